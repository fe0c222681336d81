/*
 * cmd_run.c -- `k3 run` (generate text, streamed to stdout) and `k3 info`
 * (config, layer map, sizes, the kernels in use). main.c dispatches.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "k3.h"

static int fail(const char *cmd, const k3_error *e) {
    fprintf(stderr, "k3 %s: %s\n", cmd, e->msg[0] ? e->msg : k3_status_str(e->status));
    return 1;
}

static void usage_to(FILE *out) {
    fprintf(out,
            "usage: k3 run [-m DIR] [options] [PROMPT | - | -f FILE]\n"
            "  -m DIR              model directory (default %s)\n"
            "  PROMPT, -, -f FILE  the prompt: the argument, stdin (-) or a file\n"
            "  -i, --interactive   a conversation on the terminal (also --chat with no prompt);\n"
            "                      one line per message, /exit or EOF ends it\n"
            "  --system TEXT       a system message before the first user turn (implies --chat)\n"
            "  -n N                tokens to generate (default 128; 0 = prefill only)\n"
            "  --temp F            temperature (default 0.8; 0 = greedy)\n"
            "  --top-k N           keep the N most likely tokens (default 40; 0 = off)\n"
            "  --top-p F           nucleus sampling (default 0.95)\n"
            "  --min-p F           drop tokens below F x the best (default 0.05)\n"
            "  --repeat-penalty F  penalty on recent tokens (default 1.1)\n"
            "  --seed N            sampler seed (default: random, printed on stderr)\n"
            "  --threads N         worker threads (default: the physical cores, shared by the local ranks\n"
            "                      under mpirun; 0 = every CPU)\n"
            "  --chat              wrap the prompt as a user turn in the K3 chat format\n"
            "  --think             open the assistant turn in thinking mode (implies --chat)\n"
            "  --image FILE        a PNG, JPEG, WEBP or GIF (first frame) before the prompt text (repeatable)\n"
            "  --ids 1,2,3         feed these token ids instead of a text prompt\n"
            "  --dump-logits FILE  write the logits of every prompt position (float32)\n"
            "  --ctx N             context size in tokens (default: prompt + n)\n"
            "  --quant MODE        " K3_CLI_QUANT_MODES " (default %s)\n"
            "  --mmap              read weights from the file mapping (default: copy them\n"
            "                      into RAM when they take at most half of it)\n"
            "  --kv-cache f32|c8   cache format (default %s)\n"
            "  --no-check-tensors  skip the load-time check that every stored weight is finite\n"
            "                      (no NaN/Inf; 0.3 s for 1.9 GB of weights)\n"
            "under mpirun -np N (rank 0 reads, samples and prints):\n"
            "  --dcp D --ep E      decode context parallel / expert parallel sizes (dividing N)\n"
            "  --dcp-interleave I  tokens per DCP stripe (default 1)\n"
            "  --dcp-topk-exchange allgather|butterfly  the DSA top-k exchange (default allgather)\n"
            "  --dist-timeout S    a collective waiting longer fails (default 300)\n"
            "  --show-memory       print each rank's cache and routed-expert bytes\n"
            "  --isa NAME          kernels: " K3_CLI_ISA_HELP "\n"
            "speculative decoding (any --speculative, off too, generates through the serving "
            "engine):\n" K3_CLI_SPEC_HELP,
            K3_DEFAULT_MODEL, K3_DEFAULT_QUANT, K3_DEFAULT_KV);
}

static int usage_run(void) {
    usage_to(stderr);
    return 2;
}

static int help_run(void) {
    usage_to(stdout);
    return 0;
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


/* A seed nobody chose: /dev/urandom, else the clock and the pid. */
static uint64_t random_seed(void) {
    uint64_t s = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    if (!f || fread(&s, sizeof s, 1, f) != 1) s = (uint64_t)time(NULL) * 6364136223846793005ull ^ (uint64_t)getpid();
    if (f) fclose(f);
    return s;
}

