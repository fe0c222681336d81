/*
 * text.h -- the text side of streaming: UTF-8 completeness and repair, and
 * the stop-string matcher. Pure functions, tested in tests/test_server_text.c.
 */
#ifndef K3_SERVER_TEXT_H
#define K3_SERVER_TEXT_H

#include <stdbool.h>
#include <stddef.h>

/* Length of the longest prefix of s[0..n) that does not end inside a
 * multi-byte character that later bytes could still complete. */
size_t k3_utf8_complete(const char *s, size_t n);
/* s[0..n) with every invalid sequence replaced by U+FFFD; NUL-terminated,
 * caller frees; *out_len may be NULL. NULL when out of memory. */
char *k3_utf8_repair(const char *s, size_t n, size_t *out_len);
/* True when s[0..n) is valid UTF-8 without NUL bytes. */
bool k3_utf8_valid(const char *s, size_t n);

typedef struct k3_stops {
    char **s;
    size_t *len;
    int n;
} k3_stops;

/* Earliest occurrence of any stop string in text[from..len): its position,
 * or -1; *stop_len gets the matched length. */
long k3_stops_find(const k3_stops *st, const char *text, size_t len, size_t from, size_t *stop_len);
/* Bytes at the end of text[from..len) to hold back: the longest suffix that
 * is a proper prefix of some stop string (it may still become one). */
size_t k3_stops_holdback(const k3_stops *st, const char *text, size_t len, size_t from);
void k3_stops_free(k3_stops *st);

#endif /* K3_SERVER_TEXT_H */
