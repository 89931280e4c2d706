"""Our decode loop (rloo.generation.lean) against `model.generate`: greedy tokens identical, sampled tokens from the
same distribution (first token against the exact processed distribution, the first two jointly against
`generate`'s samples), and the settings it does not implement left to `generate`."""

import collections
import functools
import shutil

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from rloo.generation import LeanGenerator, TransformersGenerator, in_process_generator
from rloo.generation import kernel
from rloo.generation.decode import _kernels
from rloo.generation.lean import Draws, MinNewTokens, sample_from
from rloo.testing import tiny_causal_lm

from helpers import DEVICES, small_llama, with_lora

PROMPTS = ["the dog sat", "one two three four", "red", "a big cat on the mat"]


def config(tokenizer, **settings):
    return GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=[tokenizer.eos_token_id],
                            **{"max_new_tokens": 12, **settings})


@pytest.mark.parametrize("settings", [dict(do_sample=False), dict(do_sample=False, repetition_penalty=1.3),
                                      dict(do_sample=False, min_new_tokens=6, max_new_tokens=9)],
                         ids=["greedy", "repetition-penalty", "min-new-tokens"])
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_are_generates(tokenizer, model, settings, device):
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]  # different lengths: left padding, positions
    generation = config(tokenizer, **settings)
    eos = [tokenizer.eos_token_id]
    ours = LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(model.to(device).eval(), prompts)
    assert ours == TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(model, prompts)
    assert all(len(row) >= settings.get("min_new_tokens", 0) for row in ours)
    assert any(row[-1] == tokenizer.eos_token_id for row in ours)  # EOS kept, nothing after it


@pytest.mark.parametrize("device", DEVICES)
def test_a_model_under_mixed_precision_decodes_through_its_autocast_forward(tokenizer, model, device):
    """bf16 mixed precision (`bf16=True`: accelerate wraps the prepared model's forward in autocast, and the prompts'
    cache comes out in bf16): the loop steps with that forward, not with the step written out in the weights' dtype,
    so its greedy tokens are generate's on the same model; likewise inside an autocast context."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from rloo.generation.decode import lean_decoder
    plain = tiny_causal_lm(tokenizer).to(device)
    assert lean_decoder(plain, 4) is not None
    with torch.autocast(device, dtype=torch.bfloat16):
        assert lean_decoder(plain, 4) is None
    AcceleratorState._reset_state(reset_partial_state=True)  # (as TrainingArguments does: one state per process)
    try:
        prepared = Accelerator(mixed_precision="bf16", cpu=device == "cpu").prepare_model(model.to(device).eval())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert lean_decoder(prepared, 4) is None
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    generation, eos = config(tokenizer, do_sample=False), [tokenizer.eos_token_id]
    ours = LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(prepared, prompts)
    assert ours == TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(prepared, prompts)


def _counts(generator, model, prompt, rows, seed):
    torch.manual_seed(seed)
    completions = generator.generate(model, [prompt] * rows)
    return (collections.Counter(row[0] for row in completions),
            collections.Counter(tuple(row[:2]) for row in completions))


def _distance(counts, probabilities, rows):
    keys = set(counts) | set(probabilities)
    return 0.5 * sum(abs(counts.get(k, 0) / rows - probabilities.get(k, 0.0)) for k in keys)


@pytest.mark.parametrize("eos", [[2], [5, 0, 7], [3, -1, 40]])  # (ids outside the vocabulary mark nothing)
def test_min_new_tokens_processor_gives_transformers_scores(eos):
    """Our MinNewTokens against transformers' MinNewTokensLengthLogitsProcessor, bit for bit, before and after the
    minimum, float32 and bfloat16, -inf / nan / -0.0 among the scores; a fresh tensor either way."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    from rloo.generation.lean import MinNewTokens
    theirs, ours = (kind(5, 3, torch.tensor(eos)) for kind in (MinNewTokensLengthLogitsProcessor, MinNewTokens))
    for dtype in (torch.float32, torch.bfloat16):
        scores = torch.randn(4, 32).to(dtype)
        scores[0, 2], scores[1, 5], scores[2, 7] = float("-inf"), float("nan"), -0.0
        for length in (5, 6, 7, 8, 9):
            ids = torch.zeros(4, length, dtype=torch.long)
            expected, found = theirs(ids, scores), ours(ids, scores)
            assert found.dtype == expected.dtype and found.data_ptr() != scores.data_ptr()
            assert torch.equal(found.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_follow_generates_distribution(tokenizer, model, device):
    model.to(device).eval()
    with torch.no_grad():  # sharper logits than a random tiny model's: temperature, top-k and top-p all matter
        model.lm_head.weight.mul_(8)  # (measured: leaving out any one of them moves the first token by TV >= 0.06)
    prompt, rows = tokenizer("the dog sat")["input_ids"], 20000
    generation = config(tokenizer, max_new_tokens=2, do_sample=True, temperature=0.5, top_k=8, top_p=0.9,
                        repetition_penalty=1.2)
    eos = [tokenizer.eos_token_id]
    ours_first, ours_pairs = _counts(LeanGenerator(generation, tokenizer.pad_token_id, eos), model, prompt, rows, 1)
    theirs_first, theirs_pairs = _counts(TransformersGenerator(generation, tokenizer.pad_token_id, eos), model,
                                         prompt, rows, 2)
    with torch.no_grad():  # the first token's exact distribution: logits through generate's processors
        ids = torch.tensor([prompt], device=device)
        scores = model(ids).logits[:, -1].float()
        for processor in (RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.5), TopKLogitsWarper(8),
                          TopPLogitsWarper(0.9)):
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
    processors = LogitsProcessorList([MinNewTokens(2, 2, torch.tensor([eos], device=device), device=device),
                                      TemperatureLogitsWarper(0.7), TopKLogitsWarper(6), TopPLogitsWarper(0.95)])
    draws = Draws(processors, sample=True)
    holding, done = (torch.zeros(rows, length, dtype=torch.long, device=device) for length in (3, 4))
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
    pick = lambda **s: type(in_process_generator(config(tokenizer, **s), tokenizer.pad_token_id, eos, model))
    assert pick(do_sample=True, top_k=5, top_p=0.8, min_p=0.05, temperature=0.7) is LeanGenerator
    for settings in (dict(num_beams=2), dict(no_repeat_ngram_size=2), dict(bad_words_ids=[[5]]),
                     dict(cache_implementation="static"), dict(typical_p=0.5, do_sample=True)):
        assert pick(**settings) is TransformersGenerator, settings
    synced = in_process_generator(config(tokenizer), tokenizer.pad_token_id, eos, model, synced=True)
    assert type(synced) is LeanGenerator and synced.synced  # ZeRO-3 layer by layer: ranks step together


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
    generator.policy_temperature = 0.9  # the trainer's temperature, not the sampler's warped distribution
    torch.manual_seed(0)
    completions = generator.generate(model.to(device).eval(), prompts)
    assert isinstance(completions, Completions) and completions.policy_logprobs is not None
    prompt_ids, prompt_mask = (t.to(device) for t in pad_rows(prompts, tokenizer.pad_token_id, "left"))
    completion_ids = pad_rows(list(completions), tokenizer.pad_token_id, "right")[0].to(device)
    mask = completion_mask_after_eos(completion_ids, [tokenizer.eos_token_id])
    assert (mask.sum(dim=1) < completion_ids.size(1)).any()  # some row ended early: padding after it
    with torch.no_grad():
        forward = per_token_logps(model, torch.cat([prompt_ids, completion_ids], dim=1),
                                  torch.cat([prompt_mask, mask], dim=1), completion_ids.size(1), 0.9).logps
    kept = completions.policy_logprobs[:, :completion_ids.size(1)]
    torch.testing.assert_close(kept, forward * mask, atol=1e-5, rtol=1e-5)
    assert (kept[mask == 0] == 0).all()
    generator.policy_temperature = None
    assert not hasattr(generator.generate(model, prompts), "policy_logprobs")  # nothing kept unless asked


