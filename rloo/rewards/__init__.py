"""Reward functions: the runner (contract) and built-in rewards."""

from rloo.rewards.builtin import (accuracy_reward, get_soft_overlong_punishment,
                                  think_format_reward, unique_chars_reward)
from rloo.rewards.math import number_only_format_reward, numeric_accuracy_reward
from rloo.rewards.runner import RewardFunctionError, RewardRunner

__all__ = [
    "RewardFunctionError", "RewardRunner", "accuracy_reward", "get_soft_overlong_punishment",
    "number_only_format_reward", "numeric_accuracy_reward", "think_format_reward",
    "unique_chars_reward"
]
