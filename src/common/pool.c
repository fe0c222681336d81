/*
 * pool.c -- the persistent worker pool behind k3_pool_for (pool.h).
 *
 * One job at a time. The caller writes the job (fn, ctx, n, nth, grain),
 * bumps a generation counter and takes part itself; every worker, whether or
 * not it gets work this time, decrements `pending` once per generation, so
 * the caller knows the job is over when pending reaches 0.
 *
 * Balance: [0, n) is cut into one contiguous share per thread (on grain
 * boundaries). A thread claims its own share from the front, in chunks of an
 * eighth of what is left (at least `grain`), so its claims are adjacent and
 * its weight rows one stream in address order, which is what the hardware
 * prefetchers follow; once its share is empty it steals the back half of
 * the largest share left, so a thread that starts late (a worker waking up)
 * or runs slow (a shared core) leaves its work to the others instead of
 * holding up the job. Each share is one 64-bit word (front | back << 32)
 * changed by compare-and-swap, by its owner at the front and by thieves at
 * the back. (Before, all threads claimed "guided" chunks from one counter:
 * as balanced, but every claim started a new stream, and a core ramping up
 * its prefetch ~16 times per matrix lost 3-4% of a bench-model decode when
 * each core streams its own ~30 GB/s, 1% when they share the bus.)
 *
 * Waiting is spin-then-sleep on both sides: k3_pool_for is called 10-30 times
 * per layer per token, and a condvar round trip (~5-20 us) per call would cost
 * more than many of the jobs. Spinning is bounded (SPIN_NS) so idle workers do
 * not burn a core between tokens, and after PAUSE_NS it yields the CPU each
 * round: when the machine is oversubscribed the thread being waited for may
 * need this very core (measured on 2 busy cores: round trip 150 us without
 * the yield, 15 us with it; ~1 us or less when a core is free). The sleep paths use the Dekker pattern on
 * seq_cst atomics: the waiter announces itself (sleepers / caller_sleeping)
 * and then re-checks the condition under the mutex; the waker changes the
 * condition and then looks for an announced sleeper, signalling under the
 * mutex. One of the two always sees the other, so no wake-up is lost.
 *
 * Nesting: a thread-local flag marks "inside a pool job" (workers always; the
 * caller while it runs range 0). k3_pool_for from such a thread runs inline.
 */
#include "common/pool.h"
#include "common/clock.h"
#include "common/error.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX_THREADS 512
#define PAUSE_NS 2000 /* spin with pause this long, then with sched_yield */
#define SPIN_NS 50000 /* and sleep after this long */

typedef struct pool_worker {
    k3_pool *pool;
    int ith;
} pool_worker;

struct k3_pool {
    int n_threads;        /* workers + the caller */
    pthread_t *threads;   /* [n_threads - 1] */
    pool_worker *workers; /* [n_threads - 1] */
    pthread_mutex_t mu;
    pthread_cond_t wake; /* workers sleep here between jobs */
    pthread_cond_t done; /* the caller sleeps here until pending == 0 */

    /* The job; written by the caller before gen is bumped, read-only while
     * it runs. */
    k3_pool_fn fn;
    void *ctx;
    int nth;                              /* threads taking part in this job (<= n_threads) */
    int64_t grain;                        /* fewest items per claim */
    struct pool_share {                   /* [n_threads]: thread i's unclaimed items */
        _Alignas(64) _Atomic uint64_t fb; /* front | back << 32 */
    } * share;

    _Atomic uint64_t gen; /* bumped once per job (and once to stop) */
    _Atomic int pending;  /* workers yet to finish this generation */
    _Atomic int sleepers; /* workers blocked (or about to) on wake */
    _Atomic int caller_sleeping;
    _Atomic int stop;
};

