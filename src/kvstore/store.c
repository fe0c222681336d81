/*
 * store.c -- the disk tier (kvstore.h): keys, lookups, the reader and the
 * writer threads, files written and read in place from a context's cache
 * blocks, the budget, the metrics. The directory's files are format.h's.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "common/clock.h"
#include "common/error.h"
#include "ctx/ctx.h"
#include "kv/kv.h"
#include "kvstore/format.h"
#include "kvstore/kvstore.h"

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

const char *const k3_kvs_miss_names[K3_KVS_MISS_REASONS] = {"absent", "foreign",  "model", "torn",
                                                            "tokens", "checksum", "io"};
const double k3_kvs_hist_le[K3_KVS_HIST_BUCKETS] = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                                                    0.2,   0.5,   1,     2,    5,    10,   60};
/* vLLM's transfer size buckets, 10 of them, then 500 MB, 1, 2, 5 GB */
const double k3_kvs_size_le[K3_KVS_HIST_BUCKETS] = {1e6,   5e6,   10e6,  20e6, 40e6, 60e6, 80e6,
                                                    100e6, 150e6, 200e6, 5e8,  1e9,  2e9,  5e9};

enum { RD = 0, WR = 1 }; /* the two threads */

/* ---- a run or snapshot a lookup found ------------------------------------------------ */

typedef struct found {
    int fd;
    bool snap;
    int64_t first, n; /* blocks of the sequence it holds */
    int64_t payload_off;
    int64_t junction; /* snapshot: its header's */
    uint64_t *sums;   /* [n] (snapshot: [1]) */
    char name[48];
} found;

struct k3_kvs_hit {
    int64_t n_local, n_tokens; /* blocks' tokens: from n_local to n_tokens */
    int64_t chain_tokens;      /* the blocks on disk reach this far */
    found *runs;
    int32_t n_runs;
    found snap;
};

typedef struct job {
    struct job *next;
    uint64_t ticket;
    k3_kvs_op op;
    bool cancelled;
    /* load */
    k3_kvs_hit *hit;
    int32_t *blocks;
    void *state;
    /* saves */
    int32_t *tokens;
    uint64_t *extra, *hashes;
    int64_t n_tokens;
    uint64_t salt;
    int32_t n_full;
    bool final;
    int64_t pos, drop_pos, junction, keep;
    const void *src;
} job;

/* the snapshot keys the directory holds (a listing of snaps/) */
typedef struct keyset {
    k3_kvs_key *k;
    uint8_t *used;
    uint32_t mask;
    int64_t n;
} keyset;

struct k3_kvs {
    k3_kvs_options o;
    char *dir;
    k3_ctx *ctx;
    k3_kvs_ident id;
    uint64_t ns;
    int32_t bs, R, n_attn, max_iov;
    int32_t *attn; /* [n_attn] the MLA/DSA layers */
    k3_kvs_usage *usage;
    int runs_fd, snaps_fd, tmp_fd;
    /* jobs */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    job *head[2], *tail[2];
    int32_t queued[2];
    job *running[2];
    k3_kvs_done *done;
    int32_t n_done, cap_done;
    uint64_t next_ticket;
    bool stop;
    pthread_t th[2];
    bool th_started[2];
    /* snapshot listing */
    pthread_mutex_t snap_mu;
    keyset snaps;
    struct timespec snaps_mtime;
    int64_t snaps_listed_ns;
    /* metrics */
    pthread_mutex_t mm;
    k3_kvs_metrics m;
    uint64_t tmp_seq;
    /* direct I/O: O_DIRECT reads and writes of the payloads where the
     * directory's filesystem does it (statx's alignments), else buffered */
    bool direct;
    int32_t mem_align, off_align;
    char io_why[160];
};

/* ---- small helpers ---------------------------------------------------------------- */

static void say(k3_kvs *s, const char *fmt, ...) K3_PRINTF(2, 3);
static void say(k3_kvs *s, const char *fmt, ...) {
    if (!s->o.log) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    s->o.log(s->o.log_arg, line);
}

static void count_miss(k3_kvs *s, int reason) {
    pthread_mutex_lock(&s->mm);
    s->m.misses[reason]++;
    pthread_mutex_unlock(&s->mm);
}

static void hist_add_le(k3_kvs_hist *h, const double *le, double v) {
    int b = 0;
    while (b < K3_KVS_HIST_BUCKETS && v > le[b]) b++;
    h->count[b]++;
    h->sum += v;
    h->n++;
}

static int64_t unix_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* ---- keys -------------------------------------------------------------------------- */

/* The chain keys of blocks [0, n) of seq: two lanes of src/kv's chain from
 * seeds of the namespace and the salt. */
static void chain_keys(const k3_kvs *s, const int32_t *tokens, const uint64_t *extra, uint64_t salt, int64_t n,
                       k3_kvs_key *out) {
    uint64_t a = k3_kv_hash_block(s->ns, salt, NULL, 0),
             b = k3_kv_hash_block(~s->ns, salt ^ 0x5851F42D4C957F2Dull, NULL, 0);
    for (int64_t i = 0; i < n; i++) {
        const uint64_t x = extra ? extra[i] : 0;
        a = k3_kv_hash_block(a, x, tokens + i * s->bs, s->bs);
        b = k3_kv_hash_block(b ^ 0xD6E8FEB86659FD93ull, x, tokens + i * s->bs, s->bs);
        out[i] = (k3_kvs_key){a, b};
    }
}

static k3_kvs_key seed_key(const k3_kvs *s, uint64_t salt) {
    return (k3_kvs_key){k3_kv_hash_block(s->ns, salt, NULL, 0),
                        k3_kv_hash_block(~s->ns, salt ^ 0x5851F42D4C957F2Dull, NULL, 0)};
}

static bool key_eq(k3_kvs_key x, k3_kvs_key y) { return x.a == y.a && x.b == y.b; }

static void file_name(k3_kvs_key k, bool snap, char out[48]) {
    char hex[33];
    k3_kvs_key_hex(k, hex);
    snprintf(out, 48, "%s.%s", hex, snap ? "snap" : "run");
}

void k3_kvs_path(const k3_kvs *s, const k3_kvs_seq *seq, int64_t end_block, bool snap, char *buf, size_t size) {
    if (end_block < 1 || end_block * s->bs > seq->n_tokens) {
        snprintf(buf, size, "%s", "");
        return;
    }
    k3_kvs_key *k = malloc(sizeof *k * (size_t)end_block);
    if (!k) {
        snprintf(buf, size, "%s", "");
        return;
    }
    chain_keys(s, seq->tokens, seq->extra, seq->salt, end_block, k);
    char name[48];
    file_name(k[end_block - 1], snap, name);
    snprintf(buf, size, "%s/%s/%s", s->dir, snap ? "snaps" : "runs", name);
    free(k);
}

/* ---- the snapshot listing ------------------------------------------------------------- */

static uint32_t key_slot(k3_kvs_key k, uint32_t mask) { return (uint32_t)(k.a ^ (k.b >> 17)) & mask; }

static bool keyset_has(const keyset *ks, k3_kvs_key k) {
    if (!ks->mask) return false;
    for (uint32_t i = key_slot(k, ks->mask);; i = (i + 1) & ks->mask) {
        if (!ks->used[i]) return false;
        if (key_eq(ks->k[i], k)) return true;
    }
}

static bool keyset_add(keyset *ks, k3_kvs_key k) {
    if ((ks->n + 1) * 2 > (int64_t)ks->mask + 1) {
        const uint32_t nm = ks->mask ? ks->mask * 2 + 1 : 255;
        keyset g = {calloc((size_t)nm + 1, sizeof *g.k), calloc((size_t)nm + 1, 1), nm, 0};
        if (!g.k || !g.used) {
            free(g.k);
            free(g.used);
            return false;
        }
        for (uint32_t i = 0; ks->mask && i <= ks->mask; i++)
            if (ks->used[i]) keyset_add(&g, ks->k[i]);
        free(ks->k);
        free(ks->used);
        *ks = g;
    }
    uint32_t i = key_slot(k, ks->mask);
    while (ks->used[i]) {
        if (key_eq(ks->k[i], k)) return true;
        i = (i + 1) & ks->mask;
    }
    ks->used[i] = 1;
    ks->k[i] = k;
    ks->n++;
    return true;
}

static int hexval(char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; }

static bool parse_key(const char *name, k3_kvs_key *k) {
    uint64_t v[2] = {0, 0};
    for (int i = 0; i < 32; i++) {
        const int h = hexval(name[i]);
        if (h < 0) return false;
        v[i / 16] = v[i / 16] << 4 | (uint64_t)h;
    }
    if (strcmp(name + 32, ".snap")) return false;
    *k = (k3_kvs_key){v[0], v[1]};
    return true;
}

/* Re-lists snaps/ when it changed (its mtime) or the listing is over a
 * second old (a change within the mtime's granularity). Under snap_mu. */
