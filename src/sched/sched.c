/*
 * sched.c -- the scheduler (sched.h).
 */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "sched/sched.h"

k3_status k3_sched_init(k3_sched *s, const k3_sched_config *cfg, k3_kv_blocks *bm, k3_kv_snaps *sn, k3_error *err) {
    memset(s, 0, sizeof *s);
    s->cfg = *cfg;
    if (s->cfg.snapshot_stride < 1) s->cfg.snapshot_stride = 1;
    s->bm = bm;
    s->sn = sn;
    s->running = calloc((size_t)cfg->max_seqs, sizeof(k3_rq *));
    s->plan = calloc((size_t)cfg->max_seqs, sizeof(k3_rq *));
    s->free_slots = malloc(sizeof(int32_t) * (size_t)cfg->max_seqs);
    if (!s->running || !s->plan || !s->free_slots) {
        k3_sched_free(s);
        return k3_err(err, K3_ERR_NOMEM, "scheduler: out of memory");
    }
    for (int32_t i = 0; i < cfg->max_seqs; i++) s->free_slots[i] = cfg->max_seqs - 1 - i;
    s->n_free_slots = cfg->max_seqs;
    return K3_OK;
}

void k3_sched_free(k3_sched *s) {
    free(s->running);
    free(s->plan);
    free(s->free_slots);
    free(s->waiting);
    memset(s, 0, sizeof *s);
}

void k3_sched_hash(k3_sched *s, k3_rq *rq) {
    const int32_t bs = s->cfg.block_size;
    while ((int64_t)(rq->n_hash + 1) * bs <= rq->n_tok && rq->n_hash < s->cfg.max_blocks) {
        const uint64_t parent = rq->n_hash ? rq->hash[rq->n_hash - 1] : s->cfg.hash_seed;
        /* the block's extra key: its tokens' keys folded (0 when all are 0) */
        uint64_t x = 0;
        if (rq->tok_extra)
            for (int64_t i = (int64_t)rq->n_hash * bs; i < (int64_t)(rq->n_hash + 1) * bs && i < rq->n_prompt; i++)
                if (rq->tok_extra[i]) x = k3_kv_hash_block(x ^ rq->tok_extra[i], (uint64_t)i, NULL, 0);
        /* the request's cache salt is its first block's key: another salt never shares a block */
        if (rq->n_hash == 0 && rq->salt) x = k3_kv_hash_block(x ^ rq->salt, UINT64_MAX, NULL, 0);
        rq->extra[rq->n_hash] = x;
        rq->hash[rq->n_hash] = k3_kv_hash_block(parent, x, rq->tok + (int64_t)rq->n_hash * bs, bs);
        rq->n_hash++;
    }
}

k3_status k3_sched_add(k3_sched *s, k3_rq *rq, k3_error *err) {
    if (s->n_waiting == s->cap_waiting) {
        const int32_t cap = s->cap_waiting ? 2 * s->cap_waiting : 64;
        k3_rq **w = realloc(s->waiting, sizeof(k3_rq *) * (size_t)cap);
        if (!w) return k3_err(err, K3_ERR_NOMEM, "scheduler: out of memory for the queue");
        s->waiting = w;
        s->cap_waiting = cap;
    }
    rq->state = K3_RQ_WAITING;
    rq->slot = -1;
    s->waiting[s->n_waiting++] = rq;
    return K3_OK;
}

k3_status k3_sched_add_landed(k3_sched *s, k3_rq *rq, k3_error *err) {
    K3_TRY(k3_sched_add(s, rq, err));
    /* before the first waiting request that is not landed */
    int32_t at = 0;
    while (at < s->n_waiting - 1 && s->waiting[at]->n_blocks > 0) at++;
    memmove(s->waiting + at + 1, s->waiting + at, sizeof(k3_rq *) * (size_t)(s->n_waiting - 1 - at));
    s->waiting[at] = rq;
    return K3_OK;
}

static void waiting_remove(k3_sched *s, int32_t i) {
    memmove(s->waiting + i, s->waiting + i + 1, sizeof(k3_rq *) * (size_t)(s->n_waiting - i - 1));
    s->n_waiting--;
}

static void running_remove(k3_sched *s, const k3_rq *rq) {
    for (int32_t i = 0; i < s->n_running; i++)
        if (s->running[i] == rq) {
            memmove(s->running + i, s->running + i + 1, sizeof(k3_rq *) * (size_t)(s->n_running - i - 1));
            s->n_running--;
            return;
        }
}

/* Gives back rq's blocks (last first, so a sequence's tail is reused before
 * its head) and its slot. */
