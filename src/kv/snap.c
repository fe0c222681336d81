/*
 * snap.c -- the KDA state snapshots of the prefix cache (kv.h): entries
 * under a byte budget, an LRU over them, a small hash table from key to
 * entry. Buffers are allocated on first use and kept for reuse.
 */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "kv/kv.h"

k3_status k3_kv_snaps_init(k3_kv_snaps *sn, int64_t bytes_each, int64_t budget, k3_error *err) {
    memset(sn, 0, sizeof *sn);
    sn->bytes_each = bytes_each;
    sn->head = sn->tail = -1;
    int64_t cap = bytes_each > 0 ? budget / bytes_each : 0;
    if (cap > (1 << 20)) cap = 1 << 20;
    sn->cap = (int32_t)cap;
    uint32_t nb = 16;
    while (nb < (uint32_t)sn->cap * 2u) nb <<= 1;
    sn->bucket_mask = nb - 1;
    const size_t n = cap > 0 ? (size_t)cap : 1;
    sn->key = calloc(n, sizeof(uint64_t));
    sn->pos = calloc(n, sizeof(int64_t));
    sn->data = calloc(n, sizeof(void *));
    sn->pins = calloc(n, sizeof(int32_t));
    sn->prev = malloc(n * sizeof(int32_t));
    sn->next = malloc(n * sizeof(int32_t));
    sn->chain = malloc(n * sizeof(int32_t));
    sn->free_list = malloc(n * sizeof(int32_t));
    sn->bucket = malloc(nb * sizeof(int32_t));
    if (!sn->key || !sn->pos || !sn->data || !sn->pins || !sn->prev || !sn->next || !sn->chain || !sn->free_list ||
        !sn->bucket) {
        k3_kv_snaps_free(sn);
        return k3_err(err, K3_ERR_NOMEM, "snapshots: out of memory");
    }
    for (uint32_t i = 0; i < nb; i++) sn->bucket[i] = -1;
    for (int32_t i = 0; i < sn->cap; i++) sn->free_list[i] = sn->cap - 1 - i;
    sn->n_free_slots = sn->cap;
    return K3_OK;
}

void k3_kv_snaps_free(k3_kv_snaps *sn) {
    if (sn->data)
        for (int32_t i = 0; i < sn->cap; i++) free(sn->data[i]);
    free(sn->key);
    free(sn->pos);
    free(sn->data);
    free(sn->pins);
    free(sn->prev);
    free(sn->next);
    free(sn->chain);
    free(sn->free_list);
    free(sn->bucket);
    memset(sn, 0, sizeof *sn);
}

static int32_t find(const k3_kv_snaps *sn, uint64_t key, int64_t pos) {
    if (sn->cap == 0) return -1;
    for (int32_t e = sn->bucket[key & sn->bucket_mask]; e >= 0; e = sn->chain[e])
        if (sn->key[e] == key && sn->pos[e] == pos) return e;
    return -1;
}

static void lru_remove(k3_kv_snaps *sn, int32_t e) {
    const int32_t p = sn->prev[e], n = sn->next[e];
    if (p >= 0) sn->next[p] = n;
    else sn->head = n;
    if (n >= 0) sn->prev[n] = p;
    else sn->tail = p;
}

static void lru_push_tail(k3_kv_snaps *sn, int32_t e) {
    sn->prev[e] = sn->tail;
    sn->next[e] = -1;
    if (sn->tail >= 0) sn->next[sn->tail] = e;
    else sn->head = e;
    sn->tail = e;
}

bool k3_kv_snap_has(const k3_kv_snaps *sn, uint64_t key, int64_t pos) { return find(sn, key, pos) >= 0; }

const void *k3_kv_snap_find(k3_kv_snaps *sn, uint64_t key, int64_t pos) {
    const int32_t e = find(sn, key, pos);
    if (e < 0) return NULL;
    lru_remove(sn, e);
    lru_push_tail(sn, e);
    sn->n_restored++;
    return sn->data[e];
}

