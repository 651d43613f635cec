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
 * Shape legend: T rows (tokens), D hidden, F expert FFN, S the down product's units of rows
 * (strata_moe), K routed per token,
 * E experts of the layer, A = T*K routed (token, expert) assignments.
 *
 * Numerics: every output element of an fp32 / bf16 product is one fp32 dot product,
 * accumulated over the input index in order with a fused multiply-add, starting from zero
 * (the [out][in] products, product_rows: in 4 x VL lanes, then a fixed tree over them; the
 * [in][out] ones, product: one accumulator);
 * a block-type product (product_blocks, below) is integer dots per block on 8-bit-rounded
 * activations, one float FMA per block, in order. Either way a row's result never depends
 * on which other rows share the call, on the tile it falls in, on the thread that computes
 * it, or on the address its weights are read from (a slot or the host store): batch shapes,
 * cache sizes and placements give bit-identical outputs.
 *
 * Weights (the products' W, the experts' blobs, the router, a layer's wqkv / wo / router) are
 * fp32 or bf16 (`wtype`: WT_F32 0, WT_BF16 1; bf16 = the top 16 bits of an fp32), or GGUF
 * block types kept as stored (WT_Q8_0 .. WT_IQ4_XS; experts, lm_head, wqkv, wo). A bf16
 * weight is widened to fp32 exactly (its bits shifted up) right after it is loaded, then the
 * same fp32 FMA sequence runs: the bf16 kernel on w gives bit-identical outputs to the fp32
 * kernel on w widened, and reads half the bytes. Activations, outputs, norm weights, tables,
 * workspaces and KV pools are fp32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define ABI_VERSION 15
#define WT_F32 0          /* weight types (wtype) */
#define WT_BF16 1
#define WT_Q8_0 2         /* GGUF block types, rows of blocks as stored (see product_blocks) */
#define WT_Q4_0 3
#define WT_Q2_K 4
#define WT_Q3_K 5
#define WT_Q4_K 6
#define WT_Q5_K 7
#define WT_Q6_K 8
#define WT_IQ4_NL 9       /* non-linear 4-bit: quants index a 16-entry int8 table */
#define WT_MXFP4 10       /* OCP microscaling FP4 (E2M1 values, an E8M0 scale per 32) */
#define WT_IQ4_XS 11      /* IQ4_NL's table in super-blocks of 256, 6-bit sub-block scales */
#define WT_FP8 12         /* float8 e4m3 with an fp32 scale per bo x bi block (strata_moe) */
#define WT_F32_IO 13      /* fp32 / bf16 expert blobs whose matrices are stored [in][out]
                             (strata_moe: small experts, see its comment) */
#define WT_BF16_IO 14
#define TOK_TILE 4        /* rows sharing one pass over a weight block */
#define BLOCK_TILE 8      /* rows sharing one unpacking of a block-type block (tile_blocks):
                             at 512 rows 1.37x (Q4_K) / 1.13x (Q6_K) over 4, Q8_0 even */
#define COL_BLOCK 256     /* the granule (and least width) of strata_matmul's work units */
#define UNITS_PER_THREAD 4 /* the products' units per thread at least, taken as threads come
                              free: a thread the scheduler lends to another process for a while
                              (the gateway, on a small host) holds up only its current unit */
#define K_CHUNK 8         /* inputs per chunk of a decode-size product (see product) */
#define ACC_FLOATS 16384  /* accumulators a chunked product keeps in cache (64 KB) */
#define SHORT_ROW 4096    /* bytes of a W row up to which a chunked product prefetches */
#define CACHED_W_BYTES (32 << 10) /* a W this small is read from L1/L2 in any order: no chunks */
#define PANEL_BYTES (128 << 10) /* W bytes a prefill's tiles of rows share in L2 (product_rows) */
#define ROWS_L1_BYTES (16 << 10) /* x bytes of up to two tiles for which product_rows takes
                                  panels of one W row (hidden 512 in fp32: 8 rows) */
#define ROWS_PF 2 /* W rows ahead that those one-row panels prefetch (the hardware's stream
                     alone fell behind while two tiles computed: an lm_head of 8 rows 1.4x) */
#define ROWS_UNIT_BYTES (256 << 10) /* the most weight bytes of one rows_units unit */
#define THREADED_WEIGHTS (1 << 18) /* weights a call reads from which its work is shared among
                                    * the threads: below, waking them (and waiting for one
                                    * the scheduler has given to another process) costs more
                                    * than the work (~50 us of one core) */
#define EXPERT_UNIT_WEIGHTS (1 << 20) /* the largest expert (gate + up + down) that strata_moe
                                       * runs whole in one unit */
#if TOK_TILE != 4
#error "tile_product_of's register budget assumes TOK_TILE == 4"
#endif

int strata_abi_version(void) { return ABI_VERSION; }

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
typedef int32_t vi __attribute__((vector_size(4 * VL)));

/* Lane-wise a < b ? a : b and a > b ? a : b (what the scalar forms give, NaN included). */
static inline __attribute__((always_inline)) vw vmin(vw a, vw b)
{
    const vi m = a < b;
    return (vw)(((vi)a & m) | ((vi)b & ~m));
}

static inline __attribute__((always_inline)) vw vmax(vw a, vw b)
{
    const vi m = a > b;
    return (vw)(((vi)a & m) | ((vi)b & ~m));
}

/* e^x in VL lanes (the experts' activation; libm's expf takes one lane a call), within 1 ulp
 * over [-87, 88] (x clamped to it; 0.93 ulp at most against exp in double on every 7th float
 * there): x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts, Cody-Waite), e^r by its Taylor
 * polynomial to r^7 (the remainder under 1e-8 relative), times 2^n by adding n to the
 * exponent. The same arithmetic for every lane, so a value's result does not depend on its
 * lane or its neighbours. */
static inline __attribute__((always_inline)) vw vexp(vw x)
{
    x = vmax(vmin(x, (vw){0} + 88.0f), (vw){0} + -87.0f);
    const vw t = x * 1.44269504088896341f;
    const vi half = (vi)((vw){0} + 0.5f) | ((vi)t & (int32_t)0x80000000); /* 0.5 with t's sign */
    const vi n = __builtin_convertvector(t + (vw)half, vi);               /* round half away */
    const vw nf = __builtin_convertvector(n, vw);
    const vw r = (x - nf * 0.693145751953125f) - nf * 1.428606820309417232e-6f;
    vw p = (vw){0} + 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return (vw)((vi)p + (n << 23));
}

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
    for (int t = 0; t < NT; t++) /* vector loads and stores of ys (a memcpy goes through the
                                  * stack in halves: a failed store forward per vector) */
        for (int q = 0; q < NV; q++)
            acc[t][q] = k0 == 0 ? (vw){0} : *(const vw *)(ys[t] + c + VL * q);
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
        for (int q = 0; q < NV; q++)
            *(vw *)(ys[t] + c + VL * q) = acc[t][q];
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

/* y[r][0:n] (row stride ldy) = x_r @ W[0:K][0:n] (W row stride ld, type wt) for R rows x_r =
 * x + r ldx, or x + (xrow[r] / xdiv) ldx (gathered by index, as in product_rows), W stored
 * [in][out] (pre-transposed: strata_matmul's, and small experts'). The rows run in tiles of
 * TOK_TILE. When the R x n accumulators fit ACC_FLOATS (decode), the inputs run in chunks of
 * K_CHUNK, every tile's passes over a chunk before the next chunk, the accumulators waiting in
 * y (in cache) between chunks: W is then read a few rows' [0, n) at a time, not a pass's few
 * columns of all K rows, then the next pass's (pieces of a row far apart in time: a TLB miss
 * and a cold hardware-prefetch stream each, whatever their size, so bf16 would gain nothing).
 * W rows of up to SHORT_ROW bytes (a work unit's columns, where a chunk spans a few pages the
 * hardware prefetcher follows poorly) are also prefetched in software, a chunk ahead. Else
 * (prefill), or when W is small enough to stay in L1/L2 whatever the order it is read in (a
 * small model's experts: chunks there only store and reload the accumulators; a batch of
 * eight 33-token prompts prefilled 1.06x faster without them), one chunk: the accumulators
 * stay in registers. Either way each output is the same FMA sequence (see tile_product_of). */
static void product(const float *x, int64_t ldx, const int64_t *xrow, int64_t xdiv, int64_t R,
                    const void *W, int wt, int64_t K, int64_t ld, int64_t n, float *y,
                    int64_t ldy)
{
    const int64_t row_bytes = n * (wt == WT_BF16 ? 2 : 4);
    const int64_t kc = R * n <= ACC_FLOATS && K * row_bytes > CACHED_W_BYTES ? K_CHUNK : K;
    const int pf = kc < K && row_bytes <= SHORT_ROW;
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

/* The fp32 / bf16 products on weights (the experts in strata_moe, the dense weights in
 * strata_linear and the fused layer) read W stored [out][in], as the checkpoint holds it:
 * each output is the dot product of x with one contiguous row of W. A thread then reads its
 * rows as one sequential stream, which the hardware prefetcher follows at the memory's full
 * rate; the [in][out] passes of `product` read a few columns of several rows at a time,
 * several streams at once, and got two thirds of it (scripts/stream_orientation.c; at one row
 * 20-23 vs 14-18 GB/s over DRAM-resident experts, docs/benchmarks.md). */

/* The sum of a vector's lanes in a fixed tree: lane i += lane i + w for w = VL / 2, ..., 1.
 * In registers: written as a loop over an array, GCC kept the lanes on the stack, and each
 * add waited for the store before it (a third of a decode-size product's time at D = 128). */
static inline __attribute__((always_inline)) float hsum_vw(vw a)
{
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
    const __m512 v = (__m512)a;
    const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd((__m512d)v, 1)));
#else
    const __m256 h8 = (__m256)a;
#endif
    const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
#else
    float s[VL];
    memcpy(s, &a, sizeof s);
    for (int w = VL / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++)
            s[i] += s[i + w];
    return s[0];
#endif
}

#if defined(__AVX512F__)
/* s[j] = hsum_vw(v_j) for four vectors at once, in the same tree of adds (so the same bits):
 * lane i += lane i + w for w = 8, 4, 2, 1, the four vectors' lanes side by side. */
static inline __attribute__((always_inline)) void hsum4_vw(vw v0, vw v1, vw v2, vw v3,
                                                           float s[4])
{
    const __m512 a = (__m512)v0, b = (__m512)v1, c = (__m512)v2, d = (__m512)v3;
    /* w = 8: [v0 lo 8 | v1 lo 8] + [v0 hi 8 | v1 hi 8], likewise v2, v3 */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44),
                                    _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44),
                                    _mm512_shuffle_f32x4(c, d, 0xEE));
    /* w = 4: quarter j of q is vector j's lanes i + i + 4 */
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88),
                                   _mm512_shuffle_f32x4(ab, cd, 0xDD));
    const __m512 r = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E)); /* w = 2 */
    const __m512 t = _mm512_add_ps(r, _mm512_permute_ps(r, 0xB1)); /* w = 1 */
    _mm_storeu_ps(s, _mm512_castps512_ps128(_mm512_permutexvar_ps(
        _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), t)));
}
#define DOT_TILE 4 /* rows of x a dot_pass takes: 4 x 4 accumulators fit AVX-512's registers */
#else
#define DOT_TILE 3 /* ... and 3 x 4 AVX2's */
#endif

