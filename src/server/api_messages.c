/*
 * api_messages.c -- Anthropic's Messages API: POST /v1/messages and POST
 * /v1/messages/count_tokens.
 *
 * The request becomes a chat conversation (as vLLM's Anthropic server builds
 * one): "system" (a string or text blocks) a system message; user text and
 * image blocks (base64 sources, as data: URLs through the vision tower)
 * content parts; a tool_result block a tool message (is_error: its text
 * after "Error: "; images in it a user message after it); an assistant's
 * thinking blocks its reasoning and tool_use blocks its tool calls. "tools"
 * ({name, description, input_schema}) become chat's tools, "tool_choice"
 * auto / any / tool / none chat's auto / required / required / none (a named
 * tool must be in "tools"). "thinking": {"type": "enabled", "budget_tokens"}
 * or {"type": "adaptive"} opens K3's think channel (the default is off, as in
 * Anthropic's API); budget_tokens is checked as Anthropic checks it (>= 1024,
 * < max_tokens) but K3 has no cap on its thinking, so the thinking counts
 * against max_tokens.
 * "output_config.effort" maps as OpenAI's reasoning effort does.
 *
 * The answer: content blocks thinking (with a signature: a hash of its
 * text), text and tool_use (id "toolu_..."), stop_reason end_turn /
 * max_tokens / stop_sequence (with stop_sequence) / tool_use, and usage as
 * Anthropic counts it: input_tokens the prompt tokens not read from the
 * prefix cache, cache_read_input_tokens those that were. A stream is
 * Anthropic's named events: message_start, ping, per block
 * content_block_start, content_block_delta (thinking_delta, signature_delta,
 * text_delta, input_json_delta), content_block_stop, then message_delta
 * (stop_reason, usage) and message_stop; an error is an "error" event.
 * Every error of these routes is Anthropic's error JSON.
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

typedef struct msg_ctx {
    json_t *messages;        /* chat messages */
    json_t *tools;           /* chat-shaped, or NULL */
    json_t *response_format; /* chat-shaped, or NULL */
    char tool_choice[16];    /* "" (none given), auto, required, none */
    char tool_name[256];     /* with required: the one tool named, or "" */
    bool thinking;
    const char *effort;
    char id[64];
    k3_items items;
} msg_ctx;

static void ctx_free(void *p) {
    msg_ctx *x = p;
    json_decref(x->messages);
    json_decref(x->tools);
    json_decref(x->response_format);
    k3_items_free(&x->items);
    free(x);
}

/* ---- errors ---------------------------------------------------------------- */

json_t *k3_srv_anthropic_error_json(unsigned status, const char *msg) {
    return k3_http_anthropic_error_json(status, k3_srv_jstr(msg, strlen(msg)));
}

enum MHD_Result k3_srv_anthropic_error(struct k3_server *s, struct MHD_Connection *c, unsigned status,
                                       const char *msg) {
    return k3_srv_json(s, c, status, k3_srv_anthropic_error_json(status, msg));
}

/* ---- the request into a conversation --------------------------------------- */

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

/* An image block's source as a URL: base64 -> a data: URL; url -> as given
 * (the vision path refuses remote URLs: nothing is fetched). */
static json_t *image_part(json_t *block, const char *where, bad *b) {
    json_t *src = json_object_get(block, "source");
    const char *type = json_string_value(json_object_get(src, "type"));
    if (type && !strcmp(type, "url") && json_is_string(json_object_get(src, "url")))
        return json_pack("{s:s,s:{s:O}}", "type", "image_url", "image_url", "url", json_object_get(src, "url"));
    json_t *mt = json_object_get(src, "media_type"), *data = json_object_get(src, "data");
    if (!type || strcmp(type, "base64") || !json_is_string(mt) || !json_is_string(data)) {
        fail(b, 400, "%s: an image needs a source {\"type\": \"base64\", \"media_type\", \"data\"}", where);
        return NULL;
    }
    k3_buf u = {0};
    k3_buf_addf(&u, "data:%s;base64,", json_string_value(mt));
    k3_buf_add(&u, json_string_value(data), json_string_length(data));
    json_t *part = u.oom ? NULL : json_pack("{s:s,s:{s:s%}}", "type", "image_url", "image_url", "url", u.p, u.len);
    k3_buf_free(&u);
    if (!part) fail(b, 500, "out of memory");
    return part;
}

