from __future__ import annotations

from prefect import task

from infra import checkpoints, job_tracking, stages, stall_alert, sweep, tracking
from infra.runconfig import RunConfig, resolved_dict
from tasks.common import cache_key, progress_reporter, say


@task(name="train", cache_key_fn=cache_key("train"), persist_result=True)
async def train_task(
    config: RunConfig, dataset_result: dict, model_result: dict, parent_run_id: str | None
) -> dict:
    """Launch (or reattach to) the training job and follow it with async polling; the train stage's
    MLflow run is created here and handed to the job, whose rank 0 logs into it."""
    previous = stages.read_json(stages.stage_path(config, "train", "job.json")) or {}
    with tracking.stage_run(
        config,
        parent_run_id,
        "train",
        run_id=previous.get("mlflow_run_id"),
        params=resolved_dict(config),
    ) as run_id:
        if run_id and not previous:  # what it trains on and is scored against, on the run's page
            tracking.log_datasets(
                config.tracking_uri, run_id, stages.pipeline_datasets(config, dataset_result)
            )
        record = stages.start_or_reattach_training(config, dataset_result, model_result, run_id)
        if record["reattached"]:
            how = "reattached to"
        elif record["resumed_from"]:
            how = f"resumed from {record['resumed_from']} as"
        elif previous:
            how = "restarted from the start (the earlier attempt saved no checkpoint) as"
        else:
            how = "started"
        where = "SLURM" if record["handle"].get("executor") == "slurm" else "local"
        say(
            "train",
            f"{how} {where} job {record['handle']['job_id']} (log: {record['handle']['log_path']})",
            config=config,
        )
        on_progress = progress_reporter(config)
        stall_alert.emit(stall_alert.STARTED, config.run_key, config.name)
        try:
            judge = (
                sweep.PruningJudge(config, dataset_result, model_result)
                if (config.trial and config.trial.prune)
                else None
            )
            result = await stages.follow_training(config, record, on_progress, judge)
        finally:  # however it ends: the stalled-run automation stops watching it
            stall_alert.emit(stall_alert.FINISHED, config.run_key, config.name)
        # what MLflow refused during the run (an outage) goes now, before the run is closed
        if run_id:
            job_tracking.flush_pending(stages.train_dir(config), config.tracking_uri, run_id)
            result = checkpoints.log_models(config, result, model_result, run_id)
    models = f"; {len(result['models'])} models in MLflow" if result.get("models") else ""
    if result.get("pruned"):
        pruned = result["pruned"]
        say(
            "train",
            f"pruned by the sweep at {pruned['name']} ({config.trial.objective} "
            f"{pruned['value']:.4g}): job stopped, checkpoints kept{models}",
            config=config,
        )
    else:
        say(
            "train",
            f"{result['global_step']} optimizer steps done; model in "
            f"{result['output_dir']}{models}",
            config=config,
        )
    return result
