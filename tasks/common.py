"""What every stage task shares: the cache key (config fingerprint + stage version), the stage's
summary line, and training's progress (a Prefect progress artifact and a log line)."""

from __future__ import annotations

import logging
import time

from infra import stall_alert
from infra.runconfig import RunConfig
from infra.stages import STAGE_VERSIONS

logger = logging.getLogger(__name__)


def cache_key(stage: str):
    """Same config + same stage version => the stage's persisted result is reused (across flow runs
    too)."""

    def key(context, parameters) -> str:
        config: RunConfig = parameters["config"]
        return f"rloo-{stage}-v{STAGE_VERSIONS[stage]}-{config.fingerprint()}"

    return key


def say(stage: str, message: str, config: RunConfig | None = None) -> None:
    """The one summary line per stage on the console (and in the Prefect run log); a sweep's
    trials, which run side by side, are named in theirs."""
    from prefect import get_run_logger

    who = f"{config.name}: " if config is not None and config.trial is not None else ""
    get_run_logger().info("[%s] %s%s", stage, who, message)


def progress_reporter(config: RunConfig, every_s: float = 30.0):
    """on_progress(step, max_steps, reward, timing) for follow_training: updates the Prefect
    progress artifact at each new step and logs `[train] step 12/40, reward 0.312, ETA 4m10s, 3.10
    s/step (generation 1.90, train 0.80, ...)` at most every `every_s` seconds (and at the end), a
    plain line that reads the same in a terminal, a pipe or the Prefect UI. The Prefect API going
    away stops the artifact updates, not the following."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    artifact = create_progress_artifact(
        0.0,
        key=f"{config.name}-training-progress",
        description=f"Optimizer steps of {config.run_key}",
        _sync=True,
    )
    start, state, pace = time.time(), {"logged": 0.0}, Pace()
    report_step = stall_alert.StepReporter(config.run_key, config.name)

    def on_progress(
        step: int, max_steps: int | None, reward: float | None, timing: str | None = None
    ) -> None:
        if max_steps and not state.get("api_away"):
            try:
                update_progress_artifact(artifact, 100.0 * step / max_steps, _sync=True)
            # the Prefect API away: the job trains on, followed through its files
            except Exception as err:
                state["api_away"] = True
                say(
                    "train",
                    f"the Prefect API is unreachable ({type(err).__name__}); following the job "
                    "without progress updates. If this process ends, `rloo-pipeline resume RUN` "
                    "picks the job up.",
                    config=config,
                )
        if step != state.get("step") and not state.get("api_away"):  # the stalled-run watch
            state["step"] = step
            try:
                report_step(step, reward)
            except Exception as err:  # best effort, like the artifact: the job trains on
                logger.warning("rloo: the step event was not sent: %s", err)
        now = time.time()
        if pace.update(step, now):
            say(
                "train",
                f"a new attempt of the job is training: its step counter went back to {step}",
                config=config,
            )
        if now - state["logged"] < every_s and step != max_steps:
            return
        state["logged"] = now
        parts = [f"step {step}" + (f"/{max_steps}" if max_steps else "")]
        if reward is not None:
            parts.append(f"reward {reward:.3f}")
        remaining = pace.eta(step, max_steps, now)
        if remaining is not None:
            parts.append(f"ETA {int(remaining // 60)}m{int(remaining % 60):02d}s")
        parts.append(f"{int(now - start)}s elapsed")
        if timing:
            parts.append(timing)
        say("train", ", ".join(parts), config=config)

    return on_progress


class Pace:
    """The ETA of the attempt that is training. Its baseline is the first step seen to advance
    while following (the first step read may be an earlier attempt's last, and the first step of
    an attempt includes its start-up); a step counter that goes back is a new attempt, whose pace
    starts afresh."""

    def __init__(self):
        self.last: int | None = None
        self.first: tuple[int, float] | None = None

    def update(self, step: int, now: float) -> bool:
        """Take a step read at `now`; True when it is a new attempt's."""
        restarted = self.last is not None and step < self.last
        if restarted:
            self.first = None
        elif self.last is not None and step > self.last and self.first is None:
            self.first = (step, now)
        self.last = step
        return restarted

    def eta(self, step: int, max_steps: int | None, now: float) -> float | None:
        """Seconds left at this pace (None: not known yet)."""
        if not max_steps or self.first is None or step <= self.first[0]:
            return None
        return (now - self.first[1]) / (step - self.first[0]) * (max_steps - step)
