"""Vision-language models: telling one from a text model, and loading its processor (also where
transformers cannot build the stock one because torchvision is missing)."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch

from rloo.data import is_conversational

logger = logging.getLogger(__name__)


def is_vision_config(config: Any) -> bool:
    """A VLM's config has a vision tower's config (Qwen2-VL, Gemma3, LLaVA(-NeXT), Idefics3,
    SmolVLM, ...)."""
    return getattr(config, "vision_config", None) is not None


@functools.cache
def images_only(processor_class: type) -> type:
    """`processor_class` without its video processor, under the same name (so that a saved folder
    names the stock class). transformers builds Qwen2-VL-style processors only with a video
    processor, and its video processors need torchvision; images alone need neither. A processor
    whose constructor requires `video_processor` (Gemma 4) is given None, which is dropped before
    transformers' ProcessorMixin checks its parts."""
    from transformers import ProcessorMixin

    attributes = [name for name in processor_class.get_attributes() if name != "video_processor"]
    takes_video = "video_processor" in inspect.signature(processor_class.__init__).parameters

    class WithoutVideo(ProcessorMixin):
        # after processor_class and before ProcessorMixin in the method order: its super() call
        # lands here
        def __init__(self, *args, video_processor=None, **kwargs):
            super().__init__(*args, **kwargs)

    def __init__(self, *args, **kwargs):
        if takes_video and len(args) < len(attributes) + 1:
            kwargs.setdefault("video_processor", None)
        processor_class.__init__(self, *args, **kwargs)

    def get_attributes(cls):
        return list(attributes)

    return type(
        processor_class.__name__,
        (processor_class, WithoutVideo),
        {
            "__init__": __init__,
            "get_attributes": classmethod(get_attributes),
            "__module__": processor_class.__module__,
            "__doc__": f"{processor_class.__name__} for images only (no video processor).",
        },
    )


def has_image_processor(processing_class: Any) -> bool:
    return getattr(processing_class, "image_processor", None) is not None


def load_processor(name: str, config: Any, trust_remote_code: bool, revision: str | None = None):
    """AutoProcessor for a VLM; where transformers falls back to the bare tokenizer because the
    processor's video part needs torchvision, the same processor for images only (one log line)."""
    from transformers import AutoProcessor, AutoTokenizer
    from transformers.utils import is_torchvision_available

    kwargs = dict(trust_remote_code=trust_remote_code)
    if revision is not None:
        kwargs["revision"] = revision
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    class_name = PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", None))
    processor_class = getattr(transformers, class_name or "", None)
    # transformers without torchvision: the stock processor may not be buildable (its video part,
    # or, in older releases, AutoImageProcessor itself)
    images_alone = processor_class is not None and not is_torchvision_available()
    try:
        processor = AutoProcessor.from_pretrained(name, **kwargs)
    except (OSError, TypeError, ValueError):
        if not images_alone:
            raise
        processor = None
    if has_image_processor(processor):
        return processor
    if not images_alone:
        raise ValueError(
            f"{name!r} is a vision-language model ({type(config).__name__}) but its processor "
            f"could not be loaded (AutoProcessor gave a {type(processor).__name__}). Fix: make "
            "sure the folder or repo has its processor_config.json / preprocessor_config.json, or "
            "pass processing_class=AutoProcessor.from_pretrained(...) yourself."
        )
    image_processor = _pil_image_processor(name, config, kwargs)
    tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    attributes = processor_class.get_attributes()
    saved, _ = processor_class.get_processor_dict(name, **kwargs)
    # the processor's own settings (Idefics3's image_seq_len, ...), not its parts
    settings = {
        key: value
        for key, value in saved.items()
        if key not in attributes and key not in ("processor_class", "auto_map", "chat_template")
    }
    # an audio part (Gemma 4's feature extractor) loads without torchvision
    parts = {}
    if "feature_extractor" in attributes:
        from transformers import AutoFeatureExtractor

        parts["feature_extractor"] = AutoFeatureExtractor.from_pretrained(name, **kwargs)
    video = "video_processor" in attributes
    logger.info(
        "rloo: torchvision is not installed, so %s is built with its PIL image processor%s.",
        class_name,
        " and no video processor" if video else "",
    )
    built = images_only(processor_class) if video else processor_class
    return built(
        image_processor=image_processor,
        tokenizer=tokenizer,
        **parts,
        chat_template=tokenizer.chat_template,
        **settings,
    )


