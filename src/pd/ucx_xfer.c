/*
 * ucx_xfer.c -- the transfer agent's UCX transport (xfer.h): a hold's rows
 * and KDA state pulled with one-sided gets from where they lie in the prefill
 * instance's cache into where they go in the decode instance's, the control
 * messages on the authenticated stream.
 *
 * Registration. At start every cache array of every MLA/DSA layer is
 * registered once with the agent's UCX context (ucp_mem_map costs little
 * here, but pins pages on an RDMA NIC): for remote reads on a prefill
 * instance, for local writes on a decode instance. A hold's KDA state is a
 * buffer of its own (captured at the prompt's end; the slot moves on), so it
 * is registered for the one pull that reads it.
 *
 * A pull. The prefill side takes a worker for the pull alone (over a
 * network transport a new one, so its endpoints and listening sockets live
 * as long as the pull; over shared memory a kept one, see struct k3_pd_ux),
 * and sends, as unit 0 on the stream under its MAC, the offer: the worker's
 * address, the
 * remote keys of the arrays and of the state, the hold's block table and
 * block size. Then, for each unit (one layer's rows for a run of positions,
 * or a piece of the state; the same units as the TCP stream's), a header
 * whose payload tag is the GMAC of the unit's bytes where they lie in its
 * cache, in the transfer layout's order (k3_pd_tag_iov over the pieces: no
 * copy), then END; then it waits for the decode side's answer, progressing
 * its worker (over tcp the gets are messages it serves), and keeps the hold
 * pinned until then: no block of it is freed under an outstanding get.
 *
 * The decode side connects to the offered worker, and for each unit header
 * posts the gets of its pieces: for each array, each run of positions that
 * is contiguous in both sides' block tables (the block sizes may differ) is
 * one get, from the prefill's slot to its own, straight into its blocks and
 * its state buffer (the request's pull pinned: k3_engine_pull_pin). When a
 * unit's gets are complete it checks the unit's MAC over the bytes where
 * they landed (on a checker thread, in order, while the next units' gets
 * move); only a pull whose every unit checked lands. Several ranks
 * (DCP, EP) keep a decode instance's cache, so there a unit lands in a
 * buffer and goes through k3_engine_pull_write (the executor's mirror). It
 * answers END (or ERROR) as its message 1, then closes its endpoint: the
 * prefill side then frees the hold and the pull's worker.
 *
 * Failures: a peer that dies (the endpoint's error, or the stream's end), a
 * silence of the timeout (nothing arrived or landed), a cancel (the client
 * left): every get still outstanding is cancelled (the endpoint closed by
 * force) before the request's blocks may be freed.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "comm/ucx.h"
#include "common/error.h"
#include "pd/xfer.h"

#define MAX_LAYERS 1024
#define MAX_COMPS 5
#define WINDOW 32 /* units whose gets are in flight at once (decode side) */
#define KEPT 8    /* idle workers kept (host-local transports only) */
#define REUSES 64 /* pulls a kept worker serves before it is replaced */

/* ---- faults ------------------------------------------------------------------------------------- */

static void nap_ms(int64_t ms) {
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

bool k3_pd_fault_send(k3_pd_fault *f) {
    if (!f->kind) return false;
    const int64_t u = atomic_fetch_add(&f->seen, 1);
    if (u != f->unit) return false;
    if (f->kind == 's') nap_ms(f->ms);
    return f->kind == 'f';
}

void k3_pd_fault_recv(k3_pd_fault *f) {
    if (f->kind != 's') return;
    if (atomic_fetch_add(&f->seen, 1) == f->unit) nap_ms(f->ms);
}

/* ---- the context and the registered arrays -------------------------------------------------------- */

typedef struct arr {
    int32_t layer, comp;
    k3_kv_array a;
    k3_ucx_mem *m; /* NULL: not registered (not in place) */
} arr;

struct k3_pd_ux {
    k3_engine *e;
    k3_ucx *u; /* the context (and a worker nobody uses: each pull makes its own) */
    char tls[128];
    bool serve, read_direct, write_direct;
    arr *arrs;
    int n_arrs;
    int first[MAX_LAYERS + 1]; /* arrs of layer L: [first[L], first[L + 1]) */
    /* Workers: one per pull. Over host-local transports (shared memory)
     * they are kept and reused (a worker costs 1-8 ms to make here, as much
     * as a pull of 20 MB), each for REUSES pulls (the endpoints peers made to
     * it stay until it goes); over a network transport every pull makes its
     * own and closes it, so nothing of it listens between pulls. */
    bool local;
    pthread_mutex_t mu;
    k3_ucx *idle[KEPT];
    int uses[KEPT], n_idle;
    /* Workers of failed pulls over a network transport whose peer may be
     * lost: closed once k3_ucx_quiet says nothing is queued toward it any
     * more (UCX 1.13 aborts closing a worker with a connection reply queued
     * toward a peer whose link is down), looked at on every pull. */
    k3_ucx **parked;
    int n_parked, cap_parked;
};

typedef struct worker {
    k3_ucx *w;
    int uses;
} worker;

/* The parked workers that are quiet now, closed (under mu). */
static void parked_sweep(k3_pd_ux *ux) {
    int k = 0;
    for (int i = 0; i < ux->n_parked; i++)
        if (k3_ucx_quiet(ux->parked[i])) k3_ucx_close(ux->parked[i]);
        else ux->parked[k++] = ux->parked[i];
    ux->n_parked = k;
}

static k3_status worker_take(k3_pd_ux *ux, const char *name, worker *out, k3_error *err) {
    *out = (worker){0};
    if (!ux->local) {
        pthread_mutex_lock(&ux->mu);
        parked_sweep(ux);
        pthread_mutex_unlock(&ux->mu);
    }
    if (ux->local) {
        pthread_mutex_lock(&ux->mu);
        if (ux->n_idle > 0) {
            ux->n_idle--;
            *out = (worker){ux->idle[ux->n_idle], ux->uses[ux->n_idle]};
        }
        pthread_mutex_unlock(&ux->mu);
        if (out->w) return K3_OK;
    }
    return k3_ucx_worker_new(ux->u, name, &out->w, err);
}

/* Back after a pull (every endpoint of it closed on this side). A failed
 * pull's worker is not kept; over a network transport it is closed only
 * when quiet (parked until then). */
static void worker_give(k3_pd_ux *ux, worker *w, bool ok) {
    if (!w->w) return;
    if (!ux->local && !ok && !k3_ucx_quiet(w->w)) {
        pthread_mutex_lock(&ux->mu);
        if (ux->n_parked == ux->cap_parked) {
            const int nc = ux->cap_parked ? 2 * ux->cap_parked : 8;
            k3_ucx **np = realloc(ux->parked, sizeof *np * (size_t)nc);
            if (np) ux->parked = np, ux->cap_parked = nc;
        }
        /* out of memory for the list: left unclosed (closing it may abort) */
        if (ux->n_parked < ux->cap_parked) ux->parked[ux->n_parked++] = w->w;
        pthread_mutex_unlock(&ux->mu);
        w->w = NULL;
        return;
    }
    if (ux->local && ok && ++w->uses < REUSES) {
        pthread_mutex_lock(&ux->mu);
        const bool kept = ux->n_idle < KEPT;
        if (kept) {
            ux->idle[ux->n_idle] = w->w;
            ux->uses[ux->n_idle++] = w->uses;
        }
        pthread_mutex_unlock(&ux->mu);
        if (kept) {
            w->w = NULL;
            return;
        }
    }
    k3_ucx_close(w->w);
    w->w = NULL;
}

/* Whether a transport list names only host-local transports (shared memory
 * and self). */
static bool only_local(const char *tls) {
    static const char *const loc[] = {"sm", "cma", "posix", "sysv", "mm", "xpmem", "knem", "shm", "self"};
    if (!tls) return false;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", tls);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        bool found = false;
        for (size_t i = 0; i < sizeof loc / sizeof *loc; i++) found |= !strcmp(t, loc[i]);
        if (!found) return false;
    }
    return true;
}

