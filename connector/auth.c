/* SPDX-License-Identifier: Apache-2.0 */
/* Cluster authentication of the side channel: the shared secret, nonces and
 * tokens (OpenSSL RAND_bytes), the two handshake MACs (HMAC-SHA-256) and
 * their constant-time comparison, and the sealed channel that follows AUTH
 * (HKDF-SHA-256 keys, AES-256-GCM).  listen.c (producer) and peer.c
 * (consumer) run the exchange. */
#include "connector/kvc_int.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/kdf.h>
#include <openssl/rand.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

kvc_status_t kvc_random(void *p, size_t n) {
    if (n > INT32_MAX || RAND_bytes(p, (int)n) != 1) return KVC_ERR_IO;
    return KVC_OK;
}

static void put_str16(kvc_buf_t *b, kvc_span_t s) {
    kvc_buf_u16(b, (uint16_t)s.len);
    kvc_buf_put(b, s.p, s.len);
}

/* HMAC over a transcript built in a buffer; on any failure the output is
 * random bytes, which no peer can match. */
static void mac(const kvc_agent_t *a, const kvc_buf_t *msg, uint8_t out[KVC_MAC_LEN]) {
    unsigned int olen = 0;
    static const uint8_t nokey = 0;
    const void *key = a->secret_len ? a->secret : &nokey;
    if (msg->failed || !HMAC(EVP_sha256(), key, (int)a->secret_len, msg->p, msg->len, out, &olen) ||
        olen != KVC_MAC_LEN) {
        if (kvc_random(out, KVC_MAC_LEN) != KVC_OK) memset(out, 0xa5, KVC_MAC_LEN);
    }
}

void kvc_mac_consumer(const kvc_agent_t *a, const uint8_t *nonce_c, const uint8_t *nonce_p,
                      uint8_t proto, uint8_t hello_flags, uint8_t chal_flags, kvc_span_t cons_id,
                      kvc_span_t prod_id, uint8_t out[KVC_MAC_LEN]) {
    static const char label[] = "kvc4 consumer";
    kvc_buf_t b = {0};
    kvc_buf_put(&b, label, sizeof(label));
    kvc_buf_put(&b, nonce_c, KVC_NONCE_LEN);
    kvc_buf_put(&b, nonce_p, KVC_NONCE_LEN);
    kvc_buf_u8(&b, proto);
    kvc_buf_u8(&b, hello_flags);
    kvc_buf_u8(&b, chal_flags);
    put_str16(&b, cons_id);
    put_str16(&b, prod_id);
    mac(a, &b, out);
    kvc_buf_cleanup(&b);
}

void kvc_mac_producer(const kvc_agent_t *a, const uint8_t *nonce_c, const uint8_t *nonce_p,
                      const uint8_t *body, size_t len, uint8_t out[KVC_MAC_LEN]) {
    static const char label[] = "kvc2 producer";
    kvc_buf_t b = {0};
    kvc_buf_put(&b, label, sizeof(label));
    kvc_buf_put(&b, nonce_c, KVC_NONCE_LEN);
    kvc_buf_put(&b, nonce_p, KVC_NONCE_LEN);
    kvc_buf_put(&b, body, len);
    mac(a, &b, out);
    kvc_buf_cleanup(&b);
}

bool kvc_mac_equal(const uint8_t *x, const uint8_t *y, size_t n) {
    return CRYPTO_memcmp(x, y, n) == 0;
}

