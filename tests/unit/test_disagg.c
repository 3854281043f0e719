/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h> /* after what it uses */

#include "proxy/disagg.h"

static px_config cfg_with(long min_tokens) {
    px_config c;
    memset(&c, 0, sizeof c);
    c.disagg_min_tokens = min_tokens;
    c.disagg_bytes_per_token = 4;
    return c;
}

static void decide(const px_config *c, px_endpoint ep, const char *body, px_pindex *x,
                   const uint64_t *key, px_disagg *d) {
    px_disagg_decide(c, ep, body, strlen(body), x, key, d);
}

static void test_always_without_threshold(void **state) {
    px_config c = cfg_with(0);
    px_disagg d;
    decide(&c, PX_EP_COMPLETIONS, "{\"prompt\":\"hi\"}", NULL, NULL, &d);
    assert_int_equal(d.disagg, 1);
    assert_int_equal(d.decision, PX_DEC_ALWAYS);
    assert_int_equal(d.estimated, 0);
    assert_null(d.hash);
}

static void test_short_and_long_prompts(void **state) {
    px_config c = cfg_with(10);
    px_disagg d;
    /* "\"hi\"": 4 bytes, 1 token by the estimate. */
    decide(&c, PX_EP_COMPLETIONS, "{\"prompt\":\"hi\"}", NULL, NULL, &d);
    assert_int_equal(d.disagg, 0);
    assert_int_equal(d.decision, PX_DEC_SHORT_PROMPT);
    assert_int_equal(d.estimated, 1);
    assert_int_equal(d.tokens, 1);
    /* Token ids count exactly: 12 of them. */
    decide(&c, PX_EP_COMPLETIONS, "{\"prompt\":[1,2,3,4,5,6,7,8,9,10,11,12]}", NULL, NULL, &d);
    assert_int_equal(d.disagg, 1);
    assert_int_equal(d.decision, PX_DEC_LONG_PROMPT);
    assert_int_equal(d.tokens, 12);
    assert_int_equal(d.uncached, 12);
    /* Chat counts the messages; Anthropic's system prompt adds to them. */
    decide(&c, PX_EP_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", NULL, NULL,
           &d);
    assert_int_equal(d.tokens, 8); /* 31 bytes / 4, rounded */
    decide(&c, PX_EP_MESSAGES,
           "{\"system\":\"0123456789012345678901234567890123456789\",\"messages\":[]}", NULL, NULL,
           &d);
    assert_int_equal(d.tokens, 11); /* (2 + 42) / 4 */
    assert_int_equal(d.disagg, 1);
}

static void test_cached_prefix(void **state) {
    px_config c = cfg_with(100);
    char body[2048];
    char prompt[1200];
    memset(prompt, 'a', sizeof prompt - 1);
    prompt[sizeof prompt - 1] = '\0';
    snprintf(body, sizeof body, "{\"prompt\":\"%s\"}", prompt);
    px_pindex *x = px_pindex_create(1024);
    uint64_t key = 42, other = 7;
    px_disagg d;
    decide(&c, PX_EP_COMPLETIONS, body, x, &key, &d);
    assert_int_equal(d.disagg, 1);
    assert_int_equal(d.decision, PX_DEC_LONG_PROMPT);
    assert_non_null(d.hash);
    assert_int_equal(d.nhash, 1201 / PX_PINDEX_BLOCK_BYTES);
    /* The decode got the request: its cache holds the prefix now. */
    px_pindex_add(x, key, d.hash, d.nhash);
    free(d.hash);
    decide(&c, PX_EP_COMPLETIONS, body, x, &key, &d);
    assert_int_equal(d.disagg, 0);
    assert_int_equal(d.decision, PX_DEC_CACHED_PREFIX);
    assert_true(d.uncached < 100);
    assert_int_equal(d.tokens, 300);
    free(d.hash);
    /* Another decode holds nothing of it. */
    decide(&c, PX_EP_COMPLETIONS, body, x, &other, &d);
    assert_int_equal(d.disagg, 1);
    assert_int_equal(d.uncached, 300);
    free(d.hash);
    /* No decode chosen: nothing counts as cached. */
    decide(&c, PX_EP_COMPLETIONS, body, x, NULL, &d);
    assert_int_equal(d.disagg, 1);
    free(d.hash);
    px_pindex_destroy(x);
}

static void test_key(void **state) {
    const char *b = "{\"model\":\"m\",\"prompt\":\"abcdefgh\"}";
    const char *k;
    size_t n;
    assert_int_equal(px_disagg_key(PX_EP_COMPLETIONS, b, strlen(b), 4, &k, &n), 1);
    assert_int_equal(n, 4);
    assert_memory_equal(k, "\"abc", 4);
    assert_int_equal(px_disagg_key(PX_EP_CHAT, b, strlen(b), 4, &k, &n), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_always_without_threshold),
        cmocka_unit_test(test_short_and_long_prompts),
        cmocka_unit_test(test_cached_prefix),
        cmocka_unit_test(test_key),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