def _pil_image_processor(name: str, config: Any, kwargs: dict):
    """The model's image processor with transformers' PIL backend, by class (some transformers
    releases make AutoImageProcessor itself need torchvision)."""
    import transformers
    from transformers import AutoImageProcessor
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", None))
    pil = getattr(transformers, names.get("pil") or "", None) if isinstance(names, dict) else None
    if pil is None:
        return AutoImageProcessor.from_pretrained(name, backend="pil", **kwargs)
    return pil.from_pretrained(name, **kwargs)


def row_images(row: dict) -> list:
    """A dataset row's images: its `images` list, or its one `image` (None: no image)."""
    if row.get("images") is not None:
        images = row["images"]
        return list(images) if isinstance(images, (list, tuple)) else [images]
    return [] if row.get("image") is None else [row["image"]]


def _image_parts(content: Any) -> int:
    if isinstance(content, list):
        return sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
    return 0


def multimodal_messages(prompt: list[dict], num_images: int, row: int) -> list[dict]:
    """A conversational prompt as a processor's chat template takes it: string contents become text
    parts, and the first user message starts with one `{"type": "image"}` part per image (as TRL
    does), unless the prompt already has image parts, which must then match the images."""
    placed = sum(_image_parts(message.get("content")) for message in prompt)
    if placed and placed != num_images:
        raise ValueError(
            f"row {row}: the prompt has {placed} {{'type': 'image'}} part(s) but the row has "
            f"{num_images} image(s). Fix: one image part per image, or plain string contents "
            "(the images are then put at the start of the first user message)."
        )
    messages, first_user = [], not placed and num_images > 0
    for message in prompt:
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
            if first_user and message.get("role") == "user":
                content = [{"type": "image"} for _ in range(num_images)] + content
                first_user = False
        messages.append({**message, "content": content})
    if first_user:
        raise ValueError(
            f"row {row}: the row has {num_images} image(s) but its prompt has no user message "
            "with text content to put them in. Fix: add a user message."
        )
    return messages


def process_prompts(
    processor: Any, prompts: list, images: list[list], chat_template_kwargs: dict | None
) -> tuple[list[list[int]], list[dict]]:
    """Prompts and their images through a VLM's processor, one row at a time: (prompt token ids
    with the image tokens expanded, per row; the model's other inputs per row, e.g. pixel_values,
    image_grid_thw, token_type_ids, as a batch of one). Rows with the same prompt and images (the
    num_generations consecutive copies of one prompt) are processed once."""

    ids, media, previous = [], [], None
    for index, (prompt, row_images_) in enumerate(zip(prompts, images)):
        # equal prompt and images (PIL compares pixels): the previous row's result
        if previous is None or previous[0] != (prompt, row_images_):
            previous = (
                (prompt, row_images_),
                _process_one(
                    processor,
                    prompt,
                    row_images_,
                    index,
                    chat_template_kwargs,
                    is_conversational(prompt),
                ),
            )
        row_ids, row_media = previous[1]
        ids.append(row_ids)
        media.append(row_media)
    return ids, media


