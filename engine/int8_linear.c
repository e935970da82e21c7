/* y = x @ w.T with int8 weights (--weights int8); and the one-row float32 product (f32_linear_f32) that --weights
 * fp32 uses for decode steps of a few tokens.
 *
 *   x      [M, K]          float32 activations (rows contiguous)
 *   q      [N32, K, 32]    int8 weights packed 32 output channels at a time: q[b, k, l] is channel 32b + l at
 *                          column k (N32 = ceil(N / 32); channels past N are zero)
 *   scale  [N32, NG, 32]   float32 scales packed the same way: channel 32b + l, group g of G columns (NG = K / G,
 *                          G divides K); w_real[n, k] = scale[n, k / G] * q[n, k]
 *   y      [M, N]          float32; only columns n_begin .. n_end-1 are written (n_begin a multiple of 32), so
 *                          threads can split the channels
 *
 * Code paths (kernel_common.h; int8_path_supported says which this CPU runs):
 *
 * - portable, avx2, avx512: float32 activations. For each output, for each group g in order, a partial sum of
 *   x[k] * q[k] over the group's columns in order (one FMA each, on the integer-valued weights), then total +=
 *   partial * scale[g] (one FMA). avx2 and avx512 do exactly this per lane, so they give the same bits (portable
 *   C may round differently where the compiler does not fuse). A row's result does not depend on how many rows
 *   came with it (greedy decoding stays batch invariant), nor on the thread split.
 *   - Rows one by one (fewer than six rows, e.g. one decoding stream): each weight byte widened in registers
 *     (vpmovsxbd + vcvtdq2ps) right before its FMA, so every weight is read from memory once, as one byte, from
 *     sequential streams (two 32-channel blocks at a time on avx2, four on avx512: eight FMA chains either way).
 *   - Six rows and more: the weights of 16 (avx2) or 32 (avx512) channels are widened once into a buffer that
 *     stays in L1/L2, then a 6-row register tile runs over it for each six rows (and one smaller tile for the rows
 *     left over), as a float32 GEMM's inner kernel does (OpenBLAS's Haswell sgemm kernel is 6 x 16).
 * - vnni: int8 activations, as llama.cpp's Q8_0 x Q8_0 and torch's dynamic quantization (fbgemm) multiply: each
 *   row of x is quantized per group of G columns (int8_vnni_linear_f32 does it once per call: sx = max|x| / 127),
 *   stored + 128 as uint8 (vpdpbusd multiplies unsigned by signed bytes), and each group's dot product is exact in
 *   int32: sum((xq + 128) * q) - 128 * sum(q), the second term precomputed per channel and group (`comp`, as
 *   fbgemm's row offsets); then total += float(dot) * (scale * sx) (one FMA). Its weights are packed for
 *   vpdpbusd, four columns of a channel in one 32-bit lane: qv [N32, K/4, 32, 4] (kernels.py packs them from q).
 *   Numerics differ from the float32-activation paths; the quality tests force this route to check its contract.
 * - x16-avx2 (path 8, AVX2): activations quantized to 16-bit integers, integer dot products with vpmaddwd (two
 *   products summed per 32-bit lane, twice the multiplies per instruction of the float path's FMAs, and no
 *   conversion of each weight to float), on vnni's packing qv [N32, K/4, 32, 4]. G must be a multiple of 4 and at
 *   most 512 (else -1). Per row m and group g: amax = max |x| over the group (fmaxf in column order),
 *   sx = amax / 32767.0f, inv = amax > 0 ? 32767.0f / amax : 0, xi[k] = lrintf(x[k] * inv) clamped to +-32767
 *   (once per call, shared by both threads); per output channel isum = the sum of xi[k] * q[k] over the group,
 *   exact in int32 (|isum| <= 32767 * 127 * 512 < 2^31); total = fmaf((float)isum, scale * sx, total) for each
 *   group in order. The activations' error is 2^-16 of the group's max (rounding), far below the int8 weights'
 *   own (2^-8 of theirs); a row's bits depend only on that row (any batch, any thread split).
 *
 * Two threads: *_2t runs channels [n_begin, mid) on the calling thread and [mid, n_end) on the process's kernel
 * worker thread (kernel_worker.c, shared by every kernel library), in one call; the same arithmetic per output channel either way.
 *
 * Built at run time by tokenloop/engine/kernels.py for baseline x86-64 (each path under its own target attribute,
 * -ffast-math at compile time only). Returns 0, or < 0: -1 bad arguments, -2 no memory, -3 a path this CPU lacks.
 */
