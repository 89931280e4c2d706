"""Shared-prompt forwards: where rows repeat a prompt (the num_generations completions of one), that
prompt goes through the model once and each row's completion attends to its KV cache. The same
positions, mask and logits as one forward over the whole rows, the prompt's compute done once; with
a plain LM head, one head gradient for prompts and completions; with rloo.engine.prompt_layers, the
prompts' backward layer by layer with the completions'."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer

from rloo.engine.prompt_layers import PromptLayers
from rloo.engine.recompute import checkpointed_layers, checkpointed_or_sharded
from rloo.engine.registry import kind_of
from rloo.engine.tied import head_weight
from rloo.kv import (
    cache_argument,
    distinct_prompts,
    initialize_layer,
    layer_initialized,
    plain_cache,
)
from rloo.primitives import is_moe, is_peft_model


def can_share_prompts(model: nn.Module) -> bool:
    """A decoder-only model whose forward takes a KV cache, without a router loss (computed over the
    tokens of one forward), and not checkpointing activations with the reentrant variant (its
    forward runs without gradients, so the prompt's cache would carry none) nor with layers that
    drop any cache they are given (transformers 4.x's, which lack `_can_checkpoint_with_cache`)."""
    base = model.get_base_model() if is_peft_model(model) else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or is_moe(base):
        return False
    checkpointed = checkpointed_layers(base)
    if (
        checkpointed
        and torch.is_grad_enabled()
        and base.training
        and (
            not all(_non_reentrant(layer) for layer in checkpointed)
            or not any(hasattr(layer, "_can_checkpoint_with_cache") for layer in checkpointed)
        )
    ):
        return False
    return cache_argument(model) is not None


def kl_forwards_share_prompts(policy: nn.Module, reference: nn.Module | None) -> bool:
    """Whether the KL's old and reference forwards share prompts: both or neither (a ZeRO-3
    reference engine cannot), so that a reference equal to the policy gives a KL of exactly 0. None:
    the reference is the policy's own base or adapter."""
    return can_share_prompts(policy) and (reference is None or can_share_prompts(reference))


def _non_reentrant(layer: nn.Module) -> bool:
    function = getattr(layer, "_gradient_checkpointing_func", None)
    return getattr(function, "keywords", {}).get("use_reentrant") is False


@contextlib.contextmanager
def _checkpoints_keep_cache(model: nn.Module):
    """Checkpointed layers keep the KV cache they are given (transformers drops it, fearing a replay
    that writes it twice; the caches of shared_prompt_logits are written once and read after)."""
    layers = [
        layer
        for layer in checkpointed_layers(model)
        if hasattr(layer, "_can_checkpoint_with_cache")
    ]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


class _WrittenOnceLayer(DynamicLayer):
    """A cache layer for a forward over whole prompts (nothing before them): keeps the first keys
    and values it is given; a replay of the same forward (activation checkpointing) attends to its
    own and changes nothing."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not layer_initialized(self):
            initialize_layer(self, key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _ReadOnlyLayer(DynamicLayer):
    """The distinct prompts' cached keys and values under each row's completion: read, never
    extended. Each row's copy of its prompt's is taken in the layer's own forward, so that its
    backward (the rows' gradients summed per prompt) runs with that layer's, not after the whole
    completions' backward: the rows' key and value gradients are not held that long."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, boundary=None):
        super().__init__()
        initialize_layer(self, keys, values)
        self.keys, self.values, self.rows = keys, values, rows
        self.read, self.boundary = False, boundary

    def update(self, key_states, value_states, *args, **kwargs):
        self.read = True
        # (behind the node that runs the prompts' layer backward with this one's:
        # rloo.engine.prompt_layers)
        keys, values = (
            self.boundary(self.keys, self.values) if self.boundary else (self.keys, self.values)
        )
        return torch.cat([keys[self.rows], key_states], dim=-2), torch.cat(
            [values[self.rows], value_states], dim=-2
        )


def shared_prompt_logits(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
) -> tuple[torch.Tensor, Any] | None:
    """(logits predicting the last `logits_to_keep` tokens of each row, the completions' model
    outputs), with each distinct prompt through the model once; None where no two rows share a
    prompt or the cache cannot be shared. Positions are those of one forward over the whole rows
    (0.. from the first column, padding included)."""
    prompt_length = input_ids.size(1) - logits_to_keep
    base = model.get_base_model() if is_peft_model(model) else model
    found = (
        distinct_prompts(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
        if prompt_length > 0
        else None
    )
    cache = plain_cache(base.config, _WrittenOnceLayer) if found is not None else None
    if cache is None:
        return None
    first, inverse = found
    name = cache_argument(model)
    # (use_cache only creates a cache where none is given; checkpointed layers warn about it, and
    # keep ours)
    use_cache = not (checkpointed_layers(base) and base.training and torch.is_grad_enabled())
    # Where the model's forward is lm_head(decoder(...)), the decoder runs on the prompts and on the
    # completions and the head on both in one autograd node (_HeadOverParts): the same logits, but
    # one head gradient (vocabulary x hidden) instead of one per forward plus their sum.
    plain = (
        kind_of(base) == "causal_lm"
        and "forward" not in base.__dict__
        and not _prompt_learning(model)
    )
    # (not past a forward wrapped by hooks: accelerate's device alignment)
    decoder = base.model if plain else None
    forward = model if decoder is None else decoder
    # The prompts' backward layer by layer with the completions' (not with activation
    # checkpointing's replays, nor ZeRO-3's gathering hooks).
    segments = (
        PromptLayers(decoder)
        if logits_to_keep > 1
        and PromptLayers.applies(decoder)
        and not checkpointed_or_sharded(base)
        else None
    )
    with _checkpoints_keep_cache(base):
        with segments.cut() if segments else contextlib.nullcontext():
            prompts = forward(
                input_ids=input_ids[first, :prompt_length],
                attention_mask=attention_mask[first, :prompt_length],
                use_cache=use_cache,
                **({"logits_to_keep": 1} if decoder is None else {}),
                **{name: cache},
            )
        if not all(layer_initialized(layer) for layer in cache.layers):
            return None  # a forward that ignored the cache given
        # What predicts each row's first completion token (the decoder's: one per distinct prompt).
        last_prompt = (
            prompts.logits[inverse] if decoder is None else prompts.last_hidden_state[:, -1:]
        )
        if logits_to_keep == 1:
            return (last_prompt if decoder is None else base.lm_head(last_prompt)[inverse]), prompts
        if segments and not segments.segments_found(
            [(layer.keys, layer.values) for layer in cache.layers], last_prompt
        ):
            return None  # a layer reaching past its own input and parameters: whole rows
        # A cache of its own: a replay of the prompts' forward in backward still finds theirs.
        rows_cache = plain_cache(base.config)
        rows_cache.layers = [
            _ReadOnlyLayer(
                layer.keys,
                layer.values,
                inverse,
                functools.partial(segments.boundary, index) if segments else None,
            )
            for index, layer in enumerate(cache.layers)
        ]
        # The completions but their last token (nothing after it is scored), attending to their
        # prompt's cache.
        completions = forward(
            input_ids=input_ids[:, prompt_length:-1],
            attention_mask=attention_mask[:, :-1],
            use_cache=use_cache,
            **{name: rows_cache},
        )
        if not all(layer.read for layer in rows_cache.layers):
            return None
    if decoder is None:
        return torch.cat([last_prompt, completions.logits], dim=1), completions
    if segments:
        (last_prompt,) = segments.boundary(len(cache.layers), last_prompt)
    prompt_logits, completion_logits = _head_over_parts(
        base.lm_head, last_prompt, completions.last_hidden_state
    )
    return torch.cat([prompt_logits[inverse], completion_logits], dim=1), completions


class _HeadOverParts(torch.autograd.Function):
    """(first, second) -> (F.linear(first, weight, bias), F.linear(second, weight, bias)): each
    part's logits its own product, as the model's forward over that part alone makes them; the
    weight's gradient one vocabulary x hidden product (the first part's added into the second's in
    place) instead of one per part and their sum."""

    @staticmethod
    def forward(ctx, weight, bias, first, second):
        ctx.save_for_backward(weight, first, second)
        ctx.with_bias = bias is not None
        return F.linear(first, weight, bias), F.linear(second, weight, bias)

    @staticmethod
    def backward(ctx, grad_first, grad_second):
        weight, first, second = ctx.saved_tensors
        parts = [
            (grad, x)
            for grad, x in ((grad_second, second), (grad_first, first))
            if grad is not None
        ]
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            for grad, x in parts:
                grad, x = grad.reshape(-1, grad.size(-1)), x.reshape(-1, x.size(-1))
                grad_weight = (
                    grad.t().mm(x) if grad_weight is None else grad_weight.addmm_(grad.t(), x)
                )
        if ctx.with_bias and ctx.needs_input_grad[1]:
            grad_bias = sum(grad.reshape(-1, grad.size(-1)).sum(0) for grad, _ in parts)
        inputs = [
            None if grad is None or not needed else grad.matmul(weight)
            for grad, needed in (
                (grad_first, ctx.needs_input_grad[2]),
                (grad_second, ctx.needs_input_grad[3]),
            )
        ]
        return grad_weight, grad_bias, *inputs


def _head_over_parts(
    head: nn.Module, first: torch.Tensor, second: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(head(first), head(second)), the weight's gradient made once where the head is a plain
    product (_HeadOverParts)."""
    weight = head_weight(head)
    if weight is None or not torch.is_grad_enabled():
        return head(first), head(second)
    return _HeadOverParts.apply(weight, head.bias, first, second)


def _prompt_learning(model: nn.Module) -> bool:
    """A peft model whose own forward changes the inputs (prompt tuning and its kin): its base's
    decoder alone is not the model."""
    config = getattr(model, "active_peft_config", None)
    return bool(getattr(config, "is_prompt_learning", False))
