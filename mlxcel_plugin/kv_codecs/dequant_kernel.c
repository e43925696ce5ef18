/* Group-quantized K/V rows decoded in one pass: codes widened, scaled (and offset),
 * rotated back with the orthonormal Walsh-Hadamard transform, clipped and rounded into
 * the cache's own dtype, each row while it sits in L1.
 *
 * Why by hand: NumPy needs five passes over memory for this (widen, scale, a BLAS product
 * per rotation block, round, a strided copy into the cache): ~1.3 CPU-s per GiB of bf16
 * KV on one x86 core, most of an int8 receiver's CPU (issue 40). MLX's CPU ops took
 * 3.8 s/GiB for the same graph, and Numba did not vectorise the butterflies. This loop
 * runs at ~0.3-0.4 s/GiB here (setup.py builds it).
 *
 * The arithmetic is the NumPy decoder's (quant_decode.py) without fused multiply-adds
 * (built with -ffp-contract=off): unrotated rows decode to the same bits; rotated rows sum
 * in the butterflies' order instead of the BLAS product's (at most one unit in the last
 * place of the stored dtype apart). Loaded with ctypes (quant_kernel.py), which releases
 * the GIL for the call. The caller checks every index against its arrays first.
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 1024
#define INLINE static inline __attribute__((always_inline)) /* into each clone below */

/* x86-64 with GCC and glibc: an AVX2 build of the loop beside the baseline one, chosen
 * when the library loads (~20% less CPU measured); elsewhere the compiler's baseline. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define WIDEST_VECTORS __attribute__((target_clones("avx2", "default")))
#else
#define WIDEST_VECTORS
#endif

enum { OUT_FLOAT32 = 0, OUT_BFLOAT16 = 1, OUT_FLOAT16 = 2 };

#if defined(__GNUC__) && !defined(__clang__)
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* One stage of stride h within 8 lanes: lane i takes x[i] + x[i + h] where bit h of i is
 * clear, x[i - h] - x[i] where it is set. As a shuffle, a sign flip of the lanes whose bit
 * is set (an exact XOR) and one add: x[i] + x[i ^ h], or -x[i] + x[i ^ h], which IEEE
 * addition gives the same bits as the scalar loop's x[i - h] - x[i]. A blend and a
 * subtract fewer per stage than adding and subtracting both ways. */
#define STAGE(x, partner, flips) do { \
    f32x8 other_ = __builtin_shuffle((x), (i32x8)partner); \
    (x) = (f32x8)((i32x8)(x) ^ (i32x8)flips) + other_; \
} while (0)

#define SIGN ((int32_t)0x80000000)

INLINE void butterflies_of_8(float *x) {
    f32x8 v;
    memcpy(&v, x, sizeof v);
    STAGE(v, ((i32x8){1, 0, 3, 2, 5, 4, 7, 6}), ((i32x8){0, SIGN, 0, SIGN, 0, SIGN, 0, SIGN}));
    STAGE(v, ((i32x8){2, 3, 0, 1, 6, 7, 4, 5}), ((i32x8){0, 0, SIGN, SIGN, 0, 0, SIGN, SIGN}));
    STAGE(v, ((i32x8){4, 5, 6, 7, 0, 1, 2, 3}), ((i32x8){0, 0, 0, 0, SIGN, SIGN, SIGN, SIGN}));
    memcpy(x, &v, sizeof v);
}
#else
INLINE void butterflies_of_8(float *x) {
    for (int i = 0; i < 8; i += 2) { float a = x[i], b = x[i + 1]; x[i] = a + b; x[i + 1] = a - b; }
    for (int i = 0; i < 8; i += 4)
        for (int j = i; j < i + 2; j++) { float a = x[j], b = x[j + 2]; x[j] = a + b; x[j + 2] = a - b; }
    for (int j = 0; j < 4; j++) { float a = x[j], b = x[j + 4]; x[j] = a + b; x[j + 4] = a - b; }
}
#endif

/* Each run of `block` values of the row (unnormalised): the three smallest strides within
 * registers, the wider ones as contiguous half-runs the compiler vectorises. */
INLINE void hadamard_runs(float *restrict w, int width, int block) {
    int h = 1;
    if (block >= 8) {
        for (int i = 0; i < width; i += 8) butterflies_of_8(w + i);
        h = 8;
    }
    for (; h < block; h *= 2)
        for (int i = 0; i < width; i += 2 * h) {
            float *restrict a = w + i, *restrict b = w + i + h;
            for (int j = 0; j < h; j++) { float x = a[j], y = b[j]; a[j] = x + y; b[j] = x - y; }
        }
}