static json_t *text_part(json_t *t) { return json_pack("{s:s,s:O}", "type", "text", "text", t); }

/* A tool_result block: a tool message, then its images as a user message. */
static bool tool_result(json_t *block, const char *where, json_t *msgs, bad *b) {
    json_t *id = json_object_get(block, "tool_use_id"), *content = json_object_get(block, "content");
    if (!json_is_string(id)) return fail(b, 400, "%s: a tool_result needs \"tool_use_id\"", where);
    k3_buf t = {0};
    if (json_is_true(json_object_get(block, "is_error"))) k3_buf_puts(&t, "Error: ");
    json_t *images = json_array();
    if (json_is_string(content)) {
        k3_buf_add(&t, json_string_value(content), json_string_length(content));
    } else if (json_is_array(content)) {
        size_t k, n_text = 0;
        json_t *p;
        json_array_foreach(content, k, p) {
            const char *type = json_string_value(json_object_get(p, "type"));
            char w[160];
            snprintf(w, sizeof w, "%s.content[%zu]", where, k);
            if (type && !strcmp(type, "text") && json_is_string(json_object_get(p, "text"))) {
                json_t *tx = json_object_get(p, "text");
                if (n_text++) k3_buf_puts(&t, "\n");
                k3_buf_add(&t, json_string_value(tx), json_string_length(tx));
            } else if (type && !strcmp(type, "image")) {
                json_t *ip = image_part(p, w, b);
                if (!ip) {
                    k3_buf_free(&t);
                    json_decref(images);
                    return false;
                }
                json_array_append_new(images, ip);
            } else {
                k3_buf_free(&t);
                json_decref(images);
                return fail(b, 400, "%s: a tool_result block of type \"%s\" is not supported", w, type ? type : "?");
            }
        }
    } else if (content && !json_is_null(content)) {
        k3_buf_free(&t);
        json_decref(images);
        return fail(b, 400, "%s: a tool_result's content must be a string or a list of blocks", where);
    }
    json_t *tc = k3_srv_jstr(t.p ? t.p : "", t.len);
    k3_buf_free(&t);
    json_array_append_new(msgs,
                          json_pack("{s:s,s:O,s:o}", "role", "tool", "tool_call_id", id, "content",
                                    tc ? tc : json_string("")));
    if (json_array_size(images)) json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "user", "content", images));
    json_decref(images);
    return true;
}

