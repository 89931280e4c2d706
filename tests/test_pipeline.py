"""The pipeline end to end against real services: a Prefect API (prefect_test_harness starts a real server
process), an MLflow tracking server on 127.0.0.1 (SQLite), submitit's local executor running real torchrun."""

import asyncio
import json
import os
import time

import pytest

from helpers import TIMING_KEYS, assert_step_timing
from infra import job_tracking, stages, tracking
from infra.launch import JobHandle, TrainingFailed, cancel, job_state
from infra.runconfig import load_run_config
from rloo.checkpoint import latest_checkpoint
from services import MlflowServer

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
SECRET = "hf_pipelineSECRET0987654321"


@pytest.fixture(scope="module")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("runs"))


def overrides(run_root, mlflow_server, *extra):
    return [
        f"run_root={run_root}",
        f"tracking.tracking_uri={mlflow_server.uri}",
        f"data.source={ROOT}/data/arithmetic.jsonl",
        *extra,
    ]


def run_flow(recipe, assignments):
    from flows.pipeline import rloo_pipeline

    return asyncio.run(rloo_pipeline(recipe, overrides=assignments, return_state=True))


async def _task_states(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async with get_client() as client:
        runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}


def task_states(state):
    """The flow run's task states by stage, once none reads Running: Prefect records a task's final
    state through its events, which may land a moment after the flow has returned."""
    deadline = time.monotonic() + 30
    while True:
        found = asyncio.run(_task_states(state.state_details.flow_run_id))
        if "Running" not in found.values() or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_end_to_end_two_processes(prefect_api, mlflow_server, run_root):
    assignments = overrides(
        run_root,
        mlflow_server,
        "launch.nproc_per_node=2",
        f"training.hub_token={SECRET}",
        "training.log_completions=true",
    )
    state = run_flow(TINY, assignments)
    assert state.is_completed(), state
    summary = state.result()
    config = load_run_config(TINY, assignments)
    evaluation = summary["evaluate"]
    assert (
        evaluation["num_prompts"] == 8
        and "reward" in evaluation["base"]
        and "reward" in evaluation["trained"]
    )
    report = open(evaluation["report_path"]).read()
    assert "| metric | base | trained | change |" in report and "reward_curve.png" in report
    assert "step_timing.png" in report  # the stacked bar per step of the timing/* sections
    assert os.path.exists(evaluation["plot_path"]) and os.path.exists(
        evaluation["timing_plot_path"]
    )
    assert task_states(state) == {
        "dataset": "Completed",
        "model": "Completed",
        "train": "Completed",
        "evaluate": "Completed",
    }

    client = tracking.client(mlflow_server.uri)
    experiment = client.get_experiment_by_name("rloo")
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`rloo.run_key` = '{config.run_key}'"
    )
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["rloo.stage"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert len(parent) == 1 and set(children) == {
        "dataset",
        "model",
        "train",
        "evaluate",
    }  # no run per rank
    assert all(
        r.data.tags["mlflow.parentRunId"] == parent[0].info.run_id for r in children.values()
    )
    assert parent[0].data.tags["prefect.flow_run_id"] == str(state.state_details.flow_run_id)
    assert parent[0].data.params["training.learning_rate"] == "0.001"
    train = children["train"]
    history = client.get_metric_history(train.info.run_id, "reward")
    assert [m.step for m in history] == [1, 2, 3]  # global rank 0 only: one value per step
    timing = {
        key: {m.step: m.value for m in client.get_metric_history(train.info.run_id, key)}
        for key in [*TIMING_KEYS, "step_time"]
    }
    assert_step_timing([{key: timing[key][step] for key in timing} for step in (1, 2, 3)])
    assert "completions" in {a.path for a in client.list_artifacts(train.info.run_id)}
    # MLflow's UI opens the experiment in its model-training view, not the GenAI one
    assert experiment.tags["mlflow.experimentKind"] == "finetuning"
    # the data each run read, where MLflow shows it: equal data, equal digest, in every run
    inputs = {
        stage: {
            (d.dataset.name, d.dataset.digest, d.tags[0].value, json.loads(d.dataset.source)["uri"])
            for d in client.get_run(children[stage].info.run_id).inputs.dataset_inputs
        }
        for stage in ("dataset", "train", "evaluate")
    }
    source = f"file://{ROOT}/data/arithmetic.jsonl"
    assert {(name, context, uri) for name, _, context, uri in inputs["train"]} == {
        ("tiny-train", "training", source),
        ("tiny-eval", "evaluation", source),
    }
    assert inputs["train"] == inputs["evaluate"] == inputs["dataset"]
    assert (
        len({digest for _, digest, _, _ in inputs["train"]}) == 2
    )  # each split its own content digest
    # every saved checkpoint and the final model a LoggedModel of the train run, with its held-out metrics
    held_out = next(
        (name, digest) for name, digest, context, _ in inputs["train"] if context == "evaluation"
    )
    models = client.search_logged_models(
        [experiment.experiment_id], filter_string=f"tags.`rloo.run_key` = '{config.run_key}'"
    )
    assert sorted((m.name, m.tags["rloo.step"]) for m in models) == [
        ("checkpoint-2", "2"),
        ("checkpoint-3", "3"),
        ("final", "3"),
    ]
    for model in models:
        assert model.source_run_id == train.info.run_id and str(model.status) == "READY"
        assert model.tags["rloo.weights"] == "adapter" and model.tags["rloo.stored"] == "logged"
        assert model.params["learning_rate"] == "0.001"
        linked = {(m.key, m.dataset_name, m.dataset_digest): m.value for m in model.metrics}
        assert set(linked) >= {("reward", *held_out), ("completion_length", *held_out)}
    # system metrics beside the loss curve
    assert any(
        key.startswith("system/cpu_utilization")
        for key in client.get_run(train.info.run_id).data.metrics
    )
    assert children["evaluate"].data.metrics["trained_reward"] == pytest.approx(
        evaluation["trained"]["reward"]
    )
    shown = {a.path for a in client.list_artifacts(children["evaluate"].info.run_id, "evaluation")}
    assert {
        "evaluation/report.md",
        "evaluation/reward_curve.png",
        "evaluation/step_timing.png",
    } <= shown
    for run in [*parent, *children.values()]:  # the token is in the config, and nowhere in MLflow
        assert SECRET not in json.dumps(client.get_run(run.info.run_id).data.to_dictionary())
    assert not [p for p in parent[0].data.params if "token" in p]

    from prefect.artifacts import Artifact

    link = Artifact.get("tiny-mlflow-run")
    assert link is not None and parent[0].info.run_id in link.data


def test_the_mlflow_ui_opens_the_training_view_and_ranks_the_checkpoints(
    mlflow_server, run_root, tmp_path
):
    """What a person sees in MLflow (headless Chromium): the pipeline's run link opens the model-training view (runs
    and models, not the GenAI view of traces), and the experiment's Models tab lists the end-to-end run's checkpoints
    and final model with their held-out metrics on the held-out dataset. Screenshots go to docs/img/."""
    import re

    from services import chromium

    images = os.path.join(ROOT, "docs", "img")
    config = load_run_config(
        TINY,
        overrides(
            run_root,
            mlflow_server,
            "launch.nproc_per_node=2",
            f"training.hub_token={SECRET}",
            "training.log_completions=true",
        ),
    )
    summary = json.load(
        open(stages.stage_path(config, "summary.json"))
    )  # the end-to-end test's run

    def text(url, profile, size="1400,1100"):
        page = chromium("--dump-dom", url, profile=tmp_path / profile, size=size).stdout
        return re.sub(
            r"\s+",
            " ",
            re.sub(r"<[^>]+>", " ", re.sub(r"<style.*?</style>", " ", page, flags=re.S)),
        )

    run_page = text(summary["mlflow_link"], "run")
    assert "Model training" in run_page and "Models" in run_page and config.run_key in run_page
    assert "Traces 0" not in run_page and "No data available" not in run_page  # the GenAI overview
    experiment = tracking.experiment_id(mlflow_server.uri, "rloo")
    models = tracking.models_link(mlflow_server.uri, experiment)
    page = text(
        models, "models", size="2600,1100"
    )  # wide: the metric columns are drawn when in view
    held_out = stages.load_stage_result(config, "dataset")["eval_digest"]
    shown = page[page.find("Table view") :][:3000]
    assert f"Dataset: tiny-eval (#{held_out})" in page and " reward " in page, shown
    for name in ("checkpoint-2", "checkpoint-3", "final"):
        assert f" {name} Ready " in page, page[:3000]
    os.makedirs(images, exist_ok=True)
    chromium(
        f"--screenshot={images}/mlflow-run.png", summary["mlflow_link"], profile=tmp_path / "shot1"
    )
    chromium(
        f"--screenshot={images}/mlflow-models.png",
        models,
        profile=tmp_path / "shot2",
        size="2600,600",
    )
    assert (
        os.path.getsize(f"{images}/mlflow-run.png") > 20_000
        and os.path.getsize(f"{images}/mlflow-models.png") > 20_000
    )


def test_rerun_skips_finished_stages_and_retry_reruns_only_what_failed(
    prefect_api, mlflow_server, run_root, tmp_path, monkeypatch
):
    lookup = tmp_path / "lookup.txt"
    monkeypatch.setenv("RLOO_TEST_LOOKUP_FILE", str(lookup))
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])
    )
    assignments = overrides(
        run_root,
        mlflow_server,
        "training.reward_funcs=[pipeline_rewards:lookup_reward]",
        "training.reward_weights=null",
    )
    config = load_run_config(TINY, assignments)

    failed = run_flow(TINY, assignments)  # evaluation needs the lookup file, which is missing
    assert failed.is_failed()
    assert task_states(failed)["evaluate"] == "Failed"
    assert stages.executions(config) == ["dataset", "model", "train", "evaluate"]

    lookup.write_text("0.5")  # fix the cause, run again with the same config
    retried = run_flow(TINY, assignments)
    assert retried.is_completed(), retried
    assert task_states(retried) == {
        "dataset": "Cached",
        "model": "Cached",
        "train": "Cached",
        "evaluate": "Completed",
    }
    assert stages.executions(config) == ["dataset", "model", "train", "evaluate", "evaluate"]
    assert retried.result()["evaluate"]["base"]["reward"] >= 0.5

    from flows.cli import main

    assert main(["status", "--run-root", run_root]) == 0
    assert main(["compare", "--run-root", run_root]) == 0  # both runs of this module, from MLflow


