/*
 * pd.c -- prefill/decode disaggregation's KV connector (connector.h) and
 * the k3_engine_hold_* / k3_engine_pull_* API of k3.h that src/pd's agent
 * calls from its own threads.
 *
 * Prefill side: a request submitted with kv_hold keeps, when it ends by
 * stop or length, its blocks (a reference each) and its KDA state at the
 * prompt's end (captured in the pass that ends the prompt) as a hold, until
 * a decode instance has read it and released it, or its timeout passes.
 * Decode side: a remote request waits for its prompt's blocks in arrival
 * order (the scheduler does not see it), the pull hook fetches them, and
 * once the pull is done it lands: its blocks enter the prefix cache as if
 * computed, the prefill instance's first token is its first output, and it
 * joins the scheduler's queue to decode on.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "engine/internal.h"
#include "executor/executor.h"

/* A finished request's blocks and end state, kept for a decode instance. */
typedef struct hold {
    uint64_t id;
    int32_t *blocks;
    int32_t n_blocks;
    int64_t n_tokens;
    void *state;
    double deadline;
    double queue_s, prefill_s;
    int pins; /* reads in flight */
    bool released;
} hold;

typedef struct k3_pd_conn {
    k3_kv_connector c;
    k3_engine *e;
    k3_pull_hook pull_hook;
    void *pull_arg;
    req **rwait; /* stepping thread: remote requests waiting for blocks, in order */
    int32_t n_rwait, cap_rwait;
    bool rwait_blocked; /* the first of them did not fit since blocks were last freed */
    req **pulls;        /* under mu: remote requests pulling */
    int32_t n_pulls, cap_pulls;
    hold **holds; /* under mu */
    int32_t n_holds, cap_holds;
    int64_t holds_expired, holds_released, pulls_ok, pulls_failed; /* under mu */
    double hold_timeout;
} k3_pd_conn;

static void hold_free(hold *h) {
    if (!h) return;
    free(h->blocks);
    free(h->state);
    free(h);
}

/* A hold that a step should free now (under mu). */
static bool hold_due(const hold *h, double now) { return h->pins == 0 && (h->released || now >= h->deadline); }

static void pull_hook(k3_pd_conn *pd, req *r, k3_pull_op op) {
    const k3_pull_info pi = {op, r->rq.id, r->rp.ctx, r->rq.n_cached, r->rq.n_prompt};
    if (pd->pull_hook) pd->pull_hook(pd->pull_arg, &pi);
}

/* ---- the connector's calls ------------------------------------------------- */

/* Frees the holds that are due. */
static void pd_begin(void *self, double t) {
    k3_pd_conn *pd = self;
    k3_engine *e = pd->e;
    pthread_mutex_lock(&e->mu);
    for (int32_t i = 0; i < pd->n_holds;) {
        hold *h = pd->holds[i];
        if (!hold_due(h, t)) {
            i++;
            continue;
        }
        if (!h->released) pd->holds_expired++;
        pd->holds[i] = pd->holds[--pd->n_holds];
        for (int32_t b = h->n_blocks - 1; b >= 0; b--) k3_kv_unref(&e->bm, h->blocks[b]);
        hold_free(h);
        pd->rwait_blocked = false;
    }
    pthread_mutex_unlock(&e->mu);
}

/* A remote request waits for its blocks (arrival order). */
static bool pd_arrive(void *self, req *r) {
    k3_pd_conn *pd = self;
    k3_engine *e = pd->e;
    if (!r->remote) return false;
    if (k3_engine_push_ptr((void ***)&pd->rwait, &pd->n_rwait, &pd->cap_rwait, r)) {
        r->pull_phase = PULL_WAIT;
        return true;
    }
    snprintf(r->error, sizeof r->error, "out of memory for the queue");
    r->finished = true;
    r->finish = K3_FINISH_ERROR;
    r->rq.state = K3_RQ_DONE;
    r->rq.events |= K3_EV_FINISHED;
    e->finished_by[K3_FINISH_ERROR]++;
    pull_hook(pd, r, K3_PULL_ABORT);
    return true;
}