/* One message's blocks into chat messages appended to msgs. */
static bool message(json_t *m, size_t i, json_t *msgs, bad *b) {
    const char *role = json_string_value(json_object_get(m, "role"));
    if (!role || (strcmp(role, "user") && strcmp(role, "assistant")))
        return fail(b, 400, "messages[%zu]: the role must be user or assistant", i);
    const bool user = !strcmp(role, "user");
    json_t *content = json_object_get(m, "content");
    if (json_is_string(content)) {
        json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", role, "content", content));
        return true;
    }
    if (!json_is_array(content)) return fail(b, 400, "messages[%zu].content must be a string or a list of blocks", i);
    json_t *parts = json_array(), *calls = json_array();
    k3_buf think = {0};
    bool ok = true, any_think = false;
    size_t k;
    json_t *blk;
    json_array_foreach(content, k, blk) {
        char w[96];
        snprintf(w, sizeof w, "messages[%zu].content[%zu]", i, k);
        const char *type = json_is_object(blk) ? json_string_value(json_object_get(blk, "type")) : NULL;
        if (!type) {
            ok = fail(b, 400, "%s is not a block with a \"type\"", w);
            break;
        }
        if (!strcmp(type, "text")) {
            json_t *t = json_object_get(blk, "text");
            if (!json_is_string(t)) {
                ok = fail(b, 400, "%s: a text block needs \"text\"", w);
                break;
            }
            json_array_append_new(parts, text_part(t));
        } else if (!strcmp(type, "image") && user) {
            json_t *ip = image_part(blk, w, b);
            if (!(ok = ip != NULL)) break;
            json_array_append_new(parts, ip);
        } else if (!strcmp(type, "tool_result") && user) {
            if (!(ok = tool_result(blk, w, msgs, b))) break;
        } else if (!strcmp(type, "tool_use") && !user) {
            json_t *id = json_object_get(blk, "id"), *name = json_object_get(blk, "name"),
                   *input = json_object_get(blk, "input");
            if (!json_is_string(id) || !json_is_string(name) || (input && !json_is_object(input))) {
                ok = fail(b, 400, "%s: a tool_use needs \"id\", \"name\" and an \"input\" object", w);
                break;
            }
            json_array_append_new(calls,
                                  json_pack("{s:O,s:s,s:{s:O,s:o}}", "id", id, "type", "function", "function", "name",
                                            name, "arguments", input ? json_incref(input) : json_object()));
        } else if (!strcmp(type, "thinking") && !user) {
            json_t *t = json_object_get(blk, "thinking");
            if (!json_is_string(t)) {
                ok = fail(b, 400, "%s: a thinking block needs \"thinking\"", w);
                break;
            }
            k3_buf_add(&think, json_string_value(t), json_string_length(t));
            any_think = true;
        } else if (!strcmp(type, "redacted_thinking") && !user) {
            /* opaque: nothing of it can be put back */
        } else {
            ok = fail(b, 400, "%s: a %s block is not supported in a%s %s message", w, type, user ? "" : "n", role);
            break;
        }
    }
    if (ok && (json_array_size(parts) || json_array_size(calls) || any_think)) {
        json_t *msg = json_pack("{s:s}", "role", role);
        /* one text block is a string, as a client would write it; more, or an image, a list of parts */
        json_t *only = json_array_size(parts) == 1 ? json_object_get(json_array_get(parts, 0), "text") : NULL;
        if (only) json_object_set(msg, "content", only);
        else if (json_array_size(parts)) json_object_set(msg, "content", parts);
        if (json_array_size(calls)) json_object_set(msg, "tool_calls", calls);
        if (any_think) json_object_set_new(msg, "reasoning_content", k3_srv_jstr(think.p ? think.p : "", think.len));
        json_array_append_new(msgs, msg);
    }
    json_decref(parts);
    json_decref(calls);
    k3_buf_free(&think);
    return ok;
}

static bool system_message(json_t *sys, json_t *msgs, bad *b) {
    if (!sys || json_is_null(sys)) return true;
    if (json_is_string(sys)) {
        if (json_string_length(sys))
            json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "system", "content", sys));
        return true;
    }
    if (!json_is_array(sys)) return fail(b, 400, "\"system\" must be a string or a list of text blocks");
    k3_buf t = {0};
    size_t k;
    json_t *blk;
    json_array_foreach(sys, k, blk) {
        json_t *tx = json_object_get(blk, "text");
        const char *type = json_string_value(json_object_get(blk, "type"));
        if (!type || strcmp(type, "text") || !json_is_string(tx)) {
            k3_buf_free(&t);
            return fail(b, 400, "system[%zu] is not a text block", k);
        }
        k3_buf_add(&t, json_string_value(tx), json_string_length(tx));
    }
    if (t.len)
        json_array_append_new(msgs, json_pack("{s:s,s:o}", "role", "system", "content", k3_srv_jstr(t.p, t.len)));
    k3_buf_free(&t);
    return true;
}

