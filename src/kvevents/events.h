/*
 * events.h -- the KV events' side the engine sets up (the public calls are
 * k3.h's "KV events"): the block manager's observer that feeds a publisher.
 */
#ifndef K3_KVEVENTS_EVENTS_H
#define K3_KVEVENTS_EVENTS_H

#include "k3.h"
#include "kv/kv.h"

/* The medium of the events of the engine's own prefix cache: vLLM's name
 * for the primary tier ("GPU" whatever the device, as vLLM on a CPU says),
 * so routers that only follow that tier see k3's. */
#define K3_KV_EVENTS_MEDIUM "GPU"
/* The disk tier's (src/kvstore): BlockStored when a run of blocks is
 * published in the directory, BlockRemoved when an eviction pass of this
 * instance removes one. vLLM's offloading connectors name their tier the
 * same way (medium "CPU" for its CPU tier). */
#define K3_KV_EVENTS_MEDIUM_DISK "DISK"

/* The observer to give the block manager (k3_kv_set_observer): blocks of
 * block_size tokens whose chain starts at hash_seed (a first block's parent,
 * sent as parent_block_hash nil). Valid until k3_kv_events_close. */
const k3_kv_observer *k3_kv_events_observer(k3_kv_events *ev, int32_t block_size, uint64_t hash_seed);

/* Blocks of another medium than the engine's own (the disk tier's, any
 * thread): stored (with their parent, tokens and extra keys, of the
 * observer's block size) or removed. medium is a string constant. */
void k3_kv_events_blocks(k3_kv_events *ev, const char *medium, bool stored, const uint64_t *hashes, int32_t n,
                         uint64_t parent, bool has_parent, const int32_t *tokens, const uint64_t *extra);

/* Waits until what is queued now has been published (tests, shutdown). */
void k3_kv_events_flush(k3_kv_events *ev);

#endif /* K3_KVEVENTS_EVENTS_H */
