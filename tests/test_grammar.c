/*
 * test_grammar.c -- the grammar engine (src/grammar): regular expressions,
 * GBNF, choices and JSON Schema checked byte by byte on a vocabulary of the
 * 256 single bytes; masks held to the scalar reference (every token of the
 * vocabulary tried by feeding its bytes) on random walks with o200k and the
 * k3-mini vocabulary; rollback, rebuild, clone, batches; the K3 tool-call
 * grammar against what the chat encoder writes; and the cases derived from
 * the JSON Schema Test Suite (tests/golden/grammar/suite.json).
 */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/vocab.h"
#include "k3.h"
#include "test.h"

/* ---- vocabularies ------------------------------------------------------------------ */

/* ids 0..255 the bytes, then specials; the last is the end of a message */
static const char *const SPECIALS[] = {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"};
#define N_SPECIALS 4
#define BYTE_EOS (256 + N_SPECIALS - 1)

static k3_grammar_vocab *byte_vocab(void) {
    static k3_grammar_vocab *v;
    if (v) return v;
    static char bytes[256];
    const char *tok[256 + N_SPECIALS];
    size_t len[256 + N_SPECIALS];
    bool sp[256 + N_SPECIALS];
    for (int i = 0; i < 256; i++) {
        bytes[i] = (char)i;
        tok[i] = &bytes[i];
        len[i] = 1;
        sp[i] = false;
    }
    for (int i = 0; i < N_SPECIALS; i++) {
        tok[256 + i] = SPECIALS[i];
        len[256 + i] = strlen(SPECIALS[i]);
        sp[256 + i] = true;
    }
    int32_t eos = BYTE_EOS;
    k3_error err = {0};
    if (k3g_vocab_from_tokens(&v, tok, len, sp, 256 + N_SPECIALS, &eos, 1, &err) != K3_OK) {
        fprintf(stderr, "byte vocab: %s\n", err.msg);
        return NULL;
    }
    return v;
}

static k3_tokenizer *o200k_tok;
static k3_grammar_vocab *o200k_vocab(void) {
    static k3_grammar_vocab *v;
    if (v) return v;
    k3_error err = {0};
    if (k3_tokenizer_open_file(&o200k_tok, "data/tokenizers/o200k_base.tiktoken", K3_PATTERN_O200K, &err) != K3_OK ||
        k3_grammar_vocab_init(&v, o200k_tok, &err) != K3_OK) {
        fprintf(stderr, "o200k: %s\n", err.msg);
        return NULL;
    }
    return v;
}

static k3_tokenizer *mini_tok;
static k3_grammar_vocab *mini_vocab(void) {
    static k3_grammar_vocab *v;
    if (v) return v;
    k3_error err = {0};
    if (k3_tokenizer_open(&mini_tok, "models/k3-mini", &err) != K3_OK ||
        k3_grammar_vocab_init(&v, mini_tok, &err) != K3_OK) {
        fprintf(stderr, "k3-mini: %s\n", err.msg);
        return NULL;
    }
    return v;
}

static k3_grammar *compile_kind(const k3_grammar_vocab *v, k3_grammar_kind kind, const char *text, k3_error *err) {
    k3_grammar_spec spec = {.kind = kind, .text = text};
    k3_grammar *g = NULL;
    k3_error e = {0};
    if (k3_grammar_compile(&g, v, &spec, err ? err : &e) != K3_OK) return NULL;
    return g;
}

/* 1 when the byte string s is accepted whole (every byte allowed and the
 * end complete) on the byte vocabulary; also checks each byte against the
 * mask. */
static int bytes_match(k3_grammar *g, const char *s, size_t n) {
    k3_grammar_matcher *m;
    k3_error err = {0};
    if (k3_grammar_matcher_init(&m, g, &err) != K3_OK) return -1;
    uint64_t mask[(256 + N_SPECIALS + 63) / 64];
    int r = 1;
    for (size_t i = 0; i < n && r == 1; i++) {
        uint8_t c = (uint8_t)s[i];
        if (k3_grammar_matcher_fill_mask(m, mask, &err) != K3_OK) r = -1;
        bool allowed = (mask[c >> 6] >> (c & 63)) & 1;
        k3_status st = k3_grammar_matcher_accept(m, c, &err);
        if (allowed != (st == K3_OK)) r = -2;
        else if (!allowed) r = 0;
    }
    if (r == 1 && !k3_grammar_matcher_is_complete(m)) r = 0;
    if (r == 1) {
        k3_grammar_matcher_fill_mask(m, mask, &err);
        if (!((mask[BYTE_EOS >> 6] >> (BYTE_EOS & 63)) & 1)) r = -3;
    }
    k3_grammar_matcher_free(m);
    return r;
}

static int str_match(k3_grammar *g, const char *s) { return bytes_match(g, s, strlen(s)); }

/* ---- regular expressions ------------------------------------------------------------ */

typedef struct re_case {
    const char *re;
    const char *yes[6];
    const char *no[6];
} re_case;

K3_TEST(grammar_regex_fullmatch) {
    k3_grammar_vocab *v = byte_vocab();
    REQUIRE(v);
    static const re_case cases[] = {
        {"abc", {"abc"}, {"ab", "abcd", "xabc", ""}},
        {"a|bc|", {"a", "bc", ""}, {"b", "abc"}},
        {"[a-c]+[0-9]{2,3}", {"a12", "cab123"}, {"a1", "a1234", "d12", "12"}},
        {"[^a-z]*", {"", "AB-1", "\xc3\xa9", "\xe2\x82\xac"}, {"a", "Ab"}},
        {"\\d\\w\\s\\D\\W\\S", {"1a b!x"}, {"aa b!x", "1a\tbab"}},
        {"(ab)*c?", {"", "ab", "ababc", "c"}, {"a", "abca"}},
        {"x{3}", {"xxx"}, {"xx", "xxxx"}},
        {"x{2,}", {"xx", "xxxxx"}, {"x", ""}},
        {"^a.c$",
         {"abc",
          "a\xc3\xa9"
          "c"},
         {"a\nc", "ac"}},
        {"\\u00e9|\\x41|\\.|\\/", {"\xc3\xa9", "A", ".", "/"}, {"e", "a"}},
        {"(?:a|b)(?<n>c)d*?", {"ac", "bcdd"}, {"c", "abc"}},
        {"[\\d-z]", {"5", "-", "z"}, {"a"}},
        {"\\u{1F600}", {"\xf0\x9f\x98\x80"}, {"\xf0\x9f\x98\x81"}},
        {"[\\]a]", {"]", "a"}, {"b"}},
        {"a{,2}", {"a{,2}"}, {"a", "aa"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        k3_error err = {0};
        k3_grammar *g = compile_kind(v, K3_GRAMMAR_REGEX, cases[i].re, &err);
        CHECKF(g, "regex %s: %s", cases[i].re, err.msg);
        if (!g) continue;
        for (int k = 0; k < 6 && cases[i].yes[k]; k++)
            CHECKF(str_match(g, cases[i].yes[k]) == 1, "regex %s should accept \"%s\"", cases[i].re, cases[i].yes[k]);
        for (int k = 0; k < 6 && cases[i].no[k]; k++)
            CHECKF(str_match(g, cases[i].no[k]) == 0, "regex %s should reject \"%s\"", cases[i].re, cases[i].no[k]);
        k3_grammar_free(g);
    }
}

K3_TEST(grammar_regex_errors) {
    k3_grammar_vocab *v = byte_vocab();
    REQUIRE(v);
    static const char *const bad[][2] = {
        {"(?=a)b", "lookahead"},   {"a\\1", "backreference"}, {"\\bword", "word boundary"}, {"\\p{L}", "property"},
        {"a(b", "unclosed"},       {"a)", "unmatched"},       {"*a", "nothing to repeat"},  {"a{3,1}", "n < m"},
        {"[z-a]", "out of order"}, {"a^b", "anchor"},         {"a**", "quantifier after"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        k3_error err = {0};
        k3_grammar *g = compile_kind(v, K3_GRAMMAR_REGEX, bad[i][0], &err);
        CHECKF(!g, "regex %s should not compile", bad[i][0]);
        CHECKF(strstr(err.msg, bad[i][1]), "regex %s: message \"%s\" lacks \"%s\"", bad[i][0], err.msg, bad[i][1]);
        k3_grammar_free(g);
    }
}

/* ---- GBNF ----------------------------------------------------------------------------- */

K3_TEST(grammar_gbnf) {
    k3_grammar_vocab *v = byte_vocab();
    REQUIRE(v);
    const char *arith = "# arithmetic\n"
                        "root ::= expr\n"
                        "expr ::= term ((\"+\" | \"-\") term)*\n"
                        "term ::= factor ((\"*\" | \"/\") factor)*\n"
                        "factor ::= [0-9]+ | \"(\" expr \")\" # nested\n";
    k3_error err = {0};
    k3_grammar *g = compile_kind(v, K3_GRAMMAR_GBNF, arith, &err);
    REQUIREF(g, "%s", err.msg);
    CHECK(str_match(g, "1+2*(3-45)/6") == 1);
    CHECK(str_match(g, "((7))") == 1);
    CHECK(str_match(g, "1+") == 0);
    CHECK(str_match(g, "(1") == 0);
    CHECK(str_match(g, "1++2") == 0);
    k3_grammar_free(g);
    /* escapes, classes, repetition, a newline after | continuing a rule */
    const char *misc = "root ::= greet \" \" name{1,2} \"!\"? |\n"
                       "   [\\u00e9\\x41-\\x43] . \"\\n\"\n"
                       "greet ::= (\"hi\" | \"hello\")\n"
                       "name  ::= [^ !\\n]+ \" \"?\n";
    g = compile_kind(v, K3_GRAMMAR_GBNF, misc, &err);
    REQUIREF(g, "%s", err.msg);
    CHECK(str_match(g, "hi bob!") == 1);
    CHECK(str_match(g, "hello ann bo") == 1);
    CHECK(str_match(g, "hello ann bo cy") == 0);
    CHECK(str_match(g,
                    "\xc3\xa9"
                    "x\n") == 1);
    CHECK(str_match(g, "B\xe2\x82\xac\n") == 1);
    CHECK(str_match(g, "D\n\n") == 0);
    k3_grammar_free(g);
    /* special tokens by name, and !<...> */
    const char *tok = "root ::= <|open|> \"tools\" <|sep|> body <|close|>\n"
                      "body ::= !<|close|>*\n";
    g = compile_kind(v, K3_GRAMMAR_GBNF, tok, &err);
    REQUIREF(g, "%s", err.msg);
    k3_grammar_matcher *m;
    REQUIRE(k3_grammar_matcher_init(&m, g, &err) == K3_OK);
    CHECK(k3_grammar_matcher_accept(m, 't', &err) != K3_OK); /* must open with <|open|> */
    CHECK(k3_grammar_matcher_accept(m, 256, &err) == K3_OK);
    for (const char *p = "tools"; *p; p++) CHECK(k3_grammar_matcher_accept(m, (uint8_t)*p, &err) == K3_OK);
    CHECK(k3_grammar_matcher_accept(m, 258, &err) == K3_OK);
    CHECK(k3_grammar_matcher_accept(m, 'x', &err) == K3_OK);
    CHECK(k3_grammar_matcher_accept(m, 256, &err) == K3_OK); /* any special but <|close|> */
    CHECK(!k3_grammar_matcher_is_complete(m));
    CHECK(k3_grammar_matcher_accept(m, 257, &err) == K3_OK);
    CHECK(k3_grammar_matcher_is_complete(m));
    CHECK(k3_grammar_matcher_accept(m, BYTE_EOS, &err) == K3_OK);
    CHECK(k3_grammar_matcher_is_ended(m));
    CHECK(k3_grammar_matcher_accept(m, 'x', &err) != K3_OK);
    k3_grammar_matcher_free(m);
    k3_grammar_free(g);
}

K3_TEST(grammar_gbnf_errors) {
    k3_grammar_vocab *v = byte_vocab();
    REQUIRE(v);
    static const char *const bad[][2] = {
        {"root ::= a\n", "never defined"},
        {"start ::= \"x\"\n", "no rule named 'root'"},
        {"root ::= root \"x\" | \"y\"\n", "left-recursive"},
        {"root ::= a | \"z\"\na ::= b? root\nb ::= \"x\"\n", "left-recursive"},
        {"root ::= a\na ::= \"x\" a\n", "nothing can match"},
        {"root ::= \"x\"\nroot ::= \"y\"\n", "defined twice"},
        {"root ::= \"x\n", "unclosed"},
        {"root ::= (\"x\"\n", "unclosed ("},
        {"root ::= [b-a]\n", "out of order"},
        {"root ::= <|nope|>\n", "not a special token"},
        {"root ::= <[65]>\n", "ordinary token"},
        {"root ::= \"a\"{2,1}\n", "n < m"},
        {"root ::= \"x\" ]\n", "unexpected"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        k3_error err = {0};
        k3_grammar *g = compile_kind(v, K3_GRAMMAR_GBNF, bad[i][0], &err);
        CHECKF(!g, "grammar %s should not compile", bad[i][0]);
        CHECKF(strstr(err.msg, bad[i][1]), "grammar %s: message \"%s\" lacks \"%s\"", bad[i][0], err.msg, bad[i][1]);
        k3_grammar_free(g);
    }
}

/* ---- choices ----------------------------------------------------------------------------- */

K3_TEST(grammar_choice) {
    k3_grammar_vocab *v = byte_vocab();
    REQUIRE(v);
    const char *ch[] = {"yes", "no", "not sure", "y\xc3\xa9s"};
    k3_grammar_spec spec = {.kind = K3_GRAMMAR_CHOICE, .choices = ch, .n_choices = 4};
    k3_grammar *g = NULL;
    k3_error err = {0};
    REQUIRE(k3_grammar_compile(&g, v, &spec, &err) == K3_OK);
    CHECK(str_match(g, "yes") == 1);
    CHECK(str_match(g, "no") == 1);
    CHECK(str_match(g, "not sure") == 1);
    CHECK(str_match(g, "y\xc3\xa9s") == 1);
    CHECK(str_match(g, "not") == 0);
    CHECK(str_match(g, "nos") == 0);
    k3_grammar_free(g);
    spec.n_choices = 0;
    CHECK(k3_grammar_compile(&g, v, &spec, &err) == K3_ERR_ARG);
}

/* ---- JSON Schema, byte by byte ------------------------------------------------------------ */

typedef struct js_case {
    const char *schema;
    const char *yes[8];
    const char *no[8];
} js_case;

static void run_js_cases(const js_case *cases, size_t n, bool compact) {
    k3_grammar_vocab *v = byte_vocab();
    if (!v) return;
    for (size_t i = 0; i < n; i++) {
        k3_grammar_spec spec = {.kind = K3_GRAMMAR_JSON_SCHEMA, .text = cases[i].schema, .compact = compact};
        k3_grammar *g = NULL;
        k3_error err = {0};
        CHECKF(k3_grammar_compile(&g, v, &spec, &err) == K3_OK, "schema %s: %s", cases[i].schema, err.msg);
        if (!g) continue;
        for (int k = 0; k < 8 && cases[i].yes[k]; k++)
            CHECKF(str_match(g, cases[i].yes[k]) == 1, "schema %s should accept %s", cases[i].schema, cases[i].yes[k]);
        for (int k = 0; k < 8 && cases[i].no[k]; k++)
            CHECKF(str_match(g, cases[i].no[k]) == 0, "schema %s should reject %s", cases[i].schema, cases[i].no[k]);
        k3_grammar_free(g);
    }
}

K3_TEST(grammar_json_scalars) {
    static const js_case cases[] = {
        {"{\"type\":\"integer\"}", {"0", "-12", "1.0", "7.000"}, {"01", "1.5", "1e3", "\"1\"", "-", "+1"}},
        {"{\"type\":\"number\"}", {"0", "-1.5e+10", "3.25", "2E-3"}, {"1.", ".5", "0x1", "--1", "NaN"}},
        {"{\"type\":\"boolean\"}", {"true", "false"}, {"True", "1", "null"}},
        {"{\"type\":\"null\"}", {"null"}, {"nul", "\"null\""}},
        {"{\"type\":\"string\"}",
         {"\"\"", "\"a\\\"b\"", "\"\\u00e9\\ud83d\\ude00\"", "\"\xe2\x82\xac\""},
         {"\"a", "\"\\x\"", "\"\\ud83d\"", "\"\x01\"", "\"\xc3\"", "\"\xed\xa0\x80\""}},
        {"{\"type\":[\"string\",\"null\"]}", {"null", "\"x\""}, {"1", "true"}},
        {"{\"type\":\"string\",\"nullable\":true}", {"null", "\"x\""}, {"1"}},
        {"{\"type\":\"integer\",\"minimum\":-5,\"maximum\":120}",
         {"-5", "0", "99", "120", "-0", "120.0"},
         {"-6", "121", "1000", "-10"}},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":0,\"exclusiveMaximum\":10}", {"1", "9"}, {"0", "10", "-0"}},
        {"{\"type\":\"number\",\"minimum\":1.5,\"maximum\":2.25}",
         {"1.5", "2", "2.25", "1.999", "2.250"},
         {"1.49", "2.251", "3", "1"}},
        {"{\"type\":\"number\",\"exclusiveMaximum\":-0.5}", {"-0.6", "-1", "-100.25"}, {"-0.5", "0", "-0.49"}},
        {"{\"type\":\"integer\",\"multipleOf\":7}", {"0", "14", "-21", "700"}, {"1", "15", "-20"}},
        {"{\"type\":\"number\",\"multipleOf\":0.25}", {"0.5", "1", "-2.75", "1.250"}, {"0.3", "1.125"}},
        {"{\"type\":\"integer\",\"minimum\":10,\"multipleOf\":5}", {"10", "15", "1000"}, {"5", "12", "0"}},
        {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}",
         {"\"ab\"", "\"\xc3\xa9\xc3\xa9\"", "\"a\\nb\""},
         {"\"a\"", "\"abcd\"", "\"\""}},
        {"{\"type\":\"string\",\"pattern\":\"^[a-z]+-[0-9]+$\"}", {"\"ab-12\""}, {"\"ab12\"", "\"Ab-1\"", "\"ab-1x\""}},
        {"{\"type\":\"string\",\"pattern\":\"b+\"}", {"\"abbbc\"", "\"b\""}, {"\"ac\""}},
        {"{\"type\":\"string\",\"pattern\":\"^a\\\"\\\\\\\\\"}", {"\"a\\\"\\\\xyz\""}, {"\"a\\\"x\""}},
        {"{\"enum\":[\"red\",\"green\",1,null,[1,2],{\"a\":true}]}",
         {"\"red\"", "1", "1.0", "null", "[1,2]", "[ 1 , 2 ]", "{\"a\": true}"},
         {"\"blue\"", "2", "[2,1]", "\"1\""}},
        {"{\"const\":\"a/b\"}", {"\"a/b\"", "\"a\\/b\""}, {"\"ab\""}},
        {"{\"enum\":[\"x\",\"yy\",3],\"type\":\"string\",\"maxLength\":1}", {"\"x\""}, {"\"yy\"", "3"}},
        {"{\"type\":\"string\",\"format\":\"date\"}",
         {"\"2024-02-29\"", "\"1999-12-31\""},
         {"\"2023-02-29\"", "\"2024-13-01\"", "\"2024-04-31\"", "\"24-01-01\""}},
        {"{\"type\":\"string\",\"format\":\"date-time\"}",
         {"\"2024-01-01T12:30:00Z\"", "\"2024-01-01t12:30:00.5+05:30\""},
         {"\"2024-01-01T24:00:00Z\"", "\"2024-01-01 12:30:00Z\"", "\"2024-01-01T12:30:00\""}},
        {"{\"type\":\"string\",\"format\":\"uuid\"}",
         {"\"123e4567-e89b-12d3-a456-426614174000\""},
         {"\"123e4567e89b12d3a456426614174000\"", "\"123e4567-e89b-12d3-a456-42661417400g\""}},
        {"{\"type\":\"string\",\"format\":\"ipv4\"}",
         {"\"192.168.0.1\"", "\"0.0.0.0\""},
         {"\"256.1.1.1\"", "\"01.2.3.4\"", "\"1.2.3\""}},
        {"{\"type\":\"string\",\"format\":\"ipv6\"}",
         {"\"::1\"", "\"fe80::1:2\"", "\"1:2:3:4:5:6:7:8\"", "\"::ffff:1.2.3.4\""},
         {"\"1:2:3:4:5:6:7:8:9\"", "\"1::2::3\"", "\"12345::\""}},
        {"{\"type\":\"string\",\"format\":\"email\"}",
         {"\"joe.bloggs@example.com\"", "\"a+b@x-y.org\""},
         {"\"joe@\"", "\".a@x.com\"", "\"a..b@x.com\"", "\"ab\""}},
        {"{\"type\":\"string\",\"format\":\"uri\"}",
         {"\"https://example.com/a?b=c#d\"", "\"urn:isbn:123\"", "\"mailto:a@b.c\""},
         {"\"//example.com\"", "\"http://exa mple.com\"", "\"1http://x\""}},
    };
    run_js_cases(cases, sizeof cases / sizeof cases[0], false);
}

K3_TEST(grammar_json_structures) {
    static const js_case cases[] = {
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"}},"
         "\"required\":[\"b\"],\"additionalProperties\":false}",
         {"{\"b\":\"x\"}", "{\"a\":1,\"b\":\"x\"}", "{ \"a\" : 1 ,\n \"b\" : \"\" }"},
         {"{}", "{\"a\":1}", "{\"b\":\"x\",\"a\":1}", "{\"b\":\"x\",\"c\":1}", "{\"b\":1}", "{\"a\":1,\"b\":\"x\",}"}},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}",
         {"{}", "{\"a\":1}", "{\"a\":1,\"z\":[true]}", "{\"zz\":{}}", "{\"aa\":\"s\"}", "{\"\":1}"},
         {"{\"a\":\"s\"}", "{\"z\":1,\"a\":2}", "{\"a\":1,\"a\":2}"}},
        {"{\"type\":\"object\",\"patternProperties\":{\"^x-\":{\"type\":\"integer\"}},\"additionalProperties\":{"
         "\"type\":\"string\"}}",
         {"{\"x-a\":1,\"b\":\"s\"}", "{\"y\":\"s\"}"},
         {"{\"x-a\":\"s\"}", "{\"b\":1}"}},
        {"{\"type\":\"object\",\"minProperties\":1,\"maxProperties\":2}",
         {"{\"a\":1}", "{\"a\":1,\"b\":2}"},
         {"{}", "{\"a\":1,\"b\":2,\"c\":3}"}},
        {"{\"type\":\"object\",\"propertyNames\":{\"pattern\":\"^[a-z]+$\"}}", {"{\"ab\":1}", "{}"}, {"{\"aB\":1}"}},
        {"{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":1,\"maxItems\":3}",
         {"[1]", "[1,2,3]", "[ 1 ,\n2 ]"},
         {"[]", "[1,2,3,4]", "[1,]", "[\"a\"]"}},
        {"{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"},{\"type\":\"integer\"}],\"items\":false}",
         {"[]", "[\"a\"]", "[\"a\",1]"},
         {"[1]", "[\"a\",1,2]"}},
        {"{\"type\":\"array\",\"prefixItems\":[{\"const\":1}],\"items\":{\"type\":\"string\"},\"minItems\":2}",
         {"[1,\"a\"]", "[1,\"a\",\"b\"]"},
         {"[1]", "[1,2]"}},
        {"{\"type\":\"array\",\"items\":[{\"type\":\"string\"}],\"additionalItems\":{\"type\":\"boolean\"}}",
         {"[\"a\",true,false]"},
         {"[\"a\",1]"}},
        {"{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"integer\",\"minimum\":3}]}", {"\"x\"", "3"}, {"2", "null"}},
        {"{\"oneOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]}", {"\"x\"", "3"}, {"null"}},
        {"{\"oneOf\":[{\"type\":\"object\",\"properties\":{\"kind\":{\"const\":\"a\"},\"x\":{\"type\":\"integer\"}},"
         "\"required\":[\"kind\"],\"additionalProperties\":false},"
         "{\"type\":\"object\",\"properties\":{\"kind\":{\"const\":\"b\"}},\"required\":[\"kind\"],"
         "\"additionalProperties\":false}]}",
         {"{\"kind\":\"a\",\"x\":1}", "{\"kind\":\"b\"}"},
         {"{\"kind\":\"c\"}", "{\"kind\":\"b\",\"x\":1}"}},
        {"{\"allOf\":[{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]},"
         "{\"properties\":{\"b\":{\"type\":\"string\"}},\"required\":[\"b\"],\"additionalProperties\":{\"type\":"
         "\"integer\"}}]}",
         {"{\"a\":1,\"b\":\"x\"}", "{\"a\":1,\"b\":\"x\",\"c\":1}"},
         {"{\"a\":1}", "{\"b\":\"x\"}", "{\"a\":1,\"b\":\"x\",\"c\":\"s\"}"}},
        {"{\"allOf\":[{\"type\":\"integer\",\"minimum\":1},{\"maximum\":5},{\"multipleOf\":2}]}",
         {"2", "4"},
         {"0", "3", "6"}},
        {"{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
         "\"next\":{\"$ref\":\"#/$defs/node\"}},\"required\":[\"v\"],\"additionalProperties\":false}},"
         "\"$ref\":\"#/$defs/node\"}",
         {"{\"v\":1}", "{\"v\":1,\"next\":{\"v\":2,\"next\":{\"v\":3}}}"},
         {"{\"v\":1,\"next\":{}}", "{}"}},
        {"{\"definitions\":{\"s\":{\"type\":\"string\"}},\"type\":\"array\",\"items\":{\"$ref\":\"#/definitions/s\"}}",
         {"[\"a\",\"b\"]"},
         {"[1]"}},
        {"{\"type\":\"object\",\"properties\":{\"t\":{\"$anchor\":\"T\",\"type\":\"integer\"},\"u\":{\"$ref\":\"#T\"}}"
         "}",
         {"{\"t\":1,\"u\":2}"},
         {"{\"u\":\"x\"}"}},
        {"{\"type\":\"array\",\"items\":{\"$ref\":\"#\"},\"maxItems\":2}", {"[]", "[[],[[]]]"}, {"[[],[],[]]", "[1]"}},
        {"{\"not\":{\"type\":\"string\"}}", {"1", "null", "{}"}, {"\"x\""}},
        {"true", {"1", "\"x\"", "{\"a\":[null]}"}, {"", "{"}},
        {"{\"type\":\"object\"}", {"{}", "{\"a\":{\"b\":[1,\"x\",null]}}"}, {"[]", "{\"a\"}"}},
    };
    run_js_cases(cases, sizeof cases / sizeof cases[0], false);
}

