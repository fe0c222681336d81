/*
 * cmd_bench_throughput.c -- `k3 bench throughput`: offline serving
 * throughput of the engine (in the spirit of `vllm bench throughput`).
 *
 * N random prompts of --input-len tokens (with --prefix-len P, each starts
 * with one of --num-prefixes K shared random prefixes of P tokens) go through
 * one k3_engine, at most --max-concurrency in flight (a new one is submitted
 * when one finishes); each generates exactly --output-len tokens (EOS
 * ignored). With --long-prompt L, one more request of L prompt tokens (1
 * output token) is submitted once every other request in flight is decoding,
 * to see what a long prefill does to their inter-token latency; it is left
 * out of the latency figures (its own TTFT is printed).
 *
 * Figures: request, output and total token throughput over the wall time;
 * TTFT (submit -> first token), TPOT ((last - first token) / (out - 1)) and
 * ITL (each gap between a request's tokens) as mean, median and p99, and
 * the ITL of the gaps after every request was submitted and all in flight
 * were decoding (with --long-prompt: until the long prompt is done); the
 * prefix cache hit rate (hit / queried prompt tokens); preemptions; KDA
 * snapshot size and the mean time to take and to restore one.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "k3.h"

/* The usage on stdout (exit 0) for --help, on stderr (exit 2) after a bad option. */
static int usage_tp(FILE *f) {
    fprintf(f,
            "usage: k3 bench throughput [-m DIR] [options]\n"
            "  --num-prompts N          requests (default 64)\n"
            "  --max-concurrency C      requests in flight at once (default 16)\n"
            "  --input-len I            prompt tokens (default 256)\n"
            "  --output-len O           generated tokens per request (default 64)\n"
            "  --prefix-len P           shared prefix tokens at the start of each prompt (default 0)\n"
            "  --num-prefixes K         distinct shared prefixes (default 1)\n"
            "  --long-prompt L          one extra L-token prompt once the others decode\n"
            "  --seed S                 prompt seed (default 0)\n"
            "  --threads N              worker threads (default: the physical cores)\n"
            "  --quant MODE             none | w8a8 | w4a8 | w8a8+w4a8 (default " K3_DEFAULT_QUANT ")\n"
            "  --isa NAME               kernels: " K3_CLI_ISA_HELP "\n"
            "  --kv-cache f32|c8        cache format (default " K3_DEFAULT_KV ")\n"
            "  --mmap                   keep the weights in the file mapping\n"
            "  --max-num-seqs N         engine: running requests (default: max(16, C))\n"
            "  --max-num-batched-tokens N  engine: tokens per step (default 2048)\n"
            "  --max-step-cost N        engine: while requests decode, a step costs at most N decode\n"
            "                           tokens, a prompt token priced by its position (default 0: off)\n"
            "  --block-size N           engine: tokens per cache block (default 64)\n"
            "  --cache-tokens N         engine: cache pool in tokens (default: enough for all in flight)\n"
            "  --snapshot-stride N      engine: a KDA snapshot every N blocks (default 4)\n"
            "  --snapshot-mb N          engine: snapshot budget in MB (default: the engine's)\n"
            "  --no-prefix-cache        engine: prefix caching off\n"
            "  --json                   one JSON object on stdout\n");
    return f == stdout ? 0 : 2;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct {
    double mean, median, p99;
} dist;

static dist summarize(double *v, int64_t n) {
    dist d = {0, 0, 0};
    if (n <= 0) return d;
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += v[i];
    d.mean = s / (double)n;
    d.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    /* nearest rank, as numpy's percentile with the default (linear) would
     * interpolate: use linear interpolation too */
    const double r = 0.99 * (double)(n - 1);
    const int64_t lo = (int64_t)r;
    d.p99 = lo + 1 < n ? v[lo] + (r - (double)lo) * (v[lo + 1] - v[lo]) : v[lo];
    return d;
}

static uint64_t rng_next(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

typedef struct {
    uint64_t id;
    double t_submit, t_first, t_last;
    int32_t n_out;
    bool long_one, done;
} track;

static long parse_pos(const char *s, bool *bad) {
    char *end;
    errno = 0;
    const long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < 0) *bad = true;
    return v;
}

int k3_cmd_bench_throughput(int argc, char **argv) {
    const char *dir = K3_DEFAULT_MODEL, *quant = K3_DEFAULT_QUANT;
    long num = 64, conc = 16, in_len = 256, out_len = 64, pfx = 0, n_pfx = 1, long_len = 0, seed = 0;
    long mns = 0, mnbt = 0, msc = 0, bs = 0, cache_tokens = 0, stride = 0, snap_mb = -1;
    long threads = k3_cli_default_threads();
    bool json = false, keep_mapped = false, no_prefix = false, bad = false;
    k3_kv_type kv = K3_KV_F32;
    k3_cli_parse_kv(K3_DEFAULT_KV, &kv);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const bool has = i + 1 < argc;
#define OPT(name, var) else if (!strcmp(a, name) && has) var = parse_pos(argv[++i], &bad)
        if (!strcmp(a, "-m") && has) dir = argv[++i];
        OPT("--num-prompts", num);
        OPT("--max-concurrency", conc);
        OPT("--input-len", in_len);
        OPT("--output-len", out_len);
        OPT("--prefix-len", pfx);
        OPT("--num-prefixes", n_pfx);
        OPT("--long-prompt", long_len);
        OPT("--seed", seed);
        OPT("--threads", threads);
        OPT("--max-num-seqs", mns);
        OPT("--max-num-batched-tokens", mnbt);
        OPT("--max-step-cost", msc);
        OPT("--block-size", bs);
        OPT("--cache-tokens", cache_tokens);
        OPT("--snapshot-stride", stride);
        OPT("--snapshot-mb", snap_mb);
#undef OPT
        else if ((!strcmp(a, "--kv-cache") || !strcmp(a, "--kv")) && has) {
            if (k3_cli_parse_kv(argv[++i], &kv)) {
                fprintf(stderr, "k3 bench throughput: --kv-cache must be f32 or c8, not '%s'\n", argv[i]);
                return 2;
            }
        }
        else if (!strcmp(a, "--quant") && has) quant = argv[++i]; else if (!strcmp(a, "--json")) json = true;
        else if (!strcmp(a, "--isa") && has) {
            if (k3_cli_set_isa("bench throughput", argv[++i])) return 2;
        }
        else if (!strcmp(a, "--mmap")) keep_mapped = true; else if (!strcmp(a, "--no-prefix-cache")) no_prefix = true;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage_tp(stdout); else return usage_tp(stderr);
    }
    if (bad || num < 1 || conc < 1 || in_len < 1 || out_len < 1 || threads < 1 || n_pfx < 1 || pfx >= in_len ||
        num > 1000000 || in_len > 10000000 || long_len > 10000000 || msc > 1000000) {
        fprintf(stderr, "k3 bench throughput: bad option value (need N, C, I, O, K >= 1 and P < I)\n");
        return usage_tp(stderr);
    }
    if (conc > num) conc = num;

    k3_error err = {0};
    k3_model *m = NULL;
    k3_pool *pool = NULL;
    k3_engine *e = NULL;
    int32_t *prompts = NULL, *long_prompt = NULL;
    track *tr = NULL;
    double *ttft = NULL, *tpot = NULL, *itl = NULL, *itl2 = NULL;
    int rc = 1;
    if (k3_cli_open_model(&m, dir, quant, keep_mapped, &err) || k3_pool_init(&pool, (int)threads, &err)) goto fail;
    k3_model_info info;
    k3_model_get_info(m, &info);
    const int64_t V = info.vocab_size;

    /* prompts */
    uint64_t rs = (uint64_t)seed * 0x9E3779B97F4A7C15ull + 1;
    prompts = malloc(sizeof(int32_t) * (size_t)(num * in_len));
    int32_t *prefixes = malloc(sizeof(int32_t) * (size_t)(n_pfx * (pfx ? pfx : 1)));
    if (!prompts || !prefixes) {
        free(prefixes);
        fprintf(stderr, "k3 bench throughput: out of memory for the prompts\n");
        goto out;
    }
    for (long i = 0; i < n_pfx * pfx; i++) prefixes[i] = (int32_t)(rng_next(&rs) % (uint64_t)V);
    for (long r = 0; r < num; r++) {
        int32_t *p = prompts + r * in_len;
        if (pfx) memcpy(p, prefixes + (r % n_pfx) * pfx, sizeof(int32_t) * (size_t)pfx);
        for (long i = pfx; i < in_len; i++) p[i] = (int32_t)(rng_next(&rs) % (uint64_t)V);
    }
    free(prefixes);
    if (long_len) {
        long_prompt = malloc(sizeof(int32_t) * (size_t)long_len);
        if (!long_prompt) goto fail;
        for (long i = 0; i < long_len; i++) long_prompt[i] = (int32_t)(rng_next(&rs) % (uint64_t)V);
    }

    /* the engine */
    long seqs = conc + (long_len > 0);
    if (seqs < 16) seqs = 16;
    if (mns) seqs = mns;
    k3_engine_options eo = {.max_num_seqs = (int32_t)seqs,
                            .max_num_batched_tokens = (int32_t)mnbt,
                            .max_step_cost = (int32_t)msc,
                            .block_size = (int32_t)bs,
                            .kv_cache = kv,
                            .no_prefix_cache = no_prefix,
                            .snapshot_stride = (int32_t)stride,
                            .snapshot_bytes = snap_mb > 0 ? (int64_t)snap_mb << 20
                                : snap_mb == 0            ? 1
                                                          : 0,
                            .cache_salt = 0x6b33,
                            .pool = pool};
    const int64_t longest = (in_len > long_len ? in_len : long_len) + out_len;
    eo.max_model_len = longest;
    eo.cache_tokens = cache_tokens ? cache_tokens : (conc + 1) * (in_len + out_len + 128) + long_len + 1024;
    if (k3_engine_open(&e, m, &eo, &err)) goto fail;

    fprintf(stderr,
            "k3 bench throughput: %s, %ld threads, quant %s, kv %s, isa %s; %ld prompts x (%ld in, %ld out), "
            "concurrency %ld%s\n",
            dir, threads, quant, kv == K3_KV_C8 ? "c8" : "f32", k3_isa_current(), num, in_len, out_len, conc,
            no_prefix ? ", prefix cache off" : "");
    if (pfx) fprintf(stderr, "  shared prefixes: %ld of %ld tokens\n", n_pfx, pfx);

    const long n_track = num + (long_len > 0);
    tr = calloc((size_t)n_track, sizeof(track));
    ttft = malloc(sizeof(double) * (size_t)n_track);
    tpot = malloc(sizeof(double) * (size_t)n_track);
    itl = malloc(sizeof(double) * (size_t)(num * out_len + 1));
    itl2 = malloc(sizeof(double) * (size_t)(num * out_len + 1));
    if (!tr || !ttft || !tpot || !itl || !itl2) {
        fprintf(stderr, "k3 bench throughput: out of memory\n");
        goto out;
    }
    int64_t n_itl = 0, n_itl2 = 0;
    double t_mark = 0; /* when every request had been submitted and all in flight were decoding */
    bool long_done = false;
    int64_t long_beside = 0; /* long-prompt tokens computed in steps that had decodes */
    long next = 0, done = 0, in_flight = 0;
    bool long_sent = long_len == 0;
    const uint64_t first_id = 1;
    const double t0 = k3_now();
    double t_end = t0;
    while (done < n_track) {
        /* keep C in flight */
        while (in_flight < conc && next < num) {
            k3_request_params p = {.prompt = prompts + next * in_len,
                                   .n_prompt = in_len,
                                   .max_tokens = (int32_t)out_len,
                                   .ignore_eos = true,
                                   .logprobs = -1,
                                   .prompt_logprobs = -1,
                                   .user = NULL};
            p.sampling =
                (k3_sampler_options){.temperature = 0, .top_p = 1, .repeat_penalty = 1, .seed = (uint64_t)next};
            uint64_t id;
            if (k3_engine_submit(e, &p, &id, &err)) goto fail;
            track *t = &tr[id - first_id];
            t->id = id;
            t->t_submit = k3_now();
            next++;
            in_flight++;
        }
        if (t_mark == 0 && next == num) {
            /* all submitted in flight are decoding? */
            bool all = in_flight > 0;
            for (long i = 0; i < n_track && all; i++)
                if (tr[i].id && !tr[i].done && !tr[i].long_one && tr[i].n_out == 0) all = false;
            if (all) t_mark = k3_now();
        }
        if (!long_sent && t_mark > 0) {
            {
                k3_request_params p = {.prompt = long_prompt,
                                       .n_prompt = long_len,
                                       .max_tokens = 1,
                                       .ignore_eos = true,
                                       .logprobs = -1,
                                       .prompt_logprobs = -1};
                p.sampling = (k3_sampler_options){.top_p = 1, .repeat_penalty = 1};
                uint64_t id;
                if (k3_engine_submit(e, &p, &id, &err)) goto fail;
                track *t = &tr[id - first_id];
                t->id = id;
                t->long_one = true;
                t->t_submit = k3_now();
                long_sent = true;
            }
        }
        k3_step_result sr;
        if (k3_engine_step(e, &sr, &err)) goto fail;
        int32_t step_decodes = 0; /* tokens given to the other requests this step */
        for (int32_t i = 0; i < sr.n_outputs; i++) {
            const k3_req_output *o = &sr.outputs[i];
            if (o->id < first_id || o->id >= first_id + (uint64_t)n_track) continue;
            track *t = &tr[o->id - first_id];
            if (o->n_new > 0 && !t->long_one && t->n_out > 0) step_decodes += o->n_new;
            if (o->n_new > 0) {
                if (t->n_out == 0) t->t_first = sr.t;
                else if (!t->long_one) {
                    itl[n_itl++] = sr.t - t->t_last;
                    if (t_mark > 0 && t->t_last >= t_mark && !long_done) itl2[n_itl2++] = sr.t - t->t_last;
                }
                t->t_last = sr.t;
                t->n_out += o->n_new;
            }
            if (o->events & K3_EV_FINISHED) {
                if (o->finish == K3_FINISH_ERROR) {
                    fprintf(stderr, "k3 bench throughput: request %llu failed: %s\n", (unsigned long long)o->id,
                            o->error ? o->error : "?");
                    goto out;
                }
                t->done = true;
                if (t->long_one) long_done = true;
                done++;
                if (!t->long_one) in_flight--;
                t_end = sr.t;
            }
        }
        /* how far the long prompt got while the others decoded */
        if (long_sent && !long_done && t_mark > 0 && step_decodes > 0 && sr.n_tokens > step_decodes)
            long_beside += sr.n_tokens - step_decodes;
    }
    const double wall = t_end - t0;
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);

    long n_t = 0, n_p = 0;
    double long_ttft = 0;
    for (long i = 0; i < n_track; i++) {
        if (tr[i].long_one) {
            long_ttft = tr[i].t_first - tr[i].t_submit;
            continue;
        }
        ttft[n_t++] = tr[i].t_first - tr[i].t_submit;
        if (tr[i].n_out > 1) tpot[n_p++] = (tr[i].t_last - tr[i].t_first) / (tr[i].n_out - 1);
    }
    for (int64_t i = 0; i < n_itl; i++) itl[i] *= 1e3;
    for (int64_t i = 0; i < n_itl2; i++) itl2[i] *= 1e3;
    for (long i = 0; i < n_t; i++) ttft[i] *= 1e3;
    for (long i = 0; i < n_p; i++) tpot[i] *= 1e3;
    const dist d_ttft = summarize(ttft, n_t), d_tpot = summarize(tpot, n_p), d_itl = summarize(itl, n_itl),
               d_itl2 = summarize(itl2, n_itl2);
    const double out_tok = (double)num * (double)out_len, in_tok = (double)num * (double)in_len + (double)long_len;
    const double hit_rate = st.prefix_queries ? (double)st.prefix_hits / (double)st.prefix_queries : 0.0;
    const double snap_take_ms = st.n_snapshot_saves ? st.snapshot_save_s / (double)st.n_snapshot_saves * 1e3 : 0;
    const double snap_restore_ms =
        st.n_snapshot_restores ? st.snapshot_restore_s / (double)st.n_snapshot_restores * 1e3 : 0;
    if (json) {
        printf("{\"model\": \"%s\", \"threads\": %ld, \"quant\": \"%s\", \"kv_cache\": \"%s\", \"isa\": \"%s\", "
               "\"num_prompts\": %ld, "
               "\"max_concurrency\": %ld, \"input_len\": %ld, \"output_len\": %ld, \"prefix_len\": %ld, "
               "\"num_prefixes\": %ld, \"long_prompt\": %ld, \"prefix_cache\": %s, \"elapsed_s\": %.3f, "
               "\"request_throughput\": %.4f, \"output_throughput\": %.3f, \"total_token_throughput\": %.3f, "
               "\"prefix_cache_hit_rate\": %.4f, \"prefix_cache_queries\": %lld, \"prefix_cache_hits\": %lld, "
               "\"preemptions\": %lld, "
               "\"ttft_ms\": {\"mean\": %.3f, \"median\": %.3f, \"p99\": %.3f}, "
               "\"tpot_ms\": {\"mean\": %.3f, \"median\": %.3f, \"p99\": %.3f}, "
               "\"itl_ms\": {\"mean\": %.3f, \"median\": %.3f, \"p99\": %.3f}, "
               "\"itl_decoding_ms\": {\"mean\": %.3f, \"median\": %.3f, \"p99\": %.3f, \"n\": %lld}, "
               "\"long_prompt_ttft_ms\": %.3f, \"snapshot_bytes_each\": %lld, \"snapshots_taken\": %lld, "
               "\"snapshot_take_ms\": %.4f, \"snapshots_restored\": %lld, \"snapshot_restore_ms\": %.4f, "
               "\"cache_tokens\": %lld, \"max_num_seqs\": %d, \"max_step_cost\": %ld, \"step_cost_max\": %.2f, "
               "\"prefill_cost_p0\": %lld, \"long_prompt_tokens_beside_decodes\": %lld}\n",
               dir, threads, quant, kv == K3_KV_C8 ? "c8" : "f32", k3_isa_current(), num, conc, in_len, out_len, pfx,
               n_pfx, long_len, no_prefix ? "false" : "true", wall, num / wall, out_tok / wall,
               (out_tok + in_tok) / wall, hit_rate, (long long)st.prefix_queries, (long long)st.prefix_hits,
               (long long)st.n_preemptions, d_ttft.mean, d_ttft.median, d_ttft.p99, d_tpot.mean, d_tpot.median,
               d_tpot.p99, d_itl.mean, d_itl.median, d_itl.p99, d_itl2.mean, d_itl2.median, d_itl2.p99,
               (long long)n_itl2, long_ttft * 1e3, (long long)st.state_bytes_per_seq, (long long)st.n_snapshot_saves,
               snap_take_ms, (long long)st.n_snapshot_restores, snap_restore_ms, (long long)st.cache_tokens,
               eo.max_num_seqs, msc, st.step_cost_max, (long long)st.prefill_cost_p0, (long long)long_beside);
    } else {
        printf("elapsed                 %.2f s\n", wall);
        printf("request throughput      %.3f req/s\n", num / wall);
        printf("output throughput       %.2f tok/s\n", out_tok / wall);
        printf("total token throughput  %.2f tok/s\n", (out_tok + in_tok) / wall);
        printf("TTFT ms                 mean %.2f  median %.2f  p99 %.2f\n", d_ttft.mean, d_ttft.median, d_ttft.p99);
        printf("TPOT ms                 mean %.2f  median %.2f  p99 %.2f\n", d_tpot.mean, d_tpot.median, d_tpot.p99);
        printf("ITL ms                  mean %.2f  median %.2f  p99 %.2f\n", d_itl.mean, d_itl.median, d_itl.p99);
        printf("ITL ms, all decoding     mean %.2f  median %.2f  p99 %.2f (%lld gaps%s)\n", d_itl2.mean, d_itl2.median,
               d_itl2.p99, (long long)n_itl2, long_len ? ", while the long prompt ran" : "");
        printf("prefix_cache_hit_rate   %.4f (%lld of %lld prompt tokens)\n", hit_rate, (long long)st.prefix_hits,
               (long long)st.prefix_queries);
        printf("preemptions             %lld\n", (long long)st.n_preemptions);
        if (msc)
            printf("step cost guard         %ld decode tokens; costliest step with decodes %.2f (a prompt token costs "
                   "2 at position %lld)\n",
                   msc, st.step_cost_max, (long long)st.prefill_cost_p0);
        if (long_len)
            printf("long prompt TTFT        %.2f ms (%ld tokens, %lld of them in steps beside decodes)\n",
                   long_ttft * 1e3, long_len, (long long)long_beside);
        printf("KDA snapshot            %lld bytes each; %lld taken (%.3f ms each), %lld restored (%.3f ms each)\n",
               (long long)st.state_bytes_per_seq, (long long)st.n_snapshot_saves, snap_take_ms,
               (long long)st.n_snapshot_restores, snap_restore_ms);
    }
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "k3 bench throughput: %s\n", err.msg);
out:
    free(prompts);
    free(long_prompt);
    free(tr);
    free(ttft);
    free(tpot);
    free(itl);
    free(itl2);
    k3_engine_close(e);
    k3_pool_free(pool);
    k3_model_close(m);
    return rc;
}