static bool convert_tools(json_t *tools, msg_ctx *x, bad *b) {
    if (!tools || json_is_null(tools)) return true;
    if (!json_is_array(tools)) return fail(b, 400, "\"tools\" must be a list");
    if (!json_array_size(tools)) return true;
    x->tools = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        const char *type = json_string_value(json_object_get(t, "type"));
        json_t *name = json_object_get(t, "name"), *schema = json_object_get(t, "input_schema");
        if (type && strcmp(type, "custom"))
            return fail(b, 400, "tools[%zu]: the tool type \"%s\" is not supported (only client tools)", i, type);
        if (!json_is_string(name) || !json_string_length(name) || !json_is_object(schema))
            return fail(b, 400, "tools[%zu]: a tool needs \"name\" and an \"input_schema\" object", i);
        json_t *fn = json_pack("{s:O}", "name", name);
        json_t *d = json_object_get(t, "description");
        if (json_is_string(d)) json_object_set(fn, "description", d);
        json_object_set(fn, "parameters", schema);
        json_array_append_new(x->tools, json_pack("{s:s,s:o}", "type", "function", "function", fn));
    }
    return true;
}

static bool parse_tool_choice(json_t *tc, msg_ctx *x, bad *b) {
    if (!tc || json_is_null(tc)) return true;
    const char *type = json_is_object(tc) ? json_string_value(json_object_get(tc, "type")) : NULL;
    if (!type) return fail(b, 400, "\"tool_choice\" must be an object with a \"type\" (auto, any, tool, none)");
    const char *mapped = !strcmp(type, "auto") ? "auto"
        : !strcmp(type, "any")                 ? "required"
        : !strcmp(type, "none")                ? "none"
        : !strcmp(type, "tool")                ? "required"
                                               : NULL;
    if (!mapped) return fail(b, 400, "\"tool_choice.type\" is \"%.32s\", not auto, any, tool or none", type);
    if (!strcmp(type, "tool")) {
        const char *name = json_string_value(json_object_get(tc, "name"));
        bool found = false;
        size_t i;
        json_t *t;
        json_array_foreach(x->tools, i, t) {
            const char *n = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
            if (name && n && !strcmp(n, name)) found = true;
        }
        if (!found)
            return fail(b, 400, "\"tool_choice\" names the tool \"%s\", which is not in \"tools\"", name ? name : "?");
        if (strlen(name) >= sizeof x->tool_name)
            return fail(b, 400, "\"tool_choice\" names a tool of over %zu bytes", sizeof x->tool_name - 1);
        snprintf(x->tool_name, sizeof x->tool_name, "%s", name);
    }
    snprintf(x->tool_choice, sizeof x->tool_choice, "%s", mapped);
    return true;
}

static bool parse_thinking(json_t *root, msg_ctx *x, bool count_only, bad *b) {
    json_t *th = json_object_get(root, "thinking");
    x->thinking = false;
    if (th && !json_is_null(th)) {
        const char *type = json_is_object(th) ? json_string_value(json_object_get(th, "type")) : NULL;
        if (!type || (strcmp(type, "enabled") && strcmp(type, "disabled") && strcmp(type, "adaptive")))
            return fail(b, 400, "\"thinking.type\" must be \"enabled\", \"adaptive\" or \"disabled\"");
        const char *display = json_string_value(json_object_get(th, "display"));
        if (display && strcmp(display, "summarized"))
            return fail(b, 400, "\"thinking.display\" \"%.32s\" is not supported (the thinking is returned whole)",
                        display);
        if (!strcmp(type, "adaptive")) x->thinking = true;
        if (!strcmp(type, "enabled")) {
            json_t *bt = json_object_get(th, "budget_tokens"), *mt = json_object_get(root, "max_tokens");
            if (!json_is_integer(bt) || json_integer_value(bt) < 1024)
                return fail(b, 400, "\"thinking.budget_tokens\" must be an integer >= 1024");
            if (!count_only && json_is_integer(mt) && json_integer_value(bt) >= json_integer_value(mt))
                return fail(b, 400, "\"max_tokens\" must be greater than \"thinking.budget_tokens\"");
            x->thinking = true;
        }
    }
    if (x->thinking) {
        /* the effort of thinking that asks none: chat's default (k3_srv_reasoning_effort of NULL) */
        bool on = false;
        k3_error err = {0};
        if (k3_srv_reasoning_effort("thinking", NULL, &on, &x->effort, &err)) return fail(b, 400, "%s", err.msg);
    }
    json_t *oc = json_object_get(root, "output_config");
    if (!oc || json_is_null(oc)) return true;
    if (!json_is_object(oc)) return fail(b, 400, "\"output_config\" must be an object");
    json_t *eff = json_object_get(oc, "effort");
    if (eff && !json_is_null(eff)) {
        if (!json_is_string(eff)) return fail(b, 400, "\"output_config.effort\" must be a string");
        bool on = false;
        k3_error err = {0};
        if (k3_srv_reasoning_effort("output_config.effort", json_string_value(eff), &on, &x->effort, &err))
            return fail(b, 400, "%s", err.msg);
        if (!x->thinking) x->effort = NULL; /* the effort of thinking that is off says nothing */
    }
    json_t *fmt = json_object_get(oc, "format");
    if (fmt && !json_is_null(fmt)) {
        const char *type = json_string_value(json_object_get(fmt, "type"));
        json_t *schema = json_object_get(fmt, "schema");
        if (!type || strcmp(type, "json_schema") || !json_is_object(schema))
            return fail(b, 400, "\"output_config.format\" must be {\"type\": \"json_schema\", \"schema\": {...}}");
        x->response_format =
            json_pack("{s:s,s:{s:s,s:O}}", "type", "json_schema", "json_schema", "name", "output", "schema", schema);
    }
    return true;
}

