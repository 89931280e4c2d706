"""Sweeps end to end, as a person runs them: `rloo-pipeline sweep` in its own process on the embedded
default (an ephemeral Prefect API, a SQLite MLflow store and Optuna study under the run root), real
torchrun training jobs two at a time, a trial pruned while it trains, `compare --sweep` and
`promote --sweep`; a sweep killed (the orchestrator, then one trial's job) and run again."""

import json
import os
import signal

import pytest

from sweeps import PRUNED_SWEEP, checkpoint_steps, cli, study, sweep_config, trial_dirs, wait_for

pytestmark = pytest.mark.slow


def test_a_sweep_runs_in_parallel_prunes_a_loser_and_promotes_the_best(tmp_path):
    path = sweep_config(str(tmp_path), **PRUNED_SWEEP)
    run_root, max_steps = str(tmp_path / "runs"), 30
    done = cli("sweep", path, "--set", f"training.max_steps={max_steps}", "--set",
               "training.save_steps=5")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[sweep] trial 3 started" in done.stderr and "pruned at checkpoint-" in done.stderr

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
    judged = [json.loads(line) for line in open(os.path.join(pruned, "train",
                                                             "trial_scores.jsonl"))]
    assert judged[-1]["prune"] and found.trials[3].intermediate_values == {
        row["step"]: row["value"] for row in judged}

    from infra import tracking
    uri = "sqlite:///" + os.path.join(run_root, "mlflow.db")
    client = tracking.client(uri)
    experiment = client.get_experiment_by_name("rloo").experiment_id
    parent = client.search_runs([experiment], "tags.`rloo.kind` = 'sweep'")
    assert len(parent) == 1
    children = client.search_runs(
        [experiment], f"tags.`mlflow.parentRunId` = '{parent[0].info.run_id}'")
    assert sorted(int(r.data.tags["rloo.trial"]) for r in children) == [0, 1, 2, 3]
    by_trial = {int(r.data.tags["rloo.trial"]): r for r in children}
    assert by_trial[3].data.tags["rloo.trial_state"] == "PRUNED"
    assert by_trial[0].data.metrics["objective"] == pytest.approx(found.trials[0].value)
    assert by_trial[1].data.params["evaluation.max_completion_length"] == "8"
    artifacts = {a.path for a in client.list_artifacts(parent[0].info.run_id, "sweep")}
    assert {"sweep/trials.md", "sweep/importances.json", "sweep/objective.png"} <= artifacts

    compared = cli("compare", "--sweep", "sweep-tiny", "--run-root", run_root)
    assert compared.returncode == 0, compared.stderr
    lines = [line for line in compared.stdout.splitlines() if line.startswith("│")]
    ranks = [line.split("│")[2].strip() for line in lines]
    best = min((t for t in found.trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert ranks[0] == str(best.number) and ranks[-1] == "3"  # by the objective, pruned last
    assert "evaluation.max_completion_length" in compared.stdout  # the key that differs

    promoted = cli("promote", "--sweep", "sweep-tiny", "--run-root", run_root, "--approve",
                   env={"RLOO_HUB_PUBLISHER": f"local:{tmp_path / 'hub'}"})
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    key = best.user_attrs["rloo.run_key"]
    assert f"best trial is {key}" in promoted.stdout
    versions = tracking.find_versions(uri, "rloo-sweep-tiny", {})
    assert [v.tags.get("rloo.run_key") for v in versions] == [key]


def first_started(metrics_path):
    """Steps the job logged, in order: a run trained from scratch twice logs step 1 twice."""
    if not os.path.exists(metrics_path):
        return []
    return [json.loads(line).get("step") for line in open(metrics_path) if '"step"' in line]


def test_a_killed_sweep_continues_where_it_stopped(tmp_path):
    path = sweep_config(str(tmp_path), n_trials=3, parallel=2, pruner={"kind": "none"})
    run_root, name = str(tmp_path / "runs"), "sweep-tiny"
    settings = ["--set", "training.max_steps=24", "--set", "training.save_steps=4"]
    # 1. the orchestrator killed while two trials train (their jobs train on, orphaned)
    first = cli("sweep", path, *settings, wait=False)
    wait_for(lambda: len([d for d in trial_dirs(run_root, name).values()
                          if checkpoint_steps(d)]) >= 1 if os.path.isdir(run_root) else None,
             what="a trial's first checkpoint")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    # 2. run again: trials 0 and 1 resume; trial 2, new, has its job killed after a checkpoint:
    # that trial fails, the others finish
    second = cli("sweep", path, *settings, wait=False)

    def trial_2_training():
        run_dir = trial_dirs(run_root, name).get(2)
        job = run_dir and os.path.join(run_dir, "train", "job.json")
        if job and os.path.exists(job) and checkpoint_steps(run_dir):
            return json.load(open(job))
        return None
    record = wait_for(trial_2_training, what="trial 2 training after a checkpoint")
    from infra.launch import JobHandle, cancel
    cancel(JobHandle.from_dict(record["handle"]))
    assert second.wait(timeout=900) == 1  # some trial did not finish: rerun to resume it
    # 3. the same command again finishes the sweep
    third = cli("sweep", path, *settings)
    assert third.returncode == 0, third.stdout + third.stderr
    found = study(run_root, name)
    assert [t.state.name for t in found.trials] == ["COMPLETE"] * 3  # none lost, none twice
    dirs = trial_dirs(run_root, name)
    assert sorted(dirs) == [0, 1, 2]
    for run_dir in dirs.values():  # every trial trained once from step 1, resumed after kills
        steps = first_started(os.path.join(run_dir, "train", "metrics.jsonl"))
        assert steps.count(1) == 1 and max(steps) == 24, (run_dir, steps)
    resumed = json.load(open(os.path.join(dirs[2], "train", "job.json")))
    assert resumed["resumed_from"]  # the killed job's trial went on from its checkpoint


def test_bad_sweeps_are_refused_before_any_trial(tmp_path):
    from infra.runconfig import ConfigError, load_run_config
    from infra.sweep import check_sweep

    def refused(*assignments, space=None):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        path = sweep_config(str(folder), **({"space": space} if space else {}))
        with pytest.raises(ConfigError) as err:
            check_sweep(load_run_config(path, list(assignments)))
        return str(err.value)

    message = refused(space={"training.learning_rat": {"type": "log_uniform", "low": 1e-3,
                                                       "high": 1e-2}})
    assert "sweep.space.training.learning_rat" in message and "learning_rate" in message
    assert "empty or inverted range" in refused(
        space={"training.beta": {"type": "uniform", "low": 0.1, "high": 0.0}})
    assert "empty or inverted range" in refused(
        space={"training.max_steps": {"type": "int", "low": 4, "high": 4}})
    message = refused(space={"training.lora_r": {"type": "categorical",
                                                 "choices": ["four", "eight"]}})
    assert "sweep.space.training.lora_r" in message and "'four'" in message
    assert "mix types" in refused(
        space={"training.lora_r": {"type": "categorical", "choices": [4, "eight"]}})
    assert "not part of a run's result" in refused(
        space={"tracking.experiment": {"type": "categorical", "choices": ["a", "b"]}})
    assert "parallel=5 is more than n_trials=4" in refused("sweep.parallel=5")
    message = refused("sweep.objective=accuracy/nothing_reward")
    assert "accuracy/numeric_accuracy_reward" in message and "never" in message
    assert "extra_sets" in refused("sweep.objective_set=phrased")
    assert "PGPASSWORD" in refused("sweep.storage=postgresql://me:secret@127.0.0.1:5432/rloo")
    assert "save_strategy" in refused("training.save_strategy=no")