/* ys[t][o] = xs[t] . W[o] for NT <= DOT_TILE rows xs and output row o of W (rows of `in`
 * weights of type wt). Per output, four accumulators of VL lanes (vector j of the row into
 * j % 4, from zero, FMA), summed (0 + 1) + (2 + 3), the lanes summed in hsum_vw's tree (four
 * rows' at once in hsum4_vw's), then the row's last in % VL weights one by one: the same
 * sequence whatever NT, so a row's result does not depend on the rows it shares a pass with.
 * (Several rows of W in one pass, to share the lane sums, read W as several streams: on
 * DRAM-resident weights 1.3-1.7x slower.) */
static inline __attribute__((always_inline)) void dot_pass(const float *const *xs, const int NT,
                                                           const void *W, const int wt,
                                                           int64_t in, int64_t o,
                                                           float *const *ys)
{
    vw acc[DOT_TILE][4];
    for (int t = 0; t < NT; t++)
        for (int a = 0; a < 4; a++)
            acc[t][a] = (vw){0};
    const void *row = welem(W, o * in, wt);
    int64_t k = 0;
    for (; k + 4 * VL <= in; k += 4 * VL)
        for (int a = 0; a < 4; a++) {
            vw w;
            load_w(&w, row, k + a * VL, wt);
            for (int t = 0; t < NT; t++) /* vw is 4-aligned: an unaligned load of x */
                acc[t][a] += *(const vw *)(xs[t] + k + a * VL) * w;
        }
    /* the last 0-3 whole vectors into acc[0], acc[1], acc[2]: constant indices, so the
     * accumulators stay in registers (a loop's running index kept them on the stack) */
    for (int a = 0; a < 3; a++) {
        if (k + VL > in)
            break;
        vw w;
        load_w(&w, row, k, wt);
        for (int t = 0; t < NT; t++)
            acc[t][a] += *(const vw *)(xs[t] + k) * w;
        k += VL;
    }
    float sums[DOT_TILE];
#if defined(__AVX512F__)
    if (NT == 4)
        hsum4_vw((acc[0][0] + acc[0][1]) + (acc[0][2] + acc[0][3]),
                 (acc[1][0] + acc[1][1]) + (acc[1][2] + acc[1][3]),
                 (acc[2][0] + acc[2][1]) + (acc[2][2] + acc[2][3]),
                 (acc[3][0] + acc[3][1]) + (acc[3][2] + acc[3][3]), sums);
    else
#endif
        for (int t = 0; t < NT; t++)
            sums[t] = hsum_vw((acc[t][0] + acc[t][1]) + (acc[t][2] + acc[t][3]));
    for (int t = 0; t < NT; t++) {
        float s = sums[t];
        for (int64_t j = k; j < in; j++) /* fmaf: the same rounding however GCC vectorizes */
            s = fmaf(xs[t][j], load1(row, j, wt), s);
        ys[t][o] = s;
    }
}

/* dot_pass over output rows [o0, o0 + out) for nt <= TOK_TILE rows: one row of W at a time
 * (one stream), all nt rows of x against it (on AVX2 four as two and two, the second pair
 * reading the row from L1). */
static inline __attribute__((always_inline)) void dot_rows_of(const float *const *xs, int nt,
                                                              const void *W, const int wt,
                                                              int64_t in, int64_t o0,
                                                              int64_t out, float *const *ys)
{
    for (int64_t o = o0; o < o0 + out; o++)
        switch (nt) {
        case 1: dot_pass(xs, 1, W, wt, in, o, ys); break;
        case 2: dot_pass(xs, 2, W, wt, in, o, ys); break;
        case 3: dot_pass(xs, 3, W, wt, in, o, ys); break;
        default:
#if DOT_TILE == 4
            dot_pass(xs, 4, W, wt, in, o, ys);
#else
            dot_pass(xs, 2, W, wt, in, o, ys);
            dot_pass(xs + 2, 2, W, wt, in, o, ys + 2);
#endif
            break;
        }
}

#define DOT_ROWS(name, wt)                                                                     \
    static void name(const float *const *xs, int nt, const void *W, int64_t in, int64_t o0,  \
                     int64_t out, float *const *ys)                                          \
    {                                                                                        \
        dot_rows_of(xs, nt, W, wt, in, o0, out, ys);                                         \
    }
DOT_ROWS(dot_rows_f32, WT_F32)
DOT_ROWS(dot_rows_bf16, WT_BF16)
#undef DOT_ROWS

/* y[r][o - o0] (row stride ldy) = x_r . W[o] for outputs o in [o0, o0 + out) of W [N][in]
 * (type wt) and R rows x_r = x + r ldx, or x + (xrow[r] / xdiv) ldx (gathered by index), in
 * tiles of TOK_TILE rows, the outputs in panels, every tile over one panel before the next.
 * One tile: the whole range is one panel. Two tiles whose rows fit ROWS_L1_BYTES (a decode
 * step's): a panel is one row of W, read from memory by the first tile and from L1 by the
 * second, the row ROWS_PF ahead prefetched meanwhile (a prefetch never faults: past the end
 * of W is harmless). More rows (prefill): panels of about PANEL_BYTES of W, read from memory
 * once and from L2 by the other tiles, where a pass of each tile over all of W read it from
 * memory once a tile. */
static void product_rows(const float *x, int64_t ldx, const int64_t *xrow, int64_t xdiv,
                         int64_t R, const void *W, int wt, int64_t in, int64_t o0, int64_t out,
                         float *y, int64_t ldy)
{
    const int64_t row_bytes = in * (wt == WT_BF16 ? 2 : 4);
    const int two_tiles = R > TOK_TILE && R <= 2 * TOK_TILE && R * in * 4 <= ROWS_L1_BYTES;
    const int64_t panel = two_tiles ? 1
                          : R <= TOK_TILE || row_bytes >= PANEL_BYTES ? (out > 0 ? out : 1)
                                                                      : PANEL_BYTES / row_bytes;
    for (int64_t p0 = o0; p0 < o0 + out; p0 += panel) {
        const int64_t n = o0 + out - p0 < panel ? o0 + out - p0 : panel;
        if (two_tiles) {
            const char *ahead = (const char *)welem(W, (p0 + ROWS_PF) * in, wt);
            for (int64_t b = 0; b < row_bytes; b += 64)
                __builtin_prefetch(ahead + b, 0, 3);
        }
        for (int64_t r0 = 0; r0 < R; r0 += TOK_TILE) {
            const int nt = R - r0 < TOK_TILE ? (int)(R - r0) : TOK_TILE;
            const float *xs[TOK_TILE];
            float *ys[TOK_TILE];
            for (int t = 0; t < nt; t++) {
                xs[t] = x + (xrow ? xrow[r0 + t] / xdiv : r0 + t) * ldx;
                ys[t] = y + (r0 + t) * ldy - o0;
            }
            (wt == WT_BF16 ? dot_rows_bf16 : dot_rows_f32)(xs, nt, W, in, p0, n, ys);
        }
    }
}

typedef float vf8 __attribute__((vector_size(32), aligned(4)));  /* 8 floats, unaligned ok */

/* ---- GGUF block types, computed as stored ----------------------------------------------
 *
 * A block-type weight is N rows of `in` weights, each row its blocks in order, as GGUF stores
 * them (services/engine/model/blocks.py has each type's layout and reference dequantization):
 *   Q8_0, Q4_0       blocks of 32: an fp16 scale d, then 32 int8 / 16 bytes of 4-bit quants
 *   IQ4_NL, MXFP4    blocks of 32: 4-bit indices into a 16-value table (fp16 d / E8M0 scale)
 *   IQ4_XS           super-blocks of 256: IQ4_NL's table, 6-bit signed sub-block scales
 *   Q2_K .. Q6_K     super-blocks of 256 (QK): an fp16 d (and dmin), sub-block scales (and
 *                    mins) of 16 or 32 weights, 2-6 bit quants
 * The products compute in integers, the way the fastest CPU engines do: each activation row
 * is quantized once per call to 8 bits (struct q8rows: per block of the weight type's size a
 * scale max|x| / 127, int8 quants rounded to nearest even, and the quants' sum per 16), then
 * per weight block the quants are unpacked to bytes in registers and multiplied with
 * vpmaddubsw / vpmaddwd (unsigned weight byte times signed activation byte, pairs summed in
 * 16 bits, then in 32 bits with the sub-block scales), one float FMA per block and row.
 * An unpacked weight u stands for d * s_j * (u - off) - dmin * m_j (s_j, m_j: its 16-weight
 * group's scale and min; off: 32 for Q6_K, 4 for Q3_K, else 0), so a super-block's dot with
 * an activation block of scale dx is
 *     dx * (d * sum_j s_j * (u_j . a_j)  -  sum_j sum(a_j) * (d * off * s_j + dmin * m_j)).
 * Numerics: a row's output is its blocks' terms accumulated in order in 8 float lanes,
 * summed last in a fixed tree; integer parts are exact. Nothing depends on the other rows of
 * the call, the tile, the thread or where the weights lie. Results differ from the reference
 * dequantization's fp32 product by the activations' rounding (an error of about 0.3% of a
 * row's norm, as in llama.cpp); tests/engine/test_block_kernels.py checks each type against
 * the reference on the same rounded activations to fp32 accuracy. */

#define QK 256 /* weights per K-quant super-block */
#ifndef PF_BYTES
#define PF_BYTES 1024 /* how far ahead a block product prefetches its weight stream */
#endif

static inline int64_t block_weights(int bt)
{
    return bt == WT_Q8_0 || bt == WT_Q4_0 || bt == WT_IQ4_NL || bt == WT_MXFP4 ? 32 : QK;
}

static inline int64_t block_bytes(int bt)
{
    switch (bt) {
    case WT_Q8_0: return 34;
    case WT_Q4_0: return 18;
    case WT_Q2_K: return 84;
    case WT_Q3_K: return 110;
    case WT_Q4_K: return 144;
    case WT_Q5_K: return 176;
    case WT_Q6_K: return 210;
    case WT_IQ4_NL: return 18;
    case WT_MXFP4: return 17;
    case WT_IQ4_XS: return 136;
    }
    return 0;
}

static inline int64_t row_bytes_of(int bt, int64_t in) { return in / block_weights(bt) * block_bytes(bt); }

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

static inline float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_to_float(h);
#endif
}

/* R activation rows of K values quantized for a product (bs: values per scale, 32 or QK). */
struct q8rows {
    int8_t *q;    /* [R][K] */
    float *d;     /* [R][K / bs] */
    int32_t *sum; /* [R][K / 16] sum of q per 16 values */
    int64_t K, bs;
};

/* Bytes a q8rows of R rows of K needs (for the smallest bs). */
static int64_t q8rows_bytes(int64_t R, int64_t K) { return R * K + R * (K / 32) * 4 + R * (K / 16) * 4 + 64; }

static struct q8rows q8rows_at(void *mem, int64_t R, int64_t K, int64_t bs)
{
    struct q8rows a = {.K = K, .bs = bs};
    a.d = (float *)mem;
    a.sum = (int32_t *)(a.d + R * (K / 32));
    a.q = (int8_t *)(a.sum + R * (K / 16));
    return a;
}

