/* test_attn_ops.c -- QLI and QSFA fast paths == their scalar references,
 * quantized results == dequantize-then-fp32 to rounding, the exact LSE
 * merge, and the Hadamard transform. */
#include <stdlib.h>
#include <string.h>

#include "kernels/mla.h"
#include "kernels/attn_ops.h"
#include "kernels/kernels.h"
#include "test.h"

static uint64_t rng = 99;
static float frand(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) / 8388608.0) - 1.0f;
}

K3_TEST(hadamard_orthonormal) {
    float x[64], y[64];
    for (int i = 0; i < 64; i++) x[i] = y[i] = frand();
    k3_hadamard(y, 64);
    double nx = 0, ny = 0;
    for (int i = 0; i < 64; i++) {
        nx += x[i] * x[i];
        ny += y[i] * y[i];
    }
    CHECK(fabs(nx - ny) < 1e-4 * nx);
    k3_hadamard(y, 64); /* H is its own inverse when orthonormal */
    CHECK(k3_test_max_abs(x, y, 64) < 1e-5);
}

K3_TEST(qli_matches_ref_and_fp32) {
    /* AVX-512: 20 heads pad to 32, 64 dims are one 16 x 16 dword block, 128
     * two; 50 keys are 3 x 16 + 2 */
    const int shapes[][2] = {{20, 64}, {16, 128}, {4, 48}};
    enum { N = 50, MAXQ = 20 * 128, MAXK = N * 128 };
    for (int sh = 0; sh < 3; sh++) {
        const int HI = shapes[sh][0], DI = shapes[sh][1];
        float q[MAXQ], k[MAXK], w[20], ks[N], qs[20], s1[N], s2[N], s3[N];
        int8_t q8[MAXQ], k8[MAXK];
        int64_t slots[N];
        for (int i = 0; i < HI * DI; i++) q[i] = frand();
        for (int i = 0; i < N * DI; i++) k[i] = frand();
        for (int h = 0; h < HI; h++) w[h] = frand();
        for (int i = 0; i < N; i++) slots[i] = (i * 7) % N; /* a permutation */
        for (int h = 0; h < HI; h++) {
            if (DI % 64 == 0) k3_hadamard(q + h * DI, DI);
            qs[h] = k3_quant_i8(q + h * DI, DI, q8 + h * DI);
        }
        for (int i = 0; i < N; i++) {
            if (DI % 64 == 0) k3_hadamard(k + i * DI, DI);
            ks[i] = k3_quant_i8(k + i * DI, DI, k8 + i * DI);
        }
        for (int isa = K3_ISA_REF; isa <= K3_ISA_AVX512; isa++) {
            k3_kernels_force((k3_isa)isa);
            k3_qli_scores(q8, qs, w, HI, DI, k8, ks, slots, N, s1);
            k3_qli_scores_ref(q8, qs, w, HI, DI, k8, ks, slots, N, s2);
            CHECKF(k3_test_rel_l2(s1, s2, N) < 1e-6, "%dx%d isa %d: %g", HI, DI, isa, k3_test_rel_l2(s1, s2, N));
        }
        /* against fp32 scores on the same vectors: int8 rounding only */
        k3_indexer_scores(q, w, HI, DI, k, slots, N, s3);
        CHECKF(k3_test_rel_l2(s1, s3, N) < 0.03, "%dx%d int8 vs fp32 rel-L2 %g", HI, DI, k3_test_rel_l2(s1, s3, N));
    }
}

static void fill_c8(int n, int kvl, int rope, int8_t *c8, float *cs, float *kpe, float *cf) {
    const int nt = (kvl + K3_C8_TILE - 1) / K3_C8_TILE;
    for (int s = 0; s < n; s++) {
        float row[1024];
        for (int j = 0; j < kvl; j++) row[j] = frand() * (1 + (j / 128));
        k3_quant_i8_tiles(row, kvl, c8 + s * kvl, cs + s * nt);
        for (int j = 0; j < kvl; j++) cf[s * (kvl + rope) + j] = c8[s * kvl + j] * cs[s * nt + j / K3_C8_TILE];
        for (int j = 0; j < rope; j++) cf[s * (kvl + rope) + kvl + j] = kpe[s * rope + j] = frand();
    }
}

