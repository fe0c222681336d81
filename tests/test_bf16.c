/*
 * test_bf16.c -- the BF16 dot products (src/kernels/kernels_isa.h, "BF16 dot
 * products"): the strips against the matrices they are made from, the
 * scalar reference against the exact product within the BF16 bound, the
 * AVX-512 BF16 kernels against the scalar reference bit for bit (on a CPU
 * whose vdpbf16ps adds a pair as Intel's does; within the bound elsewhere),
 * the AMX tiles (the unit, and emulated) against the AVX-512 kernels bit for
 * bit at every row count, and each token's bits independent of the tokens,
 * rows and threads its call had.
 *
 * The bound: the weights are exact BF16 values, each activation is rounded
 * to BF16 (relative error <= 2^-8), products are exact in fp32 and a sum of
 * K terms rounds K times, so |y - ref| <= sum_k |w_k x_k| (2^-8 + K 2^-24).
 */
#include "test.h"

#include "k3.h"
#include "common/pool.h"
#include "kernels/amx.h"
#include "kernels/kernels.h"
#include "kernels/kernels_isa.h"
#include "kernels/quant.h"

#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float frand(float a) { return ((float)(rnd() % 20001) / 10000.0f - 1.0f) * a; }

static float *fvec(int64_t n, float a) {
    float *v = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) v[i] = frand(a) * (i % 7 == 0 ? 8.0f : 1.0f);
    return v;
}

static k3_mat bf16_mat(int64_t rows, int64_t cols) {
    uint16_t *d = malloc(2 * (size_t)(rows * cols));
    for (int64_t i = 0; i < rows * cols; i++) d[i] = k3_f32_to_bf16(frand(1.0f) * (i % 5 == 0 ? 16.0f : 1.0f));
    return (k3_mat){.type = K3_W_BF16, .rows = rows, .cols = cols, .data = d, .bf16 = true};
}

/* MXFP4 with scales in [emin, emin + espan), every 9th block all zero */
static k3_mat mx4_mat(int64_t rows, int64_t cols, int emin, int espan) {
    uint8_t *d = malloc((size_t)(rows * cols / 2)), *s = malloc((size_t)(rows * cols / 32));
    for (int64_t i = 0; i < rows * cols / 2; i++) d[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < rows * cols / 32; i++) {
        s[i] = (uint8_t)(emin + (int)(rnd() % (uint32_t)espan));
        if (i % 9 == 4) {
            memset(d + 16 * i, i % 2 ? 0x88 : 0, 16); /* +-0 codes */
            s[i] = (uint8_t)(i % 4 ? 0 : 254);        /* a scale the codes never meet */
        }
    }
    return (k3_mat){.type = K3_W_MXFP4, .rows = rows, .cols = cols, .data = d, .scale = s, .bf16 = true};
}

/* The strips of w (k3_s16_pack), in memory of their own. */
static k3_mat strips(const k3_mat *w) {
    k3_mat s = *w;
    uint8_t *d = malloc(k3_mat_data_bytes(w)), *sc = w->scale ? malloc(k3_mat_scale_bytes(w)) : NULL;
    k3_s16_pack(w, d, sc);
    s.type = w->type == K3_W_MXFP4 ? K3_W_MXFP4_S16 : K3_W_BF16_S16;
    s.data = d;
    s.scale = sc;
    s.wrange = k3_mat_wrange(&s); /* as the loader marks them */
    return s;
}

static void mat_free(k3_mat *w) {
    free((void *)w->data);
    free((void *)w->scale);
}

/* sum_k |w_k x_k| for every (token, row) */
static double *abs_sums(const k3_mat *w, const float *x, int64_t n) {
    double *s = calloc((size_t)(n * w->rows), sizeof(double));
    float *row = malloc(sizeof(float) * (size_t)w->cols);
    for (int64_t r = 0; r < w->rows; r++) {
        k3_mat_get_row(w, r, row);
        for (int64_t t = 0; t < n; t++) {
            double a = 0;
            for (int64_t c = 0; c < w->cols; c++) a += fabs((double)row[c] * x[t * w->cols + c]);
            s[t * w->rows + r] = a;
        }
    }
    free(row);
    return s;
}

