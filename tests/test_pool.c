/* test_pool.c -- k3_pool_for: coverage, ranges, nesting, sleep/wake. */
#include "test.h"

#include "common/pool.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    _Atomic int *hits;
    _Atomic int bad; /* a range or thread index out of bounds */
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
                CHECKF(covered_once(pool, ns[i], grains[g]), "threads=%d n=%lld grain=%lld", t, (long long)ns[i],
                       (long long)grains[g]);
        k3_pool_free(pool);
    }
}

/* Chunks tile [0, n), each of at least grain items (the last may be short),
 * handed to valid thread indices; n <= grain stays inline. */
enum { MAX_CALLS = 512 };

typedef struct {
    int64_t lo[MAX_CALLS], hi[MAX_CALLS];
    int ith[MAX_CALLS];
    _Atomic int calls;
    int64_t sleep_at; /* a call starting here sleeps 20 ms first (-1: none) */
} range_job;

static void range_fn(void *ctx, int64_t lo, int64_t hi, int ith) {
    range_job *j = ctx;
    const int c = atomic_fetch_add(&j->calls, 1);
    if (c < MAX_CALLS) {
        j->lo[c] = lo;
        j->hi[c] = hi;
        j->ith[c] = ith;
    }
    if (lo == j->sleep_at) {
        struct timespec ts = {0, 20000000};
        nanosleep(&ts, NULL);
    }
}

static bool tiles(range_job *j, int64_t n, int64_t grain, int threads) {
    const int calls = atomic_load(&j->calls);
    if (calls < 1 || calls > MAX_CALLS) return false;
    int64_t at = 0;
    for (int k = 0; k < calls; k++) { /* find the chunk starting at `at` */
        int f = -1;
        for (int q = 0; q < calls; q++)
            if (j->lo[q] == at) f = q;
        if (f < 0 || j->ith[f] < 0 || j->ith[f] >= threads) return false;
        if (j->hi[f] - j->lo[f] < grain && j->hi[f] != n) return false;
        if (j->lo[f] % grain) return false;
        at = j->hi[f];
    }
    return at == n;
}

K3_TEST(pool_ranges_and_grain) {
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 3, NULL) == K3_OK);
    range_job j = {.sleep_at = -1};
    k3_pool_for(pool, 10, 1, range_fn, &j); /* shares of 3, 3, 4, one item a claim, or stolen */
    CHECK(atomic_load(&j.calls) <= 10 && tiles(&j, 10, 1, 3));
    range_job k = {.sleep_at = -1};
    k3_pool_for(pool, 10, 10, range_fn, &k); /* n <= grain: one inline call */
    CHECK(atomic_load(&k.calls) == 1 && k.lo[0] == 0 && k.hi[0] == 10 && k.ith[0] == 0);
    range_job m = {.sleep_at = -1};
    k3_pool_for(pool, 10, 4, range_fn, &m); /* two threads: 4 | 4, 2 (or 6 stolen whole) */
    CHECK(atomic_load(&m.calls) <= 3 && tiles(&m, 10, 4, 3));
    range_job l = {.sleep_at = -1};
    k3_pool_for(pool, 1000, 8, range_fn, &l);
    CHECK(tiles(&l, 1000, 8, 3));
    k3_pool_free(pool);
}

/* Each thread takes its own share from the front in adjacent chunks of an
 * eighth of what is left, and a thread that is done steals the back half of
 * what another has left: here the caller sleeps in its first chunk, so the
 * worker does all of its share in order, then most of the caller's. */
K3_TEST(pool_shares_in_order_and_stealing) {
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    static range_job j;
    memset(&j, 0, sizeof j);
    j.sleep_at = 0;
    k3_pool_for(pool, 1000, 8, range_fn, &j); /* shares [0, 496) and [496, 1000) */
    REQUIRE(tiles(&j, 1000, 8, 2));
    const int calls = atomic_load(&j.calls);
    int64_t at = 496, stolen = 0, first0 = -1;
    bool in_order = true, shrinking = true;
    int64_t prev = 1 << 30;
    for (int c = 0; c < calls; c++) {
        if (j.ith[c] == 0) {
            if (first0 < 0) first0 = c;
            continue;
        }
        if (at < 1000) { /* still its own share */
            in_order &= j.lo[c] == at;
            shrinking &= j.hi[c] - j.lo[c] <= prev;
            prev = j.hi[c] - j.lo[c];
            at = j.hi[c];
        } else {
            stolen += j.hi[c] - j.lo[c];
            in_order &= j.hi[c] <= 496;
        }
    }
    CHECK(first0 >= 0 && j.lo[first0] == 0 && j.hi[first0] == 64); /* 496 / 8 = 62, up to a grain */
    CHECK(in_order && shrinking && at == 1000);
    CHECKF(stolen >= 248 && stolen <= 432, "stolen %lld", (long long)stolen);
    k3_pool_free(pool);
}

/* Ranges past what a share's 32-bit fields hold run as pieces. */
typedef struct {
    _Atomic uint64_t items, index_sum;
    _Atomic int64_t top;
    _Atomic int bad;
} long_job;

static void long_fn(void *ctx, int64_t lo, int64_t hi, int ith) {
    long_job *j = ctx;
    if (lo < 0 || lo >= hi || lo % 3) atomic_store(&j->bad, 1);
    atomic_fetch_add(&j->items, (uint64_t)(hi - lo));
    /* Σ i over [lo, hi), mod 2^64 */
    const uint64_t a = (uint64_t)lo, b = (uint64_t)hi;
    atomic_fetch_add(&j->index_sum, (b - a) % 2 ? (a + b - 1) / 2 * (b - a) : (b - a) / 2 * (a + b - 1));
    int64_t t = atomic_load(&j->top);
    while (hi > t && !atomic_compare_exchange_weak(&j->top, &t, hi)) {}
}

K3_TEST(pool_long_ranges) {
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    const int64_t n = 3 * (INT64_C(1) << 32) + 5; /* pieces of 6 x 2^28 items (two grains), then 5 inline */
    long_job j = {0};
    k3_pool_for(pool, n, 3 * (INT64_C(1) << 28), long_fn, &j);
    const uint64_t un = (uint64_t)n;
    CHECK(!atomic_load(&j.bad));
    CHECK(atomic_load(&j.items) == un && atomic_load(&j.top) == n);
    CHECK(atomic_load(&j.index_sum) == (un % 2 ? (un - 1) / 2 * un : un / 2 * (un - 1)));
    long_job k = {0}; /* a grain past 2^31: pieces of one grain, each inline */
    k3_pool_for(pool, INT64_C(3) << 33, INT64_C(3) << 31, long_fn, &k);
    CHECK(!atomic_load(&k.bad) && atomic_load(&k.items) == UINT64_C(3) << 33);
    CHECK(atomic_load(&k.top) == INT64_C(3) << 33);
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
    for (int64_t i = lo; i < hi; i++) atomic_fetch_add(&in->outer->hits[in->row * in->outer->inner + i], 1);
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
