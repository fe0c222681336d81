/*
 * ctx.h -- the mutable side of inference (struct k3_ctx of k3.h).
 *
 * A context owns, for up to max_seqs sequences:
 *   - KDA state per KDA layer and sequence: S [H, dk, dv] and the conv windows
 *     [3 (q,k,v), K-1, H*dk] (the K-1 previous pre-conv inputs, oldest first);
 *   - a pool of fixed-size cache blocks shared by all sequences. One block id
 *     names the same token slots in every MLA/DSA layer: the latent cache
 *     [n_blocks*bs, kv_lora + rope] and, for DSA layers, the indexer key cache
 *     [n_blocks*bs, dI]. Each sequence has a block table (logical block ->
 *     block id), so prefix sharing and paging need no change of layout;
 *   - the scratch of one forward pass of up to max_batch tokens, allocated
 *     once here (the buffers of the DCP and EP exchanges too): the token
 *     loop allocates nothing.
 * The arena is ctx.c; the forward pass (src/forward) and the layers
 * (src/layers) read and write it; the executor (src/executor) mirrors the
 * calls that change it to the other ranks. Nothing here sends anything.
 */
#ifndef K3_CTX_CTX_H
#define K3_CTX_CTX_H

#include "k3.h"
#include "comm/comm.h"
#include "common/error.h"
#include "model/model.h"

/* Prefill pieces (a span cut on the block grid) of at least
 * K3_KDA_CHUNK_MIN tokens use the chunked KDA form with chunks of
 * K3_KDA_CHUNK, on CPUs without AVX-512. Measured (one
 * head, dk = dv = 128, 512 tokens, one thread): AVX2 chunked-16 0.8 ms,
 * AVX2 recurrent 0.9 ms, AVX-512 recurrent 0.75 ms -- so with AVX-512 the
 * recurrent form runs prefill too, which also makes prefill bit-identical to
 * token-by-token decode. */
#define K3_KDA_CHUNK_MIN 64
#define K3_KDA_CHUNK 16

/* Prefill pieces of at least kda_bf_min tokens (k3_kda_bf_min(), kda.h,
 * where k3_ctx_options.kda_bf16_prefill asks; none by default) use KDA's BF16 chunked form (chunks of K3_KDA_CHUNK_BF)
 * where the model runs the BF16 dot products; decode, the speculative
 * verify and the exact fp32 paths keep the forms above. */

/* Attention of a row over many cached keys is split into parts of at least
 * 256 keys, at most K3_ATTN_PARTS_MAX and 2 per thread, merged by
 * log-sum-exp (src/layers/mla.c). The parts depend on the row alone (its
 * keys and the thread count), never on the other rows of the round, so a
 * row computes the same bits in a decode step, a verify chunk or a prefill. */
#define K3_ATTN_PARTS_MAX 64

/* The most indexer scores a prefill chunk holds at once (16 MiB of them):
 * its rows are scored together in blocks of at most this many (layers/mla.c). */
#define K3_QLI_CHUNK_SCORES ((int64_t)1 << 22)
#define K3_ATTN_PART_KEYS 256

typedef struct k3_seq {
    int64_t pos;      /* tokens consumed */
    int32_t *blocks;  /* block table [max_blocks_per_seq] */
    int32_t n_blocks; /* blocks in use */
} k3_seq;

/* A contiguous run of one sequence's tokens inside a forward round. */
typedef struct k3_span {
    int32_t seq;
    int32_t t0, n; /* rows [t0, t0+n) of the round */
    int64_t pos0;  /* position of the first of them */
} k3_span;

