/*
 * xfer.h -- inside the transfer agent (agent.c): the test faults, and the
 * UCX transport (ucx_xfer.c), which moves a hold's rows and KDA state with
 * one-sided gets straight from the prefill instance's cache into the decode
 * instance's blocks, the control messages staying on the authenticated
 * stream (wire.h, auth.h). docs/pd.md ("UCX") has the protocol and the
 * security argument.
 */
#ifndef K3_PD_XFER_H
#define K3_PD_XFER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "k3.h"
#include "pd/auth.h"
#include "pd/wire.h"

/* --kv-fault (tests only): flip a byte of unit U after its MAC, or stall
 * before sending (after receiving) unit U; over UCX (prefill side) an offer
 * forged (a byte of its remote keys flipped after its MAC) or replayed (every
 * pull after the first sent the first one's offer, header and payload as they
 * went on the wire). */
typedef struct k3_pd_fault {
    int kind; /* 0, 'f' flip, 's' stall, 'o' offer forged, 'r' offer replayed */
    int64_t unit, ms;
    atomic_int_fast64_t seen; /* units counted */
    pthread_mutex_t mu;       /* 'r': the offer kept */
    uint8_t *offer;           /* 'r': the first offer's header and payload */
    size_t offer_n;
} k3_pd_fault;
/* A unit about to go: counted; the stall done when it is its turn. True
 * when its payload is to be flipped. */
bool k3_pd_fault_send(k3_pd_fault *f);
/* A unit just received (decode side): counted under a stall, and the stall. */
void k3_pd_fault_recv(k3_pd_fault *f);

/* ---- UCX ------------------------------------------------------------------------------------- */

typedef struct k3_pd_ux k3_pd_ux;

/* A UCX context for the agent of engine e over the transports tls (NULL:
 * UCX's own choice, UCX_TLS), with the cache arrays registered once: for
 * remote reads on a prefill instance (serve), for local writes otherwise.
 * Shared-memory transports have no peer failure detection: a list that
 * names one runs without it (a dead peer is then seen by the deadlines). */
k3_status k3_pd_ux_open(k3_pd_ux **out, k3_engine *e, const char *tls, bool serve, k3_error *err);
void k3_pd_ux_close(k3_pd_ux *ux);
/* "cma,self" ... as the context was asked. */
const char *k3_pd_ux_tls(const k3_pd_ux *ux);
/* Whether this instance can offer its holds in place (registered for remote
 * reads, every position on this rank: no DCP). */
bool k3_pd_ux_can_serve(const k3_pd_ux *ux);

typedef struct k3_pd_ux_stats {
    int64_t bytes, units, states;
    double verify_s; /* decode side: time spent checking the MACs of what landed */
    bool in_place;   /* decode side: into the blocks (else through a unit buffer) */
} k3_pd_ux_stats;

/* Prefill side, for a PULL_UCX of hold `hold` (taken for this connection):
 * the offer (unit 0), then a header and the MAC of the source bytes for each
 * unit of [r->from, r->to) of every MLA/DSA layer and of the KDA state, then
 * END; then waits (progressing the pull's own worker) for the decode side's
 * answer. The hold is pinned throughout; the worker, its endpoints and the
 * state's registration are gone before it returns. *landed: the decode side
 * said every unit landed and checked. */
k3_status k3_pd_ux_serve(k3_pd_ux *ux, int fd, k3_pd_session *ss, uint64_t hold, const k3_pd_req *r, k3_pd_fault *f,
                         double timeout_s, k3_pd_ux_stats *st, bool *landed, k3_error *err);

/* Decode side, after unit 0 of a PULL_UCX was an offer (its header u0 and
 * payload checked): connects to the offered worker, gets each unit where it
 * goes (the request's blocks and state, pinned, when k3_engine_kv_direct;
 * else a unit buffer written through k3_engine_pull_write), checks each
 * unit's MAC on what landed, and answers the prefill side (message 1).
 * timeout_s: nothing landing or arriving that long fails; *cancel (or
 * *quit) turning true ends it. Every get is complete or cancelled when it
 * returns. */
k3_status k3_pd_ux_pull(k3_pd_ux *ux, int fd, k3_pd_session *ss, const k3_pull_info *pi, const void *offer,
                        size_t offer_len, int64_t max_unit, k3_pd_fault *f, double timeout_s, const atomic_bool *cancel,
                        const atomic_bool *quit, k3_pd_ux_stats *st, k3_error *err);

#endif /* K3_PD_XFER_H */
