"""One rollout: prompts -> completions -> rewards -> advantages, the data both training and
evaluation use.

`build_rollout` tokenizes the prompts (`prepare_prompts`, unless they were read ahead), generates
through the caller's backend, pads, decodes, scores with the reward runner, folds the KL into the
reward and computes leave-one-out advantages (rloo.algorithm). Where pi_old's log-probs come from
is decided once per trainer and mode (`pi_old_plan`, table in `PiOld`); in the one configuration
where the loss's own forward is the KL's pi_old, the rollout is completed by `complete_rollout`, a
named stage of the step that the loss runs right after that forward. Its collaborators are
arguments (a generate function, the processing class, the reward runner, the log-probs source
rloo.logps.StepLogProbs, the cross-process gather), so it knows nothing of the trainer: the
trainer's `_prepare_inputs` and the pipeline's evaluation stage call this same function.
`rollout_metrics` computes the TRL docs' metrics from a Rollout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rloo import algorithm
from rloo.data import as_completion, is_conversational, pad_rows, tokenize_prompts
from rloo.metrics import nanmean, nanstd_value, tensor_stats
from rloo.models import text_tokenizer_of
from rloo.timing import NULL_TIMER, StepTimer
from rloo.vision import process_prompts, row_images

# Fields holding one entry per local row, in order: what a micro-batch slice takes.
ROW_FIELDS = (
    "prompts",
    "completions",
    "completion_texts",
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "truncated",
    "advantages",
    "old_logps",
    "sampler_logps",
    "old_token_logps",
    "ref_logps",
    "row_index",
    "media",
    "images",
)


class PiOld(NamedTuple):
    """Where one step takes pi_old's log-probs from (`pi_old_plan`). The step runs one way: sample
    prompts -> rollout (generate, score, log-probs, advantages) -> loss -> optimizer step; only in
    the second row does the loss first complete the rollout (`complete_rollout`), from the very
    forward it computes the ratio with (it saves one no-grad forward of the policy per step in the
    default configuration: docs/design.md has the measurement).

    | configuration                          | ratio's pi_old   | KL's pi_old        | kl        |
    |----------------------------------------|------------------|--------------------|-----------|
    | on-policy, beta 0                      | loss forward     | -                  | ""        |
    | on-policy, beta > 0, one micro-batch   | loss forward     | loss forward, in   | "loss"    |
    |   per generation, no dropout; training |                  | complete_rollout   |           |
    | on-policy, beta > 0, otherwise; eval   | loss forward     | rollout forward    | "rollout" |
    | on-policy, kl_logps_from_generation    | loss forward     | decode loop        | "decoder" |
    | off-policy (num_iterations > 1, or a   | rollout forward, | the same forward   | "rollout" |
    |   batch outliving an optimizer step)   | kept per row     |                    |           |

    The importance weights of vllm_importance_sampling_correction (rloo.importance) take pi_old
    per token from the rollout forward where the row above runs one (`weights` "rollout": the
    policy may have moved since sampling), else from the loss forward (`weights` "loss": it has
    not); "" without the correction.

    "loss forward": the loss's own forward, detached (on-policy: the ratio is exactly 1);
    "rollout forward": a no-grad forward in the rollout; "decode loop": the log-probs the decode
    loop computed while sampling. The reference's log-probs always come from a no-grad forward in
    the rollout."""

    kept: bool  # the rollout keeps pi_old per row for the ratio (off-policy)
    kl: str  # "", "loss", "rollout" or "decoder": the KL's pi_old, per the table
    weights: str = ""  # "", "rollout" or "loss": the importance weights' pi_old


def pi_old_plan(args: Any, dropout: bool, mode: str = "train") -> PiOld:
    """The PiOld row for an RLOOConfig in `mode` ("train" or "eval"; `dropout`: the policy draws
    dropout masks, so two forwards differ)."""
    kept = args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps
    if args.beta == 0.0:
        kl = ""
    elif kept:
        kl = "rollout"
    elif args.kl_logps_from_generation:
        kl = "decoder"
    elif mode == "train" and args.steps_per_generation == 1 and not dropout:
        kl = "loss"
    else:
        kl = "rollout"
    weights = ""
    if args.use_vllm and args.vllm_importance_sampling_correction:
        weights = "rollout" if kept or kl == "rollout" else "loss"
    return PiOld(kept, kl, weights)


class Prompts(NamedTuple):
    """A generation batch's prompts as the backend takes them: token ids per row, and for a VLM
    the processor's other inputs per row and the images as the dataset gave them (else None)."""

    ids: list[list[int]]
    media: list[dict] | None
    images: list[list] | None


