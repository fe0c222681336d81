/*
 * driver.c -- the disk tier across processes (tests/kvstore.sh): one
 * process computes a prompt cold and saves it, another (a restart, a second
 * instance sharing the directory) loads it into a fresh context and goes on;
 * both write the logits of the prompt's rest and of greedy decode steps, and
 * the script compares the files byte for byte.
 *
 *   k3-kvs-driver save DIR MODEL f32|c8 N SPLIT SEED OUT [BUDGET]
 *       cold run split at SPLIT (a snapshot there), blocks and snapshot saved
 *   k3-kvs-driver load DIR MODEL f32|c8 N SPLIT SEED OUT
 *       a lookup and a load, then the rest; on a miss the prompt is computed
 *       cold with the same split; prints "hit H"; exit 0, or 1 on an error
 *
 * Lines about misses and failed saves go to stderr.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kvs_harness.h"
#include "kvstore/kvstore.h"

enum { BS = 16, NB = 32 };

static void logline(void *arg, const char *line) {
    (void)arg;
    fprintf(stderr, "%s\n", line);
}

static int fail(const char *what, const k3_error *err) {
    fprintf(stderr, "k3-kvs-driver: %s: %s\n", what, err->msg);
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 9) {
        fprintf(stderr, "usage: k3-kvs-driver save|load DIR MODEL f32|c8 N SPLIT SEED OUT [BUDGET]\n");
        return 2;
    }
    const bool save = !strcmp(argv[1], "save");
    const char *dir = argv[2], *model = argv[3], *out = argv[8];
    const k3_kv_type kv = !strcmp(argv[4], "c8") ? K3_KV_C8 : K3_KV_F32;
    const int64_t n = atoll(argv[5]), split = atoll(argv[6]);
    const unsigned seed = (unsigned)atoi(argv[7]);
    const int64_t budget = argc > 9 ? atoll(argv[9]) : (1ll << 30);
    if (n < 2 || split < BS || split % BS || split >= n || n + KVH_DECODE > NB * BS) {
        fprintf(stderr, "k3-kvs-driver: bad N or SPLIT\n");
        return 2;
    }
    k3_error err = {0};
    k3_model *m = NULL;
    if (k3_model_open(&m, model, &err)) return fail("model", &err);
    k3_ctx *ctx = kvh_ctx(m, kv, BS, NB, &err);
    if (!ctx) return fail("context", &err);
    k3_kvs *s = NULL;
    k3_kvs_options o = {.dir = dir,
                        .disk_bytes = budget,
                        .ctx = ctx,
                        .model_id = k3_model_identity(m),
                        .quant = "none",
                        .run_blocks = 2,
                        .log = logline};
    if (k3_kvs_open(&s, &o, &err)) return fail("store", &err);
    const int64_t V = m ? ctx->c->vocab_size : 0, sb = k3_ctx_state_bytes(ctx);
    int32_t tok[NB * BS], blocks[NB];
    kvh_ids(tok, n, V, seed);
    for (int i = 0; i < NB; i++) blocks[i] = save ? i : NB - 1 - i;
    float *logits = malloc(sizeof(float) * (size_t)((n - split + KVH_DECODE) * V));
    void *state = malloc((size_t)sb);
    const k3_kvs_seq seq = {.tokens = tok, .n_tokens = n};
    int64_t hit_tokens = 0;
    k3_ctx_seq_clear_state(ctx, 0);
    if (!save) {
        k3_kvs_hit *hit = NULL;
        if (k3_kvs_lookup(s, &seq, 0, n - 1, &hit, &err)) return fail("lookup", &err);
        if (hit) {
            hit_tokens = k3_kvs_hit_tokens(hit);
            uint64_t t = 0;
            k3_kvs_done d;
            if (k3_kvs_load(s, hit, blocks, state, &t, &err) || k3_kvs_wait(s, t, &d, &err)) return fail("load", &err);
            if (d.status) {
                fprintf(stderr, "k3-kvs-driver: the load failed (a miss): %s\n", d.why);
                hit_tokens = 0;
            } else {
                k3_ctx_state_restore(ctx, 0, state);
            }
        }
        printf("hit %lld\n", (long long)hit_tokens);
    }
    if (hit_tokens && hit_tokens != split) {
        fprintf(stderr, "k3-kvs-driver: a hit of %lld tokens, the test split at %lld\n", (long long)hit_tokens,
                (long long)split);
        return 1;
    }
    if (!hit_tokens) {
        k3_ctx_seq_clear_state(ctx, 0);
        if (kvh_run(ctx, blocks, NB, tok, 0, split, NULL, &err)) return fail("prefill", &err);
        k3_ctx_state_save(ctx, 0, state);
    }
    if (kvh_finish(ctx, blocks, NB, tok, split, n, logits, &err)) return fail("rest", &err);
    if (save) {
        uint64_t t1 = 0, t2 = 0;
        k3_kvs_done d;
        if (k3_kvs_save_blocks(s, &seq, blocks, (int32_t)(n / BS), true, 0, &t1, &err) ||
            k3_kvs_save_snapshot(s, &seq, split, state, 0, 0, &t2, &err))
            return fail("save", &err);
        for (int i = 0; i < 2; i++) {
            const uint64_t t = i ? t2 : t1;
            if (t && k3_kvs_wait(s, t, &d, &err)) return fail("wait", &err);
            if (t && d.status) fprintf(stderr, "k3-kvs-driver: a save failed: %s\n", d.why);
        }
    }
    FILE *f = fopen(out, "wb");
    if (!f ||
        fwrite(logits, sizeof(float), (size_t)((n - split + KVH_DECODE) * V), f) !=
            (size_t)((n - split + KVH_DECODE) * V) ||
        fclose(f)) {
        fprintf(stderr, "k3-kvs-driver: cannot write %s\n", out);
        return 1;
    }
    k3_kvs_close(s);
    free(logits);
    free(state);
    k3_ctx_free(ctx);
    k3_model_close(m);
    return 0;
}
