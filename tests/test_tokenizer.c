/*
 * test_tokenizer.c -- rank BPE, split patterns, specials and the chat format
 * against the goldens of tools/gen_tokenizer_goldens.py (tiktoken and the
 * regex package), plus malformed input.
 *
 * The o200k/cl100k rank files are the repository's copies in data/tokenizers
 * (see data/tokenizers/README.md); a missing file is a failure.
 */
#include "test.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "k3.h"
#include "tokenizer/pretok.h"
#include "tokenizer/tokenizer_internal.h"

#define GOLDEN "tests/golden/tokenizer/"
#define O200K "data/tokenizers/o200k_base.tiktoken"
#define CL100K "data/tokenizers/cl100k_base.tiktoken"
#define KIMI_CONFIG GOLDEN "kimi-o200k/tokenizer_config.json"
#define O200K_RANKS 199998

/* ---- helpers ------------------------------------------------------------ */

static char *read_all(const char *rel, size_t *len) {
    FILE *f = fopen(rel, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        cap *= 2;
        char *nb = realloc(buf, cap + 1);
        if (!nb) free(buf);
        buf = nb;
    }
    fclose(f);
    if (buf) buf[n] = 0;
    if (len) *len = n;
    return buf;
}

/* Whitespace- or comma-separated integers. */
static int32_t *parse_ints(const char *s, size_t *n) {
    size_t cap = 64;
    int32_t *v = malloc(cap * sizeof *v);
    *n = 0;
    while (v && *s) {
        char *end;
        long x = strtol(s, &end, 10);
        if (end == s) {
            s++;
            continue;
        }
        if (*n == cap) v = realloc(v, (cap *= 2) * sizeof *v);
        if (v) v[(*n)++] = (int32_t)x;
        s = end;
    }
    return v;
}

static int32_t *read_ints(const char *rel, size_t *n) {
    char *s = read_all(rel, NULL);
    if (!s) return NULL;
    int32_t *v = parse_ints(s, n);
    free(s);
    return v;
}

/* Names listed in cases.txt; a NULL-terminated array of strings. */
static char **read_cases(void) {
    char *s = read_all(GOLDEN "cases.txt", NULL);
    if (!s) return NULL;
    size_t n = 0;
    for (char *p = s; *p; p++) n += *p == '\n';
    char **names = calloc(n + 1, sizeof *names);
    size_t i = 0;
    for (char *tok = strtok(s, "\n"); tok && i < n; tok = strtok(NULL, "\n")) names[i++] = strdup(tok);
    free(s);
    return names;
}

static void free_cases(char **names) {
    for (char **p = names; p && *p; p++) free(*p);
    free(names);
}

static k3_tokenizer *open_file(const char *rel, k3_pattern pat) {
    k3_tokenizer *t = NULL;
    k3_error err = {0};
    if (k3_tokenizer_open_file(&t, rel, pat, &err) != K3_OK)
        k3_test_fail(__FILE__, __LINE__,
                     "%s (the rank files are committed in data/tokenizers: "
                     "`git checkout -- data/tokenizers`)",
                     err.msg);
    return t;
}

static k3_tokenizer *open_kimi(void) {
    k3_tokenizer *t = NULL;
    k3_error err = {0};
    if (k3_tokenizer_open_paths(&t, O200K, KIMI_CONFIG, K3_PATTERN_KIMI, &err) != K3_OK)
        k3_test_fail(__FILE__, __LINE__,
                     "%s (the rank files are committed in data/tokenizers: "
                     "`git checkout -- data/tokenizers`)",
                     err.msg);
    return t;
}

/* Encodes every golden case and compares with NAME.<suffix>.ids; checks
 * decode(encode(x)) == x. Returns the number of tokens compared. */
