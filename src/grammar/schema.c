/*
 * schema.c -- JSON Schema (draft 2020-12 meaning) into grammar rules.
 *
 * A schema is a conjunction of keywords, each constraining only values of
 * its own type, so a schema compiles to one alternative per JSON type it
 * allows (null, boolean, integer, number, string, array, object), each with
 * that type's keywords applied. Before that, the applicators are taken
 * apart:
 *   - $ref (JSON pointers inside the document, $anchor names, "#"): a rule
 *     per target, made before its body so recursion is a rule referring to
 *     itself; $ref beside other keywords is their intersection (allOf);
 *   - allOf: the branches are merged keyword by keyword into one schema
 *     (types intersected, bounds tightened, properties merged with each
 *     side's additionalProperties, required united, patterns and formats
 *     kept as several to intersect...); what cannot be merged exactly is an
 *     error;
 *   - anyOf: the other keywords merged into each branch, then the union;
 *   - oneOf: the same, after proving the branches pairwise disjoint (by
 *     type, by const/enum values, by a property whose values differ, by a
 *     required property the other branch forbids); otherwise an error,
 *     since "exactly one" is not a union.
 * Compiled subschemas are kept by their canonical text, so a repeated or
 * recursive schema is one rule.
 *
 * Values: strings are automata over the raw text (length as code points,
 * pattern with search semantics, format) intersected, then encoded as the
 * inside of a JSON literal (escapes: \" \\ control characters, \/); a
 * string with only a length limit allows every escape and shares the
 * standard string's token tables. Numbers with bounds or multipleOf are
 * digit automata over the decimal text (no exponent); integers are
 * -?(0|[1-9][0-9]*) with an optional .0+. enum/const values are their
 * canonical JSON texts (numbers also with trailing zeros), filtered by the
 * schema's other keywords. Objects list their properties in the schema's
 * order, each once, required ones always, then the additional and pattern
 * properties; arrays unroll prefixItems and minItems/maxItems.
 *
 * The keywords that are not honoured (not beyond a type list, if/then/else,
 * dependent*, contains, unevaluated*, uniqueItems, $dynamicRef...) are an
 * error naming the keyword and its path; unknown keywords are annotations
 * and ignored, as the specification says.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/chat_form.h"
#include "common/error.h"
#include "common/json_guard.h"
#include "common/json_text.h"
#include "grammar/regex.h"
#include "grammar/schema.h"
#include "grammar/stdrules.h"
#include "grammar/vocab.h"

enum {
    T_NULL = 1,
    T_BOOL = 2,
    T_INT = 4,
    T_FRAC = 8,
    T_STR = 16,
    T_ARR = 32,
    T_OBJ = 64,
    T_NUM = T_INT | T_FRAC,
    T_ALL = 127,
};

enum { ENC_JSON = 0, ENC_RAW = 1 };

/* internal keywords of merged schemas (a user schema cannot start a key
 * with \x01... it could, but then it is an unknown keyword of its own) */
#define K_PATTERNS "\x01patterns"
#define K_FORMATS "\x01formats"
#define K_MULTIPLES "\x01multiples"
#define K_TYPES "\x01types"

typedef struct memo_e {
    char *key;
    int32_t rule;
} memo_e;

typedef struct fmt_e {
    char *name;
    k3g_fa *dfa;
} fmt_e;

typedef struct js {
    k3g_builder *b;
    k3_error *err;
    json_t *root;
    const char *root_id;
    k3g_ws ws;
    bool no_extra;
    bool int_canon; /* numbers as JSON writers write them (k3_grammar_spec.canonical_numbers) */
    int int_digits; /* most digits of a number's integer part (common/json_text.h; more for a bound that needs them) */
    memo_e *memo;
    size_t n_memo, cap_memo;
    fmt_e *fmts;
    size_t n_fmts, cap_fmts;
    json_t *anchors; /* $anchor name -> schema */
    bool has_ref;
    char path[1024];
    size_t plen;
    int depth;
    int norm_depth;
} js;

/* ---- paths and errors -------------------------------------------------------------- */

static size_t path_push(js *J, const char *fmt, const char *arg) {
    size_t old = J->plen;
    int n = snprintf(J->path + J->plen, sizeof J->path - J->plen, fmt, arg);
    if (n > 0) J->plen = J->plen + (size_t)n < sizeof J->path ? J->plen + (size_t)n : sizeof J->path - 1;
    return old;
}

static size_t path_push_i(js *J, const char *key, size_t i) {
    size_t old = J->plen;
    int n = snprintf(J->path + J->plen, sizeof J->path - J->plen, ".%s[%zu]", key, i);
    if (n > 0) J->plen = J->plen + (size_t)n < sizeof J->path ? J->plen + (size_t)n : sizeof J->path - 1;
    return old;
}

static void path_pop(js *J, size_t old) {
    J->plen = old;
    J->path[old] = 0;
}

static k3_status unsup(js *J, const char *fmt, const char *arg) {
    char msg[400];
    snprintf(msg, sizeof msg, fmt, arg);
    return k3_err(J->err, K3_ERR_UNSUPPORTED, "%s: %s", J->path, msg);
}

static k3_status bad(js *J, const char *fmt, const char *arg) {
    char msg[400];
    snprintf(msg, sizeof msg, fmt, arg);
    return k3_err(J->err, K3_ERR_ARG, "%s: %s", J->path, msg);
}

static k3_status nomem(js *J) { return k3_err(J->err, K3_ERR_NOMEM, "out of memory compiling a JSON schema"); }

/* ---- keywords ---------------------------------------------------------------------- */

typedef enum kw_kind { KW_UNKNOWN, KW_OK, KW_ANNOT, KW_UNSUP } kw_kind;

static const char *const KW_SUPPORTED[] = {"type",
                                           "enum",
                                           "const",
                                           "properties",
                                           "required",
                                           "additionalProperties",
                                           "patternProperties",
                                           "propertyNames",
                                           "minProperties",
                                           "maxProperties",
                                           "items",
                                           "prefixItems",
                                           "additionalItems",
                                           "minItems",
                                           "maxItems",
                                           "uniqueItems",
                                           "anyOf",
                                           "oneOf",
                                           "allOf",
                                           "not",
                                           "$ref",
                                           "$defs",
                                           "definitions",
                                           "minLength",
                                           "maxLength",
                                           "pattern",
                                           "format",
                                           "minimum",
                                           "maximum",
                                           "exclusiveMinimum",
                                           "exclusiveMaximum",
                                           "multipleOf",
                                           "nullable",
                                           K_PATTERNS,
                                           K_FORMATS,
                                           K_MULTIPLES,
                                           K_TYPES,
                                           NULL};
static const char *const KW_ANNOTATIONS[] = {"title",
                                             "description",
                                             "default",
                                             "examples",
                                             "example",
                                             "$comment",
                                             "$schema",
                                             "$id",
                                             "$anchor",
                                             "deprecated",
                                             "readOnly",
                                             "writeOnly",
                                             "contentMediaType",
                                             "contentEncoding",
                                             "contentSchema",
                                             "$vocabulary",
                                             "discriminator",
                                             "xml",
                                             "externalDocs",
                                             "then",
                                             "else",
                                             NULL};
static const char *const KW_UNSUPPORTED[] = {"if",
                                             "dependentSchemas",
                                             "dependentRequired",
                                             "dependencies",
                                             "contains",
                                             "minContains",
                                             "maxContains",
                                             "unevaluatedItems",
                                             "unevaluatedProperties",
                                             "$dynamicRef",
                                             "$dynamicAnchor",
                                             "$recursiveRef",
                                             "$recursiveAnchor",
                                             NULL};

static bool in_list(const char *const *l, const char *k) {
    for (; *l; l++)
        if (!strcmp(*l, k)) return true;
    return false;
}

static kw_kind kw_of(const char *k) {
    if (in_list(KW_SUPPORTED, k)) return KW_OK;
    if (in_list(KW_ANNOTATIONS, k)) return KW_ANNOT;
    if (in_list(KW_UNSUPPORTED, k)) return KW_UNSUP;
    return KW_UNKNOWN;
}

/* Keywords that constrain a value (everything but annotations, unknown
 * keywords and the definition containers). */
static bool asserts(const char *k) { return kw_of(k) == KW_OK && strcmp(k, "$defs") && strcmp(k, "definitions"); }

static bool has_asserts(const json_t *s) {
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)s, k, v) if (asserts(k)) return true;
    return false;
}

static k3_status check_keywords(js *J, const json_t *s) {
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)s, k, v) {
        kw_kind kk = kw_of(k);
        if (kk == KW_UNSUP) return unsup(J, "keyword '%s' is not supported", k);
        if (!strcmp(k, "uniqueItems") && json_is_true(v)) {
            json_t *mx = json_object_get(s, "maxItems");
            if (!(json_is_integer(mx) && json_integer_value(mx) <= 1))
                return unsup(J, "keyword '%s' (true) is not supported", k);
        }
        if (!strcmp(k, "$id") && J->has_ref && s != J->root)
            return unsup(J, "keyword '%s' below the root (a new base for $ref) is not supported", k);
    }
    return K3_OK;
}

/* ---- $ref -------------------------------------------------------------------------- */

static void collect_anchors(js *J, json_t *s, int depth) {
    if (depth > 200) return;
    if (json_is_object(s)) {
        const char *k;
        json_t *v;
        json_t *a = json_object_get(s, "$anchor");
        if (json_is_string(a)) json_object_set(J->anchors, json_string_value(a), s);
        if (json_object_get(s, "$ref")) J->has_ref = true;
        json_object_foreach(s, k, v) collect_anchors(J, v, depth + 1);
    } else if (json_is_array(s)) {
        size_t i;
        json_t *v;
        json_array_foreach(s, i, v) collect_anchors(J, v, depth + 1);
    }
}

static int hexv(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The schema a $ref names, and its path for messages; NULL with err. */
static json_t *resolve(js *J, const char *ref, char *tpath, size_t tcap) {
    const char *r = ref;
    if (J->root_id && *J->root_id) {
        size_t n = strlen(J->root_id);
        const char *hash = strchr(J->root_id, '#');
        if (hash) n = (size_t)(hash - J->root_id);
        if (!strncmp(r, J->root_id, n) && (r[n] == '#' || r[n] == 0)) r += n;
    }
    if (*r == 0 || !strcmp(r, "#")) {
        snprintf(tpath, tcap, "%s", "json_schema");
        return J->root;
    }
    if (r[0] != '#') {
        unsup(J, "$ref '%s' points outside the schema (only references inside it are supported)", ref);
        return NULL;
    }
    if (r[1] != '/') {
        json_t *t = json_object_get(J->anchors, r + 1);
        if (!t) {
            bad(J, "$ref '%s' names no $anchor of the schema", ref);
            return NULL;
        }
        snprintf(tpath, tcap, "json_schema(%s)", r);
        return t;
    }
    json_t *cur = J->root;
    size_t tp = (size_t)snprintf(tpath, tcap, "%s", "json_schema");
    const char *p = r + 2;
    for (;;) {
        char tok[512];
        size_t n = 0;
        while (*p && *p != '/') {
            char c = *p++;
            if (c == '%' && hexv(p[0]) >= 0 && hexv(p[1]) >= 0) {
                c = (char)(hexv(p[0]) * 16 + hexv(p[1]));
                p += 2;
            } else if (c == '~' && (*p == '0' || *p == '1')) {
                c = *p++ == '0' ? '~' : '/';
            }
            if (n + 1 < sizeof tok) tok[n++] = c;
        }
        tok[n] = 0;
        if (json_is_object(cur)) {
            cur = json_object_get(cur, tok);
        } else if (json_is_array(cur)) {
            char *end;
            long long i = strtoll(tok, &end, 10);
            cur = *tok && !*end && i >= 0 ? json_array_get(cur, (size_t)i) : NULL;
        } else {
            cur = NULL;
        }
        if (!cur) {
            bad(J, "$ref '%s' does not resolve inside the schema", ref);
            return NULL;
        }
        if (tp < tcap) tp += (size_t)snprintf(tpath + tp, tcap - tp, ".%s", tok);
        if (!*p) break;
        p++;
    }
    return cur;
}

/* ---- decimal numbers ---------------------------------------------------------------- */

typedef struct dec {
    bool neg;
    char I[440]; /* integer digits, no leading zeros ("0" for zero) */
    char F[440]; /* fraction digits, no trailing zeros */
} dec;

static bool dec_is_zero(const dec *d) { return !strcmp(d->I, "0") && !d->F[0]; }

/* The exact decimal value of a JSON number (shortest digits that read back
 * to the same double for a real); false when it needs over 400 digits. */
static bool dec_of(const json_t *v, dec *d) {
    *d = (dec){0};
    if (json_is_integer(v)) {
        long long x = json_integer_value(v);
        d->neg = x < 0;
        unsigned long long u = x < 0 ? 0ull - (unsigned long long)x : (unsigned long long)x;
        snprintf(d->I, sizeof d->I, "%llu", u);
        return true;
    }
    double x = json_real_value(v);
    if (!isfinite(x)) return false;
    d->neg = signbit(x) && x != 0;
    x = fabs(x);
    char buf[64];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*e", prec - 1, x);
        if (strtod(buf, NULL) == x) break;
    }
    char digits[32];
    size_t nd = 0;
    const char *p = buf;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9') digits[nd++] = *p;
    digits[nd] = 0;
    int e = *p == 'e' ? atoi(p + 1) : 0;
    int point = 1 + e; /* digits before the decimal point */
    if (point > 400 || point < -400) return false;
    char I[440] = "", F[440] = "";
    if (point <= 0) {
        snprintf(I, sizeof I, "0");
        size_t k = 0;
        for (int i = 0; i < -point; i++) F[k++] = '0';
        memcpy(F + k, digits, nd + 1);
    } else if ((size_t)point >= nd) {
        memcpy(I, digits, nd);
        for (size_t i = nd; i < (size_t)point; i++) I[i] = '0';
        I[point] = 0;
    } else {
        memcpy(I, digits, (size_t)point);
        I[point] = 0;
        memcpy(F, digits + point, nd - (size_t)point + 1);
    }
    /* normalize */
    const char *ip = I;
    while (ip[0] == '0' && ip[1]) ip++;
    snprintf(d->I, sizeof d->I, "%s", ip);
    size_t fl = strlen(F);
    while (fl && F[fl - 1] == '0') F[--fl] = 0;
    snprintf(d->F, sizeof d->F, "%s", F);
    if (dec_is_zero(d)) d->neg = false;
    return true;
}