#include "kernel_common.h"

/* ---- portable C: one function for every number of rows, so rows stay batch invariant here too ---- */

static void linear_portable(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t G,
                            float *y, int64_t N, int64_t n_begin, int64_t n_end) {
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
}

#if HAVE_X86

/* ---- AVX2 + FMA ---- */

/* 8 int8 -> 8 float */
AVX2_FN static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* one row x against blocks b and b + 1 (nb = 2) or b alone (nb = 1); out [nb * 32] */
AVX2_FN static void row_blocks(const float *x, const int8_t *q, const float *scale, int64_t K, int64_t G, int64_t b,
                               int nb, float *out) {
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
    const __m256 t[8] = {t0, t1, t2, t3, t4, t5, t6, t7};
    for (int i = 0; i < 4 * nb; i++) _mm256_storeu_ps(out + 8 * i, t[i]);
}

/* channels 16h .. 16h+15 of block b widened to float (no scale): wf[k * 16 + l] */
AVX2_FN static void widen_avx2(const void *ctx, int64_t b, int h, float *wf) {
    const ctx_t *c = ctx;
    const int8_t *p = ((const int8_t *)c->q) + b * c->K * PACK + h * BLOCK;
    for (int64_t k = 0; k < c->K; k++) {
        _mm256_storeu_ps(wf + k * BLOCK, widen8(p + k * PACK));
        _mm256_storeu_ps(wf + k * BLOCK + 8, widen8(p + k * PACK + 8));
    }
}

/* rows m .. m+R-1 (R <= 6) against widened weights wf [K, 16] of channels 16h.. of block b; out [R, 16] */
AVX2_FN INLINE void tile_rows_avx2(const ctx_t *c, int64_t m, const int R, const float *wf, int64_t b, int h,
                                   float *out) {
    const int64_t K = c->K, G = c->G, NG = K / G;
    __m256 t[12], a[12];
    for (int i = 0; i < 12; i++) t[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        for (int i = 0; i < 2 * R; i++) a[i] = _mm256_setzero_ps();
        tile6_sums_avx2(c->x + m * K, wf, K, g * G, (g + 1) * G, R, a);
        const float *s = c->scale + (b * NG + g) * PACK + h * BLOCK;
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
        for (int r = 0; r < R; r++) {
            t[2 * r] = _mm256_fmadd_ps(a[2 * r], s0, t[2 * r]);
            t[2 * r + 1] = _mm256_fmadd_ps(a[2 * r + 1], s1, t[2 * r + 1]);
        }
    }
    for (int i = 0; i < 2 * R; i++) _mm256_storeu_ps(out + i * 8, t[i]);
}

DEFINE_AVX2_TILE()

AVX2_FN static void rows_avx2(const void *ctx, int64_t m, int64_t b, int nb, float *out) {
    const ctx_t *c = ctx;
    row_blocks(c->x + m * c->K, ((const int8_t *)c->q), c->scale, c->K, c->G, b, nb, out);
}

static const steps_t AVX2_STEPS = {BLOCK, 2, widen_avx2, tile_avx2, rows_avx2};

/* ---- AVX-512 F/BW/VL: the avx2 arithmetic on 16 lanes ---- */

/* block b's 32 channels widened to float: wf [K, 32] */
AVX512_FN static void widen_512(const void *ctx, int64_t b, int h, float *wf) {
    const ctx_t *c = ctx;
    const int8_t *p = ((const int8_t *)c->q) + b * c->K * PACK;
    (void)h;
    for (int64_t i = 0; i < c->K * PACK; i += 16) _mm512_storeu_ps(wf + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + i))))); /* the same layout */
}

/* rows m .. m+R-1 (R <= 6) against the widened block wf [K, 32]; out [R, 32] (up to 12 partial sums, 12 totals in
 * registers) */
