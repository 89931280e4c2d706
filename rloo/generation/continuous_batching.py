"""Sampling completions with transformers' continuous batching engine (`model.generate_batch`, paged
KV cache)."""

from __future__ import annotations

import math

import torch
from transformers import GenerationConfig, PreTrainedModel

from rloo.algorithm import completion_mask_after_eos
from rloo.generation.base import GenerationBackend
from rloo.models import eval_mode

SIZING_KEYS = ("num_blocks", "max_memory_percent", "max_batch_tokens")


class ContinuousBatchingGenerator(GenerationBackend):
    """`use_transformers_continuous_batching=True`: every prompt is a request; the scheduler batches
    them at the token level. `transformers_continuous_batching_config` is passed to
    ContinuousBatchingConfig. When it does not size the paged cache, it is sized to this batch
    (prompts + max_new_tokens each) instead of transformers' default of half the free memory, which
    on a CPU host means allocating gigabytes for every call."""

    def __init__(
        self, generation_config: GenerationConfig, eos_ids: list[int], config: dict | None = None
    ):
        self.generation_config = generation_config
        self.eos_ids = eos_ids
        self.config = dict(config or {})

    def _engine_config(self, prompt_ids: list[list[int]]):
        from transformers import ContinuousBatchingConfig

        settings = dict(self.config)
        if not any(key in settings for key in SIZING_KEYS):
            page = settings.setdefault("page_size", 16)
            max_new = self.generation_config.max_new_tokens or 0
            pages = sum(math.ceil((len(ids) + max_new) / page) for ids in prompt_ids)
            settings["num_blocks"] = pages + len(prompt_ids)
            settings["max_batch_tokens"] = max(256, sum(len(ids) for ids in prompt_ids))
        return ContinuousBatchingConfig(**settings)

    @torch.no_grad()
    def generate(
        self,
        model: PreTrainedModel,
        prompt_ids: list[list[int]],
        num_generations: int = 1,
        step: int = 0,
    ) -> list[list[int]]:
        with eval_mode(model):
            outputs = model.generate_batch(
                [list(ids) for ids in prompt_ids],
                generation_config=self.generation_config,
                continuous_batching_config=self._engine_config(prompt_ids),
                progress_bar=False,
                warmup=False,
            )
        completions = []
        for index in range(len(prompt_ids)):
            output = outputs.get(f"req_{index}")
            if output is None or output.error:
                reason = "no output" if output is None else output.error
                raise RuntimeError(
                    f"continuous batching failed for prompt {index} ({reason}). Check "
                    "transformers_continuous_batching_config (num_blocks / max_batch_tokens), or "
                    "set use_transformers_continuous_batching=False."
                )
            tokens = list(output.generated_tokens)
            if tokens:
                row = torch.tensor([tokens])
                tokens = tokens[: int(completion_mask_after_eos(row, self.eos_ids).sum())]
            completions.append(tokens)
        return completions
