/* SPDX-License-Identifier: Apache-2.0 */
/* A hand-made consumer for the connector's unit tests: it speaks the side
 * channel and the PULL active message with the library's own wire encoders
 * (connector/kvc_int.h), choosing what a well-behaved agent never would: the
 * HELLO's flags, the consumer key of its CONSUMER message (or none), the
 * pull flags.  Blocking socket I/O (5 s timeouts): the producer it talks to
 * must run its progress thread.  One UCX worker serves every handshake of a
 * raw peer (its address goes in each CONSUMER message).  Include after
 * cmocka.h. */
#ifndef KVC_RAWPEER_H
#define KVC_RAWPEER_H

#include <arpa/inet.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "connector/kvc_int.h"

typedef struct {
    struct kvc_agent *auth; /* owned: only its secret is read (auth.c) */
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_address_t *addr; /* this worker's address */
    size_t addr_len;
    ucp_ep_h ep;         /* to the producer's worker, once connected */
    uint8_t *paddr;      /* owned: the producer's worker address, from the handshake */
    size_t paddr_len;
    int refusals, ends, data;
    int32_t last_refusal;
    uint8_t hello_flags; /* sent in the next HELLO */
    uint8_t chal_flags;  /* the last CHALLENGE's */
} raw_t;

static ucs_status_t raw_on_data(void *arg, const void *header, size_t hlen, void *data, size_t len,
                                const ucp_am_recv_param_t *param) {
    (void)data;
    (void)len;
    (void)param;
    raw_t *r = arg;
    kvc_wire_data_hdr_t h;
    if (kvc_wire_parse_data_hdr(header, hlen, &h) != KVC_OK) return UCS_OK;
    if (h.status != 0) {
        r->refusals++;
        r->last_refusal = h.status;
    } else if (h.region == KVC_DATA_END) {
        r->ends++;
    } else {
        r->data++;
    }
    /* Rendezvous data is never taken: UCX drops it when the callback returns. */
    return UCS_OK;
}

/* The handler of active message id on this worker (whole messages; its
 * argument is r). */
static inline void raw_handler(raw_t *r, unsigned id, ucp_am_recv_callback_t cb) {
    ucp_am_handler_param_t hp = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                               UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB |
                                               UCP_AM_HANDLER_PARAM_FIELD_ARG,
                                 .id = id,
                                 .flags = UCP_AM_FLAG_WHOLE_MSG,
                                 .cb = cb,
                                 .arg = r};
    assert_int_equal(ucp_worker_set_am_recv_handler(r->w, &hp), UCS_OK);
}

/* secret: the cluster secret (borrowed until raw_leave), or NULL. */
static inline void raw_up(raw_t *r, const char *secret) {
    memset(r, 0, sizeof(*r));
    r->auth = calloc(1, sizeof(*r->auth));
    assert_non_null(r->auth);
    if (secret) {
        r->auth->secret = (uint8_t *)secret;
        r->auth->secret_len = strlen(secret);
    }
    r->hello_flags = (uint8_t)(secret ? KVC_HFLAG_SECRET : 0);
    ucp_config_t *cfg;
    assert_int_equal(ucp_config_read(NULL, NULL, &cfg), UCS_OK);
    ucp_params_t pp = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM};
    assert_int_equal(ucp_init(&pp, cfg, &r->ctx), UCS_OK);
    ucp_config_release(cfg);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    assert_int_equal(ucp_worker_create(r->ctx, &wp, &r->w), UCS_OK);
    assert_int_equal(ucp_worker_get_address(r->w, &r->addr, &r->addr_len), UCS_OK);
    raw_handler(r, KVC_AM_DATA, raw_on_data);
}

static inline bool raw_read(int fd, void *p, size_t n) {
    for (uint8_t *c = p; n;) {
        ssize_t k = read(fd, c, n);
        if (k <= 0) return false;
        c += k;
        n -= (size_t)k;
    }
    return true;
}

/* One whole side-channel message (header included) into *m (malloc'ed). */
static inline bool raw_msg(int fd, kvc_wire_hdr_t *h, uint8_t **m) {
    uint8_t hb[KVC_WIRE_HDR_LEN];
    if (!raw_read(fd, hb, sizeof(hb)) ||
        kvc_wire_parse_hdr(hb, sizeof(hb), KVC_WIRE_MAX_BODY, h) != KVC_OK)
        return false;
    *m = malloc(KVC_WIRE_HDR_LEN + h->body_len + 1);
    assert_non_null(*m);
    memcpy(*m, hb, sizeof(hb));
    return raw_read(fd, *m + KVC_WIRE_HDR_LEN, h->body_len);
}

