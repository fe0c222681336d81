/*
 * test_amx.c -- the AMX kernels (src/kernels/amx.h) against the scalar
 * references: on the unit where this CPU has it and the kernel grants the
 * tile state, and always (where AVX-512 runs) with the tile instructions
 * emulated, which checks the same layouts, tails and epilogues.
 *
 * Bounds. BF16 paths: the weights are exact in BF16 (BF16 as stored; MXFP4
 * codes times their power-of-two scale), each activation is rounded to BF16
 * (relative error <= 2^-8), the products are exact in fp32 and the sums are
 * fp32 over K terms, so |y - ref| <= sum_k |w_k x_k| (2^-8 + K 2^-24).
 * INT8 paths: the integer sums are exact. Q8 then applies the same two float
 * products as the AVX-512 VNNI kernel (bit for bit); the MXFP4 INT8 route
 * adds its per-block products in fp32: |y - ref| <= (K/32 + 1) 2^-24
 * sum_k |q_k s_x w_k|. A routed expert rounds x and h = act(gate x, up x)
 * to BF16; h computed from a few-ulp different gate and up sums may round
 * one BF16 step (<= 2^-7 |h|) apart from the reference's, hence
 * |y - ref| <= sum_k |w_k h_k| (2^-7 + K 2^-24) for its down projection.
 */
#include "test.h"

#include "k3.h"
#include "common/pool.h"
#include "ctx/ctx.h"
#include "kernels/amx.h"
#include "kernels/attn_ops.h"
#include "kernels/kernels.h"
#include "kernels/quant.h"

#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float frand(float a) { return ((float)(rnd() % 20001) / 10000.0f - 1.0f) * a; }

/* The backends to test: the unit (when granted) and the emulation. Returns
 * how many; prints why the unit is not among them once. */
static int backends(bool hw[2]) {
    static bool said;
    int n = 0;
    k3_error err = {0};
    if (k3_amx_init(&err) == K3_OK) hw[n++] = true;
    else if (!said) printf("    (AMX unit not tested: %s)\n", err.msg);
    if (k3_amx_emu_possible()) hw[n++] = false;
    else if (!said) printf("    (AMX emulation not tested: this CPU lacks AVX-512 BF16/VNNI)\n");
    said = true;
    return n;
}

static void use(bool hw) { k3_amx_emulate(!hw); }

static float *fvec(int64_t n, float a) {
    float *v = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) v[i] = frand(a) * (i % 7 == 0 ? 8.0f : 1.0f);
    return v;
}

static k3_mat bf16_mat(int64_t rows, int64_t cols) {
    uint16_t *d = malloc(2 * (size_t)(rows * cols));
    for (int64_t i = 0; i < rows * cols; i++) d[i] = k3_f32_to_bf16(frand(1.0f));
    return (k3_mat){.type = K3_W_BF16, .rows = rows, .cols = cols, .data = d};
}

static k3_mat mx4_mat(int64_t rows, int64_t cols, int emin, int espan) {
    uint8_t *d = malloc((size_t)(rows * cols / 2)), *s = malloc((size_t)(rows * cols / 32));
    for (int64_t i = 0; i < rows * cols / 2; i++) d[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < rows * cols / 32; i++) s[i] = (uint8_t)(emin + (int)(rnd() % (uint32_t)espan));
    return (k3_mat){.type = K3_W_MXFP4, .rows = rows, .cols = cols, .data = d, .scale = s};
}