static int within_bound(const k3_mat *w, const float *x, int64_t n, const float *y, const char *what) {
    float *ref = malloc(sizeof(float) * (size_t)(n * w->rows));
    k3_mat plain = *w;
    plain.bf16 = false;
    k3_matmul_ref(&plain, x, n, ref); /* exact weights, fp32 x, sums in double */
    double *abs = abs_sums(w, x, n);
    const double rel = 1.0 / 256 + (double)w->cols / 16777216.0;
    int bad = 0;
    for (int64_t i = 0; i < n * w->rows; i++) {
        const double tol = abs[i] * rel * 1.0001 + 1e-30;
        if (!(fabs((double)y[i] - ref[i]) <= tol) && bad++ < 3)
            printf("    %s: element %lld: %.9g vs exact %.9g (bound %.3g)\n", what, (long long)i, y[i], ref[i], tol);
    }
    free(ref);
    free(abs);
    return bad;
}

/* The scalar reference of the BF16 dot products over all rows. */
static void bf16_ref(const k3_mat *w, const float *x, int64_t n, float *y) {
    k3_bf16_rows_ref(w, x, n, y, w->rows, 0, w->rows);
}

/* Whether this CPU's vdpbf16ps is the one the strips are arranged for
 * (Intel's: a lane adds its high product, then its low one, each rounded):
 * then the AVX-512 kernels must give the reference's bits. */
static bool vdp_as_intel(void) {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel");
}

static const char *type_name(const k3_mat *w) { return k3_wtype_info(w->type)->name; }

K3_TEST(bf16_strips_pack) {
    k3_mat b = bf16_mat(48, 96), m = mx4_mat(32, 128, 100, 40);
    k3_mat sb = strips(&b), sm = strips(&m);
    float *r0 = malloc(sizeof(float) * 128), *r1 = malloc(sizeof(float) * 128);
    int bad = 0;
    for (int64_t r = 0; r < 48; r++) {
        k3_mat_get_row(&b, r, r0);
        k3_mat_get_row(&sb, r, r1);
        bad += memcmp(r0, r1, sizeof(float) * 96) != 0;
    }
    for (int64_t r = 0; r < 32; r++) {
        k3_mat_get_row(&sm, r, r1);
        k3_mat_get_row(&m, r, r0);
        bad += memcmp(r0, r1, sizeof(float) * 128) != 0;
    }
    CHECKF(bad == 0, "%d strip rows differ from their source", bad);
    /* every element lands on its own place */
    uint16_t *seen = calloc(48 * 96, sizeof(uint16_t));
    for (int64_t r = 0; r < 48; r++)
        for (int64_t c = 0; c < 96; c++) seen[k3_s16_bf16_at(96, r, c)]++;
    for (int64_t i = 0; i < 48 * 96; i++) bad += seen[i] != 1;
    CHECKF(bad == 0, "k3_s16_bf16_at is not a permutation (%d)", bad);
    free(seen);
    free(r0);
    free(r1);
    mat_free(&sb);
    mat_free(&sm);
    mat_free(&b);
    mat_free(&m);
}

K3_TEST(bf16_mat_ok_scales) {
    k3_mat m = mx4_mat(16, 64, 100, 40);
    CHECK(k3_bf16_mat_ok(&m)); /* zero blocks with scales 0 and 254 are taken */
    uint8_t *s = (uint8_t *)m.scale;
    const uint8_t keep = s[1];
    s[1] = 1; /* a block with nonzero codes whose weights would be BF16 denormals */
    CHECK(!k3_bf16_mat_ok(&m));
    s[1] = 253; /* ... or overflow */
    CHECK(!k3_bf16_mat_ok(&m));
    s[1] = 252;
    CHECK(k3_bf16_mat_ok(&m));
    s[1] = keep;
    s[4] = 255; /* NaN, even on a zero block */
    CHECK(!k3_bf16_mat_ok(&m));
    k3_mat f = {.type = K3_W_F32, .rows = 1, .cols = 32, .data = m.data};
    CHECK(!k3_bf16_mat_ok(&f));
    mat_free(&m);
}

