/*
 * draft.c -- speculative decoding's side of the step (docs/spec.md): the
 * proposers' state per request, the drafts of a step and how many of them
 * are worth verifying (the cost model of src/spec/policy.c), and the verify
 * of a chunk after the forward pass with its rollback.
 *
 * A decoding request with drafts d1..dk is scheduled as one chunk of k + 1
 * tokens (its last token, then the drafts: rq.tok[n_tok ..] holds them) and
 * run as a prefill chunk, every row's logits kept; the context keeps what
 * its KDA layers need to roll back (k3_ctx_spec_begin). Its rows are then
 * sampled in order exactly as decode steps would be (the grammar mask of
 * the tokens so far, the penalties of the output so far, its own random
 * numbers): the draw at row j is the token; the next row counts only while
 * the draw equals the draft it was fed. That is the rejection rule for a
 * point-mass draft (spec.h), so the text, its distribution and the tokens
 * for a seed are those without drafts. m rows kept: the KDA state goes to
 * the one after them (k3_ctx_spec_accept), the block table drops what only
 * rejected positions used (k3_sched_verified).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "engine/internal.h"
#include "executor/executor.h"

#define SPEC_DEFAULT_K 8
#define SPEC_PRIOR_SLOPE 0.05 /* a verify row's cost over a decode step's before any is measured */

k3_status k3_engine_spec_open(k3_engine *e, k3_error *err) {
    k3_engine_options *o = &e->o;
    if (o->speculative < K3_SPEC_DEFAULT || o->speculative > K3_SPEC_DRAFT_MODEL)
        return k3_err(err, K3_ERR_ARG, "engine: unknown speculative method %d", (int)o->speculative);
    if (o->num_speculative_tokens < 0 || o->num_speculative_tokens > K3_SPEC_MAX_TOKENS)
        return k3_err(err, K3_ERR_RANGE, "engine: num_speculative_tokens %d is not in 1..%d", o->num_speculative_tokens,
                      K3_SPEC_MAX_TOKENS);
    if (!o->num_speculative_tokens) o->num_speculative_tokens = SPEC_DEFAULT_K;
    if (o->speculative == K3_SPEC_DEFAULT) o->speculative = K3_SPEC_OFF;
    if (o->spec_rollback != K3_SPEC_REAPPLY && o->spec_rollback != K3_SPEC_STATES)
        return k3_err(err, K3_ERR_ARG, "engine: spec_rollback %d is not 0 (re-apply) or 1 (states)", o->spec_rollback);
    if (o->draft_model) {
        k3_model_info a, b;
        k3_model_get_info(e->m, &a);
        k3_model_get_info(o->draft_model, &b);
        if (a.vocab_size != b.vocab_size)
            return k3_err(err, K3_ERR_ARG,
                          "engine: the draft model's vocabulary has %lld ids, the model's %lld: drafts must be the "
                          "same tokens",
                          (long long)b.vocab_size, (long long)a.vocab_size);
    }
    k3_spec_config c = {.method = o->speculative,
                        .num_speculative_tokens = o->num_speculative_tokens,
                        .suffix_max_tree_depth = o->suffix_max_tree_depth,
                        .suffix_max_cached_requests = o->suffix_max_cached_requests,
                        .suffix_max_spec_factor = o->suffix_max_spec_factor,
                        .suffix_min_token_prob = o->suffix_min_token_prob,
                        .prompt_lookup_min = o->prompt_lookup_min,
                        .prompt_lookup_max = o->prompt_lookup_max,
                        .draft_model = o->draft_model,
                        .kv_cache = o->kv_cache,
                        .pool = o->pool};
    K3_TRY(k3_proposer_open(&e->prop, &c, o->max_num_seqs, e->max_model_len, err));
    k3_spec_policy_init(&e->policy, SPEC_PRIOR_SLOPE);
    e->cand = calloc((size_t)o->max_num_seqs, sizeof *e->cand);
    e->take = calloc((size_t)o->max_num_seqs, sizeof *e->take);
    if (!e->cand || !e->take) return k3_err(err, K3_ERR_NOMEM, "engine: out of memory");
    return K3_OK;
}

void k3_engine_spec_close(k3_engine *e) {
    k3_proposer_close(e->prop);
    free(e->cand);
    free(e->take);
}

/* The method request p would draft with, after the engine's default. */
static k3_spec_method method_of(const k3_engine *e, const k3_request_params *p) {
    return p->speculative == K3_SPEC_DEFAULT ? e->o.speculative : p->speculative;
}

