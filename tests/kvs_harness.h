/*
 * kvs_harness.h -- what the disk tier's tests (test_kvstore.c) and their
 * driver for other processes (tests/kvstore/driver.c) share: a context made
 * as the engine makes one (k3_ctx_init_pool, block tables set by the caller),
 * a prompt computed in two passes (the prefix to a boundary, then the rest
 * with every row's logits) and greedy decode steps after it, so a run that
 * loads the prefix from disk can be compared with a cold one bit for bit.
 */
#ifndef K3_TESTS_KVS_HARNESS_H
#define K3_TESTS_KVS_HARNESS_H

#include <stdlib.h>
#include <string.h>

#include "ctx/ctx.h"
#include "forward/forward.h"
#include "k3.h"

enum { KVH_DECODE = 3 };

static inline k3_ctx *kvh_ctx(const k3_model *m, k3_kv_type kv, int32_t bs, int32_t n_blocks, k3_error *err) {
    k3_ctx *ctx = NULL;
    k3_ctx_options o = {.max_seqs = 2,
                        .cache_tokens = (int64_t)n_blocks * bs,
                        .block_size = bs,
                        .max_batch = 64,
                        .kv_cache = kv};
    if (k3_ctx_init_pool(&ctx, m, &o, n_blocks, (int64_t)n_blocks * bs, err)) return NULL;
    return ctx;
}

/* Tokens [from, to) of slot 0 (its table blocks[0..nb)); every row's logits into out (NULL: none). */
static inline k3_status kvh_run(k3_ctx *ctx, const int32_t *blocks, int32_t nb, const int32_t *tok, int64_t from,
                                int64_t to, float *out, k3_error *err) {
    if (k3_ctx_seq_set_blocks(ctx, 0, blocks, nb, err)) return err->status;
    k3_ctx_seq_set_pos(ctx, 0, from);
    const k3_batch_seq b = {.seq = 0, .n_tokens = (int32_t)(to - from), .tokens = tok + from};
    const uint8_t want = out ? K3_WANT_ALL : K3_WANT_NONE;
    return k3_ctx_run(ctx, &b, 1, &want, out, err);
}

static inline int32_t kvh_argmax(const float *row, int64_t n) {
    int32_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (row[i] > row[best]) best = (int32_t)i;
    return best;
}

/* From slot 0 at position `from` (its state restored or computed): the rows
 * [from, n) of the prompt, then KVH_DECODE greedy tokens, every logits row
 * into out [(n - from + KVH_DECODE) * V]. tok must have room for n +
 * KVH_DECODE ids (the decoded ones are appended); blocks cover them. */
static inline k3_status kvh_finish(k3_ctx *ctx, const int32_t *blocks, int32_t nb, int32_t *tok, int64_t from,
                                   int64_t n, float *out, k3_error *err) {
    const int64_t V = ctx->c->vocab_size;
    if (kvh_run(ctx, blocks, nb, tok, from, n, out, err)) return err->status;
    float *row = out + (n - from - 1) * V;
    for (int d = 0; d < KVH_DECODE; d++) {
        tok[n + d] = kvh_argmax(row, V);
        if (kvh_run(ctx, blocks, nb, tok, n + d, n + d + 1, row + V, err)) return err->status;
        row += V;
    }
    return K3_OK;
}

/* Deterministic ids in [8, vocab - 8). */
static inline void kvh_ids(int32_t *ids, int64_t n, int64_t vocab, unsigned seed) {
    uint64_t r = seed * 2654435761u + 12345;
    for (int64_t i = 0; i < n; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((r >> 33) % (uint64_t)(vocab - 16)) + 8;
    }
}

#endif /* K3_TESTS_KVS_HARNESS_H */
