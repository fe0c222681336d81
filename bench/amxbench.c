/*
 * amxbench.c -- the AMX kernels alone (src/kernels/amx.h): the unit's peak
 * by a tile loop, then a MoE layer's routed experts on the bench
 * checkpoint's shapes (64 experts, top 8, 1024 -> 2 x 384 -> 1024,
 * SiLU-gated) with the weights read from DRAM (layers cycled, more than the
 * last-level cache), per format and token count, beside the AVX-512 kernels
 * (k3_matmul) on the same experts; then BF16 trunk shapes. A developer tool
 * (`make amxbench`), not part of k3.
 *
 *   build/amxbench [threads]            (default 1)
 *   AB_TOKENS=512,64,8,4,2,1  tokens routed (each to 8 experts)
 *   AB_FMT=bf16,mxfp4,mxfp4-i8,q8   formats (q8: W8A8; mxfp4-i8: the INT8 route)
 *   AB_MB=600     MB of expert weights per format (layers cycled)
 *   AB_RUNS=9     timed layer calls per point (median)
 *   AB_AVX=0      skip the AVX-512 baselines; AB_TRUNK=0 skip the trunk shapes
 *   AB_QLI=4096   key slots of the DSA indexer run (16 heads of 128, 512 and 64 tokens); 0 skips it
 *   AB_BFDOT=1    the amx table's BF16 dot products as the model runs them (k3_amx_bf_call on
 *                 K3_W_BF16_S16 strips, k3_amx_moe_bf on K3_W_MXFP4_S16 experts) at AB_BFN
 *                 tokens (default 128,512,2048), weights cycled from DRAM; 0 skips it
 *   AB_EMU=1      the emulated kernels (checks the tool; its times mean nothing)
 *   AB_AMX=0      only the AVX-512 baselines (runs on any AVX-512 machine)
 * Time the figures under `flock -x /tmp/k3-cpu.lock`.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "k3.h"
#include "kernels/amx.h"
#include "kernels/attn_ops.h"
#include "kernels/kernels.h"
#include "kernels/kernels_isa.h"
#include "kernels/quant.h"

enum { NE = 64, TOPK = 8, HID = 1024, INTER = 384 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float frand(void) { return (float)((int)(rnd() % 2001) - 1000) / 1000.0f; }

static int cmpd(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static const char *env(const char *k, const char *d) { return getenv(k) ? getenv(k) : d; }

/* One expert's three matrices in a format, as stored (k3_mat) and as the
 * AMX kernels read them. */
typedef struct bexp {
    k3_mat g, u, d;
    k3_mat r4[3]; /* W4A8: the AVX-512 kernel's K3_W_MXFP4_R4 tiles, as the model makes them */
    k3_amx_expert a;
} bexp;

static k3_mat r4_copy(const k3_mat *w) {
    if (!k3_mx4_r4_wanted(w)) return *w;
    k3_mat t = *w;
    uint8_t *d = aligned_alloc(64, (size_t)(w->rows * w->cols / 2)), *s = aligned_alloc(64, (size_t)(w->rows * w->cols / 32) + 64);
    k3_mx4_r4_pack(w, d, s);
    t.type = K3_W_MXFP4_R4;
    t.data = d;
    t.scale = s;
    return t;
}

static k3_mat make_mat(const char *fmt, int64_t rows, int64_t cols) {
    k3_mat w = {.rows = rows, .cols = cols};
    if (!strcmp(fmt, "bf16")) {
        uint16_t *d = aligned_alloc(64, 2 * (size_t)(rows * cols));
        for (int64_t i = 0; i < rows * cols; i++) d[i] = k3_f32_to_bf16(frand() * 0.05f);
        w.type = K3_W_BF16;
        w.data = d;
    } else if (!strncmp(fmt, "mxfp4", 5)) {
        uint8_t *d = aligned_alloc(64, (size_t)(rows * cols / 2)), *s = aligned_alloc(64, (size_t)(rows * cols / 32) + 64);
        for (int64_t i = 0; i < rows * cols / 2; i++) d[i] = (uint8_t)rnd();
        for (int64_t i = 0; i < rows * cols / 32; i++) s[i] = (uint8_t)(118 + rnd() % 6);
        w.type = K3_W_MXFP4;
        w.data = d;
        w.scale = s;
        w.act8 = !strcmp(fmt, "mxfp4-i8");
    } else { /* q8 */
        float *f = malloc(sizeof(float) * (size_t)(rows * cols));
        for (int64_t i = 0; i < rows * cols; i++) f[i] = frand();
        k3_mat src = {.type = K3_W_F32, .rows = rows, .cols = cols, .data = f};
        int8_t *q = aligned_alloc(64, (size_t)(rows * cols));
        float *s = malloc(sizeof(float) * (size_t)rows);
        int32_t *sum = malloc(sizeof(int32_t) * (size_t)rows);
        k3_quant_q8_mat(&src, q, s, sum);
        free(f);
        w.type = K3_W_Q8;
        w.data = q;
        w.row_scale = s;
        w.row_sum = sum;
        w.act8 = true;
    }
    return w;
}

