/*
 * constraint.c -- a request's structured-output fields as a shared grammar
 * (constraint.h).
 *
 * What becomes which grammar (k3_grammar_spec, include/k3.h):
 *   response_format json_object          K3_GRAMMAR_JSON_OBJECT
 *   response_format json_schema          K3_GRAMMAR_JSON_SCHEMA
 *   structured_outputs.json, guided_json K3_GRAMMAR_JSON_SCHEMA
 *   .regex, guided_regex                 K3_GRAMMAR_REGEX
 *   .choice, guided_choice               K3_GRAMMAR_CHOICE
 *   .grammar, guided_grammar             K3_GRAMMAR_GBNF
 *   .json_object                         K3_GRAMMAR_JSON_OBJECT
 *   tool_choice required                 K3_GRAMMAR_TOOL_CALLS over every tool
 *   tool_choice {function: {name}}       K3_GRAMMAR_TOOL_CALLS over that tool
 *     (beside a response format: OpenAI's meaning, this turn is the call)
 *   tool_choice auto beside a response   K3_GRAMMAR_TOOL_CALLS, tools_optional with
 *     format (JSON schema or object)     that JSON as the text: a call or the JSON
 *   tool_choice auto, a strict tool      K3_GRAMMAR_TOOL_CALLS, tools_optional
 *                                        (text, or the calls)
 * with k3_reply on chat (the content of the K3 assistant turn, after the
 * think block when the turn thinks). JSON is compact (no whitespace between
 * tokens): every JSON reader takes it, and a model cannot run on in
 * whitespace. An object is closed unless its schema opens it
 * (additionalProperties true or a schema), as XGrammar's strict mode (vLLM's
 * default engine) and OpenAI's structured outputs generate it; vLLM's
 * structured_outputs.disable_additional_properties given false opens them.
 * Two constraints (response_format and structured_outputs, or vLLM's own
 * beside a forced tool choice) are a 400.
 *
 * The cache: CACHE_CAP grammars by (kind, flags, text), least recently used
 * out; a lookup and the insert are under the server's grammar mutex, the
 * compile is not (two requests compiling one schema at once keep the first).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/buf.h"
#include "server/constraint.h"
#include "server/http.h"

#define CACHE_CAP 64
#define ANY_OBJECT "{\"type\":\"object\"}"

typedef struct gentry {
    char *key;
    size_t klen;
    uint64_t hash, used;
    k3_grammar *g;
} gentry;

struct k3_srv_gcache {
    gentry e[CACHE_CAP];
    int n;
    uint64_t clock;
};

#define bad k3_srv_bad_set

static uint64_t fnv(const char *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)p[i]) * 1099511628211ull;
    return h;
}

void k3_srv_constraint_free(struct k3_server *s) {
    if (s->gcache) {
        for (int i = 0; i < s->gcache->n; i++) {
            free(s->gcache->e[i].key);
            k3_grammar_free(s->gcache->e[i].g);
        }
        free(s->gcache);
        s->gcache = NULL;
    }
    k3_grammar_vocab_free(s->gvocab);
    s->gvocab = NULL;
}

/* The model's grammar vocabulary, built on first use; NULL with e. */
static const k3_grammar_vocab *vocab(struct k3_server *s, k3_srv_bad *e) {
    pthread_mutex_lock(&s->grammar_mu);
    k3_error err = {0};
    if (!s->gvocab && k3_grammar_vocab_init(&s->gvocab, s->tok, &err)) {
        s->gvocab = NULL;
        bad(e, err.status == K3_ERR_NOMEM ? 500 : 400, "structured outputs: %s", err.msg);
    }
    if (s->gvocab && !s->gcache && !(s->gcache = calloc(1, sizeof *s->gcache)))
        bad(e, 500, "out of memory for the grammar cache");
    const k3_grammar_vocab *v = s->gcache ? s->gvocab : NULL;
    pthread_mutex_unlock(&s->grammar_mu);
    return v;
}

/* The cached grammar of key, with a reference, or NULL. Under grammar_mu. */
static k3_grammar *cache_get(struct k3_srv_gcache *c, const char *key, size_t klen, uint64_t h) {
    for (int i = 0; i < c->n; i++)
        if (c->e[i].hash == h && c->e[i].klen == klen && !memcmp(c->e[i].key, key, klen)) {
            c->e[i].used = ++c->clock;
            return k3_grammar_ref(c->e[i].g);
        }
    return NULL;
}

