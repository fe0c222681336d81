/* test_quant.c -- FP8 E4M3 codes, Q8 / MXFP8 conversion, and the 8-bit
 * activation matmuls (W8A8 Q8 and MXFP8, W4A8 MXFP4) == their
 * dequantize-then-fp32 reference, on every ISA path. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "kernels/kernels_isa.h"
#include "kernels/quant.h"
#include "test.h"

static uint64_t rng = 5;
static float frand(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) / 8388608.0) - 1.0f;
}

K3_TEST(quant_e4m3_codes) {
    CHECK(k3_e4m3_to_f32(0x7E) == 448.0f);
    CHECK(k3_e4m3_to_f32(0x01) == ldexpf(1, -9));
    CHECK(k3_e4m3_to_f32(0x08) == ldexpf(1, -6));
    CHECK(k3_e4m3_to_f32(0x38) == 1.0f);
    CHECK(k3_e4m3_to_f32(0xB8) == -1.0f);
    CHECK(isnan(k3_e4m3_to_f32(0x7F)));
    /* every finite code round-trips */
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7F) == 0x7F || c == 0x80) continue;
        CHECKF(k3_f32_to_e4m3(k3_e4m3_to_f32((uint8_t)c)) == c, "code 0x%02x", c);
    }
    CHECK(k3_f32_to_e4m3(1000.0f) == 0x7E);          /* saturates */
    CHECK(k3_f32_to_e4m3(1.0625f) == 0x38);          /* tie 1 + 1/16 -> even mantissa 0 */
    CHECK(k3_f32_to_e4m3(1.1875f) == 0x3A);          /* tie 1 + 3/16 -> even mantissa 2 */
    CHECK(k3_f32_to_e4m3(ldexpf(1.5f, -9)) == 0x02); /* subnormal tie to even */
}

static void check_matmul_q(k3_wtype type, int rows, int cols, int n) {
    float *wf = malloc(sizeof(float) * rows * cols), *x = malloc(sizeof(float) * n * cols);
    float *y = malloc(sizeof(float) * n * rows), *yr = malloc(sizeof(float) * n * rows);
    float *yf = malloc(sizeof(float) * n * rows);
    for (int i = 0; i < rows * cols; i++) wf[i] = frand() * (1 + (i % 7));
    for (int i = 0; i < n * cols; i++) x[i] = frand() * (i % 13 == 0 ? 8 : 1);
    k3_mat src = {.type = K3_W_F32, .rows = rows, .cols = cols, .data = wf};
    k3_mat w = {.type = type, .rows = rows, .cols = cols, .act8 = true};
    int8_t *q8 = NULL;
    uint8_t *q = NULL, *e = NULL;
    float *rs = NULL;
    int32_t *sums = NULL;
    if (type == K3_W_Q8) {
        q8 = malloc((size_t)rows * cols);
        rs = malloc(sizeof(float) * rows);
        sums = malloc(sizeof(int32_t) * rows);
        k3_quant_q8_mat(&src, q8, rs, sums);
        w.data = q8;
        w.row_scale = rs;
        w.row_sum = sums;
    } else if (type == K3_W_MXFP8) {
        q = malloc((size_t)rows * cols);
        e = malloc((size_t)rows * cols / 32);
        k3_quant_mxfp8_mat(&src, q, e);
        w.data = q;
        w.scale = e;
    } else { /* MXFP4: random codes and scales; R4: the same, tiled */
        q = malloc((size_t)rows * cols / 2);
        e = malloc((size_t)rows * cols / 32);
        for (int i = 0; i < rows * cols / 2; i++) q[i] = (uint8_t)(rng = rng * 6364136223846793005ull + 1, rng >> 56);
        for (int i = 0; i < rows * cols / 32; i++) e[i] = (uint8_t)(120 + i % 10);
        w.type = K3_W_MXFP4;
        w.data = q;
        w.scale = e;
        if (type == K3_W_MXFP4_R4) {
            uint8_t *tq = malloc((size_t)rows * cols / 2), *te = malloc((size_t)rows * cols / 32);
            k3_mx4_r4_pack(&w, tq, te);
            memcpy(q, tq, (size_t)rows * cols / 2);
            memcpy(e, te, (size_t)rows * cols / 32);
            free(tq);
            free(te);
            w.type = K3_W_MXFP4_R4;
        }
    }
    k3_matmul_q_ref(&w, x, n, yr);
    k3_pool *pool = NULL;
    k3_error err = {0};
    REQUIRE(k3_pool_init(&pool, 2, &err) == K3_OK);
    /* 0..2: ref, AVX2 (with AVX-VNNI where the CPU has it), AVX-512; 3: AVX2 without AVX-VNNI */
    for (int isa = K3_ISA_REF; isa <= K3_ISA_AVX512 + 1; isa++) {
        k3_kernels_force(isa > K3_ISA_AVX512 ? K3_ISA_AVX2 : (k3_isa)isa); /* a path the CPU lacks falls back */
        if (isa > K3_ISA_AVX512) k3_kernels_force_avxvnni(false);
        k3_matmul(pool, &w, x, n, y);
        const double r = k3_test_rel_l2(y, yr, (int64_t)n * rows);
        CHECKF(r < 1e-6, "type %d isa %d %dx%d n=%d: rel-L2 %.3g", type, isa, rows, cols, n, r);
    }
    k3_kernels_force(K3_ISA_AVX512);
    if (type != K3_W_MXFP8 && n * cols >= 65536) {
        /* activations quantized on both threads: each token alone (inline) gives the batch's bits */
        float *yt = malloc(sizeof(float) * rows);
        k3_matmul(pool, &w, x, n, y);
        for (int t = 0; t < n; t++) {
            k3_matmul(NULL, &w, x + t * cols, 1, yt);
            CHECKF(memcmp(yt, y + t * rows, sizeof(float) * rows) == 0, "type %d %dx%d n=%d: token %d alone differs",
                   type, rows, cols, n, t);
        }
        free(yt);
    }
    if (type != K3_W_MXFP4 && type != K3_W_MXFP4_R4) {
        /* and close to the unquantized fp32 product */
        k3_matmul_ref(&src, x, n, yf);
        const double r = k3_test_rel_l2(y, yf, (int64_t)n * rows);
        CHECKF(r < (type == K3_W_Q8 ? 0.02 : 0.08), "type %d %dx%d n=%d vs fp32: rel-L2 %.3g", type, rows, cols, n, r);
    }
    k3_pool_free(pool);
    free(wf);
    free(x);
    free(y);
    free(yr);
    free(yf);
    free(q8);
    free(rs);
    free(sums);
    free(q);
    free(e);
}

