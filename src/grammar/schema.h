/*
 * schema.h -- JSON Schema into builder rules, and the arguments of K3 tool
 * calls (schema.c).
 */
#ifndef K3_GRAMMAR_SCHEMA_H
#define K3_GRAMMAR_SCHEMA_H

#include "grammar/build.h"
#include "grammar/stdrules.h"

typedef struct k3g_json_opts {
    k3g_ws ws;
    bool no_extra;     /* absent additionalProperties means false */
    bool int_canon;    /* numbers as JSON writers write them (k3_grammar_spec.canonical_numbers) */
    const char *where; /* error path prefix */
} k3g_json_opts;

/* A JSON Schema text as a rule (*rule). */
k3_status k3g_json_schema(k3g_builder *b, const char *text, const k3g_json_opts *o, int32_t *rule);
/* The arguments of a K3 tool call for a parameters schema (NULL: none): the
 * argument tags in the schema's order, or one json block when the schema is
 * not a plain object of properties. */
k3_status k3g_tool_args(k3g_builder *b, const char *params, const char *where, k3g_ast **out);

#endif /* K3_GRAMMAR_SCHEMA_H */
