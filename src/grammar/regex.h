/*
 * regex.h -- ECMA-262 regular expressions into builder expressions
 * (regex.c): a schema's "pattern", --regex, and the string formats.
 */
#ifndef K3_GRAMMAR_REGEX_H
#define K3_GRAMMAR_REGEX_H

#include "grammar/build.h"

/* A regular expression over raw UTF-8 text. search: JSON Schema "pattern"
 * semantics (a match anywhere unless anchored by ^ / $); else the whole
 * text. where prefixes error messages. */
k3_status k3g_regex(k3g_builder *b, const char *re, size_t len, bool search, const char *where, k3g_ast **out);

#endif /* K3_GRAMMAR_REGEX_H */