static void snaps_refresh(k3_kvs *s) {
    struct stat st;
    const int64_t now = k3_now_ns();
    if (fstat(s->snaps_fd, &st)) return;
    if (s->snaps_listed_ns && st.st_mtim.tv_sec == s->snaps_mtime.tv_sec &&
        st.st_mtim.tv_nsec == s->snaps_mtime.tv_nsec && now - s->snaps_listed_ns < 1000000000)
        return;
    const int fd = dup(s->snaps_fd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0) close(fd);
        return;
    }
    rewinddir(d);
    keyset ks = {0};
    struct dirent *de;
    bool ok = true;
    while (ok && (de = readdir(d))) {
        k3_kvs_key k;
        if (strlen(de->d_name) == 37 && parse_key(de->d_name, &k)) ok = keyset_add(&ks, k);
    }
    closedir(d);
    if (!ok) {
        free(ks.k);
        free(ks.used);
        return;
    }
    free(s->snaps.k);
    free(s->snaps.used);
    s->snaps = ks;
    s->snaps_mtime = st.st_mtim;
    s->snaps_listed_ns = now;
}

/* ---- opening a file a lookup names ----------------------------------------------------- */

static void found_close(found *f) {
    if (f->fd >= 0) close(f->fd);
    free(f->sums);
    f->fd = -1;
    f->sums = NULL;
}

/* Opens and checks a run (expected blocks [first, first + n), with tokens
 * and chain as given) or a snapshot at boundary end; false when it is
 * absent or refused (counted, logged). */
static bool open_checked(k3_kvs *s, k3_kvs_key key, bool snap, int64_t first, int64_t n, k3_kvs_key parent,
                         const int32_t *tokens, const uint64_t *extra, found *out) {
    char name[48];
    file_name(key, snap, name);
    memset(out, 0, sizeof *out);
    out->fd = -1;
    const int fd = openat(snap ? s->snaps_fd : s->runs_fd, name, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return false;
    struct stat st;
    const int64_t hb = k3_kvs_hdr_bytes(snap ? 0 : (int32_t)n, s->bs, snap);
    k3_kvs_hdr *h = malloc((size_t)hb);
    char why[400];
    int reason = K3_KVS_MISS_IO;
    snprintf(why, sizeof why, "unreadable");
    if (h && !fstat(fd, &st) && S_ISREG(st.st_mode)) {
        const ssize_t r = pread(fd, h, (size_t)hb, 0);
        reason = k3_kvs_hdr_check(h, r < 0 ? 0 : r, (int64_t)st.st_size, snap, why, sizeof why);
        if (reason == K3_KVS_MISS_ABSENT) {
            const char *d = k3_kvs_ident_diff(&h->id, &s->id);
            if (d) {
                char theirs[160], ours[160];
                k3_kvs_ident_str(&h->id, theirs, sizeof theirs);
                k3_kvs_ident_str(&s->id, ours, sizeof ours);
                snprintf(why, sizeof why, "%s: written for %s, this is %s", d, theirs, ours);
                reason = K3_KVS_MISS_MODEL;
            } else if (!key_eq(h->key, key) ||
                       (!snap && (!key_eq(h->parent, parent) || h->first_block != first || h->n_blocks != n)) ||
                       h->pos != (snap ? first : first + n) * s->bs) {
                snprintf(why, sizeof why, "its chain or place differs from the request's");
                reason = K3_KVS_MISS_TOKENS;
            } else if (!snap) {
                const int32_t *ht = k3_kvs_hdr_tokens(h);
                const uint64_t *hx = k3_kvs_hdr_extra(h);
                bool same = !memcmp(ht, tokens + first * s->bs, sizeof(int32_t) * (size_t)(n * s->bs));
                for (int64_t i = 0; same && i < n; i++) same = hx[i] == (extra ? extra[first + i] : 0);
                if (!same) {
                    snprintf(why, sizeof why, "its tokens differ from the request's (a key collision)");
                    reason = K3_KVS_MISS_TOKENS;
                }
            }
        }
    } else if (!h) {
        snprintf(why, sizeof why, "out of memory");
    }
    if (reason != K3_KVS_MISS_ABSENT) {
        count_miss(s, reason);
        say(s, "kv cache: %s/%s refused (a miss): %.400s", snap ? "snaps" : "runs", name, why);
        free(h);
        close(fd);
        return false;
    }
    const int64_t ns = snap ? 1 : n;
    out->sums = malloc(sizeof(uint64_t) * (size_t)ns);
    if (!out->sums) {
        free(h);
        close(fd);
        return false;
    }
    const uint64_t *sums = k3_kvs_hdr_sums(h);
    memcpy(out->sums, sums, sizeof(uint64_t) * (size_t)ns);
    out->fd = fd;
    out->snap = snap;
    out->first = first;
    out->n = n;
    out->payload_off = h->payload_off;
    out->junction = snap && h->junction > 0 && h->junction < h->pos && h->junction % s->bs == 0 ? h->junction : 0;
    memcpy(out->name, name, sizeof out->name);
    free(h);
    return true;
}

/* ---- lookup ---------------------------------------------------------------------------- */

void k3_kvs_hit_free(k3_kvs_hit *h) {
    if (!h) return;
    for (int32_t i = 0; i < h->n_runs; i++) found_close(&h->runs[i]);
    found_close(&h->snap);
    free(h->runs);
    free(h);
}

int64_t k3_kvs_hit_tokens(const k3_kvs_hit *h) { return h ? h->n_tokens : 0; }
int64_t k3_kvs_hit_junction(const k3_kvs_hit *h) { return h ? h->snap.junction : 0; }
int64_t k3_kvs_hit_chain_tokens(const k3_kvs_hit *h) { return h ? h->chain_tokens : 0; }

k3_status k3_kvs_lookup(k3_kvs *s, const k3_kvs_seq *seq, int64_t n_local, int64_t n_max, k3_kvs_hit **out,
                        k3_error *err) {
    *out = NULL;
    if (!seq || n_local < 0 || n_max < 0 || (seq->n_tokens > 0 && !seq->tokens))
        return k3_err(err, K3_ERR_ARG, "kv cache: bad lookup");
    const int64_t bs = s->bs, R = s->R;
    if (n_max > seq->n_tokens) n_max = seq->n_tokens;
    const int64_t nb_local = n_local / bs, nb_max = n_max / bs, nfull = seq->n_tokens / bs;
    pthread_mutex_lock(&s->mm);
    s->m.lookups++;
    s->m.query_tokens += n_max > n_local ? n_max - n_local : 0;
    pthread_mutex_unlock(&s->mm);
    if (nb_max <= nb_local) return K3_OK;
    k3_kvs_key *keys = malloc(sizeof *keys * (size_t)nfull);
    k3_kvs_hit *hit = calloc(1, sizeof *hit);
    if (!keys || !hit) {
        free(keys);
        free(hit);
        return k3_err(err, K3_ERR_NOMEM, "kv cache: out of memory for a lookup of %lld tokens",
                      (long long)seq->n_tokens);
    }
    hit->snap.fd = -1;
    chain_keys(s, seq->tokens, seq->extra, seq->salt, nfull, keys);
    const k3_kvs_key seed = seed_key(s, seq->salt);
    /* runs from the one holding the first block past the local hit */
    int64_t end = nb_local;
    int32_t cap = 0;
    for (int64_t g = nb_local / R; end < nb_max; g++) {
        found f;
        bool got = false;
        const int64_t g0 = g * R;
        const k3_kvs_key parent = g0 ? keys[g0 - 1] : seed;
        if (g0 + R <= nfull) got = open_checked(s, keys[g0 + R - 1], false, g0, R, parent, seq->tokens, seq->extra, &f);
        int64_t j = R;
        if (!got) {
            j = nfull - g0 < R - 1 ? nfull - g0 : R - 1;
            for (; j >= 1 && !got; j--)
                got = open_checked(s, keys[g0 + j - 1], false, g0, j, parent, seq->tokens, seq->extra, &f);
            j++;
        }
        if (!got) break;
        if (hit->n_runs == cap) {
            cap = cap ? 2 * cap : 8;
            found *r = realloc(hit->runs, sizeof *r * (size_t)cap);
            if (!r) {
                found_close(&f);
                break;
            }
            hit->runs = r;
        }
        hit->runs[hit->n_runs++] = f;
        end = g0 + j;
        if (j < R) break; /* a partial run ends the chain on disk */
    }
    if (end > nb_max) end = nb_max;
    /* the latest snapshot boundary within them */
    int64_t B = 0;
    pthread_mutex_lock(&s->snap_mu);
    snaps_refresh(s);
    for (int64_t b = end; b > nb_local && !B; b--)
        if (keyset_has(&s->snaps, keys[b - 1]) &&
            open_checked(s, keys[b - 1], true, b, 0, keys[b - 1], NULL, NULL, &hit->snap))
            B = b;
    pthread_mutex_unlock(&s->snap_mu);
    free(keys);
    if (!B) {
        k3_kvs_hit_free(hit);
        return K3_OK;
    }
    /* keep the runs the hit reads */
    int32_t k = 0;
    for (int32_t i = 0; i < hit->n_runs; i++) {
        found *f = &hit->runs[i];
        if (f->first < B && f->first + f->n > nb_local) hit->runs[k++] = *f;
        else found_close(f);
    }
    hit->n_runs = k;
    hit->n_local = nb_local * bs;
    hit->n_tokens = B * bs;
    hit->chain_tokens = end * bs;
    pthread_mutex_lock(&s->mm);
    s->m.lookup_hits++;
    s->m.hit_tokens += hit->n_tokens - n_local;
    pthread_mutex_unlock(&s->mm);
    *out = hit;
    return K3_OK;
}

/* ---- moving bytes ------------------------------------------------------------------------ */

/* The iovecs of block id b (every MLA/DSA layer, in the payload's order). */
static int block_iov(k3_kvs *s, int32_t b, struct iovec *iov) {
    int n = 0;
    for (int32_t i = 0; i < s->n_attn; i++) {
        void *base[5];
        int64_t len[5];
        const int nc = k3_ctx_kv_block_ranges(s->ctx, s->attn[i], b, base, len);
        for (int c = 0; c < nc; c++) iov[n++] = (struct iovec){base[c], (size_t)len[c]};
    }
    return n;
}

/* Maps the pages of iov[0..n) in, writable, without changing a byte
 * (MADV_POPULATE_WRITE): memory a load is about to fill that was never
 * touched (a server that just started) is faulted in by one call per range
 * instead of a fault per page in the middle of each read. Best effort. */
static void populate(const struct iovec *iov, int n) {
#ifdef MADV_POPULATE_WRITE
    const uintptr_t pg = 4096;
    for (int i = 0; i < n; i++) {
        const uintptr_t a = (uintptr_t)iov[i].iov_base & ~(pg - 1),
                        b = ((uintptr_t)iov[i].iov_base + iov[i].iov_len + pg - 1) & ~(pg - 1);
        if (madvise((void *)a, b - a, MADV_POPULATE_WRITE)) return; /* an old kernel: EINVAL */
    }
#else
    (void)iov;
    (void)n;
#endif
}

/* All of iov at off (write or read); 0, or an errno (EIO for a short read). */
static int rw_all(int fd, struct iovec *iov, int n, int64_t off, bool wr) {
    int i = 0;
    while (i < n) {
        const int cnt = n - i < IOV_MAX ? n - i : IOV_MAX;
        const ssize_t r = wr ? pwritev(fd, iov + i, cnt, off) : preadv(fd, iov + i, cnt, off);
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) return wr ? ENOSPC : EIO;
        off += r;
        size_t left = (size_t)r;
        while (i < n && left >= iov[i].iov_len) left -= iov[i++].iov_len;
        if (left) {
            iov[i].iov_base = (char *)iov[i].iov_base + left;
            iov[i].iov_len -= left;
        }
    }
    return 0;
}

