/*
 * cmd_bench.c -- `k3 bench -m DIR`: speed, measured against the machine.
 *
 *   1. memory read bandwidth, STREAM-like over >= 1 GB (the decode ceiling);
 *   2. prefill tok/s for prompts of 128, 512 and 2048 tokens, and GFLOP/s
 *      counted as 2 x active parameters x tokens (the figure earlier docs
 *      quote) and as the work the prefill does (k3_model_prof_flops: the
 *      products a token runs, attention over its keys, the head once, no
 *      embedding), which is what the fraction of the peak is taken of;
 *   3. decode tok/s at batch 1 and batch 8, weight bytes read per decoded
 *      token, effective GB/s and its fraction of the measured bandwidth;
 *   4. image encode (checkpoints with a vision tower): ms per image at three
 *      sizes, and the prompt tokens each takes (bench_vision.c);
 *   5. --long-context: decode ms/token at long contexts, DSA against the same
 *      layers run dense (caches filled with synthetic content, since a 128k
 *      prefill of the bench model takes too long here; the cost of a decode
 *      step depends on the length, not the content).
 * Every figure is the median of --runs runs (default 5) with min and max.
 * --profile adds time per operator; --json prints one object.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "k3.h"

/* GFLOP/s of the work of a prefill of T tokens at tok_s (k3_model_prof_flops). */
static double work_gflops(const k3_model *m, int64_t T, double tok_s) {
    double f[K3_PROF_COUNT], sum = 0.0;
    k3_model_prof_flops(m, T, f);
    for (int i = 0; i < K3_PROF_COUNT; i++) sum += f[i];
    return T > 0 ? sum / (double)T * tok_s / 1e9 : 0.0;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct {
    double med, min, max;
} stat3;

static stat3 stats(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    stat3 s = {n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]), v[0], v[n - 1]};
    return s;
}

