/*
 * test_spec_ctx.c -- the context's side of verifying drafts (ctx.h,
 * "verifying drafts"): a verify chunk of the last token and k drafts, then
 * the accept of its first n_keep positions, against a context that decoded
 * only those tokens one by one:
 *   - on the exact path (fp32 cache, weights as stored, --isa avx512 where
 *     the CPU has it: the path whose products do not depend on how many
 *     rows share them) every chunk row's logits and the KDA state after the
 *     accept equal the decode's bit for bit, for every n_keep and both ways
 *     of keeping (REAPPLY, STATES), and decoding on from there too;
 *   - on any kernel table, a marked chunk gives the logits of the same chunk
 *     unmarked, and accepting all of it gives its state;
 *   - misuse is refused with a message.
 */
#include <stdlib.h>
#include <string.h>

#include "ctx/ctx.h"
#include "forward/forward.h"
#include "kernels/kernels.h"
#include "model/model.h"
#include "k3.h"
#include "test.h"

enum { NP = 21, K = 5, NP_LONG = 700 };

/* Two slots of 1024 tokens each. */
static k3_ctx *pool_ctx(const k3_model *m, k3_pool *pool, k3_kv_type kv) {
    k3_ctx *c = NULL;
    k3_error err = {0};
    k3_ctx_options o =
        {.max_seqs = 2, .cache_tokens = 2048, .block_size = 16, .max_batch = 256, .pool = pool, .kv_cache = kv};
    if (k3_ctx_init_pool(&c, m, &o, 128, 1024, &err)) k3_test_fail(__FILE__, __LINE__, "%s", err.msg);
    return c;
}

/* Sets slot s of c up with its 64 blocks, position 0, zero state. */
static void slot_up(k3_ctx *c, int32_t s) {
    int32_t blk[64];
    for (int i = 0; i < 64; i++) blk[i] = 64 * s + i;
    k3_ctx_seq_set_blocks(c, s, blk, 64, NULL);
    k3_ctx_seq_set_pos(c, s, 0);
    k3_ctx_seq_clear_state(c, s);
}

static k3_status run1(k3_ctx *c, int32_t s, const int32_t *ids, int32_t n, uint8_t want, float *lg) {
    k3_batch_seq b = {s, n, ids, NULL};
    k3_error err = {0};
    const k3_status st = k3_ctx_run(c, &b, 1, &want, lg, &err);
    if (st) k3_test_fail(__FILE__, __LINE__, "run: %s", err.msg);
    return st;
}

static bool same_state(const k3_ctx *a, int32_t sa, const k3_ctx *b, int32_t sb) {
    const int64_t n = k3_ctx_state_bytes(a);
    char *x = malloc((size_t)n), *y = malloc((size_t)n);
    k3_ctx_state_save(a, sa, x);
    k3_ctx_state_save(b, sb, y);
    const bool same = !memcmp(x, y, (size_t)n);
    free(x);
    free(y);
    return same;
}

/* ids: a prompt of NP, then the last token and K drafts (K + 1 rows). On
 * the exact path: for each n_keep and mode, the chunk's rows and the state
 * after the accept against one-by-one decoding, then one more token. */
static void exact_against_decode_m(k3_model *m, const char *dir, k3_kv_type kv, int np);

static void exact_against_decode(const char *dir, k3_kv_type kv, int np) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(k3_model_open(&m, dir, &err) == K3_OK, "%s", err.msg);
    exact_against_decode_m(m, dir, kv, np);
}

