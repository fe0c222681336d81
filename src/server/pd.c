/*
 * pd.c -- a generation job's part in prefill and decode apart (job.h's
 * k3_srv_pd_*): vLLM's kv_transfer_params read and answered, for every API
 * surface alike.
 *
 * Prefill side ({"do_remote_decode": true}): one prompt, one choice, no
 * stream; the engine request generates one token (whatever max_tokens says)
 * and is submitted with kv_hold; the whole answer gets kv_transfer_params
 * naming the hold (src/pd: k3_pd_prefill_params). A hold whose answer never
 * went out (the client left) is released at once.
 *
 * Decode side ({"do_remote_prefill": true, remote_host, ...}): the params
 * become a pull (k3_pd_pull_new checks them against this prompt) and the
 * engine request's `remote`; the answer (and a stream's usage chunk) gets
 * the pull's figures as "kv_transfer". A request refused here still has
 * its hold released on the prefill side.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "pd/pd.h"
#include "server/http.h"
#include "server/job.h"

/* The hold named by params, released on its prefill instance (a request that
 * will not pull it): a pull made only to be abandoned. */
static void release_named(k3_srv_job *j) {
    json_t *p = json_deep_copy(j->rq.kv_transfer);
    if (!p) return;
    /* the prompt checks are what failed: make them pass to reach the release */
    json_object_del(p, "prompt_hash");
    const int64_t n = j->rq.n_prompts ? j->rq.n_prompt[0] : 0;
    json_object_set_new(p, "num_tokens", json_integer(n > 0 ? n : 1));
    k3_remote_prefill rp;
    k3_pd_pull *pull = n > 0 ? k3_pd_pull_new(j->s->pd, p, j->rq.prompts[0], n, &rp, NULL) : NULL;
    json_decref(p);
    if (!pull) return;
    k3_pd_pull_abandon(j->s->pd, pull);
    k3_pd_pull_unref(j->s->pd, pull);
}

bool k3_srv_pd_prepare(k3_srv_job *j, k3_srv_bad *e) {
    k3_srv_request *rq = &j->rq;
    json_t *kt = rq->kv_transfer;
    const bool decode = k3_pd_wants_remote_decode(kt), prefill = k3_pd_wants_remote_prefill(kt);
    if (!decode && !prefill) return true; /* no transfer asked for (vLLM's proxies send both false) */
    if (decode && prefill)
        return k3_srv_bad_set(e, 400, "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true");
    if (!j->s->pd) {
        if (prefill) release_named(j);
        return k3_srv_bad_set(e, 400,
                              "kv_transfer_params: this server is not a prefill or decode instance (k3 serve --role "
                              "prefill|decode)");
    }
    if (rq->n_prompts != 1 || rq->n != 1) {
        if (prefill) release_named(j);
        return k3_srv_bad_set(e, 400, "kv_transfer_params: a disaggregated request has one prompt and n = 1");
    }
    if (decode) {
        if (rq->stream) return k3_srv_bad_set(e, 400, "kv_transfer_params: do_remote_decode needs \"stream\": false");
        j->pd_prefill = true;
        return true;
    }
    if (rq->echo && rq->logprobs >= 0) {
        release_named(j);
        return k3_srv_bad_set(e, 400, "kv_transfer_params: prompt logprobs (\"echo\" with \"logprobs\") are computed "
                                      "where the prompt is, not on a decode instance");
    }
    k3_error err = {0};
    j->pull = k3_pd_pull_new(j->s->pd, kt, rq->prompts[0], rq->n_prompt[0], &j->rp, &err);
    if (!j->pull) {
        release_named(j);
        return k3_srv_bad_set(e, err.status == K3_ERR_NOMEM ? 500 : 400, "%s", err.msg);
    }
    return true;
}

void k3_srv_pd_request(k3_srv_job *j, k3_request_params *p) {
    if (j->pd_prefill) {
        p->kv_hold = true;
        p->max_tokens = 1;
    } else if (j->pull) {
        p->remote = &j->rp;
    }
}

bool k3_srv_pd_finish(k3_srv_job *j, char *why, size_t why_len) {
    if (j->extra) return true;
    if (j->pd_prefill) {
        const k3_srv_choice *c = &j->ch[0];
        if (k3_srv_choice_error(c, NULL) || c->q.n_tok < 1) return true; /* the surface answers the error */
        const k3_srv_seq *q = &c->q;
        k3_error err = {0};
        const int nt = q->n_top < (int)j->rq.logprobs ? q->n_top : (int)j->rq.logprobs;
        json_t *kt = k3_pd_prefill_params(j->s->pd, q->eid, j->rq.prompts[0], j->rq.n_prompt[0], q->toks[0],
                                          j->rq.logprobs >= 0 ? q->lps[0] : NAN, q->tops, nt > 0 ? nt : 0, &err);
        if (!kt) {
            snprintf(why, why_len, "the prompt was computed but its cache is not held for the decode instance: %s",
                     err.msg);
            return false;
        }
        j->extra = json_pack("{s:o}", "kv_transfer_params", kt);
        j->pd_answered = j->extra != NULL;
        return true;
    }
    if (j->pull) {
        k3_pd_pull_stats st;
        k3_pd_pull_stats_get(j->s->pd, j->pull, &st);
        if (st.ended && st.ok) {
            json_t *kt = k3_pd_pull_json(&st);
            const k3_srv_seq *q = j->n > 0 ? &j->ch[0].q : NULL;
            if (kt && q) /* the time to first token, split */
                json_object_set_new(kt, "ttft",
                                    json_pack("{s:f,s:f,s:f,s:f,s:f}", "prefill_queue_s", st.queue_s, "prefill_s",
                                              st.prefill_s, "decode_queue_s", q->pd_queue_s, "transfer_s",
                                              q->pd_transfer_s, "first_decode_step_s", q->pd_first_step_s));
            j->extra = json_pack("{s:o}", "kv_transfer", kt);
        }
    }
    return true;
}

void k3_srv_pd_free(k3_srv_job *j) {
    if (j->pd_prefill && !j->pd_answered && j->n > 0 && j->ch[0].q.submitted && j->s->engine)
        k3_engine_hold_release(j->s->engine, j->ch[0].q.eid); /* nobody was told of it */
    if (j->pull && !(j->n > 0 && j->ch && j->ch[0].q.submitted)) k3_pd_pull_abandon(j->s->pd, j->pull);
    if (j->pull) k3_pd_pull_unref(j->s->pd, j->pull);
    j->pull = NULL;
    json_decref(j->extra);
    j->extra = NULL;
}

enum MHD_Result k3_srv_job_json(k3_srv_job *j, unsigned status, json_t *resp) {
    if (resp && j->extra && status == 200) json_object_update(resp, j->extra);
    return k3_srv_json(j->s, j->conn, status, resp);
}
