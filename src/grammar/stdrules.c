/*
 * stdrules.c -- the standard rules: a JSON string (and its tail after the
 * quote), numbers, integers, any JSON value / object / array in each
 * whitespace mode, raw tool-argument text, free text, JSON whitespace, and
 * the supported string formats (as regular expressions).
 *
 * Built by the same code in every grammar and in the vocabulary's standard
 * grammar, so that their DFAs -- and the order of their nodes -- are
 * identical everywhere and their token tables are computed once per
 * vocabulary (grammar.h: the kinds and node roles the tables rely on).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/json_text.h"
#include "grammar/regex.h"
#include "grammar/stdrules.h"

/* ---- JSON whitespace ------------------------------------------------------------- */

k3g_ast *k3g_json_ws(k3g_builder *b, k3g_ws ws) {
    if (ws != K3G_WS_FLEX) return k3g_empty(b);
    k3g_bset s = {{0}};
    k3g_bset_add(&s, ' ');
    k3g_bset_add(&s, '\t');
    k3g_bset_add(&s, '\n');
    k3g_bset_add(&s, '\r');
    return k3g_rep(b, k3g_byteset(b, &s), 0, -1);
}

/* ---- standard rules ----------------------------------------------------------------
 * Built by the same code everywhere, so that their DFAs -- and the order of
 * their nodes -- are identical in every grammar and in the vocabulary's
 * standard grammar. */

/* The inside of a JSON string in the layout both the standard string and
 * the length-limited strings use: node roles, one copy per character. */
enum {
    JS_BODY, /* between characters */
    JS_M0,
    JS_M1,
    JS_M2,
    JS_M3,
    JS_M4,
    JS_M5,
    JS_M6,  /* inside a UTF-8 sequence */
    JS_ESC, /* after a backslash */
    JS_U1,
    JS_U2,
    JS_U3,
    JS_U4, /* after \u and 0..3 hex digits */
    JS_UD, /* after \uD */
    JS_H3,
    JS_H4, /* inside a high surrogate \uD[89AB].. */
    JS_HB,
    JS_HU, /* waiting for the \ and u of the low surrogate */
    JS_L1,
    JS_L2,
    JS_L3,
    JS_L4, /* the low surrogate \uD[C-F].. */
    JS_ROLES
};

static void hex_edges(k3g_fa *fa, int32_t from, int32_t to) {
    k3g_fa_byte(fa, from, to, '0', '9');
    k3g_fa_byte(fa, from, to, 'A', 'F');
    k3g_fa_byte(fa, from, to, 'a', 'f');
}

/* The edges of one JSON string character from s[JS_BODY] to next, through
 * the role states s[1..]. */