kvc_status_t kvc_chan_init(kvc_chan_t *ch, const kvc_agent_t *a, const uint8_t *nonce_c,
                           const uint8_t *nonce_p, const uint8_t mac_c[KVC_MAC_LEN],
                           bool producer) {
    static const char label[] = "kvc3 channel";
    /* HKDF refuses empty key material: an agent without a secret (whose
     * channel protects nothing, as documented) uses a fixed one. */
    static const char nokey[] = "kvc3 no cluster secret";
    uint8_t salt[2 * KVC_NONCE_LEN], info[sizeof(label) + KVC_MAC_LEN];
    uint8_t keys[2 * KVC_CHAN_KEY_LEN];
    size_t klen = sizeof(keys);
    memcpy(salt, nonce_c, KVC_NONCE_LEN);
    memcpy(salt + KVC_NONCE_LEN, nonce_p, KVC_NONCE_LEN);
    memcpy(info, label, sizeof(label));
    memcpy(info + sizeof(label), mac_c, KVC_MAC_LEN);
    const uint8_t *ikm = a->secret_len ? a->secret : (const uint8_t *)nokey;
    size_t ikm_len = a->secret_len ? a->secret_len : sizeof(nokey) - 1;
    memset(ch, 0, sizeof(*ch));
    EVP_PKEY_CTX *pc = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, NULL);
    bool ok = pc && EVP_PKEY_derive_init(pc) > 0 &&
              EVP_PKEY_CTX_set_hkdf_md(pc, EVP_sha256()) > 0 &&
              EVP_PKEY_CTX_set1_hkdf_salt(pc, salt, (int)sizeof(salt)) > 0 &&
              EVP_PKEY_CTX_set1_hkdf_key(pc, ikm, (int)ikm_len) > 0 &&
              EVP_PKEY_CTX_add1_hkdf_info(pc, info, (int)sizeof(info)) > 0 &&
              EVP_PKEY_derive(pc, keys, &klen) > 0 && klen == sizeof(keys);
    EVP_PKEY_CTX_free(pc);
    if (ok) {
        /* keys: consumer-to-producer, then producer-to-consumer */
        memcpy(ch->tx, keys + (producer ? KVC_CHAN_KEY_LEN : 0), KVC_CHAN_KEY_LEN);
        memcpy(ch->rx, keys + (producer ? 0 : KVC_CHAN_KEY_LEN), KVC_CHAN_KEY_LEN);
        ch->ready = true;
    }
    OPENSSL_cleanse(keys, sizeof(keys));
    return ok ? KVC_OK : KVC_ERR_IO;
}

void kvc_chan_cleanup(kvc_chan_t *ch) {
    OPENSSL_cleanse(ch, sizeof(*ch));
}

static void chan_iv(uint64_t seq, uint8_t iv[12]) {
    memset(iv, 0, 12);
    for (int i = 0; i < 8; i++)
        iv[4 + i] = (uint8_t)(seq >> (8 * i));
}

kvc_status_t kvc_chan_seal(kvc_chan_t *ch, kvc_buf_t *out, uint16_t version, const uint8_t *msg,
                           size_t len) {
    if (!ch->ready || out->failed || ch->seq_tx == UINT64_MAX ||
        len > KVC_WIRE_MAX_BODY - KVC_CHAN_TAG_LEN) {
        out->failed = true;
        return KVC_ERR_IO;
    }
    size_t start = out->len;
    kvc_buf_u32(out, KVC_WIRE_MAGIC);
    kvc_buf_u16(out, version);
    kvc_buf_u16(out, KVC_MSG_SEALED);
    kvc_buf_u32(out, (uint32_t)(len + KVC_CHAN_TAG_LEN));
    /* room for the ciphertext and tag, written in place */
    size_t body = out->len;
    uint8_t zero[256] = {0};
    for (size_t left = len + KVC_CHAN_TAG_LEN; left;) {
        size_t k = left < sizeof(zero) ? left : sizeof(zero);
        kvc_buf_put(out, zero, k);
        left -= k;
    }
    if (out->failed) return KVC_ERR_NO_MEMORY;
    uint8_t iv[12];
    chan_iv(ch->seq_tx, iv);
    int n = 0, fin = 0;
    EVP_CIPHER_CTX *cx = EVP_CIPHER_CTX_new();
    bool ok =
        cx && len <= INT32_MAX &&
        EVP_EncryptInit_ex(cx, EVP_aes_256_gcm(), NULL, ch->tx, iv) == 1 &&
        EVP_EncryptUpdate(cx, NULL, &n, out->p + start, KVC_WIRE_HDR_LEN) == 1 &&
        EVP_EncryptUpdate(cx, out->p + body, &n, msg, (int)len) == 1 && (size_t)n == len &&
        EVP_EncryptFinal_ex(cx, out->p + body + n, &fin) == 1 && fin == 0 &&
        EVP_CIPHER_CTX_ctrl(cx, EVP_CTRL_GCM_GET_TAG, KVC_CHAN_TAG_LEN, out->p + body + len) == 1;
    EVP_CIPHER_CTX_free(cx);
    if (!ok) {
        out->failed = true;
        return KVC_ERR_IO;
    }
    ch->seq_tx++;
    return KVC_OK;
}

