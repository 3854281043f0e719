/* SPDX-License-Identifier: Apache-2.0 */
/* proxy/tokenize.c: the /tokenize body built from a request, its answer
 * read, the per-worker cache; and kv_aware's choice (proxy/route.c) over
 * a real index. */
/* cmocka.h needs these first. */
// clang-format off
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
// clang-format on
#include <stdlib.h>
#include <string.h>

#include "proxy/kvindex.h"
#include "proxy/route.h"
#include "proxy/tokenize.h"

static void test_body(void **state) {
    (void)state;
    px_buf b;
    px_buf_init(&b);
    uint64_t k1, k2, k3;
    const char *c = "{\"model\":\"m\",\"prompt\":\"hi there\",\"max_tokens\":3}";
    assert_int_equal(px_tokenize_body(PX_EP_COMPLETIONS, c, strlen(c), &b, &k1), 0);
    assert_int_equal(b.len, strlen("{\"model\":\"m\",\"prompt\":\"hi there\"}"));
    assert_memory_equal(b.data, "{\"model\":\"m\",\"prompt\":\"hi there\"}", b.len);
    px_buf_reset(&b);
    /* max_tokens and the rest do not change the key; the prompt does. */
    const char *c2 = "{\"prompt\":\"hi there\",\"model\":\"m\"}";
    assert_int_equal(px_tokenize_body(PX_EP_COMPLETIONS, c2, strlen(c2), &b, &k2), 0);
    assert_int_equal(k1, k2);
    px_buf_reset(&b);
    const char *c3 = "{\"model\":\"m\",\"prompt\":\"hi there!\"}";
    assert_int_equal(px_tokenize_body(PX_EP_COMPLETIONS, c3, strlen(c3), &b, &k3), 0);
    assert_int_not_equal(k1, k3);
    px_buf_reset(&b);
    const char *ch = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}";
    assert_int_equal(px_tokenize_body(PX_EP_CHAT, ch, strlen(ch), &b, &k3), 0);
    assert_non_null(memmem(b.data, b.len, "\"messages\":[{", 13));
    px_buf_reset(&b);
    /* Token ids, a batch, no prompt: nothing to ask. */
    const char *ids = "{\"model\":\"m\",\"prompt\":[1,2,3]}";
    assert_int_equal(px_tokenize_body(PX_EP_COMPLETIONS, ids, strlen(ids), &b, &k3), -1);
    const char *none = "{\"model\":\"m\"}";
    assert_int_equal(px_tokenize_body(PX_EP_COMPLETIONS, none, strlen(none), &b, &k3), -1);
    assert_int_equal(px_tokenize_body(PX_EP_MODELS, c, strlen(c), &b, &k3), -1);
    px_buf_cleanup(&b);
}

static void test_parse(void **state) {
    (void)state;
    uint32_t *t;
    const char *ok = "{\"count\":3,\"max_model_len\":4096,\"tokens\":[1, 22,333]}";
    assert_int_equal(px_tokenize_parse(ok, strlen(ok), 100, &t), 3);
    assert_int_equal(t[0], 1);
    assert_int_equal(t[2], 333);
    free(t);
    const char *bad[] = {"{\"tokens\":[1,-2]}",
                         "{\"tokens\":[1.5]}",
                         "{\"tokens\":\"x\"}",
                         "{\"count\":1}",
                         "{\"tokens\":[]}",
                         "{\"tokens\":[4294967296]}",
                         "not json"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(px_tokenize_parse(bad[i], strlen(bad[i]), 100, &t), -1);
        assert_null(t);
    }
    assert_int_equal(px_tokenize_parse(ok, strlen(ok), 2, &t), -1); /* over max */
}

static void test_cache(void **state) {
    (void)state;
    px_tokcache *c = px_tokcache_create(4, 3);
    uint32_t a[3] = {1, 2, 3}, big[4] = {1, 2, 3, 4}, *out;
    assert_int_equal(px_tokcache_get(c, 7, &out), -1);
    px_tokcache_put(c, 7, a, 3);
    assert_int_equal(px_tokcache_get(c, 7, &out), 3);
    assert_memory_equal(out, a, sizeof a);
    free(out);
    px_tokcache_put(c, 8, big, 4); /* over max_tokens: not kept */
    assert_int_equal(px_tokcache_get(c, 8, &out), -1);
    for (uint64_t k = 100; k < 200; k++) /* bounded: old ones give way */
        px_tokcache_put(c, k, a, 2);
    assert_int_equal(px_tokcache_get(c, 199, &out), 2);
    free(out);
    px_tokcache_destroy(c);
}

