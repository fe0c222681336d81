/*
 * tower.c -- MoonViT3d, sd2_tpool and patchmergerv2 (docs/vision.md §3-4), as
 * modeling_kimi_k3.py computes them:
 *
 *   x = patches [L, 3 P P] · proj.weightᵀ + pos (the table F.interpolate'd to
 *       the grid; + sincos time term for t > 1)
 *   per block:  x += wo(attn(rope(wqkv(rms0(x)))));  x += fc1(gelu_tanh(fc0(rms1(x))))
 *       attention full (non-causal) within the image, scale 1/sqrt(head_dim),
 *       2D RoPE on interleaved pairs: complex pair 2j turns by col·f_j, 2j+1 by
 *       row·f_j, f_j = 10000^(-4j/head_dim)
 *   x = final_rms(x); tokens = 2x2 blocks [TL | TR | BL | BR] (mean over t)
 *   y = post_rms(fc2(gelu(fc0'(tokens))))       -- exact erf GELU, eps projector_ln_eps
 *
 * The encoder norms are nn.RMSNorm(eps=None): torch resolves that to
 * finfo(float32).eps (docs/vision.md §3.7, §8.2). Matrices go through k3_matmul in
 * their stored format (or as --quant converted them); the attention products
 * are k3_matmul calls on fp32 views of the image's keys and values.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/error.h"
#include "common/pool.h"
#include "kernels/quant.h"
#include "model/model.h"
#include "vision/vision.h"

/* ---- owned memory ---------------------------------------------------------- */

static void *vown(k3_vision *v, size_t n) {
    if (v->n_owned == v->cap_owned) {
        int32_t cap = v->cap_owned ? 2 * v->cap_owned : 64;
        void **o = realloc(v->owned, sizeof *o * (size_t)cap);
        if (!o) return NULL;
        v->owned = o;
        v->cap_owned = cap;
    }
    void *p = malloc(n ? n : 1);
    if (p) v->owned[v->n_owned++] = p;
    return p;
}

void k3_vision_close(k3_vision *v) {
    if (!v) return;
    for (int32_t i = 0; i < v->n_owned; i++) free(v->owned[i]);
    free(v->owned);
    free(v->blocks);
    free(v);
}

/* ---- vision_config ----------------------------------------------------------- */

typedef struct vparse {
    json_t *o;
    const char *src;
    k3_error *err;
} vparse;

static k3_status vint(vparse *p, const char *key, int64_t def, int64_t lo, int64_t hi, int64_t *out) {
    json_t *j = json_object_get(p->o, key);
    if (!j || json_is_null(j)) {
        *out = def;
        return K3_OK;
    }
    if (!json_is_integer(j) || json_integer_value(j) < lo || json_integer_value(j) > hi)
        return k3_err(p->err, K3_ERR_FORMAT, "%s: vision_config.%s must be an integer in [%lld, %lld]", p->src, key,
                      (long long)lo, (long long)hi);
    *out = json_integer_value(j);
    return K3_OK;
}

/* A string field that must have one of the values this engine computes. */
static k3_status vstr(vparse *p, const char *key, const char *def, const char *const *ok, int n_ok, int *which) {
    json_t *j = json_object_get(p->o, key);
    const char *s = !j || json_is_null(j) ? def : json_string_value(j);
    if (!s) return k3_err(p->err, K3_ERR_FORMAT, "%s: vision_config.%s is not a string", p->src, key);
    for (int i = 0; i < n_ok; i++)
        if (!strcmp(s, ok[i])) {
            if (which) *which = i;
            return K3_OK;
        }
    return k3_err(p->err, K3_ERR_UNSUPPORTED, "%s: vision_config.%s = '%s' is not supported (%s)", p->src, key, s,
                  ok[0]);
}

static k3_status vfalse(vparse *p, const char *key) {
    json_t *j = json_object_get(p->o, key);
    if (!j || json_is_null(j)) return K3_OK; /* KimiK3VisionConfig defaults: false */
    if (!json_is_boolean(j)) return k3_err(p->err, K3_ERR_FORMAT, "%s: vision_config.%s is not a boolean", p->src, key);
    if (json_is_true(j))
        return k3_err(p->err, K3_ERR_UNSUPPORTED, "%s: vision_config.%s = true is not supported", p->src, key);
    return K3_OK;
}

