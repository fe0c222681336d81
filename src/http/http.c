/*
 * http.c -- the hardened HTTP layer (http.h): one libmicrohttpd daemon with
 * a thread per connection (a request that waits, for tokens or for a
 * backend, blocks in its own thread), the connection table with its limits
 * and deadlines, what is decided on the request line and headers before any
 * body byte is read, the body, the phases of a shutdown, and the answers'
 * common headers.
 *
 * Connections. Every open connection has a conn in h->conns: waiting for a
 * request (its line and headers), reading a body, or busy (its request
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
 * What libmicrohttpd (0.9.75) decides before any callback of ours: a
 * request line without a space (e.g. "GARBAGE") is closed unanswered
 * (parse_initial_message_line fails without queueing an answer); a bad
 * HTTP version, a header line without a colon or a Content-Length that is
 * not a number get its own 400 with an HTML body; a request line or headers
 * over its buffer a 414 or 431. With two Content-Length headers it frames
 * the body by the first, so the 400 below must come first, and does.
 */
#include "http/http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#include "common/error.h"

enum { CONN_WAIT = 0, CONN_BODY, CONN_BUSY };
enum { OVER_NONE = 0, OVER_TOTAL, OVER_IP };

typedef struct conn {
    struct conn *prev, *next;
    struct MHD_Connection *c;
    int fd;
    struct sockaddr_storage addr;
    int state;    /* CONN_* */
    double since; /* when the state began */
    int n_req;    /* requests answered on it */
    bool closing; /* shut down by us: its slot is free */
    int over;     /* OVER_*: answered 503 at its request */
} conn;

struct k3_http {
    struct MHD_Daemon *d;
    k3_http_app app;
    char *api_key;
    size_t max_body;
    int timeout_s, header_timeout_s, body_timeout_s, port;
    /* connections, under conn_mu */
    unsigned max_conn, max_conn_ip;
    atomic_int n_conn; /* open (those being closed included) */
    pthread_mutex_t conn_mu;
    conn *conns;
    int n_live; /* holding a slot: not being closed, not over a limit */
    pthread_t reaper;
    pthread_cond_t reaper_cv;
    bool reaper_quit, reaper_started;
    /* CORS */
    char **origins;
    int n_origins;
    bool any_origin;
    char *cors_methods, *cors_headers; /* NULL headers: those asked for */
    bool loopback;                     /* bound to a loopback address */
    atomic_int phase;                  /* K3_HTTP_* */
    char end_msg[256];                 /* set before phase turns ENDING */
    atomic_int in_flight;
    /* counters */
    atomic_ullong requests, errors, refused, timeouts, evicted;
};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ---- errors ------------------------------------------------------------------ */

json_t *k3_http_str(const char *msg) {
    char buf[1024];
    size_t n = 0;
    for (; msg[n] && n < sizeof buf - 1; n++) buf[n] = msg[n] >= 0x20 && msg[n] < 0x7f ? msg[n] : '?';
    buf[n] = 0;
    return json_string(buf);
}

static const char *openai_type(unsigned status) {
    switch (status) {
    case 400: return "BadRequestError";
    case 401: return "AuthenticationError";
    case 403: return "PermissionDeniedError";
    case 404: return "NotFoundError";
    case 405: return "MethodNotAllowedError";
    case 408: return "RequestTimeoutError";
    case 413: return "RequestTooLargeError";
    case 415: return "UnsupportedMediaTypeError";
    case 501: return "NotImplementedError";
    case 503: return "ServiceUnavailableError";
    default: return status >= 500 ? "InternalServerError" : "BadRequestError";
    }
}

json_t *k3_http_error_json(unsigned status, json_t *message) {
    return json_pack("{s:{s:o,s:s,s:n,s:i}}", "error", "message", message ? message : json_string("error"), "type",
                     openai_type(status), "param", "code", (json_int_t)status);
}

static const char *anthropic_type(unsigned status) {
    switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 503: return "overloaded_error";
    default: return status >= 500 ? "api_error" : "invalid_request_error";
    }
}

