/*
 * cmd_eval.c -- `k3 eval -m DIR --text FILE`: perplexity over a text file.
 *
 * The text is tokenized whole, then scored with a sliding context: windows
 * of --ctx tokens that advance by --stride; each window is a fresh sequence,
 * and only the tokens a previous window has not scored count, so every token
 * after the first is scored once with at least ctx - stride tokens of
 * context (the first window's tokens with less). Progress goes to stderr;
 * the last line on stdout is `ppl <float> bits_per_byte <float> tokens <int>`.
 *
 * With --base-url URL the same windows are scored by a server through
 * /v1/completions with echo + logprobs (cmd_eval_remote.c; -m gives the
 * tokenizer, and with --compare-fp32 the local fp32 reference), so a
 * deployment prints the figures of the offline run on the same model and mode.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "k3.h"

static void usage_to(FILE *out) {
    fprintf(out,
            "usage: k3 eval [-m DIR] --text FILE [--ctx N] [--stride N] [--threads N] [--max-tokens N]\n"
            "  -m DIR          model directory (default " K3_DEFAULT_MODEL ")\n"
            "  --text FILE     the text to score (- = stdin; at most 64 MB)\n"
            "  --ctx N         window length in tokens (default 512)\n"
            "  --threads N     worker threads (default: the physical cores; 0 = every CPU)\n"
            "  --stride N      tokens a window advances (default ctx/2)\n"
            "  --max-tokens N  score only the first N tokens of the file\n"
            "  --quant MODE    " K3_CLI_QUANT_MODES "\n"
            "  --isa NAME      kernels: " K3_CLI_ISA_HELP "\n"
            "  --mmap          keep the weights in the file mapping\n"
            "  --kv-cache f32|c8\n"
            "  --compare-fp32  also report top-1 agreement with the unquantized f32 run\n"
            "  --base-url URL  score through a server's /v1/completions (echo + logprobs)\n"
            "  --model NAME    the served model name (default: the first of /v1/models)\n"
            "  --api-key KEY   Bearer key for --base-url (default: $K3_API_KEY)\n"
            "Progress goes to stderr: a bar redrawn in place on a terminal, a line every\n"
            "10%% otherwise.\n");
}

static int usage_eval(void) {
    usage_to(stderr);
    return 2;
}

/* log-softmax of row at index id, in nats */
static double nll_of(const float *logits, int64_t V, int32_t id) {
    float mx = logits[0];
    for (int64_t v = 1; v < V; v++) mx = logits[v] > mx ? logits[v] : mx;
    double sum = 0.0;
    for (int64_t v = 0; v < V; v++) sum += exp((double)logits[v] - mx);
    return log(sum) + mx - logits[id];
}

