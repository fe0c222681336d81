/*
 * proxy.c -- the one endpoint in front of prefill and decode instances
 * (k3_proxy of k3.h; k3 serve --role proxy): the HTTP layer every k3
 * endpoint shares for the clients (src/http: connections, deadlines and
 * caps, framing, the key before any body, CORS, the drain), libcurl for the
 * backends.
 *
 * A generation request (a POST whose body is a JSON object, on any path but
 * the few that do not generate) is sent to the least loaded prefill
 * instance as vLLM's proxies send it: kv_transfer_params
 * {"do_remote_decode": true}, one token, no stream; the kv_transfer_params
 * of its answer go with the client's own request to the least loaded decode
 * instance, with the proxy's credential over them (auth.h), whose answer or
 * stream is relayed as it comes. A request the prefill instance cannot
 * split (several prompts or choices) goes whole to a decode instance. The
 * proxy knows no API surface but for the shape of its own errors and
 * endings (Anthropic's on /v1/messages, the Responses API's on
 * /v1/responses, OpenAI's elsewhere). Other routes go to a decode instance
 * unchanged; /health (its backends' health) and /metrics are its own.
 *
 * Failures: a backend that cannot be reached is marked down for a few
 * seconds and the next one tried (a decode instance that is down is
 * replaced by another, with a fresh hold from a prefill instance: the one
 * that failed may have begun the pull a hold allows); when none answers the
 * client gets a 502 in its API's error shape, and a hold made for it is
 * released on its prefill instance. A backend's own error (4xx, 5xx) is
 * relayed as it is. A decode stream cut short ends with an error event the
 * client sees. A client that hangs up ends the backend request (the decode
 * instance sees it go, cancels and frees); one that only half-closes is
 * still answered. On k3_proxy_end every request in flight ends: a stream
 * with its API's error event, a whole answer with a 503.
 */
#include <curl/curl.h>
#include <jansson.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/buf.h"
#include "common/error.h"
#include "http/http.h"
#include "pd/auth.h"
#include "pd/pd.h"
#include "router/router.h"

typedef struct backend {
    char *url;   /* base, no trailing slash */
    int32_t rix; /* the router's index of it, -1 for prefill and decode instances */
    atomic_int inflight;
    _Atomic double down_until; /* k3_now() before which it is skipped */
    atomic_long requests, failures;
    atomic_bool up; /* its /health answered 200 at the last probe */
} backend;

