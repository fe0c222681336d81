/*
 * test_ucx.c -- src/comm/ucx: one-sided gets and puts between two workers
 * (two threads of this process, and two processes) over loopback, with
 * checksums; the handshake over a socket pair; the errors (out of range, a
 * malformed descriptor or handshake); a silent peer's deadline and the
 * cancellation that follows; a peer that dies mid-transfer. Skipped where
 * the build has no UCX. Across two network-namespace hosts: tests/hosts.sh
 * (build/ucxbench --check).
 */
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/ucx.h"
#include "test.h"

#define MIB (1u << 20)

static uint64_t fnv(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static void fill(unsigned char *p, size_t n, uint32_t seed) {
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        p[i] = (unsigned char)(x >> 24);
    }
}

/* The target side of a transfer in a thread: offers one region, serves until stopped. */
typedef struct target {
    const char *tls;
    bool no_peer_errors;
    int fd;
    size_t len;
    unsigned char *mem;
    volatile bool stop, ready, no_progress;
    k3_status st;
    k3_error err;
} target;

static void *target_main(void *arg) {
    target *t = arg;
    k3_ucx *u = NULL;
    k3_ucx_mem *m = NULL;
    k3_ucx_ep *ep = NULL;
    k3_ucx_region *theirs[1];
    int nt = 0;
    k3_ucx_options o = {.tls = t->tls, .name = "target", .no_peer_errors = t->no_peer_errors};
    k3_ucx_sock sk = {t->fd, 10};
    const k3_ucx_chan ch = k3_ucx_chan_socket(&sk);
    t->st = k3_ucx_open(&u, &o, &t->err);
    if (!t->st) t->st = k3_ucx_mem_register(u, t->mem, t->len, &m, &t->err);
    if (!t->st) t->st = k3_ucx_handshake(u, &ch, "the initiator", &m, 1, &ep, theirs, 1, &nt, &t->err);
    t->ready = true;
    if (!t->st && !t->no_progress) k3_ucx_serve(u, 60, &t->stop);
    while (!t->stop) usleep(1000);
    k3_ucx_ep_close(ep, 1);
    k3_ucx_mem_free(m);
    k3_ucx_close(u);
    return NULL;
}

static bool skip_without_ucx(void) {
    if (k3_ucx_available()) return false;
    k3_test_skip("this build has no UCX (libucx-dev)");
    return true;
}

/* gets of a 6 MiB + 3 region in pieces, then puts of another pattern over it */
static void get_put(const char *tls, bool no_peer_errors) {
    if (skip_without_ucx()) return;
    const size_t len = 6 * MIB + 3;
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    target t = {.tls = tls, .no_peer_errors = no_peer_errors, .fd = sv[1], .len = len, .mem = malloc(len)};
    unsigned char *local = malloc(len);
    REQUIRE(t.mem && local);
    fill(t.mem, len, 1);
    memset(local, 0, len);
    pthread_t th;
    pthread_create(&th, NULL, target_main, &t);
    k3_error err = {0};
    k3_ucx *u = NULL;
    k3_ucx_mem *lm = NULL;
    k3_ucx_ep *ep = NULL;
    k3_ucx_region *r[1] = {NULL};
    int n = 0;
    k3_ucx_options o = {.tls = tls, .name = "initiator", .no_peer_errors = no_peer_errors};
    k3_ucx_sock sk = {sv[0], 10};
    const k3_ucx_chan ch = k3_ucx_chan_socket(&sk);
    k3_status s = k3_ucx_open(&u, &o, &err);
    if (!s) s = k3_ucx_mem_register(u, local, len, &lm, &err);
    if (!s) s = k3_ucx_handshake(u, &ch, "the target", NULL, 0, &ep, r, 1, &n, &err);
    CHECKF(!s, "%s: %s", tls, err.msg);
    CHECK(s || n == 1);
    if (!s && n == 1) {
        CHECK(k3_ucx_region_size(r[0]) == len);
        k3_ucx_xfer *x = NULL;
        s = k3_ucx_xfer_begin(ep, &x, &err);
        /* 1 MiB pieces and the odd tail, the last one into unregistered memory */
        for (size_t off = 0; !s && off < len; off += MIB) {
            const size_t k = len - off < MIB ? len - off : MIB;
            s = k3_ucx_get(x, local + off, off + k < len ? lm : NULL, k, r[0], off, &err);
        }
        if (!s) s = k3_ucx_xfer_wait(x, 30, &err);
        CHECKF(!s, "%s: get: %s", tls, err.msg);
        CHECK(s || k3_ucx_xfer_bytes(x) == len);
        CHECKF(fnv(local, len) == fnv(t.mem, len), "%s: the gets' checksum differs", tls);
        k3_ucx_xfer_free(x);
        /* puts: another pattern, written at the target, complete there after the wait */
        fill(local, len, 2);
        const uint64_t want = fnv(local, len);
        s = k3_ucx_xfer_begin(ep, &x, &err);
        for (size_t off = 0; !s && off < len; off += 2 * MIB) {
            const size_t k = len - off < 2 * MIB ? len - off : 2 * MIB;
            s = k3_ucx_put(x, local + off, lm, k, r[0], off, &err);
        }
        if (!s) s = k3_ucx_xfer_wait(x, 30, &err);
        CHECKF(!s, "%s: put: %s", tls, err.msg);
        CHECKF(fnv(t.mem, len) == want, "%s: the puts' checksum differs at the target", tls);
        /* out of the region: refused before anything is posted */
        k3_error e2 = {0};
        CHECK(k3_ucx_get(x, local, lm, 16, r[0], len - 8, &e2) == K3_ERR_RANGE);
        CHECKF(strstr(e2.msg, "outside"), "%s", e2.msg);
        k3_error e3 = {0};
        CHECK(k3_ucx_get(x, local, lm, 0, r[0], 0, &e3) == K3_ERR_RANGE);
        k3_ucx_xfer_free(x);
    }
    if (n == 1) k3_ucx_region_free(r[0]);
    t.stop = true;
    pthread_join(th, NULL);
    CHECKF(!t.st, "target: %s", t.err.msg);
    k3_ucx_ep_close(ep, 1);
    k3_ucx_mem_free(lm);
    k3_ucx_close(u);
    close(sv[0]);
    close(sv[1]);
    free(local);
    free(t.mem);
}

