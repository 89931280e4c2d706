/* The decode step's kernels and the token draw (rloo.engine.kernel builds this file with gcc -O3
   -march=native -fopenmp and loads it with ctypes): fp32, one new token per row, parallel over the
   OpenMP threads of the torch that loaded it. */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#ifdef __AVX512F__
#define NB 16
#define MR 8
#else
#define NB 8
#define MR 4
#endif
#define S 3
#define AHEAD 32  /* weight vectors prefetched ahead in each stream */
typedef float vec __attribute__((vector_size(NB * 4)));
typedef int ivec __attribute__((vector_size(NB * 4)));

int vector_floats(void) { return NB; }
#if defined(__AVX2__) && defined(__FMA__)
int fused(void) { return 1; }  /* 8-float vectors in ymm registers, multiply-adds fused */
#else
int fused(void) { return 0; }
#endif
int block_columns(void) { return NB * S; }
/* Which kernel.c this library was built from (rloo.engine.binding.source_id, passed by the build)
 */
unsigned long long source_id(void) { return RLOO_SOURCE_ID; }

static int padded(int n) { return (n + NB * S - 1) / (NB * S) * (NB * S); }

/* The weights of `count` segments side by side (segment s: ns[s] rows of k floats at ws[s]; n rows
   in all) -> p [n_pad / NB][k][NB]; columns past n are 0 */
void pack(const float *const *ws, const int *ns, int count, float *p, int k, int n_pad,
          int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int nb = 0; nb < n_pad / NB; nb++) {
        const float *rows[NB];
        for (int j = 0; j < NB; j++) {
            int row = nb * NB + j, s = 0;
            while (s < count && row >= ns[s]) row -= ns[s++];
            rows[j] = s < count ? ws[s] + (size_t)row * k : NULL;
        }
        float *block = p + (size_t)nb * k * NB;
        for (int kk = 0; kk < k; kk++)
            for (int j = 0; j < NB; j++) block[(size_t)kk * NB + j] = rows[j] ? rows[j][kk] : 0.0f;
    }
}

/* y[col + j] = (residual[col + j] +) (sum + bias[col + j]), the sums of one block of columns: as
   one vector where the block lies inside the n columns (faster than lane by lane) */
static inline void store(float *y, const vec *acc, const float *bias, const float *residual, int n,
                         int col) {
    if (col + NB <= n) {
        vec value = *acc, other;
        if (bias) {
            memcpy(&other, bias + col, sizeof(other));
            value += other;
        }
        if (residual) {
            memcpy(&other, residual + col, sizeof(other));
            value = other + value;
        }
        memcpy(y + col, &value, sizeof(value));
        return;
    }
    float sums[NB];
    memcpy(sums, acc, sizeof(sums));
    for (int j = 0; j < NB && col + j < n; j++) {
        float value = sums[j] + (bias ? bias[col + j] : 0.0f);
        y[col + j] = residual ? residual[col + j] + value : value;
    }
}

/* acc[i][s] = the sums over k of x row i's entries times the weight vectors of stream s, for MR
   rows at xr. Each weight vector prefetched AHEAD vectors on in its stream, or, given `next`,
   `lines` cache lines a step from `next` on into L2 instead (k x lines in all). Inlined at each
   call with `next` NULL or not and `lines` a constant: no branch in the loop. */
static inline __attribute__((always_inline)) void rows_block(const vec *const *w, const float *xr,
                                                             int k, vec acc[MR][S],
                                                             const char *next, int lines) {
    for (int kk = 0; kk < k; kk++) {
        vec wv[S];
#pragma GCC unroll 4
        for (int s = 0; s < S; s++) {
            wv[s] = w[s][kk];
            if (!next) __builtin_prefetch(&w[s][kk + AHEAD]);
            else if (s < lines)
                __builtin_prefetch(next + ((size_t)kk * lines + s) * sizeof(vec), 0, 2);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            float xv = xr[(size_t)i * k + kk];
#pragma GCC unroll 4
            for (int s = 0; s < S; s++) acc[i][s] += xv * wv[s];
        }
    }
}