static void dec_text(const dec *d, char *out, size_t cap) {
    snprintf(out, cap, "%s%s%s%s", d->neg ? "-" : "", d->I, d->F[0] ? "." : "", d->F);
}

/* -1, 0, 1 */
static int dec_cmp(const dec *a, const dec *b) {
    if (dec_is_zero(a) && dec_is_zero(b)) return 0;
    if (a->neg != b->neg) return a->neg ? -1 : 1;
    int s = a->neg ? -1 : 1;
    size_t la = strlen(a->I), lb = strlen(b->I);
    if (la != lb) return la < lb ? -s : s;
    int c = strcmp(a->I, b->I);
    if (c) return c < 0 ? -s : s;
    c = strcmp(a->F, b->F); /* no trailing zeros: lexicographic is numeric */
    if (c) return c < 0 ? -s : s;
    return 0;
}

/* A count keyword's value, clamped far past every limit (a double of 1e30
 * would not fit an int64). */
static int64_t count_of(const json_t *v) {
    double d = json_number_value(v);
    return d > 1e12 ? (int64_t)1e12 : d < -1e12 ? (int64_t)-1e12 : (int64_t)d;
}

/* ---- small expression helpers ----------------------------------------------------------- */

static k3g_ast *L(js *J, const char *s) { return k3g_str(J->b, s); }
static k3g_ast *D(js *J, int lo, int hi) {
    if (lo > hi) return k3g_none(J->b);
    return k3g_brange(J->b, (unsigned)('0' + lo), (unsigned)('0' + hi));
}
static k3g_ast *DIGITS(js *J, int min, int max) { return k3g_rep(J->b, D(J, 0, 9), min, max); }

static k3g_ast *ws(js *J) { return k3g_json_ws(J->b, J->ws); }
static k3g_ast *sep(js *J) {
    if (J->ws == K3G_WS_PY) return L(J, ", ");
    return k3g_seq3(J->b, ws(J), L(J, ","), ws(J));
}
static k3g_ast *colon(js *J) {
    if (J->ws == K3G_WS_PY) return L(J, ": ");
    return k3g_seq3(J->b, ws(J), L(J, ":"), ws(J));
}

/* ---- numbers ------------------------------------------------------------------------ */

/* -?(0|[1-9][0-9]*) as the reply parser reads it (common/json_text.h), at most int_digits digits */
static k3g_ast *int_canon(js *J) {
    return k3g_alt2(J->b, L(J, "0"), k3g_seq2(J->b, D(J, 1, 9), DIGITS(J, 0, J->int_digits - 1)));
}
/* any integer: the standard rule (a zero fraction allowed), or with
 * int_canon -?(0|[1-9][0-9]*) */
static k3g_ast *int_any(js *J) {
    if (!J->int_canon) return k3g_ref(J->b, k3g_std_rule(J->b, K3G_STD_INTEGER));
    return k3g_seq2(J->b, k3g_rep(J->b, L(J, "-"), 0, 1), int_canon(J));
}
static k3g_ast *frac_any(js *J) {
    return k3g_rep(J->b,
                   k3g_seq2(J->b, L(J, "."),
                            DIGITS(J, 1, J->int_canon ? K3_JSON_CANON_FRAC_DIGITS : K3_JSON_FRAC_DIGITS)),
                   0, 1);
}
static k3g_ast *nn_any(js *J) { return k3g_seq2(J->b, int_canon(J), frac_any(J)); }
static k3g_ast *zero_nn(js *J) {
    return k3g_seq2(J->b, L(J, "0"), k3g_rep(J->b, k3g_seq2(J->b, L(J, "."), k3g_rep(J->b, L(J, "0"), 1, -1)), 0, 1));
}

/* canonical integers (digit strings) greater / less than I */
static k3g_ast *int_gt(js *J, const char *I) {
    int n = (int)strlen(I);
    k3g_builder *b = J->b;
    k3g_ast **alt = k3g_alloc(&b->arena, (size_t)(n + 2) * sizeof *alt);
    if (!alt) return NULL;
    int m = 0;
    alt[m++] = k3g_seq2(b, D(J, 1, 9), DIGITS(J, n, -1)); /* more digits */
    for (int i = 0; i < n; i++) {
        int d = I[i] - '0';
        if (d == 9) continue;
        int lo = d + 1;
        k3g_ast *k[3] = {k3g_lit(b, I, (size_t)i), D(J, lo, 9), DIGITS(J, n - i - 1, n - i - 1)};
        alt[m++] = k3g_seq(b, k, 3);
    }
    return k3g_alt(b, alt, m);
}

static k3g_ast *int_lt(js *J, const char *I) {
    int n = (int)strlen(I);
    k3g_builder *b = J->b;
    if (!strcmp(I, "0")) return k3g_none(b);
    k3g_ast **alt = k3g_alloc(&b->arena, (size_t)(n + 3) * sizeof *alt);
    if (!alt) return NULL;
    int m = 0;
    if (n >= 2) {
        alt[m++] = L(J, "0");
        alt[m++] = k3g_seq2(b, D(J, 1, 9), DIGITS(J, 0, n - 2)); /* fewer digits */
    }
    for (int i = 0; i < n; i++) {
        int d = I[i] - '0';
        int lo = (i == 0 && n > 1) ? 1 : 0;
        if (d - 1 < lo) continue;
        k3g_ast *k[3] = {k3g_lit(b, I, (size_t)i), D(J, lo, d - 1), DIGITS(J, n - i - 1, n - i - 1)};
        alt[m++] = k3g_seq(b, k, 3);
    }
    return k3g_alt(b, alt, m);
}

/* fraction digits after '.' (at least one) compared with F[i..] */
static k3g_ast *frac_ge(js *J, const char *F, int i, bool strict) {
    k3g_builder *b = J->b;
    int n = (int)strlen(F);
    if (i == n) {
        if (!strict) return DIGITS(J, 0, -1);
        return k3g_seq3(b, DIGITS(J, 0, -1), D(J, 1, 9), DIGITS(J, 0, -1));
    }
    int d = F[i] - '0';
    k3g_ast *gt = k3g_seq2(b, D(J, d + 1, 9), DIGITS(J, 0, -1));
    char c[2] = {F[i], 0};
    return k3g_alt2(b, gt, k3g_seq2(b, L(J, c), frac_ge(J, F, i + 1, strict)));
}

/* digits from position i on (i > 0: possibly none) that keep the fraction <= F */
static k3g_ast *frac_le_rest(js *J, const char *F, int i, bool strict);

static k3g_ast *frac_le1(js *J, const char *F, int i, bool strict) {
    k3g_builder *b = J->b;
    int d = F[i] - '0';
    k3g_ast *lt = k3g_seq2(b, D(J, 0, d - 1), DIGITS(J, 0, -1));
    char c[2] = {F[i], 0};
    return k3g_alt2(b, lt, k3g_seq2(b, L(J, c), frac_le_rest(J, F, i + 1, strict)));
}

static k3g_ast *frac_le_rest(js *J, const char *F, int i, bool strict) {
    int n = (int)strlen(F);
    if (i == n) return strict ? k3g_none(J->b) : k3g_rep(J->b, L(J, "0"), 0, -1);
    return k3g_alt2(J->b, k3g_empty(J->b), frac_le1(J, F, i, strict));
}

/* non-negative decimal texts >= (>) I.F and <= (<) I.F */
static k3g_ast *ge_nn(js *J, const dec *d, bool strict) {
    k3g_builder *b = J->b;
    k3g_ast *eq;
    if (!d->F[0]) {
        eq = strict ? k3g_seq3(b, L(J, "."), DIGITS(J, 0, -1), k3g_seq2(b, D(J, 1, 9), DIGITS(J, 0, -1))) : frac_any(J);
    } else {
        eq = k3g_seq2(b, L(J, "."), frac_ge(J, d->F, 0, strict));
    }
    return k3g_alt2(b, k3g_seq2(b, int_gt(J, d->I), frac_any(J)), k3g_seq2(b, L(J, d->I), eq));
}

static k3g_ast *le_nn(js *J, const dec *d, bool strict) {
    k3g_builder *b = J->b;
    k3g_ast *eq;
    if (!d->F[0]) {
        eq = strict ? k3g_none(b) : k3g_rep(b, k3g_seq2(b, L(J, "."), k3g_rep(b, L(J, "0"), 1, -1)), 0, 1);
    } else {
        eq = k3g_alt2(b, k3g_empty(b), k3g_seq2(b, L(J, "."), frac_le1(J, d->F, 0, strict)));
    }
    return k3g_alt2(b, k3g_seq2(b, int_lt(J, d->I), frac_any(J)), k3g_seq2(b, L(J, d->I), eq));
}

/* signed decimal texts x >= (>) lo */
static k3g_ast *lower(js *J, const dec *lo, bool strict) {
    k3g_builder *b = J->b;
    if (dec_is_zero(lo))
        return strict ? ge_nn(J, lo, true) : k3g_alt2(b, nn_any(J), k3g_seq2(b, L(J, "-"), zero_nn(J)));
    if (!lo->neg) return ge_nn(J, lo, strict);
    dec m = *lo;
    m.neg = false;
    return k3g_alt2(b, nn_any(J), k3g_seq2(b, L(J, "-"), le_nn(J, &m, strict)));
}

static k3g_ast *upper(js *J, const dec *hi, bool strict) {
    k3g_builder *b = J->b;
    if (dec_is_zero(hi))
        return strict ? k3g_seq2(b, L(J, "-"), ge_nn(J, hi, true))
                      : k3g_alt2(b, k3g_seq2(b, L(J, "-"), nn_any(J)), zero_nn(J));
    if (hi->neg) {
        dec m = *hi;
        m.neg = false;
        return k3g_seq2(b, L(J, "-"), ge_nn(J, &m, strict));
    }
    return k3g_alt2(b, k3g_seq2(b, L(J, "-"), nn_any(J)), le_nn(J, hi, strict));
}

/* x is a multiple of d: residues of the digits (sign and '.' pass), the
 * text's shape left to the intersection with the number syntax. */
static k3_status multiple_dfa(js *J, const dec *d, k3g_fa *out) {
    *out = (k3g_fa){0};
    /* d = M * 10^-q */
    char digits[900];
    snprintf(digits, sizeof digits, "%s%s", d->I, d->F);
    int q = (int)strlen(d->F);
    const char *p = digits;
    while (p[0] == '0' && p[1]) p++;
    if (strlen(p) > 7) return unsup(J, "multipleOf %s is too fine (its digits exceed 7)", p);
    long long M = atoll(p);
    if (M <= 0) return bad(J, "multipleOf must be greater than 0%s", "");
    if (M * (q + 2) > 400000) return unsup(J, "multipleOf %s needs too large an automaton", p);
    /* states (r, j): j = 0 in the integer part, j = 1 + the fraction digits
     * read (1..q+1); past q digits only zeros may follow */
    int J2 = q + 2;
    for (long long s = 0; s < M * J2; s++) k3g_fa_state(out);
    if (out->oom) return nomem(J);
    out->start = 0;
    long long pow10[64];
    pow10[0] = 1 % M;
    for (int i = 1; i < 64; i++) pow10[i] = pow10[i - 1] * 10 % M;
    for (long long r = 0; r < M; r++) {
        for (int j = 0; j < J2; j++) {
            int32_t s = (int32_t)(r * J2 + j);
            int read = j == 0 ? 0 : j - 1; /* fraction digits read */
            int rest = q - read;
            if (rest < 64 && (r * pow10[rest]) % M == 0) out->final[s] = 1;
            if (j == 0) {
                k3g_fa_byte(out, s, s, '-', '-');
                k3g_fa_byte(out, s, (int32_t)(r * J2 + 1), '.', '.');
                for (int c = 0; c < 10; c++)
                    k3g_fa_byte(out, s, (int32_t)(((r * 10 + c) % M) * J2), (unsigned)('0' + c), (unsigned)('0' + c));
            } else if (j <= q) {
                for (int c = 0; c < 10; c++)
                    k3g_fa_byte(out, s, (int32_t)(((r * 10 + c) % M) * J2 + j + 1), (unsigned)('0' + c),
                                (unsigned)('0' + c));
            } else {
                k3g_fa_byte(out, s, s, '0', '0');
            }
        }
    }
    if (out->oom) return nomem(J);
    k3g_fa d2;
    k3_status st = k3g_fa_determinize(out, &d2, "a multipleOf automaton", J->err);
    k3g_fa_free(out);
    if (st == K3_OK) *out = d2;
    return st;
}

