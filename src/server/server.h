/*
 * server.h -- what the HTTP layer (server.c) and the generation routes
 * (gen.c) share.
 */
#ifndef K3_SERVER_SERVER_H
#define K3_SERVER_SERVER_H

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
    long created;
    k3_metrics metrics;
    atomic_bool stopping;
    atomic_uint_fast64_t next_id;
    /* the engine thread (gen.c) */
    pthread_t eng_thread;
    bool eng_started;
    atomic_bool gen_quit;
    pthread_mutex_t fail_mu;
    bool failed;
    k3_error fail_err;
    int32_t eom_id, eos_id; /* <|end_of_msg|>, [EOS] or -1 */
    /* images in chat (gen.c): the tower or NULL, its pool, encodes one at a time */
    const k3_vision *vision;
    k3_pool *vision_pool;
    int64_t max_image_pixels;
    pthread_mutex_t vision_mu;
};

/* Queues a JSON response (takes the reference of body). */
enum MHD_Result k3_srv_json(struct k3_server *s, struct MHD_Connection *c, unsigned status, json_t *body);
/* Queues an error in OpenAI's shape: {"error": {message, type, param, code}}. */
enum MHD_Result k3_srv_error(struct k3_server *s, struct MHD_Connection *c, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* A json string of s[0..n), invalid UTF-8 replaced by U+FFFD. */
json_t *k3_srv_jstr(const char *p, size_t n);
/* True once the client of c has hung up. */
bool k3_srv_client_gone(struct MHD_Connection *c);

#endif /* K3_SERVER_SERVER_H */
