/*
 * error.h -- status codes with context, and the small assertion macros.
 *
 * k3_err() records the first problem in a k3_error (which may be NULL) and
 * returns its status, so a failing call reads `return k3_err(err, K3_ERR_IO,
 * "cannot open %s: %s", path, strerror(errno));`. The first error wins: a later
 * k3_err on the same k3_error keeps the earlier message.
 */
#ifndef K3_COMMON_ERROR_H
#define K3_COMMON_ERROR_H

#include "k3.h"

#if defined(__GNUC__)
#define K3_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define K3_PRINTF(a, b)
#endif

k3_status k3_err(k3_error *err, k3_status status, const char *fmt, ...) K3_PRINTF(3, 4);
/* Clears err to K3_OK with an empty message. */
void k3_err_clear(k3_error *err);

/* Returns the status of x from the calling function unless it is K3_OK. */
#define K3_TRY(x) \
    do { \
        k3_status k3_try_ = (x); \
        if (k3_try_ != K3_OK) return k3_try_; \
    } while (0)

/* A bug, not bad input: aborts with file:line in every build. */
#define K3_ASSERT(x) ((x) ? (void)0 : k3_assert_fail(#x, __FILE__, __LINE__))
void k3_assert_fail(const char *expr, const char *file, int line);

#endif /* K3_COMMON_ERROR_H */
