/*
 * vocab.h -- the vocabulary of a model (vocab.c; the structure is in
 * grammar.h): special tokens by name, and vocabularies from explicit tokens
 * for tests.
 */
#ifndef K3_GRAMMAR_VOCAB_H
#define K3_GRAMMAR_VOCAB_H

#include "grammar/grammar.h"

/* Token id of a special by name, or -1. */
int32_t k3g_vocab_special(const k3_grammar_vocab *v, const char *name, size_t len);
/* A vocabulary from explicit token byte strings (tests): ids 0..n-1, those
 * with is_special set are specials named by their bytes. */
k3_status k3g_vocab_from_tokens(k3_grammar_vocab **out, const char *const *tok, const size_t *len,
                                const bool *is_special, int32_t n, const int32_t *eos, int32_t n_eos, k3_error *err);

#endif /* K3_GRAMMAR_VOCAB_H */
