/*
 * metrics.h -- Prometheus histograms and the /metrics text with vLLM's names
 * (docs/serving-reference.md §6.1) plus k3's own.
 */
#ifndef K3_SERVER_METRICS_H
#define K3_SERVER_METRICS_H

#include <pthread.h>
#include <stdint.h>

#include "k3.h"
#include "common/buf.h"

#define K3_HIST_MAX_BUCKETS 24

typedef struct k3_hist {
    const char *name, *help;
    int n_le;
    double le[K3_HIST_MAX_BUCKETS];
    uint64_t count[K3_HIST_MAX_BUCKETS + 1]; /* per bucket (not cumulative); last = +Inf */
    double sum;
    uint64_t n;
} k3_hist;

enum {
    K3_H_TTFT = 0,
    K3_H_ITL,
    K3_H_E2E,
    K3_H_QUEUE,
    K3_H_PREFILL,
    K3_H_DECODE,
    K3_H_PROMPT_TOKENS,
    K3_H_GEN_TOKENS,
    K3_H_ITER_TOKENS,
    /* prefill and decode apart (decode side): the TTFT of a request prefilled
     * elsewhere, split into that instance's queue and prefill, the pull, and
     * the first decode step here */
    K3_H_PD_QUEUE,
    K3_H_PD_PREFILL,
    K3_H_PD_TRANSFER,
    K3_H_PD_FIRST_STEP,
    K3_H_COUNT
};

typedef struct k3_metrics {
    pthread_mutex_t mu;
    k3_hist h[K3_H_COUNT];
    /* engine requests finished, by the reason the client saw (a stop
     * string ends a request by cancelling it, yet it finished with "stop") */
    uint64_t finished[K3_FINISH_ERROR + 1];
    /* vLLM's prompt token counters: a request's whole prompt when its
     * prefill is done (its first token), and of it what the prefix cache held */
    uint64_t prompt_tokens, prompt_tokens_cached, prompt_tokens_disk;
} k3_metrics;

void k3_metrics_init(k3_metrics *m, int64_t max_model_len, int32_t max_num_batched_tokens);
void k3_metrics_destroy(k3_metrics *m);
void k3_metrics_observe(k3_metrics *m, int which, double v);
void k3_metrics_finished(k3_metrics *m, k3_finish_reason why);
/* A request's prefill is done: its prompt counts (n_cached of it from the prefix cache). */
void k3_metrics_prompt(k3_metrics *m, int64_t n_prompt, int64_t n_cached, int64_t n_disk);
/* A request has finished, with the reason the client sees: its success
 * counter and every per-request histogram (from o's times and counts) move
 * together, under one lock, so no scrape sees the one without the other. */
void k3_metrics_request_done(k3_metrics *m, k3_finish_reason why, const k3_req_output *o);
/* Appends the whole /metrics text; st may be NULL (no engine: zeros). */
/* The cross-rank counters of rank 0 (k3 serve under mpirun), per collective
 * kind: k3:dist_bytes_total{kind,dir="sent"|"received"}, k3:dist_calls_total,
 * k3:dist_seconds_total. */
void k3_metrics_render_dist(const k3_comm_stats *cs, k3_buf *o);
/* vLLM's sampled block residency histograms (only when r->enabled). */
void k3_metrics_render_kv(const k3_kv_residency *r, const char *model_name, k3_buf *o);
/* The disk tier (vLLM's external prefix cache and kv_offload counters, k3's
 * own) and the KV events' counters; nothing for what is off. */
void k3_metrics_render_disk(k3_engine *e, struct k3_kv_events *ev, const char *model_name, k3_buf *o);
void k3_metrics_render(k3_metrics *m, const k3_engine_stats *st, const char *model_name, int32_t block_size,
                       k3_buf *out);

#endif /* K3_SERVER_METRICS_H */
