/*
 * attn_ops.c -- QLI, QSFA and the LSE merge (see attn_ops.h): the scalar
 * references (the "ref" table's kernels; dispatch.c runs the current table's),
 * the per-token quantizers and the Hadamard transform.
 */
#include "attn_ops.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "kernels/bf16_scalar.h"
#include "kernels/kernels_isa.h"
#include "kernels/kernels.h"
#include "kernels/quant.h"

/* = the per-token quantizer of the 8-bit matmuls, the scalar form */
float k3_quant_i8(const float *x, int n, int8_t *q) { return k3_quant_act_i8_ref(x, n, q); }

void k3_quant_i8_tiles(const float *x, int n, int8_t *q, float *scales) {
    for (int t = 0; t * K3_C8_TILE < n; t++) {
        const int len = n - t * K3_C8_TILE < K3_C8_TILE ? n - t * K3_C8_TILE : K3_C8_TILE;
        scales[t] = k3_quant_i8(x + t * K3_C8_TILE, len, q + t * K3_C8_TILE);
    }
}

void k3_hadamard(float *x, int n) {
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float r = 1.0f / sqrtf((float)n);
    for (int i = 0; i < n; i++) x[i] *= r;
}

/* ---- QLI ----------------------------------------------------------------- */

void k3_qli_scores_ref(const int8_t *q8, const float *qs, const float *w, int HI, int dI, const int8_t *k8,
                       const float *ks, const int64_t *slots, int n, float *scores) {
    for (int i = 0; i < n; i++) {
        const int8_t *k = k8 + slots[i] * dI;
        float s = 0.0f;
        for (int h = 0; h < HI; h++) {
            int32_t d = 0;
            for (int j = 0; j < dI; j++) d += (int32_t)q8[h * dI + j] * k[j];
            if (d > 0) s += w[h] * qs[h] * (float)d;
        }
        scores[i] = s * ks[slots[i]];
    }
}

/* ---- QSFA ---------------------------------------------------------------- */

int64_t k3_qsfa_work(int H, int kv_lora, int n) {
    /* ref: scores [H, n] + one row; AVX2 slot by slot: one row + running
     * max/sum [2H]; by blocks of slots (AVX2, AVX-512): a block of rows and
     * its scores (rope <= kv_lora) */
    const int64_t ref = (int64_t)H * n + kv_lora + 2 * H, blocks = k3_qsfa_block_work(H, kv_lora, kv_lora),
                  bf = k3_qsfa_bf_work(kv_lora, kv_lora, n), most = ref > blocks ? ref : blocks;
    return most > bf ? most : bf;
}

static float dq(const k3_c8_cache *c, int64_t slot, int i) {
    return c->c8[slot * c->kv_lora + i] * c->cs[slot * c->n_tiles + i / K3_C8_TILE];
}

void k3_qsfa_ref(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                 float scale, float *out, float *lse, float *work) {
    const int kvl = c->kv_lora, rope = c->rope;
    for (int h = 0; h < H; h++) {
        float *z = work + (int64_t)h * n;
        float mx = -INFINITY;
        for (int i = 0; i < n; i++) {
            double s = 0.0;
            for (int j = 0; j < kvl; j++) s += (double)qa[h * kvl + j] * dq(c, slots[i], j);
            for (int j = 0; j < rope; j++) s += (double)qpe[h * rope + j] * c->kpe[slots[i] * rope + j];
            z[i] = (float)s * scale;
            mx = z[i] > mx ? z[i] : mx;
        }
        double sum = 0.0;
        for (int i = 0; i < n; i++) sum += exp((double)z[i] - mx);
        for (int j = 0; j < kvl; j++) {
            double o = 0.0;
            for (int i = 0; i < n; i++) o += exp((double)z[i] - mx) / sum * dq(c, slots[i], j);
            out[h * kvl + j] = (float)o;
        }
        lse[h] = n ? mx + (float)log(sum) : -INFINITY;
    }
}

