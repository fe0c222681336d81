/*
 * request.c -- the request table (request.h).
 *
 * To take a new field: a member in k3_srv_request, a row below (its JSON
 * name, the surfaces that take it, how it is checked), and its use where
 * the job turns the request into engine requests (job.c). A surface that
 * spells the field otherwise adds a row with its own name and bit.
 */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/request.h"

#define ALL (K3_API_COMPLETIONS | K3_API_CHAT)
#define RESP K3_API_RESPONSES
#define MSGS K3_API_MESSAGES

typedef enum {
    F_NUM,            /* a number in [lo, hi] (double) */
    F_INT,            /* an integer in [ilo, ihi] (long long) */
    F_BOOL,           /* true or false (bool) */
    F_SEED,           /* an integer in [ilo, ihi]; also records that it was given */
    F_STOP,           /* a string or a list of strings (k3_stops) */
    F_STOP_IDS,       /* a list of token ids */
    F_LOGIT_BIAS,     /* {"token id": bias} */
    F_ALLOWED_IDS,    /* a non-empty list of token ids */
    F_BAD_WORDS,      /* a list of strings, tokenized as vLLM does */
    F_TOP_LOGPROBS,   /* chat's count of top alternatives, after its "logprobs" flag */
    F_STREAM_OPTIONS, /* {"include_usage": bool}, only with "stream": true */
    F_KV_TRANSFER,    /* vLLM's kv_transfer_params: an object, kept for the job (src/pd reads it) */
    F_SPEC,           /* speculative_config: {method, num_speculative_tokens} (vLLM's field names) */
    F_SALT,           /* vLLM's cache_salt: a non-empty string, kept as its hash */
    F_PROMPT,         /* the surface's own prompt field(s) */
    F_UNSUPPORTED,    /* not implemented: refused unless it asks for nothing */
} kind;

/* What an F_UNSUPPORTED field may hold and still ask for nothing. */
typedef enum { NOTHING_NULL, NOTHING_ZERO, NOTHING_EMPTY_OBJECT, NOTHING_UP_TO_N } nothing;

typedef struct field {
    const char *name; /* the JSON key */
    unsigned apis;    /* the surfaces that take it (K3_API_* bits) */
    kind kind;
    size_t off; /* the member of k3_srv_request it fills */
    double lo, hi;
    long long ilo, ihi;
    nothing nothing;
    const char *hint; /* after "is not supported" */
} field;

#define M(member) offsetof(k3_srv_request, member)
#define NUM(name, apis, member, lo, hi) \
    { name, apis, F_NUM, M(member), lo, hi, 0, 0, 0, NULL }
#define INT(name, apis, member, lo, hi) \
    { name, apis, F_INT, M(member), 0, 0, lo, hi, 0, NULL }
#define BOOL(name, apis, member) \
    { name, apis, F_BOOL, M(member), 0, 0, 0, 0, 0, NULL }
#define UNSUPPORTED(name, apis, nothing, hint) \
    { name, apis, F_UNSUPPORTED, 0, 0, 0, 0, 0, nothing, hint }
#define SPECIAL(name, apis, kind) \
    { name, apis, kind, 0, 0, 0, 0, 0, 0, NULL }

