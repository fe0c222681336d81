/*
 * executor.c -- rank 0's command channel and the replay on the other ranks
 * (executor.h). Everything about a mirrored call comes from its row in
 * calls.h: the function rank 0 calls, what goes into its message, and how
 * a rank that serves reads it back and makes the same call.
 */
#include "executor/executor.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/error.h"

/* ---- commands ------------------------------------------------------------------ */

#define K3_EXEC_CMD(name, ...) CMD_##name,
enum { CMD_STOP = 1, CMD_STATS, CMD_INIT_POOL, K3_EXEC_CALLS(K3_EXEC_CMD) CMD_COUNT };
_Static_assert(CMD_COUNT <= 64, "k3_exec_tap.n_of has room for 64 commands");

#define K3_EXEC_NAME(name, ...) #name,
static const char *const row_names[] = {K3_EXEC_CALLS(K3_EXEC_NAME)};

int32_t k3_exec_command(const char *name) {
    for (int32_t i = 0; i < (int32_t)(sizeof row_names / sizeof row_names[0]); i++)
        if (!strcmp(row_names[i], name)) return CMD_INIT_POOL + 1 + i;
    return -1;
}

static const char *command_name(int32_t cmd) {
    if (cmd == CMD_STOP) return "the end";
    if (cmd == CMD_STATS) return "a counter sum";
    if (cmd == CMD_INIT_POOL) return "k3_ctx_init_pool";
    if (cmd > CMD_INIT_POOL && cmd < CMD_COUNT) return row_names[cmd - CMD_INIT_POOL - 1];
    return "?";
}

/* A payload this small travels in the header. */
enum { INLINE_BYTES = 24, SEG_MIN = 4096, MAX_SEGS = 4 };

typedef struct msg_hdr {
    int32_t cmd, pad;
    int64_t bytes; /* payload */
    uint8_t inl[INLINE_BYTES];
} msg_hdr;

static k3_exec_tap *g_tap;

void k3_exec_set_tap(k3_exec_tap *tap) { g_tap = tap; }

/* Rank 0 of several: its calls go to the others. */
static bool sends(const k3_dist *d) { return d && k3_dist_rank(d) == 0 && k3_dist_size(d) > 1; }

/* ---- writing a message ------------------------------------------------------------
 * The payload is copied together; an array of SEG_MIN bytes or more (of at
 * most MAX_SEGS per message) is a segment instead, broadcast from where it
 * lies after the payload, with its length in the payload. Both sides know
 * an array's length (calls.h: the same on every rank), so both take the
 * same arrays for segments and a short array travels without a length. */

typedef struct wmsg {
    msg_hdr h;
    uint8_t *buf;
    size_t n, cap;
    uint8_t small[512];
    struct {
        const void *p;
        size_t n;
        void *owned; /* freed after the send */
    } seg[MAX_SEGS];
    int n_seg;
    k3_status st; /* a message that cannot be made, why in msg */
    char msg[200];
} wmsg;

static void w_init(wmsg *w, int32_t cmd) {
    memset(&w->h, 0, sizeof w->h);
    w->h.cmd = cmd;
    w->buf = w->small;
    w->n = 0;
    w->cap = sizeof w->small;
    w->n_seg = 0;
    w->st = K3_OK;
    w->msg[0] = 0;
}

static void w_free(wmsg *w) {
    if (w->buf != w->small) free(w->buf);
    for (int i = 0; i < w->n_seg; i++) free(w->seg[i].owned);
    w->n_seg = 0;
}

static void w_fail(wmsg *w, k3_status st, const char *what) {
    if (w->st) return;
    w->st = st;
    snprintf(w->msg, sizeof w->msg, "%s", what);
}

static void w_put(wmsg *w, const void *src, size_t n) {
    if (w->st || n == 0) return;
    if (w->n + n > w->cap) {
        size_t cap = 2 * w->cap;
        while (cap < w->n + n) cap *= 2;
        uint8_t *b = w->buf == w->small ? malloc(cap) : realloc(w->buf, cap);
        if (!b) return w_fail(w, K3_ERR_NOMEM, "dist: out of memory for a message");
        if (w->buf == w->small) memcpy(b, w->small, w->n);
        w->buf = b;
        w->cap = cap;
    }
    memcpy(w->buf + w->n, src, n);
    w->n += n;
}

