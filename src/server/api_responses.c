/*
 * api_responses.c -- POST /v1/responses, OpenAI's Responses API, and GET /
 * DELETE /v1/responses/{id}.
 *
 * The request becomes a chat conversation (as vLLM's Responses server builds
 * one): "instructions" a system message, then the history of
 * "previous_response_id", then "input" (a string: one user message; or
 * items: messages with input_text / input_image parts, function_call items
 * joined to the assistant message before them, function_call_output items as
 * tool messages, reasoning items as the assistant's reasoning). Function
 * tools are flat ({type, name, parameters}) and become chat's tools;
 * "reasoning.effort" maps onto K3's thinking switch as chat's
 * reasoning_effort does (k3_srv_reasoning_effort); "text.format" becomes
 * chat's response_format. The reply is parsed as chat's and answered as
 * output items (items.h): reasoning, message (output_text), function_call.
 *
 * A stream is typed events, each with a sequence_number: response.created,
 * response.in_progress, then per item output_item.added, content_part.added,
 * output_text.delta / reasoning_text.delta / function_call_arguments.delta,
 * their .done, content_part.done, output_item.done, and at the end
 * response.completed (response.incomplete when max_output_tokens cut it,
 * response.failed when it failed). No [DONE].
 *
 * State: with "store" (the default) the response and its conversation are
 * kept in memory (store.h: the last K3_SRV_STORE_ENTRIES responses within
 * K3_SRV_STORE_BYTES, least recently used out first) for GET /v1/responses/{id}
 * and "previous_response_id"; an id that is not kept is a 404, as in vLLM.
 * As in vLLM, the system messages of a previous response (its instructions)
 * do not carry over.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "server/api.h"
#include "server/constraint.h"
#include "server/http.h"
#include "server/items.h"
#include "server/job.h"
#include "server/store.h"

/* What the surface keeps of a request, its echo in the response object, and
 * the stream's state. */
typedef struct resp_ctx {
    json_t *messages;        /* the conversation encoded (chat messages) */
    json_t *tools;           /* chat-shaped tools, or NULL */
    json_t *response_format; /* chat-shaped, or NULL */
    char tool_choice[16];    /* "" (none given), auto, required, none */
    char tool_name[256];     /* with required: the one tool named, or "" */
    bool thinking;
    const char *effort; /* K3's thinking_effort */
    bool store;
    char id[64];
    long created;
    json_t *echo; /* the request fields the response object repeats */
    /* the stream */
    long seq;
    k3_items items;
} resp_ctx;

static void ctx_free(void *p) {
    resp_ctx *x = p;
    json_decref(x->messages);
    json_decref(x->tools);
    json_decref(x->response_format);
    json_decref(x->echo);
    k3_items_free(&x->items);
    free(x);
}

/* ---- the request into a conversation ---------------------------------------- */

typedef struct bad {
    unsigned status;
    char msg[512];
} bad;

static bool fail(bad *b, unsigned status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool fail(bad *b, unsigned status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->msg, sizeof b->msg, fmt, ap);
    va_end(ap);
    b->status = status;
    return false;
}

/* A message's content parts into chat's: input_text / output_text / text ->
 * text, input_image (a data: URL) -> image_url. */
static bool content_parts(json_t *content, size_t i, json_t **out, bad *b) {
    if (json_is_string(content)) {
        *out = json_incref(content);
        return true;
    }
    if (!json_is_array(content)) return fail(b, 400, "input[%zu].content must be a string or a list of parts", i);
    json_t *parts = json_array();
    size_t k;
    json_t *p;
    json_array_foreach(content, k, p) {
        const char *type = json_is_object(p) ? json_string_value(json_object_get(p, "type")) : NULL;
        if (!type) {
            json_decref(parts);
            return fail(b, 400, "input[%zu].content[%zu] is not an object with a \"type\"", i, k);
        }
        if (!strcmp(type, "input_text") || !strcmp(type, "output_text") || !strcmp(type, "text") ||
            !strcmp(type, "refusal")) {
            json_t *t = json_object_get(p, !strcmp(type, "refusal") ? "refusal" : "text");
            if (!json_is_string(t)) {
                json_decref(parts);
                return fail(b, 400, "input[%zu].content[%zu] (%s) has no text string", i, k, type);
            }
            json_array_append_new(parts, json_pack("{s:s,s:O}", "type", "text", "text", t));
        } else if (!strcmp(type, "input_image")) {
            json_t *u = json_object_get(p, "image_url");
            if (json_is_object(u)) u = json_object_get(u, "url");
            if (!json_is_string(u)) {
                json_decref(parts);
                return fail(b, 400,
                            "input[%zu].content[%zu]: an input_image needs \"image_url\" (a data: URL); "
                            "file_id is not supported",
                            i, k);
            }
            json_array_append_new(parts, json_pack("{s:s,s:{s:O}}", "type", "image_url", "image_url", "url", u));
        } else {
            json_decref(parts);
            return fail(b, 400, "input[%zu].content[%zu]: the content part type \"%s\" is not supported", i, k, type);
        }
    }
    *out = parts;
    return true;
}

