"""The prompts' forward of a generation call (rloo.generation.lean): each distinct prompt once (the num_generations
copies of a prompt share its KV cache), and on the CPU the prompts in groups of similar length, each group padded
only to its own longest prompt.

A batch's prompts are left-padded to the longest one, and a forward computes every padded position: 14-15 % of the
prompts' forward for the generation benchmark's arithmetic prompts (44-58 tokens), far more for datasets whose prompts
vary more. Grouping by length costs a forward per group, so `length_groups` weighs the padding a group saves against
a fixed cost per forward. The groups' caches are put back into one left-padded cache (zeros at the padding, which
the mask hides), so that what follows sees the cache one forward would have made: the same keys and values at every
unmasked position, up to float rounding (a matmul's sums may run in another order for another number of rows). On
a GPU a forward's cost hardly grows with its rows, and under ZeRO-3 every forward is collective (each rank must run
as many): there the prompts go through in one forward."""

from __future__ import annotations

import bisect
from typing import Any

import torch

from rloo.logps import cache_argument, distinct_prompts, plain_cache, share_cache_rows

# a forward's fixed cost in padded tokens, for length_groups. Measured on 2 cores (SmolLM2, the generation benchmark's
# distinct prompts): 32 rows of 44-58 tokens in two groups 1.35 -> 1.28 s; 8 rows (45-57) in two groups 0.36 -> 0.38 s,
# which this cost keeps in one.
FORWARD_COST = 128


def length_groups(lengths: list[int], forward_cost: int | None = None) -> list[list[int]]:
    """Row indices in groups of similar length: the grouping of the rows sorted by length whose padded tokens (each
    group's rows x its longest length) plus `forward_cost` (FORWARD_COST) per group are fewest (dynamic programming
    over the distinct lengths; over 64 of them spread by rank where there are more). One group where grouping saves
    nothing."""
    forward_cost = FORWARD_COST if forward_cost is None else forward_cost
    ordered = sorted(lengths)
    values = sorted(set(ordered))
    if len(values) > 64:  # (group bounds among 64 lengths: the search stays small for any batch)
        values = sorted({values[round(i * (len(values) - 1) / 63)] for i in range(64)})
    count = [bisect.bisect_right(ordered, value) for value in values]  # rows up to each length
    best, cut = [0.0] + [float("inf")] * len(values), [0] * (len(values) + 1)
    for end in range(1, len(values) + 1):  # rows longer than values[start - 1], up to values[end - 1]
        for start in range(end):
            rows = count[end - 1] - (count[start - 1] if start else 0)
            cost = best[start] + rows * values[end - 1] + forward_cost
            if cost < best[end]:
                best[end], cut[end] = cost, start
    bounds, end = [], len(values)
    while end:
        bounds.append((values[cut[end] - 1] if cut[end] else -1, values[end - 1]))
        end = cut[end]
    return [[row for row, length in enumerate(lengths) if low < length <= high] for low, high in reversed(bounds)]


def _left_padded(attention_mask: torch.Tensor) -> bool:
    """Every row's ones are its last columns (padding only on the left)."""
    lengths = attention_mask.sum(-1)
    columns = torch.arange(attention_mask.size(1), device=attention_mask.device)
    return bool(torch.equal(attention_mask.bool(), columns >= attention_mask.size(1) - lengths[:, None]))


def _forward(model, input_ids, attention_mask, positions, arguments: dict, cache) -> torch.Tensor:
    """The logits of each row's last position, the KV cache filled into `cache`."""
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                 logits_to_keep=1, **{cache_argument(model): cache}, **arguments).logits[:, -1]


def _grouped(model, input_ids, attention_mask, positions, arguments: dict) -> tuple[torch.Tensor, Any] | None:
    """The rows' forward in length_groups, their caches merged into one left-padded cache; None where one forward
    is the better (one group, a GPU, padding not all on the left, a cache with other than plain layers) or the only
    way (ZeRO-3: every forward gathers the parameters with the other ranks, which must run as many)."""
    from rloo.zero import is_partitioned
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if input_ids.device.type != "cpu" or input_ids.size(0) < 2 or plain_cache(base.config) is None or \
            is_partitioned(base) or not _left_padded(attention_mask):
        return None
    config = base.config
    lengths = attention_mask.sum(-1).tolist()
    groups = length_groups(lengths)
    if len(groups) == 1 or 0 in lengths:  # (an empty prompt: nothing to slice its group by)
        return None
    total, parts = input_ids.size(1), []
    logits = None
    for rows in groups:
        index, width = torch.tensor(rows, device=input_ids.device), max(lengths[row] for row in rows)
        cache = plain_cache(config)
        found = _forward(model, input_ids[index, -width:], attention_mask[index, -width:], positions[index, -width:],
                         arguments, cache)
        logits = found.new_empty(input_ids.size(0), found.size(-1)) if logits is None else logits
        logits[index] = found
        parts.append((index, width, cache))
    merged = plain_cache(config)
    for number in range(len(merged.layers)):
        first = parts[0][2].layers[number]
        keys = first.keys.new_zeros(input_ids.size(0), *first.keys.shape[1:-2], total, first.keys.size(-1))
        values = first.values.new_zeros(input_ids.size(0), *first.values.shape[1:-2], total, first.values.size(-1))
        for index, width, cache in parts:
            keys[index, ..., total - width:, :] = cache.layers[number].keys
            values[index, ..., total - width:, :] = cache.layers[number].values
        merged.update(keys, values, number)
    return logits, merged


def _through(model, input_ids, attention_mask, positions, arguments: dict) -> tuple[torch.Tensor, Any]:
    """(the logits of each row's last position, the KV cache): in length groups where that pays, else one forward."""
    grouped = _grouped(model, input_ids, attention_mask, positions, arguments)
    if grouped is not None:
        return grouped
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    return _forward(model, input_ids, attention_mask, positions, arguments, cache), cache


def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, arguments: dict
            ) -> tuple[torch.Tensor, dict]:
    """The prompts through the model: the logits of each row's last position, and `arguments` with the KV cache they
    filled under the model's cache argument. Rows with the same prompt go through once and share it."""
    name = cache_argument(model)
    found = distinct_prompts(input_ids, attention_mask)
    if found is not None:
        first, inverse = found
        logits, cache = _through(model, input_ids[first], attention_mask[first], positions[first], arguments)
        if share_cache_rows(cache, inverse):
            return logits[inverse], {name: cache, **arguments}
    logits, cache = _through(model, input_ids, attention_mask, positions, arguments)
    return logits, {name: cache, **arguments}
