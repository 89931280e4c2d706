"""The one interface every generation backend implements; the trainer talks to nothing else."""

from __future__ import annotations

from torch import nn


class GenerationBackend:
    """Turns prompt token ids into completion token ids (EOS included, nothing after it).

    `generate` is called by every rank with that rank's rows, `num_generations` consecutive rows per prompt and the
    optimizer step the weights belong to. Backends that hold their own copy of the weights (a vLLM server or
    engine) push them in `sync_weights` when that step changed; in-process backends use the live model and need
    nothing. `sleep` / `wake_up` release and restore a backend's memory between generations where it has any."""

    def generate(self, model: nn.Module, prompt_ids: list[list[int]], num_generations: int, step: int
                 ) -> list[list[int]]:
        raise NotImplementedError

    def sync_weights(self, model: nn.Module, step: int) -> None:
        """Make the backend generate from `model`'s current weights (no-op for in-process backends)."""

    def sleep(self) -> None:
        """Release memory until the next generation (no-op where there is nothing to release)."""

    def wake_up(self) -> None:
        """Undo `sleep`."""

    def pop_metrics(self) -> dict[str, float]:
        """Backend metrics since the last call (sync seconds and bytes, ...), logged with the step."""
        return {}
