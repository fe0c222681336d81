/*
 * ucxbench.c -- developer tool: one-sided UCX gets (src/comm/ucx) against a
 * plain TCP stream of the same bytes, memory to memory in 1 MiB units (the
 * unit of the prefill -> decode transfer; the TCP stream is bench/tcpcopy's:
 * a 96-byte header and 1 MiB per sendmsg).
 *
 *   ucxbench local [--bytes N] [--runs R] [--tls LIST]
 *       one host: a forked target process offers N bytes; this process gets
 *       them with each transport list of LIST (default "sm;cma,sysv;posix,sysv;tcp":
 *       all shared memory; cross-memory attach or a shared mapping for the
 *       gets, with sysv's messages beside them; tcp over loopback),
 *       and copies them over a loopback TCP stream: R rounds, each running
 *       the TCP stream and then every list (alternated, so a change of the
 *       machine's state meets all alike); medians, and each list's median
 *       ratio to the TCP stream of the same round
 *   ucxbench serve --bind ADDR[:PORT]
 *       the target across hosts: offers --bytes, answers a client's runs until
 *       it is killed or the client sends a stop
 *   ucxbench get --connect ADDR:PORT [--bytes N] [--runs R] [--tls LIST] [--check] [--stop]
 *       the initiator across hosts: UCX gets with each list, then the TCP stream
 *
 * --check verifies every run's bytes against the target's pattern (a
 * checksum of the whole region); a difference is an error (exit 1). The
 * region is filled and touched before any run, so no page fault is timed;
 * a UCX run's time is from the first get posted to the last completed (the
 * handshake apart, printed once), a TCP run's from the request to the last
 * byte received.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/ucx.h"
#include "common/error.h"
#include "k3.h"

#define UNIT (1u << 20)

typedef struct cmd {
    uint32_t magic; /* "K3UB" */
    uint32_t op;    /* 'U' a UCX run, 'T' a TCP stream, 'S' stop */
    uint64_t bytes;
    char tls[64];
} cmd;
#define CMD_MAGIC 0x4255334bu

static uint64_t fnv(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static void fill(unsigned char *p, size_t n) {
    uint64_t *q = (uint64_t *)p;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < n / 8; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        q[i] = x;
    }
    for (size_t i = n / 8 * 8; i < n; i++) p[i] = (unsigned char)i;
}