static void quantize_row(const float *x, int64_t K, int64_t bs, int8_t *q, float *d, int32_t *sum)
{
    for (int64_t b = 0; b < K / bs; b++) {
        const float *xb = x + b * bs;
        float amax = 0.0f;
        for (int64_t i = 0; i < bs; i++)
            amax = fmaxf(amax, fabsf(xb[i]));
        d[b] = amax / 127.0f;
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t *qb = q + b * bs;
#if defined(__AVX2__)
        for (int64_t i = 0; i < bs; i += 8) { /* vcvtps2dq: nearest even, as nearbyintf */
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i),
                                                               _mm256_set1_ps(id)));
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v),
                                              _mm256_extracti128_si256(v, 1));
            _mm_storel_epi64((__m128i *)(qb + i), _mm_packs_epi16(w, w));
        }
#else
        for (int64_t i = 0; i < bs; i++)
            qb[i] = (int8_t)nearbyintf(xb[i] * id);
#endif
    }
    for (int64_t g = 0; g < K / 16; g++) {
        int32_t s = 0;
        for (int i = 0; i < 16; i++)
            s += q[g * 16 + i];
        sum[g] = s;
    }
}

/* The orphaned `omp for` quantizing R rows (ldx apart) of x into a. */
static void quantize_rows(const float *x, int64_t R, int64_t ldx, const struct q8rows *a)
{
    const int64_t K = a->K;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++)
        quantize_row(x + r * ldx, K, a->bs, a->q + r * K, a->d + r * (K / a->bs),
                     a->sum + r * (K / 16));
}

typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x32 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) u8x32 load32(const uint8_t *p)
{
    u8x32 v;
    memcpy(&v, p, 32);
    return v;
}

/* Chunk c (weights 32c .. 32c + 31) of a K-quant super-block as bytes u (see the layout in
 * model/blocks.py). Generic vectors: vpsrlw + vpand on AVX2, plain loops elsewhere. */
static inline __attribute__((always_inline)) u8x32 unpack_k(const uint8_t *blk, const int bt,
                                                             const int c)
{
    const int n = c / 4, j = c % 4;
    switch (bt) {
    case WT_Q4_K: {
        const u8x32 q = load32(blk + 16 + 32 * (c / 2));
        return c % 2 ? q >> 4 : q & 0x0f;
    }
    case WT_Q5_K: { /* high bit c of each byte moved straight to bit 4: one shift, one and */
        const u8x32 q = load32(blk + 48 + 32 * (c / 2)), qh = load32(blk + 16);
        const u8x32 hi = (c <= 4 ? qh << (4 - c) : qh >> (c - 4)) & 0x10;
        return (c % 2 ? q >> 4 : q & 0x0f) | hi;
    }
    case WT_Q6_K: { /* bit pair j moved straight to bits 4-5 */
        const u8x32 ql = load32(blk + 64 * n + 32 * (j % 2)), qh = load32(blk + 128 + 32 * n);
        const u8x32 hi = (j < 2 ? qh << (4 - 2 * j) : qh >> (2 * j - 4)) & 0x30;
        return (j < 2 ? ql & 0x0f : ql >> 4) | hi;
    }
    case WT_Q2_K:
        return (load32(blk + 16 + 32 * n) >> (2 * j)) & 3;
    default: { /* WT_Q3_K */
        const u8x32 lo = (load32(blk + 32 + 32 * n) >> (2 * j)) & 3, hm = load32(blk);
        const int bit = 4 * n + j; /* high bit `bit` of each byte moved straight to bit 2 */
        return lo | ((bit <= 2 ? hm << (2 - bit) : hm >> (bit - 2)) & 4);
    }
    }
}

typedef uint8_t u8x4 __attribute__((vector_size(4)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int16_t i16x16 __attribute__((vector_size(32)));

/* 8 signed / unsigned bytes as 8 floats (vpmovsxbd / vpmovzxbd + vcvtdq2ps: GCC 12 lowers
 * the generic __builtin_convertvector of bytes to floats element by element). */
static inline __attribute__((always_inline)) vf8 i8_to_f(i8x8 v)
{
#if defined(__AVX2__)
    long long bits;
    memcpy(&bits, &v, 8);
    return (vf8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bits)));
#else
    return __builtin_convertvector(v, vf8);
#endif
}

static inline __attribute__((always_inline)) vf8 u8_to_f(u8x8 v)
{
#if defined(__AVX2__)
    long long bits;
    memcpy(&bits, &v, 8);
    return (vf8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bits)));
#else
    return __builtin_convertvector(v, vf8);
#endif
}

/* Each of 16 group values (bytes) to int16 s[] and to floats times f (cw0: groups 0-7, cw1:
 * 8-15, one multiply each). */
static inline __attribute__((always_inline)) void groups_i8(i8x16 v, float f, int16_t s[16],
                                                             vf8 *cw0, vf8 *cw1)
{
    const i16x16 w = __builtin_convertvector(v, i16x16);
    memcpy(s, &w, 32);
    const i8x8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    const i8x8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    *cw0 = f * i8_to_f(lo);
    *cw1 = f * i8_to_f(hi);
}

/* A K-quant super-block's float scale d, its 16 group scales s[] and each group's offset and
 * min term cw[j] = d * off * s_j + dmin * m_j (cw0: groups 0-7, cw1: 8-15). Generic vectors
 * throughout: a block's scales cost a handful of instructions, not a loop per group. */
static inline __attribute__((always_inline)) float scales_k(const uint8_t *blk, const int bt,
                                                             int16_t s[16], vf8 *cw0, vf8 *cw1)
{
    switch (bt) {
    case WT_Q4_K:
    case WT_Q5_K: { /* 8 6-bit scales and mins: sub-blocks 0-3 in the low 6 bits of bytes
                     * 0-3 / 4-7; 4-7 in bytes 8-11's nibbles plus those bytes' top 2 bits,
                     * unpacked four at a time in 32-bit words */
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        uint32_t A, B, C;
        memcpy(&A, blk + 4, 4);
        memcpy(&B, blk + 8, 4);
        memcpy(&C, blk + 12, 4);
        const uint32_t sc[2] = {A & 0x3f3f3f3fu,
                                (C & 0x0f0f0f0fu) | (((A >> 6) & 0x03030303u) << 4)};
        const uint32_t mn[2] = {B & 0x3f3f3f3fu,
                                ((C >> 4) & 0x0f0f0f0fu) | (((B >> 6) & 0x03030303u) << 4)};
#if defined(__AVX2__)
        const __m128i scv = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc));
        _mm_storeu_si128((__m128i *)s, _mm_unpacklo_epi16(scv, scv)); /* each twice */
        _mm_storeu_si128((__m128i *)(s + 8), _mm_unpackhi_epi16(scv, scv));
        const __m128i m2 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)mn),
                                             _mm_loadl_epi64((const __m128i *)mn));
        *cw0 = dmin * (vf8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m2));
        *cw1 = dmin * (vf8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(m2, 8)));
#else
        const uint8_t *scb = (const uint8_t *)sc, *mnb = (const uint8_t *)mn;
        for (int k = 0; k < 8; k++) {
            s[2 * k] = s[2 * k + 1] = scb[k];
            (*(k < 4 ? cw0 : cw1))[2 * (k % 4)] = (*(k < 4 ? cw0 : cw1))[2 * (k % 4) + 1] =
                dmin * (float)mnb[k];
        }
#endif
        return d;
    }
    case WT_Q6_K: {
        const float d = f16_at(blk + 208);
        i8x16 v;
        memcpy(&v, blk + 192, 16);
        groups_i8(v, d * 32.0f, s, cw0, cw1);
        return d;
    }
    case WT_Q2_K: {
        const float d = f16_at(blk + 80), dmin = f16_at(blk + 82);
        u8x16 v;
        memcpy(&v, blk, 16);
        const i16x16 w = __builtin_convertvector(v & 15, i16x16);
        memcpy(s, &w, 32);
        const u8x16 m = v >> 4;
        const u8x8 m0 = __builtin_shufflevector(m, m, 0, 1, 2, 3, 4, 5, 6, 7);
        const u8x8 m1 = __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15);
        *cw0 = dmin * u8_to_f(m0);
        *cw1 = dmin * u8_to_f(m1);
        return d;
    }
    case WT_IQ4_XS: { /* 8 6-bit sub-block scales, stored + 32: low 4 bits the nibbles of
                       * bytes 4-7 (sub-block k: byte 4 + k / 2, low nibble for even k), high 2
                       * bits bit pair k of the uint16 at byte 2 */
        const float d = f16_at(blk);
        uint16_t h;
        memcpy(&h, blk + 2, 2);
        for (int k = 0; k < 8; k++) {
            const int ls = ((blk[4 + k / 2] >> (4 * (k % 2))) & 15) | (((h >> (2 * k)) & 3) << 4);
            s[2 * k] = s[2 * k + 1] = (int16_t)(ls - 32);
        }
        *cw0 = *cw1 = (vf8){0};
        return d;
    }
    default: { /* WT_Q3_K: 16 6-bit scales, stored + 32: the low 4 bits are bytes 0-7's low
                * (groups 0-7) then high (8-15) nibbles; the high 2 bits, bit pair g / 4 of
                * byte 8 + g % 4 */
        const float d = f16_at(blk + 108);
        u8x8 L;
        u8x4 H;
        memcpy(&L, blk + 96, 8);
        memcpy(&H, blk + 104, 4);
        const u8x16 lo = __builtin_shufflevector(L & 15, L >> 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                 10, 11, 12, 13, 14, 15);
        const u8x8 h01 = __builtin_shufflevector(H & 3, (H >> 2) & 3, 0, 1, 2, 3, 4, 5, 6, 7);
        const u8x8 h23 = __builtin_shufflevector((H >> 4) & 3, H >> 6, 0, 1, 2, 3, 4, 5, 6, 7);
        const u8x16 hi = __builtin_shufflevector(h01, h23, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                 11, 12, 13, 14, 15);
        groups_i8((i8x16)(lo | (hi << 4)) - 32, d * 4.0f, s, cw0, cw1);
        return d;
    }
    }
}

/* The value tables of the non-linear 4-bit types (ggml's kvalues_iq4nl; kvalues_mxfp4: the
 * E2M1 values doubled, the scale halved to match). */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 16 bytes of nibbles as 32 table values: weight j the low nibble of byte j, weight j + 16 its
 * high nibble (vpshufb on AVX2). */
static inline __attribute__((always_inline)) i8x32 nibbles_to(const uint8_t *qs,
                                                              const int8_t table[16])
{
    u8x16 q;
    memcpy(&q, qs, 16);
#if defined(__AVX2__)
    const __m128i t = _mm_loadu_si128((const __m128i *)table);
    const __m128i lo = _mm_shuffle_epi8(t, (__m128i)(q & 0x0f));
    const __m128i hi = _mm_shuffle_epi8(t, (__m128i)(q >> 4));
    return (i8x32)_mm256_set_m128i(hi, lo);
#else
    i8x32 w;
    for (int j = 0; j < 16; j++) {
        w[j] = table[q[j] & 0x0f];
        w[j + 16] = table[q[j] >> 4];
    }
    return w;
#endif
}

/* A 32-weight block's scale: fp16, or MXFP4's E8M0 exponent e as 2^(e - 128) (the table's
 * doubled values), exact. */
