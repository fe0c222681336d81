/*
 * step.c -- k3_engine_step: one step of the engine in its phases.
 *
 *   begin     what finished in the previous step is freed (its outputs lived
 *             until now); the connectors take back what they no longer keep;
 *             the inbox (submits and cancels from any thread, under the
 *             mutex) becomes requests, each given to a connector that takes
 *             it or to the scheduler's queue; cancelled requests end.
 *   schedule  the connectors' requests get their blocks; each running decode
 *             proposes its drafts and the cost model keeps those that pay
 *             (draft.c); the scheduler plans the step (k3_sched_schedule).
 *   run       each planned slot's block table and position (restoring a
 *             snapshot or zeroing the KDA state on admission), a verify
 *             chunk marked on its slot, the KDA snapshots the step crosses
 *             and the connectors' captures asked, then one forward pass
 *             (k3_exec_run) over the plan.
 *   sample    full blocks registered, prompt logprobs, the grammar masks of
 *             the step in one batch, then per request its token (token.c) or
 *             its verify chunk's tokens and rollback (draft.c).
 *   finish    the connectors land what completed; every request with
 *             something to say gets its output; the stats are published.
 *
 * The connectors (connector.h) are called at these boundaries and only there.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "engine/internal.h"
#include "executor/executor.h"
#include "forward/forward.h"

#define EACH_CONN(call) \
    do { \
        for (int32_t ci_ = 0; ci_ < e->n_conn; ci_++) { \
            k3_kv_connector *c_ = e->conn[ci_]; \
            call; \
        } \
    } while (0)

/* ---- begin ------------------------------------------------------------------------------------- */

static k3_status phase_begin(k3_engine *e, k3_error *err) {
    k3_sched *s = &e->sched;
    for (int32_t i = 0; i < e->n_done; i++) {
        req *r = e->done[i];
        for (int32_t j = 0; j < e->n_live; j++)
            if (e->live[j] == r) {
                e->live[j] = e->live[--e->n_live];
                break;
            }
        k3_engine_req_free(r);
    }
    e->n_done = 0;
    for (int32_t i = 0; i < e->n_live; i++) {
        e->live[i]->rq.events = 0;
        e->live[i]->n_new = 0;
    }
    const double t0 = k3_now();
    EACH_CONN(if (c_->begin) c_->begin(c_->self, t0));

    pthread_mutex_lock(&e->mu);
    req **subs = e->in_sub;
    const int32_t n_subs = e->n_sub;
    uint64_t *cancels = e->in_cancel;
    const int32_t n_cancels = e->n_cancel;
    e->in_sub = NULL;
    e->n_sub = e->cap_sub = 0;
    e->in_cancel = NULL;
    e->n_cancel = e->cap_cancel = 0;
    pthread_mutex_unlock(&e->mu);
    k3_status st = K3_OK;
    for (int32_t i = 0; i < n_subs; i++) {
        req *r = subs[i];
        if (st || !k3_engine_push_ptr((void ***)&e->live, &e->n_live, &e->cap_live, r)) {
            st = st ? st : k3_err(err, K3_ERR_NOMEM, "step: out of memory for the request list");
            /* a connector that would have taken it hears of it and lets it go */
            bool taken = false;
            EACH_CONN(if (!taken && c_->arrive && (taken = c_->arrive(c_->self, r)) && c_->cancel)
                          c_->cancel(c_->self, r, t0));
            k3_engine_req_free(r);
            continue;
        }
        r->rq.events |= K3_EV_QUEUED;
        k3_sched_hash(s, &r->rq);
        k3_error serr = {0};
        if (k3_engine_spec_req_open(e, r, &serr)) { /* no drafts for it: it goes on without */
            r->spec = NULL;
            r->spec_method = K3_SPEC_OFF;
        }
        bool taken = false;
        EACH_CONN(if (!taken && c_->arrive) taken = c_->arrive(c_->self, r));
        if (taken) continue;
        if (k3_sched_add(s, &r->rq, NULL)) {
            snprintf(r->error, sizeof r->error, "out of memory for the queue");
            r->finished = true;
            r->finish = K3_FINISH_ERROR;
            r->rq.state = K3_RQ_DONE;
            r->rq.events |= K3_EV_FINISHED;
            e->finished_by[K3_FINISH_ERROR]++;
            k3_engine_spec_req_close(e, r);
        }
    }
    free(subs);
    const double t_in = k3_now();
    for (int32_t i = 0; i < n_cancels; i++)
        for (int32_t j = 0; j < e->n_live; j++) {
            req *r = e->live[j];
            if (r->rq.id != cancels[i] || r->finished) continue;
            bool handled = false;
            EACH_CONN(if (!handled && c_->cancel) handled = c_->cancel(c_->self, r, t_in));
            if (!handled) k3_engine_finish(e, r, K3_FINISH_CANCELLED, t_in);
        }
    free(cancels);
    return st;
}

