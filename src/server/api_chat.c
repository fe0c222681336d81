/*
 * api_chat.c -- POST /v1/chat/completions: "messages" (with "tools",
 * "tool_choice", "response_format", "chat_template_kwargs", images through
 * the vision tower) encoded as a K3 chat prompt; the reply decoded with
 * specials by name and parsed into reasoning_content, content and
 * tool_calls. A stream re-parses the reply on each new token and sends the
 * growth of reasoning_content and content (an unfinished <|open|> or
 * <|close|> tag held back) and the tool calls as vLLM sends them.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "server/api.h"
#include "server/constraint.h"
#include "server/http.h"
#include "server/images.h"
#include "server/job.h"
#include "tokenizer/reasoning.h"

#define OBJECT "chat.completion"
#define CHUNK_OBJECT "chat.completion.chunk"

/* ---- the prompt --------------------------------------------------------- */

/* The think switch and effort of a chat request: "reasoning_effort" on
 * OpenAI's scale (k3_chat_reasoning_effort: none is off; absent, K3's
 * default: on, at "max"), then chat_template_kwargs, which win:
 * .thinking / .enable_thinking turn it on or off, .thinking_effort names
 * K3's level (null: none named, the model's own judgement). */
static k3_status chat_thinking(json_t *root, bool *thinking, const char **effort, k3_error *err) {
    json_t *re = json_object_get(root, "reasoning_effort");
    if (re && !json_is_null(re) && !json_is_string(re))
        return k3_err(err, K3_ERR_ARG, "\"reasoning_effort\" must be a string");
    K3_TRY(k3_chat_reasoning_effort(json_string_value(re), thinking, effort, err));
    json_t *kw = json_object_get(root, "chat_template_kwargs");
    if (!kw || json_is_null(kw)) return K3_OK;
    if (!json_is_object(kw)) return k3_err(err, K3_ERR_ARG, "\"chat_template_kwargs\" must be an object");
    static const char *keys[] = {"thinking", "enable_thinking"};
    for (int i = 0; i < 2; i++) {
        json_t *v = json_object_get(kw, keys[i]);
        if (!v || json_is_null(v)) continue;
        if (!json_is_boolean(v)) return k3_err(err, K3_ERR_ARG, "\"%s\" must be true or false", keys[i]);
        *thinking = json_is_true(v);
        if (*thinking && !*effort) *effort = "max";
    }
    json_t *te = json_object_get(kw, "thinking_effort");
    if (te && !json_is_null(te) && !json_is_string(te))
        return k3_err(err, K3_ERR_ARG, "\"thinking_effort\" must be a string");
    if (te) *effort = json_string_value(te);
    return K3_OK;
}

k3_status k3_srv_reasoning_effort(const char *field, const char *effort, bool *thinking, const char **k3_effort,
                                  k3_error *err) {
    k3_error e = {0};
    if (k3_chat_reasoning_effort(effort, thinking, k3_effort, &e))
        return k3_err(err, K3_ERR_ARG, "\"%s\": %s", field, e.msg);
    return K3_OK;
}

/* Whether any message has an image part (the encode then takes the tower's pool). */
static bool has_image(json_t *msgs) {
    size_t i, k;
    json_t *m, *part;
    json_array_foreach(msgs, i, m) {
        json_t *content = json_is_object(m) ? json_object_get(m, "content") : NULL;
        if (!json_is_array(content)) continue;
        json_array_foreach(content, k, part) {
            const char *type = json_is_object(part) ? json_string_value(json_object_get(part, "type")) : NULL;
            if (type && (!strcmp(type, "image_url") || !strcmp(type, "image"))) return true;
        }
    }
    return false;
}

