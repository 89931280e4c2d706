from __future__ import annotations

from prefect import task

from infra import stages, tracking
from infra.runconfig import RunConfig
from tasks.common import cache_key, say


@task(name="model", cache_key_fn=cache_key("model"), persist_result=True)
def model_task(config: RunConfig, dataset_result: dict, parent_run_id: str | None) -> dict:
    result = tracking.tracked_stage(
        config,
        parent_run_id,
        "model",
        lambda: stages.prepare_model(config, dataset_result),
        tracking.model_record,
    )
    peft = result["peft"]
    adapter = (
        f"LoRA r={peft['r']} on {peft['target_modules']}" if peft["enabled"] else "full fine-tuning"
    )
    say(
        "model",
        f"{result['policy']} ({result['num_parameters'] / 1e6:.1f}M parameters), {adapter}; "
        f"rewards: {', '.join(result['reward_names'])}",
        config=config,
    )
    return result
