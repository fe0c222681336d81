/*
 * qsfa_amx.c -- QSFA's BF16 form (attn_ops.h) on the AMX tiles, the "amx"
 * table's kernel: the bits of the vdpbf16ps one (qsfa_avx512bf16.c) and of
 * k3_qsfa_bf16_ref. One call is one token, so prefill, decode and the
 * speculative verify run it alike.
 *
 * Scores, per 32 slots and block (4 x 32 latent dims, or the rope block):
 * C [16 slots x 16 heads] (tmm0, tmm1) = keys (A: tmm2, tmm3, a slot's 32
 * BF16 dims a row, read in place from the block's key rows) x query (B:
 * tmm4, its dim pairs a row, made once a call). Values, per 64 output dims:
 * C [16 heads x 16 dims] (tmm0-tmm3) += P (A: tmm4, 16 heads x 32 slots of
 * one block's P) x codes (B: tmm6, tmm7, a pair of slots a row), the C tiles
 * held over every slot. Compiled with the AMX flags; run only after
 * k3_amx_init (the "amx" table holds it only where the unit is granted).
 */
#include "kernels/qsfa_bf16.h"

#include "kernels/amx_tile.h"

#define TLOAD(t, p, s) AMX_HW_TLOAD(t, p, s)

static void scores(qsfa_bf_ws *w, const k3_c8_cache *c, const int64_t *slots, int s0) {
    const int kq = w->kq, kvl = w->kvl;
    const long ld = 2L * kq;
    float *cb0 = w->cbuf, *cb1 = w->cbuf + 256;
    for (int b = 0; b <= w->nt; b++) {
        const int k0 = b < w->nt ? b * 4 : kvl / 32,
                  k1 = b < w->nt ? (kvl / 32 < (b + 1) * 4 ? kvl / 32 : (b + 1) * 4) : kq / 32;
        _tile_zero(0);
        _tile_zero(1);
        for (int k = k0; k < k1; k++) {
            TLOAD(4, w->qb + (int64_t)k * 512, 64);
            TLOAD(2, w->cb + 32 * k, ld);
            TLOAD(3, w->cb + (int64_t)16 * kq + 32 * k, ld);
            _tile_dpbf16ps(0, 2, 4);
            _tile_dpbf16ps(1, 3, 4);
        }
        _tile_stored(0, cb0, 64);
        _tile_stored(1, cb1, 64);
        __asm__ volatile("" ::: "memory");
        qsfa_bf_zblock(w, c, slots, s0, b);
    }
}

/* B rows of 16 slot pairs x 16 dims for dims [d0, d0 + 16 nd) of slots
 * [s0, s0 + 32): row k lane d = (low: slot 2k, high: slot 2k + 1). */
static void value_b(qsfa_bf_ws *w, const k3_c8_cache *c, const int64_t *slots, int s0, int d0, int nd) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    for (int k = 0; k < 16; k++) {
        const int a = s0 + 2 * k, e = a + 1;
        const int8_t *pa = a < w->n ? c->c8 + slots[a] * w->kvl + d0 : NULL,
                     *pe = e < w->n ? c->c8 + slots[e] * w->kvl + d0 : NULL;
        for (int t = 0; t < nd; t++) {
            const __m512i fa = pa ? qsfa_bf_codes16(pa + 16 * t) : _mm512_setzero_si512(),
                          fe = pe ? qsfa_bf_codes16(pe + 16 * t) : _mm512_setzero_si512();
            _mm512_storeu_si512((void *)(w->vb + t * 256 + k * 16),
                                _mm512_ternarylogic_epi32(hi, fe, _mm512_srli_epi32(fa, 16), 0xCA));
        }
    }
}

/* Output dims [d0, d0 + 16 nd) (nd <= 4, one block) of heads [0, H). */
static void values(qsfa_bf_ws *w, const k3_c8_cache *c, const int64_t *slots, int H, int d0, int nd, float *out) {
    const int npad = w->npad, b = d0 / K3_C8_TILE;
    const uint16_t *P = w->pb + (int64_t)b * 16 * npad;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int s0 = 0; s0 < npad; s0 += QB_S) {
        value_b(w, c, slots, s0, d0, nd);
        TLOAD(4, P + s0, 2L * npad);
        TLOAD(6, w->vb, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (nd > 1) {
            TLOAD(7, w->vb + 256, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (nd > 2) {
            TLOAD(6, w->vb + 512, 64);
            _tile_dpbf16ps(2, 4, 6);
        }
        if (nd > 3) {
            TLOAD(7, w->vb + 768, 64);
            _tile_dpbf16ps(3, 4, 7);
        }
    }
    float *C = w->vb; /* [16][64] */
    _tile_stored(0, C, 256);
    _tile_stored(1, C + 16, 256);
    _tile_stored(2, C + 32, 256);
    _tile_stored(3, C + 48, 256);
    __asm__ volatile("" ::: "memory");
    for (int t = 0; t < nd; t++) qsfa_bf_out(w, C + 16 * t, 64, H, d0 + 16 * t, out);
}

static void qsfa16(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                   float scale, float *out, float *lse, float *work) {
    if (n == 0) {
        qsfa_bf_empty(H, c->kv_lora, out, lse);
        return;
    }
    qsfa_bf_ws w;
    qsfa_bf_ws_init(&w, c, n, work);
    const __m512i idx = k3b_idx_natural();
    qsfa_bf_query(&w, qa, qpe, H, idx);
    for (int s0 = 0; s0 < w.npad; s0 += QB_S) {
        qsfa_bf_keys(&w, c, slots, s0, idx);
        __asm__ volatile("" ::: "memory");
        scores(&w, c, slots, s0);
    }
    qsfa_bf_softmax(&w, c, slots, scale, idx);
    __asm__ volatile("" ::: "memory");
    for (int d0 = 0; d0 < w.kvl; d0 += 64) {
        const int nd = (w.kvl - d0) / 16 < 4 ? (w.kvl - d0) / 16 : 4;
        values(&w, c, slots, H, d0, nd, out);
    }
    qsfa_bf_lse(&w, H, lse);
}

void k3_qsfa_bf_amx(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n,
                    float scale, float *out, float *lse, float *work) {
    amx_tcfg cfg;
    amx_tcfg_make(&cfg, 64, 16);
    AMX_HW_TCFG(&cfg);
    for (int h0 = 0; h0 < H; h0 += QB_H) {
        const int nh = H - h0 < QB_H ? H - h0 : QB_H;
        qsfa16(qa + (int64_t)h0 * c->kv_lora, qpe + (int64_t)h0 * c->rope, nh, c, slots, n, scale,
               out + (int64_t)h0 * c->kv_lora, lse + h0, work);
    }
    _tile_release();
}
