/*
 * compile.c -- k3_grammar_compile: a spec into one grammar, and the K3
 * reply around it.
 *
 * The K3 chat format (src/tokenizer/chat_json.c writes it, chat_reply.c
 * reads it back) frames an assistant turn with special tokens; the
 * generation prompt ends with <|open|>think<|sep|> (thinking) or
 * <|open|>response<|sep|>. As a grammar, the rest of the turn is
 *
 *   [ TEXT <|close|>think<|sep|> <|open|>response<|sep|> ]     thinking only
 *   CONTENT <|close|>response<|sep|> [<|close|>message<|sep|>]
 *
 * with CONTENT the spec's grammar (k3_reply), and for tool calls
 *
 *   [ think as above ] <|close|>response<|sep|>                (no content)
 *   <|open|>tools<|sep|> CALL+ <|close|>tools<|sep|> [<|close|>message<|sep|>]
 *
 * or, with tools_optional, TEXT <|close|>response<|sep|> [<|open|>tools<|sep|>
 * CALL+ <|close|>tools<|sep|>] [<|close|>message<|sep|>] (TEXT without
 * <|close|>), and with a JSON Schema text beside the tools, either JSON
 * <|close|>response<|sep|> or <|close|>response<|sep|> and the calls.
 *   CALL = <|open|>call tool="NAME" index="N"<|sep|> ARGS <|close|>call<|sep|>
 *   ARGS = (<|open|>argument key="K" type="T"<|sep|> VALUE <|close|>argument<|sep|>)*
 *        | <|open|>json type="object"<|sep|> {...} <|close|>json<|sep|>
 *
 * where N counts 1, 2, ... (exactly one call unless parallel_calls), the
 * arguments follow the parameters schema in its order (schema.c,
 * k3g_tool_args), a string VALUE is raw text and any other is JSON as
 * json.dumps writes it. The end of the message's own <|end_of_msg|> is an
 * end-of-generation id, allowed once the grammar is complete.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/chat_form.h"
#include "common/error.h"
#include "grammar/build.h"
#include "grammar/gbnf.h"
#include "grammar/regex.h"
#include "grammar/schema.h"
#include "grammar/stdrules.h"
#include "grammar/vocab.h"
#include "grammar/walk.h"

typedef struct specials {
    int32_t open, close, sep;
} specials;

static k3_status need_specials(k3g_builder *b, specials *s) {
    const k3_grammar_vocab *v = b->vocab;
    s->open = k3g_vocab_special(v, K3_FORM_OPEN, sizeof K3_FORM_OPEN - 1);
    s->close = k3g_vocab_special(v, K3_FORM_CLOSE, sizeof K3_FORM_CLOSE - 1);
    s->sep = k3g_vocab_special(v, K3_FORM_SEP, sizeof K3_FORM_SEP - 1);
    if (s->open < 0 || s->close < 0 || s->sep < 0)
        return k3_err(b->err, K3_ERR_ARG,
                      "the K3 reply form needs the tokenizer's <|open|>, <|close|> and <|sep|> "
                      "specials, and this vocabulary lacks them");
    return K3_OK;
}

/* SPECIAL(a) "text" SPECIAL(b) */
static k3g_ast *tag(k3g_builder *b, int32_t a, const char *text, int32_t c) {
    return k3g_seq3(b, k3g_special(b, a), k3g_str(b, text), k3g_special(b, c));
}

static k3g_ast *think_part(k3g_builder *b, const specials *s) {
    int32_t text = k3g_std_rule(b, K3G_STD_ANY_TEXT);
    if (text < 0) return NULL;
    return k3g_seq3(b, k3g_ref(b, text), tag(b, s->close, K3_FORM_THINK, s->sep),
                    tag(b, s->open, K3_FORM_RESPONSE, s->sep));
}

static k3g_ast *reply_end(k3g_builder *b, const specials *s) {
    return k3g_rep(b, tag(b, s->close, K3_FORM_MESSAGE, s->sep), 0, 1);
}

#define EXACT_INDICES 16

