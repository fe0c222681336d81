/*
 * pd.h -- prefill and decode apart: what the server asks of the transfer
 * agent (agent.c; the agent itself is k3_pd of k3.h). The prefill side's
 * answer names its hold in vLLM's kv_transfer_params; the decode side turns
 * such params into a pull (k3_pd_pull), the ctx of the engine request's
 * k3_remote_prefill, which the agent fills when the engine's pull hook
 * starts it. docs/pd.md has the fields and the protocol.
 */
#ifndef K3_PD_PD_H
#define K3_PD_PD_H

#include <jansson.h>

#include "common/buf.h"
#include "k3.h"
#include "pd/auth.h"

/* One request's pull (decode side): where its prompt's cache is, and, once
 * the agent is done with it, what moved. Shared by the job that made it and
 * the agent (two references). */
typedef struct k3_pd_pull k3_pd_pull;

/* What the job reads after its request finished. */
typedef struct k3_pd_pull_stats {
    bool ended, ok;
    int64_t bytes; /* payload bytes received (rows and state) */
    int64_t units, tokens, layers, states, blocks;
    double seconds;            /* connect to the last byte */
    double queue_s, prefill_s; /* the prefill instance's, from its params */
    bool ucx;                  /* the rows came by UCX gets (else on the stream) */
    double verify_s;           /* UCX: time checking the MACs of what landed */
} k3_pd_pull_stats;

/* The refusal of a request that cannot be disaggregated (several prompts or
 * choices): the proxy sends such a request whole to a decode instance. */
#define K3_PD_NOT_SPLIT "kv_transfer_params: a disaggregated request has one prompt and n = 1"

/* kv_transfer_params of a request: which way it asks (neither: NULL or
 * empty, or both false). */
bool k3_pd_wants_remote_decode(json_t *params);
bool k3_pd_wants_remote_prefill(json_t *params);

/* Prefill side: the kv_transfer_params of the answer for hold `hold` (the
 * engine request id) of prompt ids [n], whose first generated token was
 * first (with its logprob and n_top alternatives when asked for). NULL with
 * err when the hold is gone. */
json_t *k3_pd_prefill_params(k3_pd *pd, uint64_t hold, const int32_t *prompt, int64_t n, int32_t first, float logprob,
                             const k3_logprob *top, int n_top, k3_error *err);

/* Decode side: a pull for the prompt ids [n] from the params a prefill
 * instance answered. They are taken only with the proxy's credential
 * (credential: the request's K3_PD_CREDENTIAL_HEADER, or NULL) or for a
 * peer of --prefill-peers (else K3_ERR_PERM, and nothing is connected to);
 * then checked: the token count and the prompt's hash must be this
 * instance's, the host, port and hold's token named. *rp is filled for the
 * engine request (rp->ctx = the pull; rp->first_top points into the pull).
 * NULL with err (K3_ERR_ARG, K3_ERR_PERM) otherwise. Two references: the
 * job's and the agent's. */
k3_pd_pull *k3_pd_pull_new(k3_pd *pd, json_t *params, const char *credential, const int32_t *prompt, int64_t n,
                           k3_remote_prefill *rp, k3_error *err);
/* A request that will not pull the hold its params name: released on the
 * prefill instance (in the background), when the params are trusted as for
 * k3_pd_pull_new; else nothing is done. */
void k3_pd_release_named(k3_pd *pd, json_t *params, const char *credential);
/* The request could not be submitted: the hold is released on the prefill
 * side (in the background) and the agent's reference dropped. */
void k3_pd_pull_abandon(k3_pd *pd, k3_pd_pull *p);
void k3_pd_pull_stats_get(k3_pd *pd, const k3_pd_pull *p, k3_pd_pull_stats *out);
void k3_pd_pull_unref(k3_pd *pd, k3_pd_pull *p);
/* The per-request figures of a finished pull as a JSON object (for the answer). */
json_t *k3_pd_pull_json(const k3_pd_pull_stats *s);

/* A hold released on its prefill instance by anyone with the deployment's
 * keys (the proxy, when no decode instance took its request). */
k3_status k3_pd_release_hold(const k3_pd_keys *k, const char *host, int port, const uint8_t token[K3_PD_TOKEN_BYTES],
                             const uint8_t hash[K3_PD_HASH_BYTES], double timeout_s, k3_error *err);

/* The transfer counters and gauges of /metrics (k3:kv_transfer_* ...). */
void k3_pd_metrics_render(k3_pd *pd, const char *model_name, k3_buf *o);

#endif /* K3_PD_PD_H */
