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
#include <stdio.h>
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
    /* Charged with what it computes: the 16 tokens it lacks. */
    assert_int_equal(atomic_load(&b->tokens), 16);
    /* 16 uncached tokens queued there do not outweigh 32 more cached. */
    px_backend *c = px_pool_pick(&p, &k, NULL);
    assert_ptr_equal(c, b);
    assert_int_equal(atomic_load(&b->tokens), 32);
    /* 72 queued do: the other engine, which lacks 48 of the 64. */
    px_backend_charge(b, 40);
    px_backend *d = px_pool_pick(&p, &k, NULL);
    assert_string_equal(d->name, "10.0.0.1:8000");
    assert_int_equal(cached, 16);
    assert_int_equal(atomic_load(&d->tokens), 48);
    px_backend_charge(b, -72);
    px_backend_charge(d, -48);
    px_backend_done(&p, b, PX_OUT_OK);
    px_backend_done(&p, c, PX_OUT_OK);
    px_backend_done(&p, d, PX_OUT_OK);
    /* The engine recomputes a prompt's last token: of a 48-token prompt
     * whose 6 blocks it holds, 40 tokens are reused, and it is charged 8. */
    k.ntok = 48;
    b = px_pool_pick(&p, &k, NULL);
    assert_string_equal(b->name, "10.0.0.2:8000");
    assert_int_equal(cached, 40);
    assert_int_equal(atomic_load(&b->tokens), 8);
    px_backend_charge(b, -8);
    px_backend_done(&p, b, PX_OUT_OK);
    assert_int_equal(px_kv_reusable(6, 8, 48), 40);
    assert_int_equal(px_kv_reusable(6, 8, 49), 48);
    assert_int_equal(px_kv_reusable(2, 8, 64), 16);
    assert_int_equal(px_kv_reusable(3, 8, 1), 0);
    assert_int_equal(px_kv_reusable(3, 8, 0), 0);
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

/* kv_aware's tie-break: the rendezvous hash of the prompt's first block
 * key with each backend's name. Pools listing the members in another order
 * agree, and prompts opening with the same block meet on one idle engine. */
static void test_kv_aware_tie(void **state) {
    (void)state;
    px_kvindex *x = px_kvindex_create(1000, 8);
    px_pool_cfg pc = {.policy = PX_POLICY_KV_AWARE,
                      .unhealthy_after = 3,
                      .healthy_after = 1,
                      .load_factor = 1.25,
                      .kv_cache_weight = 1,
                      .kv_load_weight = 1};
    static const char *const urls[] = {"http://10.0.0.1:8000", "http://10.0.0.2:8000",
                                       "http://10.0.0.3:8000", "http://10.0.0.4:8000"};
    px_pool a, z;
    px_pool_init(&a, "prefill", &pc);
    px_pool_init(&z, "prefill", &pc);
    for (int i = 0; i < 4; i++) {
        px_pool_add(&a, urls[i], NULL);
        px_pool_add(&z, urls[3 - i], NULL);
        char name[32];
        snprintf(name, sizeof name, "10.0.0.%d:8000", i + 1);
        uint64_t eh = 500u + (uint64_t)i;
        uint32_t other[8] = {9, 9, 9, 9, 9, 9, 9, (uint32_t)i}; /* a block of nothing asked */
        px_kvindex_store(x, px_kvindex_slot(x, name, 1), &eh, 1, 0, 0, other, 8, NULL, NULL);
    }
    px_pool_seal(&a);
    px_pool_seal(&z);
    int seen[4] = {0};
    for (uint32_t v = 0; v < 40; v++) {
        uint32_t t1[24], t2[24];
        for (int i = 0; i < 24; i++) {
            t1[i] = v * 100u + (uint32_t)i;
            t2[i] = i < 8 ? t1[i] : 7000u + (uint32_t)i; /* the same first block */
        }
        px_pick k1 = {.kv = x, .tok = t1, .ntok = 24}, k2 = {.kv = x, .tok = t2, .ntok = 24};
        /* Each request taken back (its charge too) before the next pick:
         * an idle pool every time. */
        px_backend *b1 = px_pool_pick(&a, &k1, NULL);
        px_backend_charge(b1, -24);
        px_backend_done(&a, b1, PX_OUT_OK);
        px_backend *b2 = px_pool_pick(&z, &k1, NULL);
        px_backend_charge(b2, -24);
        px_backend_done(&z, b2, PX_OUT_OK);
        px_backend *b3 = px_pool_pick(&a, &k2, NULL);
        px_backend_charge(b3, -24);
        px_backend_done(&a, b3, PX_OUT_OK);
        assert_string_equal(b1->name, b2->name); /* the pools still hold them */
        assert_string_equal(b1->name, b3->name);
        seen[b1->name[7] - '1']++;
    }
    for (int i = 0; i < 4; i++)
        assert_true(seen[i] > 0); /* different openings spread */
    px_pool_cleanup(&a);
    px_pool_cleanup(&z);
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
        cmocka_unit_test(test_body),         cmocka_unit_test(test_parse),
        cmocka_unit_test(test_cache),        cmocka_unit_test(test_kv_aware_choice),
        cmocka_unit_test(test_kv_aware_tie), cmocka_unit_test(test_sessions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
