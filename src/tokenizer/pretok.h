/*
 * pretok.h -- the split regex that cuts text into pieces before BPE.
 *
 * Three patterns, each a PCRE2 transcription of a pat_str that tiktoken runs
 * with the Rust fancy-regex crate: o200k_base, cl100k_base, and Kimi's
 * (o200k's rules behind a leading Han rule; docs/model.md §5). The
 * transcriptions keep fancy-regex's results, not just its spelling:
 *   - `\s` is Unicode White_Space, written out as a class, because PCRE2's
 *     UCP `\s` also matches U+180E;
 *   - Han is Script=Han, because a bare PCRE2 `\p{Han}` (10.40+) means
 *     Script_Extensions and would swallow 。 and 、;
 *   - Kimi's `[X&&[^\p{Han}]]` becomes `(?:(?!\p{Han})[X])`.
 * A k3_pretok is read-only after init and may be shared between threads.
 * Text handed to it must be valid UTF-8 (k3_utf8_check).
 */
#ifndef K3_TOKENIZER_PRETOK_H
#define K3_TOKENIZER_PRETOK_H

#include "k3.h"

typedef struct k3_pretok k3_pretok;

/* Compiles the pattern (with JIT when PCRE2 has it). */
k3_status k3_pretok_init(k3_pretok **out, k3_pattern pattern, k3_error *err);
void k3_pretok_free(k3_pretok *p);

/* The PCRE2 source of a pattern; static storage. NULL for an unknown one. */
const char *k3_pretok_source(k3_pattern pattern);

/* Called once per piece, in text order. A status other than K3_OK stops the
 * split and is returned by k3_pretok_split. piece points into the text. */
typedef k3_status (*k3_pretok_fn)(void *ctx, const char *piece, size_t len);

/* Cuts text[0, len) into pieces. text must be valid UTF-8. */
k3_status k3_pretok_split(const k3_pretok *p, const char *text, size_t len, k3_pretok_fn fn, void *ctx, k3_error *err);

/* Strict UTF-8 check (no overlongs, surrogates, code points > U+10FFFF or
 * truncated sequences). Returns true when valid; otherwise *bad is the byte
 * offset of the first byte of the offending sequence. */
bool k3_utf8_check(const char *s, size_t len, size_t *bad);

#endif /* K3_TOKENIZER_PRETOK_H */
