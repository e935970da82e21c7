/* Decode attention read straight from the paged KV cache: no gather, no padding, no mask.
 *
 * One query token per sequence (a decode step). Each sequence's K rows are read once (all query heads' scores
 * from one pass over the context) and then its V rows once (all heads' weighted sums), block after block. At many
 * streams the step is bound by the memory it reads (32 sequences x 128 tokens x 30 layers of SmolLM2-135M's K and
 * V are ~190 MB per step), and a sequence's blocks lie anywhere in the cache, so the CPU's own prefetchers cannot
 * see the next one coming: a read-ahead cursor (read_ahead, below) prefetches the rows the kernel will read next
 * (AHEAD rows on, into L2), a few per head, so the loads overlap the arithmetic.
 *
 *   q        [B, H, E]   queries of the decoding sequences (float32, contiguous)
 *   out      [B, H, E]   attention output
 *   k_cache  [S, K, E]   one layer's cache; slot = block_id * block_size + offset (v_cache alike): float32, or
 *                        IEEE float16 (`kv16`, the quantized modes' 16-bit KV cache: docs/engine.md#16-bit-kv-cache),
 *                        each row widened to float32 as it is loaded (F16C's vcvtph2ps on the x86 paths, exact)
 *   tables   [B, NB]     int64 block table of each sequence
 *   lens     [B]         int64 context length: keys 0 .. lens[b]-1 (the current token's K/V is written)
 *   window               a sliding window (paged_decode_window_path): keys lens[b]-window .. lens[b]-1 only
 *                        (Gemma 3's local layers); 0: every key. The blocks before the window's are skipped, the
 *                        keys before it in its first block masked (their scores -FLT_MAX, so exp makes them 0).
 *
 * Only sequences b_begin .. b_end-1 are computed, so a caller can split one batch over threads; and
 * paged_decode_heads_f32_path computes only kv heads kv_begin .. kv_end-1 (with their query heads), so that one
 * sequence's attention splits over two threads too.
 *
 * Per sequence, in three steps:
 *   scores  s[h, c] = scale * <q_h, k_c>, W context rows at a time (W = the vector width): W dot products of one
 *           head run side by side, one partial-sum vector each, and a transposing add tree turns the W partial
 *           vectors into one vector of the W scores (instead of a horizontal sum per score). The W rows stay in L1
 *           across the H heads, so each K row is loaded from memory once for all heads (GQA: the G = H / K query
 *           heads of a kv head share its rows).
 *   softmax per head: max, then exp(s - max) on whole vectors (a polynomial exp, below) and their sum.
 *   output  out_h = (sum_c p[h, c] * v_c) / sum_h, a block and a kv head at a time, the G heads' sums held in
 *           registers across the block's rows, so each V row is loaded once per kv head.
 * Every sequence's result depends only on its own query, context and length: the same bits alone or in any batch,
 * and whichever thread computes it (the engine's batch invariance).
 *
 * Paths (`path` argument; paged_best_path() says which this CPU runs, paged_path_supported() which it can):
 *   1 portable C: any CPU, any compiler; the same steps in plain loops, left to the compiler to vectorise.
 *   2 AVX2 + FMA: 8-float vectors (head_dim a multiple of 8; else the portable path serves).
 *   3 AVX-512 F: 16-float vectors (head_dim a multiple of 16; else AVX2, else portable).
 * The x86 paths are compiled with target attributes, so the library builds and loads on any x86-64 CPU and the
 * path is chosen at run time from the CPU's flags. The paths differ only in summation order (the dot products'
 * lanes) and in the exp (the portable path calls expf), at the level of float32 rounding.
 *
 * exp on the x86 paths: Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n),
 * within 2 ulp of exp over the softmax's range (x <= 0; 1.23 ulp at worst against double exp, every 64th float of
 * [-87.3, 0]); below -87.3 (under float's normal range) it gives 0.
 *
 * Built at run time by tokenloop/engine/kernels.py (cc -O3 -march=native -ffast-math at compile time only, so
 * loading the library leaves the process's denormal handling alone); the pure-torch path in model.py is the
 * fallback and the reference in the tests.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

enum { PATH_PORTABLE = 1, PATH_AVX2 = 2, PATH_AVX512 = 3 };

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86 1
#include <immintrin.h>
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX512_FN __attribute__((target("avx512f")))
#else
#define HAVE_X86 0
#endif

#define MAX_W 16                  /* the widest vector, in floats: rows of one scores chunk */
#define EXP_MIN (-87.33654475f)   /* ln(FLT_MIN): exp below it is 0 here */
#define CACHE_LINE 64
#ifndef PREFETCH
#define PREFETCH 1
#endif
#ifndef AHEAD
#define AHEAD 256 /* rows: ~190 KB of K/V at 3 kv heads x 64, well within L2 */
#endif
/* GCC drops __builtin_prefetch from loops it finds free of side effects (C11 lets it assume they end): on x86 the
 * prefetch is an asm statement, which it keeps */
