"""Our decode loop (rloo.engine.lean) against `model.generate`: greedy tokens identical, sampled tokens from the
same distribution (first token against the exact processed distribution, the first two jointly against
`generate`'s samples), the settings it does not implement left to `generate`, and the prompts' forward before the
decode steps (each repeated prompt once, a shared start once, length groups, oneDNN's linears). The decode step
itself: test_decode_step.py (torch) and test_decode_kernel.py (its C)."""

import collections

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from helpers import DEVICES, PROMPTS, config, with_lora
from rloo.engine.lean import Draws, MinNewTokens, sample_from
from rloo.generation import LeanGenerator, TransformersGenerator, in_process_generator
from tiny_models import tiny_causal_lm


@pytest.mark.parametrize(
    "settings",
    [
        dict(do_sample=False),
        dict(do_sample=False, repetition_penalty=1.3),
        dict(do_sample=False, min_new_tokens=6, max_new_tokens=9),
    ],
    ids=["greedy", "repetition-penalty", "min-new-tokens"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_are_generates(tokenizer, model, settings, device):
    prompts = [
        tokenizer(text)["input_ids"] for text in PROMPTS
    ]  # different lengths: left padding, positions
    generation = config(tokenizer, **settings)
    eos = [tokenizer.eos_token_id]
    ours = LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(
        model.to(device).eval(), prompts
    )
    assert ours == TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(
        model, prompts
    )
    assert all(len(row) >= settings.get("min_new_tokens", 0) for row in ours)
    assert any(row[-1] == tokenizer.eos_token_id for row in ours)  # EOS kept, nothing after it


@pytest.mark.parametrize("device", DEVICES)
def test_a_model_under_mixed_precision_decodes_through_its_autocast_forward(
    tokenizer, model, device
):
    """bf16 mixed precision (`bf16=True`: accelerate wraps the prepared model's forward in autocast, and the prompts'
    cache comes out in bf16): the loop steps with that forward, not with the step written out in the weights' dtype,
    so its greedy tokens are generate's on the same model; likewise inside an autocast context."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from rloo.engine.decode import lean_decoder

    plain = tiny_causal_lm(tokenizer).to(device)
    assert lean_decoder(plain, 4) is not None
    with torch.autocast(device, dtype=torch.bfloat16):
        assert lean_decoder(plain, 4) is None
    AcceleratorState._reset_state(
        reset_partial_state=True
    )  # (as TrainingArguments does: one state per process)
    try:
        prepared = Accelerator(mixed_precision="bf16", cpu=device == "cpu").prepare_model(
            model.to(device).eval()
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert lean_decoder(prepared, 4) is None
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    generation, eos = config(tokenizer, do_sample=False), [tokenizer.eos_token_id]
    ours = LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(prepared, prompts)
    assert ours == TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(
        prepared, prompts
    )


def _counts(generator, model, prompt, rows, seed):
    torch.manual_seed(seed)
    completions = generator.generate(model, [prompt] * rows)
    return (
        collections.Counter(row[0] for row in completions),
        collections.Counter(tuple(row[:2]) for row in completions),
    )


def _distance(counts, probabilities, rows):
    keys = set(counts) | set(probabilities)
    return 0.5 * sum(abs(counts.get(k, 0) / rows - probabilities.get(k, 0.0)) for k in keys)


@pytest.mark.parametrize(
    "eos", [[2], [5, 0, 7], [3, -1, 40]]
)  # (ids outside the vocabulary mark nothing)
def test_min_new_tokens_processor_gives_transformers_scores(eos):
    """Our MinNewTokens against transformers' MinNewTokensLengthLogitsProcessor, bit for bit, before and after the
    minimum, float32 and bfloat16, -inf / nan / -0.0 among the scores; a fresh tensor either way."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    from rloo.engine.lean import MinNewTokens

    theirs, ours = (
        kind(5, 3, torch.tensor(eos)) for kind in (MinNewTokensLengthLogitsProcessor, MinNewTokens)
    )
    for dtype in (torch.float32, torch.bfloat16):
        scores = torch.randn(4, 32).to(dtype)
        scores[0, 2], scores[1, 5], scores[2, 7] = float("-inf"), float("nan"), -0.0
        for length in (5, 6, 7, 8, 9):
            ids = torch.zeros(4, length, dtype=torch.long)
            expected, found = theirs(ids, scores), ours(ids, scores)
            assert found.dtype == expected.dtype and found.data_ptr() != scores.data_ptr()
            assert torch.equal(
                found.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            )


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_follow_generates_distribution(tokenizer, model, device):
    model.to(device).eval()
    with (
        torch.no_grad()
    ):  # sharper logits than a random tiny model's: temperature, top-k and top-p all matter
        model.lm_head.weight.mul_(
            8
        )  # (measured: leaving out any one of them moves the first token by TV >= 0.06)
    prompt, rows = tokenizer("the dog sat")["input_ids"], 20000
    generation = config(
        tokenizer,
        max_new_tokens=2,
        do_sample=True,
        temperature=0.5,
        top_k=8,
        top_p=0.9,
        repetition_penalty=1.2,
    )
    eos = [tokenizer.eos_token_id]
    ours_first, ours_pairs = _counts(
        LeanGenerator(generation, tokenizer.pad_token_id, eos), model, prompt, rows, 1
    )
    theirs_first, theirs_pairs = _counts(
        TransformersGenerator(generation, tokenizer.pad_token_id, eos), model, prompt, rows, 2
    )
    with (
        torch.no_grad()
    ):  # the first token's exact distribution: logits through generate's processors
        ids = torch.tensor([prompt], device=device)
        scores = model(ids).logits[:, -1].float()
        for processor in (
            RepetitionPenaltyLogitsProcessor(1.2),
            TemperatureLogitsWarper(0.5),
            TopKLogitsWarper(8),
            TopPLogitsWarper(0.9),
        ):
            scores = processor(ids, scores)
        exact = {i: p for i, p in enumerate(torch.softmax(scores, -1)[0].tolist()) if p > 0}
    assert len(exact) > 3  # a distribution worth testing, not one token
    assert set(ours_first) <= set(exact)  # nothing outside top-k / top-p is ever drawn
    assert _distance(ours_first, exact, rows) < 0.02 and _distance(theirs_first, exact, rows) < 0.02
    # two tokens: the second is drawn after a step on the KV cache
    theirs = {pair: count / rows for pair, count in theirs_pairs.items()}
    assert _distance(ours_pairs, theirs, rows) < 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_the_draw_replayed_as_a_cuda_graph_follows_the_processed_distribution(device):
    """Draws (on a GPU a CUDA graph per state of the processors, elsewhere the same function run as it is): many rows
    of the same logits draw tokens at softmax of the processed scores (min_new_tokens, temperature, top-k, top-p),
    EOS never while min_new_tokens holds and at its probability after; each replay draws anew; greedy picks the
    processed scores' argmax."""
    torch.manual_seed(0)
    vocab, rows, eos = 12, 40000, 3
    logits = (torch.randn(1, vocab) * 2).expand(rows, -1).contiguous().to(device)
    logits[:, eos] = logits.max() + 1  # (EOS the likeliest: banned, then drawn most)
    processors = LogitsProcessorList(
        [
            MinNewTokens(2, 2, torch.tensor([eos], device=device), device=device),
            TemperatureLogitsWarper(0.7),
            TopKLogitsWarper(6),
            TopPLogitsWarper(0.95),
        ]
    )
    draws = Draws(processors, sample=True)
    holding, done = (
        torch.zeros(rows, length, dtype=torch.long, device=device) for length in (3, 4)
    )
    first, again, after = draws(holding, logits), draws(holding, logits), draws(done, logits)
    assert not torch.equal(first, again)
    for sequences, drawn in ((holding, first), (done, after)):
        exact = torch.softmax(processors(sequences[:1], logits[:1].float()), dim=-1)[0].cpu()
        frequencies = torch.bincount(drawn.cpu(), minlength=vocab).float() / rows
        assert (frequencies - exact).abs().sum() / 2 < 0.02 and not frequencies[exact == 0].any()
    assert not first.eq(eos).any() and after.eq(eos).float().mean() > 0.25
    assert (set(draws.graphs) == {(True,), (False,)}) == (device == "cuda")
    greedy = Draws(processors, sample=False)
    assert torch.equal(greedy(holding, logits), processors(holding, logits.float()).argmax(dim=-1))


def test_inverse_cdf_draw_matches_the_probabilities_and_never_draws_zeros():
    torch.manual_seed(0)
    probabilities = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0]]).repeat(50000, 1)
    drawn = sample_from(probabilities)
    frequencies = torch.bincount(drawn, minlength=6).float() / drawn.numel()
    assert frequencies[[0, 2, 5]].sum() == 0
    assert torch.allclose(frequencies, probabilities[0], atol=0.01)
    # several blocks of 256 (the last one partial), whole blocks of zeros, zeros at the edges of the others
    weights = torch.zeros(1000)
    weights[[255, 256, 511, 700, 999]] = torch.tensor([1.0, 2.0, 3.0, 0.5, 1.5])
    weights[300:310] = 0.2
    probabilities = (weights / weights.sum()).repeat(50000, 1)
    torch.manual_seed(1)
    drawn = sample_from(probabilities)
    frequencies = torch.bincount(drawn, minlength=1000).float() / drawn.numel()
    assert frequencies[weights == 0].sum() == 0
    assert torch.allclose(frequencies, probabilities[0], atol=0.01)
    # the same token as one cumulative sum over the whole row, for the same uniform draw
    torch.manual_seed(2)
    probabilities = torch.softmax(torch.randn(64, 5000) * 3, dim=-1)
    cumulative = probabilities.double().cumsum(dim=-1)
    uniform = torch.rand(64, 1, dtype=torch.float64)
    torch.manual_seed(2)
    torch.randn(64, 5000)
    expected = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True).squeeze(1)
    assert torch.equal(sample_from(probabilities), expected)


