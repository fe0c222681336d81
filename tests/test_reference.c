/* test_reference.c -- k3 against implementations written by others, through
 * the small goldens of tests/golden/ref (made by tools/check_reference.py; see
 * the README there for the commands and the reference versions):
 *   - KDA gate, recurrent and chunked forms vs fla's naive_kda_gate /
 *     naive_kda_lowerbound_gate / naive_recurrent_kda / naive_chunk_kda;
 *   - the DSA indexer scores and top-k sets vs DeepSeek-V3.2's formula and
 *     transformers' DeepseekV32Indexer;
 *   - whole-model logits of a Kimi-Linear checkpoint written by transformers'
 *     save_pretrained vs transformers' own forward.
 * Goldens are safetensors files read with k3's parser; no Python needed. */
#include <stdlib.h>
#include <string.h>

#include "kernels/kda.h"
#include "kernels/mla.h"
#include "k3.h"
#include "model/safetensors.h"
#include "test.h"

/* ---- golden files -------------------------------------------------------- */

typedef struct golden {
    k3_st *st;
    uint8_t *buf; /* the whole file; tensors point into it */
    const char *path;
} golden;

static bool golden_open(golden *g, const char *rel) {
    memset(g, 0, sizeof *g);
    g->path = rel; /* tests run from the repo root */
    FILE *f = fopen(g->path, "rb");
    if (!f) {
        k3_test_fail(__FILE__, __LINE__, "cannot open %s (regenerate: see tests/golden/ref/README.md)", g->path);
        return false;
    }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    g->buf = malloc(size > 0 ? (size_t)size : 1);
    bool ok = g->buf && size > 0 && fread(g->buf, 1, (size_t)size, f) == (size_t)size;
    fclose(f);
    k3_error err = {0};
    if (ok)
        ok = k3_st_init(&g->st, &err) == K3_OK && k3_st_parse(g->st, g->buf, (size_t)size, 0, g->path, &err) == K3_OK;
    if (!ok) k3_test_fail(__FILE__, __LINE__, "cannot read %s: %s", g->path, err.msg);
    return ok;
}

static void golden_close(golden *g) {
    k3_st_close(g->st);
    free(g->buf);
}

/* An aligned copy of tensor `name` (caller frees), which must hold n values of
 * dtype dt; NULL (and a recorded failure) otherwise. */
static void *golden_get(const golden *g, const char *name, k3_dtype dt, int64_t n) {
    const k3_st_tensor *t = g->st ? k3_st_get(g->st, name) : NULL;
    if (!t || t->dtype != dt || t->nbytes != (size_t)n * k3_dtype_size(dt)) {
        k3_test_fail(__FILE__, __LINE__, "%s: tensor '%s' missing or not %s x %lld", g->path, name, k3_dtype_name(dt),
                     (long long)n);
        return NULL;
    }
    void *p = malloc(t->nbytes);
    if (p) memcpy(p, t->data, t->nbytes);
    return p;
}

static float *gf(const golden *g, const char *name, int64_t n) { return golden_get(g, name, K3_DTYPE_F32, n); }

/* ---- KDA vs fla ------------------------------------------------------------ */

enum { KDA_H = 2, KDA_K = 32, KDA_V = 32 };

/* Runs one form over every head: chunk = 0 is the recurrent form. o: [T, H, V]
 * (row-major, fla's layout), S: [H, K, V] in/out. */
static void kda_run(int T, const float *q, const float *k, const float *v, const float *g, const float *beta, float *o,
                    float *S, int chunk) {
    float *work = chunk ? malloc(sizeof(float) * (size_t)k3_kda_chunk_work(chunk, KDA_K, KDA_V)) : NULL;
    for (int h = 0; h < KDA_H; h++) {
        const int64_t hk = (int64_t)h * KDA_K, hv = (int64_t)h * KDA_V;
        k3_kda_head kh = {T,      KDA_K,         KDA_V,    q + hk, k + hk, g + hk,       KDA_H * KDA_K,
                          v + hv, KDA_H * KDA_V, beta + h, KDA_H,  o + hv, KDA_H * KDA_V};
        float *Sh = S + (int64_t)h * KDA_K * KDA_V;
        if (chunk) k3_kda_chunked(&kh, Sh, chunk, work);
        else k3_kda_recurrent(&kh, Sh);
    }
    free(work);
}

