/*
 * regex.c -- regular expressions (the ECMA-262 subset JSON Schema's
 * "pattern" uses, which is also what guided_regex clients send) into
 * grammar expressions over raw UTF-8 text.
 *
 * Supported: literals (UTF-8), '.', classes [...] and [^...] with ranges
 * and the escapes \d \D \w \W \s \S inside and outside, the escapes \t \n
 * \r \f \v \0 \xHH \uHHHH \u{H...} \cX and escaped punctuation, groups
 * ( ) (?: ) (?<name> ), alternation, the quantifiers * + ? {m} {m,} {m,n}
 * (lazy forms too: laziness changes which match is found, not whether one
 * is), and the anchors ^ and $ at the ends of the pattern or of its
 * top-level alternatives. Refused with an error naming them: lookaround,
 * backreferences, word boundaries \b \B, Unicode property escapes \p{..},
 * and anchors anywhere else.
 *
 * Search (JSON Schema) semantics: a pattern matches a string containing a
 * match, so an end without its anchor gets any text there. Full-match
 * semantics (k3_grammar REGEX, guided_regex): the text is the match.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "grammar/regex.h"

#define ANCHOR_START INT32_MIN
#define ANCHOR_END (INT32_MIN + 1)

typedef struct rx {
    k3g_builder *b;
    const uint8_t *s;
    size_t n, at;
    const char *where;
    int depth;
} rx;

typedef struct cpr {
    uint32_t *r; /* lo, hi pairs */
    int32_t n, cap;
} cpr;

static k3_status bad(rx *p, const char *what) {
    return k3_err(p->b->err, K3_ERR_ARG, "%s: %s at offset %zu of the regular expression", p->where, what, p->at);
}

static k3_status unsup(rx *p, const char *what) {
    return k3_err(p->b->err, K3_ERR_UNSUPPORTED, "%s: %s (offset %zu of the regular expression) is not supported",
                  p->where, what, p->at);
}

static k3_status nomem(rx *p) {
    return k3_err(p->b->err, K3_ERR_NOMEM, "out of memory compiling a regular expression");
}

static bool cpr_add(cpr *c, uint32_t lo, uint32_t hi) {
    if (c->n == c->cap) {
        int32_t cap = c->cap ? c->cap * 2 : 8;
        uint32_t *r = realloc(c->r, (size_t)cap * 2 * sizeof *r);
        if (!r) return false;
        c->r = r;
        c->cap = cap;
    }
    c->r[2 * c->n] = lo;
    c->r[2 * c->n + 1] = hi;
    c->n++;
    return true;
}

