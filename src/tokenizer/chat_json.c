/*
 * chat_json.c -- k3_chat_encode_json: OpenAI-shaped messages and tools in the
 * K3 "XTML" chat format, segment for segment as Moonshot's encoding_k3.py
 * build_chat_segments renders them (tests/golden/chat/ holds that encoder's
 * ids, tools/gen_chat_goldens.py writes them).
 *
 * The order of the output, as build_chat_segments emits it:
 *   1. tool declarations (system, type="tool-declare"): the tools array,
 *      deep-sorted and compact, in a ```json block;
 *   2. thinking effort (system, type="thinking-effort"), thinking on only;
 *   3. the messages, after two normalizations: each run of consecutive tool
 *      messages is re-sorted into the order of the preceding assistant's
 *      tool_calls when every one of them resolves by tool_call_id (and then
 *      takes that call's function name); tool-call arguments given as a JSON
 *      string are parsed, and a string that is not JSON goes out verbatim
 *      in a <|open|>json type="object"<|sep|> block (_xtml_json_block);
 *   4. tool choice (required / none), then response format (json_object /
 *      json_schema with its deep-sorted schema);
 *   5. the generation prompt.
 * Every text piece is its own segment (its own call to the BPE), so segment
 * boundaries are token boundaries; empty pieces vanish. Control markers are
 * single special ids.
 *
 * Where Python would quietly accept odd input (a non-string name goes
 * through str(), a non-dict message is skipped, an unknown role renders
 * nothing) this encoder refuses it with K3_ERR_ARG naming the message:
 * a server should answer 400, not guess. Image parts are
 * K3_ERR_UNSUPPORTED (this is the text encoder). JSON that jansson cannot
 * hold (NaN, integers beyond 64 bits, lone surrogates) is refused as
 * malformed, except inside a tool call's argument string, where, as in
 * Python for any unparsable string, it goes out as a json block.
 */
#include "tokenizer/chat_json.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/chat_form.h"
#include "common/error.h"
#include "common/json_guard.h"
#include "common/json_text.h"
#include "tokenizer/tokenizer_internal.h"

/* ---- JSON as Python writes it ---------------------------------------------- */

void k3_pyjson_float(k3_buf *b, double v) {
    if (v == 0) {
        k3_buf_puts(b, signbit(v) ? "-0.0" : "0.0");
        return;
    }
    if (v < 0) k3_buf_puts(b, "-");
    double a = fabs(v);
    /* The shortest %.*e that reads back to a: repr's digits. */
    char e[40];
    for (int p = 0; p < 17; p++) {
        snprintf(e, sizeof e, "%.*e", p, a);
        if (strtod(e, NULL) == a) break;
    }
    char digits[24];
    int nd = 0;
    const char *q = e;
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9') digits[nd++] = *q;
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    int exp10 = atoi(q + 1);
    int decpt = exp10 + 1; /* digits d1d2... mean 0.d1d2... * 10^decpt */
    char out[64];
    int n = 0;
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            out[n++] = '0';
            out[n++] = '.';
            for (int i = 0; i < -decpt; i++) out[n++] = '0';
            for (int i = 0; i < nd; i++) out[n++] = digits[i];
        } else if (decpt >= nd) {
            for (int i = 0; i < nd; i++) out[n++] = digits[i];
            for (int i = nd; i < decpt; i++) out[n++] = '0';
            out[n++] = '.';
            out[n++] = '0';
        } else {
            for (int i = 0; i < nd; i++) {
                if (i == decpt) out[n++] = '.';
                out[n++] = digits[i];
            }
        }
        out[n] = 0;
    } else {
        out[n++] = digits[0];
        if (nd > 1) {
            out[n++] = '.';
            for (int i = 1; i < nd; i++) out[n++] = digits[i];
        }
        int x = decpt - 1;
        n += snprintf(out + n, sizeof out - (size_t)n, "e%c%02d", x < 0 ? '-' : '+', abs(x));
    }
    k3_buf_puts(b, out);
}

void k3_pyjson_string(k3_buf *b, const char *s, size_t n) { k3_json_write_string(b, s, n); }

typedef struct kv {
    const char *key;
    json_t *val;
} kv;

static int kv_cmp(const void *a, const void *b) { return strcmp(((const kv *)a)->key, ((const kv *)b)->key); }