json_t *k3_http_anthropic_error_json(unsigned status, json_t *message) {
    return json_pack("{s:s,s:{s:s,s:o}}", "type", "error", "error", "type", anthropic_type(status), "message",
                     message ? message : json_string("error"));
}

/* ---- CORS ------------------------------------------------------------------- */

/* "localhost", "127.x.y.z" or "[::1]", a port after it or not. */
static bool host_is_loopback(const char *h, size_t n) {
    if (n >= 5 && h[0] == '[') return !strncmp(h, "[::1]", 5) && (n == 5 || h[5] == ':');
    size_t end = 0;
    while (end < n && h[end] != ':') end++;
    if (end == 9 && !strncasecmp(h, "localhost", 9)) return true;
    if (end < 4 || strncmp(h, "127.", 4)) return false;
    for (size_t i = 4; i < end; i++)
        if (!(h[i] == '.' || (h[i] >= '0' && h[i] <= '9'))) return false;
    return true;
}

int k3_http_origin(k3_http *h, struct MHD_Connection *c, const char **origin) {
    const char *o = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    *origin = o;
    if (!o) return 0;
    if (h->any_origin) return 1;
    for (int i = 0; i < h->n_origins; i++)
        if (!strcasecmp(o, h->origins[i])) return 1;
    /* the endpoint's own origin: the page it serves calling it. Bound to a
     * loopback address, the host must be a loopback one too, so a page whose
     * name was made to resolve to 127.0.0.1 (DNS rebinding) is not "own" */
    const char *host = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host");
    if (host && !strncasecmp(o, "http://", 7) && !strcasecmp(o + 7, host) &&
        (!h->loopback || host_is_loopback(host, strlen(host))))
        return 1;
    return -1;
}

static conn *conn_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

void k3_http_headers(k3_http *h, struct MHD_Connection *c, struct MHD_Response *r) {
    const char *o;
    if (k3_http_origin(h, c, &o) > 0) {
        MHD_add_response_header(r, "Access-Control-Allow-Origin", h->any_origin ? "*" : o);
        if (!h->any_origin) MHD_add_response_header(r, "Vary", "Origin");
    }
    /* an endpoint that is shutting down keeps no connection open, nor one
     * that came over a limit */
    const conn *k = conn_of(c);
    if (atomic_load(&h->phase) != K3_HTTP_RUNNING || (k && k->over))
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
}

/* ---- answers ----------------------------------------------------------------- */

static void count(k3_http *h, unsigned status) {
    atomic_fetch_add(&h->requests, 1);
    if (status >= 400) atomic_fetch_add(&h->errors, 1);
}

enum MHD_Result k3_http_queue(k3_http *h, struct MHD_Connection *c, unsigned status, char *text, size_t len,
                              const char *type) {
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, text ? text : "", text ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    if (type) MHD_add_response_header(r, "Content-Type", type);
    if (status == 503 || status == 429) MHD_add_response_header(r, "Retry-After", "1");
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    if (status == 415) MHD_add_response_header(r, "Accept-Encoding", "identity");
    k3_http_headers(h, c, r);
    count(h, status);
    const enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

enum MHD_Result k3_http_json(k3_http *h, struct MHD_Connection *c, unsigned status, json_t *body) {
    char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (!text) return MHD_NO;
    return k3_http_queue(h, c, status, text, strlen(text), "application/json");
}

enum MHD_Result k3_http_error(k3_http *h, struct MHD_Connection *c, unsigned status, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return k3_http_json(h, c, status, k3_http_error_json(status, k3_http_str(msg)));
}

enum MHD_Result k3_http_queue_stream(k3_http *h, struct MHD_Connection *c, unsigned status, const char *type,
                                     MHD_ContentReaderCallback fn, void *cls, MHD_ContentReaderFreeCallback done) {
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, fn, cls, done);
    if (!r) {
        done(cls);
        return k3_http_error(h, c, 500, "out of memory for the stream");
    }
    MHD_add_response_header(r, "Content-Type", type ? type : "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    /* HTTP/1.1: a chunked body on a connection that stays open (HTTP/1.0:
     * libmicrohttpd closes it at the end) */
    k3_http_headers(h, c, r);
    count(h, status);
    const enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

/* A half-close (POLLRDHUP: the client shut down its sending side, as
 * `nc -N`, HTTP/1.0 clients and some proxies do after the request) is not a
 * hang-up: the client still reads. Only the connection's error or hang-up
 * state is (a reset, or both directions shut). */
bool k3_http_client_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return true;
    struct pollfd p = {.fd = ci->connect_fd, .events = 0};
    if (poll(&p, 1, 0) < 0) return false;
    return (p.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0;
}

bool k3_http_client_half_closed(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return true;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) < 0) return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

