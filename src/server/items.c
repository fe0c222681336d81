/*
 * items.c -- a chat reply as output items (items.h). The stream re-parses
 * the reply as chat's stream does (k3_chat_parse_reply_marked over the
 * sendable text, tool calls through k3_srv_tool_deltas) and turns the
 * growth of reasoning, content and calls into item events.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "server/api.h"
#include "server/items.h"

void k3_items_free(k3_items *it) {
    for (int i = 0; i < it->n; i++) free(it->v[i].name);
    free(it->v);
    *it = (k3_items){0};
}

static k3_item *push(k3_items *it, const k3_items_ops *ops, k3_item_kind kind, int call, const char *call_id,
                     const char *name, k3_error *err) {
    if (it->n == it->cap) {
        const int cap = it->cap ? it->cap * 2 : 4;
        k3_item *nv = realloc(it->v, sizeof *nv * (size_t)cap);
        if (!nv) {
            k3_err(err, K3_ERR_NOMEM, "out of memory for the output items");
            return NULL;
        }
        it->v = nv;
        it->cap = cap;
    }
    k3_item *x = &it->v[it->n];
    memset(x, 0, sizeof *x);
    x->kind = kind;
    x->call = call;
    char rnd[32];
    k3_chat_new_call_id(rnd); /* "call_" and 24 letters and digits */
    snprintf(x->id, sizeof x->id, "%s%s", ops->prefix[kind] ? ops->prefix[kind] : "", rnd + 5);
    if (call_id) snprintf(x->call_id, sizeof x->call_id, "%s", call_id);
    if (name && !(x->name = strdup(name))) {
        k3_err(err, K3_ERR_NOMEM, "out of memory for the output items");
        return NULL;
    }
    it->n++;
    return x;
}

json_t *k3_items_calls(const k3_chat_reply *r) {
    if (r && r->tool_calls_json && r->n_tool_calls > 0) return json_loads(r->tool_calls_json, 0, NULL);
    return json_array();
}

static const char *call_str(json_t *calls, int k, const char *key) {
    json_t *tc = json_array_get(calls, (size_t)k);
    if (!strcmp(key, "id")) return json_string_value(json_object_get(tc, "id"));
    return json_string_value(json_object_get(json_object_get(tc, "function"), key));
}

k3_status k3_items_of_reply(k3_items *it, const k3_items_ops *ops, const k3_chat_reply *r, k3_error *err) {
    if (r->reasoning && *r->reasoning && !push(it, ops, K3_ITEM_REASONING, 0, NULL, NULL, err)) return err->status;
    if (r->content && *r->content && !push(it, ops, K3_ITEM_TEXT, 0, NULL, NULL, err)) return err->status;
    json_t *calls = k3_items_calls(r);
    if (!calls) return k3_err(err, K3_ERR_NOMEM, "out of memory for the tool calls");
    for (size_t k = 0; k < json_array_size(calls); k++) {
        const char *id = call_str(calls, (int)k, "id"), *name = call_str(calls, (int)k, "name");
        if (!push(it, ops, K3_ITEM_CALL, (int)k, id, name ? name : "", err)) {
            json_decref(calls);
            return err->status;
        }
    }
    json_decref(calls);
    return K3_OK;
}

/* Closes the open item, if any. */
static void close_open(k3_srv_job *j, k3_items *it, const k3_items_ops *ops, const k3_chat_reply *r, json_t **calls,
                       bool last) {
    if (!it->open) return;
    it->open = false;
    if (!*calls) *calls = k3_items_calls(r);
    ops->close(j, &it->v[it->n - 1], it->n - 1, r, *calls, last);
}

/* The open item of kind (a new one when the open item is of another kind). */
static k3_item *ensure(k3_srv_job *j, k3_items *it, const k3_items_ops *ops, k3_item_kind kind, const k3_chat_reply *r,
                       json_t **calls, k3_error *err) {
    if (it->open && it->v[it->n - 1].kind == kind) return &it->v[it->n - 1];
    close_open(j, it, ops, r, calls, false);
    k3_item *x = push(it, ops, kind, 0, NULL, NULL, err);
    if (!x) return NULL;
    it->open = true;
    ops->open(j, x, it->n - 1);
    return x;
}

