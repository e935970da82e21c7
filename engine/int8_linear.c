/* y = x @ w.T with int8 weights: float32 activations, float32 accumulation.
 *
 *   x      [M, K]          float32 activations (rows contiguous)
 *   q      [N8, K, 8]      int8 weights packed eight output channels at a time: q[j, k, l] is channel 8j + l at
 *                          column k (N8 = ceil(N / 8); channels past N are zero)
 *   scale  [N8, NG, 8]     float32 scales packed the same way: channel 8j + l, group g of G columns (NG = ceil(K / G))
 *                          w_real[n, k] = scale[n, k / G] * q[n, k]
 *   y      [M, N]          float32; only columns n_begin .. n_end-1 are written (n_begin a multiple of 8), so
 *                          threads can split the channels
 *
 * Every path multiplies x by the same float weights, w_real = (float)q * scale, one FMA per column k in order
 * k = 0, 1, ..., K-1, one accumulator lane per output: a row's result does not depend on how many rows came with
 * it (greedy decoding stays batch invariant), nor on the thread split.
 *
 * - Rows one by one (fewer than six rows, e.g. one decoding sequence): 64 channels at a time, each weight byte
 *   widened in registers (AVX2 vpmovsxbd + vcvtdq2ps, times its scale) right before its FMA: each weight is read
 *   from memory as one byte; eight independent accumulators keep both FMA pipes busy.
 * - Six rows and more: the weights of 16 channels are widened once into a buffer [K, 16] that stays in L1/L2,
 *   then a 6 x 16 register tile (12 accumulators: x broadcast, two weight vectors per column) runs over it for
 *   each six rows, as a float32 GEMM's inner kernel does (OpenBLAS's Haswell sgemm kernel is 6 x 16 too).
 *
 * Built at run time by tokenloop/engine/kernels.py like paged_attention.c (cc -O3 -march=native, -ffast-math at
 * compile time only); without AVX2 + FMA the plain C below serves (the same order of operations, slower).
 * Returns 0, or < 0 on bad arguments or no memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 16 /* channels widened together for the tiled path */
#define ROWS 6   /* rows of one register tile */

/* the widened weights of channel group j (8 channels) at column k: dst[l] = q * scale */
static inline void widen_group_k(const int8_t *qj, const float *sj, int64_t k, int64_t G, float *dst) {
    const int8_t *src = qj + k * 8;
    const float *s = sj + (k / G) * 8;
    for (int l = 0; l < 8; l++) dst[l] = (float)src[l] * s[l];
}

/* the widened weights of channel group j (8 channels) for all columns: dst[k * stride + l] = q * scale */
static void widen_block(const int8_t *qj, const float *sj, int64_t K, int64_t G, float *dst, int64_t stride) {
    for (int64_t k0 = 0; k0 < K; k0 += G) {
        const float *s = sj + (k0 / G) * 8;
        const int64_t k1 = k0 + G < K ? k0 + G : K;
        for (int64_t k = k0; k < k1; k++)
            for (int l = 0; l < 8; l++) dst[k * stride + l] = (float)qj[k * 8 + l] * s[l];
    }
}

/* write out[0..7] (channels n..n+7) into y, only the channels below n_end */
static inline void store8(float *y, int64_t n, int64_t n_end, const float *out) {
    const int64_t count = n_end - n < 8 ? n_end - n : 8;
    memcpy(y + n, out, sizeof(float) * (size_t)count);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 widen8(const int8_t *p, const float *s) { /* 8 int8 -> 8 float, times 8 scales */
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                         _mm256_loadu_ps(s));
}

