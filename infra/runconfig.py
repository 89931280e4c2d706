"""The pipeline's run configuration: a YAML recipe validated by pydantic, `--set key=value`
overrides, and a fingerprint of the resolved config that names the run directory
`runs/<run_key>/`."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rloo.cli import (
    FIELD_NAMES,
    PIPELINE_SECTIONS,
    check_recipe_combinations,
    recipe_value,
    unknown_field,
)
from rloo.config_checks import STALL_MARGIN_S

# What the pipeline sets in the recipe it hands to the job (the user sets everything else in
# `training:`).
SET_BY_PIPELINE = {
    "dataset_name": "the prepared train split of data.source",
    "output_dir": "the run directory",
    "report_to": "the pipeline's own tracking (MLflow)",
    "resume_from_checkpoint": "the train stage",
    "dataset_config": "data.config",
    "dataset_train_split": "data.split",
    "dataset_test_split": "the held-out split (evaluation)",
    "dataset_streaming": "the dataset stage",
    "datasets": "data.source (one source per run)",
    "streaming": "the dataset stage",
    "test_split_size": "data.eval_size",
}
# Keys of the earlier pipeline shape and where they live now.
MOVED = {
    "model.name_or_path": "training.model_name_or_path",
    "model.tokenizer": "training.tokenizer_name_or_path",
    "model.peft.enabled": "training.use_peft",
    "model.peft.r": "training.lora_r",
    "model.peft.alpha": "training.lora_alpha",
    "model.peft.dropout": "training.lora_dropout",
    "model.peft.target_modules": "training.lora_target_modules (a list; [all-linear] for all "
    "linear layers)",
    "model.peft.load_in_4bit": "training.load_in_4bit",
    "rewards": "training.reward_funcs",
    "reward_weights": "training.reward_weights",
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataSettings(Strict):
    """Prompts: a Hub id, a save_to_disk folder, or a JSON/JSONL/CSV/Parquet file with a 'prompt'
    column."""

    source: str
    config: str | None = None
    split: str = "train"
    eval_size: int = Field(
        40, ge=0, description="Held-out prompts for evaluation (taken before training)."
    )
    max_train_samples: int | None = Field(None, ge=1)
    seed: int = 0


# The spec's server line, with the weight-transfer backend the trainer speaks (gloo:
# rloo_vllm.engine, found on the job's PYTHONPATH) instead of NCCL.
DEFAULT_GENERATION_COMMAND = [
    "env",
    "VLLM_SERVER_DEV_MODE=1",
    "vllm",
    "serve",
    "{model}",
    "--port",
    "{port}",
    "--weight-transfer-config",
    '{"backend": "gloo"}',
    "--worker-extension-cls",
    "rloo_vllm.engine.WorkerExtension",
    "--logprobs-mode",
    "processed_logprobs",
    "--max-logprobs",
    "-1",
]


class SlurmSettings(Strict):
    """One SLURM allocation: `trainer_nodes` run torchrun (c10d rendezvous on the first), the last
    `generation_nodes` run the generation server."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    trainer_nodes: int = Field(4, ge=1)
    generation_nodes: int = Field(1, ge=0, le=1)
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int | None = Field(None, ge=1)
    constraint: str | None = Field(
        None, description="Default with features: [trainer*N&generation*1]."
    )
    use_node_features: bool = Field(
        True, description="Place roles with the Features 'trainer' / 'generation'."
    )
    extra_sbatch: dict[str, str] = Field(default_factory=dict, description="Forced #SBATCH flags.")
    setup: list[str] = Field(
        default_factory=list, description="Shell lines before the job (modules, venv)."
    )
    signal_delay_s: int = Field(
        90, ge=1, description="Pre-termination signal this long before the time limit."
    )
    max_num_timeout: int = Field(3, ge=0, description="Requeues after a time-out.")
    rendezvous_port: int = Field(29500, ge=1024, le=65535)
    generation_port: int = Field(8000, ge=1024, le=65535)
    generation_command: list[str] = Field(
        default_factory=lambda: list(DEFAULT_GENERATION_COMMAND),
        description="Command of the generation role ({model}, {port}, {host} substituted).",
    )
    generation_health_path: str = "/health"
    generation_timeout_s: float = Field(
        240.0, gt=0, description="Wait for the server's health (vllm_server_timeout)."
    )
    collective_timeout_s: int | None = Field(
        None,
        ge=10,
        description="How long a collective waits for the other ranks (ddp_timeout): "
        "a crashed rank fails the job after this at most. None: the recipe's stall_timeout_s + "
        "300 s (2400 s without the watchdog); above stall_timeout_s, so the stall watchdog reports "
        "a frozen rank first.",
    )


