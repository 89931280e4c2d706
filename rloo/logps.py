"""Per-token log-probabilities of completions under a model: one forward over whole rows, or, where rows repeat a
prompt (the num_generations completions of one), that prompt through the model once and each row's completion
attending to its KV cache (shared_prompt_logits)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer

from rloo.models import is_moe, is_peft_model
from rloo.prompt_layers import PromptLayers
from rloo.recompute import checkpointed_layers, checkpointed_or_sharded, llama_kind
from rloo.tied import head_weight


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
    """Entropy per position, one row at a time to bound memory (three vocabulary-wide temporaries per row)."""
    with torch.no_grad():
        rows = []
        for row in logits:
            logps = F.log_softmax(row.float(), dim=-1)
            rows.append(-(logps.exp() * logps).sum(dim=-1))
        return torch.stack(rows) if rows else logits.new_zeros(logits.shape[:-1])


class TokenLogps(NamedTuple):
    logps: torch.Tensor
    entropy: torch.Tensor | None
    aux_loss: torch.Tensor | None  # Mixture-of-Experts load-balancing loss, when the model returns it


def per_token_logps(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                    temperature: float, with_entropy: bool = False, share_prompts: bool = True) -> TokenLogps:
    """log pi(token_t | tokens_<t) / temperature-scaled, for the last `logits_to_keep` tokens of each row.

    With `share_prompts`, rows whose prompt (every token before the last `logits_to_keep`, padding included) is the
    same, e.g. the num_generations completions of one prompt, run that prompt through the model once: its KV cache
    is copied to each of its rows and only the completions go through the model per row (`shared_prompt_logits`).
    The same positions, mask and logits as one forward over the whole rows; the prompt's compute is done once."""
    outputs, logits = None, None
    if share_prompts and logits_to_keep > 0 and can_share_prompts(model):
        found = shared_prompt_logits(model, input_ids, attention_mask, logits_to_keep)
        if found is not None:
            logits, outputs = found
    if logits is None:
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1,
                        use_cache=False)
        logits = outputs.logits[:, :-1, :][:, -logits_to_keep:, :]
    if temperature != 1.0:  # (x / 1.0 is x: no vocabulary-wide copy)
        logits = logits / temperature
    targets = input_ids[:, -logits_to_keep:]
    logps = selective_log_softmax(logits, targets)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return TokenLogps(logps, entropy, getattr(outputs, "aux_loss", None))


def can_share_prompts(model: nn.Module) -> bool:
    """A decoder-only model whose forward takes a KV cache, without a router loss
    (computed over the tokens of one forward), and not checkpointing activations with the reentrant variant (its
    forward runs without gradients, so the prompt's cache would carry none)."""
    base = model.get_base_model() if is_peft_model(model) else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or is_moe(base):
        return False
    checkpointed = checkpointed_layers(base)
    if checkpointed and torch.is_grad_enabled() and base.training and not all(
            _non_reentrant(layer) for layer in checkpointed):
        return False
    return cache_argument(model) is not None


def kl_forwards_share_prompts(policy: nn.Module, reference: nn.Module | None) -> bool:
    """Whether the KL's old and reference forwards share prompts: both or neither (a ZeRO-3 reference engine
    cannot), so that a reference equal to the policy gives a KL of exactly 0. None: the reference is the policy's
    own base or adapter."""
    return can_share_prompts(policy) and (reference is None or can_share_prompts(reference))


def _non_reentrant(layer: nn.Module) -> bool:
    function = getattr(layer, "_gradient_checkpointing_func", None)
    return getattr(function, "keywords", {}).get("use_reentrant") is False


@contextlib.contextmanager
def _checkpoints_keep_cache(model: nn.Module):
    """Checkpointed layers keep the KV cache they are given (transformers drops it, fearing a replay that writes it
    twice; the caches of shared_prompt_logits are written once and read after)."""
    layers = [layer for layer in checkpointed_layers(model) if hasattr(layer, "_can_checkpoint_with_cache")]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


