/*
 * main.c -- the `k3` program: one row per subcommand (its name, its entry
 * point in cmd_*.c, its line in `k3 --help`).
 */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "k3.h"

static const struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} commands[] = {
    {"run", k3_cmd_run, "generate text from a model"},
    {"info", k3_cmd_info, "describe a model: config, layer map, sizes"},
    {"tokenize", k3_cmd_tokenize, "text to token ids, or ids to text with --decode"},
    {"eval", k3_cmd_eval, "perplexity of a model over a text file"},
    {"bench", k3_cmd_bench,
     "prefill/decode speed against the measured memory bandwidth (bench serve, bench throughput)"},
    {"serve", k3_cmd_serve, "an OpenAI-compatible HTTP server"},
    {"plan", k3_cmd_plan, "memory and cross-rank traffic of a DCP/EP deployment, from a config"},
    {"grammar", k3_cmd_grammar, "compile a JSON schema / regex / grammar and check texts against it"},
    {"cache", k3_cmd_cache, "inspect or clear a disk cache directory (k3 cache ls|clear DIR)"},
};

static void usage(FILE *out) {
    fputs("usage: k3 <command> [options]\n", out);
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(out, "  %-9s %s\n", commands[i].name, commands[i].help);
    fputs("  --version print the version\n"
          "run `k3 <command> --help` for its options\n",
          out);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(cmd, commands[i].name)) return commands[i].fn(argc - 1, argv + 1);
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "-V") || !strcmp(cmd, "version")) {
        printf("k3 %s\n", K3_VERSION);
        return 0;
    }
    fprintf(stderr, "k3: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}