/* one row x against `ng` (1..8) channel groups starting at qj / sj (group stride K*8 / NG*8); out [ng * 8] */
static void row_groups(const float *x, const int8_t *qj, const float *sj, int64_t K, int64_t G, int64_t NG, int ng,
                       float *out) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    const int64_t qs = K * 8, ss = NG * 8;
    if (ng == 8) { /* the common case, fully unrolled: eight chains */
        __m256 a0 = a[0], a1 = a[0], a2 = a[0], a3 = a[0], a4 = a[0], a5 = a[0], a6 = a[0], a7 = a[0];
        for (int64_t k0 = 0; k0 < K; k0 += G) {
          const float *s = sj + (k0 / G) * 8;
          const int64_t k1 = k0 + G < K ? k0 + G : K;
          for (int64_t k = k0; k < k1; k++) {
            const __m256 xv = _mm256_broadcast_ss(x + k);
            const int8_t *p = qj + k * 8;
            a0 = _mm256_fmadd_ps(xv, widen8(p, s), a0);
            a1 = _mm256_fmadd_ps(xv, widen8(p + qs, s + ss), a1);
            a2 = _mm256_fmadd_ps(xv, widen8(p + 2 * qs, s + 2 * ss), a2);
            a3 = _mm256_fmadd_ps(xv, widen8(p + 3 * qs, s + 3 * ss), a3);
            a4 = _mm256_fmadd_ps(xv, widen8(p + 4 * qs, s + 4 * ss), a4);
            a5 = _mm256_fmadd_ps(xv, widen8(p + 5 * qs, s + 5 * ss), a5);
            a6 = _mm256_fmadd_ps(xv, widen8(p + 6 * qs, s + 6 * ss), a6);
            a7 = _mm256_fmadd_ps(xv, widen8(p + 7 * qs, s + 7 * ss), a7);
          }
        }
        a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3, a[4] = a4, a[5] = a5, a[6] = a6, a[7] = a7;
    } else {
        for (int j = 0; j < ng; j++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k++)
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), widen8(qj + j * qs + k * 8, sj + j * ss + (k / G) * 8),
                                      acc);
            a[j] = acc;
        }
    }
    for (int j = 0; j < ng; j++) _mm256_storeu_ps(out + j * 8, a[j]);
}

/* six rows x (stride K) against widened weights wf [K, 8 * ng] (ng = 1 or 2); out [6, 8 * ng] */
static void tile6(const float *x, const float *wf, int64_t K, int ng, float *out) {
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K, *x4 = x + 4 * K, *x5 = x + 5 * K;
    if (ng == 2) { /* 12 accumulators, two weight vectors, one broadcast: 15 of the 16 registers */
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
        __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
        for (int64_t k = 0; k < K; k++) {
            const __m256 b0 = _mm256_loadu_ps(wf + k * 16), b1 = _mm256_loadu_ps(wf + k * 16 + 8);
            __m256 xv = _mm256_broadcast_ss(x0 + k);
            a00 = _mm256_fmadd_ps(xv, b0, a00), a01 = _mm256_fmadd_ps(xv, b1, a01);
            xv = _mm256_broadcast_ss(x1 + k);
            a10 = _mm256_fmadd_ps(xv, b0, a10), a11 = _mm256_fmadd_ps(xv, b1, a11);
            xv = _mm256_broadcast_ss(x2 + k);
            a20 = _mm256_fmadd_ps(xv, b0, a20), a21 = _mm256_fmadd_ps(xv, b1, a21);
            xv = _mm256_broadcast_ss(x3 + k);
            a30 = _mm256_fmadd_ps(xv, b0, a30), a31 = _mm256_fmadd_ps(xv, b1, a31);
            xv = _mm256_broadcast_ss(x4 + k);
            a40 = _mm256_fmadd_ps(xv, b0, a40), a41 = _mm256_fmadd_ps(xv, b1, a41);
            xv = _mm256_broadcast_ss(x5 + k);
            a50 = _mm256_fmadd_ps(xv, b0, a50), a51 = _mm256_fmadd_ps(xv, b1, a51);
        }
        _mm256_storeu_ps(out, a00), _mm256_storeu_ps(out + 8, a01), _mm256_storeu_ps(out + 16, a10);
        _mm256_storeu_ps(out + 24, a11), _mm256_storeu_ps(out + 32, a20), _mm256_storeu_ps(out + 40, a21);
        _mm256_storeu_ps(out + 48, a30), _mm256_storeu_ps(out + 56, a31), _mm256_storeu_ps(out + 64, a40);
        _mm256_storeu_ps(out + 72, a41), _mm256_storeu_ps(out + 80, a50), _mm256_storeu_ps(out + 88, a51);
    } else {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        for (int64_t k = 0; k < K; k++) {
            const __m256 b0 = _mm256_loadu_ps(wf + k * 8);
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + k), b0, a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(x1 + k), b0, a1);
            a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(x2 + k), b0, a2);
            a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(x3 + k), b0, a3);
            a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(x4 + k), b0, a4);
            a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(x5 + k), b0, a5);
        }
        _mm256_storeu_ps(out, a0), _mm256_storeu_ps(out + 8, a1), _mm256_storeu_ps(out + 16, a2);
        _mm256_storeu_ps(out + 24, a3), _mm256_storeu_ps(out + 32, a4), _mm256_storeu_ps(out + 40, a5);
    }
}

