/*
 * format.h -- the files of a cache directory (docs/kvstore.md, "The file
 * format"), shared by the store (store.c) and the directory tools (dir.c).
 *
 *   DIR/runs/KEY.run    a run of cache blocks: header, tokens, checksums, payload
 *   DIR/snaps/KEY.snap  a KDA state snapshot: header, checksum, payload
 *   DIR/tmp/            files being written (published by rename)
 *   DIR/usage           the shared byte counter (mapped by every process)
 *   DIR/lock            flock'ed by the process running an eviction pass
 *
 * KEY is 32 hex digits (the 128-bit chain key). Every number is little
 * endian as it lies in memory (x86-64), like the transfer stream of src/pd.
 */
#ifndef K3_KVSTORE_FORMAT_H
#define K3_KVSTORE_FORMAT_H

#include <stdbool.h>
#include <stdint.h>

#include "k3.h"

/* 3: each block's payload (and a snapshot's) padded to a whole number of
 * K3_KVS_ALIGN, so every block lies on a page of the file (O_DIRECT). A file
 * of another version is refused (a miss), never misread. */
#define K3_KVS_VERSION 3
#define K3_KVS_MAGIC_RUN "K3KVRUN" /* 8 bytes with the NUL */
#define K3_KVS_MAGIC_SNAP "K3KVSNP"
#define K3_KVS_QUANT_LEN 24
#define K3_KVS_ALIGN 4096 /* payloads, and each block in them, start on a page */
#define K3_KVS_MAX_BLOCKS_PER_RUN 64
#define K3_KVS_MAX_TOKENS_PER_RUN (1 << 20)

/* What the bytes depend on besides the tokens and the salt. */
typedef struct k3_kvs_ident {
    uint64_t model;               /* k3_model_identity */
    char quant[K3_KVS_QUANT_LEN]; /* the --quant mode, NUL-padded */
    uint32_t kv;                  /* k3_kv_type */
    int32_t block_size;           /* tokens per block */
    int32_t dcp_rank, dcp_size, dcp_il;
    int32_t run_blocks;  /* blocks per run file */
    int64_t block_bytes; /* a block's payload on this rank */
    int64_t state_bytes; /* a snapshot's payload */
    uint64_t layout;     /* hash of every layer's row sizes */
} k3_kvs_ident;

typedef struct k3_kvs_key {
    uint64_t a, b;
} k3_kvs_key;

typedef struct k3_kvs_hdr {
    char magic[8];
    uint32_t version, hdr_bytes; /* hdr_bytes: this struct and the arrays after it */
    k3_kvs_ident id;
    k3_kvs_key key;      /* run: its last block's chain key; snapshot: the boundary block's */
    k3_kvs_key parent;   /* run: the chain key before its first block */
    int64_t first_block; /* run: its first block's index in the sequence */
    int32_t n_blocks;    /* run: blocks in it; snapshot: 0 */
    int32_t flags;
    int64_t pos;             /* the position it ends at: (first_block + n_blocks) * bs, or the boundary */
    int64_t payload_off;     /* a multiple of K3_KVS_ALIGN */
    int64_t payload_bytes;   /* run: n_blocks * k3_kvs_stride(block_bytes); snapshot: k3_kvs_stride(state_bytes) */
    int64_t created_unix_ns; /* when it was written (for k3 cache ls) */
    int64_t junction;        /* snapshot: the position of the junction snapshot saved beside this
                                prompt-end state (the snapshot policy; 0 = none); run: 0 */
    uint64_t hdr_sum;        /* XXH3-64 of the hdr_bytes with this field 0 */
} k3_kvs_hdr;
/* After the header (run): int32_t tokens[n_blocks * block_size], uint64_t
 * extra[n_blocks], uint64_t ehash[n_blocks] (the engine's 64-bit chain hash
 * of each block, what its KV events name it by; 0 = not given), uint64_t
 * sums[n_blocks] (XXH3-64 of each block's payload); (snapshot): uint64_t
 * sums[1]. Then zeros up to payload_off. A
 * run's payload is block after block, each at a multiple of
 * k3_kvs_stride(block_bytes) (zeros after its bytes); a block is every
 * MLA/DSA layer in order, each array of the layer (ctx.h's transfer layout
 * order) its block_size / dcp_size slots. A snapshot's payload is the state,
 * then zeros to k3_kvs_stride(state_bytes). The checksums cover the bytes,
 * not the zeros. */

