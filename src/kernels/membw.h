/*
 * membw.h -- a STREAM-like measure of the memory read bandwidth, the ceiling
 * a decode step (which streams every active weight once) is held against.
 */
#ifndef K3_KERNELS_MEMBW_H
#define K3_KERNELS_MEMBW_H

#include "k3.h"

/* Reads (sums) a buffer of `bytes` with every thread of pool, reps times,
 * and returns the median rate in GB/s (1e9 bytes/s). Use >= 1 GB so caches do
 * not count. Allocates and frees the buffer; returns 0 if it cannot. */
double k3_membw_read_gbps(k3_pool *pool, size_t bytes, int reps);

#endif /* K3_KERNELS_MEMBW_H */
