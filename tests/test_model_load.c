/*
 * test_model_load.c -- k3_model_open on the tiny checkpoints of
 * tests/models/ (written by tools/make_checkpoint.py), on corrupted copies of
 * them (wrong shape, wrong dtype, a NaN E8M0 scale, a missing tensor, a
 * truncated shard), and on a small Kimi-Linear-family checkpoint written here
 * (no AttnRes, BF16 experts, low-rank KDA gate, q_proj, tied embeddings, no
 * `language_model.` prefix).
 */
#include "test.h"
#include "common/error.h"
#include "model/model.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TINY "tests/models/tiny"
#define TINY_DSA "tests/models/tiny-dsa"

/* ---- file helpers ------------------------------------------------------------ */

static uint8_t *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(len > 0 ? (size_t)len : 1);
    *n = b ? fread(b, 1, (size_t)len, f) : 0;
    fclose(f);
    return b;
}

static bool write_all(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(data, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

static void path_in(char *buf, size_t size, const char *dir, const char *name) {
    snprintf(buf, size, "%s/%s", dir, name);
}

/* A fresh temp dir holding copies of src's config.json and model.safetensors. */
static bool copy_ckpt(const char *src, char *dir) {
    strcpy(dir, "/tmp/k3-model-XXXXXX");
    if (!mkdtemp(dir)) return false;
    static const char *const names[] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        char from[512], to[512];
        path_in(from, sizeof from, src, names[i]);
        path_in(to, sizeof to, dir, names[i]);
        size_t n;
        uint8_t *b = read_all(from, &n);
        bool ok = b && write_all(to, b, n);
        free(b);
        if (!ok) return false;
    }
    return true;
}

static void rm_ckpt(const char *dir) {
    char p[512];
    path_in(p, sizeof p, dir, "config.json");
    unlink(p);
    path_in(p, sizeof p, dir, "model.safetensors");
    unlink(p);
    rmdir(dir);
}

/* Rewrites DIR/model.safetensors with its header passed through edit(); the
 * data area is kept byte for byte (offsets are relative to it). */
typedef void (*header_edit)(json_t *header, void *ctx);
static bool edit_header(const char *dir, header_edit edit, void *ctx) {
    char p[512];
    path_in(p, sizeof p, dir, "model.safetensors");
    size_t n;
    uint8_t *b = read_all(p, &n);
    if (!b || n < 8) return false;
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--) h = h << 8 | b[i];
    json_t *j = json_loadb((const char *)b + 8, (size_t)h, 0, NULL);
    if (!j) return false;
    edit(j, ctx);
    char *text = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    size_t hl = strlen(text), data = n - 8 - (size_t)h;
    uint8_t *o = malloc(8 + hl + data);
    for (int i = 0; i < 8; i++) o[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(o + 8, text, hl);
    memcpy(o + 8 + hl, b + 8 + h, data);
    bool ok = write_all(p, o, 8 + hl + data);
    free(text);
    free(o);
    free(b);
    return ok;
}

/* Opens dir, expecting failure with status and a message containing needle. */
static void expect_open_fails(const char *dir, k3_status want, const char *needle, const char *file, int line) {
    k3_model *m;
    k3_error e;
    k3_err_clear(&e);
    k3_status s = k3_model_open(&m, dir, &e);
    if (s != want) k3_test_fail(file, line, "status %d (%s), want %d", (int)s, e.msg, (int)want);
    if (!strstr(e.msg, needle)) k3_test_fail(file, line, "message '%s' lacks '%s'", e.msg, needle);
    if (m) k3_model_close(m);
}
#define EXPECT_OPEN_FAILS(dir, want, needle) expect_open_fails(dir, want, needle, __FILE__, __LINE__)

/* ---- the tiny checkpoints ------------------------------------------------------ */

static bool have(const char *dir) {
    char p[512];
    path_in(p, sizeof p, dir, "model.safetensors");
    return access(p, R_OK) == 0;
}

/* Parameters and bytes of a set, counted independently of the loader:
 * MXFP4 packed bytes hold 2 parameters each, scales none. */
static void st_totals(const k3_st *st, int64_t *params, int64_t *bytes) {
    *params = *bytes = 0;
    for (int64_t i = 0; i < k3_st_count(st); i++) {
        const k3_st_tensor *t = k3_st_at(st, i);
        int64_t n = 1;
        for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
        size_t len = strlen(t->name);
        if (len > 13 && !strcmp(t->name + len - 13, ".weight_scale")) n = 0;
        else if (len > 14 && !strcmp(t->name + len - 14, ".weight_packed")) n *= 2;
        *params += n;
        *bytes += (int64_t)t->nbytes;
    }
}

static float bf16_at(const k3_st_tensor *t, int64_t i) {
    uint16_t h;
    memcpy(&h, t->data + 2 * i, 2);
    return k3_bf16_to_f32(h);
}

K3_TEST(model_load_tiny) {
    if (!have(TINY)) SKIP("%s is not built (tools/make_checkpoint.py)", TINY);
    k3_model *m;
    k3_error e;
    k3_err_clear(&e);
    REQUIREF(k3_model_open(&m, TINY, &e) == K3_OK, "%s", e.msg);
    k3_model_info in;
    k3_model_get_info(m, &in);
    CHECK(!strcmp(in.model_type, "kimi_k3"));
    CHECK(in.vocab_size == 1024 && in.hidden_size == 256 && in.n_layers == 8);
    CHECK(in.n_kda == 6 && in.n_mla == 2 && in.n_dsa == 0 && in.max_positions == 4096);
    CHECK(in.cache_bytes_per_token == 2 * (64 + 16) * 4);
    CHECK(in.state_bytes_per_seq == 6 * (4 * 32 * 32 + 3 * 4 * 32 * 3) * 4);

    int64_t params, bytes;
    st_totals(m->st, &params, &bytes);
    CHECKF(in.n_params == params, "n_params %lld, want %lld", (long long)in.n_params, (long long)params);
    CHECKF(in.weight_bytes == bytes, "weight_bytes %lld, want %lld", (long long)in.weight_bytes, (long long)bytes);
    /* Per token: 4 of 16 experts in each of the 7 MoE layers, one embedding row. */
    int64_t exp_params = 7 * 16 * (3 * 64 * 128), exp_bytes = 7 * 16 * 3 * (64 * 64 + 64 * 4);
    CHECK(in.n_params_active == params - exp_params * 12 / 16 - 1023 * 256);
    CHECK(in.bytes_per_token == bytes - exp_bytes * 12 / 16 - 1023 * 256 * 2);

    /* Layer structure. */
    static const uint8_t kinds[8] = {0, 0, 0, 1, 0, 0, 0, 1};
    for (int i = 0; i < 8; i++) {
        const k3_layer *L = &m->layers[i];
        CHECKF(L->kind == kinds[i] && L->moe == (i > 0), "layer %d", i);
        CHECKF(L->input_norm && L->post_attn_norm && L->attn_res_w && L->mlp_res_w, "layer %d", i);
        CHECKF(L->o_proj.rows == 256 && L->o_proj.data, "layer %d", i);
        if (L->kind == K3_LAYER_KDA)
            CHECKF(L->q_proj.rows == 128 && L->q_proj.cols == 256 && L->A_log && L->q_conv && L->g_proj.rows == 128 &&
                       L->f_b.cols == 32 && !L->wuk_t,
                   "layer %d", i);
        else
            CHECKF(L->q_a.rows == 64 && L->q_b.rows == 4 * 48 && L->kv_b.rows == 4 * 64 && L->kv_a.rows == 80 &&
                       L->wuk_t && L->g_proj.rows == 128 && !L->idx_wk.data,
                   "layer %d", i);
    }
    const k3_layer *L1 = &m->layers[1];
    CHECK(L1->exp_gate && L1->exp_gate[15].type == K3_W_MXFP4);
    CHECK(L1->exp_gate[15].rows == 64 && L1->exp_gate[15].cols == 128 && L1->exp_gate[15].scale);
    CHECK(L1->exp_down[3].rows == 128 && L1->exp_down[3].cols == 64);
    CHECK(L1->router.rows == 16 && L1->router_bias && L1->lat_down.rows == 128 && L1->lat_up.cols == 128 &&
          L1->lat_norm && L1->sh_gate.rows == 128);
    CHECK(m->layers[0].ffn_gate.rows == 512 && m->layers[0].ffn_down.cols == 512);
    CHECK(m->embed.type == K3_W_BF16 && m->embed.rows == 1024 && m->lm_head.data != m->embed.data);
    CHECK(m->final_norm && m->out_res_w);

    /* Derived vectors. */
    const k3_st_tensor *rn = k3_st_get(m->st, "language_model.model.layers.2.mlp_res_norm.weight");
    const k3_st_tensor *rp = k3_st_get(m->st, "language_model.model.layers.2.mlp_res_proj.weight");
    REQUIRE(rn && rp);
    double err = 0;
    for (int d = 0; d < 256; d++) err = fmax(err, fabs(m->layers[2].mlp_res_w[d] - bf16_at(rn, d) * bf16_at(rp, d)));
    CHECK(err == 0);
    const k3_st_tensor *kb = k3_st_get(m->st, "language_model.model.layers.7.self_attn.kv_b_proj.weight");
    REQUIRE(kb);
    int bad = 0;
    for (int h = 0; h < 4; h++) /* wuk_t[h][c][d] = kv_b[h*(nope+v)+d][c] */
        for (int c = 0; c < 64; c += 5)
            for (int d = 0; d < 32; d += 3)
                bad += m->layers[7].wuk_t[(h * 64 + c) * 32 + d] != bf16_at(kb, (h * 64 + d) * 64 + c);
    CHECK(bad == 0);
    const k3_st_tensor *al = k3_st_get(m->st, "language_model.model.layers.0.self_attn.A_log");
    REQUIRE(al && al->shape[0] == 32);
    for (int h = 0; h < 4; h++) {
        float want;
        memcpy(&want, al->data + 4 * h, 4);
        CHECK(m->layers[0].A_log[h] == want);
    }

    /* The description. */
    char buf[4096];
    size_t n = k3_model_describe(m, buf, sizeof buf);
    CHECK(n > 0 && n < sizeof buf && strlen(buf) == n);
    CHECKF(strstr(buf, "layers: 0:KDA* 1:KDA 2:KDA 3:MLA* 4:KDA 5:KDA 6:KDA* 7:MLA\n"), "%s", buf);
    CHECKF(strstr(buf, "ffn: 0:dense 1-7:MoE"), "%s", buf);
    CHECK(strstr(buf, "kimi_k3") && strstr(buf, "MXFP4"));
    char small[16];
    CHECK(k3_model_describe(m, small, sizeof small) == n && strlen(small) == 15);
    k3_model_close(m);
}

K3_TEST(model_load_tiny_dsa) {
    if (!have(TINY_DSA)) SKIP("%s is not built (tools/make_checkpoint.py)", TINY_DSA);
    k3_model *m;
    k3_error e;
    k3_err_clear(&e);
    REQUIREF(k3_model_open(&m, TINY_DSA, &e) == K3_OK, "%s", e.msg);
    k3_model_info in;
    k3_model_get_info(m, &in);
    CHECK(in.n_kda == 6 && in.n_mla == 0 && in.n_dsa == 2);
    CHECK(in.cache_bytes_per_token == 2 * (64 + 16 + 32) * 4);
    for (int i = 3; i < 8; i += 4) {
        const k3_layer *L = &m->layers[i];
        CHECKF(L->kind == K3_LAYER_DSA && L->idx_wq_b.rows == 64 && L->idx_wq_b.cols == 64 && L->idx_wk.rows == 32 &&
                   L->idx_wk.cols == 256 && L->idx_k_norm_w && L->idx_k_norm_b && L->idx_weights.rows == 2 && L->wuk_t,
               "layer %d", i);
    }
    char buf[4096];
    k3_model_describe(m, buf, sizeof buf);
    CHECKF(strstr(buf, "3:DSA* ") && strstr(buf, "7:DSA\n"), "%s", buf);
    k3_model_close(m);
}

/* ---- corrupted copies ------------------------------------------------------- */

typedef struct edit {
    const char *name;  /* tensor */
    const char *dtype; /* new dtype or NULL */
    int64_t shape[2];  /* new 2-D shape when shape[0] > 0 */
    bool remove;
    bool strip_prefix; /* drop "language_model." from every name */
} edit;

static void apply_edit(json_t *h, void *ctx) {
    const edit *ed = ctx;
    if (ed->strip_prefix) {
        json_t *n = json_object();
        const char *k;
        json_t *v;
        json_object_foreach(h, k, v) {
            const char *p = "language_model.";
            json_object_set(n, strncmp(k, p, strlen(p)) ? k : k + strlen(p), v);
        }
        json_object_clear(h);
        json_object_update(h, n);
        json_decref(n);
        return;
    }
    if (ed->remove) {
        json_object_del(h, ed->name);
        return;
    }
    json_t *t = json_object_get(h, ed->name);
    if (!t) return;
    if (ed->dtype) json_object_set_new(t, "dtype", json_string(ed->dtype));
    if (ed->shape[0] > 0)
        json_object_set_new(t, "shape", json_pack("[II]", (json_int_t)ed->shape[0], (json_int_t)ed->shape[1]));
}

#define P "language_model.model.layers."

K3_TEST(model_load_bad_shape) {
    if (!have(TINY)) SKIP("%s is not built (tools/make_checkpoint.py)", TINY);
    char dir[64];
    REQUIRE(copy_ckpt(TINY, dir));
    /* Same byte count, so the file stays valid safetensors. */
    edit ed = {.name = P "3.self_attn.q_b_proj.weight", .shape = {96, 128}};
    REQUIRE(edit_header(dir, apply_edit, &ed));
    EXPECT_OPEN_FAILS(dir, K3_ERR_SHAPE,
                      "tensor '" P "3.self_attn.q_b_proj.weight': expected "
                      "shape [192, 64], got [96, 128]");
    rm_ckpt(dir);
}

K3_TEST(model_load_bad_dtype) {
    if (!have(TINY)) SKIP("%s is not built (tools/make_checkpoint.py)", TINY);
    char dir[64];
    REQUIRE(copy_ckpt(TINY, dir));
    edit ed = {.name = "language_model.model.embed_tokens.weight", .dtype = "U8", .shape = {1024, 512}};
    REQUIRE(edit_header(dir, apply_edit, &ed));
    EXPECT_OPEN_FAILS(dir, K3_ERR_SHAPE, "embed_tokens.weight': dtype U8 is not allowed");
    rm_ckpt(dir);
    /* Experts must be packed U8. */
    REQUIRE(copy_ckpt(TINY, dir));
    edit ed2 = {.name = P "4.block_sparse_moe.experts.2.w2.weight_packed", .dtype = "I8"};
    REQUIRE(edit_header(dir, apply_edit, &ed2));
    EXPECT_OPEN_FAILS(dir, K3_ERR_SHAPE, "experts.2.w2.weight_packed': dtype I8");
    rm_ckpt(dir);
}

K3_TEST(model_load_missing_tensor) {
    if (!have(TINY)) SKIP("%s is not built (tools/make_checkpoint.py)", TINY);
    char dir[64];
    REQUIRE(copy_ckpt(TINY, dir));
    edit ed = {.name = P "4.self_attn.dt_bias", .remove = true};
    REQUIRE(edit_header(dir, apply_edit, &ed));
    EXPECT_OPEN_FAILS(dir, K3_ERR_FORMAT, "missing tensor '" P "4.self_attn.dt_bias'");
    rm_ckpt(dir);
    REQUIRE(copy_ckpt(TINY, dir));
    edit ed2 = {.name = P "5.block_sparse_moe.experts.9.w3.weight_scale", .remove = true};
    REQUIRE(edit_header(dir, apply_edit, &ed2));
    EXPECT_OPEN_FAILS(dir, K3_ERR_FORMAT, "missing tensor '" P "5.block_sparse_moe.experts.9.w3.weight_scale'");
    rm_ckpt(dir);
}

K3_TEST(model_load_nan_scale) {
    if (!have(TINY)) SKIP("%s is not built (tools/make_checkpoint.py)", TINY);
    char dir[64];
    REQUIRE(copy_ckpt(TINY, dir));
    /* Find the scale tensor's bytes in the file and set row 7, block 2 to 255. */
    k3_st *st;
    k3_error e;
    k3_err_clear(&e);
    REQUIRE(k3_st_open(&st, dir, &e) == K3_OK);
    const char *name = P "2.block_sparse_moe.experts.5.w3.weight_scale";
    const k3_st_tensor *t = k3_st_get(st, name);
    REQUIRE(t && t->shape[1] == 4);
    /* Offset in the file = data - mapping start: find it through the header. */
    char p[512];
    path_in(p, sizeof p, dir, "model.safetensors");
    size_t n;
    uint8_t *b = read_all(p, &n);
    REQUIRE(b);
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--) h = h << 8 | b[i];
    json_t *j = json_loadb((const char *)b + 8, (size_t)h, 0, NULL);
    REQUIRE(j);
    json_int_t begin = json_integer_value(json_array_get(json_object_get(json_object_get(j, name), "data_offsets"), 0));
    json_decref(j);
    k3_st_close(st);
    b[8 + h + (size_t)begin + 7 * 4 + 2] = 255;
    REQUIRE(write_all(p, b, n));
    free(b);
    k3_model *m;
    k3_err_clear(&e);
    CHECK(k3_model_open(&m, dir, &e) == K3_ERR_FORMAT && m == NULL);
    CHECKF(strstr(e.msg, name) && strstr(e.msg, "255") && strstr(e.msg, "row 7") && strstr(e.msg, "block 2"), "%s",
           e.msg);
    rm_ckpt(dir);
}

