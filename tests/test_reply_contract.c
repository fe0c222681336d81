/*
 * test_reply_contract.c -- the grammar engine and the chat reply parser are
 * one contract: what a grammar lets a model write, the parser reads back,
 * byte for byte, and no field it returns holds the chat format's specials.
 *
 *  - numbers are text: any JSON number passes through as written (past 64
 *    bits, exponents, fractions), objects and arrays re-spaced as Python's
 *    json.dumps writes them; what is not JSON of the declared type is an
 *    error naming the call and the key;
 *  - the grammar bounds a number (common/json_text.h) and the parser
 *    agrees with it on every string tried;
 *  - random walks through a forced tool call's grammar (k3-mini's
 *    vocabulary, tokens drawn among those the mask allows) parse back into
 *    that call at the end and at every token boundary before it, with no
 *    special in any field, and the whole answer's cut call equals what the
 *    stream's partial call says;
 *  - a turn cut inside its closing markup, one that closes the think block
 *    with another tag, and text that spells a special's name without being
 *    one (only the server's marks are specials).
 */
#include "test.h"

#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/json_text.h"
#include "k3.h"
#include "tokenizer/chat_stream.h"

static bool same(const char *a, const char *b) { return (!a && !b) || (a && b && !strcmp(a, b)); }

/* The arguments string of call k of a reply. */
static char *call_args(const k3_chat_reply *r, size_t k, char *name, size_t cap) {
    json_t *a = json_loads(r->tool_calls_json ? r->tool_calls_json : "[]", 0, NULL);
    json_t *fn = json_object_get(json_array_get(a, k), "function");
    const char *s = json_string_value(json_object_get(fn, "arguments"));
    const char *nm = json_string_value(json_object_get(fn, "name"));
    if (name) snprintf(name, cap, "%s", nm ? nm : "");
    char *out = s ? strdup(s) : NULL;
    json_decref(a);
    return out;
}

static k3_status parse_arg(const char *type, const char *value, char **args) {
    char text[1024];
    snprintf(text, sizeof text,
             "<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"v\" "
             "type=\"%s\"<|sep|>"
             "%s<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
             type, value);
    k3_chat_reply r;
    k3_error e = {0};
    k3_status st = k3_chat_parse_reply(text, strlen(text), false, &r, &e);
    *args = st == K3_OK ? call_args(&r, 0, NULL, 0) : NULL;
    k3_chat_reply_free(&r);
    return st;
}

K3_TEST(reply_numbers_pass_through_as_text) {
    static const struct {
        const char *type, *value, *args;
    } ok[] = {
        {"number", "10261041299326810411", "{\"v\": 10261041299326810411}"},
        {"number", "-123456789012345678901234567890", "{\"v\": -123456789012345678901234567890}"},
        {"number", "1e400", "{\"v\": 1e400}"},
        {"number", "-0.50", "{\"v\": -0.50}"},
        {"number", "2E-3", "{\"v\": 2E-3}"},
        {"number", "1.0", "{\"v\": 1.0}"},
        {"object", "{\"a\":123456789012345678901234567890,\"b\":[1.0,2,{\"c\":null}]}",
         "{\"v\": {\"a\": 123456789012345678901234567890, \"b\": [1.0, 2, {\"c\": null}]}}"},
        {"array", " [ 1 , \"x\\u00e9\\n\" ] ", "{\"v\": [1, \"x\xc3\xa9\\n\"]}"},
        {"boolean", "true", "{\"v\": true}"},
        {"null", "null", "{\"v\": null}"},
        {"string", "12345678901234567890", "{\"v\": \"12345678901234567890\"}"},
    };
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
        char *args = NULL;
        k3_status st = parse_arg(ok[i].type, ok[i].value, &args);
        CHECKF(st == K3_OK && same(args, ok[i].args), "%s %s: status %d, %s", ok[i].type, ok[i].value, st,
               args ? args : "(null)");
        free(args);
    }
    static const struct {
        const char *type, *value;
    } bad[] = {{"number", "12."},  {"number", "01"},        {"number", "1e"},  {"number", "--1"},
               {"number", "NaN"},  {"number", "\"1\""},     {"object", "[1]"}, {"object", "{\"a\":1,}"},
               {"array", "[1 2]"}, {"boolean", "yes"},      {"null", "nul"},   {"object", "{\"a\":\"\\ud800\"}"},
               {"number", "1 2"},  {"object", "{\"a\":01}"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char *args = NULL;
        CHECKF(parse_arg(bad[i].type, bad[i].value, &args) == K3_ERR_FORMAT, "%s %s accepted: %s", bad[i].type,
               bad[i].value, args ? args : "");
        free(args);
    }
    /* the json block: the whole arguments object, numbers as written */
    const char *blk =
        "<|open|>tools<|sep|><|open|>call tool=\"g\" index=\"1\"<|sep|><|open|>json type=\"object\"<|sep|>"
        "{\"n\":98765432109876543210,\"x\":[1e-7]}<|close|>json<|sep|><|close|>call<|sep|>";
    k3_chat_reply r;
    k3_error e = {0};
    REQUIREF(k3_chat_parse_reply(blk, strlen(blk), false, &r, &e) == K3_OK, "%s", e.msg);
    char *args = call_args(&r, 0, NULL, 0);
    CHECKF(same(args, "{\"n\": 98765432109876543210, \"x\": [1e-7]}"), "%s", args ? args : "(null)");
    free(args);
    k3_chat_reply_free(&r);
}

