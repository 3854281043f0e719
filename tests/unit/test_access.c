/* SPDX-License-Identifier: Apache-2.0 */
/* cmocka.h needs these first. */
// clang-format off
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
// clang-format on
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
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_access_line_leaves_out_the_unknown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