#if HAVE_X86
#ifndef PF_INSN
#define PF_INSN "prefetcht1" /* into L2: prefetcht0 (into L1) fills the miss queue and stalls the loads */
#endif
#define PREFETCH_LINE(p) __asm__ volatile(PF_INSN " %0" : : "m"(*(const char *)(p)))
#else
#define PREFETCH_LINE(p) __builtin_prefetch((p), 0, 3)
#endif

/* float16 <-> float32, both exact where float16 can hold the value (the wider conversion always; the narrower rounds to
 * nearest even, as F16C's vcvtps2ph and torch's .half() do): F16C's instructions where the build has them, else bit
 * arithmetic with the same results (layer_ops.c writes the cache with half_from_float). */
#if HAVE_X86 && defined(__F16C__)
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0x1f) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    } else { /* zero or subnormal: man * 2^-24, exact in float */
        v.f = (float)man * 5.9604644775390625e-8f;
        v.u |= sign;
    }
    return v.f;
}
#endif

/* Row pointers of context rows c0 .. c0 + n - 1 (the first computed kv head's slice); rows n .. W - 1 repeat row c0,
 * so a chunk can always be computed whole (its extra lanes are masked afterwards). `row` is a cache row's bytes. */
static inline void chunk_rows(const void *cache, const int64_t *table, int64_t bs, int64_t row, int64_t c0, int64_t n,
                              int64_t W, const void **rows) {
    int64_t blk = c0 / bs, off = c0 % bs;
    for (int64_t j = 0; j < n; j++) {
        rows[j] = (const char *)cache + (table[blk] * bs + off) * row;
        if (++off == bs) {
            off = 0;
            blk++;
        }
    }
    for (int64_t j = n; j < W; j++) rows[j] = rows[0];
}

/* What one sequence needs: its query [H, E], output [H, E], block table, length, and how many leading keys are masked
 * (those before a sliding window's start in its first block; `windowed`). */
typedef struct {
    const float *q;
    float *out;
    const int64_t *table;
    int64_t len, skip;
} seq_args;

/* scores [H, stride] of the `skip` masked keys -> -FLT_MAX (exp then gives 0) */
static inline void mask_skipped(float *scores, int64_t H, int64_t stride, int64_t skip) {
    for (int64_t h = 0; h < H; h++)
        for (int64_t c = 0; c < skip; c++) scores[h * stride + c] = -FLT_MAX;
}

/* k_cache / v_cache point at the first kv head computed; H and K count the query and kv heads computed, KE is a
 * cache row's stride (every kv head's) in elements, esz an element's bytes (4: float32, 2: float16) */
typedef struct {
    const void *k_cache, *v_cache;
    int64_t H, K, G, E, KE, bs, esz;
    float scale;
} shape_args;

