/*
 * dist.h -- the inside of k3_dist (k3.h "distributed"): the MPI groups, the
 * wrapped collectives the forward pass uses, the DCP token layout, and the
 * hooks forward.c and ctx.c call. src/dist/ is the only place that calls MPI.
 *
 * Every collective is started non-blocking and waited for with a deadline
 * (k3_dist_options.timeout_s), so a rank that dies or hangs turns into an
 * error on the others instead of a hang. The first failure is sticky: the
 * dist remembers it, later collectives return at once, and k3_ctx_forward
 * returns it after the round (k3_dist_failed).
 */
#ifndef K3_DIST_DIST_H
#define K3_DIST_DIST_H

#include <stddef.h>
#include <stdint.h>

#include "k3.h"

typedef enum { K3_GROUP_WORLD = 0, K3_GROUP_DCP, K3_GROUP_EP } k3_group;

/* ---- DCP layout (serving.md §2.5) -------------------------------------------
 * With bs a multiple of I, ((x mod (bs*D)) div I) mod D == (x div I) mod D. */
static inline int32_t k3_dcp_owner(int64_t x, int32_t D, int32_t I) { return (int32_t)((x / I) % D); }
/* local index of token x on its owner */
static inline int64_t k3_dcp_local(int64_t x, int32_t D, int32_t I) { return x / ((int64_t)I * D) * I + x % I; }
/* global position of local index j on rank r */
static inline int64_t k3_dcp_global(int64_t j, int32_t r, int32_t D, int32_t I) {
    return ((j / I) * D + r) * I + j % I;
}
/* tokens among [0, n) that rank r owns: its local indices [0, count) */
static inline int64_t k3_dcp_count(int64_t n, int32_t r, int32_t D, int32_t I) {
    const int64_t stripe = (int64_t)I * D, rem = n % stripe - (int64_t)r * I;
    return n / stripe * I + (rem < 0 ? 0 : rem > I ? I : rem);
}

/* ---- the exchange of DSA candidates ------------------------------------------ */

/* One candidate: fp32 score and int32 global position (8 bytes on the wire,
 * the unit of the traffic formulas). Padding: pos -1, sorts last. */
typedef struct k3_cand {
    float score;
    int32_t pos;
} k3_cand;

/* The total order all ranks agree on: score descending (NaN after numbers),
 * then position ascending; padding last. Returns 1 when a goes first. */
int k3_cand_before(const k3_cand *a, const k3_cand *b);
/* Merges two lists each sorted by k3_cand_before, keeping the first k, into
 * out (which may not alias). */
void k3_cand_merge(const k3_cand *a, const k3_cand *b, int k, k3_cand *out);
/* Sorts n candidates by k3_cand_before. */
void k3_cand_sort(k3_cand *c, int n);

/* Settles the global top-k of `rows` rows across the DCP group: mine holds
 * each row's local top-k (k entries, sorted, padded); out gets the global
 * top-k of each row (sorted). work: rows*k*max(D, 2) candidates. */
k3_status k3_dist_topk_exchange(k3_dist *d, const k3_cand *mine, int32_t rows, int32_t k, k3_cand *out,
                                k3_cand *work);

/* ---- wrapped collectives (bytes; counted under kind, self excluded) ---------- */

k3_status k3_dist_allgather(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, size_t bytes,
                            void *recv);
k3_status k3_dist_sendrecv(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, size_t bytes,
                           int32_t partner, void *recv);
/* counts and displacements in bytes, per group rank */
k3_status k3_dist_alltoallv(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, const int *scount,
                            const int *sdispl, void *recv, const int *rcount, const int *rdispl);
/* group size and rank */
int32_t k3_dist_group_size(const k3_dist *d, k3_group g);
int32_t k3_dist_group_rank(const k3_dist *d, k3_group g);

/* The sticky failure: K3_OK, or the first failure's status (message into err). */
k3_status k3_dist_failed(const k3_dist *d, k3_error *err);

/* ---- rank 0's calls, sent to the workers (ctx.c) ------------------------------ */

/* A batch goes out as its ids; rows replacing embeddings (images,
 * k3_batch_seq.embeds: row_floats = hidden_size floats each) follow it, so
 * every rank runs the same input rows. */
k3_status k3_dist_send_forward(k3_dist *d, const k3_batch_seq *batch, int32_t n_seqs, k3_logits_mode mode,
                               int64_t row_floats, k3_error *err);
k3_status k3_dist_send_reset(k3_dist *d, int32_t seq, k3_error *err);
k3_status k3_dist_send_fill(k3_dist *d, int32_t seq, int64_t n, uint64_t seed, k3_error *err);

/* the engine's (k3 serve, a context made by k3_ctx_init_pool; ctx.c) */
k3_status k3_dist_send_pool(k3_dist *d, const k3_ctx_options *o, int32_t n_blocks, int64_t max_ctx, k3_error *err);
k3_status k3_dist_send_run(k3_dist *d, const k3_batch_seq *batch, int32_t n_seqs, const uint8_t *want,
                           int64_t row_floats, k3_error *err);
k3_status k3_dist_send_blocks(k3_dist *d, int32_t seq, const int32_t *blocks, int32_t n, k3_error *err);
k3_status k3_dist_send_pos(k3_dist *d, int32_t seq, int64_t pos, k3_error *err);
k3_status k3_dist_send_clear(k3_dist *d, int32_t seq, k3_error *err);
k3_status k3_dist_send_restore(k3_dist *d, int32_t seq, const void *state, int64_t bytes, k3_error *err);

#endif /* K3_DIST_DIST_H */
