/*
 * model.c -- k3_model_open: config + safetensors -> bound, checked weights.
 *
 * One walker visits every tensor the config implies, in three passes:
 *   CHECK  looks each tensor up, checks dtype and exact shape, and fills the
 *          k3_mat views (no tensor data is read);
 *   LOAD   runs only when CHECK passed: converts the small vectors to owned
 *          fp32 copies, derives attn_res_w and wuk_t, and scans every MXFP4
 *          scale byte for the E8M0 NaN code 255;
 *   COUNT  (k3_model_get_info) sums parameters and bytes; it writes nothing
 *          and visits one expert per layer (all experts share one shape).
 * Names are tried as `language_model.<name>` first, then `<name>`; messages
 * use the spelling the checkpoint uses. Tensors the config does not imply
 * (vision tower, projector, MTP layers) are ignored.
 */
#include "model.h"
#include "model/plan.h"
#include "common/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem.h"
#include "kernels/attn_ops.h"
#include "kernels/quant.h"

#define PFX "language_model."

typedef enum pass { PASS_CHECK, PASS_LOAD, PASS_COUNT } pass;

typedef struct stats {
    int64_t params, bytes;         /* every bound text tensor (embed once) */
    int64_t exp_params, exp_bytes; /* routed experts, all layers */
    int64_t emb_params, emb_bytes; /* the embedding table */
} stats;

typedef struct walker {
    const k3_model *m; /* config and tensors */
    k3_model *out;     /* where views and copies go; NULL in PASS_COUNT */
    pass pass;
    k3_error *err;
    const char *pfx; /* PFX when the checkpoint uses it, else "" */
    bool expert;     /* the tensors being bound are routed experts */
    stats st;
    char name[256]; /* the current name, without prefix */
} walker;

/* ---- small helpers ------------------------------------------------------ */

/* Formats the current tensor name into w->name. */
static const char *nm(walker *w, const char *fmt, ...) K3_PRINTF(2, 3);
static const char *nm(walker *w, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->name, sizeof w->name, fmt, ap);
    va_end(ap);
    return w->name;
}

static const k3_st_tensor *lookup(const walker *w, const char *name) {
    char full[352];
    snprintf(full, sizeof full, PFX "%s", name);
    const k3_st_tensor *t = k3_st_get(w->m->st, full);
    return t ? t : k3_st_get(w->m->st, name);
}

/* The name as the checkpoint spells it (for messages). */
static const char *full_name(const walker *w, const k3_st_tensor *t, const char *name, char *buf, size_t size) {
    if (t) return t->name;
    snprintf(buf, size, "%s%s", w->pfx, name);
    return buf;
}

static k3_status need(walker *w, const char *name, const k3_st_tensor **out) {
    *out = lookup(w, name);
    if (*out) return K3_OK;
    char buf[512];
    return k3_err(w->err, K3_ERR_FORMAT, "missing tensor '%s'", full_name(w, NULL, name, buf, sizeof buf));
}

static void fmt_shape(char *buf, size_t size, const int64_t *shape, int ndim) {
    size_t n = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < ndim && n < size; i++)
        n += (size_t)snprintf(buf + n, size - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < size) snprintf(buf + n, size - n, "]");
}

static k3_status bad_shape(walker *w, const k3_st_tensor *t, const int64_t *want, int ndim) {
    char a[128], b[128];
    fmt_shape(a, sizeof a, want, ndim);
    fmt_shape(b, sizeof b, t->shape, t->ndim);
    return k3_err(w->err, K3_ERR_SHAPE, "tensor '%s': expected shape %s, got %s", t->name, a, b);
}

static bool same_shape(const k3_st_tensor *t, const int64_t *want, int ndim) {
    if (t->ndim != ndim) return false;
    for (int i = 0; i < ndim; i++)
        if (t->shape[i] != want[i]) return false;
    return true;
}

static bool is_float(k3_dtype d) { return d == K3_DTYPE_BF16 || d == K3_DTYPE_F16 || d == K3_DTYPE_F32; }

static k3_status bad_dtype(walker *w, const k3_st_tensor *t, const char *allowed) {
    return k3_err(w->err, K3_ERR_SHAPE, "tensor '%s': dtype %s is not allowed (expected %s)", t->name,
                  k3_dtype_name(t->dtype), allowed);
}

/* A zero dimension makes it 0 whatever the others are (they may be huge:
 * the product is only bounded by the file size when every factor is
 * non-zero, so check for zero first). */
static int64_t numel(const k3_st_tensor *t) {
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] == 0) return 0;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

static void count(walker *w, int64_t params, int64_t bytes) {
    w->st.params += params;
    w->st.bytes += bytes;
    if (w->expert) {
        w->st.exp_params += params;
        w->st.exp_bytes += bytes;
    }
}