static bool pd_cancel(void *self, req *r, double t) {
    k3_pd_conn *pd = self;
    k3_engine *e = pd->e;
    if (r->pull_phase == PULL_WAIT) { /* no blocks yet: nothing to fetch */
        for (int32_t k = 0; k < pd->n_rwait; k++)
            if (pd->rwait[k] == r) {
                memmove(pd->rwait + k, pd->rwait + k + 1, sizeof(req *) * (size_t)(pd->n_rwait - k - 1));
                pd->n_rwait--;
                break;
            }
        r->pull_phase = PULL_NONE;
        k3_engine_finish(e, r, K3_FINISH_CANCELLED, t);
        pull_hook(pd, r, K3_PULL_ABORT);
        return true;
    }
    if (r->pull_phase != PULL_NONE) { /* its blocks are being written: ended once the pull stops */
        pthread_mutex_lock(&e->mu);
        r->pull_cancel = true;
        pthread_mutex_unlock(&e->mu);
        pull_hook(pd, r, K3_PULL_CANCEL);
        return true;
    }
    return false;
}

/* Remote requests in arrival order get their blocks while they fit, and
 * their pulls start. */
static void pd_before_schedule(void *self, double t) {
    k3_pd_conn *pd = self;
    k3_engine *e = pd->e;
    while (pd->n_rwait > 0) {
        req *r = pd->rwait[0];
        if (!k3_sched_remote_alloc(&e->sched, &r->rq)) {
            pd->rwait_blocked = true;
            return;
        }
        memmove(pd->rwait, pd->rwait + 1, sizeof(req *) * (size_t)(pd->n_rwait - 1));
        pd->n_rwait--;
        r->t_pull0 = r->t_scheduled = t;
        r->rq.events |= K3_EV_SCHEDULED;
        pthread_mutex_lock(&e->mu);
        const bool ok = k3_engine_push_ptr((void ***)&pd->pulls, &pd->n_pulls, &pd->cap_pulls, r);
        if (ok) r->pull_phase = PULL_ACTIVE;
        pthread_mutex_unlock(&e->mu);
        if (!ok) {
            snprintf(r->error, sizeof r->error, "out of memory for the pull list");
            r->pull_phase = PULL_NONE;
            k3_engine_finish(e, r, K3_FINISH_ERROR, t);
            pull_hook(pd, r, K3_PULL_ABORT);
            continue;
        }
        pull_hook(pd, r, K3_PULL_START);
    }
}

/* A request kept for a decode instance: its state where the prompt ends,
 * captured in the pass that crosses it. */
static void pd_before_run(void *self) {
    k3_pd_conn *pd = self;
    k3_engine *e = pd->e;
    const k3_sched *s = &e->sched;
    for (int32_t i = 0; i < s->n_plan; i++) {
        const k3_rq *rq = s->plan[i];
        req *r = rq->owner;
        if (r->hold_state && rq->n_computed < rq->n_prompt && rq->n_computed + rq->n_sched >= rq->n_prompt)
            r->hold_captured = !k3_ctx_capture_state(e->ctx, rq->slot, rq->n_prompt, r->hold_state, NULL);
    }
}

static void pd_after_run(void *self, bool ok) {
    k3_pd_conn *pd = self;
    const k3_sched *s = &pd->e->sched;
    if (!ok)
        for (int32_t i = 0; i < s->n_plan; i++) ((req *)s->plan[i]->owner)->hold_captured = false;
}

/* A remote request's pull has landed: its blocks enter the prefix cache as
 * if computed, the prefill instance's first token is its first output, and
 * it waits (with its blocks) to decode on. */
