/*
 * blocks.c -- the block manager and the prefix index (kv.h).
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/error.h"
#include "kv/kv.h"

/* ---- hashing --------------------------------------------------------------- */

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t k3_kv_hash_seed(uint64_t cache_salt, int32_t block_size, int32_t kv_type) {
    return mix64(cache_salt ^ mix64(0x6B33ull + (uint64_t)(uint32_t)block_size * 131 + (uint64_t)(uint32_t)kv_type));
}

uint64_t k3_kv_hash_block(uint64_t parent, uint64_t extra, const int32_t *tokens, int32_t n) {
    uint64_t h = mix64(parent ^ 0x9E3779B97F4A7C15ull) ^ mix64(extra + 0x632BE59BD9B4E019ull);
    for (int32_t i = 0; i < n; i++)
        h = mix64(h + (uint64_t)(uint32_t)tokens[i] + 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1));
    return mix64(h ^ (uint64_t)n);
}

/* ---- free list ---------------------------------------------------------------- */

static void fl_remove(k3_kv_blocks *bm, int32_t b) {
    const int32_t p = bm->prev[b], n = bm->next[b];
    if (p >= 0) bm->next[p] = n;
    else bm->head = n;
    if (n >= 0) bm->prev[n] = p;
    else bm->tail = p;
    bm->prev[b] = bm->next[b] = -1;
    bm->in_free[b] = false;
    bm->n_free--;
}

static void fl_push_tail(k3_kv_blocks *bm, int32_t b) {
    bm->prev[b] = bm->tail;
    bm->next[b] = -1;
    if (bm->tail >= 0) bm->next[bm->tail] = b;
    else bm->head = b;
    bm->tail = b;
    bm->in_free[b] = true;
    bm->n_free++;
}

static void fl_push_head(k3_kv_blocks *bm, int32_t b) {
    bm->next[b] = bm->head;
    bm->prev[b] = -1;
    if (bm->head >= 0) bm->prev[bm->head] = b;
    else bm->tail = b;
    bm->head = b;
    bm->in_free[b] = true;
    bm->n_free++;
}

/* ---- index --------------------------------------------------------------------- */

static void index_remove(k3_kv_blocks *bm, int32_t b) {
    int32_t *at = &bm->bucket[bm->hash[b] & bm->bucket_mask];
    while (*at >= 0 && *at != b) at = &bm->chain[*at];
    if (*at == b) *at = bm->chain[b];
    bm->chain[b] = -1;
    bm->hashed[b] = false;
    bm->n_hashed--;
}

int32_t k3_kv_lookup(const k3_kv_blocks *bm, uint64_t hash, uint64_t parent, uint64_t extra, const int32_t *tokens) {
    const int32_t bs = bm->block_size;
    for (int32_t b = bm->bucket[hash & bm->bucket_mask]; b >= 0; b = bm->chain[b])
        if (bm->hash[b] == hash && bm->parent[b] == parent && bm->extra[b] == extra &&
            !memcmp(bm->tokens + (int64_t)b * bs, tokens, sizeof(int32_t) * (size_t)bs))
            return b;
    return -1;
}

void k3_kv_register(k3_kv_blocks *bm, int32_t b, uint64_t hash, uint64_t parent, uint64_t extra,
                    const int32_t *tokens) {
    if (b < 0 || b >= bm->n_blocks || bm->hashed[b]) return;
    if (k3_kv_lookup(bm, hash, parent, extra, tokens) >= 0) return;
    const int32_t bs = bm->block_size;
    bm->hash[b] = hash;
    bm->parent[b] = parent;
    bm->extra[b] = extra;
    memcpy(bm->tokens + (int64_t)b * bs, tokens, sizeof(int32_t) * (size_t)bs);
    int32_t *head = &bm->bucket[hash & bm->bucket_mask];
    bm->chain[b] = *head;
    *head = b;
    bm->hashed[b] = true;
    bm->n_hashed++;
    if (bm->obs && bm->obs->stored) bm->obs->stored(bm->obs->arg, hash, parent, extra, tokens, bs);
}

/* ---- residency metrics ------------------------------------------------------------- */

const double k3_kv_residency_le[K3_KV_RESIDENCY_BUCKETS] = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                                                            0.2,   0.5,   1,     2,    5,    10,   20,
                                                            30,    60,    120,   300,  600,  1200, 1800};

#define TRACK_HISTORY 4 /* accesses kept per block (vLLM: a deque of 4) */

