/*
 * grammar.h -- what the files of the grammar engine share (nothing outside
 * src/grammar/ and tests/ includes it).
 *
 * The pieces, bottom up:
 *   - k3g_fa (fsa.c): a byte automaton, NFA while built (epsilon edges),
 *     DFA after k3g_fa_determinize; edges are byte ranges or symbols (a
 *     reference to a rule, or one special token). Regular languages are
 *     made, intersected, complemented and JSON-string-encoded here.
 *   - k3g_ast (build.c): the expressions the front ends write (regex, GBNF,
 *     JSON Schema, choices, tool calls) before they become automata.
 *   - k3g_builder (build.c): rules under construction, each an NFA; finalize
 *     inlines small regular rules, determinizes every rule, drops rules that
 *     match nothing, refuses left recursion, and lays the rules out as one
 *     array of nodes: the compiled k3_grammar.
 *   - k3_grammar_vocab (vocab.c): the tokens of a model as a byte trie in
 *     preorder, the special tokens by name, the ids that end a generation,
 *     and the "standard" grammar whose rules (a JSON string, a number, any
 *     JSON value...) every JSON grammar shares, with their token tables.
 *   - the token tables (walk.c): for one grammar node, which tokens stay
 *     inside the node's rule (the accepted set, context-free) and which leave
 *     it mid-token (the uncertain ones, kept as a trie of the bytes that
 *     follow the rule's end), computed once by walking the vocab trie with a
 *     lazily built DFA over parser configurations.
 *   - the matcher (matcher.c): a set of configurations (node, stack) per
 *     token boundary; masks are the union of the nodes' accepted sets plus
 *     the uncertain tokens checked against the real stack.
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

#include "k3.h"

/* ---- limits (hostile input gets an error, not a machine-sized grammar) --- */

#define K3G_MAX_NFA_STATES  (2 << 20)  /* per automaton under construction */
#define K3G_MAX_DFA_STATES  250000     /* per determinized automaton */
#define K3G_MAX_STRLEN      20000      /* minLength / maxLength (each character is ~23 nodes) */
#define K3G_MAX_ITEMS       10000      /* minItems / maxItems */
#define K3G_MAX_NODES       (4 << 20)  /* per compiled grammar */
#define K3G_MAX_RULES       (1 << 20)
#define K3G_MAX_REPEAT      100000     /* a bounded repetition {m,n}: n at most */
#define K3G_MAX_TEXT        (16 << 20) /* schema / grammar / regex text bytes */

/* ---- small helpers ------------------------------------------------------- */

/* Grows *p (an array of elem-byte items with capacity *cap) to hold need
 * items. false on overflow or allocation failure (*p unchanged). */
bool k3g_grow(void *p, size_t *cap, size_t need, size_t elem);

typedef struct k3g_bset {
    uint64_t w[4];
} k3g_bset;

static inline bool k3g_bset_has(const k3g_bset *s, unsigned b) { return (s->w[b >> 6] >> (b & 63)) & 1; }
static inline void k3g_bset_add(k3g_bset *s, unsigned b) { s->w[b >> 6] |= (uint64_t)1 << (b & 63); }
void k3g_bset_range(k3g_bset *s, unsigned lo, unsigned hi);

/* A bump allocator for the expressions of one compile. */
typedef struct k3g_arena {
    struct k3g_arena_blk *head;
    bool oom;
} k3g_arena;

void *k3g_alloc(k3g_arena *a, size_t n); /* zeroed; NULL (and a->oom) on failure */
void k3g_arena_free(k3g_arena *a);

/* ---- byte automata (fsa.c) ------------------------------------------------- */

#define K3G_EPS (-2)   /* k3g_fedge.sym: an epsilon edge */
#define K3G_BYTE (-1)  /* k3g_fedge.sym: bytes lo..hi */
/* Symbols (sym >= 0): rule r is 2r, special token id t is 2t + 1. */
#define K3G_SYM_REF(r) (2 * (int32_t)(r))
#define K3G_SYM_SPECIAL(t) (2 * (int32_t)(t) + 1)
#define K3G_SYM_IS_REF(s) (((s) & 1) == 0)
#define K3G_SYM_ARG(s) ((s) >> 1)

typedef struct k3g_fedge {
    int32_t from, to;
    int32_t sym;       /* K3G_EPS, K3G_BYTE or a symbol */
    uint8_t lo, hi;    /* K3G_BYTE: the byte range */
} k3g_fedge;

