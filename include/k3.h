/*
 * k3.h -- the one public header of k3, an inference engine for Kimi K3 / K3.1.
 *
 * The boundary: programs (cli/, later the server) see a loaded model
 * (k3_model, read-only, shared), a tokenizer (k3_tokenizer, read-only), and a
 * context (k3_ctx) that owns every mutable thing of a set of sequences: KDA
 * recurrent and conv state, the paged MLA latent cache and the DSA indexer key
 * cache, and the scratch memory of a forward pass. Nothing here exposes a
 * tensor layout.
 *
 * Errors: every fallible call returns k3_status and, when given a k3_error,
 * writes one sentence naming the problem. The library never prints, never
 * exits and never reads the environment.
 *
 * Ownership: pointers returned by an _open or _init call are freed by the
 * matching _close or _free. Buffers marked "caller frees" are released with free().
 */
#ifndef K3_H
#define K3_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status and errors ------------------------------------------------ */

typedef enum k3_status {
    K3_OK = 0,
    K3_ERR_NOMEM,       /* an allocation failed */
    K3_ERR_IO,          /* a file is missing or unreadable */
    K3_ERR_FORMAT,      /* a file is malformed (JSON, safetensors, tokenizer) */
    K3_ERR_SHAPE,       /* a tensor has the wrong dtype or shape */
    K3_ERR_UNSUPPORTED, /* valid input that k3 does not implement */
    K3_ERR_ARG,         /* a bad argument: id out of range, bad UTF-8, ... */
    K3_ERR_RANGE,       /* out of capacity: context full, too many sequences */
    K3_ERR_BUSY,        /* try again later: the engine's waiting queue is full */
    K3_ERR_PERM,        /* refused: the peer or request is not one that may do this */
} k3_status;

typedef struct k3_error {
    k3_status status;
    char msg[512];
} k3_error;

/* A static string naming the status ("format error", ...). */
const char *k3_status_str(k3_status s);

/* ---- threads ---------------------------------------------------------- */

typedef struct k3_pool k3_pool;

/* A persistent pool of n_threads workers (the caller counts as one). */
k3_status k3_pool_init(k3_pool **out, int n_threads, k3_error *err);
void k3_pool_free(k3_pool *pool);
int k3_pool_size(const k3_pool *pool);

/* ---- kernel ISA ------------------------------------------------------ */

/* Picks the kernels every later call runs: "ref" (scalar), "avx2" (AVX2 +
 * FMA + F16C, with AVX-VNNI for the integer dot products where the CPU has
 * it), "avx2-vnni" (the same, refused without AVX-VNNI), "avx2-novnni" (the
 * same without AVX-VNNI), "avx512", "amx" (AVX-512 with the prefill and
 * batch GEMMs on the AMX tile unit: only where the CPU has it and the kernel
 * grants the tile state), or "best" / NULL (the best the CPU has, the
 * default). Call it before k3_model_quantize and
 * k3_model_load_resident: the resident layout of the 8-bit weights depends on
 * the ISA (the W4A8 4-row tiles are made only for a table with a tile
 * kernel: AVX2 and AVX-512 VNNI), and contexts choose
 * their KDA form when made. K3_ERR_ARG for an unknown name,
 * K3_ERR_UNSUPPORTED for an ISA this CPU lacks. Not thread safe with
 * running forward passes. */
k3_status k3_set_isa(const char *name, k3_error *err);
/* The ISA running now: "ref", "avx2", "avx2-vnni" (AVX2 with AVX-VNNI), "avx512" or "amx". */
const char *k3_isa_current(void);

/* ---- model ------------------------------------------------------------ */

typedef struct k3_model k3_model;

typedef struct k3_model_info {
    const char *model_type; /* "kimi_k3" or "kimi_linear"; borrowed */
    int64_t vocab_size;
    int64_t hidden_size;
    int32_t n_layers;
    int32_t n_kda, n_mla, n_dsa; /* layer counts by attention kind */
    int64_t max_positions;
    int64_t n_params;              /* all parameters of the text model */
    int64_t n_params_active;       /* parameters used per token (top-k experts) */
    int64_t weight_bytes;          /* bytes of all text weights as stored */
    int64_t bytes_per_token;       /* weight bytes read to decode one token */
    int64_t cache_bytes_per_token; /* MLA latent + indexer keys, all layers */
    int64_t state_bytes_per_seq;   /* KDA recurrent + conv state */
    int32_t n_experts;             /* routed experts per MoE layer (0: none) */
    int32_t n_experts_per_tok;     /* routed experts each token picks per layer */
    int32_t n_moe_layers;          /* layers with routed experts */
    int64_t expert_bytes;          /* one routed expert of one layer (gate, up, down), as stored */
} k3_model_info;

/* Opens a checkpoint directory (config.json + safetensors). Weights are
 * memory-mapped; every tensor is checked against the config here. */
k3_status k3_model_open(k3_model **out, const char *dir, k3_error *err);
void k3_model_close(k3_model *m);
void k3_model_get_info(const k3_model *m, k3_model_info *info);

/* Load-time quantization (docs/serving-reference.md §5). Matrices are converted once into
 * memory the model owns; activations are quantized per token at run time. */
typedef enum k3_wquant {
    K3_WQ_NONE = 0, /* as stored (BF16 trunk): the reference */
    K3_WQ_INT8,     /* W8A8 INT8: int8 per output channel, int8 activations per token */
    K3_WQ_MXFP8,    /* W8A8 MXFP8: E4M3 + E8M0 per 32, MXFP8 activations */
} k3_wquant;

typedef struct k3_quant_options {
    k3_wquant linear; /* attention linears, dense FFN, shared experts, latent MoE projections */
    bool experts_a8;  /* W4A8: MXFP4 routed experts with int8 activations */
    bool f32;         /* the weights as stored, fp32 activations everywhere: the reference. Otherwise,
                         where the kernels have BF16 dot products (AVX512_BF16, AMX), the BF16 and
                         MXFP4 matrices but the routers take them: activations rounded to BF16 */
} k3_quant_options;

/* Parses "none", "f32", "w8a8", "w8a8-mxfp8", "w4a8" or a '+'-joined
 * combination ("w8a8+w4a8"). */
k3_status k3_quant_parse(const char *s, k3_quant_options *out, k3_error *err);
/* Converts the model's weights; call once, right after k3_model_open. */
k3_status k3_model_quantize(k3_model *m, const k3_quant_options *opt, k3_error *err);

/* Copies the weights the forward pass streams (all but the embedding table,
 * which is read a row per token) out of the file mapping into memory the
 * model owns, in transparent huge pages where the kernel gives them (small
 * matrices in order in shared chunks, so each expert's matrices follow one
 * another): the same weights, read without a page-table walk every 4 KB;
 * routed experts that run W4A8 on AVX-512 VNNI are rearranged into 4-row
 * tiles (K3_W_MXFP4_R4). Call after k3_model_quantize (what it converted is
 * owned already). Costs their size in RAM: when that would exceed max_bytes
 * (> 0), nothing is copied.
 * *copied gets the bytes copied. */
k3_status k3_model_load_resident(k3_model *m, int64_t max_bytes, int64_t *copied, k3_error *err);

/* A 64-bit name of the checkpoint: its config.json and every safetensors
 * header hashed, so instances that hand caches to one another can tell they
 * run the same model (nonzero). */
uint64_t k3_model_identity(const k3_model *m);

/* Writes a human-readable description (config, layer map, parameter and
 * cache sizes) into buf. Returns the length it wanted (snprintf rules). */
size_t k3_model_describe(const k3_model *m, char *buf, size_t size);

/* ---- model: checks ----------------------------------------------- */
/* Checks that every stored float of the checkpoint is finite (no NaN or
 * Inf; MXFP4 scales not the NaN byte): K3_ERR_FORMAT naming the tensor and
 * the element otherwise. One pass over the mapped files (0.3 s for 1.9 GB
 * from the page cache): `k3 info` and the CLI's model loading run it
 * (`--no-check-tensors` skips it). *n_checked (may be NULL) gets the tensor count. */
k3_status k3_model_check_tensors(const k3_model *m, int64_t *n_checked, k3_error *err);

/* ---- tokenizer -------------------------------------------------------- */

typedef struct k3_tokenizer k3_tokenizer;

typedef enum k3_pattern {
    K3_PATTERN_KIMI = 0, /* Kimi's split regex (o200k + a leading Han rule) */
    K3_PATTERN_O200K,
    K3_PATTERN_CL100K,
} k3_pattern;

/* Opens DIR/tiktoken.model with the Kimi pattern and the specials of
 * DIR/tokenizer_config.json (added_tokens_decoder). */
k3_status k3_tokenizer_open(k3_tokenizer **out, const char *dir, k3_error *err);
/* Opens a bare .tiktoken rank file with a named pattern and no specials. */
k3_status k3_tokenizer_open_file(k3_tokenizer **out, const char *path, k3_pattern pattern, k3_error *err);
void k3_tokenizer_free(k3_tokenizer *t);

/* Number of ids (ranks + specials). */
int32_t k3_tokenizer_n_vocab(const k3_tokenizer *t);
/* Id of a special token by name ("<|end_of_msg|>"), or -1. */
int32_t k3_tokenizer_special(const k3_tokenizer *t, const char *name);
/* The ids that end a generation: [EOS] (the end of a text) and
 * <|end_of_msg|> (the end of a chat turn), those of them the tokenizer has,
 * in that order. Returns how many were written. */
#define K3_MAX_EOS_IDS 2
int32_t k3_tokenizer_eos_ids(const k3_tokenizer *t, int32_t out[K3_MAX_EOS_IDS]);
/* Whether id is one of k3_tokenizer_eos_ids. */
bool k3_tokenizer_is_eos(const k3_tokenizer *t, int32_t id);
/* True for special (added) ids. */
bool k3_tokenizer_is_special(const k3_tokenizer *t, int32_t id);

/* Encodes UTF-8 text as ordinary text (specials are not parsed). Rejects
 * invalid UTF-8 with K3_ERR_ARG. *ids is caller-freed. */
k3_status k3_tokenizer_encode(const k3_tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n_ids,
                              k3_error *err);
/* Decodes ids to bytes (specials as their names). *out is caller-freed and
 * NUL-terminated; *len excludes the NUL. Rejects ids out of range. */
k3_status k3_tokenizer_decode(const k3_tokenizer *t, const int32_t *ids, size_t n_ids, char **out, size_t *len,
                              k3_error *err);
/* Bytes of one id (borrowed), or NULL when out of range. */
const char *k3_tokenizer_token(const k3_tokenizer *t, int32_t id, size_t *len);

typedef struct k3_chat_msg {
    const char *role; /* "system", "user", "assistant" */
    const char *content;
    const char *reasoning; /* assistant thinking, may be NULL */
} k3_chat_msg;

/* Encodes a conversation in the K3 chat format (docs/model.md §5).
 * With add_generation_prompt the assistant turn is opened: with thinking on,
 * up to <|open|>think<|sep|>; off, up to <|open|>response<|sep|>.
 * *ids is caller-freed. */
k3_status k3_chat_encode(const k3_tokenizer *t, const k3_chat_msg *msgs, size_t n_msgs, bool add_generation_prompt,
                         bool thinking, int32_t **ids, size_t *n_ids, k3_error *err);

/* The OpenAI-shaped form of the K3 chat encoder (encoding_k3.py), for the
 * server: messages_json is a JSON array of {role, content (a string or a
 * list of {type:"text",text} parts), name?, reasoning_content?, tool_calls?,
 * tool_call_id?}; roles system, user, assistant, tool. tools_json is NULL or
 * a JSON array of OpenAI tool definitions, declared the K3 way. Malformed
 * JSON, unknown roles and unresolvable tool names are K3_ERR_ARG with a
 * message naming the message index. *ids is caller-freed. */
