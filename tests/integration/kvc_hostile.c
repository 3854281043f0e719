/* SPDX-License-Identifier: Apache-2.0 */
/* kvc_hostile: a hostile libkvconnector peer for connector_hostile.py.
 *
 * It speaks the side channel and the active messages by hand, with the
 * library's own wire encoders (connector/kvc_int.h), to do what a
 * well-behaved agent never does.  Tests only; never installed.
 *
 * usage (the cluster secret, if any, from KVC_SECRET):
 *   kvc_hostile consumer PORT put REGION BLOCK
 *       authenticates asking for one-sided reads (rkeys), then writes 0xEE
 *       over the producer's block with ucp_put_nbx
 *       -> "PUT status=<UCX status> rkeys=<regions with a key>"
 *   kvc_hostile consumer PORT get REGION BLOCK
 *       the same, reading the block (published or not) with ucp_get_nbx
 *       -> "GET status=<UCX status> rkeys=<n> data=<first 8 bytes, hex>"
 * put/get wait at most 2 s for UCX; "Operation in progress" means it never
 * completed.
 *   kvc_hostile consumer PORT pull REQ TOKEN RUNS [REPEAT]
 *       RUNS: remote:local:count[,...]; sends the PULL REPEAT times (1), waits
 *       up to 3 s for an END or a refusal of each
 *       -> "PULL data=<DATA messages with bytes> refused=<first refusal or
 *          none> refusals=<n> ends=<n> rkeys=<regions with a key>"
 *       With KVC_HOSTILE_LEAVE set it asks for rendezvous data, never takes
 *       it, and leaves after 300 ms without closing anything.
 *   kvc_hostile consumer PORT notify REQ TOKEN TP
 *       -> "NOTIFY sent"
 *   kvc_hostile consumer PORT raw AM_ID BYTES [rndv]
 *       a raw UCX peer: one active message AM_ID of BYTES zero bytes (eager,
 *       or rendezvous), then it leaves without closing its endpoint
 *       -> "RAW status=<UCX status of the send>"
 *       KVC_HOSTILE_CLOSE: it leaves in order (endpoint closed, worker
 *       destroyed); KVC_HOSTILE_FAST: it leaves before the send or UCX's
 *       wire-up completed (UCX 1.13 may then abort the producer: SECURITY.md)
 * With KVC_HOSTILE_ERR_PEER its endpoint asks for peer-failure handling, as
 * the library's own endpoints do.
 *   kvc_hostile consumer PORT keys
 *       authenticates asking for one-sided reads and prints what the
 *       handshake unlocked, hex, for a relay test to look for in the bytes
 *       it saw -> "KEYS addr=<worker address> rkeys=<rkey>,<rkey>,..."
 *   kvc_hostile producer MODE REGIONS BLOCKS BLOCK_LEN SEED
 *       a producer whose pushes misbehave: MODE is ok (well-behaved, data
 *       is the test peer's pattern for SEED), dup (first message twice, last
 *       one missing), outside (one message for a block nobody asked for,
 *       then the rest), short (last message missing, then END), stray (every
 *       message with a wrong transfer token, no END)
 *       -> "READY port=N"; serves until stdin closes.
 * A failure of the tool itself prints "ERR <what>" and exits 1.
 * With KVC_CAPTURE_DIR set, every side-channel message and active message it
 * sends or receives is also written there, one file each (seeds for the fuzz
 * corpora: side-channel messages whole; active messages as the kvc_notify
 * target reads them, a selector byte then the bytes). */
#include "connector/kvc_int.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

enum { AM_PULL = 21, AM_DATA = 22, AM_NOTIFY = 23 };

static struct kvc_agent fake; /* only secret/secret_len are read (auth.c) */
static ucp_context_h ctx;
static ucp_worker_h worker;

static void capture(const char *kind, int sel, const void *p, size_t n) {
    static int seq;
    const char *dir = getenv("KVC_CAPTURE_DIR");
    if (!dir || !*dir) return;
    char path[512];
    snprintf(path, sizeof(path), "%s/%s-%d-%d", dir, kind, (int)getpid(), seq++);
    FILE *f = fopen(path, "wb");
    if (!f) return;
    if (sel >= 0) fputc(sel, f);
    fwrite(p, 1, n, f);
    fclose(f);
}

