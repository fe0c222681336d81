/*
 * kv_io.c -- a sequence's cache rows in and out of a context, in the
 * transfer layout of ctx.h (k3_ctx_kv_read, _write, _gather): what a
 * prefill instance sends and a decode instance receives (src/pd). One
 * layer and one run of positions at a time, so a long prompt moves without
 * a second copy of its cache. Under DCP each rank reads and writes only the
 * positions it caches (k3_ctx_own_slot's arithmetic on a block-table
 * slice): a write broadcast to every rank re-shards by token owner, and a
 * gather assembles a DCP group's rows on its rank 0.
 */
#include <stdlib.h>
#include <string.h>

#include "ctx/ctx.h"
#include "kernels/attn_ops.h"

/* One array of a layer's cache: its base on this rank and its bytes per slot. */
typedef struct comp {
    uint8_t *base;
    int64_t row;
} comp;

static bool is_attn(const k3_ctx *ctx, int32_t layer) {
    return layer >= 0 && layer < ctx->c->n_layers && ctx->c->layer_kind[layer] != K3_LAYER_KDA;
}

/* The layer's arrays in the transfer layout's order; returns how many. */
static int layer_comps(const k3_ctx *ctx, int32_t layer, comp out[5]) {
    const k3_config *c = ctx->c;
    const bool dsa = c->layer_kind[layer] == K3_LAYER_DSA;
    const int64_t kvl = c->kv_lora_rank, rope = c->qk_rope_dim, dI = c->index_head_dim;
    int n = 0;
    if (ctx->kv == K3_KV_F32) {
        out[n++] = (comp){(uint8_t *)ctx->lat_cache[layer], (kvl + rope) * 4};
        if (dsa) out[n++] = (comp){(uint8_t *)ctx->idx_cache[layer], dI * 4};
    } else {
        out[n++] = (comp){(uint8_t *)ctx->lat8[layer], kvl};
        out[n++] = (comp){(uint8_t *)ctx->lat_s[layer], (int64_t)ctx->n_tiles * 4};
        out[n++] = (comp){(uint8_t *)ctx->lat_r[layer], rope * 4};
        if (dsa) {
            out[n++] = (comp){(uint8_t *)ctx->idx8[layer], dI};
            out[n++] = (comp){(uint8_t *)ctx->idx_s[layer], 4};
        }
    }
    return n;
}

int64_t k3_ctx_kv_bytes(const k3_ctx *ctx, int32_t layer, int64_t n) {
    if (!is_attn(ctx, layer) || n < 0) return 0;
    comp cs[5];
    const int nc = layer_comps(ctx, layer, cs);
    int64_t row = 0;
    for (int i = 0; i < nc; i++) row += cs[i].row;
    return row * n;
}

int k3_ctx_kv_block_ranges(k3_ctx *ctx, int32_t layer, int32_t block, void *base[5], int64_t len[5]) {
    if (!is_attn(ctx, layer) || block < 0 || block >= ctx->n_blocks) return 0;
    comp cs[5];
    const int nc = layer_comps(ctx, layer, cs);
    for (int c = 0; c < nc; c++) {
        base[c] = cs[c].base + (int64_t)block * ctx->lbs * cs[c].row;
        len[c] = (int64_t)ctx->lbs * cs[c].row;
    }
    return nc;
}

/* Slot on this rank of position p of the slice, or -1 when another DCP rank
 * caches it (k3_ctx_own_slot, with the slice's own table). */
static int64_t slice_slot(const k3_ctx *ctx, const int32_t *blocks, int64_t p) {
    const int64_t bs = ctx->block_size, o = p % bs, b = blocks[p / bs];
    if (ctx->dcp > 1) {
        const int64_t I = ctx->dcp_il;
        if ((o / I) % ctx->dcp != ctx->dcp_rank) return -1;
        return b * ctx->lbs + o / (I * ctx->dcp) * I + o % I;
    }
    return b * bs + o;
}

static k3_status check_range(const k3_ctx *ctx, const int32_t *blocks, int32_t n_blocks, int32_t layer, int64_t t0,
                             int64_t n, const void *buf, k3_error *err) {
    if (!is_attn(ctx, layer))
        return k3_err(err, K3_ERR_ARG, "kv transfer: layer %d is not an MLA/DSA layer of this model", layer);
    if (t0 < 0 || n < 0 || n_blocks < 0 || (n > 0 && !buf) || (n_blocks > 0 && !blocks))
        return k3_err(err, K3_ERR_ARG, "kv transfer: bad range (t0 %lld, %lld tokens, %d blocks)", (long long)t0,
                      (long long)n, n_blocks);
    if (n > 0 && (t0 + n + ctx->block_size - 1) / ctx->block_size > n_blocks)
        return k3_err(err, K3_ERR_RANGE, "kv transfer: positions [%lld, %lld) are past the %d blocks given",
                      (long long)t0, (long long)(t0 + n), n_blocks);
    for (int32_t i = 0; i < n_blocks; i++)
        if (blocks[i] < 0 || blocks[i] >= ctx->n_blocks)
            return k3_err(err, K3_ERR_ARG, "kv transfer: block id %d out of range [0, %d)", blocks[i], ctx->n_blocks);
    return K3_OK;
}

