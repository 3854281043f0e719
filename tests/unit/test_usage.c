/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "proxy/usage.h"

/* The filter's output, collected. */
static void collect(void *arg, const char *p, size_t n)
{
    assert_true(n > 0);
    px_buf_append(arg, p, n);
}

/* Feeds `in` to a filter `step` bytes at a time, ends it, and returns what
 * came out (the caller frees). */
static char *run(const char *cached, int sse, size_t max_hold, const char *in, size_t step,
                 int whole)
{
    px_buf out;
    px_usage u;
    px_buf_init(&out);
    px_usage_init(&u, cached, sse, max_hold, collect, &out);
    size_t n = strlen(in);
    for (size_t at = 0; at < n; at += step) {
        size_t k = n - at < step ? n - at : step;
        if (!u.active || px_usage_feed(&u, in + at, k) < 0) px_buf_append(&out, in + at, k);
    }
    if (u.active) px_usage_end(&u, whole);
    assert_false(u.active);
    assert_int_equal(px_usage_held(&u), 0);
    px_usage_cleanup(&u);
    px_buf_append(&out, "", 1);
    return out.data;
}

static void test_cached_tokens(void **state)
{
    char out[24] = "x";
    const char *ok = "{\"id\":\"c\",\"usage\":{\"prompt_tokens\":9,"
                     "\"prompt_tokens_details\":{\"cached_tokens\":64}}}";
    assert_int_equal(px_usage_cached_tokens(ok, strlen(ok), out), 1);
    assert_string_equal(out, "64");
    const char *none = "{\"usage\":{\"prompt_tokens\":9}}";
    strcpy(out, "x");
    assert_int_equal(px_usage_cached_tokens(none, strlen(none), out), 0);
    assert_string_equal(out, "x");
    const char *text = "{\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":\"64\"}}}";
    assert_int_equal(px_usage_cached_tokens(text, strlen(text), out), 0);
    const char *big = "{\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":"
                      "123456789012345678901234567890}}}";
    assert_int_equal(px_usage_cached_tokens(big, strlen(big), out), 0);
    assert_int_equal(px_usage_cached_tokens(NULL, 0, out), 0);
    /* From the usage member found already (px_extract_prefill_answer). */
    px_json_member u;
    assert_int_equal(px_json_find(ok, strlen(ok), "usage", &u), 1);
    strcpy(out, "x");
    assert_int_equal(px_usage_cached_tokens_in(&u, out), 1);
    assert_string_equal(out, "64");
    u.val = NULL;
    strcpy(out, "x");
    assert_int_equal(px_usage_cached_tokens_in(&u, out), 0);
    assert_string_equal(out, "x");
}

static void test_json_whole(void **state)
{
    const char *in = "{\"choices\":[],\"usage\":{\"prompt_tokens\":9,"
                     "\"prompt_tokens_details\":{\"cached_tokens\":0}}}";
    const char *want = "{\"choices\":[],\"usage\":{\"prompt_tokens\":9,"
                       "\"prompt_tokens_details\":{\"cached_tokens\":64}}}";
    for (size_t step = 1; step < 8; step++) {
        char *got = run("64", 0, 1 << 20, in, step, 1);
        assert_string_equal(got, want);
        free(got);
    }
    /* A cut answer goes out as it came. */
    char *got = run("64", 0, 1 << 20, in, 5, 0);
    assert_string_equal(got, in);
    free(got);
    /* Without the member, every byte as it is. */
    got = run("64", 0, 1 << 20, "{\"usage\":{}}", 3, 1);
    assert_string_equal(got, "{\"usage\":{}}");
    free(got);
}

static void test_sse_events(void **state)
{
    const char *in = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
                     "data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":3}}}\r\n\r\n"
                     "data: [DONE]\n\n";
    const char *want = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
                       "data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":128}}}"
                       "\r\n\r\n"
                       "data: [DONE]\n\n";
    for (size_t step = 1; step < 12; step++) {
        char *got = run("128", 1, 1 << 20, in, step, 1);
        assert_string_equal(got, want);
        free(got);
    }
    /* A partial event left at the end goes out as it is. */
    char *got = run("128", 1, 1 << 20, "data: {\"a\":1}\n\ndata: {\"usage\"", 4, 0);
    assert_string_equal(got, "data: {\"a\":1}\n\ndata: {\"usage\"");
    free(got);
    /* cached_tokens outside a data line is not touched. */
    const char *odd = ": \"cached_tokens\":3\n\n";
    got = run("128", 1, 1 << 20, odd, 2, 1);
    assert_string_equal(got, odd);
    free(got);
}

static void test_gives_up_past_the_limit(void **state)
{
    const char *in = "{\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":0}}}";
    /* Held up to 16 bytes: then the held bytes go first, the rest passes
     * untouched, in order. */
    char *got = run("64", 0, 16, in, 10, 1);
    assert_string_equal(got, in);
    free(got);

    px_buf out;
    px_usage u;
    px_buf_init(&out);
    px_usage_init(&u, "64", 0, 4, collect, &out);
    assert_int_equal(px_usage_feed(&u, "abc", 3), 0);
    assert_int_equal(out.len, 0);
    assert_int_equal(px_usage_held(&u), 3);
    assert_int_equal(px_usage_feed(&u, "de", 2), -1);
    assert_false(u.active);
    assert_int_equal(out.len, 3);
    assert_memory_equal(out.data, "abc", 3);
    px_usage_cleanup(&u);
    px_buf_cleanup(&out);
}

/* Issue 41: the usage chunk the proxy asked for is dropped, every other
 * byte passes as it came, whatever the pieces. */
static void test_strip_usage_chunk(void **state)
{
    (void)state;
    const char *in = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
                     "data: {\"choices\": [ ],\"usage\":{\"total_tokens\":10}}\r\n\r\n"
                     "data: {\"choices\":[],\"usage\":null}\n\n"
                     "data: [DONE]\n\n";
    const char *want = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
                       "data: {\"choices\":[],\"usage\":null}\n\n"
                       "data: [DONE]\n\n";
    for (size_t step = 1; step <= strlen(in); step += 7) {
        px_buf out;
        px_usage u;
        px_buf_init(&out);
        px_usage_init(&u, "", 1, 1 << 20, collect, &out);
        px_usage_strip(&u);
        size_t n = strlen(in);
        for (size_t at = 0; at < n; at += step)
            assert_int_equal(px_usage_feed(&u, in + at, n - at < step ? n - at : step), 0);
        px_usage_end(&u, 1);
        assert_int_equal(u.stripped, 1);
        px_buf_append(&out, "", 1);
        assert_string_equal(out.data, want);
        px_buf_cleanup(&out);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_strip_usage_chunk),
        cmocka_unit_test(test_cached_tokens),
        cmocka_unit_test(test_json_whole),
        cmocka_unit_test(test_sse_events),
        cmocka_unit_test(test_gives_up_past_the_limit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
