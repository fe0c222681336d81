/*
 * matcher.c -- k3_grammar_matcher over a compiled grammar, and the
 * grammar's reference count.
 *
 * The parser core (configurations, frames, the closure) is parser.c.
 *
 * The matcher keeps one state per token boundary (so rolling back N tokens
 * is dropping N states) and its frames in one array truncated with them.
 *
 * The mask of a state is the union, over its configurations, of the node's
 * accepted tokens (context-free: the token stays inside the node's rule;
 * walk.c) and of the node's uncertain tokens (those that leave the rule
 * mid-token) checked against the real stack: the rule's frame is popped
 * and the bytes after the rule's end are read from there, as a trie walk
 * pruned at the first byte the stack refuses. Special tokens come from the
 * nodes' special edges, the end-of-generation ids from completeness.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/pool.h"
#include "grammar/build.h"
#include "grammar/grammar.h"
#include "grammar/parser.h"
#include "grammar/walk.h"

/* ---- the matcher ---------------------------------------------------------------- */

typedef struct mstate {
    size_t off, n;    /* configurations in m->cfgs */
    int32_t nf, ne;   /* frames and edges in use at this state */
    uint8_t complete; /* the root rule can end here */
    uint8_t ended;    /* an end-of-generation id was accepted */
} mstate;

struct k3_grammar_matcher {
    k3_grammar *g;
    k3g_gss gs; /* the stacks, graph-structured (parser.h) */
    k3g_cscratch cs;
    k3g_cfgv cfgs; /* every state's configurations back to back */
    mstate *hist;  /* [n_hist]: hist[0] the start, one per token after */
    size_t n_hist, cap_hist;
    /* scratch */
    k3g_cfgv ta, tb, lv;
    size_t *lv_off; /* suffix walks: level d is lv[lv_off[d] .. lv_off[d+1]) */
    k3g_bset *lv_allowed;
    size_t cap_lv, cap_lva;
    uint64_t *seen;    /* (key, stack) pairs done in this mask; stack ~0: the accepted set */
    uint64_t *scratch; /* [mask words]: a counted node's accepted set */
    size_t n_seen, cap_seen;
};

static k3_status nomem(k3_error *err) { return k3_err(err, K3_ERR_NOMEM, "out of memory in the grammar matcher"); }

/* A closure that failed: its budget ran out (what), else out of memory. */
static k3_status failed(k3_grammar_matcher *m, const char *what, k3_error *err) {
    if (!m->cs.over) return nomem(err);
    m->cs.over = false;
    return k3_err(err, K3_ERR_UNSUPPORTED,
                  "the grammar needs more than %lld parser steps (or %d stack frames) for %s: a grammar this "
                  "ambiguous or this large is cut here",
                  (long long)(strstr(what, "mask") ? K3G_MASK_WORK : K3G_ACCEPT_WORK), K3G_MAX_GSS, what);
}

static const k3g_cfg *top_cfgs(const k3_grammar_matcher *m, size_t *n) {
    const mstate *s = &m->hist[m->n_hist - 1];
    *n = s->n;
    return m->cfgs.v ? m->cfgs.v + s->off : NULL;
}

static bool push_state(k3_grammar_matcher *m, const k3g_cfg *c, size_t n, bool complete, bool ended) {
    if (!k3g_grow(&m->hist, &m->cap_hist, m->n_hist + 1, sizeof *m->hist)) return false;
    if (!k3g_grow(&m->cfgs.v, &m->cfgs.cap, m->cfgs.n + n, sizeof *m->cfgs.v)) return false;
    mstate s = {m->cfgs.n, n, m->gs.nf, m->gs.ne, complete, ended};
    if (n) memmove(m->cfgs.v + m->cfgs.n, c, n * sizeof *c);
    m->cfgs.n += n;
    m->hist[m->n_hist++] = s;
    return true;
}

static k3_status start_state(k3_grammar_matcher *m, k3_error *err) {
    m->n_hist = 0;
    m->cfgs.n = 0;
    k3g_gss_truncate(&m->gs, 0, 0);
    m->ta.n = 0;
    bool bottom = false;
    k3g_cfg s0 = {m->g->rule_start[m->g->root], -1};
    m->cs.budget = K3G_ACCEPT_WORK;
    if (!k3g_gss_closure(m->g, &m->gs, &m->cs, &s0, 1, &m->ta, &bottom)) return failed(m, "the start", err);
    if (!push_state(m, m->ta.v, m->ta.n, bottom, false)) return nomem(err);
    return K3_OK;
}

