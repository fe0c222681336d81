/*
 * cli.h -- the subcommands of the `k3` program. Each takes argc/argv with
 * argv[0] = the subcommand name, prints, and returns the process exit code.
 * Only cli/ prints or exits.
 */
#ifndef K3_CLI_CLI_H
#define K3_CLI_CLI_H

int k3_cmd_run(int argc, char **argv);
int k3_cmd_info(int argc, char **argv);
int k3_cmd_tokenize(int argc, char **argv);
int k3_cmd_eval(int argc, char **argv);
int k3_cmd_bench(int argc, char **argv);
int k3_cmd_serve(int argc, char **argv);
/* k3 serve --role proxy (cmd_proxy.c) */
int k3_cmd_serve_proxy(int argc, char **argv);
int k3_cmd_bench_serve(int argc, char **argv);
int k3_cmd_bench_throughput(int argc, char **argv); /* `k3 bench throughput` */

#include "k3.h"

/* The --quant modes, as the subcommands' help lists them (k3_quant_parse). */
#define K3_CLI_QUANT_MODES "none | f32 | w8a8 | w8a8-mxfp8 | w4a8 | w8a8+w4a8"

/* The quantization mode and cache format used when none is given. The
 * trunk runs as stored (BF16) and the routed experts as stored (MXFP4 or
 * BF16), with the C8 cache; where the CPU has BF16 dot products (AVX512_BF16,
 * AMX) their activations are rounded to BF16 and the products summed in the
 * AMX unit's order, the same bits at every batch size (docs/amx.md,
 * "Numerics"), the routers kept fp32. On tiny checkpoints built by Moonshot's
 * own classes with their own initialization (tests/test_official.c) the
 * router's top-k has near-ties (score margins of 1e-4): this mode is at
 * rel-L2 6.7e-3 with every top-1 against the official logits (9e-4 with fp32
 * activations), while any 8-bit requantization upstream of a router flips
 * some of them: W8A8 is at rel-L2 0.36 / 0.32 and top-1 21/24 / 16/24, W4A8
 * alone at 0.054 on the MXFP4 variant (docs/performance.md, "Accuracy
 * against Moonshot's code"). W8A8 and W4A8 are explicit choices: `--quant
 * w8a8+w4a8` (ppl +0.03% on the trained models/k3-mini); check a new
 * checkpoint with `k3 eval --compare-fp32` before trusting them. `--quant
 * f32 --kv-cache f32` is the reference path. */
#define K3_DEFAULT_QUANT "none"
#define K3_DEFAULT_KV "c8"

/* Opens a model, applies a --quant mode ("none", "w8a8", "w4a8",
 * "w8a8+w4a8", ...) and, unless keep_mapped (--mmap), copies the streamed
 * weights into RAM when they take at most half of it (k3_model_load_resident). */
k3_status k3_cli_open_model(k3_model **m, const char *dir, const char *quant, bool keep_mapped, k3_error *err);
/* k3_cli_open_model checks first that every stored weight is finite
 * (k3_model_check_tensors: 0.3 s for the 1.9 GB bench checkpoint). The
 * _stored form makes the check optional (check = false: --no-check-tensors)
 * and, when stored != NULL, fills it with the model's info before
 * quantization (the figures `k3 info` shows: bytes read per decoded token
 * as stored). */
k3_status k3_cli_open_model_stored(k3_model **m, const char *dir, const char *quant, bool keep_mapped, bool check,
                                   k3_model_info *stored, k3_error *err);
/* The same, binding only the routed experts of EP rank ep_rank of ep_size
 * (k3_model_open_ep; 0 of 1 = all). */
k3_status k3_cli_open_model_ex(k3_model **m, const char *dir, const char *quant, bool keep_mapped, bool check,
                               k3_model_info *stored, int32_t ep_rank, int32_t ep_size, k3_error *err);
/* Parses a --kv-cache value ("f32" or "c8"); 0 on success. */
int k3_cli_parse_kv(const char *s, k3_kv_type *out);