static inline __attribute__((always_inline)) float scale_32(const uint8_t *blk, const int bt)
{
    if (bt != WT_MXFP4)
        return f16_at(blk);
    const uint32_t bits = blk[0] < 2 ? 0x00200000u << blk[0] : (uint32_t)(blk[0] - 1) << 23;
    float d;
    memcpy(&d, &bits, 4);
    return d;
}

/* Block b of a 32-weight type as signed bytes (Q8_0 as stored, Q4_0 nibble - 8, IQ4_NL and
 * MXFP4 their tables' values). */
static inline __attribute__((always_inline)) i8x32 unpack_32(const uint8_t *blk, const int bt)
{
    if (bt == WT_Q8_0) {
        i8x32 q;
        memcpy(&q, blk + 2, 32);
        return q;
    }
    if (bt == WT_IQ4_NL)
        return nibbles_to(blk + 2, IQ4_VALUES);
    if (bt == WT_MXFP4)
        return nibbles_to(blk + 1, MXFP4_VALUES);
    u8x16 q;
    memcpy(&q, blk + 2, 16);
    const u8x32 both = __builtin_shufflevector(q & 0x0f, q >> 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                               10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                               22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    return (i8x32)both - 8;
}

typedef int32_t i32x8 __attribute__((vector_size(32)));

/* 8 int32 lanes: lane k = sum over bytes 4k .. 4k+3 of u * a * (its half's scale: s0 for
 * bytes 0-15, s1 for 16-31): vpmaddubsw then vpmaddwd. u is at most 63, |a| at most 127:
 * the 16-bit pair sums cannot saturate. */
static inline __attribute__((always_inline)) i32x8 dot_u8(u8x32 u, const int8_t *a, int16_t s0,
                                                            int16_t s1)
{
#if defined(__AVX2__)
    const __m256i p = _mm256_maddubs_epi16((__m256i)u, _mm256_loadu_si256((const __m256i *)a));
    if (__builtin_constant_p(s0 == s1) && s0 == s1) /* one scale per 32 (Q4_K, Q5_K) */
        return (i32x8)_mm256_madd_epi16(p, _mm256_set1_epi16(s0));
    return (i32x8)_mm256_madd_epi16(p, _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0)));
#else
    i32x8 r;
    for (int k = 0; k < 8; k++) {
        const int s = k < 4 ? s0 : s1;
        int32_t acc = 0;
        for (int i = 4 * k; i < 4 * k + 4; i++)
            acc += (int32_t)u[i] * a[i];
        r[k] = acc * s;
    }
    return r;
#endif
}

/* |w| (unsigned) times a signed like w, in 8 int32 lanes of 4 bytes each: the VNNI
 * instruction where there is one (one vpdpbusd for vpmaddubsw + vpmaddwd by ones); the same
 * integers either way. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_VNNI(u, a) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (a))
#elif defined(__AVXVNNI__)
#define DOT_VNNI(u, a) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (a))
#endif

/* 8 int32 lanes of signed w times signed a (lane k: bytes 4k .. 4k+3) times the half's
 * scale (s0: bytes 0-15, s1: 16-31): vpmaddubsw on |w| and a signed like w, then vpmaddwd
 * (|w| <= 128, |a| <= 127: the pair sums fit 16 bits). */
static inline __attribute__((always_inline)) i32x8 dot_i8(i8x32 w, const int8_t *a, int16_t s0,
                                                            int16_t s1)
{
#if defined(DOT_VNNI)
    if (__builtin_constant_p(s0 == 1 && s1 == 1) && s0 == 1 && s1 == 1) /* 32-weight blocks */
        return (i32x8)DOT_VNNI(_mm256_sign_epi8((__m256i)w, (__m256i)w),
                               _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a),
                                                (__m256i)w));
#endif
#if defined(__AVX2__)
    const __m256i av = _mm256_loadu_si256((const __m256i *)a);
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8((__m256i)w, (__m256i)w),
                                           _mm256_sign_epi8(av, (__m256i)w));
    if (__builtin_constant_p(s0 == s1) && s0 == s1)
        return (i32x8)_mm256_madd_epi16(p, _mm256_set1_epi16(s0));
    return (i32x8)_mm256_madd_epi16(p, _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0)));
#else
    i32x8 r;
    for (int k = 0; k < 8; k++) {
        int32_t acc = 0;
        for (int i = 4 * k; i < 4 * k + 4; i++)
            acc += (int32_t)w[i] * a[i];
        r[k] = acc * (k < 4 ? s0 : s1);
    }
    return r;
#endif
}

/* a * b + c, one rounding, whatever the tile height: an explicit FMA (GCC's contraction of
 * `c += a * b` differed between the unrolled variants, and so would a row's bits). */
static inline __attribute__((always_inline)) vf8 fma8(vf8 a, vf8 b, vf8 c)
{
#if defined(__FMA__)
    return (vf8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vf8 r;
    for (int i = 0; i < 8; i++)
        r[i] = fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

static inline __attribute__((always_inline)) float hsum8(vf8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

/* y[t][o] (rows ldy apart) for NT activation rows (a's rows rows[t]) against `out` rows of
 * W, a block type bt (NT and bt constants at every call site, so the loops unroll and the
 * accumulators stay in registers). */
static inline __attribute__((always_inline)) void tile_blocks(const struct q8rows *a,
                                                              const int64_t *rows, const int NT,
                                                              const uint8_t *W, const int bt,
                                                              int64_t out, float *y,
                                                              int64_t ldy)
{
    const int64_t K = a->K, bw = block_weights(bt), nb = K / bw, bb = block_bytes(bt);
    const int8_t *aq[BLOCK_TILE];
    const float *ad[BLOCK_TILE];
    const int32_t *as[BLOCK_TILE];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        aq[t] = a->q + rows[t] * K;
        ad[t] = a->d + rows[t] * nb;
        as[t] = a->sum + rows[t] * (K / 16);
    }
    for (int64_t o = 0; o < out; o++) {
        const uint8_t *blk = W + o * nb * bb;
        vf8 acc[BLOCK_TILE];
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++)
            acc[t] = (vf8){0};
        for (int64_t b = 0; b < nb; b++, blk += bb) {
            /* the stream, PF_BYTES ahead, into all cache levels: on a Xeon (Sapphire Rapids)
             * non-temporal prefetches made Q8_0 experts read at 7.8 GB/s, these at 19.5 */
            for (int64_t off = 0; off < bb; off += 64)
                __builtin_prefetch(blk + PF_BYTES + off, 0, 3);
            if (bw == 32) {
                const float dw = scale_32(blk, bt);
                const i8x32 w = unpack_32(blk, bt);
#pragma GCC unroll 8
                for (int t = 0; t < NT; t++) {
                    const i32x8 p = dot_i8(w, aq[t] + b * 32, 1, 1);
                    acc[t] = fma8((vf8){0} + dw * ad[t][b], __builtin_convertvector(p, vf8),
                                  acc[t]);
                }
                continue;
            }
            int16_t s[16];
            vf8 cw0, cw1;
            const float d = scales_k(blk, bt, s, &cw0, &cw1);
            i32x8 isum[BLOCK_TILE];
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++)
                isum[t] = (i32x8){0};
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                /* one scale per 32 weights (Q4_K, Q5_K, IQ4_XS): the same value twice, which
                 * dot_* see as such (a broadcast instead of two and an insert) */
                const int16_t s0 = s[2 * c];
                const int16_t s1 = bt == WT_Q4_K || bt == WT_Q5_K || bt == WT_IQ4_XS
                                       ? s0 : s[2 * c + 1];
                if (bt == WT_IQ4_XS) { /* signed table values: sub-block c is qs[16c ..) */
                    const i8x32 w = nibbles_to(blk + 8 + 16 * c, IQ4_VALUES);
#pragma GCC unroll 8
                    for (int t = 0; t < NT; t++)
                        isum[t] += dot_i8(w, aq[t] + b * QK + 32 * c, s0, s1);
                    continue;
                }
                const u8x32 u = unpack_k(blk, bt, c);
#pragma GCC unroll 8
                for (int t = 0; t < NT; t++)
                    isum[t] += dot_u8(u, aq[t] + b * QK + 32 * c, s0, s1);
            }
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                const float dx = ad[t][b];
                i32x8 s0, s1;
                memcpy(&s0, as[t] + b * 16, 32);
                memcpy(&s1, as[t] + b * 16 + 8, 32);
                /* explicit FMAs: the same operations for every tile height (fma8) */
                acc[t] = fma8((vf8){0} + d * dx, __builtin_convertvector(isum[t], vf8), acc[t]);
                if (bt != WT_IQ4_XS) { /* no offsets or mins */
                    const vf8 m = fma8(cw0, __builtin_convertvector(s0, vf8),
                                       cw1 * __builtin_convertvector(s1, vf8));
                    acc[t] = fma8((vf8){0} - dx, m, acc[t]);
                }
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++)
            y[t * ldy + o] = hsum8(acc[t]);
    }
}

/* y[r][o] for R activation rows (a's row r, or xrow[r] / xdiv) against `out` rows of W (type
 * bt, a constant at the call sites in product_blocks), in tiles of BLOCK_TILE rows sharing
 * each block's unpacking. */
static inline __attribute__((always_inline)) void product_of(const struct q8rows *a,
                                                             const int64_t *xrow, int64_t xdiv,
                                                             int64_t R, const uint8_t *W,
                                                             const int bt, int64_t out,
                                                             float *y, int64_t ldy)
{
    for (int64_t r0 = 0; r0 < R; r0 += BLOCK_TILE) {
        const int nt = R - r0 < BLOCK_TILE ? (int)(R - r0) : BLOCK_TILE;
        int64_t rows[BLOCK_TILE];
        for (int t = 0; t < nt; t++)
            rows[t] = xrow ? xrow[r0 + t] / xdiv : r0 + t;
        float *yt = y + r0 * ldy;
        switch (nt) {
        case 1: tile_blocks(a, rows, 1, W, bt, out, yt, ldy); break;
        case 2: tile_blocks(a, rows, 2, W, bt, out, yt, ldy); break;
        case 3: tile_blocks(a, rows, 3, W, bt, out, yt, ldy); break;
        case 4: tile_blocks(a, rows, 4, W, bt, out, yt, ldy); break;
        case 5: tile_blocks(a, rows, 5, W, bt, out, yt, ldy); break;
        case 6: tile_blocks(a, rows, 6, W, bt, out, yt, ldy); break;
        case 7: tile_blocks(a, rows, 7, W, bt, out, yt, ldy); break;
        default: tile_blocks(a, rows, 8, W, bt, out, yt, ldy); break;
        }
    }
}

/* product_of specialized per block type. */
static void product_blocks(const struct q8rows *a, const int64_t *xrow, int64_t xdiv, int64_t R,
                           const uint8_t *W, int bt, int64_t out, float *y, int64_t ldy)
{
    switch (bt) {
    case WT_Q8_0: product_of(a, xrow, xdiv, R, W, WT_Q8_0, out, y, ldy); break;
    case WT_Q4_0: product_of(a, xrow, xdiv, R, W, WT_Q4_0, out, y, ldy); break;
    case WT_Q2_K: product_of(a, xrow, xdiv, R, W, WT_Q2_K, out, y, ldy); break;
    case WT_Q3_K: product_of(a, xrow, xdiv, R, W, WT_Q3_K, out, y, ldy); break;
    case WT_Q4_K: product_of(a, xrow, xdiv, R, W, WT_Q4_K, out, y, ldy); break;
    case WT_Q5_K: product_of(a, xrow, xdiv, R, W, WT_Q5_K, out, y, ldy); break;
    case WT_Q6_K: product_of(a, xrow, xdiv, R, W, WT_Q6_K, out, y, ldy); break;
    case WT_IQ4_NL: product_of(a, xrow, xdiv, R, W, WT_IQ4_NL, out, y, ldy); break;
    case WT_MXFP4: product_of(a, xrow, xdiv, R, W, WT_MXFP4, out, y, ldy); break;
    case WT_IQ4_XS: product_of(a, xrow, xdiv, R, W, WT_IQ4_XS, out, y, ldy); break;
    }
}

