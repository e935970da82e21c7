/* Decode attention read straight from the paged KV cache: no gather, no padding, no mask.
 *
 * One query token per sequence (a decode step). For each sequence b and kv head kh, the G = H / K query
 * heads that share kh walk the sequence's blocks once for K (scores) and once for V (weighted sum), so each
 * cached K/V row is read from memory once per step instead of being copied into a padded tensor first.
 *
 *   q        [B, H, E]   queries of the decoding sequences (float32, contiguous)
 *   out      [B, H, E]   attention output
 *   k_cache  [S, K, E]   one layer's cache; slot = block_id * block_size + offset (v_cache alike)
 *   tables   [B, NB]     int64 block table of each sequence
 *   lens     [B]         int64 context length: keys 0 .. lens[b]-1 (the current token's K/V is written)
 *
 * Only sequences b_begin .. b_end-1 are computed, so a caller can split one batch over threads.
 *
 * Per sequence: scores[h, c] = scale * <q_h, k_c> (one block and one kv head at a time: the G query heads of kh
 * against the block's rows), a softmax per head, then out_h = sum_c p[h, c] * v_c (one block and one kv head at
 * a time, the G heads' sums held in registers across the block's rows on the x86 paths, so each V row is loaded
 * once per kv head and the sums are not stored and reloaded per row).
 *
 * Paths (`path` argument; paged_best_path() says which this CPU runs, paged_path_supported() which it can):
 *   1 portable C: any CPU, any compiler; the loops are left to the compiler to vectorise.
 *   2 AVX2 + FMA: 8-float vectors (head_dim a multiple of 8; else the portable path serves).
 *   3 AVX-512 F: 16-float vectors (head_dim a multiple of 16; else AVX2, else portable).
 * The x86 paths are compiled with target attributes, so the library builds and loads on any x86-64 CPU and the
 * path is chosen at run time from the CPU's flags. The paths differ only in summation order (the dot products'
 * lanes), at the level of float32 rounding; a row's result does not depend on the other rows of the batch.
 *
 * Built at run time by tokenloop/engine/kernels.py (cc -O3 -march=native -ffast-math at compile time only, so
 * the exp of the softmax vectorises while loading the library leaves the process's denormal handling alone);
 * the pure-torch path in model.py is the fallback and the reference in the tests.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

enum { PATH_PORTABLE = 1, PATH_AVX2 = 2, PATH_AVX512 = 3 };

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86 1
#include <immintrin.h>
#define AVX2_FN __attribute__((target("avx2,fma")))
#define AVX512_FN __attribute__((target("avx512f")))
#else
#define HAVE_X86 0
#endif

/* One block's rows (n of them, rows KE floats apart, k pointing at kv head kh's slice of the first) against the
 * G query heads of kh (q [G, E]): s[g * len + j] = scale * <q_g, k_j>. */
typedef void (*qk_fn)(const float *q, const float *k, int64_t KE, int64_t n, int64_t G, int64_t E, float scale,
                      float *s, int64_t len);
/* acc[g, :] += sum_j p[g * len + j] * v_j over one block's rows (v as k above); acc [G, E]. */
typedef void (*pv_fn)(float *acc, const float *p, int64_t len, const float *v, int64_t KE, int64_t n, int64_t G,
                      int64_t E);

static void qk_portable(const float *q, const float *k, int64_t KE, int64_t n, int64_t G, int64_t E, float scale,
                        float *s, int64_t len) {
    for (int64_t j = 0; j < n; j++) {
        const float *kr = k + j * KE;
        for (int64_t g = 0; g < G; g++) {
            const float *qh = q + g * E;
            float dot = 0.0f;
            for (int64_t e = 0; e < E; e++) dot += qh[e] * kr[e];
            s[g * len + j] = dot * scale;
        }
    }
}

static void pv_portable(float *acc, const float *p, int64_t len, const float *v, int64_t KE, int64_t n, int64_t G,
                        int64_t E) {
    for (int64_t j = 0; j < n; j++) {
        const float *vr = v + j * KE;
        for (int64_t g = 0; g < G; g++) {
            const float w = p[g * len + j];
            float *a = acc + g * E;
            for (int64_t e = 0; e < E; e++) a[e] += w * vr[e];
        }
    }
}