static void mat_free(k3_mat *w) {
    free((void *)w->data);
    free((void *)w->scale);
    free((void *)w->row_scale);
    free((void *)w->row_sum);
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

/* y within rel * sum|wx| (+ a hair for the flushed denormals) of ref. */
static int within(const float *y, const float *ref, const double *abs, int64_t len, double rel, const char *what) {
    int bad = 0;
    for (int64_t i = 0; i < len; i++) {
        const double tol = abs[i] * rel * 1.0001 + 1e-30;
        if (!(fabs((double)y[i] - ref[i]) <= tol)) {
            if (bad++ < 3)
                printf("    %s: element %lld: %.9g vs ref %.9g (bound %.3g)\n", what, (long long)i, y[i], ref[i], tol);
        }
    }
    return bad;
}

/* A token's row alone gives the bits it gets among the others. */
static int invariant(const k3_amx_mat *a, const float *x, const float *y, int64_t n) {
    const int64_t rows = a->rows, cols = a->cols;
    float *y1 = malloc(sizeof(float) * (size_t)rows);
    int bad = 0;
    for (int64_t t = 0; t < n; t += (n > 4 ? n / 3 : 1)) {
        k3_amx_matmul(NULL, a, x + t * cols, 1, y1);
        bad += memcmp(y1, y + t * rows, sizeof(float) * (size_t)rows) != 0;
    }
    free(y1);
    return bad;
}

/* One BF16 (or MXFP4 fp32-activation) product against k3_matmul_ref. */
static void check_bf16(const k3_mat *w, int64_t n, bool tiles, const char *name) {
    float *x = fvec(n * w->cols, 2.0f);
    float *y = malloc(sizeof(float) * (size_t)(n * w->rows)), *ref = malloc(sizeof(float) * (size_t)(n * w->rows));
    k3_matmul_ref(w, x, n, ref);
    double *abs = abs_sums(w, x, n);
    k3_amx_mat a;
    void *buf = NULL;
    REQUIRE(k3_amx_view(w, &a, NULL) == K3_OK);
    if (tiles) {
        buf = aligned_alloc(64, k3_amx_pack_bytes(w));
        k3_amx_pack(w, buf, &a);
    }
    bool hw[2];
    const int nb = backends(hw);
    for (int b = 0; b < nb; b++) {
        use(hw[b]);
        memset(y, 0xff, sizeof(float) * (size_t)(n * w->rows));
        k3_amx_matmul(NULL, &a, x, n, y);
        const double rel = 0x1p-8 + (double)w->cols * 0x1p-24;
        CHECKF(!within(y, ref, abs, n * w->rows, rel, name), "%s %lldx%lld n=%lld %s%s", name, (long long)w->rows,
               (long long)w->cols, (long long)n, hw[b] ? "amx" : "emulated", tiles ? " tiles" : "");
        CHECKF(!invariant(&a, x, y, n), "%s %lldx%lld n=%lld: a token alone differs", name, (long long)w->rows,
               (long long)w->cols, (long long)n);
    }
    use(true);
    free(buf);
    free(abs);
    free(x);
    free(y);
    free(ref);
}

K3_TEST(amx_init_says_why) {
    k3_error err = {0};
    const k3_status s = k3_amx_init(&err);
    CHECK(s == K3_OK || (s == K3_ERR_UNSUPPORTED && err.msg[0]));
    CHECK(k3_amx_ready() == (s == K3_OK));
    CHECK(k3_amx_ready() <= k3_amx_cpu_has());
    k3_amx_emulate(false);
    CHECK(!strcmp(k3_amx_backend(), s == K3_OK ? "amx" : "none"));
    k3_amx_emulate(true);
    CHECK(!strcmp(k3_amx_backend(), k3_amx_emu_possible() ? "amx-emulated" : "none"));
    k3_amx_emulate(false);
}

K3_TEST(amx_view_refuses) {
    k3_mat f = {.type = K3_W_F32, .rows = 4, .cols = 4};
    k3_amx_mat a;
    k3_error err = {0};
    CHECK(k3_amx_view(&f, &a, &err) == K3_ERR_UNSUPPORTED && err.msg[0]);
    k3_mat m = {.type = K3_W_MXFP4, .rows = 4, .cols = 48};
    CHECK(k3_amx_view(&m, &a, NULL) == K3_ERR_SHAPE);
}

/* The activations are rounded as k3_f32_to_bf16 does: through an identity
 * the products give them back (a BF16 denormal reads as zero in the unit). */
K3_TEST(amx_bf16_rounding_is_k3s) {
    const int64_t d = 48, n = 19;
    uint16_t *id = calloc((size_t)(d * d), 2);
    for (int64_t i = 0; i < d; i++) id[i * d + i] = k3_f32_to_bf16(1.0f);
    k3_mat w = {.type = K3_W_BF16, .rows = d, .cols = d, .data = id};
    float *x = malloc(sizeof(float) * (size_t)(n * d)), *y = malloc(sizeof(float) * (size_t)(n * d));
    const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x3f807fffu, 0x7f7f7fffu,
                                0x00000001u, 0x00800000u, 0x807fffffu, 0xbf808000u, 0x0080ffffu};
    for (int64_t i = 0; i < n * d; i++) {
        uint32_t u = i % 3 ? (rnd() << 16) ^ rnd() : special[i % 10];
        if ((u & 0x7f000000u) == 0x7f000000u) u ^= 0x40000000u; /* nothing that rounds to inf */
        memcpy(&x[i], &u, 4);
    }
    k3_amx_mat a;
    REQUIRE(k3_amx_view(&w, &a, NULL) == K3_OK);
    bool hw[2];
    const int nb = backends(hw);
    for (int b = 0; b < nb; b++) {
        use(hw[b]);
        k3_amx_matmul(NULL, &a, x, n, y);
        int bad = 0;
        for (int64_t i = 0; i < n * d; i++) {
            const uint16_t h = k3_f32_to_bf16(x[i]);
            const float want = (h & 0x7f80) ? k3_bf16_to_f32(h) : 0.0f;
            bad += fabsf(y[i]) != fabsf(want) || (want != 0 && y[i] != want);
        }
        CHECKF(!bad, "%d of %lld values not rounded as k3_f32_to_bf16 (%s)", bad, (long long)(n * d),
               hw[b] ? "amx" : "emulated");
    }
    use(true);
    free(id);
    free(x);
    free(y);
}

K3_TEST(amx_bf16_odd_shapes) {
    static const int64_t sh[][3] = {{1, 1, 1},    {17, 33, 1},  {31, 70, 2},   {16, 64, 3},  {40, 100, 17},
                                    {33, 31, 16}, {64, 96, 33}, {48, 200, 64}, {80, 64, 512}};
    for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++) {
        k3_mat w = bf16_mat(sh[i][0], sh[i][1]);
        check_bf16(&w, sh[i][2], false, "bf16");
        check_bf16(&w, sh[i][2], true, "bf16");
        mat_free(&w);
    }
}

/* Every BF16 matrix shape of the bench checkpoint (attention, dense FFN,
 * shared and latent expert projections, router, lm_head) at a few tokens. */
