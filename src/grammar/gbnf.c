/*
 * gbnf.c -- GBNF grammars (the syntax of llama.cpp's grammars/README.md)
 * into grammar rules.
 *
 *   rule    ::= NAME "::=" alternatives      (one per line; names [A-Za-z0-9_-]+)
 *   element ::= "literal" | [class] | [^class] | . | NAME | ( alternatives )
 *             | <[ID]> | <SPECIAL> | !<SPECIAL>
 *   followed by * + ? {m} {m,} {m,n}
 *
 * Literals and classes are Unicode code points (escapes \n \r \t \\ \" \[
 * \] \- \xHH \uHHHH \UHHHHHHHH), written as UTF-8. '.' is any code point.
 * A rule ends at a newline outside parentheses, unless the line ends in
 * '|'; '#' starts a comment. <[ID]> and <NAME> match one special token (by
 * id, or by its name such as <|open|>); ordinary tokens are matched by
 * their text, so naming one is an error saying so. !<NAME> matches any one
 * byte of text or any special token but NAME, so !<NAME>* is any text
 * without NAME. The output must match rule "root".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "grammar/gbnf.h"
#include "grammar/vocab.h"

typedef struct gp {
    k3g_builder *b;
    const uint8_t *s;
    size_t n, at;
    const char *where;
    int line;
    /* rule names -> rule ids, by a hash (a grammar of many rules compiles in
     * time linear in its text) */
    struct gname {
        char *name;
        size_t len;
        int32_t id;
        bool defined;
    } * names;
    size_t n_names, cap_names;
    int32_t *slot; /* open addressing: index into names, or -1 */
    uint32_t mask;
    int depth;
} gp;

static k3_status bad(gp *p, const char *what) {
    return k3_err(p->b->err, K3_ERR_ARG, "%s: line %d: %s", p->where, p->line, what);
}

static k3_status nomem(gp *p) { return k3_err(p->b->err, K3_ERR_NOMEM, "out of memory compiling a grammar"); }