/* float32 bits -> float16 bits, nearest even (finite inputs; past the largest: inf). */
INLINE uint16_t float16_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t magnitude = bits & 0x7FFFFFFFu;
    if (magnitude >= 0x477FF000u) return sign | 0x7C00u; /* rounds past 65504 */
    if (magnitude < 0x38800000u) {                         /* float16 subnormal: k x 2**-24 */
        float scaled = (value < 0 ? -value : value) * 16777216.0f; /* exact */
        volatile float rounded = scaled + 8388608.0f;     /* nearest even, as the FPU rounds */
        return sign | (uint16_t)(rounded - 8388608.0f);
    }
    uint32_t rebased = magnitude - 0x38000000u; /* exponent bias 127 -> 15 */
    rebased += 0x0FFFu + ((rebased >> 13) & 1u);
    return sign | (uint16_t)(rebased >> 13);
}

/* The row's last steps on each value as it is stored, not as passes of their own over the
 * row: times the rotation's norm (where rotated), clipped to +-limit (where clipping). The
 * flags do not change within a row, so the compiler keeps one loop per case. */
INLINE float finished(float value, int rotated, float norm, int clip, float limit) {
    if (rotated) value *= norm;
    if (clip) value = value > limit ? limit : (value < -limit ? -limit : value);
    return value;
}

INLINE void store_row(const float *w, int width, void *out, int64_t row, int mode,
                      int rotated, float norm, int clip, float limit) {
    if (mode == OUT_FLOAT32) {
        float *o = (float *)out + row * width;
        for (int k = 0; k < width; k++) o[k] = finished(w[k], rotated, norm, clip, limit);
    } else if (mode == OUT_BFLOAT16) { /* nearest, ties away from zero: the NumPy decoder's */
        uint16_t *o = (uint16_t *)out + row * width;
        for (int k = 0; k < width; k++) {
            float value = finished(w[k], rotated, norm, clip, limit);
            uint32_t bits;
            memcpy(&bits, &value, 4);
            o[k] = (uint16_t)((bits + 0x8000u) >> 16);
        }
    } else {
        uint16_t *o = (uint16_t *)out + row * width;
        for (int k = 0; k < width; k++)
            o[k] = float16_bits(finished(w[k], rotated, norm, clip, limit));
    }
}

/* Rows r of `codes` ([rows, width] bytes; `flip` 128: signed codes, 0: unsigned) into rows
 * dest[r] (or r) of `out`. Row r's scales start at scales[first_group[r]]: one per `group`
 * values (group > 1), or one per value (group == 1: per-channel token groups); minimums
 * (or NULL) alike. `rotation`: the Hadamard block (0: none), `norm` its 1/sqrt(block);
 * values clip to +-limit (none when it is infinite). Returns 0, or -1 for a width it does
 * not take. */
WIDEST_VECTORS int decode_rows(const uint8_t *restrict codes, int64_t rows, int width, int flip,
                const float *restrict scales, const float *restrict minimums,
                const int64_t *restrict first_group, int group, int rotation, float norm,
                float limit, void *out, const int64_t *restrict dest, int mode) {
    if (width < 1 || width > MAX_HEAD_DIM || group < 1 || width % group) return -1;
    if (rotation && (rotation > width || width % rotation || rotation & (rotation - 1))) return -1;
    float w[MAX_HEAD_DIM];
    int clip = limit <= FLT_MAX; /* an infinite limit: nothing to clip */
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *c = codes + r * width;
        const float *s = scales + first_group[r];
        const float *m = minimums ? minimums + first_group[r] : 0;
        if (group == 1 && m) {
            for (int k = 0; k < width; k++) w[k] = (float)((c[k] ^ flip) - flip) * s[k] + m[k];
        } else if (group == 1) {
            for (int k = 0; k < width; k++) w[k] = (float)((c[k] ^ flip) - flip) * s[k];
        } else {
            for (int q = 0; q < width / group; q++) {
                float step = s[q];
                if (m) {
                    float low = m[q];
                    for (int k = q * group; k < (q + 1) * group; k++)
                        w[k] = (float)((c[k] ^ flip) - flip) * step + low;
                } else {
                    for (int k = q * group; k < (q + 1) * group; k++)
                        w[k] = (float)((c[k] ^ flip) - flip) * step;
                }
            }
        }
        if (rotation) hadamard_runs(w, width, rotation);
        store_row(w, width, out, dest ? dest[r] : r, mode, rotation != 0, norm, clip, limit);
    }
    return 0;
}
