/*
 * test_spec_engine.c -- speculative decoding through the engine: the same
 * tokens (and logprobs, bit for bit) with drafts as without, greedy and
 * seeded, on the trained k3-mini, tiny, tiny-dsa and the official-code
 * checkpoint, over prompts that repeat (drafts accepted) and that do not,
 * several requests batched with others' prompts; with penalties,
 * logit_bias, top-k/p, min_tokens, stop ids, a grammar and max_tokens; on
 * a pool small enough to preempt; the draft-model proposer with the model
 * drafting for itself accepts every greedy draft; the token distribution at
 * a position over many seeds (chi-square against the run without drafts);
 * the blocks all come back.
 *
 * Kernel tables: these run on the default table (k3_set_isa "best"). On a
 * CPU with AMX the default's products of >= 8 rows (>= 4 for MXFP4 experts)
 * round activations to BF16, so a verify chunk's rows differ from a decode
 * step's there; a failure then also says whether --isa avx512 (the exact
 * path) passes.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "k3.h"
#include "model/model.h"
#include "test.h"

enum { MAXQ = 8, MAXGEN = 96, NTOP = 2 };

typedef struct {
    int32_t tok[MAXGEN];
    float lp[MAXGEN];
    k3_logprob top[MAXGEN][NTOP];
    int n;
    k3_finish_reason fin;
    int32_t stop_id;
} result;

typedef struct {
    k3_spec_method method;
    int32_t k;
    const k3_model *draft;
    int64_t cache_tokens; /* 0: plenty */
    int32_t max_num_seqs;
} spec_cfg;

typedef struct {
    int32_t max_tokens, min_tokens, logprobs;
    float temp, top_p, min_p, freq, pres, rep;
    int32_t top_k;
    const k3_logit_bias *bias;
    int32_t n_bias;
    const int32_t *stop_ids;
    int32_t n_stop_ids;
    bool ignore_eos;
    const char *regex; /* a grammar (needs the model's tokenizer) */
    uint64_t seed0;    /* request i's seed is seed0 + i (0: 1000) */
} req_cfg;

static k3_tokenizer *g_tok;
static k3_grammar_vocab *g_gv;

/* Runs prompts through one engine (all submitted at once; a second wave
 * while the first decodes), into res; stats into *st. */
