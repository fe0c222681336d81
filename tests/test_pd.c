/* test_pd.c -- prefill and decode apart at the engine's level, in one
 * process: a prefill engine keeps a request's blocks and KDA state (a
 * hold), a decode engine pulls them through its hook (copied here with
 * k3_engine_hold_read -> k3_engine_pull_write, what src/pd does over TCP),
 * and the decode engine's tokens equal one colocated engine's, token for
 * token (greedy and seeded, short prompts and prompts past the DSA top-k
 * and several KDA chunks, f32 and C8); a prefix the decode engine holds
 * is not fetched again; a cancelled or failed pull, a hold nobody reads,
 * and a wrong write each end cleanly with every block back. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/error.h"
#include "engine/engine.h"
#include "k3.h"
#include "kernels/kernels.h"
#include "model/model.h"
#include "common/random.h"
#include "pd/auth.h"
#include "pd/wire.h"
#include "test.h"

#define TINY_DSA "tests/models/tiny-dsa"

enum { MAXG = 48, MAXQ = 16 };

/* the decode engine's hook: what it asked for, in order */
typedef struct {
    k3_pull_info q[64];
    int n;
} hookq;

static void hook(void *arg, const k3_pull_info *pi) {
    hookq *h = arg;
    if (h->n < 64) h->q[h->n++] = *pi;
}

static void make_ids(int32_t *ids, int n, int vocab, unsigned seed) {
    uint64_t r = seed * 2654435761u + 7;
    for (int i = 0; i < n; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((r >> 33) % (uint64_t)(vocab - 16)) + 8;
    }
}

typedef struct {
    int32_t tok[MAXG];
    float lp[MAXG];
    int n;
    k3_finish_reason fin;
    int64_t n_cached;
    const char *err;
    char errbuf[256];
} result;

/* Steps e until every request of ids [base, base + n) has finished. */
static void drain(k3_engine *e, result *res, uint64_t base, int n, void (*between)(void *), void *arg) {
    for (int guard = 0; guard < 4000; guard++) {
        k3_step_result sr;
        k3_error err = {0};
        if (between) between(arg);
        if (!k3_engine_has_work(e)) {
            bool all = true;
            for (int i = 0; i < n; i++) all &= res[i].fin != K3_FINISH_NONE;
            if (all) return;
        }
        if (k3_engine_step(e, &sr, &err)) {
            k3_test_fail(__FILE__, __LINE__, "step: %s", err.msg);
            return;
        }
        for (int i = 0; i < sr.n_outputs; i++) {
            const k3_req_output *o = &sr.outputs[i];
            if (o->id < base || o->id >= base + (uint64_t)n) continue;
            result *r = &res[o->id - base];
            for (int k = 0; k < o->n_new && r->n < MAXG; k++) {
                r->lp[r->n] = o->logprobs ? o->logprobs[k] : NAN;
                r->tok[r->n++] = o->tokens[k];
            }
            r->n_cached = o->n_cached;
            if (o->events & K3_EV_FINISHED) {
                r->fin = o->finish;
                if (o->error) snprintf(r->errbuf, sizeof r->errbuf, "%s", o->error);
                r->err = o->error ? r->errbuf : NULL;
            }
        }
    }
    k3_test_fail(__FILE__, __LINE__, "the engine did not finish");
}

typedef struct {
    k3_engine *p, *d;
    hookq *hq;
    int done;           /* hook entries handled */
    uint64_t holds[64]; /* the hold of each decode request, by ctx index */
    int64_t pulled;     /* tokens copied */
    int chunk;          /* tokens per write */
    bool fail, cancel_first;
} pd;

