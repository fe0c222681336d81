/*
 * dist.c -- k3_dist on MPI: groups, wrapped non-blocking collectives with a
 * deadline, traffic counters, and rank 0's command channel (see dist.h).
 *
 * What OpenMPI 4.1 detects: a rank that exits or is killed makes mpirun end
 * the whole job (its default), so the others do not outlive it; a rank that
 * hangs, or a transport that loses a peer without mpirun noticing, is seen
 * here as a collective past its deadline: the waiting ranks fail with a
 * message naming the collective. Communicators use MPI_ERRORS_RETURN, so an
 * error code MPI does return becomes a k3_status, never an abort inside MPI.
 */
#include "dist.h"

#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "engine/ctx.h"

struct k3_dist {
    int32_t rank, size;
    MPI_Comm dcp, ep;
    int32_t dcp_rank, dcp_size, ep_rank, ep_size, il;
    k3_topk_exchange exchange;
    double timeout;
    bool own_init;
    k3_comm_stats st;
    k3_error fail;  /* sticky */
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
                k3_err(&d->fail, K3_ERR_IO,
                       "dist: rank %d: %s got no answer within %.0f s (a rank died or hangs)", d->rank, what,
                       timeout);
            return d->fail.status;
        }
        struct timespec ts = {0, spins < 2000 ? 20000 : 500000};
        nanosleep(&ts, NULL);
    }
}

static MPI_Comm comm_of(const k3_dist *d, k3_group g) {
    return g == K3_GROUP_DCP ? d->dcp : g == K3_GROUP_EP ? d->ep : MPI_COMM_WORLD;
}

int32_t k3_dist_group_size(const k3_dist *d, k3_group g) {
    return g == K3_GROUP_DCP ? d->dcp_size : g == K3_GROUP_EP ? d->ep_size : d->size;
}
int32_t k3_dist_group_rank(const k3_dist *d, k3_group g) {
    return g == K3_GROUP_DCP ? d->dcp_rank : g == K3_GROUP_EP ? d->ep_rank : d->rank;
}

static void count(k3_dist *d, k3_comm_kind kind, int64_t sent, int64_t recv, double t0) {
    d->st.sent[kind] += sent;
    d->st.recv[kind] += recv;
    d->st.calls[kind]++;
    d->st.seconds[kind] += k3_now() - t0;
}

k3_status k3_dist_allgather(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, size_t bytes,
                            void *recv) {
    if (d->fail.status) return d->fail.status;
    const int n = k3_dist_group_size(d, g);
    if (bytes > (size_t)INT32_MAX / (size_t)n) return dist_fail(d, "allgather (message too large)", MPI_SUCCESS);
    const double t0 = k3_now();
    MPI_Request r;
    int rc = MPI_Iallgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, comm_of(d, g), &r);
    if (rc != MPI_SUCCESS) return dist_fail(d, "allgather", rc);
    k3_status s = wait_req(d, &r, "allgather", d->timeout);
    if (!s) count(d, kind, (int64_t)bytes * (n - 1), (int64_t)bytes * (n - 1), t0);
    return s;
}

