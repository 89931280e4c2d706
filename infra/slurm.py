"""The multi-node launch: one SLURM allocation through submitit, trainer nodes running torchrun
(c10d rendezvous on the first trainer) and, on the last node, the generation server.

Roles are a pure function of the node index. Trainers wait for the server's health before training
and the first trainer writes a sentinel when training ends, which stops the server, so the job
completes; either side failing fails the job with its log."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from infra.jobs import JobHandle, TrainingFailed, job_environment, tail, wait_for_health


def role_of(node: int, num_nodes: int, generation_nodes: int) -> str:
    return "generation" if node >= num_nodes - generation_nodes else "trainer"


def default_constraint(trainer_nodes: int, generation_nodes: int) -> str:
    if not generation_nodes:
        return f"[trainer*{trainer_nodes}]"
    return f"[trainer*{trainer_nodes}&generation*{generation_nodes}]"


def executor_parameters(settings, timeout_min: int, job_name: str) -> dict:
    """submitit SlurmExecutor parameters (slurm_* names) from the run config's cluster section."""
    nodes = settings.trainer_nodes + settings.generation_nodes
    params = {
        "slurm_job_name": job_name,
        "nodes": nodes,
        "tasks_per_node": 1,
        "timeout_min": timeout_min,
        "slurm_signal_delay_s": settings.signal_delay_s,
        "slurm_max_num_timeout": settings.max_num_timeout,
        # one failed node (a crashed trainer, a dead server) ends the whole step at once
        "slurm_srun_args": ["--kill-on-bad-exit=1"],
    }
    if settings.partition:
        params["slurm_partition"] = settings.partition
    if settings.account:
        params["slurm_account"] = settings.account
    if settings.qos:
        params["slurm_qos"] = settings.qos
    if settings.gpus_per_node:
        params["gpus_per_node"] = settings.gpus_per_node
    if settings.cpus_per_task:
        params["cpus_per_task"] = settings.cpus_per_task
    by_features = (
        default_constraint(settings.trainer_nodes, settings.generation_nodes)
        if settings.use_node_features
        else None
    )
    constraint = settings.constraint or by_features
    if constraint:
        params["slurm_constraint"] = constraint
    if settings.setup:
        params["slurm_setup"] = list(settings.setup)
    if settings.extra_sbatch:
        params["slurm_additional_parameters"] = dict(settings.extra_sbatch)
    return params


def _ignore_usr2() -> None:
    import signal

    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def wait_exited(process: subprocess.Popen, timeout_s: float) -> None:
    """Wait up to timeout_s for process to exit, from a signal handler. The handler interrupted
    `process.wait()` in the same thread, which holds the Popen's wait lock: `process.wait(timeout)`
    would spin on that lock for the whole timeout even after the process exited (every preemption
    then lost signal_delay_s - 10 seconds of the grace SLURM gives). waitpid needs no lock."""
    deadline = time.time() + timeout_s
    while process.returncode is None and time.time() < deadline:
        try:
            pid, status = os.waitpid(process.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already
            return
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return
        time.sleep(0.1)


def fill_placeholders(command: list[str], **values) -> list[str]:
    """{model}, {port} and {host} replaced; any other brace (a JSON argument) left as written."""
    filled = []
    for part in command:
        for name, value in values.items():
            part = part.replace("{" + name + "}", str(value))
        filled.append(part)
    return filled


class MultiNodeJob:
    """The callable submitit runs once per node (tasks_per_node=1). Requeued on preemption/time-out:
    training then resumes from the newest checkpoint in output_dir."""

    def __init__(
        self,
        recipe_path: str,
        settings: dict,
        nproc_per_node: int,
        env: dict[str, str],
        log_dir: str,
        workdir: str,
        model: str,
    ):
        self.recipe_path = recipe_path
        self.settings = settings
        self.nproc_per_node = nproc_per_node
        self.env = env
        self.log_dir = log_dir
        self.workdir = workdir
        self.model = model

    def _environment(self) -> dict:
        env = job_environment(self.env, self.workdir)
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        return env

    def __call__(self) -> dict:
        import submitit

        job = submitit.JobEnvironment()
        generation_nodes = self.settings["generation_nodes"]
        role = role_of(job.node, job.num_nodes, generation_nodes)
        sentinel = os.path.join(self.log_dir, f"training-finished-{job.job_id}")
        host = job.hostnames[-1]
        url = f"http://{host}:{self.settings['generation_port']}"
        if role == "generation":
            return self._serve(job, sentinel, url)
        return self._train(job, sentinel, url if generation_nodes else None)

    def _serve(self, job, sentinel: str, url: str) -> dict:
        log_path = os.path.join(self.log_dir, f"generation-{job.job_id}.log")
        command = fill_placeholders(
            self.settings["generation_command"],
            model=self.model,
            port=self.settings["generation_port"],
            host=job.hostnames[-1],
        )
        with open(log_path, "a") as log:
            server = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environment(),
                # preemption: keep serving
                cwd=self.workdir,
                preexec_fn=_ignore_usr2,
            )
            try:
                while not os.path.exists(sentinel):
                    if server.poll() is not None:
                        raise TrainingFailed(
                            f"the generation server ({' '.join(command)}) exited with code "
                            f"{server.returncode}; last lines of {log_path}:\n{tail(log_path)}"
                        )
                    time.sleep(0.5)
            finally:
                if server.poll() is None:
                    server.terminate()
                    try:
                        server.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        server.kill()
        return {"role": "generation", "stopped": True}

    def _train(self, job, sentinel: str, url: str | None) -> dict:
        trainers = job.num_nodes - self.settings["generation_nodes"]
        log_path = os.path.join(self.log_dir, f"trainer-{job.job_id}-node{job.node}.log")
        if url is not None:
            wait_for_health(
                url + self.settings["generation_health_path"],
                self.settings["generation_timeout_s"],
                "the generation server (vllm_server_timeout)",
                error=TrainingFailed,
            )
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(trainers),
            "--nproc_per_node",
            str(self.nproc_per_node),
            "--node_rank",
            str(job.node),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"{job.hostnames[0]}:{self.settings['rendezvous_port']}",
            "--rdzv_id",
            str(job.job_id),
            "-m",
            "rloo",
            "train",
            "--config",
            self.recipe_path,
            "--resume_from_checkpoint",
            "latest",
            "--ddp_timeout",
            str(self.settings["collective_timeout_s"]),
        ]
        if url is not None:
            command += ["--vllm_server_base_url", url]
        start = time.time()
        with open(log_path, "a") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            # torchrun's agent would die of SLURM's SIGUSR2; ignored here (inherited across exec),
            # the training processes install their own handler (rloo.callbacks.PreemptionCallback)
            # and save before stopping.
            env = self._environment()
            if url is not None:  # a failing server call then quotes the server's own last lines
                env["RLOO_VLLM_SERVER_LOG"] = os.path.join(
                    self.log_dir, f"generation-{job.job_id}.log"
                )
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                preexec_fn=_ignore_usr2,
            )
            code = self._process.wait()
        if job.node == 0:
            with open(sentinel, "w") as handle:
                handle.write(str(code))
        if code != 0:
            raise TrainingFailed(
                f"trainer node {job.node} ({job.hostnames[job.node]}) exited with code {code}; "
                f"last lines of {log_path}:\n{tail(log_path)}"
            )
        return {"role": "trainer", "node": job.node, "seconds": time.time() - start}

    def checkpoint(self, *args, **kwargs):
        """Preemption / time-out (submitit calls this on global rank 0): let the trainers save their
        checkpoint and stop (they got the same signal), then requeue the same job; they resume from
        that checkpoint."""
        import submitit

        process = getattr(self, "_process", None)
        if process is not None:
            wait_exited(process, max(10, self.settings["signal_delay_s"] - 10))
        self._process = None  # not picklable; the requeued job starts a new one
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_process", None)
        return state


