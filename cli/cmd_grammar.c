/*
 * cmd_grammar.c -- `k3 grammar`: compile a constraint for a model's
 * vocabulary, check texts against it token by token, and time the masks,
 * without a forward pass.
 *
 *   k3 grammar (-m DIR | --vocab FILE --pattern NAME)
 *              (--json-schema FILE | --json-object | --regex RE | --grammar FILE
 *               | --choice A,B,.. | --tools FILE)
 *              [--compact] [--strict] [--k3-reply] [--think] [--parallel]
 *              [--test FILE] [--sample N [--seed S] [--max-tokens N]] [--json] [--times FILE]
 *
 * --test FILE is JSON Lines: each line a JSON string holding one text (or an
 * array of strings and token ids, for texts with special tokens). Each text
 * is tokenized as the model's tokenizer does, then fed one token at a time:
 * the mask of every step is computed and timed, the token must be in it, and
 * at the end the text must be complete (the end-of-generation id allowed).
 * --json prints one object: {"compiled", "error", "compile_ms", "results":
 * [{"accepted", "tokens", "rejected_at"}], "mask_us": {"mean", "p50", "p99",
 * "max", "n"}}; rejected_at is the index of the first token refused, or
 * the token count when every token passed but the text is incomplete.
 * --batch N then steps N requests through the accepted test texts together,
 * filling each step's masks with k3_grammar_fill_masks on --threads T (the
 * engine's per-step call), and reports the step time ("batch_us" in --json).
 * --sample N prints N random texts the grammar allows (one JSON string per
 * line; the tokens picked uniformly among the allowed ones), for checking
 * them with an outside validator. --times FILE writes every mask time (us),
 * one a line, for benchmarks that pool several runs. Exit status 0 when it ran, whatever the
 * verdicts; 1 when a file or the vocabulary cannot be read; 2 on bad usage.
 */
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "k3.h"

static const char usage[] =
    "usage: k3 grammar (-m DIR | --vocab FILE --pattern NAME)\n"
    "                  (--json-schema FILE | --json-object | --regex RE | --grammar FILE\n"
    "                   | --choice A,B,.. | --tools FILE)\n"
    "                  [--compact] [--strict] [--k3-reply] [--think] [--parallel]\n"
    "                  [--test FILE] [--sample N [--seed S] [--max-tokens N]] [--json] [--times FILE]\n"
    "                  [--batch N [--threads T]]\n"
    "  Compiles a constraint for a vocabulary, feeds test texts through it token by\n"
    "  token and times the mask of every step.\n"
    "  -m DIR             a model directory (its tiktoken.model and specials)\n"
    "  --vocab FILE       a bare .tiktoken rank file; --pattern o200k|cl100k|kimi\n"
    "  --json-schema FILE a JSON Schema;  --json-object: any JSON object\n"
    "  --regex RE         a regular expression the whole output matches\n"
    "  --grammar FILE     a GBNF grammar (rule root)\n"
    "  --choice A,B,..    exactly one of the comma-separated strings\n"
    "  --tools FILE       K3 tool calls to the OpenAI-style tools of a JSON array\n"
    "  --compact          JSON without whitespace\n"
    "  --strict           objects without additionalProperties allow no others\n"
    "  --k3-reply         the output is the rest of a K3 assistant turn (needs -m)\n"
    "  --think            ... opened in thinking mode;  --parallel: one or more tool calls\n"
    "  --test FILE        JSON Lines of texts (or arrays of text pieces and token ids)\n"
    "  --sample N         print N random texts the grammar allows (--seed, --max-tokens)\n"
    "  --json             one JSON object with the verdicts and the mask times\n"
    "  --times FILE       every mask time (us), one a line\n"
    "  --batch N          then N requests through the accepted test texts together, each\n"
    "                     step's masks filled at once (k3_grammar_fill_masks); --threads T\n"
    "  Exit status 0 when it ran, whatever the verdicts.\n";

