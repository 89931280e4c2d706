"""What a sweep shows: its trials ranked by the objective with the keys that differ (the sweep's
summary, `rloo-pipeline compare --sweep`), the parameter importances, a plot of the objective per
trial, all logged to the sweep's MLflow run."""

from __future__ import annotations

import json
import os

from infra import tracking
from infra.evaluation import figure, save_figure
from infra.runconfig import RunConfig
from infra.sweep import count, trial_states

ORDER = {"COMPLETE": 0, "PRUNED": 1, "RUNNING": 2, "FAIL": 3, "WAITING": 4}


def sweep_params(config: RunConfig) -> dict:
    """The sweep's own settings, as the sweep run's params."""
    return {"sweep": json.loads(config.sweep.model_dump_json())}


def ranked(study) -> list[dict]:
    """Every started trial: finished ones by objective (the study's direction), then pruned ones by
    their last reported value, then the rest; each with its values, state and run."""
    maximize = study.direction.name == "MAXIMIZE"
    rows = []
    for trial in study.get_trials(deepcopy=False):
        if trial.state.name == "WAITING":
            continue
        last = (
            trial.intermediate_values[max(trial.intermediate_values)]
            if trial.intermediate_values
            else None
        )
        value = trial.value if trial.state.name == "COMPLETE" else last
        rows.append(
            {
                "number": trial.number,
                "state": trial.state.name,
                "value": value,
                "params": dict(trial.params),
                "run_key": trial.user_attrs.get("rloo.run_key"),
                "checkpoint": trial.user_attrs.get("rloo.checkpoint"),
                "step": trial.user_attrs.get("rloo.step"),
                "pruned_at": trial.user_attrs.get("rloo.pruned_at"),
                "error": trial.user_attrs.get("rloo.error"),
                "intermediate": dict(sorted(trial.intermediate_values.items())),
            }
        )

    def key(row):
        value = row["value"]
        missing = value is None
        return (
            ORDER[row["state"]],
            missing,
            0.0 if missing else (-value if maximize else value),
            row["number"],
        )

    return sorted(rows, key=key)


def differing_keys(rows: list[dict]) -> list[str]:
    """The searched keys whose values are not the same in every trial."""
    keys = sorted({key for row in rows for key in row["params"]})
    return [key for key in keys if len({json.dumps(row["params"].get(key)) for row in rows}) > 1]


def table(rows: list[dict], objective: str) -> tuple[list[str], list[list[str]]]:
    """(header, cells per trial): rank, trial, state, objective, checkpoint, the differing keys,
    run; what trials.md and `compare --sweep` both show."""
    keys = differing_keys(rows)
    header = ["rank", "trial", "state", objective, "checkpoint", *keys, "run"]
    body = []
    for rank, row in enumerate(rows, 1):
        where = row["checkpoint"] or (
            f"pruned at step {row['pruned_at']}" if row["pruned_at"] is not None else "-"
        )
        body.append(
            [
                str(rank),
                str(row["number"]),
                row["state"],
                _show(row["value"]),
                where,
                *(_show(row["params"].get(k)) for k in keys),
                row["run_key"] or "-",
            ]
        )
    return header, body


def render(rows: list[dict], objective: str) -> list[str]:
    """The trials' table in markdown."""
    header, body = table(rows, objective)
    return [
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
        *("| " + " | ".join(cells) + " |" for cells in body),
    ]


def _show(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def importances(study) -> tuple[dict[str, float], str | None]:
    """Optuna's parameter importances over the finished trials ({} and why when there are too few
    or nothing varies)."""
    import optuna

    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if len(complete) < 2:
        return {}, f"{len(complete)} finished trial(s): importances need at least 2"
    try:
        return dict(optuna.importance.get_param_importances(study)), None
    except (RuntimeError, ValueError) as err:
        return {}, str(err)


def plot(rows: list[dict], objective: str, target: str) -> str | None:
    """The objective per trial: finished trials as dots, pruned ones at their last reported value
    (crosses), the best so far as a line."""
    points = [row for row in rows if row["value"] is not None]
    if not points:
        return None

    plt, fig, axis = figure((7, 4))
    for state, marker in (("COMPLETE", "o"), ("PRUNED", "x")):
        chosen = sorted(
            (row for row in points if row["state"] == state), key=lambda row: row["number"]
        )
        if chosen:
            axis.scatter(
                [row["number"] for row in chosen],
                [row["value"] for row in chosen],
                marker=marker,
                label=state.lower(),
            )
    axis.set_xlabel("trial")
    axis.set_ylabel(objective)
    axis.set_title("Sweep: objective per trial (pruned: last reported value)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return save_figure(plt, fig, target)


def write(config: RunConfig, study, run_id: str, folder: str) -> dict:
    """The sweep's report (trials.md, importances.json, objective.png in the sweep folder, logged to
    its MLflow run with the best value as a metric); returns it with a one-line summary."""

    objective = f"{config.sweep.objective_set} {config.sweep.objective}"
    rows = ranked(study)
    found, why = importances(study)
    figure_path = plot(rows, objective, os.path.join(folder, "objective.png"))
    lines = [
        f"# Sweep {study.study_name}",
        "",
        f"Objective: {objective} ({config.sweep.direction}); trials: "
        f"{', '.join(f'{n} {s}' for s, n in count(trial_states(study)).items())}.",
        "",
        *render(rows, objective),
        "",
        "## Parameter importances",
        "",
    ]
    lines += [f"- {key}: {value:.3f}" for key, value in found.items()] or [f"- none: {why}"]
    with open(os.path.join(folder, "trials.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    with open(os.path.join(folder, "importances.json"), "w") as handle:
        json.dump({"importances": found, "note": why}, handle, indent=2)
    uri = config.tracking_uri
    for path in (
        os.path.join(folder, "trials.md"),
        os.path.join(folder, "importances.json"),
        figure_path,
    ):
        if path:
            tracking.client(uri).log_artifact(run_id, path, "sweep")
    complete = [row for row in rows if row["state"] == "COMPLETE"]
    if complete:
        tracking.log_metrics(uri, run_id, {"best_objective": complete[0]["value"]}, step=len(rows))
    best = (
        f"best: trial {complete[0]['number']} {objective} {complete[0]['value']:.4g} "
        f"({complete[0]['checkpoint']} of {complete[0]['run_key']})"
        if complete
        else "no finished trial yet"
    )
    return {
        "summary": f"{len(rows)} trials; {best}; report {os.path.join(folder, 'trials.md')}",
        "trials": rows,
        "importances": found,
        "plot": figure_path,
    }
