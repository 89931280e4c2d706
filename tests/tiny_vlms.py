"""Tiny random vision-language models of five families with different image mechanics, built here
(nothing is downloaded), with their processors:

- Qwen2-VL: M-RoPE positions, patches of every image in one `pixel_values` matrix and
  `image_grid_thw` saying which rows belong to which image;
- Qwen2.5-VL (the docs' quick start): Qwen2-VL's inputs, a vision tower with windowed attention
  and full-attention blocks;
- Idefics3 (SmolVLM): `pixel_values` of shape rows x images x C x H x W (all-zero images are
  padding) with a `pixel_attention_mask`, pixel-shuffled patches;
- Gemma3: a fixed number of soft tokens per image, bidirectional attention over them
  (`token_type_ids`);
- LLaVA-NeXT: any-resolution tiles (`pixel_values` of shape images x tiles x C x H x W) and
  `image_sizes`.

The processors use transformers' PIL image backends; Qwen2-VL's is built without its video part
(`rloo.vision.images_only`) because its stock video processor needs torchvision, which has no
build on PyPI that matches this project's CPU torch."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from rloo.tiny import (
    qwen_vl_processor,
    qwen_vl_token_ids,
    qwen_vl_tokenizer,
    tiny_text_config,
    tiny_tokenizer,
    tiny_vision_model,
)

# the vision towers of the Qwen families after Qwen2-VL: two blocks, 4-pixel patches merged 2x2
QWEN_VISION = dict(
    depth=2,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=32,
)


def _tokenizer(
    image_tokens: list[str], image_markup: str, extra_special_tokens: dict | None = None
):
    return tiny_tokenizer(tuple(image_tokens), image_markup, extra_special_tokens)


def _text(vocab_size: int) -> dict:
    return tiny_text_config(vocab_size)


def tiny_qwen2_vl(seed: int = 0):
    """(model, processor): rloo.tiny's (the `tiny-vlm` alias)."""
    return tiny_vision_model(seed)


def tiny_gemma3(seed: int = 0):
    """(model, processor): Gemma3 with 32x32 images, 4 soft tokens each."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = _tokenizer(
        ["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
        "<start_of_image>",
        {
            "boi_token": "<start_of_image>",
            "image_token": "<image_soft_token>",
            "eoi_token": "<end_of_image>",
        },
    )
    ids = tokenizer.convert_tokens_to_ids
    text = _text(len(tokenizer))
    text.update(head_dim=8, query_pre_attn_scalar=8, sliding_window=64)
    config = Gemma3Config(
        text_config=text,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        mm_tokens_per_image=4,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        eos_token_id=2,
        pad_token_id=2,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    # transformers initialises the projection to zeros: no image would reach the text model
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=4,
    )
    return _finish(model, tokenizer), processor


def tiny_llava_next(seed: int = 0):
    """(model, processor): LLaVA-NeXT with 16x16 tiles of 8-pixel patches, grids up to 2x2."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    tokenizer = _tokenizer(["<image>"], "<image>")
    config = LlavaNextConfig(
        text_config={"model_type": "llama", **_text(len(tokenizer))},
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
            projection_dim=32,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]],
        vision_feature_layer=-1,
        image_seq_length=4,
        eos_token_id=2,
        pad_token_id=2,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 16},
        crop_size={"height": 16, "width": 16},
        image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]],
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return _finish(model, tokenizer), processor


def tiny_qwen2_5_vl(seed: int = 0):
    """(model, processor): Qwen2.5-VL with 4-pixel patches merged 2x2, windows of 16 pixels in its
    first vision block and full attention in its second."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    tokenizer = qwen_vl_tokenizer()
    text = _text(len(tokenizer))
    text["rope_parameters"] = {
        "rope_type": "default",
        "mrope_section": [2, 1, 1],
        "rope_theta": 10000.0,
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(QWEN_VISION, window_size=16, fullatt_block_indexes=[1]),
        **qwen_vl_token_ids(tokenizer),
        eos_token_id=2,
        pad_token_id=2,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    return _finish(model, tokenizer), qwen_vl_processor(Qwen2_5_VLProcessor, tokenizer)


def tiny_idefics3(seed: int = 0):
    """(model, processor): Idefics3 (SmolVLM's architecture), each image resized to 32x32 without
    splitting, 8-pixel patches shuffled 2x2 into 4 image tokens."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = _tokenizer(
        ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"], "<image>"
    )
    config = Idefics3Config(
        text_config={"model_type": "llama", **_text(len(tokenizer))},
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 32}, max_image_size={"longest_edge": 32}, do_image_splitting=False
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=4,
        chat_template=tokenizer.chat_template,
    )
    return _finish(model, tokenizer), processor


