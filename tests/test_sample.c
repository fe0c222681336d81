/* test_sample.c -- the sampler: greedy, seeds, top-k/top-p/min-p filters,
 * the distribution it draws from, and the repetition penalty. */
#include <string.h>

#include "k3.h"
#include "test.h"

static k3_sampler *mk(float temp, int top_k, float top_p, float min_p, float rep, uint64_t seed, int V) {
    k3_sampler *s = NULL;
    k3_sampler_options o = {temp, top_k, top_p, min_p, rep, 0, seed};
    k3_error err = {0};
    if (k3_sampler_init(&s, &o, V, &err)) k3_test_fail(__FILE__, __LINE__, "%s", err.msg);
    return s;
}

K3_TEST(sample_greedy_and_ties) {
    k3_sampler *s = mk(0, 0, 1, 0, 1, 1, 5);
    REQUIRE(s);
    float l[5] = {0.1f, 2.0f, -1.0f, 2.0f, 1.0f};
    CHECK(k3_sampler_sample(s, l) == 1);
    k3_sampler_free(s);
}

K3_TEST(sample_distribution_and_seed) {
    const float lg[4] = {logf(0.1f), logf(0.2f), logf(0.3f), logf(0.4f)};
    k3_sampler *s = mk(1.0f, 0, 1.0f, 0.0f, 1.0f, 123, 4), *s2 = mk(1.0f, 0, 1.0f, 0.0f, 1.0f, 123, 4);
    REQUIRE(s && s2);
    int count[4] = {0}, same = 1;
    for (int i = 0; i < 20000; i++) {
        float l[4], l2[4];
        memcpy(l, lg, sizeof l);
        memcpy(l2, lg, sizeof l2);
        const int a = k3_sampler_sample(s, l), b = k3_sampler_sample(s2, l2);
        same &= a == b;
        count[a]++;
    }
    CHECK(same);
    for (int i = 0; i < 4; i++)
        CHECKF(fabs(count[i] / 20000.0 - 0.1 * (i + 1)) < 0.015, "p[%d] = %.3f", i, count[i] / 20000.0);
    k3_sampler_free(s);
    k3_sampler_free(s2);
}

K3_TEST(sample_filters) {
    const float lg[4] = {logf(0.1f), logf(0.2f), logf(0.3f), logf(0.4f)};
    /* top-k 2: only ids 2 and 3; top-p 0.6: ids 3, 2 (0.4 + 0.3 >= 0.6);
     * min-p 0.6: p >= 0.24 -> ids 2, 3 */
    struct {
        int k;
        float p, minp;
    } cases[3] = {{2, 1.0f, 0}, {0, 0.6f, 0}, {0, 1.0f, 0.6f}};
    for (int c = 0; c < 3; c++) {
        k3_sampler *s = mk(1.0f, cases[c].k, cases[c].p, cases[c].minp, 1.0f, 7, 4);
        REQUIRE(s);
        for (int i = 0; i < 500; i++) {
            float l[4];
            memcpy(l, lg, sizeof l);
            const int id = k3_sampler_sample(s, l);
            CHECKF(id == 2 || id == 3, "case %d drew %d", c, id);
        }
        k3_sampler_free(s);
    }
}

K3_TEST(sample_repetition_penalty) {
    k3_sampler *s = mk(0, 0, 1, 0, 2.0f, 1, 3);
    REQUIRE(s);
    float l[3] = {1.0f, 1.5f, -1.0f};
    k3_sampler_accept(s, 1);
    k3_sampler_accept(s, 1);
    CHECK(k3_sampler_sample(s, l) == 0); /* 1.5 / 2 < 1.0, penalised once */
    CHECK(l[1] == 0.75f);
    k3_sampler_free(s);
}

K3_TEST(sample_bad_options) {
    k3_sampler *s = NULL;
    k3_error err = {0};
    k3_sampler_options o = {-1, 0, 1, 0, 1, 0, 0};
    CHECK(k3_sampler_init(&s, &o, 10, &err) == K3_ERR_ARG);
    CHECK(s == NULL);
}

