/*
 * token.c -- one request's tokens: the sampling of a logits row (grammar
 * mask, min_tokens, the request's own sampler, logprobs of the raw or masked
 * row), the stop rules (EOS, stop ids, the grammar's end, max_tokens, the
 * model length), the grammar masks of a step in one batch, prompt logprobs,
 * and the end of a request. A verify chunk samples each of its rows through
 * k3_engine_sample too (draft.c), so every token is decided by the same
 * code whether it came one per step or several.
 * Logprobs are the log-softmax of the raw logits (before penalty and
 * temperature), as vLLM reports them.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "engine/internal.h"

void k3_engine_finish(k3_engine *e, req *r, k3_finish_reason why, double t) {
    if (r->finished) return;
    for (int32_t i = 0; i < e->n_conn; i++)
        if (e->conn[i]->request_finished) e->conn[i]->request_finished(e->conn[i]->self, r, why, t);
    k3_sched_release(&e->sched, &r->rq);
    r->finished = true;
    r->finish = why;
    r->t_finished = t;
    r->rq.events |= K3_EV_FINISHED;
    e->finished_by[why]++;
    k3_engine_spec_req_close(e, r);
}

/* log-softmax normaliser of a row */
static double log_norm(const float *x, int64_t n) {
    float mx = x[0];
    for (int64_t i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += exp((double)x[i] - mx);
    return mx + log(s);
}

/* the k most likely ids of a row, best first (ties to the lower id) */
static void top_k(const float *x, int64_t n, int k, double lse, k3_logprob *out) {
    int m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (m == k && !(x[i] > out[k - 1].logprob)) continue;
        int at = m < k ? m++ : k - 1;
        while (at > 0 && x[i] > out[at - 1].logprob) {
            out[at] = out[at - 1];
            at--;
        }
        out[at] = (k3_logprob){(int32_t)i, x[i]};
    }
    for (int i = 0; i < m; i++) out[i].logprob = (float)((double)out[i].logprob - lse);
}

bool k3_engine_is_stop(const k3_engine *e, const req *r, int32_t id) {
    if (!r->p.ignore_eos)
        for (int32_t i = 0; i < e->n_eos; i++)
            if (e->eos[i] == id) return true;
    for (int32_t i = 0; i < r->p.n_stop_ids; i++)
        if (r->stop_ids[i] == id) return true;
    return false;
}

bool k3_engine_is_eos(const k3_engine *e, int32_t id) {
    for (int32_t i = 0; i < e->n_eos; i++)
        if (e->eos[i] == id) return true;
    return false;
}

bool k3_engine_is_stop_id(const req *r, int32_t id) {
    for (int32_t i = 0; i < r->p.n_stop_ids; i++)
        if (r->stop_ids[i] == id) return true;
    return false;
}

/* Whether r's grammar mask allows an id that is neither an EOS nor a stop id
 * (min_tokens holds the stops back only then: a complete text that can only
 * end would have nothing left to sample). */
static bool grammar_allows_text(const k3_engine *e, const req *r) {
    const k3_grammar_vocab *gv = r->gv;
    const size_t nw = k3_grammar_mask_words(gv);
    for (size_t w = 0; w < nw; w++)
        for (uint64_t b = r->mask[w]; b; b &= b - 1) {
            const int32_t id = (int32_t)(w * 64 + (size_t)__builtin_ctzll(b));
            if (id < e->V && !k3_engine_is_eos(e, id) && !k3_engine_is_stop_id(r, id)) return true;
        }
    return false;
}