void k3_pyjson_dump(k3_buf *b, const json_t *v, bool compact, bool sort_keys) {
    const char *item_sep = compact ? "," : ", ", *key_sep = compact ? ":" : ": ";
    char num[32];
    switch (json_typeof(v)) {
    case JSON_NULL: k3_buf_puts(b, "null"); break;
    case JSON_TRUE: k3_buf_puts(b, "true"); break;
    case JSON_FALSE: k3_buf_puts(b, "false"); break;
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        k3_buf_puts(b, num);
        break;
    case JSON_REAL: k3_pyjson_float(b, json_real_value(v)); break;
    case JSON_STRING: k3_pyjson_string(b, json_string_value(v), json_string_length(v)); break;
    case JSON_ARRAY:
        k3_buf_puts(b, "[");
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i) k3_buf_puts(b, item_sep);
            k3_pyjson_dump(b, json_array_get(v, i), compact, sort_keys);
        }
        k3_buf_puts(b, "]");
        break;
    case JSON_OBJECT: {
        size_t n = json_object_size(v), i = 0;
        kv *items = malloc((n ? n : 1) * sizeof *items);
        if (!items) {
            b->oom = true;
            return;
        }
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)v, key, val) items[i++] = (kv){key, val};
        if (sort_keys) qsort(items, n, sizeof *items, kv_cmp);
        k3_buf_puts(b, "{");
        for (i = 0; i < n; i++) {
            if (i) k3_buf_puts(b, item_sep);
            k3_pyjson_string(b, items[i].key, strlen(items[i].key));
            k3_buf_puts(b, key_sep);
            k3_pyjson_dump(b, items[i].val, compact, sort_keys);
        }
        k3_buf_puts(b, "}");
        free(items);
        break;
    }
    }
}

/* ---- Python semantics the renderer leans on --------------------------------- */

/* Python truthiness of a JSON value (None, False, 0, "", [], {} are false). */
static bool truthy(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_NULL:
    case JSON_FALSE: return false;
    case JSON_TRUE: return true;
    case JSON_INTEGER: return json_integer_value(v) != 0;
    case JSON_REAL: return json_real_value(v) != 0;
    case JSON_STRING: return json_string_length(v) > 0;
    case JSON_ARRAY: return json_array_size(v) > 0;
    case JSON_OBJECT: return json_object_size(v) > 0;
    }
    return false;
}

/* Decodes one UTF-8 code point at s (valid UTF-8 assumed: jansson checked). */
static uint32_t utf8_at(const unsigned char *s, size_t n, size_t *len) {
    uint32_t c = s[0];
    size_t l = c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
    if (l > n) l = n;
    if (l > 1) c &= 0x3f >> (l - 1);
    for (size_t i = 1; i < l; i++) c = c << 6 | (s[i] & 0x3f);
    *len = l;
    return c;
}

/* str.isspace: the code points Python strips with str.strip(). */
static bool py_isspace(uint32_t c) {
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
        (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

/* True when s.strip() would be empty. */
static bool py_blank(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        size_t l;
        if (!py_isspace(utf8_at((const unsigned char *)s + i, n - i, &l))) return false;
        i += l;
    }
    return true;
}

/* str(v) of a scalar id (tool_calls[].id, tool_call_id): strings as they
 * are, numbers as Python prints them, booleans as True / False. */
static bool py_str_scalar(k3_buf *b, const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_STRING: k3_buf_add(b, json_string_value(v), json_string_length(v)); return true;
    case JSON_TRUE: k3_buf_puts(b, "True"); return true;
    case JSON_FALSE: k3_buf_puts(b, "False"); return true;
    case JSON_INTEGER:
    case JSON_REAL: k3_pyjson_dump(b, v, false, false); return true;
    default: return false;
    }
}

/* ---- segments ------------------------------------------------------------- */

typedef struct enc {
    const k3_tokenizer *t;
    k3_ids out;
    k3_error *err;
    int32_t open, sep, close, end_of_msg;
} enc;

typedef struct attr {
    const char *key;
    const char *val; /* may hold NULs: vlen says how long */
    size_t vlen;
} attr;

/* Text segments go through k3_tokenizer_encode_append, which cuts long
 * text into the pieces the official tokenizer encodes separately
 * (tokenization_kimi.py _encode_text_piece: 400,000-code-point chunks, runs
 * of at most 25,000 whitespace or non-whitespace code points). */
static k3_status text(enc *e, const char *s, size_t n) {
    return k3_tokenizer_encode_append(e->t, s, n, &e->out, e->err);
}

static k3_status texts(enc *e, const char *s) { return text(e, s, strlen(s)); }

static k3_status control(enc *e, int32_t id) { return k3_ids_push(&e->out, id, e->err); }

static k3_status nomem(k3_error *err) { return k3_err(err, K3_ERR_NOMEM, "out of memory encoding a chat"); }

