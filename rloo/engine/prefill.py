"""The prompts' forward of a generation call (rloo.engine.lean) by the model's forward (where the
decode step is wholly our C, rloo.engine.prompt_steps takes the prompts instead): each distinct
prompt once (the num_generations copies of a prompt share its KV cache), and on the CPU in parts:
the first tokens every prompt shares (a chat template's system turn, a shared instruction) once, and
the rest in groups of similar length, each group padded only to its own longest.

A batch's prompts are left-padded to the longest one, and a forward computes every padded position:
14-15 % of the prompts' forward for the generation benchmark's arithmetic prompts (44-58 tokens),
far more for datasets whose prompts vary more; and SmolLM2's chat template alone puts the same 24
tokens before every one of those prompts. Each part costs a forward of its own, so `_plan` weighs
the tokens a part saves against a fixed cost per forward (`FORWARD_COST`). The parts' caches are put
back into one left-padded cache (zeros at the padding, which the mask hides), so that what follows
sees the cache one forward would have made: the same keys and values at every unmasked position, up
to float rounding (a matmul's sums may run in another order for another number of rows). On a GPU a
forward's cost hardly grows with its rows, and under ZeRO-3 every forward is collective (each rank
must run as many): there the prompts go through in one forward. On the CPU the model's fp32 linear
layers run on oneDNN's GEMM rather than F.linear's (MKL's) in this forward: `_linears_on_onednn`."""

from __future__ import annotations

import bisect
import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F

from rloo.kv import (
    cache_argument,
    cache_rows_shareable,
    distinct_prompts,
    plain_cache,
    share_cache_rows,
)
from rloo.zero import is_partitioned

# a forward's fixed cost in padded tokens, for _plan: a split into groups must save more padding
# than this (measured on SmolLM2 with the generation benchmark's prompts: bench_generation.py)
FORWARD_COST = 128


def length_groups(lengths: list[int], forward_cost: int | None = None) -> list[list[int]]:
    """Row indices in groups of similar length: the grouping of the rows sorted by length whose
    padded tokens (each group's rows x its longest length) plus `forward_cost` (FORWARD_COST) per
    group are fewest (dynamic programming over the distinct lengths; over 64 of them spread by rank
    where there are more). One group where grouping saves nothing."""
    forward_cost = FORWARD_COST if forward_cost is None else forward_cost
    ordered = sorted(lengths)
    values = sorted(set(ordered))
    if len(values) > 64:  # (group bounds among 64 lengths: the search stays small for any batch)
        values = sorted({values[round(i * (len(values) - 1) / 63)] for i in range(64)})
    count = [bisect.bisect_right(ordered, value) for value in values]  # rows up to each length
    best, cut = [0.0] + [float("inf")] * len(values), [0] * (len(values) + 1)
    # rows longer than values[start - 1], up to values[end - 1]
    for end in range(1, len(values) + 1):
        for start in range(end):
            rows = count[end - 1] - (count[start - 1] if start else 0)
            cost = best[start] + rows * values[end - 1] + forward_cost
            if cost < best[end]:
                best[end], cut[end] = cost, start
    bounds, end = [], len(values)
    while end:
        bounds.append((values[cut[end] - 1] if cut[end] else -1, values[end - 1]))
        end = cut[end]
    return [
        [row for row, length in enumerate(lengths) if low < length <= high]
        for low, high in reversed(bounds)
    ]


def _left_padded(attention_mask: torch.Tensor) -> bool:
    """Every row's ones are its last columns (padding only on the left)."""
    lengths = attention_mask.sum(-1)
    columns = torch.arange(attention_mask.size(1), device=attention_mask.device)
    return bool(
        torch.equal(attention_mask.bool(), columns >= attention_mask.size(1) - lengths[:, None])
    )


