/*
 * clock.h -- the one monotonic clock of the library (k3_now in k3.h is its
 * public face), in nanoseconds for the code that counts in integers.
 */
#ifndef K3_COMMON_CLOCK_H
#define K3_COMMON_CLOCK_H

#include <stdint.h>

/* CLOCK_MONOTONIC in nanoseconds; k3_now() is the same clock in seconds. */
int64_t k3_now_ns(void);

#endif /* K3_COMMON_CLOCK_H */
