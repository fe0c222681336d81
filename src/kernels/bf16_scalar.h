/*
 * bf16_scalar.h -- the BF16 vector kernels' arithmetic one value at a time,
 * for their scalar references (QSFA's in attn_ops.c, KDA's chunked form's in
 * kda.c): a BF16 value as the products read it, the rounding to BF16, the
 * flush of a sum below 2^-126, and k3_exp16 (vexp_avx512.h) operation for
 * operation. Plain C: any file may include it.
 */
#ifndef K3_KERNELS_BF16_SCALAR_H
#define K3_KERNELS_BF16_SCALAR_H

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "kernels/kernels.h"

/* a BF16 value as the products read it: below 2^-126 as 0 */
static inline float bf_in(uint16_t b) { return (b & 0x7f80) ? k3_bf16_to_f32(b) : 0.0f; }
static inline float bf_round(float x) { return bf_in(k3_f32_to_bf16(x)); }
static inline float ftz(float x) { return fabsf(x) < FLT_MIN ? 0.0f * x : x; }

/* k3_exp16 (vexp_avx512.h) on one value, operation for operation */
static inline float exp_poly(float x) {
    const float lo = -87.33654f, hi = 88.0f;
    const bool under = x < lo;
    x = lo > x ? lo : x;
    x = hi < x ? hi : x;
    const float fx = rintf(x * 1.44269504088896341f);
    float r = fmaf(-fx, 0.693359375f, x);
    r = fmaf(-fx, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r + 1.0f);
    union {
        uint32_t u;
        float f;
    } e = {.u = (uint32_t)((int32_t)fx + 127) << 23};
    return under ? 0.0f : p * e.f;
}

#endif
