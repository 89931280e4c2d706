"""Trainer callbacks: TR-DPO reference-model synchronisation."""

from __future__ import annotations

import torch
from torch import nn
from transformers import TrainerCallback


@torch.no_grad()
def mix_into_reference(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """TR-DPO soft update, parameter-wise: pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref."""
    policy_params = dict(policy.named_parameters())
    for name, ref_param in reference.named_parameters():
        if name not in policy_params:
            raise ValueError(f"reference parameter {name!r} has no counterpart in the policy: the two models "
                             "must have the same architecture.")
        ref_param.mul_(1.0 - alpha).add_(policy_params[name].detach().to(ref_param.dtype), alpha=alpha)


class SyncRefModelCallback(TrainerCallback):
    """Every `ref_model_sync_steps` optimizer steps, mix the policy into the reference (TR-DPO, Gorbatovski 2024)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps != 0:
            return
        trainer = self.trainer
        reference = trainer.accelerator.unwrap_model(trainer.ref_model)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        if trainer.is_deepspeed_enabled and getattr(trainer.accelerator.state.deepspeed_plugin, "zero_stage", 0) == 3:
            import deepspeed
            params = list(reference.parameters()) + list(policy.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                if trainer.accelerator.is_main_process:
                    mix_into_reference(reference, policy, args.ref_model_mixup_alpha)
        else:
            mix_into_reference(reference, policy, args.ref_model_mixup_alpha)