/* The layer's experts through the AMX kernels: fused (k3_amx_moe) where the
 * format has it, else gate, up, act and down as products. */
static void run_amx(k3_pool *pool, const bexp *E, const int64_t *row0, const float *x, float *y, float *g, float *u,
                    bool fused) {
    if (fused) {
        k3_amx_expert ex[NE];
        for (int e = 0; e < NE; e++) ex[e] = E[e].a;
        k3_amx_moe(pool, ex, NE, row0, x, y, K3_GLU_SWIGLU, 0, 0);
        return;
    }
    for (int e = 0; e < NE; e++) {
        const int64_t m = row0[e + 1] - row0[e];
        if (!m) continue;
        k3_amx_matmul(pool, &E[e].a.gate, x + row0[e] * HID, m, g);
        k3_amx_matmul(pool, &E[e].a.up, x + row0[e] * HID, m, u);
        k3_glu(g, u, m * INTER, K3_GLU_SWIGLU, 0, 0);
        k3_amx_matmul(pool, &E[e].a.down, g, m, y + row0[e] * HID);
    }
}

/* The same experts through k3_matmul (the AVX-512 kernels). */
static void run_avx(k3_pool *pool, const bexp *E, const int64_t *row0, const float *x, float *y, float *g, float *u) {
    for (int e = 0; e < NE; e++) {
        const int64_t m = row0[e + 1] - row0[e];
        if (!m) continue;
        k3_matmul(pool, &E[e].r4[0], x + row0[e] * HID, m, g);
        k3_matmul(pool, &E[e].r4[1], x + row0[e] * HID, m, u);
        k3_glu(g, u, m * INTER, K3_GLU_SWIGLU, 0, 0);
        k3_matmul(pool, &E[e].r4[2], g, m, y + row0[e] * HID);
    }
}

/* Routes T tokens to TOPK distinct experts each; row0 gets each expert's
 * first gathered row. */
static void route(int64_t T, int64_t *row0) {
    int64_t cnt[NE] = {0};
    for (int64_t t = 0; t < T; t++) {
        int pick[TOPK];
        for (int k = 0; k < TOPK; k++) {
            int e, dup;
            do {
                e = (int)(rnd() % NE);
                dup = 0;
                for (int j = 0; j < k; j++) dup |= pick[j] == e;
            } while (dup);
            pick[k] = e;
            cnt[e]++;
        }
    }
    row0[0] = 0;
    for (int e = 0; e < NE; e++) row0[e + 1] = row0[e] + cnt[e];
}

/* w (BF16 or MXFP4, k3_mat.bf16) as the strips the model makes at load
 * (K3_W_BF16_S16, K3_W_MXFP4_S16); the stored copy freed. */
static k3_mat strips(k3_mat w) {
    w.bf16 = true;
    const size_t nb = k3_mat_data_bytes(&w), ns = k3_mat_scale_bytes(&w);
    uint8_t *d = aligned_alloc(64, nb), *sc = ns ? aligned_alloc(64, ns + 64) : NULL;
    k3_s16_pack(&w, d, sc);
    free((void *)w.data);
    if (ns) free((void *)w.scale);
    w.type = w.type == K3_W_MXFP4 ? K3_W_MXFP4_S16 : K3_W_BF16_S16;
    w.data = d;
    if (ns) w.scale = sc;
    return w;
}

/* The amx table's BF16 dot products over n tokens: trunk shapes (copies
 * cycled so each call reads its weights from DRAM) and one MoE layer's
 * routed experts grouped (layers cycled). GFLOP/s of the products. */
