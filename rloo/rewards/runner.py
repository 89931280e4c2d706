"""Running reward functions and reward models: the reward-function contract of the TRL docs.

A reward function is called with keyword arguments `prompts`, `completions`, `completion_ids`,
`trainer_state`, `log_extra`, `log_metric` and every dataset column except `prompt`, and returns one
float (or None: "does not apply") per completion; bools, numpy and torch numbers count as floats
(True is 1.0), as in TRL. `async def` functions are awaited concurrently.
NaN or inf is refused naming the function and row (or read as None with nonfinite="none"); with a
timeout, a call that does not return in time is an error naming the function and the prompts (an
async one is cancelled; a sync one, run in a worker thread, is abandoned there).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from rloo.data import is_conversational

logger = logging.getLogger(__name__)


class RewardFunctionError(ValueError):
    """A reward function broke the contract; the message names the function and the row."""


class RewardTimeoutError(RewardFunctionError, TimeoutError):
    """A reward function did not return within reward_timeout."""


def reward_function_name(func: Any) -> str:
    if isinstance(func, nn.Module):
        return (
            str(getattr(func.config, "_name_or_path", type(func).__name__))
            .rstrip("/")
            .split("/")[-1]
        )
    while isinstance(func, functools.partial):
        func = func.func
    name = getattr(func, "__name__", None)
    return name if name is not None else type(func).__name__


def is_async_reward(func: Any) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
        getattr(func, "__call__", None)
    )


class _AsyncLoop:
    """One daemon event loop thread, so async rewards run concurrently even inside a running
    loop."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="rloo-reward-loop"
        )
        self.thread.start()

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


