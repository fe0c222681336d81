/*
 * server.c -- the HTTP layer of `k3 serve` on libmicrohttpd: one thread per
 * connection (a blocked generation waits in its own thread), the
 * connection table with its limits and deadlines, what is decided on the
 * request line and headers before any body byte is read (the limits, the
 * framing, CORS, the API key, the route), the body, and dispatch through the
 * routing table (routes.c); the phases of a shutdown. The engine thread is
 * engine_loop.c.
 *
 * Connections. Every open connection has a k3_srv_conn in s->conns: waiting
 * for a request (its line and headers), reading a body, or busy (its request
 * dispatched). A slow client cannot hold a slot for long: a reaper thread
 * closes a connection whose request line and headers are not in within
 * header_timeout_s of its opening (or of its previous answer), or whose body
 * is not in within body_timeout_s of its headers, with a 408 when the client
 * waits for an answer. One that arrives over the connection limit takes the
 * slot of the connection that has waited longest for its request (which is
 * closed: a trickling client, or an idle kept-alive one), so a normal client
 * is served while slow ones hold every slot; when every slot is busy it is
 * answered 503 with Retry-After at its request. A per-address cap answers
 * the same 503 to the connections of one address over it.
 *
 * Before the body. On the request line and headers (libmicrohttpd's first
 * call) a request is answered at once, its body never read, when: the
 * connection is over a limit (503), the server is shutting down (503),
 * its Content-Length values differ (400), its Transfer-Encoding is not
 * chunked (501), it has both a Content-Length and Transfer-Encoding:
 * chunked (400), its body is compressed (Content-Encoding: 415), it is a CORS
 * preflight (OPTIONS: 204, or 403 for an origin not allowed), its Origin is
 * not allowed (403), it lacks the API key (401), its path or method is
 * unknown (404, 405, 501), or its Content-Length is over the body limit
 * (413). So an unauthenticated client never has a body buffered.
 *
 * What libmicrohttpd (0.9.75) decides before any callback of ours: a
 * request line without a space (e.g. "GARBAGE") is closed unanswered
 * (parse_initial_message_line fails without queueing an answer); a bad
 * HTTP version, a header line without a colon or a Content-Length that is
 * not a number get its own 400 with an HTML body; a request line or headers
 * over its buffer a 414 or 431.
 */
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
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

/* ---- the connection table ------------------------------------------------- */

enum { CONN_WAIT = 0, CONN_BODY, CONN_BUSY };
enum { OVER_NONE = 0, OVER_TOTAL, OVER_IP };

struct k3_srv_conn {
    k3_srv_conn *prev, *next;
    struct MHD_Connection *c;
    int fd;
    struct sockaddr_storage addr;
    socklen_t alen;
    int state;    /* CONN_* */
    double since; /* when the state began */
    int n_req;    /* requests answered on it */
    bool closing; /* shut down by us: its slot is free */
    int over;     /* OVER_*: answered 503 at its request */
};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static bool same_addr(const k3_srv_conn *a, const k3_srv_conn *b) {
    if (a->addr.ss_family != b->addr.ss_family) return false;
    if (a->addr.ss_family == AF_INET)
        return ((const struct sockaddr_in *)&a->addr)->sin_addr.s_addr ==
            ((const struct sockaddr_in *)&b->addr)->sin_addr.s_addr;
    if (a->addr.ss_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)&a->addr)->sin6_addr,
                       &((const struct sockaddr_in6 *)&b->addr)->sin6_addr, sizeof(struct in6_addr));
    return false;
}

/* Closes k's connection from outside its thread (conn_mu held: the entry,
 * hence the descriptor, lives until its NOTIFY_CLOSED, which takes conn_mu
 * before libmicrohttpd closes the descriptor). A client that waits for an
 * answer (a first request, or a body) gets a 408 first; libmicrohttpd's
 * thread then reads the end and closes it. */
