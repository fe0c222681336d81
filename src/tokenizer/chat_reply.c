/*
 * chat_reply.c -- k3_chat_parse_reply: a generated assistant turn back into
 * OpenAI fields, the inverse of what chat_json.c renders for an assistant
 * message (encoding_k3.py _render_assistant_segments):
 *
 *   [REASONING <|close|>think<|sep|>]            (thinking: the prompt opened it)
 *   [<|open|>response<|sep|>] CONTENT <|close|>response<|sep|>
 *   [<|open|>tools<|sep|>
 *      <|open|>call tool="NAME" index="1"<|sep|>
 *        <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|> ...
 *      | <|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>
 *      <|close|>call<|sep|> ...
 *    <|close|>tools<|sep|>]
 *   [<|close|>message<|sep|>] [<|end_of_msg|>]
 *
 * Without thinking the prompt opened the response channel, so the text starts
 * with CONTENT. Attribute values are un-escaped (&quot; &amp;). An argument's
 * VALUE is text for type="string" and JSON of the declared type otherwise
 * (number, boolean, null, object, array); a value that is not is
 * K3_ERR_FORMAT naming the call and the key. The arguments of a call become
 * one JSON object string, written as Python's json.dumps writes it (", " and
 * ": "), so that it renders back to the same tokens.
 *
 * Text that stops early (max_tokens) parses as far as it goes: the reasoning
 * or content so far, and the tool calls that were closed; a call cut off
 * midway is dropped. reasoning is NULL when absent or empty; content is NULL
 * when the response channel is absent, or empty and there are tool calls
 * (OpenAI's content: null); tool_calls_json is NULL without tool calls.
 * Tool-call ids are "call_" and 24 letters and digits, new for every call.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/random.h"
#include "common/json_guard.h"
#include "tokenizer/chat_json.h"
#include "tokenizer/chat_stream.h"

#define OPEN "<|open|>"
#define SEP "<|sep|>"
#define CLOSE "<|close|>"
#define END_OF_MSG "<|end_of_msg|>"

typedef struct cursor {
    const char *s;
    size_t n, at;
} cursor;

static bool starts(const cursor *c, const char *lit) {
    size_t l = strlen(lit);
    return c->n - c->at >= l && !memcmp(c->s + c->at, lit, l);
}

static bool eat(cursor *c, const char *lit) {
    if (!starts(c, lit)) return false;
    c->at += strlen(lit);
    return true;
}

/* True when the rest of the text is a proper prefix of lit: a marker that
 * the generation stopped inside of (or nothing at all). */
static bool cut_inside(const cursor *c, const char *lit) {
    size_t rest = c->n - c->at;
    return rest < strlen(lit) && !memcmp(c->s + c->at, lit, rest);
}

/* Offset of lit at or after c->at, or (size_t)-1. */
static size_t find(const cursor *c, const char *lit) {
    size_t l = strlen(lit);
    for (size_t i = c->at; i + l <= c->n; i++)
        if (!memcmp(c->s + i, lit, l)) return i;
    return (size_t)-1;
}

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

/* ---- tags ------------------------------------------------------------------- */

#define MAX_ATTRS 4

typedef struct tag_attrs {
    size_t n;
    char *key[MAX_ATTRS];
    char *val[MAX_ATTRS]; /* un-escaped */
} tag_attrs;

static void attrs_free(tag_attrs *a) {
    for (size_t i = 0; i < a->n; i++) {
        free(a->key[i]);
        free(a->val[i]);
    }
    a->n = 0;
}

static const char *attr_get(const tag_attrs *a, const char *key) {
    for (size_t i = 0; i < a->n; i++)
        if (!strcmp(a->key[i], key)) return a->val[i];
    return NULL;
}

static char *unescape(const char *s, size_t n) {
    char *d = malloc(n + 1), *q = d;
    if (!d) return NULL;
    for (size_t i = 0; i < n;) {
        if (n - i >= 6 && !memcmp(s + i, "&quot;", 6)) {
            *q++ = '"';
            i += 6;
        } else if (n - i >= 5 && !memcmp(s + i, "&amp;", 5)) {
            *q++ = '&';
            i += 5;
        } else {
            *q++ = s[i++];
        }
    }
    *q = 0;
    return d;
}

typedef enum got { GOT_OK, GOT_CUT, GOT_BAD, GOT_NOMEM } got;

