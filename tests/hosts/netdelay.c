/*
 * netdelay.c -- a delay line for the test hosts' links where the kernel has
 * no netem qdisc (tests/hosts/lib.sh: shape). An iptables rule in the switch
 * namespace sends what a host puts on the bridge to netfilter queue QUEUE
 * (-j NFQUEUE --queue-num QUEUE --queue-bypass); this program takes each
 * packet's id (metadata only: the packet stays in the kernel, GSO packets
 * whole), holds it DELAY microseconds from its arrival and then accepts it,
 * in order (one batch verdict for every packet that is due). The same
 * constant one-way delay as `netem delay`, with no reordering and no loss
 * (the queue holds up to 1M packets; past that, fail-open passes them on).
 *
 * Usage: k3-netdelay QUEUE DELAY_US
 * Returns once the queue is bound (exit 0, the line running in the
 * background, its own session) or with a message naming the failure
 * (exit 1). SIGTERM: every packet held is accepted, then it ends.
 * Raw netlink (NETLINK_NETFILTER): no library beyond libc.
 */
/* glibc's netinet/in.h before the kernel's headers (it tells linux/in.h what it defined) */
#include <arpa/inet.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RING (1u << 20)

static uint32_t ring_id[RING];
static int64_t ring_due[RING];
static unsigned head, tail;
static volatile sig_atomic_t stopping;
static int fd;
static uint16_t queue;
static uint32_t seq;

static void on_term(int s) {
    (void)s;
    stopping = 1;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* one nfnetlink message for the queue: header, nfgenmsg, then attributes
 * appended by put(); sent with an ACK request when ack is set */
typedef struct {
    char buf[256];
    struct nlmsghdr *h;
} msg;

static void msg_init(msg *m, uint16_t type, int ack) {
    memset(m->buf, 0, sizeof m->buf);
    m->h = (struct nlmsghdr *)m->buf;
    m->h->nlmsg_len = NLMSG_LENGTH(sizeof(struct nfgenmsg));
    m->h->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | type;
    m->h->nlmsg_flags = NLM_F_REQUEST | (ack ? NLM_F_ACK : 0);
    m->h->nlmsg_seq = ++seq;
    struct nfgenmsg *g = NLMSG_DATA(m->h);
    g->nfgen_family = AF_UNSPEC;
    g->version = NFNETLINK_V0;
    g->res_id = htons(queue);
}

static void put(msg *m, uint16_t type, const void *data, uint16_t len) {
    struct nlattr *a = (struct nlattr *)(m->buf + NLMSG_ALIGN(m->h->nlmsg_len));
    a->nla_type = type;
    a->nla_len = NLA_HDRLEN + len;
    memcpy((char *)a + NLA_HDRLEN, data, len);
    m->h->nlmsg_len = NLMSG_ALIGN(m->h->nlmsg_len) + NLA_ALIGN(a->nla_len);
}

static int send_msg(msg *m) {
    struct sockaddr_nl k = {.nl_family = AF_NETLINK};
    for (;;) {
        if (sendto(fd, m->buf, m->h->nlmsg_len, 0, (struct sockaddr *)&k, sizeof k) >= 0) return 0;
        if (errno != EINTR) return -1;
    }
}

/* a configuration message and the kernel's answer to it (0, or its errno) */
static int configure(msg *m, const char *what) {
    if (send_msg(m)) {
        fprintf(stderr, "k3-netdelay: queue %u: %s: send: %s\n", queue, what, strerror(errno));
        return -1;
    }
    char rb[4096];
    for (;;) {
        ssize_t n = recv(fd, rb, sizeof rb, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            fprintf(stderr, "k3-netdelay: queue %u: %s: %s\n", queue, what, strerror(errno));
            return -1;
        }
        for (struct nlmsghdr *h = (struct nlmsghdr *)rb; NLMSG_OK(h, (size_t)n); h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_type != NLMSG_ERROR || h->nlmsg_seq != m->h->nlmsg_seq) continue;
            const struct nlmsgerr *e = NLMSG_DATA(h);
            if (e->error) {
                fprintf(stderr, "k3-netdelay: queue %u: %s: %s\n", queue, what, strerror(-e->error));
                return -1;
            }
            return 0;
        }
    }
}

/* accept every queued packet up to and including id (ids rise in order) */
static void accept_upto(uint32_t id) {
    msg m;
    msg_init(&m, NFQNL_MSG_VERDICT_BATCH, 0);
    struct nfqnl_msg_verdict_hdr v = {.verdict = htonl(NF_ACCEPT), .id = htonl(id)};
    put(&m, NFQA_VERDICT_HDR, &v, sizeof v);
    send_msg(&m); /* a lost verdict: the packet is accepted by the next one (ids below it) */
}

