/*
 * plan.h -- the model's arithmetic from its config alone (plan.c): what a
 * token costs in the caches, and k3_plan_compute of k3.h (weights, caches,
 * KDA state and traffic per rank for k3 plan).
 */
#ifndef K3_MODEL_PLAN_H
#define K3_MODEL_PLAN_H

#include "model/config.h"

/* Bytes of one token in the latent and indexer caches over all MLA/DSA
 * layers, in format kv as a context stores it: f32 latent + rope (+ the
 * indexer key), or C8: int8 latent with an fp32 scale per 128-tile and an
 * fp32 rope part (+ an int8 indexer key with its fp32 scale). */
int64_t k3_config_cache_bytes_per_token(const k3_config *c, k3_kv_type kv);

#endif /* K3_MODEL_PLAN_H */
