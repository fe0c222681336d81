/* test_kvstore.c -- the disk tier (src/kvstore) on real contexts: a prompt
 * prefilled on tests/models/tiny (fp32 and C8) and tiny-dsa (past the
 * indexer's top-k) is saved as block runs and KDA snapshots, loaded into a
 * fresh context (other block ids), and the logits of the rest of the prompt
 * and of greedy decode steps equal the cold run's bit for bit; hits end on
 * the latest snapshot within the blocks on disk, after a local hit too;
 * torn, foreign, damaged and other models' files, another salt or quant
 * mode are misses with their reason; two writers of the same keys leave one
 * file each; the byte budget evicts the least recently used; a load keeps
 * what it found while the directory is cleared. (Other processes, a full
 * disk: tests/kvstore.sh with tests/kvstore/driver.c.) */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/engine.h"
#include "kvs_harness.h"
#include "model/model.h"
#include "kvstore/kvstore.h"
#include "test.h"

#define TINY "tests/models/tiny"
#define TINY_DSA "tests/models/tiny-dsa"

enum { BS = 16, NB = 16, MAXN = NB * BS - KVH_DECODE };

typedef struct logbuf {
    char text[8192];
    int n;
} logbuf;

static void logline(void *arg, const char *line) {
    logbuf *l = arg;
    const int len = (int)strlen(line);
    if (l->n + len + 2 < (int)sizeof l->text) {
        memcpy(l->text + l->n, line, (size_t)len);
        l->n += len;
        l->text[l->n++] = '\n';
        l->text[l->n] = 0;
    }
}

static void rm_tree(const char *dir) {
    const char *subs[] = {"runs", "snaps", "tmp"};
    char p[4096];
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, subs[i]);
        DIR *d = opendir(p);
        if (d) {
            struct dirent *de;
            while ((de = readdir(d)))
                if (de->d_name[0] != '.') unlinkat(dirfd(d), de->d_name, 0);
            closedir(d);
        }
        rmdir(p);
    }
    snprintf(p, sizeof p, "%s/usage", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/lock", dir);
    unlink(p);
    rmdir(dir);
}

static int count_files(const char *dir, const char *sub) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, sub);
    DIR *d = opendir(p);
    int n = 0;
    if (!d) return -1;
    struct dirent *de;
    while ((de = readdir(d))) n += de->d_name[0] != '.';
    closedir(d);
    return n;
}

static k3_kvs *open_store(const char *dir, k3_ctx *ctx, uint64_t model, const char *quant, int32_t R, int64_t budget,
                          logbuf *lb) {
    k3_kvs *s = NULL;
    k3_error err = {0};
    k3_kvs_options o = {.dir = dir,
                        .disk_bytes = budget,
                        .ctx = ctx,
                        .model_id = model,
                        .quant = quant,
                        .run_blocks = R,
                        .log = lb ? logline : NULL,
                        .log_arg = lb};
    if (k3_kvs_open(&s, &o, &err)) k3_test_fail(__FILE__, __LINE__, "open: %s", err.msg);
    return s;
}

/* A prompt computed cold in context a: the prefix [0, split) in one pass,
 * the state at each of snaps[] taken on the way (snaps ascending, the last
 * one <= split), then [split, n) and the decode steps with their logits. */
typedef struct cold {
    int32_t tok[NB * BS];
    int64_t n, split;
    int32_t blocks[NB];
    float *logits; /* [(n - split + KVH_DECODE) * V] */
    void *state[4];
    int64_t snap_pos[4];
    int n_snaps;
    void *rows[64]; /* every layer's rows of [0, split) as the cold run left them */
} cold;

static bool run_cold(k3_ctx *a, cold *c, int64_t n, int64_t split, const int64_t *snaps, int n_snaps, unsigned seed) {
    k3_error err = {0};
    const int64_t V = a->c->vocab_size, sb = k3_ctx_state_bytes(a);
    c->n = n;
    c->split = split;
    kvh_ids(c->tok, n, V, seed);
    for (int i = 0; i < NB; i++) c->blocks[i] = i;
    k3_ctx_seq_clear_state(a, 0);
    int64_t at = 0;
    c->n_snaps = n_snaps;
    for (int i = 0; i < n_snaps; i++) {
        if (kvh_run(a, c->blocks, NB, c->tok, at, snaps[i], NULL, &err)) goto fail;
        at = snaps[i];
        c->snap_pos[i] = at;
        c->state[i] = malloc((size_t)sb);
        k3_ctx_state_save(a, 0, c->state[i]);
    }
    if (at < split && kvh_run(a, c->blocks, NB, c->tok, at, split, NULL, &err)) goto fail;
    c->logits = malloc(sizeof(float) * (size_t)((n - split + KVH_DECODE) * V));
    if (kvh_finish(a, c->blocks, NB, c->tok, split, n, c->logits, &err)) goto fail;
    for (int32_t L = 0; L < a->c->n_layers && L < 64; L++) {
        const int64_t bytes = k3_ctx_kv_bytes(a, L, split);
        if (!bytes) continue;
        c->rows[L] = malloc((size_t)bytes);
        if (k3_ctx_kv_read(a, c->blocks, NB, L, 0, split, c->rows[L], &err)) goto fail;
    }
    return true;
fail:
    k3_test_fail(__FILE__, __LINE__, "cold run: %s", err.msg);
    return false;
}

static void cold_free(cold *c) {
    free(c->logits);
    for (int i = 0; i < 64; i++) free(c->rows[i]);
    for (int i = 0; i < c->n_snaps; i++) free(c->state[i]);
}

/* Saves c's prompt blocks (every full block of its n tokens) and snapshots; waits. */
static bool save_cold(k3_kvs *s, const cold *c, uint64_t salt) {
    k3_error err = {0};
    const k3_kvs_seq seq = {.tokens = c->tok, .n_tokens = c->n, .salt = salt};
    uint64_t t[8];
    int nt = 0;
    k3_kvs_done d;
    if (k3_kvs_save_blocks(s, &seq, c->blocks, (int32_t)(c->n / BS), true, 0, &t[nt], &err)) goto fail;
    nt += t[nt] != 0;
    for (int i = 0; i < c->n_snaps; i++) {
        if (k3_kvs_save_snapshot(s, &seq, c->snap_pos[i], c->state[i], 0, 0, &t[nt], &err)) goto fail;
        nt++;
    }
    for (int i = 0; i < nt; i++) {
        if (k3_kvs_wait(s, t[i], &d, &err)) goto fail;
        if (d.status) {
            k3_test_fail(__FILE__, __LINE__, "save: %s", d.why);
            return false;
        }
    }
    return true;
fail:
    k3_test_fail(__FILE__, __LINE__, "save: %s", err.msg);
    return false;
}

/* A fresh context b: blocks [0, n_local) copied from a (a RAM hit), the
 * rest of the hit loaded from s; then the prompt's rest and the decode
 * steps; their logits must equal c's, bit for bit. Returns the hit's tokens
 * (-1: the load failed). */
static bool warm_aligned; /* warm's state buffer on a page (else malloc's: not) */

