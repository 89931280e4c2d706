"""Sweeps: an Optuna study over a pipeline config's keys. Each trial is a pipeline run of its own
(its own name, fingerprint and run directory); its checkpoints' held-out evaluations are reported
to the study while it trains, and a trial the pruner gives up on has its training job stopped.

The study lives in a database: by default a SQLite file beside the MLflow store (one machine, one
orchestrator process writing), or the team's PostgreSQL (`sweep.storage`)."""

from __future__ import annotations

import functools
import json
import math
import os

from infra import databases, stages, tracking
from infra.checkpoints import best, training_checkpoints
from infra.evaluation import held_out_rows, score_sets
from infra.runconfig import ConfigError, PrunerSettings, RunConfig, load_run_config, resolved_dict
from infra.stages import extra_set_rows, validate_recipe
from rloo.cli import resolve_reward, reward_entries
from rloo.rewards.runner import reward_function_name

# Trial states as the study keeps them (optuna.trial.TrialState names).
FINISHED = ("COMPLETE", "PRUNED", "FAIL")
SCORES = "trial_scores.jsonl"  # train/: one line per checkpoint judged for pruning


# ------------------------------------------------------------------------------ names and places
def study_name(config: RunConfig) -> str:
    return config.sweep.name or config.name


def sweep_dir(run_root: str, name: str) -> str:
    return os.path.abspath(os.path.join(run_root, "sweeps", name))


def storage_url(config: RunConfig) -> str:
    """The study's database: sweep.storage (or RLOO_SWEEP_DB), else a SQLite file beside the
    MLflow store."""

    url = config.sweep.storage or databases.configured("sweep")
    if url:
        return databases.sqlalchemy_url(url, "sweep")
    return "sqlite:///" + os.path.abspath(os.path.join(config.run_root, "sweeps.db"))


def trial_name(config: RunConfig, number: int) -> str:
    return f"{study_name(config)}-t{number}"


# ------------------------------------------------------------------------------------ validation
def metric_names(config: RunConfig) -> list[str]:
    """What the held-out evaluation measures for this config's reward functions (accuracy/<name>
    where the reward turns out 0/1)."""

    names = []
    for entry in reward_entries(config.training):
        found = resolve_reward(entry)
        names.append(
            found.rstrip("/").split("/")[-1]
            if isinstance(found, str)
            else reward_function_name(found)
        )
    return [
        "reward",
        *(f"reward/{n}" for n in names),
        *(f"accuracy/{n}" for n in names),
        "completion_length",
        "truncated_ratio",
    ]


def check_sweep(config: RunConfig) -> None:
    """Every problem of the sweep section, before any trial starts: the objective (a metric the
    held-out evaluation produces, on a set it scores), pruning's need for checkpoints, and every
    value a trial can get (each edge of a range, each choice, each enqueued point) applied to the
    config and validated as a run of its own would be."""

    sweep = config.sweep
    if sweep is None:
        raise ConfigError(
            "the config has no `sweep:` section (space, n_trials, objective, ...); "
            "see configs/sweep-tiny.yaml."
        )
    if not config.evaluation.enabled:
        raise ConfigError("sweep.objective is a held-out metric: evaluation.enabled must be true.")
    sets = config.evaluation.extra_sets
    if sweep.objective_set != "held_out" and sweep.objective_set not in sets:
        raise ConfigError(
            f"sweep.objective_set: {sweep.objective_set!r} is not evaluated. Fix: held_out or one "
            f"of evaluation.extra_sets ({', '.join(config.evaluation.extra_sets) or 'none'})."
        )
    if sweep.objective not in (known := metric_names(config)):
        raise ConfigError(
            f"sweep.objective: {sweep.objective!r} is not a metric of the held-out evaluation. "
            f"Fix: one of {', '.join(known)} (the training reward is never an objective)."
        )
    if sweep.pruner.kind != "none" and (
        config.recipe_value("save_strategy") != "steps"
        or config.evaluation.checkpoint_interval == 0
    ):
        raise ConfigError(
            "sweep.pruner: pruning judges the checkpoints saved during training. Fix: set "
            "training.save_strategy: steps with save_steps, and evaluation.checkpoint_interval >= "
            "1; or sweep.pruner.kind: none."
        )
    if len(sweep.enqueue) > sweep.n_trials:
        raise ConfigError(
            f"sweep.enqueue has {len(sweep.enqueue)} points for n_trials={sweep.n_trials}."
        )
    if sweep.storage:
        databases.check(sweep.storage, "sweep.storage")
    tried = [
        (f"sweep.space.{key}", {key: value})
        for key, dimension in sweep.space.items()
        for value in dimension.bounds()
    ]
    tried += [(f"sweep.enqueue[{index}]", point) for index, point in enumerate(sweep.enqueue)]
    for where, point in tried:
        try:
            validate_recipe(trial_config(config, 0, point))
        except Exception as err:
            shown = ", ".join(f"{key}={value!r}" for key, value in point.items())
            raise ConfigError(f"{where}: a trial with {shown} is not a valid run:\n{err}") from None