/* Keeps g under key (one more reference); the least recently used one goes
 * when full. Returns the grammar to use: g, or one another thread put there
 * first (g is then dropped). Under grammar_mu. */
static k3_grammar *cache_put(struct k3_srv_gcache *c, const char *key, size_t klen, uint64_t h, k3_grammar *g) {
    k3_grammar *had = cache_get(c, key, klen, h);
    if (had) {
        k3_grammar_free(g);
        return had;
    }
    char *k = malloc(klen ? klen : 1);
    if (!k) return g; /* not cached: still usable */
    memcpy(k, key, klen);
    int at = c->n;
    if (c->n == CACHE_CAP) {
        at = 0;
        for (int i = 1; i < c->n; i++)
            if (c->e[i].used < c->e[at].used) at = i;
        free(c->e[at].key);
        k3_grammar_free(c->e[at].g);
    } else {
        c->n++;
    }
    c->e[at] = (gentry){k, klen, h, ++c->clock, k3_grammar_ref(g)};
    return g;
}

/* The cache key: the kind and flags, then the texts, NUL-separated. */
static bool spec_key(const k3_grammar_spec *sp, k3_buf *k) {
    char head[64];
    const int n = snprintf(head, sizeof head, "%d|%d%d%d%d%d%d%d%d|", (int)sp->kind, sp->compact,
                           sp->no_extra_properties, sp->k3_reply, sp->thinking, sp->parallel_calls, sp->tools_optional,
                           sp->text != NULL, sp->canonical_numbers);
    k3_buf_add(k, head, (size_t)n);
    if (sp->text) k3_buf_add(k, sp->text, strlen(sp->text) + 1);
    for (int32_t i = 0; i < sp->n_choices; i++) k3_buf_add(k, sp->choices[i], strlen(sp->choices[i]) + 1);
    for (int32_t i = 0; i < sp->n_tools; i++) {
        k3_buf_add(k, sp->tools[i].name, strlen(sp->tools[i].name) + 1);
        const char *p = sp->tools[i].parameters ? sp->tools[i].parameters : "";
        k3_buf_add(k, p, strlen(p) + 1);
    }
    return !k->oom;
}

static bool client_gone(void *conn) { return k3_srv_client_gone(conn); }

/* A compile on a thread of its own at the lowest priority (nice 19), so that
 * a long one takes what the engine's threads leave of the CPU and the other
 * clients keep their inter-token latency; the HTTP thread waits for it. */
typedef struct cjob {
    const k3_grammar_vocab *v;
    const k3_grammar_spec *sp;
    k3_grammar *g;
    k3_error err;
    k3_status st;
} cjob;

static void *compile_main(void *arg) {
    cjob *c = arg;
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19); /* best effort: a thread may always lower itself */
    c->st = k3_grammar_compile(&c->g, c->v, c->sp, &c->err);
    return NULL;
}

static k3_status compile_low(const k3_grammar_vocab *v, const k3_grammar_spec *sp, k3_grammar **out, k3_error *err) {
    cjob c = {.v = v, .sp = sp};
    pthread_t t;
    if (pthread_create(&t, NULL, compile_main, &c)) return k3_grammar_compile(out, v, sp, err); /* here, then */
    pthread_join(t, NULL);
    *out = c.g;
    if (c.st) *err = c.err;
    return c.st;
}

/* Compiles sp (or finds it in the cache) into *out; false with e. The
 * compile (its token tables included) has a time budget and stops when the
 * client of conn (when not NULL) has gone. */
static bool compile(struct k3_server *s, k3_grammar_spec *sp, struct MHD_Connection *conn, k3_grammar **out,
                    k3_srv_bad *e) {
    const k3_grammar_vocab *v = vocab(s, e);
    if (!v) return false;
    k3_buf key = {0};
    if (!spec_key(sp, &key)) {
        k3_buf_free(&key);
        return bad(e, 500, "out of memory for a grammar key");
    }
    const uint64_t h = fnv(key.p, key.len);
    pthread_mutex_lock(&s->grammar_mu);
    *out = cache_get(s->gcache, key.p, key.len, h);
    pthread_mutex_unlock(&s->grammar_mu);
    if (*out) {
        k3_buf_free(&key);
        return true;
    }
    k3_error err = {0};
    k3_grammar *g = NULL;
    sp->cancel = conn ? client_gone : NULL;
    sp->cancel_ctx = conn;
    if (compile_low(v, sp, &g, &err)) {
        k3_buf_free(&key);
        return bad(e, err.status == K3_ERR_NOMEM ? 500 : 400, "%s", err.msg);
    }
    pthread_mutex_lock(&s->grammar_mu);
    *out = cache_put(s->gcache, key.p, key.len, h, g);
    pthread_mutex_unlock(&s->grammar_mu);
    k3_buf_free(&key);
    return true;
}

