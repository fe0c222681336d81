/*
 * routes.c -- the routing table (routes.h) and the routes that need no
 * generation: /health (liveness: the engine can generate), /ready
 * (readiness: a request would be taken now), /version, /v1/models,
 * /metrics, /tokenize, /detokenize, /tokenizer_info, and the chat page at
 * /. The generation routes are the API surfaces (api.h).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api.h"
#include "server/engine_loop.h"
#include "server/http.h"
#include "server/images.h"
#include "server/routes.h"
#include "pd/pd.h"
#include "server/ui_page.h"
#include "tokenizer/tokenizer_info.h"

/* Why the server cannot serve a generation now, or NULL: shutting down,
 * the engine failed, or a step has run longer than the step timeout (a
 * stuck rank); with queue_full, also a full waiting queue. */
static const char *not_ok(struct k3_server *s, bool queue_full, char *buf, size_t cap) {
    if (k3_http_phase(s->http) != K3_HTTP_RUNNING) return "the server is shutting down";
    if (!s->engine) return NULL;
    k3_error e = {0};
    if (k3_server_failed(s, &e)) {
        snprintf(buf, cap, "the engine failed: %.250s", e.msg);
        return buf;
    }
    const double t = k3_srv_step_seconds(s);
    if (t > s->step_timeout_s) {
        snprintf(buf, cap, "the engine has been in one step for %.0f s, over the step timeout of %.0f s", t,
                 s->step_timeout_s);
        return buf;
    }
    if (queue_full) {
        k3_engine_stats st;
        k3_srv_engine_stats(s, &st);
        if (st.max_waiting > 0 && st.n_waiting >= st.max_waiting) {
            snprintf(buf, cap, "the engine's queue is full (%d requests waiting)", st.n_waiting);
            return buf;
        }
    }
    return NULL;
}

/* Liveness: 200 while the engine can generate. */
static enum MHD_Result route_health(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    char buf[300];
    const char *why = not_ok(s, false, buf, sizeof buf);
    if (why) return k3_srv_error(s, c, 503, "%s", why);
    return k3_srv_queue(s, c, 200, strdup(""), 0, "text/plain");
}

/* Readiness: 200 while a new generation request would be taken now. */
static enum MHD_Result route_ready(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    char buf[300];
    const char *why = not_ok(s, true, buf, sizeof buf);
    if (why) return k3_srv_error(s, c, 503, "%s", why);
    return k3_srv_json(s, c, 200, json_pack("{s:s}", "status", "ready"));
}

static enum MHD_Result route_version(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    return k3_srv_json(s, c, 200, json_pack("{s:s}", "version", s->version));
}

static enum MHD_Result route_models(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    /* capabilities: what the chat page (and any client) may offer: images
     * only with a vision tower */
    json_t *m =
        json_pack("{s:s,s:s,s:I,s:s,s:s,s:I,s:[],s:{s:b}}", "id", s->model, "object", "model", "created",
                  (json_int_t)s->created, "owned_by", "k3", "root", s->model, "max_model_len",
                  (json_int_t)k3_srv_max_model_len(s), "permission", "capabilities", "vision", s->vision != NULL);
    return k3_srv_json(s, c, 200, json_pack("{s:s,s:[o]}", "object", "list", "data", m));
}

static enum MHD_Result route_metrics(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    k3_buf o = {0};
    k3_engine_stats st;
    int32_t bs = 0;
    if (s->engine) {
        k3_srv_engine_stats(s, &st);
        bs = st.blocks_total ? (int32_t)(st.cache_tokens / st.blocks_total) : 0;
    }
    k3_metrics_render(&s->metrics, s->engine ? &st : NULL, s->model_label, bs, &o);
    k3_http_metrics_render(s->http, s->model_label, &o);
    k3_srv_images_metrics(s, &o);
    if (s->engine) {
        k3_kv_residency kr;
        k3_engine_kv_residency(s->engine, &kr);
        k3_metrics_render_kv(&kr, s->model_label, &o);
    }
    k3_comm_stats cs;
    if (s->engine && k3_engine_comm_stats(s->engine, &cs)) k3_metrics_render_dist(&cs, &o);
    if (s->pd) k3_pd_metrics_render(s->pd, s->model_label, &o);
    k3_metrics_render_disk(s->engine, s->kv_events, s->model_label, &o);
    if (o.oom || !o.p) {
        k3_buf_free(&o);
        return k3_srv_error(s, c, 500, "out of memory");
    }
    return k3_srv_queue(s, c, 200, o.p, o.len, "text/plain; version=0.0.4; charset=utf-8");
}

