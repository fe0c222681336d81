/*
 * parser.h -- configurations and the parser core (parser.c), which the
 * token tables (walk.c) and the matcher (matcher.c) both run.
 *
 * A parser state is a set of configurations (node, stack): the node of the
 * rule being read and the stack of rules below it, as an index into
 * interned frames (ret, parent), so equal stacks are equal indices and a
 * set dedups by the pair.
 */
#ifndef K3_GRAMMAR_PARSER_H
#define K3_GRAMMAR_PARSER_H

#include "grammar/grammar.h"

typedef struct k3g_cfg {
    int32_t node;
    int32_t stack; /* frame index, or -1: the bottom */
} k3g_cfg;

typedef struct k3g_frame {
    int32_t ret;    /* the node the rule below continues from */
    int32_t parent; /* the frame below, or -1 */
} k3g_frame;

/* Frames, interned by (ret, parent) so equal stacks are equal indices. */
typedef struct k3g_frames {
    k3g_frame *v;
    int32_t n;
    size_t cap;
    int32_t *slot; /* open addressing: frame index or -1 */
    uint32_t mask; /* slots - 1 */
} k3g_frames;

void k3g_frames_free(k3g_frames *f);
/* The frame (ret, parent), made if new; -1 on allocation failure. */
int32_t k3g_frames_get(k3g_frames *f, int32_t ret, int32_t parent);
/* Forgets frames n.. (their slots are found stale later). */
static inline void k3g_frames_truncate(k3g_frames *f, int32_t n) {
    if (n < f->n) f->n = n;
}
bool k3g_frames_copy(k3g_frames *dst, const k3g_frames *src);

typedef struct k3g_cfgv {
    k3g_cfg *v;
    size_t n, cap;
} k3g_cfgv;

/* Scratch for closures: a visited set, a work list, the map of the frames
 * a graph-structured closure made (by return node), and a work budget. */
typedef struct k3g_cscratch {
    uint64_t *key;
    uint32_t *gen;
    uint32_t mask, cur;
    k3g_cfgv work;
    int32_t *fm_ret, *fm_frame;
    uint32_t *fm_gen;
    uint32_t fm_mask, fm_cur;
    size_t fm_n;
    /* configurations the closures may still process (0: no limit); when it
     * runs out a closure fails with over set, which callers turn into an
     * error naming the budget rather than out of memory */
    int64_t budget;
    bool over;
} k3g_cscratch;

void k3g_cscratch_free(k3g_cscratch *s);
/* The closure of seeds (predictions and completions) appended to out: only
 * configurations that can read a byte or a special token are kept.
 * *bottom is set when a seed's stack runs out (the grammar, or the rule at
 * the bottom, is complete). false on allocation failure. */
bool k3g_closure(const k3_grammar *g, k3g_frames *fr, k3g_cscratch *cs, const k3g_cfg *seeds, size_t n_seeds,
                 k3g_cfgv *out, bool *bottom);
/* Reads byte c from every configuration of in (then the closure) into out. */
bool k3g_scan_byte(const k3_grammar *g, k3g_frames *fr, k3g_cscratch *cs, const k3g_cfg *in, size_t n_in, unsigned c,
                   k3g_cfgv *out, bool *bottom);
bool k3g_cfgv_push(k3g_cfgv *v, k3g_cfg c);

/* ---- graph-structured stacks (the matcher's) ----
 * Earley's merge, as GLL parsers keep it: a closure pushes one frame per
 * return node, whatever the stacks below it, and those stacks are the
 * frame's edges; parses that reach one rule at one place share the frame,
 * so a state's configurations stay polynomial in the text however
 * ambiguous the grammar (root ::= "a" root root | "a" root | "": the tree
 * of stacks would double per byte). A configuration's stack is a frame
 * index (-1: the bottom); popping a frame continues at its return node on
 * each of its edges. Frames and edges are arrays truncated with the
 * matcher's states; a frame gets edges only in the closure that made it. */
typedef struct k3g_gframe {
    int32_t ret;     /* the node the rules below continue from */
    uint32_t gen;    /* the closure that made it */
    int32_t edge;    /* its first edge, or -1 */
    uint32_t popped; /* gen when the rule above it ended in that same closure (nullable) */
} k3g_gframe;

typedef struct k3g_gedge {
    int32_t parent; /* the frame below, or -1 */
    int32_t next;   /* the frame's next edge, or -1 */
} k3g_gedge;

typedef struct k3g_gss {
    k3g_gframe *f;
    int32_t nf;
    size_t capf;
    k3g_gedge *e;
    int32_t ne;
    size_t cape;
    uint32_t gen; /* closures so far */
} k3g_gss;

#define K3G_MAX_GSS (1 << 22) /* frames or edges per matcher: past it, a budget error */
/* Work budgets, in configurations a closure processes (a few ns to a few
 * tens of ns each): one token's mask, one token accepted, one token table
 * (walk.c). A mask or an accept past its budget fails that request alone
 * with an error saying so; the engine's step goes on for the others. */
#define K3G_MASK_WORK (1 << 18)
#define K3G_ACCEPT_WORK (1 << 18)
#define K3G_TABLE_WORK (1 << 22)

void k3g_gss_free(k3g_gss *s);
bool k3g_gss_copy(k3g_gss *dst, const k3g_gss *src);
static inline void k3g_gss_truncate(k3g_gss *s, int32_t nf, int32_t ne) {
    if (nf < s->nf) s->nf = nf;
    if (ne < s->ne) s->ne = ne;
}
/* k3g_closure and k3g_scan_byte over graph-structured stacks. */
bool k3g_gss_closure(const k3_grammar *g, k3g_gss *s, k3g_cscratch *cs, const k3g_cfg *seeds, size_t n_seeds,
                     k3g_cfgv *out, bool *bottom);
bool k3g_gss_scan_byte(const k3_grammar *g, k3g_gss *s, k3g_cscratch *cs, const k3g_cfg *in, size_t n_in, unsigned c,
                       k3g_cfgv *out, bool *bottom);
/* The configurations that popping frame f leads to (one per edge), appended to out. */
bool k3g_gss_pop(const k3g_gss *s, int32_t f, k3g_cfgv *out);

#endif /* K3_GRAMMAR_PARSER_H */
