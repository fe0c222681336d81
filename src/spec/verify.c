/*
 * verify.c -- the acceptance rule of speculative sampling (spec.h,
 * k3_spec_reject_sample; Leviathan et al. 2023, Chen et al. 2023).
 */
#include "spec/spec.h"

int32_t k3_spec_reject_sample(const float *p, const float *q, int32_t n, int32_t d, double u1, double u2,
                              bool *accepted) {
    *accepted = false;
    if (d >= 0 && d < n) {
        const double pd = p[d], qd = q ? q[d] : 1.0;
        /* accept with probability min(1, p(d) / q(d)) */
        if (qd > 0 && u1 * qd < pd) {
            *accepted = true;
            return d;
        }
    }
    /* the residual max(0, p - q), normalized */
    double z = 0;
    for (int32_t i = 0; i < n; i++) {
        const double r = (double)p[i] - (q ? (double)q[i] : (i == d ? 1.0 : 0.0));
        if (r > 0) z += r;
    }
    if (!(z > 0)) { /* p <= q everywhere: p == q, and the draft was accepted above unless p(d) = 0 */
        double c = 0, u = u2;
        for (int32_t i = 0; i < n; i++) c += p[i];
        u *= c;
        for (int32_t i = 0; i < n; i++)
            if ((u -= p[i]) < 0) return i;
        return n - 1;
    }
    double u = u2 * z;
    int32_t last = -1;
    for (int32_t i = 0; i < n; i++) {
        const double r = (double)p[i] - (q ? (double)q[i] : (i == d ? 1.0 : 0.0));
        if (r <= 0) continue;
        last = i;
        if ((u -= r) < 0) return i;
    }
    return last;
}
