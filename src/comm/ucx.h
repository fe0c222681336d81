/*
 * ucx.h -- one-sided bulk transfer over UCX (Debian's libucx, the ucp_* API):
 * the data path a prefill -> decode handoff needs when the caches lie in
 * registered memory, as vLLM's NIXL connector moves KV. Optional: without
 * libucx-dev at build time every call returns K3_ERR_UNSUPPORTED and
 * k3_ucx_available() is false.
 *
 * The pieces, in the order a transfer uses them:
 *
 *   k3_ucx          a context and its one worker (the progress engine); one per
 *                   thread that drives transfers: nothing here is thread safe.
 *   k3_ucx_mem      a local region registered with the worker's context
 *                   (ucp_mem_map), and its packed descriptor: base address,
 *                   length and the remote key, for the peer to address it.
 *   k3_ucx_ep       an endpoint to a peer worker, made from the worker address
 *                   the peer sent over the control channel.
 *   k3_ucx_region   a peer's region, unpacked for one endpoint: what a get reads
 *                   from and a put writes into, by offset, bounds checked.
 *   k3_ucx_xfer     a batch of one-sided operations on one endpoint
 *                   (ucp_get_nbx / ucp_put_nbx), waited for with a deadline,
 *                   or cancelled.
 *
 * The control channel is the caller's (the PD agent's checked TCP stream, a
 * socket, a pipe): k3_ucx_handshake sends this worker's address and the
 * descriptors of the regions it offers, receives the peer's, and makes the
 * endpoint. Both sides call it; nothing in it trusts the peer's lengths.
 *
 * Which transport moves the bytes is UCX's choice among those the context
 * allows (k3_ucx_options.tls, else UCX_TLS of the environment, which UCX
 * reads itself): on one host the shared-memory ones (cma, posix: the get is
 * a copy by the initiator, the target's CPU does nothing); across hosts tcp
 * (its one-sided operations are emulated with messages: the target must
 * progress its worker, k3_ucx_progress / k3_ucx_serve) or RDMA where there is
 * a NIC for it (rc, dc: true one-sided, zero copy on both sides).
 *
 * Failures: every call returns a status and a message with its context (the
 * operation, the bytes, the offset, the peer, UCX's own words). A peer that
 * dies fails the endpoint (UCX's peer error handling): its operations end
 * with an error at the next progress. A peer that goes silent (a cut link)
 * is a deadline: k3_ucx_xfer_wait returns K3_ERR_IO naming the operations
 * still outstanding, and k3_ucx_xfer_cancel closes the endpoint by force, so
 * they end and the local buffers may be reused or freed.
 */
#ifndef K3_COMM_UCX_H
#define K3_COMM_UCX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "k3.h"

typedef struct k3_ucx k3_ucx;
typedef struct k3_ucx_mem k3_ucx_mem;
typedef struct k3_ucx_ep k3_ucx_ep;
typedef struct k3_ucx_region k3_ucx_region;
typedef struct k3_ucx_xfer k3_ucx_xfer;

/* Whether this build has UCX. */
bool k3_ucx_available(void);

typedef struct k3_ucx_options {
    const char *tls;  /* UCX_TLS for this context ("cma,self", "tcp,self", ...); NULL: UCX's own (its environment) */
    const char *name; /* for messages and UCX's logs; NULL: "k3" */
    /* Endpoints without UCX's peer failure detection (UCP_ERR_HANDLING_MODE_NONE):
     * needed for the shared-memory transports, which have none; a dead peer is
     * then seen by the deadlines only. Default (false): detection on, which
     * leaves UCX only the transports that have it (tcp, RDMA). */
    bool no_peer_errors;
} k3_ucx_options;

k3_status k3_ucx_open(k3_ucx **out, const k3_ucx_options *opt, k3_error *err);
/* Another worker on parent's context (its options, its registrations), for
 * another thread: each worker is one thread's, the context is shared. A
 * worker made for one transfer and closed after it takes its endpoints and
 * its listening sockets with it. The parent is closed last. */
k3_status k3_ucx_worker_new(k3_ucx *parent, const char *name, k3_ucx **out, k3_error *err);
/* Frees the worker (and the context, when it is not a k3_ucx_worker_new
 * child's); endpoints, regions and registrations made from it must be freed
 * first. */
void k3_ucx_close(k3_ucx *u);
/* Whether everything the worker has outstanding toward any peer (its own
 * operations and UCX's connection messages, such as the reply to a peer
 * that connected) is done, without waiting: the first call posts a flush of
 * the worker, every call progresses it. 1: done (with or without an error:
 * k3_ucx_close is safe then), 0: not yet. UCX 1.13 aborts in
 * ucp_worker_destroy on a connection reply still queued toward a peer whose
 * link is down; a worker whose peer was lost waits for this before it is
 * closed. */
int k3_ucx_quiet(k3_ucx *u);
/* The transports the context may use, as UCX names them (for messages). */
const char *k3_ucx_tls(const k3_ucx *u);

/* One round of the worker's progress; returns how many events it handled. */
unsigned k3_ucx_progress(k3_ucx *u);
/* Progresses for up to seconds (short sleeps when idle), or until *stop
 * (when stop is not NULL) turns true: the target side of a transport that
 * emulates one-sided operations. */
void k3_ucx_serve(k3_ucx *u, double seconds, const volatile bool *stop);
/* The same until fd has something to read (or hung up): 1 then, 0 when
 * seconds passed or *stop turned true. */
int k3_ucx_serve_until_readable(k3_ucx *u, int fd, double seconds, const volatile bool *stop);

