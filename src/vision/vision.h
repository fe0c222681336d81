/*
 * vision.h -- the vision side of a K3 checkpoint (docs/vision.md):
 * decoded images (image.c), the K3 image processor (processor.c: patch-budget
 * resize with PIL's BICUBIC, the transparent-background chessboard, padding
 * to the merge grid, normalization, patchify) and the MoonViT3d tower with
 * the sd2_tpool merger and the patchmergerv2 projector (tower.c).
 *
 * The reference is Moonshot's own code (llmcompressor 0.14.0.1,
 * llmcompressor/modeling/kimi_k3/): media_utils.py and
 * kimi_k3_vision_processing.py for the processor, modeling_kimi_k3.py for the
 * tower. Where sources disagree (docs/vision.md §8) this follows modeling_kimi_k3.py.
 * This module reads the checkpoint's config.json (vision_config) and
 * preprocessor_config.json itself; src/model knows nothing of vision.
 */
#ifndef K3_VISION_VISION_H
#define K3_VISION_VISION_H

#include "k3.h"
#include "kernels/kernels.h"

/* ---- decoded images (image.c) ---- */

/* How PIL would hold the decoded image: what Image.resize and
 * fill_transparent_bg_with do depends on it. */
typedef enum k3_image_mode {
    K3_IMODE_RGB = 0,  /* "RGB" (also "L", expanded: every step is per channel) */
    K3_IMODE_RGBA,     /* "RGBA" or "LA": resized premultiplied, then composited */
    K3_IMODE_PALETTE,  /* "P" or "1": resized NEAREST; alpha from tRNS when has_alpha */
    K3_IMODE_GREY_KEY, /* "L" with a tRNS grey key: resized as L, the key made transparent after */
} k3_image_mode;

struct k3_image {
    int32_t width, height;
    k3_image_mode mode;
    bool has_alpha; /* PALETTE: the palette has tRNS entries */
    bool grey;      /* decoded from a grey source (informational) */
    uint8_t key;    /* GREY_KEY: the transparent grey value */
    uint8_t *px;    /* [height, width, 4] RGBA (alpha 255 where none) */
};

/* ---- processor (processor.c) ---- */

typedef enum k3_bg_pattern { K3_BG_NONE = 0, K3_BG_WHITE, K3_BG_BLACK, K3_BG_GRAY, K3_BG_CHESSBOARD } k3_bg_pattern;

typedef struct k3_image_proc {
    int32_t patch_size;     /* 14 */
    int32_t merge;          /* merge_kernel_size, 2 */
    int64_t in_patch_limit; /* 65536 in the release */
    int32_t side_limit;     /* patch_limit_on_one_side, 512 */
    double mean[3], std[3]; /* 0.5 (numpy float64, as the processor reads them) */
    k3_bg_pattern bg;       /* transparent_bg_config (NONE: plain convert("RGB")) */
    int32_t square;         /* chessboard_square_size */
    bool square_top_left;   /* chessboard_square_on_top_left */
    int32_t white, gray;    /* chessboard_white_value / chessboard_gray_value */
    bool after_resize;      /* transparent_bg_fill_stage == "after_resize" */
} k3_image_proc;

/* The published defaults (docs/vision.md §2.1). */
void k3_image_proc_defaults(k3_image_proc *p);
/* Reads DIR/preprocessor_config.json (its media_proc_cfg object, or the
 * fields at its root); a missing file leaves the defaults. */
k3_status k3_image_proc_load(k3_image_proc *p, const char *dir, k3_error *err);

/* navit_resize_image (media_utils.py). */
typedef struct k3_resize_plan {
    int32_t new_w, new_h, pad_w, pad_h;
    int32_t grid_h, grid_w; /* patches */
    int32_t n_tokens;       /* (grid_h / merge) * (grid_w / merge) */
} k3_resize_plan;

k3_status k3_image_proc_plan(const k3_image_proc *p, int32_t w, int32_t h, k3_resize_plan *out, k3_error *err);

/* The processed image as uint8 RGB [Hpad, Wpad, 3] (resized, composited,
 * padded with black): image_np of KimiK3VisionProcessor.resize_image. */