K3_TEST(bf16_reference_within_bound) {
    k3_mat mats[3] = {bf16_mat(37, 70), bf16_mat(16, 1024), mx4_mat(32, 256, 110, 25)};
    for (int i = 0; i < 3; i++) {
        const int64_t n = 5;
        float *x = fvec(n * mats[i].cols, 2.0f), *y = malloc(sizeof(float) * (size_t)(n * mats[i].rows));
        bf16_ref(&mats[i], x, n, y);
        CHECKF(!within_bound(&mats[i], x, n, y, type_name(&mats[i])), "%s: reference outside the BF16 bound",
               type_name(&mats[i]));
        free(x);
        free(y);
        mat_free(&mats[i]);
    }
}

/* k3_matmul on the current table against the reference: the same bits (or,
 * where vdpbf16ps is not Intel's, within the bound); returns mismatches. */
static int against_ref(const k3_mat *w, int64_t n, bool exact, const char *table) {
    float *x = fvec(n * w->cols, 2.0f);
    float *y = malloc(sizeof(float) * (size_t)(n * w->rows)), *r = malloc(sizeof(float) * (size_t)(n * w->rows));
    k3_matmul(NULL, w, x, n, y);
    bf16_ref(w, x, n, r);
    int bad = 0;
    if (exact) {
        for (int64_t i = 0; i < n * w->rows; i++)
            if (memcmp(&y[i], &r[i], 4) && bad++ < 3)
                printf("    %s %s %lldx%lld n=%lld: element %lld %.9g vs reference %.9g\n", table, type_name(w),
                       (long long)w->rows, (long long)w->cols, (long long)n, (long long)i, y[i], r[i]);
    } else {
        bad = within_bound(w, x, n, y, type_name(w));
    }
    free(x);
    free(y);
    free(r);
    return bad;
}

/* The matrices every table test runs: stored BF16 with tails, stored MXFP4,
 * and both as strips. */
enum { NMATS = 6 };
static void test_mats(k3_mat m[NMATS]) {
    m[0] = bf16_mat(37, 70);
    m[1] = mx4_mat(40, 96, 100, 40);
    m[2] = bf16_mat(64, 256);
    m[3] = strips(&m[2]);
    m[4] = mx4_mat(48, 512, 110, 25);
    m[5] = strips(&m[4]);
}

static void free_mats(k3_mat m[NMATS]) {
    for (int i = 0; i < NMATS; i++) mat_free(&m[i]);
}

K3_TEST(bf16_avx512_equals_reference) {
    k3_error err = {0};
    if (k3_set_isa("avx512-bf16", &err) != K3_OK) {
        printf("    (not run: %s)\n", err.msg);
        return;
    }
    const bool exact = vdp_as_intel();
    if (!exact) printf("    (this CPU's vdpbf16ps is not Intel's: held to the bound, not to the reference's bits)\n");
    k3_mat m[NMATS];
    test_mats(m);
    static const int64_t ns[] = {1, 2, 3, 4, 5, 8, 13, 16, 17, 33};
    for (int i = 0; i < NMATS; i++)
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++)
            CHECKF(!against_ref(&m[i], ns[k], exact, "avx512-bf16"), "avx512-bf16 %s n=%lld", type_name(&m[i]),
                   (long long)ns[k]);
    free_mats(m);
    k3_set_isa(NULL, &err);
}

/* Inputs near the ends of the range: denormal and tiny activations and
 * weights, which both instructions read as zero or flush. */
K3_TEST(bf16_avx512_flushes_as_reference) {
    k3_error err = {0};
    if (k3_set_isa("avx512-bf16", &err) != K3_OK || !vdp_as_intel()) {
        printf("    (not run: %s)\n", err.msg[0] ? err.msg : "vdpbf16ps is not Intel's here");
        k3_set_isa(NULL, &err);
        return;
    }
    k3_mat w = bf16_mat(32, 96);
    uint16_t *d = (uint16_t *)w.data;
    for (int64_t i = 0; i < 32 * 96; i += 3) d[i] = (uint16_t)((d[i] & 0x807f) | (rnd() % 4) << 7); /* exp 0..3 */
    float *x = fvec(4 * 96, 1.0f);
    for (int64_t i = 0; i < 4 * 96; i += 2) x[i] *= 1e-37f;
    float *y = malloc(sizeof(float) * 4 * 32), *r = malloc(sizeof(float) * 4 * 32);
    k3_matmul(NULL, &w, x, 4, y);
    bf16_ref(&w, x, 4, r);
    CHECK(!memcmp(y, r, sizeof(float) * 4 * 32));
    free(x);
    free(y);
    free(r);
    mat_free(&w);
    k3_set_isa(NULL, &err);
}