static k3_status parse_vision_config(k3_vision_config *c, json_t *root, json_t *vc, const char *src,
                                     const k3_config *text, k3_error *err) {
    vparse p = {vc, src, err};
    int64_t v;
    if (!json_is_object(vc)) return k3_err(err, K3_ERR_FORMAT, "%s: vision_config is not an object", src);
    K3_TRY(vint(&p, "patch_size", 14, 1, 64, &v));
    c->patch_size = (int32_t)v;
    K3_TRY(vint(&p, "init_pos_emb_height", 64, 1, 512, &v));
    c->pos_h = (int32_t)v;
    K3_TRY(vint(&p, "init_pos_emb_width", 64, 1, 512, &v));
    c->pos_w = (int32_t)v;
    K3_TRY(vint(&p, "init_pos_emb_time", 4, 1, 1024, &v));
    c->pos_t = (int32_t)v;
    K3_TRY(vint(&p, "vt_num_attention_heads", 12, 1, 1024, &v));
    c->n_heads = (int32_t)v;
    K3_TRY(vint(&p, "vt_num_hidden_layers", 27, 1, 1024, &v));
    c->n_layers = (int32_t)v;
    K3_TRY(vint(&p, "vt_hidden_size", 1024, 1, 1 << 16, &c->hidden));
    K3_TRY(vint(&p, "vt_intermediate_size", 4096, 1, 1 << 18, &c->mlp));
    K3_TRY(vint(&p, "qkv_hidden_size", 1536, 1, 1 << 16, &c->qkv));
    K3_TRY(vint(&p, "mm_hidden_size", c->hidden, 1, 1 << 16, &c->mm_hidden));
    K3_TRY(vint(&p, "text_hidden_size", 7168, 1, 1 << 20, &c->text_hidden));
    json_t *mk = json_object_get(vc, "merge_kernel_size");
    c->merge_h = c->merge_w = 2;
    if (mk && !json_is_null(mk)) {
        if (!json_is_array(mk) || json_array_size(mk) != 2 || !json_is_integer(json_array_get(mk, 0)) ||
            !json_is_integer(json_array_get(mk, 1)))
            return k3_err(err, K3_ERR_FORMAT, "%s: vision_config.merge_kernel_size must be [h, w]", src);
        c->merge_h = (int32_t)json_integer_value(json_array_get(mk, 0));
        c->merge_w = (int32_t)json_integer_value(json_array_get(mk, 1));
    }
    if (c->merge_h != 2 || c->merge_w != 2)
        return k3_err(err, K3_ERR_UNSUPPORTED, "%s: vision_config.merge_kernel_size [%d, %d] is not supported ([2, 2])",
                      src, c->merge_h, c->merge_w);
    static const char *const rms[] = {"rmsnorm"}, *const mlp2[] = {"mlp2"}, *const tpool[] = {"sd2_tpool"},
                             *const pm2[] = {"patchmergerv2"}, *const fixed[] = {"divided_fixed"},
                             *const gelu[] = {"gelu"}, *const interp[] = {"bilinear", "bicubic"};
    K3_TRY(vstr(&p, "norm_type", "rmsnorm", rms, 1, NULL));
    K3_TRY(vstr(&p, "mlp_type", "mlp2", mlp2, 1, NULL));
    K3_TRY(vstr(&p, "merge_type", "sd2_tpool", tpool, 1, NULL));
    K3_TRY(vstr(&p, "mm_projector_type", "patchmergerv2", pm2, 1, NULL));
    K3_TRY(vstr(&p, "pos_emb_type", "divided_fixed", fixed, 1, NULL));
    K3_TRY(vstr(&p, "projector_hidden_act", "gelu", gelu, 1, NULL));
    /* activation_func is not read: MoonViT3dPretrainedModel hard-codes
     * PytorchGELUTanh whatever the config says. */
    int which = 0;
    K3_TRY(vstr(&p, "pos_emb_interpolation_mode", "bilinear", interp, 2, &which));
    c->interp = which ? K3_INTERP_BICUBIC : K3_INTERP_BILINEAR;
    K3_TRY(vfalse(&p, "attn_bias"));
    K3_TRY(vfalse(&p, "linear_bias"));
    K3_TRY(vfalse(&p, "patch_embed_proj_bias"));
    json_t *eps = json_object_get(vc, "projector_ln_eps");
    double e = eps && json_is_number(eps) ? json_number_value(eps) : 1e-5;
    if (!(e > 0 && e < 1))
        return k3_err(err, K3_ERR_FORMAT, "%s: vision_config.projector_ln_eps must be in (0, 1)", src);
    c->proj_eps = (float)e;
    c->enc_eps = FLT_EPSILON;
    if (c->qkv % c->n_heads || (c->qkv / c->n_heads) % 4)
        return k3_err(err, K3_ERR_FORMAT, "%s: qkv_hidden_size %lld is not heads (%d) x a head_dim divisible by 4", src,
                      (long long)c->qkv, c->n_heads);
    if (c->mm_hidden != c->hidden)
        return k3_err(err, K3_ERR_FORMAT, "%s: vision_config.mm_hidden_size %lld != vt_hidden_size %lld", src,
                      (long long)c->mm_hidden, (long long)c->hidden);
    if (c->text_hidden != text->hidden_size)
        return k3_err(err, K3_ERR_FORMAT,
                      "%s: vision_config.text_hidden_size %lld != the text model's hidden_size %lld", src,
                      (long long)c->text_hidden, (long long)text->hidden_size);
    json_t *pad = json_object_get(root, "media_placeholder_token_id");
    int64_t pid = pad && json_is_integer(pad) ? json_integer_value(pad) : 163605;
    if (pid < 0 || pid >= text->vocab_size)
        return k3_err(err, K3_ERR_FORMAT, "%s: media_placeholder_token_id %lld is outside the vocabulary of %lld", src,
                      (long long)pid, (long long)text->vocab_size);
    c->media_pad_id = (int32_t)pid;
    return K3_OK;
}

