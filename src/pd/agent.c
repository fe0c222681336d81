/*
 * agent.c -- the transfer agent (k3_pd of k3.h, pd.h): the prefill side's
 * listener, which streams holds to the decode instances that pull them, and
 * the decode side's pullers, which the engine's pull hook feeds.
 *
 * Holds are the engine's (k3_engine_hold_*, named by the engine request's
 * id); outside this file a hold is named by a token of 128 random bits,
 * bound to the prompt's hash: the table here maps one to the other. A pull
 * or a release names the token and the hash; anything else is refused
 * without touching a hold.
 *
 * Prefill side: one thread accepts; each connection gets a thread that runs
 * the handshake (auth.h: a peer without the deployment's secret is closed
 * unanswered), reads one request (wire.h), and finds its hold. PULL: the
 * identity is compared (a mismatch is an ERROR unit that names nothing of
 * either side), then for every MLA/DSA layer in order the hold's positions
 * [from, to) in runs of at most max_unit bytes (k3_engine_hold_read:
 * straight from the cache, or gathered from the DCP ranks), each run tagged
 * and sent as it is read, so a prompt's cache is never copied whole; then
 * the KDA state in pieces, then END. A hold that was pulled is released when
 * the connection ends, whatever happened: a decode instance that died
 * mid-stream leaves nothing behind. RELEASE: the hold goes.
 *
 * Decode side: the hook queues START / ABORT (and CANCEL, which shuts the
 * pull's socket so a blocked read returns); worker threads connect, run the
 * handshake, send PULL, check every header (its MAC, the layer, the next
 * position of that layer, the size) and every payload's MAC, and write each
 * unit into the request's blocks (k3_engine_pull_write) as it arrives, then
 * k3_engine_pull_done. kv_transfer_params that name a peer are taken only
 * with the proxy's credential or for a peer of --prefill-peers.
 */
#include <errno.h>
#include <openssl/crypto.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/error.h"
#include "common/random.h"
#include "pd/auth.h"
#include "pd/pd.h"
#include "pd/wire.h"
#include "pd/xfer.h"

#define K3_PD_UNIT ((int64_t)1 << 20) /* payload bytes per unit */
#define K3_PD_MAX_FIRST_TOP 20
#define K3_PD_MAX_LAYERS 1024
#define K3_PD_MAX_ACTIVE 256
#define K3_PD_MAX_SERVING 64  /* prefill-side connections at once */
#define K3_PD_MAX_PEERS 64    /* --prefill-peers */
#define K3_PD_HANDSHAKE_S 5.0 /* a connection proves the secret within this, or is closed */

struct k3_pd_pull {
    int refs; /* under pd->mu */
    char host[256];
    int port;
    uint8_t token[K3_PD_TOKEN_BYTES];
    uint8_t hash[K3_PD_HASH_BYTES];
    int64_t n_tokens;
    k3_logprob top[K3_PD_MAX_FIRST_TOP];
    k3_pd_pull_stats st; /* under pd->mu */
    bool cancel;         /* under pd->mu */
    atomic_bool acancel; /* the same, for the UCX transport's waits */
    int fd;              /* under pd->mu: the socket while pulling, else -1 */
};

typedef struct job {
    k3_pull_info pi;
    struct job *next;
} job;

/* a histogram of the decode side's transfers */
#define PD_HIST 14
static const double pd_secs_le[PD_HIST] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
static const double pd_gbps_le[PD_HIST] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 16};

typedef struct hist {
    uint64_t count[PD_HIST + 1];
    double sum;
    uint64_t n;
} hist;

/* A hold as the outside names it: its token, the prompt it was made for,
 * and the engine's id for it. */
typedef struct hold_ref {
    uint8_t token[K3_PD_TOKEN_BYTES];
    uint8_t hash[K3_PD_HASH_BYTES];
    uint64_t hold;
    struct hold_ref *next;
} hold_ref;

typedef struct peer {
    char host[256];
    int port;
} peer;

struct k3_pd {
    k3_engine *e;
    k3_pd_ident id;
    uint64_t engine_id;
    k3_pd_keys keys;
    peer peers[K3_PD_MAX_PEERS];
    int n_peers;
    char host[256], adv[256];
    double timeout;
    int lfd, port;
    atomic_bool quit;
    pthread_t lthread;
    bool lstarted;
    k3_pd_fault fault; /* tests */
    /* --kv-transport ucx: the context and the registered cache (NULL: TCP) */
    k3_pd_ux *ux;
    char transport[640]; /* what the start log says */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_serving;                        /* prefill-side connection threads */
    int serve_fd[K3_PD_MAX_SERVING];      /* their sockets, to end them at stop */
    double serve_t0[K3_PD_MAX_SERVING];   /* when each came; 0 once it proved the secret */
    hold_ref *holds;                      /* prefill side: the holds' tokens */
    job *head, *tail;                     /* decode side: the hook's queue */
    k3_pd_pull *active[K3_PD_MAX_ACTIVE]; /* the pulls with a socket, to end them at stop */
    pthread_t *workers;
    int n_workers;
    /* counters, under mu */
    int64_t sent_bytes, sent_units, sent_ok, sent_failed;
    int64_t recv_bytes, recv_blocks, recv_states, recv_ok, recv_failed, releases;
    int64_t refused_auth, refused_hold, refused_params; /* prefill: no secret; no such hold; decode: untrusted */
    int64_t ucx_sent, ucx_recv, ucx_fallback;           /* transfers over UCX; UCX asked, the stream served */
    double sent_seconds, recv_seconds;
    hist h_secs, h_gbps;
};

static void hist_add(hist *h, const double *le, double v) {
    int b = 0;
    while (b < PD_HIST && v > le[b]) b++;
    h->count[b]++;
    h->sum += v;
    h->n++;
}


/* ---- holds and their tokens --------------------------------------------------------------------- */

/* Drops the tokens whose hold the engine no longer has (read, released or
 * expired); under pd->mu. */
static void holds_prune_locked(k3_pd *pd) {
    for (hold_ref **h = &pd->holds; *h;) {
        if (k3_engine_hold_get(pd->e, (*h)->hold, &(k3_hold_info){0}, NULL, 0, NULL)) {
            hold_ref *gone = *h;
            *h = gone->next;
            free(gone);
        } else {
            h = &(*h)->next;
        }
    }
}

/* The engine's hold for token and hash, taken out of the table (a hold is
 * pulled or released once); false when there is none. Every entry is
 * compared, in constant time, whatever matches. */
static bool holds_take(k3_pd *pd, const uint8_t token[K3_PD_TOKEN_BYTES], const uint8_t hash[K3_PD_HASH_BYTES],
                       uint64_t *hold) {
    pthread_mutex_lock(&pd->mu);
    holds_prune_locked(pd);
    hold_ref **found = NULL;
    for (hold_ref **h = &pd->holds; *h; h = &(*h)->next) {
        const bool same =
            k3_pd_equal((*h)->token, token, K3_PD_TOKEN_BYTES) & k3_pd_equal((*h)->hash, hash, K3_PD_HASH_BYTES);
        if (same && !found) found = h;
    }
    hold_ref *r = found ? *found : NULL;
    if (r) {
        *found = r->next;
        *hold = r->hold;
    }
    pthread_mutex_unlock(&pd->mu);
    free(r);
    return r != NULL;
}

/* ---- the prefill side --------------------------------------------------------------------------- */

typedef struct conn {
    k3_pd *pd;
    int fd, slot;
} conn;

/* What the decode side is told of a refusal: that it was refused, nothing
 * of this instance or of its holds. */
#define REFUSED \
    "kv transfer refused by the prefill instance: no hold for this request's prompt, or another model, " \
    "quantization or cache format"