void k3_lse_merge_ref(const float *const *o, const float *const *lse, int P, int H, int d, float *out, float *lse_out) {
    for (int h = 0; h < H; h++) {
        float mx = -INFINITY;
        for (int p = 0; p < P; p++) mx = lse[p][h] > mx ? lse[p][h] : mx;
        float *oh = out + (int64_t)h * d;
        memset(oh, 0, sizeof(float) * (size_t)d);
        if (mx == -INFINITY) {
            lse_out[h] = -INFINITY;
            continue;
        }
        double sum = 0.0;
        for (int p = 0; p < P; p++) sum += exp((double)lse[p][h] - mx);
        const float L = mx + (float)log(sum);
        for (int p = 0; p < P; p++) {
            const float wgt = expf(lse[p][h] - L);
            if (wgt == 0.0f) continue;
            const float *op = o[p] + (int64_t)h * d;
            for (int j = 0; j < d; j++) oh[j] += wgt * op[j];
        }
        lse_out[h] = L;
    }
}

/* ---- QSFA's BF16 form (attn_ops.h) ----------------------------------------- */

bool k3_qsfa_bf16_fits(const k3_c8_cache *c) {
    return c->kv_lora >= 32 && c->kv_lora % 32 == 0 && c->rope % 16 == 0 && c->rope <= c->kv_lora && c->rope <= 1024 &&
        c->n_tiles == (c->kv_lora + K3_C8_TILE - 1) / K3_C8_TILE;
}

/* E/O sums of 32 pairs a[i] b[i] (as the products read them), added to C */
static float eo32(float C, const float *a, int as, const float *b, int bs) {
    float e = 0.0f, o = 0.0f;
    for (int i = 0; i < 32; i += 2) {
        e = ftz(e + a[i * as] * b[i * bs]);
        o = ftz(o + a[(i + 1) * as] * b[(i + 1) * bs]);
    }
    return C + (e + o);
}

void k3_qsfa_bf16_ref(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                      float scale, float *out, float *lse, float *work) {
    const int kvl = c->kv_lora, rope = c->rope, kq = kvl + 2 * rope, nt = c->n_tiles;
    const int npad = (n + 31) / 32 * 32;
    float *q = work, *key = q + kq, *z = key + kq, *P = z + npad, *cv = P + npad;
    for (int h = 0; h < H; h++) {
        float *oh = out + (int64_t)h * kvl;
        if (n == 0) {
            memset(oh, 0, sizeof(float) * (size_t)kvl);
            lse[h] = -INFINITY;
            continue;
        }
        for (int d = 0; d < kq; d++)
            q[d] = bf_round(d < kvl ? qa[(int64_t)h * kvl + d] : qpe[(int64_t)h * rope + (d - kvl) % rope]);
        float m = -INFINITY;
        for (int i = 0; i < n; i++) {
            const int64_t s = slots[i];
            for (int d = 0; d < kvl; d++) key[d] = c->c8[s * kvl + d];
            for (int d = 0; d < rope; d++) {
                const uint16_t hi = k3_f32_to_bf16(c->kpe[s * rope + d]);
                key[kvl + d] = bf_in(hi);
                key[kvl + rope + d] = bf_round(c->kpe[s * rope + d] - k3_bf16_to_f32(hi));
            }
            float zi = 0.0f;
            for (int b = 0; b < nt; b++) {
                float C = 0.0f;
                for (int d = b * K3_C8_TILE; d < kvl && d < (b + 1) * K3_C8_TILE; d += 32)
                    C = eo32(C, q + d, 1, key + d, 1);
                zi = fmaf(C, c->cs[s * nt + b], zi);
            }
            float C = 0.0f;
            for (int d = kvl; d < kq; d += 32) C = eo32(C, q + d, 1, key + d, 1);
            z[i] = (zi + C) * scale;
            m = z[i] > m ? z[i] : m;
        }
        float l = 0.0f;
        for (int i = 0; i < n; i++) {
            z[i] = exp_poly(z[i] - m);
            l = l + z[i];
        }
        const float inv = 1.0f / l;
        for (int d = 0; d < kvl; d++) {
            const int b = d / K3_C8_TILE;
            for (int i = 0; i < npad; i++) {
                P[i] = i < n ? bf_round(z[i] * c->cs[slots[i] * nt + b]) : 0.0f;
                cv[i] = i < n ? (float)c->c8[slots[i] * kvl + d] : 0.0f;
            }
            float C = 0.0f;
            for (int i = 0; i < npad; i += 32) C = eo32(C, P + i, 1, cv + i, 1);
            oh[d] = C * inv;
        }
        lse[h] = m + logf(l);
    }
}
