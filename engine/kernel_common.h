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
 * Each x86 path is compiled with a target attribute, so the library is built for baseline x86-64 and runs a path
 * only where __builtin_cpu_supports says the CPU has it (a path it lacks returns -3).
 */
#ifndef TOKENLOOP_KERNEL_COMMON_H
#define TOKENLOOP_KERNEL_COMMON_H

#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#define PACK 32  /* output channels per packed block */
#define BLOCK 16 /* channels widened together for the AVX2 tiled path */
#define ROWS 6   /* rows of one register tile */

enum { PATH_PORTABLE = 1, PATH_AVX2 = 2, PATH_AVX512 = 3, PATH_VNNI = 4 };

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

/* 1 when this CPU (and this build) can run `path` */
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

/* x [M, K] -> int8 per row and group of G columns, symmetric: sx[m, g] = max |x| / 127, xq = round(x / sx); with
 * `bias` each value is stored + 128 as uint8 (the unsigned operand of vpdpbusd). One function for every row count,
 * so a row's quantized values do not depend on the batch. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t G, int bias, int8_t *xq, float *sx) {
    const int64_t NG = K / G;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < NG; g++) {
            const float *v = x + m * K + g * G;
            float amax = 0.0f;
            for (int64_t k = 0; k < G; k++) amax = fmaxf(amax, fabsf(v[k]));
            const float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            sx[m * NG + g] = s;
            int8_t *o = xq + m * K + g * G;
            for (int64_t k = 0; k < G; k++) {
                const int32_t q = (int32_t)lrintf(v[k] * inv);
                o[k] = (int8_t)(bias ? (uint8_t)(q + 128) : q);
            }
        }
}

#endif