static const field fields[] = {
    NUM("temperature", ALL | RESP | MSGS, temperature, 0, 2),
    NUM("top_p", ALL | RESP | MSGS, top_p, 1e-9, 1),
    NUM("min_p", ALL | RESP, min_p, 0, 1),
    NUM("repetition_penalty", ALL | RESP, repetition_penalty, 1e-6, 100),
    INT("top_k", ALL | RESP | MSGS, top_k, -1, 1 << 30),
    INT("n", ALL, n, 1, K3_SRV_MAX_N),
    {"seed", ALL | RESP, F_SEED, M(seed), 0, 0, INT64_MIN, INT64_MAX, 0, NULL},
    INT("max_tokens", ALL | MSGS, max_tokens, 0, 1 << 30),
    INT("min_tokens", ALL, min_tokens, 0, 1 << 30),
    BOOL("stream", ALL | RESP | MSGS, stream),
    BOOL("ignore_eos", ALL | RESP | MSGS, ignore_eos),
    SPECIAL("stop", ALL | RESP, F_STOP),
    SPECIAL("stop_sequences", MSGS, F_STOP),
    BOOL("return_tokens_as_token_ids", ALL, tok_ids),
    INT("max_completion_tokens", K3_API_CHAT, max_tokens, 0, 1 << 30),
    INT("max_output_tokens", RESP, max_tokens, 1, 1 << 30),
    NUM("frequency_penalty", ALL, frequency_penalty, -2, 2),
    NUM("presence_penalty", ALL, presence_penalty, -2, 2),
    SPECIAL("logit_bias", ALL, F_LOGIT_BIAS),
    SPECIAL("allowed_token_ids", ALL, F_ALLOWED_IDS),
    SPECIAL("bad_words", ALL, F_BAD_WORDS),
    BOOL("include_stop_str_in_output", ALL, include_stop_str),
    BOOL("skip_special_tokens", ALL, skip_special_tokens),
    BOOL("spaces_between_special_tokens", ALL, spaces_between_special_tokens),
    UNSUPPORTED("best_of", ALL, NOTHING_UP_TO_N, ""),
    UNSUPPORTED("suffix", ALL, NOTHING_NULL, ""),
    BOOL("echo", K3_API_COMPLETIONS, echo),
    INT("logprobs", K3_API_COMPLETIONS, logprobs, 0, K3_SRV_MAX_TOP),
    BOOL("logprobs", K3_API_CHAT, want_logprobs),
    {"top_logprobs", K3_API_CHAT, F_TOP_LOGPROBS, M(logprobs), 0, 0, 0, K3_SRV_MAX_TOP, 0, NULL},
    SPECIAL("stream_options", ALL, F_STREAM_OPTIONS),
    SPECIAL(NULL, ALL | RESP | MSGS, F_PROMPT),
    SPECIAL("stop_token_ids", ALL, F_STOP_IDS),
    SPECIAL("kv_transfer_params", ALL | RESP | MSGS, F_KV_TRANSFER),
    SPECIAL("speculative_config", ALL | RESP | MSGS, F_SPEC),
    SPECIAL("cache_salt", ALL | RESP, F_SALT),
};

bool k3_srv_bad_set(k3_srv_bad *e, unsigned status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    e->status = status;
    return false;
}
#define bad k3_srv_bad_set

/* A number field: absent/null keeps *out. */
static bool get_num(json_t *root, const char *key, double lo, double hi, double *out, k3_srv_bad *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_number(v)) return bad(e, 400, "\"%s\" must be a number", key);
    const double d = json_number_value(v);
    if (!(d >= lo && d <= hi)) return bad(e, 400, "\"%s\" is %g, not in [%g, %g]", key, d, lo, hi);
    *out = d;
    return true;
}

static bool get_int(json_t *root, const char *key, long long lo, long long hi, long long *out, k3_srv_bad *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_integer(v)) return bad(e, 400, "\"%s\" must be an integer", key);
    const long long d = json_integer_value(v);
    if (d < lo || d > hi) return bad(e, 400, "\"%s\" is %lld, not in [%lld, %lld]", key, d, lo, hi);
    *out = d;
    return true;
}

static bool get_bool(json_t *root, const char *key, bool *out, k3_srv_bad *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_boolean(v)) return bad(e, 400, "\"%s\" must be true or false", key);
    *out = json_is_true(v);
    return true;
}

static bool parse_stops(json_t *root, const char *key, k3_stops *st, k3_srv_bad *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return true;
    const bool one = json_is_string(v);
    if (!one && !json_is_array(v)) return bad(e, 400, "\"%s\" must be a string or a list of strings", key);
    const size_t n = one ? 1 : json_array_size(v);
    if (n > K3_SRV_MAX_STOPS) return bad(e, 400, "\"%s\" has %zu strings, more than %d", key, n, K3_SRV_MAX_STOPS);
    st->s = calloc(n ? n : 1, sizeof *st->s);
    st->len = calloc(n ? n : 1, sizeof *st->len);
    if (!st->s || !st->len) return bad(e, 500, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *x = one ? v : json_array_get(v, i);
        if (!json_is_string(x)) return bad(e, 400, "\"%s\"[%zu] is not a string", key, i);
        if (json_string_length(x) == 0) continue;
        if (json_string_length(x) > 256) return bad(e, 400, "\"%s\"[%zu] is longer than 256 bytes", key, i);
        st->s[st->n] = strndup(json_string_value(x), json_string_length(x));
        if (!st->s[st->n]) return bad(e, 500, "out of memory");
        st->len[st->n++] = json_string_length(x);
    }
    return true;
}

static bool parse_stop_ids(struct k3_server *s, json_t *root, const char *key, k3_srv_request *rq, k3_srv_bad *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_array(v) || json_array_size(v) > K3_SRV_MAX_STOPS)
        return bad(e, 400, "\"%s\" must be a list of at most %d ids", key, K3_SRV_MAX_STOPS);
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *x = json_array_get(v, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= k3_tokenizer_n_vocab(s->tok))
            return bad(e, 400, "\"%s\"[%zu] is not a token id", key, i);
        rq->stop_ids[rq->n_stop_ids++] = (int32_t)json_integer_value(x);
    }
    return true;
}

