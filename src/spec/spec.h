/*
 * spec.h -- speculative decoding's pieces that know no engine (docs/spec.md):
 *
 *   - proposers: what drafts the next tokens of a sequence, behind one
 *     interface (k3_proposer): a suffix structure over the sequence's own
 *     prompt and output plus a bounded cache of recent outputs per scope
 *     (one scope per API key; suffix.c), an n-gram lookup over the sequence
 *     (ngram.c), and a second, small model of the same vocabulary
 *     (draft_model.c);
 *   - the acceptance rule (verify.c): greedy and strict drafts are accepted
 *     while the target's own draw equals them; a proposer that gives its
 *     distribution q gets the rejection-sampling rule (accept d with
 *     probability min(1, p(d)/q(d)), else draw from max(0, p - q)), so the
 *     output distribution is the target's either way;
 *   - the cost model and the draft length (policy.c): a running estimate of
 *     a pass's time by its rows, a running acceptance rate per sequence, and
 *     the drafts of a step chosen to maximize tokens per second.
 *
 * The engine (src/engine/draft.c and verify.c) wires them into its step.
 */
#ifndef K3_SPEC_SPEC_H
#define K3_SPEC_SPEC_H

#include <stdbool.h>
#include <stdint.h>

#include "k3.h"

#define K3_SPEC_MAX_DRAFT \
    K3_SPEC_MAX_TOKENS /* draft tokens per sequence and step at most (a verify chunk is this + 1) */

/* ---- a bounded-depth suffix tree with counts (suffix.c) --------------------
 * Every substring of at most `depth` tokens of the texts inserted, as a path
 * from the root, each node counting the occurrences of its string (start
 * positions); children are found by (node, token) in a hash table and listed
 * per node. Texts can be removed again (counts go down, empty nodes go). */
typedef struct k3_stree {
    int32_t depth;
    int32_t *cnt, *tok, *par;                /* [cap] per node: count, token, parent */
    int32_t *first, *next, *prev;            /* [cap] its children's list: first child, next and previous sibling */
    int32_t *slink;                          /* [cap] the node of the string without its first token (the root's: 0) */
    uint8_t *dep;                            /* [cap] depth */
    int32_t n_nodes, cap, n_free, free_head; /* freed ids: a list through next, the last freed first */
    struct k3_stree_slot {
        uint32_t tag; /* a hash of (parent, token), >= 2; 0 = empty, 1 = deleted */
        int32_t val;  /* the child (its parent and token confirm a matching tag) */
    } * h;            /* the children: 8 bytes a slot */
    uint32_t hmask;
    int64_t h_used;
    int64_t max_nodes; /* a budget: insertions stop creating nodes past it */
    uint64_t version;  /* bumped by every change: active lists made before are stale */
} k3_stree;

k3_status k3_stree_init(k3_stree *t, int32_t depth, int64_t max_nodes, k3_error *err);
/* Empties the tree for new texts under a new node budget, keeping its
 * memory (a tree made again costs its allocations, their page faults and
 * the table's growth again; one reused costs the table's clearing). The
 * texts to come are expected to make at most nodes_hint nodes: a table far
 * larger than that is replaced by a smaller one. */
void k3_stree_clear(k3_stree *t, int64_t max_nodes, int64_t nodes_hint);
void k3_stree_free(k3_stree *t);
int64_t k3_stree_bytes(const k3_stree *t);
/* The child of node u by token x, or -1. */
int32_t k3_stree_child(const k3_stree *t, int32_t u, int32_t x);

/* The nodes of the suffixes (lengths 1..depth) of a text that the tree
 * holds, deepest last: act[i] has depth i + 1 while they are consecutive. */
typedef struct k3_sactive {
    int32_t n;
    int32_t node[64];
    uint64_t version;
} k3_sactive;
/* Inserts token x at the end of a text whose active suffixes are a (counts
 * +1 for each suffix that now ends in x; a fresh a for a new text). */
void k3_stree_push(k3_stree *t, k3_sactive *a, int32_t x);
/* The same walk, counts -1 (removing a text token by token, in order);
 * nodes that reach 0 are freed. */
