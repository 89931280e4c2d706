"""Every MLflow call of the pipeline's own process: runs (one parent per pipeline run, one nested
run per stage, opened and closed FINISHED / FAILED by `stage_run`), what each stage logs
(`tracked_stage` with the stage's record), params without secrets, dataset inputs, artifacts, the
comparison query, the model registry. The training job's side (its callback and the queue of what
MLflow refused) is infra.job_tracking."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
import warnings
from typing import Any

from rloo.data import load_prompt_dataset
from rloo.hub import is_secret

QUICK_FAIL = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
# What MLflow 3 reads as the experiment's type: untagged, its UI takes it for a GenAI experiment
# (traces) and asks for a type. (3.17's UI also keeps a per-browser view toggle: see TRAINING_VIEW.)
EXPERIMENT_KIND = ("mlflow.experimentKind", "finetuning")


class TrackingUnavailable(RuntimeError):
    pass


def client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def log_to(handler) -> None:
    """MLflow's loggers (which do not propagate) write to `handler` only: their notices stay off the
    console."""
    import logging

    import mlflow  # noqa: F401 (configures its loggers on import; replaced here)

    for name in ("mlflow", "alembic"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False


def check_reachable(tracking_uri: str) -> None:
    """Fail before any compute when the tracking server cannot be used."""
    saved = {name: os.environ.get(name) for name in QUICK_FAIL}
    os.environ.update(QUICK_FAIL)  # one quick attempt, not minutes of retries
    try:
        client(tracking_uri).search_experiments(max_results=1)
    except Exception as err:
        raise TrackingUnavailable(
            f"MLflow at {tracking_uri} is not reachable ({type(err).__name__}: {str(err)[:200]}). "
            "Fix: start it (rloo-pipeline ui starts one on 127.0.0.1) or set "
            "tracking.tracking_uri."
        ) from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def artifact_location(tracking_uri: str) -> str | None:
    """A local SQLite store keeps its artifacts beside the database (MLflow's default is ./mlruns in
    the current directory, i.e. wherever the command was started); a server decides for itself."""
    if tracking_uri.startswith("sqlite:///"):
        database = tracking_uri[len("sqlite:///") :]
        return "file://" + os.path.join(os.path.dirname(os.path.abspath(database)), "mlartifacts")
    return None


def experiment_id(tracking_uri: str, name: str) -> str:
    """The experiment's id, made if there is none, tagged as a fine-tuning experiment (an existing
    one that lacks the tag gets it). Runs started at once (several Run clicks on a fresh store) can
    all find none and all make it: the ones whose making is refused take the one that won."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

    mlflow_client = client(tracking_uri)
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return mlflow_client.create_experiment(
                name,
                artifact_location=artifact_location(tracking_uri),
                tags=dict([EXPERIMENT_KIND]),
            )
        except MlflowException as error:
            experiment = mlflow_client.get_experiment_by_name(name)
            if error.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS) or experiment is None:
                raise
    key, kind = EXPERIMENT_KIND
    if experiment.tags.get(key) != kind:
        mlflow_client.set_experiment_tag(experiment.experiment_id, key, kind)
    return experiment.experiment_id


def flatten(values: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def safe_params(values: dict) -> dict[str, str]:
    """Flattened params with every secret-looking key removed, values cut to MLflow's limit."""
    return {key: str(value)[:6000] for key, value in flatten(values).items() if not is_secret(key)}


def start_run(
    tracking_uri: str,
    experiment: str,
    run_name: str,
    tags: dict[str, str],
    parent_run_id: str | None = None,
) -> str:
    mlflow_client = client(tracking_uri)
    all_tags = dict(tags)
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = mlflow_client.create_run(
        experiment_id(tracking_uri, experiment), run_name=run_name, tags=all_tags
    )
    return run.info.run_id


def log_params(tracking_uri: str, run_id: str, params: dict) -> None:
    from mlflow.entities import Param

    items = [Param(key, value) for key, value in safe_params(params).items()]
    mlflow_client = client(tracking_uri)
    for start in range(0, len(items), 100):
        mlflow_client.log_batch(run_id, params=items[start : start + 100])


def numeric_metrics(logs: dict) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in logs.items()
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    }


