"""The trainer's data side: a dataloader batch is one process's share of a whole generation batch,
each prompt repeated num_generations times in a row (RepeatSampler, reproducible per epoch); eval
batches hold whole prompt groups; a streaming dataset repeats its prompts in the stream and is read
in the main process."""

from __future__ import annotations

from datasets import IterableDataset

from rloo.checks import check_dispatch
from rloo.sampling import RepeatSampler, repeat_iterable


class GenerationBatches:
    """Mixed into RLOOTrainer ahead of transformers.Trainer, whose dataloader hooks it overrides."""

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "image", "images"]

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args, dataset = self.args, self.train_dataset
        # no sampler: the same order, built into the stream
        if isinstance(dataset, IterableDataset):
            if args.shuffle_dataset:
                dataset = dataset.shuffle(seed=args.seed)
            prompts = args.generation_batch_size // args.num_generations
            dataset = repeat_iterable(
                dataset, prompts, args.num_generations, args.generation_micro_steps
            )
        # One dataloader batch = this process's share of a whole generation batch.
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=self._train_batch_size * args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = (
            self.eval_dataset[eval_dataset]
            if isinstance(eval_dataset, str)
            else (eval_dataset if eval_dataset is not None else self.eval_dataset)
        )
        generations = self._num_generations("eval")
        eval_batch = self.args.per_device_eval_batch_size * self.accelerator.num_processes
        if eval_batch % generations != 0:
            raise ValueError(
                f"The global eval batch size ({eval_batch} = per_device_eval_batch_size "
                f"{self.args.per_device_eval_batch_size} x {self.accelerator.num_processes} "
                f"processes) must be divisible by num_generations_eval ({generations}) so that "
                "every batch holds whole prompt groups."
            )
        if isinstance(dataset, IterableDataset):
            check_dispatch(self.args, None, dataset)  # dispatch_batches=True set by hand
            dataset = repeat_iterable(dataset, 1, generations)
        return super().get_eval_dataloader(dataset)

    def _get_train_sampler(self, dataset=None):
        dataset = dataset if dataset is not None else self.train_dataset
        args = self.args
        return RepeatSampler(
            len(dataset),
            mini_repeat_count=args.num_generations,
            batch_size=args.generation_batch_size // args.num_generations,
            repeat_count=args.generation_micro_steps,
            shuffle=args.shuffle_dataset,
            seed=args.seed,
        )

    def _get_eval_sampler(self, eval_dataset):
        return RepeatSampler(
            len(eval_dataset), mini_repeat_count=self._num_generations("eval"), seed=self.args.seed
        )

    def _num_generations(self, mode: str) -> int:
        if mode == "eval":
            return self.args.num_generations_eval or self.args.num_generations
        return self.args.num_generations

    def _get_dataloader(
        self,
        dataset,
        description,
        batch_size,
        sampler_fn=None,
        is_training=False,
        dataloader_key=None,
    ):
        if not isinstance(dataset, IterableDataset):
            return super()._get_dataloader(
                dataset, description, batch_size, sampler_fn, is_training, dataloader_key
            )
        # A stream of one shard would be read once per worker: load it in the main process.
        names = (
            "dataloader_num_workers",
            "dataloader_persistent_workers",
            "dataloader_prefetch_factor",
        )
        saved = {name: getattr(self.args, name) for name in names}
        for name, value in zip(names, (0, False, None)):
            setattr(self.args, name, value)
        try:
            return super()._get_dataloader(
                dataset, description, batch_size, sampler_fn, is_training, dataloader_key
            )
        finally:
            for name, value in saved.items():
                setattr(self.args, name, value)

    # ------------------------------------------------------------------ asynchronous generation
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """One optimizer step's dataloader batches; with async_generation, also read
        weight_sync_steps generation batches further, so that the batches sampled before the next
        push are known (`_upcoming_prompt_ids`) and sampled while this one trains. What is read
        ahead is handed out in order later; a checkpoint keeps the batches in flight
        (rloo.generation.vllm_async)."""
        if not self.args.generates_ahead:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if getattr(self, "_read_ahead_of", None) is not epoch_iterator:  # a new epoch
            self._read_ahead_of, self._read_ahead = epoch_iterator, []
        # the generation batches sampled before the next push (one per optimizer step)
        ahead = self.args.generation_micro_steps * self.args.weight_sync_steps
        while len(self._read_ahead) < num_batches + ahead:
            try:
                self._read_ahead.append(next(epoch_iterator))
            except StopIteration:
                break
        self._window = self._read_ahead
        batches, self._read_ahead = self._window[:num_batches], self._window[num_batches:]
        return batches, None

    def _upcoming_prompt_ids(self, rows: list[dict], mode: str) -> dict:
        """{"upcoming": the generation batches read ahead after `rows`} for the backend (async
        generation, training); else {}."""
        if mode != "train" or not self.args.generates_ahead:
            return {}
        every = self.args.generation_micro_steps
        window = getattr(self, "_window", [])
        # (by identity: the repeats of one generation batch are equal, not the same object)
        index = next((i for i, batch in enumerate(window) if batch is rows), None)
        later = [] if index is None else window[index + every :: every]
        # none past the last step: (generation batches left after this one, counted in whole
        # optimizer steps)
        left = (
            self.state.max_steps - self.state.global_step
        ) * self.args.gradient_accumulation_steps // every - 1
        later = later[: max(0, left)]
        return {
            "upcoming": ReadAhead(
                self.processing_class, later, self.args.chat_template_kwargs, self._vision
            )
        }


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
