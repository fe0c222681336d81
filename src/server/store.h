/*
 * store.h -- the Responses API's store (store.c): the responses kept for
 * GET /v1/responses/{id} and previous_response_id, in memory, bounded by a
 * count and by bytes, least recently used first out. An entry is two
 * serialized JSON texts: the response object as answered and the
 * conversation it ends (chat messages), so nothing is shared with the
 * threads that read it.
 */
#ifndef K3_SERVER_STORE_H
#define K3_SERVER_STORE_H

#include <stdbool.h>
#include <stddef.h>

#define K3_SRV_STORE_ENTRIES 1024             /* responses kept at most */
#define K3_SRV_STORE_BYTES ((size_t)64 << 20) /* their JSON texts together at most */

typedef struct k3_srv_store k3_srv_store;

/* NULL when out of memory. */
k3_srv_store *k3_srv_store_new(size_t max_entries, size_t max_bytes);
void k3_srv_store_free(k3_srv_store *st);
/* Keeps copies of response[0..rlen) and history[0..hlen) under id (an
 * entry with the same id is replaced) as the most recent entry, then
 * drops the least recently used entries until both bounds hold again.
 * False (nothing kept) when the entry alone is over the byte bound or
 * memory runs out. */
bool k3_srv_store_put(k3_srv_store *st, const char *id, const char *response, size_t rlen, const char *history,
                      size_t hlen);
/* Copies of id's texts (caller frees; either pointer may be NULL), and
 * id becomes the most recent entry. False when id is not kept (or memory
 * runs out). */
bool k3_srv_store_get(k3_srv_store *st, const char *id, char **response, char **history);
/* Forgets id; false when it was not kept. */
bool k3_srv_store_delete(k3_srv_store *st, const char *id);
/* The entries and bytes kept now. */
void k3_srv_store_usage(k3_srv_store *st, size_t *entries, size_t *bytes);

#endif /* K3_SERVER_STORE_H */
