"""Activations of the training forward that autograd would keep, recomputed in the backward from
tensors it keeps anyway: the RMSNorm's normalised input and its output, the gated MLP's activation
and its product with the up projection. Each is a few elementwise operations on tensors the graph
holds in any case (the norm's input and inverse root mean square, the gate and up projections), so
its memory is not held from the forward to the backward; recomputed from the same values by the same
operations, it is bitwise the tensor the forward made, and the gradients are the model's own.
Likewise the keys and values that SDPA attention keeps after `repeat_kv` copied each key/value head
once per query head of its group: the copy is made again from the un-repeated heads, a fraction of
its size.

It applies to the registered RMSNorm and gated-MLP classes whose self-check passed
(rloo.engine.registry); any other module runs as it is. What it saves: docs/design.md."""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Iterator

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from transformers.integrations import sdpa_attention

from rloo.engine.registry import kind_of
from rloo.zero import is_partitioned


class _Recipe:
    """How to make a saved tensor again: its base's recomputation and the view of that base that was
    saved."""

    __slots__ = ("make", "size", "stride", "offset")

    def __init__(self, make: Callable[[], torch.Tensor], view: torch.Tensor):
        self.make, self.size = make, view.size()
        self.stride, self.offset = view.stride(), view.storage_offset()

    def __call__(self) -> torch.Tensor:
        return self.make().as_strided(self.size, self.stride, self.offset)


class _Recipes:
    """Tensors that can be made again, by their memory: a saved tensor that is one of them, or a
    view of one (a linear layer saves its input flattened to two dimensions), is packed as its
    recipe."""

    def __init__(self):
        self._by_pointer: dict[int, tuple[weakref.ref, Callable[[], torch.Tensor], int]] = {}

    def add(self, tensor: torch.Tensor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.numel():
            self._by_pointer[tensor.data_ptr()] = (weakref.ref(tensor), make, tensor._version)
        return tensor

    def pack(self, saved: torch.Tensor):
        if saved.layout is not torch.strided or not saved.numel():
            return saved
        entry = self._by_pointer.get(saved.untyped_storage().data_ptr())
        if entry is None:
            return saved
        base = entry[0]()
        # Alive, so the memory is still its own; the same values it was made with (not changed in
        # place since).
        if base is None or base.dtype != saved.dtype or base._version != entry[2]:
            return saved
        return _Recipe(entry[1], saved)

    def close(self) -> None:
        """No more packing: each recipe packed keeps what it needs, the rest goes (every tensor
        saved under the hooks keeps `pack`, so this object lives until the whole graph's backward is
        done)."""
        self._by_pointer.clear()

    @staticmethod
    def unpack(packed):
        return packed() if isinstance(packed, _Recipe) else packed


def _norm_forward(
    module: nn.Module, recipes: _Recipes, hidden_states: torch.Tensor
) -> torch.Tensor:
    # LlamaRMSNorm.forward, operation for operation, with the tensors made from the kept ones
    # registered.
    input_dtype = hidden_states.dtype
    hidden = hidden_states.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    scale = torch.rsqrt(variance + module.variance_epsilon)
    normed = recipes.add(hidden * scale, lambda: hidden * scale)
    cast = normed.to(input_dtype)
    if cast is not normed:
        recipes.add(cast, lambda: (hidden * scale).to(input_dtype))
    return recipes.add(
        module.weight * cast, lambda: module.weight * (hidden * scale).to(input_dtype)
    )


def _mlp_forward(module: nn.Module, recipes: _Recipes, x: torch.Tensor) -> torch.Tensor:
    # LlamaMLP.forward in the same order: gate projection, activation, up projection, product, down
    # projection.
    gate = module.gate_proj(x)
    activated = recipes.add(module.act_fn(gate), lambda: module.act_fn(gate))
    up = module.up_proj(x)
    product = recipes.add(activated * up, lambda: module.act_fn(gate) * up)
    return module.down_proj(product)


def _repeat_kv(
    recipes: _Recipes, repeat: Callable, hidden_states: torch.Tensor, n_rep: int
) -> torch.Tensor:
    repeated = repeat(hidden_states, n_rep)
    if repeated is not hidden_states:
        recipes.add(repeated, lambda: repeat(hidden_states, n_rep))
    return repeated


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The model's modules with activation checkpointing on (transformers' `gradient_checkpointing`
    flag)."""
    return [
        module
        for module in model.modules()
        if getattr(module, "gradient_checkpointing", False) is True
    ]


def checkpointed_or_sharded(model: nn.Module) -> bool:
    """Whether a forward through the model replays layers in backward (activation checkpointing) or
    gathers ZeRO-3-partitioned weights in hooks: what keeps a forward from being rearranged around
    its modules."""
    return bool(checkpointed_layers(model)) or is_partitioned(model)


def covered_modules(model: nn.Module) -> int:
    """How many of the model's modules `recomputed_activations` would cover."""
    return sum(kind_of(module) in ("norm", "mlp") for module in model.modules())


@contextlib.contextmanager
def recomputed_activations(model: nn.Module | None) -> Iterator[int]:
    """Inside, with gradients on: the model's Llama-style norms and MLPs keep no activation the
    backward can make again (see the module's docstring); yields how many modules that covers (0:
    the model runs as it is). None runs as it is, and so do a model with checkpointed layers (they
    keep nothing anyway), one sharded by ZeRO-3 (a norm's weight is gathered again only for its own
    backward) and modules with forward wrappers of their own (offloading hooks)."""
    if model is None or not torch.is_grad_enabled() or checkpointed_or_sharded(model):
        yield 0
        return
    recipes = _Recipes()
    forwards = {"norm": _norm_forward, "mlp": _mlp_forward}
    patched = [
        module
        for module in model.modules()
        if kind_of(module) in forwards and "forward" not in module.__dict__
    ]
    for module in patched:
        module.forward = functools.partial(forwards[kind_of(module)], module, recipes)
    repeat = sdpa_attention.repeat_kv  # a module global, looked up by SDPA attention at each call
    sdpa_attention.repeat_kv = functools.partial(_repeat_kv, recipes, repeat)
    try:
        with saved_tensors_hooks(recipes.pack, recipes.unpack):
            yield len(patched)
    finally:
        recipes.close()
        sdpa_attention.repeat_kv = repeat
        for module in patched:
            del module.forward
