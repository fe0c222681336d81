/*
 * test_sched_unit.c -- the scheduler (src/sched) alone, with no model, as
 * vLLM tests its scheduler: fake requests (token arrays the test writes),
 * the real block manager and snapshot store of src/kv, and a fake forward
 * pass that marks the scheduled tokens computed, "samples" a token at a
 * prefill's end and takes the snapshots the pass would capture. Every step
 * checks the invariants (the budget, the block grid, the reference counts);
 * the cases cover the token budget and the cap on running requests,
 * chunking on the block grid, preemption by recompute, prefix hits (with
 * and without KDA snapshots), the step cost guard, and a request that waits
 * for a block another one is computing. The engine over a real model is
 * test_sched.c.
 */
#include <stdlib.h>
#include <string.h>

#include "kv/kv.h"
#include "sched/sched.h"
#include "test.h"

enum { BS = 16, MAX_RQ = 16, VOCAB = 1000 };

typedef struct fake {
    k3_kv_blocks bm;
    k3_kv_snaps sn;
    k3_sched s;
    k3_rq rq[MAX_RQ];
    int32_t n_rq;
    int32_t want_gen[MAX_RQ], n_gen[MAX_RQ];
    bool finished[MAX_RQ];
    int64_t n_snaps_taken;
    int32_t max_blocks;
    bool bad; /* an invariant failed (reported once) */
} fake;

/* A scheduler over n_blocks blocks of BS tokens; snap_each bytes per KDA
 * snapshot (0: a model without KDA layers) under snap_budget bytes. */
static void fake_open(fake *f, k3_sched_config cfg, int32_t n_blocks, int64_t snap_each, int64_t snap_budget) {
    memset(f, 0, sizeof *f);
    k3_error err = {0};
    f->max_blocks = cfg.max_blocks = cfg.max_blocks ? cfg.max_blocks : 64;
    cfg.block_size = BS;
    cfg.hash_seed = k3_kv_hash_seed(7, BS, 0);
    if (!cfg.plp_cap) cfg.plp_cap = 4 * BS;
    if (k3_kv_blocks_init(&f->bm, n_blocks, BS, &err) || k3_kv_snaps_init(&f->sn, snap_each, snap_budget, &err) ||
        k3_sched_init(&f->s, &cfg, &f->bm, &f->sn, &err))
        k3_test_fail(__FILE__, __LINE__, "open: %s", err.msg);
}

static void fake_close(fake *f) {
    for (int32_t i = 0; i < f->n_rq; i++) {
        free(f->rq[i].tok);
        free(f->rq[i].blocks);
        free(f->rq[i].hash);
        free(f->rq[i].extra);
    }
    k3_sched_free(&f->s);
    k3_kv_snaps_free(&f->sn);
    k3_kv_blocks_free(&f->bm);
}

/* Queues a request: n_prompt tokens, prompt[i] = base + i (mod VOCAB), of
 * which the first `shared` are 1 + i (a prefix common to every request
 * that says so); it generates n_gen tokens. */
static k3_rq *fake_add(fake *f, int64_t n_prompt, int64_t shared, int32_t n_gen, int32_t base) {
    if (f->n_rq == MAX_RQ) return NULL;
    const int32_t i = f->n_rq++;
    k3_rq *rq = &f->rq[i];
    memset(rq, 0, sizeof *rq);
    rq->id = (uint64_t)i + 1;
    rq->cap_tok = n_prompt + n_gen + 1;
    rq->tok = malloc(sizeof(int32_t) * (size_t)rq->cap_tok);
    rq->blocks = malloc(sizeof(int32_t) * (size_t)(f->max_blocks + 1));
    rq->hash = malloc(sizeof(uint64_t) * (size_t)(f->max_blocks + 1));
    rq->extra = malloc(sizeof(uint64_t) * (size_t)(f->max_blocks + 1));
    if (!rq->tok || !rq->blocks || !rq->hash || !rq->extra) return NULL;
    for (int64_t t = 0; t < n_prompt; t++) rq->tok[t] = (int32_t)(t < shared ? 1 + t : (base + t) % VOCAB);
    rq->n_tok = rq->n_prompt = n_prompt;
    rq->slot = -1;
    rq->read_cache = true;
    rq->owner = (void *)(intptr_t)i;
    f->want_gen[i] = n_gen;
    k3_sched_hash(&f->s, rq);
    if (k3_sched_add(&f->s, rq, NULL)) return NULL;
    return rq;
}