static int64_t warm(k3_kvs *s, k3_ctx *a, k3_ctx *b, const cold *c, int64_t n_local, uint64_t salt, bool compare,
                    k3_kvs_done *done) {
    k3_error err = {0};
    const int64_t V = b->c->vocab_size, sb = k3_ctx_state_bytes(b);
    int32_t tok[NB * BS], blocks[NB];
    memcpy(tok, c->tok, sizeof(int32_t) * (size_t)c->n);
    for (int i = 0; i < NB; i++) blocks[i] = NB - 1 - i; /* other ids than the cold run's */
    k3_ctx_seq_clear_state(b, 0);
    for (int32_t L = 0; L < a->c->n_layers && n_local; L++) {
        const int64_t bytes = k3_ctx_kv_bytes(a, L, n_local);
        if (!bytes) continue;
        void *rows = malloc((size_t)bytes);
        CHECK(!k3_ctx_kv_read(a, c->blocks, NB, L, 0, n_local, rows, &err));
        CHECK(!k3_ctx_kv_write(b, blocks, NB, L, 0, (int32_t)n_local, rows, &err));
        free(rows);
    }
    const k3_kvs_seq seq = {.tokens = tok, .n_tokens = c->n, .salt = salt};
    k3_kvs_hit *hit = NULL;
    if (k3_kvs_lookup(s, &seq, n_local, c->n - 1, &hit, &err)) {
        k3_test_fail(__FILE__, __LINE__, "lookup: %s", err.msg);
        return -1;
    }
    if (!hit) return 0;
    const int64_t got = k3_kvs_hit_tokens(hit);
    char *state_mem = aligned_alloc(4096, ((size_t)sb + 4095) / 4096 * 4096 + 4096);
    void *state = state_mem && !warm_aligned ? state_mem + 16 : state_mem;
    uint64_t ticket = 0;
    k3_kvs_done d = {0};
    if (k3_kvs_load(s, hit, blocks, state, &ticket, &err) || k3_kvs_wait(s, ticket, &d, &err)) {
        k3_test_fail(__FILE__, __LINE__, "load: %s", err.msg);
        free(state_mem);
        return -1;
    }
    if (done) *done = d;
    if (d.status) {
        free(state_mem);
        return -1;
    }
    if (compare) {
        CHECKF(got == c->split, "hit %lld tokens, the cold run split at %lld", (long long)got, (long long)c->split);
        /* the cache bytes of the prefix are the cold run's */
        for (int32_t L = 0; L < a->c->n_layers && got == c->split; L++) {
            const int64_t bytes = k3_ctx_kv_bytes(a, L, got);
            if (!bytes) continue;
            void *y = malloc((size_t)bytes);
            CHECK(!k3_ctx_kv_read(b, blocks, NB, L, 0, got, y, &err));
            CHECKF(c->rows[L] && !memcmp(c->rows[L], y, (size_t)bytes), "layer %d's rows differ after the load", L);
            free(y);
        }
        k3_ctx_state_restore(b, 0, state);
        float *lg = malloc(sizeof(float) * (size_t)((c->n - got + KVH_DECODE) * V));
        CHECKF(!kvh_finish(b, blocks, NB, tok, got, c->n, lg, &err), "warm run: %s", err.msg);
        CHECKF(!memcmp(lg, c->logits, sizeof(float) * (size_t)((c->n - got + KVH_DECODE) * V)),
               "logits after a disk hit of %lld tokens differ from the cold run's", (long long)got);
        CHECK(!memcmp(tok + c->n, c->tok + c->n, sizeof(int32_t) * KVH_DECODE));
        free(lg);
    }
    free(state_mem);
    return got;
}

static char *tmp_dir_in(const char *base) {
    static char buf[96];
    snprintf(buf, sizeof buf, "%s/k3-kvs-test-XXXXXX", base);
    return mkdtemp(buf);
}

static char *tmp_dir(void) { return tmp_dir_in("/tmp"); }

/* One model and cache format: hits at and between block boundaries, a
 * shorter hit when a run is gone, after a local hit. */
static void roundtrip(const char *model_dir, k3_kv_type kv, int32_t R) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(!k3_model_open(&m, model_dir, &err), "%s", err.msg);
    k3_ctx *a = kvh_ctx(m, kv, BS, NB, &err), *b = kvh_ctx(m, kv, BS, NB, &err);
    REQUIREF(a && b, "%s", err.msg);
    char *dir = tmp_dir();
    REQUIRE(dir);
    logbuf lb = {0};
    k3_kvs *s = open_store(dir, a, 42, "none", R, 1ll << 30, &lb),
           *sb = open_store(dir, b, 42, "none", R, 1ll << 30, &lb);
    REQUIRE(s && sb);
    /* 87 tokens: snapshots at 32 and 80, the hit ends on 80 (between block
     * boundaries: the prompt's last full block is 5) */
    {
        cold c = {0};
        const int64_t snaps[] = {32, 80};
        REQUIRE(run_cold(a, &c, 87, 80, snaps, 2, 1));
        REQUIRE(save_cold(s, &c, 0));
        CHECK(warm(sb, a, b, &c, 0, 0, true, NULL) == 80);
        /* after a local hit of two blocks */
        CHECK(warm(sb, a, b, &c, 32, 0, true, NULL) == 80);
        /* a local hit that already reaches the last snapshot: nothing more */
        CHECK(warm(sb, a, b, &c, 80, 0, false, NULL) == 0);
        /* another salt (tenant) finds nothing */
        CHECK(warm(sb, a, b, &c, 0, 7, false, NULL) == 0);
        cold_free(&c);
    }
    /* 96 tokens (on the grid): the hit leaves the last block to compute */
    {
        cold c = {0};
        const int64_t snaps[] = {48, 80};
        REQUIRE(run_cold(a, &c, 96, 80, snaps, 2, 2));
        REQUIRE(save_cold(s, &c, 0));
        CHECK(warm(sb, a, b, &c, 0, 0, true, NULL) == 80);
        /* the run that holds block 4 gone: the hit falls back to the snapshot at 48 */
        if (R > 0 && R <= 2) {
            char path[4096];
            const k3_kvs_seq seq = {.tokens = c.tok, .n_tokens = c.n};
            k3_kvs_path(s, &seq, 6, false, path, sizeof path); /* blocks 4..5 */
            CHECKF(!unlink(path), "%s: no such run", path);
            /* compare against a cold run split at 48 */
            const int64_t snaps2[] = {48};
            cold c3 = {0};
            REQUIRE(run_cold(a, &c3, 96, 48, snaps2, 1, 2));
            CHECK(warm(sb, a, b, &c3, 0, 0, true, NULL) == 48);
            cold_free(&c3);
        }
        cold_free(&c);
    }
    k3_kvs_metrics mt, ma;
    k3_kvs_get_metrics(sb, &mt);
    k3_kvs_get_metrics(s, &ma);
    CHECK(mt.lookup_hits >= 3 && mt.hit_tokens > 0 && ma.bytes_written > 0 && mt.bytes_read > 0);
    CHECK(mt.loads_failed == 0 && ma.saves_failed == 0);
    CHECKF(mt.dir_bytes > 0, "the shared counter says %lld bytes", (long long)mt.dir_bytes);
    k3_kvs_close(s);
    k3_kvs_close(sb);
    rm_tree(dir);
    k3_ctx_free(a);
    k3_ctx_free(b);
    k3_model_close(m);
}