int k3_cmd_run(int argc, char **argv) {
    const char *dir = K3_DEFAULT_MODEL, *prompt = NULL, *ids_arg = NULL, *dump = NULL;
    const char *quant = K3_DEFAULT_QUANT, *prompt_file = NULL, *system = NULL;
    char *prompt_buf = NULL;
    bool keep_mapped = false, interactive = false, seed_given = false, check_tensors = true, show_mem = false;
    k3_kv_type kv = K3_KV_F32;
    k3_cli_parse_kv(K3_DEFAULT_KV, &kv);
    int n_gen = 128, threads = k3_cli_default_threads(), chat = 0, think = 0;
    long ctx_arg = 0;
    const char *image_files[16];
    int n_images = 0;
    k3_sampler_options so = {.temperature = 0.8f,
                             .top_k = 40,
                             .top_p = 0.95f,
                             .min_p = 0.05f,
                             .repeat_penalty = 1.1f,
                             .repeat_last_n = 64,
                             .seed = 42};
    k3_cli_dist cd;
    k3_cli_spec spec = {0};
    bool workers_wait = false; /* rank 0 owes the workers the context size */
    if (k3_cli_dist_args(&argc, argv, &cd, "run")) return 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int has = i + 1 < argc;
        const int sa = k3_cli_spec_arg("run", argc, argv, &i, &spec);
        if (sa < 0) return 2;
        if (sa) continue;
#define ARG(name) (!strcmp(a, name) && has)
/* a number option: strictly parsed, or exit 2 with a message naming it */
#define NUM(call) \
    do { \
        if (call) return 2; \
    } while (0)
        if (ARG("-m")) dir = argv[++i];
        else if (ARG("-n")) NUM(k3_cli_int("run", a, argv[++i], 0, 1 << 30, &n_gen));
        else if (ARG("--temp")) NUM(k3_cli_float("run", a, argv[++i], 0, 1000, &so.temperature));
        else if (ARG("--top-k")) NUM(k3_cli_int("run", a, argv[++i], 0, INT32_MAX, &so.top_k));
        else if (ARG("--top-p")) NUM(k3_cli_float("run", a, argv[++i], 1e-6, 1, &so.top_p));
        else if (ARG("--min-p")) NUM(k3_cli_float("run", a, argv[++i], 0, 1, &so.min_p));
        else if (ARG("--repeat-penalty")) NUM(k3_cli_float("run", a, argv[++i], 1e-6, 1000, &so.repeat_penalty));
        else if (ARG("--seed")) {
            NUM(k3_cli_u64("run", a, argv[++i], &so.seed));
            seed_given = true;
        } else if (ARG("--threads")) NUM(k3_cli_threads("run", argv[++i], &threads));
        else if (ARG("--ids")) ids_arg = argv[++i];
        else if (ARG("--dump-logits")) dump = argv[++i];
        else if (ARG("--ctx")) NUM(k3_cli_long("run", a, argv[++i], 0, INT32_MAX, &ctx_arg));
        else if (ARG("-f")) prompt_file = argv[++i];
        else if (ARG("--system")) system = argv[++i];
        else if (!strcmp(a, "-i") || !strcmp(a, "--interactive")) interactive = true;
        else if (!strcmp(a, "--check-tensors")) check_tensors = true;
        else if (!strcmp(a, "--no-check-tensors")) check_tensors = false;
        else if (ARG("--quant")) quant = argv[++i];
        else if (ARG("--isa")) {
            if (k3_cli_set_isa("run", argv[++i])) return 2;
        } else if (!strcmp(argv[i], "--mmap")) keep_mapped = true;
        else if (!strcmp(argv[i], "--show-memory")) show_mem = true;
        else if (ARG("--kv-cache")) {
            if (k3_cli_parse_kv(argv[++i], &kv)) {
                fprintf(stderr, "k3 run: --kv-cache must be f32 or c8, not '%s'\n", argv[i]);
                return 2;
            }
        } else if (ARG("--image")) {
            if (n_images == 16) {
                fprintf(stderr, "k3 run: at most 16 --image files\n");
                return 2;
            }
            image_files[n_images++] = argv[++i];
        } else if (!strcmp(a, "--chat")) chat = 1;
        else if (!strcmp(a, "--think")) think = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return help_run();
        else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "k3 run: unknown option or missing value: %s\n", a);
            return usage_run();
        } else if (!prompt) prompt = a;
        else {
            fprintf(stderr, "k3 run: more than one prompt given (quote the prompt)\n");
            return 2;
        }
