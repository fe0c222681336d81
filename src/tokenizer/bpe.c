/*
 * bpe.c -- rank BPE with tiktoken's semantics (see tokenizer_internal.h).
 *
 * A .tiktoken file lists every token as `base64(bytes) rank`. There is no
 * merge list: the rank of a byte string is its merge priority. Encoding a
 * piece starts from single bytes and repeatedly merges the adjacent pair
 * whose concatenation has the lowest rank, the leftmost one on a tie, until
 * no adjacent pair is a token. That is tiktoken's _byte_pair_merge, which
 * rescans all pairs after each merge (quadratic); merge_scan() copies it for
 * short pieces and merge_heap() gives the same merges in O(n log n) for long
 * ones (a run of digits-free punctuation or a base64 blob can be megabytes).
 */
#include "tokenizer/tokenizer_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/file.h"

#define NO_RANK UINT32_MAX

k3_status k3_ids_push(k3_ids *ids, int32_t id, k3_error *err) {
    if (ids->n == ids->cap) {
        size_t cap = ids->cap ? ids->cap * 2 : 64;
        int32_t *v = realloc(ids->v, cap * sizeof *v);
        if (!v) return k3_err(err, K3_ERR_NOMEM, "out of memory for %zu token ids", cap);
        ids->v = v;
        ids->cap = cap;
    }
    ids->v[ids->n++] = id;
    return K3_OK;
}

/* ---- hash map: bytes -> rank ------------------------------------------- */

static uint32_t hash_bytes(const uint8_t *s, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
        s += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, s, n);
    h = (h ^ w) * 0x94D049BB133111EBull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return (uint32_t)h;
}

int32_t k3_bpe_rank(const k3_bpe *b, const uint8_t *s, size_t n) {
    uint32_t h = hash_bytes(s, n);
    for (uint32_t i = h & b->mask;; i = (i + 1) & b->mask) {
        const k3_bpe_slot *e = &b->slots[i];
        if (e->rank < 0) return -1;
        if (e->hash != h) continue;
        uint32_t off = b->offset[e->rank];
        if (b->offset[e->rank + 1] - off == n && memcmp(b->bytes + off, s, n) == 0) return e->rank;
    }
}

/* ---- loading ------------------------------------------------------------ */

void k3_bpe_free(k3_bpe *b) {
    if (!b) return;
    free(b->bytes);
    free(b->offset);
    free(b->slots);
    memset(b, 0, sizeof *b);
}