K3_TEST(qsfa_matches_ref_and_dequant_fp32) {
    enum { H = 6, KVL = 256, ROPE = 16, N = 43 }; /* AVX-512: heads 4 + 2 padded, slots 5 x 8 + 3 */
    const int nt = KVL / K3_C8_TILE;
    int8_t *c8 = malloc(N * KVL);
    float *cs = malloc(sizeof(float) * N * nt), *kpe = malloc(sizeof(float) * N * ROPE);
    float *cf = malloc(sizeof(float) * N * (KVL + ROPE));
    fill_c8(N, KVL, ROPE, c8, cs, kpe, cf);
    float qa[H * KVL], qpe[H * ROPE];
    for (int i = 0; i < H * KVL; i++) qa[i] = frand() * 0.3f;
    for (int i = 0; i < H * ROPE; i++) qpe[i] = frand();
    int64_t slots[N];
    for (int i = 0; i < N; i++) slots[i] = (i * 3) % N;
    k3_c8_cache c = {c8, cs, kpe, KVL, ROPE, nt};
    float o1[H * KVL], o2[H * KVL], l1[H], l2[H];
    float *work = malloc(sizeof(float) * (size_t)k3_qsfa_work(H, KVL, N));
    const float scale = 0.125f;
    k3_qsfa_ref(qa, qpe, H, &c, slots, N, scale, o2, l2, work);
    for (int isa = K3_ISA_REF; isa <= K3_ISA_AVX512; isa++) {
        k3_kernels_force((k3_isa)isa);
        k3_qsfa(qa, qpe, H, &c, slots, N, scale, o1, l1, work);
        CHECKF(k3_test_rel_l2(o1, o2, H * KVL) < 1e-5, "isa %d out %g", isa, k3_test_rel_l2(o1, o2, H * KVL));
        CHECKF(k3_test_max_abs(l1, l2, H) < 1e-4, "isa %d lse %g", isa, k3_test_max_abs(l1, l2, H));
    }
    /* equals fp32 absorbed attention on the dequantized cache */
    for (int h = 0; h < H; h++) {
        float out[KVL], sc[N];
        const float lse =
            k3_mla_attend(qa + h * KVL, qpe + h * ROPE, KVL, ROPE, cf, KVL + ROPE, slots, N, scale, sc, out);
        CHECK(k3_test_rel_l2(o1 + h * KVL, out, KVL) < 1e-5);
        CHECK(fabsf(lse - l1[h]) < 1e-4f);
    }
    /* split the slots in two and merge by LSE: equals the whole */
    float oa[H * KVL], ob[H * KVL], la[H], lb[H], om[H * KVL], lm[H];
    k3_qsfa(qa, qpe, H, &c, slots, 17, scale, oa, la, work);
    k3_qsfa(qa, qpe, H, &c, slots + 17, N - 17, scale, ob, lb, work);
    const float *os[2] = {oa, ob}, *ls[2] = {la, lb};
    k3_lse_merge(os, ls, 2, H, KVL, om, lm);
    CHECK(k3_test_rel_l2(om, o1, H * KVL) < 1e-5);
    CHECK(k3_test_max_abs(lm, l1, H) < 1e-4);
    /* an empty part weighs nothing */
    float oe[H * KVL], le[H];
    k3_qsfa(qa, qpe, H, &c, slots, 0, scale, oe, le, work);
    const float *os2[2] = {o1, oe}, *ls2[2] = {l1, le};
    k3_lse_merge(os2, ls2, 2, H, KVL, om, lm);
    CHECK(k3_test_rel_l2(om, o1, H * KVL) < 1e-6);
    free(c8);
    free(cs);
    free(kpe);
    free(cf);
    free(work);
}

