/* Strata's CPU kernels: the decode step's weight-streaming products, called through ctypes
 * (services/engine/kernels/__init__.py builds this file with the machine's C compiler).
 *
 * Decode at small batch is bound by the bytes of weights it reads. torch runs a single-row
 * product as MKL's gemv on one core and pays a dispatch per expert; these kernels read every
 * weight block a step needs inside one OpenMP parallel region per call (torch's own OpenMP
 * runtime: the library is loaded after torch, so its libgomp is the one in use).
 *
 * Structure: the static *_rows / *_units functions hold orphaned `omp for` loops — inside a
 * parallel region they share the work among its threads, outside one they run on the caller's
 * thread. The exported strata_* functions open one region around one of them;
 * strata_decode_layer runs a whole decoder layer's attention half and its router in one region
 * (a barrier between stages instead of a Python dispatch and a fork/join per op).
 *
 * Shape legend: T rows (tokens), D hidden, F expert FFN, S column splits, K routed per token,
 * E experts of the layer, A = T*K routed (token, expert) assignments.
 *
 * Numerics: every output element is one fp32 dot product, accumulated over the input index in
 * order with a fused multiply-add, starting from zero. A row's result never depends on which
 * other rows share the call, on the tile it falls in, on the thread that computes it, or on
 * the address its weights are read from (a slot or the host store): batch shapes, cache sizes
 * and placements give bit-identical outputs.
 *
 * Weights (the products' W, the experts' blobs, the router, a layer's wqkv / wo / router) are
 * fp32 or bf16 (`wtype`: WT_F32 0, WT_BF16 1; bf16 = the top 16 bits of an fp32). A bf16
 * weight is widened to fp32 exactly (its bits shifted up) right after it is loaded, then the
 * same fp32 FMA sequence runs: the bf16 kernel on w gives bit-identical outputs to the fp32
 * kernel on w widened, and reads half the bytes. Activations, outputs, norm weights, tables,
 * workspaces and KV pools are fp32.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define ABI_VERSION 5
#define WT_F32 0          /* weight types (wtype) */
#define WT_BF16 1
#define WT_Q8_0 2         /* GGUF Q8_0 blocks (strata_moe only; see product_q8_0) */
#define Q8_0_WEIGHTS 32   /* weights per Q8_0 block */
#define Q8_0_BYTES 34     /* bytes per Q8_0 block: an fp16 scale, then 32 int8 quants */
#define TOK_TILE 4        /* rows sharing one pass over a weight block */
#define COL_BLOCK 256     /* the granule (and least width) of strata_linear's work units */
#define K_CHUNK 8         /* inputs per chunk of a decode-size product (see product) */
#define ACC_FLOATS 16384  /* accumulators a chunked product keeps in cache (64 KB) */
#define SHORT_ROW 4096    /* bytes of a W row up to which a chunked product prefetches */
#if TOK_TILE != 4
#error "tile_product_of's register budget assumes TOK_TILE == 4"
#endif

int strata_abi_version(void) { return ABI_VERSION; }

typedef float v16 __attribute__((vector_size(64), aligned(4))); /* 16 floats, unaligned ok */

/* The products' register tiles: a pass keeps NT x NV accumulators of VL floats in vector
 * registers for NT rows (NV_NT vectors each), plus a vector of weights per column vector.
 * AVX-512 has 32 registers of 16 floats; AVX2 16 of 8; the portable fallback assumes 16 of 4.
 * Columns a full pass does not cover run in passes of NV_TAIL vectors, then one by one. The
 * tiles only choose which outputs share a pass, never how one is computed (tile_product_of). */
#if defined(__AVX512F__)
#define VL 16
#define NV_1 16
#define NV_2 8
#define NV_3 4
#define NV_4 4
#define NV_TAIL 4
#elif defined(__AVX2__)
#define VL 8
#define NV_1 8
#define NV_2 4
#define NV_3 3
#define NV_4 2
#define NV_TAIL 2
#else
#define VL 4
#define NV_1 8
#define NV_2 4
#define NV_3 3
#define NV_4 2
#define NV_TAIL 2
#endif
#define NV_MAX 16
typedef float vw __attribute__((vector_size(4 * VL), aligned(4)));    /* VL floats, unaligned ok */
typedef uint16_t vh __attribute__((vector_size(2 * VL), aligned(2))); /* VL bf16 bit patterns */
typedef uint32_t vu __attribute__((vector_size(4 * VL)));

/* Element i of a weight of type wt, as a pointer (an fp32 element is 4 bytes, a bf16 one 2). */
static inline const void *welem(const void *W, int64_t i, int wt)
{
    return (const char *)W + i * (wt == WT_BF16 ? 2 : 4);
}

/* *out = the VL weights at element i of W (type wt, a constant at every call site) as fp32; a
 * bf16 widens exactly: zero-extend to 32 bits, shift up 16. On x86 that is vpmovzxwd from
 * memory + vpslld (GCC 12 splits the generic __builtin_convertvector into halves there). */