typedef struct k3_scratch {
    float *P, *X, *xn, *tmp; /* [T, D] */
    float *bank;             /* [n_bank, T, D] */
    /* KDA */
    float *kq, *kk, *kv, *kg, *kz; /* [T, H*dk] (kv: [T, H*dv]) */
    float *kfa;                    /* [T, dk] (and low-rank gate) */
    float *kbeta;                  /* [T, H] */
    float *ko;                     /* [T, H*dv] */
    /* MLA */
    float *cq;                /* [T, q_lora] */
    float *fused;             /* [T, mla_down rows] MLAPO's fused projection */
    float *mq;                /* [T, H*(nope+rope)] */
    float *ckv;               /* [T, kv_lora+rope] */
    float *qn, *qa, *chat;    /* [H, T, nope], [H, T, kv_lora] x2 */
    float *mo, *mgate, *mtmp; /* [T, H*v], [T, H*v], [H, T, v] */
    /* DSA */
    float *iq, *ik, *iw;      /* [T, HI*dI], [T, dI], [T, HI] */
    int8_t *iq8;              /* [T, HI*dI] C8 indexer queries */
    float *iqs;               /* [T, HI] their scales */
    int64_t *isel;            /* [T, topk] selected cache slots */
    int32_t *icount;          /* [T] */
    float *iscore;            /* [iscore_n] a chunk's indexer scores (C8, T > 1; else NULL) */
    int64_t iscore_n;         /* min(T max_ctx, K3_QLI_CHUNK_SCORES), >= max_ctx */
    int64_t *islots;          /* [max_ctx] their slots */
    float *part_o, *part_l;   /* split-KV partials [n_parts + nth, H, kv_lora], [n_parts, H]: a wave's
                               parts, then one row of scratch per thread */
    int32_t n_parts;          /* parts of one wave of attention rows (K3_ATTN_PARTS_MAX at least) */
    int32_t *rparts, *rfirst; /* [T] a row's parts and its first part in the wave */
    int32_t *prow;            /* [n_parts] a part's row */
    /* FFN / MoE */
    float *f1, *f2;                         /* [T, max(I, n_shared*Im, Im)] */
    float *rlog;                            /* [T, E] */
    int32_t *rids;                          /* [T, k] */
    float *rw;                              /* [T, k] */
    float *lat, *lout;                      /* [T, Dl] each: latent inputs, combined outputs */
    float *ly;                              /* [T, k, Dl] */
    int32_t *erows;                         /* [T*k] token*k+slot rows per expert */
    int32_t *ecount;                        /* [E+1] */
    int32_t *eact;                          /* [E] experts with rows this round */
    float **tgather, **tf1, **tf2, **tlout; /* [nth][T*Dl], [nth][T*Im] x2, [nth][T*Dl] */
    /* per thread: attention scores, slot lists, top-k work */
    float **tscore;          /* [nth][max_ctx] */
    int64_t **tslots;        /* [nth][max_ctx] */
    int32_t **tsel, **twork; /* [nth][max_ctx] */
    float **tkda;            /* [nth][kda chunk work] */
    float **tq;              /* [nth][H*(kv_lora+rope)] one token's absorbed query */
    float **tqsfa;           /* [nth][k3_qsfa_work] */
    float *rwork;            /* [E] router work (single-threaded) */
} k3_scratch;

/* The buffers of the exchanges with other ranks (sized for max_batch rows;
 * NULL with one process): the DCP form of the MLA/DSA layer
 * (src/layers/mla_dcp.c) and the EP form of the MoE layer (moe_ep.c). */
typedef struct k3_exchange_scratch {
    /* DCP */
    k3_cand *cand, *cand_out, *cand_work; /* [T*k], [T*k], [T*k*max(D,2)] */
    int32_t *xrow;                        /* [T] row -> exchanged row, or -1 */
    int64_t *wslots;                      /* [T*k] own winners' slots */
    int32_t *wcount;                      /* [T] */
    float *att, *att_all;                 /* [T*(H*kvl+H)], [D*T*(H*kvl+H)] */
    float *att_send, *att_mine;           /* head-split merge: [T*(H*kvl+H)], [T*(H/D)*kvl] */
    /* EP */
    float *zr;              /* [T, Dl] the latents the own experts read */
    float *sendb, *recvb;   /* [T*K*Dl] each */
    int *sc, *sd, *rc, *rd; /* [E] byte counts and displacements */
} k3_exchange_scratch;

/* A KDA state to copy (k3_ctx_state_save's layout) once sequence seq has
 * consumed pos tokens, inside a forward pass. */
typedef struct k3_capture {
    int32_t seq;
    int64_t pos;
    void *dst;
} k3_capture;

