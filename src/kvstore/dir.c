/*
 * dir.c -- a cache directory's files (format.h): the header checks, the
 * shared size counter, the eviction pass, and k3_kvcache_scan / _clear
 * (k3.h) for `k3 cache`.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "common/error.h"
#include "kvstore/format.h"
#include "kvstore/kvstore.h"

/* ---- headers ------------------------------------------------------------------- */

uint64_t k3_kvs_hdr_sum(const k3_kvs_hdr *h) {
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, h, offsetof(k3_kvs_hdr, hdr_sum));
    const uint64_t zero = 0;
    XXH3_64bits_update(&st, &zero, sizeof zero);
    XXH3_64bits_update(&st, (const char *)h + sizeof *h, (size_t)h->hdr_bytes - sizeof *h);
    return XXH3_64bits_digest(&st);
}

int k3_kvs_hdr_check(const k3_kvs_hdr *h, int64_t n_read, int64_t file_bytes, bool snap, char *why, size_t why_size) {
    if (n_read < (int64_t)sizeof *h) {
        snprintf(why, why_size, "torn: %lld bytes, shorter than a header", (long long)n_read);
        return n_read < 8 ? K3_KVS_MISS_TORN : memcmp(h->magic, "K3KV", 4) ? K3_KVS_MISS_FOREIGN : K3_KVS_MISS_TORN;
    }
    const char *magic = snap ? K3_KVS_MAGIC_SNAP : K3_KVS_MAGIC_RUN;
    if (memcmp(h->magic, magic, 8)) {
        snprintf(why, why_size, "not a k3 %s file (magic \"%.7s\")", snap ? "snapshot" : "block run",
                 memchr(h->magic, 0, 8) ? h->magic : "?");
        return K3_KVS_MISS_FOREIGN;
    }
    if (h->version != K3_KVS_VERSION) {
        snprintf(why, why_size, "format version %u, this build reads %d", h->version, K3_KVS_VERSION);
        return K3_KVS_MISS_FOREIGN;
    }
    const int32_t bs = h->id.block_size;
    const bool sane = bs >= 1 && bs <= K3_KVS_MAX_TOKENS_PER_RUN && h->id.block_bytes > 0 && h->id.state_bytes >= 0 &&
        (snap ? h->n_blocks == 0
              : h->n_blocks >= 1 && h->n_blocks <= K3_KVS_MAX_BLOCKS_PER_RUN &&
                 (int64_t)h->n_blocks * bs <= K3_KVS_MAX_TOKENS_PER_RUN);
    if (!sane || (int64_t)h->hdr_bytes != k3_kvs_hdr_bytes(h->n_blocks, bs, snap)) {
        snprintf(why, why_size, "damaged header (sizes out of range)");
        return K3_KVS_MISS_TORN;
    }
    if (n_read < (int64_t)h->hdr_bytes) {
        snprintf(why, why_size, "torn: %lld bytes, the header alone is %u", (long long)n_read, h->hdr_bytes);
        return K3_KVS_MISS_TORN;
    }
    if (k3_kvs_hdr_sum(h) != h->hdr_sum) {
        snprintf(why, why_size, "damaged header (checksum)");
        return K3_KVS_MISS_TORN;
    }
    const int64_t want =
        snap ? k3_kvs_stride(h->id.state_bytes) : (int64_t)h->n_blocks * k3_kvs_stride(h->id.block_bytes);
    if (h->payload_off != k3_kvs_payload_off(h->hdr_bytes) || h->payload_bytes != want) {
        snprintf(why, why_size, "damaged header (payload at %lld, %lld bytes)", (long long)h->payload_off,
                 (long long)h->payload_bytes);
        return K3_KVS_MISS_TORN;
    }
    if (file_bytes < h->payload_off + h->payload_bytes) {
        snprintf(why, why_size, "torn: %lld bytes, the header says %lld", (long long)file_bytes,
                 (long long)(h->payload_off + h->payload_bytes));
        return K3_KVS_MISS_TORN;
    }
    return K3_KVS_MISS_ABSENT;
}

static const char *kv_name(uint32_t kv) { return kv == K3_KV_F32 ? "f32" : kv == K3_KV_C8 ? "c8" : "?"; }

