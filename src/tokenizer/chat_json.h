/*
 * chat_json.h -- what chat_json.c (the OpenAI-shaped encoder) and
 * chat_reply.c (the reply parser) share: JSON, into a k3_buf (common/buf.h),
 * written exactly as Python's json.dumps(..., ensure_ascii=False) writes it,
 * because encoding_k3.py renders tool declarations, argument values and
 * response schemas that way and the token ids depend on every byte.
 *
 * Python's rules, as json.dumps applies them:
 *   - strings: \" \\ \b \f \n \r \t, other bytes below 0x20 as \u00XX (lower
 *     case hex); everything else (DEL, non-ASCII) verbatim;
 *   - integers in decimal; floats as repr(float): the shortest digits that
 *     read back to the same double, positional when the decimal exponent is
 *     in [-4, 16), else d.ddde+XX, and a ".0" on integral positional values;
 *   - separators ", " and ": " by default, "," and ":" compact;
 *   - sort_keys (deep_sort_dict) orders object keys by code point, which
 *     for UTF-8 is byte order.
 * Nothing outside src/tokenizer/ and tests/ includes this.
 */
#ifndef K3_TOKENIZER_CHAT_JSON_H
#define K3_TOKENIZER_CHAT_JSON_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/buf.h"

/* repr(float) of a finite double. */
void k3_pyjson_float(k3_buf *b, double v);
/* A JSON string literal of n bytes of UTF-8. */
void k3_pyjson_string(k3_buf *b, const char *s, size_t n);
/* json.dumps(v, ensure_ascii=False[, separators=(",", ":")]) of a deep-
 * sorted copy when sort_keys. Recursion follows the nesting of v, which the
 * callers cap with k3_json_too_deep before parsing. */
void k3_pyjson_dump(k3_buf *b, const json_t *v, bool compact, bool sort_keys);

#endif /* K3_TOKENIZER_CHAT_JSON_H */
