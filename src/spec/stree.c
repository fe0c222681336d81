/*
 * stree.c -- the bounded-depth suffix tree with counts (spec.h, k3_stree):
 * SuffixDecoding's structure (arXiv 2411.04975): every substring of at most
 * `depth` tokens of the inserted texts is a path from the root, each node
 * counting its string's occurrences, so a text's continuation is predicted
 * by its longest suffix found in the tree and the counts of what followed.
 *
 * Insertion follows suffix links: slink[v] is the node of v's string
 * without its first token (the root for depth 1). The node set is closed
 * under dropping the first token (a push makes a text's suffixes shallow
 * to deep, each after the one below it), so when the suffix of length i
 * extended by x is in the tree, every shorter one is too, and they are
 * reached from it by slinks without hashing. A push probes from the
 * deepest candidate down until one hit (one probe per new node, whose slot
 * the insertion then takes, plus the hit), walks slinks for the rest and
 * makes the missing ones shallow to deep, each linking to the one below.
 *
 * The children's table is open addressing with 8-byte slots (a 32-bit tag
 * of (parent, token) and the child; the child's parent and token confirm a
 * matching tag), at most 3/4 used and rehashed to at most 3/8: in a server
 * a new tree's fresh memory (page faults, TLB shootdowns across the
 * threads) costs more than its hashing, so the bytes a node are kept low
 * (29 in the node arrays, ~14 in the table).
 *
 * Slinks stay valid when nodes are freed and their ids reused: counts
 * obey cnt[v] <= cnt[slink[v]] (each count of a string counts its suffix
 * in the same step: the lists are consecutive from depth 1), every live
 * node has a count >= 1 after a push or a pop (nodes are made and counted
 * in one step; one whose count reaches 0 is in that step's list, and so
 * is any child of it, which has a count <= its own: freed deepest first),
 * and only a node of count 0 is freed. So a freed node is no live node's
 * slink target. A periodic text (7 7 7 ...) meets a node as both a
 * candidate's parent and the hit's slink in one step; that changes none
 * of this.
 */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "spec/spec.h"

#define EMPTY 0u /* a slot's tag: never used */
#define GONE 1u  /* ... its node was removed (the probe goes on past it) */
/* the table's load limit (live and deleted slots), LOAD_NUM / LOAD_DEN */
#define LOAD_NUM 3
#define LOAD_DEN 4
#define PREFETCH 8 /* probes ahead */

/* The child (u, x)'s tag: a hash, >= 2; its slot's probe path starts at
 * tag & hmask at every table size (a rehash reads no node). A slot whose
 * tag matches is the child when its node's parent and token are u and x. */
static inline uint32_t tag_of(int32_t u, int32_t x) {
    uint64_t k = ((uint64_t)(uint32_t)u << 32) | (uint32_t)x;
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    const uint32_t g = (uint32_t)k;
    return g < 2 ? g + 2 : g;
}

static inline bool is_child(const k3_stree *t, int32_t v, int32_t u, int32_t x) {
    return t->par[v] == u && t->tok[v] == x;
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
    t->slink = malloc(sizeof *t->slink * (size_t)t->cap);
    t->dep = calloc((size_t)t->cap, 1);
    t->prev = malloc(sizeof *t->prev * (size_t)t->cap);
    t->hmask = 511;
    t->h = calloc((size_t)t->hmask + 1, sizeof *t->h);
    if (!t->cnt || !t->tok || !t->first || !t->next || !t->par || !t->slink || !t->dep || !t->prev || !t->h) {
        k3_stree_free(t);
        return k3_err(err, K3_ERR_NOMEM, "suffix tree: out of memory");
    }
    t->n_nodes = 1; /* the root */
    t->first[0] = t->next[0] = t->prev[0] = t->par[0] = -1;
    t->slink[0] = 0;
    t->free_head = -1;
    return K3_OK;
}

