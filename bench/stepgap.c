/*
 * stepgap.c -- one decode step of the engine against one of a bare context,
 * in the same process on the same loaded model, interleaved step by step
 * (ctx, engine, ctx, engine, ...) so that both meet the same machine state.
 * (in ABBA order). A developer tool (`make stepgap`), not part of k3: it isolates what the
 * engine's step adds to `k3 run`'s decode loop from the noise of a shared
 * machine (separate processes see different loads and page placements).
 *
 *   build/stepgap MODEL [threads] [prompt_len] [decode_steps] [max_num_seqs]
 *
 * Prints the median and mean time per decode step of each, their ratio,
 * and the engine step's time outside its forward pass is the difference.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "k3.h"

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double mean(const double *v, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += v[i];
    return n ? s / n : 0;
}

#define DIE(...) do { fprintf(stderr, "stepgap: " __VA_ARGS__); fprintf(stderr, ": %s\n", err.msg); return 1; } while (0)

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: stepgap MODEL [threads] [prompt_len] [decode_steps] [max_num_seqs]\n");
        return 2;
    }
    const char *dir = argv[1];
    const int threads = argc > 2 ? atoi(argv[2]) : 2, P = argc > 3 ? atoi(argv[3]) : 127,
              N = argc > 4 ? atoi(argv[4]) : 32, mns = argc > 5 ? atoi(argv[5]) : 16;
    if (threads < 1 || P < 1 || N < 2 || mns < 1) {
        fprintf(stderr, "stepgap: threads, prompt_len, max_num_seqs >= 1 and decode_steps >= 2\n");
        return 2;
    }
    k3_error err = {0};
    k3_model *m = NULL;
    k3_pool *pool = NULL;
    if (k3_model_open(&m, dir, &err)) DIE("cannot open %s", dir);
    k3_quant_options q;
    if (k3_quant_parse("none", &q, &err) || k3_model_quantize(m, &q, &err)) DIE("quantize");
    int64_t copied = 0;
    const long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (k3_model_load_resident(m, (int64_t)pages * psz / 2, &copied, &err)) DIE("load");
    if (k3_pool_init(&pool, threads, &err)) DIE("pool");
    k3_model_info info;
    k3_model_get_info(m, &info);
    const int64_t V = info.vocab_size;

    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)P);
    uint64_t r = 12345;
    for (int i = 0; i < P; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        prompt[i] = (int32_t)((r >> 33) % (uint64_t)(V > 300 ? V - 300 : V));
    }

    /* the bare context, as `k3 run` makes it */
    k3_ctx *ctx = NULL;
    k3_ctx_options co = {.max_seqs = 1, .cache_tokens = P + N + 1, .pool = pool, .kv_cache = K3_KV_C8};
    if (k3_ctx_init(&ctx, m, &co, &err)) DIE("ctx");
    float *logits = malloc(sizeof(float) * (size_t)V);
    k3_sampler *smp = NULL;
    k3_sampler_options so = {.temperature = 0, .top_p = 1, .repeat_penalty = 1};
    if (k3_sampler_init(&smp, &so, (int32_t)V, &err)) DIE("sampler");

    /* the engine, as `k3 serve` makes it */
    k3_engine *e = NULL;
    k3_engine_options eo = {.max_num_seqs = mns, .kv_cache = K3_KV_C8, .max_model_len = P + N + 8,
                            .cache_tokens = (int64_t)(mns + 1) * (P + N + 128), .cache_salt = 1, .pool = pool};
    if (k3_engine_open(&e, m, &eo, &err)) DIE("engine");
    k3_request_params rp = {.prompt = prompt, .n_prompt = P, .max_tokens = N + 1, .ignore_eos = true,
                            .logprobs = -1, .prompt_logprobs = -1, .sampling = so};
    uint64_t id;
    if (k3_engine_submit(e, &rp, &id, &err)) DIE("submit");

    /* prefills */
    k3_batch_seq b = {0, P, prompt, NULL};
    if (k3_ctx_forward(ctx, &b, 1, K3_LOGITS_LAST, logits, &err)) DIE("prefill");
    int32_t tok = k3_sampler_sample(smp, logits);
    k3_step_result res;
    /* the engine's prefill may take more than one step (chunks): until the first token */
    int n_pre = 0;
    do {
        if (k3_engine_step(e, &res, &err)) DIE("engine prefill");
        n_pre++;
    } while (n_pre < 64 && !(res.n_outputs > 0 && res.outputs[0].n_new == 1));
    if (getenv("STEPGAP_V")) printf("engine prefill: %d steps\n", n_pre);

    double *tc = malloc(sizeof(double) * (size_t)N), *te = malloc(sizeof(double) * (size_t)N);
    int n = 0;
    /* ABBA: the order alternates, so neither arm always runs first */
    for (; n < N; n++) {
        bool stop = false;
        for (int arm = 0; arm < 2; arm++) {
            const bool engine_arm = (arm == 0) == (n % 2 == 1);
            const double t0 = k3_now();
            if (!engine_arm) {
                k3_sampler_accept(smp, tok);
                b = (k3_batch_seq){0, 1, &tok, NULL};
                if (k3_ctx_forward(ctx, &b, 1, K3_LOGITS_LAST, logits, &err)) DIE("decode");
                tok = k3_sampler_sample(smp, logits);
                tc[n] = k3_now() - t0;
            } else {
                if (k3_engine_step(e, &res, &err)) DIE("engine step");
                te[n] = k3_now() - t0;
                stop = res.n_outputs == 0 || res.outputs[0].n_new != 1;
            }
        }
        if (stop) break;
    }
    if (n < 2) {
        fprintf(stderr, "stepgap: the engine stopped after %d steps\n", n);
        return 1;
    }
    if (getenv("STEPGAP_V"))
        for (int i = 0; i < n; i++) printf("step %d: ctx %.3f ms engine %.3f ms\n", i, tc[i] * 1e3, te[i] * 1e3);
    const double mc = mean(tc, n), me = mean(te, n), dc = median(tc, n), de = median(te, n);
    printf("stepgap: %s, %d threads, prompt %d, %d decode steps, max_num_seqs %d\n", dir, threads, P, n, mns);
    printf("ctx decode step     median %.3f ms  mean %.3f ms\n", dc * 1e3, mc * 1e3);
    printf("engine decode step  median %.3f ms  mean %.3f ms\n", de * 1e3, me * 1e3);
    printf("engine / ctx        median %.4f  mean %.4f  (engine - ctx: %.3f ms median)\n", de / dc, me / mc,
           (de - dc) * 1e3);
    k3_engine_close(e);
    k3_sampler_free(smp);
    k3_ctx_free(ctx);
    k3_pool_free(pool);
    k3_model_close(m);
    free(prompt);
    free(logits);
    free(tc);
    free(te);
    return 0;
}
