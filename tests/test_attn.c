/* test_attn.c -- MLA absorbed == naive (docs/model.md §6.2.4), the DSA top-k
 * and indexer (§6.2.6), AttnRes (§6.2.9) and the router (§6.2.8). */
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "kernels/attnres.h"
#include "kernels/mla.h"
#include "kernels/kernels.h"
#include "kernels/router.h"
#include "test.h"

static uint64_t rng = 7;
static float frand(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) / 8388608.0) - 1.0f;
}

K3_TEST(mla_absorbed_equals_naive) {
    /* one head: nope 8, rope 4, v 6, kv_lora 16, 9 cached tokens */
    enum { NOPE = 8, ROPE = 4, VD = 6, KVL = 16, N = 9 };
    float wuk[NOPE * KVL], wuv[VD * KVL], qn[NOPE], qpe[ROPE], cache[N * (KVL + ROPE)];
    for (int i = 0; i < NOPE * KVL; i++) wuk[i] = frand();
    for (int i = 0; i < VD * KVL; i++) wuv[i] = frand();
    for (int i = 0; i < NOPE; i++) qn[i] = 2 * frand();
    for (int i = 0; i < ROPE; i++) qpe[i] = 2 * frand();
    for (int i = 0; i < N * (KVL + ROPE); i++) cache[i] = frand();
    const float scale = 1.0f / sqrtf(NOPE + ROPE);
    /* naive: expand k_nope = W_UK c, v = W_UV c per token */
    double sc[N], mx = -1e30, o_naive[VD] = {0};
    for (int s = 0; s < N; s++) {
        const float *c = cache + s * (KVL + ROPE);
        double d = 0;
        for (int i = 0; i < NOPE; i++) {
            double kn = 0;
            for (int j = 0; j < KVL; j++) kn += (double)wuk[i * KVL + j] * c[j];
            d += qn[i] * kn;
        }
        for (int i = 0; i < ROPE; i++) d += (double)qpe[i] * c[KVL + i];
        sc[s] = d * scale;
        if (sc[s] > mx) mx = sc[s];
    }
    double sum = 0;
    for (int s = 0; s < N; s++) sum += (sc[s] = exp(sc[s] - mx));
    for (int s = 0; s < N; s++) {
        const float *c = cache + s * (KVL + ROPE);
        for (int i = 0; i < VD; i++) {
            double v = 0;
            for (int j = 0; j < KVL; j++) v += (double)wuv[i * KVL + j] * c[j];
            o_naive[i] += sc[s] / sum * v;
        }
    }
    /* absorbed: qa = W_UKᵀ q_nope; attend in latent space; o = W_UV ĉ */
    float qa[KVL], chat[KVL], scores[N];
    for (int j = 0; j < KVL; j++) {
        qa[j] = 0;
        for (int i = 0; i < NOPE; i++) qa[j] += wuk[i * KVL + j] * qn[i];
    }
    int64_t slots[N];
    for (int s = 0; s < N; s++) slots[s] = s;
    const float lse = k3_mla_attend(qa, qpe, KVL, ROPE, cache, KVL + ROPE, slots, N, scale, scores, chat);
    CHECK(fabs(lse - (mx + log(sum))) < 1e-4);
    float o[VD], on[VD];
    for (int i = 0; i < VD; i++) {
        o[i] = 0;
        for (int j = 0; j < KVL; j++) o[i] += wuv[i * KVL + j] * chat[j];
        on[i] = (float)o_naive[i];
    }
    CHECKF(k3_test_rel_l2(o, on, VD) < 1e-5, "rel-L2 %g", k3_test_rel_l2(o, on, VD));
}

