/*
 * amx_tile.h -- what every AMX kernel file shares (gemm_amx.c over
 * amx_kern.inc, qsfa_amx.c, kda_amx.c): the 64-byte tile configuration
 * ldtilecfg reads (palette 1), the usual one (C tiles 0-3 of 16 x 64 bytes,
 * A tiles 4-5 of 16 x a_colsb, B tiles 6-7 of b_rows x 64), and the tile
 * instructions as inline asm that says what memory each reads or writes:
 * GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the
 * configuration and _tile_loadd / _tile_stored that they touch no memory, so
 * the stores that fill a configuration or a tile's operands could be
 * dropped or moved past them. The asm needs the AMX flags; the struct and
 * its maker are plain C (the emulation uses them too).
 */
#ifndef K3_KERNELS_AMX_TILE_H
#define K3_KERNELS_AMX_TILE_H

#include <stdint.h>
#include <string.h>

typedef struct amx_tcfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tcfg;

/* C 16 x 64 bytes; A 16 x a_colsb; B b_rows x 64. */
static inline void amx_tcfg_make(amx_tcfg *c, int a_colsb, int b_rows) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int t = 0; t < 8; t++) {
        c->rows[t] = (uint8_t)(t >= 6 ? b_rows : 16);
        c->colsb[t] = (uint16_t)(t == 4 || t == 5 ? a_colsb : 64);
    }
}

#define AMX_HW_TCFG(c) __asm__ volatile("ldtilecfg %0" ::"m"(*(const amx_tcfg *)(c)))
#define AMX_HW_TLOAD(t, p, s) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(p)), "r"((long)(s)) : "memory")
#define AMX_HW_TSTORE(t, p, s) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void *)(p)), "r"((long)(s)) : "memory")

#endif
