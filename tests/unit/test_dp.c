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

/* The table every test of this file works on, in order (a test may read
 * what an earlier one took): made for the group, not reset between. */
static px_dp_table *T;

static int make_table(void **state) {
    T = px_dp_table_create();
    return 0;
}

static int drop_table(void **state) {
    px_dp_table_destroy(T);
    return 0;
}

/* The least loaded rank, the lowest on a tie; done frees it. */
static void test_least_loaded(void **state) {
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "d:1", 3), 0);
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "d:1", 3), 1);
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "d:1", 3), 2);
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "d:1", 3), 0);
    px_dp_done(T, PX_DP_DECODE, "d:1", 1);
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "d:1", 3), 1);
    /* Another role of the same name, another backend: counted apart. */
    assert_int_equal(px_dp_take(T, PX_DP_PREFILL, "d:1", 3), 0);
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "d:2", 3), 0);
    /* No DP: no rank. */
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "d:3", 1), -1);
    /* Sizes past PX_DP_MAX are clamped. */
    for (int k = 0; k < PX_DP_MAX; k++)
        assert_int_equal(px_dp_take(T, PX_DP_DECODE, "d:big", 1000), k);
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "d:big", 1000), 0);
    /* Done for a rank never taken or a backend never seen: no effect. */
    px_dp_done(T, PX_DP_DECODE, "never", 0);
    px_dp_done(T, PX_DP_DECODE, "d:1", -1);
    px_dp_done(T, PX_DP_DECODE, "d:1", PX_DP_MAX);
}

static void test_render(void **state) {
    px_buf b;
    px_buf_init(&b);
    px_dp_render(T, &b);
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
        got += px_dp_take(T, PX_DP_PREFILL, name, 2) >= 0;
    }
    assert_true(got > 0 && got < 300);
    px_buf b;
    px_buf_init(&b);
    px_dp_render(T, &b);
    px_buf_append(&b, "", 1);
    assert_non_null(strstr(b.data, "backend=\"b\\\"0\\\\\""));
    px_buf_cleanup(&b);
}

/* Per-rank series: engine="K" anywhere in the labels, running + waiting
 * summed; other labels, other metrics, odd values and ranks ignored. */
static void test_parse_ranks(void **state) {
    static const char page[] =
        "# HELP vllm:num_requests_running x\n"
        "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3\n"
        "vllm:num_requests_running{model_name=\"m\",engine=\"2\"} 1 1700000000\n"
        "vllm:num_requests_waiting{engine=\"2\"} 4\n"
        "vllm:num_requests_waiting{engine=\"1\"} NaN\n"
        "vllm:num_requests_waiting{engine=\"1\"} -1\n"
        "vllm:num_requests_waiting{engine=\"64\"} 5\n"
        "vllm:num_requests_waiting{engine=\"\"} 5\n"
        "vllm:num_requests_waiting{xengine=\"1\"} 5\n"
        "vllm:num_requests_waiting_extra{engine=\"1\"} 5\n"
        "vllm:num_requests_running{engine=\"1\"\n"
        "vllm:kv_cache_usage_perc{engine=\"1\"} 0.5";
    long load[PX_DP_MAX];
    assert_int_equal(px_dp_parse_ranks(page, sizeof page - 1, load), 3);
    assert_int_equal(load[0], 3);
    assert_int_equal(load[1], 0);
    assert_int_equal(load[2], 5);
    static const char unlabelled[] = "vllm:num_requests_running{model_name=\"m\"} 9\n";
    assert_int_equal(px_dp_parse_ranks(unlabelled, sizeof unlabelled - 1, load), 0);
    assert_int_equal(px_dp_parse_ranks("", 0, load), 0);
}

/* The engine's figures steer the choice, corrected by pdproxy's own
 * requests since the probe; a failed probe falls back to pdproxy's. */