/* Serves the decode engine's hook entries: copies each hold into its pull. */
static void serve(void *arg) {
    pd *x = arg;
    for (; x->done < x->hq->n; x->done++) {
        const k3_pull_info *pi = &x->hq->q[x->done];
        const uint64_t hid = x->holds[(intptr_t)pi->ctx];
        if (pi->op != K3_PULL_START) {
            if (pi->op == K3_PULL_ABORT) k3_engine_hold_release(x->p, hid);
            continue;
        }
        k3_error err = {0};
        bool ok = !x->fail;
        const int64_t sb = k3_engine_state_bytes(x->d);
        int64_t most = 0;
        for (int32_t L = 0; L < 8; L++)
            if (k3_engine_kv_bytes(x->d, L, x->chunk) > most) most = k3_engine_kv_bytes(x->d, L, x->chunk);
        char *buf = malloc((size_t)(most + sb + 1));
        for (int32_t L = 0; ok && L < 8; L++) {
            if (k3_engine_kv_bytes(x->d, L, 1) == 0) continue;
            for (int64_t t = pi->n_local; ok && t < pi->n_tokens; t += x->chunk) {
                const int32_t n = (int32_t)(pi->n_tokens - t < x->chunk ? pi->n_tokens - t : x->chunk);
                const int64_t b = k3_engine_kv_bytes(x->d, L, n);
                ok = !k3_engine_hold_read(x->p, hid, L, t, n, buf, b, &err) &&
                    !k3_engine_pull_write(x->d, pi->id, L, t, n, buf, b, &err);
                if (ok) x->pulled += n;
            }
        }
        /* the state in two parts */
        for (int64_t off = 0, half = sb / 2; ok && off < sb; off += half ? half : sb) {
            const int64_t nb = off + half < sb && half ? half : sb - off;
            ok = !k3_engine_hold_read_state(x->p, hid, off, buf, nb, &err) &&
                !k3_engine_pull_state(x->d, pi->id, off, buf, nb, &err);
        }
        k3_engine_pull_done(x->d, pi->id, ok, ok ? NULL : x->fail ? "the test failed it" : err.msg);
        k3_engine_hold_release(x->p, hid);
        free(buf);
    }
}

static k3_engine *open_engine(const k3_model *m, k3_kv_type kv, int max_seqs) {
    k3_engine *e = NULL;
    k3_error err = {0};
    const int32_t eos = 770;
    k3_engine_options o = {.max_num_seqs = max_seqs,
                           .max_num_batched_tokens = 256,
                           .cache_tokens = 4096,
                           .block_size = 16,
                           .kv_cache = kv,
                           .eos_ids = &eos,
                           .n_eos_ids = 1,
                           .hold_timeout_s = 30};
    if (k3_engine_open(&e, m, &o, &err)) k3_test_fail(__FILE__, __LINE__, "engine: %s", err.msg);
    return e;
}

static bool engine_idle(k3_engine *e) {
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    return k3_engine_check(e) && st.blocks_used == 0 && st.n_holds == 0 && st.n_pulls == 0;
}

