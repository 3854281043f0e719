/* SPDX-License-Identifier: Apache-2.0 */
/* proxy/route.c: the routing policies, passive and active ejection,
 * readmission and panic routing, on pools of literal-address backends (no
 * DNS, no network). */
/* cmocka.h needs these first. */
// clang-format off
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
// clang-format on

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "proxy/route.h"

#define NB 4

typedef struct {
    px_pool pool;
    px_backend *b[NB];
    size_t n;
} fixture;

static void fixture_init(fixture *f, px_policy policy, size_t n, int active_checks) {
    px_pool_cfg cfg = {.policy = policy,
                       .unhealthy_after = 2,
                       .healthy_after = 2,
                       .active_checks = active_checks,
                       .prefix_bytes = 64,
                       .load_factor = 1.25};
    px_pool_init(&f->pool, "decode", &cfg);
    f->n = n;
    for (size_t i = 0; i < n; i++) {
        char url[64];
        snprintf(url, sizeof url, "http://127.0.0.1:%zu", 9001 + i);
        f->b[i] = px_pool_add(&f->pool, url, NULL);
        assert_non_null(f->b[i]);
    }
    px_pool_seal(&f->pool);
}

static void fixture_cleanup(fixture *f) {
    for (size_t i = 0; i < f->n; i++)
        assert_int_equal(atomic_load(&f->b[i]->inflight), 0);
    px_pool_cleanup(&f->pool);
}

/* Index of the member picked (the pick ended at once with `o`), or -1. */
static int pick_done(fixture *f, const px_pick *k, px_outcome o) {
    size_t nm = 0;
    px_backend *b = px_pool_pick(&f->pool, k, &nm);
    assert_int_equal(nm, f->n);
    if (!b) return -1;
    int idx = -1;
    for (size_t i = 0; i < f->n; i++)
        if (f->b[i] == b) idx = (int)i;
    assert_true(idx >= 0);
    px_backend_done(&f->pool, b, o);
    return idx;
}

static int pick(fixture *f, const px_pick *k) {
    return pick_done(f, k, PX_OUT_OK);
}

static void test_policy_names(void **state) {
    (void)state;
    for (int p = PX_POLICY_ROUND_ROBIN; p <= PX_POLICY_LOAD_AWARE; p++)
        assert_int_equal(px_policy_parse(px_policy_name((px_policy)p)), p);
    assert_int_equal(px_policy_parse("random"), -1);
    assert_string_equal(px_outcome_name(PX_OUT_CONNECT_ERR), "connect_error");
}

static void test_url_split(void **state) {
    (void)state;
    char host[64];
    int port, https;
    assert_int_equal(px_url_split("http://engine:8000/", host, sizeof host, &port, &https), 0);
    assert_string_equal(host, "engine");
    assert_int_equal(port, 8000);
    assert_int_equal(https, 0);
    assert_int_equal(px_url_split("https://[::1]", host, sizeof host, &port, &https), 0);
    assert_string_equal(host, "::1");
    assert_int_equal(port, 443);
    assert_int_equal(https, 1);
    assert_int_equal(px_url_split("ftp://x", host, sizeof host, &port, &https), -1);
    assert_int_equal(px_url_split("http://x:0", host, sizeof host, &port, &https), -1);
    assert_int_equal(px_url_split("http://x:99999", host, sizeof host, &port, &https), -1);
    assert_int_equal(px_url_split("http://[::1", host, sizeof host, &port, &https), -1);
    assert_int_equal(px_url_split("http://", host, sizeof host, &port, &https), -1);
}

static void test_hash_seeded(void **state) {
    (void)state;
    /* FNV-1a test vectors; a seed moves the offset basis. */
    assert_true(px_hash64("", 0) == 0xcbf29ce484222325ull);
    assert_true(px_hash64("a", 1) == 0xaf63dc4c8601ec8cull);
    assert_true(px_hash64("foobar", 6) == 0x85944171f73967e8ull);
    /* A prefix hash continued is the hash of the whole. */
    assert_true(px_hash64_more(px_hash64("foo", 3), "bar", 3) == px_hash64("foobar", 6));
    assert_true(px_hash64_seed("foobar", 6, 0) == px_hash64("foobar", 6));
    assert_true(px_hash64_seed("a", 1, 1) != px_hash64("a", 1));
    assert_true(px_hash64_seed("", 0, 0x5eed) == (0xcbf29ce484222325ull ^ 0x5eed));
}

