/*
 * dispatch.c -- the kernel tables (kernels_isa.h): built once from what the
 * CPU has, one of them current; and the entry points that run the current
 * table's kernels (k3_matmul is in matmul.c).
 *
 * Tables, each a copy of the one below it with the entries it has kernels for
 * replaced:
 *   "ref"          the scalar references; takes every shape.
 *   "avx2"         AVX2 + FMA + F16C; its integer kernels in the plain form
 *                  (vpmaddubsw/vpmaddwd).
 *   "avx2-vnni"    "avx2" with the AVX-VNNI forms of W8A8 and the W4A8 tiles
 *                  (vpdpbusd on 256 bits) where the CPU has them; "avx2" where
 *                  the CPU has AVX-VNNI means this one, "avx2-novnni" the plain.
 *   "avx512"       AVX-512 F+BW+VL over "avx2" (the plain one); with AVX-512
 *                  VNNI its W8A8, W4A8 and QLI kernels, with VBMI too the
 *                  vpermb forms of W4A8 and its orders; without VNNI the 8-bit
 *                  products stay AVX2's.
 *   "avx512-bf16"  "avx512" with the BF16 dot products (vdpbf16ps, kernels_isa.h)
 *                  where the CPU has AVX512_BF16: the model's BF16 and MXFP4
 *                  matrices take them (k3_mat.bf16), and QSFA its BF16 form
 *                  (attn_ops.h, k3_c8_cache.bf16); "avx512" on such a CPU
 *                  means this one, "avx512-nobf16" the plain, exact one.
 *   "amx"          "avx512-bf16" with the BF16 dot products of calls with
 *                  enough rows and Q8 (W8A8) on the AMX tile unit (amx.h),
 *                  each with the bits of the kernel below it, so no result
 *                  depends on the rows that share its call; the rest, decode
 *                  included, run "avx512-bf16"'s kernels (its base). Only
 *                  where the CPU has AMX and the kernel grants the process
 *                  the tile state (arch_prctl, in k3_amx_init); "--isa amx"
 *                  elsewhere is an error saying why.
 * CPU features come from __builtin_cpu_supports, which also checks that the OS
 * saves the wider registers. The best table the CPU has is current unless
 * k3_set_isa (`--isa`) or k3_kernels_force (tests) chose another; which one
 * runs also decides the resident layout (the W4A8 tiles) and a context's KDA
 * form, so it is chosen before the model is loaded.
 */
#include "kernels/kernels_isa.h"
#include "kernels/amx.h"
#include "kernels/quant.h"
#include "kernels/peak_isa.h"
#include "common/error.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static k3_kernel_ops t_ref, t_avx2, t_avx2_vnni, t_avx512, t_avx512_bf16, t_amx;
static bool g_have[K3_ISA_COUNT];
static bool g_amx_built;    /* t_amx is made (the unit is granted, or the emulation can run) */
static bool g_have_avxvnni; /* AVX-VNNI (vpdpbusd on ymm) */
static bool g_have_bf16;    /* AVX512_BF16 (vdpbf16ps): t_avx512_bf16 is built */
static const k3_kernel_ops *g_best;
static const k3_kernel_ops *_Atomic g_ops;

/* ---- the tables --------------------------------------------------------------- */

