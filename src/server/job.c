/*
 * job.c -- the generation job (job.h).
 *
 * The HTTP thread of a request parses it (request.c), submits one engine
 * request per prompt and choice, and waits on the job's condition variable
 * (polling its socket every 100 ms, so a client that hangs up has its
 * requests cancelled within one step plus 100 ms); the engine thread
 * appends the outputs (engine_loop.c).
 *
 * Text: generated tokens are decoded into a byte buffer: specials left
 * out unless skip_special_tokens is false (then by name, with a space on
 * each side when spaces_between_special_tokens, as Hugging Face's slow
 * tokenizers join them), and the chat markup always by name for a surface
 * that parses it; the end of each token in the text is kept, so the
 * surfaces can tell which tokens made which part of it. Only whole UTF-8
 * characters are sent; stop strings are searched over the whole unsent
 * text, so a stop split over tokens is found, and the longest unsent
 * suffix that could still begin a stop string is held back until the next
 * token decides it. A stop string ends the request (cancelled in the
 * engine) and is never sent, nor is the stop token that ended it, unless
 * include_stop_str_in_output.
 *
 * Prefill and decode apart: the k3_srv_pd_* at the end.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/random.h"
#include "pd/pd.h"
#include "server/http.h"
#include "server/job.h"

void k3_tool_stream_free(k3_tool_stream *ts) {
    for (int i = 0; i < ts->n; i++) k3_buf_free(&ts->calls[i].sent);
    free(ts->calls);
    *ts = (k3_tool_stream){0};
}

static void job_destroy(k3_srv_group *g) {
    k3_srv_job *j = (k3_srv_job *)g;
    for (int i = 0; i < j->n; i++) {
        k3_srv_choice *c = &j->ch[i];
        k3_srv_seq_free(&c->q);
        k3_buf_free(&c->text);
        free(c->tok_end);
        free(c->marks);
        free(c->complete);
        k3_grammar_matcher_free(c->gm);
        k3_tool_stream_free(&c->ts);
    }
    k3_srv_pd_free(j);
    free(j->ch);
    if (j->surf && j->api && j->api->surf_free) j->api->surf_free(j->surf);
    k3_srv_request_free(&j->rq);
    k3_sse_free(&j->sse);
    free(j);
}

static void job_unref(k3_srv_job *j) { k3_srv_group_unref(&j->g); }

/* ---- text ------------------------------------------------------------- */

enum { SP_NONE, SP_TEXT, SP_SPECIAL };

/* Appends token id to c's text. */
static void add_token(k3_srv_job *j, k3_srv_choice *c, int32_t id) {
    const k3_tokenizer *tok = j->s->tok;
    size_t len = 0;
    const char *p = k3_tokenizer_token(tok, id, &len);
    if (!p) return;
    const bool space = j->rq.spaces_between_special_tokens;
    if (k3_tokenizer_is_special(tok, id)) {
        if (j->api->keep_specials &&
            (id == j->markup[0] || id == j->markup[1] || id == j->markup[2] || id == j->markup[3])) {
            /* markup: parsed away, no spaces; where it is, so the parser
             * tells it from text that spells its name */
            if (c->n_marks == c->cap_marks) {
                const size_t cap = c->cap_marks ? c->cap_marks * 2 : 16;
                size_t *m = realloc(c->marks, cap * sizeof *m);
                if (!m) {
                    c->text.oom = true;
                    return;
                }
                c->marks = m;
                c->cap_marks = cap;
            }
            c->marks[c->n_marks++] = c->text.len;
            k3_buf_add(&c->text, p, len);
            c->sp = SP_NONE;
            return;
        }
        if (j->rq.skip_special_tokens) return;
        if (space && c->sp != SP_NONE) k3_buf_add(&c->text, " ", 1);
        k3_buf_add(&c->text, p, len);
        c->sp = SP_SPECIAL;
        return;
    }
    if (space && c->sp == SP_SPECIAL) k3_buf_add(&c->text, " ", 1);
    k3_buf_add(&c->text, p, len);
    c->sp = SP_TEXT;
}

/* With a grammar and stop strings: whether the text after generated token
 * n_seen is a complete match, from the choice's own matcher (a token it refuses, which
 * the engine's would not have sampled, turns the tracking off: no stop
 * string ends the output then). */
