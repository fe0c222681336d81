/*
 * gemm_amx.c -- the AMX kernels (amx_kern.inc) on the tile unit. Compiled
 * with the AMX and AVX-512 flags; run only after k3_amx_init (amx.c).
 */
#define AMX_OPS k3_amx_ops_hw
#define AMX_NAME "amx"
/* GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the
 * configuration and _tile_loadd that it reads no memory, so the stores that
 * fill a configuration, a decoded tile or the activation tiles could be
 * dropped or moved past them: these two say what they read. */
#define TCFG(c) __asm__ volatile("ldtilecfg %0" ::"m"(*(const amx_tcfg *)(c)))
#define TRELEASE() _tile_release()
#define TZERO(t) _tile_zero(t)
#define TLOAD(t, p, s) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(p)), "r"((long)(s)) : "memory")
#define TSTORE(t, p, s) _tile_stored(t, p, s)
#define TBF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define TSSD(c, a, b) _tile_dpbssd(c, a, b)
#include "amx_kern.inc"
