/*
 * propose.c -- the proposers behind one interface (spec.h): suffix (a
 * sequence's own suffix tree over its prompt's last tokens and its output,
 * and its scope's tree of recent outputs), ngram (the most recent earlier
 * occurrence of the longest n-gram) and draft_model (draft_model.c).
 *
 * The scope cache: per scope (an API key's hash; 0 the default), the
 * outputs of the last suffix_max_cached_requests sequences that completed,
 * at most K3_SPEC_CACHE_TOKENS tokens of them, in one suffix tree; the
 * oldest go first (their counts come off the tree). Scopes beyond
 * suffix_max_scopes go least recently used first. A sequence only ever
 * reads its own scope's tree.
 *
 * A closed sequence's own tree is kept (up to K3_SPEC_SPARE_TREES, at most
 * K3_SPEC_SPARE_BYTES of them) and emptied for a later suffix sequence,
 * the largest first: a tree's memory made anew costs its page faults (in a
 * server of many threads, with TLB shootdowns) and its growth, which cost
 * more than indexing the prompt.
 */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "spec/draft_model.h"
#include "spec/spec.h"

#define K3_SPEC_CACHE_TOKENS 65536 /* tokens of past outputs per scope */
#define K3_SPEC_OUT_TOKENS 16384   /* a sequence's output tokens the scope's cache takes at most */
/* The prompt's last tokens cached before each output in its scope's tree:
 * a request that repeats an earlier one (a retry, a regenerate, the same
 * tool call) then matches that output from its first token, at the depth
 * of this context, instead of one token at a time. */
#define K3_SPEC_OUT_CONTEXT 12
#define K3_SPEC_SPARE_TREES 16                   /* closed sequences' trees kept for the next ones */
#define K3_SPEC_SPARE_BYTES ((int64_t)128 << 20) /* ... at most this many bytes of them */

typedef struct scope_cache {
    uint64_t scope;
    k3_stree tree;
    int32_t **text; /* ring of cached outputs, oldest at head */
    int64_t *len;
    int32_t head, n, cap;
    int64_t tokens;
    uint64_t used; /* the proposer's tick when last used */
} scope_cache;

struct k3_proposer {
    k3_spec_config cfg;
    scope_cache *scopes;
    int32_t n_scopes;
    uint64_t tick;
    k3_draft_model *dm; /* the draft model, or NULL */
    /* the trees of closed suffix sequences, emptied by the next ones: a new
     * tree's allocations, page faults and table growth cost as much as
     * indexing a prompt into a warm one */
    k3_stree spare[K3_SPEC_SPARE_TREES];
    int32_t n_spare;
    int64_t spare_bytes;
};

struct k3_spec_seq {
    k3_spec_method method;
    uint64_t scope;
    /* suffix */
    bool has_tree;
    k3_stree tree;
    k3_sactive act;   /* the sequence's suffixes in its own tree */
    k3_sactive gact;  /* ... in its scope's tree */
    int32_t tail[64]; /* the last depth tokens, for a rematch */
    int32_t n_tail;
    int32_t *out; /* the prompt's last K3_SPEC_OUT_CONTEXT tokens (n_ctx) and its output, for the scope's cache */
    int64_t n_out, cap_out, n_ctx;
    /* ngram */
    bool has_ngram;
    k3_ngram ng;
    /* draft model */
    int32_t dslot;
};

const char *k3_spec_method_name(k3_spec_method m) {
    switch (m) {
    case K3_SPEC_SUFFIX: return "suffix";
    case K3_SPEC_NGRAM: return "ngram";
    case K3_SPEC_DRAFT_MODEL: return "draft_model";
    default: return "off";
    }
}

k3_status k3_spec_method_parse(const char *s, k3_spec_method *out, k3_error *err) {
    static const k3_spec_method all[] = {K3_SPEC_OFF, K3_SPEC_SUFFIX, K3_SPEC_NGRAM, K3_SPEC_DRAFT_MODEL};
    for (size_t i = 0; s && i < sizeof all / sizeof all[0]; i++)
        if (!strcmp(s, k3_spec_method_name(all[i]))) {
            *out = all[i];
            return K3_OK;
        }
    if (s && !strcmp(s, "draft")) {
        *out = K3_SPEC_DRAFT_MODEL;
        return K3_OK;
    }
    return k3_err(err, K3_ERR_ARG, "speculative method '%s' is not one of suffix, ngram, draft_model, off",
                  s ? s : "(null)");
}

