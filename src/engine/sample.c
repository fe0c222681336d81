/*
 * sample.c -- token sampling (k3_sampler of k3.h): logit processors, then
 * greedy or a seeded draw through top-k, temperature, top-p and min-p.
 *
 * Processors, in vLLM's order, on the raw logits: ids outside allowed_ids
 * and bad words masked (-inf); logit_bias added; the repetition penalty
 * (a positive logit divided by it, a negative one multiplied, each distinct
 * id of the history window once); OpenAI's frequency and presence
 * penalties over the output (the ids this sampler drew). Then (as
 * llama.cpp's default chain) top-k, temperature, softmax, top-p, min-p,
 * draw. Greedy (temperature 0) takes the highest processed logit, ties to
 * the lowest id.
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
    k3_sampler_options o; /* its pointers cleared: the copies below */
    int32_t n_vocab;
    cand *c;       /* [n_vocab] */
    uint8_t *mark; /* [n_vocab] ids already penalised this step */
    int32_t *hist; /* ring of recent ids */
    int32_t hist_cap, hist_n, hist_head;
    uint64_t rng;
    /* the output: what this sampler drew */
    int32_t *count;    /* [n_vocab] times drawn, with a frequency or presence penalty */
    int32_t *distinct; /* the ids drawn at least once, in order */
    int32_t n_distinct, cap_distinct;
    int32_t *out; /* every id drawn, with bad words */
    int64_t n_out, cap_out;
    k3_logit_bias *bias;
    int32_t n_bias;
    uint8_t *allowed; /* [n_vocab] 1 = may be drawn, or NULL */
    int32_t *bw;      /* bad words: ids, offsets [n_bw + 1] */
    int32_t *bw_off;
    int32_t n_bw;
};

static k3_status check_ids(const int32_t *ids, int64_t n, int32_t V, const char *what, k3_error *err) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= V)
            return k3_err(err, K3_ERR_ARG, "sampler: %s[%lld] = %d is not a token id in 0..%d", what, (long long)i,
                          ids[i], V - 1);
    return K3_OK;
}

static k3_status check_options(const k3_sampler_options *opt, int32_t V, k3_error *err) {
    /* written so that NaN fails every test */
    if (!(opt->temperature >= 0 && opt->temperature <= 1e30f) || opt->top_k < 0 ||
        !(opt->top_p > 0 && opt->top_p <= 1) || !(opt->min_p >= 0 && opt->min_p <= 1) ||
        !(opt->repeat_penalty > 0 && opt->repeat_penalty <= 1e30f) || opt->repeat_last_n < 0)
        return k3_err(err, K3_ERR_ARG,
                      "sampler: bad options (need temp >= 0, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1, "
                      "repeat penalty > 0)");
    if (!isfinite(opt->frequency_penalty) || !isfinite(opt->presence_penalty))
        return k3_err(err, K3_ERR_ARG, "sampler: the frequency and presence penalties must be finite");
    if (opt->n_logit_bias < 0 || (opt->n_logit_bias > 0 && !opt->logit_bias))
        return k3_err(err, K3_ERR_ARG, "sampler: n_logit_bias is %d without a logit_bias array", opt->n_logit_bias);
    for (int32_t i = 0; i < opt->n_logit_bias; i++) {
        const k3_logit_bias *b = &opt->logit_bias[i];
        if (b->id < 0 || b->id >= V)
            return k3_err(err, K3_ERR_ARG, "sampler: logit_bias[%d] names id %d, not a token id in 0..%d", i, b->id,
                          V - 1);
        if (!isfinite(b->bias))
            return k3_err(err, K3_ERR_ARG, "sampler: logit_bias[%d] (id %d) is not finite", i, b->id);
    }
    if (opt->allowed_ids && opt->n_allowed <= 0)
        return k3_err(err, K3_ERR_ARG, "sampler: allowed_ids is given but empty (no id could be drawn)");
    if (opt->allowed_ids) K3_TRY(check_ids(opt->allowed_ids, opt->n_allowed, V, "allowed_ids", err));
    if (opt->n_bad_words < 0 || (opt->n_bad_words > 0 && (!opt->bad_words || !opt->bad_word_off)))
        return k3_err(err, K3_ERR_ARG, "sampler: n_bad_words is %d without the word arrays", opt->n_bad_words);
    if (opt->n_bad_words > 0) {
        if (opt->bad_word_off[0] != 0) return k3_err(err, K3_ERR_ARG, "sampler: bad_word_off[0] must be 0");
        for (int32_t w = 0; w < opt->n_bad_words; w++)
            if (opt->bad_word_off[w + 1] <= opt->bad_word_off[w])
                return k3_err(err, K3_ERR_ARG, "sampler: bad word %d has no ids", w);
        K3_TRY(check_ids(opt->bad_words, opt->bad_word_off[opt->n_bad_words], V, "bad_words", err));
    }
    return K3_OK;
}

