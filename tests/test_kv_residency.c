/* test_kv_residency.c -- the sampled KV block residency metrics (vLLM's
 * vllm:kv_block_lifetime_seconds, _idle_before_evict_seconds and
 * _reuse_gap_seconds): the block manager with a test clock (what is
 * observed, when, in which bucket; sampling off / all / a fraction), and
 * the engine on the tiny checkpoint, whose lifetime count grows once
 * requests through a small pool evict blocks. */
#include <stdlib.h>
#include <string.h>

#include "k3.h"
#include "engine/engine.h"
#include "kv/kv.h"
#include "test.h"

static int64_t fake_ns;
static int64_t fake_clock(void *arg) {
    (void)arg;
    return fake_ns;
}

static int bucket_of(const k3_kv_hist *h) {
    for (int b = 0; b <= K3_KV_RESIDENCY_BUCKETS; b++)
        if (h->count[b]) return b;
    return -1;
}

K3_TEST(kv_residency_observed_at_eviction) {
    k3_kv_blocks bm;
    k3_error err = {0};
    REQUIRE(k3_kv_blocks_init(&bm, 2, 2, &err) == K3_OK);
    k3_kv_residency r;
    k3_kv_track_get(&bm, &r);
    CHECK(!r.enabled);
    CHECK(k3_kv_track_enable(&bm, 1.5, 1, &err) == K3_ERR_ARG && strstr(err.msg, "sample rate"));
    REQUIRE(k3_kv_track_enable(&bm, 1.0, 1, &err) == K3_OK);
    k3_kv_track_set_clock(&bm, fake_clock, NULL);
    const int32_t toks[2] = {5, 6};
    fake_ns = 1000000000; /* t = 1 s: born */
    const int32_t b = k3_kv_alloc(&bm);
    REQUIRE(b >= 0);
    k3_kv_register(&bm, b, 77, 0, 0, toks);
    k3_kv_unref(&bm, b); /* free, still cached */
    fake_ns += 3000000;  /* + 3 ms: a prefix hit */
    CHECK(k3_kv_lookup(&bm, 77, 0, 0, toks) == b);
    k3_kv_ref(&bm, b);
    k3_kv_unref(&bm, b);
    fake_ns += 400000000; /* + 400 ms: another */
    k3_kv_ref(&bm, b);
    k3_kv_unref(&bm, b);
    k3_kv_track_get(&bm, &r);
    CHECK(r.enabled && r.lifetime.n == 0 && r.idle.n == 0 && r.reuse_gap.n == 0); /* not evicted yet */
    /* the other block is taken first (LRU head: it was never hashed), then b is evicted */
    fake_ns += 7000000000; /* + 7 s */
    const int32_t o = k3_kv_alloc(&bm);
    CHECK(o >= 0 && o != b);
    k3_kv_track_get(&bm, &r);
    CHECK(r.lifetime.n == 0);
    CHECK(k3_kv_alloc(&bm) == b);
    k3_kv_track_get(&bm, &r);
    CHECK(r.lifetime.n == 1 && r.idle.n == 1 && r.reuse_gap.n == 1);
    /* lifetime 7.403 s -> le 10; idle 7 s -> le 10; the gap 0.4 s -> le 0.5 */
    CHECKF(bucket_of(&r.lifetime) == 12 && k3_kv_residency_le[12] == 10, "lifetime bucket %d", bucket_of(&r.lifetime));
    CHECK(bucket_of(&r.idle) == 12);
    CHECK(bucket_of(&r.reuse_gap) == 8 && k3_kv_residency_le[8] == 0.5);
    CHECK(r.lifetime.sum > 7.402 && r.lifetime.sum < 7.404 && r.idle.sum > 6.999 && r.idle.sum < 7.001);
    /* a block never hit: idle = lifetime; past the last bucket -> +Inf */
    k3_kv_unref(&bm, o);
    fake_ns += (int64_t)2000 * 1000000000;
    CHECK(k3_kv_alloc(&bm) == o);
    k3_kv_track_get(&bm, &r);
    CHECK(r.lifetime.n == 2 && r.lifetime.count[K3_KV_RESIDENCY_BUCKETS] == 1 &&
          r.idle.count[K3_KV_RESIDENCY_BUCKETS] == 1 && r.reuse_gap.n == 1);
    CHECK(k3_kv_check(&bm));
    k3_kv_blocks_free(&bm);
}

