/*
 * processor.c -- the K3 image processor (KimiK3VisionProcessor, media_utils.py):
 *
 *   navit_resize_image  scale = min(1, sqrt(limit / (w//P * h//P)), side*P/w, side*P/h),
 *                       sizes truncated, then padded right/bottom to multiples of merge*P;
 *   image_to_np         PIL Image.resize(BICUBIC) in the image's own mode (RGBA
 *                       premultiplied, P and 1 NEAREST), then -- fill stage
 *                       "after_resize" -- the transparent background composited;
 *   np.pad              black;
 *   normalize           (u8 / 255.0 in double, to float32) - mean, * 1/std;
 *   navit_patchify      [Hp, Wp] patches, each channel-first [3, P, P].
 *
 * The resampler follows Pillow 13.0's libImaging/Resample.c operation for
 * operation (including 13.0's choice of pass order), so the uint8 output is
 * identical, not merely close.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/error.h"
#include "vision/vision.h"

/* ---- configuration --------------------------------------------------------- */

void k3_image_proc_defaults(k3_image_proc *p) {
    *p = (k3_image_proc){
        .patch_size = 14,
        .merge = 2,
        .in_patch_limit = 65536,
        .side_limit = 512,
        .mean = {0.5, 0.5, 0.5},
        .std = {0.5, 0.5, 0.5},
        .bg = K3_BG_CHESSBOARD,
        .square = 8,
        .square_top_left = true,
        .white = 255,
        .gray = 180,
        .after_resize = true,
    };
}

static k3_status get_int(json_t *o, const char *key, int64_t lo, int64_t hi, int64_t *v, const char *src,
                         k3_error *err) {
    json_t *j = json_object_get(o, key);
    if (!j || json_is_null(j)) return K3_OK;
    if (!json_is_integer(j) || json_integer_value(j) < lo || json_integer_value(j) > hi)
        return k3_err(err, K3_ERR_FORMAT, "%s: %s must be an integer in [%lld, %lld]", src, key, (long long)lo,
                      (long long)hi);
    *v = json_integer_value(j);
    return K3_OK;
}

static k3_status get_vec3(json_t *o, const char *key, double *v, bool positive, const char *src, k3_error *err) {
    json_t *j = json_object_get(o, key);
    if (!j || json_is_null(j)) return K3_OK;
    if (json_is_number(j)) { /* one value for all channels */
        for (int c = 0; c < 3; c++) v[c] = json_number_value(j);
    } else {
        if (!json_is_array(j) || json_array_size(j) != 3)
            return k3_err(err, K3_ERR_FORMAT, "%s: %s must be a list of 3 numbers", src, key);
        for (int c = 0; c < 3; c++) {
            json_t *e = json_array_get(j, (size_t)c);
            if (!json_is_number(e)) return k3_err(err, K3_ERR_FORMAT, "%s: %s must be a list of 3 numbers", src, key);
            v[c] = json_number_value(e);
        }
    }
    for (int c = 0; c < 3; c++)
        if (!isfinite(v[c]) || (positive && !(v[c] > 0)))
            return k3_err(err, K3_ERR_FORMAT, "%s: %s has a bad value", src, key);
    return K3_OK;
}

