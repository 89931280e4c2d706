"""Generation backends: each turns prompt token ids into completion token ids
(rloo.generation.base), and the one factory that picks a backend from an RLOOConfig."""

from rloo import engine
from rloo.generation.base import Completions, GenerationBackend
from rloo.generation.continuous_batching import ContinuousBatchingGenerator
from rloo.generation.lean import LeanGenerator
from rloo.generation.transformers_backend import TransformersGenerator, build_generation_config
from rloo.generation.vllm_async import AsyncServerGenerator
from rloo.generation.vllm_colocate import VLLMColocateGenerator
from rloo.generation.vllm_server import VLLMServerGenerator
from rloo.models import dropout_active
from rloo.vision import is_vision_config, placeholder_token_ids

__all__ = [
    "Completions",
    "ContinuousBatchingGenerator",
    "GenerationBackend",
    "LeanGenerator",
    "TransformersGenerator",
    "in_process_generator",
    "keep_policy_logprobs",
    "make_generation_backend",
]


def in_process_generator(
    generation_config,
    pad_token_id: int,
    eos_token_ids: list[int],
    model,
    pad_to_multiple_of: int | None = None,
    synced: bool = False,
    fast: bool | None = None,
) -> GenerationBackend:
    """Our decode loop where it reproduces `generate` for these settings
    (rloo.engine.supports), else `model.generate`. `synced`: ZeRO-3 without gathering for
    generation, where every rank must run the same forwards until all are done (as generate's
    synced_gpus). `fast`: the speed layer on (None: rloo.engine's environment switch); off, always
    `model.generate`."""
    if (engine.is_fast() if fast is None else fast) and engine.supports(generation_config, model):
        return LeanGenerator(
            generation_config, pad_token_id, eos_token_ids, pad_to_multiple_of, synced
        )
    return TransformersGenerator(generation_config, pad_token_id, eos_token_ids, pad_to_multiple_of)


def make_generation_backend(
    args,
    accelerator,
    model,
    tokenizer,
    pad_token_id: int,
    eos_token_ids: list[int],
    zero3: bool = False,
    fast: bool = True,
    processor=None,
) -> GenerationBackend:
    """The backend RLOOConfig asks for: a vLLM server (`use_vllm`, `vllm_mode='server'`), an
    in-process vLLM engine (`vllm_mode='colocate'`, which gets a VLM's `processor`),
    transformers' continuous batching, or in process (in_process_generator; `fast`: the speed
    layer may take it)."""
    vision = is_vision_config(model.config)
    if vision and args.use_transformers_continuous_batching and not args.use_vllm:
        raise ValueError(
            f"{type(model).__name__} is a vision-language model, and "
            "use_transformers_continuous_batching=True does not take images here: generation "
            "would see the text alone. Fix: use_transformers_continuous_batching=False "
            "(model.generate takes the images), or use_vllm=True."
        )
    if args.use_vllm and args.vllm_mode == "server":
        if args.generates_ahead:
            return AsyncServerGenerator(args, accelerator, model, eos_token_ids, zero3=zero3)
        return VLLMServerGenerator(args, accelerator, model, eos_token_ids, zero3=zero3)
    if args.use_vllm:
        return VLLMColocateGenerator(
            args,
            accelerator,
            model,
            eos_token_ids,
            processor if vision and processor is not None else tokenizer,
            zero3=zero3,
        )
    generation_config = build_generation_config(
        args, pad_token_id, tokenizer.bos_token_id, eos_token_ids
    )
    if vision:  # completions never hold an image placeholder
        generation_config.suppress_tokens = list(
            generation_config.suppress_tokens or []
        ) + placeholder_token_ids(model.config)
    if args.use_transformers_continuous_batching:
        return ContinuousBatchingGenerator(
            generation_config, eos_token_ids, args.transformers_continuous_batching_config
        )
    generator = in_process_generator(
        generation_config,
        pad_token_id,
        eos_token_ids,
        model,
        args.pad_to_multiple_of,
        synced=zero3 and not args.ds3_gather_for_generation,
        fast=fast,
    )
    # pi_old for the KL from the decode loop, not a second forward
    if args.kl_logps_from_generation:
        keep_policy_logprobs(generator, model, args.temperature)
    return generator


def keep_policy_logprobs(generator: GenerationBackend, model, temperature: float) -> None:
    """kl_logps_from_generation: ask the decode loop to keep the policy's log-probs of its tokens
    (RLOOConfig has refused the backends and losses where they cannot stand for pi_old); a clear
    error where they cannot here."""

    if not isinstance(generator, LeanGenerator):
        raise ValueError(
            "kl_logps_from_generation=True: these generation settings (generation_kwargs, "
            "cache_implementation, a model forward without cache arguments, or the speed layer "
            "off: engine='reference') keep model.generate, which keeps no log-probs. Fix: "
            "kl_logps_from_generation=False."
        )
    # decoding runs in eval mode, the forward it replaces in training mode
    if dropout_active(model):
        raise ValueError(
            "kl_logps_from_generation=True: the policy has dropout, so the decode loop's log-probs "
            "(eval mode) are not the training-mode forward's. Fix: disable_dropout=True, or "
            "kl_logps_from_generation=False."
        )
    generator.policy_temperature = temperature
