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
 *   add_rms_norm_f32: h [T, D] += delta (when given), then out = weight * (h * rsqrt(mean(h^2) + eps)) (out may be
 *                     h: in place)
 *   rope_store_f32:   qkv [T, (H + 2K) * E], rows `stride` apart: rotates the H query and K key heads in place
 *                     (half-split layout: x * cos + rotate_half(x) * sin, cos/sin [max_context, E] rows picked by
 *                     positions[t]), then copies each token's K and V heads to k_cache / v_cache [S, K, E] at
 *                     slot slots[t], and (q_out given) its rotated query heads to q_out [T, H * E], contiguous rows
 *                     for the decode-attention kernel. rope_store_kv: the same, into a float32 cache or (kv16) a
 *                     float16 one, each K/V value rounded to the nearest float16 (ties to even: F16C's vcvtps2ph,
 *                     torch's .half()); the quantized modes' 16-bit KV cache (docs/engine.md#16-bit-kv-cache)
 *   silu_mul_f32:     gate_up [T, 2I] -> out [T, I] = silu(gate) * up
 *   gelu_mul_f32:     the same with GeGLU's gelu (tanh approximation, in torch's order of operations:
 *                     0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g^3))) * up; Gemma 3)
 *   rms_norm_heads_f32: qkv rows `stride` apart: each of the H query heads normalized in place over its E values with
 *                     q_weight [E], each of the K key heads after them with k_weight [E] (Qwen3's, Gemma 3's q/k
 *                     norms, before the rotary embedding)
 *
 *   decode_step_f32:  every decoder layer of a step of one-query attention groups in one call (below, "One call per
 *                     decode step")
 *
 * Built at run time by tokenloop/engine/kernels.py like the other kernels (-O3 -march=native -ffast-math at
 * compile time only); without it model.py runs the same operations in torch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* float32 -> float16, rounded to nearest even (inf past float16's range; NaN stays NaN): F16C where the build has it,
 * else the same rounding in bit arithmetic (F. Giesen's float_to_half_fast3_rtne) */
static inline uint16_t half_from_float(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0);
#else
    union { float f; uint32_t u; } v = {f}, magic = {.u = 126u << 23}; /* 0.5: a float16 subnormal's ulp in bit 0 */
    const uint32_t sign = v.u & 0x80000000u;
    uint32_t x = v.u ^ sign;
    uint16_t o;
    if (x >= (143u << 23)) { /* 2^16 and above, inf, NaN */
        o = x > (255u << 23) ? 0x7e00 : 0x7c00;
    } else if (x < (113u << 23)) { /* below 2^-14: a float16 subnormal or zero; the float add rounds to even */
        v.u = x;
        v.f += magic.f;
        o = (uint16_t)(v.u - magic.u);
    } else {
        const uint32_t odd = (x >> 13) & 1;
        x += ((uint32_t)(15 - 127) << 23) + 0xfff + odd;
        o = (uint16_t)(x >> 13);
    }
    return o | (uint16_t)(sign >> 16);
#endif
}

/* n floats -> float16 at dst */
static void store_half(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = half_from_float(src[i]);
}

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

int rope_store_kv(float *qkv, int64_t T, int64_t stride, int64_t H, int64_t K, int64_t E, const float *cos,
                  const float *sin, const int64_t *positions, const int64_t *slots, void *k_cache, void *v_cache,
                  float *q_out, int kv16) {
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
        if (slots && kv16) {
            const int64_t at = slots[t] * K * E;
            store_half((uint16_t *)k_cache + at, row + H * E, K * E);
            store_half((uint16_t *)v_cache + at, row + (H + K) * E, K * E);
        } else if (slots) {
            const int64_t at = slots[t] * K * E;
            memcpy((float *)k_cache + at, row + H * E, sizeof(float) * (size_t)(K * E));
            memcpy((float *)v_cache + at, row + (H + K) * E, sizeof(float) * (size_t)(K * E));
        }
        if (q_out) memcpy(q_out + t * H * E, row, sizeof(float) * (size_t)(H * E));
    }
    return 0;
}

/* rope_store_kv into a float32 cache */
int rope_store_f32(float *qkv, int64_t T, int64_t stride, int64_t H, int64_t K, int64_t E, const float *cos,
                   const float *sin, const int64_t *positions, const int64_t *slots, float *k_cache, float *v_cache,
                   float *q_out) {
    return rope_store_kv(qkv, T, stride, H, K, E, cos, sin, positions, slots, k_cache, v_cache, q_out, 0);
}

void silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

void gelu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi), as torch's GeluKernel */
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i++) {
            const float x = g[i], inner = beta * (x + kappa * (x * x * x));
            o[i] = 0.5f * x * (1.0f + tanhf(inner)) * u[i];
        }
    }
}

void rms_norm_heads_f32(float *qkv, int64_t T, int64_t stride, int64_t H, int64_t K, int64_t E,
                        const float *q_weight, const float *k_weight, float eps) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t head = 0; head < H + K; head++) {
            float *x = qkv + t * stride + head * E; /* in place: add_rms_norm_f32 reads x[j] before it writes it */
            add_rms_norm_f32(x, NULL, head < H ? q_weight : k_weight, eps, x, 1, E);
        }
}

