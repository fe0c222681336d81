/*
 * ucx.c -- one-sided bulk transfer on UCX's ucp_* API (see ucx.h). Built with
 * K3_HAVE_UCX (the Makefile sets it when pkg-config finds ucx); without it
 * every call says UCX is not in this build.
 *
 * Completion: each get or put is posted with a callback that counts it done
 * (and its bytes) on its batch and frees the request; one that completes in
 * place is counted at once. Waiting progresses the worker: a few hundred
 * rounds that yield, then short sleeps, as src/comm's collectives wait, since
 * the processes share cores here. Puts are complete at the peer only after a
 * flush of the endpoint, which the wait posts last.
 */
#include "comm/ucx.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/error.h"

/* ---- the socket control channel (no UCX needed) ------------------------------------------------- */

static k3_status sock_wait(k3_ucx_sock *s, short ev, double t0, const char *what, k3_error *err) {
    for (;;) {
        const double left = s->timeout_s - (k3_now() - t0);
        if (left <= 0)
            return k3_err(err, K3_ERR_IO, "ucx: the control channel: nothing %s within %.1f s", what, s->timeout_s);
        struct pollfd p = {.fd = s->fd, .events = ev};
        const int n = poll(&p, 1, (int)(left * 1000) + 1);
        if (n > 0) return K3_OK;
        if (n < 0 && errno != EINTR)
            return k3_err(err, K3_ERR_IO, "ucx: the control channel: poll: %s", strerror(errno));
    }
}