/* ---- tensors ------------------------------------------------------------------ */

typedef struct vbind {
    k3_vision *v;
    const k3_st *st;
    const char *dir;
    k3_error *err;
} vbind;

static bool is_float(k3_dtype d) { return d == K3_DTYPE_F32 || d == K3_DTYPE_BF16 || d == K3_DTYPE_F16; }

static k3_status vneed(vbind *b, const char *name, const int64_t *shape, int nd, const k3_st_tensor **out) {
    const k3_st_tensor *t = k3_st_get(b->st, name);
    if (!t) return k3_err(b->err, K3_ERR_FORMAT, "%s: tensor '%s' is missing", b->dir, name);
    if (!is_float(t->dtype))
        return k3_err(b->err, K3_ERR_SHAPE, "%s: tensor '%s' is %s, want BF16, F16 or F32", b->dir, name,
                      k3_dtype_name(t->dtype));
    bool ok = t->ndim == nd;
    for (int i = 0; ok && i < nd; i++) ok = t->shape[i] == shape[i];
    if (!ok) {
        char want[128] = "", got[128] = "";
        for (int i = 0; i < nd; i++)
            snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", i ? "," : "", (long long)shape[i]);
        for (int i = 0; i < t->ndim; i++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", i ? "," : "", (long long)t->shape[i]);
        return k3_err(b->err, K3_ERR_SHAPE, "%s: tensor '%s' expected [%s] got [%s]", b->dir, name, want, got);
    }
    b->v->n_params += (int64_t)(t->nbytes / k3_dtype_size(t->dtype));
    b->v->weight_bytes += (int64_t)t->nbytes;
    *out = t;
    return K3_OK;
}

static k3_status vmat(vbind *b, k3_mat *dst, const char *name, const int64_t *shape, int nd) {
    const k3_st_tensor *t;
    k3_status s = vneed(b, name, shape, nd, &t);
    if (s) return s;
    int64_t cols = 1;
    for (int i = 1; i < nd; i++) cols *= shape[i];
    *dst = (k3_mat){.type = k3_model_wtype_of(t->dtype), .rows = shape[0], .cols = cols, .data = t->data};
    return K3_OK;
}

static k3_status vvec(vbind *b, float **dst, const char *name, const int64_t *shape, int nd) {
    const k3_st_tensor *t;
    k3_status s = vneed(b, name, shape, nd, &t);
    if (s) return s;
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    float *o = vown(b->v, sizeof(float) * (size_t)n);
    if (!o) return k3_err(b->err, K3_ERR_NOMEM, "%s: out of memory", b->dir);
    for (int64_t i = 0; i < n; i++) {
        if (t->dtype == K3_DTYPE_F32) memcpy(&o[i], t->data + 4 * i, 4);
        else {
            uint16_t h;
            memcpy(&h, t->data + 2 * i, 2);
            o[i] = t->dtype == K3_DTYPE_BF16 ? k3_bf16_to_f32(h) : k3_f16_to_f32(h);
        }
    }
    *dst = o;
    return K3_OK;
}

static k3_status bind_all(k3_vision *v, const k3_model *m, k3_error *err) {
    const k3_vision_config *c = &v->cfg;
    vbind b = {v, m->st, m->dir, err};
    const int64_t D = c->hidden, P = c->patch_size, Q = c->qkv, I = c->mlp, M4 = 4 * c->mm_hidden;
    char name[256];
    k3_status s;
#define B(call) \
    do { \
        if ((s = (call))) return s; \
    } while (0)
    B(vmat(&b, &v->patch, "vision_tower.patch_embed.proj.weight", (int64_t[]){D, 3, P, P}, 4));
    B(vvec(&b, &v->pos, "vision_tower.patch_embed.pos_emb.weight", (int64_t[]){c->pos_h, c->pos_w, D}, 3));
    v->blocks = calloc((size_t)c->n_layers, sizeof *v->blocks);
    if (!v->blocks) return k3_err(err, K3_ERR_NOMEM, "%s: out of memory", m->dir);
    for (int i = 0; i < c->n_layers; i++) {
        k3_vit_block *L = &v->blocks[i];
#define NM(s) (snprintf(name, sizeof name, "vision_tower.encoder.blocks.%d.%s", i, s), name)
        B(vvec(&b, &L->norm0, NM("norm0.weight"), (int64_t[]){D}, 1));
        B(vvec(&b, &L->norm1, NM("norm1.weight"), (int64_t[]){D}, 1));
        B(vmat(&b, &L->wqkv, NM("wqkv.weight"), (int64_t[]){3 * Q, D}, 2));
        B(vmat(&b, &L->wo, NM("wo.weight"), (int64_t[]){D, Q}, 2));
        B(vmat(&b, &L->fc0, NM("mlp.fc0.weight"), (int64_t[]){I, D}, 2));
        B(vmat(&b, &L->fc1, NM("mlp.fc1.weight"), (int64_t[]){D, I}, 2));
#undef NM
    }
    snprintf(name, sizeof name, "vision_tower.encoder.blocks.%d.norm0.weight", c->n_layers);
    if (k3_st_get(m->st, name))
        return k3_err(err, K3_ERR_SHAPE, "%s: the checkpoint has more tower blocks than vt_num_hidden_layers = %d",
                      m->dir, c->n_layers);
    B(vvec(&b, &v->final_norm, "vision_tower.encoder.final_layernorm.weight", (int64_t[]){D}, 1));
    B(vmat(&b, &v->proj0, "mm_projector.proj.0.weight", (int64_t[]){M4, M4}, 2));
    B(vmat(&b, &v->proj2, "mm_projector.proj.2.weight", (int64_t[]){c->text_hidden, M4}, 2));
    B(vvec(&b, &v->post_norm, "mm_projector.post_norm.weight", (int64_t[]){c->text_hidden}, 1));
#undef B
    return K3_OK;
}

k3_status k3_vision_open(k3_vision **out, const k3_model *m, k3_error *err) {
    if (!out || !m) return k3_err(err, K3_ERR_ARG, "vision: no model");
    *out = NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", m->dir);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) return k3_err(err, K3_ERR_FORMAT, "%s: line %d: %s", path, je.line, je.text);
    json_t *vc = json_is_object(root) ? json_object_get(root, "vision_config") : NULL;
    if (!vc || json_is_null(vc)) {
        json_decref(root);
        return k3_err(err, K3_ERR_UNSUPPORTED,
                      "%s has no vision tower (config.json has no vision_config): it "
                      "takes text only",
                      m->dir);
    }
    if (!k3_st_get(m->st, "vision_tower.patch_embed.proj.weight")) {
        json_decref(root);
        return k3_err(err, K3_ERR_UNSUPPORTED,
                      "%s has no vision tower weights (no vision_tower.* tensors): it takes "
                      "text only",
                      m->dir);
    }
    k3_vision *v = calloc(1, sizeof *v);
    if (!v) {
        json_decref(root);
        return k3_err(err, K3_ERR_NOMEM, "vision: out of memory");
    }
    v->quant = "none";
    k3_status s = parse_vision_config(&v->cfg, root, vc, path, &m->cfg, err);
    json_decref(root);
    if (!s) s = k3_image_proc_load(&v->proc, m->dir, err);
    if (!s && v->proc.patch_size != v->cfg.patch_size)
        s = k3_err(err, K3_ERR_FORMAT, "%s: preprocessor patch_size %d != vision_config.patch_size %d", m->dir,
                   v->proc.patch_size, v->cfg.patch_size);
    if (!s && v->proc.merge != v->cfg.merge_h)
        s = k3_err(err, K3_ERR_FORMAT, "%s: preprocessor merge_kernel_size %d != vision_config's %d", m->dir,
                   v->proc.merge, v->cfg.merge_h);
    if (!s && v->proc.side_limit > 512)
        s = k3_err(err, K3_ERR_FORMAT, "%s: patch_limit_on_one_side %d is over the tower's RoPE grid of 512", m->dir,
                   v->proc.side_limit);
    if (!s) s = bind_all(v, m, err);
    if (s) {
        k3_vision_close(v);
        return s;
    }
    *out = v;
    return K3_OK;
}

static void *quant_alloc(void *v, size_t n) { return vown(v, n); }

k3_status k3_vision_quantize(k3_vision *v, const k3_quant_options *opt, k3_error *err) {
    if (!v || !opt || opt->linear == K3_WQ_NONE) return K3_OK;
    if (strcmp(v->quant, "none")) return k3_err(err, K3_ERR_ARG, "vision: already quantized");
    k3_status s;
    for (int i = 0; i < v->cfg.n_layers; i++) {
        k3_vit_block *L = &v->blocks[i];
        k3_mat *ms[] = {&L->wqkv, &L->wo, &L->fc0, &L->fc1};
        for (int k = 0; k < 4; k++)
            if ((s = k3_quantize_mat(ms[k], opt->linear, quant_alloc, v, err))) return s;
    }
    k3_mat *more[] = {&v->patch, &v->proj0, &v->proj2};
    for (int k = 0; k < 3; k++)
        if ((s = k3_quantize_mat(more[k], opt->linear, quant_alloc, v, err))) return s;
    v->quant = k3_quant_mode_name(opt->linear);
    return K3_OK;
}

/* ---- position table ------------------------------------------------------------- */

/* torch's upsample_bicubic2d: Keys' cubic with A = -0.75 */
static void cubic_coeffs(float t, float c[4]) {
    const float A = -0.75f;
    float x = t + 1.0f;
    c[0] = ((A * x - 5.0f * A) * x + 8.0f * A) * x - 4.0f * A;
    x = t;
    c[1] = ((A + 2.0f) * x - (A + 3.0f)) * x * x + 1.0f;
    x = 1.0f - t;
    c[2] = ((A + 2.0f) * x - (A + 3.0f)) * x * x + 1.0f;
    x = 2.0f - t;
    c[3] = ((A * x - 5.0f * A) * x + 8.0f * A) * x - 4.0f * A;
}

void k3_vision_pos_interp(const float *tab, int32_t th, int32_t tw, int64_t D, int32_t h, int32_t w, k3_interp mode,
                          float *out) {
    /* align_corners False, size given: scale = in / out (float), src = scale (dst + 0.5) - 0.5 */
    const float sh = (float)th / (float)h, sw = (float)tw / (float)w;
    for (int32_t y = 0; y < h; y++)
        for (int32_t x = 0; x < w; x++) {
            float *o = out + ((int64_t)y * w + x) * D;
            if (mode == K3_INTERP_BILINEAR) {
                float fy = sh * (y + 0.5f) - 0.5f, fx = sw * (x + 0.5f) - 0.5f;
                if (fy < 0) fy = 0;
                if (fx < 0) fx = 0;
                const int32_t y0 = (int32_t)fy, x0 = (int32_t)fx;
                const int32_t y1 = y0 + (y0 < th - 1), x1 = x0 + (x0 < tw - 1);
                const float ly1 = fy - y0, ly0 = 1.0f - ly1, lx1 = fx - x0, lx0 = 1.0f - lx1;
                const float *a = tab + ((int64_t)y0 * tw + x0) * D, *b = tab + ((int64_t)y0 * tw + x1) * D;
                const float *c = tab + ((int64_t)y1 * tw + x0) * D, *d = tab + ((int64_t)y1 * tw + x1) * D;
                for (int64_t k = 0; k < D; k++)
                    o[k] = ly0 * (lx0 * a[k] + lx1 * b[k]) + ly1 * (lx0 * c[k] + lx1 * d[k]);
            } else {
                const float fy = sh * (y + 0.5f) - 0.5f, fx = sw * (x + 0.5f) - 0.5f;
                const int32_t iy = (int32_t)floorf(fy), ix = (int32_t)floorf(fx);
                float cy[4], cx[4];
                cubic_coeffs(fy - iy, cy);
                cubic_coeffs(fx - ix, cx);
                for (int64_t k = 0; k < D; k++) {
                    float acc = 0;
                    for (int i = 0; i < 4; i++) {
                        int32_t yy = iy - 1 + i;
                        yy = yy < 0 ? 0 : yy >= th ? th - 1 : yy;
                        float row = 0;
                        for (int j = 0; j < 4; j++) {
                            int32_t xx = ix - 1 + j;
                            xx = xx < 0 ? 0 : xx >= tw ? tw - 1 : xx;
                            row += cx[j] * tab[((int64_t)yy * tw + xx) * D + k];
                        }
                        acc += cy[i] * row;
                    }
                    o[k] = acc;
                }
            }
        }
}

/* ---- row operations, threaded --------------------------------------------------- */

typedef struct vjob {
    float *x; /* rows in place, or the output */
    const float *in;
    const float *w;
    int64_t n, ld; /* row width, stride */
    float eps, scale;
    const float *cs; /* rope: [rows, half] cos, then sin */
    int64_t half, heads, hd, rows;
} vjob;

static void rms_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const vjob *j = p;
    for (int64_t r = lo; r < hi; r++) {
        const float *x = j->in + r * j->n;
        float *o = j->x + r * j->n;
        float ss = 0;
        for (int64_t k = 0; k < j->n; k++) ss += x[k] * x[k];
        const float inv = 1.0f / sqrtf(ss / (float)j->n + j->eps);
        for (int64_t k = 0; k < j->n; k++) o[k] = x[k] * inv * j->w[k];
    }
}

