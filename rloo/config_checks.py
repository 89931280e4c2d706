"""RLOOConfig's checks and derived values, each failing early with the field, the value and the fix:
the RLOO fields, the batch sizes, kl_logps_from_generation, JSON-string fields, pad_to_multiple_of,
and the TRL <= 0.21 parameter names (each with what replaced it)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from rloo.algorithm import IMPORTANCE_SAMPLING_MODES

VLLM_MODES = ("server", "colocate")
STALL_MARGIN_S = 60  # ddp_timeout over stall_timeout_s: the watchdog's report and unwinding

# TRL <= 0.21 names (spec, "Guia de migração") -> what replaced them.
LEGACY_PARAMETERS = {
    "rloo_k": "num_generations",
    "cliprange": "epsilon",
    "kl_coef": "beta",
    "exp_name": "run_name (run_name=f'{exp_name}__{seed}__{int(time.time())}' reproduces the old "
    "name)",
    "normalize_reward": "normalize_advantages",
    "num_ppo_epochs": "num_iterations",
    "token_level_kl": "nothing: the KL is sequence-level only; remove the parameter",
    "dataset_num_proc": "nothing: it was unused; remove the parameter",
    "num_mini_batches": "steps_per_generation",
    "total_episodes": "max_steps (max_steps = total_episodes / gradient_accumulation_steps)",
    "local_rollout_forward_batch_size": "nothing: per_device_train_batch_size (or "
    "per_device_eval_batch_size) is used",
    "num_sample_generations": "logging_steps",
    "response_length": "max_completion_length",
    "stop_token": "nothing: generation stops at the tokenizer's EOS; remove the parameter",
    "stop_token_id": "processing_class.eos_token_id",
    "missing_eos_penalty": "a custom reward function that checks for eos_token_id in "
    "completion_ids",
    "max_prompt_length": "nothing: prompts are never truncated; filter long prompts from the "
    "dataset instead",
}


# RLOOTrainer's TRL <= 0.21 argument names and what replaced them.
LEGACY_TRAINER_ARGUMENTS = {
    "config": "args (an RLOOConfig)",
    "policy": "model (a model id, a path or a PreTrainedModel)",
    "reward_model": "reward_funcs (a reward model or its id, a reward function, or a list of both)",
    "ref_policy": "nothing: the reference is a frozen copy of model made when beta > 0 (with LoRA, "
    "the base with the adapter off); remove the argument",
    "data_collator": "nothing: the trainer batches prompts itself; remove the argument",
}


def reject_legacy_trainer_arguments(init):
    """RLOOTrainer.__init__ wrapped: a TRL <= 0.21 argument name is a TypeError naming its
    replacement, not Python's bare 'unexpected keyword argument'."""
    import functools

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        for name in kwargs:
            if name in LEGACY_TRAINER_ARGUMENTS:
                raise TypeError(
                    f"RLOOTrainer: '{name}' is a TRL <= 0.21 argument that no longer exists; use "
                    f"{LEGACY_TRAINER_ARGUMENTS[name]}."
                )
        init(self, *args, **kwargs)

    return checked_init


def check_backend_combinations(config) -> None:
    """Distributed and generation settings that cannot work together (after TrainingArguments has
    parsed them)."""
    if config.use_vllm and not config.ds3_gather_for_generation:
        raise ValueError(
            "ds3_gather_for_generation=False with use_vllm=True: vLLM loads full weights, so they "
            "are gathered for it whatever this says (the TRL docs call the two incompatible). Fix: "
            "drop ds3_gather_for_generation=False, or use_vllm=False to generate layer by layer."
        )
    check_async_generation(config)
    check_importance_sampling(config)
    parallelism = getattr(config, "parallelism_config", None)
    if parallelism is not None and (
        getattr(parallelism, "cp_enabled", False) or getattr(parallelism, "sp_enabled", False)
    ):
        raise ValueError(
            "parallelism_config with context or sequence parallelism (cp_size or sp_size > 1) is "
            "not supported (nor by TRL): the trainer builds each batch's inputs after generation, "
            "so the sequence dimension is never sharded for it. Fix: cp_size=1 and sp_size=1."
        )
    if config.neftune_noise_alpha is not None:
        raise ValueError(
            f"neftune_noise_alpha={config.neftune_noise_alpha}: NEFTune adds noise to the "
            "embeddings of the training forward, so the log-probabilities the loss uses would not "
            "be those of the policy that sampled the completions (the ratio drifts from 1 on "
            "policy). Fix: drop it (NEFTune is for supervised fine-tuning)."
        )
    if config.use_liger_kernel:
        from transformers.utils import is_liger_kernel_available

        if not is_liger_kernel_available():
            raise ValueError(
                "use_liger_kernel=True, but liger-kernel is not installed (its Triton kernels need "
                "a GPU). Fix: `pip install liger-kernel` on a GPU machine, or drop the flag."
            )


