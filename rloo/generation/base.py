"""The one interface every generation backend implements; the trainer talks to nothing else."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rloo.timing import NULL_TIMER


class Completions(list):
    """Completion token ids, one list per row (it is a list: callers index it as one), plus
    per-token log-probs of those same tokens, one list per row, where a backend has them: -
    `logprobs`: the sampler's, from backends that sample with their own copy of the weights (vLLM),
    when sampling is not warped (no top-k/top-p/min-p, repetition penalty or structured outputs,
    which renormalise or mask the distribution); the trainer compares them with its own log-probs
    every step; - `policy_logprobs`: the live policy's log softmax(logits / temperature) of each
    token, from the logits the in-process decode loop computed anyway (whatever processors shaped
    the draw): what a no-grad forward over the finished rows would give, so the rollout takes them
    for pi_old instead of running that forward."""

    def __init__(
        self,
        ids: list[list[int]],
        logprobs: list[list[float]] | None = None,
        policy_logprobs: torch.Tensor | None = None,
    ):
        super().__init__(ids)
        self.logprobs = logprobs
        self.policy_logprobs = policy_logprobs  # (rows, longest completion), 0 after a row's end
        # the optimizer step whose weights sampled them, where a backend samples ahead
        # (asynchronous generation); None: the current one
        self.policy_version: int | None = None


class GenerationBackend:
    """Turns prompt token ids into completion token ids (EOS included, nothing after it).

    `generate` is called by every rank with that rank's rows, `num_generations` consecutive rows per
    prompt and the optimizer step the weights belong to. Backends that hold their own copy of the
    weights (a vLLM server or engine) push them in `sync_weights` when that step changed; in-process
    backends use the live model and need nothing. `sleep` / `wake_up` release and restore a
    backend's memory between generations where it has any. `timer` (set by the trainer, rloo.timing)
    is where a backend counts its weight pushes (`weight_sync`)."""

    timer = NULL_TIMER

    def generate(
        self, model: nn.Module, prompt_ids: list[list[int]], num_generations: int, step: int
    ) -> list[list[int]]:
        """Completion ids per row; vLLM backends return `Completions` with the sampled tokens'
        log-probs."""
        raise NotImplementedError

    @contextlib.contextmanager
    def reusing_weights(self):
        """Calls inside may keep what they derive from the model's weights (rloo.engine.lean: the
        decode step's packed copy) for the next call with the same weights: evaluation's batches of
        one policy. No-op here."""
        yield

    def sync_weights(self, model: nn.Module, step: int) -> None:
        """Make the backend generate from `model`'s current weights (no-op for in-process
        backends)."""

    def sleep(self) -> None:
        """Release memory until the next generation (no-op where there is nothing to release)."""

    def wake_up(self) -> None:
        """Undo `sleep`."""

    def close(self) -> None:
        """Release what the backend holds (an in-process engine, a weight-transfer group) before the
        process group goes away."""

    def checkpoint_state(self) -> dict | None:
        """What a resumed run needs to continue as this one would (every rank calls it)."""
        return None

    def restore(self, state: dict | None) -> None:
        """Undo checkpoint_state on resume."""

    def pop_metrics(self) -> dict[str, float]:
        """Backend metrics since the last call (sync seconds and bytes, ...), logged with the
        step."""
        return {}
