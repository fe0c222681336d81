/*
 * engine.c -- the k3_engine API of k3.h: many requests on one model.
 *
 * The engine owns a context made with k3_ctx_init_pool (cache storage for
 * the pool's blocks, one sequence slot per running request), the block
 * manager and KDA snapshots (src/kv), and the scheduler (src/sched). It
 * drives the context through the executor (src/executor), which under
 * mpirun makes every call on every rank. A step:
 *   1. frees the requests that finished in the previous step (their outputs
 *      lived until now), takes the inbox (submits and cancels from any thread,
 *      under the mutex), ends cancelled requests;
 *   2. plans (k3_sched_schedule), sets each planned slot's block table and
 *      position (restoring a snapshot or zeroing the KDA state on admission);
 *   3. runs one forward pass (k3_exec_run) over the plan;
 *   4. registers full blocks, takes snapshots, samples (each request its own
 *      sampler: the same tokens alone or batched), applies stop rules, and
 *      reports outputs and events.
 * Logprobs are the log-softmax of the raw logits (before penalty and
 * temperature), as vLLM reports them.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/error.h"
#include "ctx/ctx.h"
#include "engine.h"
#include "executor/executor.h"
#include "kv/kv.h"
#include "kvevents/events.h"
#include "model/model.h"
#include "model/plan.h"
#include "sched/sched.h"

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
    /* this step's output */
    int32_t out_tok;
    float out_lp;
    k3_logprob *out_top; /* [n_top] */
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
} req;

enum { PULL_NONE = 0, PULL_WAIT, PULL_ACTIVE, PULL_OK, PULL_FAILED };

/* A finished request's blocks and end state, kept for a decode instance. */
typedef struct hold {
    uint64_t id;
    int32_t *blocks;
    int32_t n_blocks;
    int64_t n_tokens;
    void *state;
    double deadline;
    double queue_s, prefill_s;
    int pins; /* reads in flight */
    bool released;
} hold;

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
    int64_t cost_p0; /* where the step cost guard prices a prompt token at 2 */

    k3_comm_stats comm; /* cross-rank counters since open, all ranks summed (o.dist), under mu */

    /* prefill and decode apart (k3.h) */
    bool exec_lock;          /* several ranks: the executor is one thread's at a time */
    pthread_mutex_t exec_mu; /* held by a step, and by a pull's writes and a hold's reads */
    k3_pull_hook pull_hook;
    void *pull_arg;
    req **rwait; /* stepping thread: remote requests waiting for blocks, in order */
    int32_t n_rwait, cap_rwait;
    bool rwait_blocked; /* the first of them did not fit since blocks were last freed */
    req **pulls;        /* under mu: remote requests pulling */
    int32_t n_pulls, cap_pulls;
    hold **holds; /* under mu */
    int32_t n_holds, cap_holds;
    int64_t n_async; /* under mu: pulls done and holds released, not yet stepped */
    int64_t holds_expired, holds_released, pulls_ok, pulls_failed; /* under mu */
    double hold_timeout;

    /* inbox, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    req **in_sub;
    int32_t n_sub, cap_sub;
    uint64_t *in_cancel;
    int32_t n_cancel, cap_cancel;
    uint64_t next_id;
    int64_t n_accepted;     /* submitted and not finished (for max_waiting) */
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
    float *logits;            /* [(max_seqs + plp_cap) * V] */
    float *row;               /* [V] a copy for sampling */
    k3_grammar_matcher **g_m; /* [max_seqs] this step's constrained samplers */
    uint64_t **g_mask;        /* [max_seqs] their masks */
    float **lg_of;            /* [max_seqs] the logits row each plan entry samples from, or NULL */
    int64_t grammar_steps, grammar_masks;
    double grammar_s;
    int64_t prompt_tokens, generation_tokens, finished_by[K3_FINISH_ERROR + 1];
    int64_t n_snap_saves, n_snap_restores;
    int32_t req_snaps, step_snaps; /* snapshot points of one request's chunk, of a step at most */
    int64_t *snap_pos;             /* [req_snaps + step_snaps]: a request's points, then the step's */
    uint64_t *snap_key;
    double snap_save_s, snap_restore_s;
};

/* ---- memory accounting ------------------------------------------------------ */

/* The step cost guard's price of a prompt token at position p (sched.h):
 * 1 + p * slope + min(p, cap) * cap_slope, the FLOPs of attending over p
 * cached keys against those of the token's weights (2 x the active
 * parameters). Per key, an absorbed MLA head scores kv_lora + rope dims and
 * sums kv_lora (4 kv_lora + 2 rope FLOPs); a DSA layer's indexer scores
 * every key (2 x heads x dim) and its heads attend over at most index_topk.
 * KDA layers cost the same at every position. */
static void prefill_cost(const k3_config *c, int64_t active, double *slope, double *cap_slope, int64_t *cap) {
    const double w = 2.0 * (double)(active > 0 ? active : 1), head = 4.0 * c->kv_lora_rank + 2.0 * c->qk_rope_dim;
    double all = 0, capped = 0;
    for (int i = 0; i < c->n_layers; i++)
        if (c->layer_kind[i] == K3_LAYER_MLA) all += c->n_heads * head;
        else if (c->layer_kind[i] == K3_LAYER_DSA) {
            all += 2.0 * c->index_n_heads * c->index_head_dim;
            capped += c->n_heads * head;
        }
    *slope = all / w;
    *cap_slope = capped / w;
    *cap = c->index_topk > 0 ? c->index_topk : 0;
}

/* The position where the guard prices a prompt token at 2 (0: never). */
static int64_t prefill_cost_p0(double slope, double cap_slope, int64_t cap) {
    if ((double)cap * (slope + cap_slope) >= 1.0) return (int64_t)ceil(1.0 / (slope + cap_slope));
    if (slope <= 0) return 0;
    return cap + (int64_t)ceil((1.0 - (double)cap * (slope + cap_slope)) / slope);
}

/* free memory now (the defaults are sized from it) and physical memory (the
 * limit a configuration is refused against) */
static int64_t machine_bytes(bool total) {
    const long pages = sysconf(total ? _SC_PHYS_PAGES : _SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || psz <= 0) return (int64_t)1 << 34;
    return (int64_t)pages * psz;
}

/* ---- requests ------------------------------------------------------------------- */

static void req_free(req *r) {
    if (!r) return;
    free(r->rq.tok);
    free(r->rq.blocks);
    free(r->rq.hash);
    free(r->rq.extra);
    free((void *)r->rq.tok_extra);
    free(r->stop_ids);
    k3_sampler_free(r->smp);
    free(r->out_top);
    free(r->plp);
    free(r->plp_top);
    free(r->emb_rows);
    free(r->emb);
    free(r->hold_state);
    free(r->first_top);
    free(r->pull_state);
    k3_grammar_matcher_free(r->gm);
    free(r->mask);
    free(r->stop_raw);
    free(r);
}

static void hold_free(hold *h) {
    if (!h) return;
    free(h->blocks);
    free(h->state);
    free(h);
}

static bool push_ptr(void ***arr, int32_t *n, int32_t *cap, void *p) {
    if (*n == *cap) {
        const int32_t nc = *cap ? 2 * *cap : 64;
        void **a = realloc(*arr, sizeof(void *) * (size_t)nc);
        if (!a) return false;
        *arr = a;
        *cap = nc;
    }
    (*arr)[(*n)++] = p;
    return true;
}

/* ---- open / close ------------------------------------------------------------------ */

void k3_engine_close(k3_engine *e) {
    if (!e) return;
    for (int32_t i = 0; i < e->n_live; i++) req_free(e->live[i]);
    for (int32_t i = 0; i < e->n_sub; i++) req_free(e->in_sub[i]);
    free(e->live);
    free(e->done);
    free(e->in_sub);
    free(e->in_cancel);
    free(e->outs);
    free(e->batch);
    free(e->want);
    free(e->logits);
    free(e->row);
    free(e->g_m);
    free(e->g_mask);
    free(e->lg_of);
    free(e->snap_pos);
    free(e->snap_key);
    free(e->eos);
    for (int32_t i = 0; i < e->n_holds; i++) hold_free(e->holds[i]);
    free(e->holds);
    free(e->rwait);
    free(e->pulls);
    pthread_mutex_destroy(&e->exec_mu);
    k3_sched_free(&e->sched);
    k3_kv_snaps_free(&e->sn);
    k3_kv_blocks_free(&e->bm);
    k3_ctx_free(e->ctx);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
}