K3_TEST(topk_exact_and_deterministic) {
    enum { N = 300 };
    float s[N];
    int32_t sel[N], work[N];
    for (int i = 0; i < N; i++) s[i] = (float)((i * 37) % 101); /* many ties */
    for (int k = 0; k <= N + 5; k += 7) {
        const int n = k3_topk(s, N, k, sel, work);
        const int want = k < N ? k : N;
        REQUIRE(n == want);
        /* ascending indices, and every selected beats every unselected */
        char in[N] = {0};
        for (int i = 0; i < n; i++) {
            if (i) CHECK(sel[i - 1] < sel[i]);
            in[sel[i]] = 1;
        }
        for (int a = 0; a < N; a++)
            for (int b = 0; b < N && in[a]; b++)
                if (!in[b]) CHECKF(s[a] > s[b] || (s[a] == s[b] && a < b), "k=%d: %d kept, %d dropped", k, a, b);
    }
    /* all equal: the lowest indices win */
    for (int i = 0; i < N; i++) s[i] = 0.0f;
    REQUIRE(k3_topk(s, N, 5, sel, work) == 5);
    for (int i = 0; i < 5; i++) CHECK(sel[i] == i);
}

/* the order k3_topk promises, for the oracle below: higher first, -0 == +0,
 * NaN last, ties to the lower index */
static int topk_before(const float *s, int a, int b) {
    const float x = s[a], y = s[b];
    if (isnan(x) || isnan(y)) return isnan(x) == isnan(y) ? a < b : !isnan(x);
    return x > y || (x == y && a < b);
}

K3_TEST(topk_equals_sorting_on_hard_scores) {
    /* negatives, both zeros, infinities, NaNs and runs of ties, against a
     * plain selection sort of the order (n small enough for it) */
    enum { N = 1500 };
    static float s[N];
    static int32_t sel[N], work[N], ord[N];
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < N; i++) {
            const int r = (int)(frand() * 1000.0f);
            s[i] = r % 11 == 0 ? 0.0f
                : r % 13 == 0  ? -0.0f
                : r % 97 == 0  ? NAN
                : r % 89 == 0  ? -INFINITY
                : r % 83 == 0  ? INFINITY
                               : (float)(r % (round == 0 ? 7 : 400)) - 3.5f;
        }
        for (int i = 0; i < N; i++) ord[i] = i;
        for (int i = 0; i < N; i++) /* selection sort by the promised order */
            for (int j = i + 1; j < N; j++)
                if (topk_before(s, ord[j], ord[i])) {
                    const int32_t t = ord[i];
                    ord[i] = ord[j];
                    ord[j] = t;
                }
        const int ks[] = {1, 2, 100, 777, N - 1};
        for (int q = 0; q < 5; q++) {
            const int k = ks[q];
            REQUIRE(k3_topk(s, N, k, sel, work) == k);
            char want[N] = {0};
            for (int i = 0; i < k; i++) want[ord[i]] = 1;
            int bad = 0;
            for (int i = 0; i < k; i++) bad += !want[sel[i]] || (i && sel[i - 1] >= sel[i]);
            CHECKF(bad == 0, "round %d k %d: %d wrong", round, k, bad);
        }
    }
}

K3_TEST(indexer_scores_hadamard_invariant) {
    /* Σ_h w_h ReLU(q_h·k) is unchanged when q and k are rotated by the same
     * orthonormal Hadamard matrix (fp32, to rounding) */
    enum { HI = 3, DI = 8, N = 5 };
    float q[HI * DI], w[HI], k[N * DI], qr[HI * DI], kr[N * DI], s1[N], s2[N];
    for (int i = 0; i < HI * DI; i++) q[i] = frand();
    for (int i = 0; i < HI; i++) w[i] = frand();
    for (int i = 0; i < N * DI; i++) k[i] = frand();
    float Hm[DI][DI];
    for (int i = 0; i < DI; i++)
        for (int j = 0; j < DI; j++) Hm[i][j] = (__builtin_popcount(i & j) & 1 ? -1.0f : 1.0f) / sqrtf(DI);
    for (int r = 0; r < HI + N; r++) {
        const float *src = r < HI ? q + r * DI : k + (r - HI) * DI;
        float *dst = r < HI ? qr + r * DI : kr + (r - HI) * DI;
        for (int i = 0; i < DI; i++) {
            dst[i] = 0;
            for (int j = 0; j < DI; j++) dst[i] += Hm[i][j] * src[j];
        }
    }
    int64_t slots[N] = {0, 1, 2, 3, 4};
    k3_indexer_scores(q, w, HI, DI, k, slots, N, s1);
    k3_indexer_scores(qr, w, HI, DI, kr, slots, N, s2);
    for (int i = 0; i < N; i++) CHECK(fabsf(s1[i] - s2[i]) < 1e-5f);
    /* and by definition */
    double e = 0;
    for (int h = 0; h < HI; h++) {
        double d = 0;
        for (int j = 0; j < DI; j++) d += q[h * DI + j] * k[2 * DI + j];
        if (d > 0) e += w[h] * d;
    }
    CHECK(fabs(s1[2] - e) < 1e-5);
}