static void grammar_track(k3_srv_job *j, k3_srv_choice *c, int32_t id) {
    k3_error err = {0};
    if (!c->gm && !c->gm_off) {
        if (k3_grammar_matcher_init(&c->gm, j->rq.grammar, &err)) c->gm_off = true;
        else c->complete0 = k3_grammar_matcher_is_complete(c->gm);
    }
    if (!c->gm_off && k3_grammar_matcher_accept(c->gm, id, &err)) c->gm_off = true;
    c->complete[c->n_seen] = !c->gm_off && k3_grammar_matcher_is_complete(c->gm);
}

/* The first stop string in c's unsent text (k3_stops_find); with a grammar
 * only one that begins where the text before it is complete, so a stop
 * string never cuts a structured output short. */
static long find_stop(k3_srv_job *j, k3_srv_choice *c, size_t *sl) {
    size_t from = c->emitted;
    for (;;) {
        const long at = k3_stops_find(&j->rq.stops, c->text.p, c->text.len, from, sl);
        if (at < 0 || !j->rq.grammar) return at;
        bool ok = at == 0 && c->complete0;
        for (size_t k = c->n_seen + 1; !ok && k-- > 0;) {
            if (c->tok_end[k] < (size_t)at) break;
            ok = c->tok_end[k] == (size_t)at && c->complete[k];
        }
        if (ok) return at;
        from = (size_t)at + 1;
    }
}

void k3_srv_choice_advance(k3_srv_job *j, k3_srv_choice *c) {
    const k3_srv_seq *q = &c->q;
    if (c->done) return;
    if (q->n_tok > c->tok_cap) {
        size_t cap = c->tok_cap ? c->tok_cap * 2 : 64;
        while (cap < q->n_tok) cap *= 2;
        size_t *te = realloc(c->tok_end, sizeof *te * cap);
        const bool track = j->rq.grammar && j->rq.stops.n;
        uint8_t *cm = te && track ? realloc(c->complete, cap) : NULL;
        if (cm) c->complete = cm;
        if (!te || (track && !cm)) {
            if (te) c->tok_end = te;
            if (!q->error[0]) snprintf(c->q.error, sizeof c->q.error, "out of memory for the generated text");
            k3_srv_cancel(j->s, &c->q);
            c->done = true;
            return;
        }
        c->tok_end = te;
        c->tok_cap = cap;
    }
    for (; c->n_seen < q->n_tok && !c->stop_hit; c->n_seen++) {
        const int32_t id = q->toks[c->n_seen];
        c->n_out++;
        /* the token that ended the request is not part of the text, unless asked for */
        const bool stop_tok =
            q->finished && q->finish == K3_FINISH_STOP && c->n_seen + 1 == q->n_tok && id == q->stop_id;
        if (!stop_tok || j->rq.include_stop_str) add_token(j, c, id);
        c->tok_end[c->n_seen] = c->text.len;
        if (j->rq.grammar && j->rq.stops.n) grammar_track(j, c, id);
        if (j->rq.stops.n) {
            /* a stop can begin in the held-back text, never in sent text */
            size_t sl = 0;
            const long at = find_stop(j, c, &sl);
            if (at >= 0) {
                for (int k = 0; k < j->rq.stops.n && !c->stop_which; k++)
                    if (j->rq.stops.len[k] == sl && !memcmp(c->text.p + at, j->rq.stops.s[k], sl))
                        c->stop_which = k + 1;
                const size_t cut = (size_t)at + (j->rq.include_stop_str ? sl : 0);
                c->text.len = cut;
                c->text.p[cut] = 0;
                c->stop_hit = true;
                k3_srv_cancel(j->s, &c->q);
            }
        }
    }
    if (c->stop_hit || (q->finished && c->n_seen == q->n_tok)) c->done = true;
}

void k3_srv_choice_token_span(const k3_srv_choice *c, size_t i, size_t *start, size_t *end) {
    size_t a = i ? c->tok_end[i - 1] : 0, b = c->tok_end[i];
    if (a > c->text.len) a = c->text.len;
    if (b > c->text.len) b = c->text.len;
    *start = a;
    *end = b;
}

size_t k3_srv_choice_sendable(k3_srv_job *j, k3_srv_choice *c) {
    if (c->done) return c->text.len;
    size_t lim = k3_utf8_complete(c->text.p, c->text.len);
    if (lim < c->emitted) return c->emitted;
    const size_t hold = k3_stops_holdback(&j->rq.stops, c->text.p, lim, c->emitted);
    lim -= hold;
    if (j->api->hold) lim = j->api->hold(c->text.p, c->emitted, lim);
    return lim < c->emitted ? c->emitted : lim;
}

size_t k3_srv_choice_lp_ready(const k3_srv_choice *c) { return c->done ? (size_t)c->n_out : c->n_seen; }