/* After "<|open|>NAME": ( KEY="VALUE")* <|sep|>. */
static got tag_rest(cursor *c, tag_attrs *a) {
    a->n = 0;
    for (;;) {
        if (eat(c, SEP)) return GOT_OK;
        if (c->at == c->n || cut_inside(c, SEP)) return GOT_CUT;
        if (c->s[c->at] != ' ' || a->n == MAX_ATTRS) return GOT_BAD;
        size_t k0 = ++c->at;
        while (c->at < c->n && c->s[c->at] != '=' && c->s[c->at] != '<' && c->s[c->at] != ' ') c->at++;
        size_t k1 = c->at;
        if (c->at == c->n) return GOT_CUT;
        if (k1 == k0 || !eat(c, "=\"")) return c->n - c->at < 2 ? GOT_CUT : GOT_BAD;
        size_t v0 = c->at;
        while (c->at < c->n && c->s[c->at] != '"') c->at++;
        if (c->at == c->n) return GOT_CUT;
        a->key[a->n] = dup_n(c->s + k0, k1 - k0);
        a->val[a->n] = unescape(c->s + v0, c->at - v0);
        a->n++;
        c->at++;
        if (!a->key[a->n - 1] || !a->val[a->n - 1]) return GOT_NOMEM;
    }
}

/* ---- tool calls --------------------------------------------------------------- */

/* "call_" and 24 characters of [0-9A-Za-z] from the OS's generator: they
 * carry no counter, clock or address. */
static void new_call_id(char out[32]) { k3_random_id(out, 32, "call_", 24); }

void k3_chat_new_call_id(char out[32]) { new_call_id(out); }

typedef struct parser {
    cursor c;
    k3_error *err;
    k3_buf calls; /* the tool_calls array so far */
    int32_t n_calls;
    k3_chat_partial_call *part; /* NULL, or where the call cut off at the end goes */
} parser;

static k3_status bad(parser *p, const char *what) {
    return k3_err(p->err, K3_ERR_FORMAT, "the reply's tool calls are malformed at byte %zu: %s", p->c.at, what);
}

static k3_status nomem(parser *p) { return k3_err(p->err, K3_ERR_NOMEM, "out of memory parsing a reply"); }

