"""The prompts' forward of a generation call through the decode step's C (kernel.Step.prompt_tokens)
instead of the model's forward, where every row has a prompt of its own: several tokens of every row
at once, their keys and values written straight into the decoder's buffers.

The rows stay left-padded: a row's prompt ends at the last prompt column of its buffers. The columns
go through in spans (`spans`), each over the rows whose prompt has begun by its end, so that rows
with short prompts do not compute the padding before them, padded only inside a span; a token at a
padded column attends to nothing and its key and value are masked (zeroed first where no span writes
them). The first tokens every prompt shares (a chat template's system turn) go through once, as one
row, into buffers that the decode step's attention reads for every row (kernel.Shared, every row of
prompt 0). Only the last span's last tokens go through the LM head. The same operations on the same
values as the model's forward, as the decode step computes them (float rounding apart).

Against the model's forward in groups (rloo.engine.prefill) it saves the per-module dispatch, the
elementwise operations as separate passes, the cache's concatenation and the copy into the decoder's
buffers. Rows that repeat a prompt keep that forward: there each distinct prompt goes through once
and its rows read its one cache."""

from __future__ import annotations

import bisect

import torch

from rloo.engine import kernel as kernel_module
from rloo.engine.prefill import _left_padded, shared_prefix
from rloo.kv import distinct_prompts

# the least a span costs, in token-rows (rows x tokens), for `spans`: every span reads all the
# weights, which takes as long as computing about this many token-rows (measured on SmolLM2)
SPAN_COST = 20
# token-rows a span computes at most (its scratch: ~ 4 x (width + 3 intermediate) bytes each)
MOST_TOKENS = 1024


