/* test_chat_json.c -- k3_chat_encode_json against Moonshot's own encoder
 * (tests/golden/chat/cases.json: tools/official_chat_goldens.py runs the
 * official tokenizer's apply_chat_template over models/k3-mini's vocabulary),
 * k3_chat_parse_reply against the official rendering of assistant turns
 * (replies.json), and Python's float repr (floats.txt). */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "k3.h"
#include "tokenizer/reasoning.h"
#include "test.h"
#include "tokenizer/chat_json.h"

#define GOLDEN "tests/golden/chat/"

static const char *str_or_null(json_t *o, const char *key) { return json_string_value(json_object_get(o, key)); }

K3_TEST(chat_json_equals_official_encoder) {
    k3_tokenizer *t = NULL;
    k3_error err = {0};
    REQUIREF(k3_tokenizer_open(&t, "models/k3-mini", &err) == K3_OK, "%s", err.msg);
    json_error_t je;
    json_t *cases = json_load_file(GOLDEN "cases.json", 0, &je);
    REQUIREF(json_is_array(cases) && json_array_size(cases) >= 20, "cases.json: %s", je.text);
    size_t i;
    json_t *c;
    int n_ok = 0, n_err = 0;
    json_array_foreach(cases, i, c) {
        const char *name = str_or_null(c, "name");
        k3_chat_options opt = {
            .add_generation_prompt = json_is_true(json_object_get(c, "add_generation_prompt")),
            .thinking = json_is_true(json_object_get(c, "thinking")),
            .thinking_effort = str_or_null(c, "thinking_effort"),
            .tool_choice = str_or_null(c, "tool_choice"),
            .response_format = str_or_null(c, "response_format"),
        };
        int32_t *ids = NULL;
        size_t n = 0;
        k3_error e = {0};
        k3_status st = k3_chat_encode_json(t, str_or_null(c, "messages"), str_or_null(c, "tools"), &opt, &ids, &n, &e);
        if (json_is_true(json_object_get(c, "error"))) {
            CHECKF(st == K3_ERR_ARG && e.msg[0], "%s: expected K3_ERR_ARG, got %d", name, st);
            n_err++;
            continue;
        }
        json_t *want = json_object_get(c, "ids");
        CHECKF(st == K3_OK, "%s: %s", name, e.msg);
        if (st != K3_OK) continue;
        size_t nw = json_array_size(want), k = 0;
        while (k < n && k < nw && ids[k] == json_integer_value(json_array_get(want, k))) k++;
        CHECKF(n == nw && k == n, "%s: %zu ids, official %zu, first difference at %zu (%d vs %d)", name, n, nw, k,
               k < n ? ids[k] : -1, k < nw ? (int)json_integer_value(json_array_get(want, k)) : -1);
        if (n == nw && k == n) n_ok++;
        free(ids);
    }
    CHECK(n_err == 3);
    CHECK(n_ok + n_err == (int)json_array_size(cases));
    json_decref(cases);
    k3_tokenizer_free(t);
}

static bool same(const char *a, const char *b) { return (!a && !b) || (a && b && !strcmp(a, b)); }

