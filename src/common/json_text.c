/*
 * json_text.c -- JSON values as text (json_text.h): numbers recognized and
 * passed through, one value re-written the way Python's json.dumps writes
 * it, by a recursive-descent reader bounded in depth.
 */
#include "common/json_text.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

static size_t digits(const char *s, size_t n, size_t i) {
    size_t j = i;
    while (j < n && s[j] >= '0' && s[j] <= '9') j++;
    return j - i;
}

/* The parts of the number at s: integer digits, fraction digits (-1: no
 * fraction), exponent digits (-1: none); the length, 0 when none. */
static size_t number_parts(const char *s, size_t n, size_t *ni, long *nf, long *ne) {
    size_t i = 0;
    *nf = *ne = -1;
    if (i < n && s[i] == '-') i++;
    if (i >= n || s[i] < '0' || s[i] > '9') return 0;
    if (s[i] == '0') {
        *ni = 1;
        i++;
    } else {
        *ni = digits(s, n, i);
        i += *ni;
    }
    if (i + 1 < n && s[i] == '.' && s[i + 1] >= '0' && s[i + 1] <= '9') {
        const size_t f = digits(s, n, i + 1);
        *nf = (long)f;
        i += 1 + f;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        size_t j = i + 1;
        if (j < n && (s[j] == '+' || s[j] == '-')) j++;
        const size_t e = digits(s, n, j);
        if (e) {
            *ne = (long)e;
            i = j + e;
        }
    }
    return i;
}

size_t k3_json_number_len(const char *s, size_t n) {
    size_t ni;
    long nf, ne;
    return number_parts(s, n, &ni, &nf, &ne);
}

bool k3_json_number_bounded(const char *s, size_t n, int frac_digits) {
    size_t ni;
    long nf, ne;
    return n && number_parts(s, n, &ni, &nf, &ne) == n && ni <= K3_JSON_INT_DIGITS && nf <= frac_digits &&
        ne <= K3_JSON_INT_DIGITS;
}

/* The length of the valid UTF-8 sequence at p (at most n bytes), 0 if none. */
static size_t utf8_len(const unsigned char *p, size_t n) {
    const unsigned c = p[0];
    size_t l;
    uint32_t min, cp;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) l = 2, min = 0x80, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) l = 3, min = 0x800, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4) l = 4, min = 0x10000, cp = c & 0x07;
    else return 0;
    if (n < l) return 0;
    for (size_t i = 1; i < l; i++) {
        if ((p[i] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (p[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return l;
}

void k3_json_write_string(k3_buf *out, const char *s, size_t n) {
    k3_buf_add(out, "\"", 1);
    size_t run = 0; /* bytes copied verbatim since the last escape */
    for (size_t i = 0; i < n;) {
        const unsigned char c = (unsigned char)s[i];
        const char *rep = NULL;
        char u[8];
        size_t l = 1;
        switch (c) {
        case '"': rep = "\\\""; break;
        case '\\': rep = "\\\\"; break;
        case '\b': rep = "\\b"; break;
        case '\f': rep = "\\f"; break;
        case '\n': rep = "\\n"; break;
        case '\r': rep = "\\r"; break;
        case '\t': rep = "\\t"; break;
        default:
            if (c < 0x20) {
                snprintf(u, sizeof u, "\\u%04x", c);
                rep = u;
            } else if (c >= 0x80 && !(l = utf8_len((const unsigned char *)s + i, n - i))) {
                rep = "\xEF\xBF\xBD"; /* U+FFFD for a byte that is not UTF-8, as a decode with errors="replace" */
                l = 1;
            }
        }
        if (!rep) {
            run += l;
            i += l;
            continue;
        }
        k3_buf_add(out, s + i - run, run);
        run = 0;
        k3_buf_puts(out, rep);
        i += l;
    }
    k3_buf_add(out, s + n - run, run);
    k3_buf_add(out, "\"", 1);
}

/* ---- the reader ---------------------------------------------------------- */

typedef struct rd {
    const char *s;
    size_t n, at;
    int depth, max_depth;
    const char *why;
    k3_buf *out, str; /* str: a string's decoded bytes */
} rd;

static bool fail(rd *r, const char *why) {
    if (!r->why) r->why = why;
    return false;
}

static void ws(rd *r) {
    while (r->at < r->n && (r->s[r->at] == ' ' || r->s[r->at] == '\t' || r->s[r->at] == '\n' || r->s[r->at] == '\r'))
        r->at++;
}

static bool lit(rd *r, const char *w) {
    const size_t l = strlen(w);
    if (r->n - r->at < l || memcmp(r->s + r->at, w, l)) return fail(r, "not a JSON value");
    k3_buf_add(r->out, w, l);
    r->at += l;
    return true;
}

static int hex4(const char *p) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        const char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= c - '0';
        else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
        else return -1;
    }
    return v;
}

static void put_utf8(k3_buf *b, uint32_t cp) {
    char u[4];
    size_t l;
    if (cp < 0x80) u[0] = (char)cp, l = 1;
    else if (cp < 0x800) u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 0x3F)), l = 2;
    else if (cp < 0x10000)
        u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | ((cp >> 6) & 0x3F)), u[2] = (char)(0x80 | (cp & 0x3F)),
        l = 3;
    else
        u[0] = (char)(0xF0 | cp >> 18), u[1] = (char)(0x80 | ((cp >> 12) & 0x3F)),
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), u[3] = (char)(0x80 | (cp & 0x3F)), l = 4;
    k3_buf_add(b, u, l);
}