#undef NUM
#undef ARG
    }
    /* --think, --system and -i are chat features: they imply --chat */
    if (think || system || interactive) chat = 1;
    if ((prompt != NULL) + (prompt_file != NULL) + (ids_arg != NULL) > 1) {
        fprintf(stderr, "k3 run: give one of PROMPT, - (stdin), -f FILE and --ids\n");
        return 2;
    }
    if (interactive && (prompt || prompt_file || ids_arg)) {
        fprintf(stderr, "k3 run: -i reads its messages from the terminal: give no prompt with it\n");
        return 2;
    }
    if (ids_arg && chat) {
        fprintf(stderr, "k3 run: --ids feeds raw token ids: it cannot be used with --chat, --think or --system\n");
        return 2;
    }
    if (n_images && (interactive || (chat && !prompt && !prompt_file))) {
        fprintf(stderr, "k3 run: --image needs a prompt (PROMPT, - or -f FILE), not a conversation\n");
        return 2;
    }
    if (chat && !prompt && !prompt_file && !ids_arg) interactive = true;
    if (!prompt && !ids_arg && !prompt_file && !interactive) {
        fprintf(stderr, "k3 run: no prompt: give PROMPT, - (stdin), -f FILE, --ids, or --chat for a conversation\n");
        return usage_run();
    }
    if (prompt && !strcmp(prompt, "-")) prompt_file = "-";
    if (prompt_file) {
        size_t plen;
        if (!(prompt_buf = k3_cli_read_input("run", prompt_file, K3_CLI_MAX_INPUT, &plen))) return 1;
        if (strlen(prompt_buf) != plen) {
            fprintf(stderr, "k3 run: the prompt in %s holds a NUL byte\n",
                    !strcmp(prompt_file, "-") ? "stdin" : prompt_file);
            free(prompt_buf);
            return 1;
        }
        prompt = prompt_buf;
    }
    if (!(dir = k3_cli_model_dir("run", dir))) {
        free(prompt_buf);
        return 1;
    }
    const bool via_engine = spec.method || spec.draft_dir;
    if (via_engine && (dump || n_images || interactive || cd.asked || k3_cli_dist_wanted(argc, argv))) {
        fprintf(stderr,
                "k3 run: --speculative generates through the engine: not with --dump-logits, --image, a "
                "conversation or mpirun (k3 serve takes them)\n");
        free(prompt_buf);
        return 2;
    }
    if (!seed_given) so.seed = random_seed();
    fprintf(stderr, "k3 run: seed %llu%s\n", (unsigned long long)so.seed,
            seed_given ? "" : " (random; --seed N to repeat)");
    if (k3_cli_dist_start(&cd, "run")) return k3_cli_dist_exit(&cd, 2);
    const bool root = cd.rank == 0;

    k3_error err = {0};
    k3_model *m = NULL;
    k3_tokenizer *tok = NULL;
    k3_pool *pool = NULL;
    k3_ctx *ctx = NULL;
    k3_sampler *smp = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    size_t n_ids = 0;
    k3_cli_images img = {0};
    int rc = 1;

    k3_status ms = k3_cli_open_model_dist(&m, dir, quant, keep_mapped, check_tensors, &cd, &err);
    if (k3_cli_dist_agree(&cd, ms, &err, "run")) {
        if (!cd.d) goto out;
        goto out_quiet;
    }
    k3_model_info info;
    k3_model_get_info(m, &info);
    int64_t want = -1;
    workers_wait = cd.d != NULL;
    if (!root) goto distributed; /* rank 0 reads the prompt */
    /* The tokenizer is needed for text in or out; --ids -n 0 runs without. */
    if (!(ids_arg && n_gen == 0) && k3_tokenizer_open(&tok, dir, &err)) goto out;
    if (interactive) {
        k3_cli_repl repl = {m, tok, threads, kv, &so, system, think, n_gen, ctx_arg};
        rc = k3_cli_chat_repl(&repl);
        goto out_quiet;
    }

    if (ids_arg) {
        if (parse_ids(ids_arg, &ids, &n_ids)) {
            fprintf(stderr, "k3 run: --ids: cannot parse '%s' as comma-separated integers\n", ids_arg);
            rc = 2;
            goto out_quiet;
        }
    } else if (chat) {
        k3_chat_msg msgs[2] = {{"system", system, NULL}, {"user", prompt, NULL}};
        if (k3_chat_encode(tok, system ? msgs : msgs + 1, system ? 2 : 1, true, think, &ids, &n_ids, &err)) goto out;
    } else if (k3_tokenizer_encode(tok, prompt, strlen(prompt), &ids, &n_ids, &err)) {
        goto out;
    }
    if (n_images) {
        size_t at = 0;
        if (ids_arg) {
            fprintf(stderr, "k3 run: --image needs a text prompt, not --ids\n");
            goto out_quiet;
        }
        /* under mpirun rank 0 encodes; the rows go to the other ranks with the batch */
        if (k3_pool_init(&pool, threads, &err)) goto out;
        if (chat && k3_cli_chat_content_at(tok, system, think, ids, n_ids, &at, &err)) goto out;
        if (k3_cli_images_insert(&img, m, tok, pool, quant, image_files, n_images, at, &ids, &n_ids, &err)) goto out;
    }
    if (n_ids == 0) {
        fprintf(stderr, "k3 run: the prompt encodes to no tokens\n");
        goto out_quiet;
    }

    want = ctx_arg ? ctx_arg : (int64_t)n_ids + n_gen;
    if (want > info.max_positions) want = info.max_positions;
    if ((int64_t)n_ids > want) {
        fprintf(stderr, "k3 run: the prompt has %zu tokens, more than the context of %lld tokens\n", n_ids,
                (long long)want);
        goto out_quiet;
    }
    if (via_engine) {
        if (k3_pool_init(&pool, threads, &err)) goto out;
        if (tok && !chat && !ids_arg) fwrite(prompt, 1, strlen(prompt), stdout);
        fflush(stdout);
        const k3_cli_run_engine_args ra = {m,  tok, pool,  ids,  n_ids, n_gen, want < 64 ? 64 : want,
                                           so, kv,  quant, chat, think, &spec};
        rc = k3_cli_run_engine(&ra);
        goto out_quiet;
    }