static bool build(json_t *root, msg_ctx *x, bool count_only, bad *b) {
    if (!count_only) {
        json_t *mt = json_object_get(root, "max_tokens");
        if (!mt || json_is_null(mt)) return fail(b, 400, "max_tokens: Field required");
        if (!json_is_integer(mt) || json_integer_value(mt) < 1)
            return fail(b, 400, "\"max_tokens\" must be an integer >= 1");
    }
    json_t *msgs = json_object_get(root, "messages");
    if (!json_is_array(msgs) || !json_array_size(msgs)) return fail(b, 400, "\"messages\" must be a non-empty list");
    x->messages = json_array();
    if (!system_message(json_object_get(root, "system"), x->messages, b)) return false;
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        if (!json_is_object(m)) return fail(b, 400, "messages[%zu] is not an object", i);
        if (!message(m, i, x->messages, b)) return false;
    }
    if (!json_array_size(x->messages)) return fail(b, 400, "\"messages\" holds no content");
    if (!convert_tools(json_object_get(root, "tools"), x, b)) return false;
    if (!parse_tool_choice(json_object_get(root, "tool_choice"), x, b)) return false;
    return parse_thinking(root, x, count_only, b);
}

static k3_status encode(struct k3_server *s, msg_ctx *x, k3_vision_prompt *vp, k3_error *err) {
    const k3_srv_chat_input in = {.messages = x->messages,
                                  .tools = x->tools,
                                  .tool_choice = x->tool_choice[0] ? x->tool_choice : NULL,
                                  .tool_name = x->tool_name[0] ? x->tool_name : NULL,
                                  .thinking = x->thinking,
                                  .effort = x->effort,
                                  .response_format = x->response_format};
    return k3_srv_encode_messages(s, &in, vp, err);
}

static bool msg_prompt(struct k3_server *s, json_t *root, k3_srv_request *rq, k3_srv_bad *e) {
    msg_ctx *x = k3_srv_job_of(rq)->surf;
    k3_error err = {0};
    rq->thinking = x->thinking;
    if (encode(s, x, &rq->vp, &err)) return k3_srv_bad_set(e, err.status == K3_ERR_NOMEM ? 500 : 400, "%s", err.msg);
    int32_t *ids = rq->vp.ids;
    rq->vp.ids = NULL;
    /* output_config.format and tool_choice any / tool constrain the reply (constraint.h) */
    json_t *tc = json_object_get(root, "tool_choice");
    return k3_srv_request_one_prompt(rq, ids, (int64_t)rq->vp.n_ids, e) &&
        k3_srv_constraint_words(s, x->response_format, "output_config.format", "output_config.format.schema", x->tools,
                                x->tool_choice[0] ? x->tool_choice : NULL, x->tool_name[0] ? x->tool_name : NULL,
                                !json_is_true(json_object_get(tc, "disable_parallel_tool_use")), x->thinking,
                                &rq->grammar, k3_srv_job_of(rq)->conn, e);
}

