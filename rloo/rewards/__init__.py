"""Reward functions: the runner (contract) and built-in rewards."""

from rloo.rewards.math import numeric_accuracy_reward
from rloo.rewards.runner import RewardFunctionError, RewardRunner

__all__ = ["RewardFunctionError", "RewardRunner", "numeric_accuracy_reward"]
