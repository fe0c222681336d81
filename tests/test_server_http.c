/*
 * test_server_http.c -- the HTTP layer's limits over raw sockets, with no
 * engine and no Python: routes that need no generation, OpenAI-shaped errors,
 * the API key, an oversized body (refused from Content-Length before it is
 * sent, and while reading a chunked one), malformed JSON and bad UTF-8, a
 * slow client dropped by the idle timeout, more connections than the limit
 * (the extra ones answered 503 with Retry-After),
 * and the generation routes answering 503 with Retry-After without an engine.
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

static int dial(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    return fd;
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

static k3_server *start(k3_tokenizer *tok, const char *key, int timeout_s, int max_conn) {
    k3_server_options o = {.host = "127.0.0.1",
                           .port = 0,
                           .api_key = key,
                           .model_name = "tiny",
                           .tok = tok,
                           .max_model_len = 4096,
                           .max_body_bytes = 4096,
                           .max_connections = max_conn,
                           .timeout_s = timeout_s};
    k3_server *s = NULL;
    k3_error err = {0};
    if (k3_server_start(&s, &o, &err)) return NULL;
    return s;
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
    CHECK(post(port, "/detokenize", dbad, strlen(dbad), NULL, resp, sizeof resp) == 400 &&
          strstr(resp, "tokens[1]"));
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
    k3_server_stop(s);
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

K3_TEST(server_http_slow_client_and_connection_limit) {
    k3_tokenizer *tok = NULL;
    REQUIRE(k3_tokenizer_open(&tok, "tests/models/tiny", NULL) == K3_OK);
    k3_server *s = start(tok, NULL, 1, 8);
    REQUIRE(s);
    const int port = k3_server_port(s);
    /* a client that sends half a request line and stalls is dropped */
    int fd = dial(port);
    REQUIRE(fd >= 0);
    send(fd, "GET /hea", 8, MSG_NOSIGNAL);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const long got = read_all(fd, resp, sizeof resp, 10000);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double el = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    CHECKF(got >= 0 && el < 8.0, "slow client not dropped (read %ld after %.1f s)", got, el);
    close(fd);
    /* the dropped client's slot is given back: only the asking connection is open */
    bool idle = false;
    for (int tries = 0; tries < 100 && !idle; tries++) {
        idle = get(port, "/metrics", NULL, resp, sizeof resp) == 200 &&
               strstr(resp, "k3:http_connections{model_name=\"tiny\"} 1\n");
        usleep(50 * 1000);
    }
    CHECK(idle);
    /* more connections than the limit: each sends a request; the 8 within
     * the limit are answered, the 16 over it get a 503 with Retry-After and
     * OpenAI's error JSON and are closed; the server lives */
    enum { NC = 24, LIMIT = 8 };
    int fds[NC];
    for (int i = 0; i < NC; i++) fds[i] = dial(port);
    static const char req[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    for (int i = 0; i < NC; i++)
        if (fds[i] >= 0) send(fds[i], req, sizeof req - 1, MSG_NOSIGNAL);
    int n_ok = 0, n_busy = 0, n_busy_shaped = 0, n_other = 0;
    for (int i = 0; i < NC; i++) {
        if (fds[i] < 0) {
            n_other++;
            continue;
        }
        /* a kept-alive 200 stays open: read what comes within 3 s */
        char r[4096];
        size_t n = 0;
        for (;;) {
            struct pollfd p = {.fd = fds[i], .events = POLLIN};
            if (poll(&p, 1, n && strstr(r, "\r\n\r\n") ? 300 : 3000) <= 0) break;
            const ssize_t k = recv(fds[i], r + n, sizeof r - 1 - n, 0);
            if (k <= 0) break;
            n += (size_t)k;
            r[n] = 0;
            if (n + 1 >= sizeof r) break;
        }
        r[n] = 0;
        const int st = n >= 12 ? atoi(r + 9) : -1;
        if (st == 200) n_ok++;
        else if (st == 503) {
            n_busy++;
            n_busy_shaped += strstr(r, "Retry-After: 1") && strstr(r, "\"type\":\"ServiceUnavailableError\"") &&
                             strstr(r, "\"code\":503") && strstr(r, "limit");
        } else n_other++;
    }
    CHECKF(n_ok == LIMIT && n_busy == NC - LIMIT && n_busy_shaped == n_busy,
           "%d connections against a limit of %d: %d answered 200, %d got 503 (%d with Retry-After and the "
           "error JSON), %d neither", NC, LIMIT, n_ok, n_busy, n_busy_shaped, n_other);
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