K3_TEST(amx_bf16_trunk_shapes) {
    static const int64_t sh[][2] = {{2048, 2048}, {576, 2048},  {4096, 512}, {768, 2048},  {3072, 768},
                                    {5632, 2048}, {2048, 5632}, {2048, 768}, {2048, 1024}, {1024, 2048},
                                    {128, 2048},  {2048, 128},  {16, 2048},  {64, 2048},   {32768, 2048}};
    for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++) {
        k3_mat w = bf16_mat(sh[i][0], sh[i][1]);
        check_bf16(&w, sh[i][0] >= 16384 ? 1 : 3, i % 2 == 0, "bf16 trunk");
        mat_free(&w);
    }
}

K3_TEST(amx_mxfp4_bf16_route) {
    static const int64_t sh[][3] = {{384, 1024, 64}, {1024, 384, 17}, {384, 1024, 1}, {17, 32, 1},
                                    {33, 96, 3},     {50, 160, 17},   {1024, 384, 2}, {32, 64, 512}};
    for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++) {
        k3_mat w = mx4_mat(sh[i][0], sh[i][1], 118, 10);
        check_bf16(&w, sh[i][2], false, "mxfp4");
        mat_free(&w);
    }
    /* scales from the smallest up (tiny weights flush to zero: within the hair) */
    k3_mat w = mx4_mat(40, 256, 0, 200);
    check_bf16(&w, 5, false, "mxfp4 scales");
    mat_free(&w);
}

/* The MXFP4 INT8 route against k3_matmul_q_ref. */
static void check_mx4_i8(int64_t rows, int64_t cols, int64_t n) {
    k3_mat w = mx4_mat(rows, cols, 118, 10);
    w.act8 = true;
    float *x = fvec(n * cols, 2.0f), *y = malloc(sizeof(float) * (size_t)(n * rows));
    float *ref = malloc(sizeof(float) * (size_t)(n * rows)), *xq = malloc(sizeof(float) * (size_t)(n * cols));
    int8_t *q = malloc((size_t)cols);
    for (int64_t t = 0; t < n; t++) { /* |q s| as the route sees the activations */
        const float s = k3_quant_act_i8_ref(x + t * cols, cols, q);
        for (int64_t c = 0; c < cols; c++) xq[t * cols + c] = (float)q[c] * s;
    }
    k3_matmul_q_ref(&w, x, n, ref);
    double *abs = abs_sums(&w, xq, n);
    k3_amx_mat a;
    REQUIRE(k3_amx_view(&w, &a, NULL) == K3_OK && a.act8);
    bool hw[2];
    const int nb = backends(hw);
    for (int b = 0; b < nb; b++) {
        use(hw[b]);
        k3_amx_matmul(NULL, &a, x, n, y);
        CHECKF(!within(y, ref, abs, n * rows, (double)(cols / 32 + 1) * 0x1p-24 + 1e-9, "mxfp4 i8"),
               "mxfp4 int8 route %lldx%lld n=%lld (%s)", (long long)rows, (long long)cols, (long long)n,
               hw[b] ? "amx" : "emulated");
        CHECK(!invariant(&a, x, y, n));
    }
    use(true);
    free(abs);
    free(q);
    free(xq);
    free(x);
    free(y);
    free(ref);
    mat_free(&w);
}

K3_TEST(amx_mxfp4_int8_route) {
    check_mx4_i8(384, 1024, 64);
    check_mx4_i8(1024, 384, 17);
    check_mx4_i8(17, 32, 1);
    check_mx4_i8(33, 96, 3);
    check_mx4_i8(48, 160, 2);
}

/* W8A8: the integer sums, then ((float)sum * s_x) * s_w, bit for bit. */
static void check_q8(int64_t rows, int64_t cols, int64_t n) {
    float *wf = fvec(rows * cols, 1.0f);
    k3_mat src = {.type = K3_W_F32, .rows = rows, .cols = cols, .data = wf};
    int8_t *wq = malloc((size_t)(rows * cols));
    float *rs = malloc(sizeof(float) * (size_t)rows);
    int32_t *sums = malloc(sizeof(int32_t) * (size_t)rows);
    k3_quant_q8_mat(&src, wq, rs, sums);
    k3_mat w =
        {.type = K3_W_Q8, .rows = rows, .cols = cols, .data = wq, .row_scale = rs, .row_sum = sums, .act8 = true};
    float *x = fvec(n * cols, 2.0f), *y = malloc(sizeof(float) * (size_t)(n * rows));
    float *want = malloc(sizeof(float) * (size_t)(n * rows)), *vnni = malloc(sizeof(float) * (size_t)(n * rows));
    int8_t *q = malloc((size_t)cols);
    for (int64_t t = 0; t < n; t++) {
        const float s = k3_quant_act_i8_ref(x + t * cols, cols, q);
        for (int64_t r = 0; r < rows; r++) {
            int32_t acc = 0;
            for (int64_t c = 0; c < cols; c++) acc += (int32_t)q[c] * wq[r * cols + c];
            want[t * rows + r] = (float)acc * s * rs[r];
        }
    }
    k3_matmul(NULL, &w, x, n, vnni);
    k3_amx_mat a;
    REQUIRE(k3_amx_view(&w, &a, NULL) == K3_OK && a.act8);
    bool hw[2];
    const int nb = backends(hw);
    for (int b = 0; b < nb; b++) {
        use(hw[b]);
        k3_amx_matmul(NULL, &a, x, n, y);
        CHECKF(!memcmp(y, want, sizeof(float) * (size_t)(n * rows)),
               "q8 %lldx%lld n=%lld differs from the integer sums (%s)", (long long)rows, (long long)cols, (long long)n,
               hw[b] ? "amx" : "emulated");
        if (k3_kernels_isa() == K3_ISA_AVX512)
            CHECKF(!memcmp(y, vnni, sizeof(float) * (size_t)(n * rows)), "q8 %lldx%lld n=%lld differs from VNNI",
                   (long long)rows, (long long)cols, (long long)n);
        CHECK(!invariant(&a, x, y, n));
    }
    use(true);
    free(q);
    free(x);
    free(y);
    free(want);
    free(vnni);
    free(wf);
    free(wq);
    free(rs);
    free(sums);
}