# ----------------------------------------------------------------------------------------- trials
def trial_overrides(config: RunConfig, number: int, params: dict) -> list[str]:
    """The `--set` assignments that make trial `number` of the sweep config: its own name (so its
    own run directory), the study it reports to, the registered model every trial promotes into,
    and its sampled values."""
    trial = {
        "sweep": study_name(config),
        "number": number,
        "storage": storage_url(config),
        "objective": config.sweep.objective,
        "objective_set": config.sweep.objective_set,
        "direction": config.sweep.direction,
        "prune": config.sweep.pruner.kind != "none",
        "pruner": config.sweep.pruner.model_dump(),
    }
    return [
        "sweep=null",
        f"name={trial_name(config, number)}",
        f"trial={json.dumps(trial)}",
        f"promotion.model_name={config.registered_model}",
        *(f"{key}={json.dumps(value)}" for key, value in sorted(params.items())),
    ]


def trial_config(config: RunConfig, number: int, params: dict) -> RunConfig:
    return load_run_config(resolved_dict(config), trial_overrides(config, number, params))


def distributions(config: RunConfig) -> dict:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    found = {}
    for key, d in config.sweep.space.items():
        if d.type == "categorical":
            found[key] = CategoricalDistribution(d.choices)
        elif d.type == "int":
            found[key] = IntDistribution(int(d.low), int(d.high), step=int(d.step or 1))
        else:
            found[key] = FloatDistribution(
                d.low,
                d.high,
                log=d.type == "log_uniform",
                step=d.step if d.type == "uniform" else None,
            )
    return found


def make_pruner(settings: PrunerSettings):
    import optuna

    if settings.kind == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=settings.n_startup_trials, n_warmup_steps=settings.n_warmup_steps
        )
    if settings.kind == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=settings.min_resource or "auto", reduction_factor=settings.reduction_factor
        )
    return optuna.pruners.NopPruner()


def quiet_optuna() -> None:
    """Optuna's per-trial INFO lines would repeat what the sweep says (and its storage warns about
    SQLite in parallel, which is one writer process here)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


@functools.lru_cache(maxsize=None)
def _storage(url: str):
    import optuna

    return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))


def open_study(config: RunConfig):
    """The sweep's study (created with its enqueued points the first time)."""
    import optuna

    quiet_optuna()
    name, url = study_name(config), storage_url(config)
    storage = _storage(url)
    try:
        existing = optuna.load_study(
            study_name=name,
            storage=storage,
            pruner=make_pruner(config.sweep.pruner),
            sampler=optuna.samplers.TPESampler(seed=config.sweep.seed),
        )
    except KeyError:  # not there yet
        existing = None
    if existing is not None:
        if existing.direction.name.lower() != config.sweep.direction:
            raise ConfigError(
                f"sweep {name!r} exists in {url} with direction "
                f"{existing.direction.name.lower()}; this config says {config.sweep.direction}. "
                "Fix: keep the direction, or name a new sweep (sweep.name)."
            )
        return existing
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        direction=config.sweep.direction,
        pruner=make_pruner(config.sweep.pruner),
        sampler=optuna.samplers.TPESampler(seed=config.sweep.seed),
    )
    study.set_user_attr("rloo.storage", url)
    study.set_user_attr(
        "rloo.space", {k: v.model_dump(exclude_none=True) for k, v in config.sweep.space.items()}
    )
    study.set_user_attr("rloo.objective", f"{config.sweep.objective_set}/{config.sweep.objective}")
    for point in config.sweep.enqueue:
        study.enqueue_trial(point)  # once, when the study is made
    return study


