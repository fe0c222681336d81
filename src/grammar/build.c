/*
 * build.c -- the grammar builder: expressions into NFAs, and finalize,
 * which turns a set of rule NFAs into the compiled k3_grammar (and the
 * grammar's destroy, which frees its token tables through walk.h). The
 * standard rules every JSON grammar shares are in stdrules.c.
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
#include "grammar/build.h"
#include "grammar/walk.h"

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

k3g_ast *k3g_attr_lit(k3g_builder *b, const char *v) {
    size_t n = strlen(v);
    char *buf = malloc(6 * n + 1);
    if (!buf) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (v[i] == '&') k += (size_t)sprintf(buf + k, "&amp;");
        else if (v[i] == '"') k += (size_t)sprintf(buf + k, "&quot;");
        else buf[k++] = v[i];
    }
    k3g_ast *a = k3g_lit(b, buf, k);
    free(buf);
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

/* ---- finalize ------------------------------------------------------------------------ */

typedef struct fin {
    k3g_builder *b;
    int32_t n;        /* rules */
    uint8_t *has_ref; /* the rule's automaton references rules */
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
        else k3g_fa_edge(&t, e.from, e.to, e.sym, e.lo, e.hi);
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

/* The rules that reference each rule: refby[ref0[x] .. ref0[x + 1]) for rule x. */
static k3_status referrers(k3g_builder *b, int32_t n, int32_t **ref0_out, int32_t **refby_out) {
    int32_t *ref0 = calloc((size_t)n + 1, sizeof *ref0);
    if (!ref0) return nomem(b);
    size_t total = 0;
    for (int32_t r = 0; r < n; r++) {
        const k3g_fa *fa = &b->rules[r].fa;
        for (size_t i = 0; i < fa->ne; i++)
            if (fa->e[i].sym >= 0 && K3G_SYM_IS_REF(fa->e[i].sym)) {
                ref0[K3G_SYM_ARG(fa->e[i].sym) + 1]++;
                total++;
            }
    }
    for (int32_t x = 0; x < n; x++) ref0[x + 1] += ref0[x];
    int32_t *refby = malloc((total ? total : 1) * sizeof *refby), *fill = malloc(((size_t)n + 1) * sizeof *fill);
    if (!refby || !fill) {
        free(ref0);
        free(refby);
        free(fill);
        return nomem(b);
    }
    memcpy(fill, ref0, ((size_t)n + 1) * sizeof *fill);
    for (int32_t r = 0; r < n; r++) {
        const k3g_fa *fa = &b->rules[r].fa;
        for (size_t i = 0; i < fa->ne; i++)
            if (fa->e[i].sym >= 0 && K3G_SYM_IS_REF(fa->e[i].sym)) refby[fill[K3G_SYM_ARG(fa->e[i].sym)]++] = r;
    }
    free(fill);
    *ref0_out = ref0;
    *refby_out = refby;
    return K3_OK;
}

/* The least fixpoint of set[r] = has_path(rule r, over set) for the rules in
 * only (NULL: all), by a work list: a rule is looked at again only when a
 * rule it references joins the set. */
static void fixpoint(k3g_builder *b, int32_t n, uint8_t *set, const uint8_t *only, bool refs_only, const int32_t *ref0,
                     const int32_t *refby, int32_t *wl, uint8_t *inwl, int32_t *q, uint8_t *seen) {
    int32_t nw = 0;
    for (int32_t r = n; r-- > 0;)
        if (!set[r] && (!only || only[r])) {
            wl[nw++] = r;
            inwl[r] = 1;
        }
    while (nw) {
        const int32_t r = wl[--nw];
        inwl[r] = 0;
        if (set[r] || !has_path(&b->rules[r].fa, set, refs_only, q, seen)) continue;
        set[r] = 1;
        for (int32_t k = ref0[r]; k < ref0[r + 1]; k++) {
            const int32_t x = refby[k];
            if (!set[x] && !inwl[x] && (!only || only[x])) {
                wl[nw++] = x;
                inwl[x] = 1;
            }
        }
    }
}

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
        if ((r & 255) == 0 && k3g_stopped(err, R->name)) {
            st = err && err->status ? err->status : K3_ERR_UNSUPPORTED;
            break;
        }
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
        if ((r & 255) == 0 && k3g_stopped(err, R->name)) {
            st = err && err->status ? err->status : K3_ERR_UNSUPPORTED;
            break;
        }
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
    /* the rules that reference each rule, for the fixpoints below: a rule is
     * looked at again only when one it references changes (linear in the
     * grammar, where a pass over every rule per change is quadratic on a
     * chain of rules) */
    int32_t *ref0 = NULL, *refby = NULL, *wl = NULL;
    uint8_t *inwl = NULL;
    if (st == K3_OK) st = referrers(b, n, &ref0, &refby);
    if (st == K3_OK && (!(wl = malloc((size_t)n * sizeof *wl)) || !(inwl = calloc((size_t)n, 1)))) st = nomem(b);
    /* 3. productive rules (a fixpoint), then prune references to the rest */
    if (st == K3_OK) fixpoint(b, n, prod, NULL, false, ref0, refby, wl, inwl, q, seen);
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
    /* 5. nullable rules, then left recursion (the pruning above changed the
     * references: count them again) */
    free(ref0);
    free(refby);
    ref0 = refby = NULL;
    if (st == K3_OK) st = referrers(b, n, &ref0, &refby);
    if (st == K3_OK) fixpoint(b, n, null, reach, true, ref0, refby, wl, inwl, q, seen);
    free(ref0);
    free(refby);
    free(wl);
    free(inwl);
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
                        st = k3_err(err, K3_ERR_ARG,
                                    "rule '%s' is left-recursive (it can reach itself "
                                    "without reading anything)",
                                    b->rules[x].name);
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
            if (!g->nodes || !g->bedges || !g->redges || !g->sedges || !g->rule_start || !g->rule_first || !g->rule_n ||
                !g->rule_std || !g->rule_name || !g->follow || !g->entries)
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
            bool alias_ok = R->alias && !b->is_std && v && v->std && R->alias_std >= 0 && v->std_n[R->alias_std] > 0;
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
                        g->redges[g->n_redges++] =
                            (k3g_redge){(uint32_t)map[K3G_SYM_ARG(e->sym)], (uint32_t)(base + e->to)};
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
