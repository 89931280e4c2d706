"""Reward functions named by import path in CLI tests ('cli_rewards:length_reward')."""


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def first_token_reward(completion_ids, **kwargs):
    """Varies within a group, so every step has non-zero advantages (the weights move)."""
    return [float(ids[0] % 7) if ids else 0.0 for ids in completion_ids]
