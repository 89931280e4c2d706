"""The decode step's C (rloo.engine.kernel): its GEMM, attention, draw and whole step against torch's and the
model's forward, for this CPU's build and, where this CPU has AVX-512, the AVX2 build; which build the decode step
takes, and none without a compiler."""

import functools
import shutil

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper

from helpers import PROMPTS, config, kernel_targets, small_llama, with_lora
from rloo.engine import kernel, packing
from rloo.engine.lean import Draws, MinNewTokens, sample_from
from rloo.engine.packing import kernels
from rloo.generation import LeanGenerator, TransformersGenerator

_TARGETS = kernel_targets()


@pytest.mark.parametrize("target", _TARGETS)
def test_decode_gemm_is_flinear_for_any_rows_columns_bias_and_threads(target):
    """rloo.engine.kernel: built wherever gcc is (8-float vectors without AVX-512), and x W^T + b for row counts
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
                        torch.testing.assert_close(
                            linear(x), F.linear(x, weight, b), atol=1e-4, rtol=1e-4
                        )
                    parts = list(weight.split([n // 2, 3, n - n // 2 - 3]))
                    torch.testing.assert_close(
                        kernel.packed_linear(library, parts, bias, rows)(x),
                        F.linear(x, weight, bias),
                        atol=1e-4,
                        rtol=1e-4,
                    )
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="expected fp32 inputs of 7 features"):
        kernel.packed_linear(library, torch.randn(4, 7), None, 2)(torch.randn(2, 1, 7).double())
    with pytest.raises(ValueError, match="one input size"):
        kernel.packed_linear(library, [torch.randn(4, 7), torch.randn(4, 6)], None, 2)


def test_decode_gemm_goes_first_with_avx512_or_avx2_and_is_skipped_without_a_compiler(
    tmp_path, monkeypatch
):
    """The decode step packs for our kernel where it is built for AVX-512 or for AVX2 with FMA, and for oneDNN's
    where there is no compiler (nothing cached): the build's failure is not an error."""
    assert ("rloo" in kernels()) == (kernel.for_decoding() is not None)
    flags = set(kernel._cpu_flags().split())
    if kernel.compiled() is not None:
        assert (kernel.for_decoding() is not None) == (
            "avx512f" in flags or {"avx2", "fma"} <= flags
        )
    for target in _TARGETS[1:]:
        assert kernel.compiled(target).vector_floats() == 8 and kernel.compiled(target).fused() == 1
    monkeypatch.setenv("RLOO_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-gcc"))
    kernel.compiled.cache_clear()
    try:
        assert kernel.compiled() is None and kernel.for_decoding() is None
        assert next(iter(packing.kernels())) == "onednn"
    finally:
        monkeypatch.undo()
        kernel.compiled.cache_clear()
    if kernel.for_decoding() is not None:
        assert next(iter(packing.kernels())) == "rloo"


@pytest.mark.skipif(
    kernel.compiled() is None, reason="no build of our kernel here (no gcc, or not Linux x86-64)"
)
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
    monkeypatch.setenv(
        "RLOO_KERNEL_MARCH", "x86-64"
    )  # (SSE2 only: built and runnable, but not taken)
    with pytest.raises(ValueError, match="'x86-64'.*neither AVX-512 nor AVX2 with FMA"):
        kernel.for_decoding()
    monkeypatch.delenv("RLOO_KERNEL_MARCH")
    assert kernel.for_decoding() is kernel.compiled()


@pytest.mark.parametrize(
    "path,kind,target",
    [("whole", kind, target) for kind in ("plain", "shared") for target in _TARGETS]
    + [("whole", "biases", "native"), ("whole", "lora", "native"), ("whole", "wide", "native")]
    + [("attention", kind, target) for kind in ("plain", "shared") for target in _TARGETS]
    + [("torch", "plain", "native"), ("torch", "shared", "native")],
)
def test_decode_step_in_c_is_the_models_forward(tokenizer, path, kind, target, monkeypatch):
    """rloo.engine.kernel: the whole step in one C call (kernel.Step: norms, packed projections, attention,
    SiLU x up, residuals, LM head; with biases on every projection, with LoRA merged, with gates far out on both
    sides, where e^-|gate| underflows), the C attention alone in the
    step module by module, and torch's attention: three steps' logits against the model's forward over a
    left-padded batch, grouped query heads, tied embeddings; greedy decoding gives generate's tokens. `shared`:
    rows repeating a prompt start from a cache with each prompt once, which the C attention reads for all of its
    rows (each row's own buffers only its new tokens) and torch's copies to each row."""
    from transformers import DynamicCache

    from rloo.data import pad_rows
    from rloo.engine.decode import lean_decoder
    from rloo.kv import cache_argument

    library = kernel.compiled(target)
    if library is None:
        assert shutil.which("gcc") is None
        pytest.skip("no gcc on this machine: the step stays torch's")
    # our GEMM (on a CPU without AVX2 and FMA built with 8-float vectors: tested here, not used there)
    monkeypatch.setattr(
        packing, "kernels", lambda: {"rloo": functools.partial(kernel.packed_linear, library)}
    )
    model = small_llama(tokenizer, biases=kind == "biases")
    if kind == "lora":
        model = with_lora(model)
    gates = []
    if kind == "wide":  # (SiLU's vectorised exp: gates from about -200 to 200)
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.data.mul_(400)
            layer.mlp.gate_proj.register_forward_hook(
                lambda module, inputs, output: gates.append(output)
            )
    model.eval()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    rows_of = (
        torch.tensor([0, 1, 0, 1]) if kind == "shared" else None
    )  # (each row's prompt among the first two)
    if rows_of is not None:
        prompts = [prompts[index] for index in rows_of.tolist()]
    input_ids, mask = pad_rows(prompts, tokenizer.pad_token_id, "left")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, name = DynamicCache(config=model.config), cache_argument(model)
    with torch.no_grad():
        model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{name: cache},
        )
        start = cache
        if rows_of is not None:  # (the prompts' cache, each once: rows 0 and 1)
            start = DynamicCache(config=model.config)
            model(
                input_ids=input_ids[:2],
                attention_mask=mask[:2],
                position_ids=positions[:2],
                use_cache=True,
                **{name: start},
            )
        decoder = lean_decoder(model, len(prompts))
        assert decoder.whole is not None
        if path != "whole":
            decoder.whole = None
            decoder.attend = kernel.attention(library, 4, 2, 16) if path == "attention" else None
        if (
            rows_of is not None and path != "torch"
        ):  # (a row pointing past the cache's prompts: refused)
            with pytest.raises(ValueError, match="prompt_rows must name one of the cache's 2 rows"):
                decoder.start(start, mask, 3, torch.tensor([0, 1, 2, 1]))
        decoder.start(start, mask, 3, rows_of)
        assert (path == "whole") == (decoder.whole is not None and decoder.whole.table is not None)
        assert (decoder.shared is not None) == (rows_of is not None and path != "torch")
        assert decoder.keys[0].size(2) == 3 + (
            0 if decoder.shared is not None else input_ids.size(1)
        )
        step_positions = positions[:, -1:]
        for tokens in ([7, 8, 9, 10], [3, 4, 5, 6], [11, 12, 13, 14]):
            tokens, step_positions = torch.tensor(tokens), step_positions + 1
            mine = decoder.step(tokens, step_positions)
            mask = torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], 1)
            theirs = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=step_positions,
                use_cache=True,
                **{name: cache},
            ).logits[:, -1]
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    if kind == "wide":
        assert min(gate.min() for gate in gates) < -100 and max(gate.max() for gate in gates) > 100
    if path == "whole":
        generation, eos = config(tokenizer, do_sample=False), [tokenizer.eos_token_id]
        assert LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(
            model, prompts
        ) == TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(model, prompts)