static void land(k3_pd_conn *pd, req *r, double t) {
    k3_engine *e = pd->e;
    k3_sched *s = &e->sched;
    k3_rq *rq = &r->rq;
    const int32_t bs = e->block_size;
    rq->n_computed = rq->n_prompt;
    if (!e->o.no_prefix_cache) {
        while (rq->n_registered < rq->n_hash && (int64_t)(rq->n_registered + 1) * bs <= rq->n_computed) {
            const int32_t k = rq->n_registered++;
            k3_kv_register(&e->bm, rq->blocks[k], rq->hash[k], k ? rq->hash[k - 1] : s->cfg.hash_seed, rq->extra[k],
                           rq->tok + (int64_t)k * bs);
        }
        /* the state at the prompt's end is the snapshot a local prefill would keep there */
        if (e->state_bytes > 0 && rq->n_prompt % bs == 0 && rq->n_prompt / bs <= rq->n_hash) {
            void *buf = k3_kv_snap_put(&e->sn, rq->hash[rq->n_prompt / bs - 1], rq->n_prompt);
            if (buf) memcpy(buf, r->pull_state, (size_t)e->state_bytes);
        }
    }
    const int32_t id = r->rp.first_token;
    k3_sampler_take(r->smp, id);
    k3_sampler_accept(r->smp, id);
    r->out_tok[0] = id;
    r->out_lp[0] = r->rp.first_logprob;
    for (int32_t k = 0; k < r->p.logprobs; k++)
        r->out_top[k] = k < r->rp.n_first_top ? r->first_top[k] : (k3_logprob){-1, -INFINITY};
    r->n_new = 1;
    r->n_gen = 1;
    e->generation_tokens++;
    rq->tok[rq->n_tok++] = id;
    k3_sched_hash(s, rq);
    r->t_first_token = r->t_last = r->t_landed = t;
    rq->events |= K3_EV_FIRST_TOKEN;
    bool stop = k3_engine_is_stop(e, r, id) && r->n_gen >= r->p.min_tokens;
    if (r->gm) { /* the first token is the grammar's too, as a local first step takes it */
        k3_error gerr = {0};
        if (k3_grammar_matcher_is_complete(r->gm) && k3_engine_is_stop_id(r, id) && !k3_engine_is_eos(e, id)) {
            stop = true;
        } else if (k3_grammar_matcher_accept(r->gm, id, &gerr)) {
            snprintf(r->error, sizeof r->error,
                     "request %llu: the grammar refused token %d, the prefill instance's first: %.400s",
                     (unsigned long long)rq->id, id, gerr.msg);
            k3_engine_finish(e, r, K3_FINISH_ERROR, t);
            return;
        } else {
            stop = k3_grammar_matcher_is_ended(r->gm);
        }
    }
    if (stop) {
        r->stop_id = id;
        k3_engine_finish(e, r, K3_FINISH_STOP, t);
    } else if (r->n_gen >= r->p.max_tokens || rq->n_tok >= e->max_model_len) {
        k3_engine_finish(e, r, K3_FINISH_LENGTH, t);
    } else {
        rq->landed_state = e->state_bytes > 0 ? r->pull_state : NULL;
        if (k3_sched_add_landed(s, rq, NULL)) {
            snprintf(r->error, sizeof r->error, "out of memory for the queue");
            k3_engine_finish(e, r, K3_FINISH_ERROR, t);
        }
    }
}

/* Lands or ends the pulls that are over (after the step's forward pass: a
 * landed request's first output is this step's, its first decode the next's). */
static void pd_after_step(void *self, double t) {
    k3_pd_conn *pd = self;
    k3_engine *e = pd->e;
    pthread_mutex_lock(&e->mu);
    req **over = pd->n_pulls ? malloc(sizeof(req *) * (size_t)pd->n_pulls) : NULL;
    int32_t n_over = 0;
    for (int32_t i = 0; over && i < pd->n_pulls;) {
        req *r = pd->pulls[i];
        if (r->pull_phase != PULL_OK && r->pull_phase != PULL_FAILED) {
            i++;
            continue;
        }
        over[n_over++] = r;
        if (r->pull_phase == PULL_OK && !r->pull_cancel) pd->pulls_ok++;
        else pd->pulls_failed++;
        memmove(pd->pulls + i, pd->pulls + i + 1, sizeof(req *) * (size_t)(pd->n_pulls - i - 1));
        pd->n_pulls--;
    }
    pthread_mutex_unlock(&e->mu);
    for (int32_t i = 0; i < n_over; i++) {
        req *r = over[i];
        const int phase = r->pull_phase;
        r->pull_phase = PULL_NONE;
        if (r->finished) continue;
        if (r->pull_cancel) {
            k3_engine_finish(e, r, K3_FINISH_CANCELLED, t);
        } else if (phase == PULL_OK) {
            land(pd, r, t);
        } else {
            snprintf(r->error, sizeof r->error, "%s",
                     r->pull_err[0] ? r->pull_err : "the pull from the prefill instance failed");
            k3_engine_finish(e, r, K3_FINISH_ERROR, t);
        }
    }
    free(over);
}

/* A finished kv_hold request's blocks (a reference each) and end state
 * become a hold. Out of memory: no hold (the decode side is told there is
 * none). Any request's end frees blocks: a remote one waiting may fit now. */