/* Whether a transport list names a shared-memory transport (no peer failure
 * detection there). */
static bool names_shm(const char *tls) {
    static const char *const shm[] = {"sm", "cma", "posix", "sysv", "mm", "xpmem", "knem", "shm"};
    char buf[128];
    snprintf(buf, sizeof buf, "%s", tls ? tls : "");
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        while (*t == '^' || *t == ' ') t++;
        for (size_t i = 0; i < sizeof shm / sizeof *shm; i++)
            if (!strcmp(t, shm[i])) return true;
    }
    return !tls; /* UCX's own choice may take shared memory on one host */
}

k3_status k3_pd_ux_open(k3_pd_ux **out, k3_engine *e, const char *tls, bool serve, k3_error *err) {
    *out = NULL;
    k3_pd_ux *ux = calloc(1, sizeof *ux);
    if (!ux) return k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory");
    ux->e = e;
    ux->serve = serve;
    ux->local = only_local(tls);
    pthread_mutex_init(&ux->mu, NULL);
    snprintf(ux->tls, sizeof ux->tls, "%s", tls ? tls : "UCX's default");
    ux->read_direct = k3_engine_kv_direct(e, false);
    ux->write_direct = k3_engine_kv_direct(e, true);
    const k3_ucx_options o = {.tls = tls, .name = serve ? "k3-prefill" : "k3-decode", .no_peer_errors = names_shm(tls)};
    k3_status st = k3_ucx_open(&ux->u, &o, err);
    int cap = 0;
    for (int32_t L = 0; !st && L < MAX_LAYERS; L++) {
        ux->first[L] = ux->n_arrs;
        k3_kv_array a[MAX_COMPS];
        const int n = k3_engine_kv_arrays(e, L, a);
        for (int c = 0; !st && c < n; c++) {
            if (ux->n_arrs == cap) {
                cap = cap ? 2 * cap : 64;
                arr *na = realloc(ux->arrs, sizeof *na * (size_t)cap);
                if (!na) {
                    st = k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory");
                    break;
                }
                ux->arrs = na;
            }
            arr *x = &ux->arrs[ux->n_arrs++];
            *x = (arr){L, c, a[c], NULL};
            /* registered where a pull may go in place: read by peers on a
             * prefill instance, written by this one's gets on a decode one */
            if (serve ? ux->read_direct : ux->write_direct)
                st = k3_ucx_mem_register_access(ux->u, a[c].base, (size_t)a[c].bytes,
                                                serve ? K3_UCX_REMOTE_READ : K3_UCX_LOCAL, &x->m, err);
        }
    }
    ux->first[MAX_LAYERS] = ux->n_arrs;
    if (st) {
        k3_pd_ux_close(ux);
        return st;
    }
    *out = ux;
    return K3_OK;
}

void k3_pd_ux_close(k3_pd_ux *ux) {
    if (!ux) return;
    for (int i = 0; i < ux->n_idle; i++) k3_ucx_close(ux->idle[i]);
    /* a parked worker still not quiet is left to the process's end (closing
     * it would abort), and so is the context it belongs to */
    parked_sweep(ux);
    const bool leave = ux->n_parked > 0;
    free(ux->parked);
    pthread_mutex_destroy(&ux->mu);
    for (int i = 0; i < ux->n_arrs; i++) k3_ucx_mem_free(ux->arrs[i].m);
    free(ux->arrs);
    if (!leave) k3_ucx_close(ux->u);
    free(ux);
}

const char *k3_pd_ux_tls(const k3_pd_ux *ux) { return ux->tls; }

bool k3_pd_ux_can_serve(const k3_pd_ux *ux) { return ux && ux->serve && ux->read_direct && ux->u; }

/* ---- pieces: a unit's bytes where they lie ---------------------------------------------------------- */

typedef struct piece {
    uint64_t src; /* byte offset in the source array (prefill side) */
    uint8_t *dst; /* where it goes (decode side), or where it lies (prefill side: src unused) */
    size_t len;
} piece;

typedef struct pieces {
    piece *p;
    int n, cap;
} pieces;

