/*
 * fsa.h -- the ground floor of the grammar engine: the limits every piece
 * holds hostile input to, small helpers (array growth, byte sets, a bump
 * arena), and byte automata (fsa.c).
 *
 * A k3g_fa is an NFA while built (epsilon edges) and a DFA after
 * k3g_fa_determinize; edges are byte ranges or symbols (a reference to a
 * rule, or one special token). Regular languages are made, intersected,
 * complemented and JSON-string-encoded here.
 */
#ifndef K3_GRAMMAR_FSA_H
#define K3_GRAMMAR_FSA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "k3.h"

/* ---- limits (hostile input gets an error, not a machine-sized grammar) --- */

#define K3G_MAX_NFA_STATES (2 << 20) /* per automaton under construction */
#define K3G_MAX_DFA_STATES 250000    /* per determinized automaton */
#define K3G_MAX_STRLEN 20000         /* minLength / maxLength (each character is ~23 nodes) */
#define K3G_MAX_ITEMS 10000          /* minItems / maxItems */
#define K3G_MAX_NODES (4 << 20)      /* per compiled grammar */
#define K3G_MAX_RULES (1 << 20)
#define K3G_MAX_REPEAT 100000   /* a bounded repetition {m,n}: n at most */
#define K3G_MAX_TEXT (16 << 20) /* schema / grammar / regex text bytes */

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

#define K3G_EPS (-2)  /* k3g_fedge.sym: an epsilon edge */
#define K3G_BYTE (-1) /* k3g_fedge.sym: bytes lo..hi */
/* Symbols (sym >= 0): rule r is 2r, special token id t is 2t + 1. */
#define K3G_SYM_REF(r) (2 * (int32_t)(r))
#define K3G_SYM_SPECIAL(t) (2 * (int32_t)(t) + 1)
#define K3G_SYM_IS_REF(s) (((s)&1) == 0)
#define K3G_SYM_ARG(s) ((s) >> 1)

typedef struct k3g_fedge {
    int32_t from, to;
    int32_t sym;    /* K3G_EPS, K3G_BYTE or a symbol */
    uint8_t lo, hi; /* K3G_BYTE: the byte range */
} k3g_fedge;

typedef struct k3g_fa {
    int32_t n, start; /* states 0..n-1 */
    uint8_t *final;   /* [n] */
    size_t cap;       /* of final */
    k3g_fedge *e;     /* edges; sorted by (from, sym, lo) once indexed */
    size_t ne, cap_e;
    int32_t *first; /* [n + 1] when indexed: the edges of s are e[first[s] .. first[s+1]) */
    bool oom;       /* an append failed; the automaton is incomplete */
    bool too_big;   /* more than K3G_MAX_NFA_STATES states were asked for */
} k3g_fa;

void k3g_fa_free(k3g_fa *fa);
int32_t k3g_fa_state(k3g_fa *fa); /* a new non-final state, or -1 (oom/too big) */
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

/* ---- a compile's budget and its cancellation ----
 * k3_grammar_compile sets a stop for its thread (the spec's time budget and
 * cancel callback); the long loops (subset constructions, products, the
 * rules of a grammar, the schema's nodes, the token tables) ask k3g_stopped
 * every so often and end with the error it writes, naming what they were
 * building. Nothing is stopped on a thread without one. */
typedef struct k3g_stop {
    bool (*cancel)(void *ctx); /* true: stop (the client left); asked at most every 10 ms */
    void *ctx;
    double budget_s, deadline; /* the budget, and its end on k3_now()'s clock (0: none) */
    double next_cancel;        /* when the callback is asked next */
    k3_status why;             /* K3_OK, or why the compile stopped (sticky) */
} k3g_stop;
void k3g_stop_set(k3g_stop *s); /* this thread's, NULL for none */
/* Whether the compile must stop: true once the budget is spent or the
 * callback said so, with err naming what and why (once). */
bool k3g_stopped(k3_error *err, const char *what);

#endif /* K3_GRAMMAR_FSA_H */
