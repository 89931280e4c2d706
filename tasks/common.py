"""What every stage task shares: the cache key (config fingerprint + stage version), MLflow child runs."""

from __future__ import annotations

import contextlib

from infra import tracking
from infra.runconfig import RunConfig
from infra.stages import STAGE_VERSIONS


def cache_key(stage: str):
    """Same config + same stage version => the stage's persisted result is reused (across flow runs too)."""
    def key(context, parameters) -> str:
        config: RunConfig = parameters["config"]
        return f"rloo-{stage}-v{STAGE_VERSIONS[stage]}-{config.fingerprint()}"
    return key


@contextlib.contextmanager
def stage_run(config: RunConfig, parent_run_id: str | None, stage: str):
    """A nested MLflow run for one stage, ended FINISHED or FAILED (yields None when tracking is off)."""
    if parent_run_id is None:
        yield None
        return
    run_id = tracking.start_run(config.tracking_uri, config.tracking.experiment, f"{config.run_key}/{stage}",
                                {"rloo.stage": stage, "rloo.run_key": config.run_key}, parent_run_id=parent_run_id)
    mlflow_client = tracking.client(config.tracking_uri)
    try:
        yield run_id
    except BaseException:
        mlflow_client.set_terminated(run_id, status="FAILED")
        raise
    mlflow_client.set_terminated(run_id, status="FINISHED")


def say(stage: str, message: str) -> None:
    """The one summary line per stage on the console (and in the Prefect run log)."""
    from prefect import get_run_logger
    get_run_logger().info("[%s] %s", stage, message)
