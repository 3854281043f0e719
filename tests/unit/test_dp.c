/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h> /* after what it uses */

#include "proxy/dp.h"

/* The least loaded rank, the lowest on a tie; done frees it. */
static void test_least_loaded(void **state) {
    assert_int_equal(px_dp_take(PX_DP_DECODE, "d:1", 3), 0);
    assert_int_equal(px_dp_take(PX_DP_DECODE, "d:1", 3), 1);
    assert_int_equal(px_dp_take(PX_DP_DECODE, "d:1", 3), 2);
    assert_int_equal(px_dp_take(PX_DP_DECODE, "d:1", 3), 0);
    px_dp_done(PX_DP_DECODE, "d:1", 1);
    assert_int_equal(px_dp_take(PX_DP_DECODE, "d:1", 3), 1);
    /* Another role of the same name, another backend: counted apart. */
    assert_int_equal(px_dp_take(PX_DP_PREFILL, "d:1", 3), 0);
    assert_int_equal(px_dp_take(PX_DP_DECODE, "d:2", 3), 0);
    /* No DP: no rank. */
    assert_int_equal(px_dp_take(PX_DP_DECODE, "d:3", 1), -1);
    /* Sizes past PX_DP_MAX are clamped. */
    for (int k = 0; k < PX_DP_MAX; k++)
        assert_int_equal(px_dp_take(PX_DP_DECODE, "d:big", 1000), k);
    assert_int_equal(px_dp_take(PX_DP_DECODE, "d:big", 1000), 0);
    /* Done for a rank never taken or a backend never seen: no effect. */
    px_dp_done(PX_DP_DECODE, "never", 0);
    px_dp_done(PX_DP_DECODE, "d:1", -1);
    px_dp_done(PX_DP_DECODE, "d:1", PX_DP_MAX);
}

static void test_render(void **state) {
    px_buf b;
    px_buf_init(&b);
    px_dp_render(&b);
    px_buf_append(&b, "", 1);
    assert_non_null(strstr(b.data, "pdproxy_dp_rank_in_flight{role=\"decode\",backend=\"d:1\","
                                   "rank=\"0\"} 2\n"));
    assert_non_null(strstr(b.data, "pdproxy_dp_rank_requests_total{role=\"decode\","
                                   "backend=\"d:1\",rank=\"1\"} 2\n"));
    assert_non_null(strstr(b.data, "pdproxy_dp_rank_in_flight{role=\"prefill\",backend=\"d:1\","
                                   "rank=\"0\"} 1\n"));
    /* Ranks never used are not listed. */
    assert_null(strstr(b.data, "backend=\"d:2\",rank=\"1\""));
    px_buf_cleanup(&b);
}

/* A full table gives no rank (the engine balances); names that need
 * escaping are escaped in the labels. */
static void test_full_table_and_escaping(void **state) {
    char name[64];
    int got = 0;
    for (int i = 0; i < 300; i++) {
        snprintf(name, sizeof name, "b\"%d\\", i);
        got += px_dp_take(PX_DP_PREFILL, name, 2) >= 0;
    }
    assert_true(got > 0 && got < 300);
    px_buf b;
    px_buf_init(&b);
    px_dp_render(&b);
    px_buf_append(&b, "", 1);
    assert_non_null(strstr(b.data, "backend=\"b\\\"0\\\\\""));
    px_buf_cleanup(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_least_loaded),
        cmocka_unit_test(test_render),
        cmocka_unit_test(test_full_table_and_escaping),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
