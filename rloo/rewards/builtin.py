"""Built-in reward functions, usable as `reward_funcs=[...]` or by import path from a recipe.

- `accuracy_reward`: LaTeX-aware answer checking with math-verify (optional extra: `pip install
  'rloo[math]'`); `reasoning_accuracy_reward`: the same on what follows `</think>`;
  `get_cosine_scaled_reward(max_len)`: correctness scaled by length.
- `get_repetition_penalty_reward(ngram_size, max_penalty)`: repeated token n-grams penalised.
- `think_format_reward`: 1.0 when the completion is `<think>...</think>` followed by the answer.
- `get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`: DAPO's soft length penalty.
"""

from __future__ import annotations

import math
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
            "'rloo[math]' (or pip install math-verify)."
        ) from err
    return math_verify, NormalizationConfig


def _timeout() -> int | None:
    # math-verify's timeouts use signal.alarm, which only works on the main thread.
    return 5 if threading.current_thread() is threading.main_thread() else None


def _verified(gold_text, answer_text: str) -> tuple[float | None, str | None, str | None]:
    """(1.0 / 0.0, or None when the gold cannot be parsed; the parsed gold; the parsed answer): the
    answer's first LaTeX expression (a `\\boxed{}` first, then `$...$`) against the gold, by
    math-verify."""
    math_verify, NormalizationConfig = _math_verify()
    timeout = _timeout()
    extraction = [
        math_verify.LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    gold = math_verify.parse(str(gold_text), parsing_timeout=timeout)
    answer = math_verify.parse(
        answer_text,
        extraction_config=extraction,
        extraction_mode="first_match",
        parsing_timeout=timeout,
    )
    shown = (str(gold[0]) if gold else None, str(answer[0]) if answer else None)
    if not gold:
        return None, *shown
    return float(math_verify.verify(gold, answer, timeout_seconds=timeout)), *shown


def accuracy_reward(
    completions: list, solution: list, log_extra=None, **kwargs
) -> list[float | None]:
    """1.0 if the completion's first LaTeX answer (a `\\boxed{}` first, then `$...$`) equals the
    `solution` column mathematically (math-verify), else 0.0; None when the solution itself cannot
    be parsed (the row is left to the other reward functions). Standard and conversational
    completions. With `log_extra`, the parsed gold and answer appear as columns of the completion
    table."""
    found = [
        _verified(gold, _content(completion)) for completion, gold in zip(completions, solution)
    ]
    if log_extra is not None:
        log_extra("solution", [str(s) for s in solution])
        log_extra("gold_parsed", [gold for _, gold, _ in found])
        log_extra("answer_parsed", [answer for _, _, answer in found])
    return [reward for reward, _, _ in found]


def reasoning_accuracy_reward(
    completions: list,
    solution: list,
    reasoning_delimiters: list[str] | None = None,
    log_extra=None,
    **kwargs,
) -> list[float | None]:
    """accuracy_reward on what follows the reasoning: the text after the last occurrence of the
    first of `reasoning_delimiters` (default `</think>`) that the completion contains. A completion
    that never closes its reasoning gets 0.0 (not None: an unfinished reasoning is wrong, not
    unscorable); an unparseable solution gives None."""
    delimiters = reasoning_delimiters or ["</think>"]
    rewards, golds, answers = [], [], []
    for completion, gold in zip(completions, solution):
        text = _content(completion)
        delimiter = next((d for d in delimiters if d in text), None)
        if delimiter is None:
            rewards.append(0.0)
            golds.append("[incomplete reasoning]")
            answers.append("[incomplete reasoning]")
            continue
        reward, gold_parsed, answer_parsed = _verified(gold, text.rsplit(delimiter, 1)[1])
        rewards.append(reward)
        golds.append(gold_parsed)
        answers.append(answer_parsed)
    if log_extra is not None:
        log_extra("solution", [str(s) for s in solution])
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", answers)
    return rewards


class _CosineScaled:
    """get_cosine_scaled_reward's reward (a class, not a closure: picklable for other processes)."""

    __name__ = "cosine_scaled_reward"

    def __init__(self, max_len: int, wrong: tuple[float, float], correct: tuple[float, float]):
        self.max_len, self.wrong, self.correct = max_len, wrong, correct

    def __call__(
        self, completions: list, solution: list, completion_ids: list[list[int]], **kwargs
    ) -> list[float | None]:
        rewards = []
        for completion, gold, ids in zip(completions, solution, completion_ids):
            verdict = _verified(gold, _content(completion))[0]
            if verdict is None:
                rewards.append(None)
                continue
            # at the shortest length `short`, at max_len and beyond `long` (cos would climb back)
            short, long = (self.correct[1], self.correct[0]) if verdict else self.wrong
            progress = min(len(ids) / self.max_len, 1.0)
            rewards.append(long + (short - long) * 0.5 * (1.0 + math.cos(math.pi * progress)))
        return rewards


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
):
    """Correctness (as accuracy_reward) scaled by the completion's token count on a cosine from 0 to
    `max_len` ("Demystifying Long Chain-of-Thought Reasoning", appendix C.1): a correct completion
    earns `max_value_correct` when short down to `min_value_correct` at `max_len`; a wrong one is
    penalised `min_value_wrong` when short up to `max_value_wrong` at `max_len` (a long wrong
    attempt is penalised less). None where the solution cannot be parsed."""
    if max_len < 1:
        raise ValueError(f"max_len={max_len} must be >= 1 (tokens).")
    return _CosineScaled(
        max_len, (min_value_wrong, max_value_wrong), (min_value_correct, max_value_correct)
    )


class _RepetitionPenalty:
    """get_repetition_penalty_reward's reward (a picklable class)."""

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            grams = [
                tuple(ids[i : i + self.ngram_size]) for i in range(len(ids) - self.ngram_size + 1)
            ]
            repeated = 1.0 - len(set(grams)) / len(grams) if grams else 0.0
            rewards.append(repeated * self.max_penalty if repeated else 0.0)
        return rewards


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0):
    """The share of a completion's token n-grams that repeat an earlier one, times `max_penalty`
    (<= 0): 0.0 without repetition, towards `max_penalty` for a completion that loops
    ("Demystifying Long Chain-of-Thought Reasoning", appendix C.2). Shorter than `ngram_size`
    tokens: 0.0."""
    if max_penalty > 0:
        raise ValueError(f"max_penalty={max_penalty} must be <= 0 (a penalty).")
    if ngram_size < 1:
        raise ValueError(f"ngram_size={ngram_size} must be >= 1.")
    return _RepetitionPenalty(ngram_size, max_penalty)


# Checked when the trainer is built (rloo.checks), without calling the reward: a missing extra fails
# before training.
accuracy_reward.check_dependencies = _math_verify
reasoning_accuracy_reward.check_dependencies = _math_verify
_CosineScaled.check_dependencies = staticmethod(_math_verify)


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
            f"max_completion_len={max_completion_len}]."
        )
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
