"""rloo.engine.recompute: the loss's forward keeps no activation that its backward can make again, and the gradients are
bitwise the model's own."""

import contextlib
import gc
import weakref

import pytest
import torch

from helpers import conversational, make_args, position_reward, with_lora
from rloo import RLOOTrainer
from rloo.engine import recompute
from rloo.logps import per_token_logps
from tiny_models import tiny_causal_lm


def _model(tokenizer, kind):
    if kind == "qwen2":  # biases on q/k/v, Qwen2's own norm and MLP classes
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        return Qwen2ForCausalLM(
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
    model = tiny_causal_lm(tokenizer, tie_word_embeddings=kind == "tied")
    if kind == "lora":
        model = with_lora(model)
    return model.to(torch.bfloat16) if kind == "bfloat16" else model


def _rows():
    """2 prompts x 2 rows (the shared-prompt path), one prompt left-padded, completions of 5 with end padding."""
    torch.manual_seed(1)
    prompts = torch.randint(3, 50, (2, 6)).repeat_interleave(2, dim=0)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[2:, :2] = 0
    completions = torch.randint(3, 50, (4, 5))
    completion_mask = torch.ones_like(completions)
    completion_mask[1, 3:] = 0
    return torch.cat([prompts, completions], 1), torch.cat([prompt_mask, completion_mask], 1)


def _logps_and_grads(model, recomputed: bool):
    model.train()
    model.zero_grad(set_to_none=True)
    ids, mask = _rows()
    with recompute.recomputed_activations(model if recomputed else None) as covered:
        out = per_token_logps(model, ids, mask, 5, 0.7, with_entropy=True, share_prompts=True)
    (out.logps.float() * mask[:, -5:]).sum().backward()
    grads = {
        name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad
    }
    return covered, out.logps.detach(), out.entropy, grads


@pytest.mark.parametrize("kind", ["llama", "tied", "qwen2", "lora", "bfloat16"])
def test_recomputed_activations_give_the_models_own_logps_and_gradients(tokenizer, kind):
    model = _model(tokenizer, kind)
    covered, logps, entropy, grads = _logps_and_grads(model, recomputed=True)
    _, logps_plain, entropy_plain, grads_plain = _logps_and_grads(model, recomputed=False)
    assert covered == 7  # 2 x 2 layer norms + the final norm, 2 MLPs
    assert torch.equal(logps, logps_plain) and torch.equal(entropy, entropy_plain)
    assert grads.keys() == grads_plain.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert torch.equal(grad, grads_plain[name]), name
    assert all(
        "forward" not in module.__dict__ for module in model.modules()
    )  # the model is as it was


def test_recomputable_activations_are_not_kept_for_the_backward(tokenizer, monkeypatch):
    """Every tensor registered as recomputable (norm outputs, the MLP's activation and product, the repeated keys
    and values) is freed once the forward is over, while the graph that needs it lives on; without the saved-tensor
    hooks the graph keeps them. A module whose forward is not Llama's is left alone, and so is a model under ZeRO-3."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    from rloo.engine.registry import registry

    kinds = [registry().get(cls) for cls in (LlamaRMSNorm, LlamaMLP, GemmaRMSNorm)]
    assert kinds == ["norm", "mlp", None]
    model = tiny_causal_lm(tokenizer)
    registered = []
    add = recompute._Recipes.add
    monkeypatch.setattr(
        recompute._Recipes,
        "add",
        lambda self, tensor, make: (
            registered.append(weakref.ref(tensor)) or add(self, tensor, make)
        ),
    )
    ids, mask = _rows()

    def alive_after_forward():
        registered.clear()
        with recompute.recomputed_activations(model):
            out = per_token_logps(model, ids, mask, 5, 1.0, share_prompts=True)
        gc.collect()
        return out, [ref for ref in registered if ref() is not None]

    out, alive = alive_after_forward()
    # prompts' and completions' forwards: 5 norms x 2 (normalised, scaled), 2 MLPs x 2, 2 layers' keys and values
    assert len(registered) == 2 * (5 * 2 + 2 * 2 + 2 * 2)
    assert alive == []
    out.logps.sum().backward()
    model.lm_head.weight.ds_id = 0  # as DeepSpeed marks a ZeRO-3 parameter: the model runs as it is
    with recompute.recomputed_activations(model) as covered:
        assert covered == 0
    del model.lm_head.weight.ds_id
    monkeypatch.setattr(
        recompute, "saved_tensors_hooks", lambda pack, unpack: contextlib.nullcontext()
    )
    out, alive = alive_after_forward()
    assert len(alive) > len(registered) // 2


def test_the_loss_forward_recomputes_activations_unless_layers_are_checkpointed(
    tmp_path, tokenizer, monkeypatch
):
    seen = []
    real = recompute.recomputed_activations

    @contextlib.contextmanager
    def recording(model):
        with real(model) as covered:
            seen.append(covered)
            yield covered

    monkeypatch.setattr(recompute, "recomputed_activations", recording)
    for checkpointed in (False, True):
        seen.clear()
        trainer = RLOOTrainer(
            model=tiny_causal_lm(tokenizer),
            reward_funcs=position_reward,
            args=make_args(
                tmp_path / str(checkpointed), max_steps=1, gradient_checkpointing=checkpointed
            ),
            train_dataset=conversational(),
            processing_class=tokenizer,
        )
        trainer.train()
        assert seen == ([0] if checkpointed else [7])


def test_what_a_recipe_needs_goes_with_its_layers_backward(tokenizer):
    """The gate and up projections a recipe makes the MLP's product from are freed once their own layer's backward
    has run, not held by the forward's recipe book until the whole graph's backward is done (measured: 0.12 GiB of
    the SmolLM2 benchmark's peak)."""
    model = tiny_causal_lm(tokenizer)
    model.train()
    outputs = []
    for layer in model.model.layers:
        for projection in (layer.mlp.gate_proj, layer.mlp.up_proj):
            projection.register_forward_hook(
                lambda module, args, output: outputs.append(weakref.ref(output))
            )
    alive_at_the_end = []
    model.model.layers[0].self_attn.q_proj.weight.register_post_accumulate_grad_hook(
        lambda param: alive_at_the_end.append(sum(ref() is not None for ref in outputs))
    )
    ids, mask = _rows()
    with recompute.recomputed_activations(model):
        out = per_token_logps(model, ids, mask, 5, 1.0, share_prompts=True)
    assert len(outputs) == 2 * 2 * 2 and all(
        ref() is not None for ref in outputs
    )  # 2 passes x 2 layers x 2
    out.logps.sum().backward()
    assert alive_at_the_end == [0]