static bool run(const k3_model *m, const spec_cfg *sc, const int32_t *const *ps, const int *lens, int nq,
                const req_cfg *rc, result *res, k3_engine_stats *st) {
    k3_pool *pool = NULL;
    k3_pool_init(&pool, 2, NULL);
    k3_engine_options o = {.max_num_seqs = sc->max_num_seqs ? sc->max_num_seqs : 4,
                           .max_num_batched_tokens = 64,
                           .block_size = 16,
                           .cache_tokens = sc->cache_tokens ? sc->cache_tokens : 4096,
                           .kv_cache = K3_KV_F32,
                           .pool = pool,
                           .speculative = sc->method,
                           .num_speculative_tokens = sc->k,
                           .draft_model = sc->draft,
                           .spec_no_cost_model = true};
    int32_t eos = 3;
    o.eos_ids = &eos;
    o.n_eos_ids = 1;
    k3_engine *e = NULL;
    k3_error err = {0};
    if (k3_engine_open(&e, m, &o, &err)) {
        k3_test_fail(__FILE__, __LINE__, "engine: %s", err.msg);
        k3_pool_free(pool);
        return false;
    }
    k3_grammar *g = NULL;
    if (rc->regex && g_gv) {
        k3_grammar_spec gs = {.kind = K3_GRAMMAR_REGEX, .text = rc->regex};
        if (k3_grammar_compile(&g, g_gv, &gs, &err)) k3_test_fail(__FILE__, __LINE__, "grammar: %s", err.msg);
    }
    memset(res, 0, sizeof(result) * (size_t)nq);
    uint64_t base = 0;
    bool ok = true;
    int submitted = 0, steps = 0;
    while (ok && (submitted < nq || k3_engine_has_work(e)) && steps < 20000) {
        /* the first half at once, the rest after a few steps (prompts among decodes) */
        const int upto = steps == 0 ? (nq + 1) / 2 : steps == 3 ? nq : submitted;
        for (; submitted < upto; submitted++) {
            k3_request_params p = {.prompt = ps[submitted],
                                   .n_prompt = lens[submitted],
                                   .max_tokens = rc->max_tokens,
                                   .min_tokens = rc->min_tokens,
                                   .logprobs = rc->logprobs,
                                   .prompt_logprobs = -1,
                                   .stop_ids = rc->stop_ids,
                                   .n_stop_ids = rc->n_stop_ids,
                                   .ignore_eos = rc->ignore_eos,
                                   .grammar = g};
            p.sampling = (k3_sampler_options){.temperature = rc->temp,
                                              .top_k = rc->top_k,
                                              .top_p = rc->top_p > 0 ? rc->top_p : 1.0f,
                                              .min_p = rc->min_p,
                                              .repeat_penalty = rc->rep > 0 ? rc->rep : 1.0f,
                                              .seed = (rc->seed0 ? rc->seed0 : 1000) + (uint64_t)submitted,
                                              .frequency_penalty = rc->freq,
                                              .presence_penalty = rc->pres,
                                              .logit_bias = rc->bias,
                                              .n_logit_bias = rc->n_bias};
            uint64_t id = 0;
            if (k3_engine_submit(e, &p, &id, &err)) {
                k3_test_fail(__FILE__, __LINE__, "submit: %s", err.msg);
                ok = false;
                break;
            }
            if (submitted == 0) base = id;
        }
        k3_step_result sr;
        if (k3_engine_step(e, &sr, &err)) {
            k3_test_fail(__FILE__, __LINE__, "step: %s", err.msg);
            ok = false;
            break;
        }
        for (int32_t i = 0; i < sr.n_outputs; i++) {
            const k3_req_output *out = &sr.outputs[i];
            if (out->id < base || out->id >= base + (uint64_t)nq) continue;
            result *r = &res[out->id - base];
            for (int32_t t = 0; t < out->n_new && r->n < MAXGEN; t++) {
                r->tok[r->n] = out->tokens[t];
                r->lp[r->n] = out->logprobs ? out->logprobs[t] : 0;
                for (int k = 0; k < NTOP && out->top && k < out->n_top; k++)
                    r->top[r->n][k] = out->top[t * out->n_top + k];
                r->n++;
            }
            if (out->events & K3_EV_FINISHED) {
                r->fin = out->finish;
                r->stop_id = out->stop_id;
            }
        }
        if (!k3_engine_check(e)) {
            k3_test_fail(__FILE__, __LINE__, "block accounting broken after step %d", steps);
            ok = false;
        }
        steps++;
    }
    k3_engine_get_stats(e, st);
    if (ok && k3_engine_blocks_free(e) != st->blocks_total) {
        k3_test_fail(__FILE__, __LINE__, "%lld blocks held after every request ended",
                     (long long)(st->blocks_total - k3_engine_blocks_free(e)));
        ok = false;
    }
    k3_grammar_free(g);
    k3_engine_close(e);
    k3_pool_free(pool);
    return ok;
}

/* Requests whose tokens (and finish) differ; *lp_bad: those whose tokens
 * agree but whose logprobs or alternatives differ in any bit. */
static int differ2(const result *a, const result *b, int nq, int *lp_bad) {
    int bad = 0, lb = 0;
    for (int i = 0; i < nq; i++) {
        const bool t = a[i].n != b[i].n || a[i].fin != b[i].fin || a[i].stop_id != b[i].stop_id ||
            memcmp(a[i].tok, b[i].tok, sizeof(int32_t) * (size_t)a[i].n);
        bad += t;
        lb += !t &&
            (memcmp(a[i].lp, b[i].lp, sizeof(float) * (size_t)a[i].n) ||
             memcmp(a[i].top, b[i].top, sizeof(k3_logprob) * NTOP * (size_t)a[i].n));
    }
    if (lp_bad) *lp_bad = lb;
    return bad;
}

/* Same tokens, logprobs and alternatives, bit for bit. */
static int differ(const result *a, const result *b, int nq) {
    int lb = 0;
    const int bad = differ2(a, b, nq, &lb);
    return bad + lb;
}

/* Prompts: two that repeat themselves (drafts that get accepted), two of
 * random ids, one short, one on the block grid. */
static int prompts(int32_t ids[][160], int *lens, int V) {
    uint64_t r = 77;
    for (int q = 0; q < 6; q++) {
        const int n = q == 4 ? 5 : q == 5 ? 32 : 100 + 13 * q;
        for (int i = 0; i < n; i++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            ids[q][i] = q < 2 && i >= 24 ? ids[q][i % 24] : (int32_t)((r >> 33) % (uint64_t)(V - 16)) + 8;
        }
        lens[q] = n;
    }
    return 6;
}

