/*
 * api.h -- the API surfaces, one file each (api_NAME.c): a surface maps its
 * request onto the request table (request.h) and its answer onto the
 * generation job's choices (job.h), and is a row of the routing table
 * (routes.c): OpenAI's completions (api_completions.c) and chat completions
 * (api_chat.c).
 */
#ifndef K3_SERVER_API_H
#define K3_SERVER_API_H

#include "server/job.h"

/* The routes (routes.h: k3_route_fn). */
enum MHD_Result k3_api_completions(struct k3_server *s, struct MHD_Connection *c, json_t *root);
enum MHD_Result k3_api_chat(struct k3_server *s, struct MHD_Connection *c, json_t *root);

/* ---- chat's pieces that others use (api_chat.c) ---- */

/* Encodes root's "messages" (+ "tools", "tool_choice", "chat_template_kwargs")
 * as a K3 chat prompt, image parts through the tower (ids, their rows and
 * prefix-cache keys; free with k3_vision_prompt_free); *thinking (may be
 * NULL) gets whether the think channel was opened. */
k3_status k3_srv_encode_chat(struct k3_server *s, json_t *root, k3_vision_prompt *out, bool *thinking,
                             k3_error *err);
/* The assistant message of a finished chat reply (text decoded with
 * specials by name): role, content, reasoning_content, tool_calls (*tools
 * set when there are any). NULL with err when the reply cannot be parsed,
 * e.g. a tool call whose arguments are not valid JSON. */
json_t *k3_srv_chat_message(const char *text, size_t len, bool thinking, bool *tools, k3_error *err);
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
