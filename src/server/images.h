/*
 * images.h -- the budgets of the image work a chat request brings (images.c):
 * per request, its images' decoded pixels and the vision tower's work (their
 * prompt rows), checked on their headers before any is decoded; and
 * server-wide, one request at a time on the tower's pool, the others waiting
 * their turn in the order they came.
 */
#ifndef K3_SERVER_IMAGES_H
#define K3_SERVER_IMAGES_H

#include "server/state.h"

/* The cost of messages_json's images (*cost), within the request's
 * budgets: else K3_ERR_RANGE with a message that names the limit and its
 * option (a 400), or the image's own error. */
k3_status k3_srv_images_admit(struct k3_server *s, const char *messages_json, k3_vision_cost *cost, k3_error *err);
/* Waits for the request's turn on the tower's pool; leave gives it on. */
void k3_srv_images_enter(struct k3_server *s, const k3_vision_cost *cost);
void k3_srv_images_leave(struct k3_server *s, const k3_vision_cost *cost);
/* k3:image_requests_waiting, k3:image_pixels_in_flight of /metrics. */
void k3_srv_images_metrics(struct k3_server *s, k3_buf *o);

#endif /* K3_SERVER_IMAGES_H */
