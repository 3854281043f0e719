/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proxy/ratelimit.h"

#define SEC 1000000000ULL

/* A bucket of 60 per minute: 60 at once, then one a second. */
static void test_bucket_burst_and_refill(void **state)
{
    (void)state;
    px_bucket b;
    px_bucket_init(&b, 60);
    uint64_t t = 1000 * SEC, retry = 0;
    assert_int_equal(px_bucket_remaining(&b, t), 60);
    for (int i = 0; i < 60; i++)
        assert_true(px_bucket_take(&b, t, 1, NULL));
    assert_int_equal(px_bucket_remaining(&b, t), 0);
    assert_false(px_bucket_take(&b, t, 1, &retry));
    assert_int_equal(retry, SEC);
    assert_int_equal(px_bucket_reset_ns(&b, t), 60 * SEC);
    /* Half a second later: still nothing; a second later: one. */
    assert_false(px_bucket_take(&b, t + SEC / 2, 1, &retry));
    assert_int_equal(retry, SEC / 2);
    assert_true(px_bucket_take(&b, t + SEC, 1, NULL));
    assert_false(px_bucket_take(&b, t + SEC, 1, NULL));
    /* A minute idle refills it whole, never beyond. */
    assert_int_equal(px_bucket_remaining(&b, t + 1000 * SEC), 60);
}

/* Unlimited buckets take everything; charges may put a bucket in debt. */
static void test_bucket_unlimited_and_debt(void **state)
{
    (void)state;
    px_bucket b;
    px_bucket_init(&b, 0);
    assert_true(px_bucket_take(&b, 0, 1000000, NULL));
    px_bucket_init(&b, 600); /* 10 a second */
    uint64_t t = 5 * SEC;
    px_bucket_charge(&b, t, 1200); /* two minutes' worth */
    assert_int_equal(px_bucket_remaining(&b, t), 0);
    assert_false(px_bucket_take(&b, t + 59 * SEC, 1, NULL));
    assert_true(px_bucket_take(&b, t + 61 * SEC, 1, NULL));
}

/* Threads taking at once never take more than the bucket holds. */
typedef struct {
    px_bucket *b;
    int got;
} taker;

static void *take_many(void *arg)
{
    taker *k = arg;
    for (int i = 0; i < 5000; i++)
        k->got += px_bucket_take(k->b, 42 * SEC, 1, NULL);
    return NULL;
}

static void test_bucket_threads(void **state)
{
    (void)state;
    px_bucket b;
    px_bucket_init(&b, 1000);
    pthread_t th[4];
    taker k[4];
    for (int i = 0; i < 4; i++) {
        k[i] = (taker){&b, 0};
        assert_int_equal(pthread_create(&th[i], NULL, take_many, &k[i]), 0);
    }
    int total = 0;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        total += k[i].got;
    }
    assert_int_equal(total, 1000);
}

/* A reload's new limit (px_bucket_set): what was taken stays taken, the
 * new rate refills from then on; 0 lifts the limit, a limit again counts
 * from the bucket's state. */
static void test_bucket_set_in_use(void **state) {
    (void)state;
    uint64_t t = 1000 * SEC;
    px_bucket b;
    px_bucket_init(&b, 2);
    assert_true(px_bucket_take(&b, t, 1, NULL));
    assert_true(px_bucket_take(&b, t, 1, NULL));
    assert_false(px_bucket_take(&b, t, 1, NULL));
    px_bucket_set(&b, 4); /* 60 s of credit taken at 30 s each is 60 s: none left at 4/min */
    assert_int_equal(b.limit, 4);
    assert_int_equal(px_bucket_remaining(&b, t), 0);
    assert_true(px_bucket_take(&b, t + 15 * SEC, 1, NULL)); /* refills at 4 a minute now */
    px_bucket_set(&b, 0);
    assert_true(px_bucket_take(&b, t, 1000000, NULL));
    assert_int_equal(px_bucket_remaining(&b, t), 0);
    px_bucket_set(&b, 600);
    assert_int_equal(px_bucket_remaining(&b, t + 120 * SEC), 600);
}