static size_t check_goldens(const k3_tokenizer *t, const char *suffix) {
    char **names = read_cases();
    CHECKF(names && names[0], "cannot read " GOLDEN "cases.txt");
    size_t total = 0;
    for (char **name = names; name && *name; name++) {
        char path[512];
        size_t len, n_want, n_got, out_len;
        snprintf(path, sizeof path, GOLDEN "%s.txt", *name);
        char *text = read_all(path, &len);
        snprintf(path, sizeof path, GOLDEN "%s.%s.ids", *name, suffix);
        int32_t *want = read_ints(path, &n_want);
        CHECKF(text && want, "cannot read golden %s", path);
        if (!text || !want) {
            free(text);
            free(want);
            continue;
        }
        int32_t *got = NULL;
        char *back = NULL;
        k3_error err = {0};
        k3_status st = k3_tokenizer_encode(t, text, len, &got, &n_got, &err);
        CHECKF(st == K3_OK, "%s: %s", *name, err.msg);
        if (st == K3_OK) {
            size_t i = 0;
            while (i < n_got && i < n_want && got[i] == want[i]) i++;
            CHECKF(i == n_got && i == n_want, "%s.%s: first difference at token %zu of %zu/%zu (got %d, want %d)",
                   *name, suffix, i, n_got, n_want, i < n_got ? got[i] : -1, i < n_want ? want[i] : -1);
            st = k3_tokenizer_decode(t, got, n_got, &back, &out_len, &err);
            CHECKF(st == K3_OK && out_len == len && !memcmp(back, text, len), "%s: decode(encode(x)) != x", *name);
            total += n_got;
        }
        free(back);
        free(got);
        free(want);
        free(text);
    }
    free_cases(names);
    return total;
}

/* 256 single-byte tokens (rank = byte) followed by extra lines. */
static char *vocab_text(const char *extra) {
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t n = 256 * 16 + strlen(extra) + 1;
    char *s = malloc(n), *p = s;
    for (int c = 0; c < 256; c++) p += sprintf(p, "%c%c== %d\n", b64[c >> 2], b64[(c & 3) << 4], c);
    strcpy(p, extra);
    return s;
}

/* Writes the .tiktoken line of the NUL-terminated token s at e; returns the
 * end of the line. */
static char *b64_line(char *e, const char *s, int rank) {
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t n = strlen(s);
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)(unsigned char)s[i] << 16;
        if (i + 1 < n) v |= (uint32_t)(unsigned char)s[i + 1] << 8;
        if (i + 2 < n) v |= (unsigned char)s[i + 2];
        *e++ = b64[v >> 18];
        *e++ = b64[v >> 12 & 63];
        *e++ = i + 1 < n ? b64[v >> 6 & 63] : '=';
        *e++ = i + 2 < n ? b64[v & 63] : '=';
    }
    return e + sprintf(e, " %d\n", rank);
}

static k3_status parse_vocab(const char *extra, k3_bpe *b, k3_error *err) {
    char *s = vocab_text(extra);
    k3_status st = k3_bpe_parse(b, s, strlen(s), "test.tiktoken", err);
    free(s);
    return st;
}

/* ---- golden ids --------------------------------------------------------- */

K3_TEST(tokenizer_o200k_golden) {
    k3_tokenizer *t = open_file(O200K, K3_PATTERN_O200K);
    REQUIRE(t);
    CHECK(k3_tokenizer_n_vocab(t) == O200K_RANKS);
    CHECK(check_goldens(t, "o200k") > 10000);
    k3_tokenizer_free(t);
}

K3_TEST(tokenizer_cl100k_golden) {
    k3_tokenizer *t = open_file(CL100K, K3_PATTERN_CL100K);
    REQUIRE(t);
    CHECK(k3_tokenizer_n_vocab(t) == 100256);
    CHECK(check_goldens(t, "cl100k") > 10000);
    k3_tokenizer_free(t);
}

/* Kimi's pattern over the o200k ranks, against tiktoken given Kimi's pat_str. */
K3_TEST(tokenizer_kimi_golden) {
    k3_tokenizer *t = open_kimi();
    REQUIRE(t);
    CHECK(check_goldens(t, "kimi") > 10000);
    k3_tokenizer_free(t);
}

/* Both merge paths must give tiktoken's ids: force the heap on every piece,
 * then the quadratic scan on every piece (long_runs has 3000-byte pieces). */
K3_TEST(tokenizer_merge_paths_golden) {
    k3_tokenizer *t = open_file(O200K, K3_PATTERN_O200K);
    REQUIRE(t);
    t->bpe.heap_min = 2;
    check_goldens(t, "o200k");
    t->bpe.heap_min = SIZE_MAX;
    check_goldens(t, "o200k");
    k3_tokenizer_free(t);
}

/* ---- Kimi's split pattern against the regex package --------------------- */

typedef struct piece_list {
    size_t n, cap, at, gap;
    int32_t *len;
    const char *text;
} piece_list;