K3_TEST(amx_q8_exact) {
    static const int64_t sh[][3] = {{1, 1, 1},     {17, 33, 2},   {31, 65, 3},    {16, 64, 17},    {40, 100, 1},
                                    {33, 130, 16}, {64, 128, 64}, {768, 2048, 3}, {2048, 768, 17}, {96, 256, 512}};
    for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++) check_q8(sh[i][0], sh[i][1], sh[i][2]);
}

/* ---- routed experts ---------------------------------------------------- */

/* Reference of one expert with the kernel's rounding points: x and h in
 * BF16, sums in double. abs gets sum_k |w2_k h_k| per output. */
static void expert_ref(const k3_mat *g, const k3_mat *u, const k3_mat *d, const float *x, int64_t m, k3_glu_kind kind,
                       float b1, float b2, float *y, double *abs) {
    const int64_t hid = g->cols, inter = g->rows;
    float *xr = malloc(sizeof(float) * (size_t)(m * hid) + 1), *gv = malloc(sizeof(float) * (size_t)(m * inter) + 1);
    float *uv = malloc(sizeof(float) * (size_t)(m * inter) + 1);
    for (int64_t i = 0; i < m * hid; i++) xr[i] = k3_bf16_to_f32(k3_f32_to_bf16(x[i]));
    k3_matmul_ref(g, xr, m, gv);
    k3_matmul_ref(u, xr, m, uv);
    k3_glu_ref(gv, uv, m * inter, kind, b1, b2);
    for (int64_t i = 0; i < m * inter; i++) gv[i] = k3_bf16_to_f32(k3_f32_to_bf16(gv[i]));
    k3_matmul_ref(d, gv, m, y);
    double *a = abs_sums(d, gv, m);
    memcpy(abs, a, sizeof(double) * (size_t)(m * hid));
    free(a);
    free(xr);
    free(gv);
    free(uv);
}

static void check_moe(bool mx4, k3_glu_kind kind, float b1, float b2) {
    enum { NE = 8 };
    const int64_t hid = 1024, inter = 384;
    static const int64_t cnt[NE] = {0, 1, 3, 17, 64, 2, 33, 16};
    int64_t row0[NE + 1] = {0};
    for (int e = 0; e < NE; e++) row0[e + 1] = row0[e] + cnt[e];
    const int64_t tot = row0[NE];
    k3_mat g[NE], u[NE], d[NE];
    k3_amx_expert ex[NE];
    for (int e = 0; e < NE; e++) {
        g[e] = mx4 ? mx4_mat(inter, hid, 118, 8) : bf16_mat(inter, hid);
        u[e] = mx4 ? mx4_mat(inter, hid, 118, 8) : bf16_mat(inter, hid);
        d[e] = mx4 ? mx4_mat(hid, inter, 118, 8) : bf16_mat(hid, inter);
        REQUIRE(k3_amx_view(&g[e], &ex[e].gate, NULL) == K3_OK && k3_amx_view(&u[e], &ex[e].up, NULL) == K3_OK &&
                k3_amx_view(&d[e], &ex[e].down, NULL) == K3_OK);
    }
    float *x = fvec(tot * hid, 1.0f), *y = malloc(sizeof(float) * (size_t)(tot * hid));
    float *y2 = malloc(sizeof(float) * (size_t)(tot * hid)), *ref = malloc(sizeof(float) * (size_t)(tot * hid));
    double *abs = malloc(sizeof(double) * (size_t)(tot * hid));
    for (int e = 0; e < NE; e++)
        if (cnt[e])
            expert_ref(&g[e], &u[e], &d[e], x + row0[e] * hid, cnt[e], kind, b1, b2, ref + row0[e] * hid,
                       abs + row0[e] * hid);
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    bool hw[2];
    const int nb = backends(hw);
    for (int b = 0; b < nb; b++) {
        use(hw[b]);
        k3_amx_moe(NULL, ex, NE, row0, x, y, kind, b1, b2);
        CHECKF(!within(y, ref, abs, tot * hid, 0x1p-7 + inter * 0x1p-24, "moe"), "moe %s kind %d (%s)",
               mx4 ? "mxfp4" : "bf16", (int)kind, hw[b] ? "amx" : "emulated");
        k3_amx_moe(pool, ex, NE, row0, x, y2, kind, b1, b2);
        CHECKF(!memcmp(y, y2, sizeof(float) * (size_t)(tot * hid)), "moe: two threads differ from one");
        /* an expert alone, its rows at the start of a call: the same bits */
        const int64_t one[2] = {0, cnt[4]};
        k3_amx_moe(NULL, &ex[4], 1, one, x + row0[4] * hid, y2, kind, b1, b2);
        CHECKF(!memcmp(y + row0[4] * hid, y2, sizeof(float) * (size_t)(cnt[4] * hid)), "moe: an expert alone differs");
    }
    use(true);
    k3_pool_free(pool);
    for (int e = 0; e < NE; e++) {
        mat_free(&g[e]);
        mat_free(&u[e]);
        mat_free(&d[e]);
    }
    free(x);
    free(y);
    free(y2);
    free(ref);
    free(abs);
}

