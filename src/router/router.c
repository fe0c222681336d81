/*
 * router.c -- the cache-aware routing policy (router.h): the block-granular
 * prefix tree (a hash table of chained block hashes, each node a bit per
 * backend and its last time), the load, the health, the choice.
 */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "kv/kv.h"
#include "router/router.h"

typedef struct node {
    uint64_t hash; /* 0 = empty slot */
    uint64_t mask; /* backends sent this prefix */
    double last;   /* last time any of them was */
} node;

typedef struct bstate {
    int64_t load, cached, routed, failures;
    bool down, probing;
    double down_until;
} bstate;

struct k3_router {
    k3_router_options o;
    node *t;
    uint64_t cap; /* a power of two, >= 2 * max_nodes */
    int64_t n;
    uint32_t rr; /* the round-robin policy's next turn */
    bstate b[K3_ROUTER_MAX_BACKENDS];
};

static uint64_t seed(void) { return 0x6B33526F75746572ull; } /* "k3Router" */

k3_status k3_router_open(k3_router **out, const k3_router_options *opt, k3_error *err) {
    *out = NULL;
    if (!opt || opt->n_backends < 1 || opt->n_backends > K3_ROUTER_MAX_BACKENDS)
        return k3_err(err, K3_ERR_ARG, "router: 1 to %d backends, not %d", K3_ROUTER_MAX_BACKENDS,
                      opt ? opt->n_backends : 0);
    if (opt->block_size < 0 || opt->cache_threshold < 0 || opt->cache_threshold > 1 || opt->balance_abs < 0 ||
        opt->balance_rel < 0 || opt->max_nodes < 0 || opt->fail_threshold < 0 || opt->retry_s < 0)
        return k3_err(err, K3_ERR_ARG, "router: a negative option, or a cache threshold over 1");
    if (opt->policy != K3_ROUTER_CACHE_AWARE && opt->policy != K3_ROUTER_ROUND_ROBIN)
        return k3_err(err, K3_ERR_ARG, "router: unknown policy %d", (int)opt->policy);
    k3_router *r = calloc(1, sizeof *r);
    if (!r) return k3_err(err, K3_ERR_NOMEM, "router: out of memory");
    r->o = *opt;
    if (!r->o.block_size) r->o.block_size = 64;
    if (!r->o.cache_threshold) r->o.cache_threshold = 0.5;
    if (!r->o.balance_abs) r->o.balance_abs = 32;
    if (!r->o.balance_rel) r->o.balance_rel = 1.5;
    if (!r->o.max_nodes) r->o.max_nodes = 1 << 20;
    if (!r->o.fail_threshold) r->o.fail_threshold = 3;
    if (!r->o.retry_s) r->o.retry_s = 5;
    r->cap = 16;
    while (r->cap < (uint64_t)r->o.max_nodes * 2) r->cap <<= 1;
    r->t = calloc(r->cap, sizeof *r->t);
    if (!r->t) {
        const long long nodes = (long long)r->o.max_nodes;
        free(r);
        return k3_err(err, K3_ERR_NOMEM, "router: out of memory for %lld tree nodes", nodes);
    }
    *out = r;
    return K3_OK;
}

void k3_router_close(k3_router *r) {
    if (!r) return;
    free(r->t);
    free(r);
}

/* ---- the tree ---------------------------------------------------------------------- */

static node *find(const k3_router *r, uint64_t h) {
    for (uint64_t i = h & (r->cap - 1);; i = (i + 1) & (r->cap - 1)) {
        if (!r->t[i].hash) return NULL;
        if (r->t[i].hash == h) return &r->t[i];
    }
}