static k3_status sock_send(void *ctx, const void *buf, size_t len, k3_error *err) {
    k3_ucx_sock *s = ctx;
    const double t0 = k3_now();
    for (size_t off = 0; off < len;) {
        if (sock_wait(s, POLLOUT, t0, "taken", err)) return K3_ERR_IO;
        const ssize_t n = send(s->fd, (const char *)buf + off, len - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (n <= 0) return k3_err(err, K3_ERR_IO, "ucx: the control channel: send: %s", n ? strerror(errno) : "closed");
        off += (size_t)n;
    }
    return K3_OK;
}

static k3_status sock_recv(void *ctx, void *buf, size_t len, k3_error *err) {
    k3_ucx_sock *s = ctx;
    const double t0 = k3_now();
    for (size_t off = 0; off < len;) {
        if (sock_wait(s, POLLIN, t0, "received", err)) return K3_ERR_IO;
        const ssize_t n = recv(s->fd, (char *)buf + off, len - off, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (n == 0) return k3_err(err, K3_ERR_IO, "ucx: the control channel: the peer closed it");
        if (n < 0) return k3_err(err, K3_ERR_IO, "ucx: the control channel: recv: %s", strerror(errno));
        off += (size_t)n;
    }
    return K3_OK;
}

k3_ucx_chan k3_ucx_chan_socket(k3_ucx_sock *sock) { return (k3_ucx_chan){sock, sock_send, sock_recv}; }

#ifndef K3_HAVE_UCX

#define NO_UCX(err) \
    k3_err(err, K3_ERR_UNSUPPORTED, "ucx: this build has no UCX (libucx-dev was missing when it was made)")

bool k3_ucx_available(void) { return false; }
k3_status k3_ucx_open(k3_ucx **out, const k3_ucx_options *opt, k3_error *err) {
    *out = NULL;
    return NO_UCX(err);
}
k3_status k3_ucx_worker_new(k3_ucx *parent, const char *name, k3_ucx **out, k3_error *err) {
    *out = NULL;
    return NO_UCX(err);
}
void k3_ucx_close(k3_ucx *u) {}
int k3_ucx_quiet(k3_ucx *u) { return 1; }
const char *k3_ucx_tls(const k3_ucx *u) { return "none"; }
unsigned k3_ucx_progress(k3_ucx *u) { return 0; }
void k3_ucx_serve(k3_ucx *u, double seconds, const volatile bool *stop) {}
int k3_ucx_serve_until_readable(k3_ucx *u, int fd, double seconds, const volatile bool *stop) { return 0; }
k3_status k3_ucx_mem_register(k3_ucx *u, void *base, size_t len, k3_ucx_mem **out, k3_error *err) {
    *out = NULL;
    return NO_UCX(err);
}
k3_status k3_ucx_mem_register_access(k3_ucx *u, void *base, size_t len, int access, k3_ucx_mem **out, k3_error *err) {
    *out = NULL;
    return NO_UCX(err);
}
void k3_ucx_mem_free(k3_ucx_mem *m) {}
k3_status k3_ucx_mem_pack(k3_ucx_mem *m, void **desc, size_t *len, k3_error *err) { return NO_UCX(err); }
k3_status k3_ucx_handshake(k3_ucx *u, const k3_ucx_chan *ch, const char *peer, k3_ucx_mem *const *mine, int n_mine,
                           k3_ucx_ep **ep, k3_ucx_region **theirs, int max_theirs, int *n_theirs, k3_error *err) {
    return NO_UCX(err);
}
k3_status k3_ucx_address(k3_ucx *u, void **addr, size_t *len, k3_error *err) { return NO_UCX(err); }
k3_status k3_ucx_connect(k3_ucx *u, const void *addr, size_t len, const char *peer, k3_ucx_ep **out, k3_error *err) {
    return NO_UCX(err);
}
k3_status k3_ucx_region_unpack(k3_ucx_ep *ep, const void *desc, size_t len, k3_ucx_region **out, k3_error *err) {
    return NO_UCX(err);
}
uint64_t k3_ucx_region_size(const k3_ucx_region *r) { return 0; }
void k3_ucx_region_free(k3_ucx_region *r) {}
void k3_ucx_ep_close(k3_ucx_ep *ep, double timeout_s) {}
k3_status k3_ucx_ep_failed(const k3_ucx_ep *ep, k3_error *err) { return NO_UCX(err); }
k3_status k3_ucx_xfer_begin(k3_ucx_ep *ep, k3_ucx_xfer **out, k3_error *err) { return NO_UCX(err); }
k3_status k3_ucx_get(k3_ucx_xfer *x, void *local, k3_ucx_mem *lmem, size_t len, const k3_ucx_region *r, uint64_t offset,
                     k3_error *err) {
    return NO_UCX(err);
}
k3_status k3_ucx_put(k3_ucx_xfer *x, const void *local, k3_ucx_mem *lmem, size_t len, const k3_ucx_region *r,
                     uint64_t offset, k3_error *err) {
    return NO_UCX(err);
}
k3_status k3_ucx_xfer_test(k3_ucx_xfer *x, int *done, k3_error *err) { return NO_UCX(err); }
k3_status k3_ucx_xfer_wait(k3_ucx_xfer *x, double timeout_s, k3_error *err) { return NO_UCX(err); }
void k3_ucx_xfer_cancel(k3_ucx_xfer *x) {}
void k3_ucx_xfer_free(k3_ucx_xfer *x) {}
uint64_t k3_ucx_xfer_bytes(const k3_ucx_xfer *x) { return 0; }

#else

#include <ucp/api/ucp.h>

struct k3_ucx {
    ucp_context_h ctx;
    ucp_worker_h w;
    char tls[128], name[64];
    bool peer_errors;
    bool child;  /* a k3_ucx_worker_new worker: the context is the parent's */
    void *flush; /* k3_ucx_quiet's flush in flight */
};

struct k3_ucx_mem {
    k3_ucx *u;
    ucp_mem_h h;
    void *base;
    size_t len;
};

struct k3_ucx_ep {
    k3_ucx *u;
    ucp_ep_h ep; /* NULL once closed */
    ucs_status_t failed;
    char peer[96];
};

struct k3_ucx_region {
    k3_ucx_ep *ep;
    ucp_rkey_h rkey;
    uint64_t base, len;
};

struct k3_ucx_xfer {
    k3_ucx_ep *ep;
    uint64_t posted, done;      /* operations */
    uint64_t bytes, bytes_done; /* payload */
    ucs_status_t status;        /* the first failure */
    char what[200];             /* the first failure's operation */
    bool puts, flushed;
};

typedef struct op {
    k3_ucx_xfer *x;
    size_t len;
    char what[200];
} op;

#define DESC_MAGIC 0x5255334bu /* "K3UR" */
#define HS_MAGIC 0x5855334bu   /* "K3UX" */
#define HS_VERSION 1u
#define MAX_ADDR (1u << 16)
#define MAX_DESC (1u << 16)
#define MAX_REGIONS 4096

typedef struct desc_hdr {
    uint32_t magic, version;
    uint64_t base, len;
    uint32_t rkey_len, pad;
} desc_hdr;

static k3_status ucs_err(k3_error *err, ucs_status_t s, const char *fmt, const char *a, const char *b) {
    char m[512];
    snprintf(m, sizeof m, fmt, a ? a : "", b ? b : "");
    return k3_err(err, K3_ERR_IO, "ucx: %s: %s", m, ucs_status_string(s));
}

bool k3_ucx_available(void) { return true; }

k3_status k3_ucx_open(k3_ucx **out, const k3_ucx_options *opt, k3_error *err) {
    *out = NULL;
    k3_ucx *u = calloc(1, sizeof *u);
    if (!u) return k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
    snprintf(u->name, sizeof u->name, "%s", opt && opt->name ? opt->name : "k3");
    u->peer_errors = !(opt && opt->no_peer_errors);
    snprintf(u->tls, sizeof u->tls, "%s", opt && opt->tls ? opt->tls : "(UCX_TLS or UCX's default)");
    ucp_config_t *cfg = NULL;
    ucs_status_t s = ucp_config_read(NULL, NULL, &cfg);
    if (s != UCS_OK) {
        free(u);
        return ucs_err(err, s, "reading UCX's configuration%s%s", NULL, NULL);
    }
    if (opt && opt->tls) s = ucp_config_modify(cfg, "TLS", opt->tls);
    if (s != UCS_OK) {
        ucp_config_release(cfg);
        free(u);
        return ucs_err(err, s, "the transports '%s'%s", opt->tls, NULL);
    }
    /* workers of several threads may share the context (k3_ucx_worker_new) */
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                      .features = UCP_FEATURE_RMA,
                      .mt_workers_shared = 1,
                      .name = u->name};
    s = ucp_init(&p, cfg, &u->ctx);
    ucp_config_release(cfg);
    if (s != UCS_OK) {
        free(u);
        return ucs_err(err, s, "ucp_init (transports %s)%s", u->tls, NULL);
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
    s = ucp_worker_create(u->ctx, &wp, &u->w);
    if (s != UCS_OK) {
        ucp_cleanup(u->ctx);
        free(u);
        return ucs_err(err, s, "ucp_worker_create (transports %s)%s", u->tls, NULL);
    }
    *out = u;
    return K3_OK;
}

k3_status k3_ucx_worker_new(k3_ucx *parent, const char *name, k3_ucx **out, k3_error *err) {
    *out = NULL;
    k3_ucx *u = calloc(1, sizeof *u);
    if (!u) return k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
    *u = *parent;
    u->child = true;
    if (name) snprintf(u->name, sizeof u->name, "%s", name);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
    const ucs_status_t s = ucp_worker_create(u->ctx, &wp, &u->w);
    if (s != UCS_OK) {
        free(u);
        return ucs_err(err, s, "ucp_worker_create (transports %s)%s", parent->tls, NULL);
    }
    *out = u;
    return K3_OK;
}

void k3_ucx_close(k3_ucx *u) {
    if (!u) return;
    if (u->flush) ucp_request_free(u->flush);
    ucp_worker_destroy(u->w);
    if (!u->child) ucp_cleanup(u->ctx);
    free(u);
}

const char *k3_ucx_tls(const k3_ucx *u) { return u->tls; }

unsigned k3_ucx_progress(k3_ucx *u) { return ucp_worker_progress(u->w); }

int k3_ucx_quiet(k3_ucx *u) {
    if (!u->flush) {
        const ucp_request_param_t p = {0};
        void *r = ucp_worker_flush_nbx(u->w, &p);
        if (r == NULL || UCS_PTR_IS_ERR(r)) return 1;
        u->flush = r;
    }
    for (int i = 0; i < 64 && ucp_worker_progress(u->w); i++) {}
    if (ucp_request_check_status(u->flush) == UCS_INPROGRESS) return 0;
    ucp_request_free(u->flush);
    u->flush = NULL;
    return 1;
}

/* One idle round of a wait: yield for the first rounds, then sleep a little. */
static void idle(long spins) {
    if (spins < 200) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, spins < 2000 ? 20000 : 200000};
    nanosleep(&ts, NULL);
}

void k3_ucx_serve(k3_ucx *u, double seconds, const volatile bool *stop) {
    const double t0 = k3_now();
    long spins = 0;
    while (!(stop && *stop) && k3_now() - t0 < seconds) {
        if (ucp_worker_progress(u->w)) spins = 0;
        else idle(spins++);
    }
}

int k3_ucx_serve_until_readable(k3_ucx *u, int fd, double seconds, const volatile bool *stop) {
    const double t0 = k3_now();
    long spins = 0;
    for (unsigned busy = 0;; busy++) {
        /* while the worker has work, the socket and the clock are looked at
         * every 64 rounds (a round moves a fragment of a few KiB) */
        if (spins > 0 || busy % 64 == 0) {
            if ((stop && *stop) || k3_now() - t0 >= seconds) return 0;
            struct pollfd p = {.fd = fd, .events = POLLIN};
            if (poll(&p, 1, 0) > 0) return 1;
        }
        if (ucp_worker_progress(u->w)) spins = 0;
        else idle(spins++);
    }
}

/* ---- registered memory ------------------------------------------------------------------------- */

k3_status k3_ucx_mem_register(k3_ucx *u, void *base, size_t len, k3_ucx_mem **out, k3_error *err) {
    return k3_ucx_mem_register_access(u, base, len, K3_UCX_REMOTE_RW, out, err);
}

k3_status k3_ucx_mem_register_access(k3_ucx *u, void *base, size_t len, int access, k3_ucx_mem **out, k3_error *err) {
    *out = NULL;
    if (!base || !len) return k3_err(err, K3_ERR_ARG, "ucx: registering an empty region");
    k3_ucx_mem *m = calloc(1, sizeof *m);
    if (!m) return k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
    unsigned prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE;
    if (access & K3_UCX_REMOTE_READ) prot |= UCP_MEM_MAP_PROT_REMOTE_READ;
    if ((access & K3_UCX_REMOTE_RW) == K3_UCX_REMOTE_RW) prot |= UCP_MEM_MAP_PROT_REMOTE_WRITE;
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                   UCP_MEM_MAP_PARAM_FIELD_PROT,
                               .address = base,
                               .length = len,
                               .prot = prot};
    const ucs_status_t s = ucp_mem_map(u->ctx, &mp, &m->h);
    if (s != UCS_OK) {
        free(m);
        char what[96];
        snprintf(what, sizeof what, "registering %zu bytes at %p", len, base);
        return ucs_err(err, s, "%s%s", what, NULL);
    }
    m->u = u;
    m->base = base;
    m->len = len;
    *out = m;
    return K3_OK;
}

