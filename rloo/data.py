"""Prompt formats (standard / conversational), dataset checks, tokenisation and padding."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from datasets import Dataset, IterableDataset


def is_conversational(prompt: Any) -> bool:
    """A conversational prompt is a list of {'role': ..., 'content': ...} messages."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and isinstance(prompt[0], dict)
        and "role" in prompt[0]
    )


def check_prompt_dataset(dataset: Any, name: str = "train_dataset") -> None:
    """A dataset must be a (non-empty) datasets.Dataset / IterableDataset with a usable `prompt`
    column."""
    if dataset is None:
        raise ValueError(f"`{name}` is required: pass a datasets.Dataset with a 'prompt' column.")
    if not isinstance(dataset, (Dataset, IterableDataset)):
        raise TypeError(
            f"`{name}` must be a datasets.Dataset or IterableDataset, got "
            f"{type(dataset).__name__}. Fix: datasets.Dataset.from_list(rows) or "
            "from_dict(columns)."
        )
    columns = dataset.column_names
    if columns is not None and "prompt" not in columns:
        raise ValueError(
            f"`{name}` has no 'prompt' column (columns: {columns}). Fix: rename the column holding "
            "the prompts to 'prompt', e.g. dataset.rename_column('question', 'prompt')."
        )
    if isinstance(dataset, Dataset):
        if len(dataset) == 0:
            raise ValueError(f"`{name}` is empty: it needs at least one prompt.")
        first = dataset[0]["prompt"]
        if not (isinstance(first, str) or is_conversational(first)):
            raise ValueError(
                f"`{name}` row 0: 'prompt' must be a string or a list of {{'role', 'content'}} "
                f"messages, got {type(first).__name__}: {str(first)[:80]!r}."
            )


def tokenize_prompts(
    processing_class: Any, prompts: list, chat_template_kwargs: dict | None
) -> list[list[int]]:
    """Conversational prompts go through the chat template (generation prompt added); standard ones
    are tokenised as they are (special tokens included, never truncated)."""
    if is_conversational(prompts[0]):
        encoded = processing_class.apply_chat_template(
            prompts,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(chat_template_kwargs or {}),
        )
        return [list(ids) for ids in encoded["input_ids"]]
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]


def round_up(length: int, multiple: int | None) -> int:
    if not multiple:
        return length
    return ((length + multiple - 1) // multiple) * multiple


def pad_rows(
    rows: list[list[int]], pad_id: int, side: str, multiple: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token-id lists to one length (optionally a multiple); returns (ids, mask)."""
    width = round_up(max((len(r) for r in rows), default=0), multiple)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if not row:
            continue
        if side == "left":
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
        else:
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
    return ids, mask


def as_completion(text: str, conversational: bool) -> Any:
    return [{"role": "assistant", "content": text}] if conversational else text


FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_prompt_dataset(
    name: str, config: str | None = None, split: str = "train", streaming: bool = False
):
    """A Hub dataset id, a folder written by `save_to_disk`, or a JSON/JSONL/CSV/Parquet file -> one
    split."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    path = os.path.expanduser(name)
    extension = os.path.splitext(path)[1].lower()
    if extension in FILE_BUILDERS:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"dataset {name!r}: no such file.")
        loaded = load_dataset(
            FILE_BUILDERS[extension], data_files={split: path}, split=split, streaming=streaming
        )
        return with_image_files(loaded, os.path.dirname(os.path.abspath(path)))
    if (
        os.path.isdir(path)
        and os.path.exists(os.path.join(path, "dataset_dict.json"))
        or os.path.isdir(path)
        and os.path.exists(os.path.join(path, "dataset_info.json"))
    ):
        loaded = load_from_disk(path)
        if isinstance(loaded, DatasetDict):
            if split not in loaded:
                raise ValueError(
                    f"dataset {name!r} has no split {split!r} (splits: {list(loaded)})."
                )
            loaded = loaded[split]
        return loaded.to_iterable_dataset() if streaming else loaded
    if os.path.exists(path) or name.startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"dataset {name!r} is neither a data file (.json/.jsonl/.csv/.parquet) nor a folder "
            "written by Dataset.save_to_disk."
        )
    try:
        return load_dataset(name, config, split=split, streaming=streaming)
    except Exception as err:  # datasets raises many types for offline / missing ids
        raise ValueError(
            f"dataset {name!r} (config {config!r}, split {split!r}) could not be loaded from the "
            f"Hugging Face Hub: {err}"
        ) from err


MIXTURE_PART_KEYS = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction")


