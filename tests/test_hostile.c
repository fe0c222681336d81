/*
 * test_hostile.c -- regression tests for hostile input (issue 14): the
 * fixed-size arrays of the compute code against what config.c allows, files
 * that are not regular files, unbounded reads, zero-size tensors with huge
 * dimensions, unpadded safetensors headers, non-finite weights, and texts
 * with runs too long for the split regex.
 */
#include "test.h"

#include <fcntl.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/file.h"
#include "k3.h"
#include "kernels/attn_ops.h"
#include "model/config.h"
#include "kernels/router.h"
#include "tokenizer/tokenizer_internal.h"

#define TINY "tests/models/tiny"
#define O200K "data/tokenizers/o200k_base.tiktoken"
#define KIMI_CONFIG "tests/golden/tokenizer/kimi-o200k/tokenizer_config.json"

/* ---- helpers ------------------------------------------------------------ */

static char *slurp(const char *path, size_t *n) {
    char *b;
    k3_error e = {0};
    if (k3_file_read(path, (size_t)64 << 20, "a test file", &b, n, &e) != K3_OK) return NULL;
    return b;
}

static bool spit(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    const bool ok = fwrite(data, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

/* A temp dir with a copy of tiny's config.json (and model.safetensors). */
static bool tmp_ckpt(char *dir, bool with_weights) {
    strcpy(dir, "/tmp/k3-hostile-XXXXXX");
    if (!mkdtemp(dir)) return false;
    const char *names[] = {"config.json", "model.safetensors"};
    for (int i = 0; i < (with_weights ? 2 : 1); i++) {
        char from[256], to[256];
        snprintf(from, sizeof from, "%s/%s", TINY, names[i]);
        snprintf(to, sizeof to, "%s/%s", dir, names[i]);
        size_t n;
        char *b = slurp(from, &n);
        const bool ok = b && spit(to, b, n);
        free(b);
        if (!ok) return false;
    }
    return true;
}

static void rm_tmp(const char *dir) {
    const char *names[] = {"config.json", "model.safetensors", "tiktoken.model", "tokenizer_config.json"};
    char p[256];
    for (int i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        unlink(p);
    }
    rmdir(dir);
}

/* tiny's config.json with one substitution, parsed. */
static k3_status parse_tiny_sub(const char *from, const char *to, k3_error *e) {
    size_t n;
    char *j = slurp(TINY "/config.json", &n);
    if (!j) return K3_ERR_IO;
    char *at = strstr(j, from);
    if (!at) {
        free(j);
        snprintf(e->msg, sizeof e->msg, "test bug: '%s' not in the config", from);
        return (k3_status)-1;
    }
    const size_t a = (size_t)(at - j), lf = strlen(from), lt = strlen(to);
    char *r = malloc(n - lf + lt + 1);
    memcpy(r, j, a);
    memcpy(r + a, to, lt);
    memcpy(r + a + lt, at + lf, n - a - lf + 1);
    k3_config c;
    k3_err_clear(e);
    const k3_status s = k3_config_parse(&c, r, strlen(r), "config.json", e);
    free(r);
    free(j);
    return s;
}

/* ---- fixed-size arrays against the config bounds ----------------------- */

K3_TEST(hostile_config_array_bounds) {
    k3_error e;
    /* 257 expert groups overflowed the router's gscore[256] / keep[256] */
    CHECK(parse_tiny_sub("\"num_experts\": 16", "\"num_experts\": 514", &e) == K3_OK);
    k3_status s = K3_OK;
    {
        size_t n;
        char *j = slurp(TINY "/config.json", &n);
        REQUIRE(j);
        char *a = strstr(j, "\"num_experts\": 16"), *b = strstr(j, "\"num_expert_group\": 1");
        REQUIRE(a && b);
        json_t *root = json_loads(j, 0, NULL);
        free(j);
        REQUIRE(root);
        json_t *tc = json_object_get(root, "text_config");
        json_object_set_new(tc, "num_experts", json_integer(514));
        json_object_set_new(tc, "num_expert_group", json_integer(257));
        char *t = json_dumps(root, 0);
        json_decref(root);
        k3_config c;
        k3_err_clear(&e);
        s = k3_config_parse(&c, t, strlen(t), "config.json", &e);
        free(t);
    }
    CHECKF(s == K3_ERR_FORMAT && strstr(e.msg, "num_expert_group") && strstr(e.msg, "256"), "%d %s", (int)s, e.msg);
    s = parse_tiny_sub("\"num_attention_heads\": 4", "\"num_attention_heads\": 1025", &e);
    CHECKF(s == K3_ERR_FORMAT && strstr(e.msg, "num_attention_heads") && strstr(e.msg, "1024"), "%s", e.msg);
    s = parse_tiny_sub("\"head_dim\": 32", "\"head_dim\": 1024", &e);
    CHECKF(s == K3_ERR_FORMAT && strstr(e.msg, "head_dim") && strstr(e.msg, "512"), "%s", e.msg);
}

/* The router at the largest group count the config allows: every chosen
 * expert lies in a kept group, ids are distinct. (Under ASan the old
 * gscore[256] with 257 groups wrote past the stack array.) */
K3_TEST(hostile_router_max_groups) {
    enum { E = 2 * K3_MOE_MAX_GROUPS, K = 8 };
    float logits[E], bias[E], work[E], w[K];
    int32_t ids[K];
    for (int e = 0; e < E; e++) {
        logits[e] = (float)((e * 37) % 101) / 50.0f - 1.0f;
        bias[e] = 0.0f;
    }
    k3_router_cfg rc = {E, K, true, true, 1.0f, K3_MOE_MAX_GROUPS, 4};
    k3_router_select(&rc, logits, bias, ids, w, work);
    for (int r = 0; r < K; r++) {
        CHECK(ids[r] >= 0 && ids[r] < E);
        for (int q = 0; q < r; q++) CHECK(ids[q] != ids[r]);
        CHECK(work[ids[r]] > -INFINITY);
    }
}

/* The AVX2 indexer kernel keeps queries in q16[64 * 256]: a head dim of 512
 * must take another path and still equal the reference. */
K3_TEST(hostile_qli_wide_heads) {
    enum { HI = 64, DI = 512, N = 5 };
    int8_t *q8 = malloc(HI * DI), *k8 = malloc(N * DI);
    float qs[HI], w[HI], ks[N], a[N], b[N];
    int64_t slots[N];
    REQUIRE(q8 && k8);
    for (int i = 0; i < HI * DI; i++) q8[i] = (int8_t)((i * 31) % 255 - 127);
    for (int i = 0; i < N * DI; i++) k8[i] = (int8_t)((i * 17) % 251 - 125);
    for (int h = 0; h < HI; h++) {
        qs[h] = 0.01f * (1 + h % 5);
        w[h] = 0.5f - 0.01f * h;
    }
    for (int i = 0; i < N; i++) {
        ks[i] = 0.02f * (i + 1);
        slots[i] = N - 1 - i;
    }
    k3_qli_scores(q8, qs, w, HI, DI, k8, ks, slots, N, a);
    k3_qli_scores_ref(q8, qs, w, HI, DI, k8, ks, slots, N, b);
    CHECK(k3_test_rel_l2(a, b, N) < 1e-5);
    free(q8);
    free(k8);
}

/* ---- files that are not regular files; unbounded reads ------------------ */

K3_TEST(hostile_fifo_and_devices) {
    alarm(30); /* were open() to block on a FIFO again, SIGALRM ends the run as a failure */
    char dir[64];
    REQUIRE(tmp_ckpt(dir, false));
    char p[128];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    REQUIRE(mkfifo(p, 0600) == 0);
    k3_model *m = NULL;
    k3_error e = {0};
    /* open() of a FIFO with no writer blocked forever before */
    CHECK(k3_model_open(&m, dir, &e) == K3_ERR_IO && !m);
    CHECKF(strstr(e.msg, "model.safetensors") && strstr(e.msg, "FIFO"), "%s", e.msg);
    unlink(p);
    /* a FIFO config.json */
    snprintf(p, sizeof p, "%s/config.json", dir);
    unlink(p);
    REQUIRE(mkfifo(p, 0600) == 0);
    k3_err_clear(&e);
    CHECK(k3_model_open(&m, dir, &e) == K3_ERR_IO && strstr(e.msg, "FIFO"));
    unlink(p);
    /* tiktoken.model as a FIFO, and /dev/zero (which grew a buffer without end) */
    snprintf(p, sizeof p, "%s/tiktoken.model", dir);
    REQUIRE(mkfifo(p, 0600) == 0);
    k3_tokenizer *t = NULL;
    k3_err_clear(&e);
    CHECK(k3_tokenizer_open(&t, dir, &e) == K3_ERR_IO && !t && strstr(e.msg, "FIFO"));
    unlink(p);
    k3_err_clear(&e);
    CHECK(k3_tokenizer_open_file(&t, "/dev/zero", K3_PATTERN_O200K, &e) == K3_ERR_IO && !t);
    CHECKF(strstr(e.msg, "/dev/zero") && strstr(e.msg, "character device"), "%s", e.msg);
    rm_tmp(dir);
    alarm(0);
}

K3_TEST(hostile_read_limit) {
    char path[] = "/tmp/k3-hostile-big-XXXXXX";
    const int fd = mkstemp(path);
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, (2 << 20) + 1) == 0);
    close(fd);
    char *b;
    size_t n;
    k3_error e = {0};
    CHECK(k3_file_read(path, (size_t)2 << 20, "a test file", &b, &n, &e) == K3_ERR_FORMAT);
    CHECKF(strstr(e.msg, "2 MB limit") && strstr(e.msg, path), "%s", e.msg);
    k3_err_clear(&e);
    REQUIRE(k3_file_read(path, (size_t)3 << 20, "a test file", &b, &n, &e) == K3_OK);
    CHECK(n == (2u << 20) + 1 && b[n] == 0);
    free(b);
    unlink(path);
}

