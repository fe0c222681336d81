/*
 * test_exec.c -- the executor (src/executor) without a second process:
 *   - every call of ctx.h, forward.h and k3.h that changes a context has a
 *     row in calls.h (mirrored to the other ranks) or says why it stays on
 *     its rank (K3_EXEC_RANK_LOCAL), and the code that drives a context
 *     under mpirun (a file that calls the executor or hands a context a
 *     dist) makes the mirrored calls through the executor only;
 *   - every row's message, replayed on a second context as a serving rank
 *     does, leaves it in the state of the first, bit for bit (a tap records
 *     the messages in one process); the calls through the executor give the
 *     results of the plain calls;
 *   - a message cut short or bent is refused with a message, never a crash.
 * Under mpirun the same messages go over MPI (tests/mpi.sh).
 */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include "ctx/ctx.h"
#include "executor/executor.h"
#include "k3.h"
#include "test.h"

#define TINY_DSA "tests/models/tiny-dsa"

#define ROW_NAME(name, ...) #name,
#define LOCAL_NAME(name) #name,
static const char *const mirrored[] = {K3_EXEC_CALLS(ROW_NAME)};
static const char *const rank_local[] = {K3_EXEC_RANK_LOCAL(LOCAL_NAME)};
#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

static bool listed(const char *const *list, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(list[i], name)) return true;
    return false;
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s) s[n] = 0;
    fclose(f);
    return s;
}

/* The names NAME of the declarations `k3_ctx_NAME(k3_ctx *` and
 * `k3_ctx_NAME(k3_ctx **` in text: the calls that change a context (a
 * const k3_ctx * only reads it). */
static int changing_calls(const char *text, char names[][64], int cap) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, "k3_ctx_")) && n < cap; p++) {
        if (p > text && (p[-1] == '_' || (p[-1] >= 'a' && p[-1] <= 'z'))) continue;
        const char *q = p + 7;
        size_t len = 0;
        while ((q[len] >= 'a' && q[len] <= 'z') || q[len] == '_' || (q[len] >= '0' && q[len] <= '9')) len++;
        if (len == 0 || len >= 64 || strncmp(q + len, "(k3_ctx *", 9)) continue;
        memcpy(names[n], q, len);
        names[n][len] = 0;
        n++;
    }
    return n;
}

K3_TEST(exec_every_changing_ctx_call_is_mirrored) {
    const char *headers[] = {"src/ctx/ctx.h", "src/forward/forward.h", "include/k3.h"};
    int found = 0;
    for (size_t h = 0; h < N_OF(headers); h++) {
        char *text = slurp(headers[h]);
        REQUIREF(text, "cannot read %s", headers[h]);
        char names[128][64];
        const int n = changing_calls(text, names, 128);
        for (int i = 0; i < n; i++) {
            found++;
            CHECKF(listed(mirrored, N_OF(mirrored), names[i]) || listed(rank_local, N_OF(rank_local), names[i]),
                   "k3_ctx_%s (%s) changes a context but has no row in src/executor/calls.h (nor a line in "
                   "K3_EXEC_RANK_LOCAL): under mpirun the other ranks would never make it",
                   names[i], headers[h]);
        }
        free(text);
    }
    /* the scan sees the calls it should (the pattern did not rot) */
    CHECKF(found >= (int)N_OF(mirrored), "found %d changing calls, fewer than the %d rows", found, (int)N_OF(mirrored));
    for (size_t i = 0; i < N_OF(mirrored); i++) CHECK(k3_exec_command(mirrored[i]) >= 0);
}

/* Files of dir ending in .c, checked: one that drives a context under
 * mpirun (calls the executor or gives a context a dist) makes no mirrored
 * call k3_ctx_NAME( itself. */
static void check_dir(const char *dir, int *n_files) {
    DIR *d = opendir(dir);
    if (!d) {
        k3_test_fail(__FILE__, __LINE__, "cannot list %s", dir);
        return;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        const size_t len = strlen(e->d_name);
        if (len < 3 || strcmp(e->d_name + len - 2, ".c")) continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        char *text = slurp(path);
        if (!text) {
            k3_test_fail(__FILE__, __LINE__, "cannot read %s", path);
            continue;
        }
        if (strstr(text, "k3_exec_") || strstr(text, ".dist = ")) {
            (*n_files)++;
            for (size_t i = 0; i < N_OF(mirrored); i++) {
                char call[96];
                snprintf(call, sizeof call, "k3_ctx_%s(", mirrored[i]);
                CHECKF(!strstr(text, call), "%s drives a context under mpirun but calls %s itself: use k3_exec_%s",
                       path, call, mirrored[i]);
            }
        }
        free(text);
    }
    closedir(d);
}

K3_TEST(exec_drivers_call_through_the_executor) {
    int n = 0;
    check_dir("src/engine", &n);
    check_dir("src/server", &n);
    check_dir("cli", &n);
    CHECKF(n >= 3, "only %d files drive a context under mpirun (the engine, k3 run, k3 bench --dcp)", n);
}

/* ---- replay ------------------------------------------------------------------------ */

static k3_model *g_m;

