"""What the sweep tests share: a sweep config of the tiny recipe, `rloo-pipeline` in its own process,
the study and the trials' run directories as a person would look at them."""

import json
import os
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP = os.path.join(ROOT, "configs", "sweep-tiny.yaml")


def sweep_config(folder, **sweep) -> str:
    """configs/sweep-tiny.yaml with this sweep section (merged) and run root."""
    with open(SWEEP) as handle:
        config = yaml.safe_load(handle)
    config["data"]["source"] = os.path.join(ROOT, "data", "arithmetic.jsonl")
    config["run_root"] = os.path.join(folder, "runs")
    config["sweep"].update(sweep)
    path = os.path.join(folder, "sweep.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump(config, handle)
    return path


def cli(*arguments, env=None, wait=True, prefect_api=None):
    command = [sys.executable, "-m", "flows.cli", *arguments]
    environment = {**os.environ, "RLOO_HUB_PUBLISHER": "", **(env or {})}
    environment.pop("PREFECT_API_URL", None)  # the embedded default, or a server
    if prefect_api:
        environment["PREFECT_API_URL"] = prefect_api
    if not wait:  # its output in a file beside the run root (a pipe nobody reads would fill up)
        log = open(os.path.join(os.path.dirname(arguments[1]) if len(arguments) > 1 and
                                os.path.isfile(arguments[1]) else "/tmp", "sweep.log"), "a")
        return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=900)


def study(run_root, name):
    import optuna
    record = json.load(open(os.path.join(run_root, "sweeps", name, "sweep.json")))
    return optuna.load_study(study_name=name, storage=record["storage"])


def trial_dirs(run_root, name):
    return {int(d.split("-t")[-1].split("-")[0]): os.path.join(run_root, d)
            for d in os.listdir(run_root) if d.startswith(f"{name}-t")}


def checkpoint_steps(run_dir):
    path = os.path.join(run_dir, "train", "checkpoints.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line)["step"] for line in open(path) if line.strip()]


# The searched key sets how long the evaluation's completions may be, so the objective (the mean
# completion length, minimized) tells trials apart on a random tiny model: the trials of 8 tokens
# lose to those of 2 at every checkpoint, and the last one, started when two trials are finished,
# is pruned at its first checkpoint.
PRUNED_SWEEP = dict(
    n_trials=4, parallel=2, objective="completion_length", direction="minimize",
    space={"evaluation.max_completion_length": {"type": "categorical", "choices": [2, 8]}},
    enqueue=[{"evaluation.max_completion_length": n} for n in (2, 8, 2, 8)],
    pruner={"kind": "median", "n_startup_trials": 1})


def wait_for(predicate, timeout=300, what="the condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if found := predicate():
            return found
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")
