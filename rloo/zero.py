"""How a run is spread over processes: which ZeRO stage is on, frozen models (reference, reward
models) as ZeRO inference engines, full parameters gathered for generation under ZeRO-3, no DDP
wrapper around a single CPU process (torchrun with one process), and DeepSpeed's process group on
the CPU (gloo), which accelerate does not start by itself."""

from __future__ import annotations

import contextlib
import copy
import os

from torch import nn


def zero_stage(accelerator) -> int:
    """The ZeRO stage the run trains with; 0 without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return 0
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))


def single_process_ddp(accelerator) -> None:
    """torchrun with a single process on CPU: accelerate wraps the model in
    DistributedDataParallel for any multi-CPU state, one process or not (an all-reduce over one
    process per backward, and no shared prompts through the wrapper: the quick start's train
    forward + backward took 7-8 s a step instead of 3.5). Mark the state as the single process it
    is; the process group stays up, unused."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if accelerator.num_processes == 1 and accelerator.distributed_type == DistributedType.MULTI_CPU:
        # (AcceleratorState copies it from there)
        PartialState().distributed_type = DistributedType.NO
        accelerator.state.distributed_type = DistributedType.NO


def is_partitioned(model: nn.Module) -> bool:
    """True when ZeRO-3 has already split the parameters across ranks (a model loaded under
    zero.Init)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    size = getattr(config, "hidden_size", None)
    if size is None and getattr(config, "hidden_sizes", None):
        size = max(config.hidden_sizes)
    return size


def _drop_auto(node: dict) -> dict:
    """DeepSpeed defaults for the values transformers fills only when it builds the training
    engine."""
    return {
        key: _drop_auto(value) if isinstance(value, dict) else value
        for key, value in node.items()
        if value != "auto"
    }


def frozen_engine_config(training_config: dict, model: nn.Module, micro_batch_size: int) -> dict:
    """The training run's DeepSpeed config turned into one for a model that only runs forward
    passes: no optimizer or scheduler, stage 3 kept (sharded like the policy) and anything lower
    reduced to 0 (replicated), ZeRO-3 buckets left on 'auto' sized from the model as transformers
    sizes the policy's."""
    config = copy.deepcopy(training_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = config.setdefault("zero_optimization", {})
    if zero.get("stage", 0) == 3:
        hidden = _hidden_size(model)
        sizes = (
            {
                "reduce_bucket_size": hidden * hidden,
                "stage3_param_persistence_threshold": 10 * hidden,
                "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            }
            if hidden
            else {}
        )
        # the values transformers gives the policy; a user's numbers stay
        for key, value in sizes.items():
            if zero.get(key, "auto") == "auto":
                zero[key] = value
    else:
        zero["stage"] = 0
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["gradient_accumulation_steps"] = 1
    config.pop("train_batch_size", None)
    return _drop_auto(config)


def prepare_frozen(model: nn.Module, accelerator, micro_batch_size: int) -> nn.Module:
    """A frozen model wrapped as a DeepSpeed engine in eval mode (ZeRO-3: sharded; forward gathers
    layer by layer, so every rank must call it the same number of times)."""
    import deepspeed

    config = frozen_engine_config(
        accelerator.state.deepspeed_plugin.deepspeed_config, model, micro_batch_size
    )
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def gathered_parameters(model: nn.Module, enabled: bool, modifier_rank: int | None = None):
    """Context in which every ZeRO-3 shard of `model` is gathered on each rank
    (ds3_gather_for_generation: generation then runs on full weights without one all-gather per
    layer per token). With modifier_rank, what that rank writes into the full weights is
    re-partitioned to all ranks on exit. A no-op when not enabled."""
    if not enabled:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=modifier_rank)


DEEPSPEED_ON_CPU = {"started": False}


def start_deepspeed_on_cpu(timeout_s: int) -> None:
    """The process group and accelerate state for DeepSpeed over gloo (CPU), as a DeepSpeed launch
    on GPUs has."""
    from datetime import timedelta

    from accelerate import PartialState

    if PartialState._shared_state:
        return
    DEEPSPEED_ON_CPU["started"] = True
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo", timeout=timedelta(seconds=timeout_s))
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
