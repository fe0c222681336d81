/*
 * attn_ops.c -- QLI and QSFA (see attn_ops.h): scalar references, the
 * dispatch to the AVX2 and AVX-512 paths, quantizers and the Hadamard
 * transform.
 */
#include "attn_ops.h"

#include <math.h>
#include <string.h>

#include "kernels/kernels.h"

/* AVX2 paths, attn_ops_avx2.c */
void k3_qli_scores_avx2(const int8_t *q8, const float *qs, const float *w, int HI, int dI,
                        const int8_t *k8, const float *ks, const int64_t *slots, int n, float *scores);
void k3_qsfa_avx2(const float *qa, const float *qpe, int H, const k3_c8_cache *c,
                  const int64_t *slots, int n, float scale, float *out, float *lse, float *work);

/* AVX2 QSFA by blocks of slots (attn_ops_avx2.c), and the work floats it needs */
int64_t k3_qsfa_work_avx2b(int H, int kv_lora, int rope);
void k3_qsfa_avx2b(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                   float scale, float *out, float *lse, float *work);

/* AVX-512 VNNI path, attn_ops_avx512.c: whether it takes these shapes, and
 * the scores */
int k3_qli_avx512_ok(int HI, int dI);
void k3_qli_scores_avx512(const int8_t *q8, const float *qs, const float *w, int HI, int dI, const int8_t *k8,
                          const float *ks, const int64_t *slots, int n, float *scores);

/* AVX-512 QSFA, attn_ops_avx512.c, and the work floats it needs */
int64_t k3_qsfa_work_avx512(int H, int kv_lora, int rope);
void k3_qsfa_avx512(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                    float scale, float *out, float *lse, float *work);

static int use_avx2(void) { return k3_kernels_isa() >= K3_ISA_AVX2; }

float k3_quant_i8(const float *x, int n, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    if (amax == 0.0f) {
        memset(q, 0, (size_t)n);
        return 0.0f;
    }
    const float s = amax / 127.0f, inv = 127.0f / amax;
    for (int i = 0; i < n; i++) {
        const float r = nearbyintf(x[i] * inv);
        q[i] = (int8_t)(r > 127.0f ? 127 : r < -127.0f ? -127 : r);
    }
    return s;
}

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

void k3_qli_scores_ref(const int8_t *q8, const float *qs, const float *w, int HI, int dI,
                       const int8_t *k8, const float *ks, const int64_t *slots, int n, float *scores) {
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

void k3_qli_scores(const int8_t *q8, const float *qs, const float *w, int HI, int dI,
                   const int8_t *k8, const float *ks, const int64_t *slots, int n, float *scores) {
    if (k3_kernels_isa() >= K3_ISA_AVX512 && __builtin_cpu_supports("avx512vnni") &&
        k3_qli_avx512_ok(HI, dI))
        k3_qli_scores_avx512(q8, qs, w, HI, dI, k8, ks, slots, n, scores);
    else if (use_avx2() && dI % 16 == 0 && dI <= 256 && HI <= 64) /* its q16[64 * 256] */
        k3_qli_scores_avx2(q8, qs, w, HI, dI, k8, ks, slots, n, scores);
    else
        k3_qli_scores_ref(q8, qs, w, HI, dI, k8, ks, slots, n, scores);
}

/* ---- QSFA ---------------------------------------------------------------- */

int64_t k3_qsfa_work(int H, int kv_lora, int n) {
    /* ref: scores [H, n] + one row; avx2: one row + running max/sum [2H];
     * avx512: a block of rows and its scores (rope <= kv_lora) */
    const int64_t ref = (int64_t)H * n + kv_lora + 2 * H, simd = k3_qsfa_work_avx512(H, kv_lora, kv_lora);
    const int64_t a2 = k3_qsfa_work_avx2b(H, kv_lora, kv_lora);
    const int64_t mx = ref > simd ? ref : simd;
    return mx > a2 ? mx : a2;
}

static float dq(const k3_c8_cache *c, int64_t slot, int i) {
    return c->c8[slot * c->kv_lora + i] * c->cs[slot * c->n_tiles + i / K3_C8_TILE];
}

void k3_qsfa_ref(const float *qa, const float *qpe, int H, const k3_c8_cache *c,
                 const int64_t *slots, int n, float scale, float *out, float *lse, float *work) {
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

void k3_qsfa(const float *qa, const float *qpe, int H, const k3_c8_cache *c,
             const int64_t *slots, int n, float scale, float *out, float *lse, float *work) {
    if (k3_kernels_isa() >= K3_ISA_AVX512 && c->kv_lora % 16 == 0 && c->rope % 16 == 0 && c->rope <= c->kv_lora)
        k3_qsfa_avx512(qa, qpe, H, c, slots, n, scale, out, lse, work);
    else if (use_avx2() && c->kv_lora % 8 == 0 && c->rope % 8 == 0 && c->rope <= c->kv_lora)
        k3_qsfa_avx2b(qa, qpe, H, c, slots, n, scale, out, lse, work);
    else if (use_avx2() && c->kv_lora % 8 == 0)
        k3_qsfa_avx2(qa, qpe, H, c, slots, n, scale, out, lse, work);
    else
        k3_qsfa_ref(qa, qpe, H, c, slots, n, scale, out, lse, work);
}

void k3_lse_merge(const float *const *o, const float *const *lse, int P, int H, int d,
                  float *out, float *lse_out) {
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