class LaunchSettings(Strict):
    """Where training runs: 'local' (submitit local executor + torchrun) or 'slurm'."""

    executor: Literal["local", "slurm"] = "local"
    nproc_per_node: int = Field(1, ge=1)
    timeout_min: int = Field(120, ge=1)
    poll_seconds: float = Field(2.0, gt=0)
    slurm: SlurmSettings = SlurmSettings()


class EvalSettings(Strict):
    """Held-out evaluation of the trained policy against the base model."""

    enabled: bool = True
    max_completion_length: int | None = Field(
        None, ge=1, description="Default: training's max_completion_length."
    )
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling (temperature > 0).")
    top_k: int = Field(0, ge=0, description="Top-k sampling (temperature > 0); 0 = off.")
    repetition_penalty: float = Field(1.0, gt=0.0, description="1.0 = none.")
    batch_size: int = Field(16, ge=1)
    checkpoint_interval: int = Field(
        1,
        ge=0,
        description="Score every k-th saved checkpoint on the held-out sets too (1 = "
        "all, 0 = none; the final model always): MLflow ranks them, promotion picks the best.",
    )
    extra_sets: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "More held-out sets, name -> a JSON/JSONL/CSV/Parquet file of prompts kept out of "
            "training (e.g. phrased unlike them): scored like the held-out prompts and reported "
            "beside them."
        ),
    )

    @field_validator("extra_sets")
    @classmethod
    def _set_names(cls, sets: dict[str, str]) -> dict[str, str]:
        for name in sets:
            if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name == "held_out":
                raise ValueError(
                    f"extra set name {name!r}: use lowercase letters, digits and _ (not "
                    "'held_out', the name of data.eval_size's prompts)."
                )
        return sets


class TrackingSettings(Strict):
    """MLflow: default a SQLite store under the run root (the embedded default)."""

    tracking_uri: str | None = None
    experiment: str = "rloo"
    log_weights_max_mb: float = Field(
        2048,
        ge=0,
        description="A checkpoint's weights up to this size are copied into MLflow "
        "(its LoggedModel loads with mlflow.transformers); larger ones are referenced by their "
        "folder. A LoRA adapter is a few MB.",
    )


