/*
 * comm.c -- k3_dist on MPI: groups, wrapped non-blocking collectives with a
 * deadline, and traffic counters (see comm.h). Rank 0's command channel,
 * which rides on k3_comm_bcast, is the executor's (src/executor).
 *
 * What OpenMPI 4.1 detects: a rank that exits or is killed makes mpirun end
 * the whole job (its default), so the others do not outlive it; a rank that
 * hangs, or a transport that loses a peer without mpirun noticing, is seen
 * here as a collective past its deadline: the waiting ranks fail with a
 * message naming the collective. Communicators use MPI_ERRORS_RETURN, so an
 * error code MPI does return becomes a k3_status, never an abort inside MPI.
 */
#include "comm/comm.h"

#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"

struct k3_dist {
    int32_t rank, size;
    MPI_Comm dcp, ep;
    int32_t dcp_rank, dcp_size, ep_rank, ep_size, il;
    k3_topk_exchange exchange;
    double timeout;
    bool own_init;
    k3_comm_stats st;
    k3_error fail; /* sticky */
};

static k3_status dist_fail(k3_dist *d, const char *what, int rc) {
    if (d->fail.status) return d->fail.status;
    char es[MPI_MAX_ERROR_STRING] = "";
    int n = 0;
    if (rc != MPI_SUCCESS) MPI_Error_string(rc, es, &n);
    return k3_err(&d->fail, K3_ERR_IO, "dist: rank %d: %s failed%s%s", d->rank, what, n ? ": " : "", es);
}

/* Waits for r until done or the deadline (timeout < 0: no deadline). The
 * first 200 tests yield, then it sleeps between tests (20 us, after 2000
 * tests 500 us): ranks share cores here, and MPI's progress happens inside
 * MPI_Test. Measured on tiny-dsa, DCP 2, 2 cores under load (medians of 5
 * runs, 3 tries each, alternated): 200 yields 2.7-5.8 ms per decoded token,
 * 20 yields 4.6-10.4, 20000 (spinning) 9.7-12.8. */
static k3_status wait_req(k3_dist *d, MPI_Request *r, const char *what, double timeout) {
    const double t0 = k3_now();
    for (long spins = 0;; spins++) {
        int flag = 0;
        const int rc = MPI_Test(r, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return dist_fail(d, what, rc);
        if (flag) return K3_OK;
        if (spins < 200) {
            sched_yield();
            continue;
        }
        if (timeout >= 0 && k3_now() - t0 > timeout) {
            if (!d->fail.status)
                k3_err(&d->fail, K3_ERR_IO, "dist: rank %d: %s got no answer within %.0f s (a rank died or hangs)",
                       d->rank, what, timeout);
            return d->fail.status;
        }
        struct timespec ts = {0, spins < 2000 ? 20000 : 500000};
        nanosleep(&ts, NULL);
    }
}

static MPI_Comm comm_of(const k3_dist *d, k3_group g) {
    return g == K3_GROUP_DCP ? d->dcp : g == K3_GROUP_EP ? d->ep : MPI_COMM_WORLD;
}

int32_t k3_comm_group_size(const k3_dist *d, k3_group g) {
    return g == K3_GROUP_DCP ? d->dcp_size : g == K3_GROUP_EP ? d->ep_size : d->size;
}
int32_t k3_comm_group_rank(const k3_dist *d, k3_group g) {
    return g == K3_GROUP_DCP ? d->dcp_rank : g == K3_GROUP_EP ? d->ep_rank : d->rank;
}

static void count(k3_dist *d, k3_comm_kind kind, int64_t sent, int64_t recv, double t0) {
    d->st.sent[kind] += sent;
    d->st.recv[kind] += recv;
    d->st.calls[kind]++;
    d->st.seconds[kind] += k3_now() - t0;
}

k3_status k3_comm_allgather(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, size_t bytes, void *recv) {
    if (d->fail.status) return d->fail.status;
    const int n = k3_comm_group_size(d, g);
    if (bytes > (size_t)INT32_MAX / (size_t)n) return dist_fail(d, "allgather (message too large)", MPI_SUCCESS);
    const double t0 = k3_now();
    MPI_Request r;
    int rc = MPI_Iallgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, comm_of(d, g), &r);
    if (rc != MPI_SUCCESS) return dist_fail(d, "allgather", rc);
    k3_status s = wait_req(d, &r, "allgather", d->timeout);
    if (!s) count(d, kind, (int64_t)bytes * (n - 1), (int64_t)bytes * (n - 1), t0);
    return s;
}