const char *k3_srv_choice_error(const k3_srv_choice *c, const char *fallback) {
    if (c->q.finish != K3_FINISH_ERROR && !c->q.error[0]) return NULL;
    return c->q.error[0] ? c->q.error : fallback;
}

unsigned k3_srv_choice_error_status(const k3_srv_choice *c) { return c->q.err_status ? c->q.err_status : 500; }

const char *k3_srv_finish_reason(const k3_srv_choice *c, bool tool_calls) {
    if (c->stop_hit) return "stop";
    switch (c->q.finish) {
    case K3_FINISH_STOP: return tool_calls ? "tool_calls" : "stop";
    case K3_FINISH_LENGTH: return "length";
    case K3_FINISH_CANCELLED: return "abort";
    default: return "error";
    }
}

char *k3_srv_choice_prompt_text(k3_srv_job *j, const k3_srv_choice *c, size_t *len) {
    char *pt = NULL;
    *len = 0;
    if (k3_tokenizer_decode(j->s->tok, j->rq.prompts[c->prompt_index], (size_t)j->rq.n_prompt[c->prompt_index], &pt,
                            len, NULL)) {
        free(pt);
        *len = 0;
        return NULL;
    }
    return pt;
}

/* The engine thread, the job's mutex held: the choice's text is decoded
 * now, and a stop string in it makes "stop" -- even when the engine
 * reached max_tokens before the cancel the stop string sent came. */
static k3_finish_reason on_finish(k3_srv_group *g, k3_srv_seq *q) {
    k3_srv_choice *c = (k3_srv_choice *)q;
    k3_srv_choice_advance((k3_srv_job *)g, c);
    return c->stop_hit && q->finish != K3_FINISH_ERROR ? K3_FINISH_STOP : q->finish;
}

void k3_srv_job_cancel(k3_srv_job *j) {
    for (int i = 0; i < j->n; i++) k3_srv_cancel(j->s, &j->ch[i].q);
}

/* ---- logprobs and usage ----------------------------------------------- */

json_t *k3_srv_token_json(k3_srv_job *j, int32_t id) {
    if (j->rq.tok_ids) {
        char b[32];
        snprintf(b, sizeof b, "token_id:%d", id);
        return json_string(b);
    }
    size_t len = 0;
    const char *p = k3_tokenizer_token(j->s->tok, id, &len);
    if (!p) return json_string("");
    return k3_srv_jstr(p, len);
}

static json_t *bytes_of(struct k3_server *s, int32_t id) {
    size_t len = 0;
    const char *p = k3_tokenizer_token(s->tok, id, &len);
    json_t *a = json_array();
    for (size_t i = 0; p && i < len; i++) json_array_append_new(a, json_integer((unsigned char)p[i]));
    return a;
}

void k3_srv_chat_logprobs(k3_srv_job *j, const k3_srv_choice *c, size_t a, size_t b, json_t *content) {
    struct k3_server *s = j->s;
    const k3_srv_seq *q = &c->q;
    for (size_t i = a; i < b && i < q->n_tok; i++) {
        const int32_t id = q->toks[i];
        json_t *top = json_array();
        for (int k = 0; k < q->n_top && k < j->rq.logprobs; k++) {
            const k3_logprob *t = &q->tops[i * (size_t)q->n_top + (size_t)k];
            if (t->id < 0) continue;
            json_array_append_new(top,
                                  json_pack("{s:o,s:f,s:o}", "token", k3_srv_token_json(j, t->id), "logprob",
                                            (double)t->logprob, "bytes", bytes_of(s, t->id)));
        }
        json_array_append_new(content,
                              json_pack("{s:o,s:o,s:o,s:o}", "token", k3_srv_token_json(j, id), "logprob",
                                        isnan(q->lps[i]) ? json_null() : json_real(q->lps[i]), "bytes", bytes_of(s, id),
                                        "top_logprobs", top));
    }
}

json_t *k3_srv_openai_usage(k3_srv_job *j) {
    int64_t prompt = 0, cached = 0, out = 0;
    for (int p = 0; p < j->rq.n_prompts; p++) {
        prompt += j->rq.n_prompt[p];
        /* the first choice of each prompt tells how much of it was cached */
        for (int i = 0; i < j->n; i++)
            if (j->ch[i].prompt_index == p) {
                cached += j->ch[i].q.n_cached;
                break;
            }
    }
    for (int i = 0; i < j->n; i++) out += j->ch[i].n_out;
    json_t *u = json_pack("{s:I,s:I,s:I,s:{s:I}}", "prompt_tokens", (json_int_t)prompt, "completion_tokens",
                          (json_int_t)out, "total_tokens", (json_int_t)(prompt + out), "prompt_tokens_details",
                          "cached_tokens", (json_int_t)cached);
    if (u && j->api->reasoning_tokens) {
        int64_t rt = 0;
        for (int i = 0; i < j->n; i++) rt += j->api->reasoning_tokens(j, &j->ch[i]);
        json_object_set_new(u, "completion_tokens_details", json_pack("{s:I}", "reasoning_tokens", (json_int_t)rt));
    }
    return u;
}

