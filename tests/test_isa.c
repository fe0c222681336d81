/* test_isa.c -- the whole model on each kernel ISA the CPU has (k3_set_isa):
 * the 8-bit mode (W8A8 + W4A8, C8 cache) gives the same logits bit for bit
 * with AVX2's plain and AVX-VNNI integer kernels, logits close to the other
 * fp32-activation ISAs', and within the BF16 rounding of its matrices left
 * as stored (the head) on the BF16 dot products ("avx512" where the CPU has
 * AVX512_BF16). Each model is quantized and copied into RAM after the ISA is
 * set, as the CLI does (the resident layout depends on it). */
#include <stdlib.h>
#include <string.h>

#include "k3.h"
#include "kernels/kernels.h"
#include "test.h"

enum { N = 21 };

/* Logits of N tokens of tiny-dsa, quantized, on ISA name; NULL if the CPU
 * lacks it. */
static float *logits_on(const char *isa, int64_t *V) {
    k3_error err = {0};
    if (k3_set_isa(isa, &err) != K3_OK) {
        CHECKF(err.status == K3_ERR_UNSUPPORTED, "%s: %s", isa, err.msg);
        printf("    (%s: %s; not run)\n", isa, err.msg);
        return NULL;
    }
    k3_model *m = NULL;
    k3_quant_options qo;
    k3_pool *pool = NULL;
    k3_ctx *ctx = NULL;
    float *lg = NULL;
    int64_t copied = 0;
    if (k3_quant_parse("w8a8+w4a8", &qo, &err) || k3_model_open(&m, "tests/models/tiny-dsa", &err) ||
        k3_model_quantize(m, &qo, &err) || k3_model_load_resident(m, 0, &copied, &err) || k3_pool_init(&pool, 2, &err))
        goto out;
    k3_model_info info;
    k3_model_get_info(m, &info);
    *V = info.vocab_size;
    k3_ctx_options o = {.max_seqs = 1, .cache_tokens = 64, .block_size = 16, .pool = pool, .kv_cache = K3_KV_C8};
    if (k3_ctx_init(&ctx, m, &o, &err)) goto out;
    int32_t ids[N];
    unsigned seed = 9;
    for (int i = 0; i < N; i++) {
        seed = seed * 1103515245u + 12345u;
        ids[i] = (int32_t)((seed >> 8) % (unsigned)*V);
    }
    lg = malloc(sizeof(float) * (size_t)(*V * N));
    k3_batch_seq b = {0, N, ids};
    if (k3_ctx_forward(ctx, &b, 1, K3_LOGITS_ALL, lg, &err)) {
        free(lg);
        lg = NULL;
    }
out:
    if (!lg) CHECKF(0, "%s: %s", isa, err.msg);
    k3_ctx_free(ctx);
    k3_pool_free(pool);
    k3_model_close(m);
    return lg;
}

K3_TEST(isa_set_names) {
    k3_error err = {0};
    CHECK(k3_set_isa("ref", &err) == K3_OK && !strcmp(k3_isa_current(), "ref"));
    CHECK(k3_set_isa("sse9", &err) == K3_ERR_ARG && strstr(err.msg, "sse9"));
    CHECK(k3_set_isa(NULL, &err) == K3_OK);
    if (k3_kernels_have(K3_ISA_AVX2)) {
        CHECK(k3_set_isa("avx2-novnni", &err) == K3_OK && !strcmp(k3_isa_current(), "avx2"));
        CHECK(!k3_kernels_avxvnni());
    }
    if (k3_kernels_have(K3_ISA_AVX512)) {
        CHECK(k3_set_isa("avx512-nobf16", &err) == K3_OK && !strcmp(k3_isa_current(), "avx512") && !k3_kernels_bf16());
        if (k3_set_isa("avx512-bf16", &err) == K3_OK) {
            CHECK(!strcmp(k3_isa_current(), "avx512-bf16") && k3_kernels_bf16());
            CHECK(k3_set_isa("avx512", &err) == K3_OK && !strcmp(k3_isa_current(), "avx512-bf16"));
        } else {
            CHECK(err.status == K3_ERR_UNSUPPORTED && strstr(err.msg, "AVX512_BF16"));
        }
    }
    CHECK(k3_set_isa("best", &err) == K3_OK);
}

K3_TEST(isa_quantized_model_on_each_path) {
    int64_t V = 0;
    float *ref = logits_on("ref", &V), *a2 = logits_on("avx2", &V), *a2p = logits_on("avx2-novnni", &V);
    float *a5 = logits_on("avx512-nobf16", &V), *a5b = NULL;
    if (k3_kernels_have(K3_ISA_AVX512) && k3_set_isa("avx512-bf16", NULL) == K3_OK) a5b = logits_on("avx512-bf16", &V);
    const int64_t n = V * N;
    if (a2 && a2p) CHECKF(memcmp(a2, a2p, sizeof(float) * (size_t)n) == 0, "AVX2: AVX-VNNI and plain logits differ");
    if (ref && a2) {
        const double e = k3_test_rel_l2(a2, ref, n);
        printf("    avx2 vs ref: rel-L2 %.3g\n", e);
        CHECKF(e < 1e-4, "avx2 vs ref: rel-L2 %.3g", e);
    }
    if (a5 && a2) {
        const double e = k3_test_rel_l2(a2, a5, n);
        printf("    avx2 vs avx512-nobf16: rel-L2 %.3g\n", e);
        CHECKF(e < 1e-4, "avx2 vs avx512-nobf16: rel-L2 %.3g", e);
    }
    if (a5b && a5) {
        /* the head (and any BF16 matrix the mode leaves) with BF16
         * activations: ~2^-9 a product, ~2e-3 here */
        const double e = k3_test_rel_l2(a5b, a5, n);
        printf("    avx512-bf16 vs avx512-nobf16: rel-L2 %.3g\n", e);
        CHECKF(e < 1e-2, "avx512-bf16 vs avx512-nobf16: rel-L2 %.3g", e);
    }
    k3_error err = {0};
    k3_set_isa("best", &err);
    free(ref);
    free(a2);
    free(a2p);
    free(a5);
    free(a5b);
}