k3_status k3_engine_open(k3_engine **out, const k3_model *m, const k3_engine_options *opt, k3_error *err) {
    *out = NULL;
    if (!m || !opt) return k3_err(err, K3_ERR_ARG, "engine: no model or options");
    const k3_config *c = &m->cfg;
    k3_engine_options o = *opt;
    if (o.max_num_seqs < 0 || o.max_num_batched_tokens < 0 || o.max_model_len < 0 || o.cache_tokens < 0 ||
        o.cache_bytes < 0 || o.block_size < 0 || o.snapshot_stride < 0 || o.snapshot_bytes < 0 || o.max_waiting < 0 ||
        o.max_step_cost < 0 || o.n_eos_ids < 0 || (o.n_eos_ids > 0 && !o.eos_ids) ||
        !(o.hold_timeout_s >= 0 && o.hold_timeout_s <= 1e9))
        return k3_err(err, K3_ERR_ARG, "engine: negative option or missing eos_ids");
    if (o.kv_cache != K3_KV_F32 && o.kv_cache != K3_KV_C8)
        return k3_err(err, K3_ERR_ARG, "engine: unknown cache type %d", (int)o.kv_cache);
    if (!o.max_num_seqs) o.max_num_seqs = 16;
    if (!o.max_num_batched_tokens) o.max_num_batched_tokens = 2048;
    if (!o.block_size) o.block_size = 64;
    const int32_t dcp = k3_dist_dcp_size(o.dist), stripe = dcp * k3_dist_interleave(o.dist);
    /* under DCP a block holds block_size / D tokens of each rank: the default
     * is 64 up to a multiple of D * interleave */
    if (!opt->block_size && stripe > 1) o.block_size = (64 + stripe - 1) / stripe * stripe;
    if (!o.snapshot_stride) o.snapshot_stride = 4;
    if (o.max_num_seqs > 4096) return k3_err(err, K3_ERR_RANGE, "engine: max_num_seqs %d is over 4096", o.max_num_seqs);
    if (stripe > 1 && o.block_size % stripe)
        return k3_err(err, K3_ERR_ARG,
                      "engine: the block size %d is not a multiple of --dcp %d x --dcp-interleave %d (a block "
                      "holds the same number of tokens of every DCP rank)",
                      o.block_size, dcp, k3_dist_interleave(o.dist));
    if (o.block_size > 4096) return k3_err(err, K3_ERR_RANGE, "engine: block_size %d is over 4096", o.block_size);
    if (o.max_num_batched_tokens < o.block_size)
        return k3_err(err, K3_ERR_RANGE,
                      "engine: max_num_batched_tokens %d is below one block (%d tokens): a prompt chunk could never be "
                      "scheduled",
                      o.max_num_batched_tokens, o.block_size);
    if (o.max_num_batched_tokens < o.max_num_seqs)
        return k3_err(err, K3_ERR_RANGE,
                      "engine: max_num_batched_tokens %d is below max_num_seqs %d: running decodes could starve",
                      o.max_num_batched_tokens, o.max_num_seqs);
    for (int32_t i = 0; i < o.n_eos_ids; i++)
        if (o.eos_ids[i] < 0 || o.eos_ids[i] >= c->vocab_size)
            return k3_err(err, K3_ERR_ARG, "engine: eos id %d is out of range [0, %lld)", o.eos_ids[i],
                          (long long)c->vocab_size);
    if (o.max_model_len > c->max_positions)
        return k3_err(err, K3_ERR_RANGE, "engine: max_model_len %lld is over the model's %lld positions",
                      (long long)o.max_model_len, (long long)c->max_positions);

    /* the pool */
    const int64_t bpt = k3_config_cache_bytes_per_token(c, o.kv_cache), avail = machine_bytes(false);
    k3_model_info info;
    k3_model_get_info(m, &info);
    /* what the weights leave of the machine */
    const int64_t phys = machine_bytes(true);
    int64_t room = phys - info.weight_bytes;
    if (room < phys / 4) room = phys / 4;
    const int64_t bs = o.block_size;
    int64_t tokens;
    if (o.cache_tokens) {
        tokens = o.cache_tokens;
    } else if (o.cache_bytes) {
        tokens = bpt > 0 ? o.cache_bytes / bpt : o.cache_bytes;
        if (tokens < bs)
            return k3_err(err, K3_ERR_RANGE,
                          "engine: cache_bytes %lld hold %lld tokens at %lld bytes per token, under one block of %lld",
                          (long long)o.cache_bytes, (long long)tokens, (long long)bpt, (long long)bs);
    } else {
        const int64_t len = o.max_model_len ? o.max_model_len : c->max_positions;
        tokens = (int64_t)o.max_num_seqs * len;
        const int64_t cap = bpt > 0 ? avail / 4 / bpt : tokens; /* a quarter of what is free */
        if (tokens > cap) tokens = cap;
        if (tokens < bs) tokens = bs;
    }
    int64_t n_blocks = (tokens + bs - 1) / bs;
    if (n_blocks > INT32_MAX / 2) n_blocks = INT32_MAX / 2;
    tokens = n_blocks * bs;
    const int64_t pool_bytes = tokens * bpt / dcp; /* this rank's: 1/D under DCP */
    const int64_t state_all = (int64_t)o.max_num_seqs * info.state_bytes_per_seq;
    if (o.max_model_len && o.max_model_len > tokens)
        return k3_err(err, K3_ERR_RANGE, "engine: max_model_len %lld is over the %lld tokens the cache pool holds",
                      (long long)o.max_model_len, (long long)tokens);
    const int64_t max_model_len =
        o.max_model_len ? o.max_model_len : (c->max_positions < tokens ? c->max_positions : tokens);
    int64_t snap_budget = o.snapshot_bytes;
    if (!snap_budget) {
        /* a snapshot serves a hit only while the attention blocks of its
         * prefix are cached: the pool backs at most one per snapshot point
         * (every snapshot_stride blocks) plus the prompt end of each running
         * request; no more than that, 1 GiB or an eighth of free memory */
        const int64_t useful = (n_blocks / o.snapshot_stride + o.max_num_seqs) * info.state_bytes_per_seq;
        snap_budget = (int64_t)1 << 30;
        if (snap_budget > avail / 8) snap_budget = avail / 8;
        if (snap_budget > useful) snap_budget = useful;
        if (snap_budget < 8 * info.state_bytes_per_seq) snap_budget = 8 * info.state_bytes_per_seq;
    }
    if (o.no_prefix_cache) snap_budget = 0;
    if (pool_bytes + state_all + snap_budget > room)
        return k3_err(err, K3_ERR_RANGE,
                      "engine: the cache pool (%lld tokens x %lld bytes = %lld MB), %d KDA states (%lld MB) and the "
                      "snapshot budget (%lld MB) "
                      "need %lld MB, over the %lld MB the machine has beside the weights",
                      (long long)tokens, (long long)bpt, (long long)(pool_bytes >> 20), o.max_num_seqs,
                      (long long)(state_all >> 20), (long long)(snap_budget >> 20),
                      (long long)((pool_bytes + state_all + snap_budget) >> 20), (long long)(room >> 20));

    k3_engine *e = calloc(1, sizeof *e);
    if (!e) return k3_err(err, K3_ERR_NOMEM, "engine: out of memory");
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    pthread_mutex_init(&e->exec_mu, NULL);
    e->exec_lock = o.dist && k3_dist_size(o.dist) > 1;
    e->hold_timeout = o.hold_timeout_s > 0 ? o.hold_timeout_s : 120.0;
    e->m = m;
    e->o = o;
    e->V = c->vocab_size;
    e->block_size = (int32_t)bs;
    e->max_model_len = max_model_len;
    e->cache_tokens = tokens;
    e->max_blocks = (int32_t)((max_model_len + bs - 1) / bs);
    e->next_id = 1;
    /* prompt-logprob rows per step: at most ~64 MB of logits, a block at least */
    int64_t plp = ((int64_t)16 << 20) / e->V;
    plp -= plp % bs;
    if (plp < bs) plp = bs;
    if (plp > o.max_num_batched_tokens) plp = o.max_num_batched_tokens - o.max_num_batched_tokens % bs;
    e->plp_cap = (int32_t)plp;

    k3_status st = K3_OK;
    e->eos = malloc(sizeof(int32_t) * (size_t)(o.n_eos_ids ? o.n_eos_ids : 1));
    if (!e->eos) st = k3_err(err, K3_ERR_NOMEM, "engine: out of memory");
    if (!st) {
        if (o.n_eos_ids) memcpy(e->eos, o.eos_ids, sizeof(int32_t) * (size_t)o.n_eos_ids);
        e->n_eos = o.n_eos_ids;
        e->o.eos_ids = e->eos;
        k3_ctx_options co = {.max_seqs = o.max_num_seqs,
                             .cache_tokens = tokens,
                             .block_size = (int32_t)bs,
                             .max_batch = o.max_num_batched_tokens < 1024 ? o.max_num_batched_tokens : 1024,
                             .kv_cache = o.kv_cache,
                             .pool = o.pool,
                             .dist = o.dist};
        st = k3_exec_init_pool(&e->ctx, m, &co, (int32_t)n_blocks, max_model_len, err);
    }
    if (!st) {
        e->state_bytes = k3_ctx_state_bytes(e->ctx);
        st = k3_kv_blocks_init(&e->bm, (int32_t)n_blocks, (int32_t)bs, err);
    }
    if (!st) st = k3_kv_snaps_init(&e->sn, e->state_bytes, snap_budget, err);
    if (!st) {
        k3_sched_config sc = {.max_seqs = o.max_num_seqs,
                              .max_num_batched_tokens = o.max_num_batched_tokens,
                              .block_size = (int32_t)bs,
                              .max_blocks = e->max_blocks,
                              .snapshot_stride = o.snapshot_stride,
                              .plp_cap = e->plp_cap,
                              .prefix_cache = !o.no_prefix_cache,
                              .hash_seed = k3_kv_hash_seed(o.cache_salt, (int32_t)bs, (int32_t)o.kv_cache),
                              .max_step_cost = o.max_step_cost};
        prefill_cost(c, info.n_params_active, &sc.cost_slope, &sc.cost_cap_slope, &sc.cost_cap);
        e->cost_p0 = prefill_cost_p0(sc.cost_slope, sc.cost_cap_slope, sc.cost_cap);
        st = k3_sched_init(&e->sched, &sc, &e->bm, &e->sn, err);
    }
    if (!st) {
        e->batch = calloc((size_t)o.max_num_seqs, sizeof(k3_batch_seq));
        e->want = calloc((size_t)o.max_num_seqs, 1);
        e->logits = malloc(sizeof(float) * (size_t)((o.max_num_seqs + e->plp_cap) * e->V));
        e->row = malloc(sizeof(float) * (size_t)e->V);
        e->g_m = calloc((size_t)o.max_num_seqs, sizeof *e->g_m);
        e->g_mask = calloc((size_t)o.max_num_seqs, sizeof *e->g_mask);
        e->lg_of = calloc((size_t)o.max_num_seqs, sizeof *e->lg_of);
        /* snapshot points: a request's chunk crosses at most one per block
         * (+ its end and a junction), a step at most as many as fit */
        e->req_snaps = o.max_num_batched_tokens / (int32_t)bs + 3;
        int64_t step = (int64_t)o.max_num_seqs * e->req_snaps;
        if (step > e->sn.cap) step = e->sn.cap;
        e->step_snaps = (int32_t)step;
        e->snap_pos = malloc(sizeof(int64_t) * (size_t)(e->req_snaps + step));
        e->snap_key = malloc(sizeof(uint64_t) * (size_t)(e->req_snaps + step));
        if (!e->batch || !e->want || !e->logits || !e->row || !e->g_m || !e->g_mask || !e->lg_of || !e->snap_pos ||
            !e->snap_key)
            st = k3_err(err, K3_ERR_NOMEM, "engine: out of memory");
    }
    if (st) {
        k3_engine_close(e);
        return st;
    }
    e->st.blocks_total = n_blocks;
    e->st.max_model_len = max_model_len;
    e->st.cache_tokens = tokens;
    e->st.state_bytes_per_seq = e->state_bytes;
    e->st.snapshot_budget = snap_budget;
    e->st.max_num_seqs = o.max_num_seqs;
    e->st.max_waiting = o.max_waiting;
    *out = e;
    return K3_OK;
}

