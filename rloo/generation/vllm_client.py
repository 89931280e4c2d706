"""The vLLM server's HTTP side for server mode: every route the trainer calls (health, model info,
the weight-transfer routes, LoRA loading, completions and scoring, with images through the token-in
route), each with a timeout and a failure that names the route and the server's answer (and the
server's last log lines where readable; a request left unanswered is a resumable stall), and the
weight source vLLM's NCCL engine reads from."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import requests
import torch
import torch.distributed as dist

from rloo import faults
from rloo.watchdog import TrainingStalled
from rloo_vllm.wire import CHUNK_BYTES, pack, plan_chunks

logger = logging.getLogger(__name__)


def server_log_tail(lines: int = 20) -> str:
    """The server's last log lines when its log is readable from here (RLOO_VLLM_SERVER_LOG, set by
    the SLURM launcher), for the error of a failed call."""
    import os

    path = os.environ.get("RLOO_VLLM_SERVER_LOG")
    if not path or not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as handle:
        return f"\nlast lines of the server's log {path}:\n" + "".join(handle.readlines()[-lines:])


TOKENS_ROUTE = "/inference/v1/generate"  # vLLM's token-in route (`--enable-scale-out`)


def image_data_url(image) -> str:
    """A PIL image as a PNG `data:` URL, as vLLM's `image_url` content parts take it."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class VLLMServerError(RuntimeError):
    """The server answered a route with an error (the message names the route and quotes the
    answer)."""


class ServerStalled(TrainingStalled):
    """A request got no answer within the read timeout: a stall, resumable like the watchdog's."""


