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
#include <stdlib.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

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

/* The BF16 dot products (kernels_isa.h) one product and one rounding at a
 * time, in their order: per 32-column block (zeros past cols) the even
 * columns' products added from +0 into e, the odd ones' into o, then
 * c += e + o; x rounded by k3_f32_to_bf16, the weights as their row
 * dequantizer gives them (exact BF16 values: the type's get_row), with
 * denormal inputs read as zero and denormal results flushed (MXCSR DAZ and
 * FTZ for the duration), as TDPBF16PS and vdpbf16ps do. x as it is (no
 * prep_x). */
void k3_bf16_rows_ref(const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const int64_t cols = w->cols, kp = (cols + 31) / 32 * 32;
    float *wr = calloc((size_t)(2 * kp), sizeof(float)), *xr = wr + kp;
    K3_ASSERT(wr);
#if defined(__x86_64__) || defined(__i386__)
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ | DAZ */
#endif
    for (int64_t r = r0; r < r1; r++) {
        k3_wtype_info(w->type)->get_row(w, r, 0, cols, wr);
        for (int64_t i = 0; i < n; i++) {
            for (int64_t c = 0; c < cols; c++) xr[c] = k3_bf16_to_f32(k3_f32_to_bf16(x[i * cols + c]));
            float acc = 0.0f;
            for (int64_t b = 0; b < kp; b += 32) {
                volatile float e = 0.0f, o = 0.0f; /* each add rounded to fp32 as it goes */
                for (int k = 0; k < 16; k++) {
                    e = e + wr[b + 2 * k] * xr[b + 2 * k];
                    o = o + wr[b + 2 * k + 1] * xr[b + 2 * k + 1];
                }
                acc = acc + (e + o);
            }
            y[i * ldy + r] = acc;
        }
    }
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(csr);
#endif
    free(wr);
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