/* ---- the answer -------------------------------------------------------------- */

/* A thinking block's signature: a hash of its text (the text is not kept, so
 * there is nothing else to sign; the same text always gets the same one). */
static void signature(const char *t, char out[24]) {
    uint64_t h = 1469598103934665603ull;
    for (; t && *t; t++) h = (h ^ (unsigned char)*t) * 1099511628211ull;
    snprintf(out, 24, "k3%016llx", (unsigned long long)h);
}

/* "toolu_" and the 24 letters and digits of a chat tool-call id. */
static void tool_use_id(const char *call_id, char out[64]) {
    snprintf(out, 64, "toolu_%s", !strncmp(call_id, "call_", 5) ? call_id + 5 : call_id);
}

/* A content block (r NULL: as a stream opens it). */
static json_t *block_json(const k3_item *it, const k3_chat_reply *r, json_t *calls) {
    switch (it->kind) {
    case K3_ITEM_REASONING: {
        const char *t = r && r->reasoning ? r->reasoning : "";
        char sig[24] = "";
        if (r) signature(t, sig);
        return json_pack("{s:s,s:o,s:s}", "type", "thinking", "thinking", k3_srv_jstr(t, strlen(t)), "signature", sig);
    }
    case K3_ITEM_TEXT: {
        const char *t = r && r->content ? r->content : "";
        return json_pack("{s:s,s:o}", "type", "text", "text", k3_srv_jstr(t, strlen(t)));
    }
    case K3_ITEM_CALL: {
        char id[64];
        tool_use_id(it->call_id, id);
        json_t *input = NULL;
        if (r) {
            json_t *a =
                json_object_get(json_object_get(json_array_get(calls, (size_t)it->call), "function"), "arguments");
            if (json_is_string(a)) input = json_loadb(json_string_value(a), json_string_length(a), 0, NULL);
            /* a call cut off by max_tokens: its arguments so far, closed (a
             * string value cut midway, then the object), as the stream's
             * partial_json deltas read */
            static const char *const ends[] = {"}", "\"}"};
            for (int k = 0; k < 2 && !input && json_is_string(a); k++) {
                k3_buf t = {0};
                k3_buf_add(&t, json_string_value(a), json_string_length(a));
                k3_buf_puts(&t, ends[k]);
                if (!t.oom) input = json_loadb(t.p, t.len, 0, NULL);
                k3_buf_free(&t);
            }
        }
        if (!json_is_object(input)) {
            json_decref(input);
            input = json_object();
        }
        return json_pack("{s:s,s:s,s:s,s:o}", "type", "tool_use", "id", id, "name", it->name ? it->name : "", "input",
                         input);
    }
    }
    return NULL;
}

static const char *stop_reason(const k3_srv_choice *c, bool tools) {
    if (c->stop_hit) return "stop_sequence";
    if (c->q.finish == K3_FINISH_LENGTH) return "max_tokens";
    return tools ? "tool_use" : "end_turn";
}

static json_t *stop_sequence(k3_srv_job *j, const k3_srv_choice *c) {
    if (!c->stop_hit || c->stop_which < 1 || c->stop_which > j->rq.stops.n) return json_null();
    const int k = c->stop_which - 1;
    return k3_srv_jstr(j->rq.stops.s[k], j->rq.stops.len[k]);
}

static json_t *usage_json(k3_srv_job *j) {
    const k3_srv_choice *c = &j->ch[0];
    const int64_t in = j->rq.n_prompt[0], cached = c->q.n_cached;
    return json_pack("{s:I,s:I,s:I,s:I}", "input_tokens", (json_int_t)(in - cached), "output_tokens",
                     (json_int_t)c->n_out, "cache_read_input_tokens", (json_int_t)cached, "cache_creation_input_tokens",
                     (json_int_t)0);
}

