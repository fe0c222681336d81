/*
 * policy.c -- the cost model and the draft length (spec.h): how long a
 * step of decodes and verify chunks takes, learned from the engine's own
 * steps, and the drafts of a step chosen to maximize the batch's expected
 * tokens per second.
 *
 * The pass: at batch 1 on a CPU a pass reads every weight once whatever its
 * rows, so extra rows are cheap (the routed experts read grow with the
 * distinct experts the rows pick); once a step's rows make it compute-bound
 * each row costs its full share. Around the pass: proposing, sampling each
 * verify row, the rollback, and the outputs of the extra tokens (a server's
 * per-token work on its engine thread). On a small model they weigh as much
 * as the pass, so the model measures the step's whole time, not the pass's
 * alone: a verify chunk that adds 0.2 ms of pass and 0.3 ms around it to a
 * 1 ms step of four decodes must bring 2 accepted tokens to pay.
 */
#include <string.h>

#include "spec/spec.h"

#define SPEC_FIT_DECAY 0.97      /* the verify overhead's fit: the weight of an older step */
#define SPEC_DECLINED_DECAY 0.99 /* ... and of the fit at a step that declined every draft */
#define SPEC_FIT_RIDGE 1.0       /* its ridge (in chunks^2), which a fit decayed to nothing falls back to 0 by */

void k3_spec_policy_init(k3_spec_policy *p, double prior_slope) {
    memset(p, 0, sizeof *p);
    p->prior_slope = prior_slope > 0 ? prior_slope : 0.1;
}

static void ewma(double *t, int32_t *n_obs, int32_t i, double seconds) {
    const double w = n_obs[i] < 8 ? 1.0 / (n_obs[i] + 1) : 0.125;
    t[i] = n_obs[i] ? t[i] + w * (seconds - t[i]) : seconds;
    n_obs[i]++;
}

void k3_spec_policy_observe(k3_spec_policy *p, int32_t rows, double seconds) {
    if (rows < 1 || rows > K3_SPEC_ROWS_MAX || !(seconds > 0)) return;
    ewma(p->t, p->n_obs, rows, seconds);
}