class VLLMServerClient:
    """`request_timeout_s`: how long a request may go without an answer before it is a stall
    (vllm_request_timeout_s); `progress`: called as each chunk of a weight push is sent (the
    trainer's StepTimer.advance, so a long push is not taken for a stalled one)."""

    def __init__(
        self,
        base_url: str,
        connect_timeout_s: float = 240.0,
        request_timeout_s: float = 1800.0,
        progress: Callable[[], None] | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.progress = progress or (lambda: None)
        self.session = requests.Session()
        self.group = None
        self._store = None
        # (RLOO_WEIGHT_CHUNK_BYTES: smaller chunks, less memory on the server during a push)
        self.chunk_bytes = int(os.environ.get("RLOO_WEIGHT_CHUNK_BYTES", CHUNK_BYTES))
        self.nccl = None  # vLLM's NCCL trainer engine when the server runs the "nccl" backend
        self.source = None

    # ------------------------------------------------------------------ HTTP
    def _call(
        self, method: str, route: str, payload: dict | None = None, timeout: float | None = None
    ):
        url = self.base_url + route
        timeout = timeout or self.request_timeout_s
        try:
            response = self.session.request(method, url, json=payload, timeout=timeout)
        except requests.ReadTimeout as err:
            raise self._stalled(method, route, timeout) from err
        except requests.RequestException as err:
            raise VLLMServerError(f"{method} {url} failed: {err}{server_log_tail()}") from err
        if response.status_code != 200:
            raise VLLMServerError(
                f"{method} {url} answered {response.status_code}: "
                f"{response.text[:1000]}{server_log_tail()}"
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:  # some routes answer plain text ("Success: LoRA adapter ... loaded")
            return response.text

    def _stalled(self, method: str, route: str, timeout: float) -> ServerStalled:
        return ServerStalled(
            f"{method} {self.base_url}{route} got no answer for {timeout:g} s "
            "(vllm_request_timeout_s): the vLLM server is stopped or overloaded, or this batch "
            "takes longer than that allows (then raise vllm_request_timeout_s). The run resumes "
            f"from its last checkpoint.{server_log_tail()}"
        )

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
                raise ConnectionError(
                    f"the vLLM server at {self.base_url} did not become healthy within "
                    f"{self.connect_timeout_s:.0f} s (vllm_server_timeout; last: {last}). Start it "
                    "first, or fix vllm_server_base_url / vllm_server_host / vllm_server_port."
                )
            time.sleep(1.0)

    def model_info(self) -> dict:
        models = self._call("GET", "/v1/models", timeout=30)["data"]
        return models[0]

    def server_config(self) -> dict:
        return self._call("GET", "/server_info?config_format=json", timeout=30)["vllm_config"]

    # ------------------------------------------------------------------ weights
    def init_weight_transfer(self, host: str, port: int, timeout_s: float = 300.0) -> None:
        """Open the weight-transfer group with the server's workers, over the backend the server
        runs: "gloo" (ours, CPU or GPU servers; this process hosts the store as rank 0) or "nccl"
        (GPU to GPU, through vLLM's own trainer-side engine)."""
        try:
            config = self.server_config()
        except VLLMServerError as err:
            raise VLLMServerError(
                f"{err}. The weight-update routes exist only when the server runs with "
                "VLLM_SERVER_DEV_MODE=1."
            ) from err
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend not in ("gloo", "nccl"):
            raise VLLMServerError(
                f"the server's weight transfer backend is {backend!r}; this trainer pushes weights "
                "over 'gloo' (any device) or 'nccl' (GPUs). Restart the server with "
                '--weight-transfer-config \'{"backend": "gloo"}\' --worker-extension-cls '
                "rloo_vllm.engine.WorkerExtension."
            )
        self._close_abandoned_update(config)
        workers = int(self._call("GET", "/get_world_size", timeout=30)["world_size"])
        world = workers + 1
        if backend == "nccl":
            self._init_nccl(host, port, world)
            return
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(
            host, port, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        info = {
            "master_address": host,
            "master_port": port,
            "world_size": world,
            "rank_offset": 1,
            "timeout_s": timeout_s,
            "chunk_bytes": self.chunk_bytes,
        }
        errors = self._in_thread("POST", "/init_weight_transfer_engine", {"init_info": info})
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("rloo-weights", self._store), 0, world, timeout
        )
        errors.join_and_raise()

    def _init_nccl(self, host: str, port: int, world: int) -> None:
        """The server runs vLLM's NCCL backend: vLLM's trainer-side engine drives the same routes
        through this client (init_weight_transfer_engine / start / update / finish below) and
        broadcasts from this GPU."""
        if not torch.cuda.is_available():
            raise VLLMServerError(
                "the server's weight transfer backend is 'nccl', which sends from a GPU of this "
                "process, and this process has none. Fix: restart the server with "
                '--weight-transfer-config \'{"backend": "gloo"}\' --worker-extension-cls '
                "rloo_vllm.engine.WorkerExtension (works with GPU servers too, through host "
                "memory)."
            )
        try:
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )
        except ImportError as err:
            raise ImportError(
                "the server's weight transfer backend is 'nccl': the trainer side needs vLLM in "
                "the training environment (pip install vllm), or restart the server with the "
                "'gloo' "
                'backend (--weight-transfer-config \'{"backend": "gloo"}\').'
            ) from err
        self.source = named_tensor_source()
        info = NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=world, rank=0)
        self.nccl = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=self, source=self.source
        )

    def _close_abandoned_update(self, config: dict) -> None:
        """A trainer killed between starting a weight update and finishing it leaves the server's
        session open (its layers waiting for weights), and vLLM's engine dies at the next start.
        Our worker extension closes such a session (every push writes every weight, so nothing of
        it remains); a server without the extension cannot be asked (an unknown worker method
        would stop its engine too)."""
        extension = str((config.get("parallel_config") or {}).get("worker_extension_cls") or "")
        if extension != "rloo_vllm.engine.WorkerExtension":
            return
        results = self._call(
            "POST", "/collective_rpc", {"method": "rloo_close_abandoned_weight_update"}, timeout=60
        )
        if any((result or {}).get("closed") for result in results.get("results") or []):
            logger.warning(
                "The vLLM server at %s had a weight update left open by a trainer that "
                "stopped mid-push; it is closed, and every weight is pushed again.",
                self.base_url,
            )

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
        """One update: start, /update_weights while the chunks are broadcast, finish, reset the
        prefix cache (cached KV of old weights would otherwise score long prompts). Returns seconds
        and bytes."""
        start = time.perf_counter()
        if self.nccl is not None:
            # NCCL sends from this process's GPU
            device = torch.device("cuda", torch.cuda.current_device())
            self.source.named = [
                (name, tensor.detach().to(device)) for name, tensor in named_tensors
            ]
            self.nccl.send_weights()
            self._call("POST", "/reset_prefix_cache", {})
            return {
                "seconds": time.perf_counter() - start,
                "bytes": sum(t.numel() * t.element_size() for _, t in self.source.named),
            }
        if self.group is None:
            raise RuntimeError("init_weight_transfer() must run before push_weights()")
        names = [name for name, _ in named_tensors]
        tensors = [tensor.detach().cpu() for _, tensor in named_tensors]
        dtype_names = [str(t.dtype).removeprefix("torch.") for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        self.start_weight_update()
        errors = self._in_thread(
            "POST",
            "/update_weights",
            {"update_info": {"names": names, "dtype_names": dtype_names, "shapes": shapes}},
        )
        sent = 0
        try:
            for chunk in plan_chunks(dtype_names, shapes, self.chunk_bytes):
                buffer = pack([tensors[i] for i in chunk])
                self.group.broadcast(buffer, 0).wait()
                sent += buffer.numel() * buffer.element_size()
                self.progress()
                faults.point("mid-push")  # the server waits for the next chunk, or the finish
        finally:
            errors.join_and_raise()
        self.finish_weight_update()
        self._call("POST", "/reset_prefix_cache", {})
        return {"seconds": time.perf_counter() - start, "bytes": sent}

    def load_lora_adapter(self, name: str, path: str) -> float:
        start = time.perf_counter()
        self._call(
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": path, "load_inplace": True},
        )
        return time.perf_counter() - start

    # ------------------------------------------------------------------ sampling and scoring
    def complete(
        self, model: str, prompts: list[list[int]], n: int, sampling: dict
    ) -> list[list[dict]]:
        """Per prompt, `n` completions: {"ids": [...], "logprobs": [...]} (sampled-token
        log-probs)."""
        payload = {
            "model": model,
            "prompt": prompts,
            "n": n,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **sampling,
        }
        choices = self._call("POST", "/v1/completions", payload)["choices"]
        if len(choices) != len(prompts) * n:
            raise VLLMServerError(
                f"POST {self.base_url}/v1/completions returned {len(choices)} choices for "
                f"{len(prompts)} prompts x n={n}"
            )
        choices = sorted(choices, key=lambda c: c["index"])
        rows = [
            _sampled(
                c,
                list((c.get("logprobs") or {}).get("token_logprobs") or []),
                f"POST {self.base_url}/v1/completions",
                f"prompt {c['index'] // n}",
            )
            for c in choices
        ]
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))]

    def score(self, model: str, prompt: list[int], completion: list[int]) -> list[float]:
        """The server's log-probs (temperature 1) of `completion`'s tokens after `prompt`."""
        payload = {
            "model": model,
            "prompt": [prompt + completion],
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        }
        entries = self._call("POST", "/v1/completions", payload)["choices"][0]["prompt_logprobs"]
        return _completion_logprobs(entries, prompt, completion)

    # ------------------------------------------------------------------ with images
    def complete_with_images(
        self, model: str, prompt: list[int], images: list, n: int, sampling: dict
    ) -> list[dict]:
        """`n` completions of one prompt and its images, as `complete` gives them. /v1/completions
        takes token ids but no images, so this goes through vLLM's token-in route."""
        body = self._tokens_call(model, prompt, images, dict(sampling, n=n, logprobs=0))
        choices = sorted(body["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise VLLMServerError(
                f"POST {self.base_url}{TOKENS_ROUTE} returned {len(choices)} choices for n={n}"
            )
        return [
            _sampled(
                c,
                [
                    float(entry["logprob"])
                    for entry in (c.get("logprobs") or {}).get("content") or []
                ],
                f"POST {self.base_url}{TOKENS_ROUTE}",
                "the prompt",
            )
            for c in choices
        ]

    def score_with_images(
        self, model: str, prompt: list[int], completion: list[int], images: list
    ) -> list[float]:
        """`score` for a prompt with images."""
        tokens = list(prompt) + list(completion)
        body = self._tokens_call(
            model, tokens, images, {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        )
        return _completion_logprobs(body["prompt_logprobs"], prompt, completion)

    def _tokens_call(self, model: str, token_ids: list[int], images: list, sampling: dict) -> dict:
        """POST /inference/v1/generate: the prompt's ids as the processor expanded them, each image
        as a PNG data URL (lossless: the server sees our pixels). The server expands the
        placeholders itself and echoes the ids; other ids mean another processor there."""
        payload = {
            "model": model,
            "token_ids": list(token_ids),
            "content_parts": [
                {"type": "image_url", "url": image_data_url(image)} for image in images
            ],
            "sampling_params": sampling,
            "return_token_ids": True,
        }
        try:
            body = self._call("POST", TOKENS_ROUTE, payload)
        except VLLMServerError as err:
            if " answered 403" in str(err) or " answered 404" in str(err):
                raise VLLMServerError(
                    f"{err}\nImages reach a vLLM server through its token-in route, served only "
                    "with `vllm serve ... --enable-scale-out`. Fix: restart the server with "
                    "--enable-scale-out."
                ) from err
            raise
        echoed = body.get("prompt_token_ids")
        if echoed is not None and list(echoed) != list(token_ids):
            raise VLLMServerError(
                f"the vLLM server made {len(echoed)} prompt tokens of a prompt with "
                f"{len(images)} image(s) that the trainer's processor made {len(token_ids)} "
                "tokens of: it processes images differently, so it would sample for other "
                "inputs than the trainer trains on. Fix: serve the checkpoint folder that holds "
                "the trainer's processor (processor_config.json / preprocessor_config.json)."
            )
        return body

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
            raise self.client._stalled(self.method, self.route, self.client.request_timeout_s)
        if self.error is not None:
            raise self.error


def named_tensor_source():
    """A vLLM WeightSource over the (name, tensor) list of the current push (vLLM is imported only
    here: the NCCL path needs it in the training environment)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class NamedTensors(WeightSource):
        def __init__(self):
            self.named: list[tuple[str, torch.Tensor]] = []

        def metadata(self):
            return [
                ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.named
            ]

        def __iter__(self):
            return ((name, tensor.contiguous()) for name, tensor in self.named)

    return NamedTensors()


def _sampled(choice: dict, logprobs: list[float], request: str, prompt: str) -> dict:
    """A sampled completion and its sampled tokens' log-probs, one per token: a server answering
    with fewer (or none) would leave importance weights computed from the wrong tokens, or none."""
    ids = list(choice["token_ids"])
    if len(logprobs) != len(ids):
        raise VLLMServerError(
            f"{request} answered completion {choice['index']} ({prompt}) with {len(ids)} token ids "
            f"and {len(logprobs)} log-probs; the request asked for the log-prob of every sampled "
            "token (logprobs=0). Is the server a vLLM that returns them?"
        )
    return {"ids": ids, "logprobs": [float(value) for value in logprobs]}


def _completion_logprobs(entries: list, prompt: list[int], completion: list[int]) -> list[float]:
    """From vLLM's prompt log-probs (one {token id: {"logprob": ...}} per position) of prompt +
    completion, those of the completion's tokens."""
    tokens = list(prompt) + list(completion)
    return [float(entries[i][str(tokens[i])]["logprob"]) for i in range(len(prompt), len(tokens))]
