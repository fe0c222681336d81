/*
 * router.h -- the policy of a cache-aware router over colocated instances
 * (one per NUMA node or host), with no HTTP: which backend a request goes
 * to. (`k3 serve --role router` puts it in front of the instances; the
 * proxy's prefill/decode routing stays a policy of its own.)
 *
 * Prefix affinity from an approximate radix tree of what was sent where,
 * as SGLang's router keeps one: the prompt's full blocks of block_size
 * tokens, each named by a hash chained over the blocks before it (src/kv's
 * chain), so one hash table is a trie at block granularity; a node records
 * which backends were sent that prefix and when (an LRU bounds the tree).
 * A request goes to the healthy backend with the longest match when it
 * covers more than cache_threshold of the prompt, else to the healthy one
 * with the least cached (room for a new prefix), ties to the least loaded;
 * but when the load is out of balance -- the busiest has more than
 * balance_abs requests more than the idlest and more than balance_rel times
 * as many -- it goes to the least loaded, whatever it holds. Health: a
 * backend that fails fail_threshold times in a row is down for retry_s,
 * then gets one probe request; a success brings it back. A backend that
 * goes down is forgotten by the tree (an instance that restarts has lost
 * its RAM cache). The round-robin policy (for comparison) takes the
 * healthy backends in turn and keeps the rest.
 */
#ifndef K3_ROUTER_ROUTER_H
#define K3_ROUTER_ROUTER_H

#include <stdbool.h>
#include <stdint.h>

#include "k3.h"

#define K3_ROUTER_MAX_BACKENDS 64

typedef struct k3_router k3_router;

typedef enum k3_router_policy {
    K3_ROUTER_CACHE_AWARE = 0, /* prefix affinity, balanced by load */
    K3_ROUTER_ROUND_ROBIN,     /* in turn (no affinity): the baseline */
} k3_router_policy;

typedef struct k3_router_options {
    int32_t n_backends;     /* 1 .. K3_ROUTER_MAX_BACKENDS */
    int32_t block_size;     /* tokens per tree node (0 = 64, the engine's block) */
    double cache_threshold; /* match fraction that wins affinity (0 = 0.5; SGLang's default) */
    int32_t balance_abs;    /* load gap in requests (0 = 32; SGLang's balance_abs_threshold) */
    double balance_rel;     /* load ratio (0 = 1.5; SGLang's balance_rel_threshold) */
    int64_t max_nodes;      /* tree nodes kept (0 = 1 << 20); the least recently sent go first */
    int32_t fail_threshold; /* failures in a row that take a backend down (0 = 3) */
    double retry_s;         /* how long a backend stays down before a probe (0 = 5 s) */
    k3_router_policy policy;
} k3_router_options;

k3_status k3_router_open(k3_router **out, const k3_router_options *opt, k3_error *err);
void k3_router_close(k3_router *r);

typedef enum k3_route_why {
    K3_ROUTE_NONE = 0, /* no healthy backend */
    K3_ROUTE_AFFINITY, /* the longest cached prefix */
    K3_ROUTE_ROOM,     /* no backend holds enough of it: the least cached */
    K3_ROUTE_BALANCE,  /* the load is out of balance: the least loaded */
    K3_ROUTE_PROBE,    /* a backend that was down gets a probe */
    K3_ROUTE_RR,       /* the round-robin policy's turn */
} k3_route_why;

typedef struct k3_route {
    int32_t backend; /* -1 with K3_ROUTE_NONE */
    k3_route_why why;
    int64_t matched_tokens; /* of the prompt, on the chosen backend, by the tree */
} k3_route;

/* Picks a backend for the prompt at time now (seconds, any clock that only
 * grows) and records the request as sent there: its load grows by one and
 * the tree learns the prompt's blocks on that backend. */
k3_route k3_router_route(k3_router *r, const int32_t *tokens, int64_t n, double now);
/* The same among the backends not in exclude (bit b: backend b; those a
 * request already failed on). */
k3_route k3_router_route_excluding(k3_router *r, const int32_t *tokens, int64_t n, double now, uint64_t exclude);
/* A request the caller sent to backend itself (none was healthy and it
 * tried one anyway): recorded as k3_router_route records its choice. */
void k3_router_sent(k3_router *r, int32_t backend, const int32_t *tokens, int64_t n, double now);
/* The request sent to backend ended (ok: answered; else a connection or
 * server failure, which counts toward taking it down). */
void k3_router_done(k3_router *r, int32_t backend, bool ok, double now);
/* Tokens of the prompt the tree says backend holds (tests, metrics). */
int64_t k3_router_match(const k3_router *r, int32_t backend, const int32_t *tokens, int64_t n);

typedef struct k3_router_backend {
    int64_t load;     /* requests sent and not done */
    int64_t cached;   /* tree nodes naming it */
    int64_t routed;   /* requests sent to it */
    int64_t failures; /* in a row */
    bool healthy;
} k3_router_backend;
void k3_router_backend_get(const k3_router *r, int32_t backend, k3_router_backend *out);
/* A backend's health from outside (a /health probe): up or down now. */
void k3_router_set_health(k3_router *r, int32_t backend, bool up, double now);

#endif /* K3_ROUTER_ROUTER_H */
