from __future__ import annotations

import os

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra import evaluation, stages, tracking
from infra.runconfig import RunConfig
from tasks.common import cache_key, say


@task(name="evaluate", cache_key_fn=cache_key("evaluate"), persist_result=True)
def evaluate_task(
    config: RunConfig,
    dataset_result: dict,
    model_result: dict,
    train_result: dict,
    parent_run_id: str | None,
) -> dict:
    result = tracking.tracked_stage(
        config,
        parent_run_id,
        "evaluate",
        lambda: evaluation.evaluate_policy(config, dataset_result, model_result, train_result),
        lambda result: tracking.evaluation_record(
            result,
            train_result["global_step"],
            stages.pipeline_datasets(config, dataset_result),
            list(config.evaluation.extra_sets),
        ),
    )
    with open(result["report_path"]) as handle:
        report = handle.read()
    for plot in (result["plot_path"], result.get("timing_plot_path")):
        if plot:
            report = report.replace(f"]({os.path.basename(plot)})", f"]({plot})")
    create_markdown_artifact(
        report, key=f"{config.name}-evaluation", description=f"Evaluation of {config.run_key}"
    )
    create_table_artifact(
        [
            {"metric": key, "base": result["base"][key], "trained": result["trained"].get(key)}
            for key in result["base"]
        ],
        key=f"{config.name}-evaluation-table",
    )
    gain = result["reward_gain"]
    extra = "".join(
        f"; {name} {evaluation.format_number(found['base']['reward'])} -> "
        f"{evaluation.format_number(found['trained']['reward'])}"
        for name, found in result.get("extra_sets", {}).items()
    )
    say(
        "evaluate",
        f"held-out reward {evaluation.format_number(result['base']['reward'])} (base) -> "
        f"{evaluation.format_number(result['trained']['reward'])} (trained), gain "
        f"{'-' if gain is None else f'{gain:+.3f}'}{extra}; report: {result['report_path']}",
        config=config,
    )
    return result