typedef struct k3_kv_track {
    double rate;
    uint64_t rng;
    int64_t (*now_ns)(void *);
    void *now_arg;
    bool *on;              /* [n] followed */
    int64_t *birth, *last; /* [n] ns */
    int64_t *hist;         /* [n * TRACK_HISTORY] access times, oldest first */
    uint8_t *n_hist;       /* [n] */
    k3_kv_residency agg;
} k3_kv_track;

static int64_t mono_ns(void *arg) {
    (void)arg;
    return k3_now_ns();
}

static void track_free(k3_kv_track *t) {
    if (!t) return;
    free(t->on);
    free(t->birth);
    free(t->last);
    free(t->hist);
    free(t->n_hist);
    free(t);
}

k3_status k3_kv_track_enable(k3_kv_blocks *bm, double rate, uint64_t seed, k3_error *err) {
    if (!(rate >= 0 && rate <= 1))
        return k3_err(err, K3_ERR_ARG, "blocks: the residency sample rate %g is not in [0, 1]", rate);
    track_free(bm->track);
    bm->track = NULL;
    if (rate == 0) return K3_OK;
    k3_kv_track *t = calloc(1, sizeof *t);
    const size_t n = (size_t)bm->n_blocks;
    if (t) {
        t->on = calloc(n, sizeof *t->on);
        t->birth = calloc(n, sizeof *t->birth);
        t->last = calloc(n, sizeof *t->last);
        t->hist = calloc(n * TRACK_HISTORY, sizeof *t->hist);
        t->n_hist = calloc(n, sizeof *t->n_hist);
    }
    if (!t || !t->on || !t->birth || !t->last || !t->hist || !t->n_hist) {
        track_free(t);
        return k3_err(err, K3_ERR_NOMEM, "blocks: out of memory for the residency metrics of %d blocks", bm->n_blocks);
    }
    t->rate = rate;
    t->rng = seed ^ 0x9E3779B97F4A7C15ull;
    t->now_ns = mono_ns;
    t->agg.enabled = true;
    t->agg.sample_rate = rate;
    bm->track = t;
    return K3_OK;
}

void k3_kv_track_set_clock(k3_kv_blocks *bm, int64_t (*now_ns)(void *), void *arg) {
    if (!bm->track) return;
    bm->track->now_ns = now_ns ? now_ns : mono_ns;
    bm->track->now_arg = arg;
}

void k3_kv_track_get(const k3_kv_blocks *bm, k3_kv_residency *out) {
    if (bm->track) *out = bm->track->agg;
    else memset(out, 0, sizeof *out);
}

static void observe(k3_kv_hist *h, double v) {
    int b = 0;
    while (b < K3_KV_RESIDENCY_BUCKETS && v > k3_kv_residency_le[b]) b++;
    h->count[b]++;
    h->sum += v;
    h->n++;
}

/* Block b is taken for new tokens: a followed one is observed and dropped,
 * then the new one is followed with probability rate. */
static void track_alloc(k3_kv_track *t, int32_t b) {
    const int64_t now = t->now_ns(t->now_arg);
    if (t->on[b]) {
        observe(&t->agg.lifetime, (double)(now - t->birth[b]) * 1e-9);
        observe(&t->agg.idle, (double)(now - t->last[b]) * 1e-9);
        const int64_t *h = t->hist + (size_t)b * TRACK_HISTORY;
        for (int i = 1; i < t->n_hist[b]; i++) observe(&t->agg.reuse_gap, (double)(h[i] - h[i - 1]) * 1e-9);
        t->on[b] = false;
    }
    t->rng = mix64(t->rng + 0x9E3779B97F4A7C15ull);
    if ((double)(t->rng >> 11) * 0x1.0p-53 < t->rate) {
        t->on[b] = true;
        t->birth[b] = t->last[b] = now;
        t->n_hist[b] = 0;
    }
}

static void track_access(k3_kv_track *t, int32_t b) {
    if (!t->on[b]) return;
    const int64_t now = t->now_ns(t->now_arg);
    int64_t *h = t->hist + (size_t)b * TRACK_HISTORY;
    if (t->n_hist[b] == TRACK_HISTORY) {
        memmove(h, h + 1, sizeof *h * (TRACK_HISTORY - 1));
        t->n_hist[b]--;
    }
    h[t->n_hist[b]++] = now;
    t->last[b] = now;
}

/* ---- the manager ------------------------------------------------------------------ */