static void rmsnorm_rows(k3_pool *pool, float *out, const float *x, const float *w, int64_t rows, int64_t n,
                         float eps) {
    vjob j = {.x = out, .in = x, .w = w, .n = n, .eps = eps};
    k3_pool_for(pool, rows, 16, rms_rows, &j);
}

/* gelu_tanh(x) = 0.5 x (1 + tanh(z)) = x sigmoid(2 z), z = sqrt(2/pi) (x + 0.044715 x^3):
 * the sigmoid gate of the kernels (k3_glu K3_GLU_GATE, vector exp), in chunks. */
static void gelu_tanh_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const vjob *j = p;
    const float k2 = 2.0f * 0.7978845608028654f;
    float u[1024];
    for (int64_t i = lo * j->n; i < hi * j->n; i += 1024) {
        const int64_t m = hi * j->n - i < 1024 ? hi * j->n - i : 1024;
        for (int64_t k = 0; k < m; k++) {
            const float x = j->x[i + k];
            u[k] = k2 * (x + 0.044715f * x * x * x);
        }
        k3_glu(j->x + i, u, m, K3_GLU_GATE, 1.0f, 0.0f);
    }
}

static void gelu_erf_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const vjob *j = p;
    for (int64_t i = lo * j->n; i < hi * j->n; i++) {
        const float x = j->x[i];
        j->x[i] = 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    }
}

