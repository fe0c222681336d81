/*
 * http.c -- the response helpers of the routes (http.h).
 */
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

enum MHD_Result k3_srv_queue(struct k3_server *s, struct MHD_Connection *c, unsigned status, char *text,
                             size_t len, const char *type) {
    struct MHD_Response *r = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    if (status == 503) MHD_add_response_header(r, "Retry-After", "1");
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
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
    case 404: return "NotFoundError";
    case 405: return "MethodNotAllowedError";
    case 413: return "RequestTooLargeError";
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

bool k3_srv_client_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return true;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) < 0) return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