#if HAVE_X86
/* One path's two functions, from one template: V is the vector type, W its width in floats, the rest its
 * intrinsics. Register tiles of the weighted sum: up to TG heads x TV vectors of accumulators, loops with constant
 * bounds (fully unrolled, so the tile stays in registers) and run-time guards for a partial tile. */
#define DEFINE_PATH(NAME, ATTR, V, W, TG, TV, LOADU, STOREU, SET1, ZERO, MUL, ADD, FMADD, HSUM)                     \
    ATTR static void qk_##NAME(const float *q, const float *k, int64_t KE, int64_t n, int64_t G, int64_t E,        \
                               float scale, float *s, int64_t len) {                                               \
        for (int64_t j = 0; j < n; j++) {                                                                          \
            const float *kr = k + j * KE;                                                                          \
            for (int64_t g = 0; g < G; g++) {                                                                      \
                const float *qh = q + g * E;                                                                       \
                V a0 = MUL(LOADU(qh), LOADU(kr)), a1 = ZERO();                                                     \
                int64_t e = W;                                                                                     \
                for (; e + 2 * W <= E; e += 2 * W) {                                                               \
                    a1 = FMADD(LOADU(qh + e), LOADU(kr + e), a1);                                                  \
                    a0 = FMADD(LOADU(qh + e + W), LOADU(kr + e + W), a0);                                          \
                }                                                                                                  \
                if (e < E) a1 = FMADD(LOADU(qh + e), LOADU(kr + e), a1);                                           \
                s[g * len + j] = HSUM(ADD(a0, a1)) * scale;                                                        \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
    ATTR static void pv_##NAME(float *acc, const float *p, int64_t len, const float *v, int64_t KE, int64_t n,     \
                               int64_t G, int64_t E) {                                                             \
        for (int64_t g0 = 0; g0 < G; g0 += TG) {                                                                   \
            const int64_t gn = G - g0 < TG ? G - g0 : TG;                                                          \
            for (int64_t e0 = 0; e0 < E; e0 += W * TV) {                                                           \
                const int64_t vn = (E - e0) / W < TV ? (E - e0) / W : TV;                                          \
                V a[TG][TV];                                                                                       \
                _Pragma("GCC unroll 4") for (int g = 0; g < TG; g++)                                               \
                _Pragma("GCC unroll 4") for (int i = 0; i < TV; i++)                                               \
                    a[g][i] = g < gn && i < vn ? LOADU(acc + (g0 + g) * E + e0 + W * i) : ZERO();                  \
                for (int64_t j = 0; j < n; j++) {                                                                  \
                    const float *vr = v + j * KE + e0;                                                             \
                    V x[TV];                                                                                       \
                    _Pragma("GCC unroll 4") for (int i = 0; i < TV; i++) x[i] = i < vn ? LOADU(vr + W * i) : ZERO(); \
                    _Pragma("GCC unroll 4") for (int g = 0; g < TG; g++) {                                         \
                        if (g >= gn) break;                                                                        \
                        const V w = SET1(p[(g0 + g) * len + j]);                                                   \
                        _Pragma("GCC unroll 4") for (int i = 0; i < TV; i++)                                       \
                            if (i < vn) a[g][i] = FMADD(w, x[i], a[g][i]);                                         \
                    }                                                                                              \
                }                                                                                                  \
                _Pragma("GCC unroll 4") for (int g = 0; g < TG; g++)                                               \
                _Pragma("GCC unroll 4") for (int i = 0; i < TV; i++)                                               \
                    if (g < gn && i < vn) STOREU(acc + (g0 + g) * E + e0 + W * i, a[g][i]);                        \
            }                                                                                                      \
        }                                                                                                          \
    }

AVX2_FN static inline float hsum256(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* AVX-512: 16 accumulators + 4 V vectors of the 32 zmm registers */
DEFINE_PATH(avx512, AVX512_FN, __m512, 16, 4, 4, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_setzero_ps,
            _mm512_mul_ps, _mm512_add_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps)
/* AVX2: 8 accumulators + 2 V vectors of the 16 ymm registers */
DEFINE_PATH(avx2, AVX2_FN, __m256, 8, 4, 2, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps, _mm256_setzero_ps,
            _mm256_mul_ps, _mm256_add_ps, _mm256_fmadd_ps, hsum256)
#endif /* HAVE_X86 */

/* 1 when this CPU (and this build) can run `path` */
int paged_path_supported(int path) {
    if (path == PATH_PORTABLE) return 1;
#if HAVE_X86
    __builtin_cpu_init();
    if (path == PATH_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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

int paged_decode_f32_path(int path, const float *q, float *out, const float *k_cache, const float *v_cache,
                          const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t b_begin,
                          int64_t b_end, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, float scale) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim < 1 || block_size < 1) return -1;
    if (!paged_path_supported(path)) return -4;
    const int64_t H = num_heads, G = num_heads / num_kv_heads, E = head_dim, KE = num_kv_heads * head_dim;
    qk_fn qk = qk_portable;
    pv_fn pv = pv_portable;
#if HAVE_X86
    if (path == PATH_AVX512 && E % 16 == 0) {
        qk = qk_avx512;
        pv = pv_avx512;
    } else if (path >= PATH_AVX2 && E % 8 == 0) { /* AVX-512 CPUs have AVX2: a head_dim of 8k serves there */
        qk = qk_avx2;
        pv = pv_avx2;
    }
#endif
    int64_t longest = 1;
    for (int64_t b = b_begin; b < b_end; b++) longest = lens[b] > longest ? lens[b] : longest;
    float *scores = malloc(sizeof(float) * (size_t)(H * longest)); /* [H, len] */
    float *acc = malloc(sizeof(float) * (size_t)(H * E));
    if (!scores || !acc) {
        free(scores);
        free(acc);
        return -2;
    }
    for (int64_t b = b_begin; b < b_end; b++) {
        const int64_t len = lens[b];
        if (len < 1) {
            free(scores);
            free(acc);
            return -3;
        }
        const int64_t *table = tables + b * max_blocks;
        const float *qb = q + b * H * E;
        /* scores[h, c] = scale * <q_h, k_c>, a block and a kv head at a time (query head h = kh * G + g) */
        for (int64_t c0 = 0; c0 < len; c0 += block_size) {
            const int64_t n = len - c0 < block_size ? len - c0 : block_size;
            const float *kb = k_cache + table[c0 / block_size] * block_size * KE;
            for (int64_t kh = 0; kh < num_kv_heads; kh++)
                qk(qb + kh * G * E, kb + kh * E, KE, n, G, E, scale, scores + kh * G * len + c0, len);
        }
        /* softmax over c, per query head */
        for (int64_t h = 0; h < H; h++) {
            float *s = scores + h * len;
            float m = s[0]; /* len >= 1 (checked above): the current token is always in the context */
            for (int64_t c = 1; c < len; c++) m = s[c] > m ? s[c] : m;
            float sum = 0.0f;
            for (int64_t c = 0; c < len; c++) {
                s[c] = expf(s[c] - m);
                sum += s[c];
            }
            const float inv = 1.0f / sum;
            for (int64_t c = 0; c < len; c++) s[c] *= inv;
        }
        /* out_h = sum_c p[h, c] * v_c */
        for (int64_t i = 0; i < H * E; i++) acc[i] = 0.0f;
        for (int64_t c0 = 0; c0 < len; c0 += block_size) {
            const int64_t n = len - c0 < block_size ? len - c0 : block_size;
            const float *vb = v_cache + table[c0 / block_size] * block_size * KE;
            for (int64_t kh = 0; kh < num_kv_heads; kh++)
                pv(acc + kh * G * E, scores + kh * G * len + c0, len, vb + kh * E, KE, n, G, E);
        }
        float *ob = out + b * H * E;
        for (int64_t i = 0; i < H * E; i++) ob[i] = acc[i];
    }
    free(scores);
    free(acc);
    return 0;
}

/* paged_decode_f32_path on the fastest path this CPU runs */
int paged_decode_f32(const float *q, float *out, const float *k_cache, const float *v_cache, const int64_t *tables,
                     int64_t max_blocks, const int64_t *lens, int64_t b_begin, int64_t b_end, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    return paged_decode_f32_path(paged_best_path(), q, out, k_cache, v_cache, tables, max_blocks, lens, b_begin,
                                 b_end, num_heads, num_kv_heads, head_dim, block_size, scale);
}
