/*
 * walk.c -- the token tables: for one grammar node, which tokens of the
 * vocabulary are accepted whatever the stack below the node's rule is, and
 * which depend on it.
 *
 * The vocab trie is walked with a DFA whose states are sets of local
 * configurations: the node's rule sits at the bottom of a local stack
 * (stack -1), rules it references are pushed above it, and completing the
 * bottom rule is a flag on the state ("the rule can end here") rather than
 * a pop. For a token the walk ends in one of three ways:
 *   - it reads every byte: accepted, whatever lies below (context-free);
 *   - it dies, but the rule could have ended after k < len bytes: uncertain,
 *     the bytes token[k..] must be read by the rules below; kept as a trie
 *     of those suffixes, checked per step by the matcher;
 *   - it dies without such a point: rejected.
 * A rejected byte prunes the token's whole subtree (the trie is in
 * preorder: one jump). Suffixes whose first byte cannot follow the rule in
 * any context (the rule's follow set) are dropped at once.
 *
 * The DFA is built lazily, one transition when the walk first needs it, and
 * kept per grammar (under the grammar's mutex) so later walks reuse it; it
 * is dropped when it grows past LDFA_KEEP states. The walk is the cold path:
 * each table is computed once per grammar (per vocabulary for the
 * standard rules).
 */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "grammar/parser.h"
#include "grammar/walk.h"

#define LDFA_KEEP 16384    /* states kept between walks */
#define LDFA_MAX (1 << 20) /* states in one walk */
#define T_UNKNOWN (-2)
#define T_DEAD (-1)

struct k3g_ldfa {
    k3g_frames fr;
    k3g_cscratch cs;
    k3g_cfgv tmp, seeds;
    int32_t n;
    size_t cap;
    size_t *cfg0;
    int32_t *ncfg;
    uint8_t *can_pop;
    k3g_bset *allowed;
    int32_t *trans; /* [n * 256] */
    k3g_cfg *pool;
    size_t npool, cap_pool;
    int32_t *slot;
    uint32_t mask;
};

void k3g_ldfa_free(k3g_ldfa *d) {
    if (!d) return;
    k3g_frames_free(&d->fr);
    k3g_cscratch_free(&d->cs);
    free(d->tmp.v);
    free(d->seeds.v);
    free(d->cfg0);
    free(d->ncfg);
    free(d->can_pop);
    free(d->allowed);
    free(d->trans);
    free(d->pool);
    free(d->slot);
    free(d);
}

void k3g_entry_free(k3g_entry *e) {
    if (!e) return;
    free(e->acc_list);
    free(e->acc_bits);
    free(e->s_byte);
    free(e->s_depth);
    free(e->s_next);
    free(e->s_tok0);
    free(e->s_toks);
    free(e);
}

static int cfg_cmp(const void *a, const void *b) {
    const k3g_cfg *x = a, *y = b;
    if (x->node != y->node) return x->node < y->node ? -1 : 1;
    return x->stack < y->stack ? -1 : x->stack > y->stack;
}

static uint64_t state_hash(const k3g_cfg *c, size_t n, bool pop) {
    uint64_t h = 0x84222325cbf29ce4u ^ (pop ? 0x9e37u : 0) ^ n;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint32_t)c[i].node;
        h *= 0x100000001b3u;
        h ^= (uint32_t)c[i].stack;
        h *= 0x100000001b3u;
        h ^= h >> 31;
    }
    return h;
}

static bool ldfa_rehash(k3g_ldfa *L) {
    uint32_t ns = L->slot ? (L->mask + 1) * 2 : 1024;
    int32_t *slot = malloc((size_t)ns * sizeof *slot);
    if (!slot) return false;
    for (uint32_t i = 0; i < ns; i++) slot[i] = -1;
    for (int32_t s = 0; s < L->n; s++) {
        uint32_t i = (uint32_t)state_hash(L->pool + L->cfg0[s], (size_t)L->ncfg[s], L->can_pop[s]) & (ns - 1);
        while (slot[i] >= 0) i = (i + 1) & (ns - 1);
        slot[i] = s;
    }
    free(L->slot);
    L->slot = slot;
    L->mask = ns - 1;
    return true;
}