static int b64_value(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Strict standard base64 (padding required). Returns the decoded length, or
 * -1 when s is not base64. out has room for n / 4 * 3 bytes. */
static long b64_decode(const char *s, size_t n, uint8_t *out) {
    if (n == 0 || n % 4) return -1;
    size_t pad = 0;
    if (s[n - 1] == '=') pad = s[n - 2] == '=' ? 2 : 1;
    long len = 0;
    for (size_t i = 0; i < n; i += 4) {
        uint32_t v = 0;
        for (size_t k = 0; k < 4; k++) {
            int d;
            if (i + k >= n - pad) d = 0; /* a padding position */
            else if ((d = b64_value((unsigned char)s[i + k])) < 0) return -1;
            v = v << 6 | (uint32_t)d;
        }
        size_t keep = i + 4 == n ? 3 - pad : 3;
        for (size_t k = 0; k < keep; k++) out[len++] = (uint8_t)(v >> (16 - 8 * k));
    }
    return len;
}

/* Cut [p, end) at the first '\n'. Returns the line without "\r\n"/"\n" and
 * moves *p past the line. */
static size_t next_line(const char **p, const char *end, const char **line) {
    const char *s = *p, *nl = memchr(s, '\n', (size_t)(end - s));
    const char *e = nl ? nl : end;
    *p = nl ? nl + 1 : end;
    if (e > s && e[-1] == '\r') e--;
    *line = s;
    return (size_t)(e - s);
}

k3_status k3_bpe_parse(k3_bpe *b, const char *text, size_t len, const char *name, k3_error *err) {
    memset(b, 0, sizeof *b);
    b->heap_min = K3_BPE_HEAP_MIN;
    const char *end = text + len, *p, *line;

    /* Pass 1: count tokens so ranks can be checked as they are read. */
    size_t n = 0;
    for (p = text; p < end;)
        if (next_line(&p, end, &line)) n++;
    if (n == 0) return k3_err(err, K3_ERR_FORMAT, "%s: no tokens", name);
    if (n > (size_t)INT32_MAX - K3_N_SPECIALS) return k3_err(err, K3_ERR_FORMAT, "%s: too many tokens (%zu)", name, n);

    k3_status st = K3_OK;
    uint8_t *raw = malloc(len / 4 * 3 + 1); /* decoded bytes, file order */
    uint32_t *raw_off = malloc(n * sizeof *raw_off);
    uint32_t *raw_len = malloc(n * sizeof *raw_len); /* by rank */
    b->offset = malloc((n + 1) * sizeof *b->offset);
    if (!raw || !raw_off || !raw_len || !b->offset) {
        st = k3_err(err, K3_ERR_NOMEM, "%s: out of memory for %zu tokens", name, n);
        goto done;
    }
    for (size_t r = 0; r < n; r++) raw_len[r] = UINT32_MAX; /* rank not seen yet */

    /* Pass 2: decode each line; raw_off/raw_len are indexed by rank. */
    size_t lineno = 0, used = 0;
    for (p = text; p < end;) {
        size_t ll = next_line(&p, end, &line);
        lineno++;
        if (ll == 0) continue;
        const char *sp = memchr(line, ' ', ll);
        if (!sp) {
            st = k3_err(err, K3_ERR_FORMAT, "%s:%zu: expected `base64 rank`", name, lineno);
            goto done;
        }
        long tl = b64_decode(line, (size_t)(sp - line), raw + used);
        if (tl <= 0) {
            st = k3_err(err, K3_ERR_FORMAT, "%s:%zu: bad base64 token", name, lineno);
            goto done;
        }
        const char *d = sp + 1, *de = line + ll;
        uint64_t rank = 0;
        if (d == de || de - d > 10) goto bad_rank;
        for (; d < de; d++) {
            if (*d < '0' || *d > '9') goto bad_rank;
            rank = rank * 10 + (uint64_t)(*d - '0');
        }
        if (rank >= n) {
            st = k3_err(err, K3_ERR_FORMAT,
                        "%s:%zu: rank %llu out of range (the file has %zu tokens; "
                        "ranks must be 0..%zu)",
                        name, lineno, (unsigned long long)rank, n, n - 1);
            goto done;
        }
        if (raw_len[rank] != UINT32_MAX) {
            st = k3_err(err, K3_ERR_FORMAT, "%s:%zu: duplicate rank %llu", name, lineno, (unsigned long long)rank);
            goto done;
        }
        raw_off[rank] = (uint32_t)used;
        raw_len[rank] = (uint32_t)tl;
        used += (size_t)tl;
        continue;
    bad_rank:
        st = k3_err(err, K3_ERR_FORMAT, "%s:%zu: rank is not a number: \"%.*s\"", name, lineno,
                    (int)(de - (sp + 1) < 40 ? de - (sp + 1) : 40), sp + 1);
        goto done;
    }
    if (used > UINT32_MAX) {
        st = k3_err(err, K3_ERR_FORMAT, "%s: token bytes exceed 4 GiB", name);
        goto done;
    }
    /* n lines, n distinct ranks each < n: every rank 0..n-1 is present. */

    /* Token bytes in rank order, so offset[r + 1] - offset[r] is a length. */
    b->bytes = malloc(used ? used : 1);
    uint32_t cap = 1;
    while (cap < 2 * n) cap <<= 1;
    b->slots = malloc((size_t)cap * sizeof *b->slots);
    if (!b->bytes || !b->slots) {
        st = k3_err(err, K3_ERR_NOMEM, "%s: out of memory for %zu tokens", name, n);
        goto done;
    }
    b->mask = cap - 1;
    b->n_ranks = (int32_t)n;
    for (uint32_t i = 0; i < cap; i++) b->slots[i].rank = -1;
    uint32_t off = 0;
    for (size_t r = 0; r < n; r++) {
        b->offset[r] = off;
        memcpy(b->bytes + off, raw + raw_off[r], raw_len[r]);
        off += raw_len[r];
    }
    b->offset[n] = off;

    for (size_t r = 0; r < n; r++) {
        const uint8_t *s = b->bytes + b->offset[r];
        size_t sl = raw_len[r];
        if (k3_bpe_rank(b, s, sl) >= 0) {
            /* Find the line for the message: the later of the two ranks. */
            st = k3_err(err, K3_ERR_FORMAT, "%s: ranks %d and %zu have the same bytes", name, k3_bpe_rank(b, s, sl), r);
            goto done;
        }
        uint32_t h = hash_bytes(s, sl), i = h & b->mask;
        while (b->slots[i].rank >= 0) i = (i + 1) & b->mask;
        b->slots[i] = (k3_bpe_slot){h, (int32_t)r};
    }
    /* Byte-level BPE must be able to fall back to single bytes. */
    for (int c = 0; c < 256; c++) {
        uint8_t byte = (uint8_t)c;
        if (k3_bpe_rank(b, &byte, 1) < 0) {
            st = k3_err(err, K3_ERR_FORMAT, "%s: no token for the single byte 0x%02x", name, c);
            goto done;
        }
    }

done:
    free(raw);
    free(raw_off);
    free(raw_len);
    if (st != K3_OK) k3_bpe_free(b);
    return st;
}

/* The largest rank file read: Kimi's is 2.6 MB, o200k's 3.6 MB. */
#define BPE_MAX_FILE_BYTES ((size_t)64 << 20)

k3_status k3_bpe_load(k3_bpe *b, const char *path, k3_error *err) {
    memset(b, 0, sizeof *b);
    char *buf;
    size_t len;
    k3_status st = k3_file_read(path, BPE_MAX_FILE_BYTES, "a tiktoken rank file", &buf, &len, err);
    if (st != K3_OK) return st;
    st = k3_bpe_parse(b, buf, len, path, err);
    free(buf);
    return st;
}

/* ---- merging ------------------------------------------------------------ */

static uint32_t rank_or_none(const k3_bpe *b, const uint8_t *s, size_t n) {
    int32_t r = k3_bpe_rank(b, s, n);
    return r < 0 ? NO_RANK : (uint32_t)r;
}

/* Appends the token of each final part. Every part is a token: it is a
 * single byte (all present, checked at load) or the result of a merge. */
static k3_status emit(const k3_bpe *b, const uint8_t *s, size_t start, size_t end, k3_ids *out, k3_error *err) {
    int32_t r = k3_bpe_rank(b, s + start, end - start);
    K3_ASSERT(r >= 0);
    return k3_ids_push(out, r, err);
}

typedef struct part {
    uint32_t start; /* first byte of the part */
    uint32_t rank;  /* rank of this part joined with the next, or NO_RANK */
} part;

/* tiktoken's _byte_pair_merge, step for step. */
static k3_status merge_scan(const k3_bpe *b, const uint8_t *s, size_t n, k3_ids *out, k3_error *err) {
    part local[K3_BPE_HEAP_MIN + 1], *pt = local;
    if (n + 1 > sizeof local / sizeof local[0]) {
        pt = malloc((n + 1) * sizeof *pt);
        if (!pt) return k3_err(err, K3_ERR_NOMEM, "out of memory merging a %zu-byte piece", n);
    }
    size_t np = 0;
    for (size_t i = 0; i + 1 < n; i++) pt[np++] = (part){(uint32_t)i, rank_or_none(b, s + i, 2)};
    pt[np++] = (part){(uint32_t)(n - 1), NO_RANK};
    pt[np++] = (part){(uint32_t)n, NO_RANK};

    for (;;) {
        uint32_t best = NO_RANK;
        size_t i = 0;
        for (size_t k = 0; k + 1 < np; k++)
            if (pt[k].rank < best) best = pt[k].rank, i = k;
        if (best == NO_RANK) break;
        /* Parts i and i+1 become one; re-rank its pairs with both neighbours
         * (part k joined with k+1 spans pt[k].start .. pt[k+3].start while
         * i+1 is still in the array). */
        if (i > 0)
            pt[i - 1].rank =
                i + 2 < np ? rank_or_none(b, s + pt[i - 1].start, pt[i + 2].start - pt[i - 1].start) : NO_RANK;
        pt[i].rank = i + 3 < np ? rank_or_none(b, s + pt[i].start, pt[i + 3].start - pt[i].start) : NO_RANK;
        memmove(pt + i + 1, pt + i + 2, (np - i - 2) * sizeof *pt);
        np--;
    }
    k3_status st = K3_OK;
    for (size_t k = 0; k + 1 < np && st == K3_OK; k++) st = emit(b, s, pt[k].start, pt[k + 1].start, out, err);
    if (pt != local) free(pt);
    return st;
}

/* The same merges with a binary heap of candidate pairs ordered by (rank,
 * position): the smallest is exactly the pair the scan would pick. Parts
 * form a linked list over byte positions; a part's version changes whenever
 * its pair with the next part changes, which voids older heap entries. */
typedef struct cand {
    uint32_t rank, pos, version;
} cand;

static bool cand_less(cand a, cand b) { return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos); }