K3_TEST(model_load_truncated) {
    if (!have(TINY)) SKIP("%s is not built (tools/make_checkpoint.py)", TINY);
    char dir[64];
    REQUIRE(copy_ckpt(TINY, dir));
    char p[512];
    path_in(p, sizeof p, dir, "model.safetensors");
    struct stat sb;
    REQUIRE(stat(p, &sb) == 0);
    REQUIRE(truncate(p, sb.st_size - 1000) == 0);
    EXPECT_OPEN_FAILS(dir, K3_ERR_FORMAT, "run past the end of the file");
    rm_ckpt(dir);
}

K3_TEST(model_load_missing_files) {
    EXPECT_OPEN_FAILS("/nonexistent/k3-model", K3_ERR_IO, "/nonexistent/k3-model");
    char dir[] = "/tmp/k3-model-XXXXXX";
    REQUIRE(mkdtemp(dir));
    EXPECT_OPEN_FAILS(dir, K3_ERR_IO, "config.json");
    rmdir(dir);
}

K3_TEST(model_load_unprefixed) {
    if (!have(TINY)) SKIP("%s is not built (tools/make_checkpoint.py)", TINY);
    char dir[64];
    REQUIRE(copy_ckpt(TINY, dir));
    edit ed = {.strip_prefix = true};
    REQUIRE(edit_header(dir, apply_edit, &ed));
    k3_model *m;
    k3_error e;
    k3_err_clear(&e);
    CHECKF(k3_model_open(&m, dir, &e) == K3_OK, "%s", e.msg);
    if (m) {
        CHECK(k3_st_get(m->st, "model.embed_tokens.weight") && m->layers[7].wuk_t);
        k3_model_close(m);
    }
    /* Messages use the checkpoint's own spelling. */
    edit ed2 = {.name = "model.layers.1.input_layernorm.weight", .remove = true};
    REQUIRE(edit_header(dir, apply_edit, &ed2));
    EXPECT_OPEN_FAILS(dir, K3_ERR_FORMAT, "missing tensor 'model.layers.1.input_layernorm.weight'");
    rm_ckpt(dir);
}

