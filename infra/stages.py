"""The pipeline's stages as plain functions (Prefect tasks in `tasks/` wrap them; tests call them
directly): dataset, model and train here, evaluate in infra.evaluation.

Each stage writes into the run directory and returns a small JSON-able dict; `stages/<stage>.json`
keeps it, so a retried or re-run pipeline (same config fingerprint) finds the finished stages."""

from __future__ import annotations

import json
import os
import shutil
import time

from infra.job_tracking import read_metrics, read_step, tracking_environment
from infra.jobs import TrainingStalled, stall_cause
from infra.launch import JobHandle, TrainingFailed, TrainJob, cancel, job_state, submit_local
from infra.model_checks import check_lora_targets, check_tokenizer_fits, resolve_model_source
from infra.runconfig import ConfigError, RunConfig, resolved_dict
from infra.slurm import MultiNodeJob, executor_parameters, submit_slurm
from infra.tracking import DatasetRef
from rloo.adapters import check_quantization_supported, lora_targets
from rloo.checkpoint import latest_checkpoint
from rloo.checks import check_image_columns
from rloo.cli import parse_recipe, recipe_value, resolve_reward, reward_entries
from rloo.data import load_prompt_dataset, validate_prompt_rows
from rloo.models import load_tokenizer, prepare_tokenizer
from rloo.timing import timing_summary
from rloo.vision import check_images_readable, check_rows_fit, embed_images, undecoded

STAGE_VERSIONS = {"dataset": 2, "model": 1, "train": 2, "evaluate": 2}


# ---------------------------------------------------------------------------------------------- run
# directory
def stage_path(config: RunConfig, *parts: str) -> str:
    return os.path.join(config.run_dir, *parts)


def record_execution(config: RunConfig, stage: str) -> None:
    """One line per execution of a stage's body: what really ran (`rloo-pipeline status` shows
    re-runs)."""
    os.makedirs(stage_path(config, "stages"), exist_ok=True)
    with open(stage_path(config, "stages", "executions.log"), "a") as handle:
        handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {stage} v{STAGE_VERSIONS[stage]}\n")


def executions(config: RunConfig) -> list[str]:
    path = stage_path(config, "stages", "executions.log")
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [line.split()[1] for line in handle if line.strip()]


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True, default=str)
    os.replace(path + ".tmp", path)


def read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def save_stage_result(config: RunConfig, stage: str, result: dict) -> dict:
    write_json(
        stage_path(config, "stages", f"{stage}.json"),
        {"version": STAGE_VERSIONS[stage], "fingerprint": config.fingerprint(), "result": result},
    )
    return result


def load_stage_result(config: RunConfig, stage: str) -> dict | None:
    """The stage's persisted result when it belongs to this config and stage version (else None: it
    would run)."""
    record = read_json(stage_path(config, "stages", f"{stage}.json"))
    if (
        record
        and record["version"] == STAGE_VERSIONS[stage]
        and record["fingerprint"] == config.fingerprint()
    ):
        return record["result"]
    return None


def write_config(config: RunConfig) -> str:

    path = stage_path(config, "config.json")
    write_json(
        path,
        {
            "run_key": config.run_key,
            "fingerprint": config.fingerprint(),
            "config": resolved_dict(config),
        },
    )
    return path


def _replace_dir(staging: str, target: str) -> None:
    if os.path.exists(target):
        shutil.rmtree(target)
    os.replace(staging, target)


# ----------------------------------------------------------------------------------------------
# dataset
def prepare_dataset(config: RunConfig) -> dict:
    """Load, validate every row, hold out `eval_size` prompts, save both splits to the run
    directory."""
    import datasets

    datasets.disable_progress_bars()  # one summary line per stage, not a bar per split
    record_execution(config, "dataset")

    data = config.data
    dataset, prompt_format = load_checked_rows(config)
    # images read from files go into the saved splits: the run directory holds its data
    shuffled = embed_images(dataset).shuffle(seed=data.seed)
    eval_split = shuffled.select(range(data.eval_size))
    train_split = shuffled.select(range(data.eval_size, len(shuffled)))
    if data.max_train_samples is not None:
        train_split = train_split.select(range(min(data.max_train_samples, len(train_split))))
    root = stage_path(config, "data")
    os.makedirs(root, exist_ok=True)
    paths = {}
    for name, split in (("train", train_split), ("eval", eval_split)):
        staging = os.path.join(root, f".{name}-staging")
        shutil.rmtree(staging, ignore_errors=True)
        split.flatten_indices().save_to_disk(staging)
        paths[name] = os.path.join(root, name)
        _replace_dir(staging, paths[name])
    result = {
        "train_path": paths["train"],
        "eval_path": paths["eval"],
        "num_train": len(train_split),
        "num_eval": len(eval_split),
        "format": prompt_format,
        "columns": dataset.column_names,
        "source": data.source,
        "digest": dataset_digest(train_split, eval_split),
        "train_digest": dataset_digest(train_split),
        "eval_digest": dataset_digest(eval_split),
    }
    return save_stage_result(config, "dataset", result)