/* Element i of a BF16/F16/F32 array (possibly unaligned) as fp32. */
static float elem_f32(const uint8_t *data, k3_dtype d, int64_t i) {
    if (d == K3_DTYPE_F32) {
        float f;
        memcpy(&f, data + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, data + 2 * i, 2);
    return d == K3_DTYPE_BF16 ? k3_bf16_to_f32(h) : k3_f16_to_f32(h);
}

k3_wtype k3_model_wtype_of(k3_dtype d) {
    return d == K3_DTYPE_F32 ? K3_W_F32 : d == K3_DTYPE_F16 ? K3_W_F16 : K3_W_BF16;
}

/* Memory the model owns (freed by k3_model_close): vectors, derived and
 * quantized matrices (large ones in huge pages, common/mem.h). */
static void *own_bytes(k3_model *m, size_t n) {
    if (m->n_owned == m->cap_owned) {
        int64_t cap = m->cap_owned ? 2 * m->cap_owned : 256;
        float **o = realloc(m->owned, (size_t)cap * sizeof *o);
        if (!o) return NULL;
        m->owned = o;
        m->cap_owned = cap;
    }
    void *p = k3_alloc_big(n ? n : 1);
    if (p) m->owned[m->n_owned++] = p;
    return p;
}

/* Memory for a matrix made or copied at load (quantized, or out of the
 * mapping by k3_model_load_resident): below 2 MB, taken in order from 32 MB
 * chunks of own_bytes, so it lies in huge pages too (k3_alloc_big gives them
 * from 2 MB up) and matrices made one after another lie one after another.
 * Matrices of a few hundred KB in allocations of their own got 4 KB pages,
 * which the hardware prefetchers do not cross: one core streamed a latent
 * expert's W4A8 weights at 22 GB/s from 4 KB pages and 29 from 2 MB ones,
 * and the shared experts' 1.5 MB int8 down-projection, read at decode in 196
 * KB slices, at half the rate. Never freed alone (disown does not apply). */
enum { PACK_CHUNK = 32 << 20, PACK_BIG = 2 << 20 };
static void *own_packed(k3_model *m, size_t n) {
    n = (n + 63) / 64 * 64;
    if (n >= PACK_BIG) return own_bytes(m, n);
    if (!m->pack || m->pack_used + n > PACK_CHUNK) {
        if (!(m->pack = own_bytes(m, PACK_CHUNK))) return NULL;
        m->pack_used = 0;
    }
    void *p = m->pack + m->pack_used;
    m->pack_used += n;
    return p;
}

/* An fp32 buffer the model owns. */
static float *own(walker *w, int64_t n) { return own_bytes(w->out, (size_t)(n > 0 ? n : 1) * sizeof(float)); }

static k3_status nomem(walker *w) { return k3_err(w->err, K3_ERR_NOMEM, "out of memory loading %s", w->m->dir); }

/* ---- binders ------------------------------------------------------------ */

/* A matrix [rows, cols] in BF16/F16/F32, viewed in place. */
static k3_status bind_mat(walker *w, k3_mat *dst, const char *name, int64_t rows, int64_t cols) {
    if (w->pass == PASS_LOAD) return K3_OK;
    const k3_st_tensor *t;
    k3_status s = need(w, name, &t);
    if (s != K3_OK) return s;
    if (!is_float(t->dtype)) return bad_dtype(w, t, "BF16, F16 or F32");
    int64_t want[2] = {rows, cols};
    if (!same_shape(t, want, 2)) return bad_shape(w, t, want, 2);
    if (dst && w->out)
        *dst = (k3_mat){.type = k3_model_wtype_of(t->dtype), .rows = rows, .cols = cols, .data = t->data};
    count(w, rows * cols, (int64_t)t->nbytes);
    return K3_OK;
}

/* A routed expert matrix W[rows, cols] in MXFP4: NAME.weight_packed U8
 * [rows, cols/2] + NAME.weight_scale U8 [rows, cols/32]. LOAD scans the
 * scales for 255 (NaN in E8M0), which the kernels must never see. */
static k3_status bind_mxfp4(walker *w, k3_mat *dst, const char *base, int64_t rows, int64_t cols) {
    char pn[320], sn[320];
    snprintf(pn, sizeof pn, "%s.weight_packed", base);
    snprintf(sn, sizeof sn, "%s.weight_scale", base);
    const k3_st_tensor *p, *sc;
    k3_status s = need(w, pn, &p);
    if (s == K3_OK) s = need(w, sn, &sc);
    if (s != K3_OK) return s;
    if (w->pass == PASS_LOAD) {
        int64_t nb = cols / 32;
        const uint8_t *hit = memchr(sc->data, 0xFF, sc->nbytes);
        if (hit) {
            int64_t off = hit - sc->data;
            return k3_err(w->err, K3_ERR_FORMAT,
                          "tensor '%s': E8M0 scale 255 (NaN) at row %lld, block %lld "
                          "(columns %lld..%lld)",
                          sc->name, (long long)(off / nb), (long long)(off % nb), (long long)(off % nb * 32),
                          (long long)(off % nb * 32 + 31));
        }
        return K3_OK;
    }
    if (p->dtype != K3_DTYPE_U8) return bad_dtype(w, p, "U8 (packed MXFP4)");
    if (sc->dtype != K3_DTYPE_U8) return bad_dtype(w, sc, "U8 (E8M0 scales)");
    int64_t wp[2] = {rows, cols / 2}, ws[2] = {rows, cols / 32};
    if (!same_shape(p, wp, 2)) return bad_shape(w, p, wp, 2);
    if (!same_shape(sc, ws, 2)) return bad_shape(w, sc, ws, 2);
    if (dst && w->out)
        *dst = (k3_mat){.type = K3_W_MXFP4, .rows = rows, .cols = cols, .data = p->data, .scale = sc->data};
    count(w, rows * cols, (int64_t)(p->nbytes + sc->nbytes));
    return K3_OK;
}

/* Checks a vector-like tensor: dtype float, shape one of the allowed forms. */
static k3_status check_vec(walker *w, const k3_st_tensor *t, const int64_t *want, int ndim, const int64_t *alt,
                           int alt_ndim) {
    if (!is_float(t->dtype)) return bad_dtype(w, t, "BF16, F16 or F32");
    if (same_shape(t, want, ndim) || (alt && same_shape(t, alt, alt_ndim))) return K3_OK;
    return bad_shape(w, t, want, ndim);
}

/* Copies the first n elements of t into an owned fp32 vector. */
static k3_status load_vec(walker *w, float **dst, const k3_st_tensor *t, int64_t n) {
    float *v = own(w, n);
    if (!v) return nomem(w);
    for (int64_t i = 0; i < n; i++) v[i] = elem_f32(t->data, t->dtype, i);
    *dst = v;
    return K3_OK;
}

/* A vector [n] -> owned fp32. optional: absent leaves *dst NULL. */
static k3_status bind_vec_opt(walker *w, float **dst, const char *name, int64_t n, bool optional) {
    const k3_st_tensor *t = lookup(w, name);
    if (!t && optional) return K3_OK;
    k3_status s = need(w, name, &t);
    if (s != K3_OK) return s;
    if (w->pass != PASS_LOAD) {
        int64_t want[1] = {n};
        s = check_vec(w, t, want, 1, NULL, 0);
        if (s == K3_OK) count(w, n, (int64_t)t->nbytes);
        return s;
    }
    return dst ? load_vec(w, dst, t, n) : K3_OK;
}

static k3_status bind_vec(walker *w, float **dst, const char *name, int64_t n) {
    return bind_vec_opt(w, dst, name, n, false);
}

/* Conv taps [C, 1, K] (or [C, K]) -> owned fp32 [K, C], tap-major, so the
 * short conv runs along channels (k3_kda_conv). */
static k3_status bind_conv(walker *w, float **dst, const char *name, int64_t c, int64_t k) {
    const k3_st_tensor *t;
    k3_status s = need(w, name, &t);
    if (s != K3_OK) return s;
    if (w->pass != PASS_LOAD) {
        int64_t want[3] = {c, 1, k}, alt[2] = {c, k};
        s = check_vec(w, t, want, 3, alt, 2);
        if (s == K3_OK) count(w, c * k, (int64_t)t->nbytes);
        return s;
    }
    float *v = own(w, c * k);
    if (!v) return nomem(w);
    for (int64_t ch = 0; ch < c; ch++)
        for (int64_t j = 0; j < k; j++) v[j * c + ch] = elem_f32(t->data, t->dtype, ch * k + j);
    *dst = v;
    return K3_OK;
}

/* A_log: [H], padded [n >= H] (K3 stores [head_dim]), or any shape of H
 * elements ([1, 1, H, 1] in some Kimi-Linear exports). The first H are used. */
static k3_status bind_alog(walker *w, float **dst, const char *name, int64_t h) {
    const k3_st_tensor *t;
    k3_status s = need(w, name, &t);
    if (s != K3_OK) return s;
    if (w->pass != PASS_LOAD) {
        if (!is_float(t->dtype)) return bad_dtype(w, t, "BF16, F16 or F32");
        if (!(t->ndim == 1 && t->shape[0] >= h) && numel(t) != h)
            return k3_err(w->err, K3_ERR_SHAPE,
                          "tensor '%s': expected shape [%lld] (or padded to more), got "
                          "%d dimensions and %lld elements",
                          t->name, (long long)h, t->ndim, (long long)numel(t));
        count(w, numel(t), (int64_t)t->nbytes);
        return K3_OK;
    }
    return load_vec(w, dst, t, h);
}

/* AttnRes pseudo-query: norm [D] ⊙ proj[0, :] ([1, D], or [D]). */
static k3_status bind_res(walker *w, float **dst, const char *norm_name, const char *proj_name, int64_t d) {
    const k3_st_tensor *tn, *tp;
    k3_status s = need(w, norm_name, &tn);
    if (s == K3_OK) s = need(w, proj_name, &tp);
    if (s != K3_OK) return s;
    if (w->pass != PASS_LOAD) {
        int64_t v[1] = {d}, p2[2] = {1, d};
        s = check_vec(w, tn, v, 1, NULL, 0);
        if (s == K3_OK) s = check_vec(w, tp, p2, 2, v, 1);
        if (s == K3_OK) count(w, 2 * d, (int64_t)(tn->nbytes + tp->nbytes));
        return s;
    }
    float *r = own(w, d);
    if (!r) return nomem(w);
    for (int64_t i = 0; i < d; i++) r[i] = elem_f32(tn->data, tn->dtype, i) * elem_f32(tp->data, tp->dtype, i);
    *dst = r;
    return K3_OK;
}

/* ---- the layer walk ------------------------------------------------------ */

/* &L->field, or NULL when counting (no layer to write to). */
#define F(field) (L ? &L->field : NULL)

/* wuk_t[h][c][d] = kv_b[h*(nope+v) + d][c]: W_UK_h transposed, fp32. */
static k3_status derive_wuk(walker *w, k3_layer *L) {
    const k3_config *c = &w->m->cfg;
    int64_t H = c->n_heads, kv = c->kv_lora_rank, nope = c->qk_nope_dim, v = c->v_head_dim;
    float *t = own(w, H * kv * nope), *row = malloc(sizeof(float) * (size_t)(kv > 0 ? kv : 1));
    if (!t || !row) {
        free(row);
        return nomem(w);
    }
    for (int64_t h = 0; h < H; h++)
        for (int64_t j = 0; j < nope; j++) {
            k3_mat_get_row(&L->kv_b, h * (nope + v) + j, row);
            for (int64_t col = 0; col < kv; col++) t[(h * kv + col) * nope + j] = row[col];
        }
    free(row);
    L->wuk = (k3_mat){.type = K3_W_F32, .rows = H * kv, .cols = nope, .data = t};
    L->wuk_t = t;
    return K3_OK;
}

/* parts[0..np) stacked by rows into one owned matrix of their common dtype,
 * so one matmul (one pass over the input, one dispatch) serves them all;
 * *out stays empty when the parts differ in dtype or keep scales beside
 * their data (MXFP4). */
static k3_status derive_stack(walker *w, const k3_mat *const *parts, int np, k3_mat *out) {
    if (!parts[0]->data) return K3_OK;
    const k3_wtype_traits *ti = k3_wtype_info(parts[0]->type);
    if (ti->block || ti->row_scale) return K3_OK;
    int64_t rows = 0;
    for (int j = 0; j < np; j++) {
        if (parts[j]->type != parts[0]->type || parts[j]->cols != parts[0]->cols) return K3_OK;
        rows += parts[j]->rows;
    }
    const size_t rb = k3_mat_row_bytes(parts[0]);
    float *buf = own(w, (int64_t)((rows * (int64_t)rb + 3) / 4));
    if (!buf) return nomem(w);
    char *dst = (char *)buf;
    for (int j = 0; j < np; j++) {
        memcpy(dst, parts[j]->data, (size_t)parts[j]->rows * rb);
        dst += (size_t)parts[j]->rows * rb;
    }
    *out = (k3_mat){.type = parts[0]->type, .rows = rows, .cols = parts[0]->cols, .data = buf};
    return K3_OK;
}

/* MLAPO's fused down-projection: the matrices that read the layer input x
 * (q_a, kv_a and, for DSA, the indexer's wk and weights_proj). */
static k3_status derive_mla_down(walker *w, k3_layer *L) {
    const k3_mat *parts[4] = {&L->q_a, &L->kv_a, &L->idx_wk, &L->idx_weights};
    return derive_stack(w, parts, L->kind == K3_LAYER_DSA ? 4 : 2, &L->mla_down);
}

/* KDA's input projections: q, k, v, the decay gate's f_a, beta's b_proj and,
 * when full rank, the output gate. */
static k3_status derive_kda_in(walker *w, k3_layer *L, bool full_rank_gate) {
    const k3_mat *parts[6] = {&L->q_proj, &L->k_proj, &L->v_proj, &L->f_a, &L->b_proj, &L->g_proj};
    return derive_stack(w, parts, full_rank_gate ? 6 : 5, &L->kda_in);
}

/* gate and up of a GLU FFN, which read the same input */
static k3_status derive_gate_up(walker *w, const k3_mat *gate, const k3_mat *up, k3_mat *out) {
    const k3_mat *parts[2] = {gate, up};
    return derive_stack(w, parts, 2, out);
}

static k3_status walk_kda(walker *w, int i, k3_layer *L) {
    const k3_config *c = &w->m->cfg;
    int64_t D = c->hidden_size, H = c->kda_heads, dk = c->kda_head_dim, HD = H * dk;
    static const char *const qkv[3] = {"q", "k", "v"};
    for (int j = 0; j < 3; j++) {
        k3_mat *proj = L ? (j == 0 ? &L->q_proj : j == 1 ? &L->k_proj : &L->v_proj) : NULL;
        float **conv = L ? (j == 0 ? &L->q_conv : j == 1 ? &L->k_conv : &L->v_conv) : NULL;
        K3_TRY(bind_mat(w, proj, nm(w, "model.layers.%d.self_attn.%s_proj.weight", i, qkv[j]), HD, D));
        K3_TRY(bind_conv(w, conv, nm(w, "model.layers.%d.self_attn.%s_conv1d.weight", i, qkv[j]), HD, c->conv_size));
    }
    K3_TRY(bind_mat(w, F(o_proj), nm(w, "model.layers.%d.self_attn.o_proj.weight", i), D, HD));
    K3_TRY(bind_mat(w, F(f_a), nm(w, "model.layers.%d.self_attn.f_a_proj.weight", i), dk, D));
    K3_TRY(bind_mat(w, F(f_b), nm(w, "model.layers.%d.self_attn.f_b_proj.weight", i), HD, dk));
    K3_TRY(bind_mat(w, F(b_proj), nm(w, "model.layers.%d.self_attn.b_proj.weight", i), H, D));
    K3_TRY(bind_alog(w, F(A_log), nm(w, "model.layers.%d.self_attn.A_log", i), H));
    K3_TRY(bind_vec(w, F(dt_bias), nm(w, "model.layers.%d.self_attn.dt_bias", i), HD));
    K3_TRY(bind_vec(w, F(o_norm), nm(w, "model.layers.%d.self_attn.o_norm.weight", i), dk));
    if (c->kda_full_rank_gate) {
        K3_TRY(bind_mat(w, F(g_proj), nm(w, "model.layers.%d.self_attn.g_proj.weight", i), HD, D));
    } else {
        int64_t r = c->kda_gate_rank;
        K3_TRY(bind_mat(w, F(g_a), nm(w, "model.layers.%d.self_attn.g_a_proj.weight", i), r, D));
        K3_TRY(bind_mat(w, F(g_b), nm(w, "model.layers.%d.self_attn.g_b_proj.weight", i), HD, r));
    }
    if (w->pass == PASS_LOAD) K3_TRY(derive_kda_in(w, L, c->kda_full_rank_gate));
    return K3_OK;
}

static k3_status walk_mla(walker *w, int i, k3_layer *L) {
    const k3_config *c = &w->m->cfg;
    int64_t D = c->hidden_size, H = c->n_heads, ql = c->q_lora_rank, kv = c->kv_lora_rank;
    int64_t qk = c->qk_nope_dim + c->qk_rope_dim, v = c->v_head_dim;
    if (ql > 0) {
        K3_TRY(bind_mat(w, F(q_a), nm(w, "model.layers.%d.self_attn.q_a_proj.weight", i), ql, D));
        K3_TRY(bind_vec(w, F(q_a_norm), nm(w, "model.layers.%d.self_attn.q_a_layernorm.weight", i), ql));
        K3_TRY(bind_mat(w, F(q_b), nm(w, "model.layers.%d.self_attn.q_b_proj.weight", i), H * qk, ql));
    } else {
        K3_TRY(bind_mat(w, F(q_b), nm(w, "model.layers.%d.self_attn.q_proj.weight", i), H * qk, D));
    }
    K3_TRY(
        bind_mat(w, F(kv_a), nm(w, "model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", i), kv + c->qk_rope_dim, D));
    K3_TRY(bind_vec(w, F(kv_a_norm), nm(w, "model.layers.%d.self_attn.kv_a_layernorm.weight", i), kv));
    K3_TRY(bind_mat(w, F(kv_b), nm(w, "model.layers.%d.self_attn.kv_b_proj.weight", i), H * (c->qk_nope_dim + v), kv));
    K3_TRY(bind_mat(w, F(o_proj), nm(w, "model.layers.%d.self_attn.o_proj.weight", i), D, H * v));
    if (c->mla_use_output_gate)
        K3_TRY(bind_mat(w, F(g_proj), nm(w, "model.layers.%d.self_attn.g_proj.weight", i), H * v, D));
    if (c->layer_kind[i] == K3_LAYER_DSA) {
        int64_t HI = c->index_n_heads, dI = c->index_head_dim;
        K3_TRY(bind_mat(w, F(idx_wq_b), nm(w, "model.layers.%d.self_attn.indexer.wq_b.weight", i), HI * dI, ql));
        K3_TRY(bind_mat(w, F(idx_wk), nm(w, "model.layers.%d.self_attn.indexer.wk.weight", i), dI, D));
        K3_TRY(bind_vec(w, F(idx_k_norm_w), nm(w, "model.layers.%d.self_attn.indexer.k_norm.weight", i), dI));
        K3_TRY(bind_vec(w, F(idx_k_norm_b), nm(w, "model.layers.%d.self_attn.indexer.k_norm.bias", i), dI));
        K3_TRY(bind_mat(w, F(idx_weights), nm(w, "model.layers.%d.self_attn.indexer.weights_proj.weight", i), HI, D));
    }
    if (w->pass == PASS_LOAD) {
        K3_TRY(derive_wuk(w, L));
        K3_TRY(derive_mla_down(w, L));
    }
    return K3_OK;
}

static k3_status walk_moe(walker *w, int i, k3_layer *L) {
    const k3_config *c = &w->m->cfg;
    int64_t D = c->hidden_size, E = c->n_experts, Dl = c->expert_dim, Im = c->moe_intermediate;
    const char *P = "model.layers.%d.block_sparse_moe.";
    char fmt[160];
#define MOE(suffix) (snprintf(fmt, sizeof fmt, "%s%s", P, suffix), nm(w, fmt, i))
    K3_TRY(bind_mat(w, F(router), MOE("gate.weight"), E, D));
    K3_TRY(bind_vec_opt(w, F(router_bias), MOE("gate.e_score_correction_bias"), E, true));
    if (c->latent_moe) {
        K3_TRY(bind_mat(w, F(lat_down), MOE("routed_expert_down_proj.weight"), Dl, D));
        K3_TRY(bind_mat(w, F(lat_up), MOE("routed_expert_up_proj.weight"), D, Dl));
        if (c->latent_moe_norm) K3_TRY(bind_vec(w, F(lat_norm), MOE("routed_expert_norm.weight"), Dl));
    }
    if (c->n_shared_experts > 0) {
        int64_t S = c->n_shared_experts * Im;
        K3_TRY(bind_mat(w, F(sh_gate), MOE("shared_experts.gate_proj.weight"), S, D));
        K3_TRY(bind_mat(w, F(sh_up), MOE("shared_experts.up_proj.weight"), S, D));
        K3_TRY(bind_mat(w, F(sh_down), MOE("shared_experts.down_proj.weight"), D, S));
        if (w->pass == PASS_LOAD) {
            /* the latent down-projection and the shared experts' gate and up
             * all read the layer input: one stack when latent, else gate+up */
            const k3_mat *parts[3] = {&L->lat_down, &L->sh_gate, &L->sh_up};
            if (c->latent_moe) K3_TRY(derive_stack(w, parts, 3, &L->moe_in));
            if (!L->moe_in.data) K3_TRY(derive_gate_up(w, &L->sh_gate, &L->sh_up, &L->sh_gu));
        }
    }
#undef MOE
    if (L && w->pass == PASS_CHECK) {
        L->exp_gate = calloc((size_t)E, sizeof *L->exp_gate);
        L->exp_up = calloc((size_t)E, sizeof *L->exp_up);
        L->exp_down = calloc((size_t)E, sizeof *L->exp_down);
        if (!L->exp_gate || !L->exp_up || !L->exp_down) return nomem(w);
    }
    /* COUNT visits expert 0 and scales: CHECK proved they all match. */
    int64_t n_visit = w->pass == PASS_COUNT ? 1 : E;
    stats before = w->st;
    w->expert = true;
    for (int64_t e = 0; e < n_visit; e++) {
        static const char *const wn[3] = {"w1", "w3", "w2"};
        /* EP: another rank's expert is neither bound nor read */
        if (L && w->out->ep_size > 1 && e / (E / w->out->ep_size) != w->out->ep_rank) continue;
        for (int j = 0; j < 3; j++) {
            k3_mat *dst = L ? (j == 0 ? &L->exp_gate[e] : j == 1 ? &L->exp_up[e] : &L->exp_down[e]) : NULL;
            int64_t rows = j < 2 ? Im : Dl, cols = j < 2 ? Dl : Im;
            k3_status s;
            if (c->experts_mxfp4) {
                nm(w, "model.layers.%d.block_sparse_moe.experts.%lld.%s", i, (long long)e, wn[j]);
                char base[256];
                memcpy(base, w->name, sizeof base);
                s = bind_mxfp4(w, dst, base, rows, cols);
            } else {
                s = bind_mat(w, dst,
                             nm(w, "model.layers.%d.block_sparse_moe.experts.%lld.%s.weight", i, (long long)e, wn[j]),
                             rows, cols);
            }
            if (s != K3_OK) {
                w->expert = false;
                return s;
            }
        }
    }
    w->expert = false;
    if (n_visit < E) { /* scale the one visited expert up to all E */
        int64_t p1 = w->st.exp_params - before.exp_params, b1 = w->st.exp_bytes - before.exp_bytes;
        w->st.exp_params += p1 * (E - 1);
        w->st.exp_bytes += b1 * (E - 1);
        w->st.params += p1 * (E - 1);
        w->st.bytes += b1 * (E - 1);
    }
    return K3_OK;
}

static k3_status walk_layer(walker *w, int i, k3_layer *L) {
    const k3_config *c = &w->m->cfg;
    int64_t D = c->hidden_size;
    if (L && w->pass == PASS_CHECK) {
        L->kind = (k3_layer_kind)c->layer_kind[i];
        L->moe = c->layer_moe[i];
    }
    K3_TRY(bind_vec(w, F(input_norm), nm(w, "model.layers.%d.input_layernorm.weight", i), D));
    K3_TRY(bind_vec(w, F(post_attn_norm), nm(w, "model.layers.%d.post_attention_layernorm.weight", i), D));
    if (c->attn_res_block_size > 0) {
        char pn[256];
        snprintf(pn, sizeof pn, "model.layers.%d.self_attention_res_proj.weight", i);
        K3_TRY(bind_res(w, F(attn_res_w), nm(w, "model.layers.%d.self_attention_res_norm.weight", i), pn, D));
        snprintf(pn, sizeof pn, "model.layers.%d.mlp_res_proj.weight", i);
        K3_TRY(bind_res(w, F(mlp_res_w), nm(w, "model.layers.%d.mlp_res_norm.weight", i), pn, D));
    }
    if (c->layer_kind[i] == K3_LAYER_KDA) K3_TRY(walk_kda(w, i, L));
    else K3_TRY(walk_mla(w, i, L));
    if (c->layer_moe[i]) {
        K3_TRY(walk_moe(w, i, L));
    } else {
        int64_t I = c->intermediate_size;
        /* transformers' KimiLinear save renames every ".mlp." to
         * ".block_sparse_moe.", the dense layer's MLP included */
        const char *mlp = "mlp";
        if (!lookup(w, nm(w, "model.layers.%d.mlp.gate_proj.weight", i)) &&
            lookup(w, nm(w, "model.layers.%d.block_sparse_moe.gate_proj.weight", i)))
            mlp = "block_sparse_moe";
        K3_TRY(bind_mat(w, F(ffn_gate), nm(w, "model.layers.%d.%s.gate_proj.weight", i, mlp), I, D));
        K3_TRY(bind_mat(w, F(ffn_up), nm(w, "model.layers.%d.%s.up_proj.weight", i, mlp), I, D));
        K3_TRY(bind_mat(w, F(ffn_down), nm(w, "model.layers.%d.%s.down_proj.weight", i, mlp), D, I));
        if (w->pass == PASS_LOAD) K3_TRY(derive_gate_up(w, &L->ffn_gate, &L->ffn_up, &L->ffn_gu));
    }
    return K3_OK;
}

#undef F

static k3_status walk_model(walker *w) {
    const k3_config *c = &w->m->cfg;
    k3_model *o = w->out;
    int64_t V = c->vocab_size, D = c->hidden_size;
    stats before = w->st;
    K3_TRY(bind_mat(w, o ? &o->embed : NULL, "model.embed_tokens.weight", V, D));
    w->st.emb_params += w->st.params - before.params;
    w->st.emb_bytes += w->st.bytes - before.bytes;
    if (c->tie_word_embeddings) {
        if (o) o->lm_head = o->embed;
    } else {
        K3_TRY(bind_mat(w, o ? &o->lm_head : NULL, "lm_head.weight", V, D));
    }
    K3_TRY(bind_vec(w, o ? &o->final_norm : NULL, "model.norm.weight", D));
    if (c->attn_res_block_size > 0)
        K3_TRY(bind_res(w, o ? &o->out_res_w : NULL, "model.output_attn_res_norm.weight",
                        "model.output_attn_res_proj.weight", D));
    for (int i = 0; i < c->n_layers; i++) K3_TRY(walk_layer(w, i, o ? &o->layers[i] : NULL));
    return K3_OK;
}

/* ---- public API --------------------------------------------------------- */

void k3_model_close(k3_model *m) {
    if (!m) return;
    if (m->layers) {
        for (int i = 0; i < m->cfg.n_layers; i++) {
            free(m->layers[i].exp_gate);
            free(m->layers[i].exp_up);
            free(m->layers[i].exp_down);
        }
    }
    for (int64_t i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    k3_st_close(m->st);
    free(m->dir);
    free(m);
}

k3_status k3_model_open(k3_model **out, const char *dir, k3_error *err) {
    return k3_model_open_ep(out, dir, 0, 1, err);
}

int64_t k3_model_expert_bytes(const k3_model *m) {
    int64_t b = 0;
    for (int i = 0; i < m->cfg.n_layers; i++) {
        const k3_layer *L = &m->layers[i];
        for (int e = 0; L->moe && e < m->cfg.n_experts; e++) {
            const k3_mat *ws[3] = {&L->exp_gate[e], &L->exp_up[e], &L->exp_down[e]};
            for (int j = 0; j < 3; j++) {
                const k3_mat *w = ws[j];
                if (w->data) b += w->rows * (int64_t)k3_mat_row_bytes(w);
            }
        }
    }
    return b;
}

k3_status k3_model_open_ep(k3_model **out, const char *dir, int32_t ep_rank, int32_t ep_size, k3_error *err) {
    *out = NULL;
    if (ep_size < 1 || ep_rank < 0 || ep_rank >= ep_size)
        return k3_err(err, K3_ERR_ARG, "model: EP rank %d of %d is out of range", ep_rank, ep_size);
    k3_model *m = calloc(1, sizeof *m);
    if (!m) return k3_err(err, K3_ERR_NOMEM, "out of memory");
    m->ep_rank = ep_rank;
    m->ep_size = ep_size;
    k3_status s = K3_OK;
    m->dir = strdup(dir);
    if (!m->dir) s = k3_err(err, K3_ERR_NOMEM, "out of memory");
    if (s == K3_OK) s = k3_config_load(&m->cfg, dir, err);
    if (s == K3_OK && ep_size > 1 && m->cfg.n_experts < ep_size)
        s = k3_err(err, K3_ERR_ARG, "model: --ep %d is more EP ranks than the %d routed experts of %s", ep_size,
                   m->cfg.n_experts, dir);
    else if (s == K3_OK && ep_size > 1 && m->cfg.n_experts % ep_size)
        s = k3_err(err, K3_ERR_ARG, "model: --ep %d does not divide the %d routed experts of %s", ep_size,
                   m->cfg.n_experts, dir);
    if (s == K3_OK) s = k3_st_open(&m->st, dir, err);
    if (s == K3_OK) {
        m->layers = calloc((size_t)m->cfg.n_layers, sizeof *m->layers);
        if (!m->layers) s = k3_err(err, K3_ERR_NOMEM, "out of memory");
    }
    if (s == K3_OK) {
        walker w = {.m = m, .out = m, .err = err, .pass = PASS_CHECK};
        w.pfx = "";
        for (int64_t i = 0; i < k3_st_count(m->st); i++)
            if (!strncmp(k3_st_at(m->st, i)->name, PFX, strlen(PFX))) {
                w.pfx = PFX;
                break;
            }
        s = walk_model(&w);
        if (s == K3_OK) {
            w.pass = PASS_LOAD;
            s = walk_model(&w);
        }
    }
    if (s != K3_OK) {
        k3_model_close(m);
        return s;
    }
    *out = m;
    return K3_OK;
}

void k3_model_get_info(const k3_model *m, k3_model_info *info) {
    const k3_config *c = &m->cfg;
    memset(info, 0, sizeof *info);
    info->model_type = c->model_type;
    info->vocab_size = c->vocab_size;
    info->hidden_size = c->hidden_size;
    info->n_layers = c->n_layers;
    info->max_positions = c->max_positions;
    int64_t state = 0;
    for (int i = 0; i < c->n_layers; i++) {
        switch ((k3_layer_kind)c->layer_kind[i]) {
        case K3_LAYER_KDA: {
            int64_t H = c->kda_heads, dk = c->kda_head_dim;
            info->n_kda++;
            state += (H * dk * dk + 3 * H * dk * (c->conv_size - 1)) * 4;
            break;
        }
        case K3_LAYER_DSA: info->n_dsa++; break;
        case K3_LAYER_MLA: info->n_mla++; break;
        }
    }
    info->cache_bytes_per_token = k3_config_cache_bytes_per_token(c, K3_KV_F32);
    info->state_bytes_per_seq = state;

    /* Sizes: a read-only walk (the model was fully checked at open). */
    walker w = {.m = m, .out = NULL, .pass = PASS_COUNT, .err = NULL, .pfx = ""};
    if (walk_model(&w) != K3_OK) return; /* cannot happen after a good open */
    const stats *s = &w.st;
    int64_t E = c->n_experts > 0 ? c->n_experts : 1, k = c->n_experts_per_tok;
    int64_t act_exp_params = s->exp_params / E * k, act_exp_bytes = s->exp_bytes / E * k;
    int64_t V = c->vocab_size > 0 ? c->vocab_size : 1;
    info->n_params = s->params;
    info->weight_bytes = s->bytes;
    /* Per token: one embedding row, the top-k experts, everything else
     * (lm_head included; when tied, lm_head *is* the full table). */
    int64_t emb_p = c->tie_word_embeddings ? 0 : s->emb_params - c->hidden_size;
    int64_t emb_b = c->tie_word_embeddings ? 0 : s->emb_bytes - s->emb_bytes / V;
    info->n_params_active = s->params - s->exp_params + act_exp_params - emb_p;
    info->bytes_per_token = s->bytes - s->exp_bytes + act_exp_bytes - emb_b + m->quant_bytes_delta;
    int32_t nmoe = 0;
    for (int i = 0; i < c->n_layers; i++)
        if (c->layer_moe[i]) nmoe++;
    info->n_experts = c->n_experts > 0 ? (int32_t)c->n_experts : 0;
    info->n_experts_per_tok = info->n_experts ? (int32_t)c->n_experts_per_tok : 0;
    info->n_moe_layers = nmoe;
    info->expert_bytes = nmoe ? s->exp_bytes / E / nmoe : 0;
}

/* snprintf into buf at *len, tracking the wanted length (snprintf rules). */
static void put(char *buf, size_t size, size_t *len, const char *fmt, ...) K3_PRINTF(4, 5);
static void put(char *buf, size_t size, size_t *len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(*len < size ? buf + *len : NULL, *len < size ? size - *len : 0, fmt, ap);
    va_end(ap);
    if (n > 0) *len += (size_t)n;
}

static const char *human(double x, char *buf, size_t size) {
    const char *u[] = {"", "K", "M", "G", "T", "P"};
    int i = 0;
    while (x >= 1000 && i < 5) {
        x /= 1000;
        i++;
    }
    snprintf(buf, size, i ? "%.2f%s" : "%.0f%s", x, u[i]);
    return buf;
}

size_t k3_model_describe(const k3_model *m, char *buf, size_t size) {
    const k3_config *c = &m->cfg;
    k3_model_info in;
    k3_model_get_info(m, &in);
    size_t n = 0;
    char h1[32], h2[32], h3[32], h4[32];
    if (size) buf[0] = 0;
    put(buf, size, &n, "model: %s (%s)\n", c->model_type, c->is_k3 ? "Kimi K3 family" : "Kimi-Linear family");
    put(buf, size, &n,
        "vocab %lld, hidden %lld, %d layers (%d KDA, %d MLA, %d DSA), "
        "max positions %lld, rms eps %g%s\n",
        (long long)c->vocab_size, (long long)c->hidden_size, c->n_layers, in.n_kda, in.n_mla, in.n_dsa,
        (long long)c->max_positions, c->rms_eps, c->tie_word_embeddings ? ", tied lm_head" : "");
    if (in.n_kda)
        put(buf, size, &n, "KDA: %d heads x %d, conv %d, decay %s, output gate %s\n", c->kda_heads, c->kda_head_dim,
            c->conv_size, c->kda_has_lower_bound ? "bounded sigmoid" : "softplus",
            c->kda_full_rank_gate ? "full rank" : "low rank");
    if (in.n_mla + in.n_dsa)
        put(buf, size, &n, "MLA: %d heads, q_lora %d, kv_lora %d, qk %d+%d (NoPE), v %d%s\n", c->n_heads,
            c->q_lora_rank, c->kv_lora_rank, c->qk_nope_dim, c->qk_rope_dim, c->v_head_dim,
            c->mla_use_output_gate ? ", output gate" : "");
    if (in.n_dsa)
        put(buf, size, &n, "DSA indexer: %d heads x %d, top %d\n", c->index_n_heads, c->index_head_dim, c->index_topk);
    if (c->n_experts)
        put(buf, size, &n,
            "MoE: %d experts (%s), top %d, %d shared, width %lld on %s%lld, "
            "router %s, scale %g\n",
            c->n_experts, c->experts_mxfp4 ? "MXFP4" : "float", c->n_experts_per_tok, c->n_shared_experts,
            (long long)c->moe_intermediate, c->latent_moe ? "latent " : "", (long long)c->expert_dim,
            c->router_sigmoid ? "sigmoid" : "softmax", c->routed_scaling);
    put(buf, size, &n, "FFN: %s; residual: %s\n", c->act == K3_ACT_SITU ? "SiTU-GLU" : "SwiGLU",
        c->attn_res_block_size ? "AttnRes" : "plain");
    if (c->attn_res_block_size) put(buf, size, &n, "AttnRes: block %d (* = bank layer)\n", c->attn_res_block_size);
    static const char *const kind[] = {"KDA", "MLA", "DSA"};
    put(buf, size, &n, "layers:");
    for (int i = 0; i < c->n_layers; i++)
        put(buf, size, &n, " %d:%s%s", i, kind[c->layer_kind[i] % 3], k3_config_is_bank_layer(c, i) ? "*" : "");
    put(buf, size, &n, "\nffn:");
    for (int i = 0; i < c->n_layers;) { /* runs of dense / MoE */
        int j = i;
        while (j + 1 < c->n_layers && c->layer_moe[j + 1] == c->layer_moe[i]) j++;
        if (j > i) put(buf, size, &n, " %d-%d:%s", i, j, c->layer_moe[i] ? "MoE" : "dense");
        else put(buf, size, &n, " %d:%s", i, c->layer_moe[i] ? "MoE" : "dense");
        i = j + 1;
    }
    put(buf, size, &n, "\nparameters: %lld total (%s), %lld active per token (%s)\n", (long long)in.n_params,
        human((double)in.n_params, h1, sizeof h1), (long long)in.n_params_active,
        human((double)in.n_params_active, h2, sizeof h2));
    put(buf, size, &n, "weights: %lld bytes (%sB); bytes read per decoded token: %lld (%sB), %s\n",
        (long long)in.weight_bytes, human((double)in.weight_bytes, h3, sizeof h3), (long long)in.bytes_per_token,
        human((double)in.bytes_per_token, h4, sizeof h4), m->quant_bytes_delta ? "as quantized" : "as stored");
    put(buf, size, &n, "cache: %lld bytes per token (fp32), %lld (c8); KDA state %lld bytes per sequence\n",
        (long long)in.cache_bytes_per_token, (long long)k3_config_cache_bytes_per_token(&m->cfg, K3_KV_C8),
        (long long)in.state_bytes_per_seq);
    return n;
}

/* ---- load-time quantization ------------------------------------------------ */

k3_status k3_quant_parse(const char *s, k3_quant_options *out, k3_error *err) {
    *out = (k3_quant_options){K3_WQ_NONE, false, false};
    char buf[128];
    if (!s || strlen(s) >= sizeof buf) return k3_err(err, K3_ERR_ARG, "quant: bad mode");
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, "+,", &save); tok; tok = strtok_r(NULL, "+,", &save)) {
        k3_wquant q;
        if (!strcmp(tok, "none") || !strcmp(tok, "bf16")) continue;
        else if (!strcmp(tok, "f32") || !strcmp(tok, "fp32")) out->f32 = true;
        else if (k3_quant_mode_of(tok, &q)) out->linear = q;
        else if (!strcmp(tok, "w4a8")) out->experts_a8 = true;
        else {
            char modes[128];
            k3_quant_mode_list(modes, sizeof modes);
            return k3_err(err, K3_ERR_ARG, "quant: unknown mode '%s' (use none, f32, %s, w4a8, or e.g. w8a8+w4a8)", tok,
                          modes);
        }
    }
    return K3_OK;
}

