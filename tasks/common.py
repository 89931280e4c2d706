"""What every stage task shares: the cache key (config fingerprint + stage version) and the stage's summary line."""

from __future__ import annotations

from infra.runconfig import RunConfig
from infra.stages import STAGE_VERSIONS


def cache_key(stage: str):
    """Same config + same stage version => the stage's persisted result is reused (across flow runs too)."""
    def key(context, parameters) -> str:
        config: RunConfig = parameters["config"]
        return f"rloo-{stage}-v{STAGE_VERSIONS[stage]}-{config.fingerprint()}"
    return key


def say(stage: str, message: str) -> None:
    """The one summary line per stage on the console (and in the Prefect run log)."""
    from prefect import get_run_logger
    get_run_logger().info("[%s] %s", stage, message)
