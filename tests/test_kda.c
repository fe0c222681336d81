/* test_kda.c -- KDA: chunked form == recurrent form (k3-model.md §6.2.1),
 * gate ranges (§6.2.10), short conv with state == conv over the whole run. */
#include <stdlib.h>
#include <string.h>

#include "attn/kda.h"
#include "test.h"

static uint64_t rng = 1;
static float frand(void) { /* uniform in [-1, 1) */
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) / 8388608.0) - 1.0f;
}

typedef struct {
    int n, dk, dv;
    float *q, *k, *v, *g, *beta;
} kda_in;

static kda_in make_in(int n, int dk, int dv) {
    kda_in in = {n, dk, dv, malloc(sizeof(float) * n * dk), malloc(sizeof(float) * n * dk),
                 malloc(sizeof(float) * n * dv), malloc(sizeof(float) * n * dk), malloc(sizeof(float) * n)};
    for (int t = 0; t < n; t++) {
        double sq = 0, sk = 0;
        for (int d = 0; d < dk; d++) {
            in.q[t * dk + d] = frand();
            in.k[t * dk + d] = frand();
            sq += in.q[t * dk + d] * in.q[t * dk + d];
            sk += in.k[t * dk + d] * in.k[t * dk + d];
            /* K3 decays: g in (-5, 0), with some channels strongly decaying */
            in.g[t * dk + d] = -5.0f * (0.5f + 0.5f * frand()) * (d % 3 == 0 ? 1.0f : 0.05f);
        }
        for (int d = 0; d < dk; d++) {
            in.q[t * dk + d] /= (float)sqrt(sq) * sqrtf((float)dk);
            in.k[t * dk + d] /= (float)sqrt(sk);
        }
        for (int d = 0; d < dv; d++) in.v[t * dv + d] = frand();
        in.beta[t] = 0.5f + 0.49f * frand();
    }
    return in;
}

static void free_in(kda_in *in) {
    free(in->q);
    free(in->k);
    free(in->v);
    free(in->g);
    free(in->beta);
}

static k3_kda_head head(const kda_in *in, float *o) {
    return (k3_kda_head){in->n, in->dk, in->dv, in->q, in->k, in->g, in->dk, in->v, in->dv,
                         in->beta, 1, o, in->dv};
}

static void check_chunked(int n, int chunk, int nonzero_state) {
    const int dk = 32, dv = 24;
    kda_in in = make_in(n, dk, dv);
    float *o1 = calloc((size_t)n * dv, sizeof(float)), *o2 = calloc((size_t)n * dv, sizeof(float));
    float *S1 = calloc((size_t)dk * dv, sizeof(float)), *S2 = calloc((size_t)dk * dv, sizeof(float));
    float *work = malloc(sizeof(float) * (size_t)k3_kda_chunk_work(chunk, dk, dv));
    if (nonzero_state)
        for (int i = 0; i < dk * dv; i++) S1[i] = S2[i] = frand();
    k3_kda_head h1 = head(&in, o1), h2 = head(&in, o2);
    k3_kda_recurrent(&h1, S1);
    k3_kda_chunked(&h2, S2, chunk, work);
    const double eo = k3_test_rel_l2(o2, o1, (int64_t)n * dv), es = k3_test_rel_l2(S2, S1, (int64_t)dk * dv);
    CHECKF(eo <= 1e-5 && es <= 1e-5, "T=%d C=%d state=%d: output rel-L2 %.3g, state rel-L2 %.3g", n, chunk,
           nonzero_state, eo, es);
    free(o1);
    free(o2);
    free(S1);
    free(S2);
    free(work);
    free_in(&in);
}

K3_TEST(kda_chunked_equals_recurrent) {
    const int Ts[] = {1, 7, 64, 65, 200};
    const int Cs[] = {16, 64};
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 2; j++)
            for (int s = 0; s < 2; s++) check_chunked(Ts[i], Cs[j], s);
}

K3_TEST(kda_recurrent_split_equals_whole) {
    /* running 50 tokens then 30 equals running 80 (state continuation) */
    const int dk = 16, dv = 16, n = 80;
    kda_in in = make_in(n, dk, dv);
    float o1[80 * 16], o2[80 * 16], S1[256] = {0}, S2[256] = {0};
    k3_kda_head h = head(&in, o1);
    k3_kda_recurrent(&h, S1);
    k3_kda_head a = head(&in, o2);
    a.n = 50;
    k3_kda_recurrent(&a, S2);
    k3_kda_head b = a;
    b.n = 30;
    b.q += 50 * dk; b.k += 50 * dk; b.g += 50 * dk; b.v += 50 * dv; b.beta += 50; b.o += 50 * dv;
    k3_kda_recurrent(&b, S2);
    CHECK(memcmp(o1, o2, sizeof o1) == 0);
    CHECK(memcmp(S1, S2, sizeof S1) == 0);
    free_in(&in);
}

