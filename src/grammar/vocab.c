/*
 * vocab.c -- k3_grammar_vocab: a model's tokens as the grammar engine reads
 * them, built once per model.
 *
 * Ordinary tokens go into a byte trie stored in preorder: node i has the
 * byte on its incoming edge, its depth, and the index just past its
 * subtree, so a walk is a forward scan that jumps over a rejected subtree
 * in one step (the token tables of walk.c are such walks). Tokens with the
 * same bytes share a node (dup_next chains them). Special tokens are not in
 * the trie: they match only where a grammar names them.
 *
 * The standard grammar holds the rules every JSON grammar shares (strings,
 * numbers, any JSON value in each whitespace mode...); their token tables
 * are computed here, once, for the rules K3G_STD_WARM names, and on first
 * use for the others.
 */
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"
#include "grammar/build.h"
#include "grammar/stdrules.h"
#include "grammar/vocab.h"
#include "grammar/walk.h"

typedef struct tokref {
    const uint8_t *p;
    uint32_t len;
    int32_t id;
} tokref;

static int tokref_cmp(const void *a, const void *b) {
    const tokref *x = a, *y = b;
    uint32_t n = x->len < y->len ? x->len : y->len;
    int c = n ? memcmp(x->p, y->p, n) : 0;
    if (c) return c;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static void trie_free(k3g_trie *t) {
    free(t->byte);
    free(t->depth);
    free(t->next);
    free(t->tok);
    free(t->dup);
    *t = (k3g_trie){0};
}

void k3_grammar_vocab_free(k3_grammar_vocab *v) {
    if (!v) return;
    if (v->counted)
        for (int32_t i = 0; v->std && i < v->std->n_nodes; i++) k3g_counted_free(atomic_load(&v->counted[i]));
    free(v->counted);
    if (v->std) k3g_grammar_destroy(v->std);
    free(v->bytes);
    free(v->off);
    free(v->is_special);
    free(v->specials);
    trie_free(&v->trie);
    for (int i = 0; i < K3G_N_SLICES; i++) {
        trie_free(&v->slice[i].rest);
        k3g_fa_free(&v->slice[i].dfa);
        free(v->slice[i].bits);
    }
    free(v->dup_next);
    free(v);
}

size_t k3_grammar_mask_words(const k3_grammar_vocab *v) { return v ? v->n_words : 0; }

int32_t k3g_vocab_special(const k3_grammar_vocab *v, const char *name, size_t len) {
    for (int32_t i = 0; i < v->n_specials; i++) {
        int32_t id = v->specials[i];
        if (v->off[id + 1] - v->off[id] == len && !memcmp(v->bytes + v->off[id], name, len)) return id;
    }
    return -1;
}

static k3_status nomem(k3_error *err) {
    return k3_err(err, K3_ERR_NOMEM, "out of memory building the vocabulary tables");
}

/* The trie of the ordinary tokens for which keep(id) holds (every one when
 * keep is NULL); fills dup_next for duplicates when dups is set. */
static tokref *sorted_tokens; /* every ordinary token in byte order (during the build) */
static int32_t n_sorted;

static k3_status build_trie(k3_grammar_vocab *v, k3g_trie *tr, const uint64_t *keep, bool keep_out, bool dups,
                            k3_error *err) {
    int32_t m = 0;
    tokref *t = malloc((size_t)(n_sorted ? n_sorted : 1) * sizeof *t);
    if (!t) return nomem(err);
    size_t total = 1;
    for (int32_t i = 0; i < n_sorted; i++) {
        int32_t id = sorted_tokens[i].id;
        if (keep && (((keep[id >> 6] >> (id & 63)) & 1) == keep_out)) continue;
        t[m++] = sorted_tokens[i];
        total += sorted_tokens[i].len;
    }
    /* nodes: at most 1 + the sum of lengths */
    tr->byte = malloc(total);
    tr->depth = malloc(total * sizeof *tr->depth);
    tr->next = malloc(total * sizeof *tr->next);
    tr->tok = malloc(total * sizeof *tr->tok);
    tr->dup = calloc(total, 1);
    int32_t *path = malloc(((size_t)v->max_len + 2) * sizeof *path);
    if (!tr->byte || !tr->depth || !tr->next || !tr->tok || !tr->dup || !path) {
        free(t);
        free(path);
        return nomem(err);
    }
    int32_t nn = 1;
    tr->byte[0] = 0;
    tr->depth[0] = 0;
    tr->tok[0] = -1;
    path[0] = 0;
    const tokref *prev = NULL;
    for (int32_t i = 0; i < m; i++) {
        const tokref *cur = &t[i];
        uint32_t l = 0;
        if (prev) {
            uint32_t lim = prev->len < cur->len ? prev->len : cur->len;
            while (l < lim && prev->p[l] == cur->p[l]) l++;
        }
        for (uint32_t d = l; d < cur->len; d++) {
            tr->byte[nn] = cur->p[d];
            tr->depth[nn] = (uint16_t)(d + 1);
            tr->tok[nn] = -1;
            path[d + 1] = nn++;
        }
        int32_t end = path[cur->len];
        if (tr->tok[end] < 0) {
            tr->tok[end] = cur->id;
        } else {
            if (dups) {
                int32_t id = tr->tok[end];
                while (v->dup_next[id] >= 0) id = v->dup_next[id];
                v->dup_next[id] = cur->id;
            }
            tr->dup[end] = 1;
        }
        prev = cur;
    }
    /* next: the first node after each subtree */
    int32_t *open = path; /* reuse: the open nodes, one per depth */
    int32_t sp = 0;
    for (int32_t i = 0; i < nn; i++) {
        while (sp && tr->depth[open[sp - 1]] >= tr->depth[i]) tr->next[open[--sp]] = (uint32_t)i;
        open[sp++] = i;
    }
    while (sp) tr->next[open[--sp]] = (uint32_t)nn;
    tr->n = nn;
    free(t);
    free(path);
    return K3_OK;
}

/* The slices (grammar.h): their tokens, and the tries of the others. */
static k3_status build_slices(k3_grammar_vocab *v, k3_error *err) {
    for (int s = 0; s < K3G_N_SLICES; s++) {
        k3g_slice *sl = &v->slice[s];
        k3g_builder b;
        k3g_builder_init(&b, NULL, err);
        k3g_ast *one;
        if (s == 0) {
            uint32_t hi[2] = {0x80, 0x10FFFF};
            k3g_ast *k[4] = {k3g_brange(&b, 0x20, 0x21), k3g_brange(&b, 0x23, 0x5B), k3g_brange(&b, 0x5D, 0x7F),
                             k3g_cpset(&b, hi, 1)};
            one = k3g_alt(&b, k, 4);
        } else if (s == 1) {
            k3g_ast *k[3] = {k3g_brange(&b, '0', '9'), k3g_brange(&b, 'A', 'Z'), k3g_brange(&b, 'a', 'z')};
            one = k3g_alt(&b, k, 3);
        } else {
            one = k3g_brange(&b, 'a', 'z');
        }
        k3_status st = k3g_ast_dfa(&b, k3g_rep(&b, one, 1, -1), &sl->dfa, "a token slice");
        k3g_builder_free(&b);
        if (st != K3_OK) return st;
        sl->bits = calloc(v->n_words ? v->n_words : 1, sizeof *sl->bits);
        if (!sl->bits) return nomem(err);
        for (int32_t id = 0; id < v->n_vocab; id++) {
            uint32_t len = v->off[id + 1] - v->off[id];
            if (v->is_special[id] || len == 0) continue;
            if (k3g_fa_accepts(&sl->dfa, v->bytes + v->off[id], len)) {
                sl->bits[id >> 6] |= (uint64_t)1 << (id & 63);
                sl->n++;
            }
        }
        K3_TRY(build_trie(v, &sl->rest, sl->bits, true, false, err));
    }
    return K3_OK;
}

/* The standard grammar: every standard rule, reachable from one root. */
static k3_status build_std(k3_grammar_vocab *v, k3_error *err) {
    k3g_builder b;
    k3g_builder_init(&b, v, err);
    b.is_std = true;
    k3_status st = K3_OK;
    k3g_ast *alts[K3G_STD_N];
    for (int s = 0; s < K3G_STD_N && st == K3_OK; s++) {
        int32_t r = k3g_std_rule(&b, (k3g_std)s);
        if (r < 0) st = err && err->status ? err->status : K3_ERR_NOMEM;
        else alts[s] = k3g_ref(&b, r);
    }
    int32_t root = st == K3_OK ? k3g_rule(&b, "root") : -1;
    if (st == K3_OK && root < 0) st = K3_ERR_NOMEM;
    if (st == K3_OK) st = k3g_rule_set(&b, root, k3g_alt(&b, alts, K3G_STD_N));
    if (st == K3_OK) st = k3g_finalize(&b, root, &v->std);
    k3g_builder_free(&b);
    if (st != K3_OK) return err && err->status ? err->status : k3_err(err, st, "cannot build the standard rules");
    for (int s = 0; s < K3G_STD_N; s++) v->std_first[s] = v->std_n[s] = -1;
    for (int32_t r = 0; r < v->std->n_rules; r++) {
        int s = v->std->rule_std[r];
        if (s >= 0) {
            v->std_first[s] = v->std->rule_first[r];
            v->std_n[s] = v->std->rule_n[r];
        }
    }
    return K3_OK;
}

static k3_status vocab_finish(k3_grammar_vocab *v, k3_error *err) {
    v->n_words = ((size_t)v->n_vocab + 63) / 64;
    int32_t ns = 0;
    for (int32_t id = 0; id < v->n_vocab; id++) ns += v->is_special[id];
    v->specials = malloc((size_t)(ns ? ns : 1) * sizeof *v->specials);
    if (!v->specials) return nomem(err);
    for (int32_t id = 0; id < v->n_vocab; id++)
        if (v->is_special[id]) v->specials[v->n_specials++] = id;
    size_t nv = v->n_vocab > 0 ? (size_t)v->n_vocab : 1;
    v->dup_next = malloc(nv * sizeof *v->dup_next);
    if (!v->dup_next) return nomem(err);
    for (int32_t id = 0; id < v->n_vocab; id++) {
        v->dup_next[id] = -1;
        uint32_t len = v->off[id + 1] - v->off[id];
        if (len > 65535)
            return k3_err(err, K3_ERR_FORMAT, "token %d is %u bytes long (the grammar tables take 65535)", id, len);
        if (!v->is_special[id] && (int32_t)len > v->max_len) v->max_len = (int32_t)len;
    }
    /* one sort for every trie; the build runs under a lock because the
     * sorted array is static (vocabularies are built rarely) */
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&mu);
    n_sorted = 0;
    sorted_tokens = malloc((size_t)(v->n_vocab ? v->n_vocab : 1) * sizeof *sorted_tokens);
    k3_status st = sorted_tokens ? K3_OK : nomem(err);
    for (int32_t id = 0; st == K3_OK && id < v->n_vocab; id++) {
        uint32_t len = v->off[id + 1] - v->off[id];
        if (!v->is_special[id] && len) sorted_tokens[n_sorted++] = (tokref){v->bytes + v->off[id], len, id};
    }
    if (st == K3_OK) {
        qsort(sorted_tokens, (size_t)n_sorted, sizeof *sorted_tokens, tokref_cmp);
        st = build_trie(v, &v->trie, NULL, false, true, err);
    }
    if (st == K3_OK) st = build_slices(v, err);
    free(sorted_tokens);
    sorted_tokens = NULL;
    pthread_mutex_unlock(&mu);
    if (st != K3_OK) return st;
    K3_TRY(build_std(v, err));
    v->counted = calloc((size_t)v->std->n_nodes, sizeof *v->counted);
    if (!v->counted) return nomem(err);
    int64_t t0 = k3_now_ns();
    for (int s = 0; s < K3G_STD_N; s++) {
        if (!K3G_STD_WARM(s) || v->std_first[s] < 0) continue;
        for (int32_t i = 0; i < v->std_n[s]; i++) {
            int32_t node = v->std_first[s] + i;
            const k3g_node *nd = &v->std->nodes[node];
            if (nd->nb == 0) continue; /* reads no byte: never asked for */
            if (!k3g_entry_get(v->std, node, err)) return err && err->status ? err->status : K3_ERR_NOMEM;
        }
    }
    /* the character counts of the string body: every length-limited string uses them */
    if (v->std_first[K3G_STD_STRING_TAIL] >= 0 &&
        !k3g_counted_get(v, v->std_first[K3G_STD_STRING_TAIL] + 1 + K3G_JS_BODY, err))
        return err && err->status ? err->status : K3_ERR_NOMEM;
    v->warm_ms = (double)(k3_now_ns() - t0) / 1e6;
    return K3_OK;
}