K3_TEST(grammar_json_compact) {
    static const js_case cases[] = {
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"items\":{\"type\":\"integer\"}}}}",
         {"{\"a\":[1,2]}", "{}"},
         {"{ \"a\":[1,2]}", "{\"a\":[1, 2]}", "{\"a\": [1]}"}},
        {"{\"type\":\"object\"}", {"{\"x\":{\"y\":[1,{}]}}"}, {"{\"x\": 1}"}},
    };
    run_js_cases(cases, sizeof cases / sizeof cases[0], true);
}

K3_TEST(grammar_json_errors) {
    k3_grammar_vocab *v = byte_vocab();
    REQUIRE(v);
    static const char *const bad[][2] = {
        {"{\"type\":\"object\",\"properties\":{\"x\":{\"dependentSchemas\":{}}}}",
         "json_schema.properties.x: keyword 'dependentSchemas' is not supported"},
        {"{\"if\":{\"type\":\"string\"},\"then\":{\"minLength\":1}}", "keyword 'if' is not supported"},
        {"{\"type\":\"array\",\"items\":{\"contains\":{}}}", "json_schema.items: keyword 'contains'"},
        {"{\"type\":\"array\",\"uniqueItems\":true}", "uniqueItems"},
        {"{\"type\":\"string\",\"format\":\"hostname-ish\"}", "format 'hostname-ish' is not supported"},
        {"{\"$ref\":\"https://example.com/s.json\"}", "points outside the schema"},
        {"{\"$ref\":\"#/$defs/missing\"}", "does not resolve"},
        {"{\"oneOf\":[{\"type\":\"integer\"},{\"minimum\":2}]}", "oneOf branches 0 and 1 may both match"},
        {"{\"not\":{\"minimum\":3}}", "'not' is supported only around 'type'"},
        {"{\"type\":\"strings\"}", "unknown type"},
        {"{\"type\":\"string\",\"pattern\":\"(?=x)\"}", "lookahead"},
        {"{\"type\":\"string\",\"minLength\":5,\"maxLength\":2}", "nothing can match"},
        {"{\"type\":\"object\",\"properties\":{\"a\":false},\"required\":[\"a\"]}", "nothing can match"},
        {"{\"type\":", "not valid JSON"},
        {"{\"$defs\":{\"a\":{\"$ref\":\"#/$defs/b\"},\"b\":{\"$ref\":\"#/$defs/a\"}},\"$ref\":\"#/$defs/a\"}", "cycle"},
        {"{\"unevaluatedProperties\":false}", "unevaluatedProperties"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        k3_error err = {0};
        k3_grammar *g = compile_kind(v, K3_GRAMMAR_JSON_SCHEMA, bad[i][0], &err);
        CHECKF(!g, "schema %s should not compile", bad[i][0]);
        CHECKF(strstr(err.msg, bad[i][1]), "schema %s: message \"%s\" lacks \"%s\"", bad[i][0], err.msg, bad[i][1]);
        k3_grammar_free(g);
    }
    /* annotations and unknown keywords are fine */
    k3_error err = {0};
    k3_grammar *g =
        compile_kind(v, K3_GRAMMAR_JSON_SCHEMA,
                     "{\"title\":\"t\",\"description\":\"d\",\"examples\":[1],\"$comment\":\"c\",\"default\":2,"
                     "\"x-vendor\":{\"if\":1},\"type\":\"integer\"}",
                     &err);
    CHECKF(g, "%s", err.msg);
    k3_grammar_free(g);
}

/* ---- masks against the scalar reference -------------------------------------------------- */

/* The reference mask: every token of the vocabulary tried by feeding it
 * (accept, then roll back). */
static void ref_mask(k3_grammar_matcher *m, const k3_grammar_vocab *v, uint64_t *mask) {
    k3_error err = {0};
    memset(mask, 0, v->n_words * sizeof *mask);
    for (int32_t id = 0; id < v->n_vocab; id++) {
        if (k3_grammar_matcher_accept(m, id, &err) == K3_OK) {
            mask[id >> 6] |= (uint64_t)1 << (id & 63);
            k3_grammar_matcher_rollback(m, 1, &err);
        }
        err.status = K3_OK;
        err.msg[0] = 0;
    }
}

static uint64_t rng(uint64_t *s) {
    uint64_t x = (*s += 0x9e3779b97f4a7c15u);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9u;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebu;
    return x ^ (x >> 31);
}

/* A random walk of at most steps tokens, each step's fast mask compared
 * with the reference. Returns the number of steps checked. */
static int walk_check(k3_grammar *g, const k3_grammar_vocab *v, int steps, uint64_t seed, const char *what) {
    k3_grammar_matcher *m;
    k3_error err = {0};
    if (k3_grammar_matcher_init(&m, g, &err) != K3_OK) return 0;
    uint64_t *a = malloc(v->n_words * 8), *b = malloc(v->n_words * 8);
    int32_t *allowed = malloc((size_t)v->n_vocab * sizeof *allowed);
    int done = 0;
    for (int s = 0; s < steps; s++) {
        CHECKF(k3_grammar_matcher_fill_mask(m, a, &err) == K3_OK, "%s: %s", what, err.msg);
        ref_mask(m, v, b);
        bool same = !memcmp(a, b, v->n_words * 8);
        if (!same) {
            for (int32_t id = 0; id < v->n_vocab; id++) {
                bool x = (a[id >> 6] >> (id & 63)) & 1, y = (b[id >> 6] >> (id & 63)) & 1;
                if (x != y) {
                    size_t len = v->off[id + 1] - v->off[id];
                    CHECKF(false, "%s: step %d: token %d (\"%.*s\") fast %d reference %d", what, s, id, (int)len,
                           (const char *)v->bytes + v->off[id], x, y);
                    break;
                }
            }
            break;
        }
        done++;
        int32_t n = 0;
        for (int32_t id = 0; id < v->n_vocab; id++)
            if ((b[id >> 6] >> (id & 63)) & 1) {
                bool eos = false;
                for (int32_t e = 0; e < v->n_eos; e++) eos |= v->eos[e] == id;
                if (!eos) allowed[n++] = id;
            }
        if (n == 0) break;
        /* prefer short tokens now and then, so that walks reach deep states */
        int32_t pick = allowed[rng(&seed) % (uint64_t)n];
        if (rng(&seed) % 3 == 0) {
            for (int t = 0; t < 8; t++) {
                int32_t c = allowed[rng(&seed) % (uint64_t)n];
                if (v->off[c + 1] - v->off[c] < v->off[pick + 1] - v->off[pick]) pick = c;
            }
        }
        CHECK(k3_grammar_matcher_accept(m, pick, &err) == K3_OK);
        if (k3_grammar_matcher_is_complete(m) && rng(&seed) % 4 == 0) break;
    }
    free(a);
    free(b);
    free(allowed);
    k3_grammar_matcher_free(m);
    return done;
}

static const char *const WALK_SCHEMAS[] = {
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\",\"minimum\":0},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"bb\",\"c d\"]}},\"ok\":{\"type\":\"boolean\"}},"
    "\"required\":[\"name\"]}",
    "{\"type\":\"array\",\"items\":{\"anyOf\":[{\"type\":\"number\"},{\"type\":\"string\",\"maxLength\":40},{\"type\":"
    "\"null\"}]}}",
    "{\"$defs\":{\"t\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"string\",\"pattern\":\"^[a-z]{1,8}$\"},"
    "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/"
    "t\"}}},\"required\":[\"v\"],\"additionalProperties\":false}},"
    "\"$ref\":\"#/$defs/t\"}",
    "{\"type\":\"object\",\"properties\":{\"when\":{\"type\":\"string\",\"format\":\"date-time\"},"
    "\"n\":{\"type\":\"number\",\"minimum\":-1.5,\"maximum\":1000}},\"additionalProperties\":{\"type\":\"integer\"}}",
    "true",
    "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"minLength\":2,\"maxLength\":5},"
    "\"b\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"minLength\":12,\"maxLength\":150}}},"
    "\"additionalProperties\":false}",
};

K3_TEST(grammar_mask_reference_mini) {
    k3_grammar_vocab *v = mini_vocab();
    REQUIRE(v);
    int steps = 0;
    for (size_t i = 0; i < sizeof WALK_SCHEMAS / sizeof WALK_SCHEMAS[0]; i++) {
        for (int compact = 0; compact < 2; compact++) {
            k3_grammar_spec spec = {.kind = K3_GRAMMAR_JSON_SCHEMA, .text = WALK_SCHEMAS[i], .compact = compact};
            k3_grammar *g = NULL;
            k3_error err = {0};
            REQUIREF(k3_grammar_compile(&g, v, &spec, &err) == K3_OK, "%s", err.msg);
            for (uint64_t seed = 1; seed <= 6; seed++) steps += walk_check(g, v, 60, seed * 7919 + i, WALK_SCHEMAS[i]);
            k3_grammar_free(g);
        }
    }
    /* a GBNF grammar with specials, a regex */
    k3_error err = {0};
    k3_grammar *g =
        compile_kind(v, K3_GRAMMAR_GBNF,
                     "root ::= (<|open|> word (\" \" word)* <|close|>)+\nword ::= [a-z]+ | [0-9]{1,3}\n", &err);
    REQUIREF(g, "%s", err.msg);
    for (uint64_t seed = 1; seed <= 4; seed++) steps += walk_check(g, v, 60, seed, "gbnf");
    k3_grammar_free(g);
    g = compile_kind(v, K3_GRAMMAR_REGEX, "(the|a) [a-z]+( [a-z]+){0,5}\\.", &err);
    REQUIREF(g, "%s", err.msg);
    for (uint64_t seed = 1; seed <= 4; seed++) steps += walk_check(g, v, 40, seed, "regex");
    k3_grammar_free(g);
    CHECKF(steps > 400, "only %d steps were checked", steps);
}

/* Tool-call grammars (specials, raw string arguments with length limits)
 * against the reference on the k3-mini vocabulary. */
K3_TEST(grammar_mask_reference_tools) {
    k3_grammar_vocab *v = mini_vocab();
    REQUIRE(v);
    k3_grammar_tool t[2] =
        {{"post",
          "{\"type\":\"object\",\"properties\":{\"text\":{\"type\":\"string\",\"minLength\":2,\"maxLength\":9},"
          "\"n\":{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}}},"
          "\"required\":[\"text\"]}"},
         {"free", "{\"type\":\"object\",\"properties\":{\"q\":{\"type\":\"string\"}},\"additionalProperties\":true}"}};
    int steps = 0;
    for (int mode = 0; mode < 3; mode++) {
        k3_grammar_spec spec = {.kind = K3_GRAMMAR_TOOL_CALLS,
                                .tools = t,
                                .n_tools = 2,
                                .parallel_calls = mode == 1,
                                .thinking = mode == 2};
        k3_grammar *g = NULL;
        k3_error err = {0};
        REQUIREF(k3_grammar_compile(&g, v, &spec, &err) == K3_OK, "%s", err.msg);
        for (uint64_t seed = 1; seed <= 5; seed++) steps += walk_check(g, v, 80, seed * 31 + (uint64_t)mode, "tools");
        k3_grammar_free(g);
    }
    CHECKF(steps > 300, "only %d steps were checked", steps);
}

K3_TEST(grammar_mask_reference_o200k) {
    k3_grammar_vocab *v = o200k_vocab();
    REQUIRE(v);
    int steps = 0;
    for (size_t i = 0; i < sizeof WALK_SCHEMAS / sizeof WALK_SCHEMAS[0]; i++) {
        k3_grammar_spec spec = {.kind = K3_GRAMMAR_JSON_SCHEMA, .text = WALK_SCHEMAS[i]};
        k3_grammar *g = NULL;
        k3_error err = {0};
        REQUIREF(k3_grammar_compile(&g, v, &spec, &err) == K3_OK, "%s", err.msg);
        steps += walk_check(g, v, 6, 100 + i, WALK_SCHEMAS[i]);
        k3_grammar_free(g);
    }
    CHECKF(steps >= 15, "only %d steps were checked", steps);
}

/* ---- matcher operations ----------------------------------------------------------------- */

static int32_t *encode(k3_tokenizer *t, const char *s, size_t *n) {
    int32_t *ids = NULL;
    k3_error err = {0};
    if (k3_tokenizer_encode(t, s, strlen(s), &ids, n, &err) != K3_OK) return NULL;
    return ids;
}

K3_TEST(grammar_matcher_rollback_clone) {
    k3_grammar_vocab *v = o200k_vocab();
    REQUIRE(v);
    k3_error err = {0};
    k3_grammar *g = compile_kind(v, K3_GRAMMAR_JSON_SCHEMA, WALK_SCHEMAS[0], &err);
    REQUIREF(g, "%s", err.msg);
    const char *text = "{\"name\": \"Ada Lovelace\", \"age\": 36, \"tags\": [\"a\", \"c d\"], \"ok\": true}";
    size_t n;
    int32_t *ids = encode(o200k_tok, text, &n);
    REQUIRE(ids && n > 6);
    k3_grammar_matcher *m, *c = NULL;
    REQUIRE(k3_grammar_matcher_init(&m, g, &err) == K3_OK);
    size_t words = v->n_words;
    uint64_t *masks = malloc((n + 1) * words * 8), *x = malloc(words * 8);
    for (size_t i = 0; i <= n; i++) {
        CHECK(k3_grammar_matcher_fill_mask(m, masks + i * words, &err) == K3_OK);
        CHECK(k3_grammar_matcher_is_complete(m) == (i == n));
        if (i < n) CHECK(k3_grammar_matcher_accept(m, ids[i], &err) == K3_OK);
        if (i == n / 2) CHECK(k3_grammar_matcher_clone(&c, m, &err) == K3_OK);
    }
    CHECK(k3_grammar_matcher_n_tokens(m) == (int32_t)n);
    /* rollback to every point gives the same masks */
    for (size_t back = 1; back <= n; back += 3) {
        CHECK(k3_grammar_matcher_rollback(m, (int32_t)back, &err) == K3_OK);
        size_t at = n - back;
        CHECK(k3_grammar_matcher_fill_mask(m, x, &err) == K3_OK);
        CHECKF(!memcmp(x, masks + at * words, words * 8), "mask after rolling back to %zu", at);
        size_t acc = 0;
        CHECK(k3_grammar_matcher_accept_tokens(m, ids + at, back, &acc, &err) == K3_OK && acc == back);
    }
    CHECK(k3_grammar_matcher_rollback(m, (int32_t)n + 1, &err) == K3_ERR_ARG);
    /* the clone goes on independently */
    REQUIRE(c);
    CHECK(k3_grammar_matcher_n_tokens(c) == (int32_t)(n / 2 + 1));
    CHECK(k3_grammar_matcher_fill_mask(c, x, &err) == K3_OK);
    CHECK(!memcmp(x, masks + (n / 2 + 1) * words, words * 8));
    /* rebuild (preemption): a fresh matcher fed the tokens */
    k3_grammar_matcher *r;
    REQUIRE(k3_grammar_matcher_init(&r, g, &err) == K3_OK);
    size_t acc = 0;
    CHECK(k3_grammar_matcher_accept_tokens(r, ids, n, &acc, &err) == K3_OK && acc == n);
    CHECK(k3_grammar_matcher_is_complete(r));
    /* a wrong token is refused and changes nothing */
    k3_grammar_matcher_reset(r);
    CHECK(k3_grammar_matcher_n_tokens(r) == 0);
    int32_t bad = ids[1];
    CHECK(k3_grammar_matcher_accept(r, bad, &err) == K3_ERR_ARG); /* the second token first */
    CHECK(k3_grammar_matcher_n_tokens(r) == 0);
    CHECK(k3_grammar_matcher_fill_mask(r, x, &err) == K3_OK && !memcmp(x, masks, words * 8));
    /* the end-of-generation ids: none in o200k's bare vocabulary; the mask is complete only at the end */
    k3_grammar_matcher_free(r);
    k3_grammar_matcher_free(c);
    k3_grammar_matcher_free(m);
    free(masks);
    free(x);
    free(ids);
    k3_grammar_free(g);
}

K3_TEST(grammar_batch_pool) {
    k3_grammar_vocab *v = o200k_vocab();
    REQUIRE(v);
    k3_error err = {0};
    k3_grammar *g1 = compile_kind(v, K3_GRAMMAR_JSON_SCHEMA, WALK_SCHEMAS[0], &err);
    k3_grammar *g2 = compile_kind(v, K3_GRAMMAR_JSON_SCHEMA, WALK_SCHEMAS[1], &err);
    REQUIRE(g1 && g2);
    k3_pool *pool = NULL;
    REQUIRE(k3_pool_init(&pool, 2, &err) == K3_OK);
    enum { N = 6 };
    k3_grammar_matcher *m[N];
    uint64_t *masks[N], *one = malloc(v->n_words * 8);
    const char *prefix[N] = {"{\"name\": \"x", "[1, \"ab", "{", "[", "{\"name\":\"a\",\"tags\":[", "[null,"};
    for (int i = 0; i < N; i++) {
        REQUIRE(k3_grammar_matcher_init(&m[i], i % 2 ? g2 : g1, &err) == K3_OK);
        size_t n;
        int32_t *ids = encode(o200k_tok, prefix[i], &n);
        size_t acc;
        CHECKF(k3_grammar_matcher_accept_tokens(m[i], ids, n, &acc, &err) == K3_OK, "prefix %d: %s", i, err.msg);
        free(ids);
        masks[i] = malloc(v->n_words * 8);
    }
    CHECK(k3_grammar_fill_masks(m, masks, N, pool, &err) == K3_OK);
    for (int i = 0; i < N; i++) {
        CHECK(k3_grammar_matcher_fill_mask(m[i], one, &err) == K3_OK);
        CHECKF(!memcmp(one, masks[i], v->n_words * 8), "batch mask %d", i);
        k3_grammar_matcher_free(m[i]);
        free(masks[i]);
    }
    free(one);
    k3_pool_free(pool);
    k3_grammar_free(g1);
    k3_grammar_free(g2);
}

K3_TEST(grammar_mask_apply_forced) {
    k3_grammar_vocab *v = byte_vocab();
    REQUIRE(v);
    k3_error err = {0};
    k3_grammar *g = compile_kind(v, K3_GRAMMAR_JSON_SCHEMA,
                                 "{\"type\":\"object\",\"properties\":{\"alpha\":{\"type\":\"integer\"}},"
                                 "\"required\":[\"alpha\"],\"additionalProperties\":false}",
                                 &err);
    REQUIREF(g, "%s", err.msg);
    k3_grammar_matcher *m;
    REQUIRE(k3_grammar_matcher_init(&m, g, &err) == K3_OK);
    char buf[32];
    size_t len;
    CHECK(k3_grammar_matcher_forced(m, buf, sizeof buf, &len, &err) == K3_OK);
    CHECK(len == 1 && buf[0] == '{'); /* then whitespace may come */
    CHECK(k3_grammar_matcher_accept(m, '{', &err) == K3_OK);
    CHECK(k3_grammar_matcher_accept(m, '"', &err) == K3_OK);
    CHECK(k3_grammar_matcher_forced(m, buf, sizeof buf, &len, &err) == K3_OK);
    CHECK(len == 6 && !memcmp(buf, "alpha\"", 6));
    CHECK(k3_grammar_matcher_n_tokens(m) == 2);
    uint64_t mask[5];
    float logits[300];
    for (int i = 0; i < 300; i++) logits[i] = 1;
    CHECK(k3_grammar_matcher_fill_mask(m, mask, &err) == K3_OK);
    k3_grammar_mask_apply(v, mask, logits, 300);
    CHECK(logits['a'] == 1 && logits['b'] < -1e30f && logits[299] < -1e30f && logits['"'] < -1e30f);
    k3_grammar_matcher_free(m);
    k3_grammar_free(g);
}

/* ---- K3 tool calls --------------------------------------------------------------------------- */

/* The ids the model writes for the assistant message asst (JSON) after a
 * user turn: the chat encoder's rendering of the conversation minus that of
 * the prompt with its generation prompt. */
static int32_t *assistant_ids(const char *asst, const char *tools, bool thinking, size_t *n) {
    char msgs[4096], prompt[1024];
    snprintf(prompt, sizeof prompt, "[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}]");
    snprintf(msgs, sizeof msgs, "[{\"role\":\"user\",\"content\":\"Weather in Paris?\"},%s]", asst);
    k3_chat_options o = {.add_generation_prompt = true, .thinking = thinking};
    int32_t *p = NULL, *f = NULL;
    size_t np = 0, nf = 0;
    k3_error err = {0};
    if (k3_chat_encode_json(mini_tok, prompt, tools, &o, &p, &np, &err) != K3_OK) {
        fprintf(stderr, "encode: %s\n", err.msg);
        return NULL;
    }
    o.add_generation_prompt = false;
    if (k3_chat_encode_json(mini_tok, msgs, tools, &o, &f, &nf, &err) != K3_OK || nf < np ||
        memcmp(p, f, np * sizeof *p)) {
        fprintf(stderr, "encode: %s (prefix %s)\n", err.msg,
                nf >= np && !memcmp(p, f, np * sizeof *p) ? "same" : "differs");
        free(p);
        free(f);
        return NULL;
    }
    *n = nf - np;
    memmove(f, f + np, *n * sizeof *f);
    free(p);
    return f;
}

/* Feeds ids through g checking each against the mask; the index of the
 * first refused id, or -1 when all pass (the last being an end id). */
static long feed(k3_grammar *g, const int32_t *ids, size_t n) {
    const k3_grammar_vocab *v = k3_grammar_mask_words(mini_vocab()) ? mini_vocab() : NULL;
    k3_grammar_matcher *m;
    k3_error err = {0};
    if (!v || k3_grammar_matcher_init(&m, g, &err) != K3_OK) return -2;
    uint64_t *mask = malloc(v->n_words * 8);
    long r = -1;
    for (size_t i = 0; i < n && r < 0; i++) {
        k3_grammar_matcher_fill_mask(m, mask, &err);
        bool allowed = (mask[ids[i] >> 6] >> (ids[i] & 63)) & 1;
        bool ok = k3_grammar_matcher_accept(m, ids[i], &err) == K3_OK;
        if (!allowed || !ok) r = (long)i;
    }
    if (r < 0 && !k3_grammar_matcher_is_ended(m)) r = (long)n;
    free(mask);
    k3_grammar_matcher_free(m);
    return r;
}

static const char TOOLS[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\",\"minimum\":1},"
    "\"unit\":{\"enum\":[\"c\",\"f\"]},\"hours\":{\"type\":\"array\",\"items\":{\"type\":\"integer\"}},"
    "\"opts\":{\"type\":\"object\",\"properties\":{\"wind\":{\"type\":\"boolean\"}}},\"note\":{\"type\":[\"string\","
    "\"null\"]}},"
    "\"required\":[\"city\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"now\",\"parameters\":{\"type\":\"object\",\"properties\":{}}}}]";

static k3_grammar *tool_grammar(bool parallel, bool thinking, const char *only) {
    json_error_t je;
    json_t *arr = json_loads(TOOLS, 0, &je);
    k3_grammar_tool t[2];
    char *params[2] = {0};
    int32_t n = 0;
    for (size_t i = 0; i < json_array_size(arr); i++) {
        json_t *fn = json_object_get(json_array_get(arr, i), "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (only && strcmp(only, name)) continue;
        params[n] = json_dumps(json_object_get(fn, "parameters"), JSON_COMPACT);
        t[n] = (k3_grammar_tool){name, params[n]};
        n++;
    }
    k3_grammar_spec spec = {.kind = K3_GRAMMAR_TOOL_CALLS,
                            .tools = t,
                            .n_tools = n,
                            .parallel_calls = parallel,
                            .thinking = thinking};
    k3_grammar *g = NULL;
    k3_error err = {0};
    if (k3_grammar_compile(&g, mini_vocab(), &spec, &err) != K3_OK) fprintf(stderr, "tool grammar: %s\n", err.msg);
    for (int32_t i = 0; i < n; i++) free(params[i]);
    json_decref(arr);
    return g;
}

K3_TEST(grammar_tool_calls) {
    REQUIRE(mini_vocab());
    k3_grammar *g = tool_grammar(false, false, NULL), *gp = tool_grammar(true, false, NULL);
    k3_grammar *gn = tool_grammar(false, false, "now"), *gt = tool_grammar(false, true, NULL);
    REQUIRE(g && gp && gn && gt);
    static const char *const one =
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":"
        "{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris \\\\\\\"Ville\\\\\\\" & co\\\", "
        "\\\"days\\\": 3, "
        "\\\"unit\\\": \\\"c\\\", \\\"hours\\\": [1, 2], \\\"opts\\\": {\\\"wind\\\": true}, \\\"note\\\": null}\"}}]}";
    size_t n;
    int32_t *ids = assistant_ids(one, TOOLS, false, &n);
    REQUIRE(ids);
    CHECKF(feed(g, ids, n) == -1, "one call refused at %ld", feed(g, ids, n));
    CHECK(feed(gp, ids, n) == -1);
    CHECK(feed(gn, ids, n) >= 0); /* only "now" may be called */
    /* the text parses back into the same call */
    char *text;
    size_t len;
    k3_error err = {0};
    REQUIRE(k3_tokenizer_decode(mini_tok, ids, n, &text, &len, &err) == K3_OK);
    k3_chat_reply rep;
    REQUIRE(k3_chat_parse_reply(text, len, false, &rep, &err) == K3_OK);
    CHECK(rep.n_tool_calls == 1 && rep.tool_calls_json && strstr(rep.tool_calls_json, "get_weather"));
    k3_chat_reply_free(&rep);
    free(text);
    free(ids);
    /* two calls need parallel_calls; the second is index 2 */
    static const char *const two =
        "{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":"
        "{\"name\":\"now\",\"arguments\":\"{}\"}},{\"id\":\"c2\",\"type\":\"function\",\"function\":{\"name\":\"get_"
        "weather\","
        "\"arguments\":\"{\\\"city\\\": \\\"Oslo\\\"}\"}}]}";
    ids = assistant_ids(two, TOOLS, false, &n);
    REQUIRE(ids);
    CHECK(feed(gp, ids, n) == -1);
    CHECK(feed(g, ids, n) >= 0);
    free(ids);
    /* with thinking: free text, then the calls */
    static const char *const think =
        "{\"role\":\"assistant\",\"reasoning_content\":\"The user wants weather; <b>call</b> it.\",\"content\":null,"
        "\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"now\",\"arguments\":\"{}\"}}]}";
    ids = assistant_ids(think, TOOLS, true, &n);
    REQUIRE(ids);
    CHECK(feed(gt, ids, n) == -1);
    CHECK(feed(g, ids, n) >= 0);
    free(ids);
    /* wrong arguments are refused: a string for days, a missing city, an unknown unit */
    static const char *const bad[] = {"{\\\"city\\\": \\\"x\\\", \\\"days\\\": \\\"3\\\"}", "{\\\"days\\\": 3}",
                                      "{\\\"city\\\": \\\"x\\\", \\\"unit\\\": \\\"k\\\"}",
                                      "{\\\"city\\\": \\\"x\\\", \\\"days\\\": 0}",
                                      "{\\\"city\\\": \\\"x\\\", \\\"extra\\\": 1}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char a[1024];
        snprintf(a, sizeof a,
                 "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\","
                 "\"function\":"
                 "{\"name\":\"get_weather\",\"arguments\":\"%s\"}}]}",
                 bad[i]);
        ids = assistant_ids(a, TOOLS, false, &n);
        REQUIRE(ids);
        CHECKF(feed(g, ids, n) >= 0, "bad arguments %zu accepted", i);
        free(ids);
    }
    k3_grammar_free(g);
    k3_grammar_free(gp);
    k3_grammar_free(gn);
    k3_grammar_free(gt);
}

K3_TEST(grammar_k3_reply_json) {
    k3_grammar_vocab *v = mini_vocab();
    REQUIRE(v);
    const char *schema =
        "{\"type\":\"object\",\"properties\":{\"answer\":{\"type\":\"string\"},\"n\":{\"type\":\"integer\"}},"
        "\"required\":[\"answer\",\"n\"],\"additionalProperties\":false}";
    for (int thinking = 0; thinking < 2; thinking++) {
        k3_grammar_spec spec = {.kind = K3_GRAMMAR_JSON_SCHEMA, .text = schema, .k3_reply = true, .thinking = thinking};
        k3_grammar *g = NULL;
        k3_error err = {0};
        REQUIREF(k3_grammar_compile(&g, v, &spec, &err) == K3_OK, "%s", err.msg);
        const char *ok = thinking
            ? "{\"role\":\"assistant\",\"reasoning_content\":\"hmm\",\"content\":\"{\\\"answer\\\": \\\"Paris\\\", "
              "\\\"n\\\": 2}\"}"
            : "{\"role\":\"assistant\",\"content\":\"{\\\"answer\\\": \\\"Paris\\\", \\\"n\\\": 2}\"}";
        size_t n;
        int32_t *ids = assistant_ids(ok, NULL, thinking, &n);
        REQUIRE(ids);
        CHECKF(feed(g, ids, n) == -1, "thinking %d: refused at %ld", thinking, feed(g, ids, n));
        free(ids);
        const char *no = "{\"role\":\"assistant\",\"content\":\"{\\\"answer\\\": 1, \\\"n\\\": 2}\"}";
        if (!thinking) {
            ids = assistant_ids(no, NULL, false, &n);
            REQUIRE(ids);
            CHECK(feed(g, ids, n) >= 0);
            free(ids);
        }
        k3_grammar_free(g);
    }
    /* the K3 form needs the chat specials */
    k3_grammar_spec spec = {.kind = K3_GRAMMAR_JSON_OBJECT, .k3_reply = true};
    k3_grammar *g = NULL;
    k3_error err = {0};
    REQUIRE(o200k_vocab());
    CHECK(k3_grammar_compile(&g, o200k_vocab(), &spec, &err) == K3_ERR_ARG && strstr(err.msg, "<|open|>"));
}

/* ---- the JSON Schema Test Suite ------------------------------------------------------------- */

/* The keyword an error message names ("keyword 'X'", "format 'X'", ...),
 * for the summary. */
static void error_key(const char *msg, char *out, size_t cap) {
    const char *p = strstr(msg, "keyword '");
    const char *q = p ? p + 9 : NULL;
    if (!q && (p = strstr(msg, "format '"))) q = p;
    if (!q && (p = strstr(msg, "$ref '"))) q = "$ref (remote)";
    if (!q && strstr(msg, "oneOf branches")) q = "oneOf (overlapping)";
    if (!q && strstr(msg, "nothing can match")) q = "(matches nothing)";
    if (!q && strstr(msg, "not supported")) q = msg;
    if (!q) q = msg;
    size_t n = strcspn(q, q == msg ? "" : "'");
    if (q[0] == 'f' && !strncmp(q, "format '", 8)) n = 8 + strcspn(q + 8, "'") + 1;
    snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), q);
}

K3_TEST(grammar_schema_suite) {
    k3_grammar_vocab *v = o200k_vocab();
    REQUIRE(v);
    json_error_t je;
    json_t *cases = json_load_file("tests/golden/grammar/suite.json", JSON_ALLOW_NUL, &je);
    REQUIREF(cases, "tests/golden/grammar/suite.json: %s", je.text);
    size_t words = v->n_words;
    uint64_t *mask = malloc(words * 8);
    int compiled = 0, refused = 0, texts = 0, valid_ok = 0, invalid_ok = 0, false_accept = 0, false_reject = 0;
    int stricter = 0;
    struct {
        char key[96];
        int n;
    } keys[64];
    int nkeys = 0;
    size_t ci;
    json_t *c;
    json_array_foreach(cases, ci, c) {
        const char *file = json_string_value(json_object_get(c, "file"));
        const char *group = json_string_value(json_object_get(c, "group"));
        char *schema = strdup(json_string_value(json_object_get(c, "schema")));
        json_t *cj = json_object_get(c, "compiles");
        bool expect = !json_is_false(cj);
        k3_grammar_spec spec = {.kind = K3_GRAMMAR_JSON_SCHEMA, .text = schema};
        k3_grammar *g = NULL;
        k3_error err = {0};
        k3_status st = k3_grammar_compile(&g, v, &spec, &err);
        free(schema);
        if (st != K3_OK) {
            refused++;
            CHECKF(st == K3_ERR_UNSUPPORTED || st == K3_ERR_ARG, "%s: %s: status %d: %s", file, group, st, err.msg);
            CHECKF(!cj || !expect, "%s: %s: no longer compiles: %s", file, group, err.msg);
            char key[96];
            error_key(err.msg, key, sizeof key);
            int k = 0;
            while (k < nkeys && strcmp(keys[k].key, key)) k++;
            if (k == nkeys && nkeys < 64) {
                snprintf(keys[nkeys].key, sizeof keys[nkeys].key, "%s", key);
                keys[nkeys++].n = 0;
            }
            if (k < nkeys) keys[k].n++;
            continue;
        }
        compiled++;
        CHECKF(!cj || expect, "%s: %s: compiles now (update the golden)", file, group);
        k3_grammar_matcher *m;
        REQUIRE(k3_grammar_matcher_init(&m, g, &err) == K3_OK);
        size_t ti;
        json_t *t;
        json_array_foreach(json_object_get(c, "tests"), ti, t) {
            bool valid = json_is_true(json_object_get(t, "valid"));
            const char *why = json_string_value(json_object_get(t, "stricter"));
            size_t xi;
            json_t *x;
            json_array_foreach(json_object_get(t, "texts"), xi, x) {
                size_t n;
                int32_t *ids = NULL;
                if (k3_tokenizer_encode(o200k_tok, json_string_value(x), json_string_length(x), &ids, &n, &err) !=
                    K3_OK) {
                    CHECKF(false, "%s: encode: %s", file, err.msg);
                    continue;
                }
                texts++;
                k3_grammar_matcher_reset(m);
                bool ok = true;
                for (size_t i = 0; i < n && ok; i++) {
                    if (k3_grammar_matcher_fill_mask(m, mask, &err) != K3_OK) ok = false;
                    bool allowed = ok && ((mask[ids[i] >> 6] >> (ids[i] & 63)) & 1);
                    k3_status a = k3_grammar_matcher_accept(m, ids[i], &err);
                    if (allowed != (a == K3_OK)) CHECKF(false, "%s: %s: mask and accept disagree", file, group);
                    ok = allowed;
                }
                if (ok) ok = k3_grammar_matcher_is_complete(m);
                if (!valid) {
                    if (ok) {
                        false_accept++;
                        printf("    ACCEPTED %s: %s: %s: %s\n", file, group,
                               json_string_value(json_object_get(t, "description")), json_string_value(x));
                        CHECKF(false, "%s: %s: %s: the invalid %s was accepted", file, group,
                               json_string_value(json_object_get(t, "description")), json_string_value(x));
                    } else invalid_ok++;
                } else if (ok) {
                    valid_ok++;
                } else if (why) {
                    stricter++;
                } else {
                    false_reject++;
                    printf("    REFUSED %s: %s: %s: %s\n", file, group,
                           json_string_value(json_object_get(t, "description")), json_string_value(x));
                    CHECKF(false, "%s: %s: %s: the valid %s was refused", file, group,
                           json_string_value(json_object_get(t, "description")), json_string_value(x));
                }
                free(ids);
            }
        }
        k3_grammar_matcher_free(m);
        k3_grammar_free(g);
    }
    printf("    suite: %d schemas compiled, %d refused; %d texts: %d valid accepted, %d invalid rejected, "
           "%d valid refused by design (stricter), %d valid refused, %d invalid accepted\n",
           compiled, refused, texts, valid_ok, invalid_ok, stricter, false_reject, false_accept);
    printf("    refused by keyword:");
    for (int k = 0; k < nkeys; k++) printf(" %s %d;", keys[k].key, keys[k].n);
    printf("\n");
    CHECK(false_accept == 0);
    free(mask);
    json_decref(cases);
}

/* ---- the agent schemas of bench/grammar -------------------------------------------------------- */

#include <dirent.h>

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s) s[n] = 0;
    fclose(f);
    return s;
}

