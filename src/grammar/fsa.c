/*
 * fsa.c -- byte automata: the NFAs the front ends build, subset
 * construction into DFAs (byte edges as disjoint ranges, one edge per
 * symbol), products, complements, and the encoding of raw text as the
 * inside of a JSON string literal.
 *
 * Every DFA this file returns is trimmed: each state is reachable from the
 * start and can reach a final state, so a DFA with no states is the empty
 * language and any prefix a DFA can read can be completed.
 */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "grammar/fsa.h"

/* ---- helpers ------------------------------------------------------------- */

bool k3g_grow(void *p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return true;
    size_t c = *cap ? *cap : 8;
    while (c < need) {
        if (c > SIZE_MAX / 2) return false;
        c *= 2;
    }
    if (c > SIZE_MAX / elem) return false;
    void **pp = p;
    void *q = realloc(*pp, c * elem);
    if (!q) return false;
    *pp = q;
    *cap = c;
    return true;
}

void k3g_bset_range(k3g_bset *s, unsigned lo, unsigned hi) {
    if (hi > 255) hi = 255;
    for (unsigned w = lo >> 6; lo <= hi && w <= (hi >> 6); w++) {
        unsigned a = w == (lo >> 6) ? lo & 63 : 0, z = w == (hi >> 6) ? hi & 63 : 63;
        uint64_t m = (z == 63 ? ~(uint64_t)0 : (((uint64_t)1 << (z + 1)) - 1)) & ~(((uint64_t)1 << a) - 1);
        s->w[w] |= m;
    }
}

typedef struct k3g_arena_blk {
    struct k3g_arena_blk *next;
    size_t used, size;
    max_align_t data[];
} k3g_arena_blk;

void *k3g_alloc(k3g_arena *a, size_t n) {
    n = (n + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
    k3g_arena_blk *h = a->head;
    if (!h || h->size - h->used < n) {
        size_t sz = n > (64 << 10) ? n : (64 << 10);
        h = malloc(sizeof *h + sz);
        if (!h) {
            a->oom = true;
            return NULL;
        }
        h->next = a->head;
        h->used = 0;
        h->size = sz;
        a->head = h;
    }
    void *p = (char *)h->data + h->used;
    h->used += n;
    memset(p, 0, n);
    return p;
}

void k3g_arena_free(k3g_arena *a) {
    for (k3g_arena_blk *h = a->head, *nx; h; h = nx) {
        nx = h->next;
        free(h);
    }
    a->head = NULL;
}

/* ---- building ------------------------------------------------------------ */

void k3g_fa_free(k3g_fa *fa) {
    free(fa->final);
    free(fa->e);
    free(fa->first);
    *fa = (k3g_fa){0};
}

int32_t k3g_fa_state(k3g_fa *fa) {
    if (fa->oom || fa->too_big) return -1;
    if (fa->n >= K3G_MAX_NFA_STATES) {
        fa->too_big = true;
        return -1;
    }
    if (!k3g_grow(&fa->final, &fa->cap, (size_t)fa->n + 1, 1)) {
        fa->oom = true;
        return -1;
    }
    fa->final[fa->n] = 0;
    free(fa->first);
    fa->first = NULL;
    return fa->n++;
}

void k3g_fa_edge(k3g_fa *fa, int32_t from, int32_t to, int32_t sym, unsigned lo, unsigned hi) {
    if (fa->oom || fa->too_big || from < 0 || to < 0) return;
    if (sym == K3G_BYTE && lo > hi) return;
    if (!k3g_grow(&fa->e, &fa->cap_e, fa->ne + 1, sizeof *fa->e)) {
        fa->oom = true;
        return;
    }
    fa->e[fa->ne++] = (k3g_fedge){from, to, sym, (uint8_t)lo, (uint8_t)hi};
    free(fa->first);
    fa->first = NULL;
}

void k3g_fa_bytes(k3g_fa *fa, int32_t from, int32_t to, const void *s, size_t n) {
    const uint8_t *p = s;
    if (n == 0) {
        k3g_fa_eps(fa, from, to);
        return;
    }
    int32_t cur = from;
    for (size_t i = 0; i < n; i++) {
        int32_t nx = i + 1 == n ? to : k3g_fa_state(fa);
        k3g_fa_byte(fa, cur, nx, p[i], p[i]);
        cur = nx;
    }
}

static int edge_cmp(const void *a, const void *b) {
    const k3g_fedge *x = a, *y = b;
    if (x->from != y->from) return x->from < y->from ? -1 : 1;
    if (x->sym != y->sym) return x->sym < y->sym ? -1 : 1;
    if (x->lo != y->lo) return x->lo < y->lo ? -1 : 1;
    if (x->to != y->to) return x->to < y->to ? -1 : 1;
    return 0;
}

bool k3g_fa_index(k3g_fa *fa) {
    if (fa->oom) return false;
    if (fa->first) return true;
    bool sorted = true;
    for (size_t i = 1; i < fa->ne && sorted; i++) sorted = edge_cmp(&fa->e[i - 1], &fa->e[i]) <= 0;
    if (!sorted) qsort(fa->e, fa->ne, sizeof *fa->e, edge_cmp);
    fa->first = malloc(((size_t)fa->n + 1) * sizeof *fa->first);
    if (!fa->first) return false;
    size_t j = 0;
    for (int32_t s = 0; s <= fa->n; s++) {
        while (j < fa->ne && fa->e[j].from < s) j++;
        fa->first[s] = (int32_t)j;
    }
    return true;
}

void k3g_fa_embed(k3g_fa *dst, const k3g_fa *src, int32_t from, int32_t to) {
    if (src->n == 0) return; /* the empty language: no path */
    int32_t base = dst->n;
    for (int32_t i = 0; i < src->n; i++)
        if (k3g_fa_state(dst) < 0) return;
    for (size_t i = 0; i < src->ne; i++) {
        const k3g_fedge *e = &src->e[i];
        k3g_fa_edge(dst, base + e->from, base + e->to, e->sym, e->lo, e->hi);
    }
    k3g_fa_eps(dst, from, base + src->start);
    for (int32_t i = 0; i < src->n; i++)
        if (src->final[i]) k3g_fa_eps(dst, base + i, to);
}

/* ---- UTF-8 ranges -----------------------------------------------------------
 * The code points lo..hi as byte-range sequences, each range of each
 * position being a whole block, the way RE2 and Rust's utf8-ranges split
 * them: first at the encoded-length boundaries, then until every
 * continuation position spans 80..BF or the low bits agree. */

static int utf8_len(uint32_t c) { return c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4; }

static void utf8_enc(uint32_t c, uint8_t *o) {
    switch (utf8_len(c)) {
    case 1: o[0] = (uint8_t)c; break;
    case 2:
        o[0] = (uint8_t)(0xC0 | c >> 6);
        o[1] = (uint8_t)(0x80 | (c & 0x3F));
        break;
    case 3:
        o[0] = (uint8_t)(0xE0 | c >> 12);
        o[1] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
        o[2] = (uint8_t)(0x80 | (c & 0x3F));
        break;
    default:
        o[0] = (uint8_t)(0xF0 | c >> 18);
        o[1] = (uint8_t)(0x80 | ((c >> 12) & 0x3F));
        o[2] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
        o[3] = (uint8_t)(0x80 | (c & 0x3F));
        break;
    }
}

static void utf8_split(k3g_fa *fa, int32_t from, int32_t to, uint32_t lo, uint32_t hi) {
    if (lo > hi) return;
    static const uint32_t lim[] = {0x7F, 0x7FF, 0xFFFF, 0x10FFFF};
    for (int i = 0; i < 3; i++) {
        if (lo <= lim[i] && hi > lim[i]) {
            utf8_split(fa, from, to, lo, lim[i]);
            utf8_split(fa, from, to, lim[i] + 1, hi);
            return;
        }
    }
    if (hi < 0x80) {
        k3g_fa_byte(fa, from, to, lo, hi);
        return;
    }
    int n = utf8_len(lo);
    for (int i = 1; i < n; i++) {
        uint32_t m = ((uint32_t)1 << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                utf8_split(fa, from, to, lo, lo | m);
                utf8_split(fa, from, to, (lo | m) + 1, hi);
                return;
            }
            if ((hi & m) != m) {
                utf8_split(fa, from, to, lo, (hi & ~m) - 1);
                utf8_split(fa, from, to, hi & ~m, hi);
                return;
            }
        }
    }
    uint8_t a[4], b[4];
    utf8_enc(lo, a);
    utf8_enc(hi, b);
    int32_t cur = from;
    for (int i = 0; i < n; i++) {
        int32_t nx = i + 1 == n ? to : k3g_fa_state(fa);
        k3g_fa_byte(fa, cur, nx, a[i], b[i]);
        cur = nx;
    }
}

