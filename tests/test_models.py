"""Model handling: PEFT (new adapter and PeftModel in), QLoRA refusal, init kwargs, dropout, remote code, MoE, GC."""

import copy
import weakref

import pytest
import torch
from peft import LoraConfig, get_peft_model

from helpers import (
    assert_same_update,
    conversational,
    length_reward,
    logged,
    make_args,
    position_reward,
    with_lora,
)
from rloo import RLOOTrainer
from rloo.versions import TRANSFORMERS_4
from tiny_models import save_remote_code_model, save_tiny, tiny_causal_lm, tiny_moe_causal_lm

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.engines
def test_lora_trains_adapter_only_and_reference_is_the_base(tmp_path, tokenizer, model):
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=position_reward,
        args=make_args(tmp_path, beta=0.05, max_steps=3),
        train_dataset=conversational(),
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA),
    )
    assert trainer.ref_model is None
    before = snapshot(trainer.model)
    trainer.train()
    after = snapshot(trainer.model)
    lora = [n for n in before if "lora_" in n]
    base = [n for n in before if "lora_" not in n]
    assert len(lora) == 8 and base
    assert all(torch.equal(before[n], after[n]) for n in base), "base weights must never change"
    assert all(not torch.equal(before[n], after[n]) for n in lora if "lora_B" in n)
    assert logged(trainer, "kl")[-1] > 0  # policy moved away from the adapter-free reference


def test_peft_model_passed_in_keeps_its_adapter_as_reference(tmp_path, tokenizer, model):
    peft_model = with_lora(
        model, 0.5, **LORA
    )  # a "trained" adapter (e.g. after SFT): the reference must include it
    initial = copy.deepcopy(peft_model)
    trainer = RLOOTrainer(
        model=peft_model,
        reward_funcs=length_reward,
        args=make_args(tmp_path, beta=0.05, max_steps=2),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    assert "ref" in trainer.model.peft_config
    trainer.train()
    ids = torch.tensor([[3, 10, 11, 12, 13]])
    with torch.no_grad():
        expected = initial(input_ids=ids).logits
        from rloo.adapters import reference_adapter

        with reference_adapter(trainer.model, trainer._trainable_adapter):
            reference = trainer.model(input_ids=ids).logits
        live = trainer.model(input_ids=ids).logits
    assert torch.allclose(reference, expected, atol=1e-6)  # reference = the adapter as it arrived
    assert not torch.allclose(live, expected, atol=1e-4)  # the trainable copy moved
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)


def test_peft_model_and_peft_config_together_is_an_error(tmp_path, tokenizer, model):
    with pytest.raises(ValueError, match="already a PeftModel and peft_config is also given"):
        RLOOTrainer(
            model=get_peft_model(model, LoraConfig(**LORA)),
            reward_funcs=length_reward,
            args=make_args(tmp_path),
            train_dataset=conversational(),
            processing_class=tokenizer,
            peft_config=LoraConfig(**LORA),
        )


def test_peft_targets_matching_nothing(tmp_path, tokenizer, model):
    with pytest.raises(ValueError, match=r"target_modules=.*nope.*matches no layer.*q_proj"):
        RLOOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=make_args(tmp_path),
            train_dataset=conversational(),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=4, target_modules=["nope"]),
        )


def test_quantization_needs_peft_and_bitsandbytes(tmp_path, tokenizer, model):
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True)
    with pytest.raises(ValueError, match="quantization_config is set without peft_config"):
        RLOOTrainer(
            model="/nonexistent/model",
            reward_funcs=length_reward,
            args=make_args(tmp_path),
            train_dataset=conversational(),
            quantization_config=quantization,
        )
    with pytest.raises((ImportError, RuntimeError), match="QLoRA.*(bitsandbytes|CUDA GPU)"):
        RLOOTrainer(
            model="/nonexistent/model",
            reward_funcs=length_reward,
            args=make_args(tmp_path),
            train_dataset=conversational(),
            quantization_config=quantization,
            peft_config=LoraConfig(**LORA),
        )


def test_quantization_config_on_an_instantiated_model_is_ignored_with_a_warning(
    tmp_path, tokenizer, model
):
    """As the TRL docs say: no PEFT, a model object: quantization_config is ignored (not refused)."""
    from transformers import BitsAndBytesConfig

    with pytest.warns(
        UserWarning,
        match="already instantiated: model_init_kwargs and quantization_config are ignored",
    ):
        trainer = RLOOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=make_args(tmp_path, max_steps=1),
            train_dataset=conversational(),
            processing_class=tokenizer,
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        )
    trainer.train()
    assert next(trainer.model.parameters()).dtype == torch.float32


