"""fp32 weights on the CPU packed once per generation call for a small-batch GEMM (the decode step's
projections, rloo.engine.decode): the kernel to use (ours, rloo.engine.kernel, where the CPU has
AVX-512 or AVX2 with FMA; else oneDNN's, MKL's in a build without it), a layer's projections side by
side in one packed matmul, LoRA merged into that copy (the model's own tensors are not touched) or
written out as peft computes it where the weights are not packed."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rloo.engine import kernel as kernel_module


def packable(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and bool(kernels())


def onednn_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """oneDNN's linear on a weight reordered for `rows` rows (the kernel inductor's freezing
    uses)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def mkl_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """MKL's GEMM on a weight packed for `rows` rows (cblas_sgemm_pack). The kernel's fallback for
    other row counts gets a zero-strided stand-in, so that `weight` (a merged or concatenated copy)
    can be freed: LeanDecoder.step refuses other row counts."""
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
    stand_in = weight.new_zeros(()).expand(weight.shape)
    return lambda x: torch.ops.mkl._mkl_linear(x, packed, stand_in, bias, rows)


def kernels() -> dict[str, Callable]:
    """The packed fp32 GEMM kernels here, the one used first: ours (rloo.engine.kernel) where the
    CPU has AVX-512 or AVX2 with FMA and gcc built it, then this torch build's: oneDNN's, then
    MKL's."""
    found = {}
    library = kernel_module.for_decoding()
    if library is not None:
        found["rloo"] = functools.partial(kernel_module.packed_linear, library)
    if torch.backends.mkldnn.is_available():
        found["onednn"] = onednn_linear
    if torch.backends.mkl.is_available():
        found["mkl"] = mkl_linear
    return found


def packed_linear(
    weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None, rows: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> F.linear(x, weight, bias) (a list of weights: side by side) for inputs of `rows` rows
    (fp32 on the CPU): the weight packed once per generation call for the first of `kernels` (ours
    where the CPU has AVX-512 or AVX2 with FMA), else oneDNN's small-batch GEMM, MKL's where the
    build has no oneDNN (MKL's packed copy is several times the weight's size, and on AMD CPUs its
    GEMM is slower)."""
    bias = None if bias is None else bias.detach()
    name, make = next(iter(kernels().items()))
    # (ours packs weights side by side where they are)
    if isinstance(weight, list) and name != "rloo":
        weight = weight[0] if len(weight) == 1 else torch.cat(weight)
    return make(weight, bias, rows)


def lora_parts(module: nn.Module) -> tuple[nn.Linear, torch.Tensor, torch.Tensor, float] | None:
    """(base Linear, A, B, scaling) of a peft LoRA layer with one active, unmerged, plain adapter;
    else None."""
    base = getattr(module, "base_layer", None)
    active = getattr(module, "active_adapters", None)
    if (
        type(base) is not nn.Linear
        or active is None
        or len(active) != 1
        or module.merged
        or module.disable_adapters
    ):
        return None
    name = active[0]
    variant = getattr(module, "lora_variant", {}).get(name)
    if (
        name not in module.lora_A
        or variant is not None
        or module.use_dora.get(name, False)
        or getattr(module, "fan_in_fan_out", False)
    ):
        return None
    down, up = module.lora_A[name].weight.detach(), module.lora_B[name].weight.detach()
    return base, down, up, module.scaling[name]


def weight_parts(
    module: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None] | None:
    """(weight, bias, LoRA (A, B, scaling) or None) of what module(x) applies: a plain Linear or a
    LoRA layer (lora_parts); None for anything else."""
    if type(module) is nn.Linear:
        return module.weight.detach(), module.bias, None
    parts = lora_parts(module)
    if parts is None:
        return None
    base, a, b, scaling = parts
    return base.weight.detach(), base.bias, (a, b, scaling)


def own_linear(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> module(x) where the weights are not packed (not fp32 on the CPU): base + B(A(x)) *
    scaling for a LoRA layer (the order of peft's own forward, without its dispatch), the module
    itself for anything else."""
    parts = lora_parts(module)
    if parts is None:
        return module
    base, a, b, scaling = parts
    return lambda x: base(x) + F.linear(F.linear(x, a), b) * scaling


def merged_into(
    scratch: list[torch.Tensor], weights: list[tuple], side_by_side: bool = False
) -> list[torch.Tensor]:
    """Each (weight, LoRA (A, B, scaling) or None): the weight itself, or W + (B @ A) * scaling
    (peft's merge, one addmm) written into `scratch`'s one buffer (grown as needed, reused by the
    next projection once packed: no fresh pages per projection). `side_by_side`: every weight into
    the buffer, one
    after the other, returned as one tensor (kernels that pack a single weight)."""
    into = [w for w, lora in weights if lora is not None or side_by_side]
    need = sum(w.numel() for w in into)
    if need and (
        not scratch or scratch[0].numel() < need or scratch[0].dtype != weights[0][0].dtype
    ):
        scratch[:] = [weights[0][0].new_empty(need)]
    found, used = [], 0
    for w, lora in weights:
        if lora is None and not side_by_side:
            found.append(w)
            continue
        part = scratch[0][used : used + w.numel()].view(w.shape)
        merged = (
            part.copy_(w)
            if lora is None
            else torch.addmm(w, lora[1], lora[0], alpha=lora[2], out=part)
        )
        found.append(merged)
        used += w.numel()
    return [scratch[0][:used].view(-1, weights[0][0].size(1))] if side_by_side else found


def side_by_side(
    modules: list[nn.Module], rows: int, scratch: list[torch.Tensor] | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> torch.cat([m(x) for m in modules], dim=-1). Packable (fp32 on the CPU) Linear and LoRA
    layers: one packed matmul over their weights side by side (q/k/v and gate/up: fewer, larger
    matmuls a step), LoRA merged first (peft's base(x) + B(A(x)) *
    scaling up to float rounding). Our GEMM packs the weights from where they are (the model's, or
    the merged copy); the others one buffer written with all of them. Otherwise each module's own
    product."""
    found = [weight_parts(module) for module in modules]
    if all(part is not None and packable(part[0]) for part in found):
        # (ours packs the weights side by side where they are; the others one tensor)
        with torch.no_grad():
            one_tensor = next(iter(kernels())) != "rloo" and len(found) > 1
            weights = merged_into(
                [] if scratch is None else scratch, [(w, lora) for w, _, lora in found], one_tensor
            )
            biases = [bias for _, bias, _ in found]
            bias = (
                None
                if all(b is None for b in biases)
                else torch.cat(
                    [
                        b.detach() if b is not None else w.new_zeros(w.size(0))
                        for (w, _, _), b in zip(found, biases)
                    ]
                )
            )
            return packed_linear(weights, bias, rows)
    linears = [own_linear(module) for module in modules]
    if len(linears) == 1:
        return linears[0]
    return lambda x: torch.cat([linear(x) for linear in linears], dim=-1)