static void exact_against_decode_m(k3_model *m, const char *dir, k3_kv_type kv, int np) {
    k3_error err = {0};
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    const int64_t V = m->cfg.vocab_size;
    int32_t ids[NP_LONG + K + 2];
    for (int i = 0; i < np + K + 2; i++) ids[i] = (int32_t)((i * 7919 + 13) % V);
    k3_ctx *ref = pool_ctx(m, pool, kv), *c = pool_ctx(m, pool, kv);
    REQUIRE(ref && c);
    float *dec = malloc(sizeof(float) * (size_t)(V * (K + 2))), *lg = malloc(sizeof(float) * (size_t)(V * (K + 1)));
    float *one = malloc(sizeof(float) * (size_t)V);
    const int64_t sb = k3_ctx_state_bytes(ref);
    char *states = malloc((size_t)(sb * (K + 3)));
    REQUIRE(dec && lg && one && states);
    /* the reference: the prompt, then every later token decoded alone */
    slot_up(ref, 0);
    REQUIRE(run1(ref, 0, ids, np, K3_WANT_NONE, NULL) == K3_OK);
    k3_ctx_state_save(ref, 0, states);
    for (int j = 0; j < K + 2; j++) {
        REQUIRE(run1(ref, 0, ids + np + j, 1, K3_WANT_LAST, dec + j * V) == K3_OK);
        k3_ctx_state_save(ref, 0, states + (j + 1) * sb);
    }
    int bad_rows = 0, bad_states = 0, bad_after = 0;
    for (int mode = K3_SPEC_REAPPLY; mode <= K3_SPEC_STATES; mode++)
        for (int keep = 0; keep <= K + 1; keep++) {
            slot_up(c, 1);
            REQUIRE(run1(c, 1, ids, np, K3_WANT_NONE, NULL) == K3_OK);
            REQUIREF(k3_ctx_spec_begin(c, 1, K + 1, mode, &err) == K3_OK, "%s", err.msg);
            REQUIRE(run1(c, 1, ids + np, K + 1, K3_WANT_ALL, lg) == K3_OK);
            bad_rows += memcmp(lg, dec, sizeof(float) * (size_t)(V * (K + 1))) != 0;
            REQUIREF(k3_ctx_spec_accept(c, 1, keep, &err) == K3_OK, "%s", err.msg);
            CHECK(k3_ctx_seq_pos(c, 1) == np + keep);
            char *got = malloc((size_t)sb);
            k3_ctx_state_save(c, 1, got);
            bad_states += memcmp(got, states + keep * sb, (size_t)sb) != 0;
            free(got);
            /* decoding on from the kept positions: the token after them */
            REQUIRE(run1(c, 1, ids + np + keep, 1, K3_WANT_LAST, one) == K3_OK);
            bad_after += memcmp(one, dec + keep * V, sizeof(float) * (size_t)V) != 0;
        }
    CHECKF(!bad_rows && !bad_states && !bad_after,
           "%s (%s, %d-token prompt, isa %s): of 2 x %d accepts, %d chunks' rows, %d states and %d next tokens differ "
           "from decoding "
           "the kept tokens one by one",
           dir, kv == K3_KV_C8 ? "c8" : "f32", np, k3_isa_current(), K + 2, bad_rows, bad_states, bad_after);
    free(states);
    free(dec);
    free(lg);
    free(one);
    k3_ctx_free(ref);
    k3_ctx_free(c);
    k3_pool_free(pool);
    k3_model_close(m);
}

/* The exact path is AVX-512 (the CPUs of this project have it); where the CPU
 * lacks it, AVX2's table keeps the same row invariance. */
static bool exact_isa(void) {
    k3_error err = {0};
    if (k3_set_isa("avx512", &err) == K3_OK) return true;
    return k3_set_isa("avx2", &err) == K3_OK;
}

K3_TEST(spec_kda_rollback_bit_exact) {
    char prev[32];
    snprintf(prev, sizeof prev, "%s", k3_isa_current());
    if (!exact_isa()) {
        printf("skip spec_kda_rollback_bit_exact: no AVX-512 or AVX2 here\n");
        return;
    }
    exact_against_decode("tests/models/tiny", K3_KV_F32, NP);
    exact_against_decode("tests/models/tiny-dsa", K3_KV_F32, NP);
    exact_against_decode("tests/models/tiny-dsa", K3_KV_C8, NP);
    exact_against_decode("models/k3-mini", K3_KV_F32, NP);
    /* past 512 cached keys a decode row's attention is split over the
     * threads and merged by log-sum-exp: the chunk's rows must be too */
    exact_against_decode("tests/models/tiny", K3_KV_F32, NP_LONG);
    exact_against_decode("tests/models/tiny-dsa", K3_KV_C8, NP_LONG);
    k3_set_isa(prev, NULL); /* the table the suite ran on before */
}

/* QSFA's BF16 form (the default mode's attention over the C8 cache on
 * models of 8+ heads: tiles or vdpbf16ps, one token a call) on the small
 * checkpoints with their 2-4 heads let in: the verify chunk's rows, the state
 * after every accept and the next token equal decoding one by one, bit for
 * bit, below and past the 512 keys where a row's attention is split over the
 * threads; on each BF16 table the CPU has. */