k3_status k3_comm_sendrecv(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, size_t bytes, int32_t partner,
                           void *recv) {
    if (d->fail.status) return d->fail.status;
    if (bytes > (size_t)INT32_MAX) return dist_fail(d, "sendrecv (message too large)", MPI_SUCCESS);
    const double t0 = k3_now();
    MPI_Request r[2];
    int rc = MPI_Irecv(recv, (int)bytes, MPI_BYTE, partner, 7, comm_of(d, g), &r[0]);
    if (rc == MPI_SUCCESS) rc = MPI_Isend(send, (int)bytes, MPI_BYTE, partner, 7, comm_of(d, g), &r[1]);
    if (rc != MPI_SUCCESS) return dist_fail(d, "sendrecv", rc);
    k3_status s = wait_req(d, &r[0], "sendrecv", d->timeout);
    if (!s) s = wait_req(d, &r[1], "sendrecv", d->timeout);
    if (!s) count(d, kind, (int64_t)bytes, (int64_t)bytes, t0);
    return s;
}

k3_status k3_comm_alltoallv(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, const int *scount,
                            const int *sdispl, void *recv, const int *rcount, const int *rdispl) {
    if (d->fail.status) return d->fail.status;
    const double t0 = k3_now();
    MPI_Request r;
    int rc = MPI_Ialltoallv(send, scount, sdispl, MPI_BYTE, recv, rcount, rdispl, MPI_BYTE, comm_of(d, g), &r);
    if (rc != MPI_SUCCESS) return dist_fail(d, "alltoallv", rc);
    k3_status s = wait_req(d, &r, "alltoallv", d->timeout);
    if (s) return s;
    const int n = k3_comm_group_size(d, g), me = k3_comm_group_rank(d, g);
    int64_t sent = 0, got = 0;
    for (int i = 0; i < n; i++)
        if (i != me) {
            sent += scount[i];
            got += rcount[i];
        }
    count(d, kind, sent, got, t0);
    return K3_OK;
}

k3_status k3_comm_bcast(k3_dist *d, void *buf, size_t bytes, const char *what, double timeout) {
    if (d->fail.status) return d->fail.status;
    if (bytes > (size_t)INT32_MAX) return dist_fail(d, "broadcast (message too large)", MPI_SUCCESS);
    const double t0 = k3_now();
    MPI_Request r;
    int rc = MPI_Ibcast(buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD, &r);
    if (rc != MPI_SUCCESS) return dist_fail(d, what, rc);
    k3_status s = wait_req(d, &r, what, timeout);
    if (!s)
        count(d, K3_COMM_CONTROL, d->rank == 0 ? (int64_t)bytes * (d->size - 1) : 0, d->rank == 0 ? 0 : (int64_t)bytes,
              t0);
    return s;
}

k3_status k3_comm_failed(const k3_dist *d, k3_error *err) {
    if (!d || !d->fail.status) return K3_OK;
    return k3_err(err, d->fail.status, "%s", d->fail.msg);
}

k3_status k3_comm_fail(k3_dist *d, const char *what, k3_error *err) {
    dist_fail(d, what, MPI_SUCCESS);
    return k3_comm_failed(d, err);
}

double k3_comm_timeout(const k3_dist *d) { return d->timeout; }

/* ---- life cycle ----------------------------------------------------------------- */