K3_TEST(quant_matmul_w8a8_w4a8) {
    const int shapes[][3] = {{1, 32, 1}, {37, 64, 3}, {64, 96, 8}, {130, 256, 17}};
    for (int s = 0; s < 4; s++) {
        check_matmul_q(K3_W_Q8, shapes[s][0], shapes[s][1], shapes[s][2]);
        check_matmul_q(K3_W_MXFP8, shapes[s][0], shapes[s][1], shapes[s][2]);
        check_matmul_q(K3_W_MXFP4, shapes[s][0], shapes[s][1], shapes[s][2]);
    }
    check_matmul_q(K3_W_Q8, 9, 50, 4);   /* int8 tail */
    check_matmul_q(K3_W_Q8, 33, 300, 1); /* decode with row sums: 256-column steps + tail */
    check_matmul_q(K3_W_Q8, 17, 1100, 3);
    check_matmul_q(K3_W_MXFP4, 21, 1120, 1); /* W4A8: 512-column scale groups + a 96-column tail */
    check_matmul_q(K3_W_MXFP4, 13, 384, 5);  /* a latent expert's down rows: 12 scales in one load */
    check_matmul_q(K3_W_MXFP4, 40, 640, 9);  /* 16 + 4 blocks */
    check_matmul_q(K3_W_MXFP4, 21, 1120, 9);
    /* enough tokens x columns that the activations are quantized on the pool */
    check_matmul_q(K3_W_Q8, 24, 512, 130);
    check_matmul_q(K3_W_MXFP4, 21, 1024, 80);
}

/* The tiles MXFP4_R4 hold the same weights (k3_mat_get_row, bit for bit),
 * and rows of 4-row views are the matrix's rows. */
K3_TEST(quant_w4a8_r4_pack_keeps_weights) {
    enum { R = 12, C = 384 };
    uint8_t pk[R * C / 2], sc[R * C / 32], tp[R * C / 2], ts[R * C / 32];
    for (int i = 0; i < R * C / 2; i++) pk[i] = (uint8_t)(rng = rng * 6364136223846793005ull + 1, rng >> 56);
    for (int i = 0; i < R * C / 32; i++) sc[i] = (uint8_t)(110 + i % 23);
    const k3_mat w = {.type = K3_W_MXFP4, .rows = R, .cols = C, .data = pk, .scale = sc, .act8 = true};
    k3_mx4_r4_pack(&w, tp, ts);
    const k3_mat t = {.type = K3_W_MXFP4_R4, .rows = R, .cols = C, .data = tp, .scale = ts, .act8 = true};
    const k3_mat v = k3_mat_rows(&t, 4, 8);
    float a[C], b[C];
    for (int r = 0; r < R; r++) {
        k3_mat_get_row(&w, r, a);
        k3_mat_get_row(&t, r, b);
        CHECKF(memcmp(a, b, sizeof a) == 0, "row %d", r);
        if (r >= 4) {
            k3_mat_get_row(&v, r - 4, b);
            CHECKF(memcmp(a, b, sizeof a) == 0, "view row %d", r);
        }
    }
    CHECK(k3_mat_row_bytes(&t) == k3_mat_row_bytes(&w));
}