static void drop_blocks(k3_sched *s, k3_rq *rq) {
    for (int32_t b = rq->n_blocks - 1; b >= 0; b--) k3_kv_unref(s->bm, rq->blocks[b]);
    rq->n_blocks = 0;
    rq->n_registered = 0;
    if (rq->slot >= 0) s->free_slots[s->n_free_slots++] = rq->slot;
    rq->slot = -1;
}

void k3_sched_release(k3_sched *s, k3_rq *rq) {
    if (rq->state == K3_RQ_RUNNING) running_remove(s, rq);
    else if (rq->state == K3_RQ_WAITING)
        for (int32_t i = 0; i < s->n_waiting; i++)
            if (s->waiting[i] == rq) {
                waiting_remove(s, i);
                break;
            }
    drop_blocks(s, rq);
    rq->state = K3_RQ_DONE;
}

/* Back to the front of the queue, to recompute everything it had. The
 * queue has room: rq was counted in it when it arrived. */
static void preempt(k3_sched *s, k3_rq *rq) {
    running_remove(s, rq);
    drop_blocks(s, rq);
    rq->n_computed = 0;
    rq->n_draft = 0;
    rq->junction = 0;
    rq->state = K3_RQ_WAITING;
    rq->events |= K3_EV_PREEMPTED;
    K3_ASSERT(s->n_waiting < s->cap_waiting);
    memmove(s->waiting + 1, s->waiting, sizeof(k3_rq *) * (size_t)s->n_waiting);
    s->waiting[0] = rq;
    s->n_waiting++;
    s->n_preemptions++;
}

static int64_t grid_floor(const k3_sched *s, int64_t p) { return p - p % s->cfg.block_size; }

static bool is_snap_point(const k3_sched *s, const k3_rq *rq, int64_t p) {
    const int32_t bs = s->cfg.block_size;
    if (!s->cfg.prefix_cache || s->sn->cap == 0 || p <= 0 || p % bs || p > rq->prefill_end) return false;
    return (p / bs) % s->cfg.snapshot_stride == 0 || p == grid_floor(s, rq->prefill_end) || p == rq->junction;
}

/* What the guard charges for a prompt token at position p. */
static double token_cost(const k3_sched *s, int64_t p) {
    const int64_t q = p < s->cfg.cost_cap ? p : s->cfg.cost_cap;
    return 1.0 + (double)p * s->cfg.cost_slope + (double)q * s->cfg.cost_cap_slope;
}

/* The cost of positions [c, c + n). */
static double span_cost(const k3_sched *s, int64_t c, int64_t n) {
    double t = 0;
    for (int64_t i = 0; i < n; i++) t += token_cost(s, c + i);
    return t;
}

/* Tokens rq can take this step from `budget` (and from `cost_left` of the
 * guard when it is >= 0), on the grid unless it ends the prefill or the
 * guard holds it inside a block (0 = none now). A request with one token
 * to compute is a decode: the guard reserved its cost. */
static int32_t chunk(const k3_sched *s, const k3_rq *rq, int32_t budget, int32_t plp_left, double cost_left) {
    const int64_t c = rq->n_computed, need = rq->n_tok - c;
    if (need == 1 && rq->n_draft > 0) /* a verify chunk: as much of it as the budget takes */
        return 1 + rq->n_draft < budget ? 1 + rq->n_draft : budget;
    int64_t n = need < budget ? need : budget;
    if (rq->plp && c < rq->n_prompt && n > plp_left) n = plp_left;
    bool held = false;
    if (cost_left >= 0 && need > 1) {
        int64_t k = 0;
        for (double left = cost_left; k < n && (left -= token_cost(s, c + k)) >= 0;) k++;
        held = k < n;
        n = k;
    }
    if (n < need) {
        const int64_t g = grid_floor(s, c + n) - c;
        if (g > 0 || !held) n = g;
    }
    return n > 0 ? (int32_t)n : 0;
}

static int32_t blocks_for(const k3_sched *s, int64_t n_tokens) {
    return (int32_t)((n_tokens + s->cfg.block_size - 1) / s->cfg.block_size);
}

/* Prefix lookup: *hit tokens (with a snapshot), blocks in out[], *attn the
 * blocks that match at all. */
