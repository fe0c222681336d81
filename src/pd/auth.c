/*
 * auth.c -- the deployment's keys, the handshake, the MACs, the proxy's
 * credential and the prompt hash (auth.h), on OpenSSL's libcrypto: HMAC-SHA256
 * for the proofs and the derivations, AES-256-GCM over additional data only
 * (GMAC) for the messages, CRYPTO_memcmp for every comparison.
 *
 * Why GMAC: the payloads are the cache rows, up to 1 MiB a unit, every byte
 * of a prompt's cache; the MAC is a pass over them on each side. On the
 * machines this runs on, OpenSSL's GMAC (carry-less multiplication) runs at
 * about 18 GB/s a core, Poly1305 at 14 and HMAC-SHA256 at 2 (docs/pd.md has
 * the command). It replaces the stream's former checksum, so what a transfer
 * pays for it is the difference.
 */
#include "pd/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"
#include "common/random.h"
#include "pd/wire.h"

static void hmac(const uint8_t *key, size_t nk, const void *a, size_t na, const void *b, size_t nb, const void *c,
                 size_t nc, uint8_t out[32]) {
    uint8_t buf[256];
    unsigned int len = 32;
    /* every input here is short: one buffer, one call */
    size_t n = 0;
    memcpy(buf + n, a, na), n += na;
    if (nb) memcpy(buf + n, b, nb), n += nb;
    if (nc) memcpy(buf + n, c, nc), n += nc;
    HMAC(EVP_sha256(), key, (int)nk, buf, n, out, &len);
    OPENSSL_cleanse(buf, sizeof buf);
}

k3_status k3_pd_keys_derive(k3_pd_keys *k, const void *secret, size_t n, k3_error *err) {
    if (!secret || n < K3_PD_SECRET_MIN)
        return k3_err(err, K3_ERR_ARG,
                      "the kv transfer secret has %zu bytes: it needs at least %d (for example 32 random bytes: "
                      "head -c 32 /dev/urandom | base64)",
                      secret ? n : 0, K3_PD_SECRET_MIN);
    if (n > 4096) return k3_err(err, K3_ERR_ARG, "the kv transfer secret has %zu bytes: at most 4096", n);
    static const char lt[] = "k3 kv transfer v2", lp[] = "k3 proxy credential v2";
    unsigned int len = 32;
    HMAC(EVP_sha256(), secret, (int)n, (const uint8_t *)lt, sizeof lt - 1, k->transfer, &len);
    HMAC(EVP_sha256(), secret, (int)n, (const uint8_t *)lp, sizeof lp - 1, k->proxy, &len);
    return K3_OK;
}

bool k3_pd_equal(const void *a, const void *b, size_t n) { return CRYPTO_memcmp(a, b, n) == 0; }

/* ---- the session's MACs ---------------------------------------------------------- */

static bool mac_init(k3_pd_mac *m, const uint8_t key[32], uint32_t dir) {
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
    if (!c || EVP_EncryptInit_ex(c, EVP_aes_256_gcm(), NULL, key, NULL) != 1) {
        EVP_CIPHER_CTX_free(c);
        return false;
    }
    m->ctx = c;
    m->dir = dir;
    return true;
}

void k3_pd_session_free(k3_pd_session *s) {
    if (!s) return;
    EVP_CIPHER_CTX_free(s->tx.ctx);
    EVP_CIPHER_CTX_free(s->rx.ctx);
    s->tx.ctx = s->rx.ctx = NULL;
}

void k3_pd_tag_iov(k3_pd_mac *m, uint64_t seq, const struct iovec *v, int n, uint8_t tag[K3_PD_TAG_BYTES]) {
    /* the 96-bit nonce: the direction and the message's number; the key is
     * the session's own, so no (key, nonce) pair ever repeats */
    uint8_t iv[12];
    memcpy(iv, &m->dir, 4);
    memcpy(iv + 4, &seq, 8);
    EVP_CIPHER_CTX *c = m->ctx;
    int ol = 0;
    uint8_t none[16];
    bool ok = EVP_EncryptInit_ex(c, NULL, NULL, NULL, iv) == 1;
    /* EVP takes an int length: a piece of 1 GiB and more goes in parts. The
     * pieces make one message: the tag of their concatenation. */
    for (int i = 0; ok && i < n; i++) {
        size_t left = v[i].iov_len;
        for (const uint8_t *p = v[i].iov_base; ok && left;) {
            const int k = left > (1u << 30) ? 1 << 30 : (int)left;
            ok = EVP_EncryptUpdate(c, NULL, &ol, p, k) == 1;
            p += k, left -= (size_t)k;
        }
    }
    ok = ok && EVP_EncryptFinal_ex(c, none, &ol) == 1 &&
        EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, K3_PD_TAG_BYTES, tag) == 1;
    if (!ok) k3_random_bytes(tag, K3_PD_TAG_BYTES, NULL); /* a failed MAC matches nothing */
}