/* W4A8 on tiles == the dequantize-then-fp32 reference, on every ISA path
 * (below AVX-512 VNNI the scalar one): one tile, a latent expert's shapes
 * (down: 384 columns; gate/up: 1024), decode and batches of 8 + a rest, and
 * row ranges that start inside a 16-row slice. */
K3_TEST(quant_matmul_w4a8_r4) {
    const int shapes[][3] = {{4, 128, 1}, {12, 384, 1}, {40, 1024, 1}, {36, 384, 11}, {20, 1024, 8}, {8, 256, 17}};
    for (int s = 0; s < 6; s++) check_matmul_q(K3_W_MXFP4_R4, shapes[s][0], shapes[s][1], shapes[s][2]);
}

/* The per-token int8 quantizer's SIMD form == the scalar one, bit for bit
 * (tails, zeros, values that round at .5, one outlier). */
K3_TEST(quant_act_i8_simd_equals_ref) {
    static const int ns[] = {1, 15, 16, 17, 100, 2048, 2053};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        const int n = ns[k];
        float *x = malloc(sizeof(float) * n);
        int8_t *a = malloc(n), *b = malloc(n);
        for (int i = 0; i < n; i++) x[i] = i % 11 == 0 ? 0.0f : frand() * (i % 7 == 0 ? 3.0f : 1.0f);
        x[n / 2] = 10.0f;                            /* amax: 127 / 10 per unit */
        if (n > 4) x[1] = 0.5f * 10.0f / 127.0f * 3; /* exactly 1.5 steps: ties to even */
        const float sa = k3_quant_act_i8_ref(x, n, a);
        for (int isa = K3_ISA_AVX2; isa <= K3_ISA_AVX512; isa++) {
            k3_kernels_force((k3_isa)isa); /* a path the CPU lacks falls back */
            memset(b, 0x55, (size_t)n);
            const float sb = k3_quant_act_i8(x, n, b);
            CHECKF(sa == sb && memcmp(a, b, (size_t)n) == 0, "n=%d isa %s", n, k3_isa_name(k3_kernels_isa()));
        }
        k3_kernels_force(K3_ISA_AVX512);
        free(x);
        free(a);
        free(b);
    }
    int8_t z[20];
    float zero[20] = {0};
    CHECK(k3_quant_act_i8(zero, 20, z) == 0.0f && z[0] == 0 && z[19] == 0);
}

/* MXFP8 block scale: the OCP rule, raised by one where it would clip
 * (amax in [448, 512) x 2^k), so no element saturates. */
K3_TEST(quant_mxfp8_scale_never_clips) {
    float row[32];
    uint8_t q[32], e[1];
    for (int i = 0; i < 32; i++) row[i] = 0.01f * (float)i;
    row[5] = 470.0f; /* OCP: 2^(8 - 8) = 1 -> 470 clips to 448 */
    k3_mat src = {.type = K3_W_F32, .rows = 1, .cols = 32, .data = row};
    k3_quant_mxfp8_mat(&src, q, e);
    CHECK(e[0] == 128); /* 2^1 */
    CHECK(fabsf(k3_e4m3_to_f32(q[5]) * 2.0f - 470.0f) <= 16.0f);
    row[5] = 440.0f; /* below 448: the OCP rule stands */
    k3_quant_mxfp8_mat(&src, q, e);
    CHECK(e[0] == 127 && k3_e4m3_to_f32(q[5]) == 448.0f);
}

/* The AVX-512 and AVX2 E4M3 decodes (through IEEE half) == the scalar one
 * for every code, normals and subnormals, under small, unit and large block
 * scales. */
static void check_mxfp8_decode(void (*dq)(const uint8_t *, const uint8_t *, int64_t, float *), const char *name) {
    uint8_t q[256], e[8];
    float out[256];
    for (int c = 0; c < 256; c++) q[c] = (uint8_t)((c & 0x7f) == 0x7f ? 0x7e : c);
    static const uint8_t scales[] = {1, 100, 127, 130, 200, 254};
    for (size_t s = 0; s < sizeof scales; s++) {
        for (int b = 0; b < 8; b++) e[b] = (uint8_t)(scales[s] + (b % 2 && scales[s] < 254 ? 1 : 0));
        dq(q, e, 256, out);
        int bad = 0;
        for (int c = 0; c < 256; c++) bad += out[c] != k3_e4m3_to_f32(q[c]) * k3_e8m0_to_f32(e[c / 32]);
        CHECKF(bad == 0, "%s, scale byte %d: %d codes differ", name, scales[s], bad);
    }
}