static bool has_calls(const k3_items *it) {
    for (int i = 0; i < it->n; i++)
        if (it->v[i].kind == K3_ITEM_CALL) return true;
    return false;
}

static const k3_items_ops items_ops;

static enum MHD_Result answer(k3_srv_job *j) {
    msg_ctx *x = j->surf;
    k3_srv_choice *c = &j->ch[0];
    const char *failed = k3_srv_choice_error(c, "engine error");
    if (failed) return k3_srv_anthropic_error(j->s, j->conn, k3_srv_choice_error_status(c), failed);
    k3_chat_reply r;
    k3_error err = {0};
    char why[700];
    const k3_chat_text mk = k3_srv_choice_marks(c);
    if (k3_chat_parse_reply_marked(c->text.p ? c->text.p : "", c->text.len, &mk, j->rq.thinking, &r, NULL, &err)) {
        snprintf(why, sizeof why, "the model's reply cannot be parsed: %s", err.msg);
        return k3_srv_anthropic_error(j->s, j->conn, 500, why);
    }
    if (k3_items_of_reply(&x->items, &items_ops, &r, &err)) {
        k3_chat_reply_free(&r);
        return k3_srv_anthropic_error(j->s, j->conn, 500, err.msg);
    }
    json_t *content = json_array(), *calls = k3_items_calls(&r);
    for (int i = 0; i < x->items.n; i++) json_array_append_new(content, block_json(&x->items.v[i], &r, calls));
    json_decref(calls);
    k3_chat_reply_free(&r);
    json_t *resp =
        json_pack("{s:s,s:s,s:s,s:s,s:o,s:s,s:o,s:o}", "id", x->id, "type", "message", "role", "assistant", "model",
                  j->s->model, "content", content, "stop_reason", stop_reason(c, has_calls(&x->items)), "stop_sequence",
                  stop_sequence(j, c), "usage", usage_json(j));
    return k3_srv_job_json(j, 200, resp); /* with a prefill or decode instance's members */
}

/* ---- the stream ---------------------------------------------------------------- */

static void event(k3_srv_job *j, const char *type, json_t *obj) {
    if (!obj) return;
    json_object_set_new(obj, "type", json_string(type));
    k3_sse_event(&j->sse, type, obj);
}

static void ev_open(k3_srv_job *j, const k3_item *it, int i) {
    event(j, "content_block_start", json_pack("{s:i,s:o}", "index", i, "content_block", block_json(it, NULL, NULL)));
}

static void ev_delta(k3_srv_job *j, const k3_item *it, int i, const char *p, size_t n) {
    static const char *types[] = {"thinking_delta", "text_delta", "input_json_delta"};
    static const char *keys[] = {"thinking", "text", "partial_json"};
    event(j, "content_block_delta",
          json_pack("{s:i,s:{s:s,s:o}}", "index", i, "delta", "type", types[it->kind], keys[it->kind],
                    k3_srv_jstr(p, n)));
}

static void ev_close(k3_srv_job *j, const k3_item *it, int i, const k3_chat_reply *r, json_t *calls, bool last) {
    if (it->kind == K3_ITEM_REASONING) {
        char sig[24];
        signature(r->reasoning ? r->reasoning : "", sig);
        event(j, "content_block_delta",
              json_pack("{s:i,s:{s:s,s:s}}", "index", i, "delta", "type", "signature_delta", "signature", sig));
    }
    event(j, "content_block_stop", json_pack("{s:i}", "index", i));
}

static const k3_items_ops items_ops = {
    .prefix = {"th_", "tx_", "tu_"},
    .open = ev_open,
    .delta = ev_delta,
    .close = ev_close,
};

/* Anthropic's error event, as its API ends a stream it cannot finish (the
 * SDK raises it): a reply that fails, and the server's own endings (a
 * shutdown, the engine failed: the stream_error hook). */
