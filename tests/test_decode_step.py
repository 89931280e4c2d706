"""The decode step written out in torch (rloo.engine.decode): its logits against the model's forward with each
GEMM kernel and packing the build has, the fixed-shape form a CUDA graph replays, the models it leaves to `generate`,
and the packed weights kept while they are unchanged."""

import functools

import pytest
import torch

from helpers import DEVICES, PROMPTS, config, with_lora
from rloo.engine import kernel, packing
from rloo.engine.packing import kernels
from rloo.generation import LeanGenerator, TransformersGenerator
from tiny_models import tiny_causal_lm


def _variant(tokenizer, kind):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if kind == "qwen2":  # biases on q/k/v
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                eos_token_id=2,
                pad_token_id=2,
                bos_token_id=None,
            )
        )
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
        if (
            kind == "lora-mixed"
        ):  # k_proj plain beside LoRA q_proj / v_proj of other ranks and scalings
            settings.update(
                target_modules=["q_proj", "v_proj", "up_proj"],
                rank_pattern={"v_proj": 2},
                alpha_pattern={"v_proj": 6},
            )
        if (
            kind == "lora-float64"
        ):  # not packed for MKL: each projection its own product, LoRA written out
            settings.update(lora_alpha=12)
        model = with_lora(model, **settings)
        if kind == "lora-float64":
            model = model.double()
    return model


_KERNELS = kernels()
if (
    "rloo" not in _KERNELS and kernel.compiled() is not None
):  # (built here without AVX2 and FMA: tested, not used)
    _KERNELS["rloo"] = functools.partial(kernel.packed_linear, kernel.compiled())
_PACKABLE = ("llama", "llama-bias", "qwen2", "lora", "lora-mixed")


@pytest.mark.parametrize(
    "kind,gemm",
    [(kind, gemm) for kind in _PACKABLE for gemm in sorted(_KERNELS)] + [("lora-float64", None)],
)
def test_written_out_decode_step_is_the_models_forward(tokenizer, kind, gemm, monkeypatch):
    """rloo.engine.decode: the step's logits are the model's (KV buffers; packed weights with each GEMM kernel
    the build has, q/k/v and gate/up side by side, LoRA merged; or, not packable, LoRA written out; the attention's
    matmuls), and greedy decoding with it gives generate's tokens."""
    from rloo.engine.decode import lean_decoder

    if (
        gemm is not None
    ):  # that kernel alone (MKL's is otherwise used only in a build without oneDNN)
        monkeypatch.setattr(packing, "kernels", lambda: {gemm: _KERNELS[gemm]})
    model = _variant(tokenizer, kind).eval()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    assert lean_decoder(model, len(prompts)) is not None
    generation = config(tokenizer, do_sample=False)
    eos = [tokenizer.eos_token_id]
    ours = LeanGenerator(generation, tokenizer.pad_token_id, eos).generate(model, prompts)
    assert ours == TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(
        model, prompts
    )
    from transformers import DynamicCache

    from rloo.data import pad_rows
    from rloo.kv import cache_argument

    input_ids, mask = pad_rows(prompts, tokenizer.pad_token_id, "left")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    name = cache_argument(model)
    with torch.no_grad():
        model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{name: cache},
        )
        decoder = lean_decoder(model, len(prompts))
        decoder.start(cache, mask, 2)
        tokens, step_positions = torch.tensor([7, 8, 9, 10]), positions[:, -1:] + 1
        mine = decoder.step(tokens, step_positions)
        grown = torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], 1)
        theirs = model(
            input_ids=tokens[:, None],
            attention_mask=grown,
            position_ids=step_positions,
            use_cache=True,
            **{name: cache},
        ).logits[:, -1]
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_the_steps_fixed_shape_form_replayed_as_a_cuda_graph_gives_the_steps_logits(
    tokenizer, model, device, monkeypatch
):
    """On a GPU the decode steps replay CUDA graphs of LeanDecoder._graph_step, one per attention length (the position
    a tensor, attention over the buffers' first positions, zero where not yet written); step after step their logits
    are those of the step as it runs elsewhere (the position an int, attention over the positions written). On the
    CPU the fixed-shape form is run as it is, with the torch step (the C's off) as on a GPU."""
    from transformers import DynamicCache

    from rloo.data import pad_rows
    from rloo.engine.decode import LeanDecoder, lean_decoder

    monkeypatch.setattr(kernel, "for_decoding", lambda: None)
    monkeypatch.setattr(
        LeanDecoder, "GRAPH_LENGTH", 4
    )  # (graphs of lengths 8, then the buffers' 14)
    model.to(device).eval()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    input_ids, mask = (t.to(device) for t in pad_rows(prompts, tokenizer.pad_token_id, "left"))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            past_key_values=cache,
        ).logits[:, -1]
        stepped, fixed = lean_decoder(model, len(prompts)), lean_decoder(model, len(prompts))
        for decoder in (stepped, fixed):
            decoder.start(cache, mask, 8)
        assert (fixed.graphs is not None) == (device == "cuda")
        stepped.graphs = None
        for buffer in fixed.keys + fixed.values:
            buffer[:, :, mask.size(1) :].zero_()
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
    assert (
        mask.size(1) == 6 and lengths == [8] * 2 + [14] * 5
    )  # (positions 6-7 in 8's graph, 8-12 in the buffers')
    if device == "cuda":
        assert sorted(fixed.graphs) == [8, 14]  # each captured once, then replayed