#define BLOCK_UNIT_ROWS 64 /* output rows per work unit of a block-type product */

/* A block-type matrix of up to 3 row segments (q | k | v kept in their own types), all rows
 * `in` weights: segment i is rows[i] rows of type types[i], stored one after another. */
struct block_matrix {
    const uint8_t *W;
    int64_t nseg, types[3], rows[3];
};

/* The orphaned work of y [T, N] (rows ldy apart, N the segments' rows) = x [T, in] (rows ldx
 * apart) times m's rows: the rows quantized into `qmem` for each segment's block size (the
 * first of each size, a barrier after), then units of BLOCK_UNIT_ROWS rows of a segment. */
static void block_units(const float *x, int64_t T, int64_t in, int64_t ldx,
                        const struct block_matrix *m, void *qmem, float *y, int64_t ldy)
{
    struct q8rows a32 = q8rows_at(qmem, T, in, 32), a256 = q8rows_at(
        (char *)qmem + q8rows_bytes(T, in), T, in, QK);
    int need32 = 0, need256 = 0;
    for (int64_t i = 0; i < m->nseg; i++)
        *(block_weights((int)m->types[i]) == 32 ? &need32 : &need256) = 1;
    if (need32)
        quantize_rows(x, T, ldx, &a32);
    if (need256)
        quantize_rows(x, T, ldx, &a256);
    int64_t units = 0;
    for (int64_t i = 0; i < m->nseg; i++)
        units += (m->rows[i] + BLOCK_UNIT_ROWS - 1) / BLOCK_UNIT_ROWS;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        int64_t i = 0, first = 0, row0 = 0, rest = u;
        const uint8_t *W = m->W;
        for (;; i++) { /* the unit's segment */
            const int64_t n = (m->rows[i] + BLOCK_UNIT_ROWS - 1) / BLOCK_UNIT_ROWS;
            if (rest < n)
                break;
            rest -= n;
            first += m->rows[i];
            W += m->rows[i] * row_bytes_of((int)m->types[i], in);
        }
        const int bt = (int)m->types[i];
        row0 = rest * BLOCK_UNIT_ROWS;
        const int64_t rows = m->rows[i] - row0 < BLOCK_UNIT_ROWS ? m->rows[i] - row0
                                                                  : BLOCK_UNIT_ROWS;
        product_blocks(block_weights(bt) == 32 ? &a32 : &a256, NULL, 1, T,
                       W + row0 * row_bytes_of(bt, in), bt, rows, y + first + row0, ldy);
    }
}

/* out [n][K] = rows ids[0..n) of W (block type bt, rows of K weights, blocks as stored)
 * dequantized: each weight the value the block products multiply by (d * q for the 32-weight
 * types; d * s_g * q - (offset and min term)_g for the K-quants, g a group of 16). An
 * embedding lookup, per decode step: small work, one thread. */
void strata_dequantize_rows(const uint8_t *W, int64_t bt_, int64_t K, const int64_t *ids,
                            int64_t n, float *out)
{
    const int bt = (int)bt_;
    const int64_t bw = block_weights(bt), bb = block_bytes(bt), rb = row_bytes_of(bt, K);
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *blk = W + ids[r] * rb;
        float *y = out + r * K;
        for (int64_t b = 0; b < K / bw; b++, blk += bb, y += bw) {
            if (bw == 32) {
                const float d = scale_32(blk, bt);
                const i8x32 w = unpack_32(blk, bt);
                for (int j = 0; j < 32; j++)
                    y[j] = d * (float)w[j];
                continue;
            }
            int16_t s[16];
            vf8 cw0, cw1;
            const float d = scales_k(blk, bt, s, &cw0, &cw1);
            for (int c = 0; c < 8; c++) {
                if (bt == WT_IQ4_XS) {
                    const i8x32 w = nibbles_to(blk + 8 + 16 * c, IQ4_VALUES);
                    for (int j = 0; j < 32; j++)
                        y[32 * c + j] = d * (float)(s[2 * c] * w[j]);
                    continue;
                }
                const u8x32 u = unpack_k(blk, bt, c);
                for (int j = 0; j < 32; j++) {
                    const int g = 2 * c + j / 16;
                    y[32 * c + j] = d * (float)(s[g] * u[j]) - (g < 8 ? cw0[g] : cw1[g - 8]);
                }
            }
        }
    }
}

/* Bytes of block_units' qmem for T rows of `in`. */
int64_t strata_block_work_bytes(int64_t T, int64_t in) { return 2 * q8rows_bytes(T, in); }

/* y [T, N] = x [T, K] (rows ldx apart) times W^T for a block-type matrix of nseg segments
 * (types[i], rows[i]; an lm_head or attention kept as stored). work: strata_block_work_bytes. */
void strata_linear_blocks(const float *x, int64_t T, int64_t K, int64_t ldx, const uint8_t *W,
                          int64_t nseg, const int64_t *types, const int64_t *rows, float *y,
                          void *work)
{
    struct block_matrix m = {.W = W, .nseg = nseg};
    int64_t N = 0;
    for (int64_t i = 0; i < nseg; i++) {
        m.types[i] = types[i];
        m.rows[i] = rows[i];
        N += rows[i];
    }
#pragma omp parallel if (N * K >= THREADED_WEIGHTS)
    block_units(x, T, K, ldx, &m, work, y, N);
}

/* Columns per unit of linear_units for T rows: units of equal width (multiples of COL_BLOCK),
 * as wide as the chunked accumulators allow (T x width <= ACC_FLOATS, so that product chunks
 * the inputs: a decode row reads long contiguous runs of each W row) while every thread of the
 * team still gets UNITS_PER_THREAD units. */
static int64_t unit_columns(int64_t T, int64_t N)
{
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads();
#else
    const int64_t threads = 1;
#endif
    const int64_t fit = T > 0 ? ACC_FLOATS / T / COL_BLOCK * COL_BLOCK : ACC_FLOATS;
    const int64_t cap = fit > COL_BLOCK ? fit : COL_BLOCK; /* a multiple of COL_BLOCK */
    int64_t units = UNITS_PER_THREAD * threads;
    if (units < (N + cap - 1) / cap)
        units = (N + cap - 1) / cap;
    const int64_t width = (N + units - 1) / units;
    return (width + COL_BLOCK - 1) / COL_BLOCK * COL_BLOCK;
}

/* y[t][j] (row stride ldy) = x[T][K] (row stride ldx) @ W, W [K][N] (type wt, pre-transposed);
 * units of unit_columns() columns shared among the threads. */
static void linear_units(const float *x, int64_t T, int64_t K, int64_t ldx, const void *W,
                         int wt, int64_t N, float *y, int64_t ldy)
{
    const int64_t width = unit_columns(T, N), units = (N + width - 1) / width;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t c = u * width, w = N - c < width ? N - c : width;
        product(x, ldx, NULL, 1, T, welem(W, c, wt), wt, K, N, w, y + c, ldy);
    }
}

/* y [T, N] = x [T, K] (rows ldx apart) @ W [K][N] (fp32 or bf16, pre-transposed: routers,
 * gates, latent projections): linear_units. */
void strata_matmul(const float *x, int64_t T, int64_t K, int64_t ldx, const void *W,
                   int64_t wtype, int64_t N, float *y)
{
#pragma omp parallel if (N * K >= THREADED_WEIGHTS)
    linear_units(x, T, K, ldx, W, (int)wtype, N, y, N);
}

/* y[t][o] (row stride ldy) = x[t] . W[o] for W [N][K] (type wt, stored [out][in] as the
 * checkpoint holds it): product_rows on units of consecutive output rows shared among the
 * threads, UNITS_PER_THREAD a thread at least and none over ROWS_UNIT_BYTES of weights (a
 * unit's rows stay in L2 while a prefill's tiles of rows pass over them). */
static void rows_units(const float *x, int64_t T, int64_t K, int64_t ldx, const void *W,
                       int wt, int64_t N, float *y, int64_t ldy)
{
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads();
#else
    const int64_t threads = 1;
#endif
    const int64_t bytes = N * K * (wt == WT_BF16 ? 2 : 4);
    int64_t units = UNITS_PER_THREAD * threads;
    if (units < (bytes + ROWS_UNIT_BYTES - 1) / ROWS_UNIT_BYTES)
        units = (bytes + ROWS_UNIT_BYTES - 1) / ROWS_UNIT_BYTES;
    if (units > N)
        units = N > 0 ? N : 1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t o0 = N * u / units, o1 = N * (u + 1) / units;
        product_rows(x, ldx, NULL, 1, T, W, wt, K, o0, o1 - o0, y + o0, ldy);
    }
}

/* y [T, N] = x [T, K] (rows ldx apart) times W^T, W [N][K] fp32 or bf16 (a dense weight as
 * the checkpoint stores it): rows_units. */
void strata_linear(const float *x, int64_t T, int64_t K, int64_t ldx, const void *W,
                   int64_t wtype, int64_t N, float *y)
{
#pragma omp parallel if (N * K >= THREADED_WEIGHTS)
    rows_units(x, T, K, ldx, W, (int)wtype, N, y, N);
}

typedef float v4 __attribute__((vector_size(16)));