static bool add_piece(pieces *ps, uint64_t src, uint8_t *dst, size_t len) {
    if (ps->n > 0) { /* contiguous on both sides: one piece */
        piece *l = &ps->p[ps->n - 1];
        if (l->src + l->len == src && l->dst + l->len == dst) {
            l->len += len;
            return true;
        }
    }
    if (ps->n == ps->cap) {
        const int nc = ps->cap ? 2 * ps->cap : 64;
        piece *np = realloc(ps->p, sizeof *np * (size_t)nc);
        if (!np) return false;
        ps->p = np;
        ps->cap = nc;
    }
    ps->p[ps->n++] = (piece){src, dst, len};
    return true;
}

/* The slots of positions [t0, t0 + n) split where either block table turns
 * a corner: (src slot in tables s, dst slot in table d (or NULL: a buffer
 * from dst0), row bytes) pieces appended in position order. */
static bool run_pieces(pieces *ps, const int32_t *sb, int32_t sbs, const int32_t *db, int32_t dbs, uint8_t *dst_base,
                       int64_t row, int64_t t0, int64_t n) {
    for (int64_t p = t0; p < t0 + n;) {
        const int64_t so = p % sbs, s_slot = (int64_t)sb[p / sbs] * sbs + so;
        int64_t k = sbs - so;
        uint8_t *dst;
        if (db) {
            const int64_t dof = p % dbs, d_slot = (int64_t)db[p / dbs] * dbs + dof;
            if (dbs - dof < k) k = dbs - dof;
            dst = dst_base + d_slot * row;
        } else {
            dst = dst_base + (p - t0) * row;
        }
        if (t0 + n - p < k) k = t0 + n - p;
        if (!add_piece(ps, (uint64_t)(s_slot * row), dst, (size_t)(k * row))) return false;
        p += k;
    }
    return true;
}

/* ---- the prefill side ------------------------------------------------------------------------------ */

typedef struct blob {
    uint8_t *p;
    size_t n, cap;
} blob;

static bool put(blob *b, const void *x, size_t n) {
    if (b->n + n > b->cap) {
        size_t nc = b->cap ? 2 * b->cap : 4096;
        while (nc < b->n + n) nc *= 2;
        uint8_t *np = realloc(b->p, nc);
        if (!np) return false;
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->n, x, n);
    b->n += n;
    return true;
}

/* The unit's MAC (message 2 no + 1) over its bytes where they lie, in order. */
static k3_status tag_pieces(k3_pd_session *ss, int64_t no, k3_pd_unit *u, const pieces *ps, k3_error *err) {
#ifdef K3_PD_UCX_NO_MAC /* a bench build only: what the MACs of the rows cost (docs/pd.md) */
    return K3_OK;
#endif
    struct iovec v[64] = {{0}}, *vv = ps->n <= 64 ? v : malloc(sizeof *vv * (size_t)ps->n);
    if (!vv) return k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory");
    for (int i = 0; i < ps->n; i++) vv[i] = (struct iovec){ps->p[i].dst, ps->p[i].len};
    k3_pd_tag_iov(&ss->tx, 2 * (uint64_t)no + 1, vv, ps->n, u->payload_tag);
    if (vv != v) free(vv);
    return K3_OK;
}

/* A unit's header: its MAC over where its bytes lie, the test fault (a byte
 * flipped after the MAC, before the header lets the peer get it: restored by
 * the caller), then the header (message 2 no). */
static k3_status send_header(int fd, k3_pd_session *ss, int64_t no, k3_pd_unit *u, const pieces *ps, k3_pd_fault *f,
                             uint8_t **flipped, uint8_t *flip_was, k3_error *err) {
    K3_TRY(tag_pieces(ss, no, u, ps, err));
    if (k3_pd_fault_send(f) && !*flipped && ps->n > 0) {
        *flipped = ps->p[0].dst + ps->p[0].len / 2;
        *flip_was = **flipped;
        **flipped ^= 0x10;
    }
    return k3_pd_unit_send(fd, ss, 2 * (uint64_t)no, u, err);
}

/* Where the transport emulates gets with messages (tcp; on one host the
 * shared-memory segments of sysv and posix: UCX 1.13 takes cma for
 * rendezvous only, not for ucp_get), each get is served by this worker's
 * progress: everything that came is answered before the next unit. */
static void serve_pending(k3_ucx *w) {
    for (int i = 0; i < 4096 && k3_ucx_progress(w); i++) {}
}

/* The offer under a test fault: a byte of its last remote key flipped after
 * its MAC (forged), or the first pull's offer sent as it went (replayed: its
 * header's MAC and its payload's of another session). */
static k3_status offer_fault(int fd, k3_pd_session *ss, k3_pd_fault *f, k3_pd_unit *u, blob *b, k3_error *err) {
    if (f->kind == 'o') {
        b->p[b->n - 1] ^= 0x10;
        K3_TRY(k3_pd_unit_send(fd, ss, 0, u, err));
        return k3_pd_send(fd, b->p, b->n, NULL, 0, "the UCX offer", err);
    }
    pthread_mutex_lock(&f->mu);
    if (!f->offer) { /* the first: kept as it goes */
        const k3_status s = k3_pd_unit_send(fd, ss, 0, u, err);
        if (s) {
            pthread_mutex_unlock(&f->mu);
            return s;
        }
        f->offer = malloc(sizeof *u + b->n);
        if (f->offer) {
            memcpy(f->offer, u, sizeof *u);
            memcpy(f->offer + sizeof *u, b->p, b->n);
            f->offer_n = sizeof *u + b->n;
        }
        pthread_mutex_unlock(&f->mu);
        return k3_pd_send(fd, b->p, b->n, NULL, 0, "the UCX offer", err);
    }
    const k3_status s = k3_pd_send(fd, f->offer, f->offer_n, NULL, 0, "the UCX offer", err);
    pthread_mutex_unlock(&f->mu);
    return s;
}

