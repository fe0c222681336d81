/*
 * engine.c -- the k3_engine API of k3.h: many requests on one model.
 *
 * The engine owns a context made with k3_ctx_init_pool (cache storage for
 * the pool's blocks, one sequence slot per running request), the block
 * manager and KDA snapshots (src/kv), the scheduler (src/sched), the
 * proposers of speculative decoding (src/spec) and its KV connectors
 * (connector.h; prefill/decode disaggregation's is pd.c). It drives the
 * context through the executor (src/executor), which under mpirun makes
 * every call on every rank. This file is the API around the step: open,
 * close, submit, cancel, waiting, stats. The step is step.c, a request's
 * tokens token.c, speculation's part of the step draft.c (internal.h).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/error.h"
#include "engine/engine.h"
#include "engine/internal.h"
#include "executor/executor.h"
#include "kvevents/events.h"
#include "kvstore/kvstore.h"
#include "model/model.h"
#include "model/plan.h"

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

void k3_engine_req_free(req *r) {
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
    free(r->disk_state);
    k3_kvs_hit_free(r->disk_hit);
    k3_grammar_matcher_free(r->gm);
    free(r->mask);
    free(r->stop_raw);
    free(r);
}

bool k3_engine_push_ptr(void ***arr, int32_t *n, int32_t *cap, void *p) {
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

void k3_engine_notify_locked(k3_engine *e) {
    e->n_async++;
    pthread_cond_broadcast(&e->cv);
}

/* ---- open / close ------------------------------------------------------------------ */

