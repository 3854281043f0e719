/* SPDX-License-Identifier: Apache-2.0 */
/* proxy/trace.c: the W3C traceparent parser, fresh trace and span ids, and
 * the child header each upstream leg carries. */
/* cmocka.h needs these first. */
// clang-format off
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
// clang-format on

#include <string.h>

#include "proxy/trace.h"

#define TRACE "4bf92f3577b34da6a3ce929d0e0e4736"
#define SPAN "00f067aa0ba902b7"

static int parse(const char *tp, char trace[33], char flags[3]) {
    return px_trace_parse(tp, strlen(tp), trace, flags);
}

static void test_valid(void **state) {
    (void)state;
    char trace[33], flags[3];
    assert_int_equal(parse("00-" TRACE "-" SPAN "-01", trace, flags), 1);
    assert_string_equal(trace, TRACE);
    assert_string_equal(flags, "01");
    assert_int_equal(parse("00-" TRACE "-" SPAN "-00", trace, flags), 1);
    assert_string_equal(flags, "00");
    /* A later version may append fields, which a version-00 reader skips. */
    assert_int_equal(parse("01-" TRACE "-" SPAN "-01-extra", trace, flags), 1);
    assert_string_equal(trace, TRACE);
    assert_int_equal(parse("cc-" TRACE "-" SPAN "-01", trace, flags), 1);
    /* Only the first n bytes count. */
    const char *tail = "00-" TRACE "-" SPAN "-01 trailing";
    assert_int_equal(px_trace_parse(tail, 55, trace, flags), 1);
}

static void test_invalid(void **state) {
    (void)state;
    char trace[33] = "unchanged", flags[3] = "xx";
    const char *bad[] = {
        "",
        "00-" TRACE "-" SPAN "-0",                         /* short */
        "00-" TRACE "-" SPAN "-01-extra",                  /* version 00 is exactly 55 */
        "01-" TRACE "-" SPAN "-01x",                       /* later version, no '-' after */
        "ff-" TRACE "-" SPAN "-01",                        /* version ff is invalid */
        "0g-" TRACE "-" SPAN "-01",                        /* not hex */
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-" SPAN "-01", /* upper case */
        "00-00000000000000000000000000000000-" SPAN "-01", /* all-zero trace id */
        "00-" TRACE "-0000000000000000-01",                /* all-zero parent id */
        "00_" TRACE "-" SPAN "-01",                        /* separators */
        "00-" TRACE "_" SPAN "-01",
        "00-" TRACE "-" SPAN "_01",
        "00-" TRACE "-" SPAN "-0G",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        assert_int_equal(parse(bad[i], trace, flags), 0);
    assert_int_equal(px_trace_parse(NULL, 55, trace, flags), 0);
    /* n shorter than the text: cut off. */
    assert_int_equal(px_trace_parse("00-" TRACE "-" SPAN "-01", 54, trace, flags), 0);
    /* Nothing written on failure. */
    assert_string_equal(trace, "unchanged");
    assert_string_equal(flags, "xx");
}

static void test_new(void **state) {
    (void)state;
    char a[33], b[33], flags[3];
    px_trace_new(a);
    px_trace_new(b);
    assert_int_equal(strlen(a), 32);
    assert_string_not_equal(a, b);
    /* A fresh id is itself a valid trace id. */
    char tp[56];
    memcpy(tp, "00-", 3);
    memcpy(tp + 3, a, 32);
    memcpy(tp + 35, "-" SPAN "-01", 20);
    tp[55] = '\0';
    char got[33];
    assert_int_equal(parse(tp, got, flags), 1);
    assert_string_equal(got, a);
}

static void test_child_header(void **state)
{
    char span[17], child[56], trace[33], flags[3];
    px_trace_span_new(span);
    assert_int_equal(strlen(span), 16);
    px_trace_child(TRACE, span, "01", child);
    assert_int_equal(strlen(child), 55);
    /* What a leg sends parses back to the same trace and flags. */
    assert_int_equal(px_trace_parse(child, 55, trace, flags), 1);
    assert_string_equal(trace, TRACE);
    assert_string_equal(flags, "01");
    assert_memory_equal(child + 36, span, 16);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid),
        cmocka_unit_test(test_invalid),
        cmocka_unit_test(test_new),
        cmocka_unit_test(test_child_header),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