k3_status k3_dist_sendrecv(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, size_t bytes,
                           int32_t partner, void *recv) {
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

k3_status k3_dist_alltoallv(k3_dist *d, k3_group g, k3_comm_kind kind, const void *send, const int *scount,
                            const int *sdispl, void *recv, const int *rcount, const int *rdispl) {
    if (d->fail.status) return d->fail.status;
    const double t0 = k3_now();
    MPI_Request r;
    int rc = MPI_Ialltoallv(send, scount, sdispl, MPI_BYTE, recv, rcount, rdispl, MPI_BYTE, comm_of(d, g), &r);
    if (rc != MPI_SUCCESS) return dist_fail(d, "alltoallv", rc);
    k3_status s = wait_req(d, &r, "alltoallv", d->timeout);
    if (s) return s;
    const int n = k3_dist_group_size(d, g), me = k3_dist_group_rank(d, g);
    int64_t sent = 0, got = 0;
    for (int i = 0; i < n; i++)
        if (i != me) {
            sent += scount[i];
            got += rcount[i];
        }
    count(d, kind, sent, got, t0);
    return K3_OK;
}

static k3_status bcast(k3_dist *d, void *buf, size_t bytes, const char *what, double timeout) {
    if (d->fail.status) return d->fail.status;
    if (bytes > (size_t)INT32_MAX) return dist_fail(d, "broadcast (message too large)", MPI_SUCCESS);
    const double t0 = k3_now();
    MPI_Request r;
    int rc = MPI_Ibcast(buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD, &r);
    if (rc != MPI_SUCCESS) return dist_fail(d, what, rc);
    k3_status s = wait_req(d, &r, what, timeout);
    if (!s) count(d, K3_COMM_CONTROL, d->rank == 0 ? (int64_t)bytes * (d->size - 1) : 0,
                  d->rank == 0 ? 0 : (int64_t)bytes, t0);
    return s;
}

k3_status k3_dist_failed(const k3_dist *d, k3_error *err) {
    if (!d || !d->fail.status) return K3_OK;
    return k3_err(err, d->fail.status, "%s", d->fail.msg);
}

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
    if (opt && (opt->dcp < 0 || opt->ep < 0))
        s = k3_err(err, K3_ERR_ARG, "dist: --dcp and --ep must be positive");
    else if (I < 1)
        s = k3_err(err, K3_ERR_ARG, "dist: --dcp-interleave must be positive, not %d", I);
    else if (n % D)
        s = k3_err(err, K3_ERR_ARG, "dist: --dcp %d does not divide the %d ranks of the job", D, n);
    else if (n % E)
        s = k3_err(err, K3_ERR_ARG, "dist: --ep %d does not divide the %d ranks of the job", E, n);
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
    static const char *names[K3_COMM_COUNT] = {"topk_exchange", "lse_merge", "ep_dispatch", "ep_combine",
                                               "control"};
    return k >= 0 && k < K3_COMM_COUNT ? names[k] : "?";
}

void k3_dist_stats_take(k3_dist *d, k3_comm_stats *out) {
    *out = d->st;
    memset(&d->st, 0, sizeof d->st);
}

/* ---- small collectives for the CLI ------------------------------------------------ */

k3_status k3_dist_agree(k3_dist *d, k3_status mine, k3_error *err) {
    if (d->fail.status) return k3_dist_failed(d, err);
    /* the lowest failing rank, or size when none failed */
    int me = mine ? d->rank : d->size, first = d->size;
    MPI_Request r;
    int rc = MPI_Iallreduce(&me, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD, &r);
    if (rc != MPI_SUCCESS) return k3_err(err, dist_fail(d, "agree", rc), "%s", d->fail.msg);
    if (wait_req(d, &r, "agree", d->timeout)) return k3_dist_failed(d, err);
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
    if (wait_req(d, &r, "agree", d->timeout)) return k3_dist_failed(d, err);
    if (err) {
        k3_err_clear(err);
        if (first == d->rank) k3_err(err, (k3_status)m.status, "%s", m.msg);
        else k3_err(err, (k3_status)m.status, "rank %d: %s", first, m.msg);
    }
    return (k3_status)m.status;
}

k3_status k3_dist_bcast_i64(k3_dist *d, int64_t *v, int32_t n, k3_error *err) {
    if (bcast(d, v, sizeof(int64_t) * (size_t)n, "broadcast", d->timeout)) return k3_dist_failed(d, err);
    return K3_OK;
}

