/*
 * gen.h -- the generation side of the server (gen.c): the engine thread,
 * /v1/completions and /v1/chat/completions (validation into
 * k3_request_params, per-request queues, stop strings, incremental
 * detokenization, SSE, logprobs, usage), and the chat request encoder.
 */
#ifndef K3_SERVER_GEN_H
#define K3_SERVER_GEN_H

#include "server/server.h"
#include "tokenizer/chat_stream.h"

k3_status k3_srv_gen_start(struct k3_server *s, k3_error *err);
void k3_srv_gen_stop(struct k3_server *s);
void k3_srv_engine_stats(struct k3_server *s, k3_engine_stats *st);
int64_t k3_srv_max_model_len(struct k3_server *s);
/* Answers a completion (chat = false) or chat completion request. */
enum MHD_Result k3_srv_generate(struct k3_server *s, struct MHD_Connection *c, json_t *root, bool chat);
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

/* ---- streamed tool calls (what vLLM's OpenAI server sends) ----
 * A call's first delta: {index, id, type "function", function {name,
 * arguments ""}}; then {index, function {arguments: FRAGMENT}} as its
 * arguments grow. The fragments of a call add up to the arguments the
 * non-streamed reply has (the whole reply is still parsed and checked at
 * the end). */
typedef struct k3_tool_stream_call {
    char id[32];
    k3_buf sent;        /* the arguments sent so far */
} k3_tool_stream_call;

typedef struct k3_tool_stream {
    k3_tool_stream_call *calls;
    int n, cap;
} k3_tool_stream;

/* Appends to out (a JSON array) the tool_calls delta entries that are new
 * since the last call, for r's complete calls and the call being generated
 * (part, or NULL). K3_ERR_FORMAT when the arguments sent are no longer a
 * prefix of a call's arguments, K3_ERR_NOMEM. */
k3_status k3_srv_tool_deltas(k3_tool_stream *ts, const k3_chat_reply *r, const k3_chat_partial_call *part, json_t *out,
                             k3_error *err);
void k3_tool_stream_free(k3_tool_stream *ts);
/* The end of text[from..lim) a chat stream may parse and send now: an
 * <|open|> or <|close|> tag whose <|sep|> has not come is held back (its
 * name and attributes are not decided). */
size_t k3_srv_chat_hold(const char *t, size_t from, size_t lim);

#endif /* K3_SERVER_GEN_H */
