/*
 * mem.c -- see mem.h.
 */
#include "common/mem.h"
#include "common/error.h"

#include <pthread.h>
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

typedef struct {
    void *buf[K3_SCRATCH_SLOTS];
    size_t cap[K3_SCRATCH_SLOTS];
} scratch_set;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p) {
    scratch_set *s = p;
    for (int i = 0; i < K3_SCRATCH_SLOTS; i++) free(s->buf[i]);
    free(s);
}

static void scratch_init(void) { K3_ASSERT(pthread_key_create(&scratch_key, scratch_free) == 0); }

void *k3_scratch(int slot, size_t need) {
    K3_ASSERT(slot >= 0 && slot < K3_SCRATCH_SLOTS);
    pthread_once(&scratch_once, scratch_init);
    scratch_set *s = pthread_getspecific(scratch_key);
    if (!s) {
        s = calloc(1, sizeof *s);
        K3_ASSERT(s && pthread_setspecific(scratch_key, s) == 0);
    }
    if (need > s->cap[slot]) {
        free(s->buf[slot]);
        s->buf[slot] = aligned_alloc(64, (need + 63) / 64 * 64);
        K3_ASSERT(s->buf[slot]);
        s->cap[slot] = need;
    }
    return s->buf[slot];
}