void k3g_fa_utf8(k3g_fa *fa, int32_t from, int32_t to, uint32_t lo, uint32_t hi) {
    if (hi > 0x10FFFF) hi = 0x10FFFF;
    if (lo > hi) return;
    if (lo < 0xD800 && hi >= 0xD800) {
        utf8_split(fa, from, to, lo, 0xD7FF);
        if (hi > 0xDFFF) utf8_split(fa, from, to, 0xE000, hi);
        return;
    }
    if (lo >= 0xD800 && lo <= 0xDFFF) {
        if (hi <= 0xDFFF) return;
        lo = 0xE000;
    }
    utf8_split(fa, from, to, lo, hi);
}

/* ---- subset construction ---------------------------------------------------- */

typedef struct setpool {
    int32_t *v; /* members of every set back to back */
    size_t n, cap;
    size_t *off; /* [n_sets + 1] */
    size_t cap_off;
    int32_t n_sets;
    int32_t *slot; /* hash: set index or -1 */
    uint32_t mask;
} setpool;

static uint64_t hash_ints(const int32_t *v, size_t n) {
    uint64_t h = 1469598103934665603u ^ n;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint32_t)v[i];
        h *= 1099511628211u;
        h ^= h >> 29;
    }
    return h;
}

static void setpool_free(setpool *p) {
    free(p->v);
    free(p->off);
    free(p->slot);
}

static bool setpool_rehash(setpool *p) {
    uint32_t ns = p->mask ? (p->mask + 1) * 2 : 1024;
    int32_t *slot = malloc((size_t)ns * sizeof *slot);
    if (!slot) return false;
    for (uint32_t i = 0; i < ns; i++) slot[i] = -1;
    for (int32_t s = 0; s < p->n_sets; s++) {
        uint64_t h = hash_ints(p->v + p->off[s], p->off[s + 1] - p->off[s]);
        uint32_t i = (uint32_t)h & (ns - 1);
        while (slot[i] >= 0) i = (i + 1) & (ns - 1);
        slot[i] = s;
    }
    free(p->slot);
    p->slot = slot;
    p->mask = ns - 1;
    return true;
}