K3_TEST(chat_reply_parses_official_rendering) {
    json_error_t je;
    json_t *cases = json_load_file(GOLDEN "replies.json", 0, &je);
    REQUIREF(json_is_array(cases) && json_array_size(cases) == 5, "replies.json: %s", je.text);
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c) {
        const char *name = str_or_null(c, "name"), *text = str_or_null(c, "text");
        json_t *calls = json_object_get(c, "tool_calls");
        bool want_error = false;
        for (size_t k = 0; k < json_array_size(calls); k++)
            want_error |= json_is_null(json_object_get(json_array_get(calls, k), "arguments"));
        k3_chat_reply r;
        k3_error e = {0};
        k3_status st = k3_chat_parse_reply(text, strlen(text), json_is_true(json_object_get(c, "thinking")), &r, &e);
        if (want_error) {
            CHECKF(st == K3_ERR_FORMAT && e.msg[0], "%s: expected K3_ERR_FORMAT, got %d", name, st);
            CHECK(!r.content && !r.tool_calls_json && !r.reasoning);
            continue;
        }
        REQUIREF(st == K3_OK, "%s: %s", name, e.msg);
        CHECKF(same(r.reasoning, str_or_null(c, "reasoning")), "%s: reasoning %s", name,
               r.reasoning ? r.reasoning : "(null)");
        CHECKF(same(r.content, str_or_null(c, "content")), "%s: content %s", name, r.content ? r.content : "(null)");
        CHECKF(r.n_tool_calls == (int32_t)json_array_size(calls), "%s: %d calls", name, r.n_tool_calls);
        if (json_array_size(calls)) {
            json_t *got = json_loads(r.tool_calls_json, 0, &je);
            REQUIREF(json_is_array(got), "%s: tool_calls_json %s", name, r.tool_calls_json);
            for (size_t k = 0; k < json_array_size(calls) && k < json_array_size(got); k++) {
                json_t *g = json_array_get(got, k), *w = json_array_get(calls, k);
                json_t *fn = json_object_get(g, "function");
                const char *id = str_or_null(g, "id");
                CHECKF(id && !strncmp(id, "call_", 5) && strlen(id) == 29, "%s: id %s", name, id);
                CHECK(same(str_or_null(g, "type"), "function"));
                CHECK(same(str_or_null(fn, "name"), str_or_null(w, "name")));
                CHECKF(same(str_or_null(fn, "arguments"), str_or_null(w, "arguments")), "%s: arguments %s, official %s",
                       name, str_or_null(fn, "arguments"), str_or_null(w, "arguments"));
            }
            if (json_array_size(got) == 2) {
                const char *a = str_or_null(json_array_get(got, 0), "id");
                const char *b = str_or_null(json_array_get(got, 1), "id");
                CHECK(a && b && strcmp(a, b));
            }
            json_decref(got);
        } else {
            CHECK(!r.tool_calls_json);
        }
        /* the parsed turn, sent back as an assistant message, renders to the
         * same ids as the message the official renderer started from */
        {
            json_t *orig = json_loads(str_or_null(c, "message"), 0, &je);
            json_t *back = json_object();
            json_object_set_new(back, "role", json_string("assistant"));
            if (r.reasoning) json_object_set_new(back, "reasoning_content", json_string(r.reasoning));
            json_object_set_new(back, "content", r.content ? json_string(r.content) : json_null());
            if (r.tool_calls_json) json_object_set_new(back, "tool_calls", json_loads(r.tool_calls_json, 0, &je));
            k3_tokenizer *t = NULL;
            k3_error te = {0};
            REQUIREF(orig && k3_tokenizer_open(&t, "models/k3-mini", &te) == K3_OK, "%s", te.msg);
            int32_t *ids[2] = {NULL, NULL};
            size_t n_ids[2] = {0, 0};
            k3_chat_options opt = {.thinking = json_is_true(json_object_get(c, "thinking"))};
            json_t *msgs[2] = {orig, back};
            for (int k = 0; k < 2; k++) {
                json_t *conv = json_pack("[{s:s, s:s}, O]", "role", "user", "content", "q", msgs[k]);
                char *js = json_dumps(conv, 0);
                CHECKF(k3_chat_encode_json(t, js, NULL, &opt, &ids[k], &n_ids[k], &te) == K3_OK, "%s: %s", name,
                       te.msg);
                free(js);
                json_decref(conv);
            }
            CHECKF(n_ids[0] == n_ids[1] && n_ids[0] && !memcmp(ids[0], ids[1], n_ids[0] * sizeof(int32_t)),
                   "%s: the parsed turn renders to other ids (%zu vs %zu)", name, n_ids[1], n_ids[0]);
            free(ids[0]);
            free(ids[1]);
            json_decref(orig);
            json_decref(back);
            k3_tokenizer_free(t);
        }
        /* every prefix (a reply cut off by max_tokens) parses, and never
         * yields more than the whole */
        for (size_t cut = 0; cut < strlen(text); cut++) {
            k3_chat_reply p;
            k3_error pe = {0};
            k3_status ps = k3_chat_parse_reply(text, cut, json_is_true(json_object_get(c, "thinking")), &p, &pe);
            CHECKF(ps == K3_OK && p.n_tool_calls <= r.n_tool_calls, "%s cut at %zu: %s", name, cut, pe.msg);
            k3_chat_reply_free(&p);
        }
        k3_chat_reply_free(&r);
    }
    json_decref(cases);
}