json_t *k3_srv_openai_object(k3_srv_job *j, const char *object, json_t *choices) {
    return json_pack("{s:s,s:s,s:I,s:s,s:o}", "id", j->id, "object", object, "created", (json_int_t)j->created, "model",
                     j->s->model, "choices", choices);
}

enum MHD_Result k3_srv_openai_answer(k3_srv_job *j, const char *object, k3_srv_choice_json_fn choice) {
    json_t *choices = json_array();
    for (int i = 0; i < j->n; i++) {
        k3_srv_choice *c = &j->ch[i];
        const char *failed = k3_srv_choice_error(c, "engine error");
        char why[1024] = "";
        json_t *ch = failed ? NULL : choice(j, c, why, sizeof why);
        if (failed || (!ch && why[0])) {
            json_decref(choices);
            if (failed && k3_srv_choice_error_status(c) != 500)
                return k3_srv_error(j->s, j->conn, k3_srv_choice_error_status(c), "%s", failed);
            if (failed) return k3_srv_error(j->s, j->conn, 500, "generation failed: %s", failed);
            return k3_srv_error(j->s, j->conn, 500, "%s", why);
        }
        json_array_append_new(choices, ch);
    }
    json_t *resp = k3_srv_openai_object(j, object, choices);
    if (resp) json_object_set_new(resp, "usage", k3_srv_openai_usage(j));
    return k3_srv_job_json(j, 200, resp);
}

void k3_srv_openai_stream_end(k3_srv_job *j, const char *object) {
    if (j->rq.include_usage) {
        json_t *u = k3_srv_openai_object(j, object, json_array());
        json_object_set_new(u, "usage", k3_srv_openai_usage(j));
        if (u && j->extra) json_object_update(u, j->extra);
        k3_sse_data(&j->sse, u);
    }
    k3_sse_done(&j->sse);
}

/* ---- errors ------------------------------------------------------------ */

enum MHD_Result k3_srv_api_error(const k3_srv_api *api, struct k3_server *s, struct MHD_Connection *c, unsigned status,
                                 const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (api && api->error) return api->error(s, c, status, msg);
    return k3_srv_error(s, c, status, "%s", msg);
}

/* ---- submitting, waiting ------------------------------------------------- */

static k3_request_params engine_request(k3_srv_job *j, int i);

/* Submits the choices that wait while fewer than the job's seats run (the
 * job's mutex not held). One the engine refuses fails alone with its
 * message: the answer is under way. */
static void submit_more(k3_srv_job *j) {
    for (;;) {
        pthread_mutex_lock(&j->g.mu);
        int running = 0;
        for (int i = 0; i < j->n_sub; i++) running += !j->ch[i].q.finished;
        const int i = j->n_sub;
        const bool more = i < j->n && running < j->seats;
        pthread_mutex_unlock(&j->g.mu);
        if (!more) return;
        k3_srv_choice *c = &j->ch[i];
        k3_request_params p = engine_request(j, i);
        k3_error err = {0};
        const k3_status st = k3_srv_submit(j->s, &c->q, &p, &err);
        pthread_mutex_lock(&j->g.mu);
        j->n_sub++;
        if (st) {
            c->q.finished = true;
            c->q.finish = K3_FINISH_ERROR;
            c->q.err_status = st == K3_ERR_BUSY || st == K3_ERR_IO ? 503 : st == K3_ERR_NOMEM ? 500 : 400;
            snprintf(c->q.error, sizeof c->q.error, "%.250s", err.msg);
        }
        pthread_mutex_unlock(&j->g.mu);
    }
}

static void wait_a_while(k3_srv_job *j) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 100 * 1000000L;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(&j->g.cv, &j->g.mu, &ts);
}

/* ---- the whole answer --------------------------------------------------- */

/* 0: all choices done; 1: the client hung up or the server stops (no
 * answer); 2: the server ends the request (why[] says why). A client that
 * only half-closed is answered: only a hang-up (reset, or both ways shut)
 * cancels, or failing to write the answer. */
