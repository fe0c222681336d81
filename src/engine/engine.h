/*
 * engine.h -- internal views of a k3_engine for tests and benchmarks.
 */
#ifndef K3_ENGINE_ENGINE_H
#define K3_ENGINE_ENGINE_H

#include "k3.h"

/* Blocks on the free list (reference count 0, cached or not). */
int64_t k3_engine_blocks_free(const k3_engine *e);
/* The block manager is consistent and every reference is held by a
 * request's block table. */
bool k3_engine_check(const k3_engine *e);

/* The hashes of the blocks the prefix cache holds (up to cap into out, in
 * block id order); returns how many there are. */
int64_t k3_engine_cached_hashes(k3_engine *e, uint64_t *out, int64_t cap);

#endif /* K3_ENGINE_ENGINE_H */