void k3_ucx_mem_free(k3_ucx_mem *m) {
    if (!m) return;
    ucp_mem_unmap(m->u->ctx, m->h);
    free(m);
}

k3_status k3_ucx_mem_pack(k3_ucx_mem *m, void **desc, size_t *len, k3_error *err) {
    *desc = NULL;
    *len = 0;
    void *rk = NULL;
    size_t rkl = 0;
    const ucs_status_t s = ucp_rkey_pack(m->u->ctx, m->h, &rk, &rkl);
    if (s != UCS_OK) return ucs_err(err, s, "packing a remote key%s%s", NULL, NULL);
    if (rkl > MAX_DESC - sizeof(desc_hdr)) {
        ucp_rkey_buffer_release(rk);
        return k3_err(err, K3_ERR_RANGE, "ucx: a remote key of %zu bytes is over the descriptor's limit", rkl);
    }
    char *d = malloc(sizeof(desc_hdr) + rkl);
    if (!d) {
        ucp_rkey_buffer_release(rk);
        return k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
    }
    const desc_hdr h = {DESC_MAGIC, HS_VERSION, (uint64_t)(uintptr_t)m->base, (uint64_t)m->len, (uint32_t)rkl, 0};
    memcpy(d, &h, sizeof h);
    memcpy(d + sizeof h, rk, rkl);
    ucp_rkey_buffer_release(rk);
    *desc = d;
    *len = sizeof h + rkl;
    return K3_OK;
}