kvc_status_t kvc_chan_open(kvc_chan_t *ch, const uint8_t *rec, size_t rec_len, uint8_t **msg,
                           size_t *len) {
    kvc_wire_hdr_t h;
    if (!ch->ready || kvc_wire_parse_hdr(rec, rec_len, KVC_WIRE_MAX_BODY, &h) != KVC_OK ||
        h.type != KVC_MSG_SEALED || rec_len != KVC_WIRE_HDR_LEN + (size_t)h.body_len ||
        h.body_len < KVC_CHAN_TAG_LEN + KVC_WIRE_HDR_LEN || ch->seq_rx == UINT64_MAX)
        return KVC_ERR_PROTOCOL;
    size_t n_ct = h.body_len - KVC_CHAN_TAG_LEN;
    const uint8_t *ct = rec + KVC_WIRE_HDR_LEN;
    uint8_t *pt = malloc(n_ct);
    if (!pt) return KVC_ERR_NO_MEMORY;
    uint8_t iv[12], tag[KVC_CHAN_TAG_LEN];
    memcpy(tag, ct + n_ct, KVC_CHAN_TAG_LEN);
    chan_iv(ch->seq_rx, iv);
    int n = 0, fin = 0;
    EVP_CIPHER_CTX *cx = EVP_CIPHER_CTX_new();
    bool ok = cx && EVP_DecryptInit_ex(cx, EVP_aes_256_gcm(), NULL, ch->rx, iv) == 1 &&
              EVP_DecryptUpdate(cx, NULL, &n, rec, KVC_WIRE_HDR_LEN) == 1 &&
              EVP_DecryptUpdate(cx, pt, &n, ct, (int)n_ct) == 1 && (size_t)n == n_ct &&
              EVP_CIPHER_CTX_ctrl(cx, EVP_CTRL_GCM_SET_TAG, KVC_CHAN_TAG_LEN, tag) == 1;
    /* The tag check: nothing of the plaintext is handed out unless it holds. */
    bool tag_ok = ok && EVP_DecryptFinal_ex(cx, pt + n, &fin) == 1 && fin == 0;
    EVP_CIPHER_CTX_free(cx);
    if (!tag_ok) {
        OPENSSL_cleanse(pt, n_ct);
        free(pt);
        return ok ? KVC_ERR_AUTH : KVC_ERR_IO;
    }
    ch->seq_rx++;
    *msg = pt;
    *len = n_ct;
    return KVC_OK;
}

static uint64_t id_hash(const char *id, size_t len) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a: the token is what proves anything */
    for (size_t i = 0; i < len; i++)
        h = (h ^ (uint8_t)id[i]) * 1099511628211ull;
    return h;
}

void kvc_token_remember(kvc_agent_t *a, const char *id, const uint8_t *token) {
    kvc_gone_t *g = &a->gone[a->gone_next++ % KVC_NOTIFY_GONE];
    g->id_hash = id_hash(id, strlen(id));
    memcpy(g->token, token, KVC_TOKEN_LEN);
    g->used = false;
}