K3_TEST(sample_top_k_keeps_exactly_the_best) {
    /* top-k keeps the k highest logits, ties to the lower id, over a large
     * vocabulary (the heap path): draws at a high temperature hit all of
     * them and nothing else */
    enum { V = 5000, K = 5 };
    static float lg[V], l[V];
    for (int i = 0; i < V; i++) lg[i] = (float)((i * 7919) % 997) / 100.0f;
    /* the best value 9.96 occurs at ids i with (i*7919)%997 == 996: collect the 5 lowest */
    int want[K], nw = 0;
    for (int v = 996; v >= 0 && nw < K; v--)
        for (int i = 0; i < V && nw < K; i++)
            if ((i * 7919) % 997 == v) want[nw++] = i;
    k3_sampler *s = mk(100.0f, K, 1.0f, 0.0f, 1.0f, 3, V);
    REQUIRE(s);
    int hit[K] = {0};
    for (int r = 0; r < 2000; r++) {
        memcpy(l, lg, sizeof l);
        const int id = k3_sampler_sample(s, l);
        int found = -1;
        for (int q = 0; q < K; q++)
            if (want[q] == id) found = q;
        CHECKF(found >= 0, "drew id %d outside the top %d", id, K);
        if (found >= 0) hit[found]++;
    }
    for (int q = 0; q < K; q++) CHECK(hit[q] > 0);
    k3_sampler_free(s);
}

/* Non-finite logits give -1 (no distribution), greedy and sampled alike;
 * -Inf is a mask and stays allowed. NaN options are refused at init. */
K3_TEST(sample_refuses_nan_logits) {
    k3_sampler *g = mk(0, 0, 1, 0, 1, 1, 4), *t = mk(0.8f, 40, 0.95f, 0.05f, 1.1f, 7, 4);
    REQUIRE(g && t);
    float l[4] = {NAN, NAN, NAN, NAN};
    CHECK(k3_sampler_sample(g, l) == -1);
    float l2[4] = {0.5f, NAN, 1.0f, 0.0f};
    CHECK(k3_sampler_sample(t, l2) == -1);
    float l3[4] = {0.5f, INFINITY, 1.0f, 0.0f};
    CHECK(k3_sampler_sample(t, l3) == -1);
    float l4[4] = {-INFINITY, 2.0f, -INFINITY, 1.0f};
    CHECK(k3_sampler_sample(g, l4) == 1);
    k3_sampler_free(g);
    k3_sampler_free(t);
    const float bad[][4] = {{NAN, 1, 0, 1}, {1, NAN, 0, 1}, {1, 1, NAN, 1}, {1, 1, 0, NAN}, {INFINITY, 1, 0, 1}};
    for (int i = 0; i < 5; i++) {
        k3_sampler *s = NULL;
        k3_sampler_options o = {bad[i][0], 0, bad[i][1], bad[i][2], bad[i][3], 0, 1};
        k3_error err = {0};
        CHECKF(k3_sampler_init(&s, &o, 4, &err) == K3_ERR_ARG && !s, "options %d accepted", i);
    }
}

/* ---- the logit processors against a reference computed here ----------------
 * The reference keeps its own history (prompt and output) and output
 * counts and applies each knob as OpenAI / vLLM define it: ids outside
 * allowed_ids and bad words to -inf, logit_bias added, the repetition
 * penalty on each distinct id of prompt + output, then
 * logit -= count * frequency + (count > 0) * presence over the output. */

typedef struct ref {
    int V;
    float freq, pres, rep;
    const k3_logit_bias *bias;
    int n_bias;
    const uint8_t *allowed;     /* [V] or NULL */
    const int32_t *bw, *bw_off; /* bad words */
    int n_bw;
    int32_t hist[512]; /* prompt + output (the repetition window: all) */
    int n_hist;
    int32_t out[512];
    int n_out;
} ref;

static void ref_process(const ref *r, float *l) {
    for (int i = 0; i < r->V; i++)
        if (r->allowed && !r->allowed[i]) l[i] = -INFINITY;
    for (int w = 0; w < r->n_bw; w++) {
        const int len = r->bw_off[w + 1] - r->bw_off[w];
        const int32_t *ids = r->bw + r->bw_off[w];
        if (len - 1 > r->n_out) continue;
        int match = 1;
        for (int k = 0; k < len - 1; k++) match &= r->out[r->n_out - (len - 1) + k] == ids[k];
        if (match) l[ids[len - 1]] = -INFINITY;
    }
    for (int i = 0; i < r->n_bias; i++) l[r->bias[i].id] += r->bias[i].bias;
    for (int id = 0; id < r->V; id++) {
        int seen = 0, count = 0;
        for (int k = 0; k < r->n_hist; k++) seen |= r->hist[k] == id;
        for (int k = 0; k < r->n_out; k++) count += r->out[k] == id;
        if (seen && r->rep != 1.0f) l[id] = l[id] > 0 ? l[id] / r->rep : l[id] * r->rep;
        if (count) l[id] -= (float)count * r->freq + r->pres;
    }
}