/* The state of the sorted configurations c[0..n) with flag pop; -3 on
 * allocation failure, -4 when over LDFA_MAX. */
static int32_t ldfa_intern(k3g_ldfa *L, const k3_grammar *g, const k3g_cfg *c, size_t n, bool pop) {
    if (!L->slot || (uint32_t)L->n * 2 + 2 >= L->mask) {
        if (!ldfa_rehash(L)) return -3;
    }
    uint32_t i = (uint32_t)state_hash(c, n, pop) & L->mask;
    for (; L->slot[i] >= 0; i = (i + 1) & L->mask) {
        int32_t s = L->slot[i];
        if ((size_t)L->ncfg[s] == n && L->can_pop[s] == pop &&
            (n == 0 || !memcmp(L->pool + L->cfg0[s], c, n * sizeof *c)))
            return s;
    }
    if (L->n >= LDFA_MAX) return -4;
    size_t need = (size_t)L->n + 1;
    if (need > L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        size_t *c0 = realloc(L->cfg0, cap * sizeof *c0);
        if (!c0) return -3;
        L->cfg0 = c0;
        int32_t *nc = realloc(L->ncfg, cap * sizeof *nc);
        if (!nc) return -3;
        L->ncfg = nc;
        uint8_t *cp = realloc(L->can_pop, cap);
        if (!cp) return -3;
        L->can_pop = cp;
        k3g_bset *al = realloc(L->allowed, cap * sizeof *al);
        if (!al) return -3;
        L->allowed = al;
        int32_t *tr = realloc(L->trans, cap * 256 * sizeof *tr);
        if (!tr) return -3;
        L->trans = tr;
        L->cap = cap;
    }
    if (!k3g_grow(&L->pool, &L->cap_pool, L->npool + n, sizeof *L->pool)) return -3;
    int32_t s = L->n++;
    L->cfg0[s] = L->npool;
    L->ncfg[s] = (int32_t)n;
    L->can_pop[s] = pop;
    if (n) memcpy(L->pool + L->npool, c, n * sizeof *c);
    L->npool += n;
    k3g_bset al = {{0}};
    for (size_t k = 0; k < n; k++) {
        const k3g_node *nd = &g->nodes[c[k].node];
        for (uint32_t j = 0; j < nd->nb; j++) k3g_bset_range(&al, g->bedges[nd->b0 + j].lo, g->bedges[nd->b0 + j].hi);
    }
    L->allowed[s] = al;
    int32_t *tr = L->trans + (size_t)s * 256;
    for (int k = 0; k < 256; k++) tr[k] = k3g_bset_has(&al, (unsigned)k) ? T_UNKNOWN : T_DEAD;
    L->slot[i] = s;
    return s;
}

/* The closure of seeds as a state. */
static int32_t ldfa_close(k3g_ldfa *L, const k3_grammar *g, const k3g_cfg *seeds, size_t n) {
    L->tmp.n = 0;
    bool pop = false;
    if (!k3g_closure(g, &L->fr, &L->cs, seeds, n, &L->tmp, &pop)) return -3;
    if (L->tmp.n == 0 && !pop) return T_DEAD;
    qsort(L->tmp.v, L->tmp.n, sizeof *L->tmp.v, cfg_cmp);
    return ldfa_intern(L, g, L->tmp.v, L->tmp.n, pop);
}

typedef struct unc {
    int32_t tok;
    int32_t k; /* the suffix starts at byte k */
} unc;

typedef struct uncv {
    unc *v;
    size_t n, cap;
} uncv;

/* The transition of state s on byte c, stored in trans[] as the target's
 * id << 1 | its can_pop flag (or T_DEAD) and returned so; -3 / -4 on
 * failure. */
static int32_t ldfa_step(k3g_ldfa *L, const k3_grammar *g, int32_t s, unsigned c) {
    L->seeds.n = 0;
    size_t a = L->cfg0[s];
    int32_t n = L->ncfg[s];
    for (int32_t k = 0; k < n; k++) {
        k3g_cfg x = L->pool[a + (size_t)k];
        int32_t t = k3g_step(g, x.node, c);
        if (t >= 0 && !k3g_cfgv_push(&L->seeds, (k3g_cfg){t, x.stack})) return -3;
    }
    int32_t t = L->seeds.n ? ldfa_close(L, g, L->seeds.v, L->seeds.n) : T_DEAD;
    if (t < T_DEAD) return t;
    if (t >= 0) t = t << 1 | L->can_pop[t];
    L->trans[(size_t)s * 256 + c] = t;
    return t;
}