/* ---- a Kimi-Linear-family checkpoint, written here ----------------------------- */

typedef struct writer {
    json_t *header;
    uint8_t *data;
    size_t size, cap;
} writer;

/* Adds a tensor of the given dtype/shape filled with a deterministic pattern
 * (BF16 values in [-1, 1]). */
static void add(writer *w, const char *name, k3_dtype dt, int ndim, const int64_t *shape) {
    size_t es = k3_dtype_size(dt), n = 1;
    json_t *sh = json_array();
    for (int i = 0; i < ndim; i++) {
        n *= (size_t)shape[i];
        json_array_append_new(sh, json_integer(shape[i]));
    }
    size_t bytes = n * es;
    if (w->size + bytes > w->cap) {
        w->cap = (w->size + bytes) * 2;
        w->data = realloc(w->data, w->cap);
    }
    for (size_t i = 0; i < n; i++) {
        float v = (float)((int)((i * 2654435761u + w->size) % 2001) - 1000) / 1000.0f;
        if (dt == K3_DTYPE_BF16) {
            uint16_t h = k3_f32_to_bf16(v);
            memcpy(w->data + w->size + 2 * i, &h, 2);
        } else {
            memcpy(w->data + w->size + 4 * i, &v, 4);
        }
    }
    json_object_set_new(w->header, name,
                        json_pack("{s:s, s:o, s:[II]}", "dtype", k3_dtype_name(dt), "shape", sh, "data_offsets",
                                  (json_int_t)w->size, (json_int_t)(w->size + bytes)));
    w->size += bytes;
}