/* ---- the connection table ------------------------------------------------------- */

static bool same_addr(const conn *a, const conn *b) {
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
static void conn_close(k3_http *h, conn *k, bool answer, const char *why) {
    if (k->closing) return;
    k->closing = true;
    if (!k->over) h->n_live--;
    if (answer) {
        json_t *e = k3_http_error_json(408, k3_http_str(why));
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

static void conn_set(k3_http *h, conn *k, int state) {
    if (!k) return;
    pthread_mutex_lock(&h->conn_mu);
    k->state = state;
    k->since = now_s();
    pthread_mutex_unlock(&h->conn_mu);
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
    k3_http *h = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        atomic_fetch_add(&h->n_conn, 1);
        conn *k = calloc(1, sizeof *k);
        *socket_context = k;
        if (!k) return; /* counted, untracked: no limit applies to it */
        k->c = c;
        const union MHD_ConnectionInfo *fi = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        k->fd = fi ? fi->connect_fd : -1;
        const union MHD_ConnectionInfo *ai = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        if (ai && ai->client_addr)
            memcpy(&k->addr, ai->client_addr,
                   ai->client_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in));
        k->since = now_s();
        pthread_mutex_lock(&h->conn_mu);
        k->next = h->conns;
        if (h->conns) h->conns->prev = k;
        h->conns = k;
        /* a connection over a limit holds no slot: it waits for its 503 */
        int from_ip = 0;
        conn *oldest = NULL;
        for (conn *o = h->conns; o; o = o->next) {
            if (o == k || o->closing || o->over) continue;
            if (h->max_conn_ip && same_addr(o, k)) from_ip++;
            if (o->state == CONN_WAIT && (!oldest || o->since < oldest->since)) oldest = o;
        }
        if (h->max_conn_ip && from_ip >= (int)h->max_conn_ip) {
            k->over = OVER_IP;
        } else if (h->n_live >= (int)h->max_conn) {
            /* the slot of the one that has waited longest for its request */
            if (oldest) {
                conn_close(h, oldest, false, NULL);
                atomic_fetch_add(&h->evicted, 1);
            } else {
                k->over = OVER_TOTAL;
            }
        }
        if (!k->over) h->n_live++;
        pthread_mutex_unlock(&h->conn_mu);
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        atomic_fetch_sub(&h->n_conn, 1);
        conn *k = *socket_context;
        if (!k) return;
        pthread_mutex_lock(&h->conn_mu);
        if (k->prev) k->prev->next = k->next;
        else h->conns = k->next;
        if (k->next) k->next->prev = k->prev;
        if (!k->closing && !k->over) h->n_live--;
        pthread_mutex_unlock(&h->conn_mu);
        free(k);
        *socket_context = NULL;
    }
}

/* The deadlines, four times a second. */
static void *reaper_main(void *arg) {
    k3_http *h = arg;
    pthread_mutex_lock(&h->conn_mu);
    while (!h->reaper_quit) {
        const double now = now_s();
        int n_timeouts = 0;
        for (conn *k = h->conns; k; k = k->next) {
            if (k->closing) continue;
            if (k->state == CONN_WAIT && now - k->since > h->header_timeout_s) {
                /* a first request is answered; an idle kept-alive connection just closes */
                conn_close(h, k, k->n_req == 0,
                           "the request line and headers did not arrive in time (the server's --header-timeout)");
                n_timeouts++;
            } else if (k->state == CONN_BODY && now - k->since > h->body_timeout_s) {
                conn_close(h, k, true, "the request body did not arrive in time (the server's body timeout)");
                n_timeouts++;
            }
        }
        if (n_timeouts) atomic_fetch_add(&h->timeouts, (unsigned long long)n_timeouts);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 250 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&h->reaper_cv, &h->conn_mu, &ts);
    }
    pthread_mutex_unlock(&h->conn_mu);
    return NULL;
}

