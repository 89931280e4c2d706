"""A train run's checkpoints as MLflow LoggedModels, and the evidence that ranks them.

Every checkpoint the job saved (`train/checkpoints.jsonl`, written at save time) and the final
model become one LoggedModel each of the train stage's run when training ends: its step, the
recipe's parameters, tags (base model, adapter or full weights, checkpoint folder) and its
weights in MLflow's transformers flavor, or a reference to the folder when the weights are larger
than `tracking.log_weights_max_mb` (or the policy is a vision-language model, which the flavor's
text-generation pipeline cannot carry). A checkpoint that save_total_limit deleted before training
ended stays a record, tagged `rloo.stored=deleted`. Models are found again by their tags, so a
resumed or retried stage makes none twice.

The evaluate stage scores the final model and every `evaluation.checkpoint_interval`-th kept
checkpoint on the held-out sets; `checkpoint_table` and `best` read what it found."""

from __future__ import annotations

import dataclasses
import hashlib
import os

from infra import stages, tracking
from infra.job_tracking import CHECKPOINTS, read_jsonl
from infra.runconfig import RunConfig
from rloo.checkpoint import is_complete
from rloo.models import load_causal_lm, load_tokenizer, prepare_tokenizer
from rloo.vision import is_vision_config

FINAL = "final"
# a checkpoint folder's files that are not the policy's weights
TRAINING_STATE = ("optimizer", "scheduler", "rng_state", "training_args", "scaler")


@dataclasses.dataclass
class Checkpoint:
    name: str  # "checkpoint-N", or FINAL for the model saved at the end of training
    step: int
    path: str
    model_id: str | None = None

    @property
    def exists(self) -> bool:
        """The weights are there: a complete checkpoint (rloo.checkpoint's marker), or the final
        model's adapter or config."""
        if self.name != FINAL:
            return is_complete(self.path)
        return os.path.isfile(os.path.join(self.path, "adapter_config.json")) or os.path.isfile(
            os.path.join(self.path, "config.json")
        )

    @property
    def adapter(self) -> bool:
        return os.path.isfile(os.path.join(self.path, "adapter_config.json"))


def saved_checkpoints(config: RunConfig, train_result: dict) -> list[Checkpoint]:
    """Every checkpoint the job saved (kept or deleted since), by step, then the final model
    (none for a pruned trial); the model ids the train stage recorded."""
    models = train_result.get("models") or {}
    found = training_checkpoints(config)
    if not train_result.get("pruned"):  # a pruned trial's job was stopped before its end
        found.append(
            Checkpoint(FINAL, int(train_result["global_step"]), train_result["output_dir"])
        )
    for checkpoint in found:
        checkpoint.model_id = models.get(checkpoint.name)
    return sorted(found, key=lambda c: (c.step, c.name == FINAL))


def training_checkpoints(config: RunConfig) -> list[Checkpoint]:
    """The checkpoints the job recorded so far (kept or deleted since), in the order saved."""
    records = read_jsonl(os.path.join(stages.train_dir(config), CHECKPOINTS))
    return [Checkpoint(f"checkpoint-{r['step']}", int(r["step"]), r["path"]) for r in records]


def weight_files(path: str) -> list[str]:
    """The policy's weight files in a checkpoint folder (not the optimizer or other state)."""
    return sorted(
        os.path.join(path, name)
        for name in os.listdir(path)
        if name.endswith((".safetensors", ".bin")) and not name.startswith(TRAINING_STATE)
    )