/* An ERROR unit as unit number u_no (its header message 2u, its payload 2u + 1). */
static k3_status send_error(int fd, k3_pd_session *ss, int64_t u_no, const char *msg) {
    const size_t n = strlen(msg);
    k3_pd_unit u = {.kind = K3_PD_ERROR, .layer = -1, .payload_bytes = n};
    k3_pd_tag(&ss->tx, 2 * (uint64_t)u_no + 1, msg, n, NULL, 0, u.payload_tag);
    K3_TRY(k3_pd_unit_send(fd, ss, 2 * (uint64_t)u_no, &u, NULL));
    return k3_pd_send(fd, msg, n, NULL, 0, "an error unit", NULL);
}

/* The test hook on the unit about to go: flips a payload byte, or stalls. */
static void fault_send(k3_pd *pd, uint8_t *payload, size_t n) {
    if (k3_pd_fault_send(&pd->fault) && n > 0) payload[n / 2] ^= 0x10;
}

/* Unit number u_no: its payload's tag (message 2u + 1), its header (message
 * 2u) on the stream, its payload by the bulk transport. */
static k3_status send_unit(k3_pd *pd, int fd, k3_pd_session *ss, k3_pd_bulk *bulk, int64_t u_no, k3_pd_unit *u,
                           uint8_t *payload, k3_error *err) {
    k3_pd_tag(&ss->tx, 2 * (uint64_t)u_no + 1, payload, (size_t)u->payload_bytes, NULL, 0, u->payload_tag);
    if (u->payload_bytes) fault_send(pd, payload, (size_t)u->payload_bytes);
    K3_TRY(k3_pd_unit_send(fd, ss, 2 * (uint64_t)u_no, u, err));
    return u->payload_bytes ? bulk->send(bulk, payload, (size_t)u->payload_bytes, err) : K3_OK;
}

/* Streams hold `hold`'s positions [r->from, r->to) and its state; *units
 * gets the units sent (an error unit after a failure is the next). */
static k3_status serve_pull(k3_pd *pd, int fd, k3_pd_session *ss, uint64_t hold, const k3_pd_req *r, int64_t *bytes,
                            int64_t *units_out, k3_error *err) {
    k3_engine *e = pd->e;
    k3_hold_info hi;
    K3_TRY(k3_engine_hold_get(e, hold, &hi, NULL, 0, err));
    if (r->from < 0 || r->from > r->to || r->to != hi.n_tokens)
        return k3_err(err, K3_ERR_ARG, "kv transfer: positions [%lld, %lld) asked of a hold of %lld tokens",
                      (long long)r->from, (long long)r->to, (long long)hi.n_tokens);
    int64_t max_unit = r->max_unit > 0 && r->max_unit < K3_PD_UNIT ? r->max_unit : K3_PD_UNIT;
    const int32_t n_layers = K3_PD_MAX_LAYERS; /* past the model's, kv_bytes is 0 */
    int64_t row_max = 0;
    for (int32_t L = 0; L < n_layers; L++)
        if (k3_engine_kv_bytes(e, L, 1) > row_max) row_max = k3_engine_kv_bytes(e, L, 1);
    if (row_max > max_unit) max_unit = row_max;
    uint8_t *buf = malloc((size_t)max_unit);
    if (!buf)
        return k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory for a unit of %lld bytes", (long long)max_unit);
    k3_pd_bulk bulk;
    k3_pd_bulk_tcp(&bulk, fd);
    k3_status st = K3_OK;
    int64_t units = 0;
    *units_out = 0;
    for (int32_t L = 0; !st && L < n_layers; L++) {
        const int64_t row = k3_engine_kv_bytes(e, L, 1);
        if (row == 0) continue;
        const int64_t per = max_unit / row;
        for (int64_t t = r->from; !st && t < r->to; t += per) {
            const int32_t n = (int32_t)(r->to - t < per ? r->to - t : per);
            const int64_t nb = row * n;
            st = k3_engine_hold_read(e, hold, L, t, n, buf, nb, err);
            if (st) break;
            k3_pd_unit u = {.kind = K3_PD_LAYER, .layer = L, .t0 = t, .n = n, .payload_bytes = (uint64_t)nb};
            st = send_unit(pd, fd, ss, &bulk, units++, &u, buf, err);
            *bytes += nb;
        }
    }
    for (int64_t off = 0; !st && off < hi.state_bytes; off += max_unit) {
        const int64_t nb = hi.state_bytes - off < max_unit ? hi.state_bytes - off : max_unit;
        st = k3_engine_hold_read_state(e, hold, off, buf, nb, err);
        if (st) break;
        k3_pd_unit u = {.kind = K3_PD_STATE, .layer = -1, .t0 = off, .n = nb, .payload_bytes = (uint64_t)nb};
        st = send_unit(pd, fd, ss, &bulk, units++, &u, buf, err);
        *bytes += nb;
    }
    free(buf);
    if (!st) {
        k3_pd_unit u = {.kind = K3_PD_END, .layer = -1, .t0 = units};
        st = send_unit(pd, fd, ss, &bulk, units, &u, NULL, err);
    }
    *units_out = units;
    return st;
}

static void *conn_main(void *arg) {
    conn *c = arg;
    k3_pd *pd = c->pd;
    const int fd = c->fd;
    /* a peer proves the secret within a few seconds, or its slot goes */
    k3_pd_socket_setup(fd, pd->timeout < K3_PD_HANDSHAKE_S ? pd->timeout : K3_PD_HANDSHAKE_S);
    k3_pd_session ss = {0};
    k3_pd_req r;
    k3_error err = {0};
    const double t0 = k3_now();
    int64_t bytes = 0;
    bool pulled = false, ok = false, authed = false, refused = false, ucx = false, fallback = false;
    if (!k3_pd_handshake_server(fd, &pd->keys, &ss, &err)) {
        authed = true;
        k3_pd_socket_setup(fd, pd->timeout);
        pthread_mutex_lock(&pd->mu);
        pd->serve_t0[c->slot] = 0;
        pthread_mutex_unlock(&pd->mu);
    }
    uint64_t hold = 0;
    if (authed && !k3_pd_req_recv(fd, &ss, &r, &err)) {
        /* the hold of this token and this prompt's hash, taken out of the
         * table: only the request it was made for names both */
        const bool pull = r.op == K3_PD_PULL || r.op == K3_PD_PULL_UCX;
        const bool found = (pull || r.op == K3_PD_RELEASE) && holds_take(pd, r.hold, r.prompt_hash, &hold);
        if (!found) {
            refused = true;
            send_error(fd, &ss, 0, REFUSED);
        } else if (pull && !k3_pd_ident_same(&r.id, &pd->id)) {
            /* its own request, on an instance of another model, quantization
             * or cache format: refused, and the hold goes (nobody else can
             * name it) */
            refused = true;
            send_error(fd, &ss, 0, REFUSED);
            k3_engine_hold_release(pd->e, hold);
        } else if (r.op == K3_PD_RELEASE) {
            k3_engine_hold_release(pd->e, hold);
            pthread_mutex_lock(&pd->mu);
            pd->releases++;
            pthread_mutex_unlock(&pd->mu);
        } else if (r.op == K3_PD_PULL_UCX && k3_pd_ux_can_serve(pd->ux)) {
            /* in place: the decode side gets the rows itself; the hold stays
             * pinned until it says it is done (or goes) */
            pulled = ucx = true;
            k3_pd_ux_stats us;
            bool landed = false;
            if (!k3_pd_ux_serve(pd->ux, fd, &ss, hold, &r, &pd->fault, pd->timeout, &us, &landed, &err)) ok = landed;
            bytes = us.bytes;
            k3_engine_hold_release(pd->e, hold);
        } else {
            /* the rows on the stream (a PULL_UCX too, where this instance
             * cannot offer its holds in place: no UCX, or DCP) */
            pulled = true;
            fallback = r.op == K3_PD_PULL_UCX;
            int64_t sent = 0;
            if (serve_pull(pd, fd, &ss, hold, &r, &bytes, &sent, &err)) {
                /* a peer that is gone does not read it */
                send_error(fd, &ss, sent, "kv transfer: the prefill instance could not read the hold");
            } else {
                ok = true;
            }
            /* read or not, nobody pulls a hold twice */
            k3_engine_hold_release(pd->e, hold);
        }
    }
    k3_pd_session_free(&ss);
    pthread_mutex_lock(&pd->mu);
    if (pulled) {
        if (ok) pd->sent_ok++;
        else pd->sent_failed++;
        pd->ucx_sent += ucx && ok; /* landed */
        pd->ucx_fallback += fallback;
        pd->sent_bytes += bytes;
        pd->sent_seconds += k3_now() - t0;
    }
    if (!authed) pd->refused_auth++;
    if (refused) pd->refused_hold++;
    pd->serve_fd[c->slot] = -1;
    pd->n_serving--;
    pthread_cond_broadcast(&pd->cv);
    pthread_mutex_unlock(&pd->mu);
    close(fd);
    free(c);
    return NULL;
}

