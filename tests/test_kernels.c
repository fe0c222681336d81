/* test_kernels.c -- conversions, k3_mat helpers, and every ISA path of
 * k3_matmul / k3_dot / k3_axpy held to the scalar reference. */
#include "test.h"

#include "common/pool.h"
#include "kernels/kernels.h"
#include "kernels/kernels_isa.h"
#include "kernels/membw.h"

#include <stdlib.h>
#include <string.h>

/* ---- helpers ---------------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

/* Uniform in [-1, 1). */
static float rndf(void) { return (float)(rnd() & 0xffffff) / 8388608.0f - 1.0f; }

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Runs body once per ISA the CPU has, then restores the best one. */
#define FOR_EACH_ISA(isa) \
    for (int isa_i_ = 0; isa_i_ < 3; isa_i_++) \
        for (k3_isa isa = (k3_kernels_force((k3_isa)isa_i_), (k3_isa)isa_i_); isa == k3_kernels_isa(); isa = (k3_isa)99)

static void restore_best_isa(void) { k3_kernels_force(K3_ISA_AVX512); }

/* ---- conversions ------------------------------------------------------ */

K3_TEST(kernels_bf16_conversion) {
    CHECK(k3_bf16_to_f32(0x3f80) == 1.0f);
    CHECK(k3_bf16_to_f32(0xc040) == -3.0f);
    CHECK(k3_f32_to_bf16(1.0f) == 0x3f80);
    /* Round to nearest even: ties go to the even mantissa. */
    CHECK(k3_f32_to_bf16(from_bits(0x3f808000)) == 0x3f80);
    CHECK(k3_f32_to_bf16(from_bits(0x3f818000)) == 0x3f82);
    CHECK(k3_f32_to_bf16(from_bits(0x3f808001)) == 0x3f81);
    CHECK(k3_f32_to_bf16(from_bits(0x3f807fff)) == 0x3f80);
    CHECK(k3_f32_to_bf16(from_bits(0x7f7fffff)) == 0x7f80); /* rounds up to inf */
    CHECK(k3_f32_to_bf16(INFINITY) == 0x7f80 && k3_f32_to_bf16(-INFINITY) == 0xff80);
    uint16_t qn = k3_f32_to_bf16(from_bits(0x7f800001)); /* NaN stays NaN */
    CHECK((qn & 0x7f80) == 0x7f80 && (qn & 0x7f) != 0);
    int ok = 1;
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7f80) == 0x7f80 && (h & 0x7f)) continue; /* NaN payloads */
        ok &= k3_f32_to_bf16(k3_bf16_to_f32((uint16_t)h)) == h;
    }
    CHECK(ok);
}

K3_TEST(kernels_f16_conversion) {
    CHECK(k3_f16_to_f32(0x3c00) == 1.0f);
    CHECK(k3_f16_to_f32(0xc000) == -2.0f);
    CHECK(k3_f16_to_f32(0x7bff) == 65504.0f);
    CHECK(k3_f16_to_f32(0x0001) == 0x1p-24f);
    CHECK(k3_f16_to_f32(0x03ff) == 1023 * 0x1p-24f);
    CHECK(k3_f16_to_f32(0x8001) == -0x1p-24f);
    CHECK(k3_f16_to_f32(0x0400) == 0x1p-14f);
    CHECK(k3_f16_to_f32(0x0000) == 0 && !signbit(k3_f16_to_f32(0x0000)));
    CHECK(k3_f16_to_f32(0x8000) == 0 && signbit(k3_f16_to_f32(0x8000)));
    CHECK(k3_f16_to_f32(0x7c00) == INFINITY && k3_f16_to_f32(0xfc00) == -INFINITY);
    CHECK(isnan(k3_f16_to_f32(0x7e00)) && isnan(k3_f16_to_f32(0x7c01)));
    /* Every finite value against the definition. */
    int ok = 1;
    for (uint32_t h = 0; h < 65536; h++) {
        int e = (h >> 10) & 31, m = h & 1023;
        if (e == 31) continue;
        double v = e ? ldexp(1.0 + m / 1024.0, e - 15) : ldexp(m, -24);
        if (h & 0x8000) v = -v;
        ok &= k3_f16_to_f32((uint16_t)h) == (float)v;
    }
    CHECK(ok);
}