def _process_one(
    processor,
    prompt,
    images: list,
    row: int,
    chat_template_kwargs: dict | None,
    conversational: bool,
) -> tuple[list[int], dict]:
    if conversational:
        text = processor.apply_chat_template(
            multimodal_messages(prompt, len(images), row),
            add_generation_prompt=True,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
    else:
        check_string_prompt(prompt, len(images), getattr(processor, "image_token", None), row)
        text = prompt
    try:
        encoded = processor(
            text=[text],
            images=[images] if images else None,
            return_tensors="pt",
            add_special_tokens=not conversational,
        )
    except Exception as err:  # the processor's own message, with the row it came from
        raise ValueError(
            f"row {row}: the processor could not take this prompt and its "
            f"{len(images)} image(s): {err}"
        ) from err
    row_ids = encoded["input_ids"][0][encoded["attention_mask"][0].bool()].tolist()
    width = encoded["input_ids"].size(1)
    media = {}
    for key, value in encoded.items():
        if key in ("input_ids", "attention_mask") or not isinstance(value, torch.Tensor):
            continue
        # per-token inputs (token_type_ids, mm_token_type_ids): unpadded, like the ids
        if is_per_token(key, value, width):
            value = value[:, encoded["attention_mask"][0].bool()]
        media[key] = value
    return row_ids, media


def is_per_token(key: str, value: torch.Tensor, ids_length: int) -> bool:
    """token_type_ids, mm_token_type_ids: one entry per prompt token."""
    return (
        key.endswith("_ids")
        and value.dim() == 2
        and value.size(0) == 1
        and value.size(1) == ids_length
    )


def collate_media(
    media: list[dict], prompt_lengths: list[int], prompt_width: int, completion_width: int = 0
) -> dict[str, torch.Tensor]:
    """The model's extra inputs for these rows as one batch: per-token inputs left-padded like the
    prompts (zeros over padding and over `completion_width` completion tokens); images' tensors
    concatenated in row order (the first dimension counts images, tiles or patches), other
    dimensions zero-padded to the largest (LLaVA-NeXT's tiles), as the processors pad a batch."""
    keys = sorted({key for row in media for key in row})
    batch = {}
    for key in keys:
        per_token = [
            is_per_token(key, row[key], length)
            for row, length in zip(media, prompt_lengths)
            if key in row
        ]
        if all(per_token):
            out = torch.zeros(
                (len(media), prompt_width + completion_width),
                dtype=next(row[key] for row in media if key in row).dtype,
            )
            for index, (row, length) in enumerate(zip(media, prompt_lengths)):
                if key in row:
                    out[index, prompt_width - length : prompt_width] = row[key][0]
            batch[key] = out
            continue
        values = [row[key] for row in media if key in row]
        shape = [max(value.size(d) for value in values) for d in range(values[0].dim())]
        padded = []
        for value in values:
            if list(value.shape[1:]) != shape[1:]:
                grown = value.new_zeros([value.size(0)] + shape[1:])
                grown[tuple(slice(0, size) for size in value.shape)] = value
                value = grown
            padded.append(value)
        batch[key] = torch.cat(padded, dim=0)
    return batch


def forward_media(
    media: list[dict], attention_mask: torch.Tensor, completion_width: int, device: Any
) -> dict[str, torch.Tensor]:
    """collate_media for a forward over prompt + completion rows (`attention_mask` covers both, the
    last `completion_width` columns being the completion), on `device`."""
    prompt_width = attention_mask.size(1) - completion_width
    lengths = attention_mask[:, :prompt_width].sum(dim=1).tolist()
    batch = collate_media(media, lengths, prompt_width, completion_width)
    return {key: value.to(device) for key, value in batch.items()}


def placeholder_token_ids(config: Any) -> list[int]:
    """The ids a VLM's forward takes as "an image (or video) goes here". Sampled into a completion,
    one would make the training forward fail (more placeholders than images), so generation never
    samples them: `suppress_tokens`."""
    ids = []
    for name in ("image_token_id", "image_token_index", "video_token_id", "video_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


def check_string_prompt(prompt: str, count: int, image_token: str | None, row: int) -> None:
    """A plain string prompt with images must hold one image token per image."""
    if count and (image_token is None or prompt.count(image_token) != count):
        raise ValueError(
            f"row {row}: a plain string prompt with {count} image(s) and "
            f"{prompt.count(image_token) if image_token else 0} image token(s) ({image_token!r}). "
            "Fix: a conversational prompt ([{'role': 'user', 'content': ...}]), whose chat "
            "template places the images, or one image token per image in the string."
        )


def check_image_rows(train_dataset: Any, eval_dataset: Any, processor: Any) -> None:
    """Every row of the map-style datasets with image columns, before any model work: its images fit
    its prompt (no more images than `{"type": "image"}` parts where it has some; a plain string
    prompt holds one image token per image). Images are counted, not decoded."""
    named = [("train_dataset", train_dataset)]
    if isinstance(eval_dataset, dict):
        named += [(f"eval_dataset[{key!r}]", value) for key, value in eval_dataset.items()]
    elif eval_dataset is not None:
        named.append(("eval_dataset", eval_dataset))
    every_row = type(processor).__name__ in EVERY_ROW_PROCESSORS
    for name, dataset in named:
        if image_columns_of(dataset) and not has_image_processor(processor):
            raise ValueError(
                f"`{name}` has images but processing_class is a {type(processor).__name__}, which "
                "cannot read them. Fix: the model's processor, e.g. processing_class="
                "AutoProcessor.from_pretrained(...), or leave processing_class unset."
            )
        check_rows_fit(
            dataset,
            f"`{name}`",
            getattr(processor, "image_token", None),
            every_row,
            type(processor).__name__,
        )


# Processors whose pixel tensors have one entry per row of a batch (Idefics2/3, SmolVLM): a row
# without an image has nothing there, so every row of a batch must have one.
EVERY_ROW_PROCESSORS = ("Idefics2Processor", "Idefics3Processor", "SmolVLMProcessor")


def check_rows_fit(
    dataset: Any,
    name: str,
    image_token: str | None,
    every_row: bool = False,
    processor_name: str = "",
) -> None:
    """check_image_rows for one dataset, its errors starting with `name`."""
    try:
        _check_rows(dataset, image_token, every_row, processor_name)
    except ValueError as err:
        raise ValueError(f"{name} {err}") from None


IMAGE_COLUMNS = ("image", "images")  # a row's one image, or its list of them


def image_columns_of(dataset: Any) -> list[str]:
    return [column for column in IMAGE_COLUMNS if column in (dataset.column_names or [])]


def undecoded(dataset: Any) -> Any:
    """The dataset with its image columns read as {"bytes", "path"} (no image decoded)."""
    from datasets import Image as ImageFeature

    for column in image_columns_of(dataset):
        feature = dataset.features[column]
        inner = getattr(feature, "feature", None)
        if isinstance(feature, ImageFeature):
            dataset = dataset.cast_column(column, ImageFeature(decode=False))
        elif isinstance(inner, ImageFeature):
            dataset = dataset.cast_column(column, type(feature)(ImageFeature(decode=False)))
    return dataset


def check_images_readable(dataset: Any, source: str) -> None:
    """Every image of a map-style dataset opens and decodes; the first that does not is an error
    naming its row and column."""
    import io

    from PIL import Image

    columns = image_columns_of(dataset)
    if not columns:
        return
    for index, row in enumerate(undecoded(dataset.select_columns(columns))):
        for column in columns:
            for image in row_images({column: row[column]}):
                try:
                    if isinstance(image, dict):
                        image = Image.open(
                            io.BytesIO(image["bytes"]) if image.get("bytes") else image["path"]
                        )
                    image.load()
                except Exception as err:  # PIL raises many types for a bad file
                    raise ValueError(
                        f"{source}: row {index}: its {column!r} cannot be read as an "
                        f"image ({type(err).__name__}: {err}). Fix: replace or drop "
                        "the row."
                    ) from None


def embed_images(dataset: Any) -> Any:
    """Images that the dataset references by file path stored in it as bytes, so that a saved copy
    (save_to_disk) holds them."""
    from datasets.table import embed_table_storage

    if not image_columns_of(dataset):
        return dataset
    return dataset.with_format("arrow").map(embed_table_storage, batched=True).with_format(None)


def _check_rows(
    dataset: Any, image_token: str | None, every_row: bool = False, processor_name: str = ""
) -> None:
    from datasets import Dataset

    columns = image_columns_of(dataset)
    if not isinstance(dataset, Dataset) or not columns:
        return
    for index, row in enumerate(undecoded(dataset.select_columns(["prompt"] + columns))):
        count, prompt = len(row_images(row)), row["prompt"]
        if every_row and count == 0:
            raise ValueError(
                f"row {index} has no image, but a {processor_name} batch needs an image in every "
                "row (its pixel tensors have one entry per row). Fix: give the row an image, or "
                "train on the rows without images separately."
            )
        if is_conversational(prompt):
            multimodal_messages(prompt, count, index)
        else:
            check_string_prompt(prompt, count, image_token, index)