static inline __attribute__((always_inline)) void load_w(vw *out, const void *W, int64_t i,
                                                         const int wt)
{
    if (wt != WT_BF16) {
        *out = *(const vw *)((const float *)W + i);
        return;
    }
    const uint16_t *h = (const uint16_t *)W + i;
#if defined(__AVX512F__)
    *out = (vw)_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
#elif defined(__AVX2__)
    *out = (vw)_mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
#else
    *out = (vw)(__builtin_convertvector(*(const vh *)h, vu) << 16);
#endif
}

/* One weight at element i of W (type wt), as fp32. */
static inline __attribute__((always_inline)) float load1(const void *W, int64_t i, const int wt)
{
    if (wt == WT_BF16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)W)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)W)[i];
}

/* One pass over columns [c, c + VL NV) of W for NT rows and the inputs [k0, k1), the NT x NV
 * accumulators in registers (NT, NV, wt and pf are constants at every call site, so the loops
 * unroll): they start from zero at k0 = 0, else from ys, where the pass over [.., k0) left
 * them. With pf, each W row's columns are prefetched K_CHUNK rows (a chunk) ahead. */
static inline __attribute__((always_inline)) void reg_pass(const float *const *xs, const int NT,
                                                           const int NV, const void *W,
                                                           const int wt, const int pf,
                                                           int64_t k0, int64_t k1, int64_t ld,
                                                           int64_t c, float *const *ys)
{
    vw acc[TOK_TILE][NV_MAX];
    for (int t = 0; t < NT; t++)
        for (int q = 0; q < NV; q++)
            if (k0 == 0)
                acc[t][q] = (vw){0};
            else
                memcpy(&acc[t][q], ys[t] + c + VL * q, sizeof(vw));
    for (int64_t i = k0; i < k1; i++) {
        if (pf) { /* a prefetch never faults: past the end of W is harmless */
            const char *ahead = welem(W, (i + K_CHUNK) * ld + c, wt);
            for (int b = 0; b < NV * VL * (wt == WT_BF16 ? 2 : 4); b += 64)
                __builtin_prefetch(ahead + b, 0, 3);
        }
        vw xv[TOK_TILE];
        for (int t = 0; t < NT; t++)
            xv[t] = (vw){0} + xs[t][i];
        for (int q = 0; q < NV; q++) { /* each weight vector used as it is loaded: 1 register */
            vw row;
            load_w(&row, W, i * ld + c + VL * q, wt);
            for (int t = 0; t < NT; t++)
                acc[t][q] += xv[t] * row;
        }
    }
    for (int t = 0; t < NT; t++)
        memcpy(ys[t] + c, acc[t], (size_t)NV * sizeof(vw));
}

/* Columns [0, n) for the inputs [k0, k1) in passes of VL NV; the rest in passes of
 * VL NV_TAIL, then one by one. */
static inline __attribute__((always_inline)) void reg_passes(const float *const *xs,
                                                             const int NT, const int NV,
                                                             const void *W, const int wt,
                                                             const int pf, int64_t k0,
                                                             int64_t k1, int64_t ld, int64_t n,
                                                             float *const *ys)
{
    const int NVT = NV < NV_TAIL ? NV : NV_TAIL;
    int64_t c = 0;
    for (; c + VL * NV <= n; c += VL * NV)
        reg_pass(xs, NT, NV, W, wt, pf, k0, k1, ld, c, ys);
    for (; c + VL * NVT <= n; c += VL * NVT)
        reg_pass(xs, NT, NVT, W, wt, pf, k0, k1, ld, c, ys);
    if (c == n)
        return;
    float acc[TOK_TILE][VL * NV_TAIL];
    for (int t = 0; t < NT; t++)
        if (k0 == 0)
            memset(acc[t], 0, sizeof acc[t]);
        else
            memcpy(acc[t], ys[t] + c, (size_t)(n - c) * sizeof(float));
    for (int64_t i = k0; i < k1; i++) {
        const void *row = welem(W, i * ld + c, wt);
        for (int t = 0; t < NT; t++) {
            const float xi = xs[t][i];
            for (int64_t j = 0; j < n - c; j++)
                acc[t][j] += xi * load1(row, j, wt);
        }
    }
    for (int t = 0; t < NT; t++)
        memcpy(ys[t] + c, acc[t], (size_t)(n - c) * sizeof(float));
}

/* ys[t][0:n] (+)= xs[t][k0:k1] @ W[k0:k1][0:n] (W row stride ld, type wt) for nt <= TOK_TILE
 * rows, with the accumulators in registers: with AVX-512 one row reads up to 256 columns per
 * pass, four rows 64. Every variant computes acc = fma(x[i], W[i][j], acc) for i = k0, k0 + 1,
 * ... from acc = 0 at k0 = 0 (else from ys, exact), a bf16 W[i][j] widened to fp32 first, so
 * the result of a row does not depend on how many rows share the pass. */