static void *listen_main(void *arg) {
    k3_pd *pd = arg;
    while (!atomic_load(&pd->quit)) {
        struct pollfd p = {pd->lfd, POLLIN, 0};
        if (poll(&p, 1, 200) != 1) continue;
        const int fd = accept4(pd->lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        conn *c = malloc(sizeof *c);
        pthread_mutex_lock(&pd->mu);
        int slot = -1, oldest = -1;
        for (int i = 0; i < K3_PD_MAX_SERVING && slot < 0; i++)
            if (pd->serve_fd[i] < 0) slot = i;
            else if (pd->serve_t0[i] > 0 && (oldest < 0 || pd->serve_t0[i] < pd->serve_t0[oldest])) oldest = i;
        if (slot < 0 && oldest >= 0) {
            /* full: the connection that has waited longest without proving
             * the secret is cut (its thread frees the slot), so idle
             * connections cannot lock the pullers out */
            shutdown(pd->serve_fd[oldest], SHUT_RDWR);
            pd->serve_t0[oldest] = 0;
        }
        if (!c || slot < 0) { /* too many at once: the decode side sees the close and fails that request */
            pthread_mutex_unlock(&pd->mu);
            free(c);
            close(fd);
            continue;
        }
        pd->serve_fd[slot] = fd;
        pd->serve_t0[slot] = k3_now();
        pd->n_serving++;
        pthread_mutex_unlock(&pd->mu);
        *c = (conn){pd, fd, slot};
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &at, conn_main, c)) {
            pthread_mutex_lock(&pd->mu);
            pd->serve_fd[slot] = -1;
            pd->n_serving--;
            pthread_mutex_unlock(&pd->mu);
            close(fd);
            free(c);
        }
        pthread_attr_destroy(&at);
    }
    return NULL;
}

/* ---- the decode side ----------------------------------------------------------------------------- */

static void pull_unref_locked(k3_pd_pull *p) {
    if (--p->refs == 0) free(p);
}

void k3_pd_pull_unref(k3_pd *pd, k3_pd_pull *p) {
    if (!p) return;
    pthread_mutex_lock(&pd->mu);
    pull_unref_locked(p);
    pthread_mutex_unlock(&pd->mu);
}

/* A connection to host:port that has run the handshake, or -1. */
static int open_session(const k3_pd_keys *k, const char *host, int port, double timeout, k3_pd_session *ss,
                        k3_error *err) {
    const int fd = k3_pd_connect(host, port, timeout, err);
    if (fd < 0) return -1;
    if (k3_pd_handshake_client(fd, k, ss, err)) {
        close(fd);
        return -1;
    }
    return fd;
}

k3_status k3_pd_release_hold(const k3_pd_keys *k, const char *host, int port, const uint8_t token[K3_PD_TOKEN_BYTES],
                             const uint8_t hash[K3_PD_HASH_BYTES], double timeout_s, k3_error *err) {
    k3_pd_session ss;
    const int fd = open_session(k, host, port, timeout_s, &ss, err);
    if (fd < 0) return err ? err->status : K3_ERR_IO;
    k3_pd_req r = {.op = K3_PD_RELEASE};
    memcpy(r.hold, token, K3_PD_TOKEN_BYTES);
    memcpy(r.prompt_hash, hash, K3_PD_HASH_BYTES);
    k3_status st = k3_pd_req_send(fd, &ss, &r, err);
    /* the prefill side answers a refusal, or closes once released */
    k3_pd_unit u;
    if (!st && !k3_pd_unit_recv(fd, &ss, 0, &u, NULL) && u.kind == K3_PD_ERROR)
        st = k3_err(err, K3_ERR_PERM, "%s", REFUSED);
    k3_pd_session_free(&ss);
    close(fd);
    return st;
}

static void release_remote(k3_pd *pd, const k3_pd_pull *p) {
    /* a failure leaves the hold to the prefill instance's timeout */
    k3_pd_release_hold(&pd->keys, p->host, p->port, p->token, p->hash, pd->timeout < 5 ? pd->timeout : 5, NULL);
}

/* The test hook on the unit just received: stalls. */
static void fault_recv(k3_pd *pd) { k3_pd_fault_recv(&pd->fault); }