K3_TEST(chat_reply_rejects_bad_arguments) {
    static const struct {
        const char *text;
        k3_status st;
    } cases[] = {
        {"<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"n\" "
         "type=\"number\"<|sep|>twelve<|close|>argument<|sep|><|close|>call<|sep|>",
         K3_ERR_FORMAT},
        {"<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"n\" "
         "type=\"object\"<|sep|>[1]<|close|>argument<|sep|><|close|>call<|sep|>",
         K3_ERR_FORMAT},
        {"<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"n\" "
         "type=\"boolean\"<|sep|>yes<|close|>argument<|sep|><|close|>call<|sep|>",
         K3_ERR_FORMAT},
        {"<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"n\" "
         "type=\"integer\"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>",
         K3_ERR_FORMAT},
        {"<|open|>tools<|sep|><|open|>call index=\"1\"<|sep|><|close|>call<|sep|>", K3_ERR_FORMAT},
        {"<|open|>tools<|sep|>garbage", K3_ERR_FORMAT},
        /* an incomplete value is a cut, not an error */
        {"<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"n\" "
         "type=\"number\"<|sep|>1",
         K3_OK},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char text[512];
        snprintf(text, sizeof text, "ok<|close|>response<|sep|>%s", cases[i].text);
        k3_chat_reply r;
        k3_error e = {0};
        k3_status st = k3_chat_parse_reply(text, strlen(text), false, &r, &e);
        CHECKF(st == cases[i].st, "case %zu: status %d (%s)", i, st, e.msg);
        /* the cut call stays, its arguments so far (a number is whole or absent) */
        if (st == K3_OK)
            CHECKF(r.n_tool_calls == 1 && r.last_call_cut && same(r.content, "ok") &&
                       strstr(r.tool_calls_json, "\"arguments\":\"{\"}"),
                   "case %zu: %s", i, r.tool_calls_json ? r.tool_calls_json : "(null)");
        else CHECK(strstr(e.msg, "tool call") || strstr(e.msg, "malformed"));
        k3_chat_reply_free(&r);
    }
    /* a reply with reasoning that was never closed */
    k3_chat_reply r;
    k3_error e = {0};
    CHECK(k3_chat_parse_reply("thinking so far", 15, true, &r, &e) == K3_OK);
    CHECK(same(r.reasoning, "thinking so far") && !r.content && !r.tool_calls_json);
    k3_chat_reply_free(&r);
    CHECK(k3_chat_parse_reply("", 0, true, &r, &e) == K3_OK);
    CHECK(!r.reasoning && !r.content);
    k3_chat_reply_free(&r);
}

K3_TEST(chat_json_rejects_bad_requests) {
    k3_tokenizer *t = NULL;
    k3_error err = {0};
    REQUIREF(k3_tokenizer_open(&t, "models/k3-mini", &err) == K3_OK, "%s", err.msg);
    static const struct {
        const char *messages, *tools, *tool_choice, *response_format, *effort, *needle;
        k3_status st;
    } cases[] = {
        {"[{\"role\":\"user\",\"content\":\"x\"", NULL, NULL, NULL, NULL, "not valid JSON", K3_ERR_ARG},
        {"{\"role\":\"user\"}", NULL, NULL, NULL, NULL, "array", K3_ERR_ARG},
        {"[{\"role\":\"moderator\",\"content\":\"x\"}]", NULL, NULL, NULL, NULL, "message 0", K3_ERR_ARG},
        {"[{\"content\":\"x\"}]", NULL, NULL, NULL, NULL, "no role", K3_ERR_ARG},
        {"[1]", NULL, NULL, NULL, NULL, "message 0", K3_ERR_ARG},
        {"[{\"role\":\"user\",\"content\":5}]", NULL, NULL, NULL, NULL, "content", K3_ERR_ARG},
        {"[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]", NULL, NULL, NULL, NULL,
         "image", K3_ERR_UNSUPPORTED},
        {"[{\"role\":\"user\",\"content\":\"x\"}]", "{}", NULL, NULL, NULL, "tools", K3_ERR_ARG},
        {"[{\"role\":\"user\",\"content\":\"x\"}]", NULL, "sometimes", NULL, NULL, "tool_choice", K3_ERR_ARG},
        {"[{\"role\":\"user\",\"content\":\"x\"}]", NULL, NULL, "{\"type\":\"yaml\"}", NULL, "yaml", K3_ERR_ARG},
        {"[{\"role\":\"user\",\"content\":\"x\"}]", NULL, NULL, NULL, "", "thinking_effort", K3_ERR_ARG},
        {"[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"arguments\":{}}}]}]", NULL, NULL, NULL, NULL,
         "function name", K3_ERR_ARG},
        {"[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":3}}]}]", NULL, NULL,
         NULL, NULL, "arguments", K3_ERR_ARG},
        {"[{\"role\":\"user\",\"name\":3,\"content\":\"x\"}]", NULL, NULL, NULL, NULL, "name", K3_ERR_ARG},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        k3_chat_options opt = {.add_generation_prompt = true,
                               .thinking = true,
                               .tool_choice = cases[i].tool_choice,
                               .response_format = cases[i].response_format,
                               .thinking_effort = cases[i].effort};
        int32_t *ids = (int32_t *)&opt;
        size_t n = 7;
        k3_error e = {0};
        k3_status st = k3_chat_encode_json(t, cases[i].messages, cases[i].tools, &opt, &ids, &n, &e);
        CHECKF(st == cases[i].st && strstr(e.msg, cases[i].needle), "case %zu: %d %s", i, st, e.msg);
        CHECK(!ids && !n);
    }
    /* nesting is capped before jansson recurses */
    char deep[2100];
    size_t k = 0;
    k += (size_t)snprintf(deep, sizeof deep, "[{\"role\":\"user\",\"content\":\"x\",\"x\":");
    for (int d = 0; d < 1000; d++) deep[k++] = '[';
    for (int d = 0; d < 1000; d++) deep[k++] = ']';
    memcpy(deep + k, "}]", 3);
    k3_chat_options opt = {.thinking = true};
    int32_t *ids;
    size_t n;
    k3_error e = {0};
    CHECK(k3_chat_encode_json(t, deep, NULL, &opt, &ids, &n, &e) == K3_ERR_ARG);
    CHECK(strstr(e.msg, "deeper") != NULL);
    k3_tokenizer_free(t);
}