static inline __attribute__((always_inline)) void tile_product_of(const float *const *xs,
                                                                  int nt, const void *W,
                                                                  const int wt, const int pf,
                                                                  int64_t k0, int64_t k1,
                                                                  int64_t ld, int64_t n,
                                                                  float *const *ys)
{
    switch (nt) {
    case 1:
        reg_passes(xs, 1, NV_1, W, wt, pf, k0, k1, ld, n, ys);
        break;
    case 2:
        reg_passes(xs, 2, NV_2, W, wt, pf, k0, k1, ld, n, ys);
        break;
    case 3:
        reg_passes(xs, 3, NV_3, W, wt, pf, k0, k1, ld, n, ys);
        break;
    default:
        reg_passes(xs, 4, NV_4, W, wt, pf, k0, k1, ld, n, ys);
        break;
    }
}

/* tile_product_of for each weight type, without and with the software prefetch. */
#define TILE_PRODUCT(name, wt, pf)                                                              \
    static void name(const float *const *xs, int nt, const void *W, int64_t k0, int64_t k1,   \
                     int64_t ld, int64_t n, float *const *ys)                                 \
    {                                                                                         \
        tile_product_of(xs, nt, W, wt, pf, k0, k1, ld, n, ys);                                \
    }
TILE_PRODUCT(tile_product_f32, WT_F32, 0)
TILE_PRODUCT(tile_product_bf16, WT_BF16, 0)
TILE_PRODUCT(tile_product_f32_pf, WT_F32, 1)
TILE_PRODUCT(tile_product_bf16_pf, WT_BF16, 1)
#undef TILE_PRODUCT

/* y[r][0:n] (row stride ldy) = x_r @ W[0:K][0:n] (W row stride ld, type wt) for R rows; x_r is
 * x + r ldx, or x + (xrow[r] / xdiv) ldx (rows gathered by index). The rows run in tiles of
 * TOK_TILE. When the R x n accumulators fit ACC_FLOATS (decode), the inputs run in chunks of
 * K_CHUNK, every tile's passes over a chunk before the next chunk, the accumulators waiting in
 * y (in cache) between chunks: W is then read a few rows' [0, n) at a time, not a pass's few
 * columns of all K rows, then the next pass's (pieces of a row far apart in time: a TLB miss
 * and a cold hardware-prefetch stream each, whatever their size, so bf16 would gain nothing).
 * W rows of up to SHORT_ROW bytes (the experts' matrices, where a chunk spans a few pages the
 * hardware prefetcher follows poorly) are also prefetched in software, a chunk ahead. Else
 * (prefill) one chunk: the accumulators stay in registers. Either way each output is the same
 * FMA sequence (see tile_product_of). */
static void product(const float *x, int64_t ldx, const int64_t *xrow, int64_t xdiv, int64_t R,
                    const void *W, int wt, int64_t K, int64_t ld, int64_t n, float *y,
                    int64_t ldy)
{
    const int64_t kc = R * n <= ACC_FLOATS ? K_CHUNK : K;
    const int pf = kc < K && n * (wt == WT_BF16 ? 2 : 4) <= SHORT_ROW;
    int64_t k0 = 0;
    do { /* at least one chunk: K = 0 writes zeros */
        const int64_t k1 = K - k0 <= kc ? K : k0 + kc;
        for (int64_t r0 = 0; r0 < R; r0 += TOK_TILE) {
            const int nt = R - r0 < TOK_TILE ? (int)(R - r0) : TOK_TILE;
            const float *xs[TOK_TILE];
            float *ys[TOK_TILE];
            for (int t = 0; t < nt; t++) {
                xs[t] = x + (xrow ? xrow[r0 + t] / xdiv : r0 + t) * ldx;
                ys[t] = y + (r0 + t) * ldy;
            }
            if (wt == WT_BF16)
                (pf ? tile_product_bf16_pf : tile_product_bf16)(xs, nt, W, k0, k1, ld, n, ys);
            else
                (pf ? tile_product_f32_pf : tile_product_f32)(xs, nt, W, k0, k1, ld, n, ys);
        }
        k0 = k1;
    } while (k0 < K);
}

typedef int8_t vq8 __attribute__((vector_size(8), aligned(1)));  /* 8 int8 quants */
typedef float vf8 __attribute__((vector_size(32), aligned(4)));  /* 8 floats, unaligned ok */

/* IEEE half -> float, exact (normal, subnormal, zero, inf, nan). */
static inline float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        const float f = (float)man * 0x1p-24f; /* subnormal or zero: exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* y[r][o] = sum over the row's blocks b of d_b * (q_b . x_b) for R rows of x against `out`
 * rows of Q8_0 weights (each `in` weights: in / 32 blocks of an fp16 scale d and 32 int8 q;
 * weight = d * q, as GGUF defines it). The weights stay in their 8.5 bits per weight: each
 * block's quants are widened to floats in registers once for up to TOK_TILE rows. Numerics: a
 * row's dot product runs in 8 lanes, block by block in order (each block's four lane-wise
 * q * x products summed pairwise, scaled by d and accumulated with one FMA, so only that FMA
 * is on the row's dependency chain), the lanes summed last in a fixed tree: the same bits for
 * a row whatever the other rows, the tile, the thread or where the blob lies. */