static uint64_t lcg(uint64_t *x) {
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    return *x >> 33;
}

/* Every knob at once, greedy and sampled: the logits after the call are
 * the reference's, the id is the reference's argmax (greedy) or an id the
 * reference did not mask (sampled), for 60 steps of a random walk. */
K3_TEST(sample_knobs_match_reference) {
    enum { V = 48 };
    static const k3_logit_bias bias[] = {{3, 2.5f}, {7, -100.0f}, {11, 1.5f}, {20, -1.25f}};
    static const int32_t bw[] = {5, 8, 8, 12, 13, 16}; /* "5", "8 8", "12 13 16" */
    static const int32_t bw_off[] = {0, 1, 3, 6};
    int32_t allowed[V];
    uint8_t amask[V] = {0};
    int n_allowed = 0;
    for (int i = 0; i < V; i++)
        if (i % 5 != 4) allowed[n_allowed++] = i, amask[i] = 1;
    for (int sampled = 0; sampled < 2; sampled++) {
        k3_sampler_options o = {.temperature = sampled ? 1.0f : 0.0f,
                                .top_p = 1,
                                .repeat_penalty = 1.3f,
                                .seed = 5,
                                .frequency_penalty = 0.7f,
                                .presence_penalty = -0.4f,
                                .logit_bias = bias,
                                .n_logit_bias = 4,
                                .allowed_ids = allowed,
                                .n_allowed = n_allowed,
                                .bad_words = bw,
                                .bad_word_off = bw_off,
                                .n_bad_words = 3};
        k3_sampler *s = NULL;
        k3_error err = {0};
        REQUIREF(k3_sampler_init(&s, &o, V, &err) == K3_OK, "%s", err.msg);
        static ref r;
        r = (ref){.V = V,
                  .freq = 0.7f,
                  .pres = -0.4f,
                  .rep = 1.3f,
                  .bias = bias,
                  .n_bias = 4,
                  .allowed = amask,
                  .bw = bw,
                  .bw_off = bw_off,
                  .n_bw = 3};
        const int32_t prompt[] = {1, 2, 3, 8, 40};
        for (int i = 0; i < 5; i++) {
            k3_sampler_accept(s, prompt[i]);
            r.hist[r.n_hist++] = prompt[i];
        }
        uint64_t x = 99 + (uint64_t)sampled;
        int bad_step = -1;
        for (int step = 0; step < 60 && bad_step < 0; step++) {
            float l[V], want[V];
            for (int i = 0; i < V; i++) l[i] = want[i] = (float)((int)(lcg(&x) % 2001) - 1000) / 250.0f;
            /* steer the walk into the bad words' prefixes now and then */
            if (step % 7 == 3) l[8] = want[8] = 9.0f;
            if (step % 11 == 5) l[12] = want[12] = 9.0f;
            if (step % 11 == 6) l[13] = want[13] = 9.0f;
            if (step % 11 == 7) l[16] = want[16] = 9.0f;
            ref_process(&r, want);
            const int id = k3_sampler_sample(s, l);
            for (int i = 0; i < V; i++)
                if (!(l[i] == want[i] || fabsf(l[i] - want[i]) <= 1e-6f * fmaxf(1.0f, fabsf(want[i])))) bad_step = step;
            CHECKF(bad_step < 0, "step %d (%s): processed logits differ from the reference", step,
                   sampled ? "sampled" : "greedy");
            REQUIREF(id >= 0 && id < V, "step %d drew %d", step, id);
            CHECKF(want[id] > -INFINITY, "step %d drew the masked id %d", step, id);
            if (!sampled) {
                int best = 0;
                for (int i = 1; i < V; i++)
                    if (want[i] > want[best]) best = i;
                CHECKF(id == best, "step %d: greedy drew %d, the reference's argmax is %d", step, id, best);
            }
            k3_sampler_accept(s, id);
            r.hist[r.n_hist++] = id;
            r.out[r.n_out++] = id;
        }
        /* the walk went through a bad word's prefix at least once */
        int prefixes = 0;
        for (int k = 0; k + 1 < r.n_out; k++) prefixes += r.out[k] == 8 || (r.out[k] == 12 && r.out[k + 1] == 13);
        int long_prefix = 0;
        for (int k = 0; k + 1 < r.n_out; k++) long_prefix += r.out[k] == 12 && r.out[k + 1] == 13;
        CHECKF(long_prefix > 0, "%s: the walk never drew 12 13", sampled ? "sampled" : "greedy");
        CHECKF(prefixes > 0, "%s: the walk never entered a bad word's prefix", sampled ? "sampled" : "greedy");
        for (int k = 0; k + 1 < r.n_out; k++) {
            CHECK(r.out[k] != 5 && r.out[k] % 5 != 4 && r.out[k] != 7);
            CHECK(!(r.out[k] == 8 && r.out[k + 1] == 8));
            CHECK(!(k + 2 < r.n_out && r.out[k] == 12 && r.out[k + 1] == 13 && r.out[k + 2] == 16));
        }
        k3_sampler_free(s);
    }
}

