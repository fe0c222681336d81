/*
 * kvstore.h -- the disk tier of the prefix cache: runs of cache blocks (every
 * MLA/DSA layer's latent and indexer rows, f32 or C8, as they lie in a
 * k3_ctx) and KDA state snapshots, in files under one directory that several
 * processes may share, found again after a restart (docs/kvstore.md).
 *
 * What the engine's connector seam calls (all from its stepping thread;
 * nothing here blocks on the disk but k3_kvs_lookup's header reads):
 *
 *   k3_kvs_lookup     how many tokens beyond the local hit the directory can
 *                     supply for a token sequence (blocks AND a KDA snapshot
 *                     at the end of them); the files it found stay open in
 *                     the hit, so an eviction in between cannot take them
 *   k3_kvs_load       reads a hit into given cache blocks and a state buffer
 *                     on the reader thread; a ticket completes it
 *   k3_kvs_save_blocks, k3_kvs_save_snapshot
 *                     writes completed blocks / a snapshot on the writer
 *                     thread, straight from the context's blocks (the caller
 *                     keeps them, and the state buffer, until the ticket
 *                     completes: the RAM copy stays usable meanwhile)
 *   k3_kvs_poll       the tickets done since the last call (status, bytes,
 *                     seconds, why it failed)
 *   k3_kvs_cancel     a request freed while its load is queued or running:
 *                     it stops writing into its blocks; its ticket still
 *                     completes (then the blocks may be reused)
 *
 * Keys: a 128-bit chain over the blocks' token ids (two lanes of
 * k3_kv_hash_block, src/kv/blocks.c's chain, from two seeds) starting from
 * the namespace (format version, model identity, quant mode, cache dtype,
 * block size, DCP rank, size and interleave, the rows' layout) and the
 * request's cache salt, so a file is found only by the same model, mode,
 * layout and tenant, for the same tokens. A run file is named by the key of
 * its last block, a snapshot by the key of the block it ends.
 *
 * Safety: every file is written under a temporary name and published with
 * rename(RENAME_NOREPLACE) (two writers of one key: the second finds it
 * there and drops its copy); its header says what wrote it and carries the
 * tokens, and every block's payload has a checksum (XXH3) verified as it is
 * read. A crash, a torn file, a full disk, a foreign file or another model's
 * file is a miss whose reason goes to the log callback and the counters,
 * never a wrong token. The directory's size is one shared counter (a mapped
 * file, atomic adds); a process over its budget takes the directory's lock
 * and evicts by last use (mtime, touched on every load) down to 90% of it.
 */
#ifndef K3_KVSTORE_KVSTORE_H
#define K3_KVSTORE_KVSTORE_H

#include <stdbool.h>
#include <stdint.h>

#include "k3.h"

typedef struct k3_kvs k3_kvs;
typedef struct k3_kvs_hit k3_kvs_hit;

/* Blocks that entered the directory (a run this process published) or left
 * it (a run an eviction pass of this process removed), named by the
 * engine's 64-bit chain hashes (what its KV events call them; the disk
 * tier's medium). Published: the tokens and extra keys, and the parent
 * hash when the run does not start the chain. */
typedef struct k3_kvs_blocks_event {
    bool stored;
    const uint64_t *hashes; /* [n] */
    int32_t n;
    uint64_t parent;
    bool has_parent;
    const int32_t *tokens; /* stored: [n * block_size] */
    const uint64_t *extra; /* stored: [n] */
} k3_kvs_blocks_event;

typedef struct k3_kvs_options {
    const char *dir;      /* created if missing (with runs/, snaps/, tmp/) */
    int64_t disk_bytes;   /* this process's budget for the directory (> 0) */
    k3_ctx *ctx;          /* whose cache blocks are read and written (borrowed) */
    uint64_t model_id;    /* k3_model_identity */
    const char *quant;    /* the --quant mode the weights run in ("none", ...) */
    int32_t queue_max;    /* jobs waiting per thread (0 = 256): past it a save is
                              dropped (counted), a load refused (K3_ERR_BUSY) */
    int32_t run_blocks;   /* blocks per run file (0 = about 16 MiB of them, a
                              power of two <= 64); part of the namespace */
    bool fsync;           /* fsync each file before publishing it (durability
                              after a power loss; the checksums alone already
                              turn a lost write into a miss) */
    bool no_threads;      /* tests: jobs run inside k3_kvs_poll / k3_kvs_wait */
    bool buffered;        /* never O_DIRECT (else used where the filesystem
                              does it: k3_kvs_io says which) */
    bool buffered_writes; /* saves through the page cache, loads O_DIRECT
                              (the device's writes then happen at writeback,
                              not while the save runs) */
    /* A line about a miss, a failed save or an eviction (any thread; NULL =
     * none). The library never prints: the program decides. */
    void (*log)(void *arg, const char *line);
    void *log_arg;
    /* A job completed (its thread; NULL = none): the engine wakes to poll. */
    void (*on_done)(void *arg);
    /* Blocks entered or left the directory (any thread; NULL = none). */
    void (*on_blocks)(void *arg, const k3_kvs_blocks_event *ev);
    void *cb_arg;
} k3_kvs_options;