/* ---- endpoints ----------------------------------------------------------------------------------- */

static void on_ep_error(void *arg, ucp_ep_h h, ucs_status_t status) {
    k3_ucx_ep *ep = arg;
    if (ep->failed == UCS_OK) ep->failed = status;
}

k3_status k3_ucx_address(k3_ucx *u, void **addr, size_t *len, k3_error *err) {
    *addr = NULL;
    *len = 0;
    ucp_address_t *a = NULL;
    size_t n = 0;
    const ucs_status_t s = ucp_worker_get_address(u->w, &a, &n);
    if (s != UCS_OK) return ucs_err(err, s, "the worker's address%s%s", NULL, NULL);
    *addr = malloc(n);
    if (*addr) memcpy(*addr, a, n);
    ucp_worker_release_address(u->w, a);
    if (!*addr) return k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
    *len = n;
    return K3_OK;
}

k3_status k3_ucx_connect(k3_ucx *u, const void *addr, size_t len, const char *peer, k3_ucx_ep **out, k3_error *err) {
    *out = NULL;
    if (!addr || !len || len > MAX_ADDR)
        return k3_err(err, K3_ERR_FORMAT, "ucx: %s sent a worker address of %zu bytes", peer ? peer : "the peer", len);
    k3_ucx_ep *ep = calloc(1, sizeof *ep);
    if (!ep) return k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
    ep->u = u;
    snprintf(ep->peer, sizeof ep->peer, "%s", peer ? peer : "the peer");
    ucp_ep_params_t p = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                             UCP_EP_PARAM_FIELD_ERR_HANDLER,
                         .address = addr,
                         .err_mode = u->peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE,
                         .err_handler = {on_ep_error, ep}};
    const ucs_status_t s = ucp_ep_create(u->w, &p, &ep->ep);
    if (s != UCS_OK) {
        free(ep);
        return k3_err(err, K3_ERR_IO, "ucx: an endpoint to %s (transports %s%s): %s", peer ? peer : "the peer", u->tls,
                      u->peer_errors ? ", with peer failure detection, which shared memory lacks" : "",
                      ucs_status_string(s));
    }
    *out = ep;
    return K3_OK;
}

