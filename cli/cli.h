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

/* ---- several processes (cli_dist.c, cmd_plan.c) ---- */
int k3_cmd_plan(int argc, char **argv);
int k3_cmd_bench_dist(int argc, char **argv);
/* Whether `k3 bench` runs as k3_cmd_bench_dist: under mpirun, or --dcp/--ep given. */
bool k3_cli_dist_wanted(int argc, char **argv);

typedef struct k3_cli_dist {
    k3_dist_options opt;
    bool asked;                 /* --dcp or --ep given */
    k3_dist *d;                 /* NULL: one process */
    int32_t rank;
    int32_t die_rank, hang_rank;/* test hooks: --dist-test-die R, --dist-test-hang R */
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
/* k3_cli_open_model keeping only this EP rank's routed experts. */
k3_status k3_cli_open_model_ep(k3_model **m, const char *dir, const char *quant, bool keep_mapped, int32_t ep_rank,
                               int32_t ep_size, k3_error *err);
k3_status k3_cli_open_model_dist(k3_model **m, const char *dir, const char *quant, bool keep_mapped,
                                 const k3_cli_dist *cd, k3_error *err);

/* The model directory used when -m is not given. */
#define K3_DEFAULT_MODEL "models/k3-mini"

#endif /* K3_CLI_CLI_H */
