/*
 * internal.h -- the engine's own view of itself, shared by its files:
 *
 *   engine.c     the API: open, close, submit, cancel, stats
 *   step.c       k3_engine_step as its phases: begin (the inbox, what
 *                finished), schedule (drafts, the plan), run (the slots, the
 *                captures, the forward pass), sample (tokens, verify chunks
 *                and their rollback), finish (outputs, stats)
 *   token.c      one request's tokens: sampling a row, the stop rules, the
 *                grammar's masks, prompt logprobs, finishing
 *   draft.c      speculation's side of a step: proposing drafts and choosing
 *                how many to verify (src/spec), accepting a verify chunk
 *   connector.h  the KV connector seam the step calls at its phase
 *                boundaries; pd.c is prefill/decode disaggregation's
 *                connector (holds and pulls, the k3_engine_hold_* and
 *                k3_engine_pull_* API of k3.h)
 */
#ifndef K3_ENGINE_INTERNAL_H
#define K3_ENGINE_INTERNAL_H

#include <pthread.h>

#include "ctx/ctx.h"
#include "engine/connector.h"
#include "kv/kv.h"
#include "sched/sched.h"
#include "spec/spec.h"

#define K3_MAX_LOGPROBS 20

typedef struct req {
    k3_rq rq;
    k3_request_params p; /* copied; p.prompt points into rq.tok */
    int32_t *stop_ids;
    k3_sampler *smp;
    int32_t n_gen;
    bool finished;
    k3_finish_reason finish;
    int32_t stop_id;
    char error[512];
    double t_arrival, t_scheduled, t_first_token, t_finished, t_last;
    /* this step's output: n_new tokens (a verify chunk gives up to k + 1) */
    int32_t out_tok[K3_SPEC_MAX_TOKENS + 1];
    float out_lp[K3_SPEC_MAX_TOKENS + 1];
    k3_logprob *out_top; /* [(K3_SPEC_MAX_TOKENS + 1) * n_top] */
    int32_t n_new;
    bool plp_ready, plp_reported;
    float *plp;          /* [n_prompt - 1] */
    k3_logprob *plp_top; /* [(n_prompt - 1) * n_top] */
    float *emb_rows;     /* the given embedding rows, copied [n_rows, D] */
    const float **emb;   /* [cap_tok] row per token (NULL = the table's), or NULL */
    /* prefill side (kv_hold): the KDA state at the prompt's end, captured in the pass that ends it */
    void *hold_state;
    bool hold_captured;
    /* decode side (remote): the prefill instance's answer and the pull */
    bool remote;
    k3_remote_prefill rp; /* rp.first_top -> first_top (copied) */
    k3_logprob *first_top;
    void *pull_state;       /* [state_bytes] the KDA state pulled */
    int pull_phase;         /* PULL_*, under mu once the pull started */
    bool pull_cancel;       /* under mu: cancelled while pulling */
    int pull_pins;          /* under mu: writes in flight */
    int64_t pull_state_got; /* under mu: bytes of the state written */
    char pull_err[256];     /* under mu: why it failed */
    double t_pull0, t_landed, t_second;
    /* the grammar the output matches (p.grammar), or NULL */
    k3_grammar_matcher *gm;     /* at the output's end: every generated token accepted */
    uint64_t *mask;             /* [mask words] this step's mask */
    const k3_grammar_vocab *gv; /* the grammar's vocabulary */
    float *stop_raw;            /* [n_stop_ids] their raw logits, for when the text is complete */
    /* speculative decoding (draft.c) */
    k3_spec_seq *spec;          /* the proposer's state, NULL: none (yet) */
    k3_spec_method spec_method; /* its method, K3_SPEC_OFF: no drafts; the state is made when drafting may pay */
    int32_t spec_k;             /* draft tokens per step at most */
    int64_t spec_appended;      /* tokens of rq.tok the proposer has seen */
    k3_spec_calib calib;
    int32_t n_draft;                      /* this step: drafts proposed (rq.tok[n_tok ..]) */
    float draft_conf[K3_SPEC_MAX_TOKENS]; /* their confidences */
    bool verify;                          /* this step's entry is a verify chunk */
    /* the disk tier (disk.c) */
    int disk_phase;                      /* DISK_* */
    struct k3_kvs_hit *disk_hit;         /* DISK_WAIT: what the directory holds beyond the local hit */
    uint64_t disk_ticket;                /* DISK_LOAD: the load's */
    void *disk_state;                    /* [state_bytes] the KDA state loaded, until admitted with it */
    int64_t disk_local, disk_hit_tokens; /* the local hit it goes beyond; the tokens it reaches */
    int64_t disk_chain_tokens;           /* how far its blocks lie on disk (k3_kvs_hit_chain_tokens) */
    int64_t disk_junction;               /* the junction saved with its prompt's end (0 = none) */
    int64_t disk_loaded;                 /* prompt tokens its load gave */
    bool disk_cancel;                    /* cancelled while loading */
    int32_t disk_saved;                  /* blocks of its prefix given to saves so far */
    double t_disk0;                      /* its load started */
} req;