k3_grammar *k3_grammar_ref(k3_grammar *g) {
    if (g) atomic_fetch_add(&g->refs, 1);
    return g;
}

const k3_grammar_vocab *k3_grammar_get_vocab(const k3_grammar *g) { return g ? g->vocab : NULL; }

void k3_grammar_free(k3_grammar *g) {
    if (g && atomic_fetch_sub(&g->refs, 1) == 1) k3g_grammar_destroy(g);
}

k3_status k3_grammar_matcher_init(k3_grammar_matcher **out, k3_grammar *g, k3_error *err) {
    *out = NULL;
    if (!g) return k3_err(err, K3_ERR_ARG, "k3_grammar_matcher_init needs a grammar");
    k3_grammar_matcher *m = calloc(1, sizeof *m);
    if (!m) return nomem(err);
    m->g = k3_grammar_ref(g);
    k3_status st = start_state(m, err);
    if (st != K3_OK) {
        k3_grammar_matcher_free(m);
        return st;
    }
    *out = m;
    return K3_OK;
}

void k3_grammar_matcher_free(k3_grammar_matcher *m) {
    if (!m) return;
    k3_grammar_free(m->g);
    k3g_gss_free(&m->gs);
    k3g_cscratch_free(&m->cs);
    free(m->cfgs.v);
    free(m->hist);
    free(m->ta.v);
    free(m->tb.v);
    free(m->lv.v);
    free(m->lv_off);
    free(m->lv_allowed);
    free(m->seen);
    free(m->scratch);
    free(m);
}

k3_status k3_grammar_matcher_clone(k3_grammar_matcher **out, const k3_grammar_matcher *m, k3_error *err) {
    *out = NULL;
    k3_grammar_matcher *c = calloc(1, sizeof *c);
    if (!c) return nomem(err);
    c->g = k3_grammar_ref(m->g);
    bool ok = k3g_gss_copy(&c->gs, &m->gs);
    if (ok && m->cfgs.n) {
        ok = k3g_grow(&c->cfgs.v, &c->cfgs.cap, m->cfgs.n, sizeof *c->cfgs.v);
        if (ok) memcpy(c->cfgs.v, m->cfgs.v, m->cfgs.n * sizeof *c->cfgs.v);
        c->cfgs.n = m->cfgs.n;
    }
    if (ok) ok = k3g_grow(&c->hist, &c->cap_hist, m->n_hist, sizeof *c->hist);
    if (ok) {
        memcpy(c->hist, m->hist, m->n_hist * sizeof *c->hist);
        c->n_hist = m->n_hist;
    }
    if (!ok) {
        k3_grammar_matcher_free(c);
        return nomem(err);
    }
    *out = c;
    return K3_OK;
}

void k3_grammar_matcher_reset(k3_grammar_matcher *m) {
    /* the start state is hist[0]: keep it */
    m->n_hist = 1;
    m->cfgs.n = m->hist[0].n;
    k3g_gss_truncate(&m->gs, m->hist[0].nf, m->hist[0].ne);
}

int32_t k3_grammar_matcher_n_tokens(const k3_grammar_matcher *m) { return (int32_t)m->n_hist - 1; }

void k3_grammar_matcher_size(const k3_grammar_matcher *m, size_t *configs, size_t *frames) {
    *configs = m->hist[m->n_hist - 1].n;
    *frames = (size_t)m->gs.nf + (size_t)m->gs.ne;
}

bool k3_grammar_matcher_is_complete(const k3_grammar_matcher *m) {
    const mstate *s = &m->hist[m->n_hist - 1];
    return s->complete || s->ended;
}

bool k3_grammar_matcher_is_ended(const k3_grammar_matcher *m) { return m->hist[m->n_hist - 1].ended; }

k3_status k3_grammar_matcher_rollback(k3_grammar_matcher *m, int32_t n, k3_error *err) {
    if (n < 0 || (size_t)n >= m->n_hist)
        return k3_err(err, K3_ERR_ARG, "cannot roll back %d tokens: %zu were accepted", n, m->n_hist - 1);
    m->n_hist -= (size_t)n;
    const mstate *s = &m->hist[m->n_hist - 1];
    m->cfgs.n = s->off + s->n;
    k3g_gss_truncate(&m->gs, s->nf, s->ne);
    return K3_OK;
}