k3_status k3_dist_init(k3_dist **out, const k3_dist_options *opt, k3_error *err) {
    *out = NULL;
    const int32_t D = opt && opt->dcp > 0 ? opt->dcp : 1, E = opt && opt->ep > 0 ? opt->ep : 1;
    const int32_t I = opt && opt->dcp_interleave ? opt->dcp_interleave : 1;
    k3_dist *d = calloc(1, sizeof *d);
    if (!d) return k3_err(err, K3_ERR_NOMEM, "dist: out of memory");
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        int provided;
        if (MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
            free(d);
            return k3_err(err, K3_ERR_IO, "dist: MPI_Init failed");
        }
        d->own_init = true;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    int r, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    d->rank = r;
    d->size = n;
    d->dcp = d->ep = MPI_COMM_NULL;
    d->timeout = opt && opt->timeout_s > 0 ? opt->timeout_s : 300.0;
    d->exchange = opt ? opt->exchange : K3_TOPK_ALLGATHER;
    k3_status s = K3_OK;
    if (opt && (opt->dcp < 0 || opt->ep < 0)) s = k3_err(err, K3_ERR_ARG, "dist: --dcp and --ep must be positive");
    else if (I < 1) s = k3_err(err, K3_ERR_ARG, "dist: --dcp-interleave must be positive, not %d", I);
    else if (n % D) s = k3_err(err, K3_ERR_ARG, "dist: --dcp %d does not divide the %d ranks of the job", D, n);
    else if (n % E) s = k3_err(err, K3_ERR_ARG, "dist: --ep %d does not divide the %d ranks of the job", E, n);
    else if (d->exchange == K3_TOPK_BUTTERFLY && (D & (D - 1)))
        s = k3_err(err, K3_ERR_ARG, "dist: the butterfly top-k exchange needs a power-of-two --dcp, not %d", D);
    else if (d->exchange != K3_TOPK_ALLGATHER && d->exchange != K3_TOPK_BUTTERFLY)
        s = k3_err(err, K3_ERR_ARG, "dist: unknown top-k exchange %d", (int)d->exchange);
    if (s) {
        k3_dist_free(d);
        return s;
    }
    d->dcp_size = D;
    d->ep_size = E;
    d->il = I;
    /* DCP: consecutive ranks; EP: ranks n/E apart (one of each DCP group
     * position), so a DCP group and an EP group meet in one rank */
    int rc = MPI_Comm_split(MPI_COMM_WORLD, r / D, r, &d->dcp);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_split(MPI_COMM_WORLD, r % (n / E), r, &d->ep);
    if (rc != MPI_SUCCESS) {
        k3_dist_free(d);
        return k3_err(err, K3_ERR_IO, "dist: cannot split the MPI world into DCP and EP groups");
    }
    MPI_Comm_rank(d->dcp, &r);
    d->dcp_rank = r;
    MPI_Comm_rank(d->ep, &r);
    d->ep_rank = r;
    *out = d;
    return K3_OK;
}

void k3_dist_free(k3_dist *d) {
    if (!d) return;
    if (d->dcp != MPI_COMM_NULL) MPI_Comm_free(&d->dcp);
    if (d->ep != MPI_COMM_NULL) MPI_Comm_free(&d->ep);
    if (d->own_init) {
        int fin = 0;
        MPI_Finalized(&fin);
        if (!fin) MPI_Finalize();
    }
    free(d);
}

void k3_dist_abort(k3_dist *d, int code) {
    (void)d;
    MPI_Abort(MPI_COMM_WORLD, code);
}

int32_t k3_dist_rank(const k3_dist *d) { return d ? d->rank : 0; }
int32_t k3_dist_size(const k3_dist *d) { return d ? d->size : 1; }
int32_t k3_dist_dcp_rank(const k3_dist *d) { return d ? d->dcp_rank : 0; }
int32_t k3_dist_dcp_size(const k3_dist *d) { return d ? d->dcp_size : 1; }
int32_t k3_dist_ep_rank(const k3_dist *d) { return d ? d->ep_rank : 0; }
int32_t k3_dist_ep_size(const k3_dist *d) { return d ? d->ep_size : 1; }
int32_t k3_dist_interleave(const k3_dist *d) { return d ? d->il : 1; }
k3_topk_exchange k3_dist_exchange(const k3_dist *d) { return d ? d->exchange : K3_TOPK_ALLGATHER; }

const char *k3_comm_kind_name(k3_comm_kind k) {
    static const char *names[K3_COMM_COUNT] = {"topk_exchange", "lse_merge", "ep_dispatch", "ep_combine", "control"};
    return k >= 0 && k < K3_COMM_COUNT ? names[k] : "?";
}

