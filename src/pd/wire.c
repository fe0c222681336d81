/*
 * wire.c -- the transfer stream's headers, checksum and sockets (wire.h).
 */
#include "pd/wire.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/error.h"
#include "kernels/kernels.h"

_Static_assert(sizeof(k3_pd_ident) == 40, "k3_pd_ident is 40 bytes on the wire");
_Static_assert(sizeof(k3_pd_req) == 96, "k3_pd_req is 96 bytes on the wire");
_Static_assert(sizeof(k3_pd_unit) == 96, "k3_pd_unit is 96 bytes on the wire");

/* ---- the checksum ----------------------------------------------------------- */

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

#define SUM_P1 0x9E3779B185EBCA87ull
#define SUM_P2 0xC2B2AE3D27D4EB4Full

size_t k3_pd_sum_blocks_ref(const uint8_t *b, size_t n, uint32_t a[K3_PD_SUM_LANES]) {
    size_t i = 0;
    for (; i + K3_PD_SUM_BLOCK <= n; i += K3_PD_SUM_BLOCK)
        for (int j = 0; j < K3_PD_SUM_LANES; j++) {
            uint32_t w;
            memcpy(&w, b + i + 4 * (size_t)j, 4);
            a[j] = rotl32((a[j] ^ w) * K3_PD_SUM_Q, K3_PD_SUM_R);
        }
    return i;
}

/* The lanes' start, then (after the blocks) the lanes and the tail folded
 * into 64 bits: each step a bijection of the running value and of the word
 * it takes, so a change in one lane or one tail byte changes the result. */
static void sum_init(uint32_t a[K3_PD_SUM_LANES], size_t n) {
    for (int j = 0; j < K3_PD_SUM_LANES; j++)
        a[j] = (uint32_t)(j + 1) * 0x85EBCA77u ^ (uint32_t)n ^ (uint32_t)(n >> 32);
}

static uint64_t sum_finish(const uint32_t a[K3_PD_SUM_LANES], const uint8_t *b, size_t m, size_t n) {
    uint64_t h = SUM_P1 ^ n;
    for (int j = 0; j < K3_PD_SUM_LANES; j++) h = rotl(h ^ ((uint64_t)a[j] * SUM_P2), 27) * SUM_P1;
    size_t i = 0;
    for (; i + 8 <= m; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = rotl(h ^ (w * SUM_P2), 27) * SUM_P1 + 0x85EBCA77C2B2AE63ull;
    }
    for (; i < m; i++) h = rotl(h ^ (b[i] * SUM_P1), 11) * SUM_P2;
    h ^= h >> 33;
    h *= SUM_P2;
    h ^= h >> 29;
    return h;
}

uint64_t k3_pd_sum_ref(const void *p, size_t n) {
    const uint8_t *b = p;
    uint32_t a[K3_PD_SUM_LANES];
    sum_init(a, n);
    const size_t i = n ? k3_pd_sum_blocks_ref(b, n, a) : 0;
    return sum_finish(a, b + i, n - i, n);
}

uint64_t k3_pd_sum(const void *p, size_t n) {
    if (n < K3_PD_SUM_BLOCK) return k3_pd_sum_ref(p, n);
    const uint8_t *b = p;
    uint32_t a[K3_PD_SUM_LANES];
    sum_init(a, n);
    const k3_isa isa = k3_kernels_isa();
    const size_t i = isa == K3_ISA_AVX512 ? k3_pd_sum_blocks_avx512(b, n, a)
        : isa == K3_ISA_AVX2              ? k3_pd_sum_blocks_avx2(b, n, a)
                                          : k3_pd_sum_blocks_ref(b, n, a);
    return sum_finish(a, b + i, n - i, n);
}

void k3_pd_req_seal(k3_pd_req *r) {
    memcpy(r->magic, "K3PD", 4);
    r->version = K3_PD_VERSION;
    r->sum = k3_pd_sum(r, offsetof(k3_pd_req, sum));
}

void k3_pd_unit_seal(k3_pd_unit *u) {
    memcpy(u->magic, "K3KV", 4);
    u->version = K3_PD_VERSION;
    u->sum = k3_pd_sum(u, offsetof(k3_pd_unit, sum));
}

bool k3_pd_req_check(const k3_pd_req *r, k3_error *err) {
    if (memcmp(r->magic, "K3PD", 4)) return !k3_err(err, K3_ERR_FORMAT, "kv transfer: not a k3 transfer request");
    if (r->version != K3_PD_VERSION)
        return !k3_err(err, K3_ERR_FORMAT, "kv transfer: protocol version %u, this instance speaks %u", r->version,
                       K3_PD_VERSION);
    if (r->sum != k3_pd_sum(r, offsetof(k3_pd_req, sum)))
        return !k3_err(err, K3_ERR_FORMAT, "kv transfer: a request whose checksum does not match (damaged)");
    return true;
}

bool k3_pd_unit_check(const k3_pd_unit *u, k3_error *err) {
    if (memcmp(u->magic, "K3KV", 4)) return !k3_err(err, K3_ERR_FORMAT, "kv transfer: not a k3 transfer unit");
    if (u->version != K3_PD_VERSION)
        return !k3_err(err, K3_ERR_FORMAT, "kv transfer: protocol version %u, this instance speaks %u", u->version,
                       K3_PD_VERSION);
    if (u->sum != k3_pd_sum(u, offsetof(k3_pd_unit, sum)))
        return !k3_err(err, K3_ERR_FORMAT, "kv transfer: a unit header whose checksum does not match (damaged)");
    return true;
}