static void json_char_edges(k3g_fa *fa, const int32_t *s, int32_t next) {
    int32_t body = s[JS_BODY];
    k3g_fa_byte(fa, body, next, 0x20, 0x21);
    k3g_fa_byte(fa, body, next, 0x23, 0x5B);
    k3g_fa_byte(fa, body, next, 0x5D, 0x7F);
    k3g_fa_byte(fa, body, s[JS_M0], 0xC2, 0xDF);
    k3g_fa_byte(fa, body, s[JS_M3], 0xE0, 0xE0);
    k3g_fa_byte(fa, body, s[JS_M1], 0xE1, 0xEC);
    k3g_fa_byte(fa, body, s[JS_M4], 0xED, 0xED);
    k3g_fa_byte(fa, body, s[JS_M1], 0xEE, 0xEF);
    k3g_fa_byte(fa, body, s[JS_M5], 0xF0, 0xF0);
    k3g_fa_byte(fa, body, s[JS_M2], 0xF1, 0xF3);
    k3g_fa_byte(fa, body, s[JS_M6], 0xF4, 0xF4);
    k3g_fa_byte(fa, s[JS_M0], next, 0x80, 0xBF);
    k3g_fa_byte(fa, s[JS_M1], s[JS_M0], 0x80, 0xBF);
    k3g_fa_byte(fa, s[JS_M2], s[JS_M1], 0x80, 0xBF);
    k3g_fa_byte(fa, s[JS_M3], s[JS_M0], 0xA0, 0xBF);
    k3g_fa_byte(fa, s[JS_M4], s[JS_M0], 0x80, 0x9F);
    k3g_fa_byte(fa, s[JS_M5], s[JS_M1], 0x90, 0xBF);
    k3g_fa_byte(fa, s[JS_M6], s[JS_M1], 0x80, 0x8F);
    k3g_fa_byte(fa, body, s[JS_ESC], '\\', '\\');
    static const char esc[] = "\"\\/bfnrt";
    for (const char *p = esc; *p; p++) k3g_fa_byte(fa, s[JS_ESC], next, (uint8_t)*p, (uint8_t)*p);
    k3g_fa_byte(fa, s[JS_ESC], s[JS_U1], 'u', 'u');
    k3g_fa_byte(fa, s[JS_U1], s[JS_U2], '0', '9');
    k3g_fa_byte(fa, s[JS_U1], s[JS_U2], 'A', 'C');
    k3g_fa_byte(fa, s[JS_U1], s[JS_U2], 'E', 'F');
    k3g_fa_byte(fa, s[JS_U1], s[JS_U2], 'a', 'c');
    k3g_fa_byte(fa, s[JS_U1], s[JS_U2], 'e', 'f');
    k3g_fa_byte(fa, s[JS_U1], s[JS_UD], 'D', 'D');
    k3g_fa_byte(fa, s[JS_U1], s[JS_UD], 'd', 'd');
    hex_edges(fa, s[JS_U2], s[JS_U3]);
    hex_edges(fa, s[JS_U3], s[JS_U4]);
    hex_edges(fa, s[JS_U4], next);
    k3g_fa_byte(fa, s[JS_UD], s[JS_U3], '0', '7');
    k3g_fa_byte(fa, s[JS_UD], s[JS_H3], '8', '9');
    k3g_fa_byte(fa, s[JS_UD], s[JS_H3], 'A', 'B');
    k3g_fa_byte(fa, s[JS_UD], s[JS_H3], 'a', 'b');
    hex_edges(fa, s[JS_H3], s[JS_H4]);
    hex_edges(fa, s[JS_H4], s[JS_HB]);
    k3g_fa_byte(fa, s[JS_HB], s[JS_HU], '\\', '\\');
    k3g_fa_byte(fa, s[JS_HU], s[JS_L1], 'u', 'u');
    k3g_fa_byte(fa, s[JS_L1], s[JS_L2], 'D', 'D');
    k3g_fa_byte(fa, s[JS_L1], s[JS_L2], 'd', 'd');
    k3g_fa_byte(fa, s[JS_L2], s[JS_L3], 'C', 'F');
    k3g_fa_byte(fa, s[JS_L2], s[JS_L3], 'c', 'f');
    hex_edges(fa, s[JS_L3], s[JS_L4]);
    hex_edges(fa, s[JS_L4], next);
}

/* A JSON string with min..max characters (max < 0: no limit) as a DFA:
 * with quote, node 0 reads the opening quote and node 1 is the end; without,
 * node 0 is the end and the start is the first position's body. Then
 * JS_ROLES nodes per character position. With alias != NULL the nodes get
 * the node of the standard string tail (quote = false, no limits) playing
 * the same role, with the characters still allowed (budget) and needed
 * (need) at that position; budget -1 where no token of at most lookahead
 * bytes can reach the limit and none is needed: the tail's own table. */