class PromotionSettings(Strict):
    """`rloo-pipeline promote`: register the trained policy in MLflow, gate it on held-out evidence
    against the current champion, ask for approval, publish it to the Hub. Not part of the run's
    identity (fingerprint)."""

    model_name: str | None = Field(
        None,
        description="MLflow registered model (letters, digits, '.', '_', '-'); "
        "default rloo-<name>.",
    )
    metric: str = Field("reward", description="The held-out metric the gain is measured on.")
    min_gain: float = Field(
        0.0, description="Candidate minus reference on `metric` must be at least this."
    )
    max_regression: dict[str, float] = Field(
        default_factory=dict, description="metric -> the largest drop allowed versus the reference."
    )
    min_prompts: int = Field(20, ge=1, description="Fewest held-out prompts a verdict may rest on.")
    require_approval: bool | None = Field(
        None,
        description="Pause for a person's approval before publishing. "
        "Default: yes with a Prefect server (PREFECT_API_URL), no embedded.",
    )
    approval_timeout_s: int = Field(
        7 * 24 * 3600, ge=60, description="How long the flow waits for the answer."
    )
    hub_repo: str | None = Field(
        None, description="<user or org>/<name> on the Hub; required to publish."
    )
    private: bool = Field(True, description="Create the Hub repository private.")
    publish: Literal["adapter", "merged"] = Field(
        "adapter",
        description="A LoRA run: its adapter, or the base model with the adapter merged in.",
    )

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}", value):
            raise ValueError(
                f"{value!r} is not a valid MLflow registered-model name: use letters, digits, '.', "
                "'_' and '-' (no '/', ':' or spaces), e.g. rloo-arithmetic."
            )
        return value

    @field_validator("hub_repo")
    @classmethod
    def _hub_repo(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", value):
            raise ValueError(
                f"{value!r} is not a Hub repository id: use <user or org>/<name>, e.g. "
                "acme/rloo-tiny."
            )
        return value

    def approval_required(self) -> bool:
        return (
            bool(os.environ.get("PREFECT_API_URL"))
            if self.require_approval is None
            else self.require_approval
        )


class SearchDimension(Strict):
    """One dimension of a sweep's search space."""

    type: Literal["log_uniform", "uniform", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    step: float | None = Field(None, gt=0, description="int (and uniform): the grid's step.")
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _bounds(self) -> "SearchDimension":
        if self.type == "categorical":
            if not self.choices or self.low is not None or self.high is not None:
                raise ValueError(
                    "categorical takes `choices: [a, b, ...]` (at least one), no low/high."
                )
            if len({json.dumps(choice, sort_keys=True) for choice in self.choices}) < len(
                self.choices
            ):
                raise ValueError(f"categorical choices {self.choices} repeat a value.")
            if len(
                {type(choice).__name__ for choice in self.choices if choice is not None}
            ) > 1 and not all(
                isinstance(choice, (int, float)) and not isinstance(choice, bool)
                for choice in self.choices
            ):
                raise ValueError(
                    f"categorical choices {self.choices} mix types; give one key "
                    "values of one type."
                )
            return self
        if self.choices is not None or self.low is None or self.high is None:
            raise ValueError(f"{self.type} takes `low` and `high` (no choices).")
        if not self.low < self.high:
            raise ValueError(
                f"empty or inverted range low={self.low} high={self.high}: low must be below high."
            )
        if self.type == "log_uniform" and self.low <= 0:
            raise ValueError(
                f"log_uniform needs low > 0 (got {self.low}); use uniform for a range from 0."
            )
        if self.type == "int" and not (
            float(self.low).is_integer()
            and float(self.high).is_integer()
            and float(self.step or 1).is_integer()
        ):
            raise ValueError(
                f"int takes whole low, high and step (got {self.low}, {self.high}, {self.step})."
            )
        return self

    def bounds(self) -> list[Any]:
        """The values a trial may get at the edges (every choice of a categorical): what validation
        tries in the config before any trial starts."""
        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int":
            return [int(self.low), int(self.high)]
        return [self.low, self.high]


class PrunerSettings(Strict):
    """Stopping a losing trial from its intermediate held-out evaluations (every saved
    checkpoint's)."""

    kind: Literal["median", "successive_halving", "none"] = "median"
    n_startup_trials: int = Field(
        2, ge=0, description="median: no pruning before this many trials finished."
    )
    n_warmup_steps: int = Field(
        0, ge=0, description="median: no pruning of a trial before this step."
    )
    min_resource: int | None = Field(
        None,
        ge=1,
        description="successive_halving: checkpoints before the first rung (default: "
        "Optuna's estimate).",
    )
    reduction_factor: int = Field(3, ge=2, description="successive_halving: 1/rf promoted.")


class SweepSettings(Strict):
    """`rloo-pipeline sweep`: trials of this config with keys drawn from `space`, run in
    parallel, pruned from their checkpoints' held-out evaluations, ranked by `objective`. Not part
    of a run's identity: each trial is a run of its own."""

    name: str | None = Field(
        None,
        pattern=r"^[a-z0-9][a-z0-9-]*$",
        description="The study's name; default the config's name.",
    )
    space: dict[str, SearchDimension] = Field(
        min_length=1,
        description="config key (training.learning_rate, evaluation.temperature, "
        "...) -> {type: log_uniform|uniform|int|categorical, low, high, step, choices}.",
    )
    n_trials: int = Field(ge=1, description="Trials in the study when the sweep is done.")
    parallel: int = Field(1, ge=1, description="Trials running at once.")
    objective: str = Field(
        "reward",
        description="A metric of the held-out evaluation (reward, reward/<function>, "
        "accuracy/<function>, completion_length, truncated_ratio); never the training reward.",
    )
    objective_set: str = Field(
        "held_out",
        description="Where the objective is measured: held_out (data.eval_size's "
        "prompts) or a name of evaluation.extra_sets.",
    )
    direction: Literal["maximize", "minimize"] = "maximize"
    pruner: PrunerSettings = PrunerSettings()
    seed: int = 0
    enqueue: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Points tried first (e.g. the recipe's own values): "
        "a list of {key: value} over the space's keys.",
    )
    storage: str | None = Field(
        None,
        description="The study's database: default sqlite beside the MLflow store; a "
        "team's PostgreSQL as postgresql://user@host:5432/db (the password from PGPASSWORD or "
        "~/.pgpass, never in the config).",
    )

    @model_validator(mode="after")
    def _shape(self) -> "SweepSettings":
        if self.parallel > self.n_trials:
            raise ValueError(
                f"parallel={self.parallel} is more than n_trials={self.n_trials}: "
                "lower parallel or raise n_trials."
            )
        for key in self.space:
            section = key.split(".")[0]
            if section in ("sweep", "trial", "run_root", "tracking", "promotion", "name"):
                raise ValueError(
                    f"sweep.space.{key}: {section} is not part of a run's result; "
                    "search training, data, launch or evaluation keys."
                )
        for index, point in enumerate(self.enqueue):
            if unknown := sorted(set(point) - set(self.space)):
                raise ValueError(f"sweep.enqueue[{index}]: {unknown} are not keys of sweep.space.")
        return self


class TrialSettings(Strict):
    """Set by `rloo-pipeline sweep` on each trial's config (not written by hand): which study and
    trial it is, and how its checkpoints are judged for pruning."""

    sweep: str
    number: int = Field(ge=0)
    storage: str
    objective: str
    objective_set: str = "held_out"
    direction: Literal["maximize", "minimize"] = "maximize"
    prune: bool = True
    pruner: PrunerSettings = PrunerSettings()


class RunConfig(Strict):
    """A pipeline config. `training:` is exactly an `rloo train` recipe (RLOOConfig fields plus
    ScriptArguments' model / reward / LoRA keys), validated by rloo.cli.parse_recipe; the other
    sections are the pipeline's own."""

    name: str = Field(
        pattern=r"^[a-z0-9][a-z0-9-]*$", description="Lowercase letters, digits and dashes."
    )
    run_root: str = Field(
        default_factory=lambda: os.environ.get("RLOO_RUN_ROOT", "runs"),
        description="Where runs live; default $RLOO_RUN_ROOT or ./runs.",
    )
    data: DataSettings
    training: dict[str, Any] = Field(
        description="An `rloo train` recipe: model_name_or_path ('smollm2', 'tiny', "
        "'tiny-vlm', a path or a Hub id), reward_funcs, LoRA keys, RLOOConfig fields."
    )
    launch: LaunchSettings = LaunchSettings()
    evaluation: EvalSettings = EvalSettings()
    tracking: TrackingSettings = TrackingSettings()
    promotion: PromotionSettings = PromotionSettings()
    sweep: SweepSettings | None = None
    trial: TrialSettings | None = None

    @field_validator("training")
    @classmethod
    def _recipe_keys(cls, training: dict) -> dict:
        for key in training:
            if key in SET_BY_PIPELINE:
                raise ValueError(
                    f"training.{key} is set by the pipeline ({SET_BY_PIPELINE[key]}); remove it."
                )
            if key not in FIELD_NAMES:
                raise ValueError(f"training.{key}: {unknown_field(key)}")
        if not training.get("model_name_or_path"):
            raise ValueError("training.model_name_or_path is required (the recipe's policy).")
        return training

    @model_validator(mode="after")
    def _combinations(self) -> "RunConfig":
        # What depends on the launch (the world size) is checked here; the rest by the recipe's own
        # validation (rloo.cli.parse_recipe, in the model stage and `rloo-pipeline validate`), plus
        # what is cheap to see now.
        check_recipe_combinations(self.training, "training.")
        generations = self.recipe_value("num_generations")
        nodes = self.launch.slurm.trainer_nodes if self.launch.executor == "slurm" else 1
        batch = (
            self.recipe_value("per_device_train_batch_size") * self.launch.nproc_per_node * nodes
        )
        if batch % generations:
            raise ValueError(
                "training.per_device_train_batch_size x launch.nproc_per_node x trainer nodes = "
                f"{batch} is not divisible by training.num_generations = {generations}."
            )
        stall = self.recipe_value("stall_timeout_s")
        collective = self.launch.slurm.collective_timeout_s
        if (
            self.launch.executor == "slurm"
            and stall
            and collective is not None
            and collective < stall + STALL_MARGIN_S
        ):
            raise ValueError(
                f"launch.slurm.collective_timeout_s={collective} must exceed training."
                f"stall_timeout_s={stall:g} by {STALL_MARGIN_S} s or more (the stall watchdog "
                "reports a frozen rank, with every stack, before the collective's timeout ends the "
                f"job without them). Fix: collective_timeout_s >= {int(stall) + STALL_MARGIN_S}, "
                "or a lower training.stall_timeout_s, or leave collective_timeout_s unset."
            )
        return self

    def collective_timeout_s(self) -> int:
        """The trainers' ddp_timeout on the cluster (launch.slurm.collective_timeout_s)."""
        if self.launch.slurm.collective_timeout_s is not None:
            return self.launch.slurm.collective_timeout_s
        stall = self.recipe_value("stall_timeout_s")
        return int(stall) + 300 if stall else 2400

    @property
    def registered_model(self) -> str:
        return self.promotion.model_name or f"rloo-{self.name}"

    def recipe_value(self, name: str):
        """A `training:` field, or its default (defined once, by rloo train's dataclasses)."""
        return recipe_value(self.training, name)

    # ------------------------------------------------------------------ identity
    def fingerprint(self) -> str:
        """Hash of everything that changes the result (not where it is stored or tracked)."""
        payload = self.model_dump(exclude={"run_root", "tracking", "promotion", "sweep", "trial"})
        if self.trial is not None:  # a trial is a run of its own, wherever its study is stored
            payload["trial"] = {"sweep": self.trial.sweep, "number": self.trial.number}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

    @property
    def run_key(self) -> str:
        return f"{self.name}-{self.fingerprint()[:10]}"

    @property
    def run_dir(self) -> str:
        return os.path.abspath(os.path.join(self.run_root, self.run_key))

    @property
    def tracking_uri(self) -> str:
        store = os.path.abspath(os.path.join(self.run_root, "mlflow.db"))
        # RLOO_TRACKING_URI: set by `rloo-pipeline serve` when its MLflow server is the team's
        return (
            self.tracking.tracking_uri
            or os.environ.get("RLOO_TRACKING_URI")
            or f"sqlite:///{store}"
        )


REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shipped_recipes() -> list[str]:
    """The pipeline configs in configs/ (what a deployment's form offers), as paths from the
    repository root."""
    folder = os.path.join(REPOSITORY, "configs")
    return sorted(f"configs/{name}" for name in os.listdir(folder) if name.endswith(".yaml"))


def shipped_sweeps() -> list[str]:
    """The shipped configs with a `sweep:` section (what the sweep deployment's form offers)."""
    found = []
    for path in shipped_recipes():
        with open(os.path.join(REPOSITORY, path)) as handle:
            if (yaml.safe_load(handle) or {}).get("sweep"):
                found.append(path)
    return found


# The form's fields and the config keys they set.
SETTING_KEYS = {
    "model": "training.model_name_or_path",
    "max_steps": "training.max_steps",
    "learning_rate": "training.learning_rate",
    "num_generations": "training.num_generations",
    "max_completion_length": "training.max_completion_length",
    "beta": "training.beta",
    "lora_r": "training.lora_r",
    "executor": "launch.executor",
    "nproc_per_node": "launch.nproc_per_node",
    "trainer_nodes": "launch.slurm.trainer_nodes",
    "generation_nodes": "launch.slurm.generation_nodes",
}


class RunSettings(BaseModel):
    """What people change between runs. Empty: the recipe's value."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(
        None,
        title="Model",
        description="training.model_name_or_path: 'smollm2', 'tiny', "
        "'tiny-vlm', a local path or a Hub id.",
        json_schema_extra={"position": 0},
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="training.max_steps: optimizer steps.",
        json_schema_extra={"position": 1},
    )
    learning_rate: float | None = Field(
        None, gt=0, le=1, description="training.learning_rate.", json_schema_extra={"position": 2}
    )
    num_generations: int | None = Field(
        None,
        ge=2,
        le=256,
        description="training.num_generations: completions per prompt (the leave-one-out group).",
        json_schema_extra={"position": 3},
    )
    max_completion_length: int | None = Field(
        None,
        ge=1,
        le=131_072,
        description="training.max_completion_length (tokens).",
        json_schema_extra={"position": 4},
    )
    beta: float | None = Field(
        None,
        ge=0,
        le=10,
        description="training.beta: KL coefficient (0: no reference model).",
        json_schema_extra={"position": 5},
    )
    lora_r: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="training.lora_r: LoRA rank (with use_peft).",
        json_schema_extra={"position": 6},
    )
    executor: Literal["local", "slurm"] | None = Field(
        None,
        description="launch.executor: this machine or SLURM.",
        json_schema_extra={"position": 7},
    )
    nproc_per_node: int | None = Field(
        None,
        ge=1,
        le=64,
        description="launch.nproc_per_node: trainer processes per node.",
        json_schema_extra={"position": 8},
    )
    trainer_nodes: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="launch.slurm.trainer_nodes.",
        json_schema_extra={"position": 9},
    )
    generation_nodes: int | None = Field(
        None,
        ge=0,
        le=1,
        description="launch.slurm.generation_nodes (a vLLM server node).",
        json_schema_extra={"position": 10},
    )

    def assignments(self, current: "RunConfig") -> list[str]:
        """The fields set to something other than `current`'s value, as `key=value` overrides (a
        form prefilled with the recipe's values changes nothing, not even the run's fingerprint)."""
        found = []
        for name, value in self.model_dump().items():
            section, _, rest = SETTING_KEYS[name].partition(".")
            if section == "training":
                now = current.recipe_value(rest)
            else:
                now = current.launch
                for part in rest.split("."):
                    now = getattr(now, part)
            if value is not None and value != now:
                found.append(f"{SETTING_KEYS[name]}={json.dumps(value)}")
        return found


class ConfigError(ValueError):
    """A recipe problem, named by key; raised before any stage runs."""


def apply_override(data: dict, assignment: str) -> None:
    """'training.learning_rate=1e-5' -> data['training']['learning_rate'] = 1e-5 (value parsed as
    YAML)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected key=value, e.g. training.max_steps=10.")
    key, _, raw = assignment.partition("=")
    value = yaml.safe_load(raw) if raw else None
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: '{part}' is not a section.")
        node = child
    node[parts[-1]] = value


def load_run_config(source: str | dict, overrides: list[str] | None = None) -> RunConfig:
    if isinstance(source, dict):
        data = copy.deepcopy(source)
        origin = "config"
    else:
        if not os.path.isfile(source):
            raise ConfigError(f"config {source!r}: no such file.")
        with open(source) as handle:
            try:
                data = yaml.safe_load(handle) or {}
            except yaml.YAMLError as err:
                raise ConfigError(f"config {source!r} is not valid YAML: {err}") from None
        origin = source
        if (
            isinstance(data, dict)
            and "name" not in data
            and set(data) & FIELD_NAMES
            and not set(data) & set(PIPELINE_SECTIONS[1:])
        ):
            raise ConfigError(
                f"{source} is a flat `rloo train` recipe (RLOOConfig/ScriptArguments fields), not "
                f"a pipeline config. Fix: run it with `rloo train --config {source}`; "
                "`rloo-pipeline` takes a config with name/model/data/rewards/training sections "
                "(configs/*.yaml)."
            )
    for assignment in overrides or []:
        apply_override(data, assignment)
    check_moved_keys(data, origin)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        lines = []
        for problem in err.errors():
            where = ".".join(str(part) for part in problem["loc"]) or "(top level)"
            message = problem["msg"]
            if problem["type"] == "extra_forbidden":
                message = "unknown key" + _did_you_mean(problem["loc"])
            lines.append(
                f"  {where}: {message}"
                + (
                    f" (got {problem['input']!r})"
                    if problem["type"] not in ("extra_forbidden", "missing", "value_error")
                    else ""
                )
            )
        raise ConfigError(f"{origin}: invalid run config\n" + "\n".join(lines)) from None


def _did_you_mean(loc: tuple) -> str:
    """'. Did you mean ...?' with the closest keys of the section the unknown key is in."""
    import difflib

    section = RunConfig
    for part in loc[:-1]:
        field = section.model_fields.get(str(part))
        section = field.annotation if field is not None else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return ""
    close = difflib.get_close_matches(str(loc[-1]), list(section.model_fields), n=2)
    return f". Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def check_moved_keys(data: dict, origin: str) -> None:
    """Keys of the earlier config shape get an error that names their new place."""
    if not isinstance(data, dict):
        return
    found = []
    for old, new in MOVED.items():
        node = data
        for part in old.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None or (old in ("rewards", "reward_weights") and old in data):
            found.append(f"  {old}: moved to {new}")
    if isinstance(data.get("model"), dict) and not found:
        found.append(
            "  model: moved into training (model_name_or_path, tokenizer_name_or_path, use_peft, "
            "lora_*)"
        )
    if found:
        raise ConfigError(
            f"{origin}: the model, LoRA and reward settings now live in `training:`, which is an "
            "`rloo "
            "train` recipe:\n" + "\n".join(found)
        )


def resolved_dict(config: RunConfig) -> dict:
    return json.loads(config.model_dump_json())