static k3_status collect(void *ctx, const char *piece, size_t len) {
    piece_list *l = ctx;
    if ((size_t)(piece - l->text) != l->at) l->gap++;
    l->at = (size_t)(piece - l->text) + len;
    if (l->n == l->cap) l->len = realloc(l->len, (l->cap = l->cap * 2 + 64) * sizeof *l->len);
    if (!l->len) return K3_ERR_NOMEM;
    l->len[l->n++] = (int32_t)len;
    return K3_OK;
}

K3_TEST(tokenizer_kimi_split_golden) {
    k3_pretok *p = NULL;
    k3_error err = {0};
    REQUIREF(k3_pretok_init(&p, K3_PATTERN_KIMI, &err) == K3_OK, "%s", err.msg);
    char **names = read_cases();
    REQUIRE(names && names[0]);
    for (char **name = names; *name; name++) {
        char path[512];
        size_t len, n_want;
        snprintf(path, sizeof path, GOLDEN "%s.txt", *name);
        char *text = read_all(path, &len);
        snprintf(path, sizeof path, GOLDEN "%s.kimi.split", *name);
        int32_t *want = read_ints(path, &n_want);
        CHECKF(text && want, "cannot read golden %s", path);
        if (text && want) {
            piece_list l = {.text = text};
            CHECK(k3_pretok_split(p, text, len, collect, &l, &err) == K3_OK);
            CHECKF(l.gap == 0 && l.at == len, "%s: pieces do not cover the text", *name);
            size_t i = 0;
            while (i < l.n && i < n_want && l.len[i] == want[i]) i++;
            CHECKF(i == l.n && i == n_want, "%s: first different piece %zu of %zu/%zu (len %d, want %d)", *name, i, l.n,
                   n_want, i < l.n ? l.len[i] : -1, i < n_want ? want[i] : -1);
            free(l.len);
        }
        free(text);
        free(want);
    }
    free_cases(names);
    k3_pretok_free(p);
}

/* The properties the pattern transcriptions rely on (pretok.h). */
K3_TEST(tokenizer_pattern_classes) {
    k3_pretok *p = NULL;
    k3_error err = {0};
    REQUIRE(k3_pretok_init(&p, K3_PATTERN_KIMI, &err) == K3_OK);
    struct {
        const char *text;
        size_t n_pieces;
    } cases[] = {
        {"漢字。", 2},          /* 。 is Han only by Script_Extensions */
        {"漢々〆", 2},          /* 々 is Script=Han, 〆 is Common */
        {"x  \xe1\xa0\x8e", 3}, /* U+180E is not White_Space: x | " " | " U+180E" */
        {"x  \n", 2},           /* "x" | "  \n" */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        piece_list l = {.text = cases[i].text};
        CHECK(k3_pretok_split(p, cases[i].text, strlen(cases[i].text), collect, &l, &err) == K3_OK);
        CHECKF(l.n == cases[i].n_pieces, "\"%s\": %zu pieces, want %zu", cases[i].text, l.n, cases[i].n_pieces);
        free(l.len);
    }
    k3_pretok_free(p);
}

/* ---- merging ------------------------------------------------------------ */

/* Heap and scan agree on random strings over a small alphabet, with a vocab
 * full of overlapping merges and equal-priority ties. */
K3_TEST(tokenizer_merge_paths_random) {
    /* Every string of 2..4 letters over {a,b,c} is a token, ranks in a
     * scrambled order so merges happen all over the piece. */
    char extra[8192], *e = extra;
    int rank = 256;
    uint32_t seed = 12345;
    char words[200][5];
    int n_words = 0;
    for (int len = 2; len <= 4; len++) {
        int count = len == 2 ? 9 : len == 3 ? 27 : 81;
        for (int k = 0; k < count; k++) {
            int x = k;
            for (int i = 0; i < len; i++) words[n_words][i] = (char)('a' + x % 3), x /= 3;
            words[n_words][len] = 0;
            n_words++;
        }
    }
    for (int i = n_words - 1; i > 0; i--) { /* shuffle, keeping 2-letter words first */
        seed = seed * 1103515245u + 12345u;
        int lo = i < 9 ? 0 : 9, j = lo + (int)((seed >> 8) % (uint32_t)(i - lo + 1));
        char tmp[5];
        memcpy(tmp, words[i], 5), memcpy(words[i], words[j], 5), memcpy(words[j], tmp, 5);
    }
    for (int w = 0; w < n_words; w++) e = b64_line(e, words[w], rank++);
    k3_bpe b;
    k3_error err = {0};
    REQUIREF(parse_vocab(extra, &b, &err) == K3_OK, "%s", err.msg);
    for (int trial = 0; trial < 300; trial++) {
        char s[700];
        seed = seed * 1103515245u + 12345u;
        size_t n = 2 + (seed >> 8) % 600;
        for (size_t i = 0; i < n; i++) {
            seed = seed * 1103515245u + 12345u;
            s[i] = (char)('a' + (seed >> 16) % 3);
        }
        k3_ids x = {0}, y = {0};
        b.heap_min = 2;
        CHECK(k3_bpe_encode_piece(&b, (const uint8_t *)s, n, &x, &err) == K3_OK);
        b.heap_min = SIZE_MAX;
        CHECK(k3_bpe_encode_piece(&b, (const uint8_t *)s, n, &y, &err) == K3_OK);
        CHECKF(x.n == y.n && !memcmp(x.v, y.v, x.n * sizeof *x.v), "trial %d (n=%zu) differs", trial, n);
        free(x.v);
        free(y.v);
    }
    k3_bpe_free(&b);
}