static void add2(writer *w, const char *name, int64_t r, int64_t c) {
    int64_t s[2] = {r, c};
    add(w, name, K3_DTYPE_BF16, 2, s);
}
static void add1(writer *w, const char *name, int64_t n) { add(w, name, K3_DTYPE_F32, 1, &n); }

static const char *linear_config =
    "{\"architectures\": [\"KimiLinearForCausalLM\"], \"model_type\": \"kimi_linear\","
    " \"vocab_size\": 96, \"hidden_size\": 32, \"num_hidden_layers\": 3,"
    " \"num_attention_heads\": 2, \"num_key_value_heads\": 2, \"q_lora_rank\": null,"
    " \"kv_lora_rank\": 16, \"qk_nope_head_dim\": 8, \"qk_rope_head_dim\": 4, \"v_head_dim\": 8,"
    " \"mla_use_nope\": true, \"hidden_act\": \"silu\", \"intermediate_size\": 48,"
    " \"linear_attn_config\": {\"num_heads\": 2, \"head_dim\": 8, \"short_conv_kernel_size\": 4,"
    "   \"kda_layers\": [1, 2], \"full_attn_layers\": [3]},"
    " \"first_k_dense_replace\": 1, \"num_experts\": 4, \"num_experts_per_token\": 2,"
    " \"num_shared_experts\": 1, \"moe_intermediate_size\": 16,"
    " \"tie_word_embeddings\": true, \"rms_norm_eps\": 1e-6}";

