/*
 * comm.h -- the inside of k3_dist (k3.h "distributed"): the transport
 * between ranks. The MPI groups, the collectives the layers and the
 * executor use, their traffic counters, and the exchange of DSA candidates.
 * src/comm/ is the only code that calls MPI, and it knows nothing of a
 * context: it moves bytes between ranks.
 *
 * Every collective is started non-blocking and waited for with a deadline
 * (k3_dist_options.timeout_s), so a rank that dies or hangs turns into an
 * error on the others instead of a hang. The first failure is sticky: the
 * dist remembers it, later collectives return at once, and whoever asks
 * (k3_comm_failed) gets its message.
 */
#ifndef K3_COMM_COMM_H
#define K3_COMM_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "k3.h"

typedef enum { K3_GROUP_WORLD = 0, K3_GROUP_DCP, K3_GROUP_EP } k3_group;

/* ---- collectives (bytes; counted under kind, self excluded) ------------------ */

k3_status k3_comm_allgather(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, size_t bytes, void *recv);
k3_status k3_comm_sendrecv(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, size_t bytes, int32_t partner,
                           void *recv);
/* counts and displacements in bytes, per group rank */
k3_status k3_comm_alltoallv(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, const int *scount,
                            const int *sdispl, void *recv, const int *rcount, const int *rdispl);
/* Rank 0's bytes to every rank of the world, counted as K3_COMM_CONTROL;
 * what names the message in a failure. wait_s: the deadline (< 0: none, for
 * a rank that waits for rank 0's next command). */
k3_status k3_comm_bcast(k3_dist *d, void *buf, size_t bytes, const char *what, double wait_s);
/* The deadline of one collective (k3_dist_options.timeout_s). */
double k3_comm_timeout(const k3_dist *d);
/* group size and rank */
int32_t k3_comm_group_size(const k3_dist *d, k3_group g);
int32_t k3_comm_group_rank(const k3_dist *d, k3_group g);

/* The sticky failure: K3_OK (also for d NULL), or the first failure's status
 * (message into err). */
k3_status k3_comm_failed(const k3_dist *d, k3_error *err);
/* Makes the link fail for a reason of the caller's (a message the other
 * ranks wait for cannot be sent): sticky as any failure; message into err. */
k3_status k3_comm_fail(k3_dist *d, const char *what, k3_error *err);

/* Every rank takes its own counters (k3_dist_stats_take) and they are
 * summed over the world (one all-reduce); mine and all may be NULL. */
k3_status k3_comm_stats_sum(k3_dist *d, k3_comm_stats *mine, k3_comm_stats *all, k3_error *err);

/* ---- the exchange of DSA candidates -------------------------------------------- */

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
k3_status k3_comm_topk_exchange(k3_dist *d, const k3_cand *mine, int32_t rows, int32_t k, k3_cand *out, k3_cand *work);

#endif /* K3_COMM_COMM_H */