AVX512_FN INLINE void tile_rows_512(const ctx_t *c, int64_t m, const int R, const float *wf, int64_t b, int h,
                                    float *out) {
    const int64_t K = c->K, G = c->G, NG = K / G;
    __m512 t[12], a[12];
    (void)h;
    for (int i = 0; i < 12; i++) t[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        tile6_sums_512(c->x + m * K, wf, K, g * G, (g + 1) * G, R, a);
        const float *s = c->scale + (b * NG + g) * PACK; /* a[i]: row i / 2, channels 16 * (i % 2) .. */
        const __m512 sv[2] = {_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16)};
        for (int i = 0; i < 2 * R; i++) t[i] = _mm512_fmadd_ps(a[i], sv[i % 2], t[i]);
    }
    for (int i = 0; i < 2 * R; i++) _mm512_storeu_ps(out + i * 16, t[i]);
}

DEFINE_512_STEPS(0)

/* ---- AVX-512 VNNI: int8 activations, integer dot products per group ---- */

DEFINE_VNNI_STEPS(0)

/* ---- float32 weights, a few rows (f32_linear_f32) ---- */

AVX2_FN static int64_t f32_linear_avx2(const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N,
                                       int64_t n_begin, int64_t n_end) {
    const int64_t K16 = K / 16 * 16;
    int64_t n = n_begin;
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
    return n;
}

#endif /* HAVE_X86 */

/* ---- x16-avx2: 16-bit integer activations, vpmaddwd on vnni's packing (the header says the arithmetic) ---- */

#define X16_MAX_GROUP 512

/* the operands of an x16 product, prepared once for both threads */
typedef struct {
    const int16_t *xi; /* [M, K] the rows quantized per group */
    const float *sx;   /* [M, NG] amax / 32767 */
    const int8_t *qv;  /* [N32, K/4, 32, 4] */
    const float *scale;
    int64_t K, G;
} x16_t;

#if HAVE_X86
/* row m against block b; out [32]. A 4-column chunk of the block is 128 bytes: channel l's four columns at 4l.
 * vpmovsxbw of 16 bytes gives channels 4j .. 4j+3, each as two 32-bit lanes of two columns (columns 0-1, 2-3);
 * vpmaddwd against the chunk's four activations (broadcast as one 64-bit pair of pairs) sums each lane's two
 * products. At the group's end vphaddd adds each channel's two lanes and a permutation puts the channels in order. */
AVX2_FN INLINE void x16_row_avx2(const x16_t *c, int64_t m, int64_t b, float *out) {
    const int64_t K = c->K, G = c->G, NG = K / G, C = G / 4, bytes = K * PACK;
    const int16_t *x = c->xi + m * K;
    const int8_t *q = c->qv + b * bytes;
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    __m256 t[4];
    for (int i = 0; i < 4; i++) t[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        __m256i a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_si256();
        for (int64_t i = 0; i < C; i++) {
            const int64_t k = g * G + 4 * i;
            const int8_t *w = q + k * PACK;
            /* T0, not the one-row nta of the AVX-512 paths: on the AVX2-only Zen 3 VM nta made the one-row
             * Gemma 3 lm_head ~2x slower (loaded machine, one run) */
            _mm_prefetch((const char *)(w + PREFETCH_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + PREFETCH_AHEAD + 64), _MM_HINT_T0);
            int64_t four;
            memcpy(&four, x + k, 8);
            const __m256i xb = _mm256_set1_epi64x(four);
            for (int j = 0; j < 8; j++)
                a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16 * j))), xb));
        }
        const __m256 sr = _mm256_set1_ps(c->sx[m * NG + g]);
        const float *s = c->scale + (b * NG + g) * PACK;
        for (int p = 0; p < 4; p++) {
            const __m256i is = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a[2 * p], a[2 * p + 1]), order);
            t[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(_mm256_loadu_ps(s + 8 * p), sr), t[p]);
        }
    }
    for (int p = 0; p < 4; p++) _mm256_storeu_ps(out + 8 * p, t[p]);
}

/* rows m .. m+R-1 (R <= 6) against block b, eight channels at a time: each chunk's 32 bytes of them widened once
 * (two vpmovsxbw) for every row (12 accumulators); out [R, 32]. The same integers and epilogue per channel as
 * x16_row_avx2, so the same bits. */