def spans(
    starts: list[int], end: int, span_cost: int | None = None, most: int | None = None
) -> list[tuple[int, int]]:
    """Column spans [a, b) from the first row's start to `end` covering every row's prompt columns
    [start, end): where each span computes the rows begun by its end (start < b) over its columns,
    the spans whose costs (each span's token-rows, at least `span_cost`, plus one) add up least
    (dynamic programming over the distinct starts); spans of more than `most` token-rows split into
    equal parts (defaults: SPAN_COST, MOST_TOKENS)."""
    span_cost = SPAN_COST if span_cost is None else span_cost
    most = MOST_TOKENS if most is None else most
    ordered = sorted(starts)
    bounds = sorted(set(ordered)) + [end]
    best, cut = [0.0] + [float("inf")] * (len(bounds) - 1), [0] * len(bounds)
    for b in range(1, len(bounds)):
        for a in range(b):
            rows = bisect.bisect_left(ordered, bounds[b])
            cost = best[a] + max(rows * (bounds[b] - bounds[a]), span_cost) + 1
            if cost < best[b]:
                best[b], cut[b] = cost, a
    found, b = [], len(bounds) - 1
    while b:
        found.append((bounds[cut[b]], bounds[b]))
        b = cut[b]
    split = []
    for a, b in reversed(found):
        rows = bisect.bisect_left(ordered, b)
        parts = -(-rows * (b - a) // most)
        edges = [a + round(i * (b - a) / parts) for i in range(parts + 1)]
        split.extend((x, y) for x, y in zip(edges, edges[1:]) if y > x)
    return split


def _fill(
    decoder,
    ids: torch.Tensor,
    positions: torch.Tensor,
    starts: list[int],
    mask: torch.Tensor,
    head: bool = True,
) -> torch.Tensor | None:
    """Rows' prompt tokens through the whole step into the buffers it was started on (each layer's:
    rows x kv heads x columns x head size, after shared positions where given), ids / positions
    (rows, columns) at the buffers' columns, row r's prompt from column starts[r] to the last of
    `ids`; `mask` (rows, ..., shared + buffer columns) 0 at the prompts' columns -> the logits of
    each row's last token (with `head`)."""
    whole, rows, end = decoder.whole, ids.size(0), ids.size(1)
    found, logits = spans(starts, end), None
    for number, (a, b) in enumerate(found):
        begun = [row for row, start in enumerate(starts) if start < b]
        row_of = None if len(begun) == rows else torch.tensor(begun, dtype=torch.int32)
        index = torch.tensor(begun)
        hidden = decoder.inner.embed_tokens(ids[index, a:b])
        cos, sin = decoder.inner.rotary_emb(hidden, position_ids=positions[index, a:b])
        logits = whole.prompt_tokens(
            hidden, cos, sin, mask, a, row_of, head and number == len(found) - 1
        )
    return logits


def _buffers(
    rows: int, decoder, columns: int, zeroed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's keys and values buffers (rows x kv heads x columns x head size), the first
    `zeroed` columns 0 (no span writes a row's columns before its prompt: masked, and finite)."""
    found = [
        torch.empty(rows, decoder.kv_heads, columns, decoder.head_dim)
        for _ in range(2 * len(decoder.layers))
    ]
    for buffer in found:
        buffer[:, :, :zeroed].zero_()
    return found[: len(decoder.layers)], found[len(decoder.layers) :]


def prompt_steps(
    decoder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    new_tokens: int,
) -> torch.Tensor | None:
    """The prompts (left-padded rows) through `decoder`'s C step into buffers it decodes on, with
    room for `new_tokens` after them (as after LeanDecoder.start): the logits of each row's last
    position; None where this does not apply (the decoder's step not wholly C, not fp32 on the CPU,
    padding not all on the left, an empty prompt) and nothing was done. Rows repeating a prompt:
    each distinct prompt goes through once into buffers that all of its rows' decode steps read
    (kernel.Shared), each row's own buffers holding only its new tokens."""
    if (
        decoder.whole is None
        or input_ids.device.type != "cpu"
        or input_ids.size(0) != decoder.rows
        or decoder.inner.embed_tokens.weight.dtype != torch.float32
        or not _left_padded(attention_mask)
        or not bool(attention_mask.any(-1).all())
    ):
        return None
    rows, width = input_ids.shape
    found = distinct_prompts(input_ids, attention_mask)
    first, inverse = found if found is not None else (torch.arange(rows), None)
    ids, mask, places = input_ids[first], attention_mask[first], positions[first]
    prefix = shared_prefix(ids, mask, places)
    if prefix * (ids.size(0) - 1) <= SPAN_COST:  # (the token-rows it saves vs its own span)
        prefix = 0
    lengths = mask.sum(-1)
    common = None
    if prefix:  # their shared first tokens' keys and values, once, as one row
        start = width - int(lengths[0])
        common = _buffers(1, decoder, prefix, 0)
        decoder.whole.start(*common, 1)
        _fill(
            decoder,
            ids[:1, start : start + prefix],
            places[:1, start : start + prefix],
            [0],
            torch.zeros(1, prefix),
            head=False,
        )
    # rows' own buffers: their prompts after the prefix (read from `common`), then new tokens
    if inverse is None:
        end = width - prefix
        keys, values = _buffers(rows, decoder, end + new_tokens, end)
        scores_mask = torch.full((rows, 1, 1, width + new_tokens), float("-inf"))
        scores_mask[:, 0, 0, :prefix] = 0.0
        scores_mask[:, 0, 0, prefix:width].masked_fill_(attention_mask[:, :end].bool(), 0.0)
        every_row = torch.zeros(rows, dtype=torch.int32)
        shared = (
            None
            if common is None
            else [kernel_module.Shared(k, v, every_row) for k, v in zip(*common)]
        )
        # (the whole step started on them)
        decoder.begin(keys, values, scores_mask, width, prefix, shared)
        return _fill(
            decoder,
            ids[:, prefix:],
            places[:, prefix:],
            (end - (lengths - prefix)).tolist(),
            scores_mask,
        )
    # each distinct prompt's buffers (its prefix copied in), read by its rows' steps
    prompt_keys, prompt_values = _buffers(ids.size(0), decoder, width, width)
    starts = (width - lengths).tolist()
    if prefix:
        for buffers, copied in ((prompt_keys, common[0]), (prompt_values, common[1])):
            for buffer, source in zip(buffers, copied):
                for prompt, start in enumerate(starts):
                    buffer[prompt, :, start : start + prefix] = source[0]
    prompts_mask = torch.zeros(ids.size(0), width).masked_fill_(~mask.bool(), float("-inf"))
    decoder.whole.start(prompt_keys, prompt_values, ids.size(0))
    logits = _fill(decoder, ids, places, [start + prefix for start in starts], prompts_mask)
    keys, values = _buffers(rows, decoder, new_tokens, 0)
    scores_mask = torch.full((rows, 1, 1, width + new_tokens), float("-inf"))
    scores_mask[:, 0, 0, :width].masked_fill_(attention_mask.bool(), 0.0)
    prompt = inverse.to(torch.int32).contiguous()
    decoder.begin(
        keys,
        values,
        scores_mask,
        width,
        width,
        [kernel_module.Shared(k, v, prompt) for k, v in zip(prompt_keys, prompt_values)],
    )
    return logits[inverse]