int k3_items_step(k3_srv_job *j, k3_srv_choice *c, k3_items *it, const k3_items_ops *ops, k3_chat_reply *final,
                  k3_error *err) {
    k3_srv_choice_advance(j, c);
    const size_t upto = k3_srv_choice_sendable(j, c);
    if (!(upto > c->emitted || c->done)) return 0;
    k3_chat_reply r;
    k3_chat_partial_call part;
    const k3_chat_text mk = k3_srv_choice_marks(c);
    if (k3_chat_parse_reply_marked(c->text.p ? c->text.p : "", upto, &mk, j->rq.thinking, &r, c->done ? NULL : &part,
                                   err))
        return c->done ? -1 : 0;
    json_t *calls = NULL, *deltas = NULL;
    int ret = 0;
    const size_t rl = r.reasoning ? strlen(r.reasoning) : 0, cl = r.content ? strlen(r.content) : 0;
    if (rl > c->sent_reasoning) {
        k3_item *x = ensure(j, it, ops, K3_ITEM_REASONING, &r, &calls, err);
        if (!x) goto fail;
        ops->delta(j, x, it->n - 1, r.reasoning + c->sent_reasoning, rl - c->sent_reasoning);
        c->sent_reasoning = rl;
    }
    if (cl > c->sent_content) {
        k3_item *x = ensure(j, it, ops, K3_ITEM_TEXT, &r, &calls, err);
        if (!x) goto fail;
        ops->delta(j, x, it->n - 1, r.content + c->sent_content, cl - c->sent_content);
        c->sent_content = cl;
    }
    /* tool calls as chat streams them: a header per call, then fragments */
    if (!(deltas = json_array())) {
        k3_err(err, K3_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (k3_srv_tool_deltas(&c->ts, &r, c->done ? NULL : &part, deltas, err)) goto fail;
    size_t k;
    json_t *d;
    json_array_foreach(deltas, k, d) {
        const int call = (int)json_integer_value(json_object_get(d, "index"));
        json_t *fn = json_object_get(d, "function");
        const char *id = json_string_value(json_object_get(d, "id"));
        if (id) {
            close_open(j, it, ops, &r, &calls, false);
            const char *name = json_string_value(json_object_get(fn, "name"));
            k3_item *x = push(it, ops, K3_ITEM_CALL, call, id, name ? name : "", err);
            if (!x) goto fail;
            it->open = true;
            ops->open(j, x, it->n - 1);
        }
        json_t *a = json_object_get(fn, "arguments");
        if (json_string_length(a) && it->open && it->v[it->n - 1].kind == K3_ITEM_CALL && it->v[it->n - 1].call == call)
            ops->delta(j, &it->v[it->n - 1], it->n - 1, json_string_value(a), json_string_length(a));
    }
    c->emitted = upto;
    if (c->done) {
        close_open(j, it, ops, &r, &calls, true);
        *final = r;
        ret = 1;
    }
    goto out;
fail:
    ret = -1;
out:
    json_decref(deltas);
    json_decref(calls);
    if (!c->done) k3_chat_partial_call_free(&part);
    if (ret != 1) k3_chat_reply_free(&r);
    return ret;
}

int64_t k3_items_reasoning_tokens(k3_srv_job *j, k3_srv_choice *c) {
    if (!j->rq.thinking) return 0;
    size_t re, off, len;
    bool has;
    const k3_chat_text mk = k3_srv_choice_marks(c);
    k3_chat_reply_spans_marked(c->text.p ? c->text.p : "", c->text.len, &mk, true, &re, &has, &off, &len);
    if (re >= c->text.len) return c->n_out; /* the think block never closed: all of it */
    /* the tokens that begin inside the think block, its closing tag included */
    int64_t n = 0;
    for (size_t i = 0; i < c->n_seen; i++) {
        size_t t0, t1;
        k3_srv_choice_token_span(c, i, &t0, &t1);
        n += t0 < re;
    }
    return n;
}