def test_a_stalled_training_job_is_reported_as_stalled_with_where_it_waited(run_root, monkeypatch):
    """A reward call that takes longer than training.stall_timeout_s: the job's watchdog fails the step, and the
    train stage reports a stalled job naming the section and the stack report, not a failure without a cause."""
    from infra.jobs import TrainingStalled

    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__))
    monkeypatch.setenv("RLOO_TEST_REWARD_SLEEP", "30")
    returned = os.path.join(run_root, "reward-returned")
    monkeypatch.setenv("RLOO_TEST_REWARD_RETURNED", returned)
    config = load_run_config(
        TINY,
        [
            f"run_root={run_root}",
            f"data.source={ROOT}/data/arithmetic.jsonl",
            "training.reward_funcs=[pipeline_rewards:slow_length_reward]",
            "training.reward_weights=null",
            "training.stall_timeout_s=2",
            "name=stalled",
        ],
    )
    dataset = stages.prepare_dataset(config)
    model = stages.prepare_model(config, dataset)
    record = stages.start_or_reattach_training(config, dataset, model, None)
    with pytest.raises(
        TrainingStalled,
        match=r"stalled: training stalled: rank 0 made no progress for 2 s "
        r"\(stall_timeout_s\) in step 1, waiting in train > rewards.*\(report: .*stall-report-.*-rank0.txt\)",
    ):
        asyncio.run(stages.follow_training(config, record))
    # the job has ended (a stall is reported once it failed), and the 30 s reward call never returned:
    # the watchdog failed the step instead of waiting for it
    assert not os.path.exists(returned)