/* Frees an owned buffer before k3_model_close (its slot stays, empty). */
static void disown(k3_model *m, const void *p) {
    for (int64_t i = 0; i < m->n_owned; i++)
        if (m->owned[i] == p) {
            free(m->owned[i]);
            m->owned[i] = NULL;
            return;
        }
}

/* Memory for quantized arrays: own_packed's (k3_quantize_mat's alloc). */
static void *pack_alloc(void *m, size_t n) { return own_packed(m, n); }

/* alias: W_UK, the k half of kv_b again -- its bytes are counted with kv_b's
 * and its source stays (wuk_t names it) */
static k3_status quantize_mat(k3_model *m, k3_mat *w, k3_wquant q, bool alias, k3_error *err) {
    const void *old = w->data;
    /* a stack the loader made: not needed once converted */
    const void *src = alias || !old || k3_st_maps(m->st, old) ? NULL : old;
    const int64_t before = w->rows * (int64_t)k3_mat_row_bytes(w);
    K3_TRY(k3_quantize_mat(w, q, pack_alloc, m, err));
    if (w->data == old) return K3_OK; /* stays as stored */
    if (!alias) m->quant_bytes_delta += w->rows * (int64_t)k3_mat_row_bytes(w) - before;
    if (src) disown(m, src);
    return K3_OK;
}

