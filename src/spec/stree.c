/*
 * stree.c -- the bounded-depth suffix tree with counts (spec.h, k3_stree):
 * SuffixDecoding's structure (arXiv 2411.04975): every substring of at most
 * `depth` tokens of the inserted texts is a path from the root, each node
 * counting its string's occurrences, so a text's continuation is predicted
 * by its longest suffix found in the tree and the counts of what followed.
 */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "spec/spec.h"

#define EMPTY 0ull
#define GONE (~0ull)

static inline uint64_t key_of(int32_t u, int32_t x) { return (((uint64_t)(uint32_t)u << 32) | (uint32_t)x) + 1; }

static inline uint32_t hash_key(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (uint32_t)k;
}

k3_status k3_stree_init(k3_stree *t, int32_t depth, int64_t max_nodes, k3_error *err) {
    memset(t, 0, sizeof *t);
    if (depth < 1 || depth > 63) return k3_err(err, K3_ERR_RANGE, "suffix tree: depth %d is not in 1..63", depth);
    t->depth = depth;
    t->max_nodes = max_nodes > 1 ? max_nodes : 1;
    t->cap = 256;
    t->cnt = calloc((size_t)t->cap, sizeof *t->cnt);
    t->tok = calloc((size_t)t->cap, sizeof *t->tok);
    t->first = malloc(sizeof *t->first * (size_t)t->cap);
    t->next = malloc(sizeof *t->next * (size_t)t->cap);
    t->par = malloc(sizeof *t->par * (size_t)t->cap);
    t->dep = calloc((size_t)t->cap, 1);
    t->free_ids = malloc(sizeof *t->free_ids * (size_t)t->cap);
    t->hmask = 511;
    t->h = calloc((size_t)t->hmask + 1, sizeof *t->h);
    if (!t->cnt || !t->tok || !t->first || !t->next || !t->par || !t->dep || !t->free_ids || !t->h) {
        k3_stree_free(t);
        return k3_err(err, K3_ERR_NOMEM, "suffix tree: out of memory");
    }
    t->n_nodes = 1; /* the root */
    t->first[0] = t->next[0] = t->par[0] = -1;
    return K3_OK;
}

void k3_stree_free(k3_stree *t) {
    free(t->cnt);
    free(t->tok);
    free(t->first);
    free(t->next);
    free(t->par);
    free(t->dep);
    free(t->free_ids);
    free(t->h);
    memset(t, 0, sizeof *t);
}

int64_t k3_stree_bytes(const k3_stree *t) {
    return (int64_t)t->cap * (5 * 4 + 1 + 4) + ((int64_t)t->hmask + 1) * (int64_t)sizeof *t->h;
}

int32_t k3_stree_child(const k3_stree *t, int32_t u, int32_t x) {
    const uint64_t k = key_of(u, x);
    for (uint32_t h = hash_key(k) & t->hmask;; h = (h + 1) & t->hmask) {
        if (t->h[h].key == EMPTY) return -1;
        if (t->h[h].key == k) return t->h[h].val;
    }
}

static bool rehash(k3_stree *t, uint32_t mask) {
    struct k3_stree_slot *nh = calloc((size_t)mask + 1, sizeof *nh);
    if (!nh) return false;
    int64_t used = 0;
    for (uint32_t i = 0; i <= t->hmask; i++) {
        const uint64_t k = t->h[i].key;
        if (k == EMPTY || k == GONE) continue;
        uint32_t h = hash_key(k) & mask;
        while (nh[h].key != EMPTY) h = (h + 1) & mask;
        nh[h] = t->h[i];
        used++;
    }
    free(t->h);
    t->h = nh;
    t->hmask = mask;
    t->h_used = used;
    return true;
}