/* ---- the fields ------------------------------------------------------------ */

/* What one request asks for, before it is compiled. */
typedef struct want {
    k3_grammar_spec sp;
    char *text;             /* owned: a schema's JSON text */
    const char **choices;   /* owned array (strings borrowed from the request) */
    k3_grammar_tool *tools; /* owned array (names borrowed, parameters owned) */
    char where[96];
    const char *source; /* the field that asked, for the two-constraints message */
    bool from_rf;       /* the constraint is the response format's (a forced tool call replaces it) */
    bool open_objects;  /* structured_outputs.disable_additional_properties: false, the opt-out */
} want;

static void want_free(want *w) {
    free(w->text);
    free(w->choices);
    for (int32_t i = 0; i < w->sp.n_tools; i++) free((char *)w->tools[i].parameters);
    free(w->tools);
    memset(w, 0, sizeof *w);
}

/* A schema value (an object, a boolean, or a string holding one) as text. */
static bool schema_text(json_t *v, const char *field, char **out, k3_srv_bad *e) {
    if (json_is_string(v)) {
        json_error_t je;
        json_t *x = json_loads(json_string_value(v), JSON_DECODE_ANY, &je);
        if (!x) return bad(e, 400, "\"%s\" is not a JSON Schema: %s", field, je.text);
        json_decref(x);
        *out = strdup(json_string_value(v));
    } else if (json_is_object(v) || json_is_boolean(v)) {
        *out = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    } else {
        return bad(e, 400, "\"%s\" must be a JSON Schema (an object)", field);
    }
    return *out ? true : bad(e, 500, "out of memory");
}

static bool set_source(want *w, const char *source, k3_srv_bad *e) {
    if (w->source)
        return bad(e, 400, "\"%s\" and \"%s\" both constrain the output: give one of them", w->source, source);
    w->source = source;
    return true;
}

static bool from_response_format(json_t *rf, const char *name, const char *schema_name, want *w, k3_srv_bad *e) {
    if (!rf || json_is_null(rf)) return true;
    if (!json_is_object(rf)) return bad(e, 400, "\"%s\" must be an object", name);
    const char *type = json_string_value(json_object_get(rf, "type"));
    if (!type) return bad(e, 400, "\"%s\" needs a \"type\": text, json_object or json_schema", name);
    if (!strcmp(type, "text")) return true;
    if (!strcmp(type, "json_object")) {
        if (!set_source(w, name, e)) return false;
        w->from_rf = true;
        w->sp.kind = K3_GRAMMAR_JSON_OBJECT;
        snprintf(w->where, sizeof w->where, "%s", name);
        return true;
    }
    if (strcmp(type, "json_schema"))
        return bad(e, 400, "\"%s.type\" is \"%.40s\", not text, json_object or json_schema", name, type);
    json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js)) return bad(e, 400, "\"%s\" of type json_schema needs a \"json_schema\" object", name);
    json_t *schema = json_object_get(js, "schema"), *strict = json_object_get(js, "strict");
    if (strict && !json_is_null(strict) && !json_is_boolean(strict))
        return bad(e, 400, "\"%s.json_schema.strict\" must be true or false", name);
    if (!set_source(w, name, e)) return false;
    w->from_rf = true;
    if (!schema || json_is_null(schema)) { /* no schema: any JSON object */
        w->sp.kind = K3_GRAMMAR_JSON_OBJECT;
        snprintf(w->where, sizeof w->where, "%s", name);
        return true;
    }
    char field[96];
    if (schema_name) snprintf(field, sizeof field, "%s", schema_name);
    else snprintf(field, sizeof field, "%s.json_schema.schema", name);
    if (!schema_text(schema, field, &w->text, e)) return false;
    w->sp.kind = K3_GRAMMAR_JSON_SCHEMA;
    snprintf(w->where, sizeof w->where, "%s", field);
    return true;
}

/* One of vLLM's constraints: key (json, regex, choice, grammar, json_object)
 * holding v, named field in messages. */