static int32_t index_of(const fake *f, const k3_rq *rq) { return (int32_t)(rq - f->rq); }

static void invariant(fake *f, bool ok, const char *what, int line) {
    if (ok || f->bad) return;
    f->bad = true;
    k3_test_fail(__FILE__, line, "invariant: %s", what);
}

/* One step: plan, then the fake forward pass and sampling, as the engine
 * does (its snapshot points taken, the tokens computed, a token appended
 * at a prefill's end, finished requests released). Returns the plan's
 * tokens. */
static int32_t fake_step(fake *f) {
    k3_sched *s = &f->s;
    for (int32_t i = 0; i < f->n_rq; i++) f->rq[i].events = 0;
    k3_sched_schedule(s);
    invariant(f, s->plan_tokens <= s->cfg.max_num_batched_tokens, "a plan over the token budget", __LINE__);
    invariant(f, s->n_running <= s->cfg.max_seqs, "more running requests than slots", __LINE__);
    int32_t sum = 0;
    for (int32_t p = 0; p < s->n_plan; p++) {
        k3_rq *rq = s->plan[p];
        const int64_t end = rq->n_computed + rq->n_sched;
        sum += rq->n_sched;
        invariant(f, rq->n_sched > 0 && end <= rq->n_tok, "a chunk outside the request", __LINE__);
        invariant(f, rq->n_blocks * (int64_t)BS >= end, "a chunk without its blocks", __LINE__);
        /* a chunk that does not end the prefill ends on the block grid
         * (unless the cost guard holds it inside one) */
        if (end < rq->n_tok && s->cfg.max_step_cost == 0)
            invariant(f, end % BS == 0, "a partial chunk off the block grid", __LINE__);
        int64_t pos[64];
        uint64_t key[64];
        const int32_t n = k3_sched_snap_points(s, rq, pos, key, 64);
        for (int32_t k = 0; k < n; k++) {
            void *buf = k3_kv_snap_put(&f->sn, key[k], pos[k]);
            if (buf) memset(buf, (int)(pos[k] & 0xff), (size_t)f->sn.bytes_each);
            f->n_snaps_taken += buf != NULL;
        }
    }
    invariant(f, sum == s->plan_tokens, "plan_tokens is not the sum of the chunks", __LINE__);
    for (int32_t p = 0; p < s->n_plan; p++) {
        k3_rq *rq = s->plan[p];
        const int32_t i = index_of(f, rq);
        k3_sched_computed(s, rq);
        if (rq->n_computed < rq->n_tok) continue;
        if (f->n_gen[i] >= f->want_gen[i]) { /* prefill only */
            k3_sched_release(s, rq);
            f->finished[i] = true;
            continue;
        }
        rq->tok[rq->n_tok++] = (int32_t)((rq->id * 131 + (uint64_t)f->n_gen[i]) % VOCAB);
        f->n_gen[i]++;
        k3_sched_hash(s, rq);
        if (f->n_gen[i] >= f->want_gen[i]) {
            k3_sched_release(s, rq);
            f->finished[i] = true;
        }
    }
    int64_t refs = 0;
    for (int32_t b = 0; b < f->bm.n_blocks; b++) refs += f->bm.ref[b];
    invariant(f, k3_kv_check(&f->bm) && refs == k3_sched_blocks_held(s), "block references", __LINE__);
    return s->plan_tokens;
}

static bool all_done(const fake *f) {
    for (int32_t i = 0; i < f->n_rq; i++)
        if (!f->finished[i]) return false;
    return true;
}

/* Steps until every request finished (at most max_steps); returns the steps. */
static int fake_run(fake *f, int max_steps) {
    int n = 0;
    while (!all_done(f) && n < max_steps && !f->bad) {
        fake_step(f);
        n++;
    }
    return n;
}

