/*
 * test_server_text.c -- the server's text pieces without HTTP: UTF-8
 * completeness and repair, the stop-string matcher across token boundaries,
 * and the Prometheus histogram text.
 */
#include "test.h"

#include <stdlib.h>
#include <string.h>

#include "server/api.h"
#include "server/metrics.h"
#include "server/text.h"

K3_TEST(server_utf8_complete_holds_partial_characters) {
    const char *e = "h\xC3\xA9"; /* hé */
    CHECK(k3_utf8_complete(e, 3) == 3);
    CHECK(k3_utf8_complete(e, 2) == 1); /* the first byte of é alone waits */
    const char *euro = "\xE2\x82\xAC";
    CHECK(k3_utf8_complete(euro, 1) == 0);
    CHECK(k3_utf8_complete(euro, 2) == 0);
    CHECK(k3_utf8_complete(euro, 3) == 3);
    const char *emoji = "a\xF0\x9F\x98\x80";
    for (size_t n = 2; n < 5; n++) CHECK(k3_utf8_complete(emoji, n) == 1);
    CHECK(k3_utf8_complete(emoji, 5) == 5);
    /* a byte that can never start a character is not held */
    CHECK(k3_utf8_complete("a\xFF", 2) == 2);
    CHECK(k3_utf8_complete("a\xE0\x80", 3) == 3); /* overlong start: invalid, not partial */
}

K3_TEST(server_utf8_valid_and_repair) {
    CHECK(k3_utf8_valid("abc \xC3\xA9", 6));
    CHECK(!k3_utf8_valid("a\xC3", 2));
    CHECK(!k3_utf8_valid("a\xED\xA0\x80", 4)); /* a surrogate */
    CHECK(!k3_utf8_valid("a\0b", 3));
    CHECK(!k3_utf8_valid("\xC0\xAF", 2)); /* overlong */
    size_t n;
    char *r = k3_utf8_repair("a\xFF"
                             "b\xE2\x82",
                             5, &n);
    REQUIRE(r);
    CHECK(!strcmp(r,
                  "a\xEF\xBF\xBD"
                  "b\xEF\xBF\xBD\xEF\xBF\xBD"));
    CHECK(n == strlen(r));
    CHECK(k3_utf8_valid(r, n));
    free(r);
}

static k3_stops make_stops(const char **s, int n) {
    k3_stops st = {calloc((size_t)n, sizeof(char *)), calloc((size_t)n, sizeof(size_t)), n};
    for (int i = 0; i < n; i++) {
        st.s[i] = strdup(s[i]);
        st.len[i] = strlen(s[i]);
    }
    return st;
}

K3_TEST(server_stop_strings_across_tokens) {
    const char *words[] = {"END", "\n\n"};
    k3_stops st = make_stops(words, 2);
    /* the text grows token by token: "foo E" "N" "D bar" */
    const char *steps[] = {"foo E", "foo EN", "foo END bar"};
    size_t sl = 0;
    CHECK(k3_stops_find(&st, steps[0], strlen(steps[0]), 0, &sl) == -1);
    CHECK(k3_stops_holdback(&st, steps[0], strlen(steps[0]), 0) == 1); /* "E" may begin END */
    CHECK(k3_stops_find(&st, steps[1], strlen(steps[1]), 0, &sl) == -1);
    CHECK(k3_stops_holdback(&st, steps[1], strlen(steps[1]), 0) == 2);
    CHECK(k3_stops_find(&st, steps[2], strlen(steps[2]), 0, &sl) == 4);
    CHECK(sl == 3);
    /* the earliest of two stops wins; search starts at from */
    CHECK(k3_stops_find(&st, "a\n\nEND", 6, 0, &sl) == 1 && sl == 2);
    CHECK(k3_stops_find(&st, "END x END", 9, 1, &sl) == 6);
    /* nothing held when the tail cannot begin a stop */
    CHECK(k3_stops_holdback(&st, "foo", 3, 0) == 0);
    CHECK(k3_stops_holdback(&st, "foo\n", 4, 0) == 1);
    /* held back only within the unsent part */
    CHECK(k3_stops_holdback(&st, "fooEN", 5, 3) == 2);
    CHECK(k3_stops_holdback(&st, "fooEN", 5, 4) == 0);
    k3_stops_free(&st);
    CHECK(k3_stops_find(NULL, "x", 1, 0, &sl) == -1);
}

