/*
 * kernels_isa.h -- private to src/kernels: the per-ISA function table that
 * dispatch.c chooses from. Each ISA file (ref.c, matmul_avx2.c,
 * matmul_avx512.c) exports one table; dispatch.c owns the threading.
 */
#ifndef K3_KERNELS_KERNELS_ISA_H
#define K3_KERNELS_KERNELS_ISA_H

#include "kernels/kernels.h"

typedef struct k3_kernel_ops {
    k3_isa isa;
    /* Rows [r0, r1) of y = x Wᵀ: y[i*ldy + r] for i < n, r0 <= r < r1.
     * x: [n, w->cols] (row stride w->cols). One thread; the ISA picks its
     * own blocking (streaming for small n, tiled for large n), but each
     * y[i][r] must come out bit for bit the same whatever n, r0, r1 and the
     * position of row i (batch invariance: dispatch.c splits freely, and the
     * engine's batch == alone and causality tests compare with memcmp).
     * Stack: up to ~100 KB (the AVX-512 tiled path's weight block).
     * x is as prep_x left it where that returns > 0 for w. */
    void (*matmul)(const k3_mat *w, const float *x, int64_t n, float *y, int64_t ldy,
                   int64_t r0, int64_t r1);
    /* Optional (NULL: x is always taken as it is): x [n, w->cols] in the
     * order matmul wants for w, written to xp once per k3_matmul call rather
     * than by every row chunk. Returns the floats it writes (0: w takes x as
     * it is); with xp == NULL only returns that count. */
    int64_t (*prep_x)(const k3_mat *w, const float *x, int64_t n, float *xp);
    float (*dot)(const float *a, const float *b, int64_t n);
    void (*axpy)(float *y, float a, const float *x, int64_t n);
    void (*glu)(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2);
} k3_kernel_ops;

void k3_glu_avx2(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2);
void k3_glu_avx512(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2);

extern const k3_kernel_ops k3_ops_ref;
extern const k3_kernel_ops k3_ops_avx2;
extern const k3_kernel_ops k3_ops_avx512;

#endif /* K3_KERNELS_KERNELS_ISA_H */