static _Thread_local int tls_in_pool;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Spins up to SPIN_NS for cond(arg); false if it still does not hold. */
static bool spin_until(bool (*cond)(k3_pool *, uint64_t), k3_pool *p, uint64_t v) {
    int64_t t0 = 0;
    for (int i = 0;; i++) {
        for (int j = 0; j < 64; j++) {
            if (cond(p, v)) return true;
            cpu_relax();
        }
        int64_t t = k3_now_ns();
        if (i == 0) t0 = t;
        else if (t - t0 > SPIN_NS) return false;
        else if (t - t0 > PAUSE_NS) sched_yield();
    }
}

static bool gen_moved(k3_pool *p, uint64_t seen) { return atomic_load_explicit(&p->gen, memory_order_acquire) != seen; }

static bool job_done(k3_pool *p, uint64_t unused) {
    (void)unused;
    return atomic_load_explicit(&p->pending, memory_order_acquire) == 0;
}

static inline uint64_t fb_pack(int64_t f, int64_t b) { return (uint64_t)f | (uint64_t)b << 32; }
static inline int64_t fb_front(uint64_t v) { return (int64_t)(v & 0xffffffffu); }
static inline int64_t fb_back(uint64_t v) { return (int64_t)(v >> 32); }

static void run_range(k3_pool *p, int ith) {
    const int64_t g = p->grain;
    _Atomic uint64_t *own = &p->share[ith].fb;
    for (;;) { /* own share, from the front */
        uint64_t v = atomic_load_explicit(own, memory_order_relaxed);
        const int64_t f = fb_front(v), b = fb_back(v);
        if (f >= b) break;
        int64_t c = ((b - f) / 8 + g - 1) / g * g;
        if (c < g) c = g;
        const int64_t e = b - f > c ? f + c : b;
        /* on failure (a thief moved the back) v is reloaded: try again */
        if (atomic_compare_exchange_weak_explicit(own, &v, fb_pack(e, b), memory_order_relaxed, memory_order_relaxed))
            p->fn(p->ctx, f, e, ith);
    }
    for (;;) { /* the back half of the largest share left */
        int k = -1;
        int64_t most = 0;
        for (int i = 0; i < p->nth; i++) {
            const uint64_t v = atomic_load_explicit(&p->share[i].fb, memory_order_relaxed);
            if (fb_back(v) - fb_front(v) > most) most = fb_back(v) - fb_front(v), k = i;
        }
        if (k < 0) return;
        _Atomic uint64_t *s = &p->share[k].fb;
        uint64_t v = atomic_load_explicit(s, memory_order_relaxed);
        const int64_t f = fb_front(v), b = fb_back(v);
        const int64_t m = f + (b - f) / 2 / g * g; /* all of it when less than 2 grains are left */
        if (f < b &&
            atomic_compare_exchange_weak_explicit(s, &v, fb_pack(f, m), memory_order_relaxed, memory_order_relaxed))
            p->fn(p->ctx, m, b, ith);
    }
}

