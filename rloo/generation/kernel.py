"""Two kernels of our own for the written-out decode step (rloo.generation.decode), fp32 on the CPU.

`linear`: y = x W^T (+ bias) for a few rows. The weight is packed once per generation call into blocks of NB output
columns x K (NB = one vector register's floats), read as three sequential streams at a time; x's rows go in groups
of 8, every weight vector loaded once per group and used for all of its rows; the column blocks are shared out among
torch's own OpenMP threads (the library links the libgomp torch loaded: one thread pool, not two competing for the
cores). Each output is one sum over K in order: equal to F.linear up to float rounding.
`attend`: a step's rotary embedding, key/value write and attention over the written positions, one call per layer,
parallel over rows x key/value heads: equal to the model's attention up to float rounding.

C, compiled once per machine and source by the system's gcc (-O3 -march=native, OpenMP) into the kernels folder of
rloo.assets.cache_root (~/.cache/rloo or $RLOO_CACHE) and loaded with ctypes. The decode step takes it only where
the CPU has AVX-512 (`for_decoding`): there, on 2 cores of an Intel Xeon, SmolLM2's 121 matmuls of a decode step
took 18.7 ms at 8 rows against oneDNN's 28.9 (42.3 vs 48.4 at 32 rows), and the rest of the step 7.5 -> 3.5 ms.
Without AVX-512 (not measured on such a CPU), without gcc, or off Linux on x86-64, the step keeps oneDNN's GEMM and
torch's attention."""

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
from typing import Callable

import torch

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#define NB 16
#define MR 8
#else
#define NB 8
#define MR 4
#endif
#define S 3
typedef float vec __attribute__((vector_size(NB * 4)));

int vector_floats(void) { return NB; }
int block_columns(void) { return NB * S; }

/* w [n][k] -> p [n_pad / NB][k][NB]; columns past n are 0 */
void pack(const float *w, float *p, int n, int k, int n_pad, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int nb = 0; nb < n_pad / NB; nb++)
        for (int kk = 0; kk < k; kk++)
            for (int j = 0; j < NB; j++) {
                int row = nb * NB + j;
                p[((size_t)nb * k + kk) * NB + j] = row < n ? w[(size_t)row * k + kk] : 0.0f;
            }
}

static void store(float *y, const vec *acc, const float *bias, int n, int col) {
    float sums[NB];
    memcpy(sums, acc, sizeof(sums));
    for (int j = 0; j < NB && col + j < n; j++) y[col + j] = sums[j] + (bias ? bias[col + j] : 0.0f);
}

/* y [m][n] = x [m][k] . w [n][k] (+ bias [n]), w packed by `pack` */
void linear(const float *x, const float *p, const float *bias, float *y, int m, int n, int k, int n_pad,
            int threads) {
    int groups = n_pad / (NB * S);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < groups; g++) {
        const vec *w[S];
        for (int s = 0; s < S; s++) w[s] = (const vec *)(p + (size_t)(g * S + s) * k * NB);
        for (int r0 = 0; r0 < m; r0 += MR) {
            const float *xr = x + (size_t)r0 * k;
            int rows = m - r0 < MR ? m - r0 : MR;
            vec acc[MR][S];
            memset(acc, 0, sizeof(acc));
            if (rows == MR) {
                for (int kk = 0; kk < k; kk++) {
                    vec wv[S];
#pragma GCC unroll 4
                    for (int s = 0; s < S; s++) wv[s] = w[s][kk];
#pragma GCC unroll 8
                    for (int i = 0; i < MR; i++) {
                        float xv = xr[(size_t)i * k + kk];
#pragma GCC unroll 4
                        for (int s = 0; s < S; s++) acc[i][s] += xv * wv[s];
                    }
                }
            } else {
                for (int i = 0; i < rows; i++)
                    for (int kk = 0; kk < k; kk++) {
                        float xv = xr[(size_t)i * k + kk];
                        for (int s = 0; s < S; s++) acc[i][s] += xv * w[s][kk];
                    }
            }
            for (int i = 0; i < rows; i++)
                for (int s = 0; s < S; s++) store(y + (size_t)(r0 + i) * n, &acc[i][s], bias, n, (g * S + s) * NB);
        }
    }
}

