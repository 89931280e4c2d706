"""One writer per run directory: the pipeline holds an exclusive flock on `<run_dir>/.writer.lock` for as long as its
flow runs (the kernel releases it when the process ends, however it ends); `writer.json` beside it says who holds
it, so a second run of the same config (same fingerprint, same directory) refuses naming the first, or waits for it.
A training job left running by a writer that died is reattached by the next one (infra.stages)."""

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
    return f"process {who['pid']} on {who['host']} (since {who['since']}{flow_run}: {who['command']})"


def _try_lock(handle) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


@contextlib.contextmanager
def sole_writer(run_dir: str, if_running: str = "refuse", flow_run: str | None = None, poll_s: float = 2.0,
                probe: bool = False):
    """Hold the run directory's lock inside the block (`probe`: only check that it is free, or wait until it is,
    without keeping it). if_running='refuse' raises RunDirBusy naming the holder; 'wait' polls until it is free."""
    if if_running not in IF_RUNNING:
        raise ValueError(f"if_running={if_running!r}: use 'refuse' or 'wait'.")
    if probe and not os.path.exists(os.path.join(run_dir, LOCK)):
        yield
        return
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, LOCK), "a+") as handle:
        waiting_said = False
        while not _try_lock(handle):
            if if_running == "refuse":
                raise RunDirBusy(f"{run_dir} is being written by {holder(run_dir)}: a second run of the same config "
                                 "would write the same checkpoints. Fix: wait for it to finish (rloo-pipeline status "
                                 "shows its stages), stop it, or start this one with --if-running wait.")
            if not waiting_said:
                print(f"[pipeline] waiting for {holder(run_dir)} to finish with {run_dir}", flush=True)
                waiting_said = True
            time.sleep(poll_s)
        if probe:
            yield
            return
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "flow_run": flow_run, "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])[:200]}
        with open(os.path.join(run_dir, HOLDER + ".tmp"), "w") as out:
            json.dump(info, out)
        os.replace(os.path.join(run_dir, HOLDER + ".tmp"), os.path.join(run_dir, HOLDER))
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(run_dir, HOLDER))