double k3_spec_policy_cost(const k3_spec_policy *p, int32_t rows) {
    if (rows < 1) rows = 1;
    if (rows <= K3_SPEC_ROWS_MAX && p->n_obs[rows]) return p->t[rows];
    /* the nearest seen counts below and above */
    int32_t lo = (rows <= K3_SPEC_ROWS_MAX ? rows : K3_SPEC_ROWS_MAX + 1) - 1, hi = rows + 1;
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

/* A plain step of n decodes took seconds: its time is the median of the
 * last few such (one step's time moves with what the machine does beside
 * it; a mean of three would take an outlier's third). */
static void observe_plain(k3_spec_policy *p, int32_t n, double seconds) {
    double *last = p->plain_last[n];
    last[p->n_obs_plain[n] % K3_SPEC_PLAIN_KEEP] = seconds;
    p->n_obs_plain[n]++;
    p->plain_at[n] = p->n_steps;
    const int32_t m = p->n_obs_plain[n] < K3_SPEC_PLAIN_KEEP ? p->n_obs_plain[n] : K3_SPEC_PLAIN_KEEP;
    double v[K3_SPEC_PLAIN_KEEP];
    for (int32_t i = 0; i < m; i++) { /* insertion sort of at most five */
        int32_t j = i;
        for (; j > 0 && v[j - 1] > last[i]; j--) v[j] = v[j - 1];
        v[j] = last[i];
    }
    p->plain[n] = m % 2 ? v[m / 2] : 0.5 * (v[m / 2 - 1] + v[m / 2]);
}

/* A plain step's whole time at n decodes: the seen count's, else
 * interpolated, else in proportion to the nearest seen; < 0 before any. */
static double plain_cost(const k3_spec_policy *p, int32_t n) {
    if (n < 1) n = 1;
    if (n <= K3_SPEC_ROWS_MAX && p->n_obs_plain[n]) return p->plain[n];
    int32_t lo = (n <= K3_SPEC_ROWS_MAX ? n : K3_SPEC_ROWS_MAX + 1) - 1, hi = n + 1;
    while (lo >= 1 && !p->n_obs_plain[lo]) lo--;
    while (hi <= K3_SPEC_ROWS_MAX && !p->n_obs_plain[hi]) hi++;
    const bool has_lo = lo >= 1, has_hi = hi <= K3_SPEC_ROWS_MAX;
    if (has_lo && has_hi) return p->plain[lo] + (p->plain[hi] - p->plain[lo]) * (double)(n - lo) / (double)(hi - lo);
    if (has_lo) return p->plain[lo] * (double)n / (double)lo;
    if (has_hi) return p->plain[hi] * (double)n / (double)hi;
    return -1;
}

/* The batch size class of n decodes: 1, 2, 3-4, 5-8, ... */
static int32_t size_class(int32_t n) {
    int32_t c = 0;
    while (c < K3_SPEC_CLASSES - 1 && (1 << c) < n) c++;
    return c;
}

/* Solves a verify fit: y = a c + b d, least squares with a small ridge,
 * each coefficient >= 0 (a negative one is dropped and the other fitted
 * alone); a fit whose weight has decayed away shrinks to 0 (trying again). */
static void solve(k3_spec_fit *f) {
    const double r = SPEC_FIT_RIDGE * 1e-3, cc = f->s_cc + r, dd = f->s_dd + r;
    const double det = cc * dd - f->s_cd * f->s_cd;
    double a = det > 0 ? (dd * f->s_cy - f->s_cd * f->s_dy) / det : 0;
    double b = det > 0 ? (cc * f->s_dy - f->s_cd * f->s_cy) / det : 0;
    if (a < 0) {
        a = 0;
        b = f->s_dy / (f->s_dd + r);
    } else if (b < 0) {
        b = 0;
        a = f->s_cy / (f->s_cc + r);
    }
    const double w = f->s_cc + f->s_dd, shrink = w / (w + SPEC_FIT_RIDGE);
    f->a_chunk = a > 0 ? a * shrink : 0;
    f->b_draft = b > 0 ? b * shrink : 0;
}

void k3_spec_policy_observe_step(k3_spec_policy *p, const k3_spec_step *st) {
    if (st->n_dec < 1 || st->n_dec + st->n_drafts > K3_SPEC_ROWS_MAX || !(st->pass_s > 0) ||
        !(st->step_s >= st->pass_s))
        return;
    k3_spec_policy_observe(p, st->n_dec + st->n_drafts, st->pass_s);
    p->n_steps++;
    if (!st->n_chunks) {
        observe_plain(p, st->n_dec, st->step_s);
        return;
    }
    const double base = plain_cost(p, st->n_dec);
    if (base < 0) return; /* nothing to measure the extra against yet */
    k3_spec_fit *f = &p->fit[size_class(st->n_dec)];
    const double c = st->n_chunks, d = st->n_drafts;
    /* one step moves the fit by at most twice what it predicts plus a plain
     * step: a step slowed by something beside it (another process, a page
     * fault storm) would otherwise price every draft so high that none is
     * taken, and nothing is measured, for the hundreds of steps the declined
     * steps take to forget it */
    const double pred = k3_spec_policy_step_cost(p, st->n_dec, st->n_chunks, st->n_drafts) - base;
    double y = st->step_s - base;
    if (y > 2 * pred + base) y = 2 * pred + base;
    f->s_cc = SPEC_FIT_DECAY * f->s_cc + c * c;
    f->s_cd = SPEC_FIT_DECAY * f->s_cd + c * d;
    f->s_dd = SPEC_FIT_DECAY * f->s_dd + d * d;
    f->s_cy = SPEC_FIT_DECAY * f->s_cy + c * y;
    f->s_dy = SPEC_FIT_DECAY * f->s_dy + d * y;
    f->n_obs++;
    solve(f);
}

void k3_spec_policy_declined(k3_spec_policy *p, int32_t n_dec) {
    k3_spec_fit *f = &p->fit[size_class(n_dec)];
    f->s_cc *= SPEC_DECLINED_DECAY;
    f->s_cd *= SPEC_DECLINED_DECAY;
    f->s_dd *= SPEC_DECLINED_DECAY;
    f->s_cy *= SPEC_DECLINED_DECAY;
    f->s_dy *= SPEC_DECLINED_DECAY;
    solve(f);
}

double k3_spec_policy_step_cost(const k3_spec_policy *p, int32_t n_dec, int32_t n_chunks, int32_t n_drafts) {
    const double base = plain_cost(p, n_dec);
    if (base < 0) return k3_spec_policy_cost(p, n_dec + n_drafts); /* no step seen: the pass alone */
    const k3_spec_fit *own = &p->fit[size_class(n_dec)];
    if (own->n_obs) return base + own->a_chunk * n_chunks + own->b_draft * n_drafts;
    /* a class not seen drafting: the most of the pass's extra rows, the
     * nearest smaller class's fit, and a decode row's cost at this batch (the
     * plain step's growth from the largest smaller batch seen): a draft row
     * is a row of the pass like a decode's */
    double extra = k3_spec_policy_cost(p, n_dec + n_drafts) - k3_spec_policy_cost(p, n_dec);
    for (int32_t c = size_class(n_dec) - 1; c >= 0; c--) {
        const k3_spec_fit *f = &p->fit[c];
        if (!f->n_obs) continue;
        const double e = f->a_chunk * n_chunks + f->b_draft * n_drafts;
        if (e > extra) extra = e;
        break;
    }
    int32_t m = (n_dec <= K3_SPEC_ROWS_MAX ? n_dec : K3_SPEC_ROWS_MAX + 1) - 1;
    while (m >= 1 && !p->n_obs_plain[m]) m--;
    if (m >= 1) {
        const double row = (base - p->plain[m]) / (double)(n_dec - m);
        if (row * n_drafts > extra) extra = row * n_drafts;
    }
    return base + extra;
}

bool k3_spec_policy_may_pay(const k3_spec_policy *p, int32_t base, int32_t max_k) {
    if (base < 1) base = 1;
    const double rate = base / k3_spec_policy_step_cost(p, base, 0, 0);
    for (int32_t k = 1; k <= max_k && base + k <= K3_SPEC_ROWS_MAX; k++)
        if ((base + k) / k3_spec_policy_step_cost(p, base, 1, k) > rate) return true;
    return false;
}

bool k3_spec_policy_plain_due(const k3_spec_policy *p, int32_t base) {
    if (base < 1 || base > K3_SPEC_ROWS_MAX) return false;
    return p->n_obs_plain[base] < K3_SPEC_PLAIN_MIN || p->n_steps - p->plain_at[base] > K3_SPEC_PLAIN_EVERY;
}

int32_t k3_spec_policy_choose(const k3_spec_policy *p, int32_t base, const k3_spec_cand *c, int32_t n_seqs,
                              int32_t *take) {
    if (base < 1) base = 1;
    for (int32_t i = 0; i < n_seqs; i++) take[i] = 0;
    /* add the best marginal gain and keep the set of the best rate; gains
     * fall along each sequence (gain[j] is a product of probabilities), so
     * taking the best next token of any sequence is the most tokens for a
     * set of that size (a new chunk's fixed cost aside) */
    double tokens = base, best_rate = tokens / k3_spec_policy_step_cost(p, base, 0, 0);
    int32_t added = 0, best_added = 0, chunks = 0;
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
        chunks += cur[bi] == 0;
        cur[bi]++;
        added++;
        tokens += bg;
        const double rate = tokens / k3_spec_policy_step_cost(p, base, chunks, added);
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
