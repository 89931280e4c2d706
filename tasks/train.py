from __future__ import annotations

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from infra import stages, tracking
from infra.runconfig import RunConfig, resolved_dict
from tasks.common import cache_key, say


@task(name="train", cache_key_fn=cache_key("train"), persist_result=True)
async def train_task(config: RunConfig, dataset_result: dict, model_result: dict, parent_run_id: str | None) -> dict:
    """Launch (or reattach to) the training job and follow it with async polling; the train stage's MLflow run
    is created here and handed to the job, whose rank 0 logs into it."""
    previous = stages.read_json(stages.stage_path(config, "train", "job.json")) or {}
    with tracking.stage_run(config, parent_run_id, "train", run_id=previous.get("mlflow_run_id"),
                            params=resolved_dict(config)) as run_id:
        record = stages.start_or_reattach_training(config, dataset_result, model_result, run_id)
        how = "reattached to" if record["reattached"] else (
            f"resumed from {record['resumed_from']} as" if record["resumed_from"] else "started")
        say("train", f"{how} local job {record['handle']['job_id']} (log: {record['handle']['log_path']})")
        progress_id = create_progress_artifact(0.0, key=f"{config.name}-training-progress",
                                               description=f"Optimizer steps of {config.run_key}", _sync=True)
        bar = _console_bar()

        def on_progress(step: int, max_steps: int | None) -> None:
            if max_steps:
                update_progress_artifact(progress_id, 100.0 * step / max_steps, _sync=True)
            bar(step, max_steps)

        try:
            result = await stages.follow_training(config, record, on_progress)
        finally:
            bar(None, None)
        if run_id:  # what MLflow refused during the run (an outage) goes now, before the run is closed
            tracking.flush_pending(stages.train_dir(config), config.tracking_uri, run_id)
    say("train", f"{result['global_step']} optimizer steps done; model in {result['output_dir']}")
    return result


def _console_bar():
    """A rich progress bar on the orchestrator's console (closed with bar(None, None))."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        transient=True)
    state = {"task": None}

    def update(step, max_steps):
        if step is None:
            progress.stop()
            return
        if state["task"] is None:
            progress.start()
            state["task"] = progress.add_task("train", total=max_steps)
        progress.update(state["task"], completed=step, total=max_steps)
    return update
