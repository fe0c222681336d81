/*
 * forward.h -- the forward pass over a context (k3_ctx_forward of k3.h and
 * the engine's k3_ctx_run): run.c checks a batch and cuts it into rounds of
 * at most max_batch tokens, forward.c runs one round through the layer loop
 * (the layers are src/layers).
 */
#ifndef K3_FORWARD_FORWARD_H
#define K3_FORWARD_FORWARD_H

#include "ctx/ctx.h"

/* Which logits an entry of k3_ctx_run wants. */
enum { K3_WANT_NONE = 0, K3_WANT_LAST = 1, K3_WANT_ALL = 2 };

/* The forward pass over a batch whose block tables are already set: logits
 * rows in batch order (an entry's last row, or all its rows, per want[i]).
 * Validates everything first; on error no state changes. */
k3_status k3_ctx_run(k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, const uint8_t *want, float *logits,
                     k3_error *err);
/* What k3_ctx_run and k3_ctx_forward check before they touch any state:
 * K3_OK when the call would start its forward pass. */
k3_status k3_ctx_run_check(const k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, const uint8_t *want,
                           const float *logits, k3_error *err);
k3_status k3_ctx_forward_check(const k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, k3_logits_mode mode,
                               const float *logits, k3_error *err);

/* The forward pass over one round of at most max_batch tokens: rows T,
 * spans already laid out, blocks already allocated. out_rows lists the rows
 * whose logits are wanted (n_out of them), written to logits. */
void k3_forward_round(k3_ctx *ctx, const int32_t *tokens, const int32_t *out_rows, int32_t n_out, float *logits);

#endif /* K3_FORWARD_FORWARD_H */