static void product_q8_0(const float *x, int64_t ldx, const int64_t *xrow, int64_t xdiv,
                         int64_t R, const uint8_t *W, int64_t in, int64_t out, float *y,
                         int64_t ldy)
{
    const int64_t nb = in / Q8_0_WEIGHTS, row_bytes = nb * Q8_0_BYTES;
    for (int64_t r0 = 0; r0 < R; r0 += TOK_TILE) {
        const int nt = R - r0 < TOK_TILE ? (int)(R - r0) : TOK_TILE;
        const float *xs[TOK_TILE];
        for (int t = 0; t < nt; t++)
            xs[t] = x + (xrow ? xrow[r0 + t] / xdiv : r0 + t) * ldx;
        for (int64_t o = 0; o < out; o++) {
            const uint8_t *blk = W + o * row_bytes;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
            __m256 acc[TOK_TILE];
            for (int t = 0; t < nt; t++)
                acc[t] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++, blk += Q8_0_BYTES) {
                uint16_t dh;
                memcpy(&dh, blk, 2);
                const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
                __m256 w[4];
                for (int i = 0; i < 4; i++)
                    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * i))));
                for (int t = 0; t < nt; t++) {
                    const float *xb = xs[t] + b * Q8_0_WEIGHTS;
                    const __m256 s = _mm256_add_ps(
                        _mm256_add_ps(_mm256_mul_ps(w[0], _mm256_loadu_ps(xb)),
                                      _mm256_mul_ps(w[1], _mm256_loadu_ps(xb + 8))),
                        _mm256_add_ps(_mm256_mul_ps(w[2], _mm256_loadu_ps(xb + 16)),
                                      _mm256_mul_ps(w[3], _mm256_loadu_ps(xb + 24))));
                    acc[t] = _mm256_fmadd_ps(d, s, acc[t]);
                }
            }
            for (int t = 0; t < nt; t++) {
                float a[8];
                _mm256_storeu_ps(a, acc[t]);
                y[(r0 + t) * ldy + o] = ((a[0] + a[4]) + (a[1] + a[5])) +
                                        ((a[2] + a[6]) + (a[3] + a[7]));
            }
#else
            vf8 acc[TOK_TILE] = {{0}};
            for (int64_t b = 0; b < nb; b++, blk += Q8_0_BYTES) {
                uint16_t dh;
                memcpy(&dh, blk, 2);
                const float d = half_to_float(dh);
                vf8 w[4];
                for (int i = 0; i < 4; i++) {
                    vq8 q;
                    memcpy(&q, blk + 2 + 8 * i, 8);
                    w[i] = __builtin_convertvector(q, vf8);
                }
                for (int t = 0; t < nt; t++) { /* independent products, a pairwise sum, and
                                                  * one FMA on the row's chain per block */
                    const float *xb = xs[t] + b * Q8_0_WEIGHTS;
                    const vf8 s = (w[0] * *(const vf8 *)xb + w[1] * *(const vf8 *)(xb + 8)) +
                                  (w[2] * *(const vf8 *)(xb + 16) + w[3] * *(const vf8 *)(xb + 24));
                    acc[t] += d * s;
                }
            }
            for (int t = 0; t < nt; t++) {
                const vf8 a = acc[t];
                y[(r0 + t) * ldy + o] = ((a[0] + a[4]) + (a[1] + a[5])) +
                                        ((a[2] + a[6]) + (a[3] + a[7]));
            }
#endif
        }
    }
}

/* Columns per unit of linear_units for T rows: units of equal width (multiples of COL_BLOCK),
 * as wide as the chunked accumulators allow (T x width <= ACC_FLOATS: a decode row reads long
 * contiguous runs of each W row) while every thread of the team still gets a unit. */
static int64_t unit_columns(int64_t T, int64_t S, int64_t n)
{
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads();
#else
    const int64_t threads = 1;
#endif
    const int64_t cap = T > 0 && ACC_FLOATS / T > COL_BLOCK ? ACC_FLOATS / T : COL_BLOCK;
    int64_t per_split = (threads + S - 1) / S;  /* units per column block for every thread */
    if (per_split < (n + cap - 1) / cap)
        per_split = (n + cap - 1) / cap;
    const int64_t width = (n + per_split - 1) / per_split;
    return (width + COL_BLOCK - 1) / COL_BLOCK * COL_BLOCK;
}

/* y[t][s*n + j] (row stride ldy) = x[T][K] (row stride ldx) @ W, W (type wt) stored as S
 * column blocks [S][K][n]; units of unit_columns() columns shared among the threads. */
static void linear_units(const float *x, int64_t T, int64_t K, int64_t ldx, const void *W,
                         int wt, int64_t S, int64_t n, float *y, int64_t ldy)
{
    const int64_t width = unit_columns(T, S, n), chunks = (n + width - 1) / width;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < S * chunks; u++) {
        const int64_t s = u / chunks, c = (u % chunks) * width;
        const int64_t w = n - c < width ? n - c : width;
        product(x, ldx, NULL, 1, T, welem(W, s * K * n + c, wt), wt, K, n, w, y + s * n + c,
                ldy);
    }
}

void strata_linear(const float *x, int64_t T, int64_t K, int64_t ldx, const void *W,
                   int64_t wtype, int64_t S, int64_t n, float *y)
{
#pragma omp parallel
    linear_units(x, T, K, ldx, W, (int)wtype, S, n, y, S * n);
}