def _engine_kwargs(url: str) -> dict:
    # SQLite: the orchestrator's threads share one file; wait for a lock instead of failing
    return {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}


def _trial(study, number: int):
    """Trial `number` of the study as an optuna.trial.Trial (to report to, tag, ask)."""
    import optuna

    storage = _storage(study_storage_url(study))
    trial_id = storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(study.study_name), number
    )
    return optuna.trial.Trial(study, trial_id)


def study_storage_url(study) -> str:
    return study.user_attrs["rloo.storage"]


def trial_states(study) -> dict[int, str]:
    """{number: COMPLETE | PRUNED | FAIL | RUNNING} of the trials started (enqueued points not yet
    started are WAITING and not counted)."""
    return {
        t.number: t.state.name
        for t in study.get_trials(deepcopy=False)
        if t.state.name != "WAITING"
    }


def count(states: dict[int, str]) -> dict[str, int]:
    import collections

    return dict(collections.Counter(states.values()))


def ask(study, config: RunConfig):
    """A new trial (an enqueued point first), its values drawn from the search space."""
    return study.ask(distributions(config))


def resume(study, number: int):
    """An interrupted trial (RUNNING in the study, its orchestrator gone): the same number and
    values, so the same run directory and its checkpoints."""
    return next(t for t in study.get_trials(deepcopy=False) if t.number == number)


MAX_ATTEMPTS = 2  # a trial failing this often is FAIL (not resumed forever)


def record_failure(study, number: int, err: BaseException) -> None:
    """A trial's pipeline raised: it stays RUNNING (the next sweep resumes it from its checkpoint)
    unless it failed MAX_ATTEMPTS times or its values make an invalid run (a combination the
    per-key checks could not see), then it is FAIL with the error kept."""
    from optuna.trial import TrialState

    trial = _trial(study, number)
    attempts = int(resume(study, number).user_attrs.get("rloo.failures", 0)) + 1
    trial.set_user_attr("rloo.failures", attempts)
    trial.set_user_attr("rloo.error", f"{type(err).__name__}: {str(err)[:500]}")
    if attempts >= MAX_ATTEMPTS or isinstance(err, ConfigError):
        study.tell(number, state=TrialState.FAIL)


def finish(study, config: RunConfig, number: int, params: dict, summary: dict) -> str:
    """Tell the study how trial `number` ended (PRUNED, or COMPLETE with its objective), keep its
    run on the trial and its state and objective on its MLflow run; a line saying so."""
    from optuna.trial import TrialState

    trial_cfg = trial_config(config, number, params)
    trial = _trial(study, number)
    trial.set_user_attr("rloo.run_key", trial_cfg.run_key)
    trial.set_user_attr("rloo.run_dir", trial_cfg.run_dir)
    trial.set_user_attr("rloo.mlflow_run_id", summary.get("mlflow_run_id"))
    pruned = (summary.get("train") or {}).get("pruned")
    run_id, uri = summary.get("mlflow_run_id"), config.tracking_uri
    if pruned:
        trial.set_user_attr("rloo.pruned_at", pruned["step"])
        study.tell(number, state=TrialState.PRUNED)
        if run_id:
            tracking.tag_run(uri, run_id, {"rloo.trial_state": "PRUNED"})
        return (
            f"pruned at {pruned['name']} ({config.sweep.objective} {pruned['value']:.4g}); "
            f"{trial_cfg.run_key}"
        )
    value, row = objective_value(trial_cfg, summary)
    if value is None:
        trial.set_user_attr("rloo.error", f"{config.sweep.objective} was not measured")
        study.tell(number, state=TrialState.FAIL)
        if run_id:
            tracking.tag_run(uri, run_id, {"rloo.trial_state": "FAIL"})
        return f"failed: no {config.sweep.objective} in its evaluation; {trial_cfg.run_key}"
    trial.set_user_attr("rloo.checkpoint", row["name"])
    trial.set_user_attr("rloo.step", row["step"])
    study.tell(number, value)
    if run_id:
        tracking.tag_run(
            uri, run_id, {"rloo.trial_state": "COMPLETE", "rloo.trial_checkpoint": row["name"]}
        )
        tracking.log_metrics(uri, run_id, {"objective": value}, step=row["step"])
    return (
        f"complete: {config.sweep.objective_set} {config.sweep.objective} {value:.4g} "
        f"({row['name']}); {trial_cfg.run_key}"
    )


