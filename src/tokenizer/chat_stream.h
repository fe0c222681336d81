/*
 * chat_stream.h -- what the server needs to stream a reply's tool calls as
 * they are generated (chat_reply.c): the call a reply is cut off inside,
 * and the tool-call ids.
 */
#ifndef K3_TOKENIZER_CHAT_STREAM_H
#define K3_TOKENIZER_CHAT_STREAM_H

#include <stdbool.h>
#include <stddef.h>

#include "k3.h"

/* The tool call a reply is cut off inside: its tool name and its arguments
 * JSON so far (a prefix of what the whole call's arguments will be: the
 * arguments before the cut, and a string value cut midway up to the cut). */
typedef struct k3_chat_partial_call {
    char *name; /* NULL when the text does not end inside a named call */
    char *args;
    size_t args_len;
} k3_chat_partial_call;

/* Where a server's text has its chat specials: the offsets (ascending) of
 * the <|open|>, <|close|>, <|sep|> and <|end_of_msg|> tokens it decoded by
 * name, so that text the model wrote that spells one is read as text. */
typedef struct k3_chat_text {
    const size_t *marks;
    size_t n_marks;
} k3_chat_text;

/* k3_chat_parse_reply over a text whose specials t says (NULL: every name
 * is one), and (part not NULL, a stream) the call the text ends inside in
 * part instead of as the cut last entry of tool_calls_json. */
k3_status k3_chat_parse_reply_marked(const char *text, size_t len, const k3_chat_text *t, bool thinking,
                                     k3_chat_reply *out, k3_chat_partial_call *part, k3_error *err);
/* The same with every name a special. */
k3_status k3_chat_parse_reply_partial(const char *text, size_t len, bool thinking, k3_chat_reply *out,
                                      k3_chat_partial_call *part, k3_error *err);
void k3_chat_partial_call_free(k3_chat_partial_call *p);
/* Where k3_chat_parse_reply finds the parts of text: the think channel ends
 * at *reasoning_end (after its closing tag; 0 without thinking, len while it
 * is open), and the content, when *has_content, is text[*content_off,
 * *content_off + *content_len) -- so a server can tell which generated
 * tokens are reasoning and which are content. */
void k3_chat_reply_spans(const char *text, size_t len, bool thinking, size_t *reasoning_end, bool *has_content,
                         size_t *content_off, size_t *content_len);
void k3_chat_reply_spans_marked(const char *text, size_t len, const k3_chat_text *t, bool thinking,
                                size_t *reasoning_end, bool *has_content, size_t *content_off, size_t *content_len);
/* A new tool-call id: "call_" and 24 of [0-9A-Za-z]. */
void k3_chat_new_call_id(char out[32]);

#endif /* K3_TOKENIZER_CHAT_STREAM_H */
