/*
 * job.h -- the generation job (job.c): one HTTP request's choices, shared by
 * every API surface. It turns the parsed request (request.h) into engine
 * requests (one per prompt and choice, submitted through the engine loop),
 * decodes each choice's tokens into text, applies stop strings, keeps the
 * logprobs, tells the finish reason, and either waits for the whole answer
 * or pumps a stream. What the answer looks like is the surface's
 * (k3_srv_api, one per api_NAME.c): its hooks build the whole response and
 * the stream's events from the choices.
 */
#ifndef K3_SERVER_JOB_H
#define K3_SERVER_JOB_H

#include <stddef.h>

#include "server/engine_loop.h"
#include "server/request.h"
#include "server/sse.h"
#include "tokenizer/chat_stream.h"

typedef struct k3_srv_job k3_srv_job;

/* What one request may ask for, so an answer's size and its hold on the
 * engine stay bounded: generated plus echoed tokens over all its choices,
 * and logprob entries (those tokens x (1 + top alternatives)). An explicit
 * max_tokens over them is a 400 naming the numbers; a default one is cut
 * to fit. */
#define K3_SRV_MAX_TOKENS (1ll << 21)
#define K3_SRV_MAX_LP_ENTRIES (1ll << 19)

/* ---- streamed tool calls (what vLLM's OpenAI server sends) ----
 * A call's first delta: {index, id, type "function", function {name,
 * arguments ""}}; then {index, function {arguments: FRAGMENT}} as its
 * arguments grow. The fragments of a call add up to the arguments the
 * non-streamed reply has (the whole reply is still parsed and checked at
 * the end). */
typedef struct k3_tool_stream_call {
    char id[32];
    k3_buf sent; /* the arguments sent so far */
} k3_tool_stream_call;

typedef struct k3_tool_stream {
    k3_tool_stream_call *calls;
    int n, cap;
} k3_tool_stream;

void k3_tool_stream_free(k3_tool_stream *ts);

typedef struct k3_srv_choice {
    k3_srv_seq q; /* what the engine thread wrote (engine_loop.h) */
    k3_srv_job *job;
    int index, prompt_index;
    /* the text, decoded on the HTTP side (or by the engine thread at the end) */
    size_t n_seen; /* tokens decoded into text */
    k3_buf text;
    size_t *tok_end; /* [n_seen] the text's length after each token (k3_srv_choice_token_span) */
    size_t tok_cap;
    size_t *marks; /* with keep_specials: where the chat specials decoded by name begin, ascending */
    size_t n_marks, cap_marks;
    int sp;         /* what the text last took, for spaces_between_special_tokens */
    int64_t n_out;  /* completion tokens counted */
    bool stop_hit;  /* a stop string ended it (cut from the text) */
    int stop_which; /* 1 + the index in rq.stops of that stop string, 0 when none */
    bool done;      /* the text is final */
    /* what a stream has sent */
    size_t emitted;  /* bytes of text */
    size_t lp_sent;  /* tokens whose logprobs were sent (content: chat) */
    size_t lp_rsent; /* chat: reasoning tokens whose logprobs were sent */
    bool started;    /* the surface's opening events (a role delta, the echo) */
    bool final_sent; /* its last event */
    size_t sent_reasoning, sent_content;
    k3_tool_stream ts; /* tool calls streamed */
    /* with a grammar: which token ends leave a complete text (stop strings
     * end the output only there), from a matcher of its own */
    k3_grammar_matcher *gm;
    uint8_t *complete; /* [n_seen] after token i */
    bool complete0, gm_off;
} k3_srv_choice;