def split_datasets(config: RunConfig, dataset_result: dict) -> list:
    """The training and held-out splits as MLflow datasets (tracking.DatasetRef), each with its
    own content digest and data.source as where it came from."""
    return [
        DatasetRef(
            dataset_result[f"{split}_path"],
            f"{config.name}-{split}",
            dataset_result[f"{split}_digest"],
            dataset_result["source"],
            context,
        )
        for split, context in (("train", "training"), ("eval", "evaluation"))
    ]


def pipeline_datasets(config: RunConfig, dataset_result: dict) -> list:
    """What the train and evaluate runs show as their inputs: both splits and every
    evaluation.extra_sets file (context evaluation, digest of its rows)."""

    extra = [
        DatasetRef(
            path,
            f"{config.name}-{name}",
            dataset_digest(load_prompt_dataset(path)),
            path,
            "evaluation",
        )
        for name, path in config.evaluation.extra_sets.items()
    ]
    return split_datasets(config, dataset_result) + extra


def load_checked_rows(config: RunConfig):
    """data.source loaded and every row checked (rloo.data), enough rows for data.eval_size:
    (dataset, format)."""

    data = config.data
    dataset = load_prompt_dataset(data.source, data.config, data.split)
    prompt_format = validate_prompt_rows(dataset, data.source)
    check_images_readable(dataset, data.source)
    if prompt_format == "conversational":  # (a string prompt's image tokens are the model's)
        check_rows_fit(dataset, data.source, None)
    if data.eval_size >= len(dataset):
        raise ValueError(
            f"data.eval_size={data.eval_size} leaves no training prompts ({len(dataset)} rows in "
            f"{data.source}). Fix: a smaller data.eval_size."
        )
    return dataset, prompt_format


def check_config(config: RunConfig, read_rows: bool) -> bool:
    """What needs no model and writes nothing, as one-line ConfigErrors: every recipe value
    (rloo.cli's checks), the reward imports, data.source, and with `read_rows` every row of a local
    source (`rloo-pipeline validate`; a Hub dataset's rows are checked by the dataset stage, nothing
    is downloaded here). True when rows were read."""

    try:
        script, args = validate_recipe(config)
        for entry in reward_entries(script):
            resolve_reward(entry)
    except (ValueError, ImportError) as err:
        raise ConfigError(f"training: {err}") from None
    source = config.data.source
    if source.endswith((".json", ".jsonl", ".csv", ".parquet")) and not os.path.isfile(source):
        raise ConfigError(f"data.source {source!r}: no such file.")
    for name, path in config.evaluation.extra_sets.items():
        if not os.path.isfile(path):
            raise ConfigError(f"evaluation.extra_sets.{name}: {path!r}: no such file.")
    if not (read_rows and os.path.exists(source)):
        return False
    import datasets

    datasets.disable_progress_bars()
    try:
        dataset, _ = load_checked_rows(config)
        check_enough_prompts(config, args, len(dataset) - config.data.eval_size)
        # (against every source row: the split is not drawn yet)
        for name in config.evaluation.extra_sets:
            extra_set_rows(config, name, dataset["prompt"])
    except ValueError as err:
        raise ConfigError(f"data: {err}") from None
    return True


def check_enough_prompts(config: RunConfig, args, num_train: int) -> None:
    """One generation batch of the whole launch (every process) takes generation_batch_size /
    num_generations distinct prompts: fewer training prompts than that and no step could be
    drawn."""
    if config.data.max_train_samples is not None:
        num_train = min(num_train, config.data.max_train_samples)
    needed = args.generation_batch_size // args.num_generations
    if num_train < needed:
        world = config.launch.nproc_per_node * (
            config.launch.slurm.trainer_nodes if config.launch.executor == "slurm" else 1
        )
        raise ValueError(
            f"{num_train} training prompts, but one generation batch of this launch ({world} "
            "process(es) x training.per_device_train_batch_size / num_generations x steps per "
            f"generation) takes {needed} distinct prompts. Fix: more prompts "
            "(data.max_train_samples, a smaller data.eval_size), fewer processes, or a smaller "
            "per_device_train_batch_size."
        )