static int parse_list(const char *s, long *out, int cap) {
    int n = 0;
    while (*s && n < cap) {
        char *end;
        errno = 0;
        const long v = strtol(s, &end, 10);
        if (end == s || errno || v <= 0) return -1;
        out[n++] = v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

static void fill_ids(int32_t *ids, int64_t n, int64_t vocab, uint64_t seed) {
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((seed >> 33) % (uint64_t)vocab);
    }
}

static void usage_to(FILE *out) {
    fprintf(out,
            "usage: k3 bench [-m DIR] [options]\n"
            "  -m DIR               model directory (default " K3_DEFAULT_MODEL ")\n"
            "  --threads N          worker threads (default: the physical cores; 0 = every CPU)\n"
            "  --runs N             runs per figure, 1-64 (default 5; medians with min and max)\n"
            "  --kv-cache f32|c8    cache format\n"
            "  --quant MODE         " K3_CLI_QUANT_MODES "\n"
            "  --mmap               keep the weights in the file mapping (default: in RAM)\n"
            "  --kda-bf16-prefill   KDA's prefill in its BF16 chunked form where the table has it (amx)\n"
            "  --prompts 128,512,2048  prefill lengths\n"
            "  --decode-tokens N    decode steps per run (default 16)\n"
            "  --membw-mb N         bandwidth buffer size (default 1024)\n"
            "  --long-context       decode ms/token at --contexts, DSA vs dense\n"
            "  --contexts 1024,8192,32768,131072\n"
            "  --profile            time per operator (prefill 512 and decode)\n"
            "  --isa NAME           kernels: " K3_CLI_ISA_HELP "\n"
            "  --json               one JSON object on stdout\n"
            "  --quick              one run per figure, prompts 128,512: about a fifth of the time\n"
            "Progress, with the time left, goes to stderr.\n"
            "under mpirun (or with --dcp/--ep): decode at --contexts and the cross-rank traffic\n"
            "  per decoded token; see `mpirun -np 1 k3 bench --help`\n");
}

static int usage_bench(void) {
    usage_to(stderr);
    return 2;
}

typedef struct {
    k3_model *m;
    k3_model_info info;
    k3_pool *pool;
    int runs;
    int decode_tokens;
    k3_kv_type kv;
    bool kda_bf16; /* --kda-bf16-prefill */
    size_t bw_bytes;
    double *bw_runs;  /* when set, run_decode measures the bandwidth before each run, */
    double *bw_after; /* after it, */
    double *dec_runs; /* and keeps each run's tok/s (in run order) */
} bench;

/* Decode tokens/s of a batch of `batch` sequences at context `pos` (filled
 * synthetically when synth, else by a short real prefill). Returns stats of
 * tok/s; *ms_per_step gets the median step time. */
static int run_decode(bench *b, int batch, int64_t pos, bool synth, bool dense, stat3 *out, k3_profile *prof,
                      k3_error *err) {
    k3_ctx *ctx = NULL;
    k3_ctx_options o = {.max_seqs = batch,
                        .cache_tokens = (int64_t)batch * (pos + b->decode_tokens + 1),
                        .kv_cache = b->kv,
                        .dense_attention = dense,
                        .kda_bf16_prefill = b->kda_bf16,
                        .pool = b->pool};
    if (k3_ctx_init(&ctx, b->m, &o, err)) return 1;
    const int64_t V = b->info.vocab_size;
    float *logits = malloc(sizeof(float) * (size_t)(V * batch));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(pos > 1 ? pos : 1));
    k3_batch_seq *bs = malloc(sizeof(k3_batch_seq) * (size_t)batch);
    int32_t *next = malloc(sizeof(int32_t) * (size_t)batch);
    double *rates = malloc(sizeof(double) * (size_t)b->runs);
    int rc = 0;
    if (!logits || !ids || !bs || !next || !rates) {
        snprintf(err->msg, sizeof err->msg, "bench: out of memory");
        rc = 1;
        goto done;
    }
    /* run -1 warms up (first touches of the caches and state), untimed */
    for (int r = -1; r < b->runs && !rc; r++) {
        for (int s = 0; s < batch; s++) {
            k3_ctx_seq_reset(ctx, s);
            if (synth) {
                if (k3_ctx_seq_fill_synthetic(ctx, s, pos, (uint64_t)(s + 1), err)) rc = 1;
            } else {
                fill_ids(ids, pos, V, (uint64_t)(7 * s + r + 1));
                k3_batch_seq p = {s, (int32_t)pos, ids};
                if (k3_ctx_forward(ctx, &p, 1, K3_LOGITS_NONE, NULL, err)) rc = 1;
            }
            next[s] = (int32_t)((s * 131 + r + 1) % V);
        }
        if (rc) break;
        if (prof && r == b->runs - 1) {
            k3_profile junk;
            k3_ctx_profile_take(ctx, &junk);
            k3_ctx_profile_enable(ctx, true);
        }
        const int steps = r < 0 ? (b->decode_tokens < 4 ? b->decode_tokens : 4) : b->decode_tokens;
        /* the machine's bandwidth drifts (other tenants): measure it before
         * and after each run, so each run's fraction compares like with like */
        if (b->bw_runs && r >= 0) b->bw_runs[r] = k3_membw_read_gbps(b->pool, b->bw_bytes, 3);
        const double t0 = k3_now();
        for (int step = 0; step < steps && !rc; step++) {
            for (int s = 0; s < batch; s++) bs[s] = (k3_batch_seq){s, 1, &next[s]};
            if (k3_ctx_forward(ctx, bs, batch, K3_LOGITS_LAST, logits, err)) rc = 1;
            for (int s = 0; s < batch; s++) next[s] = (int32_t)((next[s] + 17 * step + 1) % V);
        }
        if (r < 0) continue;
        rates[r] = (double)batch * b->decode_tokens / (k3_now() - t0);
        if (b->dec_runs) b->dec_runs[r] = rates[r];
        if (b->bw_after) b->bw_after[r] = k3_membw_read_gbps(b->pool, b->bw_bytes, 3);
        if (prof && r == b->runs - 1) k3_ctx_profile_take(ctx, prof);
    }
    if (!rc) *out = stats(rates, b->runs);
done:
    free(logits);
    free(ids);
    free(bs);
    free(next);
    free(rates);
    k3_ctx_free(ctx);
    return rc;
}