/* The matrices of layer L that the forward pass reads, less the router and
 * the routed experts: where the loader stacked matrices (MLAPO's
 * down-projection, KDA's input projections, FFN gate+up, the MoE input
 * stack), the stack and not its parts; W_UK as a matrix. Returns the count
 * written to out (empty ones skipped). */
static int runtime_mats(const k3_config *c, k3_layer *L, k3_mat **out) {
    const bool mla = L->mla_down.data != NULL, kda = L->kda_in.data != NULL;
    const bool ffn = L->ffn_gu.data != NULL, sh = L->sh_gu.data != NULL, moe = L->moe_in.data != NULL;
    k3_mat *mats[] = {moe ? &L->moe_in : NULL,
                      &L->wuk,
                      &L->o_proj,
                      kda && c->kda_full_rank_gate ? NULL : &L->g_proj,
                      kda ? &L->kda_in : &L->q_proj,
                      kda ? NULL : &L->k_proj,
                      kda ? NULL : &L->v_proj,
                      &L->g_a,
                      &L->g_b,
                      kda ? NULL : &L->f_a,
                      &L->f_b,
                      kda ? NULL : &L->b_proj,
                      mla ? &L->mla_down : &L->q_a,
                      &L->q_b,
                      mla ? NULL : &L->kv_a,
                      &L->kv_b,
                      mla ? NULL : &L->idx_wk,
                      mla ? NULL : &L->idx_weights,
                      &L->idx_wq_b,
                      ffn ? &L->ffn_gu : &L->ffn_gate,
                      ffn ? NULL : &L->ffn_up,
                      &L->ffn_down,
                      moe ? NULL : &L->lat_down,
                      &L->lat_up,
                      moe      ? NULL
                          : sh ? &L->sh_gu
                               : &L->sh_gate,
                      moe || sh ? NULL : &L->sh_up,
                      &L->sh_down};
    int n = 0;
    for (size_t k = 0; k < sizeof mats / sizeof mats[0]; k++)
        if (mats[k] && mats[k]->data) out[n++] = mats[k];
    return n;
}