@pytest.mark.parametrize("target", _TARGETS)
def test_decode_attention_in_c_is_sdpas_for_scores_far_apart_and_masked_positions(target):
    """rloo.engine.kernel.attention (its own exp and softmax, NB positions at a time): the rotated key and the
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
        keys, values = (
            torch.randn(rows, kv_heads, total, dim),
            torch.randn(rows, kv_heads, total, dim),
        )
        mask = torch.zeros(rows, 1, 1, total)
        mask[1, ..., : at // 2] = float("-inf")  # (a row's left padding)
        cos, sin = torch.randn(rows, 1, dim), torch.randn(rows, 1, dim)
        expected_keys, expected_values = keys.clone(), values.clone()
        keys[1, :, : at // 2], values[1, :, : at // 2] = float("nan"), float("nan")
        out = attend(projected, cos, sin, keys, values, mask, at, 0.125)
        padding = slice(None, at // 2)
        keys[1, :, padding], values[1, :, padding] = (
            expected_keys[1, :, padding],
            expected_values[1, :, padding],
        )

        def rotated(x):
            return x * cos + torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1) * sin

        expected_keys[:, :, at] = rotated(projected[:, heads : heads + kv_heads])
        expected_values[:, :, at] = projected[:, heads + kv_heads :]
        torch.testing.assert_close(keys, expected_keys)
        torch.testing.assert_close(values, expected_values)
        query = rotated(projected[:, :heads])[:, :, None]  # (rows, heads, 1, dim)
        theirs = F.scaled_dot_product_attention(
            query,
            expected_keys[..., : at + 1, :].repeat_interleave(heads // kv_heads, 1),
            expected_values[..., : at + 1, :].repeat_interleave(heads // kv_heads, 1),
            attn_mask=mask[..., : at + 1],
            scale=0.125,
        )
        torch.testing.assert_close(
            out.view(rows, heads, dim), theirs[:, :, 0], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("target", _TARGETS)
def test_c_draw_is_the_inverse_cdf_of_softmax_with_banned_columns_and_leaves_rows_it_cannot_draw(
    target,
):
    """rloo.engine.kernel.draw: for the same uniform numbers, the token of one cumulative sum of softmax's
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
    sparse = torch.full(
        (4, 1000), float("-inf")
    )  # (weight only at a few entries, whole blocks of nothing)
    sparse[:, [255, 256, 700, 999]] = torch.tensor([1.0, 2.0, -3.0, 0.5])
    edges = torch.tensor([[0.0], [1.0 - 2.0**-53], [0.5], [0.999]], dtype=torch.float64)
    assert set(kernel.draw(library, sparse, [], edges).tolist()) <= {255, 256, 700, 999}
    assert kernel.draw(library, sparse, [], edges)[:2].tolist() == [255, 999]
    odd = torch.randn(4, 300)
    odd[0, 3], odd[1, 299], odd[2] = float("nan"), float("inf"), float("-inf")
    odd[3, :] = float("-inf")
    odd[3, 17] = 0.0  # (the only finite score: banned)
    assert kernel.draw(library, odd, [17], torch.rand(4, 1, dtype=torch.float64)).tolist() == [
        -1,
        -1,
        -1,
        -1,
    ]


def test_the_decode_loop_draws_with_the_c_where_only_min_new_tokens_processes_and_torch_otherwise(
    monkeypatch,
):
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
    assert (
        torch.equal(drawn, sample_from(torch.softmax(warmer(sequences, logits), dim=-1)))
        and calls == []
    )