def test_reattach_then_resume_after_the_job_is_killed(run_root, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__))
    monkeypatch.setenv("RLOO_TEST_REWARD_SLEEP", "0.7")
    config = load_run_config(
        TINY,
        [
            f"run_root={run_root}",
            f"data.source={ROOT}/data/arithmetic.jsonl",
            "training.reward_funcs=[pipeline_rewards:slow_length_reward]",
            "training.reward_weights=null",
            "training.max_steps=6",
            "training.save_steps=2",
            "name=killed",
        ],
    )
    dataset = stages.prepare_dataset(config)
    model = stages.prepare_model(config, dataset)
    first = stages.start_or_reattach_training(config, dataset, model, None)
    again = stages.start_or_reattach_training(config, dataset, model, None)  # e.g. the task retried
    assert again["reattached"] and again["handle"]["job_id"] == first["handle"]["job_id"]
    handle = JobHandle.from_dict(first["handle"])
    output = stages.stage_path(config, "train", "output")
    deadline = time.time() + 240
    while latest_checkpoint(output) is None:
        assert time.time() < deadline and job_state(handle)[0] == "RUNNING", open(
            handle.log_path
        ).read()[-3000:]
        time.sleep(0.5)
    cancel(handle)  # the training processes die (node failure, OOM kill, ...)
    with pytest.raises(TrainingFailed, match="lost|failed"):
        asyncio.run(stages.follow_training(config, first))
    checkpoint = latest_checkpoint(output)
    resumed = stages.start_or_reattach_training(config, dataset, model, None)
    assert (
        resumed["resumed_from"] == checkpoint
        and resumed["attempt"] == 2
        and not resumed["reattached"]
    )
    result = asyncio.run(stages.follow_training(config, resumed))
    assert result["global_step"] == 6
    steps = [
        json.loads(line)["step"] for line in open(result["metrics_path"]) if '"reward"' in line
    ]
    assert steps[-1] == 6 and int(checkpoint.rsplit("-", 1)[1]) + 1 in steps
    # finished while nobody followed it (the orchestrator lost): reattached, not trained again
    finished = stages.start_or_reattach_training(config, dataset, model, None)
    assert finished["reattached"] and finished["handle"]["job_id"] == resumed["handle"]["job_id"]


