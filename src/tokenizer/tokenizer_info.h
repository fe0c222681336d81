/*
 * tokenizer_info.h -- what the server's tokenizer routes need beyond k3.h
 * (tokenizer_info.c): vLLM's /tokenizer_info answer, and text encoded with
 * the specials' names read as the specials, as the released tokenizer's
 * encode (allow_special_tokens) and vLLM's /tokenize with it read them.
 */
#ifndef K3_TOKENIZER_TOKENIZER_INFO_H
#define K3_TOKENIZER_TOKENIZER_INFO_H

#include <stddef.h>

#include "k3.h"

/* vLLM's TokenizerInfoResponse: the tokenizer's configuration as Hugging
 * Face keeps it (the keys of tokenizer_config.json without vocab_file and
 * merges_file, every added token -- added_tokens_decoder's values, an
 * "AddedToken" object anywhere -- as its content string), with
 * "tokenizer_class" (the config's, else K3Tokenizer) and bos_token /
 * eos_token where the config names none but the tokenizer has [BOS] /
 * [EOS]. *json (caller-freed, compact) and *len. */
k3_status k3_tokenizer_info_json(const k3_tokenizer *t, char **json, size_t *len, k3_error *err);

/* k3_tokenizer_encode, except that a special's name in the text (the
 * longest one that starts at a place) is that special's id. */
k3_status k3_tokenizer_encode_specials(const k3_tokenizer *t, const char *text, size_t len, int32_t **ids,
                                       size_t *n_ids, k3_error *err);

#endif /* K3_TOKENIZER_TOKENIZER_INFO_H */