/* Off against each method on one model and request shape: the same; the
 * repeating prompts must have accepted drafts. */
static void same_with_and_without(const char *dir, const req_cfg *rc, const char *what, bool need_accepts) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(k3_model_open(&m, dir, &err) == K3_OK, "%s", err.msg);
    int32_t ids[6][160];
    int lens[6];
    const int nq = prompts(ids, lens, (int)m->cfg.vocab_size);
    const int32_t *ps[6] = {ids[0], ids[1], ids[2], ids[3], ids[4], ids[5]};
    static result off[MAXQ], on[MAXQ];
    k3_engine_stats st;
    char isa[32];
    snprintf(isa, sizeof isa, "%s", k3_isa_current());
    spec_cfg so = {.method = K3_SPEC_OFF};
    REQUIRE(run(m, &so, ps, lens, nq, rc, off, &st));
    const k3_spec_method ms[2] = {K3_SPEC_SUFFIX, K3_SPEC_NGRAM};
    for (int mi = 0; mi < 2; mi++) {
        spec_cfg sc = {.method = ms[mi], .k = mi ? 3 : 5};
        REQUIRE(run(m, &sc, ps, lens, nq, rc, on, &st));
        int lb = 0;
        const int tb = differ2(off, on, nq, &lb), bad = tb + lb;
        if (bad && !strcmp(isa, "amx")) { /* the threshold of the AMX table, or not? */
            static result x_off[MAXQ], x_on[MAXQ];
            k3_engine_stats xs;
            k3_set_isa("avx512", NULL);
            run(m, &so, ps, lens, nq, rc, x_off, &xs);
            run(m, &sc, ps, lens, nq, rc, x_on, &xs);
            const int xbad = differ(x_off, x_on, nq);
            k3_set_isa("best", NULL);
            CHECKF(!bad,
                   "%s, %s, %s: on the default table (amx) %d of %d requests' tokens differ with drafts, %d more "
                   "only in logprob bits; on --isa avx512 %d differ in any bit",
                   dir, what, ms[mi] == K3_SPEC_SUFFIX ? "suffix" : "ngram", tb, nq, lb, xbad);
        } else {
            CHECKF(!bad, "%s, %s, %s (isa %s): %d of %d requests differ with drafts", dir, what,
                   ms[mi] == K3_SPEC_SUFFIX ? "suffix" : "ngram", isa, bad, nq);
        }
        if (need_accepts)
            CHECKF(st.spec_accepted_tokens > 0 && st.spec_drafts > 0, "%s, %s: %lld drafts, %lld tokens accepted", dir,
                   what, (long long)st.spec_drafts, (long long)st.spec_accepted_tokens);
    }
    k3_model_close(m);
}

static void with_isa(const char *isa) {
    if (isa) k3_set_isa(isa, NULL);
}

K3_TEST(spec_engine_greedy_same_text) {
    char prev[32];
    snprintf(prev, sizeof prev, "%s", k3_isa_current());
    with_isa("best");
    const req_cfg greedy = {.max_tokens = 40, .logprobs = NTOP, .ignore_eos = true};
    same_with_and_without("models/k3-mini", &greedy, "greedy", true);
    same_with_and_without("tests/models/tiny", &greedy, "greedy", false); /* a random model: few repeats */
    same_with_and_without("tests/models/tiny-dsa", &greedy, "greedy", false);
    same_with_and_without("tests/models/official-tiny", &greedy, "greedy", false);
    k3_set_isa(prev, NULL);
}

K3_TEST(spec_engine_sampling_same_tokens_per_seed) {
    char prev[32];
    snprintf(prev, sizeof prev, "%s", k3_isa_current());
    with_isa("best");
    /* every processor a normal step applies, at every position */
    const k3_logit_bias bias[2] = {{9, 2.5f}, {17, -1.0f}};
    const int32_t stops[1] = {4};
    const req_cfg seeded = {.max_tokens = 40,
                            .min_tokens = 6,
                            .logprobs = NTOP,
                            .temp = 0.7f,
                            .top_k = 50,
                            .top_p = 0.9f,
                            .min_p = 0.02f,
                            .freq = 0.2f,
                            .pres = 0.1f,
                            .rep = 1.1f,
                            .bias = bias,
                            .n_bias = 2,
                            .stop_ids = stops,
                            .n_stop_ids = 1};
    same_with_and_without("models/k3-mini", &seeded, "seeded with penalties, bias, top-k/p, min_p, stops", false);
    same_with_and_without("tests/models/tiny-dsa", &seeded, "seeded with penalties, bias, top-k/p, min_p, stops",
                          false);
    k3_set_isa(prev, NULL);
}

