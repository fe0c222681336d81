/* test_vision.c -- the vision path against Moonshot's own code, through the
 * goldens of tests/golden/vision (tools/official_vision.py; see the README
 * there): the K3 image processor (pixel values to 1e-6, grids, token
 * counts), the MoonViT3d tower + sd2_tpool + patchmergerv2 (rel-L2 1e-5 in
 * fp32), the position-table resize in both interpolation modes, and
 * whole-model logits with two images in the prompt (rel-L2 1e-5, same greedy
 * tokens); WEBP and GIF first frames against Pillow and the processor. Then
 * bad input: malformed, truncated and oversized images, a checkpoint without
 * a tower. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "k3.h"
#include "kernels/kernels_isa.h"
#include "model/safetensors.h"
#include "test.h"
#include "vision/vision.h"

#define VDIR "tests/models/vision-tiny"
#define GDIR "tests/golden/vision"

static const char *const images[] = {"rgb_200x130.png",     "rgba_180x150.png",    "grey_300x40.png",
                                     "photo_67x45.jpg",     "palette_170x101.png", "rgb_112x112.png",
                                     "dot_5x3.png",         "tall_60x400.png",     "bw_130x90.png",
                                     "grey2bit_150x70.png", "greykey_120x100.png", "la_140x95.png",
                                     "rgbkey_160x80.png",   "grey_150x80.jpg"};
enum { N_IMAGES = sizeof images / sizeof images[0] };

typedef struct golden {
    k3_st *st;
    uint8_t *buf;
} golden;

static uint8_t *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(size > 0 ? (size_t)size : 1);
    if (b && fread(b, 1, (size_t)size, f) != (size_t)size) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *n = (size_t)size;
    return b;
}

static bool golden_open(golden *g) {
    memset(g, 0, sizeof *g);
    size_t n = 0;
    k3_error err = {0};
    g->buf = read_file(GDIR "/vision.safetensors", &n);
    if (!g->buf) {
        k3_test_fail(__FILE__, __LINE__, "cannot read " GDIR "/vision.safetensors (see its README)");
        return false;
    }
    if (k3_st_init(&g->st, &err) || k3_st_parse(g->st, g->buf, n, 0, GDIR "/vision.safetensors", &err)) {
        k3_test_fail(__FILE__, __LINE__, "golden: %s", err.msg);
        return false;
    }
    return true;
}

static void golden_close(golden *g) {
    k3_st_close(g->st);
    free(g->buf);
}

static const k3_st_tensor *gt(const golden *g, const char *name, k3_dtype dt) {
    const k3_st_tensor *t = k3_st_get(g->st, name);
    if (!t || t->dtype != dt)
        k3_test_fail(__FILE__, __LINE__, "golden tensor %s missing or not %s", name, k3_dtype_name(dt));
    return t && t->dtype == dt ? t : NULL;
}

static float *gf32(const k3_st_tensor *t) { /* aligned copy */
    float *p = malloc(t->nbytes);
    if (p) memcpy(p, t->data, t->nbytes);
    return p;
}

static int64_t gi64(const k3_st_tensor *t, int64_t i) {
    int64_t v;
    memcpy(&v, t->data + 8 * i, 8);
    return v;
}

typedef struct fixture {
    k3_model *m;
    k3_vision *v;
    k3_tokenizer *tok;
} fixture;

static bool fixture_open(fixture *f) {
    memset(f, 0, sizeof *f);
    k3_error err = {0};
    if (k3_model_open(&f->m, VDIR, &err) || k3_vision_open(&f->v, f->m, &err) ||
        k3_tokenizer_open(&f->tok, VDIR, &err)) {
        k3_test_fail(__FILE__, __LINE__, "open " VDIR ": %s", err.msg);
        return false;
    }
    return true;
}

static void fixture_close(fixture *f) {
    k3_tokenizer_free(f->tok);
    k3_vision_close(f->v);
    k3_model_close(f->m);
}

static k3_image *load_image(int i) {
    char path[256];
    snprintf(path, sizeof path, GDIR "/images/%s", images[i]);
    k3_image *im = NULL;
    k3_error err = {0};
    if (k3_image_load(&im, path, 0, &err)) k3_test_fail(__FILE__, __LINE__, "%s", err.msg);
    return im;
}

/* ---- processor ------------------------------------------------------------- */

K3_TEST(vision_preprocess_official) {
    golden g;
    fixture f;
    if (!golden_open(&g)) return;
    if (!fixture_open(&f)) goto out;
    double worst = 0;
    for (int i = 0; i < N_IMAGES; i++) {
        char name[64];
        snprintf(name, sizeof name, "img%d.grid_thw", i);
        const k3_st_tensor *tg = gt(&g, name, K3_DTYPE_I64);
        snprintf(name, sizeof name, "img%d.pixel_values", i);
        const k3_st_tensor *tp = gt(&g, name, K3_DTYPE_F32);
        k3_image *im = load_image(i);
        if (!tg || !tp || !im) {
            k3_image_free(im);
            continue;
        }
        float *px = NULL;
        k3_image_plan plan;
        k3_error err = {0};
        if (k3_vision_preprocess(f.v, im, &px, &plan, &err)) {
            k3_test_fail(__FILE__, __LINE__, "%s: %s", images[i], err.msg);
            k3_image_free(im);
            continue;
        }
        CHECKF(plan.grid_t == gi64(tg, 0) && plan.grid_h == gi64(tg, 1) && plan.grid_w == gi64(tg, 2),
               "%s: grid (%d,%d,%d), official (%lld,%lld,%lld)", images[i], plan.grid_t, plan.grid_h, plan.grid_w,
               (long long)gi64(tg, 0), (long long)gi64(tg, 1), (long long)gi64(tg, 2));
        const int64_t n = (int64_t)plan.grid_h * plan.grid_w * 3 * 14 * 14;
        CHECKF((size_t)n * 4 == tp->nbytes, "%s: %lld values, official %zu", images[i], (long long)n, tp->nbytes / 4);
        CHECKF(plan.n_tokens == plan.grid_h * plan.grid_w / 4, "%s: tokens %d", images[i], plan.n_tokens);
        if ((size_t)n * 4 == tp->nbytes) {
            float *ref = gf32(tp);
            const double e = k3_test_max_abs(px, ref, n);
            if (e > worst) worst = e;
            CHECKF(e <= 1e-6, "%s: pixel values max |diff| %.3g vs the official processor", images[i], e);
            free(ref);
        }
        /* the plan alone (what a server counts before decoding everything) */
        k3_image_plan p2;
        CHECK(k3_vision_plan(f.v, k3_image_width(im), k3_image_height(im), &p2, &err) == K3_OK);
        CHECK(p2.n_tokens == plan.n_tokens && p2.grid_h == plan.grid_h && p2.grid_w == plan.grid_w);
        free(px);
        k3_image_free(im);
    }
    printf("    processor: %d images (RGB, RGBA, LA, L, 1, 2-bit, grey/RGB keys, palette, JPEGs, 5x3, tall), pixel "
           "values max |diff| %.3g\n",
           N_IMAGES, worst);
out:
    fixture_close(&f);
    golden_close(&g);
}

