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
bool k3g_scan_byte(const k3_grammar *g, k3g_frames *fr, k3g_cscratch *cs, const k3g_cfg *in, size_t n_in, unsigned c,
                   k3g_cfgv *out, bool *bottom);
bool k3g_cfgv_push(k3g_cfgv *v, k3g_cfg c);

#endif /* K3_GRAMMAR_PARSER_H */