k3_status k3_kv_blocks_init(k3_kv_blocks *bm, int32_t n_blocks, int32_t block_size, k3_error *err) {
    memset(bm, 0, sizeof *bm);
    if (n_blocks < 1 || block_size < 1)
        return k3_err(err, K3_ERR_ARG, "blocks: need at least one block of at least one token");
    bm->n_blocks = n_blocks;
    bm->block_size = block_size;
    uint32_t nb = 16;
    while (nb < (uint32_t)n_blocks * 2u && nb < (1u << 30)) nb <<= 1;
    bm->bucket_mask = nb - 1;
    const size_t n = (size_t)n_blocks;
    bm->ref = calloc(n, sizeof(int32_t));
    bm->prev = malloc(n * sizeof(int32_t));
    bm->next = malloc(n * sizeof(int32_t));
    bm->in_free = calloc(n, sizeof(bool));
    bm->hashed = calloc(n, sizeof(bool));
    bm->hash = calloc(n, sizeof(uint64_t));
    bm->parent = calloc(n, sizeof(uint64_t));
    bm->extra = calloc(n, sizeof(uint64_t));
    bm->tokens = malloc(n * (size_t)block_size * sizeof(int32_t));
    bm->chain = malloc(n * sizeof(int32_t));
    bm->bucket = malloc(nb * sizeof(int32_t));
    if (!bm->ref || !bm->prev || !bm->next || !bm->in_free || !bm->hashed || !bm->hash || !bm->parent || !bm->extra ||
        !bm->tokens || !bm->chain || !bm->bucket) {
        k3_kv_blocks_free(bm);
        return k3_err(err, K3_ERR_NOMEM, "blocks: out of memory for %d blocks", n_blocks);
    }
    for (uint32_t i = 0; i < nb; i++) bm->bucket[i] = -1;
    bm->head = bm->tail = -1;
    for (int32_t b = 0; b < n_blocks; b++) {
        bm->chain[b] = -1;
        fl_push_tail(bm, b); /* low ids first */
    }
    return K3_OK;
}

void k3_kv_blocks_free(k3_kv_blocks *bm) {
    free(bm->ref);
    free(bm->prev);
    free(bm->next);
    free(bm->in_free);
    free(bm->hashed);
    free(bm->hash);
    free(bm->parent);
    free(bm->extra);
    free(bm->tokens);
    free(bm->chain);
    free(bm->bucket);
    track_free(bm->track);
    memset(bm, 0, sizeof *bm);
}

int32_t k3_kv_alloc(k3_kv_blocks *bm) {
    const int32_t b = bm->head;
    if (b < 0) return -1;
    fl_remove(bm, b);
    if (bm->hashed[b]) {
        index_remove(bm, b);
        bm->n_evicted++;
        if (bm->obs && bm->obs->removed) bm->obs->removed(bm->obs->arg, bm->hash[b]);
    }
    if (bm->track) track_alloc(bm->track, b);
    bm->ref[b] = 1;
    return b;
}

void k3_kv_ref(k3_kv_blocks *bm, int32_t b) {
    K3_ASSERT(b >= 0 && b < bm->n_blocks);
    if (bm->ref[b]++ == 0 && bm->in_free[b]) fl_remove(bm, b);
    if (bm->track) track_access(bm->track, b);
}

void k3_kv_unref(k3_kv_blocks *bm, int32_t b) {
    K3_ASSERT(b >= 0 && b < bm->n_blocks && bm->ref[b] > 0);
    if (--bm->ref[b] > 0) return;
    if (bm->hashed[b]) fl_push_tail(bm, b);
    else fl_push_head(bm, b);
}

bool k3_kv_check(const k3_kv_blocks *bm) {
    int32_t n = 0, last = -1;
    for (int32_t b = bm->head; b >= 0; b = bm->next[b]) {
        if (bm->ref[b] != 0 || !bm->in_free[b] || bm->prev[b] != last) return false;
        last = b;
        if (++n > bm->n_blocks) return false;
    }
    if (n != bm->n_free || last != bm->tail) return false;
    int64_t nh = 0;
    for (int32_t b = 0; b < bm->n_blocks; b++) {
        if (bm->ref[b] < 0 || (bm->ref[b] == 0) != bm->in_free[b]) return false;
        nh += bm->hashed[b];
    }
    if (nh != bm->n_hashed) return false;
    int64_t in_buckets = 0;
    for (uint32_t i = 0; i <= bm->bucket_mask; i++)
        for (int32_t b = bm->bucket[i]; b >= 0; b = bm->chain[b]) {
            if (!bm->hashed[b] || (bm->hash[b] & bm->bucket_mask) != i) return false;
            if (++in_buckets > bm->n_blocks) return false;
        }
    return in_buckets == nh;
}