/* kv_aware: the backend caching the longest prefix wins; load in tokens
 * moves the choice; equal scores break the same way every time. */
static void test_kv_aware_choice(void **state) {
    (void)state;
    px_kvindex *x = px_kvindex_create(1000, 4);
    px_pool_cfg pc = {.policy = PX_POLICY_KV_AWARE,
                      .unhealthy_after = 3,
                      .healthy_after = 1,
                      .load_factor = 1.25,
                      .kv_cache_weight = 1,
                      .kv_load_weight = 1};
    px_pool p;
    px_pool_init(&p, "prefill", &pc);
    px_pool_add(&p, "http://10.0.0.1:8000", NULL);
    px_pool_add(&p, "http://10.0.0.2:8000", NULL);
    px_pool_seal(&p);
    uint32_t tok[64];
    for (int i = 0; i < 64; i++)
        tok[i] = 1000u + (uint32_t)i;
    uint64_t eh[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int s1 = px_kvindex_slot(x, "10.0.0.1:8000", 1), s2 = px_kvindex_slot(x, "10.0.0.2:8000", 1);
    px_kvindex_store(x, s1, eh, 2, 0, 0, tok, 8, NULL, NULL); /* 16 tokens */
    px_kvindex_store(x, s2, eh, 6, 0, 0, tok, 8, NULL, NULL); /* 48 tokens */
    size_t cached = 0;
    px_pick k = {.kv = x, .tok = tok, .ntok = 64, .cached = &cached};
    px_backend *b = px_pool_pick(&p, &k, NULL);
    assert_string_equal(b->name, "10.0.0.2:8000");
    assert_int_equal(cached, 48);
    assert_int_equal(atomic_load(&b->tokens), 64); /* charged */
    /* With 64 tokens in flight there, 48 cached no longer beat 16. */
    px_backend *c = px_pool_pick(&p, &k, NULL);
    assert_string_equal(c->name, "10.0.0.1:8000");
    px_backend_charge(b, -64);
    px_backend_charge(c, -64);
    px_backend_done(&p, b, PX_OUT_OK);
    px_backend_done(&p, c, PX_OUT_OK);
    /* Uncached prompt, idle pool: the same choice every time for it. */
    uint32_t other[16];
    for (int i = 0; i < 16; i++)
        other[i] = 77;
    px_pick o = {.kv = x, .tok = other, .ntok = 16, .key = "abc", .key_len = 3};
    px_backend *first = px_pool_pick(&p, &o, NULL);
    px_backend_charge(first, -16);
    px_backend_done(&p, first, PX_OUT_OK);
    for (int i = 0; i < 5; i++) {
        px_backend *again = px_pool_pick(&p, &o, NULL);
        assert_ptr_equal(again, first);
        px_backend_charge(again, -16);
        px_backend_done(&p, again, PX_OUT_OK);
    }
    px_pool_cleanup(&p);
    px_kvindex_destroy(x);
}

static void test_sessions(void **state) {
    (void)state;
    px_sessions *s = px_sessions_create(16, 60);
    uint64_t b;
    assert_int_equal(px_sessions_get(s, 5, &b), 0);
    px_sessions_put(s, 5, 99);
    assert_int_equal(px_sessions_get(s, 5, &b), 1);
    assert_int_equal(b, 99);
    assert_int_equal(px_sessions_get(s, 0, &b), 0);
    px_sessions_destroy(s);
    px_sessions *t = px_sessions_create(16, 0); /* expires at once */
    px_sessions_put(t, 5, 99);
    assert_int_equal(px_sessions_get(t, 5, &b), 0);
    px_sessions_destroy(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_body),     cmocka_unit_test(test_parse),
        cmocka_unit_test(test_cache),    cmocka_unit_test(test_kv_aware_choice),
        cmocka_unit_test(test_sessions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