static bool from_vllm_one(const char *key, json_t *v, const char *field, want *w, k3_srv_bad *e) {
    if (!strcmp(key, "json_object")) {
        if (!json_is_true(v)) return json_is_false(v) ? true : bad(e, 400, "\"%s\" must be true or false", field);
        if (!set_source(w, field, e)) return false;
        w->sp.kind = K3_GRAMMAR_JSON_OBJECT;
    } else if (!strcmp(key, "json")) {
        if (!set_source(w, field, e) || !schema_text(v, field, &w->text, e)) return false;
        w->sp.kind = K3_GRAMMAR_JSON_SCHEMA;
    } else if (!strcmp(key, "regex") || !strcmp(key, "grammar")) {
        if (!json_is_string(v)) return bad(e, 400, "\"%s\" must be a string", field);
        if (!set_source(w, field, e)) return false;
        if (!(w->text = strdup(json_string_value(v)))) return bad(e, 500, "out of memory");
        w->sp.kind = !strcmp(key, "regex") ? K3_GRAMMAR_REGEX : K3_GRAMMAR_GBNF;
    } else { /* choice */
        if (!json_is_array(v) || json_array_size(v) == 0)
            return bad(e, 400, "\"%s\" must be a non-empty list of strings", field);
        if (!set_source(w, field, e)) return false;
        const size_t n = json_array_size(v);
        if (!(w->choices = calloc(n, sizeof *w->choices))) return bad(e, 500, "out of memory");
        for (size_t i = 0; i < n; i++) {
            json_t *x = json_array_get(v, i);
            if (!json_is_string(x)) return bad(e, 400, "\"%s\"[%zu] is not a string", field, i);
            w->choices[i] = json_string_value(x);
        }
        w->sp.kind = K3_GRAMMAR_CHOICE;
        w->sp.n_choices = (int32_t)n;
    }
    snprintf(w->where, sizeof w->where, "%s", field);
    return true;
}

static bool from_vllm(json_t *root, want *w, k3_srv_bad *e) {
    if (!root) return true;
    static const char *const keys[] = {"json", "regex", "choice", "grammar", "json_object"};
    static const char *const fields[] = {"structured_outputs.json", "structured_outputs.regex",
                                         "structured_outputs.choice", "structured_outputs.grammar",
                                         "structured_outputs.json_object"};
    static const char *const guided[] = {"guided_json", "guided_regex", "guided_choice", "guided_grammar", NULL};
    json_t *so = json_object_get(root, "structured_outputs");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) return bad(e, 400, "\"structured_outputs\" must be an object");
        json_t *st = json_object_get(so, "structural_tag");
        if (st && !json_is_null(st)) return bad(e, 400, "\"structured_outputs.structural_tag\" is not supported");
        for (int i = 0; i < 5; i++) {
            json_t *v = json_object_get(so, keys[i]);
            if (v && !json_is_null(v) && !from_vllm_one(keys[i], v, fields[i], w, e)) return false;
        }
        /* objects are closed unless the schema opens them (XGrammar's strict
         * mode, vLLM's default); vLLM's own switch, given false, opens them */
        json_t *dap = json_object_get(so, "disable_additional_properties");
        if (dap && !json_is_null(dap) && !json_is_boolean(dap))
            return bad(e, 400, "\"structured_outputs.disable_additional_properties\" must be true or false");
        if (json_is_false(dap)) w->open_objects = true;
    }
    for (int i = 0; guided[i]; i++) {
        json_t *v = json_object_get(root, guided[i]);
        if (v && !json_is_null(v) && !from_vllm_one(keys[i], v, guided[i], w, e)) return false;
    }
    return true;
}

/* The tools' names and parameters (chat's shape) into w->tools; only one
 * (index `only`) when only >= 0. */
static bool tools_of(json_t *tools, int only, want *w, k3_srv_bad *e) {
    const size_t n = json_array_size(tools);
    if (!(w->tools = calloc(n ? n : 1, sizeof *w->tools))) return bad(e, 500, "out of memory");
    for (size_t i = 0; i < n; i++) {
        if (only >= 0 && (size_t)only != i) continue;
        json_t *f = json_object_get(json_array_get(tools, i), "function"), *p = json_object_get(f, "parameters");
        k3_grammar_tool *t = &w->tools[w->sp.n_tools++];
        t->name = json_string_value(json_object_get(f, "name"));
        if (p && !json_is_null(p)) {
            char field[64];
            snprintf(field, sizeof field, "tools[%zu].function.parameters", i);
            char *txt = NULL;
            if (!schema_text(p, field, &txt, e)) return false;
            t->parameters = txt;
        }
    }
    w->sp.tools = w->tools;
    return true;
}

