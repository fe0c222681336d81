/*
 * tokenizer.c -- the k3_tokenizer API of k3.h: a rank file, a split pattern
 * and, for a model directory, the special ids of tokenizer_config.json.
 *
 * Ids: 0..n_ranks-1 are the ranks of the .tiktoken file; with a config,
 * n_ranks..n_ranks+255 are specials, named by `added_tokens_decoder` or else
 * `<|reserved_token_{id}|>` (tokenization_kimi.py). Encoding treats all text
 * as ordinary: a special's name in the input is split and merged like any
 * other text; only k3_chat_encode emits special ids.
 */
#include "tokenizer/tokenizer_internal.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "common/file.h"
#include "common/json_guard.h"

/* ---- specials from tokenizer_config.json -------------------------------- */

static k3_status set_special(k3_tokenizer *t, int32_t i, const char *name, k3_error *err) {
    size_t n = strlen(name);
    char *s = malloc(n + 1);
    if (!s) return k3_err(err, K3_ERR_NOMEM, "out of memory for special token names");
    memcpy(s, name, n + 1);
    free(t->special_name[i]);
    t->special_name[i] = s;
    t->special_len[i] = n;
    return K3_OK;
}

/* Names the specials of added_tokens_decoder: {"163584": {"content": "[BOS]",
 * ...}, ...}. Ids must lie in the special range. */
static k3_status read_config(k3_tokenizer *t, const char *path, k3_error *err) {
    int32_t n_ranks = t->bpe.n_ranks;
    char *text;
    size_t len;
    k3_status rs = k3_file_read(path, (size_t)16 << 20, "a tokenizer config", &text, &len, err);
    if (rs != K3_OK) return rs;
    if (k3_json_too_deep(text, len, 64)) {
        free(text);
        return k3_err(err, K3_ERR_FORMAT, "%s: JSON nests deeper than 64 levels", path);
    }
    json_error_t je;
    json_t *root = json_loadb(text, len, 0, &je);
    if (!root) {
        free(text);
        return k3_err(err, K3_ERR_FORMAT, "%s:%d: %s", path, je.line, je.text);
    }
    free(t->config);
    t->config = text; /* kept for the server's /tokenizer_info */
    t->config_len = len;

    k3_status st = K3_OK;
    json_t *dec = json_object_get(root, "added_tokens_decoder");
    if (dec && !json_is_object(dec)) st = k3_err(err, K3_ERR_FORMAT, "%s: added_tokens_decoder is not an object", path);
    const char *key;
    json_t *val;
    json_object_foreach(dec, key, val) {
        if (st != K3_OK) break;
        char *end;
        long long id = strtoll(key, &end, 10);
        const char *name = json_string_value(json_object_get(val, "content"));
        if (!*key || *end || id < n_ranks || id >= (long long)n_ranks + K3_N_SPECIALS)
            st = k3_err(err, K3_ERR_FORMAT,
                        "%s: added token id \"%s\" is outside the special range %d..%d "
                        "(the rank file has %d tokens)",
                        path, key, n_ranks, n_ranks + K3_N_SPECIALS - 1, n_ranks);
        else if (!name || !*name)
            st = k3_err(err, K3_ERR_FORMAT, "%s: added token %s has no \"content\" string", path, key);
        else st = set_special(t, (int32_t)(id - n_ranks), name, err);
    }
    json_decref(root);
    return st;
}

/* The 256 specials: named by the config when path is given, the rest
 * `<|reserved_token_{id}|>`. */
static k3_status load_specials(k3_tokenizer *t, const char *path, k3_error *err) {
    int32_t n_ranks = t->bpe.n_ranks;
    t->special_name = calloc(K3_N_SPECIALS, sizeof *t->special_name);
    t->special_len = calloc(K3_N_SPECIALS, sizeof *t->special_len);
    if (!t->special_name || !t->special_len) return k3_err(err, K3_ERR_NOMEM, "out of memory for special tokens");
    t->n_specials = K3_N_SPECIALS;
    k3_status st = path ? read_config(t, path, err) : K3_OK;
    for (int32_t i = 0; i < K3_N_SPECIALS && st == K3_OK; i++) {
        if (t->special_name[i]) continue;
        char name[48];
        snprintf(name, sizeof name, "<|reserved_token_%d|>", n_ranks + i);
        st = set_special(t, i, name, err);
    }
    /* k3_tokenizer_special looks names up, so they must be unique. */
    for (int32_t i = 0; i < K3_N_SPECIALS && st == K3_OK; i++)
        for (int32_t k = i + 1; k < K3_N_SPECIALS && st == K3_OK; k++)
            if (!strcmp(t->special_name[i], t->special_name[k]))
                st = k3_err(err, K3_ERR_FORMAT, "%s: ids %d and %d are both named %s", path ? path : "tokenizer",
                            n_ranks + i, n_ranks + k, t->special_name[i]);
    return st;
}

