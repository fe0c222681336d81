/*
 * sched.h -- the scheduler of the engine (vLLM V1 semantics) and the request
 * state it works on.
 *
 * A step has a token budget (max_num_batched_tokens) and at most max_seqs
 * running requests (a running request holds one sequence slot of the
 * context). Running requests are scheduled first, in the order they were
 * admitted: a decode takes 1 token, a partial prefill its next chunk; then
 * waiting requests are admitted in arrival order while the budget, the slots
 * and the free blocks last (and, while requests decode, the step cost guard
 * of k3_sched_config). A chunk that does not finish the request's prefill
 * ends on the block grid (unless the guard holds it inside a block). A
 * chunk may cross KDA snapshot points: the forward pass captures the KDA
 * state at each of them (k3_sched_snap_points lists them, the context's
 * k3_ctx_capture_state takes them), so a short prompt is one forward pass
 * however many snapshots it leaves behind. When a running request needs a block and none
 * is free, the newest running request is preempted by recompute: its blocks
 * are released (their hashes stay in the prefix cache), it goes back to the
 * front of the queue and later recomputes its prompt and the tokens it had
 * generated; its sampler is kept, so it goes on with the same tokens. No
 * request is admitted in a step that preempted. A decode with drafts
 * (n_draft) is a verify chunk of 1 + n_draft tokens: its drafts are cut to
 * the budget left and to the free blocks before anyone is preempted for them.
 *
 * Prefix cache (at admission): the longest run of the request's full blocks
 * found in the index, cut back to the last boundary that also has a KDA
 * snapshot (and to leave at least one token to compute). The blocks are
 * shared (reference counts), the snapshot restores the slot's KDA state. If
 * the attention blocks match further than the snapshot, that boundary (the
 * junction where this prompt leaves a cached one) becomes a snapshot point
 * of this request, so the next request with the same prefix hits all of it.
 * A waiting request whose next block is being computed right now by a
 * running request (same hash) waits for it instead of computing it twice.
 */
#ifndef K3_SCHED_SCHED_H
#define K3_SCHED_SCHED_H

#include "k3.h"
#include "kv/kv.h"

/* K3_RQ_REMOTE: its prompt's blocks are held while their contents come from
 * a prefill instance (the engine keeps it; the scheduler does not see it). */
typedef enum { K3_RQ_WAITING = 0, K3_RQ_RUNNING, K3_RQ_DONE, K3_RQ_REMOTE } k3_rq_state;

typedef struct k3_rq {
    uint64_t id;
    k3_rq_state state;
    /* tokens: the prompt, then what was generated */
    int32_t *tok;
    int64_t n_tok, cap_tok, n_prompt;
    int64_t n_computed;  /* tokens in the cache (the slot's position) */
    int64_t prefill_end; /* n_tok when it was (re)admitted */
    int32_t slot;        /* -1 unless running */
    int32_t *blocks;     /* [max_blocks] block table */
    int32_t n_blocks;
    uint64_t *hash;               /* [max_blocks] chain hash of each full block of tok */
    uint64_t *extra;              /* [max_blocks] each block's extra key */
    const uint64_t *tok_extra;    /* [n_prompt] per-token extra keys, or NULL (all 0) */
    int32_t n_hash, n_registered; /* hashed; registered in the index */
    int64_t junction;             /* extra snapshot point (0 = none) */
    bool read_cache;              /* may take prefix hits */
    uint64_t salt;                /* the request's cache salt (0 = none): its first block's key */
    bool plp;                     /* wants prompt logprobs: chunks capped */
    int64_t n_cached;             /* prompt tokens served by the cache (first admission) */
    bool admitted_once;
    /* this step */
    int32_t n_draft;          /* a decode's draft tokens after its last (at tok[n_tok ..]): it is
                                 scheduled as a verify chunk of 1 + n_draft, and the schedule may
                                 cut them (the budget, the free blocks) */
    int32_t n_sched;          /* tokens scheduled */
    bool is_new;              /* admitted by this step: set the slot up */
    const void *restore;      /* snapshot to restore into the slot, NULL = zero state */
    const void *landed_state; /* a waiting request that holds blocks (its prompt came
                                     from a prefill instance): the KDA state to admit it with */
    int64_t landed_junction;  /* and where its prompt leaves the chain its source holds beyond
                                 that state (the junction it is admitted with; 0 = none) */
    uint32_t events;          /* K3_EV_* since the last step */
    void *owner;              /* the engine's part of the request */
} k3_rq;