K3_TEST(server_metrics_histogram_text) {
    k3_metrics m;
    k3_metrics_init(&m, 1000, 512);
    k3_metrics_observe(&m, K3_H_TTFT, 0.003);
    k3_metrics_observe(&m, K3_H_TTFT, 0.3);
    k3_metrics_observe(&m, K3_H_TTFT, 1e6);
    k3_metrics_observe(&m, K3_H_PROMPT_TOKENS, 7);
    k3_engine_stats st;
    memset(&st, 0, sizeof st);
    st.n_running = 3;
    st.prefix_queries = 100;
    st.prefix_hits = 64;
    st.n_snapshots = 5;
    for (int i = 0; i < 9; i++) k3_metrics_finished(&m, K3_FINISH_LENGTH);
    k3_metrics_finished(&m, K3_FINISH_CANCELLED);
    k3_buf b = {0};
    k3_metrics_render(&m, &st, "tiny", 64, &b);
    REQUIRE(b.p && !b.oom);
    CHECK(strstr(b.p, "vllm:num_requests_running{model_name=\"tiny\"} 3\n"));
    CHECK(strstr(b.p, "vllm:prefix_cache_hits_total{model_name=\"tiny\"} 64\n"));
    CHECK(strstr(b.p, "vllm:request_success_total{finished_reason=\"length\",model_name=\"tiny\"} 9\n"));
    CHECK(strstr(b.p, "vllm:request_success_total{finished_reason=\"abort\",model_name=\"tiny\"} 1\n"));
    CHECK(strstr(b.p, "vllm:request_success_total{finished_reason=\"stop\",model_name=\"tiny\"} 0\n"));
    CHECK(strstr(b.p, "k3:kda_snapshots{model_name=\"tiny\"} 5\n"));
    /* cumulative buckets: 0.003 is under le=0.005, 0.3 under le=0.5, 1e6 only in +Inf */
    CHECK(strstr(b.p, "vllm:time_to_first_token_seconds_bucket{le=\"0.001\",model_name=\"tiny\"} 0\n"));
    CHECK(strstr(b.p, "vllm:time_to_first_token_seconds_bucket{le=\"0.005\",model_name=\"tiny\"} 1\n"));
    CHECK(strstr(b.p, "vllm:time_to_first_token_seconds_bucket{le=\"0.5\",model_name=\"tiny\"} 2\n"));
    CHECK(strstr(b.p, "vllm:time_to_first_token_seconds_bucket{le=\"2560\",model_name=\"tiny\"} 2\n"));
    CHECK(strstr(b.p, "vllm:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"tiny\"} 3\n"));
    CHECK(strstr(b.p, "vllm:time_to_first_token_seconds_count{model_name=\"tiny\"} 3\n"));
    CHECK(strstr(b.p, "vllm:request_prompt_tokens_bucket{le=\"10\",model_name=\"tiny\"} 1\n"));
    CHECK(strstr(b.p, "vllm:request_prompt_tokens_bucket{le=\"5\",model_name=\"tiny\"} 0\n"));
    k3_buf_free(&b);
    k3_metrics_destroy(&m);
}

/* A reply the model could give, decoded with specials by name: the server's
 * message has the parsed tool calls (arguments as JSON strings) and says so;
 * a call whose argument is not what its type says is an error, not text. */