static int pair_cmp(const void *a, const void *b) {
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* Sorts and merges the ranges. */
static void cpr_norm(cpr *c) {
    if (c->n < 2) return;
    qsort(c->r, (size_t)c->n, 2 * sizeof *c->r, pair_cmp);
    int32_t k = 0;
    for (int32_t i = 1; i < c->n; i++) {
        if (c->r[2 * i] <= c->r[2 * k + 1] + 1) {
            if (c->r[2 * i + 1] > c->r[2 * k + 1]) c->r[2 * k + 1] = c->r[2 * i + 1];
        } else {
            k++;
            c->r[2 * k] = c->r[2 * i];
            c->r[2 * k + 1] = c->r[2 * i + 1];
        }
    }
    c->n = k + 1;
}

/* The complement within 0..10FFFF. */
static bool cpr_negate(cpr *c) {
    cpr_norm(c);
    cpr o = {0};
    uint32_t next = 0;
    bool ok = true;
    for (int32_t i = 0; i < c->n && ok; i++) {
        if (c->r[2 * i] > next) ok = cpr_add(&o, next, c->r[2 * i] - 1);
        next = c->r[2 * i + 1] + 1;
    }
    if (ok && next <= 0x10FFFF) ok = cpr_add(&o, next, 0x10FFFF);
    free(c->r);
    *c = o;
    return ok;
}

/* ECMA-262 \s: WhiteSpace and LineTerminator. */
static bool add_space(cpr *c) {
    static const uint32_t r[] = {0x09,   0x0D,   0x20,   0x20,   0xA0,   0xA0,   0x1680, 0x1680, 0x2000, 0x200A,
                                 0x2028, 0x2029, 0x202F, 0x202F, 0x205F, 0x205F, 0x3000, 0x3000, 0xFEFF, 0xFEFF};
    for (size_t i = 0; i < sizeof r / sizeof r[0]; i += 2)
        if (!cpr_add(c, r[i], r[i + 1])) return false;
    return true;
}

static bool add_word(cpr *c) {
    return cpr_add(c, '0', '9') && cpr_add(c, 'A', 'Z') && cpr_add(c, '_', '_') && cpr_add(c, 'a', 'z');
}

/* Adds the class escape \d \D \w \W \s \S (letter), negated ones through a
 * temporary. */
static bool add_class_escape(cpr *c, uint8_t letter) {
    cpr t = {0};
    bool ok;
    switch (letter | 0x20) {
    case 'd': ok = cpr_add(&t, '0', '9'); break;
    case 'w': ok = add_word(&t); break;
    default: ok = add_space(&t); break;
    }
    if (ok && letter >= 'A' && letter <= 'Z') ok = cpr_negate(&t);
    for (int32_t i = 0; ok && i < t.n; i++) ok = cpr_add(c, t.r[2 * i], t.r[2 * i + 1]);
    free(t.r);
    return ok;
}

/* One UTF-8 code point at p->at; -1 on invalid UTF-8. */
static int64_t utf8_next(rx *p) {
    const uint8_t *s = p->s + p->at;
    size_t rest = p->n - p->at;
    uint32_t c = s[0];
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!len || (size_t)len > rest) return -1;
    if (len == 1) {
        p->at++;
        return c;
    }
    c &= 0x3F >> (len - 1);
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return -1;
        c = c << 6 | (s[i] & 0x3F);
    }
    static const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (c < min[len] || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return -1;
    p->at += (size_t)len;
    return c;
}

static int hexval(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int64_t hexn(rx *p, int n) {
    if (p->n - p->at < (size_t)n) return -1;
    int64_t v = 0;
    for (int i = 0; i < n; i++) {
        int h = hexval(p->s[p->at + (size_t)i]);
        if (h < 0) return -1;
        v = v * 16 + h;
    }
    p->at += (size_t)n;
    return v;
}

/* A character escape after '\' (p->at on the letter): its code point, or
 * -1 (with the error set), or -2 for a class escape (*cls set). in_class:
 * \b is a backspace there. */
static int64_t escape(rx *p, bool in_class, uint8_t *cls, k3_status *st) {
    *st = K3_OK;
    if (p->at >= p->n) {
        *st = bad(p, "a trailing backslash");
        return -1;
    }
    uint8_t c = p->s[p->at];
    switch (c) {
    case 'd':
    case 'D':
    case 'w':
    case 'W':
    case 's':
    case 'S':
        p->at++;
        *cls = c;
        return -2;
    case 't': p->at++; return '\t';
    case 'n': p->at++; return '\n';
    case 'r': p->at++; return '\r';
    case 'f': p->at++; return '\f';
    case 'v': p->at++; return '\v';
    case 'b':
        if (in_class) {
            p->at++;
            return '\b';
        }
        *st = unsup(p, "the word boundary \\b");
        return -1;
    case 'B': *st = unsup(p, "the word boundary \\B"); return -1;
    case '0':
        if (p->at + 1 < p->n && p->s[p->at + 1] >= '0' && p->s[p->at + 1] <= '9') {
            *st = unsup(p, "an octal escape");
            return -1;
        }
        p->at++;
        return 0;
    case 'x': {
        p->at++;
        int64_t v = hexn(p, 2);
        if (v < 0) *st = bad(p, "\\x needs two hex digits");
        return v;
    }
    case 'u': {
        p->at++;
        if (p->at < p->n && p->s[p->at] == '{') {
            p->at++;
            int64_t v = 0;
            int nd = 0;
            while (p->at < p->n && hexval(p->s[p->at]) >= 0 && nd < 7) v = v * 16 + hexval(p->s[p->at++]), nd++;
            if (!nd || p->at >= p->n || p->s[p->at] != '}' || v > 0x10FFFF) {
                *st = bad(p, "a malformed \\u{...} escape");
                return -1;
            }
            p->at++;
            return v;
        }
        int64_t v = hexn(p, 4);
        if (v < 0) {
            *st = bad(p, "\\u needs four hex digits");
            return -1;
        }
        if (v >= 0xD800 && v <= 0xDBFF && p->n - p->at >= 6 && p->s[p->at] == '\\' && p->s[p->at + 1] == 'u') {
            size_t save = p->at;
            p->at += 2;
            int64_t lo = hexn(p, 4);
            if (lo >= 0xDC00 && lo <= 0xDFFF) return 0x10000 + ((v - 0xD800) << 10) + (lo - 0xDC00);
            p->at = save;
        }
        if (v >= 0xD800 && v <= 0xDFFF) {
            *st = unsup(p, "a lone surrogate escape");
            return -1;
        }
        return v;
    }
    case 'c': {
        if (p->at + 1 < p->n && ((p->s[p->at + 1] | 0x20) >= 'a' && (p->s[p->at + 1] | 0x20) <= 'z')) {
            int64_t v = p->s[p->at + 1] % 32;
            p->at += 2;
            return v;
        }
        *st = bad(p, "\\c needs a letter");
        return -1;
    }
    case 'p':
    case 'P': *st = unsup(p, "the Unicode property escape \\p{...}"); return -1;
    case 'k': *st = unsup(p, "the named backreference \\k<...>"); return -1;
    default:
        if (c >= '1' && c <= '9') {
            *st = unsup(p, "a backreference");
            return -1;
        }
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
            *st = bad(p, "an unknown escape");
            return -1;
        }
        {
            int64_t v = utf8_next(p);
            if (v < 0) *st = bad(p, "invalid UTF-8");
            return v;
        }
    }
}