k3_status k3_kvs_open(k3_kvs **out, const k3_kvs_options *opt, k3_error *err);
/* Finishes the queued saves (loads are cancelled), joins the threads. */
void k3_kvs_close(k3_kvs *s);

/* Tokens per block; blocks per run file (fixed by the namespace: all the
 * processes of one directory and model agree on it); a block's bytes on this
 * rank; a snapshot's bytes. */
int32_t k3_kvs_block_size(const k3_kvs *s);
int32_t k3_kvs_run_blocks(const k3_kvs *s);
int64_t k3_kvs_block_bytes(const k3_kvs *s);
int64_t k3_kvs_state_bytes(const k3_kvs *s);
/* How the payloads move: "direct" (O_DIRECT) or "buffered"; why names the
 * reason (the alignments, or what refused it). */
const char *k3_kvs_io(const k3_kvs *s, const char **why);

/* A token sequence as the engine holds it. */
typedef struct k3_kvs_seq {
    const int32_t *tokens; /* [n_tokens] */
    int64_t n_tokens;
    const uint64_t *extra;  /* NULL, or one extra key per full block (the
                              engine's per-block keys: images' content hashes) */
    uint64_t salt;          /* the request's cache_salt (0 = none) */
    const uint64_t *hashes; /* NULL, or the engine's chain hash of each full
                               block (saves: kept in the run files, for the
                               KV events) */
} k3_kvs_seq;

/* The longest hit beyond n_local tokens (a block multiple the caller
 * already holds): the largest block boundary B * block_size <= n_max with
 * every block in [n_local / bs, B) in a run file and a KDA snapshot at B.
 * *out = NULL (and K3_OK) when there is none; files that were found but
 * refused (foreign, another model's, torn) are counted and logged with their
 * reason. The hit keeps its files open; give it to k3_kvs_load or free it. */
k3_status k3_kvs_lookup(k3_kvs *s, const k3_kvs_seq *seq, int64_t n_local, int64_t n_max, k3_kvs_hit **out,
                        k3_error *err);
/* Tokens from position 0 the hit reaches (a block multiple). */
int64_t k3_kvs_hit_tokens(const k3_kvs_hit *h);
/* The junction its snapshot's saver named (k3_kvs_save_snapshot), or 0. */
int64_t k3_kvs_hit_junction(const k3_kvs_hit *h);
/* How far the sequence's blocks lie on disk from the hit's start (a block
 * multiple >= k3_kvs_hit_tokens, below the lookup's n_max): beyond the hit
 * they have no snapshot, so the prompt leaves the chain on disk there (the
 * junction of a request admitted with this hit). */
int64_t k3_kvs_hit_chain_tokens(const k3_kvs_hit *h);
void k3_kvs_hit_free(k3_kvs_hit *h);

/* Reads hit (taken, freed by the store) into blocks (the sequence's block
 * table: entries [n_local / bs, hit tokens / bs) are written) and the
 * snapshot into state (k3_kvs_state_bytes). Both must stay valid until the
 * ticket completes. A failed load (a checksum, a short read) leaves those
 * blocks with garbage: do not register them; the snapshot state likewise. */
k3_status k3_kvs_load(k3_kvs *s, k3_kvs_hit *hit, const int32_t *blocks, void *state, uint64_t *ticket, k3_error *err);

/* Saves blocks [0, n_full) of seq (blocks[i] holds block i; n_full *
 * block_size <= seq->n_tokens): every whole run not in the directory yet,
 * and with final (the request ends, or will not grow in this run) the
 * partial run at the end too. Call it when a run completes and once at the
 * end; what is on disk already is skipped. A longer run of a group removes
 * the shorter ones, except the one that ends at keep (> 0: a junction, a
 * block multiple; written too when missing), so a prompt that leaves the
 * chain there finds its blocks. The blocks must stay unchanged until the
 * ticket completes (*ticket = 0: nothing was queued). */
k3_status k3_kvs_save_blocks(k3_kvs *s, const k3_kvs_seq *seq, const int32_t *blocks, int32_t n_full, bool final,
                             int64_t keep, uint64_t *ticket, k3_error *err);
/* Saves the KDA state at position pos (a block multiple, >= block_size) of
 * seq, read from state until the ticket completes. drop_pos > 0 names an
 * older snapshot of the same chain that this one supersedes: it is removed
 * once this one is published (docs/kvstore.md, the snapshot policy).
 * junction > 0: the position of the junction snapshot saved beside this one
 * (a prompt's end), kept in its header: a hit on it says so
 * (k3_kvs_hit_junction), after a restart too. */
k3_status k3_kvs_save_snapshot(k3_kvs *s, const k3_kvs_seq *seq, int64_t pos, const void *state, int64_t drop_pos,
                               int64_t junction, uint64_t *ticket, k3_error *err);