#define Q8_0_UNIT_ROWS 64 /* output rows per work unit of a Q8_0 product (q8_0_units) */

static void q8_0_units(const float *x, int64_t T, int64_t K, int64_t ldx, const uint8_t *W,
                       int64_t N, float *y, int64_t ldy);

/* y [T, N] = x [T, K] (rows ldx apart) times W^T for W: N rows of K weights as GGUF Q8_0
 * blocks (an lm_head or attention kept as stored). Each output is product_q8_0's fixed-order
 * sum, whatever unit it falls in. */
void strata_linear_q8_0(const float *x, int64_t T, int64_t K, int64_t ldx, const uint8_t *W,
                        int64_t N, float *y)
{
#pragma omp parallel
    q8_0_units(x, T, K, ldx, W, N, y, N);
}

/* sum_j a[j] * b[j] in a fixed order: 16 lanes over the multiples of 16, lanes then summed
 * pairwise, then the tail in order. */
static float dot(const float *a, const float *b, int64_t n)
{
    const int64_t n16 = n - n % 16;
    v16 acc = {0};
    for (int64_t j = 0; j < n16; j += 16)
        acc += *(const v16 *)(a + j) * *(const v16 *)(b + j);
    float lanes[16];
    memcpy(lanes, &acc, sizeof lanes);
    for (int width = 8; width > 0; width /= 2)
        for (int i = 0; i < width; i++)
            lanes[i] += lanes[i + width];
    float sum = lanes[0];
    for (int64_t j = n16; j < n; j++)
        sum += a[j] * b[j];
    return sum;
}

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) for R rows of D (row strides ldx, ldo); with
 * `add` (row stride ldx), first x[r] += add[r] in place: the residual stream's update. */
static void rms_rows(float *x, int64_t R, int64_t D, int64_t ldx, const float *add,
                     const float *w, float eps, float *out, int64_t ldo)
{
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        float *restrict xr = x + r * ldx;
        if (add)
            for (int64_t j = 0; j < D; j++)
                xr[j] += add[r * ldx + j];
        float *restrict o = out + r * ldo;
        const float inv = 1.0f / sqrtf(dot(xr, xr, D) / (float)D + eps);
        for (int64_t j = 0; j < D; j++)
            o[j] = w[j] * (xr[j] * inv);
    }
}

void strata_rms_norm(const float *x, int64_t R, int64_t D, int64_t ldx, const float *w,
                     float eps, float *out, int64_t ldo)
{
#pragma omp parallel if (R * D >= 65536)
    rms_rows((float *)x, R, D, ldx, NULL, w, eps, out, ldo);
}

/* In place on the q and k heads of a fused projection qkv [T][ldx] = [q: H x Hd | k: G x Hd |
 * v]: per head an RMSNorm over Hd (weights q_norm / k_norm; none when NULL), then RoPE in
 * rotate-half form with the rows cos_table/sin_table [.][Hd] of each token's position. */
static void qk_heads(float *qkv, int64_t T, int64_t ldx, int64_t H, int64_t G, int64_t Hd,
                     const float *q_norm, const float *k_norm, float eps,
                     const float *cos_table, const float *sin_table, const int64_t *positions)
{
    const int64_t half = Hd / 2;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < T * (H + G); u++) {
        const int64_t t = u / (H + G), head = u % (H + G);
        float *restrict x = qkv + t * ldx + head * Hd;
        const float *norm = head < H ? q_norm : k_norm;
        if (norm) {
            const float inv = 1.0f / sqrtf(dot(x, x, Hd) / (float)Hd + eps);
            for (int64_t j = 0; j < Hd; j++)
                x[j] = norm[j] * (x[j] * inv);
        }
        const float *c = cos_table + positions[t] * Hd, *s = sin_table + positions[t] * Hd;
        for (int64_t j = 0; j < half; j++) {
            const float a = x[j], b = x[j + half];
            x[j] = a * c[j] - b * s[j];
            x[j + half] = b * c[j + half] + a * s[j + half];
        }
    }
}

void strata_qk_norm_rope(float *qkv, int64_t T, int64_t ldx, int64_t H, int64_t G, int64_t Hd,
                         const float *q_norm, const float *k_norm, float eps,
                         const float *cos_table, const float *sin_table, const int64_t *positions)
{
#pragma omp parallel if (T * (H + G) * Hd >= 65536)
    qk_heads(qkv, T, ldx, H, G, Hd, q_norm, k_norm, eps, cos_table, sin_table, positions);
}

/* Decode attention over the paged KV cache: R rows, one query token each, causal over the
 * n[r] positions its sequence has (its own included). q [R][ldq] holds H heads of Hd; query
 * head h reads KV head h / (H/G). Position p of row r is at block tables[r][p / P], offset
 * p % P of the pools k, v [blocks][P][G][Hd]. out [R][H][Hd]. work: R * H * n_max floats. */