K3_TEST(server_chat_message_tool_calls) {
    const char *text = "Need a tool.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>"
                       "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
                       "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>"
                       "<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>"
                       "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";
    bool tools = false;
    k3_error err = {0};
    json_t *m = k3_srv_chat_message(text, strlen(text), NULL, true, &tools, &err);
    REQUIREF(m, "%s", err.msg);
    CHECK(tools);
    CHECK(!strcmp(json_string_value(json_object_get(m, "role")), "assistant"));
    CHECK(!strcmp(json_string_value(json_object_get(m, "reasoning_content")), "Need a tool."));
    json_t *tc = json_object_get(m, "tool_calls");
    REQUIRE(json_array_size(tc) == 1);
    json_t *f = json_object_get(json_array_get(tc, 0), "function");
    CHECK(!strcmp(json_string_value(json_object_get(f, "name")), "get_weather"));
    json_t *args = json_loads(json_string_value(json_object_get(f, "arguments")), 0, NULL);
    CHECK(args && !strcmp(json_string_value(json_object_get(args, "city")), "Paris") &&
          json_number_value(json_object_get(args, "days")) == 3);
    json_decref(args);
    json_decref(m);

    /* a number argument that is not a number */
    char *broken = strdup(text);
    REQUIRE(broken);
    char *p = strstr(broken, "<|sep|>3<|close|>");
    REQUIRE(p);
    p[7] = 'x';
    m = k3_srv_chat_message(broken, strlen(broken), NULL, true, &tools, &err);
    CHECK(m == NULL && err.status == K3_ERR_FORMAT && strstr(err.msg, "days"));
    json_decref(m);
    free(broken);

    /* plain text, thinking off */
    const char *plain = "Hello there.<|close|>response<|sep|><|close|>message<|sep|>";
    m = k3_srv_chat_message(plain, strlen(plain), NULL, false, &tools, &err);
    REQUIRE(m);
    CHECK(!tools && !strcmp(json_string_value(json_object_get(m, "content")), "Hello there."));
    CHECK(json_object_get(m, "tool_calls") == NULL);
    json_decref(m);
}

/* A chat reply streamed the way the server cuts it (never inside a special
 * marker or a UTF-8 character, an undecided tag held back): the tool-call
 * deltas, accumulated as the openai client does (by index: id, type and
 * name from the first, the arguments concatenated), equal the tool calls
 * of the whole reply; the arguments arrive in pieces, not at the end. */