static k3_status reduce(k3_dist *d, double *v, int32_t n, MPI_Op op, k3_error *err) {
    if (d->fail.status) return k3_dist_failed(d, err);
    MPI_Request r;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, v, n, MPI_DOUBLE, op, MPI_COMM_WORLD, &r);
    if (rc != MPI_SUCCESS) dist_fail(d, "allreduce", rc);
    else wait_req(d, &r, "allreduce", d->timeout);
    return k3_dist_failed(d, err);
}

k3_status k3_dist_sum(k3_dist *d, double *v, int32_t n, k3_error *err) { return reduce(d, v, n, MPI_SUM, err); }
k3_status k3_dist_max(k3_dist *d, double *v, int32_t n, k3_error *err) { return reduce(d, v, n, MPI_MAX, err); }

/* ---- rank 0's command channel ------------------------------------------------------ */

enum { CMD_STOP = 1, CMD_FORWARD, CMD_RESET, CMD_FILL, CMD_POOL, CMD_RUN, CMD_BLOCKS, CMD_POS, CMD_CLEAR, CMD_RESTORE,
       CMD_STATS };

typedef struct cmd_hdr {
    int32_t cmd, n_seqs, mode, pad;
    int64_t n_tokens, a, b;
} cmd_hdr;

/* ---- image rows (k3_batch_seq.embeds) after a batch ---------------------------------
 * The header's field a counts them; when non-zero a flag per token (1: the
 * row follows) and the rows themselves (row_floats floats each) follow the
 * ids, in token order. */

static int64_t embed_rows(const k3_batch_seq *batch, int32_t n_seqs) {
    int64_t n = 0;
    for (int32_t i = 0; i < n_seqs; i++)
        for (int32_t t = 0; batch[i].embeds && t < batch[i].n_tokens; t++) n += batch[i].embeds[t] != NULL;
    return n;
}

/* refused before anything is sent: a message over MPI's int count */
static k3_status embed_check(int64_t rows, int64_t row_floats, k3_error *err) {
    if (rows > 0 && (row_floats < 1 || rows > (int64_t)INT32_MAX / 4 / row_floats))
        return k3_err(err, K3_ERR_RANGE, "dist: %lld image rows of %lld floats are over one broadcast (2 GB)",
                      (long long)rows, (long long)row_floats);
    return K3_OK;
}

static k3_status send_embeds(k3_dist *d, const k3_batch_seq *batch, int32_t n_seqs, int64_t n_tokens, int64_t rows,
                             int64_t row_floats, k3_error *err) {
    if (rows == 0 || d->fail.status) return k3_dist_failed(d, err);
    int32_t *flag = malloc(sizeof(int32_t) * (size_t)(n_tokens + 1));
    float *f = malloc(sizeof(float) * (size_t)(rows * row_floats));
    if (!flag || !f) {
        free(flag), free(f);
        /* the workers wait for the rows: the link cannot go on */
        return k3_err(err, dist_fail(d, "sending image rows (out of memory)", MPI_SUCCESS), "%s", d->fail.msg);
    }
    int64_t o = 0, r = 0;
    for (int32_t i = 0; i < n_seqs; i++)
        for (int32_t t = 0; t < batch[i].n_tokens; t++, o++) {
            const float *e = batch[i].embeds ? batch[i].embeds[t] : NULL;
            flag[o] = e != NULL;
            if (e) memcpy(f + r++ * row_floats, e, sizeof(float) * (size_t)row_floats);
        }
    if (!bcast(d, flag, sizeof(int32_t) * (size_t)n_tokens, "broadcast of image rows", d->timeout))
        bcast(d, f, sizeof(float) * (size_t)(rows * row_floats), "broadcast of image rows", d->timeout);
    free(flag), free(f);
    return k3_dist_failed(d, err);
}

/* The worker's side: *ptrs gets a row pointer per token of the batch (NULL:
 * the embedding table's), pointing into *buf; both caller-freed. */