class ExtraLog:
    """Collects log_extra columns and log_metric values produced by reward functions for one
    batch."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self.columns: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def log_extra(self, column: str, values: list) -> None:
        values = list(values)
        if len(values) != self.num_rows:
            raise RewardFunctionError(
                f"log_extra({column!r}, ...) got {len(values)} values for {self.num_rows} rows"
            )
        self.columns[column] = values

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))


def _check_output(
    name: str, output: Any, num_rows: int, rows_desc: Callable[[int], str], nonfinite: str = "error"
) -> list[float]:
    if output is None or isinstance(output, (str, bytes)) or not hasattr(output, "__len__"):
        raise RewardFunctionError(
            f"reward function '{name}' returned {type(output).__name__}; it must return a list "
            f"with one float (or None) per completion ({num_rows} here)."
        )
    # tensors and numpy arrays as Python numbers; bools (`[c == answer ...]`) are 1.0 / 0.0, as TRL
    values = (
        output.tolist()
        if hasattr(output, "tolist") and not isinstance(output, list)
        else list(output)
    )
    if len(values) != num_rows:
        raise RewardFunctionError(
            f"reward function '{name}' returned {len(values)} values for {num_rows} completions; "
            "it must return exactly one float (or None) per completion, in order."
        )
    result = []
    for row, value in enumerate(values):
        if hasattr(value, "item") and not isinstance(value, (str, bytes)):
            value = value.item()  # a numpy or torch scalar
        if value is None:
            result.append(math.nan)
        elif not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"reward function '{name}' returned {value!r} ({type(value).__name__}) for row "
                f"{row} ({rows_desc(row)}); rewards must be numbers or None."
            )
        elif not math.isfinite(float(value)) and nonfinite == "error":
            raise RewardFunctionError(
                f"reward function '{name}' returned {float(value)} for row {row} "
                f"({rows_desc(row)}). Fix: return a finite number, or None where the reward does "
                "not apply (or set nonfinite_rewards='none' to read NaN/inf as None)."
            )
        else:
            result.append(float(value) if math.isfinite(float(value)) else math.nan)
    return result


class RewardRunner:
    """Turns completions into the (rows, functions) reward matrix, NaN where a function returned
    None."""

    def __init__(
        self,
        reward_funcs: list,
        reward_processing_classes: list,
        chat_template_kwargs: dict | None = None,
        timeout: float | None = None,
        nonfinite: str = "error",
    ):
        self.reward_funcs = reward_funcs
        self.timeout = timeout
        self.nonfinite = nonfinite
        self.processing_classes = reward_processing_classes
        self.names = [reward_function_name(f) for f in reward_funcs]
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._loop = _AsyncLoop() if any(is_async_reward(f) for f in reward_funcs) else None
        # called as each function returns (the trainer's StepTimer.advance: the stall watchdog
        # then takes a slow batch of several functions for one that progresses)
        self.progress: Callable[[], None] = lambda: None

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        columns: dict[str, list],
        trainer_state: Any,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, ExtraLog]:
        num_rows = len(prompts)
        extra = ExtraLog(num_rows)
        kwargs = dict(
            columns,
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids,
            trainer_state=trainer_state,
            log_extra=extra.log_extra,
            log_metric=extra.log_metric,
        )

        def describe(row: int) -> str:
            return f"prompt {str(prompts[row])[:60]!r}"

        def late(index: int) -> RewardTimeoutError:
            shown = list(dict.fromkeys(str(p)[:60] for p in prompts))
            fate = (
                "cancelled"
                if is_async_reward(self.reward_funcs[index])
                else "abandoned in its thread"
            )
            return RewardTimeoutError(
                f"reward function '{self.names[index]}' did not return within "
                f"reward_timeout={self.timeout} s ({fate}) on a batch of {num_rows} completions of "
                f"the prompts {shown[:3]}{' ...' if len(shown) > 3 else ''}. Fix: make it faster "
                "(or async), or raise reward_timeout."
            )

        outputs: dict[int, list[float]] = {}
        async_indices = []
        for index, func in enumerate(self.reward_funcs):
            name = self.names[index]
            if isinstance(func, PreTrainedModel):
                output = self._score_with_model(
                    func, self.processing_classes[index], prompts, completions
                )
            elif is_async_reward(func):
                async_indices.append(index)
                continue
            else:
                try:
                    output = self._call(func, kwargs, lambda: late(index))
                except RewardTimeoutError:
                    raise
                except Exception as err:  # the user's code: name it and find the row
                    raise self._locate_failure(index, kwargs, num_rows, describe, err) from err
            outputs[index] = _check_output(name, output, num_rows, describe, self.nonfinite)
            self.progress()
        if async_indices:

            async def bounded(index):
                try:
                    return await asyncio.wait_for(self.reward_funcs[index](**kwargs), self.timeout)
                except asyncio.TimeoutError:
                    return late(index)
                finally:
                    self.progress()

            async def gather():
                return await asyncio.gather(
                    *(bounded(i) for i in async_indices), return_exceptions=True
                )

            for index, output in zip(async_indices, self._loop.run(gather())):
                if isinstance(output, RewardTimeoutError):
                    raise output
                if isinstance(output, BaseException):
                    raise RewardFunctionError(
                        f"reward function '{self.names[index]}' raised "
                        f"{type(output).__name__}: {output}"
                    ) from output
                outputs[index] = _check_output(
                    self.names[index], output, num_rows, describe, self.nonfinite
                )
        matrix = torch.tensor(
            [outputs[i] for i in range(len(self.reward_funcs))], dtype=torch.float32
        ).T.reshape(num_rows, len(self.reward_funcs))
        unscorable = torch.isnan(matrix).all(dim=1).nonzero().flatten().tolist()
        if unscorable:  # TRL's warning, word for word where users and tests match on it
            row = unscorable[0]
            shown = {key: values[row] for key, values in columns.items()}
            shown.update(prompt=prompts[row], completion=completions[row])
            logger.warning(
                "All reward functions returned None for the following kwargs:\n%s\nPlease ensure "
                "that at least one reward function returns a valid reward (%d of %d completions "
                "here; they get advantage 0).",
                shown,
                len(unscorable),
                num_rows,
            )
        return matrix.to(device), extra

    def _call(self, func, kwargs: dict, timed_out: Callable[[], Exception]):
        """func(**kwargs); with a timeout, in a daemon thread (same grad mode) that is abandoned
        when it is late."""
        if self.timeout is None:
            return func(**kwargs)
        outcome, grad = {}, torch.is_grad_enabled()

        def target():
            try:
                with torch.set_grad_enabled(grad):
                    outcome["value"] = func(**kwargs)
            except BaseException as err:  # re-raised in the caller's thread
                outcome["error"] = err

        thread = threading.Thread(target=target, daemon=True, name="rloo-reward-call")
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise timed_out()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _locate_failure(
        self, index: int, kwargs: dict, num_rows: int, describe, err: Exception
    ) -> Exception:
        """Re-run the failing function one row at a time to name the first row that raises."""
        name = self.names[index]
        for row in range(num_rows):
            row_kwargs = {
                key: value[row : row + 1]
                if isinstance(value, list) and len(value) == num_rows
                else value
                for key, value in kwargs.items()
            }
            row_kwargs["log_extra"] = lambda *a, **k: None
            row_kwargs["log_metric"] = lambda *a, **k: None
            try:
                self._call(
                    self.reward_funcs[index],
                    row_kwargs,
                    lambda: RewardTimeoutError(
                        f"reward function '{name}' raised {type(err).__name__}: {err} on the "
                        f"batch, and re-running it on row {row} ({describe(row)}) alone did not "
                        f"return within reward_timeout={self.timeout} s"
                    ),
                )
            except RewardTimeoutError:
                raise
            except Exception as row_err:
                return RewardFunctionError(
                    f"reward function '{name}' raised {type(row_err).__name__}: {row_err} on row "
                    f"{row} ({describe(row)}, completion {str(kwargs['completions'][row])[:60]!r})"
                )
        return RewardFunctionError(
            f"reward function '{name}' raised {type(err).__name__}: {err} (on the batch of "
            f"{num_rows} rows; no single row reproduces it)"
        )

    def _score_with_model(
        self, model: PreTrainedModel, tokenizer: Any, prompts: list, completions: list
    ) -> list[float]:
        if is_conversational(prompts[0]):
            texts = [
                tokenizer.apply_chat_template(p + c, tokenize=False, **self.chat_template_kwargs)
                for p, c in zip(prompts, completions)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        device = next(model.parameters()).device
        encoded = tokenizer(
            texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        )
        with torch.inference_mode():
            logits = model(
                input_ids=encoded["input_ids"].to(device),
                attention_mask=encoded["attention_mask"].to(device),
            ).logits
        return logits[:, 0].float().cpu().tolist()