/* QSFA on shapes only the AVX2 block form takes (rope 8, not a multiple of
 * 16), a part block alone (5 slots), an odd head count, and no slots. */
K3_TEST(qsfa_avx2_blocks_match_ref) {
    enum { H = 5, KVL = 128, ROPE = 8, N = 13, nt = KVL / K3_C8_TILE };
    int8_t c8[N * KVL];
    float cs[N * nt], kpe[N * ROPE], cf[N * (KVL + ROPE)];
    fill_c8(N, KVL, ROPE, c8, cs, kpe, cf);
    float qa[H * KVL], qpe[H * ROPE];
    for (int i = 0; i < H * KVL; i++) qa[i] = frand() * 0.5f;
    for (int i = 0; i < H * ROPE; i++) qpe[i] = frand();
    int64_t slots[N];
    for (int i = 0; i < N; i++) slots[i] = (i * 5) % N;
    k3_c8_cache c = {c8, cs, kpe, KVL, ROPE, nt};
    float o1[H * KVL], o2[H * KVL], l1[H], l2[H];
    float *work = malloc(sizeof(float) * (size_t)k3_qsfa_work(H, KVL, N));
    const int ns[] = {N, 5, 1, 0};
    for (int k = 0; k < 4; k++) {
        k3_qsfa_ref(qa, qpe, H, &c, slots, ns[k], 0.2f, o2, l2, work);
        for (int isa = K3_ISA_REF; isa <= K3_ISA_AVX512; isa++) {
            k3_kernels_force((k3_isa)isa);
            k3_qsfa(qa, qpe, H, &c, slots, ns[k], 0.2f, o1, l1, work);
            if (ns[k] == 0) {
                CHECKF(l1[0] == -INFINITY && l1[H - 1] == -INFINITY, "isa %d: no slots, lse %g", isa, l1[0]);
                continue;
            }
            CHECKF(k3_test_rel_l2(o1, o2, H * KVL) < 1e-5, "n %d isa %d out %g", ns[k], isa,
                   k3_test_rel_l2(o1, o2, H * KVL));
            CHECKF(k3_test_max_abs(l1, l2, H) < 1e-4, "n %d isa %d lse %g", ns[k], isa, k3_test_max_abs(l1, l2, H));
        }
    }
    k3_kernels_force(K3_ISA_AVX512);
    free(work);
}

/* ---- QSFA's BF16 form ------------------------------------------------------------ */

typedef struct qbf_case {
    int H, kvl, rope, n;
} qbf_case;

/* The bound of the BF16 form against the exact attention (k3_qsfa_ref), per
 * output element: the query rounded to BF16 (2^-9 relative), the rope key
 * held to 2^-16 by hi + lo, fp32 sums of K terms move score i by at most
 * dz_i = scale (2^-9 + 2^-16 + K 2^-24) Σ_d |q_d k_d|; the softmax then moves
 * each weight by a factor within exp(±2 max dz); P is rounded to BF16 (2^-9)
 * and the values' sums add n 2^-24: |o - ref| <= (e^(2 dz) - 1 + 2^-8 +
 * 2n 2^-24) Σ_i p_i |v_i| (+ 1e-7 of the output's scale for the reference's
 * own fp32 rounding). lse moves by at most 2 max dz + 2^-20. */
