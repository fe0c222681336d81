/*
 * json_text.h -- JSON values as text, the one definition the grammar engine
 * (src/grammar: what a constrained model may write) and the chat reply
 * parser (src/tokenizer/chat_reply.c: what the server returns) share, so
 * that whatever a grammar allows the parser reads back byte for byte.
 *
 * Numbers are text. The parser takes any number RFC 8259 allows, of any
 * length, and passes it through as written (never through a double or a
 * 64-bit integer); the grammar bounds what a model may generate:
 *   K3_JSON_INT_DIGITS  digits of the integer part (and of an exponent):
 *                       16, as llama.cpp's json-schema-to-grammar bounds
 *                       its integral-part ([1-9][0-9]{0,15}); every such
 *                       integer fits an int64 (Go's, serde's int fields)
 *   K3_JSON_FRAC_DIGITS digits of a fraction: 16 as llama.cpp's decimal-part
 *                       ([0-9]{1,16}); canonical numbers (what the server
 *                       asks for) keep 15
 * XGrammar, vLLM's default, leaves a plain integer unbounded
 * ("-"? [1-9][0-9]*) and bounds only minimum/maximum to int64; a model then
 * writes digits until max_tokens.
 */
#ifndef K3_COMMON_JSON_TEXT_H
#define K3_COMMON_JSON_TEXT_H

#include <stdbool.h>
#include <stddef.h>

#include "common/buf.h"

#define K3_JSON_INT_DIGITS 16
#define K3_JSON_FRAC_DIGITS 16
#define K3_JSON_CANON_FRAC_DIGITS 15

typedef enum k3_json_type {
    K3_JSON_T_NULL,
    K3_JSON_T_BOOL,
    K3_JSON_T_NUMBER,
    K3_JSON_T_STRING,
    K3_JSON_T_ARRAY,
    K3_JSON_T_OBJECT,
} k3_json_type;

/* The length of the JSON number (RFC 8259: -?(0|[1-9][0-9]*)(.[0-9]+)?
 * ([eE][+-]?[0-9]+)?) that s[0..n) starts with, the longest one; 0 when it
 * starts with none. */
size_t k3_json_number_len(const char *s, size_t n);

/* Whether s[0..n) is exactly one JSON number within the grammar's bounds
 * (integer part and exponent at most K3_JSON_INT_DIGITS digits, fraction at
 * most frac_digits). */
bool k3_json_number_bounded(const char *s, size_t n, int frac_digits);

/* Appends s[0..n) as a JSON string the way Python's json.dumps writes it
 * with ensure_ascii=False: " \ and the control characters escaped (\n \r
 * \t \b \f, others \u00XX), everything else as is -- but a byte that is not
 * part of valid UTF-8 (a character cut by max_tokens) as U+FFFD, as a decode
 * with errors="replace" gives it, so the JSON is always valid UTF-8. */
void k3_json_write_string(k3_buf *out, const char *s, size_t n);

/* Reads s[0..n) as exactly one JSON value (JSON whitespace around it and
 * between its tokens allowed) and appends it to out as Python's json.dumps
 * writes it: ", " and ": " between items, strings decoded and written by
 * k3_json_write_string, numbers byte for byte as they are in s, keys in
 * their order. False when s is not one JSON value (invalid UTF-8 in a
 * string, a lone surrogate escape, nesting past max_depth included), with
 * *why a static reason and *at its byte offset; out may then hold a part.
 * *type (when not NULL) is the value's type. */
bool k3_json_text_canon(k3_buf *out, const char *s, size_t n, int max_depth, k3_json_type *type, const char **why,
                        size_t *at);

#endif /* K3_COMMON_JSON_TEXT_H */
