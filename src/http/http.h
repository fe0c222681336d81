/*
 * http.h -- the hardened HTTP layer every k3 endpoint serves through
 * (http.c, on libmicrohttpd): `k3 serve` (src/server) and the proxy of
 * prefill and decode instances (src/pd/proxy.c). One code path for what
 * protects an endpoint, whatever it answers:
 *
 * - connections: a table with a limit (one over it takes the slot of the
 *   connection that has waited longest for its request, else a 503 with
 *   Retry-After), a per-address cap, a header deadline and a body deadline
 *   (a reaper closes connections past them, with a 408 when the client
 *   waits for an answer);
 * - what is decided on the request line and headers, before a body byte is
 *   read: over a limit (503), shutting down (503, but for the routes that
 *   answer during a drain), differing Content-Lengths (400), a
 *   Transfer-Encoding other than chunked (501), Content-Length with chunked
 *   (400), a compressed body (415), a CORS preflight (204 / 403), an Origin
 *   not allowed (403), the API key (401: "Authorization: Bearer KEY", the
 *   scheme in any case, or "x-api-key: KEY", compared in constant time; an
 *   unknown path asks for it too), the route (404, 405, 501), a
 *   Content-Length over the body limit (413); so an unauthenticated client
 *   never has a body buffered;
 * - the body, within the limit, then the application's handler;
 * - a client that half-closes (shuts down its sending side) is not gone: it
 *   still reads and is answered; only a hang-up is (k3_http_client_gone);
 * - the phases of a shutdown (k3_http_drain, k3_http_end): new requests 503
 *   and Connection: close; the application ends those in flight in its
 *   APIs' shapes;
 * - the answers' common headers (CORS, Retry-After, WWW-Authenticate,
 *   Accept-Encoding), the counters and gauges of /metrics (k3:http_*).
 *
 * The application gives three hooks: the route of a request line (whether
 * the path exists, takes the method, needs the key, answers during a
 * drain), an error in the route's API shape, and the handler of a whole
 * request.
 */
#ifndef K3_HTTP_HTTP_H
#define K3_HTTP_HTTP_H

#include <jansson.h>
#include <microhttpd.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/buf.h"
#include "k3.h"

typedef struct k3_http k3_http;

/* The phases (k3_http_drain, k3_http_end). */
enum {
    K3_HTTP_RUNNING = 0,
    K3_HTTP_DRAINING, /* new requests 503; those in flight go on */
    K3_HTTP_ENDING,   /* those in flight end with an error ending (k3_http_end_msg) */
};

/* What the application says of a request line. */
typedef struct k3_http_route {
    const void *route; /* the application's, handed back to error and dispatch; NULL: no such path */
    bool method_ok;    /* the path takes this method (else 405, or 501 for an unknown method) */
    const char *allow; /* the methods the path takes (the 405's message) */
    bool needs_key;    /* the API key is asked for (an unknown path asks for it too) */
    bool during_drain; /* answered while shutting down (/health, /metrics) */
} k3_http_route;

typedef struct k3_http_app {
    void *arg;
    void (*find)(void *arg, const char *method, const char *url, k3_http_route *out);
    /* queues an error in route's API shape (route NULL: an unknown path) */
    enum MHD_Result (*error)(void *arg, struct MHD_Connection *c, const void *route, unsigned status, const char *msg);
    /* the request is in: its body (within the limit; too_big when it was
     * over it, the body dropped) */
    enum MHD_Result (*dispatch)(void *arg, struct MHD_Connection *c, const void *route, const char *url,
                                const char *method, const k3_buf *body, bool too_big);
} k3_http_app;

typedef struct k3_http_options {
    const char *host;            /* NULL = "127.0.0.1" */
    int port;                    /* 0 = any free port */
    const char *api_key;         /* NULL: none; "" is refused */
    size_t max_body_bytes;       /* 0 = 4 MiB */
    int max_connections;         /* 0 = 256 */
    int max_connections_per_ip;  /* 0 = no cap */
    int timeout_s;               /* idle (0 = 30) */
    int header_timeout_s;        /* 0 = 10 */
    int body_timeout_s;          /* 0 = 60 */
    const char *allowed_origins; /* CORS (see k3_server_options) */
    const char *allowed_methods;
    const char *allowed_headers;
} k3_http_options;

k3_status k3_http_start(k3_http **out, const k3_http_options *o, const k3_http_app *app, k3_error *err);
/* Stops listening and joins the threads (the handlers must have seen
 * k3_http_stopping first). */
void k3_http_stop(k3_http *h);
int k3_http_port(const k3_http *h);
bool k3_http_has_key(const k3_http *h);
size_t k3_http_max_body(const k3_http *h);
int k3_http_timeout(const k3_http *h);

void k3_http_drain(k3_http *h);
/* Phase ENDING with why (the handlers end their requests with it). */
void k3_http_end(k3_http *h, const char *why);
int k3_http_phase(const k3_http *h);
const char *k3_http_end_msg(const k3_http *h);
/* Requests received and not yet answered in full; open connections. */
int k3_http_in_flight(k3_http *h);
int k3_http_connections(k3_http *h);

/* ---- answers ---------------------------------------------------------- */

/* Queues text[0..len) (taken) with Content-Type type (NULL: none); a 503 or
 * 429 carries Retry-After, a 401 WWW-Authenticate, a 415 Accept-Encoding:
 * identity, and every answer k3_http_headers. Counted. */
enum MHD_Result k3_http_queue(k3_http *h, struct MHD_Connection *c, unsigned status, char *text, size_t len,
                              const char *type);
/* A JSON answer (takes body's reference). */
enum MHD_Result k3_http_json(k3_http *h, struct MHD_Connection *c, unsigned status, json_t *body);
/* OpenAI's error object {"error": {message, type, param, code}}; and
 * Anthropic's {"type": "error", "error": {type, message}}. Each takes
 * message's reference (NULL: "error"). */
json_t *k3_http_error_json(unsigned status, json_t *message);
json_t *k3_http_anthropic_error_json(unsigned status, json_t *message);
/* msg as a JSON string, a byte that is not printable ASCII as '?'. */
json_t *k3_http_str(const char *msg);
/* Queues an error in OpenAI's shape. */
enum MHD_Result k3_http_error(k3_http *h, struct MHD_Connection *c, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Queues a streamed answer (status 200, Content-Type type, no cache) read
 * from fn; counted like the others. */
enum MHD_Result k3_http_queue_stream(k3_http *h, struct MHD_Connection *c, unsigned status, const char *type,
                                     MHD_ContentReaderCallback fn, void *cls, MHD_ContentReaderFreeCallback done);
/* The headers every answer carries: CORS for an allowed Origin; Connection:
 * close while shutting down or for a connection over a limit. */
void k3_http_headers(k3_http *h, struct MHD_Connection *c, struct MHD_Response *r);
/* The request's Origin (*origin): 0 none, 1 allowed, -1 refused. */
int k3_http_origin(k3_http *h, struct MHD_Connection *c, const char **origin);
/* True once the client has hung up (reset, or shut both ways); a client
 * that only shut down its sending side still reads. */
bool k3_http_client_gone(struct MHD_Connection *c);
/* True once the client sent its end of stream (a half-close, or gone). */
bool k3_http_client_half_closed(struct MHD_Connection *c);
/* The k3:http_* counters and gauges of /metrics, labelled with label
 * (NULL: no label). */
void k3_http_metrics_render(k3_http *h, const char *label, k3_buf *o);

#endif /* K3_HTTP_HTTP_H */