/* The walk of the vocab trie from state s0: accepted tokens into bits,
 * uncertain ones into u. 0, or the failure of a transition. */
static int32_t walk(k3g_ldfa *L, const k3_grammar *g, const k3g_trie *tr, int32_t s0, uint64_t *bits,
                    int32_t *n_acc_out, uncv *u, const k3g_bset *follow, int32_t *ds, int32_t *popd) {
    const k3_grammar_vocab *v = g->vocab;
    const uint8_t *tb = tr->byte, *tdup = tr->dup;
    const uint16_t *td = tr->depth;
    const uint32_t *tn = tr->next;
    const int32_t *tt = tr->tok, *dup = v->dup_next;
    const int32_t *trans = L->trans;
    int32_t N = tr->n, npop = 0, n_acc = 0, prev_d = 0, prev_t = s0 << 1;
    ds[0] = s0 << 1;
    for (int32_t i = 1; i < N;) {
        int32_t d = td[i];
        while (npop && popd[npop - 1] >= d) npop--;
        /* going one deeper (the common case) reads the state just made */
        int32_t s = (d == prev_d + 1 ? prev_t : ds[d - 1]) >> 1;
        unsigned c = tb[i];
        int32_t t = trans[(size_t)s << 8 | c];
        if (t < 0) {
            if (t == T_UNKNOWN) {
                t = ldfa_step(L, g, s, c);
                trans = L->trans;
                if (t < T_DEAD) return t;
            }
            if (t == T_DEAD) {
                if (npop) {
                    /* every token below dies here; the rule could end earlier */
                    for (uint32_t j = (uint32_t)i; j < tn[i]; j++) {
                        for (int32_t tok = tt[j]; tok >= 0; tok = tdup[j] ? dup[tok] : -1) {
                            const uint8_t *p = v->bytes + v->off[tok];
                            for (int32_t q = 0; q < npop; q++) {
                                if (follow && !k3g_bset_has(follow, p[popd[q]])) continue;
                                if (u->n == u->cap && !k3g_grow(&u->v, &u->cap, u->n + 1, sizeof *u->v)) return -3;
                                u->v[u->n++] = (unc){tok, popd[q]};
                            }
                        }
                    }
                }
                i = (int32_t)tn[i];
                prev_d = -2;
                continue;
            }
        }
        ds[d] = t;
        prev_d = d;
        prev_t = t;
        if (t & 1) popd[npop++] = d;
        int32_t tok = tt[i];
        if (tok >= 0) {
            bits[tok >> 6] |= (uint64_t)1 << (tok & 63);
            n_acc++;
            if (tdup[i])
                for (tok = dup[tok]; tok >= 0; tok = dup[tok]) {
                    bits[tok >> 6] |= (uint64_t)1 << (tok & 63);
                    n_acc++;
                }
        }
        i++;
    }
    *n_acc_out += n_acc;
    return 0;
}

/* Whether every string of the slice's language stays alive from state s0
 * (a product walk of the two automata). 1 yes, 0 no, < 0 a failure. */
