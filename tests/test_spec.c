/*
 * test_spec.c -- speculative decoding's pieces without an engine (src/spec):
 * the suffix tree's counts against brute force, removal, rematching; the
 * proposers (suffix with its per-scope cache of outputs, ngram); the
 * acceptance rule's output distribution (chi-square against p, for a
 * distribution q and for a point mass); the cost model and the draft
 * length.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "spec/spec.h"
#include "test.h"

static uint64_t rng_state = 12345;
static uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double unif(void) { return (double)(rnd() >> 11) / 9007199254740992.0; }

/* occurrences of s[0..m) in text[0..n) */
static int32_t brute(const int32_t *text, int n, const int32_t *s, int m) {
    int32_t c = 0;
    for (int i = 0; i + m <= n; i++) c += !memcmp(text + i, s, sizeof(int32_t) * (size_t)m);
    return c;
}

/* the node of s[0..m) from the root, or -1 */
static int32_t path(const k3_stree *t, const int32_t *s, int m) {
    int32_t u = 0;
    for (int i = 0; i < m && u >= 0; i++) u = k3_stree_child(t, u, s[i]);
    return u;
}

static int32_t live_nodes(const k3_stree *t) { return t->n_nodes - t->n_free; }

K3_TEST(spec_stree_counts_and_removal) {
    enum { N = 300, D = 6 };
    int32_t a[N], b[N];
    for (int i = 0; i < N; i++) {
        a[i] = (int32_t)(rnd() % 5); /* a small alphabet: many repeats */
        b[i] = i % 17 < 9 ? a[i] : (int32_t)(rnd() % 5);
    }
    k3_stree t;
    k3_error err = {0};
    REQUIRE(k3_stree_init(&t, D, 1 << 20, &err) == K3_OK);
    k3_sactive sa = {0}, sb = {0};
    for (int i = 0; i < N; i++) k3_stree_push(&t, &sa, a[i]);
    const int32_t after_a = live_nodes(&t);
    for (int i = 0; i < N; i++) k3_stree_push(&t, &sb, b[i]);
    /* every substring of length <= D of both texts: its count is its occurrences */
    int bad = 0;
    for (int m = 1; m <= D; m++)
        for (int i = 0; i + m <= N; i++) {
            const int32_t u = path(&t, b + i, m);
            bad += u < 0 || t.cnt[u] != brute(a, N, b + i, m) + brute(b, N, b + i, m);
        }
    CHECKF(!bad, "%d substrings with a wrong count", bad);
    /* the active suffixes are the text's last suffixes */
    for (int m = 1; m <= D; m++) CHECK(sb.n >= m && sb.node[m - 1] == path(&t, b + N - m, m));
    /* a rematch from the tail gives the same nodes */
    k3_sactive r = {0};
    k3_stree_rematch(&t, &r, b + N - D, D);
    CHECK(r.n == sb.n && !memcmp(r.node, sb.node, sizeof(int32_t) * (size_t)r.n));
    /* removing b leaves a's tree: the same counts and nodes */
    k3_sactive pb = {0};
    for (int i = 0; i < N; i++) k3_stree_pop(&t, &pb, b[i]);
    CHECKF(live_nodes(&t) == after_a, "%d nodes after removing b, %d before it was added", live_nodes(&t), after_a);
    bad = 0;
    for (int m = 1; m <= D; m++)
        for (int i = 0; i + m <= N; i++) {
            const int32_t u = path(&t, a + i, m);
            bad += u < 0 || t.cnt[u] != brute(a, N, a + i, m);
        }
    CHECK(!bad);
    k3_sactive pa = {0};
    for (int i = 0; i < N; i++) k3_stree_pop(&t, &pa, a[i]);
    CHECK(live_nodes(&t) == 1); /* the root alone */
    /* a periodic text (one node met twice in a step) comes and goes too */
    k3_sactive pp = {0}, qq = {0};
    for (int i = 0; i < 40; i++) k3_stree_push(&t, &pp, 7);
    CHECK(t.cnt[path(&t, (int32_t[]){7, 7, 7}, 3)] == 38);
    for (int i = 0; i < 40; i++) k3_stree_pop(&t, &qq, 7);
    CHECK(live_nodes(&t) == 1);
    /* a budget stops growth, not counting */
    k3_stree small;
    REQUIRE(k3_stree_init(&small, D, 50, &err) == K3_OK);
    k3_sactive s = {0};
    for (int i = 0; i < N; i++) k3_stree_push(&small, &s, a[i]);
    CHECK(live_nodes(&small) <= 50);
    k3_stree_free(&small);
    k3_stree_free(&t);
    CHECK(k3_stree_init(&t, 0, 10, &err) == K3_ERR_RANGE);
}

