/*
 * build.c -- the grammar builder: expressions into NFAs, the standard rules
 * every JSON grammar shares, and finalize, which turns a set of rule NFAs
 * into the compiled k3_grammar.
 *
 * Finalize, in order: small regular rules are inlined into the rules that
 * use them (so tokens that cross them are context-free there); every rule
 * is determinized; rules that match nothing are found (a fixpoint) and the
 * references to them removed; rules the root cannot reach are dropped; left
 * recursion (a rule that can reach itself without reading a byte) is an
 * error naming the rule; the rules are laid out as one array of nodes; and
 * the bytes that may follow each rule are computed (the token tables use
 * them to drop impossible uncertain tokens).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "grammar/grammar.h"

/* ---- expressions ------------------------------------------------------------ */

static k3g_ast *node_new(k3g_builder *b, k3g_akind kind) {
    k3g_ast *a = k3g_alloc(&b->arena, sizeof *a);
    if (a) a->kind = kind;
    return a;
}

k3g_ast *k3g_empty(k3g_builder *b) { return node_new(b, K3G_A_EMPTY); }
k3g_ast *k3g_none(k3g_builder *b) { return node_new(b, K3G_A_NONE); }

k3g_ast *k3g_lit(k3g_builder *b, const void *s, size_t n) {
    if (n == 0) return k3g_empty(b);
    k3g_ast *a = node_new(b, K3G_A_BYTES);
    if (!a || n > INT32_MAX) return NULL;
    a->u.bytes = k3g_alloc(&b->arena, n);
    if (!a->u.bytes) return NULL;
    memcpy(a->u.bytes, s, n);
    a->n = (int32_t)n;
    return a;
}

k3g_ast *k3g_str(k3g_builder *b, const char *s) { return k3g_lit(b, s, strlen(s)); }

k3g_ast *k3g_brange(k3g_builder *b, unsigned lo, unsigned hi) {
    k3g_ast *a = node_new(b, K3G_A_BRANGE);
    if (!a) return NULL;
    a->u.r = k3g_alloc(&b->arena, 2 * sizeof *a->u.r);
    if (!a->u.r) return NULL;
    a->u.r[0] = lo;
    a->u.r[1] = hi;
    a->n = 1;
    return a;
}

k3g_ast *k3g_byteset(k3g_builder *b, const k3g_bset *s) {
    uint32_t r[512];
    int32_t n = 0;
    for (unsigned c = 0; c < 256;) {
        if (!k3g_bset_has(s, c)) {
            c++;
            continue;
        }
        unsigned z = c;
        while (z + 1 < 256 && k3g_bset_has(s, z + 1)) z++;
        r[2 * n] = c;
        r[2 * n + 1] = z;
        n++;
        c = z + 1;
    }
    if (n == 0) return k3g_none(b);
    k3g_ast *a = node_new(b, K3G_A_BRANGE);
    if (!a) return NULL;
    a->u.r = k3g_alloc(&b->arena, (size_t)n * 2 * sizeof *a->u.r);
    if (!a->u.r) return NULL;
    memcpy(a->u.r, r, (size_t)n * 2 * sizeof *r);
    a->n = n;
    return a;
}

k3g_ast *k3g_cpset(k3g_builder *b, const uint32_t *ranges, int32_t n) {
    if (n == 0) return k3g_none(b);
    k3g_ast *a = node_new(b, K3G_A_CPSET);
    if (!a) return NULL;
    a->u.r = k3g_alloc(&b->arena, (size_t)n * 2 * sizeof *a->u.r);
    if (!a->u.r) return NULL;
    memcpy(a->u.r, ranges, (size_t)n * 2 * sizeof *ranges);
    a->n = n;
    return a;
}

k3g_ast *k3g_ref(k3g_builder *b, int32_t rule) {
    if (rule < 0) return NULL;
    k3g_ast *a = node_new(b, K3G_A_SYM);
    if (a) a->sym = K3G_SYM_REF(rule);
    return a;
}

k3g_ast *k3g_special(k3g_builder *b, int32_t id) {
    k3g_ast *a = node_new(b, K3G_A_SYM);
    if (a) a->sym = K3G_SYM_SPECIAL(id);
    return a;
}

static k3g_ast *list(k3g_builder *b, k3g_akind kind, k3g_ast *const *kids, int32_t n) {
    for (int32_t i = 0; i < n; i++)
        if (!kids[i]) return NULL;
    if (n == 1) return kids[0];
    if (n == 0) return kind == K3G_A_SEQ ? k3g_empty(b) : k3g_none(b);
    k3g_ast *a = node_new(b, kind);
    if (!a) return NULL;
    a->u.kids = k3g_alloc(&b->arena, (size_t)n * sizeof *a->u.kids);
    if (!a->u.kids) return NULL;
    memcpy(a->u.kids, kids, (size_t)n * sizeof *kids);
    a->n = n;
    return a;
}

k3g_ast *k3g_seq(k3g_builder *b, k3g_ast *const *kids, int32_t n) { return list(b, K3G_A_SEQ, kids, n); }
k3g_ast *k3g_alt(k3g_builder *b, k3g_ast *const *kids, int32_t n) { return list(b, K3G_A_ALT, kids, n); }

k3g_ast *k3g_seq2(k3g_builder *b, k3g_ast *x, k3g_ast *y) {
    k3g_ast *k[2] = {x, y};
    return k3g_seq(b, k, 2);
}