void k3_engine_sample(k3_engine *e, req *r, float *lg, double t) {
    const int64_t V = e->V;
    bool complete = false;
    if (r->gm) {
        /* the mask on the raw row, so the logprobs are those of what may be
         * sampled; the stop ids, which the mask forbids unless the grammar
         * writes them, are allowed back where the text is complete */
        const double t0 = k3_now();
        complete = k3_grammar_matcher_is_complete(r->gm);
        for (int32_t i = 0; i < r->p.n_stop_ids; i++) r->stop_raw[i] = lg[r->stop_ids[i]];
        k3_grammar_mask_apply(r->gv, r->mask, lg, (int32_t)V);
        if (complete)
            for (int32_t i = 0; i < r->p.n_stop_ids; i++) lg[r->stop_ids[i]] = r->stop_raw[i];
        e->grammar_s += k3_now() - t0;
    }
    /* the sampler works in place: on a copy only when the raw row is still
     * needed for the logprobs (lg is this step's scratch, read by no one
     * after; a copy is V floats per request per step: 640 KB at K3's vocab) */
    float *row = lg;
    if (r->p.logprobs >= 0) {
        memcpy(e->row, lg, sizeof(float) * (size_t)V);
        row = e->row;
    }
    /* min_tokens: the stop ids cannot be generated before (as vLLM) */
    if (r->n_gen < r->p.min_tokens && (!r->gm || grammar_allows_text(e, r))) {
        if (!r->p.ignore_eos)
            for (int32_t i = 0; i < e->n_eos; i++) row[e->eos[i]] = -INFINITY;
        for (int32_t i = 0; i < r->p.n_stop_ids; i++) row[r->stop_ids[i]] = -INFINITY;
    }
    const int32_t id = k3_sampler_sample(r->smp, row);
    if (id < 0 || id >= V) { /* a sampler that refuses non-finite logits, or has every id masked */
        snprintf(r->error, sizeof r->error,
                 "request %llu has no token to sample: its logits are not finite, or every token is masked",
                 (unsigned long long)r->rq.id);
        k3_engine_finish(e, r, K3_FINISH_ERROR, t);
        return;
    }
    k3_sampler_accept(r->smp, id);
    const int32_t at = r->n_new;
    if (r->p.logprobs >= 0) {
        const double lse = log_norm(lg, V);
        r->out_lp[at] = (float)((double)lg[id] - lse);
        if (r->p.logprobs > 0) top_k(lg, V, r->p.logprobs, lse, r->out_top + (int64_t)at * r->p.logprobs);
    }
    r->out_tok[at] = id;
    r->n_new++;
    r->n_gen++;
    e->generation_tokens++;
    k3_rq *rq = &r->rq;
    rq->tok[rq->n_tok++] = id;
    k3_sched_hash(&e->sched, rq);
    if (r->n_gen == 1) {
        r->t_first_token = t;
        rq->events |= K3_EV_FIRST_TOKEN;
    }
    if (r->n_gen == 2 && r->remote) r->t_second = t;
    r->t_last = t;
    if (r->gm) {
        /* a stop id ends a complete text (it is not the grammar's); every
         * other token is the grammar's, and its end (an EOS accepted where
         * the text is complete) ends the request */
        k3_error gerr = {0};
        if (complete && k3_engine_is_stop_id(r, id) && !k3_engine_is_eos(e, id)) {
            r->stop_id = id;
            k3_engine_finish(e, r, K3_FINISH_STOP, t);
            return;
        }
        if (k3_grammar_matcher_accept(r->gm, id, &gerr)) {
            snprintf(r->error, sizeof r->error, "request %llu: the grammar refused token %d: %.400s",
                     (unsigned long long)rq->id, id, gerr.msg);
            k3_engine_finish(e, r, K3_FINISH_ERROR, t);
            return;
        }
        if (k3_grammar_matcher_is_ended(r->gm)) {
            r->stop_id = id;
            k3_engine_finish(e, r, K3_FINISH_STOP, t);
            return;
        }
    }
    if (!r->gm && k3_engine_is_stop(e, r, id) && r->n_gen >= r->p.min_tokens) {
        r->stop_id = id;
        k3_engine_finish(e, r, K3_FINISH_STOP, t);
    } else if (r->n_gen >= r->p.max_tokens || rq->n_tok >= e->max_model_len) {
        k3_engine_finish(e, r, K3_FINISH_LENGTH, t);
    }
}

/* A matcher that is not at the output's end (the tokens it has accepted are
 * not those generated, which a recompute never changes) is rebuilt from the
 * tokens; false (r ended) when they do not match. */
static bool grammar_sync(k3_engine *e, req *r, double t) {
    if (k3_grammar_matcher_n_tokens(r->gm) == r->n_gen) return true;
    k3_error gerr = {0};
    size_t n_ok = 0;
    k3_grammar_matcher_reset(r->gm);
    if (k3_grammar_matcher_accept_tokens(r->gm, r->rq.tok + r->rq.n_prompt, (size_t)r->n_gen, &n_ok, &gerr)) {
        snprintf(r->error, sizeof r->error, "request %llu: its tokens do not match its grammar: %.400s",
                 (unsigned long long)r->rq.id, gerr.msg);
        k3_engine_finish(e, r, K3_FINISH_ERROR, t);
        return false;
    }
    return true;
}

void k3_engine_grammar_masks(k3_engine *e, int32_t n_plan, double t) {
    int32_t n = 0;
    const double t0 = k3_now();
    for (int32_t i = 0; i < n_plan; i++) {
        req *r = e->sched.plan[i]->owner;
        if (!e->lg_of[i] || !r->gm || r->finished) continue;
        if (!grammar_sync(e, r, t)) continue;
        e->g_m[n] = r->gm;
        e->g_mask[n++] = r->mask;
    }
    if (!n) return;
    k3_error gerr = {0};
    if (k3_grammar_fill_masks(e->g_m, e->g_mask, n, e->o.pool, &gerr)) {
        /* one at a time, to fail only the requests whose masks fail */
        for (int32_t i = 0; i < n_plan; i++) {
            req *r = e->sched.plan[i]->owner;
            if (!e->lg_of[i] || !r->gm || r->finished) continue;
            k3_error one = {0};
            if (k3_grammar_matcher_fill_mask(r->gm, r->mask, &one)) {
                snprintf(r->error, sizeof r->error, "request %llu: no grammar mask: %.400s",
                         (unsigned long long)r->rq.id, one.msg);
                k3_engine_finish(e, r, K3_FINISH_ERROR, t);
            }
        }
    }
    e->grammar_steps++;
    e->grammar_masks += n;
    e->grammar_s += k3_now() - t0;
}

void k3_engine_prompt_logprobs(k3_engine *e, req *r, const float *lg, int64_t c, int32_t n) {
    const int64_t V = e->V;
    const int32_t k = r->p.prompt_logprobs;
    for (int32_t i = 0; i < n; i++) {
        const int64_t p = c + i; /* row p predicts token p + 1 */
        if (p + 1 >= r->rq.n_prompt) break;
        const float *row = lg + (int64_t)i * V;
        const double lse = log_norm(row, V);
        r->plp[p] = (float)((double)row[r->rq.tok[p + 1]] - lse);
        if (k > 0) top_k(row, V, k, lse, r->plp_top + p * k);
    }
    if (c + n >= r->rq.n_prompt) r->plp_ready = true;
}
