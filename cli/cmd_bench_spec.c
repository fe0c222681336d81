/*
 * cmd_bench_spec.c -- `k3 bench spec`: speculative decoding measured
 * (docs/spec.md).
 *
 *   --curve          one verify pass of 1 + k positions of one sequence (k =
 *                    1, 2, 4, 8) against one decode step, at a context of
 *                    --context tokens, batch 1: the median of --runs
 *                    passes, its ratio, and the accept (the KDA rollback)
 *                    for both ways of keeping it, with the bytes each keeps
 *                    per sequence here;
 *   --text FILE      end to end: greedy continuation of the file's first
 *                    --prompt-tokens tokens, --gen tokens, with and without
 *                    drafts (rounds alternated), through the engine;
 *   --replay FILE    end to end over a conversation (JSON lines, one turn
 *                    each: {"user": TEXT, "prefix": TEXT}): each turn's
 *                    prompt is the whole conversation so far, its reply
 *                    generated greedily and kept for the next turns;
 *   --synthetic      end to end on a prompt of random ids (a model's own
 *                    greedy continuation).
 *   --stree FILE     the suffix tree alone (no model): the proposer's index
 *                    of a prompt of the file's token ids (whitespace
 *                    separated, as `k3 tokenize` prints them), built as a
 *                    request's first drafting step builds it (in a new
 *                    tree and in one emptied for it, as the proposer
 *                    reuses closed requests' trees) and taken off again
 *                    token by token, then the same for a random text of as
 *                    many ids (novel text: nearly every substring new): ns
 *                    a token and nodes, the median of --runs.
 * --temp F samples instead of greedy (the same seed with and without).
 * Each end-to-end figure is decode tokens per second (generated tokens
 * after the first, over the time after the first), with and without, their
 * ratio, the mean acceptance length (1 + accepted / verify passes), and
 * whether the texts are the same. The memory bandwidth around the run is
 * printed: this machine's moves between states.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli.h"
#include "ctx/ctx.h"
#include "spec/spec.h"

static void usage_to(FILE *f) {
    fprintf(f,
            "usage: k3 bench spec -m DIR [--curve] [--text FILE | --replay FILE | --synthetic] [options]\n"
            "  --curve              one verify pass of 1 + k positions (k = 1, 2, 4, 8) against a decode step\n"
            "  --context N          the curve's context (default 512); --profile: its passes by operator\n"
            "  --text FILE          greedy continuation of the file's start, with and without drafts\n"
            "  --replay FILE        a conversation, one JSON line per turn {\"user\": TEXT, \"prefix\": TEXT}\n"
            "  --synthetic          a prompt of random ids\n"
            "  --stree FILE         the suffix tree alone over the file's token ids and a random text as long\n"
            "                       (ns a token to insert and to remove, nodes; median of --runs; no model)\n"
            "  --prompt-tokens N    the --text / --synthetic prompt (default 256)\n"
            "  --gen N              tokens generated per prompt or turn (default 128)\n"
            "  --temp F             sample at this temperature, seed 1 (default 0: greedy)\n"
            "  --rounds N           alternated rounds of with and without (default 3); --runs N curve passes\n"
            "  --quant MODE, --kv-cache f32|c8, --isa NAME, --threads N, --mmap\n" K3_CLI_SPEC_HELP);
}

static double median(double *v, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            const double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return n ? (n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2) : 0;
}

/* ---- the verify cost curve -------------------------------------------------- */