static void build_ref(k3_kernel_ops *o) {
    *o = (k3_kernel_ops){
        .name = "ref",
        .isa = K3_ISA_REF,
        .quant_act_i8 = k3_quant_act_i8_ref,
        .mx4_prep = k3_mx4_prep_ref,
        .mx4_r4_prep = k3_mx4_r4_prep_ref,
        .mx4_dot = k3_mx4_dot_ref,
        .mxfp8_dequant = k3_mxfp8_dequant_ref,
        .dot = k3_dot_ref,
        .axpy = k3_axpy_ref,
        .glu = k3_glu_ref,
        .softmax = k3_softmax_ref,
        .qli_scores = k3_qli_scores_ref,
        .qsfa = k3_qsfa_ref,
        .lse_merge = k3_lse_merge_ref,
        .attnres_mix = k3_attnres_mix_ref,
        .kda_recurrent = k3_kda_recurrent_ref,
        .kda_chunked = k3_kda_chunked_ref,
    };
    /* every type the fp32 family takes, through its row dequantizer */
    for (int t = 0; t < K3_W_COUNT; t++) {
        if (k3_wtype_info((k3_wtype)t)->acts & K3_ACTS_F32) o->mm[t].rows = k3_matmul_rows_ref;
        if (k3_wtype_info((k3_wtype)t)->acts & K3_ACTS_BF16) o->bf[t].rows = k3_bf16_rows_ref;
    }
    o->q[K3_W_Q8] = (k3_q_kernel){.form = K3_QX_I8, .rows = k3_q8_rows_ref};
    o->q[K3_W_MXFP4] = (k3_q_kernel){.form = K3_QX_I8, .rows = k3_mx4_rows};
    o->q[K3_W_MXFP4_R4] = (k3_q_kernel){.form = K3_QX_I8, .rows = k3_mx4_r4_rows_ref};
    o->q[K3_W_MXFP8] = (k3_q_kernel){.form = K3_QX_MXFP8, .rows = k3_mxfp8_rows};
}

static void build_avx2(k3_kernel_ops *o, const k3_kernel_ops *base) {
    *o = *base;
    o->name = "avx2";
    o->isa = K3_ISA_AVX2;
    o->base = base;
    const k3_mm_kernel mm = {.rows = k3_matmul_rows_avx2, .prep_x = k3_matmul_prep_x_avx2};
    o->mm[K3_W_F32] = o->mm[K3_W_F16] = o->mm[K3_W_BF16] = o->mm[K3_W_MXFP4] = mm;
    o->q[K3_W_Q8] = (k3_q_kernel){.form = K3_QX_I8, .rows = k3_q8_rows_avx2};
    o->q[K3_W_MXFP4_R4] = (k3_q_kernel){.form = K3_QX_MX4_R4, .rows = k3_mx4_r4_rows_avx2};
    o->w4a8_tiles = true;
    o->quant_act_i8 = k3_quant_act_i8_avx2;
    o->mx4_r4_prep = k3_mx4_r4_prep_avx2;
    o->mx4_dot = k3_mx4_dot_avx2;
    o->mxfp8_dequant = k3_mxfp8_dequant_avx2;
    o->dot = k3_dot_avx2;
    o->axpy = k3_axpy_avx2;
    o->glu = k3_glu_avx2;
    o->softmax = k3_softmax_avx2;
    o->qli_fits = k3_qli_avx2_fits;
    o->qli_scores = k3_qli_scores_avx2;
    o->qsfa_fits = k3_qsfa_avx2_fits;
    o->qsfa = k3_qsfa_avx2;
    o->attnres_mix = k3_attnres_mix_avx2;
    o->kda_recurrent_fits = o->kda_chunked_fits = k3_kda_simd_fits;
    o->kda_recurrent = k3_kda_recurrent_avx2;
    o->kda_chunked = k3_kda_chunked_avx2;
}

static void build_avx2_vnni(k3_kernel_ops *o, const k3_kernel_ops *avx2) {
    *o = *avx2;
    o->name = "avx2-vnni";
    o->q[K3_W_Q8] = (k3_q_kernel){.form = K3_QX_U8, .rows = k3_q8_rows_avxvnni};
    o->q[K3_W_MXFP4_R4] = (k3_q_kernel){.form = K3_QX_MX4_R4, .rows = k3_mx4_r4_rows_avxvnni};
}

/* The AVX-512 recurrence beats every chunked form at every span length
 * (kda.h), so prefill runs it too, and is then bit-identical to decode. */