K3_TEST(spec_stree_drafts_by_frequency) {
    k3_stree t;
    REQUIRE(k3_stree_init(&t, 8, 1 << 16, NULL) == K3_OK);
    k3_sactive a = {0};
    /* "1 2 3 4 5" three times, then "1 2 3 9", then "1 2": the text now
     * ends in "1 2"; after it came 3 four times, then 4 three times of 4 */
    const int32_t text[] = {1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2};
    for (size_t i = 0; i < sizeof text / sizeof text[0]; i++) k3_stree_push(&t, &a, text[i]);
    int32_t d[16];
    float conf[16], score;
    const int32_t n = k3_stree_draft(&t, &a, true, 4, 2.0f, 0.1f, d, conf, &score);
    REQUIREF(n >= 2, "drafted %d", n);
    CHECK(d[0] == 3 && d[1] == 4);
    CHECKF(fabsf(conf[0] - 1.0f) < 1e-6f && fabsf(conf[1] - 0.75f) < 1e-6f, "conf %g %g", conf[0], conf[1]);
    /* the spec factor: a match of 2 drafts at most 2 x factor */
    CHECK(k3_stree_draft(&t, &a, true, 8, 0.5f, 0.0f, d, conf, &score) <= 1);
    /* a probability floor above the second token's stops before it */
    CHECK(k3_stree_draft(&t, &a, true, 4, 2.0f, 0.9f, d, conf, &score) == 1);
    k3_stree_free(&t);
}

/* ---- the suffix tree against a plain reference ------------------------------
 * The reference is the tree as it was before suffix links: a trie whose
 * children are found by scanning a list, one lookup (and, in a push, an
 * insertion) per active suffix from the shortest up, the first that cannot
 * be made ending the list (the budget), a removal uncounting each suffix
 * and freeing nodes that reach 0 and have no children. */
enum { REF_NODES = 1 << 15 };
typedef struct ref_tree {
    int32_t depth, max_nodes, n, live;
    int32_t cnt[REF_NODES], tok[REF_NODES], par[REF_NODES], first[REF_NODES], next[REF_NODES], dep[REF_NODES];
    bool alive[REF_NODES];
} ref_tree;
typedef struct ref_active {
    int32_t n, node[64];
} ref_active;

static void ref_init(ref_tree *r, int32_t depth, int32_t max_nodes) {
    r->depth = depth;
    r->max_nodes = max_nodes;
    r->n = r->live = 1;
    r->cnt[0] = r->dep[0] = 0;
    r->first[0] = r->next[0] = r->par[0] = -1;
    r->alive[0] = true;
}

static int32_t ref_child(const ref_tree *r, int32_t u, int32_t x) {
    for (int32_t v = r->first[u]; v >= 0; v = r->next[v])
        if (r->tok[v] == x) return v;
    return -1;
}

static int32_t ref_child_or_add(ref_tree *r, int32_t u, int32_t x) {
    const int32_t c = ref_child(r, u, x);
    if (c >= 0 || r->live >= r->max_nodes || r->n == REF_NODES) return c;
    const int32_t v = r->n++;
    r->cnt[v] = 0;
    r->tok[v] = x;
    r->par[v] = u;
    r->dep[v] = r->dep[u] + 1;
    r->first[v] = -1;
    r->next[v] = r->first[u];
    r->first[u] = v;
    r->alive[v] = true;
    r->live++;
    return v;
}

static void ref_prune(ref_tree *r, int32_t v) {
    while (v > 0 && r->cnt[v] <= 0 && r->first[v] < 0) {
        const int32_t u = r->par[v];
        if (r->first[u] == v) r->first[u] = r->next[v];
        else
            for (int32_t w = r->first[u]; w >= 0; w = r->next[w])
                if (r->next[w] == v) {
                    r->next[w] = r->next[v];
                    break;
                }
        r->alive[v] = false;
        r->live--;
        v = u;
    }
}

/* mode 1 push, -1 pop, 0 follow */
static void ref_walk(ref_tree *r, ref_active *a, int32_t x, int mode) {
    int32_t nn = 0, out[64];
    for (int32_t i = -1; i < a->n && nn < r->depth; i++) {
        const int32_t u = i < 0 ? 0 : a->node[i];
        const int32_t v = u < 0 ? -1 : mode == 1 ? ref_child_or_add(r, u, x) : ref_child(r, u, x);
        if (v < 0 && mode != -1) break;
        out[nn++] = v;
    }
    for (int32_t i = 0; mode && i < nn; i++)
        if (out[i] >= 0) r->cnt[out[i]] += mode;
    for (int32_t i = nn - 1; mode < 0 && i >= 0; i--)
        if (out[i] > 0 && r->alive[out[i]]) ref_prune(r, out[i]);
    for (int32_t i = 0; mode < 0 && i < nn; i++)
        if (out[i] > 0 && !r->alive[out[i]]) out[i] = -1;
    a->n = nn;
    memcpy(a->node, out, sizeof(int32_t) * (size_t)nn);
}

/* k3_stree_draft's rule over the reference */
static int32_t ref_draft(const ref_tree *r, const ref_active *a, bool self, int32_t max, float spec_factor,
                         float min_prob, int32_t *draft, float *conf) {
    int32_t best_n = 0;
    float best_s = 0;
    for (int32_t i = a->n - 1; i >= 0; i--) { /* every matched depth, none skipped */
        const int32_t u = a->node[i];
        if (u < 0 || r->first[u] < 0) continue;
        const int32_t d = r->dep[u];
        int32_t lim = max;
        if (spec_factor > 0 && (float)lim > spec_factor * (float)d) lim = (int32_t)(spec_factor * (float)d);
        if (lim > r->depth - d) lim = r->depth - d;
        int32_t tok[64], n = 0;
        float p[64], prod = 1, s = 0;
        for (int32_t w = u, first = 1; n < lim && n < 64; first = 0) {
            int32_t v = -1;
            for (int32_t c = r->first[w]; c >= 0; c = r->next[c])
                if (v < 0 || r->cnt[c] > r->cnt[v]) v = c;
            if (v < 0) break;
            const int32_t denom = r->cnt[w] - (first && self ? 1 : 0);
            if (denom <= 0) break;
            float pr = (float)r->cnt[v] / (float)denom;
            if (pr > 1) pr = 1;
            if (prod * pr < min_prob) break;
            prod *= pr;
            s += prod;
            p[n] = pr;
            tok[n++] = r->tok[v];
            w = v;
        }
        if (n > 0 && s > best_s) {
            best_s = s;
            best_n = n;
            memcpy(draft, tok, sizeof(int32_t) * (size_t)n);
            memcpy(conf, p, sizeof(float) * (size_t)n);
        }
    }
    return best_n;
}