/* sum_j a[j] * b[j] in a fixed order: 16 lanes over the multiples of 16 (two 8-lane halves:
 * a 16-float vector type lives on the stack where the CPU has no 16-lane registers), lanes
 * then summed pairwise (lane i += lane i + w for w = 8, 4, 2, 1, in vector registers: through
 * memory it cost more than the products at a head's 32 or 64), then the tail in order. */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b,
                                                       int64_t n)
{
    const int64_t n16 = n - n % 16;
    vf8 lo = {0}, hi = {0};
    for (int64_t j = 0; j < n16; j += 16) {
        lo = fma8(*(const vf8 *)(a + j), *(const vf8 *)(b + j), lo);
        hi = fma8(*(const vf8 *)(a + j + 8), *(const vf8 *)(b + j + 8), hi);
    }
    const vf8 w8 = lo + hi;
    const v4 w4 = __builtin_shufflevector(w8, w8, 0, 1, 2, 3) +
                  __builtin_shufflevector(w8, w8, 4, 5, 6, 7);
    float sum = (w4[0] + w4[2]) + (w4[1] + w4[3]);
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

/* o[0 .. 8 NV) += sum over positions lo .. hi - 1 of one block, in order, of (s[p] / sum) v_p,
 * the accumulators in registers across the block (accumulated in memory, each position's FMAs
 * waited for the previous one's stores). v_p = vb + (p - p0) * stride. NV is a constant at
 * each call. */
static inline __attribute__((always_inline)) void weigh_values(
    const float *s, float sum, const float *vb, int64_t stride, int64_t p0, int64_t lo,
    int64_t hi, const int NV, float *o)
{
    vf8 acc[4];
#pragma GCC unroll 4
    for (int c = 0; c < NV; c++)
        acc[c] = *(const vf8 *)(o + 8 * c);
    for (int64_t p = lo; p < hi; p++) {
        const vf8 pw = (vf8){0} + s[p] / sum;
        const float *vp = vb + (p - p0) * stride;
#pragma GCC unroll 4
        for (int c = 0; c < NV; c++)
            acc[c] = fma8(pw, *(const vf8 *)(vp + 8 * c), acc[c]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < NV; c++)
        *(vf8 *)(o + 8 * c) = acc[c];
}

/* Decode attention over the paged KV cache: R rows, one query token each, causal over the
 * n[r] positions its sequence has (its own included), or only its last `window` of them
 * (window > 0: a sliding-window layer). q [R][ldq] holds H heads of Hd; query head h reads KV
 * head h / (H/G). Position p of row r is at block tables[r][p / P], offset p % P of the pools
 * k, v [blocks][P][G][Hd]. sinks (or NULL): a logit per query head that joins the softmax's
 * denominator with no value (gpt-oss's attention sinks). out [R][H][Hd]. work: R * H * n_max
 * floats.
 * A unit is a row's KV head and the query heads that read it (or a share of them, when there
 * are fewer units than threads): block by block, each K and V row is read once for them all.
 * Every head's arithmetic is the same whatever the split (positions in order). */
static void attention_rows(const float *q, int64_t R, int64_t ldq, int64_t H, int64_t G,
                           int64_t Hd, const float *k, const float *v, int64_t P,
                           const int64_t *tables, int64_t table_stride, const int64_t *n,
                           int64_t n_max, float scale, const float *sinks, int64_t window,
                           float *out, float *work)
{
    const int64_t stride = G * Hd, per_block = P * stride, group = H / G;
    int64_t heads = group; /* query heads per unit */
    while (heads % 2 == 0 && R * G * (group / heads) < omp_get_num_threads())
        heads /= 2;
    const int64_t shares = group / heads;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < R * G * shares; u++) {
        const int64_t r = u / (G * shares), g = u / shares % G, h0 = g * group + u % shares * heads;
        const int64_t len = n[r], first = window > 0 && len > window ? len - window : 0;
        const int64_t *table = tables + r * table_stride;
        float m[heads], sum[heads];
        for (int64_t i = 0; i < heads; i++)
            m[i] = sinks ? sinks[h0 + i] : -INFINITY;
        for (int64_t p0 = first - first % P; p0 < len; p0 += P) { /* block by block */
            const float *kb = k + table[p0 / P] * per_block + g * Hd;
            const int64_t lo = p0 > first ? p0 : first, hi = p0 + P < len ? p0 + P : len;
            for (int64_t i = 0; i < heads; i++) {
                const float *restrict qh = q + r * ldq + (h0 + i) * Hd;
                float *restrict s = work + (r * H + h0 + i) * n_max;
                for (int64_t p = lo; p < hi; p++) {
                    s[p] = dot(qh, kb + (p - p0) * stride, Hd) * scale;
                    m[i] = s[p] > m[i] ? s[p] : m[i];
                }
            }
        }
        for (int64_t i = 0; i < heads; i++) {
            float *restrict s = work + (r * H + h0 + i) * n_max;
            sum[i] = sinks ? expf(sinks[h0 + i] - m[i]) : 0.0f;
            for (int64_t p = first; p < len; p++) {
                s[p] = expf(s[p] - m[i]);
                sum[i] += s[p];
            }
            memset(out + (r * H + h0 + i) * Hd, 0, (size_t)Hd * sizeof(float));
        }
        for (int64_t p0 = first - first % P; p0 < len; p0 += P) {
            const float *vb = v + table[p0 / P] * per_block + g * Hd;
            const int64_t lo = p0 > first ? p0 : first, hi = p0 + P < len ? p0 + P : len;
            for (int64_t i = 0; i < heads; i++) {
                const float *s = work + (r * H + h0 + i) * n_max;
                float *restrict o = out + (r * H + h0 + i) * Hd;
                int64_t j = 0;
                for (; j + 32 <= Hd; j += 32)
                    weigh_values(s, sum[i], vb + j, stride, p0, lo, hi, 4, o + j);
                for (; j + 8 <= Hd; j += 8)
                    weigh_values(s, sum[i], vb + j, stride, p0, lo, hi, 1, o + j);
                for (; j < Hd; j++)
                    for (int64_t p = lo; p < hi; p++)
                        o[j] = fmaf(s[p] / sum[i], vb[(p - p0) * stride + j], o[j]);
            }
        }
    }
}

void strata_decode_attention(const float *q, int64_t R, int64_t ldq, int64_t H, int64_t G,
                             int64_t Hd, const float *k, const float *v, int64_t P,
                             const int64_t *tables, int64_t table_stride, const int64_t *n,
                             int64_t n_max, float scale, const float *sinks, int64_t window,
                             float *out, float *work)
{
#pragma omp parallel if (R * H * n_max * Hd >= 32768)
    attention_rows(q, R, ldq, H, G, Hd, k, v, P, tables, table_stride, n, n_max, scale, sinks,
                   window, out, work);
}

/* A softmax top-K router on T rows: logits = x[t] @ Wr (Wr [D][E] of type wt, pre-transposed;
 * the same products as strata_matmul), probabilities = softmax(logits) in fp32, the K most
 * probable experts in descending order (the lower id first on a tie), their probabilities
 * renormalized to sum to 1 when `renormalize`. work: T * E floats. */
static void router_rows(const float *x, int64_t T, int64_t D, const void *Wr, int wt,
                        int64_t E, int64_t K, int renormalize, int64_t *top_idx, float *top_w,
                        float *work)
{
    linear_units(x, T, D, D, Wr, wt, E, work, E); /* logits [T][E] */
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

/* One decoder layer's weights: wqkv and wo [out][in] as the checkpoint stores them, the router
 * pre-transposed, all three of type wtype; the norm weights and the KV pools fp32. When
 * qkv_types[0] is a block type, wqkv is GGUF rows of blocks instead: the q rows (H Hd, type
 * qkv_types[0]), then k's and v's (G Hd each, their types); when o_type is one, wo is D rows
 * of that type. */
struct strata_layer {
    const float *in_norm, *post_norm; /* [D] */
    const void *wqkv;                 /* [(H + 2G) Hd][D]: q | k | v rows */
    const float *q_norm, *k_norm;     /* [Hd] per head, or NULL */
    const void *wo;                   /* [D][H Hd] */
    float *k_pool, *v_pool;           /* this layer's [blocks][P][G][Hd] */
    const void *router;               /* [D][E] */
    int64_t wtype;                    /* WT_F32 or WT_BF16: wqkv's, wo's and router's type */
    int64_t qkv_types[3], o_type;     /* block types of wqkv's segments and wo, or WT_F32 */
};

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

/* Rows t0 .. t0 + n - 1 of the attention half's first stage: x += add; h = norm(x);
 * qkv = h @ wqkv; q, k: head norm + RoPE; K/V written to the pool. */
static void attend_in(const struct strata_layer *L, const struct strata_step *s, int64_t t0,
                      int64_t n, void *qmem)
{
    const int64_t D = s->D, Hd = s->Hd, G = s->G;
    const int64_t nqkv = (s->H + 2 * G) * Hd, q_size = s->H * Hd, kv_size = G * Hd;
    float *qkv = s->qkv + t0 * nqkv;
    rms_rows(s->x + t0 * D, n, D, D, s->add ? s->add + t0 * D : NULL, L->in_norm, s->eps,
             s->h + t0 * D, D);
    if (L->qkv_types[0] >= WT_Q8_0) {
        const struct block_matrix qkv_m = {
            .W = L->wqkv, .nseg = 3, .types = {L->qkv_types[0], L->qkv_types[1], L->qkv_types[2]},
            .rows = {q_size, kv_size, kv_size}};
        block_units(s->h + t0 * D, n, D, D, &qkv_m, qmem, qkv, nqkv);
    } else {
        rows_units(s->h + t0 * D, n, D, D, L->wqkv, (int)L->wtype, nqkv, qkv, nqkv);
    }
    qk_heads(qkv, n, nqkv, s->H, G, Hd, L->q_norm, L->k_norm, s->eps, s->cos_table,
             s->sin_table, s->positions + t0);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = s->slots[t0 + t];
        memcpy(L->k_pool + slot * kv_size, qkv + t * nqkv + q_size, (size_t)kv_size * sizeof(float));
        memcpy(L->v_pool + slot * kv_size, qkv + t * nqkv + q_size + kv_size,
               (size_t)kv_size * sizeof(float));
    }
}

/* The same rows' second stage, once every row's K/V is in the pool: attention over the pool;
 * x += attn @ wo; h = post_norm(x); router(h). scores: the rows' attention and router work. */
static void attend_out(const struct strata_layer *L, const struct strata_step *s, int64_t t0,
                       int64_t n, void *qmem, float *scores)
{
    const int64_t D = s->D, Hd = s->Hd, G = s->G;
    const int64_t nqkv = (s->H + 2 * G) * Hd, q_size = s->H * Hd;
    float *attn = s->attn + t0 * q_size, *o = s->o + t0 * D;
    attention_rows(s->qkv + t0 * nqkv, n, nqkv, s->H, G, Hd, L->k_pool, L->v_pool, s->P,
                   s->tables + t0 * s->table_stride, s->table_stride, s->lengths + t0,
                   s->max_length, s->scale, NULL, 0, attn, scores);
    if (L->o_type >= WT_Q8_0) {
        const struct block_matrix o_m = {.W = L->wo, .nseg = 1, .types = {L->o_type}, .rows = {D}};
        block_units(attn, n, q_size, q_size, &o_m, qmem, o, D);
    } else {
        rows_units(attn, n, q_size, q_size, L->wo, (int)L->wtype, D, o, D);
    }
    rms_rows(s->x + t0 * D, n, D, D, o, L->post_norm, s->eps, s->h + t0 * D, D);
    router_rows(s->h + t0 * D, n, D, L->router, (int)L->wtype, s->E, s->K, (int)s->renormalize,
                s->top_idx + t0 * s->K, s->top_w + t0 * s->K, scores);
}

/* The attention half of a decoder layer and its router, for decode rows, in one region:
 *   x += add; h = norm(x); qkv = h @ wqkv; q, k: head norm + RoPE; K/V written to the pool;
 *   attention over the pool; x += attn @ wo; h = post_norm(x); router(h).
 * Each stage computes what strata_rms_norm, strata_linear, strata_qk_norm_rope,
 * strata_decode_attention and strata_router compute (the same functions). Weights large
 * enough to share are split among the threads by columns, stage by stage; smaller ones
 * (a small model's layer) are read whole by each thread for its share of the rows, with one
 * barrier (every row's K/V written before any row attends: rows of one prompt read each
 * other's). A row's arithmetic is the same either way. */
void strata_decode_layer(const struct strata_layer *L, const struct strata_step *s)
{
    const int64_t T = s->T, D = s->D, q_size = s->H * s->Hd;
    const int64_t nqkv = (s->H + 2 * s->G) * s->Hd;
    const int blocks = L->qkv_types[0] >= WT_Q8_0 || L->o_type >= WT_Q8_0;
    const int64_t in_max = D > q_size ? D : q_size;
    const int by_columns = (nqkv + q_size + s->E) * D >= THREADED_WEIGHTS;
    if (by_columns || T < 2 || omp_get_max_threads() < 2) {
        void *qmem = blocks ? malloc((size_t)strata_block_work_bytes(T, in_max)) : NULL;
#pragma omp parallel if (by_columns)
        {
            attend_in(L, s, 0, T, qmem);  /* its last loop's barrier: every K/V written */
            attend_out(L, s, 0, T, qmem, s->scores);
        }
        free(qmem);
    } else {
        const int64_t per_row = s->H * s->max_length > s->E ? s->H * s->max_length : s->E;
        const int threads = T < omp_get_max_threads() ? (int)T : omp_get_max_threads();
#pragma omp parallel num_threads(threads)
        {
            const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
            const int64_t t0 = T * i / n, rows = T * (i + 1) / n - t0;
            void *qmem = blocks ? malloc((size_t)strata_block_work_bytes(rows, in_max)) : NULL;
            /* each stage's worksharing runs on this thread alone (an inactive nested region) */
#pragma omp parallel if (0)
            attend_in(L, s, t0, rows, qmem);
#pragma omp barrier
#pragma omp parallel if (0)
            attend_out(L, s, t0, rows, qmem, s->scores + t0 * per_row);
            free(qmem);
        }
    }
    count_experts(s->top_idx, T * s->K, s->E, s->counts);
}

/* Workspace sizes (elements) strata_moe needs for T rows: the products' floats, then the
 * quantized activations of block-type experts (x for gate and up, h for down). */
int64_t strata_moe_work_floats(int64_t T, int64_t K, int64_t D, int64_t F)
{
    return T * K * (3 * F + D) + (2 * q8rows_bytes(T, D) + q8rows_bytes(T * K, F)) / 4 + 1;
}

int64_t strata_moe_work_ints(int64_t T, int64_t K, int64_t E)
{
    return 3 * E + 1 + 2 * T * K;
}

/* 8 float8 e4m3 codes (1 sign, 4 exponent bits biased 7, 3 mantissa bits) as 8 floats,
 * exact. With F16C: the codes' bits placed in an fp16's (magnitude << 7, sign << 8) give the
 * value times 2^-8 (subnormal codes as fp16 subnormals), vcvtph2ps widens it exactly and the
 * multiply by 2^8 restores it. Else in an fp32's (<< 20): the value times 2^-120, subnormal
 * codes as fp32 subnormals, and the multiply by 2^120 (a power of two: exact) — on Intel cores
 * a multiply of a subnormal takes a microcode assist, which made that path 12x slower there. */
static inline __attribute__((always_inline)) vf8 e4m3_to_f(const uint8_t *w)
{
#if defined(__AVX2__) && defined(__F16C__)
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)w));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
    return (vf8)_mm256_cvtph_ps(h) * 0x1p8f;