void k3_kvs_ident_str(const k3_kvs_ident *id, char *buf, size_t size) {
    snprintf(buf, size, "model %016llx quant %.*s kv %s block %d dcp %d/%d", (unsigned long long)id->model,
             K3_KVS_QUANT_LEN, id->quant, kv_name(id->kv), id->block_size, id->dcp_rank, id->dcp_size);
}

const char *k3_kvs_ident_diff(const k3_kvs_ident *a, const k3_kvs_ident *b) {
    if (a->model != b->model) return "another model";
    if (strncmp(a->quant, b->quant, K3_KVS_QUANT_LEN)) return "another quant mode";
    if (a->kv != b->kv) return "another cache dtype";
    if (a->block_size != b->block_size) return "another block size";
    if (a->dcp_rank != b->dcp_rank || a->dcp_size != b->dcp_size || a->dcp_il != b->dcp_il)
        return "another DCP rank or size";
    if (a->run_blocks != b->run_blocks || a->block_bytes != b->block_bytes || a->state_bytes != b->state_bytes ||
        a->layout != b->layout)
        return "another cache layout";
    return NULL;
}

void k3_kvs_key_hex(k3_kvs_key k, char out[33]) {
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)k.a, (unsigned long long)k.b);
}

/* ---- the shared counter ------------------------------------------------------------ */

k3_kvs_usage *k3_kvs_usage_map(const char *dir, k3_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/usage", dir);
    const int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        k3_err(err, K3_ERR_IO, "kv cache: cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) || (st.st_size < (off_t)sizeof(k3_kvs_usage) && ftruncate(fd, 4096))) {
        k3_err(err, K3_ERR_IO, "kv cache: cannot size %s: %s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        k3_err(err, K3_ERR_IO, "kv cache: cannot map %s: %s", path, strerror(errno));
        return NULL;
    }
    k3_kvs_usage *u = p;
    if (memcmp(u->magic, "K3KVUSE", 8)) {
        /* a new file (or a damaged one): the next pass over the directory sets the counts */
        memcpy(u->magic, "K3KVUSE", 8);
    }
    return u;
}

void k3_kvs_usage_unmap(k3_kvs_usage *u) {
    if (u) munmap(u, 4096);
}

/* ---- listing ----------------------------------------------------------------------- */

typedef struct entry {
    char name[48];
    bool snap;
    int64_t bytes;
    int64_t mtime_ns;
} entry;

typedef struct listing {
    entry *e;
    int64_t n, cap;
} listing;

static int64_t ts_ns(struct timespec t) { return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec; }

static int64_t unix_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return ts_ns(t);
}

/* Files named like a cache file (32 hex digits and the suffix) in dir/sub. */
static k3_status list_sub(const char *dir, const char *sub, bool snap, listing *l, k3_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, sub);
    DIR *d = opendir(path);
    if (!d) {
        if (errno == ENOENT) return K3_OK;
        return k3_err(err, K3_ERR_IO, "kv cache: cannot list %s: %s", path, strerror(errno));
    }
    const int dfd = dirfd(d);
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.' || strlen(de->d_name) >= sizeof l->e[0].name) continue;
        struct stat st;
        if (fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISREG(st.st_mode)) continue;
        if (l->n == l->cap) {
            const int64_t cap = l->cap ? 2 * l->cap : 256;
            entry *e = realloc(l->e, sizeof *e * (size_t)cap);
            if (!e) {
                closedir(d);
                return k3_err(err, K3_ERR_NOMEM, "kv cache: out of memory listing %s", path);
            }
            l->e = e;
            l->cap = cap;
        }
        entry *e = &l->e[l->n++];
        snprintf(e->name, sizeof e->name, "%s", de->d_name);
        e->snap = snap;
        e->bytes = (int64_t)st.st_size;
        e->mtime_ns = ts_ns(st.st_mtim);
    }
    closedir(d);
    return K3_OK;
}

static int by_mtime(const void *a, const void *b) {
    const entry *x = a, *y = b;
    return x->mtime_ns < y->mtime_ns ? -1 : x->mtime_ns > y->mtime_ns;
}