k3_status k3_image_proc_rgb(const k3_image_proc *p, const k3_image *im, const k3_resize_plan *plan, uint8_t **rgb,
                            k3_error *err);
/* Normalized patches [grid_h * grid_w, 3, P, P] from that. */
void k3_image_proc_patchify(const k3_image_proc *p, const uint8_t *rgb, const k3_resize_plan *plan, float *out);

/* PIL's Image.resize(size, BICUBIC) of an 8-bit image with nch interleaved
 * channels (every channel alike, as PIL's 8-bit path computes it: separable
 * convolution with the support scaled by the downscale factor, 22-bit fixed
 * point coefficients, horizontal pass first, clipped to 8 bits between the
 * passes). Returns false when out of memory. */
bool k3_pil_resize_bicubic(const uint8_t *in, int32_t w, int32_t h, int nch, uint8_t *out, int32_t ow, int32_t oh);
/* Image.resize(size, BICUBIC) of RGBA pixels: with premultiplied, as PIL
 * does for RGBA and LA (through RGBa: multiply, resample, divide back),
 * else every channel as it is (RGB, L). in is not changed. */
bool k3_pil_resize_rgba(const uint8_t *in, int32_t w, int32_t h, bool premultiplied, uint8_t *out, int32_t ow,
                        int32_t oh);
/* Image.resize(size, NEAREST) (ImagingScaleAffine). */
void k3_pil_resize_nearest(const uint8_t *in, int32_t w, int32_t h, int nch, uint8_t *out, int32_t ow, int32_t oh);

/* ---- tower (tower.c) ---- */

typedef enum k3_interp { K3_INTERP_BILINEAR = 0, K3_INTERP_BICUBIC } k3_interp;

typedef struct k3_vision_config {
    int32_t patch_size;
    int32_t pos_h, pos_w, pos_t; /* init_pos_emb_height/width/time */
    int32_t n_heads, n_layers;
    int64_t hidden, qkv, mlp; /* vt_hidden_size, qkv_hidden_size, vt_intermediate_size */
    int32_t merge_h, merge_w;
    int64_t mm_hidden, text_hidden;
    float proj_eps; /* projector_ln_eps */
    float enc_eps;  /* nn.RMSNorm(eps=None): finfo(float32).eps */
    k3_interp interp;
    int32_t media_pad_id; /* media_placeholder_token_id */
} k3_vision_config;

typedef struct k3_vit_block {
    float *norm0, *norm1; /* [hidden] */
    k3_mat wqkv;          /* [3 qkv, hidden]: q; k; v, each heads x head_dim */
    k3_mat wo;            /* [hidden, qkv] */
    k3_mat fc0;           /* [mlp, hidden] */
    k3_mat fc1;           /* [hidden, mlp] */
} k3_vit_block;

struct k3_vision {
    k3_vision_config cfg;
    k3_image_proc proc;
    k3_mat patch;         /* [hidden, 3 P P]: the conv weight flattened (c, ky, kx) */
    float *pos;           /* [pos_h, pos_w, hidden] */
    k3_vit_block *blocks; /* [n_layers] */
    float *final_norm;    /* [hidden] */
    k3_mat proj0;         /* [4 mm, 4 mm] */
    k3_mat proj2;         /* [text_hidden, 4 mm] */
    float *post_norm;     /* [text_hidden] */
    int64_t attn_rows;    /* query rows per attention block (0 = scores up to 32 MB) */
    const char *quant;    /* "none", "w8a8", ... (describe) */
    int64_t n_params, weight_bytes;
    void **owned;
    int32_t n_owned, cap_owned;
};

/* The position table resized to (h, w) as torch's F.interpolate computes it
 * (align_corners False, no antialias): out [h, w, D]. */
void k3_vision_pos_interp(const float *tab, int32_t th, int32_t tw, int64_t D, int32_t h, int32_t w, k3_interp mode,
                          float *out);

/* The tower + merger + projector over one image's patches [gh * gw, 3 P P]:
 * out [gh * gw / 4, text_hidden]. */
k3_status k3_vision_forward(const k3_vision *v, k3_pool *pool, const float *pixels, int32_t gt, int32_t gh, int32_t gw,
                            float *out, k3_error *err);

#endif /* K3_VISION_VISION_H */
