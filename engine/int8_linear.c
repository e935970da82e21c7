/* y = x @ w.T with int8 weights: float32 activations, float32 accumulation; and the one-row float32 product
 * (f32_linear_f32) that --weights fp32 uses for decode steps of a few tokens.
 *
 *   x      [M, K]          float32 activations (rows contiguous)
 *   q      [N32, K, 32]    int8 weights packed 32 output channels at a time: q[b, k, l] is channel 32b + l at
 *                          column k (N32 = ceil(N / 32); channels past N are zero)
 *   scale  [N32, NG, 32]   float32 scales packed the same way: channel 32b + l, group g of G columns (NG = K / G,
 *                          G divides K); w_real[n, k] = scale[n, k / G] * q[n, k]
 *   y      [M, N]          float32; only columns n_begin .. n_end-1 are written (n_begin a multiple of 32), so
 *                          threads can split the channels
 *
 * Arithmetic, the same on every path: for each output, for each group g in order, a partial sum of x[k] * q[k]
 * over the group's columns in order (one FMA each, on the integer-valued weights), then total += partial *
 * scale[g] (one FMA). A row's result does not depend on how many rows came with it (greedy decoding stays batch
 * invariant), nor on the thread split. Scaling once per group instead of once per weight saves a multiply per
 * weight, and the products of one group are exact small-integer multiples of x, so it is also the more accurate
 * order.
 *
 * - Rows one by one (fewer than six rows, e.g. one decoding sequence): two 32-channel blocks at a time, each
 *   weight byte widened in registers (AVX2 vpmovsxbd + vcvtdq2ps) right before its FMA, so every weight is read
 *   from memory once, as one byte, from two sequential streams (a block's columns are contiguous: with eight
 *   channels per column instead, the eight strided streams ran ~1.5x slower); eight chains keep both FMA pipes
 *   busy.
 * - Six rows and more: the weights of 16 channels are widened once into a buffer [K, 16] that stays in L1/L2,
 *   then a 6 x 16 register tile (12 partial sums: x broadcast, two weight vectors per column) runs over it for
 *   each six rows, as a float32 GEMM's inner kernel does (OpenBLAS's Haswell sgemm kernel is 6 x 16 too); the
 *   totals live in memory and take one FMA per group.
 *
 * Two threads: int8_linear_f32_2t runs channels [n_begin, mid) on the calling thread and [mid, n_end) on one
 * worker thread of this library, in one call. A worker woken through Python (a queue, then the GIL) took ~35 us per
 * product, more than half of what a one-row product of this model takes; this worker spins (pause, then
 * sched_yield, so any other runnable thread gets the core) for up to `spin_us` after each job, then sleeps on a
 * futex, so back-to-back products of one forward pass hand over in about a microsecond and an idle engine costs
 * no CPU. One caller at a time uses the worker; a concurrent caller (a second engine in the process) computes
 * its whole range itself. Same arithmetic per output channel either way.
 *
 * Built at run time by tokenloop/engine/kernels.py like paged_attention.c (cc -O3 -march=native, -ffast-math at
 * compile time only); without AVX2 + FMA the plain C below serves (one function for every path, slower).
 * Returns 0, or < 0 on bad arguments or no memory.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#define PACK 32  /* output channels per packed block */
#define BLOCK 16 /* channels widened together for the tiled path */
#define ROWS 6   /* rows of one register tile */