#else /* portable C: the same order of operations (fused multiply-adds where the compiler contracts them) */

static void row_groups(const float *x, const int8_t *qj, const float *sj, int64_t K, int64_t G, int64_t NG, int ng,
                       float *out) {
    float w[8];
    for (int j = 0; j < ng; j++) {
        float acc[8] = {0};
        for (int64_t k = 0; k < K; k++) {
            widen_group_k(qj + j * K * 8, sj + j * NG * 8, k, G, w);
            for (int l = 0; l < 8; l++) acc[l] += x[k] * w[l];
        }
        memcpy(out + j * 8, acc, sizeof acc);
    }
}

static void tile6(const float *x, const float *wf, int64_t K, int ng, float *out) {
    const int width = 8 * ng;
    for (int r = 0; r < 6; r++)
        for (int c = 0; c < width; c++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += x[r * K + k] * wf[k * width + c];
            out[r * width + c] = acc;
        }
}

#endif

int int8_linear_f32(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t G,
                    float *y, int64_t N, int64_t n_begin, int64_t n_end) {
    if (M < 0 || K < 1 || G < 1 || n_begin < 0 || n_begin % 8 != 0 || n_end > N || n_begin > n_end) return -1;
    const int64_t NG = (K + G - 1) / G, M6 = M / ROWS * ROWS;
    const int64_t j_begin = n_begin / 8, j_end = (n_end + 7) / 8;
    /* six rows and more: widen 16 channels at a time, then 6 x 16 tiles */
    if (M6 > 0) {
        float *wf = malloc(sizeof(float) * (size_t)(K * BLOCK));
        if (!wf) return -2;
        float t[ROWS * BLOCK];
        for (int64_t j = j_begin; j < j_end; j += 2) {
            const int ng = j + 1 < j_end ? 2 : 1, width = 8 * ng;
            for (int h = 0; h < ng; h++)
                widen_block(q + (j + h) * K * 8, scale + (j + h) * NG * 8, K, G, wf + h * 8, width);
            for (int64_t m = 0; m < M6; m += ROWS) {
                tile6(x + m * K, wf, K, ng, t);
                for (int r = 0; r < ROWS; r++)
                    for (int h = 0; h < ng; h++) store8(y + (m + r) * N, 8 * (j + h), n_end, t + r * width + h * 8);
            }
        }
        free(wf);
    }
    /* the rows left over (all of them below six rows): 64 channels at a time, widened on the fly */
    float out[64];
    for (int64_t m = M6; m < M; m++) {
        for (int64_t j = j_begin; j < j_end; j += 8) {
            const int ng = j_end - j < 8 ? (int)(j_end - j) : 8;
            row_groups(x + m * K, q + j * K * 8, scale + j * NG * 8, K, G, NG, ng, out);
            for (int h = 0; h < ng; h++) store8(y + m * N, 8 * (j + h), n_end, out + h * 8);
        }
    }
    return 0;
}
