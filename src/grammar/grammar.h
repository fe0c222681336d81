/*
 * grammar.h -- the data forms the files of the grammar engine share: the
 * compiled grammar and the vocabulary (nothing outside src/grammar/ and
 * tests/ includes it). It declares no functions; each piece has its own
 * header, and includes only the pieces below it.
 *
 * The pieces, bottom up:
 *   - fsa.h (fsa.c): limits, helpers, and byte automata.
 *   - grammar.h: the compiled grammar (nodes with byte, reference and
 *     special edges, and the token-table cache) and the vocabulary (the
 *     tokens of a model as a byte trie in preorder, the special tokens, the
 *     ids that end a generation, and the standard grammar).
 *   - parser.h (parser.c): configurations (node, stack), interned frames,
 *     the closure.
 *   - walk.h (walk.c): the token tables of the grammar nodes.
 *   - build.h (build.c): expressions, the builder, finalize (rules into one
 *     compiled grammar) and the grammar's destroy.
 *   - regex.h (regex.c): ECMA-262 regular expressions.
 *   - stdrules.h (stdrules.c): the standard rules every JSON grammar shares
 *     (strings, numbers, any value) and the string formats.
 *   - vocab.h (vocab.c): k3_grammar_vocab, its tries, slices and standard
 *     grammar.
 *   - gbnf.h (gbnf.c), schema.h (schema.c): the GBNF and JSON Schema front
 *     ends.
 *   - compile.c (k3_grammar_compile) and matcher.c (k3_grammar_matcher):
 *     the library API of include/k3.h.
 *
 * Invariants: a compiled grammar is immutable except for its token-table
 * cache, whose slots are filled once under the grammar's mutex and read with
 * acquire loads; a matcher belongs to one thread at a time.
 */
#ifndef K3_GRAMMAR_GRAMMAR_H
#define K3_GRAMMAR_GRAMMAR_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "grammar/fsa.h"
#include "k3.h"

/* ---- the standard rules' kinds (made in stdrules.c) ---------------------- */

typedef enum k3g_std {
    K3G_STD_STRING,      /* a JSON string literal, every escape: '"' tail */
    K3G_STD_STRING_TAIL, /* its characters and the closing quote */
    K3G_STD_NUMBER,      /* a JSON number */
    K3G_STD_INTEGER,     /* -?(0|[1-9][0-9]*)(\.0+)? */
    K3G_STD_VALUE_FLEX,  /* any JSON value, in each whitespace mode */
    K3G_STD_OBJECT_FLEX,
    K3G_STD_ARRAY_FLEX,
    K3G_STD_VALUE_COMPACT,
    K3G_STD_OBJECT_COMPACT,
    K3G_STD_ARRAY_COMPACT,
    K3G_STD_VALUE_PY,
    K3G_STD_OBJECT_PY,
    K3G_STD_ARRAY_PY,
    K3G_STD_RAW_STRING, /* UTF-8 text without "<|close|>" (a tool-call argument) */
    K3G_STD_ANY_TEXT,   /* any bytes (a think block) */
    K3G_STD_FORMAT0,    /* a JSON string of each supported format, in the order of k3g_formats */
    K3G_STD_N = K3G_STD_FORMAT0 + 10
} k3g_std;

/* The standard rules whose token tables k3_grammar_vocab_init computes up
 * front (the rest are computed on first use). */
#define K3G_STD_WARM(s) ((s) <= K3G_STD_ARRAY_PY)
/* The node roles of the string tail: node 0 the end (after the quote), node
 * 1 + K3G_JS_BODY between characters; the others inside one character. The
 * raw string: nodes 0..K3G_RAW_BOUNDARY-1 between characters, the others
 * inside one. */
#define K3G_JS_BODY 0
#define K3G_RAW_BOUNDARY 9

/* ---- the compiled grammar -------------------------------------------------- */

typedef struct k3g_bedge {
    uint8_t lo, hi;
    uint32_t to;
} k3g_bedge;

typedef struct k3g_redge {
    uint32_t rule, to;
} k3g_redge;

typedef struct k3g_sedge {
    int32_t id; /* special token id */
    uint32_t to;
} k3g_sedge;