AVX2_FN INLINE void x16_tile_rows(const x16_t *c, int64_t m, int64_t b, const int R, float *out) {
    const int64_t K = c->K, G = c->G, NG = K / G, C = G / 4;
    const int8_t *q = c->qv + b * K * PACK;
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (int h = 0; h < 4; h++) {
        __m256 t[ROWS];
        for (int r = 0; r < R; r++) t[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < NG; g++) {
            __m256i a[2 * ROWS];
            for (int i = 0; i < 2 * R; i++) a[i] = _mm256_setzero_si256();
            for (int64_t i = 0; i < C; i++) {
                const int64_t k = g * G + 4 * i;
                const int8_t *w = q + k * PACK + 8 * 4 * h;
                if (h == 0) /* the first pass brings the block in; the others find it in L1 */
                    _mm_prefetch((const char *)(w + PREFETCH_AHEAD), _MM_HINT_T0),
                        _mm_prefetch((const char *)(w + PREFETCH_AHEAD + 64), _MM_HINT_T0);
                const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
                const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16)));
                for (int r = 0; r < R; r++) {
                    int64_t four;
                    memcpy(&four, c->xi + (m + r) * K + k, 8);
                    const __m256i xb = _mm256_set1_epi64x(four);
                    a[2 * r] = _mm256_add_epi32(a[2 * r], _mm256_madd_epi16(w0, xb));
                    a[2 * r + 1] = _mm256_add_epi32(a[2 * r + 1], _mm256_madd_epi16(w1, xb));
                }
            }
            const __m256 s = _mm256_loadu_ps(c->scale + (b * NG + g) * PACK + 8 * h);
            for (int r = 0; r < R; r++) {
                const __m256i is = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a[2 * r], a[2 * r + 1]), order);
                const __m256 sr = _mm256_set1_ps(c->sx[(m + r) * NG + g]);
                t[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(s, sr), t[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * PACK + 8 * h, t[r]);
    }
}

#define X16_TILE(r) x16_tile_rows(ctx, m, b, r, out)
AVX2_FN static void tile_x16_avx2(const void *ctx, int64_t m, int R, const float *wf, int64_t b, int h, float *out) {
    (void)wf, (void)h;
    SWITCH_ROWS(R, X16_TILE)
}

AVX2_FN static void rows_x16_avx2(const void *ctx, int64_t m, int64_t b, int nb, float *out) {
    for (int j = 0; j < nb; j++) x16_row_avx2(ctx, m, b + j, out + j * PACK);
}

static const steps_t X16_AVX2_STEPS = {PACK, 4, NULL, tile_x16_avx2, rows_x16_avx2, 2};
#endif

/* the x16 product on activations quantized already */
static int x16_quantized(const int16_t *xi, const float *sx, int64_t M, int64_t K, const int8_t *qv,
                         const float *scale, int64_t G, float *y, int64_t N, int64_t n_begin, int64_t n_end) {
    if (bad_args(M, K, G, N, n_begin, n_end) || G % 4 != 0 || G > X16_MAX_GROUP) return -1;
    if (!path_supported(PATH_AVX2)) return -3;
    if (M == 0 || n_begin == n_end) return 0;
#if HAVE_X86
    const x16_t ctx = {xi, sx, qv, scale, K, G};
    return drive(&X16_AVX2_STEPS, &ctx, M, K, y, N, n_begin / PACK, (n_end + PACK - 1) / PACK, n_end);
#else
    (void)xi, (void)sx, (void)qv, (void)scale, (void)y;
    return -3;
#endif
}

/* x quantized for x16 into one buffer: xi [M * K] int16 then sx [M * NG]; NULL on no memory or bad shapes */
static int16_t *quantize_x16(const float *x, int64_t M, int64_t K, int64_t G, float **sx) {
    if (K < 1 || G < 1 || K % G != 0 || M < 0) return NULL;
    const size_t bytes = (size_t)(2 * M * K + 64) / 64 * 64;
    uint8_t *buf = malloc(bytes + sizeof(float) * (size_t)(M * (K / G) + 1));
    if (!buf) return NULL;
    *sx = (float *)(buf + bytes);
    quantize_groups(x, M, K, G, 32767.0f, 2, buf, *sx);
    return (int16_t *)buf;
}

/* y[:, n_begin:n_end] = x @ w.T for float32 weights w [N, K] (rows contiguous), a few rows x at a time (a decode
 * step of one to a few sequences): four output channels at a time, each a dot product of two 8-lane FMA chains
 * summed at the end. Memory-bound at one row, where it reads the weight once at the machine's bandwidth. */
