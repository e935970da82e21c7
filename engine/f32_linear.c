/* y = x @ w.T for float32 weights w [N, K] (rows contiguous, as the model holds them) and float32 x [M, K]: the
 * products of --weights fp32 steps of a batch of sequences (16 to a few hundred rows), where MKL and OpenBLAS reach
 * ~40 % of this CPU's FMA peak on the model's narrow shapes (K = 576 or 1536).
 *
 *   x   [M, K]   float32 activations (rows contiguous)
 *   w   [N, K]   float32 weights, read in place (no packed copy of any weight)
 *   y   [M, N]   float32; only the channels n_begin .. n_end-1 are written, so threads can split them
 *
 * The product is computed as y.T = w @ x.T: x is transposed once per call into xt [T, K, W] (T = ceil(M / W) tiles
 * of W rows, zero padded; 73 KB for 32 rows of 576 columns: it stays in L2), and a register tile of R channels by W
 * rows accumulates, for each column k in order, w[n, k] (broadcast) times xt[t, k, 0..W-1] (W / lanes vectors).
 * Each weight is thus read once from memory for the whole batch (up to W rows a tile; R channels' rows stay in L1/L2
 * while the tiles of more rows pass over them), and the weights need no packing.
 *
 * Code paths (kernel_common.h's numbers; f32_path_supported says which this CPU runs):
 *   1 portable  plain C;
 *   2 avx2      AVX2 + FMA: tiles of R = 6 channels by 16 rows (12 accumulators, two x vectors, one broadcast);
 *   3 avx512    AVX-512 F: tiles of R = 12 channels by 32 rows (24 accumulators, two x vectors, one broadcast).
 * Every output is one FMA chain over k = 0 .. K-1 in order, whatever the path's tile, the row count, the tile a row
 * falls in or the thread split: avx2 and avx512 give the same bits, and a row's result does not depend on its batch
 * (portable C may round differently where the compiler does not fuse or reorders).
 *
 * Two threads: f32_gemm_2t transposes x once, then runs channels [0, mid) here and [mid, N) on the process's kernel
 * worker thread (kernel_worker.c, shared by every kernel library).
 *
 * Built at run time by tokenloop/engine/kernels.py for baseline x86-64 (each path under its own target attribute,
 * -ffast-math at compile time only). Returns 0, or < 0: -1 bad arguments, -2 no memory, -3 a path this CPU lacks.
 */
#include "kernel_common.h"

#define W512 32 /* rows of an avx512 tile (two 16-lane vectors) */
#define W256 16 /* rows of an avx2 tile (two 8-lane vectors); the portable path uses this packing too */
#define R512 12 /* channels of an avx512 tile */
#define R256 6  /* channels of an avx2 tile */

static int tile_rows(int path) { return path == PATH_AVX512 ? W512 : W256; }

/* x [M, K] -> xt [T, K, Wd] zero padded (T = ceil(M / Wd)); NULL on no memory */
static float *transpose_x(const float *x, int64_t M, int64_t K, int Wd) {
    const int64_t T = (M + Wd - 1) / Wd;
    float *xt = aligned_alloc(64, (size_t)((T * K * Wd * sizeof(float) + 63) / 64 * 64));
    if (!xt) return NULL;
    for (int64_t t = 0; t < T; t++) {
        float *o = xt + t * K * Wd;
        const int64_t rows = M - t * Wd < Wd ? M - t * Wd : Wd;
        if (rows < Wd) memset(o, 0, sizeof(float) * (size_t)(K * Wd));
        for (int64_t r = 0; r < rows; r++) {
            const float *v = x + (t * Wd + r) * K;
            for (int64_t k = 0; k < K; k++) o[k * Wd + r] = v[k];
        }
    }
    return xt;
}

/* out [R, Wd] (channel r's values for the tile's rows) -> y[m0 + l, n + r] for the tile's `rows` valid rows */
static inline void store_tile(const float *out, int R, int Wd, int64_t rows, float *y, int64_t N, int64_t m0,
                              int64_t n) {
    for (int64_t l = 0; l < rows; l++) {
        float *dst = y + (m0 + l) * N + n;
        for (int r = 0; r < R; r++) dst[r] = out[r * Wd + l];
    }
}

/* ---- portable C: the same order per output (one chain over k) ---- */

static void gemm_portable(const float *xt, int64_t M, int64_t K, const float *w, float *y, int64_t N,
                          int64_t n_begin, int64_t n_end) {
    float out[W256];
    for (int64_t n = n_begin; n < n_end; n++)
        for (int64_t t = 0; t * W256 < M; t++) {
            const float *xk = xt + t * K * W256;
            for (int l = 0; l < W256; l++) out[l] = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                const float b = w[n * K + k];
                for (int l = 0; l < W256; l++) out[l] = fmaf(b, xk[k * W256 + l], out[l]);
            }
            const int64_t rows = M - t * W256 < W256 ? M - t * W256 : W256;
            store_tile(out, 1, W256, rows, y, N, t * W256, n);
        }
}