/* The bench checkpoint's routed experts (1024 -> 2 x 384 -> 1024, MXFP4),
 * SiLU-gated and SiTU (the checkpoint's act, betas 4 and 25). */
K3_TEST(amx_moe_mxfp4) {
    check_moe(true, K3_GLU_SWIGLU, 0, 0);
    check_moe(true, K3_GLU_SITU, 4.0f, 25.0f);
}

K3_TEST(amx_moe_bf16) { check_moe(false, K3_GLU_SWIGLU, 0, 0); }

/* The same matrix split over threads gives the same bits. */
K3_TEST(amx_threads_invariant) {
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    k3_mat w = mx4_mat(200, 512, 118, 8);
    k3_amx_mat a;
    REQUIRE(k3_amx_view(&w, &a, NULL) == K3_OK);
    const int64_t n = 40;
    float *x = fvec(n * 512, 1.0f), *y1 = malloc(sizeof(float) * (size_t)(n * 200)),
          *y2 = malloc(sizeof(float) * (size_t)(n * 200));
    bool hw[2];
    const int nb = backends(hw);
    for (int b = 0; b < nb; b++) {
        use(hw[b]);
        k3_amx_matmul(NULL, &a, x, n, y1);
        k3_amx_matmul(pool, &a, x, n, y2);
        CHECK(!memcmp(y1, y2, sizeof(float) * (size_t)(n * 200)));
    }
    use(true);
    k3_pool_free(pool);
    mat_free(&w);
    free(x);
    free(y1);
    free(y2);
}

/* The DSA indexer over a chunk: each token's scores equal k3_qli_scores_ref's
 * bit for bit (slots in any order, repeated or not). */
static void check_qli(int64_t T, int HI, int dI, int64_t n, int64_t nslots) {
    int8_t *q8 = malloc((size_t)(T * HI * dI)), *k8 = malloc((size_t)(nslots * dI));
    float *qs = malloc(sizeof(float) * (size_t)(T * HI)), *w = malloc(sizeof(float) * (size_t)(T * HI));
    float *ks = malloc(sizeof(float) * (size_t)nslots);
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)n);
    for (int64_t i = 0; i < T * HI * dI; i++) q8[i] = (int8_t)((int)(rnd() % 255) - 127);
    for (int64_t i = 0; i < nslots * dI; i++) k8[i] = (int8_t)((int)(rnd() % 255) - 127);
    for (int64_t i = 0; i < T * HI; i++) {
        qs[i] = 1e-3f * (1 + rnd() % 100);
        w[i] = frand(0.5f);
    }
    for (int64_t i = 0; i < nslots; i++) ks[i] = 1e-3f * (1 + rnd() % 100);
    for (int64_t i = 0; i < n; i++) slots[i] = i % 5 == 4 ? (int64_t)(rnd() % (uint32_t)nslots) : (i * 7) % nslots;
    const int64_t lds = n + 3;
    float *ref = malloc(sizeof(float) * (size_t)(T * lds)), *y = malloc(sizeof(float) * (size_t)(T * lds));
    for (int64_t t = 0; t < T; t++)
        k3_qli_scores_ref(q8 + t * HI * dI, qs + t * HI, w + t * HI, HI, dI, k8, ks, slots, (int)n, ref + t * lds);
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    bool hw[2];
    const int nb = backends(hw);
    for (int b = 0; b < nb; b++) {
        use(hw[b]);
        for (int th = 0; th < 2; th++) {
            memset(y, 0, sizeof(float) * (size_t)(T * lds));
            k3_amx_qli_scores(th ? pool : NULL, q8, qs, w, T, HI, dI, k8, ks, slots, n, y, lds);
            int bad = 0;
            for (int64_t t = 0; t < T; t++) bad += memcmp(y + t * lds, ref + t * lds, sizeof(float) * (size_t)n) != 0;
            CHECKF(!bad, "qli T=%lld HI=%d dI=%d n=%lld: %d tokens differ from the reference (%s, %d threads)",
                   (long long)T, HI, dI, (long long)n, bad, hw[b] ? "amx" : "emulated", th + 1);
        }
    }
    use(true);
    k3_pool_free(pool);
    free(q8);
    free(k8);
    free(qs);
    free(w);
    free(ks);
    free(slots);
    free(ref);
    free(y);
}

K3_TEST(amx_qli_equals_ref) {
    CHECK(k3_amx_qli_ok(16, 128) && k3_amx_qli_ok(64, 64) && !k3_amx_qli_ok(8, 128) && !k3_amx_qli_ok(16, 96));
    check_qli(1, 16, 128, 1, 4);
    check_qli(3, 16, 128, 15, 40);
    check_qli(17, 16, 128, 100, 300); /* the bench checkpoint's indexer: 16 heads of 128 */
    check_qli(5, 32, 64, 33, 50);
    check_qli(2, 64, 128, 64, 64);
    check_qli(64, 16, 128, 257, 257);
}

/* ---- the "amx" kernel table (dispatch.c) ------------------------------- */

