"""Kernels of our own for the written-out decode step (rloo.engine.decode), fp32 on the CPU, in
kernel.c; its binding is read from kernel.c itself (rloo.engine.binding).

`linear` (PackedLinear): y = x W^T (+ bias) for a few rows. The weights (several side by side: a
layer's q/k/v) are packed once per generation call into blocks of NB output columns x K (NB = one
vector register's floats), read as three sequential streams, each prefetched ahead; x's rows go in
groups, every weight vector loaded once per group; the column blocks are shared out among torch's
own OpenMP threads (one thread pool, not two competing for the cores). Each output is one sum over K
in order: equal to F.linear up to float rounding. `attend`: a step's rotary embedding, key/value
write and attention over the written positions (first those of the row's prompt in a copy its rows
share, `Shared`), one call per layer, parallel over rows x key/value heads, the softmax NB positions
at a time with an exp of its own (Cephes' polynomial): equal to the model's attention up to float
rounding. `decode_step` (Step): the whole step of a Llama-family decoder in one call and one
parallel region (norms, the two above, SiLU x up, residual adds, LM head). The same call takes
several prompt tokens per row (Step.prompt_tokens; rloo.engine.prompt_steps). `draw`: a token per
row from softmax(logits) (some columns banned: min_new_tokens' EOS) by inverse CDF on the weights
e^(s - max) in double, two levels as rloo.engine.lean.sample_from, without a processed copy in
memory.

Compiled once per machine and source by the system's gcc (-O3 -march=native, OpenMP) into the
kernels folder of rloo.process.cache_root and loaded with ctypes. The decode step takes it where
the CPU has AVX-512 or AVX2 with FMA (`for_decoding`; $RLOO_KERNEL_MARCH, where set, is the -march
instead of native, e.g. x86-64-v3 to measure on a CPU with AVX-512 what one without it does).
Without either, without gcc, or off Linux on x86-64, the step keeps oneDNN's GEMM and torch's
attention, and says so once. What each part buys: docs/performance.md."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from typing import Callable, NamedTuple

import torch

from rloo.engine.binding import Library, source_id
from rloo.process import cache_root

logger = logging.getLogger(__name__)

MARCH = "RLOO_KERNEL_MARCH"  # gcc's -march for the library instead of native (for_decoding)
SOURCE = (resources.files("rloo.engine") / "kernel.c").read_text()


@functools.cache
def compiled(target: str = "native") -> Library | None:
    """The library for this machine (built on first use, then from the cache), or None where it
    cannot be built here: not Linux on x86-64, no gcc, or the build failed (logged). `target`: gcc's
    -march (the tests also build for x86-64-v3, AVX2 and FMA without AVX-512, on a CPU that has
    AVX-512)."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    if compiler is None:
        logger.warning(
            "rloo engine: no C compiler (%s) found: the decode step runs on torch.",
            os.environ.get("CC", "gcc"),
        )
        return None
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    flags = [
        "-O3",
        f"-march={target}",
        "-fopenmp",
        "-shared",
        "-fPIC",
        f"-Wl,-rpath,{torch_lib}",
        "-lm",
        f"-DRLOO_SOURCE_ID={source_id(SOURCE)}ULL",
    ]
    key = hashlib.sha256("\n".join([SOURCE, compiler, torch_lib, *flags]).encode()).hexdigest()[:16]
    # (-march=native: one build per CPU model)
    cpu = hashlib.sha256(_cpu_flags().encode()).hexdigest()[:8]

    path = os.path.join(cache_root(), "kernels", f"decode-gemm-{key}-{cpu}.so")
    if not os.path.exists(path):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            directory = os.path.dirname(path)
        except OSError:
            directory = tempfile.gettempdir()
            path = os.path.join(directory, os.path.basename(path))
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            source, built = os.path.join(scratch, "gemm.c"), os.path.join(scratch, "gemm.so")
            with open(source, "w") as handle:
                handle.write(SOURCE)
            done = subprocess.run(
                [compiler, *flags, source, "-o", built], capture_output=True, text=True
            )
            if done.returncode != 0:
                logger.warning(
                    "rloo engine: the decode kernel did not build (%s -march=%s): the decode step "
                    "runs on torch. %s",
                    compiler,
                    target,
                    done.stderr.strip()[-500:],
                )
                return None
            os.replace(built, path)  # (atomic: another process never loads half a file)
    return Library(path, SOURCE)  # (the source it was built from and its struct checked: binding)


@functools.cache
def _cpu_flags() -> str:
    """The "flags" line of /proc/cpuinfo (read once a process: a CPU's flags do not change)."""
    try:
        with open("/proc/cpuinfo") as handle:
            return next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return ""