#if HAVE_X86

/* The loops of one SIMD path, from its vector type and intrinsics (FN: its target attribute; LANES floats a vector;
 * tiles of W = 2 * LANES rows and RMAX <= 12 channels):
 *   tile_ISA      R channels (R <= RMAX) by V vectors of rows (V = 1 or 2): for each column k in order, the R weights
 *                 w[n + r, k] broadcast, times xt's V vectors at k, into 2R accumulators; out [R, W]. Row r of w sits
 *                 at p[r / 3] + (r % 3) * K: four pointers and two strides address all twelve, so the loop needs no
 *                 more general registers than x86-64 has (with w + r * K the compiler spilled row offsets to the
 *                 stack: -15 %); every 16 columns (a cache line a row) the `ahead` rows after the tile's are
 *                 prefetched into L2, so the next tile's weights come from memory while this one multiplies (~10 %
 *                 at 32 rows, weights streaming from memory).
 *   channels_ISA  channels n .. n+R-1 against every tile of xt (the weights' R rows stay in L1/L2 meanwhile)
 *   gemm_ISA      channels n_begin .. n_end-1: RMAX at a time, then 6 (when RMAX > 6), then the last 1 to 5 */
#define DEFINE_GEMM(isa, FN, vec, LANES, RMAX, zero, load, set1, fma, store)                                        \
    FN INLINE void tile_##isa(const float *xt, const float *w, int64_t K, const int R, const int V, int ahead,      \
                              float *out) {                                                                         \
        enum { W = 2 * LANES };                                                                                     \
        vec a[2 * RMAX];                                                                                            \
        for (int i = 0; i < 2 * R; i++) a[i] = zero();                                                              \
        const float *p[4] = {w, w + (R > 3 ? 3 : 0) * K, w + (R > 6 ? 6 : 0) * K, w + (R > 9 ? 9 : 0) * K};         \
        const int64_t K2 = 2 * K;                                                                                   \
        for (int64_t k = 0; k < K; k++) {                                                                           \
            if ((k & 15) == 0)                                                                                      \
                for (int r = 0; r < ahead; r++) _mm_prefetch((const char *)(w + (R + r) * K + k), _MM_HINT_T1);     \
            const vec x0 = load(xt + k * W);                                                                        \
            const vec x1 = V == 2 ? load(xt + k * W + LANES) : x0;                                                  \
            for (int r = 0; r < R; r++) {                                                                           \
                const float *q = p[r / 3] + k;                                                                      \
                const vec b = set1(r % 3 == 0 ? q[0] : r % 3 == 1 ? q[K] : q[K2]);                                  \
                a[2 * r] = fma(b, x0, a[2 * r]);                                                                    \
                if (V == 2) a[2 * r + 1] = fma(b, x1, a[2 * r + 1]);                                                \
            }                                                                                                       \
        }                                                                                                           \
        for (int r = 0; r < R; r++) {                                                                               \
            store(out + r * W, a[2 * r]);                                                                           \
            if (V == 2) store(out + r * W + LANES, a[2 * r + 1]);                                                   \
        }                                                                                                           \
    }                                                                                                               \
    FN INLINE void channels_##isa(const float *xt, int64_t M, int64_t K, const float *w, float *y, int64_t N,      \
                                  int64_t n, int64_t n_end, const int R) {                                          \
        enum { W = 2 * LANES };                                                                                     \
        float out[RMAX * W];                                                                                        \
        const int ahead = n_end - n - R < R ? (int)(n_end - n - R) : R; /* the next tile's rows, to prefetch */     \
        for (int64_t t = 0; t * W < M; t++) {                                                                       \
            const int64_t rows = M - t * W < W ? M - t * W : W;                                                     \
            if (rows > LANES) /* two calls: V a constant in each, so each loop is specialised */                  \
                tile_##isa(xt + t * K * W, w + n * K, K, R, 2, ahead, out);                                         \
            else                                                                                                    \
                tile_##isa(xt + t * K * W, w + n * K, K, R, 1, ahead, out);                                         \
            store_tile(out, R, W, rows, y, N, t * W, n);                                                            \
        }                                                                                                           \
    }                                                                                                               \
    FN static void gemm_##isa(const float *xt, int64_t M, int64_t K, const float *w, float *y, int64_t N,          \
                              int64_t n_begin, int64_t n_end) {                                                     \
        int64_t n = n_begin;                                                                                        \
        for (; n + RMAX <= n_end; n += RMAX) channels_##isa(xt, M, K, w, y, N, n, n_end, RMAX);                    \
        if (RMAX > 6 && n_end - n >= 6) {                                                                           \
            channels_##isa(xt, M, K, w, y, N, n, n_end, 6);                                                         \
            n += 6;                                                                                                 \
        }                                                                                                           \
        switch (n_end - n) {                                                                                        \
        case 5: channels_##isa(xt, M, K, w, y, N, n, n_end, 5); break;                                              \
        case 4: channels_##isa(xt, M, K, w, y, N, n, n_end, 4); break;                                              \
        case 3: channels_##isa(xt, M, K, w, y, N, n, n_end, 3); break;                                              \
        case 2: channels_##isa(xt, M, K, w, y, N, n, n_end, 2); break;                                              \
        case 1: channels_##isa(xt, M, K, w, y, N, n, n_end, 1); break;                                              \
        default: break;                                                                                             \
        }                                                                                                           \
    }