static k3_status recv_embeds(k3_dist *d, int64_t n_tokens, int64_t rows, int64_t row_floats, const float ***ptrs,
                             float **buf, k3_error *err) {
    *ptrs = NULL;
    *buf = NULL;
    if (rows == 0) return K3_OK;
    if (rows < 0 || rows > n_tokens || row_floats < 1 || rows > (int64_t)INT32_MAX / 4 / row_floats)
        return k3_err(err, K3_ERR_FORMAT, "dist: rank %d: %lld image rows for %lld tokens from rank 0", d->rank,
                      (long long)rows, (long long)n_tokens);
    int32_t *flag = malloc(sizeof(int32_t) * (size_t)n_tokens);
    *buf = malloc(sizeof(float) * (size_t)(rows * row_floats));
    *ptrs = calloc((size_t)n_tokens, sizeof(float *));
    if (!flag || !*buf || !*ptrs) {
        free(flag);
        return k3_err(err, K3_ERR_NOMEM, "dist: rank %d: out of memory for image rows", d->rank);
    }
    k3_status s = K3_OK;
    if (bcast(d, flag, sizeof(int32_t) * (size_t)n_tokens, "broadcast of image rows", d->timeout) ||
        bcast(d, *buf, sizeof(float) * (size_t)(rows * row_floats), "broadcast of image rows", d->timeout))
        s = k3_dist_failed(d, err);
    int64_t r = 0;
    for (int64_t t = 0; !s && t < n_tokens; t++) r += flag[t] != 0;
    if (!s && r != rows)
        s = k3_err(err, K3_ERR_FORMAT, "dist: rank %d: %lld image row flags from rank 0, but %lld rows", d->rank,
                   (long long)r, (long long)rows);
    r = 0;
    for (int64_t t = 0; !s && t < n_tokens; t++)
        if (flag[t]) (*ptrs)[t] = *buf + r++ * row_floats;
    free(flag);
    return s;
}

k3_status k3_dist_send_forward(k3_dist *d, const k3_batch_seq *batch, int32_t n_seqs, k3_logits_mode mode,
                               int64_t row_floats, k3_error *err) {
    cmd_hdr h = {CMD_FORWARD, n_seqs, (int32_t)mode, 0, 0, embed_rows(batch, n_seqs), 0};
    for (int32_t i = 0; i < n_seqs; i++) h.n_tokens += batch[i].n_tokens;
    const k3_status es = embed_check(h.a, row_floats, err);
    if (es) return es;
    const size_t bytes = sizeof(int32_t) * (size_t)(2 * n_seqs + h.n_tokens);
    int32_t *p = malloc(bytes ? bytes : 1);
    if (!p) return k3_err(err, K3_ERR_NOMEM, "dist: out of memory for a batch");
    int64_t o = 2 * n_seqs;
    for (int32_t i = 0; i < n_seqs; i++) {
        p[2 * i] = batch[i].seq;
        p[2 * i + 1] = batch[i].n_tokens;
        memcpy(p + o, batch[i].tokens, sizeof(int32_t) * (size_t)batch[i].n_tokens);
        o += batch[i].n_tokens;
    }
    if (!bcast(d, &h, sizeof h, "broadcast of a batch", d->timeout))
        bcast(d, p, bytes, "broadcast of a batch", d->timeout);
    free(p);
    return send_embeds(d, batch, n_seqs, h.n_tokens, h.a, row_floats, err);
}

k3_status k3_dist_send_reset(k3_dist *d, int32_t seq, k3_error *err) {
    cmd_hdr h = {CMD_RESET, 0, 0, 0, 0, seq, 0};
    bcast(d, &h, sizeof h, "broadcast of a reset", d->timeout);
    return k3_dist_failed(d, err);
}

k3_status k3_dist_send_fill(k3_dist *d, int32_t seq, int64_t n, uint64_t seed, k3_error *err) {
    cmd_hdr h = {CMD_FILL, 0, 0, 0, n, seq, (int64_t)seed};
    bcast(d, &h, sizeof h, "broadcast of a cache fill", d->timeout);
    return k3_dist_failed(d, err);
}