/* Pulls for request pi->id; the reason of a failure into err. */
static k3_status run_pull(k3_pd *pd, k3_pd_pull *p, const k3_pull_info *pi, int64_t *bytes, int64_t *units,
                          int64_t *states, bool *via_ucx, double *verify_s, k3_error *err) {
    k3_engine *e = pd->e;
    pthread_mutex_lock(&pd->mu);
    const bool cancelled = p->cancel;
    pthread_mutex_unlock(&pd->mu);
    if (cancelled) return k3_err(err, K3_ERR_ARG, "cancelled");
    k3_pd_session ss;
    const int fd = open_session(&pd->keys, p->host, p->port, pd->timeout, &ss, err);
    if (fd < 0) return err ? err->status : K3_ERR_IO;
    k3_pd_bulk bulk;
    k3_pd_bulk_tcp(&bulk, fd);
    pthread_mutex_lock(&pd->mu);
    p->fd = fd;
    const bool late_cancel = p->cancel || atomic_load(&pd->quit);
    for (int i = 0; i < K3_PD_MAX_ACTIVE; i++)
        if (!pd->active[i]) {
            pd->active[i] = p;
            break;
        }
    pthread_mutex_unlock(&pd->mu);
    k3_status st = late_cancel ? k3_err(err, K3_ERR_ARG, "cancelled") : K3_OK;
    /* with UCX, the prefill side may offer the hold in place (else it streams it) */
    k3_pd_req r = {.op = pd->ux ? K3_PD_PULL_UCX : K3_PD_PULL,
                   .id = pd->id,
                   .from = pi->n_local,
                   .to = pi->n_tokens,
                   .max_unit = K3_PD_UNIT};
    memcpy(r.hold, p->token, K3_PD_TOKEN_BYTES);
    memcpy(r.prompt_hash, p->hash, K3_PD_HASH_BYTES);
    if (!st) st = k3_pd_req_send(fd, &ss, &r, err);
    const int64_t sb = k3_engine_state_bytes(e);
    int64_t next[K3_PD_MAX_LAYERS], state_next = 0, n_units = 0;
    int32_t n_layers = 0;
    for (int32_t L = 0; L < K3_PD_MAX_LAYERS; L++) {
        next[L] = pi->n_local;
        if (k3_engine_kv_bytes(e, L, 1) > 0) n_layers = L + 1;
    }
    uint8_t *buf = NULL;
    size_t cap = 0;
    bool end = false;
    while (!st && !end) {
        k3_pd_unit u;
        st = k3_pd_unit_recv(fd, &ss, 2 * (uint64_t)n_units, &u, err);
        if (st) break;
        const bool offer = u.kind == K3_PD_UCX && n_units == 0 && pd->ux;
        if (u.payload_bytes > (offer ? (uint64_t)K3_PD_UCX_OFFER_MAX : (uint64_t)K3_PD_UNIT * 4 + 4096)) {
            st = k3_err(err, K3_ERR_FORMAT, "kv transfer: a unit of %llu bytes, more than asked for",
                        (unsigned long long)u.payload_bytes);
            break;
        }
        if (u.payload_bytes > cap) {
            uint8_t *nbuf = realloc(buf, (size_t)u.payload_bytes);
            if (!nbuf) {
                st = k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory for a unit");
                break;
            }
            buf = nbuf;
            cap = (size_t)u.payload_bytes;
        }
        if (u.payload_bytes) st = bulk.recv(&bulk, buf, (size_t)u.payload_bytes, err);
        if (st) break;
        if (!k3_pd_tag_ok(&ss.rx, 2 * (uint64_t)n_units + 1, buf, (size_t)u.payload_bytes, NULL, 0, u.payload_tag)) {
            st = k3_err(err, K3_ERR_FORMAT,
                        "kv transfer: unit %lld (kind %u, layer %d, positions %lld+%lld) is damaged: its MAC does "
                        "not match",
                        (long long)n_units, u.kind, u.layer, (long long)u.t0, (long long)u.n);
            break;
        }
        if (offer) { /* the rest over UCX, straight into the request's blocks */
            k3_pd_ux_stats us;
            st = k3_pd_ux_pull(pd->ux, fd, &ss, pi, buf, (size_t)u.payload_bytes, K3_PD_UNIT, &pd->fault, pd->timeout,
                               &p->acancel, &pd->quit, &us, err);
            *bytes = us.bytes;
            *states = us.states;
            *verify_s = us.verify_s;
            *via_ucx = true;
            n_units = us.units;
            end = true;
            break;
        }
        if (u.kind == K3_PD_ERROR) {
            char msg[400];
            const size_t n = u.payload_bytes < sizeof msg - 1 ? (size_t)u.payload_bytes : sizeof msg - 1;
            memcpy(msg, buf, n);
            msg[n] = 0;
            st = k3_err(err, K3_ERR_UNSUPPORTED, "%s", msg);
            break;
        }
        if (u.kind == K3_PD_LAYER) {
            const int64_t want = u.layer >= 0 && u.layer < n_layers ? k3_engine_kv_bytes(e, u.layer, u.n) : -1;
            if (want <= 0 || u.t0 != next[u.layer] || u.n < 1 || u.t0 + u.n > pi->n_tokens ||
                (uint64_t)want != u.payload_bytes) {
                st = k3_err(err, K3_ERR_FORMAT,
                            "kv transfer: an unexpected unit (layer %d, positions %lld+%lld, %llu bytes)", u.layer,
                            (long long)u.t0, (long long)u.n, (unsigned long long)u.payload_bytes);
                break;
            }
            st = k3_engine_pull_write(e, pi->id, u.layer, u.t0, (int32_t)u.n, buf, want, err);
            next[u.layer] += u.n;
        } else if (u.kind == K3_PD_STATE) {
            if (u.t0 != state_next || (uint64_t)u.n != u.payload_bytes || state_next + u.n > sb) {
                st = k3_err(err, K3_ERR_FORMAT, "kv transfer: an unexpected state piece (bytes %lld+%lld of %lld)",
                            (long long)u.t0, (long long)u.n, (long long)sb);
                break;
            }
            st = k3_engine_pull_state(e, pi->id, u.t0, buf, u.n, err);
            state_next += u.n;
            if (!st && state_next == sb) (*states)++;
        } else if (u.kind == K3_PD_END) {
            if (u.t0 != n_units) {
                st = k3_err(err, K3_ERR_FORMAT, "kv transfer: the end says %lld units, %lld came", (long long)u.t0,
                            (long long)n_units);
                break;
            }
            for (int32_t L = 0; !st && L < n_layers; L++)
                if (k3_engine_kv_bytes(e, L, 1) > 0 && next[L] != pi->n_tokens)
                    st = k3_err(err, K3_ERR_FORMAT, "kv transfer: layer %d ended at position %lld of %lld", L,
                                (long long)next[L], (long long)pi->n_tokens);
            if (!st && state_next != sb)
                st = k3_err(err, K3_ERR_FORMAT, "kv transfer: %lld of the KDA state's %lld bytes came",
                            (long long)state_next, (long long)sb);
            end = true;
        } else {
            st = k3_err(err, K3_ERR_FORMAT, "kv transfer: a unit of unknown kind %u", u.kind);
        }
        if (!st && u.kind != K3_PD_END) {
            n_units++;
            *bytes += (int64_t)u.payload_bytes;
            fault_recv(pd);
        }
    }
    free(buf);
    k3_pd_session_free(&ss);
    pthread_mutex_lock(&pd->mu);
    p->fd = -1;
    for (int i = 0; i < K3_PD_MAX_ACTIVE; i++)
        if (pd->active[i] == p) pd->active[i] = NULL;
    const bool was_cancelled = p->cancel;
    pthread_mutex_unlock(&pd->mu);
    close(fd);
    *units = n_units;
    if (st && was_cancelled) {
        k3_err_clear(err);
        return k3_err(err, K3_ERR_ARG, "cancelled");
    }
    return st;
}

static void do_job(k3_pd *pd, const job *j) {
    k3_pd_pull *p = j->pi.ctx;
    if (j->pi.op == K3_PULL_ABORT) {
        release_remote(pd, p);
        pthread_mutex_lock(&pd->mu);
        p->st.ended = true;
        pd->releases++;
        pull_unref_locked(p);
        pthread_mutex_unlock(&pd->mu);
        return;
    }
    k3_error err = {0};
    int64_t bytes = 0, units = 0, states = 0;
    bool via_ucx = false;
    double verify_s = 0;
    const double t0 = k3_now();
    const k3_status st = run_pull(pd, p, &j->pi, &bytes, &units, &states, &via_ucx, &verify_s, &err);
    const double dt = k3_now() - t0;
    /* blocks written: those past the ones the prefix cache held */
    const int64_t bs = pd->id.block_size > 0 ? pd->id.block_size : 1;
    const int64_t blocks = (j->pi.n_tokens + bs - 1) / bs - j->pi.n_local / bs;
    pthread_mutex_lock(&pd->mu);
    p->st.ended = true;
    p->st.ok = st == K3_OK;
    p->st.bytes = bytes;
    p->st.units = units;
    p->st.tokens = j->pi.n_tokens - j->pi.n_local;
    p->st.states = states;
    p->st.blocks = st ? 0 : blocks;
    p->st.seconds = dt;
    p->st.ucx = via_ucx;
    p->st.verify_s = verify_s;
    pd->ucx_recv += via_ucx && !st;
    if (st) {
        pd->recv_failed++;
    } else {
        pd->recv_ok++;
        pd->recv_blocks += blocks;
        pd->recv_states += states;
        hist_add(&pd->h_secs, pd_secs_le, dt);
        hist_add(&pd->h_gbps, pd_gbps_le, dt > 0 ? (double)bytes / dt / 1e9 : 0);
    }
    pd->recv_bytes += bytes;
    pd->recv_seconds += dt;
    pthread_mutex_unlock(&pd->mu);
    /* the figures are in place before the engine may finish the request
     * (its answer reads them) */
    k3_engine_pull_done(pd->e, j->pi.id, st == K3_OK, st ? err.msg : NULL);
    pthread_mutex_lock(&pd->mu);
    pull_unref_locked(p);
    pthread_mutex_unlock(&pd->mu);
}