def load_trial(settings) -> tuple:
    """(study, optuna.trial.Trial) of a trial's config (`trial:`), to report to and ask."""
    import optuna

    quiet_optuna()
    storage = _storage(settings.storage)
    study = optuna.load_study(
        study_name=settings.sweep, storage=storage, pruner=make_pruner(settings.pruner)
    )
    study_id = storage.get_study_id_from_name(settings.sweep)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, settings.number)
    return study, optuna.trial.Trial(study, trial_id)


# ---------------------------------------------------------------------------------------- pruning
class PruningJudge:
    """While a trial trains: each newly saved checkpoint (every evaluation.checkpoint_interval-th)
    is scored on the objective's set, the value reported to the study at the checkpoint's step,
    and the pruner asked. What was judged is kept in train/trial_scores.jsonl, so a resumed
    follower judges each checkpoint once."""

    def __init__(self, config: RunConfig, dataset_result: dict, model_result: dict):

        self.config, self.dataset_result, self.model_result = config, dataset_result, model_result
        self.path = stages.stage_path(config, "train", SCORES)
        self.judged = {row["name"]: row for row in _read_jsonl(self.path)}
        self.rows = None

    def _rows(self) -> list[dict]:
        from datasets import load_from_disk

        if self.rows is None:
            name = self.config.trial.objective_set
            if name == "held_out":
                self.rows = held_out_rows(self.dataset_result)
            else:
                training = load_from_disk(self.dataset_result["train_path"])["prompt"]
                self.rows = extra_set_rows(self.config, name, training)
        return self.rows

    def verdict(self) -> dict | None:
        """The judgement that pruned this trial, if one did (also one made before the orchestrator
        was killed: a resumed trial stops there again instead of training on)."""
        return next((row for row in self.judged.values() if row["prune"]), None)

    def pending(self) -> list:
        """Checkpoints saved and complete, due for judging, not judged yet."""

        interval = self.config.evaluation.checkpoint_interval
        saved = training_checkpoints(self.config)
        due = saved[interval - 1 :: interval] if interval else []
        return [c for c in due if c.name not in self.judged and c.exists]

    def judge(self, checkpoint) -> dict:
        """Score one checkpoint, report it; {"name", "step", "value", "prune"}."""

        settings = self.config.trial
        max_steps = self.config.recipe_value("max_steps")
        scored = score_sets(
            self.config,
            self.model_result["policy"],
            self.model_result["tokenizer"],
            {"objective": self._rows()},
            {checkpoint.name: checkpoint.path},
            {checkpoint.name: checkpoint.step},
            max_steps,
        )
        metrics = scored["objective"][checkpoint.name]["metrics"]
        value = metrics.get(settings.objective)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            raise ValueError(
                f"sweep objective {settings.objective!r} was not measured on {checkpoint.name} "
                f"(measured: {', '.join(k for k, v in metrics.items() if v is not None)})."
            )
        study, trial = load_trial(settings)
        trial.report(float(value), checkpoint.step)
        row = {
            "name": checkpoint.name,
            "step": checkpoint.step,
            "value": float(value),
            "prune": bool(trial.should_prune()),
        }
        _append_jsonl(self.path, row)
        self.judged[row["name"]] = row
        return row


def trial_scores(config: RunConfig) -> list[dict]:

    return _read_jsonl(stages.stage_path(config, "train", SCORES))


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _append_jsonl(path: str, row: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")


# -------------------------------------------------------------------------------------- outcomes
def objective_value(config: RunConfig, summary: dict) -> tuple[float | None, dict | None]:
    """A finished trial's value: its best evaluated checkpoint's (the final model included) on the
    objective's set, in the study's direction, which is what `promote --sweep` takes; (value, that
    checkpoint's row of the evaluation's table)."""

    trial = config.trial
    sign = -1.0 if trial.direction == "minimize" else 1.0
    rows = []
    for row in (summary.get("evaluate") or {}).get("checkpoints") or []:
        metrics = (
            row["held_out"]
            if trial.objective_set == "held_out"
            else row["sets"].get(trial.objective_set, {})
        )
        if metrics.get(trial.objective) is not None:  # best() ranks held_out, highest first
            rows.append({**row, "held_out": {trial.objective: sign * metrics[trial.objective]}})
    top = best(rows, trial.objective)
    if top is None:
        return None, None
    return sign * top["held_out"][trial.objective], top
