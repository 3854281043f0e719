/* cmocka.h needs these first. */
// clang-format off
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
// clang-format on
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "log.h"

/* Runs fn with stderr sent to a temporary file; returns what it wrote
 * (one line), from the first occurrence of `from` on. */
static void capture(void (*fn)(void), const char *from, char *out, size_t cap) {
    FILE *tmp = tmpfile();
    assert_non_null(tmp);
    fflush(stderr);
    int saved = dup(2);
    assert_true(saved >= 0);
    assert_true(dup2(fileno(tmp), 2) >= 0);
    fn();
    fflush(stderr);
    assert_true(dup2(saved, 2) >= 0);
    close(saved);
    rewind(tmp);
    char line[4096] = "";
    size_t n = fread(line, 1, sizeof line - 1, tmp);
    line[n] = '\0';
    fclose(tmp);
    const char *p = strstr(line, from);
    assert_non_null(p);
    snprintf(out, cap, "%s", p);
}

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

static void refused_line(void) {
    px_access a = {.req = "r1",
                   .endpoint = "/v1/completions",
                   .status = 401,
                   .prefill_ms = -1,
                   .ttfb_ms = -1,
                   .total_ms = 0,
                   .outcome = "refused"};
    px_log_access(&a);
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
    px_log_access(&a);
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
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_values_typed),
        cmocka_unit_test(test_access_line_leaves_out_the_unknown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
