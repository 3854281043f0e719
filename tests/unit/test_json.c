/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"

static px_json_type v(const char *s)
{
    char err[128];
    return px_json_validate(s, strlen(s), err, sizeof err);
}

static void test_valid_documents(void **state)
{
    assert_int_equal(v("{}"), PX_JSON_OBJECT);
    assert_int_equal(v(" { \"a\" : [1, -2.5e+3, true, false, null, \"x\"] } "), PX_JSON_OBJECT);
    assert_int_equal(v("[]"), PX_JSON_ARRAY);
    assert_int_equal(v("18446744073709551615"), PX_JSON_NUMBER);
    assert_int_equal(v("\"\\u00e9\\ud83d\\ude00 \xc3\xa9 \xf0\x9f\x98\x80\""), PX_JSON_STRING);
}

static void test_invalid_documents(void **state)
{
    const char *bad[] = {"",       "{",          "{\"a\"}",     "{\"a\":1,}", "[1,]",
                         "01",     "1.",         "-",           "1e",         "tru",
                         "{} {}",  "\"\\x\"",    "\"\\u12\"",   "\"a\nb\"",   "nul",
                         "\"\xff\"", "\"\xc0\xaf\"", "\"\xed\xa0\x80\"", "{1:2}", "[1 2]"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char err[128] = "";
        assert_int_equal(px_json_validate(bad[i], strlen(bad[i]), err, sizeof err),
                         PX_JSON_INVALID);
        assert_true(err[0] != '\0');
    }
}

/* Strings are scanned 8 bytes at a time while they are plain ASCII, then
 * byte by byte to the next special byte: a special byte at every offset of
 * a string, in every position of the 8-byte window, with long and short
 * tails after it, must still be seen. */
static void test_long_strings_every_offset(void **state)
{
    const struct {
        const char *ins;
        px_json_type want;
    } cases[] = {
        {"\"", PX_JSON_INVALID},          /* ends the string early: trailing bytes */
        {"\\n", PX_JSON_STRING},         /* an escape */
        {"\\q", PX_JSON_INVALID},        /* a bad escape */
        {"\n", PX_JSON_INVALID},          /* a control character */
        {"\x1f", PX_JSON_INVALID},
        {"\x7f", PX_JSON_STRING},         /* DEL is allowed */
        {"\xc3\xa9", PX_JSON_STRING},    /* UTF-8 */
        {"\xc3", PX_JSON_INVALID},        /* truncated UTF-8 */
        {"\xff", PX_JSON_INVALID},
    };
    char doc[64];
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++)
        for (size_t at = 0; at <= 24; at++)
        for (size_t tail = 0; tail <= 17; tail++) {
            size_t n = 0;
            doc[n++] = '"';
            for (size_t i = 0; i < at; i++)
                doc[n++] = (char)('a' + i % 26);
            size_t m = strlen(cases[k].ins);
            memcpy(doc + n, cases[k].ins, m);
            n += m;
            for (size_t i = 0; i < tail; i++)
                doc[n++] = 'z';
            doc[n++] = '"';
            char err[128];
            px_json_type got = px_json_validate(doc, n, err, sizeof err);
            if (got != cases[k].want)
                fail_msg("case %zu at offset %zu, tail %zu: got %d, want %d", k, at, tail, got,
                         cases[k].want);
        }
}

/* Every byte value, alone, at every offset of the first three 16-byte
 * blocks of a string (the scan goes 16 or 8 bytes at a time, then byte by
 * byte): a string iff it is printable ASCII other than '"' and '\\'. */
static void test_every_byte_every_offset(void **state)
{
    (void)state;
    char doc[64];
    for (int c = 0; c < 256; c++)
        for (size_t at = 0; at < 48; at++) {
            size_t n = 0;
            doc[n++] = '"';
            for (size_t i = 0; i < at; i++)
                doc[n++] = 'a';
            doc[n++] = (char)c;
            for (size_t i = at + 1; i < 48; i++)
                doc[n++] = 'x'; /* not an escape's letter */
            doc[n++] = '"';
            px_json_type want =
                c >= 0x20 && c < 0x80 && c != '"' && c != '\\' ? PX_JSON_STRING : PX_JSON_INVALID;
            px_json_type got = px_json_validate(doc, n, NULL, 0);
            if (got != want)
                fail_msg("byte 0x%02x at offset %zu: got %d, want %d", c, at, got, want);
        }
}

static void test_depth_limit(void **state)
{
    size_t n = 10000;
    char *s = malloc(2 * n + 1);
    memset(s, '[', n);
    memset(s + n, ']', n);
    s[2 * n] = 0;
    char err[128];
    assert_int_equal(px_json_validate(s, 2 * n, err, sizeof err), PX_JSON_INVALID);
    assert_non_null(strstr(err, "nesting too deep"));
    /* Exactly at the limit is fine. */
    size_t k = PX_JSON_MAX_DEPTH;
    memset(s, '[', k);
    memset(s + k, ']', k);
    assert_int_equal(px_json_validate(s, 2 * k, err, sizeof err), PX_JSON_ARRAY);
    free(s);
}

