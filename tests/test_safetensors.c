/*
 * test_safetensors.c -- the safetensors parser on images built in memory
 * (good, and each malformed case), and k3_st_open on files written to a
 * temporary directory (single file, sharded index, truncated, missing).
 */
#include "test.h"
#include "common/error.h"
#include "model/safetensors.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* An image: u64 header length | header | data_size bytes (byte i = i & 255). */
static uint8_t *image(const char *header, size_t data_size, size_t *size) {
    size_t h = strlen(header);
    *size = 8 + h + data_size;
    uint8_t *b = malloc(*size);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    for (size_t i = 0; i < data_size; i++) b[8 + h + i] = (uint8_t)i;
    return b;
}

/* Parses header + data into a fresh set. On success the caller closes *st
 * and frees *buf (the set points into it); on failure both are NULL. */
static k3_status parse_image(const char *header, size_t data_size, k3_st **st, uint8_t **buf, k3_error *e) {
    size_t size;
    *buf = image(header, data_size, &size);
    k3_err_clear(e);
    k3_st_init(st, e);
    k3_status s = k3_st_parse(*st, *buf, size, 0, "model.safetensors", e);
    if (s != K3_OK) {
        k3_st_close(*st);
        free(*buf);
        *st = NULL;
        *buf = NULL;
    }
    return s;
}

static void done(k3_st *st, uint8_t *buf) {
    k3_st_close(st);
    free(buf);
}

#define GOOD_HEADER \
    "{\"__metadata__\": {\"format\": \"pt\"}," \
    " \"a.weight\": {\"dtype\": \"BF16\", \"shape\": [2, 3], \"data_offsets\": [0, 12]}," \
    " \"b.bias\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [12, 28]}," \
    " \"c.scale\": {\"dtype\": \"U8\", \"shape\": [2, 2], \"data_offsets\": [28, 32]}," \
    " \"empty\": {\"dtype\": \"F32\", \"shape\": [0, 5], \"data_offsets\": [32, 32]}}"

K3_TEST(st_parse_good) {
    k3_st *st;
    uint8_t *buf;
    k3_error e;
    REQUIREF(parse_image(GOOD_HEADER, 32, &st, &buf, &e) == K3_OK, "%s", e.msg);
    CHECK(k3_st_count(st) == 4);
    const k3_st_tensor *a = k3_st_get(st, "a.weight");
    REQUIRE(a);
    CHECK(a->dtype == K3_DTYPE_BF16 && a->ndim == 2 && a->shape[0] == 2 && a->shape[1] == 3);
    CHECK(a->nbytes == 12 && a->file == 0);
    const k3_st_tensor *b = k3_st_get(st, "b.bias");
    REQUIRE(b);
    CHECK(b->dtype == K3_DTYPE_F32 && b->nbytes == 16);
    CHECK(b->data - a->data == 12 && b->data[0] == 12); /* data byte i = i */
    const k3_st_tensor *z = k3_st_get(st, "empty");
    REQUIRE(z);
    CHECK(z->nbytes == 0 && z->shape[0] == 0);
    CHECK(k3_st_get(st, "__metadata__") == NULL);
    CHECK(k3_st_get(st, "missing") == NULL);
    CHECK(k3_st_bytes(st, "") == 32);
    CHECK(k3_st_bytes(st, "b.") == 16);
    CHECK(k3_st_bytes(st, "zzz") == 0);
    CHECK(!strcmp(k3_dtype_name(K3_DTYPE_BF16), "BF16") && k3_dtype_size(K3_DTYPE_F32) == 4);
    int seen = 0;
    for (int64_t i = 0; i < k3_st_count(st); i++) seen += k3_st_at(st, i) != NULL;
    CHECK(seen == 4 && k3_st_at(st, 4) == NULL);
    done(st, buf);
}

#define EXPECT_BAD(status_, needle, header, data_size) \
    do { \
        k3_st *st_; \
        k3_error e_; \
        uint8_t *b_; \
        k3_status s_ = parse_image(header, data_size, &st_, &b_, &e_); \
        CHECKF(s_ == (status_), "status %d (%s), want %d", (int)s_, e_.msg, (int)(status_)); \
        CHECKF(strstr(e_.msg, needle), "message '%s' lacks '%s'", e_.msg, needle); \
        CHECKF(strstr(e_.msg, "model.safetensors"), "message '%s' lacks the file", e_.msg); \
        if (st_) done(st_, b_); \
    } while (0)