static void qbf_bound(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                      float scale, const float *o_ref, const float *l_ref, const float *o, const float *l, int *bad) {
    const int kvl = c->kv_lora, rope = c->rope, K = kvl + 2 * rope;
    for (int h = 0; h < H; h++) {
        double dz = 0.0;
        double *p = malloc(sizeof(double) * (size_t)n);
        for (int i = 0; i < n; i++) {
            double a = 0.0;
            for (int d = 0; d < kvl; d++)
                a += fabs((double)qa[h * kvl + d] * c->c8[slots[i] * kvl + d] * c->cs[slots[i] * c->n_tiles + d / 128]);
            for (int d = 0; d < rope; d++) a += fabs((double)qpe[h * rope + d] * c->kpe[slots[i] * rope + d]);
            const double di = scale * (ldexp(1, -9) + ldexp(1, -16) + K * ldexp(1, -24)) * a;
            dz = di > dz ? di : dz;
            p[i] = 0.0;
        }
        /* the exact weights from the reference's lse: p_i = exp(z_i - lse) */
        for (int i = 0; i < n; i++) {
            double z = 0.0;
            for (int d = 0; d < kvl; d++)
                z += (double)qa[h * kvl + d] * c->c8[slots[i] * kvl + d] * c->cs[slots[i] * c->n_tiles + d / 128];
            for (int d = 0; d < rope; d++) z += (double)qpe[h * rope + d] * c->kpe[slots[i] * rope + d];
            p[i] = exp(z * scale - l_ref[h]);
        }
        const double f = expm1(2 * dz) + ldexp(1, -8) + 2.0 * n * ldexp(1, -24);
        for (int d = 0; d < kvl; d++) {
            double mag = 0.0;
            for (int i = 0; i < n; i++)
                mag += p[i] * fabs((double)c->c8[slots[i] * kvl + d] * c->cs[slots[i] * c->n_tiles + d / 128]);
            const double err = fabs((double)o[h * kvl + d] - o_ref[h * kvl + d]);
            if (err > f * mag + 1e-7 * mag + 1e-30) {
                if (*bad < 3)
                    fprintf(stderr, "  h %d d %d: |%g - %g| > %g\n", h, d, o[h * kvl + d], o_ref[h * kvl + d], f * mag);
                ++*bad;
            }
        }
        if (fabs((double)l[h] - l_ref[h]) > 2 * dz + ldexp(1, -20) * (1 + fabs(l_ref[h]))) {
            if (*bad < 3) fprintf(stderr, "  h %d lse %g vs %g\n", h, l[h], l_ref[h]);
            ++*bad;
        }
        free(p);
    }
}

