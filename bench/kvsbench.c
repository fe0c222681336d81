/*
 * kvsbench.c -- the disk tier's speed at module level: a sequence of cache
 * blocks (random bytes in a context of MODEL's layout) saved as block runs
 * and a KDA snapshot, then looked up and loaded back, from the page cache
 * (warm) and after its pages were dropped (cold: fdatasync + fadvise
 * DONTNEED on the directory's files), beside a plain sequential read of a
 * file of the same size in the same directory with 1 MiB read() calls (the
 * directory's raw speed, as dd bs=1M reads it). Prints the medians of RUNS.
 * With `fresh` the loads go into memory never touched before (a new
 * context's blocks and a new state buffer each time), as in a server that
 * just started: the page faults and the kernel's zeroing of each page are
 * part of the load then.
 * With `buffered` the store never uses O_DIRECT (else it does where the
 * directory's filesystem allows; then "warm" reads the disk again too). The
 * CPU time of the process (user, system) per GB loaded and saved is printed:
 * the main thread waits, so it is the reader's and the writer's.
 *   build/kvsbench MODEL DIR [f32|c8] [TOKENS] [RUNS] [fresh] [buffered]
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ctx/ctx.h"
#include "k3.h"
#include "kvstore/kvstore.h"

static double cpu_s(bool sys) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    const struct timeval t = sys ? ru.ru_stime : ru.ru_utime;
    return (double)t.tv_sec + (double)t.tv_usec * 1e-6;
}

static int cmpd(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmpd);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* fdatasync + DONTNEED on every file under dir/sub */
static void drop_pages(const char *dir, const char *sub) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, sub);
    DIR *d = opendir(p);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        const int fd = openat(dirfd(d), de->d_name, O_RDONLY);
        if (fd < 0) continue;
        fdatasync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
    }
    closedir(d);
}