typedef struct k3_chat_options {
    bool add_generation_prompt;
    bool thinking;               /* open the think channel (K3's default) */
    const char *thinking_effort; /* NULL, "low", "high" or "max" */
    const char *tool_choice;     /* NULL or "auto", "required", "none" */
    const char *response_format; /* NULL or a JSON object {type, json_schema?} */
} k3_chat_options;

k3_status k3_chat_encode_json(const k3_tokenizer *t, const char *messages_json, const char *tools_json,
                              const k3_chat_options *opt, int32_t **ids, size_t *n_ids, k3_error *err);

/* An assistant turn parsed back: text is what the model generated after the
 * generation prompt, decoded with specials as their names (thinking: it
 * starts inside the think channel). Each field is NULL when absent;
 * tool_calls_json is an OpenAI tool_calls array whose arguments are JSON
 * object strings. A tool call whose arguments do not form valid JSON is
 * K3_ERR_FORMAT with a message; text that merely stops early (max_tokens) is
 * parsed as far as it goes, a call cut off midway included (last_call_cut).
 * No field ever holds a special's name or a piece of a tag; numbers in the
 * arguments are passed through as written. Free with k3_chat_reply_free. */
typedef struct k3_chat_reply {
    char *reasoning;
    char *content;
    char *tool_calls_json;
    int32_t n_tool_calls;
    bool last_call_cut; /* the last call was cut off midway (max_tokens): its
                           arguments are the prefix generated so far */
} k3_chat_reply;

k3_status k3_chat_parse_reply(const char *text, size_t len, bool thinking, k3_chat_reply *out, k3_error *err);
void k3_chat_reply_free(k3_chat_reply *r);

/* ---- context: sequences, caches and the forward pass ------------------ */

typedef struct k3_ctx k3_ctx;

typedef enum k3_kv_type {
    K3_KV_F32 = 0, /* fp32 latent and indexer caches (the reference) */
    K3_KV_C8,      /* C8: int8 latent with one scale per 128-tile, fp32 rope
                       part; indexer keys Hadamard-rotated int8 per token */
} k3_kv_type;

typedef struct k3_ctx_options {
    int32_t max_seqs;      /* sequences that may hold state at once */
    int64_t cache_tokens;  /* cache capacity in tokens over all sequences */
    int32_t block_size;    /* tokens per cache block (0 = default 64) */
    int32_t max_batch;     /* tokens per forward pass (0 = default 512) */
    k3_kv_type kv_cache;   /* cache format (default K3_KV_F32) */
    bool dense_attention;  /* run DSA layers as dense MLA (indexer unused), to compare */
    bool kda_bf16_prefill; /* KDA's prefill pieces in its BF16 chunked form where the kernel
                              table has one worth taking (amx): faster, but a prefill then no
                              longer gives the bits of decoding the same tokens, nor the same
                              bits whatever the chunking (docs/amx.md) */
    k3_pool *pool;         /* borrowed; NULL = single-threaded */
    struct k3_dist *dist;  /* borrowed; NULL = one process (see "distributed") */
} k3_ctx_options;

k3_status k3_ctx_init(k3_ctx **out, const k3_model *m, const k3_ctx_options *opt, k3_error *err);
void k3_ctx_free(k3_ctx *ctx);

/* Forgets sequence seq: its state is zeroed and its cache blocks freed. */
void k3_ctx_seq_reset(k3_ctx *ctx, int32_t seq);
/* Number of tokens sequence seq has consumed. */
int64_t k3_ctx_seq_pos(const k3_ctx *ctx, int32_t seq);

/* One batch entry: n_tokens new tokens appended to sequence seq. */
typedef struct k3_batch_seq {
    int32_t seq;
    int32_t n_tokens;
    const int32_t *tokens;
    const float *const *embeds; /* NULL, or [n_tokens] row pointers: a non-NULL row
                                   (hidden_size floats, e.g. image features from
                                   k3_vision_encode) replaces that token's embedding */
} k3_batch_seq;

typedef enum k3_logits_mode {
    K3_LOGITS_LAST = 0, /* logits[i] = last token of entry i: [n_seqs, vocab] */
    K3_LOGITS_ALL,      /* every token, in batch order: [sum n_tokens, vocab] */
    K3_LOGITS_NONE,
} k3_logits_mode;

/* Runs the model over a batch of sequences, each at its own position.
 * Entries may be of any length (prefill) or 1 (decode); a long entry is
 * processed in chunks of max_batch tokens. A sequence appears at most once.
 * logits (float32, row-major) may be NULL with K3_LOGITS_NONE. On error no
 * sequence state is changed. */
k3_status k3_ctx_forward(k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, k3_logits_mode mode, float *logits,
                         k3_error *err);

/* ---- measurement ------------------------------------------------------ */

/* The library's clock: monotonic seconds (every time it reports is on it). */
double k3_now(void);

/* Time per operator of the forward pass, summed since the last reset. */
typedef enum k3_prof_op {
    K3_PROF_EMBED = 0, /* embedding rows */
    K3_PROF_ATTNRES,   /* AttnRes mixes */
    K3_PROF_NORM,      /* RMSNorms before attention and FFN */
    K3_PROF_KDA,       /* KDA layers: projections, conv, gates, recurrence, output */
    K3_PROF_MLAPO,     /* MLA preprocessing: projections, absorption, cache writes */
    K3_PROF_QLI,       /* DSA indexer scores and top-k */
    K3_PROF_QSFA,      /* MLA attention over the (selected) cache */
    K3_PROF_MLA_OUT,   /* W_UV, output gate, o_proj */
    K3_PROF_FFN,       /* dense FFN and shared experts */
    K3_PROF_MOE,       /* router and routed experts */
    K3_PROF_HEAD,      /* final norm and lm_head */
    K3_PROF_COUNT
} k3_prof_op;

typedef struct k3_profile {
    double seconds[K3_PROF_COUNT];
    int64_t moe_calls;   /* routed-expert layer calls (a layer of a pass) */
    int64_t moe_experts; /* experts those calls read: the union of what their rows picked, summed */
    int64_t moe_rows;    /* (row, expert) pairs those calls computed */
} k3_profile;

const char *k3_prof_op_name(k3_prof_op op);
/* The operations (2 a multiply-add) of a prefill of `tokens` tokens from
 * position 0, by operator: each operator's matrix products (the routed
 * experts: top-k a token; the head: one token's logits), the KDA recurrence
 * (~4 dk dv a head and token), and MLA's absorbed products, the indexer's
 * scores and the attention over the slots each token reads. For --profile's
 * rates against the compute peak; the elementwise work is not counted. */
void k3_model_prof_flops(const k3_model *m, int64_t tokens, double flops[K3_PROF_COUNT]);
/* Turns timing on or off (off by default; timing adds a clock read per op). */
void k3_ctx_profile_enable(k3_ctx *ctx, bool on);
/* Copies the sums into *out and resets them. */
void k3_ctx_profile_take(k3_ctx *ctx, k3_profile *out);

/* For benchmarks: appends n positions of random cache content to sequence
 * seq (and random KDA state) without running the model, so decode cost can
 * be measured at long contexts without a long prefill. */
k3_status k3_ctx_seq_fill_synthetic(k3_ctx *ctx, int32_t seq, int64_t n, uint64_t seed, k3_error *err);

/* Reads (sums) a buffer of `bytes` with every thread of pool, reps times,
 * and returns the median rate in GB/s (1e9 bytes/s): the memory bandwidth a
 * decode step is held against. Use >= 1 GB. Returns 0 if it cannot allocate. */
double k3_membw_read_gbps(k3_pool *pool, size_t bytes, int reps);

/* The compute peaks prefill is held against: a loop of independent
 * multiply-adds on registers (no memory traffic) on every thread of pool at
 * once, about `seconds` long. GFLOP/s (GOP/s for INT8), 2 operations a
 * multiply-add; 0 where the CPU lacks the instructions (AMX: or the kernel
 * refuses the tile state). */
typedef enum k3_peak_kind {
    K3_PEAK_FMA32 = 0, /* fp32 FMA (AVX-512, else AVX2) */
    K3_PEAK_BF16DOT,   /* vdpbf16ps (AVX512_BF16) */
    K3_PEAK_INT8DOT,   /* vpdpbusd (AVX-512 VNNI, else AVX-VNNI) */
    K3_PEAK_AMX_BF16,  /* TDPBF16PS */
    K3_PEAK_AMX_INT8,  /* TDPBSSD */
    K3_PEAK_COUNT
} k3_peak_kind;
double k3_peak_gflops(k3_pool *pool, k3_peak_kind kind, double seconds);
/* "fp32 FMA", "BF16 dot", "INT8 dot", "AMX BF16", "AMX INT8". */
const char *k3_peak_name(k3_peak_kind kind);
/* The kind that bounds the large products of a model quantized with q on
 * the current kernels: INT8 where the linears are 8-bit, else BF16 where the
 * table has the BF16 dot products and q is not f32, else fp32 FMA (AMX's
 * kinds on the "amx" table). */
k3_peak_kind k3_peak_of(const k3_quant_options *q);

/* ---- sampling --------------------------------------------------------- */

/* A bias added to one token's logit (OpenAI's logit_bias). */
typedef struct k3_logit_bias {
    int32_t id;
    float bias;
} k3_logit_bias;

typedef struct k3_sampler_options {
    float temperature;     /* 0 = greedy */
    int32_t top_k;         /* 0 = off */
    float top_p;           /* 1 = off */
    float min_p;           /* 0 = off */
    float repeat_penalty;  /* 1 = off; applied to ids in the history window */
    int32_t repeat_last_n; /* history window for the penalty (0 = all) */
    uint64_t seed;
    /* OpenAI's penalties over the output (the ids this sampler drew):
     * logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty */
    float frequency_penalty;         /* 0 = off */
    float presence_penalty;          /* 0 = off */
    const k3_logit_bias *logit_bias; /* [n_logit_bias], each added to its logit */
    int32_t n_logit_bias;
    const int32_t *allowed_ids; /* NULL: every id; else only these [n_allowed] may be drawn */
    int32_t n_allowed;
    /* vLLM's bad words as token sequences: word w is bad_words[bad_word_off[w] ..
     * bad_word_off[w + 1]) (n_bad_words + 1 offsets); its last id is masked
     * whenever the output ends with the ids before it (a one-id word always) */
    const int32_t *bad_words;
    const int32_t *bad_word_off;
    int32_t n_bad_words;
} k3_sampler_options;

typedef struct k3_sampler k3_sampler;

/* Copies what opt points to (logit_bias, allowed_ids, bad_words): the
 * caller may free it after. K3_ERR_ARG names a bad option (an id out of
 * range, a non-finite penalty or bias, an empty allowed list). */
k3_status k3_sampler_init(k3_sampler **out, const k3_sampler_options *opt, int32_t n_vocab, k3_error *err);
void k3_sampler_free(k3_sampler *s);
/* Records an id in the history used by the repetition penalty (the prompt
 * and the output alike). */
void k3_sampler_accept(k3_sampler *s, int32_t id);
/* Records id as drawn, as if k3_sampler_sample had just returned it (a
 * token sampled elsewhere: a prefill instance's first token): the output
 * the penalties and bad words look at, and the random number a non-greedy
 * draw takes, so the draws after it are those of the sampler that drew it
 * (the repetition penalty's history is k3_sampler_accept's, as after a draw). */
void k3_sampler_take(k3_sampler *s, int32_t id);
/* Picks an id from logits [n_vocab]. In this order (vLLM's): ids outside
 * allowed_ids and bad words masked (-inf), logit_bias added, then the
 * repetition, frequency and presence penalties; on return logits holds
 * these processed logits, and then top-k, temperature, top-p, min-p and
 * the draw (or greedy: the first of the largest) choose from them. The
 * id drawn joins the output the frequency/presence penalties and bad words
 * look at. Returns -1 when a logit is NaN or +Inf (there is no distribution
 * to sample from) or when every id is masked. */
int32_t k3_sampler_sample(k3_sampler *s, float *logits);

