/* SPDX-License-Identifier: Apache-2.0 */
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

/* What px_log_value should give for s: the model it is checked against. */
static void model_value(const char *s, char *out, size_t cap) {
    int plain = s[0] != 0;
    for (const char *p = s; *p; p++) {
        unsigned char c = (unsigned char)*p;
        if (c <= 0x20 || c == '=' || c == '"' || c == '\\' || c == 0x7f) plain = 0;
    }
    if (plain) {
        snprintf(out, cap, "%s", s);
        return;
    }
    size_t o = 0;
    out[o++] = '"';
    for (const char *p = s; *p && o + 6 < cap; p++) {
        unsigned char c = (unsigned char)*p;
        if (c == '"' || c == '\\')
            o += (size_t)snprintf(out + o, cap - o, "\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
        else
            out[o++] = (char)c;
    }
    out[o++] = '"';
    out[o] = 0;
}

/* Every byte value, alone, first, in the middle and last of a value, plain
 * or quoted and escaped as the model says; long plain values at every
 * buffer size (cut to fit, as snprintf would), and the empty value. */
static void test_value_every_byte(void **state) {
    (void)state;
    char s[64], got[128], want[128];
    for (int b = 1; b < 256; b++) {
        const char *forms[] = {"%c", "%cxyz", "ab%ccd", "abcdefghijklmnopqrstuvwxyz%c"};
        for (size_t f = 0; f < sizeof forms / sizeof *forms; f++) {
            snprintf(s, sizeof s, forms[f], b);
            const char *r = px_log_value(s, got, sizeof got);
            model_value(s, want, sizeof want);
            if (strcmp(r, want)) fail_msg("byte 0x%02x, form %zu: got [%s], want [%s]", b, f, r, want);
        }
    }
    const char *plain = "0123456789abcdefghijklmnopqrstuvwxyz-_.:/";
    for (size_t cap = 1; cap < 48; cap++) {
        px_log_value(plain, got, cap);
        model_value(plain, want, cap);
        assert_string_equal(got, want);
    }
    assert_string_equal(px_log_value("", got, sizeof got), "\"\"");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_values_typed),
        cmocka_unit_test(test_value_every_byte),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