/* vLLM's /tokenize: "prompt" (a special's name in it read as the special,
 * as vLLM with the released tokenizer reads it; "split_special_tokens":
 * true reads it as ordinary text, as a /v1/completions prompt is) or
 * "messages" (the chat prompt /v1/chat/completions would run);
 * "return_token_strs" adds each token's text. */
static enum MHD_Result route_tokenize(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    int32_t *ids = NULL;
    size_t n = 0;
    k3_error err = {0};
    json_t *prompt = json_object_get(root, "prompt"), *msgs = json_object_get(root, "messages");
    json_t *split = json_object_get(root, "split_special_tokens"), *strs = json_object_get(root, "return_token_strs");
    if ((split && !json_is_boolean(split) && !json_is_null(split)) ||
        (strs && !json_is_boolean(strs) && !json_is_null(strs)))
        return k3_srv_error(s, c, 400, "\"split_special_tokens\" and \"return_token_strs\" must be true or false");
    if (json_is_string(prompt)) {
        const k3_status st = json_is_true(split)
            ? k3_tokenizer_encode(s->tok, json_string_value(prompt), json_string_length(prompt), &ids, &n, &err)
            : k3_tokenizer_encode_specials(s->tok, json_string_value(prompt), json_string_length(prompt), &ids, &n,
                                           &err);
        if (st) return k3_srv_error(s, c, 400, "prompt: %s", err.msg);
    } else if (json_is_array(msgs)) {
        k3_vision_prompt vp;
        if (k3_srv_encode_chat(s, root, &vp, NULL, &err))
            return k3_srv_error(s, c, err.status == K3_ERR_NOMEM ? 500 : 400, "%s", err.msg);
        ids = vp.ids, n = vp.n_ids;
        vp.ids = NULL;
        k3_vision_prompt_free(&vp);
    } else {
        return k3_srv_error(s, c, 400, "tokenize needs \"prompt\" (a string) or \"messages\" (an array)");
    }
    json_t *arr = json_array(), *ts = json_is_true(strs) ? json_array() : NULL;
    for (size_t i = 0; i < n; i++) {
        json_array_append_new(arr, json_integer(ids[i]));
        if (ts) {
            size_t len = 0;
            const char *p = k3_tokenizer_token(s->tok, ids[i], &len);
            json_t *str = p ? k3_srv_jstr(p, len) : NULL;
            json_array_append_new(ts, str ? str : json_string(""));
        }
    }
    free(ids);
    json_t *out = json_pack("{s:I,s:I,s:o}", "count", (json_int_t)n, "max_model_len",
                            (json_int_t)k3_srv_max_model_len(s), "tokens", arr);
    if (out && ts) json_object_set_new(out, "token_strs", ts);
    else json_decref(ts);
    return k3_srv_json(s, c, 200, out);
}

/* vLLM's /tokenizer_info (lm-eval's remote tokenizer starts with it). */
static enum MHD_Result route_tokenizer_info(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    char *text = NULL;
    size_t len = 0;
    k3_error err = {0};
    if (k3_tokenizer_info_json(s->tok, &text, &len, &err)) return k3_srv_error(s, c, 500, "%s", err.msg);
    return k3_srv_queue(s, c, 200, text, len, "application/json");
}