/* A slot whose next run is a verify chunk (k3_ctx_spec_begin). */
typedef struct k3_spec_slot {
    bool on;      /* the next run of this slot verifies n positions */
    int32_t n;    /* positions of the chunk */
    int32_t mode; /* K3_SPEC_REAPPLY or K3_SPEC_STATES */
    int64_t pos0; /* the slot's position before the chunk */
    float *buf;   /* what the accept needs, k3_ctx_spec_bytes(n, mode) */
    int64_t cap;  /* floats allocated */
} k3_spec_slot;

struct k3_ctx {
    const k3_model *m;
    const k3_config *c;
    k3_pool *pool;
    int nth;

    int32_t max_seqs, block_size, max_batch;
    int32_t lbs;                   /* slots of one block on this rank: block_size / dcp */
    int64_t cache_tokens, max_ctx; /* cache capacity in tokens over all sequences; max_ctx: longest sequence */
    int32_t n_blocks, max_blocks_per_seq;
    /* the default block manager of k3_ctx_forward (NULL when an engine owns
     * the blocks: k3_ctx_init_pool) */
    int32_t *free_blocks, n_free;

    k3_seq *seqs;
    float **kda_S;         /* [n_layers] -> [max_seqs, H, dk, dv] (NULL if not KDA) */
    float **kda_conv;      /* [n_layers] -> [max_seqs, 3, K-1, H*dk] */
    k3_kv_type kv;         /* cache format */
    bool dense;            /* DSA layers run as dense MLA */
    int32_t kda_chunk_min; /* pieces this long use the chunked KDA form */
    int32_t kda_bf_min;    /* pieces this long use its BF16 form (k3_kda_chunked_bf) */
    int64_t *kda_snap_off; /* [n_layers] a KDA layer's offset in a state copy (floats) */
    k3_capture *caps;      /* KDA states to capture in the next k3_ctx_run */
    int32_t n_caps, cap_caps;
    int32_t *kda_ord;   /* [n_layers] a KDA layer's place among the KDA layers */
    k3_spec_slot *spec; /* [max_seqs] verify chunks (k3_ctx_spec_begin), NULL until the first */
    float **tspec;      /* [nth] a head's state and windows while it verifies */
    float **lat_cache;  /* F32: [n_layers] -> [n_blocks*bs, kv_lora+rope] */
    float **idx_cache;  /* F32: [n_layers] -> [n_blocks*bs, dI] (DSA) */
    int32_t n_tiles;    /* C8 scale tiles per latent row */
    int8_t **lat8;      /* C8: [n_layers] -> [slots, kv_lora] */
    float **lat_s;      /* C8: [n_layers] -> [slots, n_tiles] */
    float **lat_r;      /* C8: [n_layers] -> [slots, rope] */
    int8_t **idx8;      /* C8: [n_layers] -> [slots, dI] */
    float **idx_s;      /* C8: [n_layers] -> [slots] */

    bool prof_on;               /* k3_ctx_profile_enable */
    double prof[K3_PROF_COUNT]; /* seconds per operator */
    int64_t prof_moe[3];        /* routed-expert calls, experts read, rows (k3_profile) */

    int32_t n_bank_max;
    int64_t ff_width;
    k3_scratch s;

    /* the current round (set by the driver, read by the layers) */
    k3_span *spans;             /* [max_batch] */
    int32_t *round_tokens;      /* [max_batch] token ids of the round */
    int32_t *round_out;         /* [max_batch] rows whose logits are wanted */
    const float **round_embeds; /* [max_batch] rows replacing the embedding, NULL = the table (vision) */
    int32_t n_spans;
    int32_t T;

    /* several ranks (k3_ctx_options.dist, the transport of the layers' DCP
     * and EP forms); one process: dist NULL, dcp = ep = 1 */
    struct k3_dist *dist;
    int32_t dcp, dcp_rank, dcp_il; /* DCP group size, this rank, interleave */
    int32_t ep, ep_rank;           /* EP group size, this rank */
    k3_exchange_scratch *xs;       /* their exchange buffers */
};

/* ---- the owner's side (an engine: src/engine/engine.c) ----------------
 * A context made by k3_ctx_init_pool holds cache storage for n_blocks blocks
 * and max_seqs sequence slots but hands out no blocks: its owner keeps the
 * block tables (src/kv), sets a slot's table and position before a forward
 * pass and saves/restores its KDA state for prefix-cache snapshots. The
 * forward pass only computes. */