static void test_round_robin(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, PX_POLICY_ROUND_ROBIN, 3, 0);
    for (int i = 0; i < 7; i++)
        assert_int_equal(pick(&f, NULL), i % 3);
    /* An ejected member is skipped, the others keep their turns. */
    atomic_store(&f.b[1]->healthy, 0);
    atomic_store(&f.b[1]->readmit_ns, UINT64_MAX);
    int seen[3] = {0};
    for (int i = 0; i < 6; i++)
        seen[pick(&f, NULL)]++;
    assert_int_equal(seen[0], 3);
    assert_int_equal(seen[1], 0);
    assert_int_equal(seen[2], 3);
    fixture_cleanup(&f);
}

static void test_exclude(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, PX_POLICY_ROUND_ROBIN, 2, 0);
    px_backend *ex[] = {f.b[0]};
    px_pick k = {.exclude = ex, .nexclude = 1};
    for (int i = 0; i < 4; i++)
        assert_int_equal(pick(&f, &k), 1);
    /* Every member already tried: one is chosen anyway. */
    px_backend *all[] = {f.b[0], f.b[1]};
    k.exclude = all;
    k.nexclude = 2;
    assert_true(pick(&f, &k) >= 0);
    fixture_cleanup(&f);
}

static void test_least_inflight(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, PX_POLICY_LEAST_INFLIGHT, 3, 0);
    atomic_store(&f.b[0]->inflight, 5);
    atomic_store(&f.b[1]->inflight, 1);
    atomic_store(&f.b[2]->inflight, 3);
    for (int i = 0; i < 5; i++)
        assert_int_equal(pick(&f, NULL), 1);
    /* Ties go round, not always to the first member. */
    atomic_store(&f.b[0]->inflight, 0);
    atomic_store(&f.b[1]->inflight, 0);
    atomic_store(&f.b[2]->inflight, 0);
    int seen[3] = {0};
    for (int i = 0; i < 6; i++)
        seen[pick(&f, NULL)]++;
    assert_true(seen[0] > 0 && seen[1] > 0 && seen[2] > 0);
    fixture_cleanup(&f);
}

static void test_power_of_two(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, PX_POLICY_POWER_OF_TWO, 2, 0);
    /* With two candidates both are always compared: the idle one wins. */
    atomic_store(&f.b[0]->inflight, 4);
    for (int i = 0; i < 50; i++)
        assert_int_equal(pick(&f, NULL), 1);
    atomic_store(&f.b[0]->inflight, 0);
    atomic_store(&f.b[1]->inflight, 4);
    for (int i = 0; i < 50; i++)
        assert_int_equal(pick(&f, NULL), 0);
    atomic_store(&f.b[1]->inflight, 0);
    fixture_cleanup(&f);
}

static void test_prefix_affinity(void **state) {
    (void)state;
    fixture f, g;
    fixture_init(&f, PX_POLICY_PREFIX_AFFINITY, 4, 0);
    fixture_init(&g, PX_POLICY_PREFIX_AFFINITY, 4, 0);
    char key[32];
    int spread[NB] = {0};
    for (int i = 0; i < 64; i++) {
        snprintf(key, sizeof key, "prompt prefix %d", i);
        px_pick k = {.key = key, .key_len = strlen(key)};
        int first = pick(&f, &k);
        assert_true(first >= 0);
        /* The same key, the same member, and another replica agrees. */
        assert_int_equal(pick(&f, &k), first);
        assert_int_equal(pick(&g, &k), first);
        spread[first]++;
    }
    for (int i = 0; i < NB; i++)
        assert_true(spread[i] > 0);

    /* Bounded load: a member far above the mean gives the key away. */
    snprintf(key, sizeof key, "prompt prefix 0");
    px_pick k = {.key = key, .key_len = strlen(key)};
    int home = pick(&f, &k);
    atomic_store(&f.b[home]->inflight, 100);
    int away = pick(&f, &k);
    assert_true(away >= 0 && away != home);
    atomic_store(&f.b[home]->inflight, 0);
    assert_int_equal(pick(&f, &k), home);

    /* Ejected home: the key moves; readmitted: it comes back. */
    atomic_store(&f.b[home]->healthy, 0);
    atomic_store(&f.b[home]->readmit_ns, UINT64_MAX);
    assert_int_not_equal(pick(&f, &k), home);
    atomic_store(&f.b[home]->healthy, 1);
    assert_int_equal(pick(&f, &k), home);
    fixture_cleanup(&f);
    fixture_cleanup(&g);
}