/* n bytes at p: copied, or a segment (owned: freed after the send) */
static void w_array(wmsg *w, const void *p, size_t n, void *owned) {
    if (n < SEG_MIN || w->n_seg == MAX_SEGS) {
        w_put(w, p, n);
        free(owned);
        return;
    }
    if (n > INT32_MAX) w_fail(w, K3_ERR_RANGE, "dist: an array over one broadcast (2 GB)");
    const int32_t len = (int32_t)n;
    w_put(w, &len, sizeof len);
    if (w->st) {
        free(owned);
        return;
    }
    w->seg[w->n_seg].p = p;
    w->seg[w->n_seg].n = n;
    w->seg[w->n_seg++].owned = owned;
}

static void w_batch(wmsg *w, const k3_batch_seq *batch, int32_t n_seqs, int64_t row_floats) {
    int64_t n_tokens = 0;
    int32_t rows = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        n_tokens += batch[i].n_tokens;
        for (int32_t t = 0; batch[i].embeds && t < batch[i].n_tokens; t++) rows += batch[i].embeds[t] != NULL;
    }
    /* refused before anything is sent: a message over MPI's int count */
    if (rows > 0 && (row_floats < 1 || rows > INT32_MAX / 4 / row_floats)) {
        char m[200];
        snprintf(m, sizeof m, "dist: %lld image rows of %lld floats are over one broadcast (2 GB)", (long long)rows,
                 (long long)row_floats);
        return w_fail(w, K3_ERR_RANGE, m);
    }
    w_put(w, &n_seqs, sizeof n_seqs);
    for (int32_t i = 0; i < n_seqs; i++) {
        w_put(w, &batch[i].seq, sizeof batch[i].seq);
        w_put(w, &batch[i].n_tokens, sizeof batch[i].n_tokens);
    }
    for (int32_t i = 0; i < n_seqs; i++) w_put(w, batch[i].tokens, sizeof(int32_t) * (size_t)batch[i].n_tokens);
    w_put(w, &rows, sizeof rows);
    if (rows == 0 || w->st) return;
    /* a flag per token (1: its row follows), then the rows in token order */
    float *f = malloc(sizeof(float) * (size_t)(rows * row_floats));
    if (!f) return w_fail(w, K3_ERR_NOMEM, "dist: out of memory for image rows");
    int64_t r = 0;
    for (int32_t i = 0; i < n_seqs; i++)
        for (int32_t t = 0; t < batch[i].n_tokens; t++) {
            const float *e = batch[i].embeds ? batch[i].embeds[t] : NULL;
            const uint8_t flag = e != NULL;
            w_put(w, &flag, 1);
            if (e) memcpy(f + r++ * row_floats, e, sizeof(float) * (size_t)row_floats);
        }
    w_array(w, f, sizeof(float) * (size_t)rows * (size_t)row_floats, f);
}

static void tap_put(const void *p, size_t n) {
    k3_exec_tap *t = g_tap;
    if (t->failed || n == 0) return;
    if (t->len + n > t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 4096;
        while (cap < t->len + n) cap *= 2;
        uint8_t *b = realloc(t->buf, cap);
        if (!b) {
            t->failed = true;
            return;
        }
        t->buf = b;
        t->cap = cap;
    }
    memcpy(t->buf + t->len, p, n);
    t->len += n;
}

/* Broadcasts the message (and appends it to the tap, with tap). A message
 * that could not be made is not sent (its error into err); a broadcast that
 * fails fails the link (sticky). */