def weights_digest(path: str) -> str:
    """Equal weights, equal digest (the final model is usually the last checkpoint's weights)."""
    digest = hashlib.sha256()
    for file in weight_files(path):
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def log_models(config: RunConfig, train_result: dict, model_result: dict, run_id: str) -> dict:
    """Each saved checkpoint and the final model as a LoggedModel of the train run `run_id`
    (found again when it exists: none twice); returns the train result with `models` (name ->
    model id), persisted as the stage's result."""
    from transformers import AutoConfig

    uri, experiment = config.tracking_uri, config.tracking.experiment
    policy = model_result["policy"]
    trust = bool(config.recipe_value("trust_remote_code"))
    vision = is_vision_config(AutoConfig.from_pretrained(policy, trust_remote_code=trust))
    models = {}
    saved = saved_checkpoints(config, train_result)
    adapter = saved[-1].adapter  # the run's kind (a deleted checkpoint's folder cannot say)
    for checkpoint in saved:
        identity = {"rloo.run_key": config.run_key, "rloo.checkpoint": checkpoint.name}
        existing = tracking.find_logged_models(uri, experiment, identity)
        ready = [model for model in existing if str(model.status) == "READY"]
        if ready:
            models[checkpoint.name] = ready[0].model_id
            continue
        tags = {
            **identity,
            "rloo.step": str(checkpoint.step),
            "rloo.base_model": policy,
            "rloo.weights_path": checkpoint.path,
            "rloo.weights": "adapter" if adapter else "full",
        }
        # a PENDING one is an earlier attempt killed while logging: its files are written again
        model_id = (
            existing[0].model_id
            if existing
            else tracking.create_logged_model(
                uri, experiment, checkpoint.name, run_id, tags, config.training
            )
        )
        models[checkpoint.name] = model_id
        if not checkpoint.exists:
            tracking.tag_logged_model(uri, model_id, {"rloo.stored": "deleted"})
            tracking.finalize_logged_model(uri, model_id)
            continue
        size_mb = sum(os.path.getsize(f) for f in weight_files(checkpoint.path)) / 2**20
        if vision or size_mb > config.tracking.log_weights_max_mb:
            tracking.tag_logged_model(uri, model_id, {"rloo.stored": "referenced"})
            tracking.finalize_logged_model(uri, model_id)
            continue
        tracking.tag_logged_model(uri, model_id, {"rloo.stored": "logged"})
        _attach_weights(config, checkpoint, model_result, model_id)  # READY once written
    result = {**train_result, "models": models}
    return stages.save_stage_result(config, "train", result)


def load_policy(policy: str, weights: str | None, trust: bool):
    """A policy to score, log or publish: the base model (`weights` None), the base plus the
    adapter saved in `weights`, or the full model saved there."""
    import warnings

    from transformers.utils import logging as transformers_logging

    # one summary line per stage, not a bar per weight file
    transformers_logging.disable_progress_bar()
    if weights is None:
        return load_causal_lm(policy, {}, trust).eval()
    if os.path.exists(os.path.join(weights, "adapter_config.json")):
        from peft import PeftModel

        # peft 0.21 calls transformers' deprecated is_gradient_checkpointing
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
            )
            return PeftModel.from_pretrained(load_causal_lm(policy, {}, trust), weights).eval()
    return load_causal_lm(weights, {}, trust).eval()


def _attach_weights(
    config: RunConfig, checkpoint: Checkpoint, model_result: dict, model_id: str
) -> None:

    policy = model_result["policy"]
    trust = bool(config.recipe_value("trust_remote_code"))
    model = load_policy(policy, checkpoint.path, trust)
    tokenizer = prepare_tokenizer(
        load_tokenizer(model_result["tokenizer"] or policy, trust, config=model.config)
    )
    tracking.attach_transformers_weights(
        config.tracking_uri,
        model_id,
        checkpoint.name,
        checkpoint.step,
        model,
        tokenizer,
        policy if checkpoint.adapter else None,
    )


def to_evaluate(config: RunConfig, train_result: dict) -> list[Checkpoint]:
    """Every `evaluation.checkpoint_interval`-th checkpoint still on disk (0: none), then the
    final model."""
    interval = config.evaluation.checkpoint_interval
    saved = saved_checkpoints(config, train_result)
    kept = [c for c in saved if c.name != FINAL and c.exists]
    chosen = kept[interval - 1 :: interval] if interval else []
    return chosen + [c for c in saved if c.name == FINAL]


def best(table: list[dict], metric: str) -> dict | None:
    """The evaluated checkpoint with the highest held-out `metric` (ties: the earliest), or None
    when none has it."""
    scored = [row for row in table if row["held_out"].get(metric) is not None]
    if not scored:
        return None
    return max(
        scored, key=lambda row: (row["held_out"][metric], -row["step"], row["name"] != FINAL)
    )


def render_table(table: list[dict], metric: str, set_names: list[str]) -> list[str]:
    """Markdown rows: one per evaluated checkpoint, its held-out `metric` (and every extra set's),
    the best marked."""
    chosen = best(table, metric)
    header = [
        "checkpoint",
        "step",
        f"held-out {metric}",
        *(f"{name} {metric}" for name in set_names),
        "",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in table:
        values = [
            row["held_out"].get(metric),
            *(row["sets"].get(name, {}).get(metric) for name in set_names),
        ]
        cells = [
            row["name"],
            str(row["step"]),
            *("-" if value is None else f"{value:.3f}" for value in values),
            "**best**" if chosen is not None and row["name"] == chosen["name"] else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