/* ---- submit / cancel (any thread) --------------------------------------------------------- */

k3_status k3_engine_submit(k3_engine *e, const k3_request_params *p, uint64_t *id, k3_error *err) {
    if (id) *id = 0;
    if (!p || !p->prompt || p->n_prompt < 1) return k3_err(err, K3_ERR_ARG, "submit: the prompt is empty");
    if (p->max_tokens < 0 || p->min_tokens < 0 || p->n_stop_ids < 0 || (p->n_stop_ids > 0 && !p->stop_ids))
        return k3_err(err, K3_ERR_ARG, "submit: max_tokens, min_tokens and n_stop_ids must not be negative");
    if (p->logprobs < -1 || p->logprobs > K3_MAX_LOGPROBS || p->prompt_logprobs < -1 ||
        p->prompt_logprobs > K3_MAX_LOGPROBS)
        return k3_err(err, K3_ERR_ARG, "submit: logprobs and prompt_logprobs must be -1 or 0..%d", K3_MAX_LOGPROBS);
    if (p->logprobs >= 0 && p->prompt_logprobs >= 0 && p->logprobs != p->prompt_logprobs)
        return k3_err(err, K3_ERR_ARG,
                      "submit: logprobs %d and prompt_logprobs %d must ask for the same number of alternatives",
                      p->logprobs, p->prompt_logprobs);
    for (int64_t i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= e->V)
            return k3_err(err, K3_ERR_ARG, "submit: prompt token %d at index %lld is out of range [0, %lld)",
                          p->prompt[i], (long long)i, (long long)e->V);
    for (int32_t i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] < 0 || p->stop_ids[i] >= e->V)
            return k3_err(err, K3_ERR_ARG, "submit: stop id %d is out of range [0, %lld)", p->stop_ids[i],
                          (long long)e->V);
    if (p->kv_hold && (p->remote || p->max_tokens < 1))
        return k3_err(err, K3_ERR_ARG,
                      "submit: a request kept for a decode instance (kv_hold) generates its "
                      "first token here (max_tokens >= 1) and is not itself remote");
    if (p->remote) {
        const k3_remote_prefill *rp = p->remote;
        if (rp->first_token < 0 || rp->first_token >= e->V)
            return k3_err(err, K3_ERR_ARG, "submit: the prefill instance's first token %d is out of range [0, %lld)",
                          rp->first_token, (long long)e->V);
        if (p->prompt_logprobs >= 0 || p->max_tokens < 1)
            return k3_err(err, K3_ERR_ARG,
                          "submit: a request prefilled elsewhere has no prompt logprobs here and "
                          "generates at least its first token (max_tokens >= 1)");
        if (rp->n_first_top < 0 || rp->n_first_top > K3_MAX_LOGPROBS || (rp->n_first_top > 0 && !rp->first_top))
            return k3_err(err, K3_ERR_ARG, "submit: n_first_top %d is not in 0..%d", rp->n_first_top, K3_MAX_LOGPROBS);
        if (!e->pull_hook)
            return k3_err(err, K3_ERR_UNSUPPORTED,
                          "submit: this engine has no pull hook: it cannot fetch a "
                          "prompt's cache from a prefill instance");
    }
    const int64_t total = p->n_prompt + p->max_tokens;
    if (total > e->max_model_len)
        return k3_err(err, K3_ERR_RANGE,
                      "submit: the prompt (%lld tokens) plus max_tokens (%d) is %lld tokens, over the model length of "
                      "%lld",
                      (long long)p->n_prompt, p->max_tokens, (long long)total, (long long)e->max_model_len);
    if (total > e->cache_tokens)
        return k3_err(err, K3_ERR_RANGE,
                      "submit: the prompt plus max_tokens is %lld tokens, over the %lld the cache pool can ever hold",
                      (long long)total, (long long)e->cache_tokens);

    req *r = calloc(1, sizeof *r);
    if (!r) return k3_err(err, K3_ERR_NOMEM, "submit: out of memory");
    k3_status st = k3_sampler_init(&r->smp, &p->sampling, (int32_t)e->V, err);
    if (st) {
        req_free(r);
        return st;
    }
    const int32_t n_top = p->logprobs >= 0 ? p->logprobs : p->prompt_logprobs >= 0 ? p->prompt_logprobs : 0;
    r->p = *p;
    r->rq.cap_tok = total + 1;
    r->rq.tok = malloc(sizeof(int32_t) * (size_t)r->rq.cap_tok);
    r->rq.blocks = malloc(sizeof(int32_t) * (size_t)(e->max_blocks + 1));
    r->rq.hash = malloc(sizeof(uint64_t) * (size_t)(e->max_blocks + 1));
    r->rq.extra = malloc(sizeof(uint64_t) * (size_t)(e->max_blocks + 1));
    uint64_t *tx = NULL;
    if (p->extra_keys) {
        tx = malloc(sizeof(uint64_t) * (size_t)p->n_prompt);
        if (tx) memcpy(tx, p->extra_keys, sizeof(uint64_t) * (size_t)p->n_prompt);
        r->rq.tok_extra = tx;
    }
    r->stop_ids = malloc(sizeof(int32_t) * (size_t)(p->n_stop_ids + 1));
    r->out_top = malloc(sizeof(k3_logprob) * (size_t)(n_top + 1));
    if (p->prompt_logprobs >= 0) {
        r->plp = calloc((size_t)p->n_prompt, sizeof(float));
        r->plp_top = calloc((size_t)(p->n_prompt * (n_top + 1)), sizeof(k3_logprob));
    }
    if (!r->rq.tok || !r->rq.blocks || !r->rq.hash || !r->rq.extra || (p->extra_keys && !tx) || !r->stop_ids ||
        !r->out_top || (p->prompt_logprobs >= 0 && (!r->plp || !r->plp_top))) {
        req_free(r);
        return k3_err(err, K3_ERR_NOMEM, "submit: out of memory for a %lld-token request", (long long)total);
    }
    if (p->embeds) { /* rows replacing embeddings (images): copied, so the caller may free its own */
        const int64_t D = e->m->cfg.hidden_size;
        int64_t n_rows = 0;
        for (int64_t i = 0; i < p->n_prompt; i++) n_rows += p->embeds[i] != NULL;
        r->emb = calloc((size_t)r->rq.cap_tok, sizeof *r->emb); /* recompute after preemption reads past the prompt */
        r->emb_rows = malloc(sizeof(float) * (size_t)(n_rows * D + 1));
        if (!r->emb || !r->emb_rows) {
            req_free(r);
            return k3_err(err, K3_ERR_NOMEM, "submit: out of memory for %lld embedding rows", (long long)n_rows);
        }
        for (int64_t i = 0, k = 0; i < p->n_prompt; i++)
            if (p->embeds[i]) {
                memcpy(r->emb_rows + k * D, p->embeds[i], sizeof(float) * (size_t)D);
                r->emb[i] = r->emb_rows + k++ * D;
            }
    }
    r->p.embeds = NULL;
    if (p->kv_hold && e->state_bytes > 0 && !(r->hold_state = malloc((size_t)e->state_bytes))) {
        req_free(r);
        return k3_err(err, K3_ERR_NOMEM, "submit: out of memory for a KDA state to keep");
    }
    if (p->remote) {
        r->remote = true;
        r->rp = *p->remote;
        r->first_top = malloc(sizeof(k3_logprob) * (size_t)(r->rp.n_first_top + 1));
        r->pull_state = e->state_bytes > 0 ? malloc((size_t)e->state_bytes) : NULL;
        if (!r->first_top || (e->state_bytes > 0 && !r->pull_state)) {
            req_free(r);
            return k3_err(err, K3_ERR_NOMEM, "submit: out of memory for a pulled KDA state");
        }
        if (r->rp.n_first_top)
            memcpy(r->first_top, p->remote->first_top, sizeof(k3_logprob) * (size_t)r->rp.n_first_top);
        r->rp.first_top = r->first_top;
    }
    r->p.remote = NULL;
    if (p->grammar) { /* a matcher of its own, at the start of the output */
        const k3_grammar_vocab *gv = r->gv = k3_grammar_get_vocab(p->grammar);
        st = k3_grammar_matcher_init(&r->gm, p->grammar, err);
        if (!st &&
            (!(r->mask = malloc(sizeof(uint64_t) * k3_grammar_mask_words(gv))) ||
             !(r->stop_raw = malloc(sizeof(float) * (size_t)(p->n_stop_ids + 1)))))
            st = k3_err(err, K3_ERR_NOMEM, "submit: out of memory for a grammar mask");
        if (st) {
            req_free(r);
            return st;
        }
    }
    r->p.grammar = NULL; /* the matcher holds the reference */
    memcpy(r->rq.tok, p->prompt, sizeof(int32_t) * (size_t)p->n_prompt);
    if (p->n_stop_ids) memcpy(r->stop_ids, p->stop_ids, sizeof(int32_t) * (size_t)p->n_stop_ids);
    r->p.prompt = r->rq.tok;
    r->p.stop_ids = r->stop_ids;
    r->p.extra_keys = r->rq.tok_extra;
    r->p.logprobs = p->logprobs;
    r->rq.n_tok = r->rq.n_prompt = p->n_prompt;
    r->rq.slot = -1;
    r->rq.read_cache = p->prompt_logprobs < 0;
    r->rq.plp = p->prompt_logprobs >= 0;
    r->rq.owner = r;
    r->stop_id = -1;
    for (int64_t i = 0; i < p->n_prompt; i++) k3_sampler_accept(r->smp, p->prompt[i]);
    r->t_arrival = k3_now();

    pthread_mutex_lock(&e->mu);
    if (e->o.max_waiting > 0 && e->n_sub + e->st.n_waiting >= e->o.max_waiting) {
        pthread_mutex_unlock(&e->mu);
        req_free(r);
        return k3_err(err, K3_ERR_BUSY, "submit: %d requests are waiting, the limit", e->o.max_waiting);
    }
    if (!push_ptr((void ***)&e->in_sub, &e->n_sub, &e->cap_sub, r)) {
        pthread_mutex_unlock(&e->mu);
        req_free(r);
        return k3_err(err, K3_ERR_NOMEM, "submit: out of memory");
    }
    r->rq.id = e->next_id++;
    if (id) *id = r->rq.id;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return K3_OK;
}