/* Numeric keywords of s for a number of kind mode: NUM_ANY, NUM_INT (an
 * integer) or NUM_FRAC (a number that is not one: a fraction with a nonzero
 * digit). *none when there is nothing to build (the caller uses the standard
 * rule). */
enum { NUM_ANY, NUM_INT, NUM_FRAC };

static k3_status number_dfa(js *J, const json_t *s, int mode, k3g_fa *out, bool *none) {
    *out = (k3g_fa){0};
    *none = true;
    k3g_builder *b = J->b;
    dec lo = {0}, hi = {0};
    bool has_lo = false, has_hi = false, lo_strict = false, hi_strict = false;
    const char *keys[4] = {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"};
    for (int i = 0; i < 4; i++) {
        json_t *v = json_object_get(s, keys[i]);
        if (!v || json_is_boolean(v)) continue;
        if (!json_is_number(v)) return bad(J, "'%s' must be a number", keys[i]);
        dec d;
        if (!dec_of(v, &d)) return unsup(J, "the bound '%s' has too many digits", keys[i]);
        bool strict = i == 1 || i == 3;
        if (i < 2) {
            /* draft 4: exclusiveMinimum true makes minimum strict */
            if (i == 0 && json_is_true(json_object_get(s, "exclusiveMinimum"))) strict = true;
            int c = has_lo ? dec_cmp(&d, &lo) : 1;
            if (!has_lo || c > 0 || (c == 0 && strict)) {
                lo = d;
                lo_strict = strict;
            }
            has_lo = true;
        } else {
            if (i == 2 && json_is_true(json_object_get(s, "exclusiveMaximum"))) strict = true;
            int c = has_hi ? dec_cmp(&d, &hi) : -1;
            if (!has_hi || c < 0 || (c == 0 && strict)) {
                hi = d;
                hi_strict = strict;
            }
            has_hi = true;
        }
    }
    json_t *mults = json_array();
    if (!mults) return nomem(J);
    json_t *mo = json_object_get(s, "multipleOf");
    if (mo) json_array_append(mults, mo);
    json_t *extra = json_object_get(s, K_MULTIPLES);
    size_t ix;
    json_t *ev;
    json_array_foreach(extra, ix, ev) json_array_append(mults, ev);
    if (!has_lo && !has_hi && json_array_size(mults) == 0 && mode != NUM_FRAC && !J->int_canon) {
        json_decref(mults);
        return K3_OK;
    }
    *none = false;
    /* the number syntax, no exponent; a bound past the digit limit widens it
     * to the bound's digits (a minimum of 1e20 still has numbers) */
    const int int_digits = J->int_digits;
    if (has_lo && (int)strlen(lo.I) > J->int_digits) J->int_digits = (int)strlen(lo.I);
    if (has_hi && (int)strlen(hi.I) > J->int_digits) J->int_digits = (int)strlen(hi.I);
    k3g_ast *sign = k3g_rep(b, L(J, "-"), 0, 1), *shape;
    if (mode == NUM_INT && J->int_canon) {
        shape = k3g_seq2(b, sign, int_canon(J));
    } else if (mode == NUM_INT) {
        /* a zero fraction only up to 15 digits (the standard integer rule says why) */
        k3g_ast *small = k3g_alt2(b, L(J, "0"), k3g_seq2(b, D(J, 1, 9), DIGITS(J, 0, 14)));
        k3g_ast *frac = k3g_seq2(b, L(J, "."), k3g_rep(b, L(J, "0"), 1, K3_JSON_FRAC_DIGITS));
        shape = k3g_seq2(b, sign, k3g_alt2(b, k3g_seq2(b, small, k3g_rep(b, frac, 0, 1)), int_canon(J)));
    } else if (mode == NUM_FRAC)
        /* at most 15 significant digits, so that a double still reads a
         * number that is not an integer */
        shape = k3g_seq3(b, sign, k3g_alt2(b, L(J, "0"), k3g_seq2(b, D(J, 1, 9), DIGITS(J, 0, 7))),
                         k3g_seq3(b, L(J, "."), DIGITS(J, 0, 6), D(J, 1, 9)));
    else shape = k3g_seq3(b, sign, int_canon(J), frac_any(J));
    J->int_digits = int_digits;
    k3g_fa cur = {0};
    k3_status st = k3g_ast_dfa(b, shape, &cur, "a number");
    if (st == K3_OK && has_lo) {
        k3g_fa a = {0}, r = {0};
        st = k3g_ast_dfa(b, lower(J, &lo, lo_strict), &a, "a number's minimum");
        if (st == K3_OK) st = k3g_fa_intersect(&cur, &a, &r, "a number range", J->err);
        k3g_fa_free(&a);
        k3g_fa_free(&cur);
        cur = r;
    }
    if (st == K3_OK && has_hi) {
        k3g_fa a = {0}, r = {0};
        st = k3g_ast_dfa(b, upper(J, &hi, hi_strict), &a, "a number's maximum");
        if (st == K3_OK) st = k3g_fa_intersect(&cur, &a, &r, "a number range", J->err);
        k3g_fa_free(&a);
        k3g_fa_free(&cur);
        cur = r;
    }
    json_array_foreach(mults, ix, ev) {
        if (st != K3_OK) break;
        if (!json_is_number(ev)) {
            st = bad(J, "'multipleOf' must be a number%s", "");
            break;
        }
        dec d;
        if (!dec_of(ev, &d) || d.neg || dec_is_zero(&d)) {
            st = bad(J, "'multipleOf' must be a positive number%s", "");
            break;
        }
        k3g_fa a = {0}, r = {0};
        st = multiple_dfa(J, &d, &a);
        if (st == K3_OK) st = k3g_fa_intersect(&cur, &a, &r, "a multipleOf", J->err);
        k3g_fa_free(&a);
        k3g_fa_free(&cur);
        cur = r;
    }
    json_decref(mults);
    if (st != K3_OK) {
        k3g_fa_free(&cur);
        return st;
    }
    *out = cur;
    return K3_OK;
}

/* ---- strings ------------------------------------------------------------------------- */

static k3g_fa *format_dfa(js *J, const char *name) {
    for (size_t i = 0; i < J->n_fmts; i++)
        if (!strcmp(J->fmts[i].name, name)) return J->fmts[i].dfa;
    int fi = k3g_format_index(name);
    if (fi < 0) {
        unsup(J,
              "format '%s' is not supported (supported: date, time, date-time, email, uuid, uri, ipv4, "
              "ipv6, duration, json-pointer)",
              name);
        return NULL;
    }
    k3g_fa d = {0};
    if (k3g_format_dfa(J->b, fi, &d) != K3_OK) return NULL;
    k3g_fa *kept = k3g_keep(J->b, &d);
    if (!kept || !k3g_grow(&J->fmts, &J->cap_fmts, J->n_fmts + 1, sizeof *J->fmts)) {
        nomem(J);
        return NULL;
    }
    J->fmts[J->n_fmts].name = strdup(name);
    if (!J->fmts[J->n_fmts].name) {
        nomem(J);
        return NULL;
    }
    J->fmts[J->n_fmts++].dfa = kept;
    return kept;
}

/* The raw-text DFA of a pattern (search semantics). */
static k3_status pattern_dfa(js *J, const json_t *pat, k3g_fa *out) {
    *out = (k3g_fa){0};
    if (!json_is_string(pat)) return bad(J, "'pattern' must be a string%s", "");
    k3g_ast *a;
    char where[1100];
    snprintf(where, sizeof where, "%s.pattern", J->path);
    K3_TRY(k3g_regex(J->b, json_string_value(pat), json_string_length(pat), true, where, &a));
    return k3g_ast_dfa(J->b, a, out, where);
}

static bool is_format_for_numbers(const char *f) {
    return !strcmp(f, "int32") || !strcmp(f, "int64") || !strcmp(f, "float") || !strcmp(f, "double");
}

/* The raw-text DFA of a string schema's keywords (length, patterns,
 * formats); *plain when only a length applies (no DFA made). */
static k3_status string_raw_dfa(js *J, const json_t *s, k3g_fa *out, bool *plain, int64_t *mn, int64_t *mx) {
    *out = (k3g_fa){0};
    json_t *a = json_object_get(s, "minLength"), *z = json_object_get(s, "maxLength");
    *mn = 0;
    *mx = -1;
    if (a) {
        if (!json_is_integer(a) && !(json_is_real(a) && json_real_value(a) == floor(json_real_value(a))))
            return bad(J, "'minLength' must be a non-negative integer%s", "");
        *mn = count_of(a);
    }
    if (z) {
        if (!json_is_integer(z) && !(json_is_real(z) && json_real_value(z) == floor(json_real_value(z))))
            return bad(J, "'maxLength' must be a non-negative integer%s", "");
        *mx = count_of(z);
        if (*mx < 0) return bad(J, "'maxLength' must be a non-negative integer%s", "");
    }
    if (*mn > K3G_MAX_STRLEN || *mx > K3G_MAX_STRLEN) {
        char what[96];
        snprintf(what, sizeof what, "%s %lld is beyond the supported %d",
                 *mx > K3G_MAX_STRLEN ? "maxLength" : "minLength", (long long)(*mx > K3G_MAX_STRLEN ? *mx : *mn),
                 K3G_MAX_STRLEN);
        return unsup(J, "%s", what);
    }
    json_t *pats = json_array(), *fmts = json_array();
    if (!pats || !fmts) {
        json_decref(pats);
        json_decref(fmts);
        return nomem(J);
    }
    if (json_object_get(s, "pattern")) json_array_append(pats, json_object_get(s, "pattern"));
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(s, K_PATTERNS), i, v) json_array_append(pats, v);
    json_t *f = json_object_get(s, "format");
    if (f && !json_is_string(f)) {
        json_decref(pats);
        json_decref(fmts);
        return bad(J, "'format' must be a string%s", "");
    }
    if (f && !is_format_for_numbers(json_string_value(f))) json_array_append(fmts, f);
    json_array_foreach(json_object_get(s, K_FORMATS), i, v) json_array_append(fmts, v);
    *plain = json_array_size(pats) == 0 && json_array_size(fmts) == 0;
    k3_status st = K3_OK;
    if (!*plain) {
        k3g_fa cur = {0};
        st = k3g_fa_utf8_length(&cur, *mn, *mx, J->err);
        json_array_foreach(pats, i, v) {
            if (st != K3_OK) break;
            k3g_fa p = {0}, r = {0};
            st = pattern_dfa(J, v, &p);
            if (st == K3_OK) st = k3g_fa_intersect(&cur, &p, &r, "a string pattern", J->err);
            k3g_fa_free(&p);
            k3g_fa_free(&cur);
            cur = r;
        }
        json_array_foreach(fmts, i, v) {
            if (st != K3_OK) break;
            k3g_fa *p = format_dfa(J, json_string_value(v));
            k3g_fa r = {0};
            if (!p) st = J->err && J->err->status ? J->err->status : K3_ERR_NOMEM;
            else st = k3g_fa_intersect(&cur, p, &r, "a string format", J->err);
            k3g_fa_free(&cur);
            if (st == K3_OK) cur = r;
        }
        if (st == K3_OK) *out = cur;
    }
    json_decref(pats);
    json_decref(fmts);
    return st;
}

/* A string value of schema s: for ENC_JSON a JSON literal, for ENC_RAW the
 * raw text of a K3 tool-call argument (no "<|close|>" inside). */
static k3g_ast *string_value(js *J, const json_t *s, int enc) {
    k3g_builder *b = J->b;
    /* one format and nothing else: the standard rule of that format */
    const char *f = json_string_value(json_object_get(s, "format"));
    if (enc == ENC_JSON && f && k3g_format_index(f) >= 0 && !json_object_get(s, "pattern") &&
        !json_object_get(s, K_PATTERNS) && !json_object_get(s, K_FORMATS) && !json_object_get(s, "minLength") &&
        !json_object_get(s, "maxLength")) {
        int32_t r = k3g_std_rule(b, (k3g_std)(K3G_STD_FORMAT0 + k3g_format_index(f)));
        return r < 0 ? NULL : k3g_ref(b, r);
    }
    k3g_fa raw = {0};
    bool plain;
    int64_t mn, mx;
    if (string_raw_dfa(J, s, &raw, &plain, &mn, &mx) != K3_OK) return NULL;
    if (plain) {
        if (enc == ENC_JSON) {
            int32_t r = k3g_json_string_rule(b, mn, mx);
            return r < 0 ? NULL : k3g_ref(b, r);
        }
        int32_t r = k3g_raw_string_rule(b, mn, mx);
        return r < 0 ? NULL : k3g_ref(b, r);
    }
    k3g_fa enc_fa = {0};
    k3_status st;
    if (enc == ENC_JSON) {
        st = k3g_fa_json_encode(&raw, &enc_fa, "a string", J->err);
    } else {
        k3g_fa w = {0};
        st = k3g_fa_avoid(&w, "<|close|>", J->err);
        if (st == K3_OK) st = k3g_fa_intersect(&raw, &w, &enc_fa, "a string", J->err);
        k3g_fa_free(&w);
    }
    k3g_fa_free(&raw);
    if (st != K3_OK) return NULL;
    if (enc == ENC_RAW) return k3g_fa_rule(b, &enc_fa, J->path);
    k3g_fa *kept = k3g_keep(b, &enc_fa);
    if (!kept) return NULL;
    return k3g_ast_rule(b, k3g_seq3(b, L(J, "\""), k3g_fa_ast(b, kept), L(J, "\"")), J->path);
}