k3_status k3_sampler_init(k3_sampler **out, const k3_sampler_options *opt, int32_t n_vocab, k3_error *err) {
    *out = NULL;
    if (n_vocab <= 0) return k3_err(err, K3_ERR_ARG, "sampler: vocabulary size must be positive");
    K3_TRY(check_options(opt, n_vocab, err));
    k3_sampler *s = calloc(1, sizeof *s);
    if (!s) return k3_err(err, K3_ERR_NOMEM, "sampler: out of memory");
    s->o = *opt;
    s->o.logit_bias = NULL;
    s->o.allowed_ids = NULL;
    s->o.bad_words = s->o.bad_word_off = NULL;
    s->n_vocab = n_vocab;
    s->hist_cap = opt->repeat_last_n > 0 ? opt->repeat_last_n : 4096;
    s->c = malloc(sizeof(cand) * (size_t)n_vocab);
    s->hist = malloc(sizeof(int32_t) * (size_t)s->hist_cap);
    s->mark = calloc((size_t)n_vocab, 1);
    bool ok = s->c && s->hist && s->mark;
    if (ok && (opt->frequency_penalty != 0 || opt->presence_penalty != 0))
        ok = (s->count = calloc((size_t)n_vocab, sizeof *s->count)) != NULL;
    if (ok && opt->n_logit_bias > 0) {
        ok = (s->bias = malloc(sizeof *s->bias * (size_t)opt->n_logit_bias)) != NULL;
        if (ok) memcpy(s->bias, opt->logit_bias, sizeof *s->bias * (size_t)opt->n_logit_bias);
        s->n_bias = opt->n_logit_bias;
    }
    if (ok && opt->allowed_ids) {
        ok = (s->allowed = calloc((size_t)n_vocab, 1)) != NULL;
        for (int32_t i = 0; ok && i < opt->n_allowed; i++) s->allowed[opt->allowed_ids[i]] = 1;
    }
    if (ok && opt->n_bad_words > 0) {
        const int32_t n_ids = opt->bad_word_off[opt->n_bad_words];
        s->bw = malloc(sizeof *s->bw * (size_t)n_ids);
        s->bw_off = malloc(sizeof *s->bw_off * (size_t)(opt->n_bad_words + 1));
        ok = s->bw && s->bw_off;
        if (ok) {
            memcpy(s->bw, opt->bad_words, sizeof *s->bw * (size_t)n_ids);
            memcpy(s->bw_off, opt->bad_word_off, sizeof *s->bw_off * (size_t)(opt->n_bad_words + 1));
            s->n_bw = opt->n_bad_words;
        }
    }
    if (!ok) {
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
    free(s->count);
    free(s->distinct);
    free(s->out);
    free(s->bias);
    free(s->allowed);
    free(s->bw);
    free(s->bw_off);
    free(s);
}

void k3_sampler_accept(k3_sampler *s, int32_t id) {
    s->hist[s->hist_head] = id;
    s->hist_head = (s->hist_head + 1) % s->hist_cap;
    if (s->hist_n < s->hist_cap) s->hist_n++;
}

/* The id drawn joins the output. False when out of memory: the id is then
 * not counted (the penalties and bad words see one id less). */
static bool note_output(k3_sampler *s, int32_t id) {
    bool ok = true;
    if (s->count) {
        if (s->count[id] == 0) {
            if (s->n_distinct == s->cap_distinct) {
                const int32_t cap = s->cap_distinct ? s->cap_distinct * 2 : 64;
                int32_t *d = realloc(s->distinct, sizeof *d * (size_t)cap);
                if (d) {
                    s->distinct = d;
                    s->cap_distinct = cap;
                }
            }
            if (s->n_distinct < s->cap_distinct) s->distinct[s->n_distinct++] = id;
            else ok = false;
        }
        if (ok) s->count[id]++;
    }
    if (s->n_bw) {
        if (s->n_out == s->cap_out) {
            const int64_t cap = s->cap_out ? s->cap_out * 2 : 64;
            int32_t *o = realloc(s->out, sizeof *o * (size_t)cap);
            if (o) {
                s->out = o;
                s->cap_out = cap;
            }
        }
        if (s->n_out < s->cap_out) s->out[s->n_out++] = id;
        else ok = false;
    }
    return ok;
}

/* The processors, in place (see the top of the file). */
static void process(k3_sampler *s, float *logits) {
    const int32_t V = s->n_vocab;
    if (s->allowed)
        for (int32_t i = 0; i < V; i++)
            if (!s->allowed[i]) logits[i] = -INFINITY;
    for (int32_t w = 0; w < s->n_bw; w++) {
        const int32_t *ids = s->bw + s->bw_off[w];
        const int64_t pre = s->bw_off[w + 1] - s->bw_off[w] - 1; /* ids before the masked one */
        if (pre > s->n_out) continue;
        if (pre == 0 || !memcmp(s->out + (s->n_out - pre), ids, sizeof *ids * (size_t)pre))
            logits[ids[pre]] = -INFINITY;
    }
    for (int32_t i = 0; i < s->n_bias; i++) logits[s->bias[i].id] += s->bias[i].bias;
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
    if (s->count)
        for (int32_t i = 0; i < s->n_distinct; i++) {
            const int32_t id = s->distinct[i];
            logits[id] -= (float)s->count[id] * s->o.frequency_penalty + s->o.presence_penalty;
        }
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

static int32_t draw(k3_sampler *s, float *logits) {
    const int32_t V = s->n_vocab;
    /* NaN or +Inf anywhere (damaged weights, an overflow): no distribution
     * to sample from, and greedy would quietly answer id 0. -Inf is a mask. */
    for (int32_t i = 0; i < V; i++)
        if (isnan(logits[i]) || logits[i] == INFINITY) return -1;
    process(s, logits);
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
        return bv > -INFINITY ? best : -1; /* every id masked */
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
                at = 0;                                     /* sift down from the root */
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
    if (!(s->c[0].logit > -INFINITY)) return -1; /* every id masked */
    const float inv_t = 1.0f / s->o.temperature;
    const float mx = s->c[0].logit * inv_t;
    double sum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        s->c[i].logit = expf(s->c[i].logit * inv_t - mx);
        sum += s->c[i].logit;
    }
    /* masked ids (weight 0) sort last: never drawn, not even by rounding */
    while (n > 1 && s->c[n - 1].logit == 0.0f) n--;
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

void k3_sampler_take(k3_sampler *s, int32_t id) {
    if (id < 0 || id >= s->n_vocab) return;
    if (s->o.temperature != 0.0f) (void)next_uniform(s);
    note_output(s, id);
}

int32_t k3_sampler_sample(k3_sampler *s, float *logits) {
    const int32_t id = draw(s, logits);
    if (id >= 0) note_output(s, id);
    return id;
}
