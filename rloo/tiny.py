"""A tiny random Llama and a word-level tokenizer, built locally (nothing is downloaded): the
pipeline's `tiny` model alias (configs/tiny.yaml) and the models the tests train."""

from __future__ import annotations

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = (
    "the a cat dog sat ran on mat big small red blue one two three four five six seven eight nine "
    "zero what is plus minus answer yes no good bad").split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}{% if "
    "add_generation_prompt %}<|assistant|> {% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer: specials, a few words, and the digits; `<|end|>` is EOS and pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    specials = ["<pad>", "<unk>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS + list("0123456789+-=?.,"))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Punctuation(),
        pre_tokenizers.Digits(True)
    ])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        eos_token="<|end|>", pad_token="<|end|>",
                                        padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(vocab_size: int, **overrides) -> LlamaConfig:
    settings = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256, eos_token_id=2, pad_token_id=2, bos_token_id=None,
                    tie_word_embeddings=False)
    settings.update(overrides)
    return LlamaConfig(**settings)


def tiny_causal_lm(tokenizer=None, seed: int = 0, **overrides) -> LlamaForCausalLM:
    tokenizer = tokenizer or tiny_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(len(tokenizer), **overrides))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny(directory: str, model, tokenizer) -> tuple[str, str]:
    """Model and tokenizer in separate folders (transformers 5 may re-read a tokenizer beside a
    config)."""
    model_dir, tokenizer_dir = os.path.join(directory,
                                            "model"), os.path.join(directory, "tokenizer")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(tokenizer_dir)
    return model_dir, tokenizer_dir
