/* SPDX-License-Identifier: Apache-2.0 */
/* cmocka.h needs these first. */
// clang-format off
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
// clang-format on
#include "base/log.h"
#include "tests/unit/stderr_capture.h"

static void typed_line(void) {
    px_log_json = 1;
    px_log_write(PX_LOG_INFO, "a=1e3 b=01 c=0x10 d=-0.5 e=1. f=-1 g=inf h=\"12\" req=123 "
                              "trace_id=0123 m=5xx k= n=0 o=1E+2 p=-");
    px_log_json = 0;
}

static void test_json_values_typed(void **state) {
    (void)state;
    char got[4096];
    capture(typed_line, "\"a\"", got, sizeof got);
    /* Numbers as JSON spells them; everything else a string, and ids stay
     * strings even when they are digits. */
    assert_string_equal(got, "\"a\":1e3,\"b\":\"01\",\"c\":\"0x10\",\"d\":-0.5,\"e\":\"1.\","
                             "\"f\":-1,\"g\":\"inf\",\"h\":\"12\",\"req\":\"123\","
                             "\"trace_id\":\"0123\",\"m\":\"5xx\",\"k\":\"\",\"n\":0,"
                             "\"o\":1E+2,\"p\":\"-\"}\n");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_values_typed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
