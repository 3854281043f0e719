/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h> /* after what it uses */

#include "base/json.h"
#include "proxy/dispatch.h"

/* The identities the cache tests work on: a fresh one where a test needs
 * it empty (no reset hook in the library). */
static px_pf_cache *C;

static const char P_KVP[] =
    "{\"do_remote_prefill\":true,\"remote_block_ids\":[1,2],\"remote_engine_id\":\"eng-\\u0041\","
    "\"remote_request_id\":\"cmpl-x\",\"remote_host\":\"10.0.0.7\",\"remote_port\":5601,"
    "\"tp_size\":2,\"remote_kv_token\":\"00112233445566778899aabbccddeeff\"}";

static void test_modes(void **state) {
    assert_int_equal(px_dispatch_parse("serial"), PX_DISPATCH_SERIAL);
    assert_int_equal(px_dispatch_parse("concurrent"), PX_DISPATCH_CONCURRENT);
    assert_int_equal(px_dispatch_parse("Concurrent"), -1);
    assert_int_equal(px_dispatch_parse(""), -1);
    assert_int_equal(px_dispatch_parse(NULL), -1);
    assert_string_equal(px_dispatch_name(PX_DISPATCH_CONCURRENT), "concurrent");
    assert_string_equal(px_dispatch_kind_mode(PX_DISP_NO_IDENTITY), "serial");
    assert_string_equal(px_dispatch_kind_reason(PX_DISP_NO_IDENTITY), "no_identity");
    assert_string_equal(px_dispatch_kind_mode(PX_DISP_CONCURRENT), "concurrent");
}

/* The identity is the exact JSON text prefill wrote; tp_size defaults to 1. */
static void test_identity_parse(void **state) {
    px_pf_identity id;
    assert_int_equal(px_dispatch_identity_parse(P_KVP, strlen(P_KVP), &id), 0);
    assert_string_equal(id.engine_id, "\"eng-\\u0041\"");
    assert_string_equal(id.host, "\"10.0.0.7\"");
    assert_string_equal(id.port, "5601");
    assert_string_equal(id.tp_size, "2");
    static const char no_tp[] = "{\"remote_engine_id\":\"e\",\"remote_host\":\"h\","
                                "\"remote_port\":1}";
    assert_int_equal(px_dispatch_identity_parse(no_tp, strlen(no_tp), &id), 0);
    assert_string_equal(id.tp_size, "1");
    assert_string_equal(id.pp_size, "");
    /* Missing, mistyped or oversized members: no identity, id untouched. */
    static const char *const bad[] = {
        "{\"remote_host\":\"h\",\"remote_port\":1}",
        "{\"remote_engine_id\":7,\"remote_host\":\"h\",\"remote_port\":1}",
        "{\"remote_engine_id\":\"e\",\"remote_host\":null,\"remote_port\":1}",
        "{\"remote_engine_id\":\"e\",\"remote_host\":\"h\",\"remote_port\":\"1\"}",
        "{}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        memset(&id, 'z', sizeof id);
        assert_int_equal(px_dispatch_identity_parse(bad[i], strlen(bad[i]), &id), -1);
        assert_int_equal(id.port[0], 'z');
    }
    char big[600];
    snprintf(big, sizeof big, "{\"remote_engine_id\":\"%0300d\",\"remote_host\":\"h\","
                              "\"remote_port\":1}", 0);
    assert_int_equal(px_dispatch_identity_parse(big, strlen(big), &id), -1);
}

static void test_cache(void **state) {
    px_pf_cache_destroy(C);
    C = px_pf_cache_create();
    px_pf_identity id;
    assert_int_equal(px_dispatch_get(C, "http://p:1", &id), 0);
    assert_int_equal(px_dispatch_learn(C, "http://p:1", "{}", 2), -1);
    assert_int_equal(px_dispatch_get(C, "http://p:1", &id), 0);
    assert_int_equal(px_dispatch_learn(C, "http://p:1", P_KVP, strlen(P_KVP)), 0);
    assert_int_equal(px_dispatch_get(C, "http://p:1", &id), 1);
    assert_string_equal(id.port, "5601");
    static const char other[] = "{\"remote_engine_id\":\"new\",\"remote_host\":\"h\","
                                "\"remote_port\":9}";
    assert_int_equal(px_dispatch_learn(C, "http://p:1", other, strlen(other)), 0);
    assert_int_equal(px_dispatch_get(C, "http://p:1", &id), 1);
    assert_string_equal(id.engine_id, "\"new\"");
    px_dispatch_forget(C, "http://p:1");
    assert_int_equal(px_dispatch_get(C, "http://p:1", &id), 0);
    px_dispatch_forget(C, "never");
    /* Bounded: past the limit the least recently learned goes. */
    char name[64];
    for (int i = 0; i <= PX_DISPATCH_MAX_IDENTITIES; i++) {
        snprintf(name, sizeof name, "b%d", i);
        assert_int_equal(px_dispatch_learn(C, name, other, strlen(other)), 0);
    }
    assert_int_equal(px_dispatch_get(C, "b0", &id), 0);
    assert_int_equal(px_dispatch_get(C, "b1", &id), 1);
    snprintf(name, sizeof name, "b%d", PX_DISPATCH_MAX_IDENTITIES);
    assert_int_equal(px_dispatch_get(C, name, &id), 1);
    px_pf_cache_destroy(C);
    C = px_pf_cache_create();
    assert_int_equal(px_dispatch_get(C, "b1", &id), 0);
}