/* The header's size with its arrays for n blocks of bs tokens (snapshot: 0 blocks). */
static inline int64_t k3_kvs_hdr_bytes(int32_t n_blocks, int32_t bs, bool snap) {
    return (int64_t)sizeof(k3_kvs_hdr) + (snap ? 8 : (int64_t)n_blocks * bs * 4 + (int64_t)n_blocks * 24);
}
/* A run header's arrays. */
static inline const int32_t *k3_kvs_hdr_tokens(const k3_kvs_hdr *h) { return (const int32_t *)(h + 1); }
static inline const uint64_t *k3_kvs_hdr_extra(const k3_kvs_hdr *h) {
    return (const uint64_t *)(k3_kvs_hdr_tokens(h) + (int64_t)h->n_blocks * h->id.block_size);
}
static inline const uint64_t *k3_kvs_hdr_ehash(const k3_kvs_hdr *h) { return k3_kvs_hdr_extra(h) + h->n_blocks; }
static inline const uint64_t *k3_kvs_hdr_sums(const k3_kvs_hdr *h) {
    return h->n_blocks ? k3_kvs_hdr_ehash(h) + h->n_blocks : (const uint64_t *)(h + 1);
}
/* Bytes a payload of n takes in the file: whole pages. */
static inline int64_t k3_kvs_stride(int64_t n) { return (n + K3_KVS_ALIGN - 1) / K3_KVS_ALIGN * K3_KVS_ALIGN; }
static inline int64_t k3_kvs_payload_off(int64_t hdr_bytes) {
    return (hdr_bytes + K3_KVS_ALIGN - 1) / K3_KVS_ALIGN * K3_KVS_ALIGN;
}

/* Checks a header read from a file of file_bytes bytes: magic, version,
 * checksum, sizes. Returns a K3_KVS_MISS_* reason (K3_KVS_MISS_ABSENT = fine)
 * with a sentence in why. n_read: bytes of h available (the arrays too). */
int k3_kvs_hdr_check(const k3_kvs_hdr *h, int64_t n_read, int64_t file_bytes, bool snap, char *why, size_t why_size);
uint64_t k3_kvs_hdr_sum(const k3_kvs_hdr *h);
/* "model 0123456789abcdef quant none kv f32 block 16 dcp 0/1" */
void k3_kvs_ident_str(const k3_kvs_ident *id, char *buf, size_t size);
/* The first differing field of two identities, or NULL when they agree. */
const char *k3_kvs_ident_diff(const k3_kvs_ident *a, const k3_kvs_ident *b);

/* "0123...ef" (32 hex digits and a NUL). */
void k3_kvs_key_hex(k3_kvs_key k, char out[33]);

/* The shared counter file (DIR/usage). */
typedef struct k3_kvs_usage {
    char magic[8]; /* "K3KVUSE" */
    int64_t bytes; /* files under runs/ and snaps/ (atomic adds) */
    int64_t files;
    int64_t scans; /* eviction passes over the directory */
} k3_kvs_usage;

/* Maps DIR/usage (creating it); NULL with err on failure. */
k3_kvs_usage *k3_kvs_usage_map(const char *dir, k3_error *err);
void k3_kvs_usage_unmap(k3_kvs_usage *u);

/* One pass over runs/ and snaps/ (and tmp/: files older than stale_s are
 * removed) under DIR/lock: the counter is set to what is there, then the
 * least recently used files are removed until at most target bytes remain
 * (target < 0: none). Without wait, a pass another process holds the lock
 * for is skipped (*ran = false). */
typedef struct k3_kvs_evict_result {
    bool ran;
    int64_t bytes_before, files_before, bytes_after, files_after;
    int64_t evicted_files, evicted_bytes, stale_tmp;
} k3_kvs_evict_result;
/* removed (NULL: none) hears of each run file the pass removes, with its
 * header, when that header reads whole (the KV events' BlockRemoved). */
typedef void (*k3_kvs_removed_fn)(void *arg, const k3_kvs_hdr *h);
k3_status k3_kvs_dir_evict(const char *dir, k3_kvs_usage *u, int64_t target, double stale_s, bool wait,
                           k3_kvs_removed_fn removed, void *arg, k3_kvs_evict_result *out, k3_error *err);

#endif /* K3_KVSTORE_FORMAT_H */