bool k3_pd_tag_iov_ok(k3_pd_mac *m, uint64_t seq, const struct iovec *v, int n, const uint8_t tag[K3_PD_TAG_BYTES]) {
    uint8_t t[K3_PD_TAG_BYTES];
    k3_pd_tag_iov(m, seq, v, n, t);
    return CRYPTO_memcmp(t, tag, K3_PD_TAG_BYTES) == 0;
}

bool k3_pd_mac_clone(k3_pd_mac *dst, const k3_pd_mac *src) {
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
    if (!c || EVP_CIPHER_CTX_copy(c, src->ctx) != 1) {
        EVP_CIPHER_CTX_free(c);
        return false;
    }
    dst->ctx = c;
    dst->dir = src->dir;
    return true;
}

void k3_pd_mac_free(k3_pd_mac *m) {
    if (!m) return;
    EVP_CIPHER_CTX_free(m->ctx);
    m->ctx = NULL;
}

void k3_pd_tag(k3_pd_mac *m, uint64_t seq, const void *a, size_t na, const void *b, size_t nb,
               uint8_t tag[K3_PD_TAG_BYTES]) {
    const struct iovec v[2] = {{(void *)a, na}, {(void *)b, nb}};
    k3_pd_tag_iov(m, seq, v, 2, tag);
}

bool k3_pd_tag_ok(k3_pd_mac *m, uint64_t seq, const void *a, size_t na, const void *b, size_t nb,
                  const uint8_t tag[K3_PD_TAG_BYTES]) {
    uint8_t t[K3_PD_TAG_BYTES];
    k3_pd_tag(m, seq, a, na, b, nb, t);
    return CRYPTO_memcmp(t, tag, K3_PD_TAG_BYTES) == 0;
}

/* ---- the handshake ----------------------------------------------------------------- */

static const char L_SERVER[] = "k3pd server proof", L_CLIENT[] = "k3pd client proof", L_C2S[] = "k3pd c2s",
                  L_S2C[] = "k3pd s2c";

static bool hello_ok(const k3_pd_hello *h, int role) {
    return !memcmp(h->magic, "K3PH", 4) && h->version == K3_PD_VERSION && h->role == role;
}

static k3_status session_keys(const k3_pd_keys *k, const uint8_t nc[32], const uint8_t ns[32], bool client,
                              k3_pd_session *s, k3_error *err) {
    uint8_t c2s[32], s2c[32];
    hmac(k->transfer, 32, L_C2S, sizeof L_C2S - 1, nc, 32, ns, 32, c2s);
    hmac(k->transfer, 32, L_S2C, sizeof L_S2C - 1, nc, 32, ns, 32, s2c);
    memset(s, 0, sizeof *s);
    const bool ok =
        mac_init(&s->tx, client ? c2s : s2c, client ? 1 : 2) && mac_init(&s->rx, client ? s2c : c2s, client ? 2 : 1);
    OPENSSL_cleanse(c2s, sizeof c2s);
    OPENSSL_cleanse(s2c, sizeof s2c);
    if (!ok) {
        k3_pd_session_free(s);
        return k3_err(err, K3_ERR_NOMEM, "kv transfer: cannot set up the session's MAC");
    }
    return K3_OK;
}