/* An API surface: how its answers look. */
typedef struct k3_srv_api {
    unsigned fields;              /* the request table's rows it takes (K3_API_*) */
    const char *id_prefix;        /* of the response id, e.g. "cmpl" */
    bool keep_specials;           /* decode the chat markup (<|open|>, <|close|>, <|sep|>) by name,
                                    for the surface's reply parser; other specials follow
                                    skip_special_tokens */
    long long default_max_tokens; /* when the request names none; -1: what the context leaves */
    k3_srv_prompt_fn prompt;      /* the surface's prompt field(s) */
    /* How much of t[from..lim) may be sent now (e.g. an undecided tag held
     * back), or NULL: all of it. */
    size_t (*hold)(const char *t, size_t from, size_t lim);
    /* Queues the whole answer once every choice is done (or the error
     * that keeps it from being made). */
    enum MHD_Result (*answer)(k3_srv_job *j);
    /* Streaming, the job's mutex held: the events for what is new in
     * choice i (it sets final_sent with its last one), then once every
     * choice has ended, the closing events. */
    void (*stream_choice)(k3_srv_job *j, int i);
    void (*stream_end)(k3_srv_job *j);
    /* Queues an error response in the surface's shape (every refusal the
     * job makes), or NULL: OpenAI's {"error": {...}}. */
    enum MHD_Result (*error)(struct k3_server *s, struct MHD_Connection *c, unsigned status, const char *msg);
    /* Frees the surface's own state of a job (k3_srv_job.surf), or NULL. */
    void (*surf_free)(void *surf);
    /* The reasoning tokens of a finished choice (usage's
     * completion_tokens_details.reasoning_tokens), or NULL: no such field. */
    int64_t (*reasoning_tokens)(k3_srv_job *j, const k3_srv_choice *c);
    /* Streaming, the job's mutex held: the events that end the stream when
     * the server ends it (the engine failed, a shutdown), or NULL: OpenAI's
     * error event and [DONE]. */
    void (*stream_error)(k3_srv_job *j, unsigned status, const char *msg);
} k3_srv_api;

struct k3_srv_job {
    k3_srv_group g; /* first: the engine loop's view of the job */
    struct k3_server *s;
    const k3_srv_api *api;
    struct MHD_Connection *conn;
    k3_srv_request rq; /* the request as parsed; owns the prompts */
    int n;
    k3_srv_choice *ch;
    char id[64];
    long created;
    int32_t markup[4]; /* the ids of <|open|>, <|close|>, <|sep|>, <|end_of_msg|> (-1: none), with keep_specials */
    k3_sse sse;        /* a stream's bytes not yet handed to the connection */
    bool sent_done;    /* the stream's closing events are out */
    /* prefill and decode apart (k3_srv_pd_*) */
    bool pd_prefill;         /* kept for a decode instance (do_remote_decode) */
    bool pd_answered;        /* its kv_transfer_params went out */
    struct k3_pd_pull *pull; /* the pull of its prompt's cache (do_remote_prefill), or NULL */
    k3_remote_prefill rp;    /* the engine request's remote part */
    json_t *extra;           /* members added to the whole answer's top level, or NULL */
    void *surf;              /* the surface's own state (k3_srv_job_serve_surf), freed by api->surf_free */
    /* choices enter the engine at most `seats` at a time (the first n_sub
     * have), so one request with many choices leaves room for others */
    int n_sub, seats;
    int64_t mml;      /* the context length */
    long long mt_cap; /* a default max_tokens is at most this (-1: no cap) */
    uint64_t base_seed;
    double probe_t; /* when a half-closed stream client was last probed */
};

/* ---- prefill and decode apart (k3_srv_pd_* in job.c): vLLM's kv_transfer_params ----
 * After parsing: checks the params and makes the decode side's pull (false
 * with e); each engine request is then adjusted (one token and kv_hold, or
 * remote); once every choice is done the answer's extra members are made
 * (false with why: a 500); the job's end frees it all (a pull never
 * submitted is given up, its hold released). */
bool k3_srv_pd_prepare(k3_srv_job *j, k3_srv_bad *e);
void k3_srv_pd_request(k3_srv_job *j, k3_request_params *p);
bool k3_srv_pd_finish(k3_srv_job *j, char *why, size_t why_len);
void k3_srv_pd_free(k3_srv_job *j);
/* Queues a surface's whole answer with the job's extra members (what every
 * surface's answer should go out through). */
enum MHD_Result k3_srv_job_json(k3_srv_job *j, unsigned status, json_t *resp);

/* Parses root for api, submits, and answers (the whole answer or a
 * stream); every refusal is an error in OpenAI's shape. */
enum MHD_Result k3_srv_job_serve(struct k3_server *s, struct MHD_Connection *conn, json_t *root, const k3_srv_api *api);
/* The same with the surface's own state surf (taken: freed by
 * api->surf_free with the job, or at once when the job cannot be made). */
