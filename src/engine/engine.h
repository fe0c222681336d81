/*
 * engine.h -- internal views of a k3_engine for tests and benchmarks.
 */
#ifndef K3_ENGINE_ENGINE_H
#define K3_ENGINE_ENGINE_H

#include "k3.h"
#include "kvstore/kvstore.h"

/* Blocks on the free list (reference count 0, cached or not). */
int64_t k3_engine_blocks_free(const k3_engine *e);
/* The block manager is consistent and every reference is held by a
 * request's block table. */
bool k3_engine_check(const k3_engine *e);

/* The hashes of the blocks the prefix cache holds (up to cap into out, in
 * block id order); returns how many there are. */
int64_t k3_engine_cached_hashes(k3_engine *e, uint64_t *out, int64_t cap);

/* The disk tier's side of the engine (disk.c), as of the last step's end:
 * tokens of the prompts it was asked about and loaded (vLLM's
 * external_prefix_cache_queries / _hits), loads by outcome and their time,
 * requests waiting for blocks or loading, saves in flight and the blocks
 * they hold. */
typedef struct k3_disk_stats {
    bool on;
    int64_t ext_queries, ext_hits;
    int64_t loads_landed, loads_failed, loads_cancelled;
    double load_seconds_total;
    int32_t waiting, loading, saving;
    int64_t save_blocks;
    int64_t budget;
    int32_t run_blocks;
    int64_t snaps_ram_only; /* stride snapshots kept in RAM only (the snapshot policy) */
} k3_disk_stats;
/* False (all zero) without a disk tier; m (may be NULL) gets the store's own. */
bool k3_engine_disk_stats(k3_engine *e, k3_disk_stats *out, k3_kvs_metrics *m);

#endif /* K3_ENGINE_ENGINE_H */