/* write out[0..count-1] (channels n..) into y, only the channels below n_end */
static inline void store_n(float *y, int64_t n, int64_t n_end, const float *out, int64_t count) {
    if (n_end - n < count) count = n_end - n;
    if (count > 0) memcpy(y + n, out, sizeof(float) * (size_t)count);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 int8 -> 8 float */
static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* one row x against blocks b and b + 1 (nb = 2) or b alone (nb = 1); out [nb * 32] */
static void row_blocks(const float *x, const int8_t *q, const float *scale, int64_t K, int64_t G, int64_t b, int nb,
                       float *out) {
    const int64_t NG = K / G;
    const int8_t *qb = q + b * K * PACK, *qc = qb + K * PACK;
    const float *sb = scale + b * NG * PACK, *sc = sb + NG * PACK;
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0, t4 = t0, t5 = t0, t6 = t0, t7 = t0;
    if (nb == 2) {
        for (int64_t g = 0; g < NG; g++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                const __m256 xv = _mm256_broadcast_ss(x + k);
                const int8_t *p = qb + k * PACK, *r = qc + k * PACK;
                a0 = _mm256_fmadd_ps(xv, widen8(p), a0), a1 = _mm256_fmadd_ps(xv, widen8(p + 8), a1);
                a2 = _mm256_fmadd_ps(xv, widen8(p + 16), a2), a3 = _mm256_fmadd_ps(xv, widen8(p + 24), a3);
                a4 = _mm256_fmadd_ps(xv, widen8(r), a4), a5 = _mm256_fmadd_ps(xv, widen8(r + 8), a5);
                a6 = _mm256_fmadd_ps(xv, widen8(r + 16), a6), a7 = _mm256_fmadd_ps(xv, widen8(r + 24), a7);
            }
            const float *s = sb + g * PACK, *u = sc + g * PACK;
            t0 = _mm256_fmadd_ps(a0, _mm256_loadu_ps(s), t0), t1 = _mm256_fmadd_ps(a1, _mm256_loadu_ps(s + 8), t1);
            t2 = _mm256_fmadd_ps(a2, _mm256_loadu_ps(s + 16), t2), t3 = _mm256_fmadd_ps(a3, _mm256_loadu_ps(s + 24), t3);
            t4 = _mm256_fmadd_ps(a4, _mm256_loadu_ps(u), t4), t5 = _mm256_fmadd_ps(a5, _mm256_loadu_ps(u + 8), t5);
            t6 = _mm256_fmadd_ps(a6, _mm256_loadu_ps(u + 16), t6), t7 = _mm256_fmadd_ps(a7, _mm256_loadu_ps(u + 24), t7);
        }
    } else {
        for (int64_t g = 0; g < NG; g++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                const __m256 xv = _mm256_broadcast_ss(x + k);
                const int8_t *p = qb + k * PACK;
                a0 = _mm256_fmadd_ps(xv, widen8(p), a0), a1 = _mm256_fmadd_ps(xv, widen8(p + 8), a1);
                a2 = _mm256_fmadd_ps(xv, widen8(p + 16), a2), a3 = _mm256_fmadd_ps(xv, widen8(p + 24), a3);
            }
            const float *s = sb + g * PACK;
            t0 = _mm256_fmadd_ps(a0, _mm256_loadu_ps(s), t0), t1 = _mm256_fmadd_ps(a1, _mm256_loadu_ps(s + 8), t1);
            t2 = _mm256_fmadd_ps(a2, _mm256_loadu_ps(s + 16), t2), t3 = _mm256_fmadd_ps(a3, _mm256_loadu_ps(s + 24), t3);
        }
    }
    _mm256_storeu_ps(out, t0), _mm256_storeu_ps(out + 8, t1), _mm256_storeu_ps(out + 16, t2);
    _mm256_storeu_ps(out + 24, t3);
    if (nb == 2)
        _mm256_storeu_ps(out + 32, t4), _mm256_storeu_ps(out + 40, t5), _mm256_storeu_ps(out + 48, t6),
            _mm256_storeu_ps(out + 56, t7);
}

/* channels 16h .. 16h+15 of block b widened to float (no scale): wf[k * 16 + l] */
static void widen_half(const int8_t *q, int64_t K, int64_t b, int h, float *wf) {
    const int8_t *p = q + b * K * PACK + h * BLOCK;
    for (int64_t k = 0; k < K; k++) {
        _mm256_storeu_ps(wf + k * BLOCK, widen8(p + k * PACK));
        _mm256_storeu_ps(wf + k * BLOCK + 8, widen8(p + k * PACK + 8));
    }
}