static int32_t covers(k3g_ldfa *L, const k3_grammar *g, int32_t s0, const k3g_fa *sl) {
    if (sl->n == 0 || !sl->first) return 0;
    size_t cap = 64, n = 0;
    uint64_t *seen = malloc(cap * sizeof *seen);
    uint64_t *queue = malloc(cap * sizeof *queue);
    size_t qh = 0, qt = 0;
    int32_t r = 1;
    if (!seen || !queue) r = -3;
    else {
        seen[n++] = (uint64_t)(uint32_t)s0 << 32 | (uint32_t)sl->start;
        queue[qt++] = seen[0];
    }
    while (r == 1 && qh < qt) {
        uint64_t x = queue[qh++];
        int32_t q = (int32_t)(x >> 32), p = (int32_t)(uint32_t)x;
        for (int32_t j = sl->first[p]; j < sl->first[p + 1] && r == 1; j++) {
            const k3g_fedge *e = &sl->e[j];
            for (unsigned c = e->lo; c <= e->hi; c++) {
                int32_t t = L->trans[(size_t)q * 256 + c];
                if (t == T_UNKNOWN) t = ldfa_step(L, g, q, c);
                if (t < T_DEAD) {
                    r = t;
                    break;
                }
                if (t == T_DEAD) {
                    r = 0;
                    break;
                }
                uint64_t y = (uint64_t)(uint32_t)(t >> 1) << 32 | (uint32_t)e->to;
                bool dup = false;
                for (size_t k = 0; k < n && !dup; k++) dup = seen[k] == y;
                if (dup) continue;
                if (n > 256) {
                    r = 0; /* too many pairs to be worth it: walk everything */
                    break;
                }
                if (n == cap) {
                    cap *= 2;
                    uint64_t *ns = realloc(seen, cap * sizeof *ns), *nq = ns ? realloc(queue, cap * sizeof *nq) : NULL;
                    if (ns) seen = ns;
                    if (nq) queue = nq;
                    if (!ns || !nq) {
                        r = -3;
                        break;
                    }
                }
                seen[n++] = y;
                queue[qt++] = y;
            }
        }
    }
    free(seen);
    free(queue);
    return r;
}

static const k3_grammar_vocab *sort_vocab;

static int unc_cmp(const void *a, const void *b) {
    const unc *x = a, *y = b;
    const k3_grammar_vocab *v = sort_vocab;
    const uint8_t *p = v->bytes + v->off[x->tok] + x->k, *q = v->bytes + v->off[y->tok] + y->k;
    size_t lp = v->off[x->tok + 1] - v->off[x->tok] - (size_t)x->k;
    size_t lq = v->off[y->tok + 1] - v->off[y->tok] - (size_t)y->k;
    size_t m = lp < lq ? lp : lq;
    int c = memcmp(p, q, m);
    if (c) return c;
    if (lp != lq) return lp < lq ? -1 : 1;
    return x->tok < y->tok ? -1 : x->tok > y->tok;
}

static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;

/* The suffix trie of the uncertain tokens (sorted by suffix). */
static bool build_suffixes(k3g_entry *e, const k3_grammar_vocab *v, uncv *u) {
    if (u->n == 0) return true;
    pthread_mutex_lock(&sort_mu); /* qsort has no context argument in C11 */
    sort_vocab = v;
    qsort(u->v, u->n, sizeof *u->v, unc_cmp);
    pthread_mutex_unlock(&sort_mu);
    size_t total = 1;
    for (size_t i = 0; i < u->n; i++) total += v->off[u->v[i].tok + 1] - v->off[u->v[i].tok] - (size_t)u->v[i].k;
    e->s_byte = malloc(total);
    e->s_depth = malloc(total * sizeof *e->s_depth);
    e->s_next = malloc(total * sizeof *e->s_next);
    e->s_tok0 = malloc((total + 1) * sizeof *e->s_tok0);
    e->s_toks = malloc(u->n * sizeof *e->s_toks);
    int32_t *path = malloc(((size_t)v->max_len + 2) * sizeof *path);
    if (!e->s_byte || !e->s_depth || !e->s_next || !e->s_tok0 || !e->s_toks || !path) {
        free(path);
        return false;
    }
    int32_t nn = 1, nt = 0;
    e->s_byte[0] = 0;
    e->s_depth[0] = 0;
    e->s_tok0[0] = 0;
    path[0] = 0;
    const uint8_t *pp = NULL;
    size_t pl = 0;
    for (size_t i = 0; i < u->n; i++) {
        const uint8_t *p = v->bytes + v->off[u->v[i].tok] + u->v[i].k;
        size_t l = v->off[u->v[i].tok + 1] - v->off[u->v[i].tok] - (size_t)u->v[i].k;
        size_t c = 0;
        if (pp) {
            size_t lim = l < pl ? l : pl;
            while (c < lim && pp[c] == p[c]) c++;
        }
        for (size_t d = c; d < l; d++) {
            e->s_byte[nn] = p[d];
            e->s_depth[nn] = (uint16_t)(d + 1);
            e->s_tok0[nn] = (uint32_t)nt;
            path[d + 1] = nn++;
        }
        e->s_toks[nt++] = u->v[i].tok;
        pp = p;
        pl = l;
    }
    e->s_tok0[nn] = (uint32_t)nt;
    /* tokens are appended to the latest node, which is the end of their
     * suffix: a node's tokens are s_toks[s_tok0[i] .. s_tok0[i + 1]) */
    int32_t sp = 0;
    int32_t *open = path;
    for (int32_t i = 0; i < nn; i++) {
        while (sp && e->s_depth[open[sp - 1]] >= e->s_depth[i]) e->s_next[open[--sp]] = (uint32_t)i;
        open[sp++] = i;
    }
    while (sp) e->s_next[open[--sp]] = (uint32_t)nn;
    e->n_sfx = nn;
    free(path);
    return true;
}

