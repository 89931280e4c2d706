"""What scoring every checkpoint on the held-out sets costs: wall time of `rloo-pipeline run` with the default
`evaluation.checkpoint_interval` (every saved checkpoint scored, then the final model) against the same run with
`evaluation.checkpoint_interval=0` (the final model only), each from a new run root, in the same session; plus each
run's evaluate stage and its job's train_runtime (the same recipe's two train_runtimes should match: machine drift
shows there).

    .venv/bin/python benchmarks/checkpoint_evaluation.py [--config configs/quickstart.yaml]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile

from pipeline_overhead import ROOT, timed, train_runtime


def stage_seconds(run_dir: str) -> dict[str, float]:
    """Seconds from each stage's start to the next one's (the evaluate stage: to its result file)."""
    with open(os.path.join(run_dir, "stages", "executions.log")) as handle:
        starts = [
            (line.split()[1], datetime.datetime.fromisoformat(line.split()[0])) for line in handle
        ]
    end = datetime.datetime.fromtimestamp(
        os.path.getmtime(os.path.join(run_dir, "stages", "evaluate.json"))
    )
    ends = [start for _, start in starts[1:]] + [end]
    return {stage: (stop - start).total_seconds() for (stage, start), stop in zip(starts, ends)}


def run(config: str, extra: list[str], env: dict) -> dict:
    root = tempfile.mkdtemp(prefix="rloo-checkpoint-eval-")
    try:
        seconds, _ = timed(
            [sys.executable, "-m", "flows.cli", "run", config, "--set", f"run_root={root}", *extra],
            env,
        )
        run_dir = next(
            os.path.join(root, d)
            for d in os.listdir(root)
            if os.path.exists(os.path.join(root, d, "config.json"))
        )
        with open(os.path.join(run_dir, "train", "metrics.jsonl")) as handle:
            runtime = train_runtime(handle.read())
        return {"wall": seconds, "stages": stage_seconds(run_dir), "train_runtime": runtime}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/quickstart.yaml")
    options = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    off = run(options.config, ["--set", "evaluation.checkpoint_interval=0"], env)
    on = run(options.config, [], env)
    for label, found in (("final model only", off), ("every checkpoint", on)):
        print(
            f"{label}: {found['wall']:.1f} s (evaluate stage {found['stages']['evaluate']:.1f} s, job "
            f"train_runtime {found['train_runtime']} s)"
        )
    print(
        f"{options.config}: every checkpoint scored / final model only = {on['wall'] / off['wall']:.3f}x "
        f"({on['wall'] - off['wall']:+.1f} s, {100 * (on['wall'] / off['wall'] - 1):+.1f} %); evaluate stage "
        f"{off['stages']['evaluate']:.1f} -> {on['stages']['evaluate']:.1f} s "
        f"({100 * (on['stages']['evaluate'] - off['stages']['evaluate']) / off['wall']:+.1f} % of the first run)"
    )


if __name__ == "__main__":
    main()