typedef struct k3g_fa {
    int32_t n, start;  /* states 0..n-1 */
    uint8_t *final;    /* [n] */
    size_t cap;        /* of final */
    k3g_fedge *e;      /* edges; sorted by (from, sym, lo) once indexed */
    size_t ne, cap_e;
    int32_t *first;    /* [n + 1] when indexed: the edges of s are e[first[s] .. first[s+1]) */
    bool oom;          /* an append failed; the automaton is incomplete */
    bool too_big;      /* more than K3G_MAX_NFA_STATES states were asked for */
} k3g_fa;

void k3g_fa_free(k3g_fa *fa);
int32_t k3g_fa_state(k3g_fa *fa);   /* a new non-final state, or -1 (oom/too big) */
void k3g_fa_edge(k3g_fa *fa, int32_t from, int32_t to, int32_t sym, unsigned lo, unsigned hi);
static inline void k3g_fa_eps(k3g_fa *fa, int32_t from, int32_t to) { k3g_fa_edge(fa, from, to, K3G_EPS, 0, 0); }
static inline void k3g_fa_byte(k3g_fa *fa, int32_t from, int32_t to, unsigned lo, unsigned hi) {
    k3g_fa_edge(fa, from, to, K3G_BYTE, lo, hi);
}
/* Sorts the edges and builds first[]; false on allocation failure. */
bool k3g_fa_index(k3g_fa *fa);
/* The byte sequences of UTF-8 code points lo..hi (surrogates excluded) as
 * paths from -> to. */
void k3g_fa_utf8(k3g_fa *fa, int32_t from, int32_t to, uint32_t lo, uint32_t hi);
/* Copies src (any automaton) into dst between from and to (epsilon edges in
 * and out). */
void k3g_fa_embed(k3g_fa *dst, const k3g_fa *src, int32_t from, int32_t to);
/* One literal byte string as a path. */
void k3g_fa_bytes(k3g_fa *fa, int32_t from, int32_t to, const void *s, size_t n);
/* One UTF-8 code point from -> to: the ASCII bytes ascii_lo..ascii_hi (none
 * when lo > hi) or any valid multi-byte sequence. */
void k3g_fa_utf8_char(k3g_fa *fa, int32_t from, int32_t to, unsigned ascii_lo, unsigned ascii_hi);
/* Keeps the states that are reachable and can reach a final state;
 * renumbers in order. map (optional, [old n]) gets old -> new or -1. */
bool k3g_fa_trim(k3g_fa *fa, int32_t *map);

/* Subset construction: out is a trimmed DFA (every state reachable and able
 * to reach a final state; no states at all for the empty language), its
 * byte edges sorted and disjoint per state, one edge per symbol. what names
 * the automaton in the error of one over K3G_MAX_DFA_STATES. */
k3_status k3g_fa_determinize(const k3g_fa *nfa, k3g_fa *out, const char *what, k3_error *err);
/* Product of two DFAs (symbols must match exactly); a trimmed DFA. */
k3_status k3g_fa_intersect(const k3g_fa *a, const k3g_fa *b, k3g_fa *out, const char *what, k3_error *err);
/* The complement over all byte strings of a symbol-free DFA. */
k3_status k3g_fa_complement(const k3g_fa *a, k3g_fa *out, k3_error *err);
/* A symbol-free DFA over raw UTF-8 text as the content of a JSON string
 * literal (without the quotes): '"' and '\' escaped, control characters as
 * their short escapes or \u00XX (either case), '/' raw or as "\/". A DFA. */
k3_status k3g_fa_json_encode(const k3g_fa *raw, k3g_fa *out, const char *what, k3_error *err);
/* DFA membership of a byte string (symbols never match). */
bool k3g_fa_accepts(const k3g_fa *dfa, const void *s, size_t n);
bool k3g_fa_is_empty(const k3g_fa *dfa);
/* The DFA of all byte strings (one final state with a self-loop). */
k3_status k3g_fa_any_bytes(k3g_fa *out, k3_error *err);
/* The DFA of valid UTF-8 text (any code points). */
k3_status k3g_fa_utf8_text(k3g_fa *out, k3_error *err);
/* The DFA of UTF-8 text with n code points, min <= n <= max (max < 0: no
 * upper bound). */