static k3_status w_send(wmsg *w, k3_dist *d, bool tap, k3_error *err) {
    const bool to_ranks = sends(d);
    char m[128];
    snprintf(m, sizeof m, "broadcast of %s", command_name(w->h.cmd));
    if (w->st) return k3_err(err, w->st, "%s", w->msg);
    w->h.bytes = (int64_t)w->n;
    if (w->n <= INLINE_BYTES) memcpy(w->h.inl, w->buf, w->n);
    if (g_tap && tap) {
        tap_put(&w->h, sizeof w->h);
        if (w->n > INLINE_BYTES) tap_put(w->buf, w->n);
        for (int i = 0; i < w->n_seg; i++) tap_put(w->seg[i].p, w->seg[i].n);
        g_tap->n_msgs++;
        g_tap->n_of[w->h.cmd]++;
    }
    if (!to_ranks) return K3_OK;
    const double dl = k3_comm_timeout(d);
    if (k3_comm_bcast(d, &w->h, sizeof w->h, m, dl)) return k3_comm_failed(d, err);
    if (w->n > INLINE_BYTES && k3_comm_bcast(d, w->buf, w->n, m, dl)) return k3_comm_failed(d, err);
    for (int i = 0; i < w->n_seg; i++)
        if (k3_comm_bcast(d, (void *)w->seg[i].p, w->seg[i].n, m, dl)) return k3_comm_failed(d, err);
    return K3_OK;
}

/* ---- reading a message --------------------------------------------------------------
 * From the broadcasts of rank 0, or from a tap. What a call's arguments
 * point into is allocated here and freed after the call. */

typedef struct rmsg {
    msg_hdr h;
    const uint8_t *p; /* the payload */
    size_t n, at;
    void *payload;          /* allocated when it did not travel in the header */
    int n_seg;              /* segments read */
    k3_dist *d;             /* the segments come from rank 0, or */
    const k3_exec_tap *tap; /* from the tap, at *tap_at */
    size_t *tap_at;
    void *own[16];
    int n_own;
    k3_status st;
    char msg[sizeof(((k3_error *)0)->msg)];
    int32_t rank;
} rmsg;

static void r_fail(rmsg *r, k3_status st, const char *what) {
    if (r->st) return;
    r->st = st;
    snprintf(r->msg, sizeof r->msg, "dist: rank %d: %s from rank 0 (%s)", r->rank, what, command_name(r->h.cmd));
}

static void *r_alloc(rmsg *r, size_t n) {
    if (r->st) return NULL;
    void *p = r->n_own < (int)(sizeof r->own / sizeof r->own[0]) ? malloc(n ? n : 1) : NULL;
    if (!p) {
        r_fail(r, K3_ERR_NOMEM, "out of memory for a message");
        return NULL;
    }
    r->own[r->n_own++] = p;
    return p;
}

static void r_free(rmsg *r) {
    for (int i = 0; i < r->n_own; i++) free(r->own[i]);
    r->n_own = 0;
    free(r->payload);
    r->payload = NULL;
}

/* n bytes of rank 0's broadcasts (or the tap) into dst */
static k3_status r_unit(rmsg *r, void *dst, size_t n, double wait_s) {
    if (r->tap) {
        if (*r->tap_at + n > r->tap->len) {
            r_fail(r, K3_ERR_FORMAT, "a message cut short");
            return r->st;
        }
        memcpy(dst, r->tap->buf + *r->tap_at, n);
        *r->tap_at += n;
        return K3_OK;
    }
    char m[128];
    snprintf(m, sizeof m, r->h.cmd ? "broadcast of %s" : "wait for rank 0", command_name(r->h.cmd));
    if (k3_comm_bcast(r->d, dst, n, m, wait_s)) {
        k3_error e = {0};
        r->st = k3_comm_failed(r->d, &e);
        memcpy(r->msg, e.msg, sizeof r->msg);
    }
    return r->st;
}

/* The next message: its header (waiting for rank 0 as long as it takes),
 * then its payload. */
