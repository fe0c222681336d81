/*
 * random.c -- the operating system's generator (random.h).
 */
#include "common/random.h"

#include <errno.h>
#include <string.h>
#include <sys/random.h>

#include "common/error.h"

k3_status k3_random_bytes(void *buf, size_t n, k3_error *err) {
    size_t got = 0;
    while (got < n) {
        const ssize_t r = getrandom((char *)buf + got, n - got, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return k3_err(err, K3_ERR_IO, "getrandom: %s", strerror(errno));
        }
        got += (size_t)r;
    }
    return K3_OK;
}

bool k3_random_id(char *out, size_t cap, const char *prefix, int n) {
    static const char abc[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    const size_t lp = strlen(prefix);
    if (n < 0) n = 0;
    if (n > 64) n = 64;
    if (cap == 0) return false;
    if (lp + (size_t)n + 1 > cap) n = cap > lp + 1 ? (int)(cap - lp - 1) : 0;
    memcpy(out, prefix, lp < cap ? lp : cap - 1);
    if (lp >= cap) {
        out[cap - 1] = 0;
        return false;
    }
    /* a byte under 248 (= 4 x 62) maps to a letter without bias; others are drawn again */
    uint8_t pool[128];
    size_t have = 0, at = 0;
    for (int i = 0; i < n;) {
        if (at == have) {
            if (k3_random_bytes(pool, sizeof pool, NULL)) {
                memset(out + lp + i, '0', (size_t)(n - i));
                out[lp + (size_t)n] = 0;
                return false;
            }
            have = sizeof pool;
            at = 0;
        }
        const uint8_t b = pool[at++];
        if (b < 248) out[lp + (size_t)i++] = abc[b % 62];
    }
    out[lp + (size_t)n] = 0;
    return true;
}