/* the tree's node of reference node v's string (-1: none, -2: no string) */
static int32_t ref_in_tree(const k3_stree *t, const ref_tree *r, int32_t v) {
    if (v < 0) return -2;
    int32_t s[64], m = r->dep[v];
    for (int32_t i = m - 1, w = v; i >= 0; i--, w = r->par[w]) s[i] = r->tok[w];
    return path(t, s, m);
}

/* Every node: the same strings with the same counts, no other; 0 = same. */
static int tree_differs(const k3_stree *t, const ref_tree *r) {
    if (live_nodes(t) != r->live) return 1;
    for (int32_t v = 1; v < r->n; v++) {
        if (!r->alive[v]) continue;
        const int32_t u = ref_in_tree(t, r, v);
        if (u < 0 || t->cnt[u] != r->cnt[v] || t->dep[u] != r->dep[v]) return 2;
    }
    return 0;
}

/* The same active suffixes (holes where the reference has them) and drafts. */
static int active_differs(const k3_stree *t, const k3_sactive *a, const ref_tree *r, const ref_active *ra,
                          bool drafts) {
    if (a->n != ra->n) return 1;
    for (int32_t i = 0; i < a->n; i++)
        if (ra->node[i] < 0 ? a->node[i] >= 0 : ref_in_tree(t, r, ra->node[i]) != a->node[i]) return 2;
    if (!drafts) return 0;
    static const float factor[2] = {1.0f, 2.0f}, floor_p[2] = {0.1f, 0.0f};
    for (int k = 0; k < 4; k++) {
        int32_t d[K3_SPEC_MAX_DRAFT], rd[64];
        float c[K3_SPEC_MAX_DRAFT], rc[64], score;
        const bool self = k & 1;
        const int32_t n = k3_stree_draft(t, a, self, 8, factor[k >> 1], floor_p[k >> 1], d, c, &score);
        const int32_t rn = ref_draft(r, ra, self, 8, factor[k >> 1], floor_p[k >> 1], rd, rc);
        if (n != rn || memcmp(d, rd, sizeof(int32_t) * (size_t)n) || memcmp(c, rc, sizeof(float) * (size_t)n)) return 3;
    }
    return 0;
}