def log_metrics(
    tracking_uri: str,
    run_id: str,
    metrics: dict[str, float],
    step: int,
    timestamp_ms: int | None = None,
) -> None:
    """A given timestamp makes a retry idempotent: MLflow keeps one row per (key, timestamp, step,
    value)."""
    from mlflow.entities import Metric

    now = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
    items = [Metric(key, value, now, step) for key, value in metrics.items()]
    mlflow_client = client(tracking_uri)
    for start in range(0, len(items), 200):
        mlflow_client.log_batch(run_id, metrics=items[start : start + 200], synchronous=True)


@dataclasses.dataclass(frozen=True)
class DatasetRef:
    """A dataset as MLflow shows it on a run: the saved rows (`path`: a datasets folder, or a
    JSON/JSONL/CSV/Parquet file), its name, the content digest (equal data, equal digest, in every
    run), where it came from (a file or a Hub id) and the context it is used in."""

    path: str
    name: str
    digest: str
    source: str
    context: str  # "training" | "evaluation"

    @property
    def key(self) -> dict[str, str]:
        """What MLflow's metrics and searches name a dataset by."""
        return {"dataset_name": self.name, "dataset_digest": self.digest}


def log_datasets(tracking_uri: str, run_id: str, refs: list[DatasetRef]) -> None:
    """Every dataset as an input of the run, with its schema and row count (MLflow's profile)."""
    import mlflow

    inputs = []
    for ref in refs:
        rows = load_prompt_dataset(ref.path)  # a saved split's folder or a file
        source = ref.source
        if os.path.exists(source):  # a local file: MLflow's local source, an absolute file URI
            source = "file://" + os.path.abspath(source)
            with warnings.catch_warnings():  # MLflow registers its local source class twice
                warnings.filterwarnings("ignore", message=".*can be interpreted in multiple ways")
                dataset = mlflow.data.from_huggingface(
                    rows, name=ref.name, digest=ref.digest, source=source
                )
        else:  # a Hub id
            dataset = mlflow.data.from_huggingface(
                rows, path=source, name=ref.name, digest=ref.digest
            )
        inputs.append(_dataset_input(dataset, ref.context))
    if inputs:
        client(tracking_uri).log_inputs(run_id, datasets=inputs)


def _dataset_input(dataset, context: str):
    from mlflow.entities import DatasetInput, InputTag

    return DatasetInput(
        dataset=dataset._to_mlflow_entity(),
        tags=[InputTag(key="mlflow.data.context", value=context)],
    )


# ----------------------------------------------------------------------------------------------
# pipeline runs
@dataclasses.dataclass
class StageRecord:
    """What a stage's nested run gets from the stage's result."""

    params: dict = dataclasses.field(default_factory=dict)
    metrics: dict = dataclasses.field(default_factory=dict)
    step: int = 0
    artifacts: list = dataclasses.field(default_factory=list)  # (local path, artifact folder)
    datasets: list = dataclasses.field(default_factory=list)  # DatasetRef
    # (model id, metrics, step, DatasetRef): held-out metrics of a LoggedModel
    model_metrics: list = dataclasses.field(default_factory=list)
    # also on the pipeline's run (what `compare` and the run list show)
    metrics_on_parent: bool = False


@contextlib.contextmanager
def stage_run(
    config,
    parent_run_id: str | None,
    stage: str,
    run_id: str | None = None,
    params: dict | None = None,
):
    """A nested MLflow run for one stage (or the existing `run_id`, when a retried stage
    reattaches), ended FINISHED or FAILED; yields its id, or None when the pipeline has no parent
    run."""
    uri = config.tracking_uri
    if run_id is None:
        if parent_run_id is None:
            yield None
            return
        run_id = start_run(
            uri,
            config.tracking.experiment,
            f"{config.run_key}/{stage}",
            {"rloo.stage": stage, "rloo.run_key": config.run_key},
            parent_run_id=parent_run_id,
        )
        if params:
            log_params(uri, run_id, params)
    try:
        yield run_id
    except BaseException:
        client(uri).set_terminated(run_id, status="FAILED")
        raise
    client(uri).set_terminated(run_id, status="FINISHED")


