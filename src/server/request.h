/*
 * request.h -- the request table (request.c): the sampling and generation
 * fields of a generation request, parsed once into k3_srv_request for
 * every API surface. Each row of the table is one JSON field as some
 * surfaces spell it (a bit per surface says which take it), the member it
 * fills and how it is checked; a surface that names a field otherwise
 * (max_completion_tokens, max_output_tokens, stop_sequences) has a row of
 * its own filling the same member. Rows are checked in the table's order
 * and the first bad one is the error, naming the field.
 */
#ifndef K3_SERVER_REQUEST_H
#define K3_SERVER_REQUEST_H

#include "server/state.h"

#define K3_SRV_MAX_N 16          /* choices of one request (prompts x n) */
#define K3_SRV_MAX_STOPS 16      /* stop strings, stop token ids */
#define K3_SRV_MAX_TOP 20        /* top logprobs */
#define K3_SRV_MAX_BAD_WORDS 128 /* bad_words strings */

/* The API surfaces, as the table's rows name them. */
enum {
    K3_API_COMPLETIONS = 1u << 0, /* POST /v1/completions */
    K3_API_CHAT = 1u << 1,        /* POST /v1/chat/completions */
    K3_API_RESPONSES = 1u << 2,   /* POST /v1/responses */
    K3_API_MESSAGES = 1u << 3,    /* POST /v1/messages (Anthropic) */
};

/* A refusal: the HTTP status and one sentence naming the field. */
typedef struct k3_srv_bad {
    char msg[512];
    unsigned status;
} k3_srv_bad;

/* Fills e and returns false. */
bool k3_srv_bad_set(k3_srv_bad *e, unsigned status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

typedef struct k3_srv_request {
    /* sampling */
    double temperature, top_p, min_p, repetition_penalty;
    double frequency_penalty, presence_penalty;
    long long top_k;
    long long seed;
    bool seed_given;
    k3_logit_bias *logit_bias; /* one entry per id (the last one given), clamped to [-100, 100] */
    int n_logit_bias;
    int32_t *allowed_ids; /* NULL: every id */
    int n_allowed;
    int32_t *bad_words;    /* token sequences (k3_sampler_options' layout) */
    int32_t *bad_word_off; /* [n_bad_words + 1] */
    int n_bad_words;
    /* generation */
    long long n;          /* choices per prompt */
    long long max_tokens; /* -1: the surface's default */
    long long min_tokens;
    bool ignore_eos;
    k3_stops stops;
    int32_t stop_ids[K3_SRV_MAX_STOPS];
    int n_stop_ids;
    /* the text */
    bool include_stop_str;              /* a stop string (or stop token) ends the text but stays in it */
    bool skip_special_tokens;           /* specials are left out of the text (default); the chat
                                   markup a surface parses is decoded either way */
    bool spaces_between_special_tokens; /* a special kept in the text has a space on each side */
    /* what the answer carries */
    long long logprobs; /* -1 none, else the number of top alternatives */
    bool want_logprobs; /* chat's "logprobs": true (top_logprobs gives the number) */
    bool echo;          /* the prompt (and its logprobs) before the text */
    bool tok_ids;       /* logprob tokens as "token_id:N" */
    bool stream, include_usage;
    /* the prompts (the surface's own field): one engine request per prompt and choice */
    int n_prompts;
    int32_t **prompts;
    int64_t *n_prompt;
    k3_vision_prompt vp; /* a chat prompt's image rows and keys, until submitted */
    bool thinking;       /* the prompt opened the think channel: the reply starts in it */
    json_t *kv_transfer; /* vLLM's kv_transfer_params (an object, referenced), or NULL */
    k3_grammar *grammar; /* what the output must match (constraint.h), or NULL; a reference */
    /* speculative_config: K3_SPEC_DEFAULT (the server's) or a method; 0 or its k */
    k3_spec_method spec_method;
    int spec_k;
    uint64_t cache_salt; /* a hash of vLLM's cache_salt (0: none given) */
} k3_srv_request;

/* A surface's prompt field(s) into rq->prompts (and vp, thinking); false with e. */
typedef bool (*k3_srv_prompt_fn)(struct k3_server *s, json_t *root, k3_srv_request *rq, k3_srv_bad *e);

/* Parses the fields of root that the surface api (one K3_API_* bit) takes,
 * in the table's order, into rq (defaults first; the prompt row calls
 * prompt). False with e at the first bad field; free rq either way. */
bool k3_srv_request_parse(struct k3_server *s, unsigned api, k3_srv_prompt_fn prompt, json_t *root, k3_srv_request *rq,
                          k3_srv_bad *e);
/* Sets rq's one prompt to ids[0..n) (taken). */
bool k3_srv_request_one_prompt(k3_srv_request *rq, int32_t *ids, int64_t n, k3_srv_bad *e);
void k3_srv_request_free(k3_srv_request *rq);

#endif /* K3_SERVER_REQUEST_H */