/* " KEY", "=\"", VALUE with & and " escaped, "\"" */
static k3_status attr_seg(enc *e, const attr *a) {
    k3_buf b = {0};
    k3_buf_puts(&b, " ");
    k3_buf_puts(&b, a->key);
    if (b.oom) return nomem(e->err);
    k3_status st = text(e, b.p, b.len);
    if (st == K3_OK) st = texts(e, "=\"");
    b.len = 0;
    for (size_t i = 0; i < a->vlen; i++) {
        char c = a->val[i];
        if (c == '&') k3_buf_puts(&b, "&amp;");
        else if (c == '"') k3_buf_puts(&b, "&quot;");
        else k3_buf_add(&b, &c, 1);
    }
    if (st == K3_OK && b.oom) st = nomem(e->err);
    if (st == K3_OK) st = text(e, b.p, b.len);
    if (st == K3_OK) st = texts(e, "\"");
    k3_buf_free(&b);
    return st;
}

static k3_status open_tag(enc *e, const char *tag, const attr *attrs, size_t n_attrs) {
    k3_status st = control(e, e->open);
    if (st == K3_OK) st = texts(e, tag);
    for (size_t i = 0; i < n_attrs && st == K3_OK; i++) st = attr_seg(e, &attrs[i]);
    if (st == K3_OK) st = control(e, e->sep);
    return st;
}

static k3_status close_tag(enc *e, const char *tag) {
    k3_status st = control(e, e->close);
    if (st == K3_OK) st = texts(e, tag);
    if (st == K3_OK) st = control(e, e->sep);
    return st;
}

static attr attr_s(const char *key, const char *val) { return (attr){key, val, strlen(val)}; }

/* An internal system message: <|open|>message role="system" type=TYPE ... */
static k3_status system_note(enc *e, const char *type, const char *body) {
    attr a[2] = {attr_s("role", "system"), attr_s("type", type)};
    k3_status st = open_tag(e, "message", a, 2);
    if (st == K3_OK) st = texts(e, body);
    if (st == K3_OK) st = close_tag(e, "message");
    if (st == K3_OK) st = control(e, e->end_of_msg);
    return st;
}

static k3_status tool_declare(enc *e, const json_t *tools, bool dynamic) {
    k3_buf b = {0};
    k3_buf_puts(&b,
                dynamic ? "## New Tools Available\n"
                          "The system dynamically extends the toolset via lazy-loading.\n"
                          "You have access to all existing and extended tools.\n"
                          "Here are the specs for the extended tools.\n\n"
                          "```json\n"
                        : "# Tools\n"
                          "Here are the available tools, described in JSONSchema.\n\n"
                          "```json\n");
    k3_pyjson_dump(&b, tools, true, true);
    k3_buf_puts(&b, "\n```");
    attr a[2] = {attr_s("role", "system"), attr_s("type", "tool-declare")};
    k3_status st = b.oom ? nomem(e->err) : open_tag(e, "message", a, 2);
    if (st == K3_OK) st = text(e, b.p, b.len);
    if (st == K3_OK) st = close_tag(e, "message");
    if (st == K3_OK) st = control(e, e->end_of_msg);
    k3_buf_free(&b);
    return st;
}

/* ---- messages ------------------------------------------------------------- */

typedef enum role { ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL } role;

typedef struct msg {
    json_t *m;    /* the message object (borrowed from the parsed array) */
    size_t index; /* its index in the request, for error messages */
    role role;
    json_t *tool; /* the tool name the id matching resolved, or NULL */
} msg;

static k3_status content(enc *e, const json_t *c, size_t index) {
    if (!c || json_is_null(c)) return K3_OK;
    if (json_is_string(c)) return text(e, json_string_value(c), json_string_length(c));
    if (!json_is_array(c))
        return k3_err(e->err, K3_ERR_ARG,
                      "message %zu: content must be a string or an array "
                      "of parts",
                      index);
    for (size_t i = 0; i < json_array_size(c); i++) {
        json_t *part = json_array_get(c, i), *type = json_object_get(part, "type");
        if (!json_is_object(part) || !type)
            return k3_err(e->err, K3_ERR_ARG,
                          "message %zu: content part %zu is not an object "
                          "with a \"type\"",
                          index, i);
        const char *ts = json_string_value(type);
        if (ts && (!strcmp(ts, "image") || !strcmp(ts, "image_url")))
            return k3_err(e->err, K3_ERR_UNSUPPORTED,
                          "message %zu: content part %zu is an "
                          "image, which the text chat encoder does not take",
                          index, i);
        json_t *t = json_object_get(part, "text");
        /* as encoding_k3.py, a part of any other type is read for its "text";
         * one without (input_audio, file, video_url, ...) is a kind of
         * content K3 does not take, and is named as such */
        if (!json_is_string(t) && ts && strcmp(ts, "text"))
            return k3_err(e->err, K3_ERR_UNSUPPORTED,
                          "message %zu: content part %zu has the type "
                          "\"%.40s\", which K3 does not take (text and image_url parts only)",
                          index, i, ts);
        if (!json_is_string(t))
            return k3_err(e->err, K3_ERR_ARG,
                          "message %zu: content part %zu has no \"text\" "
                          "string",
                          index, i);
        k3_status st = text(e, json_string_value(t), json_string_length(t));
        if (st != K3_OK) return st;
    }
    return K3_OK;
}