def test_progress_follows_the_attempt_that_trains_not_an_earlier_ones_last_step(tmp_path):
    """A job killed at step 6 before its first checkpoint and run again trains from the start: its
    metrics file holds both attempts. The progress is the running attempt's, and its ETA is paced
    from that attempt's own steps, not from the killed attempt's last line."""
    from tasks.common import Pace

    config = load_run_config(TINY, [f"run_root={tmp_path}", "training.max_steps=60"])
    os.makedirs(stages.train_dir(config))

    def log(*records):
        with open(os.path.join(stages.train_dir(config), "metrics.jsonl"), "a") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in records)

    log(*({"step": step, "reward": 0.5, "time": step} for step in range(1, 7)))
    assert stages.training_progress(config)[:3] == (6, 60, 0.5)
    pace = Pace()
    assert not pace.update(6, now=100.0)  # read when following began: the killed attempt's
    log(
        {"step": 1, "time": 130}
    )  # a step that logged no reward: none of the killed attempt's shows
    assert stages.training_progress(config)[:3] == (1, 60, None)
    assert pace.update(1, now=130.0)  # a new attempt
    assert pace.eta(1, 60, now=130.0) is None
    log({"step": 2, "reward": 0.2, "time": 135})
    assert stages.training_progress(config)[:3] == (2, 60, 0.2)
    assert not pace.update(2, now=135.0) and not pace.update(4, now=145.0)
    assert pace.eta(4, 60, now=145.0) == pytest.approx(
        5.0 * 56
    )  # 5 s a step since step 2, 56 to go