/* ---- grammar: constrained decoding ---------------------------------------
 *
 * Structured outputs: which tokens a model may sample next so that its text
 * matches a JSON Schema, a regular expression, a list of choices, a GBNF
 * grammar or K3's tool-call format (docs/grammar.md). Three objects:
 *   k3_grammar_vocab    the tokens of one model, built once from its
 *                       tokenizer; read-only afterwards, any thread;
 *   k3_grammar          a compiled grammar over that vocabulary; immutable
 *                       (its token tables fill in on first use, thread-safe),
 *                       shared by any threads, reference counted;
 *   k3_grammar_matcher  the state of one request; one thread at a time.
 * A mask is a bitset over token ids, bit (id & 63) of word (id >> 6), of
 * k3_grammar_mask_words words. Special tokens are allowed only where the
 * grammar names them; the ids that end a generation (k3_tokenizer_eos_ids)
 * only when the text so far is complete.
 */

typedef struct k3_grammar_vocab k3_grammar_vocab;
typedef struct k3_grammar k3_grammar;
typedef struct k3_grammar_matcher k3_grammar_matcher;

/* The tables of a tokenizer's vocabulary (a token trie; the token tables of
 * the standard JSON rules, computed here: ~0.2 s and ~22 MB for 200k tokens). tok is
 * only read during the call. */
k3_status k3_grammar_vocab_init(k3_grammar_vocab **out, const k3_tokenizer *tok, k3_error *err);
void k3_grammar_vocab_free(k3_grammar_vocab *v);
/* Words of a mask: (n_vocab + 63) / 64. */
size_t k3_grammar_mask_words(const k3_grammar_vocab *v);

typedef enum k3_grammar_kind {
    K3_GRAMMAR_JSON_SCHEMA, /* text: a JSON Schema (draft 2020-12 meaning) */
    K3_GRAMMAR_JSON_OBJECT, /* any JSON object (response_format json_object) */
    K3_GRAMMAR_REGEX,       /* text: a regular expression the whole output matches */
    K3_GRAMMAR_CHOICE,      /* choices: the output is exactly one of them */
    K3_GRAMMAR_GBNF,        /* text: a GBNF grammar; the output matches its rule "root" */
    K3_GRAMMAR_TOOL_CALLS,  /* tools: K3 tool calls (always in the K3 reply form) */
} k3_grammar_kind;

typedef struct k3_grammar_tool {
    const char *name;
    const char *parameters; /* JSON Schema text of the arguments; NULL = no arguments */
} k3_grammar_tool;

typedef struct k3_grammar_spec {
    k3_grammar_kind kind;
    const char *text;           /* NUL-terminated */
    const char *const *choices; /* K3_GRAMMAR_CHOICE */
    int32_t n_choices;
    const k3_grammar_tool *tools; /* K3_GRAMMAR_TOOL_CALLS */
    int32_t n_tools;
    bool parallel_calls;       /* tool calls: one or more (false: exactly one) */
    bool compact;              /* JSON: no whitespace between tokens */
    bool no_extra_properties;  /* JSON Schema: an object without
                                         "additionalProperties" allows no others */
    bool canonical_numbers;    /* JSON Schema: numbers as JSON writers write them:
                                         an integer without a fraction (21, not 21.0),
                                         no exponent, at most 15 fraction digits, enum
                                         numbers in their shortest text (tool-call
                                         arguments always) */
    bool k3_reply;             /* the output goes on a K3 assistant turn from
                                         its generation prompt: the content, then
                                         <|close|>response<|sep|> [<|close|>message<|sep|>] */
    bool thinking;             /* k3_reply and tool calls: the prompt opened
                                         the think block; free text until it closes */
    bool tools_optional;       /* tool calls: the reply may be content instead
                                         (tool_choice "auto" with strict tools): free
                                         text, then the calls or the reply's end; with
                                         text (a JSON Schema), that JSON or the calls */
    const char *text_where;    /* tool calls with text: names the schema in errors */
    const char *where;         /* names the input in errors, e.g.
                                         "response_format.json_schema.schema"
                                         (NULL: "json_schema", "regex", "grammar", ...) */
    double max_compile_s;      /* the compile's time budget (0: K3_GRAMMAR_COMPILE_S):
                                         past it, K3_ERR_UNSUPPORTED naming what it was
                                         building */
    bool (*cancel)(void *ctx); /* or NULL; asked every 10 ms or so while compiling:
                                         true stops the compile (K3_ERR_IO), as a server
                                         does when the client has left */
    void *cancel_ctx;
} k3_grammar_spec;

#define K3_GRAMMAR_COMPILE_S 10.0

/* Compiles spec. A construct the engine cannot honour is K3_ERR_UNSUPPORTED
 * naming it and where it is ("json_schema.properties.x: keyword
 * 'dependentSchemas' is not supported"); malformed input is K3_ERR_ARG. */
k3_status k3_grammar_compile(k3_grammar **out, const k3_grammar_vocab *v, const k3_grammar_spec *spec, k3_error *err);
/* Takes one more reference; k3_grammar_free drops one. */
k3_grammar *k3_grammar_ref(k3_grammar *g);
/* The vocabulary g was compiled for. */
const k3_grammar_vocab *k3_grammar_get_vocab(const k3_grammar *g);
void k3_grammar_free(k3_grammar *g);

/* A matcher at the start of the output; it keeps a reference to g. */
k3_status k3_grammar_matcher_init(k3_grammar_matcher **out, k3_grammar *g, k3_error *err);
/* An independent copy (n > 1 choices from one prompt). */
k3_status k3_grammar_matcher_clone(k3_grammar_matcher **out, const k3_grammar_matcher *m, k3_error *err);
void k3_grammar_matcher_free(k3_grammar_matcher *m);
/* The tokens allowed next, over the whole vocabulary (mask: mask_words). */
k3_status k3_grammar_matcher_fill_mask(k3_grammar_matcher *m, uint64_t *mask, k3_error *err);
/* Advances on a sampled token; K3_ERR_ARG (state unchanged) when the token
 * is not allowed here. An end-of-generation id is accepted when the text is
 * complete and ends the matcher. */
k3_status k3_grammar_matcher_accept(k3_grammar_matcher *m, int32_t id, k3_error *err);
/* Accepts ids in order (rebuilding a preempted request's state); on a
 * refusal the tokens before it stay accepted and *n_accepted says how many. */
k3_status k3_grammar_matcher_accept_tokens(k3_grammar_matcher *m, const int32_t *ids, size_t n, size_t *n_accepted,
                                           k3_error *err);
/* Whether the text so far is a complete match (EOS and stop strings allowed). */
bool k3_grammar_matcher_is_complete(const k3_grammar_matcher *m);
/* Whether an end-of-generation id was accepted. */
bool k3_grammar_matcher_is_ended(const k3_grammar_matcher *m);
/* Tokens accepted so far. */
int32_t k3_grammar_matcher_n_tokens(const k3_grammar_matcher *m);
/* Configurations of the current state and stack frames held (what a mask
 * walks and what the matcher's memory grows with): polynomial in the text
 * however ambiguous the grammar, as parses that meet share their stacks. */
void k3_grammar_matcher_size(const k3_grammar_matcher *m, size_t *configs, size_t *frames);
/* Undoes the last n accepted tokens (K3_ERR_ARG for more than were accepted). */
k3_status k3_grammar_matcher_rollback(k3_grammar_matcher *m, int32_t n, k3_error *err);
/* Back to the start of the output. */
void k3_grammar_matcher_reset(k3_grammar_matcher *m);
/* The bytes every continuation of the text starts with (jump-forward
 * decoding), at most cap; *len is how many (0 when the next byte is open). */
k3_status k3_grammar_matcher_forced(const k3_grammar_matcher *m, char *buf, size_t cap, size_t *len, k3_error *err);
/* The masks of n matchers at once, spread over pool (NULL = this thread);
 * masks[i] belongs to matchers[i]. */
k3_status k3_grammar_fill_masks(k3_grammar_matcher *const *matchers, uint64_t *const *masks, int32_t n, k3_pool *pool,
                                k3_error *err);
/* Sets logits[i] to -INFINITY for every id the mask forbids, and for ids at
 * or past the vocabulary's size (a model's padded embedding rows). */
void k3_grammar_mask_apply(const k3_grammar_vocab *v, const uint64_t *mask, float *logits, int32_t n_logits);

/* ---- engine: many requests on one model --------------------------------
 *
 * A k3_engine owns a context, a block manager (reference-counted cache
 * blocks, one block table per request), a prefix cache (full blocks keyed by
 * a hash chained over token ids, plus KDA state snapshots on the block grid)
 * and a scheduler with vLLM V1 semantics: each step has a token budget
 * (max_num_batched_tokens) and a cap on running requests (max_num_seqs);
 * running decodes are scheduled first, then chunks of waiting prompts; when
 * blocks run out the newest running request is preempted by recompute.
 *
 * Threads: k3_engine_submit, k3_engine_cancel, k3_engine_get_stats and
 * k3_engine_wait may be called from any thread while one thread calls
 * k3_engine_step. Everything else is single-threaded.
 */

typedef struct k3_engine k3_engine;

/* Speculative decoding (docs/spec.md): who drafts the tokens a step
 * verifies. K3_SPEC_DEFAULT in a request means the engine's method; in the
 * engine's options, off. */
typedef enum k3_spec_method {
    K3_SPEC_DEFAULT = 0,
    K3_SPEC_OFF,
    K3_SPEC_SUFFIX,      /* a suffix tree of the request's prompt and output, and its scope's past outputs */
    K3_SPEC_NGRAM,       /* the most recent earlier occurrence of the longest n-gram */
    K3_SPEC_DRAFT_MODEL, /* a second, small checkpoint of the same vocabulary (draft_model) */
} k3_spec_method;
#define K3_SPEC_MAX_TOKENS 16 /* draft tokens per request and step at most */

/* A step's phases as the engine times them (k3_engine_stats.phase_s):
 * begin (the inbox, requests opened: a suffix proposer indexes the prompt
 * here), propose (drafts and the cost model), schedule, setup (slots,
 * snapshots), pass (the forward pass), sample (tokens of plain rows and the
 * grammar masks), verify (a verify chunk's rows sampled and its rollback),
 * finish (outputs, stats), and outside: between the end of a step that left
 * work and the next step's start (the caller's handling of the outputs: the
 * server's per-token work on its engine thread). */
enum {
    K3_PHASE_BEGIN,
    K3_PHASE_PROPOSE,
    K3_PHASE_SCHEDULE,
    K3_PHASE_SETUP,
    K3_PHASE_PASS,
    K3_PHASE_SAMPLE,
    K3_PHASE_VERIFY,
    K3_PHASE_FINISH,
    K3_PHASE_OUTSIDE,
    K3_PHASE_COUNT
};