def test_decoded_logprobs_are_the_kls_pi_old_and_steps_past_every_end_are_cut(tokenizer):
    """build_rollout takes Completions.policy_logprobs for pi_old in the KL; a ZeRO-3 rank that decoded in step with
    the others past its own rows' ends hands in more columns than its completions have."""
    from rloo.generation import Completions
    from rloo.rewards.runner import RewardRunner
    from rloo.rollout import RolloutSettings, build_rollout
    eos = tokenizer.eos_token_id
    ids = [[5, eos], [6, 7, eos]]
    decoded = torch.tensor([[-1.0, -2.0, 0.0, 0.0, 0.0], [-1.5, -0.5, -0.25, 0.0, 0.0]])  # 5 steps for 3 tokens
    settings = RolloutSettings(num_generations=2, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[eos],
                               reward_weights=torch.ones(1), beta=0.5)
    rollout = build_rollout(
        [{"prompt": "the dog"}] * 2, settings, generate=lambda prompts: Completions(ids, policy_logprobs=decoded),
        processing_class=tokenizer, reward_runner=RewardRunner([lambda completion_ids, **kw: [float(len(c)) for c in
                                                                completion_ids]], [None]),
        trainer_state=None, policy_logps=None, reference_logps=lambda ids, mask, keep: torch.zeros(ids.size(0), keep))
    # KL_i = sum_t (pi_old - pi_ref): -3.0 and -2.25; shaped = length - 0.5 KL
    assert rollout.shaped_rewards.tolist() == pytest.approx([2 + 1.5, 3 + 1.125])
    assert rollout.kl == pytest.approx((-3.0 - 2.25) / 5)


def test_repeated_prompts_are_prefilled_once_with_generates_tokens(tokenizer, model):
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS for _ in range(3)]  # num_generations=3 copies each
    generation = config(tokenizer, do_sample=False)
    eos = [tokenizer.eos_token_id]
    rows_seen = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: rows_seen.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    try:
        ours = LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(model.eval(), prompts)
    finally:
        hook.remove()
    assert rows_seen[0][0] == len(PROMPTS) and all(shape == (len(prompts), 1) for shape in rows_seen[1:])
    assert ours == TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(model, prompts)