/* k3_matmul of w over n rows on the "amx" table (the unit, or emulated) and
 * on "avx512": below the table's row threshold the bits are AVX-512's; from
 * it on, BF16 and MXFP4 within the BF16 rounding bound of the reference and
 * each row's bits those it gets in a smaller call on the tiles, Q8 AVX-512's
 * bits at every n. */
static void table_case(bool unit, const k3_mat *w, int64_t n, int64_t thresh, const char *what) {
    const int64_t rows = w->rows, cols = w->cols;
    float *x = fvec(n * cols, 2.0f);
    float *y = malloc(sizeof(float) * (size_t)(n * rows)), *y512 = malloc(sizeof(float) * (size_t)(n * rows));
    float *ref = malloc(sizeof(float) * (size_t)(n * rows)), *ys = malloc(sizeof(float) * (size_t)(thresh * rows));
    k3_kernels_force(K3_ISA_AVX512);
    k3_matmul(NULL, w, x, n, y512);
    if (unit) REQUIRE(k3_set_isa("amx", NULL) == K3_OK);
    else REQUIRE(k3_kernels_force_amx_emulated());
    CHECK(!strcmp(k3_isa_current(), "amx"));
    k3_matmul(NULL, w, x, n, y);
    if (w->type == K3_W_Q8 || n < thresh) {
        CHECKF(!memcmp(y, y512, sizeof(float) * (size_t)(n * rows)), "%s n=%lld: amx table differs from avx512", what,
               (long long)n);
    } else {
        k3_matmul_ref(w, x, n, ref);
        double *abs = abs_sums(w, x, n);
        CHECKF(!within(y, ref, abs, n * rows, 1.0 / 256 + (double)cols / 16777216.0, what), "%s n=%lld: amx table",
               what, (long long)n);
        free(abs);
        k3_matmul(NULL, w, x + (n - thresh) * cols, thresh, ys); /* the last rows in a call of their own */
        CHECKF(!memcmp(ys, y + (n - thresh) * rows, sizeof(float) * (size_t)(thresh * rows)),
               "%s n=%lld: a row's bits depend on its call", what, (long long)n);
    }
    k3_kernels_force(K3_ISA_AVX512);
    free(x);
    free(y);
    free(y512);
    free(ref);
    free(ys);
}

K3_TEST(amx_kernel_table) {
    k3_error err = {0};
    const bool unit = k3_set_isa("amx", &err) == K3_OK;
    if (!unit) {
        CHECKF(err.status == K3_ERR_UNSUPPORTED && strstr(err.msg, "amx"), "--isa amx refused: %s", err.msg);
        if (!k3_kernels_force_amx_emulated()) SKIP("the \"amx\" table: %s; no emulation on this CPU", err.msg);
        printf("    (\"amx\" table on the emulated tiles: %s)\n", err.msg);
    }
    CHECK(!strcmp(k3_isa_current(), "amx") && k3_kernels_isa() == K3_ISA_AMX);
    k3_kernels_force(K3_ISA_AVX512);
    k3_mat b = bf16_mat(37, 70);
    for (int64_t n = 1; n <= 40; n += n < 9 ? 1 : 31) table_case(unit, &b, n, 8, "bf16 37x70");
    k3_mat m = mx4_mat(48, 96, 118, 12);
    for (int64_t n = 1; n <= 21; n += n < 5 ? 1 : 16) table_case(unit, &m, n, 4, "mxfp4 48x96");
    float *wf = fvec(40 * 130, 1.0f);
    k3_mat src = {.type = K3_W_F32, .rows = 40, .cols = 130, .data = wf};
    int8_t *wq = malloc(40 * 130);
    float *rs = malloc(sizeof(float) * 40);
    int32_t *sums = malloc(sizeof(int32_t) * 40);
    k3_quant_q8_mat(&src, wq, rs, sums);
    k3_mat q = {.type = K3_W_Q8, .rows = 40, .cols = 130, .data = wq, .row_scale = rs, .row_sum = sums, .act8 = true};
    for (int64_t n = 1; n <= 33; n += n < 9 ? 1 : 24) table_case(unit, &q, n, 8, "q8 40x130");
    free(wf);
    mat_free(&b);
    mat_free(&m);
    mat_free(&q);
    k3_kernels_force(K3_ISA_AVX512);
}

/* The trained k3-mini at temperature 0: the prompt's prefill on the "amx"
 * table (its products on the tiles), every decode step on AVX-512's kernels,
 * gives the AVX-512-only run's tokens. */
static bool mini_greedy(bool amx, bool unit, const int32_t *ids, int n, int32_t *out, int steps) {
    k3_error err = {0};
    k3_kernels_force(K3_ISA_AVX512);
    if (amx && !(unit ? k3_set_isa("amx", &err) == K3_OK : k3_kernels_force_amx_emulated())) return false;
    k3_model *m = NULL;
    k3_ctx *ctx = NULL;
    bool ok = k3_model_open(&m, "models/k3-mini", &err) == K3_OK;
    k3_model_info info;
    if (ok) k3_model_get_info(m, &info);
    k3_ctx_options o = {.max_seqs = 1, .cache_tokens = 128, .block_size = 16};
    ok = ok && k3_ctx_init(&ctx, m, &o, &err) == K3_OK;
    float *lg = ok ? malloc(sizeof(float) * (size_t)info.vocab_size) : NULL;
    k3_batch_seq b = {0, n, ids};
    for (int s = 0; ok && s < steps; s++) {
        ok = k3_ctx_forward(ctx, &b, 1, K3_LOGITS_LAST, lg, &err) == K3_OK;
        if (!ok) break;
        int32_t best = 0;
        for (int64_t v = 1; v < info.vocab_size; v++)
            if (lg[v] > lg[best]) best = (int32_t)v;
        out[s] = best;
        k3_kernels_force(K3_ISA_AVX512); /* decode on AVX-512 */
        b = (k3_batch_seq){0, 1, &out[s]};
    }
    CHECKF(ok, "k3-mini: %s", err.msg);
    free(lg);
    k3_ctx_free(ctx);
    k3_model_close(m);
    k3_kernels_force(K3_ISA_AVX512);
    return ok;
}