/* ---- the engine's calls (k3 serve): a pool context, its batches and slots ---------- */

k3_status k3_dist_send_pool(k3_dist *d, const k3_ctx_options *o, int32_t n_blocks, int64_t max_ctx, k3_error *err) {
    cmd_hdr h = {CMD_POOL, o->max_seqs, (int32_t)o->kv_cache, o->block_size, o->max_tokens, n_blocks, max_ctx};
    int64_t extra[2] = {o->max_batch, o->dense_attention};
    if (!bcast(d, &h, sizeof h, "broadcast of a context", d->timeout))
        bcast(d, extra, sizeof extra, "broadcast of a context", d->timeout);
    return k3_dist_failed(d, err);
}

k3_status k3_dist_send_run(k3_dist *d, const k3_batch_seq *batch, int32_t n_seqs, const uint8_t *want,
                           int64_t row_floats, k3_error *err) {
    cmd_hdr h = {CMD_RUN, n_seqs, 0, 0, 0, embed_rows(batch, n_seqs), 0};
    for (int32_t i = 0; i < n_seqs; i++) h.n_tokens += batch[i].n_tokens;
    const k3_status es = embed_check(h.a, row_floats, err);
    if (es) return es;
    const size_t bytes = sizeof(int32_t) * (size_t)(3 * n_seqs + h.n_tokens);
    int32_t *p = malloc(bytes ? bytes : 1);
    if (!p) return k3_err(err, K3_ERR_NOMEM, "dist: out of memory for a batch");
    int64_t o = 3 * n_seqs;
    for (int32_t i = 0; i < n_seqs; i++) {
        p[3 * i] = batch[i].seq;
        p[3 * i + 1] = batch[i].n_tokens;
        p[3 * i + 2] = want[i];
        if (batch[i].n_tokens) memcpy(p + o, batch[i].tokens, sizeof(int32_t) * (size_t)batch[i].n_tokens);
        o += batch[i].n_tokens;
    }
    if (!bcast(d, &h, sizeof h, "broadcast of a batch", d->timeout))
        bcast(d, p, bytes, "broadcast of a batch", d->timeout);
    free(p);
    return send_embeds(d, batch, n_seqs, h.n_tokens, h.a, row_floats, err);
}

k3_status k3_dist_send_blocks(k3_dist *d, int32_t seq, const int32_t *blocks, int32_t n, k3_error *err) {
    cmd_hdr h = {CMD_BLOCKS, n, 0, 0, 0, seq, 0};
    if (!bcast(d, &h, sizeof h, "broadcast of a block table", d->timeout) && n > 0)
        bcast(d, (void *)blocks, sizeof(int32_t) * (size_t)n, "broadcast of a block table", d->timeout);
    return k3_dist_failed(d, err);
}

k3_status k3_dist_send_pos(k3_dist *d, int32_t seq, int64_t pos, k3_error *err) {
    cmd_hdr h = {CMD_POS, 0, 0, 0, 0, seq, pos};
    bcast(d, &h, sizeof h, "broadcast of a position", d->timeout);
    return k3_dist_failed(d, err);
}

k3_status k3_dist_send_clear(k3_dist *d, int32_t seq, k3_error *err) {
    cmd_hdr h = {CMD_CLEAR, 0, 0, 0, 0, seq, 0};
    bcast(d, &h, sizeof h, "broadcast of a state clear", d->timeout);
    return k3_dist_failed(d, err);
}

k3_status k3_dist_send_restore(k3_dist *d, int32_t seq, const void *state, int64_t bytes, k3_error *err) {
    cmd_hdr h = {CMD_RESTORE, 0, 0, 0, bytes, seq, 0};
    if (!bcast(d, &h, sizeof h, "broadcast of a state restore", d->timeout) && bytes > 0)
        bcast(d, (void *)state, (size_t)bytes, "broadcast of a state restore", d->timeout);
    return k3_dist_failed(d, err);
}