k3_status k3_engine_spec_req_open(k3_engine *e, req *r, k3_error *err) {
    const k3_spec_method m = method_of(e, &r->p);
    r->spec = NULL;
    r->spec_method = K3_SPEC_OFF;
    /* a request kept for a decode instance samples one token here */
    if (m == K3_SPEC_OFF || r->p.kv_hold || !e->prop) return K3_OK;
    if (m == K3_SPEC_DRAFT_MODEL && !e->o.draft_model)
        return k3_err(err, K3_ERR_UNSUPPORTED, "speculative method draft_model: this engine has no draft model");
    r->spec_k = r->p.num_speculative_tokens > 0 ? r->p.num_speculative_tokens : e->o.num_speculative_tokens;
    if (r->spec_k > K3_SPEC_MAX_TOKENS) r->spec_k = K3_SPEC_MAX_TOKENS;
    k3_spec_calib_init(&r->calib);
    /* the proposer's state (a suffix tree of the prompt: 0.15-0.26 us a token) is
     * made at its first step where drafting may pay (seq_open) */
    r->spec_method = m;
    return K3_OK;
}

/* Opens r's proposer state over its tokens so far; false: no drafts for it.
 * Its time (a suffix tree of the prompt) is paid once a request, so it is
 * kept out of the step's time the cost model sees (spec_open_s). */
static bool seq_open(k3_engine *e, req *r) {
    const int64_t n_prompt = r->rq.n_tok - r->n_gen;
    const double t0 = k3_now();
    k3_error err = {0};
    const k3_status st =
        k3_spec_seq_open(e->prop, &r->spec, r->spec_method, r->p.spec_scope, r->rq.tok, n_prompt, &err);
    e->spec_open_s += k3_now() - t0;
    if (st) {
        r->spec = NULL;
        r->spec_method = K3_SPEC_OFF;
        return false;
    }
    r->spec_appended = n_prompt;
    return true;
}

void k3_engine_spec_req_close(k3_engine *e, req *r) {
    const bool completed = r->finish == K3_FINISH_STOP || r->finish == K3_FINISH_LENGTH;
    if (r->spec) k3_spec_seq_close(e->prop, r->spec, completed);
    else if (completed && r->spec_method != K3_SPEC_OFF) /* never drafted: its output is a past output all the same */
        k3_spec_cache_output(e->prop, r->spec_method, r->p.spec_scope, r->rq.tok, r->rq.n_tok - r->n_gen, r->n_gen);
    r->spec = NULL;
    r->spec_method = K3_SPEC_OFF;
}

/* Cuts r's n drafts (at rq.tok[n_tok ..]) at the first its grammar refuses
 * after the tokens so far; the matcher goes back. */
static int32_t grammar_cut(req *r, int32_t n) {
    if (!r->gm || n == 0) return n;
    if (k3_grammar_matcher_n_tokens(r->gm) != r->n_gen) return 0; /* not at the output's end: rebuilt at sampling */
    const int32_t *d = r->rq.tok + r->rq.n_tok;
    int32_t ok = 0;
    while (ok < n && !k3_grammar_matcher_is_ended(r->gm) && k3_grammar_matcher_accept(r->gm, d[ok], NULL) == K3_OK)
        ok++;
    if (ok) k3_grammar_matcher_rollback(r->gm, ok, NULL);
    return ok;
}