def test_model_init_kwargs_and_float32_default(tmp_path, tokenizer, model):
    model_dir, _ = save_tiny(str(tmp_path / "policy"), model.to(torch.bfloat16), tokenizer)
    default = RLOOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=make_args(tmp_path),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    assert next(default.model.parameters()).dtype == torch.float32  # not the checkpoint's bf16
    chosen = RLOOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=make_args(tmp_path, model_init_kwargs='{"dtype": "bfloat16"}'),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    assert next(chosen.model.parameters()).dtype == torch.bfloat16


def test_disable_dropout_makes_training_forward_deterministic(tmp_path, tokenizer):
    model = tiny_causal_lm(tokenizer, attention_dropout=0.5).train()
    ids = torch.tensor([[3, 10, 11, 12, 13, 14]])
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_args(tmp_path, disable_dropout=True),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    model.train()
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_remote_code_refused_without_trust_remote_code(tmp_path, tokenizer):
    path = save_remote_code_model(str(tmp_path / "remote"), tokenizer)
    with pytest.raises(ValueError, match="custom code.*trust_remote_code=True"):
        RLOOTrainer(
            model=path,
            reward_funcs=length_reward,
            args=make_args(tmp_path),
            train_dataset=conversational(),
            processing_class=tokenizer,
        )
    trainer = RLOOTrainer(
        model=path,
        reward_funcs=length_reward,
        args=make_args(tmp_path, trust_remote_code=True),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    assert type(trainer.model).__name__ == "RemoteForCausalLM"


@pytest.mark.skipif(TRANSFORMERS_4, reason="transformers 4's experts are Linear modules")
def test_a_lora_on_expert_parameters_passed_in_takes_the_base_as_its_reference(
    tmp_path, tokenizer, caplog
):
    """PEFT holds one adapter per model where a LoRA targets parameters (an MoE's fused experts):
    no frozen 'ref' copy is added; the reference is the base with the adapter off, as in TRL, and
    a warning says so; the experts' adapter trains and the base does not move."""
    if "target_parameters" not in LoraConfig.__dataclass_fields__:
        pytest.skip("this PEFT release has no target_parameters")
    base = tiny_moe_causal_lm(tokenizer)
    targets = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    model = get_peft_model(
        base, LoraConfig(r=2, target_parameters=targets, init_lora_weights=False)
    )
    before = snapshot(model)
    with caplog.at_level("WARNING", logger="rloo.adapters"):
        trainer = RLOOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=make_args(tmp_path, beta=0.05, max_steps=1, learning_rate=0.1),
            train_dataset=conversational(),
            processing_class=tokenizer,
        )
    assert "ref" not in trainer.model.peft_config and trainer._trainable_adapter is None
    assert "the KL's reference is the base model" in caplog.text
    trainer.train()
    after = snapshot(trainer.model)
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all("lora_" in name for name in moved)
    ids = torch.tensor([[3, 10, 11, 12, 13]])
    with torch.no_grad():
        from rloo.adapters import reference_adapter

        with reference_adapter(trainer.model, trainer._trainable_adapter):
            reference = trainer.model(input_ids=ids).logits
        with trainer.model.disable_adapter():
            plain = trainer.model(input_ids=ids).logits
    assert torch.equal(reference, plain)


def test_moe_router_aux_loss_is_added_and_logged(tmp_path, tokenizer):
    model = tiny_moe_causal_lm(tokenizer)
    # One micro-batch holds whole groups, on-policy: the surrogate's value is -mean(A) = 0, so the logged loss
    # is exactly coef * aux_loss.
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=make_args(tmp_path, router_aux_loss_coef=0.5, max_steps=2),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    trainer.train()
    aux, loss = logged(trainer, "aux_loss"), logged(trainer, "loss")
    assert len(aux) == 2 and all(a > 0 for a in aux)
    for a, value in zip(aux, loss):
        assert value == pytest.approx(0.5 * a, abs=1e-4)