k3_status k3_proposer_open(k3_proposer **out, const k3_spec_config *cfg, int32_t max_seqs, int64_t max_len,
                           k3_error *err) {
    *out = NULL;
    k3_spec_config c = *cfg;
    if (c.num_speculative_tokens < 0 || c.num_speculative_tokens > K3_SPEC_MAX_DRAFT)
        return k3_err(err, K3_ERR_RANGE, "num_speculative_tokens %d is not in 0..%d", c.num_speculative_tokens,
                      K3_SPEC_MAX_DRAFT);
    if (!c.suffix_max_tree_depth) c.suffix_max_tree_depth = 24;
    if (c.suffix_max_tree_depth < 1 || c.suffix_max_tree_depth > 63)
        return k3_err(err, K3_ERR_RANGE, "suffix_decoding_max_tree_depth %d is not in 1..63", c.suffix_max_tree_depth);
    if (!c.suffix_max_cached_requests) c.suffix_max_cached_requests = 64;
    if (!(c.suffix_max_spec_factor >= 0) || !(c.suffix_min_token_prob >= 0 && c.suffix_min_token_prob <= 1))
        return k3_err(err, K3_ERR_RANGE,
                      "suffix_decoding_max_spec_factor must be >= 0 and suffix_decoding_min_token_prob in [0, 1]");
    if (c.suffix_max_spec_factor == 0) c.suffix_max_spec_factor = 1.0f;
    if (c.suffix_min_token_prob == 0) c.suffix_min_token_prob = 0.1f;
    if (c.suffix_prompt_window <= 0) c.suffix_prompt_window = 16384;
    if (!c.suffix_max_scopes) c.suffix_max_scopes = 64;
    if (!c.prompt_lookup_min) c.prompt_lookup_min = 2;
    if (!c.prompt_lookup_max) c.prompt_lookup_max = c.prompt_lookup_min > 5 ? c.prompt_lookup_min : 5;
    if (c.prompt_lookup_min < 1 || c.prompt_lookup_max < c.prompt_lookup_min || c.prompt_lookup_max > 16)
        return k3_err(err, K3_ERR_RANGE, "prompt_lookup_min %d / prompt_lookup_max %d (need 1 <= min <= max <= 16)",
                      c.prompt_lookup_min, c.prompt_lookup_max);
    if (c.method == K3_SPEC_DRAFT_MODEL && !c.draft_model)
        return k3_err(err, K3_ERR_ARG, "speculative method draft_model needs a draft model");
    k3_proposer *p = calloc(1, sizeof *p);
    if (!p) return k3_err(err, K3_ERR_NOMEM, "proposer: out of memory");
    p->cfg = c;
    if (c.draft_model) {
        const k3_status st = k3_draft_model_open(&p->dm, c.draft_model, c.pool, c.kv_cache, max_seqs, max_len, err);
        if (st) {
            free(p);
            return st;
        }
    }
    *out = p;
    return K3_OK;
}

static void scope_free(scope_cache *sc) {
    k3_stree_free(&sc->tree);
    for (int32_t i = 0; i < sc->n; i++) free(sc->text[(sc->head + i) % sc->cap]);
    free(sc->text);
    free(sc->len);
}

void k3_proposer_close(k3_proposer *p) {
    if (!p) return;
    for (int32_t i = 0; i < p->n_scopes; i++) scope_free(&p->scopes[i]);
    free(p->scopes);
    for (int32_t i = 0; i < p->n_spare; i++) k3_stree_free(&p->spare[i]);
    k3_draft_model_close(p->dm);
    free(p);
}

