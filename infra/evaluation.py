"""The evaluate stage: held-out prompts, base vs trained policy, scored by one rloo.rollout each;
the report."""

from __future__ import annotations

import json
import os

from infra import checkpoints, stages
from infra.checkpoints import load_policy
from infra.job_tracking import read_metrics
from infra.runconfig import RunConfig
from rloo.cli import resolve_reward, reward_entries
from rloo.completion_log import as_text
from rloo.generation import in_process_generator
from rloo.models import (
    eos_token_ids,
    load_reward_model,
    load_tokenizer,
    prepare_tokenizer,
    reward_tokenizers,
    text_tokenizer_of,
)
from rloo.rewards import RewardRunner
from rloo.rollout import RolloutSettings, build_rollout, rollout_metrics
from rloo.timing import SECTIONS
from rloo.vision import has_image_processor, is_vision_config, placeholder_token_ids


def _score(config: RunConfig, model, tokenizer, rows, runner, generator, state) -> dict:
    """One rollout of the held-out prompts (rloo.rollout, the function training uses) -> the
    report's metrics."""
    import math

    import torch

    batch = config.evaluation.batch_size

    def generate(prompt_ids, media=None, images=None):  # a VLM's images (rloo.vision)
        completions = []
        with generator.reusing_weights():  # one policy's weights for every batch
            for start in range(0, len(prompt_ids), batch):
                with_media = {} if media is None else {"media": media[start : start + batch]}
                completions += generator.generate(
                    model, prompt_ids[start : start + batch], 1, state.global_step, **with_media
                )
        return completions

    weights = torch.tensor(
        config.recipe_value("reward_weights") or [1.0] * len(runner.names), dtype=torch.float32
    )
    settings = RolloutSettings(
        num_generations=1,
        pad_token_id=generator.pad_token_id,
        eos_token_ids=generator.eos_ids,
        reward_weights=weights,
        chat_template_kwargs=config.recipe_value("chat_template_kwargs"),
        vision=has_image_processor(tokenizer),
    )
    rollout = build_rollout(
        rows,
        settings,
        generate=generate,
        processing_class=tokenizer,
        reward_runner=runner,
        trainer_state=state,
    )
    measured = rollout_metrics(rollout, runner.names, weights)

    def number(value: float) -> float | None:
        return None if math.isnan(value) else value

    # the headline first (the report's tables, MLflow's first metric column)
    metrics = {"reward": number(measured["reward"])}
    for index, name in enumerate(runner.names):
        metrics[f"reward/{name}"] = number(measured[f"rewards/{name}/mean"])
        scored = {v for v in rollout.rewards_per_func[:, index].tolist() if not math.isnan(v)}
        if scored and scored <= {0.0, 1.0}:
            # a 0/1 reward's mean is its accuracy
            metrics[f"accuracy/{name}"] = metrics[f"reward/{name}"]
    metrics["completion_length"] = measured["completions/mean_length"]
    metrics["truncated_ratio"] = measured["completions/clipped_ratio"]
    return {"metrics": metrics, "texts": rollout.completion_texts}


def score_policies(
    config: RunConfig,
    policy: str,
    tokenizer_name: str | None,
    rows: list[dict],
    weights: dict[str, str | None],
    steps: dict[str, int],
    max_steps: int,
) -> dict[str, dict]:
    """Each labelled policy (`load_policy(policy, weights[label])`) on the same rows with the run's
    evaluation settings and reward functions: {label: {"metrics": ..., "texts": ...}}. Reward
    functions see a TrainerState at that policy's step, as in training."""
    return score_sets(
        config, policy, tokenizer_name, {"held_out": rows}, weights, steps, max_steps
    )["held_out"]


def score_sets(
    config: RunConfig,
    policy: str,
    tokenizer_name: str | None,
    row_sets: dict[str, list[dict]],
    weights: dict[str, str | None],
    steps: dict[str, int],
    max_steps: int,
) -> dict[str, dict]:
    """score_policies for several sets of rows: {set: {label: {...}}}. One model in memory at a
    time; labels whose weights are equal (the final model and the checkpoint of the same step) are
    scored once."""
    import torch
    from transformers import TrainerState

    trust = bool(config.recipe_value("trust_remote_code"))
    reward_funcs = [resolve_reward(entry) for entry in reward_entries(config.training)]
    reward_funcs = [
        load_reward_model(f, {}, trust) if isinstance(f, str) else f for f in reward_funcs
    ]
    runner = RewardRunner(
        reward_funcs,
        reward_tokenizers(reward_funcs, None, trust),
        config.recipe_value("chat_template_kwargs"),
        config.recipe_value("reward_timeout"),
        config.recipe_value("nonfinite_rewards"),
    )
    scored = {name: {} for name in row_sets}
    done = {}  # weights digest -> the label scored with them
    tokenizer = generator = None
    for label, path in weights.items():
        digest = None if path is None else (checkpoints.weights_digest(path), steps[label])
        if digest in done:
            for name in row_sets:
                scored[name][label] = scored[name][done[digest]]
            continue
        model = load_policy(policy, path, trust)
        if generator is None:
            # a VLM: its processor, model.generate with the images (rloo.vision)
            vision = is_vision_config(model.config)
            tokenizer = prepare_tokenizer(
                load_tokenizer(tokenizer_name or policy, trust, config=model.config)
            )
            text_tokenizer = text_tokenizer_of(tokenizer)
            eos = eos_token_ids(text_tokenizer, model)
            generator = in_process_generator(
                generation_config(config, model, text_tokenizer.pad_token_id, eos),
                text_tokenizer.pad_token_id,
                eos,
                model,
                fast=False if vision else None,
            )
        for name, rows in row_sets.items():
            torch.manual_seed(config.data.seed)
            scored[name][label] = _score(
                config,
                model,
                tokenizer,
                rows,
                runner,
                generator,
                TrainerState(global_step=steps[label], max_steps=max_steps),
            )
        if digest is not None:
            done[digest] = label
        del model
    return scored