static bool is_eos(const k3_grammar_vocab *v, int32_t id) {
    for (int32_t i = 0; i < v->n_eos; i++)
        if (v->eos[i] == id) return true;
    return false;
}

k3_status k3_grammar_matcher_accept(k3_grammar_matcher *m, int32_t id, k3_error *err) {
    const k3_grammar *g = m->g;
    const k3_grammar_vocab *v = g->vocab;
    if (id < 0 || id >= v->n_vocab) return k3_err(err, K3_ERR_ARG, "token id %d is out of range", id);
    const mstate cur = m->hist[m->n_hist - 1];
    if (cur.ended) return k3_err(err, K3_ERR_ARG, "token %d comes after the end of the generation", id);
    const int32_t nf0 = m->gs.nf, ne0 = m->gs.ne;
    m->cs.budget = K3G_ACCEPT_WORK;
    m->cs.over = false;
    size_t n;
    const k3g_cfg *c = top_cfgs(m, &n);
    m->ta.n = 0;
    bool bottom = false;
    if (v->is_special[id]) {
        m->tb.n = 0;
        for (size_t i = 0; i < n; i++) {
            const k3g_node *nd = &g->nodes[c[i].node];
            for (uint32_t j = 0; j < nd->ns; j++)
                if (g->sedges[nd->s0 + j].id == id &&
                    !k3g_cfgv_push(&m->tb, (k3g_cfg){(int32_t)g->sedges[nd->s0 + j].to, c[i].stack}))
                    return nomem(err);
        }
        if (m->tb.n) {
            if (!k3g_gss_closure(g, &m->gs, &m->cs, m->tb.v, m->tb.n, &m->ta, &bottom)) {
                k3g_gss_truncate(&m->gs, nf0, ne0);
                return failed(m, "one token", err);
            }
            if (!push_state(m, m->ta.v, m->ta.n, bottom, false)) return nomem(err);
            return K3_OK;
        }
        if (cur.complete && is_eos(v, id)) {
            if (!push_state(m, NULL, 0, false, true)) return nomem(err);
            return K3_OK;
        }
        return k3_err(err, K3_ERR_ARG, "special token %d is not allowed here", id);
    }
    const uint8_t *p = v->bytes + v->off[id];
    size_t len = v->off[id + 1] - v->off[id];
    if (len == 0) return k3_err(err, K3_ERR_ARG, "token %d has no bytes", id);
    /* ping-pong between ta and tb; the first read is from the state itself */
    k3g_cfgv *src = NULL, *dst = &m->ta;
    for (size_t i = 0; i < len; i++) {
        dst->n = 0;
        bottom = false;
        bool ok = src ? k3g_gss_scan_byte(g, &m->gs, &m->cs, src->v, src->n, p[i], dst, &bottom)
                      : k3g_gss_scan_byte(g, &m->gs, &m->cs, c, n, p[i], dst, &bottom);
        if (!ok) {
            k3g_gss_truncate(&m->gs, nf0, ne0);
            return failed(m, "one token", err);
        }
        if (dst->n == 0 && !(bottom && i + 1 == len)) {
            k3g_gss_truncate(&m->gs, nf0, ne0);
            return k3_err(err, K3_ERR_ARG, "token %d is not allowed here (byte %zu of it)", id, i);
        }
        src = dst;
        dst = dst == &m->ta ? &m->tb : &m->ta;
    }
    if (!push_state(m, src->v, src->n, bottom, false)) {
        k3g_gss_truncate(&m->gs, nf0, ne0);
        return nomem(err);
    }
    return K3_OK;
}

k3_status k3_grammar_matcher_accept_tokens(k3_grammar_matcher *m, const int32_t *ids, size_t n, size_t *n_accepted,
                                           k3_error *err) {
    if (n_accepted) *n_accepted = 0;
    for (size_t i = 0; i < n; i++) {
        K3_TRY(k3_grammar_matcher_accept(m, ids[i], err));
        if (n_accepted) *n_accepted = i + 1;
    }
    return K3_OK;
}

/* ---- masks -------------------------------------------------------------------------- */

