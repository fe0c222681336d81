/*
 * safetensors.h -- safetensors files, memory-mapped, and sharded sets of them.
 *
 * A file is `u64 header_len | JSON header | data`. k3_st_parse is the pure,
 * fuzzable part: it validates the header against the buffer size (offsets
 * inside the data area, no overlaps, byte counts that match dtype x shape)
 * and never reads tensor data. k3_st_open maps a checkpoint directory: one
 * `model.safetensors`, or `model.safetensors.index.json` naming shards.
 * Tensor data points into the read-only mapping; nothing is copied.
 */
#ifndef K3_MODEL_SAFETENSORS_H
#define K3_MODEL_SAFETENSORS_H

#include "k3.h"

typedef enum k3_dtype {
    K3_DTYPE_F32 = 0,
    K3_DTYPE_F16,
    K3_DTYPE_BF16,
    K3_DTYPE_U8,
    K3_DTYPE_I8,
    K3_DTYPE_I32,
    K3_DTYPE_I64,
    K3_DTYPE_F64,
    K3_DTYPE_F8_E4M3,
    K3_DTYPE_BOOL,
    K3_DTYPE_COUNT
} k3_dtype;

#define K3_ST_MAX_DIMS 8

typedef struct k3_st_tensor {
    char *name; /* owned by the set */
    k3_dtype dtype;
    int32_t ndim;
    int64_t shape[K3_ST_MAX_DIMS];
    const uint8_t *data; /* into the mapping; borrowed */
    size_t nbytes;
    int32_t file; /* index of the shard it lives in */
} k3_st_tensor;

typedef struct k3_st k3_st; /* a set of mapped files + a name index */

const char *k3_dtype_name(k3_dtype t);
size_t k3_dtype_size(k3_dtype t);

/* Parses one file image buf[0..size) and appends its tensors to st
 * (file index `file`, messages name `path`). Pure: reads only the header. */
k3_status k3_st_parse(k3_st *st, const uint8_t *buf, size_t size, int32_t file, const char *path, k3_error *err);

/* An empty set, for k3_st_parse and tests. */
k3_status k3_st_init(k3_st **out, k3_error *err);
/* Opens DIR/model.safetensors or DIR/model.safetensors.index.json. */
k3_status k3_st_open(k3_st **out, const char *dir, k3_error *err);
void k3_st_close(k3_st *st);
/* Folds every mapped file's header (its length and JSON: names, dtypes,
 * shapes, offsets) into h: what the files hold, without reading the data. */
uint64_t k3_st_header_hash(const k3_st *st, uint64_t h);

/* Looks a tensor up by its full name; NULL when absent. */
const k3_st_tensor *k3_st_get(const k3_st *st, const char *name);
int64_t k3_st_count(const k3_st *st);
/* True when p points into one of the set's mapped files. */
bool k3_st_maps(const k3_st *st, const void *p);
const k3_st_tensor *k3_st_at(const k3_st *st, int64_t i);
/* Total bytes of all tensors whose name starts with prefix ("" = all). */
int64_t k3_st_bytes(const k3_st *st, const char *prefix);

#endif /* K3_MODEL_SAFETENSORS_H */
