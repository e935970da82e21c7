/* y = x @ w.T with 4-bit weights (--weights int4): float32 activations, float32 accumulation.
 *
 *   x      [M, K]             float32 activations (rows contiguous)
 *   q      [N32, K, 16]       uint8, two 4-bit weights per byte, 32 output channels per block: byte j of column k
 *                             of block b holds channel 32b + j in its low nibble and channel 32b + 16 + j in its
 *                             high nibble (N32 = ceil(N / 32); channels past N are zero)
 *   sm     [N32, NG, 2, 32]   IEEE half floats: the scale d (sm[b, g, 0, l]) and the minimum m (sm[b, g, 1, l]) of
 *                             channel 32b + l over group g of G columns (NG = K / G, G divides K);
 *                             w_real[n, k] = d[n, k / G] * q[n, k] + m[n, k / G]  (llama.cpp's Q4_1 block)
 *   y      [M, N]             float32; only columns n_begin .. n_end-1 are written (n_begin a multiple of 32)
 *
 * Arithmetic, the same for every row count and thread split: xs[g] = the sum of the row's x over group g (one
 * function, in order); for each group in order, partial = the sum of x[k] * q[k] over its columns in order (one
 * FMA each on the integer-valued nibbles 0..15), then total += partial * d, then total += xs[g] * m. A row's
 * result does not depend on how many rows came with it, so greedy decoding stays batch invariant.
 *
 * Paths (`path` argument; int4_path_supported() says which this CPU runs; engine/kernels.py defaults to the fastest
 * exact one, and the start-up calibration (engine/matmul.py) times them all):
 *   1 portable C: any CPU, any compiler; the channel loops are left to the compiler to vectorise.
 *   2 AVX2 + FMA + F16C (x86-64, chosen at run time from the CPU's flags, compiled with a target attribute so the
 *     library builds and loads on CPUs without it):
 *     - fewer than six rows (a decoding stream): two 32-channel blocks at a time; each 8 bytes of a column are
 *       widened to 32-bit lanes (one vpmovzxbd from memory) and split there into the low nibbles (and) and the high
 *       ones (shift), each converted (vcvtdq2ps) right before its FMA: 3.5 instructions per 8 weights, against 3 for
 *       int8's; every weight is read from memory once as half a byte, from two sequential streams;
 *     - six rows and more: 16 channels widened once into a float buffer [K, 16] that stays in L1/L2, then a
 *       6 x 16 register tile over it (12 partial sums) for each six rows and one smaller tile for the rows left
 *       over, as int8_linear.c does.
 *   3 AVX-512 F/BW/VL: the same arithmetic per output on 16 lanes (identical bits): one row against up to four
 *     blocks at once (kernel_common.h's row_blocks512, each block's stream prefetched ahead), 6 x 32 tiles.
 *   4 vnni: int8 activations (kernel_common.h), its own numerics.
 *   5 x22-portable, 6 x22-avx2, 7 x22-vnni: activations quantized to 22-bit integers, integer dot products; the three
 *     give identical bits (integer sums are exact, and the float epilogue is the same sequence of operations).
 *     Weights in vnni's packing qv [N32, K/4, 16, 4] (four columns of a channel in one 32-bit lane, the low nibbles
 *     channels 0..15 of the block, the high ones 16..31). G must be a multiple of 4 and at most 64 (else -1).
 *     Per row m and group g of G columns:
 *       amax = max |x| over the group (fmaxf in column order), sx = amax / 2097151.0f,
 *       inv = amax > 0 ? 2097151.0f / amax : 0, xi[k] = lrintf(x[k] * inv) clamped to [-2097151, 2097151];
 *       the planes (int8) xh = xi >> 14 (arithmetic: -128 .. 127), xm = (xi >> 7) & 127, xl = xi & 127, so that
 *       xi = xh * 16384 + xm * 128 + xl; stored [M, 3, K] once per call, shared by both threads;
 *       xs[m, g] = sx * (float)(the exact int32 sum of xi over the group).
 *     Per output channel n: isum = (dot(q, xh) << 14) + (dot(q, xm) << 7) + dot(q, xl) = dot(q, xi) over the group,
 *       exact in int32: |isum| <= 15 * 64 * 2097151 = 2013264960 < 2^31 - 1, and each term alone at most
 *       15 * 128 * 64 * 16384 = 2013265920 (so no sum of them wraps either);
 *     total = 0; for each group in order: total = fmaf((float)isum, d * sx, total) (d * sx one float multiply of the
 *       half scale, as float, by sx), then total = fmaf(xs[m, g], mn, total) (mn the half minimum): vnni's epilogue.
 *     The error of xi is at float32's own level (2^-22 of the group's max, rounding), so the products stay within
 *     float32 rounding of the exact path's, unlike vnni's int8 activations; a row's bits depend only on that row.
 *
 * Two threads: int4_linear_f32_2t runs channels [n_begin, mid) on the calling thread and [mid, n_end) on the
 * process's kernel worker thread in one call (kernel_worker.c: one worker for every kernel library, which spins
 * briefly for its next job, then sleeps on a futex). Returns 0, or < 0 on bad arguments, no memory, or a path this CPU lacks.
 */
#include "kernel_common.h"

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in float */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* xs[m * NG + g] = sum of x[m, g*G .. (g+1)*G-1], in order. One function for every path and row count. */
__attribute__((noinline)) static void group_sums(const float *x, int64_t M, int64_t K, int64_t G, float *xs) {
    const int64_t NG = K / G;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < NG; g++) {
            float s = 0.0f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) s += x[m * K + k];
            xs[m * NG + g] = s;
        }
}

/* ---- portable C ---- */

static void linear_portable(const float *x, const float *xs, int64_t M, int64_t K, const uint8_t *q,
                            const uint16_t *sm, int64_t G, float *y, int64_t N, int64_t b_begin, int64_t b_end,
                            int64_t n_end) {
    (void)N;
    const int64_t NG = K / G;
    float total[PACK], partial[PACK], d[PACK], mn[PACK];
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = b_begin; b < b_end; b++) {
            const uint8_t *qb = q + b * K * (PACK / 2);
            for (int l = 0; l < PACK; l++) total[l] = 0.0f;
            for (int64_t g = 0; g < NG; g++) {
                for (int l = 0; l < PACK; l++) partial[l] = 0.0f;
                for (int64_t k = g * G; k < (g + 1) * G; k++) {
                    const float xv = x[m * K + k];
                    const uint8_t *p = qb + k * (PACK / 2);
                    for (int l = 0; l < PACK / 2; l++) partial[l] += xv * (float)(p[l] & 15);
                    for (int l = 0; l < PACK / 2; l++) partial[l + PACK / 2] += xv * (float)(p[l] >> 4);
                }
                const uint16_t *s = sm + (b * NG + g) * 2 * PACK;
                for (int l = 0; l < PACK; l++) d[l] = half_to_float(s[l]), mn[l] = half_to_float(s[PACK + l]);
                const float xg = xs[m * NG + g];
                for (int l = 0; l < PACK; l++) total[l] += partial[l] * d[l];
                for (int l = 0; l < PACK; l++) total[l] += xg * mn[l];
            }
            store_n(y + m * N, b * PACK, n_end, total, PACK);
        }
}

/* ---- AVX2 + FMA + F16C ---- */

#if HAVE_X86

AVX2_FN static inline __m256 lo8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
AVX2_FN static inline __m256 hi8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))); }
/* 8 bytes -> 8 int32 lanes (one vpmovzxbd from memory); the low nibbles, then the high ones, as floats */
AVX2_FN static inline __m256i widen8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
AVX2_FN static inline __m256 low4(__m256i v, __m256i mask) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, mask)); }
AVX2_FN static inline __m256 high4(__m256i v) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
AVX2_FN static inline __m256 half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* one row x against blocks b and b + 1 (nb = 2) or b alone (nb = 1); out [nb * 32] */
AVX2_FN static void row_blocks_avx2(const float *x, const float *xs, const uint8_t *q, const uint16_t *sm, int64_t K,
                                    int64_t G, int64_t b, int nb, float *out) {
    const int64_t NG = K / G;
    const uint8_t *qb = q + b * K * (PACK / 2), *qc = qb + K * (PACK / 2);
    const uint16_t *sb = sm + b * NG * 2 * PACK, *sc = sb + NG * 2 * PACK;
    const __m256i mask = _mm256_set1_epi32(0x0f);
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0, t4 = t0, t5 = t0, t6 = t0, t7 = t0;
    for (int64_t g = 0; g < NG; g++) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        if (nb == 2) {
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                const __m256 xv = _mm256_broadcast_ss(x + k);
                const uint8_t *p = qb + k * 16, *r = qc + k * 16;
                __m256i v = widen8(p), w = widen8(p + 8);  /* channels 0..7 | 16..23, 8..15 | 24..31 */
                a0 = _mm256_fmadd_ps(xv, low4(v, mask), a0), a1 = _mm256_fmadd_ps(xv, low4(w, mask), a1);
                a2 = _mm256_fmadd_ps(xv, high4(v), a2), a3 = _mm256_fmadd_ps(xv, high4(w), a3);
                v = widen8(r), w = widen8(r + 8);
                a4 = _mm256_fmadd_ps(xv, low4(v, mask), a4), a5 = _mm256_fmadd_ps(xv, low4(w, mask), a5);
                a6 = _mm256_fmadd_ps(xv, high4(v), a6), a7 = _mm256_fmadd_ps(xv, high4(w), a7);
            }
        } else {
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                const __m256 xv = _mm256_broadcast_ss(x + k);
                const uint8_t *p = qb + k * 16;
                const __m256i v = widen8(p), w = widen8(p + 8);
                a0 = _mm256_fmadd_ps(xv, low4(v, mask), a0), a1 = _mm256_fmadd_ps(xv, low4(w, mask), a1);
                a2 = _mm256_fmadd_ps(xv, high4(v), a2), a3 = _mm256_fmadd_ps(xv, high4(w), a3);
            }
        }
        const __m256 xg = _mm256_broadcast_ss(xs + g);
        const uint16_t *s = sb + g * 2 * PACK;
        t0 = _mm256_fmadd_ps(a0, half8(s), t0), t1 = _mm256_fmadd_ps(a1, half8(s + 8), t1);
        t2 = _mm256_fmadd_ps(a2, half8(s + 16), t2), t3 = _mm256_fmadd_ps(a3, half8(s + 24), t3);
        t0 = _mm256_fmadd_ps(xg, half8(s + 32), t0), t1 = _mm256_fmadd_ps(xg, half8(s + 40), t1);
        t2 = _mm256_fmadd_ps(xg, half8(s + 48), t2), t3 = _mm256_fmadd_ps(xg, half8(s + 56), t3);
        if (nb == 2) {
            const uint16_t *u = sc + g * 2 * PACK;
            t4 = _mm256_fmadd_ps(a4, half8(u), t4), t5 = _mm256_fmadd_ps(a5, half8(u + 8), t5);
            t6 = _mm256_fmadd_ps(a6, half8(u + 16), t6), t7 = _mm256_fmadd_ps(a7, half8(u + 24), t7);
            t4 = _mm256_fmadd_ps(xg, half8(u + 32), t4), t5 = _mm256_fmadd_ps(xg, half8(u + 40), t5);
            t6 = _mm256_fmadd_ps(xg, half8(u + 48), t6), t7 = _mm256_fmadd_ps(xg, half8(u + 56), t7);
        }
    }
    const __m256 t[8] = {t0, t1, t2, t3, t4, t5, t6, t7};
    for (int i = 0; i < 4 * nb; i++) _mm256_storeu_ps(out + 8 * i, t[i]);
}

/* channels 16h .. 16h+15 of block b (h = 0: the low nibbles, 1: the high ones) as floats: wf[k * 16 + l] */
AVX2_FN static void widen_avx2(const void *ctx, int64_t b, int h, float *wf) {
    const ctx_t *c = ctx;
    const uint8_t *p = ((const uint8_t *)c->q) + b * c->K * (PACK / 2);
    const __m128i mask = _mm_set1_epi8(0x0f);
    for (int64_t k = 0; k < c->K; k++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(p + k * 16));
        v = _mm_and_si128(h ? _mm_srli_epi16(v, 4) : v, mask);
        _mm256_storeu_ps(wf + k * BLOCK, lo8(v));
        _mm256_storeu_ps(wf + k * BLOCK + 8, hi8(v));
    }
}

/* rows m .. m+R-1 (R <= 6) against widened weights wf [K, 16] of channels 16h.. of block b; out [R, 16] */
AVX2_FN INLINE void tile_rows_avx2(const ctx_t *c, int64_t m, const int R, const float *wf, int64_t b, int h,
                                   float *out) {
    const int64_t K = c->K, G = c->G, NG = K / G;
    const float *xs = c->xs + m * NG;
    __m256 t[12], a[12];
    for (int i = 0; i < 12; i++) t[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        for (int i = 0; i < 2 * R; i++) a[i] = _mm256_setzero_ps();
        tile6_sums_avx2(c->x + m * K, wf, K, g * G, (g + 1) * G, R, a);
        const uint16_t *s = c->sm + (b * NG + g) * 2 * PACK + h * BLOCK;
        const __m256 d0 = half8(s), d1 = half8(s + 8), m0 = half8(s + PACK), m1 = half8(s + PACK + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xg = _mm256_broadcast_ss(xs + r * NG + g);
            t[2 * r] = _mm256_fmadd_ps(xg, m0, _mm256_fmadd_ps(a[2 * r], d0, t[2 * r]));
            t[2 * r + 1] = _mm256_fmadd_ps(xg, m1, _mm256_fmadd_ps(a[2 * r + 1], d1, t[2 * r + 1]));
        }
    }
    for (int i = 0; i < 2 * R; i++) _mm256_storeu_ps(out + i * 8, t[i]);
}

DEFINE_AVX2_TILE()

AVX2_FN static void rows_avx2(const void *ctx, int64_t m, int64_t b, int nb, float *out) {
    const ctx_t *c = ctx;
    const int64_t NG = c->K / c->G;
    row_blocks_avx2(c->x + m * c->K, c->xs + m * NG, ((const uint8_t *)c->q), c->sm, c->K, c->G, b, nb, out);
}

static const steps_t AVX2_STEPS = {BLOCK, 2, widen_avx2, tile_avx2, rows_avx2};

/* ---- AVX-512 F/BW/VL: the avx2 arithmetic on 16 lanes ---- */


/* block b's 32 channels as floats: wf [K, 32] */
AVX512_FN static void widen_512(const void *ctx, int64_t b, int h, float *wf) {
    const ctx_t *c = ctx;
    const uint8_t *p = ((const uint8_t *)c->q) + b * c->K * (PACK / 2);
    const __m512i mask = _mm512_set1_epi32(0x0f);
    (void)h;
    for (int64_t k = 0; k < c->K; k++) {
        const __m512i v = nibbles16(p + k * (PACK / 2));
        _mm512_storeu_ps(wf + k * PACK, _mm512_cvtepi32_ps(_mm512_and_si512(v, mask)));
        _mm512_storeu_ps(wf + k * PACK + 16, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)));
    }
}

/* rows m .. m+R-1 (R <= 6) against the widened block wf [K, 32]; out [R, 32] */
AVX512_FN INLINE void tile_rows_512(const ctx_t *c, int64_t m, const int R, const float *wf, int64_t b, int h,
                                    float *out) {
    const int64_t K = c->K, G = c->G, NG = K / G;
    const float *xs = c->xs + m * NG;
    __m512 t[12], a[12];
    (void)h;
    for (int i = 0; i < 12; i++) t[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        tile6_sums_512(c->x + m * K, wf, K, g * G, (g + 1) * G, R, a);
        const uint16_t *s = c->sm + (b * NG + g) * 2 * PACK;
        const __m512 d0 = half16(s), d1 = half16(s + 16), m0 = half16(s + 32), m1 = half16(s + 48);
        for (int r = 0; r < R; r++) {
            const __m512 xg = _mm512_set1_ps(xs[r * NG + g]);
            t[2 * r] = _mm512_fmadd_ps(xg, m0, _mm512_fmadd_ps(a[2 * r], d0, t[2 * r]));
            t[2 * r + 1] = _mm512_fmadd_ps(xg, m1, _mm512_fmadd_ps(a[2 * r + 1], d1, t[2 * r + 1]));
        }
    }
    for (int i = 0; i < 2 * R; i++) _mm512_storeu_ps(out + i * 16, t[i]);
}

DEFINE_512_STEPS(1)

/* ---- AVX-512 VNNI: int8 activations (signed) times the nibbles (unsigned), integer dot products per group ---- */

DEFINE_VNNI_STEPS(1)

#endif /* HAVE_X86 */

/* ---- x22: 4-bit weights times activations quantized to 22-bit integers (paths 5, 6, 7; the header says the
 * arithmetic). Every path reads vnni's packing qv [N32, K/4, 16, 4] and the planes xp [M, 3, K] (xh, xm, xl). ---- */

#define X22_MAX 2097151 /* 2^21 - 1: the largest |xi| */

/* the operands of an x22 product, prepared once for both threads */
typedef struct {
    const int8_t *xp;  /* [M, 3, K]: each row's planes xh, xm, xl */
    const float *sx;   /* [M, NG] amax / X22_MAX */
    const float *xs;   /* [M, NG] sx * the exact sum of the group's xi */
    const uint8_t *qv; /* [N32, K/4, 16, 4] */
    const uint16_t *sm;
    int64_t K, G;
    int nta; /* one row: the weights' prefetch is non-temporal (kernel_common.h, PREFETCH_AHEAD) */
} x22_t;

/* a group's scale sx and its inverse, from its amax: one function for the scalar and the AVX-512 quantization */
static inline __attribute__((always_inline)) void x22_scales(float amax, float *s, float *inv) {
    *s = amax / 2097151.0f, *inv = amax > 0.0f ? 2097151.0f / amax : 0.0f;
}

/* x [M, K] -> the planes of xi = lrintf(x * (X22_MAX / amax)) per row and group (the same integers for every path and
 * row count, so a row's do not depend on the batch; quantize22_512 is this on 16 lanes, the same bits) */
static void quantize22(const float *x, int64_t M, int64_t K, int64_t G, int8_t *xp, float *sx, float *xs) {
    const int64_t NG = K / G;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < NG; g++) {
            const float *v = x + m * K + g * G;
            float amax = 0.0f, s, inv;
            for (int64_t k = 0; k < G; k++) amax = fmaxf(amax, fabsf(v[k]));
            x22_scales(amax, &s, &inv);
            int8_t *h = xp + m * 3 * K + g * G, *mid = h + K, *l = mid + K;
            int32_t sum = 0; /* |sum| <= 64 * (2^21 - 1) < 2^27 */
            for (int64_t k = 0; k < G; k++) {
                long r = lrintf(v[k] * inv);
                r = r > X22_MAX ? X22_MAX : r < -X22_MAX ? -X22_MAX : r;
                const int32_t xi = (int32_t)r;
                sum += xi;
                h[k] = (int8_t)(xi >> 14), mid[k] = (int8_t)((xi >> 7) & 127), l[k] = (int8_t)(xi & 127);
            }
            sx[m * NG + g] = s;
            xs[m * NG + g] = s * (float)sum;
        }
}

#if HAVE_X86
/* quantize22 on 16 lanes (x22-vnni's preparation): max |x| is exact in any order, v * inv one rounding, vcvtps2dq
 * rounds to nearest even as lrintf does, the sum is exact: the same planes and scales */
VNNI_FN static void quantize22_512(const float *x, int64_t M, int64_t K, int64_t G, int8_t *xp, float *sx, float *xs) {
    const int64_t NG = K / G;
    const __m512i top = _mm512_set1_epi32(X22_MAX), bottom = _mm512_set1_epi32(-X22_MAX), low7 = _mm512_set1_epi32(127);
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < NG; g++) {
            const float *v = x + m * K + g * G;
            __m512 vmax = _mm512_setzero_ps();
            for (int64_t k = 0; k < G; k += 16) {
                const __mmask16 live = G - k >= 16 ? 0xffff : (__mmask16)((1u << (G - k)) - 1);
                vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(live, v + k)));
            }
            float s, inv;
            x22_scales(_mm512_reduce_max_ps(vmax), &s, &inv);
            const __m512 vinv = _mm512_set1_ps(inv);
            int8_t *h = xp + m * 3 * K + g * G, *mid = h + K, *l = mid + K;
            __m512i sum = _mm512_setzero_si512();
            for (int64_t k = 0; k < G; k += 16) {
                const __mmask16 live = G - k >= 16 ? 0xffff : (__mmask16)((1u << (G - k)) - 1);
                __m512i xi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, v + k), vinv));
                xi = _mm512_max_epi32(_mm512_min_epi32(xi, top), bottom);
                sum = _mm512_add_epi32(sum, xi);
                _mm_mask_storeu_epi8(h + k, live, _mm512_cvtepi32_epi8(_mm512_srai_epi32(xi, 14)));
                _mm_mask_storeu_epi8(mid + k, live, _mm512_cvtepi32_epi8(_mm512_and_si512(_mm512_srai_epi32(xi, 7), low7)));
                _mm_mask_storeu_epi8(l + k, live, _mm512_cvtepi32_epi8(_mm512_and_si512(xi, low7)));
            }
            sx[m * NG + g] = s;
            xs[m * NG + g] = s * (float)_mm512_reduce_add_epi32(sum);
        }
}
#endif

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* portable C: the exact dot products per channel and group (in int32: see the header's bound), then the epilogue with
 * fmaf, the operation the SIMD paths' FMAs do */
static void x22_portable(const x22_t *c, int64_t M, float *y, int64_t N, int64_t b_begin, int64_t b_end,
                         int64_t n_end) {
    const int64_t K = c->K, G = c->G, NG = K / G;
    float total[PACK];
    int32_t xi[64], isum[PACK];
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = b_begin; b < b_end; b++) {
            for (int l = 0; l < PACK; l++) total[l] = 0.0f;
            for (int64_t g = 0; g < NG; g++) {
                const int8_t *h = c->xp + m * 3 * K + g * G, *mid = h + K, *lo = mid + K;
                for (int64_t k = 0; k < G; k++) xi[k] = h[k] * 16384 + mid[k] * 128 + lo[k];
                const uint8_t *w = c->qv + (b * (K / 4) + g * (G / 4)) * (2 * PACK);
                for (int l = 0; l < PACK; l++) isum[l] = 0;
                for (int64_t k = 0; k < G; k++) {
                    const uint8_t *p = w + (k / 4) * (2 * PACK) + k % 4;
                    for (int l = 0; l < PACK / 2; l++) {
                        isum[l] += (p[4 * l] & 15) * xi[k];
                        isum[l + PACK / 2] += (p[4 * l] >> 4) * xi[k];
                    }
                }
                const uint16_t *s = c->sm + (b * NG + g) * 2 * PACK;
                const float sx = c->sx[m * NG + g], xg = c->xs[m * NG + g];
                for (int l = 0; l < PACK; l++) {
                    const float ds = half_to_float(s[l]) * sx;
                    total[l] = fmaf((float)isum[l], ds, total[l]);
                    total[l] = fmaf(xg, half_to_float(s[PACK + l]), total[l]);
                }
            }
            store_n(y + m * N, b * PACK, n_end, total, PACK);
        }
}

#if HAVE_X86

/* ---- x22-vnni: vpdpbusd (the weight bytes unsigned, a plane signed). A 64-byte chunk v holds channels 0..15 in its
 * low nibbles and 16..31 in its high ones, so without any shift: B = dot(v & 0xf0, plane) = 16 * the high channels'
 * dot product, A = dot(v, plane) = the low channels' + B. Per plane then lo = A - B and hi = B >> 4 (B a multiple of
 * 16: exact), combined as lo = (lo_h << 14) + (lo_m << 7) + lo_l, hi = (B_h << 10) + (B_m << 3) + (B_l >> 4). Bounds:
 * |A| <= 255 * 128 * 64 < 2^21, and each combined term as in the header's, so no int32 wraps. ---- */

/* acc += the dot products of a's unsigned bytes and b's signed ones, four per lane (vpdpbusd), in inline assembly: the
 * intrinsic's tied accumulator makes gcc 12 copy and spill the 24 accumulators of x22_row_blocks through the stack
 * (twice the time) */
VNNI_FN static inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* one block's six vpdpbusd on its 64 bytes at column k: A into r0..r2, B into r3..r5 (planes h, m, l) */
#define X22_BLOCK(j, r0, r1, r2, r3, r4, r5)                                                                       \
    do {                                                                                                            \
        PREFETCH_WEIGHTS(q + (j) * bytes + ahead, c->nta);                                                         \
        const __m512i v = _mm512_loadu_si512(q + (j) * bytes + k * (PACK / 2));                                    \
        const __m512i w1 = _mm512_and_si512(v, hi);                                                                 \
        r0 = dpbusd(r0, v, vh), r1 = dpbusd(r1, v, vm), r2 = dpbusd(r2, v, vl);                                     \
        r3 = dpbusd(r3, w1, vh), r4 = dpbusd(r4, w1, vm), r5 = dpbusd(r5, w1, vl);                                  \
    } while (0)

/* a block's group: the planes combined (above), then the float epilogue (header) into t[0], t[1] */
VNNI_FN INLINE void x22_epilogue(const x22_t *c, int64_t m, int64_t bj, int64_t g, __m512i r0, __m512i r1, __m512i r2,
                                 __m512i r3, __m512i r4, __m512i r5, __m512 *t) {
    const int64_t NG = c->K / c->G;
    const __m512 sr = _mm512_set1_ps(c->sx[m * NG + g]), xg = _mm512_set1_ps(c->xs[m * NG + g]);
    r0 = _mm512_sub_epi32(r0, r3), r1 = _mm512_sub_epi32(r1, r4), r2 = _mm512_sub_epi32(r2, r5);
    const __m512i i0 = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(r0, 14), _mm512_slli_epi32(r1, 7)), r2);
    const __m512i i1 = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(r3, 10), _mm512_slli_epi32(r4, 3)),
                                        _mm512_srai_epi32(r5, 4));
    const uint16_t *s = c->sm + (bj * NG + g) * 2 * PACK;
    t[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(half16(s), sr), t[0]);
    t[0] = _mm512_fmadd_ps(xg, half16(s + 32), t[0]);
    t[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(half16(s + 16), sr), t[1]);
    t[1] = _mm512_fmadd_ps(xg, half16(s + 48), t[1]);
}

/* row m against blocks b .. b + NB - 1 (NB <= 4, measured best: 2 and 3 are 5-10 % slower): all three planes at
 * once, their three 4-byte broadcasts per four columns shared by the blocks, six vpdpbusd and one and per 64 bytes
 * of weights (6 NB int32 accumulators, named so that they stay in registers; 24 + 3 + 4 of the 32 zmm); each block's
 * stream prefetched PREFETCH_AHEAD bytes ahead as row_blocks512's; out [NB * 32] */
VNNI_FN INLINE void x22_row_blocks(const x22_t *c, int64_t m, int64_t b, const int NB, float *out) {
    const int64_t K = c->K, G = c->G, NG = K / G, C = G / 4, bytes = K * (PACK / 2);
    const int8_t *xh = c->xp + m * 3 * K, *xm = xh + K, *xl = xm + K;
    const uint8_t *q = c->qv + b * bytes;
    const __m512i hi = _mm512_set1_epi8((char)0xf0);
    __m512 t[8];
    for (int j = 0; j < 2 * NB; j++) t[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        const __m512i z = _mm512_setzero_si512();
        __m512i a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, b0 = z, b1 = z, b2 = z, b3 = z, b4 = z, b5 = z;
        __m512i c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, e0 = z, e1 = z, e2 = z, e3 = z, e4 = z, e5 = z;
        for (int64_t i = 0; i < C; i++) {
            const int64_t k = g * G + 4 * i;
            const __m512i vh = _mm512_set1_epi32(load4(xh + k)), vm = _mm512_set1_epi32(load4(xm + k)),
                          vl = _mm512_set1_epi32(load4(xl + k));
            int64_t ahead = k * (PACK / 2) + PREFETCH_AHEAD;
            if (ahead >= bytes) ahead += (NB - 1) * bytes;
            X22_BLOCK(0, a0, a1, a2, a3, a4, a5);
            if (NB > 1) X22_BLOCK(1, b0, b1, b2, b3, b4, b5);
            if (NB > 2) X22_BLOCK(2, c0, c1, c2, c3, c4, c5);
            if (NB > 3) X22_BLOCK(3, e0, e1, e2, e3, e4, e5);
        }
        x22_epilogue(c, m, b, g, a0, a1, a2, a3, a4, a5, t);
        if (NB > 1) x22_epilogue(c, m, b + 1, g, b0, b1, b2, b3, b4, b5, t + 2);
        if (NB > 2) x22_epilogue(c, m, b + 2, g, c0, c1, c2, c3, c4, c5, t + 4);
        if (NB > 3) x22_epilogue(c, m, b + 3, g, e0, e1, e2, e3, e4, e5, t + 6);
    }
    for (int j = 0; j < 2 * NB; j++) _mm512_storeu_ps(out + 16 * j, t[j]);
}

/* one plane P (0: xh, 1: xm, 2: xl) of R rows against a group's C chunks at w, combined into s with its shifts */
VNNI_FN INLINE void x22_plane(const int8_t *x, int64_t stride, const uint8_t *w, int64_t C, const int R, const int P,
                              __m512i *s) {
    const __m512i lo = _mm512_set1_epi8(0x0f), hi = _mm512_set1_epi8((char)0xf0);
    __m512i a[12];
    for (int i = 0; i < 2 * R; i++) a[i] = _mm512_setzero_si512();
    for (int64_t i = 0; i < C; i++) {
        const __m512i v = _mm512_loadu_si512(w + i * 2 * PACK);
        const __m512i w0 = _mm512_and_si512(v, lo), w1 = _mm512_and_si512(v, hi);
        for (int r = 0; r < R; r++) {
            const __m512i xb = _mm512_set1_epi32(load4(x + r * stride + 4 * i));
            a[2 * r] = dpbusd(a[2 * r], w0, xb);
            a[2 * r + 1] = dpbusd(a[2 * r + 1], w1, xb);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512i l = P == 0 ? _mm512_slli_epi32(a[2 * r], 14) : P == 1 ? _mm512_slli_epi32(a[2 * r], 7) : a[2 * r];
        const __m512i h = P == 0 ? _mm512_slli_epi32(a[2 * r + 1], 10)
                          : P == 1 ? _mm512_slli_epi32(a[2 * r + 1], 3) : _mm512_srai_epi32(a[2 * r + 1], 4);
        s[2 * r] = _mm512_add_epi32(s[2 * r], l), s[2 * r + 1] = _mm512_add_epi32(s[2 * r + 1], h);
    }
}

/* rows m .. m+R-1 (R <= 6) against block b, one plane at a time (2R accumulators for the plane, 2R for the combined
 * sums); out [R, 32]. The same integers and epilogue as x22_row_blocks, so the same bits. */
VNNI_FN INLINE void x22_tile_rows(const x22_t *c, int64_t m, int64_t b, const int R, float *out) {
    const int64_t K = c->K, G = c->G, NG = K / G, C = G / 4;
    __m512 t[12];
    __m512i s[12];
    for (int i = 0; i < 2 * R; i++) t[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        const uint8_t *w = c->qv + (b * (K / 4) + g * C) * 2 * PACK;
        const int8_t *x = c->xp + m * 3 * K + g * G;
        for (int i = 0; i < 2 * R; i++) s[i] = _mm512_setzero_si512();
        x22_plane(x, 3 * K, w, C, R, 0, s);
        x22_plane(x + K, 3 * K, w, C, R, 1, s);
        x22_plane(x + 2 * K, 3 * K, w, C, R, 2, s);
        const uint16_t *sp = c->sm + (b * NG + g) * 2 * PACK;
        const __m512 d0 = half16(sp), d1 = half16(sp + 16), m0 = half16(sp + 32), m1 = half16(sp + 48);
        for (int r = 0; r < R; r++) {
            const __m512 sr = _mm512_set1_ps(c->sx[(m + r) * NG + g]), xg = _mm512_set1_ps(c->xs[(m + r) * NG + g]);
            t[2 * r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[2 * r]), _mm512_mul_ps(d0, sr), t[2 * r]);
            t[2 * r] = _mm512_fmadd_ps(xg, m0, t[2 * r]);
            t[2 * r + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[2 * r + 1]), _mm512_mul_ps(d1, sr), t[2 * r + 1]);
            t[2 * r + 1] = _mm512_fmadd_ps(xg, m1, t[2 * r + 1]);
        }
    }
    for (int i = 0; i < 2 * R; i++) _mm512_storeu_ps(out + i * 16, t[i]);
}

#define X22_TILE(r) x22_tile_rows(ctx, m, b, r, out)
VNNI_FN static void tile_x22_vnni(const void *ctx, int64_t m, int R, const float *wf, int64_t b, int h, float *out) {
    (void)wf, (void)h;
    SWITCH_ROWS(R, X22_TILE)
}

VNNI_FN static void rows_x22_vnni(const void *ctx, int64_t m, int64_t b, int nb, float *out) {
    switch (nb) {
    case 4: x22_row_blocks(ctx, m, b, 4, out); break;
    case 3: x22_row_blocks(ctx, m, b, 3, out); break;
    case 2: x22_row_blocks(ctx, m, b, 2, out); break;
    default: x22_row_blocks(ctx, m, b, 1, out); break;
    }
}

static const steps_t X22_VNNI_STEPS = {PACK, 4, NULL, tile_x22_vnni, rows_x22_vnni};

/* ---- x22-avx2: vpmaddubsw (nibbles u8 x plane s8 -> s16 pairs, |.| <= 2 * 15 * 128 = 3840: no saturation), summed
 * in s16 over up to 8 chunks of four columns (<= 30720 < 2^15), then vpmaddwd by ones -> int32 per channel. A chunk's
 * 64 bytes are two vectors: channels 0..7 and 8..15 (low nibbles), 16..23 and 24..31 (high ones). ---- */

/* half H of one row's group g against a block's weights q (H 0: the low nibbles, channels 0..15; 1: the high ones,
 * 16..31): the int32 sums is[0] (channels 8 apart: 0..7 / 16..23) and is[1] (8..15 / 24..31). Each run of up to 8
 * chunks sums the three planes in s16 (h, m, l), then adds (h << 14) + (m << 7) + l, widened by vpmaddwd: the exact
 * dot(q, xi) of the header whatever the order (every partial sum is an integer int32 holds), so the same integers as
 * every x22 path. A half at a time keeps its 6 s16 sums and 2 int32 sums in registers (all four quarters at once
 * spilled ten sums to the stack: a store and a load per chunk each); the second half reads the group's 8 chunks
 * (512 bytes) again from L1. */
AVX2_FN INLINE void x22_group_half(const int8_t *xp, int64_t K, const uint8_t *q, int64_t g, int64_t G, const int H,
                                   __m256i *is) {
    const int64_t C = G / 4;
    const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256i is0 = _mm256_setzero_si256(), is1 = is0;
    for (int64_t i0 = 0; i0 < C; i0 += 8) {
        const int64_t i1 = i0 + 8 < C ? i0 + 8 : C;
        __m256i h0 = _mm256_setzero_si256(), h1 = h0, m0 = h0, m1 = h0, l0 = h0, l1 = h0;
        for (int64_t i = i0; i < i1; i++) {
            const int64_t k = g * G + 4 * i;
            const uint8_t *w = q + k * (PACK / 2);
            if (H == 0) _mm_prefetch((const char *)(w + PREFETCH_AHEAD), _MM_HINT_T0);
            __m256i v0 = _mm256_loadu_si256((const __m256i *)w), v1 = _mm256_loadu_si256((const __m256i *)(w + 32));
            if (H == 1) v0 = _mm256_srli_epi16(v0, 4), v1 = _mm256_srli_epi16(v1, 4);
            v0 = _mm256_and_si256(v0, mask), v1 = _mm256_and_si256(v1, mask);
            __m256i xb = _mm256_set1_epi32(load4(xp + k));
            h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(v0, xb)), h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(v1, xb));
            xb = _mm256_set1_epi32(load4(xp + K + k));
            m0 = _mm256_add_epi16(m0, _mm256_maddubs_epi16(v0, xb)), m1 = _mm256_add_epi16(m1, _mm256_maddubs_epi16(v1, xb));
            xb = _mm256_set1_epi32(load4(xp + 2 * K + k));
            l0 = _mm256_add_epi16(l0, _mm256_maddubs_epi16(v0, xb)), l1 = _mm256_add_epi16(l1, _mm256_maddubs_epi16(v1, xb));
        }
        is0 = _mm256_add_epi32(is0, _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(h0, ones), 14),
                                                                      _mm256_slli_epi32(_mm256_madd_epi16(m0, ones), 7)),
                                                     _mm256_madd_epi16(l0, ones)));
        is1 = _mm256_add_epi32(is1, _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(h1, ones), 14),
                                                                      _mm256_slli_epi32(_mm256_madd_epi16(m1, ones), 7)),
                                                     _mm256_madd_epi16(l1, ones)));
    }
    is[0] = is0, is[1] = is1;
}

/* row m against block b; out [32]: per group, each half's sums (x22_group_half), then the header's epilogue per
 * 8 channels (t[j]: channels 8j.., the order of the block's scales) */
AVX2_FN INLINE void x22_row_avx2(const x22_t *c, int64_t m, int64_t b, float *out) {
    const int64_t K = c->K, G = c->G, NG = K / G;
    const int8_t *xp = c->xp + m * 3 * K;
    const uint8_t *q = c->qv + b * K * (PACK / 2);
    __m256 t[4];
    for (int j = 0; j < 4; j++) t[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        __m256i is[4];
        x22_group_half(xp, K, q, g, G, 0, is);
        x22_group_half(xp, K, q, g, G, 1, is + 2);
        const __m256 sr = _mm256_set1_ps(c->sx[m * NG + g]), xg = _mm256_set1_ps(c->xs[m * NG + g]);
        const uint16_t *s = c->sm + (b * NG + g) * 2 * PACK;
        for (int j = 0; j < 4; j++) {
            t[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[j]), _mm256_mul_ps(half8(s + 8 * j), sr), t[j]);
            t[j] = _mm256_fmadd_ps(xg, half8(s + PACK + 8 * j), t[j]);
        }
    }
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + 8 * j, t[j]);
}

/* the tile step: each row alone over the block (which stays in L1/L2 between rows) */
AVX2_FN static void tile_x22_avx2(const void *ctx, int64_t m, int R, const float *wf, int64_t b, int h, float *out) {
    (void)wf, (void)h;
    for (int r = 0; r < R; r++) x22_row_avx2(ctx, m + r, b, out + r * PACK);
}

AVX2_FN static void rows_x22_avx2(const void *ctx, int64_t m, int64_t b, int nb, float *out) {
    for (int j = 0; j < nb; j++) x22_row_avx2(ctx, m, b + j, out + j * PACK);
}

static const steps_t X22_AVX2_STEPS = {PACK, 4, NULL, tile_x22_avx2, rows_x22_avx2};

/* x22-avx2's product over blocks b_begin .. b_end-1: one row streams the blocks (drive's rows step); two rows and
 * more take each block once from memory and run every row over it while it sits in L1/L2 (drive's tiles, from two
 * rows where drive tiles from six: a row here costs its arithmetic, so a verification of a few rows must not
 * stream the weights once per row) */
AVX2_FN static int drive_x22_avx2(const x22_t *c, int64_t M, float *y, int64_t N, int64_t b_begin, int64_t b_end,
                                  int64_t n_end) {
    if (M < 2) return drive(&X22_AVX2_STEPS, c, M, c->K, y, N, b_begin, b_end, n_end);
    float out[PACK];
    for (int64_t b = b_begin; b < b_end; b++)
        for (int64_t m = 0; m < M; m++) {
            x22_row_avx2(c, m, b, out);
            store_n(y + m * N, b * PACK, n_end, out, PACK);
        }
    return 0;
}

#endif /* HAVE_X86 */

static int is_x22(int path) { return path == PATH_X22_PORTABLE || path == PATH_X22_AVX2 || path == PATH_X22_VNNI; }

/* 1 when this CPU runs `path`: the x22 paths need what avx2 / vnni need */
static int int4_supported(int path) {
    if (path == PATH_X22_PORTABLE) return 1;
    if (path == PATH_X22_AVX2) return path_supported(PATH_AVX2);
    if (path == PATH_X22_VNNI) return path_supported(PATH_VNNI);
    return path_supported(path);
}

int int4_path_supported(int path) { return int4_supported(path); }

/* the activations of one product, prepared once for both threads: xs = the sums of each row's groups (every
 * path), and on the vnni path xq / sx, the rows quantized per group (kernel_common.h), on the x22 paths xq the
 * planes [M, 3, K], sx and xs (quantize22); one allocation */
typedef struct {
    float *xs, *sx;
    int8_t *xq;
    void *buf;
} prepared_t;

static int prepare(int path, const float *x, int64_t M, int64_t K, int64_t G, prepared_t *p) {
    const int64_t NG = K / G, vnni = path == PATH_VNNI, x22 = is_x22(path);
    const size_t floats = (size_t)(M * NG) * (vnni || x22 ? 2 : 1) + 1,
                 bytes = vnni ? (size_t)(M * K) : x22 ? (size_t)(3 * M * K) : 0;
    p->buf = malloc(sizeof(float) * floats + bytes);
    if (!p->buf) return -2;
    p->xs = p->buf, p->sx = p->xs + M * NG, p->xq = (int8_t *)(p->xs + floats);
    if (x22) {
#if HAVE_X86
        if (path == PATH_X22_VNNI) {
            quantize22_512(x, M, K, G, p->xq, p->sx, p->xs);
            return 0;
        }
#endif
        quantize22(x, M, K, G, p->xq, p->sx, p->xs);
        return 0;
    }
    if (!vnni) {
        group_sums(x, M, K, G, p->xs);
        return 0;
    }
    /* vnni: the minimums multiply the sums of the quantized x (sx * sum of xq, exact), as llama.cpp's Q8_1 does, so
     * the product is exactly the dequantized weight times the quantized x: with the float sums instead, the error of
     * the scaled levels d * q (all >= 0, not centred like the weights) doubled the perplexity change */
    quantize_rows(x, M, K, G, 0, p->xq, p->sx);
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < NG; g++) {
            int32_t sum = 0;
            for (int64_t k = 0; k < G; k++) sum += p->xq[m * K + g * G + k];
            p->xs[m * NG + g] = p->sx[m * NG + g] * (float)sum;
        }
    return 0;
}

/* the product on prepared activations; q is [N32, K, 16] (vnni and x22: [N32, K/4, 16, 4]) */
static int run_prepared(int path, const float *x, const prepared_t *p, int64_t M, int64_t K, const uint8_t *q,
                        const uint16_t *sm, int64_t G, float *y, int64_t N, int64_t n_begin, int64_t n_end) {
    if (M == 0 || n_begin == n_end) return 0;
    const int64_t b_begin = n_begin / PACK, b_end = (n_end + PACK - 1) / PACK;
    const x22_t x22 = {p->xq, p->sx, p->xs, q, sm, K, G, M == 1};
    if (path == PATH_X22_PORTABLE) {
        x22_portable(&x22, M, y, N, b_begin, b_end, n_end);
        return 0;
    }
#if HAVE_X86
    if (path == PATH_X22_VNNI) return drive(&X22_VNNI_STEPS, &x22, M, K, y, N, b_begin, b_end, n_end);
    if (path == PATH_X22_AVX2) return drive_x22_avx2(&x22, M, y, N, b_begin, b_end, n_end);
    if (path == PATH_VNNI) {
        const vnni_t ctx = {(const uint8_t *)p->xq, p->sx, p->xs, q, NULL, NULL, sm, K, G};
        return drive(&VNNI_STEPS, &ctx, M, K, y, N, b_begin, b_end, n_end);
    }
    const ctx_t ctx = {x, p->xs, q, NULL, sm, K, G, M == 1};
    if (path == PATH_AVX512) return drive(&AVX512_STEPS, &ctx, M, K, y, N, b_begin, b_end, n_end);
    if (path == PATH_AVX2) return drive(&AVX2_STEPS, &ctx, M, K, y, N, b_begin, b_end, n_end);
#endif
    linear_portable(x, p->xs, M, K, q, sm, G, y, N, b_begin, b_end, n_end);
    return 0;
}

static int check(int path, int64_t M, int64_t K, int64_t G, int64_t N, int64_t n_begin, int64_t n_end) {
    if (bad_args(M, K, G, N, n_begin, n_end)) return -1;
    if ((path == PATH_VNNI || is_x22(path)) && G % 4 != 0) return -1;
    if (is_x22(path) && G > 64) return -1; /* the int32 bound of the dot products (header) */
    return int4_supported(path) ? 0 : -3;
}

int int4_linear_f32(int path, const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *sm, int64_t G,
                    float *y, int64_t N, int64_t n_begin, int64_t n_end) {
    int rc = check(path, M, K, G, N, n_begin, n_end);
    if (rc != 0 || M == 0 || n_begin == n_end) return rc;
    prepared_t p;
    if ((rc = prepare(path, x, M, K, G, &p)) != 0) return rc;
    rc = run_prepared(path, x, &p, M, K, q, sm, G, y, N, n_begin, n_end);
    free(p.buf);
    return rc;
}

/* ---- the second half of int4_linear_f32_2t, on the process's kernel worker (kernel_worker.h) ---- */

typedef struct {
    int path;
    const float *x;
    const prepared_t *p;
    int64_t M, K;
    const uint8_t *q;
    const uint16_t *sm;
    int64_t G;
    float *y;
    int64_t N, n_begin, n_end;
} job_t;

static int run_job(const job_t *j);
#include "kernel_worker.h"

static int run_job(const job_t *j) {
    return run_prepared(j->path, j->x, j->p, j->M, j->K, j->q, j->sm, j->G, j->y, j->N, j->n_begin, j->n_end);
}

/* int4_linear_f32 over channels [n_begin, n_end), split at `mid` (a multiple of 32): [n_begin, mid) here,
 * [mid, n_end) on the worker thread; when the worker is busy with another caller, all of it here. The
 * activations are prepared once, here. */
int int4_linear_f32_2t(int path, const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *sm, int64_t G,
                       float *y, int64_t N, int64_t n_begin, int64_t mid, int64_t n_end) {
    int rc = check(path, M, K, G, N, n_begin, n_end);
    if (rc != 0) return rc;
    if (mid % PACK != 0 || mid < n_begin || mid > n_end) return -1;
    if (M == 0 || n_begin == n_end) return 0;
    prepared_t p;
    if ((rc = prepare(path, x, M, K, G, &p)) != 0) return rc;
    job_t mine = {path, x, &p, M, K, q, sm, G, y, N, n_begin, mid};
    job_t theirs = mine;
    theirs.n_begin = mid, theirs.n_end = n_end;
    rc = run_split(mine, theirs);
    free(p.buf);
    return rc;
}