/* Whether a matrix of type t may run with 8-bit activations by choice
 * (k3_mat.act8): its kernels take both (MXFP4, as W4A8). */
static bool can_act8(k3_wtype t) {
    const unsigned a = k3_wtype_info(t)->acts;
    return (a & K3_ACTS_8BIT) && (a & K3_ACTS_F32);
}

/* Whether a view of rows [r0, r0 + n) of matrix w of layer L may start
 * anywhere a strip does not: the per-head views of W_UK and of kv_b's value
 * half (mla.c) start at multiples of kv_lora and of the head dims. */
static bool views_on_strips(const k3_config *c, const k3_layer *L, const k3_mat *w) {
    if (w == &L->wuk) return c->kv_lora_rank % 16 == 0;
    if (w == &L->kv_b) return c->qk_nope_dim % 16 == 0 && c->v_head_dim % 16 == 0;
    return true;
}

/* w (k3_mat.bf16) as K3_W_*_S16 strips in own_packed memory, where its shape
 * and its views allow (k3_s16_ok); the old array freed when the loader made
 * it (a stack), not when it is mapped or aliased. */
static k3_status to_strips(k3_model *m, k3_mat *w, bool views_ok, bool alias, k3_error *err) {
    if (!w->data || !w->bf16 || !views_ok || !k3_s16_ok(w)) return K3_OK;
    const void *old = w->data;
    const bool mine = !alias && !k3_st_maps(m->st, old);
    const size_t nb = k3_mat_data_bytes(w), ns = k3_mat_scale_bytes(w);
    uint8_t *d = own_packed(m, nb), *sc = ns ? own_packed(m, ns) : NULL;
    if (!d || (ns && !sc)) return k3_err(err, K3_ERR_NOMEM, "load: out of memory making the BF16 strips");
    k3_s16_pack(w, d, sc);
    w->type = w->type == K3_W_MXFP4 ? K3_W_MXFP4_S16 : K3_W_BF16_S16;
    w->data = d;
    if (ns) w->scale = sc;
    w->wrange = k3_mat_wrange(w);
    if (mine) disown(m, old);
    return K3_OK;
}

