/*
 * chat_reply.c -- k3_chat_parse_reply: a generated assistant turn back into
 * OpenAI fields, the inverse of what chat_json.c renders for an assistant
 * message (encoding_k3.py _render_assistant_segments), in the words of
 * common/chat_form.h:
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
 * The markup is the four specials (<|open|>, <|close|>, <|sep|>,
 * <|end_of_msg|>): a field is text between them and never holds one. The
 * server says where its specials are (k3_chat_text.marks: the offsets of the
 * tokens it decoded by name), so text the model wrote that spells a
 * special's name is text; without marks (k3_chat_parse_reply) every
 * occurrence of a name is one. A channel's text ends at the first special:
 * its closing tag, or another tag (a model that skips a closing tag), or
 * the end of the text (max_tokens) -- never with a piece of a tag in it.
 *
 * Attribute values are un-escaped (&quot; &amp;). An argument's VALUE is
 * text for type="string" and JSON of the declared type otherwise (number,
 * boolean, null, object, array), passed through as text: numbers byte for
 * byte as written, whatever their length (common/json_text.h, the same
 * definition the grammar uses), objects and arrays re-spaced as Python's
 * json.dumps writes them (", " and ": "), so that they render back to the
 * same tokens. A value that is not JSON of its type is K3_ERR_FORMAT naming
 * the call and the key.
 *
 * Text that stops early (max_tokens) parses as far as it goes: the reasoning
 * or content so far, the calls that were closed, and a call cut off midway
 * once its name is known: its arguments so far (those complete, and a
 * string value cut midway up to the cut, without its closing quote), the
 * last entry of tool_calls_json with last_call_cut set -- or, for a stream
 * (k3_chat_parse_reply_partial with part), in part instead. The stream and
 * the whole answer thus tell one cut call the same way. reasoning is NULL
 * when absent or empty; content is NULL when the response channel is
 * absent, or empty and there are tool calls (OpenAI's content: null);
 * tool_calls_json is NULL without tool calls. Tool-call ids are "call_"
 * and 24 letters and digits, new for every call.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/chat_form.h"
#include "common/error.h"
#include "common/json_guard.h"
#include "common/json_text.h"
#include "common/random.h"
#include "tokenizer/chat_json.h"
#include "tokenizer/chat_stream.h"

enum { MK_NONE, MK_OPEN, MK_CLOSE, MK_SEP, MK_EOM };

static const struct {
    const char *name;
    size_t len;
} mark_names[] = {
    {"", 0},
    {K3_FORM_OPEN, sizeof K3_FORM_OPEN - 1},
    {K3_FORM_CLOSE, sizeof K3_FORM_CLOSE - 1},
    {K3_FORM_SEP, sizeof K3_FORM_SEP - 1},
    {K3_FORM_END_OF_MSG, sizeof K3_FORM_END_OF_MSG - 1},
};

typedef struct cursor {
    const char *s;
    size_t n, at;
    const size_t *mk; /* the specials' offsets, ascending; NULL: every name is one */
    size_t nmk;
} cursor;

/* Which special's name s[i..] starts with. */
static int name_at(const cursor *c, size_t i) {
    if (i >= c->n || c->s[i] != '<') return MK_NONE;
    for (int k = MK_OPEN; k <= MK_EOM; k++)
        if (c->n - i >= mark_names[k].len && !memcmp(c->s + i, mark_names[k].name, mark_names[k].len)) return k;
    return MK_NONE;
}