k3_status k3_ctx_init_pool(k3_ctx **out, const k3_model *m, const k3_ctx_options *opt, int32_t n_blocks,
                           int64_t max_ctx, k3_error *err);
/* Copies n block ids into slot seq's table (ids checked). */
k3_status k3_ctx_seq_set_blocks(k3_ctx *ctx, int32_t seq, const int32_t *blocks, int32_t n, k3_error *err);
void k3_ctx_seq_set_pos(k3_ctx *ctx, int32_t seq, int64_t pos);
/* Zeroes slot seq's KDA recurrent and conv state. */
void k3_ctx_seq_clear_state(k3_ctx *ctx, int32_t seq);
/* Bytes of one slot's KDA state (every KDA layer's S and conv windows). */
int64_t k3_ctx_state_bytes(const k3_ctx *ctx);
void k3_ctx_state_save(const k3_ctx *ctx, int32_t seq, void *dst);
void k3_ctx_state_restore(k3_ctx *ctx, int32_t seq, const void *src);
/* Asks the next k3_ctx_run (src/forward) to copy slot seq's KDA state into dst (state
 * bytes) at the moment it has consumed pos tokens, pos inside the tokens the
 * run gives it: a snapshot in the middle of a chunk. The KDA layers process
 * a span in pieces that end on the block grid, so a capture on the grid
 * costs a copy and changes no result. Captures are forgotten after the run
 * (taken or not: the run failed). This rank only: under mpirun the other
 * ranks compute the same state and keep no snapshots. */
k3_status k3_ctx_capture_state(k3_ctx *ctx, int32_t seq, int64_t pos, void *dst, k3_error *err);
/* Forgets the captures asked for the next run, as every run does at its
 * end (for a run that is not made after all). */
void k3_ctx_forget_captures(k3_ctx *ctx);

/* ---- verifying drafts (speculative decoding, src/spec) -------------------
 * A verify chunk is the last accepted token and k draft tokens of one
 * sequence, run as a short prefill chunk; the caller then keeps the first
 * n_keep of its positions. The MLA/DSA caches need nothing: a rejected
 * position's rows are never read (attention stops at a row's own position)
 * and the next token written there overwrites them. The KDA layers do: their
 * state must be the state after the last kept position. k3_ctx_spec_begin
 * marks slot seq, so that in the next k3_ctx_run its n positions run the
 * KDA recurrence and short convs on a copy of the slot's state (the slot's
 * own state is not touched) and keep, per position, what the accept needs;
 * k3_ctx_spec_accept then brings the slot's state to the one after n_keep
 * positions and its position to pos0 + n_keep. Two ways to keep it
 * (measured in docs/spec.md):
 *   K3_SPEC_REAPPLY  per position and KDA layer, the pre-conv q, k, v rows
 *                    and each head's k, v, decay gate and beta: the accept
 *                    re-applies the recurrence over the kept positions (the
 *                    same kernel, the same inputs: the same bits as a pass
 *                    that never saw the rejected ones), 6·H·dk + H floats per
 *                    position and layer;
 *   K3_SPEC_STATES   every head's state and the windows after each position:
 *                    the accept copies one; a whole KDA state per position.
 * The chunk must be one entry of the run, of exactly n tokens, and is never
 * cut over two rounds; snapshots are not captured inside it. A reset, clear,
 * restore or new begin of the slot forgets the mark. */
enum { K3_SPEC_REAPPLY = 0, K3_SPEC_STATES = 1 };
#define K3_CTX_SPEC_MAX 32 /* positions of one verify chunk at most */
/* Bytes the context keeps per slot for a chunk of n positions in mode. */
int64_t k3_ctx_spec_bytes(const k3_ctx *ctx, int32_t n, int32_t mode);
k3_status k3_ctx_spec_begin(k3_ctx *ctx, int32_t seq, int32_t n, int32_t mode, k3_error *err);
k3_status k3_ctx_spec_accept(k3_ctx *ctx, int32_t seq, int32_t n_keep, k3_error *err);
/* Inside the context: forgets slot seq's mark (its state is being replaced),
 * frees what the marks keep (k3_ctx_free). */