/* ---- One call per decode step ----
 *
 * A step whose attention groups are all one query per entry with lengths (decodes, and prompt chunks whose rows the
 * runner makes sequences of their own: runner.prepare), with no LoRA and quantized weights on an exact or x22 C
 * route, runs every layer here instead of ~10 Python/ctypes calls per layer (Model.forward's fast path). The order of
 * operations and the functions are those of the Python layer loop (Model._layer): the products go through the int8 /
 * int4 libraries' exported int{8,4}_linear_f32[_2t] and the attention through paged_decode_window_path, reached
 * through function pointers that Python takes from the loaded libraries (kernels.LayerOps.decode_step), so the
 * fused step gives the Python path's bits: the same functions on the same inputs.
 *
 * Per layer: h += delta, x = RMSNorm(h) -> qkv = x W_qkv^T (+ bias) (-> q/k heads' RMSNorm) -> rope (the layer's
 * own cos/sin table) + K/V cache write -> q copied out of qkv -> paged decode attention per group, over the layer's
 * sliding window (0: every key; paged_decode_window_path, split over the process's kernel worker thread as
 * Model._paged_decode splits it over the matmul helper; a group of one sequence, by kv heads, with the same bits per
 * head) -> o = attn W_o^T (-> o = RMSNorm(o)) -> h += o, x = RMSNorm(h) -> gate_up -> SiLU or GeLU * up -> down
 * (-> down = RMSNorm(down)) = delta. After the last layer h += delta. The steps in parentheses run where the layer
 * has those weights (Qwen3's q/k norms; Gemma 3's q/k norms and sandwich norms, the norms' (1 + w) folded at load). */

typedef int (*linear_fn)(int path, const float *x, int64_t M, int64_t K, const void *q, const void *s, int64_t G,
                         float *y, int64_t N, int64_t n_begin, int64_t n_end);
typedef int (*linear2_fn)(int path, const float *x, int64_t M, int64_t K, const void *q, const void *s, int64_t G,
                          float *y, int64_t N, int64_t n_begin, int64_t mid, int64_t n_end);
typedef int (*paged_fn)(int path, int kv16, const float *q, float *out, const void *k_cache, const void *v_cache,
                        const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t b_begin, int64_t b_end,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                        int64_t kv_begin, int64_t kv_end, int64_t window); /* paged_decode_window_path */

/* one quantized weight [N, K]: kind 0 = int8 (q, scale), 1 = int4 (q, sm); groups of G columns */
typedef struct {
    int64_t kind;
    const void *q, *s;
    int64_t N, K, G;
} dweight_t;

typedef struct {
    const float *input_norm, *post_norm, *qkv_bias; /* qkv_bias NULL when the model has none */
    dweight_t qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* this layer's [S, KV, E], float32 or float16 (dmodel_t.kv16) */
    const float *q_norm, *k_norm; /* [E] each, or NULL: no q/k norms */
    const float *post_attn_norm, *post_ff_norm; /* [D] each, or NULL: no sandwich norms */
    const float *cos, *sin; /* this layer's rope tables [max_context, E] (Gemma 3's local layers have their own) */
    int64_t window; /* attend to the last `window` keys only; 0: every key */
} dlayer_t;

/* the model, built once at load (kernels.DecodePlan) */
typedef struct {
    int64_t num_layers, D, H, KV, E, I, block_size;
    float eps, scale;
    const dlayer_t *layers;
    int64_t kv16; /* the KV cache holds float16 */
    int64_t gelu; /* the MLP's activation: 0 SiLU, 1 GeLU (tanh approximation) */
} dmodel_t;

/* what a step's route and kernels are: the products' function pointers and path codes per kind, the attention's */
typedef struct {
    linear_fn linear[2];
    linear2_fn linear2[2];
    int64_t path[2];
    int64_t split; /* products over two threads (the kernel worker), channels split as linear2 does */
    paged_fn paged;
    int64_t paged_path;
    int64_t split_attention; /* a group with 0 < split < num_seqs runs its halves on two threads */
} dkernels_t;

/* one decode group: sequences out_start .. out_start + num_seqs - 1 of the step */
typedef struct {
    const int64_t *tables; /* [num_seqs, max_blocks] */
    int64_t max_blocks;
    const int64_t *lens; /* [num_seqs] */
    int64_t out_start, num_seqs, split;
} dgroup_t;

/* ---- the second half of a split attention, on the process's kernel worker (kernel_worker.h) ---- */

typedef struct {
    paged_fn fn;
    int path, kv16;
    const float *q;
    float *out;
    const void *k_cache, *v_cache;
    const int64_t *tables, *lens;
    int64_t max_blocks, H, KV, E, block_size;
    float scale;
    int64_t b_begin, b_end; /* sequences b_begin .. b_end-1 */
    int64_t kv_begin, kv_end; /* of their kv heads (and those heads' queries) */
    int64_t window;
} job_t;

static int run_job(const job_t *j);
#include "kernel_worker.h"