static void test_engine_load(void **state) {
    static const char busy0[] = "vllm:num_requests_running{engine=\"0\"} 2\n"
                                "vllm:num_requests_running{engine=\"1\"} 0\n";
    px_dp_engine_load(T, "e:1", busy0, sizeof busy0 - 1);
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "e:1", 2), 1); /* 2 vs 0 */
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "e:1", 2), 1); /* 2 vs 1 */
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "e:1", 2), 0); /* 2 vs 2: the lowest */
    assert_int_equal(px_dp_take(T, PX_DP_PREFILL, "e:1", 2), 1); /* both roles read it */
    /* A probe that failed: pdproxy's own counts alone (0: 1, 1: 2). */
    px_dp_engine_load(T, "e:1", NULL, 0);
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "e:1", 2), 0);
    /* A single rank's series says nothing about ranks. */
    static const char one[] = "vllm:num_requests_running{engine=\"0\"} 50\n";
    px_dp_engine_load(T, "e:1", one, sizeof one - 1);
    assert_int_equal(px_dp_take(T, PX_DP_DECODE, "e:1", 2), 0); /* 2 vs 2: the lowest */
    px_buf b;
    px_buf_init(&b);
    px_dp_render(T, &b);
    px_buf_append(&b, "", 1);
    assert_null(strstr(b.data, "pdproxy_dp_rank_engine_load{backend=\"e:1\""));
    px_dp_engine_load(T, "e:1", busy0, sizeof busy0 - 1);
    px_buf_reset(&b);
    px_dp_render(T, &b);
    px_buf_append(&b, "", 1);
    assert_non_null(strstr(b.data, "pdproxy_dp_rank_engine_load{backend=\"e:1\",rank=\"0\"} 2\n"));
    px_buf_cleanup(&b);
}

/* Declared sizes: the admin layer over the file's, the file's replaced as
 * a whole, the fallback otherwise. */
static void test_declared_sizes(void **state) {
    assert_false(px_dp_declared(T));
    assert_int_equal(px_dp_size(T, "http://a:1", 3), 3);
    char *v[] = {"4 http://a:1", "2 http://b:1"};
    px_strlist l = {v, 2};
    assert_int_equal(px_dp_declare_file(T, &l), 0);
    assert_true(px_dp_declared(T));
    assert_int_equal(px_dp_size(T, "http://a:1", 1), 4);
    assert_int_equal(px_dp_size(T, "http://b:1", 1), 2);
    assert_int_equal(px_dp_size(T, "http://c:1", 1), 1);
    assert_int_equal(px_dp_size(T, NULL, 5), 5);
    assert_int_equal(px_dp_declare_admin(T, "http://b:1", 8), 0);
    assert_int_equal(px_dp_size(T, "http://b:1", 1), 8);
    char *w[] = {"6 http://b:1"};
    px_strlist l2 = {w, 1};
    assert_int_equal(px_dp_declare_file(T, &l2), 0);
    assert_int_equal(px_dp_size(T, "http://a:1", 1), 1); /* no longer declared */
    assert_int_equal(px_dp_size(T, "http://b:1", 1), 8); /* the admin's still wins */
    px_dp_forget_admin(T);
    assert_int_equal(px_dp_size(T, "http://b:1", 1), 6);
    assert_int_equal(px_dp_declare_admin(T, "http://b:1", 0), 0);
    assert_int_equal(px_dp_declare_admin(T, "http://never:1", 0), 0);
    /* Malformed items and URLs too long for the table are reported. */
    char long_url[600];
    memset(long_url, 'x', sizeof long_url - 1);
    long_url[sizeof long_url - 1] = '\0';
    char item[620];
    snprintf(item, sizeof item, "2 %s", long_url);
    char *bad[] = {"nonsense", item};
    px_strlist l3 = {bad, 2};
    assert_int_equal(px_dp_declare_file(T, &l3), -1);
    assert_int_equal(px_dp_size(T, long_url, 1), 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_least_loaded),
        cmocka_unit_test(test_render),
        cmocka_unit_test(test_parse_ranks),
        cmocka_unit_test(test_engine_load),
        cmocka_unit_test(test_declared_sizes),
        cmocka_unit_test(test_full_table_and_escaping),
    };
    return cmocka_run_group_tests(tests, make_table, drop_table);
}