k3_status k3_ucx_ep_failed(const k3_ucx_ep *ep, k3_error *err) {
    if (ep->failed != UCS_OK) return ucs_err(err, ep->failed, "the endpoint to %s failed%s", ep->peer, NULL);
    if (!ep->ep) return k3_err(err, K3_ERR_IO, "ucx: the endpoint to %s is closed", ep->peer);
    return K3_OK;
}

/* Progresses until the request completes or the deadline; 1 when it completed. */
static int wait_request(k3_ucx *u, void *req, double timeout_s) {
    if (req == NULL || UCS_PTR_IS_ERR(req)) return 1;
    const double t0 = k3_now();
    long spins = 0;
    while (ucp_request_check_status(req) == UCS_INPROGRESS) {
        if (k3_now() - t0 > timeout_s) return 0;
        if (ucp_worker_progress(u->w)) spins = 0;
        else idle(spins++);
    }
    ucp_request_free(req);
    return 1;
}

/* Closes by force: local work only, bounded all the same. */
static void ep_force_close(k3_ucx_ep *ep) {
    if (!ep->ep) return;
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
    void *req = ucp_ep_close_nbx(ep->ep, &p);
    ep->ep = NULL;
    if (!wait_request(ep->u, req, 5.0)) ucp_request_free(req);
}

void k3_ucx_ep_close(k3_ucx_ep *ep, double timeout_s) {
    if (!ep) return;
    /* what was posted reaches the peer (a flush, within the deadline); then the
     * endpoint goes without waiting for the peer's word, which a lost or busy
     * peer would never send */
    if (ep->ep && ep->failed == UCS_OK) {
        ucp_request_param_t p = {.op_attr_mask = 0};
        void *req = ucp_ep_flush_nbx(ep->ep, &p);
        if (!wait_request(ep->u, req, timeout_s)) {
            ucp_request_cancel(ep->u->w, req);
            ucp_request_free(req); /* released by UCX when it ends */
        }
    }
    ep_force_close(ep);
    free(ep);
}