/* The first listed offset >= from (c->nmk when none). */
static size_t mk_lower(const cursor *c, size_t from) {
    size_t lo = 0, hi = c->nmk;
    while (lo < hi) {
        const size_t mid = (lo + hi) / 2;
        if (c->mk[mid] < from) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The special at offset i, MK_NONE when none begins there. */
static int mark_at(const cursor *c, size_t i) {
    if (!c->mk) return name_at(c, i);
    const size_t k = mk_lower(c, i);
    return k < c->nmk && c->mk[k] == i ? name_at(c, i) : MK_NONE;
}

/* The offset of the first special at or after from, or c->n. */
static size_t next_mark(const cursor *c, size_t from) {
    if (c->mk) {
        for (size_t k = mk_lower(c, from); k < c->nmk && c->mk[k] < c->n; k++)
            if (name_at(c, c->mk[k]) != MK_NONE) return c->mk[k];
        return c->n;
    }
    for (size_t i = from; i + 1 < c->n; i++)
        if (c->s[i] == '<' && c->s[i + 1] == '|' && name_at(c, i) != MK_NONE) return i;
    return c->n;
}

/* Whether a tag MARK NAME (then a space or <|sep|>) begins at c->at; *after
 * is the offset after NAME. */
static bool tag_starts(const cursor *c, int mark, const char *name, size_t *after) {
    if (mark_at(c, c->at) != mark) return false;
    const size_t i = c->at + mark_names[mark].len, l = strlen(name);
    if (c->n - i < l || memcmp(c->s + i, name, l)) return false;
    if (i + l < c->n && c->s[i + l] != ' ' && mark_at(c, i + l) != MK_SEP) return false;
    *after = i + l;
    return true;
}

/* Eats a whole tag MARK NAME <|sep|> (no attributes) at c->at. */
static bool eat_tag(cursor *c, int mark, const char *name) {
    size_t i;
    if (!tag_starts(c, mark, name, &i) || mark_at(c, i) != MK_SEP) return false;
    c->at = i + mark_names[MK_SEP].len;
    return true;
}

/* Whether the text ends inside a tag MARK NAME...: the rest from c->at is
 * the special and a prefix of NAME (or NAME and attributes with no <|sep|>
 * yet). Nothing left at all counts too. */
static bool tag_cut(const cursor *c, int mark, const char *name) {
    if (c->at >= c->n) return true;
    if (mark_at(c, c->at) != mark) return false;
    const size_t i = c->at + mark_names[mark].len, rest = c->n - i, l = strlen(name);
    if (rest < l) return !memcmp(c->s + i, name, rest);
    if (memcmp(c->s + i, name, l)) return false;
    return next_mark(c, i + l) == c->n; /* the name, maybe attributes, and no <|sep|> yet */
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

/* After "<|open|>NAME": ( KEY="VALUE")* <|sep|>; a special anywhere before
 * the <|sep|> is malformed. */
static got tag_rest(cursor *c, tag_attrs *a) {
    a->n = 0;
    const size_t end = next_mark(c, c->at);
    for (;;) {
        if (c->at == end) {
            if (end == c->n) return GOT_CUT;
            if (mark_at(c, end) != MK_SEP) return GOT_BAD;
            c->at += mark_names[MK_SEP].len;
            return GOT_OK;
        }
        if (c->s[c->at] != ' ' || a->n == MAX_ATTRS) return GOT_BAD;
        size_t k0 = ++c->at;
        while (c->at < end && c->s[c->at] != '=' && c->s[c->at] != ' ') c->at++;
        size_t k1 = c->at;
        if (c->at == end) return end == c->n ? GOT_CUT : GOT_BAD;
        if (k1 == k0 || c->s[c->at] != '=') return GOT_BAD;
        if (++c->at == end) return end == c->n ? GOT_CUT : GOT_BAD;
        if (c->s[c->at++] != '"') return GOT_BAD;
        size_t v0 = c->at;
        while (c->at < end && c->s[c->at] != '"') c->at++;
        if (c->at == end) return end == c->n ? GOT_CUT : GOT_BAD;
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
    bool last_cut;              /* the last entry of calls is a call cut off midway */
    k3_chat_partial_call *part; /* NULL, or where the call cut off at the end goes */
} parser;

static k3_status bad(parser *p, const char *what) {
    return k3_err(p->err, K3_ERR_FORMAT, "the reply's tool calls are malformed at byte %zu: %s", p->c.at, what);
}

static k3_status nomem(parser *p) { return k3_err(p->err, K3_ERR_NOMEM, "out of memory parsing a reply"); }

#define MAX_DEPTH 128

/* One argument value of its declared type, appended to args as JSON. */
static k3_status argument(parser *p, k3_buf *args, const char *name, const char *key, const char *type, const char *v,
                          size_t n) {
    if (!strcmp(type, "string")) {
        k3_json_write_string(args, v, n);
        return K3_OK;
    }
    static const struct {
        const char *name;
        k3_json_type t;
    } types[] = {{"number", K3_JSON_T_NUMBER},
                 {"boolean", K3_JSON_T_BOOL},
                 {"null", K3_JSON_T_NULL},
                 {"object", K3_JSON_T_OBJECT},
                 {"array", K3_JSON_T_ARRAY}};
    int want = -1;
    for (int i = 0; i < 5; i++)
        if (!strcmp(type, types[i].name)) want = i;
    if (want < 0)
        return k3_err(p->err, K3_ERR_FORMAT, "tool call %d (%s): argument \"%s\" has the unknown type \"%s\"",
                      p->n_calls + 1, name, key, type);
    const size_t mark = args->len;
    k3_json_type jt = K3_JSON_T_NULL;
    const char *why = NULL;
    if (k3_json_text_canon(args, v, n, MAX_DEPTH, &jt, &why, NULL) && jt == types[want].t) return K3_OK;
    if (args->oom) return nomem(p);
    args->len = mark;
    return k3_err(p->err, K3_ERR_FORMAT, "tool call %d (%s): argument \"%s\" is not a valid %s: %.*s", p->n_calls + 1,
                  name, key, type, n > 60 ? 60 : (int)n, v);
}

/* The body of a call after its open tag, up to and including
 * <|close|>call<|sep|>. *cut: the text ended first (args then holds the
 * arguments so far, a cut string value up to the cut without its quote). */
static k3_status call_body(parser *p, const char *name, k3_buf *args, bool *cut) {
    cursor *c = &p->c;
    bool first = true, json_block = false;
    k3_buf_puts(args, "{");
    for (;;) {
        if (eat_tag(c, MK_CLOSE, K3_FORM_CALL)) break;
        size_t i;
        const bool is_arg = tag_starts(c, MK_OPEN, K3_FORM_ARGUMENT, &i);
        const bool is_json = !is_arg && tag_starts(c, MK_OPEN, K3_FORM_JSON, &i);
        if (!is_arg && !is_json) {
            if (tag_cut(c, MK_CLOSE, K3_FORM_CALL) || tag_cut(c, MK_OPEN, K3_FORM_ARGUMENT) ||
                tag_cut(c, MK_OPEN, K3_FORM_JSON)) {
                *cut = true;
                return K3_OK;
            }
            return bad(p, "expected an argument, a json block or the end of the call");
        }
        c->at = i;
        tag_attrs a = {0};
        const got g = tag_rest(c, &a);
        const char *close = is_arg ? K3_FORM_ARGUMENT : K3_FORM_JSON;
        const size_t v0 = c->at, end = g == GOT_OK ? next_mark(c, v0) : 0;
        k3_status st = K3_OK;
        bool value_cut = false;
        if (g == GOT_OK) {
            c->at = end;
            if (eat_tag(c, MK_CLOSE, close)) value_cut = false;
            else if (tag_cut(c, MK_CLOSE, close)) value_cut = true;
            else st = bad(p, "a value holds another tag");
        }
        if (g == GOT_NOMEM) st = nomem(p);
        else if (g == GOT_BAD) st = bad(p, "a malformed argument tag");
        else if (st == K3_OK && (g == GOT_CUT || value_cut)) {
            *cut = true;
            /* a string value cut off midway is already that prefix of its
             * JSON (without the closing quote) */
            const char *key = attr_get(&a, K3_FORM_ATTR_KEY), *type = attr_get(&a, K3_FORM_ATTR_TYPE);
            if (g == GOT_OK && is_arg && key && type && !strcmp(type, "string") && !json_block) {
                if (!first) k3_buf_puts(args, ", ");
                k3_json_write_string(args, key, strlen(key));
                k3_buf_puts(args, ": ");
                k3_json_write_string(args, c->s + v0, end - v0);
                if (args->len) args->len--; /* the closing quote */
            }
        } else if (st == K3_OK && is_arg) {
            const char *key = attr_get(&a, K3_FORM_ATTR_KEY), *type = attr_get(&a, K3_FORM_ATTR_TYPE);
            if (!key || !type || json_block) {
                st = bad(p, json_block ? "an argument after a json block" : "an argument without a key or a type");
            } else {
                if (!first) k3_buf_puts(args, ", ");
                k3_json_write_string(args, key, strlen(key));
                k3_buf_puts(args, ": ");
                st = argument(p, args, name, key, type, c->s + v0, end - v0);
                first = false;
            }
        } else if (st == K3_OK) {
            /* a json block holds the whole arguments object */
            k3_buf o = {0};
            k3_json_type t = K3_JSON_T_NULL;
            const size_t n = end - v0;
            if (!first) st = bad(p, "a json block after arguments");
            else if (!k3_json_text_canon(&o, c->s + v0, n, MAX_DEPTH, &t, NULL, NULL) || t != K3_JSON_T_OBJECT)
                st = o.oom
                    ? nomem(p)
                    : k3_err(p->err, K3_ERR_FORMAT, "tool call %d (%s): the arguments are not a JSON object: %.*s",
                             p->n_calls + 1, name, n > 60 ? 60 : (int)n, c->s + v0);
            if (st == K3_OK) {
                args->len = 0;
                k3_buf_add(args, o.p, o.len);
                json_block = true;
                first = false;
            }
            k3_buf_free(&o);
        }
        attrs_free(&a);
        if (st != K3_OK || *cut) return st;
    }
    if (!json_block) k3_buf_puts(args, "}");
    return K3_OK;
}

/* Appends a call {id, type, function {name, arguments}} to p->calls. */
static void add_call(parser *p, const char *name, const char *args, size_t len) {
    char id[32];
    new_call_id(id);
    k3_buf *b = &p->calls;
    k3_buf_puts(b, p->n_calls ? "," : "[");
    k3_buf_puts(b, "{\"id\":\"");
    k3_buf_puts(b, id);
    k3_buf_puts(b, "\",\"type\":\"function\",\"function\":{\"name\":");
    k3_json_write_string(b, name, strlen(name));
    k3_buf_puts(b, ",\"arguments\":");
    k3_json_write_string(b, args ? args : "", args ? len : 0);
    k3_buf_puts(b, "}}");
    p->n_calls++;
}

/* After <|open|>tools<|sep|>: calls up to <|close|>tools<|sep|> (or the end
 * of the message, a model that skips that tag). */
static k3_status tools(parser *p) {
    cursor *c = &p->c;
    for (;;) {
        if (eat_tag(c, MK_CLOSE, K3_FORM_TOOLS)) return K3_OK;
        size_t i;
        if (!tag_starts(c, MK_OPEN, K3_FORM_CALL, &i)) {
            if (tag_cut(c, MK_CLOSE, K3_FORM_TOOLS) || tag_cut(c, MK_OPEN, K3_FORM_CALL)) return K3_OK;
            if (tag_starts(c, MK_CLOSE, K3_FORM_MESSAGE, &i) || mark_at(c, c->at) == MK_EOM) return K3_OK;
            return bad(p, "expected a call or the end of the tools block");
        }
        c->at = i;
        tag_attrs a = {0};
        const got g = tag_rest(c, &a);
        k3_status st = K3_OK;
        bool cut = g == GOT_CUT;
        const char *name = attr_get(&a, K3_FORM_ATTR_TOOL);
        if (g == GOT_NOMEM) st = nomem(p);
        else if (g == GOT_BAD || (g == GOT_OK && !name)) st = bad(p, "a call without a tool name");
        k3_buf args = {0};
        if (st == K3_OK && !cut) {
            st = call_body(p, name, &args, &cut);
            if (st == K3_OK && args.oom) st = nomem(p);
            if (st == K3_OK && cut && p->part) {
                /* a stream: the call being generated, its name and arguments so far */
                const char *as = k3_buf_cstr(&args);
                p->part->name = strdup(name);
                p->part->args = as ? dup_n(as, args.len) : NULL;
                p->part->args_len = args.len;
                if (!p->part->name || !p->part->args) st = nomem(p);
            } else if (st == K3_OK) {
                /* a whole call, or (the whole answer) the one cut off, as far as it goes */
                add_call(p, name, args.p, args.len);
                p->last_cut = cut;
            }
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
        const size_t e = next_mark(c, c->at);
        sp.reasoning_len = e;
        c->at = e;
        if (eat_tag(c, MK_CLOSE, K3_FORM_THINK)) sp.reasoning_end = c->at;
        else if (tag_cut(c, MK_CLOSE, K3_FORM_THINK)) sp.reasoning_end = c->at = c->n; /* cut in its closing tag */
        else sp.reasoning_end = e; /* open at the end, or another tag closed it */
        in_response = eat_tag(c, MK_OPEN, K3_FORM_RESPONSE);
        /* text after the think block with no response tag is its content */
        if (!in_response && c->at < c->n && mark_at(c, c->at) == MK_NONE) in_response = true;
    }
    if (in_response) {
        const size_t e = next_mark(c, c->at);
        sp.content_off = c->at;
        sp.content_len = e - c->at;
        sp.have_content = true;
        c->at = e;
        eat_tag(c, MK_CLOSE, K3_FORM_RESPONSE); /* else another tag ended it, or the text did */
    }
    return sp;
}

/* The text up to a listed special whose name it cuts (a server may cut its
 * text inside one for a stop string): a special is all or nothing. Only the
 * last special that begins before len can be cut. */
static size_t whole_marks_len(const char *text, size_t len, const k3_chat_text *t) {
    if (!t || !t->marks) return len;
    cursor c = {text, len, 0, t->marks, t->n_marks};
    const size_t k = mk_lower(&c, len);
    if (k == 0) return len;
    const size_t at = t->marks[k - 1];
    return name_at(&c, at) == MK_NONE ? at : len;
}

/* Without marks, a text that ends with a proper prefix of a special's name
 * ("<|clo") ends before it: a cut inside a tag. */
static size_t whole_names_len(const char *s, size_t len) {
    for (size_t back = 1; back < sizeof K3_FORM_END_OF_MSG - 1 && back <= len; back++) {
        const size_t at = len - back;
        if (s[at] != '<') continue;
        for (int k = MK_OPEN; k <= MK_EOM; k++)
            if (back < mark_names[k].len && !memcmp(s + at, mark_names[k].name, back)) return at;
        break;
    }
    return len;
}

static void cursor_init(cursor *c, const char *text, size_t len, const k3_chat_text *t) {
    *c = (cursor){text ? text : "", text ? len : 0, 0, NULL, 0};
    if (t && t->marks) {
        c->n = whole_marks_len(c->s, c->n, t);
        c->mk = t->marks;
        c->nmk = t->n_marks;
    } else {
        c->n = whole_names_len(c->s, c->n);
    }
}

void k3_chat_reply_spans_marked(const char *text, size_t len, const k3_chat_text *t, bool thinking,
                                size_t *reasoning_end, bool *has_content, size_t *content_off, size_t *content_len) {
    cursor c;
    cursor_init(&c, text, len, t);
    const spans sp = find_spans(&c, thinking);
    *reasoning_end = sp.reasoning_end;
    *has_content = sp.have_content;
    *content_off = sp.content_off;
    *content_len = sp.content_len;
}

void k3_chat_reply_spans(const char *text, size_t len, bool thinking, size_t *reasoning_end, bool *has_content,
                         size_t *content_off, size_t *content_len) {
    k3_chat_reply_spans_marked(text, len, NULL, thinking, reasoning_end, has_content, content_off, content_len);
}

k3_status k3_chat_parse_reply_marked(const char *text, size_t len, const k3_chat_text *t, bool thinking,
                                     k3_chat_reply *out, k3_chat_partial_call *part, k3_error *err) {
    *out = (k3_chat_reply){0};
    if (part) *part = (k3_chat_partial_call){0};
    if (!text && len) return k3_err(err, K3_ERR_ARG, "k3_chat_parse_reply: no text");
    parser p = {.err = err, .part = part};
    cursor_init(&p.c, text, len, t);
    cursor *c = &p.c;
    const spans sp = find_spans(c, thinking);
    k3_status st = K3_OK;
    if (eat_tag(c, MK_OPEN, K3_FORM_TOOLS)) st = tools(&p);

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
        out->last_call_cut = p.last_cut;
    }
    if (st == K3_OK && p.calls.oom) st = nomem(&p);
    k3_buf_free(&p.calls);
    if (st != K3_OK) {
        k3_chat_reply_free(out);
        k3_chat_partial_call_free(part);
    }
    return st;
}

k3_status k3_chat_parse_reply_partial(const char *text, size_t len, bool thinking, k3_chat_reply *out,
                                      k3_chat_partial_call *part, k3_error *err) {
    return k3_chat_parse_reply_marked(text, len, NULL, thinking, out, part, err);
}

k3_status k3_chat_parse_reply(const char *text, size_t len, bool thinking, k3_chat_reply *out, k3_error *err) {
    return k3_chat_parse_reply_marked(text, len, NULL, thinking, out, NULL, err);
}