/* Removes tmp/ files older than stale_s; returns how many. */
static int64_t clean_tmp(const char *dir, double stale_s) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tmp", dir);
    DIR *d = opendir(path);
    if (!d) return 0;
    const int dfd = dirfd(d);
    const int64_t now = unix_now_ns();
    int64_t n = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        struct stat st;
        if (fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISREG(st.st_mode)) continue;
        if ((double)(now - ts_ns(st.st_mtim)) * 1e-9 >= stale_s && !unlinkat(dfd, de->d_name, 0)) n++;
    }
    closedir(d);
    return n;
}

static int lock_dir(const char *dir, bool wait, k3_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/lock", dir);
    const int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        k3_err(err, K3_ERR_IO, "kv cache: cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    if (flock(fd, LOCK_EX | (wait ? 0 : LOCK_NB))) {
        const int e = errno;
        close(fd);
        if (e == EWOULDBLOCK) return -2;
        k3_err(err, K3_ERR_IO, "kv cache: cannot lock %s: %s", path, strerror(e));
        return -1;
    }
    return fd;
}

static k3_kvs_hdr *read_hdr(int fd, int64_t file_bytes, int64_t *n_read);

/* Tells removed of the run file at path, from its header (read before the unlink). */
static void tell_removed(const char *path, int64_t bytes, k3_kvs_removed_fn removed, void *arg) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return;
    int64_t n_read = 0;
    k3_kvs_hdr *h = read_hdr(fd, bytes, &n_read);
    close(fd);
    char why[160];
    if (h && k3_kvs_hdr_check(h, n_read, bytes, false, why, sizeof why) == K3_KVS_MISS_ABSENT) removed(arg, h);
    free(h);
}

k3_status k3_kvs_dir_evict(const char *dir, k3_kvs_usage *u, int64_t target, double stale_s, bool wait,
                           k3_kvs_removed_fn removed, void *arg, k3_kvs_evict_result *out, k3_error *err) {
    memset(out, 0, sizeof *out);
    const int lk = lock_dir(dir, wait, err);
    if (lk == -2) return K3_OK; /* another process is at it */
    if (lk < 0) return K3_ERR_IO;
    out->ran = true;
    const int64_t counted = u ? __atomic_load_n(&u->bytes, __ATOMIC_RELAXED) : 0;
    listing l = {0};
    k3_status st = list_sub(dir, "runs", false, &l, err);
    if (!st) st = list_sub(dir, "snaps", true, &l, err);
    if (st) {
        free(l.e);
        close(lk);
        return st;
    }
    out->stale_tmp = clean_tmp(dir, stale_s);
    int64_t total = 0;
    for (int64_t i = 0; i < l.n; i++) total += l.e[i].bytes;
    out->bytes_before = total;
    out->files_before = l.n;
    int64_t files = l.n;
    if (target >= 0 && total > target) {
        qsort(l.e, (size_t)l.n, sizeof *l.e, by_mtime);
        char path[4096];
        for (int64_t i = 0; i < l.n && total > target; i++) {
            snprintf(path, sizeof path, "%s/%s/%s", dir, l.e[i].snap ? "snaps" : "runs", l.e[i].name);
            if (removed && !l.e[i].snap) tell_removed(path, l.e[i].bytes, removed, arg);
            if (unlink(path)) continue; /* gone already */
            total -= l.e[i].bytes;
            files--;
            out->evicted_files++;
            out->evicted_bytes += l.e[i].bytes;
        }
    }
    out->bytes_after = total;
    out->files_after = files;
    if (u) {
        /* what was published while the pass listed stays counted */
        __atomic_add_fetch(&u->bytes, total - counted, __ATOMIC_RELAXED);
        __atomic_store_n(&u->files, files, __ATOMIC_RELAXED);
        __atomic_add_fetch(&u->scans, 1, __ATOMIC_RELAXED);
        if (__atomic_load_n(&u->bytes, __ATOMIC_RELAXED) < 0) __atomic_store_n(&u->bytes, total, __ATOMIC_RELAXED);
    }
    free(l.e);
    close(lk);
    return K3_OK;
}

/* ---- k3 cache ls / clear ------------------------------------------------------------ */