static k3g_ast *set_ast(rx *p, cpr *c) {
    cpr_norm(c);
    return k3g_cpset(p->b, c->r, c->n);
}

static k3_status parse_class(rx *p, k3g_ast **out) {
    p->at++; /* [ */
    bool neg = p->at < p->n && p->s[p->at] == '^';
    if (neg) p->at++;
    cpr c = {0};
    k3_status st = K3_OK;
    for (;;) {
        if (p->at >= p->n) {
            st = bad(p, "an unclosed [");
            break;
        }
        if (p->s[p->at] == ']') {
            p->at++;
            break;
        }
        int64_t lo;
        uint8_t cls = 0;
        if (p->s[p->at] == '\\') {
            p->at++;
            lo = escape(p, true, &cls, &st);
            if (st != K3_OK) break;
        } else {
            lo = utf8_next(p);
            if (lo < 0) {
                st = bad(p, "invalid UTF-8");
                break;
            }
        }
        if (lo == -2) {
            if (!add_class_escape(&c, cls)) {
                st = nomem(p);
                break;
            }
            continue;
        }
        int64_t hi = lo;
        if (p->at + 1 < p->n && p->s[p->at] == '-' && p->s[p->at + 1] != ']') {
            p->at++;
            if (p->s[p->at] == '\\') {
                p->at++;
                hi = escape(p, true, &cls, &st);
                if (st != K3_OK) break;
                if (hi == -2) {
                    st = bad(p, "a class escape as the end of a range");
                    break;
                }
            } else {
                hi = utf8_next(p);
                if (hi < 0) {
                    st = bad(p, "invalid UTF-8");
                    break;
                }
            }
            if (hi < lo) {
                st = bad(p, "a character range out of order");
                break;
            }
        }
        if (!cpr_add(&c, (uint32_t)lo, (uint32_t)hi)) {
            st = nomem(p);
            break;
        }
    }
    if (st == K3_OK && neg && !cpr_negate(&c)) st = nomem(p);
    if (st == K3_OK && !(*out = set_ast(p, &c))) st = nomem(p);
    free(c.r);
    return st;
}