static void build_avx512(k3_kernel_ops *o, const k3_kernel_ops *avx2, bool vnni, bool vbmi) {
    *o = *avx2;
    o->name = "avx512";
    o->isa = K3_ISA_AVX512;
    o->base = avx2;
    const k3_mm_kernel mm = {.rows = k3_matmul_rows_avx512, .prep_x = k3_matmul_prep_x_avx512};
    o->mm[K3_W_F32] = o->mm[K3_W_F16] = o->mm[K3_W_BF16] = o->mm[K3_W_MXFP4] = mm;
    o->quant_act_i8 = k3_quant_act_i8_avx512;
    o->mxfp8_dequant = k3_mxfp8_dequant_avx512;
    o->dot = k3_dot_avx512;
    o->axpy = k3_axpy_avx512;
    o->glu = k3_glu_avx512;
    o->softmax = k3_softmax_avx512;
    o->qsfa_fits = k3_qsfa_avx512_fits;
    o->qsfa = k3_qsfa_avx512;
    o->kda_recurrent = k3_kda_recurrent_avx512;
    o->kda_recurrent_prefill = true;
    if (!vnni) {
        o->w4a8_tiles = false; /* no tile kernel of its own */
        return;
    }
    o->q[K3_W_Q8] = (k3_q_kernel){.form = K3_QX_U8, .rows = k3_q8_rows_avx512, .panels = k3_q8_panels_avx512};
    o->q[K3_W_MXFP4] = (k3_q_kernel){.form = K3_QX_MX4, .rows = vbmi ? k3_mx4_rows_avx512_vbmi : k3_mx4_rows_avx512};
    o->q[K3_W_MXFP4_R4] =
        (k3_q_kernel){.form = K3_QX_MX4_R4, .rows = vbmi ? k3_mx4_r4_rows_avx512_vbmi : k3_mx4_r4_rows_avx512};
    o->mx4_prep = vbmi ? k3_mx4_prep_avx512_vbmi : k3_mx4_prep_ref;
    o->mx4_r4_prep = vbmi ? k3_mx4_r4_prep_avx512_vbmi : k3_mx4_r4_prep_ref;
    o->qli_fits = k3_qli_avx512_fits;
    o->qli_scores = k3_qli_scores_avx512;
}

/* "avx512" with the BF16 dot products on vdpbf16ps (AVX512_BF16): the
 * model's BF16 and MXFP4 matrices take them (k3_mat.bf16, marked at load);
 * the fp32 kernels stay for the matrices kept exact (the routers) and for
 * "avx512-nobf16", the exact path. */
static double loop_rate(double (*loop)(int64_t)) {
    double best = 0;
    for (int r = 0; r < 3; r++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        const double ops = loop(4096);
        clock_gettime(CLOCK_MONOTONIC, &b);
        const double s = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9;
        if (s > 0 && ops / s > best) best = ops / s;
    }
    return best;
}

/* Whether fp32 FMAs do the BF16 products of a few tokens faster than
 * vdpbf16ps: where a core's FMAs (16 multiply-adds each) issue at more than
 * 1.5 times the rate of its vdpbf16ps (32 each), as on the Xeons that issue
 * vdpbf16ps every other cycle beside two FMAs a cycle (Zen 4 issues it at
 * twice the FMA's rate). The two register loops, ~0.1 ms each, best of 3,
 * alternated; either answer gives the same bits. */
static bool fma_outruns_vdp(void) {
    double fma = 0, vdp = 0;
    for (int r = 0; r < 2; r++) {
        const double f = loop_rate(k3_peak_fma32_avx512), v = loop_rate(k3_peak_bf16_avx512);
        fma = f > fma ? f : fma;
        vdp = v > vdp ? v : vdp;
    }
    return fma > 1.5 * vdp;
}