K3_TEST(ucx_get_put_loopback_tcp) { get_put("tcp", false); }
/* shared memory (cma, posix, sysv): no peer failure detection, so without it */
K3_TEST(ucx_get_put_shared_memory) { get_put("sm", true); }

/* malformed descriptors and handshakes get a message, never a crash */
K3_TEST(ucx_malformed_input) {
    if (skip_without_ucx()) return;
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    k3_error err = {0};
    k3_ucx *u = NULL;
    REQUIRE(!k3_ucx_open(&u, &(k3_ucx_options){.tls = "tcp"}, &err));
    /* a peer that sends garbage instead of a handshake */
    static const char junk[64] = "GET / HTTP/1.1\r\n";
    REQUIRE(write(sv[1], junk, sizeof junk) == (ssize_t)sizeof junk);
    k3_ucx_sock sk = {sv[0], 2};
    const k3_ucx_chan ch = k3_ucx_chan_socket(&sk);
    k3_ucx_ep *ep = NULL;
    k3_ucx_region *r[1];
    int n = 0;
    CHECK(k3_ucx_handshake(u, &ch, "a stranger", NULL, 0, &ep, r, 1, &n, &err) == K3_ERR_FORMAT);
    CHECKF(strstr(err.msg, "a stranger's handshake is not one"), "%s", err.msg);
    CHECK(ep == NULL && n == 0);
    /* a peer that says nothing: the channel's deadline */
    k3_error e2 = {0};
    int sv2[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv2) == 0);
    k3_ucx_sock sk2 = {sv2[0], 0.2};
    const k3_ucx_chan ch2 = k3_ucx_chan_socket(&sk2);
    CHECK(k3_ucx_handshake(u, &ch2, "a silent peer", NULL, 0, &ep, r, 1, &n, &e2) == K3_ERR_IO);
    CHECKF(strstr(e2.msg, "nothing received within"), "%s", e2.msg);
    /* descriptors: short, wrong magic, a key length that does not add up */
    void *addr = NULL;
    size_t alen = 0;
    REQUIRE(!k3_ucx_address(u, &addr, &alen, &err));
    REQUIRE(!k3_ucx_connect(u, addr, alen, "myself", &ep, &err));
    free(addr);
    unsigned char d[64] = {0};
    k3_ucx_region *rr = NULL;
    k3_error e3 = {0}, e4 = {0}, e5 = {0};
    CHECK(k3_ucx_region_unpack(ep, d, 8, &rr, &e3) == K3_ERR_FORMAT);
    CHECK(k3_ucx_region_unpack(ep, d, sizeof d, &rr, &e4) == K3_ERR_FORMAT);
    CHECKF(strstr(e4.msg, "not one"), "%s", e4.msg);
    k3_ucx_mem *m = NULL;
    static unsigned char buf2[4096];
    REQUIRE(!k3_ucx_mem_register(u, buf2, sizeof buf2, &m, &err));
    void *desc = NULL;
    size_t dl = 0;
    REQUIRE(!k3_ucx_mem_pack(m, &desc, &dl, &err));
    CHECK(k3_ucx_region_unpack(ep, desc, dl - 1, &rr, &e5) == K3_ERR_FORMAT);
    CHECKF(strstr(e5.msg, "malformed"), "%s", e5.msg);
    CHECK(!k3_ucx_region_unpack(ep, desc, dl, &rr, &err) && k3_ucx_region_size(rr) == sizeof buf2);
    k3_ucx_region_free(rr);
    free(desc);
    k3_ucx_mem_free(m);
    k3_ucx_ep_close(ep, 1);
    k3_ucx_close(u);
    close(sv[0]);
    close(sv[1]);
    close(sv2[0]);
    close(sv2[1]);
}