static void die(const char *what) {
    printf("ERR %s\n", what);
    fflush(stdout);
    _exit(1);
}

static void ucx_up(void) {
    ucp_config_t *cfg;
    if (ucp_config_read(NULL, NULL, &cfg) != UCS_OK) die("ucp_config_read");
    ucp_params_t pp = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                       .features = UCP_FEATURE_RMA | UCP_FEATURE_AM};
    ucs_status_t us = ucp_init(&pp, cfg, &ctx);
    ucp_config_release(cfg);
    if (us != UCS_OK) die("ucp_init");
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_worker_create(ctx, &wp, &worker) != UCS_OK) die("ucp_worker_create");
    const char *s = getenv("KVC_SECRET");
    if (s && *s) {
        fake.secret = (uint8_t *)s;
        fake.secret_len = strlen(s);
    }
}

static void xwrite(int fd, const void *p, size_t n) {
    const uint8_t *c = p;
    while (n) {
        ssize_t k = write(fd, c, n);
        if (k <= 0) die("side channel write");
        c += k;
        n -= (size_t)k;
    }
}

static void xread(int fd, void *p, size_t n) {
    uint8_t *c = p;
    while (n) {
        ssize_t k = read(fd, c, n);
        if (k <= 0) die("side channel read");
        c += k;
        n -= (size_t)k;
    }
}

/* One side-channel message; *body malloc'ed. */
static kvc_wire_hdr_t read_msg(int fd, uint8_t **body) {
    uint8_t h[KVC_WIRE_HDR_LEN];
    xread(fd, h, sizeof(h));
    kvc_wire_hdr_t hdr;
    if (kvc_wire_parse_hdr(h, sizeof(h), KVC_WIRE_MAX_BODY, &hdr) != KVC_OK) die("bad header");
    uint8_t *m = malloc(KVC_WIRE_HDR_LEN + hdr.body_len + 1);
    if (!m) die("oom");
    memcpy(m, h, sizeof(h));
    xread(fd, m + KVC_WIRE_HDR_LEN, hdr.body_len);
    static const char *names[] = {"msg",  "hello", "handshake", "challenge",
                                  "auth", "error", "sealed"};
    capture(names[hdr.type <= 6 ? hdr.type : 0], -1, m, KVC_WIRE_HDR_LEN + hdr.body_len);
    *body = malloc(hdr.body_len + 1);
    if (!*body) die("oom");
    memcpy(*body, m + KVC_WIRE_HDR_LEN, hdr.body_len);
    free(m);
    return hdr;
}

static void progress_until(void *req) {
    if (!UCS_PTR_IS_PTR(req)) return;
    for (int i = 0; i < 2000000 && ucp_request_check_status(req) == UCS_INPROGRESS; i++)
        ucp_worker_progress(worker);
    ucp_request_free(req);
}

/* Waits (at most 2 s) for a request; its status. */
static ucs_status_t wait_req(ucs_status_ptr_t q) {
    if (UCS_PTR_IS_ERR(q)) return UCS_PTR_STATUS(q);
    if (!UCS_PTR_IS_PTR(q)) return UCS_OK;
    uint64_t end = kvc_now_ns() + 2000000000ull;
    while (ucp_request_check_status(q) == UCS_INPROGRESS && kvc_now_ns() < end)
        ucp_worker_progress(worker);
    ucs_status_t st = ucp_request_check_status(q);
    if (st != UCS_INPROGRESS) ucp_request_free(q);
    return st;
}

static void progress_for_ms(int ms) {
    uint64_t end = kvc_now_ns() + (uint64_t)ms * 1000000ull;
    while (kvc_now_ns() < end)
        ucp_worker_progress(worker);
}

/* ------------------------------------------------------------- consumer -- */

static int data_msgs, refused, refusals, ends; /* what the producer sent us */

static void scratch_done(void *req, ucs_status_t st, size_t length, void *ud) {
    free(ud);
    ucp_request_free(req);
}

