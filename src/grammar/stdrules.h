/*
 * stdrules.h -- the standard rules (stdrules.c): the JSON lexical pieces
 * (strings, numbers, whitespace, any value, object and array) and the
 * string formats that every JSON grammar shares, built by the same code in
 * every grammar and in the vocabulary's own standard grammar, so their
 * token tables are computed once per vocabulary. Whitespace modes: flexible
 * (JSON's [ \t\n\r]* wherever JSON allows it), compact (none), python
 * (", " and ": " exactly, as json.dumps writes them).
 *
 * It sits above the builder and the regular expressions (a format is a
 * regular expression) and below the front ends that use it (schema.c,
 * compile.c) and the vocabulary (vocab.c), which builds the standard
 * grammar. The rule kinds (k3g_std) and their node roles are in grammar.h.
 */
#ifndef K3_GRAMMAR_STDRULES_H
#define K3_GRAMMAR_STDRULES_H

#include "grammar/build.h"

typedef enum k3g_ws { K3G_WS_FLEX = 0, K3G_WS_COMPACT = 1, K3G_WS_PY = 2 } k3g_ws;

/* The rule of a standard rule (made on first use); -1 on failure. */
int32_t k3g_std_rule(k3g_builder *b, k3g_std s);
/* A JSON string of min..max characters (max < 0: unbounded) with every
 * escape, as a rule whose nodes share the standard string's token tables
 * where they behave alike; -1 on failure. */
int32_t k3g_json_string_rule(k3g_builder *b, int64_t min, int64_t max);
/* The same for a raw tool-call argument (UTF-8 without "<|close|>"). */
int32_t k3g_raw_string_rule(k3g_builder *b, int64_t min, int64_t max);

/* JSON whitespace of a mode as an expression (flexible: [ \t\n\r]*). */
k3g_ast *k3g_json_ws(k3g_builder *b, k3g_ws ws);

/* The supported string formats ("date", "time", ...; NULL-terminated),
 * and the raw-text DFA of format i. */
extern const char *const k3g_formats[];
k3_status k3g_format_dfa(k3g_builder *b, int i, k3g_fa *out);
int k3g_format_index(const char *name);

#endif /* K3_GRAMMAR_STDRULES_H */
