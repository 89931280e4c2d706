"""Loading policy, reference and reward models and their tokenizers; per-token log-probabilities."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          PreTrainedModel, PreTrainedTokenizerBase)


def _looks_like_local_path(name: str) -> bool:
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
            or os.sep in name and os.path.exists(os.path.dirname(name) or "."))


def check_model_source(name: str, what: str = "model") -> None:
    """Fail early, naming the value, when a local model path does not exist."""
    if os.path.isdir(os.path.expanduser(name)):
        return
    if _looks_like_local_path(name) or os.path.exists(os.path.expanduser(name)):
        raise FileNotFoundError(f"{what}={name!r}: no such directory. Fix: pass a directory written by "
                                "save_pretrained, or a Hugging Face Hub model id such as 'Qwen/Qwen2-0.5B-Instruct'.")


def _from_pretrained(loader, name: str, what: str, **kwargs):
    check_model_source(name, what)
    try:
        return loader(os.path.expanduser(name), **kwargs)
    except OSError as err:
        raise OSError(f"{what}={name!r} could not be loaded: not a local model directory and not reachable on the "
                      f"Hugging Face Hub ({err}).") from err


def load_causal_lm(name: str, model_init_kwargs: dict | None, trust_remote_code: bool) -> PreTrainedModel:
    """Load a policy from an id or path; dtype defaults to float32 (spec: not the config's dtype)."""
    kwargs = dict(model_init_kwargs or {})
    kwargs.setdefault("dtype", torch.float32)
    if isinstance(kwargs["dtype"], str) and kwargs["dtype"] not in ("auto",):
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    config = _from_pretrained(AutoConfig.from_pretrained, name, "model",
                              trust_remote_code=kwargs["trust_remote_code"])
    architecture = (getattr(config, "architectures", None) or [None])[0]
    import transformers
    model_class = getattr(transformers, architecture, None) if architecture else None
    if model_class is None or not hasattr(model_class, "from_pretrained"):
        model_class = AutoModelForCausalLM
    return _from_pretrained(model_class.from_pretrained, name, "model", **kwargs)


def load_reward_model(name: str, model_init_kwargs: dict | None, trust_remote_code: bool) -> PreTrainedModel:
    kwargs = dict(model_init_kwargs or {})
    kwargs.setdefault("dtype", torch.float32)
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    return _from_pretrained(AutoModelForSequenceClassification.from_pretrained, name, "reward_funcs entry",
                            num_labels=1, **kwargs)


def load_tokenizer(name: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    return _from_pretrained(AutoTokenizer.from_pretrained, name, "processing_class source",
                            trust_remote_code=trust_remote_code)


def prepare_tokenizer(tokenizer: Any, where: str = "processing_class") -> Any:
    """Left padding, pad defaults to eos; a tokenizer with neither cannot batch prompts."""
    text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    if not isinstance(text_tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"{where} must be a tokenizer or a processor, got {type(tokenizer).__name__}")
    if text_tokenizer.pad_token is None:
        if text_tokenizer.eos_token is None:
            raise ValueError(f"{where} has neither a pad token nor an EOS token, so completions cannot be ended or "
                             "batched. Fix: set tokenizer.eos_token (e.g. tokenizer.eos_token = '</s>') or "
                             "tokenizer.pad_token before creating the trainer.")
        text_tokenizer.pad_token = text_tokenizer.eos_token
    text_tokenizer.padding_side = "left"
    return tokenizer


def text_tokenizer_of(processing_class: Any) -> PreTrainedTokenizerBase:
    return getattr(processing_class, "tokenizer", processing_class)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS plus the generation config's."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    generation_config = getattr(model, "generation_config", None)
    extra = getattr(generation_config, "eos_token_id", None)
    if isinstance(extra, int):
        extra = [extra]
    for token_id in extra or []:
        if token_id not in ids:
            ids.append(token_id)
    return ids


def create_reference_model(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen copy of the policy as it is now (the reference pi_ref)."""
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    reference.eval()
    return reference


def disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def selective_log_softmax(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per position, one row at a time to bound memory."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, token_ids.unsqueeze(-1)).squeeze(-1)
        normalizer = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - normalizer
    rows = []
    for row_logits, row_ids in zip(logits, token_ids):
        row_logps = F.log_softmax(row_logits.float(), dim=-1)
        rows.append(row_logps.gather(-1, row_ids.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logps = F.log_softmax(logits.float(), dim=-1)
        return -(logps.exp() * logps).sum(dim=-1)


def per_token_logps(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                    temperature: float, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token_t | tokens_<t) / temperature-scaled, for the last `logits_to_keep` tokens of each row."""
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1,
                    use_cache=False)
    logits = outputs.logits[:, :-1, :][:, -logits_to_keep:, :] / temperature
    targets = input_ids[:, -logits_to_keep:]
    logps = selective_log_softmax(logits, targets)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logps, entropy


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Generation runs without dropout and with the KV cache; training mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        if was_training:
            model.train()