static ucs_status_t on_data(void *arg, const void *header, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *param) {
    kvc_wire_data_hdr_t h;
    capture("data", 2, header, hlen);
    if (kvc_wire_parse_data_hdr(header, hlen, &h) != KVC_OK) return UCS_OK;
    if (h.status != 0) {
        if (!refused) refused = h.status;
        refusals++;
    } else if (h.region == KVC_DATA_END)
        ends++;
    else
        data_msgs++;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) && getenv("KVC_HOSTILE_LEAVE"))
        return UCS_INPROGRESS; /* holds the data unread; the process leaves soon */
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        /* Take it (into scratch) so that the sender is not left hanging. */
        void *scratch = malloc(len ? len : 1);
        ucp_request_param_t rp = {.op_attr_mask =
                                      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                                  .cb.recv_am = scratch_done,
                                  .user_data = scratch};
        ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker, data, scratch, len, &rp);
        if (!UCS_PTR_IS_PTR(r)) free(scratch);
        return UCS_INPROGRESS;
    }
    return UCS_OK;
}

static void set_handler(unsigned id, ucp_am_recv_callback_t cb) {
    ucp_am_handler_param_t hp = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                               UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB,
                                 .id = id,
                                 .flags = UCP_AM_FLAG_WHOLE_MSG,
                                 .cb = cb};
    if (ucp_worker_set_am_recv_handler(worker, &hp) != UCS_OK) die("am handler");
}