/* navit_resize_image's worked examples with the published budget (docs/vision.md §2.2). */
K3_TEST(vision_resize_plan_published) {
    k3_image_proc p;
    k3_image_proc_defaults(&p);
    static const int32_t cases[][7] = {
        /* w, h, new_w, new_h, grid_h, grid_w, tokens */
        {225, 223, 225, 223, 16, 18, 72},          {100, 100, 100, 100, 8, 8, 16},
        {1024, 1024, 1024, 1024, 74, 74, 1369},    {1920, 1080, 1920, 1080, 78, 138, 2691},
        {4000, 3000, 4000, 3000, 216, 286, 15444}, {10000, 100, 7168, 71, 6, 512, 768},
        {8000, 8000, 3586, 3586, 258, 258, 16641}, {1861, 7041, 1850, 7002, 502, 134, 16817},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const int32_t *c = cases[i];
        k3_resize_plan r;
        k3_error err = {0};
        REQUIRE(k3_image_proc_plan(&p, c[0], c[1], &r, &err) == K3_OK);
        CHECKF(r.new_w == c[2] && r.new_h == c[3] && r.grid_h == c[4] && r.grid_w == c[5] && r.n_tokens == c[6],
               "%dx%d: got %dx%d grid %dx%d tokens %d", c[0], c[1], r.new_w, r.new_h, r.grid_h, r.grid_w, r.n_tokens);
    }
}

/* ---- tower ------------------------------------------------------------------ */

K3_TEST(vision_pos_interp_official) {
    /* the official code interpolates the table with the config's mode
     * (modeling_kimi_k3.py passes pos_emb_interpolation_mode through; one
     * port hard-codes bicubic, docs/vision.md §8.1): both modes against torch */
    golden g;
    if (!golden_open(&g)) return;
    const k3_st_tensor *tab = k3_st_get(g.st, "posemb.bilinear.5x7");
    fixture f;
    if (!tab || !fixture_open(&f)) goto out0;
    const k3_vision_config *c = &f.v->cfg;
    static const char *const modes[] = {"bilinear", "bicubic"};
    static const int32_t sizes[][2] = {{5, 7}, {12, 10}};
    for (int mi = 0; mi < 2; mi++)
        for (int si = 0; si < 2; si++) {
            char name[64];
            snprintf(name, sizeof name, "posemb.%s.%dx%d", modes[mi], sizes[si][0], sizes[si][1]);
            const k3_st_tensor *t = gt(&g, name, K3_DTYPE_F32);
            if (!t) continue;
            const int64_t n = (int64_t)sizes[si][0] * sizes[si][1] * c->hidden;
            float *o = malloc(sizeof(float) * (size_t)n), *ref = gf32(t);
            k3_vision_pos_interp(f.v->pos, c->pos_h, c->pos_w, c->hidden, sizes[si][0], sizes[si][1],
                                 mi ? K3_INTERP_BICUBIC : K3_INTERP_BILINEAR, o);
            const double e = k3_test_rel_l2(o, ref, n);
            CHECKF(e <= 1e-6, "%s: rel-L2 %.3g vs F.interpolate", name, e);
            free(o), free(ref);
        }
    fixture_close(&f);
out0:
    golden_close(&g);
}

K3_TEST(vision_tower_official) {
    golden g;
    fixture f;
    if (!golden_open(&g)) return;
    if (!fixture_open(&f)) goto out;
    k3_pool *pool = NULL;
    k3_error err = {0};
    REQUIRE(k3_pool_init(&pool, 2, &err) == K3_OK);
    const k3_st_tensor *sel = gt(&g, "tower.images", K3_DTYPE_I64);
    double worst = 0;
    for (int64_t s = 0; sel && s < sel->shape[0]; s++) {
        const int i = (int)gi64(sel, s);
        char name[64];
        snprintf(name, sizeof name, "img%d.pixel_values", i);
        const k3_st_tensor *tp = gt(&g, name, K3_DTYPE_F32);
        snprintf(name, sizeof name, "img%d.grid_thw", i);
        const k3_st_tensor *tg = gt(&g, name, K3_DTYPE_I64);
        snprintf(name, sizeof name, "tower.img%d", i);
        const k3_st_tensor *to = gt(&g, name, K3_DTYPE_F32);
        if (!tp || !tg || !to) continue;
        k3_image_plan plan = {.grid_t = (int32_t)gi64(tg, 0),
                              .grid_h = (int32_t)gi64(tg, 1),
                              .grid_w = (int32_t)gi64(tg, 2)};
        float *px = gf32(tp), *ref = gf32(to), *rows = NULL;
        if (k3_vision_encode_pixels(f.v, pool, px, &plan, &rows, &err)) {
            k3_test_fail(__FILE__, __LINE__, "%s", err.msg);
        } else {
            const int64_t n = (int64_t)plan.grid_h * plan.grid_w / 4 * k3_vision_out_dim(f.v);
            CHECK((size_t)n * 4 == to->nbytes);
            const double e = k3_test_rel_l2(rows, ref, n);
            if (e > worst) worst = e;
            CHECKF(e <= 1e-5, "image %d (grid %dx%d): tower + projector rel-L2 %.3g vs the official modules", i,
                   plan.grid_h, plan.grid_w, e);
        }
        free(px), free(ref), free(rows);
    }
    printf("    tower + projector: 4 images (grids 8x12, 8x10, 4x16, 8x8 = the table), worst rel-L2 %.3g\n", worst);
    /* attention in blocks of 7 query rows (what images over ~2900 patches get) = in one block */
    {
        const k3_st_tensor *tp0 = gt(&g, "img0.pixel_values", K3_DTYPE_F32), *to0 = gt(&g, "tower.img0", K3_DTYPE_F32);
        k3_image_plan plan = {.grid_t = 1, .grid_h = 8, .grid_w = 12};
        float *px = tp0 ? gf32(tp0) : NULL, *ref = to0 ? gf32(to0) : NULL, *rows = NULL;
        f.v->attn_rows = 7;
        if (px && ref && k3_vision_encode_pixels(f.v, pool, px, &plan, &rows, &err) == K3_OK) {
            const double e = k3_test_rel_l2(rows, ref, 24 * k3_vision_out_dim(f.v));
            CHECKF(e <= 1e-5, "attention in blocks of 7 rows: rel-L2 %.3g", e);
        } else {
            k3_test_fail(__FILE__, __LINE__, "blocked attention: %s", err.msg);
        }
        f.v->attn_rows = 0;
        free(px), free(ref), free(rows);
    }
    /* a 3-frame clip: the sincos time term and the temporal mean */
    {
        const k3_st_tensor *tv = gt(&g, "video.pixel_values", K3_DTYPE_F32), *tvo = gt(&g, "video.out", K3_DTYPE_F32);
        k3_image_plan plan = {.grid_t = 3, .grid_h = 4, .grid_w = 6};
        float *px = tv ? gf32(tv) : NULL, *ref = tvo ? gf32(tvo) : NULL, *rows = NULL;
        if (px && ref && k3_vision_encode_pixels(f.v, pool, px, &plan, &rows, &err) == K3_OK) {
            const double e = k3_test_rel_l2(rows, ref, 6 * k3_vision_out_dim(f.v));
            printf("    tower + projector, 3-frame clip (grid 3x4x6): rel-L2 %.3g\n", e);
            CHECKF(e <= 1e-5, "3-frame clip: rel-L2 %.3g vs the official modules", e);
        } else {
            k3_test_fail(__FILE__, __LINE__, "clip: %s", err.msg);
        }
        free(px), free(ref), free(rows);
    }
    /* --quant w8a8 reaches the tower's matrices: close, not equal */
    k3_quant_options q = {.linear = K3_WQ_INT8};
    const k3_st_tensor *tp = gt(&g, "img0.pixel_values", K3_DTYPE_F32), *to = gt(&g, "tower.img0", K3_DTYPE_F32);
    if (tp && to && k3_vision_quantize(f.v, &q, &err) == K3_OK) {
        k3_image_plan plan = {.grid_t = 1, .grid_h = 8, .grid_w = 12};
        float *px = gf32(tp), *ref = gf32(to), *rows = NULL;
        REQUIRE(k3_vision_encode_pixels(f.v, pool, px, &plan, &rows, &err) == K3_OK);
        const double e = k3_test_rel_l2(rows, ref, 24 * k3_vision_out_dim(f.v));
        printf("    tower + projector with w8a8 matrices: rel-L2 %.3g\n", e);
        CHECKF(e > 0 && e < 0.05, "w8a8 tower rel-L2 %.3g (want (0, 0.05))", e);
        free(px), free(ref), free(rows);
    }
    k3_pool_free(pool);
out:
    fixture_close(&f);
    golden_close(&g);
}