k3_status k3g_fa_utf8_length(k3g_fa *out, int64_t min, int64_t max, k3_error *err);
/* The DFA of byte strings that do not contain w as a substring. */
k3_status k3g_fa_avoid(k3g_fa *out, const char *w, k3_error *err);

/* ---- expressions (build.c) ------------------------------------------------- */

typedef enum k3g_akind {
    K3G_A_EMPTY,   /* the empty string */
    K3G_A_NONE,    /* nothing: the empty language */
    K3G_A_BYTES,   /* a literal byte string */
    K3G_A_BRANGE,  /* one byte from n ranges (u.r: lo, hi pairs, bytes) */
    K3G_A_CPSET,   /* one UTF-8 code point from n ranges (u.r: lo, hi pairs) */
    K3G_A_SYM,     /* a rule reference or a special token (sym) */
    K3G_A_SEQ,     /* n kids one after the other */
    K3G_A_ALT,     /* one of n kids */
    K3G_A_REP,     /* kid[0] min..max times (max < 0: unbounded) */
    K3G_A_FA,      /* an automaton (u.fa, borrowed) */
} k3g_akind;

typedef struct k3g_ast {
    k3g_akind kind;
    int32_t n;
    int32_t min, max;
    int32_t sym;
    union {
        struct k3g_ast **kids;
        uint8_t *bytes;
        uint32_t *r;
        const k3g_fa *fa;
    } u;
} k3g_ast;

/* ---- standard rules (build.c) ---------------------------------------------
 * Rules every JSON grammar shares, built by the same code in every grammar
 * and in the vocabulary's own standard grammar, so their token tables are
 * computed once per vocabulary. Whitespace modes: flexible (JSON's
 * [ \t\n\r]* wherever JSON allows it), compact (none), python (", " and ": "
 * exactly, as json.dumps writes them). */

typedef enum k3g_ws { K3G_WS_FLEX = 0, K3G_WS_COMPACT = 1, K3G_WS_PY = 2 } k3g_ws;

