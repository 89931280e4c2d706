"""KV-cache helpers for rows that share a prompt (the num_generations completions of one): finding
the distinct prompts, making plain caches, copying a prompt's cache to its rows. Below both the
log-probs (rloo.logps) and the speed layer (rloo.engine), which use them alike."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from rloo.primitives import is_peft_model


def cache_argument(model: nn.Module) -> str | None:
    """The forward's name for the KV cache (`cache` in recent transformers, `past_key_values`
    before), or None."""
    base = model.get_base_model() if is_peft_model(model) else model
    names = set(inspect.signature(base.forward).parameters)
    return next((name for name in ("cache", "past_key_values") if name in names), None)


def layer_initialized(layer: Any) -> bool:
    """The cache layer holds keys and values (transformers 5 says so; 4.x layers start as None)."""
    initialized = getattr(layer, "is_initialized", None)
    return layer.keys is not None if initialized is None else bool(initialized)


def initialize_layer(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A cache layer's own lazy initialization from its first keys and values (transformers 4.x
    takes the keys only)."""
    if _INITIALIZES_FROM_KEYS_ONLY:
        layer.lazy_initialization(keys)
    else:
        layer.lazy_initialization(keys, values)


_INITIALIZES_FROM_KEYS_ONLY = (
    len(inspect.signature(DynamicLayer.lazy_initialization).parameters) == 2
)


def distinct_prompts(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(one row index per distinct prompt, row -> its distinct prompt's position) where rows repeat
    a prompt (ids and mask alike); None when every row's prompt is its own."""
    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    count = int(inverse.max().item()) + 1 if inverse.numel() else 0
    if count == keys.size(0):
        return None
    first = torch.full((count,), keys.size(0), dtype=torch.long, device=keys.device)
    first.scatter_reduce_(0, inverse, torch.arange(keys.size(0), device=keys.device), reduce="amin")
    return first, inverse


def plain_cache(config: Any, layer_type: type = DynamicLayer) -> Any:
    """A DynamicCache whose layers are all `layer_type`; None where the model's cache needs other
    kinds of layer (sliding windows, linear attention, ...)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    cache.layers = [layer_type() for _ in layers]
    return cache


def cache_rows_shareable(cache: Any) -> bool:
    """The cache's rows can be copied to other rows (`share_cache_rows`): plain layers, none
    sliding."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(
        isinstance(layer, DynamicLayer) and not layer.is_sliding for layer in layers
    )


def share_cache_rows(cache: Any, rows: torch.Tensor) -> bool:
    """Copy the cache of each distinct prompt to its rows (in place); False for cache kinds that
    cannot."""
    if not cache_rows_shareable(cache):
        return False
    cache.batch_select_indices(rows)
    return True