static void build_avx512_bf16(k3_kernel_ops *o, const k3_kernel_ops *avx512) {
    *o = *avx512;
    o->name = "avx512-bf16";
    o->base = avx512;
    o->bf16 = true;
    o->qsfa_bf = k3_qsfa_bf_avx512;
    /* KDA's BF16 chunked form, with the tiles' bits, but not by default:
     * on the Xeon where it was measured it runs at 0.64x the fp32
     * recurrence (vdpbf16ps issues at half the FMAs' rate there) */
    o->kda_chunked_bf = k3_kda_chunked_bf_avx512;
    o->kda_bf_min = 0;
    /* vdpbf16ps, or the few-token calls on FMAs where this CPU's FMAs are
     * the faster (matmul_bf16_avx512bf16.c): the same bits */
    const k3_mm_kernel bf = fma_outruns_vdp()
        ? (k3_mm_kernel){.rows = k3_bf16_rows_avx512_fma, .prep_x = k3_bf16_prep_x_avx512_fma}
        : (k3_mm_kernel){.rows = k3_bf16_rows_avx512, .prep_x = k3_bf16_prep_x_avx512};
    for (int t = 0; t < K3_W_COUNT; t++)
        if (k3_wtype_info((k3_wtype)t)->acts & K3_ACTS_BF16) o->bf[t] = bf;
}

/* AMX over "avx512-bf16": the BF16 dot products of calls with enough rows
 * on the tiles, with the same bits as the AVX-512 BF16 kernels below them
 * (kernels_isa.h), and Q8 (W8A8) with the AVX-512 VNNI kernel's bits (the
 * same integers, the same float epilogue); QSFA's BF16 form on the tiles with
 * the vdpbf16ps kernel's bits (one token a call). Everything else -- decode's
 * streams, the rest of attention, the W4A8 tiles, the fp32 products -- as its
 * base. So no result depends on how many rows shared its call. */
static void build_amx(k3_kernel_ops *o, const k3_kernel_ops *avx512_bf16, bool unit) {
    *o = *avx512_bf16;
    o->name = "amx";
    o->isa = K3_ISA_AMX;
    o->base = avx512_bf16;
    const k3_mm_kernel bf = {.fits = k3_amx_bf_fits, .call = k3_amx_bf_call};
    for (int t = 0; t < K3_W_COUNT; t++)
        if (k3_wtype_info((k3_wtype)t)->acts & K3_ACTS_BF16) o->bf[t] = bf;
    o->q[K3_W_Q8] = (k3_q_kernel){.form = K3_QX_I8, .fits = k3_amx_q8_fits, .call = k3_amx_mm_call};
    o->moe_fits = k3_amx_moe_bf_fits;
    o->moe = k3_amx_moe_bf;
    /* QSFA's BF16 form on the tiles: no emulated form, so an emulated table
     * keeps the vdpbf16ps kernel (the same bits) */
    if (unit) o->qsfa_bf = k3_qsfa_bf_amx;
    /* KDA's BF16 chunked form likewise (emulated: the vdpbf16ps kernel),
     * faster than the recurrence from pieces of K3_KDA_BF_MIN_AMX tokens;
     * taken only where a context asks (k3_ctx_options.kda_bf16_prefill): a
     * prefill then no longer gives the bits of decoding the same tokens,
     * which the penalties' reference in tests/serve_knobs.py and the DCP
     * prefill in tests/pd_serve.py rely on (docs/amx.md, "KDA's chunked
     * form on the tiles") */
    if (unit) {
        o->kda_chunked_bf = k3_kda_chunked_bf_amx;
        o->kda_bf_min = K3_KDA_BF_MIN_AMX;
    }
    /* the indexer scores of a prefill chunk on the INT8 tiles (qli_scores'
     * bits), likewise on the unit only */
    if (unit) {
        o->qli_chunk_fits = k3_amx_qli_chunk_fits;
        o->qli_chunk = k3_amx_qli_chunk;
    }
}