static void pd_request_finished(void *self, req *r, k3_finish_reason why, double t) {
    k3_pd_conn *pd = self;
    k3_engine *e = pd->e;
    pd->rwait_blocked = false;
    if (!(r->p.kv_hold && (why == K3_FINISH_STOP || why == K3_FINISH_LENGTH) && r->rq.n_computed >= r->rq.n_prompt &&
          (r->hold_captured || e->state_bytes == 0)))
        return;
    k3_rq *rq = &r->rq;
    hold *h = calloc(1, sizeof *h);
    if (h) h->blocks = malloc(sizeof(int32_t) * (size_t)(rq->n_blocks + 1));
    pthread_mutex_lock(&e->mu);
    const bool ok = h && h->blocks && k3_engine_push_ptr((void ***)&pd->holds, &pd->n_holds, &pd->cap_holds, h);
    if (ok) {
        h->id = rq->id;
        h->n_blocks = rq->n_blocks;
        h->n_tokens = rq->n_prompt;
        memcpy(h->blocks, rq->blocks, sizeof(int32_t) * (size_t)rq->n_blocks);
        h->state = r->hold_state;
        r->hold_state = NULL;
        h->deadline = t + pd->hold_timeout;
        h->queue_s = r->t_scheduled - r->t_arrival;
        h->prefill_s = (r->t_first_token > 0 ? r->t_first_token : t) - r->t_scheduled;
    }
    pthread_mutex_unlock(&e->mu);
    if (!ok) {
        hold_free(h);
        return;
    }
    for (int32_t b = 0; b < h->n_blocks; b++) k3_kv_ref(&e->bm, h->blocks[b]);
}

/* Under mu: a hold is due. Remote requests waiting for blocks are only
 * worth a step when some were freed. */
static bool pd_has_work(void *self, double t) {
    k3_pd_conn *pd = self;
    for (int32_t i = 0; i < pd->n_holds; i++)
        if (hold_due(pd->holds[i], t)) return true;
    return pd->n_rwait > 0 && !pd->rwait_blocked;
}

static int64_t pd_blocks_held(void *self) {
    k3_pd_conn *pd = self;
    int64_t held = 0;
    for (int32_t i = 0; i < pd->n_holds; i++) held += pd->holds[i]->n_blocks;
    for (int32_t i = 0; i < pd->n_pulls; i++) held += pd->pulls[i]->rq.n_blocks;
    return held;
}

/* Under mu. */
static void pd_stats(void *self, k3_engine_stats *st) {
    k3_pd_conn *pd = self;
    st->n_holds = pd->n_holds;
    st->hold_blocks = 0;
    for (int32_t i = 0; i < pd->n_holds; i++) st->hold_blocks += pd->holds[i]->n_blocks;
    st->holds_expired = pd->holds_expired;
    st->holds_released = pd->holds_released;
    st->n_pulls = pd->n_pulls;
    st->pull_blocks = 0;
    for (int32_t i = 0; i < pd->n_pulls; i++) st->pull_blocks += pd->pulls[i]->rq.n_blocks;
    st->pulls_ok = pd->pulls_ok;
    st->pulls_failed = pd->pulls_failed;
}

static void pd_output(void *self, const req *r, k3_req_output *o) {
    (void)self;
    if (!r->remote) return;
    o->remote_queue_s = r->rp.queue_s;
    o->remote_prefill_s = r->rp.prefill_s;
    o->transfer_s = r->t_landed > 0 ? r->t_landed - r->t_pull0 : 0;
    o->first_step_s = r->t_second > 0 ? r->t_second - r->t_landed : 0;
}

static void pd_close(void *self) {
    k3_pd_conn *pd = self;
    for (int32_t i = 0; i < pd->n_holds; i++) hold_free(pd->holds[i]);
    free(pd->holds);
    free(pd->rwait);
    free(pd->pulls);
    free(pd);
}

