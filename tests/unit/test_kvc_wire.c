/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests: libkvconnector wire formats, coalescing, kv_transfer_params
 * parsing, handshake MACs and publication membership (connector/wire.c,
 * params.c, auth.c, publish.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "connector/kvc_int.h"

static void encode_sample(kvc_buf_t *b, uint16_t version, uint32_t nreg, uint64_t nblocks) {
    static const uint8_t rkey[] = {1, 2, 3, 4, 5};
    static const uint8_t addr[] = {9, 8, 7};
    kvc_wire_region_t regs[4];
    for (uint32_t i = 0; i < nreg; i++) {
        regs[i].base = 0x10000 * (i + 1);
        regs[i].block_len = 4096;
        regs[i].len = 4096 * nblocks;
        regs[i].mem_type = 0;
        regs[i].flags = KVC_RFLAG_POOL;
        regs[i].rkey = (kvc_span_t){rkey, sizeof(rkey)};
    }
    kvc_wire_hs_t hs = {
        .engine_id = {(const uint8_t *)"engine-P", 8},
        .layout = {(const uint8_t *)"NHD", 3},
        .worker_addr = {addr, sizeof(addr)},
        .nonce = 0x1122334455667788ull,
        .num_blocks = nblocks,
        .tp_size = 2,
        .n_regions = nreg,
        .regions = regs,
    };
    size_t start = b->len;
    kvc_wire_encode_handshake(b, version, &hs);
    static const uint8_t mac[KVC_MAC_LEN] = {0xee};
    kvc_buf_put(b, mac, sizeof(mac));
    kvc_wire_end_msg(b, start);
}

static const uint8_t NONCE[KVC_NONCE_LEN] = {1, 2, 3};

static void test_header(void **state) {
    kvc_buf_t b = {0};
    kvc_wire_hdr_t h;
    kvc_wire_encode_hello(&b, KVC_WIRE_VERSION, KVC_MSG_HELLO, "abc", KVC_HFLAG_SECRET, NONCE);
    assert_false(b.failed);
    for (size_t n = 0; n < KVC_WIRE_HDR_LEN; n++)
        assert_int_equal(kvc_wire_parse_hdr(b.p, n, KVC_WIRE_MAX_HELLO, &h), KVC_AGAIN);
    assert_int_equal(kvc_wire_parse_hdr(b.p, b.len, KVC_WIRE_MAX_HELLO, &h), KVC_OK);
    assert_int_equal(h.type, KVC_MSG_HELLO);
    assert_int_equal(h.version, KVC_WIRE_VERSION);
    assert_int_equal(h.body_len, b.len - KVC_WIRE_HDR_LEN);
    kvc_wire_hello_t hh;
    assert_int_equal(kvc_wire_parse_hello(b.p + KVC_WIRE_HDR_LEN, h.body_len, &hh), KVC_OK);
    assert_int_equal(hh.engine_id.len, 3);
    assert_memory_equal(hh.engine_id.p, "abc", 3);
    assert_int_equal(hh.flags, KVC_HFLAG_SECRET);
    assert_memory_equal(hh.nonce, NONCE, KVC_NONCE_LEN);
    /* every truncation and any extra byte are rejected */
    for (size_t n = 0; n < h.body_len; n++)
        assert_int_equal(kvc_wire_parse_hello(b.p + KVC_WIRE_HDR_LEN, n, &hh), KVC_ERR_PROTOCOL);
    kvc_buf_u8(&b, 0);
    assert_int_equal(kvc_wire_parse_hello(b.p + KVC_WIRE_HDR_LEN, h.body_len + 1, &hh),
                     KVC_ERR_PROTOCOL);
    /* bad magic, oversized body */
    uint8_t bad[KVC_WIRE_HDR_LEN];
    memcpy(bad, b.p, sizeof(bad));
    bad[0] ^= 0xff;
    assert_int_equal(kvc_wire_parse_hdr(bad, sizeof(bad), KVC_WIRE_MAX_HELLO, &h),
                     KVC_ERR_PROTOCOL);
    memcpy(bad, b.p, sizeof(bad));
    bad[11] = 0x7f;
    assert_int_equal(kvc_wire_parse_hdr(bad, sizeof(bad), KVC_WIRE_MAX_HELLO, &h),
                     KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&b);
}

static void test_handshake_roundtrip(void **state) {
    kvc_buf_t b = {0};
    encode_sample(&b, KVC_WIRE_VERSION, 3, 100);
    assert_false(b.failed);
    kvc_wire_hdr_t h;
    assert_int_equal(kvc_wire_parse_hdr(b.p, b.len, KVC_WIRE_MAX_BODY, &h), KVC_OK);
    assert_int_equal(h.type, KVC_MSG_HANDSHAKE);
    kvc_wire_hs_t hs;
    assert_int_equal(kvc_wire_parse_handshake(b.p + KVC_WIRE_HDR_LEN, h.body_len, &hs), KVC_OK);
    assert_int_equal(hs.n_regions, 3);
    assert_int_equal(hs.num_blocks, 100);
    assert_int_equal(hs.tp_size, 2);
    assert_true(hs.nonce == 0x1122334455667788ull);
    assert_memory_equal(hs.engine_id.p, "engine-P", 8);
    assert_memory_equal(hs.layout.p, "NHD", 3);
    assert_int_equal(hs.worker_addr.len, 3);
    assert_int_equal(hs.regions[2].base, 0x30000);
    assert_int_equal(hs.regions[1].block_len, 4096);
    assert_int_equal(hs.regions[0].rkey.len, 5);
    assert_int_equal(hs.regions[0].flags, KVC_RFLAG_POOL);
    assert_int_equal(hs.signed_len, h.body_len - KVC_MAC_LEN);
    assert_int_equal(hs.mac[0], 0xee);
    kvc_wire_hs_cleanup(&hs);
    kvc_buf_cleanup(&b);
}

static void test_handshake_truncated_and_corrupt(void **state) {
    kvc_buf_t b = {0};
    encode_sample(&b, KVC_WIRE_VERSION, 2, 10);
    const uint8_t *body = b.p + KVC_WIRE_HDR_LEN;
    size_t len = b.len - KVC_WIRE_HDR_LEN;
    kvc_wire_hs_t hs;
    /* Every truncation fails cleanly (ASan catches any overread). */
    for (size_t n = 0; n < len; n++) {
        uint8_t *copy = malloc(n ? n : 1);
        memcpy(copy, body, n);
        assert_int_equal(kvc_wire_parse_handshake(copy, n, &hs), KVC_ERR_PROTOCOL);
        free(copy);
    }
    /* Flip each byte: parse may succeed or fail, never crash. */
    uint8_t *copy = malloc(len);
    for (size_t i = 0; i < len; i++) {
        memcpy(copy, body, len);
        copy[i] ^= 0xa5;
        if (kvc_wire_parse_handshake(copy, len, &hs) == KVC_OK) kvc_wire_hs_cleanup(&hs);
    }
    free(copy);
    kvc_buf_cleanup(&b);

    /* Geometry that does not add up: len != num_blocks * block_len. */
    kvc_buf_t g = {0};
    encode_sample(&g, KVC_WIRE_VERSION, 1, 10);
    /* region entry starts after: str16(8) u64 str16(3) u32 blob32(3) u64 u32 */
    size_t off = KVC_WIRE_HDR_LEN + 2 + 8 + 8 + 2 + 3 + 4 + 4 + 3 + 8 + 4;
    g.p[off + 8] ^= 1; /* len */
    assert_int_equal(
        kvc_wire_parse_handshake(g.p + KVC_WIRE_HDR_LEN, g.len - KVC_WIRE_HDR_LEN, &hs),
        KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&g);

    /* Region count far beyond the bytes present: rejected before allocating. */
    kvc_buf_t c = {0};
    encode_sample(&c, KVC_WIRE_VERSION, 0, 10);
    size_t nr = c.len - 4 - KVC_MAC_LEN;
    c.p[nr] = 0xff;
    c.p[nr + 1] = 0xff;
    assert_int_equal(
        kvc_wire_parse_handshake(c.p + KVC_WIRE_HDR_LEN, c.len - KVC_WIRE_HDR_LEN, &hs),
        KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&c);
}

/* The PULL trailer (KVC_PULL_EXT): registration wait and TP slice. */
static void test_pull_ext(void **state) {
    (void)state;
    kvc_run_t runs[2] = {{1, 2, 3}, {10, 20, 1}};
    kvc_buf_t b = {0};
    kvc_wire_pull_t pl = {.xfer_id = 7,
                          .flags = KVC_PULL_EXT | KVC_PULL_WAIT,
                          .tp = 2,
                          .request_id = {(const uint8_t *)"r", 1},
                          .runs = runs,
                          .n = 2,
                          .wait_ms = 1234,
                          .parts = 4,
                          .part = 3};
    kvc_wire_encode_pull(&b, &pl);
    kvc_wire_pull_t out;
    assert_int_equal(kvc_wire_parse_pull(b.p, b.len, &out), KVC_OK);
    assert_int_equal(out.wait_ms, 1234);
    assert_int_equal(out.parts, 4);
    assert_int_equal(out.part, 3);
    assert_int_equal(out.n, 2);
    assert_memory_equal(out.runs, runs, sizeof(runs));
    free(out.runs);
    for (size_t k = 0; k < b.len; k++)
        assert_int_equal(kvc_wire_parse_pull(b.p, k, &out), KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&b);
    /* part out of range, or zero parts: refused */
    pl.part = 4;
    kvc_wire_encode_pull(&b, &pl);
    assert_int_equal(kvc_wire_parse_pull(b.p, b.len, &out), KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&b);
    pl.parts = 0;
    pl.part = 0;
    kvc_wire_encode_pull(&b, &pl);
    assert_int_equal(kvc_wire_parse_pull(b.p, b.len, &out), KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&b);
    /* without the flag the defaults: whole blocks, no wait */
    pl.flags = 0;
    kvc_wire_encode_pull(&b, &pl);
    assert_int_equal(kvc_wire_parse_pull(b.p, b.len, &out), KVC_OK);
    assert_int_equal(out.parts, 1);
    assert_int_equal(out.part, 0);
    assert_int_equal(out.wait_ms, 0);
    free(out.runs);
    kvc_buf_cleanup(&b);
}

static void test_pull_and_data(void **state) {
    kvc_run_t runs[3] = {{1, 2, 3}, {10, 20, 1}, {UINT64_MAX, 0, 7}};
    kvc_buf_t b = {0};
    kvc_wire_pull_t pl = {.xfer_id = 42,
                          .flags = KVC_PULL_RNDV,
                          .tp = 16,
                          .xfer_token = {1, 2},
                          .pub_token = {3, 4},
                          .request_id = {(const uint8_t *)"req:1", 5},
                          .runs = runs,
                          .n = 3};
    kvc_wire_encode_pull(&b, &pl);
    kvc_wire_pull_t out;
    assert_int_equal(kvc_wire_parse_pull(b.p, b.len, &out), KVC_OK);
    assert_int_equal(out.flags, KVC_PULL_RNDV);
    assert_int_equal(out.tp, 16);
    assert_int_equal(out.xfer_id, 42);
    assert_int_equal(out.n, 3);
    assert_memory_equal(out.xfer_token, pl.xfer_token, KVC_TOKEN_LEN);
    assert_memory_equal(out.pub_token, pl.pub_token, KVC_TOKEN_LEN);
    assert_int_equal(out.request_id.len, 5);
    assert_memory_equal(out.request_id.p, "req:1", 5);
    assert_memory_equal(out.runs, runs, sizeof(runs));
    free(out.runs);
    for (size_t k = 0; k < b.len; k++)
        assert_int_equal(kvc_wire_parse_pull(b.p, k, &out), KVC_ERR_PROTOCOL);
    /* a pull of the previous version (no tp) is refused */
    b.p[0] = KVC_WIRE_VERSION - 1;
    assert_int_equal(kvc_wire_parse_pull(b.p, b.len, &out), KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&b);
    /* an empty request id is refused */
    pl.request_id.len = 0;
    kvc_wire_encode_pull(&b, &pl);
    assert_int_equal(kvc_wire_parse_pull(b.p, b.len, &out), KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&b);

    kvc_wire_data_hdr_t h = {7, 3, -5, 100, 8, {9, 9, 9}}, g;
    uint8_t raw[KVC_WIRE_DATA_HDR_LEN];
    kvc_wire_encode_data_hdr(raw, &h);
    assert_int_equal(kvc_wire_parse_data_hdr(raw, sizeof(raw), &g), KVC_OK);
    assert_memory_equal(&g, &h, sizeof(h));
    assert_int_equal(kvc_wire_parse_data_hdr(raw, sizeof(raw) - 1, &g), KVC_ERR_PROTOCOL);
    assert_int_equal(kvc_wire_parse_data_hdr(NULL, 0, &g), KVC_ERR_PROTOCOL);
}

/* The staged-shm messages (READY, POOL, SLOT): round trips, the bytes
 * pinned (little endian, as every other field), every other length
 * refused, and what no producer sends refused too. */
static void test_staged_messages(void **state) {
    (void)state;
    kvc_wire_ready_t r = {{0x0102030405060708ull, 2, 0, 40, 3, {0xaa, 0xbb}}, 0x2000}, r2;
    uint8_t rb[KVC_WIRE_READY_LEN + 1];
    kvc_wire_encode_ready(rb, &r);
    assert_int_equal(kvc_wire_parse_ready(rb, KVC_WIRE_READY_LEN, &r2), KVC_OK);
    assert_memory_equal(&r2.h, &r.h, sizeof(r.h));
    assert_int_equal(r2.off, 0x2000);
    static const uint8_t off_le[8] = {0, 0x20, 0, 0, 0, 0, 0, 0};
    assert_memory_equal(rb + KVC_WIRE_DATA_HDR_LEN, off_le, 8);
    assert_int_equal(rb[0], 0x08); /* the DATA header's xfer id, little endian */
    for (size_t n = 0; n <= sizeof(rb); n++)
        if (n != KVC_WIRE_READY_LEN)
            assert_int_equal(kvc_wire_parse_ready(rb, n, &r2), KVC_ERR_PROTOCOL);
    assert_int_equal(kvc_wire_parse_ready(NULL, KVC_WIRE_READY_LEN, &r2), KVC_ERR_PROTOCOL);
    kvc_wire_ready_t bad[3] = {r, r, r};
    bad[0].h.status = -3;          /* a refusal comes as DATA */
    bad[1].h.region = KVC_DATA_END; /* so does an END */
    bad[2].h.count = 0;            /* an empty chunk */
    for (int i = 0; i < 3; i++) {
        kvc_wire_encode_ready(rb, &bad[i]);
        assert_int_equal(kvc_wire_parse_ready(rb, KVC_WIRE_READY_LEN, &r2), KVC_ERR_PROTOCOL);
    }

    kvc_wire_pool_t p = {{9, 0, 0, 0, 0, {1}}, 0x7f0000000000ull, 64ull << 20, 4ull << 20}, p2;
    uint8_t pb[KVC_WIRE_POOL_LEN + 1];
    kvc_wire_encode_pool(pb, &p);
    assert_int_equal(kvc_wire_parse_pool(pb, KVC_WIRE_POOL_LEN, 12, &p2), KVC_OK);
    assert_memory_equal(&p2.h, &p.h, sizeof(p.h));
    assert_int_equal(p2.base, p.base);
    assert_int_equal(p2.len, p.len);
    assert_int_equal(p2.slot_bytes, p.slot_bytes);
    assert_int_equal(pb[KVC_WIRE_DATA_HDR_LEN + 8 + 3], 0x04); /* 64 MiB = 0x04000000 */
    for (size_t n = 0; n <= sizeof(pb); n++)
        if (n != KVC_WIRE_POOL_LEN)
            assert_int_equal(kvc_wire_parse_pool(pb, n, 12, &p2), KVC_ERR_PROTOCOL);
    /* The rkey (the message's data): none, or past the blob bound. */
    assert_int_equal(kvc_wire_parse_pool(pb, KVC_WIRE_POOL_LEN, 0, &p2), KVC_ERR_PROTOCOL);
    assert_int_equal(kvc_wire_parse_pool(pb, KVC_WIRE_POOL_LEN, KVC_WIRE_MAX_BLOB + 1, &p2),
                     KVC_ERR_PROTOCOL);
    kvc_wire_pool_t pbad[5] = {p, p, p, p, p};
    pbad[0].len = 0;
    pbad[1].slot_bytes = 0;
    pbad[2].slot_bytes = pbad[2].len + 1; /* a slot larger than the pool */
    pbad[3].slot_bytes = 3 << 20;         /* the pool not whole slots */
    pbad[4].base = UINT64_MAX - 100;      /* wraps the address space */
    for (int i = 0; i < 5; i++) {
        kvc_wire_encode_pool(pb, &pbad[i]);
        assert_int_equal(kvc_wire_parse_pool(pb, KVC_WIRE_POOL_LEN, 12, &p2), KVC_ERR_PROTOCOL);
    }

    kvc_wire_slot_t m = {77, {5, 6, 7}, KVC_SLOT_FREE, 3ull << 22}, m2;
    uint8_t sb[KVC_WIRE_SLOT_LEN + 1];
    kvc_wire_encode_slot(sb, &m);
    /* u64 xfer id, token, u32 kind, u32 0, u64 offset */
    uint8_t want[KVC_WIRE_SLOT_LEN] = {77};
    memcpy(want + 8, m.token, KVC_TOKEN_LEN);
    want[8 + KVC_TOKEN_LEN] = KVC_SLOT_FREE;
    want[8 + KVC_TOKEN_LEN + 8 + 2] = 0xc0;
    assert_memory_equal(sb, want, KVC_WIRE_SLOT_LEN);
    assert_int_equal(kvc_wire_parse_slot(sb, KVC_WIRE_SLOT_LEN, &m2), KVC_OK);
    assert_int_equal(m2.xfer_id, 77);
    assert_memory_equal(m2.token, m.token, KVC_TOKEN_LEN);
    assert_int_equal(m2.kind, KVC_SLOT_FREE);
    assert_int_equal(m2.off, m.off);
    for (size_t n = 0; n <= sizeof(sb); n++)
        if (n != KVC_WIRE_SLOT_LEN)
            assert_int_equal(kvc_wire_parse_slot(sb, n, &m2), KVC_ERR_PROTOCOL);
    uint32_t kinds[] = {0, KVC_SLOT_FREE + 1, UINT32_MAX};
    for (int i = 0; i < 3; i++) {
        m.kind = kinds[i];
        kvc_wire_encode_slot(sb, &m);
        assert_int_equal(kvc_wire_parse_slot(sb, KVC_WIRE_SLOT_LEN, &m2), KVC_ERR_PROTOCOL);
    }
}

static void check_notify(const char *txt, kvc_status_t want, const char *id, uint32_t tp) {
    kvc_span_t s;
    uint32_t t = 99;
    const uint8_t *tok = NULL;
    uint8_t msg[256];
    memset(msg, 0x5a, KVC_TOKEN_LEN);
    memcpy(msg + KVC_TOKEN_LEN, txt, strlen(txt));
    assert_int_equal(kvc_wire_parse_notify(msg, KVC_TOKEN_LEN + strlen(txt), &tok, &s, &t), want);
    if (want != KVC_OK) return;
    assert_ptr_equal(tok, msg);
    assert_int_equal(s.len, strlen(id));
    assert_memory_equal(s.p, id, s.len);
    assert_int_equal(t, tp);
}

static void test_notify(void **state) {
    check_notify("cmpl-abc-0-1234:1", KVC_OK, "cmpl-abc-0-1234", 1);
    check_notify("a:b:c:8", KVC_OK, "a:b:c", 8); /* split at the last ':' */
    check_notify("x::16", KVC_OK, "x:", 16);
    check_notify("plain-id", KVC_OK, "plain-id", 0); /* no tp */
    check_notify(":4", KVC_ERR_PROTOCOL, "", 0);     /* empty id */
    check_notify("a:", KVC_ERR_PROTOCOL, "", 0);     /* empty tp */
    check_notify("a:b:x", KVC_ERR_PROTOCOL, "", 0);  /* tp not a number */
    check_notify("a:1234567890", KVC_ERR_PROTOCOL, "", 0);
    check_notify("bad\nid:1", KVC_ERR_PROTOCOL, "", 0); /* not printable */
    check_notify("", KVC_ERR_PROTOCOL, "", 0);
    kvc_buf_t b = {0};
    static const uint8_t tok[KVC_TOKEN_LEN] = {7};
    kvc_wire_encode_notify(&b, tok, "r:1:2", 4);
    assert_int_equal(b.len, KVC_TOKEN_LEN + 7);
    assert_memory_equal(b.p, tok, KVC_TOKEN_LEN);
    assert_memory_equal(b.p + KVC_TOKEN_LEN, "r:1:2:4", 7);
    /* a notification without its token is malformed */
    kvc_span_t s;
    uint32_t t;
    const uint8_t *tk;
    assert_int_equal(kvc_wire_parse_notify(b.p, KVC_TOKEN_LEN, &tk, &s, &t), KVC_ERR_PROTOCOL);
    assert_int_equal(kvc_wire_parse_notify((const uint8_t *)"r:1", 3, &tk, &s, &t),
                     KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&b);
}

static void test_coalesce(void **state) {
    uint64_t r[] = {1, 2, 3, 7, 8, 20, 21, 22, 5};
    uint64_t l[] = {10, 11, 12, 13, 14, 30, 31, 40, 41};
    kvc_run_t *runs;
    size_t n;
    assert_int_equal(kvc_coalesce(r, l, 9, &runs, &n), KVC_OK);
    /* 1-3 -> 10-12 | 7-8 -> 13-14 | 20-21 -> 30-31 | 22 -> 40 | 5 -> 41 */
    assert_int_equal(n, 5);
    assert_int_equal(runs[0].remote, 1);
    assert_int_equal(runs[0].local, 10);
    assert_int_equal(runs[0].count, 3);
    assert_int_equal(runs[1].count, 2);
    assert_int_equal(runs[2].count, 2);
    assert_int_equal(runs[3].remote, 22);
    assert_int_equal(runs[3].count, 1);
    assert_int_equal(runs[4].remote, 5);
    free(runs);
    assert_int_equal(kvc_coalesce(r, l, 0, &runs, &n), KVC_OK);
    assert_null(runs);
    assert_int_equal(n, 0);
}

static void test_params_json(void **state) {
    uint64_t blocks[] = {0, 5, 9007199254740991ull};
    uint8_t tok[KVC_TOKEN_LEN];
    for (size_t i = 0; i < KVC_TOKEN_LEN; i++)
        tok[i] = (uint8_t)(0xf0 + i);
    char *js = kvc_params_to_json("eng\"1", "req:with:colons", "10.0.0.1", 5600, blocks, 3, 4, tok);
    assert_non_null(js);
    assert_non_null(strstr(js, "\"remote_kv_token\":\"f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff\""));
    kvc_remote_t r;
    char err[200];
    assert_int_equal(kvc_params_parse_json(js, &r, err, sizeof(err)), KVC_OK);
    assert_memory_equal(r.token, tok, KVC_TOKEN_LEN);
    assert_string_equal(r.engine_id, "eng\"1");
    assert_string_equal(r.request_id, "req:with:colons");
    assert_string_equal(r.host, "10.0.0.1");
    assert_int_equal(r.port, 5600);
    assert_int_equal(r.tp_size, 4);
    assert_int_equal(r.num_blocks, 3);
    assert_true(r.block_ids[2] == 9007199254740991ull);
    kvc_remote_cleanup(&r);
    assert_non_null(strstr(js, "\"do_remote_prefill\":true"));
    assert_non_null(strstr(js, "\"do_remote_decode\":false"));
    kvc_free(js);

    /* what a proxy forwards: extra keys, per-group block lists (one group) */
    const char *fwd = "{\"remote_block_ids\":[[4,5]],\"remote_engine_id\":\"e\","
                      "\"remote_request_id\":\"r\",\"remote_host\":\"h\",\"remote_port\":1,"
                      "\"remote_num_tokens\":33,\"do_remote_prefill\":true,"
                      "\"remote_kv_token\":\"00112233445566778899AABBCCDDEEFF\"}";
    assert_int_equal(kvc_params_parse_json(fwd, &r, err, sizeof(err)), KVC_OK);
    assert_int_equal(r.num_blocks, 2);
    assert_int_equal(r.block_ids[1], 5);
    assert_int_equal(r.tp_size, 1);
    kvc_remote_cleanup(&r);
    /* A hybrid model's several KV-cache groups: refused, not half-fetched. */
    const char *hyb = "{\"remote_block_ids\":[[4,5],[6]],\"remote_engine_id\":\"e\","
                      "\"remote_request_id\":\"r\",\"remote_host\":\"h\",\"remote_port\":1,"
                      "\"remote_kv_token\":\"00112233445566778899AABBCCDDEEFF\"}";
    assert_int_equal(kvc_params_parse_json(hyb, &r, err, sizeof(err)), KVC_ERR_INCOMPATIBLE);
    assert_non_null(strstr(err, "2 KV-cache groups"));

    const char *bad[] = {
        "",
        "[]",
        "{}",
        "not json",
        "{\"remote_block_ids\":[1],\"remote_engine_id\":\"e\",\"remote_request_id\":\"r\","
        "\"remote_host\":\"h\",\"remote_port\":0}",
        "{\"remote_block_ids\":[-1],\"remote_engine_id\":\"e\",\"remote_request_id\":\"r\","
        "\"remote_host\":\"h\",\"remote_port\":5}",
        "{\"remote_block_ids\":[1.5],\"remote_engine_id\":\"e\",\"remote_request_id\":\"r\","
        "\"remote_host\":\"h\",\"remote_port\":5}",
        "{\"remote_block_ids\":null,\"remote_engine_id\":\"e\",\"remote_request_id\":\"r\","
        "\"remote_host\":\"h\",\"remote_port\":5}",
        "{\"remote_block_ids\":[1],\"remote_engine_id\":null,\"remote_request_id\":\"r\","
        "\"remote_host\":\"h\",\"remote_port\":5}",
        "{\"remote_block_ids\":[1],\"remote_engine_id\":\"e\",\"remote_host\":\"h\","
        "\"remote_port\":5}",
        /* token missing, short, not hex, not a string */
        "{\"remote_block_ids\":[1],\"remote_engine_id\":\"e\",\"remote_request_id\":\"r\","
        "\"remote_host\":\"h\",\"remote_port\":5}",
        "{\"remote_block_ids\":[1],\"remote_engine_id\":\"e\",\"remote_request_id\":\"r\","
        "\"remote_host\":\"h\",\"remote_port\":5,\"remote_kv_token\":\"0011\"}",
        "{\"remote_block_ids\":[1],\"remote_engine_id\":\"e\",\"remote_request_id\":\"r\","
        "\"remote_host\":\"h\",\"remote_port\":5,"
        "\"remote_kv_token\":\"0011223344556677889900112233445g\"}",
        "{\"remote_block_ids\":[1],\"remote_engine_id\":\"e\",\"remote_request_id\":\"r\","
        "\"remote_host\":\"h\",\"remote_port\":5,\"remote_kv_token\":7}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(kvc_params_parse_json(bad[i], &r, err, sizeof(err)),
                         KVC_ERR_INVALID_PARAM);
}

static void test_auth_messages(void **state) {
    kvc_buf_t b = {0};
    uint8_t mac[KVC_MAC_LEN];
    memset(mac, 0x33, sizeof(mac));
    kvc_wire_encode_auth(&b, KVC_WIRE_VERSION, KVC_PROTO_PUSH, mac);
    kvc_wire_hdr_t h;
    assert_int_equal(kvc_wire_parse_hdr(b.p, b.len, KVC_WIRE_MAX_HELLO, &h), KVC_OK);
    assert_int_equal(h.type, KVC_MSG_AUTH);
    uint8_t proto;
    const uint8_t *m;
    assert_int_equal(kvc_wire_parse_auth(b.p + KVC_WIRE_HDR_LEN, h.body_len, &proto, &m), KVC_OK);
    assert_int_equal(proto, KVC_PROTO_PUSH);
    assert_memory_equal(m, mac, KVC_MAC_LEN);
    assert_int_equal(kvc_wire_parse_auth(b.p + KVC_WIRE_HDR_LEN, h.body_len - 1, &proto, &m),
                     KVC_ERR_PROTOCOL);
    b.p[KVC_WIRE_HDR_LEN] = 9; /* no such protocol */
    assert_int_equal(kvc_wire_parse_auth(b.p + KVC_WIRE_HDR_LEN, h.body_len, &proto, &m),
                     KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&b);

    kvc_wire_encode_error(&b, KVC_WIRE_VERSION, KVC_ERR_AUTH, "authentication failed");
    assert_int_equal(kvc_wire_parse_hdr(b.p, b.len, KVC_WIRE_MAX_HELLO, &h), KVC_OK);
    assert_int_equal(h.type, KVC_MSG_ERROR);
    int32_t st;
    kvc_span_t msg;
    assert_int_equal(kvc_wire_parse_error(b.p + KVC_WIRE_HDR_LEN, h.body_len, &st, &msg), KVC_OK);
    assert_int_equal(st, KVC_ERR_AUTH);
    assert_int_equal(msg.len, strlen("authentication failed"));
    for (size_t n = 0; n < h.body_len; n++)
        assert_int_equal(kvc_wire_parse_error(b.p + KVC_WIRE_HDR_LEN, n, &st, &msg),
                         KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&b);
}

static void test_macs(void **state) {
    struct kvc_agent x, y, none;
    memset(&x, 0, sizeof(x));
    memset(&y, 0, sizeof(y));
    memset(&none, 0, sizeof(none));
    x.secret = (uint8_t *)"cluster-secret-1";
    x.secret_len = 16;
    y.secret = (uint8_t *)"cluster-secret-2";
    y.secret_len = 16;
    uint8_t nc[KVC_NONCE_LEN] = {1}, np[KVC_NONCE_LEN] = {2};
    kvc_span_t c = {(const uint8_t *)"D", 1}, p = {(const uint8_t *)"P", 1};
    uint8_t m1[KVC_MAC_LEN], m2[KVC_MAC_LEN], m3[KVC_MAC_LEN];
    kvc_mac_consumer(&x, nc, np, 0, 3, 3, c, p, m1);
    kvc_mac_consumer(&x, nc, np, 0, 3, 3, c, p, m2);
    assert_true(kvc_mac_equal(m1, m2, KVC_MAC_LEN)); /* deterministic */
    kvc_mac_consumer(&y, nc, np, 0, 3, 3, c, p, m3);
    assert_false(kvc_mac_equal(m1, m3, KVC_MAC_LEN)); /* another secret */
    kvc_mac_consumer(&none, nc, np, 0, 3, 3, c, p, m3);
    assert_false(kvc_mac_equal(m1, m3, KVC_MAC_LEN)); /* no secret */
    np[5] ^= 1;
    kvc_mac_consumer(&x, nc, np, 0, 3, 3, c, p, m3);
    assert_false(kvc_mac_equal(m1, m3, KVC_MAC_LEN)); /* other nonce: no replay */
    np[5] ^= 1;
    kvc_mac_consumer(&x, nc, np, 1, 3, 3, c, p, m3);
    assert_false(kvc_mac_equal(m1, m3, KVC_MAC_LEN)); /* protocol is bound */
    kvc_mac_consumer(&x, nc, np, 0, 1, 3, c, p, m3);
    assert_false(kvc_mac_equal(m1, m3, KVC_MAC_LEN)); /* the HELLO's flags are bound */
    kvc_mac_consumer(&x, nc, np, 0, 3, 1, c, p, m3);
    assert_false(kvc_mac_equal(m1, m3, KVC_MAC_LEN)); /* the CHALLENGE's flags are bound */
    /* the producer MAC covers the body and differs from the consumer's */
    uint8_t body[40] = {0};
    kvc_mac_producer(&x, nc, np, body, sizeof(body), m2);
    assert_false(kvc_mac_equal(m1, m2, KVC_MAC_LEN));
    body[39] = 1;
    kvc_mac_producer(&x, nc, np, body, sizeof(body), m3);
    assert_false(kvc_mac_equal(m2, m3, KVC_MAC_LEN));
}

static void test_tokens_and_membership(void **state) {
    uint8_t t[KVC_TOKEN_LEN], u[KVC_TOKEN_LEN];
    char hex[2 * KVC_TOKEN_LEN + 1];
    assert_int_equal(kvc_random(t, sizeof(t)), KVC_OK);
    kvc_token_hex(t, hex);
    assert_int_equal(strlen(hex), 32);
    assert_int_equal(kvc_token_parse(hex, u), KVC_OK);
    assert_memory_equal(t, u, KVC_TOKEN_LEN);
    assert_int_equal(kvc_token_parse(NULL, u), KVC_ERR_INVALID_PARAM);
    assert_int_equal(kvc_token_parse("", u), KVC_ERR_INVALID_PARAM);
    hex[31] = 'x';
    assert_int_equal(kvc_token_parse(hex, u), KVC_ERR_INVALID_PARAM);

    uint64_t sorted[] = {3, 4, 5, 9, 20, 21};
    kvc_pub_t p;
    memset(&p, 0, sizeof(p));
    p.sorted = sorted;
    p.n = 6;
    assert_true(kvc_pub_has_run(&p, 3, 3));
    assert_true(kvc_pub_has_run(&p, 4, 2));
    assert_true(kvc_pub_has_run(&p, 9, 1));
    assert_true(kvc_pub_has_run(&p, 20, 2));
    assert_false(kvc_pub_has_run(&p, 3, 4)); /* 6 is not published */
    assert_false(kvc_pub_has_run(&p, 0, 1));
    assert_false(kvc_pub_has_run(&p, 8, 2));
    assert_false(kvc_pub_has_run(&p, 21, 2));
    assert_false(kvc_pub_has_run(&p, 22, 1));
    assert_false(kvc_pub_has_run(&p, 3, 0));
    assert_false(kvc_pub_has_run(&p, 3, UINT64_MAX));
    p.n = 0;
    assert_false(kvc_pub_has_run(&p, 3, 1));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_header),
        cmocka_unit_test(test_handshake_roundtrip),
        cmocka_unit_test(test_handshake_truncated_and_corrupt),
        cmocka_unit_test(test_pull_and_data),
        cmocka_unit_test(test_pull_ext),
        cmocka_unit_test(test_staged_messages),
        cmocka_unit_test(test_notify),
        cmocka_unit_test(test_coalesce),
        cmocka_unit_test(test_params_json),
        cmocka_unit_test(test_auth_messages),
        cmocka_unit_test(test_macs),
        cmocka_unit_test(test_tokens_and_membership),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
