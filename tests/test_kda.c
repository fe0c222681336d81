/* test_kda.c -- KDA: chunked form == recurrent form (docs/model.md §6.2.1),
 * gate ranges (§6.2.10), short conv with state == conv over the whole run. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kda.h"
#include "kernels/kernels_isa.h"
#include "kernels/kernels.h"
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

/* g_floor: the strongest decay, -5 for K3 (channels d % 3 == 0 reach it) */
static kda_in make_in_g(int n, int dk, int dv, float g_floor) {
    kda_in in = {n,
                 dk,
                 dv,
                 malloc(sizeof(float) * n * dk),
                 malloc(sizeof(float) * n * dk),
                 malloc(sizeof(float) * n * dv),
                 malloc(sizeof(float) * n * dk),
                 malloc(sizeof(float) * n)};
    for (int t = 0; t < n; t++) {
        double sq = 0, sk = 0;
        for (int d = 0; d < dk; d++) {
            in.q[t * dk + d] = frand();
            in.k[t * dk + d] = frand();
            sq += in.q[t * dk + d] * in.q[t * dk + d];
            sk += in.k[t * dk + d] * in.k[t * dk + d];
            /* K3 decays: g in (-5, 0), with some channels strongly decaying */
            in.g[t * dk + d] = g_floor * (0.5f + 0.5f * frand()) * (d % 3 == 0 ? 1.0f : 0.05f);
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

static kda_in make_in(int n, int dk, int dv) { return make_in_g(n, dk, dv, -5.0f); }

static void free_in(kda_in *in) {
    free(in->q);
    free(in->k);
    free(in->v);
    free(in->g);
    free(in->beta);
}

static k3_kda_head head(const kda_in *in, float *o) {
    return (k3_kda_head){in->n, in->dk, in->dv, in->q, in->k, in->g, in->dk, in->v, in->dv, in->beta, 1, o, in->dv};
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
    b.q += 50 * dk;
    b.k += 50 * dk;
    b.g += 50 * dk;
    b.v += 50 * dv;
    b.beta += 50;
    b.o += 50 * dv;
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
    enum { C = 21, K = 4, N = 10 }; /* a block of 16 channels and a tail */
    float w[C * K], x[N * C], a[N * C], b[N * C], s1[(K - 1) * C] = {0}, s2[(K - 1) * C] = {0};
    for (int i = 0; i < C * K; i++) w[i] = frand();
    for (int i = 0; i < N * C; i++) x[i] = frand();
    memcpy(a, x, sizeof x);
    memcpy(b, x, sizeof x);
    k3_kda_conv(a, C, N, C, K, w, C, s1, C);
    k3_kda_conv(b, C, 4, C, K, w, C, s2, C);
    k3_kda_conv(b + 4 * C, C, 6, C, K, w, C, s2, C);
    CHECK(memcmp(a, b, sizeof a) == 0);
    CHECK(memcmp(s1, s2, sizeof s1) == 0);
    /* token 1, channel 2 by hand (w tap-major: w[j*C + c]) */
    const float pre = w[2 * C + 2] * x[0 * C + 2] + w[3 * C + 2] * x[1 * C + 2];
    CHECK(fabsf(a[1 * C + 2] - pre / (1.0f + expf(-pre))) < 1e-6f);
}

/* ---- SIMD paths vs the scalar references --------------------------------- */

/* Runs every form on the same inputs and initial state: the references, the
 * AVX2 paths, and the dispatching entry points; compares outputs and final
 * states by rel-L2. */
static double simd_worst[5]; /* per pair below: the largest rel-L2 seen */

static void check_simd(int n, int dk, int dv, int chunk, int nonzero_state, float g_floor) {
    kda_in in = make_in_g(n, dk, dv, g_floor);
    const size_t no = (size_t)n * dv, ns = (size_t)dk * dv;
    enum { REC_REF, REC_AVX2, REC_AVX512, REC_DISPATCH, CHK_REF, CHK_AVX2, CHK_DISPATCH, NF };
    const bool avx512 = k3_kernels_isa() >= K3_ISA_AVX512;
    float *o[NF], *S[NF];
    float *S0 = malloc(sizeof(float) * ns);
    for (size_t i = 0; i < ns; i++) S0[i] = nonzero_state ? frand() : 0.0f;
    float *work = malloc(sizeof(float) * (size_t)k3_kda_chunk_work(chunk, dk, dv));
    for (int f = 0; f < NF; f++) {
        o[f] = malloc(sizeof(float) * no);
        S[f] = malloc(sizeof(float) * ns);
        memcpy(S[f], S0, sizeof(float) * ns);
        for (size_t i = 0; i < no; i++) o[f][i] = 1e30f; /* every output must be written */
        /* garbage work memory: the paths must not depend on its contents */
        for (int64_t i = 0; i < k3_kda_chunk_work(chunk, dk, dv); i++) work[i] = 1e30f;
        k3_kda_head hh = head(&in, o[f]);
        switch (f) {
        case REC_REF: k3_kda_recurrent_ref(&hh, S[f]); break;
        case REC_AVX2: k3_kda_recurrent_avx2(&hh, S[f]); break;
        case REC_AVX512:
            if (avx512) k3_kda_recurrent_avx512(&hh, S[f]);
            else k3_kda_recurrent_avx2(&hh, S[f]);
            break;
        case REC_DISPATCH: k3_kda_recurrent(&hh, S[f]); break;
        case CHK_REF: k3_kda_chunked_ref(&hh, S[f], chunk, work); break;
        case CHK_AVX2: k3_kda_chunked_avx2(&hh, S[f], chunk, work); break;
        default: k3_kda_chunked(&hh, S[f], chunk, work); break;
        }
    }
    /* w: which worst-case slot of simd_worst the pair reports to */
    static const struct {
        int a, b, w;
        const char *what;
    } pairs[] = {
        {REC_AVX2, REC_REF, 0, "recurrent avx2 vs ref"},
        {REC_AVX512, REC_REF, 0, "recurrent avx512 vs ref"},
        {REC_DISPATCH, REC_REF, 0, "recurrent dispatch vs ref"},
        {CHK_AVX2, CHK_REF, 1, "chunked avx2 vs chunked ref"},
        {CHK_AVX2, REC_AVX2, 2, "chunked avx2 vs recurrent avx2"},
        {CHK_AVX2, REC_REF, 3, "chunked avx2 vs recurrent ref"},
        {CHK_REF, REC_REF, 4, "chunked ref vs recurrent ref"},
        {CHK_DISPATCH, CHK_AVX2, 4, "chunked dispatch vs avx2"},
    };
    for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
        const int a = pairs[p].a, b = pairs[p].b, w = pairs[p].w;
        const double eo = k3_test_rel_l2(o[a], o[b], (int64_t)no), es = k3_test_rel_l2(S[a], S[b], (int64_t)ns);
        if (eo > simd_worst[w]) simd_worst[w] = eo;
        if (es > simd_worst[w]) simd_worst[w] = es;
        CHECKF(eo <= 1e-5 && es <= 1e-5,
               "%s: T=%d dk=%d dv=%d C=%d state=%d g>=%g: output rel-L2 %.3g, state rel-L2 %.3g", pairs[p].what, n, dk,
               dv, chunk, nonzero_state, g_floor, eo, es);
    }
    for (int f = 0; f < NF; f++) {
        free(o[f]);
        free(S[f]);
    }
    free(S0);
    free(work);
    free_in(&in);
}

K3_TEST(kda_simd_matches_ref) {
    k3_kernels_init();
    if (k3_kernels_isa() < K3_ISA_AVX2) SKIP("no AVX2 on this CPU: the SIMD paths cannot run");
    /* T = 1 from a zero state is the worst conditioned case: o = β (q·k) v,
     * and q·k of random unit vectors cancels (rel-L2 up to ~5e-6 seen) */
    rng = 12345; /* the same inputs whichever tests ran before */
    static const int Ts[] = {1, 7, 16, 17, 64, 65, 200};
    static const int Cs[] = {16, 64};
    static const int dims[][2] = {{32, 32}, {128, 128}, {32, 24}, {24, 40}};
    for (int di = 0; di < 4; di++)
        for (int ti = 0; ti < 7; ti++)
            for (int ci = 0; ci < 2; ci++)
                for (int s = 0; s < 2; s++) {
                    /* the long runs at 128 only once each: they dominate the time */
                    if (dims[di][0] == 128 && Ts[ti] == 200 && s == 0) continue;
                    check_simd(Ts[ti], dims[di][0], dims[di][1], Cs[ci], s, -5.0f);
                }
    /* odd chunk lengths (sub-blocks cut short), and a much stronger decay (the
     * Kimi-Linear gate is unbounded): e^{G} underflows inside a chunk */
    check_simd(100, 32, 32, 24, 1, -5.0f);
    check_simd(37, 32, 32, 5, 1, -5.0f);
    check_simd(130, 32, 32, 64, 1, -40.0f);
    check_simd(130, 128, 128, 64, 1, -40.0f);
    printf("    worst rel-L2: recurrent simd vs ref %.2g, chunked avx2 vs chunked ref %.2g, vs recurrent avx2 "
           "%.2g, vs recurrent ref %.2g (chunked ref vs recurrent ref %.2g)\n",
           simd_worst[0], simd_worst[1], simd_worst[2], simd_worst[3], simd_worst[4]);
}

/* The SIMD recurrence in pieces (token groups cut anywhere) equals one run,
 * bit for bit: decode continues a recurrent prefill exactly. */
static void check_split(void (*rec)(const k3_kda_head *, float *), const char *what) {
    const int dk = 32, dv = 48, n = 80;
    kda_in in = make_in(n, dk, dv);
    float o1[80 * 48], o2[80 * 48], S1[32 * 48], S2[32 * 48];
    for (int i = 0; i < dk * dv; i++) S1[i] = S2[i] = frand();
    k3_kda_head h = head(&in, o1);
    rec(&h, S1);
    int t = 0;
    static const int cuts[] = {1, 33, 3, 40, 3};
    for (int c = 0; c < 5; c++) {
        k3_kda_head a = head(&in, o2);
        a.n = cuts[c];
        a.q += t * dk;
        a.k += t * dk;
        a.g += t * dk;
        a.v += t * dv;
        a.beta += t;
        a.o += t * dv;
        rec(&a, S2);
        t += cuts[c];
    }
    CHECK(t == n);
    CHECKF(memcmp(o1, o2, sizeof o1) == 0 && memcmp(S1, S2, sizeof S1) == 0, "%s: split run differs", what);
    free_in(&in);
}

K3_TEST(kda_simd_recurrent_split_equals_whole) {
    k3_kernels_init();
    if (k3_kernels_isa() >= K3_ISA_AVX2) check_split(k3_kda_recurrent_avx2, "avx2");
    if (k3_kernels_isa() >= K3_ISA_AVX512) check_split(k3_kda_recurrent_avx512, "avx512");
}

K3_TEST(kda_dispatch_falls_back) {
    /* dims the SIMD paths do not take (dk, dv not multiples of 8) go to the
     * references, bit for bit */
    const int dk = 20, dv = 12, n = 30, chunk = 16;
    kda_in in = make_in(n, dk, dv);
    float o1[30 * 12], o2[30 * 12], S1[20 * 12] = {0}, S2[20 * 12] = {0};
    float *work = malloc(sizeof(float) * (size_t)k3_kda_chunk_work(chunk, dk, dv));
    k3_kda_head h1 = head(&in, o1), h2 = head(&in, o2);
    k3_kda_chunked_ref(&h1, S1, chunk, work);
    k3_kda_chunked(&h2, S2, chunk, work);
    CHECK(memcmp(o1, o2, sizeof o1) == 0 && memcmp(S1, S2, sizeof S1) == 0);
    k3_kda_recurrent_ref(&h1, S1);
    k3_kda_recurrent(&h2, S2);
    CHECK(memcmp(o1, o2, sizeof o1) == 0 && memcmp(S1, S2, sizeof S1) == 0);
    free(work);
    free_in(&in);
}

K3_TEST(kda_dispatch_forced_ref) {
    /* with the scalar path forced, the entry points are the references */
    const int dk = 32, dv = 32, n = 40, chunk = 16;
    kda_in in = make_in(n, dk, dv);
    float o1[40 * 32], o2[40 * 32], S1[32 * 32], S2[32 * 32];
    for (int i = 0; i < dk * dv; i++) S1[i] = S2[i] = frand();
    float *work = malloc(sizeof(float) * (size_t)k3_kda_chunk_work(chunk, dk, dv));
    k3_kda_head h1 = head(&in, o1), h2 = head(&in, o2);
    k3_kernels_force(K3_ISA_REF);
    k3_kda_recurrent_ref(&h1, S1);
    k3_kda_recurrent(&h2, S2);
    CHECK(memcmp(o1, o2, sizeof o1) == 0 && memcmp(S1, S2, sizeof S1) == 0);
    k3_kda_chunked_ref(&h1, S1, chunk, work);
    k3_kda_chunked(&h2, S2, chunk, work);
    CHECK(memcmp(o1, o2, sizeof o1) == 0 && memcmp(S1, S2, sizeof S1) == 0);
    k3_kernels_force(K3_ISA_AVX512); /* back to the best the CPU has */
    free(work);
    free_in(&in);
}

/* ---- the BF16 chunked form ------------------------------------------------ */

/* The first-order bound of the BF16 form against exact arithmetic, per
 * output and state element, carried chunk by chunk in double. Every product
 * rounds both operands to BF16 (2^-8 relative each) and sums K terms in
 * fp32, so a product P = Σ a b is off by at most γ Σ|a b| with γ = 2^-7 +
 * 2^-16 + K 2^-24; the errors then travel linearly: with T = (I + L)^{-1},
 *     ΔU  <= γ |Ke||S| + |Ke| ΔS,       ΔL <= γ β |K K̃ᵀ| (the decays in)
 *     ΔVn <= |T| (β ΔU + ΔL |Vn|)
 *     Δo  <= γ (|Qe||S| + |Aqk||Vn|) + |Qe| ΔS + γ |Q K̃ᵀ||Vn| + |Aqk| ΔVn
 *     ΔS' <= e^{G_C} ΔS + γ |Kd|ᵀ|Vn| + |Kd|ᵀ ΔVn
 * (e^{G} ⊙ K = Ke, etc., all exact here). The check allows 1.25 times that
 * (the second-order terms) plus 1e-5 of the element's magnitude (the fp32
 * steps and the fp32 reference's own rounding). */
static void bf_bound(const kda_in *in, const float *S0, int chunk, double *bo, double *bs) {
    const int n = in->n, dk = in->dk, dv = in->dv;
    double *S = malloc(sizeof(double) * dk * dv), *dS = calloc((size_t)dk * dv, sizeof(double));
    for (int i = 0; i < dk * dv; i++) S[i] = S0[i];
    double *G = malloc(sizeof(double) * chunk * dk), *L = malloc(sizeof(double) * chunk * chunk);
    double *Lm = malloc(sizeof(double) * chunk * chunk), *Am = malloc(sizeof(double) * chunk * chunk);
    double *A = malloc(sizeof(double) * chunk * chunk), *T = malloc(sizeof(double) * chunk * chunk);
    double *U = malloc(sizeof(double) * chunk * dv), *dU = malloc(sizeof(double) * chunk * dv);
    double *Vn = malloc(sizeof(double) * chunk * dv), *dV = malloc(sizeof(double) * chunk * dv);
    const double u2 = ldexp(1, -7) + ldexp(1, -16);
    for (int t0 = 0; t0 < n; t0 += chunk) {
        const int C = n - t0 < chunk ? n - t0 : chunk;
        const double gk = u2 + dk * ldexp(1, -24), gc = u2 + ((C + 31) / 32 * 32) * ldexp(1, -24);
#define QD(t, d) ((double)in->q[(int64_t)(t0 + (t)) * dk + (d)])
#define KD(t, d) ((double)in->k[(int64_t)(t0 + (t)) * dk + (d)])
#define BD(t) ((double)in->beta[t0 + (t)])
        for (int t = 0; t < C; t++)
            for (int d = 0; d < dk; d++)
                G[t * dk + d] = (t ? G[(t - 1) * dk + d] : 0.0) + in->g[(int64_t)(t0 + t) * dk + d];
        const double *GC = G + (C - 1) * dk;
        for (int t = 0; t < C; t++)
            for (int j = 0; j < C; j++) {
                double l = 0, lm = 0, a = 0, am = 0;
                for (int d = 0; j <= t && d < dk; d++) {
                    const double e = exp(G[t * dk + d] - G[j * dk + d]);
                    l += KD(t, d) * KD(j, d) * e, lm += fabs(KD(t, d) * KD(j, d)) * e;
                    a += QD(t, d) * KD(j, d) * e, am += fabs(QD(t, d) * KD(j, d)) * e;
                }
                L[t * chunk + j] = j < t ? BD(t) * l : 0.0;
                Lm[t * chunk + j] = j < t ? BD(t) * lm : 0.0;
                A[t * chunk + j] = a, Am[t * chunk + j] = am;
            }
        /* T = (I + L)^{-1}, unit lower triangular */
        for (int t = 0; t < C; t++)
            for (int j = 0; j < C; j++) {
                double s = t == j ? 1.0 : 0.0;
                for (int m = j; m < t; m++) s -= L[t * chunk + m] * T[m * chunk + j];
                T[t * chunk + j] = j <= t ? s : 0.0;
            }
        for (int t = 0; t < C; t++)
            for (int c = 0; c < dv; c++) {
                double s = in->v[(int64_t)(t0 + t) * dv + c], e = 0;
                for (int a = 0; a < dk; a++) {
                    const double ke = KD(t, a) * exp(G[t * dk + a]);
                    s -= ke * S[a * dv + c];
                    e += gk * fabs(ke * S[a * dv + c]) + fabs(ke) * dS[a * dv + c];
                }
                U[t * dv + c] = s, dU[t * dv + c] = e;
            }
        for (int t = 0; t < C; t++)
            for (int c = 0; c < dv; c++) {
                double s = 0;
                for (int j = 0; j <= t; j++) s += T[t * chunk + j] * BD(j) * U[j * dv + c];
                Vn[t * dv + c] = s;
            }
        for (int t = 0; t < C; t++)
            for (int c = 0; c < dv; c++) {
                double e = 0;
                for (int j = 0; j <= t; j++) {
                    double lv = 0;
                    for (int m = 0; m < j; m++) lv += gk * Lm[j * chunk + m] * fabs(Vn[m * dv + c]);
                    e += fabs(T[t * chunk + j]) * (BD(j) * dU[j * dv + c] + lv);
                }
                dV[t * dv + c] = e;
            }
        for (int t = 0; t < C; t++)
            for (int c = 0; c < dv; c++) {
                double e = 0;
                for (int a = 0; a < dk; a++) {
                    const double qe = QD(t, a) * exp(G[t * dk + a]);
                    e += gk * fabs(qe * S[a * dv + c]) + fabs(qe) * dS[a * dv + c];
                }
                for (int j = 0; j <= t; j++)
                    e += gc * fabs(A[t * chunk + j] * Vn[j * dv + c]) + gk * Am[t * chunk + j] * fabs(Vn[j * dv + c]) +
                        fabs(A[t * chunk + j]) * dV[j * dv + c];
                bo[(int64_t)(t0 + t) * dv + c] = e;
            }
        for (int a = 0; a < dk; a++)
            for (int c = 0; c < dv; c++) {
                double s = exp(GC[a]) * S[a * dv + c], e = exp(GC[a]) * dS[a * dv + c];
                for (int t = 0; t < C; t++) {
                    const double kd = KD(t, a) * exp(GC[a] - G[t * dk + a]);
                    s += kd * Vn[t * dv + c];
                    e += gc * fabs(kd * Vn[t * dv + c]) + fabs(kd) * dV[t * dv + c];
                }
                S[a * dv + c] = s, dS[a * dv + c] = e;
            }
#undef QD
#undef KD
#undef BD
    }
    memcpy(bs, dS, sizeof(double) * dk * dv);
    free(S), free(dS), free(G), free(L), free(Lm), free(Am), free(A), free(T), free(U), free(dU), free(Vn), free(dV);
}

static int bf_outside(const float *x, const float *ref, const double *b, int64_t n, const char *what) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const double err = fabs((double)x[i] - ref[i]);
        if (!(err <= 1.25 * b[i] + 1e-5 * fabs(ref[i]) + 1e-30)) {
            if (bad < 3) fprintf(stderr, "  %s[%lld]: |%g - %g| > %g\n", what, (long long)i, x[i], ref[i], b[i]);
            bad++;
        }
    }
    return bad;
}