/* The last message of msgs when it is the assistant's, else NULL. */
static json_t *last_assistant(json_t *msgs) {
    json_t *m = json_array_get(msgs, json_array_size(msgs) - 1);
    const char *role = json_string_value(json_object_get(m, "role"));
    return role && !strcmp(role, "assistant") ? m : NULL;
}

/* A reasoning item's text: its content's reasoning_text, else its summary. */
static bool reasoning_text(json_t *item, size_t i, json_t **out, bad *b) {
    json_t *arr = json_object_get(item, "content");
    if (!json_array_size(arr)) arr = json_object_get(item, "summary");
    if (!json_array_size(arr)) {
        if (json_is_string(json_object_get(item, "encrypted_content")))
            return fail(b, 400, "input[%zu]: encrypted reasoning is not supported (send its content)", i);
        *out = json_string("");
        return true;
    }
    k3_buf t = {0};
    size_t k;
    json_t *p;
    json_array_foreach(arr, k, p) {
        json_t *s = json_object_get(p, "text");
        if (!json_is_string(s)) {
            k3_buf_free(&t);
            return fail(b, 400, "input[%zu]: a reasoning part has no text string", i);
        }
        k3_buf_add(&t, json_string_value(s), json_string_length(s));
    }
    *out = k3_srv_jstr(t.p ? t.p : "", t.len);
    k3_buf_free(&t);
    return *out != NULL || fail(b, 500, "out of memory");
}

/* Appends input (a string or items) to msgs as chat messages. */
static bool input_messages(json_t *input, json_t *msgs, bad *b) {
    if (json_is_string(input)) {
        json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "user", "content", input));
        return true;
    }
    if (!json_is_array(input) || json_array_size(input) == 0)
        return fail(b, 400, "\"input\" must be a string or a non-empty list of items");
    size_t i;
    json_t *it;
    json_array_foreach(input, i, it) {
        if (!json_is_object(it)) return fail(b, 400, "input[%zu] is not an object", i);
        const char *type = json_string_value(json_object_get(it, "type"));
        const char *role = json_string_value(json_object_get(it, "role"));
        if (!type && role) type = "message";
        if (!type) return fail(b, 400, "input[%zu] has neither a \"type\" nor a \"role\"", i);
        json_t *prev = last_assistant(msgs);
        if (!strcmp(type, "message")) {
            if (!role ||
                (strcmp(role, "user") && strcmp(role, "system") && strcmp(role, "developer") &&
                 strcmp(role, "assistant")))
                return fail(b, 400, "input[%zu]: the role must be user, system, developer or assistant", i);
            json_t *content = NULL;
            if (!content_parts(json_object_get(it, "content"), i, &content, b)) return false;
            if (!strcmp(role, "assistant") && prev && !json_object_get(prev, "content")) {
                json_object_set_new(prev, "content", content);
                continue;
            }
            /* developer is the system role as OpenAI defines it */
            json_array_append_new(msgs,
                                  json_pack("{s:s,s:o}", "role", !strcmp(role, "developer") ? "system" : role,
                                            "content", content));
        } else if (!strcmp(type, "function_call")) {
            json_t *call_id = json_object_get(it, "call_id"), *name = json_object_get(it, "name"),
                   *args = json_object_get(it, "arguments");
            if (!json_is_string(call_id) || !json_is_string(name) || !json_is_string(args))
                return fail(b, 400, "input[%zu]: a function_call needs \"call_id\", \"name\" and \"arguments\" strings",
                            i);
            json_t *tc = json_pack("{s:O,s:s,s:{s:O,s:O}}", "id", call_id, "type", "function", "function", "name", name,
                                   "arguments", args);
            json_t *calls = prev ? json_object_get(prev, "tool_calls") : NULL;
            if (json_is_array(calls)) json_array_append_new(calls, tc);
            else if (prev) json_object_set_new(prev, "tool_calls", json_pack("[o]", tc));
            else json_array_append_new(msgs, json_pack("{s:s,s:[o]}", "role", "assistant", "tool_calls", tc));
        } else if (!strcmp(type, "function_call_output")) {
            json_t *call_id = json_object_get(it, "call_id"), *out = json_object_get(it, "output");
            if (!json_is_string(call_id))
                return fail(b, 400, "input[%zu]: a function_call_output needs \"call_id\"", i);
            json_t *content = NULL;
            if (!content_parts(out, i, &content, b)) return false;
            json_array_append_new(msgs,
                                  json_pack("{s:s,s:O,s:o}", "role", "tool", "tool_call_id", call_id, "content",
                                            content));
        } else if (!strcmp(type, "reasoning")) {
            json_t *r = NULL;
            if (!reasoning_text(it, i, &r, b)) return false;
            if (prev && !json_object_get(prev, "reasoning_content") && !json_object_get(prev, "content"))
                json_object_set_new(prev, "reasoning_content", r);
            else json_array_append_new(msgs, json_pack("{s:s,s:o}", "role", "assistant", "reasoning_content", r));
        } else {
            return fail(b, 400, "input[%zu]: the item type \"%s\" is not supported", i, type);
        }
    }
    return true;
}

