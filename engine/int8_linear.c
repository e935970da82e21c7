/* y = x @ w.T with int8 weights: float32 activations, float32 accumulation.
 *
 *   x      [M, K]    float32 activations (rows contiguous)
 *   w      [N, K]    int8 weights, symmetric: w_real[n, k] = scale[n, k / G] * w[n, k]
 *   scale  [N, NG]   float32, one per output channel and group of G input columns (NG = ceil(K / G); the
 *                    engine uses G = 32, as llama.cpp's Q8_0 does, and G = K means one scale per channel)
 *   y      [M, N]    float32; only columns n_begin .. n_end-1 are written, so threads can split the channels
 *
 * Every path multiplies x by the same float weights, w_real = (float)w * scale, and sums them in the same order
 * (8 lanes along k, lane sums added at the end), so a row's result does not depend on how many other rows came
 * with it: greedy decoding stays batch invariant.
 *
 * - Fewer than four rows (a decode step of few sequences): each row walks four channels at once, widening each
 *   weight byte in registers (AVX2 vpmovsxbd + vcvtdq2ps, then the scale): bound by memory, 4x fewer bytes
 *   than float32.
 * - Four rows or more: the weights of a block of channels (~48 KB as float32) are widened once into a scratch
 *   buffer that stays in L1/L2, then every group of four rows runs 4 x 3 register tiles over it (12 float
 *   accumulators), like a float32 GEMM's inner kernel.
 *
 * Built at run time by tokenloop/engine/kernels.py like paged_attention.c (cc -O3 -march=native, -ffast-math at
 * compile time only); without AVX2 + FMA the plain C below serves. Returns 0, or < 0 on bad arguments / no memory.
 */
#include <stdint.h>
#include <stdlib.h>

#define BLOCK_FLOATS (12 * 1024) /* scratch: ~48 KB of widened weights per channel block */

/* float weights of channel row w (K int8) into dst (K floats): (float)w[k] * scale[k / G] */
static void widen_row(const int8_t *w, const float *scale, int64_t K, int64_t G, float *dst) {
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, g++) {
        const int64_t k1 = k0 + G < K ? k0 + G : K;
        const float s = scale[g];
        for (int64_t k = k0; k < k1; k++) dst[k] = (float)w[k] * s;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline __m256 widen8(const int8_t *p, __m256 s) { /* 8 int8 -> 8 float, times the group's scale */
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))), s);
}

/* the 8-lane main part of a dot product; `tail` gets the index where the scalar remainder starts */
#define K8(K) ((K) / 8 * 8)

/* one row x against channels c = 0..nc-1 (nc <= 4) of w (stride K), widened on the fly; G % 8 == 0 */
static void row_q(const float *x, const int8_t *w, const float *scale, int64_t K, int64_t G, int64_t NG, int nc,
                  float *out) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const int64_t k8 = K8(K);
    for (int64_t k0 = 0, g = 0; k0 < k8; k0 += G, g++) {
        const int64_t k1 = k0 + G < k8 ? k0 + G : k8;
        for (int c = 0; c < nc; c++) {
            const __m256 s = _mm256_set1_ps(scale[c * NG + g]);
            const int8_t *wc = w + c * K;
            __m256 acc = a[c];
            for (int64_t k = k0; k < k1; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), widen8(wc + k, s), acc);
            a[c] = acc;
        }
    }
    for (int c = 0; c < nc; c++) {
        float sum = hsum(a[c]);
        for (int64_t k = k8; k < K; k++) sum += x[k] * ((float)w[c * K + k] * scale[c * NG + k / G]);
        out[c] = sum;
    }
}

/* one row x against one widened channel wf (K floats) */
static float row_f(const float *x, const float *wf, int64_t K) {
    __m256 a = _mm256_setzero_ps();
    const int64_t k8 = K8(K);
    for (int64_t k = 0; k < k8; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(wf + k), a);
    float sum = hsum(a);
    for (int64_t k = k8; k < K; k++) sum += x[k] * wf[k];
    return sum;
}

