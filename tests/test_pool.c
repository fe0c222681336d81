/* test_pool.c -- k3_pool_for: coverage, ranges, nesting, sleep/wake. */
#include "test.h"

#include "common/pool.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

typedef struct {
    _Atomic int *hits;
    _Atomic int bad;    /* a range or thread index out of bounds */
    int64_t n;
    int nth_max;
} cover_job;

static void cover_fn(void *ctx, int64_t lo, int64_t hi, int ith) {
    cover_job *j = ctx;
    if (lo < 0 || hi > j->n || lo >= hi || ith < 0 || ith >= j->nth_max) atomic_store(&j->bad, 1);
    for (int64_t i = lo; i < hi && i < j->n && i >= 0; i++) atomic_fetch_add(&j->hits[i], 1);
}

static int covered_once(k3_pool *pool, int64_t n, int64_t grain) {
    cover_job j = {calloc((size_t)(n > 0 ? n : 1), sizeof(_Atomic int)), 0, n, k3_pool_size(pool)};
    if (!j.hits) return 0;
    k3_pool_for(pool, n, grain, cover_fn, &j);
    int ok = !atomic_load(&j.bad);
    for (int64_t i = 0; i < n; i++) ok &= atomic_load(&j.hits[i]) == 1;
    free(j.hits);
    return ok;
}

K3_TEST(pool_covers_every_index_once) {
    static const int64_t ns[] = {0, 1, 2, 3, 7, 64, 100, 1001, 12345};
    static const int64_t grains[] = {1, 3, 1000};
    CHECK(k3_pool_size(NULL) == 1);
    for (size_t g = 0; g < 3; g++)
        for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++)
            CHECKF(covered_once(NULL, ns[i], grains[g]), "NULL pool n=%lld", (long long)ns[i]);
    for (int t = 1; t <= 4; t++) {
        k3_pool *pool = NULL;
        REQUIRE(k3_pool_init(&pool, t, NULL) == K3_OK);
        CHECK(k3_pool_size(pool) == t);
        for (size_t g = 0; g < 3; g++)
            for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++)
                CHECKF(covered_once(pool, ns[i], grains[g]), "threads=%d n=%lld grain=%lld", t,
                       (long long)ns[i], (long long)grains[g]);
        k3_pool_free(pool);
    }
}

/* Chunks tile [0, n) in order, each of at least grain items (the last may be
 * short), handed to valid thread indices, shrinking as the work runs out;
 * n <= grain stays inline. */
typedef struct {
    int64_t lo[64], hi[64];
    int ith[64];
    _Atomic int calls;
} range_job;

static void range_fn(void *ctx, int64_t lo, int64_t hi, int ith) {
    range_job *j = ctx;
    const int c = atomic_fetch_add(&j->calls, 1);
    if (c < 64) {
        j->lo[c] = lo;
        j->hi[c] = hi;
        j->ith[c] = ith;
    }
}

static bool tiles(range_job *j, int64_t n, int64_t grain, int threads) {
    const int calls = atomic_load(&j->calls);
    if (calls < 1 || calls > 64) return false;
    int64_t at = 0;
    for (int k = 0; k < calls; k++) { /* find the chunk starting at `at` */
        int f = -1;
        for (int q = 0; q < calls; q++)
            if (j->lo[q] == at) f = q;
        if (f < 0 || j->ith[f] < 0 || j->ith[f] >= threads) return false;
        if (j->hi[f] - j->lo[f] < grain && j->hi[f] != n) return false;
        at = j->hi[f];
    }
    return at == n;
}