/* Whether the grammar of schema accepts text whole (o200k-free: one token
 * per byte through the k3-mini vocabulary's single bytes is not possible,
 * so the text is tokenized). */
static k3_tokenizer *tok;
static k3_grammar_vocab *voc;

static bool setup(void) {
    if (voc) return true;
    k3_error err = {0};
    if (k3_tokenizer_open(&tok, "models/k3-mini", &err) || k3_grammar_vocab_init(&voc, tok, &err)) {
        k3_test_fail(__FILE__, __LINE__, "k3-mini: %s", err.msg);
        return false;
    }
    return true;
}

static bool accepts(k3_grammar *g, const char *text) {
    int32_t *ids = NULL;
    size_t n = 0;
    k3_error err = {0};
    if (k3_tokenizer_encode(tok, text, strlen(text), &ids, &n, &err)) return false;
    k3_grammar_matcher *m = NULL;
    bool ok = !k3_grammar_matcher_init(&m, g, &err);
    for (size_t i = 0; ok && i < n; i++) ok = !k3_grammar_matcher_accept(m, ids[i], &err);
    ok = ok && k3_grammar_matcher_is_complete(m);
    k3_grammar_matcher_free(m);
    free(ids);
    return ok;
}

K3_TEST(reply_number_bounds_grammar_and_parser_agree) {
    REQUIRE(setup());
    static const char *const schemas[] = {"{\"type\":\"integer\"}", "{\"type\":\"number\"}"};
    static const char *const texts[] = {
        "0",
        "7",
        "-7",
        "1234567890123456",  /* 16 digits */
        "-9999999999999999", /* 16 digits */
        "12345678901234567", /* 17 */
        "10261041299326810411",
        "0.5",
        "1.000000000000001",  /* 15 fraction digits */
        "1.0000000000000001", /* 16 */
        "-0.25",
    };
    for (int canon = 0; canon < 2; canon++)
        for (int s = 0; s < 2; s++) {
            k3_grammar_spec spec = {.kind = K3_GRAMMAR_JSON_SCHEMA,
                                    .text = schemas[s],
                                    .compact = true,
                                    .canonical_numbers = canon};
            k3_grammar *g = NULL;
            k3_error err = {0};
            REQUIREF(!k3_grammar_compile(&g, voc, &spec, &err), "%s", err.msg);
            for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
                const char *t = texts[i];
                const bool frac = strchr(t, '.') != NULL;
                const bool want =
                    k3_json_number_bounded(t, strlen(t), canon ? K3_JSON_CANON_FRAC_DIGITS : K3_JSON_FRAC_DIGITS) &&
                    !(s == 0 && frac && (canon || strspn(strchr(t, '.') + 1, "0") != strlen(strchr(t, '.') + 1)));
                CHECKF(accepts(g, t) == want, "%s (canonical %d): '%s' accepted %d, wanted %d", schemas[s], canon, t,
                       !want, want);
                /* whatever the grammar takes, the parser reads back as written */
                if (want) {
                    char *args = NULL, wantargs[80];
                    snprintf(wantargs, sizeof wantargs, "{\"v\": %s}", t);
                    CHECKF(parse_arg("number", t, &args) == K3_OK && same(args, wantargs), "'%s' read as %s", t,
                           args ? args : "(error)");
                    free(args);
                }
            }
            k3_grammar_free(g);
        }
}

