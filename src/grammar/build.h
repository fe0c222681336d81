/*
 * build.h -- the grammar builder (build.c): the expressions the front ends
 * write (regex, GBNF, JSON Schema, choices, tool calls), rules under
 * construction (each an NFA), and finalize, which inlines small regular
 * rules, determinizes every rule, drops rules that match nothing, refuses
 * left recursion, and lays the rules out as one array of nodes: the
 * compiled k3_grammar (grammar.h). The grammar's destroy lives here too,
 * above the token-table cache (walk.h) that it frees.
 */
#ifndef K3_GRAMMAR_BUILD_H
#define K3_GRAMMAR_BUILD_H

#include "grammar/fsa.h"
#include "grammar/grammar.h"

/* ---- expressions (build.c) ------------------------------------------------- */

typedef enum k3g_akind {
    K3G_A_EMPTY,  /* the empty string */
    K3G_A_NONE,   /* nothing: the empty language */
    K3G_A_BYTES,  /* a literal byte string */
    K3G_A_BRANGE, /* one byte from n ranges (u.r: lo, hi pairs, bytes) */
    K3G_A_CPSET,  /* one UTF-8 code point from n ranges (u.r: lo, hi pairs) */
    K3G_A_SYM,    /* a rule reference or a special token (sym) */
    K3G_A_SEQ,    /* n kids one after the other */
    K3G_A_ALT,    /* one of n kids */
    K3G_A_REP,    /* kid[0] min..max times (max < 0: unbounded) */
    K3G_A_FA,     /* an automaton (u.fa, borrowed) */
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

/* ---- the builder (build.c) --------------------------------------------------- */

typedef struct k3g_brule {
    char *name;   /* for messages; owned */
    k3g_fa fa;    /* NFA while building, DFA after finalize */
    int16_t std;  /* k3g_std or -1 */
    bool defined; /* a body was given */
    bool dfa;     /* fa is already a DFA */
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
/* Emits ast into fa between states from and to. */
k3_status k3g_emit(k3g_builder *b, k3g_fa *fa, int32_t from, int32_t to, const k3g_ast *ast);
/* Determinizes a symbol-free expression into a DFA. */
k3_status k3g_ast_dfa(k3g_builder *b, const k3g_ast *ast, k3g_fa *out, const char *what);
/* Finishes the grammar with root rule root; the builder is emptied. */
k3_status k3g_finalize(k3g_builder *b, int32_t root, k3_grammar **out);

/* Expression constructors (arena-allocated; NULL after an allocation
 * failure, which the builder reports). */
k3g_ast *k3g_empty(k3g_builder *b);
k3g_ast *k3g_none(k3g_builder *b);
k3g_ast *k3g_lit(k3g_builder *b, const void *s, size_t n);
/* A literal attribute value with & and " written as &amp; and &quot;, as the
 * chat encoder writes them. */
k3g_ast *k3g_attr_lit(k3g_builder *b, const char *v);
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

/* Frees a compiled grammar, its token tables included (k3_grammar_free
 * drops a reference and calls this at the last). */
void k3g_grammar_destroy(k3_grammar *g);

#endif /* K3_GRAMMAR_BUILD_H */