int64_t k3_proposer_bytes(const k3_proposer *p) {
    int64_t b = 0;
    for (int32_t i = 0; i < p->n_scopes; i++) b += k3_stree_bytes(&p->scopes[i].tree) + p->scopes[i].tokens * 4;
    for (int32_t i = 0; i < p->n_spare; i++) b += k3_stree_bytes(&p->spare[i]);
    return b;
}

static scope_cache *scope_find(k3_proposer *p, uint64_t scope) {
    for (int32_t i = 0; i < p->n_scopes; i++)
        if (p->scopes[i].scope == scope) {
            p->scopes[i].used = ++p->tick;
            return &p->scopes[i];
        }
    return NULL;
}

/* The scope's cache, made (evicting the least recently used scope when
 * there are suffix_max_scopes), or NULL out of memory. */
static scope_cache *scope_get(k3_proposer *p, uint64_t scope) {
    scope_cache *sc = scope_find(p, scope);
    if (sc) return sc;
    if (p->n_scopes >= p->cfg.suffix_max_scopes) {
        int32_t lru = 0;
        for (int32_t i = 1; i < p->n_scopes; i++)
            if (p->scopes[i].used < p->scopes[lru].used) lru = i;
        scope_free(&p->scopes[lru]);
        p->scopes[lru] = p->scopes[--p->n_scopes];
    } else {
        scope_cache *a = realloc(p->scopes, sizeof *a * (size_t)(p->n_scopes + 1));
        if (!a) return NULL;
        p->scopes = a;
    }
    sc = &p->scopes[p->n_scopes];
    memset(sc, 0, sizeof *sc);
    sc->cap = p->cfg.suffix_max_cached_requests > 0 ? p->cfg.suffix_max_cached_requests : 1;
    sc->text = calloc((size_t)sc->cap, sizeof *sc->text);
    sc->len = calloc((size_t)sc->cap, sizeof *sc->len);
    if (!sc->text || !sc->len ||
        k3_stree_init(&sc->tree, p->cfg.suffix_max_tree_depth,
                      (int64_t)K3_SPEC_CACHE_TOKENS * p->cfg.suffix_max_tree_depth + 1, NULL)) {
        free(sc->text);
        free(sc->len);
        return NULL;
    }
    sc->scope = scope;
    sc->used = ++p->tick;
    p->n_scopes++;
    return sc;
}

/* Takes the oldest output off the scope's tree. */
static void scope_evict(scope_cache *sc) {
    const int32_t i = sc->head;
    k3_sactive a = {0};
    for (int64_t t = 0; t < sc->len[i]; t++) k3_stree_pop(&sc->tree, &a, sc->text[i][t]);
    sc->tokens -= sc->len[i];
    free(sc->text[i]);
    sc->text[i] = NULL;
    sc->head = (sc->head + 1) % sc->cap;
    sc->n--;
}

