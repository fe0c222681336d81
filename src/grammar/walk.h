/*
 * walk.h -- the token tables (walk.c): for one grammar node, which tokens
 * stay inside the node's rule (the accepted set, context-free) and which
 * leave it mid-token (the uncertain ones, kept as a trie of the bytes that
 * follow the rule's end), computed once by walking the vocabulary trie with
 * a lazily built DFA over parser configurations. The tables are a cache in
 * the grammar (k3_grammar.entries, .ldfa); walk.c owns them, and the
 * grammar's destroy (build.c) frees them through k3g_entry_free and
 * k3g_ldfa_free.
 */
#ifndef K3_GRAMMAR_WALK_H
#define K3_GRAMMAR_WALK_H

#include "grammar/grammar.h"

struct k3g_entry {
    int32_t n_acc;      /* tokens accepted without leaving the rule */
    int32_t *acc_list;  /* sorted, when sparse (acc_bits NULL) */
    uint64_t *acc_bits; /* [n_words], when dense */
    /* the uncertain tokens: a trie over the bytes after the rule ends */
    int32_t n_sfx; /* nodes (0 or >= 2: node 0 is the root) */
    uint8_t *s_byte;
    uint16_t *s_depth;
    uint32_t *s_next;
    uint32_t *s_tok0; /* [n_sfx + 1]: tokens of node i are s_toks[s_tok0[i] .. s_tok0[i+1]) */
    int32_t *s_toks;
};

/* For a node of the standard string tail: the characters each token of its
 * table takes, so that a length-limited string (a node with a budget, see
 * k3g_brule) can filter the tail's table instead of walking its own. */
typedef struct k3g_counted {
    int32_t n;                      /* accepted tokens that do not end the string */
    int32_t *tok, *cnt;             /* [n] by characters, most first */
    int32_t n_close;                /* accepted tokens that end with the closing quote */
    int32_t *close_tok, *close_cnt; /* characters before the quote */
    int32_t *s_cnt;                 /* [the entry's s_toks]: characters before the quote */
} k3g_counted;

const k3g_counted *k3g_counted_get(const k3_grammar_vocab *v, int32_t std_node, k3_error *err);
void k3g_counted_free(k3g_counted *c);

/* The token table of node n of g (computed on first use, any thread); NULL
 * with err on allocation failure. */
const k3g_entry *k3g_entry_get(const k3_grammar *g, int32_t n, k3_error *err);
void k3g_entry_free(k3g_entry *e);
void k3g_ldfa_free(k3g_ldfa *d);

#endif /* K3_GRAMMAR_WALK_H */