/* A token's bits whatever its call: alone, among others at any offset, with
 * any row range (the pool's split), on one thread or two. */
static int batch_invariant(const k3_mat *w, k3_pool *pool) {
    const int64_t n = 40, rows = w->rows, cols = w->cols;
    float *x = fvec(n * cols, 2.0f), *y = malloc(sizeof(float) * (size_t)(n * rows));
    float *y1 = malloc(sizeof(float) * (size_t)(n * rows));
    k3_matmul(pool, w, x, n, y);
    int bad = 0;
    for (int64_t t = 0; t < n; t += 3) { /* alone */
        k3_matmul(NULL, w, x + t * cols, 1, y1);
        bad += memcmp(y1, y + t * rows, sizeof(float) * (size_t)rows) != 0;
    }
    static const int64_t parts[][2] = {{5, 7}, {3, 16}, {20, 17}, {1, 4}};
    for (size_t p = 0; p < sizeof parts / sizeof parts[0]; p++) { /* among others */
        const int64_t t0 = parts[p][0], nt = parts[p][1];
        k3_matmul(p % 2 ? pool : NULL, w, x + t0 * cols, nt, y1);
        bad += memcmp(y1, y + t0 * rows, sizeof(float) * (size_t)(nt * rows)) != 0;
    }
    if (w->rows > 16) { /* the rows from the second strip on, as a view */
        const k3_mat v = k3_mat_rows(w, 16, w->rows - 16);
        k3_matmul(NULL, &v, x, n, y1);
        for (int64_t t = 0; t < n; t++)
            bad += memcmp(y1 + t * (rows - 16), y + t * rows + 16, sizeof(float) * (size_t)(rows - 16)) != 0;
    }
    free(x);
    free(y);
    free(y1);
    return bad;
}

K3_TEST(bf16_batch_invariant) {
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    k3_error err = {0};
    static const char *const isas[] = {"avx512-bf16", "amx"};
    k3_mat m[NMATS];
    test_mats(m);
    for (int k = 0; k < 2; k++) {
        if (k3_set_isa(isas[k], &err) != K3_OK) {
            if (k == 0 || !k3_kernels_force_amx_emulated()) {
                printf("    (%s not run: %s)\n", isas[k], err.msg);
                continue;
            }
        }
        for (int i = 0; i < NMATS; i++)
            CHECKF(!batch_invariant(&m[i], pool), "%s %s: a token's bits depend on its call", isas[k],
                   type_name(&m[i]));
    }
    free_mats(m);
    k3_pool_free(pool);
    k3_set_isa(NULL, &err);
}

/* The "amx" table (the unit where it is granted, and the emulation) gives
 * the "avx512-bf16" table's bits at every row count: the tiles from 16 rows
 * on, the AVX-512 kernels below. */
K3_TEST(bf16_amx_equals_avx512) {
    k3_error err = {0};
    if (k3_set_isa("avx512-bf16", &err) != K3_OK) {
        printf("    (not run: %s)\n", err.msg);
        return;
    }
    k3_mat m[NMATS];
    test_mats(m);
    static const int64_t ns[] = {1, 3, 15, 16, 17, 31, 32, 33, 70};
    float *x = fvec(70 * 512, 2.0f);
    float *ya = malloc(sizeof(float) * 70 * 64), *yb = malloc(sizeof(float) * 70 * 64);
    for (int unit = 1; unit >= 0; unit--) {
        const bool ok = unit ? k3_set_isa("amx", &err) == K3_OK : k3_kernels_force_amx_emulated();
        if (!ok) {
            printf("    (%s not tested: %s)\n", unit ? "the AMX unit" : "the AMX emulation", err.msg);
            continue;
        }
        for (int i = 0; i < NMATS; i++)
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                const int64_t n = ns[k], len = n * m[i].rows;
                k3_kernels_force_amx_emulated(); /* reset below */
                if (unit) k3_set_isa("amx", NULL);
                k3_matmul(NULL, &m[i], x, n, ya);
                k3_set_isa("avx512-bf16", NULL);
                k3_matmul(NULL, &m[i], x, n, yb);
                CHECKF(!memcmp(ya, yb, sizeof(float) * (size_t)len), "%s: amx (%s) %s n=%lld differs from avx512-bf16",
                       type_name(&m[i]), unit ? "unit" : "emulated", type_name(&m[i]), (long long)n);
            }
    }
    free(x);
    free(ya);
    free(yb);
    free_mats(m);
    k3_set_isa(NULL, &err);
}