K3_TEST(st_parse_header_length) {
    /* Header length past the end: claim 1000 bytes in a 40-byte file. */
    uint8_t b[40] = {0};
    b[0] = 0xe8;
    b[1] = 0x03;
    k3_st *st;
    k3_error e;
    k3_err_clear(&e);
    k3_st_init(&st, &e);
    CHECK(k3_st_parse(st, b, sizeof b, 0, "x.safetensors", &e) == K3_ERR_FORMAT);
    CHECK(strstr(e.msg, "header length 1000 runs past the end of the file (size 40)") != NULL);
    /* A huge length does not overflow. */
    memset(b, 0xff, 8);
    k3_err_clear(&e);
    CHECK(k3_st_parse(st, b, sizeof b, 0, "x.safetensors", &e) == K3_ERR_FORMAT);
    /* Too small for a length. */
    k3_err_clear(&e);
    CHECK(k3_st_parse(st, b, 7, 0, "x.safetensors", &e) == K3_ERR_FORMAT);
    CHECK(k3_st_count(st) == 0);
    k3_st_close(st);
    EXPECT_BAD(K3_ERR_FORMAT, "not a JSON object", "[1, 2]", 0);
    EXPECT_BAD(K3_ERR_FORMAT, "invalid header JSON", "{\"a\": ", 0);
}

K3_TEST(st_parse_offsets_past_end) {
    EXPECT_BAD(K3_ERR_FORMAT, "tensor 'b.bias' data_offsets [12,28] run past the end of the file (size", GOOD_HEADER,
               20);
    EXPECT_BAD(K3_ERR_FORMAT, "end before they begin",
               "{\"x\": {\"dtype\": \"U8\", \"shape\": [0], \"data_offsets\": [5, 4]}}", 8);
    EXPECT_BAD(K3_ERR_FORMAT, "data_offsets", "{\"x\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [-2, 0]}}",
               8);
}

K3_TEST(st_parse_overlap) {
    EXPECT_BAD(K3_ERR_FORMAT, "overlap",
               "{\"x\": {\"dtype\": \"U8\", \"shape\": [8], \"data_offsets\": [0, 8]},"
               " \"y\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [6, 10]}}",
               16);
    /* Reported with both names, in either header order. */
    EXPECT_BAD(K3_ERR_FORMAT, "'x'",
               "{\"y\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [2, 6]},"
               " \"x\": {\"dtype\": \"U8\", \"shape\": [8], \"data_offsets\": [0, 8]}}",
               16);
    /* Touching is fine, and so is an empty tensor inside another's range. */
    k3_st *st;
    uint8_t *buf;
    k3_error e;
    CHECK(parse_image("{\"x\": {\"dtype\": \"U8\", \"shape\": [8], \"data_offsets\": [0, 8]},"
                      " \"e\": {\"dtype\": \"U8\", \"shape\": [0], \"data_offsets\": [4, 4]},"
                      " \"y\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [8, 12]}}",
                      16, &st, &buf, &e) == K3_OK);
    done(st, buf);
}

K3_TEST(st_parse_nbytes) {
    EXPECT_BAD(K3_ERR_FORMAT, "tensor 'x' holds 12 bytes, but BF16 x shape needs 8",
               "{\"x\": {\"dtype\": \"BF16\", \"shape\": [2, 2], \"data_offsets\": [0, 12]}}", 16);
    EXPECT_BAD(K3_ERR_FORMAT, "shape entry",
               "{\"x\": {\"dtype\": \"BF16\", \"shape\": [2, -2], \"data_offsets\": [0, 8]}}", 16);
    /* A shape whose element count overflows is a mismatch, not a wrap. */
    EXPECT_BAD(K3_ERR_FORMAT, "tensor 'x'",
               "{\"x\": {\"dtype\": \"F32\", \"shape\": [4611686018427387904, 4],"
               " \"data_offsets\": [0, 0]}}",
               16);
    EXPECT_BAD(K3_ERR_FORMAT, "dimensions",
               "{\"x\": {\"dtype\": \"U8\", \"shape\": [1,1,1,1,1,1,1,1,1],"
               " \"data_offsets\": [0, 1]}}",
               16);
}

