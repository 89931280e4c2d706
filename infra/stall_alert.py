"""A stalled training run flagged in the Prefect UI: the train stage emits `rloo.train.started`, one
`rloo.train.step` per optimizer step it sees, and `rloo.train.finished` (however it ends), each
about the run (`rloo.run.<run key>`) with its flow run as a related resource; `rloo-pipeline serve`
installs an automation with Prefect's absence (proactive) trigger that renames the flow run's state
to `Stalled` (still running: nothing is stopped) when a run's last step or start is followed by no
step for `within_s` seconds. The job's own watchdog (rloo.watchdog) fails a step that hangs; this
is what a team sees without reading logs, also when the job cannot report anything."""

from __future__ import annotations

from datetime import timedelta

AUTOMATION = "rloo: training stalled"
STARTED, STEP, FINISHED = "rloo.train.started", "rloo.train.step", "rloo.train.finished"


def emit(event: str, run_key: str, name: str, payload: dict | None = None) -> None:
    """One event about this run, with the current flow run related (none outside a flow run; a
    Prefect API away is not an error: emitting is best effort)."""
    from prefect.events import emit_event
    from prefect.runtime import flow_run
    related = []
    if flow_run.id:
        related.append({"prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                        "prefect.resource.role": "flow-run"})
    emit_event(event=event, resource={"prefect.resource.id": f"rloo.run.{run_key}",
                                      "prefect.resource.name": name},
               related=related, payload=payload or {})


def install(within_s: float) -> None:
    """The automation on the current Prefect API, replacing an earlier one of the same name."""
    if within_s < 10:
        raise ValueError(f"a stalled-run alert after {within_s:g} s: Prefect's absence triggers "
                         "need at least 10 s.")
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
        trigger=EventTrigger(after={STARTED, STEP}, expect={STEP, FINISHED},
                             for_each={"prefect.resource.id"}, posture=Posture.Proactive,
                             threshold=1, within=timedelta(seconds=within_s)),
        actions=[ChangeFlowRunState(state=StateType.RUNNING, name="Stalled",
                                    message=f"no training step for {within_s:g} s (rloo)")],
    ).create()
