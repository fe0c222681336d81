/* test_router.c -- the cache-aware routing policy (src/router) with two and
 * three instances: a conversation's turns go where its prefix was sent, new
 * conversations spread over the instances, the least loaded takes over when
 * the load is out of balance, a failing instance is skipped, probed after
 * its retry time and brought back by a success, and the tree stays within
 * its node budget. */
#include <stdlib.h>
#include <string.h>

#include "router/router.h"
#include "test.h"

enum { BS = 16 };

/* conversation c, turn t: a shared system prompt, then the conversation's
 * own text growing by 40 tokens a turn */
static int64_t convo(int32_t *tok, int c, int t) {
    int64_t n = 0;
    for (int i = 0; i < 48; i++) tok[n++] = 5 + i;
    for (int i = 0; i < 60 + 40 * t; i++) tok[n++] = 100 + (c * 977 + i * 31) % 900;
    return n;
}

static k3_router *open_router(int n, int32_t abs_gap) {
    k3_router *r = NULL;
    k3_error err = {0};
    k3_router_options o = {.n_backends = n, .block_size = BS, .balance_abs = abs_gap, .retry_s = 10};
    if (k3_router_open(&r, &o, &err)) k3_test_fail(__FILE__, __LINE__, "%s", err.msg);
    return r;
}

static void affinity(int n_backends) {
    k3_router *r = open_router(n_backends, 32);
    REQUIRE(r);
    int32_t tok[1024];
    int where[12];
    double now = 0;
    /* turn 0 of 3 conversations per backend, then 5 turns each, interleaved */
    const int nc = 3 * n_backends;
    for (int c = 0; c < nc; c++) {
        const k3_route rt = k3_router_route(r, tok, convo(tok, c, 0), now += 1);
        where[c] = rt.backend;
        CHECK(rt.backend >= 0);
        k3_router_done(r, rt.backend, true, now);
    }
    int per[8] = {0};
    for (int c = 0; c < nc; c++) per[where[c]]++;
    for (int b = 0; b < n_backends; b++) CHECKF(per[b] == 3, "backend %d got %d new conversations", b, per[b]);
    int moved = 0;
    for (int t = 1; t <= 5; t++)
        for (int c = 0; c < nc; c++) {
            const int64_t n = convo(tok, c, t);
            const k3_route rt = k3_router_route(r, tok, n, now += 1);
            moved += rt.backend != where[c];
            CHECK(rt.why == K3_ROUTE_AFFINITY);
            CHECKF(rt.matched_tokens == (convo(tok, c, t - 1) / BS) * BS, "turn %d matched %lld", t,
                   (long long)rt.matched_tokens);
            convo(tok, c, t);
            k3_router_done(r, rt.backend, true, now);
        }
    CHECKF(moved == 0, "%d turns left their conversation's instance", moved);
    k3_router_close(r);
}

K3_TEST(router_affinity_two_instances) { affinity(2); }
K3_TEST(router_affinity_three_instances) { affinity(3); }

K3_TEST(router_balance_when_one_is_busier) {
    k3_router *r = open_router(2, 4);
    REQUIRE(r);
    int32_t tok[1024];
    const k3_route first = k3_router_route(r, tok, convo(tok, 0, 0), 1);
    k3_router_done(r, first.backend, true, 1);
    /* the conversation's instance gets 5 requests in flight */
    for (int i = 0; i < 5; i++) {
        const k3_route rt = k3_router_route(r, tok, convo(tok, 0, 1 + i), 2 + i);
        CHECK(rt.backend == first.backend && rt.why == K3_ROUTE_AFFINITY);
    }
    k3_router_backend b;
    k3_router_backend_get(r, first.backend, &b);
    CHECK(b.load == 5);
    /* 5 > 0 + 4 and 5 > 1.5 * 0: the next turn goes to the idle one */
    const k3_route rt = k3_router_route(r, tok, convo(tok, 0, 8), 10);
    CHECK(rt.backend != first.backend && rt.why == K3_ROUTE_BALANCE);
    k3_router_close(r);
}

