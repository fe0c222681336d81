/* test_sched.c -- the engine (k3_engine of k3.h), its scheduler, block
 * manager and prefix cache on the tiny checkpoints: batched = alone (greedy
 * and seeded, logprobs to 1e-5 in fp32), prefix hits = cold runs (with and
 * without a snapshot at the boundary, an evicted snapshot), preempted =
 * never preempted, cancel frees every block, the chunk size changes nothing,
 * a randomized stress run, 64 requests through a small pool, submit/cancel
 * from a second thread, and bad requests and configurations. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctx/ctx.h"
#include "engine/engine.h"
#include "k3.h"
#include "kernels/kernels.h"
#include "kv/kv.h"
#include "model/model.h"
#include "test.h"

enum { MAXGEN = 64, NTOP = 3 };

typedef struct {
    int32_t tok[MAXGEN];
    float lp[MAXGEN];
    k3_logprob top[MAXGEN][NTOP];
    int n;
    k3_finish_reason fin;
    int64_t n_cached;
    int preempted, first_token, finished, queued;
} result;

static k3_model *open_model(const char *dir) {
    k3_model *m = NULL;
    k3_error err = {0};
    if (k3_model_open(&m, dir, &err)) {
        k3_test_fail(__FILE__, __LINE__, "open %s: %s", dir, err.msg);
        return NULL;
    }
    return m;
}

static void make_ids(int32_t *ids, int n, int vocab, unsigned seed) {
    uint64_t r = seed * 2654435761u + 1;
    for (int i = 0; i < n; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((r >> 33) % (uint64_t)(vocab - 16)) + 8;
    }
}

static k3_engine *open_engine(const k3_model *m, const k3_engine_options *o) {
    k3_engine *e = NULL;
    k3_error err = {0};
    if (k3_engine_open(&e, m, o, &err)) {
        k3_test_fail(__FILE__, __LINE__, "engine: %s", err.msg);
        return NULL;
    }
    return e;
}

/* Records a step's outputs into res[id - base]. */
static void collect(const k3_step_result *sr, result *res, uint64_t base, int n_res) {
    for (int32_t i = 0; i < sr->n_outputs; i++) {
        const k3_req_output *o = &sr->outputs[i];
        if (o->id < base || o->id >= base + (uint64_t)n_res) continue;
        result *r = &res[o->id - base];
        if (o->events & K3_EV_QUEUED) r->queued++;
        if (o->events & K3_EV_PREEMPTED) r->preempted++;
        if (o->events & K3_EV_FIRST_TOKEN) r->first_token++;
        for (int32_t t = 0; t < o->n_new && r->n < MAXGEN; t++) {
            r->tok[r->n] = o->tokens[t];
            if (o->logprobs) r->lp[r->n] = o->logprobs[t];
            if (o->top)
                for (int k = 0; k < NTOP && k < o->n_top; k++) r->top[r->n][k] = o->top[t * o->n_top + k];
            r->n++;
        }
        if (o->events & K3_EV_FINISHED) {
            r->finished++;
            r->fin = o->finish;
            r->n_cached = o->n_cached;
        }
    }
}

/* Steps until the engine is idle (bounded). */
static int drain(k3_engine *e, result *res, uint64_t base, int n_res) {
    k3_error err = {0};
    int steps = 0;
    while (k3_engine_has_work(e) && steps < 100000) {
        k3_step_result sr;
        if (k3_engine_step(e, &sr, &err)) {
            k3_test_fail(__FILE__, __LINE__, "step: %s", err.msg);
            return -1;
        }
        collect(&sr, res, base, n_res);
        if (!k3_engine_check(e)) {
            k3_test_fail(__FILE__, __LINE__, "block accounting broken after step %d", steps);
            return -1;
        }
        steps++;
    }
    return steps;
}

static uint64_t submit(k3_engine *e, const int32_t *ids, int n, int max_tokens, float temp, uint64_t seed,
                       int logprobs) {
    k3_request_params p = {.prompt = ids,
                           .n_prompt = n,
                           .max_tokens = max_tokens,
                           .logprobs = logprobs,
                           .prompt_logprobs = -1};
    p.sampling = (k3_sampler_options){.temperature = temp,
                                      .top_k = temp > 0 ? 40 : 0,
                                      .top_p = 1.0f,
                                      .repeat_penalty = 1.0f,
                                      .seed = seed};
    p.ignore_eos = true;
    uint64_t id = 0;
    k3_error err = {0};
    if (k3_engine_submit(e, &p, &id, &err)) k3_test_fail(__FILE__, __LINE__, "submit: %s", err.msg);
    return id;
}

/* One request alone in a fresh engine without a prefix cache. */
static void solo(const k3_model *m, k3_kv_type kv, const int32_t *ids, int n, int max_tokens, float temp, uint64_t seed,
                 result *out) {
    k3_engine_options o = {.max_num_seqs = 1,
                           .cache_tokens = 1024,
                           .block_size = 16,
                           .kv_cache = kv,
                           .no_prefix_cache = true};
    k3_engine *e = open_engine(m, &o);
    if (!e) return;
    memset(out, 0, sizeof *out);
    const uint64_t id = submit(e, ids, n, max_tokens, temp, seed, NTOP);
    drain(e, out, id, 1);
    k3_engine_close(e);
}

static bool same_tokens(const result *a, const result *b) {
    return a->n == b->n && !memcmp(a->tok, b->tok, sizeof(int32_t) * (size_t)a->n);
}

static double lp_diff(const result *a, const result *b) {
    double d = 0;
    for (int t = 0; t < a->n && t < b->n; t++) {
        d = fmax(d, fabs((double)a->lp[t] - b->lp[t]));
        for (int k = 0; k < NTOP; k++) {
            if (a->top[t][k].id != b->top[t][k].id) return 1e9;
            d = fmax(d, fabs((double)a->top[t][k].logprob - b->top[t][k].logprob));
        }
    }
    return d;
}

/* ---- batched = alone ------------------------------------------------------ */

static void batched_equals_alone(const char *model, k3_kv_type kv, int budget) {
    k3_model *m = open_model(model);
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    enum { N = 6 };
    const int lens[N] = {5, 150, 33, 64, 17, 90};
    const float temps[N] = {0, 0.8f, 0, 1.0f, 0, 0.7f};
    int32_t ids[N][160];
    result alone[N], tog[N];
    for (int i = 0; i < N; i++) {
        make_ids(ids[i], lens[i], V, 10 + i);
        solo(m, kv, ids[i], lens[i], 12, temps[i], 1000 + i, &alone[i]);
        CHECKF(alone[i].n == 12, "request %d alone: %d tokens", i, alone[i].n);
    }
    k3_engine_options o = {.max_num_seqs = 8,
                           .max_num_batched_tokens = budget,
                           .cache_tokens = 2048,
                           .block_size = 16,
                           .kv_cache = kv};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    memset(tog, 0, sizeof tog);
    uint64_t base = 0;
    for (int i = 0; i < N; i++) {
        const uint64_t id = submit(e, ids[i], lens[i], 12, temps[i], 1000 + i, NTOP);
        if (i == 0) base = id;
    }
    const int steps = drain(e, tog, base, N);
    printf("    %s %s budget %d: %d steps\n", model, kv == K3_KV_C8 ? "c8" : "f32", budget, steps);
    for (int i = 0; i < N; i++) {
        CHECKF(same_tokens(&tog[i], &alone[i]), "request %d: batched tokens differ from alone", i);
        const double d = lp_diff(&tog[i], &alone[i]);
        CHECKF(d <= (kv == K3_KV_F32 ? 1e-5 : 1e-4), "request %d: logprobs differ by %.3g", i, d);
        CHECK(tog[i].finished == 1 && tog[i].fin == K3_FINISH_LENGTH && tog[i].queued == 1 && tog[i].first_token == 1);
    }
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    CHECK(st.n_running == 0 && st.n_waiting == 0 && st.blocks_used == 0);
    CHECK(st.generation_tokens == N * 12 && st.requests_finished[K3_FINISH_LENGTH] == N);
    k3_engine_close(e);
    k3_model_close(m);
}