static void *worker_main(void *arg) {
    k3_pd *pd = arg;
    for (;;) {
        pthread_mutex_lock(&pd->mu);
        while (!pd->head && !atomic_load(&pd->quit)) pthread_cond_wait(&pd->cv, &pd->mu);
        job *j = pd->head;
        if (j) {
            pd->head = j->next;
            if (!pd->head) pd->tail = NULL;
        }
        pthread_mutex_unlock(&pd->mu);
        if (!j) return NULL; /* quit with an empty queue */
        if (atomic_load(&pd->quit)) {
            /* stopping: fail what is queued (the engine still waits for it) */
            if (j->pi.op == K3_PULL_START) {
                k3_engine_pull_done(pd->e, j->pi.id, false, "the server is shutting down");
                k3_pd_pull_unref(pd, j->pi.ctx);
            } else {
                do_job(pd, j);
            }
        } else {
            do_job(pd, j);
        }
        free(j);
    }
}

/* The engine's pull hook (its stepping thread): queue, or cancel. */
static void on_pull(void *arg, const k3_pull_info *pi) {
    k3_pd *pd = arg;
    k3_pd_pull *p = pi->ctx;
    if (pi->op == K3_PULL_CANCEL) {
        pthread_mutex_lock(&pd->mu);
        p->cancel = true;
        atomic_store(&p->acancel, true);
        if (p->fd >= 0) shutdown(p->fd, SHUT_RDWR);
        pthread_mutex_unlock(&pd->mu);
        return;
    }
    job *j = calloc(1, sizeof *j);
    if (!j) { /* out of memory: the request fails; the hold times out on the other side */
        if (pi->op == K3_PULL_START) k3_engine_pull_done(pd->e, pi->id, false, "out of memory for a pull");
        k3_pd_pull_unref(pd, p);
        return;
    }
    j->pi = *pi;
    pthread_mutex_lock(&pd->mu);
    if (pd->tail) pd->tail->next = j;
    else pd->head = j;
    pd->tail = j;
    pthread_cond_signal(&pd->cv);
    pthread_mutex_unlock(&pd->mu);
}

/* ---- start / stop ------------------------------------------------------------------------------- */

static bool parse_fault(k3_pd *pd, const char *f) {
    if (!f || !*f) return true;
    long long u = 0, ms = 0;
    char tail = 0;
    if (sscanf(f, "flip:%lld%c", &u, &tail) == 1 && u >= 0) {
        pd->fault.kind = 'f';
        pd->fault.unit = u;
        return true;
    }
    if (!strcmp(f, "offer:forge") || !strcmp(f, "offer:replay")) {
        pd->fault.kind = f[6] == 'f' ? 'o' : 'r';
        pthread_mutex_init(&pd->fault.mu, NULL);
        return true;
    }
    if (sscanf(f, "stall:%lld:%lld%c", &u, &ms, &tail) == 2 && u >= 0 && ms >= 0 && ms <= 3600000) {
        pd->fault.kind = 's';
        pd->fault.unit = u;
        pd->fault.ms = ms;
        return true;
    }
    return false;
}

/* --prefill-peers: HOST:PORT[,HOST:PORT...] ([v6]:PORT too). */
static k3_status parse_peers(k3_pd *pd, const char *list, k3_error *err) {
    if (!list || !*list) return K3_OK;
    const char *p = list;
    while (*p) {
        const char *end = strchr(p, ',');
        const size_t len = end ? (size_t)(end - p) : strlen(p);
        char item[256];
        if (len == 0 || len >= sizeof item || pd->n_peers == K3_PD_MAX_PEERS)
            return k3_err(err, K3_ERR_ARG, "--prefill-peers: '%.*s' is not HOST:PORT (at most %d of them)",
                          (int)(len < 200 ? len : 200), p, K3_PD_MAX_PEERS);
        memcpy(item, p, len);
        item[len] = 0;
        char *colon = strrchr(item, ':');
        char *stop = NULL;
        const long port = colon ? strtol(colon + 1, &stop, 10) : 0;
        if (!colon || colon == item || !stop || *stop || port < 1 || port > 65535)
            return k3_err(err, K3_ERR_ARG, "--prefill-peers: '%s' is not HOST:PORT", item);
        *colon = 0;
        char *h = item;
        if (h[0] == '[' && colon[-1] == ']') {
            colon[-1] = 0;
            h++;
        }
        memcpy(pd->peers[pd->n_peers].host, h, strlen(h) + 1);
        pd->peers[pd->n_peers++].port = (int)port;
        p += len + (end ? 1 : 0);
    }
    return K3_OK;
}

k3_status k3_pd_start(k3_pd **out, const k3_pd_options *o, k3_error *err) {
    *out = NULL;
    if (!o || !o->engine) return k3_err(err, K3_ERR_ARG, "kv transfer: no engine");
    if (o->quant && strlen(o->quant) >= K3_PD_QUANT_LEN)
        return k3_err(err, K3_ERR_ARG, "kv transfer: quant mode '%s' is too long", o->quant);
    if (!(o->timeout_s >= 0 && o->timeout_s <= 86400) || o->max_pulls < 0 || o->max_pulls > 256)
        return k3_err(err, K3_ERR_ARG, "kv transfer: timeout_s must be in [0, 86400] and max_pulls in [0, 256]");
    k3_pd *pd = calloc(1, sizeof *pd);
    if (!pd) return k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory");
    pthread_mutex_init(&pd->mu, NULL);
    pthread_cond_init(&pd->cv, NULL);
    pd->e = o->engine;
    pd->lfd = -1;
    pd->port = -1;
    for (int i = 0; i < K3_PD_MAX_SERVING; i++) pd->serve_fd[i] = -1;
    pd->timeout = o->timeout_s > 0 ? o->timeout_s : 30.0;
    pd->id.model = o->model_id;
    if (o->quant && strcmp(o->quant, "none")) memcpy(pd->id.quant, o->quant, strlen(o->quant));
    pd->id.kv = (uint32_t)o->kv_cache;
    pd->id.block_size = o->block_size;
    snprintf(pd->host, sizeof pd->host, "%s", o->host ? o->host : "127.0.0.1");
    snprintf(pd->adv, sizeof pd->adv, "%s", o->advertise_host ? o->advertise_host : pd->host);
    if (k3_random_bytes(&pd->engine_id, sizeof pd->engine_id, err)) {
        k3_pd_stop(pd);
        return err ? err->status : K3_ERR_IO;
    }
    if (k3_pd_keys_derive(&pd->keys, o->secret, o->secret_len, err) || parse_peers(pd, o->prefill_peers, err)) {
        const k3_status st = err ? err->status : K3_ERR_ARG;
        k3_pd_stop(pd);
        return st;
    }
    if (!parse_fault(pd, o->fault)) {
        k3_pd_stop(pd);
        return k3_err(err, K3_ERR_ARG, "kv transfer: fault '%s' is not flip:U, stall:U:MS, offer:forge or offer:replay",
                      o->fault);
    }
    snprintf(pd->transport, sizeof pd->transport, "tcp");
    if (o->kv_transport && strcmp(o->kv_transport, "tcp") && strcmp(o->kv_transport, "ucx")) {
        k3_pd_stop(pd);
        return k3_err(err, K3_ERR_ARG, "kv transfer: --kv-transport '%s' is not tcp or ucx", o->kv_transport);
    }
    if (o->kv_transport && !strcmp(o->kv_transport, "ucx")) {
        /* TCP stays the fallback: where UCX is absent the stream moves the rows */
        k3_error ue = {0};
        if (k3_pd_ux_open(&pd->ux, o->engine, o->ucx_tls, o->port >= 0, &ue))
            snprintf(pd->transport, sizeof pd->transport, "tcp (--kv-transport ucx: %s)", ue.msg);
        else
            snprintf(pd->transport, sizeof pd->transport, "ucx (transports %s%s)", k3_pd_ux_tls(pd->ux),
                     o->port >= 0 && !k3_pd_ux_can_serve(pd->ux)
                         ? "; this instance's cache is spread over its DCP ranks: its holds go on the stream"
                         : "");
    }
    if (o->port >= 0) {
        pd->lfd = k3_pd_listen(pd->host, o->port, &pd->port, err);
        if (pd->lfd < 0 || pthread_create(&pd->lthread, NULL, listen_main, pd)) {
            k3_status st = pd->lfd < 0 ? err->status : k3_err(err, K3_ERR_NOMEM, "kv transfer: cannot start a thread");
            k3_pd_stop(pd);
            return st;
        }
        pd->lstarted = true;
    }
    const int nw = o->max_pulls ? o->max_pulls : 8;
    pd->workers = calloc((size_t)nw, sizeof(pthread_t));
    for (int i = 0; pd->workers && i < nw; i++) {
        if (pthread_create(&pd->workers[i], NULL, worker_main, pd)) break;
        pd->n_workers++;
    }
    if (pd->n_workers == 0) {
        k3_pd_stop(pd);
        return k3_err(err, K3_ERR_NOMEM, "kv transfer: cannot start the pull threads");
    }
    k3_engine_set_pull_hook(o->engine, on_pull, pd);
    *out = pd;
    return K3_OK;
}

