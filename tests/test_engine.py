"""rloo.engine, the speed layer: one switch turns it off, it says which parts it took, the same gradients either
way, and a registered module class whose forward changed is left to itself with a warning."""

import copy
import logging
import sys
import types

import pytest
import torch

from helpers import conversational, make_args, position_reward
from rloo import RLOOTrainer, engine
from rloo.engine import registry
from rloo.generation import LeanGenerator, TransformersGenerator
from tiny_models import tiny_reward_model


def test_the_switch_from_the_environment_and_the_config(tmp_path, monkeypatch):
    monkeypatch.delenv("RLOO_ENGINE", raising=False)
    assert make_args(tmp_path).engine == "fast"
    monkeypatch.setenv("RLOO_ENGINE", "reference")
    assert make_args(tmp_path).engine == "reference"
    assert make_args(tmp_path, engine="fast").engine == "fast"  # the config's field wins
    monkeypatch.setenv("RLOO_ENGINE", "quick")
    with pytest.raises(ValueError, match="RLOO_ENGINE='quick': use 'fast'"):
        make_args(tmp_path)
    with pytest.raises(ValueError, match="engine='off': use 'fast'"):
        make_args(tmp_path, engine="off")


def test_reference_mode_generates_with_generate_and_runs_plain_forwards(
    tmp_path, tokenizer, model, monkeypatch, caplog
):
    from rloo.engine import heap, recompute, shared_prompts, tied

    touched = []
    for module, name in (
        (shared_prompts, "shared_prompt_logits"),
        (recompute, "recomputed_activations"),
        (tied, "tied_rows"),
        (heap, "keep_freed_memory"),
    ):  # none of them called
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: touched.append(_name))
    caplog.set_level(logging.INFO, logger="rloo.trainer")
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=position_reward,
        processing_class=tokenizer,
        args=make_args(tmp_path, engine="reference", beta=0.1, max_steps=1),
        train_dataset=conversational(),
    )
    assert type(trainer.generator) is TransformersGenerator
    assert (
        getattr(trainer.ref_model, "_rloo_mapping", None) is None
    )  # a plain copy, not a mapped one
    trainer.train()
    assert touched == []
    assert any("rloo engine: reference" in record.message for record in caplog.records)
    with pytest.raises(ValueError, match="speed layer is off"):
        make_args(tmp_path, engine="reference", beta=0.1, kl_logps_from_generation=True)


def test_the_start_line_names_each_fast_path(tmp_path, tokenizer, model, caplog):
    caplog.set_level(logging.INFO, logger="rloo.trainer")
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=position_reward,
        processing_class=tokenizer,
        args=make_args(tmp_path, engine="fast"),
        train_dataset=conversational(),
    )
    assert isinstance(trainer.generator, LeanGenerator)
    line = next(
        record.message for record in caplog.records if record.message.startswith("rloo engine:")
    )
    for part in (
        "decode loop: on",
        "shared prompts: on",
        "recomputed activations: on",
        "mapped reference: off (no separate reference model)",
        "freed memory kept: on",
    ):
        assert part in line, line
    assert (
        "tied-embedding rows: "
        + ("on" if model.config.tie_word_embeddings else "off (untied model)")
        in line
    )


def test_the_same_gradients_for_the_same_samples_in_both_modes(tmp_path, tokenizer, model):
    """One rollout, then the loss's gradient with the speed layer on and off (shared prompts, recomputed
    activations and tied rows against one plain forward): equal to float rounding."""
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=position_reward,
        processing_class=tokenizer,
        args=make_args(tmp_path, engine="fast", beta=0.1),
        train_dataset=conversational(),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    rollout = trainer._prepare_inputs(batch)
    gradients = {}
    for fast in (True, False):
        trainer._fast = fast
        trainer.model.zero_grad()
        trainer.compute_loss(trainer.model, copy.copy(rollout)).backward()
        gradients[fast] = {
            name: p.grad.clone()
            for name, p in trainer.model.named_parameters()
            if p.grad is not None
        }
    assert gradients[True].keys() == gradients[False].keys() and gradients[True]
    for name, grad in gradients[True].items():
        torch.testing.assert_close(grad, gradients[False][name], atol=1e-6, rtol=1e-5, msg=name)