static void detect(void) {
    g_have[K3_ISA_REF] = true;
    bool vnni = false, vbmi = false;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    g_have[K3_ISA_AVX2] =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    g_have[K3_ISA_AVX512] = g_have[K3_ISA_AVX2] && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    g_have_avxvnni = g_have[K3_ISA_AVX2] && __builtin_cpu_supports("avxvnni");
    vnni = __builtin_cpu_supports("avx512vnni");
    vbmi = __builtin_cpu_supports("avx512vbmi");
    g_have_bf16 = __builtin_cpu_supports("avx512bf16");
#endif
    build_ref(&t_ref);
    g_best = &t_ref;
    if (g_have[K3_ISA_AVX2]) {
        build_avx2(&t_avx2, &t_ref);
        build_avx2_vnni(&t_avx2_vnni, &t_avx2);
        g_best = g_have_avxvnni ? &t_avx2_vnni : &t_avx2;
    }
    if (g_have[K3_ISA_AVX512]) {
        build_avx512(&t_avx512, &t_avx2, vnni, vbmi);
        g_best = &t_avx512;
        g_have_bf16 = g_have_bf16 && __builtin_cpu_supports("avx512vl");
        if (g_have_bf16) {
            build_avx512_bf16(&t_avx512_bf16, &t_avx512);
            g_best = &t_avx512_bf16;
        }
    }
    if (g_have[K3_ISA_AVX512] && vnni && g_have_bf16) {
        k3_error err = {0};
        g_have[K3_ISA_AMX] = k3_amx_init(&err) == K3_OK; /* the CPU has it and the tile state is granted */
        g_amx_built = g_have[K3_ISA_AMX] || k3_amx_emu_possible();
        if (g_amx_built) build_amx(&t_amx, &t_avx512_bf16, g_have[K3_ISA_AMX]);
        if (g_have[K3_ISA_AMX]) g_best = &t_amx;
    }
    atomic_store(&g_ops, g_best);
}

void k3_kernels_init(void) { pthread_once(&g_once, detect); }

const k3_kernel_ops *k3_ops(void) {
    const k3_kernel_ops *o = atomic_load_explicit(&g_ops, memory_order_acquire);
    if (!o) {
        k3_kernels_init();
        o = atomic_load(&g_ops);
    }
    return o;
}

/* The table of isa where the CPU has it (AVX2: with AVX-VNNI where it has
 * that; AVX-512: with the BF16 dot products where it has them), else NULL. */
static const k3_kernel_ops *table_of(k3_isa isa) {
    if ((int)isa < 0 || (int)isa >= K3_ISA_COUNT || !g_have[isa]) return NULL;
    switch (isa) {
    case K3_ISA_AMX: return &t_amx;
    case K3_ISA_AVX512: return g_have_bf16 ? &t_avx512_bf16 : &t_avx512;
    case K3_ISA_AVX2: return g_have_avxvnni ? &t_avx2_vnni : &t_avx2;
    default: return &t_ref;
    }
}

/* ---- choosing ------------------------------------------------------------------- */

k3_isa k3_kernels_isa(void) { return k3_ops()->isa; }

const char *k3_isa_name(k3_isa isa) {
    switch (isa) {
    case K3_ISA_REF: return "ref";
    case K3_ISA_AVX2: return "avx2";
    case K3_ISA_AVX512: return "avx512";
    case K3_ISA_AMX: return "amx";
    case K3_ISA_COUNT: break;
    }
    return "unknown";
}

void k3_kernels_force(k3_isa isa) {
    k3_kernels_init();
    k3_amx_emulate(false);
    const k3_kernel_ops *o = table_of(isa);
    atomic_store(&g_ops, o ? o : g_best);
}

bool k3_kernels_have(k3_isa isa) {
    k3_kernels_init();
    return (int)isa >= 0 && (int)isa < K3_ISA_COUNT && g_have[isa];
}

bool k3_kernels_force_amx_emulated(void) {
    k3_kernels_init();
    if (!g_amx_built || !k3_amx_emu_possible()) return false;
    k3_amx_emulate(true);
    atomic_store(&g_ops, &t_amx);
    return true;
}

bool k3_kernels_avxvnni(void) { return k3_ops() == &t_avx2_vnni; }

bool k3_kernels_bf16(void) { return k3_ops()->bf16; }

void k3_kernels_force_avxvnni(bool on) {
    const k3_kernel_ops *o = k3_ops();
    if (o == &t_avx2 || o == &t_avx2_vnni) atomic_store(&g_ops, on && g_have_avxvnni ? &t_avx2_vnni : &t_avx2);
}