static k3_status tool_calls(k3g_builder *b, const k3_grammar_spec *spec, const char *where, k3g_ast **out) {
    specials s;
    K3_TRY(need_specials(b, &s));
    if (spec->n_tools <= 0 || !spec->tools)
        return k3_err(b->err, K3_ERR_ARG, "%s: tool calls need at least one tool", where);
    int32_t nt = spec->n_tools;
    int32_t *body = malloc((size_t)nt * sizeof *body);
    if (!body) return k3_err(b->err, K3_ERR_NOMEM, "out of memory compiling tool calls");
    k3_status st = K3_OK;
    /* one rule per tool: its arguments and the end of the call */
    for (int32_t i = 0; i < nt && st == K3_OK; i++) {
        const k3_grammar_tool *t = &spec->tools[i];
        if (!t->name || !*t->name) {
            st = k3_err(b->err, K3_ERR_ARG, "%s[%d]: a tool needs a name", where, i);
            break;
        }
        for (int32_t j = 0; j < i; j++)
            if (!strcmp(spec->tools[j].name, t->name))
                st = k3_err(b->err, K3_ERR_ARG, "%s[%d]: the tool name '%s' appears twice", where, i, t->name);
        if (st != K3_OK) break;
        char w[300];
        snprintf(w, sizeof w, "%s[%d].function.parameters", where, i);
        k3g_ast *args;
        st = k3g_tool_args(b, t->parameters, w, &args);
        if (st != K3_OK) break;
        char name[300];
        snprintf(name, sizeof name, "call %.200s", t->name);
        body[i] = k3g_rule(b, name);
        if (body[i] < 0) st = b->err && b->err->status ? b->err->status : K3_ERR_NOMEM;
        else st = k3g_rule_set(b, body[i], k3g_seq2(b, args, tag(b, s.close, K3_FORM_CALL, s.sep)));
    }
    /* CALL(index): the open tag with each tool's name, then its body */
    int32_t n_idx = spec->parallel_calls ? EXACT_INDICES + 1 : 1;
    k3g_ast **calls = k3g_alloc(&b->arena, (size_t)n_idx * sizeof *calls);
    k3g_ast **alts = k3g_alloc(&b->arena, (size_t)nt * sizeof *alts);
    if (st == K3_OK && (!calls || !alts)) st = K3_ERR_NOMEM;
    for (int32_t k = 0; k < n_idx && st == K3_OK; k++) {
        k3g_ast *index;
        if (k < EXACT_INDICES) {
            char num[16];
            snprintf(num, sizeof num, "%d", k + 1);
            index = k3g_str(b, num);
        } else {
            index = k3g_seq2(b, k3g_brange(b, '1', '9'), k3g_rep(b, k3g_brange(b, '0', '9'), 0, -1));
        }
        for (int32_t i = 0; i < nt; i++) {
            k3g_ast *kk[7] = {k3g_special(b, s.open),
                              k3g_str(b, K3_FORM_CALL " " K3_FORM_ATTR_TOOL "=\""),
                              k3g_attr_lit(b, spec->tools[i].name),
                              k3g_str(b, "\" " K3_FORM_ATTR_INDEX "=\""),
                              index,
                              k3g_str(b, "\""),
                              k3g_special(b, s.sep)};
            alts[i] = k3g_seq2(b, k3g_seq(b, kk, 7), k3g_ref(b, body[i]));
        }
        calls[k] = k3g_alt(b, alts, nt);
    }
    k3g_ast *all = NULL;
    if (st == K3_OK) {
        if (n_idx == 1) {
            all = calls[0];
        } else {
            /* C1 (C2 (... (C16 C*)?)?)? */
            all = k3g_rep(b, calls[EXACT_INDICES], 0, -1);
            for (int32_t k = EXACT_INDICES - 1; k >= 1; k--) all = k3g_rep(b, k3g_seq2(b, calls[k], all), 0, 1);
            all = k3g_seq2(b, calls[0], all);
        }
    }
    if (st == K3_OK) {
        k3g_ast *pre = spec->thinking ? think_part(b, &s) : k3g_empty(b);
        k3g_ast *calls_part =
            k3g_seq3(b, tag(b, s.open, K3_FORM_TOOLS, s.sep), all, tag(b, s.close, K3_FORM_TOOLS, s.sep));
        k3g_ast *turn;
        if (spec->tools_optional && spec->text) {
            /* content matching the JSON Schema text, or the calls */
            k3g_json_opts o = {.ws = spec->compact ? K3G_WS_COMPACT : K3G_WS_FLEX,
                               .no_extra = spec->no_extra_properties,
                               .int_canon = spec->canonical_numbers,
                               .where = spec->text_where ? spec->text_where : "json_schema"};
            int32_t r;
            st = k3g_json_schema(b, spec->text, &o, &r);
            turn = st ? NULL
                      : k3g_alt2(b, k3g_seq2(b, k3g_ref(b, r), tag(b, s.close, K3_FORM_RESPONSE, s.sep)),
                                 k3g_seq2(b, tag(b, s.close, K3_FORM_RESPONSE, s.sep), calls_part));
        } else if (spec->tools_optional) {
            /* text content (a raw string: no <|close|> in it), then the calls or none */
            int32_t text = k3g_std_rule(b, K3G_STD_RAW_STRING);
            turn = text < 0
                ? NULL
                : k3g_seq3(b, k3g_ref(b, text), tag(b, s.close, K3_FORM_RESPONSE, s.sep), k3g_rep(b, calls_part, 0, 1));
        } else {
            turn = k3g_seq2(b, tag(b, s.close, K3_FORM_RESPONSE, s.sep), calls_part);
        }
        *out = st ? NULL : k3g_seq3(b, pre, turn, reply_end(b, &s));
        if (!st && !*out) st = K3_ERR_NOMEM;
    }
    free(body);
    if (st == K3_ERR_NOMEM && !(b->err && b->err->status)) k3_err(b->err, st, "out of memory compiling tool calls");
    return st;
}

