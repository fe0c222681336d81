/*
 * test_dist.c -- what of several processes needs no second one: the DCP
 * token layout (ctx.h) against brute force, the candidate order and merge
 * of the top-k exchange (src/comm) against a plain sort, the planner against the loaded
 * model's own figures, and the EP loader keeping only its experts. The
 * exchange over MPI itself, and the whole model under mpirun, are in
 * tests/mpi.sh.
 */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "comm/comm.h"
#include "ctx/ctx.h"
#include "k3.h"
#include "model/model.h"
#include "test.h"

#define TINY_DSA "tests/models/tiny-dsa"

K3_TEST(dist_dcp_layout_brute_force) {
    for (int D = 1; D <= 5; D++)
        for (int I = 1; I <= 4; I++) {
            const int bs = 4 * I; /* a multiple of I, as the context requires */
            int64_t seen[5] = {0};
            for (int64_t x = 0; x < 300; x++) {
                const int r = k3_dcp_owner(x, D, I);
                CHECK(r == ((x % (bs * D)) / I) % D); /* docs/serving-reference.md §2.5's form */
                const int64_t j = k3_dcp_local(x, D, I);
                CHECKF(j == seen[r], "D %d I %d x %lld: local %lld, expected %lld", D, I, (long long)x, (long long)j,
                       (long long)seen[r]);
                CHECK(k3_dcp_global(j, r, D, I) == x);
                seen[r]++;
                for (int q = 0; q < D; q++) CHECK(k3_dcp_count(x + 1, q, D, I) == seen[q]);
            }
        }
}

/* The DCP cache layout (ctx.h): a sequence's global block table indexes
 * every rank's cache; global block B holds, on each rank, bs/D slots: its own
 * tokens of positions [B*bs, (B+1)*bs) in order. Brute force over D, I, bs
 * and a scrambled block table: each position has exactly one owner, the
 * owner's slot lies in the block's bs/D slots, the slots of a rank are
 * distinct and fill its blocks exactly, and the j-th own token's slot is
 * k3_ctx_local_slot(j) (what the DCP attention reads). */
K3_TEST(dist_dcp_global_block_slots) {
    int32_t table[6] = {4, 1, 5, 0, 3, 2};
    k3_seq seq = {0, table, 6};
    for (int D = 1; D <= 4; D++)
        for (int I = 1; I <= 3; I++)
            for (int mult = 1; mult <= 2; mult++) {
                const int bs = D * I * 2 * mult, lbs = bs / D, n = 6 * bs;
                int owners[6 * 48] = {0};
                for (int r = 0; r < D; r++) {
                    k3_ctx ctx;
                    memset(&ctx, 0, sizeof ctx);
                    ctx.seqs = &seq;
                    ctx.block_size = bs;
                    ctx.lbs = lbs;
                    ctx.dcp = D;
                    ctx.dcp_rank = r;
                    ctx.dcp_il = I;
                    int used[6 * 48] = {0}; /* slots [0, 6*lbs) */
                    int64_t j = 0;
                    for (int64_t x = 0; x < n; x++) {
                        const int64_t slot = k3_ctx_own_slot(&ctx, 0, x);
                        if (slot < 0) {
                            CHECK(k3_dcp_owner(x, D, I) != r);
                            continue;
                        }
                        owners[x]++;
                        CHECK(k3_dcp_owner(x, D, I) == r);
                        const int64_t base = (int64_t)table[x / bs] * lbs;
                        CHECKF(slot >= base && slot < base + lbs, "D %d I %d bs %d x %lld: slot %lld outside block %d",
                               D, I, bs, (long long)x, (long long)slot, table[x / bs]);
                        CHECK(used[slot]++ == 0);
                        CHECK(k3_dcp_local(x, D, I) == j);
                        CHECK(k3_ctx_local_slot(&ctx, 0, j) == slot);
                        j++;
                    }
                    CHECK(j == 6 * lbs);
                    for (int i = 0; i < 6 * lbs; i++) CHECK(used[i] == 1);
                }
                for (int64_t x = 0; x < n; x++) CHECK(owners[x] == 1);
            }
}

static int cmp_plain(const void *pa, const void *pb) {
    const k3_cand *a = pa, *b = pb;
    if ((a->pos < 0) != (b->pos < 0)) return a->pos < 0 ? 1 : -1;
    const int na = a->score != a->score, nb = b->score != b->score;
    if (na != nb) return na ? 1 : -1;
    if (!na && a->score != b->score) return a->score > b->score ? -1 : 1;
    return (a->pos > b->pos) - (a->pos < b->pos);
}