static void test_passive_ejection(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, PX_POLICY_ROUND_ROBIN, 2, 0);
    /* Client errors and cancellations say nothing about the backend. */
    px_backend *b = px_pool_pick(&f.pool, NULL, NULL);
    assert_ptr_equal(b, f.b[0]);
    px_backend_done(&f.pool, b, PX_OUT_CLIENT_ERR);
    for (int i = 0; i < 3; i++) {
        b = px_pool_pick(&f.pool, NULL, NULL);
        px_backend_done(&f.pool, b, PX_OUT_CANCELLED);
    }
    assert_int_equal(atomic_load(&f.b[0]->healthy), 1);
    assert_int_equal(atomic_load(&f.b[1]->healthy), 1);

    /* unhealthy_after = 2 failures in a row eject; a retry of the same
     * request (done_repeat) does not count. */
    atomic_store(&f.b[0]->fails, 0);
    atomic_store(&f.b[1]->fails, 0);
    atomic_fetch_add(&f.b[0]->inflight, 1);
    atomic_fetch_add(&f.b[0]->refs, 1);
    px_backend_done(&f.pool, f.b[0], PX_OUT_SERVER_ERR);
    atomic_fetch_add(&f.b[0]->inflight, 1);
    atomic_fetch_add(&f.b[0]->refs, 1);
    px_backend_done_repeat(&f.pool, f.b[0], PX_OUT_TIMEOUT);
    assert_int_equal(atomic_load(&f.b[0]->healthy), 1);
    atomic_fetch_add(&f.b[0]->inflight, 1);
    atomic_fetch_add(&f.b[0]->refs, 1);
    px_backend_done(&f.pool, f.b[0], PX_OUT_CONNECT_ERR);
    assert_int_equal(atomic_load(&f.b[0]->healthy), 0);
    size_t n, healthy;
    px_pool_counts(&f.pool, &n, &healthy);
    assert_int_equal(n, 2);
    assert_int_equal(healthy, 1);
    for (int i = 0; i < 4; i++)
        assert_int_equal(pick(&f, NULL), 1);

    /* Without active checks, after its backoff an ejected member gets one
     * try (probation): one more failure ejects it again. */
    atomic_store(&f.b[0]->readmit_ns, 0);
    int got = -1;
    for (int i = 0; i < 2 && got != 0; i++)
        got = pick_done(&f, NULL, PX_OUT_RESET);
    assert_int_equal(got, 0);
    assert_int_equal(atomic_load(&f.b[0]->healthy), 0);
    assert_int_equal(atomic_load(&f.b[0]->ejections), 2);

    /* A success on probation readmits for good. */
    atomic_store(&f.b[0]->readmit_ns, 0);
    got = -1;
    for (int i = 0; i < 2 && got != 0; i++)
        got = pick(&f, NULL);
    assert_int_equal(got, 0);
    assert_int_equal(atomic_load(&f.b[0]->healthy), 1);
    assert_int_equal(atomic_load(&f.b[0]->ejections), 0);
    fixture_cleanup(&f);
}

static void test_panic_routing(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, PX_POLICY_ROUND_ROBIN, 2, 0);
    for (size_t i = 0; i < 2; i++) {
        atomic_store(&f.b[i]->healthy, 0);
        atomic_store(&f.b[i]->readmit_ns, UINT64_MAX);
    }
    assert_int_equal(px_pool_usable(&f.pool), 2);
    /* Every member ejected for failed requests: routed anyway, counted, and
     * the one that answers is back at once. */
    int got = pick(&f, NULL);
    assert_true(got >= 0);
    assert_int_equal(atomic_load(&f.pool.panic_routed), 1);
    assert_int_equal(atomic_load(&f.b[got]->healthy), 1);
    assert_int_equal(pick(&f, NULL), got);
    assert_int_equal(atomic_load(&f.pool.panic_routed), 1);

    /* Drained members are never chosen, not even in a panic. */
    atomic_store(&f.b[got]->drained, 1);
    int other = 1 - got;
    assert_int_equal(pick_done(&f, NULL, PX_OUT_SERVER_ERR), other);
    atomic_store(&f.b[got]->drained, 0);
    fixture_cleanup(&f);
}