static inline void set_bit(uint64_t *mask, int32_t id) { mask[id >> 6] |= (uint64_t)1 << (id & 63); }

/* True the first time key is seen in this mask. */
static bool first_time(k3_grammar_matcher *m, uint64_t key, bool *oom) {
    for (size_t i = 0; i < m->n_seen; i++)
        if (m->seen[i] == key) return false;
    if (!k3g_grow(&m->seen, &m->cap_seen, m->n_seen + 1, sizeof *m->seen)) {
        *oom = true;
        return false;
    }
    m->seen[m->n_seen++] = key;
    return true;
}

static void or_acc(const k3g_entry *e, uint64_t *mask, size_t words) {
    if (e->acc_bits) {
        const uint64_t *a = e->acc_bits;
        for (size_t w = 0; w < words; w++) mask[w] |= a[w];
    } else {
        for (int32_t i = 0; i < e->n_acc; i++) set_bit(mask, e->acc_list[i]);
    }
}

static void allowed_bytes(const k3_grammar *g, const k3g_cfg *c, size_t n, k3g_bset *out) {
    *out = (k3g_bset){{0}};
    for (size_t i = 0; i < n; i++) {
        const k3g_node *nd = &g->nodes[c[i].node];
        for (uint32_t j = 0; j < nd->nb; j++) {
            const k3g_bedge *e = &g->bedges[nd->b0 + j];
            k3g_bset_range(out, e->lo, e->hi);
        }
    }
}

/* The uncertain tokens of e that the stack below frame `stack` accepts;
 * with cnt, only those whose count lies in need..budget. */
static bool suffix_walk(k3_grammar_matcher *m, const k3g_entry *e, int32_t stack, uint64_t *mask, const int32_t *cnt,
                        int32_t need, int32_t budget) {
    const k3_grammar *g = m->g;
    const int32_t nf0 = m->gs.nf, ne0 = m->gs.ne;
    size_t depth_cap = 1;
    for (int32_t i = 0; i < e->n_sfx; i++)
        if ((size_t)e->s_depth[i] + 1 > depth_cap) depth_cap = (size_t)e->s_depth[i] + 1;
    if (!k3g_grow(&m->lv_off, &m->cap_lv, depth_cap + 1, sizeof *m->lv_off)) return false;
    if (!k3g_grow(&m->lv_allowed, &m->cap_lva, depth_cap, sizeof *m->lv_allowed)) return false;
    /* the rule's frame popped: its return node on each stack below */
    m->tb.n = 0;
    if (!k3g_gss_pop(&m->gs, stack, &m->tb)) return false;
    bool bottom = false;
    m->lv.n = 0;
    m->lv_off[0] = 0;
    if (!k3g_gss_closure(g, &m->gs, &m->cs, m->tb.v, m->tb.n, &m->lv, &bottom)) {
        k3g_gss_truncate(&m->gs, nf0, ne0);
        return false;
    }
    m->lv_off[1] = m->lv.n;
    bool ok = true;
    if (m->lv.n) {
        allowed_bytes(g, m->lv.v, m->lv.n, &m->lv_allowed[0]);
        for (int32_t i = 1; i < e->n_sfx;) {
            uint32_t d = e->s_depth[i];
            uint8_t c = e->s_byte[i];
            if (!k3g_bset_has(&m->lv_allowed[d - 1], c)) {
                i = (int32_t)e->s_next[i];
                continue;
            }
            m->lv.n = m->lv_off[d];
            size_t a = m->lv_off[d - 1], z = m->lv_off[d];
            /* the parent level may move when lv grows: scan from a copy of
             * its bounds, reading lv.v only through the index */
            k3g_cfgv *lv = &m->lv;
            bottom = false;
            size_t base = lv->n;
            for (size_t k = a; k < z; k++) {
                int32_t t = k3g_step(g, lv->v[k].node, c);
                if (t >= 0 && !k3g_cfgv_push(lv, (k3g_cfg){t, lv->v[k].stack})) {
                    ok = false;
                    break;
                }
            }
            if (!ok) break;
            size_t ns = lv->n - base;
            if (ns) {
                k3g_cfg small[16], *seeds = small;
                if (ns > 16 && !(seeds = malloc(ns * sizeof *seeds))) {
                    ok = false;
                    break;
                }
                memcpy(seeds, lv->v + base, ns * sizeof *seeds);
                lv->n = base;
                ok = k3g_gss_closure(g, &m->gs, &m->cs, seeds, ns, lv, &bottom);
                if (seeds != small) free(seeds);
                if (!ok) break;
            }
            if (lv->n == base && !bottom) {
                i = (int32_t)e->s_next[i];
                continue;
            }
            for (uint32_t k = e->s_tok0[i]; k < e->s_tok0[i + 1]; k++)
                if (!cnt || (cnt[k] >= need && cnt[k] <= budget)) set_bit(mask, e->s_toks[k]);
            m->lv_off[d + 1] = lv->n;
            if (lv->n > base) allowed_bytes(g, lv->v + base, lv->n - base, &m->lv_allowed[d]);
            else m->lv_allowed[d] = (k3g_bset){{0}};
            i++;
        }
    }
    k3g_gss_truncate(&m->gs, nf0, ne0);
    return ok;
}