def test_models_the_decode_step_does_not_write_out_keep_their_forward(tokenizer):
    from rloo.engine.decode import lean_decoder
    from tiny_models import tiny_moe_causal_lm

    assert lean_decoder(tiny_moe_causal_lm(tokenizer), 2) is None  # Mixtral: experts
    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(
        MistralConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
        )
    )
    assert lean_decoder(mistral, 2) is None  # a sliding window


def test_the_decode_steps_fused_operations_give_the_modules_values(tokenizer, model):
    """rloo.engine.decode: a Llama norm as one torch.rms_norm call, the rotation as a roll with sin's first half
    negated: the same values, bit for bit, as the module and as apply_rotary_pos_emb."""
    from transformers.models.llama.modeling_llama import rotate_half

    from rloo.engine.decode import _norm

    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(4, 1, norm.weight.size(0))
        assert _norm(norm) is not norm and torch.equal(_norm(norm)(x), norm(x))
    x, cos, sin = torch.randn(4, 6, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    signed = torch.cat([-sin[..., :4], sin[..., 4:]], dim=-1)
    assert torch.equal(x * cos + x.roll(4, -1) * signed, x * cos + rotate_half(x) * sin)


def test_weights_are_packed_for_onednn_and_for_mkl_only_in_a_build_without_it(monkeypatch):
    """rloo.engine.packing.packed_linear: oneDNN's kernel where the build has it, nothing else packed or timed
    (MKL's packed copy is up to 21x the weight's size: a fresh mapping on every generation call); MKL's in a build
    without oneDNN; packing draws no random numbers."""
    import functools

    import torch.nn.functional as F

    from rloo.engine import decode

    built = []

    def kernel(name):
        def make(weight, bias, rows):
            built.append((name, rows))
            return functools.partial(F.linear, weight=weight, bias=bias)

        return make

    monkeypatch.setattr(packing, "onednn_linear", kernel("onednn"))
    monkeypatch.setattr(packing, "mkl_linear", kernel("mkl"))
    monkeypatch.setattr(decode.kernel_module, "for_decoding", lambda: None)  # (ours: its own test)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    weight, bias, x = torch.randn(6, 5), torch.randn(6), torch.randn(3, 1, 5)
    random_state = torch.random.get_rng_state()
    linear = packing.packed_linear(weight, bias, 3)
    assert built == [("onednn", 3)]
    assert torch.equal(
        torch.random.get_rng_state(), random_state
    )  # sampling after it draws what it would have
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias))
    built.clear()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    packing.packed_linear(weight, bias, 3)
    assert built == [("mkl", 3)]


def _counting_builds(monkeypatch):
    from rloo.engine import lean
    from rloo.engine.decode import lean_decoder

    built = []

    def counted(model, rows):
        built.append(rows)
        return lean_decoder(model, rows)

    monkeypatch.setattr(lean, "lean_decoder", counted)
    return built


def test_packed_weights_are_reused_inside_reusing_weights_until_a_weight_or_adapter_changes(
    tokenizer, monkeypatch
):
    """LeanGenerator.reusing_weights: a call inside takes the previous call's packed decoder while the model, the
    rows, every parameter and the adapters' settings are unchanged; any change packs anew (the tokens are those of a
    generator that packs every time), and leaving drops the copy."""
    built = _counting_builds(monkeypatch)
    model = _variant(tokenizer, "lora").eval()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    generation = config(tokenizer, do_sample=False)
    eos = [tokenizer.eos_token_id]

    def fresh(rows):
        return TransformersGenerator(generation, tokenizer.pad_token_id, eos).generate(model, rows)

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
        assert generator.generate(model, prompts[:3]) == fresh(prompts[:3]) and built == [
            4,
            4,
            4,
            3,
        ]  # other rows
        assert generator.loop._kept is not None
    assert generator.loop._kept is None


def test_trainer_evaluation_packs_once_and_training_on_every_call(
    tmp_path, tokenizer, model, monkeypatch
):
    """RLOOTrainer.evaluate generates every batch inside reusing_weights (one packed copy for all of them);
    training packs on each call and keeps nothing through its backward."""
    from helpers import conversational, length_reward, make_args
    from rloo import RLOOTrainer

    built = _counting_builds(monkeypatch)
    args = make_args(tmp_path, per_device_eval_batch_size=4, max_steps=1)
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational(),
        eval_dataset=conversational(8),
        processing_class=tokenizer,
    )
    assert isinstance(trainer.generator, LeanGenerator)
    trainer.evaluate()  # 8 prompts x 2 generations in batches of 4 rows
    assert built == [4]
    trainer.train()
    assert built == [4, 4] and trainer.generator.loop._kept is None