K3_TEST(chat_json_float_repr_equals_python) {
    FILE *f = fopen(GOLDEN "floats.txt", "r");
    REQUIRE(f);
    char hex[64], want[64];
    int n = 0, bad = 0;
    while (fscanf(f, "%63s %63s", hex, want) == 2) {
        double v = strtod(hex, NULL);
        k3_buf b = {0};
        k3_pyjson_float(&b, v);
        const char *got = k3_buf_cstr(&b);
        if (!got || strcmp(got, want)) {
            if (bad++ < 5) k3_test_fail(__FILE__, __LINE__, "%s: %s, Python %s", hex, got, want);
        }
        k3_buf_free(&b);
        n++;
    }
    fclose(f);
    CHECKF(n > 500 && !bad, "%d floats, %d differ", n, bad);
}

K3_TEST(chat_json_cuts_segments_every_400k_chars) {
    /* tokenization_kimi.py encodes a segment in chunks of 400,000 code
     * points: a 400,006-character content must encode as the two parts
     * [:400000] and [400000:] do (parts are segments of their own). "abcde "
     * puts the cut inside a word, where it changes the tokens (checked on
     * the plain tokenizer below). */
    k3_tokenizer *t = NULL;
    k3_error err = {0};
    REQUIREF(k3_tokenizer_open(&t, "models/k3-mini", &err) == K3_OK, "%s", err.msg);
    const size_t n = 400006;
    char *text = malloc(n + 1);
    REQUIRE(text);
    for (size_t i = 0; i < n; i++) text[i] = "abcde "[i % 6];
    text[n] = 0;
    json_t *whole = json_pack("[{s:s, s:s}]", "role", "user", "content", text);
    json_t *cut = json_pack("[{s:s, s:[{s:s, s:o}, {s:s, s:o}]}]", "role", "user", "content", "type", "text", "text",
                            json_stringn(text, 400000), "type", "text", "text", json_string(text + 400000));
    json_t *convs[2] = {whole, cut};
    int32_t *ids[3] = {0};
    size_t n_ids[3] = {0};
    k3_chat_options opt = {.thinking = true};
    for (int k = 0; k < 2; k++) {
        char *js = json_dumps(convs[k], 0);
        CHECKF(js && k3_chat_encode_json(t, js, NULL, &opt, &ids[k], &n_ids[k], &err) == K3_OK, "%s", err.msg);
        free(js);
        json_decref(convs[k]);
    }
    CHECK(n_ids[0] == n_ids[1] && !memcmp(ids[0], ids[1], n_ids[0] * sizeof(int32_t)));
    /* the plain tokenizer makes the same cut (tokenizer_internal.h) */
    int32_t *h0 = NULL, *h1 = NULL;
    size_t n0 = 0, n1 = 0;
    REQUIRE(k3_tokenizer_encode(t, text, n, &ids[2], &n_ids[2], &err) == K3_OK);
    REQUIRE(k3_tokenizer_encode(t, text, 400000, &h0, &n0, &err) == K3_OK);
    REQUIRE(k3_tokenizer_encode(t, text + 400000, n - 400000, &h1, &n1, &err) == K3_OK);
    CHECK(n_ids[2] == n0 + n1 && !memcmp(ids[2], h0, n0 * sizeof(int32_t)) &&
          !memcmp(ids[2] + n0, h1, n1 * sizeof(int32_t)));
    free(h0);
    free(h1);
    for (int k = 0; k < 3; k++) free(ids[k]);
    free(text);
    k3_tokenizer_free(t);
}

