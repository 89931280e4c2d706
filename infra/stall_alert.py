"""A stalled training run flagged in the Prefect UI: the train stage emits `rloo.train.started`, one
`rloo.train.step` per optimizer step it sees, and `rloo.train.finished` (however it ends), each
about the run (`rloo.run.<run key>`) with its flow run as a related resource; `rloo-pipeline serve`
installs an automation with Prefect's absence (proactive) trigger that renames the flow run's state
to `Stalled` (still running: nothing is stopped) when a run's last step or start is followed by no
step for `within_s` seconds; when steps come again, the train stage puts it back to `Running`. The
job's own watchdog (rloo.watchdog) fails a step that hangs; this is what a team sees without reading
logs, also when the job cannot report anything."""

from __future__ import annotations

import time
from datetime import timedelta

AUTOMATION = "rloo: training stalled"
STARTED, STEP, FINISHED = "rloo.train.started", "rloo.train.step", "rloo.train.finished"
STALLED = "Stalled"
LEAST_WITHIN_S = 10  # Prefect's proactive triggers wait at least this long


def emit(event: str, run_key: str, name: str, payload: dict | None = None) -> None:
    """One event about this run, with the current flow run related (none outside a flow run; a
    Prefect API away is not an error: emitting is best effort)."""
    from prefect.events import emit_event
    from prefect.runtime import flow_run

    related = []
    if flow_run.id:
        related.append(
            {
                "prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                "prefect.resource.role": "flow-run",
            }
        )
    emit_event(
        event=event,
        resource={"prefect.resource.id": f"rloo.run.{run_key}", "prefect.resource.name": name},
        related=related,
        payload=payload or {},
    )


class StepReporter:
    """A step event for each new optimizer step the train stage sees; the first step after a gap
    long enough for the automation to have flagged the flow run finds it `Stalled` and puts it back
    to `Running` (Prefect keeps the Stalled spell in the run's state history)."""

    def __init__(self, run_key: str, name: str):
        self.run_key, self.name = run_key, name
        self.last: float | None = None  # (monotonic) when the previous step was reported

    def __call__(self, step: int, reward: float | None) -> None:
        emit(STEP, self.run_key, self.name, {"step": step, "reward": reward})
        now = time.monotonic()
        if self.last is not None and now - self.last >= LEAST_WITHIN_S:
            resume_if_stalled()
        self.last = now


def resume_if_stalled() -> bool:
    """The current flow run back to `Running` if the automation flagged it; True if it did."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.states import Running

    if not flow_run.id:
        return False
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run.id).state
        if state is None or state.name != STALLED:
            return False
        client.set_flow_run_state(
            flow_run.id, Running(message="training steps again (rloo)"), force=True
        )
    return True


def install(within_s: float) -> None:
    """The automation on the current Prefect API, replacing an earlier one of the same name."""
    if within_s < LEAST_WITHIN_S:
        raise ValueError(
            f"a stalled-run alert after {within_s:g} s: Prefect's absence triggers "
            "need at least 10 s."
        )
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    try:
        Automation.read(name=AUTOMATION).delete()
    except ValueError:  # none yet
        pass
    Automation(
        name=AUTOMATION,
        description=f"A training run with no optimizer step for {within_s:g} s: its flow run "
        "state becomes Stalled (it keeps running).",
        trigger=EventTrigger(
            after={STARTED, STEP},
            expect={STEP, FINISHED},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.RUNNING,
                name=STALLED,
                message=f"no training step for {within_s:g} s (rloo)",
            )
        ],
    ).create()