/* ---- schedule ---------------------------------------------------------------------------------- */

static void phase_schedule(k3_engine *e) {
    const double t = k3_now();
    EACH_CONN(if (c_->before_schedule) c_->before_schedule(c_->self, t));
    k3_engine_spec_propose(e);
    const double t1 = k3_now();
    k3_sched_schedule(&e->sched);
    e->phase_s[K3_PHASE_PROPOSE] += t1 - t;
    e->phase_s[K3_PHASE_SCHEDULE] += k3_now() - t1;
}

/* ---- run --------------------------------------------------------------------------------------- */

/* Sets the planned slots up and asks for the step's captures; the rows of
 * logits the pass returns. */
static int32_t setup_slots(k3_engine *e, double t_in) {
    k3_sched *s = &e->sched;
    int32_t n_rows = 0;
    for (int32_t i = 0; i < s->n_plan; i++) {
        k3_rq *rq = s->plan[i];
        req *r = rq->owner;
        if (rq->is_new) {
            if (rq->restore) {
                const double t0 = k3_now();
                k3_exec_state_restore(e->ctx, rq->slot, rq->restore);
                e->snap_restore_s += k3_now() - t0;
                e->n_snap_restores++;
            } else {
                k3_exec_seq_clear_state(e->ctx, rq->slot);
            }
            k3_exec_seq_set_pos(e->ctx, rq->slot, rq->n_computed);
            if (r->t_scheduled == 0) r->t_scheduled = t_in;
        }
        K3_ASSERT(k3_exec_seq_set_blocks(e->ctx, rq->slot, rq->blocks, rq->n_blocks, NULL) == K3_OK);
        e->batch[i] =
            (k3_batch_seq){rq->slot, rq->n_sched, rq->tok + rq->n_computed, r->emb ? r->emb + rq->n_computed : NULL};
        /* a verify chunk: the last token and its drafts, every row's logits */
        r->verify = rq->n_draft > 0 && rq->n_tok - rq->n_computed == 1;
        if (r->verify && k3_exec_spec_begin(e->ctx, rq->slot, rq->n_sched, e->o.spec_rollback, NULL)) {
            r->verify = false; /* out of memory for the rollback's rows: a plain decode */
            rq->n_draft = 0;
            rq->n_sched = 1;
            e->batch[i].n_tokens = 1;
        }
        const bool ends = rq->n_computed + rq->n_sched == rq->n_tok;
        if (r->verify) {
            e->want[i] = K3_WANT_ALL;
            n_rows += rq->n_sched;
        } else if (rq->plp && rq->n_computed < rq->n_prompt) {
            e->want[i] = K3_WANT_ALL;
            n_rows += rq->n_sched;
        } else {
            e->want[i] = ends ? K3_WANT_LAST : K3_WANT_NONE;
            n_rows += ends;
        }
    }
    K3_ASSERT(n_rows <= e->o.max_num_seqs + e->spec_rows_cap + e->plp_cap);
    return n_rows;
}

