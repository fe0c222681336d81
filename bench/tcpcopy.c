/*
 * tcpcopy.c -- developer tool: the plain loopback TCP copy the prefill ->
 * decode transfer (src/pd) is held against. One thread sends BYTES in units
 * of a 96-byte header + 1 MiB (as the transfer does, one sendmsg each), the
 * other receives them, nothing else: no checksum, no copy into a cache. With
 * `mem` the bytes are sent from a source region of BYTES and received into a
 * destination region of BYTES (memory to memory, as a cache's rows travel:
 * they lie in DRAM on both sides); without it one 1 MiB buffer is sent again
 * and again and received into another (the socket path alone). Prints the
 * median GB/s of RUNS runs.
 *     build/tcpcopy [BYTES (default 256 MiB)] [RUNS (default 5)] [mem]
 */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define UNIT (1 << 20)

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    int fd;
    long long bytes;
    char *src; /* BYTES to send, or NULL: one unit again and again */
} job;

static void *sender(void *arg) {
    job *j = arg;
    char hdr[96] = {0};
    char *buf = malloc(UNIT);
    memset(buf, 7, UNIT);
    for (long long left = j->bytes; left > 0;) {
        const size_t n = left < UNIT ? (size_t)left : UNIT;
        char *from = j->src ? j->src + (j->bytes - left) : buf;
        struct iovec iov[2] = {{hdr, sizeof hdr}, {from, n}};
        int i = 0;
        while (i < 2) {
            struct msghdr mh = {.msg_iov = iov + i, .msg_iovlen = (size_t)(2 - i)};
            const ssize_t s = sendmsg(j->fd, &mh, MSG_NOSIGNAL);
            if (s <= 0) {
                perror("send");
                exit(1);
            }
            size_t l = (size_t)s;
            while (i < 2 && l >= iov[i].iov_len) l -= iov[i++].iov_len;
            if (i < 2) {
                iov[i].iov_base = (char *)iov[i].iov_base + l;
                iov[i].iov_len -= l;
            }
        }
        left -= (long long)n;
    }
    free(buf);
    return NULL;
}

static void recv_all(int fd, char *buf, size_t n) {
    for (size_t got = 0; got < n;) {
        const ssize_t r = recv(fd, buf + got, n - got, 0);
        if (r <= 0) {
            perror("recv");
            exit(1);
        }
        got += (size_t)r;
    }
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const long long bytes = argc > 1 ? atoll(argv[1]) : 256LL << 20;
    const int runs = argc > 2 ? atoi(argv[2]) : 5;
    const int mem = argc > 3 && !strcmp(argv[3], "mem");
    if (bytes < 1 || runs < 1 || runs > 100) {
        fprintf(stderr, "usage: tcpcopy [BYTES] [RUNS]\n");
        return 2;
    }
    double gbps[100];
    char *buf = malloc(UNIT), hdr[96];
    char *src = mem ? malloc((size_t)bytes) : NULL, *dst = mem ? malloc((size_t)bytes) : NULL;
    if (mem && (!src || !dst)) {
        fprintf(stderr, "tcpcopy: out of memory\n");
        return 1;
    }
    if (mem) { /* touched, so no page fault is timed */
        memset(src, 5, (size_t)bytes);
        memset(dst, 6, (size_t)bytes);
    }
    for (int r = 0; r < runs; r++) {
        const int l = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t al = sizeof a;
        if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1) || getsockname(l, (struct sockaddr *)&a, &al)) {
            perror("listen");
            return 1;
        }
        const int c = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(c, (struct sockaddr *)&a, sizeof a)) {
            perror("connect");
            return 1;
        }
        const int s = accept(l, NULL, NULL);
        const int one = 1;
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        job j = {c, bytes, src};
        pthread_t t;
        const double t0 = now();
        pthread_create(&t, NULL, sender, &j);
        for (long long left = bytes; left > 0;) {
            const size_t n = left < UNIT ? (size_t)left : UNIT;
            recv_all(s, hdr, sizeof hdr);
            recv_all(s, dst ? dst + (bytes - left) : buf, n);
            left -= (long long)n;
        }
        const double dt = now() - t0;
        pthread_join(t, NULL);
        gbps[r] = (double)bytes / dt / 1e9;
        close(s);
        close(c);
        close(l);
    }
    qsort(gbps, (size_t)runs, sizeof *gbps, cmp);
    printf("loopback TCP copy%s: %lld bytes in 1 MiB units, median of %d runs: %.2f GB/s (min %.2f, max %.2f)\n",
           mem ? " (memory to memory)" : "", bytes, runs, gbps[runs / 2], gbps[0], gbps[runs - 1]);
    free(buf);
    free(src);
    free(dst);
    return 0;
}
