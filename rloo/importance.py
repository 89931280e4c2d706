"""The sampler side of the loss: how far the sampler's (vLLM's) log-probs of its tokens are from the
trainer's, and, with `vllm_importance_sampling_correction`, the importance weights that correct for
it (rloo.algorithm.importance_weights) with their metrics. pi_old for the weights comes from where
the step's plan says (rloo.rollout.PiOld `weights`): the rollout's per-token log-probs, or the
loss's own forward."""

from __future__ import annotations

from typing import Callable

import torch

from rloo import algorithm
from rloo.metrics import MetricBuffer
from rloo.rollout import PiOld, Rollout, global_masked_mean


def sampler_weights(
    args,
    inputs: Rollout,
    token_logps: torch.Tensor,
    metrics: MetricBuffer,
    mode: str,
    gather: Callable,
    pi_old: PiOld,
) -> torch.Tensor | None:
    """The weights for clipped_surrogate_loss's `importance` (None: no correction), after adding
    this micro-batch's sampler metrics; `pi_old`: the step's plan (rloo.rollout.pi_old_plan)."""
    sampler, mask = inputs.sampler_logps, inputs.completion_mask
    if sampler is None:
        return None
    # numerical mismatch, plus the policy's drift when a generation outlives an optimizer step
    difference = (token_logps.detach().float() - sampler).abs() * mask
    metrics.add(mode, "vllm/logprob_diff_mean", global_masked_mean(difference, mask, gather))
    worst = difference.max() if difference.numel() else difference.new_zeros(())
    metrics.add(mode, "vllm/logprob_diff_max", gather(worst.reshape(1)).max(), reduce="max")
    if not args.vllm_importance_sampling_correction:
        return None
    old = token_logps.detach()
    if pi_old.weights == "rollout":
        if inputs.old_token_logps is None:
            raise RuntimeError(
                "the plan takes the weights' pi_old from the rollout, which has none"
            )
        old = inputs.old_token_logps
    weights, outside = algorithm.importance_weights(
        old,
        sampler,
        mask,
        args.vllm_importance_sampling_mode,
        args.vllm_importance_sampling_clip_min,
        args.vllm_importance_sampling_clip_max,
    )
    # over sequences, or over the completion tokens (token modes); a rank with none of them takes
    # no part in the min and max
    counted = torch.ones_like(weights, dtype=torch.bool) if weights.dim() == 1 else mask.bool()
    kept, limited = weights[counted], outside[counted]
    total = gather(weights.new_tensor([kept.numel()])).sum().clamp(min=1)
    metrics.add(
        mode, "sampling/importance_sampling_ratio/mean", gather(kept.sum().reshape(1)).sum() / total
    )
    none = weights.new_tensor([float("inf")])
    metrics.add(
        mode,
        "sampling/importance_sampling_ratio/max",
        gather(kept.max().reshape(1) if kept.numel() else -none).max(),
        reduce="max",
    )
    metrics.add(
        mode,
        "sampling/importance_sampling_ratio/min",
        gather(kept.min().reshape(1) if kept.numel() else none).min(),
        reduce="min",
    )
    metrics.add(
        mode,
        "sampling/importance_sampling_limited_frac",
        gather(limited.to(weights).sum().reshape(1)).sum() / total,
    )
    return weights
