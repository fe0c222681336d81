/*
 * mem.h -- allocation for large, streamed buffers (weights made at load, the
 * bandwidth probe's buffer) and the kernels' per-thread scratch.
 */
#ifndef K3_COMMON_MEM_H
#define K3_COMMON_MEM_H

#include <stddef.h>

/* n bytes, 64-byte aligned; from 2 MB up, 2 MB aligned with transparent huge
 * pages requested (madvise; a kernel without them just ignores it), so a
 * pass over gigabytes of weights does not also walk page tables. Release
 * with free(). NULL when out of memory. */
void *k3_alloc_big(size_t n);

/* The calling thread's scratch buffer number slot (< K3_SCRATCH_SLOTS), at
 * least need bytes, 64-byte aligned: grown on first use (no allocation in
 * steady state), its old contents not kept, freed when the thread exits.
 * Aborts (K3_ASSERT) when out of memory, like the kernels' stack buffers. */
enum {
    K3_SCRATCH_QUANT,
    K3_SCRATCH_MATMUL,
    K3_SCRATCH_AMX_X, /* the AMX kernels' activation tiles (calling thread) */
    K3_SCRATCH_AMX_H, /* their MoE hidden tiles (calling thread) */
    K3_SCRATCH_AMX_T, /* their per-thread accumulators */
    K3_SCRATCH_SLOTS
};
void *k3_scratch(int slot, size_t need);

#endif /* K3_COMMON_MEM_H */