static k3_status json_string_dfa(k3g_fa *fa, int64_t min, int64_t max, bool quote, int32_t lookahead, int32_t **alias,
                                 int32_t **budget, int32_t **need, k3_error *err) {
    *fa = (k3g_fa){0};
    if (alias) *alias = *budget = *need = NULL;
    if (min < 0) min = 0;
    if (max >= 0 && max < min) return K3_OK;
    if (min > K3G_MAX_REPEAT || max > K3G_MAX_REPEAT)
        return k3_err(err, K3_ERR_UNSUPPORTED, "a string length of %lld is beyond the supported %d",
                      (long long)(max > min ? max : min), K3G_MAX_REPEAT);
    int64_t top = max >= 0 ? max : min; /* positions 0..top */
    int32_t open = quote ? k3g_fa_state(fa) : -1, close = k3g_fa_state(fa);
    int32_t base = quote ? 2 : 1;
    for (int64_t k = 0; k <= top; k++)
        for (int i = 0; i < JS_ROLES; i++) k3g_fa_state(fa);
    if (fa->oom || fa->too_big) {
        k3g_fa_free(fa);
        return k3_err(err, K3_ERR_NOMEM, "out of memory building a string");
    }
    fa->start = quote ? open : base;
    fa->final[close] = 1;
    if (quote) k3g_fa_byte(fa, open, base, '"', '"');
    for (int64_t k = 0; k <= top; k++) {
        int32_t s[JS_ROLES];
        for (int i = 0; i < JS_ROLES; i++) s[i] = (int32_t)(base + k * JS_ROLES + i);
        if (k >= min) k3g_fa_byte(fa, s[JS_BODY], close, '"', '"');
        if (k < top) json_char_edges(fa, s, (int32_t)(base + (k + 1) * JS_ROLES));
        else if (max < 0) json_char_edges(fa, s, s[JS_BODY]);
    }
    int32_t old_n = fa->n;
    int32_t *al = NULL, *bu = NULL, *ne = NULL;
    if (alias) {
        al = malloc((size_t)old_n * sizeof *al);
        bu = malloc((size_t)old_n * sizeof *bu);
        ne = malloc((size_t)old_n * sizeof *ne);
        if (!al || !bu || !ne) {
            free(al);
            free(bu);
            free(ne);
            k3g_fa_free(fa);
            return k3_err(err, K3_ERR_NOMEM, "out of memory building a string");
        }
        if (quote) al[open] = -1, bu[open] = -1, ne[open] = 0;
        al[close] = 0, bu[close] = -1, ne[close] = 0;
        for (int64_t k = 0; k <= top; k++) {
            int32_t n_need = (int32_t)(min > k ? min - k : 0);
            bool far = max < 0 || max - k > lookahead;
            int32_t b = far && !n_need ? -1 : max < 0 ? INT32_MAX : (int32_t)(max - k);
            for (int i = 0; i < JS_ROLES; i++) {
                int32_t at = (int32_t)(base + k * JS_ROLES + i);
                al[at] = 1 + i;
                bu[at] = b;
                ne[at] = n_need;
            }
        }
    }
    /* trim drops the unused role states of the last position; the maps
     * follow the renumbering */
    int32_t *map = malloc((size_t)old_n * sizeof *map);
    bool ok = map && k3g_fa_trim(fa, map);
    if (ok && alias) {
        *alias = malloc(((size_t)fa->n + 1) * sizeof **alias);
        *budget = malloc(((size_t)fa->n + 1) * sizeof **budget);
        *need = malloc(((size_t)fa->n + 1) * sizeof **need);
        ok = *alias && *budget && *need;
        for (int32_t i = 0; ok && i < old_n; i++)
            if (map[i] >= 0) {
                (*alias)[map[i]] = al[i];
                (*budget)[map[i]] = bu[i];
                (*need)[map[i]] = ne[i];
            }
    }
    free(map);
    free(al);
    free(bu);
    free(ne);
    if (!ok) {
        if (alias) {
            free(*alias);
            free(*budget);
            free(*need);
            *alias = *budget = *need = NULL;
        }
        k3g_fa_free(fa);
        return k3_err(err, K3_ERR_NOMEM, "out of memory building a string");
    }
    return K3_OK;
}

/* UTF-8 text of min..max characters without "<|close|>" (a tool-call
 * argument: the argument ends with the special token <|close|>, so the
 * text must not spell it), laid out per character position as 9 boundary
 * roles (how much of "<|close|>" the text ends with) and the 7 roles inside
 * a multi-byte character (which resets that count): position k, role i is
 * node k * 16 + i. Aliases as for json_string_dfa, into the unlimited form
 * (the standard raw string). */
enum { RAW_KMP = 9, RAW_ROLES = 16 };

