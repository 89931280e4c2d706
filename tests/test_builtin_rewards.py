"""Built-in rewards against hand-computed values, and through the trainer."""

import sys

import pytest
from datasets import Dataset

from helpers import make_args
from rloo import RLOOTrainer
from rloo.rewards import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)


def chat(text):
    return [{"role": "assistant", "content": text}]


def test_accuracy_reward_checks_latex_answers():
    pytest.importorskip("math_verify")
    extra = {}
    completions = [
        chat(r"So $\boxed{0.5}$."),
        chat(r"$\boxed{3}$"),
        chat("I think one half"),
        chat("x"),
        r"The answer is $\frac{2}{4}$",
    ]
    solutions = [r"$\frac{1}{2}$", "$4$", r"$\frac{1}{2}$", "not math at all", "$0.5$"]
    rewards = accuracy_reward(
        completions, solutions, log_extra=lambda name, values: extra.__setitem__(name, values)
    )
    assert rewards == [1.0, 0.0, 0.0, None, 1.0]
    assert extra["solution"] == solutions and extra["gold_parsed"][3] is None
    assert extra["answer_parsed"][0] == "0.500000000000000" and extra["answer_parsed"][2] is None


def test_accuracy_reward_without_math_verify_fails_before_training(
    tmp_path, tokenizer, model, monkeypatch
):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    dataset = Dataset.from_list([{"prompt": "one plus one", "solution": "$2$"}] * 4)
    with pytest.raises(Exception, match=r"pip install 'rloo\[math\]'"):
        RLOOTrainer(
            model=model,
            reward_funcs=accuracy_reward,
            args=make_args(tmp_path),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    assert not (tmp_path / "out").exists()


def test_think_format_reward():
    completions = [
        "<think>a</think>42",
        "<think>a</think>",
        "42",
        "<think>a<think>b</think>",
        " <think>a</think>",
        "<think>multi\nline</think>\nanswer",
    ]
    assert think_format_reward(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert think_format_reward([chat("<think>x</think>y")]) == [1.0]


def test_soft_overlong_punishment_dapo_eq13():
    punish = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    lengths = [0, 6, 7, 8, 10, 11]
    assert punish([[1] * n for n in lengths]) == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert punish.__name__ == "soft_overlong_punishment"
    with pytest.raises(ValueError, match="soft_punish_cache=12"):
        get_soft_overlong_punishment(10, 12)


def test_reasoning_accuracy_reward_scores_what_follows_the_reasoning():
    pytest.importorskip("math_verify")
    completions = [
        chat(r"<think>maybe \boxed{2}</think> so \boxed{\frac{1}{3}}"),  # the answer after </think>
        chat(r"<think>\boxed{\frac{1}{3}}</think> so \boxed{2}"),  # the reasoning's guess is not it
        chat(r"<think>still thinking \boxed{\frac{1}{3}}"),  # never closed: 0.0, not None
        chat(r"<think>a</think><think>b</think> \boxed{7}"),  # after the last delimiter
        chat(r"[done] \boxed{5}"),
    ]
    solutions = [r"$\frac{1}{3}$", r"$\frac{1}{3}$", r"$\frac{1}{3}$", "$7$", "$5$"]
    assert reasoning_accuracy_reward(completions, solutions) == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert reasoning_accuracy_reward(
        completions[4:], solutions[4:], reasoning_delimiters=["[done]"]
    ) == [1.0]
    assert reasoning_accuracy_reward([chat("</think> 3")], ["no math"]) == [None]


def test_cosine_scaled_reward_by_hand():
    pytest.importorskip("math_verify")
    reward = get_cosine_scaled_reward(max_len=100)
    right, wrong = chat(r"\boxed{\frac{1}{3}}"), chat(r"\boxed{\frac{1}{2}}")
    lengths = [
        0,
        50,
        100,
        150,
    ]  # cos(0)=1, cos(pi/2)=0, cos(pi)=-1, and beyond max_len clamped at pi
    got = reward([right] * 4 + [wrong] * 4, [r"\frac{1}{3}"] * 8, [[1] * n for n in lengths * 2])
    # correct: 0.5 + 0.25 (1 + cos); wrong: -0.5 - 0.25 (1 + cos)
    assert got == pytest.approx([1.0, 0.75, 0.5, 0.5, -1.0, -0.75, -0.5, -0.5])
    assert (
        reward([right], ["no math here"], [[1]]) == [None]
        and reward.__name__ == "cosine_scaled_reward"
    )


def test_repetition_penalty_reward_by_hand():
    penalty = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    # [1,2,3,4]: 3 bigrams, all distinct -> 0; [5]*5: 4 bigrams, 1 distinct -> -(1 - 1/4);
    # [1,2,1,2,1]: (1,2),(2,1),(1,2),(2,1) -> 2 of 4 distinct -> -0.5; one token: no bigram -> 0
    assert penalty([[1, 2, 3, 4], [5] * 5, [1, 2, 1, 2, 1], [9]]) == [0.0, -0.75, -0.5, 0.0]
    assert get_repetition_penalty_reward(3, -0.5)([[7] * 6]) == [pytest.approx(-0.5 * (1 - 1 / 4))]
    assert penalty.__name__ == "repetition_penalty_reward"
    with pytest.raises(ValueError, match="max_penalty=0.5"):
        get_repetition_penalty_reward(max_penalty=0.5)


def test_builtins_train_together(tmp_path, tokenizer, model):
    pytest.importorskip("math_verify")
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "one plus one"}], "solution": "$2$"}] * 8
    )
    trainer = RLOOTrainer(
        model=model,
        args=make_args(tmp_path, max_steps=1, log_completions=True),
        reward_funcs=[accuracy_reward, think_format_reward, get_soft_overlong_punishment(6, 2)],
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    log = trainer.state.log_history[0]
    for name in ("accuracy_reward", "think_format_reward", "soft_overlong_punishment"):
        assert f"rewards/{name}/mean" in log
    assert set(trainer._logs.extra) == {"solution", "gold_parsed", "answer_parsed"}