/* Prompts ps through colocated c, then prefill p + decode d; compares. */
static void compare_spec(const k3_model *m, k3_kv_type kv, const int32_t *const *ps, const int *lens, int nq,
                         int max_tokens, float temp, const char *what, k3_spec_method d_spec) {
    k3_engine *c = open_engine(m, kv, 8), *p = open_engine(m, kv, 8), *d = NULL;
    {
        /* the decode side, drafting when d_spec says so */
        const int32_t eos = 770;
        k3_engine_options o = {.max_num_seqs = 8,
                               .max_num_batched_tokens = 256,
                               .cache_tokens = 4096,
                               .block_size = 16,
                               .kv_cache = kv,
                               .eos_ids = &eos,
                               .n_eos_ids = 1,
                               .hold_timeout_s = 30,
                               .speculative = d_spec,
                               .spec_no_cost_model = true};
        k3_error e2 = {0};
        if (k3_engine_open(&d, m, &o, &e2)) k3_test_fail(__FILE__, __LINE__, "engine: %s", e2.msg);
    }
    REQUIRE(c && p && d);
    hookq hq = {0};
    k3_engine_set_pull_hook(d, hook, &hq);
    result rc[MAXQ] = {0}, rp[MAXQ] = {0}, rd[MAXQ] = {0};
    uint64_t id = 0, c0 = 0, p0 = 0, d0 = 0;
    k3_error err = {0};
    for (int i = 0; i < nq; i++) {
        k3_request_params q = {.prompt = ps[i],
                               .n_prompt = lens[i],
                               .max_tokens = max_tokens,
                               .logprobs = 0,
                               .prompt_logprobs = -1,
                               .sampling = {.temperature = temp,
                                            .top_p = 1,
                                            .repeat_penalty = 1,
                                            .seed = 100 + (uint64_t)i,
                                            .frequency_penalty = 0.3f}};
        REQUIRE(k3_engine_submit(c, &q, &id, &err) == K3_OK);
        if (i == 0) c0 = id;
        q.kv_hold = true;
        q.max_tokens = 1;
        REQUIRE(k3_engine_submit(p, &q, &id, &err) == K3_OK);
        if (i == 0) p0 = id;
    }
    drain(c, rc, c0, nq, NULL, NULL);
    drain(p, rp, p0, nq, NULL, NULL);
    pd x = {.p = p, .d = d, .hq = &hq, .chunk = 7};
    k3_remote_prefill rem[MAXQ];
    for (int i = 0; i < nq; i++) {
        REQUIRE(rp[i].n == 1);
        k3_hold_info hi;
        REQUIREF(k3_engine_hold_get(p, p0 + (uint64_t)i, &hi, NULL, 0, &err) == K3_OK, "%s", err.msg);
        CHECK(hi.n_tokens == lens[i]);
        x.holds[i] = p0 + (uint64_t)i;
        rem[i] =
            (k3_remote_prefill){.first_token = rp[i].tok[0], .first_logprob = rp[i].lp[0], .ctx = (void *)(intptr_t)i};
        k3_request_params q = {.prompt = ps[i],
                               .n_prompt = lens[i],
                               .max_tokens = max_tokens,
                               .logprobs = 0,
                               .prompt_logprobs = -1,
                               .remote = &rem[i],
                               .sampling = {.temperature = temp,
                                            .top_p = 1,
                                            .repeat_penalty = 1,
                                            .seed = 100 + (uint64_t)i,
                                            .frequency_penalty = 0.3f}};
        REQUIRE(k3_engine_submit(d, &q, &id, &err) == K3_OK);
        if (i == 0) d0 = id;
    }
    drain(d, rd, d0, nq, serve, &x);
    for (int i = 0; i < nq; i++) {
        CHECKF(rd[i].fin == rc[i].fin && rd[i].n == rc[i].n &&
                   !memcmp(rd[i].tok, rc[i].tok, sizeof(int32_t) * (size_t)rc[i].n),
               "%s: request %d: decode after a pull gave %d tokens (finish %d, %s), colocated %d (finish %d)", what, i,
               rd[i].n, rd[i].fin, rd[i].err ? rd[i].err : "", rc[i].n, rc[i].fin);
        for (int k = 0; k < rc[i].n && k < rd[i].n; k++)
            CHECKF(fabsf(rd[i].lp[k] - rc[i].lp[k]) <= 1e-5f, "%s: request %d token %d logprob %g vs %g", what, i, k,
                   rd[i].lp[k], rc[i].lp[k]);
    }
    if (d_spec == K3_SPEC_SUFFIX) {
        k3_engine_stats ds;
        k3_engine_get_stats(d, &ds);
        /* verify chunks ran there (a random model seldom copies: their drafts are mostly rejected) */
        CHECKF(ds.spec_drafts > 0, "%s: the decode side verified no draft", what);
    }
    /* every hold released, every block back */
    k3_step_result sr;
    k3_engine_step(p, &sr, &err);
    k3_engine_step(d, &sr, &err);
    CHECK(engine_idle(p));
    CHECK(engine_idle(d));
    k3_engine_close(c);
    k3_engine_close(p);
    k3_engine_close(d);
}

