/*
 * executor.h -- a context driven on every rank (k3.h "executor"): the layer
 * above k3_ctx that mirrors rank 0's calls to the other ranks, and their
 * replay there.
 *
 * Rank 0 makes each call that changes its context as k3_exec_NAME, with the
 * arguments of k3_ctx_NAME (calls.h lists them): the executor sends the call
 * to the other ranks (rank 0's command channel: k3_comm_bcast of src/comm)
 * and makes it on rank 0's context; the other ranks wait in k3_exec_serve
 * (or k3_exec_serve_pool) and make the same call on their own context, so
 * every context sees the same calls in the same order and everything not
 * sharded stays bit-identical across ranks. With one process (no dist, or a
 * world of 1) k3_exec_NAME is k3_ctx_NAME.
 *
 * A message is a 40-byte header (the command, the payload's size, and the
 * payload itself when it has at most 24 bytes: one broadcast for most slot
 * calls), then the payload, then the large arrays (image rows, KDA states),
 * each broadcast from where it lies.
 */
#ifndef K3_EXECUTOR_EXECUTOR_H
#define K3_EXECUTOR_EXECUTOR_H

#include "ctx/ctx.h"
#include "executor/calls.h"
#include "forward/forward.h"

/* The logits rows of k3_ctx_forward and k3_ctx_run (for the other ranks'
 * scratch buffers). */
int64_t k3_exec_forward_rows(const k3_batch_seq *batch, int32_t n_seqs, k3_logits_mode mode);
int64_t k3_exec_run_rows(const k3_batch_seq *batch, int32_t n_seqs, const uint8_t *want);

/* k3_exec_NAME for each row of calls.h: the arguments of k3_ctx_NAME. */
#define K3_EXEC_PARAM(...) K3_EXEC_PARAM_(__VA_ARGS__)
#define K3_EXEC_PARAM_(kind, ...) K3_EXEC_PARAM_##kind(__VA_ARGS__)
#define K3_EXEC_PARAM_VAL(type, name) , type name
#define K3_EXEC_PARAM_IDS(ptr, n) , const int32_t *ptr, int32_t n
#define K3_EXEC_PARAM_BYTES(type, ptr, len) , const type *ptr
#define K3_EXEC_PARAM_BATCH(batch, n) , const k3_batch_seq *batch, int32_t n
#define K3_EXEC_PARAM_LOGITS(ptr, rows) , float *ptr
#define K3_EXEC_PARAM_OUT(type, ptr, len) , type *ptr
#define K3_EXEC_RET_STATUS k3_status
#define K3_EXEC_RET_VOID void
#define K3_EXEC_ERRP_STATUS , k3_error *err
#define K3_EXEC_ERRP_VOID
/* K3_EXEC_EACH(M, a, b, ...) = M a M b ...: up to 6 arguments */
#define K3_EXEC_EACH(m, ...) K3_EXEC_EACH_(K3_EXEC_NARGS(__VA_ARGS__), m, __VA_ARGS__)
#define K3_EXEC_EACH_(n, m, ...) K3_EXEC_EACH__(n, m, __VA_ARGS__)
#define K3_EXEC_EACH__(n, m, ...) K3_EXEC_EACH_##n(m, __VA_ARGS__)
#define K3_EXEC_NARGS(...) K3_EXEC_NARGS_(__VA_ARGS__, 6, 5, 4, 3, 2, 1, 0)
#define K3_EXEC_NARGS_(a, b, c, d, e, f, n, ...) n
#define K3_EXEC_EACH_1(m, a) m a
#define K3_EXEC_EACH_2(m, a, b) m a m b
#define K3_EXEC_EACH_3(m, a, b, c) m a m b m c
#define K3_EXEC_EACH_4(m, a, b, c, d) m a m b m c m d
#define K3_EXEC_EACH_5(m, a, b, c, d, e) m a m b m c m d m e
#define K3_EXEC_EACH_6(m, a, b, c, d, e, f) m a m b m c m d m e m f

#define K3_EXEC_DECLARE(name, ret, order, ...) \
    K3_EXEC_RET_##ret k3_exec_##name(k3_ctx *ctx K3_EXEC_EACH(K3_EXEC_PARAM, __VA_ARGS__) K3_EXEC_ERRP_##ret);
K3_EXEC_CALLS(K3_EXEC_DECLARE)

/* Rank 0 (and one process): k3_ctx_init_pool on every rank; the others make
 * theirs in k3_exec_serve_pool, with the same options and their own pool
 * and dist. */
k3_status k3_exec_init_pool(k3_ctx **out, const k3_model *m, const k3_ctx_options *opt, int32_t n_blocks,
                            int64_t max_ctx, k3_error *err);

/* Whether the link to the other ranks has failed (sticky); K3_OK without a
 * dist. */
k3_status k3_exec_failed(const k3_ctx *ctx, k3_error *err);

/* ---- for tests: the messages themselves ------------------------------------
 * While a tap is set, every k3_exec_ call also appends its message, as the
 * other ranks would receive it, to the tap (with one process too), and
 * k3_exec_replay makes the calls of a tap on another context, as a rank that
 * serves would. One thread only. */
typedef struct k3_exec_tap {
    uint8_t *buf;
    size_t len, cap;
    int32_t n_msgs;
    int32_t n_of[64]; /* messages by command */
    bool failed;      /* out of memory: the tap is incomplete */
} k3_exec_tap;
void k3_exec_set_tap(k3_exec_tap *tap); /* NULL: none */
k3_status k3_exec_replay(k3_ctx *ctx, const k3_exec_tap *tap, k3_error *err);
/* The command number of row NAME of calls.h (the index into n_of), or -1. */
int32_t k3_exec_command(const char *name);

#endif /* K3_EXECUTOR_EXECUTOR_H */