/* A side-channel connection to 127.0.0.1:port from address src (NULL:
 * 127.0.0.1), or -1. */
static inline int raw_dial(uint16_t port, const char *src) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    struct sockaddr_in sa = {.sin_family = AF_INET};
    if (src) {
        inet_pton(AF_INET, src, &sa.sin_addr);
        assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    }
    sa.sin_port = htons(port);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
        close(fd);
        return -1;
    }
    return fd;
}

/* HELLO (r->hello_flags), AUTH, then, when `key` is given (cons), a sealed
 * CONSUMER with this worker's address, and the producer's sealed HANDSHAKE,
 * whose worker address is kept.  KVC_OK; the status of the producer's ERROR;
 * KVC_ERR_UNREACHABLE (no answer, closed); KVC_ERR_AUTH (the seal does not
 * open). */
static inline kvc_status_t raw_handshake(raw_t *r, uint16_t port, const char *src, bool cons,
                                         uint64_t key) {
    int fd = raw_dial(port, src);
    if (fd < 0) return KVC_ERR_UNREACHABLE;
    kvc_status_t st = KVC_ERR_UNREACHABLE;
    uint8_t nc[KVC_NONCE_LEN], mac[KVC_MAC_LEN], *m = NULL;
    kvc_buf_t b = {0};
    kvc_wire_hdr_t h;
    kvc_wire_hello_t ch;
    kvc_chan_t keys;
    memset(&keys, 0, sizeof(keys));
    assert_int_equal(kvc_random(nc, sizeof(nc)), KVC_OK);
    kvc_wire_encode_hello(&b, KVC_WIRE_VERSION, KVC_MSG_HELLO, "D-raw", r->hello_flags, nc);
    if (write(fd, b.p, b.len) != (ssize_t)b.len) goto out;
    kvc_buf_cleanup(&b);
    if (!raw_msg(fd, &h, &m)) goto out;
    if (h.type == KVC_MSG_ERROR) goto refused;
    assert_int_equal(h.type, KVC_MSG_CHALLENGE);
    assert_int_equal(kvc_wire_parse_hello(m + KVC_WIRE_HDR_LEN, h.body_len, &ch), KVC_OK);
    r->chal_flags = ch.flags;
    kvc_mac_consumer(r->auth, nc, ch.nonce, KVC_PROTO_PUSH, r->hello_flags, ch.flags,
                     (kvc_span_t){(const uint8_t *)"D-raw", 5}, ch.engine_id, mac);
    kvc_wire_encode_auth(&b, KVC_WIRE_VERSION, KVC_PROTO_PUSH, mac);
    assert_int_equal(kvc_chan_init(&keys, r->auth, nc, ch.nonce, mac, false), KVC_OK);
    free(m);
    m = NULL;
    if (cons) {
        kvc_buf_t inner = {0};
        kvc_wire_encode_consumer(&inner, KVC_WIRE_VERSION, key, r->addr, r->addr_len);
        assert_int_equal(kvc_chan_seal(&keys, &b, KVC_WIRE_VERSION, inner.p, inner.len), KVC_OK);
        kvc_buf_cleanup(&inner);
    }
    if (write(fd, b.p, b.len) != (ssize_t)b.len) goto out;
    if (!raw_msg(fd, &h, &m)) goto out;
    if (h.type == KVC_MSG_ERROR) goto refused;
    assert_int_equal(h.type, KVC_MSG_SEALED);
    uint8_t *inner;
    size_t ilen;
    st = kvc_chan_open(&keys, m, KVC_WIRE_HDR_LEN + h.body_len, &inner, &ilen);
    if (st != KVC_OK) goto out;
    kvc_wire_hdr_t ih;
    kvc_wire_hs_t hs;
    assert_int_equal(kvc_wire_parse_hdr(inner, ilen, KVC_WIRE_MAX_BODY, &ih), KVC_OK);
    assert_int_equal(kvc_wire_parse_handshake(inner + KVC_WIRE_HDR_LEN, ih.body_len, &hs), KVC_OK);
    if (!r->paddr) {
        r->paddr = malloc(hs.worker_addr.len);
        assert_non_null(r->paddr);
        memcpy(r->paddr, hs.worker_addr.p, hs.worker_addr.len);
        r->paddr_len = hs.worker_addr.len;
    }
    kvc_wire_hs_cleanup(&hs);
    free(inner);
    goto out;
refused:;
    int32_t code;
    kvc_span_t text;
    assert_int_equal(kvc_wire_parse_error(m + KVC_WIRE_HDR_LEN, h.body_len, &code, &text), KVC_OK);
    st = (kvc_status_t)code;
out:
    kvc_chan_cleanup(&keys);
    kvc_buf_cleanup(&b);
    free(m);
    close(fd);
    return st;
}

