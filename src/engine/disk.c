/*
 * disk.c -- the disk tier's KV connector (connector.h) over src/kvstore:
 * the prefix cache beyond RAM and across restarts (docs/kvstore.md).
 *
 * Loads (vLLM: get_num_new_matched_tokens with load_async): a request
 * arrives; when the directory holds its prompt beyond the local prefix hit
 * (blocks and a KDA snapshot at their end), the connector takes it. It
 * waits in arrival order for its blocks (the local hit's shared, fresh ones
 * for the rest) without a running slot, the reader thread fills them and
 * the state, and once the load completes the blocks enter the prefix cache
 * as if computed, the state enters the snapshot store, and the request
 * joins the scheduler's queue from there (k3_sched_add_landed). A load that
 * fails (a torn or damaged file, an I/O error) leaves nothing registered:
 * the request goes to the scheduler and computes its prompt, with a log
 * line. A request waiting for its blocks never holds up the batch.
 *
 * Saves (vLLM: save_kv_layer, wait_for_save), all on the writer thread,
 * never in the token loop: a request's full blocks when the prefix cache
 * registers a whole run of them (k3_kvs_run_blocks), the rest at its end;
 * every KDA snapshot the engine takes for the prefix cache. A save reads
 * the blocks and the snapshot in place: it holds a reference on each block
 * (blocks are immutable once full; other requests keep reading them) and a
 * pin on the snapshot (k3_kv_snap_pin: not evicted or overwritten) until
 * its ticket completes. A save that fails (a full disk) loses nothing but
 * that file.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "engine/engine.h"
#include "engine/internal.h"
#include "kvevents/events.h"
#include "kvstore/kvstore.h"

/* A save in flight: what it reads stays until its ticket completes. */
typedef struct save {
    uint64_t ticket;
    int32_t *blocks; /* referenced (a run save), or NULL */
    int32_t n;
    uint64_t key; /* a snapshot save: the pinned snapshot */
    int64_t pos;
} save;

/* A prompt-end snapshot saved and the junction saved beside it. */
typedef struct snap_pair {
    uint64_t key; /* the prompt-end snapshot's (its last block's hash) */
    int64_t junction;
} snap_pair;

enum { DISK_PAIRS = 4096 };

typedef struct k3_disk_conn {
    k3_kv_connector c;
    k3_engine *e;
    k3_kvs *kvs;
    int32_t bs, R;
    req **wait; /* taken, waiting for blocks, in arrival order */
    int32_t n_wait, cap_wait;
    bool blocked; /* the first did not fit since blocks were last freed */
    req **loads;  /* loading */
    int32_t n_loads, cap_loads;
    req **landed; /* landed, their state kept until admitted */
    int32_t n_landed, cap_landed;
    save *saves;
    int32_t n_saves, cap_saves;
    int64_t save_refs; /* block references the saves hold */
    void *spare_state; /* a landed request's state buffer, for the next load */
    snap_pair pairs
        [DISK_PAIRS]; /* the latest pairs saved, and those of prompt ends hit on disk (their headers name their junction: a restart loses nothing) */
    k3_disk_stats st, pub; /* stepping thread's; published at each step (under mu) */
} k3_disk_conn;

/* A KDA state buffer on a page, whole pages: the store reads into it (and
 * writes from it) with O_DIRECT where the directory allows. */
static void *state_alloc(int64_t bytes) {
    return aligned_alloc(4096, ((size_t)(bytes > 0 ? bytes : 1) + 4095) / 4096 * 4096);
}

