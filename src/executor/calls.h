/*
 * calls.h -- the context calls rank 0 mirrors to the other ranks: one row
 * each. From a row the executor makes the call rank 0 makes (k3_exec_NAME,
 * with the arguments of k3_ctx_NAME), its message, and its replay on the
 * other ranks (executor.c), so a new call that changes a context is one row
 * here. tests/test_exec.c fails while a call of ctx.h, forward.h or k3.h
 * that changes a context has no row (or a line in K3_EXEC_RANK_LOCAL), and
 * replays every row against the call itself.
 *
 * X(NAME, RETURNS, ORDER, ARGS...)
 *   NAME     the call is k3_ctx_NAME(ctx, ARGS...[, err])
 *   RETURNS  STATUS: it returns k3_status and takes a k3_error *err last;
 *            VOID: it returns nothing
 *   ORDER    LOCAL: the call runs no collective: rank 0 makes it, then sends
 *            it when it succeeded;
 *            COLLECTIVE(CHECK): the call exchanges with the other ranks (a
 *            forward pass): rank 0 checks it with CHECK (same arguments),
 *            sends it, then makes it together with the others
 *   ARGS     its arguments after ctx, in order, each one of
 *            (VAL, type, name)       a value of a fixed-size type
 *            (IDS, ptr, n)           const int32_t *ptr, int32_t n: n ids
 *            (BYTES, type, ptr, len) const type *ptr of len bytes; len is an
 *                                    expression of ctx and the arguments
 *                                    before it, the same on every rank
 *            (BATCH, batch, n)       const k3_batch_seq *batch, int32_t n:
 *                                    the ids, and the rows that replace
 *                                    embeddings (k3_batch_seq.embeds)
 *            (LOGITS, ptr, rows)     float *ptr: rank 0's logits; a scratch
 *                                    buffer of rows (an expression) x vocab
 *                                    floats on the other ranks
 *            (OUT, type, ptr, len)   type *ptr: what rank 0 receives (len
 *                                    bytes, an expression as for BYTES); a
 *                                    scratch buffer on the other ranks
 */
#ifndef K3_EXECUTOR_CALLS_H
#define K3_EXECUTOR_CALLS_H

#define K3_EXEC_CALLS(X) \
    X(forward, STATUS, COLLECTIVE(k3_ctx_forward_check), (BATCH, batch, n_seqs), (VAL, k3_logits_mode, mode), \
      (LOGITS, logits, k3_exec_forward_rows(batch, n_seqs, mode))) \
    X(run, STATUS, COLLECTIVE(k3_ctx_run_check), (BATCH, batch, n_seqs), (BYTES, uint8_t, want, n_seqs), \
      (LOGITS, logits, k3_exec_run_rows(batch, n_seqs, want))) \
    X(seq_reset, VOID, LOCAL, (VAL, int32_t, seq)) \
    X(seq_fill_synthetic, STATUS, LOCAL, (VAL, int32_t, seq), (VAL, int64_t, n), (VAL, uint64_t, seed)) \
    X(seq_set_blocks, STATUS, LOCAL, (VAL, int32_t, seq), (IDS, blocks, n)) \
    X(seq_set_pos, VOID, LOCAL, (VAL, int32_t, seq), (VAL, int64_t, pos)) \
    X(seq_clear_state, VOID, LOCAL, (VAL, int32_t, seq)) \
    X(state_restore, VOID, LOCAL, (VAL, int32_t, seq), (BYTES, void, src, k3_ctx_state_bytes(ctx))) \
    X(spec_begin, STATUS, LOCAL, (VAL, int32_t, seq), (VAL, int32_t, n), (VAL, int32_t, mode)) \
    X(spec_accept, STATUS, LOCAL, (VAL, int32_t, seq), (VAL, int32_t, n_keep)) \
    X(kv_write, STATUS, LOCAL, (IDS, blocks, n_blocks), (VAL, int32_t, layer), (VAL, int64_t, t0), (VAL, int32_t, n), \
      (BYTES, void, src, k3_ctx_kv_bytes(ctx, layer, n))) \
    X(kv_gather, STATUS, COLLECTIVE(k3_ctx_kv_gather_check), (IDS, blocks, n_blocks), (VAL, int32_t, layer), \
      (VAL, int64_t, t0), (VAL, int32_t, n), (OUT, void, dst, k3_ctx_kv_bytes(ctx, layer, n)))

/* The calls that take a context but stay on their rank, and why: X(NAME). A
 * context is made on every rank with the same options (k3_ctx_init by each
 * rank itself, k3_ctx_init_pool through k3_exec_init_pool); what rank 0
 * alone keeps (snapshots, profiles) is not mirrored. */
#define K3_EXEC_RANK_LOCAL(X) \
    X(init)            /* every rank makes its own, with the same options */ \
    X(init_pool)       /* k3_exec_init_pool sends the options */ \
    X(free)            /* every rank frees its own */ \
    X(capture_state)   /* rank 0 keeps the snapshots; the others compute the same state */ \
    X(forget_captures) /* the same captures */ \
    X(profile_enable)  /* rank 0's operator times */ \
    X(kv_block_ranges) /* a disk tier reads and writes its own rank's blocks in place */ \
    X(profile_take)

#endif /* K3_EXECUTOR_CALLS_H */