k3_status k3_grammar_vocab_init(k3_grammar_vocab **out, const k3_tokenizer *tok, k3_error *err) {
    *out = NULL;
    if (!tok) return k3_err(err, K3_ERR_ARG, "k3_grammar_vocab_init needs a tokenizer");
    k3_grammar_vocab *v = calloc(1, sizeof *v);
    if (!v) return nomem(err);
    int32_t n = k3_tokenizer_n_vocab(tok);
    v->n_vocab = n;
    v->off = malloc(((size_t)n + 1) * sizeof *v->off);
    v->is_special = calloc((size_t)(n ? n : 1), 1);
    size_t total = 0;
    k3_status st = v->off && v->is_special ? K3_OK : nomem(err);
    for (int32_t id = 0; id < n && st == K3_OK; id++) {
        size_t len = 0;
        if (!k3_tokenizer_token(tok, id, &len)) len = 0;
        total += len;
    }
    if (st == K3_OK && total > UINT32_MAX) st = k3_err(err, K3_ERR_FORMAT, "the vocabulary's tokens take over 4 GB");
    if (st == K3_OK && !(v->bytes = malloc(total ? total : 1))) st = nomem(err);
    size_t at = 0;
    for (int32_t id = 0; id < n && st == K3_OK; id++) {
        size_t len = 0;
        const char *p = k3_tokenizer_token(tok, id, &len);
        if (!p) len = 0;
        v->off[id] = (uint32_t)at;
        if (len) memcpy(v->bytes + at, p, len);
        at += len;
        v->is_special[id] = k3_tokenizer_is_special(tok, id);
    }
    if (st == K3_OK) {
        v->off[n] = (uint32_t)at;
        v->n_eos = k3_tokenizer_eos_ids(tok, v->eos);
        st = vocab_finish(v, err);
    }
    if (st != K3_OK) {
        k3_grammar_vocab_free(v);
        return st;
    }
    *out = v;
    return K3_OK;
}

