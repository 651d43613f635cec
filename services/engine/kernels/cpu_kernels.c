/* Strata's CPU kernels: the decode step's weight-streaming products, called through ctypes
 * (services/engine/kernels/__init__.py builds this file with the machine's C compiler).
 *
 * Decode at small batch is bound by the bytes of weights it reads. torch runs a single-row
 * product as MKL's gemv on one core and pays a dispatch per expert; these kernels read every
 * weight block a step needs inside one OpenMP parallel region per call (torch's own OpenMP
 * runtime: the library is loaded after torch, so its libgomp is the one in use).
 *
 * Shape legend: T rows (tokens), D hidden, F expert FFN, S column splits, K routed per token,
 * E experts of the layer, A = T*K routed (token, expert) assignments.
 *
 * Numerics: every output element is one fp32 dot product, accumulated over the input index in
 * order with a fused multiply-add, starting from zero. A row's result never depends on which
 * other rows share the call, on the tile it falls in, on the thread that computes it, or on
 * the address its weights are read from (a slot or the host store): batch shapes, cache sizes
 * and placements give bit-identical outputs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ABI_VERSION 1
#define TOK_TILE 4     /* rows sharing one pass over a weight block */
#define COL_BLOCK 256  /* output columns per parallel work unit of strata_linear */

int strata_abi_version(void) { return ABI_VERSION; }

typedef float v16 __attribute__((vector_size(64), aligned(4))); /* 16 floats, unaligned ok */
#define REG_COLS 64 /* columns whose TOK_TILE x REG_COLS accumulators stay in registers */

/* ys[t][0:n] = xs[t][0:K] @ W[0:K][0:n] (W row stride ld) for nt <= TOK_TILE rows.
 * Columns in chunks of REG_COLS, accumulated in registers; a tail of n % REG_COLS columns in
 * memory. Both compute acc = fma(x[i], W[i][j], acc) for i = 0, 1, ... from acc = 0. */
static void tile_product(const float *const *xs, int nt, const float *W, int64_t K, int64_t ld,
                         int64_t n, float *const *ys)
{
    const int64_t n_reg = n - n % REG_COLS;
    for (int64_t c = 0; c < n_reg; c += REG_COLS) {
        v16 acc[TOK_TILE][4];
        for (int t = 0; t < TOK_TILE; t++)
            for (int q = 0; q < 4; q++)
                acc[t][q] = (v16){0};
        for (int64_t i = 0; i < K; i++) {
            const v16 *r = (const v16 *)(W + i * ld + c);
            const v16 r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
#pragma GCC unroll 4
            for (int t = 0; t < TOK_TILE; t++) {
                if (t < nt) {
                    const v16 xv = (v16){0} + xs[t][i];
                    acc[t][0] += xv * r0;
                    acc[t][1] += xv * r1;
                    acc[t][2] += xv * r2;
                    acc[t][3] += xv * r3;
                }
            }
        }
        for (int t = 0; t < nt; t++)
            memcpy(ys[t] + c, acc[t], sizeof acc[t]);
    }
    if (n_reg == n)
        return;
    const int64_t w = n - n_reg;
    float acc[TOK_TILE][REG_COLS];
    for (int t = 0; t < nt; t++)
        memset(acc[t], 0, sizeof acc[t]);
    for (int64_t i = 0; i < K; i++) {
        const float *restrict row = W + i * ld + n_reg;
        for (int t = 0; t < nt; t++) {
            const float xi = xs[t][i];
            for (int64_t j = 0; j < w; j++)
                acc[t][j] += xi * row[j];
        }
    }
    for (int t = 0; t < nt; t++)
        memcpy(ys[t] + n_reg, acc[t], (size_t)w * sizeof(float));
}