/* Images in a `k3 run` prompt (image_prompt.c). */
typedef struct k3_cli_images {
    k3_vision *v;
    float **rows; /* [n] each image's prompt rows */
    int n;
    const float **embeds; /* [prompt length] row per position, NULL = the token */
} k3_cli_images;
/* Where a --chat prompt's user content begins in ids. */
k3_status k3_cli_chat_content_at(const k3_tokenizer *tok, const char *system, bool think, const int32_t *ids,
                                 size_t n_ids, size_t *at, k3_error *err);
/* Encodes the image files with the model's tower (quant: the --quant mode)
 * and splices their framings into *ids at position at (ids grows). */
k3_status k3_cli_images_insert(k3_cli_images *im, const k3_model *m, const k3_tokenizer *tok, k3_pool *pool,
                               const char *quant, const char *const *files, int n_files, size_t at, int32_t **ids,
                               size_t *n_ids, k3_error *err);
void k3_cli_images_free(k3_cli_images *im);
/* `k3 info`'s vision lines: the tower, or "none"; 1 when it is broken. */
int k3_cli_print_vision(const k3_model *m);

/* `k3 bench`'s image-encode figure (bench_vision.c): medians of runs. */
typedef struct k3_cli_vision_run {
    int32_t w, h, tokens, patches;
    double pre_ms, tower_ms, tower_min, tower_max, gflop;
} k3_cli_vision_run;
typedef struct k3_cli_vision_bench {
    k3_cli_vision_run runs[4];
    int n; /* 0: the checkpoint has no tower */
} k3_cli_vision_bench;
int k3_cli_bench_vision(const k3_model *m, k3_pool *pool, const char *quant, int runs, bool json,
                        k3_cli_vision_bench *out);
void k3_cli_bench_vision_print(const k3_cli_vision_bench *b, bool json);

/* `k3 --version` */
#define K3_VERSION "0.1.0"
/* ---- several processes (cli_dist.c, cmd_plan.c) ---- */
int k3_cmd_plan(int argc, char **argv);
int k3_cmd_grammar(int argc, char **argv); /* cmd_grammar.c */
int k3_cmd_cache(int argc, char **argv);   /* cmd_cache.c: k3 cache ls|clear DIR */
int k3_cmd_bench_dist(int argc, char **argv);
int k3_cmd_bench_spec(int argc, char **argv); /* cmd_bench_spec.c */
/* Whether `k3 bench` runs as k3_cmd_bench_dist: under mpirun, or --dcp/--ep given. */
bool k3_cli_dist_wanted(int argc, char **argv);

typedef struct k3_cli_dist {
    k3_dist_options opt;
    bool asked; /* --dcp or --ep given */
    k3_dist *d; /* NULL: one process */
    int32_t rank;
    int32_t die_rank, hang_rank; /* test hooks: --dist-test-die R, --dist-test-hang R */
} k3_cli_dist;

/* Takes --dcp, --ep, --dcp-interleave, --dcp-topk-exchange, --dist-timeout
 * (and the test hooks) out of argv; -1 (message printed) on a bad value. */
int k3_cli_dist_args(int *argc, char **argv, k3_cli_dist *cd, const char *cmd);
/* Joins MPI when under mpirun or asked for; -1 (message printed on rank 0). */
int k3_cli_dist_start(k3_cli_dist *cd, const char *cmd);
/* All ranks agree on s: 0, or -1 with the first failing rank's message
 * printed by rank 0. Without a dist: s != 0 gives -1 (nothing printed). */
int k3_cli_dist_agree(k3_cli_dist *cd, k3_status s, k3_error *err, const char *cmd);
/* The test hooks: the chosen rank dies or hangs here. */
void k3_cli_dist_test_hooks(k3_cli_dist *cd);
void k3_cli_dist_end(k3_cli_dist *cd);
/* The exit status of a rank: rc on rank 0 (and in one process); 0 on the
 * others, whose failures rank 0 has reported (or which ended the job with
 * MPI_Abort): a non-zero exit of another rank makes mpirun end the job,
 * possibly before rank 0 has printed the message. */
int k3_cli_dist_exit(const k3_cli_dist *cd, int rc);
/* Rank 0 prints every rank's cache bytes and routed-expert bytes (a
 * collective: all ranks call it); -1 on a failure. */