k3_status k3_pd_ux_serve(k3_pd_ux *ux, int fd, k3_pd_session *ss, uint64_t hold, const k3_pd_req *r, k3_pd_fault *f,
                         double timeout_s, k3_pd_ux_stats *st, bool *landed, k3_error *err) {
    k3_engine *e = ux->e;
    *st = (k3_pd_ux_stats){0};
    *landed = false;
    k3_kv_pin pin = {0};
    k3_status s = k3_engine_hold_pin(e, hold, &pin, err);
    const bool pinned = !s;
    worker wk = {0};
    k3_ucx *w = NULL;
    k3_ucx_mem *sm = NULL;
    blob b = {0};
    pieces ps = {0};
    uint8_t *flipped = NULL, flip_was = 0;
    void *addr = NULL;
    size_t alen = 0;
    int64_t no = 0; /* the next unit's number */
    if (!s && (r->from < 0 || r->from > r->to || r->to != pin.to))
        s = k3_err(err, K3_ERR_ARG, "kv transfer: positions [%lld, %lld) asked of a hold of %lld tokens",
                   (long long)r->from, (long long)r->to, (long long)pin.to);
    /* the pull's own worker: its endpoints and sockets go with it */
    if (!s) s = worker_take(ux, "k3-prefill-pull", &wk, err);
    w = wk.w;
    if (!s && pin.state_bytes > 0)
        s = k3_ucx_mem_register_access(ux->u, pin.state, (size_t)pin.state_bytes, K3_UCX_REMOTE_READ, &sm, err);
    if (!s) s = k3_ucx_address(w, &addr, &alen, err);
    /* the offer */
    if (!s) {
        const k3_pd_ucx_offer o = {.magic = {'K', '3', 'P', 'U'},
                                   .addr_len = (uint32_t)alen,
                                   .n_arrays = (uint32_t)ux->n_arrs,
                                   .n_regions = (uint32_t)ux->n_arrs + (sm ? 1u : 0u),
                                   .block_size = pin.block_size,
                                   .n_blocks = pin.n_blocks,
                                   .state_region = sm ? ux->n_arrs : -1,
                                   .n_tokens = pin.to};
        bool ok = put(&b, &o, sizeof o) && put(&b, addr, alen);
        for (int i = 0; ok && i < ux->n_arrs; i++) {
            const k3_pd_ucx_array a = {ux->arrs[i].layer, ux->arrs[i].comp, i, 0, ux->arrs[i].a.row};
            ok = put(&b, &a, sizeof a);
        }
        ok = ok && put(&b, pin.blocks, sizeof(int32_t) * (size_t)pin.n_blocks);
        for (int i = 0; ok && !s && i <= ux->n_arrs; i++) {
            k3_ucx_mem *m = i < ux->n_arrs ? ux->arrs[i].m : sm;
            if (!m) continue;
            void *d = NULL;
            size_t dl = 0;
            s = k3_ucx_mem_pack(m, &d, &dl, err);
            const uint32_t l32 = (uint32_t)dl;
            if (!s) ok = put(&b, &l32, sizeof l32) && put(&b, d, dl);
            free(d);
        }
        if (!s && !ok) s = k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory for the offer");
        if (!s) {
            k3_pd_unit u = {.kind = K3_PD_UCX, .layer = -1, .payload_bytes = b.n};
            k3_pd_tag(&ss->tx, 1, b.p, b.n, NULL, 0, u.payload_tag);
            if (f->kind == 'o' || f->kind == 'r') s = offer_fault(fd, ss, f, &u, &b, err);
            else {
                s = k3_pd_unit_send(fd, ss, 0, &u, err);
                if (!s) s = k3_pd_send(fd, b.p, b.n, NULL, 0, "the UCX offer", err);
            }
            if (!s) no = 1;
        }
    }
    free(addr);
    /* the units: headers and the MACs of where their bytes lie */
    int64_t max_unit = r->max_unit > 0 && r->max_unit < ((int64_t)64 << 20) ? r->max_unit : (int64_t)1 << 20;
    for (int32_t L = 0; !s && L < MAX_LAYERS; L++) {
        const int a0 = ux->first[L], a1 = ux->first[L + 1];
        if (a0 == a1) continue;
        const int64_t row = k3_engine_kv_bytes(e, L, 1);
        const int64_t per = max_unit / row > 0 ? max_unit / row : 1;
        for (int64_t t = r->from; !s && t < r->to; t += per) {
            const int64_t n = r->to - t < per ? r->to - t : per;
            ps.n = 0;
            for (int i = a0; i < a1; i++)
                if (!run_pieces(&ps, pin.blocks, pin.block_size, pin.blocks, pin.block_size,
                                (uint8_t *)ux->arrs[i].a.base, ux->arrs[i].a.row, t, n))
                    s = k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory");
            k3_pd_unit u = {.kind = K3_PD_LAYER, .layer = L, .t0 = t, .n = n, .payload_bytes = (uint64_t)(row * n)};
            if (!s) s = send_header(fd, ss, no, &u, &ps, f, &flipped, &flip_was, err);
            no++;
            st->bytes += row * n;
            serve_pending(w); /* the gets that came meanwhile */
        }
    }
    for (int64_t off = 0; !s && off < pin.state_bytes; off += max_unit) {
        const int64_t n = pin.state_bytes - off < max_unit ? pin.state_bytes - off : max_unit;
        ps.n = 0;
        add_piece(&ps, (uint64_t)off, (uint8_t *)pin.state + off, (size_t)n);
        k3_pd_unit u = {.kind = K3_PD_STATE, .layer = -1, .t0 = off, .n = n, .payload_bytes = (uint64_t)n};
        s = send_header(fd, ss, no, &u, &ps, f, &flipped, &flip_was, err);
        no++;
        st->bytes += n;
        serve_pending(w);
    }
    if (!s) {
        k3_pd_unit u = {.kind = K3_PD_END, .layer = -1, .t0 = no};
        s = k3_pd_unit_send(fd, ss, 2 * (uint64_t)no, &u, err);
        if (s) no = -1; /* the stream broke: nothing more goes */
    }
    st->units = no > 0 ? no - 1 : 0;
    if (s && no >= 0) { /* before the end: the decode side is told (a peer that is gone does not read it) */
        static const char msg[] = "kv transfer: the prefill instance could not serve the hold";
        k3_pd_unit u = {.kind = K3_PD_ERROR, .layer = -1, .payload_bytes = sizeof msg - 1};
        k3_pd_tag(&ss->tx, 2 * (uint64_t)no + 1, msg, sizeof msg - 1, NULL, 0, u.payload_tag);
        if (!k3_pd_unit_send(fd, ss, 2 * (uint64_t)no, &u, NULL))
            k3_pd_send(fd, msg, sizeof msg - 1, NULL, 0, "", NULL);
        no = -1;
    }
    /* the decode side's answer: until then the hold stays pinned and the
     * worker answers (a silent peer: twice the timeout, the gets' own
     * deadline and the answer's) */
    if (!s) {
        if (!k3_ucx_serve_until_readable(w, fd, 2 * timeout_s, NULL))
            s = k3_err(err, K3_ERR_IO, "kv transfer: the decode instance did not say it landed the pull within %.1f s",
                       2 * timeout_s);
        k3_pd_unit u;
        if (!s) s = k3_pd_unit_recv(fd, ss, 1, &u, err);
        if (!s) *landed = u.kind == K3_PD_END && u.t0 == no;
    }
    /* the worker first (closed, or over shared memory kept for the next
     * pull), then the hold */
    worker_give(ux, &wk, !s && *landed);
    k3_ucx_mem_free(sm);
    if (flipped) *flipped = flip_was;
    if (pinned) k3_engine_hold_unpin(e, &pin);
    free(b.p);
    free(ps.p);
    return s;
}

