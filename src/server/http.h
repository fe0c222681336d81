/*
 * http.h -- the response helpers every route uses (http.c): JSON answers,
 * errors in OpenAI's shape, strings from bytes that may not be UTF-8, the
 * CORS check and headers, and the hang-up test, on the HTTP layer every k3
 * endpoint shares (src/http/http.h). Everything in src/server answers
 * through these; they call nothing else of the server.
 */
#ifndef K3_SERVER_HTTP_H
#define K3_SERVER_HTTP_H

#include "http/http.h"
#include "server/state.h"

/* Queues text[0..len) (takes it: freed with the response) with Content-Type
 * type (NULL: none); a 503 carries Retry-After, a 401 WWW-Authenticate, a
 * 415 Accept-Encoding: identity, and every answer k3_srv_headers. Counts
 * the answer in the server's HTTP counters. */
enum MHD_Result k3_srv_queue(struct k3_server *s, struct MHD_Connection *c, unsigned status, char *text, size_t len,
                             const char *type);
/* Queues a JSON response (takes the reference of body). */
enum MHD_Result k3_srv_json(struct k3_server *s, struct MHD_Connection *c, unsigned status, json_t *body);
/* The OpenAI error object {"error": {message, type, param, code}} for status
 * (new reference, NULL when out of memory). */
json_t *k3_srv_error_json(unsigned status, const char *msg);
/* Queues an error in OpenAI's shape: {"error": {message, type, param, code}}. */
enum MHD_Result k3_srv_error(struct k3_server *s, struct MHD_Connection *c, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* A json string of s[0..n), invalid UTF-8 replaced by U+FFFD. */
json_t *k3_srv_jstr(const char *p, size_t n);
/* True once the client of c has hung up (its connection reset or shut both
 * ways); a client that only shut down its sending side still reads. */
bool k3_srv_client_gone(struct MHD_Connection *c);
/* True once the client of c sent its end of stream (a half-close, or gone):
 * a stream then probes it with a comment, whose write fails if it is gone. */
bool k3_srv_client_half_closed(struct MHD_Connection *c);
/* The request's Origin (*origin, NULL without one): 0 none, 1 allowed
 * (an origin of --allowed-origins, or the server's own), -1 refused. */
int k3_srv_origin(struct k3_server *s, struct MHD_Connection *c, const char **origin);
/* The headers every response carries: CORS for an allowed Origin, and
 * Connection: close once the server is shutting down. */
void k3_srv_headers(struct k3_server *s, struct MHD_Connection *c, struct MHD_Response *r);

#endif /* K3_SERVER_HTTP_H */
