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
int k3_cmd_bench_serve(int argc, char **argv);
int k3_cmd_bench_throughput(int argc, char **argv); /* `k3 bench throughput` */

#include "k3.h"

/* The quantization mode and cache format used when none is given. The
 * trunk runs as stored (BF16) and the routed experts as stored (MXFP4 or
 * BF16, fp32 activations), with the C8 cache: on tiny checkpoints built by
 * Moonshot's own classes with their own initialization
 * (tests/test_official.c) the router's top-k has near-ties (score margins
 * of 1e-4), and any 8-bit requantization upstream of a router flips some of
 * them: W8A8 is at rel-L2 0.36 / 0.32 and top-1 21/24 / 16/24 against the
 * official logits, W4A8 alone at 0.054 on the MXFP4 variant, while this
 * mode is at 9e-4 / 1.1e-3 with every top-1 (docs/performance.md, "Accuracy
 * against Moonshot's code"). W8A8 (~1.7x the decode speed on the bench
 * checkpoint) and W4A8 are explicit choices: `--quant w8a8+w4a8` (ppl +0.03%
 * on the trained models/k3-mini); check a new checkpoint with
 * `k3 eval --compare-fp32` before trusting them. `--quant none --kv-cache
 * f32` is the reference path. */
#define K3_DEFAULT_QUANT "none"
#define K3_DEFAULT_KV "c8"

/* Opens a model, applies a --quant mode ("none", "w8a8", "w4a8",
 * "w8a8+w4a8", ...) and, unless keep_mapped (--mmap), copies the streamed
 * weights into RAM when they take at most half of it (k3_model_load_resident). */
k3_status k3_cli_open_model(k3_model **m, const char *dir, const char *quant, bool keep_mapped, k3_error *err);
/* Parses a --kv-cache value ("f32" or "c8"); 0 on success. */
int k3_cli_parse_kv(const char *s, k3_kv_type *out);

/* `k3 eval --base-url`: a window of ids scored through /v1/completions with
 * echo + logprobs (cmd_eval_remote.c). lp[r] = logprob of ids[r + 1],
 * top1[r] = the server's most likely id there (-1 if not given); 0 on
 * success, else -1 with why. */
typedef struct k3_eval_remote k3_eval_remote;
int k3_eval_remote_open(k3_eval_remote **out, const char *base_url, const char *model, const char *api_key,
                        char *why, size_t why_len);
int k3_eval_remote_window(k3_eval_remote *r, const int32_t *ids, size_t len, double *lp, int32_t *top1, char *why,
                          size_t why_len);
void k3_eval_remote_close(k3_eval_remote *r);

/* The model directory used when -m is not given. */
#define K3_DEFAULT_MODEL "models/k3-mini"

#endif /* K3_CLI_CLI_H */