static void attention_rows(const float *q, int64_t R, int64_t ldq, int64_t H, int64_t G,
                           int64_t Hd, const float *k, const float *v, int64_t P,
                           const int64_t *tables, int64_t table_stride, const int64_t *n,
                           int64_t n_max, float scale, float *out, float *work)
{
    const int64_t per_block = P * G * Hd, group = H / G;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < R * H; u++) {
        const int64_t r = u / H, h = u % H, g = h / group, len = n[r];
        const int64_t *table = tables + r * table_stride;
        const float *restrict qh = q + r * ldq + h * Hd;
        float *restrict s = work + u * n_max;
        float m = -INFINITY;
        for (int64_t p = 0; p < len; p++) {
            const float *kp = k + table[p / P] * per_block + (p % P) * G * Hd + g * Hd;
            s[p] = dot(qh, kp, Hd) * scale;
            m = s[p] > m ? s[p] : m;
        }
        float sum = 0.0f;
        for (int64_t p = 0; p < len; p++) {
            s[p] = expf(s[p] - m);
            sum += s[p];
        }
        float *restrict o = out + u * Hd;
        memset(o, 0, (size_t)Hd * sizeof(float));
        for (int64_t p = 0; p < len; p++) {
            const float *restrict vp = v + table[p / P] * per_block + (p % P) * G * Hd + g * Hd;
            const float pw = s[p] / sum;
            for (int64_t j = 0; j < Hd; j++)
                o[j] += pw * vp[j];
        }
    }
}

void strata_decode_attention(const float *q, int64_t R, int64_t ldq, int64_t H, int64_t G,
                             int64_t Hd, const float *k, const float *v, int64_t P,
                             const int64_t *tables, int64_t table_stride, const int64_t *n,
                             int64_t n_max, float scale, float *out, float *work)
{
#pragma omp parallel if (R * H * n_max * Hd >= 32768)
    attention_rows(q, R, ldq, H, G, Hd, k, v, P, tables, table_stride, n, n_max, scale, out,
                   work);
}

/* A softmax top-K router on T rows: logits = x[t] @ Wr (Wr [D][E] of type wt, pre-transposed;
 * the same products as strata_linear), probabilities = softmax(logits) in fp32, the K most
 * probable experts in descending order (the lower id first on a tie), their probabilities
 * renormalized to sum to 1 when `renormalize`. work: T * E floats. */
static void router_rows(const float *x, int64_t T, int64_t D, const void *Wr, int wt,
                        int64_t E, int64_t K, int renormalize, int64_t *top_idx, float *top_w,
                        float *work)
{
    linear_units(x, T, D, D, Wr, wt, 1, E, work, E); /* logits [T][E] */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *p = work + t * E;
        float m = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++)
            m = p[e] > m ? p[e] : m;
        for (int64_t e = 0; e < E; e++) {
            p[e] = expf(p[e] - m);
            sum += p[e];
        }
        for (int64_t e = 0; e < E; e++)
            p[e] /= sum;
        int64_t *idx = top_idx + t * K;
        float *w = top_w + t * K;
        float picked = 0.0f;
        unsigned char taken[E];
        memset(taken, 0, sizeof taken);
        for (int64_t k = 0; k < K; k++) { /* selection: the best not yet taken */
            int64_t best = 0;
            while (taken[best])
                best++;
            for (int64_t e = best + 1; e < E; e++)
                if (!taken[e] && p[e] > p[best])
                    best = e;
            taken[best] = 1;
            idx[k] = best;
            w[k] = p[best];
            picked += p[best];
        }
        if (renormalize)
            for (int64_t k = 0; k < K; k++)
                w[k] /= picked;
    }
}

static void count_experts(const int64_t *top_idx, int64_t A, int64_t E, int64_t *counts)
{
    memset(counts, 0, (size_t)E * sizeof(int64_t));
    for (int64_t a = 0; a < A; a++)
        counts[top_idx[a]]++;
}

/* strata_router: router_rows, then counts[e] = rows routed to expert e. */
void strata_router(const float *x, int64_t T, int64_t D, const void *Wr, int64_t wtype,
                   int64_t E, int64_t K, int renormalize, int64_t *top_idx, float *top_w,
                   int64_t *counts, float *work)
{
#pragma omp parallel if (T * D * E >= (1 << 20))
    router_rows(x, T, D, Wr, (int)wtype, E, K, renormalize, top_idx, top_w, work);
    count_experts(top_idx, T * K, E, counts);
}

/* One decoder layer's weights (split layouts as in services/engine/cache/layout.py): wqkv, wo
 * and router of type wtype; the norm weights and the KV pools fp32. */
struct strata_layer {
    const float *in_norm, *post_norm; /* [D] */
    const void *wqkv;                 /* [S][D][(H + 2G) Hd / S]: q | k | v */
    int64_t qkv_splits;
    const float *q_norm, *k_norm;     /* [Hd] per head, or NULL */
    const void *wo;                   /* [S][H Hd][D / S] */
    int64_t o_splits;
    float *k_pool, *v_pool;           /* this layer's [blocks][P][G][Hd] */
    const void *router;               /* [D][E] */
    int64_t wtype;                    /* WT_F32 or WT_BF16: wqkv's, wo's and router's type */
    int64_t proj_q8_0;                /* 1: wqkv and wo are GGUF Q8_0 rows instead (wqkv:
                                       * (H + 2G) Hd rows of D, wo: D rows of H Hd) */
};