/* The tiles' loop orders by the product's width (amx_kern.inc: whole-K
 * passes where K <= 1024 or 2048 < K <= 8192, column chunks between and
 * above) give the "avx512-bf16" table's bits, as strips of BF16 and MXFP4,
 * at token counts that fill one token block, several, and a ragged end. */
K3_TEST(bf16_amx_equals_avx512_wide) {
    k3_error err = {0};
    if (k3_set_isa("avx512-bf16", &err) != K3_OK) {
        printf("    (not run: %s)\n", err.msg);
        return;
    }
    static const int64_t ks[] = {1536, 2048, 2112, 5632, 8256};
    static const int64_t ns[] = {16, 33, 70, 130};
    float *x = fvec(130 * 8256, 2.0f);
    float *ya = malloc(sizeof(float) * 130 * 48), *yb = malloc(sizeof(float) * 130 * 48);
    for (int unit = 1; unit >= 0; unit--) {
        const bool ok = unit ? k3_set_isa("amx", &err) == K3_OK : k3_kernels_force_amx_emulated();
        if (!ok) {
            printf("    (%s not tested: %s)\n", unit ? "the AMX unit" : "the AMX emulation", err.msg);
            continue;
        }
        for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++)
            for (int mx = 0; mx < 2; mx++) {
                k3_mat w0 = mx ? mx4_mat(48, ks[ki], 118, 16) : bf16_mat(48, ks[ki]);
                k3_mat w = strips(&w0);
                for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                    const int64_t n = ns[k];
                    k3_kernels_force_amx_emulated(); /* reset below */
                    if (unit) k3_set_isa("amx", NULL);
                    k3_matmul(NULL, &w, x, n, ya);
                    k3_set_isa("avx512-bf16", NULL);
                    k3_matmul(NULL, &w, x, n, yb);
                    CHECKF(!memcmp(ya, yb, sizeof(float) * (size_t)(n * 48)),
                           "amx (%s) %s 48x%lld n=%lld differs from avx512-bf16", unit ? "unit" : "emulated",
                           type_name(&w), (long long)ks[ki], (long long)n);
                }
                mat_free(&w);
                mat_free(&w0);
            }
    }
    free(x);
    free(ya);
    free(yb);
    k3_set_isa(NULL, &err);
}

/* The routed experts grouped on the tiles (k3_moe_experts, AMX) against the
 * experts one at a time through k3_matmul and k3_glu on "avx512-bf16": the
 * same bits, BF16 and MXFP4 experts, as stored and as strips, with experts
 * of 0, 1 and many rows. */
