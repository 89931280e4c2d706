"""The model stage's checks, from the model's config alone (no weights load): the policy and
tokenizer the recipe names (aliases resolved), LoRA's target modules on a meta-device skeleton, the
tokenizer against the embedding, and every training prompt against the context."""

from __future__ import annotations

import os

from infra.runconfig import RunConfig
from rloo import vision
from rloo.adapters import default_lora_targets, linear_module_names
from rloo.assets import resolve_model_alias
from rloo.vision import is_vision_config


def resolve_model_source(config: RunConfig) -> tuple[str, str | None]:
    """(policy path or id, tokenizer path or None) for training.model_name_or_path, aliases resolved
    (rloo.assets.resolve_model_alias; 'tiny' is built under the run root),
    training.tokenizer_name_or_path first."""

    policy, tokenizer = resolve_model_alias(
        config.training["model_name_or_path"], os.path.join(config.run_root, ".assets")
    )
    return policy, config.training.get("tokenizer_name_or_path") or tokenizer


def check_lora_targets(model_source: str, targets, trust_remote_code: bool) -> tuple[int, object]:
    """Build the architecture on the meta device (no weights) and check that LoRA's targets exist
    (None: PEFT's default for the architecture); returns (the parameter count, the targets)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    model_config = AutoConfig.from_pretrained(model_source, trust_remote_code=trust_remote_code)
    if targets is None:
        try:
            targets = default_lora_targets(model_config.model_type)
        except ValueError as err:
            raise ValueError(f"training.lora_target_modules: {err}") from None
    auto = AutoModelForImageTextToText if is_vision_config(model_config) else AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = auto.from_config(model_config, trust_remote_code=trust_remote_code)
    available = linear_module_names(skeleton)
    if targets != "all-linear":
        missing = [t for t in targets if t not in available]
        if missing:
            raise ValueError(
                f"training.lora_target_modules {missing} match no layer of "
                f"{type(skeleton).__name__}; its Linear layers are: {', '.join(available)}."
            )
    return sum(p.numel() for p in skeleton.parameters()), targets


def check_tokenizer_fits(policy: str, tokenizer, args, dataset_result: dict) -> None:
    """From the model's config (no weights): every token id of the tokenizer has an embedding row,
    and every training prompt plus max_completion_length fits the model's context (prompts are never
    truncated)."""
    import datasets
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(policy, trust_remote_code=args.trust_remote_code)
    text_config = (
        model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    )
    vocab = getattr(text_config, "vocab_size", None)
    context = getattr(text_config, "max_position_embeddings", None)

    processor, tokenizer = tokenizer, getattr(tokenizer, "tokenizer", tokenizer)
    if vocab and len(tokenizer) > vocab:
        raise ValueError(
            f"the tokenizer ({tokenizer.name_or_path}) has {len(tokenizer)} tokens but the model "
            f"{policy} embeds only {vocab}: ids from {vocab} on would index past its embedding. "
            "Fix: the model's own tokenizer (training.tokenizer_name_or_path), or a model resized "
            "to it."
        )
    if not context:
        return
    rows = datasets.load_from_disk(dataset_result["train_path"])
    with_images = vision.has_image_processor(processor) and vision.image_columns_of(rows)
    for index, row in enumerate(rows):
        prompt = text = row["prompt"]
        if with_images:  # the image tokens count: the processor expands them per image
            ids, _ = vision.process_prompts(
                processor, [prompt], [vision.row_images(row)], args.chat_template_kwargs
            )
            length = len(ids[0])
            text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        else:
            if isinstance(prompt, list):
                text = tokenizer.apply_chat_template(
                    prompt,
                    tokenize=False,
                    add_generation_prompt=True,
                    **(args.chat_template_kwargs or {}),
                )
            length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if length + (args.max_completion_length or 1) > context:
            raise ValueError(
                f"data: training prompt {index} ({str(text)[:50]!r}...) is {length} tokens; with "
                f"training.max_completion_length={args.max_completion_length} it exceeds the "
                f"context of {policy} ({context} tokens, max_position_embeddings). Fix: drop or "
                "shorten the long prompts, or a smaller max_completion_length."
            )