/* [first, last): this thread's share of `count` iterations, as OpenMP's static schedule gives it */
static void share(int count, int *first, int *last) {
    int t = omp_get_thread_num(), threads = omp_get_num_threads(), q = count / threads,
        r = count % threads;
    *first = t * q + (t < r ? t : r);
    *last = *first + q + (t < r);
}

/* Inside a parallel region: y [m][n] = x [m][k] . w [n][k] (+ bias [n]) (+ residual [m][n], which
   may be y itself), w packed by `pack`; the column blocks shared out among the threads, every
   weight vector loaded once per group of MR rows. Where there are more than MR rows, the passes of
   the second to the (S + 1)th group of rows over a block's weights (in cache after the first) bring
   the next block's into L2, spread evenly over them, so that its first pass does not wait for
   memory; after a thread's last block, its first block of the GEMM `then` (then_n x then_k, packed
   as p is; NULL: none; k x S lines of it, so past that block where then_k < k: a prefetch never
   faults). */
static void gemm_then(const float *x, const float *p, const float *bias, const float *residual,
                      float *y, int m, int n, int k, const float *then, int then_n, int then_k) {
    int first, last, then_first, then_last;
    share(padded(n) / (NB * S), &first, &last);
    share(padded(then_n) / (NB * S), &then_first, &then_last);
    const char *after = then ? (const char *)(then + (size_t)then_first * S * then_k * NB) : NULL;
    int passes = m / MR - 1 < S ? m / MR - 1 : S,
        lines = passes > 0 ? (S + passes - 1) / passes : 0;
    for (int g = first; g < last; g++) {
        const vec *w[S];
        for (int s = 0; s < S; s++) w[s] = (const vec *)(p + (size_t)(g * S + s) * k * NB);
        const char *next = g + 1 < last ? (const char *)(p + (size_t)(g + 1) * S * k * NB) : after;
        for (int r0 = 0; r0 < m; r0 += MR) {
            const float *xr = x + (size_t)r0 * k;
            int rows = m - r0 < MR ? m - r0 : MR, pass = r0 / MR;
            vec acc[MR][S];
            memset(acc, 0, sizeof(acc));
            if (rows == MR && pass >= 1 && pass <= passes && next) {
                const char *from = next + (size_t)(pass - 1) * k * lines * sizeof(vec);
                if (lines == 1) rows_block(w, xr, k, acc, from, 1);
                else if (lines == 2) rows_block(w, xr, k, acc, from, 2);
                else rows_block(w, xr, k, acc, from, S);
            } else if (rows == MR)
                rows_block(w, xr, k, acc, NULL, 0);
            else {
                for (int i = 0; i < rows; i++)
                    for (int kk = 0; kk < k; kk++) {
                        float xv = xr[(size_t)i * k + kk];
                        for (int s = 0; s < S; s++) acc[i][s] += xv * w[s][kk];
                    }
            }
            for (int i = 0; i < rows; i++)
                for (int s = 0; s < S; s++)
                    store(y + (size_t)(r0 + i) * n, &acc[i][s], bias,
                          residual ? residual + (size_t)(r0 + i) * n : NULL, n, (g * S + s) * NB);
        }
    }
    #pragma omp barrier
}

static void gemm(const float *x, const float *p, const float *bias, const float *residual, float *y,
                 int m, int n, int k) {
    gemm_then(x, p, bias, residual, y, m, n, k, NULL, 0, 0);
}

/* y [m][n] = x [m][k] . w [n][k] (+ bias [n]), w packed by `pack` with n_pad = padded(n) */
void linear(const float *x, const float *p, const float *bias, float *y, int m, int n, int k,
            int threads) {
#pragma omp parallel num_threads(threads)
    gemm(x, p, bias, NULL, y, m, n, k);
}