def test_prompt_lengths_are_grouped_where_the_padding_saved_outweighs_a_forward():
    from rloo.generation.prefill import length_groups
    assert length_groups([5, 50, 5, 50, 5], 32) == [[0, 2, 4], [1, 3]]  # 3 x 5 + 32 + 2 x 50 + 32 < 5 x 50 + 32
    assert length_groups([5, 50, 5, 50, 5], 200) == [[0, 1, 2, 3, 4]]  # 515 > 450
    assert length_groups([10, 11, 12]) == [[0, 1, 2]]  # padding 3 tokens: one forward
    assert length_groups([44] * 3 + [56] * 3, forward_cost=40) == [[0, 1, 2, 3, 4, 5]]  # saves 36 < 40
    assert length_groups([44] * 3 + [56] * 3, forward_cost=30) == [[0, 1, 2], [3, 4, 5]]
    assert length_groups([7]) == [[0]]
    lengths = torch.randint(20, 2000, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    groups = length_groups(lengths)  # (more distinct lengths than the search takes: bounds among 64 of them)
    assert sorted(row for group in groups for row in group) == list(range(500)) and 1 < len(groups) <= 64
    assert all(max(lengths[row] for row in a) < min(lengths[row] for row in b) for a, b in zip(groups, groups[1:]))


@pytest.mark.parametrize("shared", ["", "you are a careful helper who answers the question below in one short line: "])
def test_prompts_go_through_once_for_their_shared_start_then_in_length_groups_with_one_forwards_cache_and_tokens(
        tokenizer, model, monkeypatch, shared):
    """rloo.generation.prefill: distinct prompts of 4-5 and ~60 tokens through the model in two forwards, each padded
    to its own longest, after one forward of the first tokens they all share where they share enough; the merged
    cache equals one forward's at every unmasked position, the last positions' logits too, and greedy decoding gives
    generate's tokens (with num_generations copies as well)."""
    import os

    from transformers import DynamicCache

    from rloo.data import pad_rows
    from rloo.generation import prefill as prefill_module
    from rloo.generation.prefill import prefill
    from rloo.logps import cache_argument
    monkeypatch.setattr(prefill_module, "FORWARD_COST", 32)  # (a forward of the tiny model costs ~nothing)
    long = " ".join(["one two three four the dog sat on the mat"] * 6)
    texts = [shared + text for text in ("the dog sat", long, "red", long + " a big cat")]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    start = len(os.path.commonprefix(prompts)) if shared else 0
    assert start * (len(prompts) - 1) > 32 if shared else start == 0
    input_ids, mask = pad_rows(prompts, tokenizer.pad_token_id, "left")
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    with torch.no_grad():
        try:
            logits, arguments, _ = prefill(model.eval(), input_ids, mask, positions, {})
        finally:
            hook.remove()
        short = max(len(prompts[0]), len(prompts[2])) - start
        assert sorted(widths) == sorted([(1, start)] * bool(start) + [(2, short), (2, input_ids.size(1) - start)])
        cache, name = DynamicCache(config=model.config), cache_argument(model)
        theirs = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                       logits_to_keep=1, **{name: cache}).logits[:, -1]
    torch.testing.assert_close(logits, theirs, atol=1e-5, rtol=1e-5)
    seen = mask.bool()[:, None, :, None]
    for ours_layer, their_layer in zip(arguments[name].layers, cache.layers):
        for mine, reference in ((ours_layer.keys, their_layer.keys), (ours_layer.values, their_layer.values)):
            assert mine.shape == reference.shape
            torch.testing.assert_close(mine * seen, reference * seen, atol=1e-5, rtol=1e-5)
    generation, eos = config(tokenizer, do_sample=False), [tokenizer.eos_token_id]
    for rows in (prompts, [p for p in prompts for _ in range(2)]):
        assert LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(model, rows) == \
            TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(model, rows)
    # under ZeRO-3 each forward is collective (every rank must run as many): one forward, whatever the lengths
    import rloo.zero
    monkeypatch.setattr(rloo.zero, "is_partitioned", lambda model: True)
    widths.clear()
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    with torch.no_grad():
        try:
            prefill(model, input_ids, mask, positions, {})
        finally:
            hook.remove()
    assert widths == [tuple(input_ids.shape)]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch build without oneDNN")
def test_the_prompts_forward_runs_linears_on_onednn_without_grad_or_autocast_and_gives_them_back(
        tokenizer, model, monkeypatch):
    """rloo.generation.prefill._linears_on_onednn: inside the prompts' forward every plain fp32 Linear of the model
    (a LoRA layer's base and adapters too) runs on oneDNN's GEMM, with the model's logits; F.linear where a gradient
    is recorded or autocast is on; afterwards every module has its own forward back."""
    import torch.nn.functional as F

    from rloo.data import pad_rows
    from rloo.generation import prefill as prefill_module
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
        theirs = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    torch.testing.assert_close(logits, theirs, atol=1e-5, rtol=1e-5)
    assert set(calls) == set(linears)  # (every one, adapters included; none afterwards: `theirs` added no calls)
    assert not any("forward" in module.__dict__ for module in linears)
    monkeypatch.undo()
    layer, x = linears[0], torch.randn(3, linears[0].in_features)
    with prefill_module._linears_on_onednn(model, x.device):
        assert layer.forward.func is prefill_module._onednn_linear
        recorded = layer(x.requires_grad_())  # (a gradient recorded: F.linear, whose backward exists)
        recorded.sum().backward()
        assert x.grad is not None and recorded.grad_fn is not None
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.bfloat16  # (autocast's F.linear)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert "forward" not in layer.__dict__


