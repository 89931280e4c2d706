"""The speed layer: faster code for parts of the reference path (`model.generate` for in-process
generation, plain forwards for log-probs) that gives the same gradients for given samples, the same
greedy tokens and the same sampling distribution. Seams toward the trainer: generation through
`rloo.generation.make_generation_backend` (a backend around this package's `DecodeLoop`, or
`model.generate`), the forwards through `rloo.logps.per_token_logps` (`share_prompts`), and the
memory techniques the trainer enters around its loss (`loss_context`). This module is the
package's face: the rest of the project imports nothing from inside it.

One switch turns all of it off: RLOO_ENGINE=reference in the environment, or
RLOOConfig(engine="reference"). `describe` says, in one line, which parts are on for a model and
machine and why the others are off.
"""

from __future__ import annotations

import contextlib
import os

from torch import nn

# (recompute's functions are read through the module, where a test records their calls)
from rloo.engine import heap, kernel, recompute, tied
from rloo.engine.lean import DecodeLoop, customised_generate, supports
from rloo.engine.mapped import mapped_copy, paged_out_after
from rloo.engine.shared_prompts import (
    can_share_prompts,
    kl_forwards_share_prompts,
    shared_prompt_logits,
)
from rloo.engine.tied import tied_rows

__all__ = [
    "DecodeLoop",
    "can_share_prompts",
    "customised_generate",
    "describe",
    "is_fast",
    "keep_freed_memory",
    "kl_forwards_share_prompts",
    "loss_context",
    "mapped_copy",
    "mode",
    "paged_out_after",
    "reference_reason",
    "shared_prompt_logits",
    "supports",
]

ENVIRONMENT = "RLOO_ENGINE"
MODES = ("fast", "reference")


def mode(value: str | None = None) -> str:
    """The engine mode: `value` where given (RLOOConfig.engine), else $RLOO_ENGINE, else 'fast'."""
    chosen = value if value is not None else os.environ.get(ENVIRONMENT, "").strip() or "fast"
    if chosen not in MODES:
        source = "engine" if value is not None else ENVIRONMENT
        raise ValueError(
            f"{source}={chosen!r}: use 'fast' (the speed layer) or 'reference' (model.generate and "
            "plain forwards, the speed layer off)."
        )
    return chosen


def is_fast(value: str | None = None) -> bool:
    return mode(value) == "fast"


@contextlib.contextmanager
def loss_context(model: nn.Module, unwrapped: nn.Module, fast: bool):
    """Around the loss's forward and backward: activations recomputed in the backward
    (rloo.engine.recompute) and a tied embedding's gradient as rows (rloo.engine.tied); nothing in
    reference mode."""
    if not fast:
        yield
        return

    with recompute.recomputed_activations(model), tied_rows(unwrapped):
        yield


def keep_freed_memory(fast: bool) -> None:
    """Freed memory kept in the process for the next step (rloo.engine.heap), where the layer is
    on."""
    if fast:
        heap.keep_freed_memory()


REFERENCE_REASONS = {
    "vision": "a vision-language model: the speed layer's decode loop and forwards take no images",
    "liger": "use_liger_kernel: Liger's kernels replace the model's own modules, which the speed "
    "layer's forwards would bypass",
}


def reference_reason(vision: bool, use_liger_kernel: bool) -> str | None:
    """Why a model takes the reference path whatever the engine mode (a key of REFERENCE_REASONS),
    or None."""
    return "vision" if vision else "liger" if use_liger_kernel else None


def describe(
    fast: bool,
    model: nn.Module,
    generated_by: str | None,
    reference: nn.Module | None,
    forced: str | None = None,
) -> str:
    """One line: each part of the speed layer, on or off and why, for this model and machine
    (`generated_by`: None where the decode loop generates, else the backend that does; `forced`:
    why it takes the reference path whatever the mode, from reference_reason)."""
    from accelerate.utils import extract_model_from_parallel as unwrapped

    model, reference = unwrapped(model), reference and unwrapped(reference)
    if forced is not None:
        return (
            f"rloo engine: reference ({REFERENCE_REASONS[forced]}): model.generate and plain "
            "forwards"
        )
    if not fast:
        return (
            f"rloo engine: reference ({ENVIRONMENT}=reference or engine='reference'): "
            "model.generate and plain forwards; no fast path on"
        )

    parts = []
    if generated_by is None:
        library = kernel.for_decoding() if _on_cpu(model) else None
        build = (
            "torch step"
            if library is None
            else "C kernel, AVX-512 build"
            if library.vector_floats() == 16
            else "C kernel, AVX2 build"
        )
        parts.append(f"decode loop: on ({build})")
    else:
        parts.append(f"decode loop: off ({generated_by} generates)")
    parts.append(
        "shared prompts: "
        + (
            "on"
            if can_share_prompts(model)
            else "off (this model's forward takes no shareable KV cache)"
        )
    )
    covered = recompute.covered_modules(model)
    parts.append(
        f"recomputed activations: on ({covered} modules)"
        if covered
        else "recomputed activations: off (no registered norm or MLP class)"
    )
    parts.append("tied-embedding rows: " + ("on" if tied.is_tied(model) else "off (untied model)"))
    mapped = reference is not None and getattr(reference, "_rloo_mapping", None) is not None
    parts.append(
        "mapped reference: "
        + (
            "on"
            if mapped
            else "off ("
            + (
                "no separate reference model"
                if reference is None
                else "no disk filesystem to map from"
            )
            + ")"
        )
    )
    parts.append("freed memory kept: " + ("on" if heap.libc() is not None else "off (no glibc)"))
    return "rloo engine: " + "; ".join(parts)


def _on_cpu(model: nn.Module) -> bool:
    parameter = next(model.parameters(), None)
    return parameter is None or parameter.device.type == "cpu"
