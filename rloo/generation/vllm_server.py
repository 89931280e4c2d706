"""Server mode: a vLLM server (`vllm serve` / `python -m vllm.entrypoints.openai.api_server`)
samples the completions, and the trainer pushes its weights through vLLM's weight-transfer routes
before each generation whose weights changed. Only the main process talks to the server. A
vision-language model's prompts travel with their images through vLLM's token-in route
(`--enable-scale-out`), one request per prompt.

Every HTTP call has a timeout, and a failure names the route and the server's answer. Weights
travel over the "gloo" backend (rloo_vllm.engine, registered in the server by
`--worker-extension-cls rloo_vllm.engine.WorkerExtension`), which runs on CPU; NCCL is the GPU
backend of the same routes."""

from __future__ import annotations

import time

import torch

from rloo.config_checks import STALL_MARGIN_S, unwarped
from rloo.generation.base import Completions, GenerationBackend
from rloo.generation.vllm_client import VLLMServerClient
from rloo.generation.vllm_common import (
    cut_at_eos,
    full_weights,
    judge_sync,
    max_logprob_diff,
    run_lengths,
    sampling_of,
    sync_tolerance,
    sync_weights_of,
)
from rloo.primitives import is_peft_model
from rloo.timing import timed
from rloo.vision import is_vision_config, placeholder_token_ids
from rloo.zero import gathered_parameters


def server_url(args) -> str:
    if args.vllm_server_base_url:
        return args.vllm_server_base_url.rstrip("/")
    host = "127.0.0.1" if args.vllm_server_host in ("0.0.0.0", "") else args.vllm_server_host
    return f"http://{host}:{args.vllm_server_port}"


def local_address_towards(url: str) -> str:
    """The address of this machine that the server reaches us on (the gloo store lives here)."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(url).hostname or "127.0.0.1"
    if host in ("localhost",) or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


ADAPTER_NAME = "rloo-policy"


def request_timeout(args) -> float:
    """How long a request may go unanswered before it is a stall (vllm_request_timeout_s): by
    default a margin after the watchdog's stall_timeout_s, whose report (every stack) then comes
    first; the request's own timeout covers a run without the watchdog."""
    if args.vllm_request_timeout_s is not None:
        return args.vllm_request_timeout_s
    return args.stall_timeout_s + STALL_MARGIN_S if args.stall_timeout_s else 1800.0


def check_logprobs_mode(server_config: dict, args) -> None:
    """The importance weights divide by the sampler's probability of each token: the distribution
    it sampled from (temperature and penalties applied), which vLLM returns only with
    --logprobs-mode processed_logprobs. Its default, raw_logprobs, gives the model's unscaled
    log-probs: at any temperature but 1 every weight would be off, with nothing to show it."""
    mode = (server_config.get("model_config") or {}).get("logprobs_mode", "raw_logprobs")
    if args.vllm_importance_sampling_correction and mode != "processed_logprobs":
        raise ValueError(
            f"the vLLM server at {server_url(args)} returns log-probs in mode {mode!r}; the "
            "importance sampling correction (vllm_importance_sampling_correction, on with "
            "async_generation) needs those of the distribution it sampled from. Fix: restart the "
            "server with --logprobs-mode processed_logprobs (as docs/vllm.md and the pipeline's "
            "generation node do), or set vllm_importance_sampling_correction=False."
        )


def check_same_model(served: str, model: torch.nn.Module) -> None:
    """Refuse a server that serves another architecture (a checkpoint folder we can read)."""
    import json
    import os

    path = os.path.join(served, "config.json")
    if not os.path.isfile(path):
        # a Hub id or a path on another machine: the first weight update checks names and shapes
        return
    with open(path) as handle:
        theirs = json.load(handle)
    ours = model.config.to_dict() if hasattr(model, "config") else {}
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
    ):
        if key in theirs and key in ours and theirs[key] != ours[key]:
            raise ValueError(
                f"the vLLM server serves {served} with {key}={theirs[key]!r}, the policy has "
                f"{key}={ours[key]!r}: its weights cannot be synchronised. Fix: start the server "
                "with the policy's model."
            )