def _variant(tokenizer, kind):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if kind == "qwen2":  # biases on q/k/v
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             eos_token_id=2, pad_token_id=2, bos_token_id=None))
    else:
        model = tiny_causal_lm(tokenizer, attention_bias=kind == "llama-bias")
    with torch.no_grad():  # (initialised to 0: a step that dropped them would pass)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.3)
    if kind == "qwen2":
        return model
    if kind.startswith("lora"):
        settings = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
        if kind == "lora-mixed":  # k_proj plain beside LoRA q_proj / v_proj of other ranks and scalings
            settings.update(target_modules=["q_proj", "v_proj", "up_proj"], rank_pattern={"v_proj": 2},
                            alpha_pattern={"v_proj": 6})
        if kind == "lora-float64":  # not packed for MKL: each projection its own product, LoRA written out
            settings.update(lora_alpha=12)
        model = with_lora(model, **settings)
        if kind == "lora-float64":
            model = model.double()
    return model


_KERNELS = _kernels()
if "rloo" not in _KERNELS and kernel.compiled() is not None:  # (built here without AVX2 and FMA: tested, not used)
    _KERNELS["rloo"] = functools.partial(kernel.packed_linear, kernel.compiled())
# our kernel's builds tested here: this CPU's, and where that one has 16-float vectors (AVX-512) and the CPU AVX2
# and FMA, the build for x86-64-v3 as well (8-float vectors: what a CPU without AVX-512 runs)
_TARGETS = ["native"] + (["x86-64-v3"] if kernel.compiled() is not None and kernel.compiled().vector_floats() == 16
                         and {"avx2", "fma"} <= set(kernel._cpu_flags().split())
                         and kernel.compiled("x86-64-v3") is not None else [])  # (a gcc older than 11: no such -march)
_PACKABLE = ("llama", "llama-bias", "qwen2", "lora", "lora-mixed")


@pytest.mark.parametrize("kind,gemm", [(kind, gemm) for kind in _PACKABLE for gemm in sorted(_KERNELS)]
                         + [("lora-float64", None)])
def test_written_out_decode_step_is_the_models_forward(tokenizer, kind, gemm, monkeypatch):
    """rloo.generation.decode: the step's logits are the model's (KV buffers; packed weights with each GEMM kernel
    the build has, q/k/v and gate/up side by side, LoRA merged; or, not packable, LoRA written out; the attention's
    matmuls), and greedy decoding with it gives generate's tokens."""
    from rloo.generation import decode
    from rloo.generation.decode import lean_decoder
    if gemm is not None:  # that kernel alone (MKL's is otherwise used only in a build without oneDNN)
        monkeypatch.setattr(decode, "_kernels", lambda: {gemm: _KERNELS[gemm]})
    model = _variant(tokenizer, kind).eval()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    assert lean_decoder(model, len(prompts)) is not None
    generation = config(tokenizer, do_sample=False)
    eos = [tokenizer.eos_token_id]
    ours = LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(model, prompts)
    assert ours == TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(model, prompts)
    from transformers import DynamicCache

    from rloo.data import pad_rows
    from rloo.logps import cache_argument
    input_ids, mask = pad_rows(prompts, tokenizer.pad_token_id, "left")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    name = cache_argument(model)
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **{name: cache})
        decoder = lean_decoder(model, len(prompts))
        decoder.start(cache, mask, 2)
        tokens, step_positions = torch.tensor([7, 8, 9, 10]), positions[:, -1:] + 1
        mine = decoder.step(tokens, step_positions)
        grown = torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], 1)
        theirs = model(input_ids=tokens[:, None], attention_mask=grown,
                       position_ids=step_positions, use_cache=True, **{name: cache}).logits[:, -1]
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_the_steps_fixed_shape_form_replayed_as_a_cuda_graph_gives_the_steps_logits(tokenizer, model, device,
                                                                                   monkeypatch):
    """On a GPU the decode steps replay CUDA graphs of LeanDecoder._graph_step, one per attention length (the position
    a tensor, attention over the buffers' first positions, zero where not yet written); step after step their logits
    are those of the step as it runs elsewhere (the position an int, attention over the positions written). On the
    CPU the fixed-shape form is run as it is, with the torch step (the C's off) as on a GPU."""
    from transformers import DynamicCache

    from rloo.data import pad_rows
    from rloo.generation.decode import LeanDecoder, lean_decoder
    monkeypatch.setattr(kernel, "for_decoding", lambda: None)
    monkeypatch.setattr(LeanDecoder, "GRAPH_LENGTH", 4)  # (graphs of lengths 8, then the buffers' 14)
    model.to(device).eval()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    input_ids, mask = (t.to(device) for t in pad_rows(prompts, tokenizer.pad_token_id, "left"))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                       past_key_values=cache).logits[:, -1]
        stepped, fixed = lean_decoder(model, len(prompts)), lean_decoder(model, len(prompts))
        for decoder in (stepped, fixed):
            decoder.start(cache, mask, 8)
        assert (fixed.graphs is not None) == (device == "cuda")
        stepped.graphs = None
        for buffer in fixed.keys + fixed.values:
            buffer[:, :, mask.size(1):].zero_()
        lengths = []
        for _ in range(7):
            tokens, positions = logits.argmax(-1), positions[:, -1:] + 1
            at = stepped.length
            logits = stepped.step(tokens, positions)
            lengths.append(fixed.graph_length(at))
            if device == "cuda":
                found = fixed.step(tokens, positions)
            else:
                fixed.length = at + 1
                found = fixed._graph_step(tokens, positions, torch.tensor([at]), lengths[-1])
            torch.testing.assert_close(found, logits, atol=1e-5, rtol=1e-5)
    assert mask.size(1) == 6 and lengths == [8] * 2 + [14] * 5  # (positions 6-7 in 8's graph, 8-12 in the buffers')
    if device == "cuda":
        assert sorted(fixed.graphs) == [8, 14]  # each captured once, then replayed