static enum MHD_Result route_detokenize(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    json_t *toks = json_object_get(root, "tokens");
    if (!json_is_array(toks)) return k3_srv_error(s, c, 400, "detokenize needs \"tokens\" (an array of ids)");
    const size_t n = json_array_size(toks);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) return k3_srv_error(s, c, 500, "out of memory");
    const int32_t nv = k3_tokenizer_n_vocab(s->tok);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(toks, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= nv) {
            free(ids);
            return k3_srv_error(s, c, 400, "tokens[%zu] is not a token id in 0..%d", i, nv - 1);
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    char *text = NULL;
    size_t len = 0;
    k3_error err = {0};
    const k3_status st = k3_tokenizer_decode(s->tok, ids, n, &text, &len, &err);
    free(ids);
    if (st) return k3_srv_error(s, c, 400, "%s", err.msg);
    json_t *j = k3_srv_jstr(text, len);
    free(text);
    return k3_srv_json(s, c, 200, json_pack("{s:o}", "prompt", j ? j : json_string("")));
}

/* The chat page (ui_page.h: src/server/ui/index.html, built into the binary). */
static enum MHD_Result route_ui(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    if (s->no_ui) return k3_srv_error(s, c, 404, "no route GET / (the chat page is off: --no-ui)");
    char *page = malloc(k3_ui_index_html_len + 1);
    if (!page) return k3_srv_error(s, c, 500, "out of memory");
    memcpy(page, k3_ui_index_html, k3_ui_index_html_len);
    return k3_srv_queue(s, c, 200, page, k3_ui_index_html_len, "text/html; charset=utf-8");
}

#define AUTH K3_ROUTE_AUTH
#define JSON K3_ROUTE_JSON
#define GEN K3_ROUTE_GENERATES
#define DRAIN K3_ROUTE_DRAIN
#define PREFIX K3_ROUTE_PREFIX
#define ANTHROPIC NULL, k3_srv_anthropic_error

static const k3_route routes[] = {
    {"GET", "/", route_ui, 0},
    {"GET", "/health", route_health, DRAIN},
    {"GET", "/ready", route_ready, DRAIN},
    {"GET", "/version", route_version, AUTH},
    {"GET", "/v1/models", route_models, AUTH},
    {"GET", "/metrics", route_metrics, K3_ROUTE_METRICS | DRAIN},
    {"POST", "/tokenize", route_tokenize, AUTH | JSON},
    {"POST", "/detokenize", route_detokenize, AUTH | JSON},
    {"GET", "/tokenizer_info", route_tokenizer_info, AUTH},
    {"POST", "/v1/completions", k3_api_completions, AUTH | JSON | GEN},
    {"POST", "/v1/chat/completions", k3_api_chat, AUTH | JSON | GEN},
    {"POST", "/v1/responses", k3_api_responses, AUTH | JSON | GEN},
    {"GET", "/v1/responses/", NULL, AUTH | PREFIX, k3_api_responses_get},
    {"DELETE", "/v1/responses/", NULL, AUTH | PREFIX, k3_api_responses_delete},
    {"POST", "/v1/messages", k3_api_messages, AUTH | JSON | GEN, ANTHROPIC},
    {"POST", "/v1/messages/count_tokens", k3_api_messages_count_tokens, AUTH | JSON, ANTHROPIC},
};

static bool method_is(const char *row, const char *method) {
    if (!strcmp(row, method)) return true;
    return !strcmp(row, "GET") && !strcmp(method, "HEAD");
}

/* A prefix row takes one non-empty segment below its path. */
static bool path_is(const k3_route *r, const char *path) {
    if (!(r->flags & K3_ROUTE_PREFIX)) return !strcmp(r->path, path);
    const size_t n = strlen(r->path);
    return !strncmp(r->path, path, n) && path[n] && !strchr(path + n, '/');
}

const k3_route *k3_srv_route_find(const char *method, const char *path, const k3_route **same_path) {
    const k3_route *other = NULL;
    if (same_path) *same_path = NULL;
    for (size_t i = 0; i < sizeof routes / sizeof *routes; i++) {
        if (!path_is(&routes[i], path)) continue;
        if (method_is(routes[i].method, method)) return &routes[i];
        if (!other) other = &routes[i];
    }
    if (same_path) *same_path = other;
    return NULL;
}

enum MHD_Result k3_srv_route_error(const k3_route *rt, struct k3_server *s, struct MHD_Connection *c, unsigned status,
                                   const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (rt && rt->error) return rt->error(s, c, status, msg);
    return k3_srv_error(s, c, status, "%s", msg);
}