/* AVX2 + FMA: 6 channels by 16 rows (12 accumulators, two x vectors, one broadcast: 15 of 16 registers) */
DEFINE_GEMM(avx2, AVX2_FN, __m256, 8, R256, _mm256_setzero_ps, _mm256_load_ps, _mm256_set1_ps, _mm256_fmadd_ps,
            _mm256_storeu_ps)

/* AVX-512 F: 12 channels by 32 rows (24 accumulators, two x vectors, one broadcast: 27 of 32 registers) */
DEFINE_GEMM(512, AVX512_FN, __m512, 16, R512, _mm512_setzero_ps, _mm512_load_ps, _mm512_set1_ps, _mm512_fmadd_ps,
            _mm512_storeu_ps)

#endif /* HAVE_X86 */

/* the product on x transposed already (xt as transpose_x made it for `path`) */
static int gemm_packed(int path, const float *xt, int64_t M, int64_t K, const float *w, float *y, int64_t N,
                       int64_t n_begin, int64_t n_end) {
    if (M == 0 || n_begin == n_end) return 0;
#if HAVE_X86
    if (path == PATH_AVX512) {
        gemm_512(xt, M, K, w, y, N, n_begin, n_end);
        return 0;
    }
    if (path == PATH_AVX2) {
        gemm_avx2(xt, M, K, w, y, N, n_begin, n_end);
        return 0;
    }
#endif
    gemm_portable(xt, M, K, w, y, N, n_begin, n_end);
    return 0;
}

static int check(int path, int64_t M, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
    if (M < 0 || K < 1 || N < 0 || n_begin < 0 || n_end > N || n_begin > n_end) return -1;
    if (path != PATH_PORTABLE && path != PATH_AVX2 && path != PATH_AVX512) return -1;
    return path_supported(path) ? 0 : -3;
}

/* ---- the exported products ---- */

int f32_path_supported(int path) { return path <= PATH_AVX512 && path_supported(path); }

/* y[:, n_begin:n_end] = x @ w.T[:, n_begin:n_end] on one thread */
int f32_gemm(int path, const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, int64_t n_begin,
             int64_t n_end) {
    const int bad = check(path, M, K, N, n_begin, n_end);
    if (bad) return bad;
    if (M == 0 || n_begin == n_end) return 0;
    float *xt = transpose_x(x, M, K, tile_rows(path));
    if (!xt) return -2;
    const int rc = gemm_packed(path, xt, M, K, w, y, N, n_begin, n_end);
    free(xt);
    return rc;
}

/* ---- the second half of f32_gemm_2t, on the process's kernel worker (kernel_worker.h) ---- */

typedef struct {
    int path;
    const float *xt;
    int64_t M, K;
    const float *w;
    float *y;
    int64_t N, n_begin, n_end;
} job_t;

static int run_job(const job_t *j) {
    return gemm_packed(j->path, j->xt, j->M, j->K, j->w, j->y, j->N, j->n_begin, j->n_end);
}

#include "kernel_worker.h"

/* y = x @ w.T over all N channels on two threads: x transposed once, here; channels [0, mid) here, [mid, N) on the
 * worker thread */
int f32_gemm_2t(int path, const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, int64_t mid) {
    const int bad = check(path, M, K, N, 0, N);
    if (bad || mid < 0 || mid > N) return bad ? bad : -1;
    if (M == 0 || N == 0) return 0;
    float *xt = transpose_x(x, M, K, tile_rows(path));
    if (!xt) return -2;
    const job_t mine = {path, xt, M, K, w, y, N, 0, mid};
    job_t theirs = mine;
    theirs.n_begin = mid, theirs.n_end = N;
    const int rc = run_split(mine, theirs);
    free(xt);
    return rc;
}