/* ---- safetensors: zero-size tensors with huge dims, unpadded headers ---- */

/* Rewrites dir/model.safetensors with a header edited by fn; pad chooses
 * whether the header length is kept a multiple of 8. */
static bool rewrite(const char *dir, void (*fn)(json_t *), bool pad) {
    char p[128];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    size_t n;
    char *b = slurp(p, &n);
    if (!b) return false;
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--) h = h << 8 | (uint8_t)b[i];
    json_t *j = json_loadb(b + 8, (size_t)h, 0, NULL);
    if (!j) return false;
    fn(j);
    char *text = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    size_t hl = strlen(text);
    const size_t padded = pad ? (hl + 7) / 8 * 8 : (hl % 2 ? hl : hl + 1); /* unpadded: odd */
    const size_t data = n - 8 - (size_t)h;
    char *o = malloc(8 + padded + data);
    for (int i = 0; i < 8; i++) o[i] = (char)((uint64_t)padded >> (8 * i));
    memcpy(o + 8, text, hl);
    memset(o + 8 + hl, ' ', padded - hl);
    memcpy(o + 8 + padded, b + 8 + h, data);
    const bool ok = spit(p, o, 8 + padded + data);
    free(text);
    free(o);
    free(b);
    return ok;
}

static void huge_zero_alog(json_t *j) {
    json_t *t = json_object_get(j, "language_model.model.layers.0.self_attn.A_log");
    json_t *shape = json_array();
    json_array_append_new(shape, json_integer(1ll << 40));
    json_array_append_new(shape, json_integer(1ll << 40));
    json_array_append_new(shape, json_integer(0));
    json_object_set_new(t, "shape", shape);
    json_t *offs = json_object_get(t, "data_offsets");
    json_array_set(offs, 1, json_array_get(offs, 0));
}

