/*
 * run.c -- the forward driver (forward.h): validates a batch and cuts it
 * into rounds of at most max_batch tokens for forward.c. k3_ctx_run takes
 * block tables its owner (an engine, src/kv) has set; the public
 * k3_ctx_forward adds a simple default block manager (a free list) for
 * callers that drive a context alone (the CLI, the tests). Under mpirun the
 * executor (src/executor) hands each batch to the other ranks first.
 */
#include <stdlib.h>
#include <string.h>

#include "forward/forward.h"
#include "layers/layers.h"

/* Checks a batch before any state is touched; with check_blocks, that each
 * sequence's block table already covers its new positions. */
static k3_status validate(const k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, const uint8_t *want,
                          bool check_blocks, k3_error *err) {
    const k3_config *c = ctx->c;
    if (n_seqs < 0 || (n_seqs > 0 && !batch)) return k3_err(err, K3_ERR_ARG, "forward: bad batch");
    for (int32_t i = 0; i < n_seqs; i++) {
        const k3_batch_seq *b = &batch[i];
        if (b->seq < 0 || b->seq >= ctx->max_seqs)
            return k3_err(err, K3_ERR_ARG, "forward: sequence id %d out of range [0, %d)", b->seq, ctx->max_seqs);
        for (int32_t j = 0; j < i; j++)
            if (batch[j].seq == b->seq)
                return k3_err(err, K3_ERR_ARG, "forward: sequence %d appears twice in one batch", b->seq);
        if (b->n_tokens < 0 || (b->n_tokens > 0 && !b->tokens))
            return k3_err(err, K3_ERR_ARG, "forward: entry %d has no tokens", i);
        if (b->n_tokens == 0 && want[i] == K3_WANT_LAST)
            return k3_err(err, K3_ERR_ARG, "forward: entry %d is empty but its last logits were asked for", i);
        for (int32_t t = 0; t < b->n_tokens; t++)
            if (b->tokens[t] < 0 || b->tokens[t] >= c->vocab_size)
                return k3_err(err, K3_ERR_ARG, "forward: token id %d at index %d is out of range [0, %lld)",
                              b->tokens[t], t, (long long)c->vocab_size);
        const k3_seq *s = &ctx->seqs[b->seq];
        const int64_t end = s->pos + b->n_tokens;
        if (end > ctx->max_ctx)
            return k3_err(err, K3_ERR_RANGE,
                          "forward: sequence %d would reach %lld tokens (%lld cached + %d new), over the context of "
                          "%lld",
                          b->seq, (long long)end, (long long)s->pos, b->n_tokens, (long long)ctx->max_ctx);
        if (check_blocks && s->n_blocks < k3_ctx_blocks_for(ctx, end))
            return k3_err(err, K3_ERR_RANGE, "forward: sequence %d has %d blocks for %lld positions", b->seq,
                          s->n_blocks, (long long)end);
        if (k3_spec_on(ctx, b->seq) && (b->n_tokens != ctx->spec[b->seq].n || s->pos != ctx->spec[b->seq].pos0))
            return k3_err(err, K3_ERR_ARG,
                          "forward: sequence %d is marked for a verify chunk of %d tokens at %lld, not %d at %lld",
                          b->seq, ctx->spec[b->seq].n, (long long)ctx->spec[b->seq].pos0, b->n_tokens,
                          (long long)s->pos);
    }
    return K3_OK;
}

/* Rounds of at most max_batch tokens, in batch order. */
static void run_rounds(k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, const uint8_t *want, float *logits) {
    int32_t *toks = ctx->round_tokens, *orows = ctx->round_out;
    const int64_t V = ctx->c->vocab_size;
    int64_t n_written = 0;
    int32_t cur = 0, off = 0; /* entry and offset into it */
    while (cur < n_seqs) {
        int32_t T = 0, n_out = 0;
        ctx->n_spans = 0;
        while (cur < n_seqs && T < ctx->max_batch) {
            const k3_batch_seq *b = &batch[cur];
            int32_t take = b->n_tokens - off;
            /* a verify chunk is never cut over two rounds: it starts the next */
            if (take > ctx->max_batch - T && T > 0 && k3_spec_on(ctx, b->seq)) break;
            if (take > ctx->max_batch - T) take = ctx->max_batch - T;
            if (take > 0) {
                k3_span *sp = &ctx->spans[ctx->n_spans++];
                sp->seq = b->seq;
                sp->t0 = T;
                sp->n = take;
                sp->pos0 = ctx->seqs[b->seq].pos; /* earlier rounds already advanced it */
                memcpy(toks + T, b->tokens + off, sizeof(int32_t) * (size_t)take);
                for (int32_t r = 0; r < take; r++) ctx->round_embeds[T + r] = b->embeds ? b->embeds[off + r] : NULL;
                if (want[cur] == K3_WANT_ALL)
                    for (int32_t r = 0; r < take; r++) orows[n_out++] = T + r;
                T += take;
                off += take;
            }
            if (off >= b->n_tokens) {
                if (want[cur] == K3_WANT_LAST) orows[n_out++] = T - 1;
                cur++;
                off = 0;
            }
        }
        if (T == 0) continue;
        ctx->T = T;
        k3_forward_round(ctx, toks, orows, n_out, n_out ? logits + n_written * V : NULL);
        n_written += n_out;
        for (int32_t i = 0; i < ctx->n_spans; i++) ctx->seqs[ctx->spans[i].seq].pos += ctx->spans[i].n;
    }
}

