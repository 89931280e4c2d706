"""Step-time breakdown: where each optimizer step's wall time goes, as `timing/<section>` metrics in
seconds.

Sections nest (the trainer's `train` section holds the rollout, which holds generation, which holds
a vLLM weight push); each one counts its exclusive time, so the sections of a step add up to the
step's wall time minus what no section covers (fetching the next batch, callbacks). `step_time` is
that wall time: from the start of the first micro-batch to the end of the optimizer step (clipping,
`optimizer.step`, scheduler, `zero_grad`). Sections entered outside an optimizer step (an evaluation
between steps) are not counted. Each rank times its own work; the logged values are the main
process's. On an accelerator (CUDA) work is queued and runs later: the timer then waits for the
device at every section's start and end, so a kernel counts in the section that queued it, not in
the next one that happens to wait for a result.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from transformers import TrainerCallback

SECTIONS = ("generation", "weight_sync", "rewards", "logprobs", "train", "optimizer")


class StepTimer:
    """Exclusive seconds per section within one optimizer step; a no-op between steps. `synchronize`
    (if given) is called before every clock reading inside a step: the wait for an accelerator's
    queued work."""

    def __init__(self, synchronize: Callable[[], None] | None = None):
        self._synchronize = synchronize
        self._totals = dict.fromkeys(SECTIONS, 0.0)
        self._children: list[float] = []  # per open section, the time its nested sections took
        self._step_start: float | None = None
        self._last_mark: float | None = None
        # for the stall watchdog (rloo.watchdog): the open sections and the last change
        self.open: list[str] = []
        self.progress = time.monotonic()

    def _now(self) -> float:
        if self._synchronize is not None:
            self._synchronize()
        return time.perf_counter()

    @contextmanager
    def section(self, name: str):
        if name not in self._totals:
            raise ValueError(f"unknown timing section {name!r}; known: {', '.join(SECTIONS)}")
        if self._step_start is None:
            yield
            return
        start = self._now()
        self._children.append(0.0)
        self.open.append(name)
        self.progress = time.monotonic()
        try:
            yield
        finally:
            elapsed = self._now() - start
            self._totals[name] += elapsed - self._children.pop()
            if self._children:
                self._children[-1] += elapsed
            self.open.pop()
            self.progress = time.monotonic()

    def begin_step(self) -> None:
        self._totals = dict.fromkeys(SECTIONS, 0.0)
        self._children, self.open = [], []
        self._step_start = self._last_mark = self._now()
        self.progress = time.monotonic()

    def advance(self) -> None:
        """The work inside the open sections moved on (a weight chunk pushed, a token decoded, a
        reward function or a forward micro-batch done): the stall watchdog's clock starts again, so
        a long section that keeps reporting this is never taken for a stalled one."""
        self.progress = time.monotonic()

    @property
    def in_step(self) -> bool:
        return self._step_start is not None

    def end_micro_step(self) -> None:
        """A micro-batch's forward and backward are done: what follows until `end_step` is the
        optimizer's."""
        self._last_mark = self._now()
        self.progress = time.monotonic()

    def end_step(self) -> dict[str, float]:
        """The step's `timing/<section>` seconds and its `step_time`; {} when no step was open."""
        if self._step_start is None:
            return {}
        now = self._now()
        self._totals["optimizer"] += now - self._last_mark
        metrics = {f"timing/{name}": seconds for name, seconds in self._totals.items()}
        metrics["step_time"] = now - self._step_start
        self._step_start = None
        return metrics


def timed(section: str):
    """A method decorator: the call counts as `section` on its object's `timer` (a generation
    backend's)."""

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            with self.timer.section(section):
                return method(self, *args, **kwargs)

        return wrapper

    return decorate


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (an accelerator's); nothing on the CPU, whose work is
    done on return."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def device_timer(device: torch.device) -> StepTimer:
    """A StepTimer for work on `device`: one that waits for the device's queue at each reading,
    except on the CPU."""
    if device.type == "cpu":
        return StepTimer()
    return StepTimer(functools.partial(synchronize, device))


NULL_TIMER = StepTimer()  # never begins a step: its sections cost nothing and record nothing


class StepTimingCallback(TrainerCallback):
    """Opens the timer at each optimizer step's begin and adds its breakdown to the trainer's
    metrics at the end."""

    def __init__(self, timer: StepTimer, metrics):
        self.timer = timer
        self.metrics = metrics

    def on_step_begin(self, args, state, control, **kwargs):
        self.timer.begin_step()

    def on_step_end(self, args, state, control, **kwargs):
        for name, seconds in self.timer.end_step().items():
            self.metrics.add("train", name, seconds)


def timing_summary(record: dict) -> str | None:
    """'step 3.2 s: generation 1.9, train 0.8, logprobs 0.3, ...' from a log record, largest first;
    None without timings."""
    parts = [
        (record[f"timing/{name}"], name)
        for name in SECTIONS
        if isinstance(record.get(f"timing/{name}"), (int, float))
    ]
    if not parts or not isinstance(record.get("step_time"), (int, float)):
        return None
    shown = ", ".join(
        f"{name} {seconds:.2f}" for seconds, name in sorted(parts, reverse=True) if seconds >= 0.005
    )
    return f"{record['step_time']:.2f} s/step ({shown})"