static int consumer(int argc, char **argv) {
    if (argc < 4) die("usage");
    int port = atoi(argv[2]);
    const char *cmd = argv[3];
    ucx_up();
    set_handler(AM_DATA, on_data);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa))) die("connect");
    uint8_t nc[KVC_NONCE_LEN];
    kvc_random(nc, sizeof(nc));
    kvc_buf_t b = {0};
    kvc_wire_encode_hello(&b, KVC_WIRE_VERSION, KVC_MSG_HELLO, "D-hostile",
                          fake.secret ? KVC_HFLAG_SECRET : 0, nc);
    xwrite(fd, b.p, b.len);
    capture("hello", -1, b.p, b.len);
    kvc_buf_cleanup(&b);
    uint8_t *body;
    kvc_wire_hdr_t h = read_msg(fd, &body);
    if (h.type != KVC_MSG_CHALLENGE) die("no challenge");
    kvc_wire_hello_t ch;
    if (kvc_wire_parse_hello(body, h.body_len, &ch) != KVC_OK) die("bad challenge");
    /* "keys" asks as an automatic consumer does: it is given rkeys where
     * one-sided reads serve it, and is not refused where they cannot. */
    uint8_t proto = !strcmp(cmd, "put") || !strcmp(cmd, "get") ? KVC_PROTO_GET
                    : !strcmp(cmd, "keys")                    ? KVC_PROTO_AUTO
                                                              : KVC_PROTO_PUSH;
    uint8_t mac[KVC_MAC_LEN];
    kvc_mac_consumer(&fake, nc, ch.nonce, proto, fake.secret ? KVC_HFLAG_SECRET : 0, ch.flags,
                     (kvc_span_t){(const uint8_t *)"D-hostile", 9}, ch.engine_id, mac);
    kvc_wire_encode_auth(&b, KVC_WIRE_VERSION, proto, mac);
    xwrite(fd, b.p, b.len);
    capture("auth", -1, b.p, b.len);
    kvc_buf_cleanup(&b);
    kvc_chan_t ch_keys; /* before the challenge's nonce goes with its body */
    if (kvc_chan_init(&ch_keys, &fake, nc, ch.nonce, mac, false) != KVC_OK) die("keys");
    free(body);
    h = read_msg(fd, &body);
    if (h.type == KVC_MSG_ERROR) die("refused by the producer");
    if (h.type != KVC_MSG_SEALED) die("no sealed handshake");
    /* the whole SEALED message again (read_msg split off its header) */
    uint8_t *rec = malloc(KVC_WIRE_HDR_LEN + h.body_len), *inner;
    size_t ilen;
    if (!rec) die("oom");
    kvc_buf_u32(&b, KVC_WIRE_MAGIC);
    kvc_buf_u16(&b, h.version);
    kvc_buf_u16(&b, h.type);
    kvc_buf_u32(&b, h.body_len);
    memcpy(rec, b.p, KVC_WIRE_HDR_LEN);
    memcpy(rec + KVC_WIRE_HDR_LEN, body, h.body_len);
    kvc_buf_cleanup(&b);
    if (kvc_chan_open(&ch_keys, rec, KVC_WIRE_HDR_LEN + h.body_len, &inner, &ilen) != KVC_OK)
        die("sealed handshake does not open");
    capture("handshake", -1, inner, ilen);
    free(rec);
    free(body);
    kvc_wire_hdr_t ih;
    if (kvc_wire_parse_hdr(inner, ilen, KVC_WIRE_MAX_BODY, &ih) != KVC_OK ||
        ih.type != KVC_MSG_HANDSHAKE || ilen != KVC_WIRE_HDR_LEN + (size_t)ih.body_len)
        die("sealed message is not a handshake");
    body = inner + KVC_WIRE_HDR_LEN;
    kvc_wire_hs_t hs;
    if (kvc_wire_parse_handshake(body, ih.body_len, &hs) != KVC_OK) die("bad handshake");
    if (!strcmp(cmd, "keys")) {
        printf("KEYS addr=");
        for (size_t i = 0; i < hs.worker_addr.len; i++)
            printf("%02x", hs.worker_addr.p[i]);
        printf(" rkeys=");
        for (uint32_t r = 0; r < hs.n_regions; r++) {
            for (size_t i = 0; i < hs.regions[r].rkey.len; i++)
                printf("%02x", hs.regions[r].rkey.p[i]);
            printf("%s", r + 1 < hs.n_regions ? "," : "");
        }
        printf("\n");
        fflush(stdout);
        _exit(0);
    }
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
                          .address = (const ucp_address_t *)hs.worker_addr.p};
    if (getenv("KVC_HOSTILE_ERR_PEER")) { /* as the library's own endpoints */
        ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    }
    ucp_ep_h e;
    if (ucp_ep_create(worker, &ep, &e) != UCS_OK) die("ep");

    if ((!strcmp(cmd, "put") || !strcmp(cmd, "get")) && argc >= 6) {
        bool put = !strcmp(cmd, "put");
        uint32_t r = (uint32_t)atoi(argv[4]);
        uint64_t blk = strtoull(argv[5], NULL, 10);
        int keys = 0;
        for (uint32_t i = 0; i < hs.n_regions; i++)
            keys += hs.regions[i].rkey.len > 0;
        if (r >= hs.n_regions || !hs.regions[r].rkey.len) {
            printf("%s status=no-rkey rkeys=%d\n", put ? "PUT" : "GET", keys);
            fflush(stdout);
            _exit(0);
        }
        ucp_rkey_h rk;
        if (ucp_ep_rkey_unpack(e, hs.regions[r].rkey.p, &rk) != UCS_OK) {
            printf("%s status=rkey-unpack-failed rkeys=%d\n", put ? "PUT" : "GET", keys);
            fflush(stdout);
            _exit(0);
        }
        size_t bl = hs.regions[r].block_len;
        uint8_t *buf = malloc(bl);
        memset(buf, put ? 0xEE : 0, bl);
        ucp_request_param_t rp = {0};
        uint64_t addr = hs.regions[r].base + blk * bl;
        ucs_status_t st = wait_req(put ? ucp_put_nbx(e, buf, bl, addr, rk, &rp)
                                       : ucp_get_nbx(e, buf, bl, addr, rk, &rp));
        if (st == UCS_OK) st = wait_req(ucp_ep_flush_nbx(e, &rp));
        printf("%s status=%s rkeys=%d", put ? "PUT" : "GET", ucs_status_string(st), keys);
        if (!put) {
            printf(" data=");
            for (int i = 0; i < 8; i++)
                printf("%02x", buf[i]);
        }
        printf("\n");
        fflush(stdout);
        _exit(0); /* requests may still be in flight: no orderly teardown */
    }
    if (!strcmp(cmd, "pull") && argc >= 7) {
        kvc_wire_pull_t pl = {.xfer_id = 1, .request_id = {(const uint8_t *)argv[4], 0}};
        pl.request_id.len = strlen(argv[4]);
        kvc_random(pl.xfer_token, KVC_TOKEN_LEN);
        if (kvc_token_parse(argv[5], pl.pub_token) != KVC_OK) die("token");
        kvc_run_t runs[64];
        size_t n = 0;
        for (char *s = argv[6]; *s && n < 64; n++) {
            char *end;
            runs[n].remote = strtoull(s, &end, 10);
            runs[n].local = strtoull(end + 1, &end, 10);
            runs[n].count = strtoull(end + 1, &end, 10);
            s = end + (*end == ',');
        }
        pl.runs = runs;
        pl.n = n;
        int repeat = argc >= 8 ? atoi(argv[7]) : 1;
        bool leave = getenv("KVC_HOSTILE_LEAVE") != NULL;
        if (leave) pl.flags |= KVC_PULL_RNDV;
        for (int i = 0; i < repeat; i++) {
            pl.xfer_id = (uint64_t)i + 1;
            kvc_buf_cleanup(&b);
            kvc_wire_encode_pull(&b, &pl);
            capture("pull", 1, b.p, b.len);
            ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                      .flags = UCP_AM_SEND_FLAG_REPLY};
            progress_until(ucp_am_send_nbx(e, AM_PULL, NULL, 0, b.p, b.len, &rp));
        }
        uint64_t end = kvc_now_ns() + (leave ? 300000000ull : 3000000000ull);
        while ((leave || refusals + ends < repeat) && kvc_now_ns() < end)
            ucp_worker_progress(worker);
        progress_for_ms(50); /* stragglers */
        int keys = 0;
        for (uint32_t i = 0; i < hs.n_regions; i++)
            keys += hs.regions[i].rkey.len > 0;
        printf("PULL data=%d refused=%s refusals=%d ends=%d rkeys=%d\n", data_msgs,
               refused ? kvc_status_str((kvc_status_t)refused) : "none", refusals, ends, keys);
        fflush(stdout);
        _exit(0); /* a one-shot tool: no orderly UCX teardown */
    }
    if (!strcmp(cmd, "raw") && argc >= 6) {
        size_t n = strtoull(argv[5], NULL, 10);
        uint8_t *m = calloc(1, n ? n : 1);
        if (!m) die("oom");
        ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                  .flags = argc >= 7 && !strcmp(argv[6], "rndv")
                                               ? UCP_AM_SEND_FLAG_RNDV
                                               : UCP_AM_SEND_FLAG_EAGER};
        ucs_status_ptr_t q = ucp_am_send_nbx(e, (unsigned)atoi(argv[4]), NULL, 0, m, n, &rp);
        if (getenv("KVC_HOSTILE_FAST")) { /* gone before wireup completes */
            ucp_worker_progress(worker);
            _exit(0);
        }
        ucs_status_t st = wait_req(q);
        progress_for_ms(100);
        printf("RAW status=%s\n", ucs_status_string(st));
        fflush(stdout);
        if (getenv("KVC_HOSTILE_CLOSE")) { /* leaves in order instead */
            ucp_request_param_t cp = {0};
            wait_req(ucp_ep_close_nbx(e, &cp));
            ucp_worker_destroy(worker);
            ucp_cleanup(ctx);
        }
        _exit(0); /* leaves: no endpoint close, no UCX teardown */
    }
    if (!strcmp(cmd, "notify") && argc >= 7) {
        uint8_t tok[KVC_TOKEN_LEN];
        if (kvc_token_parse(argv[5], tok) != KVC_OK) die("token");
        kvc_wire_encode_notify(&b, tok, argv[4], (uint32_t)atoi(argv[6]));
        capture("notify", 0, b.p, b.len);
        ucp_request_param_t rp = {0};
        progress_until(ucp_am_send_nbx(e, AM_NOTIFY, NULL, 0, b.p, b.len, &rp));
        progress_until(ucp_ep_flush_nbx(e, &rp));
        printf("NOTIFY sent\n");
        fflush(stdout);
        _exit(0);
    }
    die("usage");
    return 1;
}