def _needs(library: Library) -> str | None:
    """The CPU flag the library's vectors need: avx512f (16 floats a vector) or fma (AVX2's 8 floats
    with fused multiply-adds); None where its build has neither, which the decode step does not
    take."""
    return "avx512f" if library.vector_floats() == 16 else "fma" if library.fused() else None


def for_decoding() -> Library | None:
    """The library where the decode step should use it: built, for AVX-512 or for AVX2 with FMA
    (`_needs`), for $RLOO_KERNEL_MARCH's -march where set (an error where that build fails, has
    neither, or needs what this CPU lacks), else for this CPU's."""
    target = os.environ.get(MARCH, "").strip()
    library = compiled(target) if target else compiled()
    needs = None if library is None else _needs(library)
    if target and (needs is None or needs not in _cpu_flags().split()):
        why = (
            "gcc could not build it (its message: logged above)"
            if library is None
            else f"this CPU has no {needs}"
            if needs
            else "its build has neither AVX-512 nor AVX2 with FMA"
        )
        raise ValueError(
            f"{MARCH}={target!r}: the decode step's library for -march={target} cannot run here: "
            f"{why}. Unset {MARCH} (this CPU's own build) or set a -march this CPU runs, e.g. "
            "x86-64-v3 (AVX2 and FMA)."
        )
    return library if needs is not None else None


class PackedLinear:
    """x -> F.linear(x, torch.cat(weights), bias) for fp32 inputs on the CPU (any number of rows):
    the weights (one, or several side by side: a layer's q/k/v) packed now by the library's `pack`
    straight from where they are, no concatenated copy (kept: `packed`, `bias`, `n`, `k`, for
    `Step`)."""

    def __init__(
        self,
        library: Library,
        weights: torch.Tensor | list[torch.Tensor],
        bias: torch.Tensor | None,
    ):
        weights = [
            w.detach().contiguous()
            for w in ([weights] if isinstance(weights, torch.Tensor) else weights)
        ]
        self.library = library
        self.n, self.k = sum(w.size(0) for w in weights), weights[0].size(1)
        if any(w.size(1) != self.k or w.dtype != torch.float32 for w in weights):
            raise ValueError(
                "decode GEMM: weights side by side need fp32 and one input size, got "
                f"{[(w.dtype, tuple(w.shape)) for w in weights]}"
            )
        block = library.block_columns()
        padded = -(-self.n // block) * block
        self.packed = torch.empty(padded * self.k, dtype=torch.float32)
        addresses = (ctypes.c_void_p * len(weights))(*(w.data_ptr() for w in weights))
        sizes = (ctypes.c_int * len(weights))(*(w.size(0) for w in weights))
        library.pack(
            ws=addresses,
            ns=sizes,
            count=len(weights),
            p=self.packed.data_ptr(),
            k=self.k,
            n_pad=padded,
            threads=torch.get_num_threads(),
        )
        self.bias = None if bias is None else bias.detach().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.size(-1) != self.k:
            raise ValueError(
                f"decode GEMM: expected fp32 inputs of {self.k} features, got {x.dtype} "
                f"{tuple(x.shape)}"
            )
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], self.n)
        self.library.linear(
            x=x.data_ptr(),
            p=self.packed.data_ptr(),
            bias=_address(self.bias),
            y=out.data_ptr(),
            m=x.numel() // self.k,
            n=self.n,
            k=self.k,
            threads=torch.get_num_threads(),
        )
        return out


def packed_linear(
    library: Library,
    weights: torch.Tensor | list[torch.Tensor],
    bias: torch.Tensor | None,
    rows: int,
) -> PackedLinear:
    """packing.kernels' interface (`rows` is the other kernels': this one takes any number)."""
    return PackedLinear(library, weights, bias)


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _checked_buffers(keys: torch.Tensor, values: torch.Tensor) -> None:
    if (keys.data_ptr() | values.data_ptr()) % 64 or not (
        keys.is_contiguous() and values.is_contiguous()
    ):
        raise ValueError(
            "decode attention: key/value buffers must be contiguous and 64-byte aligned"
        )


class Shared(NamedTuple):
    """The prompts' keys and values that their rows share, for one layer: keys / values (prompts,
    kv_heads, positions, dim), fp32 contiguous; prompt (rows,) int32: each row's prompt."""

    keys: torch.Tensor
    values: torch.Tensor
    prompt: torch.Tensor