K3_TEST(pool_ranges_and_grain) {
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 3, NULL) == K3_OK);
    range_job j = {0};
    k3_pool_for(pool, 10, 1, range_fn, &j); /* chunks of ceil(10 / 12) = 1 */
    CHECK(atomic_load(&j.calls) == 10 && tiles(&j, 10, 1, 3));
    range_job k = {0};
    k3_pool_for(pool, 10, 10, range_fn, &k); /* n <= grain: one inline call */
    CHECK(atomic_load(&k.calls) == 1 && k.lo[0] == 0 && k.hi[0] == 10 && k.ith[0] == 0);
    range_job m = {0};
    k3_pool_for(pool, 10, 4, range_fn, &m); /* chunks of 4, 4, 2 */
    CHECK(atomic_load(&m.calls) == 3 && tiles(&m, 10, 4, 3));
    range_job l = {0};
    k3_pool_for(pool, 1000, 1, range_fn, &l); /* guided: 1000 / 6 = 166 first, then smaller */
    CHECK(tiles(&l, 1000, 1, 3));
    int64_t prev = 0, last = 0;
    bool shrinking = true;
    for (int64_t at = 0; at < 1000;) { /* chunk sizes in counter order */
        int f = -1;
        for (int q = 0; q < atomic_load(&l.calls); q++)
            if (l.lo[q] == at) f = q;
        REQUIRE(f >= 0);
        last = l.hi[f] - l.lo[f];
        if (at == 0) CHECKF(last == 166, "first chunk %lld", (long long)last);
        shrinking &= at == 0 || last <= prev;
        prev = last;
        at = l.hi[f];
    }
    CHECK(shrinking && last == 1);
    k3_pool_free(pool);
}

typedef struct {
    k3_pool *pool;
    _Atomic int *hits; /* [outer * inner] */
    int64_t inner;
    _Atomic int bad;
} nest_job;

typedef struct {
    nest_job *outer;
    int64_t row;
} nest_inner;

static void inner_fn(void *ctx, int64_t lo, int64_t hi, int ith) {
    nest_inner *in = ctx;
    /* A nested call must run inline: one call, thread 0, the whole range. */
    if (ith != 0 || lo != 0 || hi != in->outer->inner) atomic_store(&in->outer->bad, 1);
    for (int64_t i = lo; i < hi; i++)
        atomic_fetch_add(&in->outer->hits[in->row * in->outer->inner + i], 1);
}

static void outer_fn(void *ctx, int64_t lo, int64_t hi, int ith) {
    nest_job *j = ctx;
    for (int64_t r = lo; r < hi; r++) {
        nest_inner in = {j, r};
        k3_pool_for(j->pool, j->inner, 1, inner_fn, &in);
    }
}

K3_TEST(pool_nested_calls_run_inline) {
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    enum { OUT = 9, IN = 50 };
    static _Atomic int hits[OUT * IN];
    nest_job j = {pool, hits, IN, 0};
    k3_pool_for(pool, OUT, 1, outer_fn, &j);
    CHECK(!atomic_load(&j.bad));
    int ok = 1;
    for (int i = 0; i < OUT * IN; i++) ok &= atomic_load(&hits[i]) == 1;
    CHECK(ok);
    /* The pool is usable again from the top level afterwards. */
    CHECK(covered_once(pool, 1000, 1));
    k3_pool_free(pool);
}

typedef struct {
    _Atomic int64_t sum;
} sum_job;

static void sum_fn(void *ctx, int64_t lo, int64_t hi, int ith) {
    sum_job *j = ctx;
    int64_t s = 0;
    for (int64_t i = lo; i < hi; i++) s += i;
    atomic_fetch_add(&j->sum, s);
}

K3_TEST(pool_many_calls_and_sleep_wake) {
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    int ok = 1;
    for (int it = 0; it < 5000; it++) {
        sum_job j = {0};
        int64_t n = 1 + it % 97;
        k3_pool_for(pool, n, 1, sum_fn, &j);
        ok &= atomic_load(&j.sum) == n * (n - 1) / 2;
    }
    CHECK(ok);
    /* Let the workers fall asleep (spinning stops after ~50 us), then wake. */
    for (int it = 0; it < 5; it++) {
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
        sum_job j = {0};
        k3_pool_for(pool, 1000, 1, sum_fn, &j);
        CHECK(atomic_load(&j.sum) == 1000 * 999 / 2);
    }
    k3_pool_free(pool);
    /* 0 threads = one per CPU. */
    REQUIRE(k3_pool_init(&pool, 0, NULL) == K3_OK);
    CHECK(k3_pool_size(pool) >= 1);
    CHECK(covered_once(pool, 333, 1));
    k3_pool_free(pool);
}