K3_TEST(reference_kda_fla) {
    golden G;
    if (!golden_open(&G, "tests/golden/ref/kda.safetensors")) return;
    float *lbp = gf(&G, "lower_bound", 1);
    const float lb = lbp ? *lbp : -5.0f;
    free(lbp);
    static const int Ts[] = {1, 37, 130};
    static const char *const forms[] = {"softplus", "sigmoid"};
    for (int ti = 0; ti < 3; ti++) {
        const int T = Ts[ti];
        const int64_t nqk = (int64_t)T * KDA_H * KDA_K, nv = (int64_t)T * KDA_H * KDA_V,
                      nS = (int64_t)KDA_H * KDA_K * KDA_V;
        char n[64];
#define IN(var, name, count) \
    snprintf(n, sizeof n, "T%d.%s", T, name); \
    float *var = gf(&G, n, count)
        IN(q, "q", nqk);
        IN(k, "k", nqk);
        IN(v, "v", nv);
        IN(z, "z", nqk);
        IN(A_log, "A_log", KDA_H);
        IN(dt_bias, "dt_bias", KDA_H * KDA_K);
        IN(beta, "beta", (int64_t)T * KDA_H);
        IN(S0, "S0", nS);
#undef IN
        for (int fi = 0; fi < 2 && q && k && v && z && A_log && dt_bias && beta && S0; fi++) {
#define OUT(var, name, count) \
    snprintf(n, sizeof n, "T%d.%s.%s", T, forms[fi], name); \
    float *var = gf(&G, n, count)
            OUT(g, "g", nqk);
            OUT(o_rec, "o_rec", nv);
            OUT(S_rec, "S_rec", nS);
            OUT(o_chk, "o_chunk", nv);
            OUT(S_chk, "S_chunk", nS);
#undef OUT
            float *gk = malloc(sizeof(float) * (size_t)nqk), *o = malloc(sizeof(float) * (size_t)nv),
                  *S = malloc(sizeof(float) * (size_t)nS);
            if (g && o_rec && S_rec && o_chk && S_chk && gk && o && S) {
                /* the gate: k3_kda_gate on fla's input z */
                memcpy(gk, z, sizeof(float) * (size_t)nqk);
                for (int t = 0; t < T; t++)
                    for (int h = 0; h < KDA_H; h++)
                        k3_kda_gate(gk + ((int64_t)t * KDA_H + h) * KDA_K, KDA_K, A_log[h], dt_bias + h * KDA_K,
                                    fi == 1, lb);
                const double eg = k3_test_rel_l2(gk, g, nqk);
                CHECKF(eg <= 1e-6, "T=%d %s: gate rel-L2 %.3g vs fla > 1e-6", T, forms[fi], eg);
                /* recurrent (on fla's g), then chunked 16 and 64 */
                double eo[3], es[3];
                static const int chunks[3] = {0, 16, 64};
                for (int c = 0; c < 3; c++) {
                    memcpy(S, S0, sizeof(float) * (size_t)nS);
                    kda_run(T, q, k, v, g, beta, o, S, chunks[c]);
                    const float *ro = c ? o_chk : o_rec, *rs = c ? S_chk : S_rec;
                    eo[c] = k3_test_rel_l2(o, ro, nv);
                    es[c] = k3_test_rel_l2(S, rs, nS);
                    CHECKF(eo[c] <= 1e-5 && es[c] <= 1e-5, "T=%d %s %s: o rel-L2 %.3g, S rel-L2 %.3g vs fla (> 1e-5)",
                           T, forms[fi], c ? (c == 1 ? "chunked(16)" : "chunked(64)") : "recurrent", eo[c], es[c]);
                }
                /* end to end: k3's own gate feeding the recurrence */
                memcpy(S, S0, sizeof(float) * (size_t)nS);
                kda_run(T, q, k, v, gk, beta, o, S, 0);
                const double ee = k3_test_rel_l2(o, o_rec, nv);
                CHECKF(ee <= 1e-5, "T=%d %s: k3 gate + recurrence, o rel-L2 %.3g > 1e-5", T, forms[fi], ee);
                printf("    KDA T=%-3d %-8s gate %.2g | o/S rel-L2 vs fla: recurrent %.2g/%.2g, "
                       "chunk16 %.2g/%.2g, chunk64 %.2g/%.2g, k3-gate %.2g\n",
                       T, forms[fi], eg, eo[0], es[0], eo[1], es[1], eo[2], es[2], ee);
            }
            free(g);
            free(o_rec);
            free(S_rec);
            free(o_chk);
            free(S_chk);
            free(gk);
            free(o);
            free(S);
        }
        free(q);
        free(k);
        free(v);
        free(z);
        free(A_log);
        free(dt_bias);
        free(beta);
        free(S0);
    }
    golden_close(&G);
}