/* The index of set v[0..n) (sorted), added if new; -1 on allocation
 * failure. *added tells which. */
static int32_t setpool_get(setpool *p, const int32_t *v, size_t n, bool *added) {
    *added = false;
    if (!p->slot || (uint32_t)p->n_sets * 2 >= p->mask) {
        if (!setpool_rehash(p)) return -1;
    }
    uint64_t h = hash_ints(v, n);
    uint32_t i = (uint32_t)h & p->mask;
    for (; p->slot[i] >= 0; i = (i + 1) & p->mask) {
        int32_t s = p->slot[i];
        size_t sn = p->off[s + 1] - p->off[s];
        if (sn == n && !memcmp(p->v + p->off[s], v, n * sizeof *v)) return s;
    }
    if (!k3g_grow(&p->v, &p->cap, p->n + n, sizeof *p->v)) return -1;
    if (!k3g_grow(&p->off, &p->cap_off, (size_t)p->n_sets + 2, sizeof *p->off)) return -1;
    if (p->n_sets == 0) p->off[0] = 0;
    memcpy(p->v + p->n, v, n * sizeof *v);
    p->n += n;
    p->off[p->n_sets + 1] = p->n;
    p->slot[i] = p->n_sets;
    *added = true;
    return p->n_sets++;
}