def _tiny_qwen3_5(seed: int, moe: bool):
    """Qwen3.5's VLM: a hybrid text model (Gated DeltaNet linear attention, then full attention)
    behind a Qwen3-VL-style vision tower, with Qwen3-VL's processor."""
    import transformers as tf
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    tokenizer = qwen_vl_tokenizer()
    text = _text(len(tokenizer))
    text.update(
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={
            "rope_type": "default",
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    if moe:
        text.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        )
    config_class, model_class = (
        (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration)
        if moe
        else (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration)
    )
    config = config_class(
        text_config=text,
        vision_config=dict(QWEN_VISION, num_position_embeddings=64),
        **qwen_vl_token_ids(tokenizer),
    )
    torch.manual_seed(seed)
    model = model_class(config)
    return _finish(model, tokenizer), qwen_vl_processor(Qwen3VLProcessor, tokenizer)


def tiny_qwen3_5(seed: int = 2):
    """(model, processor): Qwen3.5 (dense), 4-pixel patches merged 2x2. Seed 2 by default: at
    seeds 0, 1 and 3 this two-layer model's greedy continuations do not depend on the image, which
    test_vision's generation test needs them to."""
    return _tiny_qwen3_5(seed, moe=False)


def tiny_qwen3_5_moe(seed: int = 0):
    """(model, processor): Qwen3.5-MoE, the same with routed and shared experts."""
    return _tiny_qwen3_5(seed, moe=True)


def tiny_gemma4(seed: int = 0):
    """(model, processor): Gemma 4 with 4-pixel patches pooled 3x3 (the image processor's fewest
    soft tokens, 70, bound its resize), per-layer input embeddings, no audio tower (its processor
    still has the audio feature extractor and tokens)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    from rloo.vision import images_only

    names = {
        "boi_token": "<start_of_image>",
        "image_token": "<|image|>",
        "eoi_token": "<end_of_image>",
        "boa_token": "<start_of_audio>",
        "audio_token": "<|audio|>",
        "eoa_token": "<end_of_audio>",
    }
    tokenizer = _tokenizer(list(names.values()), "<|image|>", names)
    ids = tokenizer.convert_tokens_to_ids
    text = _text(len(tokenizer))
    text.update(
        head_dim=8,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size_per_layer_input=len(tokenizer),
        hidden_size_per_layer_input=8,
    )
    config = Gemma4Config(
        text_config=text,
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            patch_size=4,
            pooling_kernel_size=3,
            position_embedding_size=256,
        ),
        audio_config=None,
        boi_token_id=ids("<start_of_image>"),
        eoi_token_id=ids("<end_of_image>"),
        image_token_id=ids("<|image|>"),
        video_token_id=None,
        audio_token_id=None,
        boa_token_id=None,
        eoa_token_index=None,
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config)
    processor = images_only(Gemma4Processor)(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessorPil(
            patch_size=4, max_soft_tokens=70, pooling_kernel_size=3
        ),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=70,
    )
    return _finish(model, tokenizer), processor


FAMILIES = {
    "qwen2_vl": tiny_qwen2_vl,
    "qwen2_5_vl": tiny_qwen2_5_vl,
    "gemma3": tiny_gemma3,
    "llava_next": tiny_llava_next,
    "idefics3": tiny_idefics3,
    "qwen3_5": tiny_qwen3_5,
    "qwen3_5_moe": tiny_qwen3_5_moe,
    "gemma4": tiny_gemma4,
}


def _finish(model, tokenizer):
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def save_vlm(directory: str, model, processor) -> str:
    """Model and processor in one folder, as a Hub VLM repo holds them."""
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def random_image(seed: int, width: int = 24, height: int = 20) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