/* Marks the matrices that take the BF16 dot products (k3_mat.bf16): every
 * BF16 and MXFP4 matrix the forward pass reads with fp32 activations but
 * the routers, whose top-k has near-ties a BF16 rounding upstream of it does
 * not flip but one inside it does (docs/amx.md, "Numerics"). The stacks the
 * loader made become strips now (k3_model_load_resident does the mapped
 * ones). */
static k3_status mark_bf16(k3_model *m, k3_error *err) {
    const k3_config *c = &m->cfg;
    for (int i = 0; i < c->n_layers; i++) {
        k3_layer *L = &m->layers[i];
        k3_mat *mats[32];
        const int n = runtime_mats(c, L, mats);
        for (int k = 0; k < n; k++) {
            mats[k]->bf16 = !mats[k]->act8 && k3_bf16_mat_ok(mats[k]);
            if (!k3_st_maps(m->st, mats[k]->data))
                K3_TRY(to_strips(m, mats[k], views_on_strips(c, L, mats[k]), mats[k] == &L->wuk, err));
        }
        for (int e = 0; L->moe && e < c->n_experts; e++) {
            k3_mat *ws[3] = {&L->exp_gate[e], &L->exp_up[e], &L->exp_down[e]};
            for (int j = 0; j < 3; j++) ws[j]->bf16 = !ws[j]->act8 && k3_bf16_mat_ok(ws[j]);
        }
    }
    m->lm_head.bf16 = k3_bf16_mat_ok(&m->lm_head);
    m->bf16 = true;
    m->qsfa_bf16_heads = K3_QSFA_BF16_HEADS;
    return K3_OK;
}

