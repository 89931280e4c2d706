"""Trainer callbacks: TR-DPO reference-model synchronisation, checkpoint-and-stop on preemption,
completion tables to MLflow, Weights & Biases and Trackio.

`MLflowCompletionsCallback` and `TrackerCompletionsCallback` are the only places in `rloo/` where
mlflow, wandb or trackio are imported, lazily inside the callback: they serve users of the trainer
with `report_to` naming them (transformers' own callbacks own the runs; these add the completion
tables to them, as TRL logs its `completions` table). The pipeline does not use them: it passes
its own `on_completions` callback."""

from __future__ import annotations

import logging
import math
import signal
import threading

import torch
from torch import nn
from transformers import TrainerCallback

from rloo.zero import zero_stage

logger = logging.getLogger(__name__)


@torch.no_grad()
def mix_into_reference(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """TR-DPO soft update, parameter-wise: pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref."""
    policy_params = dict(policy.named_parameters())
    for name, ref_param in reference.named_parameters():
        if name not in policy_params:
            raise ValueError(
                f"reference parameter {name!r} has no counterpart in the policy: the two models "
                "must have the same architecture."
            )
        ref_param.mul_(1.0 - alpha).add_(
            policy_params[name].detach().to(ref_param.dtype), alpha=alpha
        )


class SyncRefModelCallback(TrainerCallback):
    """Every `ref_model_sync_steps` optimizer steps, mix the policy into the reference (TR-DPO,
    Gorbatovski 2024)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps != 0:
            return
        trainer = self.trainer
        reference = trainer.accelerator.unwrap_model(trainer.ref_model)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        if zero_stage(trainer.accelerator) == 3:
            import deepspeed

            params = list(reference.parameters()) + list(policy.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                if trainer.accelerator.is_main_process:
                    mix_into_reference(reference, policy, args.ref_model_mixup_alpha)
        else:
            mix_into_reference(reference, policy, args.ref_model_mixup_alpha)


class PreemptionCallback(TrainerCallback):
    """SLURM sends a pre-termination signal (SIGUSR2 through submitit) before a preemption or the
    time limit: finish the current optimizer step, save a checkpoint and stop. Ranks agree with an
    all-reduce at every step end, so they all save the same step even when the signal reaches them
    at different moments."""

    def __init__(self, signals=(signal.SIGUSR2,)):
        self.signals = signals
        self.requested = False
        self.stopped_at: int | None = None

    def _handler(self, signum, frame) -> None:
        self.requested = True

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                signal.signal(signum, self._handler)

    def on_step_end(self, args, state, control, **kwargs):
        requested = self.requested
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor([1 if requested else 0], device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            requested = bool(flag.item())
        if requested:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step


def image_columns(rows: list[dict]) -> dict[str, list]:
    """The rows' images (log_multimodal) as table columns of one image per cell, which is what
    MLflow's tables take: `image` for each row's first, `image_2`, ... as far as every row has
    one."""
    if not rows or "images" not in rows[0]:
        return {}
    shared = min(len(row["images"]) for row in rows)
    return {
        ("image" if k == 0 else f"image_{k + 1}"): [row["images"][k] for row in rows]
        for k in range(shared)
    }


class TrackerCompletionsCallback(TrainerCallback):
    """report_to has wandb or trackio: each completion table is logged to the active run under
    `completions` (wandb.Table / trackio.Table, images as their Image type), as TRL does. A
    tracking failure is a warning, never a failed step."""

    def __init__(self, trackers: list[str]):
        self.trackers = trackers

    def on_completions(self, args, state, control, rows=None, **kwargs):
        if not rows:
            return
        for name in self.trackers:
            try:
                module = __import__(name)
                if name == "wandb" and module.run is None:
                    continue
                images = image_columns(rows)
                columns = [key for key in rows[0] if key != "images"] + list(images)
                data = [
                    [row[key] for key in rows[0] if key != "images"]
                    + [module.Image(images[key][index]) for key in images]
                    for index, row in enumerate(rows)
                ]
                # (no step: wandb's own is the transformers callback's, as in TRL)
                module.log({"completions": module.Table(columns=columns, data=data)})
            except Exception as err:  # ImportError included: report_to already needs it installed
                logger.warning("could not log the completion table to %s: %s", name, err)


class MLflowCompletionsCallback(TrainerCallback):
    """report_to has mlflow: each completion table goes to the active run as
    `completions/step_<N>.json` (mlflow.log_table). A tracking outage is a warning, never a failed
    step."""

    def on_completions(self, args, state, control, rows=None, **kwargs):
        if not rows:
            return
        try:
            import mlflow  # lazily: rloo/ depends on mlflow only for users who ask for it

            if mlflow.active_run() is None:
                return

            def cell(value):
                return None if isinstance(value, float) and math.isnan(value) else value

            columns = {key: [cell(row[key]) for row in rows] for key in rows[0] if key != "images"}
            columns.update(image_columns(rows))
            mlflow.log_table(
                data=columns, artifact_file=f"completions/step_{state.global_step:07d}.json"
            )
        except Exception as err:  # ImportError included: report_to already needs mlflow installed
            logger.warning("could not log the completion table to MLflow: %s", err)


def completion_table_callbacks(report_to: list[str] | None) -> list[TrainerCallback]:
    """The callbacks that log completion tables to the trackers `report_to` names."""
    report_to = report_to or []
    callbacks: list[TrainerCallback] = (
        [MLflowCompletionsCallback()] if "mlflow" in report_to else []
    )
    if trackers := [name for name in ("wandb", "trackio") if name in report_to]:
        callbacks.append(TrackerCompletionsCallback(trackers))
    return callbacks
