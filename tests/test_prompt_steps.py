"""The prompts' forward through the decode step's C (rloo.engine.prompt_steps): its spans of columns, and the
decoder's buffers it fills against the model's own forward."""

import functools
import shutil

import pytest
import torch

from helpers import kernel_targets, small_llama, with_lora
from rloo.engine import kernel, packing

_TARGETS = kernel_targets()


def test_spans_skip_the_padding_before_short_prompts_where_it_outweighs_a_span():
    from rloo.engine.prompt_steps import spans

    # 12 rows begin at column 0, 20 at 12: 12 x 12 + 32 x 22 + 2 < 32 x 34 + 1
    assert spans([0] * 12 + [12] * 20, 34, span_cost=16) == [(0, 12), (12, 34)]
    assert spans([0] * 12 + [12] * 20, 34, span_cost=500, most=4096) == [
        (0, 34)
    ]  # (2 x 501 > 1089)
    assert spans([0, 1, 2], 10, span_cost=16) == [(0, 10)]  # (3 padded token-rows: one span)
    # a span of 3 x 1 costs as much as reading the weights (20): 12 x 12 + 1 < 20 + 1 + 12 x 11 + 1
    assert spans([0] * 3 + [1] * 9, 12, span_cost=20) == [(0, 12)]
    assert spans([0] * 3 + [1] * 9, 12, span_cost=2) == [(0, 1), (1, 12)]  # (3 + 1 + 132 + 1 < 145)
    assert spans([5], 9) == [(5, 9)]  # (nothing before the first row's start)
    assert spans([0] * 32, 100, most=1024) == [
        (0, 25),
        (25, 50),
        (50, 75),
        (75, 100),
    ]  # (3200 token-rows: 4 parts)
    starts = torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    found = spans(starts, 300, most=512)
    assert found[0][0] == min(starts) and found[-1][1] == 300
    assert all(
        b == c for (_, b), (c, _) in zip(found, found[1:])
    )  # (contiguous: every column once)
    assert all(sum(start < b for start in starts) * (b - a) <= 512 for a, b in found)


class _NanEmpty:
    """torch for rloo.engine.prompt_steps, its `empty` filled with NaN: a buffer position read before it is
    written (or zeroed) poisons the logits."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, **options):
        return torch.full(shape, float("nan"), **options)


_START = "you are a careful helper who answers the question below in one short line: "


_CASES = [
    (target, shared, repeated, "plain")
    for target in _TARGETS
    for shared in ("", _START)
    for repeated in (False, True)
] + [("native", _START, True, "lora"), ("native", _START, False, "biases")]


@pytest.mark.parametrize(
    "target,shared,repeated,kind",
    [
        pytest.param(
            *case,
            id=f"{case[0]}-{'shared-start' if case[1] else 'no-start'}-"
            f"{'repeated' if case[2] else 'distinct'}-{case[3]}",
        )
        for case in _CASES
    ],
)
def test_prompts_through_the_c_step_fill_the_decoders_buffers_as_the_models_forward(
    tokenizer, target, shared, repeated, kind, monkeypatch
):
    """Prompts of 3 to ~60 tokens (after a start they all share, or none; a Llama with LoRA on every projection, or
    with biases on every projection, too) through the C step in spans that skip the
    long padding before the short ones (the shared start once, as one row: read by every row, or copied into each
    repeated prompt's buffers); each distinct prompt once where rows repeat one (its rows' steps read its buffers).
    The logits are the model's forward's, three decode steps after it too (grouped query heads, tied embeddings,
    every buffer position it leaves unwritten NaN first), and greedy decoding through LeanGenerator (which takes it)
    gives generate's tokens; a step that is not wholly C leaves it (None)."""
    from transformers import DynamicCache, GenerationConfig

    from rloo.data import pad_rows
    from rloo.engine import prompt_steps as module
    from rloo.engine.decode import lean_decoder
    from rloo.generation import LeanGenerator, TransformersGenerator
    from rloo.kv import cache_argument

    library = kernel.compiled(target)
    if library is None:
        assert shutil.which("gcc") is None
        pytest.skip("no gcc on this machine: the prompts keep the model's forward")
    monkeypatch.setattr(
        packing, "kernels", lambda: {"rloo": functools.partial(kernel.packed_linear, library)}
    )
    monkeypatch.setattr(module, "torch", _NanEmpty())
    spanned = []
    through = kernel.Step.prompt_tokens
    monkeypatch.setattr(
        kernel.Step,
        "prompt_tokens",
        lambda step, hidden, *rest: (
            spanned.append(tuple(hidden.shape[:2])) or through(step, hidden, *rest)
        ),
    )
    model = small_llama(tokenizer, biases=kind == "biases")
    model = (with_lora(model) if kind == "lora" else model).eval()
    long = " ".join(["one two three four the dog sat on the mat"] * 6)
    prompts = [
        tokenizer(shared + text)["input_ids"]
        for text in ("the dog sat", long, "red", long + " a big cat")
    ]
    rows = [prompt for prompt in prompts for _ in range(2)] if repeated else prompts
    input_ids, mask = pad_rows(rows, tokenizer.pad_token_id, "left")
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    prefix = module.shared_prefix(input_ids, mask, positions)
    assert (prefix * 3 > module.SPAN_COST) == bool(shared)
    with torch.no_grad():
        decoder = lean_decoder(model, len(rows))
        logits = module.prompt_steps(decoder, input_ids, mask, positions, 3)
        cache, name = DynamicCache(config=model.config), cache_argument(model)
        theirs = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{name: cache},
        ).logits[:, -1]
        torch.testing.assert_close(logits, theirs, atol=1e-5, rtol=1e-5)
        start = prefix if shared else 0
        assert decoder.offset == (input_ids.size(1) if repeated else start)
        assert (decoder.shared is not None) == (repeated or bool(shared))
        short, end = max(len(prompts[0]), len(prompts[2])) - start, input_ids.size(1) - start
        assert spanned == [(1, start)] * bool(shared) + [
            (2, end - short),
            (4, short),
        ]  # (each prompt once)
        step_positions = positions[:, -1:]
        for step in range(3):
            tokens = torch.arange(len(rows)) + 3 + step * len(rows)
            step_positions = step_positions + 1
            mine = decoder.step(tokens, step_positions)
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], 1)
            theirs = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=step_positions,
                use_cache=True,
                **{name: cache},
            ).logits[:, -1]
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
        spanned.clear()  # (spans of at most 8 token-rows: each row's prompt in several, one after the other)
        monkeypatch.setattr(module, "MOST_TOKENS", 8)
        split = module.prompt_steps(
            lean_decoder(model, len(rows)), input_ids, mask[:, :-3], positions, 3
        )
        torch.testing.assert_close(split, logits, atol=1e-5, rtol=1e-5)
        assert len(spanned) > 8 and max(rows * tokens for rows, tokens in spanned) <= 8
        spanned.clear()
        other = lean_decoder(model, len(rows))
        other.whole = None
        assert (
            module.prompt_steps(other, input_ids, mask[:, :-3], positions, 3) is None
            and spanned == []
        )
    generation = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id],
        max_new_tokens=12,
        do_sample=False,
    )
    eos = [tokenizer.eos_token_id]
    assert LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(
        model, rows
    ) == TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(model, rows)
    assert spanned and spanned[-1][0] == 4  # (the generator's prompts went through the C step)