def test_models_the_decode_step_does_not_write_out_keep_their_forward(tokenizer):
    from rloo.generation.decode import lean_decoder
    from rloo.testing import tiny_moe_causal_lm
    assert lean_decoder(tiny_moe_causal_lm(tokenizer), 2) is None  # Mixtral: experts
    from transformers import MistralConfig, MistralForCausalLM
    mistral = MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               sliding_window=8))
    assert lean_decoder(mistral, 2) is None  # a sliding window


def test_the_decode_steps_fused_operations_give_the_modules_values(tokenizer, model):
    """rloo.generation.decode: a Llama norm as one torch.rms_norm call, the rotation as a roll with sin's first half
    negated: the same values, bit for bit, as the module and as apply_rotary_pos_emb."""
    from transformers.models.llama.modeling_llama import rotate_half

    from rloo.generation.decode import _norm
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(4, 1, norm.weight.size(0))
        assert _norm(norm) is not norm and torch.equal(_norm(norm)(x), norm(x))
    x, cos, sin = torch.randn(4, 6, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    signed = torch.cat([-sin[..., :4], sin[..., 4:]], dim=-1)
    assert torch.equal(x * cos + x.roll(4, -1) * signed, x * cos + rotate_half(x) * sin)


def test_weights_are_packed_for_onednn_and_for_mkl_only_in_a_build_without_it(monkeypatch):
    """rloo.generation.decode._packed_linear: oneDNN's kernel where the build has it, nothing else packed or timed
    (MKL's packed copy is up to 21x the weight's size: a fresh mapping on every generation call); MKL's in a build
    without oneDNN; packing draws no random numbers."""
    import functools

    import torch.nn.functional as F

    from rloo.generation import decode
    built = []

    def kernel(name):
        def make(weight, bias, rows):
            built.append((name, rows))
            return functools.partial(F.linear, weight=weight, bias=bias)
        return make
    monkeypatch.setattr(decode, "_onednn", kernel("onednn"))
    monkeypatch.setattr(decode, "_mkl", kernel("mkl"))
    monkeypatch.setattr(decode.kernel_module, "for_decoding", lambda: None)  # (ours: its own test)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    weight, bias, x = torch.randn(6, 5), torch.randn(6), torch.randn(3, 1, 5)
    random_state = torch.random.get_rng_state()
    linear = decode._packed_linear(weight, bias, 3)
    assert built == [("onednn", 3)]
    assert torch.equal(torch.random.get_rng_state(), random_state)  # sampling after it draws what it would have
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias))
    built.clear()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    decode._packed_linear(weight, bias, 3)
    assert built == [("mkl", 3)]


def _counting_builds(monkeypatch):
    from rloo.generation import lean
    from rloo.generation.decode import lean_decoder
    built = []

    def counted(model, rows):
        built.append(rows)
        return lean_decoder(model, rows)
    monkeypatch.setattr(lean, "lean_decoder", counted)
    return built


def test_packed_weights_are_reused_inside_reusing_weights_until_a_weight_or_adapter_changes(tokenizer,
                                                                                             monkeypatch):
    """LeanGenerator.reusing_weights: a call inside takes the previous call's packed decoder while the model, the
    rows, every parameter and the adapters' settings are unchanged; any change packs anew (the tokens are those of a
    generator that packs every time), and leaving drops the copy."""
    built = _counting_builds(monkeypatch)
    model = _variant(tokenizer, "lora").eval()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    generation = config(tokenizer, do_sample=False)
    eos = [tokenizer.eos_token_id]
    fresh = lambda rows: TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(model, rows)  # noqa
    generator = LeanGenerator(generation, tokenizer.pad_token_id, eos)
    generator.generate(model, prompts)
    generator.generate(model, prompts)
    assert built == [4, 4]  # outside: packed on every call
    built.clear()
    with generator.reusing_weights():
        before = generator.generate(model, prompts)
        assert generator.generate(model, prompts) == before == fresh(prompts) and built == [4]
        with torch.no_grad():  # an in-place change of one LoRA weight (as an optimizer step makes)
            next(p for n, p in model.named_parameters() if "q_proj.lora_B" in n).add_(1.5)
        after = generator.generate(model, prompts)
        assert built == [4, 4] and after == fresh(prompts) and after != before
        with model.disable_adapter():  # the adapter's settings, not its weights
            assert generator.generate(model, prompts) == fresh(prompts) and built == [4, 4, 4]
        assert generator.generate(model, prompts[:3]) == fresh(prompts[:3]) and built == [4, 4, 4, 3]  # other rows
        assert generator._kept is not None
    assert generator._kept is None