/* The entry for key at pos: an existing one (*existing, moved to the LRU's
 * tail), or a free or evicted one not linked yet; -1 when the existing one is
 * pinned or every entry is. */
static int32_t entry_for(k3_kv_snaps *sn, uint64_t key, int64_t pos, bool *existing) {
    int32_t e = find(sn, key, pos);
    *existing = e >= 0;
    if (e >= 0) {
        if (sn->pins[e]) return -1; /* a save reads it: not overwritten meanwhile */
        lru_remove(sn, e);
        lru_push_tail(sn, e);
        return e;
    }
    if (sn->n_free_slots == 0) {
        /* evict the least recently used that no save reads */
        e = sn->head;
        while (e >= 0 && sn->pins[e]) e = sn->next[e];
        if (e < 0) return -1;
        lru_remove(sn, e);
        int32_t *at = &sn->bucket[sn->key[e] & sn->bucket_mask];
        while (*at != e) at = &sn->chain[*at];
        *at = sn->chain[e];
        sn->n--;
        sn->n_evicted++;
    } else {
        e = sn->free_list[--sn->n_free_slots];
    }
    return e;
}

static void link_entry(k3_kv_snaps *sn, int32_t e, uint64_t key, int64_t pos) {
    sn->key[e] = key;
    sn->pos[e] = pos;
    int32_t *head = &sn->bucket[key & sn->bucket_mask];
    sn->chain[e] = *head;
    *head = e;
    lru_push_tail(sn, e);
    sn->n++;
    sn->n_taken++;
}

void *k3_kv_snap_put(k3_kv_snaps *sn, uint64_t key, int64_t pos) {
    if (sn->cap == 0) return NULL;
    bool existing;
    const int32_t e = entry_for(sn, key, pos, &existing);
    if (e < 0) return NULL;
    if (existing) return sn->data[e];
    if (!sn->data[e]) /* on a page, whole pages: the disk tier writes it with O_DIRECT */
        sn->data[e] = aligned_alloc(4096, ((size_t)sn->bytes_each + 4095) / 4096 * 4096);
    if (!sn->data[e]) {
        sn->free_list[sn->n_free_slots++] = e;
        return NULL;
    }
    link_entry(sn, e, key, pos);
    return sn->data[e];
}

bool k3_kv_snap_adopt(k3_kv_snaps *sn, uint64_t key, int64_t pos, void **buf) {
    if (sn->cap == 0 || !*buf) return false;
    bool existing;
    const int32_t e = entry_for(sn, key, pos, &existing);
    if (e < 0) return false;
    void *old = sn->data[e];
    sn->data[e] = *buf;
    *buf = old;
    if (!existing) link_entry(sn, e, key, pos);
    return true;
}

const void *k3_kv_snap_pin(k3_kv_snaps *sn, uint64_t key, int64_t pos) {
    const int32_t e = find(sn, key, pos);
    if (e < 0) return NULL;
    sn->pins[e]++;
    return sn->data[e];
}

void k3_kv_snap_unpin(k3_kv_snaps *sn, uint64_t key, int64_t pos) {
    const int32_t e = find(sn, key, pos);
    if (e >= 0 && sn->pins[e] > 0) sn->pins[e]--;
}

int32_t k3_kv_snap_pinned(const k3_kv_snaps *sn) {
    int32_t n = 0;
    for (int32_t e = sn->head; e >= 0; e = sn->next[e]) n += sn->pins[e] > 0;
    return n;
}

void k3_kv_snap_drop(k3_kv_snaps *sn, uint64_t key, int64_t pos) {
    const int32_t e = find(sn, key, pos);
    if (e < 0 || sn->pins[e]) return;
    lru_remove(sn, e);
    int32_t *at = &sn->bucket[key & sn->bucket_mask];
    while (*at != e) at = &sn->chain[*at];
    *at = sn->chain[e];
    sn->free_list[sn->n_free_slots++] = e;
    sn->n--;
    sn->n_taken--;
}