void k3_pd_stop(k3_pd *pd) {
    if (!pd) return;
    atomic_store(&pd->quit, true);
    if (pd->lstarted) pthread_join(pd->lthread, NULL);
    if (pd->lfd >= 0) close(pd->lfd);
    pthread_mutex_lock(&pd->mu);
    pthread_cond_broadcast(&pd->cv);
    for (int i = 0; i < K3_PD_MAX_ACTIVE; i++)
        if (pd->active[i] && pd->active[i]->fd >= 0) shutdown(pd->active[i]->fd, SHUT_RDWR);
    pthread_mutex_unlock(&pd->mu);
    /* pulls in flight end at their next read; the queue is failed by the workers */
    for (int i = 0; i < pd->n_workers; i++) pthread_join(pd->workers[i], NULL);
    free(pd->workers);
    /* the prefill side's connections: ended, then waited for */
    pthread_mutex_lock(&pd->mu);
    for (int i = 0; i < K3_PD_MAX_SERVING; i++)
        if (pd->serve_fd[i] >= 0) shutdown(pd->serve_fd[i], SHUT_RDWR);
    while (pd->n_serving > 0) pthread_cond_wait(&pd->cv, &pd->mu);
    pthread_mutex_unlock(&pd->mu);
    k3_engine_set_pull_hook(pd->e, NULL, NULL);
    for (hold_ref *h = pd->holds, *nx; h; h = nx) {
        nx = h->next;
        free(h);
    }
    OPENSSL_cleanse(&pd->keys, sizeof pd->keys);
    k3_pd_ux_close(pd->ux); /* every pull's worker is gone with its thread */
    if (pd->fault.kind == 'o' || pd->fault.kind == 'r') {
        free(pd->fault.offer);
        pthread_mutex_destroy(&pd->fault.mu);
    }
    pthread_mutex_destroy(&pd->mu);
    pthread_cond_destroy(&pd->cv);
    free(pd);
}

int k3_pd_port(const k3_pd *pd) { return pd ? pd->port : -1; }

const char *k3_pd_transport(const k3_pd *pd) { return pd ? pd->transport : "none"; }

/* ---- kv_transfer_params ------------------------------------------------------------------------- */

static const char *kv_name(uint32_t kv) { return kv == K3_KV_C8 ? "c8" : "f32"; }

bool k3_pd_wants_remote_decode(json_t *p) {
    return json_is_object(p) && json_is_true(json_object_get(p, "do_remote_decode"));
}

bool k3_pd_wants_remote_prefill(json_t *p) {
    return json_is_object(p) && json_is_true(json_object_get(p, "do_remote_prefill"));
}

json_t *k3_pd_prefill_params(k3_pd *pd, uint64_t hold, const int32_t *prompt, int64_t n, int32_t first, float logprob,
                             const k3_logprob *top, int n_top, k3_error *err) {
    k3_hold_info hi;
    if (k3_engine_hold_get(pd->e, hold, &hi, NULL, 0, err)) return NULL;
    int32_t *blocks = malloc(sizeof(int32_t) * (size_t)(hi.n_blocks + 1));
    hold_ref *ref = calloc(1, sizeof *ref);
    if (!blocks || !ref || k3_random_bytes(ref->token, sizeof ref->token, err)) {
        free(blocks);
        free(ref);
        if (err && !err->status) k3_err(err, K3_ERR_NOMEM, "out of memory");
        return NULL;
    }
    if (k3_engine_hold_get(pd->e, hold, &hi, blocks, hi.n_blocks, err)) {
        free(blocks);
        free(ref);
        return NULL;
    }
    /* the hold is named by its token from now on, for this prompt only */
    k3_pd_prompt_hash(prompt, n, ref->hash);
    ref->hold = hold;
    json_t *ids = json_array();
    for (int32_t i = 0; i < hi.n_blocks; i++) json_array_append_new(ids, json_integer(blocks[i]));
    free(blocks);
    char eng[40], req[2 * K3_PD_TOKEN_BYTES + 1], model[20], ph[2 * K3_PD_HASH_BYTES + 1], q[K3_PD_QUANT_LEN + 1];
    snprintf(eng, sizeof eng, "k3-%016llx", (unsigned long long)pd->engine_id);
    k3_pd_hex(ref->token, K3_PD_TOKEN_BYTES, req);
    snprintf(model, sizeof model, "%016llx", (unsigned long long)pd->id.model);
    k3_pd_hex(ref->hash, K3_PD_HASH_BYTES, ph);
    memcpy(q, pd->id.quant, K3_PD_QUANT_LEN);
    q[K3_PD_QUANT_LEN] = 0;
    /* vLLM's NixlConnector names, then k3's own */
    json_t *o =
        json_pack("{s:b,s:b,s:s,s:s,s:s,s:i,s:o,s:i,s:I,s:i,s:s,s:s,s:s,s:i,s:I,s:s,s:f,s:f}", "do_remote_prefill", 1,
                  "do_remote_decode", 0, "remote_engine_id", eng, "remote_request_id", req, "remote_host", pd->adv,
                  "remote_port", pd->port, "remote_block_ids", ids, "tp_size", 1, "num_tokens", (json_int_t)n,
                  "first_token", first, "model_id", model, "quant", q[0] ? q : "none", "kv_cache", kv_name(pd->id.kv),
                  "block_size", pd->id.block_size, "kda_state_bytes", (json_int_t)hi.state_bytes, "prompt_hash", ph,
                  "prefill_queue_s", hi.queue_s, "prefill_s", hi.prefill_s);
    if (!o) {
        free(ref);
        k3_err(err, K3_ERR_NOMEM, "out of memory");
        return NULL;
    }
    if (isfinite(logprob)) json_object_set_new(o, "first_token_logprob", json_real(logprob));
    if (n_top > 0) {
        json_t *t = json_array();
        for (int i = 0; i < n_top; i++)
            if (top[i].id >= 0) json_array_append_new(t, json_pack("[i,f]", top[i].id, (double)top[i].logprob));
        json_object_set_new(o, "first_token_top_logprobs", t);
    }
    pthread_mutex_lock(&pd->mu);
    holds_prune_locked(pd);
    ref->next = pd->holds;
    pd->holds = ref;
    pthread_mutex_unlock(&pd->mu);
    return o;
}

static bool get_int(json_t *o, const char *k, long long lo, long long hi, long long *out, k3_error *err) {
    json_t *v = json_object_get(o, k);
    if (json_is_string(v)) { /* vLLM's request ids are strings */
        char *end = NULL;
        const long long x = strtoll(json_string_value(v), &end, 10);
        if (end && !*end && x >= lo && x <= hi) {
            *out = x;
            return true;
        }
    } else if (json_is_integer(v) && json_integer_value(v) >= lo && json_integer_value(v) <= hi) {
        *out = json_integer_value(v);
        return true;
    }
    return !k3_err(err, K3_ERR_ARG, "kv_transfer_params: \"%s\" must be an integer in [%lld, %lld]", k, lo, hi);
}

/* The fields that say whom to connect to and what to read, parsed; and
 * whether they may be used: with the proxy's credential over them, or for a
 * peer the operator listed. Nothing is connected to before this says yes. */