/* ---- DSA indexer vs DeepSeek-V3.2 / transformers --------------------------- */

enum { DSA_T = 64, DSA_HI = 8, DSA_DI = 32 };

K3_TEST(reference_dsa_indexer) {
    golden G;
    if (!golden_open(&G, "tests/golden/ref/dsa.safetensors")) return;
    const int T = DSA_T, HI = DSA_HI, dI = DSA_DI;
    float *q = gf(&G, "q", (int64_t)T * HI * dI), *k = gf(&G, "k", (int64_t)T * dI);
    float *w = gf(&G, "weights", (int64_t)T * HI), *ref = gf(&G, "scores", (int64_t)T * T);
    int32_t *sel8 = golden_get(&G, "sel.k8", K3_DTYPE_I32, (int64_t)T * 8);
    int32_t *sel16 = golden_get(&G, "sel.k16", K3_DTYPE_I32, (int64_t)T * 16);
    float *sc = calloc((size_t)T * T, sizeof(float));
    if (q && k && w && ref && sel8 && sel16 && sc) {
        /* fold the scales into w, as the engine does: weights_proj(x) H_I^-1/2 d_I^-1/2 */
        const float wscale = 1.0f / sqrtf((float)HI) / sqrtf((float)dI);
        for (int i = 0; i < T * HI; i++) w[i] *= wscale;
        int64_t slots[DSA_T];
        for (int s = 0; s < T; s++) slots[s] = s;
        for (int t = 0; t < T; t++)
            k3_indexer_scores(q + (int64_t)t * HI * dI, w + t * HI, HI, dI, k, slots, t + 1, sc + t * T);
        /* rows hold s <= t only; the golden has zeros above the diagonal, as sc */
        const double e = k3_test_rel_l2(sc, ref, (int64_t)T * T);
        CHECKF(e <= 1e-5, "indexer scores rel-L2 %.3g vs DeepSeek formula > 1e-5", e);
        int same[2] = {0, 0};
        static const int ks[2] = {8, 16};
        for (int j = 0; j < 2; j++) {
            const int kk = ks[j];
            const int32_t *want = j ? sel16 : sel8;
            for (int t = 0; t < T; t++) {
                int32_t got[16], work[DSA_T];
                const int n = k3_topk(sc + t * T, t + 1, kk, got, work);
                const int wn = kk < t + 1 ? kk : t + 1;
                bool eq = n == wn;
                for (int i = 0; eq && i < n; i++) eq = got[i] == want[t * kk + i];
                for (int i = wn; eq && i < kk; i++) eq = want[t * kk + i] == -1;
                same[j] += eq;
                CHECKF(eq, "top-%d of row %d differs from transformers/DeepSeek", kk, t);
            }
        }
        printf("    DSA T=%d H_I=%d d_I=%d: scores rel-L2 %.2g; top-8 sets %d/%d, top-16 sets %d/%d equal\n", T, HI, dI,
               e, same[0], T, same[1], T);
    }
    free(q);
    free(k);
    free(w);
    free(ref);
    free(sel8);
    free(sel16);
    free(sc);
    golden_close(&G);
}