distributed:
    workers_wait = false;
    if (cd.d && k3_dist_bcast_i64(cd.d, &want, 1, &err)) goto out_abort;
    if (want < 0) goto out_quiet; /* rank 0 said why */
    {
        k3_status cs = pool ? K3_OK : k3_pool_init(&pool, threads, &err); /* --image made it already */
        k3_ctx_options co = {.max_seqs = 1, .cache_tokens = want, .pool = pool, .kv_cache = kv, .dist = cd.d};
        if (!cs) cs = k3_ctx_init(&ctx, m, &co, &err);
        if (k3_cli_dist_agree(&cd, cs, &err, "run")) {
            if (!cd.d) goto out;
            if (root) k3_exec_release(cd.d, &err);
            goto out_quiet;
        }
    }
    k3_cli_dist_test_hooks(&cd);
    if (show_mem && k3_cli_show_memory(&cd, m, ctx, "run")) goto out_abort;
    if (!root) {
        if (k3_exec_serve(ctx, &err)) {
            fprintf(stderr, "k3 run: %s\n", err.msg);
            k3_dist_abort(cd.d, 1);
        }
        rc = 0;
        goto out_quiet;
    }
    if (k3_sampler_init(&smp, &so, (int32_t)info.vocab_size, &err)) goto out;

    const int64_t V = info.vocab_size;
    logits = malloc(sizeof(float) * (size_t)V * (dump ? n_ids : 1));
    if (!logits) {
        fprintf(stderr, "k3 run: out of memory for logits\n");
        goto out_quiet;
    }
    if (tok && !chat && !ids_arg) fwrite(prompt, 1, strlen(prompt), stdout);
    fflush(stdout);

    double t0 = k3_now();
    k3_batch_seq b = {0, (int32_t)n_ids, ids, img.embeds};
    if (k3_exec_forward(ctx, &b, 1, dump ? K3_LOGITS_ALL : K3_LOGITS_LAST, logits, &err)) goto out;
    const double t_prefill = k3_now() - t0;
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

    k3_cli_chat_view cr;
    if (chat) k3_cli_chat_render_init(&cr, tok, think, stdout);
    int n_done = 0;
    double t1 = k3_now();
    const char *stop = "";
    for (; n_done < n_gen; n_done++) {
        if (k3_ctx_seq_pos(ctx, 0) >= want) {
            stop = " (context full)";
            break;
        }
        const int32_t id = k3_sampler_sample(smp, logits);
        if (id < 0) {
            fprintf(stderr,
                    "\nk3 run: the logits are not finite (NaN or +Inf): the weights are damaged; "
                    "`k3 info -m DIR` names the tensor\n");
            goto out_quiet;
        }
        if (tok && k3_tokenizer_is_eos(tok, id)) {
            stop = " (end of message)";
            break;
        }
        k3_sampler_accept(smp, id);
        size_t len;
        const char *piece = k3_tokenizer_token(tok, id, &len);
        if (chat) k3_cli_chat_render(&cr, id, piece, len);
        else if (piece && !k3_tokenizer_is_special(tok, id)) fwrite(piece, 1, len, stdout);
        fflush(stdout);
        b = (k3_batch_seq){0, 1, &id};
        if (n_done + 1 < n_gen && k3_exec_forward(ctx, &b, 1, K3_LOGITS_LAST, logits, &err)) goto out;
    }
    const double t_decode = k3_now() - t1;
    printf("\n");
    fflush(stdout); /* the text ends before the timing line on stderr */
    fprintf(stderr,
            "prompt %zu tokens, prefill %.1f tok/s, decode %d tokens at %.1f tok/s%s "
            "(quant %s, kv %s)\n",
            n_ids, n_ids / (t_prefill > 0 ? t_prefill : 1e-9), n_done, n_done / (t_decode > 0 ? t_decode : 1e-9), stop,
            quant, kv == K3_KV_C8 ? "c8" : "f32");
    rc = 0;
    if (cd.d && k3_exec_release(cd.d, &err)) goto out_abort;
    goto out_quiet;