typedef enum k3_kvs_op { K3_KVS_LOAD = 1, K3_KVS_SAVE_BLOCKS, K3_KVS_SAVE_SNAPSHOT } k3_kvs_op;

typedef struct k3_kvs_done {
    uint64_t ticket;
    k3_kvs_op op;
    k3_status status; /* K3_OK, or the failure (why says it) */
    bool cancelled;   /* a load cancelled before it finished */
    int64_t bytes;    /* payload bytes read or written */
    int32_t files;    /* files read or written */
    double seconds;   /* from the job's start to its end */
    char why[256];
} k3_kvs_done;

/* The jobs finished since the last call, at most max; returns how many. */
int32_t k3_kvs_poll(k3_kvs *s, k3_kvs_done *out, int32_t max);
/* Waits for ticket (taking it out of what k3_kvs_poll would return). */
k3_status k3_kvs_wait(k3_kvs *s, uint64_t ticket, k3_kvs_done *out, k3_error *err);
/* Asks a load to stop writing into its blocks (no-op for other tickets). */
void k3_kvs_cancel(k3_kvs *s, uint64_t ticket);

/* ---- metrics ------------------------------------------------------------
 * What the seam exports (docs/kvstore.md, "Metrics", for the names). */
enum {
    K3_KVS_MISS_ABSENT = 0, /* no file for the key (not counted as a refusal) */
    K3_KVS_MISS_FOREIGN,    /* not a k3 cache file, or another format version */
    K3_KVS_MISS_MODEL,      /* another model, quant mode, dtype, layout or DCP rank */
    K3_KVS_MISS_TORN,       /* shorter than its header says, header checksum */
    K3_KVS_MISS_TOKENS,     /* the header's tokens or chain differ (a collision) */
    K3_KVS_MISS_CHECKSUM,   /* a block's payload checksum (at load) */
    K3_KVS_MISS_IO,         /* a read that failed */
    K3_KVS_MISS_REASONS
};
extern const char *const k3_kvs_miss_names[K3_KVS_MISS_REASONS];

#define K3_KVS_HIST_BUCKETS 14
extern const double k3_kvs_hist_le[K3_KVS_HIST_BUCKETS]; /* seconds: 1 ms ... 60 s */
/* bytes of one load or save: vLLM's kv_offload_load_size / _store_size buckets (1 MB ... 200 MB) */
extern const double k3_kvs_size_le[K3_KVS_HIST_BUCKETS];

typedef struct k3_kvs_hist {
    uint64_t count[K3_KVS_HIST_BUCKETS + 1]; /* per bucket (not cumulative); last = +Inf */
    double sum;
    uint64_t n;
} k3_kvs_hist;

typedef struct k3_kvs_metrics {
    int64_t lookups, lookup_hits;                    /* lookups, those that found a hit */
    int64_t query_tokens, hit_tokens;                /* tokens asked beyond the local hit, supplied */
    int64_t loads, loads_failed;                     /* load jobs, failed or cancelled ones */
    int64_t saves, saves_failed;                     /* save jobs, failed ones (disk full, I/O) */
    int64_t saves_dropped;                           /* saves refused with a full queue */
    int64_t runs_written, snaps_written;             /* files published */
    int64_t blocks_stored, blocks_removed;           /* blocks (with engine hashes) in runs published, and in
                                                        runs an eviction pass of this process removed */
    int64_t files_present;                           /* writes skipped: the key was there (or won by another writer) */
    int64_t bytes_written, bytes_read;               /* payload bytes */
    bool direct;                                     /* payloads move with O_DIRECT (else through the page cache) */
    int64_t bytes_bounced;                           /* of those moved with O_DIRECT: through a bounce buffer
                                                        (pieces not aligned in memory or in the file) */
    double write_seconds, read_seconds;              /* time in the writer / reader jobs */
    int64_t misses[K3_KVS_MISS_REASONS];             /* refused files by reason */
    int64_t evictions, evicted_files, evicted_bytes; /* passes this process ran */
    int64_t dir_bytes;                               /* the directory's size (shared counter) */
    int64_t budget;                                  /* this process's budget */
    k3_kvs_hist load_seconds, save_seconds;
    k3_kvs_hist load_size, save_size; /* k3_kvs_size_le: bytes of each load, each save that wrote */
} k3_kvs_metrics;

void k3_kvs_get_metrics(k3_kvs *s, k3_kvs_metrics *out);

/* Runs an eviction pass now if the directory is over target bytes (tests;
 * the writer runs one itself when a write would pass the budget). */
k3_status k3_kvs_evict(k3_kvs *s, int64_t target, k3_error *err);

/* The path of the file that holds the run ending at block end_block (its
 * last block is end_block - 1) or the snapshot at that boundary, for seq:
 * tests plant and damage files with it. */
void k3_kvs_path(const k3_kvs *s, const k3_kvs_seq *seq, int64_t end_block, bool snap, char *buf, size_t size);

#endif /* K3_KVSTORE_KVSTORE_H */
