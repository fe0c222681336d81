/*
 * gen.c -- generation for the server: the engine thread and the two
 * generation routes (gen.h).
 *
 * Threads: one engine thread owns the engine and steps it; it copies each
 * output into the choice it belongs to (k3_req_output.user) under the job's
 * mutex and signals the job's condition variable. The HTTP thread of the
 * request waits on that variable (polling its socket every 100 ms, so a
 * client that hangs up has its requests cancelled within one step plus
 * 100 ms), turns new tokens into text and answers. A job is reference
 * counted: one reference for the HTTP side and one per submitted engine
 * request, dropped when the engine reports it finished, so neither side
 * frees what the other still uses.
 *
 * Text: generated tokens are decoded into a byte buffer (specials skipped
 * for completions; kept as their names for chat, where the reply parser
 * needs them); only whole UTF-8 characters are sent; stop strings are
 * searched over the whole unsent text, so a stop split over tokens is found,
 * and the longest unsent suffix that could still begin a stop string is held
 * back until the next token decides it. A stop string ends the request
 * (cancelled in the engine) and is never sent.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "server/gen.h"
#include "server/http.h"

#define MAX_N 16
#define MAX_STOPS 16
#define MAX_TOP 20

typedef struct choice {
    struct job *job;
    int index, prompt_index;
    uint64_t eid;
    bool submitted;
    /* written by the engine thread (under job->mu) */
    int32_t *toks;
    float *lps;
    k3_logprob *tops;
    size_t n_tok, cap;
    int n_top;
    float *plp;
    k3_logprob *ptop;
    int64_t n_plp;
    bool got_plp;
    bool finished;
    k3_finish_reason finish;
    int32_t stop_id;
    char error[256];
    int64_t n_prompt, n_cached, n_generated;
    double last_t;
    /* the HTTP side */
    size_t n_seen;      /* tokens decoded into text */
    k3_buf text;
    size_t emitted;     /* bytes of text sent */
    size_t lp_sent;     /* tokens whose logprobs were sent (stream) */
    bool stop_hit, done, role_sent, final_sent;
    size_t sent_reasoning, sent_content;
    k3_tool_stream ts;  /* tool calls streamed */
    int64_t n_out;      /* completion tokens counted */
} choice;

typedef struct job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    struct k3_server *s;
    int n;
    choice *ch;
    int n_prompts;
    int32_t **prompts;
    int64_t *n_prompt;
    bool chat, stream, include_usage, echo, thinking;
    bool tok_ids; /* return_tokens_as_token_ids: logprob tokens as "token_id:N" */
    int logprobs; /* -1 none, else top n */
    k3_stops stops;
    char id[64];
    long created;
    struct MHD_Connection *conn;
    k3_buf out;
    size_t out_pos;
    bool sent_done, echo_sent;
    k3_vision_prompt vp; /* a chat prompt's image rows and keys, until submitted */
} job;

static void choice_advance(struct job *j, struct choice *c);

/* ---- the engine thread ------------------------------------------------ */

static void job_free(job *j) {
    for (int i = 0; i < j->n; i++) {
        choice *c = &j->ch[i];
        free(c->toks);
        free(c->lps);
        free(c->tops);
        free(c->plp);
        free(c->ptop);
        k3_buf_free(&c->text);
        k3_tool_stream_free(&c->ts);
    }
    for (int i = 0; i < j->n_prompts; i++) free(j->prompts[i]);
    k3_vision_prompt_free(&j->vp);
    free(j->prompts);
    free(j->n_prompt);
    free(j->ch);
    k3_stops_free(&j->stops);
    k3_buf_free(&j->out);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

static void job_unref(job *j) {
    pthread_mutex_lock(&j->mu);
    const int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left == 0) job_free(j);
}

static bool grow(choice *c, size_t need) {
    if (need <= c->cap) return true;
    size_t cap = c->cap ? c->cap * 2 : 64;
    while (cap < need) cap *= 2;
    int32_t *t = realloc(c->toks, cap * sizeof *t);
    if (!t) return false;
    c->toks = t;
    float *l = realloc(c->lps, cap * sizeof *l);
    if (!l) return false;
    c->lps = l;
    if (c->n_top > 0) {
        k3_logprob *p = realloc(c->tops, cap * (size_t)c->n_top * sizeof *p);
        if (!p) return false;
        c->tops = p;
    }
    c->cap = cap;
    return true;
}