/* Reads the header (and its arrays) of an open file into a malloc'd buffer. */
static k3_kvs_hdr *read_hdr(int fd, int64_t file_bytes, int64_t *n_read) {
    int64_t want = (int64_t)sizeof(k3_kvs_hdr);
    k3_kvs_hdr *h = calloc(1, (size_t)want);
    if (!h) return NULL;
    ssize_t r = pread(fd, h, (size_t)want, 0);
    *n_read = r < 0 ? 0 : r;
    if (r == want && h->hdr_bytes > sizeof *h && (int64_t)h->hdr_bytes <= file_bytes && h->hdr_bytes <= (8u << 20)) {
        k3_kvs_hdr *g = realloc(h, h->hdr_bytes);
        if (!g) {
            free(h);
            return NULL;
        }
        h = g;
        r = pread(fd, h, h->hdr_bytes, 0);
        *n_read = r < 0 ? 0 : r;
    }
    return h;
}

static bool is_dir(const char *path) {
    struct stat st;
    return !stat(path, &st) && S_ISDIR(st.st_mode);
}

static k3_status check_cache_dir(const char *dir, k3_error *err) {
    char a[4096], b[4096];
    snprintf(a, sizeof a, "%s/runs", dir);
    snprintf(b, sizeof b, "%s/snaps", dir);
    if (!is_dir(dir)) return k3_err(err, K3_ERR_IO, "kv cache: %s: %s", dir, strerror(errno ? errno : ENOTDIR));
    if (!is_dir(a) && !is_dir(b))
        return k3_err(err, K3_ERR_IO, "kv cache: %s is not a cache directory (no runs/ or snaps/)", dir);
    return K3_OK;
}

static int by_bytes(const void *a, const void *b) {
    const k3_kvcache_model *x = a, *y = b;
    const int64_t bx = x->run_bytes + x->snap_bytes, by = y->run_bytes + y->snap_bytes;
    return bx > by ? -1 : bx < by;
}

k3_status k3_kvcache_scan(const char *dir, k3_kvcache_info *out, k3_error *err) {
    memset(out, 0, sizeof *out);
    out->counter_bytes = -1;
    K3_TRY(check_cache_dir(dir, err));
    listing l = {0};
    k3_status st = list_sub(dir, "runs", false, &l, err);
    if (!st) st = list_sub(dir, "snaps", true, &l, err);
    if (st) {
        free(l.e);
        return st;
    }
    const int64_t now = unix_now_ns();
    int32_t cap = 0;
    char path[4096];
    for (int64_t i = 0; i < l.n; i++) {
        const entry *e = &l.e[i];
        out->files++;
        out->bytes += e->bytes;
        snprintf(path, sizeof path, "%s/%s/%s", dir, e->snap ? "snaps" : "runs", e->name);
        const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
        int64_t n_read = 0;
        k3_kvs_hdr *h = fd >= 0 ? read_hdr(fd, e->bytes, &n_read) : NULL;
        if (fd >= 0) close(fd);
        char why[160];
        if (!h || k3_kvs_hdr_check(h, n_read, e->bytes, e->snap, why, sizeof why) != K3_KVS_MISS_ABSENT) {
            out->bad_files++;
            out->bad_bytes += e->bytes;
            free(h);
            continue;
        }
        k3_kvcache_model *m = NULL;
        for (int32_t k = 0; k < out->n_models && !m; k++) {
            k3_kvcache_model *x = &out->models[k];
            if (x->model == h->id.model && !strncmp(x->quant, h->id.quant, sizeof x->quant) &&
                x->kv == (k3_kv_type)h->id.kv && x->block_size == h->id.block_size && x->dcp_rank == h->id.dcp_rank &&
                x->dcp_size == h->id.dcp_size)
                m = x;
        }
        if (!m) {
            if (out->n_models == cap) {
                cap = cap ? 2 * cap : 8;
                k3_kvcache_model *g = realloc(out->models, sizeof *g * (size_t)cap);
                if (!g) {
                    free(h);
                    free(l.e);
                    k3_kvcache_info_free(out);
                    return k3_err(err, K3_ERR_NOMEM, "kv cache: out of memory");
                }
                out->models = g;
            }
            m = &out->models[out->n_models++];
            memset(m, 0, sizeof *m);
            m->model = h->id.model;
            memcpy(m->quant, h->id.quant, sizeof m->quant);
            m->quant[sizeof m->quant - 1] = 0;
            m->kv = (k3_kv_type)h->id.kv;
            m->block_size = h->id.block_size;
            m->dcp_rank = h->id.dcp_rank;
            m->dcp_size = h->id.dcp_size;
            m->newest_s = 1e300;
        }
        const double age = (double)(now - e->mtime_ns) * 1e-9;
        if (age < m->newest_s) m->newest_s = age;
        if (age > m->oldest_s) m->oldest_s = age;
        if (e->snap) {
            m->snaps++;
            m->snap_bytes += e->bytes;
        } else {
            m->runs++;
            m->run_bytes += e->bytes;
            m->blocks += h->n_blocks;
        }
        free(h);
    }
    free(l.e);
    for (int32_t k = 0; k < out->n_models; k++)
        if (out->models[k].newest_s > 1e299) out->models[k].newest_s = 0;
    qsort(out->models, (size_t)out->n_models, sizeof *out->models, by_bytes);
    snprintf(path, sizeof path, "%s/tmp", dir);
    DIR *d = opendir(path);
    if (d) {
        struct dirent *de;
        while ((de = readdir(d))) {
            struct stat sb;
            if (de->d_name[0] == '.' || fstatat(dirfd(d), de->d_name, &sb, AT_SYMLINK_NOFOLLOW) || !S_ISREG(sb.st_mode))
                continue;
            out->tmp_files++;
            out->tmp_bytes += sb.st_size;
        }
        closedir(d);
    }
    snprintf(path, sizeof path, "%s/usage", dir);
    const int ufd = open(path, O_RDONLY | O_CLOEXEC);
    if (ufd >= 0) {
        k3_kvs_usage u;
        if (pread(ufd, &u, sizeof u, 0) == (ssize_t)sizeof u && !memcmp(u.magic, "K3KVUSE", 8))
            out->counter_bytes = u.bytes;
        close(ufd);
    }
    return K3_OK;
}

