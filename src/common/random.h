/*
 * random.h -- bytes from the operating system's generator (getrandom(2)),
 * for every id and nonce that must tell nothing and repeat never: response,
 * item and tool-call ids, hold tokens, engine ids, handshake nonces. No
 * pointer, counter or clock goes into them.
 */
#ifndef K3_COMMON_RANDOM_H
#define K3_COMMON_RANDOM_H

#include <stddef.h>

#include "k3.h"

/* n random bytes into buf; K3_ERR_IO (naming the reason) only if the kernel
 * refuses, which on Linux since 3.17 it does not once booted. */
k3_status k3_random_bytes(void *buf, size_t n, k3_error *err);

/* prefix + n letters and digits ([0-9A-Za-z], each uniform: 5.95 bits),
 * NUL-terminated into out[cap]; n <= 64. False (out = prefix + "0"s) only
 * when k3_random_bytes fails. 24 letters carry 142 bits. */
bool k3_random_id(char *out, size_t cap, const char *prefix, int n);

#endif /* K3_COMMON_RANDOM_H */