def test_trainer_evaluation_packs_once_and_training_on_every_call(tmp_path, tokenizer, model, monkeypatch):
    """RLOOTrainer.evaluate generates every batch inside reusing_weights (one packed copy for all of them);
    training packs on each call and keeps nothing through its backward."""
    from helpers import conversational, length_reward, make_args

    from rloo import RLOOTrainer
    built = _counting_builds(monkeypatch)
    args = make_args(tmp_path, per_device_eval_batch_size=4, max_steps=1)
    trainer = RLOOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=conversational(),
                          eval_dataset=conversational(8), processing_class=tokenizer)
    assert isinstance(trainer.generator, LeanGenerator)
    trainer.evaluate()  # 8 prompts x 2 generations in batches of 4 rows
    assert built == [4]
    trainer.train()
    assert built == [4, 4] and trainer.generator._kept is None


@pytest.mark.parametrize("target", _TARGETS)
def test_decode_gemm_is_flinear_for_any_rows_columns_bias_and_threads(target):
    """rloo.generation.kernel: built wherever gcc is (8-float vectors without AVX-512), and x W^T + b for row counts
    in and out of its groups of rows, columns in and out of its blocks, and for weights packed side by side
    (segments of sizes in and out of a block) as the one concatenated weight."""
    import torch.nn.functional as F
    library = kernel.compiled(target)
    assert library is not None or shutil.which("gcc") is None
    if library is None:
        pytest.skip("no gcc on this machine: the decode step uses oneDNN's kernel")
    threads = torch.get_num_threads()
    try:
        for count in {1, threads}:
            torch.set_num_threads(count)
            for rows in (1, 3, 8, 9, 32):
                for n, k in ((50, 7), (96, 64), (200, 576)):
                    weight, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, 1, k)
                    for b in (None, bias):
                        linear = kernel.packed_linear(library, weight, b, rows)
                        torch.testing.assert_close(linear(x), F.linear(x, weight, b), atol=1e-4, rtol=1e-4)
                    parts = list(weight.split([n // 2, 3, n - n // 2 - 3]))
                    torch.testing.assert_close(kernel.packed_linear(library, parts, bias, rows)(x),
                                               F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="expected fp32 inputs of 7 features"):
        kernel.packed_linear(library, torch.randn(4, 7), None, 2)(torch.randn(2, 1, 7).double())
    with pytest.raises(ValueError, match="one input size"):
        kernel.packed_linear(library, [torch.randn(4, 7), torch.randn(4, 6)], None, 2)


def test_decode_gemm_goes_first_with_avx512_or_avx2_and_is_skipped_without_a_compiler(tmp_path, monkeypatch):
    """The decode step packs for our kernel where it is built for AVX-512 or for AVX2 with FMA, and for oneDNN's
    where there is no compiler (nothing cached): the build's failure is not an error."""
    from rloo.generation import decode
    assert ("rloo" in _kernels()) == (kernel.for_decoding() is not None)
    flags = set(kernel._cpu_flags().split())
    if kernel.compiled() is not None:
        assert (kernel.for_decoding() is not None) == ("avx512f" in flags or {"avx2", "fma"} <= flags)
    for target in _TARGETS[1:]:
        assert kernel.compiled(target).vector_floats() == 8 and kernel.compiled(target).fused() == 1
    monkeypatch.setenv("RLOO_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-gcc"))
    kernel.compiled.cache_clear()
    try:
        assert kernel.compiled() is None and kernel.for_decoding() is None
        assert next(iter(decode._kernels())) == "onednn"
    finally:
        monkeypatch.undo()
        kernel.compiled.cache_clear()
    if kernel.for_decoding() is not None:
        assert next(iter(decode._kernels())) == "rloo"


@pytest.mark.skipif(kernel.compiled() is None, reason="no build of our kernel here (no gcc, or not Linux x86-64)")
def test_decode_kernel_march_from_the_environment(monkeypatch):
    """RLOO_KERNEL_MARCH picks the -march of the library the decode step takes (x86-64-v3: 8-float vectors on a CPU
    with AVX-512); one gcc does not know, or whose build the decode step would not take, is an error that names the
    variable, not a silent fall-back."""
    if len(_TARGETS) > 1:
        monkeypatch.setenv("RLOO_KERNEL_MARCH", "x86-64-v3")
        assert kernel.for_decoding().vector_floats() == 8
    monkeypatch.setenv("RLOO_KERNEL_MARCH", "no-such-cpu")
    with pytest.raises(ValueError, match="RLOO_KERNEL_MARCH='no-such-cpu'.*gcc could not build it"):
        kernel.for_decoding()
    monkeypatch.setenv("RLOO_KERNEL_MARCH", "x86-64")  # (SSE2 only: built and runnable, but not taken)
    with pytest.raises(ValueError, match="'x86-64'.*neither AVX-512 nor AVX2 with FMA"):
        kernel.for_decoding()
    monkeypatch.delenv("RLOO_KERNEL_MARCH")
    assert kernel.for_decoding() is kernel.compiled()


@pytest.mark.parametrize("path,kind,target", [("whole", kind, target) for kind in ("plain", "shared")
                                              for target in _TARGETS] +
                         [("whole", "biases", "native"), ("whole", "lora", "native"), ("whole", "wide", "native")] +
                         [("attention", kind, target) for kind in ("plain", "shared") for target in _TARGETS] +
                         [("torch", "plain", "native"), ("torch", "shared", "native")])
def test_decode_step_in_c_is_the_models_forward(tokenizer, path, kind, target, monkeypatch):
    """rloo.generation.kernel: the whole step in one C call (kernel.Step: norms, packed projections, attention,
    SiLU x up, residuals, LM head; with biases on every projection, with LoRA merged, with gates far out on both
    sides, where e^-|gate| underflows), the C attention alone in the
    step module by module, and torch's attention: three steps' logits against the model's forward over a
    left-padded batch, grouped query heads, tied embeddings; greedy decoding gives generate's tokens. `shared`:
    rows repeating a prompt start from a cache with each prompt once, which the C attention reads for all of its
    rows (each row's own buffers only its new tokens) and torch's copies to each row."""
    from transformers import DynamicCache

    from rloo.data import pad_rows
    from rloo.generation import decode
    from rloo.generation.decode import lean_decoder
    from rloo.logps import cache_argument
    library = kernel.compiled(target)
    if library is None:
        assert shutil.which("gcc") is None
        pytest.skip("no gcc on this machine: the step stays torch's")
    # our GEMM (on a CPU without AVX2 and FMA built with 8-float vectors: tested here, not used there)
    monkeypatch.setattr(decode, "_kernels", lambda: {"rloo": functools.partial(kernel.packed_linear, library)})
    model = small_llama(tokenizer, biases=kind == "biases")
    if kind == "lora":
        model = with_lora(model)
    gates = []
    if kind == "wide":  # (SiLU's vectorised exp: gates from about -200 to 200)
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.data.mul_(400)
            layer.mlp.gate_proj.register_forward_hook(lambda module, inputs, output: gates.append(output))
    model.eval()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    rows_of = torch.tensor([0, 1, 0, 1]) if kind == "shared" else None  # (each row's prompt among the first two)
    if rows_of is not None:
        prompts = [prompts[index] for index in rows_of.tolist()]
    input_ids, mask = pad_rows(prompts, tokenizer.pad_token_id, "left")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, name = DynamicCache(config=model.config), cache_argument(model)
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **{name: cache})
        start = cache
        if rows_of is not None:  # (the prompts' cache, each once: rows 0 and 1)
            start = DynamicCache(config=model.config)
            model(input_ids=input_ids[:2], attention_mask=mask[:2], position_ids=positions[:2], use_cache=True,
                  **{name: start})
        decoder = lean_decoder(model, len(prompts))
        assert decoder.whole is not None
        if path != "whole":
            decoder.whole = None
            decoder.attend = kernel.attention(library, 4, 2, 16) if path == "attention" else None
        if rows_of is not None and path != "torch":  # (a row pointing past the cache's prompts: refused)
            with pytest.raises(ValueError, match="prompt_rows must name one of the cache's 2 rows"):
                decoder.start(start, mask, 3, torch.tensor([0, 1, 2, 1]))
        decoder.start(start, mask, 3, rows_of)
        assert (path == "whole") == (decoder.whole is not None and decoder.whole.table is not None)
        assert (decoder.shared is not None) == (rows_of is not None and path != "torch")
        assert decoder.keys[0].size(2) == 3 + (0 if decoder.shared is not None else input_ids.size(1))
        step_positions = positions[:, -1:]
        for tokens in ([7, 8, 9, 10], [3, 4, 5, 6], [11, 12, 13, 14]):
            tokens, step_positions = torch.tensor(tokens), step_positions + 1
            mine = decoder.step(tokens, step_positions)
            mask = torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], 1)
            theirs = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=step_positions,
                           use_cache=True, **{name: cache}).logits[:, -1]
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    if kind == "wide":
        assert min(gate.min() for gate in gates) < -100 and max(gate.max() for gate in gates) > 100
    if path == "whole":
        generation, eos = config(tokenizer, do_sample=False), [tokenizer.eos_token_id]
        assert LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(model, prompts) == \
            TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(model, prompts)


