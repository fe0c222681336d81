/*
 * k3.c -- the `k3` program: subcommand dispatch, `k3 run` and `k3 info`.
 *
 *   k3 run [-m DIR] [options] [PROMPT]     generate text (streams to stdout)
 *   k3 info [-m DIR]                       config, layer map, sizes
 *   k3 tokenize ...                        see cmd_tokenize.c
 *   k3 eval -m DIR --text FILE             see cmd_eval.c
 *   k3 bench -m DIR                        see cmd_bench.c
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "k3.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int fail(const char *cmd, const k3_error *e) {
    fprintf(stderr, "k3 %s: %s\n", cmd, e->msg[0] ? e->msg : k3_status_str(e->status));
    return 1;
}

static int usage_run(void) {
    fprintf(stderr,
            "usage: k3 run [-m DIR] [options] [PROMPT]\n"
            "  -m DIR              model directory (default %s)\n"
            "  -n N                tokens to generate (default 128; 0 = prefill only)\n"
            "  --temp F            temperature (default 0.8; 0 = greedy)\n"
            "  --top-k N           keep the N most likely tokens (default 40; 0 = off)\n"
            "  --top-p F           nucleus sampling (default 0.95)\n"
            "  --min-p F           drop tokens below F x the best (default 0.05)\n"
            "  --repeat-penalty F  penalty on recent tokens (default 1.1)\n"
            "  --seed N            sampler seed (default 42)\n"
            "  --threads N         worker threads (default: all cores)\n"
            "  --chat              wrap the prompt as a user turn in the K3 chat format\n"
            "  --think             with --chat, open the assistant turn in thinking mode\n"
            "  --ids 1,2,3         feed these token ids instead of a text prompt\n"
            "  --dump-logits FILE  write the logits of every prompt position (float32)\n"
            "  --ctx N             context size in tokens (default: prompt + n)\n"
            "  --quant MODE        none | w8a8 | w8a8-mxfp8 | w4a8 | w8a8+w4a8 (default %s)\n"
            "  --mmap              read weights from the file mapping (default: copy them\n"
            "                      into RAM when they take at most half of it)\n"
            "  --kv-cache f32|c8   cache format (default %s)\n"
            "  --isa NAME          kernels: " K3_CLI_ISA_HELP "\n",
            K3_DEFAULT_MODEL, K3_DEFAULT_QUANT, K3_DEFAULT_KV);
    return 2;
}

/* Parses "1,2,3" (commas or spaces). *out is malloc'd. */
static int parse_ids(const char *s, int32_t **out, size_t *n) {
    size_t cap = 16, k = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) return -1;
    const char *p = s;
    while (*p) {
        while (*p == ',' || *p == ' ') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < -2147483647L || v > 2147483647L) {
            free(ids);
            return -1;
        }
        if (k == cap) {
            int32_t *t = realloc(ids, (cap *= 2) * sizeof *ids);
            if (!t) {
                free(ids);
                return -1;
            }
            ids = t;
        }
        ids[k++] = (int32_t)v;
        p = end;
    }
    *out = ids;
    *n = k;
    return 0;
}

/* Renders an assistant turn in the K3 chat format as plain text: the control
 * tokens and tag names (<|open|>NAME ...<|sep|>, <|close|>NAME<|sep|>) are
 * not printed; a think block is shown between [think] and [/think]. */
typedef struct {
    int32_t open, close, sep;
    int in_tag, closing;
    char tag[64];
} chat_state;

static void chat_render(chat_state *c, int32_t id, const char *piece, size_t len) {
    if (id == c->open || id == c->close) {
        c->in_tag = 1;
        c->closing = id == c->close;
        c->tag[0] = 0;
        return;
    }
    if (id == c->sep) {
        if (c->in_tag && !strncmp(c->tag, "think", 5)) fputs(c->closing ? " [/think]\n" : "[think] ", stdout);
        c->in_tag = 0;
        return;
    }
    if (!piece) return;
    if (c->in_tag) {
        const size_t have = strlen(c->tag);
        if (have + len < sizeof c->tag) {
            memcpy(c->tag + have, piece, len);
            c->tag[have + len] = 0;
        }
        return;
    }
    fwrite(piece, 1, len, stdout);
}

static int default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 64 ? 64 : (int)n;
}

int k3_cmd_run(int argc, char **argv) {
    const char *dir = K3_DEFAULT_MODEL, *prompt = NULL, *ids_arg = NULL, *dump = NULL;
    const char *quant = K3_DEFAULT_QUANT;
    bool keep_mapped = false;
    k3_kv_type kv = K3_KV_F32;
    k3_cli_parse_kv(K3_DEFAULT_KV, &kv);
    int n_gen = 128, threads = default_threads(), chat = 0, think = 0;
    long ctx_arg = 0;
    k3_sampler_options so = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
                             .repeat_penalty = 1.1f, .repeat_last_n = 64, .seed = 42};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int has = i + 1 < argc;
