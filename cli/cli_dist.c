/*
 * cli_dist.c -- the --dcp/--ep options and the start of MPI for the
 * subcommands (see cli.h). The program joins MPI when mpirun started it
 * (OMPI_COMM_WORLD_SIZE is set) or when --dcp/--ep ask for more than one
 * rank; the library never reads the environment.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

static int pos_int(const char *s, int32_t *out) {
    char *end;
    const long v = strtol(s, &end, 10);
    if (end == s || *end || v < 1 || v > 1 << 20) return -1;
    *out = (int32_t)v;
    return 0;
}

int k3_cli_dist_args(int *argc, char **argv, k3_cli_dist *cd, const char *cmd) {
    memset(cd, 0, sizeof *cd);
    cd->opt.dcp = cd->opt.ep = cd->opt.dcp_interleave = 1;
    cd->die_rank = cd->hang_rank = -1;
    int o = 1;
    for (int i = 1; i < *argc; i++) {
        const char *a = argv[i];
        const int has = i + 1 < *argc;
        int bad = 0;
        if (!strcmp(a, "--dcp") && has) bad = pos_int(argv[++i], &cd->opt.dcp), cd->asked = true;
        else if (!strcmp(a, "--ep") && has) bad = pos_int(argv[++i], &cd->opt.ep), cd->asked = true;
        else if (!strcmp(a, "--dcp-interleave") && has) bad = pos_int(argv[++i], &cd->opt.dcp_interleave);
        else if (!strcmp(a, "--dcp-topk-exchange") && has) {
            const char *v = argv[++i];
            if (!strcmp(v, "allgather")) cd->opt.exchange = K3_TOPK_ALLGATHER;
            else if (!strcmp(v, "butterfly")) cd->opt.exchange = K3_TOPK_BUTTERFLY;
            else bad = -1;
        } else if (!strcmp(a, "--dist-timeout") && has) {
            int32_t t = 0;
            bad = pos_int(argv[++i], &t);
            cd->opt.timeout_s = t;
        } else if (!strcmp(a, "--dist-test-die") && has) {
            bad = pos_int(argv[++i], &cd->die_rank);
        } else if (!strcmp(a, "--dist-test-hang") && has) {
            bad = pos_int(argv[++i], &cd->hang_rank);
        } else {
            argv[o++] = argv[i];
            continue;
        }
        if (bad) {
            fprintf(stderr, "k3 %s: %s needs a positive integer (or allgather|butterfly), not '%s'\n", cmd, a, argv[i]);
            return -1;
        }
    }
    *argc = o;
    argv[o] = NULL;
    return 0;
}

int k3_cli_dist_exit(const k3_cli_dist *cd, int rc) { return cd->rank == 0 ? rc : 0; }

int k3_cli_dist_start(k3_cli_dist *cd, const char *cmd) {
    const char *ws = getenv("OMPI_COMM_WORLD_SIZE"), *wr = getenv("OMPI_COMM_WORLD_RANK");
    cd->rank = wr ? atoi(wr) : 0; /* until MPI says */
    if (!ws && !cd->asked) return 0;
    if (!ws && (cd->opt.dcp > 1 || cd->opt.ep > 1)) {
        fprintf(stderr, "k3 %s: --dcp %d --ep %d need several processes: run under mpirun -np N\n", cmd, cd->opt.dcp,
                cd->opt.ep);
        return -1;
    }
    k3_error err = {0};
    if (k3_dist_init(&cd->d, &cd->opt, &err)) {
        /* every rank finds the same problem; rank 0 says it */
        if (cd->rank == 0) fprintf(stderr, "k3 %s: %s\n", cmd, err.msg);
        return -1;
    }
    cd->rank = k3_dist_rank(cd->d);
    return 0;
}

int k3_cli_dist_agree(k3_cli_dist *cd, k3_status s, k3_error *err, const char *cmd) {
    if (!cd->d) return s ? -1 : 0;
    if (k3_dist_agree(cd->d, s, err) == K3_OK) return 0;
    if (cd->rank == 0) fprintf(stderr, "k3 %s: %s\n", cmd, err->msg);
    return -1;
}

void k3_cli_dist_test_hooks(k3_cli_dist *cd) {
    if (!cd->d) return;
    if (cd->rank == cd->die_rank) _exit(3); /* a rank that dies */
    if (cd->rank == cd->hang_rank)
        for (;;) pause(); /* a rank that hangs */
}

void k3_cli_dist_end(k3_cli_dist *cd) {
    k3_dist_free(cd->d);
    cd->d = NULL;
}

k3_status k3_cli_open_model_dist(k3_model **m, const char *dir, const char *quant, bool keep_mapped, bool check,
                                 const k3_cli_dist *cd, k3_error *err) {
    return k3_cli_open_model_ex(m, dir, quant, keep_mapped, check, NULL, k3_dist_ep_rank(cd->d), k3_dist_ep_size(cd->d),
                                err);
}

int k3_cli_show_memory(k3_cli_dist *cd, const k3_model *m, const k3_ctx *ctx, const char *cmd) {
    const int n = cd->d ? k3_dist_size(cd->d) : 1;
    double *v = calloc((size_t)(2 * n), sizeof *v);
    if (!v) return -1;
    v[cd->rank] = (double)k3_ctx_cache_bytes(ctx);
    v[n + cd->rank] = (double)k3_model_expert_bytes(m);
    k3_error err = {0};
    if (cd->d && k3_dist_sum(cd->d, v, 2 * n, &err)) {
        fprintf(stderr, "k3 %s: %s\n", cmd, err.msg);
        free(v);
        return -1;
    }
    if (cd->rank == 0) {
        fprintf(stderr, "cache bytes per rank:");
        for (int i = 0; i < n; i++) fprintf(stderr, " %.0f", v[i]);
        fprintf(stderr, "\nexpert bytes per rank:");
        for (int i = 0; i < n; i++) fprintf(stderr, " %.0f", v[n + i]);
        fprintf(stderr, "\n");
    }
    free(v);
    return 0;
}