static void bfdot(k3_pool *pool, int64_t n, int runs) {
    static const int64_t sh[][2] = {{2048, 2048}, {5632, 2048}, {2048, 5632}, {2048, 7168}};
    enum { NC = 6, NL = 4 };
    const int nr = runs < 64 ? runs : 64;
    double t[64];
    float *x = malloc(sizeof(float) * (size_t)(n * 7168)), *y = aligned_alloc(64, sizeof(float) * (size_t)(n * TOPK * 5632));
    for (int64_t j = 0; j < n * 7168; j++) x[j] = frand();
    printf("  %5lld tokens:", (long long)n);
    for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++) {
        k3_mat w[NC];
        for (int c = 0; c < NC; c++) w[c] = strips(make_mat("bf16", sh[i][0], sh[i][1]));
        for (int r = 0; r < nr; r++) {
            const double t0 = now_s();
            k3_amx_bf_call(pool, &w[r % NC], x, n, y);
            t[r] = now_s() - t0;
        }
        qsort(t, (size_t)nr, sizeof t[0], cmpd);
        printf(" %lldx%lld %6.1f", (long long)sh[i][0], (long long)sh[i][1], 2.0 * n * sh[i][0] * sh[i][1] / 1e9 / t[nr / 2]);
        for (int c = 0; c < NC; c++) free((void *)w[c].data);
    }
    k3_mat *g = malloc(sizeof(k3_mat) * NE * NL * 3), *u = g + NE * NL, *d = u + NE * NL;
    for (int e = 0; e < NE * NL; e++) {
        g[e] = strips(make_mat("mxfp4", INTER, HID));
        u[e] = strips(make_mat("mxfp4", INTER, HID));
        d[e] = strips(make_mat("mxfp4", HID, INTER));
    }
    int32_t *row0 = calloc(NE + 1, sizeof(int32_t)), *rows = malloc(sizeof(int32_t) * (size_t)(n * TOPK)),
            *sel = malloc(sizeof(int32_t) * (size_t)(n * TOPK)), eact[NE], fill[NE] = {0};
    for (int64_t tk = 0; tk < n; tk++)
        for (int k = 0; k < TOPK; k++) {
            int e, dup;
            do {
                e = (int)(rnd() % NE);
                dup = 0;
                for (int j = 0; j < k; j++) dup |= sel[tk * TOPK + j] == e;
            } while (dup);
            sel[tk * TOPK + k] = e;
            row0[e + 1]++;
        }
    for (int e = 0; e < NE; e++) row0[e + 1] += row0[e];
    for (int64_t tk = 0; tk < n; tk++)
        for (int k = 0; k < TOPK; k++) {
            const int e = sel[tk * TOPK + k];
            rows[row0[e] + fill[e]++] = (int32_t)(tk * TOPK + k);
        }
    int na = 0;
    for (int e = 0; e < NE; e++)
        if (row0[e + 1] > row0[e]) eact[na++] = e;
    for (int r = 0; r < nr; r++) {
        const int L = r % NL;
        const double t0 = now_s();
        k3_amx_moe_bf(pool, g + L * NE, u + L * NE, d + L * NE, eact, na, row0, rows, TOPK, x, HID, y, HID,
                      K3_GLU_SWIGLU, 0, 0);
        t[r] = now_s() - t0;
    }
    qsort(t, (size_t)nr, sizeof t[0], cmpd);
    printf("   experts %6.1f\n", 2.0 * n * TOPK * 3.0 * HID * INTER / 1e9 / t[nr / 2]);
    for (int e = 0; e < 3 * NE * NL; e++) {
        free((void *)g[e].data);
        free((void *)g[e].scale);
    }
    free(g);
    free(row0);
    free(rows);
    free(sel);
    free(x);
    free(y);
}