static k3_status r_next(rmsg *r) {
    r->st = K3_OK;
    r->h.cmd = 0;
    r->n_seg = 0;
    msg_hdr h;
    if (r_unit(r, &h, sizeof h, -1.0)) return r->st;
    r->h = h;
    r->at = 0;
    if (h.bytes < 0 || h.bytes > INT32_MAX) {
        r_fail(r, K3_ERR_FORMAT, "a bad message");
        return r->st;
    }
    r->n = (size_t)h.bytes;
    if (r->n <= INLINE_BYTES) {
        r->p = r->h.inl;
        return K3_OK;
    }
    r->payload = malloc(r->n);
    if (!r->payload) {
        r_fail(r, K3_ERR_NOMEM, "out of memory for a message");
        return r->st;
    }
    r->p = r->payload;
    return r_unit(r, r->payload, r->n, r->d ? k3_comm_timeout(r->d) : 0);
}

static void r_get(rmsg *r, void *dst, size_t n) {
    if (r->st) return;
    if (r->n - r->at < n) return r_fail(r, K3_ERR_FORMAT, "a message cut short");
    memcpy(dst, r->p + r->at, n);
    r->at += n;
}

/* an array written by w_array, expect bytes long (what this rank computes) */
static void *r_array(rmsg *r, int64_t expect) {
    if (r->st) return NULL;
    if (expect < 0 || expect > INT32_MAX) {
        r_fail(r, K3_ERR_FORMAT, "an array over one broadcast");
        return NULL;
    }
    const bool is_seg = expect >= SEG_MIN && r->n_seg < MAX_SEGS;
    if (is_seg) { /* its length, checked: the ranks must agree on it */
        int32_t len = 0;
        r_get(r, &len, sizeof len);
        if (!r->st && len != expect) {
            char m[128];
            snprintf(m, sizeof m, "an array of %d bytes where %lld were expected", len, (long long)expect);
            r_fail(r, K3_ERR_FORMAT, m);
        }
    }
    void *p = r_alloc(r, (size_t)expect);
    if (!p) return NULL;
    if (is_seg) {
        r->n_seg++;
        r_unit(r, p, (size_t)expect, r->d ? k3_comm_timeout(r->d) : 0);
    } else {
        r_get(r, p, (size_t)expect);
    }
    return r->st ? NULL : p;
}

static void r_batch(rmsg *r, const k3_batch_seq **out, int32_t *n_out, int64_t row_floats) {
    int32_t n = 0;
    r_get(r, &n, sizeof n);
    if (!r->st && (n < 0 || (size_t)n > r->n / 8)) r_fail(r, K3_ERR_FORMAT, "a bad batch");
    k3_batch_seq *b = r_alloc(r, sizeof *b * (size_t)n);
    int64_t n_tokens = 0;
    for (int32_t i = 0; !r->st && i < n; i++) {
        r_get(r, &b[i].seq, sizeof b[i].seq);
        r_get(r, &b[i].n_tokens, sizeof b[i].n_tokens);
        if (!r->st && (b[i].n_tokens < 0 || (size_t)(n_tokens + b[i].n_tokens) > r->n / 4))
            r_fail(r, K3_ERR_FORMAT, "a bad batch");
        n_tokens += b[i].n_tokens;
    }
    int32_t *tok = r_alloc(r, sizeof(int32_t) * (size_t)n_tokens);
    r_get(r, tok, sizeof(int32_t) * (size_t)n_tokens);
    int32_t rows = 0;
    r_get(r, &rows, sizeof rows);
    const float **eptr = NULL;
    if (!r->st && rows > 0) {
        if (rows > n_tokens || row_floats < 1) r_fail(r, K3_ERR_FORMAT, "a bad batch (image rows)");
        eptr = r_alloc(r, sizeof *eptr * (size_t)n_tokens);
        uint8_t *flag = r_alloc(r, (size_t)n_tokens);
        r_get(r, flag, (size_t)n_tokens);
        const float *f = r_array(r, (int64_t)sizeof(float) * rows * row_floats);
        int64_t k = 0;
        for (int64_t t = 0; !r->st && t < n_tokens; t++) {
            eptr[t] = flag[t] && k < rows ? f + k * row_floats : NULL;
            k += flag[t] != 0;
        }
        if (!r->st && k != rows) r_fail(r, K3_ERR_FORMAT, "image row flags that do not match the rows");
    }
    for (int64_t i = 0, o = 0; !r->st && i < n; i++) {
        b[i].tokens = tok + o;
        b[i].embeds = eptr ? eptr + o : NULL;
        o += b[i].n_tokens;
    }
    *out = b;
    *n_out = n;
}

