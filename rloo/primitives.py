"""Leaf helpers that the trainer and the speed layer (rloo.engine) both use: the log-probability
of chosen tokens, the entropy of a distribution and what kind of model a module is. Imports no
other module of the project, so either side can import it without reaching into the other."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def selective_log_softmax(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per position, one row at a time to bound memory."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, token_ids.unsqueeze(-1)).squeeze(-1)
        normalizer = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - normalizer
    rows = []
    for row_logits, row_ids in zip(logits, token_ids):
        row_logps = F.log_softmax(row_logits.float(), dim=-1)
        rows.append(row_logps.gather(-1, row_ids.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy per position, one row at a time to bound memory (three vocabulary-wide temporaries
    per row)."""
    with torch.no_grad():
        rows = []
        for row in logits:
            logps = F.log_softmax(row.float(), dim=-1)
            rows.append(-(logps.exp() * logps).sum(dim=-1))
        return torch.stack(rows) if rows else logits.new_zeros(logits.shape[:-1])


def is_moe(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "output_router_logits")


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)