K3_TEST(bf16_moe_grouped_equals_one_by_one) {
    k3_error err = {0};
    if (k3_set_isa("avx512-bf16", &err) != K3_OK) {
        printf("    (not run: %s)\n", err.msg);
        return;
    }
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    enum { E = 6, K = 2, T = 45, D = 96, I = 64 };
    for (int variant = 0; variant < 3; variant++) {
        k3_mat gate[E], up[E], down[E];
        for (int e = 0; e < E; e++) {
            if (variant == 0) gate[e] = bf16_mat(I, D), up[e] = bf16_mat(I, D), down[e] = bf16_mat(D, I);
            else gate[e] = mx4_mat(I, D, 110, 20), up[e] = mx4_mat(I, D, 110, 20), down[e] = mx4_mat(D, I, 110, 20);
            if (variant == 2) {
                k3_mat *ws[3] = {&gate[e], &up[e], &down[e]};
                for (int j = 0; j < 3; j++) {
                    k3_mat st = strips(ws[j]);
                    mat_free(ws[j]);
                    *ws[j] = st;
                }
            }
        }
        const int64_t Dl = D, Ih = I;
        /* routing: expert 5 gets nothing, expert 1 one row, the rest many */
        int32_t rid[T * K], row0[E + 1] = {0}, rows[T * K], eact[E], na = 0;
        for (int i = 0; i < T * K; i++) rid[i] = i == 7 ? 1 : (int32_t)(rnd() % 4 == 0 ? 0 : 2 + rnd() % 3);
        for (int i = 0; i < T * K; i++) row0[rid[i] + 1]++;
        for (int e = 0; e < E; e++) row0[e + 1] += row0[e];
        int32_t fill[E];
        memcpy(fill, row0, sizeof fill);
        for (int i = 0; i < T * K; i++) rows[fill[rid[i]]++] = i;
        for (int e = 0; e < E; e++)
            if (row0[e + 1] > row0[e]) eact[na++] = e;
        float *z = fvec(T * Dl, 2.0f), *y1 = calloc((size_t)(T * K * Dl), sizeof(float));
        float *y2 = calloc((size_t)(T * K * Dl), sizeof(float));
        float *g = malloc(sizeof(float) * (size_t)(T * K * Dl)), *f1 = malloc(sizeof(float) * (size_t)(T * K * Ih));
        float *f2 = malloc(sizeof(float) * (size_t)(T * K * Ih)), *lo = malloc(sizeof(float) * (size_t)(T * K * Dl));
        for (int a = 0; a < na; a++) { /* one by one, as moe.c does */
            const int e = eact[a], m = row0[e + 1] - row0[e];
            for (int r = 0; r < m; r++) memcpy(g + r * Dl, z + rows[row0[e] + r] / K * Dl, sizeof(float) * Dl);
            k3_matmul(pool, &gate[e], g, m, f1);
            k3_matmul(pool, &up[e], g, m, f2);
            k3_glu(f1, f2, (int64_t)m * Ih, K3_GLU_SWIGLU, 0, 0);
            k3_matmul(pool, &down[e], f1, m, lo);
            for (int r = 0; r < m; r++) memcpy(y1 + rows[row0[e] + r] * Dl, lo + r * Dl, sizeof(float) * Dl);
        }
        bool ran = false;
        for (int unit = 1; unit >= 0; unit--) {
            if (!(unit ? k3_set_isa("amx", NULL) == K3_OK : k3_kernels_force_amx_emulated())) continue;
            memset(y2, 0, sizeof(float) * (size_t)(T * K * Dl));
            const bool did =
                k3_moe_experts(pool, gate, up, down, eact, na, row0, rows, K, z, Dl, y2, Dl, K3_GLU_SWIGLU, 0, 0);
            CHECKF(did, "variant %d: the amx table did not group the experts", variant);
            CHECKF(!memcmp(y1, y2, sizeof(float) * (size_t)(T * K * Dl)), "variant %d (%s): grouped experts differ",
                   variant, unit ? "unit" : "emulated");
            ran = true;
        }
        k3_set_isa("avx512-bf16", NULL);
        CHECK(!k3_moe_experts(pool, gate, up, down, eact, na, row0, rows, K, z, Dl, y2, Dl, K3_GLU_SWIGLU, 0, 0));
        if (!ran) printf("    (no AMX unit or emulation: grouped experts not run)\n");
        for (int e = 0; e < E; e++) {
            mat_free(&gate[e]);
            mat_free(&up[e]);
            mat_free(&down[e]);
        }
        free(z), free(y1), free(y2), free(g), free(f1), free(f2), free(lo);
    }
    k3_pool_free(pool);
    k3_set_isa(NULL, &err);
}

/* Sparse routing (a batched decode step: a row or two per active expert)
 * stays off the grouped tiles: each expert then goes through k3_matmul on
 * the AVX-512 BF16 kernels, which decode the weights in registers (the same
 * bits, bf16_moe_grouped_equals_one_by_one). */