static float *r_logits(rmsg *r, int64_t rows, int64_t vocab) {
    if (!r->st && (rows < 0 || rows > (int64_t)r->n)) r_fail(r, K3_ERR_FORMAT, "a bad batch");
    return r_alloc(r, sizeof(float) * (size_t)(rows * vocab + 1));
}

/* a scratch buffer of len bytes for what rank 0 alone receives */
static void *r_out(rmsg *r, int64_t len) {
    if (!r->st && (len < 0 || len > INT32_MAX)) r_fail(r, K3_ERR_FORMAT, "a bad output size");
    return r_alloc(r, (size_t)(len > 0 ? len : 1));
}

/* ---- the rows of calls.h ------------------------------------------------------------- */

int64_t k3_exec_forward_rows(const k3_batch_seq *batch, int32_t n_seqs, k3_logits_mode mode) {
    if (mode == K3_LOGITS_NONE) return 0;
    if (mode != K3_LOGITS_ALL) return n_seqs;
    int64_t n = 0;
    for (int32_t i = 0; i < n_seqs; i++) n += batch[i].n_tokens;
    return n;
}

int64_t k3_exec_run_rows(const k3_batch_seq *batch, int32_t n_seqs, const uint8_t *want) {
    int64_t n = 0;
    for (int32_t i = 0; i < n_seqs; i++) n += want[i] == K3_WANT_ALL ? batch[i].n_tokens : want[i] == K3_WANT_LAST;
    return n;
}

/* What each kind of argument is where (calls.h): the call's arguments, the
 * message rank 0 writes, and the locals a serving rank reads it into. */
#define ARG(...) ARG_(__VA_ARGS__)
#define ARG_(kind, ...) ARG_##kind(__VA_ARGS__)
#define ARG_VAL(type, name) , name
#define ARG_IDS(ptr, n) , ptr, n
#define ARG_BYTES(type, ptr, len) , ptr
#define ARG_BATCH(batch, n) , batch, n
#define ARG_LOGITS(ptr, rows) , ptr
#define ARG_OUT(type, ptr, len) , ptr

#define PUT(...) PUT_(__VA_ARGS__)
#define PUT_(kind, ...) PUT_##kind(__VA_ARGS__)
#define PUT_VAL(type, name) w_put(&w, &name, sizeof(type));
#define PUT_IDS(ptr, n) \
    w_put(&w, &n, sizeof(int32_t)); \
    w_put(&w, ptr, sizeof(int32_t) * (size_t)(n > 0 ? n : 0));
#define PUT_BYTES(type, ptr, len) w_array(&w, ptr, (size_t)(len), NULL);
#define PUT_BATCH(batch, n) w_batch(&w, batch, n, ctx->c->hidden_size);
#define PUT_LOGITS(ptr, rows)
#define PUT_OUT(type, ptr, len)

#define LOCAL(...) LOCAL_(__VA_ARGS__)
#define LOCAL_(kind, ...) LOCAL_##kind(__VA_ARGS__)
#define LOCAL_VAL(type, name) type name = (type)0;
#define LOCAL_IDS(ptr, n) \
    const int32_t *ptr = NULL; \
    int32_t n = 0;
#define LOCAL_BYTES(type, ptr, len) const type *ptr = NULL;
#define LOCAL_BATCH(batch, n) \
    const k3_batch_seq *batch = NULL; \
    int32_t n = 0;
#define LOCAL_LOGITS(ptr, rows) float *ptr = NULL;
#define LOCAL_OUT(type, ptr, len) type *ptr = NULL;