K3_TEST(sched_batched_equals_alone_f32) { batched_equals_alone("tests/models/tiny-dsa", K3_KV_F32, 64); }
K3_TEST(sched_batched_equals_alone_c8) { batched_equals_alone("tests/models/tiny", K3_KV_C8, 2048); }

/* The engine's greedy tokens are those of the plain context driver. */
K3_TEST(sched_engine_equals_ctx_forward) {
    k3_model *m = open_model("tests/models/tiny");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    int32_t ids[64 + 10];
    make_ids(ids, 40, V, 3);
    result r;
    solo(m, K3_KV_F32, ids, 40, 10, 0, 0, &r);
    REQUIRE(r.n == 10);
    k3_ctx *ctx = NULL;
    k3_error err = {0};
    k3_ctx_options co = {.max_seqs = 1, .cache_tokens = 128, .block_size = 16};
    REQUIRE(k3_ctx_init(&ctx, m, &co, &err) == K3_OK);
    float *lg = malloc(sizeof(float) * (size_t)V);
    k3_batch_seq b = {0, 40, ids};
    int ok = 1;
    for (int t = 0; t < 10 && ok; t++) {
        ok = k3_ctx_forward(ctx, &b, 1, K3_LOGITS_LAST, lg, &err) == K3_OK;
        int best = 0;
        for (int v = 1; v < V; v++)
            if (lg[v] > lg[best]) best = v;
        CHECKF(best == r.tok[t], "token %d: ctx %d, engine %d", t, best, r.tok[t]);
        ids[40 + t] = best;
        b = (k3_batch_seq){0, 1, &ids[40 + t]};
    }
    CHECK(ok);
    free(lg);
    k3_ctx_free(ctx);
    k3_model_close(m);
}

/* ---- chunk size ---------------------------------------------------------------- */

K3_TEST(sched_chunk_size_same_output) {
    k3_model *m = open_model("tests/models/tiny-dsa");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    int32_t ids[200];
    make_ids(ids, 200, V, 77);
    const int budgets[3] = {16, 48, 2048};
    result r[3];
    for (int b = 0; b < 3; b++) {
        k3_engine_options o = {.max_num_seqs = 2,
                               .max_num_batched_tokens = budgets[b],
                               .cache_tokens = 1024,
                               .block_size = 16,
                               .no_prefix_cache = true};
        k3_engine *e = open_engine(m, &o);
        REQUIRE(e);
        memset(&r[b], 0, sizeof r[b]);
        const uint64_t id = submit(e, ids, 200, 8, 0.9f, 5, NTOP);
        drain(e, &r[b], id, 1);
        k3_engine_close(e);
    }
    for (int b = 1; b < 3; b++) {
        CHECKF(same_tokens(&r[b], &r[0]), "budget %d changes the tokens", budgets[b]);
        CHECKF(lp_diff(&r[b], &r[0]) <= 1e-5, "budget %d: logprobs differ by %.3g", budgets[b], lp_diff(&r[b], &r[0]));
    }
    k3_model_close(m);
}

/* The step cost guard: a long prompt arriving among decodes is held to what
 * max_step_cost leaves them, in chunks that may end inside a block, and every
 * request still gets its solo tokens; without decodes the prompt takes the
 * whole token budget. */
K3_TEST(sched_step_cost_guard) {
    k3_model *m = open_model("tests/models/tiny-dsa");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    enum { ND = 3, LONG = 180, COST = 9 };
    int32_t dec[ND][8], lng[LONG];
    result alone[ND + 1], tog[ND + 1];
    for (int i = 0; i < ND; i++) {
        make_ids(dec[i], 8, V, 40 + i);
        solo(m, K3_KV_F32, dec[i], 8, 40, 0, 1, &alone[i]);
    }
    make_ids(lng, LONG, V, 50);
    solo(m, K3_KV_F32, lng, LONG, 4, 0, 1, &alone[ND]);
    k3_engine_options o = {.max_num_seqs = 4,
                           .max_num_batched_tokens = 64,
                           .max_step_cost = COST,
                           .cache_tokens = 1024,
                           .block_size = 16,
                           .no_prefix_cache = true};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    memset(tog, 0, sizeof tog);
    uint64_t base = 0;
    for (int i = 0; i < ND; i++) {
        const uint64_t id = submit(e, dec[i], 8, 40, 0, 1, NTOP);
        if (!i) base = id;
    }
    k3_error err = {0};
    k3_step_result sr;
    REQUIRE(k3_engine_step(e, &sr, &err) == K3_OK); /* the three prompts */
    collect(&sr, tog, base, ND + 1);
    CHECK(sr.n_tokens == ND * 8);
    submit(e, lng, LONG, 4, 0, 1, NTOP);
    int held = 0, inside = 0, prompt_done = 0;
    while (k3_engine_has_work(e)) {
        const bool decoding = tog[0].n < 40, prefilling = tog[ND].n == 0;
        REQUIRE(k3_engine_step(e, &sr, &err) == K3_OK);
        collect(&sr, tog, base, ND + 1);
        const int chunk = sr.n_tokens - ND;
        if (decoding && prefilling && chunk > 0) {
            /* decodes ran: the prompt got at most COST - ND tokens' worth */
            CHECKF(chunk <= COST - ND, "a chunk of %d tokens beside %d decodes (guard %d)", chunk, ND, COST);
            held++;
            inside += (prompt_done + chunk) % 16 != 0;
            prompt_done += chunk;
        }
    }
    CHECKF(held >= 10 && inside > 0, "the guard held %d steps, %d of them inside a block", held, inside);
    for (int i = 0; i <= ND; i++)
        CHECKF(same_tokens(&tog[i], &alone[i]) && lp_diff(&tog[i], &alone[i]) <= 1e-5,
               "request %d: tokens under the guard differ from alone", i);
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    CHECKF(st.step_cost_max > COST - 1.5 && st.step_cost_max <= COST + 1e-9, "costliest guarded step %.3f",
           st.step_cost_max);
    CHECK(st.prefill_cost_p0 > 0 && st.blocks_used == 0);
    /* alone, the prompt is not held */
    const uint64_t id = submit(e, lng, LONG, 4, 0, 1, NTOP);
    REQUIRE(k3_engine_step(e, &sr, &err) == K3_OK);
    CHECKF(sr.n_tokens == 64, "a prompt with no decodes beside it got %d tokens", sr.n_tokens);
    result r2;
    memset(&r2, 0, sizeof r2);
    collect(&sr, &r2, id, 1);
    drain(e, &r2, id, 1);
    CHECK(same_tokens(&r2, &alone[ND]));
    k3_engine_close(e);
    k3_model_close(m);
}

/* ---- prefix cache ------------------------------------------------------------------ */

/* Prompts run one after the other through one engine: prompt i is the
 * first shared[i] tokens of a base prompt, then its own tokens (120 in all);
 * each must give its cold tokens. */