/* The KDA snapshots this step's tokens cross, captured inside the pass
 * (after the restores: a new entry may evict an old one); never more than
 * the budget holds, so no two share a buffer. Verify chunks have none: they
 * are past their prompt, and a snapshot is only ever of accepted positions. */
static void ask_snapshots(k3_engine *e) {
    k3_sched *s = &e->sched;
    e->n_taken = 0;
    const double t_snap = k3_now();
    int64_t *pos = e->snap_pos, *step_pos = e->snap_pos + e->req_snaps;
    uint64_t *key = e->snap_key, *step_key = e->snap_key + e->req_snaps;
    for (int32_t i = 0; i < s->n_plan; i++) {
        k3_rq *rq = s->plan[i];
        if (((req *)rq->owner)->verify) continue;
        const int32_t n = k3_sched_snap_points(s, rq, pos, key, e->req_snaps);
        const int32_t room = e->step_snaps - e->n_taken;
        /* over the room keep the last ones (the prompt's end) */
        for (int32_t k = n > room ? n - room : 0; k < n; k++) {
            void *buf = k3_kv_snap_put(&e->sn, key[k], pos[k]);
            if (!buf) continue; /* out of memory: no snapshot there */
            if (k3_ctx_capture_state(e->ctx, rq->slot, pos[k], buf, NULL)) {
                k3_kv_snap_drop(&e->sn, key[k], pos[k]); /* the same: a shorter hit later */
                continue;
            }
            step_pos[e->n_taken] = pos[k];
            e->snap_req[e->n_taken] = rq->owner;
            step_key[e->n_taken++] = key[k];
        }
    }
    e->snap_save_s += k3_now() - t_snap;
}

static k3_status phase_run(k3_engine *e, k3_error *ferr) {
    k3_sched *s = &e->sched;
    const double t_setup = k3_now();
    setup_slots(e, t_setup);
    ask_snapshots(e);
    EACH_CONN(if (c_->before_run) c_->before_run(c_->self));
    k3_status fst = K3_OK;
    const double t0 = k3_now();
    if (s->n_plan) fst = k3_exec_run(e->ctx, e->batch, s->n_plan, e->want, e->logits, ferr);
    e->t_run = k3_now() - t0;
    e->phase_s[K3_PHASE_SETUP] += t0 - t_setup;
    e->phase_s[K3_PHASE_PASS] += e->t_run;
    if (fst)
        for (int32_t k = 0; k < e->n_taken; k++)
            k3_kv_snap_drop(&e->sn, e->snap_key[e->req_snaps + k], e->snap_pos[e->req_snaps + k]);
    else e->n_snap_saves += e->n_taken;
    EACH_CONN(if (c_->after_run) c_->after_run(c_->self, !fst));
    if (!fst)
        for (int32_t k = 0; k < e->n_taken; k++)
            EACH_CONN(if (c_->snapshot_taken)
                          c_->snapshot_taken(c_->self, e->snap_req[k], e->snap_pos[e->req_snaps + k],
                                             e->snap_key[e->req_snaps + k]));
    if (e->o.dist && s->n_plan) {
        /* every rank's, summed (a failed link is sticky: the next pass reports it) */
        k3_comm_stats c;
        k3_exec_stats_take_all(e->o.dist, NULL, &c, NULL);
        pthread_mutex_lock(&e->mu);
        for (int k = 0; k < K3_COMM_COUNT; k++) {
            e->comm.sent[k] += c.sent[k];
            e->comm.recv[k] += c.recv[k];
            e->comm.calls[k] += c.calls[k];
            e->comm.seconds[k] += c.seconds[k];
        }
        pthread_mutex_unlock(&e->mu);
    }
    return fst;
}

/* ---- sample ------------------------------------------------------------------------------------ */