static void on_output(struct k3_server *s, const k3_req_output *o, double t) {
    choice *c = o->user;
    if (!c) return;
    job *j = c->job;
    pthread_mutex_lock(&j->mu);
    if (o->n_new > 0) {
        if (o->top && o->n_top > 0 && c->n_top == 0 && c->n_tok == 0) c->n_top = o->n_top;
        if (grow(c, c->n_tok + (size_t)o->n_new)) {
            for (int i = 0; i < o->n_new; i++) {
                c->toks[c->n_tok + (size_t)i] = o->tokens[i];
                c->lps[c->n_tok + (size_t)i] = o->logprobs ? o->logprobs[i] : NAN;
                if (c->n_top > 0)
                    for (int k = 0; k < c->n_top; k++)
                        c->tops[(c->n_tok + (size_t)i) * (size_t)c->n_top + (size_t)k] =
                            o->top && k < o->n_top ? o->top[(size_t)i * (size_t)o->n_top + (size_t)k]
                                                   : (k3_logprob){-1, -INFINITY};
            }
            c->n_tok += (size_t)o->n_new;
        } else if (!c->finished) {
            snprintf(c->error, sizeof c->error, "out of memory for the generated tokens");
            k3_engine_cancel(s->engine, c->eid);
        }
        if (c->last_t > 0) k3_metrics_observe(&s->metrics, K3_H_ITL, (t - c->last_t) / o->n_new);
        c->last_t = t;
    }
    if (o->n_prompt_logprobs > 0 && o->prompt_logprobs && !c->got_plp) {
        const int64_t n = o->n_prompt_logprobs;
        const int nt = o->n_top;
        c->plp = malloc((size_t)n * sizeof *c->plp);
        if (c->plp) memcpy(c->plp, o->prompt_logprobs, (size_t)n * sizeof *c->plp);
        if (o->prompt_top && nt > 0) {
            c->ptop = malloc((size_t)n * (size_t)nt * sizeof *c->ptop);
            if (c->ptop) memcpy(c->ptop, o->prompt_top, (size_t)n * (size_t)nt * sizeof *c->ptop);
        }
        c->n_plp = c->plp ? n : 0;
        if (nt > 0 && c->n_top == 0 && c->n_tok == 0) c->n_top = nt;
        c->got_plp = true;
    }
    c->n_prompt = o->n_prompt;
    c->n_cached = o->n_cached;
    c->n_generated = o->n_generated;
    bool fin = false;
    if (o->events & K3_EV_FINISHED) {
        c->finished = true;
        c->finish = o->finish;
        c->stop_id = o->stop_id;
        if (o->finish == K3_FINISH_ERROR && !c->error[0])
            snprintf(c->error, sizeof c->error, "%s", o->error ? o->error : "the engine failed this request");
        /* counted by the reason the client sees: the text is decoded now
         * (the HTTP thread may not have got to it), and a stop string in
         * it makes "stop" -- even when the engine reached max_tokens before
         * the cancel the stop string sent came */
        choice_advance(c->job, c);
        k3_metrics_finished(&s->metrics, c->stop_hit && o->finish != K3_FINISH_ERROR ? K3_FINISH_STOP : o->finish);
        fin = true;
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (fin) {
        k3_metrics *m = &s->metrics;
        if (o->t_first_token > 0) k3_metrics_observe(m, K3_H_TTFT, o->t_first_token - o->t_arrival);
        if (o->t_finished > 0) k3_metrics_observe(m, K3_H_E2E, o->t_finished - o->t_arrival);
        if (o->t_scheduled > 0) k3_metrics_observe(m, K3_H_QUEUE, o->t_scheduled - o->t_arrival);
        k3_metrics_observe(m, K3_H_PREFILL, o->prefill_s);
        k3_metrics_observe(m, K3_H_DECODE, o->decode_s);
        k3_metrics_observe(m, K3_H_PROMPT_TOKENS, (double)o->n_prompt);
        k3_metrics_observe(m, K3_H_GEN_TOKENS, (double)o->n_generated);
        job_unref(j);
    }
}

static void *engine_main(void *arg) {
    struct k3_server *s = arg;
    while (!atomic_load(&s->gen_quit) || k3_engine_has_work(s->engine)) {
        if (!k3_engine_has_work(s->engine)) {
            k3_engine_wait(s->engine, 0.1);
            continue;
        }
        k3_step_result res;
        k3_error err = {0};
        if (k3_engine_step(s->engine, &res, &err)) {
            pthread_mutex_lock(&s->fail_mu);
            s->failed = true;
            s->fail_err = err;
            pthread_mutex_unlock(&s->fail_mu);
            break;
        }
        if (res.n_tokens > 0) k3_metrics_observe(&s->metrics, K3_H_ITER_TOKENS, res.n_tokens);
        for (int i = 0; i < res.n_outputs; i++) on_output(s, &res.outputs[i], res.t);
    }
    return NULL;
}

k3_status k3_srv_gen_start(struct k3_server *s, k3_error *err) {
    atomic_store(&s->gen_quit, false);
    if (pthread_create(&s->eng_thread, NULL, engine_main, s))
        return k3_err(err, K3_ERR_NOMEM, "cannot start the engine thread");
    s->eng_started = true;
    return K3_OK;
}

void k3_srv_gen_stop(struct k3_server *s) {
    if (!s->eng_started) return;
    atomic_store(&s->gen_quit, true);
    pthread_join(s->eng_thread, NULL);
    s->eng_started = false;
}

void k3_srv_engine_stats(struct k3_server *s, k3_engine_stats *st) { k3_engine_get_stats(s->engine, st); }

int64_t k3_srv_max_model_len(struct k3_server *s) {
    if (!s->engine) return s->max_model_len;
    k3_engine_stats st;
    k3_srv_engine_stats(s, &st);
    return st.max_model_len;
}

bool k3_server_failed(k3_server *s, k3_error *err) {
    pthread_mutex_lock(&s->fail_mu);
    const bool f = s->failed;
    if (f && err) *err = s->fail_err;
    pthread_mutex_unlock(&s->fail_mu);
    return f;
}


/* ---- request parsing -------------------------------------------------- */

typedef struct {
    char msg[512];
    unsigned status;
} verr;

static bool bad(verr *e, unsigned status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool bad(verr *e, unsigned status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    e->status = status;
    return false;
}

/* A number field: absent/null keeps *out. */
static bool get_num(json_t *root, const char *key, double lo, double hi, double *out, verr *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_number(v)) return bad(e, 400, "\"%s\" must be a number", key);
    const double d = json_number_value(v);
    if (!(d >= lo && d <= hi)) return bad(e, 400, "\"%s\" is %g, not in [%g, %g]", key, d, lo, hi);
    *out = d;
    return true;
}

static bool get_int(json_t *root, const char *key, long long lo, long long hi, long long *out, verr *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_integer(v)) return bad(e, 400, "\"%s\" must be an integer", key);
    const long long d = json_integer_value(v);
    if (d < lo || d > hi) return bad(e, 400, "\"%s\" is %lld, not in [%lld, %lld]", key, d, lo, hi);
    *out = d;
    return true;
}

static bool get_bool(json_t *root, const char *key, bool *out, verr *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_boolean(v)) return bad(e, 400, "\"%s\" must be true or false", key);
    *out = json_is_true(v);
    return true;
}

static bool parse_stops(json_t *root, k3_stops *st, verr *e) {
    json_t *v = json_object_get(root, "stop");
    if (!v || json_is_null(v)) return true;
    const bool one = json_is_string(v);
    if (!one && !json_is_array(v)) return bad(e, 400, "\"stop\" must be a string or a list of strings");
    const size_t n = one ? 1 : json_array_size(v);
    if (n > MAX_STOPS) return bad(e, 400, "\"stop\" has %zu strings, more than %d", n, MAX_STOPS);
    st->s = calloc(n ? n : 1, sizeof *st->s);
    st->len = calloc(n ? n : 1, sizeof *st->len);
    if (!st->s || !st->len) return bad(e, 500, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *x = one ? v : json_array_get(v, i);
        if (!json_is_string(x)) return bad(e, 400, "\"stop\"[%zu] is not a string", i);
        if (json_string_length(x) == 0) continue;
        if (json_string_length(x) > 256) return bad(e, 400, "\"stop\"[%zu] is longer than 256 bytes", i);
        st->s[st->n] = strndup(json_string_value(x), json_string_length(x));
        if (!st->s[st->n]) return bad(e, 500, "out of memory");
        st->len[st->n++] = json_string_length(x);
    }
    return true;
}

static bool ids_from_array(struct k3_server *s, json_t *a, const char *what, int32_t **ids, int64_t *n, verr *e) {
    const size_t len = json_array_size(a);
    if (len == 0) return bad(e, 400, "%s is empty", what);
    *ids = malloc(len * sizeof **ids);
    if (!*ids) return bad(e, 500, "out of memory");
    const int32_t nv = k3_tokenizer_n_vocab(s->tok);
    for (size_t i = 0; i < len; i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= nv) {
            free(*ids);
            *ids = NULL;
            return bad(e, 400, "%s[%zu] is not a token id in 0..%d", what, i, nv - 1);
        }
        (*ids)[i] = (int32_t)json_integer_value(x);
    }
    *n = (int64_t)len;
    return true;
}

static bool ids_from_text(struct k3_server *s, json_t *str, const char *what, int32_t **ids, int64_t *n, verr *e) {
    size_t m = 0;
    k3_error err = {0};
    if (k3_tokenizer_encode(s->tok, json_string_value(str), json_string_length(str), ids, &m, &err))
        return bad(e, 400, "%s: %s", what, err.msg);
    if (m == 0) {
        free(*ids);
        *ids = NULL;
        return bad(e, 400, "%s encodes to no tokens", what);
    }
    *n = (int64_t)m;
    return true;
}