static void heap_push(cand *h, size_t *n, cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!cand_less(c, h[up])) break;
        h[i] = h[up];
        i = up;
    }
    h[i] = c;
}

static cand heap_pop(cand *h, size_t *n) {
    cand top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && cand_less(h[c + 1], h[c])) c++;
        if (!cand_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

static k3_status merge_heap(const k3_bpe *b, const uint8_t *s, size_t n, k3_ids *out, k3_error *err) {
    /* next[i]: start of the part after the part at i (n at the end);
     * prev[i]: start of the part before (UINT32_MAX at the start);
     * version[i]: UINT32_MAX once the part at i is merged away. */
    uint32_t *next = malloc(n * sizeof *next), *prev = malloc(n * sizeof *prev);
    uint32_t *version = calloc(n, sizeof *version);
    cand *heap = malloc(3 * n * sizeof *heap); /* n initial + 2 per merge */
    k3_status st = K3_OK;
    if (!next || !prev || !version || !heap) {
        st = k3_err(err, K3_ERR_NOMEM, "out of memory merging a %zu-byte piece", n);
        goto done;
    }
    size_t nh = 0;
    for (size_t i = 0; i < n; i++) {
        next[i] = (uint32_t)(i + 1);
        prev[i] = i ? (uint32_t)(i - 1) : UINT32_MAX;
        if (i + 1 < n) {
            uint32_t r = rank_or_none(b, s + i, 2);
            if (r != NO_RANK) heap_push(heap, &nh, (cand){r, (uint32_t)i, 0});
        }
    }
    while (nh) {
        cand c = heap_pop(heap, &nh);
        uint32_t i = c.pos;
        if (version[i] != c.version) continue; /* stale or merged away */
        uint32_t j = next[i], k = next[j];     /* k may be n */
        next[i] = k;
        if (k < n) prev[k] = i;
        version[j] = UINT32_MAX;
        version[i]++;
        if (k < n) {
            uint32_t r = rank_or_none(b, s + i, next[k] - i);
            if (r != NO_RANK) heap_push(heap, &nh, (cand){r, i, version[i]});
        }
        uint32_t p = prev[i];
        if (p != UINT32_MAX) {
            version[p]++;
            uint32_t r = rank_or_none(b, s + p, k - p);
            if (r != NO_RANK) heap_push(heap, &nh, (cand){r, p, version[p]});
        }
    }
    for (size_t i = 0; i < n && st == K3_OK; i = next[i]) st = emit(b, s, i, next[i], out, err);
done:
    free(next);
    free(prev);
    free(version);
    free(heap);
    return st;
}

k3_status k3_bpe_encode_piece(const k3_bpe *b, const uint8_t *s, size_t n, k3_ids *out, k3_error *err) {
    if (n == 0) return K3_OK;
    int32_t r = k3_bpe_rank(b, s, n);
    if (r >= 0) return k3_ids_push(out, r, err);
    if (n >= UINT32_MAX / 4) return k3_err(err, K3_ERR_RANGE, "a %zu-byte piece is too long to encode", n);
    return n < b->heap_min ? merge_scan(b, s, n, out, err) : merge_heap(b, s, n, out, err);
}