k3_status k3_ctx_run_check(const k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, const uint8_t *want,
                           const float *logits, k3_error *err) {
    if (n_seqs > 0 && !want) return k3_err(err, K3_ERR_ARG, "forward: no logits modes");
    bool any = false;
    for (int32_t i = 0; i < n_seqs; i++) {
        if (want[i] > K3_WANT_ALL) return k3_err(err, K3_ERR_ARG, "forward: bad logits mode %d", want[i]);
        any |= want[i] != K3_WANT_NONE;
    }
    if (any && !logits) return k3_err(err, K3_ERR_ARG, "forward: logits buffer is NULL");
    return validate(ctx, batch, n_seqs, want, true, err);
}

k3_status k3_ctx_run(k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, const uint8_t *want, float *logits,
                     k3_error *err) {
    k3_status st = k3_ctx_run_check(ctx, batch, n_seqs, want, logits, err);
    if (!st) {
        run_rounds(ctx, batch, n_seqs, want, logits);
        st = k3_layers_failed(ctx, err);
    }
    ctx->n_caps = 0;
    return st;
}

/* k3_ctx_forward's per-entry logits modes: into want (n_seqs of them). */
static void want_of_mode(k3_logits_mode mode, int32_t n_seqs, uint8_t *want) {
    for (int32_t i = 0; i < n_seqs; i++)
        want[i] = mode == K3_LOGITS_LAST ? K3_WANT_LAST : mode == K3_LOGITS_ALL ? K3_WANT_ALL : K3_WANT_NONE;
}

/* k3_ctx_forward's checks, with its modes in want. */
static k3_status forward_check(const k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, const uint8_t *want,
                               k3_error *err) {
    k3_status st = validate(ctx, batch, n_seqs, want, false, err);
    int64_t blocks_needed = 0;
    for (int32_t i = 0; !st && i < n_seqs; i++) {
        const k3_seq *s = &ctx->seqs[batch[i].seq];
        blocks_needed += k3_ctx_blocks_for(ctx, s->pos + batch[i].n_tokens) - s->n_blocks;
    }
    if (!st && blocks_needed > ctx->n_free)
        st = k3_err(err, K3_ERR_RANGE, "forward: cache full: %lld blocks needed, %d free", (long long)blocks_needed,
                    ctx->n_free);
    return st;
}

/* The checks that come before the modes are known to be sound. */
static k3_status forward_args(const k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, k3_logits_mode mode,
                              const float *logits, k3_error *err) {
    if (n_seqs < 0 || (n_seqs > 0 && !batch)) return k3_err(err, K3_ERR_ARG, "forward: bad batch");
    if (mode != K3_LOGITS_NONE && !logits) return k3_err(err, K3_ERR_ARG, "forward: logits buffer is NULL");
    if (!ctx->free_blocks)
        return k3_err(err, K3_ERR_ARG, "forward: this context's blocks are owned by an engine (use k3_ctx_run)");
    return K3_OK;
}

k3_status k3_ctx_forward_check(const k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, k3_logits_mode mode,
                               const float *logits, k3_error *err) {
    k3_status st = forward_args(ctx, batch, n_seqs, mode, logits, err);
    if (st) return st;
    uint8_t want_buf[64] = {0}, *want = n_seqs <= 64 ? want_buf : malloc((size_t)n_seqs);
    if (!want) return k3_err(err, K3_ERR_NOMEM, "forward: out of memory");
    want_of_mode(mode, n_seqs, want);
    st = forward_check(ctx, batch, n_seqs, want, err);
    if (want != want_buf) free(want);
    return st;
}

k3_status k3_ctx_forward(k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, k3_logits_mode mode, float *logits,
                         k3_error *err) {
    k3_status st = forward_args(ctx, batch, n_seqs, mode, logits, err);
    if (st) return st;
    uint8_t want_buf[64] = {0}, *want = n_seqs <= 64 ? want_buf : malloc((size_t)n_seqs);
    if (!want) return k3_err(err, K3_ERR_NOMEM, "forward: out of memory");
    want_of_mode(mode, n_seqs, want);
    /* Validate everything before touching any state. */
    st = forward_check(ctx, batch, n_seqs, want, err);
    if (!st) {
        /* the default block manager: reserve blocks from the free list
         * (the same global tables on every rank under DCP) */
        for (int32_t i = 0; i < n_seqs; i++) {
            k3_seq *s = &ctx->seqs[batch[i].seq];
            const int64_t end = s->pos + batch[i].n_tokens;
            while (s->n_blocks < k3_ctx_blocks_for(ctx, end))
                s->blocks[s->n_blocks++] = ctx->free_blocks[--ctx->n_free];
        }
        run_rounds(ctx, batch, n_seqs, want, logits);
        st = k3_layers_failed(ctx, err);
    }
    if (want != want_buf) free(want);
    ctx->n_caps = 0;
    return st;
}