def test_settings_it_does_not_implement_keep_generate(tokenizer, model):
    eos = [tokenizer.eos_token_id]

    def pick(**settings):
        return type(
            in_process_generator(config(tokenizer, **settings), tokenizer.pad_token_id, eos, model)
        )

    assert pick(do_sample=True, top_k=5, top_p=0.8, min_p=0.05, temperature=0.7) is LeanGenerator
    for settings in (
        dict(num_beams=2),
        dict(no_repeat_ngram_size=2),
        dict(bad_words_ids=[[5]]),
        dict(cache_implementation="static"),
        dict(typical_p=0.5, do_sample=True),
    ):
        assert pick(**settings) is TransformersGenerator, settings
    synced = in_process_generator(
        config(tokenizer), tokenizer.pad_token_id, eos, model, synced=True
    )
    assert (
        type(synced) is LeanGenerator and synced.loop.synced
    )  # ZeRO-3 layer by layer: ranks step together


def test_a_customised_generate_is_the_one_generation_goes_through(
    tmp_path, tokenizer, model, monkeypatch
):
    """On the instance, in a subclass, or patched into transformers' GenerationMixin (as TRL's tests do): the speed
    layer's loop stands aside and the trainer generates through the customised `generate`."""
    import functools

    from datasets import Dataset
    from transformers.generation.utils import GenerationMixin

    from helpers import make_args
    from rloo import RLOOTrainer

    eos = [tokenizer.eos_token_id]

    def pick():
        return type(
            in_process_generator(config(tokenizer), tokenizer.pad_token_id, eos, model, fast=True)
        )

    assert pick() is LeanGenerator
    model.generate = functools.partial(type(model).generate, model)
    assert pick() is TransformersGenerator
    del model.generate
    plain = type(model)
    model.__class__ = type(
        "Custom", (plain,), {"generate": lambda self, *a, **k: plain.generate(self, *a, **k)}
    )
    assert pick() is TransformersGenerator
    model.__class__ = plain
    calls, original = [], GenerationMixin.generate

    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    assert pick() is TransformersGenerator
    RLOOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [1.0] * len(completions),
        args=make_args(tmp_path, max_steps=1),
        train_dataset=Dataset.from_list([{"prompt": "a b"}] * 8),
        processing_class=tokenizer,
    ).train()
    assert calls  # the trainer's generation went through the patch