/* "prompt": a string, a list of strings, a list of ids, a list of id lists. */
static bool parse_prompts(struct k3_server *s, json_t *root, job *j, verr *e) {
    json_t *p = json_object_get(root, "prompt");
    if (!p) return bad(e, 400, "\"prompt\" is missing");
    size_t n = 1;
    bool list_of_lists = false;
    if (json_is_array(p)) {
        json_t *f = json_array_get(p, 0);
        if (!f) return bad(e, 400, "\"prompt\" is an empty list");
        if (json_is_string(f) || json_is_array(f)) {
            n = json_array_size(p);
            list_of_lists = true;
        }
    } else if (!json_is_string(p)) {
        return bad(e, 400, "\"prompt\" must be a string, a list of strings or a list of token ids");
    }
    if (n > MAX_N) return bad(e, 400, "\"prompt\" has %zu prompts, more than %d", n, MAX_N);
    j->prompts = calloc(n, sizeof *j->prompts);
    j->n_prompt = calloc(n, sizeof *j->n_prompt);
    if (!j->prompts || !j->n_prompt) return bad(e, 500, "out of memory");
    j->n_prompts = (int)n;
    for (size_t i = 0; i < n; i++) {
        json_t *x = list_of_lists ? json_array_get(p, i) : p;
        char what[32];
        snprintf(what, sizeof what, list_of_lists ? "prompt[%zu]" : "prompt", i);
        bool ok;
        if (json_is_string(x)) ok = ids_from_text(s, x, what, &j->prompts[i], &j->n_prompt[i], e);
        else if (json_is_array(x)) ok = ids_from_array(s, x, what, &j->prompts[i], &j->n_prompt[i], e);
        else ok = bad(e, 400, "%s must be a string or a list of token ids", what);
        if (!ok) return false;
    }
    return true;
}

static uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The think switch of a chat request: chat_template_kwargs.enable_thinking
 * or .thinking (K3's default: on). */
static bool chat_thinking(json_t *root, bool *out, verr *e) {
    *out = true;
    json_t *kw = json_object_get(root, "chat_template_kwargs");
    if (!kw || json_is_null(kw)) return true;
    if (!json_is_object(kw)) return bad(e, 400, "\"chat_template_kwargs\" must be an object");
    if (!get_bool(kw, "thinking", out, e)) return false;
    return get_bool(kw, "enable_thinking", out, e);
}

/* Whether any message has an image part (the encode then takes the tower's pool). */
static bool has_image(json_t *msgs) {
    size_t i, k;
    json_t *m, *part;
    json_array_foreach(msgs, i, m) {
        json_t *content = json_is_object(m) ? json_object_get(m, "content") : NULL;
        if (!json_is_array(content)) continue;
        json_array_foreach(content, k, part) {
            const char *type = json_is_object(part) ? json_string_value(json_object_get(part, "type")) : NULL;
            if (type && (!strcmp(type, "image_url") || !strcmp(type, "image"))) return true;
        }
    }
    return false;
}

k3_status k3_srv_encode_chat(struct k3_server *s, json_t *root, k3_vision_prompt *out, bool *thinking_out,
                             k3_error *err) {
    memset(out, 0, sizeof *out);
    verr e = {{0}, 0};
    bool thinking = true;
    if (!chat_thinking(root, &thinking, &e)) return k3_err(err, K3_ERR_ARG, "%s", e.msg);
    if (thinking_out) *thinking_out = thinking;
    json_t *msgs = json_object_get(root, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return k3_err(err, K3_ERR_ARG, "\"messages\" must be a non-empty list");
    json_t *tools = json_object_get(root, "tools");
    if (tools && !json_is_null(tools) && !json_is_array(tools))
        return k3_err(err, K3_ERR_ARG, "\"tools\" must be a list");
    json_t *tc = json_object_get(root, "tool_choice");
    const char *tool_choice = NULL;
    if (json_is_string(tc)) tool_choice = json_string_value(tc);
    else if (json_is_object(tc)) tool_choice = "required";
    else if (tc && !json_is_null(tc)) return k3_err(err, K3_ERR_ARG, "\"tool_choice\" must be a string or an object");
    json_t *kw = json_object_get(root, "chat_template_kwargs");
    json_t *effort = json_is_object(kw) ? json_object_get(kw, "thinking_effort") : NULL;
    if (!effort) effort = json_object_get(root, "reasoning_effort");
    json_t *rf = json_object_get(root, "response_format");
    char *mj = json_dumps(msgs, JSON_COMPACT), *tj = tools && json_is_array(tools) ? json_dumps(tools, JSON_COMPACT) : NULL;
    char *rj = json_is_object(rf) ? json_dumps(rf, JSON_COMPACT) : NULL;
    k3_chat_options co = {.add_generation_prompt = true,
                          .thinking = thinking,
                          .thinking_effort = json_is_string(effort) ? json_string_value(effort) : NULL,
                          .tool_choice = tool_choice,
                          .response_format = rj};
    /* image parts go through the tower (v NULL: refused for a text-only
     * model); one encode at a time, on the tower's own pool */
    const bool img = has_image(msgs);
    if (img) pthread_mutex_lock(&s->vision_mu);
    k3_status st = mj ? k3_vision_chat_encode_json(img ? s->vision : NULL, s->tok, img ? s->vision_pool : NULL, mj,
                                                   tj, &co, s->max_image_pixels, out, err)
                      : k3_err(err, K3_ERR_NOMEM, "out of memory");
    if (img) pthread_mutex_unlock(&s->vision_mu);
    free(mj);
    free(tj);
    free(rj);
    return st;
}

/* ---- text ------------------------------------------------------------- */


/* Decodes new tokens, finds stop strings. Called with j->mu held. */
static void choice_advance(job *j, choice *c) {
    struct k3_server *s = j->s;
    if (c->done) return;
    for (; c->n_seen < c->n_tok && !c->stop_hit; c->n_seen++) {
        const int32_t id = c->toks[c->n_seen];
        c->n_out++;
        /* the token that ended the request is not part of the text */
        if (c->finished && c->finish == K3_FINISH_STOP && c->n_seen + 1 == c->n_tok && id == c->stop_id) continue;
        size_t len = 0;
        const char *p = k3_tokenizer_token(s->tok, id, &len);
        if (!p) continue;
        if (k3_tokenizer_is_special(s->tok, id) && (!j->chat || k3_tokenizer_is_eos(s->tok, id))) continue;
        const size_t before = c->text.len;
        k3_buf_add(&c->text, p, len);
        if (j->stops.n) {
            /* a stop can begin in the held-back text, never in sent text */
            size_t sl = 0;
            const size_t from = c->emitted;
            const long at = k3_stops_find(&j->stops, c->text.p, c->text.len, from, &sl);
            (void)before;
            if (at >= 0) {
                c->text.len = (size_t)at;
                c->text.p[at] = 0;
                c->stop_hit = true;
                if (!c->finished) k3_engine_cancel(s->engine, c->eid);
            }
        }
    }
    if (c->stop_hit || (c->finished && c->n_seen == c->n_tok)) c->done = true;
}

/* Bytes of c->text that may be sent now. */
static size_t choice_sendable(job *j, choice *c) {
    if (c->done) return c->text.len;
    size_t lim = k3_utf8_complete(c->text.p, c->text.len);
    if (lim < c->emitted) return c->emitted;
    const size_t hold = k3_stops_holdback(&j->stops, c->text.p, lim, c->emitted);
    lim -= hold;
    if (j->chat) lim = k3_srv_chat_hold(c->text.p, c->emitted, lim);
    return lim < c->emitted ? c->emitted : lim;
}

size_t k3_srv_chat_hold(const char *t, size_t from, size_t lim) {
    /* a tag is decided at its <|sep|>: hold back an unfinished one */
    for (size_t i = lim; i-- > from;) {
        if (t[i] != '<') continue;
        if ((lim - i >= 8 && !strncmp(t + i, "<|open|>", 8)) || (lim - i >= 9 && !strncmp(t + i, "<|close|>", 9))) {
            if (!memmem(t + i, lim - i, "<|sep|>", 7)) lim = i;
            break;
        }
    }
    return lim;
}

void k3_tool_stream_free(k3_tool_stream *ts) {
    for (int i = 0; i < ts->n; i++) k3_buf_free(&ts->calls[i].sent);
    free(ts->calls);
    *ts = (k3_tool_stream){0};
}

k3_status k3_srv_tool_deltas(k3_tool_stream *ts, const k3_chat_reply *r, const k3_chat_partial_call *part, json_t *out,
                             k3_error *err) {
    json_t *tc = NULL;
    if (r->tool_calls_json && r->n_tool_calls > 0 && !(tc = json_loads(r->tool_calls_json, 0, NULL)))
        return k3_err(err, K3_ERR_NOMEM, "out of memory for the tool calls");
    const size_t nc = json_array_size(tc), total = nc + (part && part->name && part->args ? 1 : 0);
    k3_status st = K3_OK;
    for (size_t k = 0; k < total && !st; k++) {
        const char *name, *args;
        size_t alen;
        if (k < nc) {
            json_t *f = json_object_get(json_array_get(tc, k), "function"), *a = json_object_get(f, "arguments");
            name = json_string_value(json_object_get(f, "name"));
            args = json_string_value(a);
            alen = json_string_length(a);
        } else {
            name = part->name;
            args = part->args;
            alen = part->args_len;
        }
        if (!name || !args) {
            st = k3_err(err, K3_ERR_FORMAT, "tool call %zu has no name or arguments", k + 1);
            break;
        }
        if ((int)k >= ts->n) {
            if (ts->n == ts->cap) {
                const int cap = ts->cap ? ts->cap * 2 : 4;
                k3_tool_stream_call *nw = realloc(ts->calls, sizeof *nw * (size_t)cap);
                if (!nw) {
                    st = k3_err(err, K3_ERR_NOMEM, "out of memory for the tool calls");
                    break;
                }
                ts->calls = nw;
                ts->cap = cap;
            }
            k3_tool_stream_call *sc = &ts->calls[ts->n++];
            memset(sc, 0, sizeof *sc);
            k3_chat_new_call_id(sc->id);
            json_t *e = json_pack("{s:i,s:s,s:s,s:{s:o,s:s}}", "index", (int)k, "id", sc->id, "type", "function",
                                  "function", "name", k3_srv_jstr(name, strlen(name)), "arguments", "");
            if (!e || json_array_append_new(out, e)) st = k3_err(err, K3_ERR_NOMEM, "out of memory for a delta");
        }
        k3_tool_stream_call *sc = &ts->calls[k];
        if (sc->sent.len > alen || (sc->sent.len && memcmp(args, sc->sent.p, sc->sent.len)))
            st = k3_err(err, K3_ERR_FORMAT,
                        "tool call %zu (%s): the arguments sent so far are not a prefix of its arguments", k + 1, name);
        else if (alen > sc->sent.len) {
            json_t *e = json_pack("{s:i,s:{s:o}}", "index", (int)k, "function", "arguments",
                                  k3_srv_jstr(args + sc->sent.len, alen - sc->sent.len));
            k3_buf_add(&sc->sent, args + sc->sent.len, alen - sc->sent.len);
            if (!e || json_array_append_new(out, e) || sc->sent.oom)
                st = k3_err(err, K3_ERR_NOMEM, "out of memory for a delta");
        }
    }
    json_decref(tc);
    return st;
}

static const char *finish_str(const choice *c, bool tool_calls) {
    if (c->stop_hit) return "stop";
    switch (c->finish) {
    case K3_FINISH_STOP: return tool_calls ? "tool_calls" : "stop";
    case K3_FINISH_LENGTH: return "length";
    case K3_FINISH_CANCELLED: return "abort";
    default: return "error";
    }
}

static json_t *tok_str_raw(struct k3_server *s, int32_t id) {
    size_t len = 0;
    const char *p = k3_tokenizer_token(s->tok, id, &len);
    if (!p) return json_string("");
    return k3_srv_jstr(p, len);
}

static json_t *tok_name(job *j, int32_t id) {
    if (j->tok_ids) {
        char b[32];
        snprintf(b, sizeof b, "token_id:%d", id);
        return json_string(b);
    }
    return tok_str_raw(j->s, id);
}
#define tok_str(s, id) tok_name(j, id)

/* Legacy completions logprobs for tokens [a, b) of c (generated), appended
 * to the four arrays of lp; offset is the running text offset. */
static void completion_lp_gen(job *j, choice *c, size_t a, size_t b, json_t *lp, size_t *offset) {
    struct k3_server *s = j->s;
    json_t *toks = json_object_get(lp, "tokens"), *tl = json_object_get(lp, "token_logprobs"),
           *top = json_object_get(lp, "top_logprobs"), *off = json_object_get(lp, "text_offset");
    for (size_t i = a; i < b && i < c->n_tok; i++) {
        const int32_t id = c->toks[i];
        json_array_append_new(toks, tok_str(s, id));
        json_array_append_new(tl, isnan(c->lps[i]) ? json_null() : json_real(c->lps[i]));
        json_t *d = json_object();
        json_t *me = tok_str(s, id);
        if (me && !isnan(c->lps[i])) json_object_set_new(d, json_string_value(me), json_real(c->lps[i]));
        json_decref(me);
        for (int k = 0; k < c->n_top && k < j->logprobs; k++) {
            const k3_logprob *t = &c->tops[i * (size_t)c->n_top + (size_t)k];
            if (t->id < 0) continue;
            json_t *ts = tok_str(s, t->id);
            if (ts && !json_object_get(d, json_string_value(ts)))
                json_object_set_new(d, json_string_value(ts), json_real(t->logprob));
            json_decref(ts);
        }
        json_array_append_new(top, d);
        json_array_append_new(off, json_integer((json_int_t)*offset));
        size_t len = 0;
        if (!k3_tokenizer_is_special(s->tok, id)) k3_tokenizer_token(s->tok, id, &len);
        *offset += len;
    }
}

static json_t *completion_lp_new(void) {
    return json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

/* The echoed prompt's logprobs (first token: null). */
static void completion_lp_prompt(job *j, choice *c, json_t *lp, size_t *offset) {
    struct k3_server *s = j->s;
    const int32_t *ids = j->prompts[c->prompt_index];
    const int64_t n = j->n_prompt[c->prompt_index];
    json_t *toks = json_object_get(lp, "tokens"), *tl = json_object_get(lp, "token_logprobs"),
           *top = json_object_get(lp, "top_logprobs"), *off = json_object_get(lp, "text_offset");
    for (int64_t i = 0; i < n; i++) {
        json_array_append_new(toks, tok_str(s, ids[i]));
        const bool have = i >= 1 && i - 1 < c->n_plp;
        json_array_append_new(tl, have ? json_real(c->plp[i - 1]) : json_null());
        if (!have) {
            json_array_append_new(top, json_null());
        } else {
            json_t *d = json_object();
            json_t *me = tok_str(s, ids[i]);
            if (me) json_object_set_new(d, json_string_value(me), json_real(c->plp[i - 1]));
            json_decref(me);
            for (int k = 0; c->ptop && k < c->n_top && k < j->logprobs; k++) {
                const k3_logprob *t = &c->ptop[(size_t)(i - 1) * (size_t)c->n_top + (size_t)k];
                if (t->id < 0) continue;
                json_t *ts = tok_str(s, t->id);
                if (ts && !json_object_get(d, json_string_value(ts)))
                    json_object_set_new(d, json_string_value(ts), json_real(t->logprob));
                json_decref(ts);
            }
            json_array_append_new(top, d);
        }
        json_array_append_new(off, json_integer((json_int_t)*offset));
        size_t len = 0;
        if (!k3_tokenizer_is_special(s->tok, ids[i])) k3_tokenizer_token(s->tok, ids[i], &len);
        *offset += len;
    }
}

static json_t *bytes_of(struct k3_server *s, int32_t id) {
    size_t len = 0;
    const char *p = k3_tokenizer_token(s->tok, id, &len);
    json_t *a = json_array();
    for (size_t i = 0; p && i < len; i++) json_array_append_new(a, json_integer((unsigned char)p[i]));
    return a;
}

/* Chat logprobs content entries for tokens [a, b). */
static void chat_lp(job *j, choice *c, size_t a, size_t b, json_t *content) {
    struct k3_server *s = j->s;
    for (size_t i = a; i < b && i < c->n_tok; i++) {
        const int32_t id = c->toks[i];
        json_t *top = json_array();
        for (int k = 0; k < c->n_top && k < j->logprobs; k++) {
            const k3_logprob *t = &c->tops[i * (size_t)c->n_top + (size_t)k];
            if (t->id < 0) continue;
            json_array_append_new(top, json_pack("{s:o,s:f,s:o}", "token", tok_str(s, t->id), "logprob",
                                                 (double)t->logprob, "bytes", bytes_of(s, t->id)));
        }
        json_array_append_new(content,
                              json_pack("{s:o,s:o,s:o,s:o}", "token", tok_str(s, id), "logprob",
                                        isnan(c->lps[i]) ? json_null() : json_real(c->lps[i]), "bytes",
                                        bytes_of(s, id), "top_logprobs", top));
    }
}

static json_t *usage_of(job *j) {
    int64_t prompt = 0, cached = 0, out = 0;
    for (int p = 0; p < j->n_prompts; p++) {
        prompt += j->n_prompt[p];
        /* the first choice of each prompt tells how much of it was cached */
        for (int i = 0; i < j->n; i++)
            if (j->ch[i].prompt_index == p) {
                cached += j->ch[i].n_cached;
                break;
            }
    }
    for (int i = 0; i < j->n; i++) out += j->ch[i].n_out;
    return json_pack("{s:I,s:I,s:I,s:{s:I}}", "prompt_tokens", (json_int_t)prompt, "completion_tokens",
                     (json_int_t)out, "total_tokens", (json_int_t)(prompt + out), "prompt_tokens_details",
                     "cached_tokens", (json_int_t)cached);
}

json_t *k3_srv_chat_message(const char *text, size_t len, bool thinking, bool *tools, k3_error *err) {
    k3_chat_reply r;
    memset(&r, 0, sizeof r);
    *tools = false;
    if (k3_chat_parse_reply(text, len, thinking, &r, err)) return NULL;
    json_t *msg = json_pack("{s:s}", "role", "assistant");
    json_object_set_new(msg, "content", r.content ? k3_srv_jstr(r.content, strlen(r.content)) : json_null());
    if (r.reasoning) json_object_set_new(msg, "reasoning_content", k3_srv_jstr(r.reasoning, strlen(r.reasoning)));
    if (r.tool_calls_json && r.n_tool_calls > 0) {
        json_t *tc = json_loads(r.tool_calls_json, 0, NULL);
        if (tc) {
            json_object_set_new(msg, "tool_calls", tc);
            *tools = true;
        }
    }
    k3_chat_reply_free(&r);
    return msg;
}

/* ---- non-streamed answers --------------------------------------------- */

static void cancel_all(job *j) {
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].submitted && !j->ch[i].finished) k3_engine_cancel(j->s->engine, j->ch[i].eid);
}

/* 0: all choices done; 1: the client left or the server stops; 2: engine failed. */
static int wait_all(job *j) {
    struct k3_server *s = j->s;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        bool all = true;
        for (int i = 0; i < j->n; i++) {
            choice_advance(j, &j->ch[i]);
            all &= j->ch[i].done;
        }
        if (all) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        if (atomic_load(&s->stopping) || k3_srv_client_gone(j->conn)) {
            cancel_all(j);
            pthread_mutex_unlock(&j->mu);
            return 1;
        }
        if (k3_server_failed(s, NULL)) {
            pthread_mutex_unlock(&j->mu);
            return 2;
        }
    }
    pthread_mutex_unlock(&j->mu);
    return 0;
}