K3_TEST(bf16_moe_sparse_routing_not_grouped) {
    k3_error err = {0};
    if (k3_set_isa("amx", &err) != K3_OK) {
        printf("    (not run: %s)\n", err.msg);
        return;
    }
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    enum { E = 32, K = 4, T = 8, D = 96, I = 64 };
    k3_mat gate[E], up[E], down[E];
    for (int e = 0; e < E; e++) gate[e] = bf16_mat(I, D), up[e] = bf16_mat(I, D), down[e] = bf16_mat(D, I);
    float *z = fvec(T * D, 2.0f), *y = calloc((size_t)(T * K * D), sizeof(float));
    for (int dense = 0; dense < 2; dense++) {
        /* sparse: 32 rows on 32 experts, one each; dense: the same rows on 2 */
        int32_t row0[E + 1] = {0}, rows[T * K], eact[E], na = 0;
        for (int i = 0; i < T * K; i++) row0[(dense ? i / (T * K / 2) : i) + 1]++;
        for (int e = 0; e < E; e++) row0[e + 1] += row0[e];
        for (int i = 0; i < T * K; i++) rows[i] = i;
        for (int e = 0; e < E; e++)
            if (row0[e + 1] > row0[e]) eact[na++] = e;
        const bool did = k3_moe_experts(pool, gate, up, down, eact, na, row0, rows, K, z, D, y, D, K3_GLU_SWIGLU, 0, 0);
        CHECKF(did == (dense == 1), "%s routing (%d rows on %d experts): grouped %d", dense ? "dense" : "sparse", T * K,
               na, did);
    }
    for (int e = 0; e < E; e++) {
        mat_free(&gate[e]);
        mat_free(&up[e]);
        mat_free(&down[e]);
    }
    free(z), free(y);
    k3_pool_free(pool);
    k3_set_isa(NULL, &err);
}

/* ---- the few-token products on fp32 FMAs (matmul_bf16_avx512bf16.c) ---- */

/* k3_mat_wrange: the weights whose products with in-range activations are
 * normal floats (a block of zero codes may carry any scale). */
K3_TEST(bf16_wrange) {
    k3_mat b = bf16_mat(32, 64);
    CHECK(k3_mat_wrange(&b));
    ((uint16_t *)b.data)[77] = 0x0080; /* 2^-126 */
    CHECK(!k3_mat_wrange(&b));
    ((uint16_t *)b.data)[77] = 0x0001; /* a denormal: read as zero */
    CHECK(k3_mat_wrange(&b));
    ((uint16_t *)b.data)[77] = 0x5f80; /* 2^64 */
    CHECK(!k3_mat_wrange(&b));
    mat_free(&b);
    k3_mat m = mx4_mat(32, 256, 110, 25); /* zero blocks with scales 0 and 254 */
    CHECK(k3_mat_wrange(&m));
    k3_mat s = strips(&m);
    CHECK(s.wrange);
    ((uint8_t *)m.scale)[3] = 30; /* a block of codes at 2^-97 */
    CHECK(!k3_mat_wrange(&m));
    mat_free(&s);
    s = strips(&m);
    CHECK(!s.wrange);
    mat_free(&s);
    mat_free(&m);
}

/* One call of a table kernel on its own prepared x, all rows. */
static void rows_call(k3_mm_rows_fn *rows, k3_mm_prep_fn *prep, const k3_mat *w, const float *x, int64_t n, float *y,
                      int64_t r0) {
    float *xp = aligned_alloc(64, (sizeof(float) * (size_t)prep(w, x, n, NULL) + 63) / 64 * 64);
    prep(w, x, n, xp);
    rows(w, xp, n, y, w->rows, r0, w->rows);
    free(xp);
}

/* The FMA kernel against the vdpbf16ps one and the reference, bit for bit,
 * at 1 to 17 tokens and from the second strip on; returns mismatches. */
static int fma_vs_vdp(const k3_mat *w, const float *x, const char *what) {
    int bad = 0;
    const int64_t rows = w->rows;
    float *yf = calloc((size_t)(17 * rows), sizeof(float)), *yd = calloc((size_t)(17 * rows), sizeof(float));
    float *yr = malloc(sizeof(float) * (size_t)(17 * rows));
    for (int64_t n = 1; n <= 17; n++) {
        const int64_t r0 = n % 3 == 0 ? 16 : 0;
        rows_call(k3_bf16_rows_avx512_fma, k3_bf16_prep_x_avx512_fma, w, x, n, yf, r0);
        rows_call(k3_bf16_rows_avx512, k3_bf16_prep_x_avx512, w, x, n, yd, r0);
        k3_bf16_rows_ref(w, x, n, yr, rows, 0, rows);
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = r0; r < rows; r++) {
                const int64_t i = t * rows + r;
                if ((memcmp(&yf[i], &yr[i], 4) || memcmp(&yd[i], &yr[i], 4)) && bad++ < 3)
                    printf("    %s %s n=%lld token %lld row %lld: fma %.9g vdpbf16ps %.9g reference %.9g\n", what,
                           type_name(w), (long long)n, (long long)t, (long long)r, yf[i], yd[i], yr[i]);
            }
    }
    free(yf);
    free(yd);
    free(yr);
    return bad;
}

