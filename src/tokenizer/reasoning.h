/*
 * reasoning.h -- how much a K3 chat turn thinks, asked the way other APIs
 * ask it: OpenAI's reasoning_effort (chat completions' "reasoning_effort",
 * the Responses API's "reasoning.effort") onto K3's two chat options, the
 * think switch and thinking_effort (k3_chat_options). One function, so
 * every surface maps the same way; docs/api-chat.md has the table.
 */
#ifndef K3_TOKENIZER_REASONING_H
#define K3_TOKENIZER_REASONING_H

#include <stdbool.h>

#include "k3.h"

/* effort: NULL (none asked for: the default, thinking on at "max", what the
 * official tokenizer's apply_chat_template renders), "none" (thinking off),
 * "minimal" or "low" ("low"), "medium" or "high" ("high"), "xhigh" or K3's
 * own "max" ("max"). Sets *thinking and *thinking_effort (a static string,
 * NULL when thinking is off). Anything else is K3_ERR_ARG naming the values. */
k3_status k3_chat_reasoning_effort(const char *effort, bool *thinking, const char **thinking_effort, k3_error *err);

#endif /* K3_TOKENIZER_REASONING_H */