/* Removes slot i (linear probing: the cluster after it moves up). */
static void erase(k3_router *r, uint64_t i) {
    for (int32_t b = 0; b < r->o.n_backends; b++)
        if (r->t[i].mask >> b & 1) r->b[b].cached--;
    r->t[i].hash = 0;
    r->n--;
    for (uint64_t j = (i + 1) & (r->cap - 1); r->t[j].hash; j = (j + 1) & (r->cap - 1)) {
        const node x = r->t[j];
        r->t[j].hash = 0;
        uint64_t k = x.hash & (r->cap - 1);
        while (r->t[k].hash) k = (k + 1) & (r->cap - 1);
        r->t[k] = x;
    }
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Over max_nodes: the least recently sent eighth goes. */
static void trim(k3_router *r) {
    if (r->n <= r->o.max_nodes) return;
    double *ts = malloc(sizeof *ts * (size_t)r->n);
    if (!ts) return;
    int64_t k = 0;
    for (uint64_t i = 0; i < r->cap; i++)
        if (r->t[i].hash) ts[k++] = r->t[i].last;
    qsort(ts, (size_t)k, sizeof *ts, cmp_double);
    const double cut = ts[k / 8];
    free(ts);
    for (uint64_t i = 0; i < r->cap;)
        if (r->t[i].hash && r->t[i].last <= cut) erase(r, i); /* slot i may be refilled: look again */
        else i++;
}

/* The chain hash of each full block of tokens (at most nb). */
static int64_t chain(const k3_router *r, const int32_t *tokens, int64_t n, uint64_t *out, int64_t nb) {
    const int64_t bs = r->o.block_size, m = n / bs < nb ? n / bs : nb;
    uint64_t h = seed();
    for (int64_t i = 0; i < m; i++) {
        h = k3_kv_hash_block(h, 0, tokens + i * bs, (int32_t)bs);
        out[i] = h ? h : 1;
    }
    return m;
}

int64_t k3_router_match(const k3_router *r, int32_t backend, const int32_t *tokens, int64_t n) {
    if (backend < 0 || backend >= r->o.n_backends || n <= 0) return 0;
    const int64_t bs = r->o.block_size;
    uint64_t h = seed();
    int64_t i = 0;
    for (; i < n / bs; i++) {
        h = k3_kv_hash_block(h, 0, tokens + i * bs, (int32_t)bs);
        const node *x = find(r, h ? h : 1);
        if (!x || !(x->mask >> backend & 1)) break;
    }
    return i * bs;
}

static void insert(k3_router *r, int32_t backend, const uint64_t *hs, int64_t m, double now) {
    for (int64_t i = 0; i < m; i++) {
        node *x = find(r, hs[i]);
        if (!x) {
            uint64_t k = hs[i] & (r->cap - 1);
            while (r->t[k].hash) k = (k + 1) & (r->cap - 1);
            x = &r->t[k];
            *x = (node){hs[i], 0, now};
            r->n++;
        }
        if (!(x->mask >> backend & 1)) r->b[backend].cached++;
        x->mask |= 1ull << backend;
        x->last = now;
    }
    trim(r);
}

/* Backend b leaves every node (it went down: what it held is not to be counted on). */
static void forget(k3_router *r, int32_t b) {
    for (uint64_t i = 0; i < r->cap;) {
        node *x = &r->t[i];
        if (!x->hash || !(x->mask >> b & 1)) {
            i++;
            continue;
        }
        x->mask &= ~(1ull << b);
        r->b[b].cached--;
        if (!x->mask) erase(r, i); /* slot i may be refilled: look again */
        else i++;
    }
}

static void go_down(k3_router *r, int32_t b, double now) {
    bstate *x = &r->b[b];
    if (x->cached > 0) forget(r, b);
    x->down = true;
    x->probing = false;
    x->down_until = now + r->o.retry_s;
}

/* ---- the choice -------------------------------------------------------------------- */

static bool usable(k3_router *r, int32_t b, double now, bool *probe) {
    bstate *x = &r->b[b];
    *probe = false;
    if (!x->down) return true;
    if (now >= x->down_until && !x->probing) {
        *probe = true;
        return true;
    }
    return false;
}

k3_route k3_router_route(k3_router *r, const int32_t *tokens, int64_t n, double now) {
    return k3_router_route_excluding(r, tokens, n, now, 0);
}

k3_route k3_router_route_excluding(k3_router *r, const int32_t *tokens, int64_t n, double now, uint64_t exclude) {
    k3_route out = {.backend = -1, .why = K3_ROUTE_NONE};
    const int32_t nb = r->o.n_backends;
    bool ok[K3_ROUTER_MAX_BACKENDS], probe[K3_ROUTER_MAX_BACKENDS];
    int32_t n_ok = 0;
    if (n < 0) n = 0;
    for (int32_t b = 0; b < nb; b++) n_ok += ok[b] = !(exclude >> b & 1) && usable(r, b, now, &probe[b]);
    if (!n_ok) return out;
    /* a backend due for its probe gets this request */
    for (int32_t b = 0; b < nb; b++)
        if (ok[b] && probe[b]) {
            out.backend = b;
            out.why = K3_ROUTE_PROBE;
            r->b[b].probing = true;
            break;
        }
    if (out.backend < 0 && r->o.policy == K3_ROUTER_ROUND_ROBIN) {
        for (int32_t k = 0; k < nb && out.backend < 0; k++) {
            const int32_t b = (int32_t)((r->rr + (uint32_t)k) % (uint32_t)nb);
            if (ok[b]) out.backend = b;
        }
        r->rr = (uint32_t)out.backend + 1;
        out.why = K3_ROUTE_RR;
    }
    const int64_t m_max = n / r->o.block_size;
    uint64_t *hs = malloc(sizeof *hs * (size_t)(m_max ? m_max : 1));
    const int64_t m = hs ? chain(r, tokens, n, hs, m_max) : 0;
    if (out.backend < 0) {
        int32_t lo = -1, hi = -1;
        for (int32_t b = 0; b < nb; b++) {
            if (!ok[b]) continue;
            if (lo < 0 || r->b[b].load < r->b[lo].load) lo = b;
            if (hi < 0 || r->b[b].load > r->b[hi].load) hi = b;
        }
        const int64_t L = r->b[hi].load, l = r->b[lo].load;
        if (L - l > r->o.balance_abs && (double)L > r->o.balance_rel * (double)l) {
            out.backend = lo;
            out.why = K3_ROUTE_BALANCE;
        } else {
            /* the longest match */
            int64_t best = -1;
            int32_t at = -1;
            for (int32_t b = 0; b < nb; b++) {
                if (!ok[b]) continue;
                int64_t k = 0;
                while (k < m) {
                    const node *x = find(r, hs[k]);
                    if (!x || !(x->mask >> b & 1)) break;
                    k++;
                }
                if (k > best || (k == best && r->b[b].load < r->b[at].load)) {
                    best = k;
                    at = b;
                }
            }
            if (m > 0 && best > 0 && (double)best > r->o.cache_threshold * (double)m) {
                out.backend = at;
                out.why = K3_ROUTE_AFFINITY;
            } else {
                /* room for a new prefix: the least cached, then the least loaded */
                int32_t pick = -1;
                for (int32_t b = 0; b < nb; b++) {
                    if (!ok[b]) continue;
                    if (pick < 0 || r->b[b].cached < r->b[pick].cached ||
                        (r->b[b].cached == r->b[pick].cached && r->b[b].load < r->b[pick].load))
                        pick = b;
                }
                out.backend = pick;
                out.why = K3_ROUTE_ROOM;
            }
        }
    }
    out.matched_tokens = k3_router_match(r, out.backend, tokens, n);
    if (hs) insert(r, out.backend, hs, m, now);
    free(hs);
    r->b[out.backend].load++;
    r->b[out.backend].routed++;
    return out;
}

void k3_router_done(k3_router *r, int32_t backend, bool ok, double now) {
    if (backend < 0 || backend >= r->o.n_backends) return;
    bstate *x = &r->b[backend];
    if (x->load > 0) x->load--;
    if (ok) {
        x->failures = 0;
        x->down = x->probing = false;
        return;
    }
    x->failures++;
    if (x->probing || x->failures >= r->o.fail_threshold) go_down(r, backend, now);
}

void k3_router_sent(k3_router *r, int32_t backend, const int32_t *tokens, int64_t n, double now) {
    if (backend < 0 || backend >= r->o.n_backends) return;
    const int64_t m_max = n > 0 ? n / r->o.block_size : 0;
    uint64_t *hs = malloc(sizeof *hs * (size_t)(m_max ? m_max : 1));
    if (hs) insert(r, backend, hs, chain(r, tokens, n, hs, m_max), now);
    free(hs);
    r->b[backend].load++;
    r->b[backend].routed++;
}

void k3_router_set_health(k3_router *r, int32_t backend, bool up, double now) {
    if (backend < 0 || backend >= r->o.n_backends) return;
    bstate *x = &r->b[backend];
    if (up) {
        x->down = x->probing = false;
        x->failures = 0;
    } else {
        go_down(r, backend, now);
    }
}

void k3_router_backend_get(const k3_router *r, int32_t backend, k3_router_backend *out) {
    memset(out, 0, sizeof *out);
    if (backend < 0 || backend >= r->o.n_backends) return;
    const bstate *x = &r->b[backend];
    *out = (k3_router_backend){x->load, x->cached, x->routed, x->failures, !x->down};
}