def mixture_problems(values: dict) -> list[str]:
    """What is wrong with a recipe's `datasets:` mixture (TRL's DatasetMixtureConfig: a list of
    {path, name, data_dir, data_files, split, columns, fraction}, plus `streaming` and
    `test_split_size`), each naming the entry and the fix; [] when it is fine."""
    parts, problems = values.get("datasets"), []
    if not isinstance(parts, list) or not parts:
        return ["datasets: a non-empty list of {path: ..., split: ...} entries."]
    for index, part in enumerate(parts):
        if not isinstance(part, dict) or "path" not in part:
            problems.append(
                f"datasets[{index}]: needs `path` (a Hub id, a builder such as json "
                "with data_files, a data file or a save_to_disk folder)."
            )
            continue
        problems += [
            f"datasets[{index}].{key}: unknown key (known: {', '.join(MIXTURE_PART_KEYS)})."
            for key in part
            if key not in MIXTURE_PART_KEYS
        ]
    fractions = [part.get("fraction") for part in parts if isinstance(part, dict)]
    if any(f is not None for f in fractions) and any(f is None for f in fractions):
        problems.append(
            "datasets: `fraction` is set on some entries, not all: set it on every "
            "entry or on none."
        )
    if any(f is not None and f < 0 for f in fractions):
        problems.append("datasets: a `fraction` below 0.")
    if values.get("streaming") and any(f is not None for f in fractions):
        problems.append(
            "datasets: `fraction` cannot apply to streamed datasets (their length is "
            "unknown); drop fraction or streaming."
        )
    split = values.get("test_split_size")
    if split is not None and not (0 < split < 1 or (float(split).is_integer() and split >= 1)):
        problems.append(f"test_split_size={split}: a share in (0, 1) or a row count.")
    return problems


def load_mixture(values: dict) -> dict:
    """A recipe's `datasets:` mixture as TRL's get_dataset builds it: each entry loaded (a data
    file or save_to_disk folder as rloo loads one; anything else through datasets.load_dataset
    with its name, data_dir, data_files and split), its `columns` kept, cut to its `fraction` of
    the mixture (the largest mixture no entry has to repeat rows for, the first rows of each),
    concatenated in order; {"train": ...} plus "test" with `test_split_size`."""
    from datasets import concatenate_datasets, load_dataset

    streaming = bool(values.get("streaming"))
    loaded = []
    for part in values["datasets"]:
        path, split = part["path"], part.get("split", "train")
        local = os.path.splitext(path)[1].lower() in FILE_BUILDERS or os.path.isdir(
            os.path.expanduser(path)
        )
        if local and not (part.get("data_files") or part.get("data_dir")):
            dataset = load_prompt_dataset(path, part.get("name"), split, streaming)
        else:
            dataset = load_dataset(
                path=path,
                name=part.get("name"),
                data_dir=part.get("data_dir"),
                data_files=part.get("data_files"),
                split=split,
                streaming=streaming,
            )
        if part.get("columns") is not None:
            dataset = dataset.select_columns(part["columns"])
        loaded.append(dataset)
    fractions = [part.get("fraction") for part in values["datasets"]]
    if fractions[0] is not None:
        weights = [fraction / sum(fractions) for fraction in fractions]
        total = min(len(d) / w for d, w in zip(loaded, weights) if w > 0)
        loaded = [d.select(range(round(w * total))) for d, w in zip(loaded, weights)]
    combined = concatenate_datasets(loaded)
    if values.get("test_split_size") is None:
        return {"train": combined}
    split = values["test_split_size"]
    parts = combined.train_test_split(test_size=int(split) if split >= 1 else split, seed=0)
    return {"train": parts["train"], "test": parts["test"]}


def with_prompt(dataset, column: str | None, system_prompt: str | None):
    """The dataset's `prompt` made from a text `column` (as one user message) and/or a system
    message before each conversational prompt: what the TRL docs' example scripts do with `map`."""
    names = dataset.column_names or []
    if column is not None and column not in names:
        raise ValueError(f"dataset_prompt_column={column!r}: no such column (columns: {names}).")
    if column is not None and "prompt" in names and column != "prompt":
        dataset = dataset.remove_columns("prompt")

    def build(value):  # (only that column is read: images are not decoded)
        prompt = [{"role": "user", "content": value}] if column is not None else value
        if system_prompt is not None:
            if not is_conversational(prompt):
                raise ValueError(
                    "system_prompt needs conversational prompts; a prompt is a "
                    f"string ({str(prompt)[:40]!r}). Fix: dataset_prompt_column."
                )
            prompt = [{"role": "system", "content": system_prompt}] + list(prompt)
        return {"prompt": prompt}

    return dataset.map(build, input_columns=[column or "prompt"])