def test_a_registered_class_whose_forward_changed_keeps_its_own_forward(
    tokenizer, model, monkeypatch, caplog
):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.setattr(registry, "_verdicts", {})
    norm = next(module for module in model.modules() if type(module) is LlamaRMSNorm)
    assert registry.kind_of(norm) == "norm"
    own = LlamaRMSNorm.forward
    monkeypatch.setattr(registry, "_verdicts", {})
    monkeypatch.setattr(LlamaRMSNorm, "forward", lambda self, x: own(self, x) * 1.5)
    caplog.set_level(logging.WARNING, logger="rloo.engine.registry")
    state = torch.get_rng_state()
    assert registry.kind_of(norm) is None and registry.kind_of(norm) is None
    assert torch.equal(
        torch.get_rng_state(), state
    )  # the check draws nothing from the run's generator
    warnings = [record.message for record in caplog.records if "LlamaRMSNorm" in record.message]
    assert len(warnings) == 1 and "fast path is off" in warnings[0]
    from rloo.engine.recompute import covered_modules

    assert covered_modules(model) == sum(type(m).__name__ == "LlamaMLP" for m in model.modules())
    assert engine.describe(True, model, "TransformersGenerator", None).startswith(
        "rloo engine: decode loop: off (TransformersGenerator generates)"
    )


def test_liger_kernels_are_refused_without_the_package_and_take_the_reference_path(
    tmp_path, tokenizer, model, monkeypatch, caplog
):
    """Liger's kernels replace the model's own modules: the speed layer's forwards would bypass them, so the
    model takes the reference path; without liger-kernel the flag is refused before any model is loaded."""
    import transformers.trainer
    import transformers.utils

    # (transformers 4.x's Trainer checks it under the name it imported)
    for module in (transformers.utils, transformers.trainer):
        monkeypatch.setattr(module, "is_liger_kernel_available", lambda: False, raising=False)
    with pytest.raises(ValueError, match="liger-kernel is not installed.*pip install liger-kernel"):
        make_args(tmp_path, use_liger_kernel=True)
    for module in (transformers.utils, transformers.trainer):
        monkeypatch.setattr(module, "is_liger_kernel_available", lambda: True, raising=False)
    # (Liger itself needs Triton and a GPU: a stand-in of the one function transformers 4.x's Trainer calls at
    # construction, to patch the model's modules in place)
    stand_in = types.ModuleType("liger_kernel.transformers")
    stand_in._apply_liger_kernel_to_instance = lambda model, **kwargs: None
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", stand_in)
    caplog.set_level(logging.INFO, logger="rloo.trainer")
    monkeypatch.setattr(logging.getLogger("rloo.trainer"), "propagate", True)
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=position_reward,
        processing_class=tokenizer,
        args=make_args(tmp_path, use_liger_kernel=True),
        train_dataset=conversational(),
    )
    assert type(trainer.generator) is TransformersGenerator and not trainer._fast
    assert any(
        record.message.startswith("rloo engine: reference (use_liger_kernel")
        for record in caplog.records
    )


def test_torch_compile_trains_the_compiled_model_to_the_same_update(tmp_path, tokenizer, model):
    """torch_compile (accelerate's dynamo plugin; the eager backend here, to stay quick) compiles the model the
    loss's forward runs, not a reward model (dynamo's trace of a compiled one fails in transformers' forward);
    the step equals the uncompiled one."""
    steps = {}
    for compiled in (False, True):
        policy = copy.deepcopy(model)
        extra = dict(torch_compile=True, torch_compile_backend="eager") if compiled else {}
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)  # the step is the gradient
        trainer = RLOOTrainer(
            model=policy,
            reward_funcs=[position_reward, tiny_reward_model(tokenizer)],
            processing_class=tokenizer,
            reward_processing_classes=[None, tokenizer],
            args=make_args(tmp_path / str(compiled), max_steps=1, max_grad_norm=0.0, **extra),
            train_dataset=conversational(),
            optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)),
        )
        trainer.train()
        assert (type(trainer.model_wrapped).__name__ == "OptimizedModule") is compiled
        steps[compiled] = {name: p.detach().clone() for name, p in policy.named_parameters()}
    for name, value in steps[True].items():
        torch.testing.assert_close(value, steps[False][name], atol=1e-6, rtol=1e-5, msg=name)
    assert any(
        not torch.equal(value, p.detach())
        for (name, value), p in zip(steps[True].items(), model.parameters())
    )
