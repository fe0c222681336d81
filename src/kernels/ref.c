/*
 * ref.c -- scalar references: number conversions, k3_mat helpers, and the
 * plain C matmul/dot/axpy every fast path is tested against.
 *
 * The references accumulate in double (each fp32 product is exact in double),
 * so they are closer to the exact result than any fp32 kernel; a fast path's
 * distance from them is its own rounding error.
 */
#include "kernels/kernels_isa.h"
#include "common/error.h"

#include <math.h>
#include <string.h>

/* ---- scalar conversions ---------------------------------------------- */

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

float k3_bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

uint16_t k3_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1); /* round to nearest, ties to even */
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

float k3_e2m1_to_f32(uint8_t code) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float v = mag[code & 7];
    return (code & 8) ? -v : v;
}

float k3_e8m0_to_f32(uint8_t e) { return k3_mx_scale(e); }

/* ---- k3_mat ----------------------------------------------------------- */

size_t k3_mat_row_bytes(const k3_mat *w) {
    size_t c = (size_t)w->cols;
    switch (w->type) {
    case K3_W_F32: return 4 * c;
    case K3_W_F16:
    case K3_W_BF16: return 2 * c;
    case K3_W_MXFP4:
    case K3_W_MXFP4_R4: return c / 2 + c / 32;
    case K3_W_Q8: return c + 4;
    case K3_W_MXFP8: return c + c / 32;
    default: break;
    }
    K3_ASSERT(!"bad k3_wtype");
    return 0;
}

k3_mat k3_mat_rows(const k3_mat *w, int64_t r0, int64_t n) {
    K3_ASSERT(r0 >= 0 && n >= 0 && r0 + n <= w->rows);
    k3_mat v = *w;
    v.rows = n;
    if (w->type == K3_W_MXFP4 || w->type == K3_W_MXFP4_R4) {
        /* whole tiles for R4: a tile's bytes and scales are its rows' */
        K3_ASSERT(w->type == K3_W_MXFP4 || (r0 % 4 == 0 && n % 4 == 0));
        v.data = (const uint8_t *)w->data + r0 * (w->cols / 2);
        v.scale = w->scale + r0 * (w->cols / 32);
    } else if (w->type == K3_W_Q8) {
        v.data = (const int8_t *)w->data + r0 * w->cols;
        v.row_scale = w->row_scale + r0;
        if (w->row_sum) v.row_sum = w->row_sum + r0;
    } else if (w->type == K3_W_MXFP8) {
        v.data = (const uint8_t *)w->data + r0 * w->cols;
        v.scale = w->scale + r0 * (w->cols / 32);
    } else {
        v.data = (const uint8_t *)w->data + (size_t)r0 * k3_mat_row_bytes(w);
    }
    return v;
}