/* A grammar: drafts it forbids end the draft; the masks at every position. */
K3_TEST(spec_engine_grammar_same_text) {
    k3_error err = {0};
    if (!g_tok && k3_tokenizer_open(&g_tok, "models/k3-mini", &err)) {
        k3_test_fail(__FILE__, __LINE__, "tokenizer: %s", err.msg);
        return;
    }
    if (!g_gv && k3_grammar_vocab_init(&g_gv, g_tok, &err)) {
        k3_test_fail(__FILE__, __LINE__, "grammar vocabulary: %s", err.msg);
        return;
    }
    char prev[32];
    snprintf(prev, sizeof prev, "%s", k3_isa_current());
    with_isa("best");
    const req_cfg gr = {.max_tokens = 48, .logprobs = NTOP, .regex = "(the( [a-z]+){1,3}, ){2,12}(and|or) the end\\."};
    same_with_and_without("models/k3-mini", &gr, "a regex grammar", false);
    k3_set_isa(prev, NULL);
    k3_grammar_vocab_free(g_gv);
    k3_tokenizer_free(g_tok);
    g_gv = NULL;
    g_tok = NULL;
}

/* A pool that preempts: the same text; drafts give way before anyone is
 * preempted for them. */
K3_TEST(spec_engine_preemption_same_text) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(k3_model_open(&m, "tests/models/tiny", &err) == K3_OK, "%s", err.msg);
    int32_t ids[6][160];
    int lens[6];
    const int nq = prompts(ids, lens, (int)m->cfg.vocab_size);
    const int32_t *ps[6] = {ids[0], ids[1], ids[2], ids[3], ids[4], ids[5]};
    static result off[MAXQ], on[MAXQ];
    k3_engine_stats s0, s1;
    const req_cfg greedy = {.max_tokens = 60, .logprobs = NTOP, .ignore_eos = true};
    spec_cfg so = {.method = K3_SPEC_OFF, .cache_tokens = 320, .max_num_seqs = 6};
    spec_cfg sc = {.method = K3_SPEC_SUFFIX, .k = 6, .cache_tokens = 320, .max_num_seqs = 6};
    char prev[32];
    snprintf(prev, sizeof prev, "%s", k3_isa_current());
    int bad[2] = {0, 0};
    const char *isas[2] = {"best", "avx512"};
    for (int pass = 0; pass < 2; pass++) {
        k3_set_isa(isas[pass], NULL);
        REQUIRE(run(m, &so, ps, lens, nq, &greedy, off, &s0));
        REQUIRE(run(m, &sc, ps, lens, nq, &greedy, on, &s1));
        CHECKF(s0.n_preemptions > 0 && s1.n_preemptions > 0, "preemptions %lld / %lld: the pool is not small enough",
               (long long)s0.n_preemptions, (long long)s1.n_preemptions);
        CHECK(s1.spec_accepted_tokens > 0);
        bad[pass] = differ(off, on, nq);
        if (!bad[0] || strcmp(k3_isa_current(), "amx")) break; /* the second pass only to tell why */
    }
    k3_set_isa("best", NULL);
    CHECKF(!bad[0], "preempted (default table %s): %d of %d requests differ with drafts; on --isa avx512 %d",
           k3_isa_current(), bad[0], nq, bad[1]);
    k3_set_isa(prev, NULL);
    k3_model_close(m);
}

