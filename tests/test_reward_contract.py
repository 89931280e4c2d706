"""The reward-function contract: called only on real completions with the live TrainerState; a wrong signature
fails at construction without a call; a bad output or an exception at the first real call names function and row;
NaN/inf refused naming function and row (or read as None on request); a call that hangs past reward_timeout is an
error naming the function and the prompts (async ones cancelled); image columns with a text-only model are refused
before any weight loads (vision-language models: tests/test_vision.py)."""

import asyncio
import math
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import TrainerState

from helpers import conversational, make_args
from rloo import RLOOTrainer
from rloo.rewards.runner import RewardFunctionError, RewardRunner, RewardTimeoutError


def build(tmp_path, model, tokenizer, reward_funcs, dataset=None, **kwargs):
    return RLOOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=make_args(tmp_path, **kwargs),
        train_dataset=dataset if dataset is not None else conversational(8),
        processing_class=tokenizer,
    )


def test_called_only_on_real_completions_with_the_live_state(tmp_path, tokenizer, model):
    calls = []

    def recorder(prompts, completions, completion_ids, trainer_state, **kwargs):
        calls.append(
            {
                "step": trainer_state.global_step,
                "state": trainer_state,
                "texts": completions,
                "ids": completion_ids,
            }
        )
        return [float(len(ids)) for ids in completion_ids]

    async def async_recorder(prompts, completions, trainer_state, **kwargs):
        calls.append({"async": True, "state": trainer_state})
        return [0.0] * len(prompts)

    trainer = build(tmp_path, model, tokenizer, [recorder, async_recorder], max_steps=3)
    assert calls == []  # construction calls no reward function
    trainer.train()
    sync_calls = [call for call in calls if "async" not in call]
    assert [call["step"] for call in sync_calls] == [
        0,
        1,
        2,
    ]  # one generation per step, the step it belongs to
    assert all(
        call["state"] is trainer.state and isinstance(call["state"], TrainerState) for call in calls
    )
    assert len(calls) == 6
    for (
        call
    ) in sync_calls:  # sampled completions: token ids from the policy, text decoded from them
        assert all(ids for ids in call["ids"])
        decoded = tokenizer.batch_decode(call["ids"], skip_special_tokens=True)
        assert [message[0]["content"] for message in call["texts"]] == decoded


@pytest.mark.parametrize(
    "signature, missing",
    [
        ("def reward(completions): return []", "['prompts', 'completion_ids', 'trainer_state'"),
        (
            "def reward(prompts, completions, completion_ids, trainer_state, log_extra, log_metric): return []",
            "['tag']",
        ),
        (
            "def reward(completions, answer, **kwargs): return []",
            "requires the parameter(s) ['answer']",
        ),
    ],
)
def test_wrong_signature_fails_at_construction_without_a_call(
    tmp_path, tokenizer, model, signature, missing
):
    namespace = {"called": []}
    exec(signature.replace("return []", "called.append(1); return []"), namespace)
    with pytest.raises(
        RewardFunctionError,
        match="reward_funcs\\[0\\] 'reward'.*"
        + missing.replace("[", "\\[").replace("]", "\\]").replace("(", "\\(").replace(")", "\\)"),
    ):
        build(tmp_path, model, tokenizer, namespace["reward"])
    assert namespace["called"] == []
    assert not os.path.exists(tmp_path / "out")


def test_every_keyword_by_name_is_accepted(tmp_path, tokenizer, model):
    def explicit(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, tag):
        return [float(t) for t in tag]

    build(tmp_path, model, tokenizer, explicit, max_steps=1).train()


@pytest.mark.parametrize(
    "output, message",
    [
        ([1.0], "'short' returned 1 values for 4 completions"),
        (["good"] * 4, "'short' returned 'good' \\(str\\) for row 0 \\(prompt"),
    ],
)
def test_bad_output_at_the_first_real_call_names_function_and_row(
    tmp_path, tokenizer, model, output, message
):
    def short(completions, **kwargs):
        return output

    trainer = build(tmp_path, model, tokenizer, short)
    with pytest.raises(RewardFunctionError, match=message):
        trainer.train()
    assert trainer.state.global_step == 0


def test_exception_on_a_real_row_names_function_row_and_prompt(tmp_path, tokenizer, model):
    def fragile(prompts, completions, **kwargs):
        if any("cat" in p[0]["content"] for p in prompts):
            raise KeyError("no gold answer")
        return [0.0] * len(prompts)

    trainer = build(
        tmp_path, model, tokenizer, fragile, per_device_train_batch_size=8, shuffle_dataset=False
    )
    # rows 2-3 are the two completions of prompt 1, 'a big cat'
    with pytest.raises(
        RewardFunctionError, match="'fragile' raised KeyError.*on row 2 .*a big cat"
    ):
        trainer.train()
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


def _score(runner, completions=("a", "b", "c")):
    rows = len(completions)
    return runner([f"prompt {i}" for i in range(rows)], list(completions), [[1]] * rows, {}, None)[
        0
    ]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_reward_is_refused_naming_function_and_row(bad):
    def shaky(completions, **kwargs):
        return [1.0, bad, None]

    with pytest.raises(
        RewardFunctionError,
        match=f"'shaky' returned {bad} for row 1 \\(prompt 'prompt 1'\\).*nonfinite_rewards='none'",
    ):
        _score(RewardRunner([shaky], [None]))
    matrix = _score(
        RewardRunner([shaky], [None], nonfinite="none")
    )  # opted in: NaN / inf read as None
    assert matrix[0, 0] == 1.0 and math.isnan(matrix[1, 0]) and math.isnan(matrix[2, 0])