K3_TEST(attnres_uniform_with_zero_query) {
    enum { D = 16, NB = 4 };
    float v[NB][D], w[D] = {0}, out[D];
    const float *V[NB];
    for (int e = 0; e < NB; e++) {
        for (int d = 0; d < D; d++) v[e][d] = frand() * (e + 1);
        V[e] = v[e];
    }
    k3_attnres_mix(V, NB, w, D, 1e-5f, out);
    for (int d = 0; d < D; d++) {
        const float mean = (v[0][d] + v[1][d] + v[2][d] + v[3][d]) / 4;
        CHECK(fabsf(out[d] - mean) < 1e-6f);
    }
    /* scale invariance of the scores: doubling one candidate doubles only its
     * contribution, its weight stays (RMS-normalised score) */
    for (int d = 0; d < D; d++) w[d] = frand();
    float out1[D], out2[D], v2[D];
    k3_attnres_mix(V, NB, w, D, 0.0f, out1);
    for (int d = 0; d < D; d++) v2[d] = 2 * v[1][d];
    V[1] = v2;
    k3_attnres_mix(V, NB, w, D, 0.0f, out2);
    for (int d = 0; d < D; d++) {
        /* out2 - out1 = α_1 v_1 */
        const float a1 = (out2[d] - out1[d]) / v[1][d];
        if (fabsf(v[1][d]) > 0.1f) {
            const float a1_0 = (out2[0] - out1[0]) / v[1][0];
            CHECK(fabsf(a1 - a1_0) < 1e-4f);
        }
    }
    /* one candidate: out = it */
    k3_attnres_mix(V, 1, w, D, 1e-5f, out);
    CHECK(memcmp(out, v[0], sizeof out) == 0);
}

K3_TEST(attnres_simd_matches_ref) {
    enum { D = 203, NB = 6 };
    static float v[NB][D];
    float w[D], o1[D], o2[D];
    const float *V[NB];
    for (int e = 0; e < NB; e++) {
        for (int d = 0; d < D; d++) v[e][d] = frand() * (e + 1);
        V[e] = v[e];
    }
    for (int d = 0; d < D; d++) w[d] = frand();
    for (int n = 1; n <= NB; n++) {
        k3_attnres_mix_ref(V, n, w, D, 1e-5f, o2);
        for (int isa = K3_ISA_REF; isa <= K3_ISA_AVX512; isa++) {
            k3_kernels_force((k3_isa)isa);
            k3_attnres_mix(V, n, w, D, 1e-5f, o1);
            CHECKF(k3_test_rel_l2(o1, o2, D) < 1e-6, "n=%d isa %d: %g", n, isa, k3_test_rel_l2(o1, o2, D));
        }
    }
}