static void prefix_run_kv(const k3_model *m, k3_kv_type kv, int stride, int64_t snap_bytes, int n, const int *shared,
                          result *res, k3_engine_stats *st) {
    const int V = (int)m->cfg.vocab_size;
    int32_t base[120], p[120];
    make_ids(base, 120, V, 1);
    k3_engine_options o = {.max_num_seqs = 4,
                           .cache_tokens = 1024,
                           .block_size = 16,
                           .snapshot_stride = stride,
                           .snapshot_bytes = snap_bytes,
                           .kv_cache = kv};
    k3_engine *e = open_engine(m, &o);
    if (!e) return;
    for (int i = 0; i < n; i++) {
        memcpy(p, base, sizeof(int32_t) * (size_t)shared[i]);
        make_ids(p + shared[i], 120 - shared[i], V, 2 + i);
        const float temp = i % 2 ? 0.8f : 0;
        memset(&res[i], 0, sizeof res[i]);
        const uint64_t id = submit(e, p, 120, 6, temp, 9 + i, NTOP);
        drain(e, &res[i], id, 1);
        result cold;
        solo(m, kv, p, 120, 6, temp, 9 + i, &cold);
        CHECKF(same_tokens(&res[i], &cold), "prompt %d: a prefix hit of %lld tokens changes its tokens", i,
               (long long)res[i].n_cached);
        CHECKF(lp_diff(&res[i], &cold) <= 1e-5, "prompt %d: logprobs differ by %.3g", i, lp_diff(&res[i], &cold));
    }
    k3_engine_get_stats(e, st);
    k3_engine_close(e);
}

static void prefix_run(const k3_model *m, int stride, int64_t snap_bytes, int n, const int *shared, result *res,
                       k3_engine_stats *st) {
    prefix_run_kv(m, K3_KV_F32, stride, snap_bytes, n, shared, res, st);
}

/* C8 blocks are shared the same way (each token's row is quantized alone) */
K3_TEST(sched_prefix_hit_equals_cold_c8) {
    k3_model *m = open_model("tests/models/tiny-dsa");
    REQUIRE(m);
    result r[3];
    k3_engine_stats st;
    const int sh[3] = {120, 85, 85};
    prefix_run_kv(m, K3_KV_C8, 1, 0, 3, sh, r, &st);
    CHECK(r[1].n_cached == 80 && r[2].n_cached == 80);
    k3_model_close(m);
}

K3_TEST(sched_prefix_hit_equals_cold) {
    k3_model *m = open_model("tests/models/tiny-dsa");
    REQUIRE(m);
    result r[4];
    k3_engine_stats st;
    const int sh[3] = {120, 85, 85};
    /* a snapshot on every block: the later two hit the 5 shared blocks (80 tokens) */
    prefix_run(m, 1, 0, 3, sh, r, &st);
    CHECKF(r[0].n_cached == 0 && r[1].n_cached == 80 && r[2].n_cached == 80, "cached %lld %lld %lld",
           (long long)r[0].n_cached, (long long)r[1].n_cached, (long long)r[2].n_cached);
    CHECK(st.prefix_hits == 160 && st.prefix_queries == 360);
    CHECK(st.n_snapshots > 0 && st.snapshot_bytes == st.n_snapshots * st.state_bytes_per_seq);
    /* no snapshot at the boundary (stride 4 blocks = 64 tokens): the second
     * resumes at 64 and takes one at the junction (80); the third hits 80 */
    prefix_run(m, 4, 0, 3, sh, r, &st);
    CHECKF(r[1].n_cached == 64 && r[2].n_cached == 80, "cached %lld %lld", (long long)r[1].n_cached,
           (long long)r[2].n_cached);
    k3_model_close(m);
}

/* a model without KDA layers (vision-tiny's text model is all MLA) needs no
 * snapshot: a hit reaches the last shared block boundary */
K3_TEST(sched_prefix_hit_without_kda_layers) {
    k3_model *m = open_model("tests/models/vision-tiny");
    REQUIRE(m);
    result r[3];
    k3_engine_stats st;
    const int sh[3] = {120, 85, 85};
    prefix_run(m, 4, 0, 3, sh, r, &st);
    CHECKF(r[1].n_cached == 80 && r[2].n_cached == 80, "cached %lld %lld", (long long)r[1].n_cached,
           (long long)r[2].n_cached);
    CHECK(st.state_bytes_per_seq == 0 && st.n_snapshots == 0);
    k3_model_close(m);
}

K3_TEST(sched_prefix_evicted_snapshot_shorter_hit) {
    k3_model *m = open_model("tests/models/tiny-dsa");
    REQUIRE(m);
    k3_model_info info;
    k3_model_get_info(m, &info);
    result r[4];
    k3_engine_stats st;
    /* snapshots only at prompt ends and junctions, room for two: the base
     * takes 112; the second (50 shared) hits nothing, takes 48 and 112 (which
     * evicts the base's 112); the third (116 shared) finds the base's blocks
     * up to 112 but not their snapshot, so it falls back to 48, and takes 112
     * again; the fourth hits 112 */
    const int sh[4] = {120, 50, 116, 116};
    prefix_run(m, 1000, 2 * info.state_bytes_per_seq, 4, sh, r, &st);
    CHECKF(r[1].n_cached == 0 && r[2].n_cached == 48 && r[3].n_cached == 112, "cached %lld %lld %lld",
           (long long)r[1].n_cached, (long long)r[2].n_cached, (long long)r[3].n_cached);
    CHECK(st.n_snapshots == 2);
    /* no room for any snapshot: never a hit */
    const int sh2[3] = {120, 85, 85};
    prefix_run(m, 1, 1, 3, sh2, r, &st);
    CHECK(r[1].n_cached == 0 && r[2].n_cached == 0 && st.n_snapshots == 0 && st.prefix_hits == 0);
    k3_model_close(m);
}

/* The whole prompt cached: one token is still computed for the logits. */
K3_TEST(sched_prefix_full_prompt_hit) {
    k3_model *m = open_model("tests/models/tiny");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    int32_t a[64];
    make_ids(a, 64, V, 4);
    k3_engine_options o = {.max_num_seqs = 2, .cache_tokens = 512, .block_size = 16, .snapshot_stride = 1};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    result r1 = {0}, r2 = {0}, cold;
    uint64_t id = submit(e, a, 64, 5, 0, 0, NTOP);
    drain(e, &r1, id, 1);
    id = submit(e, a, 64, 5, 0, 0, NTOP);
    drain(e, &r2, id, 1);
    solo(m, K3_KV_F32, a, 64, 5, 0, 0, &cold);
    CHECK(r2.n_cached == 48);
    CHECK(same_tokens(&r1, &cold) && same_tokens(&r2, &cold));
    k3_engine_close(e);
    k3_model_close(m);
}

/* ---- preemption and cancel ------------------------------------------------------------ */

K3_TEST(sched_preempted_equals_never_preempted) {
    k3_model *m = open_model("tests/models/tiny-dsa");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    enum { N = 4 };
    int32_t ids[N][40];
    result alone[N], tog[N];
    for (int i = 0; i < N; i++) {
        make_ids(ids[i], 40, V, 50 + i);
        solo(m, K3_KV_F32, ids[i], 40, 40, i % 2 ? 0.9f : 0, 7 + i, &alone[i]);
    }
    /* 10 blocks of 16: two requests of 80 tokens (5 blocks) at a time */
    k3_engine_options o = {.max_num_seqs = 4, .cache_tokens = 160, .block_size = 16};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    memset(tog, 0, sizeof tog);
    uint64_t base = 0;
    for (int i = 0; i < N; i++) {
        const uint64_t id = submit(e, ids[i], 40, 40, i % 2 ? 0.9f : 0, 7 + i, NTOP);
        if (!i) base = id;
    }
    drain(e, tog, base, N);
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    printf("    %lld preemptions\n", (long long)st.n_preemptions);
    CHECK(st.n_preemptions > 0);
    int pre = 0;
    for (int i = 0; i < N; i++) {
        pre += tog[i].preempted;
        CHECKF(same_tokens(&tog[i], &alone[i]), "request %d (preempted %d times) differs", i, tog[i].preempted);
        CHECKF(lp_diff(&tog[i], &alone[i]) <= 1e-5, "request %d: logprobs differ by %.3g", i,
               lp_diff(&tog[i], &alone[i]));
    }
    CHECK(pre == st.n_preemptions);
    CHECK(k3_engine_blocks_free(e) == st.blocks_total);
    k3_engine_close(e);
    k3_model_close(m);
}