/* x * cos + rotate_half(x) * sin, rotate_half(x) = (-second half, first half) */
static void rotate(const float *x, const float *cos, const float *sin, float *out, int dim) {
    int half = dim / 2;
    for (int i = 0; i < half; i++) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
    for (int i = half; i < dim; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/* Shuffle masks of the pairwise trees below, one per level (width w = NB / 2, NB / 4, ..., 1):
   fold[level] takes lane x / w * 2 w + x % w of two vectors side by side (0..2 NB: a's lanes, then
   b's), fold[level] + w the lane w further on */
#if NB == 16
static const ivec fold[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                             {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                             {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                             {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
#else
static const ivec fold[3] = {
        {0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 4, 5, 8, 9, 12, 13}, {0, 2, 4, 6, 8, 10, 12, 14}};
#endif
#define LEVELS (NB == 16 ? 4 : 3)

static float
total_of(vec v) { /* pairwise: lane j + lane j + NB / 2, then j + NB / 4, ..., in registers */
    for (int level = 0, width = NB / 2; level < LEVELS; level++, width /= 2)
        v += __builtin_shuffle(v, v, fold[level] + width);
    return v[0];
}

/* Lane t: the total of d[t]'s lanes, for t < NB, by the same tree as total_of (bit for bit), run on
   NB vectors at once: at each level pairs of vectors fold into one, every position's share of the
   lanes halved */
static inline __attribute__((always_inline)) vec totals_of(vec *d) {
#pragma GCC unroll 4
    for (int level = 0, count = NB, width = NB / 2; level < LEVELS; level++, count /= 2, width /= 2)
#pragma GCC unroll 8
        for (int i = 0; i < count / 2; i++)
            d[i] = __builtin_shuffle(d[2 * i], d[2 * i + 1], fold[level]) +
                   __builtin_shuffle(d[2 * i], d[2 * i + 1], fold[level] + width);
    return d[0];
}

static float largest_of(vec v) {
    float lanes[NB], top = -INFINITY;
    memcpy(lanes, &v, sizeof(lanes));
    for (int j = 0; j < NB; j++) top = lanes[j] > top ? lanes[j] : top;
    return top;
}

static vec pick(ivec where, vec yes, vec no) {
    return (vec)(((ivec)yes & where) | ((ivec)no & ~where));
}

/* e^x lane by lane for x <= 0 (a softmax's shifted scores): Cephes' expf (a degree-6 polynomial on
   x - n ln 2, then 2^n into the exponent), within a few ulp of expf; below -86 (e^-86 ~ 4e-38) and
   -inf -> 0 */
static vec exp_of(vec x) {
    const vec zero = {0}, low = zero - 86.0f,
              big = zero + 12582912.0f; /* 1.5 x 2^23: adding it rounds to integers */
    ivec kept = x >= low;
    x = pick(kept, x, low);
    vec n = (x * 1.44269504088896341f + big) - big;
    vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vec y = ((((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r +
                4.1665795894e-2f) *
                       r +
               1.6666665459e-1f) *
                      r +
              5.0000001201e-1f) *
                     r * r +
             r) +
            1.0f;
    ivec scaled = (ivec)y + (__builtin_convertvector(n, ivec) << 23);
    return pick(kept, (vec)scaled, zero);
}

/* Prefetches `count` positions of `dim` floats from `from` on, a cache line (16 floats) at a time
 */
static inline void prefetch(const float *from, int count, int dim) {
    for (int i = 0; i < count * dim; i += 16) __builtin_prefetch(from + i, 0, 1);
}

/* The scores of `count` positions: scores[g][j] = (q_g . k_j) * scale + mask[j] for the keys at k,
   j from 0; NB positions at a time (their totals in one tree: totals_of), the rest one by one. The
   next NB keys prefetched, and the same positions of `also` (the values read next: memory busy
   while the keys' products run). */
static void score(const vec *q, const float *k, const float *mask, float *scores, int count,
                  int groups, int chunks, int stride, int dim, float scale, const float *also) {
    int j = 0;
    for (; j + NB <= count; j += NB) {
        prefetch(k + (size_t)(j + NB) * dim, NB, dim);
        prefetch(also + (size_t)j * dim, NB, dim);
        for (int g = 0; g < groups; g++) {
            vec d[NB];
#pragma GCC unroll 16
            for (int t = 0; t < NB; t++) {
                const vec *kj = (const vec *)(k + (size_t)(j + t) * dim);
                vec dot = {0};
                for (int i = 0; i < chunks; i++) dot += q[g * chunks + i] * kj[i];
                d[t] = dot;
            }
            vec m, s = totals_of(d);
            memcpy(&m, mask + j, sizeof(m));
            s = s * scale + m;
            memcpy(scores + (size_t)g * stride + j, &s, sizeof(s));
        }
    }
    prefetch(also + (size_t)j * dim, count - j, dim);
    for (; j < count; j++) {
        const vec *kj = (const vec *)(k + (size_t)j * dim);
        for (int g = 0; g < groups; g++) {
            vec dot = {0};
            for (int i = 0; i < chunks; i++) dot += q[g * chunks + i] * kj[i];
            scores[(size_t)g * stride + j] = total_of(dot) * scale + mask[j];
        }
    }
}

/* acc_g += p_gj v_j over `count` positions: the softmax's weights p at weights [groups][stride],
   the values at v; TILE of the groups x chunks sums at a time in registers; the values 8 positions
   ahead prefetched, and position j of `also` (the next task's keys) */
#define TILE 6
static void weigh(vec *acc, const float *v, const float *weights, int count, int groups, int chunks,
                  int stride, int dim, const float *also) {
    for (int e0 = 0; e0 < groups * chunks; e0 += TILE) {
        const float *p[TILE];
        int chunk[TILE], n = groups * chunks - e0 < TILE ? groups * chunks - e0 : TILE;
        vec a[TILE];
        for (int t = 0; t < TILE; t++) {
            int e = e0 +
                    (t < n ? t : 0); /* (past the last sum: the tile's first again, not kept) */
            p[t] = weights + (size_t)(e / chunks) * stride;
            chunk[t] = e % chunks;
            a[t] = acc[e];
        }
        for (int j = 0; j < count; j++) {
            const vec *vj = (const vec *)(v + (size_t)j * dim);
            if (e0 == 0) {
                prefetch(v + (size_t)(j + 8) * dim, 1, dim);
                prefetch(also + (size_t)j * dim, 1, dim);
            }
#pragma GCC unroll 8
            for (int t = 0; t < TILE; t++) a[t] += p[t][j] * vj[chunk[t]];
        }
        for (int t = 0; t < n; t++) acc[e0 + t] = a[t];
    }
}

/* Inside a parallel region, the attention of `tokens` new tokens per row (a decode step: 1; the
   prompts' tokens in steps of several: rloo.engine.prompt_steps): qkv [rows][tokens][heads + 2
   kv_heads][dim] (the projections), cos / sin [rows][tokens][dim] at their positions; token t's
   rotated key and its value are written at position at + t of keys / values [buffer
   rows][kv_heads][total][dim], the buffer row of row i being row_of[i] (NULL: i); out
   [rows][tokens][heads][dim] = softmax((q . k) * scale + mask) v over the row's positions up to the
   token's: first the `shared` positions of its prompt's keys / values
   [prompts][kv_heads][shared][dim] (prompt[buffer row]; the rows of one prompt read the same ones),
   then 0..at + t of its own; mask [buffer rows][shared + total] (0 or -inf). A token of several at
   a position its row masks (left padding) attends to nothing: out 0. Query head h uses key/value
   head h / (heads / kv_heads). dim a multiple of NB, at most 512. Parallel over rows x key/value
   heads (rows of one prompt next to each other: its keys and values stay in the cache for them);
   each key and value is loaded once per token for all the query heads that read it, the softmax
   runs NB positions at a time. */
static void attention(const float *qkv, const float *cos, const float *sin,
                      const float *shared_keys, const float *shared_values, const int *prompt,
                      int shared, float *keys, float *values, const float *mask, float *out,
                      int rows, int tokens, const int *row_of, int heads, int kv_heads, int dim,
                      int total, int at, float scale) {
    int groups = heads / kv_heads, width = (heads + 2 * kv_heads) * dim, chunks = dim / NB;
    int most = shared + at + tokens, stride = (most + NB - 1) / NB * NB;
    #pragma omp for schedule(static)
    for (int task = 0; task < rows * kv_heads; task++) {
        int i = task / kv_heads, h = task % kv_heads, r = row_of ? row_of[i] : i;
        float *k = keys + ((size_t)r * kv_heads + h) * total * dim;
        float *v = values + ((size_t)r * kv_heads + h) * total * dim;
        size_t from = shared ? ((size_t)prompt[r] * kv_heads + h) * shared * dim : 0;
        int ni = (task + 1) / kv_heads < rows ? (task + 1) / kv_heads : i,
            nh = (task + 1) % kv_heads;
        int nr = row_of ? row_of[ni] : ni;  /* the next task's row (this thread's, mostly) */
        const float *next = keys + ((size_t)nr * kv_heads + nh) * total * dim;
        size_t next_from = shared ? ((size_t)prompt[nr] * kv_heads + nh) * shared * dim : 0;
        for (int t = 0; t < tokens; t++) {
            size_t token = (size_t)i * tokens + t;
            const float *row = qkv + token * width, *c = cos + token * dim, *s = sin + token * dim;
            rotate(row + (size_t)(heads + h) * dim, c, s, k + (size_t)(at + t) * dim, dim);
            memcpy(v + (size_t)(at + t) * dim, row + (size_t)(heads + kv_heads + h) * dim,
                   dim * sizeof(float));
        }
        const float *m = mask + (size_t)r * (shared + total);
        int f = 0; /* the row's first own position it attends to: the left padding before it is not
                      read */
        while (f < at && m[shared + f] == -INFINITY) f++;
        vec q[groups * chunks], acc[groups * chunks];
        float local[4096]
                __attribute__((aligned(64))); /* (the scores on the stack where they fit) */
        float *scores = (size_t)groups * stride <= 4096
                                ? local
                                : aligned_alloc(64, sizeof(float) * groups * stride);
        for (int t = 0; t < tokens; t++) {
            size_t token = (size_t)i * tokens + t;
            float *o = out + (token * heads + h * groups) * dim;
            if (tokens > 1 && m[shared + at + t] == -INFINITY) {
                memset(o, 0, (size_t)groups * dim * sizeof(float));
                continue;
            }
            const float *row = qkv + token * width, *c = cos + token * dim, *s = sin + token * dim;
            int positions = shared + at + t + 1, width_t = (positions + NB - 1) / NB * NB;
            for (int g = 0; g < groups; g++)
                rotate(row + (size_t)(h * groups + g) * dim, c, s, (float *)(q + g * chunks), dim);
            if (shared)
                score(q, shared_keys + from, m, scores, shared, groups, chunks, stride, dim, scale,
                      shared_values + from);
            for (int g = 0; g < groups; g++)
                for (int j = shared; j < shared + f; j++)
                    scores[(size_t)g * stride + j] = -INFINITY;
            score(q, k + (size_t)f * dim, m + shared + f, scores + shared + f, at + t + 1 - f,
                  groups, chunks, stride, dim, scale, v + (size_t)f * dim);
            for (int g = 0; g < groups; g++) {
                vec *sc = (vec *)(scores + (size_t)g * stride), top = {0}, sum = {0};
                for (int j = positions; j < width_t; j++)
                    scores[(size_t)g * stride + j] = -INFINITY;
                top -= INFINITY;
                for (int j = 0; j < width_t / NB; j++) top = pick(sc[j] > top, sc[j], top);
                float largest = largest_of(top);
                for (int j = 0; j < width_t / NB; j++) {
                    sc[j] = exp_of(sc[j] - largest);
                    sum += sc[j];
                }
                vec inverse = (vec){0} + 1.0f / total_of(sum);
                for (int j = 0; j < width_t / NB; j++) sc[j] *= inverse;
            }
            for (int e = 0; e < groups * chunks; e++) acc[e] = (vec){0};
            if (shared)
                weigh(acc, shared_values + from, scores, shared, groups, chunks, stride, dim,
                      shared_keys + next_from);
            weigh(acc, v + (size_t)f * dim, scores + shared + f, at + t + 1 - f, groups, chunks,
                  stride, dim, next);
            memcpy(o, acc, (size_t)groups * dim * sizeof(float));
        }
        if (scores != local) free(scores);
    }
}

void attend(const float *qkv, const float *cos, const float *sin, const float *shared_keys,
            const float *shared_values, const int *prompt, int shared, float *keys, float *values,
            const float *mask, float *out, int rows, int heads, int kv_heads, int dim, int total,
            int at, float scale, int threads) {
#pragma omp parallel num_threads(threads)
    attention(qkv, cos, sin, shared_keys, shared_values, prompt, shared, keys, values, mask, out,
              rows, 1, NULL, heads, kv_heads, dim, total, at, scale);
}

#define BLOCK 256  /* entries per block of the draw (rloo.engine.lean.BLOCK) */
typedef double dvec __attribute__((vector_size(NB * 4)));  /* NB / 2 doubles */

static float exp1(float x) { return exp_of((vec){0} + x)[0]; }  /* exp_of for one number */

static int is_banned(int column, const int *banned, int count) {
    for (int b = 0; b < count; b++)
        if (banned[b] == column) return 1;
    return 0;
}

/* e^(x - top) for one NB-lane vector of scores, 0 at the banned entries (columns from `column` on)
 */
static vec weights_of(vec x, float top, const int *banned, int count, int column) {
    vec e = exp_of(x - top);
    for (int b = 0; b < count; b++)
        if (banned[b] >= column && banned[b] < column + NB) e[banned[b] - column] = 0.0f;
    return e;
}

/* The total of e^(x - top) over scores [from, to) in double, banned entries out; lanes past `to`
 * out */
static double block_total(const float *scores, int from, int to, float top, const int *banned,
                          int count) {
    dvec sum = {0};
    double tail = 0.0;
    int i = from;
    for (; i + NB <= to; i += NB) {
        vec x, e;
        memcpy(&x, scores + i, sizeof(x));
        e = weights_of(x, top, banned, count, i);
        typedef float half __attribute__((vector_size(NB * 2)));
        half low, high;
        memcpy(&low, &e, sizeof(low));
        memcpy(&high, (float *)&e + NB / 2, sizeof(high));
        sum += __builtin_convertvector(low, dvec) + __builtin_convertvector(high, dvec);
    }
    for (; i < to; i++)
        if (!is_banned(i, banned, count)) tail += (double)exp1(scores[i] - top);
    double total = tail;
    for (int j = 0; j < NB / 2; j++) total += sum[j];
    return total;
}

/* One token per row drawn from softmax(scores[r]) with the `banned` columns at -inf: by inverse CDF
   on the unnormalised weights e^(s - max) (float, exp_of; the max over the columns not banned)
   against uniform[r] x their total, in double and two levels, as rloo.engine.lean.sample_from does
   on softmax's probabilities (the same distribution up to float rounding; entries of weight 0 are
   never drawn). tokens[r] = -1 where the row has a NaN, no finite largest score or a total that is
   not a positive finite number (the caller's torch path decides then). */
void draw(const float *scores, int rows, int vocab, const int *banned, int count,
          const double *uniform, long *tokens, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *row = scores + (size_t)r * vocab;
        vec top = (vec){0} - INFINITY;
        ivec nan = {0};
        int i = 0, any_nan = 0;
        for (; i + NB <= vocab; i += NB) {
            vec x;
            memcpy(&x, row + i, sizeof(x));
            top = pick(x > top, x, top);
            nan |= x != x;
        }
        float largest = largest_of(top);
        for (; i < vocab; i++) {
            largest = row[i] > largest ? row[i] : largest;
            any_nan |= row[i] != row[i];
        }
        for (int j = 0; j < NB; j++) any_nan |= nan[j];
        int banned_top = 0;
        for (int b = 0; b < count; b++)
            banned_top |= banned[b] >= 0 && banned[b] < vocab && row[banned[b]] == largest;
        if (banned_top) {  /* (the largest among the rest) */
            largest = -INFINITY;
            for (int j = 0; j < vocab; j++)
                if (!is_banned(j, banned, count) && row[j] > largest) largest = row[j];
        }
        tokens[r] = -1;
        if (!isfinite(largest) || any_nan) continue;
        int blocks = (vocab + BLOCK - 1) / BLOCK;
        double *cumulative = malloc(sizeof(double) * blocks), running = 0.0;
        for (int b = 0; b < blocks; b++) {
            int to = (b + 1) * BLOCK < vocab ? (b + 1) * BLOCK : vocab;
            running += block_total(row, b * BLOCK, to, largest, banned, count);
            cumulative[b] = running;
        }
        double total = running, target = uniform[r] * total;
        if (!(total > 0.0) || !isfinite(total)) { free(cumulative); continue; }
        int chosen = 0;
        while (chosen < blocks - 1 && !(cumulative[chosen] > target)) chosen++;
        while (chosen > 0 && cumulative[chosen] == cumulative[chosen - 1])
            chosen--; /* (rounding: not a 0 block) */
        double before = chosen ? cumulative[chosen - 1] : 0.0, left = target - before, inside = 0.0;
        free(cumulative);
        left = left > 0.0 ? left : 0.0;
        int from = chosen * BLOCK, to = from + BLOCK < vocab ? from + BLOCK : vocab;
        long last = -1;
        for (int j = from; j < to; j++) {
            float e = is_banned(j, banned, count) ? 0.0f : exp1(row[j] - largest);
            if (e > 0.0f) last = j;
            inside += e;
            if (inside > left && e > 0.0f) { tokens[r] = j; break; }
        }
        if (tokens[r] < 0) tokens[r] = last;  /* (rounding: the draw at the block's end) */
    }
}

/* Inside a parallel region: out [rows][dim] = weight * (x * 1 / sqrt(mean(x^2) + eps)), Llama's
   RMSNorm, for the rows every * r + first of x; the squares summed NB lanes at a time (then
   total_of) */
static void rms_norm(const float *x, const float *weight, float *out, int rows, int dim, float eps,
                     int every, int first) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + ((size_t)r * every + first) * dim;
        vec lanes = {0};
        int i = 0;
        for (; i + NB <= dim; i += NB) {
            vec v;
            memcpy(&v, xr + i, sizeof(v));
            lanes += v * v;
        }
        float sum = total_of(lanes);
        for (; i < dim; i++) sum += xr[i] * xr[i];
        float scale = 1.0f / sqrtf(sum / dim + eps);
        for (i = 0; i < dim; i++) out[(size_t)r * dim + i] = weight[i] * (xr[i] * scale);
    }
}

/* Inside a parallel region: out [rows][size] = silu(gate) * up, gate_up [rows][2 size] the two side
   by side; silu(g) = g sigmoid(g), sigmoid from e^-|g| (exp_of, NB lanes at a time): 1 / (1 + e)
   for g >= 0, e / (1 + e) below */
static void silu_times_up(const float *gate_up, float *out, int rows, int size) {
    const vec one = (vec){0} + 1.0f;
    #pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *gate = gate_up + (size_t)r * 2 * size, *up = gate + size;
        float *o = out + (size_t)r * size;
        int i = 0;
        for (; i + NB <= size; i += NB) {
            vec g, u;
            memcpy(&g, gate + i, sizeof(g));
            memcpy(&u, up + i, sizeof(u));
            ivec positive = g >= 0;
            vec e = exp_of(pick(positive, -g, g)), y = g * (pick(positive, one, e) / (one + e)) * u;
            memcpy(o + i, &y, sizeof(y));
        }
        for (; i < size; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* One decoder layer's weights (projections packed by `pack`; biases may be NULL) and key/value
 * buffers */
typedef struct {
    const float *norm1, *qkv, *qkv_bias, *o, *o_bias, *norm2, *gate_up, *gate_up_bias, *down,
            *down_bias;
    float *keys, *values;
    float eps1, eps2, scale;
    const float *shared_keys, *shared_values;
} layer;
int layer_size(void) {
    return (int)sizeof(layer);
} /* checked against the binding's struct at load */

/* A whole decode step of a Llama-family decoder in one parallel region, or a step of `tokens`
   prompt tokens per row: hidden [rows][tokens][width] (the tokens' embeddings; the step's residual
   stream afterwards) through every layer (norm, q/k/v side by side, `attention`, o + residual,
   norm, gate/up side by side, silu(gate) * up, down + residual), the final norm and the LM head of
   each row's last token into logits [rows][vocab] (NULL: not computed); each layer's keys and
   values as `attention` takes them (`shared` positions of prompt[r]'s first, where shared > 0; row
   i's buffer row row_of[i], NULL: i). Scratch, rows x tokens rows each: normed [width], qkv [(heads
   + 2 kv_heads) dim], attended [heads dim], gate_up [2 intermediate], act [intermediate]. */
void decode_step(const layer *layers, int count, const float *final_norm, float final_eps,
                 const float *head, const float *head_bias, float *hidden, float *logits,
                 const float *cos, const float *sin, const float *mask, float *normed, float *qkv,
                 float *attended, float *gate_up, float *act, int rows, int width, int heads,
                 int kv_heads, int dim, int intermediate, int vocab, int total, int at,
                 const int *prompt, int shared, int threads, int tokens, const int *row_of) {
    int projected = (heads + 2 * kv_heads) * dim, m = rows * tokens;
    #pragma omp parallel num_threads(threads)
    {
        for (int l = 0; l < count; l++) {
            const layer *L = layers + l;
            rms_norm(hidden, L->norm1, normed, m, width, L->eps1, 1, 0);
            gemm_then(normed, L->qkv, L->qkv_bias, NULL, qkv, m, projected, width, L->o, width,
                      heads * dim);
            attention(qkv, cos, sin, L->shared_keys, L->shared_values, prompt, shared, L->keys,
                      L->values, mask, attended, rows, tokens, row_of, heads, kv_heads, dim, total,
                      at, L->scale);
            gemm_then(attended, L->o, L->o_bias, hidden, hidden, m, width, heads * dim, L->gate_up,
                      2 * intermediate, width);
            rms_norm(hidden, L->norm2, normed, m, width, L->eps2, 1, 0);
            gemm_then(normed, L->gate_up, L->gate_up_bias, NULL, gate_up, m, 2 * intermediate,
                      width, L->down, width, intermediate);
            silu_times_up(gate_up, act, m, intermediate);
            gemm_then(act, L->down, L->down_bias, hidden, hidden, m, width, intermediate,
                      l + 1 < count ? L[1].qkv
                      : logits      ? head
                                    : NULL,
                      l + 1 < count ? projected : vocab, width);
        }
        if (logits) {
            rms_norm(hidden, final_norm, normed, rows, width, final_eps, tokens, tokens - 1);
            gemm(normed, head, head_bias, NULL, logits, rows, vocab, width);
        }
    }
}