k3_status k3_pd_handshake_client(int fd, const k3_pd_keys *k, k3_pd_session *s, k3_error *err) {
    k3_pd_hello h = {.magic = "K3PH", .version = K3_PD_VERSION, .role = K3_PD_HELLO_CLIENT}, sh;
    K3_TRY(k3_random_bytes(h.nonce, sizeof h.nonce, err));
    K3_TRY(k3_pd_send(fd, &h, sizeof h, NULL, 0, "the handshake", err));
    K3_TRY(k3_pd_recv(fd, &sh, sizeof sh, "the handshake", err));
    uint8_t want[32];
    hmac(k->transfer, 32, L_SERVER, sizeof L_SERVER - 1, h.nonce, 32, sh.nonce, 32, want);
    if (!hello_ok(&sh, K3_PD_HELLO_SERVER) || CRYPTO_memcmp(want, sh.proof, 32))
        return k3_err(err, K3_ERR_PERM,
                      "kv transfer refused: the peer did not prove the deployment's transfer secret (another secret, "
                      "or not a k3 prefill instance)");
    k3_pd_hello p = {.magic = "K3PH", .version = K3_PD_VERSION, .role = K3_PD_HELLO_PROOF};
    hmac(k->transfer, 32, L_CLIENT, sizeof L_CLIENT - 1, h.nonce, 32, sh.nonce, 32, p.proof);
    K3_TRY(k3_pd_send(fd, &p, sizeof p, NULL, 0, "the handshake", err));
    return session_keys(k, h.nonce, sh.nonce, true, s, err);
}

k3_status k3_pd_handshake_server(int fd, const k3_pd_keys *k, k3_pd_session *s, k3_error *err) {
    k3_pd_hello ch, h = {.magic = "K3PH", .version = K3_PD_VERSION, .role = K3_PD_HELLO_SERVER}, p;
    K3_TRY(k3_pd_recv(fd, &ch, sizeof ch, "the handshake", err));
    if (!hello_ok(&ch, K3_PD_HELLO_CLIENT))
        return k3_err(err, K3_ERR_PERM, "kv transfer: a connection that does not speak the transfer protocol");
    K3_TRY(k3_random_bytes(h.nonce, sizeof h.nonce, err));
    hmac(k->transfer, 32, L_SERVER, sizeof L_SERVER - 1, ch.nonce, 32, h.nonce, 32, h.proof);
    K3_TRY(k3_pd_send(fd, &h, sizeof h, NULL, 0, "the handshake", err));
    K3_TRY(k3_pd_recv(fd, &p, sizeof p, "the handshake", err));
    uint8_t want[32];
    hmac(k->transfer, 32, L_CLIENT, sizeof L_CLIENT - 1, ch.nonce, 32, h.nonce, 32, want);
    if (!hello_ok(&p, K3_PD_HELLO_PROOF) || CRYPTO_memcmp(want, p.proof, 32))
        return k3_err(err, K3_ERR_PERM, "kv transfer: a peer that did not prove the deployment's transfer secret");
    return session_keys(k, ch.nonce, h.nonce, false, s, err);
}

/* ---- the prompt hash, the credential ----------------------------------------------- */

void k3_pd_prompt_hash(const int32_t *ids, int64_t n, uint8_t out[K3_PD_HASH_BYTES]) {
    SHA256((const uint8_t *)ids, sizeof(int32_t) * (size_t)(n > 0 ? n : 0), out);
}

void k3_pd_hex(const uint8_t *b, size_t n, char *out) {
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = d[b[i] >> 4];
        out[2 * i + 1] = d[b[i] & 15];
    }
    out[2 * n] = 0;
}

bool k3_pd_unhex(const char *s, uint8_t *out, size_t n) {
    if (!s || strlen(s) != 2 * n) return false;
    for (size_t i = 0; i < 2 * n; i++) {
        const char c = s[i];
        const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0) return false;
        if (i % 2) out[i / 2] = (uint8_t)(out[i / 2] << 4 | v);
        else out[i / 2] = (uint8_t)v;
    }
    return true;
}

void k3_pd_credential(const k3_pd_keys *k, const char *host, long long port, const char *request_id,
                      const char *prompt_hash, long long n_tokens, char out[2 * K3_PD_KEY_BYTES + 1]) {
    /* the fields with their lengths, so no two sets of fields read the same */
    char buf[1024];
    const int n = snprintf(buf, sizeof buf, "k3 kv_transfer_params\n%zu:%s\n%lld\n%zu:%s\n%zu:%s\n%lld", strlen(host),
                           host, port, strlen(request_id), request_id, strlen(prompt_hash), prompt_hash, n_tokens);
    uint8_t mac[32];
    unsigned int len = 32;
    HMAC(EVP_sha256(), k->proxy, 32, (const uint8_t *)buf, n > 0 && (size_t)n < sizeof buf ? (size_t)n : 0, mac, &len);
    k3_pd_hex(mac, 32, out);
}
