/*
 * test_server_http.c -- the HTTP layer's limits over raw sockets, with no
 * engine and no Python: routes that need no generation, OpenAI-shaped errors,
 * the API key (Bearer in any case, x-api-key, checked on the headers before
 * any body byte, an empty key refused), an oversized body (refused from
 * Content-Length before it is sent, and while reading a chunked one),
 * malformed JSON and bad UTF-8, the framing (two Content-Lengths, a
 * Transfer-Encoding that is not chunked, a compressed body, a malformed
 * request line), the header deadline, a connection over the limit taking
 * the slot of one that waits for its request, the 503 when every slot is
 * busy, slowloris with more trickling connections than the limit while a
 * normal client is served, the per-address cap, CORS, the drain, and the
 * generation routes answering 503 with Retry-After without an engine.
 */
#include "test.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "k3.h"

/* A connection to 127.0.0.1:port from the source address src (NULL: any). */
static int dial_from(int port, const char *src) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    if (src) {
        struct sockaddr_in b = {.sin_family = AF_INET};
        inet_pton(AF_INET, src, &b.sin_addr);
        if (bind(fd, (struct sockaddr *)&b, sizeof b)) {
            close(fd);
            return -1;
        }
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    return fd;
}

static int dial(int port) { return dial_from(port, NULL); }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Reads until the peer closes or timeout_ms passes; returns bytes read, -2 on timeout. */
static long read_all(int fd, char *buf, size_t cap, int timeout_ms) {
    size_t n = 0;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        const int r = poll(&p, 1, timeout_ms);
        if (r == 0) return -2;
        if (r < 0) return -1;
        const ssize_t got = recv(fd, buf + n, cap - 1 - n, 0);
        if (got <= 0) break;
        n += (size_t)got;
        if (n + 1 >= cap) break;
    }
    buf[n] = 0;
    return (long)n;
}

/* Sends raw (one HTTP/1.1 request with Connection: close) and reads the answer. */
static int http(int port, const char *raw, size_t len, char *resp, size_t cap) {
    int fd = dial(port);
    if (fd < 0) return -1;
    size_t sent = 0;
    while (sent < len) {
        const ssize_t w = send(fd, raw + sent, len - sent, MSG_NOSIGNAL);
        if (w <= 0) break;
        sent += (size_t)w;
    }
    const long n = read_all(fd, resp, cap, 10000);
    close(fd);
    if (n < 12) return -1;
    return atoi(resp + 9); /* "HTTP/1.1 200" */
}

static int post(int port, const char *path, const char *body, size_t blen, const char *extra, char *resp, size_t cap) {
    char *raw = malloc(blen + 512);
    if (!raw) return -1;
    const int h = snprintf(raw, 512,
                           "POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                           "%sContent-Length: %zu\r\n\r\n",
                           path, extra ? extra : "", blen);
    memcpy(raw + h, body, blen);
    const int st = http(port, raw, (size_t)h + blen, resp, cap);
    free(raw);
    return st;
}

static int get(int port, const char *path, const char *extra, char *resp, size_t cap) {
    char raw[512];
    const int n = snprintf(raw, sizeof raw, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%s\r\n", path,
                           extra ? extra : "");
    return http(port, raw, (size_t)n, resp, cap);
}

static k3_server_options opts(k3_tokenizer *tok, const char *key, int timeout_s, int max_conn) {
    return (k3_server_options){.host = "127.0.0.1",
                               .port = 0,
                               .api_key = key,
                               .model_name = "tiny",
                               .tok = tok,
                               .max_model_len = 4096,
                               .max_body_bytes = 4096,
                               .max_connections = max_conn,
                               .timeout_s = timeout_s};
}

static k3_server *start_with(const k3_server_options *o) {
    k3_server *s = NULL;
    k3_error err = {0};
    if (k3_server_start(&s, o, &err)) return NULL;
    return s;
}

static k3_server *start(k3_tokenizer *tok, const char *key, int timeout_s, int max_conn) {
    k3_server_options o = opts(tok, key, timeout_s, max_conn);
    return start_with(&o);
}

static char resp[65536];

