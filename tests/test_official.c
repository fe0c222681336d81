/* test_official.c -- k3 against Moonshot's own K3 code: tiny checkpoints
 * built by the official classes with their own initialization and saved by
 * their own save_pretrained (tests/models/official-tiny, and -mxfp4 with the
 * routed experts in compressed-tensors MXFP4), and the official fp32 logits
 * and greedy tokens (tests/golden/official/, tools/official_model_goldens.py).
 *
 * The fp32 path (--quant f32, f32 cache) must be within rel-L2 1e-5 with
 * every top-1 and the same greedy tokens; the default mode (cli/cli.h: the
 * BF16 dot products where the CPU has them) within rel-L2 2e-2 with every
 * top-1, and on the AMX tiles the same bits as on the AVX-512 BF16 kernels.
 * Also: the router renormalizes only when top_k > 1 (KimiMoEGate). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../cli/cli.h"
#include "ctx/ctx.h"
#include "k3.h"
#include "model/safetensors.h"
#include "kernels/kernels.h"
#include "kernels/amx.h"
#include "kernels/router.h"
#include "kernels/kda.h"
#include "test.h"

typedef struct golden {
    int n, n_greedy;
    int32_t *ids, *greedy;
    float *logits; /* [n, vocab] */
    int64_t vocab;
} golden;

static bool read_golden(const char *path, golden *g) {
    memset(g, 0, sizeof *g);
    FILE *f = fopen(path, "rb");
    if (!f) {
        k3_test_fail(__FILE__, __LINE__, "cannot open %s (see tests/golden/official/README.md)", path);
        return false;
    }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(size > 0 ? (size_t)size : 1);
    bool ok = buf && size > 0 && fread(buf, 1, (size_t)size, f) == (size_t)size;
    fclose(f);
    k3_st *st = NULL;
    k3_error err = {0};
    ok = ok && k3_st_init(&st, &err) == K3_OK && k3_st_parse(st, buf, (size_t)size, 0, path, &err) == K3_OK;
    const k3_st_tensor *ti = ok ? k3_st_get(st, "ids") : NULL, *tl = ok ? k3_st_get(st, "logits") : NULL,
                       *tg = ok ? k3_st_get(st, "greedy") : NULL;
    ok = ti && tl && tg && ti->dtype == K3_DTYPE_I32 && tg->dtype == K3_DTYPE_I32 && tl->dtype == K3_DTYPE_F32 &&
        tl->ndim == 2 && tl->shape[0] == ti->shape[0];
    if (ok) {
        g->n = (int)ti->shape[0];
        g->n_greedy = (int)tg->shape[0];
        g->vocab = tl->shape[1];
        g->ids = malloc(ti->nbytes);
        g->greedy = malloc(tg->nbytes);
        g->logits = malloc(tl->nbytes);
        ok = g->ids && g->greedy && g->logits;
    }
    if (ok) {
        memcpy(g->ids, ti->data, ti->nbytes);
        memcpy(g->greedy, tg->data, tg->nbytes);
        memcpy(g->logits, tl->data, tl->nbytes);
    } else {
        k3_test_fail(__FILE__, __LINE__, "%s: expected ids, logits, greedy (%s)", path, err.msg);
    }
    if (st) k3_st_close(st);
    free(buf);
    return ok;
}

static void golden_free(golden *g) {
    free(g->ids);
    free(g->greedy);
    free(g->logits);
}

static int argmax(const float *x, int64_t n) {
    int a = 0;
    for (int64_t j = 1; j < n; j++)
        if (x[j] > x[a]) a = (int)j;
    return a;
}

typedef struct result {
    double rel_l2;
    int top1, greedy_ok;
} result;

/* Logits of every position in one forward pass (kept in *keep when keep is
 * not NULL), and the greedy continuation decoded token by token. kda_bf_min >
 * 0: KDA's BF16 chunked form (kda.h) from pieces that long. */