k3_status k3_ucx_region_unpack(k3_ucx_ep *ep, const void *desc, size_t len, k3_ucx_region **out, k3_error *err) {
    *out = NULL;
    desc_hdr h;
    if (len < sizeof h)
        return k3_err(err, K3_ERR_FORMAT, "ucx: a region descriptor of %zu bytes from %s", len, ep->peer);
    memcpy(&h, desc, sizeof h);
    if (h.magic != DESC_MAGIC || h.version != HS_VERSION)
        return k3_err(err, K3_ERR_FORMAT, "ucx: %s sent a region descriptor that is not one (magic %08x, version %u)",
                      ep->peer, h.magic, h.version);
    if (h.rkey_len != len - sizeof h || !h.len || h.base + h.len < h.base)
        return k3_err(err, K3_ERR_FORMAT,
                      "ucx: %s sent a malformed region descriptor (key %u of %zu bytes, region %llu bytes)", ep->peer,
                      h.rkey_len, len - sizeof h, (unsigned long long)h.len);
    if (!ep->ep) return k3_err(err, K3_ERR_IO, "ucx: the endpoint to %s is closed", ep->peer);
    k3_ucx_region *r = calloc(1, sizeof *r);
    if (!r) return k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
    const ucs_status_t s = ucp_ep_rkey_unpack(ep->ep, (const char *)desc + sizeof h, &r->rkey);
    if (s != UCS_OK) {
        free(r);
        return ucs_err(err, s, "unpacking the remote key %s sent%s", ep->peer, NULL);
    }
    r->ep = ep;
    r->base = h.base;
    r->len = h.len;
    *out = r;
    return K3_OK;
}

uint64_t k3_ucx_region_size(const k3_ucx_region *r) { return r->len; }

void k3_ucx_region_free(k3_ucx_region *r) {
    if (!r) return;
    ucp_rkey_destroy(r->rkey);
    free(r);
}

/* ---- the handshake --------------------------------------------------------------------------------- */

typedef struct hs_hdr {
    uint32_t magic, version, addr_len, n_regions;
} hs_hdr;

static k3_status send_blob(const k3_ucx_chan *ch, const void *p, uint32_t n, k3_error *err) {
    if (ch->send(ch->ctx, &n, sizeof n, err)) return K3_ERR_IO;
    return n ? ch->send(ch->ctx, p, n, err) : K3_OK;
}

k3_status k3_ucx_handshake(k3_ucx *u, const k3_ucx_chan *ch, const char *peer, k3_ucx_mem *const *mine, int n_mine,
                           k3_ucx_ep **ep, k3_ucx_region **theirs, int max_theirs, int *n_theirs, k3_error *err) {
    *ep = NULL;
    *n_theirs = 0;
    if (n_mine < 0 || n_mine > MAX_REGIONS) return k3_err(err, K3_ERR_ARG, "ucx: %d regions to offer", n_mine);
    void *addr = NULL;
    size_t alen = 0;
    if (k3_ucx_address(u, &addr, &alen, err)) return K3_ERR_IO;
    /* mine: the header, the address, each region's descriptor */
    const hs_hdr h = {HS_MAGIC, HS_VERSION, (uint32_t)alen, (uint32_t)n_mine};
    k3_status s = ch->send(ch->ctx, &h, sizeof h, err);
    if (!s) s = ch->send(ch->ctx, addr, alen, err);
    free(addr);
    for (int i = 0; !s && i < n_mine; i++) {
        void *d = NULL;
        size_t dl = 0;
        s = k3_ucx_mem_pack(mine[i], &d, &dl, err);
        if (!s) s = send_blob(ch, d, (uint32_t)dl, err);
        free(d);
    }
    if (s) return s;
    /* theirs */
    hs_hdr ph;
    if (ch->recv(ch->ctx, &ph, sizeof ph, err)) return K3_ERR_IO;
    if (ph.magic != HS_MAGIC || ph.version != HS_VERSION)
        return k3_err(err, K3_ERR_FORMAT, "ucx: %s's handshake is not one (magic %08x, version %u)", peer, ph.magic,
                      ph.version);
    if (!ph.addr_len || ph.addr_len > MAX_ADDR || ph.n_regions > MAX_REGIONS)
        return k3_err(err, K3_ERR_FORMAT, "ucx: %s's handshake names a %u-byte address and %u regions", peer,
                      ph.addr_len, ph.n_regions);
    if ((int)ph.n_regions > max_theirs)
        return k3_err(err, K3_ERR_RANGE, "ucx: %s offers %u regions, %d expected at most", peer, ph.n_regions,
                      max_theirs);
    void *pa = malloc(ph.addr_len);
    if (!pa) return k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
    s = ch->recv(ch->ctx, pa, ph.addr_len, err);
    if (!s) s = k3_ucx_connect(u, pa, ph.addr_len, peer, ep, err);
    free(pa);
    if (s) return s;
    for (uint32_t i = 0; i < ph.n_regions; i++) {
        uint32_t dl = 0;
        s = ch->recv(ch->ctx, &dl, sizeof dl, err);
        if (!s && (dl < sizeof(desc_hdr) || dl > MAX_DESC))
            s = k3_err(err, K3_ERR_FORMAT, "ucx: %s's region %u has a descriptor of %u bytes", peer, i, dl);
        void *d = s ? NULL : malloc(dl);
        if (!s && !d) s = k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
        if (!s) s = ch->recv(ch->ctx, d, dl, err);
        if (!s) s = k3_ucx_region_unpack(*ep, d, dl, &theirs[i], err);
        free(d);
        if (s) break;
        *n_theirs = (int)i + 1;
    }
    if (s) {
        for (int i = 0; i < *n_theirs; i++) k3_ucx_region_free(theirs[i]);
        *n_theirs = 0;
        k3_ucx_ep_close(*ep, 0);
        *ep = NULL;
    }
    return s;
}