def tracked_stage(config, parent_run_id: str | None, stage: str, body, record=None) -> dict:
    """Run a stage's body inside its nested run and log `record(result)` (a StageRecord) into it."""
    with stage_run(config, parent_run_id, stage) as run_id:
        result = body()
        if run_id and record is not None:
            log_record(config.tracking_uri, run_id, record(result), parent_run_id)
    return result


def log_record(uri: str, run_id: str, record: StageRecord, parent_run_id: str | None) -> None:
    log_datasets(uri, run_id, record.datasets)
    if record.params:
        log_params(uri, run_id, record.params)
    if record.metrics:
        log_metrics(uri, run_id, record.metrics, record.step)
        if record.metrics_on_parent and parent_run_id:
            log_metrics(uri, parent_run_id, record.metrics, record.step)
    for path, folder in record.artifacts:
        client(uri).log_artifact(run_id, path, folder)
    for model_id, metrics, step, dataset in record.model_metrics:
        log_model_metrics(uri, run_id, model_id, metrics, step, dataset)


def dataset_record(result: dict, datasets: list[DatasetRef]) -> StageRecord:
    return StageRecord(
        params={"source": result["source"], "format": result["format"], "digest": result["digest"]},
        metrics={"num_train": result["num_train"], "num_eval": result["num_eval"]},
        datasets=datasets,
    )


def model_record(result: dict) -> StageRecord:
    return StageRecord(
        params={
            "policy": result["policy"],
            "num_parameters": result["num_parameters"],
            "peft": result["peft"],
        }
    )


def evaluation_record(
    result: dict, step: int, datasets: list[DatasetRef], extra_sets: list[str]
) -> StageRecord:
    """The evaluate run: base vs trained metrics (also on the pipeline's run), the report, the
    datasets it read (the splits, then each of `extra_sets`), and each evaluated checkpoint's
    metrics against its LoggedModel, one dataset at a time."""
    metrics = {
        f"{label}_{key}".replace("/", "_"): value
        for label in ("base", "trained")
        for key, value in result[label].items()
        if value is not None
    }
    if result["reward_gain"] is not None:
        metrics["reward_gain"] = result["reward_gain"]
    # evaluation.extra_sets, beside the held-out set's
    for name, found in result.get("extra_sets", {}).items():
        metrics.update(
            {
                f"{name}_{label}_{key}".replace("/", "_"): value
                for label in ("base", "trained")
                for key, value in found[label].items()
                if value is not None
            }
        )
    plots = [result.get("plot_path"), result.get("timing_plot_path")]
    artifacts = [(result["report_path"], "evaluation")] + [
        (plot, "evaluation") for plot in plots if plot
    ]
    held_out, extra = datasets[1], dict(zip(extra_sets, datasets[2:]))
    model_metrics = []
    for row in result.get("checkpoints", []):
        if row["model_id"]:
            model_metrics.append((row["model_id"], row["held_out"], row["step"], held_out))
            model_metrics += [
                (row["model_id"], row["sets"][name], row["step"], extra[name]) for name in extra
            ]
    return StageRecord(
        metrics=metrics,
        step=step,
        artifacts=artifacts,
        metrics_on_parent=True,
        datasets=datasets,
        model_metrics=model_metrics,
    )


