"""The services behind `rloo-pipeline ui` and `rloo-pipeline serve`, on 127.0.0.1: a Prefect server
whose UI calls its own API on whatever port it was given, an MLflow UI on the run root's store, and
for `serve` a `process` work pool, the deployments of prefect.yaml (`prefect deploy --all`, exactly
what a team runs against its own server) and a worker that runs what the UI's Run button or a
schedule creates. Each process in its own group, so stopping the group stops what it spawned."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from flows import prefect_api
from infra import databases
from infra.launch import stop_process_groups
from infra.runconfig import REPOSITORY

POOL = "rloo"


def service_environment(
    run_root: str,
    prefect_port: int,
    mlflow_port: int,
    prefect_db: str | None = None,
    mlflow_db: str | None = None,
) -> dict[str, str]:
    """What the servers, `prefect deploy`, the worker and the flow runs it starts share. With the
    team's databases (PostgreSQL URLs, checked: no password in them), the Prefect server runs on
    `prefect_db`, and the flow runs track into the MLflow server on `mlflow_db`."""

    root = os.path.abspath(run_root)
    api = f"http://127.0.0.1:{prefect_port}/api"
    env = dict(os.environ)
    env.setdefault("PREFECT_HOME", os.path.join(root, ".prefect"))
    env.update(
        {
            "PREFECT_API_URL": api,
            "PREFECT_UI_API_URL": api,  # without it the UI's pages call :4200 whatever the port
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "RLOO_RUN_ROOT": root,
            "RLOO_HOME": REPOSITORY,
        }
    )
    if prefect_db := databases.configured("prefect", prefect_db):
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = databases.sqlalchemy_url(
            prefect_db, "prefect"
        )
    if mlflow_db := databases.configured("mlflow", mlflow_db):
        env["RLOO_MLFLOW_BACKEND"] = databases.sqlalchemy_url(mlflow_db, "mlflow")
        env["RLOO_TRACKING_URI"] = f"http://127.0.0.1:{mlflow_port}"
    env.setdefault("PREFECT_WORKER_QUERY_SECONDS", "5")
    os.makedirs(env["PREFECT_HOME"], exist_ok=True)
    return env


def start_servers(
    run_root: str,
    prefect_port: int,
    mlflow_port: int,
    env: dict[str, str],
    mlflow_workers: int = 1,
) -> list[subprocess.Popen]:
    """The Prefect server and the MLflow server (with its UI), their output in `<run root>/.logs/`
    (the console stays readable)."""
    return [
        start_prefect(run_root, prefect_port, env),
        start_mlflow(run_root, mlflow_port, env, mlflow_workers),
    ]


def _start(run_root: str, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
    logs = os.path.join(os.path.abspath(run_root), ".logs")
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(logs, f"{name}.log"), "a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", *command],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def start_prefect(run_root: str, port: int, env: dict[str, str]) -> subprocess.Popen:
    """Prefect's server on its database (PREFECT_SERVER_DATABASE_CONNECTION_URL, else its SQLite
    file under PREFECT_HOME). A new SQLite database starts as a copy of the template the embedded
    API keeps (flows.prefect_api)."""
    prefect_api.seed_server_database(env)
    return _start(
        run_root,
        "prefect-server",
        ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
    )


def start_mlflow(
    run_root: str, port: int, env: dict[str, str], workers: int = 1
) -> subprocess.Popen:
    """MLflow's tracking server and UI on its backend store (RLOO_MLFLOW_BACKEND, else the run
    root's SQLite file), artifacts under the run root either way. One worker process by default
    (MLflow's own default of 4 costs a full import of its server each, about 20 s of CPU at every
    start, for a store that a team's few clients and one trainer write to); MLflow's job runner
    (GenAI judges and prompt optimisation, nothing this pipeline starts) stays off unless the
    environment turns it on."""
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **env}
    root = os.path.abspath(run_root)
    store = env.get("RLOO_MLFLOW_BACKEND") or f"sqlite:///{os.path.join(root, 'mlflow.db')}"
    return _start(
        run_root,
        "mlflow-ui",
        [
            "mlflow",
            "server",
            "--backend-store-uri",
            store,
            "--artifacts-destination",
            os.path.join(root, "mlartifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            str(workers),
        ],
        env,
    )


def deploy(env: dict[str, str], stall_alert_s: float) -> None:
    """The work pool, prefect.yaml's deployments and the stalled-run automation
    (infra.stall_alert) on the server of `env` (all idempotent)."""
    prefect = [sys.executable, "-m", "prefect", "--no-prompt"]
    for command in (
        ["work-pool", "create", POOL, "--type", "process", "--overwrite"],
        ["deploy", "--all"],
    ):
        done = subprocess.run(
            prefect + command, env=env, cwd=REPOSITORY, capture_output=True, text=True
        )
        if done.returncode:
            raise RuntimeError(
                f"prefect {' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}"
            )
    install = "import sys; from infra import stall_alert; stall_alert.install(float(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", install, str(stall_alert_s)],
        env=env,
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"installing the stalled-run automation failed:\n{done.stderr[-3000:]}")


def start_worker(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL],
        env=env,
        cwd=REPOSITORY,
        start_new_session=True,
    )


@contextlib.contextmanager
def running(processes: list[subprocess.Popen]):
    """Stops every process (and what it spawned) on leaving: Ctrl-C, `kill`, an error, or one of
    them exiting."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    # Ctrl-C and `kill` both stop the servers, also when started from a background job of a
    # non-interactive shell, which starts it with SIGINT ignored (Python then never raises
    # KeyboardInterrupt).
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except KeyboardInterrupt:
        pass
    finally:
        stop_process_groups(processes)


def wait_any(processes: list[subprocess.Popen]) -> None:
    while all(p.poll() is None for p in processes):
        time.sleep(1)