/* ---- the decode side ------------------------------------------------------------------------------ */

/* A unit in flight: its gets posted (GETS), landed and handed to the
 * checker (LANDED), its MAC checked (GOOD or BAD). The pull's thread posts
 * and lands units in order, the checker checks them in the same order on a
 * thread of its own (so the MACs of landed units are computed while the
 * next units' gets move), and the pull's thread retires them in order. */
enum { GETS = 0, LANDED, GOOD, BAD };
typedef struct pend {
    k3_ucx_xfer *x;
    int64_t no; /* the unit's number */
    k3_pd_unit u;
    struct iovec *v; /* where its bytes landed, in the transfer layout's order */
    int n_v;
    uint8_t *stage; /* a unit buffer (not in place), else NULL */
    int phase;      /* under the checker's mu */
} pend;

typedef struct checker {
    pthread_t t;
    bool started, quit; /* quit: under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    k3_pd_mac mac; /* a second context of the session's receiving key */
    struct puller *P;
    int next;      /* the ring slot it checks next */
    double busy_s; /* under mu */
} checker;

typedef struct puller {
    k3_pd_ux *ux;
    k3_engine *e;
    int fd;
    k3_pd_session *ss;
    const k3_pull_info *pi;
    double timeout, last;
    const atomic_bool *cancel, *quit;
    k3_ucx *w;
    k3_ucx_ep *ep;
    k3_ucx_region **reg;
    int n_reg;
    pend ring[WINDOW];
    int head, n_pend, n_landed; /* slots in use from head; of them landed (from head) */
    k3_pd_ux_stats *st;
    int64_t state_landed;
    checker ck;
} puller;

static void *check_main(void *arg) {
    checker *c = arg;
    struct puller *P = c->P;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->quit && P->ring[c->next].phase != LANDED) pthread_cond_wait(&c->cv, &c->mu);
        if (c->quit) break;
        pend *p = &P->ring[c->next];
        pthread_mutex_unlock(&c->mu);
        /* the slot is this thread's until its phase moves on */
        const double t0 = k3_now();
#ifdef K3_PD_UCX_NO_MAC /* a bench build only: what the MACs of the rows cost (docs/pd.md) */
        const bool ok = true;
#else
        const bool ok = k3_pd_tag_iov_ok(&c->mac, 2 * (uint64_t)p->no + 1, p->v, p->n_v, p->u.payload_tag);
#endif
        const double dt = k3_now() - t0;
        pthread_mutex_lock(&c->mu);
        c->busy_s += dt;
        p->phase = ok ? GOOD : BAD;
        c->next = (c->next + 1) % WINDOW;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static k3_status checker_start(puller *P, k3_error *err) {
    checker *c = &P->ck;
    c->P = P;
    if (!k3_pd_mac_clone(&c->mac, &P->ss->rx) || pthread_create(&c->t, NULL, check_main, c)) {
        k3_pd_mac_free(&c->mac);
        return k3_err(err, K3_ERR_NOMEM, "kv transfer: cannot start the MAC checker");
    }
    c->started = true;
    return K3_OK;
}

/* Stops the checker (after the unit it is checking, if any). */
static void checker_stop(puller *P) {
    checker *c = &P->ck;
    if (!c->started) return;
    pthread_mutex_lock(&c->mu);
    c->quit = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->t, NULL);
    k3_pd_mac_free(&c->mac);
    P->st->verify_s = c->busy_s;
    c->started = false;
}

static void pend_free(pend *p) {
    k3_ucx_xfer_free(p->x); /* complete, or cancelled here */
    free(p->v);
    free(p->stage);
    p->x = NULL, p->v = NULL, p->stage = NULL;
}

static k3_status stopped(puller *P, k3_error *err) {
    if (atomic_load(P->cancel)) return k3_err(err, K3_ERR_ARG, "cancelled");
    if (atomic_load(P->quit)) return k3_err(err, K3_ERR_IO, "the server is shutting down");
    if (k3_now() - P->last > P->timeout)
        return k3_err(err, K3_ERR_IO,
                      "kv transfer: nothing landed or arrived within %.1f s (%d units in flight over UCX from the "
                      "prefill instance)",
                      P->timeout, P->n_pend);
    return K3_OK;
}

static int phase_of(puller *P, const pend *p) {
    pthread_mutex_lock(&P->ck.mu);
    const int ph = p->phase;
    pthread_mutex_unlock(&P->ck.mu);
    return ph;
}

