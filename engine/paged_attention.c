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
 * Built at run time by tokenloop/engine/kernels.py (cc -O3 -march=native -ffast-math at compile time only, so
 * the exp and the dot products vectorise while loading the library leaves the process's denormal handling
 * alone); the pure-torch path in model.py is the fallback and the reference in the tests.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

int paged_decode_f32(const float *q, float *out, const float *k_cache, const float *v_cache,
                     const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t b_begin,
                     int64_t b_end, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, float scale) {
    const int64_t H = num_heads, G = num_heads / num_kv_heads, E = head_dim, KE = num_kv_heads * head_dim;
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
        /* scores[h, c] = scale * <q_h, k_c>: each block's rows (all kv heads) are read front to back */
        for (int64_t c0 = 0; c0 < len; c0 += block_size) {
            const int64_t n = len - c0 < block_size ? len - c0 : block_size;
            const float *kb = k_cache + table[c0 / block_size] * block_size * KE;
            for (int64_t j = 0; j < n; j++) {
                const float *krow = kb + j * KE;
                for (int64_t h = 0; h < H; h++) {
                    const float *k = krow + (h / G) * E, *qh = qb + h * E;
                    float dot = 0.0f;
                    for (int64_t e = 0; e < E; e++) dot += qh[e] * k[e];
                    scores[h * len + c0 + j] = dot * scale;
                }
            }
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
            for (int64_t j = 0; j < n; j++) {
                const float *vrow = vb + j * KE;
                for (int64_t h = 0; h < H; h++) {
                    const float p = scores[h * len + c0 + j], *v = vrow + (h / G) * E;
                    float *a = acc + h * E;
                    for (int64_t e = 0; e < E; e++) a[e] += p * v[e];
                }
            }
        }
        float *ob = out + b * H * E;
        for (int64_t i = 0; i < H * E; i++) ob[i] = acc[i];
    }
    free(scores);
    free(acc);
    return 0;
}
