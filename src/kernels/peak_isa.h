/*
 * peak_isa.h -- private to src/kernels: the register loops of peak.c, one
 * per instruction, each iters rounds; they return the operations done.
 */
#ifndef K3_KERNELS_PEAK_ISA_H
#define K3_KERNELS_PEAK_ISA_H

#include <stdint.h>

double k3_peak_fma32_avx512(int64_t iters);
double k3_peak_int8_avx512(int64_t iters);
double k3_peak_bf16_avx512(int64_t iters);
double k3_peak_fma32_avx2(int64_t iters);
double k3_peak_int8_avxvnni(int64_t iters);

#endif /* K3_KERNELS_PEAK_ISA_H */
