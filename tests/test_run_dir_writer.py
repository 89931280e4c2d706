"""One writer per run directory (infra.writer): while a process holds a run's directory, `rloo-pipeline run` of the
same config refuses before Prefect starts, naming the holder, and leaves the directory as it was; `--if-running
wait` waits for it; a holder killed with SIGKILL leaves the directory free. (Two flow runs of one config started at
once on a Prefect server: tests/test_deployments.py.)"""

import os
import signal
import subprocess
import sys
import time

import pytest

from infra.runconfig import load_run_config
from infra.writer import RunDirBusy, sole_writer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
HOLD = """import sys, time
from infra.writer import sole_writer
with sole_writer(sys.argv[1], flow_run="the-first-flow-run"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def hold(run_dir, seconds):
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, run_dir, str(seconds)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_writer_is_refused_or_waits_and_a_killed_one_frees_the_directory(tmp_path, capsys):
    assignments = [
        f"run_root={tmp_path}",
        "tracking.tracking_uri=sqlite:///" + str(tmp_path / "mlflow.db"),
    ]
    run_dir = load_run_config(TINY, assignments).run_dir
    holder = hold(run_dir, 60)
    before = sorted(os.listdir(run_dir))
    second = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", TINY, *[f"--set={a}" for a in assignments]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 2, second.stdout + second.stderr
    assert (
        f"rloo-pipeline run: error: {run_dir} is being written by process {holder.pid} on "
        in second.stderr
    ), second.stderr
    assert (
        "Prefect flow run the-first-flow-run" in second.stderr
        and "--if-running wait" in second.stderr
    )
    assert (
        sorted(os.listdir(run_dir)) == before == [".writer.lock", "writer.json"]
    )  # nothing else written

    holder.send_signal(signal.SIGKILL)  # however it dies, the kernel releases the lock
    holder.wait()
    with sole_writer(run_dir):
        assert f'"pid": {os.getpid()},' in open(os.path.join(run_dir, "writer.json")).read()
    assert "writer.json" not in os.listdir(run_dir)

    holder = hold(run_dir, 1.5)
    with pytest.raises(RunDirBusy, match=f"process {holder.pid} on"):
        with sole_writer(run_dir):
            pass
    start = time.monotonic()
    with sole_writer(run_dir, "wait", poll_s=0.1):
        waited = time.monotonic() - start
    assert holder.wait(timeout=30) == 0 and waited > 0.5
    assert f"[pipeline] waiting for process {holder.pid}" in capsys.readouterr().out
