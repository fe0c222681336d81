/* buf.c -- the growable byte buffer (buf.h). */
#include "common/buf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void k3_buf_add(k3_buf *b, const void *data, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *t = realloc(b->p, cap);
        if (!t) {
            b->oom = true;
            return;
        }
        b->p = t;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = 0;
}

void k3_buf_puts(k3_buf *b, const char *s) { k3_buf_add(b, s, strlen(s)); }

void k3_buf_addf(k3_buf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof tmp) {
        k3_buf_add(b, tmp, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->oom = true;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    k3_buf_add(b, big, (size_t)n);
    free(big);
}

const char *k3_buf_cstr(k3_buf *b) {
    k3_buf_add(b, "", 0);
    return b->oom ? NULL : b->p;
}

void k3_buf_free(k3_buf *b) {
    free(b->p);
    *b = (k3_buf){0};
}