static int run_job(const job_t *j) {
    return j->fn(j->path, j->kv16, j->q, j->out, j->k_cache, j->v_cache, j->tables, j->max_blocks, j->lens, j->b_begin,
                 j->b_end, j->H, j->KV, j->E, j->block_size, j->scale, j->kv_begin, j->kv_end, j->window);
}

/* y [T, N] = x [T, K] @ w^T, as QuantRoute.product runs it (linear2 splits at N / 2 rounded down to 32 channels) */
static int product(const dkernels_t *k, const dweight_t *w, const float *x, int64_t T, float *y) {
    const int kind = (int)w->kind;
    if (k->split) return k->linear2[kind]((int)k->path[kind], x, T, w->K, w->q, w->s, w->G, y, w->N, 0,
                                          w->N / 2 / 32 * 32, w->N);
    return k->linear[kind]((int)k->path[kind], x, T, w->K, w->q, w->s, w->G, y, w->N, 0, w->N);
}

/* Errors: returns 0, else the failing call's code; where[0] = the layer, where[1] the stage (1 qkv, 2 rope,
 * 3 attention, 4 o, 5 gate_up, 6 down, 7 arguments).
 *   h        [T, D] the residual stream (the embeddings in, the last layer's output added out)
 *   scratch  T * (2D + Nqkv + 2HE + 3I + D) floats, reused by every layer (see kernels.DecodePlan) */
int decode_step_f32(const dmodel_t *m, const dkernels_t *k, float *h, int64_t T, const int64_t *positions,
                    const int64_t *slots, const dgroup_t *groups, int64_t num_groups, float *scratch,
                    int64_t *where) {
    const int64_t D = m->D, H = m->H, KV = m->KV, E = m->E, I = m->I, HE = H * E, NQKV = (H + 2 * KV) * E;
    where[0] = -1, where[1] = 7;
    if (T < 1 || m->num_layers < 1) return -1;
    float *x = scratch, *qkv = x + T * D, *q = qkv + T * NQKV, *attn = q + T * HE, *o = attn + T * HE;
    float *gate_up = o + T * D, *act = gate_up + T * 2 * I, *down = act + T * I;
    const float *delta = NULL;
    int rc = 0;
    for (int64_t layer = 0; layer < m->num_layers; layer++) {
        const dlayer_t *w = m->layers + layer;
        where[0] = layer;
        add_rms_norm_f32(h, delta, w->input_norm, m->eps, x, T, D);
        where[1] = 1;
        if ((rc = product(k, &w->qkv, x, T, qkv)) != 0) return rc;
        if (w->qkv_bias)
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < NQKV; i++) qkv[t * NQKV + i] += w->qkv_bias[i];
        if (w->q_norm) rms_norm_heads_f32(qkv, T, NQKV, H, KV, E, w->q_norm, w->k_norm, m->eps);
        where[1] = 2;
        if ((rc = rope_store_kv(qkv, T, NQKV, H, KV, E, w->cos, w->sin, positions, slots, w->k_cache, w->v_cache,
                                q, (int)m->kv16)) != 0)
            return rc;
        where[1] = 3;
        for (int64_t gi = 0; gi < num_groups; gi++) {
            const dgroup_t *g = groups + gi;
            const job_t mine = {k->paged, (int)k->paged_path, (int)m->kv16, q + g->out_start * HE, attn + g->out_start * HE,
                                w->k_cache, w->v_cache, g->tables, g->lens, g->max_blocks, H, KV, E, m->block_size,
                                m->scale, 0, g->num_seqs, 0, KV, w->window};
            if (k->split_attention && 0 < g->split && g->split < g->num_seqs) {
                job_t first = mine, second = mine;
                first.b_end = g->split, second.b_begin = g->split;
                rc = run_split(first, second);
            } else if (k->split_attention && g->num_seqs == 1 && KV > 1) { /* one sequence: split by kv heads */
                job_t first = mine, second = mine;
                first.kv_end = second.kv_begin = KV / 2;
                rc = run_split(first, second);
            } else {
                rc = run_job(&mine);
            }
            if (rc != 0) return rc;
        }
        where[1] = 4;
        if ((rc = product(k, &w->o, attn, T, o)) != 0) return rc;
        if (w->post_attn_norm) add_rms_norm_f32(o, NULL, w->post_attn_norm, m->eps, o, T, D); /* in place */
        add_rms_norm_f32(h, o, w->post_norm, m->eps, x, T, D);
        where[1] = 5;
        if ((rc = product(k, &w->gate_up, x, T, gate_up)) != 0) return rc;
        if (m->gelu)
            gelu_mul_f32(gate_up, act, T, I);
        else
            silu_mul_f32(gate_up, act, T, I);
        where[1] = 6;
        if ((rc = product(k, &w->down, act, T, down)) != 0) return rc;
        if (w->post_ff_norm) add_rms_norm_f32(down, NULL, w->post_ff_norm, m->eps, down, T, D);
        delta = down;
    }
    for (int64_t i = 0; i < T * D; i++) h[i] += delta[i];
    where[0] = -1, where[1] = 0;
    return 0;
}