/* Flat function tools into chat's; the echo keeps them as given. */
static bool convert_tools(json_t *tools, json_t **out, bad *b) {
    *out = NULL;
    if (!tools || json_is_null(tools)) return true;
    if (!json_is_array(tools)) return fail(b, 400, "\"tools\" must be a list");
    if (!json_array_size(tools)) return true;
    json_t *ct = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        const char *type = json_is_object(t) ? json_string_value(json_object_get(t, "type")) : NULL;
        if (!type || strcmp(type, "function")) {
            json_decref(ct);
            return fail(b, 400, "tools[%zu]: the tool type \"%s\" is not supported (only \"function\" tools)", i,
                        type ? type : "?");
        }
        json_t *name = json_object_get(t, "name");
        if (!json_is_string(name) || !json_string_length(name)) {
            json_decref(ct);
            return fail(b, 400, "tools[%zu]: a function tool needs a \"name\"", i);
        }
        json_t *fn = json_pack("{s:O}", "name", name);
        static const char *keys[] = {"description", "parameters", "strict"};
        for (int k = 0; k < 3; k++) {
            json_t *v = json_object_get(t, keys[k]);
            if (v && !json_is_null(v)) json_object_set(fn, keys[k], v);
        }
        json_array_append_new(ct, json_pack("{s:s,s:o}", "type", "function", "function", fn));
    }
    *out = ct;
    return true;
}

static bool has_tool(json_t *tools, const char *name) {
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        const char *n = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
        if (n && !strcmp(n, name)) return true;
    }
    return false;
}

static bool parse_tool_choice(json_t *tc, resp_ctx *x, bad *b) {
    if (!tc || json_is_null(tc)) return true;
    if (json_is_string(tc)) {
        const char *v = json_string_value(tc);
        if (strcmp(v, "auto") && strcmp(v, "none") && strcmp(v, "required"))
            return fail(b, 400, "\"tool_choice\" is \"%.32s\", not auto, none or required", v);
        snprintf(x->tool_choice, sizeof x->tool_choice, "%s", v);
        return true;
    }
    const char *type = json_is_object(tc) ? json_string_value(json_object_get(tc, "type")) : NULL;
    if (!type || strcmp(type, "function"))
        return fail(b, 400, "\"tool_choice\" must be auto, none, required or {\"type\": \"function\", \"name\"}");
    const char *name = json_string_value(json_object_get(tc, "name"));
    if (!name || !x->tools || !has_tool(x->tools, name))
        return fail(b, 400, "\"tool_choice\" names the function \"%s\", which is not in \"tools\"", name ? name : "?");
    if (strlen(name) >= sizeof x->tool_name)
        return fail(b, 400, "\"tool_choice\" names a function of over %zu bytes", sizeof x->tool_name - 1);
    snprintf(x->tool_choice, sizeof x->tool_choice, "required");
    snprintf(x->tool_name, sizeof x->tool_name, "%s", name);
    return true;
}

/* text.format: text, json_object, or json_schema {name, schema, strict} (chat's response_format). */
static bool parse_text(json_t *text, resp_ctx *x, bad *b) {
    if (!text || json_is_null(text)) return true;
    if (!json_is_object(text)) return fail(b, 400, "\"text\" must be an object");
    json_t *f = json_object_get(text, "format");
    if (!f || json_is_null(f)) return true;
    const char *type = json_is_object(f) ? json_string_value(json_object_get(f, "type")) : NULL;
    if (!type) return fail(b, 400, "\"text.format\" must be an object with a \"type\"");
    if (!strcmp(type, "text")) return true;
    if (!strcmp(type, "json_object")) {
        x->response_format = json_pack("{s:s}", "type", "json_object");
        return true;
    }
    if (strcmp(type, "json_schema"))
        return fail(b, 400, "\"text.format.type\" is \"%.32s\", not text, json_object or json_schema", type);
    json_t *schema = json_object_get(f, "schema");
    if (!json_is_object(schema)) return fail(b, 400, "\"text.format\" json_schema needs a \"schema\" object");
    json_t *js = json_pack("{s:O}", "schema", schema);
    static const char *keys[] = {"name", "strict", "description"};
    for (int k = 0; k < 3; k++) {
        json_t *v = json_object_get(f, keys[k]);
        if (v && !json_is_null(v)) json_object_set(js, keys[k], v);
    }
    x->response_format = json_pack("{s:s,s:o}", "type", "json_schema", "json_schema", js);
    return true;
}