K3_TEST(kvstore_roundtrip_tiny_f32) { roundtrip(TINY, K3_KV_F32, 2); }
K3_TEST(kvstore_roundtrip_tiny_c8) { roundtrip(TINY, K3_KV_C8, 2); }
K3_TEST(kvstore_roundtrip_dsa_f32) { roundtrip(TINY_DSA, K3_KV_F32, 2); }
K3_TEST(kvstore_roundtrip_dsa_c8_default_runs) { roundtrip(TINY_DSA, K3_KV_C8, 0); }

/* Files refused with their reason: torn, foreign, another model's, a
 * damaged payload (found at load, the file removed); another quant mode
 * shares nothing. */
K3_TEST(kvstore_refusals) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(!k3_model_open(&m, TINY, &err), "%s", err.msg);
    k3_ctx *a = kvh_ctx(m, K3_KV_F32, BS, NB, &err), *b = kvh_ctx(m, K3_KV_F32, BS, NB, &err);
    REQUIRE(a && b);
    char *dir = tmp_dir();
    REQUIRE(dir);
    logbuf lb = {0};
    k3_kvs *s = open_store(dir, a, 42, "none", 2, 1ll << 30, &lb);
    k3_kvs *other = open_store(dir, a, 43, "none", 2, 1ll << 30, NULL);
    k3_kvs *quant = open_store(dir, b, 42, "w8a8", 2, 1ll << 30, NULL);
    k3_kvs *sb = open_store(dir, b, 42, "none", 2, 1ll << 30, &lb);
    REQUIRE(s && other && quant && sb);
    cold c = {0};
    const int64_t snaps[] = {64};
    REQUIRE(run_cold(a, &c, 70, 64, snaps, 1, 3));
    REQUIRE(save_cold(s, &c, 0));
    REQUIRE(save_cold(other, &c, 0));
    CHECK(warm(sb, a, b, &c, 0, 0, true, NULL) == 64);
    CHECK(warm(quant, a, b, &c, 0, 0, false, NULL) == 0); /* another quant mode: other keys */
    const k3_kvs_seq seq = {.tokens = c.tok, .n_tokens = c.n};
    char path[4096], opath[4096];
    k3_kvs_metrics m0, m1;
    /* torn: the run of blocks 2..3 cut short -> the hit stops at the snapshot it cannot reach */
    k3_kvs_path(s, &seq, 4, false, path, sizeof path);
    REQUIRE(!truncate(path, 5000));
    k3_kvs_get_metrics(sb, &m0);
    CHECK(warm(sb, a, b, &c, 0, 0, false, NULL) == 0);
    k3_kvs_get_metrics(sb, &m1);
    CHECK(m1.misses[K3_KVS_MISS_TORN] == m0.misses[K3_KVS_MISS_TORN] + 1);
    CHECKF(strstr(lb.text, "torn"), "log: %s", lb.text);
    /* foreign: garbage in its place */
    FILE *f = fopen(path, "w");
    REQUIRE(f);
    fputs("this is not a cache file, but it is long enough to have a header's size ....................\n", f);
    for (int i = 0; i < 64; i++) fputs("................................................................\n", f);
    fclose(f);
    CHECK(warm(sb, a, b, &c, 0, 0, false, NULL) == 0);
    k3_kvs_get_metrics(sb, &m1);
    CHECK(m1.misses[K3_KVS_MISS_FOREIGN] == m0.misses[K3_KVS_MISS_FOREIGN] + 1);
    /* another model's file under this model's name */
    k3_kvs_path(other, &seq, 4, false, opath, sizeof opath);
    REQUIRE(!rename(opath, path));
    CHECK(warm(sb, a, b, &c, 0, 0, false, NULL) == 0);
    k3_kvs_get_metrics(sb, &m1);
    CHECK(m1.misses[K3_KVS_MISS_MODEL] == m0.misses[K3_KVS_MISS_MODEL] + 1);
    CHECKF(strstr(lb.text, "another model"), "log: %s", lb.text);
    /* rewritten: found again */
    REQUIRE(!unlink(path));
    REQUIRE(save_cold(s, &c, 0));
    CHECK(warm(sb, a, b, &c, 0, 0, true, NULL) == 64);
    /* a damaged payload byte: the load fails (never a wrong token) and the file goes */
    int fd = open(path, O_RDWR);
    REQUIRE(fd >= 0);
    struct stat st;
    REQUIRE(!fstat(fd, &st));
    char byte; /* a byte of the last block (the file ends with its padding to a page) */
    const off_t at = st.st_size - (off_t)((k3_kvs_block_bytes(sb) + 4095) / 4096 * 4096) + 100;
    REQUIRE(pread(fd, &byte, 1, at) == 1);
    byte ^= 0x10;
    REQUIRE(pwrite(fd, &byte, 1, at) == 1);
    close(fd);
    k3_kvs_done d = {0};
    CHECK(warm(sb, a, b, &c, 0, 0, false, &d) == -1);
    CHECKF(d.status == K3_ERR_FORMAT && strstr(d.why, "checksum"), "load: %d %s", d.status, d.why);
    CHECK(access(path, F_OK) != 0);
    k3_kvs_get_metrics(sb, &m1);
    CHECK(m1.misses[K3_KVS_MISS_CHECKSUM] == m0.misses[K3_KVS_MISS_CHECKSUM] + 1 && m1.loads_failed == 1);
    CHECK(warm(sb, a, b, &c, 0, 0, false, NULL) == 0);
    /* a damaged snapshot */
    REQUIRE(save_cold(s, &c, 0));
    k3_kvs_path(s, &seq, 4, true, path, sizeof path);
    fd = open(path, O_RDWR);
    REQUIRE(fd >= 0);
    REQUIRE(pwrite(fd, "XYZ", 3, 8192) == 3);
    close(fd);
    CHECK(warm(sb, a, b, &c, 0, 0, false, &d) == -1);
    CHECKF(d.status == K3_ERR_FORMAT && strstr(d.why, "snaps/"), "load: %s", d.why);
    cold_free(&c);
    k3_kvs_close(s);
    k3_kvs_close(other);
    k3_kvs_close(quant);
    k3_kvs_close(sb);
    rm_tree(dir);
    k3_ctx_free(a);
    k3_ctx_free(b);
    k3_model_close(m);
}

/* The payloads' two paths: O_DIRECT where the directory's filesystem does
 * it (the pieces not aligned, tiny-dsa C8's 64-byte index scale rows and a
 * state buffer off a page, through a bounce buffer), else the page cache
 * (tmpfs; or asked for): files written on one path read on the other give
 * the cold run's logits; the path is said in the log and the metrics. A
 * file of the previous format version is refused, not misread. */
