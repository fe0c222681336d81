/*
 * pool.c -- the persistent worker pool behind k3_pool_for (pool.h).
 *
 * One job at a time. The caller writes the job (fn, ctx, n, nth, grain),
 * bumps a generation counter and takes part itself; every worker, whether or
 * not it gets work this time, decrements `pending` once per generation, so
 * the caller knows the job is over when pending reaches 0.
 *
 * Balance: the threads claim chunks of [0, n) in order from an atomic
 * counter, so a thread that starts late (a worker waking up) or runs slow (a
 * shared core) leaves its share to the others instead of holding up the job.
 * Chunks shrink as the work runs out ("guided"): each claim takes
 * 1 / (2 nth) of what is left, at least `grain`, so the first claims are big
 * and the last ones small, and the threads finish within about one grain of
 * each other. (With fixed chunks of n / (4 nth) the caller spent ~2% of a
 * bench-model decode waiting for the last chunk; guided, ~1%.)
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
#include "common/error.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX_THREADS 512
#define PAUSE_NS 2000  /* spin with pause this long, then with sched_yield */
#define SPIN_NS 50000  /* and sleep after this long */

typedef struct pool_worker {
    k3_pool *pool;
    int ith;
} pool_worker;

struct k3_pool {
    int n_threads;              /* workers + the caller */
    pthread_t *threads;         /* [n_threads - 1] */
    pool_worker *workers;       /* [n_threads - 1] */
    pthread_mutex_t mu;
    pthread_cond_t wake;        /* workers sleep here between jobs */
    pthread_cond_t done;        /* the caller sleeps here until pending == 0 */

    /* The job; written by the caller before gen is bumped, read-only while
     * it runs. */
    k3_pool_fn fn;
    void *ctx;
    int64_t n;
    int nth;                    /* threads taking part in this job (<= n_threads) */
    int64_t grain;              /* fewest items per claim */
    _Atomic int64_t next;       /* first unclaimed item */

    _Atomic uint64_t gen;       /* bumped once per job (and once to stop) */
    _Atomic int pending;        /* workers yet to finish this generation */
    _Atomic int sleepers;       /* workers blocked (or about to) on wake */
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

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Spins up to SPIN_NS for cond(arg); false if it still does not hold. */
static bool spin_until(bool (*cond)(k3_pool *, uint64_t), k3_pool *p, uint64_t v) {
    int64_t t0 = 0;
    for (int i = 0;; i++) {
        for (int j = 0; j < 64; j++) {
            if (cond(p, v)) return true;
            cpu_relax();
        }
        int64_t t = now_ns();
        if (i == 0) t0 = t;
        else if (t - t0 > SPIN_NS) return false;
        else if (t - t0 > PAUSE_NS) sched_yield();
    }
}

static bool gen_moved(k3_pool *p, uint64_t seen) {
    return atomic_load_explicit(&p->gen, memory_order_acquire) != seen;
}

static bool job_done(k3_pool *p, uint64_t unused) {
    (void)unused;
    return atomic_load_explicit(&p->pending, memory_order_acquire) == 0;
}

static void run_range(k3_pool *p, int ith) {
    const int64_t n = p->n;
    int64_t lo = atomic_load_explicit(&p->next, memory_order_relaxed);
    while (lo < n) {
        int64_t c = (n - lo) / (2 * p->nth);
        if (c < p->grain) c = p->grain;
        const int64_t hi = n - lo < c ? n : lo + c;
        /* on failure lo is reloaded with the counter's value: try again */
        if (atomic_compare_exchange_weak_explicit(&p->next, &lo, hi, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            p->fn(p->ctx, lo, hi, ith);
            lo = atomic_load_explicit(&p->next, memory_order_relaxed);
        }
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
        return k3_err(err, K3_ERR_ARG, "thread pool: %d threads requested, at most %d",
                      n_threads, POOL_MAX_THREADS);
    k3_pool *p = calloc(1, sizeof *p);
    if (!p) return k3_err(err, K3_ERR_NOMEM, "thread pool: out of memory");
    p->n_threads = n_threads;
    int nw = n_threads - 1;
    if (nw > 0) {
        p->threads = calloc((size_t)nw, sizeof *p->threads);
        p->workers = calloc((size_t)nw, sizeof *p->workers);
        if (!p->threads || !p->workers) {
            free(p->threads);
            free(p->workers);
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
            return k3_err(err, K3_ERR_NOMEM, "thread pool: cannot start thread %d of %d",
                          i + 1, n_threads);
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
    free(p);
}

int k3_pool_size(const k3_pool *p) { return p ? p->n_threads : 1; }

void k3_pool_for(k3_pool *p, int64_t n, int64_t grain, k3_pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    int64_t chunks = n / grain;
    if (!p || tls_in_pool || p->n_threads == 1 || chunks < 2) {
        fn(ctx, 0, n, 0);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->nth = chunks < p->n_threads ? (int)chunks : p->n_threads;
    p->grain = grain;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
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
