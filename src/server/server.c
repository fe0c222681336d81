/*
 * server.c -- `k3 serve`'s side of the HTTP layer every k3 endpoint shares
 * (src/http/http.h: connections, their limits and deadlines, what is decided
 * on the request line and headers before any body byte is read, the
 * phases of a shutdown): the routing table's rows as that layer's routes
 * (routes.c), errors in the route's API shape, and the whole request's
 * dispatch (its JSON body, the model it names, an engine that can
 * generate, then the route's handler). The engine thread is engine_loop.c.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/json_guard.h"
#include "server/api.h"
#include "server/constraint.h"
#include "server/engine_loop.h"
#include "server/http.h"
#include "server/routes.h"
#include "server/store.h"
#include "server/state.h"

#define JSON_MAX_DEPTH 64

/* ---- the routes as the HTTP layer sees them ------------------------------------ */

static void find_route(void *arg, const char *method, const char *url, k3_http_route *out) {
    struct k3_server *s = arg;
    const k3_route *other = NULL, *rt = k3_srv_route_find(method, url, &other);
    const k3_route *known = rt ? rt : other;
    *out = (k3_http_route){.route = known,
                           .method_ok = rt != NULL,
                           .allow = known ? known->method : NULL,
                           .needs_key = !known || (known->flags & K3_ROUTE_AUTH) ||
                               ((known->flags & K3_ROUTE_METRICS) && s->metrics_key),
                           .during_drain = known && (known->flags & K3_ROUTE_DRAIN)};
}

static enum MHD_Result route_error(void *arg, struct MHD_Connection *c, const void *route, unsigned status,
                                   const char *msg) {
    return k3_srv_route_error(route, arg, c, status, "%s", msg);
}

/* Parses the body as a JSON object; on failure queues a 400 and returns NULL
 * with *ret set. */
static json_t *parse_body(struct k3_server *s, struct MHD_Connection *c, const k3_route *rt, const k3_buf *body,
                          enum MHD_Result *ret) {
    if (body->len == 0) {
        *ret = k3_srv_route_error(rt, s, c, 400, "the request has no body: expected a JSON object");
        return NULL;
    }
    if (k3_json_too_deep(body->p, body->len, JSON_MAX_DEPTH)) {
        *ret = k3_srv_route_error(rt, s, c, 400, "the request JSON nests deeper than %d levels", JSON_MAX_DEPTH);
        return NULL;
    }
    json_error_t je;
    json_t *root = json_loadb(body->p, body->len, 0, &je);
    if (!root) {
        *ret = k3_srv_route_error(rt, s, c, 400, "the request is not valid JSON (line %d, column %d): %s", je.line,
                                  je.column, je.text);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        *ret = k3_srv_route_error(rt, s, c, 400, "the request JSON must be an object");
        return NULL;
    }
    return root;
}

/* The whole request is in: its JSON body, the model it names, an engine
 * that can generate, then the route's handler; every error in the shape
 * of the route's API (k3_route.error). */
static enum MHD_Result dispatch(void *arg, struct MHD_Connection *c, const void *route, const char *url,
                                const char *method, const k3_buf *body, bool too_big) {
    struct k3_server *s = arg;
    const k3_route *rt = route;
    enum MHD_Result ret;
    json_t *root = NULL;
    if (rt->flags & K3_ROUTE_JSON) {
        if (!(root = parse_body(s, c, rt, body, &ret))) return ret;
        json_t *model = json_object_get(root, "model");
        if (model && !json_is_null(model) && (!json_is_string(model) || strcmp(json_string_value(model), s->model))) {
            ret = k3_srv_route_error(rt, s, c, 404, "the model `%s` does not exist (this server serves `%s`)",
                                     json_is_string(model) ? json_string_value(model) : "?", s->model);
            json_decref(root);
            return ret;
        }
    }
    k3_error fe = {0};
    if ((rt->flags & K3_ROUTE_GENERATES) && !s->engine)
        ret = k3_srv_route_error(rt, s, c, 503, "this server has no engine to generate with");
    else if ((rt->flags & K3_ROUTE_GENERATES) && k3_server_failed(s, &fe))
        ret = k3_srv_route_error(rt, s, c, 503, "the engine failed: %s", fe.msg);
    else if (rt->fn_url) ret = rt->fn_url(s, c, url);
    else ret = rt->fn(s, c, root);
    json_decref(root);
    return ret;
}

/* ---- the server ---------------------------------------------------------------- */

static char *dup_or(const char *s, const char *dflt) {
    const char *v = s && *s ? s : dflt;
    return v ? strdup(v) : NULL;
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
    free(s->model);
    free(s->model_label);
    free(s->version);
    k3_srv_store_free(s->responses);
    k3_metrics_destroy(&s->metrics);
    pthread_mutex_destroy(&s->fail_mu);
    pthread_mutex_destroy(&s->live_mu);
    pthread_mutex_destroy(&s->images_mu);
    pthread_cond_destroy(&s->images_cv);
    k3_srv_constraint_free(s);
    pthread_mutex_destroy(&s->grammar_mu);
    free(s);
}

