/*
 * ngram.c -- the n-gram proposer's index (vLLM's prompt_lookup, llama.cpp's
 * lookup decoding): for each n in [n_min, n_max], the last position where
 * each n-gram of the sequence ended, in one open-addressing table; a draft
 * is what followed the most recent earlier occurrence of the longest n-gram
 * the sequence ends with. Memory: (n_max - n_min + 1) entries per token.
 */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "spec/spec.h"

static uint64_t gram_hash(const int32_t *t, int32_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    for (int32_t i = 0; i < n; i++) {
        h ^= (uint32_t)t[i];
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 29;
    }
    return h | 1; /* 0 = empty */
}

k3_status k3_ngram_init(k3_ngram *g, int32_t n_min, int32_t n_max, k3_error *err) {
    memset(g, 0, sizeof *g);
    if (n_min < 1 || n_max < n_min || n_max > 16)
        return k3_err(err, K3_ERR_RANGE, "n-gram proposer: prompt_lookup_min %d / max %d (need 1 <= min <= max <= 16)",
                      n_min, n_max);
    g->n_min = n_min;
    g->n_max = n_max;
    g->mask = 1023;
    g->key = calloc((size_t)g->mask + 1, sizeof *g->key);
    g->pos = malloc(sizeof *g->pos * ((size_t)g->mask + 1));
    if (!g->key || !g->pos) {
        k3_ngram_free(g);
        return k3_err(err, K3_ERR_NOMEM, "n-gram proposer: out of memory");
    }
    return K3_OK;
}

void k3_ngram_free(k3_ngram *g) {
    free(g->key);
    free(g->pos);
    memset(g, 0, sizeof *g);
}

int64_t k3_ngram_bytes(const k3_ngram *g) { return ((int64_t)g->mask + 1) * 16; }

static int64_t *slot(k3_ngram *g, uint64_t k, bool add) {
    for (uint64_t h = (k * 0x9E3779B97F4A7C15ull) >> 20 & g->mask;; h = (h + 1) & g->mask) {
        if (g->key[h] == k) return &g->pos[h];
        if (!g->key[h]) {
            if (!add) return NULL;
            g->key[h] = k;
            g->used++;
            return &g->pos[h];
        }
    }
}

static bool grow(k3_ngram *g) {
    const uint64_t mask = g->mask * 2 + 1;
    uint64_t *nk = calloc((size_t)mask + 1, sizeof *nk);
    int64_t *np = malloc(sizeof *np * ((size_t)mask + 1));
    if (!nk || !np) {
        free(nk);
        free(np);
        return false;
    }
    for (uint64_t i = 0; i <= g->mask; i++) {
        if (!g->key[i]) continue;
        uint64_t h = (g->key[i] * 0x9E3779B97F4A7C15ull) >> 20 & mask;
        while (nk[h]) h = (h + 1) & mask;
        nk[h] = g->key[i];
        np[h] = g->pos[i];
    }
    free(g->key);
    free(g->pos);
    g->key = nk;
    g->pos = np;
    g->mask = mask;
    return true;
}

void k3_ngram_index(k3_ngram *g, const int32_t *tok, int64_t n) {
    /* every n-gram that ends at a position < n - 1 (the last token's grams are
     * queried, not stored: a match must have a continuation) */
    for (int64_t e = g->n_indexed; e + 1 < n; e++) {
        for (int32_t L = g->n_min; L <= g->n_max && L <= e + 1; L++) {
            if ((g->used + 1) * 4 > (g->mask + 1) * 3 && !grow(g)) return;
            *slot(g, gram_hash(tok + e + 1 - L, L), true) = e;
        }
        g->n_indexed = e + 1;
    }
}

int32_t k3_ngram_draft(k3_ngram *g, const int32_t *tok, int64_t n, int32_t max, int32_t *draft, int32_t *match) {
    k3_ngram_index(g, tok, n);
    *match = 0;
    for (int32_t L = g->n_max; L >= g->n_min; L--) {
        if (L > n) continue;
        const int64_t *p = slot(g, gram_hash(tok + n - L, L), false);
        if (!p) continue;
        const int64_t e = *p; /* the earlier occurrence ends at e: it goes on at e + 1 */
        if (memcmp(tok + e + 1 - L, tok + n - L, sizeof(int32_t) * (size_t)L)) continue; /* a hash collision */
        int32_t k = 0;
        while (k < max && e + 1 + k < n) {
            draft[k] = tok[e + 1 + k];
            k++;
        }
        *match = L;
        return k;
    }
    return 0;
}
