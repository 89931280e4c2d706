"""The gradient of a weight shared by the input embedding and the LM head (tied, as in SmolLM2,
Qwen2.5, Llama 3.2), made without vocabulary-sized temporaries besides the head's own gradient.

Autograd sums every use of a weight in one buffer before its gradient is set: the head's gradient
(vocabulary x hidden) arrives first, then each embedding lookup's, which PyTorch makes as a dense
vocabulary x hidden table of zeros with the looked-up rows added, and the two are added into a third
table. Here, inside `tied_rows`, the embedding's gradient is only the rows its tokens touch
(PyTorch's own embedding backward over the distinct tokens: the same per-row sums), and one autograd
node over both uses adds those rows into the head's gradient in place: the same values, two
vocabulary-sized tables fewer."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from rloo.zero import is_partitioned


class _TouchedRows(torch.autograd.Function):
    """F.embedding(ids, weight, padding_idx) whose weight gradient is a coalesced sparse tensor of
    the touched rows."""

    @staticmethod
    def forward(
        ctx, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int | None
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.shape, ctx.padding_idx = weight.shape, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        # sorted distinct tokens; each id's row among them
        rows, position = torch.unique(ids, return_inverse=True)
        # PyTorch's "none"; else the padding token's row among the distinct ones (it gets no
        # gradient)
        padding = -1
        if ctx.padding_idx is not None:
            found = (rows == ctx.padding_idx).nonzero()
            padding = int(found[0, 0]) if found.numel() else -1
        sums = torch.ops.aten.embedding_dense_backward(grad, position, rows.numel(), padding, False)
        return (
            torch.sparse_coo_tensor(
                rows.unsqueeze(0), sums, ctx.shape, is_coalesced=True, check_invariants=False
            ),
            None,
            None,
        )


class _Uses(torch.autograd.Function):
    """weight -> (the embedding's view, the head's view): one node that gets both gradients and adds
    the first into the second."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor):
        return weight.view_as(weight), weight.view_as(weight)

    @staticmethod
    def backward(ctx, embedding_grad: torch.Tensor | None, head_grad: torch.Tensor | None):
        if head_grad is None:
            return None if embedding_grad is None else embedding_grad.to_dense()
        if embedding_grad is None:
            return head_grad
        if head_grad.layout is torch.strided and (
            head_grad.is_contiguous() or head_grad.t().is_contiguous()
        ):
            # (the head's product, ours alone; often stored transposed)
            return head_grad.add_(embedding_grad)
        return head_grad + embedding_grad


def _tied_modules(model: nn.Module) -> tuple[nn.Embedding, nn.Linear] | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_input, get_output = (
        getattr(base, "get_input_embeddings", None),
        getattr(base, "get_output_embeddings", None),
    )
    if get_input is None or get_output is None:
        return None
    embedding, head = get_input(), get_output()
    if (
        type(embedding) is not nn.Embedding
        or type(head) is not nn.Linear
        or embedding.weight is not head.weight
    ):
        return None
    if (
        embedding.max_norm is not None
        or embedding.scale_grad_by_freq
        or embedding.sparse
        or "forward" in embedding.__dict__
        or "forward" in head.__dict__
        or is_partitioned(base)
    ):
        return None
    return embedding, head


def is_tied(model: nn.Module) -> bool:
    """Whether `tied_rows` applies to the model's modules (a plain embedding and head sharing one
    weight)."""
    return _tied_modules(model) is not None


@contextlib.contextmanager
def tied_rows(model: nn.Module) -> Iterator[bool]:
    """Inside, with gradients on and a trainable weight tied between the input embedding and the LM
    head (plain nn.Embedding / nn.Linear, not sharded by ZeRO-3): that weight's gradient as the
    module's docstring says; yields whether it applies (otherwise the model runs as it is)."""
    found = _tied_modules(model) if torch.is_grad_enabled() else None
    if found is None or not found[0].weight.requires_grad:
        yield False
        return
    embedding, head = found
    views: list[torch.Tensor] = []

    def uses() -> list[torch.Tensor]:
        # one node for every use inside (a shared prompt's forward and its completions')
        if not views:
            views.extend(_Uses.apply(embedding.weight))
        return views

    embedding.forward = lambda ids: _TouchedRows.apply(uses()[0], ids, embedding.padding_idx)
    head.forward = lambda hidden: F.linear(hidden, uses()[1], head.bias)
    head._rloo_weight = lambda: uses()[1]
    try:
        yield True
    finally:
        del embedding.forward, head.forward, head._rloo_weight


def head_weight(head: nn.Module) -> torch.Tensor | None:
    """The weight a product standing in for `head(x)` uses: the head's view of the tied weight
    inside `tied_rows`, a plain nn.Linear's own weight, None for anything else (a LoRA layer, a
    forward wrapped by hooks, a weight that ZeRO-3 gathers only inside the module's own call)."""
    inside = getattr(head, "_rloo_weight", None)
    if inside is not None:
        return inside()
    plain = type(head) is nn.Linear and "forward" not in head.__dict__ and not is_partitioned(head)
    return head.weight if plain else None