K3_TEST(quant_mxfp8_simd_decode_equals_ref) {
    if (!k3_kernels_have(K3_ISA_AVX2) && !k3_kernels_have(K3_ISA_AVX512))
        SKIP("neither AVX2 nor AVX-512 on this CPU: no SIMD decode to compare");
    if (k3_kernels_have(K3_ISA_AVX2)) check_mxfp8_decode(k3_mxfp8_dequant_avx2, "avx2");
    else printf("    (no AVX2 on this CPU: not run)\n");
    if (k3_kernels_have(K3_ISA_AVX512)) check_mxfp8_decode(k3_mxfp8_dequant_avx512, "avx512");
    else printf("    (no AVX-512 on this CPU: not run)\n");
}

/* Whether the AVX-512 VNNI+VBMI kernels can run here. */
static bool have_vnni_vbmi(void) {
    k3_kernels_init();
    return k3_kernels_isa() >= K3_ISA_AVX512 && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("avx512vbmi");
}

typedef void (*prep_fn)(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr);
typedef void (*rows_fn)(const k3_qjob *j, int64_t r0, int64_t r1);

/* Rows [r0, r1) of w against n tokens' activations as kernel f reads them
 * (xq, with corr for the W4A8 orders), into y [n, w->rows]. */
static void run_rows(rows_fn f, const k3_mat *w, const int8_t *xq, const int32_t *corr, int64_t ldc, const float *xs,
                     int64_t n, int64_t r0, int64_t r1, float *y) {
    const k3_qjob j = {.w = w, .n = n, .xq = xq, .corr = corr, .ldc = ldc, .xs = xs, .y = y};
    f(&j, r0, r1);
}

/* A W4A8 activation preparation's SIMD form (AVX-512 VBMI, AVX2) equals its scalar one,
 * bit for bit, for each of ncols row lengths, with extreme values. */
static void check_prep(prep_fn ref, prep_fn simd, const int64_t *cols, int ncols) {
    int8_t xq[2048], p1[2048], p2[2048];
    int32_t c1[256], c2[256];
    for (int k = 0; k < ncols; k++) {
        const int64_t C = cols[k];
        for (int64_t i = 0; i < C; i++)
            xq[i] = (int8_t)(i % 7 == 0 ? -127 : i % 5 == 0 ? 127 : (int)(frand() * 127.0f));
        memset(p1, 0x55, sizeof p1);
        memset(p2, 0x55, sizeof p2);
        memset(c1, 0x55, sizeof c1);
        memset(c2, 0x55, sizeof c2);
        ref(xq, C, p1, c1);
        simd(xq, C, p2, c2);
        CHECKF(memcmp(p1, p2, sizeof p1) == 0 && memcmp(c1, c2, sizeof c1) == 0, "cols %lld", (long long)C);
    }
}

/* The row layout: whole groups of 128 columns, a short last group. */
K3_TEST(quant_w4a8_prep_vbmi_equals_ref) {
    if (!have_vnni_vbmi()) SKIP("no AVX-512 VNNI+VBMI on this CPU");
    const int64_t cols[] = {32, 96, 128, 384, 1024, 1120, 2048};
    check_prep(k3_mx4_prep_ref, k3_mx4_prep_avx512_vbmi, cols, 7);
}

/* The tiles' order (k3_mx4_r4_prep). */
K3_TEST(quant_w4a8_r4_prep_vbmi_equals_ref) {
    if (!have_vnni_vbmi()) SKIP("no AVX-512 VNNI+VBMI on this CPU");
    const int64_t cols[] = {128, 384, 1024, 2048};
    check_prep(k3_mx4_r4_prep_ref, k3_mx4_r4_prep_avx512_vbmi, cols, 4);
}

/* The two AVX-512 kernels of a W4A8 layout (nibbles decoded by vpshufb, or
 * by vpermb with VBMI) give the same bits, and each token alone, its rows in
 * two calls split at `split`, gives the bits of the batch. tiles: the
 * matrix as MXFP4_R4. */