/* ---- one-sided transfers --------------------------------------------------------------------------- */

k3_status k3_ucx_xfer_begin(k3_ucx_ep *ep, k3_ucx_xfer **out, k3_error *err) {
    *out = NULL;
    if (k3_ucx_ep_failed(ep, err)) return K3_ERR_IO;
    k3_ucx_xfer *x = calloc(1, sizeof *x);
    if (!x) return k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
    x->ep = ep;
    *out = x;
    return K3_OK;
}

static void op_done(k3_ucx_xfer *x, ucs_status_t s, size_t len, const char *what) {
    x->done++;
    if (s == UCS_OK) x->bytes_done += len;
    else if (x->status == UCS_OK) {
        x->status = s;
        snprintf(x->what, sizeof x->what, "%s", what);
    }
}

static void on_op(void *req, ucs_status_t s, void *user) {
    op *o = user;
    op_done(o->x, s, o->len, o->what);
    free(o);
    ucp_request_free(req);
}

static k3_status post(k3_ucx_xfer *x, bool put, void *local, k3_ucx_mem *lmem, size_t len, const k3_ucx_region *r,
                      uint64_t offset, k3_error *err) {
    k3_ucx_ep *ep = x->ep;
    const char *verb = put ? "put" : "get";
    if (k3_ucx_ep_failed(ep, err)) return K3_ERR_IO;
    if (r->ep != ep)
        return k3_err(err, K3_ERR_ARG, "ucx: a %s on the endpoint to %s names a region of another endpoint", verb,
                      ep->peer);
    if (!len || offset > r->len || len > r->len - offset)
        return k3_err(err, K3_ERR_RANGE, "ucx: a %s of %zu bytes at offset %llu is outside %s's region of %llu bytes",
                      verb, len, (unsigned long long)offset, ep->peer, (unsigned long long)r->len);
    if (lmem &&
        ((char *)local < (char *)lmem->base || len > lmem->len ||
         (size_t)((char *)local - (char *)lmem->base) > lmem->len - len))
        return k3_err(err, K3_ERR_RANGE, "ucx: a %s of %zu bytes: the local buffer is outside its registered region",
                      verb, len);
    op *o = malloc(sizeof *o);
    if (!o) return k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
    o->x = x;
    o->len = len;
    snprintf(o->what, sizeof o->what, "%s of %zu bytes at offset %llu of %s's region", verb, len,
             (unsigned long long)offset, ep->peer);
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                             .cb.send = on_op,
                             .user_data = o};
    if (lmem) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        p.memh = lmem->h;
    }
    void *req = put ? ucp_put_nbx(ep->ep, local, len, r->base + offset, r->rkey, &p)
                    : ucp_get_nbx(ep->ep, local, len, r->base + offset, r->rkey, &p);
    x->posted++;
    x->bytes += len;
    if (req == NULL) { /* done in place: no callback */
        op_done(x, UCS_OK, len, o->what);
        free(o);
    } else if (UCS_PTR_IS_ERR(req)) {
        op_done(x, UCS_PTR_STATUS(req), len, o->what);
        free(o);
        return ucs_err(err, UCS_PTR_STATUS(req), "%s%s", x->what, NULL);
    }
    if (put) {
        x->puts = true;
        x->flushed = false;
    }
    return K3_OK;
}

