/*
 * draft_model.c -- the draft-model proposer (draft_model.h): one context of
 * the draft checkpoint with a slot per running sequence. A slot has consumed
 * the sequence's tokens but its last (n_fed = n - 1, its KDA state saved
 * there); a proposal feeds the tokens since, then the last token and each
 * draft one at a time, greedily, and goes back to n - 1 (the saved state,
 * the position). The draft runs on rank 0 alone: it is not the model the
 * ranks share. Its cost per proposal: one catch-up pass and max one-token
 * passes of the draft model, and two copies of its KDA state (small for a
 * small draft; docs/spec.md).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "ctx/ctx.h"
#include "spec/draft_model.h"

typedef struct dslot {
    bool used;
    int64_t n_fed;
    void *state; /* the KDA state at n_fed */
} dslot;

struct k3_draft_model {
    const k3_model *m;
    k3_ctx *ctx;
    int32_t max_seqs;
    int64_t max_len, V, state_bytes;
    dslot *slot;
    float *logits;
};

k3_status k3_draft_model_open(k3_draft_model **out, const k3_model *m, k3_pool *pool, k3_kv_type kv, int32_t max_seqs,
                              int64_t max_len, k3_error *err) {
    *out = NULL;
    k3_draft_model *d = calloc(1, sizeof *d);
    if (!d) return k3_err(err, K3_ERR_NOMEM, "draft model: out of memory");
    k3_model_info info;
    k3_model_get_info(m, &info);
    d->m = m;
    d->max_seqs = max_seqs;
    d->V = info.vocab_size;
    d->max_len = max_len < info.max_positions ? max_len : info.max_positions;
    k3_ctx_options o = {.max_seqs = max_seqs,
                        .cache_tokens = (int64_t)max_seqs * d->max_len,
                        .pool = pool,
                        .kv_cache = kv};
    k3_status st = k3_ctx_init(&d->ctx, m, &o, err);
    if (!st) {
        d->state_bytes = k3_ctx_state_bytes(d->ctx);
        d->slot = calloc((size_t)max_seqs, sizeof *d->slot);
        d->logits = malloc(sizeof(float) * (size_t)d->V);
        if (!d->slot || !d->logits) st = k3_err(err, K3_ERR_NOMEM, "draft model: out of memory");
    }
    if (st) {
        k3_draft_model_close(d);
        return st;
    }
    *out = d;
    return K3_OK;
}

void k3_draft_model_close(k3_draft_model *d) {
    if (!d) return;
    for (int32_t i = 0; d->slot && i < d->max_seqs; i++) free(d->slot[i].state);
    free(d->slot);
    free(d->logits);
    k3_ctx_free(d->ctx);
    free(d);
}

k3_status k3_draft_model_seq_open(k3_draft_model *d, int32_t *slot, k3_error *err) {
    *slot = -1;
    for (int32_t i = 0; i < d->max_seqs; i++)
        if (!d->slot[i].used) {
            if (!d->slot[i].state && d->state_bytes > 0 && !(d->slot[i].state = malloc((size_t)d->state_bytes)))
                return k3_err(err, K3_ERR_NOMEM, "draft model: out of memory for a KDA state");
            d->slot[i].used = true;
            d->slot[i].n_fed = 0;
            k3_ctx_seq_reset(d->ctx, i);
            if (d->state_bytes > 0) k3_ctx_state_save(d->ctx, i, d->slot[i].state);
            *slot = i;
            return K3_OK;
        }
    return k3_err(err, K3_ERR_BUSY, "draft model: all %d slots are in use", d->max_seqs);
}

void k3_draft_model_seq_close(k3_draft_model *d, int32_t slot) {
    if (!d || slot < 0 || slot >= d->max_seqs) return;
    d->slot[slot].used = false;
    k3_ctx_seq_reset(d->ctx, slot);
}

/* The argmax of the draft's logits and its softmax probability. */
static int32_t pick(const k3_draft_model *d, float *conf) {
    const float *l = d->logits;
    int32_t best = 0;
    for (int64_t i = 1; i < d->V; i++)
        if (l[i] > l[best]) best = (int32_t)i;
    double s = 0;
    for (int64_t i = 0; i < d->V; i++) s += exp((double)l[i] - l[best]);
    *conf = (float)(1.0 / s);
    return best;
}

int32_t k3_draft_model_propose(k3_draft_model *d, int32_t slot, const int32_t *tok, int64_t n, int32_t max,
                               int32_t *draft, float *conf) {
    if (slot < 0 || slot >= d->max_seqs || n < 1) return 0;
    dslot *s = &d->slot[slot];
    if (s->n_fed > n - 1 || n + max > d->max_len) return 0;
    k3_error err = {0};
    /* the tokens since the last proposal, but the last */
    if (n - 1 > s->n_fed) {
        const k3_batch_seq b = {slot, (int32_t)(n - 1 - s->n_fed), tok + s->n_fed, NULL};
        if (k3_ctx_forward(d->ctx, &b, 1, K3_LOGITS_NONE, NULL, &err)) return 0;
        s->n_fed = n - 1;
        if (d->state_bytes > 0) k3_ctx_state_save(d->ctx, slot, s->state);
    }
    int32_t k = 0, cur = tok[n - 1];
    while (k < max) {
        const k3_batch_seq b = {slot, 1, &cur, NULL};
        if (k3_ctx_forward(d->ctx, &b, 1, K3_LOGITS_LAST, d->logits, &err)) break;
        cur = draft[k] = pick(d, &conf[k]);
        k++;
    }
    /* back to n - 1 */
    if (d->state_bytes > 0) k3_ctx_state_restore(d->ctx, slot, s->state);
    k3_ctx_seq_set_pos(d->ctx, slot, n - 1);
    return k;
}
