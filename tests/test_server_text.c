/*
 * test_server_text.c -- the server's text pieces without HTTP: UTF-8
 * completeness and repair, the stop-string matcher across token boundaries,
 * and the Prometheus histogram text.
 */
#include "test.h"

#include <stdlib.h>
#include <string.h>

#include "server/gen.h"
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
    char *r = k3_utf8_repair("a\xFF" "b\xE2\x82", 5, &n);
    REQUIRE(r);
    CHECK(!strcmp(r, "a\xEF\xBF\xBD" "b\xEF\xBF\xBD\xEF\xBF\xBD"));
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
    const char *text =
        "Need a tool.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>"
        "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
        "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>"
        "<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>"
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";
    bool tools = false;
    k3_error err = {0};
    json_t *m = k3_srv_chat_message(text, strlen(text), true, &tools, &err);
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
    m = k3_srv_chat_message(broken, strlen(broken), true, &tools, &err);
    CHECK(m == NULL && err.status == K3_ERR_FORMAT && strstr(err.msg, "days"));
    json_decref(m);
    free(broken);

    /* plain text, thinking off */
    const char *plain = "Hello there.<|close|>response<|sep|><|close|>message<|sep|>";
    m = k3_srv_chat_message(plain, strlen(plain), false, &tools, &err);
    REQUIRE(m);
    CHECK(!tools && !strcmp(json_string_value(json_object_get(m, "content")), "Hello there."));
    CHECK(json_object_get(m, "tool_calls") == NULL);
    json_decref(m);
}