/* Copies between the cache and the transfer layout buf (to_buf: read),
 * run by run of consecutive slots. */
static void copy_rows(const k3_ctx *ctx, const int32_t *blocks, int32_t layer, int64_t t0, int64_t n, uint8_t *buf,
                      bool to_buf) {
    comp cs[5];
    const int nc = layer_comps(ctx, layer, cs);
    for (int64_t i = 0; i < n;) {
        const int64_t s0 = slice_slot(ctx, blocks, t0 + i);
        int64_t len = 1;
        if (s0 < 0) {
            i++;
            continue;
        }
        while (i + len < n && slice_slot(ctx, blocks, t0 + i + len) == s0 + len) len++;
        uint8_t *at = buf;
        for (int c = 0; c < nc; c++) {
            uint8_t *slot = cs[c].base + s0 * cs[c].row, *row = at + i * cs[c].row;
            if (to_buf) memcpy(row, slot, (size_t)(len * cs[c].row));
            else memcpy(slot, row, (size_t)(len * cs[c].row));
            at += n * cs[c].row;
        }
        i += len;
    }
}

k3_status k3_ctx_kv_read(const k3_ctx *ctx, const int32_t *blocks, int32_t n_blocks, int32_t layer, int64_t t0,
                         int64_t n, void *dst, k3_error *err) {
    K3_TRY(check_range(ctx, blocks, n_blocks, layer, t0, n, dst, err));
    copy_rows(ctx, blocks, layer, t0, n, dst, true);
    return K3_OK;
}

k3_status k3_ctx_kv_write(k3_ctx *ctx, const int32_t *blocks, int32_t n_blocks, int32_t layer, int64_t t0, int32_t n,
                          const void *src, k3_error *err) {
    K3_TRY(check_range(ctx, blocks, n_blocks, layer, t0, n, src, err));
    copy_rows(ctx, blocks, layer, t0, n, (uint8_t *)src, false);
    return K3_OK;
}

k3_status k3_ctx_kv_gather_check(const k3_ctx *ctx, const int32_t *blocks, int32_t n_blocks, int32_t layer, int64_t t0,
                                 int32_t n, const void *dst, k3_error *err) {
    K3_TRY(check_range(ctx, blocks, n_blocks, layer, t0, n, dst, err));
    if (ctx->dcp > 1 && k3_ctx_kv_bytes(ctx, layer, n) > INT32_MAX / ctx->dcp)
        return k3_err(err, K3_ERR_RANGE, "kv transfer: %d tokens of layer %d are over one exchange (2 GB)", n, layer);
    return K3_OK;
}

k3_status k3_ctx_kv_gather(k3_ctx *ctx, const int32_t *blocks, int32_t n_blocks, int32_t layer, int64_t t0, int32_t n,
                           void *dst, k3_error *err) {
    if (ctx->dcp <= 1) return k3_ctx_kv_read(ctx, blocks, n_blocks, layer, t0, n, dst, err);
    K3_TRY(k3_ctx_kv_gather_check(ctx, blocks, n_blocks, layer, t0, n, dst, err));
    const int D = ctx->dcp, me = ctx->dcp_rank;
    const int64_t bytes = k3_ctx_kv_bytes(ctx, layer, n);
    uint8_t *mine = malloc((size_t)(bytes ? bytes : 1)), *all = me == 0 ? malloc((size_t)(D * bytes + 1)) : NULL;
    int *cnt = calloc((size_t)(4 * D), sizeof(int));
    if (!mine || (me == 0 && !all) || !cnt) {
        free(mine);
        free(all);
        free(cnt);
        /* the others would wait in the exchange: fail the link */
        return k3_comm_fail(ctx->dist, "kv gather: out of memory", err);
    }
    int *sc = cnt, *sd = cnt + D, *rc = cnt + 2 * D, *rd = cnt + 3 * D;
    sc[0] = (int)bytes; /* every rank's rows to rank 0 */
    for (int r = 0; me == 0 && r < D; r++) {
        rc[r] = (int)bytes;
        rd[r] = (int)(r * bytes);
    }
    copy_rows(ctx, blocks, layer, t0, n, mine, true);
    k3_status st = k3_comm_alltoallv(ctx->dist, K3_GROUP_DCP, K3_COMM_CONTROL, mine, sc, sd, all, rc, rd);
    if (st) {
        k3_comm_failed(ctx->dist, err);
    } else if (me == 0) {
        /* each position from its owner's rows */
        comp cs[5];
        const int nc = layer_comps(ctx, layer, cs);
        const int64_t I = ctx->dcp_il, bs = ctx->block_size;
        for (int64_t i = 0; i < n; i++) {
            const int r = (int)(((t0 + i) % bs / I) % D);
            int64_t at = 0;
            for (int c = 0; c < nc; c++) {
                memcpy((uint8_t *)dst + at + i * cs[c].row, all + r * bytes + at + i * cs[c].row, (size_t)cs[c].row);
                at += n * cs[c].row;
            }
        }
    }
    free(mine);
    free(all);
    free(cnt);
    return st;
}