k3_status k3_ucx_get(k3_ucx_xfer *x, void *local, k3_ucx_mem *lmem, size_t len, const k3_ucx_region *r, uint64_t offset,
                     k3_error *err) {
    return post(x, false, local, lmem, len, r, offset, err);
}

k3_status k3_ucx_put(k3_ucx_xfer *x, const void *local, k3_ucx_mem *lmem, size_t len, const k3_ucx_region *r,
                     uint64_t offset, k3_error *err) {
    return post(x, true, (void *)local, lmem, len, r, offset, err);
}

static k3_status xfer_status(k3_ucx_xfer *x, k3_error *err) {
    if (x->status != UCS_OK) return ucs_err(err, x->status, "%s%s", x->what, NULL);
    if (x->ep->failed != UCS_OK && x->done < x->posted)
        return ucs_err(err, x->ep->failed, "the endpoint to %s failed%s", x->ep->peer, NULL);
    return K3_OK;
}

/* Puts are complete at the peer after a flush of the endpoint: posted once
 * every put has completed locally, counted as one more operation. */
static k3_status flush_if_needed(k3_ucx_xfer *x, k3_error *err) {
    if (!x->puts || x->flushed || x->done < x->posted) return K3_OK;
    x->flushed = true;
    op *o = malloc(sizeof *o);
    if (!o) return k3_err(err, K3_ERR_NOMEM, "ucx: out of memory");
    o->x = x;
    o->len = 0;
    snprintf(o->what, sizeof o->what, "the flush of the puts to %s", x->ep->peer);
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                             .cb.send = on_op,
                             .user_data = o};
    void *req = ucp_ep_flush_nbx(x->ep->ep, &p);
    x->posted++;
    if (req == NULL || UCS_PTR_IS_ERR(req)) {
        op_done(x, req ? UCS_PTR_STATUS(req) : UCS_OK, 0, o->what);
        free(o);
    }
    return xfer_status(x, err);
}

k3_status k3_ucx_xfer_test(k3_ucx_xfer *x, int *done, k3_error *err) {
    *done = 0;
    ucp_worker_progress(x->ep->u->w);
    if (xfer_status(x, err)) return K3_ERR_IO;
    if (x->ep->ep && flush_if_needed(x, err)) return K3_ERR_IO;
    *done = x->done == x->posted && (!x->puts || x->flushed);
    return K3_OK;
}

k3_status k3_ucx_xfer_wait(k3_ucx_xfer *x, double timeout_s, k3_error *err) {
    const double t0 = k3_now();
    long spins = 0;
    for (;;) {
        if (xfer_status(x, err)) return K3_ERR_IO;
        if (x->ep->ep && flush_if_needed(x, err)) return K3_ERR_IO;
        if (x->done == x->posted && (!x->puts || x->flushed)) return K3_OK;
        if (!x->ep->ep) return k3_err(err, K3_ERR_IO, "ucx: the endpoint to %s is closed", x->ep->peer);
        if (k3_now() - t0 > timeout_s)
            return k3_err(err, K3_ERR_IO,
                          "ucx: %llu of %llu operations to %s (%llu of %llu bytes) still outstanding after %.1f s",
                          (unsigned long long)(x->posted - x->done), (unsigned long long)x->posted, x->ep->peer,
                          (unsigned long long)(x->bytes - x->bytes_done), (unsigned long long)x->bytes, timeout_s);
        if (ucp_worker_progress(x->ep->u->w)) spins = 0;
        else idle(spins++);
    }
}

void k3_ucx_xfer_cancel(k3_ucx_xfer *x) {
    if (x->done == x->posted) return;
    ep_force_close(x->ep);
    /* the closed endpoint's operations end as cancelled on the next rounds */
    for (int i = 0; i < 1000000 && x->done < x->posted; i++) ucp_worker_progress(x->ep->u->w);
}

void k3_ucx_xfer_free(k3_ucx_xfer *x) {
    if (!x) return;
    k3_ucx_xfer_cancel(x);
    free(x);
}

uint64_t k3_ucx_xfer_bytes(const k3_ucx_xfer *x) { return x->bytes_done; }

#endif
