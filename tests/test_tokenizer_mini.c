/* test_tokenizer_mini.c -- k3's tokenizer on the trained vocabulary of the
 * default model equals tiktoken built from the same tiktoken.model with
 * Kimi's pattern (goldens: tools/gen_mini_tokenizer_golden.py), and chat
 * control tokens are single ids. */
#include <stdlib.h>
#include <string.h>

#include "k3.h"
#include "test.h"

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) b[n] = 0;
    *len = (size_t)n;
    return b;
}

K3_TEST(tokenizer_trained_vocab_equals_tiktoken) {
    k3_tokenizer *t = NULL;
    k3_error err = {0};
    REQUIREF(k3_tokenizer_open(&t, "models/k3-mini", &err) == K3_OK, "%s", err.msg);
    CHECK(k3_tokenizer_n_vocab(t) == 8192);
    CHECK(k3_tokenizer_special(t, "<|end_of_msg|>") == 7938);
    static const char *names[] = {"austen", "brown", "kjv", "mobydick", "sotu"};
    for (int i = 0; i < 5; i++) {
        char path[128];
        size_t tl = 0, il = 0;
        snprintf(path, sizeof path, "tests/golden/tokenizer-mini/%s.txt", names[i]);
        char *text = slurp(path, &tl);
        snprintf(path, sizeof path, "tests/golden/tokenizer-mini/%s.ids", names[i]);
        char *idtext = slurp(path, &il);
        REQUIREF(text && idtext, "cannot read %s", path);
        int32_t *ids = NULL;
        size_t n = 0;
        REQUIRE(k3_tokenizer_encode(t, text, tl, &ids, &n, &err) == K3_OK);
        size_t k = 0, bad = 0;
        for (char *p = idtext, *end; *p; p = end) {
            long v = strtol(p, &end, 10);
            if (end == p) break;
            if (k >= n || ids[k] != v) bad++;
            k++;
        }
        CHECKF(k == n && bad == 0, "%s: %zu ids from k3, %zu from tiktoken, %zu differ", names[i], n, k, bad);
        char *back = NULL;
        size_t bl = 0;
        REQUIRE(k3_tokenizer_decode(t, ids, n, &back, &bl, &err) == K3_OK);
        CHECK(bl == tl && memcmp(back, text, tl) == 0);
        free(back);
        free(ids);
        free(text);
        free(idtext);
    }
    k3_tokenizer_free(t);
}
