/*
 * engine_loop.c -- the server's engine thread (engine_loop.h).
 *
 * One thread owns the engine and steps it; for every output of a step it
 * appends the new tokens, logprobs and prompt logprobs to the engine
 * request's k3_srv_seq under its group's mutex and signals the group. At
 * the finished event the group's on_finish gives the reason the client
 * sees, the request is counted and its latencies observed, and the
 * engine's reference to the group is dropped. A step that fails ends the
 * loop: every request in flight ends with the engine's message (fail_all),
 * the server reads as failed, and nothing more is submitted.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "server/engine_loop.h"

void k3_srv_group_init(k3_srv_group *g, k3_finish_reason (*on_finish)(k3_srv_group *, k3_srv_seq *),
                       void (*destroy)(k3_srv_group *)) {
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->refs = 1;
    g->on_finish = on_finish;
    g->destroy = destroy;
}

void k3_srv_group_unref(k3_srv_group *g) {
    pthread_mutex_lock(&g->mu);
    const int left = --g->refs;
    pthread_mutex_unlock(&g->mu);
    if (left == 0) {
        pthread_mutex_destroy(&g->mu);
        pthread_cond_destroy(&g->cv);
        g->destroy(g);
    }
}

void k3_srv_seq_free(k3_srv_seq *q) {
    free(q->toks);
    free(q->lps);
    free(q->tops);
    free(q->plp);
    free(q->ptop);
}

static void live_unlink(struct k3_server *s, k3_srv_seq *q) {
    if (q->live_prev) q->live_prev->live_next = q->live_next;
    else if (s->live == q) s->live = q->live_next;
    if (q->live_next) q->live_next->live_prev = q->live_prev;
    q->live_prev = q->live_next = NULL;
}

k3_status k3_srv_submit(struct k3_server *s, k3_srv_seq *q, k3_request_params *p, k3_error *err) {
    k3_srv_group *g = q->group;
    p->user = q;
    q->err_status = 500;
    pthread_mutex_lock(&g->mu);
    g->refs++; /* the engine's reference, dropped when it reports the end */
    pthread_mutex_unlock(&g->mu);
    k3_status st;
    pthread_mutex_lock(&s->live_mu);
    if (s->live_closed) {
        st = k3_err(err, K3_ERR_IO, "the engine has failed");
    } else {
        q->number = s->n_submitted + 1;
        st = k3_engine_submit(s->engine, p, &q->eid, err);
        if (!st) {
            /* in the list before the engine thread can report its end (which
             * takes live_mu to unlink it) */
            s->n_submitted++;
            q->live_next = s->live;
            if (s->live) s->live->live_prev = q;
            s->live = q;
        }
    }
    pthread_mutex_unlock(&s->live_mu);
    pthread_mutex_lock(&g->mu);
    if (st) g->refs--;
    else q->submitted = true;
    pthread_mutex_unlock(&g->mu);
    return st;
}

void k3_srv_cancel(struct k3_server *s, k3_srv_seq *q) {
    if (!q->submitted || q->finished) return;
    q->cancelled = true;
    k3_engine_cancel(s->engine, q->eid);
}

void k3_srv_cancel_all(struct k3_server *s) {
    /* a group lives while one of its requests is in the list (the engine's
     * reference), so its mutex may be taken here (live_mu, then a group's
     * mu: nothing takes them the other way round) */
    pthread_mutex_lock(&s->live_mu);
    for (k3_srv_seq *q = s->live; q; q = q->live_next) {
        k3_srv_group *g = q->group;
        pthread_mutex_lock(&g->mu);
        if (!q->finished && !q->cancelled) q->server_cut = true;
        if (!s->live_closed) k3_engine_cancel(s->engine, q->eid);
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
    }
    pthread_mutex_unlock(&s->live_mu);
}

const char *k3_srv_ending(struct k3_server *s, char *buf, size_t cap) {
    k3_error e = {0};
    if (k3_server_failed(s, &e)) {
        snprintf(buf, cap, "the engine failed: %.250s", e.msg);
        return buf;
    }
    if (k3_http_phase(s->http) == K3_HTTP_ENDING) {
        snprintf(buf, cap, "%s", k3_http_end_msg(s->http));
        return buf;
    }
    return NULL;
}

