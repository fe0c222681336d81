/* text.c -- UTF-8 helpers and the stop-string matcher (text.h). */
#include "server/text.h"

#include <stdlib.h>
#include <string.h>

/* Length of the valid sequence at s (n bytes left): 1-4, 0 if invalid, or
 * -1 if the bytes so far are a valid start that needs more bytes. */
static int seq_len(const unsigned char *s, size_t n) {
    const unsigned c = s[0];
    int need;
    unsigned min;
    if (c < 0x80) return c ? 1 : 0;
    if (c >= 0xC2 && c <= 0xDF) need = 2, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) need = 3, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) need = 4, min = 0x10000;
    else return 0;
    unsigned cp = c & (need == 2 ? 0x1F : need == 3 ? 0x0F : 0x07);
    for (int i = 1; i < need; i++) {
        if ((size_t)i >= n) return -1; /* the bytes so far are a valid start */
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
        if (i == 1) {
            /* second byte range checks for E0, ED, F0, F4 */
            if (c == 0xE0 && s[1] < 0xA0) return 0;
            if (c == 0xED && s[1] > 0x9F) return 0;
            if (c == 0xF0 && s[1] < 0x90) return 0;
            if (c == 0xF4 && s[1] > 0x8F) return 0;
        }
    }
    return cp >= min ? need : 0;
}

size_t k3_utf8_complete(const char *s, size_t n) {
    /* only the last 3 bytes can be an unfinished character */
    size_t start = n > 3 ? n - 3 : 0;
    for (size_t i = start; i < n; i++) {
        const unsigned char c = (unsigned char)s[i];
        if (c >= 0xC0) {
            const int l = seq_len((const unsigned char *)s + i, n - i);
            if (l < 0) return i;
        }
    }
    return n;
}

bool k3_utf8_valid(const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        const int l = seq_len((const unsigned char *)s + i, n - i);
        if (l <= 0) return false;
        i += (size_t)l;
    }
    return true;
}

char *k3_utf8_repair(const char *s, size_t n, size_t *out_len) {
    char *o = malloc(n * 3 + 1);
    if (!o) return NULL;
    size_t i = 0, k = 0;
    while (i < n) {
        const int l = seq_len((const unsigned char *)s + i, n - i);
        if (l > 0) {
            memcpy(o + k, s + i, (size_t)l);
            k += (size_t)l;
            i += (size_t)l;
        } else {
            /* U+FFFD for one bad byte (or a truncated tail, byte by byte) */
            memcpy(o + k, "\xEF\xBF\xBD", 3);
            k += 3;
            i++;
        }
    }
    o[k] = 0;
    if (out_len) *out_len = k;
    return o;
}

long k3_stops_find(const k3_stops *st, const char *text, size_t len, size_t from, size_t *stop_len) {
    long best = -1;
    for (int i = 0; st && i < st->n; i++) {
        if (st->len[i] == 0 || from >= len) continue;
        const char *p = memmem(text + from, len - from, st->s[i], st->len[i]);
        if (p && (best < 0 || p - text < best || (p - text == best && st->len[i] > *stop_len))) {
            best = p - text;
            *stop_len = st->len[i];
        }
    }
    return best;
}

size_t k3_stops_holdback(const k3_stops *st, const char *text, size_t len, size_t from) {
    size_t hold = 0;
    for (int i = 0; st && i < st->n; i++) {
        const size_t sl = st->len[i];
        for (size_t k = sl > 1 ? sl - 1 : 0; k > hold; k--) {
            if (k > len - from) continue;
            if (!memcmp(text + len - k, st->s[i], k)) {
                hold = k;
                break;
            }
        }
    }
    return hold;
}

void k3_stops_free(k3_stops *st) {
    if (!st) return;
    for (int i = 0; i < st->n; i++) free(st->s[i]);
    free(st->s);
    free(st->len);
    st->s = NULL;
    st->len = NULL;
    st->n = 0;
}