static void stream_error(k3_srv_job *j, unsigned status, const char *why) {
    k3_sse_event(&j->sse, "error", k3_srv_anthropic_error_json(status, why));
}

static void stream_choice(k3_srv_job *j, int i) {
    msg_ctx *x = j->surf;
    k3_srv_choice *c = &j->ch[i];
    if (c->final_sent) return;
    /* message_start once the prompt has run, so its usage counts the cached tokens */
    if (!c->started) {
        if (!c->q.n_tok && !c->q.finished) return;
        c->started = true;
        json_t *msg =
            json_pack("{s:s,s:s,s:s,s:s,s:[],s:n,s:n,s:o}", "id", x->id, "type", "message", "role", "assistant",
                      "model", j->s->model, "content", "stop_reason", "stop_sequence", "usage", usage_json(j));
        if (msg) json_object_set_new(json_object_get(msg, "usage"), "output_tokens", json_integer(0));
        event(j, "message_start", json_pack("{s:o}", "message", msg));
        event(j, "ping", json_object());
    }
    k3_chat_reply r;
    k3_error err = {0};
    const int st = k3_items_step(j, c, &x->items, &items_ops, &r, &err);
    if (st < 0) {
        char why[700];
        snprintf(why, sizeof why, "the model's reply cannot be streamed: %s", err.msg);
        stream_error(j, 500, why);
        c->final_sent = true;
        if (!c->done) k3_srv_job_cancel(j);
        return;
    }
    if (st == 0) return;
    k3_chat_reply_free(&r);
    const char *failed = k3_srv_choice_error(c, "generation failed");
    if (failed) {
        stream_error(j, k3_srv_choice_error_status(c), failed);
    } else {
        event(j, "message_delta",
              json_pack("{s:{s:s,s:o},s:o}", "delta", "stop_reason", stop_reason(c, has_calls(&x->items)),
                        "stop_sequence", stop_sequence(j, c), "usage", usage_json(j)));
        event(j, "message_stop", json_object());
    }
    c->final_sent = true;
}

static void stream_end(k3_srv_job *j) {}

static const k3_srv_api messages = {
    .fields = K3_API_MESSAGES,
    .id_prefix = "msg",
    .keep_specials = true,
    .default_max_tokens = -1,
    .prompt = msg_prompt,
    .hold = k3_srv_chat_hold,
    .answer = answer,
    .stream_choice = stream_choice,
    .stream_end = stream_end,
    .stream_error = stream_error,
    .error = k3_srv_anthropic_error,
    .surf_free = ctx_free,
};

/* ---- the routes ----------------------------------------------------------------- */

enum MHD_Result k3_api_messages(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    msg_ctx *x = calloc(1, sizeof *x);
    if (!x) return k3_srv_anthropic_error(s, c, 500, "out of memory");
    bad b = {400, ""};
    if (!build(root, x, false, &b)) {
        ctx_free(x);
        return k3_srv_anthropic_error(s, c, b.status, b.msg);
    }
    char rnd[32];
    k3_chat_new_call_id(rnd);
    snprintf(x->id, sizeof x->id, "msg_%s", rnd + 5);
    return k3_srv_job_serve_surf(s, c, root, &messages, x);
}

enum MHD_Result k3_api_messages_count_tokens(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    msg_ctx x = {0};
    bad b = {400, ""};
    k3_vision_prompt vp;
    memset(&vp, 0, sizeof vp);
    k3_error err = {0};
    enum MHD_Result ret;
    if (!build(root, &x, true, &b)) ret = k3_srv_anthropic_error(s, c, b.status, b.msg);
    else if (encode(s, &x, &vp, &err))
        ret = k3_srv_anthropic_error(s, c, err.status == K3_ERR_NOMEM ? 500 : 400, err.msg);
    else ret = k3_srv_json(s, c, 200, json_pack("{s:I}", "input_tokens", (json_int_t)vp.n_ids));
    k3_vision_prompt_free(&vp);
    json_decref(x.messages);
    json_decref(x.tools);
    json_decref(x.response_format);
    return ret;
}