typedef struct k3_engine_options {
    int32_t max_num_seqs;           /* running requests at once (0 = 16) */
    int32_t max_num_batched_tokens; /* tokens per step over all requests (0 = 2048) */
    int64_t max_model_len;          /* prompt + output per request (0 = the model's
                                       max_positions, capped by what the pool holds) */
    int64_t cache_tokens;           /* cache pool size in tokens (0 = from cache_bytes) */
    int64_t cache_bytes;            /* cache pool size in bytes when cache_tokens is 0
                                       (0 = enough for max_num_seqs x max_model_len,
                                       within the machine's memory) */
    int32_t block_size;             /* tokens per cache block (0 = 64) */
    k3_kv_type kv_cache;            /* cache format */
    bool no_prefix_cache;           /* prefix caching is on unless this is set */
    int32_t snapshot_stride;        /* a KDA snapshot every this many blocks of a
                                       prompt (0 = default), and at each prompt's end */
    int64_t snapshot_bytes;         /* byte budget of KDA snapshots (0 = default: one
                                       state per snapshot point the pool can back,
                                       (blocks / snapshot_stride + max_num_seqs) states,
                                       within 1 GiB and an eighth of free memory) */
    int32_t max_waiting;            /* submit refuses with K3_ERR_BUSY past this many
                                       waiting requests (0 = no limit) */
    int32_t max_step_cost;          /* while requests decode, a step's cost stays within
                                       this many decode tokens (0 = off): a decode costs
                                       1, a prompt token at position p costs
                                       1 + (attention work over p keys) / (the weights'
                                       work), from the model's config; holds the
                                       decodes' inter-token latency under a long prompt */
    const int32_t *eos_ids;         /* end-of-sequence ids (copied); a request ends
                                       with reason stop on one unless ignore_eos */
    int32_t n_eos_ids;
    uint64_t cache_salt;   /* mixed into every block hash: identifies the
                                       model, quantization and cache format */
    double hold_timeout_s; /* a hold (kv_hold) nobody released is freed after
                                       this long (0 = 120 s) */
    k3_pool *pool;         /* borrowed; NULL = single-threaded */
    struct k3_dist *dist;  /* borrowed; NULL = one process. On rank 0 of
                                       several the context's calls go to the other
                                       ranks (k3_exec_serve_pool) */
    /* speculative decoding: each step a decoding request may verify draft
     * tokens in one chunk of its last token and the drafts; the same text
     * (greedy), the same distribution and, for drafts not sampled (every
     * method here), the same tokens for the same seed as without */
    k3_spec_method speculative;     /* K3_SPEC_DEFAULT / OFF: none */
    int32_t num_speculative_tokens; /* k, draft tokens per step at most (0 = 4; <= K3_SPEC_MAX_TOKENS) */
    const k3_model *draft_model;    /* borrowed: K3_SPEC_DRAFT_MODEL's checkpoint (same vocabulary) */
    bool spec_no_cost_model;        /* draft whatever the proposer finds (no cost model): to measure */
    int32_t spec_rollback;          /* KDA rollback: 0 re-apply the recurrence (default), 1 keep each
                                       position's state (K3_SPEC_STATES of ctx.h, to compare) */
    /* the suffix proposer (vLLM's suffix_decoding_* fields; 0 = defaults) */
    int32_t suffix_max_tree_depth, suffix_max_cached_requests;
    float suffix_max_spec_factor, suffix_min_token_prob;
    int32_t prompt_lookup_min, prompt_lookup_max; /* the ngram proposer's n range (0 = 2, 5) */
    /* the disk tier of the prefix cache (docs/kvstore.md): cache blocks and
     * KDA snapshots saved behind the engine into a directory that survives
     * restarts and is shared by the instances of a host, loaded back before
     * a request is scheduled. NULL: none. */
    const char *kv_cache_dir;
    int64_t kv_cache_disk_bytes;   /* its byte budget (0 = 64 GiB); the directory's LRU */
    const char *quant_name;        /* the weights' quant mode, part of its namespace (NULL = "none") */
    bool kv_cache_fsync;           /* fsync each file before publishing it */
    bool kv_cache_buffered;        /* never O_DIRECT (else where the filesystem does it) */
    bool kv_cache_buffered_writes; /* saves through the page cache, loads O_DIRECT */
    /* the disk tier's lines (a miss and why, a failed save, an eviction); any
     * thread; NULL = none (the library never prints) */
    void (*log)(void *arg, const char *line);
    void *log_arg;
} k3_engine_options;

typedef struct k3_request_params {
    const int32_t *prompt; /* [n_prompt] (copied at submit), n_prompt >= 1 */
    int64_t n_prompt;
    k3_sampler_options sampling; /* its own seed: a request samples the same
                                       tokens alone or batched */
    int32_t max_tokens;          /* tokens to generate (0 = prefill only) */
    int32_t min_tokens;          /* EOS and stop ids are ignored before this many
                                       (as vLLM: they are masked, so not generated) */
    const int32_t *stop_ids;     /* extra ids that end the request (copied) */
    int32_t n_stop_ids;
    bool ignore_eos;
    int32_t logprobs;           /* -1: none; n >= 0: each generated token's
                                       logprob and the n most likely alternatives */
    int32_t prompt_logprobs;    /* -1: none; n >= 0: the logprob of every prompt
                                       token after the first, and n alternatives
                                       (such a request does not read the prefix cache) */
    void *user;                 /* returned in every output of the request */
    const uint64_t *extra_keys; /* NULL, or [n_prompt] (copied): a key per prompt
                                       token mixed into the prefix-cache hash of its
                                       block, 0 for plain text; e.g. an image's
                                       content hash on its placeholder tokens, so
                                       equal ids of different images never share */
    const float *const *embeds; /* NULL, or [n_prompt]: a row of hidden_size floats
                                       (copied at submit) replacing that prompt token's
                                       embedding, NULL for the table's -- image rows
                                       (k3_vision_splice); give extra_keys with them */
    /* disaggregated serving (below: "prefill and decode apart") */
    bool kv_hold;                           /* prefill side: when the request ends (stop or
                                       length), keep its blocks and its KDA state at
                                       the prompt's end as a hold named by its id */
    const struct k3_remote_prefill *remote; /* decode side: the prompt was computed
                                       elsewhere (copied at submit) */
    /* speculative decoding: this request's method (K3_SPEC_DEFAULT: the
     * engine's; another than the engine's needs its proposer: suffix and
     * ngram always, draft_model with a draft model), its draft tokens per
     * step at most (0: the engine's k; at most K3_SPEC_MAX_TOKENS), and its
     * scope: requests of different scopes never draft from each other's
     * outputs (the server gives the hash of the API key) */
    k3_spec_method speculative;
    int32_t num_speculative_tokens;
    uint64_t spec_scope;
    uint64_t cache_salt; /* vLLM's cache_salt (0 = none): the prefix cache (RAM
                                       and disk) shares blocks only between requests
                                       of the same salt, so a tenant cannot time
                                       another's prompts (mixed into the first
                                       block's key) */
    k3_grammar *grammar; /* NULL, or the grammar the output must match
                                       (the request keeps a matcher of its own, with a
                                       reference): every token is sampled under its
                                       mask (logprobs too are those of the masked
                                       logits), EOS and stop ids end it only where the
                                       text is complete, and the grammar's end ends it
                                       (reason stop) */
} k3_request_params;

/* Events of a request since the previous step (bits of k3_req_output.events). */
enum {
    K3_EV_QUEUED = 1u << 0,
    K3_EV_SCHEDULED = 1u << 1,
    K3_EV_FIRST_TOKEN = 1u << 2,
    K3_EV_PREEMPTED = 1u << 3,
    K3_EV_FINISHED = 1u << 4,
};

typedef enum k3_finish_reason {
    K3_FINISH_NONE = 0,  /* still running */
    K3_FINISH_STOP,      /* an EOS or stop id (stop_id says which) */
    K3_FINISH_LENGTH,    /* max_tokens, or the model length */
    K3_FINISH_CANCELLED, /* k3_engine_cancel */
    K3_FINISH_ERROR,     /* see error */
} k3_finish_reason;

typedef struct k3_logprob {
    int32_t id;
    float logprob;
} k3_logprob;

typedef struct k3_req_output {
    uint64_t id;
    void *user;
    uint32_t events;       /* K3_EV_* bits */
    int32_t n_new;         /* tokens generated by this step */
    const int32_t *tokens; /* [n_new] */
    const float *logprobs; /* [n_new] the chosen tokens' logprobs, or NULL */
    const k3_logprob *top; /* [n_new * n_top], or NULL */
    int32_t n_top;
    int64_t n_prompt_logprobs;    /* set once, on the step that ends the prefill */
    const float *prompt_logprobs; /* [n_prompt_logprobs] for prompt tokens 1.. */
    const k3_logprob *prompt_top; /* [n_prompt_logprobs * n_top] or NULL */
    k3_finish_reason finish;      /* set with K3_EV_FINISHED */
    int32_t stop_id;              /* the id that stopped it, or -1 */
    int64_t n_prompt;             /* prompt tokens */
    int64_t n_cached;             /* of them served by the prefix cache */
    int64_t n_disk;               /* of those, read from the disk tier */
    int64_t n_generated;          /* tokens generated so far */
    /* times in seconds on k3_now's clock; 0 = not yet */
    double t_arrival, t_scheduled, t_first_token, t_finished;
    double prefill_s, decode_s; /* time in prefill and in decode steps */
    const char *error;          /* with K3_FINISH_ERROR */
    /* a request whose prompt was computed by a prefill instance (else 0): that
     * instance's queue and prefill times, the pull (blocks allocated to the
     * last byte in), and the first decode step after it */
    double remote_queue_s, remote_prefill_s, transfer_s, first_step_s;
} k3_req_output;

typedef struct k3_step_result {
    int32_t n_outputs;            /* requests with something to report */
    const k3_req_output *outputs; /* owned by the engine, valid until the next step */
    int32_t n_tokens;             /* tokens computed by this step's forward pass */
    double t;                     /* when the step's outputs were ready */
} k3_step_result;

typedef struct k3_engine_stats {
    int32_t n_running, n_waiting;
    int64_t blocks_total, blocks_used;   /* used: held by some request */
    double cache_usage;                  /* blocks_used / blocks_total */
    int64_t prefix_queries, prefix_hits; /* in prompt tokens, as vLLM counts */
    int64_t n_snapshots, snapshot_bytes; /* KDA snapshots held */
    int64_t n_preemptions;
    double step_cost_max;                           /* the costliest step that had decodes, in decode tokens */
    int64_t prefill_cost_p0;                        /* the position where a prompt token costs 2 (0 = flat) */
    int64_t prompt_tokens, generation_tokens;       /* computed prompt tokens, generated tokens */
    int64_t requests_finished[K3_FINISH_ERROR + 1]; /* by finish reason */
    int64_t max_model_len, cache_tokens;
    int64_t state_bytes_per_seq;       /* one KDA snapshot */
    int64_t snapshot_budget;           /* the snapshots' byte budget */
    int32_t max_num_seqs, max_waiting; /* running requests at once; waiting ones before K3_ERR_BUSY (0: no limit) */
    int64_t n_snapshot_saves, n_snapshot_restores; /* KDA snapshots taken / restored */
    double snapshot_save_s, snapshot_restore_s;    /* time spent taking / restoring them */
    /* prefill and decode apart: holds kept for decode instances (and their
     * blocks), holds freed unread at their timeout, holds released; pulls in
     * flight (and their blocks), pulls landed and failed */
    int64_t n_holds, hold_blocks, holds_expired, holds_released;
    int64_t n_pulls, pull_blocks, pulls_ok, pulls_failed;
    int64_t grammar_steps, grammar_masks; /* steps that filled grammar masks, masks filled */
    double grammar_s;                     /* time spent filling and applying them */
    /* speculative decoding (vLLM's spec_decode counters): verify chunks with
     * drafts, draft tokens in them, draft tokens accepted, and accepted at
     * each draft position; spec_k is the engine's k (the positions that
     * count); time proposing and in the accept (KDA rollback included) */
    int64_t spec_drafts, spec_draft_tokens, spec_accepted_tokens;
    int64_t spec_accepted_per_pos[K3_SPEC_MAX_TOKENS];
    int32_t spec_k;
    double spec_propose_s, spec_accept_s;
    /* the engine's time by phase of its steps (K3_PHASE_*), summed, and the
     * steps: all of them, and those with a verify chunk */
    double phase_s[K3_PHASE_COUNT];
    int64_t n_steps, n_spec_steps;
} k3_engine_stats;

k3_status k3_engine_open(k3_engine **out, const k3_model *m, const k3_engine_options *opt, k3_error *err);
void k3_engine_close(k3_engine *e);
/* Queues a request; *id names it from now on. Refuses a prompt plus
 * max_tokens over max_model_len or over what the pool can ever hold
 * (K3_ERR_RANGE, naming the numbers), bad ids or options (K3_ERR_ARG), and a
 * full queue (K3_ERR_BUSY). */
k3_status k3_engine_submit(k3_engine *e, const k3_request_params *p, uint64_t *id, k3_error *err);
/* Ends a request at the next step (reason cancelled) and frees its blocks;
 * unknown or finished ids are ignored. */