static int curve(const k3_model *m, k3_pool *pool, k3_kv_type kv, int64_t context, int runs, bool profile, double bw,
                 const k3_quant_options *qo) {
    k3_model_info info;
    k3_model_get_info(m, &info);
    const int ks[5] = {0, 1, 2, 4, 8};
    k3_ctx *ctx = NULL;
    k3_error err = {0};
    k3_ctx_options o = {.max_seqs = 1,
                        .cache_tokens = context + 64 * (runs + 2) * 9 + 64,
                        .kv_cache = kv,
                        .pool = pool};
    if (k3_ctx_init(&ctx, m, &o, &err)) {
        fprintf(stderr, "k3 bench spec: %s\n", err.msg);
        return 1;
    }
    float *lg = malloc(sizeof(float) * (size_t)(9 * info.vocab_size));
    int32_t ids[9];
    for (int i = 0; i < 9; i++) ids[i] = (int32_t)(17 + 101 * i) % (int32_t)info.vocab_size;
    if (!lg || k3_ctx_seq_fill_synthetic(ctx, 0, context, 7, &err)) {
        fprintf(stderr, "k3 bench spec: %s\n", err.msg[0] ? err.msg : "out of memory");
        free(lg);
        k3_ctx_free(ctx);
        return 1;
    }
    double base = 0;
    printf("verify cost at batch 1, context %lld (median of %d passes, %s, %d threads)\n", (long long)context, runs,
           k3_isa_current(), k3_pool_size(pool));
    printf("  %-6s %10s %8s %12s %12s %12s %14s\n", "k", "pass ms", "x decode", "accept ms", "states pass",
           "states acc", "kept KB/seq");
    static const char *ops[K3_PROF_COUNT] = {"embed", "attnres", "norm", "kda", "mlapo", "qli",
                                             "attn",  "mla_out", "ffn",  "moe", "head"};
    double prof[5][K3_PROF_COUNT] = {{0}};
    double uni[5] = {0}, tms[5] = {0}; /* experts read per MoE layer (the union), pass ms */
    for (int ki = 0; ki < 5; ki++) {
        const int k = ks[ki];
        double t[64], ta[64], ts[64], tps[64];
        int n = 0;
        k3_profile pr;
        k3_ctx_profile_enable(ctx, profile);
        k3_ctx_profile_take(ctx, &pr);
        for (int r = -1; r < runs && r < 64; r++) {
            for (int mode = K3_SPEC_REAPPLY; mode <= (k ? K3_SPEC_STATES : K3_SPEC_REAPPLY); mode++) {
                const k3_batch_seq b = {0, 1 + k, ids, NULL};
                /* the untimed first pass counts the experts it reads */
                const bool count = r < 0 && mode == K3_SPEC_REAPPLY;
                if (count) {
                    k3_ctx_profile_take(ctx, &pr);
                    k3_ctx_profile_enable(ctx, true);
                }
                if (k && k3_ctx_spec_begin(ctx, 0, 1 + k, mode, &err)) goto fail;
                const double t0 = k3_now();
                if (k3_ctx_forward(ctx, &b, 1, k ? K3_LOGITS_ALL : K3_LOGITS_LAST, lg, &err)) goto fail;
                const double t1 = k3_now();
                /* keep the last token and half the drafts: a typical accept */
                if (k && k3_ctx_spec_accept(ctx, 0, 1 + k / 2, &err)) goto fail;
                const double t2 = k3_now();
                if (count) {
                    k3_ctx_profile_take(ctx, &pr);
                    uni[ki] = pr.moe_calls ? (double)pr.moe_experts / (double)pr.moe_calls : 0;
                    k3_ctx_profile_enable(ctx, profile);
                }
                if (r < 0) continue;
                if (mode == K3_SPEC_REAPPLY) {
                    t[n] = t1 - t0;
                    ta[n] = t2 - t1;
                } else {
                    tps[n] = t1 - t0;
                    ts[n] = t2 - t1;
                }
            }
            if (r >= 0) n++;
        }
        if (profile) {
            k3_ctx_profile_take(ctx, &pr);
            for (int op = 0; op < K3_PROF_COUNT; op++) prof[ki][op] = pr.seconds[op] * 1e3 / (runs + 1) / (k ? 2 : 1);
        }
        k3_ctx_profile_enable(ctx, false);
        const double tm = median(t, n) * 1e3, am = k ? median(ta, n) * 1e3 : 0, sm = k ? median(ts, n) * 1e3 : 0;
        const double pm = k ? median(tps, n) * 1e3 : 0;
        if (!k) base = tm;
        tms[ki] = tm;
        printf("  %-6d %10.2f %8.2f %12.3f %12.2f %12.3f %7.0f /%6.0f\n", k, tm, base > 0 ? tm / base : 0, am, pm, sm,
               k ? (double)k3_ctx_spec_bytes(ctx, 1 + k, K3_SPEC_REAPPLY) / 1024 : 0,
               k ? (double)k3_ctx_spec_bytes(ctx, 1 + k, K3_SPEC_STATES) / 1024 : 0);
    }
    printf("  (pass: re-applying rollback, its verify pass; accept: its KDA rollback of keeping 1 + k/2 positions;\n"
           "   states pass / acc: the verify pass that keeps every position's state, and its accept (a copy);\n"
           "   kept KB/seq: what each way holds per sequence, re-apply / states; a KDA state here is %lld KB)\n",
           (long long)(k3_ctx_state_bytes(ctx) / 1024));
    /* The floors: the bytes a pass must read (the trunk once, the union of
     * the experts its positions picked in each MoE layer) at the bandwidth
     * measured before, and its multiply-adds (2 a parameter a position) at
     * the register peak of the dot products the mode runs few rows on. */
    const double exp_b = (double)info.expert_bytes,
                 trunk = (double)info.bytes_per_token - exp_b * info.n_experts_per_tok * info.n_moe_layers;
    /* the kind of the mode's products below the tiles' rows: AMX's kinds
     * map to the AVX-512 dot products the few rows of a pass run on */
    k3_peak_kind pk = k3_peak_of(qo);
    if (pk == K3_PEAK_AMX_BF16) pk = K3_PEAK_BF16DOT;
    if (pk == K3_PEAK_AMX_INT8) pk = K3_PEAK_INT8DOT;
    const double peak = k3_peak_gflops(pool, pk, 0.1);
    printf("  floors: trunk %.1f MB a pass, %.3f MB an expert of a layer, %d MoE layers, %.1f GB/s, %s peak %.0f "
           "GFLOP/s\n",
           trunk / 1e6, exp_b / 1e6, info.n_moe_layers, bw, k3_peak_name(pk), peak);
    printf("  %-6s %12s %10s %12s %10s %12s %10s\n", "k", "experts/lyr", "MB read", "bytes ms", "GFLOP", "flops ms",
           "pass/floor");
    for (int ki = 0; ki < 5; ki++) {
        const double rd = trunk + exp_b * uni[ki] * info.n_moe_layers,
                     fl = 2.0 * (double)info.n_params_active * (1 + ks[ki]) / 1e9;
        const double fb = bw > 0 ? rd / (bw * 1e9) * 1e3 : 0, fc = peak > 0 ? fl / peak * 1e3 : 0;
        const double fm = fb > fc ? fb : fc;
        printf("  %-6d %12.1f %10.1f %12.2f %10.2f %12.2f %10.2f\n", ks[ki], uni[ki], rd / 1e6, fb, fl, fc,
               fm > 0 ? tms[ki] / fm : 0);
    }
    if (profile) {
        printf("  ms per pass by operator (mean, both rollbacks' passes):\n  %-8s", "k");
        for (int ki = 0; ki < 5; ki++) printf(" %8d", ks[ki]);
        printf("\n");
        for (int op = 0; op < K3_PROF_COUNT; op++) {
            printf("  %-8s", ops[op]);
            for (int ki = 0; ki < 5; ki++) printf(" %8.2f", prof[ki][op]);
            printf("\n");
        }
    }
    free(lg);
    k3_ctx_free(ctx);
    return 0;
fail:
    fprintf(stderr, "k3 bench spec: %s\n", err.msg);
    free(lg);
    k3_ctx_free(ctx);
    return 1;
}