k3_status k3_set_isa(const char *name, k3_error *err) {
    k3_kernels_init();
    k3_amx_emulate(false);
    if (!name || !strcmp(name, "best") || !*name) {
        atomic_store(&g_ops, g_best);
        return K3_OK;
    }
    /* ext: the table's extension (AVX2: AVX-VNNI; AVX-512: the BF16 dot
     * products): 0 the plain table, 1 the extension where the CPU has it, 2
     * required */
    static const struct {
        const char *name;
        k3_isa isa;
        int ext;
    } names[] = {
        {"ref", K3_ISA_REF, 0},
        {"avx2", K3_ISA_AVX2, 1},
        {"avx2-vnni", K3_ISA_AVX2, 2},
        {"avx2-novnni", K3_ISA_AVX2, 0},
        {"avx512", K3_ISA_AVX512, 1},
        {"avx512-bf16", K3_ISA_AVX512, 2},
        {"avx512-nobf16", K3_ISA_AVX512, 0},
        {"amx", K3_ISA_AMX, 0},
    };
    if (!strcmp(name, "amx") && !g_have[K3_ISA_AMX]) {
        k3_error why = {0};
        k3_amx_init(&why);
        return k3_err(err, K3_ERR_UNSUPPORTED, "kernel ISA 'amx' is not available: %s", why.msg);
    }
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(name, names[i].name)) continue;
        if (!g_have[names[i].isa])
            return k3_err(err, K3_ERR_UNSUPPORTED, "this CPU lacks the instructions of kernel ISA '%s'", name);
        if (names[i].ext == 2 && names[i].isa == K3_ISA_AVX2 && !g_have_avxvnni)
            return k3_err(err, K3_ERR_UNSUPPORTED, "this CPU lacks AVX-VNNI (kernel ISA '%s')", name);
        if (names[i].ext == 2 && names[i].isa == K3_ISA_AVX512 && !g_have_bf16)
            return k3_err(err, K3_ERR_UNSUPPORTED, "this CPU lacks AVX512_BF16 (kernel ISA '%s')", name);
        const k3_kernel_ops *o = table_of(names[i].isa);
        if (names[i].isa == K3_ISA_AVX2 && !names[i].ext) o = &t_avx2;
        if (names[i].isa == K3_ISA_AVX512 && !names[i].ext) o = &t_avx512;
        atomic_store(&g_ops, o);
        return K3_OK;
    }
    return k3_err(err, K3_ERR_ARG,
                  "unknown kernel ISA '%s' (ref, avx2, avx2-novnni, avx512, avx512-nobf16, amx or best)", name);
}

const char *k3_isa_current(void) { return k3_ops()->name; }

/* ---- the entry points ------------------------------------------------------------- */

/* o: the first table from the current one down its bases whose entry takes
 * the call (no fits(), or fits() says yes; "ref" has none). */
#define PICK(o, fits, ...) \
    for (o = k3_ops(); o->fits && !o->fits(__VA_ARGS__); o = o->base) {}

bool k3_moe_experts(k3_pool *pool, const k3_mat *gate, const k3_mat *up, const k3_mat *down, const int32_t *eact,
                    int32_t na, const int32_t *row0, const int32_t *rows, int32_t K, const float *z, int64_t ldz,
                    float *y, int64_t ldy, k3_glu_kind kind, float b1, float b2) {
    const k3_kernel_ops *o = k3_ops();
    if (!o->moe || na <= 0) return false;
    int64_t n = 0;
    for (int32_t a = 0; a < na; a++) n += row0[eact[a] + 1] - row0[eact[a]];
    if (!o->moe_fits(gate, up, down, eact, na, n)) return false;
    o->moe(pool, gate, up, down, eact, na, row0, rows, K, z, ldz, y, ldy, kind, b1, b2);
    return true;
}

float k3_dot(const float *a, const float *b, int64_t n) { return k3_ops()->dot(a, b, n); }

void k3_axpy(float *y, float a, const float *x, int64_t n) { k3_ops()->axpy(y, a, x, n); }