static bool from_tools(const k3_srv_constraint_in *in, want *w, k3_srv_bad *e) {
    json_t *tools = in->tools && !json_is_null(in->tools) ? in->tools : NULL, *tc = in->tool_choice;
    if (tools && !json_is_array(tools)) return bad(e, 400, "\"tools\" must be a list");
    const size_t n = json_array_size(tools);
    bool any_strict = false;
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(tools, i), *f = json_object_get(t, "function");
        const char *type = json_string_value(json_object_get(t, "type"));
        if (!json_is_object(t) || !type || strcmp(type, "function") || !json_is_object(f) ||
            !json_is_string(json_object_get(f, "name")))
            return bad(e, 400, "\"tools\"[%zu] must be {\"type\": \"function\", \"function\": {\"name\", ...}}", i);
        any_strict |= json_is_true(json_object_get(f, "strict"));
    }
    int only = -1;
    bool forced = false;
    if (json_is_string(tc)) {
        const char *v = json_string_value(tc);
        if (!strcmp(v, "none")) return true;
        if (!strcmp(v, "required")) forced = true;
        else if (strcmp(v, "auto"))
            return bad(e, 400, "\"tool_choice\" is \"%.40s\", not none, auto, required or a named function", v);
    } else if (json_is_object(tc)) {
        const char *name = json_string_value(json_object_get(json_object_get(tc, "function"), "name"));
        if (!name)
            return bad(e, 400, "\"tool_choice\" must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
        for (size_t i = 0; i < n && only < 0; i++)
            if (!strcmp(json_string_value(
                            json_object_get(json_object_get(json_array_get(tools, i), "function"), "name")),
                        name))
                only = (int)i;
        if (only < 0)
            return bad(e, 400, "\"tool_choice\" names the function \"%.100s\", which is not in \"tools\"", name);
        forced = true;
    } else if (tc && !json_is_null(tc)) {
        return bad(e, 400, "\"tool_choice\" must be a string or an object");
    }
    if (forced && n == 0) return bad(e, 400, "\"tool_choice\" asks for a tool call and \"tools\" is empty");
    if (n == 0) return true;
    /* OpenAI's meaning of tools beside an output schema: a forced tool
     * choice makes this turn a tool call (the schema is for the answer a
     * later turn gives); with auto the reply is a tool call or text that
     * matches the schema -- one grammar, the union */
    const bool union_text =
        !forced && w->source && (w->sp.kind == K3_GRAMMAR_JSON_SCHEMA || w->sp.kind == K3_GRAMMAR_JSON_OBJECT);
    if (!forced && !any_strict && !union_text) return true; /* auto: the model is free (or another constraint holds) */
    if (!in->k3_reply) return bad(e, 400, "\"tool_choice\" needs a chat reply to call tools in");
    if (forced) {
        if (w->source && !w->from_rf) return set_source(w, "tool_choice", e); /* vLLM's own constraint beside it */
        free(w->text);
        w->text = NULL;
        w->source = "tool_choice";
    } else if (union_text) {
        if (w->sp.kind == K3_GRAMMAR_JSON_OBJECT && !(w->text = strdup(ANY_OBJECT)))
            return bad(e, 500, "out of memory");
        w->sp.tools_optional = true;
        w->sp.text_where = strdup(w->where);
        if (!w->sp.text_where) return bad(e, 500, "out of memory");
    } else if (w->source) {
        return true; /* vLLM's regex, choice or grammar wins; the calls stay free */
    } else {
        w->source = "tools";
        w->sp.tools_optional = true;
    }
    w->sp.kind = K3_GRAMMAR_TOOL_CALLS;
    w->sp.parallel_calls = in->parallel_calls;
    snprintf(w->where, sizeof w->where, "tools");
    if (!tools_of(tools, only, w, e)) return false;
    return true;
}