/* x * cos + rotate_half(x) * sin, rotate_half(x) = (-second half, first half) */
static void rotate(const float *x, const float *cos, const float *sin, float *out, int dim) {
    int half = dim / 2;
    for (int i = 0; i < half; i++) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
    for (int i = half; i < dim; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

static float total_of(vec v) {  /* pairwise: a chain of log2(NB) additions, not NB */
    float lanes[NB];
    memcpy(lanes, &v, sizeof(lanes));
    for (int width = NB / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) lanes[j] += lanes[j + width];
    return lanes[0];
}

/* One decode step's attention: qkv [rows][heads + 2 kv_heads][dim] (the projections), cos / sin [rows][dim] at
   this step's positions; the rotated key and the value are written at position `at` of keys / values [rows][kv_heads]
   [total][dim]; out [rows][heads][dim] = softmax((q . k) * scale + mask) v over positions 0..at, mask [rows][total]
   (0 or -inf); query head h uses key/value head h / (heads / kv_heads). dim a multiple of NB, at most 512. */
void attend(const float *qkv, const float *cos, const float *sin, float *keys, float *values, const float *mask,
            float *out, int rows, int heads, int kv_heads, int dim, int total, int at, float scale, int threads) {
    int groups = heads / kv_heads, width = (heads + 2 * kv_heads) * dim, chunks = dim / NB;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int task = 0; task < rows * kv_heads; task++) {
        int r = task / kv_heads, h = task % kv_heads;
        const float *row = qkv + (size_t)r * width, *c = cos + (size_t)r * dim, *s = sin + (size_t)r * dim;
        float *k = keys + ((size_t)r * kv_heads + h) * total * dim;
        float *v = values + ((size_t)r * kv_heads + h) * total * dim;
        rotate(row + (size_t)(heads + h) * dim, c, s, k + (size_t)at * dim, dim);
        memcpy(v + (size_t)at * dim, row + (size_t)(heads + kv_heads + h) * dim, dim * sizeof(float));
        const float *m = mask + (size_t)r * total;
        float *scores = malloc(sizeof(float) * (size_t)groups * (at + 1));
        for (int g = 0; g < groups; g++) {
            vec q[512 / NB], acc[512 / NB];
            rotate(row + (size_t)(h * groups + g) * dim, c, s, (float *)q, dim);
            float *sc = scores + (size_t)g * (at + 1), top = -INFINITY, sum = 0.0f;
            for (int j = 0; j <= at; j++) {
                const vec *kj = (const vec *)(k + (size_t)j * dim);
                vec dot = {0};
                for (int i = 0; i < chunks; i++) dot += q[i] * kj[i];
                sc[j] = total_of(dot) * scale + m[j];
                if (sc[j] > top) top = sc[j];
            }
            for (int j = 0; j <= at; j++) { sc[j] = expf(sc[j] - top); sum += sc[j]; }
            for (int i = 0; i < chunks; i++) acc[i] = (vec){0};
            for (int j = 0; j <= at; j++) {
                const vec *vj = (const vec *)(v + (size_t)j * dim);
                float p = sc[j] / sum;
                for (int i = 0; i < chunks; i++) acc[i] += p * vj[i];
            }
            memcpy(out + ((size_t)r * heads + h * groups + g) * dim, acc, dim * sizeof(float));
        }
        free(scores);
    }
}
"""


@functools.cache
def compiled() -> ctypes.CDLL | None:
    """The library for this machine (built on first use, then from the cache), or None where it cannot be built
    here: not Linux on x86-64, no gcc, or the build failed (logged)."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if platform.system() != "Linux" or platform.machine() != "x86_64" or compiler is None:
        return None
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", f"-Wl,-rpath,{torch_lib}", "-lm"]
    key = hashlib.sha256("\n".join([SOURCE, compiler, torch_lib, *flags]).encode()).hexdigest()[:16]
    cpu = hashlib.sha256(_cpu_flags().encode()).hexdigest()[:8]  # (-march=native: one build per CPU model)
    from rloo.assets import cache_root
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
            done = subprocess.run([compiler, *flags, source, "-o", built], capture_output=True, text=True)
            if done.returncode != 0:
                logger.info("decode GEMM not built (%s); the decode step uses oneDNN's: %s", compiler,
                            done.stderr.strip()[-500:])
                return None
            os.replace(built, path)  # (atomic: another process never loads half a file)
    library = ctypes.CDLL(path)
    library.pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 4
    library.linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    library.attend.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    library.pack.restype = library.linear.restype = library.attend.restype = None
    return library


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            return next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return ""


def for_decoding() -> ctypes.CDLL | None:
    """The library where the decode step should use it: built, and built for AVX-512 (16 floats a vector)."""
    library = compiled()
    return library if library is not None and library.vector_floats() == 16 else None


def packed_linear(library: ctypes.CDLL, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> F.linear(x, weight, bias) for fp32 inputs on the CPU (any number of rows; `rows` is the kernel
    interface's), the weight packed now."""
    n, k = weight.shape
    block = library.block_columns()
    padded = -(-n // block) * block
    source = weight.detach().contiguous()
    packed = torch.empty(padded * k, dtype=torch.float32)
    library.pack(source.data_ptr(), packed.data_ptr(), n, k, padded, torch.get_num_threads())
    bias = None if bias is None else bias.detach().contiguous()

    def linear(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.size(-1) != k:
            raise ValueError(f"decode GEMM: expected fp32 inputs of {k} features, got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], n)
        library.linear(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                       x.numel() // k, n, k, padded, torch.get_num_threads())
        return out
    return linear


def attention(library: ctypes.CDLL, heads: int, kv_heads: int, dim: int) -> Callable | None:
    """(projected, cos, sin, keys, values, mask, at, scale) -> attended (rows, 1, heads x dim): the decode step's rotary
    embedding, key/value write at position `at` and attention (the C `attend`) for fp32 tensors laid out as
    rloo.generation.decode.LeanDecoder keeps them; None where its shapes are not ones it takes (dim a multiple of
    the vector's floats, at most 512)."""
    if dim % library.vector_floats() or dim > 512 or heads % kv_heads:
        return None

    def attend(projected, cos, sin, keys, values, mask, at: int, scale: float) -> torch.Tensor:
        rows = projected.size(0)
        if (keys.data_ptr() | values.data_ptr()) % 64 or not (keys.is_contiguous() and values.is_contiguous()):
            raise ValueError("decode attention: key/value buffers must be contiguous and 64-byte aligned")
        out = projected.new_empty(rows, 1, heads * dim)
        cos, sin = cos.contiguous(), sin.contiguous()
        library.attend(projected.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
                       mask.data_ptr(), out.data_ptr(), rows, heads, kv_heads, dim, keys.size(2), at, scale,
                       torch.get_num_threads())
        return out
    return attend
