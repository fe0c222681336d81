/* metrics.c -- histograms and the Prometheus text of /metrics (metrics.h). */
#include "server/metrics.h"

#include <string.h>

#include "engine/engine.h"
#include "kvstore/kvstore.h"

static void hist_set(k3_hist *h, const char *name, const char *help, const double *le, int n) {
    h->name = name;
    h->help = help;
    h->n_le = n > K3_HIST_MAX_BUCKETS ? K3_HIST_MAX_BUCKETS : n;
    memcpy(h->le, le, sizeof(double) * (size_t)h->n_le);
}

/* Token-count buckets like vLLM's: 1, 2, 5, 10, 20, 50 ... up to max. */
static int count_buckets(double *le, double max) {
    static const double mant[3] = {1, 2, 5};
    int n = 0;
    for (double d = 1; n < K3_HIST_MAX_BUCKETS; d *= 10)
        for (int i = 0; i < 3 && n < K3_HIST_MAX_BUCKETS; i++) {
            if (d * mant[i] > max) return n;
            le[n++] = d * mant[i];
        }
    return n;
}

void k3_metrics_init(k3_metrics *m, int64_t max_model_len, int32_t max_batched) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    /* vLLM's bucket edges (seconds) */
    static const double ttft[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
                                  1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
    static const double itl[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                 0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
    static const double req[] = {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
                                 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
    const int nt = (int)(sizeof ttft / sizeof *ttft), ni = (int)(sizeof itl / sizeof *itl),
              nr = (int)(sizeof req / sizeof *req);
    hist_set(&m->h[K3_H_TTFT], "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttft,
             nt);
    hist_set(&m->h[K3_H_ITL], "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itl,
             ni);
    hist_set(&m->h[K3_H_E2E], "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", req,
             nr);
    hist_set(&m->h[K3_H_QUEUE], "vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", req, nr);
    hist_set(&m->h[K3_H_PREFILL], "vllm:request_prefill_time_seconds",
             "Histogram of time spent in PREFILL phase for request.", req, nr);
    hist_set(&m->h[K3_H_DECODE], "vllm:request_decode_time_seconds",
             "Histogram of time spent in DECODE phase for request.", req, nr);
    double le[K3_HIST_MAX_BUCKETS];
    int n = count_buckets(le, (double)(max_model_len > 0 ? max_model_len : 1));
    hist_set(&m->h[K3_H_PROMPT_TOKENS], "vllm:request_prompt_tokens", "Number of prefill tokens processed.", le, n);
    hist_set(&m->h[K3_H_GEN_TOKENS], "vllm:request_generation_tokens", "Number of generation tokens processed.", le, n);
    hist_set(&m->h[K3_H_PD_QUEUE], "k3:pd_ttft_queue_seconds",
             "TTFT of a request prefilled elsewhere: its time waiting on the prefill instance.", ttft, nt);
    hist_set(&m->h[K3_H_PD_PREFILL], "k3:pd_ttft_prefill_seconds",
             "TTFT of a request prefilled elsewhere: its prefill there.", ttft, nt);
    hist_set(&m->h[K3_H_PD_TRANSFER], "k3:pd_ttft_transfer_seconds",
             "TTFT of a request prefilled elsewhere: blocks given here to the last byte of its cache pulled.", ttft,
             nt);
    hist_set(&m->h[K3_H_PD_FIRST_STEP], "k3:pd_first_decode_step_seconds",
             "A request prefilled elsewhere: from its cache landing to its first token computed here.", ttft, nt);
    n = count_buckets(le, (double)(max_batched > 0 ? max_batched : 1));
    hist_set(&m->h[K3_H_ITER_TOKENS], "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
             le, n);
}

void k3_metrics_destroy(k3_metrics *m) { pthread_mutex_destroy(&m->mu); }

/* m->mu held */
static void observe(k3_metrics *m, int which, double v) {
    k3_hist *h = &m->h[which];
    int b = 0;
    while (b < h->n_le && v > h->le[b]) b++;
    h->count[b]++;
    h->sum += v;
    h->n++;
}

void k3_metrics_observe(k3_metrics *m, int which, double v) {
    if (which < 0 || which >= K3_H_COUNT) return;
    pthread_mutex_lock(&m->mu);
    observe(m, which, v);
    pthread_mutex_unlock(&m->mu);
}

void k3_metrics_finished(k3_metrics *m, k3_finish_reason why) {
    if ((int)why < 0 || why > K3_FINISH_ERROR) return;
    pthread_mutex_lock(&m->mu);
    m->finished[why]++;
    pthread_mutex_unlock(&m->mu);
}

void k3_metrics_prompt(k3_metrics *m, int64_t n_prompt, int64_t n_cached, int64_t n_disk) {
    pthread_mutex_lock(&m->mu);
    m->prompt_tokens += (uint64_t)(n_prompt > 0 ? n_prompt : 0);
    m->prompt_tokens_cached += (uint64_t)(n_cached > 0 ? n_cached : 0);
    m->prompt_tokens_disk += (uint64_t)(n_disk > 0 ? n_disk : 0);
    pthread_mutex_unlock(&m->mu);
}

void k3_metrics_request_done(k3_metrics *m, k3_finish_reason why, const k3_req_output *o) {
    pthread_mutex_lock(&m->mu);
    if ((int)why >= 0 && why <= K3_FINISH_ERROR) m->finished[why]++;
    if (o->t_first_token > 0) observe(m, K3_H_TTFT, o->t_first_token - o->t_arrival);
    if (o->t_finished > 0) observe(m, K3_H_E2E, o->t_finished - o->t_arrival);
    if (o->t_scheduled > 0) observe(m, K3_H_QUEUE, o->t_scheduled - o->t_arrival);
    observe(m, K3_H_PREFILL, o->prefill_s);
    observe(m, K3_H_DECODE, o->decode_s);
    observe(m, K3_H_PROMPT_TOKENS, (double)o->n_prompt);
    observe(m, K3_H_GEN_TOKENS, (double)o->n_generated);
    if (o->transfer_s > 0) {
        observe(m, K3_H_PD_QUEUE, o->remote_queue_s);
        observe(m, K3_H_PD_PREFILL, o->remote_prefill_s);
        observe(m, K3_H_PD_TRANSFER, o->transfer_s);
        if (o->first_step_s > 0) observe(m, K3_H_PD_FIRST_STEP, o->first_step_s);
    }
    pthread_mutex_unlock(&m->mu);
}

static void metric(k3_buf *o, const char *name, const char *type, const char *help, const char *model, double v) {
    k3_buf_addf(o, "# HELP %s %s\n# TYPE %s %s\n%s{model_name=\"%s\"} %.17g\n", name, help, name, type, name, model, v);
}

void k3_metrics_render(k3_metrics *m, const k3_engine_stats *st, const char *model, int32_t block_size, k3_buf *o) {
    k3_engine_stats z;
    if (!st) {
        memset(&z, 0, sizeof z);
        st = &z;
    }
    /* one snapshot of the server's counters and histograms: they are
     * rendered as they stood together */
    static const k3_metrics zero;
    k3_metrics snap = zero;
    pthread_mutex_lock(&m->mu);
    memcpy(snap.h, m->h, sizeof snap.h);
    memcpy(snap.finished, m->finished, sizeof snap.finished);
    snap.prompt_tokens = m->prompt_tokens;
    snap.prompt_tokens_cached = m->prompt_tokens_cached;
    snap.prompt_tokens_disk = m->prompt_tokens_disk;
    pthread_mutex_unlock(&m->mu);
    m = &snap;
    metric(o, "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", model,
           st->n_running);
    metric(o, "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", model,
           st->n_waiting);
    metric(o, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", model,
           st->cache_usage);
    metric(o, "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", model,
           (double)m->prompt_tokens);
    metric(o, "vllm:prompt_tokens_cached_total", "counter", "Number of cached prompt tokens (local + external).", model,
           (double)m->prompt_tokens_cached);
    /* vLLM's split of the prompt tokens of requests as they were first scheduled */
    k3_buf_addf(o,
                "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.\n"
                "# TYPE vllm:prompt_tokens_by_source_total counter\n"
                "vllm:prompt_tokens_by_source_total{model_name=\"%s\",source=\"local_compute\"} %llu\n"
                "vllm:prompt_tokens_by_source_total{model_name=\"%s\",source=\"local_cache_hit\"} %llu\n"
                "vllm:prompt_tokens_by_source_total{model_name=\"%s\",source=\"external_kv_transfer\"} %llu\n",
                model, (unsigned long long)(m->prompt_tokens - m->prompt_tokens_cached), model,
                (unsigned long long)(m->prompt_tokens_cached - m->prompt_tokens_disk), model,
                (unsigned long long)m->prompt_tokens_disk);
    metric(o, "k3:prompt_tokens_computed_total", "counter",
           "Prompt tokens the forward pass computed (cache hits left out, recomputation after preemption in).", model,
           (double)st->prompt_tokens);
    metric(o, "vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", model,
           (double)st->generation_tokens);
    k3_buf_addf(o,
                "# HELP vllm:request_success_total Count of successfully processed requests.\n"
                "# TYPE vllm:request_success_total counter\n");
    static const char *reason[] = {NULL, "stop", "length", "abort", "error"};
    for (int r = K3_FINISH_STOP; r <= K3_FINISH_ERROR; r++)
        k3_buf_addf(o, "vllm:request_success_total{finished_reason=\"%s\",model_name=\"%s\"} %llu\n", reason[r], model,
                    (unsigned long long)m->finished[r]);
    metric(o, "vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", model,
           (double)st->n_preemptions);
    metric(o, "vllm:prefix_cache_queries_total", "counter",
           "Prefix cache queries, in terms of number of queried tokens.", model, (double)st->prefix_queries);
    metric(o, "vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
           model, (double)st->prefix_hits);
    k3_buf_addf(o,
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig.\n"
                "# TYPE vllm:cache_config_info gauge\n"
                "vllm:cache_config_info{block_size=\"%d\",num_gpu_blocks=\"%lld\",cache_tokens=\"%lld\","
                "model_name=\"%s\"} 1\n",
                block_size, (long long)st->blocks_total, (long long)st->cache_tokens, model);
    metric(o, "k3:kv_blocks_used", "gauge", "Cache blocks held by requests.", model, (double)st->blocks_used);
    metric(o, "k3:kv_blocks_total", "gauge", "Cache blocks in the pool.", model, (double)st->blocks_total);
    metric(o, "k3:kda_snapshots", "gauge", "KDA state snapshots held by the prefix cache.", model,
           (double)st->n_snapshots);
    metric(o, "k3:kda_snapshot_bytes", "gauge", "Bytes of KDA state snapshots held by the prefix cache.", model,
           (double)st->snapshot_bytes);
    metric(o, "k3:grammar_steps_total", "counter", "Engine steps that filled grammar masks (structured outputs).",
           model, (double)st->grammar_steps);
    metric(o, "k3:grammar_masks_total", "counter", "Grammar masks filled, one per constrained request and step.", model,
           (double)st->grammar_masks);
    metric(o, "k3:grammar_seconds_total", "counter",
           "Time the engine's steps spent filling and applying grammar masks.", model, st->grammar_s);
    /* speculative decoding: vLLM's counters (its Counter names plus _total);
     * acceptance rate = accepted / draft tokens, mean acceptance length =
     * 1 + accepted / drafts, per position accepted_per_pos / drafts */
    metric(o, "vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.", model,
           (double)st->spec_drafts);
    metric(o, "vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", model,
           (double)st->spec_draft_tokens);
    metric(o, "vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.", model,
           (double)st->spec_accepted_tokens);
    k3_buf_addf(o,
                "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.\n"
                "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter\n");
    int n_pos = st->spec_k;
    for (int p = 0; p < K3_SPEC_MAX_TOKENS; p++)
        if (st->spec_accepted_per_pos[p] && p + 1 > n_pos) n_pos = p + 1; /* a request's own k past the engine's */
    for (int p = 0; p < n_pos && p < K3_SPEC_MAX_TOKENS; p++)
        k3_buf_addf(o, "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"%s\",position=\"%d\"} %lld\n",
                    model, p, (long long)st->spec_accepted_per_pos[p]);
    metric(o, "k3:spec_decode_propose_seconds_total", "counter", "Time the engine's steps spent proposing drafts.",
           model, st->spec_propose_s);
    metric(o, "k3:spec_decode_accept_seconds_total", "counter",
           "Time the engine's steps spent keeping verified positions (KDA rollback and block tables).", model,
           st->spec_accept_s);
    static const char *const phase[K3_PHASE_COUNT] = {"begin",  "propose", "schedule", "setup",  "pass",
                                                      "sample", "verify",  "finish",   "outside"};
    k3_buf_addf(o,
                "# HELP k3:engine_phase_seconds_total Time the engine's steps spent by phase (outside: between a "
                "step and the next, the server's handling of its outputs).\n"
                "# TYPE k3:engine_phase_seconds_total counter\n");
    for (int i = 0; i < K3_PHASE_COUNT; i++)
        k3_buf_addf(o, "k3:engine_phase_seconds_total{model_name=\"%s\",phase=\"%s\"} %.6f\n", model, phase[i],
                    st->phase_s[i]);
    metric(o, "k3:engine_steps_total", "counter", "Engine steps.", model, (double)st->n_steps);
    metric(o, "k3:engine_spec_steps_total", "counter", "Engine steps with a verify chunk.", model,
           (double)st->n_spec_steps);
    for (int i = 0; i < K3_H_COUNT; i++) {
        const k3_hist *h = &m->h[i];
        k3_buf_addf(o, "# HELP %s %s\n# TYPE %s histogram\n", h->name, h->help, h->name);
        uint64_t cum = 0;
        for (int b = 0; b < h->n_le; b++) {
            cum += h->count[b];
            k3_buf_addf(o, "%s_bucket{le=\"%g\",model_name=\"%s\"} %llu\n", h->name, h->le[b], model,
                        (unsigned long long)cum);
        }
        cum += h->count[h->n_le];
        k3_buf_addf(o, "%s_bucket{le=\"+Inf\",model_name=\"%s\"} %llu\n", h->name, model, (unsigned long long)cum);
        k3_buf_addf(o, "%s_sum{model_name=\"%s\"} %.17g\n%s_count{model_name=\"%s\"} %llu\n", h->name, model, h->sum,
                    h->name, model, (unsigned long long)h->n);
    }
}

void k3_metrics_render_dist(const k3_comm_stats *cs, k3_buf *o) {
    k3_buf_addf(o,
                "# HELP k3:dist_bytes_total Bytes the ranks sent to and received from other ranks, summed over "
                "all ranks, per collective kind.\n# TYPE k3:dist_bytes_total counter\n");
    for (int k = 0; k < K3_COMM_COUNT; k++)
        k3_buf_addf(o,
                    "k3:dist_bytes_total{kind=\"%s\",dir=\"sent\"} %lld\n"
                    "k3:dist_bytes_total{kind=\"%s\",dir=\"received\"} %lld\n",
                    k3_comm_kind_name((k3_comm_kind)k), (long long)cs->sent[k], k3_comm_kind_name((k3_comm_kind)k),
                    (long long)cs->recv[k]);
    k3_buf_addf(o,
                "# HELP k3:dist_calls_total Collective calls, summed over all ranks, per kind.\n"
                "# TYPE k3:dist_calls_total counter\n");
    for (int k = 0; k < K3_COMM_COUNT; k++)
        k3_buf_addf(o, "k3:dist_calls_total{kind=\"%s\"} %lld\n", k3_comm_kind_name((k3_comm_kind)k),
                    (long long)cs->calls[k]);
    k3_buf_addf(o,
                "# HELP k3:dist_seconds_total Seconds spent in collectives, summed over all ranks, per kind.\n"
                "# TYPE k3:dist_seconds_total counter\n");
    for (int k = 0; k < K3_COMM_COUNT; k++)
        k3_buf_addf(o, "k3:dist_seconds_total{kind=\"%s\"} %.9g\n", k3_comm_kind_name((k3_comm_kind)k), cs->seconds[k]);
}

static void kv_hist(k3_buf *o, const char *name, const char *help, const k3_kv_hist *h, const char *model) {
    k3_buf_addf(o, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int b = 0; b < K3_KV_RESIDENCY_BUCKETS; b++) {
        cum += h->count[b];
        k3_buf_addf(o, "%s_bucket{le=\"%g\",model_name=\"%s\"} %llu\n", name, k3_kv_residency_le[b], model,
                    (unsigned long long)cum);
    }
    cum += h->count[K3_KV_RESIDENCY_BUCKETS];
    k3_buf_addf(o, "%s_bucket{le=\"+Inf\",model_name=\"%s\"} %llu\n", name, model, (unsigned long long)cum);
    k3_buf_addf(o, "%s_sum{model_name=\"%s\"} %.17g\n%s_count{model_name=\"%s\"} %llu\n", name, model, h->sum, name,
                model, (unsigned long long)h->n);
}

void k3_metrics_render_kv(const k3_kv_residency *r, const char *model, k3_buf *o) {
    if (!r->enabled) return;
    kv_hist(o, "vllm:kv_block_lifetime_seconds",
            "Histogram of KV cache block lifetime from allocation to eviction. Sampled metrics "
            "(controlled by --kv-cache-metrics-sample).",
            &r->lifetime, model);
    kv_hist(o, "vllm:kv_block_idle_before_evict_seconds",
            "Histogram of idle time before KV cache block eviction. Sampled metrics "
            "(controlled by --kv-cache-metrics-sample).",
            &r->idle, model);
    kv_hist(o, "vllm:kv_block_reuse_gap_seconds",
            "Histogram of time gaps between consecutive KV cache block accesses. Only the last 4 accesses "
            "are tracked. Sampled metrics (controlled by --kv-cache-metrics-sample).",
            &r->reuse_gap, model);
}

static void kvs_hist(k3_buf *o, const char *name, const char *help, const k3_kvs_hist *h, const double *le,
                     const char *model) {
    k3_buf_addf(o, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int b = 0; b < K3_KVS_HIST_BUCKETS; b++) {
        cum += h->count[b];
        k3_buf_addf(o, "%s_bucket{le=\"%g\",model_name=\"%s\"} %llu\n", name, le[b], model, (unsigned long long)cum);
    }
    cum += h->count[K3_KVS_HIST_BUCKETS];
    k3_buf_addf(o, "%s_bucket{le=\"+Inf\",model_name=\"%s\"} %llu\n", name, model, (unsigned long long)cum);
    k3_buf_addf(o, "%s_sum{model_name=\"%s\"} %.17g\n%s_count{model_name=\"%s\"} %llu\n", name, model, h->sum, name,
                model, (unsigned long long)h->n);
}

void k3_metrics_render_disk(k3_engine *e, struct k3_kv_events *ev, const char *model, k3_buf *o) {
    k3_disk_stats d;
    k3_kvs_metrics m;
    if (e && k3_engine_disk_stats(e, &d, &m)) {
        /* vLLM's: the external tier's prefix cache (tokens, as its scheduler counts them) */
        metric(o, "vllm:external_prefix_cache_queries_total", "counter",
               "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
               "queried tokens.",
               model, (double)d.ext_queries);
        metric(o, "vllm:external_prefix_cache_hits_total", "counter",
               "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
               "cached tokens.",
               model, (double)d.ext_hits);
        /* vLLM's offloading counters: the disk tier's reads into the cache and writes from it */
        metric(o, "vllm:kv_offload_load_bytes_total", "counter", "Total bytes loaded from offload storage.", model,
               (double)m.bytes_read);
        metric(o, "vllm:kv_offload_load_time_total", "counter", "Total load time from offload storage, in seconds.",
               model, m.read_seconds);
        kvs_hist(o, "vllm:kv_offload_load_size", "Histogram of KV offload load operation size, in bytes.", &m.load_size,
                 k3_kvs_size_le, model);
        metric(o, "vllm:kv_offload_store_bytes_total", "counter", "Total bytes stored to offload storage.", model,
               (double)m.bytes_written);
        metric(o, "vllm:kv_offload_store_time_total", "counter", "Total store time to offload storage, in seconds.",
               model, m.write_seconds);
        kvs_hist(o, "vllm:kv_offload_store_size", "Histogram of KV offload store operation size, in bytes.",
                 &m.save_size, k3_kvs_size_le, model);
        /* k3's own */
        kvs_hist(o, "k3:kv_disk_load_seconds", "Disk tier: time of a load (blocks and a KDA state), seconds.",
                 &m.load_seconds, k3_kvs_hist_le, model);
        kvs_hist(o, "k3:kv_disk_save_seconds", "Disk tier: time of a save that wrote files, seconds.", &m.save_seconds,
                 k3_kvs_hist_le, model);
        metric(o, "k3:kv_disk_bytes", "gauge", "Disk tier: the directory's size (every process's files).", model,
               (double)m.dir_bytes);
        metric(o, "k3:kv_disk_budget_bytes", "gauge", "Disk tier: this process's budget for the directory.", model,
               (double)m.budget);
        k3_buf_addf(o,
                    "# HELP k3:kv_disk_loads_total Disk tier: loads by how they ended.\n"
                    "# TYPE k3:kv_disk_loads_total counter\n"
                    "k3:kv_disk_loads_total{model_name=\"%s\",result=\"landed\"} %lld\n"
                    "k3:kv_disk_loads_total{model_name=\"%s\",result=\"failed\"} %lld\n"
                    "k3:kv_disk_loads_total{model_name=\"%s\",result=\"cancelled\"} %lld\n",
                    model, (long long)d.loads_landed, model, (long long)d.loads_failed, model,
                    (long long)d.loads_cancelled);
        k3_buf_addf(o,
                    "# HELP k3:kv_disk_saves_total Disk tier: save jobs by how they ended.\n"
                    "# TYPE k3:kv_disk_saves_total counter\n"
                    "k3:kv_disk_saves_total{model_name=\"%s\",result=\"ok\"} %lld\n"
                    "k3:kv_disk_saves_total{model_name=\"%s\",result=\"failed\"} %lld\n"
                    "k3:kv_disk_saves_total{model_name=\"%s\",result=\"dropped\"} %lld\n",
                    model, (long long)(m.saves - m.saves_failed), model, (long long)m.saves_failed, model,
                    (long long)m.saves_dropped);
        k3_buf_addf(o,
                    "# HELP k3:kv_disk_files_written_total Disk tier: files published.\n"
                    "# TYPE k3:kv_disk_files_written_total counter\n"
                    "k3:kv_disk_files_written_total{kind=\"run\",model_name=\"%s\"} %lld\n"
                    "k3:kv_disk_files_written_total{kind=\"snapshot\",model_name=\"%s\"} %lld\n",
                    model, (long long)m.runs_written, model, (long long)m.snaps_written);
        metric(o, "k3:kv_disk_files_present_total", "counter",
               "Disk tier: writes skipped because the file was there (or another writer won).", model,
               (double)m.files_present);
        k3_buf_addf(o,
                    "# HELP k3:kv_disk_refused_total Disk tier: files found but refused, by reason (each a miss).\n"
                    "# TYPE k3:kv_disk_refused_total counter\n");
        for (int r = 1; r < K3_KVS_MISS_REASONS; r++)
            k3_buf_addf(o, "k3:kv_disk_refused_total{model_name=\"%s\",reason=\"%s\"} %lld\n", model,
                        k3_kvs_miss_names[r], (long long)m.misses[r]);
        metric(o, "k3:kv_disk_evicted_files_total", "counter",
               "Disk tier: files this process's eviction passes removed.", model, (double)m.evicted_files);
        metric(o, "k3:kv_disk_evicted_bytes_total", "counter",
               "Disk tier: bytes this process's eviction passes removed.", model, (double)m.evicted_bytes);
        metric(o, "k3:kv_disk_blocks_stored_total", "counter",
               "Disk tier: blocks in the run files this process published (the events' BlockStored, medium DISK).",
               model, (double)m.blocks_stored);
        metric(o, "k3:kv_disk_blocks_removed_total", "counter",
               "Disk tier: blocks in the run files this process's eviction passes removed (the events' "
               "BlockRemoved, medium DISK).",
               model, (double)m.blocks_removed);
        k3_buf_addf(o,
                    "# HELP k3:kv_disk_requests Disk tier: requests waiting for blocks to load into, and loading.\n"
                    "# TYPE k3:kv_disk_requests gauge\n"
                    "k3:kv_disk_requests{model_name=\"%s\",state=\"waiting\"} %d\n"
                    "k3:kv_disk_requests{model_name=\"%s\",state=\"loading\"} %d\n",
                    model, d.waiting, model, d.loading);
        metric(o, "k3:kv_disk_direct_io", "gauge",
               "Disk tier: 1 when its reads and writes bypass the page cache (O_DIRECT), 0 when they go through it "
               "(a filesystem without O_DIRECT, such as tmpfs).",
               model, m.direct ? 1 : 0);
        metric(o, "k3:kv_disk_bounced_bytes_total", "counter",
               "Disk tier: bytes moved with O_DIRECT through a bounce buffer (pieces not aligned to the filesystem's "
               "direct I/O alignment).",
               model, (double)m.bytes_bounced);
        metric(o, "k3:kv_disk_snaps_ram_only_total", "counter",
               "Disk tier: KDA snapshots the snapshot policy kept in RAM only (stride snapshots: neither a prompt's "
               "end nor its junction).",
               model, (double)d.snaps_ram_only);
        metric(o, "k3:kv_disk_saves_in_flight", "gauge", "Disk tier: saves queued or running.", model,
               (double)d.saving);
        metric(o, "k3:kv_disk_save_blocks", "gauge", "Disk tier: cache blocks the saves in flight hold.", model,
               (double)d.save_blocks);
    }
    if (ev) {
        k3_kv_events_stats es;
        k3_kv_events_get_stats(ev, &es);
        metric(o, "k3:kv_events_batches_total", "counter", "KV events: batches published.", model, (double)es.batches);
        k3_buf_addf(o,
                    "# HELP k3:kv_events_blocks_total KV events: block hashes published, by event and medium.\n"
                    "# TYPE k3:kv_events_blocks_total counter\n"
                    "k3:kv_events_blocks_total{event=\"stored\",medium=\"GPU\",model_name=\"%s\"} %lld\n"
                    "k3:kv_events_blocks_total{event=\"removed\",medium=\"GPU\",model_name=\"%s\"} %lld\n"
                    "k3:kv_events_blocks_total{event=\"stored\",medium=\"DISK\",model_name=\"%s\"} %lld\n"
                    "k3:kv_events_blocks_total{event=\"removed\",medium=\"DISK\",model_name=\"%s\"} %lld\n",
                    model, (long long)es.stored_blocks, model, (long long)es.removed_blocks, model,
                    (long long)es.disk_stored_blocks, model, (long long)es.disk_removed_blocks);
    }
}