K3_TEST(server_http_routes_and_errors) {
    k3_tokenizer *tok = NULL;
    REQUIRE(k3_tokenizer_open(&tok, "tests/models/tiny", NULL) == K3_OK);
    k3_server *s = start(tok, NULL, 5, 64);
    REQUIRE(s);
    const int port = k3_server_port(s);
    CHECK(port > 0);
    CHECK(get(port, "/health", NULL, resp, sizeof resp) == 200);
    CHECK(get(port, "/version", NULL, resp, sizeof resp) == 200 && strstr(resp, "\"version\""));
    CHECK(get(port, "/v1/models", NULL, resp, sizeof resp) == 200 && strstr(resp, "\"max_model_len\":4096") &&
          strstr(resp, "\"id\":\"tiny\""));
    CHECK(get(port, "/metrics", NULL, resp, sizeof resp) == 200 &&
          strstr(resp, "vllm:num_requests_running{model_name=\"tiny\"} 0"));
    /* an unknown route and a wrong method */
    CHECK(get(port, "/v2/nothing", NULL, resp, sizeof resp) == 404 && strstr(resp, "\"error\"") &&
          strstr(resp, "\"code\":404"));
    CHECK(post(port, "/v1/models", "{}", 2, NULL, resp, sizeof resp) == 405);
    /* tokenize / detokenize round trip */
    const char *tb = "{\"prompt\":\"Hello world\"}";
    CHECK(post(port, "/tokenize", tb, strlen(tb), NULL, resp, sizeof resp) == 200 && strstr(resp, "\"count\":6"));
    const char *db = "{\"tokens\":[39,596,78,286,267,582]}";
    CHECK(post(port, "/detokenize", db, strlen(db), NULL, resp, sizeof resp) == 200 &&
          strstr(resp, "\"prompt\":\"Hello world\""));
    const char *dbad = "{\"tokens\":[1,99999]}";
    CHECK(post(port, "/detokenize", dbad, strlen(dbad), NULL, resp, sizeof resp) == 400 && strstr(resp, "tokens[1]"));
    /* malformed JSON, bad UTF-8, not an object, too deep, no body */
    const char *bads[] = {"{\"prompt\":", "{\"prompt\":\"\xC3\x28\"}", "[1,2]", "", NULL};
    for (int i = 0; bads[i]; i++)
        CHECKF(post(port, "/tokenize", bads[i], strlen(bads[i]), NULL, resp, sizeof resp) == 400 &&
                   strstr(resp, "\"type\":\"BadRequestError\""),
               "bad body %d: %s", i, resp);
    char deep[400];
    for (int i = 0; i < 200; i++) deep[i] = '[';
    for (int i = 0; i < 199; i++) deep[200 + i] = ']';
    deep[399] = ']';
    CHECK(post(port, "/tokenize", deep, sizeof deep, NULL, resp, sizeof resp) == 400 && strstr(resp, "deeper"));
    /* an unknown model is 404; the generation routes need an engine: 503 + Retry-After */
    const char *um = "{\"model\":\"other\",\"prompt\":\"x\"}";
    CHECK(post(port, "/v1/completions", um, strlen(um), NULL, resp, sizeof resp) == 404 &&
          strstr(resp, "does not exist"));
    const char *cb = "{\"model\":\"tiny\",\"prompt\":\"x\"}";
    CHECK(post(port, "/v1/completions", cb, strlen(cb), NULL, resp, sizeof resp) == 503 &&
          strstr(resp, "Retry-After: 1"));
    k3_server_stop(s);
    k3_tokenizer_free(tok);
}