K3_TEST(kda_recurrent_matches_definition) {
    /* one token from a known state: S' = diag(e^g)S, u = β(v - S'ᵀk), S'' = S' + k uᵀ, o = S''ᵀq */
    const int dk = 3, dv = 2;
    float q[3] = {0.5f, -1.0f, 0.25f}, k[3] = {1.0f, 0.5f, -0.5f}, g[3] = {-0.1f, -1.0f, 0.0f};
    float v[2] = {2.0f, -1.0f}, beta = 0.25f, o[2];
    float S[6] = {1, 2, 3, 4, 5, 6};
    double Sd[6];
    for (int a = 0; a < dk; a++)
        for (int j = 0; j < dv; j++) Sd[a * dv + j] = S[a * dv + j] * exp(g[a]);
    double u[2];
    for (int j = 0; j < dv; j++) {
        double s = 0;
        for (int a = 0; a < dk; a++) s += Sd[a * dv + j] * k[a];
        u[j] = beta * (v[j] - s);
    }
    for (int a = 0; a < dk; a++)
        for (int j = 0; j < dv; j++) Sd[a * dv + j] += k[a] * u[j];
    k3_kda_head h = {1, dk, dv, q, k, g, dk, v, dv, &beta, 1, o, dv};
    k3_kda_recurrent(&h, S);
    for (int j = 0; j < dv; j++) {
        double e = 0;
        for (int a = 0; a < dk; a++) e += Sd[a * dv + j] * q[a];
        CHECKF(fabs(o[j] - e) < 1e-5, "o[%d] = %g, expected %g", j, o[j], e);
    }
    for (int i = 0; i < 6; i++) CHECK(fabs(S[i] - Sd[i]) < 1e-5);
}

K3_TEST(kda_gate_ranges) {
    /* K3 form: g in (lb, 0) -- [lb, 0] in fp32, where sigmoid saturates for
     * large |x|; Kimi-Linear form: g <= 0 */
    float z[64], dt[64];
    for (int i = 0; i < 64; i++) {
        z[i] = 8.0f * frand();
        dt[i] = 0.5f * frand();
    }
    float g[64];
    memcpy(g, z, sizeof g);
    k3_kda_gate(g, 64, logf(4.0f), dt, true, -5.0f);
    for (int i = 0; i < 64; i++) {
        CHECKF(g[i] >= -5.0f && g[i] <= 0.0f, "g[%d] = %g", i, g[i]);
        if (fabsf(4.0f * (z[i] + dt[i])) < 10.0f) CHECKF(g[i] > -5.0f && g[i] < 0.0f, "g[%d] = %g", i, g[i]);
    }
    /* dt_bias is added before the exp(A) multiply */
    const float x = z[3] + dt[3];
    CHECK(fabsf(g[3] - (-5.0f / (1.0f + expf(-4.0f * x)))) < 1e-6f);
    memcpy(g, z, sizeof g);
    k3_kda_gate(g, 64, logf(2.0f), dt, false, 0.0f);
    for (int i = 0; i < 64; i++) CHECK(g[i] <= 0.0f);
    CHECK(fabsf(g[5] - (-2.0f * log1pf(expf(z[5] + dt[5])))) < 1e-5f);
}

K3_TEST(kda_conv_state_equals_whole_run) {
    /* conv over 10 tokens == conv over 4 then 6 with the carried state; taps
     * before the start read zeros; the last tap is the current token */
    enum { C = 5, K = 4, N = 10 };
    float w[C * K], x[N * C], a[N * C], b[N * C], s1[(K - 1) * C] = {0}, s2[(K - 1) * C] = {0};
    for (int i = 0; i < C * K; i++) w[i] = frand();
    for (int i = 0; i < N * C; i++) x[i] = frand();
    memcpy(a, x, sizeof x);
    memcpy(b, x, sizeof x);
    k3_kda_conv(a, C, N, C, K, w, s1);
    k3_kda_conv(b, C, 4, C, K, w, s2);
    k3_kda_conv(b + 4 * C, C, 6, C, K, w, s2);
    CHECK(memcmp(a, b, sizeof a) == 0);
    CHECK(memcmp(s1, s2, sizeof s1) == 0);
    /* token 1, channel 2 by hand */
    const float pre = w[2 * K + 2] * x[0 * C + 2] + w[2 * K + 3] * x[1 * C + 2];
    CHECK(fabsf(a[1 * C + 2] - pre / (1.0f + expf(-pre))) < 1e-6f);
}
