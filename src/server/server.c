/*
 * server.c -- the HTTP layer of `k3 serve` on libmicrohttpd: one thread per
 * connection (a blocked generation waits in its own thread), a connection
 * limit (one over it is answered 503 with Retry-After), an idle timeout for slow clients, a body size limit enforced from
 * Content-Length before anything is read (and again while reading a body
 * sent without one), the API key, and dispatch through the routing table
 * (routes.c). The engine thread is engine_loop.c.
 */
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "common/error.h"
#include "common/json_guard.h"
#include "server/engine_loop.h"
#include "server/http.h"
#include "server/routes.h"
#include "server/state.h"

#define JSON_MAX_DEPTH 64

typedef struct conn_req {
    k3_buf body;
    bool too_big;
    bool started;
} conn_req;

static char *dup_or(const char *s, const char *dflt) {
    const char *v = s && *s ? s : dflt;
    return v ? strdup(v) : NULL;
}

/* Constant-time comparison of the Authorization header with "Bearer KEY". */
static bool auth_ok(const struct k3_server *s, struct MHD_Connection *c) {
    if (!s->api_key) return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncmp(h, "Bearer ", 7)) return false;
    h += 7;
    const size_t a = strlen(h), b = strlen(s->api_key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a; i++) diff |= (unsigned char)h[i] ^ (unsigned char)s->api_key[i % (b ? b : 1)];
    return diff == 0;
}

/* Parses the body as a JSON object; on failure queues a 400 and returns NULL
 * with *ret set. */
static json_t *parse_body(struct k3_server *s, struct MHD_Connection *c, const conn_req *r, enum MHD_Result *ret) {
    if (r->body.len == 0) {
        *ret = k3_srv_error(s, c, 400, "the request has no body: expected a JSON object");
        return NULL;
    }
    if (k3_json_too_deep(r->body.p, r->body.len, JSON_MAX_DEPTH)) {
        *ret = k3_srv_error(s, c, 400, "the request JSON nests deeper than %d levels", JSON_MAX_DEPTH);
        return NULL;
    }
    json_error_t je;
    json_t *root = json_loadb(r->body.p, r->body.len, 0, &je);
    if (!root) {
        *ret = k3_srv_error(s, c, 400, "the request is not valid JSON (line %d, column %d): %s", je.line, je.column,
                            je.text);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        *ret = k3_srv_error(s, c, 400, "the request JSON must be an object");
        return NULL;
    }
    return root;
}

/* The request's route, and what its flags ask for, in this order: the
 * API key (an unknown path asks for it too: without the key nothing tells
 * which paths exist), the method, a JSON body naming this server's model,
 * an engine that can generate. */
static enum MHD_Result dispatch(struct k3_server *s, struct MHD_Connection *c, const char *url, const char *method,
                                conn_req *r) {
    if (r->too_big)
        return k3_srv_error(s, c, 413, "the request body is over the limit of %zu bytes", s->max_body);
    const k3_route *other = NULL, *rt = k3_srv_route_find(method, url, &other);
    const k3_route *known = rt ? rt : other;
    if ((!known || (known->flags & K3_ROUTE_AUTH)) && !auth_ok(s, c))
        return k3_srv_error(s, c, 401, "a valid API key is needed: Authorization: Bearer KEY");
    if (!known) return k3_srv_error(s, c, 404, "no route %s %s", method, url);
    if (!rt) return k3_srv_error(s, c, 405, "%s takes %s", url, known->method);
    enum MHD_Result ret;
    json_t *root = NULL;
    if (rt->flags & K3_ROUTE_JSON) {
        if (!(root = parse_body(s, c, r, &ret))) return ret;
        json_t *model = json_object_get(root, "model");
        if (model && !json_is_null(model) && (!json_is_string(model) || strcmp(json_string_value(model), s->model))) {
            ret = k3_srv_error(s, c, 404, "the model `%s` does not exist (this server serves `%s`)",
                               json_is_string(model) ? json_string_value(model) : "?", s->model);
            json_decref(root);
            return ret;
        }
    }
    if ((rt->flags & K3_ROUTE_GENERATES) && !s->engine)
        ret = k3_srv_error(s, c, 503, "this server has no engine to generate with");
    else if ((rt->flags & K3_ROUTE_GENERATES) && k3_server_failed(s, NULL))
        ret = k3_srv_error(s, c, 503, "the engine has failed");
    else ret = rt->fn(s, c, root);
    json_decref(root);
    return ret;
}