/* six rows x (stride K) against widened weights wf [K, 16] of channels 16h.. of block b; out [6, 16] */
static void tile6(const float *x, const float *wf, const float *scale, int64_t K, int64_t G, int64_t b, int h,
                  float *out) {
    const int64_t NG = K / G;
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K, *x4 = x + 4 * K, *x5 = x + 5 * K;
    __m256 t[12];
    for (int i = 0; i < 12; i++) t[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < NG; g++) { /* 12 partial sums, two weight vectors, one broadcast: 15 of 16 registers */
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
        __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
        for (int64_t k = g * G; k < (g + 1) * G; k++) {
            const __m256 b0 = _mm256_loadu_ps(wf + k * BLOCK), b1 = _mm256_loadu_ps(wf + k * BLOCK + 8);
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
        const float *s = scale + (b * NG + g) * PACK + h * BLOCK;
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
        t[0] = _mm256_fmadd_ps(a00, s0, t[0]), t[1] = _mm256_fmadd_ps(a01, s1, t[1]);
        t[2] = _mm256_fmadd_ps(a10, s0, t[2]), t[3] = _mm256_fmadd_ps(a11, s1, t[3]);
        t[4] = _mm256_fmadd_ps(a20, s0, t[4]), t[5] = _mm256_fmadd_ps(a21, s1, t[5]);
        t[6] = _mm256_fmadd_ps(a30, s0, t[6]), t[7] = _mm256_fmadd_ps(a31, s1, t[7]);
        t[8] = _mm256_fmadd_ps(a40, s0, t[8]), t[9] = _mm256_fmadd_ps(a41, s1, t[9]);
        t[10] = _mm256_fmadd_ps(a50, s0, t[10]), t[11] = _mm256_fmadd_ps(a51, s1, t[11]);
    }
    for (int i = 0; i < 12; i++) _mm256_storeu_ps(out + i * 8, t[i]);
}

int int8_linear_f32(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t G,
                    float *y, int64_t N, int64_t n_begin, int64_t n_end) {
    if (M < 0 || K < 1 || G < 1 || K % G != 0 || n_begin < 0 || n_begin % PACK != 0 || n_end > N || n_begin > n_end)
        return -1;
    const int64_t M6 = M / ROWS * ROWS, b_begin = n_begin / PACK, b_end = (n_end + PACK - 1) / PACK;
    /* six rows and more: widen 16 channels at a time, then 6 x 16 tiles */
    if (M6 > 0) {
        float *wf = malloc(sizeof(float) * (size_t)(K * BLOCK));
        if (!wf) return -2;
        float t[ROWS * BLOCK];
        for (int64_t b = b_begin; b < b_end; b++)
            for (int h = 0; h < PACK / BLOCK; h++) {
                const int64_t n = b * PACK + h * BLOCK;
                if (n >= n_end) break;
                widen_half(q, K, b, h, wf);
                for (int64_t m = 0; m < M6; m += ROWS) {
                    tile6(x + m * K, wf, scale, K, G, b, h, t);
                    for (int r = 0; r < ROWS; r++) store_n(y + (m + r) * N, n, n_end, t + r * BLOCK, BLOCK);
                }
            }
        free(wf);
    }
    /* the rows left over (all of them below six rows): two blocks at a time, widened on the fly */
    float out[2 * PACK];
    for (int64_t m = M6; m < M; m++)
        for (int64_t b = b_begin; b < b_end; b += 2) {
            const int nb = b + 1 < b_end ? 2 : 1;
            row_blocks(x + m * K, q, scale, K, G, b, nb, out);
            store_n(y + m * N, b * PACK, n_end, out, nb * PACK);
        }
    return 0;
}

#else /* portable C: one function for every number of rows, so rows stay batch invariant here too */

int int8_linear_f32(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t G,
                    float *y, int64_t N, int64_t n_begin, int64_t n_end) {
    if (M < 0 || K < 1 || G < 1 || K % G != 0 || n_begin < 0 || n_begin % PACK != 0 || n_end > N || n_begin > n_end)
        return -1;
    const int64_t NG = K / G;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n_begin; n < n_end; n++) {
            const int64_t b = n / PACK, l = n % PACK;
            float total = 0.0f;
            for (int64_t g = 0; g < NG; g++) {
                float partial = 0.0f;
                for (int64_t k = g * G; k < (g + 1) * G; k++) partial += x[m * K + k] * (float)q[(b * K + k) * PACK + l];
                total += partial * scale[(b * NG + g) * PACK + l];
            }
            y[m * N + n] = total;
        }
    return 0;
}

#endif