int main(int argc, char **argv) {
    const int nth = argc > 1 ? atoi(argv[1]) : 1;
    k3_pool *pool = NULL;
    k3_error err = {0};
    if (nth > 1 && k3_pool_init(&pool, nth, &err) != K3_OK) return 1;
    k3_kernels_init();
    const bool emu = atoi(env("AB_EMU", "0")) != 0, amx = atoi(env("AB_AMX", "1")) != 0;
    if (!amx) {
        printf("AVX-512 baselines only (AB_AMX=0)\n");
    } else if (emu) {
        k3_amx_emulate(true);
        if (!k3_amx_emu_possible()) {
            fprintf(stderr, "amxbench: this CPU cannot run the emulation (AVX-512 BF16/VNNI)\n");
            return 2;
        }
    } else if (k3_amx_init(&err) != K3_OK) {
        fprintf(stderr, "amxbench: %s (AB_EMU=1 runs the emulation, to check the tool)\n", err.msg);
        return 2;
    }
    char l2[64] = "?";
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index2/size", "r");
    if (f) {
        if (!fgets(l2, sizeof l2, f)) l2[0] = 0;
        l2[strcspn(l2, "\n")] = 0;
        fclose(f);
    }
    printf("kernels %s, avx isa %s, threads %d, L2 per core %s\n", k3_amx_backend(), k3_isa_current(), nth, l2);
    if (emu) printf("EMULATED: the times below are the C emulation's, not the unit's\n");

    /* ---- the peak ---- */
    double peak[2] = {1, 1};
    for (int i8 = 0; amx && i8 < 2; i8++) {
        double best = 0;
        const int64_t iters = emu ? 200 : 100000;
        for (int r = 0; r < 5; r++) {
            const double t0 = now_s();
            const double ops = k3_amx_peak_loop(i8, iters);
            const double dt = now_s() - t0;
            best = ops / dt > best ? ops / dt : best;
        }
        peak[i8] = best / 1e9;
        printf("peak (tile loop, 2x2 accumulators, one thread): %s %.0f G%s/s\n", i8 ? "INT8" : "BF16", peak[i8],
               i8 ? "OP" : "FLOP");
    }

    /* ---- the routed experts ---- */
    char fmts[128], toks[128];
    snprintf(fmts, sizeof fmts, "%s", env("AB_FMT", "bf16,mxfp4,mxfp4-i8,q8"));
    snprintf(toks, sizeof toks, "%s", env("AB_TOKENS", "512,64,8,4,2,1"));
    const double mb = atof(env("AB_MB", "600"));
    const int runs = atoi(env("AB_RUNS", "9"));
    const bool avx = atoi(env("AB_AVX", "1")) != 0;
    const int64_t tmax = 512;
    float *x = malloc(sizeof(float) * TOPK * tmax * HID), *y = malloc(sizeof(float) * TOPK * tmax * HID);
    float *g = malloc(sizeof(float) * TOPK * tmax * INTER), *u = malloc(sizeof(float) * TOPK * tmax * INTER);
    for (int64_t i = 0; i < TOPK * tmax * HID; i++) x[i] = frand();
    printf("\nrouted experts: %d x (gate+up %d->2x%d, down %d->%d), SiLU-gated, top %d; GFLOP/s of routed rows "
           "(2 x %d flops each), median of %d layer calls, weights from DRAM\n",
           NE, HID, INTER, INTER, HID, TOPK, 2 * (2 * INTER * HID + HID * INTER), runs);
    char *fsv = NULL;
    for (char *fs = strtok_r(fmts, ",", &fsv); fs; fs = strtok_r(NULL, ",", &fsv)) {
        char fmt[32];
        snprintf(fmt, sizeof fmt, "%s", fs);
        const double layer_mb = NE * (3.0 * INTER * HID) *
                                (!strcmp(fmt, "bf16") ? 2.0 : !strcmp(fmt, "q8") ? 1.0 : 17.0 / 32) / 1e6;
        int nl = (int)(mb / layer_mb + 0.999);
        if (nl < 2) nl = 2;
        bexp(*L)[NE] = calloc((size_t)nl, sizeof *L);
        for (int l = 0; l < nl; l++)
            for (int e = 0; e < NE; e++) {
                bexp *b = &L[l][e];
                b->g = make_mat(fmt, INTER, HID);
                b->u = make_mat(fmt, INTER, HID);
                b->d = make_mat(fmt, HID, INTER);
                b->r4[0] = r4_copy(&b->g);
                b->r4[1] = r4_copy(&b->u);
                b->r4[2] = r4_copy(&b->d);
                if (k3_amx_view(&b->g, &b->a.gate, &err) || k3_amx_view(&b->u, &b->a.up, &err) ||
                    k3_amx_view(&b->d, &b->a.down, &err)) {
                    fprintf(stderr, "amxbench: %s\n", err.msg);
                    return 1;
                }
            }
        const bool fused = !strcmp(fmt, "bf16") || !strcmp(fmt, "mxfp4");
        printf("%-9s %d layers of %.0f MB%s\n", fmt, nl, layer_mb, !amx ? "" : fused ? " (k3_amx_moe)" : " (products)");
        char tl[128];
        snprintf(tl, sizeof tl, "%s", toks);
        char *sv = NULL;
        for (char *ts = strtok_r(tl, ",", &sv); ts; ts = strtok_r(NULL, ",", &sv)) {
            const int64_t T = atoll(ts);
            if (T < 1 || T > tmax) continue;
            int64_t row0[NE + 1];
            route(T, row0);
            const double flop = 2.0 * (double)row0[NE] * (2.0 * INTER * HID + (double)HID * INTER);
            double ta[64], tv[64];
            const int nr = runs < 64 ? runs : 64;
            for (int r = 0; r < nr; r++) { /* a different layer each call: its weights are not cached */
                const bexp *E = L[r % nl];
                double t0 = now_s();
                if (amx) run_amx(pool, E, row0, x, y, g, u, fused);
                ta[r] = now_s() - t0;
                tv[r] = 0;
                if (avx && !(emu && T > 8)) {
                    const bexp *E2 = L[(r + nl / 2) % nl];
                    t0 = now_s();
                    run_avx(pool, E2, row0, x, y, g, u);
                    tv[r] = now_s() - t0;
                }
            }
            qsort(ta, (size_t)nr, sizeof ta[0], cmpd);
            qsort(tv, (size_t)nr, sizeof tv[0], cmpd);
            const double ga = flop / ta[nr / 2] / 1e9, gv = tv[nr / 2] > 0 ? flop / tv[nr / 2] / 1e9 : 0;
            const double pk = !strcmp(fmt, "q8") || !strcmp(fmt, "mxfp4-i8") ? peak[1] : peak[0];
            printf("  %4lld tokens (%5lld rows):", (long long)T, (long long)row0[NE]);
            if (amx) printf(" amx %8.3f ms %7.1f GFLOP/s (%4.1f%% of peak)", ta[nr / 2] * 1e3, ga, 100 * ga / pk);
            if (gv > 0) printf("   avx512 %8.3f ms %7.1f GFLOP/s", tv[nr / 2] * 1e3, gv);
            if (amx && gv > 0) printf("   amx/avx512 %.2f", ga / gv);
            printf("\n");
        }
        for (int l = 0; l < nl; l++)
            for (int e = 0; e < NE; e++) {
                for (int i = 0; i < 3; i++)
                    if (L[l][e].r4[i].type == K3_W_MXFP4_R4) {
                        free((void *)L[l][e].r4[i].data);
                        free((void *)L[l][e].r4[i].scale);
                    }
                k3_mat *ms[3] = {&L[l][e].g, &L[l][e].u, &L[l][e].d};
                for (int i = 0; i < 3; i++) {
                    free((void *)ms[i]->data);
                    free((void *)ms[i]->scale);
                    free((void *)ms[i]->row_scale);
                    free((void *)ms[i]->row_sum);
                }
            }
        free(L);
    }

    /* ---- BF16 trunk shapes ---- */
    if (amx && atoi(env("AB_TRUNK", "1"))) {
        static const int64_t sh[][2] = {{2048, 2048}, {5632, 2048}, {2048, 5632}, {3072, 768}, {4096, 512}};
        printf("\nBF16 trunk products (in place / tiles), GFLOP/s, median of %d\n", runs);
        for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++) {
            k3_mat w = make_mat("bf16", sh[i][0], sh[i][1]);
            k3_amx_mat a, t;
            k3_amx_view(&w, &a, NULL);
            void *buf = aligned_alloc(64, k3_amx_pack_bytes(&w));
            k3_amx_pack(&w, buf, &t);
            for (int64_t n = 64; n <= 512; n *= 8) {
                float *xs = malloc(sizeof(float) * (size_t)(n * sh[i][1])), *ys = malloc(sizeof(float) * (size_t)(n * sh[i][0]));
                for (int64_t j = 0; j < n * sh[i][1]; j++) xs[j] = frand();
                double tt[3][64];
                const int nr = emu ? 1 : runs < 64 ? runs : 64;
                for (int r = 0; r < nr; r++) {
                    double t0 = now_s();
                    k3_amx_matmul(pool, &a, xs, n, ys);
                    tt[0][r] = now_s() - t0;
                    t0 = now_s();
                    k3_amx_matmul(pool, &t, xs, n, ys);
                    tt[1][r] = now_s() - t0;
                    t0 = now_s();
                    if (avx) k3_matmul(pool, &w, xs, n, ys);
                    tt[2][r] = now_s() - t0;
                }
                const double fl = 2.0 * n * sh[i][0] * sh[i][1] / 1e9;
                for (int k = 0; k < 3; k++) qsort(tt[k], (size_t)nr, sizeof(double), cmpd);
                printf("  %5lld x %-5lld n %3lld: amx %7.1f / %7.1f (%4.1f%% of peak)   avx512 %7.1f\n", (long long)sh[i][0],
                       (long long)sh[i][1], (long long)n, fl / tt[0][nr / 2], fl / tt[1][nr / 2],
                       100 * fl / tt[1][nr / 2] / peak[0], avx ? fl / tt[2][nr / 2] : 0.0);
                free(xs);
                free(ys);
            }
            free(buf);
            free((void *)w.data);
        }
    }
    /* ---- the BF16 dot products as the model runs them ---- */
    if (amx && atoi(env("AB_BFDOT", "1"))) {
        char bn[128];
        snprintf(bn, sizeof bn, "%s", env("AB_BFN", "128,512,2048"));
        const int nr = emu ? 1 : runs;
        printf("\nBF16 dot products on the strips (the amx table's path), GFLOP/s, median of %d: trunk shapes "
               "(rows x cols), routed experts MXFP4 (%d of %d a token, %d -> 2 x %d -> %d)\n",
               nr, TOPK, NE, HID, INTER, HID);
        for (char *tk = strtok(bn, ","); tk; tk = strtok(NULL, ",")) bfdot(pool, atoll(tk), nr);
    }
    /* ---- the DSA indexer over a chunk ---- */
    const int64_t nk = atoll(env("AB_QLI", "4096"));
    if (nk > 0) {
        const int HI = 16, dI = 128;
        printf("\nDSA indexer scores (QLI), %d heads of %d, %lld key slots: GOP/s (2 per multiply-add)\n", HI, dI,
               (long long)nk);
        int8_t *k8 = malloc((size_t)(nk * dI)), *q8 = malloc((size_t)(512 * HI * dI));
        float *ks = malloc(sizeof(float) * (size_t)nk), *qs = malloc(sizeof(float) * 512 * HI);
        float *w = malloc(sizeof(float) * 512 * HI), *sc = malloc(sizeof(float) * (size_t)(512 * nk));
        int64_t *slots = malloc(sizeof(int64_t) * (size_t)nk);
        for (int64_t i = 0; i < nk * dI; i++) k8[i] = (int8_t)(rnd() % 255 - 127);
        for (int64_t i = 0; i < 512 * HI * dI; i++) q8[i] = (int8_t)(rnd() % 255 - 127);
        for (int64_t i = 0; i < nk; i++) {
            ks[i] = 1e-3f;
            slots[i] = i;
        }
        for (int i = 0; i < 512 * HI; i++) {
            qs[i] = 1e-3f;
            w[i] = frand();
        }
        for (int64_t T = 512; T >= 64; T /= 8) {
            double ta[64], tv[64];
            const int nr = emu ? 1 : runs < 64 ? runs : 64;
            for (int r = 0; r < nr; r++) {
                double t0 = now_s();
                if (amx) k3_amx_qli_scores(pool, q8, qs, w, T, HI, dI, k8, ks, slots, nk, sc, nk);
                ta[r] = now_s() - t0;
                t0 = now_s();
                if (avx)
                    for (int64_t t = 0; t < T; t++)
                        k3_qli_scores(q8 + t * HI * dI, qs + t * HI, w + t * HI, HI, dI, k8, ks, slots, (int)nk, sc + t * nk);
                tv[r] = now_s() - t0;
            }
            qsort(ta, (size_t)nr, sizeof ta[0], cmpd);
            qsort(tv, (size_t)nr, sizeof tv[0], cmpd);
            const double op = 2.0 * T * HI * dI * (double)nk / 1e9;
            printf("  %4lld tokens:", (long long)T);
            if (amx) printf(" amx %7.1f GOP/s (%4.1f%% of peak)", op / ta[nr / 2], 100 * op / ta[nr / 2] / peak[1]);
            if (avx) printf("   avx512 (k3_qli_scores per token) %7.1f GOP/s", op / tv[nr / 2]);
            printf("\n");
        }
        free(k8);
        free(q8);
        free(ks);
        free(qs);
        free(w);
        free(sc);
        free(slots);
    }
    k3_pool_free(pool);
    return 0;
}