/* Read-ahead over the rows the kernel reads, in the order it reads them: sequence b's K rows 0 .. len-1, its V
 * rows, then sequence b+1's K rows. `at` is the next row of that stream to prefetch (whole rows: every kv head);
 * ahead() keeps it up to AHEAD rows past what the kernel is reading, a few rows per call, so the prefetches spread
 * over the arithmetic instead of filling the miss queue at once. */
typedef struct {
    const shape_args *s;
    const int64_t *table, *next_table;
    int64_t len, next_len;
    int64_t at, blk, off; /* the next row to prefetch: its place in the stream, and its block and offset there */
} read_ahead;

static inline void ahead(read_ahead *r, int64_t reading, int64_t max_rows) {
    if (!PREFETCH) return;
    const shape_args *s = r->s;
    int64_t upto = reading + AHEAD;
    const int64_t end = 2 * r->len + r->next_len;
    if (upto > end) upto = end;
    for (int64_t n = 0; r->at < upto && n < max_rows; n++) {
        const void *cache = r->at >= r->len && r->at < 2 * r->len ? s->v_cache : s->k_cache;
        const int64_t *table = r->at < 2 * r->len ? r->table : r->next_table;
        const char *p = (const char *)cache + (table[r->blk] * s->bs + r->off) * s->KE * s->esz;
        for (int64_t o = 0; o < s->K * s->E * s->esz; o += CACHE_LINE) PREFETCH_LINE(p + o);
        r->at++;
        if (++r->off == s->bs) { /* no division per row: it would cost as much as the row's arithmetic */
            r->off = 0;
            r->blk++;
        }
        if (r->at == r->len || r->at == 2 * r->len) r->blk = r->off = 0;
    }
}

/* ---- portable C ---- */