/* One argument value of its declared type, appended to args as JSON. */
static k3_status argument(parser *p, k3_buf *args, const char *name, const char *key, const char *type, const char *v,
                          size_t n) {
    if (!strcmp(type, "string")) {
        k3_pyjson_string(args, v, n);
        return K3_OK;
    }
    json_t *j = NULL;
    json_error_t je;
    if (!k3_json_too_deep(v, n, 128)) j = json_loadb(v, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    bool ok = j &&
        ((!strcmp(type, "number") && json_is_number(j)) || (!strcmp(type, "boolean") && json_is_boolean(j)) ||
         (!strcmp(type, "null") && json_is_null(j)) || (!strcmp(type, "object") && json_is_object(j)) ||
         (!strcmp(type, "array") && json_is_array(j)));
    if (ok) k3_pyjson_dump(args, j, false, false);
    json_decref(j);
    if (ok) return K3_OK;
    bool known = !strcmp(type, "number") || !strcmp(type, "boolean") || !strcmp(type, "null") ||
        !strcmp(type, "object") || !strcmp(type, "array");
    if (!known)
        return k3_err(p->err, K3_ERR_FORMAT,
                      "tool call %d (%s): argument \"%s\" has the unknown "
                      "type \"%s\"",
                      p->n_calls + 1, name, key, type);
    return k3_err(p->err, K3_ERR_FORMAT,
                  "tool call %d (%s): argument \"%s\" is not a valid %s: "
                  "%.*s",
                  p->n_calls + 1, name, key, type, n > 60 ? 60 : (int)n, v);
}

/* The body of a call after its open tag, up to and including
 * <|close|>call<|sep|>. *cut: the text ended first. */
static k3_status call_body(parser *p, const char *name, k3_buf *args, bool *cut) {
    cursor *c = &p->c;
    bool first = true, json_block = false;
    k3_buf_puts(args, "{");
    for (;;) {
        if (eat(c, CLOSE "call" SEP)) break;
        bool is_arg = eat(c, OPEN "argument"), is_json = !is_arg && eat(c, OPEN "json");
        if (!is_arg && !is_json) {
            if (cut_inside(c, CLOSE "call" SEP) || cut_inside(c, OPEN "argument") || cut_inside(c, OPEN "json")) {
                *cut = true;
                return K3_OK;
            }
            return bad(p, "expected an argument, a json block or the end of the call");
        }
        tag_attrs a = {0};
        got g = tag_rest(c, &a);
        const char *close = is_arg ? CLOSE "argument" SEP : CLOSE "json" SEP;
        size_t end = g == GOT_OK ? find(c, close) : 0;
        k3_status st = K3_OK;
        if (g == GOT_NOMEM) st = nomem(p);
        else if (g == GOT_BAD) st = bad(p, "a malformed argument tag");
        else if (g == GOT_CUT || end == (size_t)-1) {
            *cut = true;
            /* streaming: a string value cut off midway is already that
             * prefix of its JSON (without the closing quote) */
            const char *key = attr_get(&a, "key"), *type = attr_get(&a, "type");
            if (p->part && g == GOT_OK && is_arg && key && type && !strcmp(type, "string") && !json_block) {
                if (!first) k3_buf_puts(args, ", ");
                k3_pyjson_string(args, key, strlen(key));
                k3_buf_puts(args, ": ");
                k3_pyjson_string(args, c->s + c->at, c->n - c->at);
                if (args->len) args->len--; /* the closing quote */
            }
        } else if (is_arg) {
            const char *key = attr_get(&a, "key"), *type = attr_get(&a, "type");
            if (!key || !type || json_block) {
                st = bad(p, json_block ? "an argument after a json block" : "an argument without a key or a type");
            } else {
                if (!first) k3_buf_puts(args, ", ");
                k3_pyjson_string(args, key, strlen(key));
                k3_buf_puts(args, ": ");
                st = argument(p, args, name, key, type, c->s + c->at, end - c->at);
                first = false;
            }
        } else {
            /* a json block holds the whole arguments object */
            json_t *j = NULL;
            json_error_t je;
            size_t n = end - c->at;
            if (!first) st = bad(p, "a json block after arguments");
            else if (!k3_json_too_deep(c->s + c->at, n, 128)) j = json_loadb(c->s + c->at, n, JSON_ALLOW_NUL, &je);
            if (st == K3_OK && !json_is_object(j))
                st = k3_err(p->err, K3_ERR_FORMAT,
                            "tool call %d (%s): the arguments are not a "
                            "JSON object: %.*s",
                            p->n_calls + 1, name, n > 60 ? 60 : (int)n, c->s + c->at);
            if (st == K3_OK) {
                args->len = 0;
                k3_pyjson_dump(args, j, false, false);
                json_block = true;
                first = false;
            }
            json_decref(j);
        }
        attrs_free(&a);
        if (st != K3_OK || *cut) return st;
        c->at = end + strlen(close);
    }
    if (!json_block) k3_buf_puts(args, "}");
    return K3_OK;
}

/* After <|open|>tools<|sep|>: calls up to <|close|>tools<|sep|>. */
static k3_status tools(parser *p) {
    cursor *c = &p->c;
    for (;;) {
        if (eat(c, CLOSE "tools" SEP)) return K3_OK;
        if (!eat(c, OPEN "call")) {
            if (cut_inside(c, CLOSE "tools" SEP) || cut_inside(c, OPEN "call")) return K3_OK;
            return bad(p, "expected a call or the end of the tools block");
        }
        tag_attrs a = {0};
        got g = tag_rest(c, &a);
        k3_status st = K3_OK;
        bool cut = g == GOT_CUT;
        const char *name = attr_get(&a, "tool");
        if (g == GOT_NOMEM) st = nomem(p);
        else if (g == GOT_BAD || (g == GOT_OK && !name)) st = bad(p, "a call without a tool name");
        k3_buf args = {0};
        if (st == K3_OK && !cut) {
            st = call_body(p, name, &args, &cut);
            if (st == K3_OK && cut && p->part && !args.oom) {
                /* the call being generated: its name and arguments so far */
                const char *as = k3_buf_cstr(&args);
                p->part->name = strdup(name);
                p->part->args = as ? dup_n(as, args.len) : NULL;
                p->part->args_len = args.len;
                if (!p->part->name || !p->part->args) st = nomem(p);
            }
        }
        if (st == K3_OK && !cut && args.oom) st = nomem(p);
        if (st == K3_OK && !cut) {
            char id[32];
            new_call_id(id);
            k3_buf *b = &p->calls;
            k3_buf_puts(b, p->n_calls ? "," : "[");
            k3_buf_puts(b, "{\"id\":\"");
            k3_buf_puts(b, id);
            k3_buf_puts(b, "\",\"type\":\"function\",\"function\":{\"name\":");
            k3_pyjson_string(b, name, strlen(name));
            k3_buf_puts(b, ",\"arguments\":");
            k3_pyjson_string(b, args.p, args.len);
            k3_buf_puts(b, "}}");
            p->n_calls++;
        }
        k3_buf_free(&args);
        attrs_free(&a);
        if (st != K3_OK || cut) return st;
    }
}

void k3_chat_reply_free(k3_chat_reply *r) {
    if (!r) return;
    free(r->reasoning);
    free(r->content);
    free(r->tool_calls_json);
    *r = (k3_chat_reply){0};
}

void k3_chat_partial_call_free(k3_chat_partial_call *p) {
    if (!p) return;
    free(p->name);
    free(p->args);
    *p = (k3_chat_partial_call){0};
}

k3_status k3_chat_parse_reply(const char *text, size_t len, bool thinking, k3_chat_reply *out, k3_error *err) {
    return k3_chat_parse_reply_partial(text, len, thinking, out, NULL, err);
}

/* The front of a reply: where the reasoning ends (after its closing tag)
 * and where the content lies; c is left after the content. */
typedef struct spans {
    size_t reasoning_len, reasoning_end; /* the reasoning's bytes; the end of its channel */
    bool have_content;
    size_t content_off, content_len;
} spans;

static spans find_spans(cursor *c, bool thinking) {
    spans sp = {0};
    bool in_response = !thinking;
    if (thinking) {
        size_t end = find(c, CLOSE "think" SEP);
        sp.reasoning_len = end == (size_t)-1 ? c->n : end;
        c->at = end == (size_t)-1 ? c->n : end + strlen(CLOSE "think" SEP);
        sp.reasoning_end = c->at;
        in_response = eat(c, OPEN "response" SEP);
        /* A reply that goes on with neither a response channel nor tools
         * (nor the end of the message) is read as its content. */
        if (!in_response && c->at < c->n && !starts(c, OPEN "tools" SEP) && !starts(c, CLOSE "message" SEP) &&
            !starts(c, END_OF_MSG) && !cut_inside(c, OPEN "response" SEP) && !cut_inside(c, OPEN "tools" SEP))
            in_response = true;
    }
    if (in_response) {
        size_t end = find(c, CLOSE "response" SEP);
        sp.content_off = c->at;
        if (end == (size_t)-1) {
            /* cut off, or a reply that ends the message without closing
             * the channel */
            end = find(c, CLOSE "message" SEP);
            size_t eom = find(c, END_OF_MSG);
            if (eom < end) end = eom;
            if (end == (size_t)-1) end = c->n;
            c->at = end;
        } else {
            c->at = end + strlen(CLOSE "response" SEP);
        }
        sp.content_len = end - sp.content_off;
        sp.have_content = true;
    }
    return sp;
}

void k3_chat_reply_spans(const char *text, size_t len, bool thinking, size_t *reasoning_end, bool *has_content,
                         size_t *content_off, size_t *content_len) {
    cursor c = {text ? text : "", text ? len : 0, 0};
    const spans sp = find_spans(&c, thinking);
    *reasoning_end = sp.reasoning_end;
    *has_content = sp.have_content;
    *content_off = sp.content_off;
    *content_len = sp.content_len;
}

k3_status k3_chat_parse_reply_partial(const char *text, size_t len, bool thinking, k3_chat_reply *out,
                                      k3_chat_partial_call *part, k3_error *err) {
    *out = (k3_chat_reply){0};
    if (part) *part = (k3_chat_partial_call){0};
    if (!text && len) return k3_err(err, K3_ERR_ARG, "k3_chat_parse_reply: no text");
    parser p = {.c = {text ? text : "", len, 0}, .err = err, .part = part};
    cursor *c = &p.c;
    const spans sp = find_spans(c, thinking);
    k3_status st = K3_OK;
    if (eat(c, OPEN "tools" SEP)) st = tools(&p);

    if (st == K3_OK && sp.reasoning_len) {
        if (!(out->reasoning = dup_n(c->s, sp.reasoning_len))) st = nomem(&p);
    }
    if (st == K3_OK && sp.have_content && (sp.content_len || !p.n_calls)) {
        if (!(out->content = dup_n(c->s + sp.content_off, sp.content_len))) st = nomem(&p);
    }
    if (st == K3_OK && p.n_calls) {
        k3_buf_puts(&p.calls, "]");
        const char *s = k3_buf_cstr(&p.calls);
        if (!s) st = nomem(&p);
        else if (!(out->tool_calls_json = dup_n(s, p.calls.len))) st = nomem(&p);
        out->n_tool_calls = p.n_calls;
    }
    if (st == K3_OK && p.calls.oom) st = nomem(&p);
    k3_buf_free(&p.calls);
    if (st != K3_OK) {
        k3_chat_reply_free(out);
        k3_chat_partial_call_free(part);
    }
    return st;
}