static void check_w4a8_kernels(bool tiles, int R, int C, int N, int split) {
    const int64_t ldc = (C + 127) / 128 * 16;
    uint8_t *pk = malloc((size_t)R * C / 2), *sc = malloc((size_t)R * C / 32);
    int8_t *xq = malloc((size_t)N * C), *xp = malloc((size_t)N * C);
    int32_t *corr = malloc(sizeof(int32_t) * N * ldc);
    float *x = malloc(sizeof(float) * N * C), *xs = malloc(sizeof(float) * N), *yt = malloc(sizeof(float) * R);
    float *y1 = malloc(sizeof(float) * N * R), *y2 = malloc(sizeof(float) * N * R);
    for (int i = 0; i < R * C / 2; i++) pk[i] = (uint8_t)(rng = rng * 6364136223846793005ull + 1, rng >> 56);
    for (int i = 0; i < R * C / 32; i++) sc[i] = (uint8_t)(118 + i % 13);
    if (tiles) {
        uint8_t *tp = malloc((size_t)R * C / 2), *ts = malloc((size_t)R * C / 32);
        const k3_mat w = {.type = K3_W_MXFP4, .rows = R, .cols = C, .data = pk, .scale = sc, .act8 = true};
        k3_mx4_r4_pack(&w, tp, ts);
        memcpy(pk, tp, (size_t)R * C / 2);
        memcpy(sc, ts, (size_t)R * C / 32);
        free(tp);
        free(ts);
    }
    const k3_mat wm =
        {.type = tiles ? K3_W_MXFP4_R4 : K3_W_MXFP4, .rows = R, .cols = C, .data = pk, .scale = sc, .act8 = true};
    const prep_fn prep = tiles ? k3_mx4_r4_prep : k3_mx4_prep;
    const rows_fn shufb = tiles ? k3_mx4_r4_rows_avx512 : k3_mx4_rows_avx512;
    const rows_fn vbmi = tiles ? k3_mx4_r4_rows_avx512_vbmi : k3_mx4_rows_avx512_vbmi;
    for (int i = 0; i < N * C; i++) x[i] = frand();
    for (int t = 0; t < N; t++) {
        xs[t] = k3_quant_act_i8(x + t * C, C, xq + t * C);
        prep(xq + t * C, C, xp + t * C, corr + t * ldc);
    }
    run_rows(shufb, &wm, xp, corr, ldc, xs, N, 0, R, y1);
    run_rows(vbmi, &wm, xp, corr, ldc, xs, N, 0, R, y2);
    CHECKF(memcmp(y1, y2, sizeof(float) * N * R) == 0, "tiles %d: vpshufb and vpermb differ", tiles);
    for (int t = 0; t < N; t++) {
        run_rows(vbmi, &wm, xp + t * C, corr + t * ldc, ldc, xs + t, 1, 0, split, yt);
        run_rows(vbmi, &wm, xp + t * C, corr + t * ldc, ldc, xs + t, 1, split, R, yt);
        CHECKF(memcmp(yt, y2 + t * R, sizeof(float) * R) == 0, "tiles %d: token %d alone differs from the batch", tiles,
               t);
    }
    free(pk);
    free(sc);
    free(xq);
    free(xp);
    free(corr);
    free(x);
    free(xs);
    free(yt);
    free(y1);
    free(y2);
}

/* Rows: 2 groups of 512 + a 96-column tail, 8 + 3 tokens, a split inside a
 * group of four rows (they are summed four at a time). Tiles: the latent
 * experts' 384 columns, a split between 16-row slices. */
K3_TEST(quant_w4a8_vbmi_equals_shufb) {
    if (!have_vnni_vbmi()) SKIP("no AVX-512 VNNI+VBMI on this CPU");
    check_w4a8_kernels(false, 19, 1120, 11, 7);
    check_w4a8_kernels(true, 24, 384, 11, 8);
}

/* ---- the AVX2 integer kernels (quant_avx2.c, declared in quant.h) ---- */

static bool have_avx2(void) { return k3_kernels_have(K3_ISA_AVX2); }

static bool have_avxvnni(void) {
    k3_kernels_force(K3_ISA_AVX2);
    const bool v = k3_kernels_avxvnni();
    k3_kernels_force(K3_ISA_AVX512);
    if (!v) printf("    (no AVX-VNNI on this CPU: that form not run)\n");
    return v;
}

/* W8A8 on AVX2: y == (float)(exact int dot) x xs x row_scale, the scalar
 * formula, bit for bit; plain AVX2 and AVX-VNNI (x + 128, minus 128 row_sum)
 * give the same bits; each token alone, and rows split at `split`, give the
 * bits of the batch (tiles of 3 or 4 rows, 48-row slices, int8 tails). */
