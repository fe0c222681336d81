/*
 * sample.c -- token sampling: greedy, temperature, top-k, top-p, min-p and a
 * repetition penalty, with a seeded generator (k3_sampler of k3.h).
 *
 * Order (as llama.cpp's default chain): repetition penalty on the raw logits,
 * then top-k, temperature, softmax, top-p, min-p, draw. Greedy (temperature
 * 0) takes the highest logit after the penalty, ties to the lowest id.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

typedef struct {
    float logit;
    int32_t id;
} cand;

struct k3_sampler {
    k3_sampler_options o;
    int32_t n_vocab;
    cand *c;            /* [n_vocab] */
    uint8_t *mark;      /* [n_vocab] ids already penalised this step */
    int32_t *hist;      /* ring of recent ids */
    int32_t hist_cap, hist_n, hist_head;
    uint64_t rng;
};

k3_status k3_sampler_init(k3_sampler **out, const k3_sampler_options *opt, int32_t n_vocab,
                          k3_error *err) {
    *out = NULL;
    if (n_vocab <= 0) return k3_err(err, K3_ERR_ARG, "sampler: vocabulary size must be positive");
    /* written so that NaN fails every test */
    if (!(opt->temperature >= 0 && opt->temperature <= 1e30f) || opt->top_k < 0 ||
        !(opt->top_p > 0 && opt->top_p <= 1) || !(opt->min_p >= 0 && opt->min_p <= 1) ||
        !(opt->repeat_penalty > 0 && opt->repeat_penalty <= 1e30f) || opt->repeat_last_n < 0)
        return k3_err(err, K3_ERR_ARG,
                      "sampler: bad options (need temp >= 0, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1, "
                      "repeat penalty > 0)");
    k3_sampler *s = calloc(1, sizeof *s);
    if (!s) return k3_err(err, K3_ERR_NOMEM, "sampler: out of memory");
    s->o = *opt;
    s->n_vocab = n_vocab;
    s->hist_cap = opt->repeat_last_n > 0 ? opt->repeat_last_n : 4096;
    s->c = malloc(sizeof(cand) * (size_t)n_vocab);
    s->hist = malloc(sizeof(int32_t) * (size_t)s->hist_cap);
    s->mark = calloc((size_t)n_vocab, 1);
    if (!s->c || !s->hist || !s->mark) {
        k3_sampler_free(s);
        return k3_err(err, K3_ERR_NOMEM, "sampler: out of memory");
    }
    s->rng = opt->seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    *out = s;
    return K3_OK;
}

void k3_sampler_free(k3_sampler *s) {
    if (!s) return;
    free(s->c);
    free(s->hist);
    free(s->mark);
    free(s);
}

void k3_sampler_accept(k3_sampler *s, int32_t id) {
    s->hist[s->hist_head] = id;
    s->hist_head = (s->hist_head + 1) % s->hist_cap;
    if (s->hist_n < s->hist_cap) s->hist_n++;
}

/* splitmix64 -> uniform in [0, 1) */
static double next_uniform(k3_sampler *s) {
    uint64_t z = (s->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0;
}

static int cand_desc(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->logit > y->logit) return -1;
    if (x->logit < y->logit) return 1;
    return (x->id > y->id) - (x->id < y->id);
}

int32_t k3_sampler_sample(k3_sampler *s, float *logits) {
    const int32_t V = s->n_vocab;
    /* NaN or +Inf anywhere (damaged weights, an overflow): no distribution
     * to sample from, and greedy would quietly answer id 0. -Inf is a mask. */
    for (int32_t i = 0; i < V; i++)
        if (isnan(logits[i]) || logits[i] == INFINITY) return -1;
    if (s->o.repeat_penalty != 1.0f) {
        /* penalise each distinct recent id once */
        for (int32_t i = 0; i < s->hist_n; i++) {
            const int32_t id = s->hist[i];
            if (id < 0 || id >= V || s->mark[id]) continue;
            s->mark[id] = 1;
            logits[id] = logits[id] > 0 ? logits[id] / s->o.repeat_penalty : logits[id] * s->o.repeat_penalty;
        }
        for (int32_t i = 0; i < s->hist_n; i++)
            if (s->hist[i] >= 0 && s->hist[i] < V) s->mark[s->hist[i]] = 0;
    }
    if (s->o.temperature == 0.0f) {
        /* the first of the largest; the best value kept in a register, not
         * reloaded through its index (this runs between two decode steps) */
        int32_t best = 0;
        float bv = logits[0];
        for (int32_t i = 1; i < V; i++)
            if (logits[i] > bv) {
                bv = logits[i];
                best = i;
            }
        return best;
    }
    int32_t n = V;
    if (s->o.top_k > 0 && s->o.top_k < V) {
        /* keep the top_k best in a min-heap (root = the worst kept), then
         * sort only those: O(V log k) instead of sorting the vocabulary */
        n = s->o.top_k;
        for (int32_t i = 0; i < V; i++) {
            const cand x = {logits[i], i};
            int32_t at;
            if (i < n) {
                at = i; /* sift up */
                while (at > 0 && cand_desc(&x, &s->c[(at - 1) / 2]) > 0) {
                    s->c[at] = s->c[(at - 1) / 2];
                    at = (at - 1) / 2;
                }
            } else {
                if (cand_desc(&x, &s->c[0]) >= 0) continue; /* not better than the worst kept */
                at = 0; /* sift down from the root */
                for (;;) {
                    int32_t ch = 2 * at + 1;
                    if (ch >= n) break;
                    if (ch + 1 < n && cand_desc(&s->c[ch + 1], &s->c[ch]) > 0) ch++;
                    if (cand_desc(&s->c[ch], &x) <= 0) break;
                    s->c[at] = s->c[ch];
                    at = ch;
                }
            }
            s->c[at] = x;
        }
        qsort(s->c, (size_t)n, sizeof(cand), cand_desc);
    } else {
        for (int32_t i = 0; i < V; i++) s->c[i] = (cand){logits[i], i};
        qsort(s->c, (size_t)V, sizeof(cand), cand_desc);
    }
    const float inv_t = 1.0f / s->o.temperature;
    const float mx = s->c[0].logit * inv_t;
    double sum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        s->c[i].logit = expf(s->c[i].logit * inv_t - mx);
        sum += s->c[i].logit;
    }
    if (s->o.top_p < 1.0f) {
        double acc = 0.0;
        for (int32_t i = 0; i < n; i++) {
            acc += s->c[i].logit / sum;
            if (acc >= s->o.top_p) {
                n = i + 1;
                break;
            }
        }
    }
    if (s->o.min_p > 0.0f) {
        /* keep tokens with p >= min_p * p_max; c[0] has p_max (its weight is 1) */
        int32_t keep = 1;
        while (keep < n && s->c[keep].logit >= s->o.min_p) keep++;
        n = keep;
    }
    sum = 0.0;
    for (int32_t i = 0; i < n; i++) sum += s->c[i].logit;
    double r = next_uniform(s) * sum;
    for (int32_t i = 0; i < n; i++) {
        r -= s->c[i].logit;
        if (r < 0) return s->c[i].id;
    }
    return s->c[n - 1].id;
}