K3_TEST(kernels_e2m1_e8m0) {
    static const float want[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -.5f, -1, -1.5f, -2, -3, -4, -6};
    for (int c = 0; c < 16; c++) CHECKF(k3_e2m1_to_f32((uint8_t)c) == want[c], "code %d", c);
    CHECK(signbit(k3_e2m1_to_f32(8)) && !signbit(k3_e2m1_to_f32(0)));
    CHECK(k3_e8m0_to_f32(127) == 1.0f);
    CHECK(k3_e8m0_to_f32(130) == 8.0f);
    CHECK(k3_e8m0_to_f32(126) == 0.5f);
    CHECK(k3_e8m0_to_f32(254) == 0x1p127f);
    CHECK(k3_e8m0_to_f32(1) == 0x1p-126f);
    CHECK(k3_e8m0_to_f32(0) == 0x1p-127f);
    CHECK(isnan(k3_e8m0_to_f32(255)));
}

/* ---- k3_mat ----------------------------------------------------------- */

/* A 2x64 MXFP4 matrix made by hand. */
static uint8_t mx_packed[2][32], mx_scale[2][2];

static k3_mat hand_mxfp4(void) {
    memset(mx_packed, 0, sizeof mx_packed);
    mx_packed[0][0] = 0x87;  /* col 0: code 7 = 6; col 1: code 8 = -0 */
    mx_packed[0][1] = 0xf0;  /* col 2: 0; col 3: code 15 = -6 */
    mx_packed[0][2] = 0x21;  /* col 4: 0.5; col 5: 1 */
    mx_packed[0][16] = 0x9b; /* col 32: code 11 = -1.5 (x8); col 33: code 9 = -0.5 (x8) */
    mx_packed[0][31] = 0x7f; /* col 62: -6 (x8); col 63: 6 (x8) */
    mx_packed[1][5] = 0x53;  /* row 1, col 10: 1.5 (x0.5); col 11: 3 (x0.5) */
    mx_scale[0][0] = 127;    /* x1 */
    mx_scale[0][1] = 130;    /* x8 */
    mx_scale[1][0] = 126;    /* x0.5 */
    mx_scale[1][1] = 127;
    return (k3_mat){.type = K3_W_MXFP4, .rows = 2, .cols = 64, .data = mx_packed, .scale = &mx_scale[0][0]};
}

K3_TEST(kernels_mxfp4_hand_made) {
    k3_mat w = hand_mxfp4();
    CHECK(k3_mat_row_bytes(&w) == 34);
    float row[64];
    k3_mat_get_row(&w, 0, row);
    CHECK(row[0] == 6.0f);
    CHECK(row[1] == 0.0f && signbit(row[1]));
    CHECK(row[2] == 0.0f && !signbit(row[2]));
    CHECK(row[3] == -6.0f);
    CHECK(row[4] == 0.5f && row[5] == 1.0f);
    CHECK(row[32] == -12.0f && row[33] == -4.0f);
    CHECK(row[62] == -48.0f && row[63] == 48.0f);
    int zeros = 1;
    for (int c = 6; c < 64; c++)
        if (c != 32 && c != 33 && c != 62 && c != 63) zeros &= row[c] == 0.0f;
    CHECK(zeros);
    k3_mat_get_row(&w, 1, row);
    CHECK(row[10] == 0.75f && row[11] == 1.5f && row[0] == 0.0f);
    k3_mat v = k3_mat_rows(&w, 1, 1);
    float row2[64];
    k3_mat_get_row(&v, 0, row2);
    CHECK(v.rows == 1 && !memcmp(row, row2, sizeof row));

    /* k3_matmul with one-hot x picks out columns, on every ISA. */
    float x[64], y[2];
    FOR_EACH_ISA(isa) {
        float want0[64], want1[64];
        k3_mat_get_row(&w, 0, want0);
        k3_mat_get_row(&w, 1, want1);
        int ok = 1;
        for (int c = 0; c < 64; c++) {
            memset(x, 0, sizeof x);
            x[c] = 1.0f;
            k3_matmul(NULL, &w, x, 1, y);
            ok &= y[0] == want0[c] && y[1] == want1[c];
        }
        CHECKF(ok, "isa %s", k3_isa_name(isa));
    }
    restore_best_isa();
}