@contextlib.contextmanager
def pipeline_run(config, params: dict, tags: dict[str, str]):
    """The pipeline's parent run (params = the resolved config, secrets dropped), ended FINISHED or
    FAILED; yields (run id, experiment id). A sweep's trial is a child of the sweep's run."""
    uri = config.tracking_uri
    parent = None
    if config.trial is not None:
        parent = sweep_run(uri, config.tracking.experiment, config.trial.sweep)
        tags = {
            **tags,
            "rloo.sweep": config.trial.sweep,
            "rloo.trial": str(config.trial.number),
            "rloo.trial_state": "RUNNING",
        }
    run_id = start_run(
        uri,
        config.tracking.experiment,
        config.run_key,
        {"rloo.run_key": config.run_key, "rloo.fingerprint": config.fingerprint(), **tags},
        parent_run_id=parent,
    )
    log_params(uri, run_id, params)
    try:
        yield run_id, experiment_id(uri, config.tracking.experiment)
    except BaseException:
        client(uri).set_terminated(run_id, status="FAILED")
        raise
    client(uri).set_terminated(run_id, status="FINISHED")


SWEEP_TAGS = {"rloo.kind": "sweep"}


def sweep_run(uri: str, experiment: str, name: str, params: dict | None = None) -> str:
    """The sweep's MLflow run (its trials' pipeline runs are its children), found by its tags or
    created."""
    tags = {**SWEEP_TAGS, "rloo.sweep": name}
    found = client(uri).search_runs(
        [experiment_id(uri, experiment)],
        _tag_filter(tags),
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    if found:
        return found[0].info.run_id
    run_id = start_run(uri, experiment, f"sweep {name}", tags)
    if params:
        log_params(uri, run_id, params)
    return run_id


def pipeline_runs(tracking_uri: str, experiment: str, run_key: str) -> dict:
    """The latest MLflow runs of a pipeline run: {"pipeline": parent, "<stage>": nested run} ({}
    when none)."""
    mlflow_client = client(tracking_uri)
    found = mlflow_client.get_experiment_by_name(experiment)
    if found is None:
        return {}
    runs = mlflow_client.search_runs(
        [found.experiment_id],
        filter_string=f"tags.`rloo.run_key` = '{run_key}'",
        order_by=["attributes.start_time ASC"],
    )
    latest = {}
    for run in runs:  # later runs (a retried stage, a resumed pipeline) win
        latest[run.data.tags.get("rloo.stage", "pipeline")] = run
    return latest


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client(tracking_uri).get_metric_history(run_id, key)]


def ui_base(tracking_uri: str) -> str:
    """The MLflow UI of a tracking URI: the server itself, or `rloo-pipeline ui`'s (RLOO_MLFLOW_UI)
    for a file store."""
    return (
        tracking_uri
        if tracking_uri.startswith("http")
        else os.environ.get("RLOO_MLFLOW_UI", "http://127.0.0.1:5000")
    ).rstrip("/")


# MLflow 3's UI picks its view (GenAI or model training) from a per-browser toggle that starts at
# GenAI; the experiment-kind tag does not override it, this parameter of a link does.
TRAINING_VIEW = "workflowType=machine_learning"


def run_link(tracking_uri: str, experiment: str, run_id: str) -> str:
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment}/runs/{run_id}?{TRAINING_VIEW}"


def models_link(tracking_uri: str, experiment: str) -> str:
    """The experiment's Models tab: every checkpoint's LoggedModel with its held-out metrics."""
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment}/models?{TRAINING_VIEW}"


def compare_link(tracking_uri: str, experiments: list[str], run_ids: list[str]) -> str:
    """MLflow's side-by-side view of these runs."""
    from urllib.parse import quote

    return (
        f"{ui_base(tracking_uri)}/#/compare-runs?runs={quote(json.dumps(run_ids))}"
        f"&experiments={quote(json.dumps(sorted(set(experiments))))}&{TRAINING_VIEW}"
    )


def log_comparison(
    tracking_uri: str, experiment: str, run_keys: list[str], files: list[str]
) -> str:
    """A run of its own (tag rloo.comparison) holding what `rloo-pipeline compare` drew; returns its
    id."""
    run_id = start_run(
        tracking_uri,
        experiment,
        "compare: " + " vs ".join(run_keys),
        {"rloo.comparison": "true", "rloo.compared": ",".join(run_keys)},
    )
    for path in files:
        client(tracking_uri).log_artifact(run_id, path, "comparison")
    client(tracking_uri).set_terminated(run_id, status="FINISHED")
    return run_id


