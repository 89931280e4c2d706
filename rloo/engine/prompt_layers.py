"""A shared prompt's backward run layer by layer with its completions'
(`rloo.engine.shared_prompts.shared_prompt_logits`).

The distinct prompts go through the decoder first, their rows' completions after, attending to the
prompts' keys and values. Autograd runs a node once everything made after it has run, so every
prompt layer's backward waited for the whole completions' backward: all the prompts' activations
stayed alive to its end, where every weight's gradient is already made and the step's memory peaks.
Here the prompts' graph is cut at each decoder layer's input (and the final norm's): prompt layer L
is a segment from its input leaf to its keys, values and output. Its backward runs in an autograd
node made in the completions' layer L forward, where their attention reads those keys and values, so
within the completions' layer L backward, and that layer's prompt activations go there.

A weight's gradient is still set once per backward, by autograd: the segment keeps its weights'
gradients, the weights wait for its node, and a hook on each adds the completions' gradient into the
prompts' in place, the one sum of the same two terms autograd made before. The gradients are bitwise
the same (tests/test_models.py); what it saves: benchmarks/bench_prompt_layers.py and
docs/performance.md."""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Iterator

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge


class PromptLayers:
    """The segments of one prompts' forward, by index (each decoder layer's, then the final norm's
    at len(layers)): the leaf each ran on, its outputs and parameters; in the backward, each leaf's
    gradient for the segment below and the parameters' gradients for their hooks."""

    def __init__(self, decoder: nn.Module):
        self.modules = [*decoder.layers, decoder.norm]
        # (the prompts' forward only)
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.leaves: dict[int, torch.Tensor] = {}
        self.below: torch.Tensor | None = None  # the first layer's input, where it needs a gradient
        self.grads: dict[int, torch.Tensor | None] = {}
        self.params: dict[int, list[torch.Tensor]] = {}
        # Each segment's outputs as autograd edges (not tensors: a view would keep its base's memory
        # alive).
        self.outputs: dict[int, list[GradientEdge | None]] = {}
        # Each segment parameter's gradient from the prompts, until its hook adds the completions'
        # into it.
        self.stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handles: list = []
        self.queued = False
        weakref.finalize(self, _remove, self.handles)  # (a forward never backpropagated)

    @staticmethod
    def applies(decoder: nn.Module | None) -> bool:
        """A decoder with `layers` and a final `norm` whose parameters get gradients, none of them
        with a hook of its own (autograd would also call it on the prompts' part, which a segment's
        backward captures)."""
        if (
            decoder is None
            or not torch.is_grad_enabled()
            or not isinstance(getattr(decoder, "layers", None), nn.ModuleList)
            or not isinstance(getattr(decoder, "norm", None), nn.Module)
        ):
            return False
        trainable = [p for p in decoder.parameters() if p.requires_grad]
        return bool(trainable) and not any(p._backward_hooks for p in trainable)

    @contextlib.contextmanager
    def cut(self) -> Iterator[None]:
        """Inside (the prompts' forward), each layer and the final norm run on a leaf detached from
        their input."""

        def pre_hook(index: int):
            def swap(module, args, kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                leaf = hidden.detach().requires_grad_(hidden.requires_grad)
                self.inputs[index] = (hidden, leaf)
                return (
                    ((leaf, *args[1:]), kwargs)
                    if args
                    else (args, {**kwargs, "hidden_states": leaf})
                )

            return swap

        handles = [
            module.register_forward_pre_hook(pre_hook(index), with_kwargs=True)
            for index, module in enumerate(self.modules)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def segments_found(
        self, keys_values: list[tuple[torch.Tensor, torch.Tensor]], last: torch.Tensor
    ) -> bool:
        """Record each segment's outputs and check that its graph reaches no leaf but its own input
        and its module's parameters (False: a layer that uses anything else, which its segment's
        backward would miss)."""
        count, taken = len(self.modules) - 1, set()
        if len(keys_values) != count or set(self.inputs) != set(range(count + 1)):
            return False
        for index in range(count + 1):
            outputs = (*keys_values[index], self.inputs[index + 1][0]) if index < count else (last,)
            own = {id(p): p for p in self.modules[index].parameters() if p.requires_grad}
            found = _leaves(outputs)
            leaf = self.inputs[index][1]
            if any(id(t) not in own and t is not leaf or id(t) in taken for t in found):
                # (also a parameter two layers share: one hook, one prompts' part each)
                return False
            taken.update(id(t) for t in found)
            self.outputs[index] = [
                get_gradient_edge(t) if t.requires_grad else None for t in outputs
            ]
            self.params[index] = [own[id(t)] for t in found if t is not leaf]
            self.leaves[index] = leaf
        first = self.inputs[0][0]
        self.below = first if first.requires_grad else None
        self.inputs.clear()
        return True

    def boundary(self, index: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`tensors` (segment `index`'s keys and values, or the final norm's output) for the
        completions, detached behind one node whose backward runs the segment's."""
        below = self.below if index == 0 else None
        # (a node even where nothing else needs a gradient)
        anchor = torch.zeros((), device=tensors[0].device, requires_grad=True)
        for param in self.params[index]:
            self.handles.append(
                param.register_hook(functools.partial(_add_prompt_side, self.stash, id(param)))
            )
        # (`tensors` not inputs)
        return _Boundary.apply(self, index, tensors, anchor, below, *self.params[index])


def _add_prompt_side(
    stash: dict[int, tuple[torch.Tensor, torch.Tensor]], key: int, grad: torch.Tensor
) -> torch.Tensor:
    """A segment parameter's hook: the gradient autograd is about to set (the completions') added in
    place into the prompts' part; autograd sets that sum, or adds it to the gradient there, as it
    did with its own sum before."""
    found = stash.pop(key, None)
    return grad if found is None else found[1].add_(grad)


def _remove(handles: list) -> None:
    while handles:
        handles.pop().remove()


def _finish(segments: PromptLayers) -> None:
    """At the backward's end: the hooks go, and a prompts' part whose hook never ran (no gradient
    from the completions) is added to its parameter's gradient."""
    _remove(segments.handles)
    with torch.no_grad():
        for param, grad in segments.stash.values():
            param.grad = grad if param.grad is None else param.grad.add_(grad)
    segments.stash.clear()


class _Boundary(torch.autograd.Function):
    """(segments, index, tensors, anchor, below, *params) -> `tensors`, detached (not inputs: the
    graph behind them is the segment's, run here). Backward: the segment's, from their gradients and
    the next segment's input gradient; it keeps the parameters' gradients for their hooks and its
    input's for the segment below (the first segment's goes to `below`, the embeddings' output)."""

    @staticmethod
    def forward(ctx, segments, index, tensors, anchor, below, *params):
        ctx.segments, ctx.index, ctx.with_below = segments, index, below is not None
        return tuple(tensor.detach() for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads):
        segments, index = ctx.segments, ctx.index
        outputs = segments.outputs.pop(index)
        grads = list(grads)
        if index < len(segments.modules) - 1:
            if index + 1 not in segments.grads:
                raise RuntimeError(
                    f"the prompts' layer {index + 1} backward has not run before layer {index}'s"
                )
            grads.append(segments.grads.pop(index + 1))
        pairs = [
            (out, grad) for out, grad in zip(outputs, grads) if grad is not None and out is not None
        ]
        leaf = segments.leaves.pop(index)
        params = segments.params.pop(index)
        wanted = [*([leaf] if leaf.requires_grad else []), *params]
        found = (
            list(
                torch.autograd.grad(
                    [out for out, _ in pairs],
                    wanted,
                    [grad for _, grad in pairs],
                    allow_unused=True,
                )
            )
            if pairs and wanted
            else [None] * len(wanted)
        )
        leaf_grad = found.pop(0) if leaf.requires_grad else None
        for param, grad in zip(params, found):
            if grad is not None:
                # (not a view: nothing else holds its memory)
                segments.stash[id(param)] = (param, grad.detach())
        if index > 0:
            segments.grads[index] = leaf_grad
        if not segments.queued:  # (the first segment to run: the final norm's)
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_finish, segments)
            )
            segments.queued = True
        below = leaf_grad if index == 0 and ctx.with_below else None
        # The parameters' gradients wait for this node: their hooks find the prompts' part here.
        return (None, None, None, None, below, *([None] * len(params)))


def _leaves(outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The leaves requiring a gradient that `outputs`' graph reaches, each once."""
    seen, found, stack = set(), {}, [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found[id(variable)] = variable
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())