static void compare(const k3_model *m, k3_kv_type kv, const int32_t *const *ps, const int *lens, int nq, int max_tokens,
                    float temp, const char *what) {
    compare_spec(m, kv, ps, lens, nq, max_tokens, temp, what, K3_SPEC_OFF);
}

/* The decode side drafts (suffix): the same tokens as colocated without. */
K3_TEST(pd_decode_side_speculates_equals_colocated) {
    k3_error err = {0};
    k3_model *m = NULL;
    REQUIREF(k3_model_open(&m, TINY_DSA, &err) == K3_OK, "%s", err.msg);
    int32_t a[60], b[96];
    make_ids(a, 12, 1024, 21);
    for (int i = 12; i < 60; i++) a[i] = a[i % 12]; /* a prompt that repeats */
    make_ids(b, 96, 1024, 22);
    const int32_t *ps[2] = {a, b};
    const int lens[2] = {60, 96};
    compare_spec(m, K3_KV_F32, ps, lens, 2, 32, 0.0f, "f32 greedy, the decode side drafting", K3_SPEC_SUFFIX);
    compare_spec(m, K3_KV_F32, ps, lens, 2, 32, 0.8f, "f32 seeded, the decode side drafting", K3_SPEC_SUFFIX);
    k3_model_close(m);
}

K3_TEST(pd_decode_after_a_pull_equals_colocated) {
    k3_error err = {0};
    k3_model *m = NULL;
    REQUIREF(k3_model_open(&m, TINY_DSA, &err) == K3_OK, "%s", err.msg);
    int32_t a[5], b[300], c2[47], d2[16];
    make_ids(a, 5, 1024, 1);
    make_ids(b, 300, 1024, 2); /* past the DSA top-k (8) and many KDA chunks */
    make_ids(c2, 47, 1024, 3);
    make_ids(d2, 16, 1024, 4); /* on the block grid */
    const int32_t *ps[4] = {a, b, c2, d2};
    const int lens[4] = {5, 300, 47, 16};
    compare(m, K3_KV_F32, ps, lens, 4, 24, 0.0f, "f32 greedy");
    compare(m, K3_KV_C8, ps, lens, 4, 24, 0.0f, "c8 greedy");
    compare(m, K3_KV_F32, ps, lens, 4, 24, 0.8f, "f32 seeded");
    k3_model_close(m);
}