def test_progress_shows_every_optimizer_step_of_a_recipe_that_logs_every_tenth(
    tmp_path, monkeypatch
):
    """The job rewrites its step at every optimizer step: the console, the progress artifact and the stalled-run
    watch see steps 1, 2, 3 of a recipe with logging_steps=10 (its metrics file has none yet), and a new attempt
    at its start."""
    from transformers import TrainerState

    from infra.job_tracking import RunDirTrackingCallback

    config = load_run_config(
        TINY, [f"run_root={tmp_path}", "training.max_steps=60", "training.logging_steps=10"]
    )
    os.makedirs(stages.train_dir(config))
    monkeypatch.setenv("RLOO_TRAIN_DIR", stages.train_dir(config))
    callback, state = RunDirTrackingCallback(), TrainerState()
    callback.on_train_begin(None, state, None)
    assert stages.training_progress(config)[:3] == (0, 60, None)
    for step in (1, 2, 3):
        state.global_step = step
        callback.on_step_end(None, state, None)
        assert stages.training_progress(config)[:3] == (step, 60, None)
    state.global_step = 10
    callback.on_step_end(None, state, None)
    callback.on_log(None, state, None, logs={"reward": 0.5})
    assert stages.training_progress(config)[:3] == (10, 60, 0.5)
    state.global_step = 5  # resumed from checkpoint 5
    callback.on_train_begin(None, state, None)
    assert stages.training_progress(config)[:3] == (5, 60, None)


def test_mlflow_unreachable_at_start_fails_before_any_stage(run_root, capsys):
    from flows.cli import main
    from services import free_port

    assignments = [
        "--set",
        f"run_root={run_root}",
        "--set",
        f"tracking.tracking_uri=http://127.0.0.1:{free_port()}",
        "--set",
        "name=nomlflow",
    ]
    assert main(["run", TINY, *assignments]) == 2
    assert "MLflow at http://127.0.0.1" in capsys.readouterr().err
    config = load_run_config(TINY, [a for a in assignments if a != "--set"])
    assert stages.executions(config) == []


def test_the_training_step_does_not_wait_for_mlflow(tmp_path, monkeypatch):
    """on_log queues and returns while the upload is still in flight (here: held until on_log has returned), and
    the sender delivers it after, in order with the items queued meanwhile."""
    import threading

    from transformers import TrainerControl, TrainerState, TrainingArguments

    for key, value in job_tracking.tracking_environment(
        "http://127.0.0.1:1", "run", str(tmp_path)
    ).items():
        monkeypatch.setenv(key, value)
    returned, events, uploaded = threading.Event(), [], []

    def held_upload(item, tracking_uri, run_id):
        events.append(("upload starts", item["step"]))
        assert returned.wait(
            timeout=60
        )  # a synchronous send would wait here for a minute, then fail the test
        uploaded.append(item["step"])
        return True

    monkeypatch.setattr(job_tracking, "_upload", held_upload)
    callback, state = job_tracking.RunDirTrackingCallback(), TrainerState()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none")
    for step in (1, 2):
        state.global_step = step
        callback.on_log(args, state, TrainerControl(), logs={"reward": 0.1 * step})
    events.append(
        ("on_log returned", 2)
    )  # (synchronously, the held upload would have failed the test first)
    returned.set()
    assert callback.wait_sent(timeout=60)
    assert events.count(("upload starts", 1)) == 1 and ("upload starts", 2) in events
    assert (
        uploaded == [1, 2] and job_tracking.pending_count(str(tmp_path)) == 0
    )  # in order, none left queued


