/*
 * bench_vision.c -- `k3 bench`'s image-encode figure: ms per image (the
 * processor, then the tower + merger + projector) at a few sizes, and the
 * prompt tokens each takes, on the checkpoint's own vision tower with the
 * --quant mode applied to its matrices. The images are synthetic (a gradient
 * with noise): the cost depends on the size, not the content. A checkpoint
 * without a tower gets one line saying so.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static k3_image *synthetic(int32_t w, int32_t h, k3_error *err) {
    uint8_t *px = malloc((size_t)w * h * 4);
    if (!px) return NULL;
    uint32_t r = 12345;
    for (int32_t y = 0; y < h; y++)
        for (int32_t x = 0; x < w; x++) {
            uint8_t *p = px + ((size_t)y * w + x) * 4;
            r = r * 1103515245u + 12345u;
            p[0] = (uint8_t)(x * 255 / w + (r >> 28));
            p[1] = (uint8_t)(y * 255 / h + (r >> 24 & 15));
            p[2] = (uint8_t)((x + y) * 3);
            p[3] = 255;
        }
    k3_image *im = NULL;
    k3_image_from_rgba(&im, px, w, h, false, err);
    free(px);
    return im;
}

int k3_cli_bench_vision(const k3_model *m, k3_pool *pool, const char *quant, int runs, bool json,
                        k3_cli_vision_bench *out) {
    memset(out, 0, sizeof *out);
    k3_vision *v = NULL;
    k3_error err = {0};
    k3_status s = k3_vision_open(&v, m, &err);
    if (s == K3_ERR_UNSUPPORTED) {
        if (!json) printf("image encode: %s\n", err.msg);
        return 0;
    }
    k3_quant_options q = {0};
    if (!s && quant) s = k3_quant_parse(quant, &q, &err);
    if (!s) s = k3_vision_quantize(v, &q, &err);
    static const int32_t sizes[][2] = {{224, 224}, {448, 448}, {672, 504}};
    for (int i = 0; !s && i < 3; i++) {
        k3_cli_vision_run *r = &out->runs[out->n];
        k3_image *im = synthetic(sizes[i][0], sizes[i][1], &err);
        if (!im) {
            s = err.status ? err.status : K3_ERR_NOMEM;
            break;
        }
        k3_image_plan plan;
        double tp[64], tt[64];
        if (!(s = k3_vision_plan(v, sizes[i][0], sizes[i][1], &plan, &err))) {
            fprintf(stderr, "  image encode %dx%d (%d tokens)...\n", sizes[i][0], sizes[i][1], plan.n_tokens);
            for (int k = 0; k < runs && !s; k++) {
                float *px = NULL, *rows = NULL;
                const double t0 = k3_now();
                s = k3_vision_preprocess(v, im, &px, &plan, &err);
                const double t1 = k3_now();
                if (!s) s = k3_vision_encode_pixels(v, pool, px, &plan, &rows, &err);
                tp[k] = (t1 - t0) * 1e3;
                tt[k] = (k3_now() - t1) * 1e3;
                free(px), free(rows);
            }
        }
        k3_image_free(im);
        if (s) break;
        qsort(tp, (size_t)runs, sizeof tp[0], cmp_d);
        qsort(tt, (size_t)runs, sizeof tt[0], cmp_d);
        *r = (k3_cli_vision_run){sizes[i][0],  sizes[i][1], plan.n_tokens, plan.grid_h * plan.grid_w,      tp[runs / 2],
                                 tt[runs / 2], tt[0],       tt[runs - 1],  k3_vision_flops(v, &plan) / 1e9};
        out->n++;
    }
    k3_vision_close(v);
    if (s) {
        fprintf(stderr, "k3 bench: image encode: %s\n", err.msg[0] ? err.msg : k3_status_str(s));
        return 1;
    }
    return 0;
}

void k3_cli_bench_vision_print(const k3_cli_vision_bench *b, bool json) {
    if (json) {
        printf(", \"image_encode\": [");
        for (int i = 0; i < b->n; i++) {
            const k3_cli_vision_run *r = &b->runs[i];
            printf("%s{\"width\": %d, \"height\": %d, \"tokens\": %d, \"patches\": %d, \"preprocess_ms\": %.2f, "
                   "\"tower_ms\": %.2f, \"tower_ms_min\": %.2f, \"tower_ms_max\": %.2f, \"gflops\": %.2f}",
                   i ? ", " : "", r->w, r->h, r->tokens, r->patches, r->pre_ms, r->tower_ms, r->tower_min, r->tower_max,
                   r->gflop / (r->tower_ms / 1e3));
        }
        printf("]");
        return;
    }
    if (!b->n) return;
    printf("%-18s %8s %8s %12s %12s %10s %10s %9s\n", "image encode", "patches", "tokens", "preproc ms", "tower ms",
           "min", "max", "GFLOP/s");
    for (int i = 0; i < b->n; i++) {
        const k3_cli_vision_run *r = &b->runs[i];
        char sz[32];
        snprintf(sz, sizeof sz, "%dx%d", r->w, r->h);
        printf("%-18s %8d %8d %12.2f %12.1f %10.1f %10.1f %9.1f\n", sz, r->patches, r->tokens, r->pre_ms, r->tower_ms,
               r->tower_min, r->tower_max, r->gflop / (r->tower_ms / 1e3));
    }
}
