"""Reward functions for pipeline tests, named by import path ('pipeline_rewards:...')."""

import os
import time


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def slow_length_reward(completion_ids, **kwargs):
    """Training slow enough to be interrupted between checkpoints. RLOO_TEST_REWARD_RETURNED names a file
    touched once a call has slept its full time (a test's proof that a call was, or was not, waited for)."""
    time.sleep(float(os.environ.get("RLOO_TEST_REWARD_SLEEP", "0.7")))
    if os.environ.get("RLOO_TEST_REWARD_RETURNED"):
        open(os.environ["RLOO_TEST_REWARD_RETURNED"], "a").close()
    return [float(len(ids)) for ids in completion_ids]


def lookup_reward(completion_ids, trainer_state, **kwargs):
    """Scores with a table file that evaluation needs (evaluation runs in the pipeline's own process, training under
    torchrun, which sets RANK); when the file is missing, evaluation fails until someone creates it."""
    if "RANK" not in os.environ:
        path = os.environ["RLOO_TEST_LOOKUP_FILE"]
        with open(path) as handle:
            bonus = float(handle.read().strip() or 0)
    else:
        bonus = 0.0
    return [float(len(ids)) + bonus for ids in completion_ids]


def crash_on_rank_reward(completion_ids, trainer_state=None, **kwargs):
    """Raises on the global rank named by RLOO_TEST_CRASH_RANK once training has made a step."""
    crash_rank = os.environ.get("RLOO_TEST_CRASH_RANK")
    if (
        trainer_state is not None
        and trainer_state.global_step >= 1
        and os.environ.get("RANK") == crash_rank
    ):
        raise RuntimeError(f"boom on rank {crash_rank}")
    return [float(len(ids)) for ids in completion_ids]
