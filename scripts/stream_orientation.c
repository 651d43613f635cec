/* How fast one thread streams cold expert-sized fp32 matrices (512 x 256, DRAM-resident) through
 * a one-row product, by access pattern; docs/benchmarks.md ("Short prompts through the decode
 * kernels", the experts' bandwidth) has the figures. AVX2.
 *
 *     gcc -O3 -march=native -o /tmp/stream_orientation scripts/stream_orientation.c
 *     /tmp/stream_orientation
 *
 *   dot-rows  W stored [F][D]: each output one dot product of a contiguous row with x
 *   rowwise   W [D][F], a row at a time, the F accumulators in L1
 *   chunked   W [D][F] as cpu_kernels.c's product() runs a decode-size product: chunks of
 *             KC input rows, passes of 64 columns with the accumulators in registers
 *   pair/quad chunked, two or four matrices advancing chunk by chunk together
 *   sum       a plain sum of each matrix (what the memory gives one thread)
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define D 512
#define F 256
#define M 1600 /* matrices: 800 MB, far more than any cache */
#define KC 8

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void dot_rows(const float *x, const float *W, float *y)
{
    for (int j = 0; j < F; j++) {
        const float *r = W + j * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < D; i += 32) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(r + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(r + i + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(r + i + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(r + i + 24), a3);
        }
        float o[8];
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        y[j] = ((o[0] + o[4]) + (o[1] + o[5])) + ((o[2] + o[6]) + (o[3] + o[7]));
    }
}

static void rowwise(const float *x, const float *W, float *y)
{
    for (int q = 0; q < F; q += 8)
        _mm256_storeu_ps(y + q, _mm256_setzero_ps());
    for (int i = 0; i < D; i++) {
        const __m256 xv = _mm256_set1_ps(x[i]);
        for (int q = 0; q < F; q += 8)
            _mm256_storeu_ps(y + q, _mm256_fmadd_ps(xv, _mm256_loadu_ps(W + i * F + q),
                                                    _mm256_loadu_ps(y + q)));
    }
}

static inline void chunk(const float *x, const float *W, float *y, int k0)
{
    for (int c = 0; c < F; c += 64) {
        __m256 a[8];
        for (int q = 0; q < 8; q++)
            a[q] = k0 ? _mm256_loadu_ps(y + c + 8 * q) : _mm256_setzero_ps();
        for (int i = k0; i < k0 + KC; i++) {
            const __m256 xv = _mm256_set1_ps(x[i]);
            for (int q = 0; q < 8; q++)
                a[q] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(W + i * F + c + 8 * q), a[q]);
        }
        for (int q = 0; q < 8; q++)
            _mm256_storeu_ps(y + c + 8 * q, a[q]);
    }
}

static void chunked(const float *x, const float *const *W, float *const *y, int n)
{
    for (int k = 0; k < D; k += KC)
        for (int j = 0; j < n; j++)
            chunk(x, W[j], y[j], k);
}

static float sum(const float *W)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (int i = 0; i < D * F; i += 16) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(W + i));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(W + i + 8));
    }
    float o[8];
    _mm256_storeu_ps(o, _mm256_add_ps(s0, s1));
    return o[0] + o[7];
}

int main(void)
{
    const size_t n = (size_t)D * F;
    float *W = aligned_alloc(64, M * n * sizeof(float));
    if (!W)
        return 1;
    for (size_t i = 0; i < M * n; i++)
        W[i] = (float)(i % 97) * 0.01f;
    float x[D], y[4][F], s = 0;
    for (int i = 0; i < D; i++)
        x[i] = 0.001f * i;
    float *ys[4] = {y[0], y[1], y[2], y[3]};
    const double gb = M * n * sizeof(float) / 1e9;
    for (int round = 0; round < 3; round++) {
        double t = now();
        for (int m = 0; m < M; m++)
            dot_rows(x, W + m * n, y[0]);
        const double t_dot = now() - t;
        t = now();
        for (int m = 0; m < M; m++)
            rowwise(x, W + m * n, y[0]);
        const double t_row = now() - t;
        double t_chunked[3];
        for (int v = 0, group = 1; v < 3; v++, group *= 2) {
            t = now();
            for (int m = 0; m < M; m += group) {
                const float *ws[4] = {W + m * n, W + (m + 1) * n, W + (m + 2) * n,
                                      W + (m + 3) * n};
                chunked(x, ws, ys, group);
            }
            t_chunked[v] = now() - t;
        }
        t = now();
        for (int m = 0; m < M; m++)
            s += sum(W + m * n);
        const double t_sum = now() - t;
        printf("GB/s: dot-rows %.1f  rowwise %.1f  chunked %.1f  pair %.1f  quad %.1f  sum %.1f\n",
               gb / t_dot, gb / t_row, gb / t_chunked[0], gb / t_chunked[1], gb / t_chunked[2],
               gb / t_sum);
    }
    return s == 0.125f && y[0][0] == 0.0f; /* keep the results alive */
}