/* ---- the type set ------------------------------------------------------------------- */

static k3_status type_bits(js *J, const json_t *t, unsigned *out) {
    *out = 0;
    if (!t) {
        *out = T_ALL;
        return K3_OK;
    }
    json_t *one = NULL;
    size_t n = json_is_array(t) ? json_array_size(t) : 1;
    for (size_t i = 0; i < n; i++) {
        one = json_is_array(t) ? json_array_get(t, i) : (json_t *)t;
        const char *s = json_string_value(one);
        if (!s) return bad(J, "'type' must be a string or an array of strings%s", "");
        if (!strcmp(s, "null")) *out |= T_NULL;
        else if (!strcmp(s, "boolean")) *out |= T_BOOL;
        else if (!strcmp(s, "integer")) *out |= T_INT;
        else if (!strcmp(s, "number")) *out |= T_NUM;
        else if (!strcmp(s, "string")) *out |= T_STR;
        else if (!strcmp(s, "array")) *out |= T_ARR;
        else if (!strcmp(s, "object")) *out |= T_OBJ;
        else return bad(J, "'type' names an unknown type '%s'", s);
    }
    return K3_OK;
}

/* The types a schema's "type" (and internal type list, nullable) allows. */
static k3_status schema_types(js *J, const json_t *s, unsigned *out) {
    K3_TRY(type_bits(J, json_object_get(s, "type"), out));
    json_t *it = json_object_get(s, K_TYPES);
    if (it) *out &= (unsigned)json_integer_value(it);
    if (json_is_true(json_object_get(s, "nullable")) && json_object_get(s, "type")) *out |= T_NULL;
    return K3_OK;
}

static unsigned value_type(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_NULL: return T_NULL;
    case JSON_TRUE:
    case JSON_FALSE: return T_BOOL;
    case JSON_INTEGER: return T_INT;
    case JSON_REAL: return json_real_value(v) == floor(json_real_value(v)) ? T_INT : T_FRAC;
    case JSON_STRING: return T_STR;
    case JSON_ARRAY: return T_ARR;
    default: return T_OBJ;
    }
}

/* ---- normalize and merge ------------------------------------------------------------ */

static json_t *normalize(js *J, json_t *s);

static bool json_num_equal(const json_t *a, const json_t *b) {
    if (!json_is_number(a) || !json_is_number(b)) return false;
    dec x, y;
    if (!dec_of(a, &x) || !dec_of(b, &y)) return json_number_value(a) == json_number_value(b);
    return dec_cmp(&x, &y) == 0;
}

/* JSON Schema equality: numbers by value, else structural. */
static bool js_equal(const json_t *a, const json_t *b) {
    if (json_is_number(a) || json_is_number(b)) return json_num_equal(a, b);
    if (json_typeof(a) != json_typeof(b)) return false;
    if (json_is_array(a)) {
        if (json_array_size(a) != json_array_size(b)) return false;
        for (size_t i = 0; i < json_array_size(a); i++)
            if (!js_equal(json_array_get(a, i), json_array_get(b, i))) return false;
        return true;
    }
    if (json_is_object(a)) {
        if (json_object_size(a) != json_object_size(b)) return false;
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)a, k, v) {
            json_t *w = json_object_get(b, k);
            if (!w || !js_equal(v, w)) return false;
        }
        return true;
    }
    return json_equal(a, b);
}

/* The values enum/const allow (a new array), or NULL when neither is given. */
static json_t *values_of(const json_t *s) {
    json_t *e = json_object_get(s, "enum"), *c = json_object_get(s, "const");
    if (!e && !c) return NULL;
    json_t *out = json_array();
    if (!out) return NULL;
    if (e && json_is_array(e)) {
        size_t i;
        json_t *v;
        json_array_foreach(e, i, v) {
            if (c && !js_equal(v, c)) continue;
            json_array_append(out, v);
        }
    } else if (c) {
        json_array_append(out, c);
    }
    return out;
}

/* The schema a property of s must match when it is not listed in
 * properties: its pattern properties' schemas, or additionalProperties
 * (true when absent). A new reference. */
static json_t *addl_for(js *J, const json_t *s, const char *name) {
    json_t *pp = json_object_get(s, "patternProperties");
    json_t *all = json_array();
    if (!all) return NULL;
    const char *k;
    json_t *v;
    json_object_foreach(pp, k, v) {
        k3g_fa d = {0};
        json_t *ks = json_string(k);
        k3_status st = ks ? pattern_dfa(J, ks, &d) : nomem(J);
        json_decref(ks);
        if (st != K3_OK) {
            json_decref(all);
            return NULL;
        }
        if (k3g_fa_accepts(&d, name, strlen(name))) json_array_append(all, v);
        k3g_fa_free(&d);
    }
    if (json_array_size(all) == 0) {
        json_decref(all);
        json_t *ap = json_object_get(s, "additionalProperties");
        if (!ap) return json_true();
        return json_incref(ap);
    }
    if (json_array_size(all) == 1) {
        json_t *one = json_incref(json_array_get(all, 0));
        json_decref(all);
        return one;
    }
    json_t *o = json_object();
    if (o) json_object_set_new(o, "allOf", all);
    else json_decref(all);
    return o;
}

static json_t *all_of2(json_t *a, json_t *b) {
    if (json_is_true(a)) return json_incref(b);
    if (json_is_true(b)) return json_incref(a);
    if (json_is_false(a) || json_is_false(b)) return json_false();
    json_t *o = json_object(), *arr = json_array();
    if (!o || !arr) {
        json_decref(o);
        json_decref(arr);
        return NULL;
    }
    json_array_append(arr, a);
    json_array_append(arr, b);
    json_object_set_new(o, "allOf", arr);
    return o;
}

static void tighten(json_t *out, const json_t *a, const json_t *b, const char *key, bool take_max) {
    json_t *x = json_object_get(a, key), *y = json_object_get(b, key);
    if (!x && !y) return;
    if (!x || !json_is_number(x)) {
        json_object_set(out, key, y);
        return;
    }
    if (!y || !json_is_number(y)) {
        json_object_set(out, key, x);
        return;
    }
    bool first = take_max ? json_number_value(x) >= json_number_value(y) : json_number_value(x) <= json_number_value(y);
    json_object_set(out, key, first ? x : y);
}

static void append_list(json_t *out, const char *key, const json_t *x) {
    json_t *l = json_object_get(out, key);
    if (!l) {
        l = json_array();
        if (!l) return;
        json_object_set_new(out, key, l);
    }
    if (json_is_array(x)) json_array_extend(l, (json_t *)x);
    else json_array_append(l, (json_t *)x);
}