void k3_engine_cancel(k3_engine *e, uint64_t id);
/* Schedules and runs one forward pass; fills *res. With nothing to do it
 * returns at once with n_outputs 0. */
k3_status k3_engine_step(k3_engine *e, k3_step_result *res, k3_error *err);
/* True while any request is waiting or running. */
bool k3_engine_has_work(k3_engine *e);
/* Blocks until a submit or cancel arrives or timeout_s passes. */
void k3_engine_wait(k3_engine *e, double timeout_s);
void k3_engine_get_stats(k3_engine *e, k3_engine_stats *st);
/* ---- KV-cache residency metrics --------------------------------------------
 *
 * vLLM v1's sampled block residency histograms (--kv-cache-metrics): a
 * sampled fraction of the cache blocks handed out is followed from the
 * allocation (birth) through its prefix-cache hits (accesses: the last four
 * are kept) to the moment the block is taken again for other tokens
 * (eviction); then lifetime = eviction - birth, idle = eviction - last
 * access (birth when never hit), and one reuse gap per pair of consecutive
 * kept accesses are observed. Buckets: k3_kv_residency_le, in seconds.
 * Without prefix caching (no_prefix_cache) nothing is observed, as in vLLM
 * (its blocks are never evicted from a cache): the histograms stay empty. */

#define K3_KV_RESIDENCY_BUCKETS 21

typedef struct k3_kv_hist {
    uint64_t count[K3_KV_RESIDENCY_BUCKETS + 1]; /* per bucket (not cumulative); last = +Inf */
    double sum;
    uint64_t n;
} k3_kv_hist;

typedef struct k3_kv_residency {
    bool enabled;
    double sample_rate;   /* the fraction of allocated blocks followed */
    k3_kv_hist lifetime;  /* vllm:kv_block_lifetime_seconds */
    k3_kv_hist idle;      /* vllm:kv_block_idle_before_evict_seconds */
    k3_kv_hist reuse_gap; /* vllm:kv_block_reuse_gap_seconds */
} k3_kv_residency;

/* The upper bounds of the buckets (vLLM's: 1 ms ... 1800 s). */
extern const double k3_kv_residency_le[K3_KV_RESIDENCY_BUCKETS];

/* Turns the residency metrics on with sample_rate in (0, 1] (vLLM's
 * default is 0.01), or off with 0. Call before the first k3_engine_step.
 * K3_ERR_ARG for a rate outside [0, 1], K3_ERR_NOMEM. */
k3_status k3_engine_set_kv_metrics(k3_engine *e, double sample_rate, k3_error *err);
/* The histograms as of the last step (any thread; enabled = false when off). */
void k3_engine_kv_residency(k3_engine *e, k3_kv_residency *out);

/* ---- prefill and decode apart (the engine's side; src/pd moves the bytes) --
 * A prefill instance runs a request submitted with kv_hold as any other
 * (its first token sampled, then max_tokens); when it ends by stop or
 * length its cache blocks and its KDA state at the prompt's end stay as a
 * hold named by the request's id, until a decode instance has read them
 * (k3_engine_hold_read, _read_state, from any thread) and
 * k3_engine_hold_release, or until hold_timeout_s passes. A decode
 * instance takes the same prompt with `remote` set: at a step the engine
 * gives it the blocks of the whole prompt (those its prefix cache holds are
 * shared, as a hit), and tells the pull hook to fetch the rest; the request
 * then waits holding its blocks but no running slot (the scheduler does not
 * see it) until k3_engine_pull_done. Landed, its blocks enter the prefix
 * cache as if computed (a KDA snapshot too when the prompt ends on the
 * block grid), the remote first token is its first output (the sampler
 * takes it as drawn), and it decodes on. A pull that fails, or a request
 * cancelled while pulling, ends with its blocks freed once the hook's side
 * has stopped writing. */
typedef struct k3_remote_prefill {
    int32_t first_token;         /* what the prefill instance sampled after the prompt */
    float first_logprob;         /* its logprob (NaN: not known) */
    const k3_logprob *first_top; /* [n_first_top] its alternatives, best first (copied) */
    int32_t n_first_top;
    double queue_s, prefill_s; /* the prefill instance's times (reported, for the TTFT split) */
    void *ctx;                 /* handed to the pull hook */
} k3_remote_prefill;

typedef enum k3_pull_op {
    K3_PULL_START,  /* blocks are ready: fetch positions [n_local, n_tokens) and the state */
    K3_PULL_ABORT,  /* the request ended before its blocks were given: fetch nothing
                       (tell the prefill instance to free its hold) */
    K3_PULL_CANCEL, /* the request was cancelled while pulling: stop soon, then
                       k3_engine_pull_done */
} k3_pull_op;

typedef struct k3_pull_info {
    k3_pull_op op;
    uint64_t id;      /* the request */
    void *ctx;        /* k3_remote_prefill.ctx */
    int64_t n_local;  /* prompt tokens the cache already holds (a block multiple) */
    int64_t n_tokens; /* the prompt's tokens */
} k3_pull_info;

/* Called on the stepping thread (so it must only queue work): once per
 * remote request with START or ABORT, then CANCEL if it is cancelled while
 * pulling. Set before the first k3_engine_step. */
typedef void (*k3_pull_hook)(void *arg, const k3_pull_info *info);
void k3_engine_set_pull_hook(k3_engine *e, k3_pull_hook fn, void *arg);
/* Bytes of n tokens of layer `layer` in the transfer layout (0 for a KDA
 * layer), and of one KDA state. */
int64_t k3_engine_kv_bytes(const k3_engine *e, int32_t layer, int64_t n);
int64_t k3_engine_state_bytes(const k3_engine *e);
/* Decode side, any thread, between START and k3_engine_pull_done: positions
 * [t0, t0 + n) of layer into the request's blocks (bytes must be
 * k3_engine_kv_bytes(layer, n), t0 >= n_local, t0 + n <= n_tokens); bytes
 * [offset, offset + bytes) of the KDA state (the pull lands once all of it
 * came). K3_ERR_ARG when the request is not pulling or was cancelled (stop
 * then), or the range is wrong. */
k3_status k3_engine_pull_write(k3_engine *e, uint64_t id, int32_t layer, int64_t t0, int32_t n, const void *rows,
                               int64_t bytes, k3_error *err);
k3_status k3_engine_pull_state(k3_engine *e, uint64_t id, int64_t offset, const void *part, int64_t bytes,
                               k3_error *err);
/* The pull is over: landed (ok: every position and the state written) or
 * failed (why: what the request's error says). */
void k3_engine_pull_done(k3_engine *e, uint64_t id, bool ok, const char *why);

typedef struct k3_hold_info {
    int64_t n_tokens; /* the prompt's tokens (what the blocks hold) */
    int32_t n_blocks;
    int64_t state_bytes;
    double queue_s, prefill_s; /* the request's time waiting, and in prefill */
} k3_hold_info;
/* Prefill side, any thread: a hold's size, and its block ids into blocks
 * (up to cap; may be NULL). K3_ERR_ARG when there is no such hold. */
k3_status k3_engine_hold_get(k3_engine *e, uint64_t id, k3_hold_info *out, int32_t *blocks, int32_t cap, k3_error *err);
/* Positions [t0, t0 + n) of layer of a hold into rows (bytes as for
 * pull_write); bytes [offset, offset + bytes) of its KDA state. */
k3_status k3_engine_hold_read(k3_engine *e, uint64_t id, int32_t layer, int64_t t0, int32_t n, void *rows,
                              int64_t bytes, k3_error *err);
k3_status k3_engine_hold_read_state(k3_engine *e, uint64_t id, int64_t offset, void *part, int64_t bytes,
                                    k3_error *err);
/* Frees a hold (at the next step, once no read is in flight); unknown ids
 * are ignored. */
void k3_engine_hold_release(k3_engine *e, uint64_t id);

/* In place, for a one-sided transport (src/pd over UCX): the cache arrays,
 * and a hold or a pull pinned so that its blocks and KDA state may be read or
 * written where they lie, with no copy. */
typedef struct k3_kv_array {
    void *base;    /* slot 0 */
    int64_t bytes; /* every block's slots */
    int64_t row;   /* bytes per slot */
} k3_kv_array;
/* The arrays of layer `layer`'s cache on this rank in the transfer layout's
 * order (k3_engine_kv_bytes(layer, n) = n x their rows summed; 0 for a KDA
 * layer). Position p of a block table t lies in slot t[p / block_size] x
 * block_size + p mod block_size of each, in one process (see direct). */
int k3_engine_kv_arrays(const k3_engine *e, int32_t layer, k3_kv_array out[5]);
/* Whether this rank's arrays hold every position (no DCP: a hold may be read
 * in place) and, with write, whether nothing else must see a write (one
 * process: a pull may be written in place, no rank to mirror it to). */
bool k3_engine_kv_direct(const k3_engine *e, bool write);
typedef struct k3_kv_pin {
    const int32_t *blocks; /* the block table: position p in blocks[p / block_size] */
    int32_t n_blocks, block_size;
    int64_t from, to;    /* the positions: a hold's [0, n_tokens), a pull's [n_local, n_tokens) */
    void *state;         /* the KDA state at the prompt's end (state_bytes; NULL when 0) */
    int64_t state_bytes; /* k3_engine_state_bytes */
    void *ref;           /* the engine's, for the unpin */
} k3_kv_pin;
/* A hold pinned: its blocks and state stay (released or timed out, they are
 * freed at the unpin), so they may be read in place. K3_ERR_ARG when there is
 * no such hold. */
k3_status k3_engine_hold_pin(k3_engine *e, uint64_t id, k3_kv_pin *out, k3_error *err);
void k3_engine_hold_unpin(k3_engine *e, k3_kv_pin *pin);
/* A pull pinned as k3_engine_pull_write pins it: positions [from, to) of its
 * blocks and its state may be written in place until the unpin, which counts
 * state_landed bytes of the state as written. K3_ERR_ARG when the request is
 * not pulling or was cancelled; only where k3_engine_kv_direct(e, true). */
k3_status k3_engine_pull_pin(k3_engine *e, uint64_t id, k3_kv_pin *out, k3_error *err);
void k3_engine_pull_unpin(k3_engine *e, k3_kv_pin *pin, int64_t state_landed);

/* Notes on the engine (implementation: src/engine, src/sched, src/kv,
 * src/spec). logprobs and prompt_logprobs take at most 20 alternatives, and
 * when both are asked for they must ask for the same number (n_top is one
 * field). A step yields one token per request, or with speculative decoding
 * up to k + 1. Outputs of a finished request are valid until the next step,
 * which frees it. */


/* ---- KV events (src/kvevents, docs/kvstore.md "KV events") -----------------
 * vLLM's KV cache events for cache-aware routers (vLLM's, Dynamo, llm-d):
 * BlockStored when a full block enters the prefix cache, BlockRemoved when
 * its hash is dropped to reuse the block, AllBlocksCleared when the cache
 * starts empty; msgpack batches on a ZeroMQ PUB socket, each message three
 * frames (topic, an 8-byte big-endian sequence number, the batch), with
 * vLLM's optional replay socket (a ROUTER: send the first sequence number
 * wanted as 8 big-endian bytes, get [seq, batch] messages and then [-1, ""]).
 * A batch is [ts, [event, ...], data_parallel_rank]; an event is a map
 * tagged by "type" with vLLM's field names (vLLM >= 0.26), or with
 * legacy_array a positional array [tag, fields...] (vLLM 0.10 - 0.25). */

typedef struct k3_kv_events k3_kv_events;

typedef struct k3_kv_events_options {
    const char *endpoint;        /* the PUB socket, as vLLM reads it: one with a '*' host (every
                                    address), "::", ipc://PATH or inproc:// is bound; another
                                    address is connected to (a forwarder) */
    const char *replay_endpoint; /* NULL, or the replay ROUTER socket's (bound) */
    const char *topic;           /* the first frame (NULL = "") */
    int32_t buffer_steps;        /* batches kept for replays (0 = 10000) */
    int32_t hwm;                 /* the PUB socket's high-water mark (0 = 100000) */
    int32_t data_parallel_rank;  /* the batches' third field */
    bool legacy_array;           /* positional events (vLLM before its map encoding) */
    double flush_s;              /* events wait at most this long for their batch (0 = 0.01 s) */
} k3_kv_events_options;