K3_TEST(sched_unit_token_budget_and_slots) {
    fake f;
    fake_open(&f, (k3_sched_config){.max_seqs = 2, .max_num_batched_tokens = 64}, 64, 0, 0);
    fake_add(&f, 100, 0, 3, 10);
    fake_add(&f, 50, 0, 3, 20);
    fake_add(&f, 10, 0, 3, 30);
    /* step 1: the first prompt takes the budget, cut to the grid (64 of 100) */
    CHECK(fake_step(&f) == 64);
    CHECK(f.s.n_plan == 1 && f.rq[0].n_computed == 64 && f.s.n_running == 1);
    /* step 2: its last 36 (a prefill's end needs no grid), then 28 of the
     * second prompt's 50, cut to the grid: 16 */
    CHECK(fake_step(&f) == 36 + 16);
    CHECK(f.rq[0].n_computed == 100 && f.rq[1].n_computed == 16);
    /* the third waits: two slots */
    CHECK(f.s.n_running == 2 && f.s.n_waiting == 1 && f.rq[2].state == K3_RQ_WAITING);
    /* step 3: a decode first (1 token), then the rest of the second prompt */
    CHECK(fake_step(&f) == 1 + 34);
    CHECK(fake_run(&f, 50) < 50 && all_done(&f));
    for (int i = 0; i < 3; i++) CHECK(f.n_gen[i] == 3);
    CHECK(f.s.n_preemptions == 0 && k3_kv_used(&f.bm) == 0);
    fake_close(&f);
}

K3_TEST(sched_unit_preemption_by_recompute) {
    fake f;
    /* 7 blocks (112 tokens) for two requests that grow to 40 + 40 each */
    fake_open(&f, (k3_sched_config){.max_seqs = 4, .max_num_batched_tokens = 128}, 7, 0, 0);
    fake_add(&f, 40, 0, 40, 10);
    fake_add(&f, 40, 0, 40, 500);
    CHECK(fake_step(&f) == 80); /* both prompts: 3 + 3 blocks */
    int preempted_at = -1;
    for (int step = 0; step < 200 && !all_done(&f) && !f.bad; step++) {
        const int64_t before = f.s.n_preemptions;
        fake_step(&f);
        if (f.s.n_preemptions > before && preempted_at < 0) {
            preempted_at = step;
            /* the newest running request went back to the front of the
             * queue with nothing computed and no blocks */
            const k3_rq *v = &f.rq[1];
            CHECK(v->state == K3_RQ_WAITING && f.s.waiting[0] == v && v->n_computed == 0 && v->n_blocks == 0);
            CHECK(v->events & K3_EV_PREEMPTED);
            CHECK(f.rq[0].state == K3_RQ_RUNNING);
        }
    }
    CHECKF(preempted_at >= 0, "no preemption in a pool of 7 blocks for 10 blocks of tokens");
    CHECK(all_done(&f) && f.n_gen[0] == 40 && f.n_gen[1] == 40);
    /* the victim recomputed its prompt and what it had generated: its
     * tokens are the ones it would have had without the preemption */
    for (int g = 0; g < 40; g++) CHECK(f.rq[1].tok[40 + g] == (int32_t)((2 * 131 + g) % VOCAB));
    CHECK(k3_kv_used(&f.bm) == 0);
    fake_close(&f);
}

K3_TEST(sched_unit_prefix_hits) {
    /* no KDA layers (no snapshots): every matched block is a hit */
    fake f;
    fake_open(&f, (k3_sched_config){.max_seqs = 4, .max_num_batched_tokens = 256, .prefix_cache = true}, 64, 0, 0);
    fake_add(&f, 70, 70, 1, 0);
    fake_run(&f, 10);
    k3_rq *b = fake_add(&f, 90, 50, 1, 300); /* 50 shared tokens: 3 full blocks */
    fake_step(&f);
    CHECK(b->n_cached == 48 && f.s.prefix_hits == 48 && f.s.prefix_queries == 70 + 90);
    k3_rq *c = fake_add(&f, 64, 64, 1, 0); /* the whole prompt cached: one token is left to compute */
    fake_step(&f);
    CHECK(c->n_cached == 48);
    fake_run(&f, 10);
    fake_close(&f);

    /* KDA snapshots every 2 blocks and at the prompt's end: a hit is cut
     * back to the last boundary with a snapshot, and the junction where the
     * new prompt leaves the cached one becomes a snapshot point */
    fake_open(&f,
              (k3_sched_config){.max_seqs = 4,
                                .max_num_batched_tokens = 256,
                                .prefix_cache = true,
                                .snapshot_stride = 2},
              64, 256, 1 << 20);
    fake_add(&f, 100, 100, 1, 0); /* snapshots at 32, 64 and 96 (the last full block) */
    fake_run(&f, 10);
    CHECK(f.n_snaps_taken == 3);
    b = fake_add(&f, 120, 85, 1, 700); /* 5 blocks match (80 tokens), the last snapshot among them is 64 */
    fake_step(&f);
    CHECK(b->n_cached == 64 && b->junction == 80);
    fake_run(&f, 10);
    /* the same prompt again: b left snapshots at its junction (80), its
     * stride point (96) and its end (112), so all of b's blocks are a hit */
    k3_rq *d = fake_add(&f, 120, 85, 1, 700);
    fake_step(&f);
    CHECK(d->n_cached == 112);
    fake_run(&f, 10);
    CHECK(all_done(&f) && k3_kv_used(&f.bm) == 0 && !f.bad);
    fake_close(&f);
}

