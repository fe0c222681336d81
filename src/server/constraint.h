/*
 * constraint.h -- what a request asks its output to match, as a compiled
 * grammar (constraint.c): the one place the API's structured-output fields
 * become a k3_grammar (src/grammar) that the engine samples under.
 *
 * A surface fills k3_srv_constraint_in with the fields it has, in chat's
 * shapes (a surface with its own spellings maps them first), and calls
 * k3_srv_constraint on its HTTP thread. The answer is NULL (nothing to
 * constrain), a grammar (one reference for the caller), or a refusal
 * naming the field: a 400 for a bad or unsupported field (a JSON Schema
 * keyword the engine cannot honour names the schema's path and the
 * keyword), 500 when out of memory.
 *
 * Compiled grammars are shared: a bounded cache keyed by (kind, flags,
 * text) keeps the most recently used ones, so a schema that comes back
 * costs a lookup and its token tables stay warm across requests. The
 * model's grammar vocabulary is built on the first constrained request.
 */
#ifndef K3_SERVER_CONSTRAINT_H
#define K3_SERVER_CONSTRAINT_H

#include "server/request.h"

typedef struct k3_srv_constraint_in {
    /* OpenAI chat's response_format: {"type": "text" | "json_object" |
     * "json_schema", "json_schema": {"name", "schema", "strict"}}, or NULL */
    json_t *response_format;
    const char *rf_name;     /* how the request names it ("response_format"; NULL: that) */
    const char *schema_name; /* how it names the schema in it (NULL: RF_NAME.json_schema.schema) */
    /* chat's tools [{"type": "function", "function": {"name", "parameters",
     * "strict"}}] and tool_choice ("none" | "auto" | "required" |
     * {"type": "function", "function": {"name"}}), or NULL */
    json_t *tools, *tool_choice;
    bool parallel_calls; /* tool calls: one or more (parallel_tool_calls) */
    /* an object holding vLLM's "structured_outputs" {json | regex | choice |
     * grammar | json_object} or the older guided_json / guided_regex /
     * guided_choice / guided_grammar (the request's root), or NULL */
    json_t *vllm;
    /* the output is a K3 assistant turn from its generation prompt (chat):
     * the constraint is its content, after the think block when the turn
     * thinks; else the raw completion text */
    bool k3_reply, thinking;
    /* the request's connection, or NULL: a compile stops (a 4xx is never
     * sent) when its client has gone */
    struct MHD_Connection *conn;
} k3_srv_constraint_in;

/* The grammar of in (*out NULL: none asked for); false with e. */
bool k3_srv_constraint(struct k3_server *s, const k3_srv_constraint_in *in, k3_grammar **out, k3_srv_bad *e);

/* OpenAI chat's and completions' fields of root (response_format, tools,
 * tool_choice, parallel_tool_calls with chat; structured_outputs and
 * guided_* with both) into k3_srv_constraint. */
bool k3_srv_constraint_openai(struct k3_server *s, unsigned api, json_t *root, bool thinking, k3_grammar **out,
                              struct MHD_Connection *conn, k3_srv_bad *e);

/* For a surface that keeps chat's constraint as words (Responses, Messages):
 * tool_choice "auto" | "required" | "none" or NULL, tool_name the one tool a
 * "required" names (or NULL), response_format in chat's shape (rf_name and
 * schema_name how the request spells it and its schema, e.g. "text.format"
 * and "text.format.schema"); always a K3 chat reply. */
bool k3_srv_constraint_words(struct k3_server *s, json_t *response_format, const char *rf_name, const char *schema_name,
                             json_t *tools, const char *tool_choice, const char *tool_name, bool parallel_calls,
                             bool thinking, k3_grammar **out, struct MHD_Connection *conn, k3_srv_bad *e);

/* Frees the server's cache and vocabulary (after the engine has stopped). */
void k3_srv_constraint_free(struct k3_server *s);

#endif /* K3_SERVER_CONSTRAINT_H */