static void io_paths(const char *base, bool want_direct) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(!k3_model_open(&m, TINY_DSA, &err), "%s", err.msg);
    k3_ctx *a = kvh_ctx(m, K3_KV_C8, BS, NB, &err), *b = kvh_ctx(m, K3_KV_C8, BS, NB, &err);
    REQUIREF(a && b, "%s", err.msg);
    char *dir = tmp_dir_in(base);
    REQUIREF(dir, "%s: %s", base, strerror(errno));
    logbuf lb = {0};
    k3_kvs *s = open_store(dir, a, 42, "none", 2, 1ll << 30, &lb);
    REQUIRE(s);
    const char *why = NULL, *io = k3_kvs_io(s, &why);
    CHECKF(strstr(lb.text, io) && strstr(lb.text, why), "the log says the path: %s", lb.text);
    if (want_direct && strcmp(io, "direct")) {
        k3_kvs_close(s);
        rm_tree(dir);
        k3_ctx_free(a);
        k3_ctx_free(b);
        k3_model_close(m);
        SKIP("%s: %s I/O (%s)", base, io, why);
    }
    if (!want_direct) CHECKF(!strcmp(io, "buffered"), "%s: %s I/O (%s)", base, io, why);
    /* the other path: buffered where s is direct, and the reverse */
    k3_kvs_options o = {.dir = dir,
                        .disk_bytes = 1ll << 30,
                        .ctx = b,
                        .model_id = 42,
                        .quant = "none",
                        .run_blocks = 2,
                        .buffered = true};
    k3_kvs *sb = NULL;
    REQUIREF(!k3_kvs_open(&sb, &o, &err), "%s", err.msg);
    CHECK(!strcmp(k3_kvs_io(sb, NULL), "buffered"));
    cold c = {0};
    const int64_t snaps[] = {32, 80};
    REQUIRE(run_cold(a, &c, 87, 80, snaps, 2, 5));
    REQUIRE(save_cold(s, &c, 0));
    for (int al = 0; al < 2; al++) {
        warm_aligned = al;
        CHECKF(warm(sb, a, b, &c, 0, 0, true, NULL) == 80, "written %s, read buffered", io);
        CHECKF(warm(s, a, b, &c, 0, 0, true, NULL) == 80, "written and read %s", io);
        CHECKF(warm(s, a, b, &c, 32, 0, true, NULL) == 80, "read %s after a local hit", io);
    }
    warm_aligned = false;
    k3_kvs_metrics ms, mb;
    k3_kvs_get_metrics(s, &ms);
    k3_kvs_get_metrics(sb, &mb);
    CHECK(!mb.direct && mb.bytes_bounced == 0);
    if (want_direct) {
        CHECK(ms.direct);
        /* tiny rows: most pieces are under the 512 bytes O_DIRECT moves at least; some are not */
        CHECKF(ms.bytes_bounced > 0 && ms.bytes_bounced < ms.bytes_read + ms.bytes_written,
               "%lld of %lld bytes through the bounce buffer", (long long)ms.bytes_bounced,
               (long long)(ms.bytes_read + ms.bytes_written));
    }
    /* written buffered, read direct */
    rm_tree(dir);
    REQUIRE(!mkdir(dir, 0755));
    k3_kvs_close(sb);
    o.ctx = a;
    REQUIREF(!k3_kvs_open(&sb, &o, &err), "%s", err.msg);
    k3_kvs_close(s);
    s = open_store(dir, b, 42, "none", 2, 1ll << 30, NULL);
    REQUIRE(s);
    REQUIRE(save_cold(sb, &c, 0));
    CHECKF(warm(s, a, b, &c, 0, 0, true, NULL) == 80, "written buffered, read %s", io);
    /* the previous format version under this one's name: refused, a miss */
    const k3_kvs_seq seq = {.tokens = c.tok, .n_tokens = c.n};
    char path[4096];
    k3_kvs_path(s, &seq, 4, false, path, sizeof path);
    int fd = open(path, O_RDWR);
    REQUIRE(fd >= 0);
    const uint32_t v2 = 2;
    REQUIRE(pwrite(fd, &v2, 4, 8) == 4); /* the version follows the 8-byte magic */
    close(fd);
    k3_kvs_metrics m0, m1;
    k3_kvs_get_metrics(s, &m0);
    CHECK(warm(s, a, b, &c, 0, 0, false, NULL) == 32); /* up to the snapshot before that run */
    k3_kvs_get_metrics(s, &m1);
    CHECK(m1.misses[K3_KVS_MISS_FOREIGN] == m0.misses[K3_KVS_MISS_FOREIGN] + 1);
    cold_free(&c);
    k3_kvs_close(s);
    k3_kvs_close(sb);
    rm_tree(dir);
    k3_ctx_free(a);
    k3_ctx_free(b);
    k3_model_close(m);
}

K3_TEST(kvstore_io_direct) { io_paths("/tmp", true); }
K3_TEST(kvstore_io_buffered_tmpfs) {
    struct stat st;
    if (stat("/dev/shm", &st) || !S_ISDIR(st.st_mode)) SKIP("no /dev/shm (tmpfs) here");
    io_paths("/dev/shm", false);
}

typedef struct writer_arg {
    k3_kvs *s;
    const cold *c;
    bool ok;
} writer_arg;

static void *writer_thread(void *arg) {
    writer_arg *w = arg;
    w->ok = save_cold(w->s, w->c, 0);
    return NULL;
}

/* Two stores (as two instances) writing the same keys at once: one file per
 * key, nothing left in tmp/, the counter equal to the files, and the result loads. */
K3_TEST(kvstore_concurrent_writers) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(!k3_model_open(&m, TINY, &err), "%s", err.msg);
    k3_ctx *a = kvh_ctx(m, K3_KV_F32, BS, NB, &err), *b = kvh_ctx(m, K3_KV_F32, BS, NB, &err);
    REQUIRE(a && b);
    char *dir = tmp_dir();
    REQUIRE(dir);
    k3_kvs *s1 = open_store(dir, a, 42, "none", 1, 1ll << 30, NULL),
           *s2 = open_store(dir, a, 42, "none", 1, 1ll << 30, NULL);
    k3_kvs *sb = open_store(dir, b, 42, "none", 1, 1ll << 30, NULL);
    REQUIRE(s1 && s2);
    cold c = {0};
    const int64_t snaps[] = {16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192};
    REQUIRE(run_cold(a, &c, 200, 192, snaps, 4, 4));
    for (int rep = 0; rep < 3; rep++) {
        writer_arg w1 = {s1, &c, false}, w2 = {s2, &c, false};
        pthread_t t1, t2;
        pthread_create(&t1, NULL, writer_thread, &w1);
        pthread_create(&t2, NULL, writer_thread, &w2);
        pthread_join(t1, NULL);
        pthread_join(t2, NULL);
        CHECK(w1.ok && w2.ok);
    }
    CHECKF(count_files(dir, "runs") == 12, "%d runs", count_files(dir, "runs"));
    CHECKF(count_files(dir, "snaps") == 4, "%d snapshots", count_files(dir, "snaps"));
    CHECKF(count_files(dir, "tmp") == 0, "%d files left in tmp/", count_files(dir, "tmp"));
    k3_kvcache_info info;
    REQUIREF(!k3_kvcache_scan(dir, &info, &err), "%s", err.msg);
    CHECKF(info.counter_bytes == info.bytes, "counter %lld, files %lld bytes", (long long)info.counter_bytes,
           (long long)info.bytes);
    CHECK(info.n_models == 1 && info.bad_files == 0 && info.models[0].runs == 12 && info.models[0].snaps == 4);
    k3_kvcache_info_free(&info);
    k3_kvs_metrics m1, m2;
    k3_kvs_get_metrics(s1, &m1);
    k3_kvs_get_metrics(s2, &m2);
    CHECKF(m1.runs_written + m2.runs_written == 12 && m1.snaps_written + m2.snaps_written == 4,
           "written %lld + %lld runs", (long long)m1.runs_written, (long long)m2.runs_written);
    /* a split at the snapshot at 64, the prefix computed in the same pieces */
    cold c2 = {0};
    REQUIRE(run_cold(a, &c2, 70, 64, snaps, 4, 4));
    CHECK(warm(sb, a, b, &c2, 0, 0, true, NULL) == 64);
    cold_free(&c2);
    cold_free(&c);
    k3_kvs_close(s1);
    k3_kvs_close(s2);
    k3_kvs_close(sb);
    rm_tree(dir);
    k3_ctx_free(a);
    k3_ctx_free(b);
    k3_model_close(m);
}