typedef enum k3g_std {
    K3G_STD_STRING,          /* a JSON string literal, every escape: '"' tail */
    K3G_STD_STRING_TAIL,     /* its characters and the closing quote */
    K3G_STD_NUMBER,          /* a JSON number */
    K3G_STD_INTEGER,         /* -?(0|[1-9][0-9]*)(\.0+)? */
    K3G_STD_VALUE_FLEX,      /* any JSON value, in each whitespace mode */
    K3G_STD_OBJECT_FLEX,
    K3G_STD_ARRAY_FLEX,
    K3G_STD_VALUE_COMPACT,
    K3G_STD_OBJECT_COMPACT,
    K3G_STD_ARRAY_COMPACT,
    K3G_STD_VALUE_PY,
    K3G_STD_OBJECT_PY,
    K3G_STD_ARRAY_PY,
    K3G_STD_RAW_STRING,      /* UTF-8 text without "<|close|>" (a tool-call argument) */
    K3G_STD_ANY_TEXT,        /* any bytes (a think block) */
    K3G_STD_FORMAT0,         /* a JSON string of each supported format, in the order of k3g_formats */
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

/* ---- the builder (build.c) --------------------------------------------------- */

typedef struct k3g_brule {
    char *name;             /* for messages; owned */
    k3g_fa fa;              /* NFA while building, DFA after finalize */
    int16_t std;            /* k3g_std or -1 */
    bool defined;           /* a body was given */
    bool dfa;               /* fa is already a DFA */
    /* Aliases (optional, [fa.n] once a DFA): a node whose token table equals
     * that of node alias[i] of the standard rule alias_std (-1: none), with
     * budget[i] >= 0 the characters it may still take before its end and
     * need[i] those it must take before it may end (budget -1: no limit
     * within one token; a length-limited string). */
    int32_t *alias, *budget, *need;
    int16_t alias_std;
} k3g_brule;

typedef struct k3g_builder {
    const k3_grammar_vocab *vocab;
    k3_error *err;
    k3g_arena arena;
    k3g_brule *rules;
    size_t n_rules, cap_rules;
    int32_t std_rule[K3G_STD_N]; /* rule id of each standard rule, -1 = not made */
    bool is_std;                 /* the vocabulary's standard grammar */
    struct k3g_kept *kept;       /* automata kept for k3g_fa_ast */
} k3g_builder;

void k3g_builder_init(k3g_builder *b, const k3_grammar_vocab *v, k3_error *err);
void k3g_builder_free(k3g_builder *b);
/* A new rule without a body; -1 (and err) on failure. */
int32_t k3g_rule(k3g_builder *b, const char *name);
/* Gives rule r the body ast (an NFA made from it). */
k3_status k3g_rule_set(k3g_builder *b, int32_t r, const k3g_ast *ast);
/* Gives rule r a finished DFA (taken over; *dfa is left empty). */
k3_status k3g_rule_set_dfa(k3g_builder *b, int32_t r, k3g_fa *dfa);
/* The rule of a standard rule (made on first use); -1 on failure. */
int32_t k3g_std_rule(k3g_builder *b, k3g_std s);
/* Emits ast into fa between states from and to. */
k3_status k3g_emit(k3g_builder *b, k3g_fa *fa, int32_t from, int32_t to, const k3g_ast *ast);
/* Determinizes a symbol-free expression into a DFA. */
k3_status k3g_ast_dfa(k3g_builder *b, const k3g_ast *ast, k3g_fa *out, const char *what);
/* A JSON string of min..max characters (max < 0: unbounded) with every
 * escape, as a rule whose nodes share the standard string's token tables
 * where they behave alike; -1 on failure. */
int32_t k3g_json_string_rule(k3g_builder *b, int64_t min, int64_t max);
/* The same for a raw tool-call argument (UTF-8 without "<|close|>"). */
int32_t k3g_raw_string_rule(k3g_builder *b, int64_t min, int64_t max);
/* Finishes the grammar with root rule root; the builder is emptied. */
k3_status k3g_finalize(k3g_builder *b, int32_t root, k3_grammar **out);

/* Expression constructors (arena-allocated; NULL after an allocation
 * failure, which the builder reports). */
k3g_ast *k3g_empty(k3g_builder *b);
k3g_ast *k3g_none(k3g_builder *b);
k3g_ast *k3g_lit(k3g_builder *b, const void *s, size_t n);
k3g_ast *k3g_str(k3g_builder *b, const char *s);
k3g_ast *k3g_brange(k3g_builder *b, unsigned lo, unsigned hi);
k3g_ast *k3g_byteset(k3g_builder *b, const k3g_bset *s);
k3g_ast *k3g_cpset(k3g_builder *b, const uint32_t *ranges, int32_t n_ranges);
k3g_ast *k3g_ref(k3g_builder *b, int32_t rule);
k3g_ast *k3g_special(k3g_builder *b, int32_t id);
k3g_ast *k3g_seq(k3g_builder *b, k3g_ast *const *kids, int32_t n);
k3g_ast *k3g_alt(k3g_builder *b, k3g_ast *const *kids, int32_t n);
k3g_ast *k3g_seq2(k3g_builder *b, k3g_ast *x, k3g_ast *y);
k3g_ast *k3g_seq3(k3g_builder *b, k3g_ast *x, k3g_ast *y, k3g_ast *z);
k3g_ast *k3g_alt2(k3g_builder *b, k3g_ast *x, k3g_ast *y);
k3g_ast *k3g_rep(k3g_builder *b, k3g_ast *x, int32_t min, int32_t max);
k3g_ast *k3g_fa_ast(k3g_builder *b, const k3g_fa *fa); /* fa borrowed until finalize */
/* A new rule whose body is dfa (taken over), as a reference; finalize
 * inlines it again when it is small and loop-free. */
k3g_ast *k3g_fa_rule(k3g_builder *b, k3g_fa *dfa, const char *name);
/* The same for a symbol-free expression (determinized first). */
k3g_ast *k3g_ast_rule(k3g_builder *b, const k3g_ast *a, const char *name);
/* An automaton kept by the builder until it is freed (for k3g_fa_ast). */
k3g_fa *k3g_keep(k3g_builder *b, k3g_fa *fa);

/* JSON whitespace of a mode as an expression (flexible: [ \t\n\r]*). */
k3g_ast *k3g_json_ws(k3g_builder *b, k3g_ws ws);

/* ---- front ends ------------------------------------------------------------- */

/* A regular expression over raw UTF-8 text. search: JSON Schema "pattern"
 * semantics (a match anywhere unless anchored by ^ / $); else the whole
 * text. where prefixes error messages. */
k3_status k3g_regex(k3g_builder *b, const char *re, size_t len, bool search, const char *where, k3g_ast **out);
/* A GBNF grammar; *root is its rule "root". */
k3_status k3g_gbnf(k3g_builder *b, const char *text, size_t len, const char *where, int32_t *root);

typedef struct k3g_json_opts {
    k3g_ws ws;
    bool no_extra;        /* absent additionalProperties means false */
    const char *where;    /* error path prefix */
} k3g_json_opts;

/* The supported string formats ("date", "time", ...; NULL-terminated),
 * and the raw-text DFA of format i. */
extern const char *const k3g_formats[];
k3_status k3g_format_dfa(k3g_builder *b, int i, k3g_fa *out);
int k3g_format_index(const char *name);

/* A JSON Schema text as a rule (*rule). */
k3_status k3g_json_schema(k3g_builder *b, const char *text, const k3g_json_opts *o, int32_t *rule);
/* The arguments of a K3 tool call for a parameters schema (NULL: none): the
 * argument tags in the schema's order, or one json block when the schema is
 * not a plain object of properties. */
k3_status k3g_tool_args(k3g_builder *b, const char *params, const char *where, k3g_ast **out);

/* ---- the compiled grammar -------------------------------------------------- */

typedef struct k3g_bedge {
    uint8_t lo, hi;
    uint32_t to;
} k3g_bedge;

typedef struct k3g_redge {
    uint32_t rule, to;
} k3g_redge;

typedef struct k3g_sedge {
    int32_t id;   /* special token id */
    uint32_t to;
} k3g_sedge;

typedef struct k3g_node {
    uint32_t b0, r0, s0;   /* first byte / ref / special edge */
    uint16_t nb, nr, ns;
    uint8_t final;
    uint8_t pad;
    uint32_t rule;
    int32_t key;           /* token-table slot: >= 0 this grammar's, < 0 the
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
    pthread_mutex_t mu;     /* guards ldfa and the filling of entries */
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

void k3g_grammar_destroy(k3_grammar *g);

/* ---- the vocabulary (vocab.c) ----------------------------------------------- */

#define K3G_N_SLICES 3

/* A token trie in preorder; node 0 is the root. */
typedef struct k3g_trie {
    int32_t n;
    uint8_t *byte;           /* [n] the byte on the edge into the node */
    uint16_t *depth;         /* [n] */
    uint32_t *next;          /* [n] the first node after its subtree */
    int32_t *tok;            /* [n] a token ending here, or -1 */
    uint8_t *dup;            /* [n] 1: more tokens end here (dup_next) */
} k3g_trie;

typedef struct k3g_slice {
    k3g_fa dfa;              /* the slice's language (one or more of its characters) */
    uint64_t *bits;          /* [n_words] its tokens */
    int32_t n;
    k3g_trie rest;           /* every other ordinary token */
} k3g_slice;

struct k3_grammar_vocab {
    int32_t n_vocab;
    size_t n_words;          /* mask words: (n_vocab + 63) / 64 */
    uint8_t *bytes;          /* token bytes back to back (specials: their names) */
    uint32_t *off;           /* [n_vocab + 1] */
    uint8_t *is_special;     /* [n_vocab] */
    int32_t *specials;       /* the special ids */
    int32_t n_specials;
    int32_t eos[K3_MAX_EOS_IDS], n_eos;
    int32_t max_len;         /* longest ordinary token, bytes */
    k3g_trie trie;           /* every ordinary token */
    int32_t *dup_next;       /* [n_vocab] the next id with the same bytes, or -1 */
    /* Slices: classes of tokens (JSON string text: valid UTF-8 without '"',
     * a backslash or control characters; ASCII letters and digits; lower-case
     * letters), each as a bitset and a trie of all the other tokens. A walk
     * from a state that accepts every string of a slice's language takes the
     * slice at once and walks only the rest. Largest first. */
    k3g_slice slice[K3G_N_SLICES];
    k3_grammar *std;         /* the standard grammar */
    _Atomic(struct k3g_counted *) *counted; /* [std nodes]: the string tail's counts */
    int32_t std_first[K3G_STD_N]; /* its first node of each standard rule */
    int32_t std_n[K3G_STD_N];     /* and their node counts */
    double warm_ms;          /* time taken computing the warm tables */
};

/* Token id of a special by name, or -1. */
int32_t k3g_vocab_special(const k3_grammar_vocab *v, const char *name, size_t len);
/* A vocabulary from explicit token byte strings (tests): ids 0..n-1, those
 * with is_special set are specials named by their bytes. */
k3_status k3g_vocab_from_tokens(k3_grammar_vocab **out, const char *const *tok, const size_t *len,
                                const bool *is_special, int32_t n, const int32_t *eos, int32_t n_eos,
                                k3_error *err);

/* ---- token tables (walk.c) ------------------------------------------------- */

struct k3g_entry {
    int32_t n_acc;        /* tokens accepted without leaving the rule */
    int32_t *acc_list;    /* sorted, when sparse (acc_bits NULL) */
    uint64_t *acc_bits;   /* [n_words], when dense */
    /* the uncertain tokens: a trie over the bytes after the rule ends */
    int32_t n_sfx;        /* nodes (0 or >= 2: node 0 is the root) */
    uint8_t *s_byte;
    uint16_t *s_depth;
    uint32_t *s_next;
    uint32_t *s_tok0;     /* [n_sfx + 1]: tokens of node i are s_toks[s_tok0[i] .. s_tok0[i+1]) */
    int32_t *s_toks;
};

/* For a node of the standard string tail: the characters each token of its
 * table takes, so that a length-limited string (a node with a budget, see
 * k3g_brule) can filter the tail's table instead of walking its own. */
typedef struct k3g_counted {
    int32_t n;            /* accepted tokens that do not end the string */
    int32_t *tok, *cnt;   /* [n] by characters, most first */
    int32_t n_close;      /* accepted tokens that end with the closing quote */
    int32_t *close_tok, *close_cnt; /* characters before the quote */
    int32_t *s_cnt;       /* [the entry's s_toks]: characters before the quote */
} k3g_counted;

const k3g_counted *k3g_counted_get(const k3_grammar_vocab *v, int32_t std_node, k3_error *err);
void k3g_counted_free(k3g_counted *c);

/* The token table of node n of g (computed on first use, any thread); NULL
 * with err on allocation failure. */
const k3g_entry *k3g_entry_get(const k3_grammar *g, int32_t n, k3_error *err);
void k3g_entry_free(k3g_entry *e);
void k3g_ldfa_free(k3g_ldfa *d);

/* ---- configurations and the parser core (matcher.c) --------------------- */

typedef struct k3g_cfg {
    int32_t node;
    int32_t stack;   /* frame index, or -1: the bottom */
} k3g_cfg;

typedef struct k3g_frame {
    int32_t ret;     /* the node the rule below continues from */
    int32_t parent;  /* the frame below, or -1 */
} k3g_frame;

/* Frames, interned by (ret, parent) so equal stacks are equal indices. */
typedef struct k3g_frames {
    k3g_frame *v;
    int32_t n;
    size_t cap;
    int32_t *slot;   /* open addressing: frame index or -1 */
    uint32_t mask;   /* slots - 1 */
} k3g_frames;

void k3g_frames_free(k3g_frames *f);
/* The frame (ret, parent), made if new; -1 on allocation failure. */
int32_t k3g_frames_get(k3g_frames *f, int32_t ret, int32_t parent);
/* Forgets frames n.. (their slots are found stale later). */
static inline void k3g_frames_truncate(k3g_frames *f, int32_t n) { if (n < f->n) f->n = n; }
bool k3g_frames_copy(k3g_frames *dst, const k3g_frames *src);

typedef struct k3g_cfgv {
    k3g_cfg *v;
    size_t n, cap;
} k3g_cfgv;

/* Scratch for closures: a visited set and a work list. */
typedef struct k3g_cscratch {
    uint64_t *key;
    uint32_t *gen;
    uint32_t mask, cur;
    k3g_cfgv work;
} k3g_cscratch;

void k3g_cscratch_free(k3g_cscratch *s);
/* The closure of seeds (predictions and completions) appended to out: only
 * configurations that can read a byte or a special token are kept.
 * *bottom is set when a seed's stack runs out (the grammar, or the rule at
 * the bottom, is complete). false on allocation failure. */
bool k3g_closure(const k3_grammar *g, k3g_frames *fr, k3g_cscratch *cs, const k3g_cfg *seeds, size_t n_seeds,
                 k3g_cfgv *out, bool *bottom);
/* Reads byte c from every configuration of in (then the closure) into out. */
bool k3g_scan_byte(const k3_grammar *g, k3g_frames *fr, k3g_cscratch *cs, const k3g_cfg *in, size_t n_in,
                   unsigned c, k3g_cfgv *out, bool *bottom);
bool k3g_cfgv_push(k3g_cfgv *v, k3g_cfg c);

#endif /* K3_GRAMMAR_GRAMMAR_H */
