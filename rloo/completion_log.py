"""Samples of (prompt, completion, rewards, advantage) from the latest generation batch, for people
to read.

The trainer records the gathered rows of every generation; at each log step the main process prints
them as a rich table in the terminal and hands them to every callback with an `on_completions`
method (with `report_to` including mlflow, rloo.callbacks.MLflowCompletionsCallback logs them with
`mlflow.log_table`; with wandb or trackio, rloo.callbacks.TrackerCompletionsCallback logs a table
to them as TRL does). A vision-language model's rows carry their images (`log_multimodal`): a
placeholder in the terminal, image columns in the trackers' tables."""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Any

COLUMNS_BEFORE_REWARDS = ("step", "prompt", "completion")


def as_text(value: Any) -> str:
    """Conversational prompts/completions are message lists: show them as `role: content` lines."""
    if isinstance(value, list) and value and isinstance(value[0], dict) and "content" in value[0]:
        return "\n".join(f"{m.get('role', '?')}: {m['content']}" for m in value)
    return str(value)


class CompletionLog:
    """TRL-compatible buffers (`prompt`, `completion`, `rewards[name]`, `advantages`,
    `extra[column]`) holding the rows of the latest generation batch (deques of length
    generation_batch_size)."""

    def __init__(self, maxlen: int, multimodal: bool = True):
        self.maxlen = maxlen
        self.multimodal = multimodal  # log_multimodal: without it no image is kept (as TRL)
        self.prompt: deque = deque(maxlen=maxlen)
        self.completion: deque = deque(maxlen=maxlen)
        self.rewards: dict[str, deque] = {}
        self.advantages: deque = deque(maxlen=maxlen)
        self.extra: dict[str, deque] = {}
        self.images: deque = deque(maxlen=maxlen)

    def __getitem__(self, key: str):  # TRL code reads trainer._logs["extra"] etc.
        return getattr(self, key)

    def record(
        self,
        prompts: list,
        completions: list,
        rewards: dict[str, list[float]],
        advantages: list[float],
        extra: dict[str, list],
        images: list[list] | None = None,
    ) -> None:
        self.prompt.extend(as_text(p) for p in prompts)
        if self.multimodal:
            self.images.extend(images if images is not None else [[] for _ in prompts])
        self.completion.extend(as_text(c) for c in completions)
        for name, values in rewards.items():
            self.rewards.setdefault(name, deque(maxlen=self.maxlen)).extend(values)
        self.advantages.extend(advantages)
        for column, values in extra.items():
            self.extra.setdefault(column, deque(maxlen=self.maxlen)).extend(values)

    def record_rollout(self, rollout, reward_names: list[str], gather_object=None) -> None:
        """A generation batch (rloo.rollout.Rollout): every process's rows (gather_object across
        processes, None for one), with each reward function's values, the advantages and the
        log_extra columns."""
        prompts, texts = list(rollout.prompts), list(rollout.completion_texts)
        images = list(rollout.images or [[] for _ in prompts]) if self.multimodal else None
        per_rank = [(len(rollout), rollout.extra_columns)]
        if gather_object is not None:
            prompts, texts = gather_object(prompts), gather_object(texts)
            per_rank = gather_object(per_rank)
            images = gather_object(images) if self.multimodal else None
        keys = sorted({key for _, columns in per_rank for key in columns})
        extra = {
            key: [
                value for rows, columns in per_rank for value in (columns.get(key) or [None] * rows)
            ]
            for key in keys
        }
        rewards = {
            name: rollout.rewards_per_func[:, index].tolist()
            for index, name in enumerate(reward_names)
        }
        self.record(prompts, texts, rewards, rollout.all_advantages.tolist(), extra, images)

    def rows(self, step: int, unique_prompts: bool = False) -> list[dict]:
        """The table's rows; with log_multimodal and images in the batch, each row's images (a
        list) under "images"."""
        with_images = self.multimodal and any(self.images)
        rows, seen = [], set()
        for index, prompt in enumerate(self.prompt):
            if unique_prompts:
                if prompt in seen:
                    continue
                seen.add(prompt)
            row = {"step": step, "prompt": prompt, "completion": self.completion[index]}
            if with_images:
                row["images"] = list(self.images[index])
            for name, values in self.rewards.items():
                row[name] = values[index] if index < len(values) else None
            for column, values in self.extra.items():
                row[column] = values[index] if index < len(values) else None
            row["advantage"] = self.advantages[index]
            rows.append(row)
        return rows


def _cell(value: Any) -> str:
    if isinstance(value, list):  # a row's images: the terminal shows how many
        return f"<{len(value)} image{'' if len(value) == 1 else 's'}>"
    if isinstance(value, float):
        return "None" if math.isnan(value) else f"{value:.2f}"
    return "None" if value is None else str(value)


def print_table(
    rows: list[dict], step: int, num_to_print: int | None, seed: int = 0, console=None
) -> None:
    from rich.console import Console
    from rich.table import Table

    if num_to_print is not None and len(rows) > num_to_print:
        rows = random.Random(seed + step).sample(rows, num_to_print)
    if not rows:
        return
    table = Table(title=f"Completions at step {step}", show_lines=True)
    for column in rows[0]:
        if column != "step":
            table.add_column(
                column, overflow="fold", style="bold cyan" if column == "advantage" else None
            )
    for row in rows:
        table.add_row(*[_cell(value) for key, value in row.items() if key != "step"])
    (console or Console()).print(table)
