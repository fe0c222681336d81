/*
 * cmd_bench_dist.c -- `k3 bench` under mpirun (--dcp D --ep E): decode at
 * long contexts with the caches filled synthetically on their owners (k3
 * bench --long-context's method: a 32k prefill of the bench model takes too
 * long here, and a decode step's cost depends on the length, not the
 * content), and the cross-rank traffic per decoded token by collective kind
 * -- bytes, time and GB/s -- with the DSA top-k exchange measured beside its
 * formula ((D-1)*k*8 B per DSA layer for the all-gather, log2(D)*k*8 B for
 * the butterfly). The traffic is printed for rank 0 and summed over all
 * ranks (k3_exec_stats_take_all: the other ranks' counters too). Also each
 * rank's cache bytes and routed-expert bytes.
 * Rank 0 prints; medians of --runs runs (min and max beside). The ranks of
 * a one-machine job share its cores, so wall-clock speed-ups are not the
 * point here: memory per rank and traffic are.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "k3.h"

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

bool k3_cli_dist_wanted(int argc, char **argv) {
    if (getenv("OMPI_COMM_WORLD_SIZE")) return true;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--dcp") || !strcmp(argv[i], "--ep")) return true;
    return false;
}

static int usage(void) {
    fprintf(stderr,
            "usage: mpirun -np N k3 bench [-m DIR] --dcp D --ep E [options]\n"
            "  --contexts 32768     decode at these lengths (synthetic caches)\n"
            "  --decode-tokens N    decode steps per run (default 8)\n"
            "  --runs N             runs per figure (default 3)\n"
            "  --threads N          worker threads per rank (default 1)\n"
            "  --kv-cache f32|c8, --quant MODE, --mmap (as k3 bench; --mmap shares the page cache)\n"
            "  --json               one JSON object on stdout (rank 0)\n"
            "  --dcp-interleave I, --dcp-topk-exchange allgather|butterfly, --dist-timeout S\n");
    return 2;
}

int k3_cmd_bench_dist(int argc, char **argv) {
    k3_cli_dist cd;
    if (k3_cli_dist_args(&argc, argv, &cd, "bench")) return 2;
    const char *dir = K3_DEFAULT_MODEL, *quant = K3_DEFAULT_QUANT;
    k3_kv_type kv = K3_KV_F32;
    k3_cli_parse_kv(K3_DEFAULT_KV, &kv);
    bool mapped = false, json = false;
    int threads = 1, runs = 3, dtok = 8, nctx = 1;
    long contexts[8] = {32768};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int has = i + 1 < argc;
        if (!strcmp(a, "-m") && has) dir = argv[++i];
        else if (!strcmp(a, "--threads") && has) {
            if (k3_cli_threads("bench", argv[++i], &threads)) return 2;
        } else if (!strcmp(a, "--runs") && has) {
            if (k3_cli_int("bench", a, argv[++i], 1, 64, &runs)) return 2;
        } else if (!strcmp(a, "--decode-tokens") && has) {
            if (k3_cli_int("bench", a, argv[++i], 1, 1 << 20, &dtok)) return 2;
        } else if (!strcmp(a, "--quant") && has) quant = argv[++i];
        else if (!strcmp(a, "--mmap")) mapped = true;
        else if (!strcmp(a, "--json")) json = true;
        else if (!strcmp(a, "--long-context")) continue; /* implied */
        else if (!strcmp(a, "--kv-cache") && has) {
            if (k3_cli_parse_kv(argv[++i], &kv)) return usage();
        } else if (!strcmp(a, "--contexts") && has) {
            nctx = 0;
            for (char *p = argv[++i]; *p && nctx < 8;) {
                char *end;
                errno = 0;
                contexts[nctx] = strtol(p, &end, 10);
                if (end == p || errno || contexts[nctx] < 1) return usage();
                nctx++;
                p = *end == ',' ? end + 1 : end;
            }
        } else {
            fprintf(stderr, "k3 bench: unknown option or missing value: %s\n", a);
            return usage();
        }
    }
    if (threads < 1 || runs < 1 || runs > 64 || dtok < 1) return usage();
    if (k3_cli_dist_start(&cd, "bench")) return k3_cli_dist_exit(&cd, 2);
    const bool root = cd.rank == 0;
    k3_error err = {0};
    k3_model *m = NULL;
    k3_pool *pool = NULL;
    k3_ctx *ctx = NULL;
    float *logits = NULL;
    int rc = 1;
    long longest = 0;
    for (int i = 0; i < nctx; i++) longest = contexts[i] > longest ? contexts[i] : longest;

    k3_status s = k3_cli_open_model_dist(&m, dir, quant, mapped, true, &cd, &err);
    if (k3_cli_dist_agree(&cd, s, &err, "bench")) {
        if (!cd.d) fprintf(stderr, "k3 bench: %s\n", err.msg);
        goto done;
    }
    k3_model_info info;
    k3_model_get_info(m, &info);
    s = k3_pool_init(&pool, threads, &err);
    k3_ctx_options co = {.max_seqs = 1,
                         .cache_tokens = longest + dtok + 8,
                         .max_batch = 16,
                         .kv_cache = kv,
                         .pool = pool,
                         .dist = cd.d};
    if (!s) s = k3_ctx_init(&ctx, m, &co, &err);
    if (k3_cli_dist_agree(&cd, s, &err, "bench")) {
        if (!cd.d) fprintf(stderr, "k3 bench: %s\n", err.msg);
        goto done;
    }
    if (k3_cli_show_memory(&cd, m, ctx, "bench")) goto abort;
    if (!root) {
        if (k3_exec_serve(ctx, &err)) {
            fprintf(stderr, "k3 bench: %s\n", err.msg);
            goto abort;
        }
        rc = 0;
        goto done;
    }

    const int D = cd.d ? k3_dist_dcp_size(cd.d) : 1, E = cd.d ? k3_dist_ep_size(cd.d) : 1;
    const k3_topk_exchange ex = cd.d ? k3_dist_exchange(cd.d) : K3_TOPK_ALLGATHER;
    char cfg[4096];
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    k3_plan plan;
    k3_plan_options po = {.dcp = D, .ep = E, .context = longest, .kv_cache = kv};
    if (k3_plan_compute(cfg, &po, &plan, &err)) goto fail;
    if (json)
        printf("{\"model\": \"%s\", \"ranks\": %d, \"dcp\": %d, \"ep\": %d, \"interleave\": %d, \"exchange\": \"%s\", "
               "\"kv_cache\": \"%s\", \"contexts\": [",
               dir, cd.d ? k3_dist_size(cd.d) : 1, D, E, cd.d ? k3_dist_interleave(cd.d) : 1,
               ex == K3_TOPK_BUTTERFLY ? "butterfly" : "allgather", kv == K3_KV_C8 ? "c8" : "f32");
    else
        printf("model %s: %d ranks, DCP %d (interleave %d, %s top-k exchange), EP %d, cache %s, quant %s\n", dir,
               cd.d ? k3_dist_size(cd.d) : 1, D, cd.d ? k3_dist_interleave(cd.d) : 1,
               ex == K3_TOPK_BUTTERFLY ? "butterfly" : "all-gather", E, kv == K3_KV_C8 ? "c8" : "f32", quant);
    logits = malloc(sizeof(float) * (size_t)info.vocab_size);
    double *ms = malloc(sizeof(double) * (size_t)runs);
    if (!logits || !ms) {
        free(ms);
        snprintf(err.msg, sizeof err.msg, "out of memory");
        goto fail;
    }
    for (int ci = 0; ci < nctx; ci++) {
        const long L = contexts[ci];
        k3_comm_stats tot = {0}, tall = {0}; /* rank 0's; every rank's, summed */
        const int N = cd.d ? k3_dist_size(cd.d) : 1;
        int64_t tokens = 0;
        for (int r = -1; r < runs; r++) { /* run -1 warms up, untimed and uncounted */
            k3_exec_seq_reset(ctx, 0);
            if (k3_exec_seq_fill_synthetic(ctx, 0, L, 1, &err)) goto fail_ms;
            k3_comm_stats st, sa;
            if (cd.d && k3_exec_stats_take_all(cd.d, &st, &sa, &err)) goto fail_ms;
            int32_t id = 7;
            const double t0 = k3_now();
            for (int step = 0; step < dtok; step++) {
                k3_batch_seq b = {0, 1, &id};
                if (k3_exec_forward(ctx, &b, 1, K3_LOGITS_LAST, logits, &err)) goto fail_ms;
                id = (id * 31 + 17) % (int32_t)info.vocab_size;
            }
            const double dt = k3_now() - t0;
            if (cd.d && k3_exec_stats_take_all(cd.d, &st, &sa, &err)) goto fail_ms;
            if (r < 0) continue;
            ms[r] = dt / dtok * 1e3;
            tokens += dtok;
            for (int k = 0; cd.d && k < K3_COMM_COUNT; k++) {
                tot.sent[k] += st.sent[k];
                tot.recv[k] += st.recv[k];
                tot.calls[k] += st.calls[k];
                tot.seconds[k] += st.seconds[k];
                tall.sent[k] += sa.sent[k];
                tall.recv[k] += sa.recv[k];
                tall.calls[k] += sa.calls[k];
                tall.seconds[k] += sa.seconds[k];
            }
        }
        qsort(ms, (size_t)runs, sizeof *ms, cmp_d);
        const double med = runs % 2 ? ms[runs / 2] : 0.5 * (ms[runs / 2 - 1] + ms[runs / 2]);
        if (json) {
            printf("%s{\"context\": %ld, \"decode_ms\": %.3f, \"decode_ms_min\": %.3f, \"decode_ms_max\": %.3f, "
                   "\"topk_formula_bytes\": %lld, \"lse_formula_bytes\": %lld, \"comm\": {",
                   ci ? ", " : "", L, med, ms[0], ms[runs - 1],
                   (long long)(ex == K3_TOPK_BUTTERFLY ? plan.topk_butterfly_bytes : plan.topk_allgather_bytes),
                   (long long)plan.lse_bytes);
            /* "comm": rank 0's; "comm_all_ranks": every rank's, summed */
            for (int w = 0; w < 2; w++) {
                const k3_comm_stats *cs = w ? &tall : &tot;
                if (w) printf("}, \"comm_all_ranks\": {");
                for (int k = 0; k < K3_COMM_COUNT; k++) {
                    const double bs = (double)cs->sent[k] / tokens, br = (double)cs->recv[k] / tokens;
                    const double us = cs->seconds[k] / tokens * 1e6;
                    printf("%s\"%s\": {\"sent_per_token\": %.0f, \"recv_per_token\": %.0f, \"us_per_token\": %.1f, "
                           "\"gbps\": %.4f, \"calls_per_token\": %.2f}",
                           k ? ", " : "", k3_comm_kind_name((k3_comm_kind)k), bs, br, us,
                           us > 0 ? (bs + br) / (us * 1e3) : 0.0, (double)cs->calls[k] / tokens);
                }
            }
            printf("}, \"ranks_summed\": %d}", N);
            continue;
        }
        printf("context %ld: decode %.2f ms/token (median of %d runs of %d tokens; min %.2f, max %.2f)\n", L,
               runs % 2 ? ms[runs / 2] : 0.5 * (ms[runs / 2 - 1] + ms[runs / 2]), runs, dtok, ms[0], ms[runs - 1]);
        for (int w = 0; w < 2; w++) {
            const k3_comm_stats *cs = w ? &tall : &tot;
            if (w) printf("  all %d ranks summed, per decoded token (bytes sent, received; rank-seconds; calls):\n", N);
            else printf("  rank 0, per decoded token (bytes sent, received; time inside the collectives; calls):\n");
            for (int k = 0; k < K3_COMM_COUNT; k++) {
                if (!cs->calls[k]) continue;
                const double bs = (double)cs->sent[k] / tokens, br = (double)cs->recv[k] / tokens;
                const double us = cs->seconds[k] / tokens * 1e6;
                printf("    %-14s sent %10.0f B  recv %10.0f B  %8.1f us  %6.3f GB/s  %5.1f calls\n",
                       k3_comm_kind_name((k3_comm_kind)k), bs, br, us, us > 0 ? (bs + br) / (us * 1e3) : 0.0,
                       (double)cs->calls[k] / tokens);
            }
        }
        if (D > 1 && plan.n_dsa > 0) {
            const int64_t f = ex == K3_TOPK_BUTTERFLY ? plan.topk_butterfly_bytes : plan.topk_allgather_bytes;
            const double got = (double)tot.recv[K3_COMM_TOPK] / tokens;
            printf("  top-k exchange received per token: measured %.0f B, formula %lld B (%d DSA layers x %s x k x 8)"
                   " -- %s\n",
                   got, (long long)f, plan.n_dsa, ex == K3_TOPK_BUTTERFLY ? "log2(D)" : "(D-1)",
                   got == (double)f ? "agree" : "DIFFER");
            /* every rank runs every row, so each receives the same */
            const double all = (double)tall.recv[K3_COMM_TOPK] / tokens;
            printf("  top-k exchange received per token, all %d ranks: measured %.0f B, %d x formula %lld B -- %s\n", N,
                   all, N, (long long)(N * f), all == (double)(N * f) ? "agree" : "DIFFER");
        }
        if (D > 1 || E > 1) {
            /* less the counters' own command (k3_exec_stats_take_all's broadcast), one a run */
            int64_t calls = -(tokens / dtok);
            for (int k = 0; k < K3_COMM_COUNT; k++) calls += tot.calls[k];
            const int32_t f = ex == K3_TOPK_BUTTERFLY ? plan.collectives_butterfly : plan.collectives_allgather;
            const double got = (double)calls / tokens;
            printf("  collectives per token, rank 0: measured %.2f, k3 plan's formula %d -- %s\n", got, f,
                   got == (double)f ? "agree" : "DIFFER");
        }
        if (E > 1)
            printf("  EP per token, rank 0 (every row's source): received %.0f B, sent %.0f B; k3 plan's expectation"
                   " %lld B, %lld B (the routing decides)\n",
                   (double)(tot.recv[K3_COMM_EP_DISPATCH] + tot.recv[K3_COMM_EP_COMBINE]) / tokens,
                   (double)(tot.sent[K3_COMM_EP_DISPATCH] + tot.sent[K3_COMM_EP_COMBINE]) / tokens,
                   (long long)plan.ep_source_recv_bytes, (long long)plan.ep_source_sent_bytes);
        if (D > 1) {
            const double got = (double)tot.recv[K3_COMM_LSE] / tokens;
            printf("  LSE merge received per token: measured %.0f B, k3 plan's formula %lld B -- %s\n", got,
                   (long long)plan.lse_bytes, got == (double)plan.lse_bytes ? "agree" : "DIFFER");
            const double all = (double)tall.recv[K3_COMM_LSE] / tokens;
            printf("  LSE merge received per token, all %d ranks: measured %.0f B, %d x formula %lld B -- %s\n", N, all,
                   N, (long long)(N * plan.lse_bytes), all == (double)(N * plan.lse_bytes) ? "agree" : "DIFFER");
        }
    }
    free(ms);
    if (json) printf("]}\n");
    rc = 0;
    if (cd.d && k3_exec_release(cd.d, &err)) goto fail;
    goto done;
fail_ms:
    free(ms);
fail:
    fprintf(stderr, "k3 bench: %s\n", err.msg);
    if (cd.d && k3_exec_release(cd.d, &err)) goto abort;
    goto done;
abort:
    k3_dist_abort(cd.d, 1);
done:
    free(logits);
    k3_ctx_free(ctx);
    k3_pool_free(pool);
    k3_model_close(m);
    k3_cli_dist_end(&cd);
    return k3_cli_dist_exit(&cd, rc);
}
