/*
 * auth.h -- who may take part in a transfer (auth.c, on OpenSSL's libcrypto):
 * the deployment's keys, the handshake that proves both ends hold them, the
 * MAC of every message, the proxy's credential on kv_transfer_params, and
 * the prompt hash a hold is bound to. docs/pd.md ("Who may pull") has the
 * design and the figures.
 *
 * Every instance of a deployment (prefill, decode, proxy) is given the same
 * secret (--kv-transfer-secret-file or K3_KV_TRANSFER_SECRET; not --api-key,
 * which every API client holds). From it: a transfer key (the handshake) and
 * a proxy key (the credential). A connection starts with a handshake: each
 * side sends 32 random bytes, the listener proves the key first (HMAC of both
 * nonces), the connecting side second; both derive a pair of session keys
 * (one per direction) from the nonces. Every message after it carries a
 * 16-byte tag: GMAC (AES-256-GCM over additional data only) under its
 * direction's session key with the message's sequence number as the nonce,
 * so a changed, replayed, reordered or forged message fails. Tags and proofs
 * are compared in constant time.
 */
#ifndef K3_PD_AUTH_H
#define K3_PD_AUTH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "k3.h"

#define K3_PD_KEY_BYTES 32
#define K3_PD_TAG_BYTES 16
#define K3_PD_NONCE_BYTES 32
#define K3_PD_HASH_BYTES 32  /* the prompt hash (SHA-256) */
#define K3_PD_TOKEN_BYTES 16 /* a hold's token */
#define K3_PD_SECRET_MIN 16  /* bytes of a deployment secret at least */
/* The header the proxy sends its credential in (decode side). */
#define K3_PD_CREDENTIAL_HEADER "X-K3-Transfer-Credential"

typedef struct k3_pd_keys {
    uint8_t transfer[K3_PD_KEY_BYTES]; /* the handshake's HMAC key */
    uint8_t proxy[K3_PD_KEY_BYTES];    /* the proxy credential's HMAC key */
} k3_pd_keys;

/* Both keys from a deployment secret of n >= K3_PD_SECRET_MIN bytes
 * (K3_ERR_ARG naming the length otherwise). */
k3_status k3_pd_keys_derive(k3_pd_keys *k, const void *secret, size_t n, k3_error *err);

/* One direction of a session: the GMAC of its messages. */
typedef struct k3_pd_mac {
    void *ctx; /* EVP_CIPHER_CTX, keyed */
    uint32_t dir;
} k3_pd_mac;

typedef struct k3_pd_session {
    k3_pd_mac tx, rx;
} k3_pd_session;

void k3_pd_session_free(k3_pd_session *s);

/* The handshake on a connected socket (the deadlines set on it apply):
 * client = the side that connected. False with the reason in err: a peer
 * that does not prove the key, or speaks another protocol. The server side's
 * failures say nothing to the peer: it closes. */
k3_status k3_pd_handshake_client(int fd, const k3_pd_keys *k, k3_pd_session *s, k3_error *err);
k3_status k3_pd_handshake_server(int fd, const k3_pd_keys *k, k3_pd_session *s, k3_error *err);

/* The tag of message number seq, a[na] then b[nb] (either may be empty). */
void k3_pd_tag(k3_pd_mac *m, uint64_t seq, const void *a, size_t na, const void *b, size_t nb,
               uint8_t tag[K3_PD_TAG_BYTES]);
/* The same compared with tag in constant time. */
bool k3_pd_tag_ok(k3_pd_mac *m, uint64_t seq, const void *a, size_t na, const void *b, size_t nb,
                  const uint8_t tag[K3_PD_TAG_BYTES]);

/* The tag of message number seq whose bytes are the n pieces of v in order
 * (a unit's rows where they lie in the cache: the same tag as of the pieces
 * copied one after the other). */
void k3_pd_tag_iov(k3_pd_mac *m, uint64_t seq, const struct iovec *v, int n, uint8_t tag[K3_PD_TAG_BYTES]);
bool k3_pd_tag_iov_ok(k3_pd_mac *m, uint64_t seq, const struct iovec *v, int n, const uint8_t tag[K3_PD_TAG_BYTES]);
/* A second context of the same direction's key (for another thread);
 * false when out of memory. Freed with k3_pd_mac_free. */
bool k3_pd_mac_clone(k3_pd_mac *dst, const k3_pd_mac *src);
void k3_pd_mac_free(k3_pd_mac *m);

/* Constant-time equality of n bytes. */
bool k3_pd_equal(const void *a, const void *b, size_t n);

/* The prompt hash: SHA-256 of the ids as int32 little endian. */
void k3_pd_prompt_hash(const int32_t *ids, int64_t n, uint8_t out[K3_PD_HASH_BYTES]);

/* The proxy's credential on kv_transfer_params: HMAC-SHA256 under the proxy
 * key of the fields that say where to connect and what to read (host, port,
 * request id, prompt hash, token count), as lowercase hex (64 + NUL). */
void k3_pd_credential(const k3_pd_keys *k, const char *host, long long port, const char *request_id,
                      const char *prompt_hash, long long n_tokens, char out[2 * K3_PD_KEY_BYTES + 1]);

/* Hex of n bytes into out (2n + 1); bytes of a 2n-digit hex string (false
 * when it is not one). */
void k3_pd_hex(const uint8_t *b, size_t n, char *out);
bool k3_pd_unhex(const char *s, uint8_t *out, size_t n);

#endif /* K3_PD_AUTH_H */