def unwarped(args) -> bool:
    """Whether the sampler's log-probs are those of the plain (temperature-scaled) distribution,
    which the trainer computes too: no top-k/top-p/min-p, repetition penalty, structured outputs or
    extra generation_kwargs."""
    return (
        args.top_k in (0, -1, None)
        and args.top_p == 1.0
        and not args.min_p
        and args.repetition_penalty == 1.0
        and not args.vllm_structured_outputs_regex
        and not args.generation_kwargs
    )


def check_importance_sampling(config) -> None:
    """vllm_importance_sampling_*: a known mode, bounds in order, and a sampler whose log-probs
    are those of the distribution the trainer computes."""

    mode = config.vllm_importance_sampling_mode
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(
            f"vllm_importance_sampling_mode={mode!r}: one of "
            f"{', '.join(IMPORTANCE_SAMPLING_MODES)}."
        )
    low, high = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    if (
        (low is not None and low < 0)
        or (high is not None and high <= 0)
        or (low is not None and high is not None and low > high)
    ):
        raise ValueError(
            f"vllm_importance_sampling_clip_min={low}, vllm_importance_sampling_clip_max={high}: "
            "the bounds of a ratio of probabilities, 0 <= clip_min <= clip_max (None: no bound)."
        )
    if config.vllm_importance_sampling_correction is None:  # on where samples lag the policy
        config.vllm_importance_sampling_correction = config.generates_ahead
    if not config.vllm_importance_sampling_correction:
        return
    if not config.use_vllm:
        raise ValueError(
            "vllm_importance_sampling_correction=True without use_vllm: the trainer samples "
            "itself, so there is no sampler mismatch to correct. Fix: use_vllm=True, or drop it."
        )
    if not unwarped(config):
        raise ValueError(
            "vllm_importance_sampling_correction=True with top_k / top_p / min_p / "
            "repetition_penalty / structured outputs / generation_kwargs: vLLM then reports "
            "log-probs of the reshaped distribution, which the trainer's are not, so the weights "
            "would be biased. Fix: plain sampling (temperature only), or drop the correction."
        )