static void test_tenants_parse(void **state)
{
    (void)state;
    char *specs[] = {"alice:weight=3:rpm=2", "bob:tpm=100", "carol"};
    px_tenants t;
    char err[256];
    assert_int_equal(px_tenants_parse(specs, 3, &t, err, sizeof err), 0);
    assert_int_equal(t.n, 3);
    assert_int_equal(px_tenants_find(&t, "bob", 3), 1);
    assert_int_equal(px_tenants_find(&t, "bo", 2), 3);
    assert_int_equal(px_tenants_find(&t, NULL, 0), 3);
    assert_int_equal(t.v[0].weight, 3);
    assert_int_equal(t.v[0].rpm.limit, 2);
    assert_int_equal(t.v[1].tpm.limit, 100);
    assert_int_equal(t.v[3].weight, 1);

    uint64_t now = 7 * SEC, retry = 0;
    assert_int_equal(px_tenant_admit(&t.v[0], now, 0, &retry), PX_RL_OK);
    assert_int_equal(px_tenant_admit(&t.v[0], now, 0, &retry), PX_RL_OK);
    assert_int_equal(px_tenant_admit(&t.v[0], now, 0, &retry), PX_RL_REQUESTS);
    assert_int_equal(retry, 30 * SEC);
    char h[512] = "";
    px_tenant_headers(&t.v[0], now, h, sizeof h);
    assert_non_null(strstr(h, "x-ratelimit-limit-requests: 2\r\n"));
    assert_non_null(strstr(h, "x-ratelimit-remaining-requests: 0\r\n"));
    assert_non_null(strstr(h, "x-ratelimit-reset-requests: 1m0s\r\n"));
    assert_null(strstr(h, "tokens"));

    /* Tokens: admitted until the answers' usage spends the minute. */
    assert_int_equal(px_tenant_admit(&t.v[1], now, 0, &retry), PX_RL_OK);
    px_bucket_charge(&t.v[1].tpm, now, 150);
    assert_int_equal(px_tenant_admit(&t.v[1], now, 0, &retry), PX_RL_TOKENS);
    assert_true(retry > 30 * SEC && retry <= 31 * SEC);
    h[0] = 0;
    px_tenant_headers(&t.v[1], now, h, sizeof h);
    assert_non_null(strstr(h, "x-ratelimit-limit-tokens: 100\r\n"));
    assert_non_null(strstr(h, "x-ratelimit-remaining-tokens: 0\r\n"));
    px_tenants_cleanup(&t);
}

/* The x-ratelimit-* lines byte for byte (reset as ms below a second, s
 * with three digits below a minute, m and s above), after what is already
 * in the buffer; a buffer too small for a tenant's next group of lines
 * gets none of that group, never half. */
static void test_tenant_headers_exact(void **state)
{
    (void)state;
    char *specs[] = {"a:rpm=120:tpm=100000", "b:rpm=2"};
    px_tenants t;
    char err[256];
    assert_int_equal(px_tenants_parse(specs, 2, &t, err, sizeof err), 0);
    uint64_t now = 7 * SEC, retry = 0;
    assert_int_equal(px_tenant_admit(&t.v[0], now, 0, &retry), PX_RL_OK);
    px_bucket_charge(&t.v[0].tpm, now, 2500);
    const char *want = "x: y\r\n"
                       "x-ratelimit-limit-requests: 120\r\nx-ratelimit-remaining-requests: 119\r\n"
                       "x-ratelimit-reset-requests: 500ms\r\n"
                       "x-ratelimit-limit-tokens: 100000\r\nx-ratelimit-remaining-tokens: 97500\r\n"
                       "x-ratelimit-reset-tokens: 1.5s\r\n";
    char h[512] = "x: y\r\n";
    px_tenant_headers(&t.v[0], now, h, sizeof h);
    assert_string_equal(h, want);
    size_t group1 = strstr(want, "x-ratelimit-limit-tokens") - want;
    for (size_t cap = 7; cap <= strlen(want) + 1; cap++) {
        char c[512] = "x: y\r\n";
        px_tenant_headers(&t.v[0], now, c, cap);
        size_t got = strlen(c);
        assert_true(got < cap);
        size_t expect = cap > strlen(want) ? strlen(want) : cap > group1 ? group1 : 6;
        if (got != expect || memcmp(c, want, got) != 0)
            fail_msg("cap %zu: %zu bytes \"%s\"", cap, got, c);
    }
    assert_int_equal(px_tenant_admit(&t.v[1], now, 0, &retry), PX_RL_OK);
    assert_int_equal(px_tenant_admit(&t.v[1], now, 0, &retry), PX_RL_OK);
    h[0] = 0;
    px_tenant_headers(&t.v[1], now + 15 * SEC, h, sizeof h);
    assert_string_equal(h, "x-ratelimit-limit-requests: 2\r\nx-ratelimit-remaining-requests: 0\r\n"
                           "x-ratelimit-reset-requests: 45s\r\n");
    px_tenants_cleanup(&t);
}