static void lookup(k3_sched *s, const k3_rq *rq, int32_t *out, int32_t *n_hit_blocks, int32_t *n_attn) {
    *n_hit_blocks = *n_attn = 0;
    if (!s->cfg.prefix_cache || !rq->read_cache) return;
    const int32_t bs = s->cfg.block_size;
    const int64_t max_blocks = (rq->n_tok - 1) / bs; /* leave a token to compute */
    int32_t k = 0, best = 0;
    for (; k < max_blocks && k < rq->n_hash; k++) {
        const uint64_t parent = k ? rq->hash[k - 1] : s->cfg.hash_seed;
        const int32_t b = k3_kv_lookup(s->bm, rq->hash[k], parent, rq->extra[k], rq->tok + (int64_t)k * bs);
        if (b < 0) break;
        out[k] = b;
        /* a model without KDA layers has no state to restore: every matched
         * block boundary is a hit */
        if (s->sn->bytes_each == 0 || k3_kv_snap_has(s->sn, rq->hash[k], (int64_t)(k + 1) * bs)) best = k + 1;
    }
    *n_attn = k;
    *n_hit_blocks = best;
}

/* True when a running request is about to compute rq's next block itself. */
static bool next_block_pending(const k3_sched *s, const k3_rq *rq, int32_t k) {
    if (!s->cfg.prefix_cache || !rq->read_cache || k >= rq->n_hash) return false;
    const int64_t end = (int64_t)(k + 1) * s->cfg.block_size;
    for (int32_t i = 0; i < s->n_running; i++) {
        const k3_rq *r = s->running[i];
        if (r->n_hash > k && r->hash[k] == rq->hash[k] && r->n_computed < end && r->prefill_end >= end) return true;
    }
    return false;
}

/* Under the guard (*cost_left >= 0): adds rq's n scheduled tokens to the
 * step's cost *step (a decode 1, a prompt chunk by position) and takes a
 * prompt chunk off what the guard has left (a decode's cost was reserved).
 * Without the guard nothing is priced. */
static void charge(const k3_sched *s, const k3_rq *rq, int32_t n, double *cost_left, double *step) {
    if (*cost_left < 0) return;
    if (rq->n_tok - rq->n_computed == 1) { /* a decode, or a verify chunk of n */
        *step += (double)n;
        if (n > 1) *cost_left = *cost_left > n - 1 ? *cost_left - (n - 1) : 0;
        return;
    }
    const double c = span_cost(s, rq->n_computed, n);
    *step += c;
    *cost_left = *cost_left > c ? *cost_left - c : 0;
}