/* A window of a transfer: what is read, then checksummed while it is still
 * in the cache (or checksummed, then written), in one system call. */
#define PIECE_BYTES (256 << 10)
#define PIECE_IOVS 64

/* Reads (wr: writes) iov[0..n) at off in windows of about PIECE_BYTES, each
 * window added to the checksum xs right after it is read (before it is
 * written): the data is read from memory once more while it is in the L2,
 * not after the whole transfer. 0, or an errno. */
static int rw_summed(int fd, const struct iovec *iov, int n, int64_t off, bool wr, XXH3_state_t *xs) {
    struct iovec win[PIECE_IOVS], cp[PIECE_IOVS];
    int i = 0;
    size_t in = 0; /* bytes of iov[i] already in a window */
    while (i < n) {
        int w = 0;
        size_t tot = 0;
        while (i < n && w < PIECE_IOVS && tot < PIECE_BYTES) {
            const size_t left = iov[i].iov_len - in, room = PIECE_BYTES - tot, take = left < room ? left : room;
            if (take) win[w++] = (struct iovec){(char *)iov[i].iov_base + in, take};
            tot += take;
            in += take;
            if (in == iov[i].iov_len) {
                i++;
                in = 0;
            }
        }
        if (!w) continue;
        if (wr)
            for (int k = 0; k < w; k++) XXH3_64bits_update(xs, win[k].iov_base, win[k].iov_len);
        memcpy(cp, win, sizeof *win * (size_t)w);
        const int e = rw_all(fd, cp, w, off, wr);
        if (e) return e;
        if (!wr)
            for (int k = 0; k < w; k++) XXH3_64bits_update(xs, win[k].iov_base, win[k].iov_len);
        off += (int64_t)tot;
    }
    return 0;
}

static int rw_buf(int fd, void *buf, int64_t n, int64_t off, bool wr) {
    for (int64_t done = 0; done < n;) {
        const int64_t chunk = n - done < (1 << 26) ? n - done : (1 << 26);
        struct iovec v = {(char *)buf + done, (size_t)chunk};
        const int e = rw_all(fd, &v, 1, off + done, wr);
        if (e) return e;
        done += chunk;
    }
    return 0;
}

/* ---- direct I/O ------------------------------------------------------------------------------ */

/* What a transfer with O_DIRECT needs besides the file: the alignments, a
 * bounce buffer for the pieces that are not aligned (allocated on first use,
 * freed by the job), and what went through it. */
typedef struct dio {
    bool on;
    int32_t mem, off; /* address and offset/length alignment (1, 1 when buffered) */
    void *bounce;
    int64_t bounced;
} dio;

#define BOUNCE_BYTES (1 << 20)

static dio dio_for(const k3_kvs *s, bool on) {
    return (dio){.on = on && s->direct,
                 .mem = on && s->direct ? s->mem_align : 1,
                 .off = on && s->direct ? s->off_align : 1};
}

static bool aligned(const dio *d, const void *p, int64_t off) {
    return (uintptr_t)p % (uintptr_t)d->mem == 0 && off % d->off == 0;
}

/* A direct window: up to DIRECT_BYTES in at most DIRECT_IOVS segments per
 * system call, so the kernel has several requests of the device in flight
 * (O_DIRECT has no readahead: one call is one wait). */
#define DIRECT_BYTES (8 << 20)
#define DIRECT_IOVS 1024

/* A page of zeros (writes) or of garbage (reads) for the padding between
 * blocks in the file: the pads of one call all land on it. */
static uint8_t pad_zeros[K3_KVS_ALIGN] __attribute__((aligned(K3_KVS_ALIGN)));
static uint8_t pad_sink[K3_KVS_ALIGN] __attribute__((aligned(K3_KVS_ALIGN)));

/* Adds the bytes [p, p + len) of segment k to its checksum (sid[k] < 0: a pad, none). */
static void sum_piece(XXH3_state_t *xs, const int *sid, int k, const void *p, size_t len) {
    const int x = sid ? sid[k] : 0;
    if (x >= 0) XXH3_64bits_update(&xs[x], p, len);
}

/* Moves the segments iov[0..n), which lie back to back in the file from off
 * (a multiple of d->off), to (wr) or from fd, adding each segment's bytes to
 * the checksum xs[sid[k]] in order (sid NULL: all to xs[0]; sid[k] < 0: none,
 * the padding). Buffered (d->on false): rw_summed, one checksum. Direct:
 * windows of aligned pieces go straight between the file and the memory; a
 * stretch that is not aligned (an array's rows of a few hundred bytes, a
 * buffer not on a page, a tail) goes through the bounce buffer, its file
 * range rounded up to the alignment (inside the payload's padding:
 * k3_kvs_stride). 0 or an errno. */
static int xfer(int fd, dio *d, const struct iovec *iov, const int *sid, int n, int64_t off, bool wr,
                XXH3_state_t *xs) {
    if (!d->on) return rw_summed(fd, iov, n, off, wr, xs);
    const size_t A = (size_t)d->off;
    struct iovec *win = malloc(sizeof *win * DIRECT_IOVS * 2);
    int *wk = malloc(sizeof *wk * DIRECT_IOVS);
    if (!win || !wk) {
        free(win);
        free(wk);
        return ENOMEM;
    }
    struct iovec *cp = win + DIRECT_IOVS;
    int i = 0, e = 0;
    size_t in = 0; /* bytes of iov[i] done */
    while (i < n && !e) {
        if (in == iov[i].iov_len) {
            i++;
            in = 0;
            continue;
        }
        /* a window of direct pieces */
        int w = 0;
        size_t tot = 0;
        while (i < n && w < DIRECT_IOVS && tot < DIRECT_BYTES) {
            char *p = (char *)iov[i].iov_base + in;
            const size_t left = iov[i].iov_len - in, room = DIRECT_BYTES - tot;
            const size_t take = (left < room ? left : room) / A * A;
            if (!take || !aligned(d, p, off + (int64_t)tot)) break;
            wk[w] = i;
            win[w++] = (struct iovec){p, take};
            tot += take;
            in += take;
            if (in == iov[i].iov_len) {
                i++;
                in = 0;
            }
        }
        if (w) {
            if (wr)
                for (int k = 0; k < w; k++) sum_piece(xs, sid, wk[k], win[k].iov_base, win[k].iov_len);
            memcpy(cp, win, sizeof *win * (size_t)w);
            if ((e = rw_all(fd, cp, w, off, wr))) break;
            if (!wr)
                for (int k = 0; k < w; k++) sum_piece(xs, sid, wk[k], win[k].iov_base, win[k].iov_len);
            off += (int64_t)tot;
            continue;
        }
        /* a stretch through the bounce buffer: up to where a direct window can start again */
        if (!d->bounce && !(d->bounce = aligned_alloc(4096, BOUNCE_BYTES))) {
            e = ENOMEM;
            break;
        }
        uint8_t *b = d->bounce;
        const int i0 = i;
        const size_t in0 = in;
        size_t bt = 0;
        while (i < n && bt < BOUNCE_BYTES) {
            const size_t left = iov[i].iov_len - in;
            if (!left) {
                i++;
                in = 0;
                continue;
            }
            if (bt && left >= A && aligned(d, (char *)iov[i].iov_base + in, off + (int64_t)bt)) break;
            const size_t take = left < BOUNCE_BYTES - bt ? left : BOUNCE_BYTES - bt;
            bt += take;
            in += take;
        }
        const size_t io = (bt + A - 1) / A * A;
        for (int pass = wr ? 0 : 1; pass < 2; pass++) {
            if (pass == 1) { /* the file's side */
                if (wr) memset(b + bt, 0, io - bt);
                struct iovec v = {b, io};
                if ((e = rw_all(fd, &v, 1, off, wr))) break;
                if (wr) break;
            }
            /* the memory's side: gather (write) or scatter (read), each piece summed */
            int k = i0;
            size_t kin = in0;
            for (size_t at = 0; at < bt; k++, kin = 0) {
                const size_t left = iov[k].iov_len - kin, take = left < bt - at ? left : bt - at;
                char *p = (char *)iov[k].iov_base + kin;
                if (wr) memcpy(b + at, p, take);
                else memcpy(p, b + at, take);
                sum_piece(xs, sid, k, b + at, take);
                at += take;
            }
            if (!wr) break;
        }
        d->bounced += (int64_t)bt;
        off += (int64_t)bt;
    }
    free(win);
    free(wk);
    return e;
}