static k3_status raw_string_dfa(k3g_fa *fa, int64_t min, int64_t max, int32_t lookahead, int32_t **alias,
                                int32_t **budget, int32_t **need, k3_error *err) {
    *fa = (k3g_fa){0};
    if (alias) *alias = *budget = *need = NULL;
    if (min < 0) min = 0;
    if (max >= 0 && max < min) return K3_OK;
    if (min > K3G_MAX_REPEAT || max > K3G_MAX_REPEAT)
        return k3_err(err, K3_ERR_UNSUPPORTED, "a string length of %lld is beyond the supported %d",
                      (long long)(max > min ? max : min), K3G_MAX_REPEAT);
    static const char w[] = "<|close|>";
    int32_t next[RAW_KMP][128]; /* KMP over the ASCII bytes; RAW_KMP = spelled out */
    for (int j = 0; j < RAW_KMP; j++)
        for (int c = 0; c < 128; c++) {
            int k = j;
            while (k > 0 && w[k] != c) {
                /* the failure of "<|close|>": only "<|" prefixes overlap with... none
                 * but the trivial, computed plainly */
                int f = 0;
                for (int l = k - 1; l > 0; l--)
                    if (!memcmp(w, w + k - l, (size_t)l)) {
                        f = l;
                        break;
                    }
                k = f;
            }
            next[j][c] = w[k] == c ? k + 1 : 0;
        }
    int64_t top = max >= 0 ? max : min;
    for (int64_t k = 0; k <= top; k++)
        for (int i = 0; i < RAW_ROLES; i++) k3g_fa_state(fa);
    if (fa->oom || fa->too_big) {
        k3g_fa_free(fa);
        return k3_err(err, K3_ERR_NOMEM, "out of memory building a string");
    }
    fa->start = 0;
    for (int64_t k = 0; k <= top; k++) {
        int32_t at = (int32_t)(k * RAW_ROLES);
        bool last = k == top;
        if (last && max >= 0) {
            for (int j = 0; j < RAW_KMP; j++) fa->final[at + j] = 1;
            continue;
        }
        int32_t to = last ? at : at + RAW_ROLES; /* the next position's roles */
        int32_t m[7];
        for (int i = 0; i < 7; i++) m[i] = at + RAW_KMP + i;
        for (int j = 0; j < RAW_KMP; j++) {
            if (k >= min) fa->final[at + j] = 1;
            for (int c = 0; c < 128;) {
                int z = c;
                while (z + 1 < 128 && next[j][z + 1] == next[j][c]) z++;
                if (next[j][c] < RAW_KMP) k3g_fa_byte(fa, at + j, to + next[j][c], (unsigned)c, (unsigned)z);
                c = z + 1;
            }
            k3g_fa_byte(fa, at + j, m[0], 0xC2, 0xDF);
            k3g_fa_byte(fa, at + j, m[3], 0xE0, 0xE0);
            k3g_fa_byte(fa, at + j, m[1], 0xE1, 0xEC);
            k3g_fa_byte(fa, at + j, m[4], 0xED, 0xED);
            k3g_fa_byte(fa, at + j, m[1], 0xEE, 0xEF);
            k3g_fa_byte(fa, at + j, m[5], 0xF0, 0xF0);
            k3g_fa_byte(fa, at + j, m[2], 0xF1, 0xF3);
            k3g_fa_byte(fa, at + j, m[6], 0xF4, 0xF4);
        }
        k3g_fa_byte(fa, m[0], to, 0x80, 0xBF);
        k3g_fa_byte(fa, m[1], m[0], 0x80, 0xBF);
        k3g_fa_byte(fa, m[2], m[1], 0x80, 0xBF);
        k3g_fa_byte(fa, m[3], m[0], 0xA0, 0xBF);
        k3g_fa_byte(fa, m[4], m[0], 0x80, 0x9F);
        k3g_fa_byte(fa, m[5], m[1], 0x90, 0xBF);
        k3g_fa_byte(fa, m[6], m[1], 0x80, 0x8F);
    }
    int32_t old_n = fa->n;
    int32_t *al = NULL, *bu = NULL, *ne = NULL;
    if (alias) {
        al = malloc((size_t)old_n * sizeof *al);
        bu = malloc((size_t)old_n * sizeof *bu);
        ne = malloc((size_t)old_n * sizeof *ne);
        if (!al || !bu || !ne) {
            free(al);
            free(bu);
            free(ne);
            k3g_fa_free(fa);
            return k3_err(err, K3_ERR_NOMEM, "out of memory building a string");
        }
        for (int64_t k = 0; k <= top; k++) {
            bool far = max < 0 || max - k > lookahead;
            int32_t b = far ? -1 : (int32_t)(max - k);
            for (int i = 0; i < RAW_ROLES; i++) {
                int32_t at = (int32_t)(k * RAW_ROLES + i);
                al[at] = i;
                bu[at] = b;
                ne[at] = 0;
            }
        }
    }
    int32_t *map = malloc((size_t)old_n * sizeof *map);
    bool ok = map && k3g_fa_trim(fa, map);
    if (ok && alias) {
        *alias = malloc(((size_t)fa->n + 1) * sizeof **alias);
        *budget = malloc(((size_t)fa->n + 1) * sizeof **budget);
        *need = malloc(((size_t)fa->n + 1) * sizeof **need);
        ok = *alias && *budget && *need;
        for (int32_t i = 0; ok && i < old_n; i++)
            if (map[i] >= 0) {
                (*alias)[map[i]] = al[i];
                (*budget)[map[i]] = bu[i];
                (*need)[map[i]] = ne[i];
            }
    }
    free(map);
    free(al);
    free(bu);
    free(ne);
    if (!ok) {
        if (alias) {
            free(*alias);
            free(*budget);
            free(*need);
            *alias = *budget = *need = NULL;
        }
        k3g_fa_free(fa);
        return k3_err(err, K3_ERR_NOMEM, "out of memory building a string");
    }
    return K3_OK;
}

