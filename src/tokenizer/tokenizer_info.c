/*
 * tokenizer_info.c -- vLLM's /tokenizer_info and special-aware encoding
 * (tokenizer_info.h).
 *
 * vLLM answers /tokenizer_info with the Hugging Face tokenizer's
 * init_kwargs, which from_pretrained fills from tokenizer_config.json: so
 * the config's own keys are the answer, with the file paths dropped and
 * every AddedToken written as its content (vLLM's _make_json_serializable),
 * plus the class name. lm-eval's remote tokenizer reads bos_token,
 * eos_token, pad_token and chat_template from it, and finds the BOS / EOS
 * ids by tokenizing those names with /tokenize -- which is why /tokenize
 * reads a special's name in its text as the special.
 */
#include "tokenizer/tokenizer_info.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "tokenizer/tokenizer_internal.h"

/* An AddedToken as tokenizer_config.json writes it: {"__type": "AddedToken", "content": ...}. */
static json_t *added_token_content(json_t *v) {
    if (!json_is_object(v)) return NULL;
    json_t *type = json_object_get(v, "__type"), *content = json_object_get(v, "content");
    if (json_is_string(content) && json_is_string(type) && !strcmp(json_string_value(type), "AddedToken"))
        return content;
    return NULL;
}

/* Every AddedToken under v (objects and lists) replaced by its content. */
static json_t *plain(json_t *v) {
    json_t *c = added_token_content(v);
    if (c) return json_incref(c);
    if (json_is_object(v)) {
        json_t *o = json_object();
        const char *k;
        json_t *x;
        json_object_foreach(v, k, x) json_object_set_new(o, k, plain(x));
        return o;
    }
    if (json_is_array(v)) {
        json_t *a = json_array();
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) json_array_append_new(a, plain(x));
        return a;
    }
    return json_incref(v);
}

k3_status k3_tokenizer_info_json(const k3_tokenizer *t, char **json, size_t *len, k3_error *err) {
    *json = NULL;
    *len = 0;
    json_t *cfg = t->config ? json_loadb(t->config, t->config_len, 0, NULL) : json_object();
    if (!json_is_object(cfg)) {
        json_decref(cfg);
        cfg = json_object();
    }
    json_t *info = json_object();
    const char *k;
    json_t *v;
    json_object_foreach(cfg, k, v) {
        if (!strcmp(k, "vocab_file") || !strcmp(k, "merges_file")) continue;
        if (!strcmp(k, "added_tokens_decoder") && json_is_object(v)) {
            /* init_kwargs holds AddedToken objects here: each becomes its content */
            json_t *d = json_object();
            const char *id;
            json_t *tok;
            json_object_foreach(v, id, tok) {
                json_t *c = json_object_get(tok, "content");
                json_object_set_new(d, id, json_is_string(c) ? json_incref(c) : plain(tok));
            }
            json_object_set_new(info, k, d);
            continue;
        }
        json_object_set_new(info, k, plain(v));
    }
    json_decref(cfg);
    if (!json_is_string(json_object_get(info, "tokenizer_class")))
        json_object_set_new(info, "tokenizer_class", json_string("K3Tokenizer"));
    static const char *const names[2][2] = {{"bos_token", "[BOS]"}, {"eos_token", "[EOS]"}};
    for (int i = 0; i < 2; i++)
        if (!json_object_get(info, names[i][0]) && k3_tokenizer_special(t, names[i][1]) >= 0)
            json_object_set_new(info, names[i][0], json_string(names[i][1]));
    char *s = json_dumps(info, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(info);
    if (!s) return k3_err(err, K3_ERR_NOMEM, "out of memory for the tokenizer info");
    *json = s;
    *len = strlen(s);
    return K3_OK;
}

/* The special whose name is the longest that text[at..n) begins with, or -1. */
static int32_t special_at(const k3_tokenizer *t, const char *text, size_t n, size_t at, size_t *name_len) {
    int32_t best = -1;
    size_t best_len = 0;
    for (int32_t i = 0; i < t->n_specials; i++) {
        const size_t l = t->special_len[i];
        if (l > best_len && l <= n - at && t->special_name[i][0] == text[at] &&
            !memcmp(text + at, t->special_name[i], l)) {
            best = t->bpe.n_ranks + i;
            best_len = l;
        }
    }
    *name_len = best_len;
    return best;
}

k3_status k3_tokenizer_encode_specials(const k3_tokenizer *t, const char *text, size_t len, int32_t **ids,
                                       size_t *n_ids, k3_error *err) {
    *ids = NULL;
    *n_ids = 0;
    k3_ids out = {0};
    size_t from = 0;
    k3_status st = K3_OK;
    /* every special's first byte, to test the text quickly */
    uint8_t first[256] = {0};
    for (int32_t i = 0; i < t->n_specials; i++) first[(uint8_t)t->special_name[i][0]] = 1;
    for (size_t at = 0; at <= len && st == K3_OK; at++) {
        size_t nl = 0;
        const int32_t sp = at < len && first[(uint8_t)text[at]] ? special_at(t, text, len, at, &nl) : -1;
        if (sp < 0 && at < len) continue;
        if (at > from) { /* the ordinary text before it */
            int32_t *piece = NULL;
            size_t np = 0;
            st = k3_tokenizer_encode(t, text + from, at - from, &piece, &np, err);
            for (size_t i = 0; i < np && st == K3_OK; i++) st = k3_ids_push(&out, piece[i], err);
            free(piece);
        }
        if (sp >= 0 && st == K3_OK) {
            st = k3_ids_push(&out, sp, err);
            at += nl - 1;
            from = at + 1;
        }
    }
    if (st == K3_OK && !out.v && !(out.v = malloc(sizeof *out.v))) st = k3_err(err, K3_ERR_NOMEM, "out of memory");
    if (st != K3_OK) {
        free(out.v);
        return st;
    }
    *ids = out.v;
    *n_ids = out.n;
    return K3_OK;
}