static k3g_entry *compute(k3_grammar *g, int32_t node, k3_error *err) {
    const k3_grammar_vocab *v = g->vocab;
    if (g->ldfa && g->ldfa->n > LDFA_KEEP) {
        k3g_ldfa_free(g->ldfa);
        g->ldfa = NULL;
    }
    if (!g->ldfa && !(g->ldfa = calloc(1, sizeof *g->ldfa))) {
        k3_err(err, K3_ERR_NOMEM, "out of memory computing token tables");
        return NULL;
    }
    k3g_ldfa *L = g->ldfa;
    L->cs.budget = K3G_TABLE_WORK; /* a bound on one table's work, however ambiguous the grammar */
    L->cs.over = false;
    k3g_entry *e = calloc(1, sizeof *e);
    uint64_t *bits = calloc(v->n_words ? v->n_words : 1, sizeof *bits);
    int32_t *ds = malloc(((size_t)v->max_len + 2) * sizeof *ds);
    int32_t *popd = malloc(((size_t)v->max_len + 2) * sizeof *popd);
    uncv u = {0};
    int32_t n_acc = 0, fail = -3;
    bool ok = e && bits && ds && popd;
    const k3g_bset *follow = g->is_std ? NULL : &g->follow[g->nodes[node].rule];
    int32_t s0 = ok ? ldfa_close(L, g, &(k3g_cfg){node, -1}, 1) : -3;
    if (s0 < T_DEAD) {
        ok = false;
        fail = s0;
    }
    if (ok && s0 >= 0) {
        /* a state that takes a whole slice walks only the other tokens */
        const k3g_trie *tr = &v->trie;
        int32_t cov = 0;
        for (int k = 0; k < K3G_N_SLICES && cov == 0; k++) {
            const k3g_slice *sl = &v->slice[k];
            if (sl->n < 256) continue; /* too few tokens to be worth a check */
            cov = covers(L, g, s0, &sl->dfa);
            if (cov == 1) {
                for (size_t w = 0; w < v->n_words; w++) bits[w] |= sl->bits[w];
                n_acc = sl->n;
                tr = &sl->rest;
            }
        }
        int32_t r = cov < 0 ? cov : walk(L, g, tr, s0, bits, &n_acc, &u, follow, ds, popd);
        if (r < 0) {
            ok = false;
            fail = r;
        }
    }
    if (ok) {
        e->n_acc = n_acc;
        if ((int64_t)n_acc * 32 < v->n_vocab) {
            e->acc_list = malloc((size_t)(n_acc ? n_acc : 1) * sizeof *e->acc_list);
            if (!e->acc_list) ok = false;
            int32_t k = 0;
            for (size_t w = 0; ok && w < v->n_words; w++)
                for (uint64_t x = bits[w]; x; x &= x - 1)
                    e->acc_list[k++] = (int32_t)(w * 64 + (size_t)__builtin_ctzll(x));
        } else {
            e->acc_bits = bits;
            bits = NULL;
        }
    }
    if (ok) ok = build_suffixes(e, v, &u);
    free(bits);
    free(ds);
    free(popd);
    free(u.v);
    if (!ok) {
        k3g_entry_free(e);
        const char *rule = g->rule_name && g->rule_name[g->nodes[node].rule] ? g->rule_name[g->nodes[node].rule] : "?";
        if (L->cs.over) {
            L->cs.over = false;
            /* the DFA may hold a part-made state: start it afresh next time */
            k3g_ldfa_free(g->ldfa);
            g->ldfa = NULL;
            k3_err(err, K3_ERR_UNSUPPORTED,
                   "the token table of rule '%.100s' needs more than %d parser steps (parses of one token "
                   "multiply: a grammar this ambiguous is cut here)",
                   rule, K3G_TABLE_WORK);
        } else if (fail == -4)
            k3_err(err, K3_ERR_UNSUPPORTED,
                   "the grammar is too ambiguous to tabulate (over %d parser states "
                   "for one node)",
                   LDFA_MAX);
        else k3_err(err, K3_ERR_NOMEM, "out of memory computing token tables");
        return NULL;
    }
    return e;
}

