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
        log = open(
            os.path.join(
                os.path.dirname(arguments[1])
                if len(arguments) > 1 and os.path.isfile(arguments[1])
                else "/tmp",
                "sweep.log",
            ),
            "a",
        )
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return subprocess.run(
        command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=900
    )


def study(run_root, name):
    import optuna

    record = json.load(open(os.path.join(run_root, "sweeps", name, "sweep.json")))
    return optuna.load_study(study_name=name, storage=record["storage"])


def trial_dirs(run_root, name):
    return {
        int(d.split("-t")[-1].split("-")[0]): os.path.join(run_root, d)
        for d in os.listdir(run_root)
        if d.startswith(f"{name}-t")
    }


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
    n_trials=4,
    parallel=2,
    objective="completion_length",
    direction="minimize",
    space={"evaluation.max_completion_length": {"type": "categorical", "choices": [2, 8]}},
    enqueue=[{"evaluation.max_completion_length": n} for n in (2, 8, 2, 8)],
    pruner={"kind": "median", "n_startup_trials": 1},
)


def wait_for(predicate, timeout=300, what="the condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if found := predicate():
            return found
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def check_pruned_sweep(folder, uri, max_steps, prefect_api=None):
    """What a finished PRUNED_SWEEP shows: the study's states, a run directory per trial, the pruned trial's job
    stopped early and not evaluated, the MLflow parent run with a child per trial, `compare --sweep` ranking by the
    objective, `promote --sweep` registering the best trial's best checkpoint."""
    run_root = os.path.join(folder, "runs")
    found = study(run_root, "sweep-tiny")
    states = {t.number: t.state.name for t in found.trials}
    assert states == {0: "COMPLETE", 1: "COMPLETE", 2: "COMPLETE", 3: "PRUNED"}, states
    dirs = trial_dirs(run_root, "sweep-tiny")
    assert len(set(dirs.values())) == 4  # one run directory per trial
    pruned = dirs[3]
    steps = checkpoint_steps(pruned)
    assert steps and max(steps) < max_steps  # its job really stopped early
    assert not os.path.exists(os.path.join(pruned, "train", "output", "adapter_model.safetensors"))
    assert not os.path.exists(os.path.join(pruned, "eval"))  # and was not evaluated
    judged = [
        json.loads(line) for line in open(os.path.join(pruned, "train", "trial_scores.jsonl"))
    ]
    assert judged[-1]["prune"] and found.trials[3].intermediate_values == {
        row["step"]: row["value"] for row in judged
    }

    from infra import tracking

    client = tracking.client(uri)
    experiment = client.get_experiment_by_name("rloo").experiment_id
    parent = client.search_runs([experiment], "tags.`rloo.kind` = 'sweep'")
    assert len(parent) == 1
    children = client.search_runs(
        [experiment], f"tags.`mlflow.parentRunId` = '{parent[0].info.run_id}'"
    )
    assert sorted(int(r.data.tags["rloo.trial"]) for r in children) == [0, 1, 2, 3]
    by_trial = {int(r.data.tags["rloo.trial"]): r for r in children}
    assert by_trial[3].data.tags["rloo.trial_state"] == "PRUNED"
    assert by_trial[0].data.metrics["objective"] == found.trials[0].value
    assert by_trial[1].data.params["evaluation.max_completion_length"] == "8"
    artifacts = {a.path for a in client.list_artifacts(parent[0].info.run_id, "sweep")}
    assert {"sweep/trials.md", "sweep/importances.json", "sweep/objective.png"} <= artifacts

    compared = cli(
        "compare", "--sweep", "sweep-tiny", "--run-root", run_root, prefect_api=prefect_api
    )
    assert compared.returncode == 0, compared.stderr
    lines = [line for line in compared.stdout.splitlines() if line.startswith("│")]
    ranks = [line.split("│")[2].strip() for line in lines]
    best = min((t for t in found.trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert ranks[0] == str(best.number) and ranks[-1] == "3"  # by the objective, pruned last
    assert "evaluation.max_completion_length" in compared.stdout  # the key that differs

    promoted = cli(
        "promote",
        "--sweep",
        "sweep-tiny",
        "--run-root",
        run_root,
        "--approve",
        env={"RLOO_HUB_PUBLISHER": f"local:{os.path.join(folder, 'hub')}"},
        prefect_api=prefect_api,
    )
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    key = best.user_attrs["rloo.run_key"]
    assert f"best trial is {key}" in promoted.stdout
    versions = tracking.find_versions(uri, "rloo-sweep-tiny", {})
    assert [v.tags.get("rloo.run_key") for v in versions] == [key]