def check_async_generation(config) -> None:
    """async_generation: a generation server beside the trainers, and a staleness it can keep."""
    staleness, every = config.max_staleness, config.weight_sync_steps
    if not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"max_staleness={staleness!r}: a number of optimizer steps, 0 or more.")
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"weight_sync_steps={every!r}: a number of optimizer steps, 1 or more.")
    if every > 1 and not config.generates_ahead:
        raise ValueError(
            f"weight_sync_steps={every}: without async_generation (and max_staleness >= 1) "
            "every generation samples from the current weights, pushed at each optimizer step. "
            "Fix: weight_sync_steps=1, or async_generation=True with max_staleness >= "
            f"{every}."
        )
    if every > staleness > 0:
        raise ValueError(
            f"weight_sync_steps={every} with max_staleness={staleness}: the batches sampled just "
            f"after a push are trained on up to {every} optimizer steps later, more than "
            f"max_staleness allows. Fix: max_staleness >= weight_sync_steps."
        )
    if every > 1 and config.generation_micro_steps != config.gradient_accumulation_steps:
        raise ValueError(
            f"weight_sync_steps={every}: pushes are counted in optimizer steps and the batches "
            "between two pushes sampled one per step, so a generation batch must feed exactly "
            f"one optimizer step (steps_per_generation {config.steps_per_generation} x "
            f"num_iterations {config.num_iterations} = gradient_accumulation_steps "
            f"{config.gradient_accumulation_steps}). Fix: steps_per_generation = "
            "gradient_accumulation_steps and num_iterations=1, or weight_sync_steps=1."
        )
    if config.stall_timeout_s is not None and config.stall_timeout_s <= 0:
        raise ValueError(
            f"stall_timeout_s={config.stall_timeout_s}: a positive number of seconds, "
            "or None (no watchdog)."
        )
    # The watchdog fires first, its report written (ANSWER_S) and the step unwound (GRACE_S) before
    # a collective waiting for a frozen rank times out with an error that names nobody.
    if config.stall_timeout_s and config.ddp_timeout < config.stall_timeout_s + STALL_MARGIN_S:
        raise ValueError(
            f"ddp_timeout={config.ddp_timeout} must exceed stall_timeout_s="
            f"{config.stall_timeout_s:g} by {STALL_MARGIN_S} s or more: a rank frozen in a "
            "collective is then reported by the stall watchdog with every process's stacks, not by "
            f"the collective's timeout. Fix: ddp_timeout >= "
            f"{int(config.stall_timeout_s) + STALL_MARGIN_S}, or a lower stall_timeout_s."
        )
    if config.vllm_request_timeout_s is not None and config.vllm_request_timeout_s <= 0:
        raise ValueError(
            f"vllm_request_timeout_s={config.vllm_request_timeout_s}: a positive "
            "number of seconds, or None (stall_timeout_s)."
        )
    if config.async_generation and not (config.use_vllm and config.vllm_mode == "server"):
        raise ValueError(
            "async_generation=True needs a generation server (use_vllm=True, vllm_mode='server'): "
            "in-process generation runs on the trainers' own devices, so it cannot overlap their "
            "training. Fix: use a vLLM server, or async_generation=False."
        )
    steps = config.generation_micro_steps
    if config.generates_ahead and steps > config.gradient_accumulation_steps:
        raise ValueError(
            f"async_generation: a generation batch here spans {steps} micro-steps "
            f"(steps_per_generation {config.steps_per_generation} x num_iterations "
            f"{config.num_iterations}) but an optimizer step is "
            f"{config.gradient_accumulation_steps}: sampled ahead, its last micro-batches would "
            "be trained an optimizer step later than the schedule that bounds staleness allows. "
            "Fix: steps_per_generation = gradient_accumulation_steps and num_iterations=1, or "
            "async_generation=False."
        )


def json_dict(value: Any, name: str) -> dict | None:
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{name}={value!r} is not valid JSON ({err}); pass a dict or a JSON object string"
            ) from None
        if not isinstance(parsed, dict):
            raise ValueError(f"{name}={value!r} must be a JSON object, e.g. '{{\"key\": 1}}'")
        return parsed
    raise ValueError(f"{name} must be a dict or a JSON string, got {type(value).__name__}")


def parse_pad_to_multiple_of(value: int | str | None) -> int | None:
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value < 1:
            raise ValueError(
                f"pad_to_multiple_of={value} must be a positive integer, 'auto' or None."
            )
        return value
    text = str(value).strip().lower()
    if text in ("none", "null", ""):
        return None
    if text == "auto":
        return 128 if hasattr(torch, "neuron") else None
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError(f"pad_to_multiple_of={value!r} must be a positive integer, 'auto' or None.")


