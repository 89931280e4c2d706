"""Pipeline overhead: wall time of `rloo-pipeline run` (ephemeral Prefect API, SQLite MLflow, dataset/model
stages, submitit + torchrun, no evaluation) over the bare `rloo train` it launches, on the same recipe, same run;
and a rerun of the finished run (every stage cached) against its first run. Each repeat starts from a new run
root, so the first run also pays for creating the Prefect and MLflow databases.

    .venv/bin/python benchmarks/pipeline_overhead.py [--config configs/tiny.yaml] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(command: list[str], env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return time.perf_counter() - start, result.stdout


def train_runtime(text: str) -> float | None:
    """Trainer.train's own train_runtime from a log: the training itself, without start-up (machine drift shows
    here: the same recipe's two runtimes should match)."""
    found = re.findall(r"'train_runtime': '?([0-9.]+)'?", text) or re.findall(
        r'"train_runtime": ([0-9.]+)', text
    )
    return float(found[-1]) if found else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    pipeline_times, bare_times, rerun_times = [], [], []
    command = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        options.config,
        "--set",
        "evaluation.enabled=false",
    ]
    for repeat in range(options.repeats):
        root = tempfile.mkdtemp(prefix="rloo-overhead-")
        runtimes = {}
        try:
            pipeline_times.append(timed(command + ["--set", f"run_root={root}"], env)[0])
            rerun_times.append(timed(command + ["--set", f"run_root={root}"], env)[0])
            run_dir = next(
                os.path.join(root, d)
                for d in os.listdir(root)
                if os.path.exists(os.path.join(root, d, "config.json"))
            )
            with open(os.path.join(run_dir, "train", "metrics.jsonl")) as handle:
                runtimes["pipeline"] = train_runtime(handle.read())
            with open(os.path.join(run_dir, "train", "recipe.yaml")) as handle:
                recipe = yaml.safe_load(handle)
            recipe.update(output_dir=os.path.join(root, "bare"), callbacks=None)
            recipe.pop("resume_from_checkpoint", None)
            bare_recipe = os.path.join(root, "bare.yaml")
            with open(bare_recipe, "w") as handle:
                yaml.safe_dump(recipe, handle)
            seconds, output = timed(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc_per_node",
                    "1",
                    "-m",
                    "rloo",
                    "train",
                    "--config",
                    bare_recipe,
                ],
                env,
            )
            bare_times.append(seconds)
            runtimes["bare"] = train_runtime(output)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(
            f"repeat {repeat}: pipeline {pipeline_times[-1]:.1f} s (its job's train_runtime "
            f"{runtimes.get('pipeline')} s), rerun {rerun_times[-1]:.1f} s, bare rloo train {bare_times[-1]:.1f} s "
            f"(train_runtime {runtimes.get('bare')} s)",
            flush=True,
        )
    pipeline, bare, rerun = min(pipeline_times), min(bare_times), min(rerun_times)
    print(
        f"{options.config}: pipeline {pipeline:.1f} s / bare rloo train {bare:.1f} s = {pipeline / bare:.2f}x "
        f"(+{pipeline - bare:.1f} s); rerun of the finished run {rerun:.1f} s = {100 * rerun / pipeline:.1f} % "
        f"of its first run (best of {options.repeats})"
    )


if __name__ == "__main__":
    main()