static k3_status parse_proc(k3_image_proc *p, json_t *c, const char *src, k3_error *err) {
    int64_t v;
    v = p->patch_size;
    K3_TRY(get_int(c, "patch_size", 1, 1024, &v, src, err));
    p->patch_size = (int32_t)v;
    v = p->merge;
    K3_TRY(get_int(c, "merge_kernel_size", 1, 16, &v, src, err));
    p->merge = (int32_t)v;
    K3_TRY(get_int(c, "in_patch_limit", 1, (int64_t)1 << 30, &p->in_patch_limit, src, err));
    v = p->side_limit;
    K3_TRY(get_int(c, "patch_limit_on_one_side", 1, 1 << 16, &v, src, err));
    p->side_limit = (int32_t)v;
    json_t *fixed = json_object_get(c, "fixed_output_tokens");
    if (fixed && !json_is_null(fixed))
        return k3_err(err, K3_ERR_UNSUPPORTED, "%s: fixed_output_tokens is not supported", src);
    K3_TRY(get_vec3(c, "image_mean", p->mean, false, src, err));
    K3_TRY(get_vec3(c, "image_std", p->std, true, src, err));
    json_t *stage = json_object_get(c, "transparent_bg_fill_stage");
    if (stage && !json_is_null(stage)) {
        const char *s = json_string_value(stage);
        if (!s || (strcmp(s, "after_resize") && strcmp(s, "before_resize")))
            return k3_err(err, K3_ERR_FORMAT, "%s: transparent_bg_fill_stage must be after_resize or before_resize",
                          src);
        p->after_resize = !strcmp(s, "after_resize");
    } else {
        p->after_resize = false; /* the processor's own default */
    }
    json_t *bg = json_object_get(c, "transparent_bg_config");
    if (!bg || json_is_null(bg)) {
        p->bg = K3_BG_NONE;
        return K3_OK;
    }
    if (!json_is_object(bg)) return k3_err(err, K3_ERR_FORMAT, "%s: transparent_bg_config is not an object", src);
    /* TransparentBgConfig's own defaults for what the object leaves out */
    p->bg = K3_BG_BLACK;
    p->square = 16;
    p->square_top_left = true;
    p->white = 255;
    p->gray = 200;
    json_t *pat = json_object_get(bg, "pattern");
    if (pat) {
        const char *s = json_string_value(pat);
        if (!s) return k3_err(err, K3_ERR_FORMAT, "%s: transparent_bg_config.pattern is not a string", src);
        if (!strcmp(s, "white")) p->bg = K3_BG_WHITE;
        else if (!strcmp(s, "black")) p->bg = K3_BG_BLACK;
        else if (!strcmp(s, "gray")) p->bg = K3_BG_GRAY;
        else if (!strcmp(s, "chessboard")) p->bg = K3_BG_CHESSBOARD;
        else return k3_err(err, K3_ERR_FORMAT, "%s: unknown transparent_bg_config.pattern '%s'", src, s);
    }
    v = p->square;
    K3_TRY(get_int(bg, "chessboard_square_size", 1, 1 << 16, &v, src, err));
    p->square = (int32_t)v;
    v = p->white;
    K3_TRY(get_int(bg, "chessboard_white_value", 0, 255, &v, src, err));
    p->white = (int32_t)v;
    v = p->gray;
    K3_TRY(get_int(bg, "chessboard_gray_value", 0, 255, &v, src, err));
    p->gray = (int32_t)v;
    json_t *tl = json_object_get(bg, "chessboard_square_on_top_left");
    if (tl) {
        if (!json_is_boolean(tl))
            return k3_err(err, K3_ERR_FORMAT, "%s: chessboard_square_on_top_left is not a boolean", src);
        p->square_top_left = json_is_true(tl);
    }
    return K3_OK;
}

k3_status k3_image_proc_load(k3_image_proc *p, const char *dir, k3_error *err) {
    k3_image_proc_defaults(p);
    char path[4096];
    snprintf(path, sizeof path, "%s/preprocessor_config.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return K3_OK; /* the published defaults */
    fclose(f);
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root) return k3_err(err, K3_ERR_FORMAT, "%s: line %d: %s", path, je.line, je.text);
    k3_status st = K3_OK;
    if (!json_is_object(root)) st = k3_err(err, K3_ERR_FORMAT, "%s: not a JSON object", path);
    else {
        json_t *c = json_object_get(root, "media_proc_cfg");
        if (c && !json_is_object(c)) st = k3_err(err, K3_ERR_FORMAT, "%s: media_proc_cfg is not an object", path);
        else st = parse_proc(p, c ? c : root, path, err);
    }
    json_decref(root);
    return st;
}

/* ---- the resize plan (navit_resize_image) ----------------------------------- */