static enum MHD_Result answer_whole(job *j) {
    struct k3_server *s = j->s;
    struct MHD_Connection *conn = j->conn;
    const int w = wait_all(j);
    if (w == 1) return MHD_NO;
    if (w == 2) return k3_srv_error(s, conn, 503, "the engine has failed");
    json_t *choices = json_array();
    for (int i = 0; i < j->n; i++) {
        choice *c = &j->ch[i];
        if (c->finish == K3_FINISH_ERROR || c->error[0]) {
            json_decref(choices);
            return k3_srv_error(s, conn, 500, "generation failed: %s", c->error[0] ? c->error : "engine error");
        }
        json_t *ch;
        if (!j->chat) {
            json_t *text;
            json_t *lp = json_null();
            if (j->logprobs >= 0) {
                json_decref(lp);
                lp = completion_lp_new();
                size_t off = 0;
                if (j->echo) completion_lp_prompt(j, c, lp, &off);
                completion_lp_gen(j, c, 0, c->n_out < 0 ? 0 : (size_t)c->n_out, lp, &off);
            }
            if (j->echo) {
                char *pt = NULL;
                size_t pl = 0;
                k3_error err = {0};
                k3_tokenizer_decode(s->tok, j->prompts[c->prompt_index], (size_t)j->n_prompt[c->prompt_index],
                                    &pt, &pl, &err);
                k3_buf b = {0};
                k3_buf_add(&b, pt ? pt : "", pt ? pl : 0);
                k3_buf_add(&b, c->text.p ? c->text.p : "", c->text.len);
                text = k3_srv_jstr(b.p ? b.p : "", b.len);
                free(pt);
                k3_buf_free(&b);
            } else {
                text = k3_srv_jstr(c->text.p ? c->text.p : "", c->text.len);
            }
            ch = json_pack("{s:i,s:o,s:o,s:s}", "index", i, "text", text ? text : json_string(""), "logprobs", lp,
                           "finish_reason", finish_str(c, false));
        } else {
            k3_error err = {0};
            bool tools = false;
            json_t *msg = k3_srv_chat_message(c->text.p ? c->text.p : "", c->text.len, j->thinking, &tools, &err);
            if (!msg) {
                json_decref(choices);
                return k3_srv_error(s, conn, 500, "the model's reply cannot be parsed: %s", err.msg);
            }
            json_t *lp = json_null();
            if (j->logprobs >= 0) {
                json_decref(lp);
                json_t *content = json_array();
                chat_lp(j, c, 0, (size_t)c->n_out, content);
                lp = json_pack("{s:o}", "content", content);
            }
            ch = json_pack("{s:i,s:o,s:o,s:s}", "index", i, "message", msg, "logprobs", lp, "finish_reason",
                           finish_str(c, tools));
        }
        json_array_append_new(choices, ch);
    }
    json_t *resp = json_pack("{s:s,s:s,s:I,s:s,s:o,s:o}", "id", j->id, "object",
                             j->chat ? "chat.completion" : "text_completion", "created", (json_int_t)j->created,
                             "model", s->model, "choices", choices, "usage", usage_of(j));
    return k3_srv_json(s, conn, 200, resp);
}