static int int_cmp(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

typedef struct closer {
    const k3g_fa *nfa;
    uint32_t *mark;
    uint32_t gen;
    int32_t *stack;
    size_t cap_stack;
    int32_t *out;
    size_t n_out, cap_out;
} closer;

/* The epsilon closure of seeds, sorted, in c->out. */
static bool eclose(closer *c, const int32_t *seeds, size_t n) {
    const k3g_fa *f = c->nfa;
    c->gen++;
    c->n_out = 0;
    size_t sp = 0;
    for (size_t i = 0; i < n; i++) {
        if (c->mark[seeds[i]] == c->gen) continue;
        c->mark[seeds[i]] = c->gen;
        if (!k3g_grow(&c->stack, &c->cap_stack, sp + 1, sizeof *c->stack)) return false;
        c->stack[sp++] = seeds[i];
    }
    while (sp) {
        int32_t s = c->stack[--sp];
        if (!k3g_grow(&c->out, &c->cap_out, c->n_out + 1, sizeof *c->out)) return false;
        c->out[c->n_out++] = s;
        for (int32_t j = f->first[s]; j < f->first[s + 1]; j++) {
            const k3g_fedge *e = &f->e[j];
            if (e->sym != K3G_EPS) break; /* sorted: EPS (-2) first */
            if (c->mark[e->to] == c->gen) continue;
            c->mark[e->to] = c->gen;
            if (!k3g_grow(&c->stack, &c->cap_stack, sp + 1, sizeof *c->stack)) return false;
            c->stack[sp++] = e->to;
        }
    }
    qsort(c->out, c->n_out, sizeof *c->out, int_cmp);
    return true;
}

/* Keeps the states of a DFA that are reachable and co-reachable; renumbers. */
bool k3g_fa_trim(k3g_fa *d, int32_t *omap) {
    if (!k3g_fa_index(d)) return false;
    int32_t n = d->n;
    if (n == 0) return true;
    uint8_t *fw = calloc((size_t)n, 1), *bw = calloc((size_t)n, 1);
    int32_t *q = malloc((size_t)n * sizeof *q), *map = malloc((size_t)n * sizeof *map);
    int32_t *rfirst = calloc((size_t)n + 1, sizeof *rfirst), *rsrc = malloc((d->ne + 1) * sizeof *rsrc);
    bool ok = fw && bw && q && map && rfirst && rsrc;
    if (ok) {
        size_t qh = 0, qt = 0;
        fw[d->start] = 1;
        q[qt++] = d->start;
        while (qh < qt) {
            int32_t s = q[qh++];
            for (int32_t j = d->first[s]; j < d->first[s + 1]; j++)
                if (!fw[d->e[j].to]) {
                    fw[d->e[j].to] = 1;
                    q[qt++] = d->e[j].to;
                }
        }
        for (size_t j = 0; j < d->ne; j++) rfirst[d->e[j].to + 1]++;
        for (int32_t s = 0; s < n; s++) rfirst[s + 1] += rfirst[s];
        int32_t *fill = map; /* reuse as a cursor */
        for (int32_t s = 0; s < n; s++) fill[s] = rfirst[s];
        for (size_t j = 0; j < d->ne; j++) rsrc[fill[d->e[j].to]++] = d->e[j].from;
        qh = qt = 0;
        for (int32_t s = 0; s < n; s++)
            if (d->final[s]) {
                bw[s] = 1;
                q[qt++] = s;
            }
        while (qh < qt) {
            int32_t s = q[qh++];
            for (int32_t j = rfirst[s]; j < rfirst[s + 1]; j++)
                if (!bw[rsrc[j]]) {
                    bw[rsrc[j]] = 1;
                    q[qt++] = rsrc[j];
                }
        }
        int32_t m = 0;
        for (int32_t s = 0; s < n; s++) map[s] = fw[s] && bw[s] ? m++ : -1;
        if (map[d->start] < 0) {
            m = 0;
            for (int32_t s = 0; s < n; s++) map[s] = -1;
        }
        if (omap) memcpy(omap, map, (size_t)n * sizeof *map);
        size_t ne = 0;
        if (m > 0) {
            for (size_t j = 0; j < d->ne; j++) {
                k3g_fedge e = d->e[j];
                if (map[e.from] < 0 || map[e.to] < 0) continue;
                e.from = map[e.from];
                e.to = map[e.to];
                d->e[ne++] = e;
            }
            for (int32_t s = 0; s < n; s++)
                if (map[s] >= 0) d->final[map[s]] = d->final[s];
            d->start = map[d->start];
        } else {
            d->start = 0;
        }
        d->n = m;
        d->ne = ne;
        free(d->first);
        d->first = NULL;
        ok = k3g_fa_index(d);
    }
    free(fw);
    free(bw);
    free(q);
    free(map);
    free(rfirst);
    free(rsrc);
    return ok;
}

typedef struct tgt {
    int32_t sym;
    uint8_t lo, hi;
    int32_t to;
} tgt;

/* ---- a compile's stop -------------------------------------------------------------- */

static _Thread_local k3g_stop *cur_stop;

void k3g_stop_set(k3g_stop *s) { cur_stop = s; }

bool k3g_stopped(k3_error *err, const char *what) {
    k3g_stop *s = cur_stop;
    if (!s) return false;
    if (s->why != K3_OK) return true;
    const double now = k3_now();
    if (s->deadline > 0 && now > s->deadline) {
        s->why = k3_err(err, K3_ERR_UNSUPPORTED, "%s: compiling it takes longer than the budget of %.0f s",
                        what ? what : "the grammar", s->budget_s);
        return true;
    }
    if (s->cancel && now >= s->next_cancel) {
        s->next_cancel = now + 0.01;
        if (s->cancel(s->ctx)) {
            s->why =
                k3_err(err, K3_ERR_IO, "%s: the compile was stopped (the client left)", what ? what : "the grammar");
            return true;
        }
    }
    return false;
}

k3_status k3g_fa_determinize(const k3g_fa *nfa_in, k3g_fa *out, const char *what, k3_error *err) {
    *out = (k3g_fa){0};
    k3g_fa *nfa = (k3g_fa *)nfa_in; /* indexing sorts the edges, nothing else */
    if (nfa->oom) return k3_err(err, K3_ERR_NOMEM, "out of memory building %s", what);
    if (nfa->too_big)
        return k3_err(err, K3_ERR_UNSUPPORTED, "%s is too large (over %d automaton states)", what, K3G_MAX_NFA_STATES);
    if (nfa->n == 0) return K3_OK;
    if (!k3g_fa_index(nfa)) return k3_err(err, K3_ERR_NOMEM, "out of memory building %s", what);

    setpool sp = {0};
    closer c = {.nfa = nfa};
    tgt *tg = NULL;
    size_t cap_tg = 0;
    int32_t *seeds = NULL;
    size_t cap_seeds = 0;
    k3_status st = K3_OK;
    c.mark = calloc((size_t)nfa->n, sizeof *c.mark);
    if (!c.mark) st = K3_ERR_NOMEM;
    bool added;
    if (st == K3_OK) {
        int32_t s0 = nfa->start;
        if (!eclose(&c, &s0, 1) || setpool_get(&sp, c.out, c.n_out, &added) < 0) st = K3_ERR_NOMEM;
    }
    for (int32_t d = 0; st == K3_OK && d < sp.n_sets; d++) {
        if (k3g_fa_state(out) < 0) {
            st = out->too_big ? K3_ERR_UNSUPPORTED : K3_ERR_NOMEM;
            break;
        }
        /* states, and the NFA states they hold: a pattern such as
         * [a-z]*x[a-z]{200} has few of the first and very many of the second */
        if (sp.n_sets > K3G_MAX_DFA_STATES || sp.n > (size_t)8 * K3G_MAX_DFA_STATES) {
            st = K3_ERR_UNSUPPORTED;
            break;
        }
        if ((d & 255) == 0 && k3g_stopped(err, what)) {
            st = K3_ERR_RANGE; /* the error is written */
            break;
        }
        /* gather the non-epsilon edges of the members */
        size_t nt = 0;
        size_t a = sp.off[d], z = sp.off[d + 1];
        for (size_t k = a; k < z && st == K3_OK; k++) {
            int32_t s = sp.v[k];
            if (nfa->final[s]) out->final[d] = 1;
            for (int32_t j = nfa->first[s]; j < nfa->first[s + 1]; j++) {
                const k3g_fedge *e = &nfa->e[j];
                if (e->sym == K3G_EPS) continue;
                if (!k3g_grow(&tg, &cap_tg, nt + 1, sizeof *tg)) {
                    st = K3_ERR_NOMEM;
                    break;
                }
                tg[nt++] = (tgt){e->sym, e->lo, e->hi, e->to};
            }
        }
        if (st != K3_OK) break;
        /* bytes: the elementary intervals between range boundaries */
        uint8_t bnd[257] = {0};
        bool any_byte = false;
        for (size_t k = 0; k < nt; k++)
            if (tg[k].sym == K3G_BYTE) {
                bnd[tg[k].lo] = 1;
                bnd[tg[k].hi + 1] = 1;
                any_byte = true;
            }
        int32_t prev_to = -1;
        int prev_hi = -2;
        for (int lo = 0; any_byte && lo < 256 && st == K3_OK;) {
            int hi = lo;
            while (hi + 1 < 256 && !bnd[hi + 1]) hi++;
            size_t ns = 0;
            for (size_t k = 0; k < nt; k++)
                if (tg[k].sym == K3G_BYTE && tg[k].lo <= lo && lo <= tg[k].hi) {
                    if (!k3g_grow(&seeds, &cap_seeds, ns + 1, sizeof *seeds)) {
                        st = K3_ERR_NOMEM;
                        break;
                    }
                    seeds[ns++] = tg[k].to;
                }
            if (st == K3_OK && ns) {
                int32_t t;
                if (!eclose(&c, seeds, ns) || (t = setpool_get(&sp, c.out, c.n_out, &added)) < 0) {
                    st = K3_ERR_NOMEM;
                    break;
                }
                if (t == prev_to && prev_hi == lo - 1 && out->ne && out->e[out->ne - 1].from == d &&
                    out->e[out->ne - 1].sym == K3G_BYTE) {
                    out->e[out->ne - 1].hi = (uint8_t)hi;
                } else {
                    k3g_fa_byte(out, d, t, (unsigned)lo, (unsigned)hi);
                }
                prev_to = t;
                prev_hi = hi;
            }
            lo = hi + 1;
        }
        /* symbols: group by symbol */
        for (size_t k = 0; k < nt && st == K3_OK; k++) {
            if (tg[k].sym == K3G_BYTE) continue;
            int32_t sym = tg[k].sym;
            bool seen = false;
            for (size_t q = 0; q < k; q++)
                if (tg[q].sym == sym) seen = true;
            if (seen) continue;
            size_t ns = 0;
            for (size_t q = k; q < nt; q++)
                if (tg[q].sym == sym) {
                    if (!k3g_grow(&seeds, &cap_seeds, ns + 1, sizeof *seeds)) {
                        st = K3_ERR_NOMEM;
                        break;
                    }
                    seeds[ns++] = tg[q].to;
                }
            int32_t t;
            if (st == K3_OK && (!eclose(&c, seeds, ns) || (t = setpool_get(&sp, c.out, c.n_out, &added)) < 0))
                st = K3_ERR_NOMEM;
            if (st == K3_OK) k3g_fa_edge(out, d, t, sym, 0, 0);
        }
        if (out->oom) st = K3_ERR_NOMEM;
    }
    if (st == K3_OK && out->oom) st = K3_ERR_NOMEM;
    out->start = 0;
    if (st == K3_OK && !k3g_fa_trim(out, NULL)) st = K3_ERR_NOMEM;
    setpool_free(&sp);
    free(c.mark);
    free(c.stack);
    free(c.out);
    free(tg);
    free(seeds);
    if (st != K3_OK) {
        k3g_fa_free(out);
        if (st == K3_ERR_RANGE) return err && err->status ? err->status : K3_ERR_UNSUPPORTED; /* stopped */
        if (st == K3_ERR_UNSUPPORTED)
            return k3_err(err, st, "%s is too large (over %d automaton states)", what, K3G_MAX_DFA_STATES);
        return k3_err(err, K3_ERR_NOMEM, "out of memory building %s", what);
    }
    return K3_OK;
}

/* ---- products and complements -------------------------------------------------- */

typedef struct pairmap {
    uint64_t *key;
    int32_t *val;
    uint32_t mask;
    int32_t n;
} pairmap;

static int32_t pair_get(pairmap *m, int32_t a, int32_t b, bool *added) {
    *added = false;
    if (!m->key || (uint32_t)m->n * 2 >= m->mask) {
        uint32_t ns = m->mask ? (m->mask + 1) * 2 : 1024;
        uint64_t *k = malloc((size_t)ns * sizeof *k);
        int32_t *v = malloc((size_t)ns * sizeof *v);
        if (!k || !v) {
            free(k);
            free(v);
            return -1;
        }
        for (uint32_t i = 0; i < ns; i++) v[i] = -1;
        for (uint32_t i = 0; m->key && i <= m->mask; i++) {
            if (m->val[i] < 0) continue;
            uint64_t h = m->key[i] * 0x9e3779b97f4a7c15u;
            uint32_t j = (uint32_t)(h >> 32) & (ns - 1);
            while (v[j] >= 0) j = (j + 1) & (ns - 1);
            k[j] = m->key[i];
            v[j] = m->val[i];
        }
        free(m->key);
        free(m->val);
        m->key = k;
        m->val = v;
        m->mask = ns - 1;
    }
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint64_t h = key * 0x9e3779b97f4a7c15u;
    uint32_t j = (uint32_t)(h >> 32) & m->mask;
    for (; m->val[j] >= 0; j = (j + 1) & m->mask)
        if (m->key[j] == key) return m->val[j];
    m->key[j] = key;
    m->val[j] = m->n;
    *added = true;
    return m->n++;
}

k3_status k3g_fa_intersect(const k3g_fa *a_in, const k3g_fa *b_in, k3g_fa *out, const char *what, k3_error *err) {
    *out = (k3g_fa){0};
    k3g_fa *a = (k3g_fa *)a_in, *b = (k3g_fa *)b_in;
    if (a->n == 0 || b->n == 0) return K3_OK;
    if (!k3g_fa_index(a) || !k3g_fa_index(b)) return k3_err(err, K3_ERR_NOMEM, "out of memory building %s", what);
    pairmap m = {0};
    int32_t *qa = NULL, *qb = NULL;
    size_t cap_q = 0;
    k3_status st = K3_OK;
    bool added;
    if (pair_get(&m, a->start, b->start, &added) < 0 || !k3g_grow(&qa, &cap_q, 1, sizeof *qa)) st = K3_ERR_NOMEM;
    size_t cap_qb = 0;
    if (st == K3_OK && !k3g_grow(&qb, &cap_qb, 1, sizeof *qb)) st = K3_ERR_NOMEM;
    if (st == K3_OK) {
        qa[0] = a->start;
        qb[0] = b->start;
    }
    for (int32_t d = 0; st == K3_OK && d < m.n; d++) {
        if (k3g_fa_state(out) < 0 || d > K3G_MAX_DFA_STATES) {
            st = out->oom ? K3_ERR_NOMEM : K3_ERR_UNSUPPORTED;
            break;
        }
        if ((d & 255) == 0 && k3g_stopped(err, what)) {
            st = K3_ERR_RANGE; /* the error is written */
            break;
        }
        int32_t x = qa[d], y = qb[d];
        out->final[d] = a->final[x] && b->final[y];
        int32_t i = a->first[x], ie = a->first[x + 1], j = b->first[y], je = b->first[y + 1];
        /* bytes */
        int32_t i0 = i, j0 = j;
        while (i < ie && a->e[i].sym == K3G_BYTE && j < je && b->e[j].sym == K3G_BYTE) {
            const k3g_fedge *p = &a->e[i], *q = &b->e[j];
            unsigned lo = p->lo > q->lo ? p->lo : q->lo, hi = p->hi < q->hi ? p->hi : q->hi;
            if (lo <= hi) {
                int32_t t = pair_get(&m, p->to, q->to, &added);
                if (t < 0) {
                    st = K3_ERR_NOMEM;
                    break;
                }
                if (added) {
                    if (!k3g_grow(&qa, &cap_q, (size_t)m.n, sizeof *qa) ||
                        !k3g_grow(&qb, &cap_qb, (size_t)m.n, sizeof *qb)) {
                        st = K3_ERR_NOMEM;
                        break;
                    }
                    qa[t] = p->to;
                    qb[t] = q->to;
                }
                k3g_fa_byte(out, d, t, lo, hi);
            }
            if (p->hi < q->hi) i++;
            else j++;
        }
        /* symbols */
        for (i = i0; i < ie && st == K3_OK; i++) {
            if (a->e[i].sym == K3G_BYTE) continue;
            for (j = j0; j < je; j++) {
                if (b->e[j].sym != a->e[i].sym) continue;
                int32_t t = pair_get(&m, a->e[i].to, b->e[j].to, &added);
                if (t < 0) {
                    st = K3_ERR_NOMEM;
                    break;
                }
                if (added) {
                    if (!k3g_grow(&qa, &cap_q, (size_t)m.n, sizeof *qa) ||
                        !k3g_grow(&qb, &cap_qb, (size_t)m.n, sizeof *qb)) {
                        st = K3_ERR_NOMEM;
                        break;
                    }
                    qa[t] = a->e[i].to;
                    qb[t] = b->e[j].to;
                }
                k3g_fa_edge(out, d, t, a->e[i].sym, 0, 0);
            }
        }
        if (out->oom) st = K3_ERR_NOMEM;
    }
    out->start = 0;
    if (st == K3_OK && !k3g_fa_trim(out, NULL)) st = K3_ERR_NOMEM;
    free(m.key);
    free(m.val);
    free(qa);
    free(qb);
    if (st != K3_OK) {
        k3g_fa_free(out);
        if (st == K3_ERR_RANGE) return err && err->status ? err->status : K3_ERR_UNSUPPORTED; /* stopped */
        if (st == K3_ERR_UNSUPPORTED)
            return k3_err(err, st, "%s is too large (over %d automaton states)", what, K3G_MAX_DFA_STATES);
        return k3_err(err, K3_ERR_NOMEM, "out of memory building %s", what);
    }
    return K3_OK;
}

k3_status k3g_fa_complement(const k3g_fa *a_in, k3g_fa *out, k3_error *err) {
    *out = (k3g_fa){0};
    k3g_fa *a = (k3g_fa *)a_in;
    if (!k3g_fa_index(a)) return k3_err(err, K3_ERR_NOMEM, "out of memory building a complement");
    k3g_fa t = {0};
    for (int32_t s = 0; s <= a->n; s++) k3g_fa_state(&t);
    int32_t sink = a->n;
    for (int32_t s = 0; s < a->n; s++) {
        t.final[s] = !a->final[s];
        unsigned next = 0;
        for (int32_t j = a->first[s]; j < a->first[s + 1]; j++) {
            const k3g_fedge *e = &a->e[j];
            if (e->sym != K3G_BYTE) continue;
            if (e->lo > next) k3g_fa_byte(&t, s, sink, next, e->lo - 1u);
            k3g_fa_byte(&t, s, e->to, e->lo, e->hi);
            next = e->hi + 1u;
        }
        if (next <= 255) k3g_fa_byte(&t, s, sink, next, 255);
    }
    t.final[sink] = 1;
    k3g_fa_byte(&t, sink, sink, 0, 255);
    t.start = a->n ? a->start : sink;
    k3_status st = K3_OK;
    if (t.oom) st = k3_err(err, K3_ERR_NOMEM, "out of memory building a complement");
    else if (!k3g_fa_trim(&t, NULL)) st = k3_err(err, K3_ERR_NOMEM, "out of memory building a complement");
    if (st != K3_OK) {
        k3g_fa_free(&t);
        return st;
    }
    *out = t;
    return K3_OK;
}

/* ---- JSON string encoding ------------------------------------------------------ */

static const char HEXL[] = "0123456789abcdef", HEXU[] = "0123456789ABCDEF";

k3_status k3g_fa_json_encode(const k3g_fa *raw_in, k3g_fa *out, const char *what, k3_error *err) {
    *out = (k3g_fa){0};
    k3g_fa *raw = (k3g_fa *)raw_in;
    if (raw->n == 0) return K3_OK;
    if (!k3g_fa_index(raw)) return k3_err(err, K3_ERR_NOMEM, "out of memory building %s", what);
    k3g_fa t = {0};
    for (int32_t s = 0; s < raw->n; s++) {
        k3g_fa_state(&t);
        if (t.final) t.final[s] = raw->final[s];
    }
    t.start = raw->start;
    for (int32_t s = 0; s < raw->n; s++) {
        int32_t esc = -1, u[4] = {-1, -1, -1, -1}; /* after \, \u, \u0, \u00 */
        int32_t hi1[2] = {-1, -1};                 /* after \u000 and \u001 */
        for (int32_t j = raw->first[s]; j < raw->first[s + 1]; j++) {
            const k3g_fedge *e = &raw->e[j];
            if (e->sym != K3G_BYTE) continue;
            for (unsigned c = e->lo; c <= e->hi;) {
                if (c >= 0x20 && c != '"' && c != '\\') {
                    /* a raw run up to the next byte that needs an escape */
                    unsigned z = c;
                    while (z < e->hi && z + 1 != '"' && z + 1 != '\\') z++;
                    k3g_fa_byte(&t, s, e->to, c, z);
                    if (c <= '/' && '/' <= z) {
                        if (esc < 0) {
                            esc = k3g_fa_state(&t);
                            k3g_fa_byte(&t, s, esc, '\\', '\\');
                        }
                        k3g_fa_byte(&t, esc, e->to, '/', '/');
                    }
                    c = z + 1;
                    continue;
                }
                if (esc < 0) {
                    esc = k3g_fa_state(&t);
                    k3g_fa_byte(&t, s, esc, '\\', '\\');
                }
                if (c == '"' || c == '\\') {
                    k3g_fa_byte(&t, esc, e->to, c, c);
                } else {
                    static const char shortesc[32] =
                        {['\b'] = 'b', ['\f'] = 'f', ['\n'] = 'n', ['\r'] = 'r', ['\t'] = 't'};
                    if (shortesc[c]) k3g_fa_byte(&t, esc, e->to, (uint8_t)shortesc[c], (uint8_t)shortesc[c]);
                    if (u[0] < 0) {
                        u[0] = k3g_fa_state(&t);
                        u[1] = k3g_fa_state(&t);
                        u[2] = k3g_fa_state(&t);
                        k3g_fa_byte(&t, esc, u[0], 'u', 'u');
                        k3g_fa_byte(&t, u[0], u[1], '0', '0');
                        k3g_fa_byte(&t, u[1], u[2], '0', '0');
                    }
                    int h = (int)(c >> 4);
                    if (hi1[h] < 0) {
                        hi1[h] = k3g_fa_state(&t);
                        k3g_fa_byte(&t, u[2], hi1[h], (uint8_t)('0' + h), (uint8_t)('0' + h));
                    }
                    char l = HEXL[c & 15], U = HEXU[c & 15];
                    k3g_fa_byte(&t, hi1[h], e->to, (uint8_t)l, (uint8_t)l);
                    if (U != l) k3g_fa_byte(&t, hi1[h], e->to, (uint8_t)U, (uint8_t)U);
                }
                c++;
            }
        }
    }
    if (t.oom || t.too_big) {
        k3g_fa_free(&t);
        return k3_err(err, K3_ERR_NOMEM, "out of memory building %s", what);
    }
    k3_status st = k3g_fa_determinize(&t, out, what, err);
    k3g_fa_free(&t);
    return st;
}

/* ---- queries and stock automata ---------------------------------------------- */

bool k3g_fa_accepts(const k3g_fa *d_in, const void *s, size_t n) {
    k3g_fa *d = (k3g_fa *)d_in;
    if (d->n == 0 || !k3g_fa_index(d)) return false;
    const uint8_t *p = s;
    int32_t cur = d->start;
    for (size_t i = 0; i < n; i++) {
        int32_t nx = -1;
        for (int32_t j = d->first[cur]; j < d->first[cur + 1]; j++) {
            const k3g_fedge *e = &d->e[j];
            if (e->sym != K3G_BYTE) break;
            if (e->lo <= p[i] && p[i] <= e->hi) {
                nx = e->to;
                break;
            }
        }
        if (nx < 0) return false;
        cur = nx;
    }
    return d->final[cur] != 0;
}

bool k3g_fa_is_empty(const k3g_fa *d) { return d->n == 0; }

k3_status k3g_fa_any_bytes(k3g_fa *out, k3_error *err) {
    *out = (k3g_fa){0};
    int32_t s = k3g_fa_state(out);
    if (s >= 0) {
        out->final[s] = 1;
        k3g_fa_byte(out, s, s, 0, 255);
    }
    if (out->oom || !k3g_fa_index(out)) {
        k3g_fa_free(out);
        return k3_err(err, K3_ERR_NOMEM, "out of memory");
    }
    return K3_OK;
}

/* The states of one UTF-8 code point from `from` to `to`, through seven
 * shared middle states m[0..6]: m0 one continuation left, m1 two, m2 three,
 * m3 after E0 (A0..BF then one), m4 after ED (80..9F then one), m5 after F0
 * (90..BF then two), m6 after F4 (80..8F then two). Lead bytes exclude
 * overlong forms and surrogates; lo_ascii..hi_ascii are the ASCII bytes
 * allowed (the JSON string body excludes some). */
static void utf8_char(k3g_fa *fa, int32_t from, int32_t to, const int32_t m[7]) {
    k3g_fa_byte(fa, from, m[0], 0xC2, 0xDF);
    k3g_fa_byte(fa, from, m[3], 0xE0, 0xE0);
    k3g_fa_byte(fa, from, m[1], 0xE1, 0xEC);
    k3g_fa_byte(fa, from, m[4], 0xED, 0xED);
    k3g_fa_byte(fa, from, m[1], 0xEE, 0xEF);
    k3g_fa_byte(fa, from, m[5], 0xF0, 0xF0);
    k3g_fa_byte(fa, from, m[2], 0xF1, 0xF3);
    k3g_fa_byte(fa, from, m[6], 0xF4, 0xF4);
    k3g_fa_byte(fa, m[0], to, 0x80, 0xBF);
    k3g_fa_byte(fa, m[1], m[0], 0x80, 0xBF);
    k3g_fa_byte(fa, m[2], m[1], 0x80, 0xBF);
    k3g_fa_byte(fa, m[3], m[0], 0xA0, 0xBF);
    k3g_fa_byte(fa, m[4], m[0], 0x80, 0x9F);
    k3g_fa_byte(fa, m[5], m[1], 0x90, 0xBF);
    k3g_fa_byte(fa, m[6], m[1], 0x80, 0x8F);
}

void k3g_fa_utf8_char(k3g_fa *fa, int32_t from, int32_t to, unsigned ascii_lo, unsigned ascii_hi) {
    int32_t m[7];
    for (int i = 0; i < 7; i++) m[i] = k3g_fa_state(fa);
    if (ascii_lo <= ascii_hi) k3g_fa_byte(fa, from, to, ascii_lo, ascii_hi);
    utf8_char(fa, from, to, m);
}

k3_status k3g_fa_utf8_text(k3g_fa *out, k3_error *err) { return k3g_fa_utf8_length(out, 0, -1, err); }

k3_status k3g_fa_utf8_length(k3g_fa *out, int64_t min, int64_t max, k3_error *err) {
    *out = (k3g_fa){0};
    if (min < 0) min = 0;
    if (max >= 0 && max < min) return K3_OK; /* empty */
    if (min > K3G_MAX_REPEAT || max > K3G_MAX_REPEAT)
        return k3_err(err, K3_ERR_UNSUPPORTED, "a length of %lld is beyond the supported %d",
                      (long long)(max > min ? max : min), K3G_MAX_REPEAT);
    /* boundary states B_0..B_top, then the middle states of each */
    int64_t top = max >= 0 ? max : min;
    for (int64_t k = 0; k <= top; k++) k3g_fa_state(out);
    for (int64_t k = 0; k <= top; k++) {
        int32_t to = (int32_t)(k < top ? k + 1 : (max < 0 ? top : -1));
        if (to < 0) break;
        int32_t m[7];
        for (int i = 0; i < 7; i++) m[i] = k3g_fa_state(out);
        k3g_fa_byte(out, (int32_t)k, to, 0x00, 0x7F);
        utf8_char(out, (int32_t)k, to, m);
    }
    for (int64_t k = min; k <= top && out->final; k++) out->final[k] = 1;
    out->start = 0;
    if (out->oom || out->too_big || !k3g_fa_trim(out, NULL)) {
        bool big = out->too_big;
        k3g_fa_free(out);
        return big ? k3_err(err, K3_ERR_UNSUPPORTED, "a length limit is too large")
                   : k3_err(err, K3_ERR_NOMEM, "out of memory");
    }
    return K3_OK;
}

k3_status k3g_fa_avoid(k3g_fa *out, const char *w, k3_error *err) {
    *out = (k3g_fa){0};
    size_t n = strlen(w);
    if (n == 0) return K3_OK;
    int32_t *fail = malloc(n * sizeof *fail);
    if (!fail) return k3_err(err, K3_ERR_NOMEM, "out of memory");
    fail[0] = 0;
    for (size_t i = 1, k = 0; i < n; i++) {
        while (k && w[i] != w[k]) k = (size_t)fail[k - 1];
        if (w[i] == w[k]) k++;
        fail[i] = (int32_t)k;
    }
    for (size_t s = 0; s < n; s++) {
        k3g_fa_state(out);
        if (out->final) out->final[s] = 1;
    }
    for (size_t s = 0; s < n; s++) {
        int32_t tgt_of[256];
        for (unsigned c = 0; c < 256; c++) {
            size_t k = s;
            while (k && (uint8_t)w[k] != c) k = (size_t)fail[k - 1];
            if ((uint8_t)w[k] == c) k++;
            tgt_of[c] = k == n ? -1 : (int32_t)k;
        }
        for (unsigned c = 0; c < 256;) {
            unsigned z = c;
            while (z + 1 < 256 && tgt_of[z + 1] == tgt_of[c]) z++;
            if (tgt_of[c] >= 0) k3g_fa_byte(out, (int32_t)s, tgt_of[c], c, z);
            c = z + 1;
        }
    }
    free(fail);
    out->start = 0;
    if (out->oom || !k3g_fa_trim(out, NULL)) {
        k3g_fa_free(out);
        return k3_err(err, K3_ERR_NOMEM, "out of memory");
    }
    return K3_OK;
}
