"""Loading policy, reference and reward models and their tokenizers; dropout, Mixture-of-Experts
and the model's identity (for resumes). LoRA and QLoRA: rloo.adapters."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rloo import vision
from rloo.engine import mapped_copy
from rloo.primitives import is_moe, is_peft_model
from rloo.zero import is_partitioned


def _looks_like_local_path(name: str) -> bool:
    return (
        os.path.isabs(name)
        or name.startswith((".", "~"))
        or name.count("/") > 1
        or os.sep in name
        and os.path.exists(os.path.dirname(name) or ".")
    )


def check_model_source(name: str, what: str = "model") -> None:
    """Fail early, naming the value, when a local model path does not exist."""
    if os.path.isdir(os.path.expanduser(name)):
        return
    if _looks_like_local_path(name) or os.path.exists(os.path.expanduser(name)):
        raise FileNotFoundError(
            f"{what}={name!r}: no such directory. Fix: pass a directory written by "
            "save_pretrained, or a Hugging Face Hub model id such as 'Qwen/Qwen2-0.5B-Instruct'."
        )


def local_model_problem(path: str, reward_model: bool = False) -> str | None:
    """Why a local model folder cannot serve as a policy (or, with reward_model, as a reward model),
    from its files alone: no config.json, no weights, or not a one-label sequence classifier. None:
    no problem seen."""
    import json

    names = os.listdir(path)
    if "adapter_config.json" in names and not reward_model:
        return None  # a PEFT adapter folder: its base model is named inside
    if "config.json" not in names:
        return f"no config.json in {path} (is it a model folder written by save_pretrained?)"
    if not any(
        name.endswith((".safetensors", ".bin", ".index.json", ".pt", ".gguf")) for name in names
    ):
        return (
            f"no weights in {path} (no *.safetensors or *.bin file: an interrupted download or "
            "copy?)"
        )
    with open(os.path.join(path, "config.json")) as handle:
        try:
            config = json.load(handle)
        except ValueError as err:
            return f"{path}/config.json is not valid JSON ({err})"
    if reward_model:
        architectures = config.get("architectures") or []
        if architectures and not any(
            a.endswith("ForSequenceClassification") for a in architectures
        ):
            return (
                f"{path} is a {architectures[0]}, not a reward model: loading it as one would "
                "score with an untrained head. A reward model is a sequence classifier with one "
                "label (AutoModelForSequenceClassification, num_labels=1)"
            )
        labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 1)
        if labels != 1:
            return f"{path} classifies into {labels} labels; a reward model has one (num_labels=1)"
    return None


def _from_pretrained(loader, name: str, what: str, **kwargs):
    check_model_source(name, what)
    try:
        return loader(os.path.expanduser(name), **kwargs)
    except ValueError as err:
        if "trust_remote_code" in str(err) and not kwargs.get("trust_remote_code"):
            raise ValueError(
                f"{what}={name!r} needs custom code (its config has an auto_map) and "
                "trust_remote_code is False, so it was not executed. Fix: read the code, then pass "
                "RLOOConfig(trust_remote_code=True)."
            ) from err
        raise
    except OSError as err:
        raise OSError(
            f"{what}={name!r} could not be loaded: not a local model directory and not reachable "
            "on the "
            f"Hugging Face Hub ({err})."
        ) from err


def load_causal_lm(
    name: str, model_init_kwargs: dict | None, trust_remote_code: bool
) -> PreTrainedModel:
    """Load a policy from an id or path; dtype defaults to float32 (spec: not the config's
    dtype)."""
    kwargs = dict(model_init_kwargs or {})
    kwargs.setdefault("dtype", torch.float32)
    if isinstance(kwargs["dtype"], str) and kwargs["dtype"] not in ("auto",):
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    config = _from_pretrained(
        AutoConfig.from_pretrained, name, "model", trust_remote_code=kwargs["trust_remote_code"]
    )
    architecture = (getattr(config, "architectures", None) or [None])[0]
    import transformers

    model_class = getattr(transformers, architecture, None) if architecture else None
    if model_class is None or not hasattr(model_class, "from_pretrained"):
        model_class = AutoModelForCausalLM
    return _from_pretrained(model_class.from_pretrained, name, "model", **kwargs)


def load_reward_model(
    name: str, model_init_kwargs: dict | None, trust_remote_code: bool
) -> PreTrainedModel:
    kwargs = dict(model_init_kwargs or {})
    kwargs.setdefault("dtype", torch.float32)
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    return _from_pretrained(
        AutoModelForSequenceClassification.from_pretrained,
        name,
        "reward_funcs entry",
        num_labels=1,
        **kwargs,
    )


def load_tokenizer(
    name: str, trust_remote_code: bool, revision: str | None = None, config: Any = None
) -> PreTrainedTokenizerBase:
    """The processing class of a model id or path: for a vision-language model (`config`, the
    model's), its processor (AutoProcessor, rloo.vision), else its tokenizer (AutoTokenizer);
    `revision` as for the model (the TRL docs: model_init_kwargs' revision is also used for the
    processing class)."""

    if config is not None and vision.is_vision_config(config):
        check_model_source(name, "processing_class source")
        return vision.load_processor(os.path.expanduser(name), config, trust_remote_code, revision)
    kwargs = {"revision": revision} if revision is not None else {}
    return _from_pretrained(
        AutoTokenizer.from_pretrained,
        name,
        "processing_class source",
        trust_remote_code=trust_remote_code,
        **kwargs,
    )


def reward_tokenizers(reward_funcs: list, classes, trust_remote_code: bool) -> list:
    """One tokenizer per reward function: None for plain functions; for a reward model the one given
    at its position or its own (loaded from its path), with a pad token set and copied into its
    config."""
    if classes is None:
        classes = [None] * len(reward_funcs)
    elif not isinstance(classes, (list, tuple)):
        classes = [classes]
    classes = list(classes)
    for index, (func, tokenizer) in enumerate(zip(reward_funcs, classes)):
        if not isinstance(func, PreTrainedModel):
            continue
        if tokenizer is None:
            source = getattr(func.config, "_name_or_path", "")
            if not source:
                raise ValueError(
                    f"reward_funcs[{index}] is a reward model object built in memory, so its "
                    "tokenizer cannot be loaded from a path. Fix: pass reward_processing_classes "
                    "with its tokenizer at that position (None for function entries)."
                )
            tokenizer = load_tokenizer(source, trust_remote_code)
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token is None:
                raise ValueError(
                    f"reward_processing_classes[{index}] has neither pad nor EOS token; set one."
                )
            tokenizer.pad_token = tokenizer.eos_token
        func.config.pad_token_id = tokenizer.pad_token_id
        classes[index] = tokenizer
    return classes


def prepare_tokenizer(tokenizer: Any, where: str = "processing_class") -> Any:
    """Left padding, pad defaults to eos; a tokenizer with neither cannot batch prompts."""
    text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    if not isinstance(text_tokenizer, PreTrainedTokenizerBase):
        raise TypeError(
            f"{where} must be a tokenizer or a processor, got {type(tokenizer).__name__}"
        )
    if text_tokenizer.pad_token is None:
        if text_tokenizer.eos_token is None:
            raise ValueError(
                f"{where} has neither a pad token nor an EOS token, so completions cannot be ended "
                "or batched. Fix: set tokenizer.eos_token (e.g. tokenizer.eos_token = '</s>') or "
                "tokenizer.pad_token before creating the trainer."
            )
        text_tokenizer.pad_token = text_tokenizer.eos_token
    text_tokenizer.padding_side = "left"
    return tokenizer


def text_tokenizer_of(processing_class: Any) -> PreTrainedTokenizerBase:
    return getattr(processing_class, "tokenizer", processing_class)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS plus the generation config's."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    generation_config = getattr(model, "generation_config", None)
    extra = getattr(generation_config, "eos_token_id", None)
    if isinstance(extra, int):
        extra = [extra]
    for token_id in extra or []:
        if token_id not in ids:
            ids.append(token_id)
    return ids


def create_reference_model(model: PreTrainedModel, mapped: bool = True) -> PreTrainedModel:
    """A frozen copy of the policy as it is now (the reference pi_ref); `mapped`: in a file mapping
    that is paged out between the reference forwards where rloo.engine.mapped can make one, else in
    memory."""
    reference = mapped_copy(model) if mapped else None
    if reference is None:
        reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    reference.eval()
    return reference


def prepare_reference(policy: PreTrainedModel, accelerator, mapped: bool = True) -> nn.Module:
    """create_reference_model, prepared by accelerate for evaluation. A CPU reference stays where it
    is: accelerate moves a model to `cpu:0` in multi-process CPU runs, which copies every tensor
    (out of rloo.engine.mapped's mapping)."""
    reference = create_reference_model(policy, mapped)
    on_cpu = accelerator.device.type == "cpu" and all(
        p.device.type == "cpu" for p in reference.parameters()
    )
    return accelerator.prepare_model(
        reference, device_placement=False if on_cpu else None, evaluation_mode=True
    )


def prepare_reward_model(model: nn.Module, accelerator) -> nn.Module:
    """A reward model prepared by accelerate for evaluation, not compiled under torch_compile:
    dynamo's trace of a compiled sequence-classification model loses its input ids (transformers'
    forward then fails with "You must specify exactly one of input_ids or inputs_embeds"), and
    torch_compile is there for the model being trained."""
    plugin = accelerator.state.dynamo_plugin
    backend = plugin.backend
    from accelerate.utils import DynamoBackend

    plugin.backend = DynamoBackend.NO
    try:
        return accelerator.prepare_model(model, evaluation_mode=True)
    finally:
        plugin.backend = backend


DROPOUT_ATTRIBUTES = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
)


def disable_dropout(model: nn.Module) -> None:
    """Every dropout off: nn.Dropout modules and the float rates attention layers apply
    functionally."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for attribute in DROPOUT_ATTRIBUTES:
            if isinstance(getattr(module, attribute, None), float):
                setattr(module, attribute, 0.0)
    config = getattr(model, "config", None)
    for attribute in DROPOUT_ATTRIBUTES:
        if isinstance(getattr(config, attribute, None), float):
            setattr(config, attribute, 0.0)


def dropout_active(model: nn.Module) -> bool:
    """Whether training mode draws dropout anywhere (a module's rate or an attention layer's
    functional one)."""
    config = getattr(model, "config", None)
    rates = [getattr(config, attribute, None) for attribute in DROPOUT_ATTRIBUTES]
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            rates.append(module.p)
        rates.extend(getattr(module, attribute, None) for attribute in DROPOUT_ATTRIBUTES)
    return any(isinstance(rate, float) and rate > 0 for rate in rates)


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Generation runs without dropout and with the KV cache; training mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        if was_training:
            model.train()


def model_identity(model: nn.Module) -> dict:
    """What a checkpoint must share with the run resuming it: the base model's name, class and
    weight shapes."""
    base = model.get_base_model() if is_peft_model(model) else model
    # ZeRO-3 shards: their full shape
    shapes = sorted(
        (name, tuple(getattr(p, "ds_shape", p.shape)))
        for name, p in base.named_parameters()
        if "lora_" not in name
    )
    import hashlib

    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    return {
        "name_or_path": str(getattr(base.config, "_name_or_path", "")),
        "class": type(base).__name__,
        "shapes_digest": digest,
    }


# --------------------------------------------------------------------------------------------------
# MoE
def resolve_router_aux_loss_coef(model: nn.Module, coef: float | None) -> float:
    """TRL 1.16 rule: None takes the model's coefficient; a non-zero value on a dense model is an
    error."""
    if not is_moe(model):
        if coef:
            raise ValueError(
                f"router_aux_loss_coef={coef} but the model ({type(model).__name__}) is not a "
                "Mixture-of-Experts model, so it has no router loss. Fix: leave "
                "router_aux_loss_coef unset (None) or 0.0."
            )
        return 0.0
    if coef is None:
        coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
    model.config.output_router_logits = coef != 0.0
    return float(coef)


def load_policy(model, args, quantization_config: Any = None) -> tuple[PreTrainedModel, dict]:
    """The policy from an id/path (model_init_kwargs, quantization_config) or as given; returns it
    with the from_pretrained kwargs used (a ZeRO-3 reference is loaded again with the same ones)."""
    import warnings

    init_kwargs = dict(args.model_init_kwargs or {})
    if isinstance(model, str):
        if quantization_config is not None:
            if "quantization_config" in init_kwargs:
                raise ValueError(
                    "quantization_config is given both as an argument and in model_init_kwargs; "
                    "pass it once."
                )
            init_kwargs["quantization_config"] = quantization_config
        return load_causal_lm(model, init_kwargs, args.trust_remote_code), init_kwargs
    if args.model_init_kwargs or quantization_config is not None:
        warnings.warn(
            "model is already instantiated: model_init_kwargs and quantization_config are ignored."
        )
    return model, init_kwargs


def reference_for_zero3(
    policy: nn.Module, source: str, init_kwargs: dict, trust_remote_code: bool
) -> nn.Module:
    """The initial policy as a separate model for ZeRO-3. A policy already sharded at load time
    (zero.Init) cannot be copied, so the reference is loaded again from the same source on every
    rank."""

    if not is_partitioned(policy):
        # its weights move into DeepSpeed's partitions
        return create_reference_model(policy, mapped=False)
    if not source:
        raise ValueError(
            "ZeRO-3 with beta > 0 needs a reference copy of the policy, but the model object given "
            "was sharded at creation and has no config._name_or_path to load it from again. Fix: "
            "pass the model by name/path, or create it outside the DeepSpeed context."
        )
    reference = load_causal_lm(source, init_kwargs, trust_remote_code)
    reference.requires_grad_(False)
    return reference