/* ---- streamed answers -------------------------------------------------- */

static void sse(job *j, json_t *obj) {
    char *t = json_dumps(obj, JSON_COMPACT);
    json_decref(obj);
    if (!t) return;
    k3_buf_add(&j->out, "data: ", 6);
    k3_buf_add(&j->out, t, strlen(t));
    k3_buf_add(&j->out, "\n\n", 2);
    free(t);
}

static json_t *chunk(job *j, json_t *choices) {
    json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:o}", "id", j->id, "object",
                          j->chat ? "chat.completion.chunk" : "text_completion", "created", (json_int_t)j->created,
                          "model", j->s->model, "choices", choices);
    if (j->include_usage) json_object_set_new(o, "usage", json_null());
    return o;
}

static void sse_error(job *j, unsigned status, const char *msg) {
    json_t *m = k3_srv_jstr(msg, strlen(msg));
    sse(j, json_pack("{s:{s:o,s:s,s:n,s:i}}", "error", "message", m, "type",
                     status >= 500 ? "InternalServerError" : "BadRequestError", "param", "code", (json_int_t)status));
}

/* Adds the SSE events for everything new in choice c. j->mu held. */
static void stream_choice(job *j, int i) {
    struct k3_server *s = j->s;
    choice *c = &j->ch[i];
    if (c->final_sent) return;
    choice_advance(j, c);
    const size_t upto = choice_sendable(j, c);
    const size_t lp_upto = c->done ? (size_t)c->n_out : c->n_seen;
    if (!j->chat) {
        if (c->done && (c->finish == K3_FINISH_ERROR || c->error[0])) {
            sse_error(j, 500, c->error[0] ? c->error : "generation failed");
            c->final_sent = true;
            return;
        }
        const bool echo_now = j->echo && !c->role_sent;
        if (upto > c->emitted || echo_now || (j->logprobs >= 0 && lp_upto > c->lp_sent) || c->done) {
            k3_buf t = {0};
            if (echo_now) {
                char *pt = NULL;
                size_t pl = 0;
                if (!k3_tokenizer_decode(s->tok, j->prompts[c->prompt_index], (size_t)j->n_prompt[c->prompt_index],
                                         &pt, &pl, NULL))
                    k3_buf_add(&t, pt, pl);
                free(pt);
            }
            c->role_sent = true;
            if (upto > c->emitted) k3_buf_add(&t, c->text.p + c->emitted, upto - c->emitted);
            json_t *lp = json_null();
            if (j->logprobs >= 0 && lp_upto > c->lp_sent) {
                json_decref(lp);
                lp = completion_lp_new();
                size_t off = c->emitted;
                completion_lp_gen(j, c, c->lp_sent, lp_upto, lp, &off);
                c->lp_sent = lp_upto;
            }
            c->emitted = upto;
            json_t *ch = json_pack("{s:i,s:o,s:o,s:o}", "index", i, "text", k3_srv_jstr(t.p ? t.p : "", t.len),
                                   "logprobs", lp, "finish_reason",
                                   c->done ? json_string(finish_str(c, false)) : json_null());
            k3_buf_free(&t);
            sse(j, chunk(j, json_pack("[o]", ch)));
        }
        if (c->done) c->final_sent = true;
        return;
    }
    if (!c->role_sent) {
        c->role_sent = true;
        sse(j, chunk(j, json_pack("[{s:i,s:{s:s,s:s},s:n,s:n}]", "index", i, "delta", "role", "assistant", "content",
                                  "", "logprobs", "finish_reason")));
    }
    k3_chat_reply r;
    k3_error err = {0};
    bool tools = false;
    if (upto > c->emitted || c->done) {
        k3_chat_partial_call part;
        if (k3_chat_parse_reply_partial(c->text.p ? c->text.p : "", upto, j->thinking, &r, c->done ? NULL : &part,
                                        &err)) {
            if (c->done) {
                char msg[700];
                snprintf(msg, sizeof msg, "the model's reply cannot be parsed: %s", err.msg);
                sse_error(j, 500, msg);
                c->final_sent = true;
            }
            return;
        }
        const size_t rl = r.reasoning ? strlen(r.reasoning) : 0, cl = r.content ? strlen(r.content) : 0;
        if (rl > c->sent_reasoning) {
            sse(j, chunk(j, json_pack("[{s:i,s:{s:o},s:n,s:n}]", "index", i, "delta", "reasoning_content",
                                      k3_srv_jstr(r.reasoning + c->sent_reasoning, rl - c->sent_reasoning),
                                      "logprobs", "finish_reason")));
            c->sent_reasoning = rl;
        }
        if (cl > c->sent_content) {
            json_t *lp = json_null();
            if (j->logprobs >= 0 && lp_upto > c->lp_sent) {
                json_decref(lp);
                json_t *content = json_array();
                chat_lp(j, c, c->lp_sent, lp_upto, content);
                c->lp_sent = lp_upto;
                lp = json_pack("{s:o}", "content", content);
            }
            sse(j, chunk(j, json_pack("[{s:i,s:{s:o},s:o,s:n}]", "index", i, "delta", "content",
                                      k3_srv_jstr(r.content + c->sent_content, cl - c->sent_content), "logprobs", lp,
                                      "finish_reason")));
            c->sent_content = cl;
        }
        /* tool calls as they are generated: a header per call, then its argument fragments */
        json_t *deltas = json_array();
        k3_status tst = deltas ? k3_srv_tool_deltas(&c->ts, &r, c->done ? NULL : &part, deltas, &err)
                               : k3_err(&err, K3_ERR_NOMEM, "out of memory");
        size_t k;
        json_t *v;
        json_array_foreach(deltas, k, v) {
            json_incref(v);
            sse(j, chunk(j, json_pack("[{s:i,s:{s:[o]},s:n,s:n}]", "index", i, "delta", "tool_calls", v, "logprobs",
                                      "finish_reason")));
        }
        json_decref(deltas);
        if (!c->done) k3_chat_partial_call_free(&part);
        tools = r.tool_calls_json && r.n_tool_calls > 0;
        if (tst) {
            char msg[700];
            snprintf(msg, sizeof msg, "the model's tool calls cannot be streamed: %s", err.msg);
            sse_error(j, 500, msg);
            if (!c->done) cancel_all(j);
            c->final_sent = true;
            k3_chat_reply_free(&r);
            return;
        }
        k3_chat_reply_free(&r);
        c->emitted = upto;
    }
    if (c->done) {
        if (c->finish == K3_FINISH_ERROR || c->error[0]) {
            sse_error(j, 500, c->error[0] ? c->error : "generation failed");
        } else {
            sse(j, chunk(j, json_pack("[{s:i,s:{},s:n,s:s}]", "index", i, "delta", "logprobs", "finish_reason",
                                      finish_str(c, tools))));
        }
        c->final_sent = true;
    }
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    job *j = cls;
    struct k3_server *s = j->s;
    for (;;) {
        if (j->out_pos < j->out.len) {
            size_t n = j->out.len - j->out_pos;
            if (n > max) n = max;
            memcpy(buf, j->out.p + j->out_pos, n);
            j->out_pos += n;
            if (j->out_pos == j->out.len) j->out_pos = j->out.len = 0;
            return (ssize_t)n;
        }
        if (j->sent_done) return MHD_CONTENT_READER_END_OF_STREAM;
        pthread_mutex_lock(&j->mu);
        bool all = true;
        for (int i = 0; i < j->n; i++) {
            stream_choice(j, i);
            all &= j->ch[i].final_sent;
        }
        if (all) {
            if (j->include_usage) {
                json_t *u = chunk(j, json_array());
                json_object_set_new(u, "usage", usage_of(j));
                sse(j, u);
            }
            k3_buf_add(&j->out, "data: [DONE]\n\n", 14);
            j->sent_done = true;
            /* generation is over: a client that stops reading is dropped again */
            MHD_set_connection_option(j->conn, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)s->timeout_s);
        }
        if (j->out.len == 0 && !j->sent_done) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
            pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        }
        pthread_mutex_unlock(&j->mu);
        if (j->out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (j->out.len == 0 && !j->sent_done &&
            (atomic_load(&s->stopping) || k3_server_failed(s, NULL) || k3_srv_client_gone(j->conn))) {
            pthread_mutex_lock(&j->mu);
            cancel_all(j);
            pthread_mutex_unlock(&j->mu);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
    }
}

