"""Metric accumulation: values appended per generation / micro-step, averaged (NaN dropped) at log
time."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from rloo.algorithm import nanstd

REDUCERS = {"mean": lambda values: sum(values) / len(values), "max": max, "min": min}


class MetricBuffer:
    """Per mode ('train' / 'eval') lists of values; `flush` returns each metric reduced over the
    logging window (the mean, as TRL logs its metrics, or the max / min for a metric added so:
    an extreme averaged over micro-batches would hide the one that was extreme) and clears."""

    def __init__(self):
        self._values: dict[str, dict[str, list[float]]] = {
            "train": defaultdict(list),
            "eval": defaultdict(list),
        }
        self._reduce: dict[str, str] = {}

    def add(self, mode: str, name: str, value: float | torch.Tensor, reduce: str = "mean") -> None:
        if isinstance(value, torch.Tensor):
            value = value.item()
        self._values[mode][name].append(float(value))
        self._reduce[name] = reduce

    def set(self, mode: str, name: str, value: float) -> None:
        """A cumulative metric (num_tokens): the latest value replaces the earlier ones."""
        self._values[mode][name] = [float(value)]

    def flush(self, mode: str) -> dict[str, float | None]:
        result = {}
        for name, values in self._values[mode].items():
            valid = [v for v in values if not math.isnan(v)]
            result[name] = REDUCERS[self._reduce.get(name, "mean")](valid) if valid else None
        self._values[mode].clear()
        return result


def tensor_stats(values: torch.Tensor) -> tuple[float, float, float]:
    """(mean, min, max) of a 1-D tensor, zeros when empty."""
    if values.numel() == 0:
        return 0.0, 0.0, 0.0
    values = values.float()
    return values.mean().item(), values.min().item(), values.max().item()


def nanmean(values: torch.Tensor) -> float:
    valid = values[~torch.isnan(values)]
    return valid.mean().item() if valid.numel() else math.nan


def nanstd_value(values: torch.Tensor) -> float:
    return nanstd(values.float()).item()