def prepare_prompts(
    processing_class: Any, rows: list[dict], chat_template_kwargs: dict | None, vision: bool
) -> Prompts:
    """Rows' prompts (and a VLM's images) through the tokenizer or processor: the rollout's first
    stage, and what asynchronous generation does ahead of it (rloo.batches.ReadAhead)."""
    prompts = [row["prompt"] for row in rows]
    if not vision:
        return Prompts(
            tokenize_prompts(processing_class, prompts, chat_template_kwargs), None, None
        )
    images = [row_images(row) for row in rows]
    ids, media = process_prompts(processing_class, prompts, images, chat_template_kwargs)
    return Prompts(ids, media, images)


@dataclass
class RolloutSettings:
    """What shapes a rollout, besides the model: RLOOConfig's values (or evaluation's)."""

    num_generations: int
    pad_token_id: int
    eos_token_ids: list[int]
    reward_weights: torch.Tensor
    beta: float = 0.0
    reward_clip_range: tuple[float, float] | None = None
    normalize_advantages: bool = False
    mask_truncated_completions: bool = False
    pad_to_multiple_of: int | None = None
    chat_template_kwargs: dict | None = None
    # where pi_old's log-probs come from (the table in PiOld)
    pi_old: PiOld = PiOld(kept=False, kl="rollout")
    # a vision-language model: prompts and their images go through the processor (rloo.vision)
    vision: bool = False