static int full(int fd, void *buf, size_t n, bool out) {
    for (size_t k = 0; k < n;) {
        const ssize_t r = out ? send(fd, (char *)buf + k, n - k, MSG_NOSIGNAL) : recv(fd, (char *)buf + k, n - k, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        k += (size_t)r;
    }
    return 0;
}

static int cmpd(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ---- the target: one connection's command --------------------------------------------------------- */

static int serve_one(int fd, unsigned char *region, size_t len) {
    cmd c;
    if (full(fd, &c, sizeof c, false) || c.magic != CMD_MAGIC || c.bytes > len) return -1;
    c.tls[sizeof c.tls - 1] = 0;
    if (c.op == 'S') return 1;
    if (c.op == 'T') { /* the TCP stream: header + 1 MiB units */
        char hdr[96] = {0};
        for (uint64_t off = 0; off < c.bytes; off += UNIT) {
            const size_t n = c.bytes - off < UNIT ? (size_t)(c.bytes - off) : UNIT;
            struct iovec iov[2] = {{hdr, sizeof hdr}, {region + off, n}};
            struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
            size_t left = sizeof hdr + n;
            while (left) {
                const ssize_t s = sendmsg(fd, &mh, MSG_NOSIGNAL);
                if (s <= 0) return -1;
                left -= (size_t)s;
                size_t l = (size_t)s;
                while (mh.msg_iovlen && l >= mh.msg_iov[0].iov_len) {
                    l -= mh.msg_iov[0].iov_len;
                    mh.msg_iov++;
                    mh.msg_iovlen--;
                }
                if (mh.msg_iovlen) {
                    mh.msg_iov[0].iov_base = (char *)mh.msg_iov[0].iov_base + l;
                    mh.msg_iov[0].iov_len -= l;
                }
            }
        }
        return 0;
    }
    /* a UCX run: offer the region, serve until the client's byte */
    k3_error err = {0};
    k3_ucx *u = NULL;
    k3_ucx_mem *m = NULL;
    k3_ucx_ep *ep = NULL;
    k3_ucx_region *r[1];
    int n = 0;
    k3_ucx_sock sk = {fd, 30};
    const k3_ucx_chan ch = k3_ucx_chan_socket(&sk);
    k3_ucx_options o = {.tls = c.tls[0] ? c.tls : NULL,
                        .name = "ucxbench-target",
                        .no_peer_errors = !strstr(c.tls, "tcp")};
    if (k3_ucx_open(&u, &o, &err) || k3_ucx_mem_register(u, region, (size_t)c.bytes, &m, &err) ||
        k3_ucx_handshake(u, &ch, "the initiator", &m, 1, &ep, r, 1, &n, &err)) {
        fprintf(stderr, "ucxbench: target: %s\n", err.msg);
        k3_ucx_mem_free(m);
        k3_ucx_close(u);
        return -1;
    }
    char done = 0;
    for (;;) {
        k3_ucx_serve(u, 0.002, NULL);
        const ssize_t k = recv(fd, &done, 1, MSG_DONTWAIT);
        if (k == 1 || k == 0 || (k < 0 && errno != EAGAIN)) break;
    }
    k3_ucx_ep_close(ep, 1);
    k3_ucx_mem_free(m);
    k3_ucx_close(u);
    return 0;
}

/* ---- the initiator ---------------------------------------------------------------------------------- */

typedef struct opts {
    uint64_t bytes;
    int runs;
    bool check;
    uint64_t want; /* the region's checksum */
} opts;

static int dial(const char *host, int port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) return -1;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* One UCX run on a fresh connection: GB/s, or < 0 on failure. */
static double ucx_run(const char *host, int port, const char *tls, const opts *o, unsigned char *local, double *hs_s) {
    const int fd = dial(host, port);
    if (fd < 0) {
        fprintf(stderr, "ucxbench: cannot connect to %s:%d: %s\n", host, port, strerror(errno));
        return -1;
    }
    cmd c = {CMD_MAGIC, 'U', o->bytes, {0}};
    snprintf(c.tls, sizeof c.tls, "%s", tls);
    double gbps = -1;
    k3_error err = {0};
    k3_ucx *u = NULL;
    k3_ucx_mem *lm = NULL;
    k3_ucx_ep *ep = NULL;
    k3_ucx_region *r[1] = {NULL};
    k3_ucx_xfer *x = NULL;
    int n = 0;
    k3_ucx_sock sk = {fd, 30};
    const k3_ucx_chan ch = k3_ucx_chan_socket(&sk);
    k3_ucx_options uo = {.tls = tls, .name = "ucxbench", .no_peer_errors = !strstr(tls, "tcp")};
    const double h0 = k3_now();
    k3_status s = full(fd, &c, sizeof c, true) ? k3_err(&err, K3_ERR_IO, "sending the command") : K3_OK;
    if (!s) s = k3_ucx_open(&u, &uo, &err);
    if (!s) s = k3_ucx_mem_register(u, local, (size_t)o->bytes, &lm, &err);
    if (!s) s = k3_ucx_handshake(u, &ch, "the target", NULL, 0, &ep, r, 1, &n, &err);
    *hs_s = k3_now() - h0;
    if (!s) s = k3_ucx_xfer_begin(ep, &x, &err);
    memset(local, 0, (size_t)o->bytes);
    const double t0 = k3_now();
    for (uint64_t off = 0; !s && off < o->bytes; off += UNIT) {
        const size_t k = o->bytes - off < UNIT ? (size_t)(o->bytes - off) : UNIT;
        s = k3_ucx_get(x, local + off, lm, k, r[0], off, &err);
    }
    if (!s) s = k3_ucx_xfer_wait(x, 120, &err);
    const double dt = k3_now() - t0;
    if (!s) gbps = (double)o->bytes / dt / 1e9;
    else fprintf(stderr, "ucxbench: %s: %s\n", tls, err.msg);
    if (!s && o->check && fnv(local, (size_t)o->bytes) != o->want) {
        fprintf(stderr, "ucxbench: %s: the bytes got differ from the target's (checksum)\n", tls);
        gbps = -2;
    }
    k3_ucx_xfer_free(x);
    if (n) k3_ucx_region_free(r[0]);
    (void)!write(fd, "d", 1);
    k3_ucx_ep_close(ep, 1);
    k3_ucx_mem_free(lm);
    k3_ucx_close(u);
    close(fd);
    return gbps;
}

static double tcp_run(const char *host, int port, const opts *o, unsigned char *local) {
    const int fd = dial(host, port);
    if (fd < 0) return -1;
    cmd c = {CMD_MAGIC, 'T', o->bytes, {0}};
    char hdr[96];
    memset(local, 0, (size_t)o->bytes);
    const double t0 = k3_now();
    if (full(fd, &c, sizeof c, true)) return -1;
    for (uint64_t off = 0; off < o->bytes; off += UNIT) {
        const size_t k = o->bytes - off < UNIT ? (size_t)(o->bytes - off) : UNIT;
        if (full(fd, hdr, sizeof hdr, false) || full(fd, local + off, k, false)) {
            close(fd);
            return -1;
        }
    }
    const double dt = k3_now() - t0;
    close(fd);
    if (o->check && fnv(local, (size_t)o->bytes) != o->want) {
        fprintf(stderr, "ucxbench: tcp: the bytes got differ from the target's (checksum)\n");
        return -2;
    }
    return (double)o->bytes / dt / 1e9;
}

static void report(const char *what, double *g, int runs, double *median) {
    qsort(g, (size_t)runs, sizeof *g, cmpd);
    *median = runs % 2 ? g[runs / 2] : 0.5 * (g[runs / 2 - 1] + g[runs / 2]);
    printf("  %-22s %7.2f GB/s  (median of %d; min %.2f, max %.2f)\n", what, *median, runs, g[0], g[runs - 1]);
}

/* Rounds of runs, alternated: in each round the TCP stream, then every list
 * of tls, so a change of the machine's state meets every transport alike.
 * Each transport's median GB/s, and each list's median of its per-round
 * ratio to the TCP stream (paired). 0, or 1 when a run failed. */
enum { MAX_LISTS = 8 };
static double median_of(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmpd);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int initiate(const char *host, int port, const char *tls_lists, const opts *o) {
    char lists[256], *name[MAX_LISTS];
    snprintf(lists, sizeof lists, "%s", tls_lists);
    int nl = 0;
    for (char *save = NULL, *t = strtok_r(lists, ";", &save); t && nl < MAX_LISTS; t = strtok_r(NULL, ";", &save))
        name[nl++] = t;
    const size_t R = (size_t)o->runs;
    unsigned char *local = malloc((size_t)o->bytes);
    double *g = calloc((size_t)(nl + 1) * R, sizeof(double)); /* row 0: tcp; row 1 + l: list l */
    double *ratio = calloc(R, sizeof(double)), hs[MAX_LISTS] = {0};
    bool bad[MAX_LISTS] = {false};
    int rc = 1;
    if (!local || !g || !ratio) goto out;
    memset(local, 1, (size_t)o->bytes);
    printf("%llu bytes from %s:%d, memory to memory, 1 MiB units, %d rounds alternating the transports%s\n",
           (unsigned long long)o->bytes, host, port, o->runs, o->check ? ", every run checked" : "");
    rc = 0;
    for (size_t r = 0; r < R; r++) {
        g[r] = tcp_run(host, port, o, local);
        if (g[r] < 0) {
            fprintf(stderr, "ucxbench: the TCP stream failed\n");
            rc = 1;
            goto out;
        }
        for (int l = 0; l < nl; l++) {
            double *gl = g + (size_t)(1 + l) * R;
            if (bad[l]) continue;
            gl[r] = ucx_run(host, port, name[l], o, local, &hs[l]);
            bad[l] = gl[r] < 0;
        }
    }
    double paired[MAX_LISTS] = {0}, tcp_copy[256];
    for (int l = 0; l < nl; l++) {
        if (bad[l]) continue;
        for (size_t r = 0; r < R; r++) ratio[r] = g[(size_t)(1 + l) * R + r] / g[r];
        paired[l] = median_of(ratio, o->runs);
    }
    memcpy(tcp_copy, g, sizeof(double) * (R < 256 ? R : 256));
    double med;
    report("tcp stream", tcp_copy, o->runs, &med);
    for (int l = 0; l < nl; l++) {
        char what[96];
        snprintf(what, sizeof what, "ucx get (%s)", name[l]);
        if (bad[l]) {
            rc = 1;
            printf("  %-22s failed\n", what);
            continue;
        }
        report(what, g + (size_t)(1 + l) * R, o->runs, &med);
        printf("  %-22s %7.2fx the TCP stream (median of the paired ratios; handshake %.1f ms)\n", "", paired[l],
               hs[l] * 1e3);
    }
out:
    free(local);
    free(g);
    free(ratio);
    return rc;
}

static int listen_on(const char *host, int port, int *bound) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) return -1;
    const int l = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    socklen_t al = sizeof a;
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 8) || getsockname(l, (struct sockaddr *)&a, &al)) {
        close(l);
        return -1;
    }
    *bound = ntohs(a.sin_port);
    return l;
}