static int run_prefill(bench *b, int64_t len, stat3 *out, k3_profile *prof, k3_error *err) {
    k3_ctx *ctx = NULL;
    k3_ctx_options o = {.max_seqs = 1,
                        .cache_tokens = len,
                        .kv_cache = b->kv,
                        .kda_bf16_prefill = b->kda_bf16,
                        .pool = b->pool};
    if (k3_ctx_init(&ctx, b->m, &o, err)) return 1;
    const int64_t V = b->info.vocab_size;
    float *logits = malloc(sizeof(float) * (size_t)V);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)len);
    double *rates = malloc(sizeof(double) * (size_t)b->runs);
    int rc = 0;
    if (!logits || !ids || !rates) {
        snprintf(err->msg, sizeof err->msg, "bench: out of memory");
        rc = 1;
    }
    for (int r = 0; r < b->runs && !rc; r++) {
        k3_ctx_seq_reset(ctx, 0);
        fill_ids(ids, len, V, (uint64_t)(r + 1));
        if (prof && r == b->runs - 1) {
            k3_profile junk;
            k3_ctx_profile_take(ctx, &junk);
            k3_ctx_profile_enable(ctx, true);
        }
        k3_batch_seq p = {0, (int32_t)len, ids};
        const double t0 = k3_now();
        if (k3_ctx_forward(ctx, &p, 1, K3_LOGITS_LAST, logits, err)) rc = 1;
        rates[r] = (double)len / (k3_now() - t0);
        if (prof && r == b->runs - 1) k3_ctx_profile_take(ctx, prof);
    }
    if (!rc) *out = stats(rates, b->runs);
    free(logits);
    free(ids);
    free(rates);
    k3_ctx_free(ctx);
    return rc;
}

/* The time per operator; with flops (prefill), each operator's GFLOP/s and
 * its fraction of peak (GFLOP/s of the mode's kind). */
static void print_profile(const char *what, const k3_profile *p, bool json, const double *flops, double peak) {
    double total = 0;
    for (int i = 0; i < K3_PROF_COUNT; i++) total += p->seconds[i];
    if (json) {
        printf("\"%s\": {", what);
        for (int i = 0; i < K3_PROF_COUNT; i++) {
            printf("%s\"%s_ms\": %.3f", i ? ", " : "", k3_prof_op_name((k3_prof_op)i), p->seconds[i] * 1e3);
            if (flops && p->seconds[i] > 0)
                printf(", \"%s_gflops\": %.2f", k3_prof_op_name((k3_prof_op)i), flops[i] / p->seconds[i] / 1e9);
        }
        printf("}");
        return;
    }
    printf("profile (%s), total %.1f ms:\n", what, total * 1e3);
    for (int i = 0; i < K3_PROF_COUNT; i++) {
        if (p->seconds[i] <= 0) continue;
        printf("  %-8s %9.2f ms  %5.1f%%", k3_prof_op_name((k3_prof_op)i), p->seconds[i] * 1e3,
               100.0 * p->seconds[i] / (total > 0 ? total : 1));
        if (flops && flops[i] > 0) {
            const double g = flops[i] / p->seconds[i] / 1e9;
            printf("  %8.1f GFLOP/s", g);
            if (peak > 0) printf("  %5.1f%% of peak", 100.0 * g / peak);
        }
        printf("\n");
    }
}

/* Progress on stderr: the phase about to run, the time so far and an
 * estimate of the time left. The estimate is a model, refined as figures
 * come in: a prefill token costs what the first prefill measured, a decode
 * step reads the weights once at the measured bandwidth (batch 8 counted as
 * two steps' worth), and a bandwidth reading costs what the first took. */
typedef struct {
    double t0;     /* start */
    double t_tok;  /* seconds per prefill token (0 until measured) */
    double t_step; /* seconds per decode step at batch 1 */
    double t_bw;   /* seconds per bandwidth reading of 3 passes */
} eta;

static double eta_left(const eta *e, const bench *b, const long *prompts, int from_prompt, int n_prompts,
                       int decode_left, int longctx, const long *contexts, int n_contexts) {
    const double tt = e->t_tok > 0 ? e->t_tok : 0.0;
    double left = 0;
    for (int i = from_prompt; i < n_prompts; i++) left += b->runs * prompts[i] * tt * (1.0 + prompts[i] / 4096.0);
    const int R = b->runs + 1; /* and the warm-up run */
    if (decode_left >= 2) left += R * (b->decode_tokens * e->t_step + 16 * tt) + 2.0 * b->runs * e->t_bw;
    if (decode_left >= 1) left += R * (2.0 * b->decode_tokens * e->t_step + 8 * 16 * tt);
    if (longctx)
        for (int i = 0; i < n_contexts; i++) left += 2.0 * R * 4 * e->t_step * (1.0 + contexts[i] / 65536.0);
    return left;
}