def check_rloo_fields(config) -> None:
    """The RLOO fields' values, before TrainingArguments' own checks."""
    # (FSDP first: transformers 4.x writes ACCELERATE_USE_FSDP into the process environment as it
    # parses fsdp, which every later config would read back)
    fsdp = bool(config.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    if fsdp:
        raise ValueError(
            "FSDP (fsdp / fsdp_config / accelerate's FSDP plugin) is not supported: RLOO needs the "
            "full parameters gathered for generation and the reference sharded like the policy, "
            "which this trainer does for DeepSpeed ZeRO-3 only; under FSDP it would generate from "
            "a shard. Fix: deepspeed='configs/deepspeed/zero3.json' (ZeRO-3, same memory "
            "savings), or no FSDP."
        )
    if config.num_generations is None or config.num_generations < 2:
        raise ValueError(
            f"num_generations={config.num_generations}: RLOO requires at least 2 generations per "
            "prompt (the leave-one-out baseline needs a sibling). Fix: num_generations >= 2."
        )
    if config.num_generations_eval is not None and config.num_generations_eval < 1:
        raise ValueError(
            f"num_generations_eval={config.num_generations_eval} must be >= 1 (or None)."
        )
    # None: no cap of ours, completions run to EOS or the model's context (as vLLM's max_tokens)
    if config.max_completion_length is not None and config.max_completion_length <= 0:
        raise ValueError(
            f"max_completion_length={config.max_completion_length} must be a positive number of "
            "tokens, or None (up to the model's context)."
        )
    if config.max_completion_length is None and config.use_transformers_continuous_batching:
        raise ValueError(
            "max_completion_length=None with use_transformers_continuous_batching=True: its paged "
            "cache is sized by the completion length. Fix: a max_completion_length."
        )
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name}={getattr(config, name)} must be >= 1.")
    if not 0 < config.top_p <= 1:
        raise ValueError(f"top_p={config.top_p} must be in (0, 1] (1.0: no nucleus filtering).")
    # transformers would quietly train num_train_epochs instead
    if config.max_steps == 0 or config.max_steps < -1:
        raise ValueError(
            f"max_steps={config.max_steps}: use a positive number of optimizer steps, or -1 to "
            "train for num_train_epochs."
        )
    if (
        str(getattr(config.save_strategy, "value", config.save_strategy)) == "steps"
        and config.save_steps <= 0
    ):
        raise ValueError(f"save_steps={config.save_steps} with save_strategy='steps' must be > 0.")
    if config.learning_rate < 0:  # transformers would train uphill without a word
        raise ValueError(
            f"learning_rate={config.learning_rate} is negative. Fix: a learning rate >= 0, e.g. "
            "1e-6."
        )
    if config.vllm_mode not in VLLM_MODES:
        raise ValueError(
            f"vllm_mode={config.vllm_mode!r} is not supported. Fix: vllm_mode='server' or "
            "'colocate'."
        )
    if config.vllm_peft_sync not in ("auto", "adapter", "merged"):
        raise ValueError(
            f"vllm_peft_sync={config.vllm_peft_sync!r}: use 'auto', 'adapter' or 'merged'."
        )
    if config.reward_timeout is not None and not config.reward_timeout > 0:
        raise ValueError(
            f"reward_timeout={config.reward_timeout} must be a positive number of seconds, or None."
        )
    if config.nonfinite_rewards not in ("error", "none"):
        raise ValueError(f"nonfinite_rewards={config.nonfinite_rewards!r}: use 'error' or 'none'.")
    if config.vllm_sync_on_mismatch not in ("error", "warn"):
        raise ValueError(
            f"vllm_sync_on_mismatch={config.vllm_sync_on_mismatch!r}: use 'error' or 'warn'."
        )
    if config.vllm_sync_verify_samples < 0:
        raise ValueError(
            f"vllm_sync_verify_samples={config.vllm_sync_verify_samples} must be >= 0."
        )
    if not 0.0 < config.vllm_gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"vllm_gpu_memory_utilization={config.vllm_gpu_memory_utilization} is the share of "
            "the device's memory vLLM may take: a number in (0, 1], e.g. 0.3."
        )
    if config.vllm_tensor_parallel_size < 1:
        raise ValueError(
            f"vllm_tensor_parallel_size={config.vllm_tensor_parallel_size} must be >= 1."
        )
    if (
        config.vllm_max_model_length is not None
        and config.max_completion_length is not None
        and config.vllm_max_model_length <= config.max_completion_length
    ):
        raise ValueError(
            f"vllm_max_model_length={config.vllm_max_model_length} leaves no room for a prompt: "
            f"it must exceed max_completion_length={config.max_completion_length}. Fix: at least "
            "the longest prompt plus max_completion_length, or None to take it from the model "
            "config."
        )
    if config.vllm_model_impl not in ("vllm", "transformers"):
        raise ValueError(
            f"vllm_model_impl={config.vllm_model_impl!r}: use 'vllm' or 'transformers'."
        )
    if config.num_iterations < 1:
        raise ValueError(f"num_iterations={config.num_iterations} must be >= 1.")
    if config.epsilon < 0 or (config.epsilon_high is not None and config.epsilon_high < 0):
        raise ValueError(
            f"epsilon={config.epsilon} / epsilon_high={config.epsilon_high} must be >= 0."
        )
    if config.temperature <= 0:
        raise ValueError(
            f"temperature={config.temperature} must be > 0 (log-probs are divided by it)."
        )
    if config.beta < 0:
        raise ValueError(f"beta={config.beta} must be >= 0.")
    if config.reward_clip_range is not None:
        low_high = config.reward_clip_range
        if len(low_high) != 2 or low_high[0] > low_high[1]:
            raise ValueError(
                f"reward_clip_range={config.reward_clip_range} must be (min, max) with min <= max."
            )
        config.reward_clip_range = (float(low_high[0]), float(low_high[1]))
    if not 0.0 <= config.ref_model_mixup_alpha <= 1.0:
        raise ValueError(
            f"ref_model_mixup_alpha={config.ref_model_mixup_alpha} must lie in [0, 1]."
        )