K3_TEST(pd_prefix_on_the_decode_side_is_not_pulled_again) {
    k3_error err = {0};
    k3_model *m = NULL;
    REQUIREF(k3_model_open(&m, TINY_DSA, &err) == K3_OK, "%s", err.msg);
    k3_engine *p = open_engine(m, K3_KV_F32, 4), *d = open_engine(m, K3_KV_F32, 4), *c = open_engine(m, K3_KV_F32, 4);
    REQUIRE(p && d && c);
    hookq hq = {0};
    k3_engine_set_pull_hook(d, hook, &hq);
    int32_t x1[100], x2[130];
    make_ids(x1, 100, 1024, 9);
    memcpy(x2, x1, sizeof(int32_t) * 96); /* 6 blocks shared */
    make_ids(x2 + 96, 34, 1024, 10);
    const int32_t *ps[2] = {x1, x2};
    const int lens[2] = {100, 130};
    pd x = {.p = p, .d = d, .hq = &hq, .chunk = 16};
    int64_t pulled[2];
    for (int i = 0; i < 2; i++) {
        result rp = {0}, rd = {0}, rc = {0};
        uint64_t id;
        k3_request_params q = {.prompt = ps[i],
                               .n_prompt = lens[i],
                               .max_tokens = 1,
                               .logprobs = -1,
                               .prompt_logprobs = -1,
                               .kv_hold = true,
                               .sampling = {.top_p = 1, .repeat_penalty = 1}};
        REQUIRE(k3_engine_submit(p, &q, &id, &err) == K3_OK);
        drain(p, &rp, id, 1, NULL, NULL);
        x.holds[i] = id;
        k3_remote_prefill rem = {.first_token = rp.tok[0], .first_logprob = NAN, .ctx = (void *)(intptr_t)i};
        q.kv_hold = false;
        q.max_tokens = 8;
        k3_request_params qc = q;
        q.remote = &rem;
        REQUIRE(k3_engine_submit(d, &q, &id, &err) == K3_OK);
        const int64_t before = x.pulled;
        drain(d, &rd, id, 1, serve, &x);
        pulled[i] = x.pulled - before;
        REQUIRE(k3_engine_submit(c, &qc, &id, &err) == K3_OK);
        drain(c, &rc, id, 1, NULL, NULL);
        CHECK(rd.n == rc.n && !memcmp(rd.tok, rc.tok, sizeof(int32_t) * (size_t)rc.n));
        if (i == 1)
            CHECKF(rd.n_cached == 96, "the second request found %lld tokens on the decode side",
                   (long long)rd.n_cached);
    }
    /* two attention layers: the first prompt whole, of the second only what follows the shared 96 */
    CHECKF(pulled[0] == 2 * 100 && pulled[1] == 2 * (130 - 96), "pulled %lld and %lld tokens x layers",
           (long long)pulled[0], (long long)pulled[1]);
    k3_step_result sr;
    k3_engine_step(p, &sr, &err);
    CHECK(engine_idle(p));
    k3_engine_close(p);
    k3_engine_close(d);
    k3_engine_close(c);
    k3_model_close(m);
}