int k3_cli_show_memory(k3_cli_dist *cd, const k3_model *m, const k3_ctx *ctx, const char *cmd);
/* k3_cli_open_model keeping only this rank's routed experts (EP); check as
 * k3_cli_open_model_stored. */
k3_status k3_cli_open_model_dist(k3_model **m, const char *dir, const char *quant, bool keep_mapped, bool check,
                                 const k3_cli_dist *cd, k3_error *err);
/* `k3 eval --base-url`: a window of ids scored through /v1/completions with
 * echo + logprobs (cmd_eval_remote.c). lp[r] = logprob of ids[r + 1],
 * top1[r] = the server's most likely id there (-1 if not given); 0 on
 * success, else -1 with why. */
typedef struct k3_eval_remote k3_eval_remote;
int k3_eval_remote_open(k3_eval_remote **out, const char *base_url, const char *model, const char *api_key, char *why,
                        size_t why_len);
int k3_eval_remote_window(k3_eval_remote *r, const int32_t *ids, size_t len, double *lp, int32_t *top1, char *why,
                          size_t why_len);
void k3_eval_remote_close(k3_eval_remote *r);
/* Applies --isa NAME (k3_set_isa) for subcommand cmd; 0, or prints why not
 * and returns 2. Call it while parsing, before the model is opened. */
int k3_cli_set_isa(const char *cmd, const char *name);
#define K3_CLI_ISA_HELP "ref | avx2 | avx2-novnni | avx512 | avx512-nobf16 | amx | best (default: best the CPU has)"

/* ---- speculative decoding options (spec_opts.c) ------------------------ */
typedef struct k3_cli_spec {
    const char *method;    /* --speculative (NULL: off, or draft_model with --draft-model) */
    int k;                 /* --num-speculative-tokens (0: the engine's) */
    const char *draft_dir; /* --draft-model */
    bool no_cost_model;    /* --spec-no-cost-model */
    int rollback;          /* --spec-rollback reapply (0) | states (1) */
    int tree_depth, cached_requests, lookup_min, lookup_max;
    float spec_factor, min_prob;
} k3_cli_spec;
#define K3_CLI_SPEC_HELP \
    "  --speculative suffix|ngram|draft_model|off  draft tokens and verify them in one pass (default off):\n" \
    "                      suffix: a suffix tree of the request's prompt and output and of recent\n" \
    "                      outputs of its API key; ngram: the last earlier occurrence of the longest\n" \
    "                      n-gram; draft_model: --draft-model DIR (same vocabulary). The same text,\n" \
    "                      and for a seed the same tokens, as without (docs/spec.md)\n" \
    "  --num-speculative-tokens K  draft tokens per step at most (1..16, default 8); the engine drafts\n" \
    "                      fewer, or none, where its cost model says they do not pay\n" \
    "  --draft-model DIR   the draft model (implies --speculative draft_model)\n" \
    "  --suffix-max-tree-depth N, --suffix-max-cached-requests N, --suffix-max-spec-factor F,\n" \
    "  --suffix-min-token-prob F, --prompt-lookup-min N, --prompt-lookup-max N  vLLM's proposer knobs\n" \
    "  --spec-no-cost-model  draft whatever is found (for measurements); --spec-rollback reapply|states\n"
/* 1: argv[*i] was one of them (consumed; *i at its last word), 0: not one,
 * -1: a bad value (printed). */
int k3_cli_spec_arg(const char *cmd, int argc, char **argv, int *i, k3_cli_spec *s);
/* Fills eo's speculative options from s, opening the draft model into
 * *draft (the caller closes it after the engine); 0, or prints why not. */
int k3_cli_spec_apply(const char *cmd, const k3_cli_spec *s, const char *quant, k3_engine_options *eo,
                      k3_model **draft);

/* k3 run's generation through the engine (run_engine.c): for --speculative. */
typedef struct k3_cli_run_engine_args {
    const k3_model *m;
    const k3_tokenizer *tok;
    k3_pool *pool;
    const int32_t *ids;
    size_t n_ids;
    int n_gen;
    int64_t ctx_tokens;
    k3_sampler_options so;
    k3_kv_type kv;
    const char *quant;
    bool chat, think;
    const k3_cli_spec *spec;
} k3_cli_run_engine_args;
int k3_cli_run_engine(const k3_cli_run_engine_args *a);