static int all_hex(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strchr("0123456789abcdef", s[i])) return 0;
    return s[n] == '\0';
}

static void test_mint_and_params(void **state) {
    char id[PX_DISPATCH_ID_LEN], tok[33], id2[PX_DISPATCH_ID_LEN], tok2[33];
    assert_int_equal(px_dispatch_mint(id, tok), 0);
    assert_int_equal(px_dispatch_mint(id2, tok2), 0);
    assert_memory_equal(id, "pdproxy-", 8);
    assert_true(all_hex(id + 8, 32));
    assert_true(all_hex(tok, 32));
    assert_string_not_equal(id, id2);
    assert_string_not_equal(tok, tok2);

    px_buf b;
    px_buf_init(&b);
    px_dispatch_prefill_kvp(id, tok, &b);
    char err[64];
    assert_int_equal(px_json_validate(b.data, b.len, err, sizeof err), PX_JSON_OBJECT);
    px_json_member m;
    assert_true(px_json_find(b.data, b.len, "transfer_mode", &m));
    assert_memory_equal(m.val, "\"push\"", 6);
    assert_true(px_json_find(b.data, b.len, "do_remote_decode", &m));
    assert_int_equal(m.type, PX_JSON_TRUE);
    assert_true(px_json_find(b.data, b.len, "remote_kv_token", &m));
    assert_int_equal(m.val_len, 34);
    assert_memory_equal(m.val + 1, tok, 32);

    px_pf_identity pf;
    assert_int_equal(px_dispatch_identity_parse(P_KVP, strlen(P_KVP), &pf), 0);
    px_buf_reset(&b);
    px_dispatch_decode_kvp(&pf, id, tok, &b);
    assert_int_equal(px_json_validate(b.data, b.len, err, sizeof err), PX_JSON_OBJECT);
    assert_false(px_json_find(b.data, b.len, "remote_block_ids", &m));
    assert_true(px_json_find(b.data, b.len, "remote_engine_id", &m));
    assert_memory_equal(m.val, "\"eng-\\u0041\"", m.val_len);
    assert_true(px_json_find(b.data, b.len, "remote_request_id", &m));
    assert_memory_equal(m.val + 1, id, strlen(id));
    assert_true(px_json_find(b.data, b.len, "tp_size", &m));
    assert_memory_equal(m.val, "2", 1);
    assert_true(px_json_find(b.data, b.len, "do_remote_prefill", &m));
    assert_int_equal(m.type, PX_JSON_TRUE);
    assert_false(px_json_find(b.data, b.len, "pp_size", &m));
    /* pp_size (vLLM's push answers carry it) is passed on when sent. */
    static const char pp[] = "{\"remote_engine_id\":\"e\",\"remote_host\":\"h\","
                             "\"remote_port\":1,\"pp_size\":2}";
    assert_int_equal(px_dispatch_identity_parse(pp, strlen(pp), &pf), 0);
    px_buf_reset(&b);
    px_dispatch_decode_kvp(&pf, id, tok, &b);
    assert_int_equal(px_json_validate(b.data, b.len, err, sizeof err), PX_JSON_OBJECT);
    assert_true(px_json_find(b.data, b.len, "pp_size", &m));
    assert_memory_equal(m.val, "2", 1);
    px_buf_cleanup(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_modes),
        cmocka_unit_test(test_identity_parse),
        cmocka_unit_test(test_cache),
        cmocka_unit_test(test_mint_and_params),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    px_pf_cache_destroy(C);
    return rc;
}