/* one path per cache element type T, its elements widened by CVT */
#define DEFINE_PORTABLE(NAME, T, CVT)                                                                             \
    static void seq_##NAME(const seq_args *a, const shape_args *s, read_ahead *r, float *scores, float *acc) {     \
        const int64_t len = a->len, H = s->H, G = s->G, E = s->E, KE = s->KE, bs = s->bs;                         \
        const void *rows[MAX_W];                                                                                   \
        for (int64_t c0 = 0; c0 < len; c0 += MAX_W) {                                                              \
            const int64_t n = len - c0 < MAX_W ? len - c0 : MAX_W;                                                 \
            chunk_rows(s->k_cache, a->table, bs, KE * s->esz, c0, n, MAX_W, rows);                                 \
            for (int64_t h = 0; h < H; h++) {                                                                      \
                ahead(r, c0, MAX_W / H + 2);                                                                       \
                const float *qh = a->q + h * E;                                                                    \
                const int64_t kh = h / G;                                                                          \
                for (int64_t j = 0; j < n; j++) {                                                                  \
                    const T *kr = (const T *)rows[j] + kh * E;                                                     \
                    float dot = 0.0f;                                                                              \
                    for (int64_t e = 0; e < E; e++) dot += qh[e] * CVT(kr[e]);                                     \
                    scores[h * len + c0 + j] = dot * s->scale;                                                     \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        mask_skipped(scores, H, len, a->skip);                                                                     \
        for (int64_t h = 0; h < H; h++) {                                                                          \
            float *sh = scores + h * len;                                                                          \
            float m = sh[0]; /* len >= 1 (checked by the caller): the current token is always in the context */   \
            for (int64_t c = 1; c < len; c++) m = sh[c] > m ? sh[c] : m;                                           \
            float sum = 0.0f;                                                                                      \
            for (int64_t c = 0; c < len; c++) {                                                                    \
                sh[c] = expf(sh[c] - m);                                                                           \
                sum += sh[c];                                                                                      \
            }                                                                                                      \
            const float inv = 1.0f / sum;                                                                          \
            for (int64_t c = 0; c < len; c++) sh[c] *= inv;                                                        \
        }                                                                                                          \
        for (int64_t i = 0; i < H * E; i++) acc[i] = 0.0f;                                                         \
        for (int64_t c0 = 0; c0 < len; c0 += bs) {                                                                 \
            const int64_t n = len - c0 < bs ? len - c0 : bs;                                                       \
            const T *vb = (const T *)s->v_cache + a->table[c0 / bs] * bs * KE;                                     \
            ahead(r, len + c0, n + 1);                                                                             \
            for (int64_t j = 0; j < n; j++) {                                                                      \
                for (int64_t h = 0; h < H; h++) {                                                                  \
                    const float w = scores[h * len + c0 + j];                                                      \
                    const T *vr = vb + j * KE + (h / G) * E;                                                       \
                    float *ah = acc + h * E;                                                                       \
                    for (int64_t e = 0; e < E; e++) ah[e] += w * CVT(vr[e]);                                       \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int64_t i = 0; i < H * E; i++) a->out[i] = acc[i];                                                    \
    }

#define AS_FLOAT(x) (x)
DEFINE_PORTABLE(portable, float, AS_FLOAT)
DEFINE_PORTABLE(portable_f16, uint16_t, half_to_float)

#if HAVE_X86
/* ---- the x86 paths' vector pieces ---- */

#define EXP_BODY(V, VI, SET1, MUL, ADD, FMADD, MAX, ROUND, CVT, ADDI, SLLI, SETI, CASTI, x)                       \
    const V lo = SET1(EXP_MIN);                                                                                    \
    const V xc = MAX(x, lo);                                                                                       \
    const V n = ROUND(MUL(xc, SET1(1.44269504088896341f)));                                                        \
    V r = FMADD(n, SET1(-0.693359375f), xc);                                                                       \
    r = FMADD(n, SET1(2.12194440e-4f), r);                                                                         \
    V p = SET1(1.9875691500e-4f);                                                                                  \
    p = FMADD(p, r, SET1(1.3981999507e-3f));                                                                       \
    p = FMADD(p, r, SET1(8.3334519073e-3f));                                                                       \
    p = FMADD(p, r, SET1(4.1665795894e-2f));                                                                       \
    p = FMADD(p, r, SET1(1.6666665459e-1f));                                                                       \
    p = FMADD(p, r, SET1(5.0000001201e-1f));                                                                       \
    p = FMADD(MUL(p, r), r, ADD(r, SET1(1.0f)));                                                                   \
    const VI e = SLLI(ADDI(CVT(n), SETI(127)), 23);                                                                \
    const V y = MUL(p, CASTI(e));

#define round512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define round256(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* exp(x) for x <= 0; 0 below EXP_MIN (so for the masked lanes, -FLT_MAX) */
AVX512_FN static inline __m512 exp512(__m512 x) {
    EXP_BODY(__m512, __m512i, _mm512_set1_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_fmadd_ps,
             _mm512_max_ps, round512, _mm512_cvtps_epi32, _mm512_add_epi32, _mm512_slli_epi32,
             _mm512_set1_epi32, _mm512_castsi512_ps, x)
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), y);
}

AVX2_FN static inline __m256 exp256(__m256 x) {
    EXP_BODY(__m256, __m256i, _mm256_set1_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_fmadd_ps,
             _mm256_max_ps, round256, _mm256_cvtps_epi32, _mm256_add_epi32, _mm256_slli_epi32,
             _mm256_set1_epi32, _mm256_castsi256_ps, x)
    return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), y);
}