K3_TEST(router_weights_and_bias) {
    enum { E = 16, K = 4 };
    float logits[E], l2[E], bias[E] = {0}, w[K], w2[K], work[E];
    int32_t ids[K], ids2[K];
    for (int e = 0; e < E; e++) logits[e] = 2 * frand();
    memcpy(l2, logits, sizeof l2);
    k3_router_cfg rc = {E, K, true, true, 2.5f, 1, 1};
    k3_router_select(&rc, logits, NULL, ids, w, work);
    float sum = 0;
    for (int r = 0; r < K; r++) sum += w[r];
    CHECK(fabsf(sum - 2.5f) < 1e-5f); /* renormalised, times the scaling */
    /* a bias on a low expert moves it in, with the weight from its unbiased score */
    int low = -1;
    for (int e = 0; e < E; e++) {
        bool chosen = false;
        for (int r = 0; r < K; r++) chosen |= ids[r] == e;
        if (!chosen) low = e;
    }
    REQUIRE(low >= 0);
    bias[low] = 10.0f;
    memcpy(logits, l2, sizeof l2);
    k3_router_select(&rc, logits, bias, ids2, w2, work);
    CHECK(ids2[0] == low);
    float s_low = 1.0f / (1.0f + expf(-l2[low])), ssum = 0;
    for (int r = 0; r < K; r++) ssum += 1.0f / (1.0f + expf(-l2[ids2[r]]));
    CHECK(fabsf(w2[0] - 2.5f * s_low / ssum) < 1e-5f);
    /* ties resolve to the lowest id */
    for (int e = 0; e < E; e++) logits[e] = 0.3f;
    k3_router_select(&rc, logits, NULL, ids, w, work);
    for (int r = 0; r < K; r++) CHECK(ids[r] == r);
    /* grouped: with 4 groups keep 1, all picks come from the best group */
    for (int e = 0; e < E; e++) logits[e] = (e >= 8 && e < 12) ? 3.0f + frand() * 0.1f : frand();
    k3_router_cfg rg = {E, K, true, true, 1.0f, 4, 1};
    k3_router_select(&rg, logits, NULL, ids, w, work);
    for (int r = 0; r < K; r++) CHECK(ids[r] >= 8 && ids[r] < 12);
}

static float glu1(k3_glu_kind kind, float g, float u) {
    k3_glu_ref(&g, &u, 1, kind, 4.0f, 25.0f);
    return g;
}

K3_TEST(situ_bounds_and_small_values) {
    for (int i = 0; i < 1000; i++) {
        const float g = 50 * frand(), u = 200 * frand();
        CHECK(fabsf(glu1(K3_GLU_SITU, g, u)) < 100.0f);
    }
    const float g = 0.01f, u = 0.02f;
    CHECK(fabsf(glu1(K3_GLU_SITU, g, u) - glu1(K3_GLU_SWIGLU, g, u)) < 1e-7f);
}

/* the SIMD activations == the scalar formulas within a few ulp, for every
 * range the exp and tanh pieces switch over (tiny, 0.2, large, saturated) */
K3_TEST(glu_simd_equals_ref) {
    enum { N = 4103 };
    float *g = malloc(sizeof(float) * N), *u = malloc(sizeof(float) * N), *a = malloc(sizeof(float) * N),
          *b = malloc(sizeof(float) * N);
    for (int i = 0; i < N; i++) {
        const float scale = i % 5 == 0 ? 1e-3f : i % 5 == 1 ? 0.3f : i % 5 == 2 ? 5.0f : i % 5 == 3 ? 60.0f : 150.0f;
        g[i] = scale * frand();
        u[i] = scale * frand();
    }
    for (int kind = K3_GLU_SWIGLU; kind <= K3_GLU_GATE; kind++)
        for (int b2 = 0; b2 < 2; b2++)
            for (int isa = K3_ISA_AVX2; isa <= K3_ISA_AVX512; isa++) {
                const float beta2 = b2 ? 25.0f : 0.0f;
                memcpy(a, g, sizeof(float) * N);
                memcpy(b, g, sizeof(float) * N);
                k3_glu_ref(a, u, N, (k3_glu_kind)kind, 4.0f, beta2);
                k3_kernels_force((k3_isa)isa);
                k3_glu(b, u, N, (k3_glu_kind)kind, 4.0f, beta2);
                double worst = 0;
                for (int i = 0; i < N; i++) {
                    const double e = fabs((double)a[i] - b[i]) / (fabs((double)a[i]) + 1e-25);
                    worst = e > worst ? e : worst;
                }
                CHECKF(worst < 2e-6, "kind %d b2 %d isa %d: worst relative error %.3g", kind, b2, isa, worst);
            }
    k3_kernels_force(K3_ISA_AVX512);
    free(g);
    free(u);
    free(a);
    free(b);
}