/* The budget: the least recently used prompt goes first (a load counts as a
 * use); a load that found its files keeps them while the directory is cleared. */
K3_TEST(kvstore_budget_and_readers) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(!k3_model_open(&m, TINY, &err), "%s", err.msg);
    k3_ctx *a = kvh_ctx(m, K3_KV_F32, BS, NB, &err), *b = kvh_ctx(m, K3_KV_F32, BS, NB, &err);
    REQUIRE(a && b);
    char *dir = tmp_dir();
    REQUIRE(dir);
    logbuf lb = {0};
    k3_kvs *s = open_store(dir, a, 42, "none", 4, 1ll << 30, &lb),
           *sb = open_store(dir, b, 42, "none", 4, 1ll << 30, &lb);
    REQUIRE(s && sb);
    cold c[3];
    memset(c, 0, sizeof c);
    const int64_t snaps[] = {64};
    int64_t one = 0;
    for (int i = 0; i < 3; i++) {
        REQUIRE(run_cold(a, &c[i], 70, 64, snaps, 1, 10 + (unsigned)i));
        k3_kvs_metrics m0;
        k3_kvs_get_metrics(s, &m0);
        REQUIRE(save_cold(s, &c[i], 0));
        if (i == 0) {
            k3_kvs_get_metrics(s, &m0);
            one = m0.dir_bytes;
        }
        usleep(20000); /* distinct mtimes */
    }
    CHECK(one > 0);
    /* prompt 0 used again: prompt 1 is now the least recently used */
    CHECK(warm(sb, a, b, &c[0], 0, 0, true, NULL) == 64);
    REQUIRE(!k3_kvs_evict(s, 2 * one + one / 2, &err));
    CHECK(warm(sb, a, b, &c[1], 0, 0, false, NULL) == 0);
    CHECK(warm(sb, a, b, &c[0], 0, 0, true, NULL) == 64);
    CHECK(warm(sb, a, b, &c[2], 0, 0, true, NULL) == 64);
    k3_kvs_metrics mt;
    k3_kvs_get_metrics(s, &mt);
    CHECKF(mt.evicted_files == 2 && mt.dir_bytes == 2 * one, "evicted %lld files, %lld bytes left",
           (long long)mt.evicted_files, (long long)mt.dir_bytes);
    /* a reader keeps what it found: clear the directory between lookup and load */
    const k3_kvs_seq seq = {.tokens = c[2].tok, .n_tokens = c[2].n};
    k3_kvs_hit *hit = NULL;
    REQUIRE(!k3_kvs_lookup(sb, &seq, 0, c[2].n - 1, &hit, &err) && hit);
    int64_t nf = 0, nbytes = 0;
    REQUIREF(!k3_kvcache_clear(dir, 0, &nf, &nbytes, &err), "%s", err.msg);
    CHECK(nf == 4 && nbytes == 2 * one);
    CHECK(count_files(dir, "runs") == 0);
    int32_t blocks[NB];
    for (int i = 0; i < NB; i++) blocks[i] = i;
    void *state = malloc((size_t)k3_ctx_state_bytes(b));
    uint64_t t = 0;
    k3_kvs_done d;
    REQUIRE(!k3_kvs_load(sb, hit, blocks, state, &t, &err) && !k3_kvs_wait(sb, t, &d, &err));
    CHECKF(!d.status, "a load after the directory was cleared: %s", d.why);
    free(state);
    /* the budget enforced by the writer itself */
    k3_kvs_close(s);
    s = open_store(dir, a, 42, "none", 4, one + one / 2, &lb);
    REQUIRE(s);
    for (int i = 0; i < 3; i++) {
        REQUIRE(save_cold(s, &c[i], 0));
        usleep(20000);
    }
    k3_kvs_get_metrics(s, &mt);
    CHECKF(mt.dir_bytes <= one + one / 2 && mt.evicted_files > 0, "%lld bytes on disk for a budget of %lld",
           (long long)mt.dir_bytes, (long long)(one + one / 2));
    CHECK(warm(sb, a, b, &c[2], 0, 0, true, NULL) == 64);
    for (int i = 0; i < 3; i++) cold_free(&c[i]);
    k3_kvs_close(s);
    k3_kvs_close(sb);
    rm_tree(dir);
    k3_ctx_free(a);
    k3_ctx_free(b);
    k3_model_close(m);
}

/* Bad calls are refused with a message; the default run length fills ~16 MiB. */
K3_TEST(kvstore_arguments) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(!k3_model_open(&m, TINY, &err), "%s", err.msg);
    k3_ctx *a = kvh_ctx(m, K3_KV_F32, BS, NB, &err);
    REQUIRE(a);
    char *dir = tmp_dir();
    REQUIRE(dir);
    k3_kvs *s = NULL;
    k3_kvs_options o = {.dir = dir, .disk_bytes = 0, .ctx = a};
    CHECK(k3_kvs_open(&s, &o, &err) == K3_ERR_ARG && strstr(err.msg, "budget"));
    s = open_store(dir, a, 1, "none", 0, 1 << 20, NULL);
    REQUIRE(s);
    CHECK(k3_kvs_run_blocks(s) == 64 && k3_kvs_block_size(s) == BS);
    CHECK(k3_kvs_block_bytes(s) == 2 * BS * (64 + 16) * 4); /* two MLA layers of f32 latent + rope */
    int32_t tok[64] = {0}, blocks[4] = {0, 1, 2, 99};
    const k3_kvs_seq seq = {.tokens = tok, .n_tokens = 64};
    uint64_t t = 1;
    k3_error e2 = {0};
    CHECK(k3_kvs_save_blocks(s, &seq, blocks, 4, true, 0, &t, &e2) == K3_ERR_ARG && t == 0 && strstr(e2.msg, "99"));
    k3_error e3 = {0};
    CHECK(k3_kvs_save_snapshot(s, &seq, 20, tok, 0, 0, &t, &e3) == K3_ERR_ARG);
    k3_error e4 = {0};
    CHECK(k3_kvs_save_blocks(s, &seq, blocks, 5, true, 0, &t, &e4) == K3_ERR_ARG);
    k3_kvs_hit *hit = (k3_kvs_hit *)1;
    CHECK(!k3_kvs_lookup(s, &seq, 0, 63, &hit, &err) && hit == NULL);
    k3_kvs_close(s);
    rm_tree(dir);
    k3_ctx_free(a);
    k3_model_close(m);
}

