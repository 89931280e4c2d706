"""The RLOO mathematics as pure torch functions (tensors in, tensors out).

Notation (spec, "Olhando mais a fundo para o método RLOO"):
  R[i, k]   reward of completion i from reward function k (NaN where the function returned None)
  w[k]      reward_weights
  G         num_generations; rows i = g*G .. g*G+G-1 form the group of prompt g
  KL_i      sum_t (log pi_old(o_i,t) - log pi_ref(o_i,t))   over completion tokens
  r_i       sum_k w_k R[i,k] - beta * KL_i
  b_i       mean of r_j over the scorable siblings j != i of the same group
  A_i       r_i - b_i
  loss      -(1/B) sum_i min(rho_i A_i, clip(rho_i, 1-eps_low, 1+eps_high) A_i),
            rho_i = exp(sum_t log pi_theta(o_i,t) - sum_t log pi_old(o_i,t))
Samples drawn by another sampler mu (vLLM: its numerics, or older weights) get an importance weight
  w_i       exp(sum_t log pi_old(o_i,t) - log mu(o_i,t)), bounded (importance_weights), and
  loss      -(1/B) sum_i w_i min(rho_i A_i, clip(rho_i) A_i)   (sequence modes; w detached)
Nothing here touches models, processes or I/O.
"""

from __future__ import annotations

import torch

NORMALIZE_EPS = 1e-4


def combine_rewards(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    reward_clip_range: tuple[float, float] | None = None,
) -> torch.Tensor:
    """r_i = clip(sum_k w_k R[i,k]) with NaN entries of R dropped from the sum.

    A row where every function returned None (all NaN) is unscorable and gets NaN.
    `reward_clip_range=(lo, hi)` clamps scorable rows; NaN stays NaN.
    """
    if rewards_per_func.dim() != 2:
        raise ValueError(
            f"rewards_per_func must be (rows, functions), got shape {tuple(rewards_per_func.shape)}"
        )
    weights = reward_weights.to(rewards_per_func)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = torch.nansum(rewards_per_func * weights.unsqueeze(0), dim=1)
    rewards = torch.where(unscorable, torch.full_like(rewards, float("nan")), rewards)
    if reward_clip_range is not None:
        low, high = reward_clip_range
        rewards = rewards.clamp(min=low, max=high)  # clamp keeps NaN
    return rewards


def sequence_kl(
    old_per_token_logps: torch.Tensor,
    ref_per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """KL_i = sum_t mask[i,t] (log pi_old[i,t] - log pi_ref[i,t])  (k1 estimator), without
    gradient."""
    with torch.no_grad():
        per_token = (old_per_token_logps - ref_per_token_logps) * completion_mask
        return per_token.sum(dim=1).detach()


def apply_kl_penalty(rewards: torch.Tensor, kl: torch.Tensor, beta: float) -> torch.Tensor:
    """r_i <- r_i - beta * KL_i; the penalty is a constant for the optimiser (detached)."""
    if beta == 0.0:
        return rewards
    return rewards - beta * kl.detach().to(rewards)


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """A_i = r_i - (S_g - r_i) / (n_g - 1) over the scorable (non-NaN) rows of each group.

    Groups are `num_generations` consecutive rows. S_g and n_g are the sum and count of scorable
    rewards in the group. Unscorable rows, and every row of a group with fewer than two scorable
    members, get NaN here (turned into 0 by `finalize_advantages`).
    """
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be split into groups of "
            f"num_generations={num_generations}"
        )
    if num_generations == 1:
        return torch.where(torch.isnan(rewards), rewards, torch.zeros_like(rewards))
    grouped = rewards.view(-1, num_generations)
    scorable = ~torch.isnan(grouped)
    count = scorable.sum(dim=1, keepdim=True).to(rewards.dtype)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    baseline = (total - grouped) / (count - 1)  # count == 1 gives 0/0 = NaN for the lone member
    advantages = grouped - baseline
    return advantages.view(-1)


def normalize_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """A <- (A - mean(A)) / (std(A) + 1e-4) over the whole generation batch, NaN rows ignored."""
    valid = ~torch.isnan(advantages)
    if valid.sum() == 0:
        return advantages
    mean = advantages[valid].mean()
    std = advantages[valid].std() if valid.sum() > 1 else torch.zeros_like(mean)
    return (advantages - mean) / (std + NORMALIZE_EPS)


def finalize_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """NaN (unscorable rows, lone scorable members) -> 0: such rows push nothing."""
    return torch.nan_to_num(advantages, nan=0.0)


