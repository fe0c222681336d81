/*
 * chat.c -- k3_chat_encode: the K3 "XTML" chat format (docs/model.md §5,
 * Moonshot's encoding_k3.py).
 *
 * A conversation is a list of segments. A control segment is one special id
 * (<|open|>, <|sep|>, <|close|>, <|end_of_msg|>, looked up by name in the
 * tokenizer); a text segment is encoded on its own, so segment boundaries are
 * always token boundaries. Tag names, attribute names, `="`, attribute
 * values (XML-escaped) and `"` are separate text segments:
 *
 *   <|open|> "message" " role" "=\"" ROLE "\"" <|sep|>
 *       CONTENT                                        (system, user, ...)
 *     | [<|open|> "think" <|sep|> REASONING <|close|> "think" <|sep|>]
 *       <|open|> "response" <|sep|> CONTENT <|close|> "response" <|sep|>
 *                                                      (assistant)
 *   <|close|> "message" <|sep|> <|end_of_msg|>
 *
 * An assistant message with reasoning == NULL has no think block; "" gives
 * an empty one. The generation prompt opens an assistant message and then
 * either a think block (thinking) or a response block.
 */
#include "tokenizer/tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"

typedef struct chat {
    const k3_tokenizer *t;
    k3_ids out;
    k3_error *err;
    int32_t open, sep, close, end_of_msg;
} chat;

static k3_status text(chat *c, const char *s) {
    return k3_tokenizer_encode_append(c->t, s, strlen(s), &c->out, c->err);
}

static k3_status control(chat *c, int32_t id) { return k3_ids_push(&c->out, id, c->err); }

/* An attribute value with & and " escaped, as one text segment. */
static k3_status attr_value(chat *c, const char *v) {
    size_t n = 0;
    for (const char *p = v; *p; p++) n += *p == '&' ? 5 : *p == '"' ? 6 : 1;
    char *s = malloc(n + 1), *q = s;
    if (!s) return k3_err(c->err, K3_ERR_NOMEM, "out of memory encoding a chat");
    for (const char *p = v; *p; p++) {
        const char *rep = *p == '&' ? "&amp;" : *p == '"' ? "&quot;" : NULL;
        if (!rep) {
            *q++ = *p;
            continue;
        }
        memcpy(q, rep, strlen(rep));
        q += strlen(rep);
    }
    *q = 0;
    k3_status st = text(c, s);
    free(s);
    return st;
}

/* <|open|>NAME ATTR="VALUE"<|sep|> (attr may be NULL). */
static k3_status open_tag(chat *c, const char *name, const char *attr, const char *value) {
    k3_status st = control(c, c->open);
    if (st == K3_OK) st = text(c, name);
    if (st == K3_OK && attr) {
        /* " role", "=\"", value, "\"" */
        size_t n = strlen(attr);
        char *a = malloc(n + 2);
        if (!a) return k3_err(c->err, K3_ERR_NOMEM, "out of memory encoding a chat");
        a[0] = ' ';
        memcpy(a + 1, attr, n + 1);
        st = text(c, a);
        free(a);
        if (st == K3_OK) st = text(c, "=\"");
        if (st == K3_OK) st = attr_value(c, value);
        if (st == K3_OK) st = text(c, "\"");
    }
    if (st == K3_OK) st = control(c, c->sep);
    return st;
}

/* <|open|>NAME<|sep|>BODY<|close|>NAME<|sep|> */
static k3_status block(chat *c, const char *name, const char *body) {
    k3_status st = open_tag(c, name, NULL, NULL);
    if (st == K3_OK) st = text(c, body);
    if (st == K3_OK) st = control(c, c->close);
    if (st == K3_OK) st = text(c, name);
    if (st == K3_OK) st = control(c, c->sep);
    return st;
}

static k3_status message(chat *c, const k3_chat_msg *m) {
    const char *content = m->content ? m->content : "";
    k3_status st = open_tag(c, "message", "role", m->role);
    if (st != K3_OK) return st;
    if (!strcmp(m->role, "assistant")) {
        if (m->reasoning) st = block(c, "think", m->reasoning);
        if (st == K3_OK) st = block(c, "response", content);
    } else {
        st = text(c, content);
    }
    if (st == K3_OK) st = control(c, c->close);
    if (st == K3_OK) st = text(c, "message");
    if (st == K3_OK) st = control(c, c->sep);
    if (st == K3_OK) st = control(c, c->end_of_msg);
    return st;
}

static k3_status lookup(const k3_tokenizer *t, const char *name, int32_t *id, k3_error *err) {
    *id = k3_tokenizer_special(t, name);
    if (*id < 0)
        return k3_err(err, K3_ERR_UNSUPPORTED,
                      "the tokenizer has no %s token for the chat "
                      "format",
                      name);
    return K3_OK;
}

k3_status k3_chat_encode(const k3_tokenizer *t, const k3_chat_msg *msgs, size_t n_msgs, bool add_generation_prompt,
                         bool thinking, int32_t **ids, size_t *n_ids, k3_error *err) {
    *ids = NULL;
    *n_ids = 0;
    chat c = {.t = t, .err = err};
    k3_status st = lookup(t, "<|open|>", &c.open, err);
    if (st == K3_OK) st = lookup(t, "<|sep|>", &c.sep, err);
    if (st == K3_OK) st = lookup(t, "<|close|>", &c.close, err);
    if (st == K3_OK) st = lookup(t, "<|end_of_msg|>", &c.end_of_msg, err);
    for (size_t i = 0; i < n_msgs && st == K3_OK; i++) {
        if (!msgs[i].role || !*msgs[i].role) st = k3_err(err, K3_ERR_ARG, "chat message %zu has no role", i);
        else st = message(&c, &msgs[i]);
    }
    if (st == K3_OK && add_generation_prompt) {
        st = open_tag(&c, "message", "role", "assistant");
        if (st == K3_OK) st = open_tag(&c, thinking ? "think" : "response", NULL, NULL);
    }
    if (st == K3_OK && !c.out.v && !(c.out.v = malloc(sizeof *c.out.v)))
        st = k3_err(err, K3_ERR_NOMEM, "out of memory encoding a chat");
    if (st != K3_OK) {
        free(c.out.v);
        return st;
    }
    *ids = c.out.v;
    *n_ids = c.out.n;
    return K3_OK;
}
