/* SPDX-License-Identifier: Apache-2.0 */
/* cmocka.h needs these first. */
// clang-format off
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
// clang-format on
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/util.h"
#include "proxy/access.h"
#include "tests/unit/stderr_capture.h"

static void refused_line(void) {
    px_access a = {.req = "r1",
                   .endpoint = "/v1/completions",
                   .status = 401,
                   .prefill_ms = -1,
                   .ttfb_ms = -1,
                   .total_ms = 0,
                   .outcome = "refused"};
    px_access_write(&a);
}

static void full_line(void) {
    px_access a = {.req = "r2",
                   .endpoint = "/v1/completions",
                   .prefill = "10.0.0.1:8100",
                   .decode = "10.0.0.2:8200",
                   .status = 200,
                   .prefill_ms = 12.5,
                   .ttfb_ms = 20,
                   .total_ms = 30,
                   .bytes_out = 99,
                   .outcome = "ok",
                   .trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"};
    px_access_write(&a);
}

static void dispatch_line(void) {
    px_access a = {.req = "r3",
                   .endpoint = "/v1/completions",
                   .status = 200,
                   .prefill_ms = -1,
                   .ttfb_ms = -1,
                   .total_ms = 1,
                   .outcome = "ok",
                   .state = "stream",
                   .dispatch = "concurrent",
                   .kv_waited = 1,
                   .kv_wait_ms = 0};
    px_access_write(&a);
}

static void estimate_line(void) {
    px_access a = {.req = "r4",
                   .method = "POST",
                   .endpoint = "/v1/chat/completions",
                   .client = "127.0.0.1",
                   .decode = "a b",
                   .status = 503,
                   .prefill_ms = -1,
                   .ttfb_ms = 0.004999,
                   .total_ms = -3,
                   .queued = 1,
                   .queue_ms = 1234567.891,
                   .bytes_out = 18446744073709551615ull,
                   .outcome = "error",
                   .decision = "decode_only",
                   .decision_reason = "short_prompt",
                   .fallback = "no_prefill",
                   .estimated = 1,
                   .prompt_tokens_est = -7,
                   .uncached_tokens_est = 4096};
    px_access_write(&a);
}

/* The access line's milliseconds are written without printf: byte for
 * byte what "%.2f" writes, ties (printf rounds the exact binary value,
 * half to even) and values on the request's own grid (nanoseconds / 1e6)
 * included. */
static void test_fixed_two_decimals_as_printf(void **state) {
    (void)state;
    const double vals[] = {0,      0.005,  0.015,   0.125,   0.375,  1.005, 2.675,  0.994999,
                           0.995,  9.995,  99.995,  1e9,     1e10,   1e20,  -0.0,   -1.5,
                           -0.004, NAN,    INFINITY, 8589934591.995, 8589934592.0, 0.1 + 0.2,
                           12.345, 4503599627370495.5};
    char got[32], want[64];
    for (size_t i = 0; i < sizeof vals / sizeof *vals; i++) {
        size_t n = px_fmt_2dp(vals[i], got);
        snprintf(want, sizeof want, "%.2f", vals[i]);
        if (strcmp(got, want) || n != strlen(want))
            fail_msg("%.17g: got %s, want %s", vals[i], got, want);
    }
    srand(36);
    for (int i = 0; i < 200000; i++) {
        uint64_t ns = ((uint64_t)rand() << 31 | (uint64_t)rand()) % 100000000000000ull;
        double v = i % 2 ? (double)ns / 1e9 * 1e3 : (double)(ns % 100000000) / 1e6;
        if (i % 7 == 0) v = (double)(ns % 100000) / 8.0; /* exact ties */
        px_fmt_2dp(v, got);
        snprintf(want, sizeof want, "%.2f", v);
        if (strcmp(got, want)) fail_msg("%.17g: got %s, want %s", v, got, want);
    }
}

static void test_access_line_leaves_out_the_unknown(void **state) {
    (void)state;
    char got[4096];
    capture(refused_line, "req=", got, sizeof got);
    assert_string_equal(got, "req=r1 msg=\"request\" endpoint=/v1/completions status=401 "
                             "total_ms=0.00 bytes_out=0 outcome=refused\n");
    capture(full_line, "req=", got, sizeof got);
    assert_string_equal(got, "req=r2 msg=\"request\" endpoint=/v1/completions "
                             "prefill=10.0.0.1:8100 decode=10.0.0.2:8200 status=200 "
                             "prefill_ms=12.50 ttfb_ms=20.00 total_ms=30.00 bytes_out=99 "
                             "outcome=ok trace_id=4bf92f3577b34da6a3ce929d0e0e4736\n");
    /* The final state, --dispatch and decode's KV wait (a wait of 0 is still
     * said). */
    capture(dispatch_line, "req=", got, sizeof got);
    assert_string_equal(got, "req=r3 msg=\"request\" endpoint=/v1/completions status=200 "
                             "total_ms=1.00 bytes_out=0 outcome=ok state=stream dispatch=concurrent "
                             "kv_wait_ms=0.00\n");
    /* Every other field: a quoted backend, a queue wait, the estimates. */
    capture(estimate_line, "req=", got, sizeof got);
    assert_string_equal(got, "req=r4 msg=\"request\" method=POST endpoint=/v1/chat/completions "
                             "client=127.0.0.1 decode=\"a b\" status=503 ttfb_ms=0.00 "
                             "queue_ms=1234567.89 total_ms=0.00 bytes_out=18446744073709551615 "
                             "outcome=error decision=decode_only decision_reason=short_prompt "
                             "fallback=no_prefill prompt_tokens_est=-7 uncached_tokens_est=4096\n");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_access_line_leaves_out_the_unknown),
        cmocka_unit_test(test_fixed_two_decimals_as_printf),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