static bool run_mode_bf(const char *dir, const char *quant, k3_kv_type kv, const golden *g, result *r, float **keep,
                        int32_t kda_bf_min) {
    k3_model *m = NULL;
    k3_ctx *ctx = NULL;
    k3_error err = {0};
    k3_quant_options q;
    float *lg = malloc(sizeof(float) * (size_t)(g->n * g->vocab));
    bool ok = lg && k3_quant_parse(quant, &q, &err) == K3_OK && k3_model_open(&m, dir, &err) == K3_OK &&
        k3_model_quantize(m, &q, &err) == K3_OK;
    k3_ctx_options o = {.max_seqs = 1, .cache_tokens = 64, .block_size = 16, .kv_cache = kv};
    ok = ok && k3_ctx_init(&ctx, m, &o, &err) == K3_OK;
    if (ok && kda_bf_min > 0) ctx->kda_bf_min = kda_bf_min;
    k3_batch_seq b = {0, g->n, g->ids};
    ok = ok && k3_ctx_forward(ctx, &b, 1, K3_LOGITS_ALL, lg, &err) == K3_OK;
    if (ok) {
        r->rel_l2 = k3_test_rel_l2(lg, g->logits, g->n * g->vocab);
        r->top1 = 0;
        for (int t = 0; t < g->n; t++)
            r->top1 += argmax(lg + t * g->vocab, g->vocab) == argmax(g->logits + t * g->vocab, g->vocab);
        int32_t next = (int32_t)argmax(lg + (g->n - 1) * g->vocab, g->vocab);
        r->greedy_ok = 0;
        for (int i = 0; i < g->n_greedy && ok; i++) {
            if (next != g->greedy[i]) break;
            r->greedy_ok++;
            k3_batch_seq b1 = {0, 1, &next};
            ok = k3_ctx_forward(ctx, &b1, 1, K3_LOGITS_LAST, lg, &err) == K3_OK;
            next = (int32_t)argmax(lg, g->vocab);
        }
    }
    if (!ok) k3_test_fail(__FILE__, __LINE__, "%s (%s): %s", dir, quant, err.msg);
    if (keep && ok && (*keep = malloc(sizeof(float) * (size_t)(g->n * g->vocab)))) {
        /* the prompt's logits again: the greedy loop wrote over lg */
        k3_ctx_free(ctx);
        ctx = NULL;
        ok = k3_ctx_init(&ctx, m, &o, &err) == K3_OK;
        if (ok && kda_bf_min > 0) ctx->kda_bf_min = kda_bf_min;
        ok = ok && k3_ctx_forward(ctx, &b, 1, K3_LOGITS_ALL, *keep, &err) == K3_OK;
    }
    free(lg);
    k3_ctx_free(ctx);
    k3_model_close(m);
    return ok;
}

static bool run_mode_keep(const char *dir, const char *quant, k3_kv_type kv, const golden *g, result *r, float **keep) {
    return run_mode_bf(dir, quant, kv, g, r, keep, 0);
}

static bool run_mode(const char *dir, const char *quant, k3_kv_type kv, const golden *g, result *r) {
    return run_mode_keep(dir, quant, kv, g, r, NULL);
}

static void check_variant(const char *name) {
    char dir[128], path[160];
    snprintf(dir, sizeof dir, "tests/models/%s", name);
    snprintf(path, sizeof path, "tests/golden/official/%s.safetensors", name);
    golden g;
    if (!read_golden(path, &g)) return;
    result r;
    if (run_mode(dir, "f32", K3_KV_F32, &g, &r)) {
        printf("    %s, fp32 path vs official fp32: rel-L2 %.3g, top-1 %d/%d, greedy %d/%d\n", name, r.rel_l2, r.top1,
               g.n, r.greedy_ok, g.n_greedy);
        CHECKF(r.rel_l2 <= 1e-5, "%s: fp32 rel-L2 %.3g > 1e-5", name, r.rel_l2);
        CHECKF(r.top1 == g.n, "%s: fp32 top-1 %d/%d", name, r.top1, g.n);
        CHECKF(r.greedy_ok == g.n_greedy, "%s: greedy %d/%d", name, r.greedy_ok, g.n_greedy);
    }
    const k3_kv_type kv = !strcmp(K3_DEFAULT_KV, "c8") ? K3_KV_C8 : K3_KV_F32;
    if (run_mode(dir, K3_DEFAULT_QUANT, kv, &g, &r)) {
        printf("    %s, default mode (%s, %s) vs official fp32: rel-L2 %.3g, top-1 %d/%d\n", name, K3_DEFAULT_QUANT,
               K3_DEFAULT_KV, r.rel_l2, r.top1, g.n);
        CHECKF(r.rel_l2 <= 2e-2, "%s: default mode rel-L2 %.3g > 2e-2", name, r.rel_l2);
        CHECKF(r.top1 == g.n, "%s: default mode top-1 %d/%d", name, r.top1, g.n);
    }
    /* the prompt's pieces are shorter than the form's minimum here: force
     * KDA's BF16 chunked form on every piece, the greedy tokens' too */
    if (k3_kda_bf_available() && run_mode_bf(dir, K3_DEFAULT_QUANT, kv, &g, &r, NULL, 1)) {
        printf("    %s, default mode with KDA's BF16 chunked form (%s) vs official fp32: rel-L2 %.3g, top-1 %d/%d, "
               "greedy %d/%d\n",
               name, k3_isa_current(), r.rel_l2, r.top1, g.n, r.greedy_ok, g.n_greedy);
        CHECKF(r.rel_l2 <= 2e-2, "%s: BF16 KDA rel-L2 %.3g > 2e-2", name, r.rel_l2);
        CHECKF(r.top1 == g.n, "%s: BF16 KDA top-1 %d/%d", name, r.top1, g.n);
        CHECKF(r.greedy_ok == g.n_greedy, "%s: BF16 KDA greedy %d/%d", name, r.greedy_ok, g.n_greedy);
    }
    golden_free(&g);
}

