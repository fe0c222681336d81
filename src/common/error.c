/* error.c -- see error.h. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

const char *k3_status_str(k3_status s) {
    switch (s) {
    case K3_OK: return "ok";
    case K3_ERR_NOMEM: return "out of memory";
    case K3_ERR_IO: return "i/o error";
    case K3_ERR_FORMAT: return "format error";
    case K3_ERR_SHAPE: return "shape error";
    case K3_ERR_UNSUPPORTED: return "unsupported";
    case K3_ERR_ARG: return "bad argument";
    case K3_ERR_RANGE: return "out of range";
    case K3_ERR_BUSY: return "busy";
    case K3_ERR_PERM: return "refused";
    }
    return "unknown status";
}

k3_status k3_err(k3_error *err, k3_status status, const char *fmt, ...) {
    if (!err || err->status != K3_OK) return status;
    err->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return status;
}

void k3_err_clear(k3_error *err) {
    if (!err) return;
    err->status = K3_OK;
    err->msg[0] = 0;
}

void k3_assert_fail(const char *expr, const char *file, int line) {
    /* The one place the library writes to stderr: a broken invariant is a
     * bug in k3, and continuing would produce silently wrong output. */
    fprintf(stderr, "k3: assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}
