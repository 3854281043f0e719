/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the side-channel messages libkvconnector parses from the
 * network — header, HELLO and CHALLENGE, AUTH, ERROR, HANDSHAKE (with its
 * CUDA IPC table, parsed against the handshake's regions), SEALED —
 * exactly as listen.c and peer.c feed them, the check of the handshake's MAC,
 * and the sealed channel: a SEALED message from the network never opens
 * without its key, and any input sealed opens to itself and to nothing once
 * a byte is changed.  The input is
 * copied into an exact-size heap buffer so any overread trips ASan.  Seeds:
 * messages captured from real handshakes (tests/integration/kvc_hostile.c,
 * KVC_CAPTURE_DIR). */
#include <stdlib.h>
#include <string.h>

#include "connector/kvc_int.h"

/* Both ends of one channel, keyed once (fixed secret, nonces and MAC). */
static kvc_chan_t chan_p, chan_c;

static void chans_init(void) {
    static bool done;
    static struct kvc_agent a;
    static const uint8_t nc[KVC_NONCE_LEN] = {1}, np[KVC_NONCE_LEN] = {2}, m[KVC_MAC_LEN] = {3};
    if (done) return;
    a.secret = (uint8_t *)"fuzz";
    a.secret_len = 4;
    if (kvc_chan_init(&chan_p, &a, nc, np, m, true) != KVC_OK ||
        kvc_chan_init(&chan_c, &a, nc, np, m, false) != KVC_OK)
        abort();
    done = true;
}

/* A whole SEALED message from the network: opened as peer.c does. */
static void sealed_in(const uint8_t *rec, size_t len) {
    kvc_chan_t c = chan_c;
    uint8_t *msg = NULL;
    size_t n = 0;
    if (kvc_chan_open(&c, rec, len, &msg, &n) == KVC_OK) free(msg); /* a forged tag: unlikely */
}

/* Seal the input (at least a header long, as every inner message is) as
 * producer, open it as consumer: the same bytes; one
 * bit changed anywhere: refused. */
static void seal_roundtrip(const uint8_t *d, size_t len) {
    kvc_chan_t p = chan_p, c = chan_c, c2 = chan_c;
    kvc_buf_t b = {0};
    if (kvc_chan_seal(&p, &b, KVC_WIRE_VERSION, d, len) != KVC_OK) {
        kvc_buf_cleanup(&b);
        return;
    }
    uint8_t *msg = NULL;
    size_t n = 0;
    if (kvc_chan_open(&c, b.p, b.len, &msg, &n) != KVC_OK || n != len ||
        (len && memcmp(msg, d, len)))
        abort();
    free(msg);
    size_t at = len ? d[0] % b.len : b.len - 1;
    b.p[at] ^= 0x20;
    if (kvc_chan_open(&c2, b.p, b.len, &msg, &n) == KVC_OK) abort();
    kvc_buf_cleanup(&b);
}

/* A CUDA IPC table as ipc.c parses it, for regions of these lengths: what
 * it accepts lies inside its allocations, and a VMM allocation's pieces
 * (none empty) lie inside the table's and sum to its size. */
static void ipc_table(const uint8_t *p, size_t len, const uint64_t *rlen, uint32_t n) {
    kvc_ipc_table_t t;
    if (kvc_wire_parse_ipc(p, len, rlen, n, &t) != KVC_OK) return;
    if (t.n_regions != n || !t.n_allocs || t.host.len == 0) abort();
    if (t.n_pieces &&
        (t.n_pieces > KVC_IPC_MAX_PIECES || !t.sock.len || t.token.len != KVC_IPC_FD_TOKEN_LEN))
        abort();
    for (uint32_t i = 0; i < t.n_allocs; i++) {
        const kvc_ipc_alloc_t *al = &t.allocs[i];
        if (al->kind == KVC_IPC_KIND_HANDLE && al->handle.len != KVC_IPC_HANDLE_LEN) abort();
        if (al->kind != KVC_IPC_KIND_VMM) continue;
        if (!al->n_pieces || al->first_piece > t.n_pieces ||
            al->n_pieces > t.n_pieces - al->first_piece)
            abort();
        uint64_t sum = 0;
        for (uint32_t k = 0; k < al->n_pieces; k++) {
            uint64_t sz = t.piece_size[al->first_piece + k];
            if (!sz || sz > al->size - sum) abort();
            sum += sz;
        }
        if (sum != al->size) abort();
    }
    for (uint32_t i = 0; i < n; i++) {
        const kvc_ipc_alloc_t *al = &t.allocs[t.reg_alloc[i]];
        if (t.reg_alloc[i] >= t.n_allocs || t.reg_off[i] > al->size ||
            rlen[i] > al->size - t.reg_off[i])
            abort();
    }
    kvc_wire_ipc_cleanup(&t);
}

static void body(uint16_t type, const uint8_t *b, size_t len) {
    switch (type) {
    case KVC_MSG_HELLO:
    case KVC_MSG_CHALLENGE: {
        kvc_wire_hello_t h;
        if (kvc_wire_parse_hello(b, len, &h) == KVC_OK) {
            volatile uint8_t sink = h.nonce[KVC_NONCE_LEN - 1] ^ h.flags;
            (void)sink;
            if (!kvc_printable((const char *)h.engine_id.p, h.engine_id.len)) abort();
        }
        break;
    }
    case KVC_MSG_AUTH: {
        uint8_t proto;
        const uint8_t *mac;
        if (kvc_wire_parse_auth(b, len, &proto, &mac) == KVC_OK) {
            if (proto > KVC_PROTO_PUSH) abort();
            volatile uint8_t sink = mac[KVC_MAC_LEN - 1];
            (void)sink;
        }
        break;
    }
    case KVC_MSG_ERROR: {
        int32_t st;
        kvc_span_t m;
        if (kvc_wire_parse_error(b, len, &st, &m) == KVC_OK &&
            !kvc_printable((const char *)m.p, m.len))
            abort();
        break;
    }
    default: {
        kvc_wire_hs_t hs;
        if (kvc_wire_parse_handshake(b, len, &hs) == KVC_OK) {
            /* touch what the consumer reads, and check its MAC as it does */
            if (hs.signed_len + KVC_MAC_LEN != len || hs.mac != b + hs.signed_len) abort();
            volatile uint64_t sink = hs.num_blocks;
            for (uint32_t i = 0; i < hs.n_regions; i++)
                sink += hs.regions[i].base + hs.regions[i].rkey.len +
                        (hs.regions[i].rkey.len ? hs.regions[i].rkey.p[0] : 0);
            (void)sink;
            static struct kvc_agent a;
            static uint8_t nonce[KVC_NONCE_LEN];
            uint8_t want[KVC_MAC_LEN];
            a.secret = (uint8_t *)"fuzz";
            a.secret_len = 4;
            kvc_mac_producer(&a, nonce, nonce, b, hs.signed_len, want);
            (void)kvc_mac_equal(want, hs.mac, KVC_MAC_LEN);
            uint64_t *rl = calloc(hs.n_regions ? hs.n_regions : 1, sizeof(*rl));
            for (uint32_t i = 0; rl && i < hs.n_regions; i++)
                rl[i] = hs.regions[i].len;
            if (rl && hs.ipc.len) ipc_table(hs.ipc.p, hs.ipc.len, rl, hs.n_regions);
            free(rl);
            kvc_wire_hs_cleanup(&hs);
        }
        break;
    }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    chans_init();
    kvc_wire_hdr_t h;
    if (kvc_wire_parse_hdr(buf, size, KVC_WIRE_MAX_BODY, &h) == KVC_OK &&
        h.type == KVC_MSG_SEALED && size >= KVC_WIRE_HDR_LEN + (size_t)h.body_len)
        sealed_in(buf, KVC_WIRE_HDR_LEN + (size_t)h.body_len);
    if (size >= KVC_WIRE_HDR_LEN && size <= 65536)
        seal_roundtrip(buf, size); /* a message or more */
    if (kvc_wire_parse_hdr(buf, size, KVC_WIRE_MAX_BODY, &h) == KVC_OK &&
        size >= KVC_WIRE_HDR_LEN + (size_t)h.body_len) {
        /* the body alone, in its own exact-size buffer */
        uint8_t *b = malloc(h.body_len ? h.body_len : 1);
        if (b) {
            memcpy(b, buf + KVC_WIRE_HDR_LEN, h.body_len);
            body(h.type, b, h.body_len);
            free(b);
        }
    }
    /* Every body parser on the raw input too (no header), the IPC table's
     * for one to four regions of 4 KiB. */
    for (uint16_t t = KVC_MSG_HELLO; t <= KVC_MSG_ERROR; t++)
        body(t, buf, size);
    static const uint64_t rl[4] = {4096, 4096, 4096, 4096};
    ipc_table(buf, size, rl, 1 + (uint32_t)(size % 4));
    free(buf);
    return 0;
}