@pytest.mark.parametrize("device", DEVICES)
def test_policy_logprobs_kept_while_decoding_are_the_forwards(tokenizer, model, device):
    """log softmax(logits / T) of every drawn token, kept by the loop, equals a no-grad forward over the finished
    rows (rloo.logps.per_token_logps: the trainer's pi_old), whatever processors shaped the draw; 0 after a row's
    end."""
    from rloo.algorithm import completion_mask_after_eos
    from rloo.data import pad_rows
    from rloo.generation import Completions
    from rloo.logps import per_token_logps

    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS] * 2
    generation = config(tokenizer, do_sample=True, temperature=0.7, top_k=6, min_new_tokens=2)
    generator = LeanGenerator(generation, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    generator.policy_temperature = (
        0.9  # the trainer's temperature, not the sampler's warped distribution
    )
    torch.manual_seed(0)
    completions = generator.generate(model.to(device).eval(), prompts)
    assert isinstance(completions, Completions) and completions.policy_logprobs is not None
    prompt_ids, prompt_mask = (
        t.to(device) for t in pad_rows(prompts, tokenizer.pad_token_id, "left")
    )
    completion_ids = pad_rows(list(completions), tokenizer.pad_token_id, "right")[0].to(device)
    mask = completion_mask_after_eos(completion_ids, [tokenizer.eos_token_id])
    assert (
        mask.sum(dim=1) < completion_ids.size(1)
    ).any()  # some row ended early: padding after it
    with torch.no_grad():
        forward = per_token_logps(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, mask], dim=1),
            completion_ids.size(1),
            0.9,
        ).logps
    kept = completions.policy_logprobs[:, : completion_ids.size(1)]
    torch.testing.assert_close(kept, forward * mask, atol=1e-5, rtol=1e-5)
    assert (kept[mask == 0] == 0).all()
    generator.policy_temperature = None
    assert not hasattr(
        generator.generate(model, prompts), "policy_logprobs"
    )  # nothing kept unless asked


