"""What a kill test puts into a run through its recipe: a callback that reaches the named points of the training
loop and a reward function that reaches 'generation' (it runs between sampling and the update). The points inside
a checkpoint save ('mid-save', 'before-marker') are in rloo itself (rloo.faults). With RLOO_TEST_REWARD_RAISES_AT=n
the reward function raises at its n-th call only (a flaky grading service); SlowSteps makes room for faults outside
the run while it trains; with RLOO_TEST_FILL_DISK_AT_END=<file>, that file fills the disk when training ends (before
the final model is saved)."""

import os
import time

from transformers import TrainerCallback

from rloo import faults


class KillPoints(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        faults.point("optimizer-step")

    def on_step_end(self, args, state, control, **kwargs):
        faults.point("step-end")

    def on_train_end(self, args, state, control, **kwargs):
        faults.point(
            "train-end"
        )  # after the last step, before `rloo train` saves the final model and exits
        if os.environ.get("RLOO_TEST_FILL_DISK_AT_END"):  # another writer takes the last free byte
            try:
                with open(os.environ["RLOO_TEST_FILL_DISK_AT_END"], "wb", buffering=0) as filler:
                    while True:
                        filler.write(b"\0" * 4096)
            except OSError:  # full
                pass


_calls = [0]


class SlowSteps(TrainerCallback):
    """Each step RLOO_TEST_STEP_SLEEP seconds longer; at step RLOO_TEST_HOLD_AT, held until the file
    RLOO_TEST_HOLD_UNTIL exists (so a run cannot end before the faults a test inflicts are over)."""

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(float(os.environ.get("RLOO_TEST_STEP_SLEEP", "0")))
        if str(state.global_step) == os.environ.get("RLOO_TEST_HOLD_AT"):
            while not os.path.exists(os.environ["RLOO_TEST_HOLD_UNTIL"]):
                time.sleep(0.1)


def position_reward(completion_ids, **kwargs):
    """Differs inside every group, so every step moves the weights."""
    faults.point("generation")
    _calls[0] += 1
    if str(_calls[0]) == os.environ.get("RLOO_TEST_REWARD_RAISES_AT"):
        raise ConnectionError("the grading service dropped the connection")
    return [float(i) for i in range(len(completion_ids))]