/* a target that never progresses (tcp emulates gets with messages the target
 * must answer): the wait's deadline names what is outstanding; the cancel
 * ends every operation, after which the endpoint refuses more */
K3_TEST(ucx_deadline_then_cancel) {
    if (skip_without_ucx()) return;
    const size_t len = 4 * MIB;
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    target t = {.tls = "tcp", .fd = sv[1], .len = len, .mem = calloc(1, len), .no_progress = true};
    unsigned char *local = malloc(len);
    REQUIRE(t.mem && local);
    pthread_t th;
    pthread_create(&th, NULL, target_main, &t);
    k3_error err = {0};
    k3_ucx *u = NULL;
    k3_ucx_ep *ep = NULL;
    k3_ucx_region *r[1] = {NULL};
    int n = 0;
    k3_ucx_sock sk = {sv[0], 10};
    const k3_ucx_chan ch = k3_ucx_chan_socket(&sk);
    k3_status s = k3_ucx_open(&u, &(k3_ucx_options){.tls = "tcp"}, &err);
    if (!s) s = k3_ucx_handshake(u, &ch, "a stalled target", NULL, 0, &ep, r, 1, &n, &err);
    REQUIREF(!s && n == 1, "%s", err.msg);
    k3_ucx_xfer *x = NULL;
    REQUIRE(!k3_ucx_xfer_begin(ep, &x, &err));
    for (size_t off = 0; off < len; off += MIB) CHECK(!k3_ucx_get(x, local + off, NULL, MIB, r[0], off, &err));
    const double t0 = k3_now();
    k3_error e = {0};
    CHECK(k3_ucx_xfer_wait(x, 0.5, &e) == K3_ERR_IO);
    const double dt = k3_now() - t0;
    CHECKF(dt >= 0.5 && dt < 5, "the wait took %.2f s", dt);
    CHECKF(strstr(e.msg, "still outstanding after 0.5 s") && strstr(e.msg, "a stalled target"), "%s", e.msg);
    k3_ucx_xfer_cancel(x);
    int done = 0;
    k3_error e2 = {0};
    CHECK(k3_ucx_xfer_test(x, &done, &e2) != K3_OK); /* cancelled: a failure, not a hang */
    k3_error e3 = {0};
    CHECK(k3_ucx_get(x, local, NULL, MIB, r[0], 0, &e3) == K3_ERR_IO);
    CHECKF(strstr(e3.msg, "closed"), "%s", e3.msg);
    k3_ucx_xfer_free(x);
    k3_ucx_region_free(r[0]);
    t.stop = true;
    pthread_join(th, NULL);
    k3_ucx_ep_close(ep, 0.5);
    k3_ucx_close(u);
    close(sv[0]);
    close(sv[1]);
    free(local);
    free(t.mem);
}

/* Two processes: the child offers a region, serves, and checks what the
 * parent put; with die set it exits after the handshake, mid-transfer. */