static void phase_sample(k3_engine *e, k3_status fst, const k3_error *ferr, double t) {
    k3_sched *s = &e->sched;
    int64_t row = 0;
    const int32_t n_plan = s->n_plan;
    bool only_decodes = n_plan > 0;
    for (int32_t i = 0; i < n_plan; i++) e->reg_before[i] = s->plan[i]->n_registered;
    for (int32_t i = 0; i < n_plan; i++) {
        k3_rq *rq = s->plan[i];
        req *r = rq->owner;
        e->lg_of[i] = NULL;
        if (fst) {
            snprintf(r->error, sizeof r->error, "%s", ferr->msg);
            k3_engine_finish(e, r, K3_FINISH_ERROR, t);
            continue;
        }
        const int64_t c = rq->n_computed;
        const int32_t n = rq->n_sched;
        if (r->verify) { /* sampled below, row by row (draft.c) */
            e->lg_of[i] = e->logits + row * e->V;
            row += n;
            continue;
        }
        only_decodes &= rq->n_tok - c == 1;
        if (c < rq->n_prompt) e->prompt_tokens += (c + n < rq->n_prompt ? c + n : rq->n_prompt) - c;
        k3_sched_computed(s, rq);
        float *lg = NULL;
        if (e->want[i] == K3_WANT_ALL) {
            k3_engine_prompt_logprobs(e, r, e->logits + row * e->V, c, n);
            lg = e->logits + (row + n - 1) * e->V;
            row += n;
        } else if (e->want[i] == K3_WANT_LAST) {
            lg = e->logits + row * e->V;
            row++;
        }
        if (rq->n_computed == rq->n_tok) { /* the prefill (or the last token) is done */
            if (r->p.max_tokens == 0) k3_engine_finish(e, r, K3_FINISH_LENGTH, t);
            else e->lg_of[i] = lg;
        }
    }
    /* the step, for the cost model, when it held decodes and verify chunks alone
     * (its whole time is known at the next step's start) */
    e->last = (k3_spec_step){0};
    for (int32_t i = 0; i < n_plan; i++) e->last.n_chunks += !fst && ((req *)s->plan[i]->owner)->verify;
    if (!fst && only_decodes) {
        e->last.n_dec = n_plan;
        e->last.n_drafts = s->plan_tokens - n_plan;
        e->last.pass_s = e->t_run;
    }
    /* the grammar masks of every constrained request that samples now, in
     * one call over the pool, so that they do not queue behind each other */
    if (!fst) k3_engine_grammar_masks(e, n_plan, t);
    double t_verify = 0;
    for (int32_t i = 0; i < n_plan; i++) {
        req *r = s->plan[i]->owner;
        if (fst || !e->lg_of[i] || r->finished) continue;
        if (r->verify) {
            const double tv = k3_now();
            k3_engine_spec_verify(e, r, e->lg_of[i], t);
            t_verify += k3_now() - tv;
        } else {
            k3_engine_sample(e, r, e->lg_of[i], t);
        }
    }
    e->phase_s[K3_PHASE_VERIFY] += t_verify;
    e->phase_s[K3_PHASE_SAMPLE] -= t_verify; /* the phase's time is added whole below */
    for (int32_t i = 0; i < n_plan; i++) ((req *)s->plan[i]->owner)->verify = false;
    /* the blocks the prefix cache registered this step, per request (full, immutable) */
    for (int32_t i = 0; i < n_plan; i++) {
        req *r = s->plan[i]->owner;
        if (!r->finished && r->rq.n_registered > e->reg_before[i])
            EACH_CONN(if (c_->registered) c_->registered(c_->self, r, e->reg_before[i]));
    }
}

/* ---- finish ------------------------------------------------------------------------------------ */