K3_TEST(kernels_mat_views) {
    enum { R = 5, C = 12 };
    uint16_t d[R * C];
    for (int i = 0; i < R * C; i++) d[i] = k3_f32_to_bf16((float)i);
    k3_mat w = {.type = K3_W_BF16, .rows = R, .cols = C, .data = d};
    CHECK(k3_mat_row_bytes(&w) == 2 * C);
    k3_mat v = k3_mat_rows(&w, 2, 3);
    CHECK(v.rows == 3 && v.cols == C);
    float row[C];
    k3_mat_get_row(&v, 1, row);
    CHECK(row[0] == 3 * C && row[C - 1] == 4 * C - 1);
    k3_mat f = {.type = K3_W_F32, .rows = 4, .cols = 3};
    CHECK(k3_mat_row_bytes(&f) == 12);
    k3_mat h = {.type = K3_W_F16, .rows = 4, .cols = 3};
    CHECK(k3_mat_row_bytes(&h) == 6);
}

/* ---- matmul against the reference ------------------------------------- */

typedef struct {
    k3_mat w;
    void *data;
    uint8_t *scale;
} test_mat;

/* A random matrix of type t; MXFP4 cols must be a multiple of 32. */
static test_mat make_mat(k3_wtype t, int64_t rows, int64_t cols) {
    test_mat m = {.w = {.type = t, .rows = rows, .cols = cols}};
    size_t n = (size_t)(rows * cols);
    switch (t) {
    case K3_W_F32: {
        float *p = malloc(n * sizeof *p);
        for (size_t i = 0; i < n; i++) p[i] = rndf();
        m.data = p;
        break;
    }
    case K3_W_BF16: {
        uint16_t *p = malloc(n * sizeof *p);
        for (size_t i = 0; i < n; i++) p[i] = k3_f32_to_bf16(rndf());
        m.data = p;
        break;
    }
    case K3_W_F16: {
        uint16_t *p = malloc(n * sizeof *p);
        for (size_t i = 0; i < n; i++) {
            uint32_t r = rnd();
            /* exponents 2^-6..2^1, plus some subnormals */
            uint32_t e = (r & 15) == 0 ? 0 : 9 + (r >> 4) % 8;
            p[i] = (uint16_t)(((r >> 8) & 0x8000) | (e << 10) | ((r >> 12) & 0x3ff));
        }
        m.data = p;
        break;
    }
    case K3_W_MXFP4: {
        uint8_t *p = malloc(n / 2);
        m.scale = malloc(n / 32);
        for (size_t i = 0; i < n / 2; i++) p[i] = (uint8_t)rnd();
        for (size_t i = 0; i < n / 32; i++) m.scale[i] = (uint8_t)(122 + rnd() % 8);
        m.data = p;
        break;
    }
    default: break;
    }
    m.w.data = m.data;
    m.w.scale = m.scale;
    return m;
}

static void free_mat(test_mat *m) {
    free(m->data);
    free(m->scale);
}

static const char *wtype_name(k3_wtype t) {
    static const char *names[] = {"f32", "f16", "bf16", "mxfp4"};
    return names[t];
}

/* y vs ref: rel-L2 <= 1e-6 and max-abs <= 1e-5 * max|ref|. */
static int close_to(const float *y, const float *ref, int64_t n, double *rel, double *mabs) {
    double scale = 1e-30;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(ref[i]));
    *rel = k3_test_rel_l2(y, ref, n);
    *mabs = k3_test_max_abs(y, ref, n);
    return *rel <= 1e-6 && *mabs <= 1e-5 * scale;
}