static void test_tenants_parse_errors(void **state)
{
    (void)state;
    const char *bad[] = {"", ":rpm=1", "a:rpm=x", "a:weight=0", "a:burst=3", "a:rpm=-1"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char *v[] = {(char *)bad[i]};
        px_tenants t = {0};
        char err[256] = "";
        assert_int_equal(px_tenants_parse(v, 1, &t, err, sizeof err), -1);
        assert_non_null(strstr(err, "--tenant"));
        assert_null(t.v);
    }
    char *dup[] = {"a", "a:rpm=3"};
    px_tenants t = {0};
    char err[256] = "";
    assert_int_equal(px_tenants_parse(dup, 2, &t, err, sizeof err), -1);
    assert_non_null(strstr(err, "twice"));
}

static void parse_into(px_tenants *t, char **specs, size_t n)
{
    char err[256] = "";
    assert_int_equal(px_tenants_parse(specs, n, t, err, sizeof err), 0);
}

/* Tenants added, changed, removed and revived at run time: indexes stay,
 * a removed name finds the default, a full table changes nothing. */
static void test_tenants_apply(void **state)
{
    (void)state;
    px_tenants t, nt;
    char *start[] = {"a:weight=2:rpm=5", "b"};
    parse_into(&t, start, 2);
    px_tenants_reserve(&t, 4);
    assert_int_equal(t.cap, 4);
    assert_int_equal(px_tenants_find(&t, "zz", 2), 4);
    assert_int_equal(px_tenants_find(&t, "b", 1), 1);
    assert_string_equal(t.v[4].name, "");
    uint32_t w[5] = {2, 1, 1, 1, 1};
    char err[256] = "";
    size_t added = 9, removed = 9;

    /* b removed, c added, a changed. */
    char *next[] = {"c:weight=4:rpm=1", "a:weight=3"};
    parse_into(&nt, next, 2);
    assert_int_equal(px_tenants_apply(&t, &nt, w, &added, &removed, err, sizeof err), 0);
    px_tenants_cleanup(&nt);
    assert_int_equal(added, 1);
    assert_int_equal(removed, 1);
    assert_int_equal(t.n, 3);
    assert_int_equal(px_tenants_find(&t, "a", 1), 0);
    assert_int_equal(px_tenants_find(&t, "b", 1), 4); /* the default now */
    assert_int_equal(px_tenants_find(&t, "c", 1), 2);
    assert_int_equal(w[0], 3);
    assert_int_equal(t.v[0].rpm.limit, 0);
    assert_int_equal(w[1], 1);             /* b's queued requests: weight 1 */
    assert_int_equal(t.v[1].rpm.limit, 0); /* and no limits */
    assert_int_equal(w[2], 4);
    assert_int_equal(t.v[2].rpm.limit, 1);
    uint64_t retry;
    assert_int_equal(px_tenant_admit(&t.v[2], SEC, 0, &retry), PX_RL_OK);
    assert_int_equal(px_tenant_admit(&t.v[2], SEC, 0, &retry), PX_RL_REQUESTS);

    /* b comes back into its old slot; d and e need two slots, one is left. */
    char *full[] = {"a", "b:weight=5", "c", "d", "e"};
    parse_into(&nt, full, 5);
    assert_int_equal(px_tenants_apply(&t, &nt, w, &added, &removed, err, sizeof err), -1);
    assert_non_null(strstr(err, "2 new tenants do not fit"));
    assert_int_equal(t.n, 3);
    assert_int_equal(px_tenants_find(&t, "b", 1), 4);
    px_tenants_cleanup(&nt);
    char *back[] = {"a", "b:weight=5", "c", "d"};
    parse_into(&nt, back, 4);
    assert_int_equal(px_tenants_apply(&t, &nt, w, &added, &removed, err, sizeof err), 0);
    px_tenants_cleanup(&nt);
    assert_int_equal(added, 2);
    assert_int_equal(removed, 0);
    assert_int_equal(px_tenants_find(&t, "b", 1), 1);
    assert_int_equal(w[1], 5);
    assert_int_equal(px_tenants_find(&t, "d", 1), 3);
    /* c without its limit now: admitted. */
    assert_int_equal(px_tenant_admit(&t.v[2], SEC, 0, &retry), PX_RL_OK);
    px_tenants_cleanup(&t);
}

