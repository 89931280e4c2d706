"""Which model classes the fast paths take: an explicit registry of the Llama family's RMSNorm,
gated MLP and causal-LM classes, and a numerical self-check the first time each class is met (the
form the fast path assumes against the module's own forward on a tiny input). A class that fails the
check is left to its own forward, with one warning naming it, so a transformers version that changes
a module never changes a number."""

from __future__ import annotations

import functools
import importlib
import logging

import torch
from torch import nn

from rloo.zero import is_partitioned

logger = logging.getLogger(__name__)

# transformers module -> class-name prefix; each family's RMSNorm, MLP and ForCausalLM are Llama's
# forms.
FAMILIES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "smollm3": "SmolLM3",
}
KINDS = {"RMSNorm": "norm", "MLP": "mlp", "ForCausalLM": "causal_lm"}


@functools.cache
def registry() -> dict[type, str]:
    """Each registered class -> 'norm' / 'mlp' / 'causal_lm' (families this transformers lacks are
    skipped)."""
    found = {}
    for family, prefix in FAMILIES.items():
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        for suffix, kind in KINDS.items():
            cls = getattr(module, prefix + suffix, None)
            if cls is not None:
                found[cls] = kind
    return found


_verdicts: dict[type, bool] = {}


def kind_of(module: nn.Module) -> str | None:
    """The registered kind of the module's class, once its self-check has passed; None otherwise."""
    cls = type(module)
    kind = registry().get(cls)
    if kind is None:
        return None
    # (ZeRO-3: weights exist only inside its forward)
    if cls not in _verdicts and not is_partitioned(module):
        _verdicts[cls] = _self_check(module, kind)
        if not _verdicts[cls]:
            logger.warning(
                "rloo engine: %s.forward no longer computes what the fast path assumes; that fast "
                "path "
                "is off for this class (its own forward runs).",
                cls.__qualname__,
            )
    return kind if _verdicts.get(cls, True) else None


@torch.no_grad()
def _self_check(module: nn.Module, kind: str) -> bool:
    """In eval mode and on a forked RNG: the check draws nothing the run would otherwise draw."""
    modes = [(each, each.training) for each in module.modules()]
    devices = [weight.device] if (weight := next(module.parameters())).is_cuda else []
    module.eval()
    try:
        with torch.random.fork_rng(devices=devices):
            return _matches(module, kind)
    finally:
        for each, training in modes:
            each.training = training


def _matches(module: nn.Module, kind: str) -> bool:
    forward = type(module).forward  # the class's own, not a forward a technique put on the instance
    try:
        if kind == "causal_lm":
            ids = torch.tensor([[1, 2, 3]], device=module.lm_head.weight.device)
            own = forward(module, input_ids=ids, use_cache=False).logits
            return torch.allclose(
                own, module.lm_head(module.model(input_ids=ids).last_hidden_state)
            )
        weight = next(module.parameters())
        width = weight.size(-1) if kind == "norm" else module.gate_proj.in_features
        x = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(0)).to(weight)
        own = forward(module, x)
        if kind == "norm":
            hidden = x.to(torch.float32)
            scale = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
            return torch.equal(own, module.weight * (hidden * scale).to(x.dtype))
        return torch.equal(
            own, module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))
        )
    except Exception:  # noqa: BLE001 (a module not of the fast path's form fails the check)
        return False
