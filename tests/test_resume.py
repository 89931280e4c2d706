"""Exact resume: an interrupted-and-resumed run ends with the same weights as an uninterrupted one."""

import os
import re

import pytest
import torch
from transformers import TrainerCallback

from helpers import conversational, length_reward, make_args
from rloo import RLOOTrainer
from tiny_models import tiny_causal_lm

# generation_batch_size 16 with per_device_train_batch_size 4 -> steps_per_generation 4 over GA 2: a checkpoint
# after optimizer step 1 (micro-step 2) falls in the middle of a generation buffer, off-policy slices pending.
MID_BUFFER = dict(
    max_steps=4, gradient_accumulation_steps=2, generation_batch_size=16, num_generations=4
)


class Interrupt(TrainerCallback):
    """Stops the run after optimizer step `at`, once its checkpoint is written (a preemption, a crash)."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_training_stop = True


def train(tmp_path, tokenizer, resume=None, interrupt_at=None, **kwargs):
    trainer = RLOOTrainer(
        model=tiny_causal_lm(tokenizer),
        reward_funcs=length_reward,
        args=make_args(tmp_path, **kwargs),
        train_dataset=conversational(16),
        processing_class=tokenizer,
        callbacks=[Interrupt(interrupt_at)] if interrupt_at else None,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"num_iterations": 2, "beta": 0.05},
        {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1},
    ],
    ids=["buffer", "iterations+kl", "tr-dpo"],
)
@pytest.mark.engines
def test_resume_mid_buffer_matches_uninterrupted_run(tmp_path, tokenizer, extra):
    settings = {**MID_BUFFER, **extra}
    full = train(tmp_path / "full", tokenizer, **settings)
    train(
        tmp_path / "cut", tokenizer, save_strategy="steps", save_steps=1, interrupt_at=1, **settings
    )
    checkpoint = tmp_path / "cut" / "out" / "checkpoint-1"
    state = torch.load(checkpoint / "rloo_state" / "rank0.pt", weights_only=False)
    assert state["step"] % 4 != 0 and state["buffered_inputs"] is not None  # really mid-buffer
    resumed = train(
        tmp_path / "cut", tokenizer, resume=True, **settings
    )  # True = latest checkpoint
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
    assert resumed_rewards == pytest.approx(
        full_rewards
    )  # history restored up to step 1, then regenerated


def checkpoint_of(tmp_path, tokenizer, **kwargs):
    train(tmp_path, tokenizer, max_steps=1, save_strategy="steps", save_steps=1, **kwargs)
    return str(tmp_path / "out" / "checkpoint-1")


def test_resume_refuses_different_num_generations(tmp_path, tokenizer):
    checkpoint = checkpoint_of(tmp_path, tokenizer)
    with pytest.raises(ValueError, match="num_generations=2, this run has 4"):
        train(tmp_path / "b", tokenizer, resume=checkpoint, num_generations=4, max_steps=2)


def test_resume_refuses_a_different_model(tmp_path, tokenizer):
    checkpoint = checkpoint_of(tmp_path, tokenizer)
    other = RLOOTrainer(
        model=tiny_causal_lm(tokenizer, hidden_size=48),
        reward_funcs=length_reward,
        args=make_args(tmp_path / "b", max_steps=2),
        train_dataset=conversational(16),
        processing_class=tokenizer,
    )
    with pytest.raises(ValueError, match="trained from a different model"):
        other.train(resume_from_checkpoint=checkpoint)
    assert not os.path.exists(tmp_path / "b" / "out" / "checkpoint-2")


def test_resume_skips_incomplete_or_corrupt_checkpoints_and_rotation_keeps_a_complete_one(
    tmp_path, tokenizer
):
    """A checkpoint counts once its completion marker (written last, after every file) is there and its files
    still match it; save_total_limit rotates only after the marker."""
    from rloo.checkpoint import is_complete, latest_checkpoint, marker_path, resolve_resume

    train(tmp_path, tokenizer, max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=2)
    out = tmp_path / "out"
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-3",
    ]
    assert is_complete(str(out / "checkpoint-2")) and is_complete(str(out / "checkpoint-3"))
    os.remove(marker_path(str(out / "checkpoint-3")))  # as if killed before the marker
    with pytest.warns(
        UserWarning, match="checkpoint-3 cannot be resumed from: no completion marker"
    ):
        assert latest_checkpoint(str(out)) == str(out / "checkpoint-2")
    weights = next(
        out / "checkpoint-2" / f
        for f in os.listdir(out / "checkpoint-2")
        if f.endswith(".safetensors")
    )
    with open(weights, "r+b") as handle:  # a truncated weight file
        handle.truncate(os.path.getsize(weights) // 2)
    with pytest.warns(UserWarning) as caught:
        assert latest_checkpoint(str(out)) is None
    assert "checkpoint-3 cannot be resumed from: no completion marker" in str(caught[0].message)
    assert re.search(
        r"checkpoint-2 cannot be resumed from: .*safetensors has \d+ bytes, \d+ were written \(truncated",
        str(caught[1].message),
    )
    with pytest.raises(ValueError, match="cannot be resumed from: .*truncated"):
        resolve_resume(str(out / "checkpoint-2"), str(out))
    assert latest_checkpoint(str(tmp_path / "missing")) is None


def test_resuming_a_run_that_had_finished_trains_no_step_past_max_steps(tmp_path, tokenizer):
    """Killed after its last step, before it exited: `latest` is checkpoint-max_steps, and transformers alone would
    train one step more (global_step 3 and a checkpoint-3 in a 2-step run, seen before this fix)."""
    full = train(tmp_path, tokenizer, max_steps=2, save_strategy="steps", save_steps=1)
    with pytest.warns(
        UserWarning, match="checkpoint-2 is at step 2 = max_steps: the run had finished"
    ):
        resumed = train(
            tmp_path, tokenizer, resume=True, max_steps=2, save_strategy="steps", save_steps=1
        )
    assert resumed.state.global_step == 2
    assert sorted(d for d in os.listdir(tmp_path / "out") if d.startswith("checkpoint-")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert [log["step"] for log in resumed.state.log_history if "reward" in log] == [1, 2]
