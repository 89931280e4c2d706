"""glibc heap settings for a training process (no-ops without glibc): memory a step frees stays in
the process for the next step's tensors instead of going back to the system and being faulted in
again, page by page; the packed weights of a generation call, made once and freed at its end, go
into the heap's free memory where it has room and get mappings of their own otherwise, so that they
do not grow the heap. (glibc's defaults return the freed top of the heap after every backward, and
the next step faults it in again, page by page; what that costs: docs/design.md.)"""

from __future__ import annotations

import contextlib
import ctypes
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters
# larger allocations get their own mapping (glibc's own adjustment climbs to this value)
MMAP_THRESHOLD = 32 << 20
# free memory at the top of the heap is kept up to this much (the most mallopt takes)
TRIM_THRESHOLD = (1 << 31) - 1


@functools.cache
def libc():
    try:
        found = ctypes.CDLL("libc.so.6", use_errno=True)
        return found if hasattr(found, "mallopt") else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Allocations under 32 MiB from the heap, and the heap's free top kept (up to 2 GiB) instead of
    trimmed. False where there is no glibc."""
    lib = libc()
    if lib is None:
        return False
    lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    lib.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return True


@contextlib.contextmanager
def own_mappings():
    """Allocations of 1 MiB or more inside get their own memory mappings where the heap's free
    memory has no room for them (glibc takes a free chunk that fits first), so that freeing them
    gives their memory back to the system instead of growing the heap, where the training step's
    allocations do not fit it again (a lower peak RSS, the same step time). Afterwards,
    keep_freed_memory's settings."""
    lib = libc()
    if lib is None:
        yield
        return
    lib.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        keep_freed_memory()