k3g_ast *k3g_seq3(k3g_builder *b, k3g_ast *x, k3g_ast *y, k3g_ast *z) {
    k3g_ast *k[3] = {x, y, z};
    return k3g_seq(b, k, 3);
}

k3g_ast *k3g_alt2(k3g_builder *b, k3g_ast *x, k3g_ast *y) {
    k3g_ast *k[2] = {x, y};
    return k3g_alt(b, k, 2);
}

k3g_ast *k3g_rep(k3g_builder *b, k3g_ast *x, int32_t min, int32_t max) {
    if (!x) return NULL;
    k3g_ast *a = node_new(b, K3G_A_REP);
    if (!a) return NULL;
    a->u.kids = k3g_alloc(&b->arena, sizeof *a->u.kids);
    if (!a->u.kids) return NULL;
    a->u.kids[0] = x;
    a->n = 1;
    a->min = min;
    a->max = max;
    return a;
}

k3g_ast *k3g_fa_ast(k3g_builder *b, const k3g_fa *fa) {
    if (!fa) return NULL;
    k3g_ast *a = node_new(b, K3G_A_FA);
    if (a) a->u.fa = fa;
    return a;
}

/* Automata kept alive until the builder is freed. */
typedef struct k3g_kept {
    struct k3g_kept *next;
    k3g_fa fa;
} kept;

k3g_fa *k3g_keep(k3g_builder *b, k3g_fa *fa) {
    kept *k = malloc(sizeof *k);
    if (!k) {
        k3g_fa_free(fa);
        b->arena.oom = true;
        return NULL;
    }
    k->fa = *fa;
    *fa = (k3g_fa){0};
    k->next = b->kept;
    b->kept = k;
    return &k->fa;
}

k3g_ast *k3g_fa_rule(k3g_builder *b, k3g_fa *dfa, const char *name) {
    int32_t r = k3g_rule(b, name);
    if (r < 0) {
        k3g_fa_free(dfa);
        return NULL;
    }
    k3g_rule_set_dfa(b, r, dfa);
    return k3g_ref(b, r);
}

k3g_ast *k3g_ast_rule(k3g_builder *b, const k3g_ast *a, const char *name) {
    k3g_fa d = {0};
    if (!a || k3g_ast_dfa(b, a, &d, name) != K3_OK) return NULL;
    return k3g_fa_rule(b, &d, name);
}

k3g_ast *k3g_json_ws(k3g_builder *b, k3g_ws ws) {
    if (ws != K3G_WS_FLEX) return k3g_empty(b);
    k3g_bset s = {{0}};
    k3g_bset_add(&s, ' ');
    k3g_bset_add(&s, '\t');
    k3g_bset_add(&s, '\n');
    k3g_bset_add(&s, '\r');
    return k3g_rep(b, k3g_byteset(b, &s), 0, -1);
}

/* ---- emission ------------------------------------------------------------------- */

static k3_status emit_err(k3g_builder *b, k3g_fa *fa) {
    if (fa->too_big)
        return k3_err(b->err, K3_ERR_UNSUPPORTED, "the grammar is too large (over %d automaton states)",
                      K3G_MAX_NFA_STATES);
    return k3_err(b->err, K3_ERR_NOMEM, "out of memory building a grammar");
}

k3_status k3g_emit(k3g_builder *b, k3g_fa *fa, int32_t from, int32_t to, const k3g_ast *a) {
    if (!a || b->arena.oom) return k3_err(b->err, K3_ERR_NOMEM, "out of memory building a grammar");
    if (fa->oom || fa->too_big) return emit_err(b, fa);
    switch (a->kind) {
    case K3G_A_EMPTY: k3g_fa_eps(fa, from, to); break;
    case K3G_A_NONE: break;
    case K3G_A_BYTES: k3g_fa_bytes(fa, from, to, a->u.bytes, (size_t)a->n); break;
    case K3G_A_BRANGE:
        for (int32_t i = 0; i < a->n; i++) k3g_fa_byte(fa, from, to, a->u.r[2 * i], a->u.r[2 * i + 1]);
        break;
    case K3G_A_CPSET:
        for (int32_t i = 0; i < a->n; i++) k3g_fa_utf8(fa, from, to, a->u.r[2 * i], a->u.r[2 * i + 1]);
        break;
    case K3G_A_SYM: k3g_fa_edge(fa, from, to, a->sym, 0, 0); break;
    case K3G_A_SEQ: {
        int32_t cur = from;
        for (int32_t i = 0; i < a->n; i++) {
            int32_t nx = i + 1 == a->n ? to : k3g_fa_state(fa);
            if (nx < 0) return emit_err(b, fa);
            K3_TRY(k3g_emit(b, fa, cur, nx, a->u.kids[i]));
            cur = nx;
        }
        break;
    }
    case K3G_A_ALT:
        for (int32_t i = 0; i < a->n; i++) {
            /* each alternative between fresh states, so a loop inside one
             * cannot connect to another */
            int32_t s = k3g_fa_state(fa), t = k3g_fa_state(fa);
            if (s < 0 || t < 0) return emit_err(b, fa);
            k3g_fa_eps(fa, from, s);
            k3g_fa_eps(fa, t, to);
            K3_TRY(k3g_emit(b, fa, s, t, a->u.kids[i]));
        }
        break;
    case K3G_A_REP: {
        const k3g_ast *x = a->u.kids[0];
        int32_t min = a->min < 0 ? 0 : a->min, max = a->max;
        if (max >= 0 && max < min) break;
        if (min > K3G_MAX_REPEAT || max > K3G_MAX_REPEAT)
            return k3_err(b->err, K3_ERR_UNSUPPORTED, "a repetition count of %d is beyond the supported %d",
                          max > min ? max : min, K3G_MAX_REPEAT);
        int32_t cur = from;
        for (int32_t i = 0; i < min; i++) {
            int32_t nx = k3g_fa_state(fa);
            if (nx < 0) return emit_err(b, fa);
            K3_TRY(k3g_emit(b, fa, cur, nx, x));
            cur = nx;
        }
        if (max < 0) {
            int32_t loop = k3g_fa_state(fa), in = k3g_fa_state(fa);
            if (loop < 0 || in < 0) return emit_err(b, fa);
            k3g_fa_eps(fa, cur, loop);
            k3g_fa_eps(fa, loop, in);
            K3_TRY(k3g_emit(b, fa, in, loop, x));
            k3g_fa_eps(fa, loop, to);
        } else {
            k3g_fa_eps(fa, cur, to);
            for (int32_t i = min; i < max; i++) {
                int32_t nx = k3g_fa_state(fa);
                if (nx < 0) return emit_err(b, fa);
                K3_TRY(k3g_emit(b, fa, cur, nx, x));
                k3g_fa_eps(fa, nx, to);
                cur = nx;
            }
        }
        break;
    }
    case K3G_A_FA: k3g_fa_embed(fa, a->u.fa, from, to); break;
    }
    if (fa->oom || fa->too_big) return emit_err(b, fa);
    return K3_OK;
}