static void nothing(json_t *j) { (void)j; }

K3_TEST(hostile_zero_size_huge_dims) {
    char dir[64];
    REQUIRE(tmp_ckpt(dir, true));
    REQUIRE(rewrite(dir, huge_zero_alog, true));
    k3_model *m = NULL;
    k3_error e = {0};
    /* numel() multiplied 2^40 x 2^40 (signed overflow) before reaching the 0 */
    CHECK(k3_model_open(&m, dir, &e) == K3_ERR_SHAPE && !m);
    CHECKF(strstr(e.msg, "A_log") && strstr(e.msg, "0 elements"), "%s", e.msg);
    rm_tmp(dir);
}

K3_TEST(hostile_unpadded_header) {
    char dir[64];
    REQUIRE(tmp_ckpt(dir, true));
    REQUIRE(rewrite(dir, nothing, false)); /* odd header length: BF16 data at odd addresses */
    k3_model *m = NULL, *ref = NULL;
    k3_error e = {0};
    /* realigned on open: loads, and reads the same weights */
    REQUIREF(k3_model_open(&m, dir, &e) == K3_OK, "%s", e.msg);
    REQUIREF(k3_model_open(&ref, TINY, &e) == K3_OK, "%s", e.msg);
    k3_model_info a, b;
    k3_model_get_info(m, &a);
    k3_model_get_info(ref, &b);
    CHECK(a.n_params == b.n_params && a.weight_bytes == b.weight_bytes);
    int32_t ids[3] = {1, 2, 3};
    float la[3 * 1024], lb[3 * 1024];
    k3_ctx *ca = NULL, *cb = NULL;
    k3_ctx_options co = {.max_seqs = 1, .cache_tokens = 8};
    REQUIRE(k3_ctx_init(&ca, m, &co, &e) == K3_OK && k3_ctx_init(&cb, ref, &co, &e) == K3_OK);
    k3_batch_seq bs = {0, 3, ids};
    REQUIRE(k3_ctx_forward(ca, &bs, 1, K3_LOGITS_ALL, la, &e) == K3_OK);
    REQUIRE(k3_ctx_forward(cb, &bs, 1, K3_LOGITS_ALL, lb, &e) == K3_OK);
    CHECK(memcmp(la, lb, sizeof la) == 0);
    k3_ctx_free(ca);
    k3_ctx_free(cb);
    k3_model_close(m);
    k3_model_close(ref);
    rm_tmp(dir);
}

