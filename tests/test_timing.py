"""The step-time breakdown (rloo.timing): exclusive time of nested sections, on a clock the test drives."""

import pytest
import torch

from helpers import needs_cuda
from rloo import timing


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    return now


def test_nested_sections_count_their_exclusive_time_and_add_up_to_the_step(clock):
    timer = timing.StepTimer()
    timer.begin_step()  # t=0
    with timer.section("train"):
        clock[0] = 1.0  # 1 s of train before the rollout
        with timer.section("generation"):
            clock[0] = 3.0  # 2 s generating, 0.5 s of it pushing weights
            with timer.section("weight_sync"):
                clock[0] = 3.5
            clock[0] = 4.0
        with timer.section("rewards"):
            clock[0] = 4.25
        clock[0] = 6.0  # forward + backward
    timer.end_micro_step()
    clock[0] = 6.5  # a gap nobody times (next micro-batch fetched)
    with timer.section("train"):
        clock[0] = 7.0
    timer.end_micro_step()
    clock[0] = 7.75  # clip, optimizer.step, zero_grad
    metrics = timer.end_step()
    assert metrics == {
        "timing/generation": 2.5,
        "timing/weight_sync": 0.5,
        "timing/rewards": 0.25,
        "timing/logprobs": 0.0,
        "timing/train": 3.25,
        "timing/optimizer": 0.75,
        "step_time": 7.75,
    }
    assert timer.end_step() == {}


def test_sections_outside_a_step_record_nothing(clock):
    timer = timing.StepTimer()
    with timer.section("generation"):  # an evaluation between optimizer steps
        clock[0] = 5.0
    timer.begin_step()
    clock[0] = 6.0
    assert timer.end_step()["timing/generation"] == 0.0
    with pytest.raises(ValueError, match="unknown timing section 'decode'"):
        with timer.section("decode"):
            pass


def test_work_queued_on_a_device_counts_in_the_section_that_queued_it(clock):
    """On an accelerator a section's kernels finish after its Python code: the timer waits for the device (here a
    queue of seconds the clock has not reached yet) at every reading, so they count where they were queued."""
    queued = []

    def synchronize():
        clock[0] += sum(queued)
        queued.clear()

    timer = timing.StepTimer(synchronize)
    timer.begin_step()
    with timer.section("generation"):
        queued.append(2.0)  # 2 s of decoding queued, returned at once
    with timer.section("train"):
        clock[0] += 0.5
        queued.append(1.0)  # backward queued
    timer.end_micro_step()
    queued.append(0.25)  # optimizer.step queued
    metrics = timer.end_step()
    assert metrics["timing/generation"] == 2.0 and metrics["timing/train"] == 1.5
    assert metrics["timing/optimizer"] == 0.25 and metrics["step_time"] == 3.75
    assert (
        timing.device_timer(torch.device("cpu"))._synchronize is None
    )  # CPU work is done when the call returns


@needs_cuda
def test_a_cuda_kernel_counts_in_the_section_that_launched_it():
    timer = timing.device_timer(torch.device("cuda"))
    torch.cuda.synchronize()
    timer.begin_step()
    with timer.section("generation"):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time, queued in microseconds
    with timer.section("rewards"):
        pass
    timer.end_micro_step()
    metrics = timer.end_step()
    assert (
        metrics["timing/generation"]
        > 0.05
        > metrics["timing/rewards"] + metrics["timing/optimizer"]
    )


def test_summary_line_lists_the_largest_sections_first():
    record = {
        "step_time": 3.2,
        "timing/generation": 1.9,
        "timing/train": 0.8,
        "timing/logprobs": 0.3,
        "timing/rewards": 0.001,
        "timing/optimizer": 0.1,
        "timing/weight_sync": 0.0,
    }
    assert (
        timing.timing_summary(record)
        == "3.20 s/step (generation 1.90, train 0.80, logprobs 0.30, optimizer 0.10)"
    )
    assert timing.timing_summary({"reward": 1.0}) is None