/* Columns [c0, c0+len) of row r, dequantized. */
static void get_row_range(const k3_mat *w, int64_t r, int64_t c0, int64_t len, float *out) {
    const int64_t cols = w->cols;
    switch (w->type) {
    case K3_W_F32: {
        const float *p = (const float *)w->data + r * cols + c0;
        memcpy(out, p, (size_t)len * sizeof *out);
        break;
    }
    case K3_W_F16: {
        const uint16_t *p = (const uint16_t *)w->data + r * cols + c0;
        for (int64_t c = 0; c < len; c++) out[c] = k3_f16_to_f32(p[c]);
        break;
    }
    case K3_W_BF16: {
        const uint16_t *p = (const uint16_t *)w->data + r * cols + c0;
        for (int64_t c = 0; c < len; c++) out[c] = k3_bf16_to_f32(p[c]);
        break;
    }
    case K3_W_Q8: {
        const int8_t *p = (const int8_t *)w->data + r * cols + c0;
        for (int64_t c = 0; c < len; c++) out[c] = p[c] * w->row_scale[r];
        break;
    }
    case K3_W_MXFP8: {
        const uint8_t *p = (const uint8_t *)w->data + r * cols;
        const uint8_t *s = w->scale + r * (cols / 32);
        for (int64_t c = c0; c < c0 + len; c++) out[c - c0] = k3_e4m3_to_f32(p[c]) * k3_e8m0_to_f32(s[c / 32]);
        break;
    }
    case K3_W_MXFP4: {
        const uint8_t *p = (const uint8_t *)w->data + r * (cols / 2);
        const uint8_t *s = w->scale + r * (cols / 32);
        for (int64_t c = c0; c < c0 + len; c++) {
            uint8_t b = p[c / 2];
            uint8_t code = (c & 1) ? (uint8_t)(b >> 4) : (uint8_t)(b & 15);
            out[c - c0] = k3_e2m1_to_f32(code) * k3_e8m0_to_f32(s[c / 32]);
        }
        break;
    }
    case K3_W_MXFP4_R4: {
        const uint8_t *p = w->data;
        for (int64_t c = c0; c < c0 + len; c++) {
            uint8_t b = p[k3_r4_byte(cols, r, c & ~(int64_t)1)];
            uint8_t code = (c & 1) ? (uint8_t)(b >> 4) : (uint8_t)(b & 15);
            out[c - c0] = k3_e2m1_to_f32(code) * k3_e8m0_to_f32(w->scale[k3_r4_scale(cols, r, c)]);
        }
        break;
    }
    default: K3_ASSERT(!"bad k3_wtype");
    }
}

void k3_mat_get_row(const k3_mat *w, int64_t r, float *out) {
    K3_ASSERT(r >= 0 && r < w->rows);
    get_row_range(w, r, 0, w->cols, out);
}

/* ---- reference kernels ---------------------------------------------- */

enum { REF_CHUNK = 256 };

static void matmul_ref_rows(const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy,
                            int64_t r0, int64_t r1) {
    const int64_t cols = w->cols;
    float wr[REF_CHUNK];
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t i = 0; i < n; i++) {
            const float *xi = x + i * cols;
            double s = 0;
            for (int64_t c0 = 0; c0 < cols; c0 += REF_CHUNK) {
                int64_t len = cols - c0 < REF_CHUNK ? cols - c0 : REF_CHUNK;
                get_row_range(w, r, c0, len, wr);
                for (int64_t c = 0; c < len; c++) s += (double)xi[c0 + c] * wr[c];
            }
            y[i * ldy + r] = (float)s;
        }
    }
}

void k3_matmul_ref(const k3_mat *w, const float *x, int64_t n, float *y) {
    K3_ASSERT(w->type != K3_W_MXFP4 || w->cols % 32 == 0);
    matmul_ref_rows(w, x, n, y, w->rows, 0, w->rows);
}

float k3_dot_ref(const float *a, const float *b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return (float)s;
}

void k3_axpy_ref(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = (float)((double)y[i] + (double)a * x[i]);
}

void k3_glu_ref(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2) {
    for (int64_t i = 0; i < n; i++) {
        const float g = f1[i], u = kind == K3_GLU_SILU ? 1.0f : f2[i];
        if (kind == K3_GLU_SILU)
            f1[i] = g / (1.0f + expf(-g));
        else if (kind == K3_GLU_SITU)
            f1[i] = b1 * tanhf(g / b1) / (1.0f + expf(-g)) * (b2 > 0.0f ? b2 * tanhf(u / b2) : u);
        else if (kind == K3_GLU_GATE)
            f1[i] = g / (1.0f + expf(-b1 * u));
        else
            f1[i] = g / (1.0f + expf(-g)) * u;
    }
}

const k3_kernel_ops k3_ops_ref = {
    .isa = K3_ISA_REF,
    .matmul = matmul_ref_rows,
    .dot = k3_dot_ref,
    .axpy = k3_axpy_ref,
    .glu = k3_glu_ref,
};