static bool grow_nodes(k3_stree *t) {
    const int32_t cap = t->cap * 2;
    int32_t *a = realloc(t->cnt, sizeof *a * (size_t)cap);
    if (a) t->cnt = a;
    int32_t *b = realloc(t->tok, sizeof *b * (size_t)cap);
    if (b) t->tok = b;
    int32_t *c = realloc(t->first, sizeof *c * (size_t)cap);
    if (c) t->first = c;
    int32_t *d = realloc(t->next, sizeof *d * (size_t)cap);
    if (d) t->next = d;
    int32_t *g = realloc(t->par, sizeof *g * (size_t)cap);
    if (g) t->par = g;
    uint8_t *e = realloc(t->dep, (size_t)cap);
    if (e) t->dep = e;
    int32_t *f = realloc(t->free_ids, sizeof *f * (size_t)cap);
    if (f) t->free_ids = f;
    if (!a || !b || !c || !d || !e || !f || !g) return false;
    t->cap = cap;
    return true;
}

/* The child of u by x, made (count 0) if there is none, in one probe of
 * the table; -1: none and none can be made (the budget or memory). */
static int32_t child_or_add(k3_stree *t, int32_t u, int32_t x) {
    if ((t->h_used + 1) * 4 > ((int64_t)t->hmask + 1) * 3 &&
        !rehash(t, (t->h_used + 1) * 2 > ((int64_t)t->hmask + 1) ? t->hmask * 2 + 1 : t->hmask))
        return k3_stree_child(t, u, x);
    const uint64_t k = key_of(u, x);
    uint32_t h = hash_key(k) & t->hmask, at = UINT32_MAX;
    for (;; h = (h + 1) & t->hmask) {
        if (t->h[h].key == k) return t->h[h].val;
        if (t->h[h].key == EMPTY) break;
        if (t->h[h].key == GONE && at == UINT32_MAX) at = h;
    }
    if (t->n_nodes - t->n_free >= t->max_nodes) return -1;
    int32_t v;
    if (t->n_free) v = t->free_ids[--t->n_free];
    else {
        if (t->n_nodes == t->cap && !grow_nodes(t)) return -1;
        v = t->n_nodes++;
    }
    t->cnt[v] = 0;
    t->tok[v] = x;
    t->dep[v] = (uint8_t)(t->dep[u] + 1);
    t->first[v] = -1;
    t->par[v] = u;
    t->next[v] = t->first[u];
    t->first[u] = v;
    if (at == UINT32_MAX) {
        at = h;
        t->h_used++;
    }
    t->h[at].key = k;
    t->h[at].val = v;
    return v;
}

static void remove_child(k3_stree *t, int32_t u, int32_t v) {
    const uint64_t k = key_of(u, t->tok[v]);
    for (uint32_t h = hash_key(k) & t->hmask; t->h[h].key != EMPTY; h = (h + 1) & t->hmask)
        if (t->h[h].key == k) {
            t->h[h].key = GONE;
            break;
        }
    if (t->first[u] == v) t->first[u] = t->next[v];
    else
        for (int32_t w = t->first[u]; w >= 0; w = t->next[w])
            if (t->next[w] == v) {
                t->next[w] = t->next[v];
                break;
            }
    t->dep[v] = 0; /* freed (only the root has depth 0) */
    t->free_ids[t->n_free++] = v;
}

/* Frees childless node v of count 0, then each ancestor left so. */
static void prune(k3_stree *t, int32_t v) {
    while (v > 0 && t->cnt[v] <= 0 && t->first[v] < 0) {
        const int32_t u = t->par[v];
        remove_child(t, u, v);
        v = u;
    }
}

/* The walk shared by push, pop and follow: the suffixes of the text before
 * x (a->node[i] of depth i + 1), each extended by x, and x alone from the
 * root. mode 1 creates and counts, -1 uncounts (a removed text: its nodes
 * are all there; a suffix freed on the way leaves a hole, -1), 0 reads. A
 * suffix that cannot be extended ends the list (every longer suffix holds
 * it: it cannot be there either) except in a removal. */