static void check_q8_avx2(int R, int C, int N, int split) {
    int8_t *w = malloc((size_t)R * C), *xq = malloc((size_t)N * C), *xu = malloc((size_t)N * C);
    float *rs = malloc(sizeof(float) * R), *xs = malloc(sizeof(float) * N);
    int32_t *sums = malloc(sizeof(int32_t) * R);
    float *y0 = malloc(sizeof(float) * N * R), *y1 = malloc(sizeof(float) * N * R), *y2 = malloc(sizeof(float) * N * R);
    float *yt = malloc(sizeof(float) * R);
    for (int i = 0; i < R * C; i++) w[i] = (int8_t)(i % 11 == 0 ? -127 : i % 13 == 0 ? 127 : (int)(frand() * 127));
    for (int i = 0; i < N * C; i++) xq[i] = (int8_t)(i % 7 == 0 ? 127 : i % 5 == 0 ? -127 : (int)(frand() * 127));
    for (int i = 0; i < N * C; i++) xu[i] = (int8_t)((uint8_t)xq[i] ^ 0x80);
    for (int r = 0; r < R; r++) {
        rs[r] = 0.01f + 0.001f * (float)r;
        int32_t s = 0;
        for (int c = 0; c < C; c++) s += w[r * C + c];
        sums[r] = s;
    }
    for (int t = 0; t < N; t++) xs[t] = 0.02f + 0.003f * (float)t;
    const k3_mat wm = {.type = K3_W_Q8, .rows = R, .cols = C, .data = w, .row_scale = rs, .row_sum = sums};
    for (int t = 0; t < N; t++)
        for (int r = 0; r < R; r++) {
            int32_t d = 0;
            for (int c = 0; c < C; c++) d += (int32_t)w[r * C + c] * xq[t * C + c];
            y0[t * R + r] = (float)d * xs[t] * rs[r];
        }
    run_rows(k3_q8_rows_avx2, &wm, xq, NULL, 0, xs, N, 0, R, y1);
    CHECKF(memcmp(y0, y1, sizeof(float) * N * R) == 0, "%dx%d n=%d: plain AVX2 != scalar", R, C, N);
    for (int t = 0; t < N; t++) {
        run_rows(k3_q8_rows_avx2, &wm, xq + t * C, NULL, 0, xs + t, 1, 0, split, yt);
        run_rows(k3_q8_rows_avx2, &wm, xq + t * C, NULL, 0, xs + t, 1, split, R, yt);
        CHECKF(memcmp(yt, y0 + t * R, sizeof(float) * R) == 0, "plain: token %d alone differs", t);
    }
    if (k3_kernels_avxvnni() || (k3_kernels_force(K3_ISA_AVX2), k3_kernels_avxvnni())) {
        run_rows(k3_q8_rows_avxvnni, &wm, xu, NULL, 0, xs, N, 0, split, y2);
        run_rows(k3_q8_rows_avxvnni, &wm, xu, NULL, 0, xs, N, split, R, y2);
        CHECKF(memcmp(y0, y2, sizeof(float) * N * R) == 0, "%dx%d n=%d: AVX-VNNI != scalar", R, C, N);
        for (int t = 0; t < N; t++) {
            run_rows(k3_q8_rows_avxvnni, &wm, xu + t * C, NULL, 0, xs + t, 1, 0, R, yt);
            CHECKF(memcmp(yt, y0 + t * R, sizeof(float) * R) == 0, "VNNI: token %d alone differs", t);
        }
    }
    k3_kernels_force(K3_ISA_AVX512);
    free(w);
    free(xq);
    free(xu);
    free(rs);
    free(xs);
    free(sums);
    free(y0);
    free(y1);
    free(y2);
    free(yt);
}

K3_TEST(quant_w8a8_avx2_equals_scalar) {
    if (!have_avx2()) SKIP("no AVX2 on this CPU");
    have_avxvnni();
    check_q8_avx2(7, 64, 1, 3);    /* decode, a row tail of the tiles; one token: row pairs + an odd row */
    check_q8_avx2(5, 8200, 1, 2);  /* one token, rows longer than the |x| buffer (column chunks) */
    check_q8_avx2(6, 4128, 1, 1);  /* one token, a 32-column step after the 64-column ones */
    check_q8_avx2(50, 300, 7, 13); /* int8 tail, two 48-row slices, token groups of 3 + 1 */
    check_q8_avx2(13, 1040, 5, 4); /* the 128-column decode steps + a 32-column one */
    check_q8_avx2(96, 2048, 2, 48);
}

/* The tiles' order on AVX2 (k3_mx4_r4_prep_avx2, what the AVX2 path takes). */
K3_TEST(quant_w4a8_r4_prep_avx2_equals_ref) {
    if (!have_avx2()) SKIP("no AVX2 on this CPU");
    const int64_t cols[] = {128, 384, 1024, 2048};
    check_prep(k3_mx4_r4_prep_ref, k3_mx4_r4_prep_avx2, cols, 4);
}

/* W4A8 on tiles on AVX2: plain and AVX-VNNI give the same bits as each
 * other, as the AVX-512 tile kernel (where the CPU has it), and, per token
 * and row split, as the batch; and they match the dequantized reference. */