void k3_stree_pop(k3_stree *t, k3_sactive *a, int32_t x);
/* Follows token x without changing the tree (matching a text against it). */
void k3_stree_follow(const k3_stree *t, k3_sactive *a, int32_t x);
/* Rebuilds the active nodes of the text ending in tail[0..n) (n <= depth). */
void k3_stree_rematch(const k3_stree *t, k3_sactive *a, const int32_t *tail, int32_t n);
/* The best draft from the active suffixes: for each matched depth d with
 * a continuation, a greedy walk down the most frequent
 * children while the product of count ratios stays >= min_prob, at most
 * min(max, spec_factor * d, depth - d) tokens; the one whose sum of
 * products is highest. `self` says the text's own last occurrence is in the
 * tree (its count has no continuation). Returns the tokens drafted, with
 * each one's probability given the ones before in conf; *score the sum. */
int32_t k3_stree_draft(const k3_stree *t, const k3_sactive *a, bool self, int32_t max, float spec_factor,
                       float min_prob, int32_t *draft, float *conf, float *score);

/* ---- an n-gram index over one sequence (ngram.c) --------------------------- */
typedef struct k3_ngram {
    int32_t n_min, n_max;
    uint64_t *key; /* gram hash (0 = empty) */
    int64_t *pos;  /* the last position such a gram ended at */
    uint64_t mask, used;
    int64_t n_indexed; /* grams ending before this position are in */
} k3_ngram;

k3_status k3_ngram_init(k3_ngram *g, int32_t n_min, int32_t n_max, k3_error *err);
void k3_ngram_free(k3_ngram *g);
int64_t k3_ngram_bytes(const k3_ngram *g);
/* Indexes tok[0..n) as far as it is not yet (tokens only ever append). */
void k3_ngram_index(k3_ngram *g, const int32_t *tok, int64_t n);
/* Up to max tokens that followed the most recent earlier occurrence of the
 * longest n-gram (n_max down to n_min) tok[0..n) ends with; *match its n. */
int32_t k3_ngram_draft(k3_ngram *g, const int32_t *tok, int64_t n, int32_t max, int32_t *draft, int32_t *match);

/* ---- proposers ---------------------------------------------------------- */

/* k3_spec_method is k3.h's (K3_SPEC_OFF, _SUFFIX, _NGRAM, _DRAFT_MODEL). */
const char *k3_spec_method_name(k3_spec_method m);
/* "suffix", "ngram", "draft_model" (vLLM's name) or "off": K3_OK, else K3_ERR_ARG naming it. */
k3_status k3_spec_method_parse(const char *s, k3_spec_method *out, k3_error *err);

typedef struct k3_spec_config {
    k3_spec_method method;
    int32_t num_speculative_tokens; /* k: draft tokens per step at most (<= K3_SPEC_MAX_DRAFT) */
    /* suffix (vLLM's suffix_decoding_* fields) */
    int32_t suffix_max_tree_depth;      /* 0 = 24 */
    int32_t suffix_max_cached_requests; /* per scope (0 = 64; < 0 = no cache of past outputs) */
    float suffix_max_spec_factor;       /* 0 = 1.0 */
    float suffix_min_token_prob;        /* 0 = 0.1 */
    int64_t suffix_prompt_window;       /* a prompt's last tokens indexed (0 = 16384) */
    int32_t suffix_max_scopes;          /* scopes (API keys) kept (0 = 64), least recently used out */
    /* ngram (vLLM's prompt_lookup_*) */
    int32_t prompt_lookup_min, prompt_lookup_max; /* 0 = 2, 5 */
    /* draft model */
    const k3_model *draft_model;
    k3_kv_type kv_cache; /* the draft model's cache format: the target's (so a model drafting for itself
                            computes what the target does) */
    k3_pool *pool;
    bool adaptive; /* choose k per step from the cost model (else always the proposer's length) */
} k3_spec_config;

/* One sequence's drafting state (opaque to the engine). */
typedef struct k3_spec_seq k3_spec_seq;
/* The proposers of one engine: the shared state (the suffix cache per
 * scope, the draft model's context). One thread. */
typedef struct k3_proposer k3_proposer;

k3_status k3_proposer_open(k3_proposer **out, const k3_spec_config *cfg, int32_t max_seqs, int64_t max_len,
                           k3_error *err);
void k3_proposer_close(k3_proposer *p);
/* A sequence starts: method (a request's own, or the engine's), its scope
 * (0 = the default scope; requests of different scopes never see each
 * other's outputs), its prompt. */
k3_status k3_spec_seq_open(k3_proposer *p, k3_spec_seq **out, k3_spec_method method, uint64_t scope,
                           const int32_t *prompt, int64_t n_prompt, k3_error *err);
