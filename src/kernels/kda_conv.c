/*
 * kda_conv.c -- the pieces of a KDA head before its recurrence (see kda.h):
 * the short conv with its SiLU and the decay gate, on k3_glu's vector forms.
 */
#include "kda.h"
#include "kernels/kernels.h"

#include <math.h>
#include <string.h>

/* ---- gate and short conv ---------------------------------------------- */

static float softplusf(float x) {
    /* log(1 + e^x), stable; torch uses a threshold of 20 */
    return x > 20.0f ? x : log1pf(expf(x));
}

void k3_kda_gate(float *z, int n, float A_log, const float *dt_bias, bool has_lb, float lb) {
    const float a = expf(A_log);
    if (has_lb) {
        /* lb · sigmoid(a x), through k3_glu's vector sigmoid, 256 at a time */
        float x[256];
        for (int i0 = 0; i0 < n; i0 += 256) {
            const int m = n - i0 < 256 ? n - i0 : 256;
            for (int i = 0; i < m; i++) {
                x[i] = z[i0 + i] + dt_bias[i0 + i];
                z[i0 + i] = lb;
            }
            k3_glu(z + i0, x, m, K3_GLU_GATE, a, 0.0f);
        }
        return;
    }
    for (int i = 0; i < n; i++) z[i] = -a * softplusf(z[i] + dt_bias[i]);
}

/* One block of nc <= 16 channels of one token of k3_kda_conv: nc is a
 * constant in the main path, so the loops and copies become vector code. The
 * sum in the order of one channel alone: current tap, then the window oldest
 * first. */
enum { CONV_CB = 16 };
static inline __attribute__((always_inline)) void conv_block(float *xt, const float *w, int64_t ldw, float *state,
                                                             int64_t lds, int K, const int nc) {
    float in[CONV_CB], s[CONV_CB];
    memcpy(in, xt, sizeof(float) * (size_t)nc);
    for (int c = 0; c < nc; c++) s[c] = w[(int64_t)(K - 1) * ldw + c] * in[c];
    for (int j = 0; j < K - 1; j++)
        for (int c = 0; c < nc; c++) s[c] += w[(int64_t)j * ldw + c] * state[(int64_t)j * lds + c];
    for (int j = 0; j + 1 < K - 1; j++)
        memcpy(state + (int64_t)j * lds, state + (int64_t)(j + 1) * lds, sizeof(float) * (size_t)nc);
    if (K > 1) memcpy(state + (int64_t)(K - 2) * lds, in, sizeof(float) * (size_t)nc);
    memcpy(xt, s, sizeof(float) * (size_t)nc);
}

void k3_kda_conv(float *x, int64_t ldx, int n, int C, int K, const float *w, int64_t ldw, float *state, int64_t lds) {
    for (int t = 0; t < n; t++) {
        float *xt = x + (int64_t)t * ldx;
        int c0 = 0;
        for (; c0 + CONV_CB <= C; c0 += CONV_CB) conv_block(xt + c0, w + c0, ldw, state + c0, lds, K, CONV_CB);
        if (c0 < C) conv_block(xt + c0, w + c0, ldw, state + c0, lds, K, C - c0);
        k3_glu(xt, NULL, C, K3_GLU_SILU, 0.0f, 0.0f);
    }
}
