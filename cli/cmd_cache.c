/*
 * cmd_cache.c -- `k3 cache ls|clear DIR`: what a disk tier's directory
 * holds (files, bytes, the models that wrote them, how recently each was
 * used) and removing it, all of it or one model's (k3_kvcache_scan,
 * k3_kvcache_clear; the directory's layout: docs/kvstore.md).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static int usage_cache_to(FILE *out, int rc) {
    fprintf(out,
            "usage: k3 cache ls DIR [--json]\n"
            "       k3 cache clear DIR [--model ID]\n"
            "  ls       files, bytes and tokens by the model, quant mode and cache format that wrote them\n"
            "  clear    removes every cache file (or the files of model ID, 16 hex digits as ls prints it);\n"
            "           safe while instances use the directory\n");
    return rc;
}

static const char *human(double b, char *buf, size_t n) {
    if (b >= 1e12) snprintf(buf, n, "%.2f TB", b / 1e12);
    else if (b >= 1e9) snprintf(buf, n, "%.2f GB", b / 1e9);
    else if (b >= 1e6) snprintf(buf, n, "%.2f MB", b / 1e6);
    else if (b >= 1e3) snprintf(buf, n, "%.2f KB", b / 1e3);
    else snprintf(buf, n, "%.0f B", b);
    return buf;
}

static const char *kv_str(k3_kv_type kv) { return kv == K3_KV_C8 ? "c8" : "f32"; }

static int cache_ls(const char *dir, bool json) {
    k3_kvcache_info in;
    k3_error err = {0};
    if (k3_kvcache_scan(dir, &in, &err)) {
        fprintf(stderr, "k3 cache: %s\n", err.msg);
        return 1;
    }
    char a[32], b[32];
    if (json) {
        printf("{\"dir\": \"%s\", \"files\": %" PRId64 ", \"bytes\": %" PRId64 ", \"bad_files\": %" PRId64
               ", \"tmp_files\": %" PRId64 ", \"counter_bytes\": %" PRId64 ", \"models\": [",
               dir, in.files, in.bytes, in.bad_files, in.tmp_files, in.counter_bytes);
        for (int32_t i = 0; i < in.n_models; i++) {
            const k3_kvcache_model *m = &in.models[i];
            printf("%s{\"model\": \"%016" PRIx64 "\", \"quant\": \"%s\", \"kv\": \"%s\", \"block_size\": %d, "
                   "\"dcp_rank\": %d, \"dcp_size\": %d, \"runs\": %" PRId64 ", \"snapshots\": %" PRId64
                   ", \"run_bytes\": %" PRId64 ", \"snapshot_bytes\": %" PRId64 ", \"blocks\": %" PRId64
                   ", \"tokens\": %" PRId64 ", \"newest_s\": %.1f, \"oldest_s\": %.1f}",
                   i ? ", " : "", m->model, m->quant, kv_str(m->kv), m->block_size, m->dcp_rank, m->dcp_size, m->runs,
                   m->snaps, m->run_bytes, m->snap_bytes, m->blocks, m->blocks * m->block_size, m->newest_s,
                   m->oldest_s);
        }
        printf("]}\n");
    } else {
        printf("%s: %" PRId64 " files, %s", dir, in.files, human((double)in.bytes, a, sizeof a));
        if (in.counter_bytes >= 0) printf(" (shared counter: %s)", human((double)in.counter_bytes, b, sizeof b));
        printf("\n");
        for (int32_t i = 0; i < in.n_models; i++) {
            const k3_kvcache_model *m = &in.models[i];
            printf("model %016" PRIx64 " quant %s kv %s block %d dcp %d/%d: %" PRId64 " runs (%s, %" PRId64
                   " blocks, %" PRId64 " tokens), %" PRId64 " snapshots (%s); used %.0f s to %.0f s ago\n",
                   m->model, m->quant, kv_str(m->kv), m->block_size, m->dcp_rank, m->dcp_size, m->runs,
                   human((double)m->run_bytes, a, sizeof a), m->blocks, m->blocks * m->block_size, m->snaps,
                   human((double)m->snap_bytes, b, sizeof b), m->newest_s, m->oldest_s);
        }
        if (in.bad_files)
            printf("%" PRId64
                   " files (%s) are not k3 cache files or are damaged: misses; `k3 cache clear` removes them\n",
                   in.bad_files, human((double)in.bad_bytes, a, sizeof a));
        if (in.tmp_files)
            printf("%" PRId64 " files (%s) in tmp/: being written, or left by a crash\n", in.tmp_files,
                   human((double)in.tmp_bytes, a, sizeof a));
    }
    k3_kvcache_info_free(&in);
    return 0;
}

int k3_cmd_cache(int argc, char **argv) {
    if (argc >= 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) return usage_cache_to(stdout, 0);
    if (argc < 3) return usage_cache_to(stderr, 2);
    const char *op = argv[1], *dir = argv[2];
    bool json = false;
    uint64_t model = 0;
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--json") && !strcmp(op, "ls")) json = true;
        else if (!strcmp(argv[i], "--model") && i + 1 < argc && !strcmp(op, "clear")) {
            char *end = NULL;
            model = strtoull(argv[++i], &end, 16);
            if (!*argv[i] || *end || !model) {
                fprintf(stderr, "k3 cache: --model needs the 16 hex digits `k3 cache ls` prints, not '%s'\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "k3 cache: unknown option or missing value: %s\n", argv[i]);
            return usage_cache_to(stderr, 2);
        }
    }
    if (!strcmp(op, "ls")) return cache_ls(dir, json);
    if (strcmp(op, "clear")) {
        fprintf(stderr, "k3 cache: unknown operation '%s' (ls or clear)\n", op);
        return usage_cache_to(stderr, 2);
    }
    int64_t files = 0, bytes = 0;
    k3_error err = {0};
    if (k3_kvcache_clear(dir, model, &files, &bytes, &err)) {
        fprintf(stderr, "k3 cache: %s\n", err.msg);
        return 1;
    }
    char a[32];
    printf("%s: removed %" PRId64 " files (%s)\n", dir, files, human((double)bytes, a, sizeof a));
    return 0;
}