/* True when k came over a limit and no slot has come free since. */
static bool still_over(k3_http *h, conn *k, char *msg, size_t cap) {
    if (!k || !k->over) return false;
    pthread_mutex_lock(&h->conn_mu);
    bool over = false;
    if (k->over == OVER_IP) {
        int n = 0;
        for (conn *o = h->conns; o; o = o->next)
            if (o != k && !o->closing && !o->over && same_addr(o, k)) n++;
        over = n >= (int)h->max_conn_ip || h->n_live >= (int)h->max_conn;
        if (over)
            snprintf(msg, cap,
                     "too many connections from your address: this server takes %u at once from one address "
                     "(--max-connections-per-ip); try again later",
                     h->max_conn_ip);
    } else {
        over = h->n_live >= (int)h->max_conn;
        if (over)
            snprintf(msg, cap,
                     "too many connections: this server takes %u at once (its connection limit); try again later",
                     h->max_conn);
    }
    if (!over) {
        /* a slot came free: it takes it */
        k->over = OVER_NONE;
        h->n_live++;
    }
    pthread_mutex_unlock(&h->conn_mu);
    return over;
}

/* ---- a request ----------------------------------------------------------------- */

typedef struct req {
    k3_buf body;
    bool too_big, started;
    bool answered; /* answered on its headers: the body is not read */
    const void *route;
} req;

/* Constant-time comparison of a presented key with the endpoint's. */
static bool key_equal(const char *p, size_t a, const char *key) {
    const size_t b = strlen(key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a; i++) diff |= (unsigned char)p[i] ^ (unsigned char)key[i % (b ? b : 1)];
    return diff == 0;
}

/* "Authorization: Bearer KEY" (the scheme in any case, RFC 7235) or
 * "x-api-key: KEY" (what the Anthropic API sends). */
static bool auth_ok(const k3_http *h, struct MHD_Connection *c) {
    if (!h->api_key) return true;
    const char *x = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "x-api-key");
    if (x && key_equal(x, strlen(x), h->api_key)) return true;
    const char *a = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!a || strncasecmp(a, "Bearer", 6) || (a[6] != ' ' && a[6] != '\t')) return false;
    a += 6;
    while (*a == ' ' || *a == '\t') a++;
    size_t n = strlen(a);
    while (n && (a[n - 1] == ' ' || a[n - 1] == '\t')) n--;
    return key_equal(a, n, h->api_key);
}

/* Counts a header's occurrences and whether their values differ. */
typedef struct header_count {
    const char *name;
    int n;
    const char *first;
    bool differ;
} header_count;

static enum MHD_Result count_header(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    header_count *hc = cls;
    if (!key || strcasecmp(key, hc->name)) return MHD_YES;
    if (hc->n++ == 0) hc->first = value;
    else if (strcmp(value ? value : "", hc->first ? hc->first : "")) hc->differ = true;
    return MHD_YES;
}

