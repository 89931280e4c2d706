"""`rloo-pipeline compare`: what differs between runs' configs, their held-out metrics side by side,
an overlay of their training reward curves (a PNG, also logged to MLflow), and the link to MLflow's
own comparison view."""

from __future__ import annotations

import json
import os

from infra import tracking
from infra.evaluation import figure, save_figure
from infra.runconfig import RunConfig


def config_differences(configs: dict[str, RunConfig]) -> dict[str, dict[str, object]]:
    """{flattened key: {run: value}} for every key whose value is not the same in all runs."""
    flat = {
        run: tracking.flatten(json.loads(config.model_dump_json(exclude={"run_root"})))
        for run, config in configs.items()
    }
    keys = sorted({key for values in flat.values() for key in values})
    return {
        key: {run: flat[run].get(key, "-") for run in configs}
        for key in keys
        if len({json.dumps(values.get(key), default=str) for values in flat.values()}) > 1
    }


def plot_curves(curves: dict[str, list[tuple[int, float]]], target: str) -> str | None:
    if not any(curves.values()):
        return None

    plt, fig, axis = figure((7, 4))
    for run, points in curves.items():
        if points:
            axis.plot(
                [step for step, _ in points], [value for _, value in points], marker="o", label=run
            )
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("mean reward (training batch)")
    axis.set_title("Training reward")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return save_figure(plt, fig, target)


def compare(configs: dict[str, RunConfig], out_dir: str) -> dict:
    """Differences, metrics, curves and links of these runs (all tracked in the same MLflow)."""
    first = next(iter(configs.values()))
    uri, experiment = first.tracking_uri, first.tracking.experiment
    mlflow_runs = {
        run: tracking.pipeline_runs(config.tracking_uri, config.tracking.experiment, run)
        for run, config in configs.items()
    }
    missing = [run for run, found in mlflow_runs.items() if "pipeline" not in found]
    if missing:
        raise FileNotFoundError(
            f"no MLflow run for {', '.join(missing)} in {uri} (experiment {experiment!r})."
        )
    metrics = {
        run: dict(found["evaluate"].data.metrics) if "evaluate" in found else {}
        for run, found in mlflow_runs.items()
    }
    curves = {
        run: tracking.metric_history(uri, found["train"].info.run_id, "reward")
        if "train" in found
        else []
        for run, found in mlflow_runs.items()
    }
    os.makedirs(out_dir, exist_ok=True)
    plot = plot_curves(curves, os.path.join(out_dir, "reward_curves.png"))
    comparison = tracking.log_comparison(uri, experiment, list(configs), [plot] if plot else [])
    parents = [found["pipeline"] for found in mlflow_runs.values()]
    return {
        "differences": config_differences(configs),
        "metrics": metrics,
        "plot": plot,
        "tags": {run: dict(found["pipeline"].data.tags) for run, found in mlflow_runs.items()},
        "comparison_run": comparison,
        "link": tracking.compare_link(
            uri, [p.info.experiment_id for p in parents], [p.info.run_id for p in parents]
        ),
    }
