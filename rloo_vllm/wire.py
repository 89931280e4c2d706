"""The weight-transfer wire format shared by the trainer (sender) and the vLLM worker (receiver):
parameters are sent in order, packed into one flat buffer per chunk of consecutive same-dtype
tensors. Both sides derive the same chunks from the same (dtype, shape) list, so the update request
carries only names, dtypes and shapes."""

from __future__ import annotations

import math

import torch

CHUNK_BYTES = 256 * 1024 * 1024


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in a weight update")
    return dtype


def plan_chunks(
    dtype_names: list[str], shapes: list[list[int]], limit_bytes: int = CHUNK_BYTES
) -> list[list[int]]:
    """Indices of the parameters in each chunk: consecutive, one dtype, at most `limit_bytes` (a
    larger tensor travels alone)."""
    chunks: list[list[int]] = []
    size = 0
    for index, (dtype_name, shape) in enumerate(zip(dtype_names, shapes)):
        nbytes = math.prod(shape) * dtype_of(dtype_name).itemsize
        same_dtype = bool(chunks) and dtype_names[chunks[-1][-1]] == dtype_name
        if not chunks or not same_dtype or size + nbytes > limit_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(index)
        size += nbytes
    return chunks


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return (
        torch.cat([t.detach().reshape(-1) for t in tensors])
        if len(tensors) > 1
        else tensors[0].detach().reshape(-1).contiguous()
    )


def unpack(buffer: torch.Tensor, shapes: list[list[int]]) -> list[torch.Tensor]:
    sizes = [math.prod(shape) for shape in shapes]
    return [part.view(shape) for part, shape in zip(torch.split(buffer, sizes), shapes)]