/* ---- the suffix tree alone ---------------------------------------------------- */

/* The prompt's index as k3_spec_seq_open makes it (depth 24, the same node
 * budget) in a new tree (the first request) and in a tree emptied for it
 * (what a request gets after one closed), and the text removed again (the
 * scope cache's eviction): the median ns a token of each over runs, and
 * the nodes. */
static int stree_one(const char *label, const int32_t *ids, int64_t n, int runs) {
    const int32_t D = 24;
    const int64_t budget = (n + 16384) * D + 1;
    double new_ns[64] = {0}, reuse_ns[64] = {0}, pop_ns[64] = {0};
    int64_t nodes = 0, bytes = 0;
    for (int r = 0; r < runs; r++) {
        k3_stree t;
        k3_error err = {0};
        const double t0 = k3_now();
        if (k3_stree_init(&t, D, budget, &err)) {
            fprintf(stderr, "k3 bench spec: %s\n", err.msg);
            return 1;
        }
        k3_sactive a = {0};
        for (int64_t i = 0; i < n; i++) k3_stree_push(&t, &a, ids[i]);
        const double t1 = k3_now();
        nodes = t.n_nodes - t.n_free - 1;
        bytes = k3_stree_bytes(&t);
        k3_sactive b = {0};
        for (int64_t i = 0; i < n; i++) k3_stree_pop(&t, &b, ids[i]);
        const double t2 = k3_now();
        const int32_t left = t.n_nodes - t.n_free;
        k3_stree_clear(&t, budget, n * D);
        k3_sactive c = {0};
        for (int64_t i = 0; i < n; i++) k3_stree_push(&t, &c, ids[i]);
        const double t3 = k3_now();
        const bool same = t.n_nodes - t.n_free - 1 == nodes;
        k3_stree_free(&t);
        if (left != 1 || !same) {
            fprintf(stderr, "k3 bench spec: %s: %d nodes left after removing the text, %s nodes made again\n", label,
                    left, same ? "as many" : "not as many");
            return 1;
        }
        new_ns[r] = (t1 - t0) * 1e9 / (double)n;
        pop_ns[r] = (t2 - t1) * 1e9 / (double)n;
        reuse_ns[r] = (t3 - t2) * 1e9 / (double)n;
    }
    printf("%-8s %7lld tokens, %lld nodes (%.2f a token), %.1f MB: ns a token: insert %.1f (new tree), %.1f (a tree "
           "reused), remove %.1f\n",
           label, (long long)n, (long long)nodes, (double)nodes / (double)n, (double)bytes / 1e6, median(new_ns, runs),
           median(reuse_ns, runs), median(pop_ns, runs));
    return 0;
}