static void eta_say(const eta *e, const char *what, double left, bool known) {
    if (known) fprintf(stderr, "  %s (%.0f s so far, about %.0f s left)\n", what, k3_now() - e->t0, left);
    else fprintf(stderr, "  %s (%.0f s so far)\n", what, k3_now() - e->t0);
}

/* A decode run whose bandwidth readings before and after it (both taken)
 * agree within 20%: it saw one of the machine's states throughout. */
static bool run_steady(double before, double after) {
    const double lo = before < after ? before : after, hi = before < after ? after : before;
    return lo > 0 && lo >= 0.8 * hi;
}

int k3_cmd_bench(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "serve")) return k3_cmd_bench_serve(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "throughput")) return k3_cmd_bench_throughput(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "spec")) return k3_cmd_bench_spec(argc - 1, argv + 1);
    if (k3_cli_dist_wanted(argc, argv)) return k3_cmd_bench_dist(argc, argv); /* cmd_bench_dist.c */
    const char *dir = K3_DEFAULT_MODEL, *quant = K3_DEFAULT_QUANT;
    bool keep_mapped = false, kda_bf16 = false;
    int threads = k3_cli_default_threads(), runs = 5, json = 0, profile = 0, longctx = 0, dtok = 16, quick = 0;
    long membw_mb = 1024;
    long prompts[8] = {128, 512, 2048}, contexts[8] = {1024, 8192, 32768, 131072};
    int n_prompts = 3, n_contexts = 4, prompts_given = 0, runs_given = 0;
    k3_kv_type kv = K3_KV_F32;
    k3_cli_parse_kv(K3_DEFAULT_KV, &kv);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int has = i + 1 < argc;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage_to(stdout);
            return 0;
        } else if (!strcmp(a, "-m") && has) dir = argv[++i];
        else if (!strcmp(a, "--threads") && has) {
            if (k3_cli_threads("bench", argv[++i], &threads)) return 2;
        } else if (!strcmp(a, "--runs") && has) {
            if (k3_cli_int("bench", a, argv[++i], 1, 64, &runs)) return 2;
            runs_given = 1;
        } else if (!strcmp(a, "--decode-tokens") && has) {
            if (k3_cli_int("bench", a, argv[++i], 1, 1 << 20, &dtok)) return 2;
        } else if (!strcmp(a, "--membw-mb") && has) {
            if (k3_cli_long("bench", a, argv[++i], 1, 1 << 20, &membw_mb)) return 2;
        } else if (!strcmp(a, "--quick")) {
            quick = 1;
        } else if (!strcmp(a, "--prompts") && has) {
            if ((n_prompts = parse_list(argv[++i], prompts, 8)) <= 0) {
                fprintf(stderr, "k3 bench: --prompts expects up to 8 positive integers separated by commas, not '%s'\n",
                        argv[i]);
                return 2;
            }
            prompts_given = 1;
        } else if (!strcmp(a, "--contexts") && has) {
            if ((n_contexts = parse_list(argv[++i], contexts, 8)) <= 0) {
                fprintf(stderr,
                        "k3 bench: --contexts expects up to 8 positive integers separated by commas, not '%s'\n",
                        argv[i]);
                return 2;
            }
        } else if ((!strcmp(a, "--kv-cache") || !strcmp(a, "--kv")) && has) {
            if (k3_cli_parse_kv(argv[++i], &kv)) {
                fprintf(stderr, "k3 bench: --kv-cache must be f32 or c8, not '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--quant") && has) quant = argv[++i];
        else if (!strcmp(a, "--isa") && has) {
            if (k3_cli_set_isa("bench", argv[++i])) return 2;
        } else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--mmap")) keep_mapped = true;
        else if (!strcmp(a, "--kda-bf16-prefill")) kda_bf16 = true;
        else if (!strcmp(a, "--profile")) profile = 1;
        else if (!strcmp(a, "--long-context")) longctx = 1;
        else {
            fprintf(stderr, "k3 bench: unknown option or missing value: %s\n", a);
            return usage_bench();
        }
    }
    if (quick) {
        runs = runs_given ? runs : 1;
        if (!prompts_given) n_prompts = 2; /* 128 and 512 */
    }
    if (!(dir = k3_cli_model_dir("bench", dir))) return 1;

    k3_error err = {0};
    bench b = {.runs = runs, .decode_tokens = dtok, .kv = kv, .kda_bf16 = kda_bf16};
    int rc = 1;
    k3_model_info stored;
    if (k3_cli_open_model_stored(&b.m, dir, quant, keep_mapped, true, &stored, &err) ||
        k3_pool_init(&b.pool, threads, &err))
        goto fail;
    k3_model_get_info(b.m, &b.info);

    fprintf(stderr, "k3 bench: %s, %d threads, %d runs, quant %s, kv %s, isa %s\n", dir, threads, runs, quant,
            kv == K3_KV_C8 ? "c8" : "f32", k3_isa_current());
    eta et = {.t0 = k3_now()};
    const double membw = k3_membw_read_gbps(b.pool, (size_t)membw_mb << 20, runs);
    et.t_bw = (k3_now() - et.t0) * 3.0 / runs;
    if (membw <= 0) {
        fprintf(stderr, "k3 bench: cannot allocate %ld MB to measure bandwidth\n", membw_mb);
        goto out;
    }

    /* the compute peaks prefill is held against: every kind this CPU has
     * (~0.1 s each), and the one of this mode's large products */
    double peak[K3_PEAK_COUNT];
    for (int k = 0; k < K3_PEAK_COUNT; k++) peak[k] = k3_peak_gflops(b.pool, (k3_peak_kind)k, 0.1);
    k3_quant_options qo;
    k3_quant_parse(quant, &qo, NULL);
    const k3_peak_kind pk = k3_peak_of(&qo);

    stat3 pre[8], dec1, dec8;
    k3_profile prof_pre = {{0}}, prof_dec = {{0}};
    if (membw > 0) et.t_step = (double)b.info.bytes_per_token / (membw * 1e9);
    for (int i = 0; i < n_prompts; i++) {
        char what[64];
        snprintf(what, sizeof what, "prefill %ld tokens...", prompts[i]);
        eta_say(&et, what, eta_left(&et, &b, prompts, i, n_prompts, 2, longctx, contexts, n_contexts), i > 0);
        const double tp = k3_now();
        if (run_prefill(&b, prompts[i], &pre[i], profile && prompts[i] == 512 ? &prof_pre : NULL, &err)) goto fail;
        if (i == 0) et.t_tok = (k3_now() - tp) / ((double)runs * prompts[i] * (1.0 + prompts[i] / 4096.0));
    }
    eta_say(&et, "decode, batch 1...",
            eta_left(&et, &b, prompts, n_prompts, n_prompts, 2, longctx, contexts, n_contexts), true);
    double bw_runs[64], bw_after[64], frac_runs[64], dec_runs[64];
    b.bw_bytes = (size_t)membw_mb << 20;
    b.bw_runs = bw_runs;
    b.bw_after = bw_after;
    b.dec_runs = dec_runs;
    if (run_decode(&b, 1, 16, false, false, &dec1, profile ? &prof_dec : NULL, &err)) goto fail;
    b.bw_runs = NULL;
    b.bw_after = NULL;
    b.dec_runs = NULL;
    if (dec1.med > 0) et.t_step = 1.0 / dec1.med;
    eta_say(&et, "decode, batch 8...",
            eta_left(&et, &b, prompts, n_prompts, n_prompts, 1, longctx, contexts, n_contexts), true);
    if (run_decode(&b, 8, 16, false, false, &dec8, NULL, &err)) goto fail;

    const double bpt = (double)b.info.bytes_per_token;
    const double eff = bpt * dec1.med / 1e9;
    /* The fraction: median over runs of (run's GB/s) / (the bandwidth around
     * it). This machine's bandwidth can double or halve within seconds; a run
     * whose bandwidth before and after differ by more than 20% met both
     * states and has no denominator, so it is left out (all runs are used,
     * against the bandwidth before each, if none was steady). */
    int steady = 0, n_frac = 0;
    for (int r = 0; r < runs; r++) steady += run_steady(bw_runs[r], bw_after[r]);
    double bw_used[64];
    for (int r = 0; r < runs; r++) {
        if (steady && !run_steady(bw_runs[r], bw_after[r])) continue;
        bw_used[n_frac] = steady ? 0.5 * (bw_runs[r] + bw_after[r]) : bw_runs[r];
        frac_runs[n_frac] = bpt * dec_runs[r] / 1e9 / bw_used[n_frac];
        n_frac++;
    }
    const stat3 frac = stats(frac_runs, n_frac), bwr = stats(bw_used, n_frac);
    int i512 = -1;
    for (int i = 0; i < n_prompts; i++)
        if (prompts[i] == 512) i512 = i;
    const int ip = i512 >= 0 ? i512 : n_prompts - 1;
    const double gflops = 2.0 * (double)b.info.n_params_active * pre[ip].med / 1e9,
                 wgflops = work_gflops(b.m, prompts[ip], pre[ip].med);
    double pflops[K3_PROF_COUNT];
    k3_model_prof_flops(b.m, 512, pflops);

    k3_cli_vision_bench vb;
    if (k3_cli_bench_vision(b.m, b.pool, quant, runs, json, &vb)) goto out;

    stat3 lc_dsa[8], lc_dense[8];
    if (longctx) {
        for (int i = 0; i < n_contexts; i++) {
            char what[64];
            snprintf(what, sizeof what, "long context %ld...", contexts[i]);
            eta_say(&et, what, eta_left(&et, &b, prompts, n_prompts, n_prompts, 0, 1, contexts + i, n_contexts - i),
                    true);
            const int saved = b.decode_tokens;
            b.decode_tokens = 4;
            if (run_decode(&b, 1, contexts[i], true, false, &lc_dsa[i], NULL, &err) ||
                run_decode(&b, 1, contexts[i], true, true, &lc_dense[i], NULL, &err))
                goto fail;
            b.decode_tokens = saved;
        }
    }

    if (json) {
        printf("{\"model\": \"%s\", \"threads\": %d, \"runs\": %d, \"quant\": \"%s\", \"kv_cache\": \"%s\", "
               "\"isa\": \"%s\", \"kda_bf16_prefill\": %s, \"mem_bw_gbps\": %.2f, ",
               dir, threads, runs, quant, kv == K3_KV_C8 ? "c8" : "f32", k3_isa_current(), kda_bf16 ? "true" : "false",
               membw);
        printf("\"prefill_tok_s\": %.2f, \"prefill_tokens\": %ld, \"prefill_gflops\": %.2f, "
               "\"prefill_work_gflops\": %.2f, ",
               pre[ip].med, prompts[ip], gflops, wgflops);
        printf("\"prefill\": [");
        for (int i = 0; i < n_prompts; i++)
            printf("%s{\"tokens\": %ld, \"tok_s\": %.2f, \"min\": %.2f, \"max\": %.2f, \"gflops\": %.2f, "
                   "\"work_gflops\": %.2f}",
                   i ? ", " : "", prompts[i], pre[i].med, pre[i].min, pre[i].max,
                   2.0 * (double)b.info.n_params_active * pre[i].med / 1e9, work_gflops(b.m, prompts[i], pre[i].med));
        printf("], \"decode_tok_s\": %.2f, \"decode_tok_s_min\": %.2f, \"decode_tok_s_max\": %.2f, ", dec1.med,
               dec1.min, dec1.max);
        printf("\"decode_batch8_tok_s\": %.2f, \"decode_batch8_tok_s_min\": %.2f, \"decode_batch8_tok_s_max\": %.2f, ",
               dec8.med, dec8.min, dec8.max);
        printf("\"bytes_per_token_stored\": %lld, ", (long long)stored.bytes_per_token);
        printf("\"bytes_per_token\": %lld, \"effective_gbps\": %.2f, \"bandwidth_fraction\": %.3f, "
               "\"bandwidth_fraction_min\": %.3f, \"bandwidth_fraction_max\": %.3f, "
               "\"decode_mem_bw_gbps\": %.2f, \"decode_mem_bw_gbps_min\": %.2f, \"decode_mem_bw_gbps_max\": %.2f, "
               "\"decode_runs_steady\": %d, ",
               (long long)b.info.bytes_per_token, eff, frac.med, frac.min, frac.max, bwr.med, bwr.min, bwr.max, steady);
        printf("\"params\": %lld, \"params_active\": %lld", (long long)b.info.n_params,
               (long long)b.info.n_params_active);
        printf(", \"peak_gflops\": {");
        for (int k = 0; k < K3_PEAK_COUNT; k++)
            printf("%s\"%s\": %.1f", k ? ", " : "", k3_peak_name((k3_peak_kind)k), peak[k]);
        printf("}, \"peak_kind\": \"%s\", \"prefill_peak_fraction\": %.4f", k3_peak_name(pk),
               peak[pk] > 0 ? wgflops / peak[pk] : 0.0);
        if (longctx) {
            printf(", \"long_context\": [");
            for (int i = 0; i < n_contexts; i++)
                printf("%s{\"context\": %ld, \"dsa_ms\": %.3f, \"dense_ms\": %.3f}", i ? ", " : "", contexts[i],
                       1e3 / lc_dsa[i].med, 1e3 / lc_dense[i].med);
            printf("]");
        }
        k3_cli_bench_vision_print(&vb, true);
        if (profile) {
            printf(", ");
            print_profile("profile_prefill", &prof_pre, true, pflops, peak[pk]);
            printf(", ");
            print_profile("profile_decode", &prof_dec, true, NULL, 0);
        }
        printf("}\n");
    } else {
        printf("model %s: %lld params, %lld active; bytes read per decoded token: %lld (%.2f MB) with --quant %s, "
               "%lld (%.2f MB) as stored (the figure of `k3 info`)\n",
               dir, (long long)b.info.n_params, (long long)b.info.n_params_active, (long long)b.info.bytes_per_token,
               bpt / 1e6, quant, (long long)stored.bytes_per_token, stored.bytes_per_token / 1e6);
        printf("kernels: %s%s\n", k3_isa_current(),
               kda_bf16 ? " (--kda-bf16-prefill: KDA's BF16 chunked form where the table has it)" : "");
        printf("memory bandwidth (read, %ld MB, %d threads): %.2f GB/s\n", membw_mb, threads, membw);
        printf("compute peak (register loops, %d threads):", threads);
        for (int k = 0, first = 1; k < K3_PEAK_COUNT; k++)
            if (peak[k] > 0) {
                printf("%s %s %.0f", first ? "" : ",", k3_peak_name((k3_peak_kind)k), peak[k]);
                first = 0;
            }
        printf(" GFLOP/s; this mode's products: %s\n", k3_peak_name(pk));
        printf("%-18s %10s %10s %10s %10s %10s %9s\n", "", "median", "min", "max", "2N GFLOP/s", "work", "of peak");
        for (int i = 0; i < n_prompts; i++) {
            const double g = 2.0 * (double)b.info.n_params_active * pre[i].med / 1e9,
                         w = work_gflops(b.m, prompts[i], pre[i].med);
            printf("prefill %5ld tok/s %10.1f %10.1f %10.1f %10.1f %10.1f %8.1f%%\n", prompts[i], pre[i].med,
                   pre[i].min, pre[i].max, g, w, peak[pk] > 0 ? 100.0 * w / peak[pk] : 0.0);
        }
        printf("(2N: 2 x active parameters a token; work: the products each token runs, attention over its keys,\n"
               " the head once, no embedding lookup: k3_model_prof_flops, what --profile splits by operator)\n");
        printf("decode b=1   tok/s %10.2f %10.2f %10.2f\n", dec1.med, dec1.min, dec1.max);
        printf("decode b=8   tok/s %10.2f %10.2f %10.2f\n", dec8.med, dec8.min, dec8.max);
        printf("decode b=1 effective %.2f GB/s; of the bandwidth measured around each run (median %.2f, "
               "%.2f-%.2f GB/s): %.1f%% (%.1f-%.1f%%); %d of %d runs saw the same bandwidth before and after%s\n",
               eff, bwr.med, bwr.min, bwr.max, 100.0 * frac.med, 100.0 * frac.min, 100.0 * frac.max, steady, runs,
               steady ? "" : " (so all runs, against the bandwidth before each)");
        if (longctx) {
            printf("\n%-10s %14s %14s %8s\n", "context", "DSA ms/token", "dense ms/token", "dense/DSA");
            for (int i = 0; i < n_contexts; i++)
                printf("%-10ld %14.2f %14.2f %8.2f\n", contexts[i], 1e3 / lc_dsa[i].med, 1e3 / lc_dense[i].med,
                       lc_dsa[i].med / lc_dense[i].med);
        }
        k3_cli_bench_vision_print(&vb, false);
        if (profile) {
            print_profile("prefill 512", &prof_pre, false, pflops, peak[pk]);
            print_profile("decode b=1", &prof_dec, false, NULL, 0);
        }
    }
    fprintf(stderr, "k3 bench: done in %.0f s\n", k3_now() - et.t0);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "k3 bench: %s\n", err.msg[0] ? err.msg : k3_status_str(err.status));
out:
    k3_pool_free(b.pool);
    k3_model_close(b.m);
    return rc;
}