K3_TEST(st_parse_dtype) {
    EXPECT_BAD(K3_ERR_UNSUPPORTED, "tensor 'x' has unknown dtype 'Q4_K'",
               "{\"x\": {\"dtype\": \"Q4_K\", \"shape\": [2], \"data_offsets\": [0, 2]}}", 8);
    EXPECT_BAD(K3_ERR_FORMAT, "'dtype'", "{\"x\": {\"shape\": [2], \"data_offsets\": [0, 2]}}", 8);
}

K3_TEST(st_parse_duplicate) {
    /* Within one file (JSON duplicate key). */
    EXPECT_BAD(K3_ERR_FORMAT, "x",
               "{\"x\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [0, 2]},"
               " \"x\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [2, 4]}}",
               8);
    /* Across two files of one set; the failed parse adds nothing. */
    const char *h1 = "{\"x\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [0, 2]}}";
    const char *h2 = "{\"y\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [0, 2]},"
                     " \"x\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [2, 4]}}";
    size_t s1, s2;
    uint8_t *b1 = image(h1, 4, &s1), *b2 = image(h2, 4, &s2);
    k3_st *st;
    k3_error e;
    k3_err_clear(&e);
    k3_st_init(&st, &e);
    CHECK(k3_st_parse(st, b1, s1, 0, "a.safetensors", &e) == K3_OK);
    CHECK(k3_st_parse(st, b2, s2, 1, "b.safetensors", &e) == K3_ERR_FORMAT);
    CHECKF(strstr(e.msg, "b.safetensors: tensor 'x' is also in"), "%s", e.msg);
    CHECK(k3_st_count(st) == 1 && k3_st_get(st, "y") == NULL);
    k3_st_close(st);
    free(b1);
    free(b2);
}

K3_TEST(st_many_tensors) {
    /* The name index grows past any fixed size. */
    enum { N = 20000 };
    size_t cap = (size_t)N * 80 + 16, n = 0;
    char *h = malloc(cap);
    n += (size_t)snprintf(h + n, cap - n, "{");
    for (int i = 0; i < N; i++)
        n += (size_t)snprintf(h + n, cap - n,
                              "%s\"layers.%d.w\": {\"dtype\": \"U8\", \"shape\": [1],"
                              " \"data_offsets\": [%d, %d]}",
                              i ? ", " : "", i, i, i + 1);
    snprintf(h + n, cap - n, "}");
    k3_st *st;
    uint8_t *buf;
    k3_error e;
    k3_status s = parse_image(h, N, &st, &buf, &e);
    free(h);
    REQUIREF(s == K3_OK, "%s", e.msg);
    CHECK(k3_st_count(st) == N);
    int ok = 0;
    char name[64];
    for (int i = 0; i < N; i += 7) {
        snprintf(name, sizeof name, "layers.%d.w", i);
        const k3_st_tensor *t = k3_st_get(st, name);
        ok += t && t->data[0] == (uint8_t)i;
    }
    CHECK(ok == (N + 6) / 7);
    CHECK(k3_st_get(st, "layers.20000.w") == NULL);
    CHECK(k3_st_bytes(st, "layers.1") == 1 + 10 + 100 + 1000 + 10000);
    done(st, buf);
}

/* ---- files on disk ----------------------------------------------------------- */

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(data, 1, n, f);
    fclose(f);
}

static void rm_dir(const char *dir) {
    static const char *const names[] = {"model.safetensors", "model.safetensors.index.json", "a.safetensors",
                                        "b.safetensors"};
    char p[512];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        unlink(p);
    }
    rmdir(dir);
}

K3_TEST(st_open_single_and_truncated) {
    char dir[] = "/tmp/k3-st-XXXXXX";
    REQUIRE(mkdtemp(dir));
    size_t size;
    uint8_t *b = image(GOOD_HEADER, 32, &size);
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    write_file(path, b, size);
    k3_st *st;
    k3_error e;
    k3_err_clear(&e);
    CHECKF(k3_st_open(&st, dir, &e) == K3_OK, "%s", e.msg);
    if (st) {
        const k3_st_tensor *t = k3_st_get(st, "c.scale");
        CHECK(t && t->data[0] == 28 && t->nbytes == 4);
        k3_st_close(st);
    }
    /* Truncated: the last tensor now runs past the end. */
    write_file(path, b, size - 3);
    k3_err_clear(&e);
    CHECK(k3_st_open(&st, dir, &e) == K3_ERR_FORMAT && st == NULL);
    CHECKF(strstr(e.msg, "run past the end of the file") && strstr(e.msg, "'c.scale'"), "%s", e.msg);
    /* Truncated inside the header. */
    write_file(path, b, 20);
    k3_err_clear(&e);
    CHECK(k3_st_open(&st, dir, &e) == K3_ERR_FORMAT);
    CHECKF(strstr(e.msg, "header length"), "%s", e.msg);
    /* Empty file. */
    write_file(path, b, 0);
    k3_err_clear(&e);
    CHECK(k3_st_open(&st, dir, &e) == K3_ERR_FORMAT);
    free(b);
    rm_dir(dir);
}

