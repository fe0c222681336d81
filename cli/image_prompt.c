/*
 * image_prompt.c -- `k3 run --image FILE`: images put into a prompt.
 *
 * Each image is decoded, preprocessed and run through the checkpoint's
 * vision tower; its K3 framing (<|media_begin|>image {W}x{H}<|media_content|>
 * + N pads + <|media_end|>) is spliced into the prompt's ids at one point --
 * the start of a plain prompt, or the start of the user turn's content with
 * --chat (images before the text, as encoding_k3.py renders a content list
 * of image parts then a text part) -- and the pads' rows point at the
 * image's features (k3_batch_seq.embeds).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void k3_cli_images_free(k3_cli_images *im) {
    for (int i = 0; i < im->n; i++) free(im->rows[i]);
    free(im->rows);
    free(im->embeds);
    k3_vision_close(im->v);
    memset(im, 0, sizeof *im);
}

k3_status k3_cli_chat_content_at(const k3_tokenizer *tok, bool think, const int32_t *ids, size_t n_ids, size_t *at,
                                 k3_error *err) {
    /* the user turn with empty content: its ids and the real ones part where
     * the content begins (right after <|sep|>, a special no text merges with) */
    k3_chat_msg msg = {"user", "", NULL};
    int32_t *e = NULL;
    size_t ne = 0;
    k3_status s = k3_chat_encode(tok, &msg, 1, true, think, &e, &ne, err);
    if (s) return s;
    size_t p = 0;
    while (p < ne && p < n_ids && e[p] == ids[p]) p++;
    free(e);
    *at = p;
    return K3_OK;
}

k3_status k3_cli_images_insert(k3_cli_images *im, const k3_model *m, const k3_tokenizer *tok, k3_pool *pool,
                               const char *quant, const char *const *files, int n_files, size_t at, int32_t **ids,
                               size_t *n_ids, k3_error *err) {
    memset(im, 0, sizeof *im);
    k3_status s = k3_vision_open(&im->v, m, err);
    if (s) return s;
    k3_quant_options q = {0};
    if (quant && (s = k3_quant_parse(quant, &q, err))) return s;
    if ((s = k3_vision_quantize(im->v, &q, err))) return s;
    im->rows = calloc((size_t)n_files, sizeof *im->rows);
    if (!im->rows) return K3_ERR_NOMEM;
    const int64_t D = k3_vision_out_dim(im->v);
    int32_t *out = NULL;
    size_t n_out = 0;
    /* per image: its framing ids and where its pads start */
    int32_t **fr = calloc((size_t)n_files, sizeof *fr);
    size_t *nfr = calloc((size_t)n_files, sizeof *nfr), *pad = calloc((size_t)n_files, sizeof *pad);
    int32_t *nrows = calloc((size_t)n_files, sizeof *nrows);
    if (!fr || !nfr || !pad || !nrows) {
        s = K3_ERR_NOMEM;
        goto done;
    }
    size_t extra = 0;
    for (int i = 0; i < n_files; i++) {
        k3_image *img = NULL;
        k3_image_plan plan;
        const double t0 = now_s();
        if ((s = k3_image_load(&img, files[i], 0, err))) goto done;
        s = k3_vision_plan(im->v, k3_image_width(img), k3_image_height(img), &plan, err);
        if (!s) s = k3_vision_encode(im->v, pool, img, &im->rows[i], &nrows[i], err);
        k3_image_free(img);
        if (s) goto done;
        im->n = i + 1;
        if ((s = k3_vision_image_prompt(im->v, tok, &plan, &fr[i], &nfr[i], &pad[i], err))) goto done;
        extra += nfr[i];
        fprintf(stderr, "image %s: %dx%d -> %dx%d, %dx%d patches, %d tokens, encoded in %.1f ms\n", files[i],
                plan.width, plan.height, plan.resized_w, plan.resized_h, plan.grid_h, plan.grid_w, plan.n_tokens,
                (now_s() - t0) * 1e3);
    }
    n_out = *n_ids + extra;
    out = malloc(sizeof(int32_t) * n_out);
    im->embeds = calloc(n_out, sizeof *im->embeds);
    if (!out || !im->embeds) {
        s = K3_ERR_NOMEM;
        goto done;
    }
    size_t k = 0;
    memcpy(out, *ids, sizeof(int32_t) * at);
    k = at;
    for (int i = 0; i < n_files; i++) {
        memcpy(out + k, fr[i], sizeof(int32_t) * nfr[i]);
        for (int32_t r = 0; r < nrows[i]; r++) im->embeds[k + pad[i] + (size_t)r] = im->rows[i] + (int64_t)r * D;
        k += nfr[i];
    }
    memcpy(out + k, *ids + at, sizeof(int32_t) * (*n_ids - at));
    free(*ids);
    *ids = out;
    *n_ids = n_out;
    out = NULL;
done:
    if (s == K3_ERR_NOMEM && err && !err->msg[0]) snprintf(err->msg, sizeof err->msg, "out of memory for the images");
    free(out);
    for (int i = 0; fr && i < n_files; i++) free(fr[i]);
    free(fr), free(nfr), free(pad), free(nrows);
    return s;
}

int k3_cli_print_vision(const k3_model *m) {
    k3_vision *v = NULL;
    k3_error err = {0};
    k3_status s = k3_vision_open(&v, m, &err);
    if (s == K3_ERR_UNSUPPORTED && strstr(err.msg, "no vision tower")) {
        printf("vision: none (text only)\n");
        return 0;
    }
    if (s) {
        fprintf(stderr, "k3 info: %s\n", err.msg);
        return 1;
    }
    char buf[2048];
    k3_vision_describe(v, buf, sizeof buf);
    fputs(buf, stdout);
    k3_vision_close(v);
    return 0;
}