#elif defined(__AVX2__)
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)w));
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f)), 20);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    return (vf8)_mm256_castsi256_ps(_mm256_or_si256(mag, sign)) * 0x1p120f;
#else
    vf8 r;
    for (int i = 0; i < 8; i++) {
        const uint32_t bits = ((uint32_t)(w[i] & 0x7f) << 20) | ((uint32_t)(w[i] & 0x80) << 24);
        memcpy(&r[i], &bits, 4);
    }
    return r * 0x1p120f;
#endif
}

/* y[r][o] for R rows of x (x + r ldx, or x + (xrow[r] / xdiv) ldx) against rows o0 .. o0 +
 * out of W, float8 e4m3 codes of `in` weights each, weight = code * scales[o / bo][k / bi]
 * (DeepSeek's weight_scale_inv layout; `in` and bi multiples of 8). Per block of bi inputs an
 * fp32 FMA dot in 8 lanes, then one FMA by the block's scale, in order; rows in tiles of
 * TOK_TILE sharing each code's conversion. */
static inline __attribute__((always_inline)) void fp8_tile(const float *const *xs, const int NT,
                                                           const uint8_t *W,
                                                           const float *scales, int64_t in,
                                                           int64_t o0, int64_t out, int64_t bo,
                                                           int64_t bi, float *y, int64_t ldy)
{
    const int64_t nbi = (in + bi - 1) / bi;
    for (int64_t o = 0; o < out; o++) {
        const uint8_t *w = W + (o0 + o) * in;
        const float *srow = scales + (o0 + o) / bo * nbi;
        vf8 acc[TOK_TILE];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            acc[t] = (vf8){0};
        for (int64_t kb = 0; kb < nbi; kb++) {
            const int64_t k0 = kb * bi, k1 = k0 + bi < in ? k0 + bi : in;
            vf8 part[TOK_TILE];
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++)
                part[t] = (vf8){0};
            for (int64_t k = k0; k < k1; k += 8) {
                __builtin_prefetch(w + k + PF_BYTES, 0, 0);
                const vf8 wf = e4m3_to_f(w + k);
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) /* vf8 is 4-aligned: one unaligned load */
                    part[t] = fma8(wf, *(const vf8 *)(xs[t] + k), part[t]);
            }
            const vf8 sc = (vf8){0} + srow[kb];
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++)
                acc[t] = fma8(sc, part[t], acc[t]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            y[t * ldy + o] = hsum8(acc[t]);
    }
}

static void product_fp8(const float *x, int64_t ldx, const int64_t *xrow, int64_t xdiv,
                        int64_t R, const uint8_t *W, const float *scales, int64_t in,
                        int64_t o0, int64_t out, int64_t bo, int64_t bi, float *y, int64_t ldy)
{
    for (int64_t r0 = 0; r0 < R; r0 += TOK_TILE) {
        const int nt = R - r0 < TOK_TILE ? (int)(R - r0) : TOK_TILE;
        const float *xs[TOK_TILE];
        for (int t = 0; t < nt; t++)
            xs[t] = x + (xrow ? xrow[r0 + t] / xdiv : r0 + t) * ldx;
        float *yt = y + r0 * ldy;
        switch (nt) {
        case 1: fp8_tile(xs, 1, W, scales, in, o0, out, bo, bi, yt, ldy); break;
        case 2: fp8_tile(xs, 2, W, scales, in, o0, out, bo, bi, yt, ldy); break;
        case 3: fp8_tile(xs, 3, W, scales, in, o0, out, bo, bi, yt, ldy); break;
        default: fp8_tile(xs, 4, W, scales, in, o0, out, bo, bi, yt, ldy); break;
        }
    }
}

/* y [T, N] = x [T, K] (rows ldx apart) times W^T for W float8 e4m3 codes [N, K] with an fp32
 * scale per bo x bi block (scales [ceil(N / bo)][ceil(K / bi)], an FP8 checkpoint's dense
 * weight as stored): product_fp8 on units of BLOCK_UNIT_ROWS output rows. */
void strata_linear_fp8(const float *x, int64_t T, int64_t K, int64_t ldx, const uint8_t *W,
                       const float *scales, int64_t N, int64_t bo, int64_t bi, float *y)
{
    const int64_t units = (N + BLOCK_UNIT_ROWS - 1) / BLOCK_UNIT_ROWS;
#pragma omp parallel for schedule(static) if (T * N * K >= (1 << 18))
    for (int64_t u = 0; u < units; u++) {
        const int64_t o0 = u * BLOCK_UNIT_ROWS;
        const int64_t n = N - o0 < BLOCK_UNIT_ROWS ? N - o0 : BLOCK_UNIT_ROWS;
        product_fp8(x, ldx, NULL, 1, T, W, scales, K, o0, n, bo, bi, y + o0, N);
    }
}

/* a's rows from `first` on. */
static struct q8rows q8rows_from(struct q8rows a, int64_t first)
{
    a.q += first * a.K;
    a.d += first * (a.K / a.bs);
    a.sum += first * (a.K / 16);
    return a;
}

#define ACT_SILU 0
#define ACT_CLAMPED 1

/* Expert e's fp32 biases, bias_at bytes into its blob. */
static inline const float *expert_bias(const int64_t *blob_addr, int64_t e, int64_t bias_at)
{
    return (const float *)((const uint8_t *)(intptr_t)blob_addr[e] + bias_at);
}

/* The routed experts of one MoE layer on T rows:
 *   y[t] = sum over k, in ascending expert id, of top_w[t][k] * expert_{top_idx[t][k]}(x[t])
 *   expert_e(v) = down_e(act(gate_e v, up_e v))
 * act ACT_SILU: silu(g) * u (SwiGLU); ACT_CLAMPED: gpt-oss's clamped SwiGLU, with g clamped
 * above at `limit` and u to [-limit, limit], g * sigmoid(alpha * g) * (u + 1).
 * bias_at >= 0: each blob holds fp32 biases at that byte offset, [gate F | up F | down D],
 * added to the gate, up and down products (gpt-oss's experts); bias_at < 0: none.
 * blob_addr[e] is the address of expert e's blob (a slot or a host-store row). Every type
 * but WT_F32_IO / WT_BF16_IO stores the matrices as the checkpoint does, [out][in], and each
 * of the S down units is D/S of down's rows. For wtypes WT_F32 / WT_BF16 (all three alike)
 * the elements are of that type (offsets count elements; products by product_rows):
 *   [gate F x D | up F x D | down D x F]                                   (cache/layout.py)
 * WT_F32_IO / WT_BF16_IO: the same elements, each matrix stored [in][out] (products by
 * product: per input, its weights to a pass's outputs broadcast-multiplied into registers,
 * no lane sums), the down units a share of down's columns:
 *   [gate^T D x F | up^T D x F | down^T F x D]
 * what small experts are kept in on the CPU (cache/formats.py's inputs_major): a dot
 * product's lane sums then cost about as much as its FMAs.
 * For block types (wtypes[0..2]: gate's, up's, down's), the GGUF's rows of blocks as stored
 * (cache/formats.py's BlockFormat):
 *   [gate F rows of D | up F rows of D | down D rows of F]
 * For WT_FP8 (wtypes[3], wtypes[4]: the scale block's rows and columns, bo x bi), float8
 * e4m3 codes then fp32 block scales (cache/formats.py's Fp8Format):
 *   [gate F x D | up F x D | down D x F codes | their scales, row-major blocks, same order]
 * Only the experts some row routes to are read. work, iwork: strata_moe_work_* elements. */
/* One MoE call's operands and grouping, shared by its units (strata_moe). */
struct moe_call {
    const float *x;
    int64_t D, F, S, K, Dc;
    const int64_t *top_idx, *blob_addr;
    int wt, io, fp8, blocks, gt, ut, dt;
    int64_t bo, bi, gate_scales, gate_bytes, up_bytes, down_row_bytes;
    int64_t act, bias_at;
    float alpha, limit;
    const int64_t *start, *order;
    float *gate, *up, *h, *out;
    struct q8rows x32, x256, hq;
};