/* {"token id": bias}: OpenAI's logit_bias, the bias clamped to [-100, 100]
 * (as OpenAI and vLLM do); a key that is not a token id is the error,
 * named. Keys naming one id twice ("5", "05"): the last one counts. */
typedef struct bias_at {
    k3_logit_bias b;
    size_t at;
} bias_at;

static int bias_order(const void *a, const void *b) {
    const bias_at *x = a, *y = b;
    if (x->b.id != y->b.id) return x->b.id < y->b.id ? -1 : 1;
    return x->at < y->at ? -1 : x->at > y->at;
}

static bool parse_logit_bias(struct k3_server *s, json_t *root, const char *key, k3_srv_request *rq, k3_srv_bad *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_object(v)) return bad(e, 400, "\"%s\" must be an object of token ids to biases", key);
    const size_t n = json_object_size(v);
    if (n == 0) return true;
    const int32_t nv = k3_tokenizer_n_vocab(s->tok);
    bias_at *all = malloc(sizeof *all * n);
    if (!all) return bad(e, 500, "out of memory");
    size_t i = 0;
    const char *k;
    json_t *x;
    json_object_foreach(v, k, x) {
        char *end = NULL;
        const long long id = strtoll(k, &end, 10);
        if (!*k || *end || id < 0 || id >= nv) {
            free(all);
            return bad(e, 400, "\"%s\" key \"%.40s\" is not a token id in 0..%d", key, k, nv - 1);
        }
        if (!json_is_number(x)) {
            free(all);
            return bad(e, 400, "\"%s\"[\"%.40s\"] must be a number", key, k);
        }
        double b = json_number_value(x);
        b = b < -100 ? -100 : b > 100 ? 100 : b;
        all[i] = (bias_at){{(int32_t)id, (float)b}, i};
        i++;
    }
    qsort(all, n, sizeof *all, bias_order);
    rq->logit_bias = malloc(sizeof *rq->logit_bias * n);
    if (!rq->logit_bias) {
        free(all);
        return bad(e, 500, "out of memory");
    }
    for (size_t j = 0; j < n; j++)
        if (j + 1 == n || all[j + 1].b.id != all[j].b.id) rq->logit_bias[rq->n_logit_bias++] = all[j].b;
    free(all);
    return true;
}

static bool parse_allowed_ids(struct k3_server *s, json_t *root, const char *key, k3_srv_request *rq, k3_srv_bad *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_array(v)) return bad(e, 400, "\"%s\" must be a list of token ids", key);
    const size_t n = json_array_size(v);
    const int32_t nv = k3_tokenizer_n_vocab(s->tok);
    if (n == 0) return bad(e, 400, "\"%s\" is empty: no token could be generated", key);
    if (n > (size_t)nv) return bad(e, 400, "\"%s\" has %zu ids, more than the %d of the vocabulary", key, n, nv);
    if (!(rq->allowed_ids = malloc(sizeof *rq->allowed_ids * n))) return bad(e, 500, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(v, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= nv)
            return bad(e, 400, "\"%s\"[%zu] is not a token id in 0..%d", key, i, nv - 1);
        rq->allowed_ids[rq->n_allowed++] = (int32_t)json_integer_value(x);
    }
    return true;
}

/* vLLM's bad words: each string, its leading whitespace stripped, is
 * tokenized alone, and again after one space when that spells it with
 * another first token and as many tokens (the word inside a text). */
static bool add_bad_word(k3_srv_request *rq, const int32_t *ids, size_t n, size_t *cap, k3_srv_bad *e) {
    const size_t have = rq->n_bad_words ? (size_t)rq->bad_word_off[rq->n_bad_words] : 0;
    if (have + n > *cap) {
        size_t c = *cap ? *cap * 2 : 64;
        while (c < have + n) c *= 2;
        int32_t *w = realloc(rq->bad_words, sizeof *w * c);
        if (!w) return bad(e, 500, "out of memory");
        rq->bad_words = w;
        *cap = c;
    }
    memcpy(rq->bad_words + have, ids, sizeof *ids * n);
    rq->n_bad_words++;
    rq->bad_word_off[rq->n_bad_words] = (int32_t)(have + n);
    return true;
}

