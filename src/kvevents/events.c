/*
 * events.c -- vLLM's KV cache events (k3.h, "KV events"): the block
 * manager's observer (src/kv) queues what it stores and evicts; a thread
 * gathers them into batches every flush_s, encodes each as vLLM does
 * (msgspec's msgpack of its EventBatch / BlockStored / BlockRemoved /
 * AllBlocksCleared structs, docs/kvstore.md) and publishes it on a ZeroMQ
 * PUB socket as [topic, seq (8 bytes, big endian), payload], keeping the last
 * buffer_steps for the replay socket. Consecutive blocks of one chain become
 * one BlockStored, as vLLM sends a request's new blocks in one event.
 */
#include <errno.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "common/error.h"
#include "kv/kv.h"
#include "kvevents/events.h"

enum { EV_STORED, EV_REMOVED, EV_CLEARED };

typedef struct event {
    int kind;
    const char *medium; /* a string constant */
    uint64_t *hashes;
    int32_t n, cap;
    uint64_t parent;
    bool has_parent;
    int32_t *tokens; /* [n * block_size] */
    uint64_t *extra; /* [n] */
} event;

typedef struct sent {
    uint64_t seq;
    char *payload;
    size_t len;
} sent;

struct k3_kv_events {
    k3_kv_events_options o;
    char *topic;
    void *zctx, *pub, *replay;
    k3_kv_observer obs;
    int32_t block_size;
    uint64_t hash_seed;
    pthread_mutex_t mu;
    pthread_cond_t cv, cv_idle;
    bool sending;
    event *pending;
    int32_t n_pending, cap_pending;
    bool stop, started, oom;
    pthread_t th;
    uint64_t next_seq;
    sent *ring; /* [buffer_steps] the last batches, for replays */
    int32_t ring_head, ring_n;
    k3_kv_events_stats st;
};

/* ---- the observer (the engine's thread) ------------------------------------------ */

static event *push(k3_kv_events *ev, int kind) {
    if (ev->n_pending == ev->cap_pending) {
        const int32_t cap = ev->cap_pending ? 2 * ev->cap_pending : 16;
        event *p = realloc(ev->pending, sizeof *p * (size_t)cap);
        if (!p) return NULL;
        ev->pending = p;
        ev->cap_pending = cap;
    }
    event *e = &ev->pending[ev->n_pending++];
    memset(e, 0, sizeof *e);
    e->kind = kind;
    e->medium = K3_KV_EVENTS_MEDIUM;
    return e;
}

static bool add_hash(k3_kv_events *ev, event *e, uint64_t h, const int32_t *tokens, uint64_t extra) {
    if (e->n == e->cap) {
        const int32_t cap = e->cap ? 2 * e->cap : 4;
        uint64_t *hs = realloc(e->hashes, sizeof *hs * (size_t)cap);
        if (hs) e->hashes = hs;
        if (tokens) {
            int32_t *t = realloc(e->tokens, sizeof *t * (size_t)cap * (size_t)ev->block_size);
            uint64_t *x = realloc(e->extra, sizeof *x * (size_t)cap);
            if (t) e->tokens = t;
            if (x) e->extra = x;
            if (!t || !x) return false;
        }
        if (!hs) return false;
        e->cap = cap;
    }
    e->hashes[e->n] = h;
    if (tokens) {
        memcpy(e->tokens + (int64_t)e->n * ev->block_size, tokens, sizeof(int32_t) * (size_t)ev->block_size);
        e->extra[e->n] = extra;
    }
    e->n++;
    return true;
}

/* Under mu: a stored block of medium, joining the last event when it continues its chain. */
static void stored_locked(k3_kv_events *ev, const char *medium, uint64_t hash, uint64_t parent, bool has_parent,
                          uint64_t extra, const int32_t *tokens) {
    event *e = ev->n_pending ? &ev->pending[ev->n_pending - 1] : NULL;
    if (!e || e->kind != EV_STORED || strcmp(e->medium, medium) || !e->n || e->hashes[e->n - 1] != parent) {
        e = push(ev, EV_STORED);
        if (e) {
            e->medium = medium;
            e->has_parent = has_parent;
            e->parent = parent;
        }
    }
    if (!e || !add_hash(ev, e, hash, tokens, extra)) ev->oom = true;
}

