/*
 * gemm_amx.c -- the AMX kernels (amx_kern.inc) on the tile unit. Compiled
 * with the AMX and AVX-512 flags; run only after k3_amx_init (amx.c).
 */
#define AMX_OPS k3_amx_ops_hw
#define AMX_NAME "amx"
#include "kernels/amx_tile.h"

/* the configuration and the loads as asm that says what they read (amx_tile.h) */
#define TCFG(c) AMX_HW_TCFG(c)
#define TRELEASE() _tile_release()
#define TZERO(t) _tile_zero(t)
#define TLOAD(t, p, s) AMX_HW_TLOAD(t, p, s)
#define TSTORE(t, p, s) _tile_stored(t, p, s)
#define TBF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define TSSD(c, a, b) _tile_dpbssd(c, a, b)
#include "amx_kern.inc"