typedef struct named {
    const char *host, *rid, *hash;
    long long port, n_tokens;
    uint8_t token[K3_PD_TOKEN_BYTES], prompt_hash[K3_PD_HASH_BYTES];
} named;

static bool parse_named(k3_pd *pd, json_t *params, const char *credential, named *nm, k3_error *err) {
    json_t *host = json_object_get(params, "remote_host"), *rid = json_object_get(params, "remote_request_id"),
           *ph = json_object_get(params, "prompt_hash");
    if (!json_is_string(host) || json_string_length(host) == 0 || json_string_length(host) >= 256)
        return !k3_err(err, K3_ERR_ARG, "kv_transfer_params: \"remote_host\" must name the prefill instance");
    if (!get_int(params, "remote_port", 1, 65535, &nm->port, err) ||
        !get_int(params, "num_tokens", 1, INT64_MAX, &nm->n_tokens, err))
        return false;
    nm->host = json_string_value(host);
    nm->rid = json_is_string(rid) ? json_string_value(rid) : "";
    nm->hash = json_is_string(ph) ? json_string_value(ph) : "";
    bool trusted = false;
    if (credential && *credential) {
        char want[2 * K3_PD_KEY_BYTES + 1];
        k3_pd_credential(&pd->keys, nm->host, nm->port, nm->rid, nm->hash, nm->n_tokens, want);
        trusted = strlen(credential) == sizeof want - 1 && k3_pd_equal(credential, want, sizeof want - 1);
    }
    for (int i = 0; !trusted && i < pd->n_peers; i++)
        trusted = pd->peers[i].port == nm->port && !strcmp(pd->peers[i].host, nm->host);
    if (!trusted)
        return !k3_err(err, K3_ERR_PERM,
                       "kv_transfer_params: a prefill instance to pull from is taken only from the proxy (its "
                       "credential, %s) or from --prefill-peers; this request has neither",
                       K3_PD_CREDENTIAL_HEADER);
    if (!k3_pd_unhex(nm->rid, nm->token, K3_PD_TOKEN_BYTES))
        return !k3_err(err, K3_ERR_ARG,
                       "kv_transfer_params: \"remote_request_id\" must be the hold's token (%d hex "
                       "digits)",
                       2 * K3_PD_TOKEN_BYTES);
    if (!k3_pd_unhex(nm->hash, nm->prompt_hash, K3_PD_HASH_BYTES))
        return !k3_err(err, K3_ERR_ARG,
                       "kv_transfer_params: \"prompt_hash\" is required (%d hex digits: the prompt's "
                       "SHA-256)",
                       2 * K3_PD_HASH_BYTES);
    return true;
}

k3_pd_pull *k3_pd_pull_new(k3_pd *pd, json_t *params, const char *credential, const int32_t *prompt, int64_t n,
                           k3_remote_prefill *rp, k3_error *err) {
    named nm;
    long long first = 0;
    k3_error pe = {0};
    if (!parse_named(pd, params, credential, &nm, &pe) || !get_int(params, "first_token", 0, INT32_MAX, &first, &pe)) {
        if (pe.status == K3_ERR_PERM) {
            pthread_mutex_lock(&pd->mu);
            pd->refused_params++;
            pthread_mutex_unlock(&pd->mu);
        }
        if (err) *err = pe;
        return NULL;
    }
    if (nm.n_tokens != n) {
        k3_err(err, K3_ERR_ARG,
               "kv_transfer_params: the prefill instance computed %lld prompt tokens, this prompt has %lld: the two "
               "instances did not make the same prompt",
               nm.n_tokens, (long long)n);
        return NULL;
    }
    uint8_t mine[K3_PD_HASH_BYTES];
    k3_pd_prompt_hash(prompt, n, mine);
    if (!k3_pd_equal(mine, nm.prompt_hash, K3_PD_HASH_BYTES)) {
        k3_err(err, K3_ERR_ARG,
               "kv_transfer_params: the prompt's hash differs from the prefill instance's: the two instances did not "
               "make the same prompt");
        return NULL;
    }
    k3_pd_pull *p = calloc(1, sizeof *p);
    if (!p) {
        k3_err(err, K3_ERR_NOMEM, "out of memory");
        return NULL;
    }
    p->refs = 2;
    p->fd = -1;
    snprintf(p->host, sizeof p->host, "%s", nm.host);
    p->port = (int)nm.port;
    memcpy(p->token, nm.token, sizeof p->token);
    memcpy(p->hash, nm.prompt_hash, sizeof p->hash);
    p->n_tokens = n;
    json_t *lp = json_object_get(params, "first_token_logprob"),
           *top = json_object_get(params, "first_token_top_logprobs");
    int n_top = 0;
    for (size_t i = 0; json_is_array(top) && i < json_array_size(top) && n_top < K3_PD_MAX_FIRST_TOP; i++) {
        json_t *e = json_array_get(top, i);
        json_t *ti = json_array_get(e, 0), *tl = json_array_get(e, 1);
        if (!json_is_integer(ti) || !json_is_number(tl)) continue;
        p->top[n_top++] = (k3_logprob){(int32_t)json_integer_value(ti), (float)json_number_value(tl)};
    }
    json_t *qs = json_object_get(params, "prefill_queue_s"), *ps = json_object_get(params, "prefill_s");
    p->st.queue_s = json_is_number(qs) ? json_number_value(qs) : 0;
    p->st.prefill_s = json_is_number(ps) ? json_number_value(ps) : 0;
    *rp = (k3_remote_prefill){.first_token = (int32_t)first,
                              .first_logprob = json_is_number(lp) ? (float)json_number_value(lp) : NAN,
                              .first_top = p->top,
                              .n_first_top = n_top,
                              .queue_s = p->st.queue_s,
                              .prefill_s = p->st.prefill_s,
                              .ctx = p};
    return p;
}

static void *release_main(void *arg) {
    void **a = arg;
    k3_pd *pd = a[0];
    k3_pd_pull *p = a[1];
    free(a);
    release_remote(pd, p);
    k3_pd_pull_unref(pd, p);
    return NULL;
}

void k3_pd_release_named(k3_pd *pd, json_t *params, const char *credential) {
    named nm;
    if (!pd || !parse_named(pd, params, credential, &nm, NULL)) return; /* untrusted: nothing is connected to */
    k3_pd_pull *p = calloc(1, sizeof *p);
    if (!p) return;
    p->refs = 1;
    p->fd = -1;
    snprintf(p->host, sizeof p->host, "%s", nm.host);
    p->port = (int)nm.port;
    memcpy(p->token, nm.token, sizeof p->token);
    memcpy(p->hash, nm.prompt_hash, sizeof p->hash);
    k3_pd_pull_abandon(pd, p);
}

void k3_pd_pull_abandon(k3_pd *pd, k3_pd_pull *p) {
    /* the agent's reference goes with the release, in the background */
    void **a = malloc(2 * sizeof(void *));
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (a) {
        a[0] = pd;
        a[1] = p;
    }
    if (!a || pthread_create(&t, &at, release_main, a)) {
        free(a);
        k3_pd_pull_unref(pd, p); /* the prefill instance frees the hold at its timeout */
    }
    pthread_attr_destroy(&at);
}

void k3_pd_pull_stats_get(k3_pd *pd, const k3_pd_pull *p, k3_pd_pull_stats *out) {
    pthread_mutex_lock(&pd->mu);
    *out = p->st;
    pthread_mutex_unlock(&pd->mu);
}

