/*
 * state.h -- the server's state, shared by every file of src/server. Only
 * the struct: the daemon (server.c) finds a request's row in the routing
 * table (routes.c); a generation route is an API surface (api_NAME.c) that
 * parses the request table (request.c) and answers through the generation
 * job (job.c), which submits through the engine thread (engine_loop.c) and
 * streams through sse.c; every answer goes out through http.c.
 */
#ifndef K3_SERVER_STATE_H
#define K3_SERVER_STATE_H

#include <microhttpd.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>

#include "http/http.h"
#include "k3.h"
#include "server/metrics.h"
#include "server/text.h"

typedef struct k3_srv_seq k3_srv_seq;

struct k3_server {
    /* the HTTP layer every endpoint shares (src/http): connections, their
     * limits and deadlines, what is decided before the body, CORS, the key,
     * the phases of a shutdown (k3_http_phase, k3_http_end_msg) */
    struct k3_http *http;
    char *model, *model_label, *version;
    bool metrics_key; /* /metrics needs the key */
    const k3_tokenizer *tok;
    k3_engine *engine;
    int64_t max_model_len;
    int timeout_s; /* the idle timeout, restored after a generation */
    double step_timeout_s;
    long created;
    k3_metrics metrics;
    atomic_bool stopping; /* k3_server_stop: waiting handlers cut their requests */
    /* the engine thread (engine_loop.c) */
    pthread_t eng_thread;
    bool eng_started;
    atomic_bool gen_quit;
    pthread_mutex_t fail_mu;
    bool failed;
    k3_error fail_err;
    /* engine requests submitted and not yet reported finished, under
     * live_mu: ended with an error if the engine fails */
    pthread_mutex_t live_mu;
    k3_srv_seq *live;
    bool live_closed;        /* the engine failed: nothing more is submitted */
    atomic_llong step_t0_ns; /* when the step in progress began (0: none) */
    int64_t n_steps, n_submitted;
    int64_t test_fail_step, test_fail_request;
    /* images in chat (images.c): the tower or NULL, its pool; the budgets of
     * one request; the queue of requests whose images wait for the pool (one
     * at a time, first come first served), under images_mu */
    const k3_vision *vision;
    k3_pool *vision_pool;
    int64_t max_image_pixels, max_request_image_pixels, max_request_image_tokens;
    pthread_mutex_t images_mu;
    pthread_cond_t images_cv;
    uint64_t images_next, images_serving;  /* tickets: taken, being served */
    int64_t images_waiting, images_pixels; /* requests waiting; pixels being decoded */
    /* prefill and decode apart: the transfer agent, or NULL (src/pd) */
    struct k3_pd *pd;
    /* the prefix cache's salt per API key (--prefix-cache-per-key); the KV events' publisher or NULL */
    bool prefix_cache_per_key;
    struct k3_kv_events *kv_events;
    /* the Responses API's stored responses (store.h; api_responses.c) */
    struct k3_srv_store *responses;
    /* the chat page at / is off (--no-ui) */
    bool no_ui;
    /* structured outputs (constraint.c): the model's grammar vocabulary (made
     * on first use) and the cache of compiled grammars, under grammar_mu */
    pthread_mutex_t grammar_mu;
    k3_grammar_vocab *gvocab;
    struct k3_srv_gcache *gcache;
};

#endif /* K3_SERVER_STATE_H */
