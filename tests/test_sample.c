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
    struct { int k; float p, minp; } cases[3] = {{2, 1.0f, 0}, {0, 0.6f, 0}, {0, 1.0f, 0.6f}};
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