/* The function object of a tool call: tool_call["function"] when present
 * (it must be an object), else the tool call itself. */
static k3_status call_fn(const json_t *tc, size_t index, size_t i, json_t **fn, k3_error *err) {
    if (!json_is_object(tc)) return k3_err(err, K3_ERR_ARG, "message %zu: tool call %zu is not an object", index, i);
    json_t *f = json_object_get(tc, "function");
    if (f && !json_is_object(f))
        return k3_err(err, K3_ERR_ARG,
                      "message %zu: tool call %zu: \"function\" is not an "
                      "object",
                      index, i);
    *fn = f ? f : (json_t *)tc;
    return K3_OK;
}

static k3_status call_name(const json_t *fn, size_t index, size_t i, const json_t **name, k3_error *err) {
    json_t *n = json_object_get(fn, "name");
    if (!json_is_string(n))
        return k3_err(err, K3_ERR_ARG, "message %zu: tool call %zu has no function name string", index, i);
    *name = n;
    return K3_OK;
}

static k3_status tool_call(enc *e, const json_t *tc, size_t index, size_t i) {
    json_t *fn = NULL;
    const json_t *name = NULL;
    k3_status st = call_fn(tc, index, i, &fn, e->err);
    if (st == K3_OK) st = call_name(fn, index, i, &name, e->err);
    if (st != K3_OK) return st;

    /* normalize_tool_arguments: None -> {}, dict as is, a string parsed
     * (blank -> {}; not JSON -> a json block; JSON but not an object -> an
     * error), anything else an error. */
    json_t *args = json_object_get(fn, "arguments"), *parsed = NULL;
    const char *block = NULL;
    size_t block_len = 0;
    if (json_is_string(args)) {
        const char *s = json_string_value(args);
        size_t n = json_string_length(args);
        if (!py_blank(s, n)) {
            json_error_t je;
            if (!k3_json_too_deep(s, n, 128)) parsed = json_loadb(s, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            if (!parsed) {
                block = s;
                block_len = n;
            } else if (!json_is_object(parsed)) {
                json_decref(parsed);
                return k3_err(e->err, K3_ERR_ARG,
                              "message %zu: tool call %zu: arguments must "
                              "be a JSON object",
                              index, i);
            }
        }
        args = parsed;
    } else if (args && !json_is_null(args) && !json_is_object(args)) {
        return k3_err(e->err, K3_ERR_ARG,
                      "message %zu: tool call %zu: arguments must be an "
                      "object or a JSON object string",
                      index, i);
    }

    char idx[24];
    snprintf(idx, sizeof idx, "%zu", i + 1);
    attr a[2] = {{K3_FORM_ATTR_TOOL, json_string_value(name), json_string_length(name)},
                 attr_s(K3_FORM_ATTR_INDEX, idx)};
    st = open_tag(e, K3_FORM_CALL, a, 2);
    if (st == K3_OK && block) {
        attr t = attr_s(K3_FORM_ATTR_TYPE, "object");
        st = open_tag(e, K3_FORM_JSON, &t, 1);
        if (st == K3_OK) st = text(e, block, block_len);
        if (st == K3_OK) st = close_tag(e, K3_FORM_JSON);
    } else if (st == K3_OK && json_is_object(args)) {
        const char *key;
        json_t *val;
        json_object_foreach(args, key, val) {
            if (st != K3_OK) break;
            const char *type = json_is_boolean(val) ? "boolean"
                : json_is_null(val)                 ? "null"
                : json_is_number(val)               ? "number"
                : json_is_string(val)               ? "string"
                : json_is_object(val)               ? "object"
                                                    : "array";
            attr aa[2] = {attr_s(K3_FORM_ATTR_KEY, key), attr_s(K3_FORM_ATTR_TYPE, type)};
            st = open_tag(e, K3_FORM_ARGUMENT, aa, 2);
            if (st == K3_OK && json_is_string(val)) {
                st = text(e, json_string_value(val), json_string_length(val));
            } else if (st == K3_OK) {
                k3_buf b = {0};
                k3_pyjson_dump(&b, val, false, false);
                st = b.oom ? nomem(e->err) : text(e, b.p, b.len);
                k3_buf_free(&b);
            }
            if (st == K3_OK) st = close_tag(e, K3_FORM_ARGUMENT);
        }
    }
    if (st == K3_OK) st = close_tag(e, K3_FORM_CALL);
    json_decref(parsed);
    return st;
}

static k3_status name_attr(const msg *m, attr *a, size_t *n, k3_error *err) {
    json_t *name = json_object_get(m->m, "name");
    if (!name || !truthy(name)) return K3_OK;
    if (!json_is_string(name)) return k3_err(err, K3_ERR_ARG, "message %zu: \"name\" must be a string", m->index);
    a[(*n)++] = (attr){"name", json_string_value(name), json_string_length(name)};
    return K3_OK;
}

static k3_status assistant(enc *e, const msg *m, bool thinking) {
    attr a[2] = {attr_s("role", "assistant")};
    size_t na = 1;
    k3_status st = name_attr(m, a, &na, e->err);
    if (st == K3_OK) st = open_tag(e, "message", a, na);
    if (st == K3_OK && thinking) {
        /* message.get("reasoning_content") or message.get("reasoning") */
        json_t *r = json_object_get(m->m, "reasoning_content");
        if (!r || !truthy(r)) r = json_object_get(m->m, "reasoning");
        if (r && !json_is_null(r) && !json_is_string(r))
            return k3_err(e->err, K3_ERR_ARG, "message %zu: reasoning must be a string", m->index);
        st = open_tag(e, K3_FORM_THINK, NULL, 0);
        if (st == K3_OK && r && !py_blank(json_string_value(r), json_string_length(r)))
            st = text(e, json_string_value(r), json_string_length(r));
        if (st == K3_OK) st = close_tag(e, K3_FORM_THINK);
    }
    if (st == K3_OK) st = open_tag(e, K3_FORM_RESPONSE, NULL, 0);
    if (st == K3_OK) st = content(e, json_object_get(m->m, "content"), m->index);
    if (st == K3_OK) st = close_tag(e, K3_FORM_RESPONSE);
    json_t *calls = json_object_get(m->m, "tool_calls");
    if (st == K3_OK && calls && truthy(calls)) {
        if (!json_is_array(calls))
            return k3_err(e->err, K3_ERR_ARG, "message %zu: tool_calls must be an array", m->index);
        st = open_tag(e, K3_FORM_TOOLS, NULL, 0);
        for (size_t i = 0; i < json_array_size(calls) && st == K3_OK; i++)
            st = tool_call(e, json_array_get(calls, i), m->index, i);
        if (st == K3_OK) st = close_tag(e, K3_FORM_TOOLS);
    }
    if (st == K3_OK) st = close_tag(e, "message");
    if (st == K3_OK) st = control(e, e->end_of_msg);
    return st;
}

/* The tool name of a tool message: the id-resolved call's name, else
 * message.get("tool", message.get("name")), else the call at the same
 * position in the latest assistant's tool_calls. */
static k3_status tool_message(enc *e, const msg *m, const json_t *calls, size_t tool_index) {
    const json_t *name = json_is_string(m->tool) ? m->tool : NULL;
    if (!name) {
        json_t *v = json_object_get(m->m, "tool");
        if (!v) v = json_object_get(m->m, "name");
        if (v && !json_is_null(v)) {
            if (!json_is_string(v))
                return k3_err(e->err, K3_ERR_ARG,
                              "message %zu: the tool name must be a "
                              "string",
                              m->index);
            name = v;
        }
    }
    if (!name && calls && json_is_array(calls) && tool_index <= json_array_size(calls)) {
        json_t *fn;
        k3_status st = call_fn(json_array_get(calls, tool_index - 1), m->index, tool_index - 1, &fn, e->err);
        if (st == K3_OK) st = call_name(fn, m->index, tool_index - 1, &name, e->err);
        if (st != K3_OK) return st;
    }
    if (!name)
        return k3_err(e->err, K3_ERR_ARG,
                      "message %zu: a tool result needs a resolvable tool "
                      "name: give \"tool\" or \"name\", a tool_call_id of the preceding "
                      "assistant's tool_calls, or match a tool call by position",
                      m->index);
    char idx[24];
    snprintf(idx, sizeof idx, "%zu", tool_index);
    attr a[3] = {attr_s("role", "tool"),
                 {"tool", json_string_value(name), json_string_length(name)},
                 attr_s("index", idx)};
    k3_status st = open_tag(e, "message", a, 3);
    if (st == K3_OK) st = content(e, json_object_get(m->m, "content"), m->index);
    if (st == K3_OK) st = close_tag(e, "message");
    if (st == K3_OK) st = control(e, e->end_of_msg);
    return st;
}

static k3_status plain_message(enc *e, const msg *m, const char *role_name) {
    attr a[2] = {attr_s("role", role_name)};
    size_t na = 1;
    k3_status st = name_attr(m, a, &na, e->err);
    if (st == K3_OK) st = open_tag(e, "message", a, na);
    if (st == K3_OK) st = content(e, json_object_get(m->m, "content"), m->index);
    if (st == K3_OK) st = close_tag(e, "message");
    if (st == K3_OK) st = control(e, e->end_of_msg);
    return st;
}

/* ---- tool-result re-sorting (normalize_xtml_tool_result_messages) ---------- */

typedef struct call_id {
    char *key;       /* str(tool_calls[i].id), owned */
    size_t position; /* 1-based position in tool_calls */
    json_t *name;    /* the function name, or NULL */
} call_id;

typedef struct id_index {
    call_id *v;
    size_t n;
} id_index;

static void id_index_free(id_index *x) {
    for (size_t i = 0; i < x->n; i++) free(x->v[i].key);
    free(x->v);
    *x = (id_index){0};
}

static k3_status id_index_build(id_index *x, const json_t *calls, size_t index, k3_error *err) {
    id_index_free(x);
    if (!json_is_array(calls)) return K3_OK;
    size_t n = json_array_size(calls);
    if (!n) return K3_OK;
    if (!(x->v = calloc(n, sizeof *x->v))) return nomem(err);
    for (size_t i = 0; i < n; i++) {
        json_t *tc = json_array_get(calls, i), *id = json_object_get(tc, "id");
        if (!json_is_object(tc) || !id || json_is_null(id)) continue;
        k3_buf b = {0};
        if (!py_str_scalar(&b, id))
            return k3_err(err, K3_ERR_ARG,
                          "message %zu: tool call %zu: \"id\" must be a "
                          "string",
                          index, i);
        const char *key = k3_buf_cstr(&b);
        if (!key) return nomem(err);
        bool dup = false;
        for (size_t j = 0; j < x->n && !dup; j++) dup = !strcmp(x->v[j].key, key);
        if (dup) {
            k3_buf_free(&b);
            continue;
        }
        json_t *fn = json_object_get(tc, "function");
        json_t *name = json_object_get(json_is_object(fn) ? fn : tc, "name");
        x->v[x->n++] = (call_id){b.p, i + 1, json_is_null(name) ? NULL : name};
    }
    return K3_OK;
}

typedef struct run_item {
    size_t position, offset;
    msg m;
} run_item;

static int run_cmp(const void *a, const void *b) {
    const run_item *x = a, *y = b;
    if (x->position != y->position) return x->position < y->position ? -1 : 1;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Reorders ms[] in place. */
static k3_status resort_tool_results(msg *ms, size_t n, k3_error *err) {
    id_index cur = {0};
    run_item *run = n ? malloc(n * sizeof *run) : NULL;
    if (n && !run) return nomem(err);
    k3_status st = K3_OK;
    for (size_t i = 0; i < n && st == K3_OK;) {
        if (ms[i].role == ROLE_ASSISTANT) {
            json_t *calls = json_object_get(ms[i].m, "tool_calls");
            if (calls && truthy(calls)) st = id_index_build(&cur, calls, ms[i].index, err);
            else id_index_free(&cur);
            i++;
            continue;
        }
        if (ms[i].role != ROLE_TOOL) {
            i++;
            continue;
        }
        size_t start = i, nr = 0;
        bool unresolved = false;
        for (; i < n && ms[i].role == ROLE_TOOL && st == K3_OK; i++) {
            json_t *id = json_object_get(ms[i].m, "tool_call_id");
            if (!id) id = json_object_get(ms[i].m, "id");
            call_id *match = NULL;
            if (id && !json_is_null(id)) {
                k3_buf b = {0};
                if (!py_str_scalar(&b, id)) {
                    st = k3_err(err, K3_ERR_ARG, "message %zu: tool_call_id must be a string", ms[i].index);
                    break;
                }
                const char *key = k3_buf_cstr(&b);
                if (!key) st = nomem(err);
                for (size_t j = 0; key && j < cur.n && !match; j++)
                    if (!strcmp(cur.v[j].key, key)) match = &cur.v[j];
                k3_buf_free(&b);
            }
            if (!match) unresolved = true;
            run[nr] = (run_item){match ? match->position : 0, nr, ms[i]};
            if (match) run[nr].m.tool = match->name;
            nr++;
        }
        if (st != K3_OK || unresolved) continue; /* left as it came */
        qsort(run, nr, sizeof *run, run_cmp);
        for (size_t j = 0; j < nr; j++) ms[start + j] = run[j].m;
    }
    free(run);
    id_index_free(&cur);
    return st;
}

/* ---- the encoder ------------------------------------------------------------ */

#define CHAT_MAX_DEPTH 128

static k3_status parse(const char *s, const char *what, json_t **out, k3_error *err) {
    size_t n = strlen(s);
    *out = NULL;
    if (k3_json_too_deep(s, n, CHAT_MAX_DEPTH))
        return k3_err(err, K3_ERR_ARG, "%s nests deeper than %d levels", what, CHAT_MAX_DEPTH);
    json_error_t je;
    *out = json_loadb(s, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!*out) return k3_err(err, K3_ERR_ARG, "%s is not valid JSON: %s (at byte %d)", what, je.text, je.position);
    return K3_OK;
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

static const char *EFFORT_NOTE =
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort=%s`.";

static const char *FORMAT_NOTE = "The system is invoked with `response_format=%s`.\n"
                                 "Your response must be raw JSON data without markdown code blocks (```json) or any "
                                 "additional formatting.";

/* extract_response_schema: json_schema.schema, else json_schema.json_schema,
 * else json_schema itself; None when there is no json_schema. */
static const json_t *response_schema(const json_t *rf) {
    json_t *js = json_object_get(rf, "json_schema");
    if (!js || json_is_null(js)) return NULL;
    if (!json_is_object(js)) return js;
    json_t *s = json_object_get(js, "schema");
    if (s) return s;
    s = json_object_get(js, "json_schema");
    return s ? s : js;
}

static k3_status response_format(enc *e, const char *rf_json) {
    json_t *rf;
    k3_status st = parse(rf_json, "response_format", &rf, e->err);
    if (st != K3_OK) return st;
    json_t *type = json_object_get(rf, "type");
    const char *ts = json_string_value(type);
    if (!json_is_object(rf) || !ts) {
        st = k3_err(e->err, K3_ERR_ARG, "response_format must be an object with a \"type\"");
    } else if (!strcmp(ts, "json_object")) {
        char body[512];
        snprintf(body, sizeof body, FORMAT_NOTE, "json_object");
        st = system_note(e, "response-format", body);
    } else if (!strcmp(ts, "json_schema")) {
        k3_buf b = {0};
        char head[512];
        snprintf(head, sizeof head, FORMAT_NOTE, "json_schema");
        k3_buf_puts(&b, head);
        k3_buf_puts(&b, "\nThe JSON data must match the following schema:\n```json\n");
        const json_t *schema = response_schema(rf);
        if (schema) k3_pyjson_dump(&b, schema, true, true);
        else k3_buf_puts(&b, "null");
        k3_buf_puts(&b, "\n```");
        st = b.oom ? nomem(e->err) : system_note(e, "response-format", b.p);
        k3_buf_free(&b);
    } else if (strcmp(ts, "text")) {
        st = k3_err(e->err, K3_ERR_ARG,
                    "response_format type \"%s\" is not text, json_object "
                    "or json_schema",
                    ts);
    }
    json_decref(rf);
    return st;
}

static k3_status role_of(const json_t *m, size_t i, role *r, k3_error *err) {
    if (!json_is_object(m)) return k3_err(err, K3_ERR_ARG, "message %zu is not an object", i);
    const char *s = json_string_value(json_object_get(m, "role"));
    if (!s) return k3_err(err, K3_ERR_ARG, "message %zu has no role", i);
    /* "developer" is OpenAI's name for the system role on its reasoning
     * models ("developer messages are the new system messages"); K3 has one
     * system role, so both render as it (vLLM does the same). */
    if (!strcmp(s, "system") || !strcmp(s, "developer")) *r = ROLE_SYSTEM;
    else if (!strcmp(s, "user")) *r = ROLE_USER;
    else if (!strcmp(s, "assistant")) *r = ROLE_ASSISTANT;
    else if (!strcmp(s, "tool")) *r = ROLE_TOOL;
    else
        return k3_err(err, K3_ERR_ARG,
                      "message %zu has the unknown role \"%s\" (system, developer, "
                      "user, assistant or tool)",
                      i, s);
    return K3_OK;
}

static k3_status encode(enc *e, const json_t *msgs, const json_t *tools, const k3_chat_options *opt) {
    size_t n = json_array_size(msgs);
    msg *ms = n ? calloc(n, sizeof *ms) : NULL;
    if (n && !ms) return nomem(e->err);
    k3_status st = K3_OK;
    for (size_t i = 0; i < n && st == K3_OK; i++) {
        ms[i] = (msg){.m = json_array_get(msgs, i), .index = i};
        st = role_of(ms[i].m, i, &ms[i].role, e->err);
    }
    if (st == K3_OK) st = resort_tool_results(ms, n, e->err);

    if (st == K3_OK && tools && truthy(tools)) st = tool_declare(e, tools, false);
    if (st == K3_OK && opt->thinking && opt->thinking_effort) {
        const char *eff = opt->thinking_effort;
        if (strcmp(eff, "low") && strcmp(eff, "high") && strcmp(eff, "max")) {
            st = k3_err(e->err, K3_ERR_ARG,
                        "thinking_effort \"%.32s\" is not low, high or "
                        "max",
                        eff);
        } else {
            char body[512];
            snprintf(body, sizeof body, EFFORT_NOTE, eff);
            st = system_note(e, "thinking-effort", body);
        }
    }

    const json_t *calls = NULL; /* the latest assistant's tool_calls */
    size_t tool_index = 0;
    for (size_t i = 0; i < n && st == K3_OK; i++) {
        const msg *m = &ms[i];
        json_t *mt = json_object_get(m->m, "tools");
        switch (m->role) {
        case ROLE_USER: st = plain_message(e, m, "user"); break;
        case ROLE_SYSTEM: st = mt && truthy(mt) ? tool_declare(e, mt, true) : plain_message(e, m, "system"); break;
        case ROLE_TOOL: st = tool_message(e, m, calls, ++tool_index); break;
        case ROLE_ASSISTANT:
            calls = json_object_get(m->m, "tool_calls");
            if (json_is_null(calls)) calls = NULL;
            tool_index = 0;
            st = assistant(e, m, opt->thinking);
            break;
        }
    }
    free(ms);

    const char *tc = opt->tool_choice;
    if (st == K3_OK && tc && !strcmp(tc, "required"))
        st = system_note(e, "tool-choice",
                         "The system is invoked with `tool_choice=required`.\n"
                         "You MUST call tools in the next message.");
    else if (st == K3_OK && tc && !strcmp(tc, "none"))
        st = system_note(e, "tool-choice",
                         "The system is invoked with `tool_choice=none`.\n"
                         "You MUST NOT call any tools in the next message.");
    else if (st == K3_OK && tc && strcmp(tc, "auto"))
        st = k3_err(e->err, K3_ERR_ARG, "tool_choice \"%.32s\" is not auto, required or none", tc);
    if (st == K3_OK && opt->response_format) st = response_format(e, opt->response_format);

    if (st == K3_OK && opt->add_generation_prompt) {
        attr a = attr_s("role", "assistant");
        st = open_tag(e, "message", &a, 1);
        if (st == K3_OK) st = open_tag(e, opt->thinking ? K3_FORM_THINK : K3_FORM_RESPONSE, NULL, 0);
    }
    return st;
}

k3_status k3_chat_encode_json(const k3_tokenizer *t, const char *messages_json, const char *tools_json,
                              const k3_chat_options *opt, int32_t **ids, size_t *n_ids, k3_error *err) {
    *ids = NULL;
    *n_ids = 0;
    if (!t || !messages_json || !opt)
        return k3_err(err, K3_ERR_ARG,
                      "k3_chat_encode_json needs a tokenizer, messages and "
                      "options");
    enc e = {.t = t, .err = err};
    k3_status st = lookup(t, K3_FORM_OPEN, &e.open, err);
    if (st == K3_OK) st = lookup(t, K3_FORM_SEP, &e.sep, err);
    if (st == K3_OK) st = lookup(t, K3_FORM_CLOSE, &e.close, err);
    if (st == K3_OK) st = lookup(t, K3_FORM_END_OF_MSG, &e.end_of_msg, err);
    if (st != K3_OK) return st;

    json_t *msgs, *tools = NULL;
    st = parse(messages_json, "messages", &msgs, err);
    if (st != K3_OK) return st;
    if (!json_is_array(msgs)) st = k3_err(err, K3_ERR_ARG, "messages must be a JSON array");
    if (st == K3_OK && tools_json) {
        st = parse(tools_json, "tools", &tools, err);
        if (st == K3_OK && !json_is_array(tools) && !json_is_null(tools))
            st = k3_err(err, K3_ERR_ARG, "tools must be a JSON array");
    }
    if (st == K3_OK) st = encode(&e, msgs, tools, opt);
    json_decref(msgs);
    json_decref(tools);
    if (st == K3_OK && !e.out.v && !(e.out.v = malloc(sizeof *e.out.v))) st = nomem(err);
    if (st != K3_OK) {
        free(e.out.v);
        return st;
    }
    *ids = e.out.v;
    *n_ids = e.out.n;
    return K3_OK;
}