K3_TEST(kernels_matmul_matches_ref) {
    static const int64_t shapes[][3] = {
        /* rows, cols, n */
        {37, 67, 1},
        {37, 67, 3},
        {64, 200, 8},
        {50, 1000, 2},
        {16, 96, 67},
        {45, 589, 67},
        {130, 1088, 4},
        {19, 33, 5},
        {7, 8, 1},
        {100, 520, 9},
        {3, 1, 2},
        {33, 130, 17},
        /* whole 32-column blocks (the paired order for BF16 on AVX2 and
         * AVX-512): n = 1 with four rows a pass (K <= 256) and a 3-row
         * remainder, n = 2 and 3, a 2-row remainder at n = 1 over KC blocks */
        {39, 256, 1},
        {37, 256, 2},
        {26, 96, 3},
        {10, 1056, 1},
    };
    k3_pool *pools[3] = {NULL, NULL, NULL};
    REQUIRE(k3_pool_init(&pools[1], 1, NULL) == K3_OK);
    REQUIRE(k3_pool_init(&pools[2], 2, NULL) == K3_OK);
    for (int t = 0; t <= K3_W_MXFP4; t++) { /* the stored formats */
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            int64_t rows = shapes[s][0], cols = shapes[s][1], n = shapes[s][2];
            if (t == K3_W_MXFP4) cols = (cols + 31) / 32 * 32;
            test_mat m = make_mat((k3_wtype)t, rows, cols);
            float *x = malloc(sizeof(float) * (size_t)(n * cols));
            float *ref = malloc(sizeof(float) * (size_t)(n * rows));
            float *y = malloc(sizeof(float) * (size_t)(n * rows));
            for (int64_t i = 0; i < n * cols; i++) x[i] = rndf();
            k3_matmul_ref(&m.w, x, n, ref);
            FOR_EACH_ISA(isa) {
                for (int p = 0; p < 3; p++) {
                    for (int64_t i = 0; i < n * rows; i++) y[i] = NAN;
                    k3_matmul(pools[p], &m.w, x, n, y);
                    double rel, mabs;
                    CHECKF(close_to(y, ref, n * rows, &rel, &mabs),
                           "%s %s pool=%d rows=%lld cols=%lld n=%lld: rel %.3g max %.3g", wtype_name((k3_wtype)t),
                           k3_isa_name(isa), p /* 0 = none */, (long long)rows, (long long)cols, (long long)n, rel,
                           mabs);
                }
            }
            free(x);
            free(ref);
            free(y);
            free_mat(&m);
        }
    }
    restore_best_isa();
    k3_pool_free(pools[1]);
    k3_pool_free(pools[2]);
}

/* Larger shapes than the test above, on the threaded fast path only, to
 * cross several KC column blocks and RB row blocks. */
K3_TEST(kernels_matmul_blocked_shapes) {
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    /* {30, 4128, 67}: x over 1 MB, the tiled path's column-panel order;
     * {21, 4160, 4}: MXFP4 streaming in two column chunks. */
    static const int64_t shapes[][3] = {{97, 1312, 13}, {64, 2080, 1}, {50, 2048, 4}, {30, 4128, 67}, {21, 4160, 4}};
    for (int t = 0; t <= K3_W_MXFP4; t++) { /* the stored formats */
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            int64_t rows = shapes[s][0], cols = shapes[s][1], n = shapes[s][2];
            test_mat m = make_mat((k3_wtype)t, rows, cols);
            float *x = malloc(sizeof(float) * (size_t)(n * cols));
            float *ref = malloc(sizeof(float) * (size_t)(n * rows));
            float *y = malloc(sizeof(float) * (size_t)(n * rows));
            for (int64_t i = 0; i < n * cols; i++) x[i] = rndf();
            k3_matmul_ref(&m.w, x, n, ref);
            FOR_EACH_ISA(isa) {
                if (isa == K3_ISA_REF) continue;
                k3_matmul(pool, &m.w, x, n, y);
                double rel, mabs;
                CHECKF(close_to(y, ref, n * rows, &rel, &mabs), "%s %s rows=%lld cols=%lld n=%lld: rel %.3g max %.3g",
                       wtype_name((k3_wtype)t), k3_isa_name(isa), (long long)rows, (long long)cols, (long long)n, rel,
                       mabs);
            }
            free(x);
            free(ref);
            free(y);
            free_mat(&m);
        }
    }
    restore_best_isa();
    k3_pool_free(pool);
}

/* Batch invariance: row i of y is bit for bit the same whatever n, the
 * position of x row i in the batch, and the thread count (the engine's
 * causality and batch == alone tests rely on it). */