/* tests/models/tiny drafting for itself: every greedy draft is accepted. */
K3_TEST(spec_engine_draft_model_accepts_itself) {
    k3_model *m = NULL, *d = NULL;
    k3_error err = {0};
    REQUIREF(k3_model_open(&m, "tests/models/tiny", &err) == K3_OK, "%s", err.msg);
    REQUIREF(k3_model_open(&d, "tests/models/tiny", &err) == K3_OK, "%s", err.msg);
    int32_t ids[6][160];
    int lens[6];
    const int nq = prompts(ids, lens, (int)m->cfg.vocab_size);
    const int32_t *ps[6] = {ids[0], ids[1], ids[2], ids[3], ids[4], ids[5]};
    static result off[MAXQ], on[MAXQ];
    k3_engine_stats st;
    const req_cfg greedy = {.max_tokens = 40, .logprobs = NTOP, .ignore_eos = true};
    spec_cfg so = {.method = K3_SPEC_OFF};
    spec_cfg sc = {.method = K3_SPEC_DRAFT_MODEL, .k = 4, .draft = d};
    char prev[32], line[2][160] = {"", ""};
    snprintf(prev, sizeof prev, "%s", k3_isa_current());
    bool ok[2] = {false, false};
    const char *isas[2] = {"best", "avx512"};
    for (int pass = 0; pass < 2; pass++) {
        k3_set_isa(isas[pass], NULL);
        REQUIRE(run(m, &so, ps, lens, nq, &greedy, off, &st));
        REQUIRE(run(m, &sc, ps, lens, nq, &greedy, on, &st));
        const int bad = differ(off, on, nq);
        ok[pass] = !bad && st.spec_draft_tokens > 0 && st.spec_accepted_tokens == st.spec_draft_tokens;
        snprintf(line[pass], sizeof line[pass], "isa %s: %d requests differ, %lld of %lld drafts accepted",
                 k3_isa_current(), bad, (long long)st.spec_accepted_tokens, (long long)st.spec_draft_tokens);
        if (ok[0] || strcmp(k3_isa_current(), "amx")) break;
    }
    k3_set_isa(prev, NULL);
    CHECKF(ok[0], "tiny drafting for itself on the default table: %s; %s", line[0], line[1]);
    k3_model_close(d);
    k3_model_close(m);
}

/* The token at output positions 1..3 over 800 draws with drafts and 800
 * without, on other seeds (temperature 1, top-k 40, a frequency penalty; the
 * suffix proposer drafting from a prompt that repeats): the same
 * distribution, by a two-sample chi-square over the 12 most frequent tokens
 * and the rest, under the 0.1% point. (With the same seeds the tokens are
 * the same ones, which spec_engine_sampling_same_tokens_per_seed checks.) */
static void distribution_per_position(const char *what, const spec_cfg *drafting) {
    k3_model *m = NULL;
    k3_error err = {0};
    REQUIREF(k3_model_open(&m, "models/k3-mini", &err) == K3_OK, "%s", err.msg);
    enum { DRAWS = 800, POS = 3, NB = 13 };
    int32_t ids[6][160];
    int lens[6];
    prompts(ids, lens, (int)m->cfg.vocab_size);
    static int32_t at[2][DRAWS][POS];
    k3_engine_stats st;
    int64_t accepted = 0;
    for (int on = 0; on < 2; on++) {
        const spec_cfg off = {.method = K3_SPEC_OFF, .max_num_seqs = drafting->max_num_seqs};
        const spec_cfg sc = on ? *drafting : off;
        for (int s0 = 0; s0 < DRAWS; s0 += MAXQ) {
            /* each batch its own prompt tail; both arms the same tails */
            int32_t tail[MAXQ][64];
            const int32_t *ps[MAXQ];
            int ls[MAXQ];
            for (int q = 0; q < MAXQ; q++) {
                memcpy(tail[q], ids[0], sizeof(int32_t) * 60);
                tail[q][59] = (int32_t)(8 + (s0 / MAXQ) % 64);
                ps[q] = tail[q];
                ls[q] = 60;
            }
            static result res[MAXQ];
            const req_cfg rc = {.max_tokens = POS + 1,
                                .temp = 1.0f,
                                .top_k = 40,
                                .freq = 0.3f,
                                .ignore_eos = true,
                                .seed0 = (on ? 500000u : 1000u) + (uint64_t)s0};
            REQUIRE(run(m, &sc, ps, ls, MAXQ, &rc, res, &st));
            if (on) accepted += st.spec_accepted_tokens;
            for (int q = 0; q < MAXQ; q++)
                for (int p = 0; p < POS; p++) at[on][s0 + q][p] = res[q].n > p + 1 ? res[q].tok[p + 1] : -1;
        }
    }
    CHECKF(accepted > 0, "%s: no draft was accepted: the test shows nothing", what);
    for (int p = 0; p < POS; p++) {
        int32_t tokv[2 * DRAWS];
        static int64_t cnt[2][2 * DRAWS];
        int nt = 0;
        memset(cnt, 0, sizeof cnt);
        for (int on = 0; on < 2; on++)
            for (int s = 0; s < DRAWS; s++) {
                int k = 0;
                while (k < nt && tokv[k] != at[on][s][p]) k++;
                if (k == nt) tokv[nt++] = at[on][s][p];
                cnt[on][k]++;
            }
        /* bins: the NB - 1 largest, the rest together */
        int64_t bin[2][NB] = {{0}};
        static bool used[2 * DRAWS];
        memset(used, 0, sizeof used);
        for (int b = 0; b < NB - 1; b++) {
            int best = -1;
            for (int k = 0; k < nt; k++)
                if (!used[k] && (best < 0 || cnt[0][k] + cnt[1][k] > cnt[0][best] + cnt[1][best])) best = k;
            if (best < 0) break;
            used[best] = true;
            bin[0][b] = cnt[0][best];
            bin[1][b] = cnt[1][best];
        }
        for (int k = 0; k < nt; k++)
            if (!used[k]) {
                bin[0][NB - 1] += cnt[0][k];
                bin[1][NB - 1] += cnt[1][k];
            }
        double x = 0;
        int df = -1;
        for (int b = 0; b < NB; b++) {
            const double tot = (double)(bin[0][b] + bin[1][b]);
            if (tot == 0) continue;
            df++;
            for (int on = 0; on < 2; on++) {
                const double e = tot / 2;
                x += ((double)bin[on][b] - e) * ((double)bin[on][b] - e) / e;
            }
        }
        /* the 0.1% points of chi-square for 1..12 degrees of freedom */
        static const double crit[13] = {0,     10.83, 13.82, 16.27, 18.47, 20.52, 22.46,
                                        24.32, 26.12, 27.88, 29.59, 31.26, 32.91};
        CHECKF(df < 1 || x < crit[df], "%s, position %d: chi-square %.2f over %d degrees of freedom", what, p + 1, x,
               df);
    }
    k3_model_close(m);
}