static bool write_linear(const char *dir) {
    enum { D = 32, H = 2, DK = 8, HD = 16, E = 4, IM = 16, V = 96 };
    writer w = {.header = json_object()};
    char n[160];
    add2(&w, "model.embed_tokens.weight", V, D);
    add1(&w, "model.norm.weight", D);
    for (int i = 0; i < 3; i++) {
#define N(fmt) (snprintf(n, sizeof n, "model.layers.%d." fmt, i), n)
        add1(&w, N("input_layernorm.weight"), D);
        add1(&w, N("post_attention_layernorm.weight"), D);
        if (i < 2) {
            add2(&w, N("self_attn.q_proj.weight"), HD, D);
            add2(&w, N("self_attn.k_proj.weight"), HD, D);
            add2(&w, N("self_attn.v_proj.weight"), HD, D);
            add2(&w, N("self_attn.o_proj.weight"), D, HD);
            int64_t conv[3] = {HD, 1, 4}, alog[4] = {1, 1, H, 1};
            add(&w, N("self_attn.q_conv1d.weight"), K3_DTYPE_F32, 3, conv);
            add(&w, N("self_attn.k_conv1d.weight"), K3_DTYPE_F32, 3, conv);
            add(&w, N("self_attn.v_conv1d.weight"), K3_DTYPE_F32, 3, conv);
            add(&w, N("self_attn.A_log"), K3_DTYPE_F32, 4, alog);
            add1(&w, N("self_attn.dt_bias"), HD);
            add2(&w, N("self_attn.f_a_proj.weight"), DK, D);
            add2(&w, N("self_attn.f_b_proj.weight"), HD, DK);
            add2(&w, N("self_attn.g_a_proj.weight"), DK, D);
            add2(&w, N("self_attn.g_b_proj.weight"), HD, DK);
            add2(&w, N("self_attn.b_proj.weight"), H, D);
            add1(&w, N("self_attn.o_norm.weight"), DK);
        } else {
            add2(&w, N("self_attn.q_proj.weight"), H * 12, D);
            add2(&w, N("self_attn.kv_a_proj_with_mqa.weight"), 16 + 4, D);
            add1(&w, N("self_attn.kv_a_layernorm.weight"), 16);
            add2(&w, N("self_attn.kv_b_proj.weight"), H * 16, 16);
            add2(&w, N("self_attn.o_proj.weight"), D, H * 8);
        }
        if (i == 0) {
            add2(&w, N("mlp.gate_proj.weight"), 48, D);
            add2(&w, N("mlp.up_proj.weight"), 48, D);
            add2(&w, N("mlp.down_proj.weight"), D, 48);
        } else {
            add2(&w, N("block_sparse_moe.gate.weight"), E, D);
            add1(&w, N("block_sparse_moe.gate.e_score_correction_bias"), E);
            add2(&w, N("block_sparse_moe.shared_experts.gate_proj.weight"), IM, D);
            add2(&w, N("block_sparse_moe.shared_experts.up_proj.weight"), IM, D);
            add2(&w, N("block_sparse_moe.shared_experts.down_proj.weight"), D, IM);
            for (int e = 0; e < E; e++) {
                snprintf(n, sizeof n, "model.layers.%d.block_sparse_moe.experts.%d.w1.weight", i, e);
                add2(&w, n, IM, D);
                snprintf(n, sizeof n, "model.layers.%d.block_sparse_moe.experts.%d.w3.weight", i, e);
                add2(&w, n, IM, D);
                snprintf(n, sizeof n, "model.layers.%d.block_sparse_moe.experts.%d.w2.weight", i, e);
                add2(&w, n, D, IM);
            }
        }
#undef N
    }
    /* Tensors a text engine must skip. */
    add2(&w, "vision_tower.patch_embed.weight", 4, 4);
    add2(&w, "mm_projector.proj.weight", 4, 4);
    char *text = json_dumps(w.header, JSON_COMPACT);
    size_t hl = strlen(text);
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    char p[512];
    path_in(p, sizeof p, dir, "model.safetensors");
    FILE *f = fopen(p, "wb");
    bool ok = f && fwrite(len, 1, 8, f) == 8 && fwrite(text, 1, hl, f) == hl && fwrite(w.data, 1, w.size, f) == w.size;
    if (f) ok = fclose(f) == 0 && ok;
    path_in(p, sizeof p, dir, "config.json");
    ok = ok && write_all(p, linear_config, strlen(linear_config));
    free(text);
    free(w.data);
    json_decref(w.header);
    return ok;
}