bool k3_srv_constraint(struct k3_server *s, const k3_srv_constraint_in *in, k3_grammar **out, k3_srv_bad *e) {
    *out = NULL;
    want w;
    memset(&w, 0, sizeof w);
    bool ok = from_response_format(in->response_format, in->rf_name ? in->rf_name : "response_format", in->schema_name,
                                   &w, e) &&
        from_vllm(in->vllm, &w, e) && from_tools(in, &w, e);
    if (ok && w.source) {
        w.sp.text = w.text;
        w.sp.choices = w.choices;
        w.sp.compact = true;
        w.sp.canonical_numbers = true;
        w.sp.no_extra_properties = !w.open_objects;
        w.sp.k3_reply = in->k3_reply;
        w.sp.thinking = in->k3_reply && in->thinking;
        w.sp.where = w.where;
        ok = compile(s, &w.sp, in->conn, out, e);
        /* auto: a tool that is not strict whose parameters the engine cannot
         * honour takes any arguments object rather than refusing the request
         * (OpenAI does not hold non-strict arguments to their schema) */
        for (int32_t tries = 0; !ok && e->status == 400 && w.sp.kind == K3_GRAMMAR_TOOL_CALLS && w.sp.tools_optional &&
             tries < w.sp.n_tools;
             tries++) {
            int i = -1;
            if (sscanf(e->msg, "tools[%d]", &i) != 1 || i < 0 || i >= w.sp.n_tools) break;
            json_t *f = json_object_get(json_array_get(in->tools, (size_t)i), "function");
            if (json_is_true(json_object_get(f, "strict")) || !w.tools[i].parameters ||
                !strcmp(w.tools[i].parameters, ANY_OBJECT))
                break;
            free((char *)w.tools[i].parameters);
            if (!(w.tools[i].parameters = strdup(ANY_OBJECT))) break;
            ok = compile(s, &w.sp, in->conn, out, e);
        }
        /* a named tool's index in the request, where the compiler counts the tools it was given */
        if (!ok && w.sp.kind == K3_GRAMMAR_TOOL_CALLS && w.sp.n_tools == 1 && json_array_size(in->tools) > 1 &&
            !strncmp(e->msg, "tools[0]", 8)) {
            json_t *tc = in->tool_choice;
            const char *name = json_string_value(json_object_get(json_object_get(tc, "function"), "name"));
            for (size_t i = 0; name && i < json_array_size(in->tools); i++)
                if (!strcmp(name,
                            json_string_value(
                                json_object_get(json_object_get(json_array_get(in->tools, i), "function"), "name")))) {
                    char rest[sizeof e->msg];
                    snprintf(rest, sizeof rest, "%s", e->msg + 8);
                    snprintf(e->msg, sizeof e->msg, "tools[%zu]%.480s", i, rest);
                    break;
                }
        }
    }
    free((char *)w.sp.text_where);
    want_free(&w);
    return ok;
}

bool k3_srv_constraint_openai(struct k3_server *s, unsigned api, json_t *root, bool thinking, k3_grammar **out,
                              struct MHD_Connection *conn, k3_srv_bad *e) {
    const bool chat = api & K3_API_CHAT;
    json_t *par = json_object_get(root, "parallel_tool_calls");
    if (par && !json_is_null(par) && !json_is_boolean(par))
        return bad(e, 400, "\"parallel_tool_calls\" must be true or false");
    k3_srv_constraint_in in = {.response_format = chat ? json_object_get(root, "response_format") : NULL,
                               .tools = chat ? json_object_get(root, "tools") : NULL,
                               .tool_choice = chat ? json_object_get(root, "tool_choice") : NULL,
                               .parallel_calls = !json_is_false(par),
                               .vllm = root,
                               .k3_reply = chat,
                               .thinking = thinking,
                               .conn = conn};
    if (!chat) {
        json_t *rf = json_object_get(root, "response_format");
        if (rf && !json_is_null(rf)) in.response_format = rf; /* vLLM takes it on completions too */
    }
    return k3_srv_constraint(s, &in, out, e);
}

bool k3_srv_constraint_words(struct k3_server *s, json_t *response_format, const char *rf_name, const char *schema_name,
                             json_t *tools, const char *tool_choice, const char *tool_name, bool parallel_calls,
                             bool thinking, k3_grammar **out, struct MHD_Connection *conn, k3_srv_bad *e) {
    json_t *tc = NULL;
    if (tool_name) tc = json_pack("{s:s,s:{s:s}}", "type", "function", "function", "name", tool_name);
    else if (tool_choice) tc = json_string(tool_choice);
    if ((tool_name || tool_choice) && !tc) return bad(e, 500, "out of memory");
    k3_srv_constraint_in in = {.response_format = response_format,
                               .rf_name = rf_name,
                               .schema_name = schema_name,
                               .tools = tools,
                               .tool_choice = tc,
                               .parallel_calls = parallel_calls,
                               .k3_reply = true,
                               .thinking = thinking,
                               .conn = conn};
    const bool ok = k3_srv_constraint(s, &in, out, e);
    json_decref(tc);
    return ok;
}
