"""Which prompts each micro-step sees: the repeat sampler and the generation buffer."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class RepeatSampler(Sampler[int]):
    """Indices for RLOO generation rounds.

    Each epoch draws a permutation of the dataset (seeded by `seed + epoch`, so it is reproducible
    on resume), cuts it into chunks of `batch_size` unique prompts (a trailing incomplete chunk is
    dropped), and yields each chunk `repeat_count` times with every index repeated
    `mini_repeat_count` times in a row:

        chunk [0, 1], mini_repeat_count=2, repeat_count=2  ->  0 0 1 1 0 0 1 1
    """

    def __init__(
        self,
        data_source_length: int,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ):
        self.num_samples = data_source_length
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        chunks = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for chunk in chunks:
            if len(chunk) < self.batch_size:
                continue
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index

    def __len__(self) -> int:
        return (
            (self.num_samples // self.batch_size)
            * self.batch_size
            * self.mini_repeat_count
            * self.repeat_count
        )


def _num_rows(batch) -> int:
    return len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch)


def _take(batch, index: torch.Tensor):
    """Rows `index` of a dict of tensors/lists, or of an object with `select(index)`
    (rloo.rollout.Rollout)."""
    if not isinstance(batch, dict):
        return batch.select(index)
    rows = index.tolist()
    return {
        key: value[index] if isinstance(value, torch.Tensor) else [value[i] for i in rows]
        for key, value in batch.items()
    }


def shuffle_rows(batch, generator: torch.Generator | None = None):
    """Apply one random row permutation to every row field of the batch."""
    return _take(batch, torch.randperm(_num_rows(batch), generator=generator))


def split_rows(batch, num_chunks: int) -> list:
    """Cut the batch into `num_chunks` equal consecutive slices of rows."""
    size = _num_rows(batch)
    if size % num_chunks != 0:
        raise ValueError(f"cannot split {size} rows into {num_chunks} equal micro-batches")
    step = size // num_chunks
    return [_take(batch, torch.arange(i * step, (i + 1) * step)) for i in range(num_chunks)]


def _repeat_rows(
    batch: dict[str, list], mini_repeat_count: int, repeat_count: int
) -> dict[str, list]:
    size = len(next(iter(batch.values())))
    order = [
        row for _ in range(repeat_count) for row in range(size) for _ in range(mini_repeat_count)
    ]
    return {column: [values[row] for row in order] for column, values in batch.items()}


def repeat_iterable(dataset, batch_size: int, mini_repeat_count: int, repeat_count: int = 1):
    """The RepeatSampler's order for a streaming dataset: chunks of `batch_size` unique rows (a
    trailing incomplete chunk dropped), each chunk `repeat_count` times, each row
    `mini_repeat_count` times in a row."""
    return dataset.map(
        _repeat_rows,
        batched=True,
        batch_size=batch_size,
        drop_last_batch=True,
        fn_kwargs={"mini_repeat_count": mini_repeat_count, "repeat_count": repeat_count},
    )