static k3_status std_set_ast(k3g_builder *b, int32_t r, k3g_ast *a) {
    if (!a) return k3_err(b->err, K3_ERR_NOMEM, "out of memory building a grammar");
    k3g_fa dfa = {0};
    K3_TRY(k3g_ast_dfa(b, a, &dfa, "a standard rule"));
    return k3g_rule_set_dfa(b, r, &dfa);
}

static k3g_ast *digits(k3g_builder *b, int min, int max) { return k3g_rep(b, k3g_brange(b, '0', '9'), min, max); }

/* 0|[1-9][0-9]*, at most K3_JSON_INT_DIGITS digits (common/json_text.h) */
static k3g_ast *int_part(k3g_builder *b) {
    return k3g_alt2(b, k3g_str(b, "0"), k3g_seq2(b, k3g_brange(b, '1', '9'), digits(b, 0, K3_JSON_INT_DIGITS - 1)));
}

static k3g_ast *opt(k3g_builder *b, k3g_ast *x) { return k3g_rep(b, x, 0, 1); }

static const char *std_name[K3G_STD_FORMAT0] = {
    "string",         "string-tail",   "number",   "integer",   "value",    "object",     "array",    "value-compact",
    "object-compact", "array-compact", "value-py", "object-py", "array-py", "raw-string", "any-text",
};