K3_TEST(spec_stree_same_tree_as_a_lookup_per_suffix) {
    enum { L = 240, TEXTS = 6 };
    static int32_t text[TEXTS][L];
    static ref_tree ref;
    /* novel (a wide alphabet), repetitive (3 tokens), one token repeated,
     * a period of 3, an edited copy of the first, a period of 5 with runs */
    for (int i = 0; i < L; i++) {
        text[0][i] = (int32_t)(rnd() % 1000);
        text[1][i] = (int32_t)(rnd() % 3);
        text[2][i] = 7;
        text[3][i] = 1 + i % 3;
        text[4][i] = rnd() % 11 ? text[0][(i + 17) % L] : (int32_t)(rnd() % 1000);
        text[5][i] = i % 5 < 3 ? 4 : 5;
    }
    /* push (+) and pop (-) of whole texts, two pushes interleaved token by token (the * pair) */
    static const int ops[][2] = {{+1, 0}, {+2, 1}, {-1, 1}, {+1, 2}, {+1, 3}, {-1, 0}, {+1, 5},
                                 {-1, 2}, {+1, 1}, {-1, 4}, {-1, 3}, {-1, 5}, {-1, 1}};
    static const int32_t depths[3] = {3, 8, 24}, budgets[2] = {1 << 20, 220};
    int fails = 0;
    for (int di = 0; di < 3; di++)
        for (int bi = 0; bi < 2; bi++) {
            const int32_t D = depths[di];
            k3_stree t;
            REQUIRE(k3_stree_init(&t, D, budgets[bi], NULL) == K3_OK);
            ref_init(&ref, D, budgets[bi]);
            for (size_t o = 0; o < sizeof ops / sizeof ops[0] && !fails; o++) {
                const int w = ops[o][1];
                if (ops[o][0] == 2) { /* text w and text 4 pushed alternately */
                    k3_sactive a = {0}, b = {0};
                    ref_active ra = {0}, rb = {0};
                    for (int i = 0; i < L && !fails; i++) {
                        k3_stree_push(&t, &a, text[w][i]);
                        ref_walk(&ref, &ra, text[w][i], 1);
                        k3_stree_push(&t, &b, text[4][i]);
                        ref_walk(&ref, &rb, text[4][i], 1);
                        const int e = active_differs(&t, &a, &ref, &ra, true) + active_differs(&t, &b, &ref, &rb, true);
                        if (e) fails++;
                        CHECKF(!e, "depth %d budget %d op %zu token %d: active suffixes or drafts differ", D,
                               budgets[bi], o, i);
                    }
                } else {
                    const int mode = ops[o][0];
                    k3_sactive a = {0};
                    ref_active ra = {0};
                    for (int i = 0; i < L && !fails; i++) {
                        if (mode > 0) k3_stree_push(&t, &a, text[w][i]);
                        else k3_stree_pop(&t, &a, text[w][i]);
                        ref_walk(&ref, &ra, text[w][i], mode);
                        const int e = active_differs(&t, &a, &ref, &ra, mode > 0);
                        if (e) fails++;
                        CHECKF(!e, "depth %d budget %d op %zu (%s text %d) token %d: active suffixes %s", D,
                               budgets[bi], o, mode > 0 ? "push" : "pop", w, i,
                               e == 3 ? "same, drafts differ" : "differ");
                    }
                }
                const int e = tree_differs(&t, &ref);
                if (e) fails++;
                CHECKF(!e, "depth %d budget %d after op %zu: %s (%d nodes, %d in the reference)", D, budgets[bi], o,
                       e == 1 ? "node counts differ" : "a string's count differs", live_nodes(&t), ref.live);
                /* following a text reads the same suffixes, and a rematch finds them */
                k3_sactive f = {0};
                ref_active rf = {0};
                for (int i = 0; i < L && !fails; i++) {
                    k3_stree_follow(&t, &f, text[4][i]);
                    ref_walk(&ref, &rf, text[4][i], 0);
                    const int fe = active_differs(&t, &f, &ref, &rf, true);
                    if (fe) fails++;
                    CHECKF(!fe, "depth %d budget %d after op %zu: following token %d differs", D, budgets[bi], o, i);
                }
                k3_sactive m = {0};
                k3_stree_rematch(&t, &m, text[4] + L - D, D);
                CHECK(m.n == f.n && !memcmp(m.node, f.node, sizeof(int32_t) * (size_t)m.n));
            }
            CHECKF(fails || live_nodes(&t) == 1, "depth %d budget %d: %d nodes left after every text came off", D,
                   budgets[bi], live_nodes(&t));
            /* emptied for new texts (its table made smaller, or cleared) it builds the same tree again */
            for (int c = 0; c < 2 && !fails; c++) {
                k3_stree_push(&t, &(k3_sactive){0}, 3); /* something to clear */
                k3_stree_clear(&t, budgets[bi], c ? 1 : (int64_t)L * D);
                ref_init(&ref, D, budgets[bi]);
                k3_sactive a = {0};
                ref_active ra = {0};
                for (int i = 0; i < L; i++) {
                    k3_stree_push(&t, &a, text[4][i]);
                    ref_walk(&ref, &ra, text[4][i], 1);
                }
                const int e = tree_differs(&t, &ref) + active_differs(&t, &a, &ref, &ra, true);
                if (e) fails++;
                CHECKF(!e, "depth %d budget %d: a tree emptied (hint %s) differs from a new one", D, budgets[bi],
                       c ? "small" : "large");
            }
            k3_stree_free(&t);
        }
}

K3_TEST(spec_ngram_drafts_the_last_occurrence) {
    k3_ngram g;
    REQUIRE(k3_ngram_init(&g, 2, 4, NULL) == K3_OK);
    const int32_t t[] = {5, 6, 7, 8, 9, 1, 6, 7, 3, 3, 5, 6, 7};
    int32_t d[8], match;
    /* ends in "5 6 7": at 0 it went on 8 9 1 ("6 7" alone went on 3 at 6) */
    CHECK(k3_ngram_draft(&g, t, 13, 3, d, &match) == 3 && match == 3 && d[0] == 8 && d[1] == 9 && d[2] == 1);
    /* ends in "1 6 7"? no; "6 7" most recently went on with 3 3 */
    const int32_t u[] = {5, 6, 7, 8, 9, 1, 6, 7, 3, 3, 2, 6, 7};
    k3_ngram h;
    REQUIRE(k3_ngram_init(&h, 2, 4, NULL) == K3_OK);
    CHECK(k3_ngram_draft(&h, u, 13, 2, d, &match) == 2 && match == 2 && d[0] == 3 && d[1] == 3);
    CHECK(k3_ngram_draft(&h, u, 3, 2, d, &match) == 0); /* nothing earlier */
    k3_ngram_free(&g);
    k3_ngram_free(&h);
    CHECK(k3_ngram_init(&g, 3, 2, NULL) == K3_ERR_RANGE);
}

/* A completed output joins its scope's cache: a later sequence of the same
 * scope is drafted from it, one of another scope never. */
