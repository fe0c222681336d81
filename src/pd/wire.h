/*
 * wire.h -- the transfer stream between a prefill and a decode instance
 * (wire.c): its messages, the bulk transport the rows move by, and the
 * socket calls with deadlines.
 * docs/pd.md has the protocol; auth.h the handshake and the MACs.
 *
 * Control and bulk are apart. Control messages (the handshake, the request,
 * each unit's header, the end and an error) go over the connection's TCP
 * stream, each with its tag (auth.h). A unit's payload (rows or a piece of
 * the KDA state) moves by a k3_pd_bulk: over the same TCP stream after its
 * header (k3_pd_bulk_tcp), or by another transport that lands the bytes in
 * the receiver's buffer; the header carries the payload's tag, which the
 * receiver checks on what landed before it writes a byte into a block.
 *
 * The decode side connects, the handshake runs, it sends one request
 * (k3_pd_req): PULL a hold's positions [from, to) and its KDA state, or
 * RELEASE a hold nobody will read; the hold named by its token and the
 * prompt's hash. The prefill side answers a PULL with units (k3_pd_unit +
 * payload): LAYER units (one MLA/DSA layer's rows for a run of positions, in
 * the transfer layout of src/ctx/ctx.h, layer after layer), STATE units
 * (pieces of the KDA state, in order), then END; or one ERROR unit whose
 * payload says why, naming nothing of the instance. Both ends are little
 * endian x86-64: the structs go on the wire as they lie in memory.
 */
#ifndef K3_PD_WIRE_H
#define K3_PD_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "k3.h"
#include "pd/auth.h"

#define K3_PD_VERSION 3
#define K3_PD_QUANT_LEN 24

/* PULL_UCX: PULL, and the prefill side may answer with one-sided access to
 * the hold (a K3_PD_UCX unit first) instead of the rows on the stream. */
enum { K3_PD_PULL = 1, K3_PD_RELEASE = 2, K3_PD_PULL_UCX = 3 };
/* UCX: the offer (unit 0: k3_pd_ucx_offer and what follows it, on the
 * stream); then LAYER and STATE units are headers only, their payload_tag the
 * MAC of the bytes where they lie on the prefill side, which the decode side
 * gets itself; END; then the decode side's answer, its message 1: an END
 * unit (all landed and checked) or an ERROR unit, after which the hold goes. */
enum { K3_PD_LAYER = 1, K3_PD_STATE = 2, K3_PD_END = 3, K3_PD_ERROR = 4, K3_PD_UCX = 5 };
enum { K3_PD_HELLO_CLIENT = 1, K3_PD_HELLO_SERVER = 2, K3_PD_HELLO_PROOF = 3 };

/* What an instance runs: two instances exchange caches only when the
 * model, quant and kv fields agree (the block size may differ: units
 * address positions, not blocks). */
typedef struct k3_pd_ident {
    uint64_t model;              /* k3_model_identity */
    char quant[K3_PD_QUANT_LEN]; /* --quant's mode, NUL-padded */
    uint32_t kv;                 /* k3_kv_type */
    int32_t block_size;
} k3_pd_ident;

/* The handshake's three messages (auth.c): the client's nonce; the server's
 * nonce and proof; the client's proof. */
typedef struct k3_pd_hello {
    char magic[4]; /* "K3PH" */
    uint16_t version, role;
    uint8_t nonce[K3_PD_NONCE_BYTES];
    uint8_t proof[K3_PD_KEY_BYTES];
} k3_pd_hello;

typedef struct k3_pd_req {
    char magic[4]; /* "K3PD" */
    uint16_t version, op;
    uint8_t hold[K3_PD_TOKEN_BYTES];       /* remote_request_id: the hold's token */
    uint8_t prompt_hash[K3_PD_HASH_BYTES]; /* the prompt the hold was made for */
    k3_pd_ident id;                        /* the decode side's */
    int64_t from, to;                      /* positions wanted */
    int64_t max_unit;                      /* payload bytes per unit at most */
    uint8_t tag[K3_PD_TAG_BYTES];          /* of the bytes before it (message 0 from the client) */
} k3_pd_req;

typedef struct k3_pd_unit {
    char magic[4]; /* "K3KV" */
    uint16_t version, kind;
    int32_t layer, pad;
    int64_t t0; /* LAYER: first position; STATE: byte offset; END: units before it */
    int64_t n;  /* LAYER: positions; STATE: bytes */
    uint64_t payload_bytes;
    uint8_t payload_tag[K3_PD_TAG_BYTES]; /* of the payload: message 2u + 1 */
    uint8_t tag[K3_PD_TAG_BYTES];         /* of the bytes before it: message 2u (u: the unit's number) */
} k3_pd_unit;

/* The payload of a K3_PD_UCX unit: how to reach the hold where it lies. In
 * order: this header; the prefill worker's address [addr_len]; n_arrays
 * k3_pd_ucx_array (one per cache array of each MLA/DSA layer, in the transfer
 * layout's order); the hold's block ids, int32 [n_blocks]; n_regions region
 * descriptors (k3_ucx_mem_pack), each a uint32 length and its bytes. Slot s
 * of array a is at byte s x row of its region; position p of the hold is slot
 * blocks[p / block_size] x block_size + p mod block_size. */
typedef struct k3_pd_ucx_offer {
    char magic[4]; /* "K3PU" */
    uint32_t addr_len, n_arrays, n_regions;
    int32_t block_size, n_blocks;
    int32_t state_region; /* the KDA state's region, -1 when the model has none */
    int32_t pad;
    int64_t n_tokens;
} k3_pd_ucx_offer;

typedef struct k3_pd_ucx_array {
    int32_t layer, comp, region, pad;
    int64_t row; /* bytes per slot */
} k3_pd_ucx_array;

#define K3_PD_UCX_OFFER_MAX ((int64_t)64 << 20) /* bytes of an offer at most */

/* How a unit's payload moves. send: n bytes (the receiver knows n from the
 * header that went before); recv: exactly n into buf. The TCP one writes and
 * reads the connection's own stream. */
typedef struct k3_pd_bulk {
    const char *name;
    k3_status (*send)(struct k3_pd_bulk *b, const void *buf, size_t n, k3_error *err);
    k3_status (*recv)(struct k3_pd_bulk *b, void *buf, size_t n, k3_error *err);
    int fd;
} k3_pd_bulk;
void k3_pd_bulk_tcp(k3_pd_bulk *b, int fd);

/* Control messages: sealed (magic, version, tag under s's tx as message seq)
 * and sent; received and checked (magic, version, tag) -- false with the
 * reason in err. */
k3_status k3_pd_req_send(int fd, k3_pd_session *s, k3_pd_req *r, k3_error *err);
k3_status k3_pd_req_recv(int fd, k3_pd_session *s, k3_pd_req *r, k3_error *err);
k3_status k3_pd_unit_send(int fd, k3_pd_session *s, uint64_t seq, k3_pd_unit *u, k3_error *err);
k3_status k3_pd_unit_recv(int fd, k3_pd_session *s, uint64_t seq, k3_pd_unit *u, k3_error *err);

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
