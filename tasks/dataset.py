from __future__ import annotations

from prefect import task

from infra import stages, tracking
from infra.runconfig import RunConfig
from tasks.common import cache_key, say, stage_run


@task(name="dataset", cache_key_fn=cache_key("dataset"), persist_result=True)
def dataset_task(config: RunConfig, parent_run_id: str | None) -> dict:
    with stage_run(config, parent_run_id, "dataset") as run_id:
        result = stages.prepare_dataset(config)
        if run_id:
            uri = config.tracking_uri
            for split in ("train", "eval"):
                tracking.log_dataset(uri, run_id, result[f"{split}_path"], f"{config.name}-{split}",
                                     result["digest"], "training" if split == "train" else "evaluation")
            tracking.log_metrics(uri, run_id, {"num_train": result["num_train"], "num_eval": result["num_eval"]}, 0)
            tracking.log_params(uri, run_id, {"source": result["source"], "format": result["format"],
                                              "digest": result["digest"]})
    say("dataset", f"{result['num_train']} train / {result['num_eval']} held-out prompts ({result['format']}) "
                   f"from {result['source']}")
    return result
