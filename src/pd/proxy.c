/*
 * proxy.c -- the one endpoint in front of prefill and decode instances
 * (k3_proxy of k3.h; k3 serve --role proxy): libmicrohttpd for the clients,
 * libcurl for the backends.
 *
 * A generation request (a POST whose body is a JSON object, on any path but
 * the few that do not generate) is sent to the least loaded prefill
 * instance as vLLM's proxies send it: kv_transfer_params
 * {"do_remote_decode": true}, one token, no stream; the kv_transfer_params
 * of its answer go with the client's own request to the least loaded decode
 * instance, whose answer or stream is relayed as it comes. The proxy knows
 * no API surface: completions, chat and any other generating route (a k3
 * backend's or a vLLM backend's) go the same way. Other routes go to a decode instance
 * unchanged; /health and /metrics are the proxy's own.
 *
 * Failures: a backend that cannot be reached is marked down for a few
 * seconds and the next one tried (a decode instance that is down is
 * replaced by another, which pulls the same hold); when none answers the
 * client gets a 502 in OpenAI's error shape, and a hold made for it is
 * released on its prefill instance. A backend's own error (4xx, 5xx) is
 * relayed as it is. A decode stream cut short ends with an error event the
 * client sees. A client that leaves ends the backend request (the decode
 * instance sees it go, cancels and frees).
 */
#include <curl/curl.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
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
#include "pd/wire.h"

typedef struct backend {
    char *url; /* base, no trailing slash */
    atomic_int inflight;
    _Atomic double down_until; /* k3_now() before which it is skipped */
    atomic_long requests, failures;
} backend;

struct k3_proxy {
    struct MHD_Daemon *d;
    backend *pre, *dec;
    int n_pre, n_dec;
    char *api_key;
    double timeout;
    size_t max_body;
    unsigned max_conn;
    atomic_int n_conn;
    atomic_uint rr;
    atomic_bool stopping;
    int port;
    atomic_long requests, errors, released;
};

typedef struct creq {
    k3_buf body;
    bool too_big, started;
} creq;

/* ---- answers ------------------------------------------------------------------------------------ */

static const char *err_type(unsigned status) {
    if (status == 401) return "AuthenticationError";
    if (status == 404) return "NotFoundError";
    if (status == 413 || status == 400) return "BadRequestError";
    if (status == 503) return "ServiceUnavailableError";
    return status >= 500 ? "InternalServerError" : "BadRequestError";
}

static char *error_json(unsigned status, const char *msg) {
    json_t *e = json_pack("{s:{s:s,s:s,s:n,s:i}}", "error", "message", msg, "type", err_type(status), "param", "code",
                          (int)status);
    char *t = e ? json_dumps(e, JSON_COMPACT) : NULL;
    json_decref(e);
    return t;
}