static bool grow(k3_srv_seq *q, size_t need) {
    if (need <= q->cap) return true;
    size_t cap = q->cap ? q->cap * 2 : 64;
    while (cap < need) cap *= 2;
    int32_t *t = realloc(q->toks, cap * sizeof *t);
    if (!t) return false;
    q->toks = t;
    float *l = realloc(q->lps, cap * sizeof *l);
    if (!l) return false;
    q->lps = l;
    if (q->n_top > 0) {
        k3_logprob *p = realloc(q->tops, cap * (size_t)q->n_top * sizeof *p);
        if (!p) return false;
        q->tops = p;
    }
    q->cap = cap;
    return true;
}

static void on_output(struct k3_server *s, const k3_req_output *o, double t) {
    k3_srv_seq *q = o->user;
    if (!q) return;
    k3_srv_group *g = q->group;
    pthread_mutex_lock(&g->mu);
    /* the prompt counts once its prefill is done: at the first token, or at
     * the end of a request that generates none */
    if ((o->n_new > 0 && q->n_tok == 0) ||
        ((o->events & K3_EV_FINISHED) && q->n_tok == 0 && o->n_new == 0 &&
         (o->finish == K3_FINISH_LENGTH || o->finish == K3_FINISH_STOP)))
        k3_metrics_prompt(&s->metrics, o->n_prompt, o->n_cached, o->n_disk);
    if (o->n_new > 0) {
        if (o->top && o->n_top > 0 && q->n_top == 0 && q->n_tok == 0) q->n_top = o->n_top;
        if (grow(q, q->n_tok + (size_t)o->n_new)) {
            for (int i = 0; i < o->n_new; i++) {
                q->toks[q->n_tok + (size_t)i] = o->tokens[i];
                q->lps[q->n_tok + (size_t)i] = o->logprobs ? o->logprobs[i] : NAN;
                if (q->n_top > 0)
                    for (int k = 0; k < q->n_top; k++)
                        q->tops[(q->n_tok + (size_t)i) * (size_t)q->n_top + (size_t)k] = o->top && k < o->n_top
                            ? o->top[(size_t)i * (size_t)o->n_top + (size_t)k]
                            : (k3_logprob){-1, -INFINITY};
            }
            q->n_tok += (size_t)o->n_new;
        } else if (!q->finished) {
            snprintf(q->error, sizeof q->error, "out of memory for the generated tokens");
            k3_engine_cancel(s->engine, q->eid);
        }
        if (s->test_fail_request && q->number == s->test_fail_request && !q->finished && !q->error[0]) {
            snprintf(q->error, sizeof q->error, "test hook: engine request %lld failed alone", (long long)q->number);
            k3_engine_cancel(s->engine, q->eid);
        }
        if (q->last_t > 0) k3_metrics_observe(&s->metrics, K3_H_ITL, (t - q->last_t) / o->n_new);
        q->last_t = t;
    }
    if (o->n_prompt_logprobs > 0 && o->prompt_logprobs && !q->got_plp) {
        const int64_t n = o->n_prompt_logprobs;
        const int nt = o->n_top;
        q->plp = malloc((size_t)n * sizeof *q->plp);
        if (q->plp) memcpy(q->plp, o->prompt_logprobs, (size_t)n * sizeof *q->plp);
        if (o->prompt_top && nt > 0) {
            q->ptop = malloc((size_t)n * (size_t)nt * sizeof *q->ptop);
            if (q->ptop) memcpy(q->ptop, o->prompt_top, (size_t)n * (size_t)nt * sizeof *q->ptop);
        }
        q->n_plp = q->plp ? n : 0;
        if (nt > 0 && q->n_top == 0 && q->n_tok == 0) q->n_top = nt;
        q->got_plp = true;
    }
    q->n_prompt = o->n_prompt;
    q->n_cached = o->n_cached;
    q->n_generated = o->n_generated;
    bool fin = false;
    if (o->events & K3_EV_FINISHED) {
        q->finished = true;
        q->finish = o->finish;
        q->stop_id = o->stop_id;
        if (o->transfer_s > 0) {
            q->pd_queue_s = o->t_scheduled > 0 ? o->t_scheduled - o->t_arrival : 0;
            q->pd_transfer_s = o->transfer_s;
            q->pd_first_step_s = o->first_step_s;
        }
        if (o->finish == K3_FINISH_ERROR && !q->error[0])
            snprintf(q->error, sizeof q->error, "%s", o->error ? o->error : "the engine failed this request");
        if (o->finish == K3_FINISH_CANCELLED && q->server_cut) {
            /* cut by the server's ending, not finished: an error the client sees as one */
            q->finish = K3_FINISH_ERROR;
            q->err_status = 503;
            const char *why = k3_http_end_msg(s->http);
            snprintf(q->error, sizeof q->error, "%s", why && why[0] ? why : "the server is shutting down");
        }
        /* counted by the reason the client sees (the group decodes the
         * text now: the HTTP thread may not have got to it), with the
         * request's histograms, before the client can have its answer */
        k3_metrics_request_done(&s->metrics, g->on_finish(g, q), o);
        fin = true;
    }
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    if (fin) {
        pthread_mutex_lock(&s->live_mu);
        live_unlink(s, q);
        pthread_mutex_unlock(&s->live_mu);
        k3_srv_group_unref(g);
    }
}