K3_TEST(kernels_matmul_batch_invariant) {
    enum { R = 45, C = 1100, N = 300 };
    /* past 256: k3_matmul prepares x for the AVX-512 paired order in blocks of 256 rows */
    static const int64_t ns[] = {1, 2, 3, 4, 5, 8, 13, 64, 65, 70, 257, 300};
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    float *x = malloc(sizeof(float) * N * C);
    float *y1 = malloc(sizeof(float) * N * R), *yb = malloc(sizeof(float) * N * R);
    for (int i = 0; i < N * C; i++) x[i] = rndf();
    /* The stored formats; BF16 also with whole 32-column blocks (the paired
     * order on AVX-512; 128 columns: four rows a pass at n = 1); MXFP4
     * over two column blocks (1088), and with a lone last 32-column block
     * (1120 = 17.5 x 64: AVX2's quad order, then its paired order). */
    static const struct {
        k3_wtype t;
        int64_t cols;
    } cases[] = {
        {K3_W_F32, C},    {K3_W_F16, C},      {K3_W_BF16, C},     {K3_W_BF16, 1088},
        {K3_W_BF16, 128}, {K3_W_MXFP4, 1088}, {K3_W_MXFP4, 1120},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const k3_wtype t = cases[c].t;
        const int64_t cols = cases[c].cols;
        test_mat m = make_mat((k3_wtype)t, R, cols);
        float *xs = malloc(sizeof(float) * N * cols);
        for (int64_t i = 0; i < N * cols; i++) xs[i] = x[i % (N * C)];
        FOR_EACH_ISA(isa) {
            /* Each row alone, single-threaded. */
            for (int i = 0; i < N; i++) k3_matmul(NULL, &m.w, xs + i * cols, 1, y1 + i * R);
            int bad = 0;
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                const int64_t n = ns[k], off = (N - n) / 2; /* a batch from the middle */
                for (int p = 0; p < 2; p++) {
                    k3_matmul(p ? pool : NULL, &m.w, xs + off * cols, n, yb);
                    if (memcmp(yb, y1 + off * R, sizeof(float) * (size_t)(n * R))) {
                        bad++;
                        CHECKF(0, "%s %s n=%lld threads=%d: not bitwise equal to rows alone", wtype_name((k3_wtype)t),
                               k3_isa_name(isa), (long long)n, p + 1);
                    }
                }
            }
            (void)bad;
        }
        free(xs);
        free_mat(&m);
    }
    restore_best_isa();
    free(x);
    free(y1);
    free(yb);
    k3_pool_free(pool);
}

/* MXFP4 matmul == dequantize to fp32, then the fp32 matmul. */
K3_TEST(kernels_mxfp4_equals_dequantized) {
    enum { R = 40, C = 352 };
    static const int64_t ns[] = {1, 2, 4, 7, 64};
    test_mat m = make_mat(K3_W_MXFP4, R, C);
    float *wf = malloc(sizeof(float) * R * C);
    for (int r = 0; r < R; r++) k3_mat_get_row(&m.w, r, wf + r * C);
    k3_mat f = {.type = K3_W_F32, .rows = R, .cols = C, .data = wf};
    float *x = malloc(sizeof(float) * 64 * C);
    float y1[64 * R], y2[64 * R];
    for (int i = 0; i < 64 * C; i++) x[i] = rndf();
    FOR_EACH_ISA(isa) {
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            k3_matmul(NULL, &m.w, x, ns[k], y1);
            k3_matmul(NULL, &f, x, ns[k], y2);
            double rel, mabs;
            CHECKF(close_to(y1, y2, ns[k] * R, &rel, &mabs), "%s n=%lld: rel %.3g", k3_isa_name(isa), (long long)ns[k],
                   rel);
        }
    }
    restore_best_isa();
    free(x);
    free(wf);
    free_mat(&m);
}

K3_TEST(kernels_matmul_zero_cols) {
    k3_mat w = {.type = K3_W_BF16, .rows = 3, .cols = 0, .data = ""};
    float x[1] = {1}, y[6] = {1, 2, 3, 4, 5, 6};
    k3_matmul(NULL, &w, x, 2, y);
    CHECK(y[0] == 0 && y[5] == 0);
}

