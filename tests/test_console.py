"""The main job's console shows the pipeline's own lines only: the tiny pipeline, run as a user runs it, prints
stage lines, progress and the summary; what MLflow, Prefect and DeepSpeed say goes to the run root's
pipeline.log."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = re.compile(r"\[(pipeline|dataset|model|train|evaluate)\] |Done in \d+ s: |  \S|$")


def test_the_tiny_pipeline_prints_only_its_own_lines(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    env["RLOO_CACHE"] = os.environ.get("RLOO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rloo"))
    result = subprocess.run([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", "--set",
                             f"run_root={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    assert [line for line in lines if not OURS.match(line)] == []
    assert "\r" not in result.stdout + result.stderr  # no progress bar
    stages = [line.split("]")[0] + "]" for line in lines if line.startswith("[")]
    assert {"[pipeline]", "[dataset]", "[model]", "[train]", "[evaluate]"} <= set(stages)
    log = (tmp_path / "pipeline.log").read_text()
    assert "Creating initial MLflow database tables" in log and "Finished in state Completed()" in log