/* y[:, n_begin:n_end] = x @ w.T for float32 weights w [N, K] (rows contiguous), a few rows x at a time (a decode
 * step of one to a few sequences): four output channels at a time, each a dot product of two 8-lane FMA chains
 * summed at the end. Memory-bound at one row, where it reads the weight once at the machine's bandwidth. */
int f32_linear_f32(const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, int64_t n_begin,
                   int64_t n_end) {
    if (M < 0 || K < 1 || n_begin < 0 || n_end > N || n_begin > n_end) return -1;
    int64_t n = n_begin;
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t K16 = K / 16 * 16;
    for (; n + 4 <= n_end; n += 4) {
        const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
            for (int64_t k = 0; k < K16; k += 16) {
                const __m256 xa = _mm256_loadu_ps(xm + k), xb = _mm256_loadu_ps(xm + k + 8);
                a0 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(w0 + k), a0), b0 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w0 + k + 8), b0);
                a1 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(w1 + k), a1), b1 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w1 + k + 8), b1);
                a2 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(w2 + k), a2), b2 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w2 + k + 8), b2);
                a3 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(w3 + k), a3), b3 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w3 + k + 8), b3);
            }
            float t[4][8];
            _mm256_storeu_ps(t[0], _mm256_add_ps(a0, b0)), _mm256_storeu_ps(t[1], _mm256_add_ps(a1, b1));
            _mm256_storeu_ps(t[2], _mm256_add_ps(a2, b2)), _mm256_storeu_ps(t[3], _mm256_add_ps(a3, b3));
            const float *ws[4] = {w0, w1, w2, w3};
            for (int r = 0; r < 4; r++) {
                float acc = ((t[r][0] + t[r][1]) + (t[r][2] + t[r][3])) + ((t[r][4] + t[r][5]) + (t[r][6] + t[r][7]));
                for (int64_t k = K16; k < K; k++) acc += xm[k] * ws[r][k];
                y[m * N + n + r] = acc;
            }
        }
    }
#endif
    for (; n < n_end; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += x[m * K + k] * w[n * K + k];
            y[m * N + n] = acc;
        }
    return 0;
}

/* ---- one worker thread for int8_linear_f32_2t ---- */

typedef struct {
    int kind; /* 0: int8_linear_f32, 1: f32_linear_f32 (w in `fw`) */
    const float *x;
    int64_t M, K;
    const float *fw;
    const int8_t *q;
    const float *scale;
    int64_t G;
    float *y;
    int64_t N, n_begin, n_end;
    int rc;
} job_t;

static int run_job(const job_t *j);
#define WORKER_THREAD_NAME "tokenloop-i8"
#include "kernel_worker.h"

/* How long (microseconds) the worker spins for its next job before it sleeps. */
void int8_set_spin_us(int64_t spin_us) { worker_spin_ns = spin_us < 0 ? 0 : spin_us * 1000; }

static int run_job(const job_t *j) {
    return j->kind == 1 ? f32_linear_f32(j->x, j->M, j->K, j->fw, j->y, j->N, j->n_begin, j->n_end)
                        : int8_linear_f32(j->x, j->M, j->K, j->q, j->scale, j->G, j->y, j->N, j->n_begin, j->n_end);
}

/* int8_linear_f32 over channels [n_begin, n_end), split at `mid` (a multiple of 8): [n_begin, mid) here,
 * [mid, n_end) on the worker thread. */
int int8_linear_f32_2t(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t G,
                       float *y, int64_t N, int64_t n_begin, int64_t mid, int64_t n_end) {
    if (mid % 8 != 0 || mid < n_begin || mid > n_end) return -1;
    const job_t mine = {0, x, M, K, NULL, q, scale, G, y, N, n_begin, mid, 0};
    job_t theirs = mine;
    theirs.n_begin = mid, theirs.n_end = n_end;
    return run_split(mine, theirs);
}

/* f32_linear_f32 over channels [0, N) on two threads, split at `mid` */
int f32_linear_f32_2t(const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, int64_t mid) {
    if (mid < 0 || mid > N) return -1;
    const job_t mine = {1, x, M, K, w, NULL, NULL, 1, y, N, 0, mid, 0};
    job_t theirs = mine;
    theirs.n_begin = mid, theirs.n_end = N;
    return run_split(mine, theirs);
}