static enum MHD_Result queue(struct MHD_Connection *c, unsigned status, char *text, size_t len, const char *type) {
    if (!text) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type ? type : "application/json");
    if (status == 503) MHD_add_response_header(r, "Retry-After", "1");
    const enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result fail(k3_proxy *p, struct MHD_Connection *c, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static enum MHD_Result fail(k3_proxy *p, struct MHD_Connection *c, unsigned status, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    atomic_fetch_add(&p->errors, 1);
    char *t = error_json(status, msg);
    return queue(c, status, t, t ? strlen(t) : 0, "application/json");
}

static bool client_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return true;
    struct pollfd pf = {.fd = ci->connect_fd, .events = POLLRDHUP};
    if (poll(&pf, 1, 0) < 0) return false;
    return (pf.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
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

typedef struct call {
    CURL *h;
    struct curl_slist *hdr;
    k3_buf out;   /* the body as it comes */
    size_t taken; /* of it handed to the client (streams) */
    char ctype[128];
    long status;
    bool got_status;
    struct MHD_Connection *client; /* watched: a client that leaves ends the call */
    bool client_left;
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
    if (c->client && client_gone(c->client)) {
        c->client_left = true;
        return 1;
    }
    return 0;
}

static bool call_init(call *c, k3_proxy *p, const backend *b, const char *method, const char *path, const char *body,
                      size_t len, struct MHD_Connection *client) {
    memset(c, 0, sizeof *c);
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
    c->hdr = curl_slist_append(NULL, "Content-Type: application/json");
    c->hdr = curl_slist_append(c->hdr, "Expect:");
    if (client) {
        const char *auth = MHD_lookup_connection_value(client, MHD_HEADER_KIND, "Authorization");
        if (auth) {
            char h[1024];
            snprintf(h, sizeof h, "Authorization: %s", auth);
            c->hdr = curl_slist_append(c->hdr, h);
        }
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

/* The hold a prefill answer named, released on its prefill instance (the
 * request will not reach a decode instance). */
static void release_hold(k3_proxy *p, json_t *kv) {
    json_t *host = json_object_get(kv, "remote_host"), *port = json_object_get(kv, "remote_port"),
           *rid = json_object_get(kv, "remote_request_id");
    if (!json_is_string(host) || !json_is_integer(port)) return;
    uint64_t hold = 0;
    if (json_is_string(rid)) hold = strtoull(json_string_value(rid), NULL, 10);
    else if (json_is_integer(rid)) hold = (uint64_t)json_integer_value(rid);
    if (!hold) return;
    const int fd = k3_pd_connect(json_string_value(host), (int)json_integer_value(port), 2.0, NULL);
    if (fd < 0) return;
    k3_pd_req r = {.op = K3_PD_RELEASE, .hold = hold};
    k3_pd_req_seal(&r);
    k3_pd_send(fd, &r, sizeof r, NULL, 0, "a release", NULL);
    close(fd);
    atomic_fetch_add(&p->released, 1);
}

/* ---- a stream from a decode instance ------------------------------------------------------------ */

typedef struct relay {
    k3_proxy *p;
    backend *b;
    call c;
    CURLM *m;
    bool done, failed, tail_sent;
    char tail[1200]; /* the error event after a stream cut short */
    size_t tail_len, tail_pos;
} relay;

/* Drives the transfer until there are bytes beyond taken, or it ends. */
static void relay_pump(relay *r, int wait_ms) {
    while (!r->done && r->c.out.len <= r->c.taken) {
        int running = 0;
        curl_multi_perform(r->m, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(r->m, &left)))
            if (msg->msg == CURLMSG_DONE) {
                r->done = true;
                r->failed = msg->data.result != CURLE_OK;
                if (r->failed) {
                    char m[1024];
                    snprintf(m, sizeof m, "the decode instance %s broke off the stream: %s", r->b->url,
                             r->c.errbuf[0] ? r->c.errbuf : curl_easy_strerror(msg->data.result));
                    char *t = error_json(502, m);
                    r->tail_len = t ? (size_t)snprintf(r->tail, sizeof r->tail, "data: %s\n\ndata: [DONE]\n\n", t) : 0;
                    if (r->tail_len >= sizeof r->tail) r->tail_len = sizeof r->tail - 1;
                    free(t);
                }
            }
        if (r->done || r->c.out.len > r->c.taken || (r->c.got_status && wait_ms == 0)) break;
        curl_multi_poll(r->m, NULL, 0, wait_ms > 0 ? wait_ms : 100, NULL);
    }
}

static ssize_t relay_read(void *cls, uint64_t pos, char *buf, size_t max) {
    relay *r = cls;
    if (atomic_load(&r->p->stopping)) return MHD_CONTENT_READER_END_WITH_ERROR;
    relay_pump(r, 100);
    if (r->c.out.len > r->c.taken) {
        size_t n = r->c.out.len - r->c.taken;
        if (n > max) n = max;
        memcpy(buf, r->c.out.p + r->c.taken, n);
        r->c.taken += n;
        if (r->c.taken == r->c.out.len) r->c.out.len = r->c.taken = 0;
        return (ssize_t)n;
    }
    if (r->done && r->failed && r->tail_pos < r->tail_len) {
        size_t n = r->tail_len - r->tail_pos;
        if (n > max) n = max;
        memcpy(buf, r->tail + r->tail_pos, n);
        r->tail_pos += n;
        return (ssize_t)n;
    }
    if (r->done) return MHD_CONTENT_READER_END_OF_STREAM;
    return 0; /* nothing yet: MHD asks again */
}

static void relay_free(void *cls) {
    relay *r = cls;
    curl_multi_remove_handle(r->m, r->c.h);
    curl_multi_cleanup(r->m);
    call_free(&r->c);
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
static enum MHD_Result forward(k3_proxy *p, struct MHD_Connection *c, const char *method, const char *url,
                               const char *body, size_t len) {
    unsigned tried = 0;
    char last[720] = "no decode instance";
    for (;;) {
        const int i = pick(p, p->dec, p->n_dec, tried);
        if (i < 0) return fail(p, c, 502, "no decode instance answered %s %s: %s", method, url, last);
        tried |= 1u << i;
        backend *b = &p->dec[i];
        call k;
        if (!call_init(&k, p, b, method, url, body, len, c)) return fail(p, c, 500, "out of memory");
        atomic_fetch_add(&b->inflight, 1);
        atomic_fetch_add(&b->requests, 1);
        k3_error err = {0};
        const bool ok = call_run(&k, &err);
        atomic_fetch_sub(&b->inflight, 1);
        if (!ok || !k.got_status) {
            atomic_fetch_add(&b->failures, 1);
            atomic_store(&b->down_until, k3_now() + 2.0);
            snprintf(last, sizeof last, "%.200s: %.500s", b->url, err.msg);
            const bool gone = k.client_left;
            call_free(&k);
            if (gone) return MHD_NO;
            continue;
        }
        char *text = malloc(k.out.len + 1);
        if (text) memcpy(text, k.out.p ? k.out.p : "", k.out.len);
        const enum MHD_Result r = queue(c, (unsigned)k.status, text, k.out.len, k.ctype[0] ? k.ctype : NULL);
        call_free(&k);
        return r;
    }
}

static enum MHD_Result generate(k3_proxy *p, struct MHD_Connection *c, const char *url, json_t *root) {
    /* 1. the prefill instance: one token, no stream, kept for a decode instance */
    json_t *pre = json_deep_copy(root);
    if (!pre) return fail(p, c, 500, "out of memory");
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
    if (!pbody) return fail(p, c, 500, "out of memory");
    unsigned tried = 0;
    char last[720] = "no prefill instance";
    json_t *ans = NULL;
    for (;;) {
        const int i = pick(p, p->pre, p->n_pre, tried);
        if (i < 0) {
            free(pbody);
            return fail(p, c, 502, "no prefill instance answered: %s", last);
        }
        tried |= 1u << i;
        backend *b = &p->pre[i];
        call k;
        if (!call_init(&k, p, b, "POST", url, pbody, strlen(pbody), c)) {
            free(pbody);
            return fail(p, c, 500, "out of memory");
        }
        atomic_fetch_add(&b->inflight, 1);
        atomic_fetch_add(&b->requests, 1);
        k3_error err = {0};
        const bool ok = call_run(&k, &err);
        atomic_fetch_sub(&b->inflight, 1);
        if (k.client_left) {
            call_free(&k);
            free(pbody);
            return MHD_NO;
        }
        if (!ok || !k.got_status) {
            atomic_fetch_add(&b->failures, 1);
            atomic_store(&b->down_until, k3_now() + 2.0);
            snprintf(last, sizeof last, "%.200s: %.500s", b->url, err.msg);
            call_free(&k);
            continue;
        }
        if (k.status != 200) { /* the prefill instance's own refusal: the client's */
            char *text = malloc(k.out.len + 1);
            if (text) memcpy(text, k.out.p ? k.out.p : "", k.out.len);
            atomic_fetch_add(&p->errors, 1);
            const enum MHD_Result r = queue(c, (unsigned)k.status, text, k.out.len, k.ctype[0] ? k.ctype : NULL);
            call_free(&k);
            free(pbody);
            return r;
        }
        ans = json_loadb(k.out.p ? k.out.p : "", k.out.len, 0, NULL);
        call_free(&k);
        break;
    }
    free(pbody);
    json_t *kv = json_is_object(ans) ? json_object_get(ans, "kv_transfer_params") : NULL;
    /* 2. the decode instance: the client's request with the prefill's params
     * (without them -- a prefill instance that names no hold -- it computes
     * the prompt itself) */
    json_t *dec = json_deep_copy(root);
    if (dec && json_is_object(kv)) json_object_set(dec, "kv_transfer_params", kv);
    else if (dec) json_object_del(dec, "kv_transfer_params");
    char *dbody = dec ? json_dumps(dec, JSON_COMPACT) : NULL;
    json_decref(dec);
    if (!dbody || client_gone(c)) {
        if (json_is_object(kv)) release_hold(p, kv);
        json_decref(ans);
        free(dbody);
        return dbody ? MHD_NO : fail(p, c, 500, "out of memory");
    }
    const bool stream = json_is_true(json_object_get(root, "stream"));
    tried = 0;
    snprintf(last, sizeof last, "no decode instance");
    for (;;) {
        const int i = pick(p, p->dec, p->n_dec, tried);
        if (i < 0) {
            if (json_is_object(kv)) release_hold(p, kv);
            json_decref(ans);
            free(dbody);
            return fail(p, c, 502, "no decode instance answered: %s", last);
        }
        tried |= 1u << i;
        backend *b = &p->dec[i];
        relay *r = calloc(1, sizeof *r);
        if (!r || !call_init(&r->c, p, b, "POST", url, dbody, strlen(dbody), c)) {
            free(r);
            json_decref(ans);
            free(dbody);
            return fail(p, c, 500, "out of memory");
        }
        r->p = p;
        r->b = b;
        atomic_fetch_add(&b->inflight, 1);
        atomic_fetch_add(&b->requests, 1);
        if (!stream) {
            k3_error err = {0};
            const bool ok = call_run(&r->c, &err);
            atomic_fetch_sub(&b->inflight, 1);
            const bool gone = r->c.client_left;
            if (ok && r->c.got_status) {
                char *text = malloc(r->c.out.len + 1);
                if (text) memcpy(text, r->c.out.p ? r->c.out.p : "", r->c.out.len);
                if (r->c.status != 200) atomic_fetch_add(&p->errors, 1);
                const enum MHD_Result ret =
                    queue(c, (unsigned)r->c.status, text, r->c.out.len, r->c.ctype[0] ? r->c.ctype : NULL);
                call_free(&r->c);
                free(r);
                json_decref(ans);
                free(dbody);
                return ret;
            }
            atomic_fetch_add(&b->failures, 1);
            atomic_store(&b->down_until, k3_now() + 2.0);
            snprintf(last, sizeof last, "%.200s: %.500s", b->url, err.msg);
            call_free(&r->c);
            free(r);
            if (gone) {
                json_decref(ans);
                free(dbody);
                return MHD_NO;
            }
            continue;
        }
        /* a stream: relayed once the decode instance has answered its status */
        r->m = curl_multi_init();
        if (!r->m) {
            atomic_fetch_sub(&b->inflight, 1);
            call_free(&r->c);
            free(r);
            json_decref(ans);
            free(dbody);
            return fail(p, c, 500, "out of memory");
        }
        curl_multi_add_handle(r->m, r->c.h);
        while (!r->done && !r->c.got_status && !client_gone(c)) relay_pump(r, 100);
        const bool answered = r->c.got_status;
        if (!answered || (r->done && r->failed && r->c.out.len == 0)) {
            atomic_fetch_add(&b->failures, 1);
            atomic_store(&b->down_until, k3_now() + 2.0);
            snprintf(last, sizeof last, "%s: %s", b->url, r->c.errbuf[0] ? r->c.errbuf : "no answer");
            const bool gone = client_gone(c);
            relay_free(r);
            if (gone) {
                if (json_is_object(kv)) release_hold(p, kv);
                json_decref(ans);
                free(dbody);
                return MHD_NO;
            }
            continue;
        }
        curl_easy_getinfo(r->c.h, CURLINFO_RESPONSE_CODE, &r->c.status);
        json_decref(ans);
        free(dbody);
        struct MHD_Response *resp =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, relay_read, r, relay_free);
        if (!resp) {
            relay_free(r);
            return MHD_NO;
        }
        MHD_add_response_header(resp, "Content-Type", r->c.ctype[0] ? r->c.ctype : "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        const enum MHD_Result ret = MHD_queue_response(c, r->c.status ? (unsigned)r->c.status : 200, resp);
        MHD_destroy_response(resp);
        return ret;
    }
}

static enum MHD_Result metrics(k3_proxy *p, struct MHD_Connection *c) {
    k3_buf o = {0};
    k3_buf_addf(&o,
                "# HELP k3:proxy_requests_total Requests the proxy took.\n# TYPE k3:proxy_requests_total counter\n"
                "k3:proxy_requests_total %ld\n"
                "# HELP k3:proxy_errors_total Requests answered with an error.\n# TYPE k3:proxy_errors_total counter\n"
                "k3:proxy_errors_total %ld\n"
                "# HELP k3:proxy_holds_released_total Holds released because no decode instance took the request.\n"
                "# TYPE k3:proxy_holds_released_total counter\nk3:proxy_holds_released_total %ld\n"
                "# HELP k3:proxy_backend_inflight Requests in flight per backend.\n# TYPE k3:proxy_backend_inflight "
                "gauge\n",
                atomic_load(&p->requests), atomic_load(&p->errors), atomic_load(&p->released));
    for (int side = 0; side < 2; side++)
        for (int i = 0; i < (side ? p->n_dec : p->n_pre); i++) {
            backend *b = side ? &p->dec[i] : &p->pre[i];
            k3_buf_addf(&o, "k3:proxy_backend_inflight{role=\"%s\",url=\"%s\"} %d\n", side ? "decode" : "prefill",
                        b->url, atomic_load(&b->inflight));
        }
    k3_buf_addf(&o,
                "# HELP k3:proxy_backend_failures_total Calls to a backend that got no answer.\n"
                "# TYPE k3:proxy_backend_failures_total counter\n");
    for (int side = 0; side < 2; side++)
        for (int i = 0; i < (side ? p->n_dec : p->n_pre); i++) {
            backend *b = side ? &p->dec[i] : &p->pre[i];
            k3_buf_addf(&o, "k3:proxy_backend_failures_total{role=\"%s\",url=\"%s\"} %ld\n",
                        side ? "decode" : "prefill", b->url, atomic_load(&b->failures));
        }
    if (o.oom || !o.p) {
        k3_buf_free(&o);
        return fail(p, c, 500, "out of memory");
    }
    return queue(c, 200, o.p, o.len, "text/plain; version=0.0.4; charset=utf-8");
}

static bool auth_ok(const k3_proxy *p, struct MHD_Connection *c) {
    if (!p->api_key) return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncmp(h, "Bearer ", 7)) return false;
    h += 7;
    const size_t a = strlen(h), b = strlen(p->api_key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a; i++) diff |= (unsigned char)h[i] ^ (unsigned char)p->api_key[i % (b ? b : 1)];
    return diff == 0;
}

static enum MHD_Result dispatch(k3_proxy *p, struct MHD_Connection *c, const char *url, const char *method, creq *r) {
    atomic_fetch_add(&p->requests, 1);
    if (r->too_big) return fail(p, c, 413, "the request body is over the limit of %zu bytes", p->max_body);
    if (!strcmp(url, "/health") && (!strcmp(method, "GET") || !strcmp(method, "HEAD"))) {
        if (atomic_load(&p->stopping)) return fail(p, c, 503, "the proxy is shutting down");
        return queue(c, 200, strdup(""), 0, "text/plain");
    }
    if (!auth_ok(p, c)) return fail(p, c, 401, "a valid API key is needed: Authorization: Bearer KEY");
    if (!strcmp(url, "/metrics") && !strcmp(method, "GET")) return metrics(p, c);
    if (strcmp(method, "POST") || passthrough_post(url)) return forward(p, c, method, url, r->body.p, r->body.len);
    json_t *root = r->body.len ? json_loadb(r->body.p, r->body.len, 0, NULL) : NULL;
    if (!json_is_object(root)) { /* not a generation: the decode instance answers (or refuses) it */
        json_decref(root);
        return forward(p, c, method, url, r->body.p, r->body.len);
    }
    const enum MHD_Result ret = generate(p, c, url, root);
    json_decref(root);
    return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *data, size_t *data_size, void **con_cls) {
    k3_proxy *p = cls;
    creq *r = *con_cls;
    if (!r) {
        if (atomic_load(&p->n_conn) > (int)p->max_conn) return fail(p, c, 503, "too many connections");
        r = calloc(1, sizeof *r);
        if (!r) return MHD_NO;
        *con_cls = r;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) > p->max_body) r->too_big = true;
        return MHD_YES;
    }
    if (*data_size) {
        if (!r->too_big && r->body.len + *data_size > p->max_body) {
            r->too_big = true;
            k3_buf_free(&r->body);
        }
        if (!r->too_big) k3_buf_add(&r->body, data, *data_size);
        *data_size = 0;
        return MHD_YES;
    }
    if (r->started) return MHD_YES;
    r->started = true;
    if (r->body.oom) return fail(p, c, 500, "out of memory for the request body");
    return dispatch(p, c, url, method, r);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    creq *r = *con_cls;
    if (!r) return;
    k3_buf_free(&r->body);
    free(r);
    *con_cls = NULL;
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
    k3_proxy *p = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) atomic_fetch_add(&p->n_conn, 1);
    else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) atomic_fetch_sub(&p->n_conn, 1);
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
    }
    return K3_OK;
}