void k3_dist_stats_take(k3_dist *d, k3_comm_stats *out) {
    *out = d->st;
    memset(&d->st, 0, sizeof d->st);
}

/* ---- small collectives for the CLI ------------------------------------------------ */

k3_status k3_dist_agree(k3_dist *d, k3_status mine, k3_error *err) {
    if (d->fail.status) return k3_comm_failed(d, err);
    /* the lowest failing rank, or size when none failed */
    int me = mine ? d->rank : d->size, first = d->size;
    MPI_Request r;
    int rc = MPI_Iallreduce(&me, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD, &r);
    if (rc != MPI_SUCCESS) return k3_err(err, dist_fail(d, "agree", rc), "%s", d->fail.msg);
    if (wait_req(d, &r, "agree", d->timeout)) return k3_comm_failed(d, err);
    if (first == d->size) return K3_OK;
    struct {
        int32_t status;
        char msg[sizeof err->msg];
    } m = {0};
    if (d->rank == first) {
        m.status = mine;
        snprintf(m.msg, sizeof m.msg, "%s", err && err->msg[0] ? err->msg : k3_status_str(mine));
    }
    rc = MPI_Ibcast(&m, (int)sizeof m, MPI_BYTE, first, MPI_COMM_WORLD, &r);
    if (rc != MPI_SUCCESS) return k3_err(err, dist_fail(d, "agree", rc), "%s", d->fail.msg);
    if (wait_req(d, &r, "agree", d->timeout)) return k3_comm_failed(d, err);
    if (err) {
        k3_err_clear(err);
        if (first == d->rank) k3_err(err, (k3_status)m.status, "%s", m.msg);
        else k3_err(err, (k3_status)m.status, "rank %d: %s", first, m.msg);
    }
    return (k3_status)m.status;
}

k3_status k3_dist_bcast_i64(k3_dist *d, int64_t *v, int32_t n, k3_error *err) {
    if (k3_comm_bcast(d, v, sizeof(int64_t) * (size_t)n, "broadcast", d->timeout)) return k3_comm_failed(d, err);
    return K3_OK;
}

static k3_status reduce(k3_dist *d, double *v, int32_t n, MPI_Op op, k3_error *err) {
    if (d->fail.status) return k3_comm_failed(d, err);
    MPI_Request r;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, v, n, MPI_DOUBLE, op, MPI_COMM_WORLD, &r);
    if (rc != MPI_SUCCESS) dist_fail(d, "allreduce", rc);
    else wait_req(d, &r, "allreduce", d->timeout);
    return k3_comm_failed(d, err);
}

k3_status k3_dist_sum(k3_dist *d, double *v, int32_t n, k3_error *err) { return reduce(d, v, n, MPI_SUM, err); }
k3_status k3_dist_max(k3_dist *d, double *v, int32_t n, k3_error *err) { return reduce(d, v, n, MPI_MAX, err); }

/* An all-reduce of 4 x K3_COMM_COUNT doubles: exact to 2^53 bytes. */
k3_status k3_comm_stats_sum(k3_dist *d, k3_comm_stats *mine, k3_comm_stats *all, k3_error *err) {
    k3_comm_stats own;
    k3_dist_stats_take(d, &own);
    if (mine) *mine = own;
    enum { K = K3_COMM_COUNT };
    double v[4 * K];
    for (int k = 0; k < K; k++) {
        v[k] = (double)own.sent[k];
        v[K + k] = (double)own.recv[k];
        v[2 * K + k] = (double)own.calls[k];
        v[3 * K + k] = own.seconds[k];
    }
    const k3_status s = reduce(d, v, 4 * K, MPI_SUM, err);
    if (all) {
        memset(all, 0, sizeof *all);
        for (int k = 0; !s && k < K; k++) {
            all->sent[k] = (int64_t)v[k];
            all->recv[k] = (int64_t)v[K + k];
            all->calls[k] = (int64_t)v[2 * K + k];
            all->seconds[k] = v[3 * K + k];
        }
    }
    return s;
}
