/*
 * buf.h -- the one growable byte buffer of the project: the server's
 * response bodies and SSE streams, the chat encoder's JSON, the CLI's HTTP
 * bodies. It stays NUL-terminated once anything was added, so p can be
 * read as a string; an allocation failure sets oom, after which appends
 * do nothing (the caller checks oom once, at the end).
 */
#ifndef K3_COMMON_BUF_H
#define K3_COMMON_BUF_H

#include <stdbool.h>
#include <stddef.h>

typedef struct k3_buf {
    char *p; /* owned; NULL until the first append */
    size_t len, cap;
    bool oom; /* an append failed: the contents are incomplete */
} k3_buf;

/* Appends data[0..n) (and keeps p NUL-terminated); on failure sets oom and drops data. */
void k3_buf_add(k3_buf *b, const void *data, size_t n);
void k3_buf_puts(k3_buf *b, const char *s);
void k3_buf_addf(k3_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The contents as a NUL-terminated string ("" when empty; NULL after an
 * allocation failure); the buffer keeps ownership. */
const char *k3_buf_cstr(k3_buf *b);
void k3_buf_free(k3_buf *b);

#endif /* K3_COMMON_BUF_H */