static void removed_locked(k3_kv_events *ev, const char *medium, uint64_t hash) {
    event *e = ev->n_pending ? &ev->pending[ev->n_pending - 1] : NULL;
    if (!e || e->kind != EV_REMOVED || strcmp(e->medium, medium)) {
        e = push(ev, EV_REMOVED);
        if (e) e->medium = medium;
    }
    if (!e || !add_hash(ev, e, hash, NULL, 0)) ev->oom = true;
}

static void on_stored(void *arg, uint64_t hash, uint64_t parent, uint64_t extra, const int32_t *tokens, int32_t n) {
    k3_kv_events *ev = arg;
    if (n != ev->block_size) return;
    pthread_mutex_lock(&ev->mu);
    stored_locked(ev, K3_KV_EVENTS_MEDIUM, hash, parent, parent != ev->hash_seed, extra, tokens);
    pthread_mutex_unlock(&ev->mu);
}

static void on_removed(void *arg, uint64_t hash) {
    k3_kv_events *ev = arg;
    pthread_mutex_lock(&ev->mu);
    removed_locked(ev, K3_KV_EVENTS_MEDIUM, hash);
    pthread_mutex_unlock(&ev->mu);
}

void k3_kv_events_blocks(k3_kv_events *ev, const char *medium, bool stored, const uint64_t *hashes, int32_t n,
                         uint64_t parent, bool has_parent, const int32_t *tokens, const uint64_t *extra) {
    pthread_mutex_lock(&ev->mu);
    for (int32_t i = 0; i < n; i++) {
        if (stored)
            stored_locked(ev, medium, hashes[i], i ? hashes[i - 1] : parent, i ? true : has_parent,
                          extra ? extra[i] : 0, tokens + (int64_t)i * ev->block_size);
        else removed_locked(ev, medium, hashes[i]);
    }
    pthread_cond_broadcast(&ev->cv);
    pthread_mutex_unlock(&ev->mu);
}

const k3_kv_observer *k3_kv_events_observer(k3_kv_events *ev, int32_t block_size, uint64_t hash_seed) {
    pthread_mutex_lock(&ev->mu);
    ev->block_size = block_size;
    ev->hash_seed = hash_seed;
    pthread_mutex_unlock(&ev->mu);
    return &ev->obs;
}

/* ---- encoding (vLLM's layout) ---------------------------------------------------- */