static bool name_char(uint8_t c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

/* Skips blanks and comments; newlines too when nested or after '|'. */
static void space(gp *p, bool newlines) {
    while (p->at < p->n) {
        uint8_t c = p->s[p->at];
        if (c == ' ' || c == '\t' || c == '\r') p->at++;
        else if (c == '#') {
            while (p->at < p->n && p->s[p->at] != '\n') p->at++;
        } else if (c == '\n' && newlines) {
            p->at++;
            p->line++;
        } else break;
    }
}

static uint32_t name_hash(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return (uint32_t)(h ^ h >> 32);
}

static bool names_rehash(gp *p) {
    uint32_t ns = p->slot ? (p->mask + 1) * 2 : 256;
    int32_t *slot = malloc((size_t)ns * sizeof *slot);
    if (!slot) return false;
    for (uint32_t i = 0; i < ns; i++) slot[i] = -1;
    for (size_t k = 0; k < p->n_names; k++) {
        uint32_t i = name_hash(p->names[k].name, p->names[k].len) & (ns - 1);
        while (slot[i] >= 0) i = (i + 1) & (ns - 1);
        slot[i] = (int32_t)k;
    }
    free(p->slot);
    p->slot = slot;
    p->mask = ns - 1;
    return true;
}

/* The index in names of the rule called name (made when new); -1 when out of memory. */
static int32_t name_index(gp *p, const char *name, size_t len) {
    if (!p->slot || p->n_names * 2 + 2 >= p->mask) {
        if (!names_rehash(p)) return -1;
    }
    uint32_t i = name_hash(name, len) & p->mask;
    for (; p->slot[i] >= 0; i = (i + 1) & p->mask) {
        const struct gname *g = &p->names[p->slot[i]];
        if (g->len == len && !memcmp(g->name, name, len)) return p->slot[i];
    }
    char buf[256];
    snprintf(buf, sizeof buf, "%.*s", (int)(len < 200 ? len : 200), name);
    int32_t r = k3g_rule(p->b, buf);
    if (r < 0) return -1;
    if (!k3g_grow(&p->names, &p->cap_names, p->n_names + 1, sizeof *p->names)) return -1;
    char *d = malloc(len + 1);
    if (!d) return -1;
    memcpy(d, name, len);
    d[len] = 0;
    p->names[p->n_names] = (struct gname){d, len, r, false};
    p->slot[i] = (int32_t)p->n_names;
    return (int32_t)p->n_names++;
}

static int32_t rule_of(gp *p, const char *name, size_t len) {
    const int32_t k = name_index(p, name, len);
    return k < 0 ? -1 : p->names[k].id;
}

static int64_t utf8_next(gp *p) {
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

/* One character of a literal or class (p->at on it); -1 with the error set. */
static int64_t char_at(gp *p, k3_status *st) {
    *st = K3_OK;
    if (p->at >= p->n) {
        *st = bad(p, "the text ends inside a literal or class");
        return -1;
    }
    if (p->s[p->at] != '\\') {
        int64_t v = utf8_next(p);
        if (v < 0) *st = bad(p, "invalid UTF-8");
        return v;
    }
    p->at++;
    if (p->at >= p->n) {
        *st = bad(p, "a trailing backslash");
        return -1;
    }
    uint8_t c = p->s[p->at++];
    int nh = 0;
    switch (c) {
    case 'n': return '\n';
    case 'r': return '\r';
    case 't': return '\t';
    case 'x': nh = 2; break;
    case 'u': nh = 4; break;
    case 'U': nh = 8; break;
    case '\\':
    case '"':
    case '[':
    case ']':
    case '-':
    case '^':
    case '/':
    case '\'': return c;
    default: *st = bad(p, "an unknown escape"); return -1;
    }
    int64_t v = 0;
    for (int i = 0; i < nh; i++) {
        int h = p->at < p->n ? hexval(p->s[p->at]) : -1;
        if (h < 0) {
            *st = bad(p, "an escape needs hex digits");
            return -1;
        }
        v = v * 16 + h;
        p->at++;
    }
    if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
        *st = bad(p, "an escape outside the Unicode range");
        return -1;
    }
    return v;
}

static k3_status alternatives(gp *p, k3g_ast **out, bool nested);

static k3_status token_ref(gp *p, bool neg, k3g_ast **out) {
    const k3_grammar_vocab *v = p->b->vocab;
    size_t a = p->at++; /* the name includes the angle brackets: <|open|> */
    while (p->at < p->n && p->s[p->at] != '>' && p->s[p->at] != '\n') p->at++;
    if (p->at >= p->n || p->s[p->at] != '>') return bad(p, "an unclosed <token>");
    p->at++;
    size_t len = p->at - a;
    int32_t id = -1;
    char buf[160];
    snprintf(buf, sizeof buf, "%.*s", (int)(len < 120 ? len : 120), (const char *)p->s + a);
    if (len >= 4 && p->s[a + 1] == '[' && p->s[a + len - 2] == ']') {
        char *end;
        long long x = strtoll(buf + 2, &end, 10);
        if (end != buf + len - 2 || x < 0 || !v || x >= v->n_vocab) return bad(p, "a token id out of range");
        id = (int32_t)x;
        if (!v->is_special[id])
            return k3_err(p->b->err, K3_ERR_UNSUPPORTED,
                          "%s: line %d: %s is an ordinary token; match its "
                          "text with a \"literal\" instead",
                          p->where, p->line, buf);
    } else {
        id = v ? k3g_vocab_special(v, (const char *)p->s + a, len) : -1;
        if (id < 0)
            return k3_err(p->b->err, K3_ERR_ARG, "%s: line %d: %s is not a special token of this vocabulary", p->where,
                          p->line, buf);
    }
    if (!neg) {
        *out = k3g_special(p->b, id);
        return *out ? K3_OK : nomem(p);
    }
    size_t n = (size_t)v->n_specials + 1;
    k3g_ast **k = malloc(n * sizeof *k);
    if (!k) return nomem(p);
    size_t m = 0;
    k[m++] = k3g_brange(p->b, 0, 255);
    for (int32_t i = 0; i < v->n_specials; i++)
        if (v->specials[i] != id) k[m++] = k3g_special(p->b, v->specials[i]);
    *out = k3g_alt(p->b, k, (int32_t)m);
    free(k);
    return *out ? K3_OK : nomem(p);
}

static k3_status element(gp *p, k3g_ast **out, bool nested) {
    uint8_t c = p->s[p->at];
    k3_status st = K3_OK;
    if (c == '"') {
        p->at++;
        k3g_ast **k = NULL;
        size_t n = 0, cap = 0;
        while (st == K3_OK) {
            if (p->at >= p->n || p->s[p->at] == '\n') {
                st = bad(p, "an unclosed \"literal\"");
                break;
            }
            if (p->s[p->at] == '"') {
                p->at++;
                break;
            }
            int64_t v = char_at(p, &st);
            if (st != K3_OK) break;
            uint32_t r[2] = {(uint32_t)v, (uint32_t)v};
            if (!k3g_grow(&k, &cap, n + 1, sizeof *k)) st = nomem(p);
            else k[n++] = k3g_cpset(p->b, r, 1);
        }
        if (st == K3_OK && !(*out = k3g_seq(p->b, k, (int32_t)n))) st = nomem(p);
        free(k);
        return st;
    }
    if (c == '[') {
        p->at++;
        bool neg = p->at < p->n && p->s[p->at] == '^';
        if (neg) p->at++;
        uint32_t *r = NULL;
        size_t n = 0, cap = 0;
        while (st == K3_OK) {
            if (p->at >= p->n || p->s[p->at] == '\n') {
                st = bad(p, "an unclosed [class]");
                break;
            }
            if (p->s[p->at] == ']') {
                p->at++;
                break;
            }
            int64_t lo = char_at(p, &st), hi = lo;
            if (st != K3_OK) break;
            if (p->at + 1 < p->n && p->s[p->at] == '-' && p->s[p->at + 1] != ']') {
                p->at++;
                hi = char_at(p, &st);
                if (st != K3_OK) break;
                if (hi < lo) {
                    st = bad(p, "a character range out of order");
                    break;
                }
            }
            if (!k3g_grow(&r, &cap, 2 * n + 2, sizeof *r)) {
                st = nomem(p);
                break;
            }
            r[2 * n] = (uint32_t)lo;
            r[2 * n + 1] = (uint32_t)hi;
            n++;
        }
        if (st == K3_OK && neg) {
            /* the complement: sort, then the gaps */
            for (size_t i = 1; i < n; i++)
                for (size_t j = i; j > 0 && r[2 * j] < r[2 * j - 2]; j--) {
                    uint32_t t0 = r[2 * j], t1 = r[2 * j + 1];
                    r[2 * j] = r[2 * j - 2];
                    r[2 * j + 1] = r[2 * j - 1];
                    r[2 * j - 2] = t0;
                    r[2 * j - 1] = t1;
                }
            uint32_t *o = malloc((2 * n + 2) * sizeof *o);
            size_t m = 0;
            uint32_t next = 0;
            if (!o) st = nomem(p);
            for (size_t i = 0; st == K3_OK && i < n; i++) {
                if (r[2 * i] > next) {
                    o[2 * m] = next;
                    o[2 * m + 1] = r[2 * i] - 1;
                    m++;
                }
                if (r[2 * i + 1] + 1 > next) next = r[2 * i + 1] + 1;
            }
            if (st == K3_OK && next <= 0x10FFFF) {
                o[2 * m] = next;
                o[2 * m + 1] = 0x10FFFF;
                m++;
            }
            free(r);
            r = o;
            n = m;
        }
        if (st == K3_OK && !(*out = k3g_cpset(p->b, r, (int32_t)n))) st = nomem(p);
        free(r);
        return st;
    }
    if (c == '.') {
        p->at++;
        uint32_t r[2] = {0, 0x10FFFF};
        *out = k3g_cpset(p->b, r, 1);
        return *out ? K3_OK : nomem(p);
    }
    if (c == '(') {
        p->at++;
        if (++p->depth > 200) return bad(p, "parentheses nest deeper than 200");
        space(p, true);
        K3_TRY(alternatives(p, out, true));
        p->depth--;
        space(p, true);
        if (p->at >= p->n || p->s[p->at] != ')') return bad(p, "an unclosed (");
        p->at++;
        return K3_OK;
    }
    if (c == '<') return token_ref(p, false, out);
    if (c == '!' && p->at + 1 < p->n && p->s[p->at + 1] == '<') {
        p->at++;
        return token_ref(p, true, out);
    }
    if (name_char(c)) {
        size_t a = p->at;
        while (p->at < p->n && name_char(p->s[p->at])) p->at++;
        if (p->at + 2 < p->n && !memcmp(p->s + p->at, "::=", 3))
            return bad(p, "a rule definition inside another rule (a missing newline?)");
        size_t save = p->at;
        space(p, false);
        if (p->at + 2 < p->n && !memcmp(p->s + p->at, "::=", 3))
            return bad(p, "a rule definition inside another rule (a missing newline?)");
        p->at = save;
        int32_t r = rule_of(p, (const char *)p->s + a, p->at - a);
        if (r < 0) return nomem(p);
        *out = k3g_ref(p->b, r);
        return *out ? K3_OK : nomem(p);
    }
    (void)nested;
    char what[64];
    snprintf(what, sizeof what, "an unexpected character '%c'", c >= 0x20 && c < 0x7F ? c : '?');
    return bad(p, what);
}

static k3_status sequence(gp *p, k3g_ast **out, bool nested) {
    k3g_ast **k = NULL;
    size_t n = 0, cap = 0;
    k3_status st = K3_OK;
    for (;;) {
        space(p, nested);
        if (p->at >= p->n) break;
        uint8_t c = p->s[p->at];
        if (c == '|' || c == ')' || c == '\n') break;
        k3g_ast *a;
        st = element(p, &a, nested);
        if (st != K3_OK) break;
        for (;;) {
            if (p->at >= p->n) break;
            c = p->s[p->at];
            int64_t mn, mx;
            if (c == '*') mn = 0, mx = -1, p->at++;
            else if (c == '+') mn = 1, mx = -1, p->at++;
            else if (c == '?') mn = 0, mx = 1, p->at++;
            else if (c == '{') {
                p->at++;
                space(p, false);
                mn = 0;
                int nd = 0;
                while (p->at < p->n && p->s[p->at] >= '0' && p->s[p->at] <= '9' && mn < 100000000)
                    mn = mn * 10 + (p->s[p->at++] - '0'), nd++;
                if (!nd) {
                    st = bad(p, "a {m,n} repetition needs a number");
                    break;
                }
                space(p, false);
                mx = mn;
                if (p->at < p->n && p->s[p->at] == ',') {
                    p->at++;
                    space(p, false);
                    mx = -1;
                    if (p->at < p->n && p->s[p->at] >= '0' && p->s[p->at] <= '9') {
                        mx = 0;
                        while (p->at < p->n && p->s[p->at] >= '0' && p->s[p->at] <= '9' && mx < 100000000)
                            mx = mx * 10 + (p->s[p->at++] - '0');
                    }
                    space(p, false);
                }
                if (p->at >= p->n || p->s[p->at] != '}') {
                    st = bad(p, "an unclosed {m,n} repetition");
                    break;
                }
                p->at++;
                if (mx >= 0 && mx < mn) {
                    st = bad(p, "a {m,n} repetition with n < m");
                    break;
                }
                if (mn > K3G_MAX_REPEAT || mx > K3G_MAX_REPEAT) {
                    st = k3_err(p->b->err, K3_ERR_UNSUPPORTED,
                                "%s: line %d: a repetition count beyond the "
                                "supported %d",
                                p->where, p->line, K3G_MAX_REPEAT);
                    break;
                }
            } else break;
            a = k3g_rep(p->b, a, (int32_t)mn, (int32_t)mx);
            if (!a) {
                st = nomem(p);
                break;
            }
        }
        if (st != K3_OK) break;
        if (!k3g_grow(&k, &cap, n + 1, sizeof *k)) {
            st = nomem(p);
            break;
        }
        k[n++] = a;
    }
    if (st == K3_OK && !(*out = k3g_seq(p->b, k, (int32_t)n))) st = nomem(p);
    free(k);
    return st;
}

static k3_status alternatives(gp *p, k3g_ast **out, bool nested) {
    k3g_ast **k = NULL;
    size_t n = 0, cap = 0;
    k3_status st = K3_OK;
    for (;;) {
        k3g_ast *a;
        st = sequence(p, &a, nested);
        if (st != K3_OK) break;
        if (!k3g_grow(&k, &cap, n + 1, sizeof *k)) {
            st = nomem(p);
            break;
        }
        k[n++] = a;
        space(p, nested);
        if (p->at < p->n && p->s[p->at] == '|') {
            p->at++;
            space(p, true); /* a newline after | continues the rule */
            continue;
        }
        break;
    }
    if (st == K3_OK && !(*out = k3g_alt(p->b, k, (int32_t)n))) st = nomem(p);
    free(k);
    return st;
}

k3_status k3g_gbnf(k3g_builder *b, const char *text, size_t len, const char *where, int32_t *root) {
    *root = -1;
    if (len > K3G_MAX_TEXT)
        return k3_err(b->err, K3_ERR_UNSUPPORTED, "%s: the grammar is longer than %d bytes", where, K3G_MAX_TEXT);
    gp p = {.b = b, .s = (const uint8_t *)text, .n = len, .where = where, .line = 1};
    k3_status st = K3_OK;
    for (;;) {
        space(&p, true);
        if (p.at >= p.n) break;
        if (k3g_stopped(b->err, where)) {
            st = b->err && b->err->status ? b->err->status : K3_ERR_UNSUPPORTED;
            break;
        }
        size_t a = p.at;
        while (p.at < p.n && name_char(p.s[p.at])) p.at++;
        if (p.at == a) {
            st = bad(&p, "expected a rule name");
            break;
        }
        size_t nl = p.at - a;
        space(&p, false);
        if (p.at + 3 > p.n || memcmp(p.s + p.at, "::=", 3)) {
            st = bad(&p, "expected ::= after the rule name");
            break;
        }
        p.at += 3;
        const int32_t k = name_index(&p, (const char *)p.s + a, nl);
        if (k < 0) {
            st = nomem(&p);
            break;
        }
        const size_t idx = (size_t)k;
        const int32_t r = p.names[idx].id;
        if (p.names[idx].defined) {
            char what[300];
            snprintf(what, sizeof what, "rule '%s' is defined twice", p.names[idx].name);
            st = bad(&p, what);
            break;
        }
        p.names[idx].defined = true;
        space(&p, false);
        k3g_ast *body;
        st = alternatives(&p, &body, false);
        if (st != K3_OK) break;
        space(&p, false);
        if (p.at < p.n && p.s[p.at] == ')') {
            st = bad(&p, "an unmatched )");
            break;
        }
        if (p.at < p.n && p.s[p.at] != '\n') {
            st = bad(&p, "unexpected text after the rule");
            break;
        }
        st = k3g_rule_set(b, r, body);
        if (st != K3_OK) break;
    }
    for (size_t i = 0; st == K3_OK && i < p.n_names; i++)
        if (!p.names[i].defined)
            st = k3_err(b->err, K3_ERR_ARG, "%s: rule '%s' is used but never defined", where, p.names[i].name);
    if (st == K3_OK) {
        for (size_t i = 0; i < p.n_names; i++)
            if (!strcmp(p.names[i].name, "root")) *root = p.names[i].id;
        if (*root < 0) st = k3_err(b->err, K3_ERR_ARG, "%s: the grammar has no rule named 'root'", where);
    }
    for (size_t i = 0; i < p.n_names; i++) free(p.names[i].name);
    free(p.names);
    free(p.slot);
    return st;
}