def test_moe_default_coefficient_and_off(tmp_path, tokenizer):
    default = RLOOTrainer(
        model=tiny_moe_causal_lm(tokenizer, router_aux_loss_coef=0.02),
        reward_funcs=length_reward,
        args=make_args(tmp_path),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    assert default.router_aux_loss_coef == 0.02 and default.aux_loss_enabled  # TRL's attribute too
    off = RLOOTrainer(
        model=tiny_moe_causal_lm(tokenizer),
        reward_funcs=length_reward,
        args=make_args(tmp_path, router_aux_loss_coef=0.0, max_steps=1),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    off.train()
    assert not logged(off, "aux_loss") and not off.aux_loss_enabled


def test_router_aux_loss_on_dense_model_is_an_error(tmp_path, tokenizer, model):
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01.*not a Mixture-of-Experts"):
        RLOOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=make_args(tmp_path, router_aux_loss_coef=0.01),
            train_dataset=conversational(),
            processing_class=tokenizer,
        )


@pytest.mark.engines
def test_gradient_checkpointing_on_and_off_give_the_same_update(tmp_path, tokenizer):
    results = {}
    for checkpointing in (True, False):
        model = tiny_causal_lm(tokenizer)
        trainer = RLOOTrainer(
            model=model,
            reward_funcs=length_reward,
            args=make_args(
                tmp_path / str(checkpointing),
                gradient_checkpointing=checkpointing,
                max_steps=2,
                beta=0.05,
            ),
            train_dataset=conversational(),
            processing_class=tokenizer,
        )
        trainer.train()
        assert model.is_gradient_checkpointing == checkpointing
        results[checkpointing] = snapshot(model)
    # (transformers 4.x: the checkpointed run's forwards take whole rows, the other's share prompts)
    assert_same_update(
        results[True], results[False], snapshot(tiny_causal_lm(tokenizer)), exact=not TRANSFORMERS_4
    )


def test_same_seed_gives_the_same_lora_initialisation(tmp_path, tokenizer):
    import torch as t

    adapters = []
    for index in range(2):
        t.manual_seed(index)  # whatever the global RNG went through before, the seed decides
        trainer = RLOOTrainer(
            model=tiny_causal_lm(tokenizer),
            reward_funcs=length_reward,
            args=make_args(tmp_path, seed=7),
            train_dataset=conversational(),
            processing_class=tokenizer,
            peft_config=LoraConfig(**LORA),
        )
        adapters.append(
            {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_A" in n}
        )
    assert adapters[0] and all(t.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])


def test_model_init_kwargs_revision_also_loads_the_processing_class(
    tmp_path, tokenizer, model, monkeypatch
):
    """Spec: the revision of model_init_kwargs is also used to load the processing class."""
    from transformers import AutoTokenizer

    model_dir, _ = save_tiny(str(tmp_path / "policy"), model, tokenizer)
    tokenizer.save_pretrained(
        model_dir
    )  # a Llama folder: its tokenizer beside it reloads as it was
    calls = []
    original = AutoTokenizer.from_pretrained

    def spy(name, *args, **kwargs):
        calls.append(kwargs.get("revision"))
        return original(name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    RLOOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=make_args(tmp_path, model_init_kwargs={"revision": "main"}),
        train_dataset=conversational(),
    )
    assert calls == ["main"]


def _in_training(model, kind):
    """The model in training mode, as it is ("full") or with a LoRA adapter whose B is not zero ("lora")."""
    if kind == "lora":
        model = with_lora(model, 0.1, **LORA)
    model.train()
    return model


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_shared_prompts_give_the_same_logps_entropy_and_gradients(tokenizer, model, kind):
    """Rows repeating a prompt (left-padded, as the generations of one prompt) run it once and reuse its KV cache."""
    from rloo.logps import per_token_logps

    model = _in_training(model, kind)
    torch.manual_seed(0)
    prompts = torch.randint(3, len(tokenizer), (3, 7))
    prompt_mask = torch.ones_like(prompts)
    prompts[1, :3], prompt_mask[1, :3] = tokenizer.pad_token_id, 0  # a shorter prompt, left padding
    rows = torch.tensor([0, 0, 1, 1, 2, 2, 1, 0])
    completions = torch.randint(3, len(tokenizer), (8, 5))
    completion_mask = torch.ones_like(completions)
    completion_mask[2, 3:] = 0
    input_ids = torch.cat([prompts[rows], completions], dim=1)
    attention_mask = torch.cat([prompt_mask[rows], completion_mask], dim=1)
    results, forwards = {}, []
    decoder = (
        model.get_base_model() if kind == "lora" else model
    ).model  # (shared prompts call it, then the head)
    hook = decoder.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    for share in (False, True):
        model.zero_grad()
        out = per_token_logps(
            model, input_ids, attention_mask, 5, 0.7, with_entropy=True, share_prompts=share
        )
        (out.logps * completion_mask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results[share] = (out.logps.detach(), out.entropy, grads)
    hook.remove()
    assert forwards == [
        (8, 12),
        (3, 7),
        (8, 4),
    ]  # whole rows; then the 3 distinct prompts once, the completions
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-5, rtol=1e-5)
    for shared, whole in zip(results[True][2], results[False][2]):
        torch.testing.assert_close(shared, whole, atol=1e-5, rtol=1e-4)


def test_shared_prompts_under_activation_checkpointing(tokenizer, model):
    """Checkpointed layers keep the shared prompt's cache (written once, so a replay adds nothing) and give the
    gradients of one forward over whole rows; the reentrant variant (no gradients inside its forward) does not share."""
    from rloo.engine.shared_prompts import can_share_prompts
    from rloo.logps import per_token_logps

    input_ids = torch.randint(3, len(tokenizer), (2, 9))
    input_ids[1, :6] = input_ids[0, :6]  # rows 0 and 1 share a 6-token prompt
    input_ids = input_ids[[0, 1, 0]]
    attention_mask = torch.ones_like(input_ids)
    model.train()
    gradients, forwards = [], []
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    for kwargs in (None, {"use_reentrant": False}):
        if kwargs:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.zero_grad()
        # (transformers 4.x's checkpointed layers drop any cache they are given: whole rows there)
        assert can_share_prompts(model) == (not kwargs or not TRANSFORMERS_4)
        per_token_logps(
            model, input_ids, attention_mask, 3, 1.0, share_prompts=True
        ).logps.sum().backward()
        gradients.append([p.grad.clone() for p in model.parameters()])
    hook.remove()
    # the prompt once, then the completions, with and without checkpoints
    assert forwards == [(1, 6), (3, 2)] + ([(3, 9)] if TRANSFORMERS_4 else [(1, 6), (3, 2)])
    for checkpointed, plain in zip(*gradients):
        torch.testing.assert_close(checkpointed, plain, atol=1e-6, rtol=1e-5)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert not can_share_prompts(model)
    with torch.no_grad():
        assert can_share_prompts(model)  # (no backward: nothing to replay)


def test_shared_prompts_let_each_layers_key_and_value_gradients_go_with_its_backward(
    tokenizer, model, monkeypatch
):
    """Each row's copy of its prompt's keys and values is taken in the layer's own forward: the gradient of the
    keys and values the completions attended to is summed per prompt within that layer's backward and freed, not
    held until the backward of every completion layer is over."""
    from rloo import logps
    from rloo.engine import shared_prompts

    grads = []

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = original(self, key_states, value_states, *args, **kwargs)
        for tensor in (keys, values):
            tensor.register_hook(lambda grad: grads.append(weakref.ref(grad.untyped_storage())))
        return keys, values

    original = shared_prompts._ReadOnlyLayer.update
    monkeypatch.setattr(shared_prompts._ReadOnlyLayer, "update", update)
    embedded, alive = [], []
    model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: embedded.append(output)
    )
    model.train()
    input_ids = torch.randint(3, len(tokenizer), (2, 9))
    input_ids = input_ids[[0, 0, 1, 1]]
    out = logps.per_token_logps(
        model, input_ids, torch.ones_like(input_ids), 3, 1.0, share_prompts=True
    )
    assert len(embedded) == 2  # the prompts' forward, then the completions'
    # Its gradient is complete once every completion layer's backward has run.
    embedded[1].register_hook(lambda grad: alive.append(sum(ref() is not None for ref in grads)))
    embedded.clear()
    out.logps.sum().backward()
    assert len(grads) == 2 * model.config.num_hidden_layers and alive == [0]


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_shared_prompts_backward_layer_by_layer_gives_bitwise_the_same_gradients(
    tokenizer, model, monkeypatch, kind
):
    """Each prompt layer's backward runs with its completions' layer (rloo.engine.prompt_layers): the same gradients, bit for
    bit, as autograd's own order, also added to gradients already there (accumulation over micro-batches), under the
    trainer's recomputed activations and tied embedding; no hook is left on a parameter after the backward."""
    from rloo import logps
    from rloo.engine import prompt_layers, tied
    from rloo.engine.recompute import recomputed_activations

    model = _in_training(model, kind)
    torch.manual_seed(0)
    prompts = torch.randint(3, len(tokenizer), (2, 7))
    prompt_mask = torch.ones_like(prompts)
    prompts[1, :3], prompt_mask[1, :3] = tokenizer.pad_token_id, 0
    rows = torch.tensor([0, 0, 1, 1, 1, 0])
    input_ids = torch.cat([prompts[rows], torch.randint(3, len(tokenizer), (6, 5))], dim=1)
    attention_mask = torch.cat([prompt_mask[rows], torch.ones(6, 5, dtype=torch.long)], dim=1)
    boundaries = []
    boundary = prompt_layers.PromptLayers.boundary
    monkeypatch.setattr(
        prompt_layers.PromptLayers,
        "boundary",
        lambda self, *args: boundaries.append(args[0]) or boundary(self, *args),
    )
    results = {}
    for layered in (True, False):
        if not layered:
            monkeypatch.setattr(
                prompt_layers.PromptLayers, "applies", staticmethod(lambda decoder: False)
            )
        model.zero_grad(set_to_none=True)
        for weight in (1.0, 0.5):  # the second backward adds into the gradients the first set
            with recomputed_activations(model), tied.tied_rows(model):
                out = logps.per_token_logps(
                    model, input_ids, attention_mask, 5, 0.7, share_prompts=True
                )
            (out.logps * weight).sum().backward()
        results[layered] = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        assert not any(p._backward_hooks for p in model.parameters())
    layers = (
        model.config.num_hidden_layers
    )  # (the layered runs took that path: a node per layer and the norm)
    assert boundaries == [*range(layers + 1)] * 2
    assert all(torch.equal(layered, plain) for layered, plain in zip(results[True], results[False]))