static void softmax_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const vjob *j = p;
    for (int64_t r = lo; r < hi; r++) k3_softmax(j->x + r * j->n, j->n, j->scale);
}

/* q and k of every head of rows [lo, hi): (a + bi)(c + di) on pairs */
static void rope_rows(void *p, int64_t lo, int64_t hi, int ith) {
    const vjob *j = p;
    for (int64_t r = lo; r < hi; r++) {
        const float *cs = j->cs + (r % j->rows) * 2 * j->half;
        for (int part = 0; part < 2; part++)
            for (int64_t h = 0; h < j->heads; h++) {
                float *x = j->x + r * j->ld + part * j->heads * j->hd + h * j->hd;
                for (int64_t c = 0; c < j->half; c++) {
                    const float a = x[2 * c], b = x[2 * c + 1], co = cs[c], si = cs[j->half + c];
                    x[2 * c] = a * co - b * si;
                    x[2 * c + 1] = a * si + b * co;
                }
            }
    }
}

/* ---- the forward pass ---------------------------------------------------------- */

k3_status k3_vision_forward(const k3_vision *v, k3_pool *pool, const float *pixels, int32_t gt, int32_t gh, int32_t gw,
                            float *out, k3_error *err) {
    const k3_vision_config *c = &v->cfg;
    if (gt < 1 || gt > c->pos_t || gh < 2 || gw < 2 || gh % 2 || gw % 2 || gh > 512 || gw > 512)
        return k3_err(err, K3_ERR_ARG, "vision: bad grid (%d, %d, %d)", gt, gh, gw);
    const int64_t HW = (int64_t)gh * gw, L = gt * HW, D = c->hidden, Q = c->qkv, H = c->n_heads, hd = Q / H;
    const int64_t I = c->mlp, half = hd / 2, N = HW / 4, M4 = 4 * D, TD = c->text_hidden;
    int64_t bq = v->attn_rows > 0 ? v->attn_rows : ((int64_t)8 << 20) / L; /* scores [bq, L] <= 32 MB */
    if (bq < 1) bq = 1;
    if (bq > L) bq = L;
    const int64_t wide = 3 * Q > I ? 3 * Q : I;
    float *x = malloc(sizeof(float) * (size_t)(L * D)), *xn = malloc(sizeof(float) * (size_t)(L * D));
    float *big = malloc(sizeof(float) * (size_t)(L * wide)), *o = malloc(sizeof(float) * (size_t)(L * Q));
    float *qh = malloc(sizeof(float) * (size_t)(L * hd)), *kh = malloc(sizeof(float) * (size_t)(L * hd));
    float *vt = malloc(sizeof(float) * (size_t)(L * hd)), *sc = malloc(sizeof(float) * (size_t)(bq * L));
    float *oh = malloc(sizeof(float) * (size_t)(bq * hd)), *pos = malloc(sizeof(float) * (size_t)(HW * D));
    float *cs = malloc(sizeof(float) * (size_t)(HW * hd));
    float *mg = malloc(sizeof(float) * (size_t)(N * M4)), *y1 = malloc(sizeof(float) * (size_t)(N * M4));
    float *y2 = malloc(sizeof(float) * (size_t)(N * TD));
    k3_status st = K3_OK;
    if (!x || !xn || !big || !o || !qh || !kh || !vt || !sc || !oh || !pos || !cs || !mg || !y1 || !y2) {
        st = k3_err(err, K3_ERR_NOMEM, "vision: out of memory for a %dx%d-patch image", gh, gw);
        goto done;
    }

    /* patch embedding + position table (+ the fixed sincos time term for t > 1) */
    k3_matmul(pool, &v->patch, pixels, L, x);
    if (gh == c->pos_h && gw == c->pos_w) memcpy(pos, v->pos, sizeof(float) * (size_t)(HW * D));
    else k3_vision_pos_interp(v->pos, c->pos_h, c->pos_w, D, gh, gw, c->interp, pos);
    for (int64_t t = 0; t < gt; t++)
        for (int64_t i = 0; i < HW; i++) {
            float *r = x + (t * HW + i) * D;
            for (int64_t k = 0; k < D; k++) r[k] += pos[i * D + k];
            if (gt > 1)
                for (int64_t k = 0; k < D / 2; k++) {
                    /* get_1d_sincos_pos_embed in float32 */
                    const float om = 1.0f / powf(10000.0f, (float)k / ((float)D / 2.0f));
                    r[k] += sinf((float)t * om);
                    r[D / 2 + k] += cosf((float)t * om);
                }
        }

    /* RoPE table: pair 2j by col f_j, pair 2j+1 by row f_j (Rope2DPosEmbRepeated) */
    for (int64_t i = 0; i < HW; i++) {
        const float row = (float)(i / gw), col = (float)(i % gw);
        for (int64_t pc = 0; pc < half; pc++) {
            const int64_t jf = pc / 2;
            const float f = 1.0f / powf(10000.0f, (float)(4 * jf) / (float)hd);
            const float a = (pc % 2 ? row : col) * f;
            cs[i * hd + pc] = cosf(a);
            cs[i * hd + half + pc] = sinf(a);
        }
    }

    const float scale = 1.0f / sqrtf((float)hd);
    for (int l = 0; l < c->n_layers; l++) {
        const k3_vit_block *B = &v->blocks[l];
        rmsnorm_rows(pool, xn, x, B->norm0, L, D, c->enc_eps);
        k3_matmul(pool, &B->wqkv, xn, L, big); /* [L, 3Q] */
        vjob rj = {.x = big, .ld = 3 * Q, .cs = cs, .half = half, .heads = H, .hd = hd, .rows = HW};
        k3_pool_for(pool, L, 16, rope_rows, &rj);
        for (int64_t h = 0; h < H; h++) {
            for (int64_t r = 0; r < L; r++) {
                memcpy(qh + r * hd, big + r * 3 * Q + h * hd, sizeof(float) * (size_t)hd);
                memcpy(kh + r * hd, big + r * 3 * Q + Q + h * hd, sizeof(float) * (size_t)hd);
                const float *vr = big + r * 3 * Q + 2 * Q + h * hd;
                for (int64_t k = 0; k < hd; k++) vt[k * L + r] = vr[k];
            }
            const k3_mat Km = {.type = K3_W_F32, .rows = L, .cols = hd, .data = kh};
            const k3_mat Vm = {.type = K3_W_F32, .rows = hd, .cols = L, .data = vt};
            for (int64_t q0 = 0; q0 < L; q0 += bq) {
                const int64_t nq = q0 + bq <= L ? bq : L - q0;
                k3_matmul(pool, &Km, qh + q0 * hd, nq, sc); /* [nq, L] */
                vjob sj = {.x = sc, .n = L, .scale = scale};
                k3_pool_for(pool, nq, 4, softmax_rows, &sj);
                k3_matmul(pool, &Vm, sc, nq, oh); /* [nq, hd] */
                for (int64_t r = 0; r < nq; r++)
                    memcpy(o + (q0 + r) * Q + h * hd, oh + r * hd, sizeof(float) * (size_t)hd);
            }
        }
        k3_matmul(pool, &B->wo, o, L, xn);
        for (int64_t i = 0; i < L * D; i++) x[i] += xn[i];
        rmsnorm_rows(pool, xn, x, B->norm1, L, D, c->enc_eps);
        k3_matmul(pool, &B->fc0, xn, L, big); /* [L, I] */
        vjob gj = {.x = big, .n = I};
        k3_pool_for(pool, L, 16, gelu_tanh_rows, &gj);
        k3_matmul(pool, &B->fc1, big, L, xn);
        for (int64_t i = 0; i < L * D; i++) x[i] += xn[i];
    }
    rmsnorm_rows(pool, xn, x, v->final_norm, L, D, c->enc_eps);

    /* sd2_tpool: token (i, j) = [p(2i,2j) | p(2i,2j+1) | p(2i+1,2j) | p(2i+1,2j+1)], mean over t */
    const int64_t nw = gw / 2;
    memset(mg, 0, sizeof(float) * (size_t)(N * M4));
    for (int64_t t = 0; t < gt; t++)
        for (int64_t n = 0; n < N; n++) {
            const int64_t i = n / nw, j = n % nw;
            for (int s = 0; s < 4; s++) {
                const int64_t pr = 2 * i + s / 2, pc = 2 * j + s % 2;
                const float *src = xn + (t * HW + pr * gw + pc) * D;
                float *dst = mg + n * M4 + s * D;
                for (int64_t k = 0; k < D; k++) dst[k] += src[k];
            }
        }
    if (gt > 1)
        for (int64_t i = 0; i < N * M4; i++) mg[i] /= (float)gt;

    /* patchmergerv2: Linear, exact GELU, Linear, RMSNorm(eps) */
    k3_matmul(pool, &v->proj0, mg, N, y1);
    vjob ej = {.x = y1, .n = M4};
    k3_pool_for(pool, N, 4, gelu_erf_rows, &ej);
    k3_matmul(pool, &v->proj2, y1, N, y2);
    rmsnorm_rows(pool, out, y2, v->post_norm, N, TD, c->proj_eps);
done:
    free(x), free(xn), free(big), free(o), free(qh), free(kh), free(vt), free(sc), free(oh), free(pos), free(cs);
    free(mg), free(y1), free(y2);
    return st;
}
