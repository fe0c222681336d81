/*
 * api_completions.c -- POST /v1/completions, OpenAI's (legacy) completions:
 * "prompt" as a string, a list of strings, a list of ids or a list of id
 * lists (one choice per prompt and n); "echo"; logprobs in the legacy
 * shape {tokens, token_logprobs, top_logprobs, text_offset}.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api.h"
#include "server/constraint.h"
#include "server/http.h"
#include "server/job.h"

#define OBJECT "text_completion"

/* ---- the prompt --------------------------------------------------------- */

static bool ids_from_array(struct k3_server *s, json_t *a, const char *what, int32_t **ids, int64_t *n, k3_srv_bad *e) {
    const size_t len = json_array_size(a);
    if (len == 0) return k3_srv_bad_set(e, 400, "%s is empty", what);
    *ids = malloc(len * sizeof **ids);
    if (!*ids) return k3_srv_bad_set(e, 500, "out of memory");
    const int32_t nv = k3_tokenizer_n_vocab(s->tok);
    for (size_t i = 0; i < len; i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= nv) {
            free(*ids);
            *ids = NULL;
            return k3_srv_bad_set(e, 400, "%s[%zu] is not a token id in 0..%d", what, i, nv - 1);
        }
        (*ids)[i] = (int32_t)json_integer_value(x);
    }
    *n = (int64_t)len;
    return true;
}

static bool ids_from_text(struct k3_server *s, json_t *str, const char *what, int32_t **ids, int64_t *n,
                          k3_srv_bad *e) {
    size_t m = 0;
    k3_error err = {0};
    if (k3_tokenizer_encode(s->tok, json_string_value(str), json_string_length(str), ids, &m, &err))
        return k3_srv_bad_set(e, 400, "%s: %s", what, err.msg);
    if (m == 0) {
        free(*ids);
        *ids = NULL;
        return k3_srv_bad_set(e, 400, "%s encodes to no tokens", what);
    }
    *n = (int64_t)m;
    return true;
}

/* "prompt": a string, a list of strings, a list of ids, a list of id lists. */
static bool parse_prompts(struct k3_server *s, json_t *root, k3_srv_request *rq, k3_srv_bad *e) {
    json_t *p = json_object_get(root, "prompt");
    if (!p) return k3_srv_bad_set(e, 400, "\"prompt\" is missing");
    size_t n = 1;
    bool list_of_lists = false;
    if (json_is_array(p)) {
        json_t *f = json_array_get(p, 0);
        if (!f) return k3_srv_bad_set(e, 400, "\"prompt\" is an empty list");
        if (json_is_string(f) || json_is_array(f)) {
            n = json_array_size(p);
            list_of_lists = true;
        }
    } else if (!json_is_string(p)) {
        return k3_srv_bad_set(e, 400, "\"prompt\" must be a string, a list of strings or a list of token ids");
    }
    if (n > K3_SRV_MAX_N) return k3_srv_bad_set(e, 400, "\"prompt\" has %zu prompts, more than %d", n, K3_SRV_MAX_N);
    rq->prompts = calloc(n, sizeof *rq->prompts);
    rq->n_prompt = calloc(n, sizeof *rq->n_prompt);
    if (!rq->prompts || !rq->n_prompt) return k3_srv_bad_set(e, 500, "out of memory");
    rq->n_prompts = (int)n;
    for (size_t i = 0; i < n; i++) {
        json_t *x = list_of_lists ? json_array_get(p, i) : p;
        char what[32];
        snprintf(what, sizeof what, list_of_lists ? "prompt[%zu]" : "prompt", i);
        bool ok;
        if (json_is_string(x)) ok = ids_from_text(s, x, what, &rq->prompts[i], &rq->n_prompt[i], e);
        else if (json_is_array(x)) ok = ids_from_array(s, x, what, &rq->prompts[i], &rq->n_prompt[i], e);
        else ok = k3_srv_bad_set(e, 400, "%s must be a string or a list of token ids", what);
        if (!ok) return false;
    }
    return k3_srv_constraint_openai(s, K3_API_COMPLETIONS, root, false, &rq->grammar, k3_srv_job_of(rq)->conn, e);
}