static enum MHD_Result app_error(k3_http *h, struct MHD_Connection *c, const void *route, unsigned status,
                                 const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static enum MHD_Result app_error(k3_http *h, struct MHD_Connection *c, const void *route, unsigned status,
                                 const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return h->app.error(h->app.arg, c, route, status, msg);
}

/* A preflight (OPTIONS with Origin and Access-Control-Request-Method):
 * 204 with what the browser may send, or 403 for an origin not allowed; a
 * plain OPTIONS: 204 with Allow. */
static enum MHD_Result answer_options(k3_http *h, struct MHD_Connection *c) {
    const char *origin;
    const int ok = k3_http_origin(h, c, &origin);
    const char *want = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Method");
    if (ok < 0)
        return k3_http_error(h, c, 403,
                             "cross-origin requests from %s are not allowed (the server's --allowed-origins)", origin);
    struct MHD_Response *r = MHD_create_response_from_buffer(0, "", MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    if (ok > 0 && want) {
        const char *hdrs = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Headers");
        MHD_add_response_header(r, "Access-Control-Allow-Methods", h->cors_methods);
        if (h->cors_headers) MHD_add_response_header(r, "Access-Control-Allow-Headers", h->cors_headers);
        else if (hdrs) MHD_add_response_header(r, "Access-Control-Allow-Headers", hdrs);
        MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    } else {
        MHD_add_response_header(r, "Allow", "GET, HEAD, POST, OPTIONS");
    }
    k3_http_headers(h, c, r);
    count(h, 204);
    const enum MHD_Result ret = MHD_queue_response(c, 204, r);
    MHD_destroy_response(r);
    return ret;
}

/* The request line and headers are in: answers now what needs no body
 * (r->answered), else names the route and reads on. */
static enum MHD_Result on_headers(k3_http *h, struct MHD_Connection *c, const char *url, const char *method, req *r) {
    /* busy while it is answered here: the reaper writes its 408 only to
     * connections libmicrohttpd is not writing to (waiting, or reading a body) */
    conn *k = conn_of(c);
    conn_set(h, k, CONN_BUSY);
    r->answered = true;
    k3_http_route rt = {0};
    h->app.find(h->app.arg, method, url, &rt);
    char msg[256];
    if (still_over(h, k, msg, sizeof msg)) {
        atomic_fetch_add(&h->refused, 1);
        return app_error(h, c, rt.route, 503, "%s", msg);
    }
    /* shutting down: new requests are refused; /health and /metrics still tell */
    if (atomic_load(&h->phase) != K3_HTTP_RUNNING && !(rt.route && rt.method_ok && rt.during_drain))
        return app_error(h, c, rt.route, 503, "the server is shutting down");
    /* the framing (RFC 9112 section 6): one length, or chunked alone */
    header_count cl = {.name = "Content-Length"}, te = {.name = "Transfer-Encoding"};
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_header, &cl);
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_header, &te);
    if (cl.differ) return app_error(h, c, rt.route, 400, "the request has Content-Length headers that differ");
    if (te.n > 1 || (te.n && strcasecmp(te.first, "chunked")))
        return app_error(h, c, rt.route, 501, "Transfer-Encoding: %s is not supported (only chunked)", te.first);
    if (cl.n && te.n)
        return app_error(h, c, rt.route, 400, "the request has both Content-Length and Transfer-Encoding");
    const char *ce = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Encoding");
    if (ce && strcasecmp(ce, "identity"))
        return app_error(h, c, rt.route, 415,
                         "a compressed body (Content-Encoding: %s) is not supported: send it as it is", ce);
    if (!strcmp(method, "OPTIONS")) return answer_options(h, c);
    const char *origin;
    if (k3_http_origin(h, c, &origin) < 0)
        return app_error(h, c, rt.route, 403,
                         "cross-origin requests from %s are not allowed (the server's --allowed-origins)", origin);
    /* the key before anything else of the route: an unknown path asks for
     * it too, so without the key nothing tells which paths exist */
    if ((!rt.route || rt.needs_key) && !auth_ok(h, c))
        return app_error(h, c, rt.route, 401,
                         "a valid API key is needed: Authorization: Bearer KEY, or x-api-key: KEY");
    if (!rt.route) return app_error(h, c, NULL, 404, "no route %s %s", method, url);
    if (!rt.method_ok) {
        if (strcmp(method, "GET") && strcmp(method, "HEAD") && strcmp(method, "POST") && strcmp(method, "PUT") &&
            strcmp(method, "DELETE") && strcmp(method, "PATCH"))
            return app_error(h, c, rt.route, 501, "the method %s is not implemented", method);
        return app_error(h, c, rt.route, 405, "%s takes %s", url, rt.allow ? rt.allow : "other methods");
    }
    /* an oversized body is refused before it is read */
    if (cl.n) {
        char *end;
        const unsigned long long v = strtoull(cl.first, &end, 10);
        if (end == cl.first || v > h->max_body)
            return app_error(h, c, rt.route, 413, "the request body (%s bytes) is over the limit of %zu bytes",
                             cl.first, h->max_body);
    }
    r->answered = false;
    r->route = rt.route;
    conn_set(h, k, CONN_BODY);
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *data, size_t *data_size, void **con_cls) {
    k3_http *h = cls;
    req *r = *con_cls;
    if (!r) {
        r = calloc(1, sizeof *r);
        if (!r) return MHD_NO;
        *con_cls = r;
        atomic_fetch_add(&h->in_flight, 1);
        return on_headers(h, c, url, method, r);
    }
    if (r->answered) {
        *data_size = 0;
        return MHD_YES;
    }
    if (*data_size) {
        if (!r->too_big && r->body.len + *data_size > h->max_body) {
            r->too_big = true;
            k3_buf_free(&r->body);
        }
        if (!r->too_big) k3_buf_add(&r->body, data, *data_size);
        *data_size = 0;
        return MHD_YES;
    }
    if (r->started) return MHD_YES;
    r->started = true;
    conn_set(h, conn_of(c), CONN_BUSY);
    if (r->body.oom) return app_error(h, c, r->route, 500, "out of memory for the request body");
    if (r->too_big)
        return app_error(h, c, r->route, 413, "the request body is over the limit of %zu bytes", h->max_body);
    return h->app.dispatch(h->app.arg, c, r->route, url, method, &r->body, r->too_big);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    k3_http *h = cls;
    req *r = *con_cls;
    if (!r) return;
    k3_buf_free(&r->body);
    free(r);
    *con_cls = NULL;
    atomic_fetch_sub(&h->in_flight, 1);
    conn *k = conn_of(c);
    if (k) {
        pthread_mutex_lock(&h->conn_mu);
        k->state = CONN_WAIT;
        k->since = now_s();
        k->n_req++;
        pthread_mutex_unlock(&h->conn_mu);
    }
}