def rloo_advantages(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    num_generations: int,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
    reward_clip_range: tuple[float, float] | None = None,
    normalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards -> KL-shaped rewards -> leave-one-out advantages, as the TRL docs chain them.

    Returns (shaped_rewards, advantages); shaped_rewards keep NaN for unscorable rows.
    """
    rewards = combine_rewards(rewards_per_func, reward_weights, reward_clip_range)
    if kl is not None:
        rewards = apply_kl_penalty(rewards, kl, beta)
    advantages = leave_one_out_advantages(rewards, num_generations)
    if normalize:
        advantages = normalize_advantages(advantages)
    return rewards, finalize_advantages(advantages)


def truncated_rows(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    eos_token_ids: list[int],
    pad_token_id: int | None,
) -> torch.Tensor:
    """True for rows whose last real completion token is neither an EOS nor the pad token."""
    lengths = completion_mask.sum(dim=1).long()
    last_index = (lengths - 1).clamp(min=0)
    last_tokens = completion_ids.gather(1, last_index.unsqueeze(1)).squeeze(1)
    stop_ids = list(eos_token_ids) + ([pad_token_id] if pad_token_id is not None else [])
    ends_properly = torch.isin(last_tokens, torch.tensor(stop_ids, device=completion_ids.device))
    return ~ends_properly


def completion_mask_after_eos(
    completion_ids: torch.Tensor, eos_token_ids: list[int]
) -> torch.Tensor:
    """mask[i,t] = 1 for t <= first EOS position of row i (EOS included), all ones if no EOS."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    length = completion_ids.size(1)
    first_eos = torch.full(
        (completion_ids.size(0),), length, dtype=torch.long, device=completion_ids.device
    )
    has_eos = is_eos.any(dim=1)
    first_eos[has_eos] = is_eos.int().argmax(dim=1)[has_eos]
    positions = torch.arange(length, device=completion_ids.device).unsqueeze(0)
    return (positions <= first_eos.unsqueeze(1)).int()


IMPORTANCE_SAMPLING_MODES = (
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "geometric_truncate",
    "geometric_mask",
)


def importance_weights(
    old_per_token_logps: torch.Tensor,
    sampler_per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler-mismatch weights (TRL's vllm_importance_sampling_mode), without gradient, and
    where a bound changed them (bool, same shape).

    sequence_*: w_i = exp(sum_t mask (log pi_old - log mu)), shape (rows,): the exact ratio of the
      sequence's probabilities; *_truncate clamps it to [clip_min, clip_max], *_mask sets it to 0
      outside (a None bound is no bound).
    geometric_*: w_i = exp(mean_t over the completion (log pi_old - log mu)), shape (rows,): the
      per-token geometric mean of the ratio, which does not shrink or grow with the completion's
      length (not the exact ratio: biased, bounded variance), bounded the same way.
    token_*: w_it = exp(log pi_old - log mu) per token, shape (rows, T), bounded the same way; 0
      on masked positions.
    """
    with torch.no_grad():
        difference = (
            old_per_token_logps.float() - sampler_per_token_logps.float()
        ) * completion_mask
        if mode.startswith("sequence"):
            difference = difference.sum(dim=1)
        elif mode.startswith("geometric"):
            difference = difference.sum(dim=1) / completion_mask.sum(dim=1).clamp(min=1)
        ratio = torch.exp(difference)
        low = -float("inf") if clip_min is None else clip_min
        high = float("inf") if clip_max is None else clip_max
        outside = (ratio < low) | (ratio > high)
        if mode.endswith("truncate"):
            weights = ratio.clamp(min=low, max=high)
        elif mode.endswith("mask"):
            weights = ratio.masked_fill(outside, 0.0)
        else:
            raise ValueError(f"unknown importance sampling mode {mode!r}")
        if mode.startswith("token"):
            weights, outside = weights * completion_mask, outside & completion_mask.bool()
        return weights, outside


def clipped_surrogate_loss(
    per_token_logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss = -(1/B) sum_i min(rho_i A_i, clip(rho_i, 1-eps_low, 1+eps_high) A_i).

    rho_i = exp(sum_t mask log pi_theta - old_logps_i): ONE ratio per sequence. Rows with an
    all-zero mask (masked truncated completions) have log pi = old = 0, rho = 1 constant: no
    gradient. Returns the loss and per-sequence clip indicators (low, high, region) for the metrics.

    `importance` (importance_weights, detached): per sequence (rows,), each row's term is scaled by
    w_i; per token (rows, T), token t's share of the gradient of row i's term is scaled by w_it
    (rho_i and its clip keep their values: the weights enter only the gradient's path).
    """
    if importance is not None and importance.dim() == 2:
        weights = importance.detach().to(per_token_logps.dtype)
        # value: exactly log pi_theta (the added term is 0); gradient: w_t d log pi_theta
        per_token_logps = per_token_logps + (weights - 1) * (
            per_token_logps - per_token_logps.detach()
        )
    logps = (per_token_logps * completion_mask).sum(dim=1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    objective = torch.min(ratio * advantages, clipped * advantages)
    if importance is not None and importance.dim() == 1:
        objective = objective * importance.detach().to(objective.dtype)
    loss = -objective.mean()
    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return loss, {"low": low.float(), "high": high.float(), "region": (low | high).float()}


def group_std_is_zero(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Per group: True when the (KL-shaped) rewards of its scorable rows have ~zero spread."""
    grouped = rewards.view(-1, num_generations)
    std = nanstd(grouped, dim=1)
    return torch.isclose(std, torch.zeros_like(std))


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaN; NaN where fewer than two values."""
    if dim is None:
        values = values.reshape(-1)
        dim = 0
    valid = ~torch.isnan(values)
    count = valid.sum(dim=dim).to(values.dtype)
    mean = torch.nansum(values, dim=dim, keepdim=True) / valid.sum(dim=dim, keepdim=True).clamp(
        min=1
    )
    squared = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values))
    variance = squared.sum(dim=dim) / (count - 1)
    return torch.where(count > 1, variance.sqrt(), torch.full_like(variance, float("nan")))