static k3_ctx *make_ctx(bool pool) {
    k3_ctx *c = NULL;
    k3_error err = {0};
    k3_ctx_options o = {.max_seqs = 3, .cache_tokens = 512, .block_size = 16, .max_batch = 24};
    const k3_status s = pool ? k3_ctx_init_pool(&c, g_m, &o, 40, 512, &err) : k3_ctx_init(&c, g_m, &o, &err);
    if (s) k3_test_fail(__FILE__, __LINE__, "context: %s", err.msg);
    return c;
}

/* Every slot's position, block table and KDA state, and every cache slot,
 * alike in a and b. */
static bool same_state(const k3_ctx *a, const k3_ctx *b) {
    const k3_config *c = a->c;
    for (int32_t s = 0; s < a->max_seqs; s++) {
        if (a->seqs[s].pos != b->seqs[s].pos || a->seqs[s].n_blocks != b->seqs[s].n_blocks) return false;
        if (memcmp(a->seqs[s].blocks, b->seqs[s].blocks, sizeof(int32_t) * (size_t)a->seqs[s].n_blocks)) return false;
    }
    const int64_t nb = k3_ctx_state_bytes(a);
    char *x = malloc((size_t)nb), *y = malloc((size_t)nb);
    bool same = x && y;
    for (int32_t s = 0; same && s < a->max_seqs; s++) {
        k3_ctx_state_save(a, s, x);
        k3_ctx_state_save(b, s, y);
        same = !memcmp(x, y, (size_t)nb);
    }
    free(x);
    free(y);
    const int64_t slots = (int64_t)a->n_blocks * a->lbs;
    for (int i = 0; same && i < c->n_layers; i++) {
        if (a->lat_cache[i])
            same = !memcmp(a->lat_cache[i], b->lat_cache[i],
                           sizeof(float) * (size_t)(slots * (c->kv_lora_rank + c->qk_rope_dim)));
        if (same && a->idx_cache[i])
            same = !memcmp(a->idx_cache[i], b->idx_cache[i], sizeof(float) * (size_t)(slots * c->index_head_dim));
    }
    return same;
}

