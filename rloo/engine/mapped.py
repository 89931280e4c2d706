"""A frozen copy of a model whose parameters and buffers live in one shared mapping of an unlinked
file on a disk filesystem, and the call that takes the mapping's pages out of the process between
uses.

The reference model (beta > 0, full fine-tune) is read once per step, by the reference forward; the
rest of the step (the loss's forward and backward, where the step's memory peaks) does not touch it.
Held in the process's own memory it adds its whole size to that peak. Here its pages are the
kernel's page cache of a file: `page_out` after each reference forward unmaps them (madvise
MADV_DONTNEED, which loses nothing on a shared file mapping: pages written stay in the page cache
and reach the file), the next forward maps them again from the page cache (minor faults, cheap), and
under memory pressure the kernel can drop them and read them back from the disk instead of swapping
anonymous memory out. The file is unlinked as soon as it is mapped, so nothing is left behind, not
even after a kill.

Only where that holds: every tensor a plain strided CPU tensor, Linux (/proc/self/mountinfo) with
glibc, a writable directory on a disk filesystem with room (the system's temporary directory,
TMPDIR, else /var/tmp). A tmpfs or ramfs is never used: its pages cannot be reclaimed, so the memory
would only move out of the process's count. Elsewhere `mapped_copy` returns None and the caller
keeps a plain copy."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import os
import re
import tempfile

import torch
from torch import nn

from rloo.engine.heap import libc

MADV_DONTNEED = 4
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"}
ALIGN = 64  # bytes between the tensors' starts in the file (a cache line)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the filesystem `path` is on (the last mount over the longest matching mount
    point), None where there is no mountinfo to read."""
    try:
        with open(mountinfo) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    path, found, longest = os.path.realpath(path), None, -1
    for line in lines:
        fields, _, tail = line.partition(" - ")
        point = re.sub(
            r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), fields.split()[4]
        )  # "\040": " "
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= longest and tail.split():
            found, longest = tail.split()[0], len(point)
    return found


def candidate_directories() -> list[str]:
    return [tempfile.gettempdir(), "/var/tmp"]


def disk_directory(size: int) -> str | None:
    """A writable directory on a disk filesystem with room for `size` bytes and as much again to
    spare."""
    for directory in candidate_directories():
        kind = filesystem_type(directory)
        if kind is None or kind in MEMORY_FILESYSTEMS or not os.access(directory, os.W_OK):
            continue
        try:
            stats = os.statvfs(directory)
        except OSError:
            continue
        if stats.f_bavail * stats.f_frsize > 2 * size:
            return directory
    return None


def _mappable(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.device.type == "cpu"
        and (tensor.layout == torch.strided and not tensor.is_quantized)
    )


def mapped_copy(model: nn.Module) -> nn.Module | None:
    """A deep copy of `model` whose parameters (frozen) and buffers are views into one shared file
    mapping, paged out; tied parameters stay tied. None where the mapping cannot be used (see the
    module's docstring)."""
    tensors = {id(tensor): tensor for tensor in [*model.parameters(), *model.buffers()]}
    if libc() is None or not tensors or not all(_mappable(tensor) for tensor in tensors.values()):
        return None
    if len({tensor.untyped_storage().data_ptr() for tensor in tensors.values()}) < len(tensors):
        # tensors sharing a storage: copies in separate places would no longer see each other's
        # writes
        return None
    offsets, size = {}, 0
    for key, tensor in tensors.items():
        offsets[key] = size
        size += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    directory = disk_directory(size) if size else None
    if directory is None:
        return None
    handle, path = tempfile.mkstemp(prefix="rloo-reference-", dir=directory)
    # the blocks reserved up front: a full disk is this error, not a SIGBUS on a later write into
    # the mapping
    try:
        os.posix_fallocate(handle, 0, size)
        flat = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    except OSError:
        return None
    finally:
        os.close(handle)
        os.unlink(path)
    memo = {}
    with torch.no_grad():
        for key, tensor in tensors.items():
            start = offsets[key]
            view = (
                flat[start : start + tensor.numel() * tensor.element_size()]
                .view(tensor.dtype)
                .view(tensor.shape)
            )
            view.copy_(tensor)
            parameter = isinstance(tensor, nn.Parameter)
            memo[key] = nn.Parameter(view, requires_grad=False) if parameter else view
    copied = copy.deepcopy(model, memo)
    copied._rloo_mapping = flat  # each module's weights leave again as soon as its forward is done:
    copied._rloo_hooks = [
        module.register_forward_hook(functools.partial(_drop_after_forward, flat))
        for module in copied.modules()
        if any(True for _ in module.parameters(recurse=False))
    ]
    page_out(copied)
    return copied


@functools.cache
def _madvise():
    call = libc().madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return call


def _drop(begin: int, end: int) -> None:
    """madvise(MADV_DONTNEED) on the whole pages of [begin, end) (a neighbour's page taken too only
    costs it a minor fault: the mapping is shared, nothing is lost)."""
    first, last = begin // PAGE * PAGE, -(-end // PAGE) * PAGE
    if last > first and _madvise()(first, last - first, MADV_DONTNEED) != 0:
        raise OSError(
            ctypes.get_errno(), "madvise(MADV_DONTNEED) on the reference model's mapping failed"
        )


def _inside(flat: torch.Tensor, tensor: torch.Tensor) -> bool:
    return flat.data_ptr() <= tensor.data_ptr() < flat.data_ptr() + flat.numel()


def _drop_after_forward(flat: torch.Tensor, module: nn.Module, inputs, output) -> None:
    """A module's forward hook: the pages of its own parameters that are (still) in the mapping."""
    for tensor in module.parameters(recurse=False):
        if _inside(flat, tensor):
            _drop(tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size())


def page_out(model: nn.Module) -> None:
    """Take the pages of a mapped_copy's mapping out of the process (they stay in the page cache). A
    model that is no mapped_copy: nothing. One whose tensors moved elsewhere (to an accelerator,
    into a DeepSpeed engine): the mapping is let go."""
    flat = getattr(model, "_rloo_mapping", None)
    if flat is None:
        return
    if not any(_inside(flat, tensor) for tensor in model.parameters()):
        for hook in model._rloo_hooks:
            hook.remove()
        del model._rloo_mapping, model._rloo_hooks
        return
    # (mmap's start is a page's; its last page is whole)
    _drop(flat.data_ptr(), flat.data_ptr() + flat.numel())


@contextlib.contextmanager
def paged_out_after(model: nn.Module):
    """page_out(model) when the block is done, however it ends."""
    try:
        yield
    finally:
        page_out(model)