static double bf_worst[2];

static void check_bf(int n, int dk, int dv, int chunk, int nonzero_state, float g_floor) {
    kda_in in = make_in_g(n, dk, dv, g_floor);
    const size_t no = (size_t)n * dv, ns = (size_t)dk * dv;
    const int64_t nw = k3_kda_chunk_work_bf(chunk, dk, dv);
    float *S0 = malloc(sizeof(float) * ns), *work = malloc(sizeof(float) * (size_t)nw);
    for (size_t i = 0; i < ns; i++) S0[i] = nonzero_state ? frand() : 0.0f;
    float *o[4], *S[4];
    for (int f = 0; f < 4; f++) {
        o[f] = malloc(sizeof(float) * no);
        S[f] = malloc(sizeof(float) * ns);
        memcpy(S[f], S0, sizeof(float) * ns);
        for (size_t i = 0; i < no; i++) o[f][i] = 1e30f;
    }
    k3_kda_head h0 = head(&in, o[0]), h1 = head(&in, o[1]);
    k3_kda_recurrent_ref(&h0, S[0]);
    for (int64_t i = 0; i < nw; i++) work[i] = 1e30f; /* the forms must not depend on the work's contents */
    k3_kda_chunked_bf_ref(&h1, S[1], chunk, work);
    /* the reference form against the fp32 recurrence, within its bound */
    double *bo = malloc(sizeof(double) * no), *bs = malloc(sizeof(double) * ns);
    bf_bound(&in, S0, chunk, bo, bs);
    const int bad = bf_outside(o[1], o[0], bo, (int64_t)no, "o") + bf_outside(S[1], S[0], bs, (int64_t)ns, "S");
    const double eo = k3_test_rel_l2(o[1], o[0], (int64_t)no), es = k3_test_rel_l2(S[1], S[0], (int64_t)ns);
    if (eo > bf_worst[0]) bf_worst[0] = eo;
    if (es > bf_worst[1]) bf_worst[1] = es;
    CHECKF(bad == 0, "T=%d dk=%d dv=%d C=%d state=%d g>=%g: %d elements outside the BF16 bound (rel-L2 o %.3g S %.3g)",
           n, dk, dv, chunk, nonzero_state, g_floor, bad, eo, es);
    /* the kernels: the reference's bits (vdpbf16ps where the CPU has it,
     * the tiles through the "amx" table where the unit is granted) */
    static const char *names[2] = {"avx512-bf16", "amx"};
    for (int f = 2; f < 4; f++) {
        k3_kda_head hf = head(&in, o[f]);
        for (int64_t i = 0; i < nw; i++) work[i] = 1e30f;
        if (f == 2) {
            k3_kernels_force(K3_ISA_AVX512);
            if (!k3_kernels_bf16()) continue;
            k3_kda_chunked_bf_avx512(&hf, S[f], chunk, work);
        } else {
            k3_kernels_force(K3_ISA_AMX);
            if (!k3_kda_chunked_bf(&hf, S[f], chunk, work)) continue;
        }
        CHECKF(!memcmp(o[f], o[1], sizeof(float) * no) && !memcmp(S[f], S[1], sizeof(float) * ns),
               "%s: T=%d dk=%d dv=%d C=%d state=%d g>=%g differs from the reference (rel-L2 o %.3g S %.3g)",
               names[f - 2], n, dk, dv, chunk, nonzero_state, g_floor, k3_test_rel_l2(o[f], o[1], (int64_t)no),
               k3_test_rel_l2(S[f], S[1], (int64_t)ns));
    }
    k3_kernels_force(K3_ISA_COUNT);
    for (int f = 0; f < 4; f++) free(o[f]), free(S[f]);
    free(S0), free(work), free(bo), free(bs);
    free_in(&in);
}

