"""The job types both launchers share (local submitit in infra.launch, SLURM in infra.slurm): the
handle written to the run directory, the failure, the job's environment, a log's tail; waiting for a
server's health URL."""

from __future__ import annotations

import dataclasses
import glob
import os


class TrainingFailed(RuntimeError):
    pass


class TrainingStalled(TrainingFailed):
    """The job's watchdog (rloo.watchdog) found a step making no progress: the message says where,
    its report holds every process's stacks."""


def stall_cause(output_dir: str, since: float) -> str | None:
    """The first line of each stall report (rloo.watchdog.REPORTS: one per process that found its
    step stalled, on any node) written after `since` (epoch seconds), the first written first,
    each with its path; else None."""
    # Imported here: rloo.watchdog is a TrainerCallback (torch, transformers), and a job's own
    # process imports this module to run torchrun, nothing of the trainer.
    from rloo.watchdog import REPORTS

    reports = sorted(
        (os.path.getmtime(path), path)
        for path in glob.glob(os.path.join(output_dir, REPORTS))
        if os.path.getmtime(path) >= since
    )
    lines = []
    for _, path in reports:
        with open(path, errors="replace") as handle:
            lines.append(f"{handle.readline().strip()} (report: {path})")
    return "; ".join(lines) or None


@dataclasses.dataclass
class JobHandle:
    executor: str
    job_id: str
    folder: str
    log_path: str
    submitted_at: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "JobHandle":
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


def tail(path: str, lines: int = 40) -> str:
    """The last lines of a log, after `rloo train`'s own one-line errors from above them (torchrun's
    report of a failed worker would otherwise push the cause out of view)."""
    if not os.path.exists(path):
        return "(no log)"
    with open(path, errors="replace") as handle:
        content = handle.readlines()
    causes = [line for line in content[:-lines] if line.startswith("rloo train: error")]
    return "".join(causes + (["...\n"] if causes else []) + content[-lines:])


def job_environment(extra: dict[str, str], workdir: str) -> dict[str, str]:
    """The environment a training or serving process gets: ours, the recipe's extras, the project on
    PYTHONPATH."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [workdir, env.get("PYTHONPATH", "")] if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def wait_for_health(
    url: str,
    timeout_s: float,
    what: str = "the server",
    alive=lambda: True,
    error: type[Exception] = TimeoutError,
) -> None:
    """Until `url` answers 200; `error` when `alive()` turns false or after `timeout_s`, naming
    `what` and the URL."""
    import time
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not alive():
            raise error(f"{what} exited before {url} became healthy")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise error(f"{what} at {url} did not become healthy within {timeout_s:.0f} s")