/* ---- images in a prompt ----------------------------------------------------- */

K3_TEST(vision_logits_official) {
    golden g;
    fixture f;
    if (!golden_open(&g)) return;
    k3_ctx *ctx = NULL;
    float *lg = NULL, *ref = NULL, *rows[2] = {NULL, NULL};
    int32_t *ids = NULL;
    const float **emb = NULL;
    k3_pool *pool = NULL;
    k3_error err = {0};
    if (!fixture_open(&f)) goto out;
    const k3_st_tensor *tid = gt(&g, "prompt.ids", K3_DTYPE_I64), *tim = gt(&g, "prompt.images", K3_DTYPE_I64);
    const k3_st_tensor *tl = gt(&g, "prompt.logits", K3_DTYPE_F32);
    if (!tid || !tim || !tl) goto out;
    const int n = (int)tid->shape[0];
    const int64_t V = 1024;
    REQUIRE(k3_pool_init(&pool, 2, &err) == K3_OK);

    /* the prompt as k3 builds it: the text's ids, and each image (from its
     * file) spliced in where its part was (k3_vision_splice) */
    int32_t *txt = malloc(sizeof(int32_t) * 256);
    size_t nt = 0, at[2];
    const char *const text[] = {"Look:", " and", " Which is brighter?"};
    txt[nt++] = k3_tokenizer_special(f.tok, "[BOS]");
    k3_image_plan plans[2];
    bool built = true;
    for (int part = 0; part < 3 && built; part++) {
        int32_t *t = NULL;
        size_t n1 = 0;
        built = k3_tokenizer_encode(f.tok, text[part], strlen(text[part]), &t, &n1, &err) == K3_OK && nt + n1 < 256;
        if (built) memcpy(txt + nt, t, sizeof(int32_t) * n1), nt += n1;
        free(t);
        if (part == 2 || !built) break;
        at[part] = nt;
        k3_image *im = load_image((int)gi64(tim, part));
        int32_t nr = 0;
        built = im && k3_vision_plan(f.v, k3_image_width(im), k3_image_height(im), &plans[part], &err) == K3_OK &&
            k3_vision_encode(f.v, pool, im, &rows[part], &nr, &err) == K3_OK && nr == plans[part].n_tokens;
        k3_image_free(im);
    }
    size_t k = 0;
    if (built)
        built = k3_vision_splice(f.v, f.tok, txt, nt, at, plans, (const float *const *)rows, NULL, 2, &ids, &k, &emb,
                                 NULL, &err) == K3_OK;
    free(txt);
    REQUIREF(built && k == (size_t)n, "building the prompt: %s (%zu of %d ids)", err.msg, k, n);
    int same = 1;
    for (int i = 0; i < n; i++) same &= ids[i] == (int32_t)gi64(tid, i);
    CHECKF(same, "the prompt's ids differ from the official framing");

    k3_ctx_options o = {.max_seqs = 1, .cache_tokens = 256, .block_size = 16, .max_batch = 32, .pool = pool};
    REQUIRE(k3_ctx_init(&ctx, f.m, &o, &err) == K3_OK);
    lg = malloc(sizeof(float) * (size_t)(V * n));
    k3_batch_seq b = {0, n, ids, emb};
    REQUIREF(k3_ctx_forward(ctx, &b, 1, K3_LOGITS_ALL, lg, &err) == K3_OK, "%s", err.msg);
    ref = gf32(tl);
    const double e = k3_test_rel_l2(lg, ref, V * n);
    int agree = 0;
    for (int t = 0; t < n; t++) {
        int a = 0, c = 0;
        for (int64_t j = 1; j < V; j++) {
            if (lg[t * V + j] > lg[t * V + a]) a = (int)j;
            if (ref[t * V + j] > ref[t * V + c]) c = (int)j;
        }
        agree += a == c;
    }
    printf("    logits with 2 images (%d positions, 30 image rows, rounds of 32): rel-L2 %.3g, greedy %d/%d\n", n, e,
           agree, n);
    CHECKF(e <= 1e-5, "logits with images rel-L2 %.3g vs the official model > 1e-5", e);
    CHECKF(agree == n, "greedy tokens agree at %d of %d positions", agree, n);

    /* without the rows (pads embedded as tokens) the logits must move */
    k3_ctx_seq_reset(ctx, 0);
    k3_batch_seq b0 = {0, n, ids};
    REQUIRE(k3_ctx_forward(ctx, &b0, 1, K3_LOGITS_ALL, lg, &err) == K3_OK);
    CHECK(k3_test_rel_l2(lg, ref, V * n) > 1e-2);
out:
    free(lg), free(ref), free(ids), free(emb), free(rows[0]), free(rows[1]);
    k3_ctx_free(ctx);
    k3_pool_free(pool);
    fixture_close(&f);
    golden_close(&g);
}

K3_TEST(vision_text_logits_official) {
    /* the text half of the same official checkpoint, no image */
    golden g;
    if (!golden_open(&g)) return;
    const k3_st_tensor *tid = gt(&g, "text.ids", K3_DTYPE_I64), *tl = gt(&g, "text.logits", K3_DTYPE_F32);
    k3_model *m = NULL;
    k3_ctx *ctx = NULL;
    k3_error err = {0};
    if (tid && tl && k3_model_open(&m, VDIR, &err) == K3_OK) {
        const int n = (int)tid->shape[0];
        int32_t ids[64];
        for (int i = 0; i < n && i < 64; i++) ids[i] = (int32_t)gi64(tid, i);
        k3_ctx_options o = {.max_seqs = 1, .cache_tokens = 64, .block_size = 16};
        float *lg = malloc(sizeof(float) * 1024 * (size_t)n), *ref = gf32(tl);
        k3_batch_seq b = {0, n, ids};
        REQUIRE(k3_ctx_init(&ctx, m, &o, &err) == K3_OK &&
                k3_ctx_forward(ctx, &b, 1, K3_LOGITS_ALL, lg, &err) == K3_OK);
        const double e = k3_test_rel_l2(lg, ref, 1024 * (int64_t)n);
        CHECKF(e <= 1e-5, "text-only logits rel-L2 %.3g vs the official model", e);
        free(lg), free(ref);
    } else {
        k3_test_fail(__FILE__, __LINE__, "%s", err.msg);
    }
    k3_ctx_free(ctx);
    k3_model_close(m);
    golden_close(&g);
}

/* ---- bad input ----------------------------------------------------------------- */

static uint32_t crc32_png(const uint8_t *p, size_t n) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
    }
    return c ^ 0xffffffffu;
}