K3_TEST(sched_unit_step_cost_guard) {
    /* a prompt token at position p costs 1 + p/32: while three requests
     * decode, a step's prompt chunk gets what 12 - 3 leaves */
    fake f;
    k3_sched_config cfg = {.max_seqs = 4, .max_num_batched_tokens = 64, .max_step_cost = 12, .cost_slope = 1.0 / 32};
    fake_open(&f, cfg, 64, 0, 0);
    for (int i = 0; i < 3; i++) fake_add(&f, 8, 0, 40, 100 * i);
    fake_step(&f); /* the three prompts, no decode yet: no guard */
    CHECK(f.s.plan_tokens == 24);
    k3_rq *lng = fake_add(&f, 200, 0, 1, 900);
    int held = 0, inside = 0;
    while (lng->state != K3_RQ_DONE && !f.bad) {
        const int64_t c0 = lng->n_computed;
        const bool decoding = f.s.n_running >= 3 && !f.finished[0];
        fake_step(&f);
        const int64_t chunk = (lng->state == K3_RQ_DONE ? 200 : lng->n_computed) - c0;
        if (decoding && chunk > 0 && c0 + chunk < 200) {
            double cost = 0;
            for (int64_t p = c0; p < c0 + chunk; p++) cost += 1.0 + (double)p / 32;
            CHECKF(cost <= 12 - 3 + 1e-9, "a chunk of %lld tokens costing %.2f beside 3 decodes", (long long)chunk,
                   cost);
            held++;
            inside += (c0 + chunk) % BS != 0;
        }
    }
    CHECKF(held >= 5 && inside > 0, "the guard held %d steps, %d inside a block", held, inside);
    CHECK(f.s.guarded_cost_max <= 12 + 1e-9 && f.s.guarded_cost_max > 3);
    fake_run(&f, 200);
    fake_close(&f);

    /* without decodes only the token budget applies */
    fake_open(&f, cfg, 64, 0, 0);
    fake_add(&f, 200, 0, 1, 0);
    CHECK(fake_step(&f) == 64);
    fake_close(&f);
}

K3_TEST(sched_unit_waits_for_a_block_being_computed) {
    /* b's first 40 tokens are a's whole prompt: while a computes them, b
     * (which the budget would let in) waits, then takes a's two full
     * blocks as a prefix hit instead of computing them twice */
    fake f;
    fake_open(&f, (k3_sched_config){.max_seqs = 4, .max_num_batched_tokens = 64, .prefix_cache = true}, 64, 0, 0);
    k3_rq *a = fake_add(&f, 40, 40, 2, 0);
    k3_rq *b = fake_add(&f, 64, 40, 2, 500);
    CHECK(fake_step(&f) == 40); /* 24 tokens of budget left, and b waits */
    CHECK(a->state == K3_RQ_RUNNING && b->state == K3_RQ_WAITING && b->n_computed == 0);
    fake_step(&f);
    CHECK(b->state == K3_RQ_RUNNING && b->n_cached == 32);
    fake_run(&f, 20);
    CHECK(all_done(&f) && f.s.prefix_hits == 32);
    fake_close(&f);

    /* without the prefix cache nothing waits */
    fake_open(&f, (k3_sched_config){.max_seqs = 4, .max_num_batched_tokens = 64}, 64, 0, 0);
    a = fake_add(&f, 40, 40, 2, 0);
    b = fake_add(&f, 64, 40, 2, 500);
    CHECK(fake_step(&f) == 40 + 16);
    CHECK(a->n_computed == 40 && b->n_computed == 16 && b->n_cached == 0);
    fake_run(&f, 20);
    fake_close(&f);
}