static int fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("k3 grammar: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

static int bad_usage(const char *fmt, const char *arg) {
    fputs("k3 grammar: ", stderr);
    fprintf(stderr, fmt, arg);
    fputs(" (see k3 grammar --help)\n", stderr);
    return 2;
}

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (n + 1 < cap) break;
        if (cap > ((size_t)256 << 20)) {
            free(buf);
            buf = NULL;
            break;
        }
        char *nb = realloc(buf, cap *= 2);
        if (!nb) free(buf);
        buf = nb;
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        *len = n;
    }
    return buf;
}

typedef struct text_case {
    int32_t *ids;
    size_t n;
} text_case;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Tokenizes one test line into ids. */
static int tokenize_line(const k3_tokenizer *tok, json_t *line, text_case *out, int lineno) {
    out->ids = NULL;
    out->n = 0;
    size_t cap = 0;
    json_t *parts = json_is_array(line) ? line : NULL;
    size_t np = parts ? json_array_size(parts) : 1;
    for (size_t i = 0; i < np; i++) {
        json_t *p = parts ? json_array_get(parts, i) : line;
        int32_t *ids = NULL;
        size_t n = 0;
        int32_t one;
        if (json_is_integer(p)) {
            one = (int32_t)json_integer_value(p);
            if (one < 0 || one >= k3_tokenizer_n_vocab(tok))
                return fail("test line %d: token id %d is out of range", lineno, one);
            ids = &one;
            n = 1;
        } else if (json_is_string(p)) {
            const char *s = json_string_value(p);
            int32_t sp = parts ? k3_tokenizer_special(tok, s) : -1;
            if (sp >= 0) {
                one = sp;
                ids = &one;
                n = 1;
            } else {
                k3_error err = {0};
                if (k3_tokenizer_encode(tok, s, json_string_length(p), &ids, &n, &err) != K3_OK)
                    return fail("test line %d: %s", lineno, err.msg);
            }
        } else {
            return fail("test line %d: not a JSON string (or an array of strings and token ids)", lineno);
        }
        if (out->n + n > cap) {
            cap = (out->n + n) * 2 + 16;
            int32_t *nv = realloc(out->ids, cap * sizeof *nv);
            if (!nv) {
                if (ids != &one) free(ids);
                return fail("out of memory");
            }
            out->ids = nv;
        }
        memcpy(out->ids + out->n, ids, n * sizeof *ids);
        out->n += n;
        if (ids != &one) free(ids);
    }
    return 0;
}

static uint64_t rng_next(uint64_t *s) {
    uint64_t x = (*s += 0x9e3779b97f4a7c15u);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9u;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebu;
    return x ^ (x >> 31);
}