static void be32(uint8_t *p, uint32_t v) { p[0] = v >> 24, p[1] = v >> 16, p[2] = v >> 8, p[3] = (uint8_t)v; }

/* A PNG whose IHDR says w x h (8-bit RGB) followed by no image data. */
static size_t png_header(uint8_t *b, uint32_t w, uint32_t h) {
    static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    memcpy(b, sig, 8);
    be32(b + 8, 13);
    memcpy(b + 12, "IHDR", 4);
    be32(b + 16, w);
    be32(b + 20, h);
    b[24] = 8, b[25] = 2, b[26] = 0, b[27] = 0, b[28] = 0;
    be32(b + 29, crc32_png(b + 12, 17));
    return 33;
}

K3_TEST(vision_bad_images) {
    k3_image *im = NULL;
    k3_error err = {0};
    uint8_t b[256];
    /* not an image, empty */
    CHECK(k3_image_decode(&im, "BM........", 10, 0, &err) == K3_ERR_UNSUPPORTED && !im);
    k3_err_clear(&err);
    CHECK(k3_image_decode(&im, b, 0, 0, &err) == K3_ERR_FORMAT && !im);
    k3_err_clear(&err);
    /* huge dimensions: refused from the header, before any allocation */
    size_t n = png_header(b, 100000, 100000);
    CHECK(k3_image_decode(&im, b, n, 0, &err) != K3_OK && !im);
    k3_err_clear(&err);
    n = png_header(b, 20000, 20000); /* 4e8 pixels > the 8192^2 cap */
    CHECKF(k3_image_decode(&im, b, n, 0, &err) == K3_ERR_RANGE && !im && strstr(err.msg, "over the limit"), "%s",
           err.msg);
    k3_err_clear(&err);
    n = png_header(b, 64, 64);
    CHECK(k3_image_decode(&im, b, n, 100, &err) == K3_ERR_RANGE && !im); /* a caller's own cap */
    k3_err_clear(&err);
    /* a header and no data: truncated */
    CHECKF(k3_image_decode(&im, b, n, 0, &err) == K3_ERR_FORMAT && !im, "%s", err.msg);
    k3_err_clear(&err);
    /* real files cut short, and with a flipped byte */
    static const char *const files[] = {GDIR "/images/rgb_200x130.png", GDIR "/images/photo_67x45.jpg"};
    for (int f = 0; f < 2; f++) {
        size_t len = 0;
        uint8_t *data = read_file(files[f], &len);
        REQUIRE(data && len > 100);
        const size_t cuts[] = {len / 2, len * 3 / 4, 40}; /* PIL too refuses these (a lost IEND it forgives) */
        for (int c = 0; c < 3; c++) {
            k3_status s = k3_image_decode(&im, data, cuts[c], 0, &err);
            CHECKF(s == K3_ERR_FORMAT && !im, "%s cut at %zu: status %d (%s)", files[f], cuts[c], s, err.msg);
            k3_err_clear(&err);
        }
        memset(data + len / 3, 0xff, 16); /* corrupt the middle: an error or an image, never a crash */
        if (k3_image_decode(&im, data, len, 0, &err) == K3_OK) k3_image_free(im);
        im = NULL;
        k3_err_clear(&err);
        free(data);
    }
    CHECK(k3_image_load(&im, GDIR "/images/no-such.png", 0, &err) == K3_ERR_IO && !im);
}

K3_TEST(vision_text_only_checkpoint) {
    k3_model *m = NULL;
    k3_vision *v = NULL;
    k3_error err = {0};
    REQUIRE(k3_model_open(&m, "tests/models/tiny", &err) == K3_OK);
    CHECKF(k3_vision_open(&v, m, &err) == K3_ERR_UNSUPPORTED && !v && strstr(err.msg, "no vision tower"), "%s",
           err.msg);
    k3_model_close(m);
}

K3_TEST(vision_image_hash) {
    k3_image *a = load_image(0), *b = load_image(0), *c = load_image(5);
    if (a && b && c) {
        CHECK(k3_image_hash(a) == k3_image_hash(b));
        CHECK(k3_image_hash(a) != k3_image_hash(c));
        a->px[100] ^= 1;
        CHECK(k3_image_hash(a) != k3_image_hash(b));
    }
    k3_image_free(a), k3_image_free(b), k3_image_free(c);
}

/* PIL's Image.resize alone (BICUBIC for RGB, L and RGBA -- premultiplied --,
 * NEAREST for P) on 24 random images, sizes 1..69 both ways: equal bytes. */
K3_TEST(vision_pil_resize_official) {
    golden g;
    if (!golden_open(&g)) return;
    const k3_st_tensor *modes = gt(&g, "pil.modes", K3_DTYPE_I64);
    int n_ok = 0, n = modes ? (int)modes->shape[0] : 0;
    for (int c = 0; c < n; c++) {
        char name[32];
        snprintf(name, sizeof name, "pil%d.in", c);
        const k3_st_tensor *ti = gt(&g, name, K3_DTYPE_U8);
        snprintf(name, sizeof name, "pil%d.out", c);
        const k3_st_tensor *to = gt(&g, name, K3_DTYPE_U8);
        if (!ti || !to) continue;
        const int32_t h = (int32_t)ti->shape[0], w = (int32_t)ti->shape[1];
        const int32_t oh = (int32_t)to->shape[0], ow = (int32_t)to->shape[1];
        const int mode = (int)gi64(modes, c); /* 0 RGB, 1 RGBA, 2 L, 3 P */
        uint8_t *in = malloc(ti->nbytes), *out = calloc(to->nbytes, 1);
        memcpy(in, ti->data, ti->nbytes);
        if (mode == 3) {
            k3_pil_resize_nearest(in, w, h, 4, out, ow, oh);
        } else {
            CHECK(k3_pil_resize_rgba(in, w, h, mode == 1, out, ow, oh));
        }
        /* RGB and L resample only their colour bands (PIL sets alpha 255 on
         * convert); k3 carries a constant alpha along, unused: compare colour */
        bool same = true;
        for (size_t i = 0; i < to->nbytes; i++) same &= (mode == 1 || i % 4 != 3) ? out[i] == to->data[i] : true;
        n_ok += same;
        CHECKF(same, "case %d (mode %d, %dx%d -> %dx%d) differs from PIL", c, mode, w, h, ow, oh);
        free(in), free(out);
    }
    printf("    PIL resize: %d/%d random cases byte-identical\n", n_ok, n);
    golden_close(&g);
}

