"""What pruning saves: wall time of `rloo-pipeline sweep` with the median pruner against the same sweep with
`sweep.pruner.kind=none`, each from a new run root, in the same session, plus the optimizer steps every trial
trained. The sweep is built so that pruning has something to find, whatever the model learns: its searched key is
the evaluation's completion length (2 or 8 tokens) and the objective the mean held-out completion length
(minimized), with the points enqueued 2, 8, 2, 8, ... so that each trial of 8 that starts after finished ones loses
at its first checkpoint.

    .venv/bin/python benchmarks/sweep_pruning.py [--trials 6] [--max-steps 40] [--save-steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import yaml

from pipeline_overhead import ROOT, timed


def sweep_config(folder: str, trials: int, pruner: str) -> str:
    with open(os.path.join(ROOT, "configs", "sweep-tiny.yaml")) as handle:
        config = yaml.safe_load(handle)
    config["data"]["source"] = os.path.join(ROOT, "data", "arithmetic.jsonl")
    config["run_root"] = folder
    key = "evaluation.max_completion_length"
    config["sweep"].update(
        n_trials=trials,
        parallel=2,
        objective="completion_length",
        direction="minimize",
        space={key: {"type": "categorical", "choices": [2, 8]}},
        enqueue=[{key: 2 if index % 2 == 0 else 8} for index in range(trials)],
        pruner={"kind": pruner, "n_startup_trials": 1},
    )
    path = os.path.join(folder, "sweep.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump(config, handle)
    return path


def steps_trained(folder: str) -> list[int]:
    """Per trial (by number), the highest optimizer step its job logged."""
    found = {}
    for name in os.listdir(folder):
        metrics = os.path.join(folder, name, "train", "metrics.jsonl")
        if "-t" in name and os.path.exists(metrics):
            with open(metrics) as handle:
                steps = [json.loads(line).get("step", 0) for line in handle if line.strip()]
            found[int(name.split("-t")[-1].split("-")[0])] = max(steps, default=0)
    return [found[number] for number in sorted(found)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=5)
    options = parser.parse_args()
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    results = {}
    for pruner in ("median", "none"):
        folder = tempfile.mkdtemp(prefix=f"rloo-sweep-{pruner}-")
        try:
            seconds, _ = timed(
                [
                    sys.executable,
                    "-m",
                    "flows.cli",
                    "sweep",
                    sweep_config(folder, options.trials, pruner),
                    "--set",
                    f"training.max_steps={options.max_steps}",
                    "--set",
                    f"training.save_steps={options.save_steps}",
                ],
                env,
            )
            results[pruner] = {"wall": seconds, "steps": steps_trained(folder)}
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(
            f"pruner {pruner}: {results[pruner]['wall']:.1f} s, optimizer steps per trial {results[pruner]['steps']}",
            flush=True,
        )
    pruned, full = results["median"], results["none"]
    print(
        f"{options.trials} trials x {options.max_steps} steps, 2 at once: pruned sweep {pruned['wall']:.1f} s vs "
        f"{full['wall']:.1f} s without pruning = {pruned['wall'] / full['wall']:.2f}x the wall time; "
        f"{sum(pruned['steps'])} vs {sum(full['steps'])} optimizer steps trained"
    )


if __name__ == "__main__":
    main()
