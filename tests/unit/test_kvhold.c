/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h> /* after what it uses */

#include "proxy/kvhold.h"

/* vLLM's answer for a request that failed to load its KV under
 * kv_load_failure_policy fail (GenerationError through its OpenAI front). */
static const char gen_err[] =
    "{\"error\":{\"message\":\"Internal server error\",\"type\":\"InternalServerError\","
    "\"param\":null,\"code\":500}}";

static int feed(px_kvhold *k, const char *s) {
    return px_kvhold_feed(k, s, strlen(s));
}

/* Only what could be a failed load is held, and only once. */
static void test_wanted(void **state) {
    px_kvhold k;
    px_kvhold_init(&k);
    assert_true(px_kvhold_wanted(&k, 500, 0));
    assert_true(px_kvhold_wanted(&k, 200, 1));
    assert_false(px_kvhold_wanted(&k, 200, 0)); /* a JSON answer: a success */
    assert_false(px_kvhold_wanted(&k, 404, 0));
    px_kvhold_retry(&k);
    assert_false(px_kvhold_wanted(&k, 500, 0));
    px_kvhold_cleanup(&k);
}

/* A JSON 500 is told at its end, from its error's type. */
static void test_json(void **state) {
    px_kvhold k;
    px_kvhold_init(&k);
    px_kvhold_start(&k, 0);
    assert_int_equal(px_kvhold_feed(&k, gen_err, 20), -1);
    assert_int_equal(feed(&k, gen_err + 20), -1); /* JSON is told whole only */
    assert_int_equal(px_kvhold_end(&k, 1), 1);
    assert_int_equal(px_kvhold_end(&k, 0), 0); /* cut: not a verdict of failure */
    px_kvhold_cleanup(&k);

    px_kvhold_init(&k);
    px_kvhold_start(&k, 0);
    feed(&k, "{\"error\":{\"message\":\"bad\",\"type\":\"BadRequestError\"}}");
    assert_int_equal(px_kvhold_end(&k, 1), 0);
    px_buf out;
    px_kvhold_take(&k, &out);
    assert_false(k.active);
    assert_true(out.len > 0 && !memcmp(out.data, "{\"error\"", 8));
    px_buf_cleanup(&out);
    px_kvhold_cleanup(&k);
}

/* A stream is told by its first event: the failure stops the transfer,
 * anything else is passed on at once. */
static void test_stream(void **state) {
    px_kvhold k;
    px_kvhold_init(&k);
    px_kvhold_start(&k, 1);
    assert_int_equal(feed(&k, "data: "), -1);
    assert_int_equal(feed(&k, gen_err), -1);
    assert_int_equal(feed(&k, "\n\n"), 1);
    assert_true(k.failed);
    assert_int_equal(px_kvhold_end(&k, 0), 1);
    px_kvhold_retry(&k);
    assert_false(k.failed);
    assert_int_equal(k.held.len, 0);
    px_kvhold_cleanup(&k);

    px_kvhold_init(&k);
    px_kvhold_start(&k, 1);
    assert_int_equal(feed(&k, "data: {\"choices\":[]}\n\ndata: [DONE]\n\n"), 0);
    px_kvhold_cleanup(&k);

    /* Not an event at all, or no end of the first event by the bound. */
    px_kvhold_init(&k);
    px_kvhold_start(&k, 1);
    assert_int_equal(feed(&k, ": ping\n\n"), 0);
    px_kvhold_cleanup(&k);
    px_kvhold_init(&k);
    px_kvhold_start(&k, 1);
    char big[PX_KVHOLD_MAX];
    memset(big, 'x', sizeof big);
    assert_int_equal(px_kvhold_feed(&k, big, sizeof big - 1), -1);
    assert_int_equal(px_kvhold_feed(&k, big, 1), 0);
    px_kvhold_cleanup(&k);
    /* A stream that ends before its first event is whole is no failure. */
    px_kvhold_init(&k);
    px_kvhold_start(&k, 1);
    assert_int_equal(feed(&k, "data: {"), -1);
    assert_int_equal(px_kvhold_end(&k, 1), 0);
    px_kvhold_cleanup(&k);
}

static void test_generation_error(void **state) {
    assert_true(px_kvhold_is_generation_error(gen_err, strlen(gen_err)));
    const char *other = "{\"error\":{\"type\":\"InternalServerErrorX\"}}";
    assert_false(px_kvhold_is_generation_error(other, strlen(other)));
    const char *flat = "{\"type\":\"InternalServerError\"}";
    assert_false(px_kvhold_is_generation_error(flat, strlen(flat)));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wanted),
        cmocka_unit_test(test_json),
        cmocka_unit_test(test_stream),
        cmocka_unit_test(test_generation_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
