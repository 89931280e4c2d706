"""Reward functions: the runner (contract) and built-in rewards."""

from rloo.rewards.builtin import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
    unique_chars_reward,
)
from rloo.rewards.math import number_only_format_reward, numeric_accuracy_reward
from rloo.rewards.runner import RewardFunctionError, RewardRunner

__all__ = [
    "RewardFunctionError",
    "RewardRunner",
    "accuracy_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "number_only_format_reward",
    "numeric_accuracy_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "unique_chars_reward",
]


def by_short_name(name: str):
    """A reward named as `trl rloo --reward_funcs` names it (TRL's four, with the values its script
    gives `get_soft_overlong_punishment`), or one of ours; None for any other name."""
    found = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "numeric_accuracy_reward": numeric_accuracy_reward,
        "number_only_format_reward": number_only_format_reward,
        "unique_chars_reward": unique_chars_reward,
    }.get(name)
    if name == "get_soft_overlong_punishment":
        found = get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)
    return found
