"""The Prefect server going away, for real (a `prefect server start` process killed, or stopped, and started again
on the same database), with the client's retries off so each outage is the worst case (longer than them):
- mid-training: the training job trains on to the end without it; the pipeline process ends with a one-line error
  saying so; once the API is back, `rloo-pipeline resume RUN` picks the run up (training is not run again);
- while a promotion waits for approval: the flow run keeps waiting and is answered afterwards, and publishes."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from infra.job_tracking import read_metrics
from services import free_port

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8


class PrefectServer:
    def __init__(self, home: str):
        self.home, self.port = home, free_port()
        self.process = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> "PrefectServer":
        from flows import prefect_api

        env = {**os.environ, "PREFECT_HOME": self.home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        prefect_api.seed_server_database(env)  # as `rloo-pipeline serve` starts one
        log = open(os.path.join(self.home, "server.log"), "a")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefect",
                "server",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"{self.api}/health", timeout=2):
                    return self
            except OSError:
                time.sleep(1)
        raise TimeoutError("prefect server not healthy")

    def stop(self) -> None:
        from infra.launch import stop_process_groups

        stop_process_groups([self.process], timeout_s=30)


def wait_for_line(path: str, text: str, process, timeout_s: float = 180.0) -> None:
    deadline = time.time() + timeout_s
    while text not in open(path).read():
        assert process.poll() is None and time.time() < deadline, open(path).read()[-4000:]
        time.sleep(1)


def _logged_step(train_dir: str) -> int:
    return max((record.get("step", 0) for record in read_metrics(train_dir)), default=0)


@pytest.fixture(scope="module")
def outage(tmp_path_factory):
    """A tiny pipeline run whose Prefect server is killed at training step 2 and started again once the pipeline
    process has ended; then `rloo-pipeline resume`. The run is reused by the promotion test."""
    from infra.launch import JobHandle, job_state
    from infra.runconfig import load_run_config

    tmp_path = tmp_path_factory.mktemp("outage")
    home = tmp_path / "prefect"
    home.mkdir()
    server = PrefectServer(str(home)).start()
    env = {
        **os.environ,
        "PREFECT_API_URL": server.api,
        "RLOO_HUB_PUBLISHER": f"local:{tmp_path}/hub",
        "PREFECT_CLIENT_MAX_RETRIES": "0",
        "RLOO_TEST_STEP_SLEEP": "1",
        "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests", "faults"), ROOT]),
    }
    run_root = str(tmp_path / "runs")
    sets = [
        f"run_root={run_root}",
        f"data.source={ROOT}/data/arithmetic.jsonl",
        f"training.max_steps={STEPS}",
        "training.callbacks=[points:SlowSteps]",
    ]
    config = load_run_config(os.path.join(ROOT, "configs", "tiny.yaml"), sets)
    train_dir = os.path.join(config.run_dir, "train")
    log_path = str(tmp_path / "first.log")
    try:
        with open(log_path, "w") as log:
            first = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "flows.cli",
                    "run",
                    "configs/tiny.yaml",
                    *[f"--set={s}" for s in sets],
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.time() + 300
        while _logged_step(train_dir) < 2:
            assert first.poll() is None and time.time() < deadline, open(log_path).read()[-4000:]
            time.sleep(0.5)
        os.killpg(server.process.pid, signal.SIGKILL)  # the API is gone mid-training
        server.process.wait()
        handle = JobHandle.from_dict(json.load(open(os.path.join(train_dir, "job.json")))["handle"])
        while job_state(handle)[0] == "RUNNING":
            assert time.time() < deadline, open(os.path.join(train_dir, "job.log")).read()[-4000:]
            time.sleep(1)
        job_end = {"state": job_state(handle)[0], "step": _logged_step(train_dir)}
        first_code = first.wait(timeout=240)  # it ends by itself, with the API still away
        server.start()  # back, same database
        resumed = subprocess.run(
            [sys.executable, "-m", "flows.cli", "resume", config.run_key, "--run-root", run_root],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        yield {
            "server": server,
            "env": env,
            "config": config,
            "run_root": run_root,
            "job_end": job_end,
            "first": (first_code, open(log_path).read()),
            "resumed": resumed,
            "tmp_path": tmp_path,
        }
    finally:
        server.stop()


def test_training_outlives_the_prefect_api_and_resume_picks_the_run_up(outage):
    from infra import stages

    assert outage["job_end"] == {
        "state": "COMPLETED",
        "step": STEPS,
    }  # trained to the end with no API
    code, output = outage["first"]
    assert code == 1, output[-4000:]
    assert (
        "the Prefect API is unreachable" in output
    )  # it kept following the job without progress updates
    assert (
        "went away" in output
        and f"`rloo-pipeline resume {outage['config'].run_key} --run-root " in output
    ), output[-3000:]
    resumed = outage["resumed"]
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    config = outage["config"]
    assert stages.executions(config).count("train") == 1  # picked up, not trained again
    assert stages.load_stage_result(config, "evaluate") is not None
    summary = json.load(open(os.path.join(config.run_dir, "summary.json")))
    assert summary["train"]["global_step"] == STEPS


def test_a_waiting_promotion_survives_a_server_outage(outage):
    server, env, run_root, tmp_path = (
        outage["server"],
        outage["env"],
        outage["run_root"],
        outage["tmp_path"],
    )
    assert outage["resumed"].returncode == 0
    run = outage["config"].run_key
    log_path = str(tmp_path / "promote.log")
    with open(log_path, "w") as log:
        promotion = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "promote",
                run,
                "--run-root",
                run_root,
                "--set",
                "promotion.require_approval=true",
                "--set",
                "promotion.min_gain=-1",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    wait_for_line(log_path, "waiting for approval", promotion)
    time.sleep(3)
    server.stop()  # the server goes away while the flow run is paused
    wait_for_line(log_path, "went away while waiting for approval", promotion, 120)
    server.start()  # back, same database
    answer = subprocess.run(
        [sys.executable, "-m", "flows.cli", "promote", run, "--run-root", run_root, "--approve"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert answer.returncode == 0 and "approved: flow run" in answer.stdout, (
        answer.stdout + answer.stderr
    )
    assert promotion.wait(timeout=180) == 0, open(log_path).read()[-4000:]
    assert "published" in open(log_path).read()
    assert os.path.exists(tmp_path / "hub" / "rloo-tiny" / "main" / "adapter_model.safetensors")