/* The orphaned `omp for` of a Q8_0 product: y [T, N] (rows ldy apart) = x times the N rows of
 * W; work units of Q8_0_UNIT_ROWS rows. */
static void q8_0_units(const float *x, int64_t T, int64_t K, int64_t ldx, const uint8_t *W,
                       int64_t N, float *y, int64_t ldy)
{
    const int64_t row_bytes = (K / Q8_0_WEIGHTS) * Q8_0_BYTES;
    const int64_t units = (N + Q8_0_UNIT_ROWS - 1) / Q8_0_UNIT_ROWS;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        const int64_t o0 = u * Q8_0_UNIT_ROWS;
        const int64_t rows = N - o0 < Q8_0_UNIT_ROWS ? N - o0 : Q8_0_UNIT_ROWS;
        product_q8_0(x, ldx, NULL, 1, T, W + o0 * row_bytes, K, rows, y + o0, ldy);
    }
}

/* One decode step: T rows, one token each (row t: position positions[t], written at flat KV
 * slot slots[t], reading tables[t][.] for lengths[t] positions), and its buffers. */
struct strata_step {
    int64_t T, D, H, G, Hd, P, E, K, renormalize, table_stride, max_length;
    float eps, scale;
    const float *cos_table, *sin_table; /* [positions][Hd] */
    const int64_t *positions, *slots, *tables, *lengths;
    float *x;                           /* [T][D] the residual stream, updated in place */
    const float *add;                   /* [T][D] added to x first (the last MoE's output), or NULL */
    float *h;                           /* [T][D] out: the MoE's normalized input */
    float *qkv, *attn, *o, *scores;     /* work: [T][(H+2G)Hd], [T][H Hd], [T][D], [T][H][max_length] */
    int64_t *top_idx;                   /* [T][K] out */
    float *top_w;                       /* [T][K] out */
    int64_t *counts;                    /* [E] out */
};

/* The attention half of a decoder layer and its router, for decode rows, in one region:
 *   x += add; h = norm(x); qkv = h @ wqkv; q, k: head norm + RoPE; K/V written to the pool;
 *   attention over the pool; x += attn @ wo; h = post_norm(x); router(h).
 * Each stage computes what strata_rms_norm, strata_linear, strata_qk_norm_rope,
 * strata_decode_attention and strata_router compute (the same functions). */
void strata_decode_layer(const struct strata_layer *L, const struct strata_step *s)
{
    const int64_t T = s->T, D = s->D, Hd = s->Hd, G = s->G;
    const int64_t nqkv = (s->H + 2 * G) * Hd, q_size = s->H * Hd, kv_size = G * Hd;
    const int wt = (int)L->wtype;
#pragma omp parallel
    {
        rms_rows(s->x, T, D, D, s->add, L->in_norm, s->eps, s->h, D);
        if (L->proj_q8_0)
            q8_0_units(s->h, T, D, D, (const uint8_t *)L->wqkv, nqkv, s->qkv, nqkv);
        else
            linear_units(s->h, T, D, D, L->wqkv, wt, L->qkv_splits, nqkv / L->qkv_splits,
                         s->qkv, nqkv);
        qk_heads(s->qkv, T, nqkv, s->H, G, Hd, L->q_norm, L->k_norm, s->eps, s->cos_table,
                 s->sin_table, s->positions);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            memcpy(L->k_pool + s->slots[t] * kv_size, s->qkv + t * nqkv + q_size,
                   (size_t)kv_size * sizeof(float));
            memcpy(L->v_pool + s->slots[t] * kv_size, s->qkv + t * nqkv + q_size + kv_size,
                   (size_t)kv_size * sizeof(float));
        }
        attention_rows(s->qkv, T, nqkv, s->H, G, Hd, L->k_pool, L->v_pool, s->P, s->tables,
                       s->table_stride, s->lengths, s->max_length, s->scale, s->attn,
                       s->scores);
        if (L->proj_q8_0)
            q8_0_units(s->attn, T, q_size, q_size, (const uint8_t *)L->wo, D, s->o, D);
        else
            linear_units(s->attn, T, q_size, q_size, L->wo, wt, L->o_splits, D / L->o_splits,
                         s->o, D);
        rms_rows(s->x, T, D, D, s->o, L->post_norm, s->eps, s->h, D);
        router_rows(s->h, T, D, L->router, wt, s->E, s->K, (int)s->renormalize, s->top_idx,
                    s->top_w, s->scores);
    }
    count_experts(s->top_idx, T * s->K, s->E, s->counts);
}

/* Workspace sizes (elements) strata_moe needs for T rows. */
int64_t strata_moe_work_floats(int64_t T, int64_t K, int64_t D, int64_t F)
{
    return T * K * (3 * F + D);
}

int64_t strata_moe_work_ints(int64_t T, int64_t K, int64_t E)
{
    return 3 * E + 1 + 2 * T * K;
}