static int wait_all(k3_srv_job *j, char *why, size_t cap) {
    struct k3_server *s = j->s;
    for (;;) {
        pthread_mutex_lock(&j->g.mu);
        bool all = j->n_sub == j->n, failed = false;
        for (int i = 0; i < j->n_sub; i++) {
            k3_srv_choice_advance(j, &j->ch[i]);
            all &= j->ch[i].done;
            failed |= j->ch[i].done && k3_srv_choice_error_status(&j->ch[i]) == 503;
        }
        const char *end = k3_srv_ending(s, why, cap);
        /* done, unless the server failed under it */
        if (all && !(end && failed)) {
            pthread_mutex_unlock(&j->g.mu);
            return 0;
        }
        if (end) {
            k3_srv_job_cancel(j);
            pthread_mutex_unlock(&j->g.mu);
            return 2;
        }
        wait_a_while(j);
        const bool cut = atomic_load(&s->stopping) || k3_srv_client_gone(j->conn);
        if (cut) k3_srv_job_cancel(j);
        pthread_mutex_unlock(&j->g.mu);
        if (cut) return 1;
        submit_more(j);
    }
}

static enum MHD_Result answer_whole(k3_srv_job *j) {
    char why[300];
    const int w = wait_all(j, why, sizeof why);
    if (w == 1) return MHD_NO;
    if (w == 2) return k3_srv_api_error(j->api, j->s, j->conn, 503, "%s", why);
    char pd_why[600];
    if (!k3_srv_pd_finish(j, pd_why, sizeof pd_why)) return k3_srv_api_error(j->api, j->s, j->conn, 500, "%s", pd_why);
    return j->api->answer(j);
}

/* ---- the stream --------------------------------------------------------- */

static double mono_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The server ends the stream: the surface's error ending. */
static void stream_ended(k3_srv_job *j, const char *why) {
    k3_srv_job_cancel(j);
    if (j->api->stream_error) j->api->stream_error(j, 503, why);
    else {
        k3_sse_error(&j->sse, 503, why);
        k3_sse_done(&j->sse);
    }
    j->sent_done = true;
    MHD_set_connection_option(j->conn, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)j->s->timeout_s);
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    k3_srv_job *j = cls;
    struct k3_server *s = j->s;
    for (;;) {
        if (!k3_sse_empty(&j->sse)) return (ssize_t)k3_sse_take(&j->sse, buf, max);
        if (j->sent_done) return MHD_CONTENT_READER_END_OF_STREAM;
        pthread_mutex_lock(&j->g.mu);
        char why[300];
        if (k3_srv_ending(s, why, sizeof why)) {
            stream_ended(j, why);
            pthread_mutex_unlock(&j->g.mu);
            continue;
        }
        bool all = j->n_sub == j->n;
        for (int i = 0; i < j->n_sub; i++) {
            j->api->stream_choice(j, i);
            all &= j->ch[i].final_sent;
        }
        if (all) {
            char pd_why[600];
            k3_srv_pd_finish(j, pd_why, sizeof pd_why); /* a decode side's figures, for the usage chunk */
            j->api->stream_end(j);
            j->sent_done = true;
            /* generation is over: a client that stops reading is dropped again */
            MHD_set_connection_option(j->conn, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)s->timeout_s);
        }
        if (k3_sse_empty(&j->sse) && !j->sent_done) wait_a_while(j);
        pthread_mutex_unlock(&j->g.mu);
        if (j->sse.out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (k3_sse_empty(&j->sse) && !j->sent_done) {
            if (atomic_load(&s->stopping) || k3_srv_client_gone(j->conn)) {
                pthread_mutex_lock(&j->g.mu);
                k3_srv_job_cancel(j);
                pthread_mutex_unlock(&j->g.mu);
                return MHD_CONTENT_READER_END_WITH_ERROR;
            }
            /* a client that sent its end may still read, or be gone: a
             * comment each second tells (the write after a closed peer
             * fails, and the connection's end cancels the stream) */
            if (k3_srv_client_half_closed(j->conn)) {
                const double now = mono_s();
                if (now - j->probe_t >= 1.0) {
                    j->probe_t = now;
                    k3_sse_comment(&j->sse);
                }
            }
            submit_more(j);
        }
    }
}

static void stream_free(void *cls) {
    k3_srv_job *j = cls;
    pthread_mutex_lock(&j->g.mu);
    k3_srv_job_cancel(j);
    pthread_mutex_unlock(&j->g.mu);
    job_unref(j);
}

/* ---- the route ---------------------------------------------------------- */