k3_status k3_spec_seq_open(k3_proposer *p, k3_spec_seq **out, k3_spec_method method, uint64_t scope,
                           const int32_t *prompt, int64_t n_prompt, k3_error *err) {
    *out = NULL;
    if (method == K3_SPEC_OFF || method == K3_SPEC_DEFAULT) return K3_OK;
    if (method == K3_SPEC_DRAFT_MODEL && !p->dm)
        return k3_err(err, K3_ERR_UNSUPPORTED, "speculative method draft_model: this engine has no draft model");
    k3_spec_seq *s = calloc(1, sizeof *s);
    if (!s) return k3_err(err, K3_ERR_NOMEM, "proposer: out of memory");
    s->method = method;
    s->scope = scope;
    s->dslot = -1;
    k3_status st = K3_OK;
    if (method == K3_SPEC_SUFFIX) {
        const int32_t D = p->cfg.suffix_max_tree_depth;
        const int64_t from = n_prompt > p->cfg.suffix_prompt_window ? n_prompt - p->cfg.suffix_prompt_window : 0;
        const int64_t budget = (n_prompt - from + K3_SPEC_OUT_TOKENS) * D + 1;
        if (p->n_spare > 0) { /* the largest (the least likely to grow again) */
            int32_t b = 0;
            for (int32_t i = 1; i < p->n_spare; i++)
                if (p->spare[i].cap >= p->spare[b].cap) b = i;
            s->tree = p->spare[b];
            p->spare_bytes -= k3_stree_bytes(&s->tree);
            p->spare[b] = p->spare[--p->n_spare];
            k3_stree_clear(&s->tree, budget, (n_prompt - from) * D);
        } else st = k3_stree_init(&s->tree, D, budget, err);
        s->has_tree = !st;
        for (int64_t i = from; !st && i < n_prompt; i++) k3_stree_push(&s->tree, &s->act, prompt[i]);
        const int64_t nt = n_prompt < D ? n_prompt : D;
        memcpy(s->tail, prompt + n_prompt - nt, sizeof(int32_t) * (size_t)nt);
        s->n_tail = (int32_t)nt;
        s->gact.version = ~0ull; /* matched against the scope's tree when first asked */
        /* the output goes to the scope's cache after the prompt's last tokens */
        const int64_t nc = n_prompt < K3_SPEC_OUT_CONTEXT ? n_prompt : K3_SPEC_OUT_CONTEXT;
        if (!st && nc > 0 && (s->out = malloc(sizeof *s->out * 256))) {
            memcpy(s->out, prompt + n_prompt - nc, sizeof *s->out * (size_t)nc);
            s->n_out = s->n_ctx = nc;
            s->cap_out = 256;
        }
    } else if (method == K3_SPEC_NGRAM) {
        st = k3_ngram_init(&s->ng, p->cfg.prompt_lookup_min, p->cfg.prompt_lookup_max, err);
        s->has_ngram = !st;
    } else {
        st = k3_draft_model_seq_open(p->dm, &s->dslot, err);
    }
    if (st) {
        k3_spec_seq_close(p, s, false);
        return st;
    }
    *out = s;
    return K3_OK;
}

k3_spec_method k3_spec_seq_method(const k3_spec_seq *s) { return s ? s->method : K3_SPEC_OFF; }

void k3_spec_seq_append(k3_proposer *p, k3_spec_seq *s, const int32_t *tok, int32_t n) {
    if (!s || s->method != K3_SPEC_SUFFIX) return;
    const int32_t D = p->cfg.suffix_max_tree_depth;
    scope_cache *sc = p->cfg.suffix_max_cached_requests > 0 ? scope_find(p, s->scope) : NULL;
    for (int32_t i = 0; i < n; i++) {
        k3_stree_push(&s->tree, &s->act, tok[i]); /* past its node budget the matches only get shorter */
        if (s->n_out < K3_SPEC_OUT_TOKENS) {
            if (s->n_out == s->cap_out) {
                const int64_t cap = s->cap_out ? 2 * s->cap_out : 256;
                int32_t *o = realloc(s->out, sizeof *o * (size_t)cap);
                if (o) {
                    s->out = o;
                    s->cap_out = cap;
                }
            }
            if (s->n_out < s->cap_out) s->out[s->n_out++] = tok[i];
        }
        if (sc && s->gact.version == sc->tree.version) k3_stree_follow(&sc->tree, &s->gact, tok[i]);
        if (s->n_tail == D) memmove(s->tail, s->tail + 1, sizeof(int32_t) * (size_t)(D - 1));
        else s->n_tail++;
        s->tail[s->n_tail - 1] = tok[i];
    }
}