static void proxy_free(k3_proxy *p) {
    for (int i = 0; p->pre && i < p->n_pre; i++) free(p->pre[i].url);
    for (int i = 0; p->dec && i < p->n_dec; i++) free(p->dec[i].url);
    free(p->pre);
    free(p->dec);
    free(p->api_key);
    free(p);
}

k3_status k3_proxy_start(k3_proxy **out, const k3_proxy_options *o, k3_error *err) {
    *out = NULL;
    if (!o || o->port < 0 || o->port > 65535) return k3_err(err, K3_ERR_ARG, "proxy: bad options (port)");
    static atomic_bool curl_ready;
    if (!atomic_exchange(&curl_ready, true)) curl_global_init(CURL_GLOBAL_DEFAULT);
    k3_proxy *p = calloc(1, sizeof *p);
    if (!p) return k3_err(err, K3_ERR_NOMEM, "proxy: out of memory");
    p->n_pre = o->n_prefill;
    p->n_dec = o->n_decode;
    k3_status st = backends(&p->pre, o->prefill, o->n_prefill, "prefill", err);
    if (!st) st = backends(&p->dec, o->decode, o->n_decode, "decode", err);
    if (st) {
        proxy_free(p);
        return st;
    }
    p->api_key = o->api_key && *o->api_key ? strdup(o->api_key) : NULL;
    p->timeout = o->timeout_s > 0 ? o->timeout_s : 600;
    p->max_body = o->max_body_bytes ? o->max_body_bytes : (size_t)4 << 20;
    p->max_conn = o->max_connections > 0 ? (unsigned)o->max_connections : 1024u;
    const char *host = o->host ? o->host : "127.0.0.1";
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai = NULL;
    char port[16];
    snprintf(port, sizeof port, "%d", o->port);
    if (getaddrinfo(host, port, &hints, &ai) || !ai) {
        proxy_free(p);
        return k3_err(err, K3_ERR_ARG, "proxy: cannot resolve --host %s", host);
    }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    p->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, p, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                            MHD_OPTION_CONNECTION_LIMIT, p->max_conn + 64, MHD_OPTION_CONNECTION_TIMEOUT, 0u,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, p, MHD_OPTION_NOTIFY_CONNECTION, on_connection,
                            p, MHD_OPTION_THREAD_STACK_SIZE, (size_t)512 << 10, MHD_OPTION_LISTEN_BACKLOG_SIZE, 512u,
                            MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!p->d) {
        proxy_free(p);
        return k3_err(err, K3_ERR_IO, "proxy: cannot listen on %s port %d (in use?)", host, o->port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(p->d, MHD_DAEMON_INFO_BIND_PORT);
    p->port = di ? di->port : o->port;
    *out = p;
    return K3_OK;
}

int k3_proxy_port(const k3_proxy *p) { return p->port; }

void k3_proxy_stop(k3_proxy *p) {
    if (!p) return;
    atomic_store(&p->stopping, true);
    MHD_stop_daemon(p->d);
    proxy_free(p);
}
