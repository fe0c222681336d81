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

/* Applies --isa NAME (k3_set_isa) for subcommand cmd; 0, or prints why not
 * and returns 2. Call it while parsing, before the model is opened. */
int k3_cli_set_isa(const char *cmd, const char *name);
#define K3_CLI_ISA_HELP "ref | avx2 | avx2-novnni | avx512 | best (default: best the CPU has)"

/* The model directory used when -m is not given. */
#define K3_DEFAULT_MODEL "models/k3-mini"

#endif /* K3_CLI_CLI_H */