enum { PULL_NONE = 0, PULL_WAIT, PULL_ACTIVE, PULL_OK, PULL_FAILED };
enum { DISK_NONE = 0, DISK_WAIT, DISK_LOAD };

struct k3_engine {
    const k3_model *m;
    k3_ctx *ctx;
    k3_kv_blocks bm;
    k3_kv_snaps sn;
    k3_sched sched;
    k3_engine_options o;
    int32_t *eos;
    int32_t n_eos;
    int64_t V, max_model_len, cache_tokens, state_bytes;
    int32_t block_size, max_blocks, plp_cap;
    int32_t spec_rows_cap; /* draft tokens a step verifies at most (their logits rows) */
    int64_t cost_p0;       /* where the step cost guard prices a prompt token at 2 */

    k3_comm_stats comm; /* cross-rank counters since open, all ranks summed (o.dist), under mu */

    bool exec_lock;          /* several ranks: the executor is one thread's at a time */
    pthread_mutex_t exec_mu; /* held by a step, and by a connector's reads and writes of the cache */

    /* the KV connectors the step calls (connector.h); pd is the first, the disk tier's (if any) the second */
    k3_kv_connector *conn[K3_MAX_CONNECTORS];
    int32_t n_conn;
    struct k3_pd_conn *pd;
    struct k3_disk_conn *disk;
    k3_kv_events *kv_events; /* the KV events' publisher (k3_engine_set_kv_events), or NULL */

    /* inbox, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    req **in_sub;
    int32_t n_sub, cap_sub;
    uint64_t *in_cancel;
    int32_t n_cancel, cap_cancel;
    uint64_t next_id;
    int64_t n_accepted;     /* submitted and not finished (for max_waiting) */
    int64_t n_async;        /* connectors' completions not yet stepped (k3_engine_notify) */
    k3_engine_stats st;     /* published at the end of each step */
    k3_kv_residency kv_res; /* the same, when the residency metrics are on */

    /* stepping thread only */
    req **live; /* submitted and not yet freed */
    int32_t n_live, cap_live;
    req **done; /* finished in the last step: freed at the next */
    int32_t n_done, cap_done;
    k3_req_output *outs;
    int32_t cap_outs;
    k3_batch_seq *batch; /* [max_seqs] */
    uint8_t *want;
    float *logits;            /* [(max_seqs + spec_rows_cap + plp_cap) * V] */
    float *row;               /* [V] a copy for sampling */
    k3_grammar_matcher **g_m; /* [max_seqs] this step's constrained samplers */
    uint64_t **g_mask;        /* [max_seqs] their masks */
    float **lg_of;            /* [max_seqs] the logits rows each plan entry samples from, or NULL */
    int64_t grammar_steps, grammar_masks;
    double grammar_s;
    int64_t prompt_tokens, generation_tokens, finished_by[K3_FINISH_ERROR + 1];
    int64_t n_snap_saves, n_snap_restores;
    int32_t req_snaps, step_snaps; /* snapshot points of one request's chunk, of a step at most */
    int64_t *snap_pos;             /* [req_snaps + step_snaps]: a request's points, then the step's */
    uint64_t *snap_key;
    int32_t n_taken;     /* this step's snapshots */
    req **snap_req;      /* [step_snaps] whose each is */
    int32_t *reg_before; /* [max_seqs] each plan entry's registered blocks before this step's tokens */
    double snap_save_s, snap_restore_s;
    double t_run; /* this step's forward pass, seconds */