/* The engine failed: every request in flight ends with its message (a
 * 503: the server, not the request, failed), and the engine's references go. */
static void fail_all(struct k3_server *s, const k3_error *err) {
    pthread_mutex_lock(&s->fail_mu);
    s->failed = true;
    s->fail_err = *err;
    pthread_mutex_unlock(&s->fail_mu);
    pthread_mutex_lock(&s->live_mu);
    s->live_closed = true;
    k3_srv_seq *q = s->live;
    s->live = NULL;
    pthread_mutex_unlock(&s->live_mu);
    while (q) {
        k3_srv_seq *next = q->live_next;
        k3_srv_group *g = q->group;
        pthread_mutex_lock(&g->mu);
        q->live_prev = q->live_next = NULL;
        if (!q->finished) {
            q->finished = true;
            q->finish = K3_FINISH_ERROR;
            q->err_status = 503;
            snprintf(q->error, sizeof q->error, "the engine failed: %.230s", err->msg);
            k3_metrics_finished(&s->metrics, K3_FINISH_ERROR);
        }
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        k3_srv_group_unref(g);
        q = next;
    }
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Whether every seat of the batch is taken (the test hook counts only such
 * steps, so its failure finds every request of a test running whatever the
 * machine's load). */
static bool batch_full(struct k3_server *s) {
    k3_engine_stats st;
    k3_engine_get_stats(s->engine, &st);
    return st.n_running >= st.max_num_seqs;
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
        atomic_store(&s->step_t0_ns, (long long)now_ns());
        k3_status st;
        if (s->test_fail_step && batch_full(s) && ++s->n_steps == s->test_fail_step)
            st = k3_err(&err, K3_ERR_IO, "test hook: engine step %lld failed", (long long)s->n_steps);
        else st = k3_engine_step(s->engine, &res, &err);
        atomic_store(&s->step_t0_ns, 0);
        if (st) {
            fail_all(s, &err);
            break;
        }
        if (res.n_tokens > 0) k3_metrics_observe(&s->metrics, K3_H_ITER_TOKENS, res.n_tokens);
        for (int i = 0; i < res.n_outputs; i++) on_output(s, &res.outputs[i], res.t);
    }
    return NULL;
}

double k3_srv_step_seconds(struct k3_server *s) {
    const long long t0 = atomic_load(&s->step_t0_ns);
    return t0 ? (double)(now_ns() - t0) * 1e-9 : 0.0;
}

k3_status k3_srv_engine_start(struct k3_server *s, k3_error *err) {
    atomic_store(&s->gen_quit, false);
    if (pthread_create(&s->eng_thread, NULL, engine_main, s))
        return k3_err(err, K3_ERR_NOMEM, "cannot start the engine thread");
    s->eng_started = true;
    return K3_OK;
}

void k3_srv_engine_stop(struct k3_server *s) {
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
