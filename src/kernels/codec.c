/*
 * codec.c -- the scalar number formats weights are stored in: BF16, F16,
 * E2M1 (MXFP4's elements), E8M0 (the MX block scales) and E4M3 (MXFP8's
 * elements), each way the code needs, and the MXFP8 block quantizer. Every
 * SIMD decode is held to these bit for bit; wtype.c's row dequantizers are
 * made of them.
 */
#include "kernels/kernels.h"

#include <math.h>
#include <string.h>

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* ---- BF16, F16 ------------------------------------------------------------ */

float k3_bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

uint16_t k3_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1);                                           /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

float k3_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13)); /* inf, NaN */
    if (exp == 0) {
        if (man == 0) return f32_from_bits(sign);
        /* subnormal: man * 2^-24, exact in fp32 */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

/* ---- MX: E2M1, E8M0 ----------------------------------------------------------- */

float k3_e2m1_to_f32(uint8_t code) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float v = mag[code & 7];
    return (code & 8) ? -v : v;
}

float k3_e8m0_to_f32(uint8_t e) { return k3_mx_scale(e); }

/* ---- FP8 E4M3 ------------------------------------------------------------------ */

float k3_e4m3_to_f32(uint8_t c) {
    const int e = (c >> 3) & 15, f = c & 7;
    if (e == 15 && f == 7) return NAN;
    const float v = e ? ldexpf((float)(8 + f), e - 10) : ldexpf((float)f, -9);
    return c & 0x80 ? -v : v;
}

uint8_t k3_f32_to_e4m3(float x) {
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    if (isnan(a)) return 0x7F;
    if (a >= 448.0f) return sign | 0x7E;
    if (a == 0.0f) return sign;
    int e2;
    frexpf(a, &e2);     /* a = m 2^e2, m in [0.5, 1) */
    int E = e2 - 1 + 7; /* biased exponent of a normal E4M3 */
    unsigned code;
    if (E < 1) {
        /* subnormal: units of 2^-9; 8 units roll over into E = 1, f = 0 */
        code = (unsigned)nearbyintf(a * 512.0f);
    } else {
        const float f = nearbyintf((ldexpf(a, 7 - E) - 1.0f) * 8.0f); /* 0..8 */
        code = ((unsigned)E << 3) + (unsigned)f;                      /* f = 8 carries into E */
    }
    if (code > 0x7E) code = 0x7E;
    return (uint8_t)(sign | code);
}

/* E8M0 exponent for a block with max |x| = amax: the OCP rule X =
 * 2^(floor(log2 amax) - emax_exp) (E4M3: emax_exp 8), raised by one when
 * amax / X would pass the largest element max_elem (E4M3: 448), since the
 * OCP rule clips blocks whose amax lies in [448, 512) x 2^k by up to 12%
 * (rounding the scale up, as the MXFP8 training recipes do). */
static uint8_t mx_scale_byte(float amax, int emax_exp, float max_elem) {
    if (!(amax > 0.0f)) return 127 - 20; /* all zero: any scale works */
    int e2;
    const float m = frexpf(amax, &e2); /* amax = m 2^e2, m in [0.5, 1) */
    int b = (e2 - 1) - emax_exp + 127;
    if (ldexpf(m, emax_exp + 1) > max_elem) b++;
    return (uint8_t)(b < 0 ? 0 : b > 254 ? 254 : b);
}

void k3_mxfp8_block(const float *x, uint8_t *q, uint8_t *e) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    *e = mx_scale_byte(amax, 8, 448.0f);
    const float inv = 1.0f / k3_e8m0_to_f32(*e);
    for (int i = 0; i < 32; i++) q[i] = k3_f32_to_e4m3(x[i] * inv);
}