static void fill_output(const k3_engine *e, req *r, k3_req_output *o) {
    memset(o, 0, sizeof *o);
    o->id = r->rq.id;
    o->user = r->p.user;
    o->events = r->rq.events;
    o->n_new = r->n_new;
    o->tokens = r->n_new ? r->out_tok : NULL;
    o->logprobs = r->n_new && r->p.logprobs >= 0 ? r->out_lp : NULL;
    o->n_top = r->p.logprobs >= 0 ? r->p.logprobs : r->p.prompt_logprobs >= 0 ? r->p.prompt_logprobs : 0;
    o->top = r->n_new && r->p.logprobs > 0 ? r->out_top : NULL;
    if (r->plp_ready && !r->plp_reported) {
        o->n_prompt_logprobs = r->rq.n_prompt - 1;
        o->prompt_logprobs = r->plp;
        o->prompt_top = r->p.prompt_logprobs > 0 ? r->plp_top : NULL;
        r->plp_reported = true;
    }
    o->finish = r->finished ? r->finish : K3_FINISH_NONE;
    o->stop_id = r->stop_id;
    o->n_prompt = r->rq.n_prompt;
    o->n_cached = r->rq.n_cached;
    o->n_generated = r->n_gen;
    o->t_arrival = r->t_arrival;
    o->t_scheduled = r->t_scheduled;
    o->t_first_token = r->t_first_token;
    o->t_finished = r->t_finished;
    if (r->t_first_token > 0) {
        o->prefill_s = r->t_first_token - r->t_scheduled;
        o->decode_s = (r->finished ? r->t_finished : r->t_last) - r->t_first_token;
    } else if (r->t_scheduled > 0) {
        o->prefill_s = (r->finished ? r->t_finished : k3_now()) - r->t_scheduled;
    }
    o->error = r->finish == K3_FINISH_ERROR ? r->error : NULL;
    for (int32_t i = 0; i < e->n_conn; i++)
        if (e->conn[i]->output) e->conn[i]->output(e->conn[i]->self, r, o);
}

void k3_engine_publish_stats(k3_engine *e) {
    const k3_sched *s = &e->sched;
    pthread_mutex_lock(&e->mu);
    k3_engine_stats *st = &e->st;
    st->n_running = s->n_running;
    st->n_waiting = s->n_waiting;
    st->blocks_used = k3_kv_used(&e->bm);
    st->cache_usage = st->blocks_total ? (double)st->blocks_used / (double)st->blocks_total : 0.0;
    st->prefix_queries = s->prefix_queries;
    st->prefix_hits = s->prefix_hits;
    st->n_snapshots = e->sn.n;
    st->snapshot_bytes = k3_kv_snap_bytes(&e->sn);
    st->n_preemptions = s->n_preemptions;
    st->step_cost_max = s->guarded_cost_max;
    st->prefill_cost_p0 = e->cost_p0;
    st->prompt_tokens = e->prompt_tokens;
    st->generation_tokens = e->generation_tokens;
    memcpy(st->requests_finished, e->finished_by, sizeof st->requests_finished);
    st->n_snapshot_saves = e->n_snap_saves;
    st->n_snapshot_restores = e->n_snap_restores;
    st->snapshot_save_s = e->snap_save_s;
    st->snapshot_restore_s = e->snap_restore_s;
    for (int32_t i = 0; i < e->n_conn; i++)
        if (e->conn[i]->stats) e->conn[i]->stats(e->conn[i]->self, st);
    st->grammar_steps = e->grammar_steps;
    st->grammar_masks = e->grammar_masks;
    st->grammar_s = e->grammar_s;
    st->spec_drafts = e->spec_drafts;
    st->spec_draft_tokens = e->spec_draft_tokens;
    st->spec_accepted_tokens = e->spec_accepted;
    memcpy(st->spec_accepted_per_pos, e->spec_per_pos, sizeof st->spec_accepted_per_pos);
    st->spec_propose_s = e->spec_propose_s;
    st->spec_accept_s = e->spec_accept_s;
    memcpy(st->phase_s, e->phase_s, sizeof st->phase_s);
    st->n_steps = e->n_steps;
    st->n_spec_steps = e->n_spec_steps;
    if (e->bm.track) k3_kv_track_get(&e->bm, &e->kv_res);
    pthread_mutex_unlock(&e->mu);
}