typedef struct k3g_node {
    uint32_t b0, r0, s0; /* first byte / ref / special edge */
    uint16_t nb, nr, ns;
    uint8_t final;
    uint8_t pad;
    uint32_t rule;
    int32_t key; /* token-table slot: >= 0 this grammar's, < 0 the
                              standard grammar's slot -key-1 */
} k3g_node;

typedef struct k3g_entry k3g_entry;
typedef struct k3g_ldfa k3g_ldfa;

struct k3_grammar {
    atomic_int refs;
    const k3_grammar_vocab *vocab;
    int32_t n_nodes, n_rules, root;
    k3g_node *nodes;
    k3g_bedge *bedges;
    k3g_redge *redges;
    k3g_sedge *sedges;
    uint32_t n_bedges, n_redges, n_sedges;
    int32_t *rule_start, *rule_first, *rule_n;
    int16_t *rule_std;
    char **rule_name;
    k3g_bset *follow;       /* [n_rules]: the bytes that may follow the rule */
    int32_t *budget, *need; /* [n_nodes] or NULL: the counted aliases (k3g_brule) */
    /* token tables, one slot per node (aliased nodes share a slot) */
    _Atomic(k3g_entry *) *entries;
    pthread_mutex_t mu; /* guards ldfa and the filling of entries */
    k3g_ldfa *ldfa;
    bool is_std;
};

/* The node's byte step: the target of byte c from node n, or -1. */
static inline int32_t k3g_step(const k3_grammar *g, int32_t n, unsigned c) {
    const k3g_node *nd = &g->nodes[n];
    const k3g_bedge *e = g->bedges + nd->b0;
    for (uint32_t i = 0; i < nd->nb; i++) {
        if (c < e[i].lo) return -1;
        if (c <= e[i].hi) return (int32_t)e[i].to;
    }
    return -1;
}

/* ---- the vocabulary (vocab.c) ----------------------------------------------- */

#define K3G_N_SLICES 3

/* A token trie in preorder; node 0 is the root. */
typedef struct k3g_trie {
    int32_t n;
    uint8_t *byte;   /* [n] the byte on the edge into the node */
    uint16_t *depth; /* [n] */
    uint32_t *next;  /* [n] the first node after its subtree */
    int32_t *tok;    /* [n] a token ending here, or -1 */
    uint8_t *dup;    /* [n] 1: more tokens end here (dup_next) */
} k3g_trie;

typedef struct k3g_slice {
    k3g_fa dfa;     /* the slice's language (one or more of its characters) */
    uint64_t *bits; /* [n_words] its tokens */
    int32_t n;
    k3g_trie rest; /* every other ordinary token */
} k3g_slice;

struct k3_grammar_vocab {
    int32_t n_vocab;
    size_t n_words;      /* mask words: (n_vocab + 63) / 64 */
    uint8_t *bytes;      /* token bytes back to back (specials: their names) */
    uint32_t *off;       /* [n_vocab + 1] */
    uint8_t *is_special; /* [n_vocab] */
    int32_t *specials;   /* the special ids */
    int32_t n_specials;
    int32_t eos[K3_MAX_EOS_IDS], n_eos;
    int32_t max_len;   /* longest ordinary token, bytes */
    k3g_trie trie;     /* every ordinary token */
    int32_t *dup_next; /* [n_vocab] the next id with the same bytes, or -1 */
    /* Slices: classes of tokens (JSON string text: valid UTF-8 without '"',
     * a backslash or control characters; ASCII letters and digits; lower-case
     * letters), each as a bitset and a trie of all the other tokens. A walk
     * from a state that accepts every string of a slice's language takes the
     * slice at once and walks only the rest. Largest first. */
    k3g_slice slice[K3G_N_SLICES];
    k3_grammar *std;                        /* the standard grammar */
    _Atomic(struct k3g_counted *) *counted; /* [std nodes]: the string tail's counts */
    int32_t std_first[K3G_STD_N];           /* its first node of each standard rule */
    int32_t std_n[K3G_STD_N];               /* and their node counts */
    double warm_ms;                         /* time taken computing the warm tables */
};

#endif /* K3_GRAMMAR_GRAMMAR_H */