static k3_status parse_alt(rx *p, k3g_ast **out);

/* A quantifier {m}, {m,}, {m,n} at p->at ('{'); false (p->at unchanged)
 * when the brace does not start one, which ECMA reads as a literal. */
static bool braces(rx *p, int64_t *min, int64_t *max) {
    size_t at = p->at + 1;
    int64_t a = 0, b;
    int nd = 0;
    while (at < p->n && p->s[at] >= '0' && p->s[at] <= '9' && a < 100000000) a = a * 10 + (p->s[at++] - '0'), nd++;
    if (!nd) return false;
    b = a;
    if (at < p->n && p->s[at] == ',') {
        at++;
        nd = 0;
        b = 0;
        while (at < p->n && p->s[at] >= '0' && p->s[at] <= '9' && b < 100000000) b = b * 10 + (p->s[at++] - '0'), nd++;
        if (!nd) b = -1;
    }
    if (at >= p->n || p->s[at] != '}') return false;
    p->at = at + 1;
    *min = a;
    *max = b;
    return true;
}

static k3_status parse_atom(rx *p, k3g_ast **out) {
    uint8_t c = p->s[p->at];
    k3_status st = K3_OK;
    switch (c) {
    case '(': {
        p->at++;
        if (p->at < p->n && p->s[p->at] == '?') {
            if (p->at + 1 < p->n && p->s[p->at + 1] == ':') {
                p->at += 2;
            } else if (p->at + 1 < p->n && (p->s[p->at + 1] == '=' || p->s[p->at + 1] == '!')) {
                return unsup(p, "lookahead (?= / (?!");
            } else if (p->at + 2 < p->n && p->s[p->at + 1] == '<' &&
                       (p->s[p->at + 2] == '=' || p->s[p->at + 2] == '!')) {
                return unsup(p, "lookbehind (?<= / (?<!");
            } else if (p->at + 1 < p->n && (p->s[p->at + 1] == '<' || p->s[p->at + 1] == 'P')) {
                /* a named group: skip the name */
                size_t at = p->at + 1 + (p->s[p->at + 1] == 'P');
                if (at >= p->n || p->s[at] != '<') return bad(p, "a malformed group");
                while (at < p->n && p->s[at] != '>') at++;
                if (at >= p->n) return bad(p, "a malformed group name");
                p->at = at + 1;
            } else {
                return unsup(p, "the group modifier (?...");
            }
        }
        if (++p->depth > 200) return unsup(p, "nesting deeper than 200 groups");
        k3g_ast *a;
        K3_TRY(parse_alt(p, &a));
        p->depth--;
        if (p->at >= p->n || p->s[p->at] != ')') return bad(p, "an unclosed (");
        p->at++;
        *out = a;
        return K3_OK;
    }
    case '[': return parse_class(p, out);
    case '.': {
        p->at++;
        cpr r = {0};
        bool ok = cpr_add(&r, '\n', '\n') && cpr_add(&r, '\r', '\r') && cpr_add(&r, 0x2028, 0x2029) && cpr_negate(&r);
        if (ok) ok = (*out = set_ast(p, &r)) != NULL;
        free(r.r);
        return ok ? K3_OK : nomem(p);
    }
    case '^':
    case '$': {
        p->at++;
        k3g_ast *a = k3g_empty(p->b);
        if (!a) return nomem(p);
        a->kind = K3G_A_SYM;
        a->sym = c == '^' ? ANCHOR_START : ANCHOR_END;
        *out = a;
        return K3_OK;
    }
    case '\\': {
        p->at++;
        uint8_t cls = 0;
        int64_t v = escape(p, false, &cls, &st);
        if (st != K3_OK) return st;
        cpr r = {0};
        bool ok = v == -2 ? add_class_escape(&r, cls) : cpr_add(&r, (uint32_t)v, (uint32_t)v);
        if (ok) ok = (*out = set_ast(p, &r)) != NULL;
        free(r.r);
        return ok ? K3_OK : nomem(p);
    }
    case '*':
    case '+':
    case '?': return bad(p, "a quantifier with nothing to repeat");
    case ')': return bad(p, "an unmatched )");
    default: {
        int64_t v = utf8_next(p);
        if (v < 0) return bad(p, "invalid UTF-8");
        uint32_t r[2] = {(uint32_t)v, (uint32_t)v};
        *out = k3g_cpset(p->b, r, 1);
        return *out ? K3_OK : nomem(p);
    }
    }
}