/* ------------------------------------------------------------- producer -- */

static const char *mode;
static size_t nreg, block_len;
static uint64_t nblocks, seed;

static uint64_t mix(uint64_t x) { /* the test peer's pattern (connector_peer.c) */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void pattern(size_t r, uint64_t b, uint8_t *out) {
    uint64_t base = mix(seed ^ ((uint64_t)r << 48) ^ (b << 8));
    for (size_t i = 0; i < block_len; i += 8) {
        uint64_t v = mix(base + i);
        size_t k = block_len - i < 8 ? block_len - i : 8;
        memcpy(out + i, &v, k);
    }
}

/* Sends one DATA message of `count` blocks starting at remote block `rb`
 * into local block `lb`.  Buffers live until exit (a test tool). */
static void send_data(ucp_ep_h ep, const kvc_wire_pull_t *pl, uint32_t region, uint64_t rb,
                      uint64_t lb, uint64_t count, bool bad_token) {
    uint8_t *hdr = malloc(KVC_WIRE_DATA_HDR_LEN);
    uint8_t *payload = malloc(count * block_len + 1);
    for (uint64_t i = 0; i < count; i++)
        pattern(region, rb + i, payload + i * block_len);
    kvc_wire_data_hdr_t h = {pl->xfer_id, region, 0, lb, count, {0}};
    memcpy(h.token, pl->xfer_token, KVC_TOKEN_LEN);
    if (bad_token) h.token[0] ^= 0xff;
    kvc_wire_encode_data_hdr(hdr, &h);
    ucp_request_param_t rp = {0};
    ucs_status_ptr_t r =
        ucp_am_send_nbx(ep, AM_DATA, hdr, KVC_WIRE_DATA_HDR_LEN, payload, count * block_len, &rp);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r); /* completes on its own */
}

