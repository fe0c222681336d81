/*
 * vision.c -- the public vision calls (k3.h): an image's plan, pixels,
 * prompt rows and prompt tokens.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "vision/vision.h"

int64_t k3_vision_out_dim(const k3_vision *v) { return v ? v->cfg.text_hidden : 0; }

double k3_vision_flops(const k3_vision *v, const k3_image_plan *plan) {
    const k3_vision_config *c = &v->cfg;
    const double L = (double)plan->grid_t * plan->grid_h * plan->grid_w, N = (double)plan->grid_h * plan->grid_w / 4;
    const double D = (double)c->hidden, M4 = 4.0 * (double)c->mm_hidden;
    const double per_patch =
        3.0 * c->patch_size * c->patch_size * D + c->n_layers * (D * 3 * c->qkv + c->qkv * D + 2 * D * c->mlp);
    const double per_token = M4 * M4 + M4 * (double)c->text_hidden;
    return 2.0 * (L * per_patch + N * per_token) + c->n_layers * 4.0 * L * L * (double)c->qkv;
}

k3_status k3_vision_plan(const k3_vision *v, int32_t width, int32_t height, k3_image_plan *out, k3_error *err) {
    if (!v || !out) return k3_err(err, K3_ERR_ARG, "vision: no tower");
    k3_resize_plan r;
    k3_status s = k3_image_proc_plan(&v->proc, width, height, &r, err);
    if (s) return s;
    *out = (k3_image_plan){.width = width,
                           .height = height,
                           .resized_w = r.new_w,
                           .resized_h = r.new_h,
                           .grid_t = 1,
                           .grid_h = r.grid_h,
                           .grid_w = r.grid_w,
                           .n_tokens = r.n_tokens};
    return K3_OK;
}

k3_status k3_vision_preprocess(const k3_vision *v, const k3_image *im, float **pixels, k3_image_plan *plan,
                               k3_error *err) {
    if (!v || !im || !pixels) return k3_err(err, K3_ERR_ARG, "vision: no image");
    *pixels = NULL;
    k3_resize_plan r;
    k3_status s = k3_image_proc_plan(&v->proc, im->width, im->height, &r, err);
    if (s) return s;
    uint8_t *rgb = NULL;
    if ((s = k3_image_proc_rgb(&v->proc, im, &r, &rgb, err))) return s;
    const int64_t P = v->proc.patch_size;
    float *px = malloc(sizeof(float) * (size_t)((int64_t)r.grid_h * r.grid_w * 3 * P * P));
    if (!px) {
        free(rgb);
        return k3_err(err, K3_ERR_NOMEM, "vision: out of memory");
    }
    k3_image_proc_patchify(&v->proc, rgb, &r, px);
    free(rgb);
    if (plan)
        *plan = (k3_image_plan){.width = im->width,
                                .height = im->height,
                                .resized_w = r.new_w,
                                .resized_h = r.new_h,
                                .grid_t = 1,
                                .grid_h = r.grid_h,
                                .grid_w = r.grid_w,
                                .n_tokens = r.n_tokens};
    *pixels = px;
    return K3_OK;
}

k3_status k3_vision_encode_pixels(const k3_vision *v, k3_pool *pool, const float *pixels, const k3_image_plan *plan,
                                  float **rows, k3_error *err) {
    if (!v || !pixels || !plan || !rows) return k3_err(err, K3_ERR_ARG, "vision: nothing to encode");
    *rows = NULL;
    const int64_t n = (int64_t)plan->grid_h * plan->grid_w / 4;
    float *out = malloc(sizeof(float) * (size_t)(n * v->cfg.text_hidden));
    if (!out) return k3_err(err, K3_ERR_NOMEM, "vision: out of memory");
    k3_status s = k3_vision_forward(v, pool, pixels, plan->grid_t, plan->grid_h, plan->grid_w, out, err);
    if (s) {
        free(out);
        return s;
    }
    *rows = out;
    return K3_OK;
}

k3_status k3_vision_encode(const k3_vision *v, k3_pool *pool, const k3_image *im, float **rows, int32_t *n_rows,
                           k3_error *err) {
    float *px = NULL;
    k3_image_plan plan;
    if (rows) *rows = NULL;
    k3_status s = k3_vision_preprocess(v, im, &px, &plan, err);
    if (!s) s = k3_vision_encode_pixels(v, pool, px, &plan, rows, err);
    free(px);
    if (!s && n_rows) *n_rows = plan.n_tokens;
    return s;
}

k3_status k3_vision_image_prompt(const k3_vision *v, const k3_tokenizer *t, const k3_image_plan *plan, int32_t **ids,
                                 size_t *n_ids, size_t *pad_at, k3_error *err) {
    if (!v || !t || !plan || !ids || !n_ids) return k3_err(err, K3_ERR_ARG, "vision: bad prompt arguments");
    *ids = NULL;
    const int32_t begin = k3_tokenizer_special(t, "<|media_begin|>"),
                  content = k3_tokenizer_special(t, "<|media_content|>");
    const int32_t end = k3_tokenizer_special(t, "<|media_end|>"), pad = k3_tokenizer_special(t, "<|media_pad|>");
    if (begin < 0 || content < 0 || end < 0)
        return k3_err(err, K3_ERR_UNSUPPORTED,
                      "the tokenizer has no <|media_begin|>, <|media_content|> and <|media_end|> "
                      "specials: images cannot be framed");
    if (pad >= 0 && pad != v->cfg.media_pad_id)
        return k3_err(err, K3_ERR_FORMAT, "the tokenizer's <|media_pad|> is %d but media_placeholder_token_id is %d",
                      pad, v->cfg.media_pad_id);
    char text[64];
    snprintf(text, sizeof text, "image %dx%d", plan->width, plan->height);
    int32_t *tx = NULL;
    size_t ntx = 0;
    k3_status s = k3_tokenizer_encode(t, text, strlen(text), &tx, &ntx, err);
    if (s) return s;
    const size_t n = 1 + ntx + 1 + (size_t)plan->n_tokens + 1;
    int32_t *o = malloc(sizeof(int32_t) * n);
    if (!o) {
        free(tx);
        return k3_err(err, K3_ERR_NOMEM, "vision: out of memory");
    }
    size_t k = 0;
    o[k++] = begin;
    memcpy(o + k, tx, sizeof(int32_t) * ntx);
    k += ntx;
    o[k++] = content;
    if (pad_at) *pad_at = k;
    for (int32_t i = 0; i < plan->n_tokens; i++) o[k++] = v->cfg.media_pad_id;
    o[k++] = end;
    free(tx);
    *ids = o;
    *n_ids = k;
    return K3_OK;
}

k3_status k3_vision_splice(const k3_vision *v, const k3_tokenizer *t, const int32_t *ids, size_t n_ids,
                           const size_t *at, const k3_image_plan *plans, const float *const *rows,
                           const uint64_t *image_keys, int32_t n_images, int32_t **out, size_t *n_out,
                           const float ***embeds, uint64_t **keys, k3_error *err) {
    if (!v || !t || !out || !n_out || !embeds || (n_ids && !ids) || n_images < 0 ||
        (n_images && (!at || !plans || !rows)))
        return k3_err(err, K3_ERR_ARG, "vision: bad splice arguments");
    *out = NULL;
    *embeds = NULL;
    if (keys) *keys = NULL;
    for (int32_t i = 0; i < n_images; i++)
        if (at[i] > n_ids || (i && at[i] < at[i - 1]) || !rows[i])
            return k3_err(err, K3_ERR_ARG,
                          "vision: image %d's insertion point %zu is out of order or past the "
                          "prompt's %zu ids",
                          i, at[i], n_ids);
    int32_t **fr = calloc((size_t)n_images + 1, sizeof *fr);
    size_t *nfr = calloc((size_t)n_images + 1, sizeof *nfr), *pad = calloc((size_t)n_images + 1, sizeof *pad);
    k3_status s = K3_OK;
    size_t total = n_ids;
    if (!fr || !nfr || !pad) s = k3_err(err, K3_ERR_NOMEM, "vision: out of memory");
    for (int32_t i = 0; !s && i < n_images; i++) {
        s = k3_vision_image_prompt(v, t, &plans[i], &fr[i], &nfr[i], &pad[i], err);
        total += nfr[i];
    }
    int32_t *o = NULL;
    const float **e = NULL;
    uint64_t *ky = NULL;
    if (!s) {
        o = malloc(sizeof(int32_t) * (total ? total : 1));
        e = calloc(total ? total : 1, sizeof *e);
        if (keys) ky = calloc(total ? total : 1, sizeof *ky);
        if (!o || !e || (keys && !ky)) s = k3_err(err, K3_ERR_NOMEM, "vision: out of memory");
    }
    if (!s) {
        const int64_t D = v->cfg.text_hidden;
        size_t k = 0, src = 0;
        for (int32_t i = 0; i < n_images; i++) {
            memcpy(o + k, ids + src, sizeof(int32_t) * (at[i] - src));
            k += at[i] - src;
            src = at[i];
            memcpy(o + k, fr[i], sizeof(int32_t) * nfr[i]);
            if (ky)
                for (size_t q = 0; q < nfr[i]; q++) ky[k + q] = image_keys ? image_keys[i] : 0;
            for (int32_t r = 0; r < plans[i].n_tokens; r++) e[k + pad[i] + (size_t)r] = rows[i] + (int64_t)r * D;
            k += nfr[i];
        }
        memcpy(o + k, ids + src, sizeof(int32_t) * (n_ids - src));
        *out = o;
        *embeds = e;
        if (keys) *keys = ky;
        *n_out = total;
    } else {
        free(o);
        free(e);
        free(ky);
    }
    for (int32_t i = 0; fr && i < n_images; i++) free(fr[i]);
    free(fr), free(nfr), free(pad);
    return s;
}

size_t k3_vision_describe(const k3_vision *v, char *buf, size_t size) {
    const k3_vision_config *c = &v->cfg;
    const k3_image_proc *p = &v->proc;
    return (size_t)snprintf(
        buf, size,
        "vision: MoonViT3d, %d blocks, hidden %lld, %d heads x %lld (qkv %lld), MLP %lld (gelu-tanh), RMSNorm eps "
        "%.3g\n"
        "vision: patch %d, position table %dx%d (%s), time %d; sd2_tpool 2x2 -> patchmergerv2 %lld -> %lld (eps %g)\n"
        "vision: %lld parameters (%.2fM), %lld bytes as stored, matrices %s\n"
        "vision: processor: %lld patches max, %d a side, bicubic, background %s%s, mean %.3g std %.3g, "
        "media pad id %d\n",
        c->n_layers, (long long)c->hidden, c->n_heads, (long long)(c->qkv / c->n_heads), (long long)c->qkv,
        (long long)c->mlp, (double)c->enc_eps, c->patch_size, c->pos_h, c->pos_w,
        c->interp == K3_INTERP_BICUBIC ? "bicubic" : "bilinear", c->pos_t, (long long)(4 * c->mm_hidden),
        (long long)c->text_hidden, (double)c->proj_eps, (long long)v->n_params, v->n_params / 1e6,
        (long long)v->weight_bytes, v->quant, (long long)p->in_patch_limit, p->side_limit,
        p->bg == K3_BG_CHESSBOARD ? "chessboard"
            : p->bg == K3_BG_NONE ? "none"
                                  : "flat",
        p->after_resize ? " after resize" : " before resize", p->mean[0], p->std[0], c->media_pad_id);
}