K3_TEST(sched_cancel_frees_every_block) {
    k3_model *m = open_model("tests/models/tiny");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    k3_engine_options o = {.max_num_seqs = 3, .max_num_batched_tokens = 32, .cache_tokens = 512, .block_size = 16};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    int32_t ids[5][100];
    uint64_t idv[5];
    for (int i = 0; i < 5; i++) {
        make_ids(ids[i], 100, V, 90 + i);
        idv[i] = submit(e, ids[i], 100, 50, 0, 0, -1);
    }
    result res[5] = {0};
    k3_error err = {0};
    for (int s = 0; s < 6; s++) {
        k3_step_result sr;
        REQUIRE(k3_engine_step(e, &sr, &err) == K3_OK);
        collect(&sr, res, idv[0], 5);
    }
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    CHECK(st.blocks_used > 0 && st.n_running > 0 && st.n_waiting > 0);
    for (int i = 0; i < 5; i++) k3_engine_cancel(e, idv[i]);
    k3_engine_cancel(e, 12345); /* unknown: ignored */
    drain(e, res, idv[0], 5);
    for (int i = 0; i < 5; i++) CHECK(res[i].finished == 1 && res[i].fin == K3_FINISH_CANCELLED);
    k3_engine_get_stats(e, &st);
    CHECK(st.blocks_used == 0 && st.n_running == 0 && st.n_waiting == 0);
    CHECK(k3_engine_blocks_free(e) == st.blocks_total);
    CHECK(st.requests_finished[K3_FINISH_CANCELLED] == 5);
    k3_engine_close(e);
    k3_model_close(m);
}

/* ---- stop rules, logprobs, prompt logprobs ---------------------------------------------- */

K3_TEST(sched_stop_ids_and_min_tokens) {
    k3_model *m = open_model("tests/models/tiny");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    int32_t ids[30];
    make_ids(ids, 30, V, 8);
    result free_run;
    solo(m, K3_KV_F32, ids, 30, 10, 0, 0, &free_run);
    REQUIRE(free_run.n == 10);
    const int32_t stop = free_run.tok[3];
    int first = 0;
    while (free_run.tok[first] != stop) first++;
    k3_engine_options o = {.max_num_seqs = 2, .cache_tokens = 512, .block_size = 16, .eos_ids = &stop, .n_eos_ids = 1};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    k3_request_params p = {.prompt = ids, .n_prompt = 30, .max_tokens = 10, .logprobs = -1, .prompt_logprobs = -1};
    p.sampling = (k3_sampler_options){.top_p = 1, .repeat_penalty = 1};
    uint64_t id;
    k3_error err = {0};
    REQUIRE(k3_engine_submit(e, &p, &id, &err) == K3_OK);
    result r = {0};
    drain(e, &r, id, 1);
    CHECK(r.fin == K3_FINISH_STOP && r.n == first + 1 && r.tok[first] == stop);
    /* ignore_eos: runs to the length */
    p.ignore_eos = true;
    REQUIRE(k3_engine_submit(e, &p, &id, &err) == K3_OK);
    memset(&r, 0, sizeof r);
    drain(e, &r, id, 1);
    CHECK(r.fin == K3_FINISH_LENGTH && r.n == 10);
    /* a stop id with min_tokens past its place: it cannot come before */
    p.ignore_eos = true;
    p.stop_ids = &stop;
    p.n_stop_ids = 1;
    p.min_tokens = first + 2;
    REQUIRE(k3_engine_submit(e, &p, &id, &err) == K3_OK);
    memset(&r, 0, sizeof r);
    drain(e, &r, id, 1);
    bool early = false;
    for (int t = 0; t < r.n && t < first + 2; t++) early |= r.tok[t] == stop;
    CHECK(!early && r.n >= first + 2);
    /* max_tokens 0: prefill only */
    p.max_tokens = 0;
    p.min_tokens = 0;
    REQUIRE(k3_engine_submit(e, &p, &id, &err) == K3_OK);
    memset(&r, 0, sizeof r);
    drain(e, &r, id, 1);
    CHECK(r.fin == K3_FINISH_LENGTH && r.n == 0 && r.finished == 1);
    k3_engine_close(e);
    k3_model_close(m);
}

K3_TEST(sched_prompt_logprobs) {
    k3_model *m = open_model("tests/models/tiny");
    REQUIRE(m);
    const int64_t V = m->cfg.vocab_size;
    enum { N = 150 };
    int32_t ids[N];
    make_ids(ids, N, (int)V, 12);
    /* reference: all logits of the prompt through the context */
    k3_ctx *ctx = NULL;
    k3_error err = {0};
    k3_ctx_options co = {.max_seqs = 1, .cache_tokens = 256, .block_size = 16};
    REQUIRE(k3_ctx_init(&ctx, m, &co, &err) == K3_OK);
    float *lg = malloc(sizeof(float) * (size_t)(V * N));
    k3_batch_seq b = {0, N, ids};
    REQUIRE(k3_ctx_forward(ctx, &b, 1, K3_LOGITS_ALL, lg, &err) == K3_OK);
    k3_engine_options o = {.max_num_seqs = 2, .max_num_batched_tokens = 64, .cache_tokens = 512, .block_size = 16};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    k3_request_params p = {.prompt = ids, .n_prompt = N, .max_tokens = 2, .logprobs = 2, .prompt_logprobs = 2};
    p.sampling = (k3_sampler_options){.top_p = 1, .repeat_penalty = 1};
    uint64_t id;
    REQUIRE(k3_engine_submit(e, &p, &id, &err) == K3_OK);
    int got = 0;
    double worst = 0;
    while (k3_engine_has_work(e)) {
        k3_step_result sr;
        REQUIRE(k3_engine_step(e, &sr, &err) == K3_OK);
        for (int i = 0; i < sr.n_outputs; i++) {
            const k3_req_output *out = &sr.outputs[i];
            if (!out->n_prompt_logprobs) continue;
            got++;
            CHECK(out->n_prompt_logprobs == N - 1 && out->prompt_top && out->n_top == 2);
            for (int t = 0; t + 1 < N; t++) {
                const float *row = lg + (int64_t)t * V;
                double mx = row[0], s = 0;
                for (int64_t v = 1; v < V; v++) mx = row[v] > mx ? row[v] : mx;
                for (int64_t v = 0; v < V; v++) s += exp(row[v] - mx);
                const double want = row[ids[t + 1]] - mx - log(s);
                worst = fmax(worst, fabs(want - out->prompt_logprobs[t]));
                CHECK(out->prompt_top[t * 2].logprob >= out->prompt_top[t * 2 + 1].logprob);
            }
        }
    }
    CHECK(got == 1);
    CHECKF(worst <= 1e-4, "prompt logprobs off by %.3g", worst);
    free(lg);
    k3_ctx_free(ctx);
    k3_engine_close(e);
    k3_model_close(m);
}

/* ---- many requests, a small pool --------------------------------------------------------- */