/* Opens (binds or connects) the sockets and starts the publishing thread,
 * which sends AllBlocksCleared first. K3_ERR_ARG names a bad endpoint. */
k3_status k3_kv_events_open(k3_kv_events **out, const k3_kv_events_options *opt, k3_error *err);
/* Sends what is pending, then closes. */
void k3_kv_events_close(k3_kv_events *ev);

typedef struct k3_kv_events_stats {
    int64_t batches, events;               /* messages published, events in them */
    int64_t stored_blocks, removed_blocks; /* hashes in BlockStored / BlockRemoved events (the engine's cache) */
    int64_t disk_stored_blocks, disk_removed_blocks; /* the same, medium "DISK" (the disk tier) */
    int64_t bytes;                                   /* payload bytes */
    int64_t replays;                                 /* replay requests served */
} k3_kv_events_stats;
void k3_kv_events_get_stats(k3_kv_events *ev, k3_kv_events_stats *out);

/* The engine's block manager publishes on ev (NULL: stops); call before the
 * first k3_engine_step. ev outlives the engine's use of it. */
void k3_engine_set_kv_events(k3_engine *e, k3_kv_events *ev);

/* ---- the disk tier's directory (src/kvstore, docs/kvstore.md) ---------------
 * What `k3 cache ls|clear DIR` shows and does. A directory holds runs of
 * cache blocks and KDA snapshots of any number of models (each file's header
 * says which); the engine's disk tier (src/kvstore/kvstore.h) writes and
 * reads them. Both calls are safe while instances use the directory: a
 * reader keeps what it opened, and the shared size counter is set from
 * what is there. */

typedef struct k3_kvcache_model {
    uint64_t model;     /* k3_model_identity of what wrote the files */
    char quant[24];     /* its --quant mode */
    k3_kv_type kv;      /* cache dtype */
    int32_t block_size; /* tokens per block */
    int32_t dcp_rank, dcp_size;
    int64_t runs, snaps; /* files */
    int64_t run_bytes, snap_bytes;
    int64_t blocks;  /* blocks in its run files */
    double newest_s; /* seconds since its newest file was last used */
    double oldest_s; /* and its least recently used one */
} k3_kvcache_model;

typedef struct k3_kvcache_info {
    int64_t files, bytes;         /* under runs/ and snaps/ */
    int64_t bad_files, bad_bytes; /* of them: not k3 cache files, torn, or damaged headers */
    int64_t tmp_files, tmp_bytes; /* being written, or left by a crash */
    int64_t counter_bytes;        /* the shared size counter (-1: none) */
    k3_kvcache_model *models;     /* [n_models] by bytes, largest first */
    int32_t n_models;
} k3_kvcache_info;

/* Reads every file's header under dir. K3_ERR_IO when dir is not a cache
 * directory (no runs/ or snaps/). Free with k3_kvcache_info_free. */
k3_status k3_kvcache_scan(const char *dir, k3_kvcache_info *out, k3_error *err);
void k3_kvcache_info_free(k3_kvcache_info *info);
/* Removes the files of model (0 = every file, and whatever tmp/ holds that
 * no process is writing: older than a minute); *files and *bytes (may be
 * NULL) get what was removed. */
k3_status k3_kvcache_clear(const char *dir, uint64_t model, int64_t *files, int64_t *bytes, k3_error *err);

/* ---- distributed: several processes on MPI (src/comm, src/executor) ------
 *
 * One k3_dist per process joins the MPI world (mpirun -np N) and splits it
 * into a decode-context-parallel group of D ranks (consecutive world ranks)
 * and an expert-parallel group of E ranks (world ranks N/E apart); D and E
 * divide N. Every rank makes a context with the dist. Rank 0 owns
 * tokenization, sampling and I/O and drives its context through the
 * executor (k3_exec_forward, ...: below), which sends each call to every
 * other rank; they replay them in k3_exec_serve, so every rank runs its
 * share of every forward pass.
 * DCP: token x of a sequence lives on DCP rank (x div I) mod D, which equals
 * ((x mod (bs*D)) div I) mod D for bs a multiple of I (docs/serving-reference.md §2.5.1); the
 * latent and indexer caches hold only own tokens, attention and the DSA
 * top-k are settled across the group and merged exactly by log-sum-exp. EP:
 * routed expert e lives on EP rank e div (n_experts / E) (k3_model_open_ep
 * loads only those), tokens' latents go to their experts' owners and the
 * results come back (all-to-all). Everything else is replicated.
 * Failures of MPI are k3_status values (K3_ERR_IO) naming the collective;
 * a collective that waits longer than timeout_s fails the same way, so a
 * rank that hangs or dies does not hang the others forever. */

typedef struct k3_dist k3_dist;

typedef enum k3_topk_exchange {
    K3_TOPK_ALLGATHER = 0, /* every rank receives every rank's k candidates */
    K3_TOPK_BUTTERFLY,     /* log2(D) rounds of pairwise top-k merges (D a power of 2) */
} k3_topk_exchange;

typedef struct k3_dist_options {
    int32_t dcp;            /* DCP group size D (0 = 1) */
    int32_t ep;             /* EP group size E (0 = 1) */
    int32_t dcp_interleave; /* I: consecutive tokens per rank stripe (0 = 1) */
    k3_topk_exchange exchange;
    double timeout_s; /* longest wait of one collective (0 = 300 s) */
} k3_dist_options;

/* Initializes MPI (once per process) and the groups. Fails with one message
 * when D or E does not divide the world size or I is not positive. */
k3_status k3_dist_init(k3_dist **out, const k3_dist_options *opt, k3_error *err);
/* Finalizes MPI. */
void k3_dist_free(k3_dist *d);
/* Ends every rank of the job (MPI_Abort): after a failure that left ranks
 * inside a collective. */
void k3_dist_abort(k3_dist *d, int code);
int32_t k3_dist_rank(const k3_dist *d);
int32_t k3_dist_size(const k3_dist *d);
int32_t k3_dist_dcp_rank(const k3_dist *d);
int32_t k3_dist_dcp_size(const k3_dist *d);
int32_t k3_dist_ep_rank(const k3_dist *d);
int32_t k3_dist_ep_size(const k3_dist *d);
int32_t k3_dist_interleave(const k3_dist *d);
k3_topk_exchange k3_dist_exchange(const k3_dist *d);
/* Every rank passes its own status; all get K3_OK, or the status and message
 * of the lowest failing rank (so rank 0 can print it). */
k3_status k3_dist_agree(k3_dist *d, k3_status mine, k3_error *err);
/* Broadcasts n int64 values from rank 0. */
k3_status k3_dist_bcast_i64(k3_dist *d, int64_t *v, int32_t n, k3_error *err);
/* Sums a double over all ranks (for per-rank figures). */
k3_status k3_dist_sum(k3_dist *d, double *v, int32_t n, k3_error *err);
/* The largest of a value over all ranks. */
k3_status k3_dist_max(k3_dist *d, double *v, int32_t n, k3_error *err);

/* Cross-rank traffic by collective kind: bytes this rank sent to and
 * received from other ranks, calls, and seconds spent inside them. */
typedef enum k3_comm_kind {
    K3_COMM_TOPK = 0,    /* DSA (score, position) candidate exchange */
    K3_COMM_LSE,         /* DCP attention partials (output + LSE) */
    K3_COMM_EP_DISPATCH, /* latents to their experts' owners */
    K3_COMM_EP_COMBINE,  /* expert results back, and the combined rows */
    K3_COMM_CONTROL,     /* rank 0's commands and batches */
    K3_COMM_COUNT
} k3_comm_kind;

typedef struct k3_comm_stats {
    int64_t sent[K3_COMM_COUNT], recv[K3_COMM_COUNT], calls[K3_COMM_COUNT];
    double seconds[K3_COMM_COUNT];
} k3_comm_stats;

const char *k3_comm_kind_name(k3_comm_kind k);
/* Copies the counters into *out and resets them. */
void k3_dist_stats_take(k3_dist *d, k3_comm_stats *out);

/* The executor: rank 0's calls on a context made with a dist, made on every
 * rank. Each k3_exec_ call takes the arguments of the k3_ctx_ call of the
 * same name; on rank 0 of several it sends the call to the other ranks and
 * makes it on its own context (a forward pass together with the others);
 * with one process (no dist, or a world of 1) it is the k3_ctx_ call. A send
 * that fails is sticky: the next forward pass returns it. */
k3_status k3_exec_forward(k3_ctx *ctx, const k3_batch_seq *batch, int32_t n_seqs, k3_logits_mode mode, float *logits,
                          k3_error *err);
void k3_exec_seq_reset(k3_ctx *ctx, int32_t seq);
k3_status k3_exec_seq_fill_synthetic(k3_ctx *ctx, int32_t seq, int64_t n, uint64_t seed, k3_error *err);
/* Ranks other than 0: makes rank 0's calls on ctx (made with the dist, the
 * same options as rank 0's) until rank 0 calls k3_exec_release (returns
 * K3_OK) or something fails. */
k3_status k3_exec_serve(k3_ctx *ctx, k3_error *err);
/* k3 serve's ranks > 0: waits for rank 0's engine to make its context (same
 * options, on model m and pool), then makes every call the engine makes on
 * it, until k3_exec_release (K3_OK) or a failure. Frees the context. */
k3_status k3_exec_serve_pool(k3_dist *d, const k3_model *m, k3_pool *pool, k3_error *err);
/* Rank 0: lets the other ranks' k3_exec_serve and k3_exec_serve_pool
 * return (K3_OK with one process). */
k3_status k3_exec_release(k3_dist *d, k3_error *err);
/* Rank 0 of several: takes its own counters into *mine and every rank's,
 * summed, into *all (either may be NULL); the other ranks, serving, take and
 * add theirs. One process: both get this process's counters. */
k3_status k3_exec_stats_take_all(k3_dist *d, k3_comm_stats *mine, k3_comm_stats *all, k3_error *err);

/* Bytes of the latent and indexer cache pool an engine's context holds on
 * this rank (under DCP each rank holds the same: 1/D of one process's). */
int64_t k3_engine_cache_bytes(const k3_engine *e);
/* The cross-rank counters of every rank, summed over the ranks and over an
 * engine's steps since it opened (any thread; taken with
 * k3_exec_stats_take_all after each step); false (and zeros) when the
 * engine runs in one process. */
bool k3_engine_comm_stats(k3_engine *e, k3_comm_stats *out);

/* k3_model_open keeping only the routed experts of EP rank ep_rank of
 * ep_size (the others are neither bound nor read nor copied). */
k3_status k3_model_open_ep(k3_model **out, const char *dir, int32_t ep_rank, int32_t ep_size, k3_error *err);
/* Bytes of routed-expert weights this process holds (as stored or converted). */
int64_t k3_model_expert_bytes(const k3_model *m);
/* Bytes of the latent and indexer caches this context allocated. */
int64_t k3_ctx_cache_bytes(const k3_ctx *ctx);

/* A deployment plan from a config alone (no weights): k3 plan. */
typedef struct k3_plan_options {
    int32_t dcp, ep; /* 0 = 1 */
    int64_t context; /* tokens of one sequence (0 = 1M) */
    k3_kv_type kv_cache;
    k3_quant_options quant;
    int32_t index_topk; /* 0 = the config's */
} k3_plan_options;