/* A stored conversation: its messages without the system ones. */
static bool previous(struct k3_server *s, const char *id, json_t *msgs, bad *b) {
    char *hist = NULL;
    if (!k3_srv_store_get(s->responses, id, NULL, &hist))
        return fail(b, 404, "Response with id '%.200s' not found.", id);
    json_t *h = json_loads(hist, 0, NULL);
    free(hist);
    if (!json_is_array(h)) {
        json_decref(h);
        return fail(b, 500, "the stored conversation of %.200s cannot be read", id);
    }
    size_t i;
    json_t *m;
    json_array_foreach(h, i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        if (role && !strcmp(role, "system")) continue;
        json_array_append(msgs, m);
    }
    json_decref(h);
    return true;
}

/* The fields k3 does not implement, refused rather than ignored. */
static bool refuse_unsupported(json_t *root, bad *b) {
    json_t *v;
    if (json_is_true(json_object_get(root, "background")))
        return fail(b, 400, "\"background\" is not supported (answers are streamed or returned whole)");
    if ((v = json_object_get(root, "conversation")) && !json_is_null(v))
        return fail(b, 400, "\"conversation\" is not supported (use previous_response_id)");
    if ((v = json_object_get(root, "prompt")) && !json_is_null(v))
        return fail(b, 400, "\"prompt\" (a stored prompt template) is not supported");
    if ((v = json_object_get(root, "top_logprobs")) && !json_is_null(v) &&
        !(json_is_integer(v) && json_integer_value(v) == 0))
        return fail(b, 400, "\"top_logprobs\" is not supported on /v1/responses");
    json_t *inc = json_object_get(root, "include");
    size_t i;
    json_array_foreach(inc, i, v) {
        const char *s = json_string_value(v);
        if (s && !strcmp(s, "message.output_text.logprobs"))
            return fail(b, 400, "\"include\": message.output_text.logprobs is not supported on /v1/responses");
    }
    v = json_object_get(root, "truncation");
    if (v && !json_is_null(v) &&
        (!json_is_string(v) || (strcmp(json_string_value(v), "disabled") && strcmp(json_string_value(v), "auto"))))
        return fail(b, 400, "\"truncation\" must be \"disabled\" or \"auto\"");
    return true;
}

static bool build(struct k3_server *s, json_t *root, resp_ctx *x, bad *b) {
    if (!refuse_unsupported(root, b)) return false;
    json_t *input = json_object_get(root, "input");
    if (!input || json_is_null(input)) return fail(b, 400, "\"input\" is required");
    json_t *instr = json_object_get(root, "instructions");
    if (instr && !json_is_null(instr) && !json_is_string(instr))
        return fail(b, 400, "\"instructions\" must be a string");
    json_t *prev = json_object_get(root, "previous_response_id");
    if (prev && !json_is_null(prev) && !json_is_string(prev))
        return fail(b, 400, "\"previous_response_id\" must be a string");
    json_t *store = json_object_get(root, "store");
    if (store && !json_is_null(store) && !json_is_boolean(store))
        return fail(b, 400, "\"store\" must be true or false");
    x->store = !json_is_false(store);
    json_t *reasoning = json_object_get(root, "reasoning");
    const char *effort = NULL;
    if (reasoning && !json_is_null(reasoning)) {
        if (!json_is_object(reasoning)) return fail(b, 400, "\"reasoning\" must be an object");
        json_t *e = json_object_get(reasoning, "effort");
        if (e && !json_is_null(e) && !json_is_string(e)) return fail(b, 400, "\"reasoning.effort\" must be a string");
        effort = json_string_value(e);
    }
    k3_error err = {0};
    if (k3_srv_reasoning_effort("reasoning.effort", effort, &x->thinking, &x->effort, &err))
        return fail(b, 400, "%s", err.msg);
    if (!convert_tools(json_object_get(root, "tools"), &x->tools, b)) return false;
    if (!parse_tool_choice(json_object_get(root, "tool_choice"), x, b)) return false;
    if (!parse_text(json_object_get(root, "text"), x, b)) return false;
    x->messages = json_array();
    if (json_is_string(instr) && json_string_length(instr))
        json_array_append_new(x->messages, json_pack("{s:s,s:O}", "role", "system", "content", instr));
    if (json_is_string(prev) && !previous(s, json_string_value(prev), x->messages, b)) return false;
    if (!input_messages(input, x->messages, b)) return false;
    /* the echo of the response object: what was asked, as given */
    json_t *tc = json_object_get(root, "tool_choice"), *par = json_object_get(root, "parallel_tool_calls");
    json_t *meta = json_object_get(root, "metadata"), *text = json_object_get(root, "text"),
           *tools = json_object_get(root, "tools"), *trunc = json_object_get(root, "truncation");
    json_t *fmt = json_is_object(text) ? json_object_get(text, "format") : NULL;
    json_t *e = x->echo = json_object();
    if (!e) return fail(b, 500, "out of memory");
    json_object_set_new(e, "instructions", json_is_string(instr) ? json_incref(instr) : json_null());
    json_object_set_new(e, "previous_response_id", json_is_string(prev) ? json_incref(prev) : json_null());
    json_object_set_new(e, "tool_choice", tc && !json_is_null(tc) ? json_incref(tc) : json_string("auto"));
    json_object_set_new(e, "parallel_tool_calls", json_boolean(!json_is_false(par)));
    json_object_set_new(e, "reasoning",
                        json_pack("{s:o,s:n}", "effort", effort ? json_string(effort) : json_null(), "summary"));
    json_object_set_new(e, "metadata", json_is_object(meta) ? json_incref(meta) : json_object());
    json_object_set_new(e, "tools", json_is_array(tools) ? json_incref(tools) : json_array());
    json_object_set_new(e, "truncation", json_is_string(trunc) ? json_incref(trunc) : json_string("disabled"));
    json_object_set_new(e, "text",
                        json_pack("{s:o}", "format",
                                  json_is_object(fmt) ? json_incref(fmt) : json_pack("{s:s}", "type", "text")));
    return true;
}