def test_a_hanging_reward_times_out_naming_function_and_prompts():
    release, cancelled, returned = threading.Event(), [], []

    def stuck(completions, **kwargs):
        release.wait(30)
        returned.append(True)
        return [0.0] * len(completions)

    async def stuck_async(completions, **kwargs):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        returned.append(True)
        return [0.0] * len(completions)

    for func, how in ((stuck, "abandoned in its thread"), (stuck_async, "cancelled")):
        with pytest.raises(
            RewardTimeoutError,
            match=f"'{func.__name__}' did not return within reward_timeout=0.3 s "
            f"\\({how}\\).*'prompt 0', 'prompt 1', 'prompt 2'",
        ):
            _score(RewardRunner([func], [None], timeout=0.3))
        assert returned == []  # the error came while the call still hung, not after it returned
    release.set()
    time.sleep(0.2)
    assert cancelled == [True]
    assert (
        _score(RewardRunner([stuck], [None], timeout=5)).tolist() == [[0.0]] * 3
    )  # in time: the same result


def test_reward_settings_reach_the_trainer(tmp_path, tokenizer, model):
    def sometimes_nan(completions, **kwargs):
        return [math.nan if i % 2 else 1.0 for i in range(len(completions))]

    build(tmp_path, model, tokenizer, sometimes_nan, max_steps=1, nonfinite_rewards="none").train()

    def slow(completions, **kwargs):
        time.sleep(2)
        return [0.0] * len(completions)

    trainer = build(tmp_path / "slow", model, tokenizer, slow, max_steps=1, reward_timeout=0.2)
    with pytest.raises(
        RewardTimeoutError, match="'slow' did not return within reward_timeout=0.2 s"
    ):
        trainer.train()
    assert trainer.state.global_step == 0
    with pytest.raises(ValueError, match="reward_timeout=0 must be a positive number of seconds"):
        make_args(tmp_path, reward_timeout=0)
    with pytest.raises(ValueError, match="nonfinite_rewards='skip': use 'error' or 'none'"):
        make_args(tmp_path, nonfinite_rewards="skip")


@pytest.mark.parametrize("column", ["image", "images"])
def test_image_columns_need_a_vision_language_model(tmp_path, tokenizer, model, column):
    dataset = Dataset.from_list([{"prompt": "the dog", column: "pixels"}] * 4)
    with pytest.raises(
        ValueError, match=f"column '{column}' but the model is a text-only LlamaConfig.*rename"
    ):
        build(
            tmp_path,
            model,
            tokenizer,
            lambda completions, **kwargs: [0.0] * len(completions),
            dataset=dataset,
        )
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize(
    "output, mean",
    [
        ([True, False, True, False], 0.5),  # `[c == answer for c in completions]`
        (np.array([True, False, True, True]), 0.75),
        ([np.float32(1.0), np.int64(0), np.bool_(True), None], 2 / 3),
        (np.array([1.0, 0.0, 0.0, 0.0]), 0.25),
        (torch.tensor([1, 0, 1, 1]), 0.75),
    ],
    ids=["bools", "numpy-bools", "numpy-scalars", "numpy-floats", "int-tensor"],
)
def test_bools_and_numpy_rewards_are_floats_as_in_trl(tmp_path, tokenizer, model, output, mean):
    def accuracy(completions, **kwargs):
        return output

    trainer = build(tmp_path, model, tokenizer, accuracy, max_steps=1)
    trainer.train()
    assert trainer.state.log_history[0]["rewards/accuracy/mean"] == pytest.approx(mean)


def test_texts_users_and_trl_tests_match_on(tmp_path, tokenizer, model, caplog):
    """TRL's wording where its users and its test file match on it: the missing train set, a processing-class
    count that does not match, and the warning naming an unscorable row's inputs."""
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        RLOOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [1.0] * len(completions),
            args=make_args(tmp_path),
            processing_class=tokenizer,
        )
    dataset = Dataset.from_list([{"prompt": "a b"}] * 4)
    with pytest.raises(ValueError, match="must match"):
        RLOOTrainer(
            model=model,
            reward_funcs=[lambda completions, **kw: [1.0] * len(completions)] * 2,
            args=make_args(tmp_path),
            train_dataset=dataset,
            processing_class=tokenizer,
            reward_processing_classes=tokenizer,
        )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [1.0] * len(completions)],
        args=make_args(tmp_path),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    assert trainer.reward_processing_classes == [None]  # TRL's list, one entry per reward function
    runner = RewardRunner([lambda completions, **kw: [None, 1.0]], [None])
    with caplog.at_level("WARNING", logger="rloo.rewards.runner"):
        runner(["p0", "p1"], ["c0", "c1"], [[1], [2]], {"tag": ["x", "y"]}, TrainerState())
    assert "All reward functions returned None for the following kwargs:" in caplog.text
    assert (
        "'tag': 'x'" in caplog.text
        and "'prompt': 'p0'" in caplog.text
        and "'completion': 'c0'" in caplog.text
    )