int32_t k3g_std_rule(k3g_builder *b, k3g_std s) {
    if (b->std_rule[s] >= 0) return b->std_rule[s];
    char fname[48];
    if (s >= K3G_STD_FORMAT0) snprintf(fname, sizeof fname, "format-%s", k3g_formats[s - K3G_STD_FORMAT0]);
    int32_t r = k3g_rule(b, s < K3G_STD_FORMAT0 ? std_name[s] : fname);
    if (r < 0) return -1;
    b->std_rule[s] = r;
    b->rules[r].std = (int16_t)s;
    k3_status st = K3_OK;
    switch (s) {
    case K3G_STD_STRING: {
        int32_t tail = k3g_std_rule(b, K3G_STD_STRING_TAIL);
        if (tail < 0) return -1;
        st = k3g_rule_set(b, r, k3g_seq2(b, k3g_str(b, "\""), k3g_ref(b, tail)));
        break;
    }
    case K3G_STD_STRING_TAIL: {
        k3g_fa fa = {0};
        st = json_string_dfa(&fa, 0, -1, false, 0, NULL, NULL, NULL, b->err);
        if (st == K3_OK) st = k3g_rule_set_dfa(b, r, &fa);
        break;
    }
    case K3G_STD_NUMBER: {
        /* bounded as llama.cpp's json-schema-to-grammar bounds a number
         * (common/json_text.h): a model cannot write digits until max_tokens */
        k3g_ast *frac = opt(b, k3g_seq2(b, k3g_str(b, "."), digits(b, 1, K3_JSON_FRAC_DIGITS)));
        k3g_ast *e = k3g_alt2(b, k3g_str(b, "e"), k3g_str(b, "E"));
        k3g_ast *sign = opt(b, k3g_alt2(b, k3g_str(b, "+"), k3g_str(b, "-")));
        k3g_ast *exp = opt(b, k3g_seq3(b, e, sign, digits(b, 1, K3_JSON_INT_DIGITS)));
        k3g_ast *k[4] = {opt(b, k3g_str(b, "-")), int_part(b), frac, exp};
        st = std_set_ast(b, r, k3g_seq(b, k, 4));
        break;
    }
    case K3G_STD_INTEGER: {
        /* an integer, also with a zero fraction (1.0) up to 15 digits, where a
         * double still holds it exactly: past that, parsers read 1...0.0 as
         * a float that is no longer the integer (or is infinite) */
        k3g_ast *frac = k3g_seq2(b, k3g_str(b, "."), k3g_rep(b, k3g_str(b, "0"), 1, K3_JSON_FRAC_DIGITS));
        k3g_ast *small = k3g_alt2(b, k3g_str(b, "0"),
                                  k3g_seq2(b, k3g_brange(b, '1', '9'), k3g_rep(b, k3g_brange(b, '0', '9'), 0, 14)));
        k3g_ast *body = k3g_alt2(b, k3g_seq2(b, small, opt(b, frac)), int_part(b));
        st = std_set_ast(b, r, k3g_seq2(b, opt(b, k3g_str(b, "-")), body));
        break;
    }
    case K3G_STD_VALUE_FLEX:
    case K3G_STD_VALUE_COMPACT:
    case K3G_STD_VALUE_PY: {
        int m = (s - K3G_STD_VALUE_FLEX) / 3;
        int32_t so = k3g_std_rule(b, K3G_STD_STRING), nu = k3g_std_rule(b, K3G_STD_NUMBER);
        int32_t ob = k3g_std_rule(b, (k3g_std)(K3G_STD_OBJECT_FLEX + 3 * m));
        int32_t ar = k3g_std_rule(b, (k3g_std)(K3G_STD_ARRAY_FLEX + 3 * m));
        if (so < 0 || nu < 0 || ob < 0 || ar < 0) return -1;
        k3g_ast *k[7] = {k3g_ref(b, so),     k3g_ref(b, nu), k3g_str(b, "true"), k3g_str(b, "false"),
                         k3g_str(b, "null"), k3g_ref(b, ob), k3g_ref(b, ar)};
        k3g_ast *a = k3g_alt(b, k, 7);
        if (!a) return -1;
        st = k3g_rule_set(b, r, a);
        break;
    }
    case K3G_STD_OBJECT_FLEX:
    case K3G_STD_OBJECT_COMPACT:
    case K3G_STD_OBJECT_PY:
    case K3G_STD_ARRAY_FLEX:
    case K3G_STD_ARRAY_COMPACT:
    case K3G_STD_ARRAY_PY: {
        bool obj = s == K3G_STD_OBJECT_FLEX || s == K3G_STD_OBJECT_COMPACT || s == K3G_STD_OBJECT_PY;
        int m = obj ? (s - K3G_STD_OBJECT_FLEX) / 3 : (s - K3G_STD_ARRAY_FLEX) / 3;
        k3g_ws ws = m == 0 ? K3G_WS_FLEX : m == 1 ? K3G_WS_COMPACT : K3G_WS_PY;
        int32_t val = k3g_std_rule(b, (k3g_std)(K3G_STD_VALUE_FLEX + 3 * m));
        int32_t so = k3g_std_rule(b, K3G_STD_STRING);
        if (val < 0 || so < 0) return -1;
        const char *sep = ws == K3G_WS_PY ? ", " : ",", *colon = ws == K3G_WS_PY ? ": " : ":";
        k3g_ast *item;
        if (obj) {
            k3g_ast *k[5] = {k3g_ref(b, so), k3g_json_ws(b, ws), k3g_str(b, colon), k3g_json_ws(b, ws),
                             k3g_ref(b, val)};
            item = k3g_seq(b, k, 5);
        } else {
            item = k3g_ref(b, val);
        }
        k3g_ast *more =
            k3g_rep(b, k3g_seq(b, (k3g_ast *[]){k3g_json_ws(b, ws), k3g_str(b, sep), k3g_json_ws(b, ws), item}, 4), 0,
                    -1);
        k3g_ast *k[5] = {k3g_str(b, obj ? "{" : "["), k3g_json_ws(b, ws),
                         opt(b, k3g_seq3(b, item, more, k3g_json_ws(b, ws))), k3g_str(b, obj ? "}" : "]"), NULL};
        k3g_ast *a = k3g_seq(b, k, 4);
        if (!a) return -1;
        st = k3g_rule_set(b, r, a);
        break;
    }
    case K3G_STD_RAW_STRING: {
        k3g_fa d = {0};
        st = raw_string_dfa(&d, 0, -1, 0, NULL, NULL, NULL, b->err);
        if (st == K3_OK) st = k3g_rule_set_dfa(b, r, &d);
        break;
    }
    case K3G_STD_ANY_TEXT: {
        k3g_fa d = {0};
        st = k3g_fa_any_bytes(&d, b->err);
        if (st == K3_OK) st = k3g_rule_set_dfa(b, r, &d);
        break;
    }
    default: {
        /* a format: '"' the format's text, JSON-encoded, '"' */
        k3g_fa raw = {0}, enc = {0};
        st = k3g_format_dfa(b, s - K3G_STD_FORMAT0, &raw);
        if (st == K3_OK) st = k3g_fa_json_encode(&raw, &enc, "a format", b->err);
        k3g_fa_free(&raw);
        if (st == K3_OK) {
            k3g_fa *kf = k3g_keep(b, &enc);
            st = kf ? std_set_ast(b, r, k3g_seq3(b, k3g_str(b, "\""), k3g_fa_ast(b, kf), k3g_str(b, "\"")))
                    : K3_ERR_NOMEM;
        }
        break;
    }
    }
    return st == K3_OK ? r : -1;
}