K3_TEST(kda_bf16_matches_ref_bitwise_and_bound) {
    k3_kernels_init();
    rng = 777;
    /* g >= -5 (K3's bound): sub-blocks both flat and steep (a channel decays
     * by more than e^-40 across 16 tokens); -1: all flat; -40: all steep,
     * e^G underflows inside a chunk (the Kimi-Linear gate is unbounded) */
    static const int Ts[] = {1, 16, 17, 40, 64, 100, 130};
    static const int dims[][2] = {{128, 128}, {64, 32}, {32, 48}};
    for (int di = 0; di < 3; di++)
        for (int ti = 0; ti < 7; ti++)
            for (int s = 0; s < 2; s++) {
                if (dims[di][0] == 128 && Ts[ti] > 64 && s == 0) continue;
                check_bf(Ts[ti], dims[di][0], dims[di][1], K3_KDA_CHUNK_BF, s, -5.0f);
            }
    check_bf(100, 64, 32, 64, 1, -5.0f);
    check_bf(130, 128, 128, 64, 1, -1.0f);
    check_bf(130, 64, 64, 32, 1, -40.0f);
    check_bf(70, 128, 128, 32, 1, -0.05f);
    k3_kernels_force(K3_ISA_AVX512);
    const bool bf = k3_kernels_bf16();
    k3_kernels_force(K3_ISA_AMX);
    const bool amx = k3_kda_bf_available();
    k3_kernels_force(K3_ISA_COUNT);
    printf("    worst rel-L2 of the BF16 form vs the fp32 recurrence: o %.2g, S %.2g; kernels: avx512-bf16 %s, amx "
           "%s\n",
           bf_worst[0], bf_worst[1], bf ? "ran" : "absent", amx ? "ran" : "absent");
    if (!bf) SKIP("the CPU lacks AVX512_BF16: only the reference against fp32 ran");
}