K3_TEST(spec_qsfa_bf16_bit_exact) {
    char prev[32];
    snprintf(prev, sizeof prev, "%s", k3_isa_current());
    const char *tables[] = {"avx512", "amx"};
    int ran = 0;
    for (int t = 0; t < 2; t++) {
        k3_error err = {0};
        if (k3_set_isa(tables[t], &err) != K3_OK || !k3_kernels_bf16()) continue;
        const char *dirs[] = {"tests/models/tiny-dsa", "tests/models/tiny"};
        for (int d = 0; d < 2; d++)
            for (int np = NP; np <= NP_LONG; np += NP_LONG - NP) {
                k3_model *m = NULL;
                k3_quant_options q;
                REQUIREF(k3_quant_parse("none", &q, &err) == K3_OK && k3_model_open(&m, dirs[d], &err) == K3_OK &&
                             k3_model_quantize(m, &q, &err) == K3_OK,
                         "%s", err.msg);
                REQUIREF(m->qsfa_bf16_heads > 0, "%s on %s: the BF16 mode did not mark the model", dirs[d],
                         k3_isa_current());
                m->qsfa_bf16_heads = 1;
                exact_against_decode_m(m, dirs[d], K3_KV_C8, np);
            }
        ran++;
    }
    k3_set_isa(prev, NULL);
    if (!ran) SKIP("no BF16 dot-product table on this CPU (AVX512_BF16)");
}

/* On the default kernel table: a marked chunk is the unmarked chunk (same
 * rows, same products), and keeping all of it keeps its state; keeping a
 * part equals running that part unmarked as a chunk of its own only where
 * the table's products do not depend on the rows (not asserted here). */
K3_TEST(spec_verify_chunk_equals_plain_chunk) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(k3_model_open(&m, "tests/models/tiny-dsa", &err) == K3_OK, "%s", err.msg);
    const int64_t V = m->cfg.vocab_size;
    int32_t ids[NP + K + 1];
    for (int i = 0; i < NP + K + 1; i++) ids[i] = (int32_t)((i * 31 + 5) % V);
    k3_ctx *c = pool_ctx(m, NULL, K3_KV_F32);
    REQUIRE(c);
    float *a = malloc(sizeof(float) * (size_t)(V * (K + 1))), *b = malloc(sizeof(float) * (size_t)(V * (K + 1)));
    REQUIRE(a && b);
    slot_up(c, 0);
    slot_up(c, 1);
    REQUIRE(run1(c, 0, ids, NP, K3_WANT_NONE, NULL) == K3_OK);
    REQUIRE(run1(c, 1, ids, NP, K3_WANT_NONE, NULL) == K3_OK);
    REQUIRE(run1(c, 0, ids + NP, K + 1, K3_WANT_ALL, a) == K3_OK);
    const int64_t sb = k3_ctx_state_bytes(c);
    char *before = malloc((size_t)sb), *after = malloc((size_t)sb);
    REQUIRE(before && after);
    k3_ctx_state_save(c, 1, before);
    REQUIREF(k3_ctx_spec_begin(c, 1, K + 1, K3_SPEC_REAPPLY, &err) == K3_OK, "%s", err.msg);
    REQUIRE(run1(c, 1, ids + NP, K + 1, K3_WANT_ALL, b) == K3_OK);
    CHECK(!memcmp(a, b, sizeof(float) * (size_t)(V * (K + 1))));
    k3_ctx_state_save(c, 1, after); /* the slot's state is not touched until the accept */
    CHECK(!memcmp(before, after, (size_t)sb));
    free(before);
    free(after);
    REQUIREF(k3_ctx_spec_accept(c, 1, K + 1, &err) == K3_OK, "%s", err.msg);
    CHECKF(same_state(c, 0, c, 1), "accepting a whole chunk (isa %s) does not give the chunk's state",
           k3_isa_current());

    /* misuse */
    k3_err_clear(&err);
    CHECK(k3_ctx_spec_accept(c, 1, 1, &err) == K3_ERR_ARG && strstr(err.msg, "no verify chunk"));
    CHECK(k3_ctx_spec_begin(c, 1, 0, K3_SPEC_REAPPLY, &err) == K3_ERR_RANGE);
    CHECK(k3_ctx_spec_begin(c, 1, K3_CTX_SPEC_MAX + 1, K3_SPEC_REAPPLY, &err) == K3_ERR_RANGE);
    CHECK(k3_ctx_spec_begin(c, 1, 3, 7, &err) == K3_ERR_ARG);
    CHECK(k3_ctx_spec_begin(c, 5, 3, K3_SPEC_REAPPLY, &err) == K3_ERR_ARG);
    REQUIRE(k3_ctx_spec_begin(c, 1, 3, K3_SPEC_REAPPLY, &err) == K3_OK);
    k3_err_clear(&err);
    CHECK(k3_ctx_spec_accept(c, 1, 1, &err) == K3_ERR_ARG && strstr(err.msg, "was not run"));
    {
        k3_batch_seq bs = {1, 2, ids, NULL};
        uint8_t want = K3_WANT_LAST;
        k3_err_clear(&err);
        CHECK(k3_ctx_run(c, &bs, 1, &want, a, &err) == K3_ERR_ARG && strstr(err.msg, "verify chunk"));
    }
    REQUIRE(run1(c, 1, ids, 3, K3_WANT_LAST, a) == K3_OK);
    CHECK(k3_ctx_spec_accept(c, 1, 4, &err) == K3_ERR_RANGE);
    CHECK(k3_ctx_spec_accept(c, 1, 2, &err) == K3_OK);
    k3_ctx_seq_clear_state(c, 1); /* a cleared slot forgets a mark */
    REQUIRE(k3_ctx_spec_begin(c, 1, 2, K3_SPEC_REAPPLY, &err) == K3_OK);
    k3_ctx_seq_clear_state(c, 1);
    CHECK(k3_ctx_spec_accept(c, 1, 1, &err) == K3_ERR_ARG);
    CHECK(k3_ctx_spec_bytes(c, 5, K3_SPEC_REAPPLY) > 0 &&
          k3_ctx_spec_bytes(c, 5, K3_SPEC_STATES) > k3_ctx_spec_bytes(c, 5, K3_SPEC_REAPPLY));
    free(a);
    free(b);
    k3_ctx_free(c);
    k3_model_close(m);
}