def test_decoded_logprobs_are_the_kls_pi_old_and_steps_past_every_end_are_cut(tokenizer):
    """build_rollout takes Completions.policy_logprobs for pi_old in the KL; a ZeRO-3 rank that decoded in step with
    the others past its own rows' ends hands in more columns than its completions have."""
    from types import SimpleNamespace

    from rloo.generation import Completions
    from rloo.rewards.runner import RewardRunner
    from rloo.rollout import PiOld, RolloutSettings, build_rollout

    eos = tokenizer.eos_token_id
    ids = [[5, eos], [6, 7, eos]]
    decoded = torch.tensor(
        [[-1.0, -2.0, 0.0, 0.0, 0.0], [-1.5, -0.5, -0.25, 0.0, 0.0]]
    )  # 5 steps for 3 tokens
    settings = RolloutSettings(
        num_generations=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=[eos],
        reward_weights=torch.ones(1),
        beta=0.5,
        pi_old=PiOld(False, "decoder"),
    )
    rollout = build_rollout(
        [{"prompt": "the dog"}] * 2,
        settings,
        generate=lambda prompts: Completions(ids, policy_logprobs=decoded),
        processing_class=tokenizer,
        reward_runner=RewardRunner(
            [lambda completion_ids, **kw: [float(len(c)) for c in completion_ids]], [None]
        ),
        trainer_state=None,
        logprobs=SimpleNamespace(reference=lambda ids, mask, keep: torch.zeros(ids.size(0), keep)),
    )
    # KL_i = sum_t (pi_old - pi_ref): -3.0 and -2.25; shaped = length - 0.5 KL
    assert rollout.shaped_rewards.tolist() == pytest.approx([2 + 1.5, 3 + 1.125])
    assert rollout.kl == pytest.approx((-3.0 - 2.25) / 5)