K3_TEST(amx_k3_mini_prefill_same_text) {
    k3_error err = {0};
    const bool unit = k3_set_isa("amx", &err) == K3_OK;
    k3_kernels_force(K3_ISA_AVX512);
    if (!unit && !k3_amx_emu_possible()) SKIP("%s; no emulation on this CPU", err.msg);
    k3_tokenizer *tok = NULL;
    REQUIREF(k3_tokenizer_open(&tok, "models/k3-mini", &err) == K3_OK, "%s", err.msg);
    static const char text[] = "It is a truth universally acknowledged, that a single man in possession of a good "
                               "fortune, must be in want of a wife. However little known the feelings";
    int32_t *ids = NULL;
    size_t n = 0;
    const k3_status es = k3_tokenizer_encode(tok, text, sizeof text - 1, &ids, &n, &err);
    k3_tokenizer_free(tok);
    REQUIREF(es == K3_OK, "%s", err.msg);
    enum { STEPS = 24 };
    int32_t a[STEPS], b[STEPS];
    const bool ran = mini_greedy(false, unit, ids, (int)n, a, STEPS) && mini_greedy(true, unit, ids, (int)n, b, STEPS);
    free(ids);
    if (!ran) return;
    int same = 0;
    while (same < STEPS && a[same] == b[same]) same++;
    printf("    k3-mini, %zu-token prompt: prefill on %s, %d/%d greedy tokens = the AVX-512 run's\n", n,
           unit ? "amx" : "the emulated tiles", same, STEPS);
    CHECK(same == STEPS);
}

/* ---- the DSA selection of a prefill chunk on the tiles (layers/mla.c) ---- */

/* k3_qli_chunk, the "amx" table's chunk entry on the unit: every token's
 * scores k3_qli_scores_ref's bits, on the tiles' shapes and zero-padded off
 * them (tiny-dsa's 2 heads of 32); no other table has the entry. */
K3_TEST(amx_qli_chunk_padded) {
    k3_error err = {0};
    k3_kernels_force(K3_ISA_AVX512);
    CHECK(!k3_qli_chunk_fits(16, 128));
    if (k3_set_isa("amx", &err) != K3_OK) SKIP("%s", err.msg);
    CHECK(k3_qli_chunk_fits(16, 128) && k3_qli_chunk_fits(2, 32) && k3_qli_chunk_fits(20, 96));
    CHECK(!k3_qli_chunk_fits(16, 1088));
    const int shapes[][4] = {{5, 2, 32, 20}, {3, 20, 96, 40}, {4, 16, 128, 50}, {2, 1, 4, 1}};
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, NULL) == K3_OK);
    for (int c = 0; c < 4; c++) {
        const int T = shapes[c][0], HI = shapes[c][1], dI = shapes[c][2], n = shapes[c][3], nslots = n + 7;
        int8_t *q8 = malloc((size_t)(T * HI * dI)), *k8 = malloc((size_t)(nslots * dI));
        float *qs = malloc(sizeof(float) * (size_t)(T * HI)), *w = malloc(sizeof(float) * (size_t)(T * HI));
        float *ks = malloc(sizeof(float) * (size_t)nslots), *ref = malloc(sizeof(float) * (size_t)(T * n));
        float *y = malloc(sizeof(float) * (size_t)(T * n));
        int64_t *slots = malloc(sizeof(int64_t) * (size_t)n);
        for (int i = 0; i < T * HI * dI; i++) q8[i] = (int8_t)((int)(rnd() % 255) - 127);
        for (int i = 0; i < nslots * dI; i++) k8[i] = (int8_t)((int)(rnd() % 255) - 127);
        for (int i = 0; i < T * HI; i++) {
            qs[i] = 1e-3f * (1 + rnd() % 100);
            w[i] = frand(0.5f);
        }
        for (int i = 0; i < nslots; i++) ks[i] = 1e-3f * (1 + rnd() % 100);
        for (int i = 0; i < n; i++) slots[i] = (i * 5 + 3) % nslots;
        for (int t = 0; t < T; t++)
            k3_qli_scores_ref(q8 + t * HI * dI, qs + t * HI, w + t * HI, HI, dI, k8, ks, slots, n, ref + t * n);
        for (int th = 0; th < 2; th++) {
            memset(y, 0, sizeof(float) * (size_t)(T * n));
            k3_qli_chunk(th ? pool : NULL, q8, qs, w, T, HI, dI, k8, ks, slots, n, y, n);
            CHECKF(!memcmp(y, ref, sizeof(float) * (size_t)(T * n)), "qli chunk T=%d HI=%d dI=%d n=%d (%d threads)", T,
                   HI, dI, n, th + 1);
        }
        free(q8);
        free(k8);
        free(qs);
        free(w);
        free(ks);
        free(ref);
        free(y);
        free(slots);
    }
    k3_pool_free(pool);
    k3_kernels_force(K3_ISA_AVX512);
}