static void walk(k3_stree *t, k3_sactive *a, int32_t x, int mode) {
    int32_t nn = 0, out[64];
    for (int32_t i = -1; i < a->n && nn < t->depth; i++) {
        const int32_t u = i < 0 ? 0 : a->node[i];
        const int32_t v = u < 0 ? -1 : mode == 1 ? child_or_add(t, u, x) : k3_stree_child(t, u, x);
        if (v < 0 && mode != -1) break;
        out[nn++] = v;
    }
    if (mode != 0) {
        for (int32_t i = 0; i < nn; i++)
            if (out[i] >= 0) t->cnt[out[i]] += mode;
        /* a periodic text can meet one node twice: each is pruned once */
        for (int32_t i = nn - 1; mode < 0 && i >= 0; i--)
            if (out[i] > 0 && t->dep[out[i]] > 0) prune(t, out[i]);
        for (int32_t i = 0; mode < 0 && i < nn; i++)
            if (out[i] > 0 && t->dep[out[i]] == 0) out[i] = -1;
        t->version++;
    }
    a->n = nn;
    memcpy(a->node, out, sizeof(int32_t) * (size_t)nn);
    a->version = t->version;
}

void k3_stree_push(k3_stree *t, k3_sactive *a, int32_t x) { walk(t, a, x, 1); }
void k3_stree_pop(k3_stree *t, k3_sactive *a, int32_t x) { walk(t, a, x, -1); }
void k3_stree_follow(const k3_stree *t, k3_sactive *a, int32_t x) { walk((k3_stree *)t, a, x, 0); }

void k3_stree_rematch(const k3_stree *t, k3_sactive *a, const int32_t *tail, int32_t n) {
    a->n = 0;
    if (n > t->depth) {
        tail += n - t->depth;
        n = t->depth;
    }
    /* suffix of length L: the path of tail[n - L .. n) */
    for (int32_t L = 1; L <= n; L++) {
        int32_t u = 0;
        for (int32_t i = n - L; i < n && u >= 0; i++) u = k3_stree_child(t, u, tail[i]);
        if (u < 0) break; /* a longer suffix contains this one */
        a->node[a->n++] = u;
    }
    a->version = t->version;
}

/* The most frequent child of u (ties to the one added last), or -1. */
static int32_t best_child(const k3_stree *t, int32_t u) {
    int32_t best = -1;
    for (int32_t v = t->first[u]; v >= 0; v = t->next[v])
        if (best < 0 || t->cnt[v] > t->cnt[best]) best = v;
    return best;
}

int32_t k3_stree_draft(const k3_stree *t, const k3_sactive *a, bool self, int32_t max, float spec_factor,
                       float min_prob, int32_t *draft, float *conf, float *score) {
    int32_t best_n = 0;
    float best_s = 0;
    int32_t tried = 0;
    for (int32_t i = a->n - 1; i >= 0 && tried < 4; i--) {
        const int32_t u = a->node[i];
        if (u < 0 || t->first[u] < 0) continue; /* nothing ever followed it */
        const int32_t d = t->dep[u];
        tried++;
        int32_t lim = max;
        if (spec_factor > 0 && (float)lim > spec_factor * (float)d) lim = (int32_t)(spec_factor * (float)d);
        if (lim > t->depth - d) lim = t->depth - d;
        int32_t tok[K3_SPEC_MAX_DRAFT], n = 0;
        float p[K3_SPEC_MAX_DRAFT], prod = 1, s = 0;
        for (int32_t w = u, first = 1; n < lim && n < K3_SPEC_MAX_DRAFT; first = 0) {
            const int32_t v = best_child(t, w);
            if (v < 0) break;
            /* the text's own occurrence of the matched suffix has no continuation yet */
            const int32_t denom = t->cnt[w] - (first && self ? 1 : 0);
            if (denom <= 0) break;
            float pr = (float)t->cnt[v] / (float)denom;
            if (pr > 1) pr = 1;
            if (prod * pr < min_prob) break;
            prod *= pr;
            s += prod;
            p[n] = pr;
            tok[n++] = t->tok[v];
            w = v;
        }
        if (n > 0 && s > best_s) {
            best_s = s;
            best_n = n;
            memcpy(draft, tok, sizeof(int32_t) * (size_t)n);
            memcpy(conf, p, sizeof(float) * (size_t)n);
        }
    }
    *score = best_s;
    return best_n;
}