k3_status k3_srv_encode_messages(struct k3_server *s, const k3_srv_chat_input *in, k3_vision_prompt *out,
                                 k3_error *err) {
    memset(out, 0, sizeof *out);
    if (!json_is_array(in->messages) || json_array_size(in->messages) == 0)
        return k3_err(err, K3_ERR_ARG, "\"messages\" must be a non-empty list");
    char *mj = json_dumps(in->messages, JSON_COMPACT);
    char *tj = json_is_array(in->tools) ? json_dumps(in->tools, JSON_COMPACT) : NULL;
    char *rj = json_is_object(in->response_format) ? json_dumps(in->response_format, JSON_COMPACT) : NULL;
    k3_chat_options co = {.add_generation_prompt = true,
                          .thinking = in->thinking,
                          .thinking_effort = in->effort,
                          .tool_choice = in->tool_choice,
                          .response_format = rj};
    /* image parts go through the tower (v NULL: refused for a text-only
     * model): the request's budgets checked on the images' headers, then
     * its turn on the tower's own pool (images.c) */
    const bool img = has_image(in->messages);
    k3_vision_cost cost = {0};
    k3_status st = !mj || (!tj && json_is_array(in->tools)) || (!rj && json_is_object(in->response_format))
        ? k3_err(err, K3_ERR_NOMEM, "out of memory")
        : img ? k3_srv_images_admit(s, mj, &cost, err)
              : K3_OK;
    if (!st) {
        if (img) k3_srv_images_enter(s, &cost);
        st = k3_vision_chat_encode_json(img ? s->vision : NULL, s->tok, img ? s->vision_pool : NULL, mj, tj, &co,
                                        s->max_image_pixels, out, err);
        if (img) k3_srv_images_leave(s, &cost);
    }
    free(mj);
    free(tj);
    free(rj);
    return st;
}