int f32_linear_f32(const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, int64_t n_begin,
                   int64_t n_end) {
    if (M < 0 || K < 1 || n_begin < 0 || n_end > N || n_begin > n_end) return -1;
    int64_t n = n_begin;
#if HAVE_X86
    static int avx2 = -1;
    if (avx2 < 0) avx2 = path_supported(PATH_AVX2);
    if (avx2) n = f32_linear_avx2(x, M, K, w, y, N, n_begin, n_end);
#endif
    for (; n < n_end; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += x[m * K + k] * w[n * K + k];
            y[m * N + n] = acc;
        }
    return 0;
}

/* ---- the exported products ---- */

int int8_path_supported(int path) { return path == PATH_X16_AVX2 ? path_supported(PATH_AVX2) : path_supported(path); }

int int8_linear_f32(int path, const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t G,
                    float *y, int64_t N, int64_t n_begin, int64_t n_end) {
    if (path == PATH_X16_AVX2) { /* q is vnni's packing qv */
        float *sx;
        int16_t *xi = quantize_x16(x, M, K, G, &sx);
        if (!xi) return bad_args(M, K, G, N, n_begin, n_end) ? -1 : -2;
        const int rc = x16_quantized(xi, sx, M, K, q, scale, G, y, N, n_begin, n_end);
        free(xi);
        return rc;
    }
    if (bad_args(M, K, G, N, n_begin, n_end) || path == PATH_VNNI) return -1;
    if (!path_supported(path)) return -3;
    if (M == 0 || n_begin == n_end) return 0;
    const int64_t b_begin = n_begin / PACK, b_end = (n_end + PACK - 1) / PACK;
#if HAVE_X86
    const ctx_t ctx = {x, NULL, q, scale, NULL, K, G, M == 1};
    if (path == PATH_AVX512) return drive(&AVX512_STEPS, &ctx, M, K, y, N, b_begin, b_end, n_end);
    if (path == PATH_AVX2) return drive(&AVX2_STEPS, &ctx, M, K, y, N, b_begin, b_end, n_end);
#endif
    (void)b_begin, (void)b_end;
    linear_portable(x, M, K, q, scale, G, y, N, n_begin, n_end);
    return 0;
}

/* the vnni product on activations quantized already (xu: uint8 = xq + 128, sx: their scales) */
static int vnni_quantized(const uint8_t *xu, const float *sx, int64_t M, int64_t K, const int8_t *qv,
                          const int32_t *comp, const float *scale, int64_t G, float *y, int64_t N, int64_t n_begin,
                          int64_t n_end) {
    if (bad_args(M, K, G, N, n_begin, n_end) || G % 4 != 0) return -1;
    if (!path_supported(PATH_VNNI)) return -3;
    if (M == 0 || n_begin == n_end) return 0;
#if HAVE_X86
    const vnni_t ctx = {xu, sx, NULL, (const uint8_t *)qv, comp, scale, NULL, K, G};
    return drive(&VNNI_STEPS, &ctx, M, K, y, N, n_begin / PACK, (n_end + PACK - 1) / PACK, n_end);
#else
    (void)xu, (void)sx, (void)qv, (void)comp, (void)scale, (void)y;
    return -3;
#endif
}

/* x quantized per row and group (+ 128, uint8) into one buffer: xu [M * K] then sx [M * NG]; NULL on no memory */
static uint8_t *quantize_x(const float *x, int64_t M, int64_t K, int64_t G, float **sx) {
    if (K < 1 || G < 1 || K % G != 0 || M < 0) return NULL;
    const size_t bytes = (size_t)(M * K + 64) / 64 * 64;
    uint8_t *buf = malloc(bytes + sizeof(float) * (size_t)(M * (K / G) + 1));
    if (!buf) return NULL;
    *sx = (float *)(buf + bytes);
    quantize_rows(x, M, K, G, 1, (int8_t *)buf, *sx);
    return buf;
}

/* y = x @ w.T on the vnni path: qv [N32, K/4, 32, 4] int8, comp [N32, NG, 32] int32 (-128 * the sum of each
 * channel's weights over each group), scale as int8_linear_f32's */