void k3_engine_cancel(k3_engine *e, uint64_t id) {
    pthread_mutex_lock(&e->mu);
    if (e->n_cancel == e->cap_cancel) {
        const int32_t nc = e->cap_cancel ? 2 * e->cap_cancel : 64;
        uint64_t *a = realloc(e->in_cancel, sizeof(uint64_t) * (size_t)nc);
        if (!a) { /* out of memory: the cancel is lost, the request ends normally */
            pthread_mutex_unlock(&e->mu);
            return;
        }
        e->in_cancel = a;
        e->cap_cancel = nc;
    }
    e->in_cancel[e->n_cancel++] = id;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* A hold that a step should free now (under mu). */
static bool hold_due(const hold *h, double now) { return h->pins == 0 && (h->released || now >= h->deadline); }

bool k3_engine_has_work(k3_engine *e) {
    const double now = k3_now();
    pthread_mutex_lock(&e->mu);
    bool w = e->n_sub > 0 || e->n_cancel > 0 || e->n_async > 0;
    for (int32_t i = 0; !w && i < e->n_holds; i++) w = hold_due(e->holds[i], now);
    pthread_mutex_unlock(&e->mu);
    /* remote requests waiting for blocks: only worth a step when some were freed */
    return w || e->sched.n_running > 0 || e->sched.n_waiting > 0 || e->n_done > 0 ||
        (e->n_rwait > 0 && !e->rwait_blocked);
}

void k3_engine_wait(k3_engine *e, double timeout_s) {
    pthread_mutex_lock(&e->mu);
    if (e->n_sub == 0 && e->n_cancel == 0 && e->n_async == 0 && timeout_s > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        const double t = (double)ts.tv_sec + ts.tv_nsec * 1e-9 + timeout_s;
        ts.tv_sec = (time_t)t;
        ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
        if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
        /* until something arrives or the time is up (spurious wake-ups wait on) */
        while (e->n_sub == 0 && e->n_cancel == 0 && e->n_async == 0)
            if (pthread_cond_timedwait(&e->cv, &e->mu, &ts) != 0) break;
    }
    pthread_mutex_unlock(&e->mu);
}

int64_t k3_engine_cache_bytes(const k3_engine *e) { return k3_ctx_cache_bytes(e->ctx); }

bool k3_engine_comm_stats(k3_engine *e, k3_comm_stats *out) {
    pthread_mutex_lock(&e->mu);
    *out = e->comm;
    pthread_mutex_unlock(&e->mu);
    return e->o.dist && k3_dist_size(e->o.dist) > 1;
}

void k3_engine_get_stats(k3_engine *e, k3_engine_stats *st) {
    pthread_mutex_lock(&e->mu);
    *st = e->st;
    st->n_waiting += e->n_sub;
    pthread_mutex_unlock(&e->mu);
}

k3_status k3_engine_set_kv_metrics(k3_engine *e, double sample_rate, k3_error *err) {
    pthread_mutex_lock(&e->mu);
    /* as vLLM: without prefix caching no block is ever evicted from the
     * cache, so the histograms exist and stay empty */
    const bool caching = !e->o.no_prefix_cache;
    const k3_status st = k3_kv_track_enable(&e->bm, caching ? sample_rate : 0, e->o.cache_salt, err);
    k3_kv_track_get(&e->bm, &e->kv_res);
    if (!st && !caching && sample_rate > 0 && sample_rate <= 1) {
        e->kv_res.enabled = true;
        e->kv_res.sample_rate = sample_rate;
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

int64_t k3_engine_cached_hashes(k3_engine *e, uint64_t *out, int64_t cap) {
    pthread_mutex_lock(&e->mu);
    int64_t n = 0;
    for (int32_t b = 0; b < e->bm.n_blocks; b++)
        if (e->bm.hashed[b] && n++ < cap) out[n - 1] = e->bm.hash[b];
    pthread_mutex_unlock(&e->mu);
    return n;
}

void k3_engine_set_kv_events(k3_engine *e, k3_kv_events *ev) {
    pthread_mutex_lock(&e->mu);
    k3_kv_set_observer(&e->bm, ev ? k3_kv_events_observer(ev, e->bm.block_size, e->sched.cfg.hash_seed) : NULL);
    pthread_mutex_unlock(&e->mu);
}

void k3_engine_kv_residency(k3_engine *e, k3_kv_residency *out) {
    pthread_mutex_lock(&e->mu);
    *out = e->kv_res;
    pthread_mutex_unlock(&e->mu);
}

/* ---- the step ------------------------------------------------------------------------------- */

/* A finished kv_hold request's blocks (a reference each) and end state
 * become a hold. Out of memory: no hold (the decode side is told there is none). */
static void make_hold(k3_engine *e, req *r, double t) {
    k3_rq *rq = &r->rq;
    hold *h = calloc(1, sizeof *h);
    if (h) h->blocks = malloc(sizeof(int32_t) * (size_t)(rq->n_blocks + 1));
    pthread_mutex_lock(&e->mu);
    const bool ok = h && h->blocks && push_ptr((void ***)&e->holds, &e->n_holds, &e->cap_holds, h);
    if (ok) {
        h->id = rq->id;
        h->n_blocks = rq->n_blocks;
        h->n_tokens = rq->n_prompt;
        memcpy(h->blocks, rq->blocks, sizeof(int32_t) * (size_t)rq->n_blocks);
        h->state = r->hold_state;
        r->hold_state = NULL;
        h->deadline = t + e->hold_timeout;
        h->queue_s = r->t_scheduled - r->t_arrival;
        h->prefill_s = (r->t_first_token > 0 ? r->t_first_token : t) - r->t_scheduled;
    }
    pthread_mutex_unlock(&e->mu);
    if (!ok) {
        hold_free(h);
        return;
    }
    for (int32_t b = 0; b < h->n_blocks; b++) k3_kv_ref(&e->bm, h->blocks[b]);
}

static void finish(k3_engine *e, req *r, k3_finish_reason why, double t) {
    if (r->finished) return;
    if (r->p.kv_hold && (why == K3_FINISH_STOP || why == K3_FINISH_LENGTH) && r->rq.n_computed >= r->rq.n_prompt &&
        (r->hold_captured || e->state_bytes == 0))
        make_hold(e, r, t);
    k3_sched_release(&e->sched, &r->rq);
    e->rwait_blocked = false; /* blocks were freed: a remote request may fit now */
    r->finished = true;
    r->finish = why;
    r->t_finished = t;
    r->rq.events |= K3_EV_FINISHED;
    e->finished_by[why]++;
}

/* log-softmax normaliser of a row */
static double log_norm(const float *x, int64_t n) {
    float mx = x[0];
    for (int64_t i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += exp((double)x[i] - mx);
    return mx + log(s);
}

/* the k most likely ids of a row, best first (ties to the lower id) */
static void top_k(const float *x, int64_t n, int k, double lse, k3_logprob *out) {
    int m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (m == k && !(x[i] > out[k - 1].logprob)) continue;
        int at = m < k ? m++ : k - 1;
        while (at > 0 && x[i] > out[at - 1].logprob) {
            out[at] = out[at - 1];
            at--;
        }
        out[at] = (k3_logprob){(int32_t)i, x[i]};
    }
    for (int i = 0; i < m; i++) out[i].logprob = (float)((double)out[i].logprob - lse);
}

static bool is_stop(const k3_engine *e, const req *r, int32_t id) {
    if (!r->p.ignore_eos)
        for (int32_t i = 0; i < e->n_eos; i++)
            if (e->eos[i] == id) return true;
    for (int32_t i = 0; i < r->p.n_stop_ids; i++)
        if (r->stop_ids[i] == id) return true;
    return false;
}

static bool is_eos(const k3_engine *e, int32_t id) {
    for (int32_t i = 0; i < e->n_eos; i++)
        if (e->eos[i] == id) return true;
    return false;
}

static bool is_stop_id(const req *r, int32_t id) {
    for (int32_t i = 0; i < r->p.n_stop_ids; i++)
        if (r->stop_ids[i] == id) return true;
    return false;
}

/* Whether r's grammar mask allows an id that is neither an EOS nor a stop id
 * (min_tokens holds the stops back only then: a complete text that can only
 * end would have nothing left to sample). */
static bool grammar_allows_text(const k3_engine *e, const req *r) {
    const k3_grammar_vocab *gv = r->gv;
    const size_t nw = k3_grammar_mask_words(gv);
    for (size_t w = 0; w < nw; w++)
        for (uint64_t b = r->mask[w]; b; b &= b - 1) {
            const int32_t id = (int32_t)(w * 64 + (size_t)__builtin_ctzll(b));
            if (id < e->V && !is_eos(e, id) && !is_stop_id(r, id)) return true;
        }
    return false;
}

/* Samples rq's next token from its logits row (with a grammar: under this
 * step's mask, r->mask). */
static void sample(k3_engine *e, req *r, float *lg, double t) {
    const int64_t V = e->V;
    bool complete = false;
    if (r->gm) {
        /* the mask on the raw row, so the logprobs are those of what may be
         * sampled; the stop ids, which the mask forbids unless the grammar
         * writes them, are allowed back where the text is complete */
        const double t0 = k3_now();
        complete = k3_grammar_matcher_is_complete(r->gm);
        for (int32_t i = 0; i < r->p.n_stop_ids; i++) r->stop_raw[i] = lg[r->stop_ids[i]];
        k3_grammar_mask_apply(r->gv, r->mask, lg, (int32_t)V);
        if (complete)
            for (int32_t i = 0; i < r->p.n_stop_ids; i++) lg[r->stop_ids[i]] = r->stop_raw[i];
        e->grammar_s += k3_now() - t0;
    }
    /* the sampler works in place: on a copy only when the raw row is still
     * needed for the logprobs (lg is this step's scratch, read by no one
     * after; a copy is V floats per request per step: 640 KB at K3's vocab) */
    float *row = lg;
    if (r->p.logprobs >= 0) {
        memcpy(e->row, lg, sizeof(float) * (size_t)V);
        row = e->row;
    }
    /* min_tokens: the stop ids cannot be generated before (as vLLM) */
    if (r->n_gen < r->p.min_tokens && (!r->gm || grammar_allows_text(e, r))) {
        if (!r->p.ignore_eos)
            for (int32_t i = 0; i < e->n_eos; i++) row[e->eos[i]] = -INFINITY;
        for (int32_t i = 0; i < r->p.n_stop_ids; i++) row[r->stop_ids[i]] = -INFINITY;
    }
    const int32_t id = k3_sampler_sample(r->smp, row);
    if (id < 0 || id >= V) { /* a sampler that refuses non-finite logits, or has every id masked */
        snprintf(r->error, sizeof r->error,
                 "request %llu has no token to sample: its logits are not finite, or every token is masked",
                 (unsigned long long)r->rq.id);
        finish(e, r, K3_FINISH_ERROR, t);
        return;
    }
    k3_sampler_accept(r->smp, id);
    if (r->p.logprobs >= 0) {
        const double lse = log_norm(lg, V);
        r->out_lp = (float)((double)lg[id] - lse);
        if (r->p.logprobs > 0) top_k(lg, V, r->p.logprobs, lse, r->out_top);
    }
    r->out_tok = id;
    r->n_new = 1;
    r->n_gen++;
    e->generation_tokens++;
    k3_rq *rq = &r->rq;
    rq->tok[rq->n_tok++] = id;
    k3_sched_hash(&e->sched, rq);
    if (r->n_gen == 1) {
        r->t_first_token = t;
        rq->events |= K3_EV_FIRST_TOKEN;
    }
    if (r->n_gen == 2 && r->remote) r->t_second = t;
    r->t_last = t;
    if (r->gm) {
        /* a stop id ends a complete text (it is not the grammar's); every
         * other token is the grammar's, and its end (an EOS accepted where
         * the text is complete) ends the request */
        k3_error gerr = {0};
        if (complete && is_stop_id(r, id) && !is_eos(e, id)) {
            r->stop_id = id;
            finish(e, r, K3_FINISH_STOP, t);
            return;
        }
        if (k3_grammar_matcher_accept(r->gm, id, &gerr)) {
            snprintf(r->error, sizeof r->error, "request %llu: the grammar refused token %d: %.400s",
                     (unsigned long long)rq->id, id, gerr.msg);
            finish(e, r, K3_FINISH_ERROR, t);
            return;
        }
        if (k3_grammar_matcher_is_ended(r->gm)) {
            r->stop_id = id;
            finish(e, r, K3_FINISH_STOP, t);
            return;
        }
    }
    if (!r->gm && is_stop(e, r, id) && r->n_gen >= r->p.min_tokens) {
        r->stop_id = id;
        finish(e, r, K3_FINISH_STOP, t);
    } else if (r->n_gen >= r->p.max_tokens || rq->n_tok >= e->max_model_len) {
        finish(e, r, K3_FINISH_LENGTH, t);
    }
}

/* Fills r->mask for each request of the plan that samples this step under
 * a grammar (lg_of set), all in one k3_grammar_fill_masks over the pool. A
 * matcher that is not at the output's end (the tokens it has accepted are
 * not those generated, which a recompute never changes) is rebuilt from
 * the tokens first. A request whose mask cannot be made fails alone. */
static void grammar_masks(k3_engine *e, int32_t n_plan, double t) {
    int32_t n = 0;
    const double t0 = k3_now();
    for (int32_t i = 0; i < n_plan; i++) {
        req *r = e->sched.plan[i]->owner;
        if (!e->lg_of[i] || !r->gm || r->finished) continue;
        if (k3_grammar_matcher_n_tokens(r->gm) != r->n_gen) {
            k3_error gerr = {0};
            size_t n_ok = 0;
            k3_grammar_matcher_reset(r->gm);
            if (k3_grammar_matcher_accept_tokens(r->gm, r->rq.tok + r->rq.n_prompt, (size_t)r->n_gen, &n_ok, &gerr)) {
                snprintf(r->error, sizeof r->error, "request %llu: its tokens do not match its grammar: %.400s",
                         (unsigned long long)r->rq.id, gerr.msg);
                finish(e, r, K3_FINISH_ERROR, t);
                continue;
            }
        }
        e->g_m[n] = r->gm;
        e->g_mask[n++] = r->mask;
    }
    if (!n) return;
    k3_error gerr = {0};
    if (k3_grammar_fill_masks(e->g_m, e->g_mask, n, e->o.pool, &gerr)) {
        /* one at a time, to fail only the requests whose masks fail */
        for (int32_t i = 0; i < n_plan; i++) {
            req *r = e->sched.plan[i]->owner;
            if (!e->lg_of[i] || !r->gm || r->finished) continue;
            k3_error one = {0};
            if (k3_grammar_matcher_fill_mask(r->gm, r->mask, &one)) {
                snprintf(r->error, sizeof r->error, "request %llu: no grammar mask: %.400s",
                         (unsigned long long)r->rq.id, one.msg);
                finish(e, r, K3_FINISH_ERROR, t);
            }
        }
    }
    e->grammar_steps++;
    e->grammar_masks += n;
    e->grammar_s += k3_now() - t0;
}

/* prompt logprobs from rows [0, n) of a chunk that starts at position c */
static void prompt_logprobs(k3_engine *e, req *r, const float *lg, int64_t c, int32_t n) {
    const int64_t V = e->V;
    const int32_t k = r->p.prompt_logprobs;
    for (int32_t i = 0; i < n; i++) {
        const int64_t p = c + i; /* row p predicts token p + 1 */
        if (p + 1 >= r->rq.n_prompt) break;
        const float *row = lg + (int64_t)i * V;
        const double lse = log_norm(row, V);
        r->plp[p] = (float)((double)row[r->rq.tok[p + 1]] - lse);
        if (k > 0) top_k(row, V, k, lse, r->plp_top + p * k);
    }
    if (c + n >= r->rq.n_prompt) r->plp_ready = true;
}

static void fill_output(const k3_engine *e, req *r, k3_req_output *o) {
    memset(o, 0, sizeof *o);
    o->id = r->rq.id;
    o->user = r->p.user;
    o->events = r->rq.events;
    o->n_new = r->n_new;
    o->tokens = r->n_new ? &r->out_tok : NULL;
    o->logprobs = r->n_new && r->p.logprobs >= 0 ? &r->out_lp : NULL;
    o->n_top = r->p.logprobs >= 0 ? r->p.logprobs : r->p.prompt_logprobs >= 0 ? r->p.prompt_logprobs : 0;
    o->top = r->n_new && r->p.logprobs > 0 ? r->out_top : NULL;
    if (r->plp_ready && !r->plp_reported) {
        o->n_prompt_logprobs = r->rq.n_prompt - 1;
        o->prompt_logprobs = r->plp;
        o->prompt_top = r->p.prompt_logprobs > 0 ? r->plp_top : NULL;
        r->plp_reported = true;
    }
    o->finish = r->finished ? r->finish : K3_FINISH_NONE;
    o->stop_id = r->stop_id;
    o->n_prompt = r->rq.n_prompt;
    o->n_cached = r->rq.n_cached;
    o->n_generated = r->n_gen;
    o->t_arrival = r->t_arrival;
    o->t_scheduled = r->t_scheduled;
    o->t_first_token = r->t_first_token;
    o->t_finished = r->t_finished;
    if (r->t_first_token > 0) {
        o->prefill_s = r->t_first_token - r->t_scheduled;
        o->decode_s = (r->finished ? r->t_finished : r->t_last) - r->t_first_token;
    } else if (r->t_scheduled > 0) {
        o->prefill_s = (r->finished ? r->t_finished : k3_now()) - r->t_scheduled;
    }
    o->error = r->finish == K3_FINISH_ERROR ? r->error : NULL;
    if (r->remote) {
        o->remote_queue_s = r->rp.queue_s;
        o->remote_prefill_s = r->rp.prefill_s;
        o->transfer_s = r->t_landed > 0 ? r->t_landed - r->t_pull0 : 0;
        o->first_step_s = r->t_second > 0 ? r->t_second - r->t_landed : 0;
    }
    (void)e;
}

static void publish_stats(k3_engine *e) {
    const k3_sched *s = &e->sched;
    pthread_mutex_lock(&e->mu);
    k3_engine_stats *st = &e->st;
    st->n_running = s->n_running;
    st->n_waiting = s->n_waiting;
    st->blocks_used = k3_kv_used(&e->bm);
    st->cache_usage = st->blocks_total ? (double)st->blocks_used / (double)st->blocks_total : 0.0;
    st->prefix_queries = s->prefix_queries;
    st->prefix_hits = s->prefix_hits;
    st->n_snapshots = e->sn.n;
    st->snapshot_bytes = k3_kv_snap_bytes(&e->sn);
    st->n_preemptions = s->n_preemptions;
    st->step_cost_max = s->guarded_cost_max;
    st->prefill_cost_p0 = e->cost_p0;
    st->prompt_tokens = e->prompt_tokens;
    st->generation_tokens = e->generation_tokens;
    memcpy(st->requests_finished, e->finished_by, sizeof st->requests_finished);
    st->n_snapshot_saves = e->n_snap_saves;
    st->n_snapshot_restores = e->n_snap_restores;
    st->snapshot_save_s = e->snap_save_s;
    st->snapshot_restore_s = e->snap_restore_s;
    st->n_holds = e->n_holds;
    st->hold_blocks = 0;
    for (int32_t i = 0; i < e->n_holds; i++) st->hold_blocks += e->holds[i]->n_blocks;
    st->holds_expired = e->holds_expired;
    st->holds_released = e->holds_released;
    st->n_pulls = e->n_pulls;
    st->pull_blocks = 0;
    for (int32_t i = 0; i < e->n_pulls; i++) st->pull_blocks += e->pulls[i]->rq.n_blocks;
    st->pulls_ok = e->pulls_ok;
    st->pulls_failed = e->pulls_failed;
    st->grammar_steps = e->grammar_steps;
    st->grammar_masks = e->grammar_masks;
    st->grammar_s = e->grammar_s;
    if (e->bm.track) k3_kv_track_get(&e->bm, &e->kv_res);
    pthread_mutex_unlock(&e->mu);
}

static void pull_hook(k3_engine *e, req *r, k3_pull_op op) {
    const k3_pull_info pi = {op, r->rq.id, r->rp.ctx, r->rq.n_cached, r->rq.n_prompt};
    if (e->pull_hook) e->pull_hook(e->pull_arg, &pi);
}

/* A remote request's pull has landed: its blocks enter the prefix cache as
 * if computed, the prefill instance's first token is its first output, and
 * it waits (with its blocks) to decode on. */
static void land(k3_engine *e, req *r, double t) {
    k3_sched *s = &e->sched;
    k3_rq *rq = &r->rq;
    const int32_t bs = e->block_size;
    rq->n_computed = rq->n_prompt;
    if (!e->o.no_prefix_cache) {
        while (rq->n_registered < rq->n_hash && (int64_t)(rq->n_registered + 1) * bs <= rq->n_computed) {
            const int32_t k = rq->n_registered++;
            k3_kv_register(&e->bm, rq->blocks[k], rq->hash[k], k ? rq->hash[k - 1] : s->cfg.hash_seed, rq->extra[k],
                           rq->tok + (int64_t)k * bs);
        }
        /* the state at the prompt's end is the snapshot a local prefill would keep there */
        if (e->state_bytes > 0 && rq->n_prompt % bs == 0 && rq->n_prompt / bs <= rq->n_hash) {
            void *buf = k3_kv_snap_put(&e->sn, rq->hash[rq->n_prompt / bs - 1], rq->n_prompt);
            if (buf) memcpy(buf, r->pull_state, (size_t)e->state_bytes);
        }
    }
    const int32_t id = r->rp.first_token;
    k3_sampler_take(r->smp, id);
    k3_sampler_accept(r->smp, id);
    r->out_tok = id;
    r->out_lp = r->rp.first_logprob;
    for (int32_t k = 0; k < r->p.logprobs; k++)
        r->out_top[k] = k < r->rp.n_first_top ? r->first_top[k] : (k3_logprob){-1, -INFINITY};
    r->n_new = 1;
    r->n_gen = 1;
    e->generation_tokens++;
    rq->tok[rq->n_tok++] = id;
    k3_sched_hash(s, rq);
    r->t_first_token = r->t_last = r->t_landed = t;
    rq->events |= K3_EV_FIRST_TOKEN;
    bool stop = is_stop(e, r, id) && r->n_gen >= r->p.min_tokens;
    if (r->gm) { /* the first token is the grammar's too, as a local first step takes it */
        k3_error gerr = {0};
        if (k3_grammar_matcher_is_complete(r->gm) && is_stop_id(r, id) && !is_eos(e, id)) {
            stop = true;
        } else if (k3_grammar_matcher_accept(r->gm, id, &gerr)) {
            snprintf(r->error, sizeof r->error,
                     "request %llu: the grammar refused token %d, the prefill instance's first: %.400s",
                     (unsigned long long)rq->id, id, gerr.msg);
            finish(e, r, K3_FINISH_ERROR, t);
            return;
        } else {
            stop = k3_grammar_matcher_is_ended(r->gm);
        }
    }
    if (stop) {
        r->stop_id = id;
        finish(e, r, K3_FINISH_STOP, t);
    } else if (r->n_gen >= r->p.max_tokens || rq->n_tok >= e->max_model_len) {
        finish(e, r, K3_FINISH_LENGTH, t);
    } else {
        rq->landed_state = e->state_bytes > 0 ? r->pull_state : NULL;
        if (k3_sched_add_landed(s, rq, NULL)) {
            snprintf(r->error, sizeof r->error, "out of memory for the queue");
            finish(e, r, K3_FINISH_ERROR, t);
        }
    }
}

/* Frees the holds that are due. */
static void step_holds(k3_engine *e, double t) {
    pthread_mutex_lock(&e->mu);
    for (int32_t i = 0; i < e->n_holds;) {
        hold *h = e->holds[i];
        if (!hold_due(h, t)) {
            i++;
            continue;
        }
        if (!h->released) e->holds_expired++;
        e->holds[i] = e->holds[--e->n_holds];
        for (int32_t b = h->n_blocks - 1; b >= 0; b--) k3_kv_unref(&e->bm, h->blocks[b]);
        hold_free(h);
        e->rwait_blocked = false;
    }
    pthread_mutex_unlock(&e->mu);
}

/* Lands or ends the pulls that are over (after the step's forward pass: a
 * landed request's first output is this step's, its first decode the next's). */
static void step_pulls(k3_engine *e, double t) {
    pthread_mutex_lock(&e->mu);
    req **over = e->n_pulls ? malloc(sizeof(req *) * (size_t)e->n_pulls) : NULL;
    int32_t n_over = 0;
    for (int32_t i = 0; over && i < e->n_pulls;) {
        req *r = e->pulls[i];
        if (r->pull_phase != PULL_OK && r->pull_phase != PULL_FAILED) {
            i++;
            continue;
        }
        over[n_over++] = r;
        if (r->pull_phase == PULL_OK && !r->pull_cancel) e->pulls_ok++;
        else e->pulls_failed++;
        memmove(e->pulls + i, e->pulls + i + 1, sizeof(req *) * (size_t)(e->n_pulls - i - 1));
        e->n_pulls--;
    }
    e->n_async = 0;
    pthread_mutex_unlock(&e->mu);
    for (int32_t i = 0; i < n_over; i++) {
        req *r = over[i];
        const int phase = r->pull_phase;
        r->pull_phase = PULL_NONE;
        if (r->finished) continue;
        if (r->pull_cancel) {
            finish(e, r, K3_FINISH_CANCELLED, t);
        } else if (phase == PULL_OK) {
            land(e, r, t);
        } else {
            snprintf(r->error, sizeof r->error, "%s",
                     r->pull_err[0] ? r->pull_err : "the pull from the prefill instance failed");
            finish(e, r, K3_FINISH_ERROR, t);
        }
    }
    free(over);
}

/* Remote requests in arrival order get their blocks while they fit. */
static void step_rwait(k3_engine *e, double t) {
    while (e->n_rwait > 0) {
        req *r = e->rwait[0];
        if (!k3_sched_remote_alloc(&e->sched, &r->rq)) {
            e->rwait_blocked = true;
            return;
        }
        memmove(e->rwait, e->rwait + 1, sizeof(req *) * (size_t)(e->n_rwait - 1));
        e->n_rwait--;
        r->t_pull0 = r->t_scheduled = t;
        r->rq.events |= K3_EV_SCHEDULED;
        pthread_mutex_lock(&e->mu);
        const bool ok = push_ptr((void ***)&e->pulls, &e->n_pulls, &e->cap_pulls, r);
        if (ok) r->pull_phase = PULL_ACTIVE;
        pthread_mutex_unlock(&e->mu);
        if (!ok) {
            snprintf(r->error, sizeof r->error, "out of memory for the pull list");
            r->pull_phase = PULL_NONE;
            finish(e, r, K3_FINISH_ERROR, t);
            pull_hook(e, r, K3_PULL_ABORT);
            continue;
        }
        pull_hook(e, r, K3_PULL_START);
    }
}

static k3_status step(k3_engine *e, k3_step_result *res, k3_error *err);

k3_status k3_engine_step(k3_engine *e, k3_step_result *res, k3_error *err) {
    if (!e->exec_lock) return step(e, res, err);
    pthread_mutex_lock(&e->exec_mu);
    const k3_status st = step(e, res, err);
    pthread_mutex_unlock(&e->exec_mu);
    return st;
}

static k3_status step(k3_engine *e, k3_step_result *res, k3_error *err) {
    memset(res, 0, sizeof *res);
    k3_sched *s = &e->sched;

    /* 1. what finished last step goes now */
    for (int32_t i = 0; i < e->n_done; i++) {
        req *r = e->done[i];
        for (int32_t j = 0; j < e->n_live; j++)
            if (e->live[j] == r) {
                e->live[j] = e->live[--e->n_live];
                break;
            }
        req_free(r);
    }
    e->n_done = 0;
    for (int32_t i = 0; i < e->n_live; i++) {
        e->live[i]->rq.events = 0;
        e->live[i]->n_new = 0;
    }
    step_holds(e, k3_now());

    /* the inbox */
    pthread_mutex_lock(&e->mu);
    req **subs = e->in_sub;
    const int32_t n_subs = e->n_sub;
    uint64_t *cancels = e->in_cancel;
    const int32_t n_cancels = e->n_cancel;
    e->in_sub = NULL;
    e->n_sub = e->cap_sub = 0;
    e->in_cancel = NULL;
    e->n_cancel = e->cap_cancel = 0;
    pthread_mutex_unlock(&e->mu);
    k3_status st = K3_OK;
    for (int32_t i = 0; i < n_subs; i++) {
        req *r = subs[i];
        if (st || !push_ptr((void ***)&e->live, &e->n_live, &e->cap_live, r)) {
            st = st ? st : k3_err(err, K3_ERR_NOMEM, "step: out of memory for the request list");
            if (r->remote) pull_hook(e, r, K3_PULL_ABORT);
            req_free(r);
            continue;
        }
        r->rq.events |= K3_EV_QUEUED;
        k3_sched_hash(s, &r->rq);
        if (r->remote) {
            if (push_ptr((void ***)&e->rwait, &e->n_rwait, &e->cap_rwait, r)) {
                r->pull_phase = PULL_WAIT;
                continue;
            }
            snprintf(r->error, sizeof r->error, "out of memory for the queue");
            r->finished = true;
            r->finish = K3_FINISH_ERROR;
            r->rq.state = K3_RQ_DONE;
            r->rq.events |= K3_EV_FINISHED;
            e->finished_by[K3_FINISH_ERROR]++;
            pull_hook(e, r, K3_PULL_ABORT);
        } else if (k3_sched_add(s, &r->rq, NULL)) {
            snprintf(r->error, sizeof r->error, "out of memory for the queue");
            r->finished = true;
            r->finish = K3_FINISH_ERROR;
            r->rq.state = K3_RQ_DONE;
            r->rq.events |= K3_EV_FINISHED;
            e->finished_by[K3_FINISH_ERROR]++;
        }
    }
    free(subs);
    const double t_in = k3_now();
    for (int32_t i = 0; i < n_cancels; i++)
        for (int32_t j = 0; j < e->n_live; j++) {
            req *r = e->live[j];
            if (r->rq.id != cancels[i] || r->finished) continue;
            if (r->pull_phase == PULL_WAIT) { /* no blocks yet: nothing to fetch */
                for (int32_t k = 0; k < e->n_rwait; k++)
                    if (e->rwait[k] == r) {
                        memmove(e->rwait + k, e->rwait + k + 1, sizeof(req *) * (size_t)(e->n_rwait - k - 1));
                        e->n_rwait--;
                        break;
                    }
                r->pull_phase = PULL_NONE;
                finish(e, r, K3_FINISH_CANCELLED, t_in);
                pull_hook(e, r, K3_PULL_ABORT);
            } else if (r->pull_phase != PULL_NONE) { /* its blocks are being written: ended once the pull stops */
                pthread_mutex_lock(&e->mu);
                r->pull_cancel = true;
                pthread_mutex_unlock(&e->mu);
                pull_hook(e, r, K3_PULL_CANCEL);
            } else {
                finish(e, r, K3_FINISH_CANCELLED, t_in);
            }
        }
    free(cancels);
    step_rwait(e, t_in);

    /* 2. plan and set the slots up */
    k3_sched_schedule(s);
    int32_t n_rows = 0;
    for (int32_t i = 0; i < s->n_plan; i++) {
        k3_rq *rq = s->plan[i];
        req *r = rq->owner;
        if (rq->is_new) {
            if (rq->restore) {
                const double t0 = k3_now();
                k3_exec_state_restore(e->ctx, rq->slot, rq->restore);
                e->snap_restore_s += k3_now() - t0;
                e->n_snap_restores++;
            } else {
                k3_exec_seq_clear_state(e->ctx, rq->slot);
            }
            k3_exec_seq_set_pos(e->ctx, rq->slot, rq->n_computed);
            if (r->t_scheduled == 0) r->t_scheduled = t_in;
        }
        K3_ASSERT(k3_exec_seq_set_blocks(e->ctx, rq->slot, rq->blocks, rq->n_blocks, NULL) == K3_OK);
        e->batch[i] =
            (k3_batch_seq){rq->slot, rq->n_sched, rq->tok + rq->n_computed, r->emb ? r->emb + rq->n_computed : NULL};
        const bool ends = rq->n_computed + rq->n_sched == rq->n_tok;
        if (rq->plp && rq->n_computed < rq->n_prompt) {
            e->want[i] = K3_WANT_ALL;
            n_rows += rq->n_sched;
        } else {
            e->want[i] = ends ? K3_WANT_LAST : K3_WANT_NONE;
            n_rows += ends;
        }
    }
    K3_ASSERT(n_rows <= e->o.max_num_seqs + e->plp_cap);

    /* the KDA snapshots this step's tokens cross, captured inside the pass
     * (after the restores above: a new entry may evict an old one); never
     * more than the budget holds, so no two share a buffer */
    k3_error ferr = {0};
    k3_status fst = K3_OK;
    int32_t n_taken = 0;
    const double t_snap = k3_now();
    int64_t *pos = e->snap_pos, *step_pos = e->snap_pos + e->req_snaps;
    uint64_t *key = e->snap_key, *step_key = e->snap_key + e->req_snaps;
    for (int32_t i = 0; i < s->n_plan; i++) {
        k3_rq *rq = s->plan[i];
        req *r = rq->owner;
        /* a request kept for a decode instance: its state where the prompt ends */
        if (r->hold_state && rq->n_computed < rq->n_prompt && rq->n_computed + rq->n_sched >= rq->n_prompt)
            r->hold_captured = !k3_ctx_capture_state(e->ctx, rq->slot, rq->n_prompt, r->hold_state, NULL);
        const int32_t n = k3_sched_snap_points(s, rq, pos, key, e->req_snaps);
        const int32_t room = e->step_snaps - n_taken;
        /* over the room keep the last ones (the prompt's end) */
        for (int32_t k = n > room ? n - room : 0; k < n; k++) {
            void *buf = k3_kv_snap_put(&e->sn, key[k], pos[k]);
            if (!buf) continue; /* out of memory: no snapshot there */
            if (k3_ctx_capture_state(e->ctx, rq->slot, pos[k], buf, NULL)) {
                k3_kv_snap_drop(&e->sn, key[k], pos[k]); /* the same: a shorter hit later */
                continue;
            }
            step_pos[n_taken] = pos[k];
            step_key[n_taken++] = key[k];
        }
    }
    e->snap_save_s += k3_now() - t_snap;

    /* 3. the forward pass */
    if (s->n_plan) fst = k3_exec_run(e->ctx, e->batch, s->n_plan, e->want, e->logits, &ferr);
    if (fst)
        for (int32_t k = 0; k < n_taken; k++) k3_kv_snap_drop(&e->sn, step_key[k], step_pos[k]);
    if (fst)
        for (int32_t i = 0; i < s->n_plan; i++) ((req *)s->plan[i]->owner)->hold_captured = false;
    else e->n_snap_saves += n_taken;
    const double t = k3_now();
    res->n_tokens = fst ? 0 : s->plan_tokens;
    if (e->o.dist && s->n_plan) {
        /* every rank's, summed (a failed link is sticky: the next pass reports it) */
        k3_comm_stats c;
        k3_exec_stats_take_all(e->o.dist, NULL, &c, NULL);
        pthread_mutex_lock(&e->mu);
        for (int k = 0; k < K3_COMM_COUNT; k++) {
            e->comm.sent[k] += c.sent[k];
            e->comm.recv[k] += c.recv[k];
            e->comm.calls[k] += c.calls[k];
            e->comm.seconds[k] += c.seconds[k];
        }
        pthread_mutex_unlock(&e->mu);
    }

    /* 4. results */
    int64_t row = 0;
    const int32_t n_plan = s->n_plan;
    for (int32_t i = 0; i < n_plan; i++) {
        k3_rq *rq = s->plan[i];
        req *r = rq->owner;
        if (fst) {
            snprintf(r->error, sizeof r->error, "%s", ferr.msg);
            finish(e, r, K3_FINISH_ERROR, t);
            continue;
        }
        const int64_t c = rq->n_computed;
        const int32_t n = rq->n_sched;
        if (c < rq->n_prompt) e->prompt_tokens += (c + n < rq->n_prompt ? c + n : rq->n_prompt) - c;
        k3_sched_computed(s, rq);
        float *lg = NULL;
        if (e->want[i] == K3_WANT_ALL) {
            prompt_logprobs(e, r, e->logits + row * e->V, c, n);
            lg = e->logits + (row + n - 1) * e->V;
            row += n;
        } else if (e->want[i] == K3_WANT_LAST) {
            lg = e->logits + row * e->V;
            row++;
        }
        e->lg_of[i] = NULL;
        if (rq->n_computed == rq->n_tok) { /* the prefill (or the last token) is done */
            if (r->p.max_tokens == 0) finish(e, r, K3_FINISH_LENGTH, t);
            else e->lg_of[i] = lg;
        }
    }
    /* the grammar masks of every constrained request that samples now, in
     * one call over the pool, so that they do not queue behind each other */
    if (!fst) grammar_masks(e, n_plan, t);
    for (int32_t i = 0; i < n_plan; i++) {
        req *r = s->plan[i]->owner;
        if (!fst && e->lg_of[i] && !r->finished) sample(e, r, e->lg_of[i], t);
    }

    step_pulls(e, k3_now());

    /* outputs: every live request with something to say */
    int32_t n_out = 0;
    for (int32_t i = 0; i < e->n_live; i++) n_out += e->live[i]->rq.events || e->live[i]->n_new;
    if (n_out > e->cap_outs) {
        k3_req_output *o = realloc(e->outs, sizeof(k3_req_output) * (size_t)n_out);
        if (!o) return k3_err(err, K3_ERR_NOMEM, "step: out of memory for %d outputs", n_out);
        e->outs = o;
        e->cap_outs = n_out;
    }
    n_out = 0;
    for (int32_t i = 0; i < e->n_live; i++) {
        req *r = e->live[i];
        if (!r->rq.events && !r->n_new) continue;
        fill_output(e, r, &e->outs[n_out++]);
        if (r->finished && !push_ptr((void ***)&e->done, &e->n_done, &e->cap_done, r))
            st = st ? st : k3_err(err, K3_ERR_NOMEM, "step: out of memory");
    }
    res->n_outputs = n_out;
    res->outputs = e->outs;
    res->t = t;
    publish_stats(e);
    /* a failed link to the other ranks stays failed: the engine cannot go on
     * (the requests of this step have their error; the server ends the job) */
    if (!st && fst && k3_exec_failed(e->ctx, NULL)) st = k3_err(err, fst, "%s", ferr.msg);
    return st;
}

/* ---- introspection for tests and the bench -------------------------------------------------- */

int64_t k3_engine_blocks_free(const k3_engine *e) { return e->bm.n_free; }

bool k3_engine_check(const k3_engine *e) {
    if (!k3_kv_check(&e->bm)) return false;
    int64_t refs = 0, held = k3_sched_blocks_held(&e->sched);
    for (int32_t b = 0; b < e->bm.n_blocks; b++) refs += e->bm.ref[b];
    /* and the holds kept for decode instances, the pulls in flight */
    for (int32_t i = 0; i < e->n_holds; i++) held += e->holds[i]->n_blocks;
    for (int32_t i = 0; i < e->n_pulls; i++) held += e->pulls[i]->rq.n_blocks;
    return refs == held;
}

/* ---- prefill and decode apart (k3.h) ------------------------------------------------------ */

void k3_engine_set_pull_hook(k3_engine *e, k3_pull_hook fn, void *arg) {
    e->pull_hook = fn;
    e->pull_arg = arg;
}

int64_t k3_engine_kv_bytes(const k3_engine *e, int32_t layer, int64_t n) { return k3_ctx_kv_bytes(e->ctx, layer, n); }

int64_t k3_engine_state_bytes(const k3_engine *e) { return e->state_bytes; }

/* The pulling request id (under mu), or NULL. */
static req *find_pull(const k3_engine *e, uint64_t id) {
    for (int32_t i = 0; i < e->n_pulls; i++)
        if (e->pulls[i]->rq.id == id) return e->pulls[i];
    return NULL;
}

/* Pins request id's pull for a write (under mu), or fails saying why. */
static k3_status pull_pin(k3_engine *e, uint64_t id, req **out, k3_error *err) {
    req *r = find_pull(e, id);
    if (!r || r->pull_phase != PULL_ACTIVE)
        return k3_err(err, K3_ERR_ARG, "pull: request %llu is not pulling", (unsigned long long)id);
    if (r->pull_cancel) return k3_err(err, K3_ERR_ARG, "pull: request %llu was cancelled", (unsigned long long)id);
    r->pull_pins++;
    *out = r;
    return K3_OK;
}

k3_status k3_engine_pull_write(k3_engine *e, uint64_t id, int32_t layer, int64_t t0, int32_t n, const void *rows,
                               int64_t bytes, k3_error *err) {
    req *r = NULL;
    pthread_mutex_lock(&e->mu);
    k3_status st = pull_pin(e, id, &r, err);
    pthread_mutex_unlock(&e->mu);
    if (st) return st;
    const k3_rq *rq = &r->rq;
    const int64_t want = k3_ctx_kv_bytes(e->ctx, layer, n);
    if (want <= 0 && n > 0) st = k3_err(err, K3_ERR_ARG, "pull: layer %d is not an MLA/DSA layer of this model", layer);
    else if (t0 < rq->n_cached || n < 0 || t0 + n > rq->n_prompt)
        st = k3_err(err, K3_ERR_ARG, "pull: positions [%lld, %lld) are outside [%lld, %lld), what request %llu fetches",
                    (long long)t0, (long long)(t0 + n), (long long)rq->n_cached, (long long)rq->n_prompt,
                    (unsigned long long)id);
    else if (bytes != want)
        st = k3_err(err, K3_ERR_ARG,
                    "pull: %lld bytes for %d tokens of layer %d, where this instance's cache holds %lld",
                    (long long)bytes, n, layer, (long long)want);
    if (!st && n > 0) {
        const int32_t b0 = (int32_t)(t0 / e->block_size);
        if (e->exec_lock) pthread_mutex_lock(&e->exec_mu);
        st = k3_exec_kv_write(e->ctx, rq->blocks + b0, rq->n_blocks - b0, layer, t0 - (int64_t)b0 * e->block_size, n,
                              rows, err);
        if (e->exec_lock) pthread_mutex_unlock(&e->exec_mu);
    }
    pthread_mutex_lock(&e->mu);
    r->pull_pins--;
    pthread_mutex_unlock(&e->mu);
    return st;
}

k3_status k3_engine_pull_state(k3_engine *e, uint64_t id, int64_t offset, const void *part, int64_t bytes,
                               k3_error *err) {
    req *r = NULL;
    pthread_mutex_lock(&e->mu);
    k3_status st = pull_pin(e, id, &r, err);
    if (!st && (offset < 0 || bytes < 0 || offset + bytes > e->state_bytes))
        st = k3_err(err, K3_ERR_ARG, "pull: KDA state bytes [%lld, %lld), where this model's state is %lld bytes",
                    (long long)offset, (long long)(offset + bytes), (long long)e->state_bytes);
    pthread_mutex_unlock(&e->mu);
    if (st) {
        if (r) {
            pthread_mutex_lock(&e->mu);
            r->pull_pins--;
            pthread_mutex_unlock(&e->mu);
        }
        return st;
    }
    if (bytes > 0) memcpy((char *)r->pull_state + offset, part, (size_t)bytes);
    pthread_mutex_lock(&e->mu);
    r->pull_state_got += bytes;
    r->pull_pins--;
    pthread_mutex_unlock(&e->mu);
    return K3_OK;
}

void k3_engine_pull_done(k3_engine *e, uint64_t id, bool ok, const char *why) {
    pthread_mutex_lock(&e->mu);
    req *r = find_pull(e, id);
    if (r && r->pull_phase == PULL_ACTIVE) {
        if (ok && r->pull_state_got != e->state_bytes) {
            ok = false;
            why = "the prefill instance sent no KDA state, or part of it";
        }
        r->pull_phase = ok ? PULL_OK : PULL_FAILED;
        snprintf(r->pull_err, sizeof r->pull_err, "%s", why ? why : "");
        e->n_async++;
        pthread_cond_broadcast(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
}

static hold *find_hold(const k3_engine *e, uint64_t id) {
    for (int32_t i = 0; i < e->n_holds; i++)
        if (e->holds[i]->id == id && !e->holds[i]->released) return e->holds[i];
    return NULL;
}

k3_status k3_engine_hold_get(k3_engine *e, uint64_t id, k3_hold_info *out, int32_t *blocks, int32_t cap,
                             k3_error *err) {
    pthread_mutex_lock(&e->mu);
    const hold *h = find_hold(e, id);
    if (h) {
        *out = (k3_hold_info){h->n_tokens, h->n_blocks, e->state_bytes, h->queue_s, h->prefill_s};
        if (blocks) memcpy(blocks, h->blocks, sizeof(int32_t) * (size_t)(h->n_blocks < cap ? h->n_blocks : cap));
    }
    pthread_mutex_unlock(&e->mu);
    return h ? K3_OK
             : k3_err(err, K3_ERR_ARG, "hold %llu is not held here (never made, released, or timed out)",
                      (unsigned long long)id);
}

/* Pins hold id for a read (under mu). */
static hold *hold_pin(k3_engine *e, uint64_t id, k3_error *err) {
    pthread_mutex_lock(&e->mu);
    hold *h = find_hold(e, id);
    if (h) h->pins++;
    pthread_mutex_unlock(&e->mu);
    if (!h)
        k3_err(err, K3_ERR_ARG, "hold %llu is not held here (never made, released, or timed out)",
               (unsigned long long)id);
    return h;
}

static void hold_unpin(k3_engine *e, hold *h) {
    pthread_mutex_lock(&e->mu);
    h->pins--;
    if (h->released) {
        e->n_async++;
        pthread_cond_broadcast(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
}

k3_status k3_engine_hold_read(k3_engine *e, uint64_t id, int32_t layer, int64_t t0, int32_t n, void *rows,
                              int64_t bytes, k3_error *err) {
    hold *h = hold_pin(e, id, err);
    if (!h) return K3_ERR_ARG;
    const int64_t want = k3_ctx_kv_bytes(e->ctx, layer, n);
    k3_status st = K3_OK;
    if (want <= 0 && n > 0) st = k3_err(err, K3_ERR_ARG, "hold: layer %d is not an MLA/DSA layer of this model", layer);
    else if (t0 < 0 || n < 0 || t0 + n > h->n_tokens)
        st = k3_err(err, K3_ERR_ARG, "hold: positions [%lld, %lld) are outside the %lld tokens it holds", (long long)t0,
                    (long long)(t0 + n), (long long)h->n_tokens);
    else if (bytes != want)
        st = k3_err(err, K3_ERR_ARG, "hold: %lld bytes for %d tokens of layer %d, where they are %lld",
                    (long long)bytes, n, layer, (long long)want);
    if (!st && n > 0) {
        const int32_t b0 = (int32_t)(t0 / e->block_size);
        const int64_t rel = t0 - (int64_t)b0 * e->block_size;
        if (e->ctx->dcp > 1) { /* every rank's share, through the executor */
            pthread_mutex_lock(&e->exec_mu);
            st = k3_exec_kv_gather(e->ctx, h->blocks + b0, h->n_blocks - b0, layer, rel, n, rows, err);
            pthread_mutex_unlock(&e->exec_mu);
        } else { /* rank 0 caches every position (one process, or EP alone) */
            st = k3_ctx_kv_read(e->ctx, h->blocks + b0, h->n_blocks - b0, layer, rel, n, rows, err);
        }
    }
    hold_unpin(e, h);
    return st;
}

k3_status k3_engine_hold_read_state(k3_engine *e, uint64_t id, int64_t offset, void *part, int64_t bytes,
                                    k3_error *err) {
    hold *h = hold_pin(e, id, err);
    if (!h) return K3_ERR_ARG;
    k3_status st = K3_OK;
    if (offset < 0 || bytes < 0 || offset + bytes > e->state_bytes)
        st = k3_err(err, K3_ERR_ARG, "hold: KDA state bytes [%lld, %lld), where a state is %lld bytes here",
                    (long long)offset, (long long)(offset + bytes), (long long)e->state_bytes);
    else if (bytes > 0) memcpy(part, (char *)h->state + offset, (size_t)bytes);
    hold_unpin(e, h);
    return st;
}

int k3_engine_kv_arrays(const k3_engine *e, int32_t layer, k3_kv_array out[5]) {
    void *base[5];
    int64_t len[5];
    const int n = k3_ctx_kv_block_ranges(e->ctx, layer, 0, base, len);
    for (int c = 0; c < n; c++) out[c] = (k3_kv_array){base[c], len[c] * e->ctx->n_blocks, len[c] / e->ctx->lbs};
    return n;
}

bool k3_engine_kv_direct(const k3_engine *e, bool write) { return write ? !e->exec_lock : e->ctx->dcp == 1; }

k3_status k3_engine_hold_pin(k3_engine *e, uint64_t id, k3_kv_pin *out, k3_error *err) {
    hold *h = hold_pin(e, id, err);
    if (!h) return K3_ERR_ARG;
    *out = (k3_kv_pin){h->blocks, h->n_blocks, e->block_size, 0, h->n_tokens, h->state, e->state_bytes, h};
    return K3_OK;
}

void k3_engine_hold_unpin(k3_engine *e, k3_kv_pin *pin) {
    if (pin && pin->ref) hold_unpin(e, pin->ref);
    if (pin) pin->ref = NULL;
}

k3_status k3_engine_pull_pin(k3_engine *e, uint64_t id, k3_kv_pin *out, k3_error *err) {
    if (!k3_engine_kv_direct(e, true))
        return k3_err(err, K3_ERR_UNSUPPORTED, "pull: several ranks keep this cache: it is written through them");
    req *r = NULL;
    pthread_mutex_lock(&e->mu);
    const k3_status st = pull_pin(e, id, &r, err);
    pthread_mutex_unlock(&e->mu);
    if (st) return st;
    *out = (k3_kv_pin){r->rq.blocks,   r->rq.n_blocks, e->block_size,  r->rq.n_cached,
                       r->rq.n_prompt, r->pull_state,  e->state_bytes, r};
    return K3_OK;
}

void k3_engine_pull_unpin(k3_engine *e, k3_kv_pin *pin, int64_t state_landed) {
    if (!pin || !pin->ref) return;
    req *r = pin->ref;
    pthread_mutex_lock(&e->mu);
    r->pull_state_got += state_landed;
    r->pull_pins--;
    pthread_mutex_unlock(&e->mu);
    pin->ref = NULL;
}

void k3_engine_hold_release(k3_engine *e, uint64_t id) {
    pthread_mutex_lock(&e->mu);
    hold *h = find_hold(e, id);
    if (h) {
        h->released = true;
        e->holds_released++;
        e->n_async++;
        pthread_cond_broadcast(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
}
