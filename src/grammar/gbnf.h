/*
 * gbnf.h -- GBNF grammars (llama.cpp's syntax) into builder rules (gbnf.c).
 */
#ifndef K3_GRAMMAR_GBNF_H
#define K3_GRAMMAR_GBNF_H

#include "grammar/build.h"

/* A GBNF grammar; *root is its rule "root". */
k3_status k3g_gbnf(k3g_builder *b, const char *text, size_t len, const char *where, int32_t *root);

#endif /* K3_GRAMMAR_GBNF_H */