/* A megabyte without a space is one piece: the heap merge and PCRE2's JIT
 * stack fallback must both cope. */
K3_TEST(tokenizer_long_piece) {
    k3_tokenizer *t = open_kimi();
    REQUIRE(t);
    size_t n = 1 << 20;
    char *s = malloc(n);
    REQUIRE(s);
    for (size_t i = 0; i < n; i++) s[i] = "xyzw"[(i * 7 + i / 13) % 4];
    int32_t *ids = NULL;
    size_t n_ids, len;
    char *back = NULL;
    k3_error err = {0};
    CHECKF(k3_tokenizer_encode(t, s, n, &ids, &n_ids, &err) == K3_OK, "%s", err.msg);
    CHECK(k3_tokenizer_decode(t, ids, n_ids, &back, &len, &err) == K3_OK);
    CHECK(back && len == n && !memcmp(back, s, n));
    free(ids);
    free(back);
    free(s);
    k3_tokenizer_free(t);
}

/* ---- specials and the chat format --------------------------------------- */

K3_TEST(tokenizer_specials) {
    k3_tokenizer *t = open_kimi();
    REQUIRE(t);
    CHECK(k3_tokenizer_n_vocab(t) == O200K_RANKS + 256);
    CHECK(k3_tokenizer_special(t, "[BOS]") == O200K_RANKS);
    CHECK(k3_tokenizer_special(t, "<|end_of_msg|>") == O200K_RANKS + 2);
    CHECK(k3_tokenizer_special(t, "<|sep|>") == O200K_RANKS + 5);
    CHECK(k3_tokenizer_special(t, "[PAD]") == O200K_RANKS + 255);
    CHECK(k3_tokenizer_special(t, "<|reserved_token_200004|>") == 200004);
    CHECK(k3_tokenizer_special(t, "<|endoftext|>") == -1);
    CHECK(!k3_tokenizer_is_special(t, O200K_RANKS - 1));
    CHECK(k3_tokenizer_is_special(t, O200K_RANKS));
    CHECK(k3_tokenizer_is_special(t, O200K_RANKS + 255));
    CHECK(!k3_tokenizer_is_special(t, O200K_RANKS + 256));
    size_t len;
    const char *name = k3_tokenizer_token(t, O200K_RANKS + 3, &len);
    CHECK(name && len == 8 && !memcmp(name, "<|open|>", 8));
    CHECK(!k3_tokenizer_token(t, O200K_RANKS + 256, &len));
    CHECK(!k3_tokenizer_token(t, -1, &len));

    /* Specials decode to their names; a name in text is ordinary text. */
    int32_t ids[] = {O200K_RANKS + 3, 0, O200K_RANKS + 200};
    char *out = NULL;
    k3_error err = {0};
    REQUIRE(k3_tokenizer_decode(t, ids, 3, &out, &len, &err) == K3_OK);
    CHECK(!strcmp(out, "<|open|>!<|reserved_token_200198|>") && len == strlen(out));
    int32_t *enc = NULL;
    size_t n;
    REQUIRE(k3_tokenizer_encode(t, "<|open|>", 8, &enc, &n, &err) == K3_OK);
    CHECK(n > 1);
    for (size_t i = 0; i < n; i++) CHECK(!k3_tokenizer_is_special(t, enc[i]));
    free(enc);
    free(out);

    /* Empty input gives an empty, non-NULL array. */
    REQUIRE(k3_tokenizer_encode(t, "", 0, &enc, &n, &err) == K3_OK);
    CHECK(enc && n == 0);
    free(enc);
    k3_tokenizer_free(t);
}

