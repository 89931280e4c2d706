"""The in-process generation backend of the speed layer: TransformersGenerator (left padding, the
cut after the first EOS) with its `generate` call replaced by rloo.engine's decode loop, which can
also keep the policy's log-probs of the tokens it draws."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from rloo import engine
from rloo.generation.transformers_backend import TransformersGenerator


class LeanGenerator(TransformersGenerator):
    """`synced`: ZeRO-3 without gathering, every rank steps until all are done (DecodeLoop)."""

    def __init__(
        self,
        generation_config: GenerationConfig,
        pad_token_id: int,
        eos_ids: list[int],
        pad_to_multiple_of: int | None = None,
        synced: bool = False,
    ):
        super().__init__(generation_config, pad_token_id, eos_ids, pad_to_multiple_of)
        self.loop = engine.DecodeLoop(synced)
        # set: keep the policy's log-probs of the drawn tokens at this temperature
        self.policy_temperature: float | None = None

    def reusing_weights(self):
        return self.loop.reusing_weights()

    def _completions(
        self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.loop.completions(
            model,
            input_ids,
            attention_mask,
            self.generation_config,
            self.pad_token_id,
            self.eos_ids,
            self.policy_temperature,
            self.timer.advance,
        )