K3_TEST(qsfa_bf16_kernels_match_ref_bitwise) {
    /* the bench shape with a tail block of slots; a short last latent block
     * (96) and an odd head count; more than 16 heads; one slot; none */
    const qbf_case cases[] = {{16, 512, 64, 77}, {5, 96, 16, 33}, {20, 64, 16, 40}, {3, 128, 32, 1}, {4, 64, 16, 0}};
    k3_kernels_force(K3_ISA_AVX512);
    const bool have_bf = k3_kernels_bf16();
    const bool have_amx = k3_kernels_have(K3_ISA_AMX);
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const qbf_case q = cases[ci];
        const int H = q.H, KVL = q.kvl, ROPE = q.rope, N = q.n, NS = N + 5, nt = (KVL + 127) / 128;
        int8_t *c8 = malloc((size_t)NS * KVL);
        float *cs = malloc(sizeof(float) * NS * nt), *kpe = malloc(sizeof(float) * NS * ROPE);
        float *cf = malloc(sizeof(float) * NS * (KVL + ROPE));
        fill_c8(NS, KVL, ROPE, c8, cs, kpe, cf);
        float *qa = malloc(sizeof(float) * H * KVL), *qpe = malloc(sizeof(float) * H * ROPE);
        for (int i = 0; i < H * KVL; i++) qa[i] = frand() * 0.3f;
        for (int i = 0; i < H * ROPE; i++) qpe[i] = frand();
        int64_t *slots = malloc(sizeof(int64_t) * (NS + 1));
        for (int i = 0; i < NS; i++) slots[i] = (i * 7 + 3) % NS;
        k3_c8_cache c = {c8, cs, kpe, KVL, ROPE, nt, true};
        CHECK(k3_qsfa_bf16_fits(&c));
        const size_t no = (size_t)H * KVL;
        float *o_ref = malloc(sizeof(float) * no), *o = malloc(sizeof(float) * no), *o32 = malloc(sizeof(float) * no);
        float *l_ref = malloc(sizeof(float) * H), *l = malloc(sizeof(float) * H), *l32 = malloc(sizeof(float) * H);
        float *work = malloc(sizeof(float) * (size_t)k3_qsfa_work(H, KVL, N));
        const float scale = 0.1f;
        k3_qsfa_bf16_ref(qa, qpe, H, &c, slots, N, scale, o_ref, l_ref, work);
        /* the fp32 reference, within the bound of the BF16 roundings */
        k3_qsfa_ref(qa, qpe, H, &c, slots, N, scale, o32, l32, work);
        int bad = 0;
        if (N > 0) qbf_bound(qa, qpe, H, &c, slots, N, scale, o32, l32, o_ref, l_ref, &bad);
        else CHECK(!memcmp(o32, o_ref, sizeof(float) * no));
        CHECKF(bad == 0, "case %zu: %d elements outside the BF16 bound", ci, bad);
        if (N > 0)
            CHECKF(k3_test_rel_l2(o_ref, o32, (int64_t)no) < 4e-3, "case %zu rel-L2 %g", ci,
                   k3_test_rel_l2(o_ref, o32, (int64_t)no));
        /* the kernels: bit for bit */
        for (int t = 0; t < 2; t++) {
            if (t == 0 && !have_bf) continue;
            if (t == 1 && !have_amx) continue;
            k3_kernels_force(t ? K3_ISA_AMX : K3_ISA_AVX512);
            memset(o, 0x7f, sizeof(float) * no);
            k3_qsfa(qa, qpe, H, &c, slots, N, scale, o, l, work);
            CHECKF(!memcmp(o, o_ref, sizeof(float) * no), "case %zu %s: out differs from the reference (rel-L2 %g)", ci,
                   t ? "amx" : "avx512-bf16", k3_test_rel_l2(o, o_ref, (int64_t)no));
            CHECKF(!memcmp(l, l_ref, sizeof(float) * H), "case %zu %s: lse differs", ci, t ? "amx" : "avx512-bf16");
            /* heads are independent: the last heads alone give the same bits */
            if (H > 2 && N > 0) {
                float *o2 = malloc(sizeof(float) * no), l2[32];
                k3_qsfa(qa + 2 * KVL, qpe + 2 * ROPE, H - 2, &c, slots, N, scale, o2, l2, work);
                CHECK(!memcmp(o2, o_ref + 2 * KVL, sizeof(float) * (no - 2 * KVL)));
                CHECK(!memcmp(l2, l_ref + 2, sizeof(float) * (size_t)(H - 2)));
                free(o2);
            }
        }
        /* c.bf16 off, or a table without the form: the fp32 kernels */
        c.bf16 = false;
        k3_kernels_force(K3_ISA_AVX512);
        k3_qsfa(qa, qpe, H, &c, slots, N, scale, o, l, work);
        if (N > 0) CHECK(k3_test_rel_l2(o, o32, (int64_t)no) < 1e-5);
        c.bf16 = true;
        k3_kernels_force(K3_ISA_AVX2);
        k3_qsfa(qa, qpe, H, &c, slots, N, scale, o, l, work);
        if (N > 0) CHECK(k3_test_rel_l2(o, o32, (int64_t)no) < 1e-5);
        k3_kernels_force(K3_ISA_COUNT);
        free(c8), free(cs), free(kpe), free(cf), free(qa), free(qpe), free(slots);
        free(o_ref), free(o), free(o32), free(l_ref), free(l), free(l32), free(work);
    }
    if (!have_bf) SKIP("the CPU lacks AVX512_BF16: only the reference against fp32 ran");
}
