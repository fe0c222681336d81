/*
 * peak_isa.h -- private to src/kernels: the register loops of peak.c, one
 * per instruction, each iters rounds; they return the operations done.
 */
#ifndef K3_KERNELS_PEAK_ISA_H
#define K3_KERNELS_PEAK_ISA_H

#include <stdint.h>

/* The loops' 12 accumulators, a0..a11, as named variables (an array of
 * them went to the stack, and each round's products then waited on a store
 * and a load: half the units' rate): K3_PEAK_ACCS declares them of type T,
 * accumulator i starting at INIT(i); K3_PEAK_ROUND applies STEP to each and
 * then names all twelve to an empty asm with constraint C ("v" for zmm,
 * "x" for ymm), so none is folded or moved out of its register;
 * K3_PEAK_SUM(ADD) adds them up. */
#define K3_PEAK_ACCS(T, INIT) \
    T a0 = INIT(0), a1 = INIT(1), a2 = INIT(2), a3 = INIT(3), a4 = INIT(4), a5 = INIT(5), a6 = INIT(6), a7 = INIT(7), \
      a8 = INIT(8), a9 = INIT(9), a10 = INIT(10), a11 = INIT(11)
#define K3_PEAK_ROUND(STEP, C) \
    do { \
        a0 = STEP(a0), a1 = STEP(a1), a2 = STEP(a2), a3 = STEP(a3), a4 = STEP(a4), a5 = STEP(a5); \
        a6 = STEP(a6), a7 = STEP(a7), a8 = STEP(a8), a9 = STEP(a9), a10 = STEP(a10), a11 = STEP(a11); \
        __asm__("" \
                : "+" C(a0), "+" C(a1), "+" C(a2), "+" C(a3), "+" C(a4), "+" C(a5), "+" C(a6), "+" C(a7), "+" C(a8), \
                  "+" C(a9), "+" C(a10), "+" C(a11)); \
    } while (0)
#define K3_PEAK_SUM(ADD) \
    ADD(ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7))), ADD(ADD(a8, a9), ADD(a10, a11)))

double k3_peak_fma32_avx512(int64_t iters);
double k3_peak_int8_avx512(int64_t iters);
double k3_peak_bf16_avx512(int64_t iters);
double k3_peak_fma32_avx2(int64_t iters);
double k3_peak_int8_avxvnni(int64_t iters);

#endif /* K3_KERNELS_PEAK_ISA_H */
