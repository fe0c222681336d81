/*
 * images.c -- the budgets of a request's image work (images.h).
 *
 * A chat request with images could once hold every image decoded at once
 * (15 PNGs of 8192 x 8192: 4 GB for half a minute). Now: its images' headers
 * are read first (k3_vision_chat_cost: nothing decoded) and their pixels and
 * tower rows checked against the request's budgets; then it waits for the
 * tower's pool, which serves one request at a time in the order they came
 * (a ticket queue, so none is passed over), and decodes and encodes its
 * images one at a time (k3_vision_chat_encode_json). So the image work in
 * memory at once is one image and its rows, whatever arrives.
 */
#include "server/images.h"

#include <stdio.h>

#include "common/error.h"
#include "server/engine_loop.h"

k3_status k3_srv_images_admit(struct k3_server *s, const char *messages_json, k3_vision_cost *cost, k3_error *err) {
    K3_TRY(k3_vision_chat_cost(s->vision, messages_json, s->max_image_pixels, cost, err));
    if (cost->pixels > s->max_request_image_pixels)
        return k3_err(err, K3_ERR_RANGE,
                      "the request's %d images have %lld pixels together, over this server's limit of %lld pixels "
                      "per request (--max-request-image-pixels)",
                      cost->n_images, (long long)cost->pixels, (long long)s->max_request_image_pixels);
    const int64_t max_tokens = s->max_request_image_tokens > 0 ? s->max_request_image_tokens : k3_srv_max_model_len(s);
    if (max_tokens > 0 && cost->tokens > max_tokens)
        return k3_err(err, K3_ERR_RANGE,
                      "the request's %d images take %lld prompt rows of the vision tower together, over this "
                      "server's limit of %lld per request (--max-request-image-tokens; the context is %lld)",
                      cost->n_images, (long long)cost->tokens, (long long)max_tokens,
                      (long long)k3_srv_max_model_len(s));
    return K3_OK;
}

void k3_srv_images_metrics(struct k3_server *s, k3_buf *o) {
    pthread_mutex_lock(&s->images_mu);
    const long long waiting = (long long)s->images_waiting, pixels = (long long)s->images_pixels;
    pthread_mutex_unlock(&s->images_mu);
    k3_buf_addf(o,
                "# HELP k3:image_requests_waiting Requests whose images wait for the vision tower's pool.\n"
                "# TYPE k3:image_requests_waiting gauge\nk3:image_requests_waiting{model_name=\"%s\"} %lld\n"
                "# HELP k3:image_pixels_in_flight Decoded pixels of the request whose images are being encoded.\n"
                "# TYPE k3:image_pixels_in_flight gauge\nk3:image_pixels_in_flight{model_name=\"%s\"} %lld\n",
                s->model_label, waiting, s->model_label, pixels);
}

void k3_srv_images_enter(struct k3_server *s, const k3_vision_cost *cost) {
    pthread_mutex_lock(&s->images_mu);
    const uint64_t me = s->images_next++;
    s->images_waiting++;
    while (s->images_serving != me) pthread_cond_wait(&s->images_cv, &s->images_mu);
    s->images_waiting--;
    s->images_pixels = cost->pixels;
    pthread_mutex_unlock(&s->images_mu);
}

void k3_srv_images_leave(struct k3_server *s, const k3_vision_cost *cost) {
    pthread_mutex_lock(&s->images_mu);
    s->images_serving++;
    s->images_pixels = 0;
    pthread_cond_broadcast(&s->images_cv);
    pthread_mutex_unlock(&s->images_mu);
}