K3_TEST(pd_failed_cancelled_and_unread_transfers_free_everything) {
    k3_error err = {0};
    k3_model *m = NULL;
    REQUIREF(k3_model_open(&m, TINY_DSA, &err) == K3_OK, "%s", err.msg);
    k3_engine *p = NULL, *d = open_engine(m, K3_KV_F32, 4);
    const int32_t eos = 770;
    k3_engine_options po = {.max_num_seqs = 4,
                            .max_num_batched_tokens = 256,
                            .cache_tokens = 4096,
                            .block_size = 16,
                            .eos_ids = &eos,
                            .n_eos_ids = 1,
                            .hold_timeout_s = 0.2};
    REQUIRE(k3_engine_open(&p, m, &po, &err) == K3_OK && d);
    hookq hq = {0};
    k3_engine_set_pull_hook(d, hook, &hq);
    int32_t ids[40];
    make_ids(ids, 40, 1024, 5);
    uint64_t id;

    /* a hold nobody reads is freed at its timeout, counted */
    result rp = {0};
    k3_request_params q = {.prompt = ids,
                           .n_prompt = 40,
                           .max_tokens = 1,
                           .logprobs = -1,
                           .prompt_logprobs = -1,
                           .kv_hold = true,
                           .sampling = {.top_p = 1, .repeat_penalty = 1}};
    REQUIRE(k3_engine_submit(p, &q, &id, &err) == K3_OK);
    drain(p, &rp, id, 1, NULL, NULL);
    k3_engine_stats st;
    k3_engine_get_stats(p, &st);
    CHECK(st.n_holds == 1 && st.hold_blocks == 3);
    for (int i = 0; i < 50 && !k3_engine_has_work(p); i++) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    k3_step_result sr;
    k3_engine_step(p, &sr, &err);
    k3_engine_get_stats(p, &st);
    CHECK(st.n_holds == 0 && st.holds_expired == 1 && engine_idle(p));
    k3_err_clear(&err);
    CHECK(k3_engine_hold_read_state(p, id, 0, NULL, 0, &err) == K3_ERR_ARG && strstr(err.msg, "not held"));

    /* a failed pull: the request's error, its blocks back */
    k3_remote_prefill rem = {.first_token = 9, .first_logprob = NAN, .ctx = (void *)(intptr_t)0};
    k3_request_params qd = {.prompt = ids,
                            .n_prompt = 40,
                            .max_tokens = 4,
                            .logprobs = -1,
                            .prompt_logprobs = -1,
                            .remote = &rem,
                            .sampling = {.top_p = 1, .repeat_penalty = 1}};
    result rd = {0};
    REQUIRE(k3_engine_submit(d, &qd, &id, &err) == K3_OK);
    k3_engine_step(d, &sr, &err);
    REQUIRE(hq.n == 1 && hq.q[0].op == K3_PULL_START && hq.q[0].n_tokens == 40);
    /* a write outside its range, or of the wrong size, is refused */
    char row[4096];
    CHECK(k3_engine_pull_write(d, id, 3, 38, 4, row, k3_engine_kv_bytes(d, 3, 4), &err) == K3_ERR_ARG);
    k3_err_clear(&err);
    CHECKF(k3_engine_pull_write(d, id, 3, 0, 4, row, 7, &err) == K3_ERR_ARG && strstr(err.msg, "bytes"), "%s", err.msg);
    k3_err_clear(&err);
    CHECK(k3_engine_pull_write(d, id, 0, 0, 4, row, 7, &err) == K3_ERR_ARG && strstr(err.msg, "MLA/DSA"));
    k3_engine_stats ds;
    k3_engine_get_stats(d, &ds);
    CHECK(ds.n_pulls == 1 && ds.pull_blocks == 3 && k3_engine_check(d));
    k3_engine_pull_done(d, id, false, "the prefill instance went away");
    drain(d, &rd, id, 1, NULL, NULL);
    CHECK(rd.fin == K3_FINISH_ERROR && rd.err && strstr(rd.err, "went away"));
    CHECK(engine_idle(d));

    /* cancelled while pulling: ended once the pull stops, blocks back */
    result rx = {0};
    REQUIRE(k3_engine_submit(d, &qd, &id, &err) == K3_OK);
    k3_engine_step(d, &sr, &err);
    REQUIRE(hq.n == 2 && hq.q[1].op == K3_PULL_START);
    k3_engine_cancel(d, id);
    k3_engine_step(d, &sr, &err);
    REQUIRE(hq.n == 3 && hq.q[2].op == K3_PULL_CANCEL);
    k3_err_clear(&err);
    CHECK(k3_engine_pull_write(d, id, 3, 0, 4, row, k3_engine_kv_bytes(d, 3, 4), &err) == K3_ERR_ARG &&
          strstr(err.msg, "cancelled"));
    k3_engine_pull_done(d, id, false, "cancelled");
    drain(d, &rx, id, 1, NULL, NULL);
    CHECK(rx.fin == K3_FINISH_CANCELLED);
    CHECK(engine_idle(d));

    /* cancelled before its blocks came: an abort for the hook, nothing held */
    k3_engine *tight = NULL;
    k3_engine_options to = {.max_num_seqs = 2,
                            .max_num_batched_tokens = 64,
                            .cache_tokens = 64,
                            .block_size = 16,
                            .eos_ids = &eos,
                            .n_eos_ids = 1};
    REQUIRE(k3_engine_open(&tight, m, &to, &err) == K3_OK);
    hookq h2 = {0};
    k3_engine_set_pull_hook(tight, hook, &h2);
    uint64_t a, b;
    qd.max_tokens = 2;
    REQUIRE(k3_engine_submit(tight, &qd, &a, &err) == K3_OK); /* 3 of the 4(+2) blocks */
    REQUIRE(k3_engine_submit(tight, &qd, &b, &err) == K3_OK); /* does not fit beside it */
    k3_engine_step(tight, &sr, &err);
    CHECK(h2.n == 1 && h2.q[0].id == a);
    k3_engine_cancel(tight, b);
    k3_engine_step(tight, &sr, &err);
    CHECK(h2.n == 2 && h2.q[1].id == b && h2.q[1].op == K3_PULL_ABORT);
    k3_engine_pull_done(tight, a, false, "no");
    result r2[2];
    memset(r2, 0, sizeof r2);
    drain(tight, r2, a, 1, NULL, NULL);
    CHECK(r2[0].fin == K3_FINISH_ERROR);
    CHECK(engine_idle(tight));
    k3_engine_close(tight);

    /* refused up front */
    qd.prompt_logprobs = 0;
    CHECK(k3_engine_submit(d, &qd, &id, &err) == K3_ERR_ARG);
    qd.prompt_logprobs = -1;
    rem.first_token = 5000;
    k3_err_clear(&err);
    CHECK(k3_engine_submit(d, &qd, &id, &err) == K3_ERR_ARG && strstr(err.msg, "first token"));
    q.max_tokens = 0;
    CHECK(k3_engine_submit(p, &q, &id, &err) == K3_ERR_ARG);
    k3_engine_close(p);
    k3_engine_close(d);
    k3_model_close(m);
}