int32_t k3g_json_string_rule(k3g_builder *b, int64_t min, int64_t max) {
    if (min <= 0 && max < 0) return k3g_std_rule(b, K3G_STD_STRING);
    int32_t r = k3g_rule(b, "string-length");
    if (r < 0) return -1;
    k3g_fa fa = {0};
    int32_t *alias = NULL, *budget = NULL, *need = NULL;
    int32_t look = b->vocab ? b->vocab->max_len + 1 : INT32_MAX / 2;
    if (json_string_dfa(&fa, min, max, true, look, &alias, &budget, &need, b->err) != K3_OK) return -1;
    if (k3g_rule_set_dfa(b, r, &fa) != K3_OK) {
        free(alias);
        free(budget);
        free(need);
        return -1;
    }
    b->rules[r].alias = alias;
    b->rules[r].budget = budget;
    b->rules[r].need = need;
    b->rules[r].alias_std = K3G_STD_STRING_TAIL;
    return r;
}

int32_t k3g_raw_string_rule(k3g_builder *b, int64_t min, int64_t max) {
    if (min <= 0 && max < 0) return k3g_std_rule(b, K3G_STD_RAW_STRING);
    int32_t r = k3g_rule(b, "raw-string-length");
    if (r < 0) return -1;
    k3g_fa fa = {0};
    int32_t *alias = NULL, *budget = NULL, *need = NULL;
    int32_t look = b->vocab ? b->vocab->max_len + 1 : INT32_MAX / 2;
    if (raw_string_dfa(&fa, min, max, look, &alias, &budget, &need, b->err) != K3_OK) return -1;
    if (k3g_rule_set_dfa(b, r, &fa) != K3_OK) {
        free(alias);
        free(budget);
        free(need);
        return -1;
    }
    b->rules[r].alias = alias;
    b->rules[r].budget = budget;
    b->rules[r].need = need;
    b->rules[r].alias_std = K3G_STD_RAW_STRING;
    return r;
}

/* ---- string formats ------------------------------------------------------------- */