K3_TEST(kv_residency_history_and_sampling) {
    k3_kv_blocks bm;
    k3_error err = {0};
    /* six hits keep the last four: three gaps */
    REQUIRE(k3_kv_blocks_init(&bm, 1, 1, &err) == K3_OK);
    REQUIRE(k3_kv_track_enable(&bm, 1.0, 1, &err) == K3_OK);
    k3_kv_track_set_clock(&bm, fake_clock, NULL);
    fake_ns = 0;
    const int32_t b = k3_kv_alloc(&bm);
    for (int i = 1; i <= 6; i++) {
        fake_ns = (int64_t)i * 1000000; /* every 1 ms */
        k3_kv_ref(&bm, b);
        k3_kv_unref(&bm, b);
    }
    k3_kv_unref(&bm, b);
    fake_ns = 20000000;
    CHECK(k3_kv_alloc(&bm) == b);
    k3_kv_residency r;
    k3_kv_track_get(&bm, &r);
    CHECK(r.reuse_gap.n == 3 && r.reuse_gap.count[0] == 3); /* 1 ms each: le 0.001 */
    CHECK(r.idle.n == 1 && r.idle.sum > 0.0139 && r.idle.sum < 0.0141);
    k3_kv_blocks_free(&bm);
    /* a rate of 0.25 follows about a quarter of the allocations */
    REQUIRE(k3_kv_blocks_init(&bm, 1, 1, &err) == K3_OK);
    REQUIRE(k3_kv_track_enable(&bm, 0.25, 7, &err) == K3_OK);
    for (int i = 0; i < 4001; i++) {
        const int32_t x = k3_kv_alloc(&bm);
        k3_kv_unref(&bm, x);
    }
    k3_kv_track_get(&bm, &r);
    CHECKF(r.lifetime.n > 850 && r.lifetime.n < 1150, "%llu of 4000 followed at 0.25",
           (unsigned long long)r.lifetime.n);
    /* off again */
    REQUIRE(k3_kv_track_enable(&bm, 0, 7, &err) == K3_OK);
    k3_kv_track_get(&bm, &r);
    CHECK(!r.enabled && r.lifetime.n == 0);
    k3_kv_blocks_free(&bm);
}

/* One greedy 40-token request (ids from round) run to the end; false on an
 * engine error (reported). */
static bool run_round(k3_engine *e, int round, k3_error *err) {
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = 3 + (round * 41 + i * 7) % 200;
    k3_request_params p =
        {.prompt = ids, .n_prompt = 40, .max_tokens = 4, .ignore_eos = true, .logprobs = -1, .prompt_logprobs = -1};
    p.sampling = (k3_sampler_options){.temperature = 0, .top_p = 1, .repeat_penalty = 1};
    uint64_t id;
    if (k3_engine_submit(e, &p, &id, err) != K3_OK) return false;
    while (k3_engine_has_work(e)) {
        k3_step_result res;
        if (k3_engine_step(e, &res, err) != K3_OK) return false;
    }
    return true;
}

K3_TEST(kv_residency_engine_counts_evictions) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIRE(k3_model_open(&m, "tests/models/tiny", &err) == K3_OK);
    /* 8 blocks of 16 tokens: each request takes 3, so later ones evict */
    k3_engine_options o = {.max_num_seqs = 2, .max_num_batched_tokens = 64, .cache_tokens = 128, .block_size = 16};
    k3_engine *e = NULL;
    REQUIRE(k3_engine_open(&e, m, &o, &err) == K3_OK);
    k3_kv_residency r;
    k3_engine_kv_residency(e, &r);
    CHECK(!r.enabled);
    CHECK(k3_engine_set_kv_metrics(e, -0.1, &err) == K3_ERR_ARG);
    REQUIRE(k3_engine_set_kv_metrics(e, 1.0, &err) == K3_OK);
    k3_engine_kv_residency(e, &r);
    CHECK(r.enabled && r.sample_rate == 1.0 && r.lifetime.n == 0);
    uint64_t last = 0;
    for (int round = 0; round < 6; round++) {
        REQUIREF(run_round(e, round, &err), "round %d: %s", round, err.msg);
        k3_engine_kv_residency(e, &r);
        if (round >= 3)
            CHECKF(r.lifetime.n > last, "round %d: lifetime count %llu, was %llu", round,
                   (unsigned long long)r.lifetime.n, (unsigned long long)last);
        last = r.lifetime.n;
    }
    CHECK(r.idle.n == r.lifetime.n && r.lifetime.sum >= 0);
    CHECK(k3_engine_check(e));
    k3_engine_close(e);
    /* without prefix caching (as vLLM): present, and empty however many blocks are reused */
    o.no_prefix_cache = true;
    REQUIRE(k3_engine_open(&e, m, &o, &err) == K3_OK);
    REQUIRE(k3_engine_set_kv_metrics(e, 1.0, &err) == K3_OK);
    for (int round = 0; round < 4; round++) {
        REQUIREF(run_round(e, round, &err), "round %d: %s", round, err.msg);
    }
    k3_engine_kv_residency(e, &r);
    CHECK(r.enabled && r.lifetime.n == 0 && r.idle.n == 0);
    k3_engine_close(e);
    k3_model_close(m);
}