static bool resp_prompt(struct k3_server *s, json_t *root, k3_srv_request *rq, k3_srv_bad *e) {
    resp_ctx *x = k3_srv_job_of(rq)->surf;
    k3_error err = {0};
    rq->thinking = x->thinking;
    const k3_srv_chat_input in = {.messages = x->messages,
                                  .tools = x->tools,
                                  .tool_choice = x->tool_choice[0] ? x->tool_choice : NULL,
                                  .tool_name = x->tool_name[0] ? x->tool_name : NULL,
                                  .thinking = x->thinking,
                                  .effort = x->effort,
                                  .response_format = x->response_format};
    if (k3_srv_encode_messages(s, &in, &rq->vp, &err))
        return k3_srv_bad_set(e, err.status == K3_ERR_NOMEM ? 500 : 400, "%s", err.msg);
    int32_t *ids = rq->vp.ids;
    rq->vp.ids = NULL;
    /* text.format and tool_choice constrain the reply (constraint.h) */
    return k3_srv_request_one_prompt(rq, ids, (int64_t)rq->vp.n_ids, e) &&
        k3_srv_constraint_words(s, x->response_format, "text.format", "text.format.schema", x->tools, in.tool_choice,
                                in.tool_name, !json_is_false(json_object_get(root, "parallel_tool_calls")), x->thinking,
                                &rq->grammar, k3_srv_job_of(rq)->conn, e);
}

/* ---- the answer ------------------------------------------------------------ */

static json_t *part_output_text(const char *text) {
    return json_pack("{s:s,s:o,s:[],s:[]}", "type", "output_text", "text", k3_srv_jstr(text, strlen(text)),
                     "annotations", "logprobs");
}

static json_t *item_json(const k3_item *it, const k3_chat_reply *r, json_t *calls, const char *status) {
    switch (it->kind) {
    case K3_ITEM_REASONING: {
        const char *t = r && r->reasoning ? r->reasoning : "";
        json_t *content =
            r ? json_pack("[{s:s,s:o}]", "type", "reasoning_text", "text", k3_srv_jstr(t, strlen(t))) : json_array();
        return json_pack("{s:s,s:s,s:[],s:o,s:s}", "id", it->id, "type", "reasoning", "summary", "content", content,
                         "status", status);
    }
    case K3_ITEM_TEXT: {
        json_t *content = r ? json_pack("[o]", part_output_text(r->content ? r->content : "")) : json_array();
        return json_pack("{s:s,s:s,s:s,s:s,s:o}", "id", it->id, "type", "message", "role", "assistant", "status",
                         status, "content", content);
    }
    case K3_ITEM_CALL: {
        json_t *f = json_object_get(json_array_get(calls, (size_t)it->call), "function");
        json_t *args = r ? json_object_get(f, "arguments") : NULL;
        return json_pack("{s:s,s:s,s:s,s:s,s:o,s:s}", "id", it->id, "type", "function_call", "call_id", it->call_id,
                         "name", it->name ? it->name : "", "arguments",
                         json_is_string(args) ? json_incref(args) : json_string(""), "status", status);
    }
    }
    return NULL;
}