k3_status k3_model_quantize(k3_model *m, const k3_quant_options *opt, k3_error *err) {
    const k3_config *c = &m->cfg;
    for (int i = 0; i < c->n_layers; i++) {
        k3_layer *L = &m->layers[i];
        if (opt->linear != K3_WQ_NONE) {
            k3_mat *mats[32];
            const int n = runtime_mats(c, L, mats);
            for (int k = 0; k < n; k++) {
                k3_status s = quantize_mat(m, mats[k], opt->linear, mats[k] == &L->wuk, err);
                if (s) return s;
            }
        }
        if (opt->experts_a8 && L->moe)
            for (int e = 0; e < c->n_experts; e++) {
                k3_mat *ws[3] = {&L->exp_gate[e], &L->exp_up[e], &L->exp_down[e]};
                for (int j = 0; j < 3; j++) ws[j]->act8 = can_act8(ws[j]->type);
            }
    }
    return opt->f32 || !k3_kernels_bf16() ? K3_OK : mark_bf16(m, err);
}

/* Copies one matrix out of the mapping (data, and the MXFP4 scales) into
 * own_packed memory -- in order, in huge pages, so an expert's matrices
 * follow one another -- or, when dry, only counts its bytes. An MXFP4 matrix
 * the W4A8 kernel will read is copied as K3_W_MXFP4_R4 tiles
 * (k3_mx4_r4_wanted), one that takes the BF16 dot products as strips
 * (k3_s16_ok, views_ok: its row views start on strips). */
