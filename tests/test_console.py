"""The tiny pipeline as a user runs it: the console shows the pipeline's own lines only (what MLflow, Prefect and
DeepSpeed say goes to the run root's pipeline.log), and a held-out set phrased unlike the training prompts
(evaluation.extra_sets) is scored and reported beside the held-out prompts, in report.md and in MLflow."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = re.compile(r"\[(pipeline|dataset|model|train|evaluate)\] |Done in \d+ s: |  \S|$")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("console")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PREFECT_", "MLFLOW_"))
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "configs/tiny.yaml",
            "--set",
            f"run_root={root}",
            "--set",
            "evaluation.extra_sets={rephrased: data/arithmetic_rephrased.jsonl}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return root, result


def test_the_tiny_pipeline_prints_only_its_own_lines(tiny_run):
    root, result = tiny_run
    lines = (result.stdout + result.stderr).splitlines()
    assert [line for line in lines if not OURS.match(line)] == []
    assert "\r" not in result.stdout + result.stderr  # no progress bar
    stages = {line.split("]")[0] + "]" for line in lines if line.startswith("[")}
    assert {"[pipeline]", "[dataset]", "[model]", "[train]", "[evaluate]"} <= stages
    log = (root / "pipeline.log").read_text()
    assert (
        "Creating initial MLflow database tables" in log and "Finished in state Completed()" in log
    )


def test_a_rephrased_held_out_set_is_reported_beside_the_held_out_prompts(tiny_run):
    root, result = tiny_run
    assert re.search(
        r"\[evaluate\] held-out reward .*; rephrased \d\.\d{3} -> \d\.\d{3}; report", result.stderr
    )
    run_dir = next(path for path in root.iterdir() if path.name.startswith("tiny-"))
    metrics = json.loads((run_dir / "eval" / "metrics.json").read_text())
    rephrased = metrics["extra_sets"]["rephrased"]
    assert rephrased["num_prompts"] == 40 and rephrased["trained"]["reward"] is not None
    report = (run_dir / "eval" / "report.md").read_text()
    assert (
        "## Held-out set `rephrased`" in report
        and "40 prompts from `data/arithmetic_rephrased.jsonl`" in report
    )
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
    runs = client.search_runs(
        [client.get_experiment_by_name("rloo").experiment_id],
        "tags.`rloo.run_key` = '" + run_dir.name + "'",
    )
    logged = {key for run in runs for key in run.data.metrics}
    assert {"rephrased_base_reward", "rephrased_trained_reward"} <= logged


def test_quieting_the_console_leaves_a_hosts_own_log_capture_alone(tmp_path):
    """An application (or pytest's caplog) that runs the pipeline in its process keeps every record its own
    handler captures; only the terminal's handlers are filtered."""
    import io
    import logging

    from flows.console import OwnLines, quiet

    capture, terminal = logging.StreamHandler(io.StringIO()), logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    root.addHandler(capture)
    root.addHandler(terminal)
    try:
        quiet(str(tmp_path))
        logging.getLogger("rloo.rewards.runner").warning("a library's warning")
    finally:
        root.removeHandler(capture)
        root.removeHandler(terminal)
    assert "a library's warning" in capture.stream.getvalue()
    assert any(isinstance(f, OwnLines) for f in terminal.filters)
    assert not any(isinstance(f, OwnLines) for f in capture.filters)
