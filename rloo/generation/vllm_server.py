"""Server mode: a vLLM server (`vllm serve` / `python -m vllm.entrypoints.openai.api_server`) samples the
completions, and the trainer pushes its weights through vLLM's weight-transfer routes before each generation
whose weights changed. Only the main process talks to the server.

Every HTTP call has a timeout, and a failure names the route and the server's answer. Weights travel over the
"gloo" backend (rloo_vllm.engine, registered in the server by `--worker-extension-cls
rloo_vllm.engine.WorkerExtension`), which runs on CPU; NCCL is the GPU backend of the same routes."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import requests
import torch
import torch.distributed as dist

from rloo.generation.base import Completions, GenerationBackend
from rloo.generation.vllm_common import (cut_at_eos, full_weights, judge_sync, max_logprob_diff, sampling_of,
                                         sync_tolerance, sync_weights_of, unwarped)
from rloo.timing import timed
from rloo_vllm.wire import CHUNK_BYTES, pack, plan_chunks


def server_log_tail(lines: int = 20) -> str:
    """The server's last log lines when its log is readable from here (RLOO_VLLM_SERVER_LOG, set by the SLURM
    launcher), for the error of a failed call."""
    import os
    path = os.environ.get("RLOO_VLLM_SERVER_LOG")
    if not path or not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as handle:
        return f"\nlast lines of the server's log {path}:\n" + "".join(handle.readlines()[-lines:])


class VLLMServerError(RuntimeError):
    """The server answered a route with an error (the message names the route and quotes the answer)."""


class VLLMServerClient:
    def __init__(self, base_url: str, connect_timeout_s: float = 240.0, request_timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.session = requests.Session()
        self.group = None
        self._store = None
        self.chunk_bytes = CHUNK_BYTES
        self.nccl = None  # vLLM's NCCL trainer engine when the server runs the "nccl" backend
        self.source = None

    # ------------------------------------------------------------------ HTTP
    def _call(self, method: str, route: str, payload: dict | None = None, timeout: float | None = None):
        url = self.base_url + route
        try:
            response = self.session.request(method, url, json=payload, timeout=timeout or self.request_timeout_s)
        except requests.RequestException as err:
            raise VLLMServerError(f"{method} {url} failed: {err}{server_log_tail()}") from err
        if response.status_code != 200:
            raise VLLMServerError(f"{method} {url} answered {response.status_code}: {response.text[:1000]}"
                                  f"{server_log_tail()}")
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:  # some routes answer plain text ("Success: LoRA adapter ... loaded")
            return response.text

    def wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        last = "no answer"
        while True:
            try:
                response = self.session.get(self.base_url + "/health", timeout=5)
                if response.status_code == 200:
                    return
                last = f"status {response.status_code}"
            except requests.RequestException as err:
                last = type(err).__name__
            if time.monotonic() > deadline:
                raise ConnectionError(f"the vLLM server at {self.base_url} did not become healthy within "
                                      f"{self.connect_timeout_s:.0f} s (vllm_server_timeout; last: {last}). Start it "
                                      "first, or fix vllm_server_base_url / vllm_server_host / vllm_server_port.")
            time.sleep(1.0)

    def model_info(self) -> dict:
        models = self._call("GET", "/v1/models", timeout=30)["data"]
        return models[0]

    def server_config(self) -> dict:
        return self._call("GET", "/server_info?config_format=json", timeout=30)["vllm_config"]

    # ------------------------------------------------------------------ weights
    def init_weight_transfer(self, host: str, port: int, timeout_s: float = 300.0) -> None:
        """Open the weight-transfer group with the server's workers, over the backend the server runs: "gloo" (ours,
        CPU or GPU servers; this process hosts the store as rank 0) or "nccl" (GPU to GPU, through vLLM's own
        trainer-side engine)."""
        try:
            config = self.server_config()
        except VLLMServerError as err:
            raise VLLMServerError(f"{err}. The weight-update routes exist only when the server runs with "
                                  "VLLM_SERVER_DEV_MODE=1.") from err
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend not in ("gloo", "nccl"):
            raise VLLMServerError(f"the server's weight transfer backend is {backend!r}; this trainer pushes weights "
                                  "over 'gloo' (any device) or 'nccl' (GPUs). Restart the server with "
                                  "--weight-transfer-config '{\"backend\": \"gloo\"}' --worker-extension-cls "
                                  "rloo_vllm.engine.WorkerExtension.")
        workers = int(self._call("GET", "/get_world_size", timeout=30)["world_size"])
        world = workers + 1
        if backend == "nccl":
            self._init_nccl(host, port, world)
            return
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, port, world, is_master=True, timeout=timeout, wait_for_workers=False)
        info = {"master_address": host, "master_port": port, "world_size": world, "rank_offset": 1,
                "timeout_s": timeout_s, "chunk_bytes": self.chunk_bytes}
        errors = self._in_thread("POST", "/init_weight_transfer_engine", {"init_info": info})
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("rloo-weights", self._store), 0, world, timeout)
        errors.join_and_raise()

    def _init_nccl(self, host: str, port: int, world: int) -> None:
        """The server runs vLLM's NCCL backend: vLLM's trainer-side engine drives the same routes through this
        client (init_weight_transfer_engine / start / update / finish below) and broadcasts from this GPU."""
        if not torch.cuda.is_available():
            raise VLLMServerError("the server's weight transfer backend is 'nccl', which sends from a GPU of this "
                                  "process, and this process has none. Fix: restart the server with "
                                  "--weight-transfer-config '{\"backend\": \"gloo\"}' --worker-extension-cls "
                                  "rloo_vllm.engine.WorkerExtension (works with GPU servers too, through host memory).")
        try:
            from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                      NCCLTrainerWeightTransferEngine)
        except ImportError as err:
            raise ImportError("the server's weight transfer backend is 'nccl': the trainer side needs vLLM in the "
                              "training environment (pip install vllm), or restart the server with the 'gloo' "
                              "backend (--weight-transfer-config '{\"backend\": \"gloo\"}').") from err
        self.source = named_tensor_source()
        info = NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=world, rank=0)
        self.nccl = NCCLTrainerWeightTransferEngine.trainer_init(info, client=self, source=self.source)

    # vLLM's trainer-side client protocol (VLLMWeightSyncClient): its NCCL engine calls these.
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("POST", "/start_weight_update", {})

    def update_weights(self, update_info: dict) -> None:
        self._call("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        payload = {} if weight_version is None else {"weight_version": weight_version}
        self._call("POST", "/finish_weight_update", payload)

    def push_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
        """One update: start, /update_weights while the chunks are broadcast, finish, reset the prefix cache
        (cached KV of old weights would otherwise score long prompts). Returns seconds and bytes."""
        start = time.perf_counter()
        if self.nccl is not None:
            device = torch.device("cuda", torch.cuda.current_device())  # NCCL sends from this process's GPU
            self.source.named = [(name, tensor.detach().to(device)) for name, tensor in named_tensors]
            self.nccl.send_weights()
            self._call("POST", "/reset_prefix_cache", {})
            return {"seconds": time.perf_counter() - start,
                    "bytes": sum(t.numel() * t.element_size() for _, t in self.source.named)}
        if self.group is None:
            raise RuntimeError("init_weight_transfer() must run before push_weights()")
        names = [name for name, _ in named_tensors]
        tensors = [tensor.detach().cpu() for _, tensor in named_tensors]
        dtype_names = [str(t.dtype).removeprefix("torch.") for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        self.start_weight_update()
        errors = self._in_thread("POST", "/update_weights",
                                 {"update_info": {"names": names, "dtype_names": dtype_names, "shapes": shapes}})
        sent = 0
        try:
            for chunk in plan_chunks(dtype_names, shapes, self.chunk_bytes):
                buffer = pack([tensors[i] for i in chunk])
                self.group.broadcast(buffer, 0).wait()
                sent += buffer.numel() * buffer.element_size()
        finally:
            errors.join_and_raise()
        self.finish_weight_update()
        self._call("POST", "/reset_prefix_cache", {})
        return {"seconds": time.perf_counter() - start, "bytes": sent}

    def load_lora_adapter(self, name: str, path: str) -> float:
        start = time.perf_counter()
        self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True})
        return time.perf_counter() - start

    # ------------------------------------------------------------------ sampling and scoring
    def complete(self, model: str, prompts: list[list[int]], n: int, sampling: dict) -> list[list[dict]]:
        """Per prompt, `n` completions: {"ids": [...], "logprobs": [...]} (sampled-token log-probs)."""
        payload = {"model": model, "prompt": prompts, "n": n, "logprobs": 0, "return_token_ids": True,
                   "return_tokens_as_token_ids": True, **sampling}
        choices = self._call("POST", "/v1/completions", payload)["choices"]
        if len(choices) != len(prompts) * n:
            raise VLLMServerError(f"POST {self.base_url}/v1/completions returned {len(choices)} choices for "
                                  f"{len(prompts)} prompts x n={n}")
        choices = sorted(choices, key=lambda c: c["index"])
        rows = [{"ids": list(c["token_ids"]), "logprobs": list((c.get("logprobs") or {}).get("token_logprobs") or [])}
                for c in choices]
        return [rows[i * n:(i + 1) * n] for i in range(len(prompts))]

    def score(self, model: str, prompt: list[int], completion: list[int]) -> list[float]:
        """The server's log-probs (temperature 1) of `completion`'s tokens after `prompt`."""
        payload = {"model": model, "prompt": [prompt + completion], "max_tokens": 1, "temperature": 1.0,
                   "prompt_logprobs": 0, "return_token_ids": True}
        entries = self._call("POST", "/v1/completions", payload)["choices"][0]["prompt_logprobs"]
        tokens = prompt + completion
        return [float(entries[i][str(tokens[i])]["logprob"]) for i in range(len(prompt), len(tokens))]

    def close(self) -> None:
        self.group = None
        if self.nccl is not None:
            self.nccl.shutdown()
            self.nccl = None
        self._store = None
        self.session.close()

    def _in_thread(self, method: str, route: str, payload: dict) -> "_Call":
        call = _Call(self, method, route, payload)
        call.start()
        return call


class _Call(threading.Thread):
    """An HTTP call that must run while this process takes part in a collective with the server."""

    def __init__(self, client: VLLMServerClient, method: str, route: str, payload: dict):
        super().__init__(daemon=True)
        self.client, self.method, self.route, self.payload = client, method, route, payload
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.client._call(self.method, self.route, self.payload)
        except BaseException as err:  # surfaced in join_and_raise
            self.error = err

    def join_and_raise(self) -> None:
        self.join(self.client.request_timeout_s)
        if self.is_alive():
            raise VLLMServerError(f"{self.method} {self.client.base_url}{self.route} did not answer within "
                                  f"{self.client.request_timeout_s:.0f} s")
        if self.error is not None:
            raise self.error


# ---------------------------------------------------------------------------------------------------- the trainer
def named_tensor_source():
    """A vLLM WeightSource over the (name, tensor) list of the current push (vLLM is imported only here: the NCCL
    path needs it in the training environment)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class NamedTensors(WeightSource):
        def __init__(self):
            self.named: list[tuple[str, torch.Tensor]] = []

        def metadata(self):
            return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.named]

        def __iter__(self):
            return ((name, tensor.contiguous()) for name, tensor in self.named)

    return NamedTensors()


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