/* what the kernel queued: each packet's id, due DELAY after now */
static void take(const char *rb, ssize_t n, int64_t due) {
    for (const struct nlmsghdr *h = (const struct nlmsghdr *)rb; NLMSG_OK(h, (size_t)n); h = NLMSG_NEXT(h, n)) {
        if (h->nlmsg_type != ((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET)) continue;
        const char *p = (const char *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct nfgenmsg));
        const char *end = (const char *)h + h->nlmsg_len;
        while (p + NLA_HDRLEN <= end) {
            const struct nlattr *a = (const struct nlattr *)p;
            if (a->nla_len < NLA_HDRLEN || p + a->nla_len > end) break;
            if ((a->nla_type & NLA_TYPE_MASK) == NFQA_PACKET_HDR &&
                a->nla_len >= NLA_HDRLEN + sizeof(struct nfqnl_msg_packet_hdr)) {
                const struct nfqnl_msg_packet_hdr *ph = (const void *)(p + NLA_HDRLEN);
                if (tail - head == RING) { /* full: pass the oldest on now */
                    accept_upto(ring_id[head % RING]);
                    head++;
                }
                ring_id[tail % RING] = ntohl(ph->packet_id);
                ring_due[tail % RING] = due;
                tail++;
                break;
            }
            p += NLA_ALIGN(a->nla_len);
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: k3-netdelay QUEUE DELAY_US\n");
        return 2;
    }
    char *e1, *e2;
    const long q = strtol(argv[1], &e1, 10), us = strtol(argv[2], &e2, 10);
    if (*e1 || *e2 || q < 0 || q > 65535 || us < 0 || us > 10000000) {
        fprintf(stderr, "k3-netdelay: bad queue '%s' or delay '%s' (0..65535, 0..10000000 us)\n", argv[1], argv[2]);
        return 2;
    }
    queue = (uint16_t)q;
    const int64_t delay = (int64_t)us * 1000;
    fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
    if (fd < 0) {
        fprintf(stderr, "k3-netdelay: netlink socket: %s\n", strerror(errno));
        return 1;
    }
    struct sockaddr_nl me = {.nl_family = AF_NETLINK};
    if (bind(fd, (struct sockaddr *)&me, sizeof me)) {
        fprintf(stderr, "k3-netdelay: netlink bind: %s\n", strerror(errno));
        return 1;
    }
    int big = 16 << 20, one = 1;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    msg m;
    msg_init(&m, NFQNL_MSG_CONFIG, 1);
    struct nfqnl_msg_config_cmd cmd = {.command = NFQNL_CFG_CMD_BIND};
    put(&m, NFQA_CFG_CMD, &cmd, sizeof cmd);
    if (configure(&m, "bind (is another program on this queue?)")) return 1;
    msg_init(&m, NFQNL_MSG_CONFIG, 1);
    struct nfqnl_msg_config_params par = {.copy_range = htonl(0), .copy_mode = NFQNL_COPY_META};
    put(&m, NFQA_CFG_PARAMS, &par, sizeof par);
    const uint32_t maxlen = htonl(RING), flags = htonl(NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN);
    put(&m, NFQA_CFG_QUEUE_MAXLEN, &maxlen, sizeof maxlen);
    put(&m, NFQA_CFG_FLAGS, &flags, sizeof flags);
    put(&m, NFQA_CFG_MASK, &flags, sizeof flags);
    if (configure(&m, "parameters (metadata, GSO, fail-open)")) return 1;

    /* bound: the caller goes on, the line runs in its own session */
    const pid_t child = fork();
    if (child < 0) {
        fprintf(stderr, "k3-netdelay: fork: %s\n", strerror(errno));
        return 1;
    }
    if (child > 0) return 0;
    setsid();
    for (int i = 3; i < 1024; i++) /* nothing of the caller's stays open here (a lock file, a pipe) */
        if (i != fd) close(i);
    const int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2); /* a caller that reads our output gets its end of file */
        close(null);
    }
    struct sigaction sa = {.sa_handler = on_term};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    static char rb[1 << 20];
    while (!stopping) {
        int64_t t = now_ns();
        /* what is due: one verdict for all of it */
        unsigned last = head;
        while (last != tail && ring_due[last % RING] <= t) last++;
        if (last != head) {
            accept_upto(ring_id[(last - 1) % RING]);
            head = last;
        }
        struct timespec wait = {1, 0}, *wp = &wait;
        if (head != tail) {
            const int64_t d = ring_due[head % RING] - t;
            wait.tv_sec = d / 1000000000;
            wait.tv_nsec = d % 1000000000;
        }
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (ppoll(&pf, 1, wp, NULL) <= 0) continue;
        for (;;) {
            const ssize_t n = recv(fd, rb, sizeof rb, 0);
            if (n <= 0) break;
            take(rb, n, now_ns() + delay);
        }
    }
    if (head != tail) accept_upto(ring_id[(tail - 1) % RING]);
    return 0;
}
