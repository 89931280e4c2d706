from __future__ import annotations

from prefect import task

from infra import stages, tracking
from infra.runconfig import RunConfig
from tasks.common import cache_key, say


@task(name="dataset", cache_key_fn=cache_key("dataset"), persist_result=True)
def dataset_task(config: RunConfig, parent_run_id: str | None) -> dict:
    result = tracking.tracked_stage(
        config,
        parent_run_id,
        "dataset",
        lambda: stages.prepare_dataset(config),
        lambda result: tracking.dataset_record(result, stages.split_datasets(config, result)),
    )
    say(
        "dataset",
        f"{result['num_train']} train / {result['num_eval']} held-out prompts ({result['format']}) "
        f"from {result['source']}",
        config=config,
    )
    return result
