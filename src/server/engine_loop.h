/*
 * engine_loop.h -- the server's engine thread (engine_loop.c): it owns the
 * engine, steps it while there is work (otherwise it sleeps in
 * k3_engine_wait), and appends each step's outputs to the engine request
 * they belong to; HTTP threads submit and cancel through it. It knows
 * nothing of HTTP, of text or of the API surfaces.
 *
 * A group is the engine requests one HTTP request waits on (its choices):
 * the engine thread writes their outputs under the group's mutex and
 * signals its condition variable. A group is reference counted: one
 * reference for the HTTP side and one per submitted engine request,
 * dropped when the engine reports it finished, so a client that leaves
 * never frees memory the engine thread still writes to.
 *
 * The server keeps the engine requests in flight in a list: when the
 * engine fails, the engine thread ends each of them with the engine's
 * message (K3_FINISH_ERROR, status 503) and drops its reference, so every
 * waiting thread gets its answer and nothing is left behind.
 */
#ifndef K3_SERVER_ENGINE_LOOP_H
#define K3_SERVER_ENGINE_LOOP_H

#include "server/state.h"

typedef struct k3_srv_group k3_srv_group;

struct k3_srv_group {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    /* The engine thread, mu held, when q has just finished: returns the
     * finish reason the client sees, which /metrics counts (a stop string
     * ends a request by cancelling it, yet it finished with "stop"). */
    k3_finish_reason (*on_finish)(k3_srv_group *g, k3_srv_seq *q);
    /* The last reference is gone. */
    void (*destroy)(k3_srv_group *g);
};

/* One engine request as the engine thread fills it (read under the
 * group's mu). */
struct k3_srv_seq {
    k3_srv_group *group;
    uint64_t eid;
    bool submitted;
    int32_t *toks;    /* [n_tok] generated tokens */
    float *lps;       /* [n_tok] their logprobs (NaN when not asked for) */
    k3_logprob *tops; /* [n_tok * n_top] the top alternatives ({-1, -inf} pads) */
    size_t n_tok, cap;
    int n_top;
    float *plp;       /* [n_plp] prompt logprobs for prompt tokens 1.. */
    k3_logprob *ptop; /* [n_plp * n_top] or NULL */
    int64_t n_plp;
    bool got_plp;
    bool finished;
    bool cancelled;  /* the HTTP side ended it (k3_srv_cancel: a stop string, a client gone) */
    bool server_cut; /* the server ended it (k3_srv_cancel_all): a cancelled finish is its error */
    k3_finish_reason finish;
    int32_t stop_id;     /* the id that stopped it, or -1 */
    char error[256];     /* why it failed (an engine error, out of memory) */
    unsigned err_status; /* the HTTP status of that failure: 500, 503 when the engine failed */
    int64_t n_prompt, n_cached, n_generated;
    double last_t; /* when its last tokens came (inter-token latency) */
    /* a request prefilled elsewhere, at its end: the TTFT split of its
     * answer's kv_transfer (queue here, blocks given to the cache landed,
     * landed to the first token computed here) */
    double pd_queue_s, pd_transfer_s, pd_first_step_s;
    /* the server's list of engine requests in flight (live_mu) */
    k3_srv_seq *live_prev, *live_next;
    int64_t number; /* 1 = the first submitted by this server */
};

/* Starts and stops the engine thread (stop waits for the work in flight). */
/* How long the step in progress has run (0: none in progress). */
double k3_srv_step_seconds(struct k3_server *s);
k3_status k3_srv_engine_start(struct k3_server *s, k3_error *err);
void k3_srv_engine_stop(struct k3_server *s);
void k3_srv_engine_stats(struct k3_server *s, k3_engine_stats *st);
/* The engine's context length, or the server's option without an engine. */
int64_t k3_srv_max_model_len(struct k3_server *s);

void k3_srv_group_init(k3_srv_group *g, k3_finish_reason (*on_finish)(k3_srv_group *, k3_srv_seq *),
                       void (*destroy)(k3_srv_group *));
/* Drops a reference; the last one destroys the group. */
void k3_srv_group_unref(k3_srv_group *g);
/* Submits p as q (q->group set; p->user becomes q); the group gets the
 * engine's reference. The engine's status and message on failure, also
 * once the engine has failed. Not with the group's mu held. */
k3_status k3_srv_submit(struct k3_server *s, k3_srv_seq *q, k3_request_params *p, k3_error *err);
/* Ends q in the engine unless it has finished (the group's mu held). */
void k3_srv_cancel(struct k3_server *s, k3_srv_seq *q);
/* Cancels every engine request in flight and wakes the threads waiting
 * on them (k3_server_end), each under its group's mutex: one that had not
 * finished nor been cancelled by its HTTP side is marked server_cut, and
 * when the engine reports it cancelled it finishes as an error with the
 * server's ending message and status 503 -- so whichever thread looks
 * first, a choice the server cut is never a whole answer. */
void k3_srv_cancel_all(struct k3_server *s);
/* The message of a server-wide ending (the engine failed, or the server
 * ends what is in flight) and its HTTP status, or NULL while neither. */
const char *k3_srv_ending(struct k3_server *s, char *buf, size_t cap);
/* Frees what the engine thread wrote into q. */
void k3_srv_seq_free(k3_srv_seq *q);

#endif /* K3_SERVER_ENGINE_LOOP_H */
