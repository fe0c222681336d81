/*
 * chat.c -- OpenAI chat messages with image parts, for the server:
 * k3_vision_chat_encode_json.
 *
 * encoding_k3.py renders every content part as a segment of its own,
 * tokenized alone: a text part as text, an image part as the image's prompt
 * (<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>,
 * specials parsed). So each image part is swapped for a text part holding a
 * marker (private-use code points, refused if any message text already
 * contains them), the conversation goes through k3_chat_encode_json, and the
 * marker's ids -- a segment of their own, so no neighbour merges into them --
 * are replaced by the image's framing with one pad per row (as vLLM expands
 * the single pad), the rows and prefix-cache keys beside them.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/error.h"
#include "vision/vision.h"

#define MARK "\xee\x80\x80k3img" /* U+E000 "k3img" */

void k3_vision_prompt_free(k3_vision_prompt *p) {
    if (!p) return;
    for (int32_t i = 0; i < p->n_images; i++) free(p->rows[i]);
    free(p->rows);
    free(p->plans);
    free(p->ids);
    free(p->embeds);
    free(p->keys);
    memset(p, 0, sizeof *p);
}

static bool holds_mark(json_t *j) {
    if (json_is_string(j)) return strstr(json_string_value(j), MARK) != NULL;
    size_t i;
    const char *k;
    json_t *v;
    if (json_is_array(j)) json_array_foreach(j, i, v) if (holds_mark(v)) return true;
    if (json_is_object(j)) json_object_foreach(j, k, v) if (strstr(k, MARK) || holds_mark(v)) return true;
    return false;
}

/* The data: URL of an image part (OpenAI: {"type":"image_url","image_url":{"url":...}}
 * or a bare string; "image" parts as encoding_k3 accepts them). */
static const char *part_url(json_t *part, const char *type) {
    json_t *u = json_object_get(part, type);
    if (json_is_string(u)) return json_string_value(u);
    if (json_is_object(u) && json_is_string(json_object_get(u, "url")))
        return json_string_value(json_object_get(u, "url"));
    return NULL;
}

