/*
 * wire.h -- the transfer stream between a prefill and a decode instance
 * (wire.c): its two message kinds, their checksum, and the socket calls with
 * deadlines. docs/pd.md has the protocol.
 *
 * The decode side connects to the prefill side's transfer port and sends
 * one request (k3_pd_req): PULL a hold's positions [from, to) and its KDA
 * state, or RELEASE a hold nobody will read. The prefill side answers a
 * PULL with units (k3_pd_unit + payload): LAYER units (one MLA/DSA layer's
 * rows for a run of positions, in the transfer layout of src/ctx/ctx.h,
 * layer after layer), STATE units (pieces of the KDA state, in order), then
 * END; or one ERROR unit whose payload says why. Every header carries the
 * sender's identity (model, quantization, cache format, block size), the
 * payload's length and checksum, and its own checksum. Both ends are little
 * endian x86-64: the structs go on the wire as they lie in memory.
 */
#ifndef K3_PD_WIRE_H
#define K3_PD_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "k3.h"

#define K3_PD_VERSION 1
#define K3_PD_QUANT_LEN 24

enum { K3_PD_PULL = 1, K3_PD_RELEASE = 2 };
enum { K3_PD_LAYER = 1, K3_PD_STATE = 2, K3_PD_END = 3, K3_PD_ERROR = 4 };

/* What an instance runs: two instances exchange caches only when the
 * model, quant and kv fields agree (the block size may differ: units
 * address positions, not blocks). */
typedef struct k3_pd_ident {
    uint64_t model;              /* k3_model_identity */
    char quant[K3_PD_QUANT_LEN]; /* --quant's mode, NUL-padded */
    uint32_t kv;                 /* k3_kv_type */
    int32_t block_size;
} k3_pd_ident;

typedef struct k3_pd_req {
    char magic[4]; /* "K3PD" */
    uint16_t version, op;
    uint64_t hold;    /* remote_request_id */
    k3_pd_ident id;   /* the decode side's */
    int64_t from, to; /* positions wanted */
    int64_t max_unit; /* payload bytes per unit at most */
    uint64_t engine;  /* the decode instance's engine id (for messages) */
    uint64_t sum;     /* of the bytes before it */
} k3_pd_req;

typedef struct k3_pd_unit {
    char magic[4]; /* "K3KV" */
    uint16_t version, kind;
    k3_pd_ident id; /* the prefill side's */
    int32_t layer, pad;
    int64_t t0; /* LAYER: first position; STATE: byte offset; END: units before it */
    int64_t n;  /* LAYER: positions; STATE: bytes */
    uint64_t payload_bytes, payload_sum;
    uint64_t sum; /* of the bytes before it */
} k3_pd_unit;

/* A 64-bit checksum of n bytes: 64 lanes of 32 bits, each taking every 64th
 * word of 256-byte blocks (lane = rotl32((lane ^ word) * Q, R), a bijection
 * of the lane and of the word), then the lanes and the tail folded into 64
 * bits the same way: any one damaged word changes it. The vector forms
 * (sum_avx2.c, sum_avx512.c, chosen like the kernels: k3_kernels_isa) give
 * the reference's value for every input (tests/test_pd.c holds them to it);
 * at about 70 GB/s on AVX-512 it costs the transfer little. */
#define K3_PD_SUM_LANES 64
#define K3_PD_SUM_BLOCK 256
#define K3_PD_SUM_Q 0x9E3779B1u
#define K3_PD_SUM_R 13
uint64_t k3_pd_sum(const void *p, size_t n);
uint64_t k3_pd_sum_ref(const void *p, size_t n);
/* The whole blocks of b[n] into the lanes a; the bytes taken. */
size_t k3_pd_sum_blocks_ref(const uint8_t *b, size_t n, uint32_t a[K3_PD_SUM_LANES]);
size_t k3_pd_sum_blocks_avx2(const uint8_t *b, size_t n, uint32_t a[K3_PD_SUM_LANES]);
size_t k3_pd_sum_blocks_avx512(const uint8_t *b, size_t n, uint32_t a[K3_PD_SUM_LANES]);
/* Seals a header (its sum) / checks one; false with the reason in err. */
void k3_pd_req_seal(k3_pd_req *r);
void k3_pd_unit_seal(k3_pd_unit *u);
bool k3_pd_req_check(const k3_pd_req *r, k3_error *err);
bool k3_pd_unit_check(const k3_pd_unit *u, k3_error *err);
/* "model 0123456789abcdef, quant w4a8, kv-cache c8, block 64" */
void k3_pd_ident_str(const k3_pd_ident *id, char *buf, size_t size);
bool k3_pd_ident_same(const k3_pd_ident *a, const k3_pd_ident *b);

/* ---- sockets: every call fails with a message rather than blocking past its
 * deadline (SO_RCVTIMEO / SO_SNDTIMEO set at connect and accept) */
/* A connected TCP socket to host:port (connect within timeout_s), or -1. */
int k3_pd_connect(const char *host, int port, double timeout_s, k3_error *err);
/* The deadlines, TCP_NODELAY and the buffer sizes on an accepted socket. */
void k3_pd_socket_setup(int fd, double timeout_s);
/* a's na bytes then b's nb bytes (one sendmsg when they fit). */
k3_status k3_pd_send(int fd, const void *a, size_t na, const void *b, size_t nb, const char *what, k3_error *err);
/* Exactly n bytes; a peer that closes or goes silent is an error naming what. */
k3_status k3_pd_recv(int fd, void *buf, size_t n, const char *what, k3_error *err);
/* A listening socket on host:port (0 = any); *port_out gets the port. */
int k3_pd_listen(const char *host, int port, int *port_out, k3_error *err);

#endif /* K3_PD_WIRE_H */