/* The socket context of a connection that arrived over the limit. */
static char over_limit_mark;

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
    struct k3_server *s = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const int n = atomic_fetch_add(&s->n_conn, 1) + 1;
        *socket_context = n > (int)s->max_conn ? &over_limit_mark : NULL;
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        atomic_fetch_sub(&s->n_conn, 1);
    }
}

/* True when c came over the connection limit and no slot has come free
 * since (a connection counts itself, so n_conn <= max_conn means there is
 * room now). */
static bool over_limit(struct k3_server *s, struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    if (!ci || ci->socket_context != &over_limit_mark) return false;
    return atomic_load(&s->n_conn) > (int)s->max_conn;
}

/* 503 + Retry-After + OpenAI's error JSON, and the connection closes. */
static enum MHD_Result refuse_busy(struct k3_server *s, struct MHD_Connection *c) {
    char msg[160];
    snprintf(msg, sizeof msg, "too many connections: this server takes %u at once (its connection limit); try again later",
             s->max_conn);
    json_t *e = k3_srv_error_json(503, msg);
    char *text = e ? json_dumps(e, JSON_COMPACT) : NULL;
    json_decref(e);
    if (!text) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "application/json");
    MHD_add_response_header(r, "Retry-After", "1");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    pthread_mutex_lock(&s->metrics.mu);
    s->metrics.http_requests++;
    s->metrics.http_errors++;
    s->metrics.http_refused++;
    pthread_mutex_unlock(&s->metrics.mu);
    const enum MHD_Result ret = MHD_queue_response(c, 503, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *data, size_t *data_size, void **con_cls) {
    struct k3_server *s = cls;
    conn_req *r = *con_cls;
    if (!r) {
        /* over the connection limit: answered at once, the body unread */
        if (over_limit(s, c)) return refuse_busy(s, c);
        r = calloc(1, sizeof *r);
        if (!r) return MHD_NO;
        *con_cls = r;
        /* refuse an oversized body before reading it */
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (cl) {
            char *end;
            const unsigned long long v = strtoull(cl, &end, 10);
            if (end == cl || v > s->max_body) {
                r->too_big = true;
                return k3_srv_error(s, c, 413, "the request body (%s bytes) is over the limit of %zu bytes", cl,
                                    s->max_body);
            }
        }
        return MHD_YES;
    }
    if (*data_size) {
        if (!r->too_big && r->body.len + *data_size > s->max_body) {
            r->too_big = true;
            k3_buf_free(&r->body);
        }
        if (!r->too_big) k3_buf_add(&r->body, data, *data_size);
        *data_size = 0;
        return MHD_YES;
    }
    if (r->started) return MHD_YES;
    r->started = true;
    if (r->body.oom) return k3_srv_error(s, c, 500, "out of memory for the request body");
    return dispatch(s, c, url, method, r);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    conn_req *r = *con_cls;
    if (!r) return;
    k3_buf_free(&r->body);
    free(r);
    *con_cls = NULL;
}

static char *label_escape(const char *s) {
    k3_buf b = {0};
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') k3_buf_add(&b, "\\", 1);
        if (*s == '\n') k3_buf_add(&b, "\\n", 2);
        else k3_buf_add(&b, s, 1);
    }
    k3_buf_add(&b, "", 0);
    if (b.oom) {
        k3_buf_free(&b);
        return NULL;
    }
    return b.p;
}

static void server_free(struct k3_server *s) {
    free(s->host);
    free(s->api_key);
    free(s->model);
    free(s->model_label);
    free(s->version);
    k3_metrics_destroy(&s->metrics);
    pthread_mutex_destroy(&s->fail_mu);
    pthread_mutex_destroy(&s->vision_mu);
    free(s);
}