def test_repeated_prompts_are_prefilled_once_with_generates_tokens(tokenizer, model, monkeypatch):
    """Through the model's forward: where the CPU's C step takes the whole step (an AVX2 build for this model's
    head size), the prompts would go through it instead (rloo.engine.prompt_steps, tested on its own)."""
    from rloo.engine import lean

    monkeypatch.setattr(lean, "prompt_steps", lambda *args: None)
    prompts = [
        tokenizer(text)["input_ids"] for text in PROMPTS for _ in range(3)
    ]  # num_generations=3 copies each
    generation = config(tokenizer, do_sample=False)
    eos = [tokenizer.eos_token_id]
    rows_seen = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: rows_seen.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        ours = LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(
            model.eval(), prompts
        )
    finally:
        hook.remove()
    assert rows_seen[0][0] == len(PROMPTS) and all(
        shape == (len(prompts), 1) for shape in rows_seen[1:]
    )
    assert ours == TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(
        model, prompts
    )


def test_prompt_lengths_are_grouped_where_the_padding_saved_outweighs_a_forward():
    from rloo.engine.prefill import length_groups

    assert length_groups([5, 50, 5, 50, 5], 32) == [
        [0, 2, 4],
        [1, 3],
    ]  # 3 x 5 + 32 + 2 x 50 + 32 < 5 x 50 + 32
    assert length_groups([5, 50, 5, 50, 5], 200) == [[0, 1, 2, 3, 4]]  # 515 > 450
    assert length_groups([10, 11, 12]) == [[0, 1, 2]]  # padding 3 tokens: one forward
    assert length_groups([44] * 3 + [56] * 3, forward_cost=40) == [
        [0, 1, 2, 3, 4, 5]
    ]  # saves 36 < 40
    assert length_groups([44] * 3 + [56] * 3, forward_cost=30) == [[0, 1, 2], [3, 4, 5]]
    assert length_groups([7]) == [[0]]
    lengths = torch.randint(20, 2000, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    groups = length_groups(
        lengths
    )  # (more distinct lengths than the search takes: bounds among 64 of them)
    assert (
        sorted(row for group in groups for row in group) == list(range(500))
        and 1 < len(groups) <= 64
    )
    assert all(
        max(lengths[row] for row in a) < min(lengths[row] for row in b)
        for a, b in zip(groups, groups[1:])
    )


@pytest.mark.parametrize(
    "shared", ["", "you are a careful helper who answers the question below in one short line: "]
)
def test_prompts_go_through_once_for_their_shared_start_then_in_length_groups_with_one_forwards_cache_and_tokens(
    tokenizer, model, monkeypatch, shared
):
    """rloo.engine.prefill: distinct prompts of 4-5 and ~60 tokens through the model in two forwards, each padded
    to its own longest, after one forward of the first tokens they all share where they share enough; the merged
    cache equals one forward's at every unmasked position, the last positions' logits too, and greedy decoding gives
    generate's tokens (with num_generations copies as well)."""
    import os

    from transformers import DynamicCache

    from rloo.data import pad_rows
    from rloo.engine import prefill as prefill_module
    from rloo.engine.prefill import prefill
    from rloo.kv import cache_argument

    monkeypatch.setattr(
        prefill_module, "FORWARD_COST", 32
    )  # (a forward of the tiny model costs ~nothing)
    long = " ".join(["one two three four the dog sat on the mat"] * 6)
    texts = [shared + text for text in ("the dog sat", long, "red", long + " a big cat")]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    start = len(os.path.commonprefix(prompts)) if shared else 0
    assert start * (len(prompts) - 1) > 32 if shared else start == 0
    input_ids, mask = pad_rows(prompts, tokenizer.pad_token_id, "left")
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    widths = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    with torch.no_grad():
        try:
            logits, arguments, _ = prefill(model.eval(), input_ids, mask, positions, {})
        finally:
            hook.remove()
        short = max(len(prompts[0]), len(prompts[2])) - start
        assert sorted(widths) == sorted(
            [(1, start)] * bool(start) + [(2, short), (2, input_ids.size(1) - start)]
        )
        cache, name = DynamicCache(config=model.config), cache_argument(model)
        theirs = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{name: cache},
        ).logits[:, -1]
    torch.testing.assert_close(logits, theirs, atol=1e-5, rtol=1e-5)
    seen = mask.bool()[:, None, :, None]
    for ours_layer, their_layer in zip(arguments[name].layers, cache.layers):
        for mine, reference in (
            (ours_layer.keys, their_layer.keys),
            (ours_layer.values, their_layer.values),
        ):
            assert mine.shape == reference.shape
            torch.testing.assert_close(mine * seen, reference * seen, atol=1e-5, rtol=1e-5)
    generation, eos = config(tokenizer, do_sample=False), [tokenizer.eos_token_id]
    for rows in (prompts, [p for p in prompts for _ in range(2)]):
        assert LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(
            model, rows
        ) == TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(model, rows)
    # under ZeRO-3 each forward is collective (every rank must run as many): one forward, whatever the lengths
    from rloo.engine import prefill as prefill_module

    monkeypatch.setattr(prefill_module, "is_partitioned", lambda model: True)
    widths.clear()
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    with torch.no_grad():
        try:
            prefill(model, input_ids, mask, positions, {})
        finally:
            hook.remove()
    assert widths == [tuple(input_ids.shape)]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch build without oneDNN")
