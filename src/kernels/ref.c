/*
 * ref.c -- the scalar references of the fp32-activation kernels: matmul (any
 * weight type, through its row dequantizer, wtype.c), dot, axpy and the gated
 * activations, which the "ref" table runs and every fast path is tested
 * against.
 *
 * The references accumulate in double (each fp32 product is exact in double),
 * so they are closer to the exact result than any fp32 kernel; a fast path's
 * distance from them is its own rounding error.
 */
#include "kernels/kernels_isa.h"
#include "common/error.h"

#include <math.h>

/* ---- reference kernels ---------------------------------------------- */

enum { REF_CHUNK = 256 };

void k3_matmul_rows_ref(const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const int64_t cols = w->cols;
    const k3_wtype_traits *ti = k3_wtype_info(w->type);
    float wr[REF_CHUNK];
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t i = 0; i < n; i++) {
            const float *xi = x + i * cols;
            double s = 0;
            for (int64_t c0 = 0; c0 < cols; c0 += REF_CHUNK) {
                int64_t len = cols - c0 < REF_CHUNK ? cols - c0 : REF_CHUNK;
                ti->get_row(w, r, c0, len, wr);
                for (int64_t c = 0; c < len; c++) s += (double)xi[c0 + c] * wr[c];
            }
            y[i * ldy + r] = (float)s;
        }
    }
}

void k3_matmul_ref(const k3_mat *w, const float *x, int64_t n, float *y) {
    const int block = k3_wtype_info(w->type)->block;
    K3_ASSERT(!block || w->cols % block == 0);
    k3_matmul_rows_ref(w, x, n, y, w->rows, 0, w->rows);
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
        if (kind == K3_GLU_SILU) f1[i] = g / (1.0f + expf(-g));
        else if (kind == K3_GLU_SITU)
            f1[i] = b1 * tanhf(g / b1) / (1.0f + expf(-g)) * (b2 > 0.0f ? b2 * tanhf(u / b2) : u);
        else if (kind == K3_GLU_GATE) f1[i] = g / (1.0f + expf(-b1 * u));
        else f1[i] = g / (1.0f + expf(-g)) * u;
    }
}
