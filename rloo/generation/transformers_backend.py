"""Sampling completions with `model.generate` (the default backend)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, PreTrainedModel

from rloo.algorithm import completion_mask_after_eos
from rloo.data import pad_rows
from rloo.generation.base import Completions, GenerationBackend
from rloo.models import eval_mode
from rloo.vision import forward_media


def build_generation_config(
    args, pad_token_id: int, bos_token_id: int | None, eos_ids: list[int]
) -> GenerationConfig:
    """RLOOConfig sampling parameters -> GenerationConfig; generation_kwargs override everything."""
    settings = dict(
        max_new_tokens=args.max_completion_length,
        do_sample=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_ids,
        temperature=args.temperature,
        top_p=args.top_p,
        # 0, not None: None lets generate take the model's own top_k (Qwen2-0.5B-Instruct: 20)
        top_k=args.top_k or 0,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        cache_implementation=args.cache_implementation,
        disable_compile=True,
    )
    settings.update(args.generation_kwargs or {})
    return GenerationConfig(**settings)


def context_length(model) -> int:
    """How many positions the model takes (its text config's max_position_embeddings)."""
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    return int(config.max_position_embeddings)


class TransformersGenerator(GenerationBackend):
    """Left-pads prompts, samples, and cuts each completion after its first EOS (EOS included)."""

    def __init__(
        self,
        generation_config: GenerationConfig,
        pad_token_id: int,
        eos_ids: list[int],
        pad_to_multiple_of: int | None = None,
    ):
        self.generation_config = generation_config
        self.pad_token_id = pad_token_id
        self.eos_ids = eos_ids
        self.pad_to_multiple_of = pad_to_multiple_of

    @torch.no_grad()
    def generate(
        self,
        model: PreTrainedModel,
        prompt_ids: list[list[int]],
        num_generations: int = 1,
        step: int = 0,
        media: list[dict] | None = None,
        images: list[list] | None = None,
    ) -> list[list[int]]:
        """`media`: a VLM's other inputs per row (rloo.vision), passed to `generate`; `images`
        (the rows' images themselves, which vLLM backends take) are in them already."""
        device = next(model.parameters()).device
        input_ids, attention_mask = pad_rows(
            prompt_ids, self.pad_token_id, "left", self.pad_to_multiple_of
        )
        extra = {} if media is None else forward_media(media, attention_mask, 0, device)
        if self.generation_config.max_new_tokens is None:  # max_completion_length=None
            extra["max_new_tokens"] = context_length(model) - input_ids.size(1)
            if extra["max_new_tokens"] < 1:
                raise ValueError(
                    f"max_completion_length=None: the prompts ({input_ids.size(1)} tokens) fill "
                    f"the model's context ({context_length(model)}). Fix: shorter prompts."
                )
        with eval_mode(model):
            completions, logps = self._completions(
                model, input_ids.to(device), attention_mask.to(device), **extra
            )
        completions = completions.cpu()
        if completions.size(1) == 0:
            return [[] for _ in prompt_ids]
        mask = completion_mask_after_eos(completions, self.eos_ids)
        ids = [row[: int(length)].tolist() for row, length in zip(completions, mask.sum(dim=1))]
        if logps is None:
            return ids
        return Completions(ids, policy_logprobs=logps * mask.to(logps.device, logps.dtype))

    def _completions(
        self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, **extra
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows, new tokens) after the left-padded prompts, pad after a row's end; and the policy's
        log-probs of those tokens where this backend computes them (else None)."""
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self.generation_config,
            **extra,
        )
        return output[:, input_ids.size(1) :], None
