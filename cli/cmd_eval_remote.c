/*
 * cmd_eval_remote.c -- the API side of `k3 eval --base-url URL`: one window
 * of token ids scored through POST /v1/completions with echo + logprobs
 * (max_tokens 1, temperature 0, return_tokens_as_token_ids), the way
 * lm-eval's local-completions scores loglikelihoods. Works against any
 * OpenAI-compatible server that returns prompt logprobs with echo.
 */
#include <curl/curl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "common/buf.h"

struct k3_eval_remote {
    CURL *h;
    struct curl_slist *hdr;
    char url[2200];
    char *model;
};

static size_t on_data(char *p, size_t size, size_t n, void *ud) {
    k3_buf *b = ud;
    k3_buf_add(b, p, size * n);
    return b->oom ? 0 : size * n;
}

static char *fetch(struct k3_eval_remote *r, const char *url, const char *body, long *code, char *why, size_t wl) {
    k3_buf b = {0};
    curl_easy_reset(r->h);
    curl_easy_setopt(r->h, CURLOPT_URL, url);
    curl_easy_setopt(r->h, CURLOPT_HTTPHEADER, r->hdr);
    curl_easy_setopt(r->h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(r->h, CURLOPT_TIMEOUT, 600L);
    curl_easy_setopt(r->h, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(r->h, CURLOPT_WRITEDATA, &b);
    if (body) curl_easy_setopt(r->h, CURLOPT_POSTFIELDS, body);
    const CURLcode cc = curl_easy_perform(r->h);
    *code = 0;
    curl_easy_getinfo(r->h, CURLINFO_RESPONSE_CODE, code);
    if (cc != CURLE_OK) {
        snprintf(why, wl, "%.300s: %s", url, curl_easy_strerror(cc));
        k3_buf_free(&b);
        return NULL;
    }
    if (!b.p) b.p = strdup("");
    return b.p;
}

int k3_eval_remote_open(k3_eval_remote **out, const char *base, const char *model, const char *key, char *why,
                        size_t wl) {
    *out = NULL;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    struct k3_eval_remote *r = calloc(1, sizeof *r);
    if (!r || !(r->h = curl_easy_init())) {
        free(r);
        snprintf(why, wl, "cannot start libcurl");
        return -1;
    }
    char b[2048];
    snprintf(b, sizeof b, "%s", base);
    size_t n = strlen(b);
    while (n && b[n - 1] == '/') b[--n] = 0;
    if (n > 3 && !strcmp(b + n - 3, "/v1")) b[n -= 3] = 0;
    r->hdr = curl_slist_append(NULL, "Content-Type: application/json");
    if (key && *key) {
        char auth[1100];
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", key);
        r->hdr = curl_slist_append(r->hdr, auth);
    }
    if (model) {
        r->model = strdup(model);
    } else {
        char url[2200];
        snprintf(url, sizeof url, "%s/v1/models", b);
        long code;
        char *t = fetch(r, url, NULL, &code, why, wl);
        json_t *j = t && code == 200 ? json_loads(t, 0, NULL) : NULL;
        json_t *id = json_object_get(json_array_get(json_object_get(j, "data"), 0), "id");
        if (json_is_string(id)) r->model = strdup(json_string_value(id));
        else if (t) snprintf(why, wl, "GET %.300s: HTTP %ld, no model id: %.200s", url, code, t);
        json_decref(j);
        free(t);
    }
    if (!r->model) {
        k3_eval_remote_close(r);
        return -1;
    }
    snprintf(r->url, sizeof r->url, "%s/v1/completions", b);
    *out = r;
    return 0;
}

/* top-1 id of a top_logprobs entry keyed "token_id:N", or -1 */
static int32_t top1_of(json_t *d) {
    const char *k;
    json_t *v;
    double best = -1e300;
    int32_t id = -1;
    json_object_foreach(d, k, v) {
        if (!json_is_number(v) || strncmp(k, "token_id:", 9)) continue;
        if (json_number_value(v) > best) {
            best = json_number_value(v);
            id = (int32_t)atol(k + 9);
        }
    }
    return id;
}

int k3_eval_remote_window(k3_eval_remote *r, const int32_t *ids, size_t len, double *lp, int32_t *top1, char *why,
                          size_t wl) {
    json_t *p = json_array();
    for (size_t i = 0; i < len; i++) json_array_append_new(p, json_integer(ids[i]));
    json_t *req = json_pack("{s:s,s:o,s:i,s:f,s:b,s:i,s:b}", "model", r->model, "prompt", p, "max_tokens", 1,
                            "temperature", 0.0, "echo", 1, "logprobs", 1, "return_tokens_as_token_ids", 1);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    if (!body) {
        snprintf(why, wl, "out of memory");
        return -1;
    }
    long code;
    char *t = fetch(r, r->url, body, &code, why, wl);
    free(body);
    if (!t) return -1;
    json_error_t je;
    json_t *j = json_loads(t, 0, &je);
    int rc = -1;
    if (code != 200 || !j) {
        snprintf(why, wl, "POST %.300s: HTTP %ld: %.300s", r->url, code, t);
        goto out;
    }
    json_t *l = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs");
    json_t *tl = json_object_get(l, "token_logprobs"), *tops = json_object_get(l, "top_logprobs");
    if (!json_is_array(tl) || json_array_size(tl) < len) {
        snprintf(why, wl, "the answer has no prompt logprobs for %zu tokens (does the server support echo?)", len);
        goto out;
    }
    for (size_t i = 1; i < len; i++) {
        json_t *v = json_array_get(tl, i);
        if (!json_is_number(v)) {
            snprintf(why, wl, "token_logprobs[%zu] is not a number", i);
            goto out;
        }
        lp[i - 1] = json_number_value(v);
        top1[i - 1] = top1_of(json_array_get(tops, i));
    }
    rc = 0;
out:
    json_decref(j);
    free(t);
    return rc;
}

void k3_eval_remote_close(k3_eval_remote *r) {
    if (!r) return;
    curl_slist_free_all(r->hdr);
    if (r->h) curl_easy_cleanup(r->h);
    free(r->model);
    free(r);
    curl_global_cleanup();
}