void k3_pd_ident_str(const k3_pd_ident *id, char *buf, size_t size) {
    char q[K3_PD_QUANT_LEN + 1];
    memcpy(q, id->quant, K3_PD_QUANT_LEN);
    q[K3_PD_QUANT_LEN] = 0;
    snprintf(buf, size, "model %016llx, quant %s, kv-cache %s, block %d", (unsigned long long)id->model,
             q[0] ? q : "none",
             id->kv == K3_KV_C8        ? "c8"
                 : id->kv == K3_KV_F32 ? "f32"
                                       : "?",
             id->block_size);
}

bool k3_pd_ident_same(const k3_pd_ident *a, const k3_pd_ident *b) {
    return a->model == b->model && a->kv == b->kv && !memcmp(a->quant, b->quant, K3_PD_QUANT_LEN);
}

/* ---- sockets -------------------------------------------------------------------- */

static void set_timeouts(int fd, double timeout_s) {
    struct timeval tv = {(time_t)timeout_s, (suseconds_t)((timeout_s - (double)(time_t)timeout_s) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

void k3_pd_socket_setup(int fd, double timeout_s) {
    set_timeouts(fd, timeout_s);
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int k3_pd_connect(const char *host, int port, double timeout_s, k3_error *err) {
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    const int gai = getaddrinfo(host, ps, &hints, &res);
    if (gai) {
        k3_err(err, K3_ERR_IO, "kv transfer: cannot resolve %s: %s", host, gai_strerror(gai));
        return -1;
    }
    int fd = -1, last = 0;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        const int fl = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
        int rc = connect(fd, a->ai_addr, a->ai_addrlen);
        if (rc && errno == EINPROGRESS) {
            struct pollfd p = {fd, POLLOUT, 0};
            rc = poll(&p, 1, (int)(timeout_s * 1000)) == 1 ? 0 : -1;
            int so = 0;
            socklen_t sl = sizeof so;
            if (!rc && (getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl) || so)) {
                errno = so ? so : errno;
                rc = -1;
            } else if (rc) {
                errno = ETIMEDOUT;
            }
        }
        if (rc) {
            last = errno;
            close(fd);
            fd = -1;
            continue;
        }
        fcntl(fd, F_SETFL, fl);
        k3_pd_socket_setup(fd, timeout_s);
    }
    freeaddrinfo(res);
    if (fd < 0) k3_err(err, K3_ERR_IO, "kv transfer: cannot connect to %s:%d: %s", host, port, strerror(last));
    return fd;
}

k3_status k3_pd_send(int fd, const void *a, size_t na, const void *b, size_t nb, const char *what, k3_error *err) {
    struct iovec iov[2] = {{(void *)a, na}, {(void *)b, nb}};
    int i = 0;
    while (i < 2) {
        if (iov[i].iov_len == 0) {
            i++;
            continue;
        }
        struct msghdr mh = {.msg_iov = iov + i, .msg_iovlen = (size_t)(2 - i)};
        const ssize_t s = sendmsg(fd, &mh, MSG_NOSIGNAL);
        if (s < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return k3_err(err, K3_ERR_IO, "kv transfer: the peer took nothing of %s within the timeout", what);
            return k3_err(err, K3_ERR_IO, "kv transfer: sending %s: %s", what, strerror(errno));
        }
        size_t left = (size_t)s;
        while (i < 2 && left >= iov[i].iov_len) left -= iov[i++].iov_len;
        if (i < 2) {
            iov[i].iov_base = (char *)iov[i].iov_base + left;
            iov[i].iov_len -= left;
        }
    }
    return K3_OK;
}

k3_status k3_pd_recv(int fd, void *buf, size_t n, const char *what, k3_error *err) {
    size_t got = 0;
    while (got < n) {
        const ssize_t r = recv(fd, (char *)buf + got, n - got, 0);
        if (r == 0)
            return k3_err(err, K3_ERR_IO, "kv transfer: the peer closed the connection in %s (%zu of %zu bytes)", what,
                          got, n);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return k3_err(err, K3_ERR_IO, "kv transfer: the peer sent nothing within the timeout in %s", what);
            return k3_err(err, K3_ERR_IO, "kv transfer: receiving %s: %s", what, strerror(errno));
        }
        got += (size_t)r;
    }
    return K3_OK;
}

int k3_pd_listen(const char *host, int port, int *port_out, k3_error *err) {
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *res = NULL;
    const int gai = getaddrinfo(host, ps, &hints, &res);
    if (gai) {
        k3_err(err, K3_ERR_IO, "kv transfer: cannot resolve %s: %s", host, gai_strerror(gai));
        return -1;
    }
    int fd = -1, last = 0;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        const int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) || listen(fd, 64)) {
            last = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0) {
        k3_err(err, K3_ERR_IO, "kv transfer: cannot listen on %s:%d: %s", host, port, strerror(last));
        return -1;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    *port_out = port;
    if (!getsockname(fd, (struct sockaddr *)&ss, &sl))
        *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                             : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    return fd;
}
