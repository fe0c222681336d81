/*
 * sse.h -- Server-Sent Events (sse.c): the framing of each event, the
 * pending bytes of a stream, and the streamed HTTP response. Every
 * streaming surface writes its events through these.
 */
#ifndef K3_SERVER_SSE_H
#define K3_SERVER_SSE_H

#include "server/state.h"

typedef struct k3_sse {
    k3_buf out; /* framed events not yet handed to the connection */
    size_t pos; /* bytes of out handed over */
} k3_sse;

/* "data: JSON\n\n" (takes obj; nothing when it is NULL). */
void k3_sse_data(k3_sse *e, json_t *obj);
/* A named event: "event: NAME\ndata: JSON\n\n" (takes obj; nothing when it
 * is NULL), as the Responses and Anthropic Messages streams frame theirs. */
void k3_sse_event(k3_sse *e, const char *name, json_t *obj);
/* "data: [DONE]\n\n", the end of an OpenAI stream. */
void k3_sse_done(k3_sse *e);
/* An error event in OpenAI's shape {"error": {message, type, param, code}}. */
void k3_sse_error(k3_sse *e, unsigned status, const char *msg);
/* ":\n\n", a comment every client skips: probes a client that half-closed
 * (the write fails once it is gone). */
void k3_sse_comment(k3_sse *e);
/* True when nothing is pending. */
bool k3_sse_empty(const k3_sse *e);
/* Moves up to max pending bytes into buf: how many. */
size_t k3_sse_take(k3_sse *e, char *buf, size_t max);
void k3_sse_free(k3_sse *e);

/* Queues a 200 text/event-stream response whose body comes from read
 * (libmicrohttpd's content reader; done is called when the connection is
 * through with it, also when the response could not be made). */
enum MHD_Result k3_sse_respond(struct k3_server *s, struct MHD_Connection *c, MHD_ContentReaderCallback read, void *cls,
                               MHD_ContentReaderFreeCallback done);

#endif /* K3_SERVER_SSE_H */