K3_TEST(sched_unit_release_anywhere) {
    fake f;
    fake_open(&f, (k3_sched_config){.max_seqs = 1, .max_num_batched_tokens = 64}, 16, 0, 0);
    k3_rq *a = fake_add(&f, 40, 0, 5, 0);
    k3_rq *b = fake_add(&f, 40, 0, 5, 50);
    fake_step(&f);
    CHECK(a->state == K3_RQ_RUNNING && b->state == K3_RQ_WAITING && k3_kv_used(&f.bm) == 3);
    k3_sched_release(&f.s, b); /* a waiting one: out of the queue */
    f.finished[1] = true;
    CHECK(f.s.n_waiting == 0 && b->state == K3_RQ_DONE);
    k3_sched_release(&f.s, a); /* a running one: its blocks and slot back */
    f.finished[0] = true;
    CHECK(f.s.n_running == 0 && f.s.n_free_slots == 1 && k3_kv_used(&f.bm) == 0);
    CHECK(fake_step(&f) == 0 && f.s.n_plan == 0);
    fake_close(&f);
}

/* A decode with drafts is a verify chunk of 1 + n_draft: cut to the budget
 * and to the free blocks before anyone is preempted; after it, the kept
 * positions are computed, full blocks registered, and the blocks only
 * rejected positions used go back (block-table truncation). */
K3_TEST(sched_unit_verify_chunks) {
    fake f;
    /* 4 blocks of 16: two requests of 20 + 20 */
    fake_open(&f, (k3_sched_config){.max_seqs = 2, .max_num_batched_tokens = 40, .prefix_cache = true}, 4, 0, 0);
    k3_rq *a = fake_add(&f, 20, 0, 30, 10), *b = fake_add(&f, 20, 0, 30, 400);
    REQUIRE(a && b);
    CHECK(fake_step(&f) == 40); /* both prompts, a token each */
    CHECK(a->n_tok == 21 && a->n_computed == 20 && a->n_blocks == 2 && b->n_blocks == 2);
    CHECK(f.bm.n_free == 0);
    /* a drafts 9: positions 20..29 fit its second block (32); b drafts 20:
     * 1 + 20 over the budget left (40 - 10 = 30 fits) but its block 2
     * (positions 32..) has no free block: cut to 1 + 11, nobody preempted */
    for (int i = 0; i < 9; i++) a->tok[a->n_tok + i] = 900 + i;
    for (int i = 0; i < 20; i++) b->tok[b->n_tok + i] = 950 + i;
    a->n_draft = 9;
    b->n_draft = 20;
    k3_sched_schedule(&f.s);
    CHECK(f.s.n_plan == 2 && a->n_sched == 10 && a->n_draft == 9);
    CHECK(b->n_sched == 12 && b->n_draft == 11 && f.s.n_preemptions == 0);
    /* a keeps 4 (its last token and 3 drafts), b keeps 1 */
    k3_sched_verified(&f.s, a, 4);
    k3_sched_verified(&f.s, b, 1);
    CHECK(a->n_computed == 24 && a->n_draft == 0 && a->n_sched == 0 && a->n_blocks == 2);
    CHECK(b->n_computed == 21 && b->n_blocks == 2);
    /* the first block of each is full and registered: a later identical prompt hits it */
    CHECK(a->n_registered == 1 && b->n_registered == 1);
    /* drafts over the budget: cut to what is left */
    a->n_tok = 25;
    for (int i = 0; i < 25; i++) a->tok[a->n_tok + i] = 700 + i; /* cap_tok is 51 */
    a->n_draft = 25;
    b->n_draft = 0;
    b->n_tok = 22;
    k3_sched_schedule(&f.s);
    CHECK(f.s.plan_tokens <= 40 && a->n_sched + b->n_sched == f.s.plan_tokens && a->n_sched - 1 == a->n_draft);
    /* a verify that reached into a new block and kept none of it gives it back */
    const int32_t before = a->n_blocks;
    k3_sched_verified(&f.s, a, 1);
    CHECK(a->n_computed == 25 && a->n_blocks <= before && a->n_blocks == 2);
    k3_sched_computed(&f.s, b);
    int64_t refs = 0;
    for (int32_t k = 0; k < f.bm.n_blocks; k++) refs += f.bm.ref[k];
    CHECK(k3_kv_check(&f.bm) && refs == k3_sched_blocks_held(&f.s));
    fake_close(&f);
}