/* ---- open / free -------------------------------------------------------- */

/* with_specials without a config_path: all 256 specials reserved. */
static k3_status open_impl(k3_tokenizer **out, const char *vocab_path, const char *config_path, bool with_specials,
                           k3_pattern pattern, k3_error *err) {
    *out = NULL;
    k3_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return k3_err(err, K3_ERR_NOMEM, "out of memory opening a tokenizer");
    t->pattern = pattern;
    k3_status st = k3_pretok_init(&t->pretok, pattern, err);
    if (st == K3_OK) st = k3_bpe_load(&t->bpe, vocab_path, err);
    if (st == K3_OK && with_specials) st = load_specials(t, config_path, err);
    if (st != K3_OK) {
        k3_tokenizer_free(t);
        return st;
    }
    *out = t;
    return K3_OK;
}

k3_status k3_tokenizer_open_paths(k3_tokenizer **out, const char *vocab_path, const char *config_path,
                                  k3_pattern pattern, k3_error *err) {
    return open_impl(out, vocab_path, config_path, config_path != NULL, pattern, err);
}

/* A model directory without tokenizer_config.json still has the 256 special
 * ids (the checkpoint's vocab_size counts them), all with reserved names;
 * the chat format then reports the missing control tokens. */
k3_status k3_tokenizer_open(k3_tokenizer **out, const char *dir, k3_error *err) {
    size_t n = strlen(dir) + 32;
    char *vocab = malloc(n), *config = malloc(n);
    k3_status st;
    if (!vocab || !config) {
        st = k3_err(err, K3_ERR_NOMEM, "out of memory opening a tokenizer");
    } else {
        snprintf(vocab, n, "%s/tiktoken.model", dir);
        snprintf(config, n, "%s/tokenizer_config.json", dir);
        bool have_config = access(config, F_OK) == 0 || errno != ENOENT;
        st = open_impl(out, vocab, have_config ? config : NULL, true, K3_PATTERN_KIMI, err);
    }
    free(vocab);
    free(config);
    return st;
}

k3_status k3_tokenizer_open_file(k3_tokenizer **out, const char *path, k3_pattern pattern, k3_error *err) {
    return k3_tokenizer_open_paths(out, path, NULL, pattern, err);
}

void k3_tokenizer_free(k3_tokenizer *t) {
    if (!t) return;
    k3_bpe_free(&t->bpe);
    k3_pretok_free(t->pretok);
    if (t->special_name)
        for (int32_t i = 0; i < t->n_specials; i++) free(t->special_name[i]);
    free(t->special_name);
    free(t->special_len);
    free(t->config);
    free(t);
}

/* ---- queries ------------------------------------------------------------ */

int32_t k3_tokenizer_n_vocab(const k3_tokenizer *t) { return t->bpe.n_ranks + t->n_specials; }

int32_t k3_tokenizer_special(const k3_tokenizer *t, const char *name) {
    for (int32_t i = 0; i < t->n_specials; i++)
        if (!strcmp(t->special_name[i], name)) return t->bpe.n_ranks + i;
    return -1;
}

int32_t k3_tokenizer_eos_ids(const k3_tokenizer *t, int32_t out[K3_MAX_EOS_IDS]) {
    static const char *const names[K3_MAX_EOS_IDS] = {"[EOS]", "<|end_of_msg|>"};
    int32_t n = 0;
    for (int i = 0; i < K3_MAX_EOS_IDS; i++) {
        const int32_t id = k3_tokenizer_special(t, names[i]);
        if (id >= 0) out[n++] = id;
    }
    return n;
}

bool k3_tokenizer_is_eos(const k3_tokenizer *t, int32_t id) {
    int32_t ids[K3_MAX_EOS_IDS];
    const int32_t n = k3_tokenizer_eos_ids(t, ids);
    for (int32_t i = 0; i < n; i++)
        if (ids[i] == id) return true;
    return false;
}

bool k3_tokenizer_is_special(const k3_tokenizer *t, int32_t id) {
    return id >= t->bpe.n_ranks && id < k3_tokenizer_n_vocab(t);
}

const char *k3_tokenizer_token(const k3_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= k3_tokenizer_n_vocab(t)) return NULL;
    if (id >= t->bpe.n_ranks) {
        int32_t i = id - t->bpe.n_ranks;
        if (len) *len = t->special_len[i];
        return t->special_name[i];
    }
    uint32_t off = t->bpe.offset[id];
    if (len) *len = t->bpe.offset[id + 1] - off;
    return (const char *)t->bpe.bytes + off;
}

