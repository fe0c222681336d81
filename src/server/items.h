/*
 * items.h -- a chat reply as a sequence of output items, for the surfaces
 * whose answers are lists of typed blocks (Responses' output items,
 * Anthropic's content blocks): the reasoning, the text, then one item per
 * tool call, in the order K3 generates them (items.c). A stream opens an
 * item when its first bytes come, sends its growth, and closes it when the
 * next one opens or the reply ends; the whole answer is the same items of
 * the parsed reply. The surface gives the events through k3_items_ops.
 */
#ifndef K3_SERVER_ITEMS_H
#define K3_SERVER_ITEMS_H

#include "server/job.h"

typedef enum k3_item_kind { K3_ITEM_REASONING = 0, K3_ITEM_TEXT, K3_ITEM_CALL } k3_item_kind;

typedef struct k3_item {
    k3_item_kind kind;
    int call;         /* K3_ITEM_CALL: the call's index in the reply's tool calls */
    char id[48];      /* the surface's id prefix and 24 letters and digits */
    char call_id[48]; /* K3_ITEM_CALL: the tool call's id ("call_..." as chat streams it) */
    char *name;       /* K3_ITEM_CALL: the tool's name */
} k3_item;

typedef struct k3_items {
    k3_item *v;
    int n, cap;
    bool open; /* the last item is open (a stream) */
} k3_items;

typedef struct k3_items_ops {
    const char *prefix[3]; /* of the item ids, per kind */
    /* Item i has just been opened (a stream). */
    void (*open)(k3_srv_job *j, const k3_item *it, int i);
    /* Bytes p[0..n) more of item i: reasoning or text, or a fragment of a
     * call's arguments JSON (the fragments add up to the arguments). */
    void (*delta)(k3_srv_job *j, const k3_item *it, int i, const char *p, size_t n);
    /* Item i is complete: r is the reply parsed so far, whole for it (its
     * reasoning, content, or call it->call of calls, the parsed
     * r->tool_calls_json); last: the reply has ended with it. */
    void (*close)(k3_srv_job *j, const k3_item *it, int i, const k3_chat_reply *r, json_t *calls, bool last);
} k3_items_ops;

void k3_items_free(k3_items *it);
/* The items of a whole reply r (no events). */
k3_status k3_items_of_reply(k3_items *it, const k3_items_ops *ops, const k3_chat_reply *r, k3_error *err);
/* One step of a stream, the job's mutex held: choice c advanced, what is
 * new parsed and given to ops. Returns 0 while the reply goes on, 1 when it
 * has ended (every item closed; *final gets the whole reply, free it with
 * k3_chat_reply_free), -1 when it cannot be parsed or streamed (err says
 * why; the stream should end with an error). */
int k3_items_step(k3_srv_job *j, k3_srv_choice *c, k3_items *it, const k3_items_ops *ops, k3_chat_reply *final,
                  k3_error *err);
/* r's calls as a JSON array (new reference; an empty array when none or r
 * is NULL), NULL when out of memory. */
json_t *k3_items_calls(const k3_chat_reply *r);
/* The generated tokens of c before its reasoning ended (all of them when
 * it never ended; 0 when the reply did not open in the think channel), the
 * job's mutex held. */
int64_t k3_items_reasoning_tokens(k3_srv_job *j, k3_srv_choice *c);

#endif /* K3_SERVER_ITEMS_H */