void k3_glu(float *f1, const float *f2, int64_t n, k3_glu_kind kind, float b1, float b2) {
    k3_ops()->glu(f1, f2, n, kind, b1, b2);
}

void k3_softmax(float *s, int64_t n, float scale) { k3_ops()->softmax(s, n, scale); }

float k3_quant_act_i8(const float *x, int64_t n, int8_t *q) { return k3_ops()->quant_act_i8(x, n, q); }

void k3_mx4_prep(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr) { k3_ops()->mx4_prep(xq, cols, xp, corr); }

void k3_mx4_r4_prep(const int8_t *xq, int64_t cols, int8_t *xp, int32_t *corr) {
    k3_ops()->mx4_r4_prep(xq, cols, xp, corr);
}

void k3_qli_scores(const int8_t *q8, const float *qs, const float *w, int HI, int dI, const int8_t *k8, const float *ks,
                   const int64_t *slots, int n, float *scores) {
    const k3_kernel_ops *o;
    PICK(o, qli_fits, HI, dI);
    o->qli_scores(q8, qs, w, HI, dI, k8, ks, slots, n, scores);
}

bool k3_qli_chunk_fits(int HI, int dI) {
    const k3_kernel_ops *o = k3_ops();
    return o->qli_chunk && o->qli_chunk_fits(HI, dI);
}

void k3_qli_chunk(k3_pool *pool, const int8_t *q8, const float *qs, const float *w, int64_t T, int HI, int dI,
                  const int8_t *k8, const float *ks, const int64_t *slots, int64_t n, float *scores, int64_t lds) {
    const k3_kernel_ops *o = k3_ops();
    K3_ASSERT(o->qli_chunk && o->qli_chunk_fits(HI, dI));
    o->qli_chunk(pool, q8, qs, w, T, HI, dI, k8, ks, slots, n, scores, lds);
}

void k3_qsfa(const float *qa, const float *qpe, int H, const k3_c8_cache *c, const int64_t *slots, int n, float scale,
             float *out, float *lse, float *work) {
    const k3_kernel_ops *o = k3_ops();
    if (c->bf16 && o->qsfa_bf && k3_qsfa_bf16_fits(c)) {
        o->qsfa_bf(qa, qpe, H, c, slots, n, scale, out, lse, work);
        return;
    }
    PICK(o, qsfa_fits, c);
    o->qsfa(qa, qpe, H, c, slots, n, scale, out, lse, work);
}

void k3_lse_merge(const float *const *o, const float *const *lse, int P, int H, int d, float *out, float *lse_out) {
    k3_ops()->lse_merge(o, lse, P, H, d, out, lse_out);
}

void k3_attnres_mix(const float *const *V, int n, const float *w, int64_t D, float eps, float *out) {
    k3_ops()->attnres_mix(V, n, w, D, eps, out);
}

void k3_kda_recurrent(const k3_kda_head *h, float *S) {
    const k3_kernel_ops *o;
    PICK(o, kda_recurrent_fits, h);
    o->kda_recurrent(h, S);
}

void k3_kda_chunked(const k3_kda_head *h, float *S, int chunk, float *work) {
    const k3_kernel_ops *o;
    PICK(o, kda_chunked_fits, h);
    o->kda_chunked(h, S, chunk, work);
}

bool k3_kda_recurrent_prefill(void) { return k3_ops()->kda_recurrent_prefill; }

bool k3_kda_bf_available(void) { return k3_ops()->kda_chunked_bf != NULL; }

int32_t k3_kda_bf_min(void) {
    const k3_kernel_ops *o = k3_ops();
    return o->kda_chunked_bf && o->kda_bf_min > 0 ? o->kda_bf_min : INT32_MAX;
}

bool k3_kda_chunked_bf(const k3_kda_head *h, float *S, int chunk, float *work) {
    const k3_kernel_ops *o = k3_ops();
    if (!o->kda_chunked_bf || !k3_kda_bf_fits(h) || chunk <= 0 || chunk % 32) return false;
    o->kda_chunked_bf(h, S, chunk, work);
    return true;
}