/* ---- non-finite weights -------------------------------------------------- */

K3_TEST(hostile_nan_weights) {
    char dir[64];
    REQUIRE(tmp_ckpt(dir, true));
    char p[128];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    size_t n;
    char *b = slurp(p, &n);
    REQUIRE(b);
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--) h = h << 8 | (uint8_t)b[i];
    json_t *j = json_loadb(b + 8, (size_t)h, 0, NULL);
    REQUIRE(j);
    json_t *offs =
        json_object_get(json_object_get(j, "language_model.model.layers.0.input_layernorm.weight"), "data_offsets");
    REQUIRE(offs);
    const size_t at = 8 + (size_t)h + (size_t)json_integer_value(json_array_get(offs, 0)) + 2 * 5;
    json_decref(j);
    b[at] = (char)0xC0; /* element 5 = BF16 0x7FC0, a quiet NaN */
    b[at + 1] = 0x7F;
    REQUIRE(spit(p, b, n));
    free(b);
    k3_model *m = NULL;
    k3_error e = {0};
    REQUIREF(k3_model_open(&m, dir, &e) == K3_OK, "%s", e.msg); /* loads: the check is separate */
    CHECK(k3_model_check_tensors(m, NULL, &e) == K3_ERR_FORMAT);
    CHECKF(strstr(e.msg, "layers.0.input_layernorm.weight") && strstr(e.msg, "element 5"), "%s", e.msg);
    /* and the forward pass gives non-finite logits, which the sampler refuses */
    k3_ctx *ctx = NULL;
    k3_ctx_options co = {.max_seqs = 1, .cache_tokens = 8};
    REQUIRE(k3_ctx_init(&ctx, m, &co, &e) == K3_OK);
    int32_t ids[2] = {1, 2};
    float logits[1024];
    k3_batch_seq bs = {0, 2, ids};
    REQUIRE(k3_ctx_forward(ctx, &bs, 1, K3_LOGITS_LAST, logits, &e) == K3_OK);
    k3_sampler *s = NULL;
    k3_sampler_options so = {0, 0, 1, 0, 1, 0, 1};
    REQUIRE(k3_sampler_init(&s, &so, 1024, &e) == K3_OK);
    CHECK(k3_sampler_sample(s, logits) == -1);
    k3_sampler_free(s);
    k3_ctx_free(ctx);
    k3_model_close(m);
    k3_model *ok = NULL;
    REQUIRE(k3_model_open(&ok, TINY, &e) == K3_OK);
    int64_t checked = 0;
    CHECK(k3_model_check_tensors(ok, &checked, &e) == K3_OK && checked > 500);
    k3_model_close(ok);
    rm_tmp(dir);
}