void k3_stree_clear(k3_stree *t, int64_t max_nodes, int64_t nodes_hint) {
    /* a table past 4x what the hint needs at the load limit goes: clearing costs its size */
    const int64_t want = (nodes_hint + 1) * 2 * LOAD_DEN / LOAD_NUM;
    uint32_t mask = 511;
    while ((int64_t)mask + 1 < want && mask < (1u << 30) - 1) mask = mask * 2 + 1;
    struct k3_stree_slot *nh =
        (int64_t)t->hmask + 1 > 4 * ((int64_t)mask + 1) ? calloc((size_t)mask + 1, sizeof *nh) : NULL;
    if (nh) {
        free(t->h);
        t->h = nh;
        t->hmask = mask;
    } else memset(t->h, 0, sizeof *t->h * ((size_t)t->hmask + 1));
    t->h_used = 0;
    t->n_nodes = 1;
    t->n_free = 0;
    t->free_head = -1;
    t->cnt[0] = 0;
    t->first[0] = -1;
    t->max_nodes = max_nodes > 1 ? max_nodes : 1;
    t->version++; /* every active list made before is stale */
}

void k3_stree_free(k3_stree *t) {
    free(t->cnt);
    free(t->tok);
    free(t->first);
    free(t->next);
    free(t->par);
    free(t->slink);
    free(t->dep);
    free(t->prev);
    free(t->h);
    memset(t, 0, sizeof *t);
}

int64_t k3_stree_bytes(const k3_stree *t) {
    return (int64_t)t->cap * (7 * 4 + 1) + ((int64_t)t->hmask + 1) * (int64_t)sizeof *t->h;
}

int32_t k3_stree_child(const k3_stree *t, int32_t u, int32_t x) {
    const uint32_t g = tag_of(u, x);
    for (uint32_t h = g & t->hmask;; h = (h + 1) & t->hmask) {
        if (t->h[h].tag == EMPTY) return -1;
        if (t->h[h].tag == g && is_child(t, t->h[h].val, u, x)) return t->h[h].val;
    }
}