/* 16 vectors -> one: lane j = the sum of p[j]'s lanes */
AVX512_FN static inline __m512 sum_lanes512(const __m512 *p) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: rows 4i .. 4i+3, one partial sum each */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 8 vectors -> one: lane j = the sum of p[j]'s lanes */
AVX2_FN static inline __m256 sum_lanes256(const __m256 *p) {
    __m256 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_ps(_mm256_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm256_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

AVX2_FN static inline float hsum256(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2_FN static inline float hmax256(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX512_FN static inline __m512 lanes_below512(int64_t n) { /* 0, 1, ..., 15 < n: all ones, else 0 */
    return _mm512_castsi512_ps(_mm512_maskz_set1_epi32((__mmask16)((1u << n) - 1u), -1));
}

AVX2_FN static inline __m256 lanes_below256(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx));
}

/* One path's sequence, from one template: V is the vector type, W its width in floats, the rest its intrinsics.
 * scores [H, Lp] with Lp = len rounded up to W, lanes past len -FLT_MAX (so exp makes them 0). Register tiles of the
 * weighted sum: up to TG heads x TV vectors of accumulators, loops with constant bounds (fully unrolled, so the
 * tile stays in registers) and run-time guards for a partial tile. */
#define DEFINE_PATH(NAME, ATTR, V, W, TG, TV, T, LOADKV, LOADU, STOREU, SET1, ZERO, MUL, ADD, SUB, FMADD, MAX, BLEND, \
                    BLEND_BELOW, SUMLANES, HSUM, HMAX, EXP)                                                        \
    ATTR static void seq_##NAME(const seq_args *a, const shape_args *s, read_ahead *r, float *scores, float *acc) { \
        const int64_t len = a->len, H = s->H, G = s->G, E = s->E, KE = s->KE, bs = s->bs;                         \
        const int64_t Lp = (len + W - 1) / W * W;                                                                  \
        const V scale = SET1(s->scale), masked = SET1(-FLT_MAX);                                                    \
        const void *rows[W];                                                                                       \
        for (int64_t c0 = 0; c0 < len; c0 += W) {                                                                  \
            const int64_t n = len - c0 < W ? len - c0 : W;                                                         \
            chunk_rows(s->k_cache, a->table, bs, KE * (int64_t)sizeof(T), c0, n, W, rows);                         \
            const V valid = BLEND_BELOW(n);                                                                        \
            for (int64_t h = 0; h < H; h++) {                                                                      \
                ahead(r, c0, W / H + 2);                                                                           \
                const float *qh = a->q + h * E;                                                                    \
                const int64_t ko = (h / G) * E;                                                                    \
                V part[W];                                                                                         \
                _Pragma("GCC unroll 16") for (int j = 0; j < W; j++) part[j] = ZERO();                             \
                for (int64_t e = 0; e < E; e += W) {                                                               \
                    const V qv = LOADU(qh + e);                                                                    \
                    _Pragma("GCC unroll 16") for (int j = 0; j < W; j++)                                           \
                        part[j] = FMADD(qv, LOADKV((const T *)rows[j] + ko + e), part[j]);                         \
                }                                                                                                  \
                const V sc = MUL(SUMLANES(part), scale);                                                           \
                STOREU(scores + h * Lp + c0, n == W ? sc : BLEND(masked, sc, valid));                                \
            }                                                                                                      \
        }                                                                                                          \
        mask_skipped(scores, H, Lp, a->skip);                                                                      \
        float inv[H];                                                                                              \
        for (int64_t h = 0; h < H; h++) {                                                                          \
            float *sh = scores + h * Lp;                                                                           \
            V m = LOADU(sh);                                                                                       \
            for (int64_t c = W; c < Lp; c += W) m = MAX(m, LOADU(sh + c));                                         \
            const V mv = SET1(HMAX(m));                                                                            \
            V sum = ZERO();                                                                                        \
            for (int64_t c = 0; c < Lp; c += W) {                                                                  \
                const V p = EXP(SUB(LOADU(sh + c), mv));                                                           \
                STOREU(sh + c, p);                                                                                 \
                sum = ADD(sum, p);                                                                                 \
            }                                                                                                      \
            inv[h] = 1.0f / HSUM(sum);                                                                             \
        }                                                                                                          \
        for (int64_t i = 0; i < H * E; i++) acc[i] = 0.0f;                                                         \
        for (int64_t c0 = 0; c0 < len; c0 += bs) {                                                                 \
            const int64_t n = len - c0 < bs ? len - c0 : bs;                                                       \
            const T *vb = (const T *)s->v_cache + a->table[c0 / bs] * bs * KE;                                     \
            for (int64_t g0 = 0, gn; g0 < H; g0 += gn) { /* heads g0 .. g0 + gn - 1, all of one kv head */         \
                gn = TG < G - g0 % G ? TG : G - g0 % G;                                                            \
                ahead(r, len + c0, n * gn / H + 2);                                                                \
                const T *vh = vb + (g0 / G) * E;                                                                   \
                const float *p = scores + g0 * Lp + c0;                                                            \
                for (int64_t e0 = 0; e0 < E; e0 += W * TV) {                                                       \
                    const int64_t vn = (E - e0) / W < TV ? (E - e0) / W : TV;                                      \
                    V t[TG][TV];                                                                                   \
                    _Pragma("GCC unroll 4") for (int g = 0; g < TG; g++)                                           \
                    _Pragma("GCC unroll 4") for (int i = 0; i < TV; i++)                                           \
                        t[g][i] = g < gn && i < vn ? LOADU(acc + (g0 + g) * E + e0 + W * i) : ZERO();              \
                    for (int64_t j = 0; j < n; j++) {                                                              \
                        const T *vr = vh + j * KE + e0;                                                            \
                        V x[TV];                                                                                   \
                        _Pragma("GCC unroll 4") for (int i = 0; i < TV; i++) x[i] = i < vn ? LOADKV(vr + W * i) : ZERO(); \
                        _Pragma("GCC unroll 4") for (int g = 0; g < TG; g++) {                                     \
                            if (g >= gn) break;                                                                    \
                            const V w = SET1(p[g * Lp + j]);                                                       \
                            _Pragma("GCC unroll 4") for (int i = 0; i < TV; i++)                                   \
                                if (i < vn) t[g][i] = FMADD(w, x[i], t[g][i]);                                     \
                        }                                                                                          \
                    }                                                                                              \
                    _Pragma("GCC unroll 4") for (int g = 0; g < TG; g++)                                           \
                    _Pragma("GCC unroll 4") for (int i = 0; i < TV; i++)                                           \
                        if (g < gn && i < vn) STOREU(acc + (g0 + g) * E + e0 + W * i, t[g][i]);                    \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int64_t h = 0; h < H; h++) {                                                                          \
            const V iv = SET1(inv[h]);                                                                             \
            for (int64_t e = 0; e < E; e += W) STOREU(a->out + h * E + e, MUL(LOADU(acc + h * E + e), iv));        \
        }                                                                                                          \
    }

/* a where mask's lane is 0, b where it is all ones */
AVX512_FN static inline __m512 blend512(__m512 a, __m512 b, __m512 mask) {
    return _mm512_mask_blend_ps(_mm512_cmpneq_epi32_mask(_mm512_castps_si512(mask), _mm512_setzero_si512()), a, b);
}
#define blend256 _mm256_blendv_ps

#define DEFINE_PATH_(...) DEFINE_PATH(__VA_ARGS__) /* expands AVX512_ARGS / AVX2_ARGS into DEFINE_PATH's arguments */
/* 16 / 8 float16 cache elements widened to a vector of floats (exact) */
#define load_f16x16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define load_f16x8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))

/* AVX-512: 12 accumulators + 4 V vectors of the 32 zmm registers; float32 and float16 caches */
#define AVX512_ARGS _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_mul_ps, _mm512_add_ps, \
    _mm512_sub_ps, _mm512_fmadd_ps, _mm512_max_ps, blend512, lanes_below512, sum_lanes512, _mm512_reduce_add_ps,     \
    _mm512_reduce_max_ps, exp512
DEFINE_PATH_(avx512, AVX512_FN, __m512, 16, 3, 4, float, _mm512_loadu_ps, AVX512_ARGS)
DEFINE_PATH_(avx512_f16, AVX512_FN, __m512, 16, 3, 4, uint16_t, load_f16x16, AVX512_ARGS)
/* AVX2: 6 accumulators + 2 V vectors of the 16 ymm registers */
#define AVX2_ARGS _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_mul_ps, _mm256_add_ps,   \
    _mm256_sub_ps, _mm256_fmadd_ps, _mm256_max_ps, blend256, lanes_below256, sum_lanes256, hsum256, hmax256, exp256
DEFINE_PATH_(avx2, AVX2_FN, __m256, 8, 3, 2, float, _mm256_loadu_ps, AVX2_ARGS)
DEFINE_PATH_(avx2_f16, AVX2_FN, __m256, 8, 3, 2, uint16_t, load_f16x8, AVX2_ARGS)
#endif /* HAVE_X86 */

/* 1 when this CPU (and this build) can run `path` */
int paged_path_supported(int path) {
    if (path == PATH_PORTABLE) return 1;
#if HAVE_X86
    __builtin_cpu_init();
    if (path == PATH_AVX2) /* F16C (every AVX2 CPU has it) widens the 16-bit KV cache */
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (path == PATH_AVX512) return __builtin_cpu_supports("avx512f");
#endif
    return 0;
}

/* the fastest path this CPU runs (asked once) */
int paged_best_path(void) {
    static int best;
    if (!best) best = paged_path_supported(PATH_AVX512) ? PATH_AVX512
                      : paged_path_supported(PATH_AVX2)  ? PATH_AVX2
                                                         : PATH_PORTABLE;
    return best;
}

/* a per-thread work area that only grows: no allocation per call once the longest context has been seen */
static float *work_area(int64_t floats) {
    static _Thread_local float *area;
    static _Thread_local int64_t size;
    if (floats > size) {
        float *grown = realloc(area, sizeof(float) * (size_t)floats);
        if (!grown) return NULL;
        area = grown;
        size = floats;
    }
    return area;
}

typedef void (*seq_fn)(const seq_args *, const shape_args *, read_ahead *, float *, float *);

/* Sequence b's keys under a sliding window (0: none): its table from the window's first block, its length from that
 * block's first key, and the keys before the window in that block masked. */
static inline seq_args windowed(const float *q, float *out, const int64_t *table, int64_t len, int64_t window,
                                int64_t bs) {
    const int64_t start = window > 0 && len > window ? len - window : 0, first = start / bs * bs;
    return (seq_args){q, out, table + start / bs, len - first, start - first};
}

/* Decode attention over kv heads kv_begin .. kv_end-1 only (their query heads' rows of `out` are written, the others
 * left alone), under a sliding window of `window` keys (0: none): one sequence's attention split over two threads by
 * heads. A head's result is the same bits whichever heads come with it (every step is per head). kv16: the caches
 * hold float16 (else float32). */
int paged_decode_window_path(int path, int kv16, const float *q, float *out, const void *k_cache, const void *v_cache,
                             const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t b_begin,
                             int64_t b_end, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size, float scale, int64_t kv_begin, int64_t kv_end, int64_t window) {
    if (window < 0) return -1;
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim < 1 || block_size < 1) return -1;
    if (kv_begin < 0 || kv_end > num_kv_heads || kv_begin >= kv_end) return -1;
    if (!paged_path_supported(path)) return -4;
    const int64_t G = num_heads / num_kv_heads, E = head_dim, HE = num_heads * head_dim, esz = kv16 ? 2 : 4;
    const int64_t H = (kv_end - kv_begin) * G, first = kv_begin * G * E; /* the heads computed, and where they start */
    const shape_args s = {(const char *)k_cache + kv_begin * E * esz, (const char *)v_cache + kv_begin * E * esz,
                          H, kv_end - kv_begin, G, E, num_kv_heads * head_dim, block_size, esz, scale};
    seq_fn run = kv16 ? seq_portable_f16 : seq_portable;
#if HAVE_X86
    if (path == PATH_AVX512 && E % 16 == 0)
        run = kv16 ? seq_avx512_f16 : seq_avx512;
    else if (path >= PATH_AVX2 && E % 8 == 0) /* AVX-512 CPUs have AVX2: a head_dim of 8k serves there */
        run = kv16 ? seq_avx2_f16 : seq_avx2;
#endif
    int64_t longest = 1;
    for (int64_t b = b_begin; b < b_end; b++) {
        if (lens[b] < 1) return -3; /* the current token is always in the context */
        longest = lens[b] > longest ? lens[b] : longest;
    }
    const int64_t padded = (longest + MAX_W - 1) / MAX_W * MAX_W;
    float *scores = work_area(H * padded + H * E);
    if (!scores) return -2;
    read_ahead r = {&s, NULL, NULL, 0, 0, 0, 0, 0};
    for (int64_t b = b_begin; b < b_end; b++) {
        const int next = b + 1 < b_end;
        const seq_args a = windowed(q + b * HE + first, out + b * HE + first, tables + b * max_blocks, lens[b], window,
                                    block_size);
        r.table = a.table;
        r.len = a.len;
        const seq_args n = next ? windowed(q, out, tables + (b + 1) * max_blocks, lens[b + 1], window, block_size) : a;
        r.next_table = next ? n.table : NULL;
        r.next_len = next ? n.len : 0;
        run(&a, &s, &r, scores, scores + H * padded);
        if (r.at >= 2 * a.len) { /* what was read ahead of the next sequence: its block and offset carry over */
            r.at -= 2 * a.len;
        } else {
            r.at = r.blk = r.off = 0;
        }
    }
    return 0;
}

/* paged_decode_window_path without a window */
int paged_decode_heads_path(int path, int kv16, const float *q, float *out, const void *k_cache, const void *v_cache,
                            const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t b_begin,
                            int64_t b_end, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, int64_t kv_begin, int64_t kv_end) {
    return paged_decode_window_path(path, kv16, q, out, k_cache, v_cache, tables, max_blocks, lens, b_begin, b_end,
                                    num_heads, num_kv_heads, head_dim, block_size, scale, kv_begin, kv_end, 0);
}

/* paged_decode_heads_path over a float32 cache */
int paged_decode_heads_f32_path(int path, const float *q, float *out, const float *k_cache, const float *v_cache,
                                const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t b_begin,
                                int64_t b_end, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, float scale, int64_t kv_begin, int64_t kv_end) {
    return paged_decode_heads_path(path, 0, q, out, k_cache, v_cache, tables, max_blocks, lens, b_begin, b_end,
                                   num_heads, num_kv_heads, head_dim, block_size, scale, kv_begin, kv_end);
}

/* paged_decode_heads_f32_path over every kv head */
int paged_decode_f32_path(int path, const float *q, float *out, const float *k_cache, const float *v_cache,
                          const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t b_begin,
                          int64_t b_end, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, float scale) {
    return paged_decode_heads_f32_path(path, q, out, k_cache, v_cache, tables, max_blocks, lens, b_begin, b_end,
                                       num_heads, num_kv_heads, head_dim, block_size, scale, 0, num_kv_heads);
}

/* paged_decode_f32_path on the fastest path this CPU runs */
int paged_decode_f32(const float *q, float *out, const float *k_cache, const float *v_cache, const int64_t *tables,
                     int64_t max_blocks, const int64_t *lens, int64_t b_begin, int64_t b_end, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    return paged_decode_f32_path(paged_best_path(), q, out, k_cache, v_cache, tables, max_blocks, lens, b_begin,
                                 b_end, num_heads, num_kv_heads, head_dim, block_size, scale);
}
