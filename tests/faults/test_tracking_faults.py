"""The tracking server misbehaving under a real 100-step `rloo train` that logs the way the pipeline's job does
(infra.job_tracking's callback on the train stage's MLflow run): killed with SIGKILL and restarted three times, and
paused with SIGSTOP for longer than the client's timeout (its requests arrive late, after the client gave up and
queued them); and answers lost after the server had stored the metrics, so the same items are sent again. The run
is not disturbed, and every step's metrics end up in MLflow exactly once."""

import json
import os
import signal
import time

import pytest
from harness import start, write_recipe

from infra.job_tracking import (
    enqueue,
    flush_pending,
    metrics_item,
    pending_count,
    read_metrics,
    tracking_environment,
)
from infra.tracking import client, start_run
from services import MlflowServer

pytestmark = pytest.mark.slow
STEPS = 100


def _logged_step(train_dir: str) -> int:
    return max((record.get("step", 0) for record in read_metrics(train_dir)), default=0)


def _wait_for_step(train_dir: str, step: int, process, log: str) -> None:
    while _logged_step(train_dir) < step:
        assert process.poll() is None, open(log).read()[-3000:]
        time.sleep(0.2)


@pytest.fixture
def server(tmp_path):
    server = MlflowServer(str(tmp_path / "mlflow")).start()
    yield server
    if server.process is not None and server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGCONT)  # a test that failed mid-pause
    server.stop()


def test_mlflow_killed_restarted_and_paused_mid_run_loses_and_doubles_no_metric(tmp_path, server):
    run_id = start_run(server.uri, "tracking-faults", "train", {})
    train_dir = str(tmp_path / "train")
    recipe = write_recipe(
        str(tmp_path),
        1,
        max_steps=STEPS,
        save_steps=50,
        callbacks=["points:SlowSteps", "infra.job_tracking:RunDirTrackingCallback"],
    )
    release = (
        tmp_path / "faults-done"
    )  # the run waits at step 90 until the faults are over, however slow they are
    env = {
        **tracking_environment(server.uri, run_id, train_dir),
        "RLOO_TEST_STEP_SLEEP": "0.3",
        "RLOO_TEST_HOLD_AT": "90",
        "RLOO_TEST_HOLD_UNTIL": str(release),
    }
    log = str(tmp_path / "job.log")  # 100 steps of log lines: more than a pipe holds
    process = start(recipe, str(tmp_path / "out"), env=env, log=log)
    try:
        for step in (5, 25, 45):  # killed outright, then back on the same port and store
            _wait_for_step(train_dir, step, process, log)
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
            time.sleep(1)
            server.start()
        _wait_for_step(train_dir, 65, process, log)
        os.killpg(
            server.process.pid, signal.SIGSTOP
        )  # frozen: connections accepted, nothing answered
        time.sleep(15)  # past the job's 10 s client timeout
        os.killpg(server.process.pid, signal.SIGCONT)
        release.touch()
        process.wait(timeout=600)
        output = open(log).read()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, output[-3000:]
    assert flush_pending(
        train_dir, server.uri, run_id
    )  # what the train stage does before it closes the run
    assert pending_count(train_dir) == 0
    with open(os.path.join(train_dir, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    for record in records[::7]:  # delivered, but the answers were lost: the same items go again
        enqueue(train_dir, metrics_item(record))
    assert flush_pending(train_dir, server.uri, run_id)
    expected: dict[str, list] = {}
    for record in records:
        for key, value in metrics_item(record)["metrics"].items():
            expected.setdefault(key, []).append((record["step"], pytest.approx(value)))
    assert [step for step, _ in expected["reward"]] == list(range(1, STEPS + 1))
    mlflow = client(server.uri)
    for key, values in expected.items():
        history = sorted((m.step, m.value) for m in mlflow.get_metric_history(run_id, key))
        assert history == values, key  # each step once, with the value the run logged