static double raw_read(const char *path, int64_t bytes, bool cold) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    if (cold) {
        fdatasync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    }
    char *buf = malloc(1 << 20);
    const double t0 = k3_now();
    int64_t got = 0;
    ssize_t r;
    while ((r = read(fd, buf, 1 << 20)) > 0) got += r;
    const double dt = k3_now() - t0;
    free(buf);
    close(fd);
    return got == bytes ? (double)got / dt / 1e9 : 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: kvsbench MODEL DIR [f32|c8] [TOKENS] [RUNS]\n");
        return 2;
    }
    const char *dir = argv[2];
    const k3_kv_type kv = argc > 3 && !strcmp(argv[3], "f32") ? K3_KV_F32 : K3_KV_C8;
    const int64_t tokens = argc > 4 ? atoll(argv[4]) : 32768;
    const int runs = argc > 5 ? atoi(argv[5]) : 5;
    bool fresh = false, buffered = false;
    for (int i = 6; i < argc; i++) {
        fresh |= !strcmp(argv[i], "fresh");
        buffered |= !strcmp(argv[i], "buffered");
    }
    const int32_t bs = 64, nb = (int32_t)(tokens / bs);
    k3_error err = {0};
    k3_model *m = NULL;
    k3_ctx *ctx = NULL;
    k3_ctx_options o = {.max_seqs = 1, .cache_tokens = tokens, .block_size = bs, .max_batch = 64, .kv_cache = kv};
    if (k3_model_open(&m, argv[1], &err) || k3_ctx_init_pool(&ctx, m, &o, nb, tokens, &err)) {
        fprintf(stderr, "kvsbench: %s\n", err.msg);
        return 1;
    }
    /* random cache bytes (every page touched) */
    uint64_t x = 88172645463325252ull;
    for (int32_t L = 0; L < ctx->c->n_layers; L++)
        for (int32_t b = 0; b < nb; b++) {
            void *base[5];
            int64_t len[5];
            const int nc = k3_ctx_kv_block_ranges(ctx, L, b, base, len);
            for (int c = 0; c < nc; c++)
                for (int64_t i = 0; i + 8 <= len[c]; i += 8) {
                    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                    memcpy((char *)base[c] + i, &x, 8);
                }
        }
    const int64_t sb = k3_ctx_state_bytes(ctx);
    const size_t sb_pages = ((size_t)sb + 4095) / 4096 * 4096; /* on a page, as the engine's */
    char *state = aligned_alloc(4096, sb_pages), *back = aligned_alloc(4096, sb_pages);
    memset(state, 7, (size_t)sb);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)tokens), *blocks = malloc(sizeof(int32_t) * (size_t)nb);
    double wr[32], rc[32], rw[32], dc[32], dw[32], cpu_w[2] = {0, 0}, cpu_rc[2] = {0, 0};
    int64_t bytes_rc = 0, bytes_w = 0;
    const char *io = "?", *io_why = "";
    int64_t bytes = 0;
    for (int run = 0; run < runs && run < 32; run++) {
        for (int64_t i = 0; i < tokens; i++) tok[i] = (int32_t)((i * 2654435761u + (uint64_t)run * 97) % 30000);
        for (int32_t i = 0; i < nb; i++) blocks[i] = i;
        k3_kvs *s = NULL;
        k3_kvs_options so =
            {.dir = dir, .disk_bytes = 64ll << 30, .ctx = ctx, .model_id = 1, .quant = "none", .buffered = buffered};
        if (k3_kvs_open(&s, &so, &err)) {
            fprintf(stderr, "kvsbench: %s\n", err.msg);
            return 1;
        }
        io = k3_kvs_io(s, &io_why);
        const k3_kvs_seq seq = {.tokens = tok, .n_tokens = tokens};
        uint64_t t1, t2;
        k3_kvs_done d1, d2;
        const double u0 = cpu_s(false), s0 = cpu_s(true);
        double t0 = k3_now();
        if (k3_kvs_save_blocks(s, &seq, blocks, nb, true, 0, &t1, &err) ||
            k3_kvs_save_snapshot(s, &seq, (int64_t)(nb - 1) * bs, state, 0, 0, &t2, &err) ||
            k3_kvs_wait(s, t1, &d1, &err) || k3_kvs_wait(s, t2, &d2, &err) || d1.status || d2.status) {
            fprintf(stderr, "kvsbench: save: %s %s\n", err.msg, d1.why);
            return 1;
        }
        const double tw = k3_now() - t0;
        bytes = d1.bytes + d2.bytes;
        cpu_w[0] += cpu_s(false) - u0;
        cpu_w[1] += cpu_s(true) - s0;
        bytes_w += bytes;
        wr[run] = (double)bytes / tw / 1e9;
        for (int pass = 0; pass < 2; pass++) {
            if (!pass) {
                drop_pages(dir, "runs");
                drop_pages(dir, "snaps");
            }
            k3_kvs *ls = s;
            k3_ctx *lctx = NULL;
            char *lback = back;
            if (fresh) { /* a store over a new context: its blocks' pages untouched */
                k3_kvs_options lo = so;
                if (k3_ctx_init_pool(&lctx, m, &o, nb, tokens, &err) || !(lo.ctx = lctx, lback = malloc((size_t)sb)) ||
                    k3_kvs_open(&ls, &lo, &err)) {
                    fprintf(stderr, "kvsbench: %s\n", err.msg);
                    return 1;
                }
            }
            k3_kvs_hit *hit = NULL;
            const double u1 = cpu_s(false), s1 = cpu_s(true);
            t0 = k3_now();
            uint64_t t3;
            k3_kvs_done d3;
            if (k3_kvs_lookup(ls, &seq, 0, tokens - 1, &hit, &err) || !hit ||
                k3_kvs_load(ls, hit, blocks, lback, &t3, &err) || k3_kvs_wait(ls, t3, &d3, &err) || d3.status) {
                fprintf(stderr, "kvsbench: load: %s %s\n", err.msg, d3.why);
                return 1;
            }
            const double tr = k3_now() - t0;
            (pass ? rw : rc)[run] = (double)d3.bytes / tr / 1e9;
            if (!pass) {
                cpu_rc[0] += cpu_s(false) - u1;
                cpu_rc[1] += cpu_s(true) - s1;
                bytes_rc += d3.bytes;
            }
            if (fresh) {
                k3_kvs_close(ls);
                k3_ctx_free(lctx);
                free(lback);
            }
        }
        /* the raw sequential read of a file of the same size beside it */
        char raw[4096];
        snprintf(raw, sizeof raw, "%s/raw.bin", dir);
        FILE *f = fopen(raw, "wb");
        char *buf = malloc(1 << 20);
        memset(buf, 1, 1 << 20);
        for (int64_t w = 0; w < bytes; w += 1 << 20)
            fwrite(buf, 1, (size_t)(bytes - w < (1 << 20) ? bytes - w : 1 << 20), f);
        fclose(f);
        free(buf);
        dc[run] = raw_read(raw, bytes, true);
        dw[run] = raw_read(raw, bytes, false);
        unlink(raw);
        k3_kvs_close(s);
        int64_t nf, nbytes;
        k3_kvcache_clear(dir, 0, &nf, &nbytes, &err);
    }
    const int n = runs < 32 ? runs : 32;
    const double mwr = median(wr, n), mrc = median(rc, n), mrw = median(rw, n), mdc = median(dc, n),
                 mdw = median(dw, n);
    printf("kvsbench: %s kv %s, %lld tokens (%d blocks of %d), %.1f MB per save (runs + one %.1f MB snapshot), "
           "medians of %d%s\n",
           argv[1], kv == K3_KV_C8 ? "c8" : "f32", (long long)tokens, nb, bs, (double)bytes / 1e6, (double)sb / 1e6, n,
           fresh ? ", loads into untouched memory" : "");
    printf("  I/O: %s (%s)\n", io, io_why);
    printf("  save (write, published)        %6.2f GB/s   CPU per GB: user %.3f s, system %.3f s\n", mwr,
           cpu_w[0] / ((double)bytes_w / 1e9), cpu_w[1] / ((double)bytes_w / 1e9));
    printf("  load cold: CPU per GB          user %.3f s, system %.3f s\n", cpu_rc[0] / ((double)bytes_rc / 1e9),
           cpu_rc[1] / ((double)bytes_rc / 1e9));
    printf("  load cold (pages dropped)      %6.2f GB/s   raw sequential read cold  %6.2f GB/s   ratio %.2f\n", mrc,
           mdc, mrc / mdc);
    printf("  load warm (page cache)         %6.2f GB/s   raw sequential read warm  %6.2f GB/s   ratio %.2f\n", mrw,
           mdw, mrw / mdw);
    free(state);
    free(back);
    free(tok);
    free(blocks);
    k3_ctx_free(ctx);
    k3_model_close(m);
    return 0;
}