k3_status k3_server_start(k3_server **out, const k3_server_options *opt, k3_error *err) {
    *out = NULL;
    if (!opt || !opt->tok || !opt->model_name || !*opt->model_name)
        return k3_err(err, K3_ERR_ARG, "the server needs a tokenizer and a model name");
    if (opt->port < 0 || opt->port > 65535) return k3_err(err, K3_ERR_ARG, "port %d is not in 0..65535", opt->port);
    struct k3_server *s = calloc(1, sizeof *s);
    if (!s) return k3_err(err, K3_ERR_NOMEM, "out of memory for the server");
    pthread_mutex_init(&s->fail_mu, NULL);
    pthread_mutex_init(&s->vision_mu, NULL);
    s->vision = opt->vision;
    s->pd = opt->pd;
    s->vision_pool = opt->vision_pool;
    s->max_image_pixels = opt->max_image_pixels;
    s->host = dup_or(opt->host, "127.0.0.1");
    s->api_key = dup_or(opt->api_key, NULL);
    s->model = strdup(opt->model_name);
    s->model_label = label_escape(opt->model_name);
    s->version = dup_or(opt->version, "k3");
    s->tok = opt->tok;
    s->engine = opt->engine;
    s->max_model_len = opt->max_model_len;
    s->max_body = opt->max_body_bytes ? opt->max_body_bytes : (size_t)4 << 20;
    s->timeout_s = opt->timeout_s > 0 ? opt->timeout_s : 30;
    s->created = (long)time(NULL);
    atomic_init(&s->stopping, false);
    atomic_init(&s->next_id, 1);
    int64_t mml = s->max_model_len;
    int32_t mbt = 2048;
    if (s->engine) {
        k3_engine_stats st;
        k3_engine_get_stats(s->engine, &st);
        mml = st.max_model_len;
    }
    k3_metrics_init(&s->metrics, mml, mbt);
    if (!s->host || !s->model || !s->model_label || !s->version || (opt->api_key && *opt->api_key && !s->api_key)) {
        server_free(s);
        return k3_err(err, K3_ERR_NOMEM, "out of memory for the server");
    }

    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai = NULL;
    char port[16];
    snprintf(port, sizeof port, "%d", opt->port);
    const int gai = getaddrinfo(s->host, port, &hints, &ai);
    if (gai || !ai) {
        k3_err(err, K3_ERR_ARG, "cannot resolve --host %s: %s", s->host, gai_strerror(gai));
        server_free(s);
        return K3_ERR_ARG;
    }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    const unsigned limit = opt->max_connections > 0 ? (unsigned)opt->max_connections : 256u;
    s->max_conn = limit;
    atomic_init(&s->n_conn, 0);
    /* MHD's own limit (connections beyond it are closed unanswered) leaves
     * room for the ones that get a 503 */
    const unsigned hard = limit + (limit < 64u ? 64u : limit);
    if (s->engine && k3_srv_engine_start(s, err)) {
        freeaddrinfo(ai);
        server_free(s);
        return err ? err->status : K3_ERR_NOMEM;
    }
    s->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                            MHD_OPTION_CONNECTION_LIMIT, hard, MHD_OPTION_CONNECTION_TIMEOUT,
                            (unsigned)s->timeout_s, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
                            MHD_OPTION_THREAD_STACK_SIZE, (size_t)512 << 10, MHD_OPTION_LISTEN_BACKLOG_SIZE, 512u,
                            MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->d) {
        if (s->engine) k3_srv_engine_stop(s);
        k3_err(err, K3_ERR_IO, "cannot listen on %s port %d (in use, or not an address of this machine)", s->host,
               opt->port);
        server_free(s);
        return K3_ERR_IO;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : opt->port;
    *out = s;
    return K3_OK;
}

int k3_server_port(const k3_server *s) { return s->port; }

void k3_server_stop(k3_server *s) {
    if (!s) return;
    atomic_store(&s->stopping, true);
    /* waiting handlers see the flag within their poll interval, cancel
     * their requests and return; then the daemon's threads end */
    MHD_stop_daemon(s->d);
    if (s->engine) k3_srv_engine_stop(s);
    server_free(s);
}
