"""The embedded default's Prefect API for `rloo-pipeline`: its environment (the database under the run root), the
ephemeral API started in the background while the CLI validates, and reading the run root early from the YAML."""

from __future__ import annotations

import os
import threading

DEFAULT_ROOT = "runs"


def prefect_environment(run_root: str) -> None:
    """Embedded default: an ephemeral Prefect API whose database lives under the run root (so `rloo-pipeline ui`
    shows the same runs). Set before prefect is imported; an explicit PREFECT_API_URL wins."""
    os.environ.setdefault("PREFECT_HOME", os.path.abspath(os.path.join(run_root, ".prefect")))
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


class EphemeralApi:
    """The embedded default's ephemeral Prefect API, started in the background while the CLI finishes its checks and
    imports (the start takes 7 s, 16 s on a new database); the flow finds it running: Prefect keeps one per process.
    Nothing is started when PREFECT_API_URL names a server. The starting thread is not a daemon: when a check fails
    after it began, the interpreter waits for it at exit (its start may be migrating the database, which must not be
    cut short) before Prefect's own exit handler stops the server."""

    def __init__(self):
        self.thread: threading.Thread | None = None

    def start(self, run_root: str) -> None:
        """Start it for this run root (once: a second call does nothing)."""
        if self.thread is not None:
            return
        prefect_environment(run_root)
        from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED
        if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
            return
        from prefect.server.api.server import SubprocessASGIServer

        def start() -> None:
            try:
                SubprocessASGIServer().start()
            except Exception:  # noqa: BLE001 - the flow's own start raises it again, in the usual place
                pass
        self.thread = threading.Thread(target=start, name="prefect-ephemeral-start")
        self.thread.start()

    def wait_ready(self) -> None:
        """Before the flow starts."""
        if self.thread is not None:
            self.thread.join()


def known_run_root(config_path: str, assignments: list[str]) -> str | None:
    """The run root a config names (its `run_root`, a `--set run_root=...`, RLOO_RUN_ROOT or the default) when that
    root's Prefect database exists already, read from the YAML alone: no validation, no heavy import. Then the API
    can start while the config is validated; on a first run nothing is created before the config is valid."""
    import yaml
    try:
        with open(config_path) as handle:
            data = yaml.safe_load(handle)
        root = data.get("run_root") if isinstance(data, dict) else None
        for assignment in assignments:
            key, _, value = assignment.partition("=")
            if key.strip() == "run_root":
                root = yaml.safe_load(value)
    except (OSError, yaml.YAMLError):
        return None
    root = root if isinstance(root, str) else os.environ.get("RLOO_RUN_ROOT", DEFAULT_ROOT)
    home = os.environ.get("PREFECT_HOME", os.path.join(os.path.abspath(root), ".prefect"))
    return root if os.path.exists(os.path.join(home, "prefect.db")) else None