K3_TEST(sched_64_requests_small_pool) {
    k3_model *m = open_model("tests/models/tiny");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    enum { N = 64 };
    static int32_t ids[N][48];
    static result alone[N], tog[N];
    for (int i = 0; i < N; i++) {
        make_ids(ids[i], 20 + i % 28, V, 300 + i);
        solo(m, K3_KV_F32, ids[i], 20 + i % 28, 8 + i % 5, i % 3 ? 0.8f : 0, i, &alone[i]);
    }
    /* 12 blocks of 16 tokens: three or four requests at a time */
    k3_engine_options o = {.max_num_seqs = 8, .max_num_batched_tokens = 64, .cache_tokens = 192, .block_size = 16};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    memset(tog, 0, sizeof tog);
    uint64_t base = 0;
    for (int i = 0; i < N; i++) {
        const uint64_t id = submit(e, ids[i], 20 + i % 28, 8 + i % 5, i % 3 ? 0.8f : 0, i, NTOP);
        if (!i) base = id;
    }
    drain(e, tog, base, N);
    int bad = 0;
    for (int i = 0; i < N; i++) bad += !same_tokens(&tog[i], &alone[i]) || tog[i].finished != 1;
    CHECKF(bad == 0, "%d of %d requests differ from their solo run", bad, N);
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    printf("    64 requests: %lld preemptions, prefix hits %lld of %lld tokens\n", (long long)st.n_preemptions,
           (long long)st.prefix_hits, (long long)st.prefix_queries);
    CHECK(st.blocks_used == 0 && st.requests_finished[K3_FINISH_LENGTH] == N);
    k3_engine_close(e);
    k3_model_close(m);
}

/* ---- randomized stress ---------------------------------------------------------------------- */

K3_TEST(sched_stress_random) {
    k3_model *m = open_model("tests/models/tiny");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    k3_engine_options o = {.max_num_seqs = 4,
                           .max_num_batched_tokens = 24,
                           .cache_tokens = 64,
                           .block_size = 8,
                           .snapshot_stride = 1,
                           .snapshot_bytes = 3 * 262656};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    enum { MAXR = 600 };
    static uint64_t ids[MAXR];
    static int ended[MAXR];
    memset(ended, 0, sizeof ended);
    int n_sub = 0;
    uint64_t rng = 12345;
#define RAND() ((rng = rng * 6364136223846793005ull + 1442695040888963407ull) >> 33)
    int32_t base_prompt[40];
    make_ids(base_prompt, 40, V, 1);
    k3_error err = {0};
    int ops = 0, bad_check = 0, refused = 0;
    for (; ops < 3000; ops++) {
        const unsigned r = (unsigned)(RAND() % 10);
        if (r < 4 && n_sub < MAXR) {
            int32_t p[40];
            const int n = 1 + (int)(RAND() % 40);
            memcpy(p, base_prompt, sizeof p); /* shared prefixes of varying length */
            for (int i = (int)(RAND() % 40); i < n; i++) p[i] = (int32_t)(RAND() % (unsigned)V);
            k3_request_params q = {.prompt = p,
                                   .n_prompt = n,
                                   .max_tokens = (int32_t)(RAND() % 30),
                                   .logprobs = (int32_t)(RAND() % 3) - 1,
                                   .prompt_logprobs = RAND() % 8 ? -1 : 1};
            if (q.logprobs >= 0 && q.prompt_logprobs >= 0) q.logprobs = q.prompt_logprobs;
            q.sampling = (k3_sampler_options){.temperature = (float)(RAND() % 2),
                                              .top_p = 1,
                                              .repeat_penalty = 1,
                                              .seed = RAND()};
            uint64_t id;
            k3_err_clear(&err);
            const k3_status st = k3_engine_submit(e, &q, &id, &err);
            if (st == K3_OK) ids[n_sub++] = id;
            else refused++;
        } else if (r < 5 && n_sub > 0) {
            k3_engine_cancel(e, ids[RAND() % (unsigned)n_sub]);
        } else {
            k3_step_result sr;
            REQUIRE(k3_engine_step(e, &sr, &err) == K3_OK);
            for (int i = 0; i < sr.n_outputs; i++)
                if (sr.outputs[i].events & K3_EV_FINISHED) {
                    const uint64_t id = sr.outputs[i].id;
                    for (int j = 0; j < n_sub; j++)
                        if (ids[j] == id) ended[j]++;
                }
            bad_check += !k3_engine_check(e);
        }
    }
    result dummy[1];
    drain(e, dummy, 0, 0);
    int not_ended = 0, twice = 0;
    for (int j = 0; j < n_sub; j++) {
        k3_step_result sr;
        (void)sr;
        not_ended += ended[j] == 0;
        twice += ended[j] > 1;
    }
    /* the drain's outputs were not counted above: recount what is left */
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    int64_t fin = 0;
    for (int k = 0; k <= K3_FINISH_ERROR; k++) fin += st.requests_finished[k];
    printf("    %d ops, %d requests (%d refused), %lld preemptions, %lld snapshots, hits %lld/%lld\n", ops, n_sub,
           refused, (long long)st.n_preemptions, (long long)st.n_snapshots, (long long)st.prefix_hits,
           (long long)st.prefix_queries);
    CHECK(bad_check == 0 && twice == 0);
    CHECK(fin == n_sub && st.requests_finished[K3_FINISH_ERROR] == 0);
    CHECK(st.blocks_used == 0 && st.n_running == 0 && st.n_waiting == 0);
    CHECK(k3_engine_blocks_free(e) == st.blocks_total && k3_engine_check(e));
    (void)not_ended;
#undef RAND
    k3_engine_close(e);
    k3_model_close(m);
}

/* ---- threads ---------------------------------------------------------------------------------- */

typedef struct {
    k3_engine *e;
    const int32_t *ids;
    uint64_t got[40];
    int n;
} thread_arg;