static void conn_close(struct k3_server *s, k3_srv_conn *k, bool answer, const char *why) {
    if (k->closing) return;
    k->closing = true;
    if (!k->over) s->n_live--;
    if (answer) {
        json_t *e = k3_srv_error_json(408, why);
        char *body = e ? json_dumps(e, JSON_COMPACT) : NULL;
        json_decref(e);
        char head[256];
        const int n = snprintf(head, sizeof head,
                               "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
                               "Content-Length: %zu\r\n\r\n",
                               body ? strlen(body) : 0);
        (void)!send(k->fd, head, (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (body) (void)!send(k->fd, body, strlen(body), MSG_DONTWAIT | MSG_NOSIGNAL);
        free(body);
    }
    shutdown(k->fd, SHUT_RDWR);
}

static void conn_set(struct k3_server *s, k3_srv_conn *k, int state) {
    if (!k) return;
    pthread_mutex_lock(&s->conn_mu);
    k->state = state;
    k->since = now_s();
    pthread_mutex_unlock(&s->conn_mu);
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
    struct k3_server *s = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        atomic_fetch_add(&s->n_conn, 1);
        k3_srv_conn *k = calloc(1, sizeof *k);
        *socket_context = k;
        if (!k) return; /* counted, untracked: no limit applies to it */
        k->c = c;
        const union MHD_ConnectionInfo *fi = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        k->fd = fi ? fi->connect_fd : -1;
        const union MHD_ConnectionInfo *ai = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        if (ai && ai->client_addr) {
            const socklen_t al =
                ai->client_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
            memcpy(&k->addr, ai->client_addr, al);
            k->alen = al;
        }
        k->since = now_s();
        pthread_mutex_lock(&s->conn_mu);
        k->next = s->conns;
        if (s->conns) s->conns->prev = k;
        s->conns = k;
        /* a connection over a limit holds no slot: it waits for its 503 */
        int from_ip = 0;
        k3_srv_conn *oldest = NULL;
        for (k3_srv_conn *o = s->conns; o; o = o->next) {
            if (o == k || o->closing || o->over) continue;
            if (s->max_conn_ip && same_addr(o, k)) from_ip++;
            if (o->state == CONN_WAIT && (!oldest || o->since < oldest->since)) oldest = o;
        }
        if (s->max_conn_ip && from_ip >= (int)s->max_conn_ip) {
            k->over = OVER_IP;
        } else if (s->n_live >= (int)s->max_conn) {
            /* the slot of the one that has waited longest for its request */
            if (oldest) {
                conn_close(s, oldest, false, NULL);
                pthread_mutex_lock(&s->metrics.mu);
                s->metrics.http_evicted++;
                pthread_mutex_unlock(&s->metrics.mu);
            } else {
                k->over = OVER_TOTAL;
            }
        }
        if (!k->over) s->n_live++;
        pthread_mutex_unlock(&s->conn_mu);
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        atomic_fetch_sub(&s->n_conn, 1);
        k3_srv_conn *k = *socket_context;
        if (!k) return;
        pthread_mutex_lock(&s->conn_mu);
        if (k->prev) k->prev->next = k->next;
        else s->conns = k->next;
        if (k->next) k->next->prev = k->prev;
        if (!k->closing && !k->over) s->n_live--;
        pthread_mutex_unlock(&s->conn_mu);
        free(k);
        *socket_context = NULL;
    }
}

static k3_srv_conn *conn_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* The deadlines, four times a second. */
static void *reaper_main(void *arg) {
    struct k3_server *s = arg;
    pthread_mutex_lock(&s->conn_mu);
    while (!s->reaper_quit) {
        const double now = now_s();
        int n_timeouts = 0;
        for (k3_srv_conn *k = s->conns; k; k = k->next) {
            if (k->closing) continue;
            if (k->state == CONN_WAIT && now - k->since > s->header_timeout_s) {
                /* a first request is answered; an idle kept-alive connection just closes */
                conn_close(s, k, k->n_req == 0,
                           "the request line and headers did not arrive in time (the server's --header-timeout)");
                n_timeouts++;
            } else if (k->state == CONN_BODY && now - k->since > s->body_timeout_s) {
                conn_close(s, k, true, "the request body did not arrive in time (the server's body timeout)");
                n_timeouts++;
            }
        }
        if (n_timeouts) {
            pthread_mutex_lock(&s->metrics.mu);
            s->metrics.http_timeouts += (uint64_t)n_timeouts;
            pthread_mutex_unlock(&s->metrics.mu);
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 250 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&s->reaper_cv, &s->conn_mu, &ts);
    }
    pthread_mutex_unlock(&s->conn_mu);
    return NULL;
}

/* ---- a request ----------------------------------------------------------------- */

typedef struct conn_req {
    k3_buf body;
    bool too_big;
    bool started;
    bool answered; /* answered on its headers: the body is not read */
    const k3_route *route;
} conn_req;

static char *dup_or(const char *s, const char *dflt) {
    const char *v = s && *s ? s : dflt;
    return v ? strdup(v) : NULL;
}

/* Constant-time comparison of a presented key with the server's. */
static bool key_equal(const char *h, size_t a, const char *key) {
    const size_t b = strlen(key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a; i++) diff |= (unsigned char)h[i] ^ (unsigned char)key[i % (b ? b : 1)];
    return diff == 0;
}

/* "Authorization: Bearer KEY" (the scheme in any case, RFC 7235) or
 * "x-api-key: KEY" (what the Anthropic API sends). */
static bool auth_ok(const struct k3_server *s, struct MHD_Connection *c) {
    if (!s->api_key) return true;
    const char *x = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "x-api-key");
    if (x && key_equal(x, strlen(x), s->api_key)) return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer", 6) || (h[6] != ' ' && h[6] != '\t')) return false;
    h += 6;
    while (*h == ' ' || *h == '\t') h++;
    size_t n = strlen(h);
    while (n && (h[n - 1] == ' ' || h[n - 1] == '\t')) n--;
    return key_equal(h, n, s->api_key);
}

