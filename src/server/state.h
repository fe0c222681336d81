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

struct k3_server {
    struct MHD_Daemon *d;
    char *host, *api_key, *model, *model_label, *version;
    const k3_tokenizer *tok;
    k3_engine *engine;
    int64_t max_model_len;
    size_t max_body;
    int timeout_s, port;
    /* connections: MHD's hard limit is above max_conn; a connection that
     * arrives over max_conn is answered 503 + Retry-After and closed
     * (server.c, counted in on_connection) */
    unsigned max_conn;
    atomic_int n_conn;
    long created;
    k3_metrics metrics;
    atomic_bool stopping;
    atomic_uint_fast64_t next_id;
    /* the engine thread (engine_loop.c) */
    pthread_t eng_thread;
    bool eng_started;
    atomic_bool gen_quit;
    pthread_mutex_t fail_mu;
    bool failed;
    k3_error fail_err;
    /* images in chat (api_chat.c): the tower or NULL, its pool, encodes one at a time */
    const k3_vision *vision;
    k3_pool *vision_pool;
    int64_t max_image_pixels;
    pthread_mutex_t vision_mu;
    /* prefill and decode apart: the transfer agent, or NULL (src/pd) */
    struct k3_pd *pd;
};

#endif /* K3_SERVER_STATE_H */
