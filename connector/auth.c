/* Cluster authentication of the side channel: the shared secret, nonces and
 * tokens (OpenSSL RAND_bytes), the two handshake MACs (HMAC-SHA-256) and
 * their constant-time comparison.  listen.c (producer) and peer.c
 * (consumer) run the exchange. */
#include "kvc_int.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
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
                      uint8_t proto, kvc_span_t cons_id, kvc_span_t prod_id,
                      uint8_t out[KVC_MAC_LEN]) {
    static const char label[] = "kvc2 consumer";
    kvc_buf_t b = {0};
    kvc_buf_put(&b, label, sizeof(label));
    kvc_buf_put(&b, nonce_c, KVC_NONCE_LEN);
    kvc_buf_put(&b, nonce_p, KVC_NONCE_LEN);
    kvc_buf_u8(&b, proto);
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