static void *submitter(void *p) {
    thread_arg *a = p;
    for (int i = 0; i < 40; i++) {
        k3_request_params q = {.prompt = a->ids + i,
                               .n_prompt = 10 + i % 7,
                               .max_tokens = 6,
                               .logprobs = -1,
                               .prompt_logprobs = -1};
        q.sampling = (k3_sampler_options){.top_p = 1, .repeat_penalty = 1};
        k3_error err = {0};
        uint64_t id;
        if (k3_engine_submit(a->e, &q, &id, &err) == K3_OK) a->got[a->n++] = id;
        if (i % 3 == 2) k3_engine_cancel(a->e, a->got[a->n - 2 >= 0 ? a->n - 2 : 0]);
        k3_engine_stats st;
        k3_engine_get_stats(a->e, &st);
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

K3_TEST(sched_submit_cancel_from_another_thread) {
    k3_model *m = open_model("tests/models/tiny");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    k3_engine_options o = {.max_num_seqs = 4, .cache_tokens = 256, .block_size = 16};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    int32_t ids[64];
    make_ids(ids, 64, V, 21);
    thread_arg a = {.e = e, .ids = ids};
    pthread_t th;
    REQUIRE(pthread_create(&th, NULL, submitter, &a) == 0);
    static int ended[41];
    memset(ended, 0, sizeof ended);
    k3_error err = {0};
    const double t0 = k3_now();
    for (;;) {
        k3_engine_wait(e, 0.002);
        k3_step_result sr;
        REQUIRE(k3_engine_step(e, &sr, &err) == K3_OK);
        for (int i = 0; i < sr.n_outputs; i++)
            if (sr.outputs[i].events & K3_EV_FINISHED && sr.outputs[i].id < 41) ended[sr.outputs[i].id]++;
        k3_engine_stats st;
        k3_engine_get_stats(e, &st);
        if (st.requests_finished[K3_FINISH_LENGTH] + st.requests_finished[K3_FINISH_CANCELLED] +
                    st.requests_finished[K3_FINISH_STOP] ==
                40 &&
            !k3_engine_has_work(e))
            break;
        if (k3_now() - t0 > 30) break;
    }
    pthread_join(th, NULL);
    REQUIRE(a.n == 40);
    int once = 0;
    for (int i = 0; i < a.n; i++) once += a.got[i] < 41 && ended[a.got[i]] == 1;
    CHECKF(once == 40, "%d of 40 requests ended exactly once", once);
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    CHECK(st.blocks_used == 0 && k3_engine_check(e));
    k3_engine_close(e);
    k3_model_close(m);
}

/* ---- bad input --------------------------------------------------------------------------------- */

K3_TEST(sched_bad_requests_and_configs) {
    k3_model *m = open_model("tests/models/tiny");
    REQUIRE(m);
    k3_error err = {0};
    k3_engine *e = NULL;
    k3_engine_options o = {.max_num_seqs = 2, .cache_tokens = 256, .block_size = 16, .max_waiting = 2};
    REQUIRE(k3_engine_open(&e, m, &o, &err) == K3_OK);
    int32_t ids[300];
    make_ids(ids, 300, 1024, 1);
    k3_request_params p = {.prompt = ids, .n_prompt = 200, .max_tokens = 100, .logprobs = -1, .prompt_logprobs = -1};
    p.sampling = (k3_sampler_options){.top_p = 1, .repeat_penalty = 1};
    uint64_t id;
    k3_err_clear(&err);
    CHECK(k3_engine_submit(e, &p, &id, &err) == K3_ERR_RANGE && strstr(err.msg, "300"));
    p.max_tokens = 10;
    ids[5] = 99999;
    k3_err_clear(&err);
    CHECK(k3_engine_submit(e, &p, &id, &err) == K3_ERR_ARG && strstr(err.msg, "99999"));
    ids[5] = 7;
    p.n_prompt = 0;
    k3_err_clear(&err);
    CHECK(k3_engine_submit(e, &p, &id, &err) == K3_ERR_ARG);
    p.n_prompt = 20;
    p.sampling.top_p = 0;
    k3_err_clear(&err);
    CHECK(k3_engine_submit(e, &p, &id, &err) == K3_ERR_ARG);
    p.sampling.top_p = 1;
    p.logprobs = 100;
    k3_err_clear(&err);
    CHECK(k3_engine_submit(e, &p, &id, &err) == K3_ERR_ARG);
    p.logprobs = -1;
    CHECK(k3_engine_submit(e, &p, &id, &err) == K3_OK);
    CHECK(k3_engine_submit(e, &p, &id, &err) == K3_OK);
    k3_err_clear(&err);
    CHECK(k3_engine_submit(e, &p, &id, &err) == K3_ERR_BUSY);
    k3_engine_close(e);
    /* configurations */
    k3_engine_options big = {.cache_bytes = (int64_t)1 << 50};
    k3_err_clear(&err);
    CHECK(k3_engine_open(&e, m, &big, &err) == K3_ERR_RANGE && strstr(err.msg, "MB"));
    k3_engine_options len = {.max_model_len = 1 << 20, .cache_tokens = 256};
    k3_err_clear(&err);
    CHECK(k3_engine_open(&e, m, &len, &err) == K3_ERR_RANGE);
    k3_engine_options pool = {.max_model_len = 1024, .cache_tokens = 256};
    k3_err_clear(&err);
    CHECK(k3_engine_open(&e, m, &pool, &err) == K3_ERR_RANGE && strstr(err.msg, "256"));
    k3_engine_options tiny_budget = {.max_num_batched_tokens = 8, .block_size = 16, .cache_tokens = 256};
    k3_err_clear(&err);
    CHECK(k3_engine_open(&e, m, &tiny_budget, &err) == K3_ERR_RANGE);
    k3_engine_options starve = {.max_num_seqs = 32,
                                .max_num_batched_tokens = 16,
                                .block_size = 16,
                                .cache_tokens = 256};
    k3_err_clear(&err);
    CHECK(k3_engine_open(&e, m, &starve, &err) == K3_ERR_RANGE && strstr(err.msg, "max_num_seqs"));
    /* defaults open, and the model length is capped by the pool */
    k3_engine_options def = {0};
    k3_err_clear(&err);
    REQUIRE(k3_engine_open(&e, m, &def, &err) == K3_OK);
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    CHECK(st.max_model_len == 4096 && st.cache_tokens >= 4096 && st.blocks_total * 64 == st.cache_tokens);
    k3_engine_close(e);
    k3_model_close(m);
}

/* ---- the block manager and snapshots alone ------------------------------------------------------ */

K3_TEST(kv_blocks_lru_and_index) {
    k3_kv_blocks bm;
    k3_error err = {0};
    REQUIRE(k3_kv_blocks_init(&bm, 4, 2, &err) == K3_OK);
    int32_t t[2] = {1, 2}, u[2] = {3, 4};
    const uint64_t seed = k3_kv_hash_seed(0, 2, 0);
    const uint64_t h1 = k3_kv_hash_block(seed, 0, t, 2), h2 = k3_kv_hash_block(h1, 0, u, 2);
    CHECK(h1 != k3_kv_hash_block(seed, 7, t, 2));                     /* the extra key counts */
    CHECK(h1 != k3_kv_hash_block(k3_kv_hash_seed(1, 2, 0), 0, t, 2)); /* and the salt */
    const int32_t a = k3_kv_alloc(&bm), b = k3_kv_alloc(&bm);
    CHECK(a == 0 && b == 1 && bm.n_free == 2);
    k3_kv_register(&bm, a, h1, seed, 0, t);
    k3_kv_register(&bm, b, h2, h1, 0, u);
    CHECK(k3_kv_lookup(&bm, h1, seed, 0, t) == a && k3_kv_lookup(&bm, h2, h1, 0, u) == b);
    CHECK(k3_kv_lookup(&bm, h1, seed, 0, u) == -1); /* same hash, other tokens: no */
    k3_kv_unref(&bm, b);
    k3_kv_unref(&bm, a);
    CHECK(bm.n_free == 4 && k3_kv_check(&bm));
    /* a hit takes a cached block back off the free list */
    k3_kv_ref(&bm, a);
    CHECK(bm.n_free == 3 && bm.ref[a] == 1);
    /* the unhashed blocks go first, then the least recently freed hashed one (b) */
    const int32_t c = k3_kv_alloc(&bm), d = k3_kv_alloc(&bm), f = k3_kv_alloc(&bm);
    CHECK(c != a && d != a && f == b && k3_kv_alloc(&bm) == -1);
    CHECK(k3_kv_lookup(&bm, h2, h1, 0, u) == -1 && k3_kv_lookup(&bm, h1, seed, 0, t) == a);
    CHECK(bm.n_evicted == 1 && k3_kv_check(&bm));
    k3_kv_blocks_free(&bm);
}

K3_TEST(kv_snapshots_budget_and_lru) {
    k3_kv_snaps sn;
    k3_error err = {0};
    REQUIRE(k3_kv_snaps_init(&sn, 100, 250, &err) == K3_OK);
    CHECK(sn.cap == 2);
    char *p1 = k3_kv_snap_put(&sn, 11, 16), *p2 = k3_kv_snap_put(&sn, 22, 32);
    REQUIRE(p1 && p2);
    memset(p1, 1, 100);
    memset(p2, 2, 100);
    CHECK(k3_kv_snap_find(&sn, 11, 16) == p1); /* 11 is now the most recent */
    CHECK(!k3_kv_snap_find(&sn, 11, 32));      /* position is part of the key */
    char *p3 = k3_kv_snap_put(&sn, 33, 48);    /* evicts 22 */
    CHECK(p3 && !k3_kv_snap_has(&sn, 22, 32) && k3_kv_snap_has(&sn, 11, 16) && sn.n == 2);
    CHECK(sn.n_evicted == 1 && k3_kv_snap_bytes(&sn) == 200);
    k3_kv_snaps_free(&sn);
    REQUIRE(k3_kv_snaps_init(&sn, 100, 50, &err) == K3_OK);
    CHECK(sn.cap == 0 && !k3_kv_snap_put(&sn, 1, 1));
    k3_kv_snaps_free(&sn);
}

/* A buffer adopted without a copy: the entry holds it as it is, the caller
 * gets the entry's previous buffer back; a pinned entry is neither adopted
 * over nor evicted for one. */
K3_TEST(kv_snapshots_adopt) {
    k3_kv_snaps sn;
    k3_error err = {0};
    REQUIRE(k3_kv_snaps_init(&sn, 100, 250, &err) == K3_OK);
    char *a = malloc(100), *b = malloc(100);
    REQUIRE(a && b);
    memset(a, 7, 100);
    void *buf = a;
    REQUIRE(k3_kv_snap_adopt(&sn, 11, 16, &buf)); /* a new entry: nothing comes back */
    CHECK(buf == NULL && k3_kv_snap_find(&sn, 11, 16) == a && sn.n == 1 && sn.n_taken == 1);
    memset(b, 8, 100);
    buf = b;
    REQUIRE(k3_kv_snap_adopt(&sn, 11, 16, &buf)); /* over it: the old buffer comes back */
    CHECK(buf == a && k3_kv_snap_find(&sn, 11, 16) == b && sn.n == 1 && ((char *)b)[99] == 8);
    CHECK(k3_kv_snap_pin(&sn, 11, 16) == b);
    CHECK(!k3_kv_snap_adopt(&sn, 11, 16, &buf) && buf == a); /* pinned: refused, nothing changed */
    CHECK(k3_kv_snap_put(&sn, 22, 32));
    REQUIRE(k3_kv_snap_adopt(&sn, 33, 48, &buf)); /* full: 22 goes, not the pinned 11 */
    CHECK(buf != a && k3_kv_snap_has(&sn, 11, 16) && !k3_kv_snap_has(&sn, 22, 32) && k3_kv_snap_find(&sn, 33, 48) == a);
    free(buf); /* 22's buffer, given back */
    k3_kv_snap_unpin(&sn, 11, 16);
    k3_kv_snaps_free(&sn); /* frees a and b */
    REQUIRE(k3_kv_snaps_init(&sn, 100, 50, &err) == K3_OK);
    char *c = malloc(100);
    buf = c;
    CHECK(!k3_kv_snap_adopt(&sn, 1, 1, &buf) && buf == c); /* no budget: the caller keeps it */
    free(c);
    k3_kv_snaps_free(&sn);
}

/* The same ids under other extra keys (another image) never share blocks;
 * under the same keys they do. */
K3_TEST(sched_prefix_extra_keys) {
    k3_model *m = open_model("tests/models/tiny");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    int32_t ids[80];
    make_ids(ids, 80, V, 6);
    uint64_t ka[80] = {0}, kb[80] = {0};
    for (int i = 20; i < 40; i++) {
        ka[i] = 0xAAAA;
        kb[i] = 0xBBBB;
    }
    k3_engine_options o = {.max_num_seqs = 2, .cache_tokens = 512, .block_size = 16, .snapshot_stride = 1};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    const uint64_t *keys[4] = {ka, kb, ka, NULL};
    int64_t cached[4];
    for (int i = 0; i < 4; i++) {
        k3_request_params p = {.prompt = ids,
                               .n_prompt = 80,
                               .max_tokens = 2,
                               .logprobs = -1,
                               .prompt_logprobs = -1,
                               .extra_keys = keys[i]};
        p.sampling = (k3_sampler_options){.top_p = 1, .repeat_penalty = 1};
        uint64_t id;
        k3_error err = {0};
        REQUIRE(k3_engine_submit(e, &p, &id, &err) == K3_OK);
        result r = {0};
        drain(e, &r, id, 1);
        cached[i] = r.n_cached;
    }
    /* block 0 (tokens 0-15) has no key: shared by all; blocks 1-2 carry the key */
    CHECKF(cached[0] == 0 && cached[1] == 16 && cached[2] == 64 && cached[3] == 16, "cached %lld %lld %lld %lld",
           (long long)cached[0], (long long)cached[1], (long long)cached[2], (long long)cached[3]);
    k3_engine_close(e);
    k3_model_close(m);
}

/* wait returns at its timeout when idle and at once with work queued; an
 * idle step reports nothing. */
K3_TEST(sched_wait_and_idle_step) {
    k3_model *m = open_model("tests/models/tiny");
    REQUIRE(m);
    k3_engine_options o = {.max_num_seqs = 2, .cache_tokens = 256, .block_size = 16};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    CHECK(!k3_engine_has_work(e));
    k3_step_result sr;
    k3_error err = {0};
    REQUIRE(k3_engine_step(e, &sr, &err) == K3_OK);
    CHECK(sr.n_outputs == 0 && sr.n_tokens == 0);
    double t0 = k3_now();
    k3_engine_wait(e, 0.02);
    const double idle = k3_now() - t0;
    CHECKF(idle >= 0.015 && idle < 1.0, "idle wait took %.3f s", idle);
    int32_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    const uint64_t id = submit(e, ids, 8, 2, 0, 0, -1);
    CHECK(id > 0 && k3_engine_has_work(e));
    t0 = k3_now();
    k3_engine_wait(e, 5.0);
    CHECK(k3_now() - t0 < 1.0);
    result r = {0};
    drain(e, &r, id, 1);
    CHECK(r.n == 2 && r.finished == 1 && !k3_engine_has_work(e));
    k3_engine_close(e);
    k3_model_close(m);
}

/* A KDA state captured inside a forward pass (k3_ctx_capture_state) is the
 * state a context has after exactly those tokens, bit for bit, on every
 * kernel path (the KDA layers cut their spans on the block grid, so the
 * pieces up to the capture are the same). */
K3_TEST(ctx_capture_state_mid_chunk) {
    k3_model *m = open_model("tests/models/tiny-dsa");
    REQUIRE(m);
    const int V = (int)m->cfg.vocab_size;
    int32_t ids[150];
    make_ids(ids, 150, V, 3);
    k3_error err = {0};
    const k3_isa best = k3_kernels_isa();
    for (int isa = K3_ISA_REF; isa <= K3_ISA_AVX512; isa++) {
        if (!k3_kernels_have((k3_isa)isa)) continue;
        k3_kernels_force((k3_isa)isa);
        for (int bs = 16; bs <= 64; bs *= 4) {
            k3_ctx_options o = {.max_seqs = 2, .cache_tokens = 512, .block_size = bs};
            k3_ctx *a = NULL, *b = NULL;
            REQUIRE(k3_ctx_init(&a, m, &o, &err) == K3_OK && k3_ctx_init(&b, m, &o, &err) == K3_OK);
            const int64_t nb = k3_ctx_state_bytes(a);
            REQUIRE(nb > 0);
            uint8_t *cap = malloc((size_t)nb), *cap2 = malloc((size_t)nb), *ref = malloc((size_t)nb);
            REQUIRE(cap && cap2 && ref);
            memset(cap, 0xA5, (size_t)nb);
            memset(cap2, 0xA5, (size_t)nb);
            /* a: 20 tokens, then 130 in one pass with captures at 64 and at its end */
            k3_batch_seq s1 = {0, 20, ids, NULL}, s2 = {0, 130, ids + 20, NULL};
            REQUIRE(k3_ctx_forward(a, &s1, 1, K3_LOGITS_NONE, NULL, &err) == K3_OK);
            REQUIRE(k3_ctx_capture_state(a, 0, 64, cap, &err) == K3_OK);
            REQUIRE(k3_ctx_capture_state(a, 0, 150, cap2, &err) == K3_OK);
            REQUIRE(k3_ctx_forward(a, &s2, 1, K3_LOGITS_NONE, NULL, &err) == K3_OK);
            /* b: the first 64 tokens one by one after 8 at once */
            k3_batch_seq t = {0, 8, ids, NULL};
            REQUIRE(k3_ctx_forward(b, &t, 1, K3_LOGITS_NONE, NULL, &err) == K3_OK);
            for (int i = 8; i < 64; i++) {
                t = (k3_batch_seq){0, 1, ids + i, NULL};
                REQUIRE(k3_ctx_forward(b, &t, 1, K3_LOGITS_NONE, NULL, &err) == K3_OK);
            }
            k3_ctx_state_save(b, 0, ref);
            CHECKF(!memcmp(cap, ref, (size_t)nb), "isa %d block %d: the state captured at 64 differs", isa, bs);
            k3_ctx_state_save(a, 0, ref);
            CHECKF(!memcmp(cap2, ref, (size_t)nb), "isa %d block %d: the state captured at the end differs", isa, bs);
            /* captures are forgotten after a run */
            memset(cap, 0xA5, (size_t)nb);
            t = (k3_batch_seq){0, 1, ids + 100, NULL};
            REQUIRE(k3_ctx_forward(a, &t, 1, K3_LOGITS_NONE, NULL, &err) == K3_OK);
            CHECK(cap[0] == 0xA5 && cap[nb - 1] == 0xA5);
            free(cap);
            free(cap2);
            free(ref);
            k3_ctx_free(a);
            k3_ctx_free(b);
        }
    }
    k3_kernels_force(best);
    k3_model_close(m);
}

/* Requests under a grammar (k3_request_params.grammar): every output matches
 * the regex and ends with an EOS (reason stop) once it is complete, batched
 * and preempted on a small pool as alone, logprobs those of the masked row
 * (the chosen id is in the mask: the grammar accepts it). */
static void grammar_solo(const k3_model *m, const int32_t *eos, int n_eos, k3_grammar *g, const int32_t *ids, int n,
                         float temp, uint64_t seed, result *out) {
    k3_engine_options o = {.max_num_seqs = 1,
                           .cache_tokens = 1024,
                           .block_size = 16,
                           .no_prefix_cache = true,
                           .eos_ids = eos,
                           .n_eos_ids = n_eos};
    k3_engine *e = open_engine(m, &o);
    if (!e) return;
    memset(out, 0, sizeof *out);
    k3_request_params p =
        {.prompt = ids, .n_prompt = n, .max_tokens = 40, .logprobs = NTOP, .prompt_logprobs = -1, .grammar = g};
    p.sampling = (k3_sampler_options){.temperature = temp,
                                      .top_k = temp > 0 ? 40 : 0,
                                      .top_p = 1.0f,
                                      .repeat_penalty = 1.0f,
                                      .seed = seed};
    uint64_t id = 0;
    k3_error err = {0};
    if (k3_engine_submit(e, &p, &id, &err)) k3_test_fail(__FILE__, __LINE__, "submit: %s", err.msg);
    drain(e, out, id, 1);
    k3_engine_close(e);
}

K3_TEST(sched_grammar_constrained) {
    k3_model *m = open_model("tests/models/tiny-dsa");
    REQUIRE(m);
    k3_tokenizer *tok = NULL;
    k3_grammar_vocab *gv = NULL;
    k3_grammar *g = NULL;
    k3_error err = {0};
    REQUIRE(k3_tokenizer_open(&tok, "tests/models/tiny-dsa", &err) == K3_OK);
    REQUIRE(k3_grammar_vocab_init(&gv, tok, &err) == K3_OK);
    const k3_grammar_spec sp = {.kind = K3_GRAMMAR_REGEX, .text = "[a-z]{3,6}-[0-9]{2}"};
    REQUIRE(k3_grammar_compile(&g, gv, &sp, &err) == K3_OK);
    int32_t eos[K3_MAX_EOS_IDS];
    const int n_eos = k3_tokenizer_eos_ids(tok, eos);
    REQUIRE(n_eos > 0);
    const int V = (int)m->cfg.vocab_size;
    enum { N = 4 };
    int32_t ids[N][46];
    result alone[N], tog[N];
    for (int i = 0; i < N; i++) {
        make_ids(ids[i], 46, V, 70 + i);
        grammar_solo(m, eos, n_eos, g, ids[i], 46, i % 2 ? 1.0f : 0, 3 + i, &alone[i]);
    }
    /* 7 blocks of 16 for four requests of 46 + a few tokens (3 blocks each, then 4): preemptions */
    k3_engine_options o = {.max_num_seqs = 4,
                           .cache_tokens = 64 + 48,
                           .block_size = 16,
                           .eos_ids = eos,
                           .n_eos_ids = n_eos};
    k3_engine *e = open_engine(m, &o);
    REQUIRE(e);
    memset(tog, 0, sizeof tog);
    uint64_t base = 0;
    for (int i = 0; i < N; i++) {
        k3_request_params p =
            {.prompt = ids[i], .n_prompt = 46, .max_tokens = 40, .logprobs = NTOP, .prompt_logprobs = -1, .grammar = g};
        p.sampling = (k3_sampler_options){.temperature = i % 2 ? 1.0f : 0,
                                          .top_k = i % 2 ? 40 : 0,
                                          .top_p = 1.0f,
                                          .repeat_penalty = 1.0f,
                                          .seed = 3 + (uint64_t)i};
        uint64_t id = 0;
        CHECK(k3_engine_submit(e, &p, &id, &err) == K3_OK);
        if (!i) base = id;
    }
    drain(e, tog, base, N);
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    printf("    %lld preemptions, %lld masks in %lld steps, %.3f ms\n", (long long)st.n_preemptions,
           (long long)st.grammar_masks, (long long)st.grammar_steps, st.grammar_s * 1e3);
    CHECK(st.n_preemptions > 0);
    CHECK(st.grammar_masks > 0 && st.grammar_steps > 0 && st.grammar_steps < st.grammar_masks);
    for (int i = 0; i < N; i++) {
        CHECKF(same_tokens(&tog[i], &alone[i]), "request %d (preempted %d times) differs from alone", i,
               tog[i].preempted);
        CHECKF(tog[i].fin == K3_FINISH_STOP, "request %d finished %d", i, (int)tog[i].fin);
        /* the text before the EOS matches; the grammar takes every token */
        k3_grammar_matcher *gm = NULL;
        REQUIRE(k3_grammar_matcher_init(&gm, g, &err) == K3_OK);
        size_t n_ok = 0;
        CHECKF(k3_grammar_matcher_accept_tokens(gm, tog[i].tok, (size_t)tog[i].n, &n_ok, &err) == K3_OK,
               "request %d: token %zu refused", i, n_ok);
        CHECK(k3_grammar_matcher_is_ended(gm));
        k3_grammar_matcher_free(gm);
        char *text = NULL;
        size_t len = 0;
        REQUIRE(k3_tokenizer_decode(tok, tog[i].tok, (size_t)(tog[i].n - 1), &text, &len, &err) == K3_OK);
        bool ok = len >= 6;
        size_t k = 0;
        while (k < len && text[k] >= 'a' && text[k] <= 'z') k++;
        ok = ok && k >= 3 && k <= 6 && k + 3 == len && text[k] == '-' && text[k + 1] >= '0' && text[k + 1] <= '9' &&
            text[k + 2] >= '0' && text[k + 2] <= '9';
        CHECKF(ok, "request %d: '%.*s' does not match", i, (int)len, text);
        /* the masked row's logprobs: the chosen token is among the most likely allowed */
        for (int t = 0; t < tog[i].n; t++) CHECK(tog[i].lp[t] <= 0 && tog[i].lp[t] > -1e30f);
        free(text);
    }
    k3_engine_close(e);
    k3_grammar_free(g);
    k3_grammar_vocab_free(gv);
    k3_tokenizer_free(tok);
    k3_model_close(m);
}