def test_the_prompts_forward_runs_linears_on_onednn_without_grad_or_autocast_and_gives_them_back(
    tokenizer, model, monkeypatch
):
    """rloo.engine.prefill._linears_on_onednn: inside the prompts' forward every plain fp32 Linear of the model
    (a LoRA layer's base and adapters too) runs on oneDNN's GEMM, with the model's logits; F.linear where a gradient
    is recorded or autocast is on; afterwards every module has its own forward back."""
    import torch.nn.functional as F

    from rloo.data import pad_rows
    from rloo.engine import prefill as prefill_module

    model = with_lora(model).eval()
    linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    assert len(linears) > 10
    calls = collections.Counter()

    def onednn(module, x):
        calls[module] += 1
        return torch.ops.mkldnn._linear_pointwise(x, module.weight, module.bias, "none", [], "")

    monkeypatch.setattr(prefill_module, "_onednn_linear", onednn)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    input_ids, mask = pad_rows(prompts, tokenizer.pad_token_id, "left")
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        logits, _, _ = prefill_module.prefill(model, input_ids, mask, positions, {})
        theirs = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[
            :, -1
        ]
    torch.testing.assert_close(logits, theirs, atol=1e-5, rtol=1e-5)
    assert set(calls) == set(
        linears
    )  # (every one, adapters included; none afterwards: `theirs` added no calls)
    assert not any("forward" in module.__dict__ for module in linears)
    monkeypatch.undo()
    layer, x = linears[0], torch.randn(3, linears[0].in_features)
    with prefill_module._linears_on_onednn(model, x.device):
        assert layer.forward.func is prefill_module._onednn_linear
        recorded = layer(
            x.requires_grad_()
        )  # (a gradient recorded: F.linear, whose backward exists)
        recorded.sum().backward()
        assert x.grad is not None and recorded.grad_fn is not None
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.bfloat16  # (autocast's F.linear)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert "forward" not in layer.__dict__