K3_TEST(router_failover_and_probe) {
    k3_router *r = open_router(3, 32);
    REQUIRE(r);
    int32_t tok[1024];
    const k3_route a = k3_router_route(r, tok, convo(tok, 7, 0), 1);
    k3_router_done(r, a.backend, true, 1);
    /* three failures in a row take it down */
    for (int i = 0; i < 3; i++) {
        const k3_route rt = k3_router_route(r, tok, convo(tok, 7, 1), 2 + i);
        CHECK(rt.backend == a.backend);
        k3_router_done(r, rt.backend, false, 2 + i);
    }
    k3_router_backend b;
    k3_router_backend_get(r, a.backend, &b);
    CHECK(!b.healthy && b.failures == 3);
    const k3_route moved = k3_router_route(r, tok, convo(tok, 7, 1), 6);
    CHECK(moved.backend >= 0 && moved.backend != a.backend);
    k3_router_done(r, moved.backend, true, 6);
    /* after retry_s: one probe, and a success brings it back */
    const k3_route probe = k3_router_route(r, tok, convo(tok, 9, 0), 20);
    CHECK(probe.backend == a.backend && probe.why == K3_ROUTE_PROBE);
    const k3_route during = k3_router_route(r, tok, convo(tok, 7, 2), 20.5);
    CHECK(during.backend != a.backend); /* one probe at a time */
    k3_router_done(r, during.backend, true, 20.5);
    k3_router_done(r, probe.backend, true, 21);
    k3_router_backend_get(r, a.backend, &b);
    CHECK(b.healthy && b.failures == 0);
    /* a failed probe: down again for retry_s */
    k3_router_set_health(r, a.backend, false, 30);
    CHECK(k3_router_route(r, tok, convo(tok, 9, 1), 31).backend != a.backend);
    const k3_route p2 = k3_router_route(r, tok, convo(tok, 9, 1), 41);
    CHECK(p2.backend == a.backend && p2.why == K3_ROUTE_PROBE);
    k3_router_done(r, p2.backend, false, 41);
    k3_router_backend_get(r, a.backend, &b);
    CHECK(!b.healthy);
    /* all down: no backend */
    for (int k = 0; k < 3; k++) k3_router_set_health(r, k, false, 42);
    CHECK(k3_router_route(r, tok, convo(tok, 1, 0), 43).why == K3_ROUTE_NONE);
    k3_router_close(r);
}

K3_TEST(router_tree_bounded) {
    k3_router *r = NULL;
    k3_error err = {0};
    k3_router_options o = {.n_backends = 2, .block_size = BS, .max_nodes = 64};
    REQUIRE(!k3_router_open(&r, &o, &err));
    int32_t tok[1024];
    for (int c = 0; c < 40; c++) {
        const k3_route rt = k3_router_route(r, tok, convo(tok, c, 2), c);
        k3_router_done(r, rt.backend, true, c);
    }
    k3_router_backend a, b;
    k3_router_backend_get(r, 0, &a);
    k3_router_backend_get(r, 1, &b);
    CHECKF(a.cached + b.cached <= 2 * 64 && a.cached > 0 && b.cached > 0, "cached %lld + %lld", (long long)a.cached,
           (long long)b.cached);
    /* the newest conversation is still known where it went */
    const int64_t n = convo(tok, 39, 2);
    CHECK(k3_router_match(r, 0, tok, n) + k3_router_match(r, 1, tok, n) >= (n / BS) * BS);
    k3_router_options bad = {.n_backends = 0};
    CHECK(k3_router_open(&r, &bad, &err) == K3_ERR_ARG);
    k3_router_close(r);
}

K3_TEST(router_excluding_round_robin_and_forgetting) {
    k3_router *r = open_router(3, 32);
    REQUIRE(r);
    int32_t tok[1024];
    const int64_t n = convo(tok, 3, 0);
    const k3_route a = k3_router_route(r, tok, n, 1);
    k3_router_done(r, a.backend, true, 1);
    /* the backend a request failed on is not chosen again for it */
    const k3_route b = k3_router_route_excluding(r, tok, n, 2, 1ull << a.backend);
    CHECK(b.backend >= 0 && b.backend != a.backend);
    CHECK(k3_router_route_excluding(r, tok, n, 2, 7).why == K3_ROUTE_NONE);
    k3_router_done(r, b.backend, true, 2);
    /* a backend that goes down is forgotten: back up, it holds nothing */
    CHECK(k3_router_match(r, a.backend, tok, n) > 0);
    k3_router_set_health(r, a.backend, false, 3);
    k3_router_backend x;
    k3_router_backend_get(r, a.backend, &x);
    CHECK(x.cached == 0 && k3_router_match(r, a.backend, tok, n) == 0);
    CHECK(k3_router_match(r, b.backend, tok, n) > 0);
    /* a request sent while none was healthy is recorded where it went */
    k3_router_sent(r, a.backend, tok, n, 4);
    k3_router_backend_get(r, a.backend, &x);
    CHECK(x.load == 1 && k3_router_match(r, a.backend, tok, n) == (n / BS) * BS);
    k3_router_close(r);
    /* round-robin: in turn, whatever each holds */
    k3_router_options o = {.n_backends = 3, .block_size = BS, .policy = K3_ROUTER_ROUND_ROBIN};
    k3_error err = {0};
    REQUIRE(!k3_router_open(&r, &o, &err));
    for (int i = 0; i < 6; i++) {
        const k3_route rt = k3_router_route(r, tok, n, 10 + i);
        CHECK(rt.backend == i % 3 && rt.why == K3_ROUTE_RR);
        k3_router_done(r, rt.backend, true, 10 + i);
    }
    k3_router_close(r);
}
