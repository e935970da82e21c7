/* The small float32 operations of a decoder layer, each in one call: RMSNorm (with the residual add before it),
 * rotary embedding with the K/V cache write, and SiLU(gate) * up.
 *
 * A decode step of one sequence spends most of its non-matmul time calling ~25 small torch operators per layer
 * (~8 us each, mostly dispatch): for SmolLM2-135M that was ~6 ms of a 15 ms --weights int8 step. These three
 * calls replace them on every path (prefill and decode alike), so a row gets the same bits alone and in any
 * batch. Their arithmetic differs from torch's only in summation order (RMSNorm's sum of squares, the exp in
 * SiLU), at the level of the decode-attention kernel's (paged_attention.c); the engine's fp32 tests against
 * transformers hold token for token.
 *
 *   add_rms_norm_f32: h [T, D] += delta (when given), then out = weight * (h * rsqrt(mean(h^2) + eps))
 *   rope_store_f32:   qkv [T, (H + 2K) * E], rows `stride` apart: rotates the H query and K key heads in place
 *                     (half-split layout: x * cos + rotate_half(x) * sin, cos/sin [max_context, E] rows picked by
 *                     positions[t]), then copies each token's K and V heads to k_cache / v_cache [S, K, E] at
 *                     slot slots[t]
 *   silu_mul_f32:     gate_up [T, 2I] -> out [T, I] = silu(gate) * up
 *
 * Built at run time by tokenloop/engine/kernels.py like the other kernels (-O3 -march=native -ffast-math at
 * compile time only); without it model.py runs the same operations in torch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

void add_rms_norm_f32(float *h, const float *delta, const float *weight, float eps, float *out, int64_t T,
                      int64_t D) {
    for (int64_t t = 0; t < T; t++) {
        float *x = h + t * D;
        if (delta) {
            const float *d = delta + t * D;
            for (int64_t i = 0; i < D; i++) x[i] += d[i];
        }
        float acc[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= D; i += 8)
            for (int l = 0; l < 8; l++) acc[l] += x[i + l] * x[i + l];
        float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; i < D; i++) sum += x[i] * x[i];
        const float rstd = 1.0f / sqrtf(sum / (float)D + eps);
        float *o = out + t * D;
        for (int64_t j = 0; j < D; j++) o[j] = weight[j] * (x[j] * rstd);
    }
}

int rope_store_f32(float *qkv, int64_t T, int64_t stride, int64_t H, int64_t K, int64_t E, const float *cos,
                   const float *sin, const int64_t *positions, const int64_t *slots, float *k_cache, float *v_cache) {
    if (E % 2 != 0) return -1;
    const int64_t half = E / 2;
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * stride;
        const float *c = cos + positions[t] * E, *s = sin + positions[t] * E;
        for (int64_t head = 0; head < H + K; head++) {
            float *x = row + head * E;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
        if (slots) {
            const int64_t slot = slots[t];
            memcpy(k_cache + slot * K * E, row + H * E, sizeof(float) * (size_t)(K * E));
            memcpy(v_cache + slot * K * E, row + (H + K) * E, sizeof(float) * (size_t)(K * E));
        }
    }
    return 0;
}

void silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
