"""The databases a team shares: MLflow's backend store, the Prefect server's database and the
sweeps' Optuna studies, each on PostgreSQL when a URL is given (`postgresql://user@host:port/db`),
else the embedded SQLite files under the run root. A URL never carries a password: libpq's
PGPASSWORD or ~/.pgpass supply it (psycopg and asyncpg both read them), so configs, logs and MLflow
params stay free of it."""

from __future__ import annotations

import os
import re

from infra.runconfig import ConfigError

# What a service's URL is read from when its option is not given.
ENVIRONMENT = {"mlflow": "RLOO_MLFLOW_DB", "prefect": "RLOO_PREFECT_DB", "sweep": "RLOO_SWEEP_DB"}
DRIVERS = {"mlflow": "psycopg", "sweep": "psycopg", "prefect": "asyncpg"}


def check(url: str, where: str) -> str:
    """A PostgreSQL URL without a password, or a SQLite one; else a ConfigError naming `where`."""
    if re.match(r"^[a-z0-9+]+://[^/@]*:[^/@]*@", url):
        raise ConfigError(
            f"{where} has a password in it: remove it and set PGPASSWORD or "
            "~/.pgpass (URLs are logged; secrets never are)."
        )
    if not re.match(r"^(sqlite|postgresql|postgres)(\+\w+)?://", url):
        raise ConfigError(
            f"{where}: {url!r}: use postgresql://user@host:port/database (or sqlite:///path)."
        )
    return url


def sqlalchemy_url(url: str, service: str) -> str:
    """postgresql://... with the driver the service uses (psycopg 3 for MLflow and Optuna, asyncpg
    for the Prefect server); SQLite URLs as they are."""
    match = re.match(r"^(postgresql|postgres)(\+\w+)?://(.*)$", url)
    if match is None:
        return url
    return f"postgresql+{DRIVERS[service]}://{match.group(3)}"


def configured(service: str, given: str | None = None) -> str | None:
    """The service's PostgreSQL URL from its option or environment variable (checked), or None
    for the embedded default."""
    url = given or os.environ.get(ENVIRONMENT[service]) or None
    return check(url, f"the {service} database ({ENVIRONMENT[service]})") if url else None