/* Each knob alone, on its own definition. */
K3_TEST(sample_knobs_one_by_one) {
    k3_error err = {0};
    /* frequency and presence: over the output only (the prompt's ids are not counted) */
    {
        k3_sampler_options o = {.temperature = 0,
                                .top_p = 1,
                                .repeat_penalty = 1,
                                .frequency_penalty = 0.5f,
                                .presence_penalty = 0.25f};
        k3_sampler *s = NULL;
        REQUIRE(k3_sampler_init(&s, &o, 4, &err) == K3_OK);
        k3_sampler_accept(s, 2); /* a prompt id */
        float l[4] = {0, 3, 2, 0};
        CHECK(k3_sampler_sample(s, l) == 1 && l[2] == 2.0f); /* the prompt's 2 is not penalised */
        float l2[4] = {0, 3, 2, 0};
        CHECK(k3_sampler_sample(s, l2) == 1 && l2[1] == 3.0f - 0.5f - 0.25f);
        float l3[4] = {0, 3, 2, 0};
        CHECK(k3_sampler_sample(s, l3) == 2 && l3[1] == 3.0f - 2 * 0.5f - 0.25f); /* 1.75 < 2 */
        k3_sampler_free(s);
    }
    /* logit_bias: -100 keeps the best id from ever being drawn, +100 makes a poor one certain */
    {
        const k3_logit_bias b[2] = {{0, -100}, {3, 100}};
        k3_sampler_options o =
            {.temperature = 1, .top_p = 1, .repeat_penalty = 1, .seed = 3, .logit_bias = b, .n_logit_bias = 1};
        k3_sampler *s = NULL, *t = NULL;
        REQUIRE(k3_sampler_init(&s, &o, 4, &err) == K3_OK);
        o.logit_bias = b + 1;
        REQUIRE(k3_sampler_init(&t, &o, 4, &err) == K3_OK);
        int zero = 0, three = 0;
        for (int i = 0; i < 2000; i++) {
            float l[4] = {5, 1, 1, -5}, l2[4] = {5, 1, 1, -5};
            zero += k3_sampler_sample(s, l) == 0;
            three += k3_sampler_sample(t, l2) == 3;
        }
        CHECK(zero == 0 && three == 2000);
        k3_sampler_free(s);
        k3_sampler_free(t);
    }
    /* logit_bias shapes the distribution: softmax(logits + bias) */
    {
        const k3_logit_bias b = {2, logf(3.0f)};
        k3_sampler_options o =
            {.temperature = 1, .top_p = 1, .repeat_penalty = 1, .seed = 11, .logit_bias = &b, .n_logit_bias = 1};
        k3_sampler *s = NULL;
        REQUIRE(k3_sampler_init(&s, &o, 4, &err) == K3_OK);
        int count[4] = {0};
        for (int i = 0; i < 20000; i++) {
            float l[4] = {0, 0, 0, 0};
            count[k3_sampler_sample(s, l)]++;
        }
        for (int i = 0; i < 4; i++)
            CHECKF(fabs(count[i] / 20000.0 - (i == 2 ? 0.5 : 1.0 / 6)) < 0.015, "p[%d] = %.3f", i, count[i] / 20000.0);
        k3_sampler_free(s);
    }
    /* allowed_token_ids: nothing else is drawn, greedy or sampled */
    {
        const int32_t a[2] = {1, 3};
        k3_sampler_options o =
            {.temperature = 2, .top_p = 1, .repeat_penalty = 1, .seed = 4, .allowed_ids = a, .n_allowed = 2};
        k3_sampler *s = NULL;
        REQUIRE(k3_sampler_init(&s, &o, 6, &err) == K3_OK);
        int hit[6] = {0};
        for (int i = 0; i < 2000; i++) {
            float l[6] = {9, 0, 8, 0, 7, 6};
            hit[k3_sampler_sample(s, l)]++;
        }
        CHECK(hit[1] > 0 && hit[3] > 0 && hit[1] + hit[3] == 2000);
        k3_sampler_free(s);
    }
    /* bad words: the pair (1, 2) never appears, though 2 alone does */
    {
        const int32_t bw[2] = {1, 2}, off[2] = {0, 2};
        k3_sampler_options o = {.temperature = 1,
                                .top_p = 1,
                                .repeat_penalty = 1,
                                .seed = 8,
                                .bad_words = bw,
                                .bad_word_off = off,
                                .n_bad_words = 1};
        k3_sampler *s = NULL;
        REQUIRE(k3_sampler_init(&s, &o, 3, &err) == K3_OK);
        int prev = -1, pairs = 0, twos = 0;
        for (int i = 0; i < 3000; i++) {
            float l[3] = {0, 0, 0};
            const int id = k3_sampler_sample(s, l);
            pairs += prev == 1 && id == 2;
            twos += id == 2;
            prev = id;
        }
        CHECK(pairs == 0 && twos > 500);
        k3_sampler_free(s);
    }
}