int32_t k3_spec_seq_propose(k3_proposer *p, k3_spec_seq *s, const int32_t *tok, int64_t n, int32_t max, int32_t *draft,
                            float *conf) {
    if (!s || max <= 0) return 0;
    if (max > K3_SPEC_MAX_DRAFT) max = K3_SPEC_MAX_DRAFT;
    if (s->method == K3_SPEC_NGRAM) {
        int32_t match = 0;
        const int32_t k = k3_ngram_draft(&s->ng, tok, n, max, draft, &match);
        for (int32_t i = 0; i < k; i++) conf[i] = 0.7f; /* no counts: the acceptance calibrates it */
        return k;
    }
    if (s->method == K3_SPEC_DRAFT_MODEL) return k3_draft_model_propose(p->dm, s->dslot, tok, n, max, draft, conf);
    const k3_spec_config *c = &p->cfg;
    float score = 0, gscore = 0;
    int32_t k = k3_stree_draft(&s->tree, &s->act, true, max, c->suffix_max_spec_factor, c->suffix_min_token_prob, draft,
                               conf, &score);
    scope_cache *sc = c->suffix_max_cached_requests > 0 ? scope_find(p, s->scope) : NULL;
    if (sc && sc->tree.n_nodes > 1) {
        if (s->gact.version != sc->tree.version) k3_stree_rematch(&sc->tree, &s->gact, s->tail, s->n_tail);
        int32_t gd[K3_SPEC_MAX_DRAFT];
        float gc[K3_SPEC_MAX_DRAFT];
        const int32_t gk = k3_stree_draft(&sc->tree, &s->gact, false, max, c->suffix_max_spec_factor,
                                          c->suffix_min_token_prob, gd, gc, &gscore);
        if (gscore > score) {
            memcpy(draft, gd, sizeof(int32_t) * (size_t)gk);
            memcpy(conf, gc, sizeof(float) * (size_t)gk);
            k = gk;
        }
    }
    return k;
}

/* A completed output joins its scope's cache; the cache takes the buffer
 * (or frees it). */
static void cache_output(k3_proposer *p, uint64_t scope, int32_t *out, int64_t n_out) {
    scope_cache *sc = n_out > 0 && p->cfg.suffix_max_cached_requests > 0 ? scope_get(p, scope) : NULL;
    if (!sc || n_out > K3_SPEC_CACHE_TOKENS) {
        free(out);
        return;
    }
    while (sc->n > 0 && (sc->n == sc->cap || sc->tokens + n_out > K3_SPEC_CACHE_TOKENS)) scope_evict(sc);
    const int32_t at = (sc->head + sc->n) % sc->cap;
    sc->text[at] = out;
    sc->len[at] = n_out;
    sc->n++;
    sc->tokens += n_out;
    k3_sactive a = {0};
    for (int64_t t = 0; t < n_out; t++) k3_stree_push(&sc->tree, &a, out[t]);
}

void k3_spec_cache_output(k3_proposer *p, k3_spec_method method, uint64_t scope, const int32_t *tok, int64_t n_prompt,
                          int64_t n_gen) {
    if (method != K3_SPEC_SUFFIX || n_gen <= 0 || p->cfg.suffix_max_cached_requests <= 0) return;
    const int64_t n_ctx = n_prompt < K3_SPEC_OUT_CONTEXT ? n_prompt : K3_SPEC_OUT_CONTEXT;
    tok += n_prompt - n_ctx;
    int64_t n = n_ctx + n_gen;
    if (n > K3_SPEC_OUT_TOKENS) n = K3_SPEC_OUT_TOKENS;
    int32_t *out = malloc(sizeof *out * (size_t)n);
    if (!out) return; /* out of memory: not cached */
    memcpy(out, tok, sizeof *out * (size_t)n);
    cache_output(p, scope, out, n);
}

void k3_spec_seq_close(k3_proposer *p, k3_spec_seq *s, bool completed) {
    if (!s) return;
    if (s->method == K3_SPEC_SUFFIX && completed && s->n_out > s->n_ctx && p->cfg.suffix_max_cached_requests > 0) {
        cache_output(p, s->scope, s->out, s->n_out);
        s->out = NULL;
    }
    if (s->has_tree) {
        const int64_t b = k3_stree_bytes(&s->tree);
        if (p->n_spare < K3_SPEC_SPARE_TREES && p->spare_bytes + b <= K3_SPEC_SPARE_BYTES) {
            p->spare[p->n_spare++] = s->tree;
            p->spare_bytes += b;
        } else k3_stree_free(&s->tree);
    }
    if (s->has_ngram) k3_ngram_free(&s->ng);
    if (s->dslot >= 0) k3_draft_model_seq_close(p->dm, s->dslot);
    free(s->out);
    free(s);
}