def submit_slurm(job: MultiNodeJob, folder: str, parameters: dict):
    import submitit

    os.makedirs(folder, exist_ok=True)
    parameters = dict(parameters)
    executor = submitit.AutoExecutor(
        folder=folder,
        cluster="slurm",
        slurm_max_num_timeout=parameters.pop("slurm_max_num_timeout", 3),
    )
    executor.update_parameters(**parameters)
    try:
        submitted = executor.submit(job)
    except Exception as err:  # submitit raises FailedJobError with sbatch's message
        raise TrainingFailed(f"SLURM refused the job: {str(err).strip()}") from None
    return JobHandle(
        "slurm",
        str(submitted.job_id),
        folder,
        os.path.join(job.log_dir, "trainer-*.log"),
        time.time(),
    )


def slurm_state(job_id: str) -> str:
    """The job's state from scontrol (works without accounting), e.g. RUNNING, COMPLETED, FAILED,
    CANCELLED."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True
    ).stdout
    for item in out.split():
        if item.startswith("JobState="):
            return item.split("=", 1)[1]
    return "UNKNOWN"


ACTIVE_STATES = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "RESIZING",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SIGNALING",
    "STAGE_OUT",
}


def slurm_job_state(handle) -> tuple[str, str | None]:
    """Map SLURM's state and submitit's per-task results onto RUNNING / COMPLETED / FAILED /
    LOST."""
    import glob

    from submitit.core.utils import pickle_load

    state = slurm_state(handle.job_id)
    if state in ACTIVE_STATES:
        return "RUNNING", None
    errors = []
    for path in sorted(glob.glob(os.path.join(handle.folder, f"{handle.job_id}_*_result.pkl"))):
        outcome, value = pickle_load(path)
        if outcome != "success":
            errors.append(str(value))
    if state == "COMPLETED" and not errors:
        return "COMPLETED", None
    log_paths = sorted(glob.glob(handle.log_path))
    logs = "\n".join(f"--- {path}\n{tail(path, 30)}" for path in log_paths[:4])
    detail = errors[0] if errors else logs or "(no logs)"
    causes = [cause for cause in (root_cause(path) for path in log_paths) if cause]
    if causes:  # the rank that crashed, not the ranks that lost their peer afterwards
        detail = f"root cause: {causes[0]}\n{detail}"
    if state == "UNKNOWN":
        return "LOST", f"SLURM no longer knows job {handle.job_id}; {detail}"
    return "FAILED", f"SLURM job {handle.job_id} ended {state}: {detail}"


def scancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True)


CONSEQUENCES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "SignalException",
    "ChildFailedError",
    "got signal",
    "Broken pipe",
    "DistNetworkError",
)


def root_cause(log_path: str) -> str | None:
    """`rloo train`'s own one-line error in this log, else the last exception a rank raised in it,
    unless it only reports another rank's failure."""
    import re

    pattern = re.compile(r"^(?:\[rank(\d+)\]: )?([A-Za-z_.]*(?:Error|Exception)): (.+)$")
    found = None
    with open(log_path, errors="replace") as handle:
        for line in handle:
            if "rloo train: error" in line:
                return f"{os.path.basename(log_path)}: {line.strip()[:400]}"
            match = pattern.match(line.strip())
            if match and not any(marker in line for marker in CONSEQUENCES):
                rank = f"rank {match.group(1)}: " if match.group(1) else ""
                found = (
                    f"{os.path.basename(log_path)}: {rank}{match.group(2)}: {match.group(3)[:300]}"
                )
    return found