k3_status k3g_ast_dfa(k3g_builder *b, const k3g_ast *ast, k3g_fa *out, const char *what) {
    *out = (k3g_fa){0};
    k3g_fa n = {0};
    int32_t s = k3g_fa_state(&n), t = k3g_fa_state(&n);
    k3_status st = s < 0 || t < 0 ? emit_err(b, &n) : K3_OK;
    if (st == K3_OK) {
        n.start = s;
        n.final[t] = 1;
        st = k3g_emit(b, &n, s, t, ast);
    }
    if (st == K3_OK) st = k3g_fa_determinize(&n, out, what, b->err);
    k3g_fa_free(&n);
    return st;
}

/* ---- the builder ------------------------------------------------------------------ */

void k3g_builder_init(k3g_builder *b, const k3_grammar_vocab *v, k3_error *err) {
    *b = (k3g_builder){.vocab = v, .err = err};
    for (int i = 0; i < K3G_STD_N; i++) b->std_rule[i] = -1;
}

void k3g_builder_free(k3g_builder *b) {
    for (size_t i = 0; i < b->n_rules; i++) {
        free(b->rules[i].name);
        k3g_fa_free(&b->rules[i].fa);
        free(b->rules[i].alias);
        free(b->rules[i].budget);
        free(b->rules[i].need);
    }
    free(b->rules);
    for (kept *k = b->kept, *nx; k; k = nx) {
        nx = k->next;
        k3g_fa_free(&k->fa);
        free(k);
    }
    b->kept = NULL;
    k3g_arena_free(&b->arena);
    b->rules = NULL;
    b->n_rules = b->cap_rules = 0;
}

int32_t k3g_rule(k3g_builder *b, const char *name) {
    if (b->n_rules >= K3G_MAX_RULES) {
        k3_err(b->err, K3_ERR_UNSUPPORTED, "the grammar has too many rules (over %d)", K3G_MAX_RULES);
        return -1;
    }
    if (!k3g_grow(&b->rules, &b->cap_rules, b->n_rules + 1, sizeof *b->rules)) {
        k3_err(b->err, K3_ERR_NOMEM, "out of memory building a grammar");
        return -1;
    }
    k3g_brule *r = &b->rules[b->n_rules];
    *r = (k3g_brule){.std = -1, .alias_std = -1};
    r->name = strdup(name ? name : "");
    if (!r->name) {
        k3_err(b->err, K3_ERR_NOMEM, "out of memory building a grammar");
        return -1;
    }
    return (int32_t)b->n_rules++;
}

k3_status k3g_rule_set(k3g_builder *b, int32_t r, const k3g_ast *ast) {
    k3g_brule *R = &b->rules[r];
    k3g_fa_free(&R->fa);
    int32_t s = k3g_fa_state(&R->fa), t = k3g_fa_state(&R->fa);
    if (s < 0 || t < 0) return emit_err(b, &R->fa);
    R->fa.start = s;
    R->fa.final[t] = 1;
    R->defined = true;
    R->dfa = false;
    return k3g_emit(b, &R->fa, s, t, ast);
}

k3_status k3g_rule_set_dfa(k3g_builder *b, int32_t r, k3g_fa *dfa) {
    k3g_brule *R = &b->rules[r];
    k3g_fa_free(&R->fa);
    R->fa = *dfa;
    *dfa = (k3g_fa){0};
    R->defined = true;
    R->dfa = true;
    return K3_OK;
}

/* ---- standard rules ----------------------------------------------------------------
 * Built by the same code everywhere, so that their DFAs -- and the order of
 * their nodes -- are identical in every grammar and in the vocabulary's
 * standard grammar. */

/* The inside of a JSON string in the layout both the standard string and
 * the length-limited strings use: node roles, one copy per character. */
