"""Sweeps end to end, as a person runs them: `rloo-pipeline sweep` in its own process on the embedded
default (an ephemeral Prefect API, a SQLite MLflow store and Optuna study under the run root), real
torchrun training jobs two at a time, a sweep killed (the orchestrator, then one trial's job) and run
again. The pruned sweep with `compare --sweep` and `promote --sweep` runs on a team's PostgreSQL
(tests/test_team_database.py); a sweep started from the Prefect UI's form in tests/test_deployments.py."""

import json
import os
import signal

import pytest

from sweeps import checkpoint_steps, cli, study, sweep_config, trial_dirs, wait_for

pytestmark = pytest.mark.slow


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
    wait_for(
        lambda: (
            len([d for d in trial_dirs(run_root, name).values() if checkpoint_steps(d)]) >= 1
            if os.path.isdir(run_root)
            else None
        ),
        what="a trial's first checkpoint",
    )
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

    message = refused(
        space={"training.learning_rat": {"type": "log_uniform", "low": 1e-3, "high": 1e-2}}
    )
    assert "sweep.space.training.learning_rat" in message and "learning_rate" in message
    assert "empty or inverted range" in refused(
        space={"training.beta": {"type": "uniform", "low": 0.1, "high": 0.0}}
    )
    assert "empty or inverted range" in refused(
        space={"training.max_steps": {"type": "int", "low": 4, "high": 4}}
    )
    message = refused(
        space={"training.lora_r": {"type": "categorical", "choices": ["four", "eight"]}}
    )
    assert "sweep.space.training.lora_r" in message and "'four'" in message
    assert "mix types" in refused(
        space={"training.lora_r": {"type": "categorical", "choices": [4, "eight"]}}
    )
    assert "not part of a run's result" in refused(
        space={"tracking.experiment": {"type": "categorical", "choices": ["a", "b"]}}
    )
    assert "parallel=5 is more than n_trials=4" in refused("sweep.parallel=5")
    message = refused("sweep.objective=accuracy/nothing_reward")
    assert "accuracy/numeric_accuracy_reward" in message and "never" in message
    assert "extra_sets" in refused("sweep.objective_set=phrased")
    assert "PGPASSWORD" in refused("sweep.storage=postgresql://me:secret@127.0.0.1:5432/rloo")
    assert "save_strategy" in refused("training.save_strategy=no")


def test_trials_at_once_share_the_cores_instead_of_each_taking_them_all(tmp_path, monkeypatch):
    from infra.runconfig import load_run_config
    from infra.stages import thread_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    path = sweep_config(str(tmp_path), parallel=2)
    trial = ["trial={sweep: s, number: 0, storage: 'sqlite:///x.db', objective: reward}"]
    assert thread_environment(load_run_config(path, trial)) == {"OMP_NUM_THREADS": "4"}
    assert thread_environment(load_run_config(path, [*trial, "launch.nproc_per_node=4"])) == {
        "OMP_NUM_THREADS": "1"
    }
    assert thread_environment(load_run_config(path)) == {}  # one process: torch's own default
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice
    assert thread_environment(load_run_config(path, trial)) == {}