static void check_w4a8_avx2(int R, int C, int N, int split) {
    const int64_t ldc = (C + 127) / 128 * 16;
    uint8_t *pk = malloc((size_t)R * C / 2), *sc = malloc((size_t)R * C / 32);
    uint8_t *tp = malloc((size_t)R * C / 2), *ts = malloc((size_t)R * C / 32);
    int8_t *xq = malloc((size_t)N * C), *xp = malloc((size_t)N * C);
    int32_t *corr = malloc(sizeof(int32_t) * N * ldc);
    float *x = malloc(sizeof(float) * N * C), *xs = malloc(sizeof(float) * N), *yt = malloc(sizeof(float) * R);
    float *y1 = malloc(sizeof(float) * N * R), *y2 = malloc(sizeof(float) * N * R), *yr = malloc(sizeof(float) * N * R);
    for (int i = 0; i < R * C / 2; i++) pk[i] = (uint8_t)(rng = rng * 6364136223846793005ull + 1, rng >> 56);
    for (int i = 0; i < R * C / 32; i++)
        sc[i] = (uint8_t)(i % 17 == 0 ? i % 3 : 118 + i % 13); /* and subnormal scales */
    const k3_mat w = {.type = K3_W_MXFP4, .rows = R, .cols = C, .data = pk, .scale = sc, .act8 = true};
    k3_mx4_r4_pack(&w, tp, ts);
    const k3_mat wt = {.type = K3_W_MXFP4_R4, .rows = R, .cols = C, .data = tp, .scale = ts, .act8 = true};
    for (int i = 0; i < N * C; i++) x[i] = frand() * (i % 29 == 0 ? 6.0f : 1.0f);
    for (int t = 0; t < N; t++) {
        xs[t] = k3_quant_act_i8_ref(x + t * C, C, xq + t * C);
        k3_mx4_r4_prep_ref(xq + t * C, C, xp + t * C, corr + t * ldc);
    }
    run_rows(k3_mx4_r4_rows_avx2, &wt, xp, corr, ldc, xs, N, 0, R, y1);
    k3_kernels_force(K3_ISA_REF);
    k3_matmul_q_ref(&w, x, N, yr);
    k3_kernels_force(K3_ISA_AVX512);
    const double rel = k3_test_rel_l2(y1, yr, (int64_t)N * R);
    CHECKF(rel < 1e-6, "%dx%d n=%d: rel-L2 %.3g vs the reference", R, C, N, rel);
    for (int t = 0; t < N; t++) {
        run_rows(k3_mx4_r4_rows_avx2, &wt, xp + t * C, corr + t * ldc, ldc, xs + t, 1, 0, split, yt);
        run_rows(k3_mx4_r4_rows_avx2, &wt, xp + t * C, corr + t * ldc, ldc, xs + t, 1, split, R, yt);
        CHECKF(memcmp(yt, y1 + t * R, sizeof(float) * R) == 0, "plain: token %d alone differs", t);
    }
    k3_kernels_force(K3_ISA_AVX2);
    if (k3_kernels_avxvnni()) {
        run_rows(k3_mx4_r4_rows_avxvnni, &wt, xp, corr, ldc, xs, N, 0, R, y2);
        CHECKF(memcmp(y1, y2, sizeof(float) * N * R) == 0, "%dx%d n=%d: AVX-VNNI != plain", R, C, N);
        for (int t = 0; t < N; t++) {
            run_rows(k3_mx4_r4_rows_avxvnni, &wt, xp + t * C, corr + t * ldc, ldc, xs + t, 1, 0, split, yt);
            run_rows(k3_mx4_r4_rows_avxvnni, &wt, xp + t * C, corr + t * ldc, ldc, xs + t, 1, split, R, yt);
            CHECKF(memcmp(yt, y1 + t * R, sizeof(float) * R) == 0, "VNNI: token %d alone differs", t);
        }
    }
    k3_kernels_force(K3_ISA_AVX512);
    if (k3_kernels_isa() >= K3_ISA_AVX512 && __builtin_cpu_supports("avx512vnni")) {
        run_rows(k3_mx4_r4_rows_avx512, &wt, xp, corr, ldc, xs, N, 0, R, y2);
        CHECKF(memcmp(y1, y2, sizeof(float) * N * R) == 0, "%dx%d n=%d: AVX2 != AVX-512 tiles", R, C, N);
    }
    free(pk);
    free(sc);
    free(tp);
    free(ts);
    free(xq);
    free(xp);
    free(corr);
    free(x);
    free(xs);
    free(yt);
    free(y1);
    free(y2);
    free(yr);
}