typedef struct {
    px_tenants *t;
    atomic_int stop;
    int bad;
} finder;

static void *find_loop(void *arg)
{
    finder *f = arg;
    char name[16];
    while (!atomic_load(&f->stop))
        for (int i = 0; i < 64; i++) {
            int len = snprintf(name, sizeof name, "t%d", i);
            size_t k = px_tenants_find(f->t, name, (size_t)len);
            if (k != f->t->cap && strcmp(f->t->v[k].name, name)) f->bad = 1;
        }
    return NULL;
}

/* Lookups on another thread while tenants are added: a published slot is
 * whole (its name matches), never half made. */
static void test_tenants_apply_while_found(void **state)
{
    (void)state;
    px_tenants t;
    parse_into(&t, NULL, 0);
    px_tenants_reserve(&t, 64);
    uint32_t w[65];
    finder f = {.t = &t};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, find_loop, &f), 0);
    char *specs[64];
    char buf[64][16];
    for (int i = 0; i < 64; i++) {
        snprintf(buf[i], sizeof buf[i], "t%d", i);
        specs[i] = buf[i];
        px_tenants nt;
        parse_into(&nt, specs, (size_t)i + 1);
        char err[256];
        assert_int_equal(px_tenants_apply(&t, &nt, w, NULL, NULL, err, sizeof err), 0);
        px_tenants_cleanup(&nt);
    }
    atomic_store(&f.stop, 1);
    pthread_join(th, NULL);
    assert_int_equal(f.bad, 0);
    assert_int_equal(px_tenants_find(&t, "t63", 3), 63);
    px_tenants_cleanup(&t);
}

/* total_tokens found whole, split at every byte, in SSE; the last wins. */
static void test_tokscan(void **state)
{
    (void)state;
    const char *doc = "{\"id\":\"x\",\"usage\":{\"prompt_tokens\":12,\"total_tokens\" : 1234,"
                      "\"completion_tokens\":1222}}";
    size_t n = strlen(doc);
    for (size_t step = 1; step <= n; step++) {
        px_tokscan s = {0};
        for (size_t at = 0; at < n; at += step)
            px_tokscan_feed(&s, doc + at, n - at < step ? n - at : step);
        assert_int_equal(s.total, 1234);
    }
    px_tokscan s = {0};
    const char *sse = "data: {\"choices\":[{\"text\":\"total_tokens\"}],\"usage\":null}\n\n"
                      "data: {\"usage\":{\"total_tokens\":7}}\n\ndata: [DONE]\n\n";
    px_tokscan_feed(&s, sse, strlen(sse));
    assert_int_equal(s.total, 7);
    px_tokscan none = {0};
    px_tokscan_feed(&none, "{\"total_tokens\":null}", 21);
    assert_int_equal(none.total, 0);
}

/* Issue 41: tpm= reserves a request's most tokens at admission and
 * settles on its real usage, so concurrent requests cannot each pass
 * while the bucket is not empty; a request that can never fit is told so. */