static const char *const FORMATS[][2] = {
    {"date",
     "(\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|1\\d|2[0-8])|\\d{4}-(0[13-9]|1[0-2])-(29|30)|\\d{4}-(0[13578]|1[02])-31|"
     "(\\d\\d(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-02-29)"},
    {"time",
     "(([01]\\d|2[0-3]):[0-5]\\d:[0-5]\\d(\\.\\d+)?([Zz]|[+-]([01]\\d|2[0-3]):[0-5]\\d)|23:59:60(\\.\\d+)?([Zz]|[+-]00:"
     "00))"},
    {"date-time", NULL}, /* date [Tt] time */
    {"email",
     "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(\\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@"
     "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"},
    {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
    {"ipv4", "(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)(\\.(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)){3}"},
    {"ipv6", NULL},
    {"uri", NULL},
    {"duration",
     "P(\\d+W|(\\d+Y(\\d+M(\\d+D)?)?|\\d+M(\\d+D)?|\\d+D)(T(\\d+H(\\d+M(\\d+S)?)?|\\d+M(\\d+S)?|\\d+S))?|"
     "T(\\d+H(\\d+M(\\d+S)?)?|\\d+M(\\d+S)?|\\d+S))"},
    {"json-pointer", "(/([^/~]|~[01])*)*"},
};

#define IPV4 "(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)(\\.(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)){3}"
#define H16 "[0-9A-Fa-f]{1,4}"

/* RFC 4291 text forms (RFC 3986 IPv6address) */
static void ipv6_regex(char *out, size_t cap) {
    const char *ls32 = "(" H16 ":" H16 "|" IPV4 ")";
    size_t n = 0;
    n += (size_t)snprintf(out + n, cap - n, "(");
    /* 6(h16:) ls32 */
    n += (size_t)snprintf(out + n, cap - n, "(" H16 ":){6}%s", ls32);
    /* :: 5(h16:) ls32 */
    n += (size_t)snprintf(out + n, cap - n, "|::(" H16 ":){5}%s", ls32);
    /* [h16] :: 4(h16:) ls32 ... */
    static const int after[] = {4, 3, 2, 1, 0};
    for (int k = 0; k < 5; k++) {
        n += (size_t)snprintf(out + n, cap - n, "|((" H16 ":){0,%d}" H16 ")?::", k);
        if (after[k]) n += (size_t)snprintf(out + n, cap - n, "(" H16 ":){%d}", after[k]);
        n += (size_t)snprintf(out + n, cap - n, "%s", ls32);
    }
    n += (size_t)snprintf(out + n, cap - n, "|((" H16 ":){0,5}" H16 ")?::" H16);
    n += (size_t)snprintf(out + n, cap - n, "|((" H16 ":){0,6}" H16 ")?::");
    snprintf(out + n, cap - n, ")");
}

/* RFC 3986 absolute URI */
static void uri_regex(char *out, size_t cap, const char *ipv6) {
    const char *unres = "A-Za-z0-9._~\\-", *sub = "!$&'()*+,;=";
    char pchar[200], seg[260], segnz[260];
    snprintf(pchar, sizeof pchar, "([%s%s:@]|%%[0-9A-Fa-f]{2})", unres, sub);
    snprintf(seg, sizeof seg, "%s*", pchar);
    snprintf(segnz, sizeof segnz, "%s+", pchar);
    snprintf(out, cap,
             "[A-Za-z][A-Za-z0-9+.-]*:"
             "(//(([%s%s:]|%%[0-9A-Fa-f]{2})*@)?(\\[(%s|v[0-9A-Fa-f]+\\.[%s%s:]+)\\]|([%s%s]|%%[0-9A-Fa-f]{2})*)"
             "(:\\d*)?(/%s)*|/(%s(/%s)*)?|%s(/%s)*|)"
             "(\\?([%s%s:@/?]|%%[0-9A-Fa-f]{2})*)?(#([%s%s:@/?]|%%[0-9A-Fa-f]{2})*)?",
             unres, sub, ipv6, unres, sub, unres, sub, seg, segnz, seg, segnz, seg, unres, sub, unres, sub);
}

const char *const k3g_formats[] = {"date", "time", "date-time", "email",        "uuid", "ipv4",
                                   "ipv6", "uri",  "duration",  "json-pointer", NULL};

int k3g_format_index(const char *name) {
    for (int i = 0; k3g_formats[i]; i++)
        if (!strcmp(k3g_formats[i], name)) return i;
    return -1;
}

k3_status k3g_format_dfa(k3g_builder *b, int fi, k3g_fa *out) {
    *out = (k3g_fa){0};
    const char *name = k3g_formats[fi];
    char *buf = malloc(32768), *v6 = malloc(4096);
    if (!buf || !v6) {
        free(buf);
        free(v6);
        return k3_err(b->err, K3_ERR_NOMEM, "out of memory compiling a format");
    }
    const char *re = NULL;
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
        if (!strcmp(FORMATS[i][0], name)) re = FORMATS[i][1];
    if (!strcmp(name, "ipv6")) {
        ipv6_regex(v6, 4096);
        re = v6;
    } else if (!strcmp(name, "uri")) {
        ipv6_regex(v6, 4096);
        uri_regex(buf, 32768, v6);
        re = buf;
    } else if (!strcmp(name, "date-time")) {
        snprintf(buf, 32768, "%s[Tt]%s", FORMATS[0][1], FORMATS[1][1]);
        re = buf;
    }
    k3g_ast *a;
    char where[64];
    snprintf(where, sizeof where, "format %s", name);
    k3_status st = k3g_regex(b, re, strlen(re), false, where, &a);
    if (st == K3_OK) st = k3g_ast_dfa(b, a, out, where);
    free(buf);
    free(v6);
    return st;
}

/* The raw-text DFA of a string format (cached per compile); NULL with err. */
