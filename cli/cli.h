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

#include "k3.h"

/* The quantization mode and cache format used when none is given: the
 * fastest mode within the accuracy bar (W8A8 and C8 within 1% perplexity of
 * fp32, W4A8 within 2%, top-1 agreement >= 97%), measured with
 * bench/accuracy.sh on models/k3-mini (docs/performance.md). `--quant none
 * --kv-cache f32` is the reference path. */
#define K3_DEFAULT_QUANT "w8a8+w4a8"
#define K3_DEFAULT_KV "c8"

/* Opens a model, applies a --quant mode ("none", "w8a8", "w4a8",
 * "w8a8+w4a8", ...) and, unless keep_mapped (--mmap), copies the streamed
 * weights into RAM when they take at most half of it (k3_model_load_resident). */
k3_status k3_cli_open_model(k3_model **m, const char *dir, const char *quant, bool keep_mapped, k3_error *err);
/* Parses a --kv-cache value ("f32" or "c8"); 0 on success. */
int k3_cli_parse_kv(const char *s, k3_kv_type *out);

/* Images in a `k3 run` prompt (image_prompt.c). */
typedef struct k3_cli_images {
    k3_vision *v;
    float **rows;               /* [n] each image's prompt rows */
    int n;
    const float **embeds;       /* [prompt length] row per position, NULL = the token */
} k3_cli_images;
/* Where a --chat prompt's user content begins in ids. */
k3_status k3_cli_chat_content_at(const k3_tokenizer *tok, bool think, const int32_t *ids, size_t n_ids, size_t *at,
                                 k3_error *err);
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
    int n;  /* 0: the checkpoint has no tower */
} k3_cli_vision_bench;
int k3_cli_bench_vision(const k3_model *m, k3_pool *pool, const char *quant, int runs, bool json,
                        k3_cli_vision_bench *out);
void k3_cli_bench_vision_print(const k3_cli_vision_bench *b, bool json);

/* The model directory used when -m is not given. */
#define K3_DEFAULT_MODEL "models/k3-mini"

#endif /* K3_CLI_CLI_H */