/* OpenAI's developer role is the system role: the same ids. A content part
 * of a kind K3 does not take is named by its type; any part with a "text"
 * string is text, as encoding_k3.py reads it. */
K3_TEST(chat_json_developer_role_and_part_types) {
    k3_tokenizer *t = NULL;
    k3_error err = {0};
    REQUIREF(k3_tokenizer_open(&t, "models/k3-mini", &err) == K3_OK, "%s", err.msg);
    k3_chat_options opt = {.add_generation_prompt = true, .thinking = true, .thinking_effort = "high"};
    const char *pairs[][2] = {
        {"[{\"role\":\"system\",\"content\":\"Answer briefly.\"},{\"role\":\"user\",\"content\":\"hi\"}]",
         "[{\"role\":\"developer\",\"content\":\"Answer briefly.\"},{\"role\":\"user\",\"content\":\"hi\"}]"},
        {"[{\"role\":\"user\",\"content\":\"hi\"}]",
         "[{\"role\":\"user\",\"content\":[{\"type\":\"input_text\",\"text\":\"hi\"}]}]"},
    };
    for (int i = 0; i < 2; i++) {
        int32_t *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        REQUIREF(k3_chat_encode_json(t, pairs[i][0], NULL, &opt, &a, &na, &err) == K3_OK, "%s", err.msg);
        REQUIREF(k3_chat_encode_json(t, pairs[i][1], NULL, &opt, &b, &nb, &err) == K3_OK, "%s", err.msg);
        CHECKF(na == nb && !memcmp(a, b, na * sizeof *a), "pair %d: %zu and %zu ids", i, na, nb);
        free(a);
        free(b);
    }
    const char *bad[][2] = {
        {"[{\"role\":\"user\",\"content\":[{\"type\":\"input_audio\",\"input_audio\":{\"data\":\"\",\"format\":\"wav\"}"
         "}]}]",
         "\"input_audio\", which K3 does not take"},
        {"[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"file\",\"file\":{}}]}]",
         "content part 1 has the type \"file\""},
        {"[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]", "has no \"text\" string"},
    };
    for (int i = 0; i < 3; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        k3_error e = {0};
        const k3_status st = k3_chat_encode_json(t, bad[i][0], NULL, &opt, &ids, &n, &e);
        CHECKF(st != K3_OK && strstr(e.msg, bad[i][1]) && !ids, "case %d: %d %s", i, st, e.msg);
    }
    k3_tokenizer_free(t);
}

/* reasoning_effort onto K3's thinking switch and effort: the documented table. */
K3_TEST(chat_reasoning_effort_table) {
    static const struct {
        const char *in;
        bool thinking;
        const char *effort;
    } rows[] = {{NULL, true, "max"},      {"none", false, NULL},  {"minimal", true, "low"}, {"low", true, "low"},
                {"medium", true, "high"}, {"high", true, "high"}, {"xhigh", true, "max"},   {"max", true, "max"}};
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
        bool th = !rows[i].thinking;
        const char *ef = "unset";
        k3_error e = {0};
        CHECK(k3_chat_reasoning_effort(rows[i].in, &th, &ef, &e) == K3_OK);
        CHECKF(th == rows[i].thinking &&
                   (ef == rows[i].effort || (ef && rows[i].effort && !strcmp(ef, rows[i].effort))),
               "%s -> %d %s", rows[i].in ? rows[i].in : "(none)", th, ef ? ef : "NULL");
    }
    bool th;
    const char *ef;
    k3_error e = {0};
    CHECK(k3_chat_reasoning_effort("extreme", &th, &ef, &e) == K3_ERR_ARG && strstr(e.msg, "\"extreme\"") &&
          strstr(e.msg, "xhigh"));
}