static int serve_loop(int l, unsigned char *region, size_t len) {
    for (;;) {
        const int fd = accept(l, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR) continue;
            return 1;
        }
        const int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        const int r = serve_one(fd, region, len);
        close(fd);
        if (r == 1) return 0;
    }
}

static int usage(void) {
    fprintf(stderr,
            "usage: ucxbench local|serve|get [--bytes N] [--runs R] [--tls 'L1;L2'] [--bind ADDR[:PORT]]\n"
            "                [--connect ADDR:PORT] [--check] [--stop]\n");
    return 2;
}

int main(int argc, char **argv) {
    if (argc < 2) return usage();
    const char *mode = argv[1], *tls = "sm;cma,sysv;posix,sysv;tcp", *bind_to = "127.0.0.1", *conn = NULL;
    opts o = {.bytes = 256ull << 20, .runs = 5};
    bool stop = false;
    for (int i = 2; i < argc; i++) {
        const bool has = i + 1 < argc;
        if (!strcmp(argv[i], "--bytes") && has) o.bytes = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--runs") && has) o.runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tls") && has) tls = argv[++i];
        else if (!strcmp(argv[i], "--bind") && has) bind_to = argv[++i];
        else if (!strcmp(argv[i], "--connect") && has) conn = argv[++i];
        else if (!strcmp(argv[i], "--check")) o.check = true;
        else if (!strcmp(argv[i], "--stop")) stop = true;
        else return usage();
    }
    if (o.bytes < 1 || o.bytes > (64ull << 30) || o.runs < 1 || o.runs > 101) return usage();
    if (!k3_ucx_available()) {
        printf("ucxbench: skipped: this build has no UCX (libucx-dev)\n");
        return 0;
    }
    signal(SIGPIPE, SIG_IGN);
    unsigned char *region = NULL;
    if (strcmp(mode, "get")) {
        region = malloc((size_t)o.bytes);
        if (!region) return 1;
        fill(region, (size_t)o.bytes);
    }
    if (!strcmp(mode, "local")) {
        int port = 0;
        const int l = listen_on("127.0.0.1", 0, &port);
        if (l < 0) return 1;
        fflush(stdout);
        const pid_t pid = fork();
        if (pid == 0) _exit(serve_loop(l, region, (size_t)o.bytes));
        close(l);
        o.want = fnv(region, (size_t)o.bytes);
        free(region);
        const int rc = initiate("127.0.0.1", port, tls, &o);
        const int fd = dial("127.0.0.1", port);
        cmd c = {CMD_MAGIC, 'S', 0, {0}};
        if (fd >= 0) (void)!full(fd, &c, sizeof c, true);
        if (fd >= 0) close(fd);
        waitpid(pid, NULL, 0);
        return rc;
    }
    if (!strcmp(mode, "serve")) {
        char host[64];
        snprintf(host, sizeof host, "%s", bind_to);
        char *colon = strchr(host, ':');
        const int want = colon ? atoi(colon + 1) : 0;
        if (colon) *colon = 0;
        int port = 0;
        const int l = listen_on(host, want, &port);
        if (l < 0) {
            fprintf(stderr, "ucxbench: cannot listen on %s\n", bind_to);
            return 1;
        }
        printf("ucxbench: serving %llu bytes on %s:%d\n", (unsigned long long)o.bytes, host, port);
        fflush(stdout);
        return serve_loop(l, region, (size_t)o.bytes);
    }
    if (!strcmp(mode, "get") && conn) {
        char host[64];
        snprintf(host, sizeof host, "%s", conn);
        char *colon = strchr(host, ':');
        if (!colon) return usage();
        *colon = 0;
        const int port = atoi(colon + 1);
        unsigned char *ref = malloc((size_t)o.bytes);
        if (!ref) return 1;
        fill(ref, (size_t)o.bytes);
        o.want = fnv(ref, (size_t)o.bytes);
        free(ref);
        const int rc = initiate(host, port, tls, &o);
        if (stop) {
            const int fd = dial(host, port);
            cmd c = {CMD_MAGIC, 'S', 0, {0}};
            if (fd >= 0) (void)!full(fd, &c, sizeof c, true);
            if (fd >= 0) close(fd);
        }
        return rc;
    }
    return usage();
}