static void stream_free(void *cls) {
    job *j = cls;
    pthread_mutex_lock(&j->mu);
    cancel_all(j);
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
}

/* ---- the route -------------------------------------------------------- */

static enum MHD_Result fail_job(job *j, struct MHD_Connection *conn, unsigned status, const char *msg) {
    struct k3_server *s = j->s;
    pthread_mutex_lock(&j->mu);
    cancel_all(j);
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
    return k3_srv_error(s, conn, status, "%s", msg);
}

enum MHD_Result k3_srv_generate(struct k3_server *s, struct MHD_Connection *conn, json_t *root, bool chat) {
    if (k3_server_failed(s, NULL)) return k3_srv_error(s, conn, 503, "the engine has failed");
    job *j = calloc(1, sizeof *j);
    if (!j) return k3_srv_error(s, conn, 500, "out of memory");
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->refs = 1;
    j->s = s;
    j->chat = chat;
    j->conn = conn;
    j->logprobs = -1;
    j->created = (long)time(NULL);
    const uint64_t rid = atomic_fetch_add(&s->next_id, 1);
    snprintf(j->id, sizeof j->id, "%s-%016llx", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)mix64(rid ^ ((uint64_t)j->created << 20)));

    verr e = {{0}, 400};
    const int64_t mml = k3_srv_max_model_len(s);
    double temperature = 1.0, top_p = 1.0, min_p = 0.0, rep = 1.0;
    long long top_k = 0, n = 1, seed = -1, max_tokens = -1, min_tokens = 0, logprobs = -1;
    bool stream = false, ignore_eos = false, echo = false;
    bool ok = get_num(root, "temperature", 0, 2, &temperature, &e) && get_num(root, "top_p", 1e-9, 1, &top_p, &e) &&
              get_num(root, "min_p", 0, 1, &min_p, &e) && get_num(root, "repetition_penalty", 1e-6, 100, &rep, &e) &&
              get_int(root, "top_k", -1, 1 << 30, &top_k, &e) && get_int(root, "n", 1, MAX_N, &n, &e) &&
              get_int(root, "seed", INT64_MIN, INT64_MAX, &seed, &e) &&
              get_int(root, "max_tokens", 0, 1 << 30, &max_tokens, &e) &&
              get_int(root, "min_tokens", 0, 1 << 30, &min_tokens, &e) && get_bool(root, "stream", &stream, &e) &&
              get_bool(root, "ignore_eos", &ignore_eos, &e) && parse_stops(root, &j->stops, &e) &&
              get_bool(root, "return_tokens_as_token_ids", &j->tok_ids, &e);
    if (ok && chat) ok = get_int(root, "max_completion_tokens", 0, 1 << 30, &max_tokens, &e);
    /* fields k3 does not implement are refused, not ignored */
    static const char *zero_only[] = {"presence_penalty", "frequency_penalty"};
    for (int k = 0; ok && k < 2; k++) {
        json_t *v = json_object_get(root, zero_only[k]);
        if (v && !json_is_null(v) && (!json_is_number(v) || json_number_value(v) != 0.0))
            ok = bad(&e, 400, "\"%s\" is not supported (use repetition_penalty)", zero_only[k]);
    }
    json_t *lb = json_object_get(root, "logit_bias"), *bo = json_object_get(root, "best_of"),
           *sfx = json_object_get(root, "suffix");
    if (ok && lb && !json_is_null(lb) && !(json_is_object(lb) && json_object_size(lb) == 0))
        ok = bad(&e, 400, "\"logit_bias\" is not supported");
    if (ok && bo && !json_is_null(bo) && !(json_is_integer(bo) && json_integer_value(bo) <= n))
        ok = bad(&e, 400, "\"best_of\" is not supported");
    if (ok && sfx && !json_is_null(sfx)) ok = bad(&e, 400, "\"suffix\" is not supported");
    if (ok && !chat) ok = get_bool(root, "echo", &echo, &e) && get_int(root, "logprobs", 0, MAX_TOP, &logprobs, &e);
    if (ok && chat) {
        bool want = false;
        long long top = 0;
        ok = get_bool(root, "logprobs", &want, &e) && get_int(root, "top_logprobs", 0, MAX_TOP, &top, &e);
        if (ok && want) logprobs = top;
        if (ok && json_object_get(root, "top_logprobs") && !want && !json_is_null(json_object_get(root, "top_logprobs")))
            ok = bad(&e, 400, "\"top_logprobs\" needs \"logprobs\": true");
    }
    json_t *so = json_object_get(root, "stream_options");
    if (ok && so && !json_is_null(so)) {
        if (!json_is_object(so)) ok = bad(&e, 400, "\"stream_options\" must be an object");
        else if (!stream) ok = bad(&e, 400, "\"stream_options\" is only allowed with \"stream\": true");
        else ok = get_bool(so, "include_usage", &j->include_usage, &e);
    }
    if (ok && chat) {
        k3_error err = {0};
        if (k3_srv_encode_chat(s, root, &j->vp, &j->thinking, &err)) {
            ok = bad(&e, err.status == K3_ERR_NOMEM ? 500 : 400, "%s", err.msg);
        } else if (!(j->prompts = calloc(1, sizeof *j->prompts)) || !(j->n_prompt = calloc(1, sizeof *j->n_prompt))) {
            ok = bad(&e, 500, "out of memory");
        } else {
            j->prompts[0] = j->vp.ids; /* the job owns the ids now */
            j->n_prompt[0] = (int64_t)j->vp.n_ids;
            j->vp.ids = NULL;
            j->n_prompts = 1;
        }
    } else if (ok) {
        ok = parse_prompts(s, root, j, &e);
    }
    /* stop_token_ids (a vLLM extra) */
    int32_t stop_ids[MAX_STOPS];
    int n_stop_ids = 0;
    json_t *sti = json_object_get(root, "stop_token_ids");
    if (ok && sti && !json_is_null(sti)) {
        if (!json_is_array(sti) || json_array_size(sti) > MAX_STOPS)
            ok = bad(&e, 400, "\"stop_token_ids\" must be a list of at most %d ids", MAX_STOPS);
        for (size_t i = 0; ok && i < json_array_size(sti); i++) {
            json_t *x = json_array_get(sti, i);
            if (!json_is_integer(x) || json_integer_value(x) < 0 ||
                json_integer_value(x) >= k3_tokenizer_n_vocab(s->tok))
                ok = bad(&e, 400, "\"stop_token_ids\"[%zu] is not a token id", i);
            else stop_ids[n_stop_ids++] = (int32_t)json_integer_value(x);
        }
    }
    if (ok && j->n_prompts * n > MAX_N)
        ok = bad(&e, 400, "%d prompts x n = %lld choices, more than %d", j->n_prompts, n, MAX_N);
    if (!ok) {
        job_unref(j);
        return k3_srv_error(s, conn, e.status, "%s", e.msg);
    }
    j->stream = stream;
    j->echo = echo;
    j->logprobs = (int)logprobs;
    if (echo && stream && logprobs >= 0) {
        job_unref(j);
        return k3_srv_error(s, conn, 400, "\"echo\" with \"logprobs\" is not supported when streaming");
    }
    j->n = j->n_prompts * (int)n;
    j->ch = calloc((size_t)j->n, sizeof *j->ch);
    if (!j->ch) {
        job_unref(j);
        return k3_srv_error(s, conn, 500, "out of memory");
    }
    const uint64_t base_seed = seed >= 0 || json_is_integer(json_object_get(root, "seed"))
                                   ? (uint64_t)seed
                                   : mix64(rid * 0x2545F4914F6CDD1Dull ^ (uint64_t)time(NULL));
    for (int i = 0; i < j->n; i++) {
        choice *c = &j->ch[i];
        c->job = j;
        c->index = i;
        c->prompt_index = i / (int)n;
        c->stop_id = -1;
        const int64_t np = j->n_prompt[c->prompt_index];
        long long mt = max_tokens;
        if (mt < 0) mt = chat ? (mml > np ? mml - np : 0) : 16;
        if (np > mml) {
            char msg[256];
            snprintf(msg, sizeof msg,
                     "the prompt has %lld tokens, more than this model's maximum context length of %lld tokens",
                     (long long)np, (long long)mml);
            return fail_job(j, conn, 400, msg);
        }
        k3_request_params p = {
            .prompt = j->prompts[c->prompt_index],
            .n_prompt = np,
            .sampling = {.temperature = (float)temperature,
                         .top_k = top_k < 0 ? 0 : (int32_t)top_k,
                         .top_p = (float)top_p,
                         .min_p = (float)min_p,
                         .repeat_penalty = (float)rep,
                         .repeat_last_n = 0,
                         .seed = base_seed + (uint64_t)(i % (int)n)},
            .max_tokens = (int32_t)mt,
            .min_tokens = (int32_t)min_tokens,
            .stop_ids = n_stop_ids ? stop_ids : NULL,
            .n_stop_ids = n_stop_ids,
            .ignore_eos = ignore_eos,
            .logprobs = logprobs >= 0 ? (int32_t)logprobs : -1,
            .prompt_logprobs = echo && logprobs >= 0 ? (int32_t)logprobs : -1,
            .user = c,
            .embeds = j->vp.n_images ? (const float *const *)j->vp.embeds : NULL,
            .extra_keys = j->vp.n_images ? j->vp.keys : NULL,
        };
        k3_error err = {0};
        pthread_mutex_lock(&j->mu);
        j->refs++; /* the engine's reference, dropped when it reports the end */
        pthread_mutex_unlock(&j->mu);
        const k3_status st = k3_engine_submit(s->engine, &p, &c->eid, &err);
        if (st) {
            pthread_mutex_lock(&j->mu);
            j->refs--;
            pthread_mutex_unlock(&j->mu);
            return fail_job(j, conn, st == K3_ERR_BUSY ? 503 : st == K3_ERR_NOMEM ? 500 : 400, err.msg);
        }
        pthread_mutex_lock(&j->mu);
        c->submitted = true;
        pthread_mutex_unlock(&j->mu);
    }
    k3_vision_prompt_free(&j->vp); /* the engine copied the rows */
    /* the generation may take long: the idle timeout is for slow clients */
    MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    if (!stream) {
        const enum MHD_Result r = answer_whole(j);
        MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)s->timeout_s);
        job_unref(j);
        return r;
    }
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, stream_read, j,
                                                                  stream_free);
    if (!resp) return fail_job(j, conn, 500, "out of memory for the stream");
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    MHD_add_response_header(resp, "Connection", "close");
    pthread_mutex_lock(&s->metrics.mu);
    s->metrics.http_requests++;
    pthread_mutex_unlock(&s->metrics.mu);
    const enum MHD_Result r = MHD_queue_response(conn, 200, resp);
    MHD_destroy_response(resp);
    return r;
}