K3_TEST(server_tool_calls_stream_incrementally) {
    const char *text_lit = "Two tools.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>"
                           "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
                           "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris, \"la "
                           "ville\"\nlumi\xC3\xA8re<|close|>argument<|sep|>"
                           "<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>"
                           "<|close|>call<|sep|>"
                           "<|open|>call tool=\"lookup\" index=\"2\"<|sep|>"
                           "<|open|>json type=\"object\"<|sep|>{\"q\":[1,2],\"deep\":{\"x\":null}}<|close|>json<|sep|>"
                           "<|close|>call<|sep|>"
                           "<|open|>call tool=\"noargs\" index=\"3\"<|sep|><|close|>call<|sep|>"
                           "<|close|>tools<|sep|><|close|>message<|sep|>";
    char *text = strdup(text_lit); /* on the heap: the cut loop below reads it by index */
    REQUIRE(text);
    const size_t len = strlen(text);
    k3_tool_stream ts = {0};
    char ids[4][32] = {{0}}, names[4][32] = {{0}};
    k3_buf args[4] = {{0}};
    int n_calls = 0, n_frag0 = 0, bad_entries = 0, frag0_before_close = 0;
    size_t last = (size_t)-1;
    const char *close0 = strstr(text, "<|close|>call<|sep|>");
    for (size_t cut = 0; cut <= len; cut++) {
        const bool done = cut == len;
        /* not inside a marker <|...|> nor a UTF-8 character */
        bool inside = false;
        for (size_t back = 1; back <= cut && back < 12; back++) {
            const size_t b = cut - back;
            if (text[b] == '>') break;
            if (text[b] == '<' && b + 1 < len && text[b + 1] == '|') {
                const char *e = strstr(text + b, "|>");
                inside = e && (size_t)(e - text) + 2 > cut;
                break;
            }
        }
        if (inside || (cut < len && ((unsigned char)text[cut] & 0xC0) == 0x80)) continue;
        const size_t upto = done ? len : k3_srv_chat_hold(text, 0, cut);
        if (upto == last) continue;
        last = upto;
        k3_chat_reply r;
        k3_chat_partial_call part;
        k3_error err = {0};
        REQUIREF(k3_chat_parse_reply_partial(text, upto, true, &r, done ? NULL : &part, &err) == K3_OK, "at %zu: %s",
                 upto, err.msg);
        json_t *d = json_array();
        REQUIREF(k3_srv_tool_deltas(&ts, &r, done ? NULL : &part, d, &err) == K3_OK, "at %zu: %s", upto, err.msg);
        size_t k;
        json_t *v;
        json_array_foreach(d, k, v) {
            const int idx = (int)json_integer_value(json_object_get(v, "index"));
            json_t *f = json_object_get(v, "function");
            if (idx < 0 || idx > 3 || !f) {
                bad_entries++;
                continue;
            }
            if (json_object_get(v, "id")) {
                /* the first delta of a call: index, id, type, name, arguments "" */
                if (idx != n_calls || strcmp(json_string_value(json_object_get(v, "type")), "function") ||
                    strcmp(json_string_value(json_object_get(f, "arguments")), ""))
                    bad_entries++;
                snprintf(ids[idx], sizeof ids[idx], "%s", json_string_value(json_object_get(v, "id")));
                snprintf(names[idx], sizeof names[idx], "%s", json_string_value(json_object_get(f, "name")));
                n_calls++;
            } else {
                if (json_object_get(f, "name")) bad_entries++;
                const char *a = json_string_value(json_object_get(f, "arguments"));
                k3_buf_add(&args[idx], a, strlen(a));
                if (idx == 0) {
                    n_frag0++;
                    frag0_before_close += upto <= (size_t)(close0 - text);
                }
            }
        }
        json_decref(d);
        if (!done) k3_chat_partial_call_free(&part);
        k3_chat_reply_free(&r);
    }
    printf("    3 tool calls streamed: call 1's arguments in %d fragments, %d of them before the call closed\n",
           n_frag0, frag0_before_close);
    CHECK(bad_entries == 0);
    CHECKF(n_calls == 3, "%d calls streamed", n_calls);
    CHECKF(n_frag0 >= 10 && frag0_before_close >= 10, "call 1's arguments came in %d fragments (%d before it closed)",
           n_frag0, frag0_before_close);
    /* the whole reply, not streamed */
    bool tools = false;
    k3_error err = {0};
    json_t *m = k3_srv_chat_message(text, len, NULL, true, &tools, &err);
    REQUIREF(m, "%s", err.msg);
    json_t *tc = json_object_get(m, "tool_calls");
    CHECK(tools && json_array_size(tc) == 3);
    for (int i = 0; i < 3 && i < (int)json_array_size(tc); i++) {
        json_t *f = json_object_get(json_array_get(tc, i), "function");
        const char *want = json_string_value(json_object_get(f, "arguments"));
        k3_buf_add(&args[i], "", 0);
        CHECKF(!strcmp(names[i], json_string_value(json_object_get(f, "name"))), "call %d name %s", i, names[i]);
        CHECKF(args[i].p && !strcmp(args[i].p, want), "call %d: streamed %s, whole %s", i, args[i].p, want);
        CHECK(!strncmp(ids[i], "call_", 5) && strlen(ids[i]) == 29);
    }
    CHECK(strcmp(ids[0], ids[1]) && strcmp(ids[1], ids[2]));
    json_decref(m);
    for (int i = 0; i < 4; i++) k3_buf_free(&args[i]);
    k3_tool_stream_free(&ts);
    free(text);

    /* what was sent must stay a prefix: a call whose arguments changed is an error */
    k3_tool_stream t2 = {0};
    k3_chat_reply r = {.tool_calls_json = "[{\"id\":\"x\",\"type\":\"function\",\"function\":{\"name\":\"f\","
                                          "\"arguments\":\"{\\\"a\\\": 1}\"}}]",
                       .n_tool_calls = 1};
    json_t *d = json_array();
    CHECK(k3_srv_tool_deltas(&t2, &r, NULL, d, &err) == K3_OK && json_array_size(d) == 2);
    json_decref(d);
    r.tool_calls_json =
        "[{\"id\":\"x\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"b\\\": 1}\"}}]";
    d = json_array();
    CHECK(k3_srv_tool_deltas(&t2, &r, NULL, d, &err) == K3_ERR_FORMAT && strstr(err.msg, "prefix"));
    json_decref(d);
    k3_tool_stream_free(&t2);
}

/* The generation job's text: specials left out, or by name with a space on
 * each side (Hugging Face's " ".join of the pieces between them); the chat
 * markup kept by name for the parser, never spaced; the stop token only
 * with include_stop_str_in_output; each token's place in the text. */