K3_TEST(dist_candidate_merge_equals_sort) {
    uint64_t s = 99;
    for (int rep = 0; rep < 200; rep++) {
        const int k = 1 + rep % 17, na = rep % 13, nb = (rep * 7) % 11;
        k3_cand a[32], b[32], all[64], out[32];
        int n = 0;
        for (int i = 0; i < na + nb; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            const int v = (int)((s >> 33) % 5);
            all[n] = (k3_cand){v == 4 ? NAN : (float)v, i};
            if (i < na) a[i] = all[n];
            else b[i - na] = all[n];
            n++;
        }
        for (int i = na; i < 32; i++) a[i] = (k3_cand){-INFINITY, -1};
        for (int i = nb; i < 32; i++) b[i] = (k3_cand){-INFINITY, -1};
        k3_cand_sort(a, na);
        k3_cand_sort(b, nb);
        k3_cand_merge(a, b, k, out);
        qsort(all, (size_t)n, sizeof *all, cmp_plain);
        for (int i = 0; i < k; i++) {
            const int32_t want = i < n ? all[i].pos : -1;
            CHECKF(out[i].pos == want, "rep %d slot %d: %d, expected %d", rep, i, out[i].pos, want);
        }
    }
}

K3_TEST(dist_plan_matches_the_model) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(k3_model_open(&m, TINY_DSA, &err) == K3_OK, "%s", err.msg);
    k3_model_info info;
    k3_model_get_info(m, &info);
    k3_plan p;
    k3_plan_options o = {.dcp = 2, .ep = 4, .context = 1000, .kv_cache = K3_KV_F32};
    REQUIREF(k3_plan_compute(TINY_DSA "/config.json", &o, &p, &err) == K3_OK, "%s", err.msg);
    CHECK(p.cache_bytes_per_token == info.cache_bytes_per_token);
    CHECK(p.state_bytes_per_seq == info.state_bytes_per_seq);
    CHECK(p.expert_bytes == k3_model_expert_bytes(m));
    CHECKF(llabs(p.weight_bytes - info.weight_bytes) < info.weight_bytes / 50, "plan %lld, model %lld bytes",
           (long long)p.weight_bytes, (long long)info.weight_bytes);
    CHECK(p.cache_bytes_per_rank == p.cache_bytes_per_token * 500);
    CHECK(p.weight_bytes_per_rank == p.weight_bytes - p.expert_bytes + p.expert_bytes / 4);
    /* the formulas of docs/serving-reference.md §2.5 with k = 8, D = 2, 2 DSA layers */
    CHECK(p.n_dsa == 2 && p.topk_allgather_bytes == 2 * 1 * 8 * 8 && p.topk_butterfly_bytes == 2 * 1 * 8 * 8);
    /* C8 per token, as the context allocates it */
    o.kv_cache = K3_KV_C8;
    REQUIRE(k3_plan_compute(TINY_DSA "/config.json", &o, &p, &err) == K3_OK);
    k3_ctx *ctx = NULL;
    k3_ctx_options co = {.max_seqs = 1, .cache_tokens = 128, .kv_cache = K3_KV_C8};
    REQUIREF(k3_ctx_init(&ctx, m, &co, &err) == K3_OK, "%s", err.msg);
    CHECK(k3_ctx_cache_bytes(ctx) == p.cache_bytes_per_token * 128);
    k3_ctx_free(ctx);
    o.ep = 3;
    CHECK(k3_plan_compute(TINY_DSA "/config.json", &o, &p, &err) == K3_ERR_ARG && strstr(err.msg, "--ep 3"));
    k3_model_close(m);
}