/* Blocks whose bytes one call moves: about DIRECT_BYTES of them. */
static int64_t blocks_per_call(const k3_kvs *s) {
    const int64_t k = DIRECT_BYTES / k3_kvs_stride(s->id.block_bytes);
    return k > 0 ? k : 1;
}

/* Moves n consecutive blocks of a run file, the first at file offset off,
 * to (wr) or from the cache blocks ids[0..n); sums[k] gets block k's
 * checksum. Direct: one xfer over all of them, the padding between blocks
 * to or from a page of its own; buffered: one call per block. 0 or an errno. */
static int xfer_blocks(k3_kvs *s, int fd, dio *d, int64_t off, const int32_t *ids, int64_t n, bool wr, bool map_in,
                       uint64_t *sums) {
    const int64_t stride = k3_kvs_stride(s->id.block_bytes), pad = stride - s->id.block_bytes;
    const int64_t per = s->max_iov + 1;
    struct iovec *iov = malloc(sizeof *iov * (size_t)(per * (d->on ? n : 1)));
    int *sid = malloc(sizeof *sid * (size_t)(per * (d->on ? n : 1)));
    XXH3_state_t *xs = malloc(sizeof *xs * (size_t)n);
    int e = iov && sid && xs ? 0 : ENOMEM;
    int m = 0;
    for (int64_t k = 0; !e && k < n; k++) {
        XXH3_64bits_reset(&xs[k]);
        const int nb = block_iov(s, ids[k], iov + m);
        if (map_in) populate(iov + m, nb);
        if (!d->on) {
            e = xfer(fd, d, iov, NULL, nb, off + k * stride, wr, &xs[k]);
            continue;
        }
        for (int c = 0; c < nb; c++) sid[m + c] = (int)k;
        m += nb;
        if (pad) {
            iov[m] = (struct iovec){wr ? pad_zeros : pad_sink, (size_t)pad};
            sid[m++] = -1;
        }
    }
    if (!e && d->on) e = xfer(fd, d, iov, sid, m, off, wr, xs);
    for (int64_t k = 0; !e && k < n; k++) sums[k] = XXH3_64bits_digest(&xs[k]);
    free(iov);
    free(sid);
    free(xs);
    return e;
}

/* Turns O_DIRECT on for a file a lookup opened (its header was read through
 * the page cache); false when the filesystem refuses it here. */
static bool set_direct(int fd) {
    const int fl = fcntl(fd, F_GETFL);
    return fl >= 0 && ((fl & O_DIRECT) || !fcntl(fd, F_SETFL, fl | O_DIRECT));
}

/* ---- writing a file ------------------------------------------------------------------------ */

/* A run an eviction pass removes: its blocks leave the directory (the
 * events' BlockRemoved), when it was this namespace's. */
static void on_removed(void *arg, const k3_kvs_hdr *h) {
    k3_kvs *s = arg;
    if (k3_kvs_ident_diff(&h->id, &s->id)) return;
    const uint64_t *eh = k3_kvs_hdr_ehash(h);
    int32_t n = 0;
    while (n < h->n_blocks && eh[n]) n++;
    if (!n) return;
    pthread_mutex_lock(&s->mm);
    s->m.blocks_removed += n;
    pthread_mutex_unlock(&s->mm);
    if (s->o.on_blocks) {
        const k3_kvs_blocks_event ev = {.stored = false, .hashes = eh, .n = n};
        s->o.on_blocks(s->o.cb_arg, &ev);
    }
}

static void budget_check(k3_kvs *s, int64_t need) {
    const int64_t used = __atomic_load_n(&s->usage->bytes, __ATOMIC_RELAXED);
    if (used + need <= s->o.disk_bytes) return;
    k3_kvs_evict_result r;
    k3_error e = {0};
    int64_t target = s->o.disk_bytes / 10 * 9 - need;
    if (target < 0) target = 0;
    if (k3_kvs_dir_evict(s->dir, s->usage, target, 600, false, on_removed, s, &r, &e)) {
        say(s, "kv cache: eviction pass failed: %s", e.msg);
        return;
    }
    if (!r.ran) return;
    pthread_mutex_lock(&s->mm);
    s->m.evictions++;
    s->m.evicted_files += r.evicted_files;
    s->m.evicted_bytes += r.evicted_bytes;
    pthread_mutex_unlock(&s->mm);
    if (r.evicted_files)
        say(s, "kv cache: evicted %lld files (%lld bytes) to stay within %lld bytes", (long long)r.evicted_files,
            (long long)r.evicted_bytes, (long long)s->o.disk_bytes);
}

/* Writes a file: header h (its arrays after it, the sums filled here),
 * payload from the blocks of a run or from src; published as name under
 * runs/ or snaps/. 0 = written, 1 = there already, -1 = failed (why). */
static int write_file(k3_kvs *s, k3_kvs_hdr *h, const int32_t *blocks, const void *src, const char *name, bool snap,
                      dio *d, int64_t *bytes, char *why, size_t why_size) {
    const int dir_fd = snap ? s->snaps_fd : s->runs_fd;
    if (!faccessat(dir_fd, name, F_OK, 0)) return 1;
    const int64_t total = h->payload_off + h->payload_bytes;
    budget_check(s, total);
    char tmp[96];
    snprintf(tmp, sizeof tmp, "%d-%ld-%llu.part", (int)getpid(), (long)syscall(SYS_gettid),
             (unsigned long long)__atomic_add_fetch(&s->tmp_seq, 1, __ATOMIC_RELAXED));
    const int fl = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
    int fd = openat(s->tmp_fd, tmp, fl | (d->on ? O_DIRECT : 0), 0644);
    if (fd < 0 && d->on && errno == EINVAL) { /* refused here after all: buffered */
        d->on = false;
        d->mem = d->off = 1;
        fd = openat(s->tmp_fd, tmp, fl, 0644);
    }
    if (fd < 0) {
        snprintf(why, why_size, "cannot create %s/tmp/%s: %s", s->dir, tmp, strerror(errno));
        return -1;
    }
    /* the file's size first: the payloads' padding is a hole that reads as zeros */
    int e = ftruncate(fd, (off_t)total) ? errno : 0;
    uint64_t *sums = (uint64_t *)k3_kvs_hdr_sums(h);
    if (e) {
    } else if (snap) {
        XXH3_state_t xs;
        XXH3_64bits_reset(&xs);
        const struct iovec v = {(void *)src, (size_t)s->id.state_bytes};
        e = xfer(fd, d, &v, NULL, 1, h->payload_off, true, &xs);
        sums[0] = XXH3_64bits_digest(&xs);
    } else {
        const int64_t per = blocks_per_call(s);
        for (int64_t i = 0; !e && i < h->n_blocks; i += per) {
            const int64_t k = h->n_blocks - i < per ? h->n_blocks - i : per;
            e = xfer_blocks(s, fd, d, h->payload_off + i * k3_kvs_stride(s->id.block_bytes),
                            blocks + h->first_block + i, k, true, false, sums + i);
        }
    }
    if (!e) {
        h->hdr_sum = k3_kvs_hdr_sum(h);
        e = rw_buf(fd, h, h->payload_off, 0, true); /* h: payload_off bytes on a page (make_hdr) */
    }
    if (!e && s->o.fsync && fsync(fd)) e = errno;
    if (close(fd) && !e) e = errno;
    if (!e) {
        if (syscall(SYS_renameat2, s->tmp_fd, tmp, dir_fd, name, RENAME_NOREPLACE)) {
            e = errno;
            if (e == EINVAL || e == ENOSYS) { /* a filesystem without it: link() refuses an existing name too */
                e = linkat(s->tmp_fd, tmp, dir_fd, name, 0) ? errno : 0;
                unlinkat(s->tmp_fd, tmp, 0);
            }
            if (e == EEXIST) {
                unlinkat(s->tmp_fd, tmp, 0);
                return 1;
            }
        }
    }
    if (e) {
        unlinkat(s->tmp_fd, tmp, 0);
        snprintf(why, why_size, "%s writing %s (%lld bytes)%s", strerror(e), name, (long long)total,
                 e == ENOSPC ? ": the disk is full" : "");
        if (e == ENOSPC) budget_check(s, s->o.disk_bytes); /* free room for the next */
        return -1;
    }
    __atomic_add_fetch(&s->usage->bytes, total, __ATOMIC_RELAXED);
    __atomic_add_fetch(&s->usage->files, 1, __ATOMIC_RELAXED);
    *bytes += snap ? s->id.state_bytes : (int64_t)h->n_blocks * s->id.block_bytes;
    return 0;
}