def test_shared_prompts_free_each_prompt_layer_within_its_completions_layer_backward(
    tokenizer, model
):
    """A prompt layer's activations (here its up projection, which the MLP's backward keeps) are gone by the time the
    completions' backward has reached their first layer's input: freed layer by layer, not after the whole
    completions' backward."""
    from rloo import logps

    model.train()
    up_projections = []  # the prompts' forward (2 distinct prompts) comes first, then the completions' (4 rows)
    for layer in model.model.layers:
        layer.mlp.up_proj.register_forward_hook(
            lambda module, args, output: (
                up_projections.append(weakref.ref(output.untyped_storage()))
                if output.size(0) == 2
                else None
            )
        )
    embedded, alive = [], []
    model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: embedded.append(output)
    )
    input_ids = torch.randint(3, len(tokenizer), (2, 9))[[0, 0, 1, 1]]
    out = logps.per_token_logps(
        model, input_ids, torch.ones_like(input_ids), 3, 1.0, share_prompts=True
    )
    assert len(embedded) == 2 and len(up_projections) == model.config.num_hidden_layers
    embedded[1].register_hook(
        lambda grad: alive.append(sum(ref() is not None for ref in up_projections))
    )
    embedded.clear()
    out.logps.sum().backward()
    assert alive == [0]


def test_a_parameter_with_a_hook_of_its_own_keeps_the_prompts_backward_after_the_completions(
    tokenizer, model, monkeypatch
):
    """A hook on a parameter sees its gradient once per backward, the sum of the prompts' and the completions' parts:
    the prompts' layers then run their backward as autograd orders it (the layered one would show it the prompts'
    part too)."""
    from rloo import logps
    from rloo.engine import prompt_layers

    boundaries, seen = [], []
    boundary = prompt_layers.PromptLayers.boundary
    monkeypatch.setattr(
        prompt_layers.PromptLayers,
        "boundary",
        lambda self, *args: boundaries.append(args[0]) or boundary(self, *args),
    )
    model.train()
    model.model.layers[0].mlp.up_proj.weight.register_hook(lambda grad: seen.append(grad.clone()))
    input_ids = torch.randint(3, len(tokenizer), (2, 9))[[0, 0, 1, 1]]
    logps.per_token_logps(
        model, input_ids, torch.ones_like(input_ids), 3, 1.0, share_prompts=True
    ).logps.sum().backward()
    assert boundaries == [] and len(seen) == 1
    assert torch.equal(seen[0], model.model.layers[0].mlp.up_proj.weight.grad)