K3_TEST(tokenizer_chat_golden) {
    k3_tokenizer *t = open_kimi();
    REQUIRE(t);
    json_error_t je;
    json_t *root = json_load_file(GOLDEN "chat_cases.json", 0, &je);
    REQUIREF(json_is_array(root), "chat_cases.json: %s", je.text);
    size_t i;
    json_t *c;
    json_array_foreach(root, i, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        json_t *msgs = json_object_get(c, "messages"), *jids = json_object_get(c, "ids");
        size_t n_msgs = json_array_size(msgs), k;
        k3_chat_msg *m = calloc(n_msgs + 1, sizeof *m);
        json_t *jm;
        json_array_foreach(msgs, k, jm) {
            m[k].role = json_string_value(json_object_get(jm, "role"));
            m[k].content = json_string_value(json_object_get(jm, "content"));
            m[k].reasoning = json_string_value(json_object_get(jm, "reasoning"));
        }
        int32_t *ids = NULL;
        size_t n_ids;
        k3_error err = {0};
        k3_status st = k3_chat_encode(t, m, n_msgs, json_is_true(json_object_get(c, "add_generation_prompt")),
                                      json_is_true(json_object_get(c, "thinking")), &ids, &n_ids, &err);
        CHECKF(st == K3_OK, "%s: %s", name, err.msg);
        size_t j = 0;
        while (st == K3_OK && j < n_ids && j < json_array_size(jids) &&
               ids[j] == json_integer_value(json_array_get(jids, j)))
            j++;
        CHECKF(st == K3_OK && j == n_ids && j == json_array_size(jids), "%s: first difference at id %zu of %zu/%zu",
               name, j, n_ids, json_array_size(jids));
        free(ids);
        free(m);
    }
    json_decref(root);
    k3_tokenizer_free(t);
}

K3_TEST(tokenizer_chat_errors) {
    k3_tokenizer *t = open_file(O200K, K3_PATTERN_O200K);
    REQUIRE(t);
    k3_chat_msg m = {.role = "user", .content = "hi"};
    int32_t *ids = NULL;
    size_t n;
    k3_error err = {0};
    CHECK(k3_chat_encode(t, &m, 1, true, true, &ids, &n, &err) == K3_ERR_UNSUPPORTED);
    CHECK(strstr(err.msg, "<|open|>"));
    k3_tokenizer_free(t);

    t = open_kimi();
    REQUIRE(t);
    k3_error err2 = {0};
    m.role = NULL;
    CHECK(k3_chat_encode(t, &m, 1, false, false, &ids, &n, &err2) == K3_ERR_ARG);
    k3_error err3 = {0};
    m.role = "user";
    m.content = "bad \xC3";
    CHECK(k3_chat_encode(t, &m, 1, false, false, &ids, &n, &err3) == K3_ERR_ARG);
    CHECK(!ids);
    k3_tokenizer_free(t);
}

/* ---- bad input ---------------------------------------------------------- */

K3_TEST(tokenizer_bad_utf8) {
    k3_tokenizer *t = open_file(O200K, K3_PATTERN_O200K);
    REQUIRE(t);
    struct {
        const char *s;
        size_t len, at;
    } cases[] = {
        {"ab\xC0\xAF", 4, 2},        /* overlong '/' */
        {"\xE0\x80\xAF", 3, 0},      /* overlong, 3 bytes */
        {"x\xF0\x80\x80\xAF", 5, 1}, /* overlong, 4 bytes */
        {"x\xED\xA0\x80y", 5, 1},    /* surrogate U+D800 */
        {"ok \xED\xBF\xBF", 6, 3},   /* surrogate U+DFFF */
        {"abc\xE4\xB8", 5, 3},       /* truncated at the end */
        {"abc\xE4\xB8z", 6, 3},      /* truncated in the middle */
        {"\xF4\x90\x80\x80", 4, 0},  /* above U+10FFFF */
        {"a\x80", 2, 1},             /* lone continuation byte */
        {"caf\xC3\xA9 \xFF", 7, 6},  /* 0xFF */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int32_t *ids = NULL;
        size_t n;
        k3_error err = {0};
        char want[64];
        snprintf(want, sizeof want, "byte %zu", cases[i].at);
        CHECKF(k3_tokenizer_encode(t, cases[i].s, cases[i].len, &ids, &n, &err) == K3_ERR_ARG &&
                   strstr(err.msg, want) && !ids,
               "case %zu: \"%s\"", i, err.msg);
    }
    /* The largest valid sequences are fine, and so is NUL. */
    int32_t *ids = NULL;
    size_t n;
    k3_error err = {0};
    CHECK(k3_tokenizer_encode(t, "\xF4\x8F\xBF\xBF\xED\x9F\xBF\xEE\x80\x80\0", 11, &ids, &n, &err) == K3_OK);
    free(ids);
    k3_tokenizer_free(t);
}