/* Removes runs/ or snaps/ name, keeping the counter. */
static void remove_file(k3_kvs *s, const char *name, bool snap) {
    const int dir_fd = snap ? s->snaps_fd : s->runs_fd;
    struct stat st;
    if (fstatat(dir_fd, name, &st, 0) || unlinkat(dir_fd, name, 0)) return;
    __atomic_sub_fetch(&s->usage->bytes, (int64_t)st.st_size, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&s->usage->files, 1, __ATOMIC_RELAXED);
}

static k3_kvs_hdr *make_hdr(k3_kvs *s, bool snap, k3_kvs_key key, k3_kvs_key parent, int64_t first, int32_t n,
                            int64_t pos, const int32_t *tokens, const uint64_t *extra, const uint64_t *ehash) {
    const int64_t hb = k3_kvs_hdr_bytes(n, s->bs, snap), room = k3_kvs_payload_off(hb);
    k3_kvs_hdr *h = aligned_alloc(K3_KVS_ALIGN, (size_t)room); /* written whole, with O_DIRECT too */
    if (!h) return NULL;
    memset(h, 0, (size_t)room);
    memcpy(h->magic, snap ? K3_KVS_MAGIC_SNAP : K3_KVS_MAGIC_RUN, 8);
    h->version = K3_KVS_VERSION;
    h->hdr_bytes = (uint32_t)hb;
    h->id = s->id;
    h->key = key;
    h->parent = parent;
    h->first_block = first;
    h->n_blocks = n;
    h->pos = pos;
    h->payload_off = k3_kvs_payload_off(hb);
    h->payload_bytes = snap ? k3_kvs_stride(s->id.state_bytes) : (int64_t)n * k3_kvs_stride(s->id.block_bytes);
    h->created_unix_ns = unix_ns();
    if (!snap) {
        int32_t *t = (int32_t *)(h + 1);
        memcpy(t, tokens + first * s->bs, sizeof(int32_t) * (size_t)(n * s->bs));
        uint64_t *x = (uint64_t *)k3_kvs_hdr_extra(h), *eh = (uint64_t *)k3_kvs_hdr_ehash(h);
        for (int32_t i = 0; i < n; i++) {
            x[i] = extra ? extra[first + i] : 0;
            eh[i] = ehash ? ehash[first + i] : 0;
        }
    }
    return h;
}

static void touch(int dir_fd, const char *name) { utimensat(dir_fd, name, NULL, 0); }

/* ---- the jobs ------------------------------------------------------------------------------ */

/* Writes the run of blocks [g0, g0 + len) of j's sequence: 0 written, 1 there
 * already, -1 failed (d->why). */
static int write_run(k3_kvs *s, job *j, k3_kvs_done *d, dio *io, const k3_kvs_key *keys, k3_kvs_key seed, int64_t g0,
                     int64_t len) {
    char name[48];
    file_name(keys[g0 + len - 1], false, name);
    k3_kvs_hdr *h = make_hdr(s, false, keys[g0 + len - 1], g0 ? keys[g0 - 1] : seed, g0, (int32_t)len,
                             (g0 + len) * s->bs, j->tokens, j->extra, j->hashes);
    if (!h) {
        snprintf(d->why, sizeof d->why, "out of memory");
        return -1;
    }
    const int r = write_file(s, h, j->blocks, NULL, name, false, io, &d->bytes, d->why, sizeof d->why);
    free(h);
    if (r == 1) {
        touch(s->runs_fd, name); /* in use again */
        pthread_mutex_lock(&s->mm);
        s->m.files_present++;
        pthread_mutex_unlock(&s->mm);
    }
    if (r != 0) return r;
    d->files++;
    pthread_mutex_lock(&s->mm);
    s->m.runs_written++;
    if (j->hashes) s->m.blocks_stored += len;
    pthread_mutex_unlock(&s->mm);
    if (j->hashes && s->o.on_blocks) {
        const k3_kvs_blocks_event ev = {.stored = true,
                                        .hashes = j->hashes + g0,
                                        .n = (int32_t)len,
                                        .parent = g0 ? j->hashes[g0 - 1] : 0,
                                        .has_parent = g0 > 0,
                                        .tokens = j->tokens + g0 * s->bs,
                                        .extra = j->extra ? j->extra + g0 : NULL};
        s->o.on_blocks(s->o.cb_arg, &ev);
    }
    return 0;
}

static k3_status job_save_blocks(k3_kvs *s, job *j, k3_kvs_done *d, dio *io) {
    const int64_t R = s->R, n = j->n_full, kb = j->keep / s->bs;
    k3_kvs_key *keys = malloc(sizeof *keys * (size_t)(n ? n : 1));
    if (!keys) {
        snprintf(d->why, sizeof d->why, "out of memory");
        return K3_ERR_NOMEM;
    }
    chain_keys(s, j->tokens, j->extra, j->salt, n, keys);
    const k3_kvs_key seed = seed_key(s, j->salt);
    k3_status st = K3_OK;
    for (int64_t g0 = 0; g0 < n && !st; g0 += R) {
        const int64_t len = g0 + R <= n ? R : j->final ? n - g0 : 0;
        if (!len) break;
        /* the run that ends at the junction kept (a prompt leaving the chain there finds it) */
        const bool keep = kb > g0 && kb < g0 + len && kb - g0 < R;
        if (keep && write_run(s, j, d, io, keys, seed, g0, kb - g0) < 0) {
            st = K3_ERR_IO;
            break;
        }
        const int r = write_run(s, j, d, io, keys, seed, g0, len);
        if (r < 0) {
            st = K3_ERR_IO;
            break;
        }
        if (r == 1) continue;
        /* a longer run of the group supersedes the shorter ones written before */
        for (int64_t k = 1; k < len; k++) {
            if (keep && k == kb - g0) continue;
            char old[48];
            file_name(keys[g0 + k - 1], false, old);
            remove_file(s, old, false);
        }
    }
    free(keys);
    return st;
}

static k3_status job_save_snapshot(k3_kvs *s, job *j, k3_kvs_done *d, dio *io) {
    const int64_t nb = j->pos / s->bs;
    k3_kvs_key *keys = malloc(sizeof *keys * (size_t)nb);
    if (!keys) {
        snprintf(d->why, sizeof d->why, "out of memory");
        return K3_ERR_NOMEM;
    }
    chain_keys(s, j->tokens, j->extra, j->salt, nb, keys);
    char name[48];
    file_name(keys[nb - 1], true, name);
    k3_kvs_hdr *h = make_hdr(s, true, keys[nb - 1], keys[nb - 1], nb, 0, j->pos, NULL, NULL, NULL);
    if (h) h->junction = j->junction;
    k3_status st = K3_OK;
    if (!h) {
        snprintf(d->why, sizeof d->why, "out of memory");
        st = K3_ERR_NOMEM;
    } else {
        const int r = write_file(s, h, NULL, j->src, name, true, io, &d->bytes, d->why, sizeof d->why);
        if (r < 0) st = K3_ERR_IO;
        else if (r == 1) touch(s->snaps_fd, name);
        if (r == 0) {
            d->files++;
            pthread_mutex_lock(&s->snap_mu);
            keyset_add(&s->snaps, keys[nb - 1]);
            pthread_mutex_unlock(&s->snap_mu);
        }
        pthread_mutex_lock(&s->mm);
        if (r == 0) s->m.snaps_written++;
        if (r == 1) s->m.files_present++;
        pthread_mutex_unlock(&s->mm);
        if (r >= 0 && j->drop_pos > 0 && j->drop_pos < j->pos && j->drop_pos % s->bs == 0) {
            char old[48];
            file_name(keys[j->drop_pos / s->bs - 1], true, old);
            remove_file(s, old, true);
        }
    }
    free(h);
    free(keys);
    return st;
}

static bool job_cancelled(k3_kvs *s, job *j) {
    pthread_mutex_lock(&s->mu);
    const bool c = j->cancelled;
    pthread_mutex_unlock(&s->mu);
    return c;
}

/* A file whose payload failed its checksum: removed (it would fail again). */
static void drop_damaged(k3_kvs *s, const found *f) {
    struct stat a, b;
    const int dir_fd = f->snap ? s->snaps_fd : s->runs_fd;
    if (!fstat(f->fd, &a) && !fstatat(dir_fd, f->name, &b, 0) && a.st_ino == b.st_ino && a.st_dev == b.st_dev)
        remove_file(s, f->name, f->snap);
}