k3_status k3_pd_conn_open(k3_engine *e, k3_kv_connector **out, k3_error *err) {
    k3_pd_conn *pd = calloc(1, sizeof *pd);
    if (!pd) return k3_err(err, K3_ERR_NOMEM, "engine: out of memory");
    pd->e = e;
    pd->hold_timeout = e->o.hold_timeout_s > 0 ? e->o.hold_timeout_s : 120.0;
    pd->c = (k3_kv_connector){.name = "pd",
                              .self = pd,
                              .begin = pd_begin,
                              .arrive = pd_arrive,
                              .cancel = pd_cancel,
                              .before_schedule = pd_before_schedule,
                              .before_run = pd_before_run,
                              .after_run = pd_after_run,
                              .after_step = pd_after_step,
                              .request_finished = pd_request_finished,
                              .has_work = pd_has_work,
                              .blocks_held = pd_blocks_held,
                              .stats = pd_stats,
                              .output = pd_output,
                              .close = pd_close};
    e->pd = pd;
    *out = &pd->c;
    return K3_OK;
}

/* ---- the API src/pd calls (k3.h) ------------------------------------------- */

void k3_engine_set_pull_hook(k3_engine *e, k3_pull_hook fn, void *arg) {
    e->pd->pull_hook = fn;
    e->pd->pull_arg = arg;
}

bool k3_engine_has_pull_hook(const k3_engine *e) { return e->pd->pull_hook != NULL; }

int64_t k3_engine_kv_bytes(const k3_engine *e, int32_t layer, int64_t n) { return k3_ctx_kv_bytes(e->ctx, layer, n); }

int64_t k3_engine_state_bytes(const k3_engine *e) { return e->state_bytes; }

/* The pulling request id (under mu), or NULL. */
static req *find_pull(const k3_pd_conn *pd, uint64_t id) {
    for (int32_t i = 0; i < pd->n_pulls; i++)
        if (pd->pulls[i]->rq.id == id) return pd->pulls[i];
    return NULL;
}

/* Pins request id's pull for a write (under mu), or fails saying why. */
static k3_status pull_pin(k3_pd_conn *pd, uint64_t id, req **out, k3_error *err) {
    req *r = find_pull(pd, id);
    if (!r || r->pull_phase != PULL_ACTIVE)
        return k3_err(err, K3_ERR_ARG, "pull: request %llu is not pulling", (unsigned long long)id);
    if (r->pull_cancel) return k3_err(err, K3_ERR_ARG, "pull: request %llu was cancelled", (unsigned long long)id);
    r->pull_pins++;
    *out = r;
    return K3_OK;
}

k3_status k3_engine_pull_write(k3_engine *e, uint64_t id, int32_t layer, int64_t t0, int32_t n, const void *rows,
                               int64_t bytes, k3_error *err) {
    req *r = NULL;
    pthread_mutex_lock(&e->mu);
    k3_status st = pull_pin(e->pd, id, &r, err);
    pthread_mutex_unlock(&e->mu);
    if (st) return st;
    const k3_rq *rq = &r->rq;
    const int64_t want = k3_ctx_kv_bytes(e->ctx, layer, n);
    if (want <= 0 && n > 0) st = k3_err(err, K3_ERR_ARG, "pull: layer %d is not an MLA/DSA layer of this model", layer);
    else if (t0 < rq->n_cached || n < 0 || t0 + n > rq->n_prompt)
        st = k3_err(err, K3_ERR_ARG, "pull: positions [%lld, %lld) are outside [%lld, %lld), what request %llu fetches",
                    (long long)t0, (long long)(t0 + n), (long long)rq->n_cached, (long long)rq->n_prompt,
                    (unsigned long long)id);
    else if (bytes != want)
        st = k3_err(err, K3_ERR_ARG,
                    "pull: %lld bytes for %d tokens of layer %d, where this instance's cache holds %lld",
                    (long long)bytes, n, layer, (long long)want);
    if (!st && n > 0) {
        const int32_t b0 = (int32_t)(t0 / e->block_size);
        if (e->exec_lock) pthread_mutex_lock(&e->exec_mu);
        st = k3_exec_kv_write(e->ctx, rq->blocks + b0, rq->n_blocks - b0, layer, t0 - (int64_t)b0 * e->block_size, n,
                              rows, err);
        if (e->exec_lock) pthread_mutex_unlock(&e->exec_mu);
    }
    pthread_mutex_lock(&e->mu);
    r->pull_pins--;
    pthread_mutex_unlock(&e->mu);
    return st;
}