json_t *k3_pd_pull_json(const k3_pd_pull_stats *s) {
    json_t *o =
        json_pack("{s:I,s:I,s:I,s:I,s:f,s:f,s:f,s:f,s:s}", "bytes", (json_int_t)s->bytes, "tokens",
                  (json_int_t)s->tokens, "blocks", (json_int_t)s->blocks, "states", (json_int_t)s->states, "seconds",
                  s->seconds, "gbps", s->seconds > 0 ? (double)s->bytes / s->seconds / 1e9 : 0.0, "prefill_queue_s",
                  s->queue_s, "prefill_s", s->prefill_s, "transport", s->ucx ? "ucx" : "tcp");
    if (o && s->ucx) json_object_set_new(o, "verify_s", json_real(s->verify_s));
    return o;
}

/* ---- /metrics ----------------------------------------------------------------------------------- */

static void render_hist(k3_buf *o, const char *name, const char *help, const char *label, const hist *h,
                        const double *le) {
    k3_buf_addf(o, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int b = 0; b < PD_HIST; b++) {
        cum += h->count[b];
        k3_buf_addf(o, "%s_bucket{model_name=\"%s\",le=\"%g\"} %llu\n", name, label, le[b], (unsigned long long)cum);
    }
    cum += h->count[PD_HIST];
    k3_buf_addf(o,
                "%s_bucket{model_name=\"%s\",le=\"+Inf\"} %llu\n%s_sum{model_name=\"%s\"} "
                "%.9g\n%s_count{model_name=\"%s\"} %llu\n",
                name, label, (unsigned long long)cum, name, label, h->sum, name, label, (unsigned long long)h->n);
}

void k3_pd_metrics_render(k3_pd *pd, const char *label, k3_buf *o) {
    k3_engine_stats st;
    k3_engine_get_stats(pd->e, &st);
    pthread_mutex_lock(&pd->mu);
    k3_buf_addf(o,
                "# HELP k3:kv_transfer_bytes_total Cache bytes moved between prefill and decode instances (rows and "
                "KDA states).\n"
                "# TYPE k3:kv_transfer_bytes_total counter\n"
                "k3:kv_transfer_bytes_total{model_name=\"%s\",dir=\"sent\"} %lld\n"
                "k3:kv_transfer_bytes_total{model_name=\"%s\",dir=\"received\"} %lld\n"
                "# HELP k3:kv_transfers_total Transfers of a prompt's cache, by direction and result.\n"
                "# TYPE k3:kv_transfers_total counter\n"
                "k3:kv_transfers_total{model_name=\"%s\",dir=\"sent\",result=\"ok\"} %lld\n"
                "k3:kv_transfers_total{model_name=\"%s\",dir=\"sent\",result=\"failed\"} %lld\n"
                "k3:kv_transfers_total{model_name=\"%s\",dir=\"received\",result=\"ok\"} %lld\n"
                "k3:kv_transfers_total{model_name=\"%s\",dir=\"received\",result=\"failed\"} %lld\n"
                "# HELP k3:kv_transfer_seconds_total Time spent in transfers, by direction.\n"
                "# TYPE k3:kv_transfer_seconds_total counter\n"
                "k3:kv_transfer_seconds_total{model_name=\"%s\",dir=\"sent\"} %.9g\n"
                "k3:kv_transfer_seconds_total{model_name=\"%s\",dir=\"received\"} %.9g\n"
                "# HELP k3:kv_transfer_blocks_total Cache blocks filled by transfers (decode side).\n"
                "# TYPE k3:kv_transfer_blocks_total counter\n"
                "k3:kv_transfer_blocks_total{model_name=\"%s\"} %lld\n"
                "# HELP k3:kv_transfer_states_total KDA states received (decode side).\n"
                "# TYPE k3:kv_transfer_states_total counter\n"
                "k3:kv_transfer_states_total{model_name=\"%s\"} %lld\n"
                "# HELP k3:kv_hold_releases_total Holds released by a decode instance that will not pull them.\n"
                "# TYPE k3:kv_hold_releases_total counter\n"
                "k3:kv_hold_releases_total{model_name=\"%s\"} %lld\n"
                "# HELP k3:kv_transfer_refused_total Transfer connections and requests refused: a peer without the "
                "deployment's secret, a pull or release that names no hold of this instance for its prompt (prefill), "
                "kv_transfer_params naming a peer without the proxy's credential (decode).\n"
                "# TYPE k3:kv_transfer_refused_total counter\n"
                "k3:kv_transfer_refused_total{model_name=\"%s\",reason=\"auth\"} %lld\n"
                "k3:kv_transfer_refused_total{model_name=\"%s\",reason=\"hold\"} %lld\n"
                "k3:kv_transfer_refused_total{model_name=\"%s\",reason=\"params\"} %lld\n",
                label, (long long)pd->sent_bytes, label, (long long)pd->recv_bytes, label, (long long)pd->sent_ok,
                label, (long long)pd->sent_failed, label, (long long)pd->recv_ok, label, (long long)pd->recv_failed,
                label, pd->sent_seconds, label, pd->recv_seconds, label, (long long)pd->recv_blocks, label,
                (long long)pd->recv_states, label, (long long)pd->releases, label, (long long)pd->refused_auth, label,
                (long long)pd->refused_hold, label, (long long)pd->refused_params);
    k3_buf_addf(o,
                "# HELP k3:kv_transfers_ucx_total Transfers whose rows moved by one-sided UCX gets (sent: holds "
                "offered in place and landed; received: pulls landed).\n"
                "# TYPE k3:kv_transfers_ucx_total counter\n"
                "k3:kv_transfers_ucx_total{model_name=\"%s\",dir=\"sent\"} %lld\n"
                "k3:kv_transfers_ucx_total{model_name=\"%s\",dir=\"received\"} %lld\n"
                "# HELP k3:kv_transfer_ucx_fallback_total Pulls that asked for UCX and got the rows on the stream "
                "(this prefill instance cannot offer its holds in place).\n"
                "# TYPE k3:kv_transfer_ucx_fallback_total counter\n"
                "k3:kv_transfer_ucx_fallback_total{model_name=\"%s\"} %lld\n",
                label, (long long)pd->ucx_sent, label, (long long)pd->ucx_recv, label, (long long)pd->ucx_fallback);
    render_hist(o, "k3:kv_transfer_seconds", "Time of one transfer, connect to the last byte (decode side).", label,
                &pd->h_secs, pd_secs_le);
    render_hist(o, "k3:kv_transfer_gbps", "Throughput of one transfer in GB/s (decode side).", label, &pd->h_gbps,
                pd_gbps_le);
    pthread_mutex_unlock(&pd->mu);
    k3_buf_addf(o,
                "# HELP k3:kv_holds Finished prompts whose blocks and KDA state are kept for a decode instance.\n"
                "# TYPE k3:kv_holds gauge\nk3:kv_holds{model_name=\"%s\"} %lld\n"
                "# HELP k3:kv_hold_blocks Cache blocks held for transfer (prefill side).\n"
                "# TYPE k3:kv_hold_blocks gauge\nk3:kv_hold_blocks{model_name=\"%s\"} %lld\n"
                "# HELP k3:kv_holds_expired_total Holds freed unread at their timeout.\n"
                "# TYPE k3:kv_holds_expired_total counter\nk3:kv_holds_expired_total{model_name=\"%s\"} %lld\n"
                "# HELP k3:kv_holds_released_total Holds released (read, or given up by the decode side).\n"
                "# TYPE k3:kv_holds_released_total counter\nk3:kv_holds_released_total{model_name=\"%s\"} %lld\n"
                "# HELP k3:kv_pulls Requests whose prompt's cache is being pulled (decode side).\n"
                "# TYPE k3:kv_pulls gauge\nk3:kv_pulls{model_name=\"%s\"} %lld\n"
                "# HELP k3:kv_pull_blocks Cache blocks of the requests being pulled.\n"
                "# TYPE k3:kv_pull_blocks gauge\nk3:kv_pull_blocks{model_name=\"%s\"} %lld\n",
                label, (long long)st.n_holds, label, (long long)st.hold_blocks, label, (long long)st.holds_expired,
                label, (long long)st.holds_released, label, (long long)st.n_pulls, label, (long long)st.pull_blocks);
}