/* Every rank takes its counters and they are summed (an all-reduce of
 * 4 x K3_COMM_COUNT doubles: exact to 2^53 bytes). */
static k3_status stats_sum(k3_dist *d, k3_comm_stats *mine, k3_comm_stats *all, k3_error *err) {
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

k3_status k3_dist_stats_take_all(k3_dist *d, k3_comm_stats *mine, k3_comm_stats *all, k3_error *err) {
    if (!d || d->size == 1 || d->rank != 0) {
        k3_comm_stats own = {0};
        if (d) k3_dist_stats_take(d, &own);
        if (mine) *mine = own;
        if (all) *all = own;
        return d && d->rank != 0 ? k3_err(err, K3_ERR_ARG, "dist: only rank 0 sums the counters") : K3_OK;
    }
    cmd_hdr h = {CMD_STATS, 0, 0, 0, 0, 0, 0};
    if (bcast(d, &h, sizeof h, "broadcast of a counter sum", d->timeout)) return k3_dist_failed(d, err);
    return stats_sum(d, mine, all, err);
}

k3_status k3_dist_release(k3_dist *d, k3_error *err) {
    if (d->rank != 0 || d->size == 1) return K3_OK;
    cmd_hdr h = {CMD_STOP, 0, 0, 0, 0, 0, 0};
    bcast(d, &h, sizeof h, "broadcast of the end", d->timeout);
    return k3_dist_failed(d, err);
}

/* One engine command (CMD_RUN .. CMD_RESTORE) on a worker. */
static k3_status worker_engine_cmd(k3_dist *d, k3_ctx *ctx, const cmd_hdr *h, k3_error *err) {
    if (h->cmd == CMD_POS) {
        k3_ctx_seq_set_pos(ctx, (int32_t)h->a, h->b);
        return K3_OK;
    }
    if (h->cmd == CMD_CLEAR) {
        k3_ctx_seq_clear_state(ctx, (int32_t)h->a);
        return K3_OK;
    }
    if (h->cmd == CMD_BLOCKS) {
        if (h->n_seqs < 0 || h->n_seqs > ctx->max_blocks_per_seq)
            return k3_err(err, K3_ERR_FORMAT, "dist: rank %d: a block table of %d blocks from rank 0", d->rank,
                          h->n_seqs);
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)(h->n_seqs + 1));
        if (!ids) return k3_err(err, K3_ERR_NOMEM, "dist: rank %d: out of memory for a block table", d->rank);
        k3_status s = K3_OK;
        if (h->n_seqs > 0 && bcast(d, ids, sizeof(int32_t) * (size_t)h->n_seqs, "broadcast of a block table",
                                   d->timeout))
            s = k3_dist_failed(d, err);
        if (!s) s = k3_ctx_seq_set_blocks(ctx, (int32_t)h->a, ids, h->n_seqs, err);
        free(ids);
        return s;
    }
    if (h->cmd == CMD_RESTORE) {
        if (h->n_tokens != k3_ctx_state_bytes(ctx))
            return k3_err(err, K3_ERR_FORMAT, "dist: rank %d: a state of %lld bytes from rank 0, expected %lld",
                          d->rank, (long long)h->n_tokens, (long long)k3_ctx_state_bytes(ctx));
        void *buf = malloc((size_t)h->n_tokens + 1);
        if (!buf) return k3_err(err, K3_ERR_NOMEM, "dist: rank %d: out of memory for a state", d->rank);
        k3_status s = K3_OK;
        if (h->n_tokens > 0 && bcast(d, buf, (size_t)h->n_tokens, "broadcast of a state restore", d->timeout))
            s = k3_dist_failed(d, err);
        if (!s) k3_ctx_state_restore(ctx, (int32_t)h->a, buf);
        free(buf);
        return s;
    }
    /* CMD_RUN */
    if (h->n_seqs < 0 || h->n_tokens < 0)
        return k3_err(err, K3_ERR_FORMAT, "dist: rank %d: a bad batch from rank 0", d->rank);
    const int64_t V = ctx->c->vocab_size;
    const size_t bytes = sizeof(int32_t) * (size_t)(3 * h->n_seqs + h->n_tokens);
    int32_t *p = malloc(bytes ? bytes : 1);
    k3_batch_seq *b = calloc((size_t)(h->n_seqs ? h->n_seqs : 1), sizeof *b);
    uint8_t *want = malloc((size_t)(h->n_seqs ? h->n_seqs : 1));
    float *logits = NULL, *ebuf = NULL;
    const float **eptr = NULL;
    k3_status s = K3_OK;
    if (!p || !b || !want) s = k3_err(err, K3_ERR_NOMEM, "dist: rank %d: out of memory for a batch", d->rank);
    if (!s && bcast(d, p, bytes, "broadcast of a batch", d->timeout)) s = k3_dist_failed(d, err);
    if (!s) s = recv_embeds(d, h->n_tokens, h->a, ctx->c->hidden_size, &eptr, &ebuf, err);
    if (!s) {
        int64_t o = 3 * h->n_seqs, rows = 0;
        for (int32_t i = 0; i < h->n_seqs; i++) {
            const int32_t n = p[3 * i + 1];
            if (n < 0 || o + n > 3 * h->n_seqs + h->n_tokens) {
                s = k3_err(err, K3_ERR_FORMAT, "dist: rank %d: a bad batch from rank 0", d->rank);
                break;
            }
            b[i].seq = p[3 * i];
            b[i].n_tokens = n;
            b[i].tokens = p + o;
            b[i].embeds = eptr ? eptr + (o - 3 * h->n_seqs) : NULL;
            want[i] = (uint8_t)p[3 * i + 2];
            rows += want[i] == K3_WANT_ALL ? n : want[i] == K3_WANT_LAST ? 1 : 0;
            o += n;
        }
        if (!s && !(logits = malloc(sizeof(float) * (size_t)(rows * V + 1))))
            s = k3_err(err, K3_ERR_NOMEM, "dist: rank %d: out of memory for a batch", d->rank);
    }
    if (!s) s = k3_ctx_run(ctx, b, h->n_seqs, want, logits, err);
    free(eptr);
    free(ebuf);
    free(p);
    free(b);
    free(want);
    free(logits);
    return s;
}