K3_TEST(server_http_api_key) {
    k3_tokenizer *tok = NULL;
    REQUIRE(k3_tokenizer_open(&tok, "tests/models/tiny", NULL) == K3_OK);
    k3_server *s = start(tok, "sekret", 5, 64);
    REQUIRE(s);
    const int port = k3_server_port(s);
    CHECK(get(port, "/health", NULL, resp, sizeof resp) == 200); /* /health needs no key */
    CHECK(get(port, "/v1/models", NULL, resp, sizeof resp) == 401 && strstr(resp, "AuthenticationError"));
    CHECK(get(port, "/v1/models", "Authorization: Bearer wrong\r\n", resp, sizeof resp) == 401);
    CHECK(get(port, "/v1/models", "Authorization: Bearer sekretX\r\n", resp, sizeof resp) == 401);
    CHECK(get(port, "/v1/models", "Authorization: Bearer sekret\r\n", resp, sizeof resp) == 200);
    CHECK(get(port, "/nope", NULL, resp, sizeof resp) == 401); /* no route is probed without the key */
    /* the scheme in any case (RFC 7235), and x-api-key (the Anthropic API's) */
    CHECK(get(port, "/v1/models", "Authorization: bearer sekret\r\n", resp, sizeof resp) == 200);
    CHECK(get(port, "/v1/models", "Authorization: BEARER   sekret\r\n", resp, sizeof resp) == 200);
    CHECK(get(port, "/v1/models", "Authorization: Basic sekret\r\n", resp, sizeof resp) == 401);
    CHECK(get(port, "/v1/models", "x-api-key: sekret\r\n", resp, sizeof resp) == 200);
    CHECK(get(port, "/v1/models", "x-api-key: sekre\r\n", resp, sizeof resp) == 401);
    /* /metrics is open (as vLLM's), /ready too */
    CHECK(get(port, "/metrics", NULL, resp, sizeof resp) == 200);
    CHECK(get(port, "/ready", NULL, resp, sizeof resp) == 200 && strstr(resp, "\"ready\""));
    /* the key is checked on the headers: a body announced and never sent is
     * not waited for (so an unauthenticated client never has one buffered) */
    int fd = dial(port);
    REQUIRE(fd >= 0);
    const char *h = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: 4000\r\n\r\n{\"prompt\":";
    send(fd, h, strlen(h), MSG_NOSIGNAL);
    const double t0 = now_s();
    const long n = read_all(fd, resp, sizeof resp, 5000);
    CHECKF(n > 12 && atoi(resp + 9) == 401 &&
                   now_s() - t0<2.0, "unauthenticated body: %ld bytes after %.1f s: %.80s", n, now_s() - t0, n> 0
               ? resp
               : "");
    close(fd);
    /* with the key the body is read (the route then answers: no engine) */
    const char *cb = "{\"prompt\":\"x\"}";
    CHECK(post(port, "/v1/completions", cb, strlen(cb), "x-api-key: sekret\r\n", resp, sizeof resp) == 503);
    k3_server_stop(s);
    /* --metrics-require-key */
    k3_server_options o = opts(tok, "sekret", 5, 64);
    o.metrics_require_key = true;
    REQUIRE((s = start_with(&o)));
    CHECK(get(k3_server_port(s), "/metrics", NULL, resp, sizeof resp) == 401);
    CHECK(get(k3_server_port(s), "/metrics", "Authorization: Bearer sekret\r\n", resp, sizeof resp) == 200);
    k3_server_stop(s);
    /* an empty key is refused at start, never taken for "no key" */
    o = opts(tok, "", 5, 64);
    k3_error err = {0};
    s = NULL;
    CHECK(k3_server_start(&s, &o, &err) == K3_ERR_ARG && !s && strstr(err.msg, "empty"));
    k3_tokenizer_free(tok);
}

K3_TEST(server_http_body_limit) {
    k3_tokenizer *tok = NULL;
    REQUIRE(k3_tokenizer_open(&tok, "tests/models/tiny", NULL) == K3_OK);
    k3_server *s = start(tok, NULL, 5, 64);
    REQUIRE(s);
    const int port = k3_server_port(s);
    /* announced too big: refused before a byte of the body is sent */
    const char *hdr = "POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 100000000\r\n\r\n";
    CHECK(http(port, hdr, strlen(hdr), resp, sizeof resp) == 413 && strstr(resp, "over the limit"));
    /* chunked, no length: refused once past the limit */
    size_t cap = 64 << 10;
    char *raw = malloc(cap);
    REQUIRE(raw);
    size_t n = (size_t)snprintf(raw, cap,
                                "POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                "Transfer-Encoding: chunked\r\n\r\n");
    for (int c = 0; c < 8; c++) {
        n += (size_t)snprintf(raw + n, cap - n, "400\r\n");
        memset(raw + n, 'a', 1024);
        n += 1024;
        n += (size_t)snprintf(raw + n, cap - n, "\r\n");
    }
    n += (size_t)snprintf(raw + n, cap - n, "0\r\n\r\n");
    CHECK(http(port, raw, n, resp, sizeof resp) == 413);
    free(raw);
    /* the server still answers */
    CHECK(get(port, "/health", NULL, resp, sizeof resp) == 200);
    k3_server_stop(s);
    k3_tokenizer_free(tok);
}

/* The status of what arrives on fd within ms (-1: nothing, or closed unanswered). */
static int status_of(int fd, int ms) {
    char r[4096];
    size_t n = 0;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, n && strstr(r, "\r\n\r\n") ? 200 : ms) <= 0) break;
        const ssize_t k = recv(fd, r + n, sizeof r - 1 - n, 0);
        if (k <= 0) break;
        n += (size_t)k;
        r[n] = 0;
        if (n + 1 >= sizeof r) break;
    }
    r[n] = 0;
    memcpy(resp, r, n + 1);
    return n >= 12 ? atoi(r + 9) : -1;
}