/* ---- start / stop ---------------------------------------------------------------- */

/* allowed_origins: "*", or origins separated by commas (spaces and a
 * trailing slash dropped). */
static bool parse_origins(k3_http *h, const char *list) {
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
            h->any_origin = true;
            continue;
        }
        char **o = realloc(h->origins, sizeof *o * (size_t)(h->n_origins + 1));
        if (!o || !(o[h->n_origins] = strdup(t))) ok = false;
        if (o) h->origins = o;
        if (ok) h->n_origins++;
    }
    free(copy);
    return ok;
}

static void http_free(k3_http *h) {
    free(h->api_key);
    for (int i = 0; i < h->n_origins; i++) free(h->origins[i]);
    free(h->origins);
    free(h->cors_methods);
    free(h->cors_headers);
    pthread_mutex_destroy(&h->conn_mu);
    pthread_cond_destroy(&h->reaper_cv);
    free(h);
}

static bool addr_is_loopback(const struct sockaddr *a) {
    if (a->sa_family == AF_INET) return (ntohl(((const struct sockaddr_in *)a)->sin_addr.s_addr) >> 24) == 127;
    if (a->sa_family == AF_INET6) return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)a)->sin6_addr);
    return false;
}

k3_status k3_http_start(k3_http **out, const k3_http_options *o, const k3_http_app *app, k3_error *err) {
    *out = NULL;
    if (!o || !app || !app->find || !app->error || !app->dispatch)
        return k3_err(err, K3_ERR_ARG, "http: no application to serve");
    if (o->port < 0 || o->port > 65535) return k3_err(err, K3_ERR_ARG, "port %d is not in 0..65535", o->port);
    if (o->api_key && !*o->api_key)
        return k3_err(err, K3_ERR_ARG, "the API key is empty: give a key, or none to serve without one");
    k3_http *h = calloc(1, sizeof *h);
    if (!h) return k3_err(err, K3_ERR_NOMEM, "out of memory for the HTTP layer");
    pthread_mutex_init(&h->conn_mu, NULL);
    pthread_cond_init(&h->reaper_cv, NULL);
    h->app = *app;
    h->api_key = o->api_key ? strdup(o->api_key) : NULL;
    h->max_body = o->max_body_bytes ? o->max_body_bytes : (size_t)4 << 20;
    h->timeout_s = o->timeout_s > 0 ? o->timeout_s : 30;
    h->header_timeout_s = o->header_timeout_s > 0 ? o->header_timeout_s : 10;
    h->body_timeout_s = o->body_timeout_s > 0 ? o->body_timeout_s : 60;
    h->max_conn = o->max_connections > 0 ? (unsigned)o->max_connections : 256u;
    h->max_conn_ip = o->max_connections_per_ip > 0 ? (unsigned)o->max_connections_per_ip : 0;
    h->cors_methods = strdup(o->allowed_methods && *o->allowed_methods ? o->allowed_methods : "GET, POST, OPTIONS");
    h->cors_headers = o->allowed_headers && *o->allowed_headers && strcmp(o->allowed_headers, "*")
        ? strdup(o->allowed_headers)
        : NULL;
    if ((o->api_key && !h->api_key) || !h->cors_methods ||
        (o->allowed_headers && *o->allowed_headers && strcmp(o->allowed_headers, "*") && !h->cors_headers) ||
        !parse_origins(h, o->allowed_origins)) {
        http_free(h);
        return k3_err(err, K3_ERR_NOMEM, "out of memory for the HTTP layer");
    }
    const char *host = o->host && *o->host ? o->host : "127.0.0.1";
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai = NULL;
    char port[16];
    snprintf(port, sizeof port, "%d", o->port);
    const int gai = getaddrinfo(host, port, &hints, &ai);
    if (gai || !ai) {
        http_free(h);
        return k3_err(err, K3_ERR_ARG, "cannot resolve --host %s: %s", host, gai_strerror(gai));
    }
    h->loopback = addr_is_loopback(ai->ai_addr);
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    /* MHD's own limit (connections beyond it are closed unanswered) leaves
     * room for the ones that get a 503 and those being closed */
    const unsigned hard = h->max_conn + (h->max_conn < 64u ? 64u : h->max_conn);
    if (pthread_create(&h->reaper, NULL, reaper_main, h)) {
        freeaddrinfo(ai);
        http_free(h);
        return k3_err(err, K3_ERR_NOMEM, "cannot start the HTTP reaper thread");
    }
    h->reaper_started = true;
    h->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                            MHD_OPTION_CONNECTION_LIMIT, hard, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)h->timeout_s,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, h, MHD_OPTION_NOTIFY_CONNECTION, on_connection,
                            h, MHD_OPTION_THREAD_STACK_SIZE, (size_t)512 << 10, MHD_OPTION_LISTEN_BACKLOG_SIZE, 512u,
                            MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!h->d) {
        pthread_mutex_lock(&h->conn_mu);
        h->reaper_quit = true;
        pthread_cond_signal(&h->reaper_cv);
        pthread_mutex_unlock(&h->conn_mu);
        pthread_join(h->reaper, NULL);
        k3_err(err, K3_ERR_IO, "cannot listen on %s port %d (in use, or not an address of this machine)", host,
               o->port);
        http_free(h);
        return K3_ERR_IO;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    h->port = di ? di->port : o->port;
    *out = h;
    return K3_OK;
}