/* Every token table the grammar's masks will read (a node's; a length-limited
 * string's counted table), made now on the compiling thread, where the
 * compile's budget and cancellation apply, rather than at a mask in the
 * engine's step: a mask is then ORs of ready tables and walks of the few
 * tokens that leave a rule (docs/grammar.md, "Cost"). A table whose walk
 * runs past its budget (an ambiguous grammar) refuses the grammar here,
 * naming the rule. A huge grammar (a regular expression of 2^17 states)
 * stops making them when a quarter of the compile's budget is spent and
 * makes the rest on first use, a few hundred microseconds each. */
static k3_status tabulate(k3_grammar *g, const char *where, double until, k3_error *err) {
    for (int32_t n = 0; n < g->n_nodes; n++) {
        if (!g->nodes[n].nb) continue;
        if ((n & 15) == 0) {
            if (k3g_stopped(err, where)) return err && err->status ? err->status : K3_ERR_UNSUPPORTED;
            if (k3_now() > until) break;
        }
        k3_error e = {0};
        const bool ok = g->budget && g->budget[n] >= 0 ? k3g_counted_get(g->vocab, -g->nodes[n].key - 1, &e) != NULL
                                                       : k3g_entry_get(g, n, &e) != NULL;
        if (!ok) return k3_err(err, e.status ? e.status : K3_ERR_NOMEM, "%s: %s", where, e.msg);
    }
    return K3_OK;
}