K3_TEST(model_load_kimi_linear) {
    char dir[] = "/tmp/k3-model-XXXXXX";
    REQUIRE(mkdtemp(dir));
    REQUIRE(write_linear(dir));
    k3_model *m;
    k3_error e;
    k3_err_clear(&e);
    k3_status s = k3_model_open(&m, dir, &e);
    CHECKF(s == K3_OK, "%s", e.msg);
    if (s == K3_OK) {
        k3_model_info in;
        k3_model_get_info(m, &in);
        CHECK(!strcmp(in.model_type, "kimi_linear") && in.n_kda == 2 && in.n_mla == 1);
        CHECK(m->lm_head.data == m->embed.data && !m->out_res_w);
        const k3_layer *L0 = &m->layers[0], *L2 = &m->layers[2];
        CHECK(!L0->attn_res_w && L0->g_a.rows == 8 && L0->g_b.cols == 8 && !L0->g_proj.data);
        CHECK(L0->A_log && L0->ffn_gate.rows == 48);
        CHECK(L2->q_b.rows == 24 && L2->q_b.cols == 32 && !L2->q_a.data && !L2->g_proj.data);
        CHECK(L2->exp_gate[3].type == K3_W_BF16 && L2->exp_gate[3].rows == 16 && L2->exp_gate[3].cols == 32 &&
              L2->exp_down[0].rows == 32);
        CHECK(!L2->lat_down.data && L2->sh_gate.rows == 16 && L2->router_bias);
        /* Vision tensors are not text parameters; the tied head counts once
         * and is read in full per token. */
        int64_t vis = 2 * 16;
        int64_t params, bytes;
        st_totals(m->st, &params, &bytes);
        CHECK(in.n_params == params - vis);
        int64_t exp = 2 * 4 * 3 * 16 * 32; /* params of all experts; BF16 */
        CHECK(in.n_params_active == params - vis - exp / 2);
        CHECK(in.weight_bytes == bytes - 2 * vis);
        CHECK(in.bytes_per_token == bytes - 2 * vis - exp); /* half the experts, 2 B each */
        CHECK(in.cache_bytes_per_token == (16 + 4) * 4);
        CHECK(in.state_bytes_per_seq == 2 * (2 * 8 * 8 + 3 * 2 * 8 * 3) * 4);
        char buf[2048];
        k3_model_describe(m, buf, sizeof buf);
        CHECKF(strstr(buf, "layers: 0:KDA 1:KDA 2:MLA\n") && strstr(buf, "Kimi-Linear"), "%s", buf);
        k3_model_close(m);
    }
    /* The same files without tie_word_embeddings need an lm_head. */
    char p[512];
    path_in(p, sizeof p, dir, "config.json");
    const char *t = strstr(linear_config, "true, \"rms");
    REQUIRE(t);
    size_t pre = (size_t)(t - linear_config);
    char *cfg = malloc(strlen(linear_config) + 2);
    memcpy(cfg, linear_config, pre);
    strcpy(cfg + pre, "false");
    strcpy(cfg + pre + 5, t + 4);
    REQUIRE(write_all(p, cfg, strlen(cfg)));
    free(cfg);
    EXPECT_OPEN_FAILS(dir, K3_ERR_FORMAT, "missing tensor 'lm_head.weight'");
    rm_ckpt(dir);
}