enum MHD_Result k3_srv_job_serve_surf(struct k3_server *s, struct MHD_Connection *conn, json_t *root,
                                      const k3_srv_api *api, void *surf);
/* The job whose request rq is: a surface's prompt callback gets the job's
 * own request, and reaches the job's surf through it. */
static inline k3_srv_job *k3_srv_job_of(k3_srv_request *rq) {
    return (k3_srv_job *)(void *)((char *)rq - offsetof(k3_srv_job, rq));
}
/* Queues an error in api's shape (api->error, else OpenAI's). */
enum MHD_Result k3_srv_api_error(const k3_srv_api *api, struct k3_server *s, struct MHD_Connection *c, unsigned status,
                                 const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* For the surfaces' hooks (the job's mutex held while streaming): */
/* Decodes c's new tokens into its text and applies the stop strings. */
void k3_srv_choice_advance(k3_srv_job *j, k3_srv_choice *c);
/* Bytes of c's text that may be sent now: whole characters, nothing that
 * may still become a stop string, and what the surface's hold allows. */
size_t k3_srv_choice_sendable(k3_srv_job *j, k3_srv_choice *c);
/* Where generated token i of c lies in its text: [*start, *end), clipped
 * to the text (a token the text left out, or cut by a stop string, is
 * empty or short). i < c->n_seen. */
void k3_srv_choice_token_span(const k3_srv_choice *c, size_t i, size_t *start, size_t *end);
/* Where c's text has its chat specials, for the reply parser
 * (k3_chat_parse_reply_marked). */
static inline k3_chat_text k3_srv_choice_marks(const k3_srv_choice *c) { return (k3_chat_text){c->marks, c->n_marks}; }
/* The tokens whose logprobs may be sent now. */
size_t k3_srv_choice_lp_ready(const k3_srv_choice *c);
/* Why c failed (the engine's message, or fallback when it gave none), or
 * NULL when it did not fail. */
const char *k3_srv_choice_error(const k3_srv_choice *c, const char *fallback);
/* The HTTP status of c's failure: 500, or 503 when the server failed. */
unsigned k3_srv_choice_error_status(const k3_srv_choice *c);
/* OpenAI's finish_reason: stop, length, abort, error; tool_calls when a
 * reply that ended by itself made tool calls. */
const char *k3_srv_finish_reason(const k3_srv_choice *c, bool tool_calls);
/* Cancels every choice still running. */
void k3_srv_job_cancel(k3_srv_job *j);
/* The decoded prompt of c (caller frees), NULL when it cannot be decoded. */
char *k3_srv_choice_prompt_text(k3_srv_job *j, const k3_srv_choice *c, size_t *len);

/* ---- what OpenAI's completions and chat answers share ---- */
/* One entry of an answer's choices, or NULL: with why filled, the answer
 * is a 500 saying why. */
typedef json_t *(*k3_srv_choice_json_fn)(k3_srv_job *j, k3_srv_choice *c, char *why, size_t why_len);
/* Queues OpenAI's whole answer {id, object, created, model, choices,
 * usage}, choice(c) for each entry of choices; a choice the engine failed
 * is a 500. */
enum MHD_Result k3_srv_openai_answer(k3_srv_job *j, const char *object, k3_srv_choice_json_fn choice);
/* {id, object, created, model, choices} (takes choices). */
json_t *k3_srv_openai_object(k3_srv_job *j, const char *object, json_t *choices);
/* The usage object: prompt, completion and total tokens, cached prompt tokens. */
json_t *k3_srv_openai_usage(k3_srv_job *j);
/* The stream's end: the usage chunk when asked for (object: the chunk's), then [DONE]. */
void k3_srv_openai_stream_end(k3_srv_job *j, const char *object);
/* A logprob entry's token: its text, or "token_id:N" with return_tokens_as_token_ids. */
json_t *k3_srv_token_json(k3_srv_job *j, int32_t id);
/* Chat's logprobs.content entries {token, logprob, bytes, top_logprobs} for generated tokens [a, b) of c. */
void k3_srv_chat_logprobs(k3_srv_job *j, const k3_srv_choice *c, size_t a, size_t b, json_t *content);

#endif /* K3_SERVER_JOB_H */