static int child(int fd, size_t len, bool die) {
    unsigned char *mem = malloc(len);
    if (!mem) return 1;
    fill(mem, len, 3);
    k3_error err = {0};
    k3_ucx *u = NULL;
    k3_ucx_mem *m = NULL;
    k3_ucx_ep *ep = NULL;
    k3_ucx_region *r[1];
    int n = 0;
    k3_ucx_sock sk = {fd, 10};
    const k3_ucx_chan ch = k3_ucx_chan_socket(&sk);
    if (k3_ucx_open(&u, &(k3_ucx_options){.tls = "tcp"}, &err) || k3_ucx_mem_register(u, mem, len, &m, &err) ||
        k3_ucx_handshake(u, &ch, "the parent", &m, 1, &ep, r, 1, &n, &err))
        return 2;
    if (die) { /* once the parent's gets are posted (its byte), without serving one */
        char go;
        if (read(fd, &go, 1) != 1) return 4;
        _exit(0);
    }
    volatile bool stop = false;
    /* serve until the parent says its puts are done (one byte), then answer the checksum */
    char c;
    for (;;) {
        k3_ucx_serve(u, 0.01, &stop);
        if (recv(fd, &c, 1, MSG_DONTWAIT) == 1) break;
    }
    fill(mem + len / 2, len - len / 2, 4); /* what the parent put over the second half */
    const uint64_t h = fnv(mem, len);
    if (write(fd, &h, sizeof h) != (ssize_t)sizeof h) return 3;
    k3_ucx_serve(u, 0.2, NULL);
    k3_ucx_ep_close(ep, 1);
    k3_ucx_mem_free(m);
    k3_ucx_close(u);
    return 0;
}

static void two_processes(bool die) {
    if (skip_without_ucx()) return;
    const size_t len = 8 * MIB;
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    fflush(stdout);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        _exit(child(sv[1], len, die));
    }
    close(sv[1]);
    unsigned char *local = malloc(len), *want = malloc(len);
    REQUIRE(local && want);
    fill(want, len, 3);
    k3_error err = {0};
    k3_ucx *u = NULL;
    k3_ucx_ep *ep = NULL;
    k3_ucx_region *r[1] = {NULL};
    int n = 0;
    k3_ucx_sock sk = {sv[0], 10};
    const k3_ucx_chan ch = k3_ucx_chan_socket(&sk);
    k3_status s = k3_ucx_open(&u, &(k3_ucx_options){.tls = "tcp"}, &err);
    if (!s) s = k3_ucx_handshake(u, &ch, "the child", NULL, 0, &ep, r, 1, &n, &err);
    CHECKF(!s && n == 1, "%s", err.msg);
    k3_ucx_xfer *x = NULL;
    if (!s) s = k3_ucx_xfer_begin(ep, &x, &err);
    for (size_t off = 0; !s && off < len; off += MIB) s = k3_ucx_get(x, local + off, NULL, MIB, r[0], off, &err);
    if (die) CHECK(write(sv[0], "g", 1) == 1);
    const double t0 = k3_now();
    if (!s) s = k3_ucx_xfer_wait(x, 20, &err);
    if (die) {
        /* the child is gone: the gets fail with UCX's reason, well before the deadline */
        CHECK(s == K3_ERR_IO);
        CHECKF(k3_now() - t0 < 15, "the failure took %.1f s", k3_now() - t0);
        CHECKF(strstr(err.msg, "the child") && !strstr(err.msg, "outstanding after"), "%s", err.msg);
    } else {
        CHECKF(!s, "%s", err.msg);
        CHECK(fnv(local, len) == fnv(want, len));
        k3_ucx_xfer_free(x);
        x = NULL;
        /* puts over the second half; the child checks its memory */
        fill(local + len / 2, len - len / 2, 4);
        s = k3_ucx_xfer_begin(ep, &x, &err);
        if (!s) s = k3_ucx_put(x, local + len / 2, NULL, len - len / 2, r[0], len / 2, &err);
        if (!s) s = k3_ucx_xfer_wait(x, 20, &err);
        CHECKF(!s, "%s", err.msg);
        uint64_t h = 0;
        CHECK(write(sv[0], "d", 1) == 1);
        k3_ucx_sock sk2 = {sv[0], 10};
        const k3_ucx_chan ch2 = k3_ucx_chan_socket(&sk2);
        CHECK(!ch2.recv(ch2.ctx, &h, sizeof h, &err));
        CHECKF(h == fnv(local, len), "the child's checksum after the puts differs");
    }
    k3_ucx_xfer_free(x);
    if (n == 1) k3_ucx_region_free(r[0]);
    k3_ucx_ep_close(ep, 1);
    k3_ucx_close(u);
    int st = 0;
    waitpid(pid, &st, 0);
    CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d", st);
    close(sv[0]);
    free(local);
    free(want);
}

K3_TEST(ucx_two_processes_get_put) { two_processes(false); }
K3_TEST(ucx_peer_dies_mid_transfer) { two_processes(true); }