/* Parses the body as a JSON object; on failure queues a 400 and returns NULL
 * with *ret set. */
static json_t *parse_body(struct k3_server *s, struct MHD_Connection *c, const k3_route *rt, const conn_req *r,
                          enum MHD_Result *ret) {
    if (r->body.len == 0) {
        *ret = k3_srv_route_error(rt, s, c, 400, "the request has no body: expected a JSON object");
        return NULL;
    }
    if (k3_json_too_deep(r->body.p, r->body.len, JSON_MAX_DEPTH)) {
        *ret = k3_srv_route_error(rt, s, c, 400, "the request JSON nests deeper than %d levels", JSON_MAX_DEPTH);
        return NULL;
    }
    json_error_t je;
    json_t *root = json_loadb(r->body.p, r->body.len, 0, &je);
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
static enum MHD_Result dispatch(struct k3_server *s, struct MHD_Connection *c, const char *url, conn_req *r) {
    const k3_route *rt = r->route;
    if (r->too_big)
        return k3_srv_route_error(rt, s, c, 413, "the request body is over the limit of %zu bytes", s->max_body);
    enum MHD_Result ret;
    json_t *root = NULL;
    if (rt->flags & K3_ROUTE_JSON) {
        if (!(root = parse_body(s, c, rt, r, &ret))) return ret;
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

/* 503 + Retry-After + the error JSON of rt's API (OpenAI's when rt is NULL
 * or has no error hook of its own), and the connection closes. */
static enum MHD_Result refuse_busy(struct k3_server *s, struct MHD_Connection *c, const k3_route *rt, const char *msg) {
    json_t *e =
        rt && rt->error == k3_srv_anthropic_error ? k3_srv_anthropic_error_json(503, msg) : k3_srv_error_json(503, msg);
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

/* True when k came over a limit and no slot has come free since. */
static bool still_over(struct k3_server *s, k3_srv_conn *k, char *msg, size_t cap) {
    if (!k || !k->over) return false;
    pthread_mutex_lock(&s->conn_mu);
    bool over = false;
    if (k->over == OVER_IP) {
        int n = 0;
        for (k3_srv_conn *o = s->conns; o; o = o->next)
            if (o != k && !o->closing && !o->over && same_addr(o, k)) n++;
        over = n >= (int)s->max_conn_ip || s->n_live >= (int)s->max_conn;
        if (over)
            snprintf(msg, cap,
                     "too many connections from your address: this server takes %u at once from one address "
                     "(--max-connections-per-ip); try again later",
                     s->max_conn_ip);
    } else {
        over = s->n_live >= (int)s->max_conn;
        if (over)
            snprintf(msg, cap,
                     "too many connections: this server takes %u at once (its connection limit); try again later",
                     s->max_conn);
    }
    if (!over) {
        /* a slot came free: it takes it */
        k->over = OVER_NONE;
        s->n_live++;
    }
    pthread_mutex_unlock(&s->conn_mu);
    return over;
}

/* Counts a header's occurrences and whether their values differ. */
typedef struct header_count {
    const char *name;
    int n;
    const char *first;
    bool differ;
} header_count;

static enum MHD_Result count_header(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    header_count *h = cls;
    if (!key || strcasecmp(key, h->name)) return MHD_YES;
    if (h->n++ == 0) h->first = value;
    else if (strcmp(value ? value : "", h->first ? h->first : "")) h->differ = true;
    return MHD_YES;
}

/* A preflight (OPTIONS with Origin and Access-Control-Request-Method):
 * 204 with what the browser may send, or 403 for an origin not allowed; a
 * plain OPTIONS: 204 with Allow. */
static enum MHD_Result answer_options(struct k3_server *s, struct MHD_Connection *c) {
    const char *origin;
    const int ok = k3_srv_origin(s, c, &origin);
    const char *want = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Method");
    if (ok < 0)
        return k3_srv_error(s, c, 403, "cross-origin requests from %s are not allowed (the server's --allowed-origins)",
                            origin);
    struct MHD_Response *r = MHD_create_response_from_buffer(0, "", MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    if (ok > 0 && want) {
        const char *hdrs = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Headers");
        MHD_add_response_header(r, "Access-Control-Allow-Methods", s->cors_methods);
        if (s->cors_headers) MHD_add_response_header(r, "Access-Control-Allow-Headers", s->cors_headers);
        else if (hdrs) MHD_add_response_header(r, "Access-Control-Allow-Headers", hdrs);
        MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    } else {
        MHD_add_response_header(r, "Allow", "GET, HEAD, POST, OPTIONS");
    }
    k3_srv_headers(s, c, r);
    pthread_mutex_lock(&s->metrics.mu);
    s->metrics.http_requests++;
    pthread_mutex_unlock(&s->metrics.mu);
    const enum MHD_Result ret = MHD_queue_response(c, 204, r);
    MHD_destroy_response(r);
    return ret;
}

/* The request line and headers are in: answers now what needs no body
 * (r->answered), else names the route and reads on. */
static enum MHD_Result on_headers(struct k3_server *s, struct MHD_Connection *c, const char *url, const char *method,
                                  conn_req *r) {
    /* busy while it is answered here: the reaper writes its 408 only to
     * connections libmicrohttpd is not writing to (waiting, or reading a body) */
    k3_srv_conn *k = conn_of(c);
    conn_set(s, k, CONN_BUSY);
    r->answered = true;
    const k3_route *other = NULL, *rt = k3_srv_route_find(method, url, &other);
    const k3_route *known = rt ? rt : other;
    char msg[256];
    if (still_over(s, k, msg, sizeof msg)) return refuse_busy(s, c, known, msg);
    /* shutting down: new requests are refused, /health, /ready and /metrics still tell */
    if (atomic_load(&s->phase) != K3_SRV_RUNNING && !(rt && (rt->flags & K3_ROUTE_DRAIN)))
        return k3_srv_route_error(known, s, c, 503, "the server is shutting down");
    /* the framing (RFC 9112 section 6): one length, or chunked alone */
    header_count cl = {.name = "Content-Length"}, te = {.name = "Transfer-Encoding"};
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_header, &cl);
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_header, &te);
    if (cl.differ) return k3_srv_route_error(known, s, c, 400, "the request has Content-Length headers that differ");
    if (te.n > 1 || (te.n && strcasecmp(te.first, "chunked")))
        return k3_srv_route_error(known, s, c, 501, "Transfer-Encoding: %s is not supported (only chunked)", te.first);
    if (cl.n && te.n)
        return k3_srv_route_error(known, s, c, 400, "the request has both Content-Length and Transfer-Encoding");
    const char *ce = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Encoding");
    if (ce && strcasecmp(ce, "identity"))
        return k3_srv_route_error(known, s, c, 415,
                                  "a compressed body (Content-Encoding: %s) is not supported: send it as it is", ce);
    if (!strcmp(method, "OPTIONS")) return answer_options(s, c);
    const char *origin;
    if (k3_srv_origin(s, c, &origin) < 0)
        return k3_srv_route_error(known, s, c, 403,
                                  "cross-origin requests from %s are not allowed (the server's --allowed-origins)",
                                  origin);
    /* the key before anything else of the route: an unknown path asks for
     * it too, so without the key nothing tells which paths exist */
    const bool needs_key =
        !known || (known->flags & K3_ROUTE_AUTH) || ((known->flags & K3_ROUTE_METRICS) && s->metrics_key);
    if (needs_key && !auth_ok(s, c))
        return k3_srv_route_error(known, s, c, 401,
                                  "a valid API key is needed: Authorization: Bearer KEY, or x-api-key: KEY");
    if (!known) return k3_srv_route_error(known, s, c, 404, "no route %s %s", method, url);
    if (!rt) {
        if (strcmp(method, "GET") && strcmp(method, "HEAD") && strcmp(method, "POST") && strcmp(method, "PUT") &&
            strcmp(method, "DELETE") && strcmp(method, "PATCH"))
            return k3_srv_route_error(known, s, c, 501, "the method %s is not implemented", method);
        return k3_srv_route_error(known, s, c, 405, "%s takes %s", url, known->method);
    }
    /* an oversized body is refused before it is read */
    if (cl.n) {
        char *end;
        const unsigned long long v = strtoull(cl.first, &end, 10);
        if (end == cl.first || v > s->max_body)
            return k3_srv_route_error(known, s, c, 413, "the request body (%s bytes) is over the limit of %zu bytes",
                                      cl.first, s->max_body);
    }
    r->answered = false;
    r->route = rt;
    conn_set(s, k, CONN_BODY);
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *data, size_t *data_size, void **con_cls) {
    struct k3_server *s = cls;
    conn_req *r = *con_cls;
    if (!r) {
        r = calloc(1, sizeof *r);
        if (!r) return MHD_NO;
        *con_cls = r;
        atomic_fetch_add(&s->in_flight, 1);
        return on_headers(s, c, url, method, r);
    }
    if (r->answered) {
        *data_size = 0;
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
    conn_set(s, conn_of(c), CONN_BUSY);
    if (r->body.oom) return k3_srv_error(s, c, 500, "out of memory for the request body");
    return dispatch(s, c, url, r);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    struct k3_server *s = cls;
    conn_req *r = *con_cls;
    if (!r) return;
    k3_buf_free(&r->body);
    free(r);
    *con_cls = NULL;
    atomic_fetch_sub(&s->in_flight, 1);
    k3_srv_conn *k = conn_of(c);
    if (k) {
        pthread_mutex_lock(&s->conn_mu);
        k->state = CONN_WAIT;
        k->since = now_s();
        k->n_req++;
        pthread_mutex_unlock(&s->conn_mu);
    }
}

/* ---- the server ---------------------------------------------------------------- */

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

/* --allowed-origins: "*", or origins separated by commas (spaces and a
 * trailing slash dropped). */
static bool parse_origins(struct k3_server *s, const char *list) {
    if (!list || !*list) return true;
    char *copy = strdup(list);
    if (!copy) return false;
    bool ok = true;
    for (char *save = NULL, *t = strtok_r(copy, ",", &save); t && ok; t = strtok_r(NULL, ",", &save)) {
        while (*t == ' ' || *t == '\t') t++;
        size_t n = strlen(t);
        while (n && (t[n - 1] == ' ' || t[n - 1] == '\t' || t[n - 1] == '/')) t[--n] = 0;
        if (!n) continue;
        if (!strcmp(t, "*")) {
            s->any_origin = true;
            continue;
        }
        char **o = realloc(s->origins, sizeof *o * (size_t)(s->n_origins + 1));
        if (!o || !(o[s->n_origins] = strdup(t))) ok = false;
        if (o) s->origins = o;
        if (ok) s->n_origins++;
    }
    free(copy);
    return ok;
}

static void server_free(struct k3_server *s) {
    free(s->host);
    free(s->api_key);
    free(s->model);
    free(s->model_label);
    free(s->version);
    k3_srv_store_free(s->responses);
    for (int i = 0; i < s->n_origins; i++) free(s->origins[i]);
    free(s->origins);
    free(s->cors_methods);
    free(s->cors_headers);
    k3_metrics_destroy(&s->metrics);
    pthread_mutex_destroy(&s->fail_mu);
    pthread_mutex_destroy(&s->live_mu);
    pthread_mutex_destroy(&s->conn_mu);
    pthread_cond_destroy(&s->reaper_cv);
    pthread_mutex_destroy(&s->vision_mu);
    k3_srv_constraint_free(s);
    pthread_mutex_destroy(&s->grammar_mu);
    free(s);
}

static bool addr_is_loopback(const struct sockaddr *a) {
    if (a->sa_family == AF_INET) return (ntohl(((const struct sockaddr_in *)a)->sin_addr.s_addr) >> 24) == 127;
    if (a->sa_family == AF_INET6) return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)a)->sin6_addr);
    return false;
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
    pthread_mutex_init(&s->conn_mu, NULL);
    pthread_cond_init(&s->reaper_cv, NULL);
    pthread_mutex_init(&s->vision_mu, NULL);
    pthread_mutex_init(&s->grammar_mu, NULL);
    s->vision = opt->vision;
    s->pd = opt->pd;
    s->vision_pool = opt->vision_pool;
    s->max_image_pixels = opt->max_image_pixels;
    s->no_ui = opt->no_ui;
    s->responses = k3_srv_store_new(K3_SRV_STORE_ENTRIES, K3_SRV_STORE_BYTES);
    s->host = dup_or(opt->host, "127.0.0.1");
    s->api_key = dup_or(opt->api_key, NULL);
    s->metrics_key = opt->metrics_require_key;
    s->model = strdup(opt->model_name);
    s->model_label = label_escape(opt->model_name);
    s->version = dup_or(opt->version, "k3");
    s->cors_methods = dup_or(opt->allowed_methods, "GET, POST, OPTIONS");
    s->cors_headers = opt->allowed_headers && *opt->allowed_headers && strcmp(opt->allowed_headers, "*")
        ? strdup(opt->allowed_headers)
        : NULL;
    s->tok = opt->tok;
    s->engine = opt->engine;
    s->max_model_len = opt->max_model_len;
    s->max_body = opt->max_body_bytes ? opt->max_body_bytes : (size_t)4 << 20;
    s->timeout_s = opt->timeout_s > 0 ? opt->timeout_s : 30;
    s->header_timeout_s = opt->header_timeout_s > 0 ? opt->header_timeout_s : 10;
    s->body_timeout_s = opt->body_timeout_s > 0 ? opt->body_timeout_s : 60;
    s->step_timeout_s = opt->step_timeout_s > 0 ? opt->step_timeout_s : 300;
    s->max_conn_ip = opt->max_connections_per_ip > 0 ? (unsigned)opt->max_connections_per_ip : 0;
    s->test_fail_step = opt->test_fail_step;
    s->test_fail_request = opt->test_fail_request;
    s->created = (long)time(NULL);
    atomic_init(&s->stopping, false);
    atomic_init(&s->phase, K3_SRV_RUNNING);
    atomic_init(&s->in_flight, 0);
    atomic_init(&s->step_t0_ns, 0);
    atomic_init(&s->next_id, 1);
    int64_t mml = s->max_model_len;
    int32_t mbt = 2048;
    if (s->engine) {
        k3_engine_stats st;
        k3_engine_get_stats(s->engine, &st);
        mml = st.max_model_len;
    }
    k3_metrics_init(&s->metrics, mml, mbt);
    if (!s->host || !s->model || !s->model_label || !s->version || !s->cors_methods || !s->responses ||
        (opt->api_key && !s->api_key) ||
        (opt->allowed_headers && *opt->allowed_headers && strcmp(opt->allowed_headers, "*") && !s->cors_headers) ||
        !parse_origins(s, opt->allowed_origins)) {
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
    s->loopback = addr_is_loopback(ai->ai_addr);
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    const unsigned limit = opt->max_connections > 0 ? (unsigned)opt->max_connections : 256u;
    s->max_conn = limit;
    atomic_init(&s->n_conn, 0);
    /* MHD's own limit (connections beyond it are closed unanswered) leaves
     * room for the ones that get a 503 and those being closed */
    const unsigned hard = limit + (limit < 64u ? 64u : limit);
    if (s->engine && k3_srv_engine_start(s, err)) {
        freeaddrinfo(ai);
        server_free(s);
        return err ? err->status : K3_ERR_NOMEM;
    }
    if (pthread_create(&s->reaper, NULL, reaper_main, s)) {
        freeaddrinfo(ai);
        if (s->engine) k3_srv_engine_stop(s);
        server_free(s);
        return k3_err(err, K3_ERR_NOMEM, "cannot start the server's reaper thread");
    }
    s->reaper_started = true;
    s->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                            MHD_OPTION_CONNECTION_LIMIT, hard, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)s->timeout_s,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_NOTIFY_CONNECTION, on_connection,
                            s, MHD_OPTION_THREAD_STACK_SIZE, (size_t)512 << 10, MHD_OPTION_LISTEN_BACKLOG_SIZE, 512u,
                            MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->d) {
        pthread_mutex_lock(&s->conn_mu);
        s->reaper_quit = true;
        pthread_cond_signal(&s->reaper_cv);
        pthread_mutex_unlock(&s->conn_mu);
        pthread_join(s->reaper, NULL);
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

void k3_server_drain(k3_server *s) {
    int run = K3_SRV_RUNNING;
    atomic_compare_exchange_strong(&s->phase, &run, K3_SRV_DRAINING);
}

int k3_server_in_flight(k3_server *s) { return atomic_load(&s->in_flight); }

void k3_server_end(k3_server *s, const char *why) {
    if (atomic_load(&s->phase) == K3_SRV_ENDING) return;
    snprintf(s->end_msg, sizeof s->end_msg, "%s", why && *why ? why : "the server is shutting down");
    atomic_store(&s->phase, K3_SRV_ENDING);
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
    MHD_stop_daemon(s->d);
    pthread_mutex_lock(&s->conn_mu);
    s->reaper_quit = true;
    pthread_cond_signal(&s->reaper_cv);
    pthread_mutex_unlock(&s->conn_mu);
    if (s->reaper_started) pthread_join(s->reaper, NULL);
    if (s->engine) k3_srv_engine_stop(s);
    server_free(s);
}
