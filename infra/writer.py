"""One writer per run directory: the pipeline holds an exclusive flock on `<run_dir>/.writer.lock`
for as long as its flow runs (the kernel releases it when the process ends, however it ends);
`writer.json` beside it says who holds it, so a second run of the same config (same fingerprint,
same directory) refuses naming the first, or waits for it. A training job left running by a writer
that died is reattached by the next one (infra.stages)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time

LOCK = ".writer.lock"
HOLDER = "writer.json"
IF_RUNNING = ("refuse", "wait")


class RunDirBusy(RuntimeError):
    """Another process is writing this run directory."""


def holder(run_dir: str) -> str:
    try:
        with open(os.path.join(run_dir, HOLDER)) as handle:
            who = json.load(handle)
    except (OSError, ValueError):
        return "another process"
    flow_run = f", Prefect flow run {who['flow_run']}" if who.get("flow_run") else ""
    return (
        f"process {who['pid']} on {who['host']} (since {who['since']}{flow_run}: {who['command']})"
    )


def _lock(handle, run_dir: str, if_running: str, poll_s: float) -> None:
    """Take the lock on the open lock file: RunDirBusy naming the holder ('refuse'), or poll until
    free ('wait')."""
    if if_running not in IF_RUNNING:
        raise ValueError(f"if_running={if_running!r}: use 'refuse' or 'wait'.")
    waiting_said = False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if if_running == "refuse":
            raise RunDirBusy(
                f"{run_dir} is being written by {holder(run_dir)}: a second run of the same config "
                "would write the same checkpoints. Fix: wait for it to finish (rloo-pipeline "
                "status shows its stages), stop it, or start this one with --if-running wait."
            )
        if not waiting_said:
            print(f"[pipeline] waiting for {holder(run_dir)} to finish with {run_dir}", flush=True)
            waiting_said = True
        time.sleep(poll_s)


def wait_until_free(run_dir: str, if_running: str = "refuse", poll_s: float = 2.0) -> None:
    """What the CLI checks before Prefect starts: nobody holds the run directory (refuse or wait);
    nothing is kept or created (the flow takes the lock itself)."""
    if os.path.exists(os.path.join(run_dir, LOCK)):
        with open(os.path.join(run_dir, LOCK), "a+") as handle:
            _lock(handle, run_dir, if_running, poll_s)


@contextlib.contextmanager
def sole_writer(
    run_dir: str, if_running: str = "refuse", flow_run: str | None = None, poll_s: float = 2.0
):
    """Hold the run directory's lock inside the block; writer.json says who holds it while it is
    held."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, LOCK), "a+") as handle:
        _lock(handle, run_dir, if_running, poll_s)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "flow_run": flow_run,
            "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])[:200],
        }
        with open(os.path.join(run_dir, HOLDER + ".tmp"), "w") as out:
            json.dump(info, out)
        os.replace(os.path.join(run_dir, HOLDER + ".tmp"), os.path.join(run_dir, HOLDER))
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(run_dir, HOLDER))