k3_status k3g_vocab_from_tokens(k3_grammar_vocab **out, const char *const *tok, const size_t *len,
                                const bool *is_special, int32_t n, const int32_t *eos, int32_t n_eos, k3_error *err) {
    *out = NULL;
    k3_grammar_vocab *v = calloc(1, sizeof *v);
    if (!v) return nomem(err);
    v->n_vocab = n;
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) total += len[i];
    v->off = malloc(((size_t)n + 1) * sizeof *v->off);
    v->is_special = calloc((size_t)(n ? n : 1), 1);
    v->bytes = malloc(total ? total : 1);
    k3_status st = v->off && v->is_special && v->bytes ? K3_OK : nomem(err);
    size_t at = 0;
    for (int32_t i = 0; i < n && st == K3_OK; i++) {
        v->off[i] = (uint32_t)at;
        memcpy(v->bytes + at, tok[i], len[i]);
        at += len[i];
        v->is_special[i] = is_special && is_special[i];
    }
    if (st == K3_OK) {
        v->off[n] = (uint32_t)at;
        for (int32_t i = 0; i < n_eos && i < K3_MAX_EOS_IDS; i++) v->eos[v->n_eos++] = eos[i];
        st = vocab_finish(v, err);
    }
    if (st != K3_OK) {
        k3_grammar_vocab_free(v);
        return st;
    }
    *out = v;
    return K3_OK;
}