def generation_config(config: RunConfig, model, pad_token_id: int, eos: list[int]):
    """The evaluation's decoding, every sampling setting explicit: `generate` fills a setting left
    unset from the model's own generation config (a Qwen Instruct model's top_k 20), which would
    make the evaluation of one model decode unlike another's."""
    from transformers import GenerationConfig

    settings = config.evaluation
    sampling = (
        dict(do_sample=False)
        if settings.temperature == 0
        else dict(
            do_sample=True,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
        )
    )
    max_new = settings.max_completion_length or config.recipe_value("max_completion_length")
    return GenerationConfig(
        max_new_tokens=max_new,
        pad_token_id=pad_token_id,
        eos_token_id=eos,
        repetition_penalty=settings.repetition_penalty,
        **sampling,
        suppress_tokens=placeholder_token_ids(model.config)
        if is_vision_config(model.config)
        else None,
    )


def evaluation_fingerprint(config: RunConfig, rows: list[dict]) -> str:
    """What makes two evaluations comparable: the same prompts, decoding settings and reward
    functions."""
    import hashlib

    payload = {
        "prompts": [row["prompt"] for row in rows],
        "evaluation": config.evaluation.model_dump(),
        "max_completion_length": config.recipe_value("max_completion_length"),
        "reward_funcs": reward_entries(config.training),
        "reward_weights": config.recipe_value("reward_weights"),
        "chat_template_kwargs": config.recipe_value("chat_template_kwargs"),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[
        :16
    ]


def held_out_rows(dataset_result: dict) -> list[dict]:
    from datasets import load_from_disk

    rows = list(load_from_disk(dataset_result["eval_path"]))
    if not rows:
        raise ValueError(
            "no held-out prompts to evaluate (data.eval_size is 0); set evaluation.enabled: false."
        )
    return rows


def evaluate_policy(
    config: RunConfig, dataset_result: dict, model_result: dict, train_result: dict
) -> dict:
    """Held-out prompts (and evaluation.extra_sets): the base model, the final model and every
    `evaluation.checkpoint_interval`-th checkpoint, each scored the same way: mean reward per
    function, accuracy where a reward is 0/1, completion lengths; a markdown report with a table
    per set, the checkpoints' table (the best marked), sample completions, the training reward
    curve and the step-time breakdown."""
    from datasets import load_from_disk

    stages.record_execution(config, "evaluate")
    rows = held_out_rows(dataset_result)
    training = (
        load_from_disk(dataset_result["train_path"])["prompt"]
        if config.evaluation.extra_sets
        else []
    )
    row_sets = {
        "held_out": rows,
        **{
            name: stages.extra_set_rows(config, name, training)
            for name in config.evaluation.extra_sets
        },
    }
    step = train_result["global_step"]
    evaluated = checkpoints.to_evaluate(config, train_result)
    weights = {"base": None, **{c.name: c.path for c in evaluated}}
    scored = score_sets(
        config,
        model_result["policy"],
        model_result["tokenizer"],
        row_sets,
        weights,
        {"base": 0, **{c.name: c.step for c in evaluated}},
        step,
    )
    for found in scored.values():  # the final model is "trained" in the report's tables
        found["trained"] = found.pop(checkpoints.FINAL)
    results = scored["held_out"]
    base_metrics, trained_metrics = results["base"]["metrics"], results["trained"]["metrics"]
    sets = {
        name: {
            "base": scored[name]["base"]["metrics"],
            "trained": scored[name]["trained"]["metrics"],
            "num_prompts": len(row_sets[name]),
            "path": config.evaluation.extra_sets[name],
        }
        for name in config.evaluation.extra_sets
    }
    table = [
        {
            "name": c.name,
            "step": c.step,
            "model_id": c.model_id,
            "held_out": scored["held_out"][_label(c)]["metrics"],
            "sets": {
                name: scored[name][_label(c)]["metrics"] for name in config.evaluation.extra_sets
            },
        }
        for c in evaluated
    ]
    out = stages.stage_path(config, "eval")
    os.makedirs(out, exist_ok=True)
    plot = plot_reward_curve(train_result["metrics_path"], os.path.join(out, "reward_curve.png"))
    timing_plot = plot_step_timing(
        train_result["metrics_path"], os.path.join(out, "step_timing.png")
    )
    report = render_report(
        config,
        dataset_result,
        base_metrics,
        trained_metrics,
        rows,
        results,
        plot,
        timing_plot,
        sets,
        table,
    )
    with open(os.path.join(out, "report.md"), "w") as handle:
        handle.write(report)
    gain = None
    if base_metrics["reward"] is not None and trained_metrics["reward"] is not None:
        gain = trained_metrics["reward"] - base_metrics["reward"]
    result = {
        "base": base_metrics,
        "trained": trained_metrics,
        "reward_gain": gain,
        "num_prompts": len(rows),
        "report_path": os.path.join(out, "report.md"),
        "plot_path": plot,
        "timing_plot_path": timing_plot,
        "extra_sets": sets,
        "checkpoints": table,
    }
    stages.write_json(os.path.join(out, "metrics.json"), result)
    return stages.save_stage_result(config, "evaluate", result)


def _label(checkpoint) -> str:
    return "trained" if checkpoint.name == "final" else checkpoint.name


def _training_records(metrics_path: str) -> list[dict]:

    return [r for r in read_metrics(os.path.dirname(metrics_path)) if "train_runtime" not in r]


def figure(size=(6, 3.5)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=size)


def save_figure(plt, figure_, target: str) -> str:
    figure_.tight_layout()
    figure_.savefig(target, dpi=100)
    plt.close(figure_)
    return target


def plot_reward_curve(metrics_path: str, target: str) -> str | None:
    records = [r for r in _training_records(metrics_path) if r.get("reward") is not None]
    if not records:
        return None
    plt, fig, axis = figure()
    axis.plot([r["step"] for r in records], [r["reward"] for r in records], marker="o")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("mean reward (training batch)")
    axis.set_title("Training reward")
    axis.grid(alpha=0.3)
    return save_figure(plt, fig, target)


def plot_step_timing(metrics_path: str, target: str) -> str | None:
    """A stacked bar per logged step: seconds in each timing/* section (rloo.timing), the step's
    wall time on top."""

    records = [
        r for r in _training_records(metrics_path) if "step_time" in r and "timing/train" in r
    ]
    if not records:
        return None
    plt, fig, axis = figure()
    steps = [r["step"] for r in records]
    bottom = [0.0] * len(records)
    for name in SECTIONS:
        heights = [r.get(f"timing/{name}") or 0.0 for r in records]
        axis.bar(steps, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axis.plot(steps, [r["step_time"] for r in records], "k_", markersize=12, label="step_time")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("seconds")
    axis.set_title("Where each step's time goes")
    axis.legend(fontsize=7, ncol=4)
    return save_figure(plt, fig, target)


def format_number(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _table(base: dict, trained: dict) -> list[str]:
    lines = ["| metric | base | trained | change |", "| --- | --- | --- | --- |"]
    for key in base:
        change = None if base[key] is None or trained.get(key) is None else trained[key] - base[key]
        lines.append(
            f"| {key} | {format_number(base[key])} | {format_number(trained.get(key))} | "
            f"{'-' if change is None else f'{change:+.3f}'} |"
        )
    return lines


def render_report(
    config,
    dataset_result,
    base,
    trained,
    rows,
    results,
    plot,
    timing_plot=None,
    sets: dict | None = None,
    table: list[dict] | None = None,
) -> str:
    temperature = config.evaluation.temperature
    decoding = "greedy decoding" if temperature == 0 else f"temperature {temperature}"
    lines = [
        f"# Evaluation of `{config.run_key}`",
        "",
        f"{len(rows)} held-out prompts from `{dataset_result['source']}`, {decoding}.",
        "",
        *_table(base, trained),
    ]
    for name, found in (sets or {}).items():
        lines += [
            "",
            f"## Held-out set `{name}`",
            "",
            f"{found['num_prompts']} prompts from `{found['path']}`, kept out of training.",
            "",
            *_table(found["base"], found["trained"]),
        ]
    if table:
        metric = config.promotion.metric
        lines += [
            "",
            "## Checkpoints",
            "",
            f"Each evaluated checkpoint on the same prompts; the best by held-out `{metric}` "
            "(promotion.metric) is what `rloo-pipeline promote` takes by default.",
            "",
            *checkpoints.render_table(table, metric, list(sets or {})),
        ]
    if plot:
        lines += ["", f"![training reward]({os.path.basename(plot)})"]
    if timing_plot:
        lines += ["", f"![step time by section]({os.path.basename(timing_plot)})"]
    lines += ["", "## Samples", "", "| prompt | base | trained |", "| --- | --- | --- |"]

    for index in range(min(5, len(rows))):
        cells = [
            as_text(rows[index]["prompt"]),
            results["base"]["texts"][index],
            results["trained"]["texts"][index],
        ]
        lines.append(
            "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ")[:160] for c in cells) + " |"
        )
    return "\n".join(lines) + "\n"