static void logf_(k3_disk_conn *d, const char *fmt, ...) K3_PRINTF(2, 3);
static void logf_(k3_disk_conn *d, const char *fmt, ...) {
    if (!d->e->o.log) return;
    char line[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    d->e->o.log(d->e->o.log_arg, line);
}

static k3_kvs_seq seq_of(const req *r, int64_t n_tokens) {
    return (k3_kvs_seq){.tokens = r->rq.tok,
                        .n_tokens = n_tokens,
                        .extra = r->rq.extra,
                        .salt = r->rq.salt,
                        .hashes = r->rq.hash};
}

static bool push(void *arr, int32_t *n, int32_t *cap, void *p) { return k3_engine_push_ptr(arr, n, cap, p); }

static void remove_at(req **a, int32_t *n, int32_t i) {
    memmove(a + i, a + i + 1, sizeof(req *) * (size_t)(*n - i - 1));
    (*n)--;
}

/* ---- callbacks from the store's threads ----------------------------------------------------- */

static void on_done(void *arg) {
    k3_disk_conn *d = arg;
    pthread_mutex_lock(&d->e->mu);
    k3_engine_notify_locked(d->e);
    pthread_mutex_unlock(&d->e->mu);
}

static void on_blocks(void *arg, const k3_kvs_blocks_event *ev) {
    k3_disk_conn *d = arg;
    k3_kv_events *kev = __atomic_load_n(&d->e->kv_events, __ATOMIC_ACQUIRE);
    if (!kev) return;
    if (ev->stored)
        k3_kv_events_blocks(kev, K3_KV_EVENTS_MEDIUM_DISK, true, ev->hashes, ev->n, ev->parent, ev->has_parent,
                            ev->tokens, ev->extra);
    else k3_kv_events_blocks(kev, K3_KV_EVENTS_MEDIUM_DISK, false, ev->hashes, ev->n, 0, false, NULL, NULL);
}

/* ---- loads ------------------------------------------------------------------------------------ */

/* The junction saved with the prompt-end snapshot named by key (0 = none). */
static int64_t pair_get(const k3_disk_conn *d, uint64_t key) {
    const snap_pair *p = &d->pairs[key % DISK_PAIRS];
    return p->key == key ? p->junction : 0;
}

static void pair_put(k3_disk_conn *d, uint64_t key, int64_t junction) {
    d->pairs[key % DISK_PAIRS] = (snap_pair){key, junction};
}

/* The directory's hit for r beyond its local hit n_local (NULL: none beyond it). */
static k3_kvs_hit *look(k3_disk_conn *d, req *r, int64_t n_local) {
    const k3_kvs_seq seq = seq_of(r, r->rq.n_prompt);
    k3_kvs_hit *hit = NULL;
    k3_error err = {0};
    if (k3_kvs_lookup(d->kvs, &seq, n_local, r->rq.n_prompt - 1, &hit, &err)) {
        logf_(d, "kv cache: a lookup failed: %s", err.msg);
        return NULL;
    }
    if (hit && k3_kvs_hit_tokens(hit) <= n_local) {
        k3_kvs_hit_free(hit);
        hit = NULL;
    }
    /* a prompt's end saved with its junction: the pair known again (after a restart too), so
     * this request's junction save replaces that junction */
    const int64_t nb = hit ? k3_kvs_hit_tokens(hit) / d->bs : 0, j = k3_kvs_hit_junction(hit);
    if (j > 0 && nb > 0 && nb <= r->rq.n_hash) pair_put(d, r->rq.hash[nb - 1], j);
    return hit;
}

/* r goes to the scheduler after all (nothing beyond its local hit, or its load failed). */
static void to_scheduler(k3_disk_conn *d, req *r) {
    k3_engine *e = d->e;
    r->disk_phase = DISK_NONE;
    k3_kvs_hit_free(r->disk_hit);
    r->disk_hit = NULL;
    if (k3_sched_add(&e->sched, &r->rq, NULL)) {
        snprintf(r->error, sizeof r->error, "out of memory for the queue");
        k3_engine_finish(e, r, K3_FINISH_ERROR, k3_now());
    }
}

/* A request the directory holds beyond its local hit waits for its blocks. */
static bool disk_arrive_(void *self, req *r) {
    k3_disk_conn *d = self;
    k3_engine *e = d->e;
    if (r->remote || !r->rq.read_cache || e->o.no_prefix_cache) return false;
    d->st.ext_queries += r->rq.n_prompt;
    const int64_t n_local = k3_sched_local_hit(&e->sched, &r->rq);
    k3_kvs_hit *hit = look(d, r, n_local);
    if (!hit) return false;
    if (!push(&d->wait, &d->n_wait, &d->cap_wait, r)) {
        k3_kvs_hit_free(hit);
        return false;
    }
    r->disk_hit = hit;
    r->disk_local = n_local;
    r->disk_hit_tokens = k3_kvs_hit_tokens(hit);
    r->disk_chain_tokens = k3_kvs_hit_chain_tokens(hit);
    r->disk_phase = DISK_WAIT;
    return true;
}

static bool disk_cancel(void *self, req *r, double t) {
    k3_disk_conn *d = self;
    if (r->disk_phase == DISK_WAIT) {
        for (int32_t i = 0; i < d->n_wait; i++)
            if (d->wait[i] == r) {
                remove_at(d->wait, &d->n_wait, i);
                break;
            }
        r->disk_phase = DISK_NONE;
        k3_kvs_hit_free(r->disk_hit);
        r->disk_hit = NULL;
        k3_engine_finish(d->e, r, K3_FINISH_CANCELLED, t);
        return true;
    }
    if (r->disk_phase == DISK_LOAD) { /* it ends when its load has stopped writing into its blocks */
        r->disk_cancel = true;
        k3_kvs_cancel(d->kvs, r->disk_ticket);
        return true;
    }
    return false;
}

/* In arrival order, while blocks last: the local hit again (the prefix
 * cache may have changed since arrival; then the directory is asked again),
 * the blocks, the load. */
static void disk_before_schedule_(void *self, double t) {
    k3_disk_conn *d = self;
    k3_engine *e = d->e;
    k3_sched *s = &e->sched;
    while (d->n_wait > 0) {
        req *r = d->wait[0];
        k3_rq *rq = &r->rq;
        const int64_t n_local = k3_sched_local_hit(s, rq);
        if (n_local != r->disk_local) {
            k3_kvs_hit_free(r->disk_hit);
            r->disk_hit = look(d, r, n_local);
            r->disk_local = n_local;
            r->disk_hit_tokens = r->disk_hit ? k3_kvs_hit_tokens(r->disk_hit) : 0;
            r->disk_chain_tokens = k3_kvs_hit_chain_tokens(r->disk_hit);
            if (!r->disk_hit) {
                remove_at(d->wait, &d->n_wait, 0);
                to_scheduler(d, r);
                continue;
            }
        }
        if (!k3_sched_alloc_beyond(s, rq, (int32_t)(n_local / d->bs), (int32_t)(r->disk_hit_tokens / d->bs))) {
            d->blocked = true;
            return;
        }
        remove_at(d->wait, &d->n_wait, 0);
        k3_error err = {0};
        k3_status st = K3_OK;
        if (!r->disk_state && d->spare_state) { /* memory touched before: no page faults in the load */
            r->disk_state = d->spare_state;
            d->spare_state = NULL;
        }
        if (!r->disk_state && !(r->disk_state = state_alloc(e->state_bytes)))
            st = k3_err(&err, K3_ERR_NOMEM, "out of memory for a KDA state");
        if (!st) {
            st = k3_kvs_load(d->kvs, r->disk_hit, rq->blocks, r->disk_state, &r->disk_ticket, &err);
            r->disk_hit = NULL; /* taken by the load, even when it failed */
        }
        if (!st && !push(&d->loads, &d->n_loads, &d->cap_loads, r)) {
            /* the load runs, but nobody would see it complete: cancel it and wait for it here */
            k3_kvs_cancel(d->kvs, r->disk_ticket);
            k3_kvs_done dn;
            k3_kvs_wait(d->kvs, r->disk_ticket, &dn, NULL);
            st = k3_err(&err, K3_ERR_NOMEM, "out of memory for the load list");
        }
        if (st) {
            logf_(d, "kv cache: request %llu: no load from the disk tier, computing its prompt: %s",
                  (unsigned long long)rq->id, err.msg);
            k3_sched_drop_blocks(s, rq);
            to_scheduler(d, r);
            continue;
        }
        r->disk_phase = DISK_LOAD;
        r->t_disk0 = t;
    }
}

/* A load completed: its blocks enter the prefix cache as if computed and
 * the request joins the queue with its state; or it failed, and the
 * request computes its prompt. */
static void load_done(k3_disk_conn *d, req *r, const k3_kvs_done *dn, double t) {
    k3_engine *e = d->e;
    k3_sched *s = &e->sched;
    k3_rq *rq = &r->rq;
    const int32_t bs = d->bs, lo = (int32_t)(r->disk_local / bs), nb = (int32_t)(r->disk_hit_tokens / bs);
    r->disk_phase = DISK_NONE;
    d->st.load_seconds_total += dn->seconds;
    if (r->disk_cancel || dn->cancelled) {
        d->st.loads_cancelled++;
        k3_sched_drop_blocks(s, rq);
        if (!r->finished) k3_engine_finish(e, r, K3_FINISH_CANCELLED, t);
        return;
    }
    if (dn->status) {
        d->st.loads_failed++;
        logf_(d, "kv cache: request %llu: the load from the disk tier failed (%s); computing its prompt",
              (unsigned long long)rq->id, dn->why);
        k3_sched_drop_blocks(s, rq);
        to_scheduler(d, r);
        return;
    }
    for (int32_t k = lo; k < nb; k++)
        k3_kv_register(&e->bm, rq->blocks[k], rq->hash[k], k ? rq->hash[k - 1] : s->cfg.hash_seed, rq->extra[k],
                       rq->tok + (int64_t)k * bs);
    rq->n_registered = nb;
    rq->n_computed = rq->n_cached = r->disk_hit_tokens;
    rq->landed_junction = r->disk_chain_tokens; /* the blocks on disk beyond the state: a new junction there */
    rq->landed_state = e->state_bytes > 0 ? r->disk_state : NULL;
    const bool listed = push(&d->landed, &d->n_landed, &d->cap_landed, r);
    if (e->state_bytes > 0) {
        /* the state enters the snapshot store without a copy (13.5 MB on bench/bench, 465 MB at
         * full size, into memory nothing touched yet: a copy here stalled the token loop): the
         * store adopts the loaded buffer, pinned until the request is admitted with it (its
         * restore reads it), and gives back its entry's previous buffer for the next load */
        void *buf = r->disk_state;
        if (listed && k3_kv_snap_adopt(&e->sn, rq->hash[nb - 1], r->disk_hit_tokens, &buf)) {
            k3_kv_snap_pin(&e->sn, rq->hash[nb - 1], r->disk_hit_tokens);
            r->disk_state = NULL; /* the store's now; landed_state points into it */
            if (!d->spare_state) d->spare_state = buf;
            else free(buf);
        } else if ((buf = k3_kv_snap_put(&e->sn, rq->hash[nb - 1], r->disk_hit_tokens))) {
            memcpy(buf, r->disk_state, (size_t)e->state_bytes);
        }
    }
    k3_sched_count_hit(s, rq, r->disk_local);
    d->st.ext_hits += r->disk_hit_tokens - r->disk_local;
    r->disk_loaded = r->disk_hit_tokens - r->disk_local;
    d->st.loads_landed++;
    r->disk_saved = nb; /* what it loaded is on disk */
    if (k3_sched_add_landed(s, rq, NULL)) {
        snprintf(r->error, sizeof r->error, "out of memory for the queue");
        k3_engine_finish(e, r, K3_FINISH_ERROR, t); /* it leaves the landed list: its pin goes */
    }
}

/* r leaves the landed list: a state the snapshot store adopted (r->disk_state
 * NULL) is unpinned; when r was not admitted with it, it keeps a copy. */
static void landed_leave(k3_disk_conn *d, req *r) {
    k3_engine *e = d->e;
    if (r->disk_state || e->state_bytes <= 0) return;
    const k3_rq *rq = &r->rq;
    const int32_t nb = (int32_t)(r->disk_hit_tokens / d->bs);
    if (rq->landed_state && !r->finished) { /* still to be restored (no longer waiting with blocks) */
        r->disk_state = state_alloc(e->state_bytes);
        if (r->disk_state) memcpy(r->disk_state, rq->landed_state, (size_t)e->state_bytes);
        r->rq.landed_state = r->disk_state; /* NULL: out of memory, it computes its state */
    }
    k3_kv_snap_unpin(&e->sn, rq->hash[nb - 1], r->disk_hit_tokens);
}

/* ---- saves ------------------------------------------------------------------------------------ */

static void save_release(k3_disk_conn *d, save *sv) {
    k3_engine *e = d->e;
    for (int32_t b = sv->n - 1; sv->blocks && b >= 0; b--) k3_kv_unref(&e->bm, sv->blocks[b]);
    d->save_refs -= sv->blocks ? sv->n : 0;
    if (sv->pos > 0) k3_kv_snap_unpin(&e->sn, sv->key, sv->pos);
    free(sv->blocks);
    d->blocked = false;
}

static bool save_push(k3_disk_conn *d, const save *sv) {
    if (d->n_saves == d->cap_saves) {
        const int32_t cap = d->cap_saves ? 2 * d->cap_saves : 64;
        save *g = realloc(d->saves, sizeof *g * (size_t)cap);
        if (!g) return false;
        d->saves = g;
        d->cap_saves = cap;
    }
    d->saves[d->n_saves++] = *sv;
    return true;
}

/* Blocks [0, n_full) of r to the directory (the whole runs not there yet;
 * with final the partial run at the end too). */
static void save_runs(k3_disk_conn *d, req *r, int32_t n_full, bool final) {
    k3_engine *e = d->e;
    if (n_full <= 0) return;
    const k3_kvs_seq seq = seq_of(r, r->rq.n_tok);
    save sv = {0};
    sv.blocks = malloc(sizeof(int32_t) * (size_t)n_full);
    if (!sv.blocks) return;
    memcpy(sv.blocks, r->rq.blocks, sizeof(int32_t) * (size_t)n_full);
    sv.n = n_full;
    k3_error err = {0};
    /* the final save keeps the run that ends at the junction saved with this prompt's end */
    if (k3_kvs_save_blocks(d->kvs, &seq, sv.blocks, n_full, final, final ? r->disk_junction : 0, &sv.ticket, &err) ||
        !sv.ticket) {
        free(sv.blocks);
        return;
    }
    for (int32_t b = 0; b < n_full; b++) k3_kv_ref(&e->bm, sv.blocks[b]);
    d->save_refs += n_full;
    if (!save_push(d, &sv)) { /* nobody would release them: wait for it here */
        k3_kvs_done dn;
        k3_kvs_wait(d->kvs, sv.ticket, &dn, NULL);
        save_release(d, &sv);
    }
    r->disk_saved = n_full;
}

static void disk_registered_(void *self, req *r, int32_t before) {
    k3_disk_conn *d = self;
    const int32_t runs = r->rq.n_registered / d->R * d->R;
    if (runs > r->disk_saved) save_runs(d, r, runs, false);
}

/* The snapshot policy (docs/kvstore.md): two per conversation on disk, the
 * state at its latest prompt's end and at the junction where that prompt
 * leaves the cached one (the end of the previous turn's output); stride
 * snapshots stay in RAM. A request that restored the state at R (its
 * prefix hit: the previous prompt's end) supersedes the previous pair: its
 * prompt-end save drops R, its junction save the junction saved with R. */
static void disk_snapshot_taken_(void *self, req *r, int64_t pos, uint64_t key) {
    k3_disk_conn *d = self;
    k3_engine *e = d->e;
    const k3_rq *rq = &r->rq;
    /* the prompt's end: the last snapshot point before its last token (a resend of the prompt
     * computes at least that token, so a state at the prompt's full length would never be found
     * by it): the grid's floor, or, for a prompt of whole blocks, the last stride point or the
     * junction before it */
    const int64_t bs = d->bs, R = rq->n_cached, stride = (int64_t)e->sched.cfg.snapshot_stride * bs;
    int64_t end = rq->prefill_end - rq->prefill_end % bs;
    if (end == rq->prefill_end && end > 0) {
        end = (rq->prefill_end - 1) / stride * stride;
        if (rq->junction > end && rq->junction < rq->prefill_end) end = rq->junction;
    }
    const bool prompt_end = end > 0 && pos == end, junction = rq->junction > 0 && pos == rq->junction;
    if (!prompt_end && !junction) {
        d->st.snaps_ram_only++;
        return;
    }
    const uint64_t key_r = R > 0 && R / bs <= rq->n_hash ? rq->hash[R / bs - 1] : 0;
    int64_t drop = 0, with = 0;
    /* restored at R from disk with no block of the chain beyond it (after a restart the previous
     * turn's output blocks are nowhere): the prompt leaves the cached chain at R itself, so R is
     * this prompt's junction; it stays, and the junction saved with R goes (its header named it) */
    const bool junction_at_r = R > 0 && R == r->disk_hit_tokens && rq->junction <= R && R < pos;
    if (prompt_end && junction_at_r) {
        drop = key_r ? pair_get(d, key_r) : 0;
        if (drop >= R) drop = 0;
        with = R;
        pair_put(d, key, with);
        r->disk_junction = with;
    } else if (prompt_end) {
        drop = R > 0 && R < pos && R != rq->junction ? R : 0;
        with = rq->junction > 0 && rq->junction < pos ? rq->junction : 0;
        pair_put(d, key, with);
        r->disk_junction = with;
    } else if (key_r) {
        drop = pair_get(d, key_r);
        if (drop >= pos) drop = 0;
    }
    const void *buf = k3_kv_snap_pin(&e->sn, key, pos);
    if (!buf) return;
    const k3_kvs_seq seq = seq_of(r, pos);
    save sv = {.key = key, .pos = pos};
    k3_error err = {0};
    if (k3_kvs_save_snapshot(d->kvs, &seq, pos, buf, drop, with, &sv.ticket, &err) || !sv.ticket) {
        k3_kv_snap_unpin(&e->sn, key, pos);
        return;
    }
    if (!save_push(d, &sv)) {
        k3_kvs_done dn;
        k3_kvs_wait(d->kvs, sv.ticket, &dn, NULL);
        save_release(d, &sv);
    }
}

/* A request ends: its computed blocks go to the directory, the partial
 * run at the end too. */
static void disk_request_finished_(void *self, req *r, k3_finish_reason why, double t) {
    k3_disk_conn *d = self;
    d->blocked = false;
    for (int32_t i = 0; i < d->n_landed; i++)
        if (d->landed[i] == r) {
            remove_at(d->landed, &d->n_landed, i);
            landed_leave(d, r);
            break;
        }
    if (why == K3_FINISH_ERROR || r->disk_phase != DISK_NONE || r->rq.state == K3_RQ_REMOTE) return;
    /* up to the prompt's last full block: a lookup finds a run only when it ends within the prompt
     * looking (the next turn's prompt, which holds this one's output, saves its own) */
    int32_t n = r->rq.n_registered;
    if (n > r->rq.n_computed / d->bs) n = (int32_t)(r->rq.n_computed / d->bs);
    if (n > r->rq.n_prompt / d->bs) n = (int32_t)(r->rq.n_prompt / d->bs);
    if (n > r->disk_saved) save_runs(d, r, n, true);
}

/* ---- the step's other calls ------------------------------------------------------------------- */

/* The states of landed requests that were admitted go (restored into their slots). */
static void disk_begin_(void *self, double t) {
    k3_disk_conn *d = self;
    for (int32_t i = 0; i < d->n_landed;) {
        req *r = d->landed[i]; /* a finished one left the list then */
        if (r->rq.state == K3_RQ_WAITING && r->rq.n_blocks > 0) {
            i++;
            continue;
        }
        if (!r->rq.landed_state && r->disk_state) { /* admitted (and restored) since: kept for the next load */
            if (!d->spare_state) d->spare_state = r->disk_state;
            else free(r->disk_state);
            r->disk_state = NULL;
        }
        remove_at(d->landed, &d->n_landed, i);
        landed_leave(d, r);
    }
}

/* Loads that completed land; saves that completed give their blocks and snapshots back. */
static void disk_after_step_(void *self, double t) {
    k3_disk_conn *d = self;
    k3_kvs_done dn[32];
    int32_t n;
    while ((n = k3_kvs_poll(d->kvs, dn, 32)) > 0)
        for (int32_t k = 0; k < n; k++) {
            bool found = false;
            for (int32_t i = 0; i < d->n_loads && !found; i++)
                if (d->loads[i]->disk_ticket == dn[k].ticket) {
                    req *r = d->loads[i];
                    remove_at(d->loads, &d->n_loads, i);
                    load_done(d, r, &dn[k], t);
                    found = true;
                }
            for (int32_t i = 0; i < d->n_saves && !found; i++)
                if (d->saves[i].ticket == dn[k].ticket) {
                    save sv = d->saves[i];
                    d->saves[i] = d->saves[--d->n_saves];
                    save_release(d, &sv);
                    found = true;
                }
        }
}

/* Under mu. */
static bool disk_has_work(void *self, double t) {
    k3_disk_conn *d = self;
    return d->n_wait > 0 && !d->blocked;
}

static int64_t disk_blocks_held(void *self) {
    k3_disk_conn *d = self;
    int64_t held = d->save_refs;
    for (int32_t i = 0; i < d->n_loads; i++) held += d->loads[i]->rq.n_blocks;
    return held;
}

/* Under mu: the counters as they stand at the step's end. */
static void disk_stats(void *self, k3_engine_stats *st) {
    k3_disk_conn *d = self;
    d->st.waiting = d->n_wait;
    d->st.loading = d->n_loads;
    d->st.saving = d->n_saves;
    d->st.save_blocks = d->save_refs;
    d->pub = d->st;
}

static void disk_output(void *self, const req *r, k3_req_output *o) {
    (void)self;
    o->n_disk = r->disk_loaded;
}

static void disk_close(void *self) {
    k3_disk_conn *d = self;
    k3_kvs_close(d->kvs); /* finishes the queued saves: the blocks and snapshots are still there */
    for (int32_t i = 0; i < d->n_saves; i++) free(d->saves[i].blocks);
    free(d->saves);
    free(d->spare_state);
    free(d->wait);
    free(d->loads);
    free(d->landed);
    free(d);
}

/* ---- the step's calls, timed ---------------------------------------------------------------- */

/* Each call the step makes here is timed; one over a millisecond says so in the log (these calls
 * sit in the token loop: docs/kvstore.md, "Decode ITL while a disk load and a save run"). */
static void timed(k3_disk_conn *d, const char *what, double t0) {
    const double dt = k3_now() - t0;
    if (dt > 1e-3) logf_(d, "kv cache: the step's %s took %.1f ms", what, dt * 1e3);
}

static void disk_begin(void *self, double t) {
    const double t0 = k3_now();
    disk_begin_(self, t);
    timed(self, "begin", t0);
}

static bool disk_arrive(void *self, req *r) {
    const double t0 = k3_now();
    const bool taken = disk_arrive_(self, r);
    timed(self, "arrive (lookup)", t0);
    return taken;
}

static void disk_before_schedule(void *self, double t) {
    const double t0 = k3_now();
    disk_before_schedule_(self, t);
    timed(self, "before_schedule (loads queued)", t0);
}

static void disk_snapshot_taken(void *self, req *r, int64_t pos, uint64_t key) {
    const double t0 = k3_now();
    disk_snapshot_taken_(self, r, pos, key);
    timed(self, "snapshot_taken (snapshot save queued)", t0);
}

static void disk_registered(void *self, req *r, int32_t before) {
    const double t0 = k3_now();
    disk_registered_(self, r, before);
    timed(self, "registered (run save queued)", t0);
}

static void disk_after_step(void *self, double t) {
    const double t0 = k3_now();
    disk_after_step_(self, t);
    timed(self, "after_step (loads landed, saves released)", t0);
}

static void disk_request_finished(void *self, req *r, k3_finish_reason why, double t) {
    const double t0 = k3_now();
    disk_request_finished_(self, r, why, t);
    timed(self, "request_finished (final save queued)", t0);
}

bool k3_engine_disk_stats(k3_engine *e, k3_disk_stats *out, k3_kvs_metrics *m) {
    memset(out, 0, sizeof *out);
    if (m) memset(m, 0, sizeof *m);
    if (!e->disk) return false;
    pthread_mutex_lock(&e->mu);
    *out = e->disk->pub;
    pthread_mutex_unlock(&e->mu);
    out->on = true;
    if (m) k3_kvs_get_metrics(e->disk->kvs, m);
    return true;
}

k3_status k3_disk_conn_open(k3_engine *e, k3_kv_connector **out, k3_error *err) {
    if (e->o.dist && k3_dist_dcp_size(e->o.dist) > 1)
        return k3_err(err, K3_ERR_UNSUPPORTED,
                      "engine: the disk tier (--kv-cache-dir) does not run under --dcp yet: each rank holds a share "
                      "of every block");
    k3_disk_conn *d = calloc(1, sizeof *d);
    if (!d) return k3_err(err, K3_ERR_NOMEM, "engine: out of memory");
    d->e = e;
    const k3_kvs_options ko = {.dir = e->o.kv_cache_dir,
                               .disk_bytes =
                                   e->o.kv_cache_disk_bytes > 0 ? e->o.kv_cache_disk_bytes : (int64_t)64 << 30,
                               .ctx = e->ctx,
                               .model_id = k3_model_identity(e->m),
                               .quant = e->o.quant_name ? e->o.quant_name : "none",
                               .fsync = e->o.kv_cache_fsync,
                               .buffered = e->o.kv_cache_buffered,
                               .buffered_writes = e->o.kv_cache_buffered_writes,
                               .log = e->o.log,
                               .log_arg = e->o.log_arg,
                               .on_done = on_done,
                               .on_blocks = on_blocks,
                               .cb_arg = d};
    k3_status st = k3_kvs_open(&d->kvs, &ko, err);
    if (st) {
        free(d);
        return st;
    }
    d->bs = k3_kvs_block_size(d->kvs);
    d->R = k3_kvs_run_blocks(d->kvs);
    d->st.budget = ko.disk_bytes;
    d->st.run_blocks = d->R;
    d->c = (k3_kv_connector){.name = "disk",
                             .self = d,
                             .begin = disk_begin,
                             .arrive = disk_arrive,
                             .cancel = disk_cancel,
                             .before_schedule = disk_before_schedule,
                             .snapshot_taken = disk_snapshot_taken,
                             .registered = disk_registered,
                             .after_step = disk_after_step,
                             .request_finished = disk_request_finished,
                             .has_work = disk_has_work,
                             .blocks_held = disk_blocks_held,
                             .stats = disk_stats,
                             .output = disk_output,
                             .close = disk_close};
    e->disk = d;
    *out = &d->c;
    return K3_OK;
}
