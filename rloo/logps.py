"""Per-token log-probabilities of completions under a model: the one function every forward of a
step goes through (the loss's, the old policy's, the reference's). One forward over whole rows, or,
with `share_prompts`, the speed layer's shared-prompt forward (rloo.engine.shared_prompts) where it
applies. `StepLogProbs` is what a rollout asks for the policy's and the reference's log-probs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from rloo import engine, vision
from rloo.adapters import reference_adapter
from rloo.primitives import entropy_from_logits, selective_log_softmax


class TokenLogps(NamedTuple):
    logps: torch.Tensor
    entropy: torch.Tensor | None
    # Mixture-of-Experts load-balancing loss, when the model returns it
    aux_loss: torch.Tensor | None


def per_token_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float,
    with_entropy: bool = False,
    share_prompts: bool = False,
    media: list[dict] | None = None,
) -> TokenLogps:
    """log pi(token_t | tokens_<t) / temperature-scaled, for the last `logits_to_keep` tokens of
    each row.

    With `share_prompts`, rows whose prompt (every token before the last `logits_to_keep`, padding
    included) is the same, e.g. the num_generations completions of one prompt, run that prompt
    through the model once: its KV cache is copied to each of its rows and only the completions go
    through the model per row. The same positions, mask and logits as one forward over the whole
    rows; the prompt's compute is done once.

    `media`: a VLM's other inputs, one dict per row (rloo.vision); such rows take one plain
    forward."""
    outputs, logits = None, None
    extra = (
        {}
        if media is None
        else vision.forward_media(media, attention_mask, logits_to_keep, input_ids.device)
    )
    if share_prompts and media is None and logits_to_keep > 0 and engine.can_share_prompts(model):
        found = engine.shared_prompt_logits(model, input_ids, attention_mask, logits_to_keep)
        if found is not None:
            logits, outputs = found
    if logits is None:
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            logits_to_keep=logits_to_keep + 1,
            use_cache=False,
            **extra,
        )
        logits = outputs.logits[:, :-1, :][:, -logits_to_keep:, :]
    if temperature != 1.0:  # (x / 1.0 is x: no vocabulary-wide copy)
        logits = logits / temperature
    targets = input_ids[:, -logits_to_keep:]
    logps = selective_log_softmax(logits, targets)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return TokenLogps(logps, entropy, getattr(outputs, "aux_loss", None))


def _no_progress() -> None:
    pass


@dataclass
class StepLogProbs:
    """The rollout's log-probs collaborator (rloo.rollout.build_rollout): the policy's and the
    reference's per-token log-probs of whole rows, `chunk` rows per forward. It holds the models
    and settings the trainer chose for this rollout, so the rollout never calls back into the
    trainer."""

    policy_model: nn.Module
    # None: the policy itself is the reference, with its trainable adapter off (PEFT)
    reference_model: nn.Module | None
    temperature: float
    chunk: int
    share_prompts: bool = False  # the speed layer's shared-prompt forward where it applies
    # PEFT with a frozen copy of a passed-in adapter as the reference: the trainable one's name
    trainable_adapter: str | None = None
    # the reference model as placed (its pages go after each use: rloo.engine.mapped)
    reference_pages: nn.Module | None = None
    # a forward micro-batch done: progress for the stall watchdog (rloo.timing)
    advance: Callable[[], None] = _no_progress

    def policy(self, input_ids, attention_mask, logits_to_keep, media=None) -> torch.Tensor:
        return self._chunked(self.policy_model, input_ids, attention_mask, logits_to_keep, media)

    def reference(self, input_ids, attention_mask, logits_to_keep, media=None) -> torch.Tensor:
        batch = (input_ids, attention_mask, logits_to_keep, media)
        if self.reference_model is not None:
            with engine.paged_out_after(self.reference_pages or self.reference_model):
                return self._chunked(self.reference_model, *batch)
        with reference_adapter(self.policy_model, self.trainable_adapter):
            return self._chunked(self.policy_model, *batch)

    def _chunked(self, model, input_ids, attention_mask, logits_to_keep, media) -> torch.Tensor:
        parts = []
        for start in range(0, input_ids.size(0), self.chunk):
            parts.append(
                per_token_logps(
                    model,
                    input_ids[start : start + self.chunk],
                    attention_mask[start : start + self.chunk],
                    logits_to_keep,
                    self.temperature,
                    share_prompts=self.share_prompts,
                    media=media and media[start : start + self.chunk],
                ).logps
            )
            self.advance()
        return torch.cat(parts, dim=0)