static void *worker_main(void *arg) {
    pool_worker *w = arg;
    k3_pool *p = w->pool;
    tls_in_pool = 1;
    uint64_t seen = 0;
    for (;;) {
        if (!spin_until(gen_moved, p, seen)) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (atomic_load(&p->gen) == seen) pthread_cond_wait(&p->wake, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        seen = atomic_load(&p->gen);
        if (atomic_load(&p->stop)) break;
        if (w->ith < p->nth) run_range(p, w->ith);
        if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_sleeping)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

/* Bumps gen and wakes sleeping workers. */
static void publish(k3_pool *p) {
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
}

static void stop_workers(k3_pool *p, int n_started) {
    atomic_store(&p->stop, 1);
    publish(p);
    for (int i = 0; i < n_started; i++) pthread_join(p->threads[i], NULL);
}

/* n_threads <= 0 means one thread per online CPU. */
k3_status k3_pool_init(k3_pool **out, int n_threads, k3_error *err) {
    *out = NULL;
    if (n_threads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = c > 0 ? (int)(c < POOL_MAX_THREADS ? c : POOL_MAX_THREADS) : 1;
    }
    if (n_threads > POOL_MAX_THREADS)
        return k3_err(err, K3_ERR_ARG, "thread pool: %d threads requested, at most %d", n_threads, POOL_MAX_THREADS);
    k3_pool *p = calloc(1, sizeof *p);
    if (!p) return k3_err(err, K3_ERR_NOMEM, "thread pool: out of memory");
    p->n_threads = n_threads;
    p->share = aligned_alloc(64, sizeof *p->share * (size_t)n_threads);
    if (!p->share) {
        free(p);
        return k3_err(err, K3_ERR_NOMEM, "thread pool: out of memory");
    }
    int nw = n_threads - 1;
    if (nw > 0) {
        p->threads = calloc((size_t)nw, sizeof *p->threads);
        p->workers = calloc((size_t)nw, sizeof *p->workers);
        if (!p->threads || !p->workers) {
            free(p->threads);
            free(p->workers);
            free(p->share);
            free(p);
            return k3_err(err, K3_ERR_NOMEM, "thread pool: out of memory");
        }
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    for (int i = 0; i < nw; i++) {
        p->workers[i] = (pool_worker){p, i + 1};
        if (pthread_create(&p->threads[i], NULL, worker_main, &p->workers[i]) != 0) {
            stop_workers(p, i);
            p->n_threads = 1;
            k3_pool_free(p);
            return k3_err(err, K3_ERR_NOMEM, "thread pool: cannot start thread %d of %d", i + 1, n_threads);
        }
    }
    *out = p;
    return K3_OK;
}

void k3_pool_free(k3_pool *p) {
    if (!p) return;
    if (p->n_threads > 1) stop_workers(p, p->n_threads - 1);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    free(p->threads);
    free(p->workers);
    free(p->share);
    free(p);
}

int k3_pool_size(const k3_pool *p) { return p ? p->n_threads : 1; }

/* A range too long for a share's 32-bit fields, run as pieces */
typedef struct pool_piece {
    k3_pool_fn fn;
    void *ctx;
    int64_t off;
} pool_piece;

static void piece_fn(void *ctx, int64_t lo, int64_t hi, int ith) {
    const pool_piece *q = ctx;
    q->fn(q->ctx, q->off + lo, q->off + hi, ith);
}

void k3_pool_for(k3_pool *p, int64_t n, int64_t grain, k3_pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    int64_t chunks = n / grain;
    if (!p || tls_in_pool || p->n_threads == 1 || chunks < 2) {
        fn(ctx, 0, n, 0);
        return;
    }
    int64_t piece = (INT64_C(1) << 31) / grain * grain;
    if (piece < grain) piece = grain; /* then each piece runs inline */
    if (n > piece) {
        for (int64_t o = 0; o < n; o += piece) {
            pool_piece q = {fn, ctx, o};
            k3_pool_for(p, n - o < piece ? n - o : piece, grain, piece_fn, &q);
        }
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->nth = chunks < p->n_threads ? (int)chunks : p->n_threads;
    p->grain = grain;
    for (int i = 0; i < p->nth; i++) {
        const int64_t f = chunks * i / p->nth * grain;
        const int64_t b = i == p->nth - 1 ? n : chunks * (i + 1) / p->nth * grain;
        atomic_store_explicit(&p->share[i].fb, fb_pack(f, b), memory_order_relaxed);
    }
    atomic_store(&p->pending, p->n_threads - 1);
    publish(p);

    tls_in_pool = 1;
    run_range(p, 0);
    tls_in_pool = 0;

    if (!spin_until(job_done, p, 0)) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->caller_sleeping, 1);
        while (atomic_load(&p->pending) != 0) pthread_cond_wait(&p->done, &p->mu);
        atomic_store(&p->caller_sleeping, 0);
        pthread_mutex_unlock(&p->mu);
    }
}