    /* speculative decoding (draft.c) */
    k3_proposer *prop; /* NULL: no proposer (off, and no request may ask) */
    k3_spec_policy policy;
    k3_spec_cand *cand; /* [max_seqs] */
    int32_t *take;      /* [max_seqs] */
    int64_t spec_drafts, spec_draft_tokens, spec_accepted, spec_per_pos[K3_SPEC_MAX_TOKENS];
    double spec_propose_s, spec_accept_s;
    double spec_open_s; /* this step's proposer states opened (a request's once): not the step's cost */
    /* the step's phases (K3_PHASE_*), and what the cost model learns a
     * step's whole time from: the last step's rows, decodes, verify chunks
     * and drafts, its pass and its time from start to end; t_end when it
     * left work (the time until the next step is the caller's) */
    double phase_s[K3_PHASE_COUNT];
    int64_t n_steps, n_spec_steps;
    k3_spec_step last;
    double t_start, t_end;
};

/* ---- engine.c -------------------------------------------------------- */
bool k3_engine_push_ptr(void ***arr, int32_t *n, int32_t *cap, void *p);
/* A connector's work completed (under e->mu): the stepping thread wakes. */
void k3_engine_notify_locked(k3_engine *e);
void k3_engine_req_free(req *r);

/* ---- token.c: one request's tokens ------------------------------------- */
/* Ends r (why, at time t): the connectors are told, its blocks and slot go. */
void k3_engine_finish(k3_engine *e, req *r, k3_finish_reason why, double t);
/* Samples r's next token from its logits row lg (with a grammar: under
 * r->mask) and applies the stop rules; the token joins r's output. */
void k3_engine_sample(k3_engine *e, req *r, float *lg, double t);
/* Fills r->mask of each plan entry that samples this step under a grammar
 * (e->lg_of set), in one call over the pool. */
void k3_engine_grammar_masks(k3_engine *e, int32_t n_plan, double t);
/* Prompt logprobs from rows [0, n) of a chunk that starts at position c. */
void k3_engine_prompt_logprobs(k3_engine *e, req *r, const float *lg, int64_t c, int32_t n);
bool k3_engine_is_stop(const k3_engine *e, const req *r, int32_t id);
bool k3_engine_is_eos(const k3_engine *e, int32_t id);
bool k3_engine_is_stop_id(const req *r, int32_t id);

/* ---- draft.c: speculation's side of the step ---------------------------- */
k3_status k3_engine_spec_open(k3_engine *e, k3_error *err);
void k3_engine_spec_close(k3_engine *e);
/* A request arrives: its proposer's state (none when it does not draft). */
k3_status k3_engine_spec_req_open(k3_engine *e, req *r, k3_error *err);
/* r ends: its output may join its scope's cache. */
void k3_engine_spec_req_close(k3_engine *e, req *r);
/* Before the schedule: each running decode's drafts, as many as pay
 * (rq.n_draft; the tokens at rq.tok[n_tok ..]). */
void k3_engine_spec_propose(k3_engine *e);
/* After the forward pass: r's verify chunk (rows lg, n_sched of them) --
 * each row sampled as a decode step would, the drafts accepted while the
 * draws equal them, the cache and KDA state rolled back to the last kept. */
void k3_engine_spec_verify(k3_engine *e, req *r, float *lg, double t);
/* The pass's time, for the cost model (a pass of decodes and verify chunks). */
void k3_engine_spec_observe(k3_engine *e, const k3_spec_step *st);

/* ---- step.c ------------------------------------------------------------ */
void k3_engine_publish_stats(k3_engine *e);

/* ---- pd.c: prefill/decode disaggregation's connector --------------------- */
k3_status k3_pd_conn_open(k3_engine *e, k3_kv_connector **out, k3_error *err);
bool k3_engine_has_pull_hook(const k3_engine *e);

/* ---- disk.c: the disk tier's connector ------------------------------------- */
k3_status k3_disk_conn_open(k3_engine *e, k3_kv_connector **out, k3_error *err);

#endif /* K3_ENGINE_INTERNAL_H */