const k3g_entry *k3g_entry_get(const k3_grammar *gc, int32_t n, k3_error *err) {
    int32_t key = gc->nodes[n].key;
    if (key < 0) return k3g_entry_get(gc->vocab->std, -key - 1, err);
    k3_grammar *g = (k3_grammar *)gc; /* the cache is the one mutable part */
    k3g_entry *e = atomic_load_explicit(&g->entries[key], memory_order_acquire);
    if (e) return e;
    pthread_mutex_lock(&g->mu);
    e = atomic_load_explicit(&g->entries[key], memory_order_relaxed);
    if (!e) {
        e = compute(g, key, err);
        if (e) atomic_store_explicit(&g->entries[key], e, memory_order_release);
    }
    pthread_mutex_unlock(&g->mu);
    return e;
}

/* ---- counted tables of the string tail -------------------------------------------------- */

void k3g_counted_free(k3g_counted *c) {
    if (!c) return;
    free(c->tok);
    free(c->cnt);
    free(c->close_tok);
    free(c->close_cnt);
    free(c->s_cnt);
    free(c);
}

/* Characters a token takes from node `from` of a string rule over its
 * first n bytes: each arrival at a boundary node (body0 <= node < body1)
 * completes one; a character left open at the end counts too. *closed:
 * the bytes end at `end` (the closing quote; -1 for none). */
static int32_t count_chars(const k3_grammar *std, int32_t from, int32_t body0, int32_t body1, int32_t end,
                           const uint8_t *p, size_t n, bool *closed) {
    int32_t cnt = 0, node = from;
    *closed = false;
    for (size_t i = 0; i < n && node >= 0; i++) {
        int32_t t = k3g_step(std, node, p[i]);
        if (t >= body0 && t < body1) cnt++;
        if (t == end) *closed = true;
        node = t;
    }
    if (!*closed && !(node >= body0 && node < body1)) cnt++;
    return cnt;
}

typedef struct tc {
    int32_t tok, cnt;
} tc;

static int tc_cmp(const void *a, const void *b) {
    const tc *x = a, *y = b;
    return x->cnt != y->cnt ? (x->cnt > y->cnt ? -1 : 1) : (x->tok < y->tok ? -1 : x->tok > y->tok);
}