/* ---- Kimi-Linear checkpoint written by transformers ----------------------- */

K3_TEST(reference_kimi_linear_transformers) {
    const char *dir = "tests/models/kimi-linear-tiny";
    golden G;
    if (!golden_open(&G, "tests/golden/ref/kimi-linear-tiny.safetensors")) return;
    const k3_st_tensor *ti = k3_st_get(G.st, "ids");
    const int n = ti ? (int)ti->shape[0] : 0;
    int32_t *ids = n > 0 ? golden_get(&G, "ids", K3_DTYPE_I32, n) : NULL;
    k3_model *m = NULL;
    k3_ctx *ctx = NULL;
    float *lg = NULL, *ref = NULL;
    k3_error err = {0};
    if (!ids) goto done;
    if (k3_model_open(&m, dir, &err) != K3_OK) {
        k3_test_fail(__FILE__, __LINE__,
                     "k3_model_open(%s) refused a checkpoint written by transformers' "
                     "save_pretrained (KimiLinearForCausalLM): %s",
                     dir, err.msg);
        goto done;
    }
    k3_model_info info;
    k3_model_get_info(m, &info);
    const int64_t V = info.vocab_size;
    ref = gf(&G, "logits", V * n);
    k3_ctx_options o = {.max_seqs = 1, .cache_tokens = 64, .block_size = 16};
    if (!ref) goto done;
    if (k3_ctx_init(&ctx, m, &o, &err) != K3_OK) {
        k3_test_fail(__FILE__, __LINE__, "ctx: %s", err.msg);
        goto done;
    }
    lg = malloc(sizeof(float) * (size_t)(V * n));
    k3_batch_seq b = {0, n, ids};
    if (!lg || k3_ctx_forward(ctx, &b, 1, K3_LOGITS_ALL, lg, &err) != K3_OK) {
        k3_test_fail(__FILE__, __LINE__, "forward: %s", err.msg);
        goto done;
    }
    const double e = k3_test_rel_l2(lg, ref, V * n);
    int agree = 0, first_bad = -1;
    for (int t = 0; t < n; t++) {
        int a = 0, c = 0;
        for (int64_t j = 1; j < V; j++) {
            if (lg[t * V + j] > lg[t * V + a]) a = (int)j;
            if (ref[t * V + j] > ref[t * V + c]) c = (int)j;
        }
        agree += a == c;
        if (first_bad < 0 && k3_test_rel_l2(lg + t * V, ref + t * V, V) > 1e-4) first_bad = t;
    }
    /* the same ids one token at a time (KDA recurrent form, conv and MLA caches) */
    k3_ctx_seq_reset(ctx, 0);
    double ed = 0;
    for (int t = 0; t < n; t++) {
        k3_batch_seq b1 = {0, 1, &ids[t]};
        if (k3_ctx_forward(ctx, &b1, 1, K3_LOGITS_LAST, lg + t * V, &err) != K3_OK) {
            k3_test_fail(__FILE__, __LINE__, "decode at %d: %s", t, err.msg);
            goto done;
        }
    }
    ed = k3_test_rel_l2(lg, ref, V * n);
    printf("    kimi-linear-tiny (transformers): %d positions, logits rel-L2 %.3g (decode %.3g), "
           "top-1 %d/%d\n",
           n, e, ed, agree, n);
    CHECKF(e <= 1e-4, "logits rel-L2 %.3g vs transformers > 1e-4 (first position over: %d)", e, first_bad);
    CHECKF(ed <= 1e-4, "token-by-token logits rel-L2 %.3g vs transformers > 1e-4", ed);
done:
    free(lg);
    free(ref);
    free(ids);
    k3_ctx_free(ctx);
    k3_model_close(m);
    golden_close(&G);
}