def start_system_metrics(tracking_uri: str, run_id: str, node: str | None):
    """MLflow's system metrics (CPU, memory, disk, network; GPU where present) sampled into the run
    while training goes on, under `system/<node>/` when a node is named; continues a resumed run's
    steps. Returns the monitor for `stop_system_metrics`."""
    import logging

    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    # its start/stop notices are not the job's news (a warning still shows)
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    monitor = SystemMetricsMonitor(
        run_id, resume_logging=True, node_id=node, tracking_uri=tracking_uri
    )
    monitor.start()
    return monitor


def stop_system_metrics(monitor) -> None:
    """Stop sampling; what was sampled since the last logging interval (a short run: everything)
    is sent too."""
    monitor.finish()
    if last := monitor.aggregate_metrics():
        monitor.publish_metrics(last)
        monitor.mlflow_logger.flush()


# ----------------------------------------------------------------------------------------------
# logged models: one per saved checkpoint of a train run (infra.checkpoints decides what and when)
def _tag_filter(tags: dict[str, str]) -> str | None:
    return " AND ".join(f"tags.`{key}` = '{value}'" for key, value in tags.items()) or None


def find_logged_models(uri: str, experiment: str, tags: dict[str, str]) -> list:
    """The experiment's LoggedModels carrying every one of `tags`, oldest first."""
    found = client(uri).search_logged_models(
        [experiment_id(uri, experiment)],
        filter_string=_tag_filter(tags),
        order_by=[{"field_name": "creation_timestamp"}],
    )
    return list(found)


def create_logged_model(
    uri: str, experiment: str, name: str, run_id: str, tags: dict[str, str], params: dict
) -> str:
    """A PENDING LoggedModel of `run_id` (weights attached by `attach_transformers_weights`, or
    the record finalized by `finalize_logged_model`); returns its id."""
    model = client(uri).create_logged_model(
        experiment_id(uri, experiment),
        name=name,
        source_run_id=run_id,
        tags=tags,
        params=safe_params(params),
        model_type="rloo-policy",
    )
    return model.model_id


def attach_transformers_weights(
    uri: str, model_id: str, name: str, step: int, model, tokenizer, base_model_path: str | None
) -> None:
    """The policy's files under the LoggedModel in MLflow's transformers flavor (READY after):
    `mlflow.transformers.load_model("models:/<id>")` returns a text-generation pipeline. A PEFT
    model is logged as its adapter plus `base_model_path` (a local folder the loader reads)."""
    import mlflow
    import peft
    import torch
    import transformers

    requirements = [
        f"torch=={torch.__version__.split('+')[0]}",
        f"transformers=={transformers.__version__}",
    ]
    if base_model_path:
        requirements.append(f"peft=={peft.__version__}")
    with _fluent_uri(uri):
        # (explicit requirements: MLflow's inference loads the model again in a subprocess)
        mlflow.transformers.log_model(
            {"model": model, "tokenizer": tokenizer},
            name=name,
            task="text-generation",
            base_model_path=base_model_path,
            step=step,
            model_id=model_id,
            pip_requirements=requirements,
        )


def finalize_logged_model(uri: str, model_id: str) -> None:
    client(uri).finalize_logged_model(model_id, "READY")


def tag_logged_model(uri: str, model_id: str, tags: dict[str, str]) -> None:
    client(uri).set_logged_model_tags(model_id, tags)