static bool parse_bad_words(struct k3_server *s, json_t *root, const char *key, k3_srv_request *rq, k3_srv_bad *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_array(v)) return bad(e, 400, "\"%s\" must be a list of strings", key);
    const size_t n = json_array_size(v);
    if (n > K3_SRV_MAX_BAD_WORDS)
        return bad(e, 400, "\"%s\" has %zu strings, more than %d", key, n, K3_SRV_MAX_BAD_WORDS);
    if (n == 0) return true;
    if (!(rq->bad_word_off = calloc(2 * n + 1, sizeof *rq->bad_word_off))) return bad(e, 500, "out of memory");
    size_t cap = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(v, i);
        if (!json_is_string(x)) return bad(e, 400, "\"%s\"[%zu] is not a string", key, i);
        const char *w = json_string_value(x);
        size_t len = json_string_length(x);
        while (len && (*w == ' ' || *w == '\t' || *w == '\n' || *w == '\r' || *w == '\f' || *w == '\v')) w++, len--;
        if (!len) return bad(e, 400, "\"%s\"[%zu] is empty", key, i);
        if (len > 256) return bad(e, 400, "\"%s\"[%zu] is longer than 256 bytes", key, i);
        char spaced[258] = " ";
        memcpy(spaced + 1, w, len);
        int32_t *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        k3_error err = {0};
        if (k3_tokenizer_encode(s->tok, w, len, &a, &na, &err) ||
            k3_tokenizer_encode(s->tok, spaced, len + 1, &b, &nb, &err)) {
            free(a);
            return bad(e, 400, "\"%s\"[%zu]: %s", key, i, err.msg);
        }
        bool ok = na == 0 || add_bad_word(rq, a, na, &cap, e);
        if (ok && na > 0 && nb == na && b[0] != a[0]) ok = add_bad_word(rq, b, nb, &cap, e);
        free(a);
        free(b);
        if (!ok) return false;
    }
    return true;
}

/* A field k3 does not implement is refused, not ignored, unless it asks for nothing. */
static bool asks_nothing(const field *f, json_t *v, const k3_srv_request *rq) {
    if (!v || json_is_null(v)) return true;
    switch (f->nothing) {
    case NOTHING_ZERO: return json_is_number(v) && json_number_value(v) == 0.0;
    case NOTHING_EMPTY_OBJECT: return json_is_object(v) && json_object_size(v) == 0;
    case NOTHING_UP_TO_N: return json_is_integer(v) && json_integer_value(v) <= rq->n;
    default: return false;
    }
}