def shared_prefix(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor
) -> int:
    """How many first tokens every row's prompt shares (ids and positions alike; rows
    left-padded), at most each row's length but one: every row keeps a last position of its own
    to predict from."""
    lengths = attention_mask.sum(-1)
    shortest = int(lengths.min()) - 1
    if shortest < 1:
        return 0
    columns = (input_ids.size(1) - lengths)[:, None] + torch.arange(
        shortest, device=input_ids.device
    )
    ids, places = input_ids.gather(1, columns), positions.gather(1, columns)
    same = ((ids == ids[:1]) & (places == places[:1])).all(0)
    return int(same.long().cumprod(0).sum())


def _onednn_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x) by oneDNN's GEMM (the kernel inductor's CPU linears use; the weight reordered on
    each call) where no gradient is recorded and no autocast applies (the model's own forward may
    enter one), else F.linear."""
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.dtype != torch.float32:
        return F.linear(x, module.weight, module.bias)
    return torch.ops.mkldnn._linear_pointwise(x, module.weight, module.bias, "none", [], "")


@contextlib.contextmanager
def _linears_on_onednn(model, device: torch.device):
    """Inside, every `torch.nn.Linear` of `model` (exactly that type: a LoRA layer's base and
    adapter layers, not quantized subclasses) with an fp32 weight on the CPU runs on oneDNN's GEMM
    (`_onednn_linear`); nothing changes on other devices, in a torch build without oneDNN, or under
    ZeRO-3 (whose hooks gather the weights). The same sums in another order (float rounding apart,
    as another row count's GEMM). oneDNN runs these shapes faster than MKL on the CPUs measured
    (docs/performance.md)."""

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or is_partitioned(base):
        yield
        return
    changed = [
        module
        for module in model.modules()
        if type(module) is torch.nn.Linear
        and "forward" not in module.__dict__
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
    ]
    for module in changed:
        module.forward = functools.partial(_onednn_linear, module)
    try:
        yield
    finally:
        for module in changed:
            del module.forward


def _forward(model, input_ids, attention_mask, positions, arguments: dict, cache) -> torch.Tensor:
    """The logits of each row's last position, the KV cache filled into `cache` (after what it
    holds)."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{cache_argument(model): cache},
        **arguments,
    ).logits[:, -1]


def _plan(model, input_ids, attention_mask, positions) -> tuple[Any, int, list[list[int]]] | None:
    """(the base model's config; the shared prefix's length, 0 where sharing it does not pay; the
    rows' groups by the length after it) for the prompts' forward in parts; None where one forward
    is the better (no prefix worth its own forward and one group, a GPU, padding not all on the
    left, a cache with other than plain layers) or the only way (ZeRO-3: every forward gathers the
    parameters with the other ranks, which must run as many)."""

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if (
        input_ids.device.type != "cpu"
        or input_ids.size(0) < 2
        or plain_cache(base.config) is None
        or is_partitioned(base)
        or not _left_padded(attention_mask)
    ):
        return None
    prefix = shared_prefix(input_ids, attention_mask, positions)
    # (the tokens it saves vs the prefix's own forward)
    if prefix * (input_ids.size(0) - 1) <= FORWARD_COST:
        prefix = 0
    lengths = (attention_mask.sum(-1) - prefix).tolist()
    groups = length_groups(lengths) if 0 not in lengths else [list(range(len(lengths)))]
    return None if prefix == 0 and len(groups) == 1 else (base.config, prefix, groups)