K3_TEST(spec_engine_distribution_per_position) {
    const spec_cfg sc = {.method = K3_SPEC_SUFFIX, .k = 4, .max_num_seqs = 8};
    distribution_per_position("suffix", &sc);
}

/* The draft model drafts greedily (its argmax), also for a sampled request:
 * a point mass q, for which the rejection rule (accept d with min(1, p/q) =
 * p(d), else draw from max(0, p - q) normalised: p without d) is what
 * drawing from p and comparing with d gives, so the verify needs no q. The
 * same distribution at each position (k3-mini drafting for itself, greedy
 * drafts against temperature-1 draws), and for one seed the same tokens. */
K3_TEST(spec_engine_draft_model_sampled_request) {
    k3_model *d = NULL, *m = NULL;
    k3_error err = {0};
    REQUIREF(k3_model_open(&d, "models/k3-mini", &err) == K3_OK, "%s", err.msg);
    const spec_cfg sc = {.method = K3_SPEC_DRAFT_MODEL, .k = 4, .draft = d, .max_num_seqs = 8};
    distribution_per_position("draft_model", &sc);
    REQUIREF(k3_model_open(&m, "models/k3-mini", &err) == K3_OK, "%s", err.msg);
    int32_t ids[6][160];
    int lens[6];
    const int nq = prompts(ids, lens, (int)m->cfg.vocab_size);
    const int32_t *ps[6] = {ids[0], ids[1], ids[2], ids[3], ids[4], ids[5]};
    static result off[MAXQ], on[MAXQ];
    k3_engine_stats st;
    const req_cfg seeded = {.max_tokens = 32, .logprobs = NTOP, .temp = 0.8f, .top_p = 0.95f, .ignore_eos = true};
    const spec_cfg so = {.method = K3_SPEC_OFF, .max_num_seqs = 8};
    REQUIRE(run(m, &so, ps, lens, nq, &seeded, off, &st));
    REQUIRE(run(m, &sc, ps, lens, nq, &seeded, on, &st));
    const int bad = differ(off, on, nq);
    CHECKF(!bad && st.spec_accepted_tokens > 0,
           "draft_model, seeded at temperature 0.8 (isa %s): %d of %d requests differ, %lld of %lld drafts accepted",
           k3_isa_current(), bad, nq, (long long)st.spec_accepted_tokens, (long long)st.spec_draft_tokens);
    k3_model_close(m);
    k3_model_close(d);
}