def test_mlflow_outage_mid_run_loses_nothing(tmp_path, monkeypatch):
    server = MlflowServer(str(tmp_path / "mlflow")).start()
    run_id = tracking.start_run(server.uri, "outage", "train", {})
    train_dir = str(tmp_path / "train")
    for key, value in job_tracking.tracking_environment(server.uri, run_id, train_dir).items():
        monkeypatch.setenv(key, value)
    from transformers import TrainerControl, TrainerState, TrainingArguments

    callback = job_tracking.RunDirTrackingCallback()
    state = TrainerState()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none")
    state.global_step = 1
    callback.on_log(args, state, TrainerControl(), logs={"reward": 0.1, "loss": 0.0})
    assert callback.wait_sent(timeout=60)
    server.stop()  # the tracking server goes away mid-run
    for step in (2, 3):
        state.global_step = step
        callback.on_log(args, state, TrainerControl(), logs={"reward": 0.1 * step, "loss": 0.0})
    callback.on_completions(
        args, state, TrainerControl(), rows=[{"step": 3, "prompt": "p", "completion": "c"}]
    )
    assert callback.wait_sent(timeout=60)  # tried, refused: queued
    assert job_tracking.pending_count(train_dir) == 3
    lines = [json.loads(line) for line in open(os.path.join(train_dir, "metrics.jsonl"))]
    assert [line["step"] for line in lines] == [1, 2, 3]  # kept in the run directory all along
    server.start()  # back, same store
    assert job_tracking.flush_pending(train_dir, server.uri, run_id)
    history = tracking.client(server.uri).get_metric_history(run_id, "reward")
    assert [(m.step, round(m.value, 3)) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert job_tracking.pending_count(train_dir) == 0
    server.stop()


def test_resume_command_reuses_every_finished_stage(prefect_api, mlflow_server, run_root):
    from flows.cli import main

    config = load_run_config(
        TINY,
        overrides(
            run_root,
            mlflow_server,
            "launch.nproc_per_node=2",
            f"training.hub_token={SECRET}",
            "training.log_completions=true",
        ),
    )
    before = stages.executions(config)
    assert before  # the end-to-end test's run
    assert main(["resume", config.run_key, "--run-root", run_root]) == 0
    assert stages.executions(config) == before  # nothing executed again


def test_a_run_that_died_while_logging_its_models_resumes_with_one_model_per_checkpoint(
    prefect_api, mlflow_server, run_root, monkeypatch
):
    """The orchestrator dies after the job trained, half-way through making the checkpoints' LoggedModels (one READY,
    one PENDING with part of its files); `rloo-pipeline resume` reattaches to the finished job and ends with exactly
    one READY model per checkpoint and the final model, the PENDING one completed, none made twice."""
    from flows.cli import main
    from infra import tracking as tracking_module

    assignments = overrides(run_root, mlflow_server, "training.save_steps=1", "name=logging-killed")
    config = load_run_config(TINY, assignments)
    attach, calls = tracking_module.attach_transformers_weights, []

    def dies_at_the_second(*args, **kwargs):
        calls.append(args[3])
        if len(calls) == 2:
            raise RuntimeError("orchestrator killed")
        return attach(*args, **kwargs)

    monkeypatch.setattr(tracking_module, "attach_transformers_weights", dies_at_the_second)
    assert run_flow(TINY, assignments).is_failed()
    client = tracking.client(mlflow_server.uri)
    experiment = client.get_experiment_by_name("rloo").experiment_id

    def models():
        return client.search_logged_models(
            [experiment], filter_string=f"tags.`rloo.run_key` = '{config.run_key}'"
        )

    assert sorted((m.name, str(m.status)) for m in models()) == [
        ("checkpoint-1", "READY"),
        ("checkpoint-2", "PENDING"),
    ]
    monkeypatch.setattr(tracking_module, "attach_transformers_weights", attach)
    assert main(["resume", config.run_key, "--run-root", run_root]) == 0
    assert stages.executions(config).count("train") == 1  # the job was reattached, not run again
    assert sorted((m.name, str(m.status)) for m in models()) == [
        ("checkpoint-1", "READY"),
        ("checkpoint-2", "READY"),
        ("checkpoint-3", "READY"),
        ("final", "READY"),
    ]
    assert all(m.metrics for m in models())  # each scored on the held-out prompts once evaluated


def test_ui_command_serves_prefect_and_mlflow_on_loopback(tmp_path):
    import signal
    import subprocess
    import sys
    import urllib.request

    from services import free_port

    prefect_port, mlflow_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "ui",
            "--run-root",
            str(tmp_path),
            "--prefect-port",
            str(prefect_port),
            "--mlflow-port",
            str(mlflow_port),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        healthy = set()
        deadline = time.time() + 180
        while len(healthy) < 2 and time.time() < deadline:
            for name, url in (
                ("prefect", f"http://127.0.0.1:{prefect_port}/api/health"),
                ("mlflow", f"http://127.0.0.1:{mlflow_port}/health"),
            ):
                try:
                    with urllib.request.urlopen(url, timeout=2) as response:
                        if response.status == 200:
                            healthy.add(name)
                except OSError:
                    pass
            time.sleep(1)
        ui_api = None
        if "prefect" in healthy:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{prefect_port}/ui-settings", timeout=5
            ) as response:
                ui_api = json.load(response)[
                    "api_url"
                ]  # the UI's pages call this: its own port, not 4200
    finally:
        process.send_signal(signal.SIGINT)
        try:  # the output pipe closes only when the command and every server it started are gone
            output, _ = process.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.stdout.close()
            output = "`rloo-pipeline ui` or a server it started was still running 90 s after Ctrl-C"
    assert healthy == {"prefect", "mlflow"}, output[-3000:]
    assert ui_api == f"http://127.0.0.1:{prefect_port}/api"
    assert f"http://127.0.0.1:{prefect_port}" in output and process.returncode == 0, output[-3000:]
    # Ctrl-C stops both servers and everything they spawned: nothing answers on either port afterwards.
    import socket

    for port in (prefect_port, mlflow_port):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"a server still listens on {port}"