def check_same_model(served: str, model: torch.nn.Module) -> None:
    """Refuse a server that serves another architecture (a checkpoint folder we can read)."""
    import json
    import os
    path = os.path.join(served, "config.json")
    if not os.path.isfile(path):
        return  # a Hub id or a path on another machine: the first weight update checks names and shapes
    with open(path) as handle:
        theirs = json.load(handle)
    ours = model.config.to_dict() if hasattr(model, "config") else {}
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if key in theirs and key in ours and theirs[key] != ours[key]:
            raise ValueError(f"the vLLM server serves {served} with {key}={theirs[key]!r}, the policy has "
                             f"{key}={ours[key]!r}: its weights cannot be synchronised. Fix: start the server with "
                             "the policy's model.")


class VLLMServerGenerator(GenerationBackend):
    """Generation in server mode for every rank: prompts are gathered, the main process pushes the weights when
    the optimizer step changed, asks for `n = num_generations` completions per unique prompt, checks the sync on a
    few samples, and each rank gets its own rows back."""

    def __init__(self, args, accelerator, model: torch.nn.Module, eos_ids: list[int], zero3: bool = False):
        self.args = args
        self.zero3 = zero3  # weights are gathered from ZeRO-3 shards (every rank takes part) before a push
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
        from rloo.models import is_peft_model
        if accelerator.is_main_process:
            self.client = VLLMServerClient(self.url, args.vllm_server_timeout)
            self.client.wait_until_healthy()
            self.model_id = self.client.model_info()["id"]
            check_same_model(self.model_id, model)
            config = self.client.server_config()
            lora_enabled = config.get("lora_config") is not None
            if is_peft_model(model) and args.vllm_peft_sync == "adapter" and not lora_enabled:
                raise ValueError("vllm_peft_sync='adapter' but the vLLM server runs without LoRA support. Fix: "
                                 "start it with --enable-lora (and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), or "
                                 "vllm_peft_sync='merged'.")
            self.adapter_mode = is_peft_model(model) and args.vllm_peft_sync != "merged" and lora_enabled
            # Adapter mode assumes the server's base weights are the policy's base; a server that an earlier run
            # pushed weights into is not. Where the server can take weights, the base is pushed once first.
            self.base_pending = self.adapter_mode and bool((config.get("weight_transfer_config") or {}).get("backend"))
            if not self.adapter_mode or self.base_pending:
                self.client.init_weight_transfer(local_address_towards(self.url), args.vllm_group_port)
        from accelerate.utils import broadcast_object_list
        self.adapter_mode, self.base_pending = broadcast_object_list([self.adapter_mode, self.base_pending],
                                                                     from_process=0)
        self.adapter_versions: list[str] = []
        self.tolerance = sync_tolerance(args, model)

    @timed("weight_sync")
    def sync_weights(self, model: torch.nn.Module, step: int) -> None:
        if self.adapter_mode:
            self._sync_adapter(model, self.zero3, step)
            return
        with full_weights(model, self.zero3) as weights:
            if self.client is not None:
                pushed = self.client.push_weights(weights)
                self.metrics.update({"vllm/sync_seconds": pushed["seconds"], "vllm/sync_bytes": pushed["bytes"]})

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, prompt_ids: list[list[int]], num_generations: int, step: int
                 ) -> list[list[int]]:
        from accelerate.utils import broadcast_object_list, gather_object
        synced = step != self.last_synced_step
        if synced:
            self.sync_weights(model, step)
            self.last_synced_step = step
        everyone = gather_object([list(p) for p in prompt_ids])
        result = [None]
        if self.client is not None:
            start = time.perf_counter()
            grouped = all(everyone[i] == everyone[i - i % num_generations] for i in range(len(everyone))) \
                and len(everyone) % num_generations == 0
            unique, n = (everyone[::num_generations], num_generations) if grouped else (everyone, 1)
            # a seed per request: different across steps (a resumed run does not replay them) and calls
            sampling = dict(sampling_of(self.args),
                            seed=(self.args.seed * 1_000_003 + step * 7_919 + self.requests) % (2 ** 31))
            self.requests += 1
            rows = [row for group in self.client.complete(self.model_id, unique, n, sampling) for row in group]
            self.metrics["vllm/generation_seconds"] = time.perf_counter() - start
            ids = [cut_at_eos(row["ids"], self.eos_ids) for row in rows]
            logprobs = [row["logprobs"][:len(cut)] for row, cut in zip(rows, ids)] if unwarped(self.args) else None
            result = [{"rows": ids, "logprobs": logprobs,
                       "check": self._check_sample(everyone, rows) if synced else None}]
        result = broadcast_object_list(result, from_process=0)[0]
        if result["check"] is not None:
            self._verify(model, result["check"])
        local = len(prompt_ids)
        start = self.accelerator.process_index * local
        logprobs = result["logprobs"]
        return Completions(result["rows"][start:start + local],
                           None if logprobs is None else logprobs[start:start + local])

    def _sync_adapter(self, model: torch.nn.Module, zero3: bool, step: int) -> None:
        """Only the LoRA adapter: written to a new folder per version (vLLM caches by path) and loaded in place
        under one name, which generation requests then use as their model."""
        import os
        import shutil

        from rloo.zero import gathered_parameters
        if self.base_pending:  # once: the base weights (adapter not merged), so server base == policy base
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
                self.metrics.update({"vllm/sync_seconds": time.perf_counter() - start, "vllm/sync_bytes": size})
                self.adapter_versions.append(path)
                while len(self.adapter_versions) > 2:  # the server has loaded the newer ones
                    shutil.rmtree(self.adapter_versions.pop(0), ignore_errors=True)

    def _check_sample(self, prompts: list[list[int]], rows: list[dict]) -> list[dict] | None:
        count = min(self.args.vllm_sync_verify_samples, len(rows))
        picks = [i for i in range(len(rows)) if rows[i]["ids"]][:count]
        if not picks:
            return None
        return [{"prompt": prompts[i], "completion": rows[i]["ids"],
                 "vllm": self.client.score(self.model_id, prompts[i], rows[i]["ids"])} for i in picks]

    @timed("weight_sync")  # the check of a push is part of its cost
    def _verify(self, model: torch.nn.Module, samples: list[dict]) -> None:
        """Every rank runs the same forward passes (ZeRO-3 gathers collectively); the main process judges."""
        worst = max_logprob_diff(model, samples)
        self.metrics["vllm/sync_max_logprob_diff"] = worst
        judge_sync(worst, self.tolerance, self.args.vllm_sync_on_mismatch, len(samples), self.last_synced_step,
                   "vLLM server")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics

