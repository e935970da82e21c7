/* What int8_linear.c and int4_linear.c share: the packing constants, the code paths and how the CPU's flags pick
 * them, and the per-row activation quantization of the VNNI paths. engine/kernels.py hashes every header with each
 * source, so a change here rebuilds both.
 *
 * Code paths (the `path` argument of every product; kernels.py names them):
 *   1 portable  plain C, any CPU and compiler;
 *   2 avx2      AVX2 + FMA + F16C;
 *   3 avx512    AVX-512 F/BW/VL (+ FMA, F16C): the same arithmetic per output as avx2, on 16 lanes;
 *   4 vnni      AVX-512 VNNI (vpdpbusd): activations quantized to int8 per row and group of G columns (llama.cpp's
 *               Q8_0 / Q8_1 activations), integer dot products per group, its own weight layout (kernels.py packs it).
 *   5 x22-portable, 6 x22-avx2 (AVX2 + FMA + F16C), 7 x22-vnni (AVX-512 F/BW/VL + VNNI): int4_linear.c only,
 *               activations quantized to 22-bit integers per row and group (three int8 planes), on vnni's packing;
 *               the three give identical bits (int4_linear.c's header says the arithmetic).
 *   8 x16-avx2  int8_linear.c only (AVX2 + FMA + F16C): activations quantized to 16-bit integers per row and group,
 *               vpmaddwd on vnni's packing (int8_linear.c's header says the arithmetic).
 * Each x86 path is compiled with a target attribute, so the library is built for baseline x86-64 and runs a path
 * only where __builtin_cpu_supports says the CPU has it (a path it lacks returns -3).
 */
#ifndef TOKENLOOP_KERNEL_COMMON_H
#define TOKENLOOP_KERNEL_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PACK 32  /* output channels per packed block */
#define BLOCK 16 /* channels widened together for the AVX2 tiled path */
#define ROWS 6   /* rows of one register tile */

enum { PATH_PORTABLE = 1, PATH_AVX2 = 2, PATH_AVX512 = 3, PATH_VNNI = 4, PATH_X22_PORTABLE = 5, PATH_X22_AVX2 = 6,
       PATH_X22_VNNI = 7, PATH_X16_AVX2 = 8 };

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86 1
#include <immintrin.h>
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
#else
#define HAVE_X86 0
#endif

/* 1 when this CPU (and this build) can run `path` (1 .. 4; int4_linear.c maps the x22 paths onto these) */
static int path_supported(int path) {
    if (path == PATH_PORTABLE) return 1;
#if HAVE_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl");
    if (path == PATH_AVX2) return avx2;
    if (path == PATH_AVX512) return avx512;
    if (path == PATH_VNNI) return avx512 && __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

/* the common checks of a product's arguments: 0 when fine */
static int bad_args(int64_t M, int64_t K, int64_t G, int64_t N, int64_t n_begin, int64_t n_end) {
    return M < 0 || K < 1 || G < 1 || K % G != 0 || n_begin < 0 || n_begin % PACK != 0 || n_end > N ||
           n_begin > n_end;
}

/* write out[0..count-1] (channels n..) into y, only the channels below n_end */
static inline void store_n(float *y, int64_t n, int64_t n_end, const float *out, int64_t count) {
    if (n_end - n < count) count = n_end - n;
    if (count > 0) memcpy(y + n, out, sizeof(float) * (size_t)count);
}

/* a group of G activations' scale max |v| / top (fmaxf in column order) and its inverse in *inv (0 for a zero group):
 * the vnni paths' (top 127) and int8's x16 (top 32767) */
static inline float group_scale(const float *v, int64_t G, float top, float *inv) {
    float amax = 0.0f;
    for (int64_t k = 0; k < G; k++) amax = fmaxf(amax, fabsf(v[k]));
    *inv = amax > 0.0f ? top / amax : 0.0f;
    return amax / top;
}

/* x [M, K] -> integers per row and group of G columns, symmetric: sx[m, g] = max |x| / top, xq = round(x / sx);
 * `kind` 0: int8 (top 127), 1: int8 stored + 128 as uint8 (the unsigned operand of vpdpbusd), 2: int16 clamped to
 * +-top (int8_linear.c's x16). One function for every row count, so a row's values do not depend on the batch. */
static void quantize_groups(const float *x, int64_t M, int64_t K, int64_t G, float top, int kind, void *dst,
                            float *sx) {
    const int64_t NG = K / G;
    const long lim = (long)top;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < NG; g++) {
            const float *v = x + m * K + g * G;
            float inv;
            sx[m * NG + g] = group_scale(v, G, top, &inv);
            const int64_t at = m * K + g * G;
            for (int64_t k = 0; k < G; k++) {
                const long q = lrintf(v[k] * inv);
                if (kind == 2)
                    ((int16_t *)dst)[at + k] = (int16_t)(q > lim ? lim : q < -lim ? -lim : q);
                else
                    ((int8_t *)dst)[at + k] = (int8_t)(kind ? (uint8_t)(q + 128) : q);
            }
        }
}

/* x [M, K] -> int8 per row and group of G columns (sx = max |x| / 127); with `bias` stored + 128 as uint8 */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t G, int bias, int8_t *xq, float *sx) {
    quantize_groups(x, M, K, G, 127.0f, bias ? 1 : 0, xq, sx);
}

/* ---- the loops around a product's kernels, shared by both libraries and every SIMD path ----
 *
 * A path gives three steps over its own operands (`ctx`):
 *   widen(ctx, b, h, wf)        channels [32b + h*width, + width) of block b as floats into wf [K, width]
 *                               (NULL: the path multiplies its packed weights directly, vnni)
 *   tile(ctx, m, R, wf, b, h, out)  rows m .. m+R-1 (R <= 6) against those channels; out [R, width]
 *   rows(ctx, m, b, nb, out)    row m against blocks b .. b+nb-1 (nb <= nb_max), weights read on the fly;
 *                               out [nb * 32]
 * drive() runs six rows at a time over each widened part of a block while it sits in L1/L2, the rows left over
 * (M % 6) in one smaller tile over the same widened part (32 rows: five tiles of six and one of two, the weights
 * widened and read once), and writes only the channels below n_end; fewer than six rows (fewer than tile_from,
 * where a path sets it) go one by one through the rows step, which reads the weights once without a buffer. A path
 * whose tile and rows steps do the same arithmetic per output keeps rows batch invariant. */
typedef struct {
    int width, nb_max;
    void (*widen)(const void *ctx, int64_t b, int h, float *wf);
    void (*tile)(const void *ctx, int64_t m, int R, const float *wf, int64_t b, int h, float *out);
    void (*rows)(const void *ctx, int64_t m, int64_t b, int nb, float *out);
    int tile_from; /* rows from which every row goes through tiles (0: ROWS); a path whose tiles read each block once
                      for all their rows sets 2, so two to five rows read a weight too big for the caches once */
} steps_t;

/* the operands of a float32-activation product, for the steps: int8 weights (q, scale) or 4-bit ones (q, sm, and xs,
 * the sums of each row's groups) */
typedef struct {
    const float *x, *xs;
    const void *q;
    const float *scale;
    const uint16_t *sm;
    int64_t K, G;
    int nta; /* one row (a decode step of one stream): the weights' prefetch is non-temporal (PREFETCH_AHEAD) */
} ctx_t;

/* this thread's buffer of at least `floats` floats, kept for its next product (a tile's widened weights: K * 32
 * floats, 74-197 KB on this model): no allocation, page faults or unmapping per product; NULL on no memory */
static float *thread_buffer(size_t floats) {
    static _Thread_local float *buf = NULL;
    static _Thread_local size_t cap = 0;
    if (floats > cap) {
        float *grown = malloc(sizeof(float) * floats);
        if (!grown) return NULL;
        free(buf);
        buf = grown, cap = floats;
    }
    return buf;
}

static int drive(const steps_t *s, const void *ctx, int64_t M, int64_t K, float *y, int64_t N, int64_t b_begin,
                 int64_t b_end, int64_t n_end) {
    const int64_t tiled = M >= (s->tile_from ? s->tile_from : ROWS) ? M : 0; /* through tiles: all rows, or none */
    if (tiled > 0) {
        float *wf = s->widen ? thread_buffer((size_t)(K * s->width)) : NULL;
        if (s->widen && !wf) return -2;
        float t[ROWS * PACK];
        for (int64_t b = b_begin; b < b_end; b++)
            for (int h = 0; h < PACK / s->width; h++) {
                const int64_t n = b * PACK + h * s->width;
                if (n >= n_end) break;
                if (s->widen) s->widen(ctx, b, h, wf);
                for (int64_t m = 0; m < tiled; m += ROWS) {
                    const int R = tiled - m < ROWS ? (int)(tiled - m) : ROWS;
                    s->tile(ctx, m, R, wf, b, h, t);
                    for (int r = 0; r < R; r++) store_n(y + (m + r) * N, n, n_end, t + r * s->width, s->width);
                }
            }
    }
    float out[4 * PACK];
    for (int64_t m = tiled; m < M; m++)
        for (int64_t b = b_begin; b < b_end;) {
            const int nb = b_end - b < s->nb_max ? (int)(b_end - b) : s->nb_max;
            s->rows(ctx, m, b, nb, out);
            store_n(y + m * N, b * PACK, n_end, out, nb * PACK);
            b += nb;
        }
    return 0;
}

/* CALL(r) with r the compile-time constant equal to R (1 .. 6): the tiles' row counts, each its own unrolled code */
#define SWITCH_ROWS(R, CALL)                                                                                        \
    switch (R) {                                                                                                    \
    case 1: CALL(1); break;                                                                                         \
    case 2: CALL(2); break;                                                                                         \
    case 3: CALL(3); break;                                                                                         \
    case 4: CALL(4); break;                                                                                         \
    case 5: CALL(5); break;                                                                                         \
    default: CALL(6); break;                                                                                        \
    }

#if HAVE_X86
/* a[2r] (channels 0..15) and a[2r+1] (16..31) += the dot products of R rows of quantized activations x (stride K)
 * with a block's C chunks of four columns at w, one vpdpbusd per 16 channels and row: int8 weights (128 signed bytes
 * a chunk; x stored + 128, the unsigned operand) or, with `nibbles`, 4-bit ones (64 bytes a chunk, the low nibbles
 * channels 0..15 and the high ones 16..31, the unsigned operand; x signed) */
VNNI_FN INLINE void vnni_dots(const uint8_t *x, int64_t K, const uint8_t *w, int64_t C, const int R, const int nibbles,
                              __m512i *a) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    const int64_t step = nibbles ? 2 * PACK : 4 * PACK;
    for (int64_t j = 0; j < C; j++) {
        const __m512i v = _mm512_loadu_si512(w + j * step);
        const __m512i w0 = nibbles ? _mm512_and_si512(v, mask) : v;
        const __m512i w1 = nibbles ? _mm512_and_si512(_mm512_srli_epi16(v, 4), mask) : _mm512_loadu_si512(w + j * step + 64);
        for (int r = 0; r < R; r++) {
            int32_t four;
            memcpy(&four, x + r * K + 4 * j, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            a[2 * r] = nibbles ? _mm512_dpbusd_epi32(a[2 * r], w0, xb) : _mm512_dpbusd_epi32(a[2 * r], xb, w0);
            a[2 * r + 1] = nibbles ? _mm512_dpbusd_epi32(a[2 * r + 1], w1, xb) : _mm512_dpbusd_epi32(a[2 * r + 1], xb, w1);
        }
    }
}

/* ---- the vnni kernel of both libraries: int8 activations, integer dot products per group ---- */

/* the operands of a vnni product, int8 or 4-bit weights */
typedef struct {
    const uint8_t *xq;   /* activations quantized per row and group [M, K]: int8 + 128 (int8 weights), int8 (4-bit) */
    const float *sx;     /* their scales [M, NG] */
    const float *xs;     /* 4-bit: sx * the sums of xq per group [M, NG] (the minimums multiply them) */
    const uint8_t *qv;   /* the weights packed four columns a lane: [N32, K/4, 32, 4] int8 or [N32, K/4, 16, 4] */
    const int32_t *comp; /* int8: -128 * each channel's group sums of weights [N32, NG, 32] */
    const float *scale;  /* int8: scales [N32, NG, 32] */
    const uint16_t *sm;  /* 4-bit: half scales and minimums [N32, NG, 2, 32] */
    int64_t K, G;
} vnni_t;

AVX512_FN static inline __m512 half16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* 16 bytes of a 4-bit block's column -> 16 int32 lanes: the low nibbles are channels 0..15, the high ones 16..31 */
AVX512_FN static inline __m512i nibbles16(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

/* bytes ahead of each weight stream that the one-row steps prefetch (software prefetch: every block is a short
 * stream of K * 16 or K * 32 bytes, a few KB, that the hardware prefetchers would only learn part way through).
 * For one row the hint is non-temporal (prefetchnta): that step reads each weight once, ~100 MB of them, and with T0
 * they pushed out of the caches what the step reads again (the K/V cache, the interpreter's working set between the
 * kernels); on the 2-vCPU AMD EPYC (Zen 4) one int4 stream through the server ran 0.985-1.036x in four A/Bs
 * (docs/engine.md). Two to five rows read each block once per row, so there the weights stay in L2 for the next
 * row (T0). */
#define PREFETCH_AHEAD 1024
#define PREFETCH_WEIGHTS(p, nta) \
    ((nta) ? _mm_prefetch((const char *)(p), _MM_HINT_NTA) : _mm_prefetch((const char *)(p), _MM_HINT_T0))

/* the avx512 rows step of both libraries: row m against blocks b .. b + NB - 1 (NB <= 4: up to eight FMA chains), the
 * weights widened right before their FMAs (int8: 16 bytes a vector; 4-bit, `nibbles`: 16 bytes two vectors), per
 * group a partial sum, then total += partial * scale (4-bit: + the row's group sum * minimum); out [NB * 32].
 * Each block's stream is prefetched PREFETCH_AHEAD bytes ahead; past its end, the same offset of the block NB
 * further on (the one this stream reads next). */
AVX512_FN INLINE void row_blocks512(const ctx_t *c, int64_t m, int64_t b, const int NB, const int nibbles, float *out) {
    const int64_t K = c->K, G = c->G, NG = K / G, width = nibbles ? PACK / 2 : PACK, bytes = K * width;
    const float *x = c->x + m * K;
    const uint8_t *q = (const uint8_t *)c->q + b * bytes;
    const __m512i mask = _mm512_set1_epi32(0x0f);
    __m512 t[8], a[8];
    for (int j = 0; j < 2 * NB; j++) t[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        for (int j = 0; j < 2 * NB; j++) a[j] = _mm512_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k++) {
            const __m512 xv = _mm512_set1_ps(x[k]);
            int64_t ahead = k * width + PREFETCH_AHEAD;
            if (ahead >= bytes) ahead += (NB - 1) * bytes;
            for (int j = 0; j < NB; j++) {
                const uint8_t *p = q + j * bytes + k * width;
                PREFETCH_WEIGHTS(q + j * bytes + ahead, c->nta);
                __m512 w0, w1;
                if (nibbles) {
                    const __m512i v = nibbles16(p);
                    w0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, mask)), w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
                } else {
                    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
                    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
                }
                a[2 * j] = _mm512_fmadd_ps(xv, w0, a[2 * j]);
                a[2 * j + 1] = _mm512_fmadd_ps(xv, w1, a[2 * j + 1]);
            }
        }
        for (int j = 0; j < NB; j++) {
            const int64_t bg = (b + j) * NG + g;
            if (nibbles) {
                const uint16_t *s = c->sm + bg * 2 * PACK;
                const __m512 xg = _mm512_set1_ps(c->xs[m * NG + g]);
                t[2 * j] = _mm512_fmadd_ps(xg, half16(s + 32), _mm512_fmadd_ps(a[2 * j], half16(s), t[2 * j]));
                t[2 * j + 1] = _mm512_fmadd_ps(xg, half16(s + 48), _mm512_fmadd_ps(a[2 * j + 1], half16(s + 16), t[2 * j + 1]));
            } else {
                t[2 * j] = _mm512_fmadd_ps(a[2 * j], _mm512_loadu_ps(c->scale + bg * PACK), t[2 * j]);
                t[2 * j + 1] = _mm512_fmadd_ps(a[2 * j + 1], _mm512_loadu_ps(c->scale + bg * PACK + 16), t[2 * j + 1]);
            }
        }
    }
    for (int j = 0; j < 2 * NB; j++) _mm512_storeu_ps(out + 16 * j, t[j]);
}

