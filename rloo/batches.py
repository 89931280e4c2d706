"""The generation batches the trainer read ahead of the one it trains on (asynchronous generation),
their prompts (and a VLM's images) processed when the backend asks for them."""

from __future__ import annotations


class ReadAhead:
    """The prompts (and a VLM's images) of the generation batches read ahead of the one being
    generated for, in order, processed only when the backend asks for them (at a push
    boundary)."""

    def __init__(
        self,
        processing_class,
        batches: list[list[dict]],
        template_kwargs: dict | None,
        vision: bool = False,
    ):
        self.processing_class, self.batches = processing_class, batches
        self.template_kwargs, self.vision = template_kwargs, vision

    def __len__(self) -> int:
        return len(self.batches)

    def first(self, count: int) -> list[tuple[list[list[int]], list[list] | None]]:
        """(prompt ids, each row's images or None for text) of the first `count` batches."""
        from rloo.data import tokenize_prompts
        from rloo.vision import process_prompts, row_images

        batches = []
        for rows in self.batches[:count]:
            prompts = [row["prompt"] for row in rows]
            if self.vision:
                images = [row_images(row) for row in rows]
                ids, _ = process_prompts(
                    self.processing_class, prompts, images, self.template_kwargs
                )
                batches.append((ids, images))
            else:
                batches.append(
                    (tokenize_prompts(self.processing_class, prompts, self.template_kwargs), None)
                )
        return batches