/* "completed" for an item the reply went past, the response's status for its last. */
static const char *item_status(const char *resp_status, bool last) {
    return last && !strcmp(resp_status, "incomplete") ? "incomplete" : "completed";
}

static json_t *output_json(resp_ctx *x, const k3_chat_reply *r, const char *status) {
    json_t *out = json_array(), *calls = k3_items_calls(r);
    for (int i = 0; i < x->items.n; i++)
        json_array_append_new(out, item_json(&x->items.v[i], r, calls, item_status(status, i == x->items.n - 1)));
    json_decref(calls);
    return out;
}

/* The usage object (the job's mutex held). */
static json_t *usage_json(k3_srv_job *j) {
    k3_srv_choice *c = &j->ch[0];
    const int64_t in = j->rq.n_prompt[0], out = c->n_out;
    return json_pack("{s:I,s:{s:I},s:I,s:{s:I},s:I}", "input_tokens", (json_int_t)in, "input_tokens_details",
                     "cached_tokens", (json_int_t)c->q.n_cached, "output_tokens", (json_int_t)out,
                     "output_tokens_details", "reasoning_tokens", (json_int_t)k3_items_reasoning_tokens(j, c),
                     "total_tokens", (json_int_t)(in + out));
}

/* The response object (takes output, usage, error). */
static json_t *response_json(k3_srv_job *j, const char *status, json_t *output, json_t *usage, json_t *error) {
    resp_ctx *x = j->surf;
    json_t *o =
        json_pack("{s:s,s:s,s:I,s:s,s:b,s:o,s:o,s:s,s:o,s:b,s:f,s:f,s:o,s:n,s:s}", "id", x->id, "object", "response",
                  "created_at", (json_int_t)x->created, "status", status, "background", 0, "error",
                  error ? error : json_null(), "incomplete_details",
                  !strcmp(status, "incomplete") ? json_pack("{s:s}", "reason", "max_output_tokens") : json_null(),
                  "model", j->s->model, "output", output ? output : json_array(), "store", x->store, "temperature",
                  j->rq.temperature, "top_p", j->rq.top_p, "usage", usage ? usage : json_null(), "user", "service_tier",
                  "default");
    if (!o) return NULL;
    json_object_set_new(o, "max_output_tokens", j->rq.max_tokens >= 0 ? json_integer(j->rq.max_tokens) : json_null());
    json_object_update(o, x->echo);
    return o;
}

static const char *final_status(const k3_srv_choice *c) {
    return !c->stop_hit && c->q.finish == K3_FINISH_LENGTH ? "incomplete" : "completed";
}

/* Keeps the response and its conversation (with the reply as the
 * assistant's message) when the request asked to store it. */
static void store(k3_srv_job *j, json_t *resp, const k3_chat_reply *r) {
    resp_ctx *x = j->surf;
    if (!x->store || !resp) return;
    json_t *msg = json_pack("{s:s,s:o}", "role", "assistant", "content",
                            k3_srv_jstr(r->content ? r->content : "", r->content ? strlen(r->content) : 0));
    if (r->reasoning) json_object_set_new(msg, "reasoning_content", k3_srv_jstr(r->reasoning, strlen(r->reasoning)));
    json_t *calls = k3_items_calls(r), *tc = json_array();
    for (int i = 0; i < x->items.n; i++) {
        const k3_item *it = &x->items.v[i];
        if (it->kind != K3_ITEM_CALL) continue;
        json_t *f = json_object_get(json_array_get(calls, (size_t)it->call), "function");
        json_array_append_new(tc,
                              json_pack("{s:s,s:s,s:{s:s,s:O}}", "id", it->call_id, "type", "function", "function",
                                        "name", it->name ? it->name : "", "arguments",
                                        json_object_get(f, "arguments")));
    }
    if (json_array_size(tc)) json_object_set(msg, "tool_calls", tc);
    json_decref(tc);
    json_decref(calls);
    json_t *hist = json_copy(x->messages);
    json_array_append_new(hist, msg);
    char *h = json_dumps(hist, JSON_COMPACT), *t = json_dumps(resp, JSON_COMPACT);
    if (h && t) k3_srv_store_put(j->s->responses, x->id, t, strlen(t), h, strlen(h));
    free(h);
    free(t);
    json_decref(hist);
}

static const k3_items_ops items_ops;