/* nb (1 .. 4) blocks at once: as many FMA chains as there are, never a block alone when more are left */
AVX512_FN INLINE void rows512(const ctx_t *c, int64_t m, int64_t b, int nb, const int nibbles, float *out) {
    switch (nb) {
    case 4: row_blocks512(c, m, b, 4, nibbles, out); break;
    case 3: row_blocks512(c, m, b, 3, nibbles, out); break;
    case 2: row_blocks512(c, m, b, 2, nibbles, out); break;
    default: row_blocks512(c, m, b, 1, nibbles, out); break;
    }
}

/* R rows (R <= 6, from row m) against block b; out [R, 32]. Per group: the exact integer dot products (int8: from
 * comp, so the + 128 cancels), then total += float(dot) * (weight scale * sx), and for 4-bit weights total +=
 * (sx * sum xq) * minimum: per output the same operations whatever R, so rows stay batch invariant. */
VNNI_FN INLINE void vnni_rows(const vnni_t *c, int64_t m, int64_t b, const int R, const int nibbles, float *out) {
    const int64_t K = c->K, G = c->G, NG = K / G, C = G / 4;
    __m512 t[12];
    __m512i a[12];
    for (int i = 0; i < 2 * R; i++) t[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        const int64_t bg = b * NG + g;
        for (int r = 0; r < R; r++) {
            a[2 * r] = nibbles ? _mm512_setzero_si512() : _mm512_loadu_si512(c->comp + bg * PACK);
            a[2 * r + 1] = nibbles ? _mm512_setzero_si512() : _mm512_loadu_si512(c->comp + bg * PACK + 16);
        }
        vnni_dots(c->xq + m * K + g * G, K, c->qv + (b * (K / 4) + g * C) * (nibbles ? 2 : 4) * PACK, C, R, nibbles, a);
        const uint16_t *s4 = nibbles ? c->sm + bg * 2 * PACK : NULL;
        const __m512 s0 = nibbles ? half16(s4) : _mm512_loadu_ps(c->scale + bg * PACK);
        const __m512 s1 = nibbles ? half16(s4 + 16) : _mm512_loadu_ps(c->scale + bg * PACK + 16);
        for (int r = 0; r < R; r++) {
            const __m512 sr = _mm512_set1_ps(c->sx[(m + r) * NG + g]);
            t[2 * r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[2 * r]), _mm512_mul_ps(s0, sr), t[2 * r]);
            t[2 * r + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[2 * r + 1]), _mm512_mul_ps(s1, sr), t[2 * r + 1]);
            if (nibbles) {
                const __m512 xg = _mm512_set1_ps(c->xs[(m + r) * NG + g]);
                t[2 * r] = _mm512_fmadd_ps(xg, half16(s4 + 32), t[2 * r]);
                t[2 * r + 1] = _mm512_fmadd_ps(xg, half16(s4 + 48), t[2 * r + 1]);
            }
        }
    }
    for (int i = 0; i < 2 * R; i++) _mm512_storeu_ps(out + i * 16, t[i]);
}

/* the vnni steps of drive() (no widening: vpdpbusd multiplies the packed bytes), for int8 (nibbles 0) or 4-bit
 * weights (1): up to six rows a tile, one row a block otherwise */
