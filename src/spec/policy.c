/*
 * policy.c -- the cost model and the draft length (spec.h): how long a
 * pass of r rows takes, learned from the engine's own decode and verify
 * passes (an EWMA per row count; unseen counts interpolated, or
 * extrapolated from the prior slope), and the drafts of a step chosen to
 * maximize the expected tokens per second. At batch 1 on a CPU a pass reads
 * every weight once whatever its rows, so extra rows are cheap (the routed
 * experts read grow with the distinct experts the rows pick); once a
 * step's rows make it compute-bound each row costs its full share and
 * drafting stops paying unless its acceptance is high.
 */
#include <string.h>

#include "spec/spec.h"

void k3_spec_policy_init(k3_spec_policy *p, double prior_slope) {
    memset(p, 0, sizeof *p);
    p->prior_slope = prior_slope > 0 ? prior_slope : 0.1;
}

void k3_spec_policy_observe(k3_spec_policy *p, int32_t rows, double seconds) {
    if (rows < 1 || rows > K3_SPEC_ROWS_MAX || !(seconds > 0)) return;
    const double w = p->n_obs[rows] < 8 ? 1.0 / (p->n_obs[rows] + 1) : 0.125;
    p->t[rows] = p->n_obs[rows] ? p->t[rows] + w * (seconds - p->t[rows]) : seconds;
    p->n_obs[rows]++;
}

double k3_spec_policy_cost(const k3_spec_policy *p, int32_t rows) {
    if (rows < 1) rows = 1;
    if (rows <= K3_SPEC_ROWS_MAX && p->n_obs[rows]) return p->t[rows];
    /* the nearest seen counts below and above */
    int32_t lo = rows - 1, hi = rows + 1;
    while (lo >= 1 && !p->n_obs[lo]) lo--;
    while (hi <= K3_SPEC_ROWS_MAX && !p->n_obs[hi]) hi++;
    const bool has_lo = lo >= 1, has_hi = hi <= K3_SPEC_ROWS_MAX;
    if (has_lo && has_hi) return p->t[lo] + (p->t[hi] - p->t[lo]) * (double)(rows - lo) / (double)(hi - lo);
    if (has_lo) {
        /* past the last seen: the slope of the two last seen, or the prior's */
        int32_t lo2 = lo - 1;
        while (lo2 >= 1 && !p->n_obs[lo2]) lo2--;
        double slope = p->prior_slope * p->t[lo] / (1.0 + p->prior_slope * (lo - 1));
        if (lo2 >= 1 && p->t[lo] > p->t[lo2]) {
            const double s2 = (p->t[lo] - p->t[lo2]) / (double)(lo - lo2);
            if (s2 > slope) slope = s2; /* never cheaper than the prior says */
        }
        return p->t[lo] + slope * (double)(rows - lo);
    }
    if (has_hi) { /* below the first seen: the prior's shape under it */
        const double t1 = p->t[hi] / (1.0 + p->prior_slope * (hi - 1));
        return t1 * (1.0 + p->prior_slope * (rows - 1));
    }
    return 1.0 + p->prior_slope * (rows - 1);
}

int32_t k3_spec_policy_choose(const k3_spec_policy *p, int32_t base, const k3_spec_cand *c, int32_t n_seqs,
                              int32_t *take) {
    if (base < 1) base = 1;
    for (int32_t i = 0; i < n_seqs; i++) take[i] = 0;
    /* add the best marginal gain while tokens per second grows; gains fall
     * along each sequence (gain[j] is a product of probabilities), so taking
     * the best next token of any sequence is the best set of that size */
    double tokens = base, best_rate = tokens / k3_spec_policy_cost(p, base);
    int32_t added = 0, best_added = 0;
    int32_t *cur = take; /* the counts of the set being grown; the best one is kept below */
    int32_t best_take[256];
    const int32_t nkeep = n_seqs < 256 ? n_seqs : 256;
    for (int32_t i = 0; i < nkeep; i++) best_take[i] = 0;
    for (;;) {
        int32_t bi = -1;
        float bg = 0;
        for (int32_t i = 0; i < nkeep; i++)
            if (cur[i] < c[i].n && c[i].gain[cur[i]] > bg) {
                bg = c[i].gain[cur[i]];
                bi = i;
            }
        if (bi < 0 || base + added + 1 > K3_SPEC_ROWS_MAX) break;
        cur[bi]++;
        added++;
        tokens += bg;
        const double rate = tokens / k3_spec_policy_cost(p, base + added);
        if (rate > best_rate) {
            best_rate = rate;
            best_added = added;
            memcpy(best_take, cur, sizeof(int32_t) * (size_t)nkeep);
        }
    }
    memcpy(take, best_take, sizeof(int32_t) * (size_t)nkeep);
    return best_added;
}

#define CALIB_DECAY 0.9f
#define CALIB_PRIOR 0.5f

void k3_spec_calib_init(k3_spec_calib *c) { c->acc = c->conf = 0; }

void k3_spec_calib_update(k3_spec_calib *c, const float *conf, int32_t n_draft, int32_t n_acc) {
    c->acc *= CALIB_DECAY;
    c->conf *= CALIB_DECAY;
    /* the drafts tested: the accepted ones and the first rejected */
    const int32_t tested = n_acc < n_draft ? n_acc + 1 : n_draft;
    c->acc += (float)n_acc;
    for (int32_t i = 0; i < tested; i++) c->conf += conf[i];
}

void k3_spec_calib_gains(const k3_spec_calib *c, const float *conf, int32_t n, k3_spec_cand *out) {
    const float ratio = (c->acc + CALIB_PRIOR) / (c->conf + CALIB_PRIOR);
    float g = 1;
    out->n = n < K3_SPEC_MAX_DRAFT ? n : K3_SPEC_MAX_DRAFT;
    for (int32_t j = 0; j < out->n; j++) {
        const float p = conf[j] * ratio;
        g *= p < 1 ? p : 1;
        out->gain[j] = g;
    }
}