void k3_spec_forget(k3_ctx *ctx, int32_t seq);
void k3_spec_slots_free(k3_ctx *ctx);
/* Whether round span sp belongs to a slot marked for a verify chunk. */
static inline bool k3_spec_on(const k3_ctx *ctx, int32_t seq) { return ctx->spec && ctx->spec[seq].on; }
/* The layout of what a verify chunk keeps: per KDA layer (by kda_ord) its n
 * positions, each k3_spec_pos_floats floats: REAPPLY the pre-conv rows [3,
 * H*dk] (q, k, v), then per head k [dk], v [dk], g [dk], beta; STATES per
 * head S [dk, dk], then the windows [3, K-1, H*dk] (state_save's layout of
 * one layer). */
static inline int64_t k3_spec_pos_floats(const k3_config *c, int32_t mode) {
    const int64_t H = c->kda_heads, dk = c->kda_head_dim, Km1 = c->conv_size > 0 ? c->conv_size - 1 : 0;
    return mode == K3_SPEC_STATES ? H * dk * dk + 3 * Km1 * H * dk : 6 * H * dk + H;
}
static inline float *k3_spec_at(const k3_ctx *ctx, int32_t seq, int layer, int32_t r) {
    const k3_spec_slot *sp = &ctx->spec[seq];
    return sp->buf + ((int64_t)ctx->kda_ord[layer] * sp->n + r) * k3_spec_pos_floats(ctx->c, sp->mode);
}

/* ---- moving a sequence's cache between instances (src/pd) ---------------
 * The transfer layout of n tokens of one MLA/DSA layer, component after
 * component, each token-major: f32: the latent + rope rows [n, kv_lora +
 * rope] f32 (+ DSA: the indexer keys [n, dI] f32); C8: the int8 latent [n,
 * kv_lora], its tile scales [n, tiles] f32, the rope part [n, rope] f32 (+
 * DSA: the int8 indexer keys [n, dI] and their scales [n] f32). Summed over
 * the layers a token is k3_config_cache_bytes_per_token bytes. Positions are
 * those of a block-table slice: blocks[0] holds positions [0, bs), and t0, n
 * are positions in it (so a slice may start anywhere on the block grid; the
 * DCP owner of a position depends only on its place in its block). */
/* Bytes of n tokens of layer `layer` in the transfer layout (0 for a KDA
 * layer or a layer out of range). */
int64_t k3_ctx_kv_bytes(const k3_ctx *ctx, int32_t layer, int64_t n);
/* Copies positions [t0, t0 + n) of layer `layer` of the block-table slice
 * blocks[0..n_blocks) into dst (k3_ctx_kv_bytes(n) bytes); under DCP only
 * the positions this rank caches are written (the others are left as they
 * are). Reads only: safe beside a forward pass that does not write those
 * blocks. */
k3_status k3_ctx_kv_read(const k3_ctx *ctx, const int32_t *blocks, int32_t n_blocks, int32_t layer, int64_t t0,
                         int64_t n, void *dst, k3_error *err);
/* The reverse: the rows of src into the cache (under DCP only the positions
 * this rank caches, so one message re-shards a sequence by token owner). */
k3_status k3_ctx_kv_write(k3_ctx *ctx, const int32_t *blocks, int32_t n_blocks, int32_t layer, int64_t t0, int32_t n,
                          const void *src, k3_error *err);
/* k3_ctx_kv_read on every DCP rank, assembled on DCP rank 0 (a collective
 * of the DCP group: each rank's rows travel to rank 0, which keeps each
 * position from its owner); with one rank, k3_ctx_kv_read. */
k3_status k3_ctx_kv_gather(k3_ctx *ctx, const int32_t *blocks, int32_t n_blocks, int32_t layer, int64_t t0, int32_t n,
                           void *dst, k3_error *err);
/* What k3_ctx_kv_gather checks before it exchanges anything. */
k3_status k3_ctx_kv_gather_check(const k3_ctx *ctx, const int32_t *blocks, int32_t n_blocks, int32_t layer, int64_t t0,
                                 int32_t n, const void *dst, k3_error *err);

/* The bytes of block id `block` of layer `layer` on this rank, one range
 * per array of the transfer layout's order (the block's lbs slots are
 * consecutive in each array): what a disk tier reads and writes in place
 * (src/kvstore). Returns how many ranges (0 for a KDA layer, a layer or a
 * block out of range). */