#define GET(...) GET_(__VA_ARGS__)
#define GET_(kind, ...) GET_##kind(__VA_ARGS__)
#define GET_VAL(type, name) r_get(r, &name, sizeof(type));
#define GET_IDS(ptr, cnt) \
    r_get(r, &cnt, sizeof(int32_t)); \
    if (!r->st && (cnt < 0 || (size_t)cnt > r->n / 4)) r_fail(r, K3_ERR_FORMAT, "a bad id list"); \
    if (!r->st) { \
        int32_t *ids_ = r_alloc(r, sizeof(int32_t) * (size_t)cnt); \
        r_get(r, ids_, sizeof(int32_t) * (size_t)cnt); \
        ptr = ids_; \
    }
#define GET_BYTES(type, ptr, len) \
    if (!r->st) ptr = r_array(r, (int64_t)(len));
#define GET_BATCH(batch, n) r_batch(r, &batch, &n, ctx->c->hidden_size);
#define GET_LOGITS(ptr, rows) \
    if (!r->st) ptr = r_logits(r, (int64_t)(rows), ctx->c->vocab_size);
#define GET_OUT(type, ptr, len) \
    if (!r->st) ptr = r_out(r, (int64_t)(len));

#define EACH K3_EXEC_EACH
#define PARAM K3_EXEC_PARAM
#define ERRA_STATUS , err
#define ERRA_VOID
#define CALL_STATUS(call) st = call
#define CALL_VOID(call) call
#define RETURN_STATUS(call) return call
#define RETURN_VOID(call) \
    do { \
        call; \
        return; \
    } while (0)
#define RESULT_STATUS return st;
#define RESULT_VOID
#define IS_COLLECTIVE_LOCAL 0
#define IS_COLLECTIVE_COLLECTIVE(check) 1
#define CHECK_LOCAL NO_CHECK
#define CHECK_COLLECTIVE(check) check
#define NO_CHECK(...) K3_OK

/* Rank 0's k3_exec_NAME. A COLLECTIVE call is checked, sent, made; when
 * it is not made (its check or its send failed) it forgets the captures
 * asked for it, as a failed forward pass does. A LOCAL call is made, then
 * sent when it succeeded; a message that cannot be sent then fails the link
 * (the others would miss it), and a failed link is sticky: the next forward
 * pass returns it. */
#define DEFINE_CALL(name, ret, order, ...) \
    K3_EXEC_RET_##ret k3_exec_##name(k3_ctx *ctx EACH(PARAM, __VA_ARGS__) K3_EXEC_ERRP_##ret) { \
        if (!g_tap && !sends(ctx->dist)) RETURN_##ret(k3_ctx_##name(ctx EACH(ARG, __VA_ARGS__) ERRA_##ret)); \
        k3_status st = K3_OK; \
        k3_error lerr_ = {0}; \
        wmsg w; \
        w_init(&w, CMD_##name); \
        if (IS_COLLECTIVE_##order) { \
            st = CHECK_##order(ctx EACH(ARG, __VA_ARGS__), &lerr_); \
            if (!st) { \
                EACH(PUT, __VA_ARGS__) \
                st = w_send(&w, ctx->dist, true, &lerr_); \
            } \
            if (!st) { \
                CALL_##ret(k3_ctx_##name(ctx EACH(ARG, __VA_ARGS__) ERRA_##ret)); \
            } else { \
                k3_ctx_forget_captures(ctx); \
                K3_EXEC_ERR_##ret(st, lerr_); \
            } \
        } else { \
            CALL_##ret(k3_ctx_##name(ctx EACH(ARG, __VA_ARGS__) ERRA_##ret)); \
            if (!st) { \
                EACH(PUT, __VA_ARGS__) \
                if (w_send(&w, ctx->dist, true, &lerr_) && sends(ctx->dist)) \
                    k3_comm_fail(ctx->dist, "the message of k3_ctx_" #name " (out of memory)", NULL); \
            } \
        } \
        w_free(&w); \
        RESULT_##ret \
    }
/* a failed check or send of a COLLECTIVE call: its message to the caller */
#define K3_EXEC_ERR_STATUS(st, e) k3_err(err, st, "%s", e.msg)
#define K3_EXEC_ERR_VOID(st, e) (void)0

K3_EXEC_CALLS(DEFINE_CALL)

/* A serving rank's side of row NAME: read the arguments, make the call. */
#define REPLAY_CALL(name, ret, order, ...) \
    case CMD_##name: { \
        EACH(LOCAL, __VA_ARGS__) \
        EACH(GET, __VA_ARGS__) \
        if (r->st) return k3_err(err, r->st, "%s", r->msg); \
        if (r->at != r->n) \
            return k3_err(err, K3_ERR_FORMAT, \
                          "dist: rank %d: %zu bytes too many in a message " \
                          "from rank 0 (%s)", \
                          r->rank, r->n - r->at, #name); \
        CALL_##ret(k3_ctx_##name(ctx EACH(ARG, __VA_ARGS__) ERRA_##ret)); \
        return st; \
    }

static k3_status replay_call(k3_ctx *ctx, rmsg *r, k3_error *err) {
    k3_status st = K3_OK;
    switch (r->h.cmd) {
        K3_EXEC_CALLS(REPLAY_CALL)
    default: return k3_err(err, K3_ERR_FORMAT, "dist: rank %d: unexpected command %d from rank 0", r->rank, r->h.cmd);
    }
}

/* ---- the pool context of an engine --------------------------------------------------- */

static void put_pool(wmsg *w, const k3_ctx_options *o, int32_t n_blocks, int64_t max_ctx) {
    const int32_t kv = (int32_t)o->kv_cache, dense = o->dense_attention;
    w_put(w, &o->max_seqs, sizeof o->max_seqs);
    w_put(w, &o->cache_tokens, sizeof o->cache_tokens);
    w_put(w, &o->block_size, sizeof o->block_size);
    w_put(w, &o->max_batch, sizeof o->max_batch);
    w_put(w, &kv, sizeof kv);
    w_put(w, &dense, sizeof dense);
    w_put(w, &n_blocks, sizeof n_blocks);
    w_put(w, &max_ctx, sizeof max_ctx);
}

k3_status k3_exec_init_pool(k3_ctx **out, const k3_model *m, const k3_ctx_options *opt, int32_t n_blocks,
                            int64_t max_ctx, k3_error *err) {
    *out = NULL;
    if (n_blocks < 1 || max_ctx < 1) return k3_err(err, K3_ERR_ARG, "context: n_blocks and max_ctx must be positive");
    if (sends(opt->dist)) { /* the others make theirs together with rank 0 */
        wmsg w;
        w_init(&w, CMD_INIT_POOL);
        put_pool(&w, opt, n_blocks, max_ctx);
        const k3_status st = w_send(&w, opt->dist, false, err);
        w_free(&w);
        if (st) return st;
    }
    return k3_ctx_init_pool(out, m, opt, n_blocks, max_ctx, err);
}

static k3_status replay_pool(rmsg *r, k3_ctx **out, const k3_model *m, k3_pool *pool, k3_dist *d, k3_error *err) {
    k3_ctx_options o = {.pool = pool, .dist = d};
    int32_t kv = 0, dense = 0, n_blocks = 0;
    int64_t max_ctx = 0;
    r_get(r, &o.max_seqs, sizeof o.max_seqs);
    r_get(r, &o.cache_tokens, sizeof o.cache_tokens);
    r_get(r, &o.block_size, sizeof o.block_size);
    r_get(r, &o.max_batch, sizeof o.max_batch);
    r_get(r, &kv, sizeof kv);
    r_get(r, &dense, sizeof dense);
    r_get(r, &n_blocks, sizeof n_blocks);
    r_get(r, &max_ctx, sizeof max_ctx);
    if (r->st) return k3_err(err, r->st, "%s", r->msg);
    o.kv_cache = (k3_kv_type)kv;
    o.dense_attention = dense != 0;
    return k3_ctx_init_pool(out, m, &o, n_blocks, max_ctx, err);
}

/* ---- serving ranks ----------------------------------------------------------------- */

/* Replays rank 0's messages until the end: on ctx, or (ctx NULL) on the
 * context the first k3_ctx_init_pool makes (on model m, pool; freed at the
 * end). */
static k3_status serve(k3_dist *d, k3_ctx *ctx, const k3_model *m, k3_pool *pool, k3_error *err) {
    if (k3_dist_rank(d) == 0) return k3_err(err, K3_ERR_ARG, "dist: rank 0 is not a worker");
    k3_ctx *own = NULL;
    rmsg r = {.d = d, .rank = k3_dist_rank(d)};
    k3_status s = K3_OK;
    for (;;) {
        /* between commands rank 0 may tokenize, sample, or wait for clients
         * for as long as it likes */
        if (r_next(&r)) {
            s = k3_err(err, r.st, "%s", r.msg);
            break;
        }
        if (r.h.cmd == CMD_STOP) break;
        if (r.h.cmd == CMD_STATS) s = k3_comm_stats_sum(d, NULL, NULL, err);
        else if (r.h.cmd == CMD_INIT_POOL && !ctx && !own && m) s = replay_pool(&r, &own, m, pool, d, err);
        else if (ctx || own) s = replay_call(ctx ? ctx : own, &r, err);
        else s = k3_err(err, K3_ERR_FORMAT, "dist: rank %d: unexpected command %d from rank 0", r.rank, r.h.cmd);
        r_free(&r);
        if (s) break;
    }
    r_free(&r);
    k3_ctx_free(own);
    return s;
}

k3_status k3_exec_serve(k3_ctx *ctx, k3_error *err) {
    if (!ctx->dist) return k3_err(err, K3_ERR_ARG, "dist: a context of one process has no rank 0 to serve");
    return serve(ctx->dist, ctx, NULL, NULL, err);
}

k3_status k3_exec_serve_pool(k3_dist *d, const k3_model *m, k3_pool *pool, k3_error *err) {
    return serve(d, NULL, m, pool, err);
}

k3_status k3_exec_replay(k3_ctx *ctx, const k3_exec_tap *tap, k3_error *err) {
    if (tap->failed) return k3_err(err, K3_ERR_NOMEM, "replay: the tap ran out of memory");
    size_t at = 0;
    rmsg r = {.tap = tap, .tap_at = &at};
    k3_status s = K3_OK;
    while (!s && at < tap->len) {
        if (r_next(&r)) s = k3_err(err, r.st, "%s", r.msg);
        else s = replay_call(ctx, &r, err);
        r_free(&r);
    }
    return s;
}

/* ---- the channel's own commands ------------------------------------------------------ */

static k3_status send_control(k3_dist *d, int32_t cmd, k3_error *err) {
    wmsg w;
    w_init(&w, cmd);
    const k3_status st = w_send(&w, d, false, err);
    w_free(&w);
    return st;
}

k3_status k3_exec_stats_take_all(k3_dist *d, k3_comm_stats *mine, k3_comm_stats *all, k3_error *err) {
    if (!d || k3_dist_size(d) == 1 || k3_dist_rank(d) != 0) {
        k3_comm_stats own = {0};
        if (d) k3_dist_stats_take(d, &own);
        if (mine) *mine = own;
        if (all) *all = own;
        return d && k3_dist_rank(d) != 0 ? k3_err(err, K3_ERR_ARG, "dist: only rank 0 sums the counters") : K3_OK;
    }
    if (send_control(d, CMD_STATS, err)) return k3_comm_failed(d, err);
    return k3_comm_stats_sum(d, mine, all, err);
}

k3_status k3_exec_release(k3_dist *d, k3_error *err) {
    if (!sends(d)) return K3_OK;
    send_control(d, CMD_STOP, NULL);
    return k3_comm_failed(d, err);
}

k3_status k3_exec_failed(const k3_ctx *ctx, k3_error *err) { return k3_comm_failed(ctx->dist, err); }
