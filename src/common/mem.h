/*
 * mem.h -- allocation for large, streamed buffers (weights made at load, the
 * bandwidth probe's buffer).
 */
#ifndef K3_COMMON_MEM_H
#define K3_COMMON_MEM_H

#include <stddef.h>

/* n bytes, 64-byte aligned; from 2 MB up, 2 MB aligned with transparent huge
 * pages requested (madvise; a kernel without them just ignores it), so a
 * pass over gigabytes of weights does not also walk page tables. Release
 * with free(). NULL when out of memory. */
void *k3_alloc_big(size_t n);

#endif /* K3_COMMON_MEM_H */
