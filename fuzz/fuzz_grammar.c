/* fuzz_grammar.c -- libFuzzer harness for the grammar compilers (JSON
 * Schema, regular expressions, GBNF) and the matcher, on a vocabulary of the
 * 256 single bytes and four specials. The first byte picks the kind and the
 * flags, the rest is the text. A compile either fails with a message or
 * gives a grammar; then a few steps of mask and accept must agree (every
 * token the mask allows is accepted) and the end must be consistent. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "grammar/vocab.h"
#include "k3.h"

static k3_grammar_vocab *bytes;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    k3_error err = {0};
    if (!bytes) {
        static char b[256];
        static const char *const sp[4] = {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"};
        const char *tok[260];
        size_t len[260];
        bool is_sp[260];
        for (int i = 0; i < 256; i++) b[i] = (char)i, tok[i] = &b[i], len[i] = 1, is_sp[i] = false;
        for (int i = 0; i < 4; i++) tok[256 + i] = sp[i], len[256 + i] = strlen(sp[i]), is_sp[256 + i] = true;
        int32_t eos = 259;
        if (k3g_vocab_from_tokens(&bytes, tok, len, is_sp, 260, &eos, 1, &err) != K3_OK) abort();
    }
    if (size < 1 || size > 4096) return 0;
    char *text = malloc(size);
    if (!text) return 0;
    memcpy(text, data + 1, size - 1);
    text[size - 1] = 0;
    static const k3_grammar_kind kinds[4] = {K3_GRAMMAR_JSON_SCHEMA, K3_GRAMMAR_REGEX, K3_GRAMMAR_GBNF,
                                             K3_GRAMMAR_JSON_SCHEMA};
    k3_grammar_spec spec = {.kind = kinds[data[0] & 3], .text = text, .compact = data[0] & 4,
                            .no_extra_properties = data[0] & 8, .k3_reply = data[0] & 16};
    k3_grammar *g = NULL;
    if (k3_grammar_compile(&g, bytes, &spec, &err) == K3_OK) {
        if (!g) abort();
        k3_grammar_matcher *m;
        if (k3_grammar_matcher_init(&m, g, &err) != K3_OK) abort();
        uint64_t mask[5];
        for (int step = 0; step < 24; step++) {
            if (k3_grammar_matcher_fill_mask(m, mask, &err) != K3_OK) break;
            int32_t pick = -1, n = 0;
            for (int32_t id = 0; id < 260; id++)
                if ((mask[id >> 6] >> (id & 63)) & 1) {
                    n++;
                    if (pick < 0 || (uint32_t)(id * 2654435761u + (uint32_t)step) % 7 == 0) pick = id;
                }
            if (n == 0) {
                if (!k3_grammar_matcher_is_complete(m) && !k3_grammar_matcher_is_ended(m)) abort(); /* a dead end */
                break;
            }
            const k3_status a = k3_grammar_matcher_accept(m, pick, &err);
            /* the mask allowed it: only the work budget may refuse it (docs/grammar.md, "Cost") */
            if (a != K3_OK && !(a == K3_ERR_UNSUPPORTED && strstr(err.msg, "parser steps"))) abort();
            if (a != K3_OK) break;
            if (k3_grammar_matcher_is_ended(m)) break;
        }
        if (k3_grammar_matcher_n_tokens(m) > 0 && k3_grammar_matcher_rollback(m, 1, &err) != K3_OK) abort();
        k3_grammar_matcher_free(m);
        k3_grammar_free(g);
    } else if (!err.msg[0]) {
        abort(); /* a failure says why */
    }
    free(text);
    return 0;
}