int k3_ctx_kv_block_ranges(k3_ctx *ctx, int32_t layer, int32_t block, void *base[5], int64_t len[5]);

/* Profiling: PROF(ctx, op, statement) adds the statement's time to op. */
#define PROF(ctx, op, stmt) \
    do { \
        const double prof_t0_ = (ctx)->prof_on ? k3_now() : 0.0; \
        stmt; \
        if ((ctx)->prof_on) (ctx)->prof[op] += k3_now() - prof_t0_; \
    } while (0)

/* Blocks a sequence needs once it holds end tokens (global blocks of
 * block_size positions, under DCP too). */
static inline int64_t k3_ctx_blocks_for(const k3_ctx *ctx, int64_t end) {
    return (end + ctx->block_size - 1) / ctx->block_size;
}

/* Slot of position pos of sequence seq in the cache. */
static inline int64_t k3_ctx_slot(const k3_ctx *ctx, int32_t seq, int64_t pos) {
    const k3_seq *s = &ctx->seqs[seq];
    return (int64_t)s->blocks[pos / ctx->block_size] * ctx->block_size + pos % ctx->block_size;
}

/* Slot of this rank's local index j of sequence seq: under DCP global block
 * B of a sequence holds, on each rank, its local indices [B*lbs, (B+1)*lbs)
 * (block_size is a multiple of D*I), in the rank's block of lbs slots with
 * the same id; one process: lbs = block_size and j = pos. */
static inline int64_t k3_ctx_local_slot(const k3_ctx *ctx, int32_t seq, int64_t j) {
    const k3_seq *s = &ctx->seqs[seq];
    return (int64_t)s->blocks[j / ctx->lbs] * ctx->lbs + j % ctx->lbs;
}

/* ---- the DCP layout (docs/serving-reference.md §2.5.1) ---------------------------------------
 * Token x of a sequence lives on DCP rank (x div I) mod D of D, at local
 * index (x div (I*D))*I + x mod I; with bs a multiple of I,
 * ((x mod (bs*D)) div I) mod D == (x div I) mod D. */
static inline int32_t k3_dcp_owner(int64_t x, int32_t D, int32_t I) { return (int32_t)((x / I) % D); }
/* local index of token x on its owner */
static inline int64_t k3_dcp_local(int64_t x, int32_t D, int32_t I) { return x / ((int64_t)I * D) * I + x % I; }
/* global position of local index j on rank r */
static inline int64_t k3_dcp_global(int64_t j, int32_t r, int32_t D, int32_t I) {
    return ((j / I) * D + r) * I + j % I;
}
/* tokens among [0, n) that rank r owns: its local indices [0, count) */
static inline int64_t k3_dcp_count(int64_t n, int32_t r, int32_t D, int32_t I) {
    const int64_t stripe = (int64_t)I * D, rem = n % stripe - (int64_t)r * I;
    return n / stripe * I + (rem < 0 ? 0 : rem > I ? I : rem);
}
/* Tokens among a sequence's first n that this rank caches. */
static inline int64_t k3_ctx_local_tokens(const k3_ctx *ctx, int64_t n) {
    return ctx->dcp > 1 ? k3_dcp_count(n, ctx->dcp_rank, ctx->dcp, ctx->dcp_il) : n;
}

/* Slot of position pos of sequence seq on this rank, or -1 when another DCP
 * rank caches it (k3_dcp_owner, k3_dcp_local). With o = x mod bs that is
 * blocks[x div bs]*(bs/D) + (o div (I*D))*I + o mod I: the engine's global
 * block tables index every rank's cache unchanged. */
static inline int64_t k3_ctx_own_slot(const k3_ctx *ctx, int32_t seq, int64_t pos) {
    if (ctx->dcp > 1) {
        const int64_t I = ctx->dcp_il, bs = ctx->block_size, o = pos % bs;
        if ((pos / I) % ctx->dcp != ctx->dcp_rank) return -1;
        return (int64_t)ctx->seqs[seq].blocks[pos / bs] * ctx->lbs + o / (I * ctx->dcp) * I + o % I;
    }
    return k3_ctx_slot(ctx, seq, pos);
}

#endif /* K3_CTX_CTX_H */
