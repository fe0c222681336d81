/*
 * http.c -- the response helpers of the routes (http.h).
 */
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/error.h"
#include "server/http.h"

json_t *k3_srv_jstr(const char *p, size_t n) {
    if (k3_utf8_valid(p, n)) return json_stringn(p, n);
    size_t m;
    char *r = k3_utf8_repair(p, n, &m);
    if (!r) return NULL;
    /* a NUL byte became U+FFFD too, so r is valid */
    json_t *j = json_stringn(r, m);
    free(r);
    return j;
}

/* ---- CORS --------------------------------------------------------------- */

/* "localhost", "127.x.y.z" or "[::1]", a port after it or not. */
static bool host_is_loopback(const char *h, size_t n) {
    if (n >= 5 && h[0] == '[') return n >= 5 && !strncmp(h, "[::1]", 5) && (n == 5 || h[5] == ':');
    size_t end = 0;
    while (end < n && h[end] != ':') end++;
    if (end == 9 && !strncasecmp(h, "localhost", 9)) return true;
    if (end < 4 || strncmp(h, "127.", 4)) return false;
    for (size_t i = 4; i < end; i++)
        if (!(h[i] == '.' || (h[i] >= '0' && h[i] <= '9'))) return false;
    return true;
}

int k3_srv_origin(struct k3_server *s, struct MHD_Connection *c, const char **origin) {
    const char *o = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    *origin = o;
    if (!o) return 0;
    if (s->any_origin) return 1;
    for (int i = 0; i < s->n_origins; i++)
        if (!strcasecmp(o, s->origins[i])) return 1;
    /* the server's own origin: the page it serves calling it. Bound to a
     * loopback address, the host must be a loopback one too, so a page whose
     * name was made to resolve to 127.0.0.1 (DNS rebinding) is not "own" */
    const char *host = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host");
    if (host && !strncasecmp(o, "http://", 7) && !strcasecmp(o + 7, host) &&
        (!s->loopback || host_is_loopback(host, strlen(host))))
        return 1;
    return -1;
}

void k3_srv_headers(struct k3_server *s, struct MHD_Connection *c, struct MHD_Response *r) {
    const char *o;
    if (k3_srv_origin(s, c, &o) > 0) {
        MHD_add_response_header(r, "Access-Control-Allow-Origin", s->any_origin ? "*" : o);
        if (!s->any_origin) MHD_add_response_header(r, "Vary", "Origin");
    }
    /* a server that is shutting down keeps no connection open */
    if (atomic_load(&s->phase) != K3_SRV_RUNNING) MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
}

enum MHD_Result k3_srv_queue(struct k3_server *s, struct MHD_Connection *c, unsigned status, char *text, size_t len,
                             const char *type) {
    struct MHD_Response *r = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    if (type) MHD_add_response_header(r, "Content-Type", type);
    if (status == 503 || status == 429) MHD_add_response_header(r, "Retry-After", "1");
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    if (status == 415) MHD_add_response_header(r, "Accept-Encoding", "identity");
    k3_srv_headers(s, c, r);
    pthread_mutex_lock(&s->metrics.mu);
    s->metrics.http_requests++;
    if (status >= 400) s->metrics.http_errors++;
    pthread_mutex_unlock(&s->metrics.mu);
    const enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

enum MHD_Result k3_srv_json(struct k3_server *s, struct MHD_Connection *c, unsigned status, json_t *body) {
    char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (!text) return MHD_NO;
    return k3_srv_queue(s, c, status, text, strlen(text), "application/json");
}

static const char *error_type(unsigned status) {
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

json_t *k3_srv_error_json(unsigned status, const char *msg) {
    json_t *m = k3_srv_jstr(msg, strlen(msg));
    return json_pack("{s:{s:o,s:s,s:n,s:i}}", "error", "message", m ? m : json_string("error"), "type",
                     error_type(status), "param", "code", (json_int_t)status);
}

enum MHD_Result k3_srv_error(struct k3_server *s, struct MHD_Connection *c, unsigned status, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return k3_srv_json(s, c, status, k3_srv_error_json(status, msg));
}

/* A half-close (POLLRDHUP: the client shut down its sending side, as
 * `nc -N`, HTTP/1.0 clients and some proxies do after the request) is not a
 * hang-up: the client still reads. Only the connection's error or hang-up
 * state is (a reset, or both directions shut). */
bool k3_srv_client_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return true;
    struct pollfd p = {.fd = ci->connect_fd, .events = 0};
    if (poll(&p, 1, 0) < 0) return false;
    return (p.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0;
}

bool k3_srv_client_half_closed(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return true;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) < 0) return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}