/* Two captures of one slot at one position (a prefix-cache snapshot and a
 * decode instance's hold where a prompt ends on the block grid) both get
 * the state: the pass used to fill only the first asked. */
K3_TEST(ctx_two_captures_at_one_position) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(k3_model_open(&m, "tests/models/tiny", &err) == K3_OK, "%s", err.msg);
    const int64_t V = m->cfg.vocab_size;
    int32_t ids[32];
    for (int i = 0; i < 32; i++) ids[i] = (int32_t)((i * 131 + 7) % V);
    k3_ctx *c = pool_ctx(m, NULL, K3_KV_F32);
    REQUIRE(c);
    const int64_t sb = k3_ctx_state_bytes(c);
    char *a = calloc(1, (size_t)sb), *b = calloc(1, (size_t)sb), *want = malloc((size_t)sb);
    REQUIRE(a && b && want);
    slot_up(c, 0);
    REQUIRE(k3_ctx_capture_state(c, 0, 16, a, &err) == K3_OK);
    REQUIRE(k3_ctx_capture_state(c, 0, 16, b, &err) == K3_OK);
    REQUIRE(run1(c, 0, ids, 32, K3_WANT_NONE, NULL) == K3_OK);
    slot_up(c, 1);
    REQUIRE(run1(c, 1, ids, 16, K3_WANT_NONE, NULL) == K3_OK);
    k3_ctx_state_save(c, 1, want);
    /* the first KDA layer reads the embeddings alone: its state is the same
     * bits on any kernel table (later ones see products of 32 rows against
     * 16, which only the exact path keeps equal) */
    int L0 = 0;
    while (m->cfg.layer_kind[L0] != K3_LAYER_KDA) L0++;
    const size_t first = sizeof(float) * (size_t)(m->cfg.kda_heads * m->cfg.kda_head_dim * m->cfg.kda_head_dim);
    CHECK(!memcmp(a + c->kda_snap_off[L0] * 4, want + c->kda_snap_off[L0] * 4, first));
    CHECKF(!memcmp(a, b, (size_t)sb), "the second capture at position 16 was not filled");
    free(a);
    free(b);
    free(want);
    k3_ctx_free(c);
    k3_model_close(m);
}
