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
    px_dispatch_prefill_kvp(id, tok, "xfer-7", &b);
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
    assert_true(px_json_find(b.data, b.len, "transfer_id", &m));
    assert_memory_equal(m.val, "\"xfer-7\"", 8);

    px_pf_identity pf;
    assert_int_equal(px_dispatch_identity_parse(P_KVP, strlen(P_KVP), &pf), 0);
    px_buf_reset(&b);
    px_dispatch_decode_kvp(&pf, id, tok, "xfer-7", &b);
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
    assert_true(px_json_find(b.data, b.len, "transfer_id", &m));
    assert_memory_equal(m.val, "\"xfer-7\"", 8);
    /* pp_size (vLLM's push answers carry it) is passed on when sent. */
    static const char pp[] = "{\"remote_engine_id\":\"e\",\"remote_host\":\"h\","
                             "\"remote_port\":1,\"pp_size\":2}";
    assert_int_equal(px_dispatch_identity_parse(pp, strlen(pp), &pf), 0);
    px_buf_reset(&b);
    px_dispatch_decode_kvp(&pf, id, tok, "xfer-7", &b);
    assert_int_equal(px_json_validate(b.data, b.len, err, sizeof err), PX_JSON_OBJECT);
    assert_true(px_json_find(b.data, b.len, "pp_size", &m));
    assert_memory_equal(m.val, "2", 1);
    px_buf_cleanup(&b);
}

/* Only a concurrent pool and a prefill known to push get both legs at
 * once; the mode is read from the answer's transfer_mode. */
static void test_decide(void **state) {
    px_pf_identity id;
    static const char push[] = "{\"remote_engine_id\":\"e\",\"remote_host\":\"h\","
                               "\"remote_port\":1,\"transfer_mode\":\"push\"}";
    static const char pull[] = "{\"remote_engine_id\":\"e\",\"remote_host\":\"h\","
                               "\"remote_port\":1,\"transfer_mode\":\"pull\"}";
    static const char odd[] = "{\"remote_engine_id\":\"e\",\"remote_host\":\"h\","
                              "\"remote_port\":1,\"transfer_mode\":7}";
    assert_int_equal(px_dispatch_identity_parse(push, strlen(push), &id), 0);
    assert_int_equal(id.mode, PX_XFER_PUSH);
    assert_int_equal(px_dispatch_decide(PX_DISPATCH_CONCURRENT, &id), PX_DISP_CONCURRENT);
    assert_int_equal(px_dispatch_decide(PX_DISPATCH_SERIAL, &id), PX_DISP_SERIAL);
    assert_int_equal(px_dispatch_decide(PX_DISPATCH_CONCURRENT, NULL), PX_DISP_NO_IDENTITY);
    assert_int_equal(px_dispatch_identity_parse(pull, strlen(pull), &id), 0);
    assert_int_equal(id.mode, PX_XFER_PULL);
    assert_int_equal(px_dispatch_decide(PX_DISPATCH_CONCURRENT, &id), PX_DISP_PULLS);
    assert_int_equal(px_dispatch_identity_parse(P_KVP, strlen(P_KVP), &id), 0);
    assert_int_equal(id.mode, PX_XFER_UNKNOWN);
    assert_int_equal(px_dispatch_decide(PX_DISPATCH_CONCURRENT, &id), PX_DISP_MODE_UNKNOWN);
    assert_int_equal(px_dispatch_identity_parse(odd, strlen(odd), &id), 0);
    assert_int_equal(id.mode, PX_XFER_UNKNOWN);
    assert_string_equal(px_dispatch_kind_reason(PX_DISP_PULLS), "prefill_pulls");
    assert_string_equal(px_dispatch_kind_mode(PX_DISP_PULLS), "serial");
    assert_string_equal(px_dispatch_kind_reason(PX_DISP_MODE_UNKNOWN), "mode_unknown");

    /* A prefill learned pushing that comes back pulling: its next answer
     * corrects the cache; one without an identity drops it. */
    px_pf_cache *c = px_pf_cache_create();
    assert_int_equal(px_dispatch_learn(c, "p:1", push, strlen(push)), 0);
    assert_int_equal(px_dispatch_get(c, "p:1", &id), 1);
    assert_int_equal(id.mode, PX_XFER_PUSH);
    assert_int_equal(px_dispatch_learn(c, "p:1", pull, strlen(pull)), 0);
    assert_int_equal(px_dispatch_get(c, "p:1", &id), 1);
    assert_int_equal(px_dispatch_decide(PX_DISPATCH_CONCURRENT, &id), PX_DISP_PULLS);
    assert_int_equal(px_dispatch_learn(c, "p:1", "{\"remote_block_ids\":[1]}", 24), -1);
    assert_int_equal(px_dispatch_get(c, "p:1", &id), 0);
    px_pf_cache_destroy(c);
}

static void test_transfer_id(void **state) {
    char a[PX_DISPATCH_XFER_LEN], b[PX_DISPATCH_XFER_LEN];
    assert_int_equal(px_dispatch_mint_transfer_id(a), 0);
    assert_int_equal(px_dispatch_mint_transfer_id(b), 0);
    assert_memory_equal(a, "xfer-", 5);
    assert_true(all_hex(a + 5, 32));
    assert_string_not_equal(a, b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_modes),
        cmocka_unit_test(test_identity_parse),
        cmocka_unit_test(test_cache),
        cmocka_unit_test(test_mint_and_params),
        cmocka_unit_test(test_decide),
        cmocka_unit_test(test_transfer_id),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    px_pf_cache_destroy(C);
    return rc;
}