static void test_reserve_and_settle(void **state)
{
    (void)state;
    char *specs[] = {"t:tpm=30"};
    px_tenants t;
    parse_into(&t, specs, 1);
    uint64_t now = 5 * SEC, retry = 0;
    /* Four requests of max 8 tokens at once: three fit in 30, not four. */
    for (int i = 0; i < 3; i++)
        assert_int_equal(px_tenant_admit(&t.v[0], now, 8, &retry), PX_RL_OK);
    assert_int_equal(px_tenant_admit(&t.v[0], now, 8, &retry), PX_RL_TOKENS);
    assert_true(retry > 0);
    /* One used 2 of its 8: 6 come back, and the fourth fits. */
    px_tenant_settle(&t.v[0], now, 8, 2);
    assert_int_equal(px_tenant_admit(&t.v[0], now, 8, &retry), PX_RL_OK);
    /* Refunds never fill the bucket past full. */
    px_tenant_settle(&t.v[0], now, 1000, 0);
    assert_int_equal(px_bucket_remaining(&t.v[0].tpm, now), 30);
    /* More than a minute's worth: never admitted, and said so. */
    assert_int_equal(px_tenant_admit(&t.v[0], now, 31, &retry), PX_RL_TOO_LARGE);
    /* A refused request takes no request from rpm either (both or none). */
    px_bucket_set(&t.v[0].rpm, 1);
    assert_int_equal(px_tenant_admit(&t.v[0], now, 30, &retry), PX_RL_OK);
    assert_int_equal(px_tenant_admit(&t.v[0], now, 30, &retry), PX_RL_TOKENS);
    px_tenants_cleanup(&t);
}

/* A spec named "default" sets the default tenant's limits: unknown callers
 * are limited too. */
static void test_default_tenant_spec(void **state)
{
    (void)state;
    char *specs[] = {"a:rpm=5", "default:weight=2:rpm=1"};
    px_tenants t;
    parse_into(&t, specs, 2);
    assert_int_equal(t.n, 1);
    size_t d = px_tenants_default(&t);
    assert_int_equal(px_tenants_find(&t, "default", 7), d);
    assert_int_equal(px_tenants_find(&t, "A", 1), d);
    assert_int_equal(t.v[d].rpm.limit, 1);
    assert_int_equal(t.v[d].weight, 2);
    uint64_t retry;
    assert_int_equal(px_tenant_admit(&t.v[d], SEC, 0, &retry), PX_RL_OK);
    assert_int_equal(px_tenant_admit(&t.v[d], SEC, 0, &retry), PX_RL_REQUESTS);
    char *twice[] = {"default:rpm=1", "default:rpm=2"};
    px_tenants u = {0};
    char err[256] = "";
    assert_int_equal(px_tenants_parse(twice, 2, &u, err, sizeof err), -1);
    /* A reload changes it, and a removed tenant gets no limits, not the
     * default's. */
    px_tenants_reserve(&t, 4);
    uint32_t w[5] = {1, 1, 1, 1, 2};
    char *next[] = {"default:rpm=7"};
    px_tenants nt;
    parse_into(&nt, next, 1);
    size_t added, removed;
    assert_int_equal(px_tenants_apply(&t, &nt, w, &added, &removed, err, sizeof err), 0);
    px_tenants_cleanup(&nt);
    assert_int_equal(t.v[4].rpm.limit, 7);
    assert_int_equal(w[4], 1);
    assert_int_equal(t.v[0].rpm.limit, 0);
    px_tenants_cleanup(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bucket_burst_and_refill),
        cmocka_unit_test(test_bucket_unlimited_and_debt),
        cmocka_unit_test(test_bucket_threads),
        cmocka_unit_test(test_bucket_set_in_use),
        cmocka_unit_test(test_tenants_parse),
        cmocka_unit_test(test_tenants_parse_errors),
        cmocka_unit_test(test_tenant_headers_exact),
        cmocka_unit_test(test_tenants_apply),
        cmocka_unit_test(test_tenants_apply_while_found),
        cmocka_unit_test(test_tokscan),
        cmocka_unit_test(test_reserve_and_settle),
        cmocka_unit_test(test_default_tenant_spec),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
