/*
 * store.c -- the Responses store (store.h): a doubly linked list in
 * recency order (head: the most recent) under one mutex. Lookups walk the
 * list; at K3_SRV_STORE_ENTRIES entries that is microseconds next to a
 * generation.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "server/store.h"

typedef struct entry {
    struct entry *prev, *next;
    char *id, *response, *history;
    size_t bytes; /* id, response and history together */
} entry;

struct k3_srv_store {
    pthread_mutex_t mu;
    entry *head, *tail;
    size_t n, bytes, max_n, max_bytes;
};

k3_srv_store *k3_srv_store_new(size_t max_entries, size_t max_bytes) {
    k3_srv_store *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    pthread_mutex_init(&st->mu, NULL);
    st->max_n = max_entries;
    st->max_bytes = max_bytes;
    return st;
}

static void entry_free(entry *e) {
    free(e->id);
    free(e->response);
    free(e->history);
    free(e);
}

static void unlink_entry(k3_srv_store *st, entry *e) {
    if (e->prev) e->prev->next = e->next;
    else st->head = e->next;
    if (e->next) e->next->prev = e->prev;
    else st->tail = e->prev;
    e->prev = e->next = NULL;
    st->n--;
    st->bytes -= e->bytes;
}

static void push_front(k3_srv_store *st, entry *e) {
    e->prev = NULL;
    e->next = st->head;
    if (st->head) st->head->prev = e;
    st->head = e;
    if (!st->tail) st->tail = e;
    st->n++;
    st->bytes += e->bytes;
}

static entry *find(k3_srv_store *st, const char *id) {
    for (entry *e = st->head; e; e = e->next)
        if (!strcmp(e->id, id)) return e;
    return NULL;
}

void k3_srv_store_free(k3_srv_store *st) {
    if (!st) return;
    for (entry *e = st->head, *nx; e; e = nx) {
        nx = e->next;
        entry_free(e);
    }
    pthread_mutex_destroy(&st->mu);
    free(st);
}

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (!d) return NULL;
    if (n) memcpy(d, s, n);
    d[n] = 0;
    return d;
}

bool k3_srv_store_put(k3_srv_store *st, const char *id, const char *response, size_t rlen, const char *history,
                      size_t hlen) {
    const size_t il = strlen(id), bytes = il + rlen + hlen;
    if (!st || st->max_n == 0 || bytes > st->max_bytes) return false;
    entry *e = calloc(1, sizeof *e);
    if (!e || !(e->id = dup_n(id, il)) || !(e->response = dup_n(response, rlen)) ||
        !(e->history = dup_n(history, hlen))) {
        if (e) entry_free(e);
        return false;
    }
    e->bytes = bytes;
    pthread_mutex_lock(&st->mu);
    entry *old = find(st, id);
    if (old) {
        unlink_entry(st, old);
        entry_free(old);
    }
    push_front(st, e);
    while (st->tail != e && (st->n > st->max_n || st->bytes > st->max_bytes)) {
        entry *t = st->tail;
        unlink_entry(st, t);
        entry_free(t);
    }
    pthread_mutex_unlock(&st->mu);
    return true;
}

bool k3_srv_store_get(k3_srv_store *st, const char *id, char **response, char **history) {
    if (response) *response = NULL;
    if (history) *history = NULL;
    if (!st) return false;
    pthread_mutex_lock(&st->mu);
    entry *e = find(st, id);
    bool ok = e != NULL;
    if (e) {
        unlink_entry(st, e);
        push_front(st, e);
        if (response && !(*response = strdup(e->response))) ok = false;
        if (ok && history && !(*history = strdup(e->history))) ok = false;
    }
    pthread_mutex_unlock(&st->mu);
    if (!ok) {
        if (response) free(*response), *response = NULL;
        if (history) free(*history), *history = NULL;
    }
    return ok;
}

bool k3_srv_store_delete(k3_srv_store *st, const char *id) {
    if (!st) return false;
    pthread_mutex_lock(&st->mu);
    entry *e = find(st, id);
    if (e) {
        unlink_entry(st, e);
        entry_free(e);
    }
    pthread_mutex_unlock(&st->mu);
    return e != NULL;
}

void k3_srv_store_usage(k3_srv_store *st, size_t *entries, size_t *bytes) {
    pthread_mutex_lock(&st->mu);
    if (entries) *entries = st->n;
    if (bytes) *bytes = st->bytes;
    pthread_mutex_unlock(&st->mu);
}
