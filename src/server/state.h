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

#include "k3.h"
#include "server/metrics.h"
#include "server/text.h"

/* The server's phases (k3_server_drain, k3_server_end). */
enum {
    K3_SRV_RUNNING = 0,
    K3_SRV_DRAINING, /* new requests 503; those in flight go on */
    K3_SRV_ENDING,   /* those in flight end with an error ending (end_msg) */
};

typedef struct k3_srv_conn k3_srv_conn;
typedef struct k3_srv_seq k3_srv_seq;

struct k3_server {
    struct MHD_Daemon *d;
    char *host, *api_key, *model, *model_label, *version;
    bool metrics_key; /* /metrics needs the key */
    const k3_tokenizer *tok;
    k3_engine *engine;
    int64_t max_model_len;
    size_t max_body;
    int timeout_s, port;
    int header_timeout_s, body_timeout_s;
    double step_timeout_s;
    /* connections (server.c): every open one is a k3_srv_conn in conns,
     * under conn_mu. One that arrives over max_conn takes the place of the
     * connection that has waited longest for its request (which is closed),
     * else it is answered 503 + Retry-After at its request and closed; so is
     * one over max_conn_ip from its address. A reaper thread closes those
     * past their header or body deadline (408). MHD's own hard limit is
     * above max_conn. */
    unsigned max_conn, max_conn_ip;
    atomic_int n_conn; /* open connections (those being closed included) */
    pthread_mutex_t conn_mu;
    k3_srv_conn *conns;
    int n_live; /* connections holding a slot: not being closed, not over a limit */
    pthread_t reaper;
    pthread_cond_t reaper_cv;
    bool reaper_quit, reaper_started;
    /* CORS (http.c): origins that may call from a browser */
    char **origins;
    int n_origins;
    bool any_origin;
    char *cors_methods, *cors_headers; /* NULL headers: those asked for */
    bool loopback;                     /* bound to a loopback address */
    long created;
    k3_metrics metrics;
    atomic_bool stopping; /* k3_server_stop: waiting handlers cut their requests */
    atomic_int phase;     /* K3_SRV_* */
    char end_msg[256];    /* why requests end (set before phase turns ENDING) */
    atomic_int in_flight; /* requests received and not yet answered in full */
    atomic_uint_fast64_t next_id;
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
    /* images in chat (api_chat.c): the tower or NULL, its pool, encodes one at a time */
    const k3_vision *vision;
    k3_pool *vision_pool;
    int64_t max_image_pixels;
    pthread_mutex_t vision_mu;
    /* prefill and decode apart: the transfer agent, or NULL (src/pd) */
    struct k3_pd *pd;
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
