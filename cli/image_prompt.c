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

void k3_cli_images_free(k3_cli_images *im) {
    for (int i = 0; i < im->n; i++) free(im->rows[i]);
    free(im->rows);
    free(im->embeds);
    k3_vision_close(im->v);
    memset(im, 0, sizeof *im);
}

k3_status k3_cli_chat_content_at(const k3_tokenizer *tok, const char *system, bool think, const int32_t *ids,
                                 size_t n_ids, size_t *at, k3_error *err) {
    /* the same turns with empty user content: its ids and the real ones part
     * where the content begins (right after <|sep|>, a special no text merges with) */
    k3_chat_msg msgs[2] = {{"system", system, NULL}, {"user", "", NULL}};
    int32_t *e = NULL;
    size_t ne = 0;
    k3_status s = k3_chat_encode(tok, system ? msgs : msgs + 1, system ? 2 : 1, true, think, &e, &ne, err);
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
    k3_image_plan *plans = calloc((size_t)n_files, sizeof *plans);
    size_t *ats = calloc((size_t)n_files, sizeof *ats);
    if (!im->rows || !plans || !ats) {
        free(plans), free(ats);
        if (err) {
            err->status = K3_ERR_NOMEM;
            snprintf(err->msg, sizeof err->msg, "out of memory for the images");
        }
        return K3_ERR_NOMEM;
    }
    for (int i = 0; i < n_files && !s; i++) {
        k3_image *img = NULL;
        const double t0 = k3_now();
        if ((s = k3_image_load(&img, files[i], 0, err))) break;
        s = k3_vision_plan(im->v, k3_image_width(img), k3_image_height(img), &plans[i], err);
        if (!s) s = k3_vision_encode(im->v, pool, img, &im->rows[i], NULL, err);
        k3_image_free(img);
        if (s) break;
        im->n = i + 1;
        ats[i] = at;
        fprintf(stderr, "image %s: %dx%d -> %dx%d, %dx%d patches, %d tokens, encoded in %.1f ms\n", files[i],
                plans[i].width, plans[i].height, plans[i].resized_w, plans[i].resized_h, plans[i].grid_h,
                plans[i].grid_w, plans[i].n_tokens, (k3_now() - t0) * 1e3);
    }
    int32_t *out = NULL;
    size_t n_out = 0;
    if (!s)
        s = k3_vision_splice(im->v, tok, *ids, *n_ids, ats, plans, (const float *const *)im->rows, NULL, n_files, &out,
                             &n_out, &im->embeds, NULL, err);
    if (!s) {
        free(*ids);
        *ids = out;
        *n_ids = n_out;
    }
    free(plans), free(ats);
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