/* ---- random walks through a forced tool call ----------------------------------- */

static uint64_t rng(uint64_t *s) {
    uint64_t x = (*s += 0x9e3779b97f4a7c15u);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9u;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebu;
    return x ^ (x >> 31);
}

/* Appends id to text as the server decodes a chat reply: a special by its
 * name, its offset in marks. */
static void add(k3_buf *text, size_t *marks, size_t *n_marks, int32_t id) {
    size_t len = 0;
    const char *p = k3_tokenizer_token(tok, id, &len);
    if (k3_tokenizer_is_special(tok, id)) marks[(*n_marks)++] = text->len;
    k3_buf_add(text, p, len);
}

static bool has_special_name(const char *s) {
    return s && (strstr(s, "<|open|>") || strstr(s, "<|close|>") || strstr(s, "<|sep|>") || strstr(s, "<|end_of"));
}

K3_TEST(reply_random_tool_calls_parse_back) {
    REQUIRE(setup());
    const char *params = "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"year\":{\"type\":"
                         "\"integer\"},\"ratio\":{\"type\":\"number\"}},\"required\":[\"city\",\"year\",\"ratio\"]}";
    k3_grammar_tool t = {"get_population", params};
    k3_grammar_spec spec = {.kind = K3_GRAMMAR_TOOL_CALLS,
                            .tools = &t,
                            .n_tools = 1,
                            .compact = true,
                            .canonical_numbers = true};
    k3_grammar *g = NULL;
    k3_error err = {0};
    REQUIREF(!k3_grammar_compile(&g, voc, &spec, &err), "%s", err.msg);
    const size_t words = k3_grammar_mask_words(voc);
    uint64_t *mask = malloc(words * 8);
    const int32_t nv = (int32_t)k3_tokenizer_n_vocab(tok);
    int32_t *allowed = malloc((size_t)nv * sizeof *allowed), *ids = malloc(4096 * sizeof *ids);
    size_t *marks = malloc(4096 * sizeof *marks);
    REQUIRE(mask && allowed && ids && marks);
    uint64_t seed = 34;
    int walks = 0, long_years = 0, prefixes = 0;
    for (int w = 0; w < 120; w++) {
        k3_grammar_matcher *m = NULL;
        REQUIRE(!k3_grammar_matcher_init(&m, g, &err));
        size_t n = 0;
        while (n < 4096 && !k3_grammar_matcher_is_ended(m)) {
            REQUIRE(!k3_grammar_matcher_fill_mask(m, mask, &err));
            int32_t na = 0, ns = 0;
            for (int32_t id = 0; id < nv; id++)
                if ((mask[id >> 6] >> (id & 63)) & 1) {
                    allowed[na++] = id;
                    ns += k3_tokenizer_is_special(tok, id);
                }
            REQUIREF(na > 0, "walk %d: an empty mask after %zu tokens", w, n);
            int32_t pick = allowed[rng(&seed) % (uint64_t)na];
            /* close strings now and then, so walks end (numbers run on
             * uniformly: digits or their end) */
            if (ns && na > 64 && rng(&seed) % 3 == 0)
                for (int32_t k = 0; k < na; k++)
                    if (k3_tokenizer_is_special(tok, allowed[k])) {
                        pick = allowed[k];
                        break;
                    }
            REQUIRE(!k3_grammar_matcher_accept(m, pick, &err));
            ids[n++] = pick;
        }
        k3_grammar_matcher_free(m);
        if (n == 4096) continue;
        walks++;
        /* every token boundary: the whole answer and the stream say the same */
        k3_buf text = {0};
        size_t n_marks = 0;
        for (size_t k = 0; k <= n; k++) {
            if (k) add(&text, marks, &n_marks, ids[k - 1]);
            const size_t len = text.len;
            /* the server parses whole characters until the end (k3_srv_choice_sendable) */
            bool partial = false;
            for (size_t back = 1; k < n && back <= 3 && back <= len; back++) {
                const unsigned char ch = (unsigned char)text.p[len - back];
                if (ch >= 0xC0) partial = back < (ch >= 0xF0 ? 4u : ch >= 0xE0 ? 3u : 2u);
                if (ch >= 0xC0 || ch < 0x80) break;
            }
            if (partial) continue;
            const k3_chat_text mk = {marks, n_marks};
            k3_chat_reply whole, streamed;
            k3_chat_partial_call part;
            k3_error e1 = {0}, e2 = {0};
            REQUIREF(!k3_chat_parse_reply_marked(text.p ? text.p : "", len, &mk, false, &whole, NULL, &e1),
                     "walk %d at token %zu: %s", w, k, e1.msg);
            REQUIREF(!k3_chat_parse_reply_marked(text.p ? text.p : "", len, &mk, false, &streamed, &part, &e2),
                     "walk %d at token %zu: %s", w, k, e2.msg);
            prefixes++;
            CHECKF(!has_special_name(whole.content) && !has_special_name(whole.reasoning) &&
                       !has_special_name(whole.tool_calls_json),
                   "walk %d at token %zu: a special in a field", w, k);
            if (part.name) {
                char name[64], *args = call_args(&whole, (size_t)whole.n_tool_calls - 1, name, sizeof name);
                CHECKF(whole.last_call_cut && whole.n_tool_calls == streamed.n_tool_calls + 1 &&
                           !strcmp(name, part.name) && same(args, part.args),
                       "walk %d at token %zu: whole '%s' vs stream '%s'", w, k, args ? args : "", part.args);
                free(args);
            } else {
                CHECK(!whole.last_call_cut && whole.n_tool_calls == streamed.n_tool_calls);
            }
            if (k == n) {
                REQUIREF(whole.n_tool_calls == 1 && !whole.last_call_cut, "walk %d: %d calls", w, whole.n_tool_calls);
                char *args = call_args(&whole, 0, NULL, 0);
                json_t *a = args ? json_loads(args, JSON_DECODE_INT_AS_REAL, NULL) : NULL;
                CHECKF(json_is_string(json_object_get(a, "city")) && json_is_number(json_object_get(a, "year")) &&
                           json_is_number(json_object_get(a, "ratio")),
                       "walk %d: arguments %s", w, args ? args : "(null)");
                /* the year as the model wrote it, within the bound */
                const char *y = args ? strstr(args, "\"year\": ") : NULL;
                if (y) {
                    y += 8;
                    const size_t l = k3_json_number_len(y, strlen(y));
                    CHECKF(k3_json_number_bounded(y, l, K3_JSON_CANON_FRAC_DIGITS), "walk %d: year %.*s", w, (int)l, y);
                    long_years += l > 10;
                }
                json_decref(a);
                free(args);
            }
            k3_chat_partial_call_free(&part);
            k3_chat_reply_free(&whole);
            k3_chat_reply_free(&streamed);
        }
        k3_buf_free(&text);
    }
    printf("    %d walks, %d prefixes parsed, %d years of 11-16 digits\n", walks, prefixes, long_years);
    CHECK(walks >= 100);
    free(mask);
    free(allowed);
    free(ids);
    free(marks);
    k3_grammar_free(g);
}

