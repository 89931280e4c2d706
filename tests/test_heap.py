"""rloo.engine.heap: memory a training step frees stays in the process for the next step instead of being returned and
faulted in again page by page."""

import resource

import pytest
import torch

from rloo.engine import heap


def _faults_of_a_step() -> int:
    """Minor page faults while 64 tensors of 4 MiB (under the mapping threshold: the heap) are made and freed."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(1 << 20) for _ in range(64)]
    del tensors
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_memory_a_step_frees_is_not_faulted_in_again():
    libc = heap.libc()
    if libc is None:
        pytest.skip("no glibc")
    try:
        libc.mallopt(heap.M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD)
        libc.mallopt(
            heap.M_TRIM_THRESHOLD, 128 << 10
        )  # glibc's default: the free top of the heap goes back
        _faults_of_a_step()
        trimmed = _faults_of_a_step()
        # every tensor's pages faulted in again: 65,536 faults with 4 KiB pages, 4,096 where the kernel hands out
        # 64 KiB folios, 128 with 2 MiB huge pages; at least one per tensor whatever the kernel's granularity
        assert trimmed >= 64
        assert heap.keep_freed_memory()
        _faults_of_a_step()
        kept = _faults_of_a_step()
        assert kept * 20 < trimmed
    finally:
        heap.keep_freed_memory()