/* Units whose gets completed go to the checker (in order); the oldest,
 * checked, is retired (written, through a buffer) and its slot freed. *done:
 * whether anything moved. */
static k3_status settle(puller *P, int *done, k3_error *err) {
    *done = 0;
    while (P->n_landed < P->n_pend) { /* landed, in order */
        pend *p = &P->ring[(P->head + P->n_landed) % WINDOW];
        int complete = 0;
        K3_TRY(k3_ucx_xfer_test(p->x, &complete, err));
        if (!complete) break;
        pthread_mutex_lock(&P->ck.mu);
        p->phase = LANDED;
        pthread_cond_broadcast(&P->ck.cv);
        pthread_mutex_unlock(&P->ck.mu);
        P->n_landed++;
        P->last = k3_now();
        *done = 1;
    }
    while (P->n_pend > 0) { /* checked, in order */
        pend *p = &P->ring[P->head];
        const int ph = phase_of(P, p);
        if (ph == BAD)
            return k3_err(err, K3_ERR_FORMAT,
                          "kv transfer: unit %lld (kind %u, layer %d, positions %lld+%lld) is damaged: its MAC does "
                          "not match what the gets brought over UCX",
                          (long long)p->no, p->u.kind, p->u.layer, (long long)p->u.t0, (long long)p->u.n);
        if (ph != GOOD) break;
        k3_status s = K3_OK;
        if (p->stage && p->u.kind == K3_PD_LAYER)
            s = k3_engine_pull_write(P->e, P->pi->id, p->u.layer, p->u.t0, (int32_t)p->u.n, p->stage,
                                     (int64_t)p->u.payload_bytes, err);
        else if (p->stage && p->u.kind == K3_PD_STATE)
            s = k3_engine_pull_state(P->e, P->pi->id, p->u.t0, p->stage, p->u.n, err);
        else if (p->u.kind == K3_PD_STATE) P->state_landed += p->u.n;
        P->st->bytes += (int64_t)p->u.payload_bytes;
        pend_free(p);
        pthread_mutex_lock(&P->ck.mu);
        p->phase = GETS; /* free */
        pthread_mutex_unlock(&P->ck.mu);
        P->head = (P->head + 1) % WINDOW;
        P->n_pend--;
        P->n_landed--;
        P->last = k3_now();
        *done = 1;
        if (s) return s;
    }
    return K3_OK;
}

/* Progresses the gets in flight (settling what landed) until fd has
 * something to read, or (drain) until nothing is in flight. */
static k3_status wait_for(puller *P, bool drain, k3_error *err) {
    long spins = 0;
    for (unsigned busy = 0;; busy++) {
        int done = 0;
        K3_TRY(settle(P, &done, err));
        if (done) spins = 0;
        if (drain && P->n_pend == 0) return K3_OK;
        /* while gets are moving, the socket and the clock every 64 rounds */
        if (spins > 0 || busy % 64 == 0 || P->n_pend == 0) {
            if (!drain) {
                struct pollfd pf = {.fd = P->fd, .events = POLLIN};
                if (poll(&pf, 1, 0) > 0) return K3_OK;
            }
            K3_TRY(stopped(P, err));
        }
        if (k3_ucx_progress(P->w)) spins = 0;
        else if (++spins > 200) {
            struct timespec ts = {0, spins < 2000 ? 20000 : 200000};
            nanosleep(&ts, NULL);
        }
    }
}

/* The offer parsed: the endpoint, the regions, the hold's table; every
 * length bounded. */
typedef struct offer {
    k3_pd_ucx_offer h;
    const uint8_t *addr;
    const k3_pd_ucx_array *arrays;
    const int32_t *blocks;
} offer;

static k3_status parse_offer(puller *P, const uint8_t *b, size_t n, offer *o, k3_error *err) {
    if (n < sizeof o->h) return k3_err(err, K3_ERR_FORMAT, "kv transfer: a UCX offer of %zu bytes", n);
    memcpy(&o->h, b, sizeof o->h);
    const k3_pd_ucx_offer *h = &o->h;
    const uint64_t need = sizeof *h + (uint64_t)h->addr_len + (uint64_t)h->n_arrays * sizeof(k3_pd_ucx_array) +
        (uint64_t)(h->n_blocks > 0 ? h->n_blocks : 0) * sizeof(int32_t);
    if (memcmp(h->magic, "K3PU", 4) || !h->addr_len || h->addr_len > (1u << 16) || h->n_arrays > 5 * MAX_LAYERS ||
        h->n_regions > h->n_arrays + 1 || h->block_size < 1 || h->n_blocks < 1 || need > n ||
        h->n_tokens != P->pi->n_tokens || (int64_t)h->n_blocks * h->block_size < h->n_tokens || h->state_region < -1 ||
        h->state_region >= (int32_t)h->n_regions)
        return k3_err(err, K3_ERR_FORMAT, "kv transfer: a malformed UCX offer (%zu bytes) from the prefill instance",
                      n);
    o->addr = b + sizeof *h;
    o->arrays = (const k3_pd_ucx_array *)(o->addr + h->addr_len);
    o->blocks = (const int32_t *)(o->arrays + h->n_arrays);
    for (int32_t i = 0; i < h->n_blocks; i++)
        if (o->blocks[i] < 0)
            return k3_err(err, K3_ERR_FORMAT, "kv transfer: the UCX offer names block %d", o->blocks[i]);
    /* the endpoint to the pull's worker, and its regions */
    K3_TRY(k3_ucx_connect(P->w, o->addr, h->addr_len, "the prefill instance", &P->ep, err));
    P->reg = calloc(h->n_regions ? h->n_regions : 1, sizeof *P->reg);
    if (!P->reg) return k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory");
    size_t at = (size_t)need;
    for (uint32_t i = 0; i < h->n_regions; i++) {
        uint32_t dl = 0;
        if (n - at < sizeof dl) return k3_err(err, K3_ERR_FORMAT, "kv transfer: the UCX offer ends early");
        memcpy(&dl, b + at, sizeof dl);
        at += sizeof dl;
        if (dl > n - at) return k3_err(err, K3_ERR_FORMAT, "kv transfer: the UCX offer ends early");
        K3_TRY(k3_ucx_region_unpack(P->ep, b + at, dl, &P->reg[i], err));
        P->n_reg = (int)i + 1;
        at += dl;
    }
    return K3_OK;
}