def log_model_metrics(
    uri: str, run_id: str, model_id: str, metrics: dict[str, float], step: int, dataset: DatasetRef
) -> None:
    """Held-out metrics of one LoggedModel on one dataset, logged in `run_id` (the evaluate run):
    MLflow's Models tab and `search_logged_models(order_by=...)` rank checkpoints by them."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [
        Metric(key, value, now, step, model_id=model_id, **dataset.key)
        for key, value in numeric_metrics(metrics).items()
    ]
    client(uri).log_batch(run_id, metrics=items, synchronous=True)


def ranked_logged_models(
    uri: str, experiment: str, tags: dict[str, str], metric: str, dataset: DatasetRef
) -> list:
    """The LoggedModels carrying `tags` that have `metric` on `dataset`, best (highest) first; ties
    to the earliest made (the earlier checkpoint, as transformers' best-model tracking does)."""
    found = client(uri).search_logged_models(
        [experiment_id(uri, experiment)],
        filter_string=_tag_filter(tags),
        datasets=[dataset.key],
        order_by=[
            {"field_name": f"metrics.{metric}", "ascending": False, **dataset.key},
            {"field_name": "creation_timestamp", "ascending": True},
        ],
    )
    return [
        model
        for model in found
        if any(m.key == metric and m.dataset_digest == dataset.digest for m in model.metrics)
    ]


# ----------------------------------------------------------------------------------------------
# model registry
def register_version(
    uri: str, model_name: str, run_id: str, model_id: str, tags: dict[str, str], description: str
) -> str:
    """A new version of `model_name` (created when missing) from the LoggedModel `model_id`
    (lineage: version -> LoggedModel -> its train run -> that run's datasets). Returns the
    version."""
    from mlflow.exceptions import MlflowException

    mlflow_client = client(uri)
    try:
        mlflow_client.get_registered_model(model_name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        mlflow_client.create_registered_model(model_name, description=description)
    # the registry resolves `models:/<id>` through the current tracking store
    with _fluent_uri(uri):
        version = mlflow_client.create_model_version(
            model_name,
            source=f"models:/{model_id}",
            run_id=run_id,
            tags=tags,
            description=description,
            model_id=model_id,
        )
    # The LoggedModel names its versions (the Models tab shows them): a tracking server's registry
    # does it itself, a local store does not (mlflow.register_model does it on the client side).
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    linked = json.loads(
        mlflow_client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS) or "[]"
    )
    if not any(
        entry["name"] == model_name and str(entry["version"]) == str(version.version)
        for entry in linked
    ):
        linked.append({"name": model_name, "version": version.version})
        mlflow_client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(linked)})
    return str(version.version)


@contextlib.contextmanager
def _fluent_uri(uri: str):
    """mlflow's process-wide tracking and registry URIs pointed at `uri` for a moment, then put back
    as they were (set_tracking_uri also exports MLFLOW_TRACKING_URI, which every later subprocess
    would inherit)."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    saved = tracking_utils._tracking_uri, registry_utils._registry_uri
    environment = {
        name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
    }
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved[0])
        mlflow.set_registry_uri(saved[1])
        os.environ.update({name: value for name, value in environment.items() if value is not None})
        for name in (name for name, value in environment.items() if value is None):
            os.environ.pop(name, None)


def find_versions(uri: str, model_name: str, tags: dict[str, str]) -> list:
    """Versions of `model_name` carrying every one of `tags` (newest first)."""
    found = client(uri).search_model_versions(f"name = '{model_name}'")
    matching = [v for v in found if all(v.tags.get(key) == value for key, value in tags.items())]
    return sorted(matching, key=lambda v: int(v.version), reverse=True)


def version_by_alias(uri: str, model_name: str, alias: str):
    """The version an alias points to, or None (no such model or alias)."""
    from mlflow.exceptions import MlflowException

    try:
        return client(uri).get_model_version_by_alias(model_name, alias)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def set_alias(uri: str, model_name: str, alias: str, version: str) -> None:
    client(uri).set_registered_model_alias(model_name, alias, version)


def tag_version(uri: str, model_name: str, version: str, tags: dict[str, str]) -> None:
    mlflow_client = client(uri)
    for key, value in tags.items():
        if is_secret(key):
            raise ValueError(f"refusing to write {key!r} to the model registry")
        mlflow_client.set_model_version_tag(model_name, version, key, str(value)[:5000])


def tag_run(uri: str, run_id: str, tags: dict[str, str]) -> None:
    for key, value in tags.items():
        client(uri).set_tag(run_id, key, value)


def log_text(uri: str, run_id: str, text: str, artifact_file: str) -> None:
    client(uri).log_text(run_id, text, artifact_file)