class VLLMServerGenerator(GenerationBackend):
    """Generation in server mode for every rank: prompts are gathered, the main process pushes the
    weights when the optimizer step changed, asks for `n = num_generations` completions per unique
    prompt, checks the sync on a few samples, and each rank gets its own rows back."""

    def __init__(
        self, args, accelerator, model: torch.nn.Module, eos_ids: list[int], zero3: bool = False
    ):
        self.args = args
        # weights are gathered from ZeRO-3 shards (every rank takes part) before a push
        self.zero3 = zero3
        self.accelerator = accelerator
        self.eos_ids = set(eos_ids)
        self.url = server_url(args)
        self.client = None
        self.model_id = None
        self.last_synced_step = -1
        self.metrics: dict[str, float] = {}
        self.requests = 0
        self.adapter_mode = False
        self.base_pending = False

        if accelerator.is_main_process:
            self.client = VLLMServerClient(
                self.url,
                args.vllm_server_timeout,
                request_timeout(args),
                lambda: self.timer.advance(),
            )
            self.client.wait_until_healthy()
            self.model_id = self.client.model_info()["id"]
            check_same_model(self.model_id, model)
            config = self.client.server_config()
            check_logprobs_mode(config, args)
            lora_enabled = config.get("lora_config") is not None
            if is_peft_model(model) and args.vllm_peft_sync == "adapter" and not lora_enabled:
                raise ValueError(
                    "vllm_peft_sync='adapter' but the vLLM server runs without LoRA support. Fix: "
                    "start it with --enable-lora (and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), or "
                    "vllm_peft_sync='merged'."
                )
            self.adapter_mode = (
                is_peft_model(model) and args.vllm_peft_sync != "merged" and lora_enabled
            )
            # Adapter mode assumes the server's base weights are the policy's base; a server that an
            # earlier run pushed weights into is not. Where the server can take weights, the base is
            # pushed once first.
            self.base_pending = self.adapter_mode and bool(
                (config.get("weight_transfer_config") or {}).get("backend")
            )
            if not self.adapter_mode or self.base_pending:
                self.client.init_weight_transfer(
                    local_address_towards(self.url), args.vllm_group_port
                )
        from accelerate.utils import broadcast_object_list

        self.adapter_mode, self.base_pending = broadcast_object_list(
            [self.adapter_mode, self.base_pending], from_process=0
        )
        self.adapter_versions: list[str] = []
        self.tolerance = sync_tolerance(args, model)
        # a VLM's completions never hold an image placeholder (as with model.generate)
        self.suppress = (
            placeholder_token_ids(model.config) if is_vision_config(model.config) else []
        )

    @timed("weight_sync")
    def sync_weights(self, model: torch.nn.Module, step: int) -> None:
        if self.adapter_mode:
            self._sync_adapter(model, self.zero3, step)
            return
        with full_weights(model, self.zero3) as weights:
            if self.client is not None:
                pushed = self.client.push_weights(weights)
                self.metrics.update(
                    {"vllm/sync_seconds": pushed["seconds"], "vllm/sync_bytes": pushed["bytes"]}
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
        """`media` / `images`: a VLM's rows (rloo.vision): the images go to the server with each
        prompt, the media to the trainer's side of the sync check."""
        from accelerate.utils import gather_object

        synced = self._push(model, step)
        everyone = gather_object([list(p) for p in prompt_ids])
        vision = None if images is None else gather_object(list(zip(images, media)))
        result = None
        if self.client is not None:
            start = time.perf_counter()
            rows = self._sample(everyone, vision, num_generations, self._sampling(step))
            self.metrics["vllm/generation_seconds"] = time.perf_counter() - start
            result = self._result(rows, everyone, vision, synced)
        return self._deliver(model, result, len(prompt_ids))

    def _push(self, model: torch.nn.Module, step: int) -> bool:
        """Push the weights when the optimizer step changed since the last push (every rank)."""
        if step == self.last_synced_step:
            return False
        self.sync_weights(model, step)
        self.last_synced_step = step
        return True

    def _sampling(self, step: int) -> dict:
        # a seed per request: different across steps and calls, and in the checkpoint
        # (checkpoint_state), so that a resumed run draws what the uninterrupted one would have
        seed = (self.args.seed * 1_000_003 + step * 7_919 + self.requests) % (2**31)
        self.requests += 1
        return dict(sampling_of(self.args, self.suppress), seed=seed)

    def _result(
        self, rows: list[dict], everyone: list[list[int]], vision: list | None, check: bool
    ) -> dict:
        """The main process's answer for every rank: ids cut at EOS, the sampler's log-probs where
        they are the plain distribution's, and the samples the sync check scores."""
        ids = [cut_at_eos(row["ids"], self.eos_ids) for row in rows]
        logprobs = (
            [row["logprobs"][: len(cut)] for row, cut in zip(rows, ids)]
            if unwarped(self.args)
            else None
        )
        return {
            "rows": ids,
            "logprobs": logprobs,
            "check": self._check_sample(everyone, rows, vision) if check else None,
        }

    def _deliver(self, model: torch.nn.Module, result: dict | None, local: int) -> Completions:
        """The main process's result to every rank (each takes its own rows), after the sync
        check."""
        from accelerate.utils import broadcast_object_list

        result = broadcast_object_list([result], from_process=0)[0]
        if result["check"] is not None:
            self._verify(model, result["check"])
        start = self.accelerator.process_index * local
        logprobs = result["logprobs"]
        completions = Completions(
            result["rows"][start : start + local],
            None if logprobs is None else logprobs[start : start + local],
        )
        completions.policy_version = result.get("version")
        return completions

    def checkpoint_state(self) -> dict:
        return {"requests": self.requests}

    def restore(self, state: dict | None) -> None:
        if state:
            self.requests = state["requests"]

    def _sample(
        self,
        prompts: list[list[int]],
        vision: list | None,
        num_generations: int,
        sampling: dict,
        client: VLLMServerClient | None = None,
    ) -> list[dict]:
        """Every row's completion from the server, in row order (through `client`, else the main
        one)."""
        client = client or self.client
        if vision is None:
            grouped = len(prompts) % num_generations == 0 and all(
                prompts[i] == prompts[i - i % num_generations] for i in range(len(prompts))
            )
            unique, n = (prompts[::num_generations], num_generations) if grouped else (prompts, 1)
            return [
                row
                for group in client.complete(self.model_id, unique, n, sampling)
                for row in group
            ]
        # a VLM's rows: a request per run of the same prompt with equal images, all in flight at
        # once (the server batches them as it batches one request's prompts)
        from concurrent.futures import ThreadPoolExecutor

        runs = run_lengths([(row, images) for row, (images, _) in zip(prompts, vision)])
        seed = sampling.pop("seed")

        def request(index: int) -> list[dict]:
            (prompt, images), n = runs[index]
            return client.complete_with_images(
                self.model_id, prompt, images, n, dict(sampling, seed=(seed + index) % 2**31)
            )

        with ThreadPoolExecutor(max_workers=min(16, len(runs))) as pool:
            return [row for group in pool.map(request, range(len(runs))) for row in group]

    def _sync_adapter(self, model: torch.nn.Module, zero3: bool, step: int) -> None:
        """Only the LoRA adapter: written to a new folder per version (vLLM caches by path) and
        loaded in place under one name, which generation requests then use as their model."""
        import os
        import shutil

        # once: the base weights (adapter not merged), so server base == policy base
        if self.base_pending:
            with gathered_parameters(model, zero3):
                if self.client is not None:
                    self.client.push_weights(sync_weights_of(model))
            self.base_pending = False
        path = os.path.join(self.args.output_dir, "vllm-adapters", f"step-{step:07d}")
        adapter_params = [p for name, p in model.named_parameters() if "lora_" in name]
        with gathered_parameters(torch.nn.ParameterList(adapter_params), zero3):
            if self.client is not None:
                start = time.perf_counter()
                model.save_pretrained(path, selected_adapters=["default"], safe_serialization=True)
                self.client.load_lora_adapter(ADAPTER_NAME, path)
                self.model_id = ADAPTER_NAME
                size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
                self.metrics.update(
                    {"vllm/sync_seconds": time.perf_counter() - start, "vllm/sync_bytes": size}
                )
                self.adapter_versions.append(path)
                while len(self.adapter_versions) > 2:  # the server has loaded the newer ones
                    shutil.rmtree(self.adapter_versions.pop(0), ignore_errors=True)

    def _check_sample(
        self, prompts: list[list[int]], rows: list[dict], vision: list | None = None
    ) -> list[dict] | None:
        count = min(self.args.vllm_sync_verify_samples, len(rows))
        picks = [i for i in range(len(rows)) if rows[i]["ids"]][:count]
        if not picks:
            return None
        if vision is None:
            return [
                {
                    "prompt": prompts[i],
                    "completion": rows[i]["ids"],
                    "vllm": self.client.score(self.model_id, prompts[i], rows[i]["ids"]),
                }
                for i in picks
            ]
        return [
            {
                "prompt": prompts[i],
                "completion": rows[i]["ids"],
                "media": vision[i][1],
                "vllm": self.client.score_with_images(
                    self.model_id, prompts[i], rows[i]["ids"], vision[i][0]
                ),
            }
            for i in picks
        ]

    @timed("weight_sync")  # the check of a push is part of its cost
    def _verify(self, model: torch.nn.Module, samples: list[dict]) -> None:
        """Every rank runs the same forward passes (ZeRO-3 gathers collectively); the main process
        judges."""
        worst = max_logprob_diff(model, samples)
        self.metrics["vllm/sync_max_logprob_diff"] = worst
        judge_sync(
            worst,
            self.tolerance,
            self.args.vllm_sync_on_mismatch,
            len(samples),
            self.last_synced_step,
            "vLLM server",
        )

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics
