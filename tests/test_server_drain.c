/*
 * test_server_drain.c -- the server's ending decided by state: an engine
 * request the server cuts (k3_server_end) finishes as an error with the
 * ending's message and status 503 whichever thread looks first, so a whole
 * answer it belonged to can never be taken for a finished one; a request
 * its own side cancelled before (a stop string, a client gone) stays
 * cancelled. Runs the engine thread on tests/models/tiny; waits by state
 * (the group's condition variable), never by sleeping.
 */
#include "test.h"

#include <string.h>
#include <time.h>

#include "server/engine_loop.h"
#include "server/state.h"

typedef struct grp {
    k3_srv_group g;
    k3_srv_seq q[2];
} grp;

static k3_finish_reason fin(k3_srv_group *g, k3_srv_seq *q) { return q->finish; }
static void destroy(k3_srv_group *g) {}

/* Waits (the group's mu held) until pred or 60 s; false on timeout. */
static bool wait_for(grp *x, bool (*pred)(grp *)) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 60;
    while (!pred(x))
        if (pthread_cond_timedwait(&x->g.cv, &x->g.mu, &ts)) return pred(x);
    return true;
}

static bool both_generating(grp *x) { return x->q[0].n_tok > 2 && x->q[1].n_tok > 2; }
static bool both_finished(grp *x) { return x->q[0].finished && x->q[1].finished; }

K3_TEST(server_drain_a_cut_request_is_an_error_by_state) {
    k3_error err = {0};
    k3_model *m = NULL;
    k3_tokenizer *tok = NULL;
    k3_engine *e = NULL;
    k3_server *s = NULL;
    REQUIREF(!k3_model_open(&m, "tests/models/tiny", &err), "%s", err.msg);
    REQUIREF(!k3_tokenizer_open(&tok, "tests/models/tiny", &err), "%s", err.msg);
    k3_engine_options eo = {.max_num_seqs = 4, .cache_tokens = 4096, .block_size = 16};
    REQUIREF(!k3_engine_open(&e, m, &eo, &err), "%s", err.msg);
    k3_server_options so = {.model_name = "tiny", .tok = tok, .engine = e};
    REQUIREF(!k3_server_start(&s, &so, &err), "%s", err.msg);

    static grp x;
    memset(&x, 0, sizeof x);
    k3_srv_group_init(&x.g, fin, destroy);
    const int32_t prompt[] = {39, 596, 78, 286};
    for (int i = 0; i < 2; i++) {
        x.q[i].group = &x.g;
        x.q[i].stop_id = -1;
        k3_request_params p = {.prompt = prompt,
                               .n_prompt = 4,
                               .sampling = {.top_p = 1, .repeat_penalty = 1},
                               .max_tokens = 3000,
                               .ignore_eos = true};
        REQUIREF(!k3_srv_submit(s, &x.q[i], &p, &err), "%s", err.msg);
    }
    pthread_mutex_lock(&x.g.mu);
    CHECK(wait_for(&x, both_generating));
    /* the HTTP side of the second one cancels it first (a stop string) */
    k3_srv_cancel(s, &x.q[1]);
    pthread_mutex_unlock(&x.g.mu);
    k3_server_drain(s);
    k3_server_end(s, "the test ends the server");
    pthread_mutex_lock(&x.g.mu);
    CHECK(wait_for(&x, both_finished));
    /* cut by the server: an error of the server's, whatever woke first */
    CHECKF(x.q[0].finish == K3_FINISH_ERROR, "finish %d (abort is %d)", (int)x.q[0].finish, (int)K3_FINISH_CANCELLED);
    CHECKF(x.q[0].err_status == 503, "status %u", x.q[0].err_status);
    CHECKF(strstr(x.q[0].error, "the test ends the server") != NULL, "error '%s'", x.q[0].error);
    CHECK(x.q[0].n_tok < 3000);
    /* cancelled by its own side before the ending: its own reason stays */
    CHECKF(x.q[1].finish == K3_FINISH_CANCELLED, "finish %d", (int)x.q[1].finish);
    CHECK(x.q[1].error[0] == 0);
    pthread_mutex_unlock(&x.g.mu);

    k3_server_stop(s);
    for (int i = 0; i < 2; i++) k3_srv_seq_free(&x.q[i]);
    k3_engine_close(e);
    k3_tokenizer_free(tok);
    k3_model_close(m);
}
