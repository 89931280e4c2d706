"""Built-in reward functions, usable as `reward_funcs=[...]` or by import path from a recipe.

- `accuracy_reward`: LaTeX-aware answer checking with math-verify (optional extra: `pip install
  'rloo[math]'`).
- `think_format_reward`: 1.0 when the completion is `<think>...</think>` followed by the answer.
- `get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`: DAPO's soft length penalty.
"""

from __future__ import annotations

import re
import threading

from rloo.rewards.math import _content

THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)


def _math_verify():
    try:
        import math_verify
        from latex2sympy2_extended import NormalizationConfig
    except ImportError as err:
        raise ImportError(
            "accuracy_reward needs math-verify, which is not installed. Fix: pip install "
            "'rloo[math]' (or pip install math-verify).") from err
    return math_verify, NormalizationConfig


def accuracy_reward(completions: list, solution: list, log_extra=None,
                    **kwargs) -> list[float | None]:
    """1.0 if the completion's first LaTeX answer (a `\\boxed{}` first, then `$...$`) equals the
    `solution` column mathematically (math-verify), else 0.0; None when the solution itself cannot
    be parsed (the row is left to the other reward functions). Standard and conversational
    completions. With `log_extra`, the parsed gold and answer appear as columns of the completion
    table."""
    math_verify, NormalizationConfig = _math_verify()
    # math-verify's timeouts use signal.alarm, which only works on the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    extraction = [
        math_verify.LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                          boxed_match_priority=0, try_extract_without_anchor=False)
    ]
    rewards: list[float | None] = []
    gold_column, answer_column = [], []
    for completion, gold_text in zip(completions, solution):
        gold = math_verify.parse(str(gold_text), parsing_timeout=timeout)
        answer = math_verify.parse(_content(completion), extraction_config=extraction,
                                   extraction_mode="first_match", parsing_timeout=timeout)
        gold_column.append(str(gold[0]) if gold else None)
        answer_column.append(str(answer[0]) if answer else None)
        if not gold:
            rewards.append(None)
            continue
        rewards.append(float(math_verify.verify(gold, answer, timeout_seconds=timeout)))
    if log_extra is not None:
        log_extra("solution", [str(s) for s in solution])
        log_extra("gold_parsed", gold_column)
        log_extra("answer_parsed", answer_column)
    return rewards


# Checked when the trainer is built (rloo.checks), without calling the reward: a missing extra fails
# before training.
accuracy_reward.check_dependencies = _math_verify


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion opens with exactly one `<think>...</think>` block (then anything),
    else 0.0."""
    return [1.0 if THINK_FORMAT.match(_content(completion)) else 0.0 for completion in completions]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int):
    """DAPO (Yu et al. 2025, eq. 13): 0 up to `max_completion_len - soft_punish_cache` tokens, then
    a linear ramp down to -1 at `max_completion_len`, and -1 beyond. Lengths are token counts
    (`completion_ids`)."""
    if not 0 <= soft_punish_cache <= max_completion_len:
        raise ValueError(
            f"soft_punish_cache={soft_punish_cache} must lie in [0, "
            f"max_completion_len={max_completion_len}].")
    free = max_completion_len - soft_punish_cache

    def soft_overlong_punishment(completion_ids: list[list[int]], **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= free:
                rewards.append(0.0)
            elif length <= max_completion_len:
                rewards.append((free - length) / soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards

    return soft_overlong_punishment


def unique_chars_reward(completions: list, **kwargs) -> list[float]:
    """The spec's TL;DR example reward: the number of distinct characters in the completion."""
    return [float(len(set(_content(completion)))) for completion in completions]