def _in_parts(
    model,
    input_ids,
    attention_mask,
    positions,
    arguments: dict,
    config: Any,
    prefix: int,
    groups: list[list[int]],
) -> tuple[torch.Tensor, Any]:
    """The prompts' forward in parts (`_plan`): their shared first `prefix` tokens once, then each
    group of rows after them, padded to the group's longest; every part's cache put back into one
    left-padded cache."""
    total, lengths = input_ids.size(1), attention_mask.sum(-1)
    columns = torch.arange(total, device=input_ids.device)
    shared = plain_cache(config) if prefix else None
    if prefix:
        first = total - int(lengths[0])
        _forward(
            model,
            input_ids[:1, first : first + prefix],
            attention_mask[:1, first : first + prefix],
            positions[:1, first : first + prefix],
            arguments,
            shared,
        )
    logits, parts = None, []
    for rows in groups:
        index = torch.tensor(rows, device=input_ids.device)
        after = lengths[index] - prefix
        width = int(after.max())
        cache = plain_cache(config)
        for number, layer in enumerate(shared.layers if prefix else ()):
            cache.update(
                layer.keys.expand(len(rows), *layer.keys.shape[1:]),
                layer.values.expand(len(rows), *layer.values.shape[1:]),
                number,
            )
        mask = (torch.arange(width, device=index.device) >= width - after[:, None]).to(
            attention_mask.dtype
        )
        found = _forward(
            model,
            input_ids[index, -width:],
            torch.cat([mask.new_ones(len(rows), prefix), mask], 1),
            positions[index, -width:],
            arguments,
            cache,
        )
        logits = found.new_empty(input_ids.size(0), found.size(-1)) if logits is None else logits
        logits[index] = found
        # each row's cache column, in the one left-padded cache: its prefix, then its tokens after
        # it
        start = total - lengths[index][:, None]
        source = torch.where(
            columns >= total - after[:, None], columns - total + prefix + width, columns - start
        )
        parts.append((index, source.clamp(min=0), columns >= start, cache))
    merged = plain_cache(config)
    for number in range(len(merged.layers)):
        layer = parts[0][3].layers[number]
        keys = layer.keys.new_empty(
            input_ids.size(0), layer.keys.size(1), total, layer.keys.size(-1)
        )
        values = layer.values.new_empty(
            input_ids.size(0), layer.values.size(1), total, layer.values.size(-1)
        )
        for index, source, seen, cache in parts:
            for into, found in (
                (keys, cache.layers[number].keys),
                (values, cache.layers[number].values),
            ):
                picked = found.gather(
                    -2, source[:, None, :, None].expand(-1, found.size(1), -1, found.size(-1))
                )
                into[index] = picked.masked_fill(~seen[:, None, :, None], 0)
        merged.update(keys, values, number)
    return logits, merged


def _through(
    model, input_ids, attention_mask, positions, arguments: dict
) -> tuple[torch.Tensor, Any]:
    """(the logits of each row's last position, the KV cache): in parts where that pays (`_plan`),
    else one forward."""
    plan = _plan(model, input_ids, attention_mask, positions)
    if plan is not None:
        return _in_parts(model, input_ids, attention_mask, positions, arguments, *plan)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    return _forward(model, input_ids, attention_mask, positions, arguments, cache), cache


def prefill(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    arguments: dict,
    keep_distinct: bool = False,
) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
    """The prompts through the model: the logits of each row's last position, `arguments` with the
    KV cache they filled under the model's cache argument, and None, or with `keep_distinct` where
    rows repeat a prompt, each row's row in a cache that holds every distinct prompt once (the
    caller copies or shares them). Rows with the same prompt go through once; without
    `keep_distinct` their cache rows are copied to each of them."""
    with _linears_on_onednn(model, input_ids.device):
        return _prefill(model, input_ids, attention_mask, positions, arguments, keep_distinct)


def _prefill(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    arguments: dict,
    keep_distinct: bool,
) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
    name = cache_argument(model)
    found = distinct_prompts(input_ids, attention_mask)
    if found is not None:
        first, inverse = found
        logits, cache = _through(
            model, input_ids[first], attention_mask[first], positions[first], arguments
        )
        if keep_distinct and cache_rows_shareable(cache):
            return logits[inverse], {name: cache, **arguments}, inverse
        if share_cache_rows(cache, inverse):
            return logits[inverse], {name: cache, **arguments}, None
    logits, cache = _through(model, input_ids, attention_mask, positions, arguments)
    return logits, {name: cache, **arguments}, None
