/*
 * test_server_items.c -- the pieces of the Responses and Anthropic surfaces
 * that need no model: a K3 reply with reasoning, text and two tool calls
 * fed byte by byte through the stream's item machine (items.c) opens,
 * grows and closes its items in order, the growth adds up to what the
 * whole reply parses to, and the whole answer has the same items; and the
 * Responses store keeps its count and byte bounds, least recently used out
 * first.
 */
#include "test.h"

#include <stdlib.h>
#include <string.h>

#include "server/api.h"
#include "server/items.h"
#include "server/store.h"

#define MAX_EV 16

typedef struct rec {
    int n_open, n_close, last_closed;
    k3_item_kind kind[MAX_EV];
    char name[MAX_EV][32];
    char text[MAX_EV][256];   /* the deltas of each item, joined */
    char closed[MAX_EV][256]; /* each item's whole text (or arguments) at its close */
    int last_flags;
} rec;

static rec g_rec;

static void on_open(k3_srv_job *j, const k3_item *it, int i) {
    if (i >= MAX_EV) return;
    g_rec.kind[i] = it->kind;
    snprintf(g_rec.name[i], sizeof g_rec.name[i], "%s", it->name ? it->name : "");
    g_rec.n_open++;
}

static void on_delta(k3_srv_job *j, const k3_item *it, int i, const char *p, size_t n) {
    if (i >= MAX_EV) return;
    strncat(g_rec.text[i], p, n);
}

static void on_close(k3_srv_job *j, const k3_item *it, int i, const k3_chat_reply *r, json_t *calls, bool last) {
    if (i >= MAX_EV) return;
    const char *t = it->kind == K3_ITEM_REASONING ? r->reasoning
        : it->kind == K3_ITEM_TEXT
        ? r->content
        : json_string_value(
              json_object_get(json_object_get(json_array_get(calls, (size_t)it->call), "function"), "arguments"));
    snprintf(g_rec.closed[i], sizeof g_rec.closed[i], "%s", t ? t : "");
    g_rec.n_close++;
    if (last) g_rec.last_flags++, g_rec.last_closed = i;
}

static const k3_items_ops ops = {.prefix = {"rs_", "msg_", "fc_"},
                                 .open = on_open,
                                 .delta = on_delta,
                                 .close = on_close};

static const char REPLY[] =
    "Let me see.<|close|>think<|sep|><|open|>response<|sep|>Sure, two calls.<|close|>response<|sep|>"
    "<|open|>tools<|sep|>"
    "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
    "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|>"
    "<|open|>call tool=\"add\" index=\"2\"<|sep|>"
    "<|open|>argument key=\"a\" type=\"number\"<|sep|>2<|close|>argument<|sep|>"
    "<|open|>argument key=\"b\" type=\"number\"<|sep|>40<|close|>argument<|sep|><|close|>call<|sep|>"
    "<|close|>tools<|sep|><|close|>message<|sep|>";

static const k3_srv_api fake_api = {.keep_specials = true, .hold = k3_srv_chat_hold};

K3_TEST(server_items_stream_in_order_and_whole) {
    memset(&g_rec, 0, sizeof g_rec);
    k3_srv_job j;
    memset(&j, 0, sizeof j);
    k3_srv_choice c;
    memset(&c, 0, sizeof c);
    j.api = &fake_api;
    j.rq.thinking = true;
    j.n = 1;
    j.ch = &c;
    c.job = &j;
    k3_items it = {0};
    k3_chat_reply final;
    k3_error err = {0};
    const size_t n = strlen(REPLY);
    int ended = 0;
    /* a byte at a time, a special token whole (as the tokenizer decodes them) */
    for (size_t len = 0; len <= n && !ended;) {
        c.text.len = 0;
        k3_buf_add(&c.text, REPLY, len);
        if (len == n) c.q.finished = true; /* no tokens: the text is the reply, whole */
        ended = k3_items_step(&j, &c, &it, &ops, &final, &err);
        REQUIREF(ended >= 0, "step at %zu: %s", len, err.msg);
        if (len < n && !strncmp(REPLY + len, "<|", 2)) len = (size_t)(strstr(REPLY + len, "|>") + 2 - REPLY);
        else len++;
    }
    REQUIRE(ended == 1);
    REQUIRE(it.n == 4 && g_rec.n_open == 4 && g_rec.n_close == 4);
    CHECK(g_rec.kind[0] == K3_ITEM_REASONING && g_rec.kind[1] == K3_ITEM_TEXT && g_rec.kind[2] == K3_ITEM_CALL &&
          g_rec.kind[3] == K3_ITEM_CALL);
    CHECK(!strcmp(g_rec.name[2], "get_weather") && !strcmp(g_rec.name[3], "add"));
    CHECK(g_rec.last_flags == 1 && g_rec.last_closed == 3);
    /* what streamed adds up to what closed, which is the whole reply's */
    CHECKF(!strcmp(g_rec.text[0], "Let me see.") && !strcmp(g_rec.closed[0], g_rec.text[0]), "%s", g_rec.text[0]);
    CHECKF(!strcmp(g_rec.text[1], "Sure, two calls.") && !strcmp(g_rec.closed[1], g_rec.text[1]), "%s", g_rec.text[1]);
    CHECKF(!strcmp(g_rec.text[2], "{\"city\": \"Paris\"}") && !strcmp(g_rec.closed[2], g_rec.text[2]), "%s",
           g_rec.text[2]);
    CHECKF(!strcmp(g_rec.text[3], "{\"a\": 2, \"b\": 40}") && !strcmp(g_rec.closed[3], g_rec.text[3]), "%s",
           g_rec.text[3]);
    CHECK(!strncmp(it.v[0].id, "rs_", 3) && !strncmp(it.v[1].id, "msg_", 4) && !strncmp(it.v[2].id, "fc_", 3));
    CHECK(!strncmp(it.v[2].call_id, "call_", 5) && strcmp(it.v[2].call_id, it.v[3].call_id));
    /* the whole answer: the same items from the parsed reply */
    k3_items whole = {0};
    REQUIRE(k3_items_of_reply(&whole, &ops, &final, &err) == K3_OK);
    REQUIRE(whole.n == it.n);
    for (int i = 0; i < whole.n; i++) {
        CHECK(whole.v[i].kind == it.v[i].kind && whole.v[i].call == it.v[i].call);
        CHECK(!whole.v[i].name == !it.v[i].name && (!whole.v[i].name || !strcmp(whole.v[i].name, it.v[i].name)));
    }
    k3_items_free(&whole);
    k3_chat_reply_free(&final);
    k3_items_free(&it);
    k3_tool_stream_free(&c.ts);
    k3_buf_free(&c.text);
}

