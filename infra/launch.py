"""Launching the training job with submitit and following it without holding anything but a file.

The job is `torchrun ... -m rloo train --config <recipe>` wrapped in a picklable callable (one
process: `python -m rloo train` itself, with the environment torchrun would give it). Its
handle (executor, job id, folder) is written to the run directory, so a retried stage — even from a
new orchestrator process — reattaches to a job that is still running instead of starting another."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from infra.jobs import JobHandle, TrainingFailed, job_environment, tail
from infra.slurm import scancel, slurm_job_state

__all__ = [
    "JobHandle",
    "TrainJob",
    "TrainingFailed",
    "cancel",
    "job_environment",
    "job_state",
    "submit_local",
    "stop_process_groups",
    "tail",
]


class TrainJob:
    """What submitit runs: torchrun on this node, output to a log file; raises with the log's tail
    on failure."""

    def __init__(
        self,
        recipe_path: str,
        nproc_per_node: int,
        env: dict[str, str],
        log_path: str,
        workdir: str,
    ):
        self.recipe_path = recipe_path
        self.nproc_per_node = nproc_per_node
        self.env = env
        self.log_path = log_path
        self.workdir = workdir

    def command(self) -> list[str]:
        train = ["-m", "rloo", "train", "--config", self.recipe_path]
        if self.nproc_per_node == 1:
            return [sys.executable, *train]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(self.nproc_per_node),
            *train,
        ]

    def __call__(self) -> dict:
        env = job_environment(self.env, self.workdir)
        if self.nproc_per_node == 1:
            env.update(single_process_environment())
        start = time.time()
        with open(self.log_path, "a") as log:
            log.write(f"$ {' '.join(self.command())}\n")
            log.flush()
            code = subprocess.call(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir
            )
        if code != 0:
            raise TrainingFailed(
                f"training exited with code {code}; last lines of "
                f"{self.log_path}:\n{tail(self.log_path)}"
            )
        return {"seconds": time.time() - start}


def single_process_environment() -> dict[str, str]:
    """What torchrun gives its one worker (a rank, a world of one, a free rendezvous port on
    loopback), for the job that starts that worker itself: torchrun's agent would cost a process
    importing torch (3-4 s of CPU) to watch one child. The trainer then runs as under torchrun (a
    gloo group of one, colocated vLLM on the same port scheme)."""
    import socket

    with socket.socket() as probe:  # the port the group's store listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK")
    sizes = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE")
    return {
        **dict.fromkeys(ranks, "0"),
        **dict.fromkeys(sizes, "1"),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def submit_local(job: TrainJob, folder: str, timeout_min: int) -> JobHandle:
    import submitit

    os.makedirs(folder, exist_ok=True)
    executor = submitit.LocalExecutor(folder=folder)
    executor.update_parameters(timeout_min=timeout_min)
    submitted = executor.submit(job)
    return JobHandle("local", str(submitted.job_id), folder, job.log_path, time.time())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a zombie child (finished, not reaped) is not running
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except OSError:
        return True


def job_state(handle: JobHandle) -> tuple[str, str | None]:
    """('RUNNING' | 'COMPLETED' | 'FAILED' | 'LOST', error text). LOST = gone without a result
    (killed)."""
    from submitit.core.utils import JobPaths, pickle_load

    if handle.executor == "slurm":
        return slurm_job_state(handle)
    paths = JobPaths(handle.folder, job_id=handle.job_id, task_id=0)
    if paths.result_pickle.exists():
        outcome, value = pickle_load(paths.result_pickle)
        if outcome == "success":
            return "COMPLETED", None
        return "FAILED", str(value)
    if handle.executor == "local" and _pid_alive(int(handle.job_id)):
        return "RUNNING", None
    return "LOST", (
        f"the job (pid {handle.job_id}) ended without a result; last lines of "
        f"{handle.log_path}:\n{tail(handle.log_path)}"
    )


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def cancel(handle: JobHandle) -> None:
    """Stop a local job and every process it started (torchrun, if any, and its ranks)."""
    import signal

    if handle.executor == "slurm":
        scancel(handle.job_id)
        return
    pid = int(handle.job_id)
    for target in [*reversed(descendants(pid)), pid]:
        try:
            os.kill(target, signal.SIGTERM)
        except ProcessLookupError:
            pass


def stop_process_groups(processes: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """Stop processes started with start_new_session=True and everything they spawned: SIGTERM to
    each group, a wait, then SIGKILL to whatever of the groups is left (servers whose workers
    outlive their parent's SIGTERM)."""
    import signal

    def signal_group(process, signum):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass

    for process in processes:
        signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        signal_group(process, signal.SIGKILL)
        process.wait()