#define ARG(name) (!strcmp(a, name) && has)
        if (ARG("-m")) dir = argv[++i];
        else if (ARG("-n")) n_gen = atoi(argv[++i]);
        else if (ARG("--temp")) so.temperature = strtof(argv[++i], NULL);
        else if (ARG("--top-k")) so.top_k = atoi(argv[++i]);
        else if (ARG("--top-p")) so.top_p = strtof(argv[++i], NULL);
        else if (ARG("--min-p")) so.min_p = strtof(argv[++i], NULL);
        else if (ARG("--repeat-penalty")) so.repeat_penalty = strtof(argv[++i], NULL);
        else if (ARG("--seed")) so.seed = strtoull(argv[++i], NULL, 10);
        else if (ARG("--threads")) threads = atoi(argv[++i]);
        else if (ARG("--ids")) ids_arg = argv[++i];
        else if (ARG("--dump-logits")) dump = argv[++i];
        else if (ARG("--ctx")) ctx_arg = atol(argv[++i]);
        else if (ARG("--quant")) quant = argv[++i];
        else if (ARG("--isa")) {
            if (k3_cli_set_isa("run", argv[++i])) return 2;
        } else if (!strcmp(argv[i], "--mmap")) keep_mapped = true;
        else if (ARG("--kv-cache")) {
            if (k3_cli_parse_kv(argv[++i], &kv)) {
                fprintf(stderr, "k3 run: --kv-cache must be f32 or c8, not '%s'\n", argv[i]);
                return 2;
            }
        }
        else if (!strcmp(a, "--chat")) chat = 1;
        else if (!strcmp(a, "--think")) think = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage_run();
        else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "k3 run: unknown option or missing value: %s\n", a);
            return usage_run();
        } else if (!prompt) prompt = a;
        else {
            fprintf(stderr, "k3 run: more than one prompt given (quote the prompt)\n");
            return 2;
        }
#undef ARG
    }
    if (n_gen < 0 || threads < 1 || ctx_arg < 0) {
        fprintf(stderr, "k3 run: -n, --threads and --ctx must not be negative\n");
        return 2;
    }
    if (!prompt && !ids_arg) {
        fprintf(stderr, "k3 run: no prompt: give PROMPT or --ids\n");
        return usage_run();
    }

    k3_error err = {0};
    k3_model *m = NULL;
    k3_tokenizer *tok = NULL;
    k3_pool *pool = NULL;
    k3_ctx *ctx = NULL;
    k3_sampler *smp = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    size_t n_ids = 0;
    int rc = 1;

    if (k3_cli_open_model(&m, dir, quant, keep_mapped, &err)) goto out;
    k3_model_info info;
    k3_model_get_info(m, &info);
    /* The tokenizer is needed for text in or out; --ids -n 0 runs without. */
    if (!(ids_arg && n_gen == 0) && k3_tokenizer_open(&tok, dir, &err)) goto out;

    if (ids_arg) {
        if (parse_ids(ids_arg, &ids, &n_ids)) {
            fprintf(stderr, "k3 run: --ids: cannot parse '%s' as comma-separated integers\n", ids_arg);
            rc = 2;
            goto out_quiet;
        }
    } else if (chat) {
        k3_chat_msg msg = {"user", prompt, NULL};
        if (k3_chat_encode(tok, &msg, 1, true, think, &ids, &n_ids, &err)) goto out;
    } else if (k3_tokenizer_encode(tok, prompt, strlen(prompt), &ids, &n_ids, &err)) {
        goto out;
    }
    if (n_ids == 0) {
        fprintf(stderr, "k3 run: the prompt encodes to no tokens\n");
        goto out_quiet;
    }

    int64_t want = ctx_arg ? ctx_arg : (int64_t)n_ids + n_gen;
    if (want > info.max_positions) want = info.max_positions;
    if ((int64_t)n_ids > want) {
        fprintf(stderr, "k3 run: the prompt has %zu tokens, more than the context of %lld tokens\n", n_ids,
                (long long)want);
        goto out_quiet;
    }
    if (k3_pool_init(&pool, threads, &err)) goto out;
    k3_ctx_options co = {.max_seqs = 1, .max_tokens = want, .pool = pool, .kv_cache = kv};
    if (k3_ctx_init(&ctx, m, &co, &err)) goto out;
    if (k3_sampler_init(&smp, &so, (int32_t)info.vocab_size, &err)) goto out;

    const int64_t V = info.vocab_size;
    logits = malloc(sizeof(float) * (size_t)V * (dump ? n_ids : 1));
    if (!logits) {
        fprintf(stderr, "k3 run: out of memory for logits\n");
        goto out_quiet;
    }
    if (tok && !chat && !ids_arg) fwrite(prompt, 1, strlen(prompt), stdout);
    fflush(stdout);

    double t0 = now_s();
    k3_batch_seq b = {0, (int32_t)n_ids, ids};
    if (k3_ctx_forward(ctx, &b, 1, dump ? K3_LOGITS_ALL : K3_LOGITS_LAST, logits, &err)) goto out;
    const double t_prefill = now_s() - t0;
    for (size_t i = 0; i < n_ids; i++) k3_sampler_accept(smp, ids[i]);

    if (dump) {
        FILE *f = fopen(dump, "wb");
        if (!f || fwrite(logits, sizeof(float), (size_t)V * n_ids, f) != (size_t)V * n_ids || fclose(f)) {
            fprintf(stderr, "k3 run: cannot write %s: %s\n", dump, strerror(errno));
            goto out_quiet;
        }
        /* sample from the last position */
        memmove(logits, logits + (n_ids - 1) * V, sizeof(float) * (size_t)V);
    }

    const int32_t eom = tok ? k3_tokenizer_special(tok, "<|end_of_msg|>") : -1;
    chat_state cr = {tok ? k3_tokenizer_special(tok, "<|open|>") : -1, tok ? k3_tokenizer_special(tok, "<|close|>") : -1,
                     tok ? k3_tokenizer_special(tok, "<|sep|>") : -1, 0, 0, ""};
    const int32_t eos = tok ? k3_tokenizer_special(tok, "[EOS]") : -1;
    int n_done = 0;
    double t1 = now_s();
    const char *stop = "";
    for (; n_done < n_gen; n_done++) {
        if (k3_ctx_seq_pos(ctx, 0) >= want) {
            stop = " (context full)";
            break;
        }
        const int32_t id = k3_sampler_sample(smp, logits);
        if (id == eom || id == eos) {
            stop = " (end of message)";
            break;
        }
        k3_sampler_accept(smp, id);
        size_t len;
        const char *piece = k3_tokenizer_token(tok, id, &len);
        if (chat) chat_render(&cr, id, piece, len);
        else if (piece && !k3_tokenizer_is_special(tok, id)) fwrite(piece, 1, len, stdout);
        fflush(stdout);
        b = (k3_batch_seq){0, 1, &id};
        if (n_done + 1 < n_gen && k3_ctx_forward(ctx, &b, 1, K3_LOGITS_LAST, logits, &err)) goto out;
    }
    const double t_decode = now_s() - t1;
    printf("\n");
    fflush(stdout); /* the text ends before the timing line on stderr */
    fprintf(stderr, "prompt %zu tokens, prefill %.1f tok/s, decode %d tokens at %.1f tok/s%s\n", n_ids,
            n_ids / (t_prefill > 0 ? t_prefill : 1e-9), n_done,
            n_done / (t_decode > 0 ? t_decode : 1e-9), stop);
    rc = 0;
    goto out_quiet;