@dataclass
class Rollout:
    """Tensors and texts of one generation batch. Row fields (ROW_FIELDS) hold this process's rows;
    the `all_*`, reward and metric fields cover every process's rows (the leave-one-out groups span
    them)."""

    prompts: list
    completions: list  # as reward functions see them (messages for conversational prompts)
    completion_texts: list[str]
    prompt_ids: torch.Tensor  # (rows, prompt_len), left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # (rows, completion_len), right-padded
    # 0 after EOS, and on truncated rows with mask_truncated_completions
    completion_mask: torch.Tensor
    truncated: torch.Tensor  # bool (rows,): no EOS within max_completion_length
    # (rows,) this process's share of all_advantages; None until finished
    advantages: torch.Tensor | None
    old_logps: torch.Tensor | None  # (rows,) sum_t log pi_old, kept only when the loss needs it
    # (rows, completion_len) the sampler's own log-probs (vLLM), else None
    sampler_logps: torch.Tensor | None
    rewards_per_func: torch.Tensor  # (all rows, functions), NaN where a function returned None
    shaped_rewards: torch.Tensor | None  # (all rows,) weighted, clipped, minus beta * KL
    all_advantages: torch.Tensor | None  # (all rows,)
    all_lengths: torch.Tensor  # (all rows,) completion lengths in tokens
    all_truncated: torch.Tensor  # (all rows,)
    num_generations: int
    num_tokens: int  # prompt + completion tokens of all rows
    kl: float | None = None  # mean per-token KL(pi_old || pi_ref) over all completion tokens
    # log_metric values, averaged
    reward_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # log_extra columns, local rows
    extra_columns: dict[str, list] = dataclasses.field(default_factory=dict)
    # Until complete_rollout (PiOld kl "loss"): the settings and first global row to complete with,
    # the reference's per-token log-probs and each row's index in this process's rollout
    # (micro-batches are shuffled).
    pending: tuple[RolloutSettings, int] | None = None
    ref_logps: torch.Tensor | None = None
    row_index: torch.Tensor | None = None
    # a VLM's other inputs per row (pixel_values, image_grid_thw, ...: rloo.vision), else None
    media: list[dict] | None = None
    images: list[list] | None = None  # and its images as the dataset gave them (PIL), per row
    # (rows, completion_len) pi_old per token for the sampler correction's weights where the plan
    # takes it from the rollout (PiOld weights "rollout"; rloo.importance)
    old_token_logps: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, index: torch.Tensor) -> "Rollout":
        """These local rows (a shuffled micro-batch), the whole-batch fields shared."""
        rows = index.tolist()
        picked = {}
        for name in ROW_FIELDS:
            value = getattr(self, name)
            if value is None:
                picked[name] = None
            elif isinstance(value, torch.Tensor):
                picked[name] = value[index.to(value.device)]
            else:
                picked[name] = [value[i] for i in rows]
        return dataclasses.replace(self, **picked)

    def to(self, device) -> "Rollout":
        moved = {
            field.name: getattr(self, field.name).to(device)
            for field in dataclasses.fields(self)
            if isinstance(getattr(self, field.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def global_masked_mean(
    values: torch.Tensor, mask: torch.Tensor, gather: Callable = _local
) -> torch.Tensor:
    """sum(values * mask) / sum(mask) over every process's rows (0 where the mask is empty
    everywhere)."""
    total = gather((values * mask).sum().reshape(1).float())
    count = gather(mask.sum().reshape(1).float())
    return total.sum() / count.sum().clamp(min=1.0)


def build_rollout(
    rows: list[dict],
    settings: RolloutSettings,
    *,
    generate: Callable,
    processing_class: Any,
    reward_runner: Callable,
    trainer_state: Any,
    logprobs: Any = None,
    gather: Callable = _local,
    gather_object: Callable | None = None,
    process_index: int = 0,
    device: torch.device | str = "cpu",
    timer: StepTimer = NULL_TIMER,
    prepared: Prompts | None = None,
) -> Rollout:
    """rows (dataset rows with 'prompt', this process's share, num_generations consecutive copies
    per prompt) -> Rollout.

    prepared: the rows' prompts already through prepare_prompts (read ahead), else done here;
    generate(prompt_id_lists) -> completion id lists (EOS included), or
    rloo.generation.base.Completions whose `policy_logprobs` then stand for pi_old in the KL;
    logprobs (rloo.logps.StepLogProbs, or anything with its `policy` and `reference` methods:
    (input_ids, attention_mask, logits_to_keep, media=None) -> per-token log-probs) answers the
    forwards settings.pi_old asks for (None: a rollout that needs none, beta 0 and on-policy);
    gather(tensor) concatenates a tensor over processes;
    gather_object(list) does the same for Python lists; timer (rloo.timing) counts the generation,
    log-prob and reward sections."""
    prompts = [row["prompt"] for row in rows]
    conversational = is_conversational(prompts[0])
    if prepared is None:
        prepared = prepare_prompts(
            processing_class, rows, settings.chat_template_kwargs, settings.vision
        )
    prompt_id_lists, media, images = prepared
    # the images' tensors travel beside the ids (only for VLMs: text callers never see them); the
    # images themselves go to generation too (vLLM takes them, not tensors)
    with_media = {} if media is None else {"media": media}
    with timer.section("generation"):
        completion_id_lists = generate(
            prompt_id_lists, **with_media, **({} if images is None else {"images": images})
        )

    pad, multiple = settings.pad_token_id, settings.pad_to_multiple_of
    prompt_ids, prompt_mask = (
        t.to(device) for t in pad_rows(prompt_id_lists, pad, "left", multiple)
    )
    completion_ids, completion_mask = (
        t.to(device) for t in pad_rows(completion_id_lists, pad, "right", multiple)
    )
    truncated = algorithm.truncated_rows(
        completion_ids, completion_mask, settings.eos_token_ids, pad
    )
    lengths = torch.tensor([len(ids) for ids in completion_id_lists], device=device)
    prompt_tokens = torch.tensor([sum(len(ids) for ids in prompt_id_lists)], device=device)
    all_lengths, all_truncated = gather(lengths), gather(truncated)
    num_tokens = int((gather(prompt_tokens).sum() + all_lengths.sum()).item())
    if settings.mask_truncated_completions:
        completion_mask = completion_mask * (~truncated).unsqueeze(1).int()

    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    old_per_token = ref_per_token = None
    # the decode loop's, for the KL's pi_old
    decoded = getattr(completion_id_lists, "policy_logprobs", None)
    kept, defer = settings.pi_old.kept, settings.pi_old.kl == "loss" and settings.beta != 0.0
    with torch.no_grad(), timer.section("logprobs"):
        if settings.pi_old.kl == "decoder" and decoded is not None and settings.beta != 0.0:
            old_per_token = torch.zeros(completion_ids.shape, dtype=decoded.dtype, device=device)
            # (ZeRO-3 ranks in step decode past their ends)
            width = min(decoded.size(1), completion_ids.size(1))
            old_per_token[:, :width] = decoded[:, :width].to(device)
        elif (kept or settings.beta != 0.0) and not defer:
            old_per_token = logprobs.policy(input_ids, attention_mask, logits_to_keep, **with_media)
        if settings.beta != 0.0:
            ref_per_token = logprobs.reference(
                input_ids, attention_mask, logits_to_keep, **with_media
            )

    texts = text_tokenizer_of(processing_class).batch_decode(
        completion_id_lists, skip_special_tokens=True
    )
    completions = [as_completion(text, conversational) for text in texts]
    columns = {
        key: [row[key] for row in rows]
        for key in rows[0]
        if key not in ("prompt", "completion", "completion_ids")
    }
    with timer.section("rewards"):
        local_rewards, extra = reward_runner(
            prompts, completions, completion_id_lists, columns, trainer_state, device=device
        )
    rewards_per_func = gather(local_rewards)
    start = process_index * len(rows)
    shaped = advantages = kl_mean = None
    if not defer:
        shaped, advantages, kl_mean = _advantages(
            rewards_per_func, settings, old_per_token, ref_per_token, completion_mask, gather
        )

    sampler_logps = None
    # vLLM's own log-probs of its samples
    if getattr(completion_id_lists, "logprobs", None) is not None:
        sampler_logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=device)
        for row, values in enumerate(completion_id_lists.logprobs):
            sampler_logps[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return Rollout(
        prompts=prompts,
        completions=completions,
        completion_texts=texts,
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=truncated,
        advantages=None if defer else advantages[start : start + len(rows)],
        old_logps=(old_per_token * completion_mask).sum(dim=1) if kept else None,
        sampler_logps=sampler_logps,
        rewards_per_func=rewards_per_func,
        shaped_rewards=shaped,
        all_advantages=advantages,
        all_lengths=all_lengths,
        all_truncated=all_truncated,
        num_generations=settings.num_generations,
        num_tokens=num_tokens,
        kl=kl_mean,
        reward_metrics=_average_reward_metrics(extra.metrics, gather_object),
        extra_columns=extra.columns,
        pending=(settings, start) if defer else None,
        ref_logps=ref_per_token if defer else None,
        row_index=torch.arange(len(rows), device=device) if defer else None,
        media=media,
        images=images,
        old_token_logps=old_per_token
        if settings.pi_old.weights == "rollout" and sampler_logps is not None
        else None,
    )


def _advantages(
    rewards_per_func: torch.Tensor,
    settings: RolloutSettings,
    old_per_token: torch.Tensor | None,
    ref_per_token: torch.Tensor | None,
    completion_mask: torch.Tensor,
    gather: Callable,
) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """(shaped rewards, advantages) of every process's rows and the mean per-token KL (None when
    beta == 0)."""
    kl = kl_mean = None
    if settings.beta != 0.0:
        kl = gather(algorithm.sequence_kl(old_per_token, ref_per_token, completion_mask))
        kl_mean = global_masked_mean(old_per_token - ref_per_token, completion_mask, gather).item()
    shaped, advantages = algorithm.rloo_advantages(
        rewards_per_func,
        settings.reward_weights.to(rewards_per_func.device),
        settings.num_generations,
        kl=kl,
        beta=settings.beta,
        reward_clip_range=settings.reward_clip_range,
        normalize=settings.normalize_advantages,
    )
    # (shaped rewards stay NaN exactly on unscorable rows; the reward runner warns about them)
    return shaped, advantages, kl_mean


def complete_rollout(
    rollout: Rollout, policy_per_token: torch.Tensor, gather: Callable = _local
) -> Rollout:
    """The step's stage for PiOld kl "loss": a rollout left pending -> the complete one: the KL's
    pi_old is `policy_per_token`, the loss's forward of these rows (all of this process's rows, in
    the micro-batch's shuffled order), the rest as build_rollout does it. Every process calls it
    (the leave-one-out groups span them)."""
    settings, start = rollout.pending
    order = rollout.row_index
    if order.numel() != order.max().item() + 1:
        raise RuntimeError("complete_rollout needs all of this process's rows in one micro-batch")
    unshuffle = torch.argsort(order)
    policy, reference = policy_per_token.detach()[unshuffle], rollout.ref_logps[unshuffle]
    shaped, advantages, kl_mean = _advantages(
        rollout.rewards_per_func,
        settings,
        policy,
        reference,
        rollout.completion_mask[unshuffle],
        gather,
    )
    return dataclasses.replace(
        rollout,
        advantages=advantages[start : start + len(rollout)][order.to(advantages.device)],
        shaped_rewards=shaped,
        all_advantages=advantages,
        kl=kl_mean,
        pending=None,
        ref_logps=None,
    )


def _average_reward_metrics(
    metrics: dict[str, list[float]], gather_object: Callable | None
) -> dict[str, float]:
    """log_metric values of every process, averaged per name."""
    local = [(name, sum(values), len(values)) for name, values in sorted(metrics.items())]
    entries = gather_object([local]) if gather_object is not None else [local]
    totals: dict[str, list[float]] = {}
    for rank_entries in entries:
        for name, total, count in rank_entries:
            accumulated = totals.setdefault(name, [0.0, 0])
            accumulated[0] += total
            accumulated[1] += count
    return {name: total / max(count, 1) for name, (total, count) in sorted(totals.items())}


def rollout_metrics(
    rollout: Rollout, reward_names: list[str], reward_weights: torch.Tensor
) -> dict[str, float]:
    """The spec's per-generation metrics (reward, reward_std, rewards/<name>/mean|std,
    frac_reward_zero_std, kl, completions/*), over every process's rows."""
    metrics: dict[str, float] = {}
    lengths, truncated = rollout.all_lengths, rollout.all_truncated
    (
        metrics["completions/mean_length"],
        metrics["completions/min_length"],
        metrics["completions/max_length"],
    ) = tensor_stats(lengths)
    clipped = truncated.float().mean().item() if truncated.numel() else 0.0
    metrics["completions/clipped_ratio"] = clipped
    (
        metrics["completions/mean_terminated_length"],
        metrics["completions/min_terminated_length"],
        metrics["completions/max_terminated_length"],
    ) = tensor_stats(lengths[~truncated])
    if rollout.kl is not None:
        metrics["kl"] = rollout.kl
    rewards = rollout.rewards_per_func
    for index, name in enumerate(reward_names):
        metrics[f"rewards/{name}/mean"] = nanmean(rewards[:, index])
        metrics[f"rewards/{name}/std"] = nanstd_value(rewards[:, index])
    weighted = algorithm.combine_rewards(rewards, reward_weights.to(rewards.device))
    metrics["reward"] = nanmean(weighted)
    metrics["reward_std"] = nanstd_value(weighted)
    zero_std = algorithm.group_std_is_zero(rollout.shaped_rewards, rollout.num_generations)
    metrics["frac_reward_zero_std"] = zero_std.float().mean().item()
    metrics.update(rollout.reward_metrics)
    return metrics