typedef struct k3_plan {
    int64_t weight_bytes;          /* all text weights in the given quantization */
    int64_t expert_bytes;          /* of them the routed experts */
    int64_t cache_bytes_per_token; /* latent + indexer, all MLA/DSA layers */
    int64_t cache_bytes_per_seq;   /* at the given context */
    int64_t cache_bytes_per_1m;    /* per 1M-token sequence */
    int64_t state_bytes_per_seq;   /* KDA recurrent + conv state (replicated) */
    int64_t weight_bytes_per_rank; /* replicated part + 1/E of the experts */
    int64_t cache_bytes_per_rank;  /* one sequence at the context, 1/D of it */
    int64_t mem_bytes_per_rank;    /* weights + cache + state */
    int32_t n_dsa, n_mla, n_kda, n_moe;
    /* cross-rank bytes per decoded token received by one rank */
    int64_t topk_allgather_bytes, topk_butterfly_bytes; /* all DSA layers */
    int64_t lse_bytes;                                  /* DCP partial outputs + LSE, all MLA/DSA layers */
    int64_t ep_dispatch_bytes, ep_combine_bytes;        /* all MoE layers, expected, over the EP group */
    /* EP as the source rank of a row sees it (a row is sourced by EP rank
     * row mod E: every row of a one-sequence batch by rank 0): its remote
     * experts' results received; its latent to each remote owner and the
     * combined row to the E-1 others sent. In a batch of E rows or more each
     * rank sources 1/E of them and moves about 1/E of the group's bytes. */
    int64_t ep_source_recv_bytes, ep_source_sent_bytes;
    /* collectives per decoded step, each a synchronisation of its group (a
     * step waits at least that many one-way link latencies): the LSE merge
     * (2 a MLA/DSA layer, 1 where D does not divide the heads), the top-k
     * exchange (a DSA layer: 1 all-gather or log2(D) butterfly steps, at
     * contexts beyond k), EP (dispatch and the two combines a MoE layer) and
     * the step's broadcast */
    int32_t collectives_allgather, collectives_butterfly;
    /* prefill and decode apart: what one prompt of the context moves from the
     * prefill instance (its rows + one KDA state), and what each of D decode
     * ranks receives (its 1/D of the rows + the state) */
    int64_t pd_bytes_per_seq, pd_bytes_per_rank;
    /* speculative decoding, per sequence: what the KDA rollback keeps per
     * verify position (re-applying the recurrence: the pre-conv rows and each
     * head's k, v, gate, beta; or the whole state), and the bytes a pass of
     * n = 1..16 positions reads at batch 1 (the weights but the routed
     * experts once, and the expected union of the experts its positions
     * route to, routing independent: an upper bound) */
    int64_t spec_reapply_bytes_per_pos, spec_states_bytes_per_pos;
    int64_t decode_read_bytes;     /* one decode step: the weights but the routed experts + its experts */
    int64_t verify_read_bytes[17]; /* [n] a pass of n positions, n = 1..16 */
} k3_plan;

/* Reads CONFIG.json (a file) and computes the plan. */
k3_status k3_plan_compute(const char *config_path, const k3_plan_options *opt, k3_plan *out, k3_error *err);


/* ---- vision: images in prompts (docs/vision.md) --------------
 *
 * A k3_image is a decoded PNG, JPEG, WEBP or GIF; a k3_vision is a
 * checkpoint's MoonViT3d tower, sd2_tpool merger and patchmergerv2 projector
 * with its image processor (preprocessor_config.json, or the published
 * defaults). An image enters a prompt as
 * <|media_begin|>image {W}x{H}<|media_content|> + N <|media_pad|> +
 * <|media_end|> (k3_vision_image_prompt), and its N rows
 * (k3_vision_encode) replace the pads' embeddings (k3_batch_seq.embeds).
 */

typedef struct k3_image k3_image;
typedef struct k3_vision k3_vision;

/* Pixel cap used when max_pixels is 0: 8192 x 8192. */
#define K3_IMAGE_MAX_PIXELS ((int64_t)8192 * 8192)

/* Decodes a PNG, JPEG, WEBP or GIF (told apart by their signatures) from
 * memory; of an animated WEBP or GIF, the first frame (as Pillow composes it
 * on the canvas). The header's size is checked against max_pixels (0 =
 * K3_IMAGE_MAX_PIXELS) before any pixel is decoded; truncated or corrupt
 * data, other formats and variants k3 does not read (16-bit grey PNG, CMYK
 * JPEG) are refused with a message. */
k3_status k3_image_decode(k3_image **out, const void *data, size_t size, int64_t max_pixels, k3_error *err);
/* The same from an OpenAI image_url: only data: URLs with base64 content
 * ("data:image/png;base64,..."; image/png, image/jpeg, image/webp, image/gif
 * or no type). Remote URLs (http:, https:, ...) are refused with
 * K3_ERR_UNSUPPORTED naming the rule -- k3 fetches nothing; malformed base64
 * is K3_ERR_ARG. */
k3_status k3_image_decode_url(k3_image **out, const char *url, size_t len, int64_t max_pixels, k3_error *err);
/* The size of an image_url's image from its header alone (nothing decoded),
 * with the same checks and errors as k3_image_decode_url's up to there. */
k3_status k3_image_probe_url(const char *url, size_t len, int64_t max_pixels, int32_t *width, int32_t *height,
                             k3_error *err);
/* The same from a file. */
k3_status k3_image_load(k3_image **out, const char *path, int64_t max_pixels, k3_error *err);
/* An image from 8-bit RGBA pixels [height, width, 4] (copied); with
 * has_alpha false the alpha bytes are ignored (an RGB image). */
k3_status k3_image_from_rgba(k3_image **out, const uint8_t *rgba, int32_t width, int32_t height, bool has_alpha,
                             k3_error *err);
void k3_image_free(k3_image *im);
int32_t k3_image_width(const k3_image *im);
int32_t k3_image_height(const k3_image *im);
/* A 64-bit hash of the decoded content (size, mode, pixels): what names an
 * image in a prefix-cache key. */
uint64_t k3_image_hash(const k3_image *im);

/* Binds the vision tower of an open model (its config.json's vision_config,
 * the vision_tower.* and mm_projector.* tensors, checked for dtype and
 * shape). A checkpoint without a tower is K3_ERR_UNSUPPORTED with a message
 * saying so. The model must outlive the tower. */
k3_status k3_vision_open(k3_vision **out, const k3_model *m, k3_error *err);
void k3_vision_close(k3_vision *v);
/* Applies --quant's linear mode to the tower's and projector's matrices. */
k3_status k3_vision_quantize(k3_vision *v, const k3_quant_options *opt, k3_error *err);
/* Describes the tower (snprintf rules, like k3_model_describe). */
size_t k3_vision_describe(const k3_vision *v, char *buf, size_t size);
/* Width of the rows k3_vision_encode writes (the text hidden size). */
int64_t k3_vision_out_dim(const k3_vision *v);

/* What the processor makes of an image of w x h pixels. */
typedef struct k3_image_plan {
    int32_t width, height;          /* the original size (the prompt's {W}x{H}) */
    int32_t resized_w, resized_h;   /* after the patch-budget resize */
    int32_t grid_t, grid_h, grid_w; /* patches, after padding to the merge grid */
    int32_t n_tokens;               /* rows the image takes in the prompt */
} k3_image_plan;

k3_status k3_vision_plan(const k3_vision *v, int32_t width, int32_t height, k3_image_plan *out, k3_error *err);
/* Floating-point operations of one encode (2 per multiply-add: the matrices
 * per patch or token, and attention's two products), for throughput figures. */
double k3_vision_flops(const k3_vision *v, const k3_image_plan *plan);
/* The processor's output: pixel values [grid_h * grid_w, 3, P, P] (P = patch
 * size), caller-freed, as KimiK3VisionProcessor.preprocess computes them. */
k3_status k3_vision_preprocess(const k3_vision *v, const k3_image *im, float **pixels, k3_image_plan *plan,
                               k3_error *err);
/* The tower, merger and projector over preprocessed pixels:
 * rows [grid_h * grid_w / 4, k3_vision_out_dim], caller-freed. */
k3_status k3_vision_encode_pixels(const k3_vision *v, k3_pool *pool, const float *pixels, const k3_image_plan *plan,
                                  float **rows, k3_error *err);
/* Both: an image to its n_tokens prompt rows. */
k3_status k3_vision_encode(const k3_vision *v, k3_pool *pool, const k3_image *im, float **rows, int32_t *n_rows,
                           k3_error *err);
/* The K3 framing of one image: <|media_begin|> "image {W}x{H}"
 * <|media_content|> n_tokens x <|media_pad|> <|media_end|>; *pad_at gets
 * the index of the first pad (the rows go at pad_at .. pad_at+n_tokens-1).
 * A tokenizer without the media specials is K3_ERR_UNSUPPORTED. *ids is
 * caller-freed. */
k3_status k3_vision_image_prompt(const k3_vision *v, const k3_tokenizer *t, const k3_image_plan *plan, int32_t **ids,
                                 size_t *n_ids, size_t *pad_at, k3_error *err);
/* A prompt with images put in: image i's framing is inserted before ids[at[i]]
 * (at nondecreasing, <= n_ids; images at the same point keep their order),
 * and (*embeds)[p] points at row r of rows[i] for its r-th pad, NULL
 * elsewhere -- ready for k3_batch_seq {.tokens = *out, .embeds = *embeds}.
 * rows[i] holds plans[i].n_tokens rows of k3_vision_out_dim floats and must
 * outlive *embeds. With keys non-NULL, *keys gets one prefix-cache key per
 * position: image_keys[i] (e.g. k3_image_hash) on image i's framing, 0 on
 * text. *out, *embeds and *keys are caller-freed. */
k3_status k3_vision_splice(const k3_vision *v, const k3_tokenizer *t, const int32_t *ids, size_t n_ids,
                           const size_t *at, const k3_image_plan *plans, const float *const *rows,
                           const uint64_t *image_keys, int32_t n_images, int32_t **out, size_t *n_out,
                           const float ***embeds, uint64_t **keys, k3_error *err);

/* An OpenAI chat request with images, for the server: k3_chat_encode_json's
 * messages, where content parts {"type":"image_url","image_url":{"url":...}}
 * (or "image") carry data: URLs (k3_image_decode_url: remote URLs refused,
 * pixels capped at max_pixels, 0 = K3_IMAGE_MAX_PIXELS). Each image is put
 * where its part was, as encoding_k3.py renders it, with one pad per row;
 * the result is ready for the forward pass (ids + embeds) and the prefix
 * cache (keys: k3_image_hash on each image's framing, 0 elsewhere). v may be
 * NULL for a text-only model: an image part is then K3_ERR_UNSUPPORTED with
 * a message. Errors name messages[i].content[j]. Free with k3_vision_prompt_free.
 * The images are decoded and encoded one at a time: what one takes is freed
 * before the next is decoded. */
typedef struct k3_vision_prompt {
    int32_t *ids;
    size_t n_ids;
    const float **embeds; /* [n_ids]: NULL, or a row of rows[] */
    uint64_t *keys;       /* [n_ids] prefix-cache keys; NULL without images */
    float **rows;         /* [n_images] each image's rows */
    k3_image_plan *plans; /* [n_images] */
    int32_t n_images;
} k3_vision_prompt;

k3_status k3_vision_chat_encode_json(const k3_vision *v, const k3_tokenizer *t, k3_pool *pool,
                                     const char *messages_json, const char *tools_json, const k3_chat_options *opt,
                                     int64_t max_pixels, k3_vision_prompt *out, k3_error *err);
void k3_vision_prompt_free(k3_vision_prompt *p);
/* What such messages' images will take, from their headers alone (nothing
 * decoded): their count, decoded pixels and prompt rows (the tower's work).
 * The same errors as k3_vision_chat_encode_json's for a bad or oversized
 * image (v NULL: K3_ERR_UNSUPPORTED at the first image). */
typedef struct k3_vision_cost {
    int32_t n_images;
    int64_t pixels; /* decoded, summed */
    int64_t tokens; /* prompt rows, summed: what the tower computes */
} k3_vision_cost;
k3_status k3_vision_chat_cost(const k3_vision *v, const char *messages_json, int64_t max_pixels, k3_vision_cost *out,
                              k3_error *err);