static char *b64(const uint8_t *p, size_t n) {
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char *o = malloc(n / 3 * 4 + 8), *q = o;
    for (size_t i = 0; i < n; i += 3) {
        const uint32_t v =
            (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
        *q++ = A[v >> 18 & 63], *q++ = A[v >> 12 & 63];
        *q++ = i + 1 < n ? A[v >> 6 & 63] : '=';
        *q++ = i + 2 < n ? A[v & 63] : '=';
    }
    *q = 0;
    return o;
}

/* The server's form of an image: an OpenAI image_url data: URL. */
K3_TEST(vision_data_url) {
    size_t n = 0;
    uint8_t *png = read_file(GDIR "/images/rgb_112x112.png", &n);
    REQUIRE(png);
    char *enc = b64(png, n);
    const size_t ne = strlen(enc);
    char *url = malloc(ne + 64);
    k3_image *im = NULL, *ref = load_image(5);
    k3_error err = {0};
    snprintf(url, ne + 64, "data:image/png;base64,%s", enc);
    CHECKF(k3_image_decode_url(&im, url, strlen(url), 0, &err) == K3_OK, "%s", err.msg);
    CHECK(im && ref && k3_image_hash(im) == k3_image_hash(ref)); /* the same pixels as the file */
    k3_image_free(im);
    im = NULL;
    /* refused: remote URLs, other types, bad or cut base64, no comma */
    const char *bad[] = {"https://example.com/cat.png", "http://10.0.0.1/x.jpg",
                         "file:///etc/passwd",          "data:image/bmp;base64,Qk0AAAAA",
                         "data:image/png,rawbytes",     "data:image/png;base64,@@@@",
                         "data:image/png;base64",       "data:image/png;base64,iVBORw0KGgo"};
    const k3_status want[] = {K3_ERR_UNSUPPORTED, K3_ERR_UNSUPPORTED, K3_ERR_UNSUPPORTED, K3_ERR_UNSUPPORTED,
                              K3_ERR_UNSUPPORTED, K3_ERR_ARG,         K3_ERR_ARG,         K3_ERR_FORMAT};
    for (int i = 0; i < 8; i++) {
        k3_err_clear(&err);
        const k3_status s = k3_image_decode_url(&im, bad[i], strlen(bad[i]), 0, &err);
        CHECKF(s == want[i] && !im && err.msg[0], "%s: status %d (%s)", bad[i], s, err.msg);
    }
    k3_err_clear(&err);
    CHECK(k3_image_decode_url(&im, "https://x/y.png", 15, 0, &err) && strstr(err.msg, "fetches nothing"));
    free(url), free(enc), free(png);
    k3_image_free(ref);
}

/* ---- WEBP and GIF ------------------------------------------------------------ */

/* tests/golden/vision/formats.safetensors (official_vision.py --formats): the
 * first frame as Pillow decodes it and the official processor's output. */
static const char *const fmt_images[] = {"webp_lossy_150x100.webp",
                                         "webp_lossless_90x70.webp",
                                         "webp_alpha_160x120.webp",
                                         "webp_alpha_lossless_64x48.webp",
                                         "webp_anim_160x100.webp",
                                         "webp_anim_offset_140x100.webp",
                                         "webp_anim_offset_rgb_140x100.webp",
                                         "gif_palette_170x100.gif",
                                         "gif_trns_150x100.gif",
                                         "gif_grey_250x40.gif",
                                         "gif_anim_110x70.gif",
                                         "gif_offset_trns_150x100.gif",
                                         "gif_offset_local_120x80.gif",
                                         "gif_beyond_60x50.gif",
                                         "gif_interlaced_53x37.gif",
                                         "gif_greykey_160x100.gif",
                                         "gif_nopalette_160x100.gif",
                                         "gif_local_ramp_90x50.gif",
                                         "gif_short_palette_44x30.gif",
                                         "gif_noise_96x64.gif"};
enum { N_FMT = sizeof fmt_images / sizeof fmt_images[0] };

static bool fmt_golden_open(golden *g) {
    memset(g, 0, sizeof *g);
    size_t n = 0;
    k3_error err = {0};
    g->buf = read_file(GDIR "/formats.safetensors", &n);
    if (!g->buf) {
        k3_test_fail(__FILE__, __LINE__, "cannot read " GDIR "/formats.safetensors (see its README)");
        return false;
    }
    if (k3_st_init(&g->st, &err) || k3_st_parse(g->st, g->buf, n, 0, GDIR "/formats.safetensors", &err)) {
        k3_test_fail(__FILE__, __LINE__, "golden: %s", err.msg);
        return false;
    }
    return true;
}

/* Each WEBP / GIF: the decoded first frame equals Pillow's convert("RGBA")
 * byte for byte (a grey key is the alpha PIL gives it), and the processor's
 * grid and pixel values equal the official KimiK3VisionProcessor's. */
K3_TEST(vision_formats_official) {
    golden g;
    fixture f;
    if (!fmt_golden_open(&g)) return;
    if (!fixture_open(&f)) goto out;
    int n_dec = 0, n_px = 0;
    for (int i = 0; i < N_FMT; i++) {
        char name[64], path[256];
        snprintf(path, sizeof path, GDIR "/images/%s", fmt_images[i]);
        snprintf(name, sizeof name, "fmt%d.rgba", i);
        const k3_st_tensor *tr = gt(&g, name, K3_DTYPE_U8);
        snprintf(name, sizeof name, "fmt%d.grid_thw", i);
        const k3_st_tensor *tg = gt(&g, name, K3_DTYPE_I64);
        snprintf(name, sizeof name, "fmt%d.pixels", i);
        const k3_st_tensor *tp = gt(&g, name, K3_DTYPE_U8);
        k3_image *im = NULL;
        k3_error err = {0};
        if (k3_image_load(&im, path, 0, &err)) k3_test_fail(__FILE__, __LINE__, "%s", err.msg);
        if (!tr || !tg || !tp || !im) {
            k3_image_free(im);
            continue;
        }
        const bool size_ok = tr->shape[0] == im->height && tr->shape[1] == im->width;
        CHECKF(size_ok, "%s: %dx%d, Pillow %lldx%lld", fmt_images[i], im->width, im->height, (long long)tr->shape[1],
               (long long)tr->shape[0]);
        if (size_ok) {
            size_t diff = 0;
            for (size_t p = 0; p < (size_t)im->width * im->height; p++) {
                uint8_t px[4];
                memcpy(px, im->px + 4 * p, 4);
                if (im->mode == K3_IMODE_GREY_KEY) px[3] = px[0] == im->key ? 0 : 255;
                diff += memcmp(px, tr->data + 4 * p, 4) != 0;
            }
            n_dec += diff == 0;
            CHECKF(diff == 0, "%s: %zu pixels differ from Pillow's first frame", fmt_images[i], diff);
        }
        float *px = NULL;
        k3_image_plan plan;
        if (k3_vision_preprocess(f.v, im, &px, &plan, &err)) {
            k3_test_fail(__FILE__, __LINE__, "%s: %s", fmt_images[i], err.msg);
            k3_image_free(im);
            continue;
        }
        CHECKF(plan.grid_t == gi64(tg, 0) && plan.grid_h == gi64(tg, 1) && plan.grid_w == gi64(tg, 2),
               "%s: grid (%d,%d,%d), official (%lld,%lld,%lld)", fmt_images[i], plan.grid_t, plan.grid_h, plan.grid_w,
               (long long)gi64(tg, 0), (long long)gi64(tg, 1), (long long)gi64(tg, 2));
        const int64_t n = (int64_t)plan.grid_h * plan.grid_w * 3 * 14 * 14;
        CHECKF((size_t)n == tp->nbytes, "%s: %lld values, official %zu", fmt_images[i], (long long)n, tp->nbytes);
        if ((size_t)n == tp->nbytes) {
            /* the official values are (u / 255 - 0.5) / 0.5 of these bytes
             * (official_vision.py checks that bit for bit); 1e-6 is far
             * below one step of u (7.8e-3) */
            double e = 0;
            for (int64_t k = 0; k < n; k++) {
                const double ref = ((double)(float)(tp->data[k] / 255.0) - 0.5) / 0.5, d = px[k] - ref;
                if (d > e || -d > e) e = d > 0 ? d : -d;
            }
            n_px += e <= 1e-6;
            CHECKF(e <= 1e-6, "%s: pixel values max |diff| %.3g vs the official processor", fmt_images[i], e);
        }
        free(px);
        k3_image_free(im);
    }
    printf("    WEBP + GIF: %d/%d first frames equal Pillow's, %d/%d pixel values equal the official processor's\n",
           n_dec, N_FMT, n_px, N_FMT);
out:
    fixture_close(&f);
    golden_close(&g);
}

static void le16(uint8_t *p, uint32_t v) { p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8); }

