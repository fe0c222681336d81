/*
 * mem.c -- see mem.h.
 */
#include "common/mem.h"

#include <stdlib.h>
#include <sys/mman.h>

#define HUGE_PAGE ((size_t)2 << 20)

void *k3_alloc_big(size_t n) {
    if (n < HUGE_PAGE) return aligned_alloc(64, (n + 63) / 64 * 64);
    void *p = NULL;
    if (posix_memalign(&p, HUGE_PAGE, n)) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, n / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE); /* advice only */
#endif
    return p;
}
