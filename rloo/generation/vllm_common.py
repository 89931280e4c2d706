"""What both vLLM backends (server and colocate) share: the sampling parameters taken from
RLOOConfig, the policy's weights under checkpoint names, the EOS cut, and the verified-sync check
(vLLM's log-probs of a few sampled completions against the trainer's)."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any

import torch

from rloo.logps import per_token_logps
from rloo.models import eval_mode
from rloo.primitives import is_peft_model
from rloo.zero import gathered_parameters


def sampling_of(args, suppress: list[int] = ()) -> dict:
    """vLLM sampling parameters (the names of vllm.SamplingParams and of /v1/completions) from
    RLOOConfig. `suppress`: tokens never to sample (a VLM's image placeholders, rloo.vision): a bias
    of -100 (vLLM's bound) leaves them ~e^-100 of the mass, as `suppress_tokens` leaves none."""
    sampling = {
        "max_tokens": args.max_completion_length,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k if args.top_k else -1,
        "min_p": args.min_p or 0.0,
        "repetition_penalty": args.repetition_penalty,
    }
    if args.vllm_structured_outputs_regex:
        sampling["structured_outputs"] = {"regex": args.vllm_structured_outputs_regex}
    if suppress:
        sampling["logit_bias"] = {int(token): -100.0 for token in suppress}
    sampling.update(args.generation_kwargs or {})
    return sampling


def run_lengths(rows: list) -> list[tuple[Any, int]]:
    """Consecutive identical prompts become one request with n = their count (vLLM shares the
    prefill)."""
    runs: list[tuple[Any, int]] = []
    for row in rows:
        if runs and runs[-1][0] == row:
            runs[-1] = (row, runs[-1][1] + 1)
        else:
            runs.append((row, 1))
    return runs


def sync_weights_of(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights under the names of its checkpoint (what vLLM's load_weights expects). A
    PeftModel must have its adapter merged by the caller: base-layer names are mapped back, LoRA
    tensors left out."""

    if is_peft_model(model):
        named = []
        for name, param in model.base_model.model.named_parameters():
            if "lora_" in name or ".original_module." in name:
                continue
            name = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
            named.append((name, param))
        return named
    return list(model.named_parameters())


@contextmanager
def full_weights(model: torch.nn.Module, zero3: bool):
    """The policy's full weights under checkpoint names, for a push: gathered from ZeRO-3 shards
    (every rank takes part) and, for a PeftModel, with the adapter merged (unmerged again
    afterwards)."""

    with gathered_parameters(model, zero3):
        if is_peft_model(model):
            model.merge_adapter()
        try:
            yield sync_weights_of(model)
        finally:
            if is_peft_model(model):
                model.unmerge_adapter()


def cut_at_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    for position, token in enumerate(ids):
        if token in eos_ids:
            return ids[: position + 1]
    return ids


def sync_tolerance(args, model: torch.nn.Module) -> float:
    """vllm_sync_tolerance, or its default for the policy's dtype (float32: exact up to kernel
    order; bf16: loose)."""
    if args.vllm_sync_tolerance is not None:
        return args.vllm_sync_tolerance
    return 1e-3 if next(model.parameters()).dtype == torch.float32 else 0.3


@torch.no_grad()
def max_logprob_diff(model: torch.nn.Module, samples: list[dict]) -> float:
    """The largest |trainer - vLLM| log-prob over the completion tokens of `samples` ({"prompt",
    "completion", "vllm"}, and a VLM's "media": rloo.vision). Every rank of a ZeRO-3 run must call
    it with the same number of samples (the forwards gather)."""

    device = next(model.parameters()).device
    worst = 0.0
    with eval_mode(model):
        for sample in samples:
            ids = torch.tensor([sample["prompt"] + sample["completion"]], device=device)
            media = [sample["media"]] if "media" in sample else None
            mine = per_token_logps(
                model, ids, torch.ones_like(ids), len(sample["completion"]), 1.0, media=media
            )
            difference = mine.logps[0].float().cpu() - torch.tensor(sample["vllm"])
            worst = max(worst, difference.abs().max().item())
    return worst


def judge_sync(
    worst: float, tolerance: float, on_mismatch: str, samples: int, step: int, engine: str
) -> None:
    """Stop training (or warn) when the engine generates from other weights than the policy's."""
    if worst <= tolerance:
        return
    message = (
        f"weight sync check failed: the {engine}'s log-probs differ from the trainer's by "
        f"{worst:.3g} (> vllm_sync_tolerance {tolerance:g}) on {samples} sampled completions after "
        f"the sync at step {step}: it is generating from other weights than the policy's. Check "
        "that it serves the same model and dtype (float32 for exact checks)."
    )
    if on_mismatch == "error":
        raise RuntimeError(message)
    warnings.warn(message)