static enum MHD_Result fail_job(k3_srv_job *j, unsigned status, const char *msg) {
    struct k3_server *s = j->s;
    struct MHD_Connection *conn = j->conn;
    const k3_srv_api *api = j->api;
    pthread_mutex_lock(&j->g.mu);
    k3_srv_job_cancel(j);
    pthread_mutex_unlock(&j->g.mu);
    job_unref(j);
    return k3_srv_api_error(api, s, conn, status, "%s", msg);
}

/* Choice i's max_tokens: the request's, or the surface's default (what
 * the context leaves when it has none), cut to the job's cap. */
static long long choice_max_tokens(const k3_srv_job *j, int i) {
    const k3_srv_request *rq = &j->rq;
    const int64_t np = rq->n_prompt[j->ch[i].prompt_index];
    long long mt = rq->max_tokens;
    if (mt < 0) {
        mt = j->api->default_max_tokens >= 0 ? j->api->default_max_tokens : (j->mml > np ? j->mml - np : 0);
        if (j->mt_cap >= 0 && mt > j->mt_cap) mt = j->mt_cap;
    }
    return mt;
}

/* The work caps (K3_SRV_MAX_TOKENS, K3_SRV_MAX_LP_ENTRIES): false with e
 * when an explicit max_tokens asks for more; a default one is capped. */
static bool check_work(k3_srv_job *j, k3_srv_bad *e) {
    const k3_srv_request *rq = &j->rq;
    const long long per = rq->logprobs >= 0 ? 1 + rq->logprobs : 1;
    const long long cap = rq->logprobs >= 0 ? K3_SRV_MAX_LP_ENTRIES : K3_SRV_MAX_TOKENS;
    long long prompt = 0, total = 0, longest = 0;
    for (int i = 0; i < j->n; i++) {
        const long long np = rq->echo ? rq->n_prompt[j->ch[i].prompt_index] : 0;
        prompt += np;
        if (np > longest) longest = np;
        total += choice_max_tokens(j, i) + np;
    }
    if (total * per <= cap) return true;
    const char *what = rq->logprobs >= 0 ? "logprob entries" : "tokens";
    if (rq->max_tokens >= 0 || j->api->default_max_tokens >= 0 || prompt * per >= cap)
        return k3_srv_bad_set(e, 400,
                              "the request asks for %lld %s (%d choices x (max_tokens%s)%s), over the limit of %lld "
                              "per "
                              "request: ask for fewer choices, tokens%s",
                              total * per, what, j->n, rq->echo ? " + the echoed prompt" : "",
                              rq->logprobs >= 0 ? " x (1 + top logprobs)" : "", cap,
                              rq->logprobs >= 0 ? " or alternatives" : "");
    /* a default max_tokens: what is left per choice after the echoed prompts */
    j->mt_cap = (cap / per - prompt) / j->n;
    return true;
}

/* The engine request of choice i (its prompt, sampling and limits). */
/* The drafts' scope of a request: a hash of the API key it presented (0
 * without one), so outputs never cross from one key's requests to
 * another's through the suffix proposer's cache. */
static uint64_t key_scope(struct MHD_Connection *conn) {
    const char *k = conn ? MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "x-api-key") : NULL;
    if (!k && conn) k = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!k) return 0;
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *k; k++) h = (h ^ (uint8_t)*k) * 0x100000001b3ull;
    return h | 1;
}

/* The prefix cache's salt of a request: its cache_salt, and with
 * --prefix-cache-per-key the API key it presented. */
static uint64_t k3_srv_cache_salt(const struct k3_server *s, uint64_t salt, uint64_t key) {
    if (s->prefix_cache_per_key && key) salt = ((salt ^ key) * 0x9E3779B97F4A7C15ull) | 1;
    return salt;
}