K3_TEST(st_open_missing) {
    k3_st *st;
    k3_error e;
    k3_err_clear(&e);
    CHECK(k3_st_open(&st, "/nonexistent/k3", &e) == K3_ERR_IO && st == NULL);
    CHECKF(strstr(e.msg, "/nonexistent/k3") && strstr(e.msg, "No such file"), "%s", e.msg);
    char dir[] = "/tmp/k3-st-XXXXXX";
    REQUIRE(mkdtemp(dir));
    k3_err_clear(&e);
    CHECK(k3_st_open(&st, dir, &e) == K3_ERR_IO);
    CHECKF(strstr(e.msg, "model.safetensors") && strstr(e.msg, "No such file"), "%s", e.msg);
    rm_dir(dir);
}

K3_TEST(st_open_sharded) {
    char dir[] = "/tmp/k3-st-XXXXXX";
    REQUIRE(mkdtemp(dir));
    char path[512];
    size_t sa, sb;
    uint8_t *a = image("{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 8, &sa);
    uint8_t *b = image("{\"y\": {\"dtype\": \"U8\", \"shape\": [3], \"data_offsets\": [0, 3]},"
                       " \"vision_tower.z\": {\"dtype\": \"U8\", \"shape\": [1],"
                       " \"data_offsets\": [3, 4]}}",
                       4, &sb);
    snprintf(path, sizeof path, "%s/a.safetensors", dir);
    write_file(path, a, sa);
    snprintf(path, sizeof path, "%s/b.safetensors", dir);
    write_file(path, b, sb);
    const char *index = "{\"metadata\": {\"total_size\": 12}, \"weight_map\": {"
                        "\"x\": \"a.safetensors\", \"y\": \"b.safetensors\","
                        " \"vision_tower.z\": \"b.safetensors\"}}";
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    write_file(path, index, strlen(index));
    k3_st *st;
    k3_error e;
    k3_err_clear(&e);
    CHECKF(k3_st_open(&st, dir, &e) == K3_OK, "%s", e.msg);
    if (st) {
        CHECK(k3_st_count(st) == 3);
        const k3_st_tensor *x = k3_st_get(st, "x"), *y = k3_st_get(st, "y");
        CHECK(x && y && x->file != y->file && y->nbytes == 3);
        k3_st_close(st);
    }
    /* The index names a tensor its shard does not hold. */
    index = "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"a.safetensors\"}}";
    write_file(path, index, strlen(index));
    k3_err_clear(&e);
    CHECK(k3_st_open(&st, dir, &e) == K3_ERR_FORMAT);
    CHECKF(strstr(e.msg, "'y'") && strstr(e.msg, "a.safetensors"), "%s", e.msg);
    /* A missing shard. */
    index = "{\"weight_map\": {\"x\": \"a.safetensors\", \"w\": \"c.safetensors\"}}";
    write_file(path, index, strlen(index));
    k3_err_clear(&e);
    CHECK(k3_st_open(&st, dir, &e) == K3_ERR_IO);
    CHECKF(strstr(e.msg, "c.safetensors"), "%s", e.msg);
    /* A shard name that leaves the directory. */
    index = "{\"weight_map\": {\"x\": \"../a.safetensors\"}}";
    write_file(path, index, strlen(index));
    k3_err_clear(&e);
    CHECK(k3_st_open(&st, dir, &e) == K3_ERR_FORMAT);
    /* No weight_map. */
    index = "{\"metadata\": {}}";
    write_file(path, index, strlen(index));
    k3_err_clear(&e);
    CHECK(k3_st_open(&st, dir, &e) == K3_ERR_FORMAT);
    free(a);
    free(b);
    rm_dir(dir);
}