k3_status k3_vision_chat_encode_json(const k3_vision *v, const k3_tokenizer *t, k3_pool *pool,
                                     const char *messages_json, const char *tools_json, const k3_chat_options *opt,
                                     int64_t max_pixels, k3_vision_prompt *out, k3_error *err) {
    if (!t || !messages_json || !out) return k3_err(err, K3_ERR_ARG, "chat: no messages");
    memset(out, 0, sizeof *out);
    json_error_t je;
    json_t *msgs = json_loads(messages_json, JSON_REJECT_DUPLICATES, &je);
    int32_t n_img = 0;
    size_t cap = 0;
    char **urls = NULL;       /* each image's data: URL; decoded one at a time below */
    size_t(*where)[2] = NULL; /* its messages[i].content[j] */
    k3_status s = K3_OK;
    if (msgs && json_is_array(msgs)) {
        size_t mi;
        json_t *m;
        json_array_foreach(msgs, mi, m) {
            json_t *content = json_is_object(m) ? json_object_get(m, "content") : NULL;
            if (!json_is_array(content)) continue;
            size_t pi;
            json_t *part;
            json_array_foreach(content, pi, part) {
                const char *type = json_is_object(part) ? json_string_value(json_object_get(part, "type")) : NULL;
                if (!type || (strcmp(type, "image_url") && strcmp(type, "image"))) continue;
                if (!v) {
                    s = k3_err(err, K3_ERR_UNSUPPORTED,
                               "messages[%zu].content[%zu]: an image, and the model has no "
                               "vision tower (it takes text only)",
                               mi, pi);
                    goto done;
                }
                const char *url = part_url(part, type);
                if (!url) {
                    s = k3_err(err, K3_ERR_ARG, "messages[%zu].content[%zu]: %s has no url", mi, pi, type);
                    goto done;
                }
                if ((size_t)n_img == cap) {
                    cap = cap ? 2 * cap : 4;
                    char **nu = realloc(urls, sizeof *nu * cap);
                    if (nu) urls = nu;
                    size_t(*nw)[2] = nu ? realloc(where, sizeof *nw * cap) : NULL;
                    if (nw) where = nw;
                    if (!nu || !nw) {
                        s = k3_err(err, K3_ERR_NOMEM, "chat: out of memory");
                        goto done;
                    }
                }
                /* its header is checked now (a bad or oversized image fails
                 * before any other is decoded) */
                k3_error ie = {0};
                int32_t w, h;
                s = k3_image_probe_url(url, strlen(url), max_pixels, &w, &h, &ie);
                if (!s && !(urls[n_img] = strdup(url))) s = k3_err(&ie, K3_ERR_NOMEM, "out of memory");
                if (s) {
                    k3_err(err, s, "messages[%zu].content[%zu]: %s", mi, pi, ie.msg);
                    goto done;
                }
                where[n_img][0] = mi;
                where[n_img][1] = pi;
                n_img++;
                char mark[32];
                snprintf(mark, sizeof mark, MARK "%d\xee\x80\x80", n_img - 1);
                json_array_set_new(content, pi, json_pack("{s:s, s:s}", "type", "text", "text", mark));
            }
        }
    }
    if (n_img == 0) { /* plain text: the chat encoder as it is (and its messages for bad JSON) */
        s = k3_chat_encode_json(t, messages_json, tools_json, opt, &out->ids, &out->n_ids, err);
        goto done;
    }
    {
        /* the markers went in after the scan; any other copy would be the user's */
        json_t *probe = json_deep_copy(msgs);
        size_t mi;
        json_t *m;
        int marks = 0;
        json_array_foreach(probe, mi, m) {
            json_t *content = json_object_get(m, "content");
            size_t pi;
            json_t *part;
            if (json_is_array(content)) json_array_foreach(content, pi, part) {
                    const char *tx = json_string_value(json_object_get(part, "text"));
                    if (tx && !strncmp(tx, MARK, strlen(MARK))) {
                        json_object_set_new(part, "text", json_string(""));
                        marks++;
                    }
                }
        }
        const bool clash = marks != n_img || holds_mark(probe);
        json_decref(probe);
        if (clash) {
            s = k3_err(err, K3_ERR_ARG,
                       "chat: the messages contain the private-use code point U+E000 with "
                       "\"k3img\", which k3 uses to place images");
            goto done;
        }
    }
    char *js = json_dumps(msgs, JSON_COMPACT);
    int32_t *ids = NULL;
    size_t n = 0;
    s = js ? k3_chat_encode_json(t, js, tools_json, opt, &ids, &n, err)
           : k3_err(err, K3_ERR_NOMEM, "chat: out of memory");
    free(js);
    if (s) goto done;
    /* find each marker's ids, in order, and cut them out */
    size_t *at = calloc((size_t)n_img, sizeof *at);
    int32_t *kept = malloc(sizeof(int32_t) * (n ? n : 1));
    out->rows = calloc((size_t)n_img, sizeof *out->rows);
    out->plans = calloc((size_t)n_img, sizeof *out->plans);
    uint64_t *hk = calloc((size_t)n_img, sizeof *hk);
    if (!at || !kept || !out->rows || !out->plans || !hk) s = k3_err(err, K3_ERR_NOMEM, "chat: out of memory");
    out->n_images = n_img;
    size_t src = 0, nk = 0;
    for (int32_t i = 0; !s && i < n_img; i++) {
        char mark[32];
        snprintf(mark, sizeof mark, MARK "%d\xee\x80\x80", i);
        int32_t *mk = NULL;
        size_t nm = 0;
        if ((s = k3_tokenizer_encode(t, mark, strlen(mark), &mk, &nm, err))) break;
        size_t p = src;
        while (p + nm <= n && memcmp(ids + p, mk, sizeof(int32_t) * nm)) p++;
        free(mk);
        if (nm == 0 || p + nm > n) {
            s = k3_err(err, K3_ERR_FORMAT, "chat: image %d was lost by the chat encoder", i);
            break;
        }
        memcpy(kept + nk, ids + src, sizeof(int32_t) * (p - src));
        nk += p - src;
        at[i] = nk;
        src = p + nm;
    }
    if (!s) {
        memcpy(kept + nk, ids + src, sizeof(int32_t) * (n - src));
        nk += n - src;
    }
    free(ids);
    /* one image at a time: decoded, encoded, its pixels freed before the next */
    for (int32_t i = 0; !s && i < n_img; i++) {
        k3_image *im = NULL;
        k3_error ie = {0};
        s = k3_image_decode_url(&im, urls[i], strlen(urls[i]), max_pixels, &ie);
        if (s) k3_err(err, s, "messages[%zu].content[%zu]: %s", where[i][0], where[i][1], ie.msg);
        if (!s) s = k3_vision_plan(v, k3_image_width(im), k3_image_height(im), &out->plans[i], err);
        if (!s) s = k3_vision_encode(v, pool, im, &out->rows[i], NULL, err);
        if (!s) hk[i] = k3_image_hash(im);
        k3_image_free(im);
        free(urls[i]);
        urls[i] = NULL;
    }
    if (!s)
        s = k3_vision_splice(v, t, kept, nk, at, out->plans, (const float *const *)out->rows, hk, n_img, &out->ids,
                             &out->n_ids, &out->embeds, &out->keys, err);
    free(at), free(kept), free(hk);
done:
    for (int32_t i = 0; i < n_img; i++) free(urls[i]);
    free(urls);
    free(where);
    json_decref(msgs);
    if (s) k3_vision_prompt_free(out);
    return s;
}

k3_status k3_vision_chat_cost(const k3_vision *v, const char *messages_json, int64_t max_pixels, k3_vision_cost *out,
                              k3_error *err) {
    memset(out, 0, sizeof *out);
    json_t *msgs = messages_json ? json_loads(messages_json, 0, NULL) : NULL;
    k3_status s = K3_OK;
    size_t mi, pi;
    json_t *m, *part;
    if (json_is_array(msgs)) json_array_foreach(msgs, mi, m) {
            json_t *content = json_is_object(m) ? json_object_get(m, "content") : NULL;
            if (!json_is_array(content)) continue;
            json_array_foreach(content, pi, part) {
                const char *type = json_is_object(part) ? json_string_value(json_object_get(part, "type")) : NULL;
                if (!type || (strcmp(type, "image_url") && strcmp(type, "image"))) continue;
                if (!v) {
                    s = k3_err(err, K3_ERR_UNSUPPORTED,
                               "messages[%zu].content[%zu]: an image, and the model has no vision tower (it takes "
                               "text only)",
                               mi, pi);
                    goto done;
                }
                const char *url = part_url(part, type);
                if (!url) {
                    s = k3_err(err, K3_ERR_ARG, "messages[%zu].content[%zu]: %s has no url", mi, pi, type);
                    goto done;
                }
                k3_error ie = {0};
                int32_t w, h;
                k3_image_plan plan;
                s = k3_image_probe_url(url, strlen(url), max_pixels, &w, &h, &ie);
                if (!s) s = k3_vision_plan(v, w, h, &plan, &ie);
                if (s) {
                    k3_err(err, s, "messages[%zu].content[%zu]: %s", mi, pi, ie.msg);
                    goto done;
                }
                out->n_images++;
                out->pixels += (int64_t)w * h;
                out->tokens += plan.n_tokens;
            }
        }
done:
    json_decref(msgs);
    return s;
}