K3_TEST(grammar_agent_schemas) {
    k3_grammar_vocab *v = o200k_vocab();
    REQUIRE(v);
    DIR *d = opendir("bench/grammar");
    REQUIRE(d);
    struct dirent *de;
    int schemas = 0, texts = 0;
    uint64_t *mask = malloc(v->n_words * 8);
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len < 6 || strcmp(de->d_name + len - 5, ".json") || de->d_name[0] < '0' || de->d_name[0] > '9') continue;
        char path[512];
        snprintf(path, sizeof path, "bench/grammar/%s", de->d_name);
        char *schema = slurp(path);
        snprintf(path, sizeof path, "bench/grammar/%.*sl", (int)len, de->d_name);
        char *lines = slurp(path);
        REQUIREF(schema && lines, "%s", path);
        k3_grammar *g = NULL;
        k3_error err = {0};
        for (int compact = 0; compact < 2; compact++) {
            k3_grammar_spec spec = {.kind = K3_GRAMMAR_JSON_SCHEMA, .text = schema, .compact = compact};
            CHECKF(k3_grammar_compile(&g, v, &spec, &err) == K3_OK, "%s: %s", de->d_name, err.msg);
            if (!g) continue;
            schemas++;
            k3_grammar_matcher *m;
            REQUIRE(k3_grammar_matcher_init(&m, g, &err) == K3_OK);
            for (char *p = lines; *p;) {
                char *nl = strchr(p, '\n');
                if (nl) *nl = 0;
                json_error_t je;
                json_t *j = json_loads(p, JSON_DECODE_ANY, &je);
                if (nl) *nl = '\n';
                p = nl ? nl + 1 : p + strlen(p);
                if (!json_is_string(j)) {
                    json_decref(j);
                    continue;
                }
                /* compact mode: only the compact texts */
                bool has_ws = strpbrk(json_string_value(j), " \n") != NULL;
                size_t n;
                int32_t *ids = NULL;
                if (compact && has_ws) {
                    json_decref(j);
                    continue;
                }
                REQUIRE(k3_tokenizer_encode(o200k_tok, json_string_value(j), json_string_length(j), &ids, &n, &err) ==
                        K3_OK);
                texts++;
                k3_grammar_matcher_reset(m);
                bool ok = true;
                for (size_t i = 0; i < n && ok; i++) {
                    ok = k3_grammar_matcher_fill_mask(m, mask, &err) == K3_OK &&
                        ((mask[ids[i] >> 6] >> (ids[i] & 63)) & 1) &&
                        k3_grammar_matcher_accept(m, ids[i], &err) == K3_OK;
                }
                CHECKF(ok && k3_grammar_matcher_is_complete(m), "%s (compact %d): refused %s", de->d_name, compact,
                       json_string_value(j));
                free(ids);
                json_decref(j);
            }
            k3_grammar_matcher_free(m);
            k3_grammar_free(g);
            g = NULL;
        }
        free(schema);
        free(lines);
    }
    closedir(d);
    free(mask);
    CHECKF(schemas >= 100 && texts >= 300, "%d schemas, %d texts", schemas, texts);
}