static k3_request_params engine_request(k3_srv_job *j, int i) {
    const k3_srv_request *rq = &j->rq;
    const k3_srv_choice *c = &j->ch[i];
    const int64_t np = rq->n_prompt[c->prompt_index];
    k3_request_params p = {
        .prompt = rq->prompts[c->prompt_index],
        .n_prompt = np,
        .sampling = {.temperature = (float)rq->temperature,
                     .top_k = rq->top_k < 0 ? 0 : (int32_t)rq->top_k,
                     .top_p = (float)rq->top_p,
                     .min_p = (float)rq->min_p,
                     .repeat_penalty = (float)rq->repetition_penalty,
                     .repeat_last_n = 0,
                     .seed = j->base_seed + (uint64_t)(i % (int)rq->n),
                     .frequency_penalty = (float)rq->frequency_penalty,
                     .presence_penalty = (float)rq->presence_penalty,
                     .logit_bias = rq->logit_bias,
                     .n_logit_bias = rq->n_logit_bias,
                     .allowed_ids = rq->allowed_ids,
                     .n_allowed = rq->n_allowed,
                     .bad_words = rq->bad_words,
                     .bad_word_off = rq->bad_word_off,
                     .n_bad_words = rq->n_bad_words},
        .max_tokens = (int32_t)choice_max_tokens(j, i),
        .min_tokens = (int32_t)rq->min_tokens,
        .stop_ids = rq->n_stop_ids ? rq->stop_ids : NULL,
        .n_stop_ids = rq->n_stop_ids,
        .ignore_eos = rq->ignore_eos,
        .logprobs = rq->logprobs >= 0 ? (int32_t)rq->logprobs : -1,
        .prompt_logprobs = rq->echo && rq->logprobs >= 0 ? (int32_t)rq->logprobs : -1,
        .embeds = rq->vp.n_images ? (const float *const *)rq->vp.embeds : NULL,
        .extra_keys = rq->vp.n_images ? rq->vp.keys : NULL,
        .grammar = rq->grammar,
        .speculative = rq->spec_method,
        .num_speculative_tokens = rq->spec_k,
        .spec_scope = key_scope(j->conn),
        .cache_salt = k3_srv_cache_salt(j->s, rq->cache_salt, key_scope(j->conn)),
    };
    k3_srv_pd_request(j, &p); /* kept for a decode instance, or pulled from a prefill one */
    return p;
}

enum MHD_Result k3_srv_job_serve(struct k3_server *s, struct MHD_Connection *conn, json_t *root,
                                 const k3_srv_api *api) {
    return k3_srv_job_serve_surf(s, conn, root, api, NULL);
}

enum MHD_Result k3_srv_job_serve_surf(struct k3_server *s, struct MHD_Connection *conn, json_t *root,
                                      const k3_srv_api *api, void *surf) {
    k3_srv_job *j = calloc(1, sizeof *j);
    if (!j) {
        if (surf && api->surf_free) api->surf_free(surf);
        return k3_srv_api_error(api, s, conn, 500, "out of memory");
    }
    j->surf = surf;
    k3_srv_group_init(&j->g, on_finish, job_destroy);
    j->s = s;
    j->api = api;
    j->conn = conn;
    j->created = (long)time(NULL);
    /* the id tells nothing: random letters from the OS, no counter, clock or address */
    char pre[24];
    snprintf(pre, sizeof pre, "%s-", api->id_prefix);
    k3_random_id(j->id, sizeof j->id, pre, 24);

    j->markup[0] = j->markup[1] = j->markup[2] = j->markup[3] = -1;
    if (api->keep_specials) {
        j->markup[0] = k3_tokenizer_special(s->tok, "<|open|>");
        j->markup[1] = k3_tokenizer_special(s->tok, "<|close|>");
        j->markup[2] = k3_tokenizer_special(s->tok, "<|sep|>");
        j->markup[3] = k3_tokenizer_special(s->tok, "<|end_of_msg|>");
    }
    k3_srv_request *rq = &j->rq;
    k3_srv_bad e = {{0}, 400};
    const int64_t mml = k3_srv_max_model_len(s);
    bool ok = k3_srv_request_parse(s, api->fields, api->prompt, root, rq, &e);
    if (ok && rq->n_prompts * rq->n > K3_SRV_MAX_N)
        ok = k3_srv_bad_set(&e, 400, "%d prompts x n = %lld choices, more than %d", rq->n_prompts, rq->n, K3_SRV_MAX_N);
    if (!ok) {
        job_unref(j);
        return k3_srv_api_error(api, s, conn, e.status, "%s", e.msg);
    }
    if (rq->echo && rq->stream && rq->logprobs >= 0) {
        job_unref(j);
        return k3_srv_api_error(api, s, conn, 400, "\"echo\" with \"logprobs\" is not supported when streaming");
    }
    if (!k3_srv_pd_prepare(j, &e)) {
        job_unref(j);
        return k3_srv_error(s, conn, e.status, "%s", e.msg);
    }
    j->n = rq->n_prompts * (int)rq->n;
    j->ch = calloc((size_t)j->n, sizeof *j->ch);
    if (!j->ch) {
        job_unref(j);
        return k3_srv_api_error(api, s, conn, 500, "out of memory");
    }
    uint64_t seed = 0;
    if (!(rq->seed >= 0 || rq->seed_given)) k3_random_bytes(&seed, sizeof seed, NULL);
    j->base_seed = rq->seed >= 0 || rq->seed_given ? (uint64_t)rq->seed : seed;
    j->mml = mml;
    j->mt_cap = -1;
    for (int i = 0; i < j->n; i++) {
        k3_srv_choice *c = &j->ch[i];
        c->job = j;
        c->index = i;
        c->prompt_index = i / (int)rq->n;
        c->q.group = &j->g;
        c->q.stop_id = -1;
        const int64_t np = rq->n_prompt[c->prompt_index];
        if (np > mml) {
            char msg[256];
            snprintf(msg, sizeof msg,
                     "the prompt has %lld tokens, more than this model's maximum context length of %lld tokens",
                     (long long)np, (long long)mml);
            return fail_job(j, 400, msg);
        }
    }
    if (!check_work(j, &e)) return fail_job(j, e.status, e.msg);
    /* fairness: half the engine's seats at most, and one at a time for
     * choices that each prefill their whole prompt (prompt logprobs do not
     * read the prefix cache), so a request behind this one is not held up
     * for all of them */
    k3_engine_stats st;
    k3_srv_engine_stats(s, &st);
    j->seats = st.max_num_seqs > 1 ? st.max_num_seqs / 2 : 1;
    if (rq->echo && rq->logprobs >= 0) j->seats = 1;
    for (int i = 0; i < j->n && i < j->seats; i++) {
        k3_request_params p = engine_request(j, i);
        k3_error err = {0};
        const k3_status st2 = k3_srv_submit(s, &j->ch[i].q, &p, &err);
        if (st2)
            return fail_job(j, st2 == K3_ERR_BUSY || st2 == K3_ERR_IO ? 503 : st2 == K3_ERR_NOMEM ? 500 : 400, err.msg);
        j->n_sub = i + 1;
    }
    if (j->n_sub == j->n) k3_vision_prompt_free(&rq->vp); /* the engine copied the rows */
    /* the generation may take long: the idle timeout is for slow clients */
    MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    if (!rq->stream) {
        const enum MHD_Result r = answer_whole(j);
        MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)s->timeout_s);
        job_unref(j);
        return r;
    }
    return k3_sse_respond(s, conn, stream_read, j, stream_free);
}