struct k3_proxy {
    k3_http *http;
    backend *pre, *dec;
    int n_pre, n_dec;
    char *api_key; /* passed on to the backends */
    bool metrics_key;
    k3_pd_keys keys;
    double timeout;
    atomic_uint rr;
    atomic_bool stopping;
    atomic_long requests, errors, released, whole;
    /* the router (--role router): its policy over the backends (p->dec), under rmu */
    k3_router *router;
    pthread_mutex_t rmu;
    atomic_long routed[K3_ROUTE_RR + 1]; /* by why */
    atomic_long matched_bytes, key_bytes;
    /* the prober of the backends' /health */
    pthread_t prober;
    bool prober_started, quit;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

/* The routes: the proxy's own, and what it forwards by the shape of its API. */
enum { R_HEALTH, R_METRICS, R_OPENAI, R_RESPONSES, R_MESSAGES };
static const int route_ids[] = {R_HEALTH, R_METRICS, R_OPENAI, R_RESPONSES, R_MESSAGES};
#define ROUTE(r) (&route_ids[r])
#define ROUTE_OF(p) ((p) ? *(const int *)(p) : R_OPENAI)

/* ---- answers in the route's shape ------------------------------------------------------------ */

static enum MHD_Result fail(k3_proxy *p, struct MHD_Connection *c, int route, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static enum MHD_Result fail(k3_proxy *p, struct MHD_Connection *c, int route, unsigned status, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    atomic_fetch_add(&p->errors, 1);
    json_t *m = k3_http_str(msg);
    return k3_http_json(p->http, c, status,
                        route == R_MESSAGES ? k3_http_anthropic_error_json(status, m) : k3_http_error_json(status, m));
}

static enum MHD_Result on_error(void *arg, struct MHD_Connection *c, const void *route, unsigned status,
                                const char *msg) {
    return fail(arg, c, ROUTE_OF(route), status, "%s", msg);
}

/* A backend's answer, relayed: text[0..len) taken. */
static enum MHD_Result relay_whole(k3_proxy *p, struct MHD_Connection *c, long status, char *text, size_t len,
                                   const char *type) {
    if (status != 200) atomic_fetch_add(&p->errors, 1);
    return k3_http_queue(p->http, c, status > 0 ? (unsigned)status : 502, text, len, type && *type ? type : NULL);
}

/* ---- backends ----------------------------------------------------------------------------------- */

/* The least loaded of n that is not down and not in tried (a bit each);
 * when all are down, the least loaded not tried. -1 when all were tried. */
static int pick(k3_proxy *p, backend *b, int n, unsigned tried) {
    const double now = k3_now();
    const unsigned off = atomic_fetch_add(&p->rr, 1);
    int best = -1, best_down = -1;
    for (int k = 0; k < n; k++) {
        const int i = (int)((off + (unsigned)k) % (unsigned)n);
        if (tried & (1u << i)) continue;
        const bool down = atomic_load(&b[i].down_until) > now;
        int *slot = down ? &best_down : &best;
        if (*slot < 0 || atomic_load(&b[i].inflight) < atomic_load(&b[*slot].inflight)) *slot = i;
    }
    return best >= 0 ? best : best_down;
}

/* A request sent to b ended (ok: answered, or ended by the client or the proxy; else b failed it):
 * the router's load and health learn it. */
static void backend_done(k3_proxy *p, backend *b, bool ok) {
    if (!p->router || b->rix < 0) return;
    pthread_mutex_lock(&p->rmu);
    k3_router_done(p->router, b->rix, ok, k3_now());
    pthread_mutex_unlock(&p->rmu);
}

typedef struct call {
    CURL *h;
    struct curl_slist *hdr;
    k3_buf out;   /* the body as it comes */
    size_t taken; /* of it handed to the client (streams) */
    char ctype[128];
    long status;
    bool got_status;
    k3_proxy *p;
    struct MHD_Connection *client; /* watched: a client that hangs up ends the call */
    bool client_left, ended;       /* ended: the proxy ended it (k3_proxy_end, stop) */
    char errbuf[CURL_ERROR_SIZE];
} call;

static size_t on_body(char *ptr, size_t size, size_t n, void *arg) {
    call *c = arg;
    k3_buf_add(&c->out, ptr, size * n);
    return c->out.oom ? 0 : size * n;
}

static size_t on_header(char *ptr, size_t size, size_t n, void *arg) {
    call *c = arg;
    const size_t len = size * n;
    if (len > 13 && !strncasecmp(ptr, "Content-Type:", 13)) {
        const char *v = ptr + 13;
        while (*v == ' ') v++;
        size_t m = (size_t)(ptr + len - v);
        while (m > 0 && (v[m - 1] == '\r' || v[m - 1] == '\n')) m--;
        if (m >= sizeof c->ctype) m = sizeof c->ctype - 1;
        memcpy(c->ctype, v, m);
        c->ctype[m] = 0;
    }
    if (len > 5 && !strncmp(ptr, "HTTP/", 5)) c->got_status = true;
    return len;
}

static int on_progress(void *arg, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un) {
    call *c = arg;
    if (atomic_load(&c->p->stopping) || k3_http_phase(c->p->http) == K3_HTTP_ENDING) {
        c->ended = true;
        return 1;
    }
    if (c->client && k3_http_client_gone(c->client)) {
        c->client_left = true;
        return 1;
    }
    return 0;
}

static bool add_header(call *c, const char *name, const char *value) {
    char h[1200];
    snprintf(h, sizeof h, "%s: %s", name, value);
    struct curl_slist *n = curl_slist_append(c->hdr, h);
    if (n) c->hdr = n;
    return n != NULL;
}

/* cred: the proxy's credential for a decode request's kv_transfer_params, or NULL. */
static bool call_init(call *c, k3_proxy *p, const backend *b, const char *method, const char *path, const char *body,
                      size_t len, struct MHD_Connection *client, const char *cred) {
    memset(c, 0, sizeof *c);
    c->p = p;
    c->h = curl_easy_init();
    if (!c->h) return false;
    char url[2048];
    snprintf(url, sizeof url, "%s%s", b->url, path);
    curl_easy_setopt(c->h, CURLOPT_URL, url);
    curl_easy_setopt(c->h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c->h, CURLOPT_CONNECTTIMEOUT_MS, 5000L);
    /* a backend that moves nothing for the timeout fails the call */
    curl_easy_setopt(c->h, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(c->h, CURLOPT_LOW_SPEED_TIME, (long)(p->timeout > 1 ? p->timeout : 1));
    curl_easy_setopt(c->h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c->h, CURLOPT_WRITEDATA, c);
    curl_easy_setopt(c->h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c->h, CURLOPT_HEADERDATA, c);
    curl_easy_setopt(c->h, CURLOPT_ERRORBUFFER, c->errbuf);
    curl_easy_setopt(c->h, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c->h, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(c->h, CURLOPT_XFERINFODATA, c);
    c->client = client;
    bool ok = add_header(c, "Content-Type", "application/json") && add_header(c, "Expect", "");
    if (p->api_key) {
        /* the client proved the proxy's key; the instances take the same */
        char v[1100];
        snprintf(v, sizeof v, "Bearer %s", p->api_key);
        ok = ok && add_header(c, "Authorization", v);
    } else if (client) {
        /* no key here: whatever the client sent is the instances' business */
        static const char *const pass[] = {"Authorization", "x-api-key"};
        for (int i = 0; i < 2; i++) {
            const char *v = MHD_lookup_connection_value(client, MHD_HEADER_KIND, pass[i]);
            if (v && strlen(v) < 1024) ok = ok && add_header(c, pass[i], v);
        }
    }
    if (client) {
        /* the Anthropic API's version header, as the client sent it */
        const char *v = MHD_lookup_connection_value(client, MHD_HEADER_KIND, "anthropic-version");
        if (v && strlen(v) < 64) ok = ok && add_header(c, "anthropic-version", v);
    }
    if (cred) ok = ok && add_header(c, K3_PD_CREDENTIAL_HEADER, cred);
    if (!ok) {
        curl_easy_cleanup(c->h);
        curl_slist_free_all(c->hdr);
        c->h = NULL;
        return false;
    }
    curl_easy_setopt(c->h, CURLOPT_HTTPHEADER, c->hdr);
    /* the body is copied: a call may outlive its caller's buffer (a stream) */
    if (!strcmp(method, "POST")) {
        curl_easy_setopt(c->h, CURLOPT_POST, 1L);
        curl_easy_setopt(c->h, CURLOPT_POSTFIELDSIZE, (long)len);
        curl_easy_setopt(c->h, CURLOPT_COPYPOSTFIELDS, body ? body : "");
    } else if (!strcmp(method, "HEAD")) {
        curl_easy_setopt(c->h, CURLOPT_NOBODY, 1L);
    } else if (strcmp(method, "GET")) {
        curl_easy_setopt(c->h, CURLOPT_CUSTOMREQUEST, method);
        if (len) {
            curl_easy_setopt(c->h, CURLOPT_POSTFIELDSIZE, (long)len);
            curl_easy_setopt(c->h, CURLOPT_COPYPOSTFIELDS, body);
        }
    }
    return true;
}

static void call_free(call *c) {
    if (c->h) curl_easy_cleanup(c->h);
    curl_slist_free_all(c->hdr);
    k3_buf_free(&c->out);
    c->h = NULL;
    c->hdr = NULL;
}

/* A whole call; false (why in err) when the backend could not be reached
 * or the call broke off before an answer. */
static bool call_run(call *c, k3_error *err) {
    const CURLcode rc = curl_easy_perform(c->h);
    curl_easy_getinfo(c->h, CURLINFO_RESPONSE_CODE, &c->status);
    if (rc == CURLE_OK) return true;
    k3_err(err, K3_ERR_IO, "%s", c->errbuf[0] ? c->errbuf : curl_easy_strerror(rc));
    return false;
}

/* The request the proxy itself ended (k3_proxy_end): a 503 naming why. */
static enum MHD_Result ended(k3_proxy *p, struct MHD_Connection *c, int route) {
    return fail(p, c, route, 503, "%s",
                k3_http_phase(p->http) == K3_HTTP_ENDING ? k3_http_end_msg(p->http) : "the server is shutting down");
}

/* The hold a prefill answer named, released on its prefill instance (the
 * request will not reach a decode instance). */
static void release_hold(k3_proxy *p, json_t *kv) {
    json_t *host = json_object_get(kv, "remote_host"), *port = json_object_get(kv, "remote_port");
    uint8_t token[K3_PD_TOKEN_BYTES], hash[K3_PD_HASH_BYTES];
    if (!json_is_string(host) || !json_is_integer(port) ||
        !k3_pd_unhex(json_string_value(json_object_get(kv, "remote_request_id")), token, sizeof token) ||
        !k3_pd_unhex(json_string_value(json_object_get(kv, "prompt_hash")), hash, sizeof hash))
        return;
    if (!k3_pd_release_hold(&p->keys, json_string_value(host), (int)json_integer_value(port), token, hash, 2.0, NULL))
        atomic_fetch_add(&p->released, 1);
}

/* The proxy's credential over the kv_transfer_params a decode request carries. */
static void credential(k3_proxy *p, json_t *kv, char out[2 * K3_PD_KEY_BYTES + 1]) {
    json_t *port = json_object_get(kv, "remote_port"), *n = json_object_get(kv, "num_tokens");
    const char *host = json_string_value(json_object_get(kv, "remote_host")),
               *rid = json_string_value(json_object_get(kv, "remote_request_id")),
               *ph = json_string_value(json_object_get(kv, "prompt_hash"));
    k3_pd_credential(&p->keys, host ? host : "", json_is_integer(port) ? json_integer_value(port) : 0, rid ? rid : "",
                     ph ? ph : "", json_is_integer(n) ? json_integer_value(n) : 0, out);
}

/* ---- a stream from a decode instance ------------------------------------------------------------ */

typedef struct relay {
    k3_proxy *p;
    backend *b;
    call c;
    CURLM *m;
    int route;
    bool done, failed;
    k3_buf tail; /* the ending after a stream cut short or ended by the proxy */
    size_t tail_pos;
    json_t *resp;  /* the Responses API's response object, from its first event */
    long seq;      /* the Responses API's last sequence_number */
    bool ended_ok; /* ended by the client or the proxy before an answer: not the backend's failure */
} relay;

/* What a stream's client reads when the stream ends early: its API's error
 * event (OpenAI's error JSON and [DONE]; the Responses API's
 * response.failed; Anthropic's event: error). */
static void make_tail(relay *r, unsigned status, const char *why) {
    if (r->tail.len) return;
    json_t *e = NULL;
    const char *event = NULL;
    if (r->route == R_MESSAGES) {
        event = "error";
        e = k3_http_anthropic_error_json(status, k3_http_str(why));
    } else if (r->route == R_RESPONSES && r->resp) {
        event = "response.failed";
        json_t *resp = json_deep_copy(r->resp);
        json_object_set_new(resp, "status", json_string("failed"));
        json_object_set_new(resp, "error", json_pack("{s:s,s:o}", "code", "server_error", "message", k3_http_str(why)));
        e = json_pack("{s:s,s:I,s:o}", "type", event, "sequence_number", (json_int_t)(r->seq + 1), "response", resp);
    } else {
        e = k3_http_error_json(status, k3_http_str(why));
    }
    char *t = e ? json_dumps(e, JSON_COMPACT) : NULL;
    json_decref(e);
    if (event) k3_buf_addf(&r->tail, "event: %s\ndata: %s\n\n", event, t ? t : "{}");
    else k3_buf_addf(&r->tail, "data: %s\n\ndata: [DONE]\n\n", t ? t : "{}");
    free(t);
}

/* Whole events going to the client: what the Responses API's ending needs
 * (the response object of its first event, the last sequence_number). */
static void note_events(relay *r, const char *p, size_t n) {
    if (r->route != R_RESPONSES) return;
    while (n > 0) {
        const char *end = memmem(p, n, "\n\n", 2);
        const size_t len = end ? (size_t)(end - p) : n;
        const char *d = len >= 6 && !strncmp(p, "data: ", 6) ? p : memmem(p, len, "\ndata: ", 7);
        if (d) {
            d += *d == '\n' ? 7 : 6;
            json_t *ev = json_loadb(d, (size_t)(p + len - d), 0, NULL);
            json_t *seq = json_object_get(ev, "sequence_number"), *resp = json_object_get(ev, "response");
            if (json_is_integer(seq)) r->seq = (long)json_integer_value(seq);
            if (!r->resp && json_is_object(resp)) r->resp = json_incref(resp);
            json_decref(ev);
        }
        const size_t step = end ? len + 2 : n;
        p += step;
        n -= step;
    }
}

/* The end of the last whole event in out beyond taken (0: none yet). */
static size_t events_end(const relay *r) {
    const char *b = r->c.out.p;
    for (size_t i = r->c.out.len; i >= r->c.taken + 2 && i >= 2; i--)
        if (b[i - 1] == '\n' && b[i - 2] == '\n') return i;
    return 0;
}

/* Drives the transfer until there are whole events beyond taken, or it ends. */
static void relay_pump(relay *r, int wait_ms) {
    while (!r->done && !events_end(r)) {
        int running = 0;
        curl_multi_perform(r->m, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(r->m, &left)))
            if (msg->msg == CURLMSG_DONE) {
                r->done = true;
                r->failed = msg->data.result != CURLE_OK;
                if (r->failed && !r->c.ended) {
                    char m[1024];
                    snprintf(m, sizeof m, "the decode instance %s broke off the stream: %s", r->b->url,
                             r->c.errbuf[0] ? r->c.errbuf : curl_easy_strerror(msg->data.result));
                    make_tail(r, 502, m);
                }
            }
        if (r->done || events_end(r) || (r->c.got_status && wait_ms == 0)) break;
        curl_multi_poll(r->m, NULL, 0, wait_ms > 0 ? wait_ms : 100, NULL);
    }
}

static ssize_t copy_out(const char *src, size_t n, size_t *pos, char *buf, size_t max) {
    size_t k = n - *pos;
    if (k > max) k = max;
    memcpy(buf, src + *pos, k);
    *pos += k;
    return (ssize_t)k;
}

static ssize_t relay_read(void *cls, uint64_t pos, char *buf, size_t max) {
    relay *r = cls;
    k3_proxy *p = r->p;
    if (atomic_load(&p->stopping)) return MHD_CONTENT_READER_END_WITH_ERROR;
    if (!r->done) relay_pump(r, 100);
    if ((r->c.ended || k3_http_phase(p->http) == K3_HTTP_ENDING) && !r->tail.len && !(r->done && !r->failed)) {
        /* ended by the proxy (its progress hook may have cut the transfer
         * already): after the whole events already in, its API's ending */
        r->done = true;
        r->c.ended = true;
        make_tail(r, 503,
                  k3_http_phase(p->http) == K3_HTTP_ENDING ? k3_http_end_msg(p->http) : "the server is shutting down");
    }
    /* whole events only, so an ending never lands inside one */
    size_t end = events_end(r);
    if (r->done && !r->failed && !r->c.ended) end = r->c.out.len; /* the backend ended it: all of it */
    if (end > r->c.taken) {
        size_t n = end - r->c.taken;
        if (n > max) n = max;
        note_events(r, r->c.out.p + r->c.taken, n);
        memcpy(buf, r->c.out.p + r->c.taken, n);
        r->c.taken += n;
        if (r->c.taken == r->c.out.len) r->c.out.len = r->c.taken = 0;
        return (ssize_t)n;
    }
    if (r->done && r->tail_pos < r->tail.len) return copy_out(r->tail.p, r->tail.len, &r->tail_pos, buf, max);
    if (r->done) return MHD_CONTENT_READER_END_OF_STREAM;
    return 0; /* nothing yet: MHD asks again */
}

static void backend_done(k3_proxy *p, backend *b, bool ok);

static void relay_free(void *cls) {
    relay *r = cls;
    backend_done(r->p, r->b,
                 r->ended_ok || r->c.client_left || r->c.ended || (r->c.got_status && !r->failed && r->c.status < 500));
    curl_multi_remove_handle(r->m, r->c.h);
    curl_multi_cleanup(r->m);
    call_free(&r->c);
    k3_buf_free(&r->tail);
    json_decref(r->resp);
    atomic_fetch_sub(&r->b->inflight, 1);
    free(r);
}

/* ---- routes ------------------------------------------------------------------------------------- */

/* Paths that take a JSON POST yet generate nothing: sent to a decode instance as they are. */
static bool passthrough_post(const char *url) {
    static const char *const paths[] = {"/tokenize", "/detokenize", "/v1/messages/count_tokens", "/v1/embeddings"};
    for (size_t i = 0; i < sizeof paths / sizeof *paths; i++)
        if (!strcmp(url, paths[i])) return true;
    return false;
}

/* method url body to a decode instance, its answer relayed. */
static enum MHD_Result forward(k3_proxy *p, struct MHD_Connection *c, int route, const char *method, const char *url,
                               const char *body, size_t len) {
    unsigned tried = 0;
    char last[720] = "no decode instance";
    for (;;) {
        const int i = pick(p, p->dec, p->n_dec, tried);
        if (i < 0) return fail(p, c, route, 502, "no decode instance answered %s %s: %s", method, url, last);
        tried |= 1u << i;
        backend *b = &p->dec[i];
        call k;
        if (!call_init(&k, p, b, method, url, body, len, c, NULL)) return fail(p, c, route, 500, "out of memory");
        atomic_fetch_add(&b->inflight, 1);
        atomic_fetch_add(&b->requests, 1);
        k3_error err = {0};
        const bool ok = call_run(&k, &err);
        atomic_fetch_sub(&b->inflight, 1);
        if (k.ended || k.client_left) {
            const bool left = k.client_left;
            call_free(&k);
            return left ? MHD_NO : ended(p, c, route);
        }
        if (!ok || !k.got_status) {
            atomic_fetch_add(&b->failures, 1);
            atomic_store(&b->down_until, k3_now() + 2.0);
            snprintf(last, sizeof last, "%.200s: %.500s", b->url, err.msg);
            call_free(&k);
            continue;
        }
        char *text = malloc(k.out.len + 1);
        if (text) memcpy(text, k.out.p ? k.out.p : "", k.out.len);
        const enum MHD_Result r = relay_whole(p, c, k.status, text, k.out.len, k.ctype);
        call_free(&k);
        return r;
    }
}

/* The prefill leg: *kv_out gets the hold's kv_transfer_params (NULL: the
 * request goes whole to a decode instance). MHD_YES with *answered false
 * to go on; else the client has been answered (or is gone). */
static enum MHD_Result prefill_leg(k3_proxy *p, struct MHD_Connection *c, int route, const char *url, json_t *root,
                                   json_t **ans_out, bool *answered) {
    *answered = true;
    *ans_out = NULL;
    json_t *pre = json_deep_copy(root);
    if (!pre) return fail(p, c, route, 500, "out of memory");
    json_object_set_new(pre, "kv_transfer_params",
                        json_pack("{s:b,s:b,s:n,s:n,s:n,s:n}", "do_remote_decode", 1, "do_remote_prefill", 0,
                                  "remote_engine_id", "remote_block_ids", "remote_host", "remote_port"));
    json_object_set_new(pre, "stream", json_false());
    json_object_del(pre, "stream_options");
    static const char *const caps[] = {"max_tokens", "max_completion_tokens", "max_output_tokens"};
    for (size_t k = 0; k < sizeof caps / sizeof *caps; k++)
        if (json_object_get(pre, caps[k])) json_object_set_new(pre, caps[k], json_integer(1));
    if (strstr(url, "completions")) json_object_set_new(pre, "max_tokens", json_integer(1));
    char *pbody = json_dumps(pre, JSON_COMPACT);
    json_decref(pre);
    if (!pbody) return fail(p, c, route, 500, "out of memory");
    unsigned tried = 0;
    char last[720] = "no prefill instance";
    for (;;) {
        const int i = pick(p, p->pre, p->n_pre, tried);
        if (i < 0) {
            free(pbody);
            return fail(p, c, route, 502, "no prefill instance answered: %s", last);
        }
        tried |= 1u << i;
        backend *b = &p->pre[i];
        call k;
        if (!call_init(&k, p, b, "POST", url, pbody, strlen(pbody), c, NULL)) {
            free(pbody);
            return fail(p, c, route, 500, "out of memory");
        }
        atomic_fetch_add(&b->inflight, 1);
        atomic_fetch_add(&b->requests, 1);
        k3_error err = {0};
        const bool ok = call_run(&k, &err);
        atomic_fetch_sub(&b->inflight, 1);
        if (k.client_left || k.ended) {
            const bool left = k.client_left;
            call_free(&k);
            free(pbody);
            return left ? MHD_NO : ended(p, c, route);
        }
        if (!ok || !k.got_status) {
            atomic_fetch_add(&b->failures, 1);
            atomic_store(&b->down_until, k3_now() + 2.0);
            snprintf(last, sizeof last, "%.200s: %.500s", b->url, err.msg);
            call_free(&k);
            continue;
        }
        free(pbody);
        if (k.status == 400 && k.out.len && memmem(k.out.p, k.out.len, K3_PD_NOT_SPLIT, strlen(K3_PD_NOT_SPLIT))) {
            /* several prompts or choices: the decode instance computes it whole */
            call_free(&k);
            atomic_fetch_add(&p->whole, 1);
            *answered = false;
            return MHD_YES;
        }
        if (k.status != 200) { /* the prefill instance's own refusal: the client's */
            char *text = malloc(k.out.len + 1);
            if (text) memcpy(text, k.out.p ? k.out.p : "", k.out.len);
            const enum MHD_Result r = relay_whole(p, c, k.status, text, k.out.len, k.ctype);
            call_free(&k);
            return r;
        }
        *ans_out = json_loadb(k.out.p ? k.out.p : "", k.out.len, 0, NULL);
        call_free(&k);
        *answered = false;
        return MHD_YES;
    }
}

/* The leg that answers the client: body (taken) to one of l->bs (l->choose's pick, then another
 * not tried when it cannot be reached: it is marked down), its answer or stream relayed as it
 * comes. The decode leg of prefill/decode disaggregation and the router's one leg. */
typedef struct leg {
    backend *bs; /* the backends it may use */
    int n;
    int (*choose)(k3_proxy *p, const struct leg *l, unsigned tried); /* an index not in tried, or -1 */
    const int32_t *key;                                              /* the router's: the prompt's key */
    int64_t n_key;
    char *cred; /* the proxy's credential over kv_transfer_params ("" or NULL: none) */
    json_t *kv; /* the hold to release when no backend takes the request, or NULL */
    /* prefill/decode: the client's request, and the prefill's answer (*ans, owned by the caller)
     * that a retry replaces with a fresh hold */
    json_t *root, **ans;
    const char *what; /* "decode instance", "backend" */
} leg;

static int pick_least_loaded(k3_proxy *p, const leg *l, unsigned tried) { return pick(p, l->bs, l->n, tried); }

/* The router's choice among the backends not tried (the policy of src/router: the longest prefix
 * it sent there, balanced by load; a backend down gets a probe); it records the request there. */
static int choose_router(k3_proxy *p, const leg *l, unsigned tried) {
    pthread_mutex_lock(&p->rmu);
    const double now = k3_now();
    const k3_route rt = k3_router_route_excluding(p->router, l->key, l->n_key, now, tried);
    if (rt.backend < 0) {
        /* none healthy: the least loaded not tried, whatever its health (it may be back) */
        const int i = pick(p, l->bs, l->n, tried);
        if (i >= 0) k3_router_sent(p->router, i, l->key, l->n_key, now);
        pthread_mutex_unlock(&p->rmu);
        if (i >= 0) atomic_fetch_add(&p->routed[K3_ROUTE_NONE], 1);
        return i;
    }
    pthread_mutex_unlock(&p->rmu);
    atomic_fetch_add(&p->routed[rt.why], 1);
    atomic_fetch_add(&p->matched_bytes, rt.matched_tokens);
    return rt.backend;
}

static char *decode_body(k3_proxy *p, json_t *root, json_t *kv, char cred[2 * K3_PD_KEY_BYTES + 1]);

static enum MHD_Result answer_leg(k3_proxy *p, struct MHD_Connection *c, int route, const char *url, char *body,
                                  bool stream, leg *l) {
    unsigned tried = 0;
    char last[720];
    snprintf(last, sizeof last, "no %s", l->what);
    for (;;) {
        const int i = l->choose(p, l, tried);
        if (i < 0) {
            if (l->kv) release_hold(p, l->kv);
            free(body);
            return fail(p, c, route, 502, "no %s answered: %s", l->what, last);
        }
        if (tried && l->ans && l->kv) {
            /* the instance tried before may have begun pulling the hold, which
             * is good for one pull only: the next one gets a fresh hold */
            release_hold(p, l->kv);
            json_decref(*l->ans);
            *l->ans = NULL;
            l->kv = NULL;
            free(body);
            bool answered;
            const enum MHD_Result again = prefill_leg(p, c, route, url, l->root, l->ans, &answered);
            if (answered) return again;
            json_t *kv = json_is_object(*l->ans) ? json_object_get(*l->ans, "kv_transfer_params") : NULL;
            l->kv = json_is_object(kv) ? kv : NULL;
            if (!(body = decode_body(p, l->root, l->kv, l->cred))) {
                if (l->kv) release_hold(p, l->kv);
                return fail(p, c, route, 500, "out of memory");
            }
        }
        tried |= 1u << i;
        backend *b = &l->bs[i];
        relay *r = calloc(1, sizeof *r);
        if (!r || !call_init(&r->c, p, b, "POST", url, body, strlen(body), c, l->cred && l->cred[0] ? l->cred : NULL)) {
            free(r);
            backend_done(p, b, true);
            if (l->kv) release_hold(p, l->kv);
            free(body);
            return fail(p, c, route, 500, "out of memory");
        }
        r->p = p;
        r->b = b;
        r->route = route;
        atomic_fetch_add(&b->inflight, 1);
        atomic_fetch_add(&b->requests, 1);
        if (!stream) {
            k3_error err = {0};
            const bool ok = call_run(&r->c, &err);
            atomic_fetch_sub(&b->inflight, 1);
            const bool gone = r->c.client_left, end = r->c.ended;
            /* a backend that answered (not with a server error), or a call the client or the proxy ended */
            backend_done(p, b, (ok && r->c.got_status && r->c.status < 500) || gone || end);
            if (ok && r->c.got_status && !end && !gone) {
                char *text = malloc(r->c.out.len + 1);
                if (text) memcpy(text, r->c.out.p ? r->c.out.p : "", r->c.out.len);
                const enum MHD_Result ret = relay_whole(p, c, r->c.status, text, r->c.out.len, r->c.ctype);
                call_free(&r->c);
                free(r);
                free(body);
                return ret;
            }
            call_free(&r->c);
            free(r);
            if (gone || end) {
                free(body);
                return gone ? MHD_NO : ended(p, c, route);
            }
            atomic_fetch_add(&b->failures, 1);
            atomic_store(&b->down_until, k3_now() + 2.0);
            snprintf(last, sizeof last, "%.200s: %.500s", b->url, err.msg);
            continue;
        }
        /* a stream: relayed once the decode instance has answered its status */
        r->m = curl_multi_init();
        if (!r->m) {
            atomic_fetch_sub(&b->inflight, 1);
            backend_done(p, b, true);
            call_free(&r->c);
            free(r);
            if (l->kv) release_hold(p, l->kv);
            free(body);
            return fail(p, c, route, 500, "out of memory");
        }
        curl_multi_add_handle(r->m, r->c.h);
        while (!r->done && !r->c.got_status && !k3_http_client_gone(c) && !r->c.ended) relay_pump(r, 100);
        const bool answered_status = r->c.got_status;
        if (!answered_status || (r->done && r->failed && r->c.out.len == 0)) {
            const bool gone = k3_http_client_gone(c), end = r->c.ended;
            if (!end) {
                atomic_fetch_add(&b->failures, 1);
                atomic_store(&b->down_until, k3_now() + 2.0);
            }
            snprintf(last, sizeof last, "%.200s: %.500s", b->url, r->c.errbuf[0] ? r->c.errbuf : "no answer");
            if (gone || end) r->ended_ok = true; /* not the backend's failure */
            relay_free(r);
            if (gone || end) {
                free(body);
                return gone ? MHD_NO : ended(p, c, route);
            }
            continue;
        }
        curl_easy_getinfo(r->c.h, CURLINFO_RESPONSE_CODE, &r->c.status);
        free(body);
        if (r->c.status != 200) atomic_fetch_add(&p->errors, 1);
        return k3_http_queue_stream(p->http, c, r->c.status ? (unsigned)r->c.status : 200,
                                    r->c.ctype[0] ? r->c.ctype : "text/event-stream", relay_read, r, relay_free);
    }
}


/* The prompt's key for the router's tree: the fields that make a prompt, in the order a template
 * renders them, as compact JSON -- a conversation that grows keeps its key's prefix (the router
 * sees text, as SGLang's does; no tokenizer here). One int32 per byte. NULL when none. */
static int32_t *prompt_key(json_t *root, int64_t *n) {
    static const char *const fields[] = {"instructions", "system", "tools", "prompt", "messages", "input"};
    k3_buf b = {0};
    for (size_t i = 0; i < sizeof fields / sizeof *fields; i++) {
        json_t *v = json_object_get(root, fields[i]);
        if (!v) continue;
        char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        if (t) k3_buf_addf(&b, "%s:%s\n", fields[i], t);
        free(t);
    }
    *n = 0;
    if (b.oom || !b.len) {
        k3_buf_free(&b);
        return NULL;
    }
    int32_t *key = malloc(sizeof(int32_t) * b.len);
    if (key) {
        for (size_t i = 0; i < b.len; i++) key[i] = (unsigned char)b.p[i];
        *n = (int64_t)b.len;
    }
    k3_buf_free(&b);
    return key;
}

/* The router's generation request: whole to the backend its policy picks. */
static enum MHD_Result route_generate(k3_proxy *p, struct MHD_Connection *c, int route, const char *url, json_t *root) {
    int64_t n_key = 0;
    int32_t *key = prompt_key(root, &n_key);
    char *body = json_dumps(root, JSON_COMPACT);
    if (!body) {
        free(key);
        return fail(p, c, route, 500, "out of memory");
    }
    atomic_fetch_add(&p->key_bytes, n_key);
    leg l = {.bs = p->dec, .n = p->n_dec, .choose = choose_router, .key = key, .n_key = n_key, .what = "backend"};
    const enum MHD_Result ret = answer_leg(p, c, route, url, body, json_is_true(json_object_get(root, "stream")), &l);
    free(key);
    return ret;
}

/* The body a decode instance gets: the client's request with the prefill's
 * kv_transfer_params and the proxy's credential over them (cred); without
 * them -- a request sent whole, or a prefill instance that names no hold --
 * it computes the prompt itself. NULL when out of memory. */
static char *decode_body(k3_proxy *p, json_t *root, json_t *kv, char cred[2 * K3_PD_KEY_BYTES + 1]) {
    json_t *dec = json_deep_copy(root);
    cred[0] = 0;
    if (dec && json_is_object(kv)) {
        json_object_set(dec, "kv_transfer_params", kv);
        credential(p, kv, cred);
    } else if (dec) {
        json_object_del(dec, "kv_transfer_params");
    }
    char *body = dec ? json_dumps(dec, JSON_COMPACT) : NULL;
    json_decref(dec);
    return body;
}

static enum MHD_Result generate(k3_proxy *p, struct MHD_Connection *c, int route, const char *url, json_t *root) {
    if (p->router) return route_generate(p, c, route, url, root);
    /* 1. the prefill instance: one token, no stream, kept for a decode instance */
    json_t *ans = NULL;
    bool answered;
    const enum MHD_Result pr = prefill_leg(p, c, route, url, root, &ans, &answered);
    if (answered) return pr;
    json_t *kv = json_is_object(ans) ? json_object_get(ans, "kv_transfer_params") : NULL;
    /* 2. a decode instance */
    char cred[2 * K3_PD_KEY_BYTES + 1];
    char *dbody = decode_body(p, root, kv, cred);
    if (!dbody || k3_http_client_gone(c)) {
        if (json_is_object(kv)) release_hold(p, kv);
        json_decref(ans);
        free(dbody);
        return dbody ? MHD_NO : fail(p, c, route, 500, "out of memory");
    }
    leg l = {.bs = p->dec,
             .n = p->n_dec,
             .choose = pick_least_loaded,
             .cred = cred,
             .kv = json_is_object(kv) ? kv : NULL,
             .root = root,
             .ans = &ans,
             .what = "decode instance"};
    const enum MHD_Result ret = answer_leg(p, c, route, url, dbody, json_is_true(json_object_get(root, "stream")), &l);
    json_decref(ans);
    return ret;
}

static enum MHD_Result health(k3_proxy *p, struct MHD_Connection *c) {
    if (k3_http_phase(p->http) != K3_HTTP_RUNNING) return fail(p, c, R_HEALTH, 503, "the server is shutting down");
    int up_pre = 0, up_dec = 0;
    for (int i = 0; i < p->n_pre; i++) up_pre += atomic_load(&p->pre[i].up);
    for (int i = 0; i < p->n_dec; i++) up_dec += atomic_load(&p->dec[i].up);
    if (p->router)
        return up_dec ? k3_http_queue(p->http, c, 200, NULL, 0, "text/plain")
                      : fail(p, c, R_HEALTH, 503, "no backend is healthy");
    if (!up_pre || !up_dec)
        return fail(p, c, R_HEALTH, 503, "%s%s%s", up_pre ? "" : "no prefill instance is healthy",
                    !up_pre && !up_dec ? "; " : "", up_dec ? "" : "no decode instance is healthy");
    return k3_http_queue(p->http, c, 200, NULL, 0, "text/plain");
}

static size_t keep(char *ptr, size_t size, size_t n, void *arg) {
    k3_buf *b = arg;
    if (!b) return size * n;                      /* the body is not wanted */
    if (b->len + size * n > (8u << 20)) return 0; /* a backend's /metrics is far smaller */
    k3_buf_add(b, ptr, size * n);
    return b->oom ? 0 : size * n;
}

/* backend i of the prefill instances then the decode instances */
static backend *backend_at(k3_proxy *p, int i) { return i < p->n_pre ? &p->pre[i] : &p->dec[i - p->n_pre]; }

/* GETs path from every backend at once, within timeout_ms: status[i] (0: no
 * answer) and, where body is not NULL, body[i] (the caller frees them); with
 * auth, the proxy's key goes with each. False, nothing fetched, when out of
 * memory. */
static bool get_all(k3_proxy *p, const char *path, long timeout_ms, bool auth, long *status, k3_buf *body) {
    const int n = p->n_pre + p->n_dec;
    CURLM *m = curl_multi_init();
    CURL **h = calloc((size_t)n, sizeof *h);
    struct curl_slist *hdr = NULL;
    if (auth && p->api_key) {
        char v[1100];
        snprintf(v, sizeof v, "Authorization: Bearer %s", p->api_key);
        hdr = curl_slist_append(NULL, v);
    }
    const bool ok = m && h && !(auth && p->api_key && !hdr);
    for (int i = 0; ok && i < n; i++) {
        status[i] = 0;
        char url[1100];
        snprintf(url, sizeof url, "%s%s", backend_at(p, i)->url, path);
        if (!(h[i] = curl_easy_init())) continue;
        curl_easy_setopt(h[i], CURLOPT_URL, url);
        curl_easy_setopt(h[i], CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h[i], CURLOPT_TIMEOUT_MS, timeout_ms);
        curl_easy_setopt(h[i], CURLOPT_WRITEFUNCTION, keep);
        curl_easy_setopt(h[i], CURLOPT_WRITEDATA, body ? &body[i] : NULL);
        if (hdr) curl_easy_setopt(h[i], CURLOPT_HTTPHEADER, hdr);
        curl_multi_add_handle(m, h[i]);
    }
    for (int running = ok; running;) {
        curl_multi_perform(m, &running);
        if (running) curl_multi_poll(m, NULL, 0, 100, NULL);
    }
    for (int i = 0; h && i < n; i++)
        if (h[i]) {
            curl_easy_getinfo(h[i], CURLINFO_RESPONSE_CODE, &status[i]);
            curl_multi_remove_handle(m, h[i]);
            curl_easy_cleanup(h[i]);
        }
    curl_slist_free_all(hdr);
    curl_multi_cleanup(m);
    free(h);
    return ok;
}

/* The sum over every series of name (any labels) in a Prometheus text. */
static double series_sum(const char *text, size_t len, const char *name) {
    double sum = 0;
    const size_t nl = strlen(name);
    for (const char *ln = text, *end = text + len; ln < end;) {
        const char *eol = memchr(ln, '\n', (size_t)(end - ln));
        if (!eol) eol = end;
        if ((size_t)(eol - ln) > nl && !memcmp(ln, name, nl) && (ln[nl] == ' ' || ln[nl] == '{')) {
            const char *v = eol;
            while (v > ln && v[-1] != ' ') v--;
            char num[64];
            const size_t vl = (size_t)(eol - v) < sizeof num - 1 ? (size_t)(eol - v) : sizeof num - 1;
            memcpy(num, v, vl);
            num[vl] = 0;
            char *e;
            const double x = strtod(num, &e);
            if (e != num) sum += x;
        }
        ln = eol + 1;
    }
    return sum;
}

/* The engine's gauges summed over the backends that answer their /metrics
 * within a second (vllm:num_requests_running and _waiting: what a request
 * through the proxy is doing), and how many answered. */
enum { GAUGE_RUNNING, GAUGE_WAITING, GAUGE_COUNT };
static int backend_gauges(k3_proxy *p, double sums[GAUGE_COUNT]) {
    static const char *const names[GAUGE_COUNT] = {"vllm:num_requests_running", "vllm:num_requests_waiting"};
    for (int g = 0; g < GAUGE_COUNT; g++) sums[g] = 0;
    const int n = p->n_pre + p->n_dec;
    long *st = calloc((size_t)n, sizeof *st);
    k3_buf *out = calloc((size_t)n, sizeof *out);
    int answered = 0;
    if (st && out && get_all(p, "/metrics", 1000, true, st, out))
        for (int i = 0; i < n; i++)
            if (st[i] == 200 && out[i].p && !out[i].oom) {
                answered++;
                for (int g = 0; g < GAUGE_COUNT; g++) sums[g] += series_sum(out[i].p, out[i].len, names[g]);
            }
    for (int i = 0; out && i < n; i++) k3_buf_free(&out[i]);
    free(st);
    free(out);
    return answered;
}

/* The router's own series: requests by why it chose, the prompt bytes it found where it sent them,
 * and per backend its load, its tree share and what it was sent. */
static void router_metrics(k3_proxy *p, k3_buf *o) {
    static const char *const why[] =
        {[K3_ROUTE_NONE] = "none_healthy", [K3_ROUTE_AFFINITY] = "affinity", [K3_ROUTE_ROOM] = "new_prefix",
         [K3_ROUTE_BALANCE] = "balance",   [K3_ROUTE_PROBE] = "probe",       [K3_ROUTE_RR] = "round_robin"};
    k3_buf_addf(o,
                "# HELP k3:router_requests_total Generation requests routed, by why the backend was chosen.\n"
                "# TYPE k3:router_requests_total counter\n");
    for (int w = 0; w <= K3_ROUTE_RR; w++)
        k3_buf_addf(o, "k3:router_requests_total{reason=\"%s\"} %ld\n", why[w], atomic_load(&p->routed[w]));
    k3_buf_addf(o,
                "# HELP k3:router_prompt_bytes_total Bytes of the prompts' text (the tree's key) routed.\n"
                "# TYPE k3:router_prompt_bytes_total counter\nk3:router_prompt_bytes_total %ld\n"
                "# HELP k3:router_affinity_hit_bytes_total Bytes of those prompts the tree says the chosen backend "
                "was sent before (its prefix cache's likely hit).\n"
                "# TYPE k3:router_affinity_hit_bytes_total counter\nk3:router_affinity_hit_bytes_total %ld\n",
                atomic_load(&p->key_bytes), atomic_load(&p->matched_bytes));
    k3_router_backend rb[K3_ROUTER_MAX_BACKENDS];
    pthread_mutex_lock(&p->rmu);
    for (int i = 0; i < p->n_dec; i++) k3_router_backend_get(p->router, i, &rb[i]);
    pthread_mutex_unlock(&p->rmu);
    static const char *const series[][2] =
        {{"k3:router_backend_load", "Requests routed to the backend and not done (gauge)."},
         {"k3:router_backend_routed_total", "Requests routed to the backend (counter)."},
         {"k3:router_backend_tree_nodes", "Prefix tree nodes that name the backend (gauge)."},
         {"k3:router_backend_healthy", "1 while the router sends the backend requests (gauge)."}};
    for (int k = 0; k < 4; k++) {
        k3_buf_addf(o, "# HELP %s %s\n# TYPE %s %s\n", series[k][0], series[k][1], series[k][0],
                    k == 1 ? "counter" : "gauge");
        for (int i = 0; i < p->n_dec; i++) {
            const int64_t v = k == 0 ? rb[i].load : k == 1 ? rb[i].routed : k == 2 ? rb[i].cached : rb[i].healthy;
            k3_buf_addf(o, "%s{url=\"%s\"} %lld\n", series[k][0], p->dec[i].url, (long long)v);
        }
    }
}

static enum MHD_Result metrics(k3_proxy *p, struct MHD_Connection *c) {
    const char *dec_role = p->router ? "backend" : "decode";
    k3_buf o = {0};
    if (p->router) router_metrics(p, &o);
    double gauge[GAUGE_COUNT];
    const int scraped = backend_gauges(p, gauge);
    k3_buf_addf(&o,
                "# HELP vllm:num_requests_running Requests in model execution batches, summed over the backends.\n"
                "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running %.0f\n"
                "# HELP vllm:num_requests_waiting Requests waiting to be processed, summed over the backends.\n"
                "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting %.0f\n"
                "# HELP k3:proxy_backends_scraped Backends whose /metrics answered for these sums.\n"
                "# TYPE k3:proxy_backends_scraped gauge\nk3:proxy_backends_scraped %d\n",
                gauge[GAUGE_RUNNING], gauge[GAUGE_WAITING], scraped);
    k3_buf_addf(&o,
                "# HELP k3:proxy_requests_total Requests the proxy took.\n# TYPE k3:proxy_requests_total counter\n"
                "k3:proxy_requests_total %ld\n"
                "# HELP k3:proxy_errors_total Requests answered with an error.\n# TYPE k3:proxy_errors_total counter\n"
                "k3:proxy_errors_total %ld\n"
                "# HELP k3:proxy_holds_released_total Holds released because no decode instance took the request.\n"
                "# TYPE k3:proxy_holds_released_total counter\nk3:proxy_holds_released_total %ld\n"
                "# HELP k3:proxy_whole_requests_total Requests sent whole to a decode instance (several prompts or "
                "choices).\n# TYPE k3:proxy_whole_requests_total counter\nk3:proxy_whole_requests_total %ld\n"
                "# HELP k3:proxy_backend_inflight Requests in flight per backend.\n# TYPE k3:proxy_backend_inflight "
                "gauge\n",
                atomic_load(&p->requests), atomic_load(&p->errors), atomic_load(&p->released), atomic_load(&p->whole));
    for (int side = 0; side < 2; side++)
        for (int i = 0; i < (side ? p->n_dec : p->n_pre); i++) {
            backend *b = side ? &p->dec[i] : &p->pre[i];
            k3_buf_addf(&o, "k3:proxy_backend_inflight{role=\"%s\",url=\"%s\"} %d\n", side ? dec_role : "prefill",
                        b->url, atomic_load(&b->inflight));
        }
    k3_buf_addf(&o,
                "# HELP k3:proxy_backend_failures_total Calls to a backend that got no answer.\n"
                "# TYPE k3:proxy_backend_failures_total counter\n");
    for (int side = 0; side < 2; side++)
        for (int i = 0; i < (side ? p->n_dec : p->n_pre); i++) {
            backend *b = side ? &p->dec[i] : &p->pre[i];
            k3_buf_addf(&o, "k3:proxy_backend_failures_total{role=\"%s\",url=\"%s\"} %ld\n",
                        side ? dec_role : "prefill", b->url, atomic_load(&b->failures));
        }
    k3_buf_addf(&o,
                "# HELP k3:proxy_backend_up 1 when the backend's /health answered 200 at the last probe.\n"
                "# TYPE k3:proxy_backend_up gauge\n");
    for (int side = 0; side < 2; side++)
        for (int i = 0; i < (side ? p->n_dec : p->n_pre); i++) {
            backend *b = side ? &p->dec[i] : &p->pre[i];
            k3_buf_addf(&o, "k3:proxy_backend_up{role=\"%s\",url=\"%s\"} %d\n", side ? dec_role : "prefill", b->url,
                        atomic_load(&b->up) ? 1 : 0);
        }
    k3_http_metrics_render(p->http, NULL, &o);
    if (o.oom || !o.p) {
        k3_buf_free(&o);
        return fail(p, c, R_METRICS, 500, "out of memory");
    }
    return k3_http_queue(p->http, c, 200, o.p, o.len, "text/plain; version=0.0.4; charset=utf-8");
}

static void find(void *arg, const char *method, const char *url, k3_http_route *out) {
    k3_proxy *p = arg;
    const bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if (!strcmp(url, "/health")) {
        *out = (k3_http_route){.route = ROUTE(R_HEALTH), .method_ok = get, .allow = "GET", .during_drain = true};
        return;
    }
    if (!strcmp(url, "/metrics")) {
        *out = (k3_http_route){.route = ROUTE(R_METRICS),
                               .method_ok = get,
                               .allow = "GET",
                               .needs_key = p->metrics_key,
                               .during_drain = true};
        return;
    }
    /* the rest is the backends': every path asks for the key (nothing tells
     * which exist); the shape of errors by the API's path */
    const int r = !strncmp(url, "/v1/messages", 12) ? R_MESSAGES
        : !strncmp(url, "/v1/responses", 13)        ? R_RESPONSES
                                                    : R_OPENAI;
    static const char *const methods[] = {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"};
    bool known = false;
    for (size_t i = 0; i < sizeof methods / sizeof *methods; i++) known |= !strcmp(method, methods[i]);
    *out = (k3_http_route){.route = ROUTE(r), .method_ok = known, .allow = "GET, POST", .needs_key = true};
}

static enum MHD_Result dispatch(void *arg, struct MHD_Connection *c, const void *route, const char *url,
                                const char *method, const k3_buf *body, bool too_big) {
    k3_proxy *p = arg;
    atomic_fetch_add(&p->requests, 1);
    const int r = ROUTE_OF(route);
    if (r == R_HEALTH) return health(p, c);
    if (r == R_METRICS) return metrics(p, c);
    if (strcmp(method, "POST") || passthrough_post(url)) return forward(p, c, r, method, url, body->p, body->len);
    json_t *root = body->len ? json_loadb(body->p, body->len, 0, NULL) : NULL;
    if (!json_is_object(root)) { /* not a generation: the decode instance answers (or refuses) it */
        json_decref(root);
        return forward(p, c, r, method, url, body->p, body->len);
    }
    const enum MHD_Result ret = generate(p, c, r, url, root);
    json_decref(root);
    return ret;
}

/* ---- the backends' health --------------------------------------------------------------------- */

static void probe_all(k3_proxy *p, long timeout_ms) {
    const int n = p->n_pre + p->n_dec;
    long *status = calloc((size_t)n, sizeof *status);
    if (!status || !get_all(p, "/health", timeout_ms, false, status, NULL)) {
        free(status);
        return;
    }
    for (int i = 0; i < n; i++) {
        backend *b = backend_at(p, i);
        const long st = status[i];
        const bool was = atomic_exchange(&b->up, st == 200);
        if (p->router && b->rix >= 0) {
            /* the router learns a backend that went down or came back (a restart: back, empty) */
            pthread_mutex_lock(&p->rmu);
            k3_router_backend rb;
            k3_router_backend_get(p->router, b->rix, &rb);
            if (st != 200 && (was || rb.healthy)) k3_router_set_health(p->router, b->rix, false, k3_now());
            if (st == 200 && !rb.healthy) k3_router_set_health(p->router, b->rix, true, k3_now());
            pthread_mutex_unlock(&p->rmu);
        }
    }
    free(status);
}

static void *prober_main(void *arg) {
    k3_proxy *p = arg;
    pthread_mutex_lock(&p->mu);
    while (!p->quit) {
        pthread_mutex_unlock(&p->mu);
        probe_all(p, 2000);
        pthread_mutex_lock(&p->mu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        if (!p->quit) pthread_cond_timedwait(&p->cv, &p->mu, &ts);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* ---- start / stop ------------------------------------------------------------------------------- */

static k3_status backends(backend **out, const char *const *urls, int n, const char *what, k3_error *err) {
    if (n < 1 || n > 32) return k3_err(err, K3_ERR_ARG, "proxy: %d %s instances (1 to 32)", n, what);
    backend *b = calloc((size_t)n, sizeof *b);
    if (!b) return k3_err(err, K3_ERR_NOMEM, "proxy: out of memory");
    *out = b;
    for (int i = 0; i < n; i++) {
        const char *u = urls[i];
        if (strncmp(u, "http://", 7) || strlen(u) < 8 || strlen(u) > 1000)
            return k3_err(err, K3_ERR_ARG, "proxy: %s URL '%s' is not http://HOST:PORT", what, u);
        b[i].url = strdup(u);
        if (!b[i].url) return k3_err(err, K3_ERR_NOMEM, "proxy: out of memory");
        size_t l = strlen(b[i].url);
        while (l > 7 && b[i].url[l - 1] == '/') b[i].url[--l] = 0;
        atomic_init(&b[i].inflight, 0);
        atomic_init(&b[i].down_until, 0.0);
        atomic_init(&b[i].up, false);
        b[i].rix = -1;
    }
    return K3_OK;
}

static void proxy_free(k3_proxy *p) {
    for (int i = 0; p->pre && i < p->n_pre; i++) free(p->pre[i].url);
    for (int i = 0; p->dec && i < p->n_dec; i++) free(p->dec[i].url);
    free(p->pre);
    free(p->dec);
    free(p->api_key);
    k3_router_close(p->router);
    pthread_mutex_destroy(&p->rmu);
    memset(&p->keys, 0, sizeof p->keys);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}

k3_status k3_proxy_start(k3_proxy **out, const k3_proxy_options *o, k3_error *err) {
    *out = NULL;
    if (!o || o->port < 0 || o->port > 65535) return k3_err(err, K3_ERR_ARG, "proxy: bad options (port)");
    if (o->api_key && !*o->api_key)
        return k3_err(err, K3_ERR_ARG, "proxy: the API key is empty: give a key, or none to serve without one");
    static atomic_bool curl_ready;
    if (!atomic_exchange(&curl_ready, true)) curl_global_init(CURL_GLOBAL_DEFAULT);
    k3_proxy *p = calloc(1, sizeof *p);
    if (!p) return k3_err(err, K3_ERR_NOMEM, "proxy: out of memory");
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    pthread_mutex_init(&p->rmu, NULL);
    k3_status st = K3_OK;
    if (o->n_backends > 0) {
        /* the router: the backends take the decode instances' place, each whole */
        if (o->n_prefill || o->n_decode)
            st = k3_err(err, K3_ERR_ARG, "proxy: a router's backends, or prefill and decode instances, not both");
        p->n_dec = o->n_backends;
        if (!st) st = backends(&p->dec, o->backends, o->n_backends, "backend", err);
        const k3_router_options ro = {.n_backends = o->n_backends,
                                      .block_size = o->router_block_bytes,
                                      .cache_threshold = o->router_cache_threshold,
                                      .balance_abs = o->router_balance_abs,
                                      .balance_rel = o->router_balance_rel,
                                      .max_nodes = 1 << 18,
                                      .policy = (k3_router_policy)o->router_policy};
        if (!st) st = k3_router_open(&p->router, &ro, err);
        for (int i = 0; !st && i < p->n_dec; i++) p->dec[i].rix = i;
    } else {
        p->n_pre = o->n_prefill;
        p->n_dec = o->n_decode;
        st = backends(&p->pre, o->prefill, o->n_prefill, "prefill", err);
        if (!st) st = backends(&p->dec, o->decode, o->n_decode, "decode", err);
        if (!st) st = k3_pd_keys_derive(&p->keys, o->secret, o->secret_len, err);
    }
    if (st) {
        proxy_free(p);
        return st;
    }
    p->api_key = o->api_key ? strdup(o->api_key) : NULL;
    p->metrics_key = o->metrics_require_key;
    p->timeout = o->timeout_s > 0 ? o->timeout_s : 600;
    if (o->api_key && !p->api_key) {
        proxy_free(p);
        return k3_err(err, K3_ERR_NOMEM, "proxy: out of memory");
    }
    /* the backends' health before the first client asks */
    probe_all(p, 1000);
    if (pthread_create(&p->prober, NULL, prober_main, p)) {
        proxy_free(p);
        return k3_err(err, K3_ERR_NOMEM, "proxy: cannot start a thread");
    }
    p->prober_started = true;
    const k3_http_options ho = {.host = o->host,
                                .port = o->port,
                                .api_key = o->api_key,
                                .max_body_bytes = o->max_body_bytes,
                                .max_connections = o->max_connections ? o->max_connections : 1024,
                                .max_connections_per_ip = o->max_connections_per_ip,
                                .timeout_s = o->idle_timeout_s,
                                .header_timeout_s = o->header_timeout_s,
                                .body_timeout_s = o->body_timeout_s,
                                .allowed_origins = o->allowed_origins,
                                .allowed_methods = o->allowed_methods,
                                .allowed_headers = o->allowed_headers};
    const k3_http_app app = {.arg = p, .find = find, .error = on_error, .dispatch = dispatch};
    if (k3_http_start(&p->http, &ho, &app, err)) {
        st = err ? err->status : K3_ERR_IO;
        k3_proxy_stop(p);
        return st;
    }
    *out = p;
    return K3_OK;
}

int k3_proxy_port(const k3_proxy *p) { return k3_http_port(p->http); }

void k3_proxy_drain(k3_proxy *p) { k3_http_drain(p->http); }

int k3_proxy_in_flight(k3_proxy *p) { return k3_http_in_flight(p->http); }

void k3_proxy_end(k3_proxy *p, const char *why) { k3_http_end(p->http, why); }

void k3_proxy_stop(k3_proxy *p) {
    if (!p) return;
    atomic_store(&p->stopping, true);
    if (p->http) k3_http_stop(p->http);
    pthread_mutex_lock(&p->mu);
    p->quit = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (p->prober_started) pthread_join(p->prober, NULL);
    proxy_free(p);
}
