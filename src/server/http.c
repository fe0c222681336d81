/*
 * http.c -- the response helpers of the routes (http.h): the server's side
 * of the HTTP layer every endpoint shares (src/http), and errors in
 * OpenAI's shape with the request's own text repaired to UTF-8.
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

/* ---- what src/http does for every endpoint ----------------------------------- */

int k3_srv_origin(struct k3_server *s, struct MHD_Connection *c, const char **origin) {
    return k3_http_origin(s->http, c, origin);
}

void k3_srv_headers(struct k3_server *s, struct MHD_Connection *c, struct MHD_Response *r) {
    k3_http_headers(s->http, c, r);
}

enum MHD_Result k3_srv_queue(struct k3_server *s, struct MHD_Connection *c, unsigned status, char *text, size_t len,
                             const char *type) {
    return k3_http_queue(s->http, c, status, text, len, type);
}

enum MHD_Result k3_srv_json(struct k3_server *s, struct MHD_Connection *c, unsigned status, json_t *body) {
    return k3_http_json(s->http, c, status, body);
}

bool k3_srv_client_gone(struct MHD_Connection *c) { return k3_http_client_gone(c); }

bool k3_srv_client_half_closed(struct MHD_Connection *c) { return k3_http_client_half_closed(c); }

/* ---- errors: OpenAI's shape, with any text the request brought ------------------- */

json_t *k3_srv_error_json(unsigned status, const char *msg) {
    return k3_http_error_json(status, k3_srv_jstr(msg, strlen(msg)));
}

enum MHD_Result k3_srv_error(struct k3_server *s, struct MHD_Connection *c, unsigned status, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return k3_srv_json(s, c, status, k3_srv_error_json(status, msg));
}