K3_TEST(tokenizer_bad_vocab) {
    struct {
        const char *extra;
        const char *want;
    } cases[] = {
        {"QUI= 256\nQ!== 257\n", ":258: bad base64"},
        {"QUI= 256\nQUJD\n", ":258: expected"},
        {"QUI= 256\nQUJD 25x\n", ":258: rank is not a number"},
        {"QUI= 256\nQUJD -3\n", ":258: rank is not a number"},
        {"QUI= 256\nQUJD 256\n", ":258: duplicate rank 256"},
        {"QUI= 256\n\nQUJD 5\n", ":259: duplicate rank 5"},
        {"QUI= 256\nQUJD 300\n", ":258: rank 300 out of range"},
        {"QUI= 256\nQUI= 257\n", "same bytes"},
        {"QUI 256\n", ":257: bad base64"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        k3_bpe b;
        k3_error err = {0};
        CHECKF(parse_vocab(cases[i].extra, &b, &err) == K3_ERR_FORMAT && strstr(err.msg, cases[i].want),
               "case %zu: \"%s\"", i, err.msg);
        k3_bpe_free(&b);
    }
    /* No token for byte 0xFF. */
    char *s = vocab_text("");
    *strstr(s, "/w== 255\n") = 0;
    k3_bpe b;
    k3_error err = {0};
    CHECK(k3_bpe_parse(&b, s, strlen(s), "x", &err) == K3_ERR_FORMAT && strstr(err.msg, "0xff"));
    free(s);
    /* CRLF line ends and blank lines are fine. */
    k3_error err2 = {0};
    CHECK(parse_vocab("QUI= 256\r\n\r\nQUJD 257\r\n", &b, &err2) == K3_OK);
    CHECK(b.n_ranks == 258 && k3_bpe_rank(&b, (const uint8_t *)"ABC", 3) == 257);
    k3_bpe_free(&b);
}

K3_TEST(tokenizer_decode_range) {
    k3_tokenizer *t = open_file(CL100K, K3_PATTERN_CL100K);
    REQUIRE(t);
    int32_t bad[][2] = {{1, -1}, {2, 100256}, {3, INT32_MAX}};
    for (size_t i = 0; i < 3; i++) {
        char *out = NULL;
        size_t len;
        k3_error err = {0};
        CHECKF(k3_tokenizer_decode(t, bad[i], 2, &out, &len, &err) == K3_ERR_ARG && !out &&
                   strstr(err.msg, "position 1"),
               "%s", err.msg);
    }
    k3_tokenizer_free(t);
}

K3_TEST(tokenizer_missing_and_bad_files) {
    k3_tokenizer *t = NULL;
    k3_error err = {0};
    CHECK(k3_tokenizer_open_file(&t, "tests/golden/tokenizer/no-such.tiktoken", K3_PATTERN_O200K, &err) == K3_ERR_IO &&
          !t);
    CHECK(strstr(err.msg, "no-such.tiktoken"));
    k3_error err2 = {0};
    CHECK(k3_tokenizer_open(&t, "tests/golden/tokenizer/no-such-dir", &err2) == K3_ERR_IO);

    /* A config naming an id inside the rank range is malformed. */
    char vocab[] = "/tmp/k3-test-vocab-XXXXXX", config[] = "/tmp/k3-test-config-XXXXXX";
    int fv = mkstemp(vocab), fc = mkstemp(config);
    REQUIRE(fv >= 0 && fc >= 0);
    char *s = vocab_text("QUI= 256\n");
    CHECK(write(fv, s, strlen(s)) == (ssize_t)strlen(s));
    const char *cfg = "{\"added_tokens_decoder\": {\"100\": {\"content\": \"[BOS]\"}}}";
    CHECK(write(fc, cfg, strlen(cfg)) == (ssize_t)strlen(cfg));
    close(fv);
    close(fc);
    k3_error err3 = {0};
    CHECK(k3_tokenizer_open_paths(&t, vocab, config, K3_PATTERN_KIMI, &err3) == K3_ERR_FORMAT);
    CHECK(strstr(err3.msg, "outside the special range 257..512"));
    /* Without the config the same rank file opens. */
    k3_error err4 = {0};
    CHECK(k3_tokenizer_open_file(&t, vocab, K3_PATTERN_KIMI, &err4) == K3_OK);
    CHECK(t && k3_tokenizer_n_vocab(t) == 257);
    k3_tokenizer_free(t);
    unlink(vocab);
    unlink(config);

    /* A model dir: tiktoken.model alone gives 256 reserved specials; with a
     * config they are named. */
    char dir[] = "/tmp/k3-test-model-XXXXXX", path[64];
    REQUIRE(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tiktoken.model", dir);
    FILE *f = fopen(path, "wb");
    REQUIRE(f);
    fputs(s, f);
    fclose(f);
    k3_error err5 = {0};
    CHECKF(k3_tokenizer_open(&t, dir, &err5) == K3_OK, "%s", err5.msg);
    CHECK(t && k3_tokenizer_n_vocab(t) == 257 + 256);
    CHECK(t && k3_tokenizer_special(t, "<|reserved_token_259|>") == 259);
    k3_tokenizer_free(t);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    f = fopen(path, "wb");
    REQUIRE(f);
    fputs("{\"added_tokens_decoder\": {\"259\": {\"content\": \"<|open|>\"}}}", f);
    fclose(f);
    k3_error err6 = {0};
    CHECKF(k3_tokenizer_open(&t, dir, &err6) == K3_OK, "%s", err6.msg);
    CHECK(t && k3_tokenizer_special(t, "<|open|>") == 259);
    CHECK(t && k3_tokenizer_special(t, "<|reserved_token_259|>") == -1);
    k3_tokenizer_free(t);
    unlink(path);
    snprintf(path, sizeof path, "%s/tiktoken.model", dir);
    unlink(path);
    rmdir(dir);
    free(s);
}

/* Random valid UTF-8 from assorted scripts survives encode/decode. */
K3_TEST(tokenizer_roundtrip_random) {
    k3_tokenizer *t = open_kimi();
    REQUIRE(t);
    static const uint32_t base[] = {0x20,  0x41,   0x61,   0x30,   0xC0,    0x300,  0x400, 0x600,
                                    0x900, 0x3040, 0x4E00, 0xAC00, 0x1F600, 0x2000, 0xA,   0xD};
    uint32_t seed = 7;
    for (int trial = 0; trial < 200; trial++) {
        char s[4096];
        size_t len = 0;
        while (len < sizeof s - 8) {
            seed = seed * 1103515245u + 12345u;
            uint32_t cp = base[(seed >> 8) % 16] + (seed >> 20) % 48;
            if (cp < 0x80) s[len++] = (char)cp;
            else if (cp < 0x800) {
                s[len++] = (char)(0xC0 | cp >> 6);
                s[len++] = (char)(0x80 | (cp & 63));
            } else if (cp < 0x10000) {
                s[len++] = (char)(0xE0 | cp >> 12);
                s[len++] = (char)(0x80 | (cp >> 6 & 63));
                s[len++] = (char)(0x80 | (cp & 63));
            } else {
                s[len++] = (char)(0xF0 | cp >> 18);
                s[len++] = (char)(0x80 | (cp >> 12 & 63));
                s[len++] = (char)(0x80 | (cp >> 6 & 63));
                s[len++] = (char)(0x80 | (cp & 63));
            }
            if ((seed >> 4) % 64 == 0) break;
        }
        int32_t *ids = NULL;
        size_t n, out_len;
        char *out = NULL;
        k3_error err = {0};
        CHECKF(k3_tokenizer_encode(t, s, len, &ids, &n, &err) == K3_OK, "%s", err.msg);
        CHECK(k3_tokenizer_decode(t, ids, n, &out, &out_len, &err) == K3_OK);
        CHECKF(out && out_len == len && !memcmp(out, s, len), "trial %d", trial);
        free(ids);
        free(out);
    }
    k3_tokenizer_free(t);
}
