/*
 * wire.c -- the transfer stream's control messages, its TCP bulk transport
 * and its sockets (wire.h).
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

_Static_assert(sizeof(k3_pd_ident) == 40, "k3_pd_ident is 40 bytes on the wire");
_Static_assert(sizeof(k3_pd_hello) == 72, "k3_pd_hello is 72 bytes on the wire");
_Static_assert(sizeof(k3_pd_req) == 136, "k3_pd_req is 136 bytes on the wire");
_Static_assert(sizeof(k3_pd_unit) == 72, "k3_pd_unit is 72 bytes on the wire");
_Static_assert(sizeof(k3_pd_ucx_offer) == 40, "k3_pd_ucx_offer is 40 bytes on the wire");
_Static_assert(sizeof(k3_pd_ucx_array) == 24, "k3_pd_ucx_array is 24 bytes on the wire");

/* ---- control messages ------------------------------------------------------------- */

k3_status k3_pd_req_send(int fd, k3_pd_session *s, k3_pd_req *r, k3_error *err) {
    memcpy(r->magic, "K3PD", 4);
    r->version = K3_PD_VERSION;
    k3_pd_tag(&s->tx, 0, r, offsetof(k3_pd_req, tag), NULL, 0, r->tag);
    return k3_pd_send(fd, r, sizeof *r, NULL, 0, "the request", err);
}

k3_status k3_pd_req_recv(int fd, k3_pd_session *s, k3_pd_req *r, k3_error *err) {
    K3_TRY(k3_pd_recv(fd, r, sizeof *r, "the request", err));
    if (memcmp(r->magic, "K3PD", 4) || r->version != K3_PD_VERSION ||
        !k3_pd_tag_ok(&s->rx, 0, r, offsetof(k3_pd_req, tag), NULL, 0, r->tag))
        return k3_err(err, K3_ERR_PERM, "kv transfer: a request whose MAC does not match (damaged or forged)");
    return K3_OK;
}

k3_status k3_pd_unit_send(int fd, k3_pd_session *s, uint64_t seq, k3_pd_unit *u, k3_error *err) {
    memcpy(u->magic, "K3KV", 4);
    u->version = K3_PD_VERSION;
    k3_pd_tag(&s->tx, seq, u, offsetof(k3_pd_unit, tag), NULL, 0, u->tag);
    return k3_pd_send(fd, u, sizeof *u, NULL, 0, "a unit header", err);
}

k3_status k3_pd_unit_recv(int fd, k3_pd_session *s, uint64_t seq, k3_pd_unit *u, k3_error *err) {
    K3_TRY(k3_pd_recv(fd, u, sizeof *u, "a unit header", err));
    if (memcmp(u->magic, "K3KV", 4) || u->version != K3_PD_VERSION ||
        !k3_pd_tag_ok(&s->rx, seq, u, offsetof(k3_pd_unit, tag), NULL, 0, u->tag))
        return k3_err(err, K3_ERR_PERM, "kv transfer: a unit header whose MAC does not match (damaged or forged)");
    return K3_OK;
}

/* ---- the TCP bulk transport: the payload on the connection's own stream ---------------- */

static k3_status tcp_send(k3_pd_bulk *b, const void *buf, size_t n, k3_error *err) {
    return k3_pd_send(b->fd, buf, n, NULL, 0, "a unit's payload", err);
}

static k3_status tcp_recv(k3_pd_bulk *b, void *buf, size_t n, k3_error *err) {
    return k3_pd_recv(b->fd, buf, n, "a unit's payload", err);
}

void k3_pd_bulk_tcp(k3_pd_bulk *b, int fd) {
    *b = (k3_pd_bulk){.name = "tcp", .send = tcp_send, .recv = tcp_recv, .fd = fd};
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
            if (errno == EPIPE || errno == ECONNRESET) /* a peer that died, or closed its end, before we wrote */
                return k3_err(err, K3_ERR_IO, "kv transfer: the peer closed the connection while sending %s (%s)", what,
                              strerror(errno));
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
            if (errno == ECONNRESET) /* a peer that died with something of ours unread */
                return k3_err(err, K3_ERR_IO,
                              "kv transfer: the peer closed the connection (reset) in %s (%zu of %zu bytes)", what, got,
                              n);
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