K3_TEST(server_http_framing) {
    k3_tokenizer *tok = NULL;
    REQUIRE(k3_tokenizer_open(&tok, "tests/models/tiny", NULL) == K3_OK);
    k3_server *s = start(tok, NULL, 5, 64);
    REQUIRE(s);
    const int port = k3_server_port(s);
    const char *tb = "{\"prompt\":\"Hello world\"}";
    char raw[512];
    /* two Content-Lengths that differ: 400 (RFC 9112 section 6.3), equal ones pass */
    snprintf(raw, sizeof raw,
             "POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %zu\r\nContent-Length: 5\r\n"
             "\r\n%s",
             strlen(tb), tb);
    CHECK(http(port, raw, strlen(raw), resp, sizeof resp) == 400 && strstr(resp, "Content-Length headers that differ"));
    snprintf(raw, sizeof raw,
             "POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %zu\r\nContent-Length: %zu\r\n"
             "\r\n%s",
             strlen(tb), strlen(tb), tb);
    CHECK(http(port, raw, strlen(raw), resp, sizeof resp) == 200);
    /* Content-Length with Transfer-Encoding: 400; a Transfer-Encoding other than chunked: 501 at once */
    snprintf(raw, sizeof raw,
             "POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %zu\r\n"
             "Transfer-Encoding: chunked\r\n\r\n%s",
             strlen(tb), tb);
    CHECK(http(port, raw, strlen(raw), resp, sizeof resp) == 400 && strstr(resp, "both Content-Length"));
    const double t0 = now_s();
    snprintf(raw, sizeof raw,
             "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc");
    CHECK(http(port, raw, strlen(raw), resp, sizeof resp) == 501 && strstr(resp, "NotImplementedError"));
    CHECK(now_s() - t0 < 3.0);
    /* a compressed body: 415 with Accept-Encoding: identity */
    snprintf(raw, sizeof raw,
             "POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Encoding: gzip\r\n"
             "Content-Length: %zu\r\n\r\n%s",
             strlen(tb), tb);
    CHECK(http(port, raw, strlen(raw), resp, sizeof resp) == 415 && strstr(resp, "Accept-Encoding: identity"));
    /* an unknown method on a known path: 501; a known one: 405 */
    const char *m = "BREW /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    CHECK(http(port, m, strlen(m), resp, sizeof resp) == 501);
    m = "DELETE /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    CHECK(http(port, m, strlen(m), resp, sizeof resp) == 405);
    /* a bad HTTP version: libmicrohttpd's own 400; a request line without a
     * space: libmicrohttpd 0.9.75 closes it unanswered before any callback
     * (parse_initial_message_line), quickly */
    m = "GET /health HTTX/1.1\r\nHost: x\r\n\r\n";
    CHECK(http(port, m, strlen(m), resp, sizeof resp) == 400);
    int fd = dial(port);
    REQUIRE(fd >= 0);
    send(fd, "GARBAGE\r\n\r\n", 11, MSG_NOSIGNAL);
    const double t1 = now_s();
    CHECK(read_all(fd, resp, sizeof resp, 5000) >= 0 && now_s() - t1 < 2.0);
    close(fd);
    CHECK(get(port, "/health", NULL, resp, sizeof resp) == 200);
    k3_server_stop(s);
    k3_tokenizer_free(tok);
}