void k3_sched_schedule(k3_sched *s) {
    const int32_t bs = s->cfg.block_size;
    int32_t budget = s->cfg.max_num_batched_tokens, plp_left = s->cfg.plp_cap;
    s->n_plan = 0;
    s->plan_tokens = 0;
    bool preempted = false;
    /* the guard: with decodes running, prompt chunks get what they leave of
     * max_step_cost (-1: no guard this step) */
    double cost_left = -1, step_cost = 0;
    if (s->cfg.max_step_cost > 0) {
        int32_t n_dec = 0;
        for (int32_t i = 0; i < s->n_running; i++) n_dec += s->running[i]->n_tok - s->running[i]->n_computed == 1;
        if (n_dec > 0) cost_left = s->cfg.max_step_cost > n_dec ? s->cfg.max_step_cost - n_dec : 0;
    }

    /* 1. running requests, oldest first */
    for (int32_t i = 0; i < s->n_running && budget > 0; i++) {
        k3_rq *rq = s->running[i];
        rq->is_new = false;
        int32_t n = chunk(s, rq, budget, plp_left, cost_left);
        if (n == 0) continue;
        int32_t need = blocks_for(s, rq->n_computed + n) - rq->n_blocks;
        /* drafts give way before anyone is preempted */
        while (n > 1 && rq->n_tok - rq->n_computed == 1 && need > s->bm->n_free)
            need = blocks_for(s, rq->n_computed + --n) - rq->n_blocks;
        if (rq->n_tok - rq->n_computed == 1) rq->n_draft = n - 1;
        bool self = false;
        while (need > s->bm->n_free) {
            k3_rq *victim = s->running[s->n_running - 1];
            preempted = true;
            preempt(s, victim);
            if (victim == rq) {
                self = true;
                break;
            }
        }
        if (self) break;
        for (int32_t b = 0; b < need; b++) rq->blocks[rq->n_blocks++] = k3_kv_alloc(s->bm);
        rq->n_sched = n;
        s->plan[s->n_plan++] = rq;
        s->plan_tokens += n;
        budget -= n;
        if (rq->plp && rq->n_computed < rq->n_prompt) plp_left -= n;
        charge(s, rq, n, &cost_left, &step_cost);
    }

    /* 2. waiting requests, in order, unless this step preempted */
    for (int32_t w = 0; !preempted && w < s->n_waiting && budget > 0 && s->n_free_slots > 0;) {
        k3_rq *rq = s->waiting[w];
        if (rq->n_blocks > 0) { /* landed: its prompt is in its blocks, its state in hand */
            /* its snapshot points (the junction among them) before its chunk is cut at them */
            rq->prefill_end = rq->n_prompt;
            rq->junction = rq->landed_junction > rq->n_computed && rq->landed_junction < rq->n_prompt &&
                    rq->landed_junction % bs == 0
                ? rq->landed_junction
                : 0;
            const int32_t n = chunk(s, rq, budget, plp_left, cost_left);
            const int32_t need = blocks_for(s, rq->n_computed + n) - rq->n_blocks;
            if (n == 0 || need > s->bm->n_free) break;
            for (int32_t b = 0; b < need; b++) rq->blocks[rq->n_blocks++] = k3_kv_alloc(s->bm);
            rq->restore = rq->landed_state;
            rq->landed_state = NULL;
            rq->landed_junction = 0;
            rq->admitted_once = true;
            rq->slot = s->free_slots[--s->n_free_slots];
            rq->state = K3_RQ_RUNNING;
            rq->is_new = true;
            rq->events |= K3_EV_SCHEDULED;
            rq->n_sched = n;
            waiting_remove(s, w);
            s->running[s->n_running++] = rq;
            s->plan[s->n_plan++] = rq;
            s->plan_tokens += n;
            budget -= n;
            charge(s, rq, n, &cost_left, &step_cost);
            continue;
        }
        int32_t n_hit = 0, n_attn = 0;
        lookup(s, rq, rq->blocks, &n_hit, &n_attn); /* the table is empty while waiting */
        if (next_block_pending(s, rq, n_hit)) {
            w++; /* it waits for that block (and its snapshot) */
            continue;
        }
        rq->n_computed = (int64_t)n_hit * bs;
        rq->prefill_end = rq->n_tok;
        rq->junction = n_attn > n_hit ? (int64_t)n_attn * bs : 0;
        const int32_t n = chunk(s, rq, budget, plp_left, cost_left);
        /* blocks: the hit ones that sit on the free list count against it */
        int32_t from_free = 0;
        for (int32_t k = 0; k < n_hit; k++) from_free += s->bm->ref[rq->blocks[k]] == 0;
        const int32_t need = blocks_for(s, rq->n_computed + n) - n_hit;
        if (n == 0 || need + from_free > s->bm->n_free) {
            rq->n_computed = 0;
            rq->junction = 0;
            break;
        }
        for (int32_t k = 0; k < n_hit; k++) k3_kv_ref(s->bm, rq->blocks[k]);
        rq->n_blocks = n_hit;
        for (int32_t b = 0; b < need; b++) rq->blocks[rq->n_blocks++] = k3_kv_alloc(s->bm);
        rq->n_registered = n_hit;
        rq->restore = n_hit ? k3_kv_snap_find(s->sn, rq->hash[n_hit - 1], (int64_t)n_hit * bs) : NULL;
        if (s->cfg.prefix_cache && rq->read_cache) {
            s->prefix_queries += rq->n_tok;
            s->prefix_hits += rq->n_computed;
        }
        if (!rq->admitted_once) rq->n_cached = rq->n_computed;
        rq->admitted_once = true;
        rq->slot = s->free_slots[--s->n_free_slots];
        rq->state = K3_RQ_RUNNING;
        rq->is_new = true;
        rq->events |= K3_EV_SCHEDULED;
        rq->n_sched = n;
        waiting_remove(s, w);
        s->running[s->n_running++] = rq;
        s->plan[s->n_plan++] = rq;
        s->plan_tokens += n;
        budget -= n;
        if (rq->plp) plp_left -= n;
        charge(s, rq, n, &cost_left, &step_cost);
    }
    if (cost_left >= 0 && step_cost > s->guarded_cost_max) s->guarded_cost_max = step_cost;
}

int64_t k3_sched_local_hit(k3_sched *s, k3_rq *rq) {
    int32_t n_hit = 0, n_attn = 0;
    lookup(s, rq, rq->blocks, &n_hit, &n_attn);
    return (int64_t)n_hit * s->cfg.block_size;
}

bool k3_sched_alloc_beyond(k3_sched *s, k3_rq *rq, int32_t n_local, int32_t nb) {
    int32_t from_free = 0;
    for (int32_t i = 0; i < n_local; i++) from_free += s->bm->ref[rq->blocks[i]] == 0;
    if (nb - n_local + from_free > s->bm->n_free) return false;
    for (int32_t i = 0; i < n_local; i++) k3_kv_ref(s->bm, rq->blocks[i]);
    for (int32_t i = n_local; i < nb; i++) rq->blocks[i] = k3_kv_alloc(s->bm);
    rq->n_blocks = nb;
    rq->n_registered = n_local;
    rq->n_computed = 0;
    rq->state = K3_RQ_REMOTE;
    return true;
}

