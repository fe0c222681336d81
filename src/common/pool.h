/*
 * pool.h -- one persistent pool of worker threads (k3_pool in k3.h).
 *
 * k3_pool_for cuts [0, n) into one contiguous share per thread, the caller
 * among them; each thread works through its own share in adjacent chunks
 * (at least grain items, shrinking as the share runs out), then takes the
 * back half of the largest share left, until none is; fn may so be called
 * several times per thread, each time with that thread's index. A call made
 * from inside a worker (nesting) runs serially on that worker. With pool == NULL or
 * n <= grain everything runs inline. The pool does no allocation per call.
 */
#ifndef K3_COMMON_POOL_H
#define K3_COMMON_POOL_H

#include "k3.h"

/* fn(ctx, lo, hi, ith): process items [lo, hi) on thread ith (0..nth-1). */
typedef void (*k3_pool_fn)(void *ctx, int64_t lo, int64_t hi, int ith);

/* Runs fn over [0, n). grain: the smallest range worth a thread (>= 1). */
void k3_pool_for(k3_pool *pool, int64_t n, int64_t grain, k3_pool_fn fn, void *ctx);

#endif /* K3_COMMON_POOL_H */