K3_TEST(spec_suffix_cache_per_scope) {
    k3_spec_config c = {.method = K3_SPEC_SUFFIX, .num_speculative_tokens = 4};
    k3_proposer *p = NULL;
    k3_error err = {0};
    REQUIREF(k3_proposer_open(&p, &c, 4, 1024, &err) == K3_OK, "%s", err.msg);
    const int32_t prompt[] = {100, 101, 102};
    const int32_t out[] = {40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51};
    k3_spec_seq *s = NULL;
    REQUIRE(k3_spec_seq_open(p, &s, K3_SPEC_SUFFIX, 0xA, prompt, 3, &err) == K3_OK);
    k3_spec_seq_append(p, s, out, 12);
    k3_spec_seq_close(p, s, true);
    /* a new request of scope A whose text reaches "42 43 44" */
    int32_t tok[16] = {200, 201, 42, 43, 44}, d[8];
    float conf[8];
    for (int scope = 0; scope < 2; scope++) {
        k3_spec_seq *q = NULL;
        REQUIRE(k3_spec_seq_open(p, &q, K3_SPEC_SUFFIX, scope ? 0xB : 0xA, tok, 2, &err) == K3_OK);
        k3_spec_seq_append(p, q, tok + 2, 3);
        const int32_t n = k3_spec_seq_propose(p, q, tok, 5, 4, d, conf);
        if (!scope) CHECKF(n >= 3 && d[0] == 45 && d[1] == 46 && d[2] == 47, "scope A drafted %d", n);
        else CHECKF(n == 0, "scope B drafted %d tokens from scope A's output", n);
        k3_spec_seq_close(p, q, false);
    }
    /* a request repeating scope A's (its prompt, nothing generated yet)
     * drafts that output from its first token: the output was cached after
     * the prompt's last tokens; so is one cached without a sequence */
    const int32_t other[] = {300, 301, 302, 303, 60, 61, 62, 63, 64};
    k3_spec_cache_output(p, K3_SPEC_SUFFIX, 0xD, other, 4, 5);
    for (int k = 0; k < 2; k++) {
        k3_spec_seq *q = NULL;
        const int32_t *pr = k ? other : prompt, np = k ? 4 : 3;
        REQUIRE(k3_spec_seq_open(p, &q, K3_SPEC_SUFFIX, k ? 0xD : 0xA, pr, np, &err) == K3_OK);
        const int32_t n = k3_spec_seq_propose(p, q, pr, np, 4, d, conf);
        CHECKF(n >= 3 && d[0] == (k ? 60 : 40) && d[1] == (k ? 61 : 41) && d[2] == (k ? 62 : 42),
               "a repeated prompt drafted %d tokens (%d ...)", n, n > 0 ? d[0] : -1);
        k3_spec_seq_close(p, q, false);
    }
    /* the sequence's own prompt: a repeat of its prompt is drafted */
    const int32_t rep[] = {7, 8, 9, 10, 11, 12, 7, 8, 9};
    k3_spec_seq *r = NULL;
    REQUIRE(k3_spec_seq_open(p, &r, K3_SPEC_SUFFIX, 0xC, rep, 9, &err) == K3_OK);
    CHECK(k3_spec_seq_propose(p, r, rep, 9, 3, d, conf) == 3 && d[0] == 10 && d[1] == 11 && d[2] == 12);
    k3_spec_seq_close(p, r, false);
    /* a long text quoted again verbatim: k drafts (a match of 16 leaves 8
     * of the depth of 24), not the at most 4 the deepest matches allow */
    int32_t quote[70];
    for (int i = 0; i < 70; i++) quote[i] = 500 + i % 40;
    REQUIRE(k3_spec_seq_open(p, &r, K3_SPEC_SUFFIX, 0xE, quote, 70, &err) == K3_OK);
    const int32_t nq = k3_spec_seq_propose(p, r, quote, 70, 8, d, conf);
    CHECKF(nq == 8 && d[0] == 530 && d[7] == 537, "a verbatim quote drafted %d tokens (%d ...)", nq,
           nq > 0 ? d[0] : -1);
    k3_spec_seq_close(p, r, false);
    CHECK(k3_proposer_bytes(p) > 0);
    k3_proposer_close(p);
    k3_spec_method m;
    CHECK(k3_spec_method_parse("suffix", &m, &err) == K3_OK && m == K3_SPEC_SUFFIX);
    CHECK(k3_spec_method_parse("eagle", &m, &err) == K3_ERR_ARG && strstr(err.msg, "eagle"));
    c.method = K3_SPEC_DRAFT_MODEL;
    CHECK(k3_proposer_open(&p, &c, 4, 1024, &err) == K3_ERR_ARG);
    c.method = K3_SPEC_SUFFIX;
    c.num_speculative_tokens = K3_SPEC_MAX_DRAFT + 1;
    CHECK(k3_proposer_open(&p, &c, 4, 1024, &err) == K3_ERR_RANGE);
}

/* Pearson's chi-square of counts against probabilities p (n bins). */
static double chi2(const int64_t *counts, const float *p, int n, int64_t total) {
    double x = 0;
    for (int i = 0; i < n; i++) {
        const double e = p[i] * (double)total;
        if (e > 0) x += ((double)counts[i] - e) * ((double)counts[i] - e) / e;
        else if (counts[i]) return INFINITY;
    }
    return x;
}

/* The rule's output distribution is p whatever q: a draft drawn from q
 * (and a point mass on one id), 400k trials each, chi-square against p
 * under the 0.1% point of 6 degrees of freedom (one bin has p = 0). */