k3_status k3_server_start(k3_server **out, const k3_server_options *opt, k3_error *err) {
    *out = NULL;
    if (!opt || !opt->tok || !opt->model_name || !*opt->model_name)
        return k3_err(err, K3_ERR_ARG, "the server needs a tokenizer and a model name");
    if (opt->port < 0 || opt->port > 65535) return k3_err(err, K3_ERR_ARG, "port %d is not in 0..65535", opt->port);
    if (opt->api_key && !*opt->api_key)
        return k3_err(err, K3_ERR_ARG, "the API key is empty: give a key, or none to serve without one");
    struct k3_server *s = calloc(1, sizeof *s);
    if (!s) return k3_err(err, K3_ERR_NOMEM, "out of memory for the server");
    pthread_mutex_init(&s->fail_mu, NULL);
    pthread_mutex_init(&s->live_mu, NULL);
    pthread_mutex_init(&s->images_mu, NULL);
    pthread_cond_init(&s->images_cv, NULL);
    pthread_mutex_init(&s->grammar_mu, NULL);
    s->vision = opt->vision;
    s->pd = opt->pd;
    s->prefix_cache_per_key = opt->prefix_cache_per_key;
    s->kv_events = opt->kv_events;
    s->vision_pool = opt->vision_pool;
    s->max_image_pixels = opt->max_image_pixels;
    s->max_request_image_pixels =
        opt->max_request_image_pixels > 0 ? opt->max_request_image_pixels : 4 * K3_IMAGE_MAX_PIXELS;
    s->max_request_image_tokens = opt->max_request_image_tokens;
    s->no_ui = opt->no_ui;
    s->responses = k3_srv_store_new(K3_SRV_STORE_ENTRIES, K3_SRV_STORE_BYTES);
    s->metrics_key = opt->metrics_require_key;
    s->model = strdup(opt->model_name);
    s->model_label = label_escape(opt->model_name);
    s->version = dup_or(opt->version, "k3");
    s->tok = opt->tok;
    s->engine = opt->engine;
    s->max_model_len = opt->max_model_len;
    s->timeout_s = opt->timeout_s > 0 ? opt->timeout_s : 30;
    s->step_timeout_s = opt->step_timeout_s > 0 ? opt->step_timeout_s : 300;
    s->test_fail_step = opt->test_fail_step;
    s->test_fail_request = opt->test_fail_request;
    s->created = (long)time(NULL);
    atomic_init(&s->stopping, false);
    atomic_init(&s->step_t0_ns, 0);
    int64_t mml = s->max_model_len;
    int32_t mbt = 2048;
    if (s->engine) {
        k3_engine_stats st;
        k3_engine_get_stats(s->engine, &st);
        mml = st.max_model_len;
    }
    k3_metrics_init(&s->metrics, mml, mbt);
    if (!s->model || !s->model_label || !s->version || !s->responses) {
        server_free(s);
        return k3_err(err, K3_ERR_NOMEM, "out of memory for the server");
    }
    if (s->engine && k3_srv_engine_start(s, err)) {
        server_free(s);
        return err ? err->status : K3_ERR_NOMEM;
    }
    const k3_http_options ho = {.host = opt->host,
                                .port = opt->port,
                                .api_key = opt->api_key,
                                .max_body_bytes = opt->max_body_bytes,
                                .max_connections = opt->max_connections,
                                .max_connections_per_ip = opt->max_connections_per_ip,
                                .timeout_s = opt->timeout_s,
                                .header_timeout_s = opt->header_timeout_s,
                                .body_timeout_s = opt->body_timeout_s,
                                .allowed_origins = opt->allowed_origins,
                                .allowed_methods = opt->allowed_methods,
                                .allowed_headers = opt->allowed_headers};
    const k3_http_app app = {.arg = s, .find = find_route, .error = route_error, .dispatch = dispatch};
    if (k3_http_start(&s->http, &ho, &app, err)) {
        if (s->engine) k3_srv_engine_stop(s);
        server_free(s);
        return err ? err->status : K3_ERR_IO;
    }
    *out = s;
    return K3_OK;
}

int k3_server_port(const k3_server *s) { return k3_http_port(s->http); }

void k3_server_drain(k3_server *s) { k3_http_drain(s->http); }

int k3_server_in_flight(k3_server *s) { return k3_http_in_flight(s->http); }

void k3_server_end(k3_server *s, const char *why) {
    if (k3_http_phase(s->http) == K3_HTTP_ENDING) return;
    k3_http_end(s->http, why);
    /* the waiting threads see the phase at once rather than at their next poll */
    if (s->engine) k3_srv_cancel_all(s);
}

void k3_server_stop(k3_server *s) {
    if (!s) return;
    k3_server_drain(s);
    atomic_store(&s->stopping, true);
    /* waiting handlers see the flag within their poll interval, cancel
     * their requests and return; then the daemon's threads end */
    if (s->engine) k3_srv_cancel_all(s);
    k3_http_stop(s->http);
    if (s->engine) k3_srv_engine_stop(s);
    server_free(s);
}