static void test_iterate_members(void **state)
{
    const char *s = "{ \"a\" : 1 , \"b\":{\"c\":[1,2]},\"d\":\"x\" }";
    px_json_iter it;
    px_json_member m;
    assert_int_equal(px_json_iter_init(&it, s, strlen(s)), 0);
    assert_int_equal(px_json_iter_next(&it, &m), 1);
    assert_true(px_json_str_eq(m.key, m.key_len, "a"));
    assert_int_equal(m.type, PX_JSON_NUMBER);
    assert_memory_equal(m.val, "1", 1);
    assert_int_equal(px_json_iter_next(&it, &m), 1);
    assert_int_equal(m.type, PX_JSON_OBJECT);
    assert_int_equal(m.val_len, strlen("{\"c\":[1,2]}"));
    assert_int_equal(px_json_iter_next(&it, &m), 1);
    assert_int_equal(m.type, PX_JSON_STRING);
    assert_int_equal(px_json_iter_next(&it, &m), 0);
    assert_int_equal(px_json_iter_init(&it, "[1]", 3), -1);
}

static void test_key_escapes(void **state)
{
    assert_true(px_json_str_eq("\\u0073tream", 11, "stream"));
    assert_true(px_json_str_eq("stream", 6, "stream"));
    assert_false(px_json_str_eq("streams", 7, "stream"));
    assert_false(px_json_str_eq("\\u0073trea", 10, "stream"));
    assert_false(px_json_str_eq("str\\u00e9am", 11, "stream"));
    /* Fuzzer find: cJSON-based engines read "stream\u0000x" as "stream". */
    assert_true(px_json_str_eq("stream\\u0000x", 13, "stream"));
    assert_true(px_json_str_eq("\\u0000", 6, ""));
    assert_false(px_json_str_eq("strea\\u0000m", 12, "stream"));
    char out[16];
    assert_int_equal(px_json_str_decode("a\\u00e9\\n", 9, out, sizeof out), 4);
    assert_string_equal(out, "a\xc3\xa9\n");
    assert_int_equal(px_json_str_decode("\\ud83d\\ude00", 12, out, sizeof out), 4);
    assert_memory_equal(out, "\xf0\x9f\x98\x80", 4);
    assert_int_equal(px_json_str_decode("abcdef", 6, out, 4), -1);
}

static void test_find_last_duplicate(void **state)
{
    const char *s = "{\"k\":1,\"x\":2,\"k\":3}";
    px_json_member m;
    assert_int_equal(px_json_find(s, strlen(s), "k", &m), 1);
    assert_memory_equal(m.val, "3", 1);
    assert_int_equal(px_json_find(s, strlen(s), "nope", &m), 0);
}

/* px_json_object_find says what px_json_validate and a px_json_find per
 * key say, in one pass: valid objects (duplicates: the last), anything
 * else refused. */
static void test_object_find(void **state)
{
    const char *docs[] = {
        "{}", " { } ", "{\"a\":1}", "{\"a\":1,\"b\":{\"a\":2},\"a\":[3]} ",
        "{\"\\u0061\":\"x\",\"b\":null}", "{\"b\":true}\n",
        /* not valid objects */
        "[1]", "1", "", "{", "{\"a\":1,}", "{\"a\":1} {}", "{\"a\":1} x", "{\"a\":1}}",
        "{\"a\":[1,]}", "{\"a\":\"\xff\"}", "{\"a\":1,\"b\":tru}", "{\"b\":{\"a\":1}",
    };
    static const char *const keys[] = {"a", "b", "c"};
    for (size_t d = 0; d < sizeof docs / sizeof *docs; d++) {
        const char *s = docs[d];
        size_t n = strlen(s);
        char err[128];
        px_json_member found[3], m;
        int valid = px_json_validate(s, n, err, sizeof err) == PX_JSON_OBJECT;
        int rc = px_json_object_find(s, n, keys, 3, found);
        if (rc != (valid ? 0 : -1)) fail_msg("doc %zu: rc %d, valid %d", d, rc, valid);
        if (!valid) continue;
        for (size_t k = 0; k < 3; k++) {
            int has = px_json_find(s, n, keys[k], &m);
            if (has != (found[k].val != NULL)) fail_msg("doc %zu key %s", d, keys[k]);
            if (has && (m.val != found[k].val || m.val_len != found[k].val_len ||
                        m.type != found[k].type))
                fail_msg("doc %zu key %s: another member", d, keys[k]);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_documents),   cmocka_unit_test(test_invalid_documents),
        cmocka_unit_test(test_depth_limit),       cmocka_unit_test(test_iterate_members),
        cmocka_unit_test(test_key_escapes),       cmocka_unit_test(test_find_last_duplicate),
        cmocka_unit_test(test_long_strings_every_offset), cmocka_unit_test(test_object_find),
        cmocka_unit_test(test_every_byte_every_offset),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