/* The routed experts of one MoE layer on T rows:
 *   y[t] = sum over k, in ascending expert id, of top_w[t][k] * expert_{top_idx[t][k]}(x[t])
 *   expert_e(v) = down_e(silu(gate_e v) * up_e v)
 * blob_addr[e] is the address of expert e's blob (a slot or a host-store row), elements of
 * type wtype (offsets below count elements):
 *   [gate_t D x F | up_t D x F | down_t as S column blocks S x F x (D/S)]   (cache/layout.py)
 * or, for WT_Q8_0, the GGUF's rows of blocks as stored (cache/formats.py's BlockFormat):
 *   [gate F rows of D | up F rows of D | down D rows of F], each of the S down units D/S rows
 * Only the experts some row routes to are read. work, iwork: strata_moe_work_* elements. */
void strata_moe(const float *x, int64_t T, int64_t D, int64_t F, int64_t S, int64_t K,
                const int64_t *top_idx, const float *top_w, int64_t E, const int64_t *blob_addr,
                int64_t wtype, float *y, float *work, int64_t *iwork)
{
    const int64_t A = T * K, Dc = D / S;
    const int wt = (int)wtype;
    int64_t *start = iwork;           /* [E + 1] first grouped position of each expert */
    int64_t *cursor = start + E + 1;  /* [E] */
    int64_t *groups = cursor + E;     /* [G] experts with rows, ascending */
    int64_t *order = groups + E;      /* [A] assignment (t*K + k) at each grouped position */
    int64_t *pos = order + A;         /* [A] grouped position of each assignment */
    float *gate = work;               /* [A][F] */
    float *up = gate + A * F;         /* [A][F] */
    float *h = up + A * F;            /* [A][F] silu(gate) * up */
    float *out = h + A * F;           /* [A][D] each assignment's expert output */

    /* Group assignments by expert, ascending; rows ascending within an expert. */
    memset(start, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t a = 0; a < A; a++)
        start[top_idx[a] + 1]++;
    int64_t G = 0;
    for (int64_t e = 0; e < E; e++) {
        if (start[e + 1])
            groups[G++] = e;
        start[e + 1] += start[e];
        cursor[e] = start[e];
    }
    for (int64_t a = 0; a < A; a++) {
        const int64_t p = cursor[top_idx[a]]++;
        order[p] = a;
        pos[a] = p;
    }

    /* Q8_0 blobs: [gate F rows of D | up F rows of D | down D rows of F], rows of blocks */
    const int64_t gate_bytes = F * (D / Q8_0_WEIGHTS) * Q8_0_BYTES;
    const int64_t down_row_bytes = (F / Q8_0_WEIGHTS) * Q8_0_BYTES;

#pragma omp parallel
    {
        /* gate and up: one unit per (expert, matrix), each pass shared by TOK_TILE rows */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < 2 * G; u++) {
            const int64_t e = groups[u / 2];
            float *dst = u % 2 ? up : gate;
            if (wt == WT_Q8_0) {
                const uint8_t *W = (const uint8_t *)(intptr_t)blob_addr[e] + (u % 2) * gate_bytes;
                product_q8_0(x, D, order + start[e], K, start[e + 1] - start[e], W, D, F,
                             dst + start[e] * F, F);
                continue;
            }
            const void *W = welem((const void *)(intptr_t)blob_addr[e], (u % 2) * D * F, wt);
            product(x, D, order + start[e], K, start[e + 1] - start[e], W, wt, D, F, F,
                    dst + start[e] * F, F);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < A * F; i++)
            h[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        /* down: one unit per (expert, column block) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < S * G; u++) {
            const int64_t e = groups[u / S], s = u % S;
            if (wt == WT_Q8_0) {
                const uint8_t *W = (const uint8_t *)(intptr_t)blob_addr[e] + 2 * gate_bytes +
                                   s * Dc * down_row_bytes;
                product_q8_0(h + start[e] * F, F, NULL, 1, start[e + 1] - start[e], W, F, Dc,
                             out + start[e] * D + s * Dc, D);
                continue;
            }
            const void *W = welem((const void *)(intptr_t)blob_addr[e], 2 * D * F + s * F * Dc,
                                  wt);
            product(h + start[e] * F, F, NULL, 1, start[e + 1] - start[e], W, wt, F, Dc, Dc,
                    out + start[e] * D + s * Dc, D);
        }
        /* weighted sum per row, experts in ascending id */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < T * S; u++) {
            const int64_t t = u / S, c0 = (u % S) * Dc;
            int64_t ks[K];
            for (int64_t k = 0; k < K; k++) { /* insertion sort of the row's K experts */
                int64_t j = k;
                while (j > 0 && top_idx[t * K + ks[j - 1]] > top_idx[t * K + k]) {
                    ks[j] = ks[j - 1];
                    j--;
                }
                ks[j] = k;
            }
            float *restrict dst = y + t * D + c0;
            memset(dst, 0, (size_t)Dc * sizeof(float));
            for (int64_t k = 0; k < K; k++) {
                const int64_t a = t * K + ks[k];
                const float wa = top_w[a];
                const float *restrict src = out + pos[a] * D + c0;
                for (int64_t j = 0; j < Dc; j++)
                    dst[j] += wa * src[j];
            }
        }
    }
}