/* Every id masked: -1 (no distribution), greedy and sampled. Bad knobs are
 * refused at init with a message naming them. */
K3_TEST(sample_knobs_refused) {
    const int32_t one[1] = {2};
    for (int t = 0; t < 2; t++) {
        const int32_t bw[1] = {2}, off[2] = {0, 1};
        k3_sampler_options o = {.temperature = (float)t,
                                .top_p = 1,
                                .repeat_penalty = 1,
                                .allowed_ids = one,
                                .n_allowed = 1,
                                .bad_words = bw,
                                .bad_word_off = off,
                                .n_bad_words = 1};
        k3_sampler *s = NULL;
        k3_error err = {0};
        REQUIRE(k3_sampler_init(&s, &o, 4, &err) == K3_OK);
        float l[4] = {1, 2, 3, 4};
        CHECK(k3_sampler_sample(s, l) == -1);
        k3_sampler_free(s);
    }
    const k3_logit_bias far = {9, 1}, nan_bias = {1, NAN};
    const int32_t out_of_range[1] = {4}, empty_off[2] = {0, 0}, off1[2] = {0, 1};
    struct {
        k3_sampler_options o;
        const char *needle;
    } bad[] = {
        {{.top_p = 1, .repeat_penalty = 1, .frequency_penalty = NAN}, "frequency"},
        {{.top_p = 1, .repeat_penalty = 1, .presence_penalty = INFINITY}, "presence"},
        {{.top_p = 1, .repeat_penalty = 1, .logit_bias = &far, .n_logit_bias = 1}, "logit_bias[0]"},
        {{.top_p = 1, .repeat_penalty = 1, .logit_bias = &nan_bias, .n_logit_bias = 1}, "not finite"},
        {{.top_p = 1, .repeat_penalty = 1, .allowed_ids = one, .n_allowed = 0}, "empty"},
        {{.top_p = 1, .repeat_penalty = 1, .allowed_ids = out_of_range, .n_allowed = 1}, "allowed_ids[0]"},
        {{.top_p = 1, .repeat_penalty = 1, .bad_words = one, .bad_word_off = empty_off, .n_bad_words = 1}, "no ids"},
        {{.top_p = 1, .repeat_penalty = 1, .bad_words = out_of_range, .bad_word_off = off1, .n_bad_words = 1},
         "bad_words[0]"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        k3_sampler *s = NULL;
        k3_error err = {0};
        CHECKF(k3_sampler_init(&s, &bad[i].o, 4, &err) == K3_ERR_ARG && !s && strstr(err.msg, bad[i].needle),
               "case %zu: %s", i, err.msg);
    }
}