static k3_status counted_node(k3_grammar_matcher *m, k3g_cfg c, const k3g_entry *e, int32_t budget, int32_t need,
                              uint64_t *mask, k3_error *err) {
    const k3_grammar *g = m->g;
    const k3_grammar_vocab *v = g->vocab;
    size_t words = v->n_words;
    const k3g_counted *ct = k3g_counted_get(v, -g->nodes[c.node].key - 1, err);
    if (!ct) return err && err->status ? err->status : K3_ERR_NOMEM;
    bool oom = false;
    uint64_t key = (uint64_t)(0x80000000u | (uint32_t)c.node) << 32;
    if (first_time(m, key | 0xFFFFFFFFu, &oom)) {
        if (!m->scratch && !(m->scratch = malloc(words * sizeof *m->scratch))) return nomem(err);
        uint64_t *x = m->scratch;
        memset(x, 0, words * sizeof *x);
        or_acc(e, x, words);
        /* most characters first: stop at the first that fits */
        for (int32_t k = 0; k < ct->n && ct->cnt[k] > budget; k++)
            x[ct->tok[k] >> 6] &= ~((uint64_t)1 << (ct->tok[k] & 63));
        for (int32_t k = 0; k < ct->n_close; k++)
            if (ct->close_cnt[k] < need || ct->close_cnt[k] > budget)
                x[ct->close_tok[k] >> 6] &= ~((uint64_t)1 << (ct->close_tok[k] & 63));
        for (size_t w = 0; w < words; w++) mask[w] |= x[w];
    }
    if (oom) return nomem(err);
    if (e->n_sfx > 1 && c.stack >= 0 && first_time(m, key | (uint32_t)c.stack, &oom)) {
        if (!suffix_walk(m, e, c.stack, mask, ct->s_cnt, need, budget)) return failed(m, "one token's mask", err);
    }
    return oom ? nomem(err) : K3_OK;
}

k3_status k3_grammar_matcher_fill_mask(k3_grammar_matcher *m, uint64_t *mask, k3_error *err) {
    const k3_grammar *g = m->g;
    const k3_grammar_vocab *v = g->vocab;
    size_t words = v->n_words;
    memset(mask, 0, words * sizeof *mask);
    const mstate st = m->hist[m->n_hist - 1];
    if (st.ended) return K3_OK;
    m->n_seen = 0;
    m->cs.budget = K3G_MASK_WORK;
    m->cs.over = false;
    bool oom = false;
    for (size_t i = 0; i < st.n; i++) {
        k3g_cfg c = m->cfgs.v[st.off + i];
        const k3g_node *nd = &g->nodes[c.node];
        for (uint32_t j = 0; j < nd->ns; j++) set_bit(mask, g->sedges[nd->s0 + j].id);
        if (nd->nb == 0) continue;
        const k3g_entry *e = k3g_entry_get(g, c.node, err);
        if (!e) return err && err->status ? err->status : K3_ERR_NOMEM;
        int32_t budget = g->budget ? g->budget[c.node] : -1;
        if (budget >= 0) {
            /* a length-limited string: the tail's table, less what is too long
             * (or ends too early) from here; the node itself is the key */
            K3_TRY(counted_node(m, c, e, budget, g->need[c.node], mask, err));
            continue;
        }
        uint64_t key = (uint64_t)(uint32_t)nd->key << 32;
        if (first_time(m, key | 0xFFFFFFFFu, &oom)) or_acc(e, mask, words);
        if (oom) return nomem(err);
        if (e->n_sfx > 1 && c.stack >= 0 && first_time(m, key | (uint32_t)c.stack, &oom)) {
            if (!suffix_walk(m, e, c.stack, mask, NULL, 0, 0)) return failed(m, "one token's mask", err);
        }
        if (oom) return nomem(err);
    }
    if (st.complete)
        for (int32_t i = 0; i < v->n_eos; i++) set_bit(mask, v->eos[i]);
    return K3_OK;
}

