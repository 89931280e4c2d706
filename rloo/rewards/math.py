"""Math rewards that need no extra dependency."""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _content(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def numeric_accuracy_reward(completions: list, solution: list, **kwargs) -> list[float | None]:
    """1.0 when the last number in the completion equals the numeric `solution`, else 0.0.

    None (the row is not scorable by this function) when the solution itself is not a number.
    Works for standard and conversational completions.
    """
    rewards: list[float | None] = []
    for completion, gold in zip(completions, solution):
        gold_value = _as_number(str(gold))
        if gold_value is None:
            rewards.append(None)
            continue
        numbers = NUMBER.findall(_content(completion).replace(",", ""))
        rewards.append(1.0 if numbers and abs(float(numbers[-1]) - gold_value) < 1e-9 else 0.0)
    return rewards


JUST_A_NUMBER = re.compile(r"^\s*-?\d+(?:\.\d+)?\s*\.?\s*$")


def number_only_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion is just a number (what "Answer with just the number." asks for), else
    0.0."""
    return [1.0 if JUST_A_NUMBER.match(_content(completion)) else 0.0 for completion in completions]
