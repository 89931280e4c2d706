"""A promotion waiting for approval outlives its Prefect server: a real `prefect server start` process is stopped
while the promotion's flow run is paused and started again on the same database; the run is answered afterwards
and finishes. The promotion's client gets no retries, so the outage is seen as the worst case (longer than them)."""

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from services import free_port

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PrefectServer:
    def __init__(self, home: str):
        self.home, self.port = home, free_port()
        self.process = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> "PrefectServer":
        env = {**os.environ, "PREFECT_HOME": self.home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        log = open(os.path.join(self.home, "server.log"), "a")
        self.process = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                         "--port", str(self.port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
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


def test_a_waiting_promotion_survives_a_server_outage(tmp_path):
    home = tmp_path / "prefect"
    home.mkdir()
    server = PrefectServer(str(home)).start()
    env = {**os.environ, "PREFECT_API_URL": server.api, "RLOO_HUB_PUBLISHER": f"local:{tmp_path}/hub",
           "PREFECT_CLIENT_MAX_RETRIES": "0"}
    run_root = str(tmp_path / "runs")
    try:
        done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", "--set",
                               f"run_root={run_root}", "--set", f"data.source={ROOT}/data/arithmetic.jsonl"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        run = next(d for d in os.listdir(run_root) if d.startswith("tiny-"))
        log_path = str(tmp_path / "promote.log")
        with open(log_path, "w") as log:
            promotion = subprocess.Popen([sys.executable, "-m", "flows.cli", "promote", run, "--run-root", run_root,
                                          "--set", "promotion.require_approval=true", "--set",
                                          "promotion.min_gain=-1"], cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        wait_for_line(log_path, "waiting for approval", promotion)
        time.sleep(3)
        server.stop()  # the server goes away while the flow run is paused
        wait_for_line(log_path, "went away while waiting for approval", promotion, 120)
        server.start()  # back, same database
        answer = subprocess.run([sys.executable, "-m", "flows.cli", "promote", run, "--run-root", run_root,
                                 "--approve"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert answer.returncode == 0 and "approved: flow run" in answer.stdout, answer.stdout + answer.stderr
        assert promotion.wait(timeout=180) == 0, open(log_path).read()[-4000:]
        assert "published" in open(log_path).read()
        assert os.path.exists(tmp_path / "hub" / "rloo-tiny" / "main" / "adapter_model.safetensors")
    finally:
        server.stop()