K3_TEST(official_tiny_bf16) { check_variant("official-tiny"); }

K3_TEST(official_tiny_mxfp4) { check_variant("official-tiny-mxfp4"); }

/* k3_ctx_options.kda_bf16_prefill reaches the context: the table's minimum
 * piece where the model runs the BF16 dot products and the table has a
 * form worth taking, never otherwise (off by default, the fp32 path never). */
K3_TEST(official_kda_bf16_prefill_option) {
    k3_error err = {0};
    static const char *const quants[] = {K3_DEFAULT_QUANT, "f32"};
    for (int qi = 0; qi < 2; qi++) {
        k3_model *m = NULL;
        k3_quant_options q;
        REQUIRE(k3_quant_parse(quants[qi], &q, &err) == K3_OK);
        REQUIRE(k3_model_open(&m, "tests/models/official-tiny", &err) == K3_OK);
        REQUIRE(k3_model_quantize(m, &q, &err) == K3_OK);
        for (int on = 0; on < 2; on++) {
            k3_ctx *ctx = NULL;
            k3_ctx_options o = {.max_seqs = 1, .cache_tokens = 64, .kda_bf16_prefill = on};
            REQUIRE(k3_ctx_init(&ctx, m, &o, &err) == K3_OK);
            const int32_t want = on && qi == 0 ? k3_kda_bf_min() : INT32_MAX;
            CHECKF(ctx->kda_bf_min == want, "--quant %s, asked %d: kda_bf_min %d, want %d (%s)", quants[qi], on,
                   ctx->kda_bf_min, want, k3_isa_current());
            k3_ctx_free(ctx);
        }
        k3_model_close(m);
    }
    if (k3_kda_bf_available() && !strcmp(k3_isa_current(), "amx"))
        CHECKF(k3_kda_bf_min() == K3_KDA_BF_MIN_AMX, "amx: minimum %d", k3_kda_bf_min());
}

K3_TEST(official_router_top1_not_renormalized) {
    /* KimiMoEGate: top_k == 1 keeps the raw score (times the scaling);
     * top_k > 1 divides by the sum of the chosen scores. */
    float logits[4] = {0.5f, 2.0f, -1.0f, 0.0f}, work[4], w[2];
    int32_t ids[2];
    k3_router_cfg rc = {.n_experts = 4,
                        .top_k = 1,
                        .sigmoid = true,
                        .renormalize = true,
                        .scaling = 2.0f,
                        .n_group = 1,
                        .topk_group = 1};
    k3_router_select(&rc, logits, NULL, ids, w, work);
    CHECK(ids[0] == 1);
    CHECKF(fabsf(w[0] - 2.0f / (1.0f + expf(-2.0f))) < 1e-6f, "top-1 weight %g", w[0]);
    float logits2[4] = {0.5f, 2.0f, -1.0f, 0.0f};
    rc.top_k = 2;
    k3_router_select(&rc, logits2, NULL, ids, w, work);
    CHECK(ids[0] == 1 && ids[1] == 0);
    CHECKF(fabsf(w[0] + w[1] - 2.0f) < 1e-5f, "top-2 weights %g + %g", w[0], w[1]);
}

