"""Exact resume: an interrupted-and-resumed run ends with the same weights as an uninterrupted one."""

import os

import pytest
import torch

from transformers import TrainerCallback

from rloo import RLOOTrainer
from rloo.testing import tiny_causal_lm

from helpers import conversational, length_reward, make_args

# generation_batch_size 16 with per_device_train_batch_size 4 -> steps_per_generation 4 over GA 2: a checkpoint
# after optimizer step 1 (micro-step 2) falls in the middle of a generation buffer, off-policy slices pending.
MID_BUFFER = dict(max_steps=4, gradient_accumulation_steps=2, generation_batch_size=16, num_generations=4)


class Interrupt(TrainerCallback):
    """Stops the run after optimizer step `at`, once its checkpoint is written (a preemption, a crash)."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_training_stop = True


def train(tmp_path, tokenizer, resume=None, interrupt_at=None, **kwargs):
    trainer = RLOOTrainer(model=tiny_causal_lm(tokenizer), reward_funcs=length_reward,
                          args=make_args(tmp_path, **kwargs), train_dataset=conversational(16),
                          processing_class=tokenizer,
                          callbacks=[Interrupt(interrupt_at)] if interrupt_at else None)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("extra", [{}, {"num_iterations": 2, "beta": 0.05},
                                   {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1}],
                         ids=["buffer", "iterations+kl", "tr-dpo"])
def test_resume_mid_buffer_matches_uninterrupted_run(tmp_path, tokenizer, extra):
    settings = {**MID_BUFFER, **extra}
    full = train(tmp_path / "full", tokenizer, **settings)
    train(tmp_path / "cut", tokenizer, save_strategy="steps", save_steps=1, interrupt_at=1, **settings)
    checkpoint = tmp_path / "cut" / "out" / "checkpoint-1"
    state = torch.load(checkpoint / "rloo_state" / "rank0.pt", weights_only=False)
    assert state["step"] % 4 != 0 and state["buffered_inputs"] is not None  # really mid-buffer
    resumed = train(tmp_path / "cut", tokenizer, resume=True, **settings)  # True = latest checkpoint
    assert resumed.state.global_step == 4
    resumed_again = train(tmp_path / "cut2", tokenizer, resume=str(checkpoint), **settings)
    for trainer in (resumed, resumed_again):
        for (name, a), b in zip(full.model.named_parameters(), trainer.model.parameters()):
            assert torch.allclose(a, b, atol=1e-6), name
    if extra.get("sync_ref_model"):
        for a, b in zip(full.ref_model.parameters(), resumed_again.ref_model.parameters()):
            assert torch.allclose(a, b, atol=1e-6)
    full_rewards = [log["reward"] for log in full.state.log_history if "reward" in log]
    resumed_rewards = [log["reward"] for log in resumed_again.state.log_history if "reward" in log]
    assert resumed_rewards == pytest.approx(full_rewards)  # history restored up to step 1, then regenerated


def checkpoint_of(tmp_path, tokenizer, **kwargs):
    train(tmp_path, tokenizer, max_steps=1, save_strategy="steps", save_steps=1, **kwargs)
    return str(tmp_path / "out" / "checkpoint-1")


def test_resume_refuses_different_num_generations(tmp_path, tokenizer):
    checkpoint = checkpoint_of(tmp_path, tokenizer)
    with pytest.raises(ValueError, match="num_generations=2, this run has 4"):
        train(tmp_path / "b", tokenizer, resume=checkpoint, num_generations=4, max_steps=2)


def test_resume_refuses_a_different_model(tmp_path, tokenizer):
    checkpoint = checkpoint_of(tmp_path, tokenizer)
    other = RLOOTrainer(model=tiny_causal_lm(tokenizer, hidden_size=48), reward_funcs=length_reward,
                        args=make_args(tmp_path / "b", max_steps=2), train_dataset=conversational(16),
                        processing_class=tokenizer)
    with pytest.raises(ValueError, match="trained from a different model"):
        other.train(resume_from_checkpoint=checkpoint)
    assert not os.path.exists(tmp_path / "b" / "out" / "checkpoint-2")


def test_latest_checkpoint_skips_one_whose_save_was_interrupted(tmp_path):
    """A save killed before trainer_state.json (transformers writes it last) leaves a folder resume must not take."""
    import json

    from rloo.checkpoint import latest_checkpoint
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    (tmp_path / "checkpoint-6" / "trainer_state.json").write_text('{"global_st')  # truncated mid-write
    with pytest.warns(UserWarning, match="checkpoint-6 is incomplete"):
        assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")
    assert latest_checkpoint(str(tmp_path / "missing")) is None