/* ---- the disk tier behind the engine (src/engine/disk.c) ------------------------------------ */

typedef struct eng_out {
    int32_t tok[16];
    int n;
    bool done;
    k3_finish_reason fin;
    int64_t n_cached, n_disk;
} eng_out;

static k3_engine *disk_engine(const k3_model *m, const char *dir) {
    const k3_engine_options o = {.max_num_seqs = 4,
                                 .cache_tokens = 2048,
                                 .block_size = BS,
                                 .max_num_batched_tokens = 512,
                                 .kv_cache_dir = dir,
                                 .kv_cache_disk_bytes = 64 << 20,
                                 .quant_name = "none"};
    k3_engine *e = NULL;
    k3_error err = {0};
    if (k3_engine_open(&e, m, &o, &err)) k3_test_fail(__FILE__, __LINE__, "engine: %s", err.msg);
    return e;
}

static uint64_t eng_submit(k3_engine *e, const int32_t *ids, int n, uint64_t salt) {
    const k3_request_params p = {.prompt = ids,
                                 .n_prompt = n,
                                 .max_tokens = 8,
                                 .logprobs = -1,
                                 .prompt_logprobs = -1,
                                 .sampling = {.temperature = 0, .top_p = 1, .repeat_penalty = 1},
                                 .cache_salt = salt};
    uint64_t id = 0;
    k3_error err = {0};
    if (k3_engine_submit(e, &p, &id, &err)) k3_test_fail(__FILE__, __LINE__, "submit: %s", err.msg);
    return id;
}

/* Steps until outs[0 .. n) (ids base ..) are done, checking the block accounting after every
 * step; a step waits for the disk tier when only a load is in flight. cancel: the id to cancel
 * after the first step (0: none). Returns the steps taken, -1 on a failure. */
static int eng_run(k3_engine *e, eng_out *outs, uint64_t base, int n, uint64_t cancel) {
    k3_error err = {0};
    if (!base) return -1; /* the submit failed (and said why) */
    for (int steps = 0; steps < 20000; steps++) {
        bool all = true;
        for (int i = 0; i < n; i++) all &= outs[i].done;
        if (all) return steps;
        if (!k3_engine_has_work(e)) k3_engine_wait(e, 0.05);
        k3_step_result sr;
        if (k3_engine_step(e, &sr, &err)) {
            k3_test_fail(__FILE__, __LINE__, "step: %s", err.msg);
            return -1;
        }
        if (!k3_engine_check(e)) {
            k3_test_fail(__FILE__, __LINE__, "block accounting broken after step %d", steps);
            return -1;
        }
        if (cancel && steps == 0) k3_engine_cancel(e, cancel);
        for (int32_t k = 0; k < sr.n_outputs; k++) {
            const k3_req_output *o = &sr.outputs[k];
            if (o->id < base || o->id >= base + (uint64_t)n) continue;
            eng_out *r = &outs[o->id - base];
            for (int32_t t = 0; t < o->n_new && r->n < 16; t++) r->tok[r->n++] = o->tokens[t];
            if (o->events & K3_EV_FINISHED) {
                r->done = true;
                r->fin = o->finish;
                r->n_cached = o->n_cached;
                r->n_disk = o->n_disk;
            }
        }
    }
    k3_test_fail(__FILE__, __LINE__, "the requests did not finish");
    return -1;
}

/* A restarted engine takes a prompt the directory holds beyond its RAM hit: it waits outside
 * the batch (a cold request beside it runs), loads, lands in the prefix cache and continues with
 * the RAM hit's tokens (the same blocks and state, computed from the same position); every step
 * the references add up (saves hold theirs); a request cancelled while it loads ends and gives
 * everything back; another salt finds nothing. */
K3_TEST(kvstore_engine_connector) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(!k3_model_open(&m, TINY, &err), "%s", err.msg);
    char *dir = tmp_dir();
    REQUIRE(dir);
    int32_t p1[200], p3[150];
    kvh_ids(p1, 200, m->cfg.vocab_size, 41);
    kvh_ids(p3, 150, m->cfg.vocab_size, 43);
    /* A: cold, then a RAM hit; closing it finishes its saves */
    k3_engine *a = disk_engine(m, dir);
    REQUIRE(a);
    eng_out cold1 = {0}, ram = {0};
    uint64_t id = eng_submit(a, p1, 200, 0);
    CHECK(eng_run(a, &cold1, id, 1, 0) >= 0);
    id = eng_submit(a, p1, 200, 0);
    CHECK(eng_run(a, &ram, id, 1, 0) >= 0);
    CHECKF(ram.n_cached == 192 && ram.n_disk == 0, "RAM hit %lld, disk %lld", (long long)ram.n_cached,
           (long long)ram.n_disk);
    k3_engine_close(a);
    /* B: the disk hit, then beside a cold request */
    k3_engine *b = disk_engine(m, dir);
    REQUIRE(b);
    eng_out disk = {0}, two[2];
    memset(two, 0, sizeof two);
    id = eng_submit(b, p1, 200, 0);
    CHECK(eng_run(b, &disk, id, 1, 0) >= 0);
    CHECKF(disk.n_cached == ram.n_cached && disk.n_disk == 192, "disk hit: cached %lld, from disk %lld",
           (long long)disk.n_cached, (long long)disk.n_disk);
    CHECK(disk.n == ram.n && !memcmp(disk.tok, ram.tok, sizeof(int32_t) * (size_t)ram.n));
    k3_disk_stats ds;
    k3_kvs_metrics km;
    REQUIRE(k3_engine_disk_stats(b, &ds, &km));
    CHECK(ds.loads_landed == 1 && ds.ext_hits == 192 && ds.ext_queries == 200 && km.bytes_read > 0);
    k3_engine_close(b);
    k3_engine *c = disk_engine(m, dir);
    REQUIRE(c);
    const uint64_t base = eng_submit(c, p1, 200, 0);
    eng_submit(c, p3, 150, 0);
    CHECK(eng_run(c, two, base, 2, 0) >= 0);
    CHECK(two[0].n_disk == 192 && two[1].n_cached == 0 && two[1].fin == K3_FINISH_LENGTH);
    k3_engine_close(c);
    /* cancelled while it loads (or waits for its blocks): everything goes back */
    k3_engine *d = disk_engine(m, dir);
    REQUIRE(d);
    eng_out cx = {0};
    id = eng_submit(d, p1, 200, 0);
    CHECK(eng_run(d, &cx, id, 1, id) >= 0);
    CHECK(cx.fin == K3_FINISH_CANCELLED && cx.n == 0);
    CHECK(k3_engine_blocks_free(d) == 2048 / BS);
    /* another salt: a miss */
    eng_out salted = {0};
    id = eng_submit(d, p1, 200, 0x5eed);
    CHECK(eng_run(d, &salted, id, 1, 0) >= 0);
    CHECK(salted.n_cached == 0 && salted.n_disk == 0);
    k3_engine_close(d);
    rm_tree(dir);
    k3_model_close(m);
}

