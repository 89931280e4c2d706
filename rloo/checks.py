"""Input checks of `RLOOTrainer`, run before any model loads: each names the argument, the value and
the fix.

Reward functions are checked by their signature only (`check_reward_signature`), and by their own
`check_dependencies()` where they define one (a missing optional package): the trainer never calls a
reward function before it has real completions and the live `TrainerState`."""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

from datasets import Dataset, IterableDataset
from torch import nn

from rloo.adapters import check_quantization_supported
from rloo.data import check_prompt_dataset
from rloo.generation.vllm_colocate import check_colocate_possible
from rloo.primitives import is_peft_model
from rloo.rewards.runner import RewardFunctionError, reward_function_name
from rloo.vision import IMAGE_COLUMNS, is_vision_config

# Keywords every reward function receives besides the dataset columns
# (rloo.rewards.runner.RewardRunner).
REWARD_KEYWORDS = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
)

logger = logging.getLogger(__name__)


def reward_columns(dataset: Any, remove_unused_columns: bool | None) -> list[str] | None:
    """The dataset columns a reward function receives as keywords (None: unknown, e.g. a stream
    without features)."""
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return None
    if remove_unused_columns:
        # only prompt and the images survive the column filter
        return [column for column in IMAGE_COLUMNS if column in columns]
    return [
        column for column in columns if column not in ("prompt", "completion", "completion_ids")
    ]


def check_reward_signature(func: Any, index: int, columns: list[str] | None) -> None:
    """A reward function must accept every keyword the trainer passes (`prompts`, `completions`,
    `completion_ids`, `trainer_state`, `log_extra`, `log_metric` and the dataset's columns): through
    `**kwargs`, or by name. It must also require nothing the trainer does not pass. Checked without
    calling it."""
    if isinstance(func, (str, nn.Module)):
        return
    try:
        signature = inspect.signature(func)
    # a builtin or C callable without a signature: checked at the first call
    except (TypeError, ValueError):
        return
    name = reward_function_name(func)
    parameters = signature.parameters.values()
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    by_name = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    passed = list(REWARD_KEYWORDS) + list(columns or [])
    if not accepts_any:
        missing = [keyword for keyword in passed if keyword not in by_name]
        if missing:
            raise RewardFunctionError(
                f"reward_funcs[{index}] '{name}' does not accept the keyword(s) {missing} that the "
                f"trainer passes (it calls reward functions with {passed}). Fix: add **kwargs to "
                f"its signature, e.g. def {name}(prompts, completions, **kwargs)."
            )
    required = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    unknown = [p for p in required if p not in passed]
    if columns is not None and unknown:
        raise RewardFunctionError(
            f"reward_funcs[{index}] '{name}' requires the parameter(s) {unknown}, which the "
            f"trainer does not pass: it passes {passed}. Fix: add a dataset column of that name "
            "(with remove_unused_columns=False), or give the parameter a default."
        )
    positional_only = [
        p.name
        for p in parameters
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty
    ]
    if positional_only:
        raise RewardFunctionError(
            f"reward_funcs[{index}] '{name}' has positional-only parameter(s) {positional_only}; "
            "the trainer passes everything by keyword. Fix: drop the '/'."
        )


def check_image_columns(
    columns: list[str] | None, name: str, model: Any, trust_remote_code: bool
) -> None:
    """Images (an `image` or `images` column among a dataset's `columns`) need a vision-language
    model: a text model would train on the text alone. Told before any weight loads (the model's
    config alone)."""
    columns = columns or []
    found = [column for column in IMAGE_COLUMNS if column in columns]
    if not found:
        return

    config = getattr(model, "config", None)
    if isinstance(model, str):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(
                os.path.expanduser(model), trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError):
            return  # the model's own load says what is wrong with it
    if config is not None and not is_vision_config(config):
        raise ValueError(
            f"`{name}` has a column {found[0]!r} but the model is a text-only "
            f"{type(config).__name__}: it would train on the text alone. Fix: a vision-language "
            "model (e.g. Qwen/Qwen2.5-VL-3B-Instruct), or, if the images are meant only for your "
            f"reward functions, rename the column (dataset.rename_column({found[0]!r}, "
            f"'reward_{found[0]}'))."
        )