void k3_engine_spec_propose(k3_engine *e) {
    k3_sched *s = &e->sched;
    if (!e->prop) return;
    const double t0 = k3_now();
    int32_t n_dec = 0, n_c = 0;
    req *who[4096];
    for (int32_t i = 0; i < s->n_running; i++) {
        k3_rq *rq = s->running[i];
        rq->n_draft = 0;
        ((req *)rq->owner)->n_draft = 0;
        n_dec += rq->n_tok - rq->n_computed == 1;
    }
    /* where not even sure drafts would pay at this batch size, nobody
     * proposes; nor in a step kept plain to measure the drafts' cost against
     * (what not speculating costs: no proposing either) */
    if (!e->o.spec_no_cost_model && !k3_spec_policy_may_pay(&e->policy, n_dec, e->o.num_speculative_tokens)) {
        if (n_dec) k3_spec_policy_declined(&e->policy, n_dec);
        e->spec_propose_s += k3_now() - t0;
        return;
    }
    if (!e->o.spec_no_cost_model && k3_spec_policy_plain_due(&e->policy, n_dec)) {
        e->spec_propose_s += k3_now() - t0;
        return;
    }
    for (int32_t i = 0; i < s->n_running; i++) {
        k3_rq *rq = s->running[i];
        req *r = rq->owner;
        if (rq->n_tok - rq->n_computed != 1) continue; /* a prompt chunk */
        if (r->spec_method == K3_SPEC_OFF || (!r->spec && !seq_open(e, r))) continue;
        /* the tokens the proposer has not seen (the last step's) */
        if (rq->n_tok > r->spec_appended) {
            k3_spec_seq_append(e->prop, r->spec, rq->tok + r->spec_appended, (int32_t)(rq->n_tok - r->spec_appended));
            r->spec_appended = rq->n_tok;
        }
        /* drafts past max_tokens or the model length are never kept; a verify
         * chunk fits a round and the context's chunk size */
        int64_t max = r->spec_k;
        if (max > (int64_t)r->p.max_tokens - r->n_gen - 1) max = (int64_t)r->p.max_tokens - r->n_gen - 1;
        if (max > e->max_model_len - rq->n_tok) max = e->max_model_len - rq->n_tok;
        if (max > K3_CTX_SPEC_MAX - 1) max = K3_CTX_SPEC_MAX - 1;
        if (max > e->ctx->max_batch - 1) max = e->ctx->max_batch - 1;
        if (max <= 0) continue;
        int32_t *d = rq->tok + rq->n_tok; /* cap_tok leaves room: n_tok + max <= n_prompt + max_tokens */
        int32_t n = k3_spec_seq_propose(e->prop, r->spec, rq->tok, rq->n_tok, (int32_t)max, d, r->draft_conf);
        n = grammar_cut(r, n);
        if (n <= 0) {
            k3_spec_calib_update(&r->calib, NULL, 0, 0);
            continue;
        }
        r->n_draft = n;
        k3_spec_calib_gains(&r->calib, r->draft_conf, n, &e->cand[n_c]);
        if (n_c < (int32_t)(sizeof who / sizeof who[0])) who[n_c++] = r;
    }
    if (n_c) {
        if (e->o.spec_no_cost_model)
            for (int32_t i = 0; i < n_c; i++) e->take[i] = who[i]->n_draft;
        else if (!k3_spec_policy_choose(&e->policy, n_dec, e->cand, n_c, e->take))
            k3_spec_policy_declined(&e->policy, n_dec);
        int32_t rows = 0;
        for (int32_t i = 0; i < n_c; i++) {
            req *r = who[i];
            if (rows + e->take[i] > e->spec_rows_cap) e->take[i] = e->spec_rows_cap - rows; /* the logits' room */
            rows += e->take[i];
            r->n_draft = r->rq.n_draft = e->take[i];
            if (!e->take[i]) k3_spec_calib_update(&r->calib, NULL, 0, 0);
        }
    }
    e->spec_propose_s += k3_now() - t0;
}

void k3_engine_spec_observe(k3_engine *e, const k3_spec_step *st) {
    if (e->prop) k3_spec_policy_observe_step(&e->policy, st);
}

void k3_engine_spec_verify(k3_engine *e, req *r, float *lg, double t) {
    k3_rq *rq = &r->rq;
    const int32_t k = rq->n_sched - 1; /* the drafts the scheduler kept */
    const int64_t n0 = rq->n_tok;
    int32_t draft[K3_SPEC_MAX_TOKENS];
    memcpy(draft, rq->tok + n0, sizeof(int32_t) * (size_t)k);
    int32_t m = 0, acc = 0;
    for (int32_t j = 0; j <= k; j++) {
        if (j > 0 && r->gm) { /* row 0's mask came with the step's; the others after the tokens before */
            k3_error gerr = {0};
            const double tg = k3_now();
            if (k3_grammar_matcher_fill_mask(r->gm, r->mask, &gerr)) {
                snprintf(r->error, sizeof r->error, "request %llu: no grammar mask: %.400s", (unsigned long long)rq->id,
                         gerr.msg);
                k3_engine_finish(e, r, K3_FINISH_ERROR, t);
                break;
            }
            e->grammar_s += k3_now() - tg;
            e->grammar_masks++;
        }
        k3_engine_sample(e, r, lg + (int64_t)j * e->V, t);
        m++;
        const bool same = j < k && rq->n_tok == n0 + j + 1 && rq->tok[n0 + j] == draft[j];
        acc += same;
        if (r->finished || !same) break;
    }
    e->spec_drafts++;
    e->spec_draft_tokens += k;
    e->spec_accepted += acc;
    for (int32_t i = 0; i < acc && i < K3_SPEC_MAX_TOKENS; i++) e->spec_per_pos[i]++;
    k3_spec_calib_update(&r->calib, r->draft_conf, k, acc);
    rq->n_draft = 0;
    r->n_draft = 0;
    if (r->finished) return; /* its blocks and slot are gone; the slot's mark goes with its next user */
    const double ta = k3_now();
    k3_error err = {0};
    if (k3_exec_spec_accept(e->ctx, rq->slot, m, &err)) {
        snprintf(r->error, sizeof r->error, "request %llu: %.480s", (unsigned long long)rq->id, err.msg);
        k3_engine_finish(e, r, K3_FINISH_ERROR, t);
        return;
    }
    k3_sched_verified(&e->sched, rq, m);
    e->spec_accept_s += k3_now() - ta;
}
