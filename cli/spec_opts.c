/*
 * spec_opts.c -- the speculative decoding options that k3 run, k3 serve and
 * k3 bench share (cli.h, k3_cli_spec): the method, k, the draft model, the
 * suffix and n-gram knobs, into k3_engine_options.
 */
#include <stdio.h>
#include <string.h>

#include "cli.h"

int k3_cli_spec_arg(const char *cmd, int argc, char **argv, int *i, k3_cli_spec *s) {
    const char *a = argv[*i];
    const bool has = *i + 1 < argc;
    const char *v = has ? argv[*i + 1] : NULL;
#define IS(name) (!strcmp(a, name) && has)
    int rc = 1;
    if (IS("--speculative")) {
        if (strcmp(v, "suffix") && strcmp(v, "ngram") && strcmp(v, "draft_model") && strcmp(v, "draft") &&
            strcmp(v, "off")) {
            fprintf(stderr, "k3 %s: --speculative must be suffix, ngram, draft_model or off, not '%s'\n", cmd, v);
            return -1;
        }
        s->method = v;
    } else if (IS("--num-speculative-tokens")) {
        if (k3_cli_int(cmd, a, v, 1, K3_SPEC_MAX_TOKENS, &s->k)) return -1;
    } else if (IS("--draft-model")) {
        s->draft_dir = v;
    } else if (IS("--spec-rollback")) {
        if (strcmp(v, "reapply") && strcmp(v, "states")) {
            fprintf(stderr, "k3 %s: --spec-rollback must be reapply or states, not '%s'\n", cmd, v);
            return -1;
        }
        s->rollback = strcmp(v, "states") ? 0 : 1;
    } else if (IS("--suffix-max-tree-depth")) {
        if (k3_cli_int(cmd, a, v, 1, 63, &s->tree_depth)) return -1;
    } else if (IS("--suffix-max-cached-requests")) {
        if (k3_cli_int(cmd, a, v, -1, 1 << 20, &s->cached_requests)) return -1;
    } else if (IS("--suffix-max-spec-factor")) {
        if (k3_cli_float(cmd, a, v, 0.01, 1000, &s->spec_factor)) return -1;
    } else if (IS("--suffix-min-token-prob")) {
        if (k3_cli_float(cmd, a, v, 0.0001, 1, &s->min_prob)) return -1;
    } else if (IS("--prompt-lookup-min")) {
        if (k3_cli_int(cmd, a, v, 1, 16, &s->lookup_min)) return -1;
    } else if (IS("--prompt-lookup-max")) {
        if (k3_cli_int(cmd, a, v, 1, 16, &s->lookup_max)) return -1;
    } else if (!strcmp(a, "--spec-no-cost-model")) {
        s->no_cost_model = true;
        return 1;
    } else {
        rc = 0;
    }
#undef IS
    if (rc) (*i)++;
    return rc;
}

int k3_cli_spec_apply(const char *cmd, const k3_cli_spec *s, const char *quant, k3_engine_options *eo,
                      k3_model **draft) {
    *draft = NULL;
    k3_spec_method m = K3_SPEC_OFF;
    if (s->method && !strcmp(s->method, "suffix")) m = K3_SPEC_SUFFIX;
    else if (s->method && !strcmp(s->method, "ngram")) m = K3_SPEC_NGRAM;
    else if (s->method && (!strcmp(s->method, "draft_model") || !strcmp(s->method, "draft"))) m = K3_SPEC_DRAFT_MODEL;
    else if (!s->method && s->draft_dir) m = K3_SPEC_DRAFT_MODEL;
    if (m == K3_SPEC_DRAFT_MODEL && !s->draft_dir) {
        fprintf(stderr, "k3 %s: --speculative draft_model needs --draft-model DIR\n", cmd);
        return 2;
    }
    if (s->draft_dir) {
        k3_error err = {0};
        if (k3_cli_open_model(draft, s->draft_dir, quant, false, &err)) {
            fprintf(stderr, "k3 %s: --draft-model %s: %s\n", cmd, s->draft_dir, err.msg);
            return 1;
        }
    }
    eo->speculative = m;
    eo->num_speculative_tokens = s->k;
    eo->draft_model = *draft;
    eo->spec_no_cost_model = s->no_cost_model;
    eo->spec_rollback = s->rollback;
    eo->suffix_max_tree_depth = s->tree_depth;
    eo->suffix_max_cached_requests = s->cached_requests;
    eo->suffix_max_spec_factor = s->spec_factor;
    eo->suffix_min_token_prob = s->min_prob;
    eo->prompt_lookup_min = s->lookup_min;
    eo->prompt_lookup_max = s->lookup_max;
    return 0;
}