def test_vision_language_pipeline_end_to_end(prefect_api, mlflow_server, run_root):
    """configs/vlm_tiny.yaml (a tiny Qwen2-VL, a JSONL whose image column holds file paths) through every stage: the
    saved splits hold the images' bytes, training and evaluation see them, MLflow's completion tables have an image
    column."""
    from datasets import load_from_disk

    from rloo.vision import undecoded

    config_path = os.path.join(ROOT, "configs", "vlm_tiny.yaml")
    assignments = [
        f"run_root={run_root}",
        f"tracking.tracking_uri={mlflow_server.uri}",
        f"data.source={ROOT}/data/shapes.jsonl",
    ]
    state = run_flow(config_path, assignments)
    assert state.is_completed(), state
    summary = state.result()
    train_split = load_from_disk(summary["dataset"]["train_path"])
    assert {"prompt", "image", "solution"} <= set(train_split.column_names)
    assert undecoded(train_split)[0]["image"][
        "bytes"
    ]  # embedded: the run directory holds its images
    assert train_split[0]["image"].size == (32, 32)
    assert summary["train"]["global_step"] == 3
    assert summary["evaluate"]["num_prompts"] == 8 and "reward" in summary["evaluate"]["trained"]

    config = load_run_config(config_path, assignments)
    client = tracking.client(mlflow_server.uri)
    experiment = client.get_experiment_by_name("rloo")
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`rloo.run_key` = '{config.run_key}'"
    )
    [train] = [r for r in runs if r.data.tags.get("rloo.stage") == "train"]
    import mlflow

    table_file = mlflow.artifacts.download_artifacts(
        run_id=train.info.run_id,
        artifact_path="completions/step_0000003.json",
        tracking_uri=mlflow_server.uri,
        dst_path=run_root,
    )
    with open(table_file) as handle:
        table = json.load(handle)
    column = table["columns"].index("image")
    assert {row[column]["type"] for row in table["data"]} == {"image"}
    # a VLM's checkpoints are LoggedModels referencing their folders (the transformers flavor's text pipeline
    # would drop the processor)
    models = client.search_logged_models(
        [experiment.experiment_id], filter_string=f"tags.`rloo.run_key` = '{config.run_key}'"
    )
    assert {m.name: m.tags["rloo.stored"] for m in models} == {
        "checkpoint-2": "referenced",
        "checkpoint-3": "referenced",
        "final": "referenced",
    }