class _WrittenOnceLayer(DynamicLayer):
    """A cache layer for a forward over whole prompts (nothing before them): keeps the first keys and values it is
    given; a replay of the same forward (activation checkpointing) attends to its own and changes nothing."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _ReadOnlyLayer(DynamicLayer):
    """The distinct prompts' cached keys and values under each row's completion: read, never extended. Each row's
    copy of its prompt's is taken in the layer's own forward, so that its backward (the rows' gradients summed per
    prompt) runs with that layer's, not after the whole completions' backward: the rows' key and value gradients
    are not held that long (measured: 30 MiB of the SmolLM2 benchmark's peak)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, boundary=None):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.rows, self.read, self.boundary = keys, values, rows, False, boundary

    def update(self, key_states, value_states, *args, **kwargs):
        self.read = True
        # (behind the node that runs the prompts' layer backward with this one's: rloo.prompt_layers)
        keys, values = self.boundary(self.keys, self.values) if self.boundary else (self.keys, self.values)
        return torch.cat([keys[self.rows], key_states], dim=-2), torch.cat([values[self.rows], value_states], dim=-2)


def cache_argument(model: nn.Module) -> str | None:
    """The forward's name for the KV cache (`cache` in recent transformers, `past_key_values` before), or None."""
    import inspect
    base = model.get_base_model() if is_peft_model(model) else model
    names = set(inspect.signature(base.forward).parameters)
    return next((name for name in ("cache", "past_key_values") if name in names), None)


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(one row index per distinct prompt, row -> its distinct prompt's position) where rows repeat a prompt (ids
    and mask alike); None when every row's prompt is its own."""
    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    count = int(inverse.max().item()) + 1 if inverse.numel() else 0
    if count == keys.size(0):
        return None
    first = torch.full((count,), keys.size(0), dtype=torch.long, device=keys.device)
    first.scatter_reduce_(0, inverse, torch.arange(keys.size(0), device=keys.device), reduce="amin")
    return first, inverse


def plain_cache(config: Any, layer_type: type = DynamicLayer) -> Any:
    """A DynamicCache whose layers are all `layer_type`; None where the model's cache needs other kinds of layer
    (sliding windows, linear attention, ...)."""
    from transformers import DynamicCache
    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    cache.layers = [layer_type() for _ in layers]
    return cache


def cache_rows_shareable(cache: Any) -> bool:
    """The cache's rows can be copied to other rows (`share_cache_rows`): plain layers, none sliding."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(isinstance(layer, DynamicLayer) and not layer.is_sliding for layer in layers)


def share_cache_rows(cache: Any, rows: torch.Tensor) -> bool:
    """Copy the cache of each distinct prompt to its rows (in place); False for cache kinds that cannot."""
    if not cache_rows_shareable(cache):
        return False
    cache.batch_select_indices(rows)
    return True


def shared_prompt_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         logits_to_keep: int) -> tuple[torch.Tensor, Any] | None:
    """(logits predicting the last `logits_to_keep` tokens of each row, the completions' model outputs), with each
    distinct prompt through the model once; None where no two rows share a prompt or the cache cannot be shared.
    Positions are those of one forward over the whole rows (0.. from the first column, padding included)."""
    prompt_length = input_ids.size(1) - logits_to_keep
    base = model.get_base_model() if is_peft_model(model) else model
    found = distinct_prompts(input_ids[:, :prompt_length], attention_mask[:, :prompt_length]) \
        if prompt_length > 0 else None
    cache = plain_cache(base.config, _WrittenOnceLayer) if found is not None else None
    if cache is None:
        return None
    first, inverse = found
    name = cache_argument(model)
    # (use_cache only creates a cache where none is given; checkpointed layers warn about it, and keep ours)
    use_cache = not (checkpointed_layers(base) and base.training and torch.is_grad_enabled())
    # Where the model's forward is lm_head(decoder(...)), the decoder runs on the prompts and on the completions and
    # the head on both in one autograd node (_HeadOverParts): the same logits, but one head gradient (vocabulary x
    # hidden) instead of one per forward plus their sum.
    plain = llama_kind(type(base)) == "causal_lm" and "forward" not in base.__dict__ and not _prompt_learning(model)
    decoder = base.model if plain else None  # (not past a forward wrapped by hooks: accelerate's device alignment)
    forward = model if decoder is None else decoder
    # The prompts' backward layer by layer with the completions' (not with activation checkpointing's replays, nor
    # ZeRO-3's gathering hooks).
    segments = PromptLayers(decoder) if logits_to_keep > 1 and PromptLayers.applies(decoder) and \
        not checkpointed_or_sharded(base) else None
    with _checkpoints_keep_cache(base):
        with segments.cut() if segments else contextlib.nullcontext():
            prompts = forward(input_ids=input_ids[first, :prompt_length],
                              attention_mask=attention_mask[first, :prompt_length], use_cache=use_cache,
                              **({"logits_to_keep": 1} if decoder is None else {}), **{name: cache})
        if not all(layer.is_initialized for layer in cache.layers):
            return None  # a forward that ignored the cache given
        # What predicts each row's first completion token (the decoder's: one per distinct prompt).
        last_prompt = prompts.logits[inverse] if decoder is None else prompts.last_hidden_state[:, -1:]
        if logits_to_keep == 1:
            return (last_prompt if decoder is None else base.lm_head(last_prompt)[inverse]), prompts
        if segments and not segments.segments_found([(layer.keys, layer.values) for layer in cache.layers],
                                                    last_prompt):
            return None  # a layer reaching past its own input and parameters: whole rows
        # A cache of its own: a replay of the prompts' forward in backward still finds theirs.
        rows_cache = plain_cache(base.config)
        rows_cache.layers = [
            _ReadOnlyLayer(layer.keys, layer.values, inverse,
                           functools.partial(segments.boundary, index) if segments else None)
            for index, layer in enumerate(cache.layers)]
        # The completions but their last token (nothing after it is scored), attending to their prompt's cache.
        completions = forward(input_ids=input_ids[:, prompt_length:-1], attention_mask=attention_mask[:, :-1],
                              use_cache=use_cache, **{name: rows_cache})
        if not all(layer.read for layer in rows_cache.layers):
            return None
    if decoder is None:
        return torch.cat([last_prompt, completions.logits], dim=1), completions
    if segments:
        last_prompt, = segments.boundary(len(cache.layers), last_prompt)
    prompt_logits, completion_logits = _head_over_parts(base.lm_head, last_prompt, completions.last_hidden_state)
    return torch.cat([prompt_logits[inverse], completion_logits], dim=1), completions


class _HeadOverParts(torch.autograd.Function):
    """(first, second) -> (F.linear(first, weight, bias), F.linear(second, weight, bias)): each part's logits its own
    product, as the model's forward over that part alone makes them; the weight's gradient one vocabulary x hidden
    product (the first part's added into the second's in place) instead of one per part and their sum."""

    @staticmethod
    def forward(ctx, weight, bias, first, second):
        ctx.save_for_backward(weight, first, second)
        ctx.with_bias = bias is not None
        return F.linear(first, weight, bias), F.linear(second, weight, bias)

    @staticmethod
    def backward(ctx, grad_first, grad_second):
        weight, first, second = ctx.saved_tensors
        parts = [(grad, x) for grad, x in ((grad_second, second), (grad_first, first)) if grad is not None]
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            for grad, x in parts:
                grad, x = grad.reshape(-1, grad.size(-1)), x.reshape(-1, x.size(-1))
                grad_weight = grad.t().mm(x) if grad_weight is None else grad_weight.addmm_(grad.t(), x)
        if ctx.with_bias and ctx.needs_input_grad[1]:
            grad_bias = sum(grad.reshape(-1, grad.size(-1)).sum(0) for grad, _ in parts)
        inputs = [None if grad is None or not needed else grad.matmul(weight)
                  for grad, needed in ((grad_first, ctx.needs_input_grad[2]), (grad_second, ctx.needs_input_grad[3]))]
        return grad_weight, grad_bias, *inputs


def _head_over_parts(head: nn.Module, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(head(first), head(second)), the weight's gradient made once where the head is a plain product
    (_HeadOverParts)."""
    weight = head_weight(head)
    if weight is None or not torch.is_grad_enabled():
        return head(first), head(second)
    return _HeadOverParts.apply(weight, head.bias, first, second)


def _prompt_learning(model: nn.Module) -> bool:
    """A peft model whose own forward changes the inputs (prompt tuning and its kin): its base's decoder alone is not
    the model."""
    config = getattr(model, "active_peft_config", None)
    return bool(getattr(config, "is_prompt_learning", False))