/* ---- logprobs in the legacy shape ----------------------------------------- */

static json_t *lp_new(void) {
    return json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

/* One top_logprobs entry: {token: logprob} for the token itself (when its
 * logprob is known) and its top alternatives (tops[0..n_top), or none). */
static json_t *lp_top(k3_srv_job *j, int32_t id, float lp, const k3_logprob *tops, int n_top) {
    json_t *d = json_object();
    json_t *me = k3_srv_token_json(j, id);
    if (me && !isnan(lp)) json_object_set_new(d, json_string_value(me), json_real(lp));
    json_decref(me);
    for (int k = 0; tops && k < n_top && k < j->rq.logprobs; k++) {
        const k3_logprob *t = &tops[k];
        if (t->id < 0) continue;
        json_t *ts = k3_srv_token_json(j, t->id);
        if (ts && !json_object_get(d, json_string_value(ts)))
            json_object_set_new(d, json_string_value(ts), json_real(t->logprob));
        json_decref(ts);
    }
    return d;
}

/* Appends the entry of token id (logprob lp: NULL for none, top: the
 * top_logprobs entry or NULL) at text offset offset. */
static void lp_entry(k3_srv_job *j, json_t *lp, int32_t id, json_t *logprob, json_t *top, size_t offset) {
    json_array_append_new(json_object_get(lp, "tokens"), k3_srv_token_json(j, id));
    json_array_append_new(json_object_get(lp, "token_logprobs"), logprob ? logprob : json_null());
    json_array_append_new(json_object_get(lp, "top_logprobs"), top ? top : json_null());
    json_array_append_new(json_object_get(lp, "text_offset"), json_integer((json_int_t)offset));
}

/* A prompt token's entry at *offset, which moves on by its text. */
static void lp_append(k3_srv_job *j, json_t *lp, int32_t id, json_t *logprob, json_t *top, size_t *offset) {
    lp_entry(j, lp, id, logprob, top, *offset);
    size_t len = 0;
    if (!k3_tokenizer_is_special(j->s->tok, id)) k3_tokenizer_token(j->s->tok, id, &len);
    *offset += len;
}

/* Generated tokens [a, b) of c, at base + where each begins in its text. */
static void lp_generated(k3_srv_job *j, const k3_srv_choice *c, size_t a, size_t b, json_t *lp, size_t base) {
    const k3_srv_seq *q = &c->q;
    for (size_t i = a; i < b && i < q->n_tok && i < c->n_seen; i++) {
        const float l = q->lps[i];
        json_t *top = lp_top(j, q->toks[i], l, q->tops ? q->tops + i * (size_t)q->n_top : NULL, q->n_top);
        size_t t0, t1;
        k3_srv_choice_token_span(c, i, &t0, &t1);
        lp_entry(j, lp, q->toks[i], isnan(l) ? NULL : json_real(l), top, base + t0);
    }
}

/* The echoed prompt (its first token has no logprob). */
static void lp_prompt(k3_srv_job *j, const k3_srv_choice *c, json_t *lp, size_t *offset) {
    const int32_t *ids = j->rq.prompts[c->prompt_index];
    const int64_t n = j->rq.n_prompt[c->prompt_index];
    const k3_srv_seq *q = &c->q;
    for (int64_t i = 0; i < n; i++) {
        const bool have = i >= 1 && i - 1 < q->n_plp;
        json_t *l = have ? json_real(q->plp[i - 1]) : NULL, *top = NULL;
        if (have)
            top = lp_top(j, ids[i], q->plp[i - 1], q->ptop ? q->ptop + (size_t)(i - 1) * (size_t)q->n_top : NULL,
                         q->n_top);
        lp_append(j, lp, ids[i], l, top, offset);
    }
}

/* ---- answers -------------------------------------------------------------- */

/* One entry of choices: the text (after the prompt with echo), its logprobs, the finish reason. */
static json_t *answer_choice(k3_srv_job *j, k3_srv_choice *c, char *why, size_t why_len) {
    json_t *lp = json_null();
    if (j->rq.logprobs >= 0) {
        json_decref(lp);
        lp = lp_new();
        size_t off = 0;
        if (j->rq.echo) lp_prompt(j, c, lp, &off);
        lp_generated(j, c, 0, c->n_out < 0 ? 0 : (size_t)c->n_out, lp, off);
    }
    json_t *text;
    if (j->rq.echo) {
        size_t pl = 0;
        char *pt = k3_srv_choice_prompt_text(j, c, &pl);
        k3_buf b = {0};
        k3_buf_add(&b, pt ? pt : "", pt ? pl : 0);
        k3_buf_add(&b, c->text.p ? c->text.p : "", c->text.len);
        text = k3_srv_jstr(b.p ? b.p : "", b.len);
        free(pt);
        k3_buf_free(&b);
    } else {
        text = k3_srv_jstr(c->text.p ? c->text.p : "", c->text.len);
    }
    return json_pack("{s:i,s:o,s:o,s:s}", "index", c->index, "text", text ? text : json_string(""), "logprobs", lp,
                     "finish_reason", k3_srv_finish_reason(c, false));
}

static enum MHD_Result answer(k3_srv_job *j) { return k3_srv_openai_answer(j, OBJECT, answer_choice); }

static json_t *chunk(k3_srv_job *j, json_t *choices) {
    json_t *o = k3_srv_openai_object(j, OBJECT, choices);
    if (o && j->rq.include_usage) json_object_set_new(o, "usage", json_null());
    return o;
}

static void stream_choice(k3_srv_job *j, int i) {
    k3_srv_choice *c = &j->ch[i];
    if (c->final_sent) return;
    k3_srv_choice_advance(j, c);
    const size_t upto = k3_srv_choice_sendable(j, c), lp_upto = k3_srv_choice_lp_ready(c);
    if (c->done) {
        const char *why = k3_srv_choice_error(c, "generation failed");
        if (why) {
            k3_sse_error(&j->sse, k3_srv_choice_error_status(c), why);
            c->final_sent = true;
            return;
        }
    }
    const bool echo_now = j->rq.echo && !c->started;
    if (upto > c->emitted || echo_now || (j->rq.logprobs >= 0 && lp_upto > c->lp_sent) || c->done) {
        k3_buf t = {0};
        if (echo_now) {
            size_t pl = 0;
            char *pt = k3_srv_choice_prompt_text(j, c, &pl);
            if (pt) k3_buf_add(&t, pt, pl);
            free(pt);
        }
        c->started = true;
        if (upto > c->emitted) k3_buf_add(&t, c->text.p + c->emitted, upto - c->emitted);
        json_t *lp = json_null();
        if (j->rq.logprobs >= 0 && lp_upto > c->lp_sent) {
            json_decref(lp);
            lp = lp_new();
            lp_generated(j, c, c->lp_sent, lp_upto, lp, 0);
            c->lp_sent = lp_upto;
        }
        c->emitted = upto;
        json_t *ch =
            json_pack("{s:i,s:o,s:o,s:o}", "index", i, "text", k3_srv_jstr(t.p ? t.p : "", t.len), "logprobs", lp,
                      "finish_reason", c->done ? json_string(k3_srv_finish_reason(c, false)) : json_null());
        k3_buf_free(&t);
        k3_sse_data(&j->sse, chunk(j, json_pack("[o]", ch)));
    }
    if (c->done) c->final_sent = true;
}

static void stream_end(k3_srv_job *j) { k3_srv_openai_stream_end(j, OBJECT); }

static const k3_srv_api completions = {
    .fields = K3_API_COMPLETIONS,
    .id_prefix = "cmpl",
    .keep_specials = false,
    .default_max_tokens = 16,
    .prompt = parse_prompts,
    .answer = answer,
    .stream_choice = stream_choice,
    .stream_end = stream_end,
};

enum MHD_Result k3_api_completions(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    return k3_srv_job_serve(s, c, root, &completions);
}