static bool is_anchor(const k3g_ast *a) {
    return a->kind == K3G_A_SYM && (a->sym == ANCHOR_START || a->sym == ANCHOR_END);
}

static k3_status parse_seq(rx *p, k3g_ast **out) {
    k3g_ast **kids = NULL;
    size_t n = 0, cap = 0;
    k3_status st = K3_OK;
    while (p->at < p->n && p->s[p->at] != '|' && p->s[p->at] != ')') {
        k3g_ast *a = NULL;
        if (p->s[p->at] == '{') {
            int64_t mn, mx;
            size_t save = p->at;
            if (braces(p, &mn, &mx)) {
                p->at = save;
                st = bad(p, "a quantifier with nothing to repeat");
                break;
            }
            p->at++;
            uint32_t r[2] = {'{', '{'};
            a = k3g_cpset(p->b, r, 1);
        } else {
            st = parse_atom(p, &a);
            if (st != K3_OK) break;
        }
        /* quantifiers */
        while (p->at < p->n && a) {
            int64_t mn, mx;
            uint8_t q = p->s[p->at];
            if (q == '*') mn = 0, mx = -1, p->at++;
            else if (q == '+') mn = 1, mx = -1, p->at++;
            else if (q == '?') mn = 0, mx = 1, p->at++;
            else if (q == '{' && braces(p, &mn, &mx)) {
                if (mx >= 0 && mx < mn) {
                    st = bad(p, "a {m,n} quantifier with n < m");
                    break;
                }
                if (mn > K3G_MAX_REPEAT || mx > K3G_MAX_REPEAT) {
                    st = k3_err(p->b->err, K3_ERR_UNSUPPORTED,
                                "%s: the repetition count %lld is beyond the "
                                "supported %d",
                                p->where, (long long)(mx > mn ? mx : mn), K3G_MAX_REPEAT);
                    break;
                }
            } else break;
            if (is_anchor(a)) {
                st = bad(p, "a quantifier on an anchor");
                break;
            }
            if (p->at < p->n && p->s[p->at] == '?') p->at++; /* lazy */
            a = k3g_rep(p->b, a, (int32_t)mn, (int32_t)mx);
            if (p->at < p->n &&
                (p->s[p->at] == '*' || p->s[p->at] == '+' || p->s[p->at] == '?' || p->s[p->at] == '{')) {
                int64_t a2, b2;
                size_t save = p->at;
                if (p->s[p->at] != '{' || braces(p, &a2, &b2)) {
                    p->at = save;
                    st = bad(p, "a quantifier after a quantifier");
                    break;
                }
                p->at = save;
            }
        }
        if (st != K3_OK) break;
        if (!a || !k3g_grow(&kids, &cap, n + 1, sizeof *kids)) {
            st = nomem(p);
            break;
        }
        kids[n++] = a;
    }
    if (st == K3_OK && !(*out = k3g_seq(p->b, kids, (int32_t)n))) st = nomem(p);
    free(kids);
    return st;
}

static k3_status parse_alt(rx *p, k3g_ast **out) {
    k3g_ast **kids = NULL;
    size_t n = 0, cap = 0;
    k3_status st = K3_OK;
    for (;;) {
        k3g_ast *a;
        st = parse_seq(p, &a);
        if (st != K3_OK) break;
        if (!k3g_grow(&kids, &cap, n + 1, sizeof *kids)) {
            st = nomem(p);
            break;
        }
        kids[n++] = a;
        if (p->at < p->n && p->s[p->at] == '|') {
            p->at++;
            continue;
        }
        break;
    }
    if (st == K3_OK) {
        if (n == 1) *out = kids[0];
        else {
            /* keep an explicit ALT even of one kind so anchors can be found per alternative */
            *out = k3g_alt(p->b, kids, (int32_t)n);
            if (!*out) st = nomem(p);
        }
    }
    free(kids);
    return st;
}