K3_TEST(reply_markup_never_in_a_field) {
    /* marks: where the server decoded specials by name */
    struct {
        const char *text;
        bool thinking;
        const char *reasoning, *content;
    } cases[] = {
        /* max_tokens cut the closing markup after its name */
        {"budgetmen.<|close|>response", false, NULL, "budgetmen."},
        {"23221301<|close|>response", false, NULL, "23221301"},
        {"23221301<|close|>", false, NULL, "23221301"},
        /* a think block closed by another tag: the reasoning ends there */
        {"The user asks.<|close|>response<|sep|><|close|>message<|sep|>", true, "The user asks.", NULL},
        {"Hm.<|close|>think<|sep|><|open|>response<|sep|>Yes.<|close|>response", true, "Hm.", "Yes."},
        {"Hm.<|close|>think<|sep|><|open|>resp", true, "Hm.", NULL},
        {"Hm.<|close|>thi", true, "Hm.", NULL},
        /* a tag inside the content ends it */
        {"Text<|open|>tools<|sep|>", false, NULL, "Text"},
        {"Text<|sep|>more", false, NULL, "Text"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const char *s = cases[i].text;
        size_t marks[16], nm = 0;
        for (size_t k = 0; s[k]; k++)
            if (!strncmp(s + k, "<|open|>", 8) || !strncmp(s + k, "<|close|>", 9) || !strncmp(s + k, "<|sep|>", 7))
                marks[nm++] = k;
        const k3_chat_text mk = {marks, nm};
        k3_chat_reply r;
        k3_error e = {0};
        REQUIREF(!k3_chat_parse_reply_marked(s, strlen(s), &mk, cases[i].thinking, &r, NULL, &e), "%s", e.msg);
        CHECKF(same(r.reasoning, cases[i].reasoning) && same(r.content, cases[i].content),
               "case %zu: reasoning '%s' content '%s'", i, r.reasoning ? r.reasoning : "(null)",
               r.content ? r.content : "(null)");
        k3_chat_reply_free(&r);
        /* without marks (every name a special) the same */
        REQUIREF(!k3_chat_parse_reply(s, strlen(s), cases[i].thinking, &r, &e), "%s", e.msg);
        CHECKF(same(r.reasoning, cases[i].reasoning) && same(r.content, cases[i].content), "case %zu by name", i);
        k3_chat_reply_free(&r);
    }
    /* text that spells a special's name without being one stays text: JSON
     * content a grammar allowed comes back byte for byte */
    const char *s = "{\"a\":\"<|sep|> and <|close|>response<|sep|>\"}<|close|>response<|sep|>";
    const size_t marks[] = {strlen("{\"a\":\"<|sep|> and <|close|>response<|sep|>\"}"),
                            strlen("{\"a\":\"<|sep|> and <|close|>response<|sep|>\"}<|close|>response")};
    const k3_chat_text mk = {marks, 2};
    k3_chat_reply r;
    k3_error e = {0};
    REQUIREF(!k3_chat_parse_reply_marked(s, strlen(s), &mk, false, &r, NULL, &e), "%s", e.msg);
    CHECKF(same(r.content, "{\"a\":\"<|sep|> and <|close|>response<|sep|>\"}"), "content '%s'", r.content);
    k3_chat_reply_free(&r);
    /* a special cut by a stop string (the text ends inside its name) is not there */
    const size_t m1[] = {5};
    const k3_chat_text mk1 = {m1, 1};
    REQUIRE(!k3_chat_parse_reply_marked("Hello<|clo", 10, &mk1, false, &r, NULL, &e));
    CHECKF(same(r.content, "Hello"), "content '%s'", r.content);
    k3_chat_reply_free(&r);
}

/* With thinking on, the constraint starts after the think block (as vLLM's
 * reasoning parsers hand the grammar only the content): the think text runs
 * free, text that is no JSON included; once <|open|>response<|sep|> is out,
 * only the schema's JSON may follow, then the closing tags; the whole turn
 * parses back into the reasoning and the content. */
K3_TEST(reply_thinking_constraint_starts_after_the_think_block) {
    REQUIRE(setup());
    const char *schema = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]}";
    k3_grammar_spec spec = {.kind = K3_GRAMMAR_JSON_SCHEMA,
                            .text = schema,
                            .compact = true,
                            .canonical_numbers = true,
                            .no_extra_properties = true,
                            .k3_reply = true,
                            .thinking = true};
    k3_grammar *g = NULL;
    k3_error err = {0};
    REQUIREF(!k3_grammar_compile(&g, voc, &spec, &err), "%s", err.msg);
    k3_grammar_matcher *m = NULL;
    REQUIRE(!k3_grammar_matcher_init(&m, g, &err));
    uint64_t *mask = malloc(k3_grammar_mask_words(voc) * 8);
    REQUIRE(mask);
    const int32_t open = k3_tokenizer_special(tok, "<|open|>"), close = k3_tokenizer_special(tok, "<|close|>"),
                  sep = k3_tokenizer_special(tok, "<|sep|>");
    int32_t *think = NULL, *brace = NULL, *word = NULL, *json = NULL, *name = NULL;
    size_t nt = 0, nb = 0, nw = 0, nj = 0, nn = 0;
    const char *tt = "Not JSON at all: {{ [ \" so it runs free.";
    REQUIRE(!k3_tokenizer_encode(tok, tt, strlen(tt), &think, &nt, &err));
    REQUIRE(!k3_tokenizer_encode(tok, "{", 1, &brace, &nb, &err) && nb == 1);
    REQUIRE(!k3_tokenizer_encode(tok, "Hello", 5, &word, &nw, &err) && nw >= 1);
