/* y = x @ (scale * w).T with int8 weights: fp32 activations, fp32 accumulation, one scale per output channel.
 *
 *   x      [M, K]   float32 activations (rows contiguous, row stride K)
 *   w      [N, K]   int8 weights, symmetric per output channel (w_real[n, k] = scale[n] * w[n, k])
 *   scale  [N]      float32
 *   y      [M, N]   float32 output; only columns n_begin .. n_end-1 are written, so a caller can split the
 *                   output channels over threads
 *
 * Each weight byte is widened to float in registers (AVX2: vpmovsxbd + vcvtdq2ps) right before the FMA, so a
 * weight is read from memory as one byte and never stored as a float. One row (a decode step of one sequence)
 * walks four channels at once (a matrix-vector product, bound by memory: 4x fewer bytes than float32); four or
 * more rows use a 4 x 3 register tile (12 accumulators), which widens each weight once per four rows and is
 * bound by the FMAs, like a float32 GEMM. The scale multiplies the finished dot product (exact: it is
 * constant along k).
 *
 * Built at run time by tokenloop/engine/kernels.py like paged_attention.c (cc -O3 -march=native, -ffast-math at
 * compile time only); without AVX2 the plain C loops below serve (the compiler vectorises what it can). The
 * torch reference `(x @ w.float().T) * scale` is the fallback and what the tests compare with.
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 widen8(const int8_t *p) { /* 8 int8 -> 8 float */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* one row x: y[n] for 4 channels n .. n+3 */
static void row_x4(const float *x, const int8_t *w, int64_t K, float *out4) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const int8_t *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(xv, widen8(w0 + k), a0);
        a1 = _mm256_fmadd_ps(xv, widen8(w1 + k), a1);
        a2 = _mm256_fmadd_ps(xv, widen8(w2 + k), a2);
        a3 = _mm256_fmadd_ps(xv, widen8(w3 + k), a3);
    }
    float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
    for (; k < K; k++) {
        s0 += x[k] * w0[k];
        s1 += x[k] * w1[k];
        s2 += x[k] * w2[k];
        s3 += x[k] * w3[k];
    }
    out4[0] = s0, out4[1] = s1, out4[2] = s2, out4[3] = s3;
}

/* one row x, one channel */
static float row_x1(const float *x, const int8_t *w, int64_t K) {
    __m256 a = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), widen8(w + k), a);
    float s = hsum(a);
    for (; k < K; k++) s += x[k] * w[k];
    return s;
}

/* four rows x (stride K) by three channels: out[r * 3 + c] */
static void tile_4x3(const float *x, const int8_t *w, int64_t K, float *out) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    const int8_t *w0 = w, *w1 = w + K, *w2 = w + 2 * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 b0 = widen8(w0 + k), b1 = widen8(w1 + k), b2 = widen8(w2 + k);
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
    for (; k < K; k++)
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 3; c++) s[r * 3 + c] += x[r * K + k] * w[c * K + k];
    for (int i = 0; i < 12; i++) out[i] = s[i];
}

#else /* portable C: the compiler vectorises the k loops where it can */

static float row_x1(const float *x, const int8_t *w, int64_t K) {
    float s = 0.0f;
    for (int64_t k = 0; k < K; k++) s += x[k] * (float)w[k];
    return s;
}

static void row_x4(const float *x, const int8_t *w, int64_t K, float *out4) {
    for (int c = 0; c < 4; c++) out4[c] = row_x1(x, w + c * K, K);
}

static void tile_4x3(const float *x, const int8_t *w, int64_t K, float *out) {
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 3; c++) out[r * 3 + c] = row_x1(x + r * K, w + c * K, K);
}

#endif

int int8_linear_f32(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, float *y,
                    int64_t N, int64_t n_begin, int64_t n_end) {
    if (M < 0 || K < 1 || n_begin < 0 || n_end > N || n_begin > n_end) return -1;
    const int64_t M4 = M / 4 * 4;
    /* four rows at a time, in 4 x 3 tiles; the channels go in blocks of ~32 KB of weights, each block taken
       through all the rows while it sits in L1/L2 (else a long prompt re-reads every weight from memory once
       per four rows) */
    int64_t block = (32 * 1024) / K / 3 * 3;
    if (block < 3) block = 3;
    for (int64_t n0 = n_begin; n0 < n_end && M4 > 0; n0 += block) {
        const int64_t n1 = n0 + block < n_end ? n0 + block : n_end;
        for (int64_t m = 0; m < M4; m += 4) {
            const float *xm = x + m * K;
            float *ym = y + m * N;
            int64_t n = n0;
            float t[12];
            for (; n + 3 <= n1; n += 3) {
                tile_4x3(xm, w + n * K, K, t);
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < 3; c++) ym[r * N + n + c] = t[r * 3 + c] * scale[n + c];
            }
            for (; n < n1; n++)
                for (int r = 0; r < 4; r++) ym[r * N + n] = row_x1(xm + r * K, w + n * K, K) * scale[n];
        }
    }
    int64_t m = M4;
    /* the rows left over (all of them for a single decode row): four channels at a time */
    for (; m < M; m++) {
        const float *xm = x + m * K;
        float *ym = y + m * N;
        int64_t n = n_begin;
        float t[4];
        for (; n + 4 <= n_end; n += 4) {
            row_x4(xm, w + n * K, K, t);
            for (int c = 0; c < 4; c++) ym[n + c] = t[c] * scale[n + c];
        }
        for (; n < n_end; n++) ym[n] = row_x1(xm, w + n * K, K) * scale[n];
    }
    return 0;
}