static bool rehash(k3_stree *t, uint32_t mask) {
    struct k3_stree_slot *nh = calloc((size_t)mask + 1, sizeof *nh);
    if (!nh) return false;
    int64_t used = 0;
    for (uint32_t i = 0; i <= t->hmask; i++) {
        const uint32_t g = t->h[i].tag;
        if (g == EMPTY || g == GONE) continue;
        uint32_t h = g & mask;
        while (nh[h].tag != EMPTY) h = (h + 1) & mask;
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
    if (t->cap > INT32_MAX / 2) return false; /* node ids are int32 */
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
    int32_t *l = realloc(t->slink, sizeof *l * (size_t)cap);
    if (l) t->slink = l;
    uint8_t *e = realloc(t->dep, (size_t)cap);
    if (e) t->dep = e;
    int32_t *f = realloc(t->prev, sizeof *f * (size_t)cap);
    if (f) t->prev = f;
    if (!a || !b || !c || !d || !e || !f || !g || !l) return false;
    t->cap = cap;
    return true;
}

/* Room in the table for `more` new children within its load limit (one
 * check per push, so the slots its probes found stay valid while it
 * inserts): false only when memory ran out. */
static bool h_room(k3_stree *t, int64_t more) {
    if ((t->h_used + more) * LOAD_DEN <= ((int64_t)t->hmask + 1) * LOAD_NUM) return true;
    const int64_t live = (int64_t)(t->n_nodes - t->n_free - 1) + more; /* the root has no slot */
    uint32_t mask = t->hmask;
    while (live * 2 * LOAD_DEN > ((int64_t)mask + 1) * LOAD_NUM && mask < UINT32_MAX / 2) mask = mask * 2 + 1;
    if (live * LOAD_DEN > ((int64_t)mask + 1) * LOAD_NUM) return false; /* past 2^32 slots: no more nodes */
    return rehash(t, mask);                                             /* at least cleans the deleted slots */
}

/* A new node, the child of u by x (count 0) whose string without its first
 * token is node `link`, in the table at the first free slot from h on (the
 * first free one on the key's probe path when it was found missing; slots
 * only filled since). -1: the budget or memory. */
static int32_t node_make(k3_stree *t, int32_t u, int32_t x, int32_t link, uint32_t h) {
    if (t->n_nodes - t->n_free >= t->max_nodes) return -1;
    int32_t v;
    if (t->n_free) { /* the last freed */
        v = t->free_head;
        t->free_head = t->next[v];
        t->n_free--;
    } else {
        if (t->n_nodes == t->cap && !grow_nodes(t)) return -1;
        v = t->n_nodes++;
    }
    t->cnt[v] = 0;
    t->tok[v] = x;
    t->dep[v] = (uint8_t)(t->dep[u] + 1);
    t->first[v] = -1;
    t->par[v] = u;
    t->slink[v] = link;
    t->prev[v] = -1;
    t->next[v] = t->first[u];
    if (t->first[u] >= 0) t->prev[t->first[u]] = v;
    t->first[u] = v;
    for (;; h = (h + 1) & t->hmask) {
        const uint32_t q = t->h[h].tag;
        if (q == EMPTY) t->h_used++;
        if (q == EMPTY || q == GONE) break;
    }
    t->h[h].tag = tag_of(u, x);
    t->h[h].val = v;
    return v;
}

/* The suffixes a push or follow of x after the active list a may reach:
 * level j < n is x after the root (j = 0) or after a->node[j - 1], of depth
 * j + 1. */
static inline int32_t n_levels(const k3_stree *t, const k3_sactive *a) {
    return a->n + 1 < t->depth ? a->n + 1 : t->depth;
}

/* Probes levels n - 1, n - 2, ... down to the first whose node exists:
 * returns that level (-1: none) and its node in *hit; every level above it
 * is missing, and with slot given, slot[j] is where level j's key may go
 * (the first free slot on its probe path). */
static int32_t probe_down(const k3_stree *t, const k3_sactive *a, int32_t n, int32_t x, int32_t *hit, uint32_t *slot) {
    /* the tags of the next PREFETCH levels made, their slots prefetched
     * (on repetitive text the first probe mostly hits) */
    uint32_t tag[64];
    int32_t made = n;
    for (int32_t j = n - 1; j >= 0; j--) {
        for (; made > 0 && made > j - PREFETCH; made--) {
            tag[made - 1] = tag_of(made > 1 ? a->node[made - 2] : 0, x);
            if (made - 1 < j) __builtin_prefetch(&t->h[tag[made - 1] & t->hmask]);
        }
        const uint32_t g = tag[j];
        const int32_t u = j ? a->node[j - 1] : 0;
        uint32_t h = g & t->hmask, at = UINT32_MAX;
        for (;; h = (h + 1) & t->hmask) {
            const uint32_t q = t->h[h].tag;
            if (q == g && is_child(t, t->h[h].val, u, x)) {
                *hit = t->h[h].val;
                return j;
            }
            if (q == EMPTY) break;
            if (q == GONE && at == UINT32_MAX) at = h;
        }
        if (slot) slot[j] = at == UINT32_MAX ? h : at;
    }
    *hit = 0;
    return -1;
}

/* The nodes of levels 0..j from level j's by slinks, each counted. */
static inline void count_down(k3_stree *t, int32_t *out, int32_t j, int32_t v) {
    for (; j >= 0; j--) {
        out[j] = v;
        t->cnt[v]++;
        v = t->slink[v];
    }
}

void k3_stree_push(k3_stree *t, k3_sactive *a, int32_t x) {
    const int32_t n = n_levels(t, a);
    int32_t out[64], hit;
    uint32_t slot[64];
    /* no room (memory): what exists is counted, nothing is made */
    const bool room = h_room(t, n);
    const int32_t j = probe_down(t, a, n, x, &hit, room ? slot : NULL);
    count_down(t, out, j, hit);
    int32_t nn = j + 1;
    for (; room && nn < n; nn++) { /* shallow to deep: each links to the one below */
        const int32_t v = node_make(t, nn ? a->node[nn - 1] : 0, x, nn ? out[nn - 1] : 0, slot[nn]);
        if (v < 0) break; /* the budget: the deeper ones contain this one */
        out[nn] = v;
        t->cnt[v] = 1;
    }
    t->version++;
    a->n = nn;
    memcpy(a->node, out, sizeof(int32_t) * (size_t)nn);
    a->version = t->version;
}

void k3_stree_follow(const k3_stree *t, k3_sactive *a, int32_t x) {
    int32_t hit;
    const int32_t j = probe_down(t, a, n_levels(t, a), x, &hit, NULL);
    for (int32_t i = j, v = hit; i >= 0; i--) {
        a->node[i] = v;
        v = t->slink[v];
    }
    a->n = j + 1;
    a->version = t->version;
}

static void remove_child(k3_stree *t, int32_t u, int32_t v) {
    const uint32_t g = tag_of(u, t->tok[v]);
    for (uint32_t h = g & t->hmask; t->h[h].tag != EMPTY; h = (h + 1) & t->hmask)
        if (t->h[h].tag == g && t->h[h].val == v) {
            t->h[h].tag = GONE;
            break;
        }
    if (t->prev[v] >= 0) t->next[t->prev[v]] = t->next[v];
    else t->first[u] = t->next[v];
    if (t->next[v] >= 0) t->prev[t->next[v]] = t->prev[v];
    t->dep[v] = 0; /* freed (only the root has depth 0) */
    t->next[v] = t->free_head;
    t->free_head = v;
    t->n_free++;
}

/* Frees childless node v of count 0, then each ancestor left so. */
static void prune(k3_stree *t, int32_t v) {
    while (v > 0 && t->cnt[v] <= 0 && t->first[v] < 0) {
        const int32_t u = t->par[v];
        remove_child(t, u, v);
        v = u;
    }
}

/* A removal (counts -1): the suffixes of the text before x (a->node[i] of
 * depth i + 1), each extended by x, and x alone from the root, one probe
 * each; the text's nodes are all there, but a suffix freed on the way
 * leaves a hole (-1) that the walk goes past. */
void k3_stree_pop(k3_stree *t, k3_sactive *a, int32_t x) {
    int32_t nn = 0, out[64];
    for (int32_t i = -1; i < a->n && nn < t->depth; i++) {
        const int32_t u = i < 0 ? 0 : a->node[i];
        out[nn++] = u < 0 ? -1 : k3_stree_child(t, u, x);
    }
    for (int32_t i = 0; i < nn; i++)
        if (out[i] >= 0) t->cnt[out[i]]--;
    /* a periodic text can meet one node twice: each is pruned once */
    for (int32_t i = nn - 1; i >= 0; i--)
        if (out[i] > 0 && t->dep[out[i]] > 0) prune(t, out[i]);
    for (int32_t i = 0; i < nn; i++)
        if (out[i] > 0 && t->dep[out[i]] == 0) out[i] = -1;
    t->version++;
    a->n = nn;
    memcpy(a->node, out, sizeof(int32_t) * (size_t)nn);
    a->version = t->version;
}

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
    /* every matched depth, as SuffixDecoding tries every match length: a
     * verbatim copy matches at every depth, and the deepest allow the
     * fewest tokens (depth - d), the middle ones the most */
    for (int32_t i = a->n - 1; i >= 0; i--) {
        const int32_t u = a->node[i];
        if (u < 0 || t->first[u] < 0) continue; /* nothing ever followed it */
        const int32_t d = t->dep[u];
        int32_t lim = max;
        if (spec_factor > 0 && (float)lim > spec_factor * (float)d) lim = (int32_t)(spec_factor * (float)d);
        if (lim > t->depth - d) lim = t->depth - d;
        if ((float)lim <= best_s) continue; /* its sum of probabilities cannot pass the best's */
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