K3_TEST(spec_rejection_rule_keeps_the_distribution) {
    enum { V = 8, TRIALS = 400000 };
    const float p[V] = {0.30f, 0.05f, 0.15f, 0.0f, 0.20f, 0.10f, 0.12f, 0.08f};
    const float q[V] = {0.05f, 0.40f, 0.10f, 0.05f, 0.10f, 0.20f, 0.05f, 0.05f};
    for (int kind = 0; kind < 3; kind++) {
        int64_t counts[V] = {0};
        int64_t acc = 0;
        for (int t = 0; t < TRIALS; t++) {
            int32_t d = 0;
            float pm[V] = {0};
            const float *qq = q;
            if (kind == 0) { /* a draft drawn from q */
                double u = unif();
                while (d < V - 1 && (u -= q[d]) >= 0) d++;
            } else { /* a point mass: the same draft always, even one p never picks */
                d = kind == 1 ? 4 : 3;
                pm[d] = 1;
                qq = pm;
            }
            bool ok;
            const int32_t y = k3_spec_reject_sample(p, qq, V, d, unif(), unif(), &ok);
            REQUIRE(y >= 0 && y < V);
            counts[y]++;
            acc += ok;
        }
        /* a zero-probability bin gets nothing; 6 free bins then */
        const double x = chi2(counts, p, V, TRIALS);
        CHECKF(x < 22.46, "rule %d: chi-square %.2f over 6 degrees of freedom (0.1%% point 22.46)", kind, x);
        if (kind == 1)
            CHECKF(fabs((double)acc / TRIALS - p[4]) < 0.005, "point mass accepted %.4f", (double)acc / TRIALS);
        if (kind == 2) CHECK(acc == 0);
    }
}

K3_TEST(spec_cost_model_and_draft_length) {
    k3_spec_policy p;
    k3_spec_policy_init(&p, 0.1);
    CHECK(fabs(k3_spec_policy_cost(&p, 5) - 1.4) < 1e-9); /* the prior alone */
    k3_spec_policy_observe(&p, 1, 0.100);
    k3_spec_policy_observe(&p, 5, 0.120);
    CHECK(fabs(k3_spec_policy_cost(&p, 3) - 0.110) < 1e-9); /* between two seen */
    CHECK(k3_spec_policy_cost(&p, 9) > 0.120);              /* past them */
    /* cheap rows and a sure draft: all of it */
    k3_spec_cand c[2] = {{4, {0.9f, 0.8f, 0.7f, 0.6f}}, {0, {0}}};
    int32_t take[2];
    CHECK(k3_spec_policy_choose(&p, 1, c, 1, take) == 4 && take[0] == 4);
    /* rows at full cost (compute-bound): drafts that are not sure do not pay */
    k3_spec_policy q;
    k3_spec_policy_init(&q, 1.0);
    for (int r = 1; r <= 64; r++) k3_spec_policy_observe(&q, r, 0.01 * r);
    k3_spec_cand w[2] = {{4, {0.5f, 0.25f, 0.12f, 0.06f}}, {4, {0.5f, 0.25f, 0.12f, 0.06f}}};
    CHECK(k3_spec_policy_choose(&q, 32, w, 2, take) == 0 && take[0] == 0 && take[1] == 0);
    /* the calibration: a proposer that is always wrong loses its say, and gets it back after a rest */
    k3_spec_calib cal;
    k3_spec_calib_init(&cal);
    const float conf[4] = {1, 1, 1, 1};
    k3_spec_cand g;
    k3_spec_calib_gains(&cal, conf, 4, &g);
    CHECK(g.n == 4 && g.gain[0] == 1.0f);
    for (int i = 0; i < 30; i++) k3_spec_calib_update(&cal, conf, 4, 0);
    k3_spec_calib_gains(&cal, conf, 4, &g);
    CHECKF(g.gain[0] < 0.1f, "gain %g after 30 rejections", g.gain[0]);
    CHECK(k3_spec_policy_choose(&p, 1, &g, 1, take) == 0);
    for (int i = 0; i < 60; i++) k3_spec_calib_update(&cal, conf, 0, 0);
    k3_spec_calib_gains(&cal, conf, 4, &g);
    CHECK(g.gain[0] > 0.5f);
}

/* A synthetic machine for the cost model: a small model's step (ms), whose
 * pass grows little with its rows while what is around it -- a verify
 * chunk's sampling and rollback, each draft row, each token's output --
 * weighs as much. The drafts are accepted as their gains say (the
 * expectation, so the run is deterministic). Runs steps of `batch`
 * sequences, each offering k drafts of confidence `conf` calibrated against
 * acceptance `acc`, and returns the share of the last `tail` steps that
 * verified drafts. */
typedef struct synth {
    double pass0, pass_row;          /* pass(r) = pass0 + pass_row (r - 1) */
    double step0, per_token;         /* a plain step's time outside the pass: step0 + per_token x tokens */
    double per_chunk, per_draft_row; /* a verify chunk's and each draft row's (sampling, rollback) */
} synth;