static void send_end(ucp_ep_h ep, const kvc_wire_pull_t *pl, uint64_t sent) {
    uint8_t *hdr = malloc(KVC_WIRE_DATA_HDR_LEN);
    kvc_wire_data_hdr_t h = {pl->xfer_id, KVC_DATA_END, 0, 0, sent, {0}};
    memcpy(h.token, pl->xfer_token, KVC_TOKEN_LEN);
    kvc_wire_encode_data_hdr(hdr, &h);
    ucp_request_param_t rp = {0};
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, AM_DATA, hdr, KVC_WIRE_DATA_HDR_LEN, NULL, 0, &rp);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
}

static ucs_status_t on_pull(void *arg, const void *header, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *param) {
    kvc_wire_pull_t pl;
    capture("pull", 1, data, len);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
    if (kvc_wire_parse_pull(data, len, &pl) != KVC_OK) return UCS_OK;
    ucp_ep_h ep = param->reply_ep;
    /* One message per (run, region, block). */
    size_t total = 0;
    for (size_t i = 0; i < pl.n; i++)
        total += pl.runs[i].count * nreg;
    bool dup = !strcmp(mode, "dup"), shrt = !strcmp(mode, "short"), stray = !strcmp(mode, "stray");
    if (!strcmp(mode, "outside")) {
        /* a local block nobody asked for: the highest not in a run */
        uint64_t lb = nblocks - 1;
        for (bool hit = true; hit && lb > 0;) {
            hit = false;
            for (size_t i = 0; i < pl.n; i++)
                if (lb >= pl.runs[i].local && lb < pl.runs[i].local + pl.runs[i].count) hit = true;
            if (hit) lb--;
        }
        send_data(ep, &pl, 0, 0, lb, 1, false);
    }
    size_t k = 0, sent = 0;
    for (size_t i = 0; i < pl.n; i++)
        for (uint32_t r = 0; r < nreg; r++)
            for (uint64_t j = 0; j < pl.runs[i].count; j++, k++) {
                if ((dup || shrt) && k == total - 1) continue; /* the last one goes missing */
                send_data(ep, &pl, r, pl.runs[i].remote + j, pl.runs[i].local + j, 1, stray);
                sent++;
                if (dup && k == 0) {
                    send_data(ep, &pl, r, pl.runs[i].remote + j, pl.runs[i].local + j, 1, false);
                    sent++;
                }
            }
    if (!stray) send_end(ep, &pl, sent);
    free(pl.runs);
    return UCS_OK;
}

static ucs_status_t on_notify(void *arg, const void *header, size_t hlen, void *data, size_t len,
                              const ucp_am_recv_param_t *param) {
    capture("notify", 0, data, len);
    return UCS_OK;
}

/* Serves one side-channel client, blocking (consumers under test answer at
 * once): HELLO, CHALLENGE, AUTH (not even checked: this producer is the
 * hostile one), HANDSHAKE without rkeys, MACed and sealed so the consumer
 * accepts it. */