k3_status k3_dist_worker_pool(k3_dist *d, const k3_model *m, k3_pool *pool, k3_error *err) {
    if (d->rank == 0) return k3_err(err, K3_ERR_ARG, "dist: rank 0 is not a worker");
    k3_ctx *ctx = NULL;
    k3_status s = K3_OK;
    for (;;) {
        cmd_hdr h;
        /* between commands rank 0 may wait for clients for as long as it likes */
        if (bcast(d, &h, sizeof h, "wait for rank 0", -1.0)) {
            s = k3_dist_failed(d, err);
            break;
        }
        if (h.cmd == CMD_STOP) break;
        if (h.cmd == CMD_POOL && !ctx) {
            int64_t extra[2];
            if (bcast(d, extra, sizeof extra, "broadcast of a context", d->timeout)) {
                s = k3_dist_failed(d, err);
                break;
            }
            k3_ctx_options o = {.max_seqs = h.n_seqs,
                                .max_tokens = h.n_tokens,
                                .block_size = h.pad,
                                .max_batch = (int32_t)extra[0],
                                .kv_cache = (k3_kv_type)h.mode,
                                .dense_attention = extra[1] != 0,
                                .pool = pool,
                                .dist = d};
            s = k3_ctx_init_pool(&ctx, m, &o, (int32_t)h.a, h.b, err);
            if (s) break;
            continue;
        }
        if (h.cmd == CMD_STATS) {
            if ((s = stats_sum(d, NULL, NULL, err))) break;
            continue;
        }
        if (!ctx || h.cmd < CMD_RUN || h.cmd > CMD_RESTORE) {
            s = k3_err(err, K3_ERR_FORMAT, "dist: rank %d: unexpected command %d from rank 0", d->rank, h.cmd);
            break;
        }
        s = worker_engine_cmd(d, ctx, &h, err);
        if (s) break;
    }
    k3_ctx_free(ctx);
    return s;
}