static double synth_run(k3_spec_policy *p, k3_spec_calib *cal, const synth *m, int32_t batch, float conf, float acc,
                        int32_t steps, int32_t tail) {
    int32_t drafted = 0;
    for (int32_t s = 0; s < steps; s++) {
        k3_spec_cand c[16];
        int32_t take[16] = {0};
        const float cf[8] = {conf, conf, conf, conf, conf, conf, conf, conf};
        for (int32_t i = 0; i < batch; i++) k3_spec_calib_gains(&cal[i], cf, 8, &c[i]);
        int32_t n = 0; /* as the engine decides (src/engine/draft.c) */
        if (!k3_spec_policy_may_pay(p, batch, 8)) k3_spec_policy_declined(p, batch);
        else if (!k3_spec_policy_plain_due(p, batch) && !(n = k3_spec_policy_choose(p, batch, c, batch, take)))
            k3_spec_policy_declined(p, batch);
        int32_t chunks = 0;
        double accepted = 0;
        for (int32_t i = 0; i < batch; i++) {
            chunks += take[i] > 0;
            /* the expected accepted prefix at a per-draft acceptance acc */
            double g = 1, a = 0;
            for (int32_t j = 0; j < take[i]; j++) a += (g *= acc);
            accepted += a;
            float cfs[8];
            for (int32_t j = 0; j < 8; j++) cfs[j] = conf;
            k3_spec_calib_update(&cal[i], cfs, take[i], take[i] ? (int32_t)(a + 0.5) : 0);
        }
        const double pass = m->pass0 + m->pass_row * (batch + n - 1);
        const double out = m->step0 + m->per_token * (batch + accepted) + m->per_chunk * chunks + m->per_draft_row * n;
        k3_spec_step st = {batch, chunks, n, pass * 1e-3, (pass + out) * 1e-3};
        k3_spec_policy_observe_step(p, &st);
        if (s >= steps - tail) drafted += n > 0;
    }
    return (double)drafted / tail;
}

K3_TEST(spec_cost_model_weighs_the_whole_step) {
    /* k3-mini-like: a 1 ms pass, +0.08 ms a row; 0.1 ms of output a token, a
     * verify chunk 0.35 ms and 0.06 ms a draft row around the pass */
    const synth m = {1.0, 0.08, 0.05, 0.10, 0.35, 0.06};
    k3_spec_policy p;
    k3_spec_policy_init(&p, 0.05);
    k3_spec_calib cal[16];
    for (int i = 0; i < 16; i++) k3_spec_calib_init(&cal[i]);
    /* batch 1, drafts right 70% of the time: a step's 1.15 ms buys one token,
     * a draft's ~0.55 ms buys 0.7: draft */
    double on = synth_run(&p, cal, &m, 1, 0.7f, 0.7f, 400, 200);
    CHECKF(on > 0.9, "batch 1: drafted in %.0f%% of the steps", 100 * on);
    /* batch 4: a step's ~1.7 ms buys four tokens (0.42 ms each), a draft
     * still ~0.55 ms for 0.7: no drafts -- though on the pass alone they pay
     * (the pass's rows are cheap) */
    k3_spec_cand c4[4];
    int32_t take[4];
    const float cf[8] = {0.7f, 0.7f, 0.7f, 0.7f, 0.7f, 0.7f, 0.7f, 0.7f};
    k3_spec_calib flat;
    k3_spec_calib_init(&flat);
    for (int i = 0; i < 4; i++) k3_spec_calib_gains(&flat, cf, 8, &c4[i]);
    k3_spec_policy pass_only;
    k3_spec_policy_init(&pass_only, 0.05);
    for (int r = 1; r <= 40; r++) k3_spec_policy_observe(&pass_only, r, (1.0 + 0.08 * (r - 1)) * 1e-3);
    CHECK(k3_spec_policy_choose(&pass_only, 4, c4, 4, take) > 0);
    double off = synth_run(&p, cal, &m, 4, 0.7f, 0.7f, 600, 300);
    CHECKF(off < 0.1, "batch 4: drafted in %.0f%% of the steps", 100 * off);
    const double extra = k3_spec_policy_step_cost(&p, 4, 1, 4) - k3_spec_policy_step_cost(&p, 4, 0, 0);
    CHECKF(extra > 0.7e-3, "a verify chunk of 4 drafts at batch 4 estimated at +%.3f ms", extra * 1e3);
    /* a batch where each row costs its full share: not even drafts sure to
     * be accepted pay there, so nobody proposes (nor indexes a prompt) */
    k3_spec_policy b;
    k3_spec_policy_init(&b, 0.05);
    for (int i = 0; i < 20; i++) {
        k3_spec_step st16 = {16, 0, 0, 3.8e-3, 4.0e-3},
                     sp16 = {16, 1, i % 8 + 1, 3.8e-3, (4.3 + 0.3 * (i % 8 + 1)) * 1e-3};
        k3_spec_step st1 = {1, 0, 0, 0.9e-3, 1.0e-3}, sp1 = {1, 1, i % 8 + 1, 1.0e-3, (1.2 + 0.1 * (i % 8 + 1)) * 1e-3};
        k3_spec_policy_observe_step(&b, &st16);
        k3_spec_policy_observe_step(&b, &sp16);
        k3_spec_policy_observe_step(&b, &st1);
        k3_spec_policy_observe_step(&b, &sp1);
    }
    CHECK(!k3_spec_policy_may_pay(&b, 16, 8));
    CHECK(k3_spec_policy_may_pay(&b, 1, 8));
    /* and on again at batch 1 */
    on = synth_run(&p, cal, &m, 1, 0.7f, 0.7f, 600, 200);
    CHECKF(on > 0.9, "batch 1 again: drafted in %.0f%% of the steps", 100 * on);
    /* where the around-the-pass costs are small, batch 4 drafts too */
    const synth lean = {1.0, 0.08, 0.02, 0.01, 0.02, 0.005};
    k3_spec_policy q;
    k3_spec_policy_init(&q, 0.05);
    for (int i = 0; i < 16; i++) k3_spec_calib_init(&cal[i]);
    on = synth_run(&q, cal, &lean, 4, 0.7f, 0.7f, 400, 200);
    CHECKF(on > 0.9, "batch 4, lean step: drafted in %.0f%% of the steps", 100 * on);
}