/* four rows x (stride K) by three widened channels wf (stride K): out[r * 3 + c] */
static void tile_4x3(const float *x, const float *wf, int64_t K, float *out) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    const float *w0 = wf, *w1 = wf + K, *w2 = wf + 2 * K;
    const int64_t k8 = K8(K);
    for (int64_t k = 0; k < k8; k += 8) {
        const __m256 b0 = _mm256_loadu_ps(w0 + k), b1 = _mm256_loadu_ps(w1 + k), b2 = _mm256_loadu_ps(w2 + k);
        __m256 xv = _mm256_loadu_ps(x0 + k);
        a00 = _mm256_fmadd_ps(xv, b0, a00), a01 = _mm256_fmadd_ps(xv, b1, a01), a02 = _mm256_fmadd_ps(xv, b2, a02);
        xv = _mm256_loadu_ps(x1 + k);
        a10 = _mm256_fmadd_ps(xv, b0, a10), a11 = _mm256_fmadd_ps(xv, b1, a11), a12 = _mm256_fmadd_ps(xv, b2, a12);
        xv = _mm256_loadu_ps(x2 + k);
        a20 = _mm256_fmadd_ps(xv, b0, a20), a21 = _mm256_fmadd_ps(xv, b1, a21), a22 = _mm256_fmadd_ps(xv, b2, a22);
        xv = _mm256_loadu_ps(x3 + k);
        a30 = _mm256_fmadd_ps(xv, b0, a30), a31 = _mm256_fmadd_ps(xv, b1, a31), a32 = _mm256_fmadd_ps(xv, b2, a32);
    }
    float s[12] = {hsum(a00), hsum(a01), hsum(a02), hsum(a10), hsum(a11), hsum(a12),
                   hsum(a20), hsum(a21), hsum(a22), hsum(a30), hsum(a31), hsum(a32)};
    for (int64_t k = k8; k < K; k++)
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 3; c++) s[r * 3 + c] += x[r * K + k] * wf[c * K + k];
    for (int i = 0; i < 12; i++) out[i] = s[i];
}

#else /* portable C, the same arithmetic in the same order as far as plain C allows */

static float row_f(const float *x, const float *wf, int64_t K) {
    float sum = 0.0f;
    for (int64_t k = 0; k < K; k++) sum += x[k] * wf[k];
    return sum;
}

static void row_q(const float *x, const int8_t *w, const float *scale, int64_t K, int64_t G, int64_t NG, int nc,
                  float *out) {
    for (int c = 0; c < nc; c++) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++) sum += x[k] * ((float)w[c * K + k] * scale[c * NG + k / G]);
        out[c] = sum;
    }
}

static void tile_4x3(const float *x, const float *wf, int64_t K, float *out) {
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 3; c++) out[r * 3 + c] = row_f(x + r * K, wf + c * K, K);
}

#endif

int int8_linear_f32(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, int64_t G,
                    float *y, int64_t N, int64_t n_begin, int64_t n_end) {
    if (M < 0 || K < 1 || G < 1 || (G % 8 != 0 && G < K) || n_begin < 0 || n_end > N || n_begin > n_end) return -1;
    const int64_t NG = (K + G - 1) / G, M4 = M / 4 * 4;
    /* four rows and more: widen a block of channels once, then 4 x 3 tiles over it */
    if (M4 > 0) {
        int64_t block = BLOCK_FLOATS / K / 3 * 3;
        if (block < 3) block = 3;
        float *wf = malloc(sizeof(float) * (size_t)(block * K));
        if (!wf) return -2;
        for (int64_t n0 = n_begin; n0 < n_end; n0 += block) {
            const int64_t nb = n0 + block < n_end ? block : n_end - n0;
            for (int64_t c = 0; c < nb; c++) widen_row(w + (n0 + c) * K, scale + (n0 + c) * NG, K, G, wf + c * K);
            for (int64_t m = 0; m < M4; m += 4) {
                const float *xm = x + m * K;
                float *ym = y + m * N + n0;
                int64_t c = 0;
                float t[12];
                for (; c + 3 <= nb; c += 3) {
                    tile_4x3(xm, wf + c * K, K, t);
                    for (int r = 0; r < 4; r++)
                        for (int j = 0; j < 3; j++) ym[r * N + c + j] = t[r * 3 + j];
                }
                for (; c < nb; c++)
                    for (int r = 0; r < 4; r++) ym[r * N + c] = row_f(xm + r * K, wf + c * K, K);
            }
        }
        free(wf);
    }
    /* the rows left over (all of them below four rows): four channels at a time, widened on the fly */
    for (int64_t m = M4; m < M; m++) {
        const float *xm = x + m * K;
        float *ym = y + m * N;
        for (int64_t n = n_begin; n < n_end; n += 4) {
            const int nc = n_end - n < 4 ? (int)(n_end - n) : 4;
            row_q(xm, w + n * K, scale + n * NG, K, G, NG, nc, ym + n);
        }
    }
    return 0;
}