#define VNNI_TILE(r) vnni_rows(ctx, m, b, r, NIBBLES, out)
#define DEFINE_VNNI_STEPS(nibbles)                                                                                  \
    VNNI_FN static void tile_vnni(const void *ctx, int64_t m, int R, const float *wf, int64_t b, int h, float *out) { \
        (void)wf, (void)h;                                                                                          \
        enum { NIBBLES = nibbles };                                                                                 \
        SWITCH_ROWS(R, VNNI_TILE)                                                                                   \
    }                                                                                                               \
    VNNI_FN static void rows_vnni(const void *ctx, int64_t m, int64_t b, int nb, float *out) {                     \
        for (int j = 0; j < nb; j++) vnni_rows(ctx, m, b + j, 1, nibbles, out + j * PACK);                        \
    }                                                                                                               \
    static const steps_t VNNI_STEPS = {PACK, 4, NULL, tile_vnni, rows_vnni};

/* the avx2 tile step of drive(): the file's own tile_rows_avx2 (a widened half block, 16 channels) for R rows */
#define TILE_AVX2(r) tile_rows_avx2(ctx, m, r, wf, b, h, out)
#define DEFINE_AVX2_TILE()                                                                                          \
    AVX2_FN static void tile_avx2(const void *ctx, int64_t m, int R, const float *wf, int64_t b, int h, float *out) { \
        SWITCH_ROWS(R, TILE_AVX2)                                                                                   \
    }

/* the AVX-512 steps of drive() around the file's own tile_rows_512 (its float32 tile over a widened block) and the
 * shared rows512, for int8 (nibbles 0) or 4-bit weights (1) */
#define TILE_512(r) tile_rows_512(ctx, m, r, wf, b, h, out)
#define DEFINE_512_STEPS(nibbles)                                                                                   \
    AVX512_FN static void tile_512(const void *ctx, int64_t m, int R, const float *wf, int64_t b, int h, float *out) { \
        SWITCH_ROWS(R, TILE_512)                                                                                    \
    }                                                                                                               \
    AVX512_FN static void rows_512(const void *ctx, int64_t m, int64_t b, int nb, float *out) {                    \
        rows512(ctx, m, b, nb, nibbles, out);                                                                       \
    }                                                                                                               \
    static const steps_t AVX512_STEPS = {PACK, 4, widen_512, tile_512, rows_512};

/* a[2r], a[2r+1] += x[r, k] * wf[k, 0..15] over k0 <= k < k1 for R <= 6 rows x (stride K): the float32 GEMM inner
 * kernel of the avx2 tiles (12 partial sums, two weight vectors, one broadcast: 15 of 16 registers) */
AVX2_FN INLINE void tile6_sums_avx2(const float *x, const float *wf, int64_t K, int64_t k0, int64_t k1, const int R,
                                    __m256 *a) {
    for (int64_t k = k0; k < k1; k++) {
        const __m256 b0 = _mm256_loadu_ps(wf + k * BLOCK), b1 = _mm256_loadu_ps(wf + k * BLOCK + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
            a[2 * r] = _mm256_fmadd_ps(xv, b0, a[2 * r]);
            a[2 * r + 1] = _mm256_fmadd_ps(xv, b1, a[2 * r + 1]);
        }
    }
}

/* the same on 16 lanes for the avx512 tiles: wf [K, 32] (a whole block); a[2R] is set, not added to */
AVX512_FN INLINE void tile6_sums_512(const float *x, const float *wf, int64_t K, int64_t k0, int64_t k1, const int R,
                                     __m512 *a) {
    for (int i = 0; i < 2 * R; i++) a[i] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k++) {
        const __m512 b0 = _mm512_loadu_ps(wf + k * PACK), b1 = _mm512_loadu_ps(wf + k * PACK + 16);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * K + k]);
            a[2 * r] = _mm512_fmadd_ps(xv, b0, a[2 * r]);
            a[2 * r + 1] = _mm512_fmadd_ps(xv, b1, a[2 * r + 1]);
        }
    }
}
#endif

#endif