static int64_t argmax(const float *x, int64_t n) {
    int64_t b = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

int k3_cmd_eval(int argc, char **argv) {
    const char *dir = K3_DEFAULT_MODEL, *text_path = NULL, *quant = K3_DEFAULT_QUANT;
    bool keep_mapped = false;
    k3_kv_type kv = K3_KV_F32;
    k3_cli_parse_kv(K3_DEFAULT_KV, &kv);
    long ctx_len = 512, stride = 0, max_tok = 0;
    int compare = 0;
    const char *base_url = NULL, *served = NULL, *api_key = getenv("K3_API_KEY");
    int threads = k3_cli_default_threads();
    for (int i = 1; i < argc; i++) {
        const int has = i + 1 < argc;
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage_to(stdout);
            return 0;
        } else if (!strcmp(argv[i], "-m") && has) dir = argv[++i];
        else if (!strcmp(argv[i], "--text") && has) text_path = argv[++i];
        else if (!strcmp(a, "--ctx") && has) {
            if (k3_cli_long("eval", a, argv[++i], 2, INT32_MAX, &ctx_len)) return 2;
        } else if (!strcmp(a, "--stride") && has) {
            if (k3_cli_long("eval", a, argv[++i], 1, INT32_MAX, &stride)) return 2;
        } else if (!strcmp(a, "--threads") && has) {
            if (k3_cli_threads("eval", argv[++i], &threads)) return 2;
        } else if (!strcmp(a, "--max-tokens") && has) {
            if (k3_cli_long("eval", a, argv[++i], 0, LONG_MAX, &max_tok)) return 2;
        } else if (!strcmp(argv[i], "--quant") && has) quant = argv[++i];
        else if (!strcmp(argv[i], "--isa") && has) {
            if (k3_cli_set_isa("eval", argv[++i])) return 2;
        } else if (!strcmp(argv[i], "--mmap")) keep_mapped = true;
        else if (!strcmp(argv[i], "--compare-fp32")) compare = 1;
        else if (!strcmp(argv[i], "--base-url") && has) base_url = argv[++i];
        else if (!strcmp(argv[i], "--model") && has) served = argv[++i];
        else if (!strcmp(argv[i], "--api-key") && has) api_key = argv[++i];
        else if (!strcmp(argv[i], "--kv-cache") && has) {
            if (k3_cli_parse_kv(argv[++i], &kv)) {
                fprintf(stderr, "k3 eval: --kv-cache must be f32 or c8, not '%s'\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "k3 eval: unknown option or missing value: %s\n", a);
            return usage_eval();
        }
    }
    if (!text_path) {
        fprintf(stderr, "k3 eval: no text: give --text FILE\n");
        return usage_eval();
    }
    if (!stride) stride = ctx_len / 2;
    if (ctx_len < 2 || stride < 1 || stride > ctx_len || threads < 1 || max_tok < 0) {
        fprintf(stderr, "k3 eval: need --ctx >= 2, 1 <= --stride <= --ctx, --threads >= 1\n");
        return 2;
    }

    k3_error err = {0};
    k3_model *m = NULL;
    k3_tokenizer *tok = NULL;
    k3_pool *pool = NULL;
    k3_ctx *ctx = NULL, *rctx = NULL;
    k3_model *rm = NULL; /* the unquantized fp32 run, with --compare-fp32 */
    int32_t *ids = NULL;
    float *logits = NULL, *rlogits = NULL;
    char *text = NULL;
    k3_eval_remote *remote = NULL;
    double *rlp = NULL;
    int32_t *rtop = NULL;
    int rc = 1;
    size_t n_bytes = 0, n_ids = 0;
    char why[600];
    if (!(dir = k3_cli_model_dir("eval", dir))) return 1;
    if (!(text = k3_cli_read_input("eval", text_path, K3_CLI_MAX_INPUT, &n_bytes))) return 1;
    if (base_url) {
        if (k3_eval_remote_open(&remote, base_url, served, api_key, why, sizeof why)) {
            fprintf(stderr, "k3 eval: %s\n", why);
            goto out;
        }
        /* the local model only for the fp32 reference */
        if (compare && k3_model_open(&m, dir, &err)) goto fail;
    } else if (k3_cli_open_model(&m, dir, quant, keep_mapped, &err)) {
        goto fail;
    }
    if (k3_tokenizer_open(&tok, dir, &err) || k3_tokenizer_encode(tok, text, n_bytes, &ids, &n_ids, &err)) goto fail;
    if (max_tok && (size_t)max_tok < n_ids) {
        /* count only the bytes of the scored tokens */
        n_ids = (size_t)max_tok;
        n_bytes = 0;
        for (size_t i = 0; i < n_ids; i++) {
            size_t l = 0;
            k3_tokenizer_token(tok, ids[i], &l);
            n_bytes += l;
        }
    }
    if (n_ids < 2) {
        fprintf(stderr, "k3 eval: %s has fewer than 2 tokens\n", text_path);
        goto out;
    }
    k3_model_info info = {.vocab_size = k3_tokenizer_n_vocab(tok), .max_positions = ctx_len};
    if (m) k3_model_get_info(m, &info);
    if (ctx_len > info.max_positions) ctx_len = info.max_positions;
    if (stride > ctx_len) stride = ctx_len;
    if (k3_pool_init(&pool, threads, &err)) goto fail;
    k3_ctx_options co = {.max_seqs = 1, .cache_tokens = ctx_len, .pool = pool, .kv_cache = kv};
    if (!remote && k3_ctx_init(&ctx, m, &co, &err)) goto fail;
    const int64_t V = info.vocab_size;
    if (remote) {
        rlp = malloc(sizeof *rlp * (size_t)ctx_len);
        rtop = malloc(sizeof *rtop * (size_t)ctx_len);
        if (!rlp || !rtop) {
            fprintf(stderr, "k3 eval: out of memory\n");
            goto out;
        }
        if (compare) { /* the fp32 reference is the model opened above */
            rm = m;
            m = NULL;
            k3_ctx_options ro = {.max_seqs = 1, .cache_tokens = ctx_len, .pool = pool, .kv_cache = K3_KV_F32};
            if (k3_ctx_init(&rctx, rm, &ro, &err)) goto fail;
            rlogits = malloc(sizeof(float) * (size_t)(V * ctx_len));
        }
    }
    logits = remote ? malloc(sizeof(float)) : malloc(sizeof(float) * (size_t)(V * ctx_len));
    if (compare && !remote) {
        k3_ctx_options ro = {.max_seqs = 1, .cache_tokens = ctx_len, .pool = pool, .kv_cache = K3_KV_F32};
        if (k3_model_open(&rm, dir, &err) || k3_ctx_init(&rctx, rm, &ro, &err)) goto fail;
        rlogits = malloc(sizeof(float) * (size_t)(V * ctx_len));
    }
    if (!logits || (compare && !rlogits)) {
        fprintf(stderr, "k3 eval: out of memory\n");
        goto out;
    }

    double nll = 0.0;
    size_t scored = 0, next = 1, agree = 0; /* next: first token index not yet scored */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    /* a bar redrawn with \r on a terminal; in a log, a plain line per 10% */
    const bool tty = isatty(STDERR_FILENO);
    int last_tenth = -1;
    for (size_t start = 0; next < n_ids; start += (size_t)stride) {
        size_t len = n_ids - start < (size_t)ctx_len ? n_ids - start : (size_t)ctx_len;
        k3_batch_seq b = {0, (int32_t)len, ids + start};
        if (remote) {
            if (k3_eval_remote_window(remote, ids + start, len, rlp, rtop, why, sizeof why)) {
                fprintf(stderr, "\nk3 eval: %s\n", why);
                goto out;
            }
        } else {
            k3_ctx_seq_reset(ctx, 0);
            if (k3_ctx_forward(ctx, &b, 1, K3_LOGITS_ALL, logits, &err)) goto fail;
        }
        if (compare) {
            k3_ctx_seq_reset(rctx, 0);
            if (k3_ctx_forward(rctx, &b, 1, K3_LOGITS_ALL, rlogits, &err)) goto fail;
        }
        /* logits row r predicts token start + r + 1 */
        for (size_t r = 0; r + 1 < len; r++) {
            const size_t target = start + r + 1;
            if (target < next) continue;
            nll += remote ? -rlp[r] : nll_of(logits + r * V, V, ids[target]);
            scored++;
            if (compare) agree += (remote ? rtop[r] : argmax(logits + r * V, V)) == argmax(rlogits + r * V, V);
        }
        next = start + len;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const double el = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
        const int width = 30, done = (int)(width * (double)next / n_ids);
        const int tenth = (int)(10.0 * (double)next / n_ids);
        if (tty)
            fprintf(stderr, "\r[%.*s%*s] %zu/%zu tokens, ppl %.3f, %.0f tok/s", done, "##############################",
                    width - done, "", next, n_ids, exp(nll / scored), scored / (el > 0 ? el : 1e-9));
        else if (tenth != last_tenth) {
            last_tenth = tenth;
            fprintf(stderr, "k3 eval: %zu/%zu tokens, ppl %.3f, %.0f tok/s\n", next, n_ids, exp(nll / scored),
                    scored / (el > 0 ? el : 1e-9));
        }
        if (next >= n_ids) break;
    }
    if (tty) fprintf(stderr, "\n");
    /* bits per byte over the bytes of the scored tokens (the first token's
     * bytes are not predicted, so they are left out) */
    size_t first_len = 0;
    k3_tokenizer_token(tok, ids[0], &first_len);
    const double bpb = nll / log(2.0) / (double)(n_bytes - first_len);
    if (compare && remote)
        printf("top1_agreement_with_fp32 %.4f (%zu/%zu) via %s\n", (double)agree / scored, agree, scored, base_url);
    else if (compare)
        printf("top1_agreement_with_fp32 %.4f (%zu/%zu) quant %s kv %s\n", (double)agree / scored, agree, scored, quant,
               kv == K3_KV_C8 ? "c8" : "f32");
    printf("ppl %.4f bits_per_byte %.4f tokens %zu\n", exp(nll / scored), bpb, scored);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "k3 eval: %s\n", err.msg[0] ? err.msg : k3_status_str(err.status));
out:
    free(text);
    free(ids);
    free(logits);
    free(rlogits);
    free(rlp);
    free(rtop);
    k3_eval_remote_close(remote);
    k3_ctx_free(ctx);
    k3_ctx_free(rctx);
    k3_model_close(rm);
    k3_pool_free(pool);
    k3_tokenizer_free(tok);
    k3_model_close(m);
    return rc;
}
