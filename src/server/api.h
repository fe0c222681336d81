/*
 * api.h -- the API surfaces, one file each (api_NAME.c): a surface maps its
 * request onto the request table (request.h) and its answer onto the
 * generation job's choices (job.h), and is a row of the routing table
 * (routes.c): OpenAI's completions (api_completions.c), chat completions
 * (api_chat.c) and Responses (api_responses.c), and Anthropic's Messages
 * (api_messages.c). The last two turn their requests into chat messages and
 * encode them through chat's k3_srv_encode_messages, so one conversation is
 * one prompt on every surface.
 */
#ifndef K3_SERVER_API_H
#define K3_SERVER_API_H

#include "server/job.h"

/* The routes (routes.h: k3_route_fn). */
enum MHD_Result k3_api_completions(struct k3_server *s, struct MHD_Connection *c, json_t *root);
enum MHD_Result k3_api_chat(struct k3_server *s, struct MHD_Connection *c, json_t *root);
enum MHD_Result k3_api_responses(struct k3_server *s, struct MHD_Connection *c, json_t *root);
enum MHD_Result k3_api_messages(struct k3_server *s, struct MHD_Connection *c, json_t *root);
enum MHD_Result k3_api_messages_count_tokens(struct k3_server *s, struct MHD_Connection *c, json_t *root);
/* GET and DELETE /v1/responses/{id}: the stored response (url: the path). */
enum MHD_Result k3_api_responses_get(struct k3_server *s, struct MHD_Connection *c, const char *url);
enum MHD_Result k3_api_responses_delete(struct k3_server *s, struct MHD_Connection *c, const char *url);
/* Anthropic's error JSON {"type":"error","error":{"type","message"}} for
 * status (the error hook of the /v1/messages routes). */
json_t *k3_srv_anthropic_error_json(unsigned status, const char *msg);
enum MHD_Result k3_srv_anthropic_error(struct k3_server *s, struct MHD_Connection *c, unsigned status, const char *msg);

/* ---- chat's pieces that others use (api_chat.c) ---- */

/* Whether the think channel is open when a request does not say (K3's
 * official chat template opens it). Chat, Responses without "reasoning"
 * and reasoning_effort NULL below all take it. */
#define K3_SRV_THINKING_DEFAULT true

/* OpenAI's reasoning effort (Responses' "reasoning.effort", Anthropic's
 * "output_config.effort") onto K3's thinking switch and thinking_effort,
 * as chat's "reasoning_effort" maps it (k3_chat_reasoning_effort: NULL is
 * the default, on at "max"; "none" is off); an unknown value is
 * K3_ERR_ARG naming field. */
k3_status k3_srv_reasoning_effort(const char *field, const char *effort, bool *thinking, const char **k3_effort,
                                  k3_error *err);

/* A conversation in chat's shape, for k3_srv_encode_messages (every member
 * borrowed). Chat, Responses and Messages all fill it, so its constraint
 * fields (tools, tool_choice, tool_name, response_format) are the one
 * place a request's decoding constraint is read from, whatever the API:
 * Responses' text.format and Anthropic's output_config.format come as
 * chat's response_format, Anthropic's tool_choice any/tool as chat's
 * required (with the tool's name). */
typedef struct k3_srv_chat_input {
    json_t *messages;        /* OpenAI chat messages (a non-empty array) */
    json_t *tools;           /* OpenAI chat tools [{type, function {name, description, parameters}}], or NULL */
    const char *tool_choice; /* NULL, "auto", "required" or "none" */
    const char *tool_name;   /* with "required": the one tool it must call (chat's {"type": "function",
                                "function": {"name"}}, Responses' {"type": "function", "name"},
                                Anthropic's {"type": "tool", "name"}), or NULL: any of them */
    bool thinking;           /* open the think channel */
    const char *effort;      /* K3's thinking_effort (low, high, max) or NULL */
    json_t *response_format; /* chat's response_format object ({type, json_schema}) or NULL: where
                                the structured-outputs constraint is taken from */
} k3_srv_chat_input;

/* Encodes in as a K3 chat prompt with the generation prompt, image parts
 * through the tower (ids, their rows and prefix-cache keys; free with
 * k3_vision_prompt_free). */
k3_status k3_srv_encode_messages(struct k3_server *s, const k3_srv_chat_input *in, k3_vision_prompt *out,
                                 k3_error *err);

/* Encodes root's "messages" (+ "tools", "tool_choice", "chat_template_kwargs")
 * as a K3 chat prompt, image parts through the tower (ids, their rows and
 * prefix-cache keys; free with k3_vision_prompt_free); *thinking (may be
 * NULL) gets whether the think channel was opened. */
k3_status k3_srv_encode_chat(struct k3_server *s, json_t *root, k3_vision_prompt *out, bool *thinking, k3_error *err);
/* The assistant message of a finished chat reply (text decoded with
 * specials by name): role, content, reasoning_content, tool_calls (*tools
 * set when there are any). NULL with err when the reply cannot be parsed,
 * e.g. a tool call whose arguments are not valid JSON. */
json_t *k3_srv_chat_message(const char *text, size_t len, const k3_chat_text *marks, bool thinking, bool *tools,
                            k3_error *err);
/* Appends to out (a JSON array) the tool_calls delta entries that are new
 * since the last call, for r's complete calls and the call being generated
 * (part, or NULL). K3_ERR_FORMAT when the arguments sent are no longer a
 * prefix of a call's arguments, K3_ERR_NOMEM. */
k3_status k3_srv_tool_deltas(k3_tool_stream *ts, const k3_chat_reply *r, const k3_chat_partial_call *part, json_t *out,
                             k3_error *err);
/* The end of text[from..lim) a chat stream may parse and send now: an
 * <|open|> or <|close|> tag whose <|sep|> has not come is held back (its
 * name and attributes are not decided). */
size_t k3_srv_chat_hold(const char *t, size_t from, size_t lim);

#endif /* K3_SERVER_API_H */
