"""Completion tables: rich in the terminal, MLflow's log_table when report_to has mlflow, a `completions` table in
wandb and trackio (offline); log_extra columns."""

import json
import os

import pytest

from helpers import conversational, length_reward, make_args
from rloo import RLOOTrainer


def reward_with_extras(completion_ids, tag, log_extra, log_metric, **kwargs):
    log_extra("tag_seen", [f"tag-{t}" for t in tag])
    log_metric("half", 0.5)
    return [float(len(ids)) for ids in completion_ids]


def test_rich_table_with_extra_columns(tmp_path, tokenizer, model, capsys):
    args = make_args(tmp_path, log_completions=True, max_steps=2, shuffle_dataset=False)
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=reward_with_extras,
        args=args,
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    trainer.train()
    out = capsys.readouterr().out
    assert (
        out.count("Completions at step") == 2
    )  # once per logging step, not again at the end of training
    for column in ("prompt", "completion", "reward_with_extras", "tag_seen", "advantage"):
        assert column in out
    assert "tag-" in out and "user: " in out
    # the latest generation batch (step 2: prompts 2 and 3, twice each, shuffle off)
    assert list(trainer._logs["extra"]["tag_seen"]) == ["tag-2", "tag-2", "tag-3", "tag-3"]
    rows = trainer._logs.rows(step=2)
    assert len(rows) == 4 and list(rows[0]) == [
        "step",
        "prompt",
        "completion",
        "reward_with_extras",
        "tag_seen",
        "advantage",
    ]


def test_sample_size_and_unique_prompts(tmp_path, tokenizer, model, capsys):
    args = make_args(
        tmp_path, log_completions=True, max_steps=1, num_completions_to_print=1, num_generations=4
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    trainer.train()
    out = capsys.readouterr().out
    assert out.count("user: ") == 1  # one sampled row printed
    assert len(trainer._logs.rows(step=1, unique_prompts=True)) == 1  # 4 completions of one prompt
    assert len(trainer._logs.rows(step=1)) == 4


def test_completion_table_logged_to_mlflow(tmp_path, tokenizer, model, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "completions-test")
    monkeypatch.delenv("DISABLE_MLFLOW_INTEGRATION", raising=False)
    args = make_args(
        tmp_path, log_completions=True, max_steps=2, report_to=["mlflow"], run_name="table-run"
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=reward_with_extras,
        args=args,
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    trainer.train()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["completions-test"], output_format="list")
    assert len(runs) == 1
    run = runs[0]
    artifacts = [
        a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "completions")
    ]
    assert artifacts == ["completions/step_0000001.json", "completions/step_0000002.json"]
    local = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path=artifacts[-1], dst_path=str(tmp_path / "dl")
    )
    with open(local) as handle:
        table = json.load(handle)
    assert table["columns"] == [
        "step",
        "prompt",
        "completion",
        "reward_with_extras",
        "tag_seen",
        "advantage",
    ]
    assert len(table["data"]) == 4
    assert run.data.metrics["half"] == 0.5 and "reward" in run.data.metrics
    assert os.path.exists(tmp_path / "mlflow.db")


def test_completion_tables_reach_wandb_and_trackio_offline(tmp_path, monkeypatch):
    """report_to wandb and trackio (wandb's offline mode, trackio's local SQLite): each gets the
    `completions` table as TRL logs it, a VLM's images as each tracker's Image type."""
    import glob
    import sqlite3

    wandb = pytest.importorskip("wandb")
    trackio_dir = pytest.importorskip("trackio.utils").TRACKIO_DIR  # (tests/conftest.py)
    from test_vision import FAMILIES, position_reward, vlm_dataset

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    model, processor = FAMILIES["qwen2_vl"]()
    args = make_args(
        tmp_path,
        max_steps=1,
        log_completions=True,
        report_to=["wandb", "trackio"],
        run_name="tables",
        project=f"tables-{tmp_path.name}",
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=position_reward,
        args=args,
        train_dataset=vlm_dataset(2),
        processing_class=processor,
    )
    trainer.train()
    wandb.finish()
    [table_file] = glob.glob(
        str(
            tmp_path
            / "wandb"
            / "offline-run-*"
            / "files"
            / "media"
            / "table"
            / "completions_1_*.table.json"
        )
    )
    with open(table_file) as handle:
        table = json.load(handle)
    assert table["columns"] == [
        "step",
        "prompt",
        "completion",
        "position_reward",
        "advantage",
        "image",
    ]
    assert len(table["data"]) == 4 and {row[-1] for row in table["data"]} == {"Image"}
    [database] = glob.glob(str(trackio_dir / f"tables-{tmp_path.name}.db"))
    logged = [
        json.loads(row[0])
        for row in sqlite3.connect(database).execute("select metrics from metrics")
    ]
    [completions] = [entry["completions"] for entry in logged if "completions" in entry]
    assert completions["_type"] == "trackio.table" and len(completions["_value"]) == 4
    image = completions["_value"][0]["image"]
    assert image["_type"] == "trackio.image"
    assert glob.glob(str(trackio_dir / "**" / image["file_path"]), recursive=True)