/* Tokens appended to the sequence (accepted output, in order). */
void k3_spec_seq_append(k3_proposer *p, k3_spec_seq *s, const int32_t *tok, int32_t n);
/* Up to max draft tokens after the sequence's tokens tok[0..n) (what was
 * appended); conf[i] the proposer's probability of draft i given the ones
 * before; q (when the proposer samples: the draft model with
 * probabilistic rejection) [n_draft * V] its distributions, else NULL.
 * Returns the number of drafts (0: nothing worth proposing). */
int32_t k3_spec_seq_propose(k3_proposer *p, k3_spec_seq *s, const int32_t *tok, int64_t n, int32_t max, int32_t *draft,
                            float *conf);
/* The sequence ended: a completed output (stop or length) joins its
 * scope's cache of past outputs. */
void k3_spec_seq_close(k3_proposer *p, k3_spec_seq *s, bool completed);
/* A completed output of a request that never opened a sequence (its
 * drafting was never worth it) joins its scope's cache all the same: tok
 * holds its n_prompt prompt tokens and then its n_gen output tokens. */
void k3_spec_cache_output(k3_proposer *p, k3_spec_method method, uint64_t scope, const int32_t *tok, int64_t n_prompt,
                          int64_t n_gen);
k3_spec_method k3_spec_seq_method(const k3_spec_seq *s);
/* Bytes the proposers hold (the caches and trees). */
int64_t k3_proposer_bytes(const k3_proposer *p);

/* ---- the acceptance rule (verify.c) ---------------------------------------
 * p and q are distributions over n ids (summing to 1 where they are not
 * zero). The rejection-sampling rule for a draft d drawn from q: accepted
 * (returns d, *accepted true) when u1 < p(d) / q(d); otherwise a draw from
 * the residual max(0, p - q) normalized, with u2 (and *accepted false). The
 * token's distribution is p for any q (Leviathan et al. 2023, Theorem 1).
 * A point mass q (a greedy or copied draft) makes it: accept with
 * probability p(d), else draw from p without d -- which is what drawing
 * from p and comparing with d gives, so a strict draft is verified by the
 * target's own draw (the same random numbers as without drafts). */
int32_t k3_spec_reject_sample(const float *p, const float *q, int32_t n, int32_t d, double u1, double u2,
                              bool *accepted);

/* ---- the cost model and the draft length (policy.c) --------------------
 * A step's whole time, start to the next start, is its forward pass plus
 * what is around it: proposing, sampling, the rollback, the outputs and
 * the caller's handling of them (the server's per-token work). The model
 * learns, at run time, from the engine's own steps of decodes and verify
 * chunks:
 *   - a plain step's whole time by its decodes n (an EWMA per count);
 *   - what verify chunks add to it: y = a x chunks + b x draft tokens,
 *     least squares over the recent such steps (decayed), one fit per batch
 *     size class (1, 2, 3-4, 5-8, ...): a verify row's cost depends on the
 *     batch it joins (four sequences' rows read four contexts; one
 *     sequence's drafts one), as do the pass's regime and the outputs; a
 *     class not yet seen drafting prices a draft row at least as a decode
 *     row of its batch (the plain step's growth from a smaller batch);
 *   - the pass's time by its rows alone (an EWMA per row count), which
 *     stands in until steps have been seen.
 * The drafts of a step are chosen on the batch's expected tokens per
 * second: (decodes + expected accepted drafts) / the step's whole time. */

#define K3_SPEC_ROWS_MAX 256    /* pass sizes the model keeps apart */
#define K3_SPEC_PLAIN_EVERY 256 /* a step without drafts at a batch size at least this often */
#define K3_SPEC_PLAIN_MIN 3     /* ... and this many before drafts are measured against it */
#define K3_SPEC_PLAIN_KEEP 5    /* a plain step's time is the median of the last this many */
#define K3_SPEC_CLASSES 9       /* batch size classes of the verify fit: 1, 2, 3-4, ..., 129-256 */

typedef struct k3_spec_fit {
    double s_cc, s_cd, s_dd, s_cy, s_dy; /* decayed sums of the products */
    int64_t n_obs;
    double a_chunk, b_draft; /* the fit (>= 0) */
} k3_spec_fit;