/* ---- prefill and decode apart (job.h's k3_srv_pd_*) ----
 *
 * vLLM's kv_transfer_params read and answered, for every API surface alike.
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
/* The proxy's credential on the request (decode side), or NULL. */
static const char *credential(k3_srv_job *j) {
    return MHD_lookup_connection_value(j->conn, MHD_HEADER_KIND, K3_PD_CREDENTIAL_HEADER);
}

/* The hold named by params, released on its prefill instance (a request that
 * will not pull it), when the params came from the proxy. */
static void release_named(k3_srv_job *j) { k3_pd_release_named(j->s->pd, j->rq.kv_transfer, credential(j)); }

bool k3_srv_pd_prepare(k3_srv_job *j, k3_srv_bad *e) {
    k3_srv_request *rq = &j->rq;
    json_t *kt = rq->kv_transfer;
    const bool decode = k3_pd_wants_remote_decode(kt), prefill = k3_pd_wants_remote_prefill(kt);
    if (!decode && !prefill) return true; /* no transfer asked for (vLLM's proxies send both false) */
    if (decode && prefill)
        return k3_srv_bad_set(e, 400, "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true");
    if (!j->s->pd)
        return k3_srv_bad_set(e, 400,
                              "kv_transfer_params: this server is not a prefill or decode instance (k3 serve --role "
                              "prefill|decode)");
    if (rq->n_prompts != 1 || rq->n != 1) {
        if (prefill) release_named(j);
        return k3_srv_bad_set(e, 400, "%s", K3_PD_NOT_SPLIT);
    }
    if (decode) {
        if (rq->stream) return k3_srv_bad_set(e, 400, "kv_transfer_params: do_remote_decode needs \"stream\": false");
        j->pd_prefill = true;
        return true;
    }
    if (rq->echo && rq->logprobs >= 0) {
        release_named(j);
        return k3_srv_bad_set(e, 400,
                              "kv_transfer_params: prompt logprobs (\"echo\" with \"logprobs\") are computed "
                              "where the prompt is, not on a decode instance");
    }
    k3_error err = {0};
    j->pull = k3_pd_pull_new(j->s->pd, kt, credential(j), rq->prompts[0], rq->n_prompt[0], &j->rp, &err);
    if (!j->pull) {
        if (err.status != K3_ERR_PERM) release_named(j);
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