def dataset_digest(*splits) -> str:
    import hashlib

    digest = hashlib.sha256()
    for split in splits:
        for row in undecoded(split):  # an image by its bytes, not a PIL object's repr
            digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def job_recipe(config: RunConfig, model_result: dict, dataset_path: str) -> dict:
    """The `rloo train` recipe the job runs: `training:` unchanged, plus what the pipeline sets (the
    resolved model alias, the prepared dataset, output_dir, report_to, its tracking callback)."""
    recipe = dict(config.training)
    recipe.update(
        model_name_or_path=model_result["policy"],
        dataset_name=dataset_path,
        output_dir=stage_path(config, "train", "output"),
        report_to="none",
        callbacks=[*(recipe.get("callbacks") or []), "infra.job_tracking:RunDirTrackingCallback"],
    )
    if model_result.get("tokenizer"):
        recipe["tokenizer_name_or_path"] = model_result["tokenizer"]
    return recipe


def build_training_args(config: RunConfig, recipe: dict):
    """(ScriptArguments, RLOOConfig) of the job's recipe, validated here in one process by
    rloo.cli.parse_recipe (what `rloo train` runs). The batch arithmetic is done for the launch's
    world size (trainer nodes x processes per node) by scaling the per-device batch sizes."""

    settings = dict(recipe)
    world = config.launch.nproc_per_node * (
        config.launch.slurm.trainer_nodes if config.launch.executor == "slurm" else 1
    )
    for key in ("per_device_train_batch_size", "per_device_eval_batch_size"):
        settings[key] = recipe_value(recipe, key) * world
    if config.launch.executor == "slurm" and config.launch.slurm.gpus_per_node:
        # The cluster's GPUs, not this machine's, decide bf16 and DeepSpeed: check the files, not
        # the hardware.
        settings["use_cpu"] = True
        deepspeed = settings.pop("deepspeed", None)
        if isinstance(deepspeed, str):
            if not os.path.isfile(deepspeed):
                raise FileNotFoundError(f"training.deepspeed={deepspeed!r}: no such file.")
            with open(deepspeed) as handle:
                if "zero_optimization" not in json.load(handle):
                    raise ValueError(
                        f"training.deepspeed={deepspeed!r} has no zero_optimization section."
                    )
    script_args, args = parse_recipe(settings)
    if args.deepspeed:
        # RLOOConfig switched transformers' process-wide ZeRO-3 flag on; models this (orchestration)
        # process loads later must not be built under zero.Init.
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    return script_args, args


def validate_recipe(config: RunConfig):
    """The job's recipe checked before any stage runs (`rloo-pipeline validate`, and the flow's
    first step): the model alias left unresolved (nothing converted or built), data.source standing
    in for the prepared split."""
    model = {"policy": config.training["model_name_or_path"], "tokenizer": None}
    return build_training_args(config, job_recipe(config, model, config.data.source))