static k3_status job_load(k3_kvs *s, job *j, k3_kvs_done *d, dio *io) {
    k3_kvs_hit *h = j->hit;
    const int64_t lo = h->n_local / s->bs, hi = h->n_tokens / s->bs;
    uint64_t *sums = malloc(sizeof *sums * (size_t)blocks_per_call(s));
    k3_status st = K3_OK;
    if (!sums) {
        snprintf(d->why, sizeof d->why, "out of memory");
        st = K3_ERR_NOMEM;
    }
    for (int32_t r = 0; !st && r < h->n_runs; r++) {
        found *f = &h->runs[r];
        dio fio = *io; /* this file's: O_DIRECT when it takes it */
        fio.on = io->on && set_direct(f->fd);
        if (!fio.on) fio.mem = fio.off = 1;
        const int64_t b0 = f->first > lo ? f->first : lo, b1 = f->first + f->n < hi ? f->first + f->n : hi;
        const int64_t per = blocks_per_call(s);
        for (int64_t b = b0; !st && b < b1; b += per) {
            if (job_cancelled(s, j)) {
                d->cancelled = true;
                snprintf(d->why, sizeof d->why, "cancelled");
                st = K3_ERR_ARG;
                break;
            }
            const int64_t k = b1 - b < per ? b1 - b : per;
            const int e =
                xfer_blocks(s, f->fd, &fio, f->payload_off + (b - f->first) * k3_kvs_stride(s->id.block_bytes),
                            j->blocks + b, k, false, true, sums);
            io->bounce = fio.bounce;
            io->bounced = fio.bounced;
            if (e) {
                snprintf(d->why, sizeof d->why, "runs/%s: %s", f->name, e == EIO ? "short read" : strerror(e));
                count_miss(s, K3_KVS_MISS_IO);
                st = K3_ERR_IO;
                break;
            }
            for (int64_t q = 0; q < k && !st; q++)
                if (sums[q] != f->sums[b + q - f->first]) {
                    snprintf(d->why, sizeof d->why, "runs/%s: block %lld fails its checksum (damaged; removed)",
                             f->name, (long long)(b + q - f->first));
                    count_miss(s, K3_KVS_MISS_CHECKSUM);
                    drop_damaged(s, f);
                    st = K3_ERR_FORMAT;
                }
            if (!st) d->bytes += k * s->id.block_bytes;
        }
        if (!st) {
            futimens(f->fd, NULL); /* used: the LRU's clock */
            d->files++;
        }
    }
    if (!st && !job_cancelled(s, j)) {
        found *f = &h->snap;
        const struct iovec v = {j->state, (size_t)s->id.state_bytes};
        populate(&v, 1);
        dio fio = *io;
        fio.on = io->on && set_direct(f->fd);
        if (!fio.on) fio.mem = fio.off = 1;
        XXH3_state_t xs;
        XXH3_64bits_reset(&xs);
        const int e = xfer(f->fd, &fio, &v, NULL, 1, f->payload_off, false, &xs);
        io->bounce = fio.bounce;
        io->bounced = fio.bounced;
        const uint64_t sum = XXH3_64bits_digest(&xs);
        if (e) {
            snprintf(d->why, sizeof d->why, "snaps/%s: %s", f->name, e == EIO ? "short read" : strerror(e));
            count_miss(s, K3_KVS_MISS_IO);
            st = K3_ERR_IO;
        } else if (sum != f->sums[0]) {
            snprintf(d->why, sizeof d->why, "snaps/%s fails its checksum (damaged; removed)", f->name);
            count_miss(s, K3_KVS_MISS_CHECKSUM);
            drop_damaged(s, f);
            st = K3_ERR_FORMAT;
        } else {
            futimens(f->fd, NULL);
            d->files++;
            d->bytes += s->id.state_bytes;
        }
    } else if (!st) {
        d->cancelled = true;
        snprintf(d->why, sizeof d->why, "cancelled");
        st = K3_ERR_ARG;
    }
    free(sums);
    return st;
}

static void job_free(job *j) {
    if (!j) return;
    k3_kvs_hit_free(j->hit);
    free(j->blocks);
    free(j->tokens);
    free(j->extra);
    free(j->hashes);
    free(j);
}

/* Runs j (running[t], taken by take()), records its completion; the job is
 * freed. */
static void run_job(k3_kvs *s, int t, job *j) {
    k3_kvs_done d = {.ticket = j->ticket, .op = j->op};
    const double t0 = k3_now();
    dio io = dio_for(s, j->op == K3_KVS_LOAD || !s->o.buffered_writes);
    d.status = j->op == K3_KVS_LOAD   ? job_load(s, j, &d, &io)
        : j->op == K3_KVS_SAVE_BLOCKS ? job_save_blocks(s, j, &d, &io)
                                      : job_save_snapshot(s, j, &d, &io);
    d.seconds = k3_now() - t0;
    free(io.bounce);
    if (d.status && !d.cancelled) say(s, "kv cache: %s failed: %s", j->op == K3_KVS_LOAD ? "a load" : "a save", d.why);
    pthread_mutex_lock(&s->mm);
    s->m.bytes_bounced += io.bounced;
    if (j->op == K3_KVS_LOAD) {
        s->m.loads++;
        s->m.loads_failed += d.status != K3_OK;
        s->m.bytes_read += d.bytes;
        s->m.read_seconds += d.seconds;
        if (!d.status) {
            hist_add_le(&s->m.load_seconds, k3_kvs_hist_le, d.seconds);
            hist_add_le(&s->m.load_size, k3_kvs_size_le, (double)d.bytes);
        }
    } else {
        s->m.saves++;
        s->m.saves_failed += d.status != K3_OK;
        s->m.bytes_written += d.bytes;
        s->m.write_seconds += d.seconds;
        if (!d.status && d.files) {
            hist_add_le(&s->m.save_seconds, k3_kvs_hist_le, d.seconds);
            hist_add_le(&s->m.save_size, k3_kvs_size_le, (double)d.bytes);
        }
    }
    pthread_mutex_unlock(&s->mm);
    /* The job leaves running[t] and enters done under one hold of mu, and is
     * freed only then: k3_kvs_wait and k3_kvs_cancel read running[t] under
     * mu, so they never see a ticket in neither place nor a freed job. */
    pthread_mutex_lock(&s->mu);
    s->running[t] = NULL;
    if (s->n_done == s->cap_done) {
        const int32_t cap = s->cap_done ? 2 * s->cap_done : 64;
        k3_kvs_done *g = realloc(s->done, sizeof *g * (size_t)cap);
        if (g) {
            s->done = g;
            s->cap_done = cap;
        }
    }
    if (s->n_done < s->cap_done) s->done[s->n_done++] = d;
    pthread_cond_broadcast(&s->cv_done);
    pthread_mutex_unlock(&s->mu);
    job_free(j);
    if (s->o.on_done) s->o.on_done(s->o.cb_arg);
}

/* Takes the next job of thread t (under mu), or NULL. */
static job *take(k3_kvs *s, int t) {
    job *j = s->head[t];
    if (j) {
        s->head[t] = j->next;
        if (!s->head[t]) s->tail[t] = NULL;
        s->queued[t]--;
        s->running[t] = j;
    }
    return j;
}

typedef struct worker_arg {
    k3_kvs *s;
    int t;
} worker_arg;