K3_TEST(server_items_cut_off_reply) {
    /* max_tokens inside the text: one item, closed as the last */
    memset(&g_rec, 0, sizeof g_rec);
    k3_srv_job j;
    memset(&j, 0, sizeof j);
    k3_srv_choice c;
    memset(&c, 0, sizeof c);
    j.api = &fake_api;
    j.rq.thinking = false;
    j.n = 1;
    j.ch = &c;
    k3_items it = {0};
    k3_chat_reply final;
    k3_error err = {0};
    k3_buf_add(&c.text, "Half a sen", 10);
    CHECK(k3_items_step(&j, &c, &it, &ops, &final, &err) == 0);
    k3_buf_add(&c.text, "tence", 5);
    c.q.finished = true;
    REQUIRE(k3_items_step(&j, &c, &it, &ops, &final, &err) == 1);
    CHECK(it.n == 1 && g_rec.kind[0] == K3_ITEM_TEXT && !strcmp(g_rec.text[0], "Half a sentence"));
    CHECK(g_rec.last_flags == 1 && g_rec.n_close == 1);
    k3_chat_reply_free(&final);
    k3_items_free(&it);
    k3_tool_stream_free(&c.ts);
    k3_buf_free(&c.text);
}

K3_TEST(server_responses_store_bounds_lru) {
    k3_srv_store *st = k3_srv_store_new(3, 100);
    REQUIRE(st);
    char *r = NULL, *h = NULL;
    CHECK(k3_srv_store_put(st, "a", "ra", 2, "ha", 2));
    CHECK(k3_srv_store_put(st, "b", "rb", 2, "hb", 2));
    CHECK(k3_srv_store_put(st, "c", "rc", 2, "hc", 2));
    CHECK(k3_srv_store_get(st, "a", &r, &h) && !strcmp(r, "ra") && !strcmp(h, "ha")); /* a is the most recent now */
    free(r);
    free(h);
    CHECK(k3_srv_store_put(st, "d", "rd", 2, "hd", 2)); /* over the count: b, the least recent, goes */
    CHECK(!k3_srv_store_get(st, "b", NULL, NULL));
    CHECK(k3_srv_store_get(st, "a", NULL, NULL) && k3_srv_store_get(st, "c", NULL, NULL));
    size_t n = 0, bytes = 0;
    k3_srv_store_usage(st, &n, &bytes);
    CHECK(n == 3 && bytes == 15);
    /* over the bytes: entries go, least recent first, until the new one fits */
    char big[80];
    memset(big, 'x', sizeof big);
    CHECK(k3_srv_store_put(st, "e", big, 60, "", 0)); /* 61 + 10 (a, c) fit; d (5) ... */
    k3_srv_store_usage(st, &n, &bytes);
    CHECK(bytes <= 100 && k3_srv_store_get(st, "e", NULL, NULL));
    CHECK(!k3_srv_store_put(st, "huge", big, 80, big, 80)); /* alone over the bound: not kept */
    CHECK(!k3_srv_store_get(st, "huge", NULL, NULL));
    /* the same id replaces its entry */
    CHECK(k3_srv_store_put(st, "e", "new", 3, "h", 1));
    CHECK(k3_srv_store_get(st, "e", &r, NULL) && !strcmp(r, "new"));
    free(r);
    CHECK(k3_srv_store_delete(st, "e") && !k3_srv_store_delete(st, "e") && !k3_srv_store_get(st, "e", NULL, NULL));
    k3_srv_store_free(st);
}

K3_TEST(server_reasoning_effort_map) {
    bool on = false;
    const char *eff = "x";
    k3_error err = {0};
    /* chat's table (k3_chat_reasoning_effort): none given is thinking on at "max" */
    CHECK(k3_srv_reasoning_effort("f", NULL, &on, &eff, &err) == K3_OK && on && !strcmp(eff, "max"));
    CHECK(k3_srv_reasoning_effort("f", "none", &on, &eff, &err) == K3_OK && !on && !eff);
    CHECK(k3_srv_reasoning_effort("f", "minimal", &on, &eff, &err) == K3_OK && on && !strcmp(eff, "low"));
    CHECK(k3_srv_reasoning_effort("f", "medium", &on, &eff, &err) == K3_OK && on && !strcmp(eff, "high"));
    CHECK(k3_srv_reasoning_effort("f", "high", &on, &eff, &err) == K3_OK && on && !strcmp(eff, "high"));
    CHECK(k3_srv_reasoning_effort("f", "xhigh", &on, &eff, &err) == K3_OK && on && !strcmp(eff, "max"));
    CHECK(k3_srv_reasoning_effort("reasoning.effort", "extreme", &on, &eff, &err) == K3_ERR_ARG &&
          strstr(err.msg, "reasoning.effort"));
}