def prepare_model(config: RunConfig, dataset_result: dict) -> dict:
    """Everything about the model that can fail, checked before training: paths, tokenizer, chat
    template, LoRA targets, quantization support, the training arguments, the reward imports."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # building the 'tiny' alias: no bar per weight file
    record_execution(config, "model")
    policy, tokenizer_source = resolve_model_source(config)
    script, args = build_training_args(
        config,
        job_recipe(
            config, {"policy": policy, "tokenizer": tokenizer_source}, dataset_result["train_path"]
        ),
    )
    check_enough_prompts(config, args, dataset_result["num_train"])
    if script.load_in_4bit or script.load_in_8bit:
        check_quantization_supported(type("Q", (), {"quant_method": "bitsandbytes"})())
    rewards = [resolve_reward(entry) for entry in reward_entries(script)]
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(policy, trust_remote_code=args.trust_remote_code)
    # images need a vision-language model (told from the config, before any weight loads)
    check_image_columns(dataset_result["columns"], "data.source", policy, args.trust_remote_code)
    # a VLM's processor (rloo.vision), else the tokenizer
    tokenizer = prepare_tokenizer(
        load_tokenizer(tokenizer_source or policy, args.trust_remote_code, config=model_config)
    )
    if dataset_result["format"] == "conversational" and not getattr(
        tokenizer, "chat_template", None
    ):
        raise ValueError(
            f"the dataset's prompts are conversational but the tokenizer of {policy!r} has no chat "
            "template. Fix: use an instruct model, set training.tokenizer_name_or_path to one "
            "with a template, or give plain-text prompts."
        )
    check_tokenizer_fits(policy, tokenizer, args, dataset_result)

    targets = lora_targets(script.lora_target_modules) if script.use_peft else "all-linear"
    num_parameters, targets = check_lora_targets(policy, targets, args.trust_remote_code)
    peft = {
        "enabled": script.use_peft,
        "r": script.lora_r,
        "alpha": script.lora_alpha,
        "dropout": script.lora_dropout,
        "target_modules": targets,
        "load_in_4bit": script.load_in_4bit,
        "load_in_8bit": script.load_in_8bit,
    }
    result = {
        "policy": policy,
        "tokenizer": tokenizer_source,
        "num_parameters": num_parameters,
        "peft": peft,
        "reward_names": [getattr(r, "__name__", str(r)) for r in rewards],
    }
    return save_stage_result(config, "model", result)


# ----------------------------------------------------------------------------------------------
# train
def train_dir(config: RunConfig) -> str:
    return stage_path(config, "train")


def write_train_recipe(
    config: RunConfig, dataset_result: dict, model_result: dict, resume: bool
) -> str:
    """train/recipe.yaml: the job's `rloo train` recipe (job_recipe), resuming from the latest
    checkpoint if asked."""
    import yaml

    recipe = job_recipe(config, model_result, dataset_result["train_path"])
    if resume:
        recipe["resume_from_checkpoint"] = "latest"
    path = stage_path(config, "train", "recipe.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        yaml.safe_dump(recipe, handle, sort_keys=False)
    return path


def start_or_reattach_training(
    config: RunConfig, dataset_result: dict, model_result: dict, mlflow_run_id: str | None
) -> dict:
    """A job of an earlier attempt that is still running, or that trained to max_steps while nobody
    followed it (its orchestrator lost: the Prefect API away, the process killed), is reattached;
    otherwise a job is submitted, resuming from the newest checkpoint when there is one. Returns the
    job record (train/job.json)."""

    job_file = stage_path(config, "train", "job.json")
    previous = read_json(job_file)
    if previous is not None:
        state, _ = job_state(JobHandle.from_dict(previous["handle"]))
        step, max_steps = training_progress(config)[:2]
        if state == "RUNNING" or (state == "COMPLETED" and max_steps and step >= max_steps):
            return {**previous, "reattached": True}
    record_execution(config, "train")
    output_dir = stage_path(config, "train", "output")

    checkpoint = latest_checkpoint(output_dir)
    recipe = write_train_recipe(config, dataset_result, model_result, resume=checkpoint is not None)
    run_id = (previous or {}).get("mlflow_run_id") or mlflow_run_id
    env = (
        tracking_environment(config.tracking_uri, run_id, train_dir(config))
        if run_id
        else {"RLOO_TRAIN_DIR": train_dir(config)}
    )
    workdir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if config.launch.executor == "slurm":
        settings = config.launch.slurm
        job = MultiNodeJob(
            recipe,
            {**settings.model_dump(), "collective_timeout_s": config.collective_timeout_s()},
            config.launch.nproc_per_node,
            env,
            stage_path(config, "train"),
            workdir,
            model_result["policy"],
        )
        handle = submit_slurm(
            job,
            stage_path(config, "train", "submitit"),
            executor_parameters(settings, config.launch.timeout_min, config.run_key),
        )
    else:
        env.update(thread_environment(config))
        job = TrainJob(
            recipe,
            config.launch.nproc_per_node,
            env,
            stage_path(config, "train", "job.log"),
            workdir,
        )
        handle = submit_local(
            job, stage_path(config, "train", "submitit"), config.launch.timeout_min
        )
    record = {
        "handle": handle.to_dict(),
        "mlflow_run_id": run_id,
        "resumed_from": checkpoint,
        "attempt": (previous or {}).get("attempt", 0) + 1,
        "reattached": False,
    }
    write_json(job_file, record)
    return record


def thread_environment(config: RunConfig) -> dict[str, str]:
    """OMP_NUM_THREADS for a local job whose processes share this machine with others running at
    once (its ranks, a sweep's parallel trials): the cores divided among them. torch otherwise gives
    each process a thread per core, and the oversubscribed cores run every process slower (a sweep
    of two trials at once on 2 cores: 20% longer). Set by the user, it is left alone."""
    trials = config.sweep.parallel if config.trial and config.sweep else 1
    at_once = config.launch.nproc_per_node * trials
    if at_once == 1 or "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // at_once))}


def training_progress(config: RunConfig) -> tuple[int, int | None, float | None, str | None]:
    """(last optimizer step, max_steps, the last logged mean reward, its step-time breakdown as
    text) of the job's latest attempt: the step from the file the job rewrites at every optimizer
    step (a recipe that logs every 10 steps still shows each), the rest from its metrics file.
    Every attempt of a job appends to that file; a step counter that goes back is a new attempt
    (resumed from an earlier checkpoint, or restarted from the start), which is the one followed."""

    step, reward, timing, logged = 0, None, None, 0.0
    for record in read_metrics(train_dir(config)):
        if "step" not in record:
            continue
        if record["step"] < step:  # a new attempt: nothing of the earlier one carries over
            reward = timing = None
        step, logged = record["step"], record.get("time", logged)
        reward = record.get("reward", reward)
        timing = timing_summary(record) or timing
    beat = read_step(train_dir(config))
    if beat is not None and beat["time"] >= logged:
        if beat["step"] < step:  # a new attempt that has logged nothing yet
            reward = timing = None
        step = beat["step"]
    max_steps = config.recipe_value("max_steps")
    return step, max_steps if max_steps and max_steps > 0 else None, reward, timing


async def follow_training(config: RunConfig, record: dict, on_progress=None, judge=None) -> dict:
    """Poll the job (asyncio.sleep between polls, so the orchestrator stays responsive and
    cancellable). A sweep's trial has a `judge` (infra.sweep.PruningJudge): each new checkpoint is
    scored and reported, and a pruned trial's job is stopped there (its checkpoints kept)."""
    import asyncio

    handle = JobHandle.from_dict(record["handle"])
    deadline = handle.submitted_at + config.launch.timeout_min * 60 + 60
    last = pruned = None
    while True:
        state, error = job_state(handle)
        progress = training_progress(config)
        if on_progress is not None and progress != last:
            on_progress(*progress)
            last = progress
        if judge is not None:
            for checkpoint in judge.pending():
                if judge.verdict() is not None:
                    break
                await asyncio.to_thread(judge.judge, checkpoint)
            # (a job that finished meanwhile is done: its work is not given up)
            pruned = judge.verdict() if state != "COMPLETED" else None
        if pruned is not None:
            cancel(handle)
            while job_state(handle)[0] == "RUNNING":
                await asyncio.sleep(config.launch.poll_seconds)
            break
        if state == "COMPLETED":
            break
        stalled = stall_cause(stage_path(config, "train", "output"), handle.submitted_at)
        if state in ("FAILED", "LOST"):
            if stalled:  # the job's watchdog said where it hung: a stalled job, retried resumes
                raise TrainingStalled(f"training job {handle.job_id} stalled: {stalled}")
            raise TrainingFailed(f"training job {handle.job_id} {state.lower()}: {error}")
        if time.time() > deadline:
            cancel(handle)
            raise (TrainingStalled if stalled else TrainingFailed)(
                f"training job {handle.job_id} exceeded "
                f"launch.timeout_min={config.launch.timeout_min}; cancelled"
                f"{f' after it stalled: {stalled}' if stalled else ''}. It can be resumed from "
                "its last checkpoint by retrying."
            )
        await asyncio.sleep(config.launch.poll_seconds)
    output_dir = stage_path(config, "train", "output")
    result = {
        "output_dir": output_dir,
        "global_step": pruned["step"] if pruned else progress[0],
        "pruned": pruned,
        "mlflow_run_id": record.get("mlflow_run_id"),
        "metrics_path": stage_path(config, "train", "metrics.jsonl"),
        "job_id": handle.job_id,
        "attempt": record.get("attempt", 1),
        "resumed_from": record.get("resumed_from"),
    }
    return save_stage_result(config, "train", result)


def extra_set_rows(config: RunConfig, name: str, training_prompts: list) -> list[dict]:
    """evaluation.extra_sets[name]'s rows, checked as training rows are, none of whose prompts is a
    training prompt (a held-out set must be kept out of training)."""

    path = config.evaluation.extra_sets[name]
    if not os.path.isfile(path):
        raise ValueError(f"evaluation.extra_sets.{name}: {path!r}: no such file.")
    dataset = load_prompt_dataset(path)
    validate_prompt_rows(dataset, path)
    rows = list(dataset)
    seen = {
        json.dumps(prompt, sort_keys=True): index for index, prompt in enumerate(training_prompts)
    }
    for index, row in enumerate(rows):
        if (found := seen.get(json.dumps(row["prompt"], sort_keys=True))) is not None:
            raise ValueError(
                f"evaluation.extra_sets.{name}: row {index}'s prompt is training prompt {found} of "
                "data.source. Fix: keep the set's prompts out of the training data."
            )
    return rows