K3_TEST(server_http_deadlines_and_connection_limit) {
    k3_tokenizer *tok = NULL;
    REQUIRE(k3_tokenizer_open(&tok, "tests/models/tiny", NULL) == K3_OK);
    k3_server_options o = opts(tok, NULL, 30, 8);
    o.header_timeout_s = 1;
    o.body_timeout_s = 2;
    k3_server *s = start_with(&o);
    REQUIRE(s);
    const int port = k3_server_port(s);
    /* a client that trickles its request line is cut at the header deadline
     * with a 408, though it is never idle for the (30 s) idle timeout */
    int fd = dial(port);
    REQUIRE(fd >= 0);
    const double t0 = now_s();
    int st = -1;
    for (int i = 0; i < 40 && st < 0; i++) {
        send(fd, "G", 1, MSG_NOSIGNAL);
        st = status_of(fd, 150);
    }
    CHECKF(st == 408 && strstr(resp, "RequestTimeoutError") && now_s() - t0 < 4.0,
           "trickling client: status %d after %.1f s", st, now_s() - t0);
    close(fd);
    /* a body that stalls is cut at the body deadline with a 408 */
    fd = dial(port);
    REQUIRE(fd >= 0);
    const char *h = "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro";
    send(fd, h, strlen(h), MSG_NOSIGNAL);
    st = status_of(fd, 6000);
    CHECKF(st == 408 && strstr(resp, "body"), "stalled body: status %d", st);
    close(fd);
    /* the dropped clients' slots are given back: only the asking connection is open */
    bool idle = false;
    for (int tries = 0; tries < 100 && !idle; tries++) {
        idle = get(port, "/metrics", NULL, resp, sizeof resp) == 200 &&
            strstr(resp, "k3:http_connections{model_name=\"tiny\"} 1\n");
        usleep(50 * 1000);
    }
    CHECK(idle);
    CHECK(strstr(resp, "k3:http_timeouts_total{model_name=\"tiny\"} 2\n"));
    /* 8 connections that wait for their request, then one more with a
     * request: it takes the slot of the one that waited longest and is served */
    enum { LIMIT = 8, NC = 24 };
    int fds[NC];
    for (int i = 0; i < LIMIT; i++) fds[i] = dial(port);
    usleep(100 * 1000);
    CHECK(get(port, "/health", NULL, resp, sizeof resp) == 200);
    int closed = 0;
    for (int i = 0; i < LIMIT; i++) {
        struct pollfd p = {.fd = fds[i], .events = POLLIN};
        if (fds[i] >= 0 && poll(&p, 1, 0) == 1) {
            char b[16];
            closed += recv(fds[i], b, sizeof b, MSG_DONTWAIT) == 0;
        }
        if (fds[i] >= 0) close(fds[i]);
    }
    CHECKF(closed == 1, "%d waiting connections closed for the new one (1 expected)", closed);
    usleep(300 * 1000); /* the closes reach the server */
    CHECK(get(port, "/metrics", NULL, resp, sizeof resp) == 200 &&
          !strstr(resp, "k3:http_evicted_total{model_name=\"tiny\"} 0\n"));
    /* every slot busy (8 bodies being read): the 16 over the limit are
     * answered 503 with Retry-After and OpenAI's error JSON, and closed */
    usleep(200 * 1000);
    for (int i = 0; i < LIMIT; i++) {
        fds[i] = dial(port);
        const char *b = "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{";
        if (fds[i] >= 0) send(fds[i], b, strlen(b), MSG_NOSIGNAL);
    }
    usleep(200 * 1000);
    for (int i = LIMIT; i < NC; i++) fds[i] = dial(port);
    static const char req[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    for (int i = LIMIT; i < NC; i++)
        if (fds[i] >= 0) send(fds[i], req, sizeof req - 1, MSG_NOSIGNAL);
    int n_busy = 0, n_shaped = 0;
    for (int i = LIMIT; i < NC; i++) {
        const int c = fds[i] >= 0 ? status_of(fds[i], 3000) : -1;
        n_busy += c == 503;
        n_shaped += c == 503 && strstr(resp, "Retry-After: 1") &&
            strstr(resp, "\"type\":\"ServiceUnavailableError\"") && strstr(resp, "limit");
    }
    CHECKF(n_busy == NC - LIMIT && n_shaped == n_busy, "%d of %d over the limit got 503 (%d shaped)", n_busy,
           NC - LIMIT, n_shaped);
    for (int i = 0; i < NC; i++)
        if (fds[i] >= 0) close(fds[i]);
    CHECK(get(port, "/metrics", NULL, resp, sizeof resp) == 200 &&
          strstr(resp, "k3:http_connections_refused_total{model_name=\"tiny\"} 16"));
    /* the slots come back */
    bool ok = false;
    for (int tries = 0; tries < 50 && !ok; tries++) {
        ok = get(port, "/health", NULL, resp, sizeof resp) == 200;
        if (!ok) usleep(100 * 1000);
    }
    CHECK(ok);
    k3_server_stop(s);
    k3_tokenizer_free(tok);
}

/* slowloris: 24 connections against a limit of 16, each sending a header
 * byte every 200 ms and reconnecting when closed; a normal client is
 * served in every round. */
K3_TEST(server_http_slowloris) {
    k3_tokenizer *tok = NULL;
    REQUIRE(k3_tokenizer_open(&tok, "tests/models/tiny", NULL) == K3_OK);
    k3_server_options o = opts(tok, NULL, 30, 16);
    o.header_timeout_s = 2;
    k3_server *s = start_with(&o);
    REQUIRE(s);
    const int port = k3_server_port(s);
    enum { NT = 24, ROUNDS = 10 };
    int fds[NT], sent[NT];
    static const char req[] =
        "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    for (int i = 0; i < NT; i++) fds[i] = dial(port), sent[i] = 0;
    int served = 0, reconnects = 0;
    for (int round = 0; round < ROUNDS; round++) {
        for (int tick = 0; tick < 3; tick++) {
            for (int i = 0; i < NT; i++) {
                char b[512];
                if (fds[i] >= 0 && recv(fds[i], b, sizeof b, MSG_DONTWAIT) == 0) {
                    close(fds[i]);
                    fds[i] = -1;
                }
                if (fds[i] < 0) {
                    fds[i] = dial(port);
                    sent[i] = 0;
                    reconnects++;
                }
                if (fds[i] >= 0 && sent[i] < (int)sizeof req - 1 &&
                    send(fds[i], req + sent[i], 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1)
                    sent[i]++;
            }
            usleep(200 * 1000);
        }
        served += get(port, "/health", NULL, resp, sizeof resp) == 200;
    }
    CHECKF(served == ROUNDS, "a normal client was served in %d of %d rounds (%d trickling reconnects)", served, ROUNDS,
           reconnects);
    CHECK(get(port, "/metrics", NULL, resp, sizeof resp) == 200 &&
          !strstr(resp, "k3:http_evicted_total{model_name=\"tiny\"} 0\n"));
    for (int i = 0; i < NT; i++)
        if (fds[i] >= 0) close(fds[i]);
    k3_server_stop(s);
    /* one address over its cap: 503 from your address; another address is served */
    o = opts(tok, NULL, 30, 64);
    o.max_connections_per_ip = 4;
    REQUIRE((s = start_with(&o)));
    const int p2 = k3_server_port(s);
    int cfd[6];
    for (int i = 0; i < 6; i++) cfd[i] = dial_from(p2, "127.0.0.2");
    usleep(100 * 1000);
    static const char hreq[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    for (int i = 0; i < 6; i++)
        if (cfd[i] >= 0) send(cfd[i], hreq, sizeof hreq - 1, MSG_NOSIGNAL);
    int ok = 0, capped = 0;
    for (int i = 0; i < 6; i++) {
        const int c = cfd[i] >= 0 ? status_of(cfd[i], 3000) : -1;
        ok += c == 200;
        capped += c == 503 && strstr(resp, "from your address") != NULL;
    }
    CHECKF(ok == 4 && capped == 2, "6 connections from one address, a cap of 4: %d served, %d refused", ok, capped);
    CHECK(get(p2, "/health", NULL, resp, sizeof resp) == 200); /* from 127.0.0.1 */
    for (int i = 0; i < 6; i++)
        if (cfd[i] >= 0) close(cfd[i]);
    k3_server_stop(s);
    k3_tokenizer_free(tok);
}

K3_TEST(server_http_cors) {
    k3_tokenizer *tok = NULL;
    REQUIRE(k3_tokenizer_open(&tok, "tests/models/tiny", NULL) == K3_OK);
    k3_server *s = start(tok, NULL, 5, 64);
    REQUIRE(s);
    int port = k3_server_port(s);
    char hdr[256];
    /* by default a page of another origin is refused, its preflight too */
    CHECK(get(port, "/v1/models", "Origin: http://evil.example\r\n", resp, sizeof resp) == 403 &&
          strstr(resp, "PermissionDeniedError") && !strstr(resp, "Access-Control-Allow-Origin"));
    const char *pf = "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     "Origin: http://evil.example\r\nAccess-Control-Request-Method: POST\r\n"
                     "Access-Control-Request-Headers: authorization, content-type\r\n\r\n";
    CHECK(http(port, pf, strlen(pf), resp, sizeof resp) == 403);
    /* a page DNS-rebound to 127.0.0.1 (its own Host) is refused too; the server's own origin is not */
    CHECK(get(port, "/v1/models", "Origin: http://evil.example:8000\r\nHost: evil.example:8000\r\n", resp,
              sizeof resp) == 403);
    snprintf(hdr, sizeof hdr, "Origin: http://127.0.0.1:%d\r\n", port);
    char raw[512];
    snprintf(raw, sizeof raw, "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n%s\r\n", port,
             hdr);
    CHECK(http(port, raw, strlen(raw), resp, sizeof resp) == 200 &&
          strstr(resp, "Access-Control-Allow-Origin: http://127.0.0.1:"));
    /* no Origin (curl, the SDKs): as before */
    CHECK(get(port, "/v1/models", NULL, resp, sizeof resp) == 200 && !strstr(resp, "Access-Control"));
    k3_server_stop(s);
    /* --allowed-origins: the preflight is answered, every answer carries the header */
    k3_server_options o = opts(tok, "k", 5, 64);
    o.allowed_origins = "http://app.example, http://other.example/";
    REQUIRE((s = start_with(&o)));
    port = k3_server_port(s);
    const char *pf2 = "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      "Origin: http://app.example\r\nAccess-Control-Request-Method: POST\r\n"
                      "Access-Control-Request-Headers: authorization, content-type\r\n\r\n";
    CHECK(http(port, pf2, strlen(pf2), resp, sizeof resp) == 204 &&
          strstr(resp, "Access-Control-Allow-Origin: http://app.example") &&
          strstr(resp, "Access-Control-Allow-Methods: GET, POST, OPTIONS") &&
          strstr(resp, "Access-Control-Allow-Headers: authorization, content-type") &&
          strstr(resp, "Access-Control-Max-Age"));
    CHECK(get(port, "/v1/models", "Origin: http://other.example\r\nAuthorization: Bearer k\r\n", resp, sizeof resp) ==
              200 &&
          strstr(resp, "Access-Control-Allow-Origin: http://other.example") && strstr(resp, "Vary: Origin"));
    /* errors carry it too, so the page can read them */
    CHECK(get(port, "/v1/models", "Origin: http://app.example\r\n", resp, sizeof resp) == 401 &&
          strstr(resp, "Access-Control-Allow-Origin: http://app.example"));
    CHECK(get(port, "/v1/models", "Origin: http://evil.example\r\nAuthorization: Bearer k\r\n", resp, sizeof resp) ==
          403);
    k3_server_stop(s);
    o = opts(tok, NULL, 5, 64);
    o.allowed_origins = "*";
    REQUIRE((s = start_with(&o)));
    CHECK(get(k3_server_port(s), "/v1/models", "Origin: http://any.example\r\n", resp, sizeof resp) == 200 &&
          strstr(resp, "Access-Control-Allow-Origin: *"));
    k3_server_stop(s);
    k3_tokenizer_free(tok);
}

K3_TEST(server_http_drain) {
    k3_tokenizer *tok = NULL;
    REQUIRE(k3_tokenizer_open(&tok, "tests/models/tiny", NULL) == K3_OK);
    k3_server *s = start(tok, NULL, 5, 64);
    REQUIRE(s);
    const int port = k3_server_port(s);
    CHECK(k3_server_in_flight(s) == 0);
    k3_server_drain(s);
    /* new requests 503 with Retry-After and Connection: close; /health,
     * /ready 503; /metrics still answers */
    CHECK(get(port, "/v1/models", NULL, resp, sizeof resp) == 503 && strstr(resp, "Retry-After: 1") &&
          strstr(resp, "Connection: close") && strstr(resp, "shutting down"));
    CHECK(get(port, "/health", NULL, resp, sizeof resp) == 503);
    CHECK(get(port, "/ready", NULL, resp, sizeof resp) == 503);
    CHECK(get(port, "/metrics", NULL, resp, sizeof resp) == 200 &&
          strstr(resp, "k3:server_draining{model_name=\"tiny\"} 1"));
    k3_server_end(s, "the server is shutting down");
    CHECK(k3_server_in_flight(s) == 0);
    k3_server_stop(s);
    k3_tokenizer_free(tok);
}