int k3_cmd_grammar(int argc, char **argv) {
    const char *model = NULL, *vocab = NULL, *pattern = NULL, *schema = NULL, *regex = NULL, *gfile = NULL;
    const char *choice = NULL, *tools_file = NULL, *test = NULL, *times_file = NULL;
    bool json_out = false, compact = false, strict = false, k3_reply = false, think = false, parallel = false;
    bool want_object = false;
    long sample = 0, max_tokens = 512, batch = 0;
    int threads = 1;
    unsigned long long seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has = i + 1 < argc;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(usage, stdout);
            return 0;
        }
        if (!strcmp(a, "--json")) json_out = true;
        else if (!strcmp(a, "--compact")) compact = true;
        else if (!strcmp(a, "--strict")) strict = true;
        else if (!strcmp(a, "--k3-reply")) k3_reply = true;
        else if (!strcmp(a, "--think")) think = true;
        else if (!strcmp(a, "--parallel")) parallel = true;
        else if (!strcmp(a, "--json-object")) want_object = true;
        else if (!strcmp(a, "-m") || !strcmp(a, "--vocab") || !strcmp(a, "--pattern") || !strcmp(a, "--json-schema") ||
                 !strcmp(a, "--regex") || !strcmp(a, "--grammar") || !strcmp(a, "--choice") || !strcmp(a, "--tools") ||
                 !strcmp(a, "--test") || !strcmp(a, "--sample") || !strcmp(a, "--seed") || !strcmp(a, "--max-tokens") ||
                 !strcmp(a, "--times") || !strcmp(a, "--batch") || !strcmp(a, "--threads")) {
            if (!has) return bad_usage("%s needs a value", a);
            const char *v = argv[++i];
            if (!strcmp(a, "-m")) model = v;
            else if (!strcmp(a, "--vocab")) vocab = v;
            else if (!strcmp(a, "--pattern")) pattern = v;
            else if (!strcmp(a, "--json-schema")) schema = v;
            else if (!strcmp(a, "--regex")) regex = v;
            else if (!strcmp(a, "--grammar")) gfile = v;
            else if (!strcmp(a, "--choice")) choice = v;
            else if (!strcmp(a, "--tools")) tools_file = v;
            else if (!strcmp(a, "--test")) test = v;
            else if (!strcmp(a, "--times")) times_file = v;
            else if (!strcmp(a, "--threads")) {
                if (k3_cli_threads("grammar", v, &threads)) return 2;
            } else {
                char *end;
                errno = 0;
                long long x = strtoll(v, &end, 10);
                if (*end || errno || x < 0) return bad_usage("%s needs a non-negative integer", a);
                if (!strcmp(a, "--sample")) sample = (long)x;
                else if (!strcmp(a, "--batch")) batch = (long)x > 4096 ? 4096 : (long)x;
                else if (!strcmp(a, "--seed")) seed = (unsigned long long)x;
                else max_tokens = (long)x;
            }
        } else {
            return bad_usage("unknown argument \"%s\"", a);
        }
    }
    if (!!model + !!vocab != 1) return bad_usage("give -m DIR or --vocab FILE%s", "");
    if (pattern && !vocab) return bad_usage("--pattern goes with --vocab%s", "");
    int kinds = !!schema + !!regex + !!gfile + !!choice + !!tools_file + want_object;
    if (kinds != 1)
        return bad_usage("give one of --json-schema, --json-object, --regex, --grammar, --choice, --tools%s", "");
    k3_pattern pat = K3_PATTERN_KIMI;
    if (pattern) {
        if (!strcmp(pattern, "o200k")) pat = K3_PATTERN_O200K;
        else if (!strcmp(pattern, "cl100k")) pat = K3_PATTERN_CL100K;
        else if (!strcmp(pattern, "kimi")) pat = K3_PATTERN_KIMI;
        else return bad_usage("unknown pattern \"%s\" (o200k, cl100k or kimi)", pattern);
    }

    k3_error err = {0};
    k3_tokenizer *tok = NULL;
    if ((model ? k3_tokenizer_open(&tok, model, &err) : k3_tokenizer_open_file(&tok, vocab, pat, &err)) != K3_OK)
        return fail("%s", err.msg);
    double t0 = k3_now();
    k3_grammar_vocab *gv = NULL;
    if (k3_grammar_vocab_init(&gv, tok, &err) != K3_OK) {
        k3_tokenizer_free(tok);
        return fail("%s", err.msg);
    }
    double vocab_ms = (k3_now() - t0) * 1e3;

    /* the spec */
    int rc = 0;
    char *text = NULL;
    size_t tlen = 0;
    char **choices = NULL;
    int32_t n_choices = 0;
    k3_grammar_tool *tools = NULL;
    int32_t n_tools = 0;
    json_t *tools_json = NULL;
    k3_grammar_spec spec = {.compact = compact,
                            .no_extra_properties = strict,
                            .k3_reply = k3_reply,
                            .thinking = think,
                            .parallel_calls = parallel};
    if (schema || gfile) {
        text = read_all(schema ? schema : gfile, &tlen);
        if (!text) rc = fail("cannot read %s: %s", schema ? schema : gfile, strerror(errno));
        spec.kind = schema ? K3_GRAMMAR_JSON_SCHEMA : K3_GRAMMAR_GBNF;
        spec.text = text;
    } else if (regex) {
        spec.kind = K3_GRAMMAR_REGEX;
        spec.text = regex;
    } else if (want_object) {
        spec.kind = K3_GRAMMAR_JSON_OBJECT;
    } else if (choice) {
        spec.kind = K3_GRAMMAR_CHOICE;
        size_t cap = 8;
        choices = malloc(cap * sizeof *choices);
        for (const char *p = choice; choices;) {
            const char *c = strchr(p, ',');
            size_t n = c ? (size_t)(c - p) : strlen(p);
            if ((size_t)n_choices == cap) {
                char **nc = realloc(choices, (cap *= 2) * sizeof *nc);
                if (!nc) break;
                choices = nc;
            }
            choices[n_choices] = strndup(p, n);
            n_choices++;
            if (!c) break;
            p = c + 1;
        }
        spec.choices = (const char *const *)choices;
        spec.n_choices = n_choices;
    } else {
        spec.kind = K3_GRAMMAR_TOOL_CALLS;
        size_t n;
        char *t = read_all(tools_file, &n);
        json_error_t je;
        if (!t) rc = fail("cannot read %s: %s", tools_file, strerror(errno));
        else if (!(tools_json = json_loadb(t, n, 0, &je)) || !json_is_array(tools_json))
            rc = fail("%s: not a JSON array of tools", tools_file);
        free(t);
        if (rc == 0) {
            n_tools = (int32_t)json_array_size(tools_json);
            tools = calloc(n_tools ? (size_t)n_tools : 1, sizeof *tools);
            for (int32_t i = 0; tools && i < n_tools; i++) {
                json_t *tl = json_array_get(tools_json, (size_t)i), *fn = json_object_get(tl, "function");
                if (!fn) fn = tl;
                tools[i].name = json_string_value(json_object_get(fn, "name"));
                json_t *params = json_object_get(fn, "parameters");
                tools[i].parameters = params ? json_dumps(params, JSON_COMPACT) : NULL;
            }
            spec.tools = tools;
            spec.n_tools = n_tools;
        }
    }

    /* compile */
    k3_grammar *g = NULL;
    double compile_ms = 0;
    k3_error cerr = {0};
    if (rc == 0) {
        t0 = k3_now();
        k3_status st = k3_grammar_compile(&g, gv, &spec, &cerr);
        compile_ms = (k3_now() - t0) * 1e3;
        if (st != K3_OK) g = NULL;
    }

    /* tests */
    json_t *results = json_array();
    double *times = NULL;
    size_t n_times = 0, cap_times = 0;
    text_case *cases = NULL;
    size_t n_cases = 0, cap_cases = 0;
    if (rc == 0 && g && test) {
        size_t n;
        char *t = read_all(test, &n);
        if (!t) rc = fail("cannot read %s: %s", test, strerror(errno));
        k3_grammar_matcher *m = NULL;
        uint64_t *mask = malloc(k3_grammar_mask_words(gv) * sizeof *mask);
        if (rc == 0 && (!mask || k3_grammar_matcher_init(&m, g, &err) != K3_OK))
            rc = fail("%s", err.msg[0] ? err.msg : "out of memory");
        int lineno = 0;
        for (char *line = t; rc == 0 && line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            lineno++;
            char *p = line;
            while (*p == ' ' || *p == '\t' || *p == '\r') p++;
            if (*p) {
                json_error_t je;
                json_t *j = json_loads(p, JSON_DECODE_ANY, &je);
                text_case tc = {0};
                if (!j) rc = fail("%s:%d: not JSON: %s", test, lineno, je.text);
                else rc = tokenize_line(tok, j, &tc, lineno);
                json_decref(j);
                if (rc == 0) {
                    k3_grammar_matcher_reset(m);
                    long rejected = -1;
                    for (size_t k = 0; k <= tc.n && rc == 0; k++) {
                        double a = k3_now();
                        k3_status st = k3_grammar_matcher_fill_mask(m, mask, &err);
                        double us = (k3_now() - a) * 1e6;
                        if (st != K3_OK) {
                            rc = fail("%s", err.msg);
                            break;
                        }
                        if (n_times == cap_times) {
                            cap_times = cap_times ? cap_times * 2 : 1024;
                            double *nt = realloc(times, cap_times * sizeof *nt);
                            if (!nt) {
                                rc = fail("out of memory");
                                break;
                            }
                            times = nt;
                        }
                        times[n_times++] = us;
                        if (k == tc.n) {
                            if (!k3_grammar_matcher_is_complete(m)) rejected = (long)tc.n;
                            break;
                        }
                        int32_t id = tc.ids[k];
                        bool allowed = (mask[id >> 6] >> (id & 63)) & 1;
                        k3_error aerr = {0};
                        k3_status ast = k3_grammar_matcher_accept(m, id, &aerr);
                        if (allowed != (ast == K3_OK)) {
                            rc = fail("%s:%d: token %zu (id %d): the mask says %s but the matcher %s it", test, lineno,
                                      k, id, allowed ? "allowed" : "refused", ast == K3_OK ? "accepted" : "refused");
                            break;
                        }
                        if (!allowed) {
                            rejected = (long)k;
                            break;
                        }
                    }
                    json_t *r = json_object();
                    json_object_set_new(r, "accepted", json_boolean(rejected < 0));
                    json_object_set_new(r, "tokens", json_integer((json_int_t)tc.n));
                    json_object_set_new(r, "rejected_at", rejected < 0 ? json_null() : json_integer(rejected));
                    json_array_append_new(results, r);
                    if (rejected < 0 && n_cases == cap_cases) {
                        cap_cases = cap_cases ? cap_cases * 2 : 16;
                        text_case *nc = realloc(cases, cap_cases * sizeof *nc);
                        if (nc) cases = nc;
                        else cap_cases = n_cases;
                    }
                    if (rejected < 0 && n_cases < cap_cases) {
                        cases[n_cases++] = tc;
                        tc.ids = NULL;
                    }
                }
                free(tc.ids);
            }
            line = nl ? nl + 1 : NULL;
        }
        k3_grammar_matcher_free(m);
        free(mask);
        free(t);
    }

    /* --batch: N requests stepping together, their masks filled at once */
    json_t *batch_json = NULL;
    if (rc == 0 && g && batch > 0 && n_cases > 0) {
        k3_pool *pool = NULL;
        if (threads > 1 && k3_pool_init(&pool, threads, &err) != K3_OK) rc = fail("%s", err.msg);
        k3_grammar_matcher **ms = calloc((size_t)batch, sizeof *ms);
        uint64_t **masks = calloc((size_t)batch, sizeof *masks);
        k3_grammar_matcher **act = calloc((size_t)batch, sizeof *act);
        uint64_t **amask = calloc((size_t)batch, sizeof *amask);
        size_t *pos = calloc((size_t)batch, sizeof *pos);
        int32_t *who = calloc((size_t)batch, sizeof *who);
        double *steps = NULL;
        size_t n_steps = 0, cap_steps = 0;
        size_t words = k3_grammar_mask_words(gv);
        if (rc == 0 && (!ms || !masks || !act || !amask || !pos || !who)) rc = fail("out of memory");
        for (long i = 0; rc == 0 && i < batch; i++) {
            masks[i] = malloc(words * sizeof **masks);
            if (!masks[i] || k3_grammar_matcher_init(&ms[i], g, &err) != K3_OK) rc = fail("out of memory");
        }
        /* each request takes the texts in turn, starting at its own */
        for (int round = 0; rc == 0; round++) {
            int32_t na = 0;
            for (long i = 0; i < batch; i++) {
                const text_case *tc = &cases[(size_t)(i + round) % n_cases];
                if (pos[i] < tc->n) {
                    act[na] = ms[i];
                    amask[na] = masks[i];
                    who[na++] = (int32_t)i;
                }
            }
            if (na == 0) {
                if (round > 0) break;
                break;
            }
            double a = k3_now();
            if (k3_grammar_fill_masks(act, amask, na, pool, &err) != K3_OK) {
                rc = fail("%s", err.msg);
                break;
            }
            double us = (k3_now() - a) * 1e6;
            if (n_steps == cap_steps) {
                cap_steps = cap_steps ? cap_steps * 2 : 256;
                double *ns = realloc(steps, cap_steps * sizeof *ns);
                if (!ns) {
                    rc = fail("out of memory");
                    break;
                }
                steps = ns;
            }
            steps[n_steps++] = us;
            for (int32_t k = 0; k < na && rc == 0; k++) {
                long i = who[k];
                const text_case *tc = &cases[(size_t)(i + round) % n_cases];
                if (k3_grammar_matcher_accept(ms[i], tc->ids[pos[i]], &err) != K3_OK) rc = fail("--batch: %s", err.msg);
                pos[i]++;
            }
            /* a text done: the next round starts the next text from scratch */
            bool all_done = true;
            for (long i = 0; i < batch; i++)
                if (pos[i] < cases[(size_t)(i + round) % n_cases].n) all_done = false;
            if (all_done) break;
            round--; /* the same texts until every request is done */
        }
        if (rc == 0 && n_steps) {
            double sum = 0;
            for (size_t i = 0; i < n_steps; i++) sum += steps[i];
            qsort(steps, n_steps, sizeof *steps, cmp_double);
            batch_json = json_object();
            json_object_set_new(batch_json, "requests", json_integer(batch));
            json_object_set_new(batch_json, "threads", json_integer(threads));
            json_object_set_new(batch_json, "mean", json_real(sum / (double)n_steps));
            json_object_set_new(batch_json, "p50", json_real(steps[(n_steps - 1) / 2]));
            json_object_set_new(batch_json, "p99", json_real(steps[(size_t)((double)(n_steps - 1) * 0.99)]));
            json_object_set_new(batch_json, "max", json_real(steps[n_steps - 1]));
            json_object_set_new(batch_json, "n", json_integer((json_int_t)n_steps));
        }
        for (long i = 0; ms && i < batch; i++) {
            k3_grammar_matcher_free(ms[i]);
            if (masks) free(masks[i]);
        }
        free(ms);
        free(masks);
        free(act);
        free(amask);
        free(pos);
        free(who);
        free(steps);
        k3_pool_free(pool);
    }
    for (size_t i = 0; i < n_cases; i++) free(cases[i].ids);
    free(cases);

    /* samples */
    if (rc == 0 && g && sample > 0) {
        k3_grammar_matcher *m = NULL;
        size_t words = k3_grammar_mask_words(gv);
        uint64_t *mask = malloc(words * sizeof *mask);
        int32_t *allowed = malloc((size_t)k3_tokenizer_n_vocab(tok) * sizeof *allowed);
        int32_t *ids = malloc(((size_t)max_tokens + 1) * sizeof *ids);
        uint64_t rs = seed;
        if (!mask || !allowed || !ids || k3_grammar_matcher_init(&m, g, &err) != K3_OK) rc = fail("out of memory");
        int32_t eos[K3_MAX_EOS_IDS];
        int32_t n_eos = k3_tokenizer_eos_ids(tok, eos);
        for (long s = 0; rc == 0 && s < sample; s++) {
            k3_grammar_matcher_reset(m);
            size_t n = 0;
            bool done = false;
            while ((long)n < max_tokens && rc == 0) {
                if (k3_grammar_matcher_fill_mask(m, mask, &err) != K3_OK) {
                    rc = fail("%s", err.msg);
                    break;
                }
                if (k3_grammar_matcher_is_complete(m) && (rng_next(&rs) % 8 == 0)) {
                    done = true;
                    break;
                }
                int32_t na = 0;
                for (size_t w = 0; w < words; w++)
                    for (uint64_t x = mask[w]; x; x &= x - 1) {
                        int32_t id = (int32_t)(w * 64 + (size_t)__builtin_ctzll(x));
                        bool is_eos = false;
                        for (int32_t e = 0; e < n_eos; e++) is_eos |= eos[e] == id;
                        if (!is_eos) allowed[na++] = id;
                    }
                if (na == 0) {
                    done = k3_grammar_matcher_is_complete(m);
                    break;
                }
                int32_t id = allowed[rng_next(&rs) % (uint64_t)na];
                if (k3_grammar_matcher_accept(m, id, &err) != K3_OK) {
                    rc = fail("sampling: %s", err.msg);
                    break;
                }
                ids[n++] = id;
            }
            if (rc) break;
            char *out = NULL;
            size_t len = 0;
            if (k3_tokenizer_decode(tok, ids, n, &out, &len, &err) != K3_OK) {
                rc = fail("%s", err.msg);
                break;
            }
            json_t *js = json_stringn(out, len);
            char *line = js ? json_dumps(js, JSON_ENCODE_ANY) : NULL;
            if (!json_out) printf("%s%s\n", line ? line : "null", done ? "" : "\t(cut at --max-tokens)");
            else if (line && done) fprintf(stderr, "%s\n", line);
            free(line);
            json_decref(js);
            free(out);
        }
        k3_grammar_matcher_free(m);
        free(mask);
        free(allowed);
        free(ids);
    }

    /* report */
    if (rc == 0 && times_file) {
        FILE *f = fopen(times_file, "w");
        if (!f) rc = fail("cannot write %s: %s", times_file, strerror(errno));
        for (size_t i = 0; f && i < n_times; i++) fprintf(f, "%.3f\n", times[i]);
        if (f && fclose(f) != 0) rc = fail("cannot write %s", times_file);
    }
    double mean = 0, p50 = 0, p99 = 0, mx = 0;
    if (n_times) {
        double sum = 0;
        for (size_t i = 0; i < n_times; i++) sum += times[i];
        mean = sum / (double)n_times;
        qsort(times, n_times, sizeof *times, cmp_double);
        p50 = times[(n_times - 1) / 2];
        p99 = times[(size_t)((double)(n_times - 1) * 0.99)];
        mx = times[n_times - 1];
    }
    if (rc == 0 && json_out) {
        json_t *o = json_object();
        json_object_set_new(o, "compiled", json_boolean(g != NULL));
        json_object_set_new(o, "error", g ? json_null() : json_string(cerr.msg));
        json_object_set_new(o, "compile_ms", json_real(compile_ms));
        json_object_set(o, "results", results);
        json_t *mu = json_object();
        json_object_set_new(mu, "mean", json_real(mean));
        json_object_set_new(mu, "p50", json_real(p50));
        json_object_set_new(mu, "p99", json_real(p99));
        json_object_set_new(mu, "max", json_real(mx));
        json_object_set_new(mu, "n", json_integer((json_int_t)n_times));
        json_object_set_new(o, "mask_us", mu);
        if (batch_json) json_object_set(o, "batch_us", batch_json);
        char *s = json_dumps(o, JSON_REAL_PRECISION(6));
        if (s) puts(s);
        free(s);
        json_decref(o);
    } else if (rc == 0) {
        printf("vocabulary: %d tokens, tables in %.1f ms\n", k3_tokenizer_n_vocab(tok), vocab_ms);
        if (!g) printf("not compiled (%.3f ms): %s\n", compile_ms, cerr.msg);
        else printf("compiled in %.3f ms\n", compile_ms);
        size_t i;
        json_t *r;
        json_array_foreach(results, i, r) {
            json_t *at = json_object_get(r, "rejected_at");
            long long nt = json_integer_value(json_object_get(r, "tokens"));
            if (json_is_null(at)) printf("text %zu: accepted (%lld tokens)\n", i + 1, nt);
            else if (json_integer_value(at) == nt) printf("text %zu: incomplete after all %lld tokens\n", i + 1, nt);
            else printf("text %zu: rejected at token %lld of %lld\n", i + 1, json_integer_value(at), nt);
        }
        if (n_times)
            printf("masks: %zu, mean %.1f us, p50 %.1f us, p99 %.1f us, max %.1f us\n", n_times, mean, p50, p99, mx);
        if (batch_json)
            printf("batch of %lld on %lld threads: %lld steps, mean %.1f us, p50 %.1f us, p99 %.1f us, max %.1f us a "
                   "step\n",
                   (long long)json_integer_value(json_object_get(batch_json, "requests")),
                   (long long)json_integer_value(json_object_get(batch_json, "threads")),
                   (long long)json_integer_value(json_object_get(batch_json, "n")),
                   json_real_value(json_object_get(batch_json, "mean")),
                   json_real_value(json_object_get(batch_json, "p50")),
                   json_real_value(json_object_get(batch_json, "p99")),
                   json_real_value(json_object_get(batch_json, "max")));
    }
    json_decref(results);
    json_decref(batch_json);
    free(times);
    k3_grammar_free(g);
    free(text);
    for (int32_t i = 0; i < n_choices; i++) free(choices[i]);
    free(choices);
    for (int32_t i = 0; tools && i < n_tools; i++) free((char *)tools[i].parameters);
    free(tools);
    json_decref(tools_json);
    k3_grammar_vocab_free(gv);
    k3_tokenizer_free(tok);
    return rc;
}