k3_status k3_image_proc_plan(const k3_image_proc *p, int32_t w, int32_t h, k3_resize_plan *out, k3_error *err) {
    if (w < 1 || h < 1) return k3_err(err, K3_ERR_ARG, "image: bad size %dx%d", w, h);
    const int64_t P = p->patch_size, side = p->side_limit;
    /* Python floats: every quotient and the sqrt in double */
    const double fw = (double)(w / P > 1 ? w / P : 1), fh = (double)(h / P > 1 ? h / P : 1);
    const double s1 = sqrt((double)p->in_patch_limit / (fw * fh));
    const double s2 = (double)(side * P) / w, s3 = (double)(side * P) / h;
    double scale = 1.0;
    if (s1 < scale) scale = s1;
    if (s2 < scale) scale = s2;
    if (s3 < scale) scale = s3;
    int64_t nw = (int64_t)(w * scale), nh = (int64_t)(h * scale); /* int() truncates */
    if (nw < 1) nw = 1;
    if (nh < 1) nh = 1;
    if (nw > side * P) nw = side * P;
    if (nh > side * P) nh = side * P;
    const int64_t f = p->merge * P;
    const int64_t pw = (f - nw % f) % f, ph = (f - nh % f) % f;
    const int64_t th = (nh + ph) / f, tw = (nw + pw) / f;
    if (th * p->merge > side || tw * p->merge > side)
        return k3_err(err, K3_ERR_ARG, "image %dx%d: %lldx%lld tokens exceed patch_limit_on_one_side %lld", w, h,
                      (long long)tw, (long long)th, (long long)side);
    *out = (k3_resize_plan){
        .new_w = (int32_t)nw,
        .new_h = (int32_t)nh,
        .pad_w = (int32_t)pw,
        .pad_h = (int32_t)ph,
        .grid_h = (int32_t)(th * p->merge),
        .grid_w = (int32_t)(tw * p->merge),
        .n_tokens = (int32_t)(th * tw),
    };
    return K3_OK;
}

/* ---- PIL's resampling (libImaging/Resample.c, Geometry.c) ------------------ */

#define PIL_PRECISION_BITS (32 - 8 - 2)