k3_status k3_dist_worker(k3_dist *d, k3_ctx *ctx, k3_error *err) {
    if (d->rank == 0) return k3_err(err, K3_ERR_ARG, "dist: rank 0 is not a worker");
    const int64_t V = ctx->c->vocab_size;
    for (;;) {
        cmd_hdr h;
        /* between commands rank 0 may tokenize, sample or print for long */
        if (bcast(d, &h, sizeof h, "wait for rank 0", -1.0)) return k3_dist_failed(d, err);
        if (h.cmd == CMD_STOP) return K3_OK;
        if (h.cmd == CMD_RESET) {
            k3_ctx_seq_reset(ctx, (int32_t)h.a);
            continue;
        }
        if (h.cmd == CMD_STATS) {
            k3_status s = stats_sum(d, NULL, NULL, err);
            if (s) return s;
            continue;
        }
        if (h.cmd == CMD_FILL) {
            k3_status s = k3_ctx_seq_fill_synthetic(ctx, (int32_t)h.a, h.n_tokens, (uint64_t)h.b, err);
            if (s) return s;
            continue;
        }
        if (h.cmd != CMD_FORWARD || h.n_seqs < 0 || h.n_tokens < 0)
            return k3_err(err, K3_ERR_FORMAT, "dist: rank %d: unknown command %d from rank 0", d->rank, h.cmd);
        const size_t bytes = sizeof(int32_t) * (size_t)(2 * h.n_seqs + h.n_tokens);
        int32_t *p = malloc(bytes ? bytes : 1);
        k3_batch_seq *b = malloc(sizeof *b * (size_t)(h.n_seqs ? h.n_seqs : 1));
        const k3_logits_mode mode = (k3_logits_mode)h.mode;
        const int64_t rows = mode == K3_LOGITS_NONE ? 0 : mode == K3_LOGITS_ALL ? h.n_tokens : h.n_seqs;
        float *logits = malloc(sizeof(float) * (size_t)(rows * V + 1)), *ebuf = NULL;
        const float **eptr = NULL;
        k3_status s = K3_OK;
        if (!p || !b || !logits) s = k3_err(err, K3_ERR_NOMEM, "dist: rank %d: out of memory for a batch", d->rank);
        if (!s && bcast(d, p, bytes, "broadcast of a batch", d->timeout)) s = k3_dist_failed(d, err);
        if (!s) s = recv_embeds(d, h.n_tokens, h.a, ctx->c->hidden_size, &eptr, &ebuf, err);
        if (!s) {
            int64_t o = 2 * h.n_seqs;
            for (int32_t i = 0; i < h.n_seqs; i++) {
                const int32_t n = p[2 * i + 1];
                if (n < 0 || o + n > 2 * h.n_seqs + h.n_tokens) {
                    s = k3_err(err, K3_ERR_FORMAT, "dist: rank %d: a bad batch from rank 0", d->rank);
                    break;
                }
                b[i] = (k3_batch_seq){p[2 * i], n, p + o, eptr ? eptr + (o - 2 * h.n_seqs) : NULL};
                o += n;
            }
            if (!s) s = k3_ctx_forward(ctx, b, h.n_seqs, mode, logits, err);
        }
        free(eptr);
        free(ebuf);
        free(p);
        free(b);
        free(logits);
        if (s) return s;
    }
}