/* A string at r->at (its opening quote) decoded into r->str. */
static bool read_string(rd *r) {
    r->str.len = 0;
    if (r->at >= r->n || r->s[r->at] != '"') return fail(r, "expected a string");
    r->at++;
    for (;;) {
        if (r->at >= r->n) return fail(r, "a string does not end");
        const unsigned char c = (unsigned char)r->s[r->at];
        if (c == '"') {
            r->at++;
            return !r->str.oom || fail(r, "out of memory");
        }
        if (c < 0x20) return fail(r, "a control character in a string");
        if (c != '\\') {
            const size_t l = utf8_len((const unsigned char *)r->s + r->at, r->n - r->at);
            if (!l) return fail(r, "invalid UTF-8 in a string");
            k3_buf_add(&r->str, r->s + r->at, l);
            r->at += l;
            continue;
        }
        if (r->at + 1 >= r->n) return fail(r, "a string does not end");
        const char e = r->s[r->at + 1];
        r->at += 2;
        char one = 0;
        switch (e) {
        case '"': one = '"'; break;
        case '\\': one = '\\'; break;
        case '/': one = '/'; break;
        case 'b': one = '\b'; break;
        case 'f': one = '\f'; break;
        case 'n': one = '\n'; break;
        case 'r': one = '\r'; break;
        case 't': one = '\t'; break;
        case 'u': {
            int v = r->n - r->at >= 4 ? hex4(r->s + r->at) : -1;
            if (v < 0) return fail(r, "a bad \\u escape in a string");
            r->at += 4;
            uint32_t cp = (uint32_t)v;
            if (cp >= 0xDC00 && cp <= 0xDFFF) return fail(r, "a lone low surrogate in a string");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                int lo =
                    r->n - r->at >= 6 && r->s[r->at] == '\\' && r->s[r->at + 1] == 'u' ? hex4(r->s + r->at + 2) : -1;
                if (lo < 0xDC00 || lo > 0xDFFF) return fail(r, "a lone high surrogate in a string");
                r->at += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + ((uint32_t)lo - 0xDC00);
            }
            put_utf8(&r->str, cp);
            continue;
        }
        default: return fail(r, "a bad escape in a string");
        }
        k3_buf_add(&r->str, &one, 1);
    }
}

static bool value(rd *r, k3_json_type *type);

static bool container(rd *r, bool obj) {
    if (++r->depth > r->max_depth) return fail(r, "nested too deep");
    r->at++;
    k3_buf_add(r->out, obj ? "{" : "[", 1);
    ws(r);
    const char close = obj ? '}' : ']';
    if (r->at < r->n && r->s[r->at] == close) {
        r->at++;
    } else {
        for (bool first = true;; first = false) {
            if (!first) k3_buf_add(r->out, ", ", 2);
            if (obj) {
                if (!read_string(r)) return false;
                k3_json_write_string(r->out, r->str.p ? r->str.p : "", r->str.len);
                ws(r);
                if (r->at >= r->n || r->s[r->at] != ':') return fail(r, "expected ':' after a key");
                r->at++;
                k3_buf_add(r->out, ": ", 2);
                ws(r);
            }
            if (!value(r, NULL)) return false;
            ws(r);
            if (r->at < r->n && r->s[r->at] == ',') {
                r->at++;
                ws(r);
                continue;
            }
            if (r->at < r->n && r->s[r->at] == close) {
                r->at++;
                break;
            }
            return fail(r, obj ? "expected ',' or '}'" : "expected ',' or ']'");
        }
    }
    k3_buf_add(r->out, &close, 1);
    r->depth--;
    return true;
}

static bool value(rd *r, k3_json_type *type) {
    if (r->at >= r->n) return fail(r, "no JSON value");
    k3_json_type t;
    bool ok;
    switch (r->s[r->at]) {
    case '{': t = K3_JSON_T_OBJECT, ok = container(r, true); break;
    case '[': t = K3_JSON_T_ARRAY, ok = container(r, false); break;
    case '"':
        t = K3_JSON_T_STRING;
        ok = read_string(r);
        if (ok) k3_json_write_string(r->out, r->str.p ? r->str.p : "", r->str.len);
        break;
    case 't': t = K3_JSON_T_BOOL, ok = lit(r, "true"); break;
    case 'f': t = K3_JSON_T_BOOL, ok = lit(r, "false"); break;
    case 'n': t = K3_JSON_T_NULL, ok = lit(r, "null"); break;
    default: {
        t = K3_JSON_T_NUMBER;
        const size_t l = k3_json_number_len(r->s + r->at, r->n - r->at);
        ok = l > 0;
        if (ok) {
            k3_buf_add(r->out, r->s + r->at, l); /* as written */
            r->at += l;
        } else {
            fail(r, "not a JSON value");
        }
    }
    }
    if (type) *type = t;
    return ok;
}

bool k3_json_text_canon(k3_buf *out, const char *s, size_t n, int max_depth, k3_json_type *type, const char **why,
                        size_t *at) {
    rd r = {.s = s ? s : "", .n = s ? n : 0, .max_depth = max_depth, .out = out};
    k3_json_type t = K3_JSON_T_NULL;
    ws(&r);
    bool ok = value(&r, &t);
    if (ok) {
        ws(&r);
        if (r.at != r.n) ok = fail(&r, "more after the JSON value");
    }
    if (ok && out->oom) ok = fail(&r, "out of memory");
    k3_buf_free(&r.str);
    if (type) *type = t;
    if (why) *why = ok ? NULL : r.why;
    if (at) *at = r.at;
    return ok;
}
