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
/* A route of a path family (K3_ROUTE_PREFIX): url is the request's path. */
typedef enum MHD_Result (*k3_route_url_fn)(struct k3_server *s, struct MHD_Connection *c, const char *url);
/* Queues an error response in the shape of a route's API. */
typedef enum MHD_Result (*k3_route_error_fn)(struct k3_server *s, struct MHD_Connection *c, unsigned status,
                                             const char *msg);

enum {
    K3_ROUTE_AUTH = 1u << 0,      /* needs the API key, when the server has one */
    K3_ROUTE_JSON = 1u << 1,      /* a JSON object body; its "model", if any, must be this server's */
    K3_ROUTE_GENERATES = 1u << 2, /* runs the engine: 503 without one, or once it has failed */
    K3_ROUTE_METRICS = 1u << 3,   /* needs the API key only with --metrics-require-key */
    K3_ROUTE_DRAIN = 1u << 4,     /* still answers while the server shuts down */
    K3_ROUTE_PREFIX = 1u << 5,    /* path ends in '/': every path one segment below it (fn_url) */
};

typedef struct k3_route {
    const char *method; /* "GET" (HEAD too), "POST" or "DELETE" */
    const char *path;
    k3_route_fn fn;
    unsigned flags;          /* K3_ROUTE_* */
    k3_route_url_fn fn_url;  /* instead of fn (K3_ROUTE_PREFIX rows) */
    k3_route_error_fn error; /* every error of the route, the server's own included (the API key,
                                the body, the model name); NULL: OpenAI's shape */
} k3_route;

/* The row of method and path, or NULL; *same_path (may be NULL) gets a row
 * of the path for another method (a 405), or NULL (a 404). */
const k3_route *k3_srv_route_find(const char *method, const char *path, const k3_route **same_path);
/* Queues an error in rt's shape (rt NULL: OpenAI's). */
enum MHD_Result k3_srv_route_error(const k3_route *rt, struct k3_server *s, struct MHD_Connection *c, unsigned status,
                                   const char *fmt, ...) __attribute__((format(printf, 5, 6)));

#endif /* K3_SERVER_ROUTES_H */