void k3_engine_close(k3_engine *e) {
    if (!e) return;
    /* the connectors first: the disk tier's threads stop writing into requests' buffers */
    for (int32_t i = 0; i < e->n_conn; i++) e->conn[i]->close(e->conn[i]->self);
    for (int32_t i = 0; i < e->n_live; i++) {
        if (e->live[i]->spec) k3_spec_seq_close(e->prop, e->live[i]->spec, false);
        k3_engine_req_free(e->live[i]);
    }
    for (int32_t i = 0; i < e->n_sub; i++) k3_engine_req_free(e->in_sub[i]);
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
    free(e->snap_req);
    free(e->reg_before);
    free(e->eos);
    k3_engine_spec_close(e);
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
    /* draft rows per step (verify chunks' logits): at most ~64 MB of logits,
     * 16 rows at least (at K3's vocabulary ~100 rows) */
    int64_t dr = ((int64_t)16 << 20) / e->V;
    e->spec_rows_cap = (int32_t)(dr < 16                                        ? 16
                                     : dr > o.max_num_seqs * K3_SPEC_MAX_TOKENS ? o.max_num_seqs * K3_SPEC_MAX_TOKENS
                                                                                : dr);

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
        /* a decode's row, or a verify chunk's k + 1 rows, per request */
        e->logits = malloc(sizeof(float) * (size_t)((o.max_num_seqs + e->spec_rows_cap + e->plp_cap) * e->V));
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
        e->snap_req = malloc(sizeof(req *) * (size_t)(step + 1));
        e->reg_before = malloc(sizeof(int32_t) * (size_t)o.max_num_seqs);
        if (!e->batch || !e->want || !e->logits || !e->row || !e->g_m || !e->g_mask || !e->lg_of || !e->snap_pos ||
            !e->snap_key || !e->snap_req || !e->reg_before)
            st = k3_err(err, K3_ERR_NOMEM, "engine: out of memory");
    }
    if (!st) st = k3_engine_spec_open(e, err);
    if (!st && (st = k3_pd_conn_open(e, &e->conn[e->n_conn], err)) == K3_OK) e->n_conn++;
    if (!st && o.kv_cache_dir && (st = k3_disk_conn_open(e, &e->conn[e->n_conn], err)) == K3_OK) e->n_conn++;
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
    e->st.spec_k = e->o.num_speculative_tokens;
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
        if (!k3_engine_has_pull_hook(e))
            return k3_err(err, K3_ERR_UNSUPPORTED,
                          "submit: this engine has no pull hook: it cannot fetch a "
                          "prompt's cache from a prefill instance");
    }
    if (p->speculative < K3_SPEC_DEFAULT || p->speculative > K3_SPEC_DRAFT_MODEL)
        return k3_err(err, K3_ERR_ARG, "submit: unknown speculative method %d", (int)p->speculative);
    if (p->num_speculative_tokens < 0 || p->num_speculative_tokens > K3_SPEC_MAX_TOKENS)
        return k3_err(err, K3_ERR_RANGE, "submit: num_speculative_tokens %d is not in 0..%d", p->num_speculative_tokens,
                      K3_SPEC_MAX_TOKENS);
    if (p->speculative == K3_SPEC_DRAFT_MODEL && !e->o.draft_model)
        return k3_err(err, K3_ERR_UNSUPPORTED,
                      "submit: speculative method draft_model asked, but this engine has no draft model");
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
        k3_engine_req_free(r);
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
    r->out_top = malloc(sizeof(k3_logprob) * (size_t)((K3_SPEC_MAX_TOKENS + 1) * n_top + 1));
    if (p->prompt_logprobs >= 0) {
        r->plp = calloc((size_t)p->n_prompt, sizeof(float));
        r->plp_top = calloc((size_t)(p->n_prompt * (n_top + 1)), sizeof(k3_logprob));
    }
    if (!r->rq.tok || !r->rq.blocks || !r->rq.hash || !r->rq.extra || (p->extra_keys && !tx) || !r->stop_ids ||
        !r->out_top || (p->prompt_logprobs >= 0 && (!r->plp || !r->plp_top))) {
        k3_engine_req_free(r);
        return k3_err(err, K3_ERR_NOMEM, "submit: out of memory for a %lld-token request", (long long)total);
    }
    if (p->embeds) { /* rows replacing embeddings (images): copied, so the caller may free its own */
        const int64_t D = e->m->cfg.hidden_size;
        int64_t n_rows = 0;
        for (int64_t i = 0; i < p->n_prompt; i++) n_rows += p->embeds[i] != NULL;
        r->emb = calloc((size_t)r->rq.cap_tok, sizeof *r->emb); /* recompute after preemption reads past the prompt */
        r->emb_rows = malloc(sizeof(float) * (size_t)(n_rows * D + 1));
        if (!r->emb || !r->emb_rows) {
            k3_engine_req_free(r);
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
        k3_engine_req_free(r);
        return k3_err(err, K3_ERR_NOMEM, "submit: out of memory for a KDA state to keep");
    }
    if (p->remote) {
        r->remote = true;
        r->rp = *p->remote;
        r->first_top = malloc(sizeof(k3_logprob) * (size_t)(r->rp.n_first_top + 1));
        r->pull_state = e->state_bytes > 0 ? malloc((size_t)e->state_bytes) : NULL;
        if (!r->first_top || (e->state_bytes > 0 && !r->pull_state)) {
            k3_engine_req_free(r);
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
            k3_engine_req_free(r);
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
    r->rq.salt = p->cache_salt;
    r->rq.plp = p->prompt_logprobs >= 0;
    r->rq.owner = r;
    r->stop_id = -1;
    for (int64_t i = 0; i < p->n_prompt; i++) k3_sampler_accept(r->smp, p->prompt[i]);
    r->t_arrival = k3_now();

    pthread_mutex_lock(&e->mu);
    if (e->o.max_waiting > 0 && e->n_sub + e->st.n_waiting >= e->o.max_waiting) {
        pthread_mutex_unlock(&e->mu);
        k3_engine_req_free(r);
        return k3_err(err, K3_ERR_BUSY, "submit: %d requests are waiting, the limit", e->o.max_waiting);
    }
    if (!k3_engine_push_ptr((void ***)&e->in_sub, &e->n_sub, &e->cap_sub, r)) {
        pthread_mutex_unlock(&e->mu);
        k3_engine_req_free(r);
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

bool k3_engine_has_work(k3_engine *e) {
    const double now = k3_now();
    pthread_mutex_lock(&e->mu);
    bool w = e->n_sub > 0 || e->n_cancel > 0 || e->n_async > 0;
    for (int32_t i = 0; !w && i < e->n_conn; i++) w = e->conn[i]->has_work(e->conn[i]->self, now);
    pthread_mutex_unlock(&e->mu);
    return w || e->sched.n_running > 0 || e->sched.n_waiting > 0 || e->n_done > 0;
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
    __atomic_store_n(&e->kv_events, ev, __ATOMIC_RELEASE); /* the disk tier's threads read it */
    k3_kv_set_observer(&e->bm, ev ? k3_kv_events_observer(ev, e->bm.block_size, e->sched.cfg.hash_seed) : NULL);
    pthread_mutex_unlock(&e->mu);
}

void k3_engine_kv_residency(k3_engine *e, k3_kv_residency *out) {
    pthread_mutex_lock(&e->mu);
    *out = e->kv_res;
    pthread_mutex_unlock(&e->mu);
}

/* ---- introspection for tests and the bench -------------------------------------------------- */

int64_t k3_engine_blocks_free(const k3_engine *e) { return e->bm.n_free; }

bool k3_engine_check(const k3_engine *e) {
    if (!k3_kv_check(&e->bm)) return false;
    int64_t refs = 0, held = k3_sched_blocks_held(&e->sched);
    for (int32_t b = 0; b < e->bm.n_blocks; b++) refs += e->bm.ref[b];
    /* and the holds kept for decode instances, the pulls in flight */
    for (int32_t i = 0; i < e->n_conn; i++) held += e->conn[i]->blocks_held(e->conn[i]->self);
    return refs == held;
}