static int stree_bench(const char *path, int runs, int threads) {
    size_t len;
    char *buf = k3_cli_read_input("bench spec", path, K3_CLI_MAX_INPUT, &len);
    if (!buf) return 1;
    int64_t n = 0, cap = 0;
    int32_t *ids = NULL, max_id = 0;
    for (char *s = buf, *e;; s = e) {
        while (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r') s++;
        if (!*s) break;
        const long v = strtol(s, &e, 10);
        if (e == s || v < 0 || v > INT32_MAX || (*e && *e != ' ' && *e != '\n' && *e != '\t' && *e != '\r')) {
            fprintf(stderr, "k3 bench spec: %s: not a token id at byte %td\n", path, s - buf);
            free(buf);
            free(ids);
            return 1;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 4096;
            int32_t *g = realloc(ids, sizeof *g * (size_t)cap);
            if (!g) {
                fprintf(stderr, "k3 bench spec: out of memory\n");
                free(buf);
                free(ids);
                return 1;
            }
            ids = g;
        }
        ids[n++] = (int32_t)v;
        max_id = (int32_t)v > max_id ? (int32_t)v : max_id;
    }
    free(buf);
    if (!n) {
        fprintf(stderr, "k3 bench spec: %s holds no token ids\n", path);
        return 1;
    }
    k3_pool *pool = NULL;
    k3_error err = {0};
    if (k3_pool_init(&pool, threads, &err)) {
        fprintf(stderr, "k3 bench spec: %s\n", err.msg);
        free(ids);
        return 1;
    }
    printf("k3 bench spec --stree %s: depth 24, %d runs; memory bandwidth %.1f GB/s before\n", path, runs,
           k3_membw_read_gbps(pool, (size_t)1 << 30, 3));
    /* a random text of as many ids over the file's id range */
    int32_t *rnd = malloc(sizeof *rnd * (size_t)n);
    uint64_t r = 99;
    for (int64_t i = 0; rnd && i < n; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        rnd[i] = (int32_t)((r >> 33) % ((uint64_t)max_id + 1));
    }
    const int rc = !rnd || stree_one("file", ids, n, runs) || stree_one("random", rnd, n, runs);
    printf("memory bandwidth %.1f GB/s after\n", k3_membw_read_gbps(pool, (size_t)1 << 30, 3));
    k3_pool_free(pool);
    free(rnd);
    free(ids);
    return rc;
}

/* ---- end to end ---------------------------------------------------------------- */

typedef struct e2e {
    const k3_model *m;
    const k3_tokenizer *tok;
    k3_pool *pool;
    k3_kv_type kv;
    k3_engine_options spec; /* the speculative options (k3_cli_spec_apply), draft model opened once */
    int gen;
    float temp;    /* 0: greedy */
    uint64_t seed; /* with temp > 0 */
} e2e;

typedef struct gen_out {
    int32_t *tok;
    int n, cap;
    double decode_s; /* after the first token */
    int decoded;     /* tokens after the first */
    int64_t drafts, accepted;
    int turns; /* replay turns run */
} gen_out;

/* An engine for one run (spec on or off) of requests of at most
 * cache_tokens tokens each, one at a time; NULL after saying why. */
static k3_engine *engine_for(const e2e *x, bool on, int64_t cache_tokens) {
    k3_engine_options eo = on ? x->spec : (k3_engine_options){0};
    eo.max_num_seqs = 1;
    eo.kv_cache = x->kv;
    eo.pool = x->pool;
    eo.no_prefix_cache = true;
    eo.cache_tokens = cache_tokens;
    eo.max_model_len = eo.cache_tokens;
    k3_engine *e = NULL;
    k3_error err = {0};
    if (k3_engine_open(&e, x->m, &eo, &err)) {
        fprintf(stderr, "k3 bench spec: %s\n", err.msg);
        return NULL;
    }
    return e;
}

/* One greedy request through engine e: its tokens appended to out. */
static int generate(const e2e *x, k3_engine *e, const int32_t *prompt, int64_t n_prompt, gen_out *out) {
    k3_error err = {0};
    k3_request_params p = {.prompt = prompt,
                           .n_prompt = n_prompt,
                           .max_tokens = x->gen,
                           .ignore_eos = true,
                           .logprobs = -1,
                           .prompt_logprobs = -1,
                           .sampling = {.temperature = x->temp, .top_p = 1, .repeat_penalty = 1, .seed = x->seed}};
    uint64_t id;
    if (k3_engine_submit(e, &p, &id, &err)) {
        fprintf(stderr, "k3 bench spec: %s\n", err.msg);
        return 1;
    }
    k3_engine_stats st0;
    k3_engine_get_stats(e, &st0);
    double t_first = 0, t_last = 0;
    int n_req = 0;
    while (k3_engine_has_work(e)) {
        k3_step_result sr;
        if (k3_engine_step(e, &sr, &err)) {
            fprintf(stderr, "k3 bench spec: %s\n", err.msg);
            return 1;
        }
        for (int32_t i = 0; i < sr.n_outputs; i++)
            for (int32_t t = 0; t < sr.outputs[i].n_new; t++) {
                if (out->n == out->cap) {
                    out->cap = out->cap ? 2 * out->cap : 1024;
                    out->tok = realloc(out->tok, sizeof(int32_t) * (size_t)out->cap);
                    if (!out->tok) return 1;
                }
                out->tok[out->n++] = sr.outputs[i].tokens[t];
                if (!n_req++) t_first = sr.t;
                else t_last = sr.t;
            }
    }
    if (n_req > 1) {
        out->decode_s += t_last - t_first;
        out->decoded += n_req - 1;
    }
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    out->drafts += st.spec_drafts - st0.spec_drafts;
    out->accepted += st.spec_accepted_tokens - st0.spec_accepted_tokens;
    return 0;
}

/* One request through a fresh engine. */
static int generate_once(const e2e *x, bool on, const int32_t *prompt, int64_t n_prompt, gen_out *out) {
    k3_engine *e = engine_for(x, on, n_prompt + x->gen + 64);
    if (!e) return 1;
    const int rc = generate(x, e, prompt, n_prompt, out);
    k3_engine_close(e);
    return rc;
}

/* The replay: each turn "User: TEXT\nAssistant: PREFIX" appended to the
 * conversation, the reply generated and kept; the turns one request after
 * another through one engine, as a server takes them (its cost model and
 * its cache of past outputs carry over). */
static int replay_once(const e2e *x, bool on, json_t *turns, gen_out *out) {
    const size_t n_turns = json_array_size(turns);
    int32_t **ids = calloc(n_turns + 1, sizeof *ids);
    size_t *ni = calloc(n_turns + 1, sizeof *ni);
    int32_t *conv = NULL;
    k3_engine *e = NULL;
    int rc = !ids || !ni;
    k3_model_info info;
    k3_model_get_info(x->m, &info);
    /* the turns' tokens, and the conversation's length the engine holds */
    int64_t total = 64;
    size_t used = 0;
    for (size_t t = 0; !rc && t < n_turns; t++) {
        json_t *turn = json_array_get(turns, t);
        const char *user = json_string_value(json_object_get(turn, "user"));
        const char *prefix = json_string_value(json_object_get(turn, "prefix"));
        char *text = malloc(strlen(user ? user : "") + strlen(prefix ? prefix : "") + 32);
        if (!text) {
            rc = 1;
            break;
        }
        sprintf(text, "%sUser: %s\nAssistant: %s", t ? "\n" : "", user ? user : "", prefix ? prefix : "");
        k3_error err = {0};
        if (k3_tokenizer_encode(x->tok, text, strlen(text), &ids[t], &ni[t], &err)) {
            fprintf(stderr, "k3 bench spec: %s\n", err.msg);
            rc = 1;
        }
        free(text);
        if (rc || total + (int64_t)ni[t] + x->gen > info.max_positions) break; /* the model's length: it ends here */
        total += (int64_t)ni[t] + x->gen;
        used = t + 1;
    }
    if (!rc && used) {
        conv = malloc(sizeof(int32_t) * (size_t)total);
        e = conv ? engine_for(x, on, total) : NULL;
        rc = !e;
    }
    int64_t n = 0;
    for (size_t t = 0; !rc && t < used; t++) {
        out->turns++;
        memcpy(conv + n, ids[t], sizeof(int32_t) * ni[t]);
        n += (int64_t)ni[t];
        const int before = out->n;
        rc = generate(x, e, conv, n, out);
        for (int i = before; !rc && i < out->n; i++) conv[n++] = out->tok[i];
    }
    k3_engine_close(e);
    for (size_t t = 0; ids && t < n_turns; t++) free(ids[t]);
    free(ids);
    free(ni);
    free(conv);
    return rc;
}

static void report(const char *what, gen_out *off, gen_out *on, int rounds) {
    const bool same = off[0].n == on[0].n && !memcmp(off[0].tok, on[0].tok, sizeof(int32_t) * (size_t)on[0].n);
    double r_off[16], r_on[16], ratio[16];
    for (int i = 0; i < rounds; i++) {
        r_off[i] = off[i].decode_s > 0 ? off[i].decoded / off[i].decode_s : 0;
        r_on[i] = on[i].decode_s > 0 ? on[i].decoded / on[i].decode_s : 0;
        ratio[i] = r_off[i] > 0 ? r_on[i] / r_off[i] : 0;
    }
    const double acc = on[0].drafts ? 1.0 + (double)on[0].accepted / (double)on[0].drafts : 1.0;
    printf("%s: %d tokens; decode %.2f tok/s without, %.2f with drafts: %.2fx (median of %d alternated rounds); "
           "mean acceptance length %.2f (%lld verify passes, %lld accepted); same text: %s\n",
           what, on[0].n, median(r_off, rounds), median(r_on, rounds), median(ratio, rounds), rounds, acc,
           (long long)on[0].drafts, (long long)on[0].accepted, same ? "yes" : "NO");
}

int k3_cmd_bench_spec(int argc, char **argv) {
    const char *dir = K3_DEFAULT_MODEL, *quant = K3_DEFAULT_QUANT, *text = NULL, *replay = NULL, *stree = NULL;
    int threads = k3_cli_default_threads(), runs = 9, rounds = 3, gen = 128, prompt_tokens = 256;
    float temp = 0;
    long context = 512;
    bool do_curve = false, synthetic = false, keep_mapped = false, profile = false;
    k3_kv_type kv = K3_KV_F32;
    k3_cli_parse_kv(K3_DEFAULT_KV, &kv);
    k3_cli_spec spec = {.method = "suffix"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const bool has = i + 1 < argc;
        const int sa = k3_cli_spec_arg("bench spec", argc, argv, &i, &spec);
        if (sa < 0) return 2;
        if (sa) continue;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage_to(stdout);
            return 0;
        } else if (!strcmp(a, "-m") && has) dir = argv[++i];
        else if (!strcmp(a, "--curve")) do_curve = true;
        else if (!strcmp(a, "--profile")) profile = true;
        else if (!strcmp(a, "--synthetic")) synthetic = true;
        else if (!strcmp(a, "--mmap")) keep_mapped = true;
        else if (!strcmp(a, "--text") && has) text = argv[++i];
        else if (!strcmp(a, "--replay") && has) replay = argv[++i];
        else if (!strcmp(a, "--stree") && has) stree = argv[++i];
        else if (!strcmp(a, "--quant") && has) quant = argv[++i];
        else if (!strcmp(a, "--context") && has) {
            if (k3_cli_long("bench spec", a, argv[++i], 1, 1 << 22, &context)) return 2;
        } else if (!strcmp(a, "--runs") && has) {
            if (k3_cli_int("bench spec", a, argv[++i], 1, 64, &runs)) return 2;
        } else if (!strcmp(a, "--rounds") && has) {
            if (k3_cli_int("bench spec", a, argv[++i], 1, 16, &rounds)) return 2;
        } else if (!strcmp(a, "--temp") && has) {
            if (k3_cli_float("bench spec", a, argv[++i], 0, 10, &temp)) return 2;
        } else if (!strcmp(a, "--gen") && has) {
            if (k3_cli_int("bench spec", a, argv[++i], 2, 1 << 16, &gen)) return 2;
        } else if (!strcmp(a, "--prompt-tokens") && has) {
            if (k3_cli_int("bench spec", a, argv[++i], 1, 1 << 20, &prompt_tokens)) return 2;
        } else if (!strcmp(a, "--threads") && has) {
            if (k3_cli_threads("bench spec", argv[++i], &threads)) return 2;
        } else if (!strcmp(a, "--isa") && has) {
            if (k3_cli_set_isa("bench spec", argv[++i])) return 2;
        } else if (!strcmp(a, "--kv-cache") && has) {
            if (k3_cli_parse_kv(argv[++i], &kv)) {
                fprintf(stderr, "k3 bench spec: --kv-cache must be f32 or c8\n");
                return 2;
            }
        } else {
            fprintf(stderr, "k3 bench spec: unknown option or missing value: %s\n", a);
            usage_to(stderr);
            return 2;
        }
    }
    if (stree) return stree_bench(stree, runs, threads);
    if (!do_curve && !text && !replay && !synthetic) {
        fprintf(stderr, "k3 bench spec: give --curve, --text FILE, --replay FILE, --synthetic or --stree FILE\n");
        return 2;
    }
    if (!(dir = k3_cli_model_dir("bench spec", dir))) return 1;
    k3_error err = {0};
    k3_model *m = NULL;
    k3_tokenizer *tok = NULL;
    k3_pool *pool = NULL;
    k3_model *draft = NULL;
    int rc = 1;
    json_t *turns = NULL;
    if (k3_cli_open_model(&m, dir, quant, keep_mapped, &err) || k3_pool_init(&pool, threads, &err)) {
        fprintf(stderr, "k3 bench spec: %s\n", err.msg);
        goto out;
    }
    if ((text || replay) && k3_tokenizer_open(&tok, dir, &err)) {
        fprintf(stderr, "k3 bench spec: %s\n", err.msg);
        goto out;
    }
    const double bw0 = k3_membw_read_gbps(pool, (size_t)1 << 30, 3);
    printf("k3 bench spec: %s, quant %s, kv %s, %s, %d threads; memory bandwidth %.1f GB/s before\n", dir, quant,
           kv == K3_KV_C8 ? "c8" : "f32", k3_isa_current(), threads, bw0);
    k3_quant_options qo = {0};
    k3_quant_parse(quant, &qo, NULL); /* checked when the model opened */
    if (do_curve && curve(m, pool, kv, context, runs, profile, bw0, &qo)) goto out;
    e2e x = {m, tok, pool, kv, {0}, gen, temp, 1};
    if (k3_cli_spec_apply("bench spec", &spec, quant, &x.spec, &draft)) goto out;
    gen_out off[16], on[16];
    const char *what[3] = {"text", "replay", "synthetic"};
    for (int w = 0; w < 3; w++) {
        if ((w == 0 && !text) || (w == 1 && !replay) || (w == 2 && !synthetic)) continue;
        int32_t *prompt = NULL;
        size_t np = 0;
        if (w == 0) {
            size_t len;
            char *buf = k3_cli_read_input("bench spec", text, K3_CLI_MAX_INPUT, &len);
            if (!buf) goto out;
            const k3_status s = k3_tokenizer_encode(tok, buf, len, &prompt, &np, &err);
            free(buf);
            if (s) {
                fprintf(stderr, "k3 bench spec: %s\n", err.msg);
                goto out;
            }
            if ((int)np > prompt_tokens) np = (size_t)prompt_tokens;
        } else if (w == 1) {
            json_error_t je;
            turns = json_array();
            FILE *f = fopen(replay, "r");
            if (!f) {
                fprintf(stderr, "k3 bench spec: cannot open %s\n", replay);
                goto out;
            }
            char line[1 << 16];
            while (fgets(line, sizeof line, f)) {
                if (line[0] == '\n' || line[0] == '#') continue;
                json_t *t = json_loads(line, 0, &je);
                if (!json_is_object(t)) {
                    fprintf(stderr, "k3 bench spec: %s: a line is not a JSON object: %s\n", replay, je.text);
                    fclose(f);
                    goto out;
                }
                json_array_append_new(turns, t);
            }
            fclose(f);
        } else {
            k3_model_info info;
            k3_model_get_info(m, &info);
            prompt = malloc(sizeof(int32_t) * (size_t)prompt_tokens);
            uint64_t r = 99;
            for (int i = 0; i < prompt_tokens; i++) {
                r = r * 6364136223846793005ull + 1442695040888963407ull;
                prompt[i] = (int32_t)((r >> 33) % (uint64_t)(info.vocab_size - 256)) + 100;
            }
            np = (size_t)prompt_tokens;
        }
        memset(off, 0, sizeof off);
        memset(on, 0, sizeof on);
        for (int r = 0; r < rounds; r++)
            for (int side = 0; side < 2; side++) { /* alternated: off, on, off, on ... */
                const bool s_on = (side + r) % 2 == 1;
                gen_out *g = s_on ? &on[r] : &off[r];
                if (w == 1 ? replay_once(&x, s_on, turns, g) : generate_once(&x, s_on, prompt, (int64_t)np, g)) {
                    free(prompt);
                    goto out;
                }
            }
        char label[64];
        snprintf(label, sizeof label, "%s (%zu-token prompt)", what[w], w == 1 ? json_array_size(turns) : np);
        if (w == 1) snprintf(label, sizeof label, "replay (%d of %zu turns)", on[0].turns, json_array_size(turns));
        report(label, off, on, rounds);
        for (int r = 0; r < rounds; r++) {
            free(off[r].tok);
            free(on[r].tok);
        }
        free(prompt);
    }
    printf("memory bandwidth %.1f GB/s after\n", k3_membw_read_gbps(pool, (size_t)1 << 30, 3));
    rc = 0;
out:
    json_decref(turns);
    k3_model_close(draft);
    k3_tokenizer_free(tok);
    k3_pool_free(pool);
    k3_model_close(m);
    return rc;
}