#define ALLOWED(id) ((mask[(id) >> 6] >> ((id)&63)) & 1)
    /* the think block: free text, any of it */
    for (size_t i = 0; i < nt; i++) {
        REQUIRE(!k3_grammar_matcher_fill_mask(m, mask, &err));
        CHECKF(ALLOWED(think[i]) && ALLOWED(word[0]) && ALLOWED(close), "think token %zu", i);
        REQUIRE(!k3_grammar_matcher_accept(m, think[i], &err));
    }
    /* <|close|>think<|sep|><|open|>response<|sep|> */
    REQUIRE(!k3_grammar_matcher_accept(m, close, &err));
    REQUIRE(!k3_tokenizer_encode(tok, "think", 5, &name, &nn, &err));
    for (size_t i = 0; i < nn; i++) REQUIRE(!k3_grammar_matcher_accept(m, name[i], &err));
    free(name);
    REQUIRE(!k3_grammar_matcher_accept(m, sep, &err) && !k3_grammar_matcher_accept(m, open, &err));
    REQUIRE(!k3_tokenizer_encode(tok, "response", 8, &name, &nn, &err));
    for (size_t i = 0; i < nn; i++) REQUIRE(!k3_grammar_matcher_accept(m, name[i], &err));
    REQUIRE(!k3_grammar_matcher_accept(m, sep, &err));
    /* now the constraint: the JSON's first byte, no free text */
    REQUIRE(!k3_grammar_matcher_fill_mask(m, mask, &err));
    CHECK(ALLOWED(brace[0]) && !ALLOWED(word[0]) && !ALLOWED(close));
    const char *js = "{\"a\":12}";
    REQUIRE(!k3_tokenizer_encode(tok, js, strlen(js), &json, &nj, &err));
    for (size_t i = 0; i < nj; i++) REQUIRE(!k3_grammar_matcher_accept(m, json[i], &err));
    REQUIRE(!k3_grammar_matcher_fill_mask(m, mask, &err));
    CHECK(ALLOWED(close) && !ALLOWED(word[0]));
#undef ALLOWED
    free(think);
    free(brace);
    free(word);
    free(json);
    free(name);
    free(mask);
    k3_grammar_matcher_free(m);
    k3_grammar_free(g);
}