/* Two rounds of tiny-dsa (C8) on a table: sequences 0 and 1 prefilled
 * together with a one-token sequence 2, then sequence 0's second chunk next
 * to a decode row of sequence 1. Each round's logits and the last layer's
 * (DSA) selection go to lg[r] and sel[r] (icount then the slots). */
enum { DSA_R0 = 37 + 29 + 1, DSA_R1 = 23 + 1, DSA_TOPK = 8 };
static bool dsa_rounds(const char *isa, float *lg[2], int64_t *sel[2], int64_t *V) {
    k3_error err = {0};
    k3_model *m = NULL;
    k3_pool *pool = NULL;
    k3_ctx *ctx = NULL;
    bool ok = k3_set_isa(isa, &err) == K3_OK && k3_model_open(&m, "tests/models/tiny-dsa", &err) == K3_OK &&
        k3_pool_init(&pool, 2, &err) == K3_OK;
    k3_model_info info;
    if (ok) k3_model_get_info(m, &info);
    k3_ctx_options o = {.max_seqs = 3, .cache_tokens = 192, .block_size = 16, .pool = pool, .kv_cache = K3_KV_C8};
    ok = ok && k3_ctx_init(&ctx, m, &o, &err) == K3_OK;
    if (ok) {
        *V = info.vocab_size;
        ok = ctx->c->index_topk == DSA_TOPK && ctx->c->n_layers == 8 && ctx->m->layers[7].kind == K3_LAYER_DSA;
        CHECKF(ok, "tiny-dsa: expected top-%d and a DSA last layer", DSA_TOPK);
    }
    int32_t ids[DSA_R0 + DSA_R1];
    for (int i = 0; i < DSA_R0 + DSA_R1; i++) ids[i] = (int32_t)((i * 131 + 7) % 1000);
    const k3_batch_seq r0[3] = {{0, 37, ids}, {1, 29, ids + 37}, {2, 1, ids + 66}};
    const k3_batch_seq r1[2] = {{0, 23, ids + DSA_R0}, {1, 1, ids + DSA_R0 + 23}};
    for (int r = 0; ok && r < 2; r++) {
        const int T = r ? DSA_R1 : DSA_R0;
        lg[r] = malloc(sizeof(float) * (size_t)(T * *V));
        sel[r] = calloc((size_t)(T * (DSA_TOPK + 1)), sizeof(int64_t));
        ok = k3_ctx_forward(ctx, r ? r1 : r0, r ? 2 : 3, K3_LOGITS_ALL, lg[r], &err) == K3_OK;
        for (int t = 0; ok && t < T; t++) {
            sel[r][t * (DSA_TOPK + 1)] = ctx->s.icount[t];
            memcpy(sel[r] + t * (DSA_TOPK + 1) + 1, ctx->s.isel + t * DSA_TOPK,
                   sizeof(int64_t) * (size_t)ctx->s.icount[t]);
        }
    }
    CHECKF(ok, "tiny-dsa on %s: %s", isa, err.msg);
    k3_ctx_free(ctx);
    k3_pool_free(pool);
    k3_model_close(m);
    k3_set_isa(NULL, &err);
    return ok;
}

/* A prefill on "amx" (the chunks' indexer scores on the tiles) selects the
 * same top-k slots and gives the same logits as on "avx512-bf16" (token by
 * token), bit for bit. */
K3_TEST(amx_dsa_prefill_chunk) {
    k3_error err = {0};
    if (k3_set_isa("amx", &err) != K3_OK) SKIP("%s", err.msg);
    CHECK(k3_qli_chunk_fits(2, 32)); /* tiny-dsa's indexer: the chunk path is taken */
    if (k3_set_isa("avx512-bf16", &err) != K3_OK) SKIP("%s", err.msg);
    CHECK(!k3_qli_chunk_fits(2, 32));
    float *la[2] = {0}, *lb[2] = {0};
    int64_t *sa[2] = {0}, *sb[2] = {0}, V = 0;
    if (dsa_rounds("avx512-bf16", lb, sb, &V) && dsa_rounds("amx", la, sa, &V)) {
        for (int r = 0; r < 2; r++) {
            const int T = r ? DSA_R1 : DSA_R0;
            int picked = 0;
            for (int t = 0; t < T; t++) picked += sb[r][t * (DSA_TOPK + 1)] == DSA_TOPK;
            CHECKF(picked > T / 2, "round %d: %d of %d rows select a full top-%d", r, picked, T, DSA_TOPK);
            CHECKF(!memcmp(sa[r], sb[r], sizeof(int64_t) * (size_t)(T * (DSA_TOPK + 1))),
                   "round %d: the selection on amx differs from avx512-bf16's", r);
            CHECKF(!memcmp(la[r], lb[r], sizeof(float) * (size_t)(T * V)),
                   "round %d: the logits on amx differ from avx512-bf16's", r);
        }
    }
    for (int r = 0; r < 2; r++) {
        free(la[r]);
        free(lb[r]);
        free(sa[r]);
        free(sb[r]);
    }
}
