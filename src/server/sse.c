/* sse.c -- Server-Sent Events: framing and the streamed response (sse.h). */
#include <stdlib.h>
#include <string.h>

#include "server/http.h"
#include "server/sse.h"

void k3_sse_data(k3_sse *e, json_t *obj) {
    char *t = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!t) return;
    k3_buf_add(&e->out, "data: ", 6);
    k3_buf_add(&e->out, t, strlen(t));
    k3_buf_add(&e->out, "\n\n", 2);
    free(t);
}

void k3_sse_event(k3_sse *e, const char *name, json_t *obj) {
    char *t = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!t) return;
    k3_buf_add(&e->out, "event: ", 7);
    k3_buf_add(&e->out, name, strlen(name));
    k3_buf_add(&e->out, "\ndata: ", 7);
    k3_buf_add(&e->out, t, strlen(t));
    k3_buf_add(&e->out, "\n\n", 2);
    free(t);
}

void k3_sse_done(k3_sse *e) { k3_buf_add(&e->out, "data: [DONE]\n\n", 14); }

void k3_sse_error(k3_sse *e, unsigned status, const char *msg) { k3_sse_data(e, k3_srv_error_json(status, msg)); }

void k3_sse_comment(k3_sse *e) { k3_buf_add(&e->out, ":\n\n", 3); }

bool k3_sse_empty(const k3_sse *e) { return e->pos >= e->out.len; }

size_t k3_sse_take(k3_sse *e, char *buf, size_t max) {
    size_t n = e->out.len - e->pos;
    if (n > max) n = max;
    memcpy(buf, e->out.p + e->pos, n);
    e->pos += n;
    if (e->pos == e->out.len) e->pos = e->out.len = 0;
    return n;
}

void k3_sse_free(k3_sse *e) {
    k3_buf_free(&e->out);
    e->pos = 0;
}

enum MHD_Result k3_sse_respond(struct k3_server *s, struct MHD_Connection *c, MHD_ContentReaderCallback read, void *cls,
                               MHD_ContentReaderFreeCallback done) {
    return k3_http_queue_stream(s->http, c, 200, "text/event-stream", read, cls, done);
}