/* The source of layer L's array c in the offer: its region and row, checked
 * against this instance's. */
static k3_status source_of(const offer *o, puller *P, int32_t L, int c, int64_t row, const k3_ucx_region **reg,
                           k3_error *err) {
    for (uint32_t i = 0; i < o->h.n_arrays; i++) {
        const k3_pd_ucx_array *a = &o->arrays[i];
        if (a->layer != L || a->comp != c) continue;
        if (a->row != row || a->region < 0 || a->region >= P->n_reg)
            return k3_err(err, K3_ERR_FORMAT,
                          "kv transfer: layer %d's cache array %d is laid out differently on the prefill instance "
                          "(%lld bytes a slot, here %lld)",
                          L, c, (long long)a->row, (long long)row);
        *reg = P->reg[a->region];
        return K3_OK;
    }
    return k3_err(err, K3_ERR_FORMAT, "kv transfer: the UCX offer has no array %d of layer %d", c, L);
}

/* A UCX failure while the prefill instance has gone: a killed process's
 * endpoint fails on its shared memory or with a reset, sometimes before its
 * stream reads closed, so UCX's words alone would not say what happened.
 * When the stream shows the hangup within a moment, the error says that the
 * prefill instance closed the connection, UCX's words after it. */
static void name_gone_peer(int fd, k3_status s, k3_error *err) {
    if (!err || s != K3_ERR_IO || strncmp(err->msg, "ucx:", 4) != 0) return;
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    if (poll(&pf, 1, 500) <= 0) return;
    char c;
    const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0 || (n < 0 && errno != ECONNRESET)) return; /* more on the stream: the peer is there */
    char was[sizeof err->msg];
    snprintf(was, sizeof was, "%s", err->msg);
    k3_err_clear(err);
    k3_err(err, K3_ERR_IO, "kv transfer: the prefill instance closed the connection (%s)", was);
}