/* ---- long runs: the split regex and Kimi's slicing ----------------------- */

static k3_tokenizer *kimi_o200k(void) {
    k3_tokenizer *t = NULL;
    k3_error e = {0};
    if (k3_tokenizer_open_paths(&t, O200K, KIMI_CONFIG, K3_PATTERN_KIMI, &e) != K3_OK)
        k3_test_fail(__FILE__, __LINE__, "%s", e.msg);
    return t;
}

/* A run of identical letters hits PCRE2's match limit from about 5 M (10 M
 * for spaces; measured with the split alone, before slicing): sliced, a
 * 6 M-letter run encodes and decodes back (about 2 s here). */
K3_TEST(hostile_long_identical_run) {
    const size_t N = 6u * 1000 * 1000;
    char *s = malloc(N);
    REQUIRE(s);
    k3_tokenizer *t = kimi_o200k();
    REQUIRE(t);
    const char fill[] = {'a'};
    for (int k = 0; k < 1; k++) {
        memset(s, fill[k], N);
        int32_t *ids = NULL;
        size_t n = 0;
        k3_error e = {0};
        CHECKF(k3_tokenizer_encode(t, s, N, &ids, &n, &e) == K3_OK, "'%c' x 6M: %s", fill[k], e.msg);
        CHECK(n > 0);
        char *back = NULL;
        size_t len = 0;
        if (ids) CHECK(k3_tokenizer_decode(t, ids, n, &back, &len, &e) == K3_OK && len == N && !memcmp(back, s, N));
        free(back);
        free(ids);
    }
    k3_tokenizer_free(t);
    free(s);
}

/* The slicing reproduces tokenization_kimi.py id for id (golden written by
 * tools/gen_long_split_golden.py; the same recipe). */
K3_TEST(tokenizer_long_runs_golden) {
    static const struct {
        const char *piece;
        int times;
    } recipe[] = {{"x", 30001},
                  {" ", 25001},
                  {"h\xc3\xa9llo w\xc3\xb6rld, ", 1},
                  {"\xe3\x80\x80", 26000},
                  {"\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e", 9000},
                  {"\n", 30000},
                  {"ab ", 150000},
                  {"z", 70000}};
    size_t len = 0;
    for (size_t i = 0; i < sizeof recipe / sizeof recipe[0]; i++) len += strlen(recipe[i].piece) * recipe[i].times;
    char *s = malloc(len), *q = s;
    REQUIRE(s);
    for (size_t i = 0; i < sizeof recipe / sizeof recipe[0]; i++)
        for (int k = 0; k < recipe[i].times; k++) {
            memcpy(q, recipe[i].piece, strlen(recipe[i].piece));
            q += strlen(recipe[i].piece);
        }
    size_t gn;
    char *g = slurp("tests/golden/tokenizer-long/long_split.txt", &gn);
    REQUIREF(g, "cannot read tests/golden/tokenizer-long/long_split.txt");
    unsigned long long cps, want_n, want_h;
    REQUIRE(sscanf(g, "%llu %llu %llx", &cps, &want_n, &want_h) == 3);
    free(g);
    k3_tokenizer *t = kimi_o200k();
    REQUIRE(t);
    int32_t *ids = NULL;
    size_t n = 0;
    k3_error e = {0};
    REQUIREF(k3_tokenizer_encode(t, s, len, &ids, &n, &e) == K3_OK, "%s", e.msg);
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        for (int b = 0; b < 4; b++) h = (h ^ (((uint32_t)ids[i] >> (8 * b)) & 0xFF)) * 0x100000001b3ull;
    CHECKF(n == want_n && h == want_h, "%zu ids hash %016llx, want %llu ids hash %016llx", n, (unsigned long long)h,
           want_n, want_h);
    free(ids);
    k3_tokenizer_free(t);
    free(s);
}