static bool parse_field(struct k3_server *s, const field *f, k3_srv_prompt_fn prompt, json_t *root, k3_srv_request *rq,
                        k3_srv_bad *e) {
    char *m = (char *)rq + f->off;
    switch (f->kind) {
    case F_NUM: return get_num(root, f->name, f->lo, f->hi, (double *)m, e);
    case F_INT: return get_int(root, f->name, f->ilo, f->ihi, (long long *)m, e);
    case F_BOOL: return get_bool(root, f->name, (bool *)m, e);
    case F_SEED:
        rq->seed_given = json_is_integer(json_object_get(root, f->name));
        return get_int(root, f->name, f->ilo, f->ihi, (long long *)m, e);
    case F_STOP: return parse_stops(root, f->name, &rq->stops, e);
    case F_STOP_IDS: return parse_stop_ids(s, root, f->name, rq, e);
    case F_LOGIT_BIAS: return parse_logit_bias(s, root, f->name, rq, e);
    case F_ALLOWED_IDS: return parse_allowed_ids(s, root, f->name, rq, e);
    case F_BAD_WORDS: return parse_bad_words(s, root, f->name, rq, e);
    case F_TOP_LOGPROBS: {
        long long top = 0;
        if (!get_int(root, f->name, f->ilo, f->ihi, &top, e)) return false;
        if (rq->want_logprobs) *(long long *)m = top;
        json_t *v = json_object_get(root, f->name);
        if (v && !rq->want_logprobs && !json_is_null(v)) return bad(e, 400, "\"%s\" needs \"logprobs\": true", f->name);
        return true;
    }
    case F_STREAM_OPTIONS: {
        json_t *so = json_object_get(root, f->name);
        if (!so || json_is_null(so)) return true;
        if (!json_is_object(so)) return bad(e, 400, "\"%s\" must be an object", f->name);
        if (!rq->stream) return bad(e, 400, "\"%s\" is only allowed with \"stream\": true", f->name);
        return get_bool(so, "include_usage", &rq->include_usage, e);
    }
    case F_KV_TRANSFER: {
        json_t *kt = json_object_get(root, f->name);
        if (!kt || json_is_null(kt)) return true;
        if (!json_is_object(kt)) return bad(e, 400, "\"%s\" must be an object", f->name);
        rq->kv_transfer = json_incref(kt);
        return true;
    }
    case F_SPEC: {
        /* this request's speculative decoding, with vLLM's speculative_config
         * names: "method" (suffix, ngram, draft_model, off) and
         * "num_speculative_tokens"; other keys of it are refused */
        json_t *sc = json_object_get(root, f->name);
        if (!sc || json_is_null(sc)) return true;
        if (!json_is_object(sc)) return bad(e, 400, "\"%s\" must be an object", f->name);
        const char *key;
        json_t *v;
        json_object_foreach(sc, key, v) {
            if (!strcmp(key, "method")) {
                const char *name = json_is_string(v) ? json_string_value(v) : NULL;
                const char *names[] = {"off", "suffix", "ngram", "draft_model"};
                const k3_spec_method ms[] = {K3_SPEC_OFF, K3_SPEC_SUFFIX, K3_SPEC_NGRAM, K3_SPEC_DRAFT_MODEL};
                rq->spec_method = K3_SPEC_DEFAULT;
                for (int i = 0; name && i < 4; i++)
                    if (!strcmp(name, names[i])) rq->spec_method = ms[i];
                if (rq->spec_method == K3_SPEC_DEFAULT)
                    return bad(e, 400, "\"%s.method\" must be one of suffix, ngram, draft_model, off", f->name);
            } else if (!strcmp(key, "num_speculative_tokens")) {
                long long k = 0;
                if (!get_int(sc, key, 1, K3_SPEC_MAX_TOKENS, &k, e))
                    return bad(e, 400, "\"%s.num_speculative_tokens\" must be an integer in [1, %d]", f->name,
                               K3_SPEC_MAX_TOKENS);
                rq->spec_k = (int)k;
            } else {
                return bad(e, 400, "\"%s.%s\" is not supported (method, num_speculative_tokens are)", f->name, key);
            }
        }
        return true;
    }
    case F_SALT: {
        /* the prefix cache (RAM and disk) shares blocks only within a salt */
        json_t *v = json_object_get(root, f->name);
        if (!v || json_is_null(v)) return true;
        if (!json_is_string(v) || !json_string_length(v) || json_string_length(v) > 4096)
            return bad(e, 400, "Parameter '%s' must be a non-empty string of at most 4096 bytes if provided", f->name);
        const char *t = json_string_value(v);
        uint64_t h = 0xcbf29ce484222325ull;
        for (size_t i = 0; i < json_string_length(v); i++) h = (h ^ (uint8_t)t[i]) * 0x100000001b3ull;
        rq->cache_salt = h | 1;
        return true;
    }
    case F_PROMPT: return prompt(s, root, rq, e);
    case F_UNSUPPORTED:
        if (asks_nothing(f, json_object_get(root, f->name), rq)) return true;
        return bad(e, 400, "\"%s\" is not supported%s", f->name, f->hint);
    }
    return true;
}

bool k3_srv_request_parse(struct k3_server *s, unsigned api, k3_srv_prompt_fn prompt, json_t *root, k3_srv_request *rq,
                          k3_srv_bad *e) {
    memset(rq, 0, sizeof *rq);
    rq->temperature = 1.0;
    rq->top_p = 1.0;
    rq->repetition_penalty = 1.0;
    rq->n = 1;
    rq->seed = -1;
    rq->max_tokens = -1;
    rq->logprobs = -1;
    rq->skip_special_tokens = true;
    rq->spaces_between_special_tokens = true;
    for (size_t i = 0; i < sizeof fields / sizeof *fields; i++)
        if ((fields[i].apis & api) && !parse_field(s, &fields[i], prompt, root, rq, e)) return false;
    return true;
}

bool k3_srv_request_one_prompt(k3_srv_request *rq, int32_t *ids, int64_t n, k3_srv_bad *e) {
    if (!(rq->prompts = calloc(1, sizeof *rq->prompts)) || !(rq->n_prompt = calloc(1, sizeof *rq->n_prompt))) {
        free(ids);
        return bad(e, 500, "out of memory");
    }
    rq->prompts[0] = ids;
    rq->n_prompt[0] = n;
    rq->n_prompts = 1;
    return true;
}

void k3_srv_request_free(k3_srv_request *rq) {
    k3_stops_free(&rq->stops);
    for (int i = 0; i < rq->n_prompts; i++) free(rq->prompts[i]);
    free(rq->prompts);
    free(rq->n_prompt);
    k3_vision_prompt_free(&rq->vp);
    free(rq->logit_bias);
    free(rq->allowed_ids);
    free(rq->bad_words);
    free(rq->bad_word_off);
    json_decref(rq->kv_transfer);
    k3_grammar_free(rq->grammar);
    memset(rq, 0, sizeof *rq);
}