K3_TEST(kernels_dot_axpy) {
    static const int64_t ns[] = {0, 1, 7, 8, 9, 31, 33, 100, 1000};
    float a[1000], b[1000], y0[1000], y1[1000];
    for (int i = 0; i < 1000; i++) {
        a[i] = rndf();
        b[i] = rndf();
    }
    FOR_EACH_ISA(isa) {
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            int64_t n = ns[k];
            float r = k3_dot_ref(a, b, n), d = k3_dot(a, b, n);
            CHECKF(fabsf(d - r) <= 1e-6f * (float)(n + 1), "%s dot n=%lld: %g vs %g", k3_isa_name(isa), (long long)n, d,
                   r);
            memcpy(y0, b, sizeof b);
            memcpy(y1, b, sizeof b);
            k3_axpy_ref(y0, 0.37f, a, n);
            k3_axpy(y1, 0.37f, a, n);
            CHECKF(k3_test_max_abs(y1, y0, 1000) <= 1e-6, "%s axpy n=%lld", k3_isa_name(isa), (long long)n);
        }
    }
    restore_best_isa();
}

K3_TEST(kernels_isa_detect) {
    k3_kernels_init();
    CHECK(k3_set_isa("best", NULL) == K3_OK);
    k3_isa best = k3_kernels_isa();
    CHECK(best == K3_ISA_REF || best == K3_ISA_AVX2 || best == K3_ISA_AVX512 || best == K3_ISA_AMX);
    k3_kernels_force(K3_ISA_REF);
    CHECK(k3_kernels_isa() == K3_ISA_REF);
    k3_kernels_force(best);
    CHECK(k3_kernels_isa() == best);
    restore_best_isa();
    CHECK(!strcmp(k3_isa_name(K3_ISA_AVX2), "avx2"));
}

/* Every table the CPU has (AVX2 with and without AVX-VNNI) has a kernel for
 * every weight type and family the weight-type table says it takes, and an
 * entry for every other family; a fits() entry has a base to fall back on.
 * A new format is a row of the weight-type table plus its kernels: this is
 * what fails when a kernel is missing. */
static void check_table(const k3_kernel_ops *o) {
    CHECKF(o->name && o->quant_act_i8 && o->mx4_prep && o->mx4_r4_prep && o->mx4_dot && o->mxfp8_dequant && o->dot &&
               o->axpy && o->glu && o->softmax && o->qli_scores && o->qsfa && o->lse_merge && o->attnres_mix &&
               o->kda_recurrent && o->kda_chunked,
           "table %s: an empty entry", o->name);
    CHECKF(o->base || (!o->qli_fits && !o->qsfa_fits && !o->kda_recurrent_fits && !o->kda_chunked_fits),
           "table %s: fits() without a base", o->name);
    for (int t = 0; t < K3_W_COUNT; t++) {
        const k3_wtype_traits *ti = k3_wtype_info((k3_wtype)t);
        CHECKF(!(ti->acts & K3_ACTS_F32) || o->mm[t].rows, "table %s: no fp32 kernel for %s", o->name, ti->name);
        CHECKF(!(ti->acts & K3_ACTS_8BIT) || o->q[t].rows || o->q[t].call, "table %s: no 8-bit kernel for %s", o->name,
               ti->name);
        CHECKF(!(ti->acts & K3_ACTS_BF16) || o->bf[t].rows || o->bf[t].call, "table %s: no BF16 kernel for %s", o->name,
               ti->name);
        CHECKF(o->base || (!o->mm[t].fits && !o->q[t].fits && !o->bf[t].fits), "table %s: fits() without a base",
               o->name);
    }
}

K3_TEST(kernels_tables_complete) {
    for (int isa = K3_ISA_REF; isa <= K3_ISA_AMX; isa++) {
        if (!k3_kernels_have((k3_isa)isa)) continue;
        k3_kernels_force((k3_isa)isa);
        check_table(k3_ops());
        if (isa == K3_ISA_AVX2) {
            k3_kernels_force_avxvnni(false);
            CHECK(!strcmp(k3_isa_current(), "avx2"));
            check_table(k3_ops());
        }
        if (isa == K3_ISA_AVX512 && k3_set_isa("avx512-nobf16", NULL) == K3_OK) check_table(k3_ops());
    }
    restore_best_isa();
}

K3_TEST(kernels_membw_small) {
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    double g = k3_membw_read_gbps(pool, (size_t)8 << 20, 3);
    CHECKF(g > 0.1 && g < 1e5, "membw %g GB/s", g);
    k3_pool_free(pool);
}