def check_inputs(
    args,
    reward_funcs,
    train_dataset,
    eval_dataset,
    reward_processing_classes,
    model,
    quantization_config,
    peft_config,
) -> None:
    """Everything about the trainer's arguments that is knowable before a model loads."""
    if train_dataset is None:
        raise ValueError(
            "`train_dataset` is required: pass a Dataset or IterableDataset with a 'prompt' column."
        )
    if not isinstance(train_dataset, (Dataset, IterableDataset)):
        raise TypeError(
            "train_dataset must be a datasets.Dataset or IterableDataset, got "
            f"{type(train_dataset).__name__}. Fix: datasets.Dataset.from_list(rows)."
        )
    check_prompt_dataset(train_dataset, "train_dataset")
    check_image_columns(train_dataset.column_names, "train_dataset", model, args.trust_remote_code)
    if peft_config is not None and is_peft_model(model):
        raise ValueError(
            "model is already a PeftModel and peft_config is also given: pass one of them (the "
            "PeftModel keeps its adapter; peft_config adds a new one to a plain model)."
        )
    # (an instantiated model: quantization_config is ignored with a warning, as the TRL docs say)
    quantized = isinstance(model, str) and (
        quantization_config is not None or "quantization_config" in (args.model_init_kwargs or {})
    )
    if quantized and peft_config is None:
        raise ValueError(
            "quantization_config is set without peft_config: a 4/8-bit base model cannot be "
            "trained directly. Fix: also pass peft_config=LoraConfig(...) (QLoRA)."
        )
    if quantized:
        check_quantization_supported(
            quantization_config or args.model_init_kwargs["quantization_config"]
        )
    if args.sync_ref_model:
        if args.beta == 0.0:
            raise ValueError(
                "sync_ref_model=True but beta=0.0: without the KL penalty there is no reference "
                "model to synchronise. Fix: set beta > 0 or sync_ref_model=False."
            )
        if peft_config is not None or is_peft_model(model):
            raise NotImplementedError(
                "sync_ref_model=True is not supported with PEFT: the reference is the base model "
                "(adapter disabled), which is frozen. Fix: sync_ref_model=False."
            )
    if args.eval_strategy != "no" and eval_dataset is None:
        strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
        raise ValueError(
            f"eval_strategy={strategy!r} but no eval_dataset was given. Fix: pass "
            "eval_dataset=... or set eval_strategy='no'."
        )
    check_dispatch(args, train_dataset, eval_dataset)
    if isinstance(train_dataset, IterableDataset) and args.max_steps <= 0:
        raise ValueError(
            "train_dataset is an IterableDataset, whose length is unknown: set max_steps (e.g. "
            "RLOOConfig(max_steps=1000))."
        )
    if args.use_vllm and args.vllm_mode == "colocate":
        check_colocate_possible(args)
    if eval_dataset is not None:
        named = (
            eval_dataset.items()
            if isinstance(eval_dataset, dict)
            else [("eval_dataset", eval_dataset)]
        )
        for name, dataset in named:
            label = name if name == "eval_dataset" else f"eval_dataset[{name!r}]"
            check_prompt_dataset(dataset, label)
            check_image_columns(dataset.column_names, label, model, args.trust_remote_code)
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError(
            "reward_funcs is empty: pass at least one reward function or reward model."
        )
    columns = reward_columns(train_dataset, args.remove_unused_columns)
    for index, func in enumerate(funcs):
        if not (isinstance(func, (str, nn.Module)) or callable(func)):
            raise TypeError(
                f"reward_funcs[{index}] is a {type(func).__name__}: expected a callable, a "
                "sequence-classification model, or a model id/path."
            )
        check_reward_signature(func, index, columns)
        check_dependencies = getattr(func, "check_dependencies", None)
        # e.g. accuracy_reward: math-verify installed? (the reward is not called)
        if callable(check_dependencies):
            check_dependencies()
    if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(args.reward_weights)} entries but there are {len(funcs)} "
            "reward functions; give one weight per function."
        )
    listed = isinstance(reward_processing_classes, (list, tuple))
    if listed and len(reward_processing_classes) != len(funcs):
        raise ValueError(
            f"reward_processing_classes has {len(reward_processing_classes)} entries but there are "
            f"{len(funcs)} reward functions; the lengths must match."
        )
    if reward_processing_classes is not None and not listed and len(funcs) != 1:
        raise ValueError(
            f"one reward processing class for {len(funcs)} reward functions: the number of reward "
            "processing classes must match the number of reward functions. Fix: a list with one "
            "entry per function (None for a plain function)."
        )


def _streams(train_dataset, eval_dataset) -> bool:
    evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    return any(isinstance(d, IterableDataset) for d in [train_dataset, *evals])


def check_dispatch(args, train_dataset, eval_dataset) -> None:
    """Streaming datasets cannot be dispatched from rank 0 (checked first, as TRL does)."""
    if _streams(train_dataset, eval_dataset) and args.accelerator_config.dispatch_batches:
        raise ValueError(
            "Iterable datasets require `dispatch_batches=False`: "
            "accelerator_config.dispatch_batches=True cannot be used with an IterableDataset, "
            "whose prompts are strings or message lists that rank 0 cannot dispatch as tensors. "
            "Fix: leave dispatch_batches unset."
        )


def prepare_for_iterable_datasets(args, train_dataset, eval_dataset) -> None:
    """Streaming datasets, now or passed to evaluate() later: every process reads its own slice of
    each global batch (no dispatch from rank 0, which cannot carry string/message columns), and a
    streamed train set is read by one worker (several would interleave the stream and split the
    prompt groups), as TRL does."""
    check_dispatch(args, train_dataset, eval_dataset)
    if args.accelerator_config.dispatch_batches is None:
        # Prompts never dispatch as tensors: a stream handed to evaluate() later, which
        # construction never saw, is read slice by slice too.
        args.accelerator_config.dispatch_batches = False
    if isinstance(train_dataset, IterableDataset) and args.dataloader_num_workers != 0:
        logger.warning(
            "Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; "
            "overriding the provided value (%d).",
            args.dataloader_num_workers,
        )
        args.dataloader_num_workers = 0