int int8_vnni_linear_f32(const float *x, int64_t M, int64_t K, const int8_t *qv, const int32_t *comp,
                         const float *scale, int64_t G, float *y, int64_t N, int64_t n_begin, int64_t n_end) {
    float *sx;
    uint8_t *xu = quantize_x(x, M, K, G, &sx);
    if (!xu) return bad_args(M, K, G, N, n_begin, n_end) ? -1 : -2;
    const int rc = vnni_quantized(xu, sx, M, K, qv, comp, scale, G, y, N, n_begin, n_end);
    free(xu);
    return rc;
}

/* ---- the second half of the *_2t products, on the process's kernel worker (kernel_worker.h) ---- */

typedef struct {
    int kind; /* 0: int8_linear_f32 on `path`, 1: f32_linear_f32 (w in `fw`), 2: vnni_quantized, 3: x16_quantized */
    int path;
    const float *x;
    int64_t M, K;
    const float *fw;
    const int8_t *q;
    const float *scale;
    int64_t G;
    const uint8_t *xu;
    const float *sx;
    const int32_t *comp;
    float *y;
    int64_t N, n_begin, n_end;
} job_t;

static int run_job(const job_t *j);
#include "kernel_worker.h"

static int run_job(const job_t *j) {
    if (j->kind == 1) return f32_linear_f32(j->x, j->M, j->K, j->fw, j->y, j->N, j->n_begin, j->n_end);
    if (j->kind == 3)
        return x16_quantized((const int16_t *)j->xu, j->sx, j->M, j->K, j->q, j->scale, j->G, j->y, j->N, j->n_begin,
                             j->n_end);
    if (j->kind == 2)
        return vnni_quantized(j->xu, j->sx, j->M, j->K, j->q, j->comp, j->scale, j->G, j->y, j->N, j->n_begin,
                              j->n_end);
    return int8_linear_f32(j->path, j->x, j->M, j->K, j->q, j->scale, j->G, j->y, j->N, j->n_begin, j->n_end);
}

static int split_at(job_t mine, int64_t mid) {
    if (mid % PACK != 0 || mid < mine.n_begin || mid > mine.n_end) return -1;
    job_t theirs = mine;
    mine.n_end = mid, theirs.n_begin = mid;
    return run_split(mine, theirs);
}

/* int8_linear_f32 over channels [n_begin, n_end), split at `mid` (a multiple of 32): [n_begin, mid) here,
 * [mid, n_end) on the worker thread. */
int int8_linear_f32_2t(int path, const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t G,
                       float *y, int64_t N, int64_t n_begin, int64_t mid, int64_t n_end) {
    if (path == PATH_X16_AVX2) { /* x quantized once, here, for both threads */
        float *sx;
        int16_t *xi = quantize_x16(x, M, K, G, &sx);
        if (!xi) return bad_args(M, K, G, N, n_begin, n_end) ? -1 : -2;
        const job_t job = {3, path, x, M, K, NULL, q, scale, G, (const uint8_t *)xi, sx, NULL, y, N, n_begin, n_end};
        const int rc = split_at(job, mid);
        free(xi);
        return rc;
    }
    const job_t job = {0, path, x, M, K, NULL, q, scale, G, NULL, NULL, NULL, y, N, n_begin, n_end};
    return split_at(job, mid);
}

/* int8_vnni_linear_f32 on two threads: x quantized once, here, then the channels split at `mid` */
int int8_vnni_linear_f32_2t(const float *x, int64_t M, int64_t K, const int8_t *qv, const int32_t *comp,
                            const float *scale, int64_t G, float *y, int64_t N, int64_t n_begin, int64_t mid,
                            int64_t n_end) {
    float *sx;
    uint8_t *xu = quantize_x(x, M, K, G, &sx);
    if (!xu) return bad_args(M, K, G, N, n_begin, n_end) ? -1 : -2;
    const job_t job = {2, PATH_VNNI, x, M, K, NULL, qv, scale, G, xu, sx, comp, y, N, n_begin, n_end};
    const int rc = split_at(job, mid);
    free(xu);
    return rc;
}

/* f32_linear_f32 over channels [0, N) on two threads, split at `mid` */
int f32_linear_f32_2t(const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, int64_t mid) {
    if (mid < 0 || mid > N) return -1;
    const job_t mine = {1, PATH_PORTABLE, x, M, K, w, NULL, NULL, 1, NULL, NULL, NULL, y, N, 0, mid};
    job_t theirs = mine;
    theirs.n_begin = mid, theirs.n_end = N;
    return run_split(mine, theirs);
}
