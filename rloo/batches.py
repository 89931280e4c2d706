"""The generation batches the trainer read ahead of the one it trains on (asynchronous generation),
their prompts (and a VLM's images) processed when the backend asks for them."""

from __future__ import annotations

from rloo.rollout import Prompts, prepare_prompts


class ReadAhead:
    """The prompts (and a VLM's images) of the generation batches read ahead of the one being
    generated for, in order, processed only when the backend asks for them (at a push boundary).
    What it processed waits in `kept` (the trainer's, across steps) for the batch's own rollout,
    which takes it instead of processing the rows again (`take`)."""

    def __init__(
        self,
        processing_class,
        batches: list[list[dict]],
        template_kwargs: dict | None,
        vision: bool = False,
        kept: dict | None = None,
    ):
        self.processing_class, self.batches = processing_class, batches
        self.template_kwargs, self.vision = template_kwargs, vision
        self.kept = {} if kept is None else kept

    def __len__(self) -> int:
        return len(self.batches)

    def first(self, count: int) -> list[tuple[list[list[int]], list[list] | None]]:
        """(prompt ids, each row's images or None for text) of the first `count` batches."""
        batches = []
        for rows in self.batches[:count]:
            if id(rows) not in self.kept:  # (the rows too: no other object takes their id)
                self.kept[id(rows)] = (rows, self._prepare(rows))
            prepared = self.kept[id(rows)][1]
            batches.append((prepared.ids, prepared.images))
        return batches

    @staticmethod
    def take(kept: dict, rows: list[dict]) -> Prompts | None:
        """The prompts read ahead for these very rows (and forgotten), or None."""
        found = kept.pop(id(rows), None)
        return None if found is None else found[1]

    def _prepare(self, rows: list[dict]) -> Prompts:
        return prepare_prompts(self.processing_class, rows, self.template_kwargs, self.vision)