def resolve_batch_sizes(config) -> None:
    """generation_batch_size / steps_per_generation from each other, checked against the
    processes."""
    num_processes = config.world_size
    global_batch = config.per_device_train_batch_size * num_processes
    if config.generation_batch_size is not None and config.steps_per_generation is not None:
        raise ValueError(
            "'generation_batch_size' and 'steps_per_generation' can not be both configured at "
            f"the same time (got {config.generation_batch_size} and "
            f"{config.steps_per_generation}). Fix: set only one of them."
        )
    if config.generation_batch_size is None and config.steps_per_generation is None:
        config.steps_per_generation = config.gradient_accumulation_steps
        config.generation_batch_size = global_batch * config.steps_per_generation
    elif config.generation_batch_size is not None:
        if config.generation_batch_size % global_batch != 0:
            raise ValueError(
                f"generation_batch_size ({config.generation_batch_size}) must be divisible by "
                f"the global batch size ({global_batch} = per_device_train_batch_size "
                f"{config.per_device_train_batch_size} x {num_processes} processes)."
            )
        config.steps_per_generation = config.generation_batch_size // global_batch
    else:
        if config.steps_per_generation < 1:
            raise ValueError(f"steps_per_generation={config.steps_per_generation} must be >= 1.")
        config.generation_batch_size = global_batch * config.steps_per_generation
    if config.generation_batch_size % config.num_generations != 0:
        raise ValueError(
            f"generation_batch_size ({config.generation_batch_size} = "
            f"per_device_train_batch_size {config.per_device_train_batch_size} x {num_processes} "
            f"processes x steps_per_generation {config.steps_per_generation}) must be divisible "
            f"by num_generations ({config.num_generations}). Fix: change "
            "per_device_train_batch_size, steps_per_generation or num_generations."
        )
    if config.do_eval and config.eval_strategy != "no":
        eval_generations = config.num_generations_eval or config.num_generations
        eval_batch = config.per_device_eval_batch_size * num_processes
        if eval_batch % eval_generations != 0:
            raise ValueError(
                f"The global eval batch size ({eval_batch} = per_device_eval_batch_size "
                f"{config.per_device_eval_batch_size} x {num_processes} processes) must be "
                f"divisible by num_generations_eval ({eval_generations})."
            )


def check_kl_logps_from_generation(config) -> None:
    """kl_logps_from_generation=True only where the decode loop's log-probs can stand for pi_old."""
    reason = None
    if config.beta == 0.0:
        reason = "beta=0.0 computes no KL"
    elif config.use_vllm or config.use_transformers_continuous_batching:
        reason = (
            "vLLM and continuous batching sample with their own kernels (vLLM with its own "
            "copy of the weights): only the in-process decode loop computes the policy's own "
            "logits"
        )
    elif (
        config.num_iterations > 1
        or config.steps_per_generation > config.gradient_accumulation_steps
    ):
        reason = (
            f"num_iterations={config.num_iterations} / "
            f"steps_per_generation={config.steps_per_generation} keep pi_old for later optimizer "
            "steps, where the clipped ratio needs the forward's exact log-probs"
        )
    elif config.engine == "reference":
        reason = (
            "the speed layer is off (engine='reference' or RLOO_ENGINE=reference): "
            "model.generate keeps no log-probs"
        )
    if reason:
        raise ValueError(
            f"kl_logps_from_generation=True: {reason}. Fix: kl_logps_from_generation=False."
        )


def check_available(config) -> None:
    """What the installed libraries cannot do (after the settings themselves are known good)."""
    if config.use_transformers_continuous_batching:
        import transformers

        if not hasattr(transformers, "ContinuousBatchingConfig"):
            raise ValueError(
                "use_transformers_continuous_batching=True needs transformers 5 (its paged "
                f"generation API); transformers {transformers.__version__} is installed. Fix: pip "
                "install -U 'transformers>=5', or drop the flag (the default in-process backend)."
            )