static void test_active_checks(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, PX_POLICY_ROUND_ROBIN, 2, 1);
    /* Two failed checks eject; with active checks no backoff readmits. */
    px_backend_check(&f.pool, f.b[0], 0);
    assert_int_equal(atomic_load(&f.b[0]->healthy), 1);
    px_backend_check(&f.pool, f.b[0], 0);
    assert_int_equal(atomic_load(&f.b[0]->healthy), 0);
    assert_int_equal(atomic_load(&f.b[0]->ejected_by_check), 1);
    atomic_store(&f.b[0]->readmit_ns, 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(pick(&f, NULL), 1);

    /* Failing its checks, a member gets no panic traffic either. */
    px_backend_check(&f.pool, f.b[1], 0);
    px_backend_check(&f.pool, f.b[1], 0);
    assert_int_equal(px_pool_usable(&f.pool), 0);
    assert_int_equal(pick(&f, NULL), -1);
    assert_int_equal(atomic_load(&f.pool.panic_routed), 0);

    /* healthy_after = 2 passing checks readmit one ejected by checks. */
    px_backend_check(&f.pool, f.b[0], 1);
    assert_int_equal(atomic_load(&f.b[0]->healthy), 0);
    px_backend_check(&f.pool, f.b[0], 1);
    assert_int_equal(atomic_load(&f.b[0]->healthy), 1);
    assert_int_equal(pick(&f, NULL), 0);
    fixture_cleanup(&f);
}

static void test_passive_then_check(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, PX_POLICY_ROUND_ROBIN, 1, 1);
    /* Ejected for failed requests, one passing check is enough. */
    for (int i = 0; i < 2; i++)
        assert_int_equal(pick_done(&f, NULL, PX_OUT_SERVER_ERR), 0);
    assert_int_equal(atomic_load(&f.b[0]->healthy), 0);
    assert_int_equal(atomic_load(&f.b[0]->ejected_by_check), 0);
    px_backend_check(&f.pool, f.b[0], 1);
    assert_int_equal(atomic_load(&f.b[0]->healthy), 1);
    fixture_cleanup(&f);
}

/* The admin API's changes in place: a ring kept by merging and filtering
 * (px_pool_insert, px_pool_remove_src) is the ring a rebuild of the same
 * members makes, so picks agree with a replica that started with them. */
