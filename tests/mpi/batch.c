/*
 * batch.c -- build/k3-mpi-batch [MODEL], run under mpirun -np D: the
 * library's DCP path with what a scheduler does -- several sequences of
 * different lengths in one batch (prefill spans and decode rows mixed, one
 * round cut into several by max_batch), a sequence reset and reused -- on
 * a context made with a dist (--dcp = world size), image rows in place of
 * some embeddings (k3_batch_seq.embeds), against a one-process
 * context on rank 0. Rank 0 drives through the executor (k3_exec_forward);
 * the others serve (k3_exec_serve). Checks
 * the logits of every step to rel-L2 1e-5 (fp32 path), and that each rank
 * holds about 1/D of the cache. Prints "batch: N passed, N failed".
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3.h"

static double rel_l2(const float *a, const float *b, int64_t n) {
    double d = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        s += (double)a[i] * a[i];
    }
    return sqrt(d) / (s > 0 ? sqrt(s) : 1);
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "tests/models/tiny-dsa";
    const int ep = argc > 2 && !strcmp(argv[2], "ep");
    k3_error err = {0};
    k3_dist *d = NULL;
    k3_dist_options dopt = {.dcp = 0, .ep = 1, .dcp_interleave = 2, .timeout_s = 60};
    /* probe the world size, then the DCP group over all of it */
    k3_dist *probe;
    if (k3_dist_init(&probe, &dopt, &err)) {
        fprintf(stderr, "batch: %s\n", err.msg);
        return 1;
    }
    if (ep) dopt.ep = k3_dist_size(probe);
    else dopt.dcp = k3_dist_size(probe);
    if (k3_dist_init(&d, &dopt, &err)) {
        fprintf(stderr, "batch: %s\n", err.msg);
        return 1;
    }
    const int rank = k3_dist_rank(d);
    k3_model *m = NULL, *full = NULL;
    k3_ctx *ctx = NULL, *ref = NULL;
    k3_status s = k3_model_open_ep(&m, dir, k3_dist_ep_rank(d), k3_dist_ep_size(d), &err);
    k3_ctx_options co = {.max_seqs = 3, .cache_tokens = 4096, .max_batch = 24, .kv_cache = K3_KV_F32, .dist = d};
    if (!s) s = k3_ctx_init(&ctx, m, &co, &err);
    if (k3_dist_agree(d, s, &err)) {
        if (rank == 0) fprintf(stderr, "batch: %s\n", err.msg);
        return 1;
    }
    int pass = 0, fail = 0;
    if (k3_dist_dcp_size(d) > 1 && rank == 0) { /* a block must hold as many tokens of every rank */
        k3_ctx_options bad_bs = co;
        bad_bs.block_size = 63;
        k3_ctx *no = NULL;
        k3_error e2 = {0};
        const k3_status bs_st = k3_ctx_init(&no, m, &bad_bs, &e2);
        if (bs_st == K3_ERR_ARG && !no && strstr(e2.msg, "block size 63 is not a multiple of --dcp"))
            pass++;
        else {
            fail++;
            fprintf(stderr, "batch: block size 63 under DCP %d: status %d '%s'\n", k3_dist_dcp_size(d), (int)bs_st,
                    e2.msg);
        }
        k3_ctx_free(no);
    }
    if (rank != 0) {
        if (k3_exec_serve(ctx, &err)) {
            fprintf(stderr, "batch: rank %d: %s\n", rank, err.msg);
            k3_dist_abort(d, 1);
        }
    } else {
        k3_ctx_options ro = co;
        ro.dist = NULL;
        if (k3_model_open(&full, dir, &err) || k3_ctx_init(&ref, full, &ro, &err)) {
            fprintf(stderr, "batch: %s\n", err.msg);
            k3_dist_abort(d, 1);
        }
        k3_model_info info;
        k3_model_get_info(m, &info);
        const int64_t V = info.vocab_size;
        float *la = malloc(sizeof(float) * (size_t)(64 * V)), *lb = malloc(sizeof(float) * (size_t)(64 * V));
        int32_t toks[3][64];
        for (int q = 0; q < 3; q++)
            for (int i = 0; i < 64; i++) toks[q][i] = (int32_t)((q * 97 + i * 31 + 5) % V);
        /* steps: (n_tokens per sequence; 0 = not in the batch), reset before step 4 */
        const int steps[7][3] = {{30, 9, 0}, {1, 1, 17}, {1, 0, 1}, {1, 1, 1}, {12, 1, 1}, {1, 1, 1}, {1, 1, 1}};
        /* rows replacing the embeddings of tokens 2..5 of sequence 1 in step
         * 0 (what an image's pads carry): they travel with the batch */
        const int64_t Dm = info.hidden_size;
        float *img = malloc(sizeof(float) * (size_t)(4 * Dm));
        const float *erow[9] = {0};
        for (int64_t i = 0; i < 4 * Dm; i++) img[i] = (float)((i * 7919) % 201 - 100) / 400.0f;
        for (int r = 0; r < 4; r++) erow[2 + r] = img + r * Dm;
        int off[3] = {0, 0, 0};
        for (int st = 0; st < 7; st++) {
            if (st == 4) {
                k3_exec_seq_reset(ctx, 0);
                k3_ctx_seq_reset(ref, 0);
                off[0] = 0;
            }
            k3_batch_seq b[3];
            int nb = 0, rows = 0;
            for (int q = 0; q < 3; q++)
                if (steps[st][q]) {
                    b[nb++] = (k3_batch_seq){q, steps[st][q], toks[q] + off[q], st == 0 && q == 1 ? erow : NULL};
                    off[q] += steps[st][q];
                    rows += steps[st][q];
                }
            const k3_logits_mode mode = st % 2 ? K3_LOGITS_LAST : K3_LOGITS_ALL;
            const int64_t n = (mode == K3_LOGITS_ALL ? rows : nb) * V;
            s = k3_exec_forward(ctx, b, nb, mode, la, &err);
            if (!s) s = k3_ctx_forward(ref, b, nb, mode, lb, &err);
            const double e = s ? 1.0 : rel_l2(lb, la, n);
            if (s || !(e <= 1e-5)) {
                fail++;
                fprintf(stderr, "batch: step %d: %s rel-L2 %.3g\n", st, s ? err.msg : "", e);
            } else {
                pass++;
            }
        }
        /* the pool: the same global blocks as one process (cache_tokens and a
         * partial block per sequence), each block_size / D slots on a rank;
         * the block size is 64 up to a multiple of D*I */
        const int64_t one = k3_ctx_cache_bytes(ref), mine = k3_ctx_cache_bytes(ctx);
        const int64_t D = k3_dist_dcp_size(d), S = co.max_seqs, I = dopt.dcp_interleave, st = D * I;
        const int64_t bs = (64 + st - 1) / st * st, one_blocks = (co.cache_tokens + 63) / 64 + S;
        const int64_t slot_bytes = one / (one_blocks * 64), mine_slots = ((co.cache_tokens + bs - 1) / bs + S) * bs / D;
        if (one % (one_blocks * 64) == 0 && mine == mine_slots * slot_bytes &&
            mine_slots * D <= co.cache_tokens + S * bs + bs)
            pass++;
        else {
            fail++;
            fprintf(stderr, "batch: cache bytes %lld on rank 0, one process %lld\n", (long long)mine, (long long)one);
        }
        free(la);
        free(lb);
        free(img);
        if (k3_exec_release(d, &err)) k3_dist_abort(d, 1);
    }
    double v[2] = {pass, fail};
    k3_dist_sum(d, v, 2, &err);
    if (rank == 0)
        printf("batch: %.0f passed, %.0f failed on %d ranks (%s)\n", v[0], v[1], k3_dist_size(d), ep ? "EP" : "DCP");
    k3_ctx_free(ref);
    k3_ctx_free(ctx);
    k3_model_close(m);
    k3_model_close(full);
    k3_dist_free(d);
    k3_dist_free(probe);
    return v[1] > 0;
}