static inline void raw_progress_ms(raw_t *r, int ms) {
    uint64_t end = kvc_now_ns() + (uint64_t)ms * 1000000ull;
    while (kvc_now_ns() < end)
        ucp_worker_progress(r->w);
}

/* Progresses this worker until cond holds; fails the test after ms. */
#define RAW_UNTIL(r, cond, ms)                                                                     \
    do {                                                                                           \
        uint64_t t0_ = kvc_now_ns();                                                               \
        while (!(cond)) {                                                                          \
            assert_true(kvc_now_ns() - t0_ < (uint64_t)(ms)*1000000ull);                           \
            ucp_worker_progress((r)->w);                                                           \
        }                                                                                          \
    } while (0)

/* The endpoint to the producer's worker (after a handshake). */
static inline void raw_connect(raw_t *r) {
    assert_non_null(r->paddr);
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
                          .address = (const ucp_address_t *)r->paddr};
    assert_int_equal(ucp_ep_create(r->w, &ep, &r->ep), UCS_OK);
}

/* One PULL of `count` blocks from remote block `remote` into local `local`
 * (count 0: no runs), eager, as a consumer sends it; waits until sent. */
static inline void raw_pull(raw_t *r, uint64_t xfer_id, const char *req, const char *tok,
                            uint16_t flags, uint32_t wait_ms, uint64_t key, uint64_t remote,
                            uint64_t local, uint64_t count) {
    kvc_run_t run = {remote, local, count};
    kvc_wire_pull_t pl = {.xfer_id = xfer_id,
                          .flags = flags,
                          .tp = 1,
                          .request_id = {(const uint8_t *)req, strlen(req)},
                          .runs = &run,
                          .n = count ? 1 : 0,
                          .wait_ms = wait_ms,
                          .parts = 1,
                          .cons_key = key};
    if (wait_ms) pl.flags |= KVC_PULL_WAIT | KVC_PULL_EXT;
    assert_int_equal(kvc_token_parse(tok, pl.pub_token), KVC_OK);
    memset(pl.xfer_token, 0x5a, KVC_TOKEN_LEN);
    kvc_buf_t b = {0};
    kvc_wire_encode_pull(&b, &pl);
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER};
    ucs_status_ptr_t q = ucp_am_send_nbx(r->ep, KVC_AM_PULL, NULL, 0, b.p, b.len, &rp);
    if (UCS_PTR_IS_PTR(q)) {
        RAW_UNTIL(r, ucp_request_check_status(q) != UCS_INPROGRESS, 5000);
        ucp_request_free(q);
    } else {
        assert_false(UCS_PTR_IS_ERR(q));
    }
    kvc_buf_cleanup(&b);
}

/* Leaves as a process that dies does (close: as one that closes its
 * endpoint first, in order). */
static inline void raw_leave(raw_t *r, bool close_ep) {
    if (r->ep && close_ep) {
        ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                  .flags = UCP_EP_CLOSE_FLAG_FORCE};
        void *q = ucp_ep_close_nbx(r->ep, &rp);
        if (UCS_PTR_IS_PTR(q)) {
            RAW_UNTIL(r, ucp_request_check_status(q) != UCS_INPROGRESS, 5000);
            ucp_request_free(q);
        }
    }
    r->ep = NULL;
    ucp_worker_release_address(r->w, r->addr);
    ucp_worker_destroy(r->w);
    ucp_cleanup(r->ctx);
    free(r->paddr);
    free(r->auth);
    memset(r, 0, sizeof(*r));
}

#endif