ROLES = ("system", "user", "assistant", "tool", "developer")


class DatasetValidationError(ValueError):
    """A dataset row that cannot be used, named by row index and column."""


def _is_content(content: Any) -> bool:
    """A message's content: a string, or a VLM's parts (text and image placeholders)."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict)
        and (
            part.get("type") == "image"
            or part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
        for part in content
    )


def validate_prompt_rows(dataset, source: str = "dataset") -> str:
    """Check every row's `prompt` (a non-empty string, or a list of {'role', 'content'} messages,
    the same kind in every row); returns 'standard' or 'conversational'. The first bad row is named
    with its column."""
    if "prompt" not in (dataset.column_names or []):
        raise DatasetValidationError(
            f"{source}: no 'prompt' column (columns: {dataset.column_names}). Fix: rename the "
            "column holding the prompts to 'prompt'."
        )
    kind = None
    for index, prompt in enumerate(dataset["prompt"]):
        if isinstance(prompt, str):
            row_kind = "standard"
            if not prompt.strip():
                raise DatasetValidationError(
                    f"{source}: row {index}, column 'prompt': empty prompt."
                )
        elif isinstance(prompt, list):
            row_kind = "conversational"
            if not prompt:
                raise DatasetValidationError(
                    f"{source}: row {index}, column 'prompt': empty message list."
                )
            for position, message in enumerate(prompt):
                if (
                    not isinstance(message, dict)
                    or message.get("role") not in ROLES
                    or not _is_content(message.get("content"))
                ):
                    raise DatasetValidationError(
                        f"{source}: row {index}, column 'prompt', message {position}: expected "
                        f"{{'role': one of {list(ROLES)}, 'content': str or a list of "
                        "{'type': 'text', 'text': str} / {'type': 'image'} parts}, got "
                        f"{str(message)[:80]!r}."
                    )
        else:
            raise DatasetValidationError(
                f"{source}: row {index}, column 'prompt': expected a string or a list of messages, "
                f"got {type(prompt).__name__} {str(prompt)[:60]!r}."
            )
        if kind is None:
            kind = row_kind
        elif row_kind != kind:
            raise DatasetValidationError(
                f"{source}: row {index}, column 'prompt' is {row_kind} but earlier rows are "
                f"{kind}; use one format for the whole dataset."
            )
    if kind is None:
        raise DatasetValidationError(f"{source}: the dataset is empty.")
    # what reward functions receive: a NaN is a missing value, not a number
    for column in dataset.column_names:
        skip = ("prompt", "image", "images")  # (images: checked by rloo.vision, never decoded here)
        for index, value in enumerate(dataset[column] if column not in skip else ()):
            if isinstance(value, float) and math.isnan(value):
                raise DatasetValidationError(
                    f"{source}: row {index}, column {column!r}: NaN (a missing value; reward "
                    "functions would get it as a number). Fix: fill it in, or drop the row."
                )
    return kind


def with_image_files(dataset: Any, base_dir: str) -> Any:
    """A data file's `image` / `images` columns of file paths (relative to the file's folder) or of
    encoded bytes (Parquet) as datasets.Image features, so that rows hold PIL images as with a Hub
    dataset. A path that is no file is an error naming its row (a stream's: when it is read)."""
    from datasets import Image as ImageFeature
    from datasets import List

    features = getattr(dataset, "features", None) or {}
    for column, nested in (("image", False), ("images", True)):
        feature = features.get(column)
        dtype = getattr(getattr(feature, "feature", feature), "dtype", None)
        if dtype in ("binary", "large_binary"):  # datasets.Image takes encoded bytes as they are
            dataset = dataset.cast_column(
                column, List(ImageFeature()) if nested else ImageFeature()
            )
        if dtype != "string":
            continue

        def absolute(row, index, column=column, nested=nested):
            def one(path):
                if path is None:
                    return None
                full = os.path.join(base_dir, os.path.expanduser(path))
                if not os.path.isfile(full):
                    raise ValueError(
                        f"row {index}: {column} {path!r} is not a file ({full}). Fix: "
                        "paths relative to the data file's folder, or absolute."
                    )
                return full

            value = row[column]
            return {column: [one(p) for p in value] if nested and value is not None else one(value)}

        dataset = dataset.map(absolute, with_indices=True)
        dataset = dataset.cast_column(column, List(ImageFeature()) if nested else ImageFeature())
    return dataset