K3_TEST(quant_w4a8_avx2_tiles) {
    if (!have_avx2()) SKIP("no AVX2 on this CPU");
    check_w4a8_avx2(4, 128, 1, 4);    /* one tile, one group */
    check_w4a8_avx2(24, 384, 11, 8);  /* the latent experts' down rows, 8 + 3 tokens, a split between slices */
    check_w4a8_avx2(36, 1024, 9, 20); /* gate/up rows, a split inside a slice */
}

/* W8A8 prefill on the AVX-512 VNNI token panels (n >= K3_Q8_PANEL_MIN,
 * cols % 4 == 0) through k3_matmul on two threads: y == (float)(exact int
 * dot) x xs x row_scale of the scalar quantizer, bit for bit, and each token
 * alone (the one-row decode path) gives the bits of the batch. The shapes
 * reach every register block (8, 4 and 1 rows; 1-3 panels, a part-filled
 * one), column blocks with a short last one, and cols % 4 != 0 (no panels). */
static void check_q8_panels(k3_pool *pool, int R, int C, int N) {
    int8_t *w = malloc((size_t)R * C), *xq = malloc((size_t)N * C);
    float *rs = malloc(sizeof(float) * R), *xs = malloc(sizeof(float) * N), *x = malloc(sizeof(float) * N * C);
    int32_t *sums = malloc(sizeof(int32_t) * R);
    float *y0 = malloc(sizeof(float) * N * R), *y1 = malloc(sizeof(float) * N * R), *yt = malloc(sizeof(float) * R);
    for (int i = 0; i < R * C; i++) w[i] = (int8_t)(i % 11 == 0 ? -127 : i % 13 == 0 ? 127 : (int)(frand() * 127));
    for (int i = 0; i < N * C; i++) x[i] = i % 17 == 0 ? 0.0f : frand() * (i % 7 == 0 ? 4.0f : 1.0f);
    for (int r = 0; r < R; r++) {
        rs[r] = 0.01f + 0.001f * (float)r;
        int32_t s = 0;
        for (int c = 0; c < C; c++) s += w[r * C + c];
        sums[r] = s;
    }
    for (int t = 0; t < N; t++) xs[t] = k3_quant_act_i8_ref(x + t * C, C, xq + t * C);
    for (int t = 0; t < N; t++)
        for (int r = 0; r < R; r++) {
            int32_t d = 0;
            for (int c = 0; c < C; c++) d += (int32_t)w[r * C + c] * xq[t * C + c];
            y0[t * R + r] = (float)d * xs[t] * rs[r];
        }
    const k3_mat wm =
        {.type = K3_W_Q8, .rows = R, .cols = C, .act8 = true, .data = w, .row_scale = rs, .row_sum = sums};
    k3_matmul(pool, &wm, x, N, y1);
    CHECKF(memcmp(y0, y1, sizeof(float) * N * R) == 0, "%dx%d n=%d: AVX-512 W8A8 != scalar", R, C, N);
    for (int t = 0; t < N; t++) {
        k3_matmul(pool, &wm, x + t * C, 1, yt);
        CHECKF(memcmp(yt, y1 + t * R, sizeof(float) * R) == 0, "%dx%d n=%d: token %d alone differs", R, C, N, t);
    }
    free(w);
    free(xq);
    free(rs);
    free(xs);
    free(x);
    free(sums);
    free(y0);
    free(y1);
    free(yt);
}

K3_TEST(quant_w8a8_avx512_panels_equal_scalar) {
    k3_kernels_force(K3_ISA_AVX512);
    if (k3_kernels_isa() < K3_ISA_AVX512 || !__builtin_cpu_supports("avx512vnni")) SKIP("no AVX-512 VNNI on this CPU");
    k3_pool *pool = NULL;
    k3_error err;
    REQUIRE(k3_pool_init(&pool, 2, &err) == K3_OK);
    check_q8_panels(pool, 64, 2048, 100); /* 3 + 3 panels (the last part-filled), 8 column blocks */
    check_q8_panels(pool, 44, 600, 49);   /* 8-row blocks + a 4-row one, 1 + a short column block */
    check_q8_panels(pool, 23, 36, 16);    /* one panel; 8, 8, 4, 1, 1, 1 rows */
    check_q8_panels(pool, 131, 1028, 33); /* two 64-row slices + 3 rows, 2 + 1 panels */
    check_q8_panels(pool, 16, 30, 20);    /* cols % 4: the tiles, no panels */
    check_q8_panels(pool, 8, 4, 47);      /* one column group */
    k3_pool_free(pool);
}

/* W4A8 tiles with enough tokens x columns that the activations are
 * quantized and prepared on the pool (check_matmul_q: each token alone gives
 * the batch's bits). */
K3_TEST(quant_w4a8_r4_prep_on_the_pool) { check_matmul_q(K3_W_MXFP4_R4, 40, 1024, 70); }