void k3_http_stop(k3_http *h) {
    if (!h) return;
    k3_http_drain(h);
    MHD_stop_daemon(h->d);
    pthread_mutex_lock(&h->conn_mu);
    h->reaper_quit = true;
    pthread_cond_signal(&h->reaper_cv);
    pthread_mutex_unlock(&h->conn_mu);
    if (h->reaper_started) pthread_join(h->reaper, NULL);
    http_free(h);
}

int k3_http_port(const k3_http *h) { return h->port; }
bool k3_http_has_key(const k3_http *h) { return h->api_key != NULL; }
size_t k3_http_max_body(const k3_http *h) { return h->max_body; }
int k3_http_timeout(const k3_http *h) { return h->timeout_s; }

void k3_http_drain(k3_http *h) {
    int run = K3_HTTP_RUNNING;
    atomic_compare_exchange_strong(&h->phase, &run, K3_HTTP_DRAINING);
}

void k3_http_end(k3_http *h, const char *why) {
    if (atomic_load(&h->phase) == K3_HTTP_ENDING) return;
    snprintf(h->end_msg, sizeof h->end_msg, "%s", why && *why ? why : "the server is shutting down");
    atomic_store(&h->phase, K3_HTTP_ENDING);
}

int k3_http_phase(const k3_http *h) { return atomic_load(&h->phase); }
const char *k3_http_end_msg(const k3_http *h) { return h->end_msg; }
int k3_http_in_flight(k3_http *h) { return atomic_load(&h->in_flight); }
int k3_http_connections(k3_http *h) { return atomic_load(&h->n_conn); }