void k3_sched_drop_blocks(k3_sched *s, k3_rq *rq) {
    drop_blocks(s, rq);
    rq->n_computed = 0;
}

void k3_sched_count_hit(k3_sched *s, const k3_rq *rq, int64_t n_local) {
    if (!s->cfg.prefix_cache || !rq->read_cache) return;
    s->prefix_queries += rq->n_tok;
    s->prefix_hits += n_local;
}

bool k3_sched_remote_alloc(k3_sched *s, k3_rq *rq) {
    const int32_t bs = s->cfg.block_size, nb = blocks_for(s, rq->n_prompt);
    int32_t k = 0;
    if (s->cfg.prefix_cache && rq->read_cache)
        for (const int64_t full = rq->n_prompt / bs; k < full && k < rq->n_hash; k++) {
            const uint64_t parent = k ? rq->hash[k - 1] : s->cfg.hash_seed;
            const int32_t b = k3_kv_lookup(s->bm, rq->hash[k], parent, rq->extra[k], rq->tok + (int64_t)k * bs);
            if (b < 0) break;
            rq->blocks[k] = b;
        }
    int32_t from_free = 0;
    for (int32_t i = 0; i < k; i++) from_free += s->bm->ref[rq->blocks[i]] == 0;
    if (nb - k + from_free > s->bm->n_free) return false;
    for (int32_t i = 0; i < k; i++) k3_kv_ref(s->bm, rq->blocks[i]);
    for (int32_t i = k; i < nb; i++) rq->blocks[i] = k3_kv_alloc(s->bm);
    rq->n_blocks = nb;
    rq->n_registered = k;
    rq->n_computed = 0;
    rq->n_cached = (int64_t)k * bs;
    if (s->cfg.prefix_cache && rq->read_cache) {
        s->prefix_queries += rq->n_prompt;
        s->prefix_hits += rq->n_cached;
    }
    rq->state = K3_RQ_REMOTE;
    return true;
}

int32_t k3_sched_snap_points(const k3_sched *s, const k3_rq *rq, int64_t *pos, uint64_t *key, int32_t max) {
    if (s->sn->bytes_each == 0) return 0;
    const int64_t bs = s->cfg.block_size, end = rq->n_computed + rq->n_sched;
    int32_t n = 0;
    for (int64_t p = (rq->n_computed / bs + 1) * bs; p <= end && n < max; p += bs) {
        if (!is_snap_point(s, rq, p) || p / bs > rq->n_hash) continue;
        const uint64_t k = rq->hash[p / bs - 1];
        if (k3_kv_snap_has(s->sn, k, p)) continue;
        pos[n] = p;
        key[n++] = k;
    }
    return n;
}

void k3_sched_computed(k3_sched *s, k3_rq *rq) {
    const int32_t bs = s->cfg.block_size;
    rq->n_computed += rq->n_sched;
    rq->n_sched = 0;
    rq->is_new = false;
    rq->restore = NULL;
    if (!s->cfg.prefix_cache) return;
    while (rq->n_registered < rq->n_hash && (int64_t)(rq->n_registered + 1) * bs <= rq->n_computed) {
        const int32_t k = rq->n_registered++;
        k3_kv_register(s->bm, rq->blocks[k], rq->hash[k], k ? rq->hash[k - 1] : s->cfg.hash_seed, rq->extra[k],
                       rq->tok + (int64_t)k * bs);
    }
}

void k3_sched_verified(k3_sched *s, k3_rq *rq, int32_t m) {
    rq->n_draft = 0;
    rq->n_sched = m;
    k3_sched_computed(s, rq);
    /* the next step writes position n_computed: its block stays */
    const int32_t keep = blocks_for(s, rq->n_computed + 1);
    for (int32_t b = rq->n_blocks - 1; b >= keep; b--) k3_kv_unref(s->bm, rq->blocks[b]);
    if (rq->n_blocks > keep) rq->n_blocks = keep;
}

int64_t k3_sched_blocks_held(const k3_sched *s) {
    int64_t n = 0;
    for (int32_t i = 0; i < s->n_running; i++) n += s->running[i]->n_blocks;
    for (int32_t i = 0; i < s->n_waiting; i++) n += s->waiting[i]->n_blocks;
    return n;
}