kvc_gone_t *kvc_token_recall(kvc_agent_t *a, kvc_span_t id, const uint8_t *token) {
    uint64_t h = id_hash((const char *)id.p, id.len);
    size_t n = a->gone_next < KVC_NOTIFY_GONE ? a->gone_next : KVC_NOTIFY_GONE;
    for (size_t i = 0; i < n; i++)
        if (a->gone[i].id_hash == h && kvc_mac_equal(a->gone[i].token, token, KVC_TOKEN_LEN))
            return &a->gone[i];
    return NULL;
}

/* Reads a secret file: at most KVC_MAX_SECRET bytes, trailing newline
 * (and CR) stripped. */
static kvc_status_t read_secret_file(kvc_agent_t *a, const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        KVC_LOG(a, KVC_LOG_ERROR, "cannot open secret file %s: %s", path, strerror(errno));
        return KVC_ERR_INVALID_PARAM;
    }
    uint8_t *buf = malloc(KVC_MAX_SECRET + 1);
    size_t len = 0;
    kvc_status_t st = KVC_ERR_NO_MEMORY;
    if (!buf) goto err_fd;
    for (;;) {
        ssize_t n = read(fd, buf + len, KVC_MAX_SECRET + 1 - len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            KVC_LOG(a, KVC_LOG_ERROR, "cannot read secret file %s: %s", path, strerror(errno));
            st = KVC_ERR_INVALID_PARAM;
            goto err_buf;
        }
        if (n == 0) break;
        len += (size_t)n;
        if (len > KVC_MAX_SECRET) break;
    }
    while (len && (buf[len - 1] == '\n' || buf[len - 1] == '\r'))
        len--;
    if (len == 0 || len > KVC_MAX_SECRET) {
        KVC_LOG(a, KVC_LOG_ERROR, "secret file %s: %s", path,
                len ? "longer than 4096 bytes" : "empty");
        st = KVC_ERR_INVALID_PARAM;
        goto err_buf;
    }
    a->secret = buf;
    a->secret_len = len;
    close(fd);
    return KVC_OK;

err_buf:
    OPENSSL_cleanse(buf, KVC_MAX_SECRET + 1);
    free(buf);
err_fd:
    close(fd);
    return st;
}

kvc_status_t kvc_secret_init(kvc_agent_t *a, const kvc_agent_params_t *p) {
    if (p->field_mask & KVC_AGENT_FIELD_SECRET) {
        if (!p->secret || p->secret_len == 0 || p->secret_len > KVC_MAX_SECRET)
            return KVC_ERR_INVALID_PARAM;
        if (!(a->secret = malloc(p->secret_len))) return KVC_ERR_NO_MEMORY;
        memcpy(a->secret, p->secret, p->secret_len);
        a->secret_len = p->secret_len;
        return KVC_OK;
    }
    const char *f = getenv("KVC_SECRET_FILE");
    if (f && *f) return read_secret_file(a, f);
    const char *s = getenv("KVC_SECRET");
    if (s && *s) {
        size_t n = strlen(s);
        if (n > KVC_MAX_SECRET) return KVC_ERR_INVALID_PARAM;
        if (!(a->secret = (uint8_t *)kvc_strdup(s))) return KVC_ERR_NO_MEMORY;
        a->secret_len = n;
        return KVC_OK;
    }
    return KVC_OK; /* none: unauthenticated, warned by the caller */
}

bool kvc_log_ratelimit(kvc_agent_t *a, int kind) {
    /* Up to 10 lines per second per kind; what is dropped is still counted
     * in the stats. */
    uint64_t now = kvc_now_ns(), sec = now / 1000000000ull;
    if (kind < 0 || kind >= KVC_RL_KINDS) return false;
    if (a->rl_sec[kind] != sec) {
        a->rl_sec[kind] = sec;
        a->rl_count[kind] = 0;
    }
    return a->rl_count[kind]++ < 10;
}
