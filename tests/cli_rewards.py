"""Reward functions named by import path in CLI tests ('cli_rewards:length_reward')."""


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]