K3_TEST(exec_replay_of_every_row_equals_the_calls) {
    k3_error err = {0};
    REQUIREF(k3_model_open(&g_m, TINY_DSA, &err) == K3_OK, "%s", err.msg);
    k3_model_info info;
    k3_model_get_info(g_m, &info);
    const int64_t V = info.vocab_size, D = info.hidden_size;
    /* a: through the executor, recorded; b: the replay; c: the plain calls */
    k3_ctx *a = make_ctx(false), *b = make_ctx(false), *c = make_ctx(false);
    k3_ctx *pa = make_ctx(true), *pb = make_ctx(true), *pc = make_ctx(true);
    float *la = malloc(sizeof(float) * (size_t)(64 * V)), *lc = malloc(sizeof(float) * (size_t)(64 * V));
    float *row = malloc(sizeof(float) * (size_t)D);
    REQUIRE(a && b && c && pa && pb && pc && la && lc && row);
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = (i * 37 + 11) % (int32_t)V;
    for (int64_t i = 0; i < D; i++) row[i] = (float)((i * 7919) % 201 - 100) / 400.0f;
    const float *erow[40] = {0};
    for (int i = 3; i < 9; i++) erow[i] = row; /* rows replacing six embeddings: 6 KB, broadcast apart */

    /* the simple context of k3 run and k3 bench: forward, reset, fill */
    k3_exec_tap t1 = {0}, t2 = {0};
    k3_exec_set_tap(&t1);
    k3_batch_seq bt[2] = {{0, 12, ids, erow}, {1, 7, ids + 12, NULL}};
    CHECK(k3_exec_forward(a, bt, 2, K3_LOGITS_ALL, la, &err) == K3_OK);
    CHECK(k3_exec_seq_fill_synthetic(a, 2, 40, 7, &err) == K3_OK);
    k3_batch_seq b1[2] = {{0, 1, ids + 20, NULL}, {2, 3, ids + 21, NULL}};
    CHECK(k3_exec_forward(a, b1, 2, K3_LOGITS_LAST, la, &err) == K3_OK);
    k3_exec_seq_reset(a, 1);
    k3_batch_seq b2 = {1, 5, ids + 30, NULL};
    CHECK(k3_exec_forward(a, &b2, 1, K3_LOGITS_NONE, NULL, &err) == K3_OK);
    k3_exec_set_tap(NULL);
    CHECK(k3_ctx_forward(c, bt, 2, K3_LOGITS_ALL, lc, &err) == K3_OK);
    CHECK(k3_ctx_seq_fill_synthetic(c, 2, 40, 7, &err) == K3_OK);
    CHECK(k3_ctx_forward(c, b1, 2, K3_LOGITS_LAST, lc, &err) == K3_OK);
    k3_ctx_seq_reset(c, 1);
    CHECK(k3_ctx_forward(c, &b2, 1, K3_LOGITS_NONE, NULL, &err) == K3_OK);
    CHECKF(k3_exec_replay(b, &t1, &err) == K3_OK, "%s", err.msg);
    CHECK(!memcmp(la, lc, sizeof(float) * (size_t)(2 * V))); /* the last logits: the plain call's */
    CHECK(same_state(a, b));
    CHECK(same_state(a, c));

    /* the engine's pool context: blocks, positions, state, runs */
    const int32_t blk0[3] = {5, 2, 9}, blk1[2] = {7, 1};
    const uint8_t want[2] = {K3_WANT_ALL, K3_WANT_LAST}, want2[2] = {K3_WANT_LAST, K3_WANT_NONE};
    k3_batch_seq r0[2] = {{0, 20, ids, erow}, {1, 9, ids + 20, NULL}};
    k3_batch_seq r1[2] = {{0, 1, ids + 33, NULL}, {1, 1, ids + 34, NULL}};
    const int64_t sb = k3_ctx_state_bytes(pa);
    char *snap = malloc((size_t)sb);
    REQUIRE(snap);
    for (int pass = 0; pass < 2; pass++) {
        k3_ctx *p = pass ? pc : pa;
        float *lg = pass ? lc : la;
        if (!pass) k3_exec_set_tap(&t2);
#define CALL(name, ...) (pass ? k3_ctx_##name(__VA_ARGS__) : k3_exec_##name(__VA_ARGS__))
        CHECK(CALL(seq_set_blocks, p, 0, blk0, 3, &err) == K3_OK);
        CHECK(CALL(seq_set_blocks, p, 1, blk1, 2, &err) == K3_OK);
        CALL(seq_set_pos, p, 0, 0);
        CALL(seq_set_pos, p, 1, 0);
        CALL(seq_clear_state, p, 0);
        CALL(seq_clear_state, p, 1);
        CHECK(CALL(run, p, r0, 2, want, lg, &err) == K3_OK);
        k3_ctx_state_save(p, 0, snap);
        CALL(state_restore, p, 2, snap);
        CHECK(CALL(seq_set_blocks, p, 2, blk0, 2, &err) == K3_OK);
        CALL(seq_set_pos, p, 2, 20);
        CHECK(CALL(run, p, r1, 2, want2, lg, &err) == K3_OK);
        /* a verify chunk of 3 on slot 1, 2 of it kept */
        CHECK(CALL(spec_begin, p, 1, 3, K3_SPEC_REAPPLY, &err) == K3_OK);
        k3_batch_seq r2 = {1, 3, ids + 35, NULL};
        const uint8_t want3 = K3_WANT_ALL;
        CHECK(CALL(run, p, &r2, 1, &want3, lg, &err) == K3_OK);
        CHECK(CALL(spec_accept, p, 1, 2, &err) == K3_OK);
        /* a sequence's rows of the first attention layer out and into other blocks */
        int32_t L = 0;
        while (p->c->layer_kind[L] == K3_LAYER_KDA) L++;
        const int64_t kb = k3_ctx_kv_bytes(p, L, 20);
        char *rows = malloc((size_t)kb);
        REQUIRE(rows && kb > 0);
        CHECK(CALL(kv_gather, p, blk0, 3, L, 0, 20, rows, &err) == K3_OK);
        CHECK(CALL(kv_write, p, blk1, 2, L, 3, 20, rows, &err) == K3_OK);
        free(rows);
#undef CALL
        k3_exec_set_tap(NULL);
    }
    CHECKF(k3_exec_replay(pb, &t2, &err) == K3_OK, "%s", err.msg);
    CHECK(!memcmp(la, lc, sizeof(float) * (size_t)V));
    CHECK(same_state(pa, pb));
    CHECK(same_state(pa, pc));

    /* every row of calls.h had its message replayed */
    for (size_t i = 0; i < N_OF(mirrored); i++) {
        const int32_t cmd = k3_exec_command(mirrored[i]);
        CHECKF(cmd >= 0 && t1.n_of[cmd] + t2.n_of[cmd] > 0, "row %s of calls.h has no replay case here", mirrored[i]);
    }

    /* a tap cut short, and a batch count bent, are refused with a message */
    k3_exec_tap cut = t1;
    cut.len = t1.len - 5;
    k3_err_clear(&err);
    CHECK(k3_exec_replay(b, &cut, &err) == K3_ERR_FORMAT && strstr(err.msg, "cut short"));
    k3_exec_tap bent = t1;
    bent.buf = malloc(t1.len);
    REQUIRE(bent.buf);
    memcpy(bent.buf, t1.buf, t1.len);
    const int32_t huge = 1 << 30;
    memcpy(bent.buf + 40, &huge, sizeof huge); /* the first message's entry count */
    k3_err_clear(&err);
    CHECK(k3_exec_replay(b, &bent, &err) == K3_ERR_FORMAT && strstr(err.msg, "bad batch"));
    free(bent.buf);

    free(snap);
    free(t1.buf);
    free(t2.buf);
    free(la);
    free(lc);
    free(row);
    k3_ctx_free(a);
    k3_ctx_free(b);
    k3_ctx_free(c);
    k3_ctx_free(pa);
    k3_ctx_free(pb);
    k3_ctx_free(pc);
    k3_model_close(g_m);
    g_m = NULL;
}