/* Anchors: removes ^ at the start and $ at the end of a (the top-level
 * expression, descending into a single group / alternatives), reporting
 * whether each end was anchored; any other anchor is an error. */
static k3_status strip_ends(rx *p, k3g_ast *a, bool *start, bool *end);

static bool has_anchor(const k3g_ast *a) {
    if (!a) return false;
    if (is_anchor(a)) return true;
    if (a->kind == K3G_A_SEQ || a->kind == K3G_A_ALT || a->kind == K3G_A_REP)
        for (int32_t i = 0; i < a->n; i++)
            if (has_anchor(a->u.kids[i])) return true;
    return false;
}

static k3g_ast *any_text(rx *p) {
    uint32_t r[2] = {0, 0x10FFFF};
    return k3g_rep(p->b, k3g_cpset(p->b, r, 1), 0, -1);
}

/* One top-level alternative made whole: the anchors at its ends removed,
 * any text added at an unanchored end (search). */
static k3_status finish_alt(rx *p, k3g_ast *a, bool search, k3g_ast **out) {
    bool start = false, end = false;
    K3_TRY(strip_ends(p, a, &start, &end));
    if (has_anchor(a)) {
        return k3_err(p->b->err, K3_ERR_UNSUPPORTED,
                      "%s: an anchor ^ or $ inside the pattern (not at its "
                      "start or end) is not supported",
                      p->where);
    }
    int32_t n = 0;
    k3g_ast *seq[3];
    if (search && !start) seq[n++] = any_text(p);
    seq[n++] = a;
    if (search && !end) seq[n++] = any_text(p);
    *out = k3g_seq(p->b, seq, n);
    return *out ? K3_OK : nomem(p);
}

static k3_status strip_ends(rx *p, k3g_ast *a, bool *start, bool *end) {
    if (is_anchor(a)) {
        if (a->sym == ANCHOR_START) *start = true;
        else *end = true;
        a->kind = K3G_A_EMPTY;
        return K3_OK;
    }
    if (a->kind != K3G_A_SEQ || a->n == 0) return K3_OK;
    /* leading ^ (possibly several), trailing $ */
    for (int32_t i = 0; i < a->n && is_anchor(a->u.kids[i]) && a->u.kids[i]->sym == ANCHOR_START; i++) {
        a->u.kids[i]->kind = K3G_A_EMPTY;
        *start = true;
    }
    for (int32_t i = a->n - 1; i >= 0 && is_anchor(a->u.kids[i]) && a->u.kids[i]->sym == ANCHOR_END; i--) {
        a->u.kids[i]->kind = K3G_A_EMPTY;
        *end = true;
    }
    (void)p;
    return K3_OK;
}

k3_status k3g_regex(k3g_builder *b, const char *re, size_t len, bool search, const char *where, k3g_ast **out) {
    *out = NULL;
    if (len > K3G_MAX_TEXT)
        return k3_err(b->err, K3_ERR_UNSUPPORTED, "%s: the regular expression is longer than %d bytes", where,
                      K3G_MAX_TEXT);
    rx p = {.b = b, .s = (const uint8_t *)re, .n = len, .where = where};
    k3g_ast *a;
    K3_TRY(parse_alt(&p, &a));
    if (p.at < p.n) return bad(&p, "an unmatched )");
    /* an alternation at the top: each alternative has its own anchors; a
     * single group around everything is looked into */
    k3g_ast *top = a;
    while (top->kind == K3G_A_SEQ && top->n == 1) top = top->u.kids[0];
    if (top->kind == K3G_A_ALT) {
        for (int32_t i = 0; i < top->n; i++) K3_TRY(finish_alt(&p, top->u.kids[i], search, &top->u.kids[i]));
        *out = top;
        return K3_OK;
    }
    return finish_alt(&p, top, search, out);
}
