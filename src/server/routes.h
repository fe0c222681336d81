/*
 * routes.h -- the routing table (routes.c): one row per route, {method,
 * path, handler, flags}. server.c finds the row of a request and applies
 * what its flags ask for (the API key, a JSON body naming this server's
 * model, an engine that has not failed, whether it answers during a
 * shutdown) before the handler runs.
 */
#ifndef K3_SERVER_ROUTES_H
#define K3_SERVER_ROUTES_H

#include "server/state.h"

/* root: the request's JSON object (K3_ROUTE_JSON), else NULL. */
typedef enum MHD_Result (*k3_route_fn)(struct k3_server *s, struct MHD_Connection *c, json_t *root);

enum {
    K3_ROUTE_AUTH = 1u << 0,      /* needs the API key, when the server has one */
    K3_ROUTE_JSON = 1u << 1,      /* a JSON object body; its "model", if any, must be this server's */
    K3_ROUTE_GENERATES = 1u << 2, /* runs the engine: 503 without one, or once it has failed */
    K3_ROUTE_METRICS = 1u << 3,   /* needs the API key only with --metrics-require-key */
    K3_ROUTE_DRAIN = 1u << 4,     /* still answers while the server shuts down */
};

typedef struct k3_route {
    const char *method; /* "GET" (HEAD too) or "POST" */
    const char *path;
    k3_route_fn fn;
    unsigned flags;     /* K3_ROUTE_* */
} k3_route;

/* The row of method and path, or NULL; *same_path (may be NULL) gets a row
 * of the path for another method (a 405), or NULL (a 404). */
const k3_route *k3_srv_route_find(const char *method, const char *path, const k3_route **same_path);

#endif /* K3_SERVER_ROUTES_H */
