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

/* The observer to give the block manager (k3_kv_set_observer): blocks of
 * block_size tokens whose chain starts at hash_seed (a first block's parent,
 * sent as parent_block_hash nil). Valid until k3_kv_events_close. */
const k3_kv_observer *k3_kv_events_observer(k3_kv_events *ev, int32_t block_size, uint64_t hash_seed);

/* Waits until what is queued now has been published (tests, shutdown). */
void k3_kv_events_flush(k3_kv_events *ev);

#endif /* K3_KVEVENTS_EVENTS_H */