/* Every token count through both kernels of the "avx512-bf16" table gives
 * the reference's bits: activations and weights of every size; at the ends
 * of the FMA path's range, where sums cancel below 2^-126 and are flushed;
 * and past them (an activation or a weight out of range: vdpbf16ps). */
K3_TEST(bf16_fma_equals_vdpbf16ps) {
    k3_error err = {0};
    if (k3_set_isa("avx512-bf16", &err) != K3_OK || !vdp_as_intel()) {
        printf("    (not run: %s)\n", err.msg[0] ? err.msg : "vdpbf16ps is not Intel's here");
        k3_set_isa(NULL, &err);
        return;
    }
    k3_set_isa(NULL, &err);
    enum { R = 48, K = 512 };
    k3_mat src[2] = {bf16_mat(R, K), mx4_mat(R, K, 110, 25)};
    float *x = fvec(17 * K, 2.0f);
    for (int i = 0; i < 2; i++) {
        k3_mat w = strips(&src[i]);
        CHECK(w.wrange);
        CHECKF(!fma_vs_vdp(&w, x, "in range"), "%s: the FMA kernel differs", type_name(&w));
        mat_free(&w);
    }
    /* the low end: |w| 2^-64..2^-63, |x| 2^-60..2^-59, products near 2^-124
     * of both signs, E, O and C cancelling below 2^-126 */
    k3_mat lo = bf16_mat(R, K);
    uint16_t *d = (uint16_t *)lo.data;
    for (int64_t i = 0; i < R * K; i++) d[i] = (uint16_t)((rnd() & 1) << 15 | 63 << 7 | (rnd() & 0x7f));
    float *xl = malloc(sizeof(float) * 17 * K);
    for (int64_t i = 0; i < 17 * K; i++) {
        const uint32_t u = (rnd() & 1u) << 31 | 67u << 23 | (rnd() & 0x7f) << 16;
        memcpy(&xl[i], &u, 4);
    }
    k3_mat wl = strips(&lo);
    CHECK(wl.wrange);
    CHECKF(!fma_vs_vdp(&wl, xl, "at 2^-124"), "%s: the FMA kernel differs at the low end", type_name(&wl));
    /* MXFP4 at both ends of its scales (69..72: products with these x near
     * 2^-126 once scaled; 184..187 with x near 2^59: near 2^124) */
    for (int end = 0; end < 2; end++) {
        k3_mat m = mx4_mat(R, K, end ? 184 : 69, 4);
        k3_mat ms = strips(&m);
        float *xe = malloc(sizeof(float) * 17 * K);
        for (int64_t i = 0; i < 17 * K; i++) {
            const uint32_t u = (rnd() & 1u) << 31 | (end ? 185u : 67u) << 23 | (rnd() & 0x7f) << 16;
            memcpy(&xe[i], &u, 4);
        }
        CHECK(ms.wrange);
        CHECKF(!fma_vs_vdp(&ms, xe, end ? "scales 184..187" : "scales 69..72"), "%s: the FMA kernel differs at %s",
               type_name(&ms), end ? "the high end" : "the low end");
        free(xe);
        mat_free(&ms);
        mat_free(&m);
    }
    /* an activation out of range: the whole call on vdpbf16ps */
    xl[5 * K + 100] = 0x1p-61f;
    CHECKF(!fma_vs_vdp(&wl, xl, "x past the range"), "%s: an activation past the range", type_name(&wl));
    mat_free(&wl);
    /* a weight out of range (2^-65): the matrix never takes the FMAs */
    d[3 * K + 7] = 62 << 7;
    wl = strips(&lo);
    CHECK(!wl.wrange);
    CHECKF(!fma_vs_vdp(&wl, xl, "w past the range"), "%s: a weight past the range", type_name(&wl));
    mat_free(&wl);
    mat_free(&lo);
    free(xl);
    free(x);
    mat_free(&src[0]);
    mat_free(&src[1]);
}