typedef struct k3_spec_policy {
    double t[K3_SPEC_ROWS_MAX + 1]; /* seconds of a decode/verify pass of r rows (EWMA) */
    int32_t n_obs[K3_SPEC_ROWS_MAX + 1];
    double plain[K3_SPEC_ROWS_MAX + 1]; /* seconds of a whole step of r decodes alone: the median of ... */
    double plain_last[K3_SPEC_ROWS_MAX + 1][K3_SPEC_PLAIN_KEEP]; /* ... the last K3_SPEC_PLAIN_KEEP seen */
    int32_t n_obs_plain[K3_SPEC_ROWS_MAX + 1];
    int64_t plain_at[K3_SPEC_ROWS_MAX + 1]; /* the step it was last seen at */
    int64_t n_steps;                        /* steps observed */
    k3_spec_fit fit[K3_SPEC_CLASSES];
    double prior_slope; /* t(r) / t(1) - 1 per extra row before any is seen */
} k3_spec_policy;

/* One step as the cost model sees it: its decodes (one row each), its
 * verify chunks and their draft tokens (rows = n_dec + n_drafts), its
 * forward pass and its whole time (start to the next step's start). */
typedef struct k3_spec_step {
    int32_t n_dec, n_chunks, n_drafts;
    double pass_s, step_s;
} k3_spec_step;

void k3_spec_policy_init(k3_spec_policy *p, double prior_slope);
/* A pass of rows rows, all decodes or verify chunks, took seconds. */
void k3_spec_policy_observe(k3_spec_policy *p, int32_t rows, double seconds);
/* A whole step of decodes and verify chunks (its pass is observed too). */
void k3_spec_policy_observe_step(k3_spec_policy *p, const k3_spec_step *st);
/* A step of n_dec decodes where drafts were offered and none taken: the
 * verify fit of its class loses weight (so a cost measured in a bad moment
 * is measured again after a while instead of ruling drafting out for good). */
void k3_spec_policy_declined(k3_spec_policy *p, int32_t n_dec);
/* The estimated time of a pass of rows rows (relative: t(1) = 1 before any
 * observation). */
double k3_spec_policy_cost(const k3_spec_policy *p, int32_t rows);
/* The estimated whole time of a step of n_dec decodes of which n_chunks
 * verify n_drafts draft tokens (before any step is seen: the pass's). */
double k3_spec_policy_step_cost(const k3_spec_policy *p, int32_t n_dec, int32_t n_chunks, int32_t n_drafts);
/* Whether this step of base decodes should go without drafts (and without
 * proposing): fewer than K3_SPEC_PLAIN_MIN such have been seen, or none in
 * the last K3_SPEC_PLAIN_EVERY steps (what verify chunks add is measured
 * against it). */
bool k3_spec_policy_plain_due(const k3_spec_policy *p, int32_t base);

/* One sequence's candidates for a step: gain[j] (j < n) the probability
 * that its first j + 1 drafts are all accepted. */
typedef struct k3_spec_cand {
    int32_t n;
    float gain[K3_SPEC_MAX_DRAFT];
} k3_spec_cand;
/* The drafts to verify this step: base decodes plus the draft tokens
 * chosen, highest marginal gain first, the set of the highest expected
 * tokens per second of the whole step: (base + sum of chosen gains) /
 * k3_spec_policy_step_cost(base, sequences drafting, chosen). Writes each
 * sequence's count to take[i]; returns the total. */
int32_t k3_spec_policy_choose(const k3_spec_policy *p, int32_t base, const k3_spec_cand *c, int32_t n_seqs,
                              int32_t *take);
/* Whether any draft could pay at base decodes: k drafts sure to be accepted
 * by one sequence (the most a draft can bring) beat the plain step for some
 * k <= max_k. Where none can, the engine does not even propose (nor index a
 * new request's prompt for it). */
bool k3_spec_policy_may_pay(const k3_spec_policy *p, int32_t base, int32_t max_k);

/* A sequence's calibration of its proposer's confidences: draft tokens
 * accepted over the confidences they were drafted with, both decayed at
 * every step (so a sequence that stopped drafting drifts back to trying),
 * from a prior of one half each. */
typedef struct k3_spec_calib {
    float acc, conf;
} k3_spec_calib;
void k3_spec_calib_init(k3_spec_calib *c);
/* A step of the sequence: n_draft of its drafts verified (0: none this
 * step), the first n_acc accepted; conf their confidences. */
void k3_spec_calib_update(k3_spec_calib *c, const float *conf, int32_t n_draft, int32_t n_acc);
/* The policy's gains of n drafts: gain[j] = prod_{i <= j} min(1, conf[i] x ratio). */
void k3_spec_calib_gains(const k3_spec_calib *c, const float *conf, int32_t n, k3_spec_cand *out);

#endif /* K3_SPEC_SPEC_H */
