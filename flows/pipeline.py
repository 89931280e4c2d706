"""`rloo_pipeline`: dataset -> model -> train -> evaluate, tracked in MLflow, resumable stage by
stage.

Every stage's result is persisted (Prefect result storage under the run root) with a cache key made
of the config fingerprint and the stage's version: running the flow again with the same config, or
retrying a failed run, executes only the stages that did not complete."""

from __future__ import annotations

import hashlib
import os
from typing import Annotated, Literal

from prefect import flow
from prefect.artifacts import create_link_artifact
from prefect.runtime import flow_run
from pydantic import Field

from infra import stages, tracking
from infra.runconfig import RunSettings, load_run_config, resolved_dict, shipped_recipes
from infra.writer import sole_writer
from tasks.dataset import dataset_task
from tasks.evaluate import evaluate_task
from tasks.model import model_task
from tasks.train import train_task


def result_storage(run_root: str) -> str:
    """A saved local-file-system block under the run root (Prefect needs result storage persisted
    server-side)."""
    from prefect.filesystems import LocalFileSystem

    root = os.path.abspath(os.path.join(run_root, ".prefect-results"))
    name = "rloo-results-" + hashlib.sha256(root.encode()).hexdigest()[:12]
    # the flow is async: save now
    LocalFileSystem(basepath=root).save(name, overwrite=True, _sync=True)
    return f"local-file-system/{name}"


@flow(name="rloo-pipeline", log_prints=True)
async def rloo_pipeline(
    recipe: Annotated[
        str, Field(json_schema_extra={"enum": shipped_recipes()})
    ] = "configs/quickstart.yaml",
    settings: RunSettings = RunSettings(),
    overrides: list[str] = (),
    if_running: Literal["refuse", "wait"] = "refuse",
) -> dict:
    """The RLOO pipeline: dataset, model, train, evaluate.

    Args:
        recipe: A pipeline config (configs/*.yaml; from the command line, any path).
        settings: What people change between runs; empty fields keep the recipe's value.
        overrides: More key=value settings, e.g. training.save_steps=10 or data.eval_size=100.
        if_running: When another run is writing this run's directory (same config): refuse, or
            wait for it.
    """
    config = load_run_config(recipe, overrides)
    if changed := settings.assignments(config):
        config = load_run_config(recipe, changed + list(overrides))
    stages.validate_recipe(config)  # every RLOOConfig value, before any stage
    with sole_writer(config.run_dir, if_running, str(flow_run.id) if flow_run.id else None):
        return await _stages(config, recipe)


async def _stages(config, recipe: str) -> dict:
    stages.write_config(config)
    tracking.check_reachable(config.tracking_uri)
    # What MLflow's run list and compare view filter on (rloo.promoted turns true when a promotion
    # publishes it).
    tags = {
        "rloo.recipe": recipe,
        "rloo.model": str(config.training["model_name_or_path"]),
        "rloo.promoted": "false",
        "prefect.flow_run_id": str(flow_run.id) if flow_run.id else "",
        "prefect.flow_run_name": flow_run.name or "",
    }
    with tracking.pipeline_run(config, resolved_dict(config), tags) as (parent, experiment):
        link = tracking.run_link(config.tracking_uri, experiment, parent)
        create_link_artifact(
            link,
            link_text=f"MLflow run {config.run_key}",
            key=f"{config.name}-mlflow-run",
            _sync=True,
        )
        print(
            f"[pipeline] {config.run_key}: run directory {config.run_dir}; MLflow run {parent} "
            f"({config.tracking_uri})"
        )
        options = dict(result_storage=result_storage(config.run_root))
        dataset = dataset_task.with_options(**options)(config, parent)
        model = model_task.with_options(**options)(config, dataset, parent)
        trained = await train_task.with_options(**options)(config, dataset, model, parent)
        summary = {
            "run_key": config.run_key,
            "run_dir": config.run_dir,
            "mlflow_run_id": parent,
            "mlflow_link": link,
            "dataset": dataset,
            "model": model,
            "train": trained,
        }
        if config.evaluation.enabled and not trained.get("pruned"):
            summary["evaluate"] = evaluate_task.with_options(**options)(
                config, dataset, model, trained, parent
            )
    stages.write_json(stages.stage_path(config, "summary.json"), summary)
    return summary