def attention(library: Library, heads: int, kv_heads: int, dim: int) -> Callable | None:
    """(projected, cos, sin, keys, values, mask, at, scale, shared=None) -> attended (rows, 1, heads
    x dim): the decode step's rotary embedding, key/value write at position `at` and attention (the
    C `attend`) for fp32 tensors laid out as rloo.engine.decode.LeanDecoder keeps them: each row's
    own keys / values (rows, kv_heads, total, dim), after its prompt's (`Shared`) where given, mask
    (rows, ..., shared positions + total); None where its shapes are not ones it takes (dim a
    multiple of the vector's floats, at most 512)."""
    if dim % library.vector_floats() or dim > 512 or heads % kv_heads:
        return None

    def attend(
        projected, cos, sin, keys, values, mask, at: int, scale: float, shared: Shared | None = None
    ) -> torch.Tensor:
        rows = projected.size(0)
        _checked_buffers(keys, values)
        _checked_position(at, keys.size(2))
        out = projected.new_empty(rows, 1, heads * dim)
        cos, sin = cos.contiguous(), sin.contiguous()
        shared_keys, shared_values, prompt, positions = _shared_arguments(shared, rows)
        library.attend(
            qkv=projected.data_ptr(),
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            shared_keys=shared_keys,
            shared_values=shared_values,
            prompt=prompt,
            shared=positions,
            keys=keys.data_ptr(),
            values=values.data_ptr(),
            mask=mask.data_ptr(),
            out=out.data_ptr(),
            rows=rows,
            heads=heads,
            kv_heads=kv_heads,
            dim=dim,
            total=keys.size(2),
            at=at,
            scale=scale,
            threads=torch.get_num_threads(),
        )
        return out

    return attend


def _checked_position(at: int, total: int) -> None:
    if not 0 <= at < total:  # (the C writes the step's key and value there)
        raise ValueError(f"decode attention: position {at} is outside the buffers' {total}")


def _shared_arguments(shared: Shared | None, rows: int) -> tuple:
    """(shared keys, shared values, prompt of each row, shared positions) for the C; nothing shared:
    Nones, 0."""
    if shared is None:
        return None, None, None, 0
    _checked_buffers(shared.keys, shared.values)
    prompt = shared.prompt
    if prompt.dtype != torch.int32 or not prompt.is_contiguous() or prompt.numel() != rows:
        raise ValueError(
            f"decode attention: the rows' prompt indices must be {rows} contiguous int32"
        )
    return shared.keys.data_ptr(), shared.values.data_ptr(), prompt.data_ptr(), shared.keys.size(2)