/* The transfer's authentication (src/pd/auth.c) over a socket pair: two
 * ends with the same secret agree on session keys and each tag checks on
 * the other side; a flipped byte, another message number (a replay or a
 * reorder) or another secret fails; an end without the secret learns
 * nothing but a refusal. */
typedef struct {
    int fd;
    const k3_pd_keys *k;
    k3_pd_session s;
    k3_status st;
} hs_arg;

static void *hs_server(void *arg) {
    hs_arg *a = arg;
    a->st = k3_pd_handshake_server(a->fd, a->k, &a->s, NULL);
    return NULL;
}

static void handshake(const k3_pd_keys *kc, const k3_pd_keys *ks, hs_arg *cli, hs_arg *srv) {
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    struct timeval tv = {2, 0};
    for (int i = 0; i < 2; i++) {
        setsockopt(sv[i], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(sv[i], SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }
    *cli = (hs_arg){sv[0], kc, {{0}}, K3_OK};
    *srv = (hs_arg){sv[1], ks, {{0}}, K3_OK};
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, hs_server, srv) == 0);
    cli->st = k3_pd_handshake_client(cli->fd, kc, &cli->s, NULL);
    if (cli->st) shutdown(cli->fd, SHUT_RDWR); /* the server side sees the end */
    pthread_join(t, NULL);
    close(sv[0]);
    close(sv[1]);
}