k3_status k3_engine_pull_state(k3_engine *e, uint64_t id, int64_t offset, const void *part, int64_t bytes,
                               k3_error *err) {
    req *r = NULL;
    pthread_mutex_lock(&e->mu);
    k3_status st = pull_pin(e->pd, id, &r, err);
    if (!st && (offset < 0 || bytes < 0 || offset + bytes > e->state_bytes))
        st = k3_err(err, K3_ERR_ARG, "pull: KDA state bytes [%lld, %lld), where this model's state is %lld bytes",
                    (long long)offset, (long long)(offset + bytes), (long long)e->state_bytes);
    pthread_mutex_unlock(&e->mu);
    if (st) {
        if (r) {
            pthread_mutex_lock(&e->mu);
            r->pull_pins--;
            pthread_mutex_unlock(&e->mu);
        }
        return st;
    }
    if (bytes > 0) memcpy((char *)r->pull_state + offset, part, (size_t)bytes);
    pthread_mutex_lock(&e->mu);
    r->pull_state_got += bytes;
    r->pull_pins--;
    pthread_mutex_unlock(&e->mu);
    return K3_OK;
}

void k3_engine_pull_done(k3_engine *e, uint64_t id, bool ok, const char *why) {
    pthread_mutex_lock(&e->mu);
    req *r = find_pull(e->pd, id);
    if (r && r->pull_phase == PULL_ACTIVE) {
        if (ok && r->pull_state_got != e->state_bytes) {
            ok = false;
            why = "the prefill instance sent no KDA state, or part of it";
        }
        r->pull_phase = ok ? PULL_OK : PULL_FAILED;
        snprintf(r->pull_err, sizeof r->pull_err, "%s", why ? why : "");
        k3_engine_notify_locked(e);
    }
    pthread_mutex_unlock(&e->mu);
}

static hold *find_hold(const k3_pd_conn *pd, uint64_t id) {
    for (int32_t i = 0; i < pd->n_holds; i++)
        if (pd->holds[i]->id == id && !pd->holds[i]->released) return pd->holds[i];
    return NULL;
}

k3_status k3_engine_hold_get(k3_engine *e, uint64_t id, k3_hold_info *out, int32_t *blocks, int32_t cap,
                             k3_error *err) {
    pthread_mutex_lock(&e->mu);
    const hold *h = find_hold(e->pd, id);
    if (h) {
        *out = (k3_hold_info){h->n_tokens, h->n_blocks, e->state_bytes, h->queue_s, h->prefill_s};
        if (blocks) memcpy(blocks, h->blocks, sizeof(int32_t) * (size_t)(h->n_blocks < cap ? h->n_blocks : cap));
    }
    pthread_mutex_unlock(&e->mu);
    return h ? K3_OK
             : k3_err(err, K3_ERR_ARG, "hold %llu is not held here (never made, released, or timed out)",
                      (unsigned long long)id);
}

/* Pins hold id for a read (under mu). */
static hold *hold_pin(k3_engine *e, uint64_t id, k3_error *err) {
    pthread_mutex_lock(&e->mu);
    hold *h = find_hold(e->pd, id);
    if (h) h->pins++;
    pthread_mutex_unlock(&e->mu);
    if (!h)
        k3_err(err, K3_ERR_ARG, "hold %llu is not held here (never made, released, or timed out)",
               (unsigned long long)id);
    return h;
}

static void hold_unpin(k3_engine *e, hold *h) {
    pthread_mutex_lock(&e->mu);
    h->pins--;
    if (h->released) k3_engine_notify_locked(e);
    pthread_mutex_unlock(&e->mu);
}

k3_status k3_engine_hold_read(k3_engine *e, uint64_t id, int32_t layer, int64_t t0, int32_t n, void *rows,
                              int64_t bytes, k3_error *err) {
    hold *h = hold_pin(e, id, err);
    if (!h) return K3_ERR_ARG;
    const int64_t want = k3_ctx_kv_bytes(e->ctx, layer, n);
    k3_status st = K3_OK;
    if (want <= 0 && n > 0) st = k3_err(err, K3_ERR_ARG, "hold: layer %d is not an MLA/DSA layer of this model", layer);
    else if (t0 < 0 || n < 0 || t0 + n > h->n_tokens)
        st = k3_err(err, K3_ERR_ARG, "hold: positions [%lld, %lld) are outside the %lld tokens it holds", (long long)t0,
                    (long long)(t0 + n), (long long)h->n_tokens);
    else if (bytes != want)
        st = k3_err(err, K3_ERR_ARG, "hold: %lld bytes for %d tokens of layer %d, where they are %lld",
                    (long long)bytes, n, layer, (long long)want);
    if (!st && n > 0) {
        const int32_t b0 = (int32_t)(t0 / e->block_size);
        const int64_t rel = t0 - (int64_t)b0 * e->block_size;
        if (e->ctx->dcp > 1) { /* every rank's share, through the executor */
            pthread_mutex_lock(&e->exec_mu);
            st = k3_exec_kv_gather(e->ctx, h->blocks + b0, h->n_blocks - b0, layer, rel, n, rows, err);
            pthread_mutex_unlock(&e->exec_mu);
        } else { /* rank 0 caches every position (one process, or EP alone) */
            st = k3_ctx_kv_read(e->ctx, h->blocks + b0, h->n_blocks - b0, layer, rel, n, rows, err);
        }
    }
    hold_unpin(e, h);
    return st;
}

