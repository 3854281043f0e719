/* Unit tests: libkvconnector wire formats, coalescing and kv_transfer_params
 * parsing (connector/wire.c, connector/params.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "kvc_int.h"

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
    kvc_wire_encode_handshake(b, version, &hs);
}

static void test_header(void **state) {
    kvc_buf_t b = {0};
    kvc_wire_hdr_t h;
    kvc_wire_encode_hello(&b, KVC_WIRE_VERSION, "abc", "\x01\x02", 2);
    assert_false(b.failed);
    for (size_t n = 0; n < KVC_WIRE_HDR_LEN; n++)
        assert_int_equal(kvc_wire_parse_hdr(b.p, n, KVC_WIRE_MAX_HELLO, &h), KVC_AGAIN);
    assert_int_equal(kvc_wire_parse_hdr(b.p, b.len, KVC_WIRE_MAX_HELLO, &h), KVC_OK);
    assert_int_equal(h.type, KVC_MSG_HELLO);
    assert_int_equal(h.version, KVC_WIRE_VERSION);
    assert_int_equal(h.body_len, b.len - KVC_WIRE_HDR_LEN);
    kvc_span_t id, addr;
    assert_int_equal(kvc_wire_parse_hello(b.p + KVC_WIRE_HDR_LEN, h.body_len, &id, &addr), KVC_OK);
    assert_int_equal(id.len, 3);
    assert_memory_equal(id.p, "abc", 3);
    assert_int_equal(addr.len, 2);
    /* short bodies are rejected; the address is optional */
    assert_int_equal(kvc_wire_parse_hello(b.p + KVC_WIRE_HDR_LEN, h.body_len - 1, &id, &addr),
                     KVC_ERR_PROTOCOL);
    assert_int_equal(kvc_wire_parse_hello(b.p + KVC_WIRE_HDR_LEN, 5, &id, &addr), KVC_OK);
    assert_int_equal(addr.len, 0);
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
    size_t nr = c.len - 4;
    c.p[nr] = 0xff;
    c.p[nr + 1] = 0xff;
    assert_int_equal(
        kvc_wire_parse_handshake(c.p + KVC_WIRE_HDR_LEN, c.len - KVC_WIRE_HDR_LEN, &hs),
        KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&c);
}

static void test_pull_and_data(void **state) {
    kvc_run_t runs[3] = {{1, 2, 3}, {10, 20, 1}, {UINT64_MAX, 0, 7}};
    kvc_buf_t b = {0};
    kvc_wire_encode_pull(&b, 42, KVC_PULL_RNDV, runs, 3);
    uint64_t id;
    kvc_run_t *out;
    size_t n;
    uint16_t fl = 0;
    assert_int_equal(kvc_wire_parse_pull(b.p, b.len, &id, &fl, &out, &n), KVC_OK);
    assert_int_equal(fl, KVC_PULL_RNDV);
    assert_int_equal(id, 42);
    assert_int_equal(n, 3);
    assert_memory_equal(out, runs, sizeof(runs));
    free(out);
    for (size_t k = 0; k < b.len; k++)
        assert_int_equal(kvc_wire_parse_pull(b.p, k, &id, &fl, &out, &n), KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&b);

    kvc_wire_data_hdr_t h = {7, 3, -5, 100, 8}, g;
    uint8_t raw[KVC_WIRE_DATA_HDR_LEN];
    kvc_wire_encode_data_hdr(raw, &h);
    assert_int_equal(kvc_wire_parse_data_hdr(raw, sizeof(raw), &g), KVC_OK);
    assert_memory_equal(&g, &h, sizeof(h));
    assert_int_equal(kvc_wire_parse_data_hdr(raw, sizeof(raw) - 1, &g), KVC_ERR_PROTOCOL);
    assert_int_equal(kvc_wire_parse_data_hdr(NULL, 0, &g), KVC_ERR_PROTOCOL);
}

static void check_notify(const char *txt, kvc_status_t want, const char *id, uint32_t tp) {
    kvc_span_t s;
    uint32_t t = 99;
    assert_int_equal(kvc_wire_parse_notify((const uint8_t *)txt, strlen(txt), &s, &t), want);
    if (want != KVC_OK) return;
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
    kvc_wire_encode_notify(&b, "r:1:2", 4);
    assert_int_equal(b.len, 7);
    assert_memory_equal(b.p, "r:1:2:4", 7);
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
    char *js = kvc_params_to_json("eng\"1", "req:with:colons", "10.0.0.1", 5600, blocks, 3, 4);
    assert_non_null(js);
    kvc_remote_t r;
    char err[200];
    assert_int_equal(kvc_params_parse_json(js, &r, err, sizeof(err)), KVC_OK);
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

    /* what a proxy forwards: extra keys, per-group block lists */
    const char *fwd = "{\"remote_block_ids\":[[4,5],[6]],\"remote_engine_id\":\"e\","
                      "\"remote_request_id\":\"r\",\"remote_host\":\"h\",\"remote_port\":1,"
                      "\"remote_num_tokens\":33,\"do_remote_prefill\":true}";
    assert_int_equal(kvc_params_parse_json(fwd, &r, err, sizeof(err)), KVC_OK);
    assert_int_equal(r.num_blocks, 2);
    assert_int_equal(r.block_ids[1], 5);
    assert_int_equal(r.tp_size, 1);
    kvc_remote_cleanup(&r);

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
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(kvc_params_parse_json(bad[i], &r, err, sizeof(err)),
                         KVC_ERR_INVALID_PARAM);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_header),
        cmocka_unit_test(test_handshake_roundtrip),
        cmocka_unit_test(test_handshake_truncated_and_corrupt),
        cmocka_unit_test(test_pull_and_data),
        cmocka_unit_test(test_notify),
        cmocka_unit_test(test_coalesce),
        cmocka_unit_test(test_params_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