/* ---- prefill and decode apart: the transfer agent and the proxy (src/pd) --
 *
 * A k3_pd sits beside one instance's engine and server. As a prefill
 * instance it listens on its transfer port and serves holds (k3_engine
 * hold_*) to the decode instances that pull them; as a decode instance it
 * is the engine's pull hook: it connects to the prefill instance a
 * request's kv_transfer_params name (taken only from the proxy, or for a
 * peer of prefill_peers) and writes what arrives into the request's blocks.
 * Every instance of a deployment holds the same secret: a connection starts
 * with a handshake that proves it both ways, then a pull request (a hold's
 * token of 128 random bits and its prompt's hash), then units (one layer's
 * rows for a run of positions, or a piece of the KDA state), each with its
 * length and a MAC; a request for another model, quantization or cache
 * format, or for a hold this prompt did not make, is refused, naming
 * nothing. The prefill side frees a pulled hold when the stream ends, read
 * or not. The server
 * (k3_server_options.pd) reads and writes vLLM's kv_transfer_params
 * (do_remote_decode / do_remote_prefill, remote_engine_id, remote_host,
 * remote_port, remote_block_ids, remote_request_id; and k3's own: the
 * first token, the token count, the model identity). docs/pd.md has the
 * protocol. */
typedef struct k3_pd k3_pd;

typedef struct k3_pd_options {
    k3_engine *engine;          /* borrowed, required */
    const char *host;           /* the transfer listener's address (NULL = "127.0.0.1") */
    int port;                   /* its port (0 = any free port; -1 = none: a decode instance only) */
    const char *advertise_host; /* remote_host in the answers (NULL = host) */
    uint64_t model_id;          /* k3_model_identity */
    const char *quant;          /* the --quant mode (NULL = "none") */
    k3_kv_type kv_cache;
    int32_t block_size;
    double timeout_s;   /* a transfer that moves nothing this long fails (0 = 30) */
    int max_pulls;      /* pulls at once (0 = 8) */
    const char *fault;  /* tests only: NULL, or "flip:U" (a byte of unit U's payload
                                   flipped after its MAC), "stall:U:MS" (sleep before
                                   sending unit U, prefill side; after receiving it, decode side) */
    const void *secret; /* the deployment's transfer secret (required, >= 16 bytes; copied) */
    size_t secret_len;
    const char *prefill_peers; /* decode side: HOST:PORT[,...] whose kv_transfer_params are taken
                                  without the proxy's credential (NULL: none) */
    const char *kv_transport;  /* "tcp" (NULL: the default) or "ucx": the rows by one-sided UCX gets
                                  from where they lie into the decode instance's blocks, where both
                                  sides have UCX (else, and where the prefill side cannot offer its
                                  holds in place, the stream) */
    const char *ucx_tls;       /* the UCX transports (UCX_TLS's syntax; NULL: UCX's own choice) */
} k3_pd_options;

k3_status k3_pd_start(k3_pd **out, const k3_pd_options *opt, k3_error *err);
/* Stops listening and pulling (transfers in flight fail), joins the threads.
 * Before k3_engine_close. */
void k3_pd_stop(k3_pd *pd);
/* The transfer port (-1 without a listener). */
int k3_pd_port(const k3_pd *pd);
/* How transfers move, for the start log: "tcp", "ucx (transports ...)", or
 * "tcp (--kv-transport ucx: why not)" when UCX was asked for and could not
 * be had. */
const char *k3_pd_transport(const k3_pd *pd);

/* The proxy: one OpenAI endpoint in front of prefill and decode instances
 * (k3 serve --role proxy). A generation request goes to the least loaded
 * prefill instance with kv_transfer_params {do_remote_decode: true}, one
 * token, no stream; its answer's kv_transfer_params go with the original
 * request to the least loaded decode instance, whose answer (or stream) is
 * the client's. Other routes go to a decode instance as they are. A backend
 * that cannot be reached is skipped for a while and another tried; when none
 * answers, the client gets an error in its API's shape. It serves through the
 * same HTTP layer as k3_server (limits, deadlines, the key before any body,
 * CORS, the drain); its /health answers 200 while a prefill and a decode
 * instance answer theirs. */
typedef struct k3_proxy k3_proxy;

typedef struct k3_proxy_options {
    const char *host;           /* address to bind (NULL = "127.0.0.1") */
    int port;                   /* 0 = any free port */
    const char *const *prefill; /* [n_prefill] base URLs (http://host:port) */
    int n_prefill;
    const char *const *decode; /* [n_decode] */
    int n_decode;
    const char *api_key;      /* NULL: none; else clients need it (Bearer or x-api-key) and the
                                 proxy passes it on to the instances; "" is refused */
    bool metrics_require_key; /* /metrics needs the key too (open by default) */
    double timeout_s;         /* a backend silent this long fails the request (0 = 600) */
    /* the HTTP layer's limits, as k3_server_options' (0 = its defaults; at most
     * 1024 connections) */
    size_t max_body_bytes;
    int max_connections, max_connections_per_ip;
    int idle_timeout_s, header_timeout_s, body_timeout_s;
    const char *allowed_origins, *allowed_methods, *allowed_headers;
    const void *secret; /* the deployment's transfer secret (required but for a router: the
                           credential on kv_transfer_params, the release of holds) */
    size_t secret_len;
    /* The router (k3 serve --role router): with n_backends > 0 (and no prefill or decode
     * instances) each generation request goes whole to one of backends, colocated instances,
     * by src/router's policy: the instance it sent the longest prefix of the prompt's text
     * (prefix affinity), balanced by load; a backend that fails or whose /health does not
     * answer is skipped, and used again when it answers. /health answers 200 while one does. */
    const char *const *backends;
    int n_backends;
    int router_policy;             /* k3_router_policy: 0 cache-aware, 1 round-robin */
    int router_block_bytes;        /* bytes of the prompt's text per tree node (0 = 64) */
    double router_cache_threshold; /* 0 = 0.5 */
    int router_balance_abs;        /* 0 = 32 */
    double router_balance_rel;     /* 0 = 1.5 */
} k3_proxy_options;

k3_status k3_proxy_start(k3_proxy **out, const k3_proxy_options *opt, k3_error *err);
/* As k3_server_drain, k3_server_in_flight, k3_server_end: new requests 503;
 * requests received and not answered in full; those in flight ended (a
 * stream with its API's error event, a whole answer with a 503 naming why). */
void k3_proxy_drain(k3_proxy *p);
int k3_proxy_in_flight(k3_proxy *p);
void k3_proxy_end(k3_proxy *p, const char *why);
int k3_proxy_port(const k3_proxy *p);
void k3_proxy_stop(k3_proxy *p);

/* ---- server: the OpenAI-compatible HTTP API (src/server) ---------------
 *
 * One libmicrohttpd daemon (a thread per connection) answers /v1/models,
 * /v1/completions, /v1/chat/completions, /v1/responses, Anthropic's
 * /v1/messages, /tokenize, /detokenize, /health, /ready, /metrics, /version
 * and a chat page at /; one engine thread owns the engine and steps it,
 * HTTP threads submit and cancel and wait on their own requests. The server
 * never prints: the caller reads k3_engine_get_stats for its log line and
 * k3_server_failed for a fatal engine error.
 *
 * Every request gets an answer that tells how it ended: when the engine
 * fails, or when the server is shut down (k3_server_drain, then
 * k3_server_end), a stream gets its API's error event (OpenAI's error JSON
 * and [DONE] on completions and chat, response.failed on /v1/responses,
 * Anthropic's event: error on /v1/messages) and the end of its chunked body,
 * and a whole answer a 503 naming why; only a hang-up of the client (or
 * k3_server_stop) ends one silently.
 */

typedef struct k3_server k3_server;

typedef struct k3_server_options {
    const char *host;            /* address or name to bind (NULL = "127.0.0.1") */
    int port;                    /* 0 = any free port (see k3_server_port) */
    const char *api_key;         /* NULL: no key; else every route but /health,
                                  /ready and /metrics needs "Authorization: Bearer
                                  KEY" or "x-api-key: KEY"; "" is refused */
    bool metrics_require_key;    /* /metrics needs the key too */
    const char *model_name;      /* the served model name (required) */
    const k3_tokenizer *tok;     /* borrowed, required */
    k3_engine *engine;           /* borrowed; NULL: the generation routes answer 503 */
    int64_t max_model_len;       /* reported by /v1/models when engine is NULL */
    size_t max_body_bytes;       /* bodies over this are refused unread (0 = 4 MiB) */
    int max_connections;         /* connections at once (0 = 256): one over it takes
                                  the place of the one that has waited longest for
                                  its request line and headers, else is answered 503 */
    int max_connections_per_ip;  /* connections from one address (0 = no cap) */
    int timeout_s;               /* a client idle this long is dropped (0 = 30) */
    int header_timeout_s;        /* the request line and headers must be in this long
                                  after the connection opened or its previous answer
                                  went out (0 = 10) */
    int body_timeout_s;          /* the body must be in this long after the headers (0 = 60) */
    double step_timeout_s;       /* /health and /ready answer 503 while one engine step
                                  has run longer than this (0 = 300) */
    const char *allowed_origins; /* CORS: a comma-separated list of origins that may
                                  call from a browser, "*" for any; NULL or "": only
                                  the server's own origin. A request with any other
                                  Origin is refused 403 */
    const char *allowed_methods; /* for preflights (NULL = "GET, POST, OPTIONS") */
    const char *allowed_headers; /* for preflights (NULL = "*": those asked for) */
    const char *version;         /* /version (NULL = "k3") */
    const k3_vision *vision;     /* borrowed; NULL: a text-only model (chat image
                                  parts answer 400) */
    k3_pool *vision_pool;        /* borrowed; the image encodes' own pool (never
                                  the engine's), used by one request at a time, in
                                  the order they came; NULL = one thread */
    int64_t max_image_pixels;    /* per image (0 = K3_IMAGE_MAX_PIXELS) */
    bool no_ui;                  /* no chat page at / (a 404 there) */
    /* a request's images together, read from their headers before any is
     * decoded: their decoded pixels (0 = 4 x K3_IMAGE_MAX_PIXELS) and their
     * prompt rows, the vision tower's work (0 = the engine's max_model_len);
     * over either: 400 naming the limit */
    int64_t max_request_image_pixels, max_request_image_tokens;
    /* tests only: the engine thread fails at its step test_fail_step (1 = the
     * first), as a failed k3_engine_step would; engine request number
     * test_fail_request (1 = the first submitted) fails alone */
    int64_t test_fail_step, test_fail_request;
    k3_pd *pd;                      /* borrowed; NULL: kv_transfer_params are refused (not a
                                  prefill or decode instance) */
    bool prefix_cache_per_key;      /* the prefix cache's salt includes the API key a
                                  request presents: one key's requests never hit
                                  another's cached prompts (nor time them) */
    struct k3_kv_events *kv_events; /* borrowed; its counters go to /metrics (NULL: none) */
} k3_server_options;

k3_status k3_server_start(k3_server **out, const k3_server_options *opt, k3_error *err);
/* The port the server listens on. */
int k3_server_port(const k3_server *s);
/* True (and *err filled) once the engine thread met an error it cannot go on
 * from; every request in flight then has had its error ending. */
bool k3_server_failed(k3_server *s, k3_error *err);
/* Stops taking requests: from now on each new one is answered 503 with
 * Retry-After (and Connection: close), /health and /ready 503; the requests
 * in flight go on. */
void k3_server_drain(k3_server *s);
/* Requests received and not yet answered in full. */
int k3_server_in_flight(k3_server *s);
/* Ends every request still in flight with its error ending (503, why);
 * returns at once, the answers go out on their own threads. */
void k3_server_end(k3_server *s, const char *why);
/* Stops listening, cuts what still runs, joins the threads. */
void k3_server_stop(k3_server *s);

#ifdef __cplusplus
}
#endif
#endif /* K3_H */