K3_TEST(dist_ep_loader_keeps_own_experts) {
    k3_model *m = NULL, *m1 = NULL;
    k3_error err = {0};
    REQUIRE(k3_model_open(&m, TINY_DSA, &err) == K3_OK);
    REQUIREF(k3_model_open_ep(&m1, TINY_DSA, 1, 2, &err) == K3_OK, "%s", err.msg);
    CHECK(k3_model_expert_bytes(m1) * 2 == k3_model_expert_bytes(m));
    const k3_layer *L = &m1->layers[1];
    REQUIRE(L->moe);
    CHECK(!L->exp_gate[0].data && !L->exp_down[7].data); /* rank 0's */
    CHECK(L->exp_gate[8].data && L->exp_up[15].data && L->exp_down[15].data);
    int64_t copied = 0;
    CHECK(k3_model_load_resident(m1, 0, &copied, &err) == K3_OK);
    /* a context without the dist cannot use a model cut for EP */
    k3_ctx *ctx = NULL;
    k3_ctx_options co = {.max_seqs = 1, .cache_tokens = 16};
    CHECK(k3_ctx_init(&ctx, m1, &co, &err) == K3_ERR_ARG);
    k3_model_close(m1);
    m1 = NULL;
    k3_err_clear(&err);
    CHECK(k3_model_open_ep(&m1, TINY_DSA, 0, 3, &err) == K3_ERR_ARG && strstr(err.msg, "does not divide"));
    k3_err_clear(&err);
    CHECK(k3_model_open_ep(&m1, TINY_DSA, 0, 32, &err) == K3_ERR_ARG && strstr(err.msg, "more EP ranks than the 16"));
    k3_model_close(m);
}

/* The full-size K3 config against the sizes docs/model.md §2.4 states: routed
 * experts 92 x 896 x 17,547,264 B; 24 MLA layers; KDA state 69 layers x
 * (96 x 128 x 128 + 3 x 12288 x 3) x 4 B; and the traffic formulas of
 * docs/serving-reference.md §2.5 on the DSA variant at W = 16, k = 2048. */
K3_TEST(dist_plan_full_size_k3) {
    k3_plan p;
    k3_error err = {0};
    k3_plan_options o = {.dcp = 16, .ep = 64, .context = 1 << 20, .kv_cache = K3_KV_C8};
    REQUIREF(k3_plan_compute("docs/configs/kimi-k3.json", &o, &p, &err) == K3_OK, "%s", err.msg);
    CHECK(p.n_mla == 24 && p.n_kda == 69 && p.n_dsa == 0 && p.n_moe == 92);
    CHECK(p.expert_bytes == 92LL * 896 * 17547264);
    CHECK(p.state_bytes_per_seq == 69LL * (96 * 128 * 128 + 3 * 12288 * 3) * 4);
    CHECK(p.cache_bytes_per_token == 24 * (512 + 4 * 4 + 64 * 4)); /* C8 as k3 stores it */
    CHECK(p.cache_bytes_per_rank == p.cache_bytes_per_token * (1 << 16));
    CHECK(p.weight_bytes_per_rank == p.weight_bytes - p.expert_bytes + p.expert_bytes / 64);
    /* prefill -> decode: every row of the prompt and one KDA state; each of
     * the 16 decode ranks its 1/16 of the rows and the whole state */
    CHECK(p.pd_bytes_per_seq == p.cache_bytes_per_token * (1 << 20) + p.state_bytes_per_seq);
    CHECK(p.pd_bytes_per_rank == p.cache_bytes_per_token * (1 << 16) + p.state_bytes_per_seq);
    /* EP as the source rank of a row sees it: 16 results of 3,584 floats from the 63/64 remote
     * experts received; the latents and the combined row to 63 ranks sent; a step's collectives:
     * 2 LSE a MLA layer, 3 EP a MoE layer and the step's broadcast */
    CHECK(p.ep_source_recv_bytes == 92LL * 225792);
    CHECK(p.ep_source_sent_bytes == p.ep_dispatch_bytes + 92LL * 63 * 3584 * 4);
    CHECK(p.collectives_allgather == 24 * 2 + 92 * 3 + 1 && p.collectives_butterfly == p.collectives_allgather);
    REQUIREF(k3_plan_compute("docs/configs/kimi-k3.1-pro-dsa.json", &o, &p, &err) == K3_OK, "%s", err.msg);
    CHECK(p.n_dsa == 24);
    /* + the top-k exchange a DSA layer: one all-gather, or log2(16) butterfly steps */
    CHECK(p.collectives_allgather == 24 * 3 + 92 * 3 + 1 && p.collectives_butterfly == 24 * 6 + 92 * 3 + 1);
    CHECK(p.topk_allgather_bytes == 24LL * 15 * 2048 * 8); /* 240 KB per layer */
    CHECK(p.topk_butterfly_bytes == 24LL * 4 * 2048 * 8);  /* 64 KB per layer */
    o.ep = 3;                                              /* 896 = 2^7 x 7 */
    CHECK(k3_plan_compute("docs/configs/kimi-k3.json", &o, &p, &err) == K3_ERR_ARG);
}