static void *worker(void *arg) {
    worker_arg *wa = arg;
    k3_kvs *s = wa->s;
    const int t = wa->t;
    free(wa);
    pthread_mutex_lock(&s->mu);
    for (;;) {
        job *j = take(s, t);
        if (!j) {
            if (s->stop) break;
            pthread_cond_wait(&s->cv_work, &s->mu);
            continue;
        }
        pthread_mutex_unlock(&s->mu);
        run_job(s, t, j);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Queues j on thread t: its ticket (j may be done and freed on return), or
 * 0 when the queue is full (j not taken). */
static uint64_t enqueue(k3_kvs *s, int t, job *j) {
    pthread_mutex_lock(&s->mu);
    if (s->queued[t] >= s->o.queue_max) {
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    const uint64_t ticket = j->ticket = ++s->next_ticket;
    j->next = NULL;
    if (s->tail[t]) s->tail[t]->next = j;
    else s->head[t] = j;
    s->tail[t] = j;
    s->queued[t]++;
    pthread_cond_broadcast(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    return ticket;
}

/* no_threads: runs what is queued, on the calling thread. */
static void run_queued(k3_kvs *s) {
    if (!s->o.no_threads) return;
    for (int t = 0; t < 2; t++)
        for (;;) {
            pthread_mutex_lock(&s->mu);
            job *j = take(s, t);
            pthread_mutex_unlock(&s->mu);
            if (!j) break;
            run_job(s, t, j);
        }
}

/* ---- the seam's calls ------------------------------------------------------------------------- */

static bool copy_seq(job *j, const k3_kvs_seq *seq, int64_t n_tokens, int64_t n_blocks) {
    j->tokens = malloc(sizeof(int32_t) * (size_t)(n_tokens ? n_tokens : 1));
    if (!j->tokens) return false;
    memcpy(j->tokens, seq->tokens, sizeof(int32_t) * (size_t)n_tokens);
    j->n_tokens = n_tokens;
    j->salt = seq->salt;
    if (seq->extra) {
        j->extra = malloc(sizeof(uint64_t) * (size_t)(n_blocks ? n_blocks : 1));
        if (!j->extra) return false;
        memcpy(j->extra, seq->extra, sizeof(uint64_t) * (size_t)n_blocks);
    }
    if (seq->hashes) {
        j->hashes = malloc(sizeof(uint64_t) * (size_t)(n_blocks ? n_blocks : 1));
        if (!j->hashes) return false;
        memcpy(j->hashes, seq->hashes, sizeof(uint64_t) * (size_t)n_blocks);
    }
    return true;
}

static k3_status check_blocks(const k3_kvs *s, const int32_t *blocks, int64_t from, int64_t to, k3_error *err) {
    for (int64_t i = from; i < to; i++)
        if (blocks[i] < 0 || blocks[i] >= s->ctx->n_blocks)
            return k3_err(err, K3_ERR_ARG, "kv cache: block id %d out of range [0, %d)", blocks[i], s->ctx->n_blocks);
    return K3_OK;
}

k3_status k3_kvs_load(k3_kvs *s, k3_kvs_hit *hit, const int32_t *blocks, void *state, uint64_t *ticket, k3_error *err) {
    *ticket = 0;
    if (!hit || !blocks || !state) {
        k3_kvs_hit_free(hit);
        return k3_err(err, K3_ERR_ARG, "kv cache: a load needs a hit, blocks and a state buffer");
    }
    const int64_t nb = hit->n_tokens / s->bs;
    k3_status st = check_blocks(s, blocks, hit->n_local / s->bs, nb, err);
    job *j = st ? NULL : calloc(1, sizeof *j);
    if (!st && j) j->blocks = malloc(sizeof(int32_t) * (size_t)nb);
    if (!st && (!j || !j->blocks)) st = k3_err(err, K3_ERR_NOMEM, "kv cache: out of memory");
    if (st) {
        k3_kvs_hit_free(hit);
        job_free(j);
        return st;
    }
    memcpy(j->blocks, blocks, sizeof(int32_t) * (size_t)nb);
    j->op = K3_KVS_LOAD;
    j->hit = hit;
    j->state = state;
    if (!(*ticket = enqueue(s, RD, j))) {
        job_free(j);
        return k3_err(err, K3_ERR_BUSY, "kv cache: %d loads are queued already", s->o.queue_max);
    }
    return K3_OK;
}

static k3_status dropped(k3_kvs *s, job *j, k3_error *err) {
    job_free(j);
    pthread_mutex_lock(&s->mm);
    s->m.saves_dropped++;
    pthread_mutex_unlock(&s->mm);
    say(s, "kv cache: a save dropped: %d saves are queued already", s->o.queue_max);
    return k3_err(err, K3_ERR_BUSY, "kv cache: %d saves are queued already", s->o.queue_max);
}

k3_status k3_kvs_save_blocks(k3_kvs *s, const k3_kvs_seq *seq, const int32_t *blocks, int32_t n_full, bool final,
                             int64_t keep, uint64_t *ticket, k3_error *err) {
    *ticket = 0;
    if (!seq || n_full < 0 || (int64_t)n_full * s->bs > seq->n_tokens || (n_full && (!blocks || !seq->tokens)))
        return k3_err(err, K3_ERR_ARG, "kv cache: bad save (%d blocks of %d tokens for %lld tokens)", n_full, s->bs,
                      seq ? (long long)seq->n_tokens : 0ll);
    if (n_full < s->R && !(final && n_full > 0)) return K3_OK;
    K3_TRY(check_blocks(s, blocks, 0, n_full, err));
    job *j = calloc(1, sizeof *j);
    const int64_t nt = (int64_t)n_full * s->bs;
    if (!j || !copy_seq(j, seq, nt, n_full) || !(j->blocks = malloc(sizeof(int32_t) * (size_t)n_full))) {
        job_free(j);
        return k3_err(err, K3_ERR_NOMEM, "kv cache: out of memory");
    }
    memcpy(j->blocks, blocks, sizeof(int32_t) * (size_t)n_full);
    j->op = K3_KVS_SAVE_BLOCKS;
    j->n_full = n_full;
    j->final = final;
    j->keep = keep > 0 && keep % s->bs == 0 && keep < (int64_t)n_full * s->bs ? keep : 0;
    if (!(*ticket = enqueue(s, WR, j))) return dropped(s, j, err);
    return K3_OK;
}

k3_status k3_kvs_save_snapshot(k3_kvs *s, const k3_kvs_seq *seq, int64_t pos, const void *state, int64_t drop_pos,
                               int64_t junction, uint64_t *ticket, k3_error *err) {
    *ticket = 0;
    if (!seq || !state || pos < s->bs || pos % s->bs || pos > seq->n_tokens || !seq->tokens)
        return k3_err(err, K3_ERR_ARG, "kv cache: a snapshot at %lld is not on the block grid within the sequence",
                      (long long)pos);
    job *j = calloc(1, sizeof *j);
    if (!j || !copy_seq(j, seq, pos, pos / s->bs)) {
        job_free(j);
        return k3_err(err, K3_ERR_NOMEM, "kv cache: out of memory");
    }
    j->op = K3_KVS_SAVE_SNAPSHOT;
    j->pos = pos;
    j->drop_pos = drop_pos;
    j->junction = junction > 0 && junction < pos && junction % s->bs == 0 ? junction : 0;
    j->src = state;
    if (!(*ticket = enqueue(s, WR, j))) return dropped(s, j, err);
    return K3_OK;
}

int32_t k3_kvs_poll(k3_kvs *s, k3_kvs_done *out, int32_t max) {
    run_queued(s);
    pthread_mutex_lock(&s->mu);
    const int32_t n = s->n_done < max ? s->n_done : max;
    memcpy(out, s->done, sizeof *out * (size_t)n);
    memmove(s->done, s->done + n, sizeof *out * (size_t)(s->n_done - n));
    s->n_done -= n;
    pthread_mutex_unlock(&s->mu);
    return n;
}

k3_status k3_kvs_wait(k3_kvs *s, uint64_t ticket, k3_kvs_done *out, k3_error *err) {
    run_queued(s);
    pthread_mutex_lock(&s->mu);
    if (!ticket || ticket > s->next_ticket) {
        pthread_mutex_unlock(&s->mu);
        return k3_err(err, K3_ERR_ARG, "kv cache: no ticket %llu", (unsigned long long)ticket);
    }
    for (;;) {
        for (int32_t i = 0; i < s->n_done; i++)
            if (s->done[i].ticket == ticket) {
                *out = s->done[i];
                memmove(s->done + i, s->done + i + 1, sizeof *s->done * (size_t)(s->n_done - i - 1));
                s->n_done--;
                pthread_mutex_unlock(&s->mu);
                return K3_OK;
            }
        bool pending = false;
        for (int t = 0; t < 2; t++) {
            if (s->running[t] && s->running[t]->ticket == ticket) pending = true;
            for (job *j = s->head[t]; j; j = j->next) pending |= j->ticket == ticket;
        }
        if (!pending) {
            pthread_mutex_unlock(&s->mu);
            return k3_err(err, K3_ERR_ARG, "kv cache: ticket %llu was taken already", (unsigned long long)ticket);
        }
        pthread_cond_wait(&s->cv_done, &s->mu);
    }
}

void k3_kvs_cancel(k3_kvs *s, uint64_t ticket) {
    pthread_mutex_lock(&s->mu);
    for (int t = 0; t < 2; t++) {
        if (s->running[t] && s->running[t]->ticket == ticket && s->running[t]->op == K3_KVS_LOAD)
            s->running[t]->cancelled = true;
        for (job *j = s->head[t]; j; j = j->next)
            if (j->ticket == ticket && j->op == K3_KVS_LOAD) j->cancelled = true;
    }
    pthread_mutex_unlock(&s->mu);
}

void k3_kvs_get_metrics(k3_kvs *s, k3_kvs_metrics *out) {
    pthread_mutex_lock(&s->mm);
    *out = s->m;
    pthread_mutex_unlock(&s->mm);
    out->dir_bytes = __atomic_load_n(&s->usage->bytes, __ATOMIC_RELAXED);
    out->budget = s->o.disk_bytes;
    out->direct = s->direct;
}

k3_status k3_kvs_evict(k3_kvs *s, int64_t target, k3_error *err) {
    k3_kvs_evict_result r;
    K3_TRY(k3_kvs_dir_evict(s->dir, s->usage, target, 600, true, on_removed, s, &r, err));
    pthread_mutex_lock(&s->mm);
    s->m.evictions++;
    s->m.evicted_files += r.evicted_files;
    s->m.evicted_bytes += r.evicted_bytes;
    pthread_mutex_unlock(&s->mm);
    return K3_OK;
}

int32_t k3_kvs_block_size(const k3_kvs *s) { return s->bs; }
int32_t k3_kvs_run_blocks(const k3_kvs *s) { return s->R; }
int64_t k3_kvs_block_bytes(const k3_kvs *s) { return s->id.block_bytes; }
int64_t k3_kvs_state_bytes(const k3_kvs *s) { return s->id.state_bytes; }

/* ---- open / close ----------------------------------------------------------------------------- */

static int open_sub(const char *dir, const char *sub, k3_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, sub);
    if (mkdir(path, 0755) && errno != EEXIST) {
        k3_err(err, K3_ERR_IO, "kv cache: cannot make %s: %s", path, strerror(errno));
        return -1;
    }
    const int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) k3_err(err, K3_ERR_IO, "kv cache: cannot open %s: %s", path, strerror(errno));
    return fd;
}

/* Whether the directory's filesystem does O_DIRECT, and its alignments: a
 * file in tmp/ opened with it, and statx's STATX_DIOALIGN. A filesystem that
 * opens it but does not say its alignments (tmpfs: its "direct" I/O is the
 * page cache) stays buffered; so does one that needs more than a page. */
static void probe_direct(k3_kvs *s) {
    s->direct = false;
    if (s->o.buffered) {
        snprintf(s->io_why, sizeof s->io_why, "asked for");
        return;
    }
    char name[64];
    snprintf(name, sizeof name, "%d-%ld-probe.part", (int)getpid(), (long)syscall(SYS_gettid));
    const int fd = openat(s->tmp_fd, name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0644);
    if (fd < 0) {
        snprintf(s->io_why, sizeof s->io_why, "the filesystem refuses O_DIRECT: %s", strerror(errno));
        return;
    }
    struct statx sx;
    memset(&sx, 0, sizeof sx);
    const int r = statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx);
    close(fd);
    unlinkat(s->tmp_fd, name, 0);
    if (r || !(sx.stx_mask & STATX_DIOALIGN) || !sx.stx_dio_mem_align || !sx.stx_dio_offset_align)
        snprintf(s->io_why, sizeof s->io_why, "the filesystem does not say how O_DIRECT aligns (tmpfs)");
    else if (sx.stx_dio_mem_align > K3_KVS_ALIGN || sx.stx_dio_offset_align > K3_KVS_ALIGN ||
             K3_KVS_ALIGN % sx.stx_dio_offset_align)
        snprintf(s->io_why, sizeof s->io_why, "O_DIRECT needs an alignment of %u/%u bytes, more than a page",
                 sx.stx_dio_mem_align, sx.stx_dio_offset_align);
    else {
        s->direct = true;
        s->mem_align = (int32_t)sx.stx_dio_mem_align;
        s->off_align = (int32_t)sx.stx_dio_offset_align;
        snprintf(s->io_why, sizeof s->io_why, "O_DIRECT, aligned to %d bytes in memory, %d in the file", s->mem_align,
                 s->off_align);
    }
}

const char *k3_kvs_io(const k3_kvs *s, const char **why) {
    if (why) *why = s->io_why;
    return s->direct ? "direct" : "buffered";
}

k3_status k3_kvs_open(k3_kvs **out, const k3_kvs_options *opt, k3_error *err) {
    *out = NULL;
    if (!opt || !opt->dir || !*opt->dir || !opt->ctx)
        return k3_err(err, K3_ERR_ARG, "kv cache: a directory and a context are needed");
    if (opt->disk_bytes <= 0)
        return k3_err(err, K3_ERR_ARG, "kv cache: the disk budget must be positive (got %lld bytes)",
                      (long long)opt->disk_bytes);
    const char *quant = opt->quant ? opt->quant : "none";
    if (strlen(quant) >= K3_KVS_QUANT_LEN)
        return k3_err(err, K3_ERR_ARG, "kv cache: the quant mode name '%s' is too long", quant);
    k3_ctx *ctx = opt->ctx;
    k3_kvs *s = calloc(1, sizeof *s);
    if (!s) return k3_err(err, K3_ERR_NOMEM, "kv cache: out of memory");
    s->o = *opt;
    if (s->o.queue_max <= 0) s->o.queue_max = 256;
    s->ctx = ctx;
    s->runs_fd = s->snaps_fd = s->tmp_fd = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->mm, NULL);
    pthread_mutex_init(&s->snap_mu, NULL);
    pthread_cond_init(&s->cv_work, NULL);
    pthread_cond_init(&s->cv_done, NULL);
    s->dir = strdup(opt->dir);
    s->attn = malloc(sizeof(int32_t) * (size_t)ctx->c->n_layers);
    if (!s->dir || !s->attn) {
        k3_kvs_close(s);
        return k3_err(err, K3_ERR_NOMEM, "kv cache: out of memory");
    }
    s->o.dir = s->dir;
    /* the identity and the layout */
    k3_kvs_ident *id = &s->id;
    id->model = opt->model_id;
    snprintf(id->quant, sizeof id->quant, "%s", quant);
    id->kv = (uint32_t)ctx->kv;
    id->block_size = ctx->block_size;
    id->dcp_rank = ctx->dcp > 1 ? ctx->dcp_rank : 0;
    id->dcp_size = ctx->dcp > 1 ? ctx->dcp : 1;
    id->dcp_il = ctx->dcp > 1 ? ctx->dcp_il : 1;
    XXH3_state_t xs;
    XXH3_64bits_reset(&xs);
    int comps = 0;
    for (int32_t L = 0; L < ctx->c->n_layers; L++) {
        void *base[5];
        int64_t len[5];
        const int nc = k3_ctx_kv_block_ranges(ctx, L, 0, base, len);
        if (!nc) continue;
        s->attn[s->n_attn++] = L;
        comps += nc;
        XXH3_64bits_update(&xs, &L, sizeof L);
        for (int c = 0; c < nc; c++) {
            XXH3_64bits_update(&xs, &len[c], sizeof len[c]);
            id->block_bytes += len[c];
        }
    }
    id->layout = XXH3_64bits_digest(&xs);
    id->state_bytes = k3_ctx_state_bytes(ctx);
    s->max_iov = comps > 0 ? comps : 1;
    s->bs = ctx->block_size;
    if (!s->n_attn || id->block_bytes <= 0) {
        k3_kvs_close(s);
        return k3_err(err, K3_ERR_UNSUPPORTED, "kv cache: the model has no MLA/DSA layer to cache");
    }
    /* blocks per run: about 16 MiB per file, a power of two, from the layout
     * alone so every process of this namespace agrees */
    int32_t R = 1;
    while (R < K3_KVS_MAX_BLOCKS_PER_RUN && (int64_t)R * 2 * id->block_bytes <= (16ll << 20) &&
           (int64_t)R * 2 * s->bs <= K3_KVS_MAX_TOKENS_PER_RUN)
        R *= 2;
    if (opt->run_blocks > 0)
        R = opt->run_blocks < K3_KVS_MAX_BLOCKS_PER_RUN ? opt->run_blocks : K3_KVS_MAX_BLOCKS_PER_RUN;
    s->R = id->run_blocks = R;
    s->ns = XXH3_64bits(id, sizeof *id) ^ (uint64_t)K3_KVS_VERSION * 0x9E3779B97F4A7C15ull;
    /* the directory */
    if (mkdir(s->dir, 0755) && errno != EEXIST) {
        k3_err(err, K3_ERR_IO, "kv cache: cannot make %s: %s", s->dir, strerror(errno));
        k3_kvs_close(s);
        return K3_ERR_IO;
    }
    if ((s->runs_fd = open_sub(s->dir, "runs", err)) < 0 || (s->snaps_fd = open_sub(s->dir, "snaps", err)) < 0 ||
        (s->tmp_fd = open_sub(s->dir, "tmp", err)) < 0 || !(s->usage = k3_kvs_usage_map(s->dir, err))) {
        k3_kvs_close(s);
        return K3_ERR_IO;
    }
    probe_direct(s);
    say(s, "kv cache: %s: %s I/O (%s)", s->dir, s->direct ? "direct" : "buffered", s->io_why);
    /* set the counter from what is there (and trim to the budget) unless another process is at it */
    k3_kvs_evict_result r;
    k3_error e2 = {0};
    if (!k3_kvs_dir_evict(s->dir, s->usage, s->o.disk_bytes, 3600, false, on_removed, s, &r, &e2) && r.evicted_files)
        say(s, "kv cache: evicted %lld files (%lld bytes) to fit %lld bytes", (long long)r.evicted_files,
            (long long)r.evicted_bytes, (long long)s->o.disk_bytes);
    if (!s->o.no_threads)
        for (int t = 0; t < 2; t++) {
            worker_arg *wa = malloc(sizeof *wa);
            if (wa) *wa = (worker_arg){s, t};
            if (!wa || pthread_create(&s->th[t], NULL, worker, wa)) {
                free(wa);
                k3_kvs_close(s);
                return k3_err(err, K3_ERR_NOMEM, "kv cache: cannot start a thread");
            }
            s->th_started[t] = true;
            pthread_setname_np(s->th[t], t == RD ? "k3-kvs-read" : "k3-kvs-write"); /* in /proc, top -H */
        }
    *out = s;
    return K3_OK;
}

void k3_kvs_close(k3_kvs *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    for (job *j = s->head[RD]; j; j = j->next) j->cancelled = true;
    if (s->running[RD]) s->running[RD]->cancelled = true;
    s->stop = true;
    pthread_cond_broadcast(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    for (int t = 0; t < 2; t++)
        if (s->th_started[t]) pthread_join(s->th[t], NULL);
    run_queued(s);
    for (int t = 0; t < 2; t++)
        while (s->head[t]) {
            job *j = s->head[t];
            s->head[t] = j->next;
            job_free(j);
        }
    if (s->runs_fd >= 0) close(s->runs_fd);
    if (s->snaps_fd >= 0) close(s->snaps_fd);
    if (s->tmp_fd >= 0) close(s->tmp_fd);
    k3_kvs_usage_unmap(s->usage);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->mm);
    pthread_mutex_destroy(&s->snap_mu);
    pthread_cond_destroy(&s->cv_work);
    pthread_cond_destroy(&s->cv_done);
    free(s->snaps.k);
    free(s->snaps.used);
    free(s->done);
    free(s->attn);
    free(s->dir);
    free(s);
}