static enum MHD_Result answer(k3_srv_job *j) {
    resp_ctx *x = j->surf;
    k3_srv_choice *c = &j->ch[0];
    const char *failed = k3_srv_choice_error(c, "engine error");
    if (failed && k3_srv_choice_error_status(c) != 500)
        return k3_srv_error(j->s, j->conn, k3_srv_choice_error_status(c), "%s", failed);
    if (failed) return k3_srv_error(j->s, j->conn, 500, "generation failed: %s", failed);
    k3_chat_reply r;
    k3_error err = {0};
    const k3_chat_text mk = k3_srv_choice_marks(c);
    if (k3_chat_parse_reply_marked(c->text.p ? c->text.p : "", c->text.len, &mk, j->rq.thinking, &r, NULL, &err))
        return k3_srv_error(j->s, j->conn, 500, "the model's reply cannot be parsed: %s", err.msg);
    if (k3_items_of_reply(&x->items, &items_ops, &r, &err)) {
        k3_chat_reply_free(&r);
        return k3_srv_error(j->s, j->conn, 500, "%s", err.msg);
    }
    const char *status = final_status(c);
    pthread_mutex_lock(&j->g.mu); /* the usage reads the generated tokens */
    json_t *usage = usage_json(j);
    pthread_mutex_unlock(&j->g.mu);
    json_t *resp = response_json(j, status, output_json(x, &r, status), usage, NULL);
    store(j, resp, &r);
    k3_chat_reply_free(&r);
    return k3_srv_job_json(j, 200, resp); /* with a prefill or decode instance's members */
}

/* ---- the stream ------------------------------------------------------------ */

/* An event: obj gets its "type" and "sequence_number" (takes obj). */
static void event(k3_srv_job *j, const char *type, json_t *obj) {
    resp_ctx *x = j->surf;
    if (!obj) return;
    json_object_set_new(obj, "type", json_string(type));
    json_object_set_new(obj, "sequence_number", json_integer(x->seq++));
    k3_sse_event(&j->sse, type, obj);
}

static void ev_open(k3_srv_job *j, const k3_item *it, int i) {
    event(j, "response.output_item.added",
          json_pack("{s:i,s:o}", "output_index", i, "item", item_json(it, NULL, NULL, "in_progress")));
    if (it->kind == K3_ITEM_CALL) return;
    json_t *part =
        it->kind == K3_ITEM_TEXT ? part_output_text("") : json_pack("{s:s,s:s}", "type", "reasoning_text", "text", "");
    event(j, "response.content_part.added",
          json_pack("{s:s,s:i,s:i,s:o}", "item_id", it->id, "output_index", i, "content_index", 0, "part", part));
}

static void ev_delta(k3_srv_job *j, const k3_item *it, int i, const char *p, size_t n) {
    json_t *d = k3_srv_jstr(p, n);
    if (it->kind == K3_ITEM_CALL) {
        event(j, "response.function_call_arguments.delta",
              json_pack("{s:s,s:i,s:o}", "item_id", it->id, "output_index", i, "delta", d));
        return;
    }
    json_t *e = json_pack("{s:s,s:i,s:i,s:o}", "item_id", it->id, "output_index", i, "content_index", 0, "delta", d);
    if (it->kind == K3_ITEM_TEXT) {
        json_object_set_new(e, "logprobs", json_array());
        event(j, "response.output_text.delta", e);
    } else {
        event(j, "response.reasoning_text.delta", e);
    }
}

static void ev_close(k3_srv_job *j, const k3_item *it, int i, const k3_chat_reply *r, json_t *calls, bool last) {
    k3_srv_choice *c = &j->ch[0];
    const char *st = item_status(final_status(c), last && c->done);
    json_t *item = item_json(it, r, calls, st);
    if (it->kind == K3_ITEM_CALL) {
        event(j, "response.function_call_arguments.done",
              json_pack("{s:s,s:i,s:s,s:O}", "item_id", it->id, "output_index", i, "name", it->name ? it->name : "",
                        "arguments", json_object_get(item, "arguments")));
    } else {
        const bool text = it->kind == K3_ITEM_TEXT;
        const char *t = text ? (r->content ? r->content : "") : (r->reasoning ? r->reasoning : "");
        json_t *e = json_pack("{s:s,s:i,s:i,s:o}", "item_id", it->id, "output_index", i, "content_index", 0, "text",
                              k3_srv_jstr(t, strlen(t)));
        if (text) json_object_set_new(e, "logprobs", json_array());
        event(j, text ? "response.output_text.done" : "response.reasoning_text.done", e);
        json_t *part = json_array_get(json_object_get(item, "content"), 0);
        event(j, "response.content_part.done",
              json_pack("{s:s,s:i,s:i,s:O}", "item_id", it->id, "output_index", i, "content_index", 0, "part", part));
    }
    event(j, "response.output_item.done", json_pack("{s:i,s:o}", "output_index", i, "item", item));
}

