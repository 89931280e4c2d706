"""LoRA / QLoRA around the policy: the adapter a peft_config adds (gradient checkpointing and k-bit
preparation as peft wants them), the reference adapter of a PeftModel passed in (a frozen copy of
its adapter), switching to the reference (adapter disabled or the frozen copy), and the checks that
QLoRA can run here."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from rloo.primitives import is_peft_model

logger = logging.getLogger(__name__)

REFERENCE_ADAPTER = "ref"


def check_quantization_supported(quantization_config: Any) -> None:
    """QLoRA loads the base in 4/8 bit through bitsandbytes, which needs its package and a CUDA
    device."""
    method = getattr(quantization_config, "quant_method", None)
    method = getattr(method, "value", method)
    if method != "bitsandbytes":
        return
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "quantization_config (QLoRA) needs bitsandbytes, which is not installed. "
            "Fix: pip install bitsandbytes on a machine with a CUDA GPU, or drop "
            "quantization_config to train LoRA on a full-precision base."
        ) from err
    if not torch.cuda.is_available():
        raise RuntimeError(
            "quantization_config (QLoRA) needs a CUDA GPU: bitsandbytes' 4/8-bit kernels cannot "
            "run on this machine (torch.cuda.is_available() is False). Fix: train on a GPU, or "
            "drop quantization_config to train LoRA on a full-precision base."
        )


def lora_targets(modules: list[str] | None):
    """LoraConfig.target_modules for a recipe's lora_target_modules, as TRL's get_peft_config
    passes them: none given -> None (PEFT's default for the architecture: q_proj and v_proj for
    Llama and Qwen); [all-linear] -> every linear layer but the output head; else those modules."""
    if modules in (["all-linear"], "all-linear"):
        return "all-linear"
    return list(modules) if modules else None


def default_lora_targets(model_type: str) -> list[str]:
    """PEFT's default LoRA targets for a model type; a clear error where PEFT has none (it would
    fail later asking for target_modules)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    found = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if not found:
        raise ValueError(
            f"PEFT has no default LoRA targets for model type {model_type!r}. Fix: set "
            "lora_target_modules (e.g. [q_proj, v_proj], or [all-linear] for every linear layer)."
        )
    return list(found)


def linear_module_names(model: nn.Module) -> list[str]:
    """Short names of the Linear layers LoRA can target (what `target_modules` matches against)."""
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    }
    return sorted(names)


def wrap_with_peft(
    model: PreTrainedModel, peft_config: Any, gradient_checkpointing: bool, quantized: bool
):
    from peft import get_peft_model, prepare_model_for_kbit_training

    if getattr(peft_config, "target_modules", None) == "lm_head" or "lm_head" in (
        getattr(peft_config, "target_modules", None) or []
    ):
        raise ValueError(
            "peft_config.target_modules includes 'lm_head': the log-probabilities are read from "
            "the output layer, which LoRA would bypass. Fix: target the attention/MLP projections."
        )
    if quantized:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing
        )
    try:
        peft_model = get_peft_model(model, peft_config)
    except ValueError as err:
        if "not found" in str(err) or "match" in str(err):
            raise ValueError(
                f"peft_config.target_modules={getattr(peft_config, 'target_modules', None)!r} "
                f"matches no layer of {type(model).__name__}. Its Linear layers are: "
                f"{', '.join(linear_module_names(model))}. Fix: pick target_modules from that list "
                "(or 'all-linear')."
            ) from err
        raise
    if quantized:  # trainable adapter weights in bf16 next to the 4-bit base, as TRL does
        for param in peft_model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    return peft_model


def add_reference_adapter(model) -> str:
    """A PeftModel that arrives trained (e.g. an SFT adapter) is its own reference: freeze a copy of
    the active adapter under the name 'ref'. Returns the name of the trainable adapter."""
    active = model.active_adapter
    model.add_adapter(REFERENCE_ADAPTER, copy.deepcopy(model.peft_config[active]))
    params = dict(model.named_parameters())
    copied = 0
    with torch.no_grad():
        for name, param in params.items():
            if f".{active}." in name:
                params[name.replace(f".{active}.", f".{REFERENCE_ADAPTER}.")].copy_(param)
                copied += 1
    if copied == 0:
        raise ValueError(
            f"could not find the weights of adapter {active!r} to copy into the reference adapter."
        )
    model.set_adapter(active)
    for name, param in model.named_parameters():
        if f".{REFERENCE_ADAPTER}." in name:
            param.requires_grad_(False)
    return active


@contextlib.contextmanager
def reference_adapter(model, trainable_adapter: str | None):
    """Inside: the model computes the reference policy (the 'ref' adapter, or the base with adapters
    disabled)."""
    if trainable_adapter is None or REFERENCE_ADAPTER not in model.peft_config:
        with model.disable_adapter():
            yield model
        return
    model.set_adapter(REFERENCE_ADAPTER)
    try:
        yield model
    finally:
        model.set_adapter(trainable_adapter)
        for name, param in model.named_parameters():
            if f".{REFERENCE_ADAPTER}." in name:
                param.requires_grad_(False)


def attach_adapter(model, peft_config: Any, args) -> tuple[nn.Module, str | None]:
    """PEFT: a new adapter from peft_config (the reference is then the base, adapter disabled), or,
    for a PeftModel passed in (e.g. after SFT) with the KL on, a frozen copy of its adapter as the
    reference. Returns the model and the name of the trainable adapter where a reference copy was
    added."""
    trainable_adapter = None
    if peft_config is not None:
        quantized = bool(
            getattr(model, "is_quantized", False) or getattr(model, "is_loaded_in_4bit", False)
        )
        model = wrap_with_peft(model, peft_config, args.gradient_checkpointing, quantized)
    elif is_peft_model(model) and args.beta != 0.0:
        targets = [getattr(c, "target_parameters", None) for c in model.peft_config.values()]
        if any(targets):
            # PEFT holds one adapter per model where a LoRA targets parameters (peft#3340): no
            # frozen copy can be added, and the reference is the base model, as TRL does
            logger.warning(
                "The PeftModel's adapter targets parameters (target_parameters=%s), and PEFT "
                "holds no second adapter beside such a one: the KL's reference is the base model "
                "with the adapter disabled, not the adapter as it arrived (as in TRL). Set "
                "beta=0.0 for no KL term.",
                next(t for t in targets if t),
            )
        else:
            trainable_adapter = add_reference_adapter(model)
    if is_peft_model(model) and args.gradient_checkpointing:
        model.enable_input_require_grads()
    return model, trainable_adapter