/* y[T][S*n] = x[T][K] (row stride ldx) @ W, W stored as S column blocks [S][K][n]. */
void strata_linear(const float *x, int64_t T, int64_t K, int64_t ldx, const float *W, int64_t S,
                   int64_t n, float *y)
{
    const int64_t chunks = (n + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < S * chunks; u++) {
        const int64_t s = u / chunks, c = (u % chunks) * COL_BLOCK;
        const int64_t w = n - c < COL_BLOCK ? n - c : COL_BLOCK;
        const float *block = W + s * K * n + c;
        for (int64_t t0 = 0; t0 < T; t0 += TOK_TILE) {
            const int nt = T - t0 < TOK_TILE ? (int)(T - t0) : TOK_TILE;
            const float *xs[TOK_TILE];
            float *ys[TOK_TILE];
            for (int t = 0; t < nt; t++) {
                xs[t] = x + (t0 + t) * ldx;
                ys[t] = y + (t0 + t) * S * n + s * n + c;
            }
            tile_product(xs, nt, block, K, n, w, ys);
        }
    }
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
 * blob_addr[e] is the address of expert e's blob (a slot or a host-store row):
 *   [gate_t D x F | up_t D x F | down_t as S column blocks S x F x (D/S)]   (cache/layout.py)
 * Only the experts some row routes to are read. work, iwork: strata_moe_work_* elements. */
void strata_moe(const float *x, int64_t T, int64_t D, int64_t F, int64_t S, int64_t K,
                const int64_t *top_idx, const float *top_w, int64_t E, const int64_t *blob_addr,
                float *y, float *work, int64_t *iwork)
{
    const int64_t A = T * K, Dc = D / S;
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

#pragma omp parallel
    {
        /* gate and up: one unit per (expert, matrix), each pass shared by TOK_TILE rows */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < 2 * G; u++) {
            const int64_t e = groups[u / 2];
            const float *W = (const float *)(intptr_t)blob_addr[e] + (u % 2) * D * F;
            float *dst = u % 2 ? up : gate;
            for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += TOK_TILE) {
                const int nt = start[e + 1] - p0 < TOK_TILE ? (int)(start[e + 1] - p0) : TOK_TILE;
                const float *xs[TOK_TILE];
                float *ys[TOK_TILE];
                for (int t = 0; t < nt; t++) {
                    xs[t] = x + order[p0 + t] / K * D;
                    ys[t] = dst + (p0 + t) * F;
                }
                tile_product(xs, nt, W, D, F, F, ys);
            }
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < A * F; i++)
            h[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        /* down: one unit per (expert, column block) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < S * G; u++) {
            const int64_t e = groups[u / S], s = u % S;
            const float *W = (const float *)(intptr_t)blob_addr[e] + 2 * D * F + s * F * Dc;
            for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += TOK_TILE) {
                const int nt = start[e + 1] - p0 < TOK_TILE ? (int)(start[e + 1] - p0) : TOK_TILE;
                const float *xs[TOK_TILE];
                float *ys[TOK_TILE];
                for (int t = 0; t < nt; t++) {
                    xs[t] = h + (p0 + t) * F;
                    ys[t] = out + (p0 + t) * D + s * Dc;
                }
                tile_product(xs, nt, W, F, Dc, Dc, ys);
            }
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

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) for R rows of D (row strides ldx, ldo). */
void strata_rms_norm(const float *x, int64_t R, int64_t D, int64_t ldx, const float *w,
                     float eps, float *out, int64_t ldo)
{
#pragma omp parallel for schedule(static) if (R * D >= 65536)
    for (int64_t r = 0; r < R; r++) {
        const float *restrict xr = x + r * ldx;
        float *restrict o = out + r * ldo;
        const float inv = 1.0f / sqrtf(dot(xr, xr, D) / (float)D + eps);
        for (int64_t j = 0; j < D; j++)
            o[j] = w[j] * (xr[j] * inv);
    }
}

/* In place on the q and k heads of a fused projection qkv [T][ldx] = [q: H x Hd | k: G x Hd |
 * v]: per head an RMSNorm over Hd (weights q_norm / k_norm; none when NULL), then RoPE in
 * rotate-half form with the rows cos_table/sin_table [.][Hd] of each token's position. */
void strata_qk_norm_rope(float *qkv, int64_t T, int64_t ldx, int64_t H, int64_t G, int64_t Hd,
                         const float *q_norm, const float *k_norm, float eps,
                         const float *cos_table, const float *sin_table, const int64_t *positions)
{
    const int64_t half = Hd / 2;
#pragma omp parallel for schedule(static) if (T * (H + G) * Hd >= 65536)
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

/* Decode attention over the paged KV cache: R rows, one query token each, causal over the
 * n[r] positions its sequence has (its own included). q [R][ldq] holds H heads of Hd; query
 * head h reads KV head h / (H/G). Position p of row r is at block tables[r][p / P], offset
 * p % P of the pools k, v [blocks][P][G][Hd]. out [R][H][Hd]. work: R * H * max(n) floats. */
void strata_decode_attention(const float *q, int64_t R, int64_t ldq, int64_t H, int64_t G,
                             int64_t Hd, const float *k, const float *v, int64_t P,
                             const int64_t *tables, int64_t table_stride, const int64_t *n,
                             float scale, float *out, float *work)
{
    int64_t n_max = 0;
    for (int64_t r = 0; r < R; r++)
        n_max = n[r] > n_max ? n[r] : n_max;
    const int64_t per_block = P * G * Hd, group = H / G;
#pragma omp parallel for schedule(dynamic, 1) if (R * H * n_max * Hd >= 32768)
    for (int64_t u = 0; u < R * H; u++) {
        const int64_t r = u / H, h = u % H, g = h / group, len = n[r];
        const int64_t *table = tables + r * table_stride;
        const float *restrict qh = q + r * ldq + h * Hd;
        float *restrict s = work + u * n_max;
        float m = -INFINITY;
        for (int64_t p = 0; p < len; p++) {
            const float *restrict kp = k + table[p / P] * per_block + (p % P) * G * Hd + g * Hd;
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