K3_TEST(spec_cost_model_acceptance_collapses) {
    const synth m = {1.0, 0.08, 0.05, 0.10, 0.35, 0.06};
    k3_spec_policy p;
    k3_spec_policy_init(&p, 0.05);
    k3_spec_calib cal[16];
    for (int i = 0; i < 16; i++) k3_spec_calib_init(&cal[i]);
    double on = synth_run(&p, cal, &m, 1, 0.9f, 0.9f, 300, 100);
    CHECKF(on > 0.9, "batch 1, acceptance 0.9: drafted in %.0f%% of the steps", 100 * on);
    /* the proposer stays as sure of itself, the target stops agreeing: within
     * a few steps drafting stops, and tries again only now and then (the
     * calibration drifts back while no draft is verified) */
    double off = synth_run(&p, cal, &m, 1, 0.9f, 0.0f, 400, 300);
    CHECKF(off < 0.15, "batch 1, acceptance 0: drafted in %.0f%% of the steps", 100 * off);
    /* acceptance back: drafting back */
    on = synth_run(&p, cal, &m, 1, 0.9f, 0.9f, 300, 100);
    CHECKF(on > 0.9, "batch 1, acceptance back: drafted in %.0f%% of the steps", 100 * on);
}

K3_TEST(spec_cost_model_robust_to_slow_steps) {
    /* three plain steps of one decode, one of them slowed by something
     * beside it (a prompt indexed, another process): the plain step is
     * 1 ms, not their mean */
    k3_spec_policy p;
    k3_spec_policy_init(&p, 0.05);
    const double plain_ms[3] = {1.0, 5.0, 1.0};
    for (int i = 0; i < 3; i++) {
        CHECK(k3_spec_policy_plain_due(&p, 1)); /* three before drafts are measured against them */
        const k3_spec_step st = {1, 0, 0, 0.9e-3, plain_ms[i] * 1e-3};
        k3_spec_policy_observe_step(&p, &st);
    }
    CHECK(!k3_spec_policy_plain_due(&p, 1));
    CHECKF(fabs(k3_spec_policy_step_cost(&p, 1, 0, 0) - 1e-3) < 1e-9, "plain step %.3f ms",
           k3_spec_policy_step_cost(&p, 1, 0, 0) * 1e3);
    /* verify chunks of 4 drafts take 1.6 ms: +0.6 ms over the plain step (a
     * mean of the three, 2.33 ms, would make them look free) */
    for (int i = 0; i < 30; i++) {
        const k3_spec_step sp = {1, 1, 4, 1.5e-3, 1.6e-3};
        k3_spec_policy_observe_step(&p, &sp);
    }
    const double extra = k3_spec_policy_step_cost(&p, 1, 1, 4) - k3_spec_policy_step_cost(&p, 1, 0, 0);
    CHECKF(fabs(extra - 0.6e-3) < 0.05e-3, "a chunk of 4 drafts estimated at +%.3f ms", extra * 1e3);
    /* so drafts that are mostly wrong are declined */
    const float cf[4] = {0.1f, 0.1f, 0.1f, 0.1f};
    k3_spec_calib flat;
    k3_spec_calib_init(&flat);
    k3_spec_cand c;
    int32_t take = 0;
    k3_spec_calib_gains(&flat, cf, 4, &c);
    CHECK(k3_spec_policy_choose(&p, 1, &c, 1, &take) == 0);
    /* one verify step slowed twentyfold, early in a fit: drafts sure to be
     * accepted are still taken (unclipped, it priced a draft at ~1.5 ms and
     * nobody proposed for the hundreds of steps a declined fit takes to fade) */
    k3_spec_policy q;
    k3_spec_policy_init(&q, 0.05);
    for (int i = 0; i < 3; i++) {
        const k3_spec_step st = {1, 0, 0, 0.9e-3, 1.0e-3};
        k3_spec_policy_observe_step(&q, &st);
    }
    const double y_ms[3] = {1.6, 1.6, 20.0};
    for (int i = 0; i < 3; i++) {
        const k3_spec_step sp = {1, 1, 4, 1.5e-3, y_ms[i] * 1e-3};
        k3_spec_policy_observe_step(&q, &sp);
    }
    CHECKF(k3_spec_policy_may_pay(&q, 1, 4), "a chunk of 4 drafts estimated at +%.3f ms after one slow step",
           (k3_spec_policy_step_cost(&q, 1, 1, 4) - k3_spec_policy_step_cost(&q, 1, 0, 0)) * 1e3);
    const float sure[4] = {0.95f, 0.95f, 0.95f, 0.95f};
    k3_spec_calib_gains(&flat, sure, 4, &c);
    CHECK(k3_spec_policy_choose(&q, 1, &c, 1, &take) > 0);
    /* the last five are kept: a machine that became slower moves it */
    for (int i = 0; i < 3; i++) {
        const k3_spec_step st = {1, 0, 0, 1.9e-3, 2.0e-3};
        k3_spec_policy_observe_step(&p, &st);
    }
    CHECKF(fabs(k3_spec_policy_step_cost(&p, 1, 0, 0) - 2e-3) < 1e-9, "plain step %.3f ms after three of 2 ms",
           k3_spec_policy_step_cost(&p, 1, 0, 0) * 1e3);
}