class Step:
    """A whole decode step in one C call (`decode_step`): every layer's norms, packed projections,
    attention, SiLU x up and residual adds, the final norm and the LM head, with no Python or torch
    dispatch between them. `layers`: one dict per layer with norm1 / norm2 ((weight, eps)), qkv /
    o_proj / gate_up / down_proj (PackedLinear) and scaling; `norm` the final (weight, eps), `head`
    the LM head's PackedLinear."""

    def __init__(
        self,
        library: Library,
        layers: list[dict],
        norm: tuple,
        head: PackedLinear,
        heads: int,
        kv_heads: int,
        dim: int,
    ):
        self.library, self.layers, self.norm, self.head = library, layers, norm, head
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.width, self.intermediate = head.k, layers[0]["down_proj"].k
        self.table = None

    def start(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        rows: int,
        shared: list[Shared] | None = None,
    ) -> None:
        """Point each layer at its key/value buffers (rows x kv_heads x total x dim; after the
        prompts' `shared` ones where given, see `attention`) and allocate the scratch; buffers that
        are not fp32 on the CPU leave the step unset (`table` None: the caller steps module by
        module)."""
        self.table = None
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (*keys, *values)):
            return
        for k, v in zip(keys, values):
            _checked_buffers(k, v)
        self.shared = shared
        self.prompt, self.positions = _shared_arguments(shared[0] if shared else None, rows)[2:]
        self.table = (self.library.Layer * len(self.layers))()
        for number, (entry, layer, k, v) in enumerate(zip(self.table, self.layers, keys, values)):
            entry.shared_keys, entry.shared_values = _shared_arguments(
                shared[number] if shared else None, rows
            )[:2]
            (norm1, eps1), (norm2, eps2) = layer["norm1"], layer["norm2"]
            entry.norm1, entry.norm2 = norm1.data_ptr(), norm2.data_ptr()
            entry.eps1, entry.eps2 = eps1, eps2
            for name in ("qkv", "o", "gate_up", "down"):
                linear = layer["o_proj" if name == "o" else "down_proj" if name == "down" else name]
                setattr(entry, name, linear.packed.data_ptr())
                setattr(entry, f"{name}_bias", _address(linear.bias))
            entry.keys, entry.values, entry.scale = k.data_ptr(), v.data_ptr(), layer["scaling"]
        self.total = keys[0].size(2)
        self.keep = (keys, values)  # (the table holds their addresses)
        new = functools.partial(torch.empty, dtype=torch.float32)
        self.scratch = [
            new(rows, self.width),
            new(rows, (self.heads + 2 * self.kv_heads) * self.dim),
            new(rows, self.heads * self.dim),
            new(rows, 2 * self.intermediate),
            new(rows, self.intermediate),
        ]

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        at: int,
    ) -> torch.Tensor:
        """hidden (rows, 1, width): the tokens' embeddings; cos / sin (rows, 1, dim) at their
        positions; mask (rows, ..., shared positions + total) with 0 up to the shared ones + `at`
        where a row attends -> logits (rows, vocab)."""
        return self._run(hidden, cos, sin, mask, at, None, self.scratch)

    def prompt_tokens(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        at: int,
        row_of: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor | None:
        """Several prompt tokens per row through the model at once (rloo.engine.prompt_steps):
        hidden (rows, tokens, width) their embeddings, at positions at..at + tokens - 1 of the rows'
        buffers (row i's buffer row row_of[i]: int32, or i); cos / sin (rows, tokens, dim); the mask
        as for a step, its 0s at the tokens' positions already set (a token at a position its row
        masks attends to nothing) -> the logits of each row's last token (rows, vocab); not computed
        without `head` (None)."""
        rows, tokens = hidden.shape[:2]
        if row_of is not None and (
            row_of.dtype != torch.int32 or not row_of.is_contiguous() or row_of.numel() != rows
        ):
            raise ValueError(f"decode step: row_of must be {rows} contiguous int32 buffer rows")
        _checked_position(at + tokens - 1, self.total)
        new = functools.partial(torch.empty, dtype=torch.float32)
        scratch = [
            new(rows * tokens, size)
            for size in (
                self.width,
                (self.heads + 2 * self.kv_heads) * self.dim,
                self.heads * self.dim,
                2 * self.intermediate,
                self.intermediate,
            )
        ]
        return self._run(hidden, cos, sin, mask, at, row_of, scratch, head)

    def _run(
        self, hidden, cos, sin, mask, at, row_of, scratch, head: bool = True
    ) -> torch.Tensor | None:
        rows, tokens = hidden.shape[:2]
        _checked_position(at, self.total)
        # (the step's own: written in place)
        hidden = hidden.reshape(rows * tokens, self.width).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        logits = hidden.new_empty(rows, self.head.n) if head else None
        weight, eps = self.norm
        normed, qkv, attended, gate_up, act = (t.data_ptr() for t in scratch)
        self.library.decode_step(
            layers=ctypes.addressof(self.table),
            count=len(self.layers),
            final_norm=weight.data_ptr(),
            final_eps=eps,
            head=self.head.packed.data_ptr(),
            head_bias=_address(self.head.bias),
            hidden=hidden.data_ptr(),
            logits=_address(logits),
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            mask=mask.data_ptr(),
            normed=normed,
            qkv=qkv,
            attended=attended,
            gate_up=gate_up,
            act=act,
            rows=rows,
            width=self.width,
            heads=self.heads,
            kv_heads=self.kv_heads,
            dim=self.dim,
            intermediate=self.intermediate,
            vocab=self.head.n,
            total=self.total,
            at=at,
            prompt=self.prompt,
            shared=self.positions,
            threads=torch.get_num_threads(),
            tokens=tokens,
            row_of=_address(row_of),
        )
        return logits


def draw(
    library: Library, scores: torch.Tensor, banned: list[int], uniform: torch.Tensor
) -> torch.Tensor:
    """The C `draw`: one token per row of `scores` (rows, vocab; fp32 on the CPU) from
    softmax(scores) with the `banned` columns at -inf, by inverse CDF against `uniform` (rows, 1;
    float64 in [0, 1)); -1 for a row with a NaN, no finite largest score or no positive finite total
    (the caller's torch path for those)."""
    scores = scores.contiguous()
    rows, vocab = scores.shape
    if (
        scores.dtype != torch.float32
        or scores.device.type != "cpu"
        or uniform.dtype != torch.float64
        or uniform.numel() != rows
    ):
        raise ValueError(
            f"draw: fp32 CPU scores and {rows} float64 uniforms, got {scores.dtype} on "
            f"{scores.device.type} and {uniform.dtype} x {uniform.numel()}"
        )
    uniform = uniform.contiguous()
    columns = (ctypes.c_int * max(1, len(banned)))(*banned)
    tokens = torch.empty(rows, dtype=torch.long)
    library.draw(
        scores=scores.data_ptr(),
        rows=rows,
        vocab=vocab,
        banned=columns,
        count=len(banned),
        uniform=uniform.data_ptr(),
        tokens=tokens.data_ptr(),
        threads=torch.get_num_threads(),
    )
    return tokens