out:
    rc = fail("run", &err);
    if (cd.d && root && ctx) {
        /* the other ranks wait in k3_exec_serve: let them go, or end the job
         * when the failure was the communication itself */
        k3_error e2 = {0};
        if (k3_exec_release(cd.d, &e2)) k3_dist_abort(cd.d, 1); /* a failed link stays failed */
    }
    goto out_quiet;
out_abort:
    rc = fail("run", &err);
    k3_dist_abort(cd.d, 1);
out_quiet:
    if (workers_wait && root) { /* rank 0 failed before the workers made a context */
        int64_t no = -1;
        k3_dist_bcast_i64(cd.d, &no, 1, &err);
    }
    free(prompt_buf);
    free(ids);
    free(logits);
    k3_cli_images_free(&img);
    k3_sampler_free(smp);
    k3_ctx_free(ctx);
    k3_pool_free(pool);
    k3_tokenizer_free(tok);
    k3_model_close(m);
    k3_cli_dist_end(&cd);
    return k3_cli_dist_exit(&cd, rc);
}

int k3_cmd_info(int argc, char **argv) {
    const char *dir = K3_DEFAULT_MODEL;
    const char *quant = "none";
    bool check = true;
    static const char usage_info[] =
        "usage: k3 info [-m DIR] [--quant MODE] [--no-check-tensors] [--isa NAME]\n"
        "  -m DIR              model directory (default " K3_DEFAULT_MODEL ")\n"
        "  --quant MODE        show the sizes under a quantization mode (default none: as stored)\n"
        "  --no-check-tensors  skip the check that every stored float is finite (no NaN/Inf)\n"
        "  --isa NAME          kernels: " K3_CLI_ISA_HELP "\n";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc) dir = argv[++i];
        else if (!strcmp(argv[i], "--quant") && i + 1 < argc) quant = argv[++i];
        else if (!strcmp(argv[i], "--check-tensors")) check = true;
        else if (!strcmp(argv[i], "--no-check-tensors")) check = false;
        else if (!strcmp(argv[i], "--isa") && i + 1 < argc) {
            if (k3_cli_set_isa("info", argv[++i])) return 2;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            fputs(usage_info, stdout);
            return 0;
        } else {
            fprintf(stderr, "k3 info: unknown option or missing value: %s\n%s", argv[i], usage_info);
            return 2;
        }
    }
    if (!(dir = k3_cli_model_dir("info", dir))) return 1;
    k3_error err = {0};
    k3_model *m = NULL;
    k3_quant_options q;
    if (k3_quant_parse(quant, &q, &err)) return fail("info", &err);
    if (k3_model_open(&m, dir, &err)) return fail("info", &err);
    int64_t n_checked = 0;
    if (check && k3_model_check_tensors(m, &n_checked, &err)) {
        k3_model_close(m);
        return fail("info", &err);
    }
    if (strcmp(quant, "none") && k3_model_quantize(m, &q, &err)) {
        k3_model_close(m);
        return fail("info", &err);
    }
    size_t need = k3_model_describe(m, NULL, 0);
    char *buf = malloc(need + 1);
    if (!buf) {
        k3_model_close(m);
        fprintf(stderr, "k3 info: out of memory\n");
        return 1;
    }
    k3_model_describe(m, buf, need + 1);
    fputs(buf, stdout);
    if (check) printf("tensors: %lld checked, every stored value finite\n", (long long)n_checked);
    printf("kernels: %s\n", k3_isa_current());
    free(buf);
    int rc = k3_cli_print_vision(m);
    k3_model_close(m);
    return rc;
}