/* A GIF89a whose screen is sw x sh with a one-colour palette and an image
 * descriptor of fw x fh at (x, y), then nothing. */
static size_t gif_header(uint8_t *b, uint32_t sw, uint32_t sh, uint32_t x, uint32_t y, uint32_t fw, uint32_t fh) {
    memcpy(b, "GIF89a", 6);
    le16(b + 6, sw), le16(b + 8, sh);
    b[10] = 0x80, b[11] = 0, b[12] = 0; /* a global table of 2 entries */
    memset(b + 13, 0, 6);
    b[19] = 0x2c;
    le16(b + 20, x), le16(b + 22, y), le16(b + 24, fw), le16(b + 26, fh);
    b[28] = 0;
    b[29] = 2; /* LZW code size, then no data */
    return 30;
}

K3_TEST(vision_formats_bad) {
    k3_image *im = NULL;
    k3_error err = {0};
    uint8_t b[64];
    /* decompression bombs: refused from the header, before any pixel */
    size_t n = gif_header(b, 30000, 30000, 0, 0, 10, 10);
    CHECKF(k3_image_decode(&im, b, n, 0, &err) == K3_ERR_RANGE && !im && strstr(err.msg, "over the limit"), "%s",
           err.msg);
    k3_err_clear(&err);
    n = gif_header(b, 10, 10, 60000, 60000, 5000, 5000); /* the frame grows the screen past the cap */
    CHECKF(k3_image_decode(&im, b, n, 0, &err) == K3_ERR_RANGE && !im, "%s", err.msg);
    k3_err_clear(&err);
    n = gif_header(b, 64, 64, 0, 0, 64, 64);
    CHECK(k3_image_decode(&im, b, n, 100, &err) == K3_ERR_RANGE && !im); /* a caller's own cap */
    k3_err_clear(&err);
    CHECKF(k3_image_decode(&im, b, n, 0, &err) == K3_ERR_FORMAT && !im && strstr(err.msg, "truncated"), "%s", err.msg);
    k3_err_clear(&err);
    b[19] = ';'; /* a GIF with no image */
    CHECKF(k3_image_decode(&im, b, 20, 0, &err) == K3_ERR_FORMAT && !im && strstr(err.msg, "no image"), "%s", err.msg);
    k3_err_clear(&err);
    /* VP8X canvas 16384 x 16384 (2.7e8 pixels): refused before the decoder allocates it */
    static const uint8_t vp8x[30] = {'R', 'I', 'F', 'F', 22, 0,    0, 0, 'W', 'E',  'B',  'P', 'V',  'P',  '8',
                                     'X', 10,  0,   0,   0,  0x02, 0, 0, 0,   0xff, 0x3f, 0,   0xff, 0x3f, 0};
    CHECKF(k3_image_decode(&im, vp8x, sizeof vp8x, 0, &err) == K3_ERR_RANGE && !im, "%s", err.msg);
    k3_err_clear(&err);
    CHECKF(k3_image_decode(&im, vp8x, 16, 0, &err) == K3_ERR_FORMAT && !im, "%s", err.msg);
    k3_err_clear(&err);
    /* RIFF WEBP with another first chunk, and other formats: not an image k3 reads */
    static const uint8_t riff[16] = {'R', 'I', 'F', 'F', 8, 0, 0, 0, 'W', 'E', 'B', 'P', 'A', 'L', 'P', 'H'};
    CHECKF(k3_image_decode(&im, riff, 16, 0, &err) == K3_ERR_UNSUPPORTED && !im &&
               strstr(err.msg, "not a PNG, JPEG, WEBP or GIF image"),
           "%s", err.msg);
    k3_err_clear(&err);
    CHECK(k3_image_decode(&im, "GIF88a....", 10, 0, &err) == K3_ERR_UNSUPPORTED && !im);
    k3_err_clear(&err);
    /* real files cut short (every one refused as truncated) and corrupted
     * (an error or an image, never a crash: the fuzzer goes further) */
    static const char *const files[] = {GDIR "/images/webp_lossy_150x100.webp",
                                        GDIR "/images/webp_alpha_lossless_64x48.webp",
                                        GDIR "/images/webp_anim_offset_140x100.webp",
                                        GDIR "/images/gif_palette_170x100.gif",
                                        GDIR "/images/gif_interlaced_53x37.gif",
                                        GDIR "/images/gif_noise_96x64.gif"};
    for (int fi = 0; fi < 6; fi++) {
        size_t len = 0;
        uint8_t *data = read_file(files[fi], &len);
        REQUIRE(data && len > 100);
        const size_t cuts[] = {len / 2, len * 3 / 4, 40, data[0] == 'G' ? 13 : 20, data[0] == 'G' ? 4 : 13};
        for (int c = 0; c < 5; c++) {
            const k3_status s = k3_image_decode(&im, data, cuts[c], 0, &err);
            CHECKF(s == K3_ERR_FORMAT && !im && strstr(err.msg, "truncated"), "%s cut at %zu: status %d (%s)",
                   files[fi], cuts[c], s, err.msg);
            k3_err_clear(&err);
        }
        if (data[0] == 'G') { /* a lost trailer Pillow forgives, and so does k3 */
            CHECKF(k3_image_decode(&im, data, len - 1, 0, &err) == K3_OK && im, "%s without ';': %s", files[fi],
                   err.msg);
            k3_image_free(im);
            im = NULL;
            k3_err_clear(&err);
        }
        for (size_t at = 30; at < len; at += len / 7) {
            uint8_t *c = malloc(len);
            memcpy(c, data, len);
            memset(c + at, 0xa5, len - at < 16 ? len - at : 16);
            if (k3_image_decode(&im, c, len, 0, &err) == K3_OK) k3_image_free(im);
            im = NULL;
            k3_err_clear(&err);
            free(c);
        }
        free(data);
    }
    /* only the first frame is read: an animated GIF cut inside its second
     * frame gives the same image (Pillow's Image.open reads no further) */
    size_t len = 0;
    uint8_t *data = read_file(GDIR "/images/gif_anim_110x70.gif", &len);
    REQUIRE(data);
    k3_image *whole = NULL;
    CHECKF(k3_image_decode(&whole, data, len, 0, &err) == K3_OK, "%s", err.msg);
    CHECKF(k3_image_decode(&im, data, len * 2 / 3, 0, &err) == K3_OK, "%s", err.msg);
    CHECK(im && whole && k3_image_hash(im) == k3_image_hash(whole));
    k3_image_free(im), k3_image_free(whole);
    free(data);
}

/* data: URLs with image/webp and image/gif, as a server receives them. */
K3_TEST(vision_formats_data_url) {
    static const char *const files[] = {"webp_alpha_160x120.webp", "gif_trns_150x100.gif"};
    static const char *const types[] = {"image/webp", "image/gif"};
    for (int i = 0; i < 2; i++) {
        char path[256];
        snprintf(path, sizeof path, GDIR "/images/%s", files[i]);
        size_t n = 0;
        uint8_t *data = read_file(path, &n);
        REQUIRE(data);
        char *enc = b64(data, n);
        const size_t ne = strlen(enc);
        char *url = malloc(ne + 64);
        snprintf(url, ne + 64, "data:%s;base64,%s", types[i], enc);
        k3_image *im = NULL, *ref = NULL;
        k3_error err = {0};
        CHECKF(k3_image_decode_url(&im, url, strlen(url), 0, &err) == K3_OK, "%s: %s", types[i], err.msg);
        CHECKF(k3_image_load(&ref, path, 0, &err) == K3_OK, "%s", err.msg);
        CHECK(im && ref && k3_image_hash(im) == k3_image_hash(ref));
        k3_image_free(im), k3_image_free(ref);
        free(url), free(enc), free(data);
    }
}

