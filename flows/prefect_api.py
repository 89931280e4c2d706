"""The embedded default's Prefect API for `rloo-pipeline`: its environment (the database under the
run root), the ephemeral API started in the background while the CLI validates, a new run root's
database copied from a template (migrating a new one takes seconds), and reading the run root early
from the YAML."""

from __future__ import annotations

import os
import sqlite3
import threading
from contextlib import closing

from rloo.process import cache_root

DEFAULT_ROOT = "runs"


def prefect_environment(run_root: str) -> None:
    """Embedded default: an ephemeral Prefect API whose database lives under the run root (so
    `rloo-pipeline ui` shows the same runs). Set before prefect is imported; an explicit
    PREFECT_API_URL wins."""
    os.environ.setdefault("PREFECT_HOME", os.path.abspath(os.path.join(run_root, ".prefect")))
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


class EphemeralApi:
    """The embedded default's ephemeral Prefect API, started in the background while the CLI
    finishes its checks and imports (the start takes 4-5 s, 10 s migrating a new database, 6 s on a
    copy of the template); the flow finds it running: Prefect keeps one per process. Nothing is
    started when PREFECT_API_URL names a server. The starting thread is not a daemon: when a check
    fails after it began, the interpreter waits for it at exit (its start may be migrating the
    database, which must not be cut short) before Prefect's own exit handler stops the server."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        # this start migrates a new database (no template yet): it becomes the template
        self.fresh = False
        self.started = False

    def start(self, run_root: str) -> None:
        """Start it for this run root (once: a second call does nothing)."""
        if self.thread is not None:
            return
        prefect_environment(run_root)
        from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

        if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
            return
        from prefect.server.api.server import SubprocessASGIServer

        database = local_database()
        self.fresh = (
            database is not None and not os.path.exists(database) and not seed_database(database)
        )

        def start() -> None:
            try:
                SubprocessASGIServer().start()
                self.started = True
            # (the flow's own start raises it again, in the usual place)
            except Exception:  # noqa: BLE001
                pass

        self.thread = threading.Thread(target=start, name="prefect-ephemeral-start")
        self.thread.start()

    def wait_ready(self) -> None:
        """Before the flow starts."""
        if self.thread is not None:
            self.thread.join()
            if self.fresh and self.started:
                save_template(local_database())
                self.fresh = False


def local_database() -> str | None:
    """The SQLite file of the Prefect database the ephemeral API uses (None: another database is
    configured)."""
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    url = PREFECT_API_DATABASE_CONNECTION_URL.value() or ""
    prefix = "sqlite+aiosqlite:///"
    return (
        url[len(prefix) :]
        if url.startswith(prefix) and url[len(prefix) :] not in ("", ":memory:")
        else None
    )


def template_path() -> str:
    """Where a just-started, still empty Prefect database of this Prefect version is kept for new
    run roots."""
    from importlib.metadata import version

    # (the installed distribution's version: reading it does not import prefect, which the
    # `ui` and `serve` commands never need in their own process)
    return os.path.join(cache_root(), "prefect-db", f"prefect-{version('prefect')}.db")


# What the API's start writes into a new database (its migrations' version and the block types it
# registers); a database holding anything else (a run, a deployment) is never made the template.
TEMPLATE_TABLES = {"alembic_version", "block_type", "block_schema", "block_schema_reference"}


def seed_database(database: str) -> bool:
    """A new run root's Prefect database as a copy of the template (False: none yet). The API still
    checks it as it starts (its migrations, its block types: both find nothing to do)."""
    template = template_path()
    if not os.path.exists(template):
        return False
    os.makedirs(os.path.dirname(database), exist_ok=True)
    with (
        closing(sqlite3.connect(template)) as source,
        closing(sqlite3.connect(database + ".seeding")) as target,
    ):
        # a consistent copy, written beside the database then renamed into place
        source.backup(target)
    os.replace(database + ".seeding", database)
    return True


def seed_server_database(env: dict[str, str]) -> None:
    """Before a Prefect server starts with `env`: its SQLite file under PREFECT_HOME, when no other
    database is configured and the file does not exist yet, as a copy of the template (migrating an
    empty one takes 10-20 s of CPU)."""
    if env.get("PREFECT_SERVER_DATABASE_CONNECTION_URL") or env.get(
        "PREFECT_API_DATABASE_CONNECTION_URL"
    ):
        return
    database = os.path.join(env["PREFECT_HOME"], "prefect.db")
    if not os.path.exists(database):
        seed_database(database)


def save_template(database: str | None) -> None:
    """Keep a database the API has just migrated and started on, before any flow ran, as the
    template: a consistent snapshot, checked to hold nothing but what the start writes, then renamed
    into place."""
    template = template_path()
    if database is None or not os.path.exists(database) or os.path.exists(template):
        return
    os.makedirs(os.path.dirname(template), exist_ok=True)
    staging = f"{template}.{os.getpid()}"
    try:
        with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as source:
            source.execute("vacuum into ?", (staging,))
        with closing(sqlite3.connect(staging)) as snapshot:
            tables = [
                name
                for (name,) in snapshot.execute(
                    "select name from sqlite_master where type = 'table'"
                )
            ]
            if any(
                snapshot.execute(f'select exists (select 1 from "{name}")').fetchone()[0]
                for name in tables
                if name not in TEMPLATE_TABLES
            ):
                return
        os.replace(staging, template)
    except sqlite3.Error:
        pass  # no template this time: the next new run root migrates its own database again
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def known_run_root(config_path: str, assignments: list[str]) -> str | None:
    """The run root a config names (its `run_root`, a `--set run_root=...`, RLOO_RUN_ROOT or the
    default) when that root's Prefect database exists already, read from the YAML alone: no
    validation, no heavy import. Then the API can start while the config is validated; on a first
    run nothing is created before the config is valid."""
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