enum {
    JS_BODY,             /* between characters */
    JS_M0, JS_M1, JS_M2, JS_M3, JS_M4, JS_M5, JS_M6, /* inside a UTF-8 sequence */
    JS_ESC,              /* after a backslash */
    JS_U1, JS_U2, JS_U3, JS_U4, /* after \u and 0..3 hex digits */
    JS_UD,               /* after \uD */
    JS_H3, JS_H4,        /* inside a high surrogate \uD[89AB].. */
    JS_HB, JS_HU,        /* waiting for the \ and u of the low surrogate */
    JS_L1, JS_L2, JS_L3, JS_L4, /* the low surrogate \uD[C-F].. */
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
static k3_status json_string_dfa(k3g_fa *fa, int64_t min, int64_t max, bool quote, int32_t lookahead,
                                 int32_t **alias, int32_t **budget, int32_t **need, k3_error *err) {
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

static k3g_ast *digits(k3g_builder *b, int min) { return k3g_rep(b, k3g_brange(b, '0', '9'), min, -1); }

static k3g_ast *int_part(k3g_builder *b) {
    return k3g_alt2(b, k3g_str(b, "0"), k3g_seq2(b, k3g_brange(b, '1', '9'), digits(b, 0)));
}

static k3g_ast *opt(k3g_builder *b, k3g_ast *x) { return k3g_rep(b, x, 0, 1); }

static const char *std_name[K3G_STD_FORMAT0] = {
    "string", "string-tail", "number", "integer", "value", "object", "array", "value-compact", "object-compact",
    "array-compact", "value-py", "object-py", "array-py", "raw-string", "any-text",
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
        k3g_ast *frac = opt(b, k3g_seq2(b, k3g_str(b, "."), digits(b, 1)));
        k3g_ast *e = k3g_alt2(b, k3g_str(b, "e"), k3g_str(b, "E"));
        k3g_ast *sign = opt(b, k3g_alt2(b, k3g_str(b, "+"), k3g_str(b, "-")));
        k3g_ast *exp = opt(b, k3g_seq3(b, e, sign, digits(b, 1)));
        k3g_ast *k[4] = {opt(b, k3g_str(b, "-")), int_part(b), frac, exp};
        st = std_set_ast(b, r, k3g_seq(b, k, 4));
        break;
    }
    case K3G_STD_INTEGER: {
        /* an integer, also with a zero fraction (1.0) up to 15 digits, where a
         * double still holds it exactly: past that, parsers read 1...0.0 as
         * a float that is no longer the integer (or is infinite) */
        k3g_ast *frac = k3g_seq2(b, k3g_str(b, "."), k3g_rep(b, k3g_str(b, "0"), 1, -1));
        k3g_ast *small = k3g_alt2(b, k3g_str(b, "0"), k3g_seq2(b, k3g_brange(b, '1', '9'),
                                                              k3g_rep(b, k3g_brange(b, '0', '9'), 0, 14)));
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
        k3g_ast *k[7] = {k3g_ref(b, so), k3g_ref(b, nu), k3g_str(b, "true"), k3g_str(b, "false"),
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
            k3g_ast *k[5] = {k3g_ref(b, so), k3g_json_ws(b, ws), k3g_str(b, colon), k3g_json_ws(b, ws), k3g_ref(b, val)};
            item = k3g_seq(b, k, 5);
        } else {
            item = k3g_ref(b, val);
        }
        k3g_ast *more = k3g_rep(b, k3g_seq(b, (k3g_ast *[]){k3g_json_ws(b, ws), k3g_str(b, sep), k3g_json_ws(b, ws), item}, 4),
                                0, -1);
        k3g_ast *k[5] = {k3g_str(b, obj ? "{" : "["), k3g_json_ws(b, ws), opt(b, k3g_seq3(b, item, more, k3g_json_ws(b, ws))),
                         k3g_str(b, obj ? "}" : "]"), NULL};
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
            st = kf ? std_set_ast(b, r, k3g_seq3(b, k3g_str(b, "\""), k3g_fa_ast(b, kf), k3g_str(b, "\""))) : K3_ERR_NOMEM;
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

/* ---- finalize ------------------------------------------------------------------------ */

typedef struct fin {
    k3g_builder *b;
    int32_t n;          /* rules */
    uint8_t *has_ref;   /* the rule's automaton references rules */
    uint8_t *productive, *nullable, *reach;
} fin;

static bool rule_refs(const k3g_fa *fa) {
    for (size_t i = 0; i < fa->ne; i++)
        if (fa->e[i].sym >= 0 && K3G_SYM_IS_REF(fa->e[i].sym)) return true;
    return false;
}

/* Rebuilds rule r's NFA with its references to small regular rules
 * replaced by copies of their DFAs. */
static k3_status inline_refs(fin *F, int32_t r, const uint8_t *inl) {
    k3g_builder *b = F->b;
    k3g_fa *fa = &b->rules[r].fa;
    bool any = false;
    for (size_t i = 0; i < fa->ne && !any; i++) {
        const k3g_fedge *e = &fa->e[i];
        if (e->sym >= 0 && K3G_SYM_IS_REF(e->sym) && inl[K3G_SYM_ARG(e->sym)]) any = true;
    }
    if (!any) return K3_OK;
    k3g_fa t = {0};
    for (int32_t s = 0; s < fa->n; s++) {
        k3g_fa_state(&t);
        if (t.final) t.final[s] = fa->final[s];
    }
    t.start = fa->start;
    for (size_t i = 0; i < fa->ne; i++) {
        k3g_fedge e = fa->e[i];
        if (e.sym >= 0 && K3G_SYM_IS_REF(e.sym) && inl[K3G_SYM_ARG(e.sym)])
            k3g_fa_embed(&t, &b->rules[K3G_SYM_ARG(e.sym)].fa, e.from, e.to);
        else
            k3g_fa_edge(&t, e.from, e.to, e.sym, e.lo, e.hi);
    }
    if (t.oom || t.too_big) {
        k3g_fa_free(&t);
        return emit_err(b, &t);
    }
    k3g_fa_free(fa);
    *fa = t;
    b->rules[r].dfa = false;
    return K3_OK;
}

/* Whether rule r's DFA has a path start -> final over bytes, specials and
 * references to rules in ok[] (only refs when refs_only: nullability). */
static bool has_path(const k3g_fa *fa, const uint8_t *ok, bool refs_only, int32_t *q, uint8_t *seen) {
    if (fa->n == 0) return false;
    memset(seen, 0, (size_t)fa->n);
    size_t qh = 0, qt = 0;
    q[qt++] = fa->start;
    seen[fa->start] = 1;
    while (qh < qt) {
        int32_t s = q[qh++];
        if (fa->final[s]) return true;
        for (int32_t j = fa->first[s]; j < fa->first[s + 1]; j++) {
            const k3g_fedge *e = &fa->e[j];
            bool pass;
            if (e->sym == K3G_BYTE) pass = !refs_only;
            else if (!K3G_SYM_IS_REF(e->sym)) pass = !refs_only;
            else pass = ok[K3G_SYM_ARG(e->sym)] != 0;
            if (pass && !seen[e->to]) {
                seen[e->to] = 1;
                q[qt++] = e->to;
            }
        }
    }
    return false;
}

static k3_status nomem(k3g_builder *b) { return k3_err(b->err, K3_ERR_NOMEM, "out of memory building a grammar"); }

/* Drops the edges of rule r that reference rules outside ok[], then trims
 * (aliases are dropped if the numbering changes). */
static k3_status prune_rule(k3g_builder *b, int32_t r, const uint8_t *ok) {
    k3g_brule *R = &b->rules[r];
    k3g_fa *fa = &R->fa;
    size_t ne = 0;
    for (size_t i = 0; i < fa->ne; i++) {
        k3g_fedge e = fa->e[i];
        if (e.sym >= 0 && K3G_SYM_IS_REF(e.sym) && !ok[K3G_SYM_ARG(e.sym)]) continue;
        fa->e[ne++] = e;
    }
    if (ne == fa->ne) return K3_OK;
    fa->ne = ne;
    free(fa->first);
    fa->first = NULL;
    if (!k3g_fa_trim(fa, NULL)) return nomem(b);
    free(R->alias);
    free(R->budget);
    free(R->need);
    R->alias = R->budget = R->need = NULL;
    return K3_OK;
}

/* Whether a DFA has no cycle (a finite language: literals, enums). Such
 * rules are inlined into the rules that use them; a rule with a loop
 * (strings, numbers) stays a rule of its own, so a walk of its token table
 * stays inside it instead of running on into everything that can follow. */
static bool acyclic(const k3g_fa *fa) {
    if (fa->n == 0) return true;
    uint8_t *color = calloc((size_t)fa->n, 1);
    int32_t *stk = malloc(2 * (size_t)fa->n * sizeof *stk);
    bool ok = color && stk;
    int32_t sp = 0;
    if (ok) {
        stk[sp++] = fa->start;
        stk[sp++] = fa->first[fa->start];
        color[fa->start] = 1;
    }
    while (ok && sp) {
        int32_t s = stk[sp - 2], j = stk[sp - 1];
        if (j < fa->first[s + 1]) {
            stk[sp - 1]++;
            int32_t t = fa->e[j].to;
            if (color[t] == 1) ok = false;
            else if (!color[t]) {
                color[t] = 1;
                stk[sp++] = t;
                stk[sp++] = fa->first[t];
            }
        } else {
            color[s] = 2;
            sp -= 2;
        }
    }
    free(color);
    free(stk);
    return ok;
}

k3_status k3g_finalize(k3g_builder *b, int32_t root, k3_grammar **out) {
    *out = NULL;
    k3_error *err = b->err;
    if (b->arena.oom) return nomem(b);
    int32_t n = (int32_t)b->n_rules;
    if (root < 0 || root >= n) return k3_err(err, K3_ERR_ARG, "the grammar has no root rule");
    for (int32_t r = 0; r < n; r++)
        if (!b->rules[r].defined)
            return k3_err(err, K3_ERR_ARG, "rule '%s' is used but never defined", b->rules[r].name);
    k3_status st = K3_OK;
    size_t nz = b->n_rules;
    uint8_t *inl = calloc(nz, 1), *prod = calloc(nz, 1), *null = calloc(nz, 1);
    uint8_t *reach = calloc(nz, 1);
    int32_t *map = malloc(nz * sizeof *map), *q = NULL;
    uint8_t *seen = NULL;
    size_t max_states = 1;
    k3_grammar *g = NULL;
    if (!inl || !prod || !null || !reach || !map) st = nomem(b);
    fin F = {.b = b, .n = n};

    /* 1. determinize the regular rules, mark the small ones for inlining */
    for (int32_t r = 0; r < n && st == K3_OK; r++) {
        k3g_brule *R = &b->rules[r];
        if (rule_refs(&R->fa)) continue;
        if (!R->dfa) {
            k3g_fa d = {0};
            char what[160];
            snprintf(what, sizeof what, "rule '%.120s'", R->name);
            st = k3g_fa_determinize(&R->fa, &d, what, err);
            if (st != K3_OK) break;
            k3g_fa_free(&R->fa);
            R->fa = d;
            R->dfa = true;
        }
        if (!k3g_fa_index(&R->fa)) {
            st = nomem(b);
            break;
        }
        if (R->std < 0 && r != root && !R->alias && R->fa.n <= 48 && !b->is_std && acyclic(&R->fa)) inl[r] = 1;
    }
    /* 2. inline them and determinize the rest */
    for (int32_t r = 0; r < n && st == K3_OK; r++) {
        k3g_brule *R = &b->rules[r];
        if (R->std >= 0) continue; /* standard rules stay as built everywhere */
        st = inline_refs(&F, r, inl);
        if (st == K3_OK && !R->dfa) {
            k3g_fa d = {0};
            char what[160];
            snprintf(what, sizeof what, "rule '%.120s'", R->name);
            st = k3g_fa_determinize(&R->fa, &d, what, err);
            if (st != K3_OK) break;
            k3g_fa_free(&R->fa);
            R->fa = d;
            R->dfa = true;
        }
    }
    for (int32_t r = 0; r < n && st == K3_OK; r++) {
        k3g_brule *R = &b->rules[r];
        if (!R->dfa) { /* a standard rule given as an NFA */
            k3g_fa d = {0};
            st = k3g_fa_determinize(&R->fa, &d, "a standard rule", err);
            if (st != K3_OK) break;
            k3g_fa_free(&R->fa);
            R->fa = d;
            R->dfa = true;
        }
        if (!k3g_fa_index(&R->fa)) st = nomem(b);
        if ((size_t)R->fa.n > max_states) max_states = (size_t)R->fa.n;
    }
    if (st == K3_OK) {
        q = malloc(max_states * sizeof *q);
        seen = malloc(max_states);
        if (!q || !seen) st = nomem(b);
    }
    /* 3. productive rules (a fixpoint), then prune references to the rest */
    for (bool changed = true; st == K3_OK && changed;) {
        changed = false;
        for (int32_t r = 0; r < n; r++)
            if (!prod[r] && has_path(&b->rules[r].fa, prod, false, q, seen)) prod[r] = changed = true;
    }
    if (st == K3_OK && !prod[root]) st = k3_err(err, K3_ERR_ARG, "the grammar matches nothing");
    for (int32_t r = 0; r < n && st == K3_OK; r++)
        if (prod[r] && !(inl[r] && r != root)) st = prune_rule(b, r, prod);
    /* 4. the rules the root reaches */
    if (st == K3_OK) {
        size_t qh = 0, qt = 0;
        int32_t *rq = map; /* reuse as a queue */
        reach[root] = 1;
        rq[qt++] = root;
        while (qh < qt) {
            const k3g_fa *fa = &b->rules[rq[qh++]].fa;
            for (size_t i = 0; i < fa->ne; i++) {
                int32_t sym = fa->e[i].sym;
                if (sym < 0 || !K3G_SYM_IS_REF(sym)) continue;
                int32_t x = K3G_SYM_ARG(sym);
                if (!reach[x]) {
                    reach[x] = 1;
                    rq[qt++] = x;
                }
            }
        }
        if (b->is_std)
            for (int32_t r = 0; r < n; r++) reach[r] = 1;
    }
    /* 5. nullable rules, then left recursion */
    for (bool changed = true; st == K3_OK && changed;) {
        changed = false;
        for (int32_t r = 0; r < n; r++)
            if (reach[r] && !null[r] && has_path(&b->rules[r].fa, null, true, q, seen)) null[r] = changed = true;
    }
    if (st == K3_OK) {
        /* left edges r -> x: x referenced from a state reachable from r's
         * start through nullable references only; a cycle is an error */
        int32_t *color = calloc((size_t)n, sizeof *color);
        int32_t *stk = malloc(2 * (size_t)n * sizeof *stk);
        int32_t **left = calloc((size_t)n, sizeof *left);
        int32_t *nleft = calloc((size_t)n, sizeof *nleft);
        if (!color || !stk || !left || !nleft) st = nomem(b);
        for (int32_t r = 0; r < n && st == K3_OK; r++) {
            if (!reach[r]) continue;
            const k3g_fa *fa = &b->rules[r].fa;
            if (fa->n == 0) continue;
            memset(seen, 0, (size_t)fa->n);
            size_t qh = 0, qt = 0;
            q[qt++] = fa->start;
            seen[fa->start] = 1;
            size_t cap = 0;
            while (qh < qt && st == K3_OK) {
                int32_t s = q[qh++];
                for (int32_t j = fa->first[s]; j < fa->first[s + 1]; j++) {
                    int32_t sym = fa->e[j].sym;
                    if (sym < 0 || !K3G_SYM_IS_REF(sym)) continue;
                    int32_t x = K3G_SYM_ARG(sym);
                    if (!k3g_grow(&left[r], &cap, (size_t)nleft[r] + 1, sizeof *left[r])) {
                        st = nomem(b);
                        break;
                    }
                    left[r][nleft[r]++] = x;
                    if (null[x] && !seen[fa->e[j].to]) {
                        seen[fa->e[j].to] = 1;
                        q[qt++] = fa->e[j].to;
                    }
                }
            }
        }
        /* iterative DFS: color 1 = on the stack, 2 = done */
        for (int32_t r0 = 0; r0 < n && st == K3_OK; r0++) {
            if (!reach[r0] || color[r0]) continue;
            int32_t sp = 0;
            stk[sp++] = r0;
            stk[sp++] = 0;
            color[r0] = 1;
            while (sp && st == K3_OK) {
                int32_t r = stk[sp - 2], i = stk[sp - 1];
                if (i < nleft[r]) {
                    stk[sp - 1]++;
                    int32_t x = left[r][i];
                    if (color[x] == 1)
                        st = k3_err(err, K3_ERR_ARG, "rule '%s' is left-recursive (it can reach itself "
                                    "without reading anything)", b->rules[x].name);
                    else if (!color[x]) {
                        color[x] = 1;
                        stk[sp++] = x;
                        stk[sp++] = 0;
                    }
                } else {
                    color[r] = 2;
                    sp -= 2;
                }
            }
        }
        for (int32_t r = 0; left && r < n; r++) free(left[r]);
        free(left);
        free(nleft);
        free(color);
        free(stk);
    }
    /* 6. lay out the nodes */
    if (st == K3_OK) {
        g = calloc(1, sizeof *g);
        if (!g) st = nomem(b);
    }
    if (st == K3_OK) {
        int32_t nr = 0;
        for (int32_t r = 0; r < n; r++) map[r] = reach[r] ? nr++ : -1;
        g->n_rules = nr;
        g->vocab = b->vocab;
        g->is_std = b->is_std;
        atomic_init(&g->refs, 1);
        size_t nn = 0, nbe = 0, nre = 0, nse = 0;
        for (int32_t r = 0; r < n; r++) {
            if (!reach[r]) continue;
            const k3g_fa *fa = &b->rules[r].fa;
            nn += (size_t)fa->n;
            for (size_t i = 0; i < fa->ne; i++) {
                if (fa->e[i].sym == K3G_BYTE) nbe++;
                else if (K3G_SYM_IS_REF(fa->e[i].sym)) nre++;
                else nse++;
            }
        }
        if (nn > K3G_MAX_NODES)
            st = k3_err(err, K3_ERR_UNSUPPORTED, "the grammar is too large (%zu nodes; the limit is %d)", nn,
                        K3G_MAX_NODES);
        if (st == K3_OK) {
            g->n_nodes = (int32_t)nn;
            g->nodes = calloc(nn ? nn : 1, sizeof *g->nodes);
            g->bedges = malloc((nbe ? nbe : 1) * sizeof *g->bedges);
            g->redges = malloc((nre ? nre : 1) * sizeof *g->redges);
            g->sedges = malloc((nse ? nse : 1) * sizeof *g->sedges);
            g->rule_start = malloc((size_t)nr * sizeof *g->rule_start);
            g->rule_first = malloc((size_t)nr * sizeof *g->rule_first);
            g->rule_n = malloc((size_t)nr * sizeof *g->rule_n);
            g->rule_std = malloc((size_t)nr * sizeof *g->rule_std);
            g->rule_name = calloc((size_t)nr, sizeof *g->rule_name);
            g->follow = calloc((size_t)nr, sizeof *g->follow);
            g->entries = calloc(nn ? nn : 1, sizeof *g->entries);
            bool any_budget = false;
            for (int32_t r = 0; r < n; r++)
                if (reach[r] && b->rules[r].budget) any_budget = true;
            if (any_budget) {
                g->budget = malloc((nn ? nn : 1) * sizeof *g->budget);
                g->need = malloc((nn ? nn : 1) * sizeof *g->need);
                if (!g->budget || !g->need) st = nomem(b);
                for (size_t i = 0; g->budget && i < nn; i++) g->budget[i] = -1;
            }
            if (!g->nodes || !g->bedges || !g->redges || !g->sedges || !g->rule_start || !g->rule_first ||
                !g->rule_n || !g->rule_std || !g->rule_name || !g->follow || !g->entries)
                st = nomem(b);
        }
        int32_t base = 0;
        for (int32_t r = 0; r < n && st == K3_OK; r++) {
            if (!reach[r]) continue;
            k3g_brule *R = &b->rules[r];
            const k3g_fa *fa = &R->fa;
            int32_t gr = map[r];
            g->rule_first[gr] = base;
            g->rule_n[gr] = fa->n;
            g->rule_start[gr] = base + fa->start;
            g->rule_std[gr] = R->std;
            g->rule_name[gr] = R->name;
            R->name = NULL;
            const k3_grammar_vocab *v = b->vocab;
            bool std_ok = R->std >= 0 && !b->is_std && v && v->std && v->std_n[R->std] == fa->n;
            bool alias_ok = R->alias && !b->is_std && v && v->std && R->alias_std >= 0 &&
                            v->std_n[R->alias_std] > 0;
            for (int32_t s = 0; s < fa->n; s++) {
                k3g_node *nd = &g->nodes[base + s];
                nd->rule = (uint32_t)gr;
                nd->final = fa->final[s];
                nd->key = base + s;
                if (std_ok) nd->key = -1 - (v->std_first[R->std] + s);
                else if (alias_ok && R->alias[s] >= 0 && R->alias[s] < v->std_n[R->alias_std]) {
                    nd->key = -1 - (v->std_first[R->alias_std] + R->alias[s]);
                    if (g->budget && R->budget) {
                        g->budget[base + s] = R->budget[s];
                        g->need[base + s] = R->need[s];
                    }
                }
                nd->b0 = g->n_bedges;
                nd->r0 = g->n_redges;
                nd->s0 = g->n_sedges;
                for (int32_t j = fa->first[s]; j < fa->first[s + 1]; j++) {
                    const k3g_fedge *e = &fa->e[j];
                    if (e->sym == K3G_BYTE) {
                        g->bedges[g->n_bedges++] = (k3g_bedge){e->lo, e->hi, (uint32_t)(base + e->to)};
                        nd->nb++;
                    } else if (K3G_SYM_IS_REF(e->sym)) {
                        g->redges[g->n_redges++] = (k3g_redge){(uint32_t)map[K3G_SYM_ARG(e->sym)],
                                                               (uint32_t)(base + e->to)};
                        nd->nr++;
                    } else {
                        g->sedges[g->n_sedges++] = (k3g_sedge){K3G_SYM_ARG(e->sym), (uint32_t)(base + e->to)};
                        nd->ns++;
                    }
                }
            }
            base += fa->n;
        }
        if (st == K3_OK) g->root = map[root];
    }
    /* 7. follow sets: the bytes that may come right after each rule */
    if (st == K3_OK) {
        int32_t nn = g->n_nodes;
        k3g_bset *first = calloc(nn ? (size_t)nn : 1, sizeof *first);
        uint8_t *ends = calloc(nn ? (size_t)nn : 1, 1), *rnull = calloc((size_t)g->n_rules, 1);
        if (!first || !ends || !rnull) st = nomem(b);
        for (int32_t r = 0; r < n && st == K3_OK; r++)
            if (reach[r]) rnull[map[r]] = null[r];
        for (int32_t i = 0; i < nn && st == K3_OK; i++) {
            const k3g_node *nd = &g->nodes[i];
            for (uint32_t j = 0; j < nd->nb; j++) {
                const k3g_bedge *e = &g->bedges[nd->b0 + j];
                k3g_bset_range(&first[i], e->lo, e->hi);
            }
            ends[i] = nd->final;
        }
        for (bool changed = true; st == K3_OK && changed;) {
            changed = false;
            for (int32_t i = nn - 1; i >= 0; i--) {
                const k3g_node *nd = &g->nodes[i];
                for (uint32_t j = 0; j < nd->nr; j++) {
                    const k3g_redge *e = &g->redges[nd->r0 + j];
                    const k3g_bset *f = &first[g->rule_start[e->rule]];
                    for (int w = 0; w < 4; w++) {
                        uint64_t add = f->w[w] | (rnull[e->rule] ? first[e->to].w[w] : 0);
                        if (add & ~first[i].w[w]) {
                            first[i].w[w] |= add;
                            changed = true;
                        }
                    }
                    if (rnull[e->rule] && ends[e->to] && !ends[i]) ends[i] = changed = 1;
                }
            }
        }
        for (bool changed = true; st == K3_OK && changed;) {
            changed = false;
            for (int32_t i = 0; i < nn; i++) {
                const k3g_node *nd = &g->nodes[i];
                for (uint32_t j = 0; j < nd->nr; j++) {
                    const k3g_redge *e = &g->redges[nd->r0 + j];
                    k3g_bset *fo = &g->follow[e->rule];
                    for (int w = 0; w < 4; w++) {
                        uint64_t add = first[e->to].w[w] | (ends[e->to] ? g->follow[nd->rule].w[w] : 0);
                        if (add & ~fo->w[w]) {
                            fo->w[w] |= add;
                            changed = true;
                        }
                    }
                }
            }
        }
        free(first);
        free(ends);
        free(rnull);
    }
    if (st == K3_OK && pthread_mutex_init(&g->mu, NULL) != 0) st = nomem(b);
    free(inl);
    free(prod);
    free(null);
    free(reach);
    free(map);
    free(q);
    free(seen);
    if (st != K3_OK) {
        if (g) {
            for (int32_t r = 0; g->rule_name && r < g->n_rules; r++) free(g->rule_name[r]);
            free(g->rule_name);
            free(g->nodes);
            free(g->bedges);
            free(g->redges);
            free(g->sedges);
            free(g->rule_start);
            free(g->rule_first);
            free(g->rule_n);
            free(g->rule_std);
            free(g->follow);
            free(g->entries);
            free(g->budget);
            free(g->need);
            free(g);
        }
        return st;
    }
    *out = g;
    return K3_OK;
}

void k3g_grammar_destroy(k3_grammar *g) {
    if (!g) return;
    for (int32_t i = 0; i < g->n_nodes; i++) k3g_entry_free(atomic_load(&g->entries[i]));
    k3g_ldfa_free(g->ldfa);
    pthread_mutex_destroy(&g->mu);
    for (int32_t r = 0; r < g->n_rules; r++) free(g->rule_name[r]);
    free(g->rule_name);
    free(g->nodes);
    free(g->bedges);
    free(g->redges);
    free(g->sedges);
    free(g->rule_start);
    free(g->rule_first);
    free(g->rule_n);
    free(g->rule_std);
    free(g->follow);
    free(g->entries);
    free(g->budget);
    free(g->need);
    free(g);
}