K3_TEST(vision_splice_bad) {
    fixture f;
    if (!fixture_open(&f)) return;
    const int32_t ids[3] = {1, 2, 3};
    k3_image_plan plan;
    k3_error err = {0};
    REQUIRE(k3_vision_plan(f.v, 5, 3, &plan, &err) == K3_OK && plan.n_tokens == 1);
    float row[64] = {0};
    const float *rows[2] = {row, row};
    const k3_image_plan plans[2] = {plan, plan};
    int32_t *out = NULL;
    size_t n = 0;
    const float **emb = NULL;
    const size_t past[1] = {4}, backwards[2] = {2, 1}, ok[2] = {0, 3};
    CHECK(k3_vision_splice(f.v, f.tok, ids, 3, past, plans, rows, NULL, 1, &out, &n, &emb, NULL, &err) == K3_ERR_ARG &&
          !out);
    k3_err_clear(&err);
    CHECK(k3_vision_splice(f.v, f.tok, ids, 3, backwards, plans, rows, NULL, 2, &out, &n, &emb, NULL, &err) ==
              K3_ERR_ARG &&
          !out);
    k3_err_clear(&err);
    const uint64_t hk[2] = {0x1111, 0x2222};
    uint64_t *keys = NULL;
    REQUIRE(k3_vision_splice(f.v, f.tok, ids, 3, ok, plans, rows, hk, 2, &out, &n, &emb, &keys, &err) == K3_OK);
    /* image, 1 2 3, image; each framing: begin "image 5x3" content pad end */
    int32_t *fr = NULL;
    size_t nfr = 0, pat = 0;
    REQUIRE(k3_vision_image_prompt(f.v, f.tok, &plan, &fr, &nfr, &pat, &err) == K3_OK);
    CHECK(n == 3 + 2 * nfr && !memcmp(out, fr, sizeof(int32_t) * nfr) &&
          !memcmp(out + nfr + 3, fr, sizeof(int32_t) * nfr));
    CHECK(out[nfr] == 1 && out[nfr + 2] == 3 && pat == nfr - 2);
    for (size_t i = 0; i < n; i++) /* prefix-cache keys: each image's on its framing, 0 on the text */
        CHECK(keys[i] == (i < nfr ? 0x1111u : i < nfr + 3 ? 0u : 0x2222u));
    free(fr);
    free(keys);
    CHECK(out[0] == k3_tokenizer_special(f.tok, "<|media_begin|>") &&
          out[n - 1] == k3_tokenizer_special(f.tok, "<|media_end|>"));
    int pads = 0;
    for (size_t i = 0; i < n; i++) {
        pads += out[i] == 789;
        CHECK((out[i] == 789) == (emb[i] != NULL));
    }
    CHECK(pads == 2);
    free(out), free(emb);
    /* a tokenizer without the media specials cannot frame an image */
    k3_tokenizer *plain = NULL;
    REQUIRE(k3_tokenizer_open(&plain, "tests/models/tiny", &err) == K3_OK);
    int32_t *o2 = NULL;
    size_t n2 = 0, pad_at = 0;
    k3_err_clear(&err);
    CHECK(k3_vision_image_prompt(f.v, plain, &plan, &o2, &n2, &pad_at, &err) == K3_ERR_UNSUPPORTED && !o2);
    k3_tokenizer_free(plain);
    fixture_close(&f);
}

/* The tower's softmax: each SIMD path against the scalar reference. */
K3_TEST(vision_softmax_paths) {
    uint32_t r = 7;
    float *x = malloc(sizeof(float) * 1100), *a = malloc(sizeof(float) * 1100), *b = malloc(sizeof(float) * 1100);
    const int64_t ns[] = {1, 7, 16, 17, 100, 1024, 1031};
    double worst = 0;
    for (size_t t = 0; t < sizeof ns / sizeof ns[0]; t++) {
        const int64_t n = ns[t];
        for (int64_t i = 0; i < n; i++) {
            r = r * 1103515245u + 12345u;
            x[i] = ((float)(r >> 8) / 16777216.0f - 0.5f) * 60.0f; /* logits spread over +-30 */
        }
        memcpy(a, x, sizeof(float) * (size_t)n);
        k3_softmax_ref(a, n, 0.0884f);
        for (int path = 0; path < 2; path++) {
            if (path == 0 && k3_kernels_isa() < K3_ISA_AVX2) continue;
            if (path == 1 && k3_kernels_isa() < K3_ISA_AVX512) continue;
            memcpy(b, x, sizeof(float) * (size_t)n);
            if (path == 0) k3_softmax_avx2(b, n, 0.0884f);
            else k3_softmax_avx512(b, n, 0.0884f);
            double e = 0, s = 0;
            for (int64_t i = 0; i < n; i++) {
                e = fmax(e, fabs((double)b[i] - a[i]) / (a[i] > 1e-30f ? a[i] : 1e-30));
                s += b[i];
            }
            if (e > worst) worst = e;
            CHECKF(e <= 2e-6 && fabs(s - 1.0) < 1e-5, "softmax path %d, n %lld: max rel diff %.3g, sum %.7f", path,
                   (long long)n, e, s);
        }
    }
    printf("    softmax SIMD vs scalar: max rel diff %.3g (%s)\n", worst, k3_isa_name(k3_kernels_isa()));
    free(x), free(a), free(b);
}

/* An OpenAI chat with two image_url parts (data: URLs) between text parts,
 * against the official encoder (apply_chat_template with the processor's
 * image prompts, pads expanded); then bad requests. */