static void pack_str(msgpack_packer *pk, const char *s) {
    const size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

static void pack_hashes(msgpack_packer *pk, const event *e) {
    msgpack_pack_array(pk, (size_t)e->n);
    for (int32_t i = 0; i < e->n; i++) msgpack_pack_uint64(pk, e->hashes[i]);
}

/* BlockStored: block_hashes, parent_block_hash, token_ids, block_size,
 * lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind
 * (vLLM's declaration order; kv_cache_spec_sliding_window is left out as
 * msgspec's omit_defaults leaves out a None default). The legacy array
 * stops after medium (vLLM 0.10's layout). */
static void pack_event(const k3_kv_events *ev, msgpack_packer *pk, const event *e) {
    const bool map = !ev->o.legacy_array;
    const int32_t bs = ev->block_size;
    if (e->kind == EV_CLEARED) {
        if (map) {
            msgpack_pack_map(pk, 1);
            pack_str(pk, "type");
        } else {
            msgpack_pack_array(pk, 1);
        }
        pack_str(pk, "AllBlocksCleared");
        return;
    }
    if (e->kind == EV_REMOVED) {
        if (map) {
            msgpack_pack_map(pk, 4);
            pack_str(pk, "type");
            pack_str(pk, "BlockRemoved");
            pack_str(pk, "block_hashes");
            pack_hashes(pk, e);
            pack_str(pk, "medium");
            pack_str(pk, e->medium);
            pack_str(pk, "group_idx");
            msgpack_pack_int32(pk, 0);
        } else {
            msgpack_pack_array(pk, 3);
            pack_str(pk, "BlockRemoved");
            pack_hashes(pk, e);
            pack_str(pk, e->medium);
        }
        return;
    }
    if (map) {
        msgpack_pack_map(pk, 11);
        pack_str(pk, "type");
    } else {
        msgpack_pack_array(pk, 7);
    }
    pack_str(pk, "BlockStored");
    if (map) pack_str(pk, "block_hashes");
    pack_hashes(pk, e);
    if (map) pack_str(pk, "parent_block_hash");
    if (e->has_parent) msgpack_pack_uint64(pk, e->parent);
    else msgpack_pack_nil(pk);
    if (map) pack_str(pk, "token_ids");
    msgpack_pack_array(pk, (size_t)e->n * (size_t)bs);
    for (int64_t i = 0; i < (int64_t)e->n * bs; i++) msgpack_pack_int32(pk, e->tokens[i]);
    if (map) pack_str(pk, "block_size");
    msgpack_pack_int32(pk, bs);
    if (map) pack_str(pk, "lora_id");
    msgpack_pack_nil(pk);
    if (map) pack_str(pk, "medium");
    pack_str(pk, e->medium);
    if (!map) return;
    pack_str(pk, "lora_name");
    msgpack_pack_nil(pk);
    /* one entry per block: None for text, (the image content hash,) for a block with image tokens */
    pack_str(pk, "extra_keys");
    msgpack_pack_array(pk, (size_t)e->n);
    for (int32_t i = 0; i < e->n; i++) {
        if (!e->extra[i]) {
            msgpack_pack_nil(pk);
        } else {
            msgpack_pack_array(pk, 1);
            msgpack_pack_uint64(pk, e->extra[i]);
        }
    }
    pack_str(pk, "group_idx");
    msgpack_pack_int32(pk, 0);
    pack_str(pk, "kv_cache_spec_kind");
    pack_str(pk, "full_attention");
}

/* ---- the publishing thread ----------------------------------------------------------- */

static void send_batch(k3_kv_events *ev, const event *evs, int32_t n) {
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, (double)t.tv_sec + (double)t.tv_nsec * 1e-9);
    msgpack_pack_array(&pk, (size_t)n);
    int64_t stored = 0, removed = 0, dstored = 0, dremoved = 0;
    for (int32_t i = 0; i < n; i++) {
        pack_event(ev, &pk, &evs[i]);
        const bool disk = !strcmp(evs[i].medium, K3_KV_EVENTS_MEDIUM_DISK);
        if (evs[i].kind == EV_STORED) *(disk ? &dstored : &stored) += evs[i].n;
        if (evs[i].kind == EV_REMOVED) *(disk ? &dremoved : &removed) += evs[i].n;
    }
    msgpack_pack_int32(&pk, ev->o.data_parallel_rank);
    const uint64_t seq = ev->next_seq++;
    unsigned char sq[8];
    for (int i = 0; i < 8; i++) sq[i] = (unsigned char)(seq >> (56 - 8 * i));
    zmq_send(ev->pub, ev->topic, strlen(ev->topic), ZMQ_SNDMORE);
    zmq_send(ev->pub, sq, 8, ZMQ_SNDMORE);
    zmq_send(ev->pub, sb.data, sb.size, 0);
    /* kept for replays */
    if (ev->o.buffer_steps > 0) {
        const int32_t cap = ev->o.buffer_steps;
        const int32_t slot = (ev->ring_head + ev->ring_n) % cap;
        if (ev->ring_n == cap) {
            free(ev->ring[ev->ring_head].payload);
            ev->ring_head = (ev->ring_head + 1) % cap;
            ev->ring_n--;
        }
        char *copy = malloc(sb.size ? sb.size : 1);
        if (copy) {
            memcpy(copy, sb.data, sb.size);
            ev->ring[slot] = (sent){seq, copy, sb.size};
            ev->ring_n++;
        }
    }
    pthread_mutex_lock(&ev->mu);
    ev->st.batches++;
    ev->st.events += n;
    ev->st.stored_blocks += stored;
    ev->st.removed_blocks += removed;
    ev->st.disk_stored_blocks += dstored;
    ev->st.disk_removed_blocks += dremoved;
    ev->st.bytes += (int64_t)sb.size;
    pthread_mutex_unlock(&ev->mu);
    msgpack_sbuffer_destroy(&sb);
}

/* One replay request: [identity, "", start (8 bytes)] -> the kept batches
 * from start on as [identity, "", seq, payload], then [identity, "", -1, ""]. */