k3_status k3_pd_ux_pull(k3_pd_ux *ux, int fd, k3_pd_session *ss, const k3_pull_info *pi, const void *offer_b,
                        size_t offer_len, int64_t max_unit, k3_pd_fault *f, double timeout_s, const atomic_bool *cancel,
                        const atomic_bool *quit, k3_pd_ux_stats *st, k3_error *err) {
    k3_engine *e = ux->e;
    *st = (k3_pd_ux_stats){0};
    puller P = {.ux = ux,
                .e = e,
                .fd = fd,
                .ss = ss,
                .pi = pi,
                .timeout = timeout_s,
                .last = k3_now(),
                .cancel = cancel,
                .quit = quit,
                .st = st};
    k3_kv_pin pin = {0};
    offer o;
    pieces ps = {0};
    bool pinned = false;
    pthread_mutex_init(&P.ck.mu, NULL);
    pthread_cond_init(&P.ck.cv, NULL);
    worker wk = {0};
    k3_status s = worker_take(ux, "k3-decode-pull", &wk, err);
    P.w = wk.w;
    if (!s) s = parse_offer(&P, offer_b, offer_len, &o, err);
    if (!s) s = checker_start(&P, err);
    /* in place: the request's blocks and state, pinned while gets may write them */
    const bool direct = ux->write_direct;
    if (!s && direct) {
        s = k3_engine_pull_pin(e, pi->id, &pin, err);
        pinned = !s;
    }
    st->in_place = direct;
    const int64_t sb = k3_engine_state_bytes(e);
    if (!s && sb > 0 && o.h.state_region < 0)
        s = k3_err(err, K3_ERR_FORMAT, "kv transfer: the UCX offer has no KDA state");
    if (!s && o.h.state_region >= 0 && k3_ucx_region_size(P.reg[o.h.state_region]) != (uint64_t)sb)
        s = k3_err(err, K3_ERR_FORMAT, "kv transfer: the offered KDA state is %llu bytes, here %lld",
                   (unsigned long long)k3_ucx_region_size(P.reg[o.h.state_region]), (long long)sb);
    int64_t next[MAX_LAYERS];
    int32_t n_layers = 0;
    for (int32_t L = 0; L < MAX_LAYERS; L++) {
        next[L] = pi->n_local;
        if (ux->first[L + 1] > ux->first[L]) n_layers = L + 1;
    }
    int64_t state_next = 0, no = 1;
    bool end = false;
    while (!s && !end) {
        s = wait_for(&P, false, err);
        k3_pd_unit u;
        if (!s) s = k3_pd_unit_recv(fd, ss, 2 * (uint64_t)no, &u, err);
        if (s) break;
        P.last = k3_now();
        if (u.kind == K3_PD_END) {
            s = wait_for(&P, true, err);
            if (!s && u.t0 != no)
                s = k3_err(err, K3_ERR_FORMAT, "kv transfer: the end says %lld units, %lld came", (long long)u.t0,
                           (long long)no);
            for (int32_t L = 0; !s && L < n_layers; L++)
                if (ux->first[L + 1] > ux->first[L] && next[L] != pi->n_tokens)
                    s = k3_err(err, K3_ERR_FORMAT, "kv transfer: layer %d ended at position %lld of %lld", L,
                               (long long)next[L], (long long)pi->n_tokens);
            if (!s && state_next != sb)
                s = k3_err(err, K3_ERR_FORMAT, "kv transfer: %lld of the KDA state's %lld bytes came",
                           (long long)state_next, (long long)sb);
            end = true;
            break;
        }
        if (u.kind == K3_PD_ERROR) { /* the prefill side failed: its reason is on the stream */
            char msg[400];
            const size_t n = u.payload_bytes < sizeof msg - 1 ? (size_t)u.payload_bytes : sizeof msg - 1;
            s = k3_pd_recv(fd, msg, n, "an error unit", err);
            if (!s) {
                msg[n] = 0;
                s = k3_pd_tag_ok(&ss->rx, 2 * (uint64_t)no + 1, msg, n, NULL, 0, u.payload_tag) && u.payload_bytes == n
                    ? k3_err(err, K3_ERR_UNSUPPORTED, "%s", msg)
                    : k3_err(err, K3_ERR_FORMAT, "kv transfer: an error unit whose MAC does not match");
            }
            break;
        }
        pend *p = &P.ring[(P.head + P.n_pend) % WINDOW];
        /* a free slot (the checker may be waiting on it: its phase under mu) */
        pthread_mutex_lock(&P.ck.mu);
        *p = (pend){.no = no, .u = u, .phase = GETS};
        pthread_mutex_unlock(&P.ck.mu);
        ps.n = 0;
        if (u.kind == K3_PD_LAYER) {
            const int64_t want = u.layer >= 0 && u.layer < n_layers ? k3_engine_kv_bytes(e, u.layer, u.n) : -1;
            if (want <= 0 || u.t0 != next[u.layer] || u.n < 1 || u.t0 + u.n > pi->n_tokens ||
                (uint64_t)want != u.payload_bytes || (int64_t)u.payload_bytes > 4 * max_unit + 4096) {
                s = k3_err(err, K3_ERR_FORMAT,
                           "kv transfer: an unexpected unit (layer %d, positions %lld+%lld, %llu bytes)", u.layer,
                           (long long)u.t0, (long long)u.n, (unsigned long long)u.payload_bytes);
                break;
            }
            if (!direct && !(p->stage = malloc((size_t)want)))
                s = k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory");
            int64_t off = 0;
            for (int i = ux->first[u.layer]; !s && i < ux->first[u.layer + 1]; i++) {
                const arr *a = &ux->arrs[i];
                const k3_ucx_region *reg = NULL;
                s = source_of(&o, &P, u.layer, a->comp, a->a.row, &reg, err);
                const int before = ps.n;
                if (!s &&
                    !run_pieces(&ps, o.blocks, o.h.block_size, direct ? pin.blocks : NULL, pin.block_size,
                                direct ? (uint8_t *)a->a.base : p->stage + off, a->a.row, u.t0, u.n))
                    s = k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory");
                if (!s && !p->x) s = k3_ucx_xfer_begin(P.ep, &p->x, err);
                for (int k = before; !s && k < ps.n; k++)
                    s = k3_ucx_get(p->x, ps.p[k].dst, direct ? a->m : NULL, ps.p[k].len, reg, ps.p[k].src, err);
                off += u.n * a->a.row;
            }
            if (!s) next[u.layer] += u.n;
        } else if (u.kind == K3_PD_STATE) {
            if (u.t0 != state_next || (uint64_t)u.n != u.payload_bytes || u.n < 1 || state_next + u.n > sb ||
                u.n > 4 * max_unit + 4096) {
                s = k3_err(err, K3_ERR_FORMAT, "kv transfer: an unexpected state piece (bytes %lld+%lld of %lld)",
                           (long long)u.t0, (long long)u.n, (long long)sb);
                break;
            }
            uint8_t *dst = direct ? (uint8_t *)pin.state + u.t0 : (p->stage = malloc((size_t)u.n));
            if (!dst) s = k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory");
            if (!s) add_piece(&ps, (uint64_t)u.t0, dst, (size_t)u.n);
            if (!s) s = k3_ucx_xfer_begin(P.ep, &p->x, err);
            if (!s) s = k3_ucx_get(p->x, dst, NULL, (size_t)u.n, P.reg[o.h.state_region], (uint64_t)u.t0, err);
            if (!s) state_next += u.n;
        } else {
            s = k3_err(err, K3_ERR_FORMAT, "kv transfer: a unit of unexpected kind %u", u.kind);
        }
        if (!s) { /* where it lands: the MAC's pieces */
            p->v = malloc(sizeof *p->v * (size_t)(ps.n ? ps.n : 1));
            if (!p->v) s = k3_err(err, K3_ERR_NOMEM, "kv transfer: out of memory");
            for (int k = 0; !s && k < ps.n; k++) p->v[k] = (struct iovec){ps.p[k].dst, ps.p[k].len};
            p->n_v = ps.n;
        }
        if (s) {
            pend_free(p);
            break;
        }
        P.n_pend++;
        no++;
        st->units++;
        if (u.kind == K3_PD_STATE) st->states += state_next == sb;
        k3_pd_fault_recv(f);
        /* the window full: the oldest lands first */
        for (long spins = 0; !s && P.n_pend == WINDOW;) {
            int done = 0;
            s = settle(&P, &done, err);
            if (!s && !done) {
                s = stopped(&P, err);
                if (!s && !k3_ucx_progress(P.w) && ++spins > 200) {
                    struct timespec ts = {0, 20000};
                    nanosleep(&ts, NULL);
                }
            }
        }
    }
    /* whatever failed: the checker stops, and what is in flight ends now (the
     * endpoint closed by force), before the blocks may be freed */
    checker_stop(&P);
    if (s) name_gone_peer(fd, s, err);
    while (P.n_pend > 0) {
        pend_free(&P.ring[P.head]);
        P.head = (P.head + 1) % WINDOW;
        P.n_pend--;
    }
    /* the answer: the prefill side frees the hold on it */
    {
        k3_pd_unit a = {.kind = s ? K3_PD_ERROR : K3_PD_END, .layer = -1, .t0 = no};
        const k3_status as = k3_pd_unit_send(fd, ss, 1, &a, s ? NULL : err);
        if (!s) s = as;
    }
    for (int i = 0; i < P.n_reg; i++) k3_ucx_region_free(P.reg[i]);
    free(P.reg);
    k3_ucx_ep_close(P.ep, 1.0);
    worker_give(ux, &wk, !s);
    if (pinned) k3_engine_pull_unpin(e, &pin, s ? 0 : P.state_landed);
    free(ps.p);
    pthread_mutex_destroy(&P.ck.mu);
    pthread_cond_destroy(&P.ck.cv);
    return s;
}