static const k3_items_ops items_ops = {
    .prefix = {"rs_", "msg_", "fc_"},
    .open = ev_open,
    .delta = ev_delta,
    .close = ev_close,
};

static void stream_failed(k3_srv_job *j, const char *why) {
    resp_ctx *x = j->surf;
    json_t *out = output_json(x, NULL, "failed");
    event(j, "response.failed",
          json_pack("{s:o}", "response",
                    response_json(j, "failed", out, NULL,
                                  json_pack("{s:s,s:o}", "code", "server_error", "message",
                                            k3_srv_jstr(why, strlen(why))))));
}

/* response.created and response.in_progress, once. */
static void stream_start(k3_srv_job *j, k3_srv_choice *c) {
    if (c->started) return;
    c->started = true;
    json_t *r0 = response_json(j, "in_progress", NULL, NULL, NULL);
    event(j, "response.created", json_pack("{s:O}", "response", r0));
    event(j, "response.in_progress", json_pack("{s:o}", "response", r0));
}

static void stream_choice(k3_srv_job *j, int i) {
    k3_srv_choice *c = &j->ch[i];
    if (c->final_sent) return;
    stream_start(j, c);
    resp_ctx *x = j->surf;
    k3_chat_reply r;
    k3_error err = {0};
    const int st = k3_items_step(j, c, &x->items, &items_ops, &r, &err);
    if (st < 0) {
        char why[700];
        snprintf(why, sizeof why, "the model's reply cannot be streamed: %s", err.msg);
        stream_failed(j, why);
        c->final_sent = true;
        if (!c->done) k3_srv_job_cancel(j);
        return;
    }
    if (st == 0) return;
    const char *failed = k3_srv_choice_error(c, "generation failed");
    if (failed) {
        stream_failed(j, failed);
    } else {
        const char *status = final_status(c);
        json_t *resp = response_json(j, status, output_json(x, &r, status), usage_json(j), NULL);
        store(j, resp, &r);
        event(j, !strcmp(status, "completed") ? "response.completed" : "response.incomplete",
              json_pack("{s:o}", "response", resp));
    }
    k3_chat_reply_free(&r);
    c->final_sent = true;
}

static void stream_end(k3_srv_job *j) {}

/* The server ends the stream (a shutdown, the engine failed):
 * response.failed with the output so far and the reason, the Responses
 * API's ending of a response that cannot finish. */
static void stream_ended(k3_srv_job *j, unsigned status, const char *why) {
    k3_srv_choice *c = &j->ch[0];
    if (c->final_sent) return;
    stream_start(j, c);
    stream_failed(j, why);
    c->final_sent = true;
}

static const k3_srv_api responses = {
    .fields = K3_API_RESPONSES,
    .id_prefix = "resp",
    .keep_specials = true,
    .default_max_tokens = -1,
    .prompt = resp_prompt,
    .hold = k3_srv_chat_hold,
    .answer = answer,
    .stream_choice = stream_choice,
    .stream_end = stream_end,
    .stream_error = stream_ended,
    .surf_free = ctx_free,
};

/* ---- the routes --------------------------------------------------------------- */

enum MHD_Result k3_api_responses(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    resp_ctx *x = calloc(1, sizeof *x);
    if (!x) return k3_srv_error(s, c, 500, "out of memory");
    bad b = {400, ""};
    if (!build(s, root, x, &b)) {
        ctx_free(x);
        return k3_srv_error(s, c, b.status, "%s", b.msg);
    }
    char rnd[32];
    k3_chat_new_call_id(rnd);
    snprintf(x->id, sizeof x->id, "resp_%s", rnd + 5);
    x->created = (long)time(NULL);
    return k3_srv_job_serve_surf(s, c, root, &responses, x);
}

/* The id of /v1/responses/{id}. */
static const char *id_of(const char *url) {
    const char *p = strrchr(url, '/');
    return p ? p + 1 : url;
}

enum MHD_Result k3_api_responses_get(struct k3_server *s, struct MHD_Connection *c, const char *url) {
    char *resp = NULL;
    const char *id = id_of(url);
    if (!k3_srv_store_get(s->responses, id, &resp, NULL))
        return k3_srv_error(s, c, 404, "Response with id '%.200s' not found.", id);
    return k3_srv_queue(s, c, 200, resp, strlen(resp), "application/json");
}

enum MHD_Result k3_api_responses_delete(struct k3_server *s, struct MHD_Connection *c, const char *url) {
    const char *id = id_of(url);
    if (!k3_srv_store_delete(s->responses, id))
        return k3_srv_error(s, c, 404, "Response with id '%.200s' not found.", id);
    return k3_srv_json(s, c, 200, json_pack("{s:s,s:s,s:b}", "id", id, "object", "response", "deleted", 1));
}
