"""Checkpoints as MLflow LoggedModels (infra.checkpoints): which are scored, the best of them, the table, and the
models themselves in a local MLflow store (weights logged or referenced by size, found again, loadable)."""

import json
import os

from infra import stages
from infra.runconfig import load_run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def tiny(tmp_path, *overrides):
    return load_run_config(
        TINY, [f"run_root={tmp_path}", f"data.source={ROOT}/data/arithmetic.jsonl", *overrides]
    )


def test_checkpoint_choice_table_and_best_by_hand(tmp_path):
    """Which checkpoints the evaluate stage scores (every k-th kept one, then the final model), the best by the held-out
    metric (ties: the earliest, a checkpoint before the final model of the same step), the report's table."""
    from infra import checkpoints
    from rloo.checkpoint import marker_path

    def saved(
        interval,
    ):  # checkpoints 2, 4, 6 and 8 saved, checkpoint-2 deleted by save_total_limit since
        config = tiny(tmp_path, f"evaluation.checkpoint_interval={interval}")
        train = stages.train_dir(config)
        os.makedirs(os.path.join(train, "output"))
        open(os.path.join(train, "output", "adapter_config.json"), "w").write("{}")
        with open(os.path.join(train, "checkpoints.jsonl"), "w") as handle:
            for step in (2, 4, 6, 8):
                path = os.path.join(train, "output", f"checkpoint-{step}")
                if step != 2:
                    os.makedirs(path)
                    open(os.path.join(path, "adapter_config.json"), "w").write("{}")
                    os.makedirs(os.path.dirname(marker_path(path)))
                    with open(marker_path(path), "w") as marker:  # a complete save
                        json.dump({"files": {"adapter_config.json": 2}}, marker)
                handle.write(json.dumps({"step": step, "path": path}) + "\n")
        result = {
            "global_step": 8,
            "output_dir": os.path.join(train, "output"),
            "models": {"final": "m-1"},
        }
        return config, result

    config, result = saved(2)
    assert [(c.name, c.model_id) for c in checkpoints.saved_checkpoints(config, result)] == [
        ("checkpoint-2", None),
        ("checkpoint-4", None),
        ("checkpoint-6", None),
        ("checkpoint-8", None),
        ("final", "m-1"),
    ]
    assert [c.name for c in checkpoints.to_evaluate(config, result)] == [
        "checkpoint-6",
        "final",
    ]  # of 4, 6, 8 kept
    assert [c.name for c in checkpoints.to_evaluate(*saved(1))] == [
        "checkpoint-4",
        "checkpoint-6",
        "checkpoint-8",
        "final",
    ]
    assert [c.name for c in checkpoints.to_evaluate(*saved(0))] == ["final"]
    table = [
        {
            "name": name,
            "step": step,
            "held_out": {"reward": value},
            "sets": {"other": {"reward": 0.1}},
        }
        for name, step, value in (
            ("checkpoint-4", 4, 0.5),
            ("checkpoint-6", 6, 0.75),
            ("checkpoint-8", 8, 0.75),
            ("final", 8, 0.75),
        )
    ]
    assert checkpoints.best(table, "reward")["name"] == "checkpoint-6"
    assert (
        checkpoints.best(table[2:], "reward")["name"] == "checkpoint-8"
    )  # before the final model, same weights
    assert checkpoints.best(table, "accuracy") is None
    lines = checkpoints.render_table(table, "reward", ["other"])
    assert lines[0] == "| checkpoint | step | held-out reward | other reward |  |"
    assert lines[3] == "| checkpoint-6 | 6 | 0.750 | 0.100 | **best** |" and "best" not in lines[4]


def test_full_weights_are_logged_up_to_the_size_limit_and_referenced_above_it(tmp_path):
    """A full fine-tune's checkpoints (no adapter) in a local MLflow store: under tracking.log_weights_max_mb the
    weights are copied into MLflow and the model loads with mlflow.transformers and generates; with the limit at 0
    they are referenced by their folder. A checkpoint deleted since its save stays a record, tagged deleted. Logging
    again (a retried stage) makes nothing twice."""
    import mlflow

    from infra import checkpoints, tracking
    from rloo.assets import resolve_model_alias
    from rloo.checkpoint import marker_path
    from rloo.models import load_causal_lm

    def run(limit):
        config = tiny(
            tmp_path / f"limit-{limit}",
            "training.use_peft=false",
            f"tracking.log_weights_max_mb={limit}",
        )
        policy, tokenizer = resolve_model_alias("tiny", str(tmp_path / ".assets"))
        model = load_causal_lm(policy, {}, False)
        train = stages.train_dir(config)
        output = os.path.join(train, "output")
        os.makedirs(train)
        with open(os.path.join(train, "checkpoints.jsonl"), "w") as handle:
            for step in (1, 2):
                path = os.path.join(output, f"checkpoint-{step}")
                handle.write(json.dumps({"step": step, "path": path}) + "\n")
                if step == 2:
                    model.save_pretrained(path)
                    os.makedirs(os.path.dirname(marker_path(path)))
                    with open(marker_path(path), "w") as marker:
                        json.dump({"files": {}}, marker)
        model.save_pretrained(output)
        run_id = tracking.start_run(config.tracking_uri, "rloo", "train", {})
        result = {"global_step": 2, "output_dir": output, "mlflow_run_id": run_id}
        model_result = {"policy": policy, "tokenizer": tokenizer}
        stages.save_stage_result(config, "train", result)
        logged = checkpoints.log_models(config, result, model_result, run_id)["models"]
        assert (
            checkpoints.log_models(config, result, model_result, run_id)["models"] == logged
        )  # found again
        found = tracking.find_logged_models(
            config.tracking_uri, "rloo", {"rloo.run_key": config.run_key}
        )
        return config, {m.name: m for m in found}, logged

    config, models, logged = run(2048)
    assert set(models) == {"checkpoint-1", "checkpoint-2", "final"} and len(logged) == 3
    assert {name: m.tags["rloo.stored"] for name, m in models.items()} == {
        "checkpoint-1": "deleted",
        "checkpoint-2": "logged",
        "final": "logged",
    }
    assert (
        models["checkpoint-2"].tags["rloo.weights"] == "full"
        and str(models["final"].status) == "READY"
    )
    with tracking._fluent_uri(config.tracking_uri):
        pipeline = mlflow.transformers.load_model(f"models:/{logged['checkpoint-2']}")
    out = pipeline(
        "2+2?", max_new_tokens=3, min_new_tokens=3, do_sample=False, return_full_text=False
    )
    assert out[0]["generated_text"].strip()
    _, models, _ = run(0)
    assert {name: m.tags["rloo.stored"] for name, m in models.items()} == {
        "checkpoint-1": "deleted",
        "checkpoint-2": "referenced",
        "final": "referenced",
    }
    assert models["final"].tags["rloo.weights_path"].endswith("train/output")