typedef struct batch {
    k3_grammar_matcher *const *m;
    uint64_t *const *masks;
    k3_status *st;
    k3_error *errs;
} batch;

static void batch_fn(void *ctx, int64_t lo, int64_t hi, int ith) {
    (void)ith;
    batch *b = ctx;
    for (int64_t i = lo; i < hi; i++) b->st[i] = k3_grammar_matcher_fill_mask(b->m[i], b->masks[i], &b->errs[i]);
}

k3_status k3_grammar_fill_masks(k3_grammar_matcher *const *matchers, uint64_t *const *masks, int32_t n, k3_pool *pool,
                                k3_error *err) {
    if (n <= 0) return K3_OK;
    k3_status *st = calloc((size_t)n, sizeof *st);
    k3_error *errs = calloc((size_t)n, sizeof *errs);
    if (!st || !errs) {
        free(st);
        free(errs);
        return nomem(err);
    }
    batch b = {matchers, masks, st, errs};
    k3_pool_for(pool, n, 1, batch_fn, &b);
    k3_status r = K3_OK;
    for (int32_t i = 0; i < n && r == K3_OK; i++)
        if (st[i] != K3_OK) r = k3_err(err, st[i], "request %d: %s", i, errs[i].msg);
    free(st);
    free(errs);
    return r;
}

void k3_grammar_mask_apply(const k3_grammar_vocab *v, const uint64_t *mask, float *logits, int32_t n_logits) {
    int32_t nv = v->n_vocab < n_logits ? v->n_vocab : n_logits;
    for (int32_t i = 0; i < nv; i++)
        if (!((mask[i >> 6] >> (i & 63)) & 1)) logits[i] = -INFINITY;
    for (int32_t i = nv; i < n_logits; i++) logits[i] = -INFINITY;
}

k3_status k3_grammar_matcher_forced(const k3_grammar_matcher *mc, char *buf, size_t cap, size_t *len, k3_error *err) {
    k3_grammar_matcher *m = (k3_grammar_matcher *)mc; /* scratch only; the state is restored */
    const k3_grammar *g = m->g;
    *len = 0;
    const mstate st = m->hist[m->n_hist - 1];
    if (st.ended || st.complete) return K3_OK;
    const int32_t nf0 = m->gs.nf, ne0 = m->gs.ne;
    m->cs.budget = K3G_ACCEPT_WORK;
    m->cs.over = false;
    k3g_cfgv *src = NULL, *dst = &m->ta;
    const k3g_cfg *c = m->cfgs.v ? m->cfgs.v + st.off : NULL;
    size_t n = st.n;
    k3_status r = K3_OK;
    while (*len < cap) {
        k3g_bset a;
        bool special = false;
        allowed_bytes(g, c, n, &a);
        for (size_t i = 0; i < n; i++)
            if (g->nodes[c[i].node].ns) special = true;
        int count = 0, only = -1;
        for (int w = 0; w < 4; w++) count += __builtin_popcountll(a.w[w]);
        if (count != 1 || special) break;
        for (unsigned b = 0; b < 256; b++)
            if (k3g_bset_has(&a, b)) only = (int)b;
        dst->n = 0;
        bool bottom = false;
        if (!k3g_gss_scan_byte(g, &m->gs, &m->cs, c, n, (unsigned)only, dst, &bottom)) {
            r = failed(m, "a forced byte", err);
            break;
        }
        buf[(*len)++] = (char)only;
        if (bottom || dst->n == 0) break;
        src = dst;
        dst = dst == &m->ta ? &m->tb : &m->ta;
        c = src->v;
        n = src->n;
    }
    k3g_gss_truncate(&m->gs, nf0, ne0);
    return r;
}