k3_status k3_srv_encode_chat(struct k3_server *s, json_t *root, k3_vision_prompt *out, bool *thinking_out,
                             k3_error *err) {
    memset(out, 0, sizeof *out);
    bool thinking = K3_SRV_THINKING_DEFAULT;
    const char *effort = NULL;
    K3_TRY(chat_thinking(root, &thinking, &effort, err));
    if (thinking_out) *thinking_out = thinking;
    json_t *msgs = json_object_get(root, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return k3_err(err, K3_ERR_ARG, "\"messages\" must be a non-empty list");
    json_t *tools = json_object_get(root, "tools");
    if (tools && !json_is_null(tools) && !json_is_array(tools))
        return k3_err(err, K3_ERR_ARG, "\"tools\" must be a list");
    json_t *tc = json_object_get(root, "tool_choice");
    const char *tool_choice = NULL, *tool_name = NULL;
    if (json_is_string(tc)) tool_choice = json_string_value(tc);
    else if (json_is_object(tc)) {
        tool_choice = "required";
        tool_name = json_string_value(json_object_get(json_object_get(tc, "function"), "name"));
    } else if (tc && !json_is_null(tc)) return k3_err(err, K3_ERR_ARG, "\"tool_choice\" must be a string or an object");
    json_t *rf = json_object_get(root, "response_format");
    const k3_srv_chat_input in = {.messages = msgs,
                                  .tools = json_is_array(tools) ? tools : NULL,
                                  .tool_choice = tool_choice,
                                  .tool_name = tool_name,
                                  .thinking = thinking,
                                  .effort = effort,
                                  .response_format = json_is_object(rf) ? rf : NULL};
    return k3_srv_encode_messages(s, &in, out, err);
}

static bool chat_prompt(struct k3_server *s, json_t *root, k3_srv_request *rq, k3_srv_bad *e) {
    k3_error err = {0};
    if (k3_srv_encode_chat(s, root, &rq->vp, &rq->thinking, &err))
        return k3_srv_bad_set(e, err.status == K3_ERR_NOMEM ? 500 : 400, "%s", err.msg);
    int32_t *ids = rq->vp.ids; /* the request owns the ids now */
    rq->vp.ids = NULL;
    return k3_srv_request_one_prompt(rq, ids, (int64_t)rq->vp.n_ids, e) &&
        k3_srv_constraint_openai(s, K3_API_CHAT, root, rq->thinking, &rq->grammar, k3_srv_job_of(rq)->conn, e);
}

/* ---- the reply ------------------------------------------------------------ */

size_t k3_srv_chat_hold(const char *t, size_t from, size_t lim) {
    /* a tag is decided at its <|sep|>: hold back an unfinished one */
    for (size_t i = lim; i-- > from;) {
        if (t[i] != '<') continue;
        if ((lim - i >= 8 && !strncmp(t + i, "<|open|>", 8)) || (lim - i >= 9 && !strncmp(t + i, "<|close|>", 9))) {
            if (!memmem(t + i, lim - i, "<|sep|>", 7)) lim = i;
            break;
        }
    }
    return lim;
}

k3_status k3_srv_tool_deltas(k3_tool_stream *ts, const k3_chat_reply *r, const k3_chat_partial_call *part, json_t *out,
                             k3_error *err) {
    json_t *tc = NULL;
    if (r->tool_calls_json && r->n_tool_calls > 0 && !(tc = json_loads(r->tool_calls_json, 0, NULL)))
        return k3_err(err, K3_ERR_NOMEM, "out of memory for the tool calls");
    const size_t nc = json_array_size(tc), total = nc + (part && part->name && part->args ? 1 : 0);
    k3_status st = K3_OK;
    for (size_t k = 0; k < total && !st; k++) {
        const char *name, *args;
        size_t alen;
        if (k < nc) {
            json_t *f = json_object_get(json_array_get(tc, k), "function"), *a = json_object_get(f, "arguments");
            name = json_string_value(json_object_get(f, "name"));
            args = json_string_value(a);
            alen = json_string_length(a);
        } else {
            name = part->name;
            args = part->args;
            alen = part->args_len;
        }
        if (!name || !args) {
            st = k3_err(err, K3_ERR_FORMAT, "tool call %zu has no name or arguments", k + 1);
            break;
        }
        if ((int)k >= ts->n) {
            if (ts->n == ts->cap) {
                const int cap = ts->cap ? ts->cap * 2 : 4;
                k3_tool_stream_call *nw = realloc(ts->calls, sizeof *nw * (size_t)cap);
                if (!nw) {
                    st = k3_err(err, K3_ERR_NOMEM, "out of memory for the tool calls");
                    break;
                }
                ts->calls = nw;
                ts->cap = cap;
            }
            k3_tool_stream_call *sc = &ts->calls[ts->n++];
            memset(sc, 0, sizeof *sc);
            k3_chat_new_call_id(sc->id);
            json_t *e = json_pack("{s:i,s:s,s:s,s:{s:o,s:s}}", "index", (int)k, "id", sc->id, "type", "function",
                                  "function", "name", k3_srv_jstr(name, strlen(name)), "arguments", "");
            if (!e || json_array_append_new(out, e)) st = k3_err(err, K3_ERR_NOMEM, "out of memory for a delta");
        }
        k3_tool_stream_call *sc = &ts->calls[k];
        if (sc->sent.len > alen || (sc->sent.len && memcmp(args, sc->sent.p, sc->sent.len)))
            st = k3_err(err, K3_ERR_FORMAT,
                        "tool call %zu (%s): the arguments sent so far are not a prefix of its arguments", k + 1, name);
        else if (alen > sc->sent.len) {
            json_t *e = json_pack("{s:i,s:{s:o}}", "index", (int)k, "function", "arguments",
                                  k3_srv_jstr(args + sc->sent.len, alen - sc->sent.len));
            k3_buf_add(&sc->sent, args + sc->sent.len, alen - sc->sent.len);
            if (!e || json_array_append_new(out, e) || sc->sent.oom)
                st = k3_err(err, K3_ERR_NOMEM, "out of memory for a delta");
        }
    }
    json_decref(tc);
    return st;
}

json_t *k3_srv_chat_message(const char *text, size_t len, const k3_chat_text *marks, bool thinking, bool *tools,
                            k3_error *err) {
    k3_chat_reply r;
    memset(&r, 0, sizeof r);
    *tools = false;
    if (k3_chat_parse_reply_marked(text, len, marks, thinking, &r, NULL, err)) return NULL;
    json_t *msg = json_pack("{s:s}", "role", "assistant");
    /* as OpenAI's reasoning models: content is "" when the reply has none
     * (thinking used up max_tokens), null only beside tool calls */
    const bool calls = r.tool_calls_json && r.n_tool_calls > 0;
    json_object_set_new(msg, "content",
                        r.content   ? k3_srv_jstr(r.content, strlen(r.content))
                            : calls ? json_null()
                                    : json_string(""));
    if (r.reasoning) json_object_set_new(msg, "reasoning_content", k3_srv_jstr(r.reasoning, strlen(r.reasoning)));
    if (r.tool_calls_json && r.n_tool_calls > 0) {
        json_t *tc = json_loads(r.tool_calls_json, 0, NULL);
        if (tc) {
            json_object_set_new(msg, "tool_calls", tc);
            *tools = true;
        }
    }
    k3_chat_reply_free(&r);
    return msg;
}

/* ---- answers -------------------------------------------------------------- */

/* Appends to content the logprobs entries of c's generated tokens [from,
 * upto) whose text lies in text[off, off + len): the tokens of the content
 * (one that puts no text there, a special left out, is not listed). Returns
 * where it stopped: the first token that begins at or after off + len. */
static size_t content_logprobs(k3_srv_job *j, const k3_srv_choice *c, size_t from, size_t upto, size_t off, size_t len,
                               json_t *content) {
    size_t t = from;
    for (; t < upto && t < c->n_seen; t++) {
        size_t t0, t1;
        k3_srv_choice_token_span(c, t, &t0, &t1);
        if (t0 >= off + len) break; /* past the content (or what is sent of it) */
        if (t1 > t0 && t1 > off) k3_srv_chat_logprobs(j, c, t, t + 1, content);
    }
    return t;
}

/* Appends to out the logprobs entries of c's generated tokens [from, upto)
 * that begin before re (the think channel, its closing tag included: the
 * tokens usage counts as reasoning_tokens; one that puts no text there is
 * not listed). Returns where it stopped: the first token at or past re. */
static size_t reasoning_logprobs(k3_srv_job *j, const k3_srv_choice *c, size_t from, size_t upto, size_t re,
                                 json_t *out) {
    size_t t = from;
    for (; t < upto && t < c->n_seen; t++) {
        size_t t0, t1;
        k3_srv_choice_token_span(c, t, &t0, &t1);
        if (t0 >= re) break;
        if (t1 > t0) k3_srv_chat_logprobs(j, c, t, t + 1, out);
    }
    return t;
}

/* Reasoning tokens: those that begin inside the think channel (its closing tag included). */
static int64_t reasoning_tokens(k3_srv_job *j, const k3_srv_choice *c) {
    if (!j->rq.thinking) return 0;
    size_t re, off, len;
    bool has;
    const k3_chat_text mk = k3_srv_choice_marks(c);
    k3_chat_reply_spans_marked(c->text.p ? c->text.p : "", c->text.len, &mk, true, &re, &has, &off, &len);
    int64_t n = 0;
    for (size_t i = 0; i < c->n_seen; i++) {
        size_t t0, t1;
        k3_srv_choice_token_span(c, i, &t0, &t1);
        n += t0 < re;
    }
    return n;
}

/* One entry of choices: the message, its logprobs, the finish reason. */
static json_t *answer_choice(k3_srv_job *j, k3_srv_choice *c, char *why, size_t why_len) {
    k3_error err = {0};
    bool tools = false;
    const k3_chat_text mk = k3_srv_choice_marks(c);
    json_t *msg = k3_srv_chat_message(c->text.p ? c->text.p : "", c->text.len, &mk, j->rq.thinking, &tools, &err);
    if (!msg) {
        snprintf(why, why_len, "the model's reply cannot be parsed: %s", err.msg);
        return NULL;
    }
    json_t *lp = json_null();
    if (j->rq.logprobs >= 0) {
        json_decref(lp);
        /* the tokens of the content, as message.content has it */
        json_t *content = json_array();
        size_t re, off, len;
        bool has;
        k3_chat_reply_spans_marked(c->text.p ? c->text.p : "", c->text.len, &mk, j->rq.thinking, &re, &has, &off, &len);
        if (has) content_logprobs(j, c, 0, c->n_seen, off, len, content);
        lp = json_pack("{s:o}", "content", content);
        /* and those of the reasoning, as message.reasoning_content has it */
        if (j->rq.thinking) {
            json_t *rs = json_array();
            reasoning_logprobs(j, c, 0, c->n_seen, re, rs);
            if (json_array_size(rs)) json_object_set_new(lp, "reasoning_content", rs);
            else json_decref(rs);
        }
    }
    return json_pack("{s:i,s:o,s:o,s:s}", "index", c->index, "message", msg, "logprobs", lp, "finish_reason",
                     k3_srv_finish_reason(c, tools));
}

static enum MHD_Result answer(k3_srv_job *j) { return k3_srv_openai_answer(j, OBJECT, answer_choice); }

static void send_chunk(k3_srv_job *j, json_t *choices) {
    json_t *o = k3_srv_openai_object(j, CHUNK_OBJECT, choices);
    if (o && j->rq.include_usage) json_object_set_new(o, "usage", json_null());
    k3_sse_data(&j->sse, o);
}

/* An error event ends choice c's stream. */
static void stream_fail(k3_srv_job *j, k3_srv_choice *c, const char *what, const char *why) {
    char msg[700];
    snprintf(msg, sizeof msg, "%s: %s", what, why);
    k3_sse_error(&j->sse, 500, msg);
    c->final_sent = true;
}

/* Sets lp's "reasoning_content" to the entries of c's reasoning tokens
 * [lp_rsent, lp_upto) that begin in the think channel of text[0, upto), and
 * moves lp_rsent past them; none new, no key. */
static void add_reasoning_logprobs(k3_srv_job *j, k3_srv_choice *c, size_t lp_upto, size_t upto, json_t *lp) {
    if (!j->rq.thinking) return;
    size_t re, off, len;
    bool has;
    const k3_chat_text mk = k3_srv_choice_marks(c);
    k3_chat_reply_spans_marked(c->text.p ? c->text.p : "", upto, &mk, true, &re, &has, &off, &len);
    json_t *rs = json_array();
    c->lp_rsent = reasoning_logprobs(j, c, c->lp_rsent, lp_upto, re, rs);
    if (json_array_size(rs)) json_object_set_new(lp, "reasoning_content", rs);
    else json_decref(rs);
}

/* The last chunk's logprobs: the reasoning tokens not sent yet (the
 * closing tag's), or null. */
static json_t *final_logprobs(k3_srv_job *j, k3_srv_choice *c) {
    if (j->rq.logprobs < 0) return json_null();
    json_t *lp = json_pack("{s:n}", "content");
    add_reasoning_logprobs(j, c, k3_srv_choice_lp_ready(c), c->text.len, lp);
    if (json_object_get(lp, "reasoning_content")) return lp;
    json_decref(lp);
    return json_null();
}

static void stream_choice(k3_srv_job *j, int i) {
    k3_srv_choice *c = &j->ch[i];
    if (c->final_sent) return;
    k3_srv_choice_advance(j, c);
    const size_t upto = k3_srv_choice_sendable(j, c), lp_upto = k3_srv_choice_lp_ready(c);
    if (!c->started) {
        c->started = true;
        send_chunk(j,
                   json_pack("[{s:i,s:{s:s,s:s},s:n,s:n}]", "index", i, "delta", "role", "assistant", "content", "",
                             "logprobs", "finish_reason"));
    }
    bool tools = false;
    if (upto > c->emitted || c->done) {
        k3_chat_reply r;
        k3_chat_partial_call part;
        k3_error err = {0};
        const k3_chat_text mk = k3_srv_choice_marks(c);
        if (k3_chat_parse_reply_marked(c->text.p ? c->text.p : "", upto, &mk, j->rq.thinking, &r,
                                       c->done ? NULL : &part, &err)) {
            if (c->done) stream_fail(j, c, "the model's reply cannot be parsed", err.msg);
            return;
        }
        const size_t rl = r.reasoning ? strlen(r.reasoning) : 0, cl = r.content ? strlen(r.content) : 0;
        /* the logprobs of every token decoded so far go with the first delta
         * sent (reasoning, then content; the rest with the last chunk), so
         * a reply that stays in reasoning_content has them all too */
        if (rl > c->sent_reasoning) {
            json_t *lp = json_null();
            if (j->rq.logprobs >= 0) {
                json_decref(lp);
                lp = json_pack("{s:n}", "content");
                add_reasoning_logprobs(j, c, lp_upto, upto, lp);
            }
            send_chunk(j,
                       json_pack("[{s:i,s:{s:o},s:o,s:n}]", "index", i, "delta", "reasoning_content",
                                 k3_srv_jstr(r.reasoning + c->sent_reasoning, rl - c->sent_reasoning), "logprobs", lp,
                                 "finish_reason"));
            c->sent_reasoning = rl;
        }
        if (cl > c->sent_content) {
            json_t *lp = json_null();
            if (j->rq.logprobs >= 0) {
                /* the content's tokens that begin in the content sent so far; the
                 * tokens before lp_sent are decided (sent, or not content) */
                size_t re, off, len;
                bool has;
                k3_chat_reply_spans_marked(c->text.p ? c->text.p : "", upto, &mk, j->rq.thinking, &re, &has, &off,
                                           &len);
                json_decref(lp);
                json_t *content = json_array();
                if (has) c->lp_sent = content_logprobs(j, c, c->lp_sent, lp_upto, off, len, content);
                lp = json_pack("{s:o}", "content", content);
                add_reasoning_logprobs(j, c, lp_upto, upto, lp);
            }
            send_chunk(j,
                       json_pack("[{s:i,s:{s:o},s:o,s:n}]", "index", i, "delta", "content",
                                 k3_srv_jstr(r.content + c->sent_content, cl - c->sent_content), "logprobs", lp,
                                 "finish_reason"));
            c->sent_content = cl;
        }
        /* tool calls as they are generated: a header per call, then its argument fragments */
        json_t *deltas = json_array();
        k3_status tst = deltas ? k3_srv_tool_deltas(&c->ts, &r, c->done ? NULL : &part, deltas, &err)
                               : k3_err(&err, K3_ERR_NOMEM, "out of memory");
        size_t k;
        json_t *v;
        json_array_foreach(deltas, k, v) {
            json_incref(v);
            send_chunk(j,
                       json_pack("[{s:i,s:{s:[o]},s:n,s:n}]", "index", i, "delta", "tool_calls", v, "logprobs",
                                 "finish_reason"));
        }
        json_decref(deltas);
        if (!c->done) k3_chat_partial_call_free(&part);
        tools = r.tool_calls_json && r.n_tool_calls > 0;
        k3_chat_reply_free(&r);
        if (tst) {
            stream_fail(j, c, "the model's tool calls cannot be streamed", err.msg);
            if (!c->done) k3_srv_job_cancel(j);
            return;
        }
        c->emitted = upto;
    }
    if (c->done) {
        const char *why = k3_srv_choice_error(c, "generation failed");
        if (why) k3_sse_error(&j->sse, k3_srv_choice_error_status(c), why);
        else
            send_chunk(j,
                       json_pack("[{s:i,s:{},s:o,s:s}]", "index", i, "delta", "logprobs", final_logprobs(j, c),
                                 "finish_reason", k3_srv_finish_reason(c, tools)));
        c->final_sent = true;
    }
}

static void stream_end(k3_srv_job *j) { k3_srv_openai_stream_end(j, CHUNK_OBJECT); }

static const k3_srv_api chat = {
    .fields = K3_API_CHAT,
    .id_prefix = "chatcmpl",
    .keep_specials = true,
    .default_max_tokens = -1,
    .prompt = chat_prompt,
    .hold = k3_srv_chat_hold,
    .answer = answer,
    .stream_choice = stream_choice,
    .stream_end = stream_end,
    .reasoning_tokens = reasoning_tokens,
};

enum MHD_Result k3_api_chat(struct k3_server *s, struct MHD_Connection *c, json_t *root) {
    return k3_srv_job_serve(s, c, root, &chat);
}