typedef struct k3_sched_config {
    int32_t max_seqs;               /* running requests (sequence slots) */
    int32_t max_num_batched_tokens; /* the token budget of a step */
    int32_t block_size, max_blocks;
    int32_t snapshot_stride; /* blocks */
    int32_t plp_cap;         /* prompt-logprob rows per step (a block multiple) */
    bool prefix_cache;
    uint64_t hash_seed;
    /* The step cost guard (max_step_cost 0 = off). While any running request
     * decodes, the prompt chunks of a step are held so that its decodes (1
     * each) and its prompt tokens, one at position p costing
     * 1 + p*cost_slope + min(p, cost_cap)*cost_cap_slope, stay within
     * max_step_cost: a prompt token's work grows with the keys it attends
     * over, a decode's budget should not. A chunk the guard holds under the
     * next block boundary may end inside a block. Without decodes only the
     * token budget applies. */
    int32_t max_step_cost;
    double cost_slope, cost_cap_slope;
    int64_t cost_cap;
} k3_sched_config;

typedef struct k3_sched {
    k3_sched_config cfg;
    k3_kv_blocks *bm;
    k3_kv_snaps *sn;
    k3_rq **running; /* [max_seqs] admission order, newest last */
    int32_t n_running;
    k3_rq **waiting; /* arrival order (preempted ones in front) */
    int32_t n_waiting, cap_waiting;
    int32_t *free_slots, n_free_slots;
    k3_rq **plan; /* [max_seqs] this step's requests, in batch order */
    int32_t n_plan, plan_tokens;
    /* counters */
    int64_t n_preemptions, prefix_queries, prefix_hits;
    double guarded_cost_max; /* the costliest step the guard held */
} k3_sched;

k3_status k3_sched_init(k3_sched *s, const k3_sched_config *cfg, k3_kv_blocks *bm, k3_kv_snaps *sn, k3_error *err);
void k3_sched_free(k3_sched *s);
/* Hashes the full blocks of rq->tok that are not hashed yet. */
void k3_sched_hash(k3_sched *s, k3_rq *rq);
/* Queues rq (at the back). */
k3_status k3_sched_add(k3_sched *s, k3_rq *rq, k3_error *err);
/* Queues rq at the front: a request whose prompt is in its blocks already
 * (n_computed tokens, landed_state), to decode from there. */
k3_status k3_sched_add_landed(k3_sched *s, k3_rq *rq, k3_error *err);
/* A prompt whose cache comes from elsewhere: the blocks of all its n_prompt
 * tokens, the leading full blocks the prefix index holds shared (n_cached
 * gets their tokens: no KDA snapshot is needed, the state comes with the
 * rest); the rest fresh. False, and nothing taken, when the free blocks
 * do not suffice. rq becomes K3_RQ_REMOTE. */
bool k3_sched_remote_alloc(k3_sched *s, k3_rq *rq);
/* The tokens of rq's prompt the prefix index holds with a KDA snapshot at
 * their end (the hit admission would take now); their blocks are left in
 * rq->blocks[0 .. hit / block_size) (not referenced). */
int64_t k3_sched_local_hit(k3_sched *s, k3_rq *rq);
/* Right after k3_sched_local_hit: rq takes the first n_local blocks of its
 * table (the local hit, shared) and nb - n_local fresh ones, to be filled
 * from elsewhere (a disk tier). False, nothing taken, when the free blocks
 * do not suffice. rq becomes K3_RQ_REMOTE (the scheduler does not see it;
 * k3_sched_add_landed gives it back once filled). */
bool k3_sched_alloc_beyond(k3_sched *s, k3_rq *rq, int32_t n_local, int32_t nb);
/* rq (not queued, not running) gives its blocks back. */
void k3_sched_drop_blocks(k3_sched *s, k3_rq *rq);
/* Counts rq's prefix cache query and its local hit of n_local tokens (a
 * request admitted outside the scheduler's own lookup). */
void k3_sched_count_hit(k3_sched *s, const k3_rq *rq, int64_t n_local);
/* Plans one step into s->plan (preempting as needed). */
void k3_sched_schedule(k3_sched *s);
/* Before the forward pass: the snapshot points of rq's scheduled tokens
 * (positions in (n_computed, n_computed + n_sched], ascending) that have no
 * snapshot yet, at most max, with the key each is stored under. */
int32_t k3_sched_snap_points(const k3_sched *s, const k3_rq *rq, int64_t *pos, uint64_t *key, int32_t max);
/* After the forward pass: rq's scheduled tokens are in the cache; registers
 * its newly full blocks. */
void k3_sched_computed(k3_sched *s, k3_rq *rq);
/* After the forward pass of a verify chunk (n_draft drafts scheduled): its
 * first m positions are kept (the last token and the drafts accepted), so
 * n_computed grows by m, the newly full blocks are registered, and the
 * blocks that only rejected positions used go back (block-table
 * truncation: their rows are never read). */
void k3_sched_verified(k3_sched *s, k3_rq *rq, int32_t m);
/* Ends rq wherever it is: releases its blocks and slot. */
void k3_sched_release(k3_sched *s, k3_rq *rq);
/* Blocks held by requests' tables, for checks. */
int64_t k3_sched_blocks_held(const k3_sched *s);

#endif /* K3_SCHED_SCHED_H */