/* k3_kvs_wait against the worker finishing the same ticket: a job is either
 * queued, running or done (under one lock), never none of them. Tiny jobs
 * (a snapshot already on disk: a skip), waited at once and after a short
 * spin of 0 to 64 us, many times over, so a waiter arrives while the worker is between
 * the end of a job and its record. */
K3_TEST(kvstore_wait_race) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(!k3_model_open(&m, TINY, &err), "%s", err.msg);
    k3_ctx *a = kvh_ctx(m, K3_KV_F32, BS, NB, &err);
    REQUIRE(a);
    char *dir = tmp_dir();
    REQUIRE(dir);
    k3_kvs *s = open_store(dir, a, 1, "none", 2, 1 << 26, NULL);
    REQUIRE(s);
    void *state = calloc(1, (size_t)k3_kvs_state_bytes(s));
    REQUIRE(state);
    int32_t tok[2 * BS];
    for (int i = 0; i < 2 * BS; i++) tok[i] = i;
    const k3_kvs_seq seq = {.tokens = tok, .n_tokens = 2 * BS};
    int bad = 0;
    char first[640] = "";
    for (int r = 0; r < 30000 && bad < 5; r++) {
        uint64_t t1 = 0, t2 = 0;
        k3_kvs_done d;
        k3_error e = {0};
        if (k3_kvs_save_snapshot(s, &seq, BS, state, 0, 0, &t1, &e) ||
            k3_kvs_save_snapshot(s, &seq, 2 * BS, state, 0, 0, &t2, &e)) {
            bad++;
            snprintf(first, sizeof first, "save: %s", e.msg);
            continue;
        }
        /* 0 to 64 us: around the time the worker takes and ends the job */
        const double until = k3_now() + (double)(r % 256) * 250e-9;
        while (k3_now() < until) {}
        if (k3_kvs_wait(s, t1, &d, &e) || d.status || k3_kvs_wait(s, t2, &d, &e) || d.status) {
            if (!bad) snprintf(first, sizeof first, "round %d: %s", r, e.msg[0] ? e.msg : d.why);
            bad++;
        }
    }
    CHECKF(bad == 0, "%d waits failed, the first: %s", bad, first);
    free(state);
    k3_kvs_close(s);
    rm_tree(dir);
    k3_ctx_free(a);
    k3_model_close(m);
}

/* Steps e until its disk saves are done (they run behind the engine). */
static bool drain_saves(k3_engine *e) {
    k3_error err = {0};
    for (int i = 0; i < 4000; i++) {
        k3_disk_stats ds;
        k3_engine_disk_stats(e, &ds, NULL);
        if (!ds.saving) return true;
        k3_engine_wait(e, 0.01);
        k3_step_result sr;
        if (k3_engine_step(e, &sr, &err)) return false;
    }
    return false;
}

/* The snapshot policy (docs/kvstore.md): on disk, a conversation keeps the state at its latest
 * prompt's end and at the junction where that prompt leaves the cached one (the end of the
 * previous turn's output); stride snapshots stay in RAM; a turn's pair replaces the previous
 * turn's. Three turns of one conversation (each prompt = the previous one, its greedy output and
 * new tokens), the stride every 4 blocks: one file after the first turn, two after each later
 * one, at the positions named; a restart hits the latest prompt's end from disk with the RAM
 * hit's answer. */
K3_TEST(kvstore_snapshot_policy) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(!k3_model_open(&m, TINY, &err), "%s", err.msg);
    k3_ctx *a = kvh_ctx(m, K3_KV_F32, BS, NB, &err);
    REQUIRE(a);
    char *dir = tmp_dir();
    REQUIRE(dir);
    int32_t p[400], fresh[200];
    kvh_ids(p, 201, m->cfg.vocab_size, 51);
    kvh_ids(fresh, 200, m->cfg.vocab_size, 52);
    k3_engine *e = disk_engine(m, dir);
    REQUIRE(e);
    /* turn 1: 201 tokens; snapshots at 64, 128 (stride) and 192 (its end); its output computed
     * up to 208 (the last token is sampled, not computed) */
    eng_out t1 = {0}, t2 = {0}, t3 = {0}, again = {0};
    uint64_t id = eng_submit(e, p, 201, 0);
    CHECK(eng_run(e, &t1, id, 1, 0) >= 0 && t1.n == 8);
    CHECK(drain_saves(e));
    CHECKF(count_files(dir, "snaps") == 1, "after turn 1: %d snapshots on disk", count_files(dir, "snaps"));
    /* turn 2: + its 8 output tokens + 60 = 269; junction 208, end 256 */
    memcpy(p + 201, t1.tok, sizeof(int32_t) * 8);
    memcpy(p + 209, fresh, sizeof(int32_t) * 60);
    id = eng_submit(e, p, 269, 0);
    CHECK(eng_run(e, &t2, id, 1, 0) >= 0 && t2.n == 8);
    CHECK(drain_saves(e));
    CHECKF(count_files(dir, "snaps") == 2, "after turn 2: %d snapshots on disk", count_files(dir, "snaps"));
    /* turn 3: 269 + 8 + 60 = 337; junction 272, end 336 */
    memcpy(p + 269, t2.tok, sizeof(int32_t) * 8);
    memcpy(p + 277, fresh + 60, sizeof(int32_t) * 60);
    id = eng_submit(e, p, 337, 0);
    CHECK(eng_run(e, &t3, id, 1, 0) >= 0 && t3.n == 8);
    CHECK(drain_saves(e));
    k3_disk_stats ds;
    REQUIRE(k3_engine_disk_stats(e, &ds, NULL));
    CHECKF(ds.snaps_ram_only >= 2, "stride snapshots kept in RAM only: %lld", (long long)ds.snaps_ram_only);
    k3_engine_close(e);
    /* which two: the files of a store over the same directory name them */
    k3_kvs *s = open_store(dir, a, k3_model_identity(m), "none", 0, 1 << 26, NULL);
    REQUIRE(s);
    const k3_kvs_seq seq = {.tokens = p, .n_tokens = 337};
    const int64_t want[] = {272 / BS, 336 / BS}, gone[] = {4, 8, 12, 13, 16};
    char path[4096];
    struct stat st;
    for (int i = 0; i < 2; i++) {
        k3_kvs_path(s, &seq, want[i], true, path, sizeof path);
        CHECKF(stat(path, &st) == 0, "no snapshot at %lld on disk", (long long)(want[i] * BS));
    }
    for (int i = 0; i < 5; i++) {
        k3_kvs_path(s, &seq, gone[i], true, path, sizeof path);
        CHECKF(stat(path, &st) != 0, "a snapshot at %lld on disk", (long long)(gone[i] * BS));
    }
    CHECKF(count_files(dir, "snaps") == 2, "after turn 3: %d snapshots on disk", count_files(dir, "snaps"));
    k3_kvs_close(s);
    /* a restart: turn 3 again, from disk up to its prompt's end, with the same answer */
    e = disk_engine(m, dir);
    REQUIRE(e);
    id = eng_submit(e, p, 337, 0);
    CHECK(eng_run(e, &again, id, 1, 0) >= 0);
    CHECKF(again.n_disk == 336 && again.n == t3.n && !memcmp(again.tok, t3.tok, sizeof(int32_t) * 8),
           "after a restart: %lld tokens from disk", (long long)again.n_disk);
    /* a prompt of whole blocks (256): its state at 256 is never found by a resend (which computes
     * at least its last token); the last point before it (192, a stride one) goes to disk */
    int32_t w[256];
    kvh_ids(w, 256, m->cfg.vocab_size, 53);
    eng_out w1 = {0}, w2 = {0};
    id = eng_submit(e, w, 256, 0);
    CHECK(eng_run(e, &w1, id, 1, 0) >= 0);
    CHECK(drain_saves(e));
    CHECKF(count_files(dir, "snaps") == 3, "a prompt of whole blocks: %d snapshots on disk", count_files(dir, "snaps"));
    k3_engine_close(e);
    e = disk_engine(m, dir);
    REQUIRE(e);
    id = eng_submit(e, w, 256, 0);
    CHECK(eng_run(e, &w2, id, 1, 0) >= 0);
    CHECKF(w2.n_disk == 192 && w2.n == w1.n && !memcmp(w2.tok, w1.tok, sizeof(int32_t) * 8),
           "a resend of a prompt of whole blocks after a restart: %lld tokens from disk", (long long)w2.n_disk);
    k3_engine_close(e);
    rm_tree(dir);
    k3_ctx_free(a);
    k3_model_close(m);
}

