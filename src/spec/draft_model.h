/*
 * draft_model.h -- the draft-model proposer (spec.h, K3_SPEC_DRAFT_MODEL):
 * a second, small checkpoint of the same vocabulary that drafts greedily.
 */
#ifndef K3_SPEC_DRAFT_MODEL_H
#define K3_SPEC_DRAFT_MODEL_H

#include "k3.h"

typedef struct k3_draft_model k3_draft_model;

k3_status k3_draft_model_open(k3_draft_model **out, const k3_model *m, k3_pool *pool, k3_kv_type kv, int32_t max_seqs,
                              int64_t max_len, k3_error *err);
void k3_draft_model_close(k3_draft_model *d);
k3_status k3_draft_model_seq_open(k3_draft_model *d, int32_t *slot, k3_error *err);
void k3_draft_model_seq_close(k3_draft_model *d, int32_t slot);
/* Up to max greedy draft tokens after tok[0..n) (n >= 1; the tokens only
 * ever grow between calls), each with its softmax probability in conf. */
int32_t k3_draft_model_propose(k3_draft_model *d, int32_t slot, const int32_t *tok, int64_t n, int32_t max,
                               int32_t *draft, float *conf);

#endif /* K3_SPEC_DRAFT_MODEL_H */