k3_status k3_grammar_compile(k3_grammar **out, const k3_grammar_vocab *v, const k3_grammar_spec *spec, k3_error *err) {
    *out = NULL;
    if (!v || !spec) return k3_err(err, K3_ERR_ARG, "k3_grammar_compile needs a vocabulary and a spec");
    static const char *const default_where[] = {"json_schema", "response_format", "regex",
                                                "choice",      "grammar",         "tools"};
    if ((unsigned)spec->kind > K3_GRAMMAR_TOOL_CALLS)
        return k3_err(err, K3_ERR_ARG, "unknown grammar kind %d", (int)spec->kind);
    const char *where = spec->where ? spec->where : default_where[spec->kind];
    /* the compile's budget and cancellation, for every loop below (fsa.h) */
    k3g_stop stop = {.cancel = spec->cancel, .ctx = spec->cancel_ctx};
    stop.budget_s = spec->max_compile_s > 0 ? spec->max_compile_s : K3_GRAMMAR_COMPILE_S;
    stop.deadline = k3_now() + stop.budget_s;
    k3g_stop_set(&stop);
    k3g_builder b;
    k3g_builder_init(&b, v, err);
    k3g_ws ws = spec->compact ? K3G_WS_COMPACT : K3G_WS_FLEX;
    k3_status st = K3_OK;
    k3g_ast *content = NULL;
    bool needs_text =
        spec->kind == K3_GRAMMAR_JSON_SCHEMA || spec->kind == K3_GRAMMAR_REGEX || spec->kind == K3_GRAMMAR_GBNF;
    if (needs_text && !spec->text) st = k3_err(err, K3_ERR_ARG, "%s: no text given", where);
    if (st == K3_OK) switch (spec->kind) {
        case K3_GRAMMAR_JSON_SCHEMA: {
            k3g_json_opts o = {.ws = ws,
                               .no_extra = spec->no_extra_properties,
                               .int_canon = spec->canonical_numbers,
                               .where = where};
            int32_t r;
            st = k3g_json_schema(&b, spec->text, &o, &r);
            if (st == K3_OK) content = k3g_ref(&b, r);
            break;
        }
        case K3_GRAMMAR_JSON_OBJECT: {
            int32_t r = k3g_std_rule(&b, spec->compact ? K3G_STD_OBJECT_COMPACT : K3G_STD_OBJECT_FLEX);
            if (r < 0) st = err && err->status ? err->status : K3_ERR_NOMEM;
            else content = k3g_ref(&b, r);
            break;
        }
        case K3_GRAMMAR_REGEX: st = k3g_regex(&b, spec->text, strlen(spec->text), false, where, &content); break;
        case K3_GRAMMAR_CHOICE: {
            if (spec->n_choices <= 0 || !spec->choices) {
                st = k3_err(err, K3_ERR_ARG, "%s: the list of choices is empty", where);
                break;
            }
            k3g_ast **k = k3g_alloc(&b.arena, (size_t)spec->n_choices * sizeof *k);
            for (int32_t i = 0; k && i < spec->n_choices; i++) {
                if (!spec->choices[i]) {
                    st = k3_err(err, K3_ERR_ARG, "%s[%d]: a choice is NULL", where, i);
                    break;
                }
                k[i] = k3g_str(&b, spec->choices[i]);
            }
            if (st == K3_OK) content = k ? k3g_alt(&b, k, spec->n_choices) : NULL;
            break;
        }
        case K3_GRAMMAR_GBNF: {
            int32_t r;
            st = k3g_gbnf(&b, spec->text, strlen(spec->text), where, &r);
            if (st == K3_OK) content = k3g_ref(&b, r);
            break;
        }
        case K3_GRAMMAR_TOOL_CALLS: st = tool_calls(&b, spec, where, &content); break;
        }
    if (st == K3_OK && spec->k3_reply && spec->kind != K3_GRAMMAR_TOOL_CALLS) {
        specials s;
        st = need_specials(&b, &s);
        if (st == K3_OK) {
            k3g_ast *pre = spec->thinking ? think_part(&b, &s) : k3g_empty(&b);
            k3g_ast *kk[4] = {pre, content, tag(&b, s.close, K3_FORM_RESPONSE, s.sep), reply_end(&b, &s)};
            content = k3g_seq(&b, kk, 4);
        }
    }
    if (st == K3_OK && !content)
        st = err && err->status ? err->status : k3_err(err, K3_ERR_NOMEM, "out of memory compiling a grammar");
    int32_t root = -1;
    if (st == K3_OK) {
        root = k3g_rule(&b, where);
        if (root < 0) st = err && err->status ? err->status : K3_ERR_NOMEM;
    }
    if (st == K3_OK) st = k3g_rule_set(&b, root, content);
    if (st == K3_OK) {
        st = k3g_finalize(&b, root, out);
        if (st == K3_ERR_ARG && err && strstr(err->msg, "matches nothing")) {
            k3_err_clear(err);
            st = k3_err(err, K3_ERR_ARG, "%s: nothing can match it (the constraints contradict each other)", where);
        }
    }
    if (st == K3_OK) {
        st = tabulate(*out, where, stop.deadline - 0.75 * stop.budget_s, err);
        if (st != K3_OK) {
            k3_grammar_free(*out);
            *out = NULL;
        }
    }
    k3g_builder_free(&b);
    k3g_stop_set(NULL);
    return st;
}