out:
    rc = fail("run", &err);
out_quiet:
    free(ids);
    free(logits);
    k3_sampler_free(smp);
    k3_ctx_free(ctx);
    k3_pool_free(pool);
    k3_tokenizer_free(tok);
    k3_model_close(m);
    return rc;
}

int k3_cmd_info(int argc, char **argv) {
    const char *dir = K3_DEFAULT_MODEL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc) dir = argv[++i];
        else if (!strcmp(argv[i], "--isa") && i + 1 < argc) {
            if (k3_cli_set_isa("info", argv[++i])) return 2;
        } else {
            fprintf(stderr, "usage: k3 info [-m DIR] [--isa NAME]\n");
            return 2;
        }
    }
    k3_error err = {0};
    k3_model *m = NULL;
    if (k3_model_open(&m, dir, &err)) return fail("info", &err);
    size_t need = k3_model_describe(m, NULL, 0);
    char *buf = malloc(need + 1);
    if (!buf) {
        k3_model_close(m);
        fprintf(stderr, "k3 info: out of memory\n");
        return 1;
    }
    k3_model_describe(m, buf, need + 1);
    fputs(buf, stdout);
    printf("kernels: %s\n", k3_isa_current());
    free(buf);
    k3_model_close(m);
    return 0;
}

static int usage(void) {
    fprintf(stderr,
            "usage: k3 <command> [options]\n"
            "  run       generate text from a model\n"
            "  info      describe a model: config, layer map, sizes\n"
            "  tokenize  text to token ids, or ids to text with --decode\n"
            "  eval      perplexity of a model over a text file\n"
            "  bench     prefill/decode speed against the measured memory bandwidth\n"
            "run `k3 <command> --help` for its options\n");
    return 2;
}

int main(int argc, char **argv) {
    if (argc < 2) return usage();
    const char *cmd = argv[1];
    if (!strcmp(cmd, "run")) return k3_cmd_run(argc - 1, argv + 1);
    if (!strcmp(cmd, "info")) return k3_cmd_info(argc - 1, argv + 1);
    if (!strcmp(cmd, "tokenize")) return k3_cmd_tokenize(argc - 1, argv + 1);
    if (!strcmp(cmd, "eval")) return k3_cmd_eval(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench")) return k3_cmd_bench(argc - 1, argv + 1);
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage();
        return 0;
    }
    fprintf(stderr, "k3: unknown command '%s'\n", cmd);
    return usage();
}
