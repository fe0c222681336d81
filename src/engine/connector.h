/*
 * connector.h -- the KV connector seam: where an external source or sink of
 * cache blocks and KDA states plugs into the engine's step, in the shape of
 * vLLM's KVConnectorBase_V1. The step knows connectors only through these
 * calls, made at its phase boundaries (src/engine/step.c); prefill/decode
 * disaggregation is one connector (pd.c), the disk tier of latent blocks
 * and KDA snapshots (disk.c, over src/kvstore) another.
 *
 * vLLM's scheduler side and worker side run in one thread here, so the
 * calls are in step order:
 *
 *   arrive            a request was submitted (hashed, not yet queued). The
 *                     connector may take it: its prompt's cache, or the part
 *                     of it beyond the local prefix hit
 *                     (k3_sched_local_hit), comes from the connector's
 *                     source (vLLM: get_num_new_matched_tokens with
 *                     load_async), and the connector queues it once loaded
 *                     (k3_sched_add_landed). A request the connector leaves
 *                     goes to the scheduler.
 *   cancel            a request is cancelled: true when the connector holds it
 *                     and ends it itself (when its load has stopped).
 *   before_schedule   the requests the connector holds get their blocks from
 *                     the block manager and it starts loading into them
 *                     (vLLM: update_state_after_alloc, start_load_kv).
 *   before_run        the plan is set: the KDA states the connector saves are
 *                     asked as captures of this pass (k3_ctx_capture_state at
 *                     a position; vLLM: save_kv_layer).
 *   after_run         the pass ran (ok) or failed: captures taken or not.
 *   snapshot_taken    the pass took a KDA snapshot of the prefix cache for
 *                     a request (its key and position; the state is in the
 *                     snapshot store, k3_kv_snap_pin keeps it while another
 *                     thread reads it; vLLM: save_kv_layer, wait_for_save).
 *   registered        the step's tokens filled blocks of a request that the
 *                     prefix cache registered (rq.n_registered grew from
 *                     `before`): full blocks, immutable from now on.
 *   after_step        the step's tokens are out: loads that completed land
 *                     and enter the scheduler (vLLM: get_finished, finished
 *                     receiving); saves that completed give their blocks back
 *                     (finished sending).
 *   request_finished  a request ended (why): the connector may keep its
 *                     blocks past the end, taking a reference on each (vLLM:
 *                     request_finished's delay_free_blocks).
 *   begin             the start of a step: what the connector kept and no
 *                     longer needs goes back (a hold released or timed out).
 *
 * and for the engine's bookkeeping: has_work (the engine should step:
 * something completed), blocks_held (blocks the connector references, for
 * k3_engine_check), stats (into k3_engine_stats), output (its part of a
 * request's output), close.
 *
 * The calls run on the stepping thread; a connector's own
 * threads reach the engine through its API (pd.c: k3_engine_pull_write ...),
 * under the engine's mutex and, for the cache, its executor lock.
 */
#ifndef K3_ENGINE_CONNECTOR_H
#define K3_ENGINE_CONNECTOR_H

#include <stdbool.h>
#include <stdint.h>

#include "k3.h"

#define K3_MAX_CONNECTORS 4

struct req;

typedef struct k3_kv_connector {
    const char *name;
    void *self;
    void (*begin)(void *self, double t);
    bool (*arrive)(void *self, struct req *r);
    bool (*cancel)(void *self, struct req *r, double t);
    void (*before_schedule)(void *self, double t);
    void (*before_run)(void *self);
    void (*after_run)(void *self, bool ok);
    void (*snapshot_taken)(void *self, struct req *r, int64_t pos, uint64_t key);
    void (*registered)(void *self, struct req *r, int32_t before);
    void (*after_step)(void *self, double t);
    void (*request_finished)(void *self, struct req *r, k3_finish_reason why, double t);
    bool (*has_work)(void *self, double t);
    int64_t (*blocks_held)(void *self);
    void (*stats)(void *self, k3_engine_stats *st);
    void (*output)(void *self, const struct req *r, k3_req_output *o);
    void (*close)(void *self);
} k3_kv_connector;

#endif /* K3_ENGINE_CONNECTOR_H */