k3_status k3_engine_hold_read_state(k3_engine *e, uint64_t id, int64_t offset, void *part, int64_t bytes,
                                    k3_error *err) {
    hold *h = hold_pin(e, id, err);
    if (!h) return K3_ERR_ARG;
    k3_status st = K3_OK;
    if (offset < 0 || bytes < 0 || offset + bytes > e->state_bytes)
        st = k3_err(err, K3_ERR_ARG, "hold: KDA state bytes [%lld, %lld), where a state is %lld bytes here",
                    (long long)offset, (long long)(offset + bytes), (long long)e->state_bytes);
    else if (bytes > 0) memcpy(part, (char *)h->state + offset, (size_t)bytes);
    hold_unpin(e, h);
    return st;
}

int k3_engine_kv_arrays(const k3_engine *e, int32_t layer, k3_kv_array out[5]) {
    void *base[5];
    int64_t len[5];
    const int n = k3_ctx_kv_block_ranges(e->ctx, layer, 0, base, len);
    for (int c = 0; c < n; c++) out[c] = (k3_kv_array){base[c], len[c] * e->ctx->n_blocks, len[c] / e->ctx->lbs};
    return n;
}

bool k3_engine_kv_direct(const k3_engine *e, bool write) { return write ? !e->exec_lock : e->ctx->dcp == 1; }

k3_status k3_engine_hold_pin(k3_engine *e, uint64_t id, k3_kv_pin *out, k3_error *err) {
    hold *h = hold_pin(e, id, err);
    if (!h) return K3_ERR_ARG;
    *out = (k3_kv_pin){h->blocks, h->n_blocks, e->block_size, 0, h->n_tokens, h->state, e->state_bytes, h};
    return K3_OK;
}

void k3_engine_hold_unpin(k3_engine *e, k3_kv_pin *pin) {
    if (pin && pin->ref) hold_unpin(e, pin->ref);
    if (pin) pin->ref = NULL;
}

k3_status k3_engine_pull_pin(k3_engine *e, uint64_t id, k3_kv_pin *out, k3_error *err) {
    if (!k3_engine_kv_direct(e, true))
        return k3_err(err, K3_ERR_UNSUPPORTED, "pull: several ranks keep this cache: it is written through them");
    req *r = NULL;
    pthread_mutex_lock(&e->mu);
    const k3_status st = pull_pin(e->pd, id, &r, err);
    pthread_mutex_unlock(&e->mu);
    if (st) return st;
    *out = (k3_kv_pin){r->rq.blocks,   r->rq.n_blocks, e->block_size,  r->rq.n_cached,
                       r->rq.n_prompt, r->pull_state,  e->state_bytes, r};
    return K3_OK;
}

void k3_engine_pull_unpin(k3_engine *e, k3_kv_pin *pin, int64_t state_landed) {
    if (!pin || !pin->ref) return;
    req *r = pin->ref;
    pthread_mutex_lock(&e->mu);
    r->pull_state_got += state_landed;
    r->pull_pins--;
    pthread_mutex_unlock(&e->mu);
    pin->ref = NULL;
}

void k3_engine_hold_release(k3_engine *e, uint64_t id) {
    pthread_mutex_lock(&e->mu);
    hold *h = find_hold(e->pd, id);
    if (h) {
        h->released = true;
        e->pd->holds_released++;
        k3_engine_notify_locked(e);
    }
    pthread_mutex_unlock(&e->mu);
}