static k3g_counted *counted_make(const k3_grammar_vocab *v, int32_t node, k3_error *err) {
    const k3_grammar *std = v->std;
    const k3g_entry *e = k3g_entry_get(std, node, err);
    if (!e) return NULL;
    int32_t first = v->std_first[K3G_STD_STRING_TAIL], end = first, b0 = first + 1 + K3G_JS_BODY, b1 = b0 + 1;
    int32_t raw = v->std_first[K3G_STD_RAW_STRING];
    if (raw >= 0 && node >= raw && node < raw + v->std_n[K3G_STD_RAW_STRING]) {
        end = -1;
        b0 = raw;
        b1 = raw + K3G_RAW_BOUNDARY;
    }
    k3g_counted *c = calloc(1, sizeof *c);
    tc *open = malloc((size_t)(e->n_acc ? e->n_acc : 1) * sizeof *open);
    tc *close = malloc((size_t)(e->n_acc ? e->n_acc : 1) * sizeof *close);
    int32_t no = 0, nc = 0;
    bool ok = c && open && close;
    for (int32_t i = 0, k = 0; ok && k < e->n_acc; i++) {
        int32_t tok;
        if (e->acc_bits) {
            if (!((e->acc_bits[i >> 6] >> (i & 63)) & 1)) continue;
            tok = i;
        } else {
            tok = e->acc_list[i];
        }
        k++;
        bool closed;
        int32_t cnt =
            count_chars(std, node, b0, b1, end, v->bytes + v->off[tok], v->off[tok + 1] - v->off[tok], &closed);
        if (closed) close[nc++] = (tc){tok, cnt};
        else open[no++] = (tc){tok, cnt};
    }
    if (ok) {
        /* by characters, most first: a counting sort (counts are at most a
         * token's length) */
        int32_t maxc = 0;
        for (int32_t k = 0; k < no; k++)
            if (open[k].cnt > maxc) maxc = open[k].cnt;
        int32_t *start = calloc((size_t)maxc + 2, sizeof *start);
        tc *sorted = malloc((size_t)(no ? no : 1) * sizeof *sorted);
        if (start && sorted) {
            for (int32_t k = 0; k < no; k++) start[maxc - open[k].cnt + 1]++;
            for (int32_t c2 = 0; c2 <= maxc; c2++) start[c2 + 1] += start[c2];
            for (int32_t k = 0; k < no; k++) sorted[start[maxc - open[k].cnt]++] = open[k];
            memcpy(open, sorted, (size_t)no * sizeof *open);
        } else {
            qsort(open, (size_t)no, sizeof *open, tc_cmp);
        }
        free(start);
        free(sorted);
        c->n = no;
        c->n_close = nc;
        c->tok = malloc((size_t)(no ? no : 1) * sizeof *c->tok);
        c->cnt = malloc((size_t)(no ? no : 1) * sizeof *c->cnt);
        c->close_tok = malloc((size_t)(nc ? nc : 1) * sizeof *c->close_tok);
        c->close_cnt = malloc((size_t)(nc ? nc : 1) * sizeof *c->close_cnt);
        size_t ns = e->n_sfx ? e->s_tok0[e->n_sfx] : 0;
        c->s_cnt = malloc((ns ? ns : 1) * sizeof *c->s_cnt);
        ok = c->tok && c->cnt && c->close_tok && c->close_cnt && c->s_cnt;
        for (int32_t k = 0; ok && k < no; k++) c->tok[k] = open[k].tok, c->cnt[k] = open[k].cnt;
        for (int32_t k = 0; ok && k < nc; k++) c->close_tok[k] = close[k].tok, c->close_cnt[k] = close[k].cnt;
        /* the uncertain tokens leave the tail right after its quote */
        for (int32_t i = 1; ok && i < e->n_sfx; i++)
            for (uint32_t k = e->s_tok0[i]; k < e->s_tok0[i + 1]; k++) {
                int32_t tok = e->s_toks[k];
                size_t len = v->off[tok + 1] - v->off[tok];
                bool closed;
                c->s_cnt[k] = count_chars(std, node, b0, b1, end, v->bytes + v->off[tok], len - e->s_depth[i], &closed);
            }
    }
    free(open);
    free(close);
    if (!ok) {
        k3g_counted_free(c);
        k3_err(err, K3_ERR_NOMEM, "out of memory computing token tables");
        return NULL;
    }
    return c;
}

const k3g_counted *k3g_counted_get(const k3_grammar_vocab *v, int32_t node, k3_error *err) {
    k3g_counted *c = atomic_load_explicit(&v->counted[node], memory_order_acquire);
    if (c) return c;
    k3_grammar *std = v->std;
    /* the entry first (it takes the same mutex) */
    if (!k3g_entry_get(std, node, err)) return NULL;
    pthread_mutex_lock(&std->mu);
    c = atomic_load_explicit(&v->counted[node], memory_order_relaxed);
    if (!c) {
        c = counted_make(v, node, err);
        if (c) atomic_store_explicit(&v->counted[node], c, memory_order_release);
    }
    pthread_mutex_unlock(&std->mu);
    return c;
}