/* The "amx" kernel table (on the unit where the CPU has it, else with the
 * tile instructions emulated): the default mode's prompt on the tiles (its
 * products of 16 rows and more) gives the same logits, bit for bit, as on
 * "avx512-bf16" (the same products on vdpbf16ps) where KDA takes the same
 * form on both -- the recurrent one, and its BF16 chunked form (on every
 * piece) where both tables have it -- within the default mode's bounds of
 * the official fp32 logits, with the official greedy tokens. By default
 * "amx" on the unit takes the BF16 form from pieces of K3_KDA_BF_MIN_AMX
 * tokens and "avx512-bf16" keeps the recurrence, so the defaults are held to
 * the bounds only. */
static void check_variant_amx(const char *name) {
    k3_error err = {0};
    if (k3_set_isa("avx512-bf16", &err) != K3_OK) {
        printf("    (%s on AMX not run: %s)\n", name, err.msg);
        return;
    }
    char dir[128], path[160];
    snprintf(dir, sizeof dir, "tests/models/%s", name);
    snprintf(path, sizeof path, "tests/golden/official/%s.safetensors", name);
    golden g;
    if (!read_golden(path, &g)) return;
    const k3_kv_type kv = !strcmp(K3_DEFAULT_KV, "c8") ? K3_KV_C8 : K3_KV_F32;
    /* KDA: the recurrent form, the BF16 chunked form on every piece, the table's default */
    static const int32_t mins[3] = {INT32_MAX, 1, 0};
    static const char *forms[3] = {"KDA recurrent", "KDA BF16 chunked", "default KDA"};
    for (int f = 0; f < 3; f++) {
        result r, ra;
        float *lv = NULL, *la = NULL;
        CHECK(k3_set_isa("avx512-bf16", &err) == K3_OK);
        const bool bf_v = k3_kda_bf_available();
        if (f == 1 && !bf_v) continue;
        if (run_mode_bf(dir, K3_DEFAULT_QUANT, kv, &g, &r, &lv, mins[f])) {
            if (k3_set_isa("amx", &err) != K3_OK) {
                if (!k3_kernels_force_amx_emulated())
                    printf("    (%s on AMX not run: no emulation on this CPU)\n", name);
                else if (f == 0) printf("    (AMX unit not tested: %s; the emulated tiles run)\n", err.msg);
            }
            const bool run = !strcmp(k3_isa_current(), "amx") && (f != 1 || k3_kda_bf_available());
            if (run && run_mode_bf(dir, K3_DEFAULT_QUANT, kv, &g, &ra, &la, mins[f]) && lv && la) {
                const bool same = !memcmp(lv, la, sizeof(float) * (size_t)(g.n * g.vocab));
                printf("    %s, default mode, %s, on %s (%s) vs official fp32: rel-L2 %.3g, top-1 %d/%d, greedy "
                       "%d/%d; logits %s avx512-bf16's\n",
                       name, forms[f], k3_isa_current(), k3_amx_backend(), ra.rel_l2, ra.top1, g.n, ra.greedy_ok,
                       g.n_greedy, same ? "=" : "!=");
                if (f < 2) CHECKF(same, "%s (%s): the logits on amx differ from avx512-bf16's", name, forms[f]);
                CHECKF(ra.rel_l2 <= 2e-2, "%s on amx: rel-L2 %.3g > 2e-2", name, ra.rel_l2);
                CHECKF(ra.top1 == g.n, "%s on amx: top-1 %d/%d", name, ra.top1, g.n);
                CHECKF(ra.greedy_ok == g.n_greedy, "%s on amx: greedy %d/%d", name, ra.greedy_ok, g.n_greedy);
            }
        }
        free(lv);
        free(la);
    }
    golden_free(&g);
    CHECK(k3_set_isa(NULL, &err) == K3_OK);
}

K3_TEST(official_tiny_amx) {
    check_variant_amx("official-tiny");
    check_variant_amx("official-tiny-mxfp4");
}