static k3_status copy_mat(k3_model *m, k3_mat *w, bool views_ok, bool dry, int64_t *bytes, k3_error *err) {
    if (!w->data || !k3_st_maps(m->st, w->data)) return K3_OK;
    const size_t nb = k3_mat_data_bytes(w), ns = k3_mat_scale_bytes(w);
    *bytes += (int64_t)(nb + ns);
    if (dry) return K3_OK;
    if (w->bf16 && views_ok && k3_s16_ok(w)) return to_strips(m, w, true, false, err);
    uint8_t *d = own_packed(m, nb), *sc = ns ? own_packed(m, ns) : NULL;
    if (!d || (ns && !sc)) return k3_err(err, K3_ERR_NOMEM, "load: out of memory copying weights into RAM");
    if (k3_mx4_r4_wanted(w)) {
        k3_mx4_r4_pack(w, d, sc);
        w->type = K3_W_MXFP4_R4;
    } else {
        memcpy(d, w->data, nb);
        if (ns) memcpy(sc, w->scale, ns);
    }
    w->data = d;
    if (ns) w->scale = sc;
    return K3_OK;
}

k3_status k3_model_load_resident(k3_model *m, int64_t max_bytes, int64_t *copied, k3_error *err) {
    const k3_config *c = &m->cfg;
    *copied = 0;
    for (int step = 0; step < 2; step++) { /* 0 counts, 1 copies */
        const bool dry = step == 0;
        int64_t bytes = 0;
        k3_status s = copy_mat(m, &m->lm_head, true, dry, &bytes, err);
        for (int i = 0; i < c->n_layers && !s; i++) {
            k3_layer *L = &m->layers[i];
            k3_mat *mats[32];
            const int n = runtime_mats(c, L, mats);
            for (int k = 0; k < n && !s; k++)
                s = copy_mat(m, mats[k], views_on_strips(c, L, mats[k]), dry, &bytes, err);
            if (!s) s = copy_mat(m, &L->router, true, dry, &bytes, err);
            for (int e = 0; L->moe && e < c->n_experts && !s; e++) {
                s = copy_mat(m, &L->exp_gate[e], true, dry, &bytes, err);
                if (!s) s = copy_mat(m, &L->exp_up[e], true, dry, &bytes, err);
                if (!s) s = copy_mat(m, &L->exp_down[e], true, dry, &bytes, err);
            }
        }
        if (s) return s;
        if (dry && max_bytes > 0 && bytes > max_bytes) return K3_OK;
        if (!dry) *copied = bytes;
    }
    return K3_OK;
}

/* ---- the work of a prefill by operator ------------------------------------------ */

static double mm2(const k3_mat *w) { return w && w->data ? 2.0 * (double)w->rows * (double)w->cols : 0.0; }

void k3_model_prof_flops(const k3_model *m, int64_t tokens, double flops[K3_PROF_COUNT]) {
    const k3_config *c = &m->cfg;
    const double T = (double)tokens;
    for (int i = 0; i < K3_PROF_COUNT; i++) flops[i] = 0.0;
    for (int i = 0; i < c->n_layers; i++) {
        const k3_layer *L = &m->layers[i];
        if (L->kind == K3_LAYER_KDA) {
            double f = L->kda_in.data ? mm2(&L->kda_in)
                                      : mm2(&L->q_proj) + mm2(&L->k_proj) + mm2(&L->v_proj) + mm2(&L->f_a) +
                    mm2(&L->b_proj) + (c->kda_full_rank_gate ? mm2(&L->g_proj) : 0.0);
            f += mm2(&L->f_b) + (c->kda_full_rank_gate ? 0.0 : mm2(&L->g_a) + mm2(&L->g_b)) + mm2(&L->o_proj);
            /* the recurrence: decay, k^T S, the rank-one update and q S, ~4 dk dv a head */
            f += 4.0 * c->kda_heads * (double)c->kda_head_dim * c->kda_head_dim;
            flops[K3_PROF_KDA] += f * T;
        } else {
            const double H = c->n_heads, kvl = c->kv_lora_rank, nope = c->qk_nope_dim, rope = c->qk_rope_dim,
                         vd = c->v_head_dim;
            double pre = L->mla_down.data ? mm2(&L->mla_down)
                                          : mm2(&L->q_a) + mm2(&L->kv_a) + mm2(&L->idx_wk) + mm2(&L->idx_weights);
            pre += mm2(&L->q_b) + mm2(&L->idx_wq_b) + 2.0 * H * kvl * nope;
            flops[K3_PROF_MLAPO] += pre * T;
            /* the keys token t sees: t + 1; the slots it attends: at most index_topk under DSA */
            const double keys = T * (T + 1) / 2;
            double att = keys;
            if (L->kind == K3_LAYER_DSA && c->index_topk > 0 && T > c->index_topk) {
                const double k = c->index_topk;
                att = k * (k + 1) / 2 + (T - k) * k;
            }
            if (L->kind == K3_LAYER_DSA)
                flops[K3_PROF_QLI] += 2.0 * c->index_n_heads * (double)c->index_head_dim * keys;
            flops[K3_PROF_QSFA] += 2.0 * H * (2 * kvl + rope) * att;
            flops[K3_PROF_MLA_OUT] += (2.0 * H * vd * kvl + mm2(&L->g_proj) + mm2(&L->o_proj)) * T;
        }
        if (L->moe) {
            double moe = mm2(&L->router) + mm2(&L->lat_up);
            moe += L->moe_in.data ? mm2(&L->moe_in) : mm2(&L->lat_down);
            moe += c->n_experts_per_tok * (mm2(&L->exp_gate[0]) + mm2(&L->exp_up[0]) + mm2(&L->exp_down[0]));
            flops[K3_PROF_MOE] += moe * T;
            double sh = mm2(&L->sh_down);
            if (!L->moe_in.data) sh += L->sh_gu.data ? mm2(&L->sh_gu) : mm2(&L->sh_gate) + mm2(&L->sh_up);
            flops[K3_PROF_FFN] += sh * T;
        } else {
            flops[K3_PROF_FFN] +=
                ((L->ffn_gu.data ? mm2(&L->ffn_gu) : mm2(&L->ffn_gate) + mm2(&L->ffn_up)) + mm2(&L->ffn_down)) * T;
        }
    }
    flops[K3_PROF_HEAD] = mm2(&m->lm_head); /* the last token's logits */
}