static void serve_replay(k3_kv_events *ev) {
    zmq_msg_t fr[4];
    int n = 0, more = 1;
    while (more && n < 4) {
        zmq_msg_init(&fr[n]);
        if (zmq_msg_recv(&fr[n], ev->replay, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&fr[n]);
            break;
        }
        more = zmq_msg_more(&fr[n]);
        n++;
    }
    while (more) { /* drain a longer message */
        zmq_msg_t x;
        zmq_msg_init(&x);
        if (zmq_msg_recv(&x, ev->replay, ZMQ_DONTWAIT) < 0) more = 0;
        else more = zmq_msg_more(&x);
        zmq_msg_close(&x);
    }
    if (n == 3 && zmq_msg_size(&fr[2]) == 8) {
        const unsigned char *b = zmq_msg_data(&fr[2]);
        uint64_t start = 0;
        for (int i = 0; i < 8; i++) start = start << 8 | b[i];
        const void *id = zmq_msg_data(&fr[0]);
        const size_t id_len = zmq_msg_size(&fr[0]);
        for (int32_t k = 0; k < ev->ring_n; k++) {
            const sent *s = &ev->ring[(ev->ring_head + k) % ev->o.buffer_steps];
            if (s->seq < start) continue;
            unsigned char sq[8];
            for (int i = 0; i < 8; i++) sq[i] = (unsigned char)(s->seq >> (56 - 8 * i));
            zmq_send(ev->replay, id, id_len, ZMQ_SNDMORE);
            zmq_send(ev->replay, "", 0, ZMQ_SNDMORE);
            zmq_send(ev->replay, sq, 8, ZMQ_SNDMORE);
            zmq_send(ev->replay, s->payload, s->len, 0);
        }
        const unsigned char end[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
        zmq_send(ev->replay, id, id_len, ZMQ_SNDMORE);
        zmq_send(ev->replay, "", 0, ZMQ_SNDMORE);
        zmq_send(ev->replay, end, 8, ZMQ_SNDMORE);
        zmq_send(ev->replay, "", 0, 0);
        pthread_mutex_lock(&ev->mu);
        ev->st.replays++;
        pthread_mutex_unlock(&ev->mu);
    }
    for (int i = 0; i < n; i++) zmq_msg_close(&fr[i]);
}

static void free_events(event *evs, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        free(evs[i].hashes);
        free(evs[i].tokens);
        free(evs[i].extra);
    }
}

static void *publisher(void *arg) {
    k3_kv_events *ev = arg;
    const long wait_ms = (long)(ev->o.flush_s * 1000 + 0.5) > 0 ? (long)(ev->o.flush_s * 1000 + 0.5) : 1;
    for (;;) {
        if (ev->replay) {
            zmq_pollitem_t it = {.socket = ev->replay, .events = ZMQ_POLLIN};
            while (zmq_poll(&it, 1, 0) > 0 && (it.revents & ZMQ_POLLIN)) serve_replay(ev);
        }
        pthread_mutex_lock(&ev->mu);
        if (!ev->n_pending && !ev->stop) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += wait_ms * 1000000L;
            until.tv_sec += until.tv_nsec / 1000000000L;
            until.tv_nsec %= 1000000000L;
            pthread_cond_timedwait(&ev->cv, &ev->mu, &until);
        }
        event *evs = ev->pending;
        const int32_t n = ev->n_pending;
        const bool stop = ev->stop;
        ev->pending = NULL;
        ev->n_pending = ev->cap_pending = 0;
        ev->sending = n > 0;
        pthread_mutex_unlock(&ev->mu);
        if (n) send_batch(ev, evs, n);
        free_events(evs, n);
        free(evs);
        pthread_mutex_lock(&ev->mu);
        ev->sending = false;
        pthread_cond_broadcast(&ev->cv_idle);
        pthread_mutex_unlock(&ev->mu);
        if (stop) break;
        if (n) { /* let a step's events gather into one batch */
            struct timespec d = {0, wait_ms * 1000000L};
            nanosleep(&d, NULL);
        }
    }
    return NULL;
}

/* ---- open / close ------------------------------------------------------------------------ */

static bool binds(const char *ep) {
    return strchr(ep, '*') || strstr(ep, "::") || !strncmp(ep, "ipc://", 6) || !strncmp(ep, "inproc://", 9);
}