/* ---- encode / decode ---------------------------------------------------- */

typedef struct encode_ctx {
    const k3_bpe *bpe;
    k3_ids *out;
    k3_error *err;
} encode_ctx;

static k3_status encode_piece(void *ctx, const char *piece, size_t len) {
    encode_ctx *c = ctx;
    return k3_bpe_encode_piece(c->bpe, (const uint8_t *)piece, len, c->out, c->err);
}

/* Python's str.isspace: Unicode White_Space plus the separators \x1c-\x1f. */
static bool py_isspace(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
        (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* The code point at s[*i] of valid UTF-8; advances *i. */
static uint32_t utf8_next(const unsigned char *s, size_t *i) {
    const unsigned char b = s[*i];
    if (b < 0x80) return s[(*i)++];
    const int n = b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : 1;
    uint32_t c = b & (0x3F >> n);
    for (int k = 1; k <= n; k++) c = c << 6 | (s[*i + k] & 0x3F);
    *i += (size_t)n + 1;
    return c;
}

k3_status k3_tokenizer_encode_append(const k3_tokenizer *t, const char *text, size_t len, k3_ids *out, k3_error *err) {
    size_t bad;
    if (!k3_utf8_check(text, len, &bad)) return k3_err(err, K3_ERR_ARG, "invalid UTF-8 at byte %zu", bad);
    encode_ctx c = {&t->bpe, out, err};
    /* fewer bytes than a run limit: no slicing can apply */
    if (len <= K3_ENCODE_MAX_RUN) return k3_pretok_split(t->pretok, text, len, encode_piece, &c, err);
    const unsigned char *s = (const unsigned char *)text;
    const bool chunks = t->pattern == K3_PATTERN_KIMI;
    size_t i = 0, start = 0, chunk_chars = 0, run = 0;
    bool run_space = false;
    k3_status st = K3_OK;
    while (i < len && st == K3_OK) {
        const size_t at = i;
        const bool sp = py_isspace(utf8_next(s, &i));
        if (chunks && chunk_chars == K3_ENCODE_CHUNK_CHARS) {
            st = k3_pretok_split(t->pretok, text + start, at - start, encode_piece, &c, err);
            start = at;
            chunk_chars = 0;
            run = 0;
        }
        if (run == 0 || sp != run_space) {
            run = 1;
            run_space = sp;
        } else if (++run > K3_ENCODE_MAX_RUN) {
            if (st == K3_OK) st = k3_pretok_split(t->pretok, text + start, at - start, encode_piece, &c, err);
            start = at;
            run = 1;
        }
        chunk_chars++;
    }
    if (st == K3_OK && start < len) st = k3_pretok_split(t->pretok, text + start, len - start, encode_piece, &c, err);
    return st;
}

k3_status k3_tokenizer_encode(const k3_tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n_ids,
                              k3_error *err) {
    *ids = NULL;
    *n_ids = 0;
    k3_ids v = {0};
    /* Reserve about one id per 4 bytes (English averages a little more), so
     * that an empty text still returns a non-NULL array. */
    v.cap = len / 4 + 16;
    v.v = malloc(v.cap * sizeof *v.v);
    if (!v.v) return k3_err(err, K3_ERR_NOMEM, "out of memory encoding %zu bytes", len);
    k3_status st = k3_tokenizer_encode_append(t, text, len, &v, err);
    if (st != K3_OK) {
        free(v.v);
        return st;
    }
    *ids = v.v;
    *n_ids = v.n;
    return K3_OK;
}

k3_status k3_tokenizer_decode(const k3_tokenizer *t, const int32_t *ids, size_t n_ids, char **out, size_t *len,
                              k3_error *err) {
    *out = NULL;
    *len = 0;
    size_t total = 0, tl;
    for (size_t i = 0; i < n_ids; i++) {
        if (!k3_tokenizer_token(t, ids[i], &tl))
            return k3_err(err, K3_ERR_ARG,
                          "token id %d at position %zu is out of range "
                          "(vocabulary of %d)",
                          ids[i], i, k3_tokenizer_n_vocab(t));
        total += tl;
    }
    char *s = malloc(total + 1);
    if (!s) return k3_err(err, K3_ERR_NOMEM, "out of memory decoding %zu ids", n_ids);
    size_t at = 0;
    for (size_t i = 0; i < n_ids; i++) {
        const char *tok = k3_tokenizer_token(t, ids[i], &tl);
        memcpy(s + at, tok, tl);
        at += tl;
    }
    s[at] = 0;
    *out = s;
    *len = at;
    return K3_OK;
}