static double bicubic_filter(double x) {
    /* Keys' cubic with a = -0.5, support 2 */
    const double a = -0.5;
    if (x < 0.0) x = -x;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

/* precompute_coeffs + normalize_coeffs_8bpc: for each output pixel, the first
 * input pixel, the tap count and ksize fixed-point weights. */
static int pil_coeffs(int32_t in_size, int32_t out_size, int32_t **bounds_out, int32_t **kk_out) {
    const double in0 = 0.0, in1 = (double)in_size; /* the box (0, size) as floats */
    double scale = (in1 - in0) / out_size, filterscale = scale;
    if (filterscale < 1.0) filterscale = 1.0;
    const double support = 2.0 * filterscale;
    const int ksize = (int)ceil(support) * 2 + 1;
    double *pre = malloc(sizeof(double) * (size_t)out_size * ksize);
    int32_t *kk = malloc(sizeof(int32_t) * (size_t)out_size * ksize);
    int32_t *bounds = malloc(sizeof(int32_t) * 2 * (size_t)out_size);
    if (!pre || !kk || !bounds) {
        free(pre), free(kk), free(bounds);
        return 0;
    }
    for (int32_t xx = 0; xx < out_size; xx++) {
        const double center = in0 + (xx + 0.5) * scale, ss = 1.0 / filterscale;
        double ww = 0.0;
        int xmin = (int)(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        int xmax = (int)(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        double *k = pre + (size_t)xx * ksize;
        int x;
        for (x = 0; x < xmax; x++) {
            const double w = bicubic_filter((x + xmin - center + 0.5) * ss);
            k[x] = w;
            ww += w;
        }
        for (x = 0; x < xmax; x++)
            if (ww != 0.0) k[x] /= ww;
        for (; x < ksize; x++) k[x] = 0;
        bounds[2 * xx] = xmin;
        bounds[2 * xx + 1] = xmax;
    }
    for (size_t i = 0; i < (size_t)out_size * ksize; i++)
        kk[i] = pre[i] < 0 ? (int32_t)(-0.5 + pre[i] * (1 << PIL_PRECISION_BITS))
                           : (int32_t)(0.5 + pre[i] * (1 << PIL_PRECISION_BITS));
    free(pre);
    *bounds_out = bounds;
    *kk_out = kk;
    return ksize;
}

static inline uint8_t pil_clip8(int32_t v) {
    v >>= PIL_PRECISION_BITS; /* arithmetic shift, as the lookup table's index */
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* One horizontal pass: rows [y0, y0 + n) of in [*, w] -> out [n, ow]. */
static void pass_h(const uint8_t *in, int32_t w, int32_t y0, int32_t n, int nch, const int32_t *b, const int32_t *kk,
                   int ks, uint8_t *out, int32_t ow) {
    for (int32_t y = 0; y < n; y++) {
        const uint8_t *row = in + (size_t)(y + y0) * w * nch;
        uint8_t *o = out + (size_t)y * ow * nch;
        for (int32_t xx = 0; xx < ow; xx++) {
            const int32_t xmin = b[2 * xx], xmax = b[2 * xx + 1];
            const int32_t *k = kk + (size_t)xx * ks;
            for (int c = 0; c < nch; c++) {
                int32_t ss = 1 << (PIL_PRECISION_BITS - 1);
                for (int32_t x = 0; x < xmax; x++) ss += row[(size_t)(x + xmin) * nch + c] * k[x];
                o[(size_t)xx * nch + c] = pil_clip8(ss);
            }
        }
    }
}

/* One vertical pass: in [*, w] (bounds relative to its first row) -> out [oh, w]. */
static void pass_v(const uint8_t *in, int32_t w, int nch, const int32_t *b, const int32_t *kk, int ks, uint8_t *out,
                   int32_t oh) {
    for (int32_t yy = 0; yy < oh; yy++) {
        const int32_t ymin = b[2 * yy], ymax = b[2 * yy + 1];
        const int32_t *k = kk + (size_t)yy * ks;
        uint8_t *o = out + (size_t)yy * w * nch;
        for (int32_t x = 0; x < w; x++)
            for (int c = 0; c < nch; c++) {
                int32_t ss = 1 << (PIL_PRECISION_BITS - 1);
                for (int32_t y = 0; y < ymax; y++) ss += in[((size_t)(y + ymin) * w + x) * nch + c] * k[y];
                o[(size_t)x * nch + c] = pil_clip8(ss);
            }
    }
}

bool k3_pil_resize_bicubic(const uint8_t *in, int32_t w, int32_t h, int nch, uint8_t *out, int32_t ow, int32_t oh) {
    if (ow == w && oh == h) { /* Image.resize returns a copy */
        memcpy(out, in, (size_t)w * h * nch);
        return true;
    }
    const bool need_h = ow != w, need_v = oh != h;
    /* Pillow 13 (ImagingResampleInner): when the height shrinks by more than
     * twice as many pixels as the width, the vertical pass runs first */
    const bool h_first = !(h - oh > 0 && h - oh > (w - ow) * 2);
    int32_t *bh = NULL, *kh = NULL, *bv = NULL, *kv = NULL;
    int ksh = 0, ksv = 0;
    bool ok = false;
    uint8_t *tmp = NULL;
    if (need_h && !(ksh = pil_coeffs(w, ow, &bh, &kh))) goto done;
    if (!(ksv = pil_coeffs(h, oh, &bv, &kv))) goto done;
    if (h_first) {
        /* the horizontal pass covers only the input rows the vertical one reads */
        const int32_t y_first = bv[0], y_last = bv[2 * (oh - 1)] + bv[2 * (oh - 1) + 1];
        if (!need_h) {
            pass_v(in, w, nch, bv, kv, ksv, out, oh);
        } else if (!need_v) {
            pass_h(in, w, 0, h, nch, bh, kh, ksh, out, ow);
        } else {
            const int32_t th = y_last - y_first;
            if (!(tmp = malloc((size_t)ow * th * nch))) goto done;
            pass_h(in, w, y_first, th, nch, bh, kh, ksh, tmp, ow);
            for (int32_t i = 0; i < oh; i++) bv[2 * i] -= y_first;
            pass_v(tmp, ow, nch, bv, kv, ksv, out, oh);
        }
    } else if (!need_h) {
        pass_v(in, w, nch, bv, kv, ksv, out, oh);
    } else {
        if (!(tmp = malloc((size_t)w * oh * nch))) goto done;
        pass_v(in, w, nch, bv, kv, ksv, tmp, oh);
        pass_h(tmp, w, 0, oh, nch, bh, kh, ksh, out, ow);
    }
    ok = true;
done:
    free(tmp);
    free(bh), free(kh), free(bv), free(kv);
    return ok;
}

void k3_pil_resize_nearest(const uint8_t *in, int32_t w, int32_t h, int nch, uint8_t *out, int32_t ow, int32_t oh) {
    /* ImagingScaleAffine: source = (int)(offset + a/2 + x a), accumulated in double */
    const double ax = (double)w / ow, ay = (double)h / oh;
    int32_t *xin = malloc(sizeof(int32_t) * (size_t)ow);
    if (!xin) { /* tiny buffer; fall back to the direct formula */
        for (int32_t y = 0; y < oh; y++)
            for (int32_t x = 0; x < ow; x++)
                memcpy(out + ((size_t)y * ow + x) * nch,
                       in + ((size_t)(int32_t)(ay * 0.5 + y * ay) * w + (int32_t)(ax * 0.5 + x * ax)) * nch,
                       (size_t)nch);
        return;
    }
    double xo = ax * 0.5;
    for (int32_t x = 0; x < ow; x++) {
        int32_t v = xo < 0.0 ? -1 : (int32_t)xo;
        xin[x] = v < 0 ? 0 : v >= w ? w - 1 : v;
        xo += ax;
    }
    double yo = ay * 0.5;
    for (int32_t y = 0; y < oh; y++) {
        int32_t yi = yo < 0.0 ? -1 : (int32_t)yo;
        if (yi < 0) yi = 0;
        if (yi >= h) yi = h - 1;
        const uint8_t *row = in + (size_t)yi * w * nch;
        uint8_t *o = out + (size_t)y * ow * nch;
        for (int32_t x = 0; x < ow; x++) memcpy(o + (size_t)x * nch, row + (size_t)xin[x] * nch, (size_t)nch);
        yo += ay;
    }
    free(xin);
}

/* ---- alpha ------------------------------------------------------------------ */

/* Convert.c rgbA2rgba / rgba2rgbA: Image.resize of RGBA and LA goes through
 * premultiplied alpha. */
static void premultiply(uint8_t *px, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint8_t *p = px + 4 * i;
        const unsigned a = p[3];
        for (int c = 0; c < 3; c++) {
            const unsigned t = p[c] * a + 128;
            p[c] = (uint8_t)(((t >> 8) + t) >> 8);
        }
    }
}

static void unpremultiply(uint8_t *px, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint8_t *p = px + 4 * i;
        const unsigned a = p[3];
        if (a == 255 || a == 0) continue;
        for (int c = 0; c < 3; c++) {
            const unsigned v = (255 * p[c]) / a;
            p[c] = (uint8_t)(v > 255 ? 255 : v);
        }
    }
}

bool k3_pil_resize_rgba(const uint8_t *in, int32_t w, int32_t h, bool premultiplied, uint8_t *out, int32_t ow,
                        int32_t oh) {
    if (!premultiplied || (ow == w && oh == h)) return k3_pil_resize_bicubic(in, w, h, 4, out, ow, oh);
    uint8_t *tmp = malloc((size_t)w * h * 4);
    if (!tmp) return false;
    memcpy(tmp, in, (size_t)w * h * 4);
    premultiply(tmp, (size_t)w * h);
    const bool ok = k3_pil_resize_bicubic(tmp, w, h, 4, out, ow, oh);
    free(tmp);
    if (ok) unpremultiply(out, (size_t)ow * oh);
    return ok;
}

static uint8_t bg_value(const k3_image_proc *p, int32_t x, int32_t y) {
    switch (p->bg) {
    case K3_BG_WHITE: return 255;
    case K3_BG_GRAY: return 128;
    case K3_BG_CHESSBOARD:
        return ((y / p->square + x / p->square) % 2 == (p->square_top_left ? 1 : 0)) ? (uint8_t)p->gray
                                                                                     : (uint8_t)p->white;
    default: return 0;
    }
}

/* fill_transparent_bg_with on an RGBA buffer whose alpha is meaningful:
 * alpha * rgb + (1 - alpha) * bg in float32, truncated to uint8. */
static void composite(const k3_image_proc *p, const uint8_t *rgba, int32_t w, int32_t h, uint8_t *rgb) {
    for (int32_t y = 0; y < h; y++)
        for (int32_t x = 0; x < w; x++) {
            const uint8_t *s = rgba + ((size_t)y * w + x) * 4;
            uint8_t *o = rgb + ((size_t)y * w + x) * 3;
            const float a = (float)s[3] / 255.0f, ia = 1.0f - a;
            const float bg = (float)bg_value(p, x, y);
            for (int c = 0; c < 3; c++) {
                const float fg = a * (float)s[c], back = ia * bg;
                const float r = fg + back;
                o[c] = (uint8_t)r;
            }
        }
}

/* What fill_transparent_bg_with makes of an image in mode `mode` (rgba
 * holds it as RGBA; for GREY_KEY the key applies now). */
static void fill_bg(const k3_image_proc *p, const k3_image *im, uint8_t *rgba, int32_t w, int32_t h, uint8_t *rgb) {
    const size_t n = (size_t)w * h;
    bool alpha = false;
    if (p->bg != K3_BG_NONE) {
        if (im->mode == K3_IMODE_RGBA) alpha = true;
        if (im->mode == K3_IMODE_PALETTE) alpha = im->has_alpha;
        if (im->mode == K3_IMODE_GREY_KEY) {
            alpha = true;
            for (size_t i = 0; i < n; i++) rgba[4 * i + 3] = rgba[4 * i] == im->key ? 0 : 255;
        }
    }
    if (alpha) {
        composite(p, rgba, w, h, rgb);
        return;
    }
    for (size_t i = 0; i < n; i++) memcpy(rgb + 3 * i, rgba + 4 * i, 3); /* convert("RGB") */
}

/* ---- the processed image ------------------------------------------------------ */

k3_status k3_image_proc_rgb(const k3_image_proc *p, const k3_image *im, const k3_resize_plan *plan, uint8_t **out,
                            k3_error *err) {
    const int32_t w = im->width, h = im->height, nw = plan->new_w, nh = plan->new_h;
    const int32_t W = nw + plan->pad_w, H = nh + plan->pad_h;
    uint8_t *rgba = malloc((size_t)w * h * 4), *res = malloc((size_t)nw * nh * 4);
    uint8_t *rgb = malloc((size_t)nw * nh * 3), *pad = calloc((size_t)W * H * 3, 1);
    k3_status st = K3_OK;
    if (!rgba || !res || !rgb || !pad) {
        st = k3_err(err, K3_ERR_NOMEM, "image %dx%d: out of memory", w, h);
        goto done;
    }
    memcpy(rgba, im->px, (size_t)w * h * 4);
    k3_image flat = *im; /* the mode after a before_resize fill: RGB */
    if (!p->after_resize) {
        /* fill first (at the original size), then resize RGB */
        uint8_t *filled = malloc((size_t)w * h * 3);
        if (!filled) {
            st = k3_err(err, K3_ERR_NOMEM, "image %dx%d: out of memory", w, h);
            goto done;
        }
        fill_bg(p, im, rgba, w, h, filled);
        for (size_t i = 0; i < (size_t)w * h; i++) {
            memcpy(rgba + 4 * i, filled + 3 * i, 3);
            rgba[4 * i + 3] = 255;
        }
        free(filled);
        flat.mode = K3_IMODE_RGB;
    }
    const bool nearest = flat.mode == K3_IMODE_PALETTE && (nw != w || nh != h);
    if (nearest) {
        k3_pil_resize_nearest(rgba, w, h, 4, res, nw, nh);
    } else if (!k3_pil_resize_rgba(rgba, w, h, flat.mode == K3_IMODE_RGBA, res, nw, nh)) {
        /* RGB and L (and the grey-key L) resample every channel as it is; RGBA premultiplied */
        st = k3_err(err, K3_ERR_NOMEM, "resize: out of memory");
    }
    if (st) goto done;
    if (p->after_resize) fill_bg(p, &flat, res, nw, nh, rgb);
    else
        for (size_t i = 0; i < (size_t)nw * nh; i++) memcpy(rgb + 3 * i, res + 4 * i, 3);
    for (int32_t y = 0; y < nh; y++) memcpy(pad + (size_t)y * W * 3, rgb + (size_t)y * nw * 3, (size_t)nw * 3);
done:
    free(rgba), free(res), free(rgb);
    if (st) {
        free(pad);
        return st;
    }
    *out = pad;
    return K3_OK;
}

void k3_image_proc_patchify(const k3_image_proc *p, const uint8_t *rgb, const k3_resize_plan *plan, float *out) {
    const int32_t P = p->patch_size, W = plan->grid_w * P;
    double mean[3], inv[3];
    for (int c = 0; c < 3; c++) {
        mean[c] = p->mean[c];
        inv[c] = 1.0 / p->std[c];
    }
    float *o = out;
    for (int32_t py = 0; py < plan->grid_h; py++)
        for (int32_t px = 0; px < plan->grid_w; px++)
            for (int c = 0; c < 3; c++)
                for (int32_t ky = 0; ky < P; ky++)
                    for (int32_t kx = 0; kx < P; kx++) {
                        const uint8_t u = rgb[((size_t)(py * P + ky) * W + px * P + kx) * 3 + c];
                        /* numpy: float32(u / 255.0); then -= mean and *= 1/std, each in
                         * double and stored back to float32 */
                        float x = (float)(u / 255.0);
                        x = (float)((double)x - mean[c]);
                        x = (float)((double)x * inv[c]);
                        *o++ = x;
                    }
}