/* The snapshot policy across a restart. The junction a prompt's end was saved with is in that
 * snapshot's header, so the pair is known again when the state is hit on disk. Two turns, a
 * restart, the third turn: its prefix, the second prompt's end (256), comes from disk with no
 * block of the second turn's output (those blocks were in RAM only), so the third prompt leaves
 * the cached chain right there: 256 is its junction and stays, its end (336) is saved, and the
 * second turn's junction (208) goes: two files, 256 and 336 (before: 208 and 336, the state where
 * the conversation now leaves its chain gone). Another restart, and the third turn with its new
 * message edited (it leaves the conversation at 277) gets the junction's state, 256, from disk,
 * with the text of a cold run of the same prompt. */
K3_TEST(kvstore_junction_restart) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(!k3_model_open(&m, TINY, &err), "%s", err.msg);
    k3_ctx *a = kvh_ctx(m, K3_KV_F32, BS, NB, &err);
    REQUIRE(a);
    char *dir0 = tmp_dir();
    REQUIRE(dir0);
    char dir[64], cold_dir[64];
    snprintf(dir, sizeof dir, "%s", dir0);
    char *cd = tmp_dir();
    REQUIRE(cd);
    snprintf(cold_dir, sizeof cold_dir, "%s", cd);
    int32_t p[400], fresh[200];
    kvh_ids(p, 201, m->cfg.vocab_size, 61);
    kvh_ids(fresh, 200, m->cfg.vocab_size, 62);
    eng_out t1 = {0}, t2 = {0}, t3 = {0}, edited = {0}, cold_run = {0};
    /* turns 1 and 2 (as in kvstore_snapshot_policy): on disk the state at 256 (turn 2's end) and at
     * 208 (its junction) */
    k3_engine *e = disk_engine(m, dir);
    REQUIRE(e);
    uint64_t id = eng_submit(e, p, 201, 0);
    CHECK(eng_run(e, &t1, id, 1, 0) >= 0 && t1.n == 8);
    memcpy(p + 201, t1.tok, sizeof(int32_t) * 8);
    memcpy(p + 209, fresh, sizeof(int32_t) * 60);
    id = eng_submit(e, p, 269, 0);
    CHECK(eng_run(e, &t2, id, 1, 0) >= 0 && t2.n == 8);
    CHECK(drain_saves(e));
    k3_engine_close(e);
    CHECKF(count_files(dir, "snaps") == 2, "after turn 2: %d snapshots on disk", count_files(dir, "snaps"));
    /* a restart, turn 3: 337 tokens, its prefix up to 256 from disk; its pair (256, 336) replaces (208, 256) */
    e = disk_engine(m, dir);
    REQUIRE(e);
    memcpy(p + 269, t2.tok, sizeof(int32_t) * 8);
    memcpy(p + 277, fresh + 60, sizeof(int32_t) * 60);
    id = eng_submit(e, p, 337, 0);
    CHECK(eng_run(e, &t3, id, 1, 0) >= 0 && t3.n == 8);
    CHECKF(t3.n_disk == 256, "turn 3 after a restart: %lld tokens from disk", (long long)t3.n_disk);
    CHECK(drain_saves(e));
    k3_engine_close(e);
    k3_kvs *s = open_store(dir, a, k3_model_identity(m), "none", 0, 1 << 26, NULL);
    REQUIRE(s);
    const k3_kvs_seq seq = {.tokens = p, .n_tokens = 337};
    const int64_t want[] = {256 / BS, 336 / BS}, gone[] = {208 / BS, 272 / BS};
    char path[4096];
    struct stat st;
    for (int i = 0; i < 2; i++) {
        k3_kvs_path(s, &seq, want[i], true, path, sizeof path);
        CHECKF(stat(path, &st) == 0, "no snapshot at %lld on disk", (long long)(want[i] * BS));
        k3_kvs_path(s, &seq, gone[i], true, path, sizeof path);
        CHECKF(stat(path, &st) != 0, "the snapshot at %lld still on disk", (long long)(gone[i] * BS));
    }
    CHECKF(count_files(dir, "snaps") == 2, "after a restart and turn 3: %d snapshots on disk",
           count_files(dir, "snaps"));
    k3_kvs_close(s);
    /* another restart: turn 3 with its new message edited leaves the chain at 277 */
    int32_t q[400];
    memcpy(q, p, sizeof(int32_t) * 277);
    kvh_ids(q + 277, 45, m->cfg.vocab_size, 63);
    e = disk_engine(m, dir);
    REQUIRE(e);
    id = eng_submit(e, q, 322, 0);
    CHECK(eng_run(e, &edited, id, 1, 0) >= 0 && edited.n == 8);
    CHECKF(edited.n_disk == 256, "an edited turn 3 after a restart: %lld tokens from disk, not the junction's 256",
           (long long)edited.n_disk);
    k3_engine_close(e);
    e = disk_engine(m, cold_dir); /* an empty directory: cold */
    REQUIRE(e);
    id = eng_submit(e, q, 322, 0);
    CHECK(eng_run(e, &cold_run, id, 1, 0) >= 0 && cold_run.n == 8 && cold_run.n_disk == 0 && cold_run.n_cached == 0);
    CHECKF(!memcmp(edited.tok, cold_run.tok, sizeof(int32_t) * 8), "the junction's disk hit's text differs from cold");
    k3_engine_close(e);
    rm_tree(dir);
    rm_tree(cold_dir);
    k3_ctx_free(a);
    k3_model_close(m);
}