void k3_http_metrics_render(k3_http *h, const char *label, k3_buf *o) {
    char lb[300] = "";
    if (label) snprintf(lb, sizeof lb, "{model_name=\"%s\"}", label);
    k3_buf_addf(o,
                "# HELP k3:http_requests_total HTTP requests answered.\n# TYPE k3:http_requests_total counter\n"
                "k3:http_requests_total%s %llu\n"
                "# HELP k3:http_errors_total HTTP requests answered with an error status.\n"
                "# TYPE k3:http_errors_total counter\nk3:http_errors_total%s %llu\n"
                "# HELP k3:http_connections_refused_total Connections over the limit answered 503.\n"
                "# TYPE k3:http_connections_refused_total counter\n"
                "k3:http_connections_refused_total%s %llu\n"
                "# HELP k3:http_timeouts_total Connections closed because their request line and headers, or "
                "their body, did not arrive in time.\n"
                "# TYPE k3:http_timeouts_total counter\nk3:http_timeouts_total%s %llu\n"
                "# HELP k3:http_evicted_total Connections waiting for their request that were closed to make room "
                "for a new one over the limit.\n"
                "# TYPE k3:http_evicted_total counter\nk3:http_evicted_total%s %llu\n"
                "# HELP k3:http_connections Open HTTP connections (this one included).\n"
                "# TYPE k3:http_connections gauge\nk3:http_connections%s %d\n"
                "# HELP k3:http_in_flight HTTP requests received and not yet answered in full (this one included).\n"
                "# TYPE k3:http_in_flight gauge\nk3:http_in_flight%s %d\n"
                "# HELP k3:server_draining 1 while the server shuts down (new requests are answered 503).\n"
                "# TYPE k3:server_draining gauge\nk3:server_draining%s %d\n",
                lb, (unsigned long long)atomic_load(&h->requests), lb, (unsigned long long)atomic_load(&h->errors), lb,
                (unsigned long long)atomic_load(&h->refused), lb, (unsigned long long)atomic_load(&h->timeouts), lb,
                (unsigned long long)atomic_load(&h->evicted), lb, atomic_load(&h->n_conn), lb,
                atomic_load(&h->in_flight), lb, atomic_load(&h->phase) != K3_HTTP_RUNNING);
}