K3_TEST(pd_handshake_proves_the_secret_and_every_tag_checks_its_bytes_and_place) {
    k3_pd_keys k1, k2;
    REQUIRE(k3_pd_keys_derive(&k1, "deployment secret one", 21, NULL) == K3_OK);
    REQUIRE(k3_pd_keys_derive(&k2, "deployment secret two", 21, NULL) == K3_OK);
    CHECK(k3_pd_keys_derive(&k2, "short", 5, NULL) == K3_ERR_ARG);
    hs_arg c, s;
    handshake(&k1, &k1, &c, &s);
    CHECK(c.st == K3_OK && s.st == K3_OK);
    uint8_t msg[3000], tag[K3_PD_TAG_BYTES];
    for (int i = 0; i < (int)sizeof msg; i++) msg[i] = (uint8_t)(i * 7 + 1);
    k3_pd_tag(&c.s.tx, 5, msg, sizeof msg, NULL, 0, tag);
    CHECK(k3_pd_tag_ok(&s.s.rx, 5, msg, sizeof msg, NULL, 0, tag));
    CHECK(!k3_pd_tag_ok(&s.s.rx, 6, msg, sizeof msg, NULL, 0, tag));   /* another place */
    CHECK(!k3_pd_tag_ok(&c.s.rx, 5, msg, sizeof msg, NULL, 0, tag));   /* the other direction */
    CHECK(k3_pd_tag_ok(&s.s.rx, 5, msg, 1000, msg + 1000, 2000, tag)); /* in two pieces */
    for (int bit = 0; bit < 8 * (int)sizeof msg; bit += 101) {
        msg[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        CHECKF(!k3_pd_tag_ok(&s.s.rx, 5, msg, sizeof msg, NULL, 0, tag), "bit %d", bit);
        msg[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    }
    k3_pd_session_free(&c.s);
    k3_pd_session_free(&s.s);
    /* another secret: both ends refuse */
    handshake(&k1, &k2, &c, &s);
    CHECK(c.st == K3_ERR_PERM && s.st != K3_OK);
    k3_pd_session_free(&c.s);
    k3_pd_session_free(&s.s);
    /* the proxy's credential covers every field that says where to connect */
    char a[65], b[65];
    k3_pd_credential(&k1, "127.0.0.1", 9100, "00ff", "ab", 12, a);
    k3_pd_credential(&k1, "127.0.0.1", 9101, "00ff", "ab", 12, b);
    CHECK(strlen(a) == 64 && strcmp(a, b));
    k3_pd_credential(&k1, "127.0.0.2", 9100, "00ff", "ab", 12, b);
    CHECK(strcmp(a, b));
    k3_pd_credential(&k2, "127.0.0.1", 9100, "00ff", "ab", 12, b);
    CHECK(strcmp(a, b));
    k3_pd_credential(&k1, "127.0.0.1", 9100, "00ff", "ab", 12, b);
    CHECK(!strcmp(a, b));
}

/* Ids from the OS's generator: 10,000 of them, no repeats, every letter of
 * the alphabet about as often in every place (a counter, a clock or an
 * address would fix letters or repeat them). */
K3_TEST(random_ids_are_unique_and_every_letter_is_uniform_in_every_place) {
    enum { N = 10000, L = 24 };
    static char ids[N][40];
    static int count[L][62];
    static const char abc[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    for (int i = 0; i < N; i++) {
        REQUIRE(k3_random_id(ids[i], sizeof ids[i], "resp_", L));
        REQUIRE(strlen(ids[i]) == 5 + L);
        for (int j = 0; j < L; j++) count[j][strchr(abc, ids[i][5 + j]) - abc]++;
    }
    /* expected N/62 = 161.3 per letter and place, sd 12.6: +-7 sd */
    int worst = 0;
    for (int j = 0; j < L; j++)
        for (int c = 0; c < 62; c++) {
            const int d = abs(count[j][c] - N / 62);
            if (d > worst) worst = d;
        }
    CHECKF(worst < 90, "a letter %d away from its expected count", worst);
    qsort(ids, N, sizeof ids[0], (int (*)(const void *, const void *))strcmp);
    int rep = 0;
    for (int i = 1; i < N; i++) rep += !strcmp(ids[i], ids[i - 1]);
    CHECK(rep == 0);
    char small[8];
    CHECK(k3_random_id(small, sizeof small, "call_", 24) && strlen(small) == 7); /* cut to fit */
}

/* A transfer's end that finds the other side gone says so in the words the
 * callers (and tests/pd.sh) look for, whichever way it learns it: a read
 * that meets the end, or a write that meets a closed or reset connection. */
K3_TEST(pd_wire_names_a_closed_peer_on_send_and_on_receive) {
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    close(sv[1]);
    k3_error e = {0};
    const char hdr[8] = "kvheader";
    CHECK(k3_pd_send(sv[0], hdr, sizeof hdr, NULL, 0, "the request", &e) == K3_ERR_IO);
    CHECKF(strstr(e.msg, "the peer closed the connection while sending the request"), "%s", e.msg);
    char buf[8];
    e = (k3_error){0};
    CHECK(k3_pd_recv(sv[0], buf, sizeof buf, "the answer", &e) == K3_ERR_IO);
    CHECKF(strstr(e.msg, "the peer closed the connection"), "%s", e.msg);
    close(sv[0]);
}
