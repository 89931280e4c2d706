"""Through the pipeline: the train stage's job killed with SIGKILL in the middle of a checkpoint save (the kill point
of tests/faults/test_kill_points.py), the pipeline run fails naming the job and how to go on; `rloo-pipeline resume
RUN` trains on from the last complete checkpoint and ends with the weights of an uninterrupted `rloo train` of the
same recipe, and the MLflow train run holds every step's reward exactly once (the replayed step is not logged
twice)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from harness import ROOT, environment
from safetensors.torch import load_file

from infra.runconfig import load_run_config
from infra.tracking import client

pytestmark = pytest.mark.slow
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
STEPS = 5


def pipeline(*arguments, env):
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_pipeline_whose_job_is_killed_mid_save_resumes_to_the_same_weights(
    tmp_path, mlflow_server
):
    run_root = str(tmp_path / "runs")
    sets = [
        f"run_root={run_root}",
        f"tracking.tracking_uri={mlflow_server.uri}",
        f"data.source={ROOT}/data/arithmetic.jsonl",
        f"training.max_steps={STEPS}",
        "training.save_steps=1",
        "evaluation.enabled=false",
    ]
    killed = pipeline(
        "run", TINY, *[f"--set={s}" for s in sets], env=environment(point="mid-save", at=3)
    )
    assert killed.returncode == 1, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert (
        "rloo-pipeline run: error: training job" in killed.stderr
        and "`rloo-pipeline resume RUN`" in killed.stderr
    )
    config = load_run_config(TINY, sets)
    resumed = pipeline("resume", config.run_key, "--run-root", run_root, env=environment())
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    output = os.path.join(config.run_dir, "train", "output")
    assert f"resumed from {output}/checkpoint-2" in resumed.stdout + resumed.stderr

    with open(os.path.join(config.run_dir, "train", "recipe.yaml")) as handle:
        recipe = yaml.safe_load(handle)
    recipe.pop("resume_from_checkpoint")
    (tmp_path / "reference.yaml").write_text(yaml.safe_dump(recipe))
    reference = subprocess.run(
        [
            sys.executable,
            "-m",
            "rloo",
            "train",
            "--config",
            str(tmp_path / "reference.yaml"),
            "--output_dir",
            str(tmp_path / "reference"),
        ],
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    got, expected = (
        load_file(os.path.join(folder, "adapter_model.safetensors"))
        for folder in (output, tmp_path / "reference")
    )
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.allclose(got[key], expected[key], atol=1e-6), key

    with open(os.path.join(config.run_dir, "summary.json")) as handle:
        run_id = json.load(handle)["train"]["mlflow_run_id"]
    history = client(mlflow_server.uri).get_metric_history(run_id, "reward")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    with open(os.path.join(config.run_dir, "train", "metrics.jsonl")) as handle:
        steps = [json.loads(line)["step"] for line in handle if '"reward"' in line]
    assert steps == list(range(1, STEPS + 1))


def test_a_pipeline_whose_job_is_killed_before_its_first_checkpoint_restarts_it_and_says_so(
    tmp_path, mlflow_server
):
    """Killed in its third optimizer step with no checkpoint saved yet: `rloo-pipeline resume RUN` says the job
    restarted from the start and trains every step."""
    run_root = str(tmp_path / "runs")
    sets = [
        f"run_root={run_root}",
        f"tracking.tracking_uri={mlflow_server.uri}",
        f"data.source={ROOT}/data/arithmetic.jsonl",
        f"training.max_steps={STEPS}",
        "training.save_steps=100",
        "evaluation.enabled=false",
        "training.callbacks=[points:KillPoints]",
    ]
    killed = pipeline(
        "run", TINY, *[f"--set={s}" for s in sets], env=environment(point="optimizer-step", at=3)
    )
    assert killed.returncode == 1, killed.stdout[-3000:] + killed.stderr[-3000:]
    config = load_run_config(TINY, sets)
    resumed = pipeline("resume", config.run_key, "--run-root", run_root, env=environment())
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, said[-3000:]
    assert (
        "[train] restarted from the start (the earlier attempt saved no checkpoint) as local job"
        in said
    )
    assert f"[train] step {STEPS}/{STEPS}" in said and f"{STEPS} optimizer steps done" in said
    with open(os.path.join(config.run_dir, "train", "metrics.jsonl")) as handle:
        steps = [json.loads(line)["step"] for line in handle if '"reward"' in line]
    assert steps == list(
        range(1, STEPS + 1)
    )  # each once: the new attempt's steps 1 and 2 were logged already