void k3_kvcache_info_free(k3_kvcache_info *info) {
    free(info->models);
    memset(info, 0, sizeof *info);
}

k3_status k3_kvcache_clear(const char *dir, uint64_t model, int64_t *files, int64_t *bytes, k3_error *err) {
    if (files) *files = 0;
    if (bytes) *bytes = 0;
    K3_TRY(check_cache_dir(dir, err));
    k3_kvs_usage *u = k3_kvs_usage_map(dir, err);
    if (!u) return K3_ERR_IO;
    k3_status st = K3_OK;
    if (!model) {
        k3_kvs_evict_result r;
        st = k3_kvs_dir_evict(dir, u, 0, 60, true, NULL, NULL, &r, err);
        if (!st && files) *files = r.evicted_files;
        if (!st && bytes) *bytes = r.evicted_bytes;
    } else {
        const int lk = lock_dir(dir, true, err);
        if (lk < 0) {
            k3_kvs_usage_unmap(u);
            return K3_ERR_IO;
        }
        listing l = {0};
        st = list_sub(dir, "runs", false, &l, err);
        if (!st) st = list_sub(dir, "snaps", true, &l, err);
        char path[4096];
        for (int64_t i = 0; !st && i < l.n; i++) {
            snprintf(path, sizeof path, "%s/%s/%s", dir, l.e[i].snap ? "snaps" : "runs", l.e[i].name);
            const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
            if (fd < 0) continue;
            k3_kvs_hdr h;
            const bool mine =
                pread(fd, &h, sizeof h, 0) == (ssize_t)sizeof h && !memcmp(h.magic, "K3KV", 4) && h.id.model == model;
            close(fd);
            if (mine && !unlink(path)) {
                __atomic_sub_fetch(&u->bytes, l.e[i].bytes, __ATOMIC_RELAXED);
                __atomic_sub_fetch(&u->files, 1, __ATOMIC_RELAXED);
                if (files) (*files)++;
                if (bytes) *bytes += l.e[i].bytes;
            }
        }
        free(l.e);
        close(lk);
    }
    k3_kvs_usage_unmap(u);
    return st;
}
