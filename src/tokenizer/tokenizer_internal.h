/*
 * tokenizer_internal.h -- what the tokenizer files share, and the hooks the
 * tests use. Nothing outside src/tokenizer/ and tests/ includes this.
 *
 * k3_bpe holds the ranks of a .tiktoken file: token bytes by rank (for
 * decoding) and a hash map bytes -> rank (for merging). Ranks are the ids of
 * ordinary tokens, 0..n_ranks-1 with no gaps; special ids follow them.
 * A loaded k3_bpe is read-only and may be shared between threads.
 */
#ifndef K3_TOKENIZER_INTERNAL_H
#define K3_TOKENIZER_INTERNAL_H

#include "k3.h"
#include "tokenizer/pretok.h"

/* ---- growable id vector ------------------------------------------------- */

typedef struct k3_ids {
    int32_t *v; /* owned; hand it to the caller or free() it */
    size_t n, cap;
} k3_ids;

k3_status k3_ids_push(k3_ids *ids, int32_t id, k3_error *err);

/* ---- rank BPE (bpe.c) --------------------------------------------------- */

typedef struct k3_bpe_slot {
    uint32_t hash; /* full hash of the token bytes */
    int32_t rank;  /* -1 = empty slot */
} k3_bpe_slot;

typedef struct k3_bpe {
    int32_t n_ranks;
    uint8_t *bytes;     /* token bytes of every rank, back to back */
    uint32_t *offset;   /* [n_ranks + 1]: rank r is bytes[offset[r], offset[r+1]) */
    k3_bpe_slot *slots; /* open addressing, linear probing */
    uint32_t mask;      /* number of slots - 1 (a power of two) */
    size_t heap_min;    /* pieces this long or longer merge with a heap */
} k3_bpe;

/* Parses the text of a .tiktoken file (`base64(bytes) rank` per line; blank
 * lines skipped). name appears in error messages. Errors name the 1-based
 * line. On failure *b is left empty (k3_bpe_free is still safe). */
k3_status k3_bpe_parse(k3_bpe *b, const char *text, size_t len, const char *name, k3_error *err);
/* Reads and parses a .tiktoken file. */
k3_status k3_bpe_load(k3_bpe *b, const char *path, k3_error *err);
void k3_bpe_free(k3_bpe *b);

/* Rank of a byte string, or -1. */
int32_t k3_bpe_rank(const k3_bpe *b, const uint8_t *s, size_t n);

/* Appends the ids of one pre-tokenized piece (n >= 1), exactly as tiktoken's
 * byte_pair_encode: a piece that is a token is that token; otherwise pairs
 * merge lowest rank first, leftmost among equal ranks. */
k3_status k3_bpe_encode_piece(const k3_bpe *b, const uint8_t *s, size_t n, k3_ids *out, k3_error *err);

/* Default of k3_bpe.heap_min. Below it the quadratic scan of tiktoken's
 * _byte_pair_merge is faster; above it, a heap keeps long pieces O(n log n). */
#define K3_BPE_HEAP_MIN 256

/* ---- the tokenizer object (tokenizer.c) --------------------------------- */

/* Number of special ids after the ranks when a tokenizer_config.json is
 * given (Kimi's num_reserved_special_tokens). */
#define K3_N_SPECIALS 256

struct k3_tokenizer {
    k3_bpe bpe;
    k3_pretok *pretok;
    k3_pattern pattern;  /* KIMI adds the 400,000-character chunks of encode */
    int32_t n_specials;  /* 0 without a config, else K3_N_SPECIALS */
    char **special_name; /* [n_specials], id = n_ranks + i; owned */
    size_t *special_len; /* [n_specials] */
    char *config;        /* the text of tokenizer_config.json, or NULL (tokenizer_info.c) */
    size_t config_len;
};

/* Opens a tokenizer from explicit paths: the rank file, and a
 * tokenizer_config.json (NULL = no specials; if given it must exist).
 * k3_tokenizer_open(dir) is open_paths(dir/tiktoken.model,
 * dir/tokenizer_config.json, KIMI), except that a missing config there gives
 * 256 reserved specials. Tests use this to pair a config with a rank file
 * kept elsewhere. */
k3_status k3_tokenizer_open_paths(k3_tokenizer **out, const char *vocab_path, const char *config_path,
                                  k3_pattern pattern, k3_error *err);

/* Long texts are encoded in slices, as Kimi's tokenization_kimi.py does
 * (after Llama 3, for tiktoken issue 195): chunks of at most
 * K3_ENCODE_CHUNK_CHARS code points (Kimi pattern only), each cut so that no
 * slice holds more than K3_ENCODE_MAX_RUN consecutive whitespace (Python's
 * str.isspace) or non-whitespace code points; the regex then runs on each
 * slice. Text without such runs (and, for Kimi, under 400,000 code points)
 * is encoded whole, exactly as before. */
#define K3_ENCODE_CHUNK_CHARS 400000
#define K3_ENCODE_MAX_RUN 25000

/* Appends the ids of ordinary text (validated UTF-8 first) to out. */
k3_status k3_tokenizer_encode_append(const k3_tokenizer *t, const char *text, size_t len, k3_ids *out, k3_error *err);

#endif /* K3_TOKENIZER_INTERNAL_H */