@pytest.mark.parametrize("target", _TARGETS)
def test_decode_attention_in_c_is_sdpas_for_scores_far_apart_and_masked_positions(target):
    """rloo.generation.kernel.attention (its own exp and softmax, NB positions at a time): the rotated key and the
    value written at the step's position, and softmax(q k^T * scale + mask) v as SDPA computes it, for scores from
    0 to hundreds apart (weights that underflow to 0), masked positions, position counts in and out of a vector and
    more scores than the C keeps on its stack; a row's left padding is never read (NaN there)."""
    import torch.nn.functional as F
    library = kernel.compiled(target)
    if library is None:
        pytest.skip("no gcc on this machine: the step's attention stays torch's")
    heads, kv_heads, dim = 6, 2, 2 * library.vector_floats()
    attend = kernel.attention(library, heads, kv_heads, dim)
    torch.manual_seed(0)
    for at, spread in ((0, 1.0), (5, 1.0), (37, 30.0), (40, 300.0), (1500, 1.0)):
        rows, total = 3, at + 4
        projected = torch.randn(rows, heads + 2 * kv_heads, dim) * spread
        keys, values = torch.randn(rows, kv_heads, total, dim), torch.randn(rows, kv_heads, total, dim)
        mask = torch.zeros(rows, 1, 1, total)
        mask[1, ..., : at // 2] = float("-inf")  # (a row's left padding)
        cos, sin = torch.randn(rows, 1, dim), torch.randn(rows, 1, dim)
        expected_keys, expected_values = keys.clone(), values.clone()
        keys[1, :, : at // 2], values[1, :, : at // 2] = float("nan"), float("nan")
        out = attend(projected, cos, sin, keys, values, mask, at, 0.125)
        padding = slice(None, at // 2)
        keys[1, :, padding], values[1, :, padding] = expected_keys[1, :, padding], expected_values[1, :, padding]

        def rotated(x):
            return x * cos + torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1) * sin
        expected_keys[:, :, at] = rotated(projected[:, heads: heads + kv_heads])
        expected_values[:, :, at] = projected[:, heads + kv_heads:]
        torch.testing.assert_close(keys, expected_keys)
        torch.testing.assert_close(values, expected_values)
        query = rotated(projected[:, :heads])[:, :, None]  # (rows, heads, 1, dim)
        theirs = F.scaled_dot_product_attention(
            query, expected_keys[..., : at + 1, :].repeat_interleave(heads // kv_heads, 1),
            expected_values[..., : at + 1, :].repeat_interleave(heads // kv_heads, 1),
            attn_mask=mask[..., : at + 1], scale=0.125)
        torch.testing.assert_close(out.view(rows, heads, dim), theirs[:, :, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", _TARGETS)
def test_c_draw_is_the_inverse_cdf_of_softmax_with_banned_columns_and_leaves_rows_it_cannot_draw(target):
    """rloo.generation.kernel.draw: for the same uniform numbers, the token of one cumulative sum of softmax's
    probabilities over the whole row (banned columns at -inf, one of them a row's largest score; a vocabulary that
    is not a whole number of blocks); never an entry of weight 0, also for uniforms at 0 and just under 1 and whole
    blocks at -inf; -1 for a row with a NaN, +inf or nothing finite."""
    library = kernel.compiled(target)
    if library is None:
        pytest.skip("no gcc on this machine: draws stay torch's")
    torch.manual_seed(0)
    rows, vocab, banned = 200, 5000, [7, 4095, 4999]
    scores = torch.randn(rows, vocab) * 3
    scores[::3, 4095] = 40.0  # (banned and the largest)
    scores[1::3, 1000] = 25.0  # (a peak)
    uniform = torch.rand(rows, 1, dtype=torch.float64)
    uniform[0, 0], uniform[1, 0] = 0.0, 1.0 - 2.0**-53
    probabilities = torch.softmax(scores.index_fill(1, torch.tensor(banned), float("-inf")), dim=-1)
    cumulative = probabilities.double().cumsum(dim=-1)
    expected = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True).squeeze(1)
    drawn = kernel.draw(library, scores, banned, uniform)
    assert torch.equal(drawn, expected) and not bool(torch.isin(drawn, torch.tensor(banned)).any())
    sparse = torch.full((4, 1000), float("-inf"))  # (weight only at a few entries, whole blocks of nothing)
    sparse[:, [255, 256, 700, 999]] = torch.tensor([1.0, 2.0, -3.0, 0.5])
    edges = torch.tensor([[0.0], [1.0 - 2.0**-53], [0.5], [0.999]], dtype=torch.float64)
    assert set(kernel.draw(library, sparse, [], edges).tolist()) <= {255, 256, 700, 999}
    assert kernel.draw(library, sparse, [], edges)[:2].tolist() == [255, 999]
    odd = torch.randn(4, 300)
    odd[0, 3], odd[1, 299], odd[2] = float("nan"), float("inf"), float("-inf")
    odd[3, :] = float("-inf")
    odd[3, 17] = 0.0  # (the only finite score: banned)
    assert kernel.draw(library, odd, [17], torch.rand(4, 1, dtype=torch.float64)).tolist() == [-1, -1, -1, -1]


def test_the_decode_loop_draws_with_the_c_where_only_min_new_tokens_processes_and_torch_otherwise(monkeypatch):
    """Draws.drawn: with min_new_tokens only, the C draw on the logits (EOS banned until the minimum), the
    token sample_from gives for the same uniform numbers; a row the C leaves (a NaN) goes through softmax and
    sample_from with those numbers; with a temperature, torch's path, one uniform per row all the same."""
    if kernel.for_decoding() is None:
        pytest.skip("no decode kernel on this machine")
    calls = []
    real = kernel.draw
    monkeypatch.setattr(kernel, "draw", lambda *a: calls.append(a[2]) or real(*a))
    eos, prompt = torch.tensor([2, 5]), 4
    minimum = LogitsProcessorList([MinNewTokens(prompt, 3, eos)])
    torch.manual_seed(0)
    logits = torch.randn(6, 700) * 2
    logits[:, 5] = 20.0  # (an EOS that would win)
    for length, banned in ((prompt + 1, [2, 5]), (prompt + 3, [])):
        sequences = torch.zeros(6, length, dtype=torch.long)
        torch.manual_seed(1)
        drawn = Draws(minimum, True).drawn(sequences, logits)
        torch.manual_seed(1)
        assert torch.equal(drawn, sample_from(torch.softmax(minimum(sequences, logits), dim=-1)))
        assert calls[-1] == banned
    logits[2, 9] = float("nan")
    torch.manual_seed(1)
    drawn = Draws(minimum, True).drawn(sequences, logits)
    torch.manual_seed(1)
    assert torch.equal(drawn, sample_from(torch.softmax(minimum(sequences, logits), dim=-1)))
    calls.clear()
    warmer = LogitsProcessorList([*minimum, TemperatureLogitsWarper(0.7)])
    torch.manual_seed(1)
    drawn = Draws(warmer, True).drawn(sequences, logits)
    torch.manual_seed(1)
    assert torch.equal(drawn, sample_from(torch.softmax(warmer(sequences, logits), dim=-1))) and calls == []
