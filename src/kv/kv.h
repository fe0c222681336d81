/*
 * kv.h -- cache block ownership for the engine: the block manager (fixed-size
 * blocks with reference counts and a free list), the prefix index (full
 * blocks keyed by a hash chained over the token ids) and the KDA state
 * snapshots of the prefix cache. None of this touches cache contents: a block
 * id names the same token slots in every MLA/DSA layer of a k3_ctx (latent
 * and indexer caches, f32 or C8 alike), so the manager only hands out ids.
 *
 * Free list = LRU: a block whose reference count drops to 0 keeps its hash
 * (a later request with the same prefix can take it back) and goes to the
 * tail; a block without a hash goes to the head. Allocation takes the head
 * and, if it still carries a hash, drops it from the index then.
 *
 * Hash: h(block i) = mix(h(block i-1), extra key, the block's token ids);
 * the chain starts from the engine's cache salt. `extra` is 0 for text; a
 * block that holds part of an image carries the image's content hash. The
 * index also keeps each block's parent hash, extra key and token ids, and a
 * lookup compares them: a 64-bit collision cannot give a wrong answer.
 */
#ifndef K3_KV_KV_H
#define K3_KV_KV_H

#include <stdbool.h>
#include <stdint.h>

#include "k3.h"

/* ---- hashing ----------------------------------------------------------- */

uint64_t k3_kv_hash_seed(uint64_t cache_salt, int32_t block_size, int32_t kv_type);
uint64_t k3_kv_hash_block(uint64_t parent, uint64_t extra, const int32_t *tokens, int32_t n);

/* ---- block manager + prefix index --------------------------------------- */

typedef struct k3_kv_blocks {
    int32_t n_blocks, block_size;
    int32_t *ref;               /* [n] reference counts */
    int32_t *prev, *next;       /* [n] free-list links (-1 = none) */
    bool *in_free;              /* [n] on the free list */
    int32_t head, tail, n_free; /* the free list (LRU: evict from the head) */
    /* prefix index: a chained hash table over hashed blocks */
    bool *hashed;                    /* [n] */
    uint64_t *hash, *parent, *extra; /* [n] */
    int32_t *tokens;                 /* [n * block_size] a hashed block's ids */
    int32_t *bucket;                 /* [n_buckets] first block, -1 = empty */
    int32_t *chain;                  /* [n] next block in the same bucket */
    uint32_t bucket_mask;
    int64_t n_hashed, n_evicted;      /* hashed blocks; hashes dropped on reuse */
    struct k3_kv_track *track;        /* residency metrics, NULL = off */
    const struct k3_kv_observer *obs; /* told of every hash in and out, NULL = none */
} k3_kv_blocks;

/* Who hears of the prefix index's changes (the KV events, src/kvevents):
 * stored when k3_kv_register indexes a block (its hash, its parent's, the
 * extra key and the ids), removed when k3_kv_alloc drops a cached block's
 * hash to reuse it. Called on the thread that changes the index (the
 * engine's), inside those calls: it must only queue. */
typedef struct k3_kv_observer {
    void (*stored)(void *arg, uint64_t hash, uint64_t parent, uint64_t extra, const int32_t *tokens, int32_t n);
    void (*removed)(void *arg, uint64_t hash);
    void *arg;
} k3_kv_observer;
/* Sets (or with NULL clears) the observer; obs must outlive its use. */
static inline void k3_kv_set_observer(k3_kv_blocks *bm, const k3_kv_observer *obs) { bm->obs = obs; }

k3_status k3_kv_blocks_init(k3_kv_blocks *bm, int32_t n_blocks, int32_t block_size, k3_error *err);
void k3_kv_blocks_free(k3_kv_blocks *bm);
/* A fresh block (reference count 1, no hash), or -1 when none is free. */
int32_t k3_kv_alloc(k3_kv_blocks *bm);
/* Takes another reference (a prefix hit on a cached block, possibly free). */
void k3_kv_ref(k3_kv_blocks *bm, int32_t b);
/* Drops a reference; at 0 the block goes to the free list (tail if hashed). */
void k3_kv_unref(k3_kv_blocks *bm, int32_t b);
/* Blocks that are held by someone (reference count > 0). */
static inline int32_t k3_kv_used(const k3_kv_blocks *bm) { return bm->n_blocks - bm->n_free; }
/* The cached block holding exactly (parent, extra, tokens), or -1. */
int32_t k3_kv_lookup(const k3_kv_blocks *bm, uint64_t hash, uint64_t parent, uint64_t extra, const int32_t *tokens);
/* Registers full block b under its hash (no-op if that content is already
 * cached in another block, or b already has a hash). */