static void decode_case(const k3_tokenizer *tok, bool chat, bool skip, bool spaces, bool include_stop,
                        const int32_t *ids, int n, const char *want, const size_t *ends) {
    struct k3_server srv;
    memset(&srv, 0, sizeof srv);
    srv.tok = tok;
    k3_srv_api api = {.keep_specials = chat};
    static k3_srv_job j;
    memset(&j, 0, sizeof j);
    j.s = &srv;
    j.api = &api;
    j.rq.skip_special_tokens = skip;
    j.rq.spaces_between_special_tokens = spaces;
    j.rq.include_stop_str = include_stop;
    j.markup[0] = k3_tokenizer_special(tok, "<|open|>");
    j.markup[1] = k3_tokenizer_special(tok, "<|close|>");
    j.markup[2] = k3_tokenizer_special(tok, "<|sep|>");
    k3_srv_choice c;
    memset(&c, 0, sizeof c);
    c.q.toks = (int32_t *)ids;
    c.q.n_tok = (size_t)n;
    c.q.finished = true;
    c.q.finish = K3_FINISH_STOP;
    c.q.stop_id = ids[n - 1];
    k3_srv_choice_advance(&j, &c);
    const char *got = c.text.p ? c.text.p : "";
    CHECKF(c.done && c.text.len == strlen(want) && !memcmp(got, want, c.text.len),
           "chat %d skip %d spaces %d include %d: \"%s\", wanted \"%s\"", chat, skip, spaces, include_stop, got, want);
    for (int i = 0; ends && i < n; i++) {
        size_t a, b;
        k3_srv_choice_token_span(&c, (size_t)i, &a, &b);
        CHECKF(b == ends[i] && a == (i ? ends[i - 1] : 0), "token %d ends at %zu, wanted %zu", i, b, ends[i]);
    }
    k3_buf_free(&c.text);
    free(c.tok_end);
    free(c.marks);
}

K3_TEST(server_job_text_specials_and_spans) {
    k3_tokenizer *tok = NULL;
    k3_error err = {0};
    REQUIREF(k3_tokenizer_open(&tok, "models/k3-mini", &err) == K3_OK, "%s", err.msg);
    int32_t *the = NULL, *and = NULL, *r = NULL;
    size_t n1 = 0, n2 = 0, nr = 0;
    REQUIRE(k3_tokenizer_encode(tok, "The", 3, &the, &n1, &err) == K3_OK && n1 == 1);
    REQUIRE(k3_tokenizer_encode(tok, " and", 4, &and, &n2, &err) == K3_OK && n2 == 1);
    REQUIRE(k3_tokenizer_encode(tok, "response", 8, &r, &nr, &err) == K3_OK && nr == 2);
    const int32_t bos = k3_tokenizer_special(tok, "[BOS]"), eos = k3_tokenizer_special(tok, "[EOS]");
    const int32_t open = k3_tokenizer_special(tok, "<|open|>"), sep = k3_tokenizer_special(tok, "<|sep|>");
    /* The [BOS] [BOS] and [EOS]: the last one stopped it */
    const int32_t a[] = {the[0], bos, bos, and[0], eos};
    const size_t ends_skip[] = {3, 3, 3, 7, 7}, ends_keep[] = {3, 9, 15, 20, 20};
    decode_case(tok, false, true, true, false, a, 5, "The and", ends_skip);
    decode_case(tok, false, false, true, false, a, 5, "The [BOS] [BOS]  and", ends_keep);
    decode_case(tok, false, false, false, false, a, 5, "The[BOS][BOS] and", NULL);
    decode_case(tok, false, false, false, true, a, 5, "The[BOS][BOS] and[EOS]", NULL);
    decode_case(tok, false, false, true, true, a, 5, "The [BOS] [BOS]  and [EOS]", NULL);
    decode_case(tok, false, true, true, true, a, 5, "The and", NULL); /* included, but a special: skipped */
    /* chat: <|open|>response<|sep|> by name whatever the options; [BOS] after the markup has no space before it */
    const int32_t b[] = {open, r[0], r[1], sep, bos, the[0], eos};
    decode_case(tok, true, true, true, false, b, 7, "<|open|>response<|sep|>The", NULL);
    decode_case(tok, true, false, true, false, b, 7, "<|open|>response<|sep|>[BOS] The", NULL);
    decode_case(tok, true, false, false, false, b, 7, "<|open|>response<|sep|>[BOS]The", NULL);
    free(the);
    free(and);
    free(r);
    k3_tokenizer_free(tok);
}
