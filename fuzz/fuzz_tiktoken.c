/* fuzz_tiktoken.c -- libFuzzer harness for the tokenizer. The first byte
 * picks the case:
 *   even: the rest is a tiktoken.model rank file (k3_bpe_parse), then the
 *         rest is also encoded with it as text and decoded back (the ids
 *         must decode to the same bytes);
 *   odd:  the rest is text, encoded with the Kimi pattern over the tiny
 *         model's ranks (loaded once) and decoded back.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "k3.h"
#include "tokenizer/pretok.h"
#include "tokenizer/tokenizer_internal.h"

static k3_tokenizer *tiny;

static void roundtrip(const k3_tokenizer *t, const char *s, size_t n) {
    int32_t *ids = NULL;
    size_t n_ids = 0;
    k3_error err = {0};
    if (k3_tokenizer_encode(t, s, n, &ids, &n_ids, &err) != K3_OK) return; /* invalid UTF-8 */
    char *back = NULL;
    size_t len = 0;
    if (k3_tokenizer_decode(t, ids, n_ids, &back, &len, &err) != K3_OK) abort();
    if (len != n || memcmp(back, s, n)) abort();
    free(back);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const char *rest = (const char *)data + 1;
    const size_t n = size - 1;
    k3_error err = {0};
    if (data[0] & 1) {
        if (!tiny && k3_tokenizer_open(&tiny, "tests/models/tiny", &err) != K3_OK) abort();
        roundtrip(tiny, rest, n);
        return 0;
    }
    k3_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return 0;
    t->pattern = K3_PATTERN_O200K;
    if (k3_pretok_init(&t->pretok, K3_PATTERN_O200K, &err) != K3_OK) abort();
    if (k3_bpe_parse(&t->bpe, rest, n, "fuzz/tiktoken.model", &err) == K3_OK) {
        /* a valid rank file holds all 256 single bytes, so any text encodes */
        roundtrip(t, rest, n);
    }
    k3_tokenizer_free(t);
    return 0;
}