void k3_kv_register(k3_kv_blocks *bm, int32_t b, uint64_t hash, uint64_t parent, uint64_t extra, const int32_t *tokens);
/* Residency metrics (k3_kv_residency, vLLM's semantics): k3_kv_alloc of a
 * followed block observes its lifetime, idle time and reuse gaps first (it
 * is evicted: taken for other tokens), then follows the new block with
 * probability sample_rate; k3_kv_ref of a followed block records an access.
 * now_ns is the clock (CLOCK_MONOTONIC; tests give their own with
 * k3_kv_track_set_clock). rate 0 turns it off. */
k3_status k3_kv_track_enable(k3_kv_blocks *bm, double sample_rate, uint64_t seed, k3_error *err);
void k3_kv_track_set_clock(k3_kv_blocks *bm, int64_t (*now_ns)(void *), void *arg);
/* The histograms so far (out->enabled = false when off). */
void k3_kv_track_get(const k3_kv_blocks *bm, k3_kv_residency *out);

/* Consistency check for tests: free list, counts and index agree. */
bool k3_kv_check(const k3_kv_blocks *bm);

/* ---- KDA state snapshots -------------------------------------------------
 * A snapshot is a copy of every KDA layer's recurrent S and conv window of
 * one sequence slot at a block boundary, keyed by the chain hash of the
 * block that ends there (which names the whole prefix). Held under their own
 * byte budget with their own LRU; taking one over budget evicts the least
 * recently used. A hit whose snapshot was evicted becomes a shorter hit. */

typedef struct k3_kv_snaps {
    int64_t bytes_each;   /* k3_ctx_state_bytes */
    int32_t cap;          /* snapshots that fit the budget */
    int32_t n;            /* held */
    uint64_t *key;        /* [cap] */
    int64_t *pos;         /* [cap] the boundary position (check) */
    void **data;          /* [cap] bytes_each each, allocated on first use */
    int32_t *pins;        /* [cap] readers outside the engine's thread (a disk save) */
    int32_t *prev, *next; /* LRU over held entries; head = oldest */
    int32_t head, tail;
    int32_t *bucket, *chain; /* key -> entry */
    uint32_t bucket_mask;
    int32_t *free_list, n_free_slots;
    int64_t n_taken, n_evicted, n_restored;
} k3_kv_snaps;

k3_status k3_kv_snaps_init(k3_kv_snaps *sn, int64_t bytes_each, int64_t budget, k3_error *err);
void k3_kv_snaps_free(k3_kv_snaps *sn);
/* The snapshot for key at pos (touches its LRU place), or NULL. */
const void *k3_kv_snap_find(k3_kv_snaps *sn, uint64_t key, int64_t pos);
/* Same, without touching the LRU. */
bool k3_kv_snap_has(const k3_kv_snaps *sn, uint64_t key, int64_t pos);
/* A buffer to write the snapshot for key into (evicting the LRU one when
 * full), or NULL when the budget holds none or memory is out. An existing
 * snapshot for key is returned for overwrite. */
void *k3_kv_snap_put(k3_kv_snaps *sn, uint64_t key, int64_t pos);
/* The same without a copy: the snapshot for key at pos takes the buffer *buf
 * (bytes_each, malloc'd; the store frees it) as it is, and *buf becomes the
 * entry's previous buffer (the caller's now: NULL, or one to reuse or free).
 * False (nothing changed) where a put would have returned NULL. */
bool k3_kv_snap_adopt(k3_kv_snaps *sn, uint64_t key, int64_t pos, void **buf);
/* Forgets the snapshot for key at pos, if held and not pinned (one whose
 * content was never written: its forward pass failed). */
void k3_kv_snap_drop(k3_kv_snaps *sn, uint64_t key, int64_t pos);
/* Pins the snapshot for key at pos while another thread reads it (a disk
 * tier's save): until unpinned it is neither evicted nor overwritten (a put
 * of its key returns NULL). Its buffer, or NULL when not held. */
const void *k3_kv_snap_pin(k3_kv_snaps *sn, uint64_t key, int64_t pos);
void k3_kv_snap_unpin(k3_kv_snaps *sn, uint64_t key, int64_t pos);
/* Snapshots pinned now (checks). */
int32_t k3_kv_snap_pinned(const k3_kv_snaps *sn);
static inline int64_t k3_kv_snap_bytes(const k3_kv_snaps *sn) { return (int64_t)sn->n * sn->bytes_each; }

#endif /* K3_KV_KV_H */