static void serve_handshake(int fd, const void *waddr, size_t wlen) {
    struct timeval tv = {.tv_sec = 3};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    uint8_t *body;
    kvc_wire_hdr_t h = read_msg(fd, &body);
    kvc_wire_hello_t hello;
    if (h.type != KVC_MSG_HELLO || kvc_wire_parse_hello(body, h.body_len, &hello) != KVC_OK)
        die("bad hello");
    uint8_t nc[KVC_NONCE_LEN], np[KVC_NONCE_LEN];
    memcpy(nc, hello.nonce, sizeof(nc));
    free(body);
    kvc_random(np, sizeof(np));
    kvc_buf_t b = {0};
    kvc_wire_encode_hello(&b, KVC_WIRE_VERSION, KVC_MSG_CHALLENGE, "P-hostile",
                          fake.secret ? KVC_HFLAG_SECRET : 0, np);
    xwrite(fd, b.p, b.len);
    kvc_buf_cleanup(&b);
    h = read_msg(fd, &body);
    uint8_t proto_c;
    const uint8_t *mac_c;
    if (h.type != KVC_MSG_AUTH || kvc_wire_parse_auth(body, h.body_len, &proto_c, &mac_c) != KVC_OK)
        die("bad auth");
    kvc_chan_t keys;
    if (kvc_chan_init(&keys, &fake, nc, np, mac_c, true) != KVC_OK) die("keys");
    free(body);
    kvc_wire_region_t regs[64];
    memset(regs, 0, sizeof(regs));
    for (size_t r = 0; r < nreg; r++) {
        regs[r].base = 0x100000 * (r + 1);
        regs[r].block_len = block_len;
        regs[r].len = block_len * nblocks;
        /* "cudamem": device memory the consumer cannot read one-sided (it
         * must be pushed); "memtype": a memory type nobody knows. */
        if (!strcmp(mode, "cudamem")) regs[r].mem_type = KVC_MEM_CUDA;
        if (!strcmp(mode, "memtype")) regs[r].mem_type = 7;
    }
    kvc_wire_hs_t hs = {.engine_id = {(const uint8_t *)"P-hostile", 9},
                        .layout = {(const uint8_t *)"NHD", 3},
                        .worker_addr = {waddr, wlen},
                        .num_blocks = nblocks,
                        .tp_size = 1,
                        .n_regions = (uint32_t)nreg,
                        .regions = regs};
    kvc_wire_encode_handshake(&b, KVC_WIRE_VERSION, &hs);
    uint8_t mac[KVC_MAC_LEN];
    kvc_mac_producer(&fake, nc, np, b.p + KVC_WIRE_HDR_LEN, b.len - KVC_WIRE_HDR_LEN, mac);
    kvc_buf_put(&b, mac, sizeof(mac));
    kvc_wire_end_msg(&b, 0);
    kvc_buf_t sealed = {0};
    if (kvc_chan_seal(&keys, &sealed, KVC_WIRE_VERSION, b.p, b.len) != KVC_OK) die("seal");
    xwrite(fd, sealed.p, sealed.len);
    kvc_buf_cleanup(&sealed);
    kvc_buf_cleanup(&b);
}

static int producer(int argc, char **argv) {
    if (argc < 7) die("usage");
    mode = argv[2];
    nreg = strtoul(argv[3], NULL, 10);
    nblocks = strtoull(argv[4], NULL, 10);
    block_len = strtoul(argv[5], NULL, 10);
    seed = strtoull(argv[6], NULL, 10);
    if (nreg == 0 || nreg > 64) die("regions");
    ucx_up();
    set_handler(AM_PULL, on_pull);
    set_handler(AM_NOTIFY, on_notify);
    ucp_address_t *waddr;
    size_t wlen;
    if (ucp_worker_get_address(worker, &waddr, &wlen) != UCS_OK) die("address");
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    socklen_t sl = sizeof(sa);
    if (bind(lfd, (struct sockaddr *)&sa, sl) || listen(lfd, 16) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl))
        die("listen");
    printf("READY port=%u\n", ntohs(sa.sin_port));
    fflush(stdout);
    for (;;) {
        struct pollfd pf[2] = {{.fd = lfd, .events = POLLIN}, {.fd = 0, .events = POLLIN}};
        poll(pf, 2, 1);
        if (pf[1].revents) break; /* stdin closed (or anything written): quit */
        if (pf[0].revents & POLLIN) {
            int fd = accept(lfd, NULL, NULL);
            if (fd >= 0) {
                serve_handshake(fd, waddr, wlen);
                close(fd);
            }
        }
        for (int i = 0; i < 64 && ucp_worker_progress(worker); i++) {
        }
    }
    fflush(stdout);
    _exit(0); /* buffers of sends live until exit by design */
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 2 && !strcmp(argv[1], "consumer")) return consumer(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "producer")) return producer(argc, argv);
    die("usage: kvc_hostile consumer|producer ...");
    return 1;
}