/* ---- registered memory ------------------------------------------------------------------------- */

/* Registers [base, base + len) for local and remote access. */
k3_status k3_ucx_mem_register(k3_ucx *u, void *base, size_t len, k3_ucx_mem **out, k3_error *err);
/* The same with the access a peer is given: K3_UCX_LOCAL (none: the
 * destination of this side's gets), K3_UCX_REMOTE_READ (gets from a peer),
 * or both ways. What a remote key enforces is the transport's: an RDMA NIC
 * checks the region and the access; shared memory (cma) and the transports
 * that emulate one-sided operations with messages (tcp) do not check them at
 * all (docs/pd.md, "What a remote key gives"). */
enum { K3_UCX_LOCAL = 0, K3_UCX_REMOTE_READ = 1, K3_UCX_REMOTE_RW = 3 };
k3_status k3_ucx_mem_register_access(k3_ucx *u, void *base, size_t len, int access, k3_ucx_mem **out, k3_error *err);
void k3_ucx_mem_free(k3_ucx_mem *m);
/* The region's descriptor for a peer (magic, base, length, remote key):
 * *desc is malloc'd, the caller frees it. */
k3_status k3_ucx_mem_pack(k3_ucx_mem *m, void **desc, size_t *len, k3_error *err);

/* ---- endpoints and the control channel --------------------------------------------------------- */

/* The caller's control channel: send and receive exactly len bytes (each with
 * the channel's own deadline), K3_OK or a status with its message. */
typedef struct k3_ucx_chan {
    void *ctx;
    k3_status (*send)(void *ctx, const void *buf, size_t len, k3_error *err);
    k3_status (*recv)(void *ctx, void *buf, size_t len, k3_error *err);
} k3_ucx_chan;

/* A socket as a control channel (blocking reads and writes, each within
 * timeout_s); sock outlives the channel. */
typedef struct k3_ucx_sock {
    int fd;
    double timeout_s;
} k3_ucx_sock;
k3_ucx_chan k3_ucx_chan_socket(k3_ucx_sock *sock);

/* Both sides: sends this worker's address and the descriptors of the n_mine
 * regions offered, receives the peer's, makes the endpoint to it (*ep) and
 * unpacks the peer's regions into theirs (at most max_theirs; *n_theirs
 * got). peer names the peer in messages. */
k3_status k3_ucx_handshake(k3_ucx *u, const k3_ucx_chan *ch, const char *peer, k3_ucx_mem *const *mine, int n_mine,
                           k3_ucx_ep **ep, k3_ucx_region **theirs, int max_theirs, int *n_theirs, k3_error *err);
/* The same in pieces: the worker's address (*addr malloc'd), an endpoint
 * from a peer's address, a peer's region from its descriptor. */
k3_status k3_ucx_address(k3_ucx *u, void **addr, size_t *len, k3_error *err);
k3_status k3_ucx_connect(k3_ucx *u, const void *addr, size_t len, const char *peer, k3_ucx_ep **out, k3_error *err);
k3_status k3_ucx_region_unpack(k3_ucx_ep *ep, const void *desc, size_t len, k3_ucx_region **out, k3_error *err);
uint64_t k3_ucx_region_size(const k3_ucx_region *r);
void k3_ucx_region_free(k3_ucx_region *r);
/* Closes the endpoint (flushing what was posted, within timeout_s; by force
 * past it or when the peer failed). Its regions must be freed first. */
void k3_ucx_ep_close(k3_ucx_ep *ep, double timeout_s);
/* The endpoint's failure (K3_OK while it is sound), message into err. */
k3_status k3_ucx_ep_failed(const k3_ucx_ep *ep, k3_error *err);

/* ---- one-sided transfers ----------------------------------------------------------------------- */

k3_status k3_ucx_xfer_begin(k3_ucx_ep *ep, k3_ucx_xfer **out, k3_error *err);
/* Reads len bytes at offset of the peer's region into local (which lies in
 * a registered region, lmem, or any memory when lmem is NULL). */
k3_status k3_ucx_get(k3_ucx_xfer *x, void *local, k3_ucx_mem *lmem, size_t len, const k3_ucx_region *r, uint64_t offset,
                     k3_error *err);
/* Writes len bytes of local at offset of the peer's region. */
k3_status k3_ucx_put(k3_ucx_xfer *x, const void *local, k3_ucx_mem *lmem, size_t len, const k3_ucx_region *r,
                     uint64_t offset, k3_error *err);
/* 1 when every operation posted has completed (0 still going), after one
 * round of progress; a failure as its status. */
k3_status k3_ucx_xfer_test(k3_ucx_xfer *x, int *done, k3_error *err);
/* Progresses until every operation posted has completed (puts: at the peer,
 * by a flush), one failed, or timeout_s passed (K3_ERR_IO naming how many of
 * how many bytes are outstanding). */
k3_status k3_ucx_xfer_wait(k3_ucx_xfer *x, double timeout_s, k3_error *err);
/* Ends the operations still outstanding: the endpoint is closed by force
 * (every later call on it fails), and they complete as cancelled before this
 * returns, so their buffers are the caller's again. */
void k3_ucx_xfer_cancel(k3_ucx_xfer *x);
/* Frees a batch that has completed or was cancelled. */
void k3_ucx_xfer_free(k3_ucx_xfer *x);
/* Bytes posted and completed so far. */
uint64_t k3_ucx_xfer_bytes(const k3_ucx_xfer *x);

#endif /* K3_COMM_UCX_H */