static long long gcdll(long long a, long long b) {
    while (b) {
        long long t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* a and b merged into one schema that means both (both normalized, no
 * $ref/allOf at the top); NULL with err when it cannot be done exactly. */
static json_t *merge(js *J, json_t *a, json_t *b) {
    if (json_is_false(a) || json_is_false(b)) return json_false();
    if (json_is_true(a)) return json_incref(b);
    if (json_is_true(b)) return json_incref(a);
    json_t *o = json_object();
    if (!o) {
        nomem(J);
        return NULL;
    }
    k3_status st = K3_OK;
    /* types */
    unsigned ta, tb;
    st = schema_types(J, a, &ta);
    if (st == K3_OK) st = schema_types(J, b, &tb);
    if (st == K3_OK && (ta & tb) != T_ALL) json_object_set_new(o, K_TYPES, json_integer(ta & tb));
    /* enum / const */
    json_t *va = values_of(a), *vb = values_of(b);
    if (va || vb) {
        json_t *r = json_array();
        if (va && vb) {
            size_t i, j;
            json_t *x, *y;
            json_array_foreach(va, i, x) {
                json_array_foreach(vb, j, y) if (js_equal(x, y)) {
                    json_array_append(r, x);
                    break;
                }
            }
        } else {
            json_array_extend(r, va ? va : vb);
        }
        json_object_set_new(o, "enum", r);
    }
    json_decref(va);
    json_decref(vb);
    /* properties */
    json_t *pa = json_object_get(a, "properties"), *pb = json_object_get(b, "properties");
    if (st == K3_OK && (pa || pb)) {
        json_t *props = json_object();
        const char *k;
        json_t *v;
        json_object_foreach(pa, k, v) {
            json_t *w = json_object_get(pb, k);
            json_t *other = w ? json_incref(w) : addl_for(J, b, k);
            json_t *m = other ? all_of2(v, other) : NULL;
            json_decref(other);
            if (!m) {
                st = J->err && J->err->status ? J->err->status : nomem(J);
                break;
            }
            json_object_set_new(props, k, m);
        }
        json_object_foreach(pb, k, v) {
            if (st != K3_OK) break;
            if (json_object_get(pa, k)) continue;
            json_t *other = addl_for(J, a, k);
            json_t *m = other ? all_of2(other, v) : NULL;
            json_decref(other);
            if (!m) {
                st = J->err && J->err->status ? J->err->status : nomem(J);
                break;
            }
            json_object_set_new(props, k, m);
        }
        json_object_set_new(o, "properties", props);
    }
    /* required */
    json_t *ra = json_object_get(a, "required"), *rb = json_object_get(b, "required");
    if (ra || rb) {
        json_t *r = json_array();
        size_t i;
        json_t *v;
        json_array_foreach(ra, i, v) json_array_append(r, v);
        json_array_foreach(rb, i, v) {
            bool dup = false;
            size_t j;
            json_t *w;
            json_array_foreach(r, j, w) if (json_equal(v, w)) dup = true;
            if (!dup) json_array_append(r, v);
        }
        json_object_set_new(o, "required", r);
    }
    /* additional and pattern properties */
    json_t *aa = json_object_get(a, "additionalProperties"), *ab = json_object_get(b, "additionalProperties");
    json_t *ppa = json_object_get(a, "patternProperties"), *ppb = json_object_get(b, "patternProperties");
    if (st == K3_OK && (ppa || ppb)) {
        bool addl_a = aa && !json_is_true(aa), addl_b = ab && !json_is_true(ab);
        if ((ppa && addl_b) || (ppb && addl_a))
            st = unsup(J,
                       "allOf combining patternProperties with another branch's additionalProperties is "
                       "not supported%s",
                       "");
        json_t *pp = json_object();
        const char *k;
        json_t *v;
        json_object_foreach(ppa, k, v) json_object_set(pp, k, v);
        json_object_foreach(ppb, k, v) {
            json_t *w = json_object_get(pp, k);
            if (w) json_object_set_new(pp, k, all_of2(w, v));
            else json_object_set(pp, k, v);
        }
        json_object_set_new(o, "patternProperties", pp);
    }
    if (aa || ab) json_object_set_new(o, "additionalProperties", all_of2(aa ? aa : json_true(), ab ? ab : json_true()));
    json_t *na = json_object_get(a, "propertyNames"), *nb = json_object_get(b, "propertyNames");
    if (na || nb) json_object_set_new(o, "propertyNames", all_of2(na ? na : json_true(), nb ? nb : json_true()));
    /* arrays */
    json_t *ia = json_object_get(a, "items"), *ib = json_object_get(b, "items");
    json_t *xa = json_object_get(a, "prefixItems"), *xb = json_object_get(b, "prefixItems");
    if (xa || xb) {
        size_t n = json_array_size(xa) > json_array_size(xb) ? json_array_size(xa) : json_array_size(xb);
        json_t *px = json_array();
        for (size_t i = 0; i < n; i++) {
            json_t *x = i < json_array_size(xa) ? json_array_get(xa, i) : ia ? ia : json_true();
            json_t *y = i < json_array_size(xb) ? json_array_get(xb, i) : ib ? ib : json_true();
            json_array_append_new(px, all_of2(x, y));
        }
        json_object_set_new(o, "prefixItems", px);
    }
    if (ia || ib) json_object_set_new(o, "items", all_of2(ia ? ia : json_true(), ib ? ib : json_true()));
    /* bounds */
    tighten(o, a, b, "minimum", true);
    tighten(o, a, b, "exclusiveMinimum", true);
    tighten(o, a, b, "maximum", false);
    tighten(o, a, b, "exclusiveMaximum", false);
    tighten(o, a, b, "minLength", true);
    tighten(o, a, b, "maxLength", false);
    tighten(o, a, b, "minItems", true);
    tighten(o, a, b, "maxItems", false);
    tighten(o, a, b, "minProperties", true);
    tighten(o, a, b, "maxProperties", false);
    /* several patterns, formats, multiples */
    const char *lists[3][2] = {{"pattern", K_PATTERNS}, {"format", K_FORMATS}, {"multipleOf", K_MULTIPLES}};
    for (int l = 0; l < 3; l++) {
        json_t *x = json_object_get(a, lists[l][0]), *y = json_object_get(b, lists[l][0]);
        if (x && y && json_equal(x, y)) y = NULL;
        if (l == 2 && x && y && json_is_integer(x) && json_is_integer(y) && json_integer_value(x) > 0 &&
            json_integer_value(y) > 0) {
            long long p = json_integer_value(x), q = json_integer_value(y);
            long long g = gcdll(p, q);
            if (p / g <= (1ll << 40) / q) {
                json_object_set_new(o, "multipleOf", json_integer(p / g * q));
                x = y = NULL;
            }
        }
        if (x) json_object_set(o, lists[l][0], x);
        if (y) append_list(o, lists[l][1], y);
        json_t *ex = json_object_get(a, lists[l][1]), *ey = json_object_get(b, lists[l][1]);
        if (ex) append_list(o, lists[l][1], ex);
        if (ey) append_list(o, lists[l][1], ey);
    }
    if (json_is_true(json_object_get(a, "uniqueItems")) || json_is_true(json_object_get(b, "uniqueItems")))
        json_object_set_new(o, "uniqueItems", json_true());
    /* anyOf / oneOf: the product of the two sides' branches */
    const char *apps[2] = {"anyOf", "oneOf"};
    for (int k = 0; k < 2 && st == K3_OK; k++) {
        json_t *x = json_object_get(a, apps[k]), *y = json_object_get(b, apps[k]);
        if (x && y) {
            if (json_array_size(x) * json_array_size(y) > 256) {
                st = unsup(J, "allOf of two %s lists this long is not supported", apps[k]);
                break;
            }
            json_t *prod = json_array();
            size_t i, j;
            json_t *u, *w;
            json_array_foreach(x, i, u) json_array_foreach(y, j, w) json_array_append_new(prod, all_of2(u, w));
            json_object_set_new(o, apps[k], prod);
        } else if (x || y) {
            json_object_set(o, apps[k], x ? x : y);
        }
    }
    /* keep the definitions reachable: refs are resolved from the root */
    if (st != K3_OK) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* s without $ref and allOf at the top, with nullable and not{type} folded
 * into the types and draft-4 forms (items as an array, boolean exclusive
 * bounds) made 2020-12 ones. A new reference; NULL with err. */
static json_t *normalize(js *J, json_t *s) {
    if (json_is_boolean(s)) return json_incref(s);
    if (!json_is_object(s)) {
        bad(J, "a schema must be an object or a boolean%s", "");
        return NULL;
    }
    if (++J->norm_depth > 64) {
        J->norm_depth--;
        unsup(J, "$ref / allOf chains deeper than 64 (a cycle?)%s", "");
        return NULL;
    }
    if (check_keywords(J, s) != K3_OK) {
        J->norm_depth--;
        return NULL;
    }
    json_t *ref = json_object_get(s, "$ref"), *all = json_object_get(s, "allOf"), *nt = json_object_get(s, "not");
    json_t *items = json_object_get(s, "items");
    bool draft4_items = json_is_array(items);
    bool bool_excl = json_is_boolean(json_object_get(s, "exclusiveMinimum")) ||
        json_is_boolean(json_object_get(s, "exclusiveMaximum"));
    bool nullable = json_object_get(s, "nullable") != NULL;
    if (!ref && !all && !nt && !draft4_items && !bool_excl && !nullable) {
        J->norm_depth--;
        return json_incref(s);
    }
    json_t *rest = json_copy(s);
    json_t *out = NULL;
    if (!rest) {
        nomem(J);
        goto done;
    }
    json_object_del(rest, "$ref");
    json_object_del(rest, "allOf");
    json_object_del(rest, "not");
    if (nullable) {
        json_object_del(rest, "nullable");
        if (json_is_true(json_object_get(s, "nullable")) && json_object_get(s, "type")) {
            unsigned t;
            if (schema_types(J, s, &t) != K3_OK) goto done;
            json_object_set_new(rest, K_TYPES, json_integer(t));
            json_object_del(rest, "type");
        }
    }
    if (bool_excl) {
        json_t *em = json_object_get(s, "exclusiveMinimum"), *eM = json_object_get(s, "exclusiveMaximum");
        if (json_is_boolean(em)) {
            json_object_del(rest, "exclusiveMinimum");
            if (json_is_true(em) && json_object_get(s, "minimum")) {
                json_object_set(rest, "exclusiveMinimum", json_object_get(s, "minimum"));
                json_object_del(rest, "minimum");
            }
        }
        if (json_is_boolean(eM)) {
            json_object_del(rest, "exclusiveMaximum");
            if (json_is_true(eM) && json_object_get(s, "maximum")) {
                json_object_set(rest, "exclusiveMaximum", json_object_get(s, "maximum"));
                json_object_del(rest, "maximum");
            }
        }
    }
    if (draft4_items) {
        json_object_set(rest, "prefixItems", items);
        json_object_del(rest, "items");
        json_t *ai = json_object_get(s, "additionalItems");
        if (ai) json_object_set(rest, "items", ai);
        json_object_del(rest, "additionalItems");
    } else {
        json_object_del(rest, "additionalItems"); /* ignored without an items array */
    }
    if (nt) {
        /* not: only a type list */
        const char *k;
        json_t *v;
        json_object_foreach(nt, k, v) if (asserts(k) && strcmp(k, "type")) {
            unsup(J, "keyword 'not' is supported only around 'type' (it holds '%s')", k);
            goto done;
        }
        if (!json_is_object(nt)) {
            unsup(J, "keyword 'not' is supported only around 'type'%s", "");
            goto done;
        }
        unsigned t, mine;
        if (type_bits(J, json_object_get(nt, "type"), &t) != K3_OK) goto done;
        if (!json_object_get(nt, "type")) t = T_ALL;
        if (schema_types(J, rest, &mine) != K3_OK) goto done;
        json_object_set_new(rest, K_TYPES, json_integer(mine & ~t & T_ALL));
        json_object_del(rest, "type");
    }
    out = json_incref(rest);
    if (ref) {
        if (!json_is_string(ref)) {
            bad(J, "'$ref' must be a string%s", "");
            json_decref(out);
            out = NULL;
            goto done;
        }
        char tp[1024];
        json_t *t = resolve(J, json_string_value(ref), tp, sizeof tp);
        json_t *nt2 = t ? normalize(J, t) : NULL;
        json_t *m = nt2 ? (has_asserts(out) ? merge(J, nt2, out) : json_incref(nt2)) : NULL;
        json_decref(nt2);
        json_decref(out);
        out = m;
    }
    if (out && all) {
        if (!json_is_array(all) || json_array_size(all) == 0) {
            bad(J, "'allOf' must be a non-empty array%s", "");
            json_decref(out);
            out = NULL;
            goto done;
        }
        size_t i;
        json_t *v;
        json_array_foreach(all, i, v) {
            size_t old = path_push_i(J, "allOf", i);
            json_t *nv = normalize(J, v);
            json_t *m = nv ? merge(J, out, nv) : NULL;
            path_pop(J, old);
            json_decref(nv);
            json_decref(out);
            out = m;
            if (!out) break;
        }
    }
done:
    json_decref(rest);
    J->norm_depth--;
    return out;
}

/* ---- oneOf: disjointness ------------------------------------------------------------- */

static unsigned effective_types(js *J, const json_t *s) {
    if (json_is_false(s)) return 0;
    if (json_is_true(s)) return T_ALL;
    unsigned t = T_ALL;
    if (schema_types(J, s, &t) != K3_OK) return T_ALL;
    json_t *vals = values_of(s);
    if (vals) {
        unsigned vt = 0;
        size_t i;
        json_t *v;
        json_array_foreach(vals, i, v) vt |= value_type(v);
        json_decref(vals);
        t &= vt;
    }
    return t;
}

/* The values a property of an object schema may take, when finite. */
static json_t *prop_values(js *J, const json_t *s, const char *name) {
    json_t *p = json_object_get(json_object_get(s, "properties"), name);
    if (!p) return NULL;
    json_t *n = normalize(J, p);
    if (!n) {
        k3_err_clear(J->err);
        return NULL;
    }
    json_t *v = json_is_object(n) ? values_of(n) : NULL;
    json_decref(n);
    return v;
}

static bool has_required(const json_t *s, const char *name) {
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(s, "required"), i,
                       v) if (json_is_string(v) && !strcmp(json_string_value(v), name)) return true;
    return false;
}

/* Whether s forbids property name (additionalProperties false and neither
 * listed nor matched, or listed as false). */
static bool forbids(const json_t *s, const char *name) {
    json_t *p = json_object_get(json_object_get(s, "properties"), name);
    if (p) return json_is_false(p);
    if (json_object_get(s, "patternProperties")) return false;
    return json_is_false(json_object_get(s, "additionalProperties"));
}

static bool disjoint(js *J, const json_t *a, const json_t *b) {
    unsigned ta = effective_types(J, a), tb = effective_types(J, b);
    if (!(ta & tb)) return true;
    json_t *va = json_is_object(a) ? values_of(a) : NULL, *vb = json_is_object(b) ? values_of(b) : NULL;
    if (va && vb) {
        bool meet = false;
        size_t i, j;
        json_t *x, *y;
        json_array_foreach(va, i, x) json_array_foreach(vb, j, y) if (js_equal(x, y)) meet = true;
        json_decref(va);
        json_decref(vb);
        return !meet;
    }
    json_decref(va);
    json_decref(vb);
    if (!json_is_object(a) || !json_is_object(b)) return false;
    /* only objects in common: a distinguishing property */
    if ((ta & tb) == T_OBJ) {
        const char *k;
        json_t *v;
        json_object_foreach(json_object_get(a, "properties"), k, v) {
            bool ra = has_required(a, k), rb = has_required(b, k);
            if (ra && rb) {
                json_t *pa = prop_values(J, a, k), *pb = prop_values(J, b, k);
                bool meet = !pa || !pb;
                if (pa && pb) {
                    size_t i, j;
                    json_t *x, *y;
                    json_array_foreach(pa, i, x) json_array_foreach(pb, j, y) if (js_equal(x, y)) meet = true;
                }
                json_decref(pa);
                json_decref(pb);
                if (!meet) return true;
            }
        }
        size_t i;
        json_t *r;
        json_array_foreach(json_object_get(a, "required"), i,
                           r) if (json_is_string(r) && forbids(b, json_string_value(r))) return true;
        json_array_foreach(json_object_get(b, "required"), i,
                           r) if (json_is_string(r) && forbids(a, json_string_value(r))) return true;
    }
    return false;
}

/* ---- values ----------------------------------------------------------------------------- */

static k3g_ast *value_of(js *J, json_t *s, unsigned types, int enc);

static k3g_ast *any_of_types(js *J, unsigned types, int enc) {
    k3g_builder *b = J->b;
    int m = J->ws == K3G_WS_FLEX ? 0 : J->ws == K3G_WS_COMPACT ? 1 : 2;
    if (types == T_ALL && enc == ENC_JSON) return k3g_ref(b, k3g_std_rule(b, (k3g_std)(K3G_STD_VALUE_FLEX + 3 * m)));
    k3g_ast *k[7];
    int n = 0;
    if (types & T_NULL) k[n++] = L(J, "null");
    if (types & T_BOOL) k[n++] = k3g_alt2(b, L(J, "true"), L(J, "false"));
    if ((types & T_NUM) == T_NUM) k[n++] = k3g_ref(b, k3g_std_rule(b, K3G_STD_NUMBER));
    else if (types & T_INT) k[n++] = int_any(J);
    else if (types & T_FRAC) {
        k3g_fa d = {0};
        bool none;
        json_t *e = json_object();
        k3_status st = e ? number_dfa(J, e, NUM_FRAC, &d, &none) : nomem(J);
        json_decref(e);
        if (st != K3_OK || !(k[n++] = k3g_fa_rule(b, &d, J->path))) return NULL;
    }
    if (types & T_STR) k[n++] = k3g_ref(b, k3g_std_rule(b, enc == ENC_JSON ? K3G_STD_STRING : K3G_STD_RAW_STRING));
    if (types & T_ARR) k[n++] = k3g_ref(b, k3g_std_rule(b, (k3g_std)(K3G_STD_ARRAY_FLEX + 3 * m)));
    if (types & T_OBJ) k[n++] = k3g_ref(b, k3g_std_rule(b, (k3g_std)(K3G_STD_OBJECT_FLEX + 3 * m)));
    return k3g_alt(b, k, n);
}

/* The literal text of a JSON value (enum/const), in this whitespace mode. */
static k3g_ast *literal(js *J, const json_t *v, int enc) {
    k3g_builder *b = J->b;
    switch (json_typeof(v)) {
    case JSON_NULL: return L(J, "null");
    case JSON_TRUE: return L(J, "true");
    case JSON_FALSE: return L(J, "false");
    case JSON_INTEGER:
    case JSON_REAL: {
        dec d;
        if (!dec_of(v, &d)) {
            unsup(J, "an enum number with too many digits%s", "");
            return NULL;
        }
        k3g_ast *sign = d.neg ? L(J, "-") : dec_is_zero(&d) ? k3g_rep(b, L(J, "-"), 0, 1) : k3g_empty(b);
        k3g_ast *tail;
        if (J->int_canon) tail = d.F[0] ? k3g_seq2(b, L(J, "."), L(J, d.F)) : k3g_empty(b);
        else if (!d.F[0]) tail = k3g_rep(b, k3g_seq2(b, L(J, "."), k3g_rep(b, L(J, "0"), 1, -1)), 0, 1);
        else tail = k3g_seq3(b, L(J, "."), L(J, d.F), k3g_rep(b, L(J, "0"), 0, -1));
        return k3g_seq3(b, sign, L(J, d.I), tail);
    }
    case JSON_STRING: {
        const char *s = json_string_value(v);
        size_t n = json_string_length(v);
        if (enc == ENC_RAW) {
            if (memmem(s, n, "<|close|>", 9)) return k3g_none(b);
            return k3g_lit(b, s, n);
        }
        k3g_fa raw, e;
        if (k3g_ast_dfa(b, k3g_lit(b, s, n), &raw, "an enum string") != K3_OK) return NULL;
        k3_status st = k3g_fa_json_encode(&raw, &e, "an enum string", J->err);
        k3g_fa_free(&raw);
        if (st != K3_OK) return NULL;
        k3g_fa *kept = k3g_keep(b, &e);
        return kept ? k3g_seq3(b, L(J, "\""), k3g_fa_ast(b, kept), L(J, "\"")) : NULL;
    }
    case JSON_ARRAY: {
        size_t n = json_array_size(v);
        if (n == 0) return k3g_seq3(b, L(J, "["), ws(J), L(J, "]"));
        k3g_ast **k = k3g_alloc(&b->arena, (2 * n + 3) * sizeof *k);
        if (!k) return NULL;
        int m = 0;
        k[m++] = k3g_seq2(b, L(J, "["), ws(J));
        for (size_t i = 0; i < n; i++) {
            if (i) k[m++] = sep(J);
            k[m++] = literal(J, json_array_get(v, i), ENC_JSON);
        }
        k[m++] = k3g_seq2(b, ws(J), L(J, "]"));
        return k3g_seq(b, k, m);
    }
    default: {
        size_t n = json_object_size(v);
        if (n == 0) return k3g_seq3(b, L(J, "{"), ws(J), L(J, "}"));
        k3g_ast **k = k3g_alloc(&b->arena, (4 * n + 3) * sizeof *k);
        if (!k) return NULL;
        int m = 0;
        k[m++] = k3g_seq2(b, L(J, "{"), ws(J));
        const char *key;
        json_t *x;
        size_t i = 0;
        json_object_foreach((json_t *)v, key, x) {
            if (i++) k[m++] = sep(J);
            json_t *ks = json_string(key);
            k[m++] = ks ? literal(J, ks, ENC_JSON) : NULL;
            json_decref(ks);
            k[m++] = colon(J);
            k[m++] = literal(J, x, ENC_JSON);
        }
        k[m++] = k3g_seq2(b, ws(J), L(J, "}"));
        return k3g_seq(b, k, m);
    }
    }
}

static bool has_any(const json_t *s, const char *const *keys) {
    for (; *keys; keys++)
        if (json_object_get(s, *keys)) return true;
    return false;
}

static const char *const OBJ_KEYS[] = {"properties",    "required",      "additionalProperties", "patternProperties",
                                       "propertyNames", "minProperties", "maxProperties",        NULL};
static const char *const ARR_KEYS[] = {"items", "prefixItems", "minItems", "maxItems", NULL};

/* Whether enum value v satisfies the schema's other scalar keywords. */
static k3_status value_allowed(js *J, const json_t *s, const json_t *v, unsigned types, bool *ok) {
    *ok = false;
    unsigned t = value_type(v);
    if (!(t & types)) return K3_OK;
    if (t == T_STR) {
        k3g_fa raw = {0};
        bool plain;
        int64_t mn, mx;
        K3_TRY(string_raw_dfa(J, s, &raw, &plain, &mn, &mx));
        const char *str = json_string_value(v);
        size_t n = json_string_length(v);
        if (plain) {
            size_t cps = 0;
            for (size_t i = 0; i < n; i++) cps += ((uint8_t)str[i] & 0xC0) != 0x80;
            *ok = (int64_t)cps >= mn && (mx < 0 || (int64_t)cps <= mx);
        } else {
            *ok = k3g_fa_accepts(&raw, str, n);
            k3g_fa_free(&raw);
        }
        return K3_OK;
    }
    if (t & T_NUM) {
        k3g_fa d = {0};
        bool none;
        K3_TRY(number_dfa(J, s, NUM_ANY, &d, &none));
        if (none) {
            *ok = true;
            return K3_OK;
        }
        dec x;
        char text[900];
        if (!dec_of(v, &x)) return K3_OK;
        dec_text(&x, text, sizeof text);
        *ok = k3g_fa_accepts(&d, text, strlen(text));
        k3g_fa_free(&d);
        return K3_OK;
    }
    if (t == T_OBJ && has_any(s, OBJ_KEYS))
        return unsup(J, "enum/const with object values together with object keywords is not supported%s", "");
    if (t == T_ARR && has_any(s, ARR_KEYS))
        return unsup(J, "enum/const with array values together with array keywords is not supported%s", "");
    *ok = true;
    return K3_OK;
}

/* ---- arrays ---------------------------------------------------------------------------- */

static bool is_nonneg_int(const json_t *v) {
    return (json_is_integer(v) && json_integer_value(v) >= 0) ||
        (json_is_real(v) && json_real_value(v) >= 0 && json_real_value(v) == floor(json_real_value(v)));
}

static k3_status array_rule(js *J, json_t *s, k3g_fa *fa) {
    k3g_builder *b = J->b;
    json_t *prefix = json_object_get(s, "prefixItems"), *items = json_object_get(s, "items");
    json_t *mn_j = json_object_get(s, "minItems"), *mx_j = json_object_get(s, "maxItems");
    if (prefix && !json_is_array(prefix)) return bad(J, "'prefixItems' must be an array%s", "");
    if ((mn_j && !is_nonneg_int(mn_j)) || (mx_j && !is_nonneg_int(mx_j)))
        return bad(J, "'minItems' and 'maxItems' must be non-negative integers%s", "");
    int64_t mn = mn_j ? count_of(mn_j) : 0, mx = mx_j ? count_of(mx_j) : -1;
    int64_t P = (int64_t)json_array_size(prefix);
    bool more = !json_is_false(items);
    /* positions unrolled: up to maxItems, else to the longest fixed part
     * and a loop there */
    int64_t Lmax;
    if (more && mx >= 0) Lmax = mx;
    else if (more) Lmax = P > mn ? P : mn > 1 ? mn : 1;
    else Lmax = mx >= 0 && mx < P ? mx : P;
    if (more && Lmax < P && mx < 0) Lmax = P;
    if (Lmax > K3G_MAX_ITEMS || mn > K3G_MAX_ITEMS) {
        char what[96];
        snprintf(what, sizeof what, "%s %lld is beyond the supported %d", mn > K3G_MAX_ITEMS ? "minItems" : "maxItems",
                 (long long)(mn > K3G_MAX_ITEMS ? mn : Lmax), K3G_MAX_ITEMS);
        return unsup(J, "%s", what);
    }
    bool loop = more && mx < 0;
    /* the item expressions */
    k3g_ast *item_rest = NULL;
    if (more) {
        size_t old = path_push(J, ".items", "");
        item_rest = value_of(J, items ? items : json_true(), T_ALL, ENC_JSON);
        path_pop(J, old);
        if (!item_rest) return J->err->status ? J->err->status : nomem(J);
    }
    k3g_ast **pre = P ? k3g_alloc(&b->arena, (size_t)P * sizeof *pre) : NULL;
    for (int64_t i = 0; i < P && i < Lmax; i++) {
        size_t old = path_push_i(J, "prefixItems", (size_t)i);
        pre[i] = value_of(J, json_array_get(prefix, (size_t)i), T_ALL, ENC_JSON);
        path_pop(J, old);
        if (!pre[i]) return J->err->status ? J->err->status : nomem(J);
    }
    int32_t start = k3g_fa_state(fa), end = k3g_fa_state(fa);
    int32_t *A = malloc(((size_t)Lmax + 1) * sizeof *A);
    if (!A || start < 0 || end < 0) {
        free(A);
        return nomem(J);
    }
    fa->start = start;
    fa->final[end] = 1;
    for (int64_t j = 0; j <= Lmax; j++) A[j] = k3g_fa_state(fa);
    k3_status st = k3g_emit(b, fa, start, A[0], k3g_seq2(b, L(J, "["), ws(J)));
    for (int64_t j = 0; j < Lmax && st == K3_OK; j++) {
        k3g_ast *it = j < P ? pre[j] : item_rest;
        st = k3g_emit(b, fa, A[j], A[j + 1], j ? k3g_seq2(b, sep(J), it) : it);
    }
    if (st == K3_OK && loop) st = k3g_emit(b, fa, A[Lmax], A[Lmax], k3g_seq2(b, sep(J), item_rest));
    k3g_ast *close = k3g_seq2(b, ws(J), L(J, "]"));
    for (int64_t j = mn; j <= Lmax && st == K3_OK; j++) st = k3g_emit(b, fa, A[j], end, close);
    free(A);
    return st;
}

/* ---- objects ----------------------------------------------------------------------------- */

typedef struct prop {
    const char *name;
    json_t *schema; /* owned reference */
    bool required;
} prop;

/* The raw DFA of propertyNames (string keywords only), or *any. */
static k3_status names_dfa(js *J, json_t *pn, k3g_fa *out, bool *any) {
    *any = false;
    *out = (k3g_fa){0};
    if (!pn || json_is_true(pn)) {
        *any = true;
        return K3_OK;
    }
    if (json_is_false(pn)) return K3_OK; /* no names */
    json_t *n = normalize(J, pn);
    if (!n) return J->err->status;
    k3_status st = K3_OK;
    const char *k;
    json_t *v;
    json_object_foreach(n, k, v) {
        if (!asserts(k) || !strcmp(k, K_TYPES) || !strcmp(k, "type")) continue;
        if (strcmp(k, "pattern") && strcmp(k, K_PATTERNS) && strcmp(k, "minLength") && strcmp(k, "maxLength") &&
            strcmp(k, "format") && strcmp(k, K_FORMATS)) {
            st = unsup(J, "propertyNames with keyword '%s' is not supported", k);
            break;
        }
    }
    bool plain = true;
    int64_t mn, mx;
    if (st == K3_OK) st = string_raw_dfa(J, n, out, &plain, &mn, &mx);
    if (st == K3_OK && plain) st = k3g_fa_utf8_length(out, mn, mx, J->err);
    json_decref(n);
    return st;
}

static k3_status object_rule(js *J, json_t *s, k3g_fa *fa) {
    k3g_builder *b = J->b;
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *pp = json_object_get(s, "patternProperties"), *ap = json_object_get(s, "additionalProperties");
    json_t *mn_j = json_object_get(s, "minProperties"), *mx_j = json_object_get(s, "maxProperties");
    if (props && !json_is_object(props)) return bad(J, "'properties' must be an object%s", "");
    if (req && !json_is_array(req)) return bad(J, "'required' must be an array%s", "");
    if (pp && !json_is_object(pp)) return bad(J, "'patternProperties' must be an object%s", "");
    if ((mn_j && !is_nonneg_int(mn_j)) || (mx_j && !is_nonneg_int(mx_j)))
        return bad(J, "'minProperties' and 'maxProperties' must be non-negative integers%s", "");
    int64_t mn = mn_j ? count_of(mn_j) : 0, mx = mx_j ? count_of(mx_j) : -1;
    if (mx > 64 || mn > 64) return unsup(J, "minProperties/maxProperties over 64 are not supported%s", "");
    if (!ap) ap = J->no_extra && props ? json_false() : json_true();
    size_t n_pp = json_object_size(pp);
    if (n_pp > 3) return unsup(J, "more than 3 patternProperties are not supported%s", "");
    k3_status st = K3_OK;
    /* pattern DFAs */
    k3g_fa pdfa[3] = {{0}};
    json_t *pschema[3] = {0};
    {
        const char *k;
        json_t *v;
        size_t i = 0;
        json_object_foreach(pp, k, v) {
            json_t *ks = json_string(k);
            size_t old = path_push(J, ".patternProperties.%s", k);
            st = ks ? pattern_dfa(J, ks, &pdfa[i]) : nomem(J);
            path_pop(J, old);
            json_decref(ks);
            pschema[i++] = v;
            if (st != K3_OK) break;
        }
    }
    k3g_fa names = {0};
    bool names_any;
    if (st == K3_OK) {
        size_t old = path_push(J, ".propertyNames", "");
        st = names_dfa(J, json_object_get(s, "propertyNames"), &names, &names_any);
        path_pop(J, old);
    }
    /* the listed properties in order, then required ones not listed */
    prop *P = NULL;
    size_t np = 0, cap = 0;
    const char *k;
    json_t *v;
    if (st == K3_OK) {
        json_object_foreach(props, k, v) {
            if (!k3g_grow(&P, &cap, np + 1, sizeof *P)) {
                st = nomem(J);
                break;
            }
            P[np++] = (prop){k, json_incref(v), has_required(s, k)};
        }
    }
    size_t ri;
    json_t *rv;
    if (st == K3_OK) json_array_foreach(req, ri, rv) {
            if (!json_is_string(rv)) {
                st = bad(J, "'required' must hold strings%s", "");
                break;
            }
            bool listed = false;
            for (size_t i = 0; i < np; i++)
                if (!strcmp(P[i].name, json_string_value(rv))) listed = true;
            if (listed) continue;
            if (!k3g_grow(&P, &cap, np + 1, sizeof *P)) {
                st = nomem(J);
                break;
            }
            P[np++] = (prop){json_string_value(rv), json_incref(ap), true};
        }
    /* pattern properties also apply to listed names */
    for (size_t i = 0; i < np && st == K3_OK; i++) {
        for (size_t p = 0; p < n_pp; p++) {
            if (!k3g_fa_accepts(&pdfa[p], P[i].name, strlen(P[i].name))) continue;
            json_t *m = all_of2(P[i].schema, pschema[p]);
            json_decref(P[i].schema);
            P[i].schema = m;
        }
        bool name_ok = names_any || k3g_fa_accepts(&names, P[i].name, strlen(P[i].name));
        if (!name_ok) {
            json_decref(P[i].schema);
            P[i].schema = json_false();
        }
    }
    /* build: states N[i][c], c = properties so far (capped) */
    int64_t C = mx >= 0 ? mx : (mn > 1 ? mn : 1);
    int32_t start = k3g_fa_state(fa), end = k3g_fa_state(fa);
    int32_t *N = NULL;
    if (st == K3_OK) {
        N = malloc((np + 1) * (size_t)(C + 1) * sizeof *N);
        if (!N || start < 0 || end < 0) st = nomem(J);
    }
    if (st == K3_OK) {
        fa->start = start;
        fa->final[end] = 1;
        for (size_t i = 0; i <= np; i++)
            for (int64_t c = 0; c <= C; c++) N[i * (size_t)(C + 1) + (size_t)c] = k3g_fa_state(fa);
        st = k3g_emit(b, fa, start, N[0], k3g_seq2(b, L(J, "{"), ws(J)));
    }
#define NS(i, c) N[(size_t)(i) * (size_t)(C + 1) + (size_t)(c)]
    for (size_t i = 0; i < np && st == K3_OK; i++) {
        size_t old = path_push(J, ".properties.%s", P[i].name);
        k3g_ast *val = json_is_false(P[i].schema) ? NULL : value_of(J, P[i].schema, T_ALL, ENC_JSON);
        path_pop(J, old);
        if (!json_is_false(P[i].schema) && !val) {
            st = J->err->status ? J->err->status : nomem(J);
            break;
        }
        json_t *ks = json_string(P[i].name);
        k3g_ast *key = ks ? literal(J, ks, ENC_JSON) : NULL;
        json_decref(ks);
        if (!key) {
            st = J->err->status ? J->err->status : nomem(J);
            break;
        }
        for (int64_t c = 0; c <= C && st == K3_OK; c++) {
            if (!P[i].required) k3g_fa_eps(fa, NS(i, c), NS(i + 1, c));
            if (!val) continue;
            int64_t c2 = c + 1;
            if (mx >= 0 && c2 > mx) continue;
            if (c2 > C) c2 = C;
            k3g_ast *kv = k3g_seq3(b, key, colon(J), val);
            st = k3g_emit(b, fa, NS(i, c), NS(i + 1, c2), c ? k3g_seq2(b, sep(J), kv) : kv);
        }
    }
    /* the other properties: one region per set of matching patterns */
    if (st == K3_OK && (n_pp || !json_is_false(ap))) {
        k3g_fa listed = {0}, notlisted = {0}, base = {0};
        k3g_fa nl = {0};
        int32_t s0 = k3g_fa_state(&nl), s1 = k3g_fa_state(&nl);
        if (s0 >= 0 && s1 >= 0) {
            nl.start = s0;
            nl.final[s1] = 1;
            for (size_t i = 0; i < np; i++) k3g_fa_bytes(&nl, s0, s1, P[i].name, strlen(P[i].name));
        }
        st = k3g_fa_determinize(&nl, &listed, "the property names", J->err);
        k3g_fa_free(&nl);
        if (st == K3_OK) st = k3g_fa_complement(&listed, &notlisted, J->err);
        k3g_fa_free(&listed);
        k3g_fa text = {0};
        if (st == K3_OK) st = k3g_fa_utf8_text(&text, J->err);
        if (st == K3_OK) st = k3g_fa_intersect(&notlisted, &text, &base, "the other property names", J->err);
        k3g_fa_free(&text);
        k3g_fa_free(&notlisted);
        if (st == K3_OK && !names_any) {
            k3g_fa r = {0};
            st = k3g_fa_intersect(&base, &names, &r, "the property names", J->err);
            k3g_fa_free(&base);
            base = r;
        }
        for (unsigned mask = 0; st == K3_OK && mask < (1u << n_pp); mask++) {
            json_t *vs = json_true();
            json_incref(vs);
            k3g_fa key = {0};
            st = k3g_fa_intersect(&base, &base, &key, "a property name", J->err);
            for (size_t p = 0; p < n_pp && st == K3_OK; p++) {
                k3g_fa r = {0}, c = {0};
                if (mask & (1u << p)) {
                    st = k3g_fa_intersect(&key, &pdfa[p], &r, "a property name", J->err);
                    json_t *m = all_of2(vs, pschema[p]);
                    json_decref(vs);
                    vs = m;
                } else {
                    st = k3g_fa_complement(&pdfa[p], &c, J->err);
                    if (st == K3_OK) st = k3g_fa_intersect(&key, &c, &r, "a property name", J->err);
                    k3g_fa_free(&c);
                }
                k3g_fa_free(&key);
                key = r;
            }
            if (st == K3_OK && mask == 0) {
                json_decref(vs);
                vs = json_incref(ap);
            }
            if (st == K3_OK && !k3g_fa_is_empty(&key) && !json_is_false(vs)) {
                k3g_fa ek = {0};
                st = k3g_fa_json_encode(&key, &ek, "a property name", J->err);
                k3g_fa *kept = st == K3_OK ? k3g_keep(b, &ek) : NULL;
                size_t old = path_push(J, mask ? ".patternProperties" : ".additionalProperties", "");
                k3g_ast *kname =
                    kept ? k3g_ast_rule(b, k3g_seq3(b, L(J, "\""), k3g_fa_ast(b, kept), L(J, "\"")), J->path) : NULL;
                k3g_ast *val = kname ? value_of(J, vs, T_ALL, ENC_JSON) : NULL;
                path_pop(J, old);
                if (st == K3_OK && (!kname || !val)) st = J->err->status ? J->err->status : nomem(J);
                k3g_ast *kv = st == K3_OK ? k3g_seq3(b, kname, colon(J), val) : NULL;
                for (int64_t c = 0; c <= C && st == K3_OK; c++) {
                    int64_t c2 = c + 1;
                    if (mx >= 0 && c2 > mx) continue;
                    if (c2 > C) c2 = C;
                    st = k3g_emit(b, fa, NS(np, c), NS(np, c2), c ? k3g_seq2(b, sep(J), kv) : kv);
                }
            }
            k3g_fa_free(&key);
            json_decref(vs);
        }
        k3g_fa_free(&base);
    }
    k3g_ast *close = k3g_seq2(b, ws(J), L(J, "}"));
    for (int64_t c = 0; c <= C && st == K3_OK; c++)
        if (c >= mn) st = k3g_emit(b, fa, NS(np, c), end, close);
#undef NS
    free(N);
    for (size_t i = 0; i < np; i++) json_decref(P[i].schema);
    free(P);
    for (size_t p = 0; p < 3; p++) k3g_fa_free(&pdfa[p]);
    k3g_fa_free(&names);
    return st;
}

/* ---- a schema into a rule ---------------------------------------------------------------- */

static char *memo_key(js *J, const json_t *s, unsigned types, int enc) {
    char *dump = json_dumps(s, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY);
    if (!dump) return NULL;
    size_t n = strlen(dump) + 32;
    char *k = malloc(n);
    if (k) snprintf(k, n, "%u/%d/%d:%s", types, enc, (int)J->ws, dump);
    free(dump);
    return k;
}

static int32_t memo_get(js *J, const char *key) {
    for (size_t i = 0; i < J->n_memo; i++)
        if (!strcmp(J->memo[i].key, key)) return J->memo[i].rule;
    return -1;
}

/* The body of a flat schema (no $ref / allOf / anyOf / oneOf left). */
static k3g_ast *flat(js *J, json_t *s, unsigned types, int enc, bool *is_std_ref) {
    k3g_builder *b = J->b;
    *is_std_ref = false;
    unsigned t;
    if (schema_types(J, s, &t) != K3_OK) return NULL;
    types &= t;
    json_t *vals = values_of(s);
    if (vals) {
        size_t n = json_array_size(vals), m = 0;
        k3g_ast **k = k3g_alloc(&b->arena, (n ? n : 1) * sizeof *k);
        size_t i;
        json_t *v;
        k3_status st = k ? K3_OK : nomem(J);
        json_array_foreach(vals, i, v) {
            if (st != K3_OK) break;
            bool ok;
            st = value_allowed(J, s, v, types, &ok);
            if (st == K3_OK && ok) {
                k[m] = literal(J, v, enc);
                if (!k[m]) st = J->err->status ? J->err->status : nomem(J);
                m++;
            }
        }
        json_decref(vals);
        if (st != K3_OK) return NULL;
        return k3g_alt(b, k, (int32_t)m);
    }
    k3g_ast *k[7];
    int n = 0;
    if (types & T_NULL) k[n++] = L(J, "null");
    if (types & T_BOOL) k[n++] = k3g_alt2(b, L(J, "true"), L(J, "false"));
    if (types & T_NUM) {
        int mode = (types & T_NUM) == T_NUM ? NUM_ANY : (types & T_INT) ? NUM_INT : NUM_FRAC;
        bool int_only = mode == NUM_INT;
        const char *f = json_string_value(json_object_get(s, "format"));
        json_t *ns = s;
        json_t *tmp = NULL;
        if (f && int_only && (!strcmp(f, "int32") || !strcmp(f, "int64"))) {
            /* OpenAPI's integer formats as bounds */
            tmp = json_copy(s);
            json_t *lo = json_object_get(s, "minimum"), *hi = json_object_get(s, "maximum");
            long long a = !strcmp(f, "int32") ? -2147483648ll : INT64_MIN,
                      z = !strcmp(f, "int32") ? 2147483647ll : INT64_MAX;
            if (tmp) {
                if (!lo || (json_is_number(lo) && json_number_value(lo) < (double)a))
                    json_object_set_new(tmp, "minimum", json_integer(a));
                if (!hi || (json_is_number(hi) && json_number_value(hi) > (double)z))
                    json_object_set_new(tmp, "maximum", json_integer(z));
                ns = tmp;
            }
        }
        k3g_fa d = {0};
        bool none;
        k3_status st = number_dfa(J, ns, mode, &d, &none);
        json_decref(tmp);
        if (st != K3_OK) return NULL;
        if (none) {
            k[n++] = int_only ? int_any(J) : k3g_ref(b, k3g_std_rule(b, K3G_STD_NUMBER));
        } else {
            k[n++] = k3g_fa_rule(b, &d, J->path);
            if (!k[n - 1]) return NULL;
        }
    }
    if (types & T_STR) {
        k3g_ast *a = string_value(J, s, enc);
        if (!a) return NULL;
        k[n++] = a;
    }
    if (types & (T_ARR | T_OBJ)) {
        for (int which = 0; which < 2; which++) {
            unsigned bit = which ? T_OBJ : T_ARR;
            if (!(types & bit)) continue;
            if (!has_any(s, which ? OBJ_KEYS : ARR_KEYS)) {
                int m = J->ws == K3G_WS_FLEX ? 0 : J->ws == K3G_WS_COMPACT ? 1 : 2;
                k[n++] =
                    k3g_ref(b, k3g_std_rule(b, (k3g_std)((which ? K3G_STD_OBJECT_FLEX : K3G_STD_ARRAY_FLEX) + 3 * m)));
                continue;
            }
            k3g_fa fa = {0};
            k3_status st = which ? object_rule(J, s, &fa) : array_rule(J, s, &fa);
            if (st != K3_OK) {
                k3g_fa_free(&fa);
                return NULL;
            }
            k3g_fa *kept = k3g_keep(b, &fa);
            if (!kept) return NULL;
            k[n++] = k3g_fa_ast(b, kept);
        }
    }
    if (n == 1 && k[0] && k[0]->kind == K3G_A_SYM) *is_std_ref = true;
    return k3g_alt(b, k, n);
}

/* The body of schema s (normalized inside). */
static k3g_ast *body_of(js *J, json_t *s, unsigned types, int enc, bool *is_std_ref) {
    k3g_builder *b = J->b;
    *is_std_ref = false;
    if (json_is_true(s)) {
        k3g_ast *a = any_of_types(J, types, enc);
        if (a && a->kind == K3G_A_SYM) *is_std_ref = true;
        return a;
    }
    if (json_is_false(s)) return k3g_none(b);
    json_t *n = normalize(J, s);
    if (!n) return NULL;
    if (json_is_boolean(n)) {
        k3g_ast *a = body_of(J, n, types, enc, is_std_ref);
        json_decref(n);
        return a;
    }
    json_t *any = json_object_get(n, "anyOf"), *one = json_object_get(n, "oneOf");
    k3g_ast *out = NULL;
    if (one || any) {
        const char *which = one ? "oneOf" : "anyOf";
        json_t *list = one ? one : any;
        if (!json_is_array(list) || json_array_size(list) == 0) {
            bad(J, "'%s' must be a non-empty array", which);
            json_decref(n);
            return NULL;
        }
        json_t *rest = json_copy(n);
        json_object_del(rest, which);
        bool plain_rest = !has_asserts(rest);
        size_t cnt = json_array_size(list);
        json_t **br = calloc(cnt, sizeof *br);
        k3g_ast **alts = k3g_alloc(&b->arena, cnt * sizeof *alts);
        k3_status st = br && alts && rest ? K3_OK : nomem(J);
        for (size_t i = 0; i < cnt && st == K3_OK; i++) {
            size_t old = path_push_i(J, which, i);
            json_t *bn = normalize(J, json_array_get(list, i));
            br[i] = bn ? (plain_rest ? json_incref(bn) : merge(J, rest, bn)) : NULL;
            json_decref(bn);
            if (!br[i]) st = J->err->status ? J->err->status : nomem(J);
            path_pop(J, old);
        }
        if (st == K3_OK && one) {
            for (size_t i = 0; i < cnt && st == K3_OK; i++)
                for (size_t j = i + 1; j < cnt && st == K3_OK; j++)
                    if (!disjoint(J, br[i], br[j])) {
                        char what[160];
                        snprintf(what, sizeof what,
                                 "oneOf branches %zu and %zu may both match; oneOf is supported "
                                 "only when its branches are provably disjoint (use anyOf)",
                                 i, j);
                        st = unsup(J, "%s", what);
                    }
        }
        for (size_t i = 0; i < cnt && st == K3_OK; i++) {
            size_t old = path_push_i(J, which, i);
            alts[i] = value_of(J, br[i], types, enc);
            path_pop(J, old);
            if (!alts[i]) st = J->err->status ? J->err->status : nomem(J);
        }
        for (size_t i = 0; br && i < cnt; i++) json_decref(br[i]);
        free(br);
        json_decref(rest);
        if (st == K3_OK) out = k3g_alt(b, alts, (int32_t)cnt);
    } else {
        out = flat(J, n, types, enc, is_std_ref);
    }
    json_decref(n);
    return out;
}

static k3g_ast *value_of(js *J, json_t *s, unsigned types, int enc) {
    k3g_builder *b = J->b;
    if (k3g_stopped(J->err, J->path)) return NULL; /* the compile's budget, or the client left */
    if (json_is_true(s) && types == T_ALL && enc == ENC_JSON) return any_of_types(J, types, enc);
    if (json_is_false(s)) return k3g_none(b);
    if (!json_is_object(s) && !json_is_boolean(s)) {
        bad(J, "a schema must be an object or a boolean%s", "");
        return NULL;
    }
    if (++J->depth > 256) {
        J->depth--;
        unsup(J, "schemas nested deeper than 256 are not supported%s", "");
        return NULL;
    }
    char *key = memo_key(J, s, types, enc);
    k3g_ast *out = NULL;
    if (!key) {
        nomem(J);
        goto done;
    }
    int32_t r = memo_get(J, key);
    if (r >= 0) {
        free(key);
        out = k3g_ref(b, r);
        goto done;
    }
    r = k3g_rule(b, J->path);
    if (r < 0 || !k3g_grow(&J->memo, &J->cap_memo, J->n_memo + 1, sizeof *J->memo)) {
        free(key);
        nomem(J);
        goto done;
    }
    J->memo[J->n_memo++] = (memo_e){key, r};
    /* a $ref: its target's path in messages */
    json_t *ref = json_is_object(s) ? json_object_get(s, "$ref") : NULL;
    char saved[1024];
    size_t saved_len = J->plen;
    memcpy(saved, J->path, J->plen + 1);
    if (ref && json_is_string(ref) && json_object_size(s) == 1) {
        char tp[1024];
        json_t *t = resolve(J, json_string_value(ref), tp, sizeof tp);
        if (!t) goto done;
        snprintf(J->path, sizeof J->path, "%s", tp);
        J->plen = strlen(J->path);
    }
    bool std_ref;
    k3g_ast *body = body_of(J, s, types, enc, &std_ref);
    memcpy(J->path, saved, saved_len + 1);
    J->plen = saved_len;
    if (!body) goto done;
    if (k3g_rule_set(b, r, body) != K3_OK) goto done;
    out = std_ref ? body : k3g_ref(b, r);
done:
    J->depth--;
    return out;
}

static void js_free(js *J) {
    for (size_t i = 0; i < J->n_memo; i++) free(J->memo[i].key);
    free(J->memo);
    for (size_t i = 0; i < J->n_fmts; i++) free(J->fmts[i].name);
    free(J->fmts);
    json_decref(J->anchors);
    json_decref(J->root);
}

static k3_status js_open(js *J, k3g_builder *b, const char *text, const char *where, k3g_ws ws, bool no_extra,
                         bool int_canon) {
    *J = (js){.b = b,
              .err = b->err,
              .ws = ws,
              .no_extra = no_extra,
              .int_canon = int_canon,
              .int_digits = K3_JSON_INT_DIGITS};
    snprintf(J->path, sizeof J->path, "%s", where);
    J->plen = strlen(J->path);
    size_t len = strlen(text);
    if (len > K3G_MAX_TEXT)
        return k3_err(b->err, K3_ERR_UNSUPPORTED, "%s: the schema is longer than %d bytes", where, K3G_MAX_TEXT);
    if (k3_json_too_deep(text, len, 128))
        return k3_err(b->err, K3_ERR_UNSUPPORTED, "%s: the schema nests deeper than 128 levels", where);
    json_error_t je;
    J->root = json_loadb(text, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!J->root) return k3_err(b->err, K3_ERR_ARG, "%s: not valid JSON (line %d: %s)", where, je.line, je.text);
    J->anchors = json_object();
    if (!J->anchors) return nomem(J);
    collect_anchors(J, J->root, 0);
    J->root_id = json_is_object(J->root) ? json_string_value(json_object_get(J->root, "$id")) : NULL;
    return K3_OK;
}

k3_status k3g_json_schema(k3g_builder *b, const char *text, const k3g_json_opts *o, int32_t *rule) {
    *rule = -1;
    js J;
    k3_status st = js_open(&J, b, text, o->where ? o->where : "json_schema", o->ws, o->no_extra, o->int_canon);
    if (st == K3_OK) {
        k3g_ast *a = value_of(&J, J.root, T_ALL, ENC_JSON);
        if (!a) st = b->err && b->err->status ? b->err->status : K3_ERR_NOMEM;
        if (st == K3_OK) {
            *rule = k3g_rule(b, "root");
            if (*rule < 0) st = K3_ERR_NOMEM;
            else st = k3g_rule_set(b, *rule, a);
        }
    }
    js_free(&J);
    return st;
}

/* ---- K3 tool-call arguments --------------------------------------------------------------- */

static const char *type_attr(unsigned bit) {
    switch (bit) {
    case T_NULL: return "null";
    case T_BOOL: return "boolean";
    case T_INT:
    case T_NUM: return "number";
    case T_STR: return "string";
    case T_ARR: return "array";
    default: return "object";
    }
}

k3_status k3g_tool_args(k3g_builder *b, const char *params, const char *where, k3g_ast **out) {
    *out = NULL;
    if (!params) {
        *out = k3g_empty(b);
        return *out ? K3_OK : K3_ERR_NOMEM;
    }
    js J;
    k3_status st = js_open(&J, b, params, where, K3G_WS_PY, true, true);
    int32_t open = b->vocab ? k3g_vocab_special(b->vocab, "<|open|>", 8) : -1;
    int32_t sepid = b->vocab ? k3g_vocab_special(b->vocab, "<|sep|>", 7) : -1;
    int32_t close = b->vocab ? k3g_vocab_special(b->vocab, "<|close|>", 9) : -1;
    json_t *n = st == K3_OK ? normalize(&J, J.root) : NULL;
    if (st == K3_OK && !n) st = J.err->status ? J.err->status : K3_ERR_NOMEM;
    /* the argument-tag form: a plain object of properties */
    bool tags = false;
    unsigned types = T_ALL;
    if (st == K3_OK && json_is_object(n)) {
        schema_types(&J, n, &types);
        json_t *ap = json_object_get(n, "additionalProperties");
        tags = (types & T_OBJ) && !json_object_get(n, "anyOf") && !json_object_get(n, "oneOf") &&
            !json_object_get(n, "patternProperties") && !json_object_get(n, "minProperties") &&
            !json_object_get(n, "maxProperties") && !json_object_get(n, "propertyNames") &&
            !json_object_get(n, "enum") && !json_object_get(n, "const") && (!ap || json_is_false(ap));
    } else if (st == K3_OK && json_is_true(n)) {
        tags = true;
    }
    if (st == K3_OK && tags) {
        json_t *props = json_object_get(n, "properties");
        size_t np = json_object_size(props);
        k3g_ast **seq = k3g_alloc(&b->arena, (np + 1) * sizeof *seq);
        if (!seq) st = K3_ERR_NOMEM;
        const char *k;
        json_t *v;
        size_t i = 0;
        json_object_foreach(props, k, v) {
            if (st != K3_OK) break;
            size_t old = path_push(&J, ".properties.%s", k);
            /* one alternative per JSON type the value may have */
            k3g_ast *alts[7];
            int na = 0;
            json_t *nv = normalize(&J, v);
            if (!nv) {
                st = J.err->status ? J.err->status : K3_ERR_NOMEM;
                path_pop(&J, old);
                break;
            }
            unsigned et = effective_types(&J, nv);
            if (json_is_object(nv) && (json_object_get(nv, "anyOf") || json_object_get(nv, "oneOf"))) et = T_ALL;
            json_decref(nv);
            static const unsigned bits[] = {T_STR, T_INT, T_NUM, T_BOOL, T_NULL, T_ARR, T_OBJ};
            for (size_t t = 0; t < sizeof bits / sizeof bits[0] && st == K3_OK; t++) {
                unsigned bit = bits[t];
                /* integers alone, or every number */
                if (bit == T_INT && (et & T_FRAC)) continue;
                if (bit == T_NUM && !(et & T_FRAC)) continue;
                if (!(et & bit)) continue;
                k3g_ast *val = value_of(&J, v, bit, bit == T_STR ? ENC_RAW : ENC_JSON);
                if (!val) {
                    st = J.err->status ? J.err->status : K3_ERR_NOMEM;
                    break;
                }
                k3g_ast *kk[7] = {k3g_special(b, open),       k3g_str(b, K3_FORM_ARGUMENT " " K3_FORM_ATTR_KEY "=\""),
                                  k3g_attr_lit(J.b, k),       k3g_str(b, "\" " K3_FORM_ATTR_TYPE "=\""),
                                  k3g_str(b, type_attr(bit)), k3g_str(b, "\""),
                                  k3g_special(b, sepid)};
                k3g_ast *tail[4] = {k3g_seq(b, kk, 7), val, k3g_special(b, close), k3g_str(b, K3_FORM_ARGUMENT)};
                alts[na++] = k3g_seq2(b, k3g_seq(b, tail, 4), k3g_special(b, sepid));
            }
            path_pop(&J, old);
            if (st != K3_OK) break;
            k3g_ast *arg = k3g_alt(b, alts, na);
            seq[i++] = has_required(n, k) ? arg : k3g_rep(b, arg, 0, 1);
        }
        if (st == K3_OK) *out = k3g_seq(b, seq, (int32_t)i);
    } else if (st == K3_OK) {
        k3g_ast *val = value_of(&J, J.root, T_OBJ, ENC_JSON);
        if (!val) st = J.err->status ? J.err->status : K3_ERR_NOMEM;
        else {
            k3g_ast *kk[6] = {k3g_special(b, open),  k3g_str(b, K3_FORM_JSON " " K3_FORM_ATTR_TYPE "=\"object\""),
                              k3g_special(b, sepid), val,
                              k3g_special(b, close), k3g_str(b, K3_FORM_JSON)};
            *out = k3g_seq2(b, k3g_seq(b, kk, 6), k3g_special(b, sepid));
        }
    }
    if (st == K3_OK && !*out) st = K3_ERR_NOMEM;
    json_decref(n);
    js_free(&J);
    return st;
}