static void test_ring_incremental(void **state) {
    (void)state;
    px_pool_cfg cfg = {.policy = PX_POLICY_PREFIX_AFFINITY,
                       .unhealthy_after = 2,
                       .healthy_after = 2,
                       .load_factor = 1.25};
    px_pool a, b;
    px_pool_init(&a, "decode", &cfg);
    px_pool_init(&b, "decode", &cfg);
    enum { N = 300 };
    char url[N][64];
    int gone[N] = {0};
    for (int i = 0; i < N; i++) {
        snprintf(url[i], sizeof url[i], "http://127.0.%d.%d:8000", i / 250, i % 250 + 1);
        assert_non_null(px_pool_insert(&a, url[i]));
        assert_int_equal(a.nring, (size_t)(i + 1) * 64);
    }
    /* First, last and every seventh go; one of them twice. */
    for (int i = 0; i < N; i++)
        if (i == 0 || i == N - 1 || i % 7 == 3) {
            assert_int_equal(px_pool_remove_src(&a, url[i]), 1);
            gone[i] = 1;
        }
    assert_int_equal(px_pool_remove_src(&a, url[3]), 0);
    assert_int_equal(px_pool_remove_src(&a, "http://127.9.9.9:1"), 0);
    for (int i = 0; i < N; i++)
        if (!gone[i]) assert_non_null(px_pool_add(&b, url[i], NULL));
    px_pool_seal(&b);
    assert_int_equal(a.n, b.n);
    for (size_t i = 0; i < a.n; i++)
        assert_string_equal(a.b[i]->src, b.b[i]->src);
    assert_int_equal(a.nring, b.nring);
    assert_memory_equal(a.ring, b.ring, a.nring * sizeof *a.ring);
    for (int i = 0; i < 200; i++) {
        char key[32];
        snprintf(key, sizeof key, "prompt %d", i);
        px_pick k = {.key = key, .key_len = strlen(key)};
        px_backend *x = px_pool_pick(&a, &k, NULL), *y = px_pool_pick(&b, &k, NULL);
        assert_non_null(x);
        assert_string_equal(x->name, y->name);
        px_backend_done(&a, x, PX_OUT_OK);
        px_backend_done(&b, y, PX_OUT_OK);
    }
    /* A request holding a removed member keeps it until it is done. */
    px_backend *held = px_pool_pick(&a, NULL, NULL);
    assert_non_null(held);
    assert_int_equal(px_pool_remove_src(&a, held->src), 1);
    assert_int_equal(a.nring, (a.n) * 64);
    assert_true(strncmp(held->src, "http://", 7) == 0);
    px_backend_done(&a, held, PX_OUT_OK);
    px_pool_cleanup(&a);
    px_pool_cleanup(&b);
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* A sealed ring of thousands of members (member indexes spanning two
 * bytes, as at 10,000 backends) is the ring qsort would make: ascending,
 * 64 points per member, none lost. */
static void test_ring_sealed_large(void **state) {
    (void)state;
    px_pool_cfg cfg = {.policy = PX_POLICY_PREFIX_AFFINITY,
                       .unhealthy_after = 2,
                       .healthy_after = 2,
                       .load_factor = 1.25};
    px_pool p;
    px_pool_init(&p, "prefill", &cfg);
    enum { N = 3000 };
    for (int i = 0; i < N; i++) {
        char url[64];
        snprintf(url, sizeof url, "http://127.1.%d.%d:8000", i / 250, i % 250 + 1);
        assert_non_null(px_pool_add(&p, url, NULL));
    }
    px_pool_seal(&p);
    assert_int_equal(p.nring, (size_t)N * 64);
    uint64_t *want = malloc(p.nring * sizeof *want);
    assert_non_null(want);
    memcpy(want, p.ring, p.nring * sizeof *want);
    qsort(want, p.nring, sizeof *want, cmp_u64);
    assert_memory_equal(p.ring, want, p.nring * sizeof *want);
    size_t per[N] = {0};
    for (size_t i = 0; i < p.nring; i++)
        per[p.ring[i] & 0xffff]++;
    for (int i = 0; i < N; i++)
        assert_int_equal(per[i], 64);
    free(want);
    px_pool_cleanup(&p);
}

/* The members' addresses as a set: what a worker keeps connections to. */
static void test_addrset(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, PX_POLICY_ROUND_ROBIN, 4, 0);
    px_pool v6;
    px_pool_cfg cfg = {.policy = PX_POLICY_ROUND_ROBIN, .unhealthy_after = 1, .healthy_after = 1};
    px_pool_init(&v6, "prefill", &cfg);
    assert_non_null(px_pool_add(&v6, "http://[::1]:7000", NULL));
    px_addrset *s = px_addrset_create();
    px_addrset_add_pool(s, &f.pool);
    px_addrset_add_pool(s, &v6);
    for (size_t i = 0; i < f.n; i++)
        assert_true(px_addrset_has(s, (struct sockaddr *)&f.b[i]->addr, f.b[i]->addrlen));
    assert_true(px_addrset_has(s, (struct sockaddr *)&v6.b[0]->addr, v6.b[0]->addrlen));
    struct sockaddr_storage other = f.b[0]->addr;
    ((struct sockaddr_in *)&other)->sin_port = htons(9999);
    assert_false(px_addrset_has(s, (struct sockaddr *)&other, f.b[0]->addrlen));
    px_addrset *r = px_addrset_ref(s);
    px_addrset_release(s);
    assert_true(px_addrset_has(r, (struct sockaddr *)&f.b[1]->addr, f.b[1]->addrlen));
    px_addrset_release(r);
    px_addrset_release(NULL);
    px_pool_cleanup(&v6);
    fixture_cleanup(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_policy_names),     cmocka_unit_test(test_url_split),
        cmocka_unit_test(test_hash_seeded),      cmocka_unit_test(test_round_robin),
        cmocka_unit_test(test_exclude),          cmocka_unit_test(test_least_inflight),
        cmocka_unit_test(test_power_of_two),     cmocka_unit_test(test_prefix_affinity),
        cmocka_unit_test(test_passive_ejection), cmocka_unit_test(test_panic_routing),
        cmocka_unit_test(test_active_checks),    cmocka_unit_test(test_passive_then_check),
        cmocka_unit_test(test_ring_incremental), cmocka_unit_test(test_ring_sealed_large),
        cmocka_unit_test(test_addrset),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