static k3_status phase_finish(k3_engine *e, k3_step_result *res, double t, k3_status st, k3_error *err) {
    pthread_mutex_lock(&e->mu);
    e->n_async = 0; /* before the connectors look: what completes after is the next step's */
    pthread_mutex_unlock(&e->mu);
    const double t_after = k3_now();
    EACH_CONN(if (c_->after_step) c_->after_step(c_->self, t_after));
    /* outputs: every live request with something to say */
    int32_t n_out = 0;
    for (int32_t i = 0; i < e->n_live; i++) n_out += e->live[i]->rq.events || e->live[i]->n_new;
    if (n_out > e->cap_outs) {
        k3_req_output *o = realloc(e->outs, sizeof(k3_req_output) * (size_t)n_out);
        if (!o) return k3_err(err, K3_ERR_NOMEM, "step: out of memory for %d outputs", n_out);
        e->outs = o;
        e->cap_outs = n_out;
    }
    n_out = 0;
    for (int32_t i = 0; i < e->n_live; i++) {
        req *r = e->live[i];
        if (!r->rq.events && !r->n_new) continue;
        fill_output(e, r, &e->outs[n_out++]);
        if (r->finished && !k3_engine_push_ptr((void ***)&e->done, &e->n_done, &e->cap_done, r))
            st = st ? st : k3_err(err, K3_ERR_NOMEM, "step: out of memory");
    }
    res->n_outputs = n_out;
    res->outputs = e->outs;
    res->t = t;
    k3_engine_publish_stats(e);
    return st;
}

/* ---- the step ---------------------------------------------------------------------------------- */

static k3_status step(k3_engine *e, k3_step_result *res, k3_error *err) {
    memset(res, 0, sizeof *res);
    const double t0 = k3_now();
    if (e->t_end > 0) { /* the last step left work: the time since is the caller's part of it */
        e->phase_s[K3_PHASE_OUTSIDE] += t0 - e->t_end;
        if (e->last.n_dec) {
            e->last.step_s = t0 - e->t_start - e->spec_open_s;
            k3_engine_spec_observe(e, &e->last);
        }
    }
    e->t_start = t0;
    e->spec_open_s = 0;
    e->last = (k3_spec_step){0};
    k3_status st = phase_begin(e, err);
    const double t1 = k3_now();
    e->phase_s[K3_PHASE_BEGIN] += t1 - t0;
    phase_schedule(e);
    k3_error ferr = {0};
    const k3_status fst = phase_run(e, &ferr);
    const double t = k3_now();
    res->n_tokens = fst ? 0 : e->sched.plan_tokens;
    phase_sample(e, fst, &ferr, t);
    const double t2 = k3_now();
    e->phase_s[K3_PHASE_SAMPLE] += t2 - t;
    e->n_steps++;
    e->n_spec_steps += e->last.n_chunks > 0;
    st = phase_finish(e, res, t, st, err);
    const double t3 = k3_now();
    e->phase_s[K3_PHASE_FINISH] += t3 - t2;
    e->t_end = e->sched.n_running > 0 || e->sched.n_waiting > 0 ? t3 : 0;
    /* a failed link to the other ranks stays failed: the engine cannot go on
     * (the requests of this step have their error; the server ends the job) */
    if (!st && fst && k3_exec_failed(e->ctx, NULL)) st = k3_err(err, fst, "%s", ferr.msg);
    return st;
}

k3_status k3_engine_step(k3_engine *e, k3_step_result *res, k3_error *err) {
    if (!e->exec_lock) return step(e, res, err);
    pthread_mutex_lock(&e->exec_mu);
    const k3_status st = step(e, res, err);
    pthread_mutex_unlock(&e->exec_mu);
    return st;
}