K3_TEST(vision_chat_official) {
    golden g;
    fixture f;
    if (!golden_open(&g)) return;
    if (!fixture_open(&f)) goto out;
    size_t nj = 0;
    char *js = (char *)read_file(GDIR "/chat_messages.json", &nj);
    const k3_st_tensor *tid = gt(&g, "chat.ids", K3_DTYPE_I64);
    REQUIRE(js && tid);
    js = realloc(js, nj + 1);
    js[nj] = 0;
    k3_chat_options opt = {.add_generation_prompt = true, .thinking = true};
    k3_vision_prompt p;
    k3_error err = {0};
    REQUIREF(k3_vision_chat_encode_json(f.v, f.tok, NULL, js, NULL, &opt, 0, &p, &err) == K3_OK, "%s", err.msg);
    const int64_t n = tid->shape[0];
    bool same = (int64_t)p.n_ids == n;
    for (int64_t i = 0; same && i < n; i++) same = p.ids[i] == (int32_t)gi64(tid, i);
    CHECKF(same, "chat ids differ from the official encoder's (%zu vs %lld ids)", p.n_ids, (long long)n);
    int rows = 0, keyed = 0;
    for (size_t i = 0; i < p.n_ids; i++) rows += p.embeds[i] != NULL, keyed += p.keys[i] != 0;
    CHECK(p.n_images == 2 && rows == 1 + 6 && keyed > rows);
    printf("    chat with 2 image_url parts: %zu ids = the official encoder's, %d image rows\n", p.n_ids, rows);
    k3_vision_prompt_free(&p);

    /* refused: a remote URL, a text-only model, the marker in user text */
    const char *remote =
        "[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{\"url\":\"https://x.org/a.png\"}}]}]";
    k3_err_clear(&err);
    CHECKF(k3_vision_chat_encode_json(f.v, f.tok, NULL, remote, NULL, &opt, 0, &p, &err) == K3_ERR_UNSUPPORTED &&
               strstr(err.msg, "messages[0].content[0]") && strstr(err.msg, "fetches nothing"),
           "%s", err.msg);
    k3_err_clear(&err);
    CHECK(k3_vision_chat_encode_json(NULL, f.tok, NULL, js, NULL, &opt, 0, &p, &err) == K3_ERR_UNSUPPORTED &&
          strstr(err.msg, "no vision tower"));
    const char *clash = "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"\\ue000k3img0\\ue000\"},"
                        "{\"type\":\"image_url\",\"image_url\":{\"url\":\"data:image/png;base64,AAAA\"}}]}]";
    k3_err_clear(&err);
    CHECK(k3_vision_chat_encode_json(f.v, f.tok, NULL, clash, NULL, &opt, 0, &p, &err) != K3_OK);
    /* no images: the plain encoder */
    const char *plain = "[{\"role\":\"user\",\"content\":\"Hi\"}]";
    k3_err_clear(&err);
    CHECK(k3_vision_chat_encode_json(NULL, f.tok, NULL, plain, NULL, &opt, 0, &p, &err) == K3_OK && p.n_ids > 0 &&
          !p.embeds);
    k3_vision_prompt_free(&p);
    free(js);
out:
    fixture_close(&f);
    golden_close(&g);
}

/* Images through the engine: k3_request_params.embeds (copied at submit) and
 * extra_keys from k3_vision_chat_encode_json. The engine's greedy tokens
 * equal the context's, for two images.
 * (Prefix-cache hits are not checked here: the engine resumes a cached
 * prefix only at a KDA snapshot, and vision-tiny has no KDA layer; the keys
 * themselves are sched_prefix_extra_keys's subject.) */
static int engine_run(k3_engine *e, const k3_vision_prompt *vp, int32_t *toks, int n_max, int64_t *n_cached) {
    k3_request_params p = {.prompt = vp->ids,
                           .n_prompt = (int64_t)vp->n_ids,
                           .max_tokens = n_max,
                           .logprobs = -1,
                           .prompt_logprobs = -1,
                           .extra_keys = vp->keys,
                           .embeds = vp->embeds,
                           .ignore_eos = true};
    p.sampling = (k3_sampler_options){.temperature = 0, .top_p = 1, .repeat_penalty = 1};
    uint64_t id;
    k3_error err = {0};
    if (k3_engine_submit(e, &p, &id, &err)) {
        k3_test_fail(__FILE__, __LINE__, "submit: %s", err.msg);
        return 0;
    }
    int n = 0;
    for (int steps = 0; steps < 1000; steps++) {
        k3_step_result sr;
        if (k3_engine_step(e, &sr, &err)) {
            k3_test_fail(__FILE__, __LINE__, "step: %s", err.msg);
            return n;
        }
        for (int32_t i = 0; i < sr.n_outputs; i++) {
            const k3_req_output *o = &sr.outputs[i];
            for (int32_t k = 0; k < o->n_new && n < n_max; k++) toks[n++] = o->tokens[k];
            if (o->events & K3_EV_FINISHED) {
                *n_cached = o->n_cached;
                return n;
            }
        }
    }
    return n;
}

static char *chat_with(const char *file) {
    size_t n = 0;
    char path[256];
    snprintf(path, sizeof path, GDIR "/images/%s", file);
    uint8_t *png = read_file(path, &n);
    if (!png) return NULL;
    char *enc = b64(png, n);
    free(png);
    const char *head = "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Look at this picture, please, "
                       "and then tell me about it in some detail.\"},{\"type\":\"image_url\",\"image_url\":{\"url\":"
                       "\"data:image/png;base64,";
    char *js = malloc(strlen(head) + strlen(enc) + 64);
    sprintf(js, "%s%s\"}}]}]", head, enc);
    free(enc);
    return js;
}

static void ctx_greedy(const fixture *f, const k3_vision_prompt *vp, int32_t *want, int n) {
    k3_ctx *ctx = NULL;
    k3_error err = {0};
    k3_ctx_options co = {.max_seqs = 1, .cache_tokens = 256, .block_size = 16};
    float *lg = malloc(sizeof(float) * 1024);
    if (!lg || k3_ctx_init(&ctx, f->m, &co, &err)) {
        k3_test_fail(__FILE__, __LINE__, "ctx: %s", err.msg);
        free(lg);
        return;
    }
    k3_batch_seq bs = {0, (int32_t)vp->n_ids, vp->ids, vp->embeds};
    for (int t = 0; t < n; t++) {
        if (k3_ctx_forward(ctx, &bs, 1, K3_LOGITS_LAST, lg, &err)) {
            k3_test_fail(__FILE__, __LINE__, "forward: %s", err.msg);
            break;
        }
        int best = 0;
        for (int j = 1; j < 1024; j++) best = lg[j] > lg[best] ? j : best;
        want[t] = best;
        bs = (k3_batch_seq){0, 1, &want[t]};
    }
    k3_ctx_free(ctx);
    free(lg);
}

K3_TEST(vision_engine) {
    fixture f;
    if (!fixture_open(&f)) return;
    k3_error err = {0};
    k3_chat_options opt = {.add_generation_prompt = true, .thinking = false};
    char *ja = chat_with("rgb_200x130.png"), *jb = chat_with("palette_170x101.png");
    k3_vision_prompt a, b;
    REQUIRE(ja && jb);
    REQUIRE(k3_vision_chat_encode_json(f.v, f.tok, NULL, ja, NULL, &opt, 0, &a, &err) == K3_OK);
    REQUIRE(k3_vision_chat_encode_json(f.v, f.tok, NULL, jb, NULL, &opt, 0, &b, &err) == K3_OK);
    int keyed = 0, rows = 0;
    for (size_t i = 0; i < a.n_ids; i++) keyed += a.keys[i] != 0, rows += a.embeds[i] != NULL;
    CHECK(rows == 24 && keyed > rows); /* the image's key on its whole framing */
    enum { NG = 6 };
    int32_t want_a[NG], want_b[NG], got_a[NG], got_b[NG];
    ctx_greedy(&f, &a, want_a, NG);
    ctx_greedy(&f, &b, want_b, NG);
    k3_engine *e = NULL;
    k3_engine_options eo = {.max_num_seqs = 2, .cache_tokens = 512, .block_size = 16};
    REQUIRE(k3_engine_open(&e, f.m, &eo, &err) == K3_OK);
    int64_t c = 0;
    const int na = engine_run(e, &a, got_a, NG, &c), nb = engine_run(e, &b, got_b, NG, &c);
    CHECKF(na == NG && !memcmp(got_a, want_a, sizeof want_a),
           "engine greedy tokens (image a) differ from the context's");
    CHECKF(nb == NG && !memcmp(got_b, want_b, sizeof want_b),
           "engine greedy tokens (image b) differ from the context's");
    printf("    engine with image rows: greedy %d/%d and %d/%d tokens = the context's\n", na, NG, nb, NG);
    k3_engine_close(e);
    k3_vision_prompt_free(&a);
    k3_vision_prompt_free(&b);
    free(ja), free(jb);
    fixture_close(&f);
}