/* The model directory used when -m is not given. */
#define K3_DEFAULT_MODEL "models/k3-mini"

/* ---- strict option values (common.c) ---------------------------------
 * Each parses the whole string (no trailing junk, no wrap-around, NaN and
 * infinities refused) within [lo, hi]; on failure it prints
 * `k3 CMD: OPT expects ..., not 'S'` on stderr and returns -1. */
#define K3_CLI_MAX_THREADS 512
int k3_cli_long(const char *cmd, const char *opt, const char *s, long lo, long hi, long *out);
int k3_cli_int(const char *cmd, const char *opt, const char *s, int lo, int hi, int *out);
int k3_cli_u64(const char *cmd, const char *opt, const char *s, uint64_t *out);
int k3_cli_float(const char *cmd, const char *opt, const char *s, double lo, double hi, float *out);
/* --threads N: 1..512, or 0 = every CPU this process may use. */
int k3_cli_threads(const char *cmd, const char *s, int *out);
/* The default thread count: physical cores (not hardware threads) among the
 * CPUs this process may use; and every such CPU. */
int k3_cli_physical_cores(void);
/* The default --threads: the physical cores, shared by the ranks of one
 * machine under mpirun. */
int k3_cli_default_threads(void);
int k3_cli_all_cpus(void);
/* The deployment's kv transfer secret of --role prefill|decode|proxy: the
 * file's bytes (--kv-transfer-secret-file FILE; a trailing newline dropped)
 * or K3_KV_TRANSFER_SECRET. 0 with *out (malloc'ed, the caller clears and
 * frees it) and *n; else prints why (none given, unreadable, too short) and
 * returns -1. */
int k3_cli_transfer_secret(const char *cmd, const char *file, char **out, size_t *n);
/* The model directory: dir when given with -m, else the default model found
 * in ./models/k3-mini, beside the binary (BIN/../models/k3-mini) or under
 * its install prefix (BIN/../share/k3/models/k3-mini). NULL (with a message
 * saying where it looked) when the default is nowhere. */
const char *k3_cli_model_dir(const char *cmd, const char *dir);

/* ---- chat (chat_repl.c) ----------------------------------------------
 * The renderer of an assistant turn in the K3 chat format as plain text:
 * control tokens and tag names are not printed; a think block is shown
 * between [think] and [/think] (the opening marker printed by _init when
 * the generation prompt opened the think block). */
#include <stdio.h>
typedef struct k3_cli_chat_view {
    int32_t open, close, sep;
    int in_tag, closing;
    char tag[64];
    char block[64]; /* the block being generated: "think", "response" or "" */
    FILE *out;
} k3_cli_chat_view;
void k3_cli_chat_render_init(k3_cli_chat_view *c, const k3_tokenizer *tok, bool think, FILE *out);
void k3_cli_chat_render(k3_cli_chat_view *c, int32_t id, const char *piece, size_t len);

/* The conversation of `k3 run --chat` with no prompt: one line of stdin per
 * user message, each turn prefilling only its own tokens. Returns the exit
 * status. */
typedef struct k3_cli_repl {
    k3_model *model;
    const k3_tokenizer *tok;
    int threads;
    k3_kv_type kv;
    const k3_sampler_options *sampling;
    const char *system; /* or NULL */
    bool think;
    int n_gen;     /* tokens per reply at most */
    int64_t n_ctx; /* 0: 4096 (or the model's limit) */
} k3_cli_repl;
int k3_cli_chat_repl(const k3_cli_repl *r);

/* Reads a whole prompt or text file ("-" = stdin) of at most max bytes;
 * NULL after printing `k3 CMD: ...` on stderr. NUL-terminated. */
#define K3_CLI_MAX_INPUT ((size_t)64 << 20)
char *k3_cli_read_input(const char *cmd, const char *path, size_t max, size_t *len);

#endif /* K3_CLI_CLI_H */