/* Expert e's gate (which 0) or up (1) product for its rows. */
static void moe_gate_up(const struct moe_call *m, int64_t e, int which)
{
    const int64_t D = m->D, F = m->F, r0 = m->start[e], n = m->start[e + 1] - r0;
    float *dst = (which ? m->up : m->gate) + r0 * F;
    if (m->fp8) {
        const uint8_t *blob = (const uint8_t *)(intptr_t)m->blob_addr[e];
        const float *sc = (const float *)(blob + 3 * D * F) + which * m->gate_scales;
        product_fp8(m->x, D, m->order + r0, m->K, n, blob + which * D * F, sc, D, 0, F, m->bo,
                    m->bi, dst, F);
    } else if (m->blocks) {
        const int bt = which ? m->ut : m->gt;
        const uint8_t *W = (const uint8_t *)(intptr_t)m->blob_addr[e] + which * m->gate_bytes;
        product_blocks(block_weights(bt) == 32 ? &m->x32 : &m->x256, m->order + r0, m->K, n, W,
                       bt, F, dst, F);
    } else {
        const void *W = welem((const void *)(intptr_t)m->blob_addr[e], which * D * F, m->wt);
        if (m->io)
            product(m->x, D, m->order + r0, m->K, n, W, m->wt, D, F, F, dst, F);
        else
            product_rows(m->x, D, m->order + r0, m->K, n, W, m->wt, D, 0, F, dst, F);
    }
}

/* w <= VL floats at p as a vector, the lanes past w zero. A whole vector is one fixed-size
 * copy (a vector load); only a row's last, partial one takes the variable-length copy, which
 * GCC emits as `rep movs` (tens of cycles to start: half of moe_activate's time when it did
 * every vector that way). */
static inline __attribute__((always_inline)) vw load_part(const float *p, int64_t w)
{
    vw x = {0};
    if (w == VL)
        memcpy(&x, p, sizeof x);
    else
        memcpy(&x, p, (size_t)w * sizeof(float));
    return x;
}

static inline __attribute__((always_inline)) void store_part(float *p, vw x, int64_t w)
{
    if (w == VL)
        memcpy(p, &x, sizeof x);
    else
        memcpy(p, &x, (size_t)w * sizeof(float));
}

/* h at grouped position p: act(gate, up), with the expert's biases when it has them. */
static void moe_activate(const struct moe_call *m, int64_t p)
{
    const int64_t F = m->F;
    const float *restrict bg = m->bias_at < 0 ? NULL
        : expert_bias(m->blob_addr, m->top_idx[m->order[p]], m->bias_at);
    const float *restrict g = m->gate + p * F, *restrict v = m->up + p * F;
    float *restrict hp = m->h + p * F;
    for (int64_t j = 0; j < F; j += VL) { /* VL lanes at a time, the last vector padded */
        const int64_t w = F - j < VL ? F - j : VL;
        vw gj = load_part(g + j, w), uj = load_part(v + j, w);
        if (bg) {
            gj += load_part(bg + j, w);
            uj += load_part(bg + F + j, w);
        }
        vw h;
        if (m->act == ACT_CLAMPED) {
            const vw limit = (vw){0} + m->limit;
            gj = vmin(gj, limit);
            uj = vmax(vmin(uj, limit), -limit);
            h = gj / (1.0f + vexp(-m->alpha * gj)) * (uj + 1.0f);
        } else {
            h = gj / (1.0f + vexp(-gj)) * uj;
        }
        store_part(hp + j, h, w);
    }
}

/* Expert e's down product for its rows, output columns s Dc .. (s + 1) Dc - 1. */
static void moe_down(const struct moe_call *m, int64_t e, int64_t s)
{
    const int64_t D = m->D, F = m->F, Dc = m->Dc, r0 = m->start[e], n = m->start[e + 1] - r0;
    float *dst = m->out + r0 * D + s * Dc;
    if (m->fp8) {
        const uint8_t *blob = (const uint8_t *)(intptr_t)m->blob_addr[e];
        const float *sc = (const float *)(blob + 3 * D * F) + 2 * m->gate_scales;
        product_fp8(m->h + r0 * F, F, NULL, 1, n, blob + 2 * D * F, sc, F, s * Dc, Dc, m->bo,
                    m->bi, dst, D);
    } else if (m->blocks) {
        const uint8_t *W = (const uint8_t *)(intptr_t)m->blob_addr[e] + m->gate_bytes +
                           m->up_bytes + s * Dc * m->down_row_bytes;
        const struct q8rows he = q8rows_from(m->hq, r0);
        product_blocks(&he, NULL, 1, n, W, m->dt, Dc, dst, D);
    } else {
        const void *W = welem((const void *)(intptr_t)m->blob_addr[e], 2 * D * F, m->wt);
        if (m->io) /* down [F][D]: its columns s Dc .. */
            product(m->h + r0 * F, F, NULL, 1, n, welem(W, s * Dc, m->wt), m->wt, F, D, Dc, dst,
                    D);
        else
            product_rows(m->h + r0 * F, F, NULL, 1, n, W, m->wt, F, s * Dc, Dc, dst, D);
    }
}

/* All of expert e on its rows: gate, up, act, (h quantized for block types), down. */
static void moe_expert(const struct moe_call *m, int64_t e)
{
    moe_gate_up(m, e, 0);
    moe_gate_up(m, e, 1);
    for (int64_t p = m->start[e]; p < m->start[e + 1]; p++) {
        moe_activate(m, p);
        if (m->blocks)
            quantize_row(m->h + p * m->F, m->hq.K, m->hq.bs, m->hq.q + p * m->hq.K,
                         m->hq.d + p * (m->hq.K / m->hq.bs), m->hq.sum + p * (m->hq.K / 16));
    }
    for (int64_t s = 0; s < m->S; s++)
        moe_down(m, e, s);
}

void strata_moe(const float *x, int64_t T, int64_t D, int64_t F, int64_t S, int64_t K,
                const int64_t *top_idx, const float *top_w, int64_t E, const int64_t *blob_addr,
                const int64_t *wtypes, int64_t act, float alpha, float limit, int64_t bias_at,
                float *y, float *work, int64_t *iwork)
{
    const int64_t A = T * K, Dc = D / S;
    const int io = wtypes[0] == WT_F32_IO || wtypes[0] == WT_BF16_IO;
    const int wt = io ? (int)wtypes[0] - WT_F32_IO : (int)wtypes[0], fp8 = wt == WT_FP8;
    const int blocks = wt >= WT_Q8_0 && !fp8;
    const int gt = (int)wtypes[0], ut = (int)wtypes[1], dt = (int)wtypes[2];
    int64_t *start = iwork;           /* [E + 1] first grouped position of each expert */
    int64_t *cursor = start + E + 1;  /* [E] */
    int64_t *groups = cursor + E;     /* [G] experts with rows, ascending */
    int64_t *order = groups + E;      /* [A] assignment (t*K + k) at each grouped position */
    int64_t *pos = order + A;         /* [A] grouped position of each assignment */
    float *gate = work;               /* [A][F] */
    float *up = gate + A * F;         /* [A][F] */
    float *h = up + A * F;            /* [A][F] silu(gate) * up */
    float *out = h + A * F;           /* [A][D] each assignment's expert output */
    char *qmem = (char *)(out + A * D); /* block types: x quantized per block size, then h */

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

    const int64_t bo = fp8 ? wtypes[3] : 1, bi = fp8 ? wtypes[4] : 1;
    const struct moe_call m = {
        .x = x, .D = D, .F = F, .S = S, .K = K, .Dc = Dc, .top_idx = top_idx,
        .blob_addr = blob_addr, .wt = wt, .io = io, .fp8 = fp8, .blocks = blocks, .gt = gt,
        .ut = ut, .dt = dt, .bo = bo, .bi = bi,
        .gate_scales = ((F + bo - 1) / bo) * ((D + bi - 1) / bi), /* also up's */
        /* block-type blobs: [gate F rows of D | up F rows of D | down D rows of F] */
        .gate_bytes = blocks ? F * row_bytes_of(gt, D) : 0,
        .up_bytes = blocks ? F * row_bytes_of(ut, D) : 0,
        .down_row_bytes = blocks ? row_bytes_of(dt, F) : 0,
        .act = act, .bias_at = bias_at, .alpha = alpha, .limit = limit, .start = start,
        .order = order, .gate = gate, .up = up, .h = h, .out = out,
        .x32 = q8rows_at(qmem, T, D, 32), .x256 = q8rows_at(qmem + q8rows_bytes(T, D), T, D, QK),
        .hq = q8rows_at(qmem + 2 * q8rows_bytes(T, D), A, F, block_weights(dt))};

    /* Many small experts for the threads (a small model's batch): a unit is a whole expert,
     * so a layer has two barriers, not four, and an expert's gate, up and h stay in this
     * core's cache. Few, or large ones: units of one matrix (gate, up) or a share of down's
     * rows, to spread them (a thread held up by the host then holds up less of the layer). */
#pragma omp parallel if (G * 3 * D * F >= THREADED_WEIGHTS)
    {
        if (blocks) {
            if (block_weights(gt) == 32 || block_weights(ut) == 32)
                quantize_rows(x, T, D, &m.x32);
            if (block_weights(gt) == QK || block_weights(ut) == QK)
                quantize_rows(x, T, D, &m.x256);
        }
        if (G >= 4 * omp_get_num_threads() && 3 * D * F <= EXPERT_UNIT_WEIGHTS) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < G; u++)
                moe_expert(&m, groups[u]);
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < 2 * G; u++)
                moe_gate_up(&m, groups[u / 2], u % 2);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < A; p++)
                moe_activate(&m, p);
            if (blocks)
                quantize_rows(h, A, F, &m.hq);
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < S * G; u++)
                moe_down(&m, groups[u / S], u % S);
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
                if (bias_at >= 0) {
                    const float *restrict bd = expert_bias(blob_addr, top_idx[a], bias_at) + 2 * F + c0;
                    for (int64_t j = 0; j < Dc; j++)
                        dst[j] += wa * (src[j] + bd[j]);
                } else {
                    for (int64_t j = 0; j < Dc; j++)
                        dst[j] += wa * src[j];
                }
            }
        }
    }
}


/* A whole decode step's decoder layers in one call, for a model whose every layer is a fused
 * decode layer (strata_decode_layer) followed by routed experts (strata_moe) read at their
 * addresses in a table: layer l's expert e at addr[l][e] (a slot, or the host store in place).
 * Per layer the same two calls as the per-layer path, with the last MoE output added at the
 * next layer's start and, after the last, to x: bit-identical to it. x [T][D] ends as the last
 * layer's output; layer l's top-K is left in route_top[l] ([T][K]) and its rows per expert in
 * route_counts[l] ([E]) for the cache's lookups after the step; wtypes[l] are layer l's
 * expert weight types (strata_moe's wtypes). */
void strata_decode_step(const struct strata_layer *layers, int64_t L,
                        const struct strata_step *s, const int64_t *addr,
                        const int64_t *wtypes, int64_t F, int64_t S, int64_t act, float alpha,
                        float limit, int64_t bias_at, int64_t *route_top,
                        int64_t *route_counts, float *y, float *work, int64_t *iwork)
{
    struct strata_step st = *s;
    const int64_t TK = s->T * s->K;
    for (int64_t l = 0; l < L; l++) {
        st.add = l ? y : s->add;
        st.top_idx = route_top + l * TK;
        st.counts = route_counts + l * s->E;
        strata_decode_layer(&layers[l], &st);
        strata_moe(st.h, s->T, s->D, F, S, s->K, st.top_idx, st.top_w, s->E, addr + l * s->E,
                   wtypes + l * 5, act, alpha, limit, bias_at, y, work, iwork);
    }
    for (int64_t i = 0; i < s->T * s->D; i++)
        s->x[i] += y[i];
}