k3_status k3_kv_events_open(k3_kv_events **out, const k3_kv_events_options *opt, k3_error *err) {
    *out = NULL;
    if (!opt || !opt->endpoint || !*opt->endpoint)
        return k3_err(err, K3_ERR_ARG, "kv events: an endpoint is needed (as vLLM: tcp://HOST:PORT, ipc://PATH)");
    if (opt->flush_s < 0 || opt->buffer_steps < 0 || opt->hwm < 0)
        return k3_err(err, K3_ERR_ARG, "kv events: negative flush interval, buffer or high-water mark");
    k3_kv_events *ev = calloc(1, sizeof *ev);
    if (!ev) return k3_err(err, K3_ERR_NOMEM, "kv events: out of memory");
    ev->o = *opt;
    if (!ev->o.buffer_steps) ev->o.buffer_steps = 10000;
    if (!ev->o.hwm) ev->o.hwm = 100000;
    if (ev->o.flush_s <= 0) ev->o.flush_s = 0.01;
    ev->topic = strdup(opt->topic ? opt->topic : "");
    ev->ring = calloc((size_t)ev->o.buffer_steps, sizeof *ev->ring);
    pthread_mutex_init(&ev->mu, NULL);
    pthread_cond_init(&ev->cv, NULL);
    pthread_cond_init(&ev->cv_idle, NULL);
    ev->obs = (k3_kv_observer){on_stored, on_removed, ev};
    ev->zctx = zmq_ctx_new();
    if (!ev->topic || !ev->ring || !ev->zctx) {
        k3_kv_events_close(ev);
        return k3_err(err, K3_ERR_NOMEM, "kv events: out of memory");
    }
    ev->pub = zmq_socket(ev->zctx, ZMQ_PUB);
    const int hwm = ev->o.hwm, linger = 200;
    if (!ev->pub || zmq_setsockopt(ev->pub, ZMQ_SNDHWM, &hwm, sizeof hwm) ||
        zmq_setsockopt(ev->pub, ZMQ_LINGER, &linger, sizeof linger) ||
        (binds(opt->endpoint) ? zmq_bind(ev->pub, opt->endpoint) : zmq_connect(ev->pub, opt->endpoint))) {
        k3_err(err, K3_ERR_ARG, "kv events: cannot %s %s: %s", binds(opt->endpoint) ? "bind" : "connect", opt->endpoint,
               zmq_strerror(zmq_errno()));
        k3_kv_events_close(ev);
        return K3_ERR_ARG;
    }
    if (opt->replay_endpoint) {
        ev->replay = zmq_socket(ev->zctx, ZMQ_ROUTER);
        if (!ev->replay || zmq_setsockopt(ev->replay, ZMQ_LINGER, &linger, sizeof linger) ||
            zmq_bind(ev->replay, opt->replay_endpoint)) {
            k3_err(err, K3_ERR_ARG, "kv events: cannot bind the replay socket %s: %s", opt->replay_endpoint,
                   zmq_strerror(zmq_errno()));
            k3_kv_events_close(ev);
            return K3_ERR_ARG;
        }
    }
    /* the cache starts empty: routers drop what they knew of this instance */
    push(ev, EV_CLEARED);
    if (pthread_create(&ev->th, NULL, publisher, ev)) {
        k3_kv_events_close(ev);
        return k3_err(err, K3_ERR_NOMEM, "kv events: cannot start the publishing thread");
    }
    ev->started = true;
    *out = ev;
    return K3_OK;
}

void k3_kv_events_close(k3_kv_events *ev) {
    if (!ev) return;
    if (ev->started) {
        pthread_mutex_lock(&ev->mu);
        ev->stop = true;
        pthread_cond_broadcast(&ev->cv);
        pthread_mutex_unlock(&ev->mu);
        pthread_join(ev->th, NULL);
    }
    free_events(ev->pending, ev->n_pending);
    free(ev->pending);
    if (ev->pub) zmq_close(ev->pub);
    if (ev->replay) zmq_close(ev->replay);
    if (ev->zctx) zmq_ctx_term(ev->zctx);
    for (int32_t k = 0; ev->ring && k < ev->ring_n; k++)
        free(ev->ring[(ev->ring_head + k) % ev->o.buffer_steps].payload);
    free(ev->ring);
    free(ev->topic);
    pthread_mutex_destroy(&ev->mu);
    pthread_cond_destroy(&ev->cv);
    pthread_cond_destroy(&ev->cv_idle);
    free(ev);
}

void k3_kv_events_flush(k3_kv_events *ev) {
    pthread_mutex_lock(&ev->mu);
    pthread_cond_broadcast(&ev->cv);
    while (ev->started && (ev->n_pending || ev->sending)) pthread_cond_wait(&ev->cv_idle, &ev->mu);
    pthread_mutex_unlock(&ev->mu);
}

void k3_kv_events_get_stats(k3_kv_events *ev, k3_kv_events_stats *out) {
    pthread_mutex_lock(&ev->mu);
    *out = ev->st;
    pthread_mutex_unlock(&ev->mu);
}
