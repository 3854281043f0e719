/* SPDX-License-Identifier: Apache-2.0 */
/* The live latency model (proxy/latency.c), its plans, and the latency
 * targets' specs and counters (proxy/slo.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "proxy/latency.h"
#include "proxy/slo.h"

#define SEC 1000000000ULL

static int near(double a, double b, double rel) {
    return fabs(a - b) <= rel * fabs(b) + 1e-12;
}

/* Samples on a line give the line back. */
static void test_fit_recovers_a_line(void **state) {
    (void)state;
    px_lat_fit f = {0};
    uint64_t t = 10 * SEC;
    for (int i = 0; i < 50; i++) {
        double x = 100 + (i * 37) % 900;
        px_lat_fit_add(&f, x, 0.01 + 2e-4 * x, t, 0.95, 30);
        t += SEC / 100;
    }
    double a, b;
    assert_true(px_lat_fit_solve(&f, 1e-4, &a, &b) > 10);
    assert_true(near(a, 0.01, 0.02));
    assert_true(near(b, 2e-4, 0.02));
}

/* Equal x say nothing about the slope: it stays at the prior, and the
 * intercept takes the rest. Negative fits are held at 0. */
static void test_fit_prior_and_bounds(void **state) {
    (void)state;
    px_lat_fit f = {0};
    double a, b;
    assert_true(px_lat_fit_solve(&f, 3e-4, &a, &b) == 0);
    assert_true(a == 0 && b == 3e-4);
    for (int i = 0; i < 20; i++)
        px_lat_fit_add(&f, 500, 0.2, SEC + (uint64_t)i, 0.95, 30);
    px_lat_fit_solve(&f, 3e-4, &a, &b);
    assert_true(near(b, 3e-4, 0.01));
    assert_true(near(a + b * 500, 0.2, 0.01));
    /* y falling with x: no negative slope. */
    px_lat_fit g = {0};
    for (int i = 0; i < 20; i++)
        px_lat_fit_add(&g, 100 + 10 * i, 1.0 - 0.001 * i, SEC, 0.95, 30);
    px_lat_fit_solve(&g, 1e-4, &a, &b);
    assert_true(b >= 0 && a >= 0);
    /* Garbage is not a sample. */
    px_lat_fit h = {0};
    px_lat_fit_add(&h, NAN, 1, SEC, 0.95, 30);
    px_lat_fit_add(&h, 1, -1, SEC, 0.95, 30);
    px_lat_fit_add(&h, INFINITY, 1, SEC, 0.95, 30);
    assert_int_equal(h.n, 0);
}

/* An engine that becomes three times slower is relearned within a few
 * dozen samples (keep 0.95), and time alone lets an idle engine's fit
 * weigh nothing (the pooled one stands in). */
static void test_model_forgets(void **state) {
    (void)state;
    px_latmodel *m = px_latmodel_create(16, 16, 0.95, 30);
    uint64_t t = 100 * SEC, key = 42;
    for (int i = 0; i < 60; i++, t += SEC / 50)
        px_lat_observe(m, key, "e", PX_LAT_PREFILL, 200 + 20 * (i % 30),
                       1e-4 * (200 + 20 * (i % 30)), t);
    assert_true(near(px_lat_predict(m, key, PX_LAT_PREFILL, 1000), 0.1, 0.1));
    for (int i = 0; i < 60; i++, t += SEC / 50)
        px_lat_observe(m, key, "e", PX_LAT_PREFILL, 200 + 20 * (i % 30),
                       3e-4 * (200 + 20 * (i % 30)), t);
    /* The pooled fit saw both speeds; the engine's own weighs 20 of 22. */
    double p = px_lat_predict(m, key, PX_LAT_PREFILL, 1000);
    assert_true(p > 0.25 && p < 0.33);
    /* Ten half-lives idle: the next sample alone counts, blended 1:2 with
     * the pooled fit. */
    t += 300 * SEC;
    px_lat_observe(m, key, "e", PX_LAT_PREFILL, 1000, 0.3, t);
    assert_true(px_lat_slope(m, key, PX_LAT_PREFILL) > 0);
    px_latmodel_destroy(m);
}

/* Unknown engines and pairs get the pooled fit (the defaults before any
 * sample); a pair's KV wait is learned per pair. */
static void test_model_pairs_and_pooled(void **state) {
    (void)state;
    px_latmodel *m = px_latmodel_create(16, 16, 0.95, 30);
    assert_true(near(px_lat_predict(m, 1, PX_LAT_PREFILL, 1000), 0.1, 1e-9)); /* 100 us/token */
    uint64_t t = SEC;
    for (int i = 0; i < 40; i++, t += SEC / 100) {
        double n = 500 + 50 * (i % 10);
        px_lat_observe_pair(m, 1, 2, "p1", "d2", n, 0.002 + n * 5e-5, t); /* slow link */
        px_lat_observe_pair(m, 1, 3, "p1", "d3", n, 0.001 + n * 1e-6, t);
    }
    double slow = px_lat_predict_pair(m, 1, 2, 1000), fast = px_lat_predict_pair(m, 1, 3, 1000);
    assert_true(slow > 0.04 && slow < 0.06);
    assert_true(fast < 0.006);
    /* An unseen pair: the pooled line, between the two. */
    double unseen = px_lat_predict_pair(m, 5, 6, 1000);
    assert_true(unseen > fast && unseen < slow);
    /* The JSON view names both pairs and their rates. */
    px_buf b;
    px_buf_init(&b);
    px_lat_render_json(m, &b);
    assert_non_null(strstr(b.data, "\"name\":\"p1\",\"decode\":\"d2\""));
    assert_non_null(strstr(b.data, "\"tokens_per_s\":"));
    px_buf_cleanup(&b);
    px_latmodel_destroy(m);
}

/* A full table takes over its stalest entries: memory stays bounded. */
static void test_model_bounded(void **state) {
    (void)state;
    px_latmodel *m = px_latmodel_create(16, 16, 0.95, 30);
    for (uint64_t k = 1; k <= 1000; k++)
        px_lat_observe(m, k * 7919, "x", PX_LAT_DECODE, 1, 0.01, k * SEC);
    px_buf b;
    px_buf_init(&b);
    px_lat_render_json(m, &b);
    assert_null(strstr(b.data, "\"engines\":0"));
    assert_non_null(strstr(b.data, "\"taken_over\":{\"engines\":"));
    assert_null(strstr(b.data, "\"taken_over\":{\"engines\":0,"));
    px_buf_cleanup(&b);
    /* The newest is known exactly. */
    assert_true(near(px_lat_predict(m, 1000 * 7919, PX_LAT_DECODE, 1), 0.01, 0.01));
    px_latmodel_destroy(m);
}

/* Teaches the model: prefills 1 (fast, 100 us/token) and 2 (slow, 300),
 * decodes 11 and 12 (10 ms to first token), the link 1->11 slow. */
static px_latmodel *taught(void) {
    px_latmodel *m = px_latmodel_create(64, 64, 0.95, 30);
    uint64_t t = SEC;
    for (int i = 0; i < 40; i++, t += SEC / 100) {
        double x = 200 + 100 * (i % 10);
        px_lat_observe(m, 1, "p1", PX_LAT_PREFILL, x, 0.005 + 1e-4 * x, t);
        px_lat_observe(m, 2, "p2", PX_LAT_PREFILL, x, 0.005 + 3e-4 * x, t);
        px_lat_observe(m, 11, "d11", PX_LAT_DECODE, x / 10, 0.01, t);
        px_lat_observe(m, 12, "d12", PX_LAT_DECODE, x / 10, 0.01, t);
        px_lat_observe(m, 11, "d11", PX_LAT_LOCAL, x, 0.01 + 2e-4 * x, t);
        px_lat_observe(m, 12, "d12", PX_LAT_LOCAL, x, 0.01 + 2e-4 * x, t);
        px_lat_observe(m, 11, "d11", PX_LAT_TPOT, i % 5, 0.02, t);
        px_lat_observe(m, 12, "d12", PX_LAT_TPOT, i % 5, 0.05, t);
        for (uint64_t p = 1; p <= 2; p++)
            for (uint64_t d = 11; d <= 12; d++)
                px_lat_observe_pair(m, p, d, "p", "d", x,
                                    p == 1 && d == 11 ? 0.2 + 1e-4 * x : 0.001 + 1e-6 * x, t);
    }
    return m;
}

static void test_plan_picks_fast_pair(void **state) {
    (void)state;
    px_latmodel *m = taught();
    px_lat_cand P[] = {{.key = 1}, {.key = 2}}, D[] = {{.key = 11}, {.key = 12}};
    px_lat_plan pl;
    px_lat_plan_make(m, P, 2, D, 2, 1000, 0, &pl);
    assert_true(pl.ok);
    /* The fast prefill, and not its slow link. */
    assert_int_equal(pl.pkey, 1);
    assert_int_equal(pl.dkey, 12);
    assert_true(near(pl.ttft, pl.pre + pl.kv + pl.dec, 1e-9));
    assert_true(near(pl.pre, 0.105, 0.05));
    assert_true(pl.wait < 1e-3);
    /* The fast prefill has 3000 tokens queued: the slow one is sooner. */
    P[0].tokens = 3000;
    px_lat_plan_make(m, P, 2, D, 2, 1000, 0, &pl);
    assert_int_equal(pl.pkey, 2);
    /* ... unless it holds most of the prompt in its cache. */
    P[0].tokens = 1000;
    P[0].cached = 900;
    px_lat_plan_make(m, P, 2, D, 2, 1000, 0, &pl);
    assert_int_equal(pl.pkey, 1);
    assert_true(pl.p_x == 1100);
    /* A TPOT target of 30 ms leaves decode 11 alone (d12: 50 ms). */
    P[0] = (px_lat_cand){.key = 1};
    px_lat_plan_make(m, P, 2, D, 2, 1000, 0.03, &pl);
    assert_int_equal(pl.dkey, 11);
    assert_int_equal(pl.pkey, 2);
    /* A target nobody meets is no filter. */
    px_lat_plan_make(m, P, 2, D, 2, 1000, 0.001, &pl);
    assert_true(pl.ok && pl.dkey == 12);
    px_latmodel_destroy(m);
}

/* Decode alone is the faster choice for a short prompt, or when every
 * prefill is busy; not for a long one on idle prefills. */
static void test_plan_decode_only_by_prediction(void **state) {
    (void)state;
    px_latmodel *m = taught();
    px_lat_cand P[] = {{.key = 1}, {.key = 2}}, D[] = {{.key = 11}, {.key = 12}};
    px_lat_plan pl;
    px_lat_plan_make(m, P, 2, D, 2, 2000, 0, &pl);
    assert_true(pl.local_ok && pl.ok);
    assert_true(pl.local > pl.ttft);
    P[0].tokens = P[1].tokens = 20000;
    px_lat_plan_make(m, P, 2, D, 2, 2000, 0, &pl);
    assert_true(pl.local < pl.ttft);
    assert_true(pl.local_wait == 0);
    /* No prefill at all: decode alone is the only plan. */
    px_lat_plan_make(m, P, 0, D, 2, 2000, 0, &pl);
    assert_false(pl.ok);
    assert_true(pl.local_ok);
    px_latmodel_destroy(m);
}

/* An engine never tried is tried: with only the slow prefill known, the
 * pooled stand-in for the unknown one is that same speed, and the
 * exploration bonus tips the choice to it. */
static void test_plan_explores(void **state) {
    (void)state;
    px_latmodel *m = px_latmodel_create(16, 16, 0.95, 30);
    for (int i = 0; i < 10; i++)
        px_lat_observe(m, 2, "p2", PX_LAT_PREFILL, 100 + 100 * i, 3e-4 * (100 + 100 * i), SEC);
    px_lat_cand P[] = {{.key = 2}, {.key = 99}}, D[] = {{.key = 11}};
    px_lat_plan pl;
    px_lat_plan_make(m, P, 2, D, 1, 1000, 0, &pl);
    assert_int_equal(pl.pkey, 99);
    /* Its prediction is the plain one: the bonus only orders. */
    assert_true(near(pl.pre, px_lat_predict(m, 99, PX_LAT_PREFILL, 1000), 1e-9));
    assert_true(pl.score < pl.ttft);
    px_latmodel_destroy(m);
}

static void test_errors(void **state) {
    (void)state;
    px_latmodel *m = px_latmodel_create(16, 16, 0.95, 30);
    assert_true(px_lat_error_median(m) < 0);
    px_lat_error(m, 1.1, 1.0); /* 10 % */
    px_lat_error(m, 0.9, 1.0); /* 10 % */
    px_lat_error(m, 3.0, 1.0); /* 200 % */
    assert_true(near(px_lat_error_median(m), 0.125, 1e-9));
    px_buf b;
    px_buf_init(&b);
    px_lat_render_metrics(m, &b);
    assert_non_null(strstr(b.data, "pdproxy_latency_model_ttft_error_count 3\n"));
    assert_non_null(strstr(b.data, "pdproxy_latency_model_ttft_error_bucket{le=\"0.15\"} 2\n"));
    px_buf_cleanup(&b);
    px_latmodel_destroy(m);
}

/* Workers observe and predict at once; readers never see a line that is
 * not one a writer published (every sample here is on y = 2x, so every
 * published line predicts 2x). */
typedef struct {
    px_latmodel *m;
    int writer;
    int bad;
} thr_arg;

static void *thr(void *p) {
    thr_arg *a = p;
    for (int i = 0; i < 20000; i++) {
        double x = 1 + i % 100;
        if (a->writer)
            px_lat_observe(a->m, 1 + (uint64_t)(i % 3), "e", PX_LAT_PREFILL, x, 2 * x,
                           SEC + (uint64_t)i);
        else if (!near(px_lat_predict(a->m, 1 + (uint64_t)(i % 3), PX_LAT_PREFILL, 50), 100, 0.02))
            a->bad++;
    }
    return NULL;
}

static void test_concurrent(void **state) {
    (void)state;
    px_latmodel *m = px_latmodel_create(16, 16, 0.95, 30);
    for (uint64_t k = 1; k <= 3; k++)
        for (int i = 0; i < 10; i++)
            px_lat_observe(m, k, "e", PX_LAT_PREFILL, 1 + i, 2.0 * (1 + i), SEC);
    pthread_t t[4];
    thr_arg a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (thr_arg){m, i < 2, 0};
        pthread_create(&t[i], NULL, thr, &a[i]);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    assert_int_equal(a[2].bad + a[3].bad, 0);
    px_latmodel_destroy(m);
}

/* ---------- slo.c ---------- */

static void test_slo_specs(void **state) {
    (void)state;
    char err[512];
    char *good[] = {"class=interactive:ttft=500:tpot=50:miss=refuse",
                    "tenant=acme:ttft=2000:miss=queue:status=429", "pool=*:ttft=1000",
                    "pool=:tpot=80"};
    px_slo_map m;
    if (px_slo_map_parse(good, 4, &m, err, sizeof err)) fail_msg("%s", err);
    assert_int_equal(m.n, 4);
    const px_slo_target *t = px_slo_find(&m, 'c', "interactive", 11);
    assert_non_null(t);
    assert_true(t->ttft_ms == 500 && t->tpot_ms == 50 && t->miss == PX_SLO_REFUSE);
    assert_non_null(px_slo_find(&m, 'p', "", 0));
    const char *bad[] = {"interactive:ttft=5", "class=x",
                         "class=x:ttft=0",     "class=x:ttft=abc",
                         "class=x:miss=maybe", "class=x:status=500",
                         "who=x:ttft=5",       "class=:ttft=5",
                         "class=x:ttft=5:"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(px_slo_spec_check(bad[i], err, sizeof err), -1);
        assert_non_null(strstr(err, "--slo"));
    }
    /* Precedence: what is set first stays; the rest is filled. */
    px_slo_target r = {.ttft_ms = 300, .set = PX_SLO_HAS_TTFT};
    px_slo_merge(&r, px_slo_find(&m, 't', "acme", 4));
    px_slo_merge(&r, px_slo_find(&m, 'c', "interactive", 11));
    assert_true(r.ttft_ms == 300 && r.miss == PX_SLO_QUEUE && r.status == 429 && r.tpot_ms == 50);
}

static void test_slo_publish_and_count(void **state) {
    (void)state;
    px_slo *s = px_slo_create();
    assert_int_equal(px_slo_current(s)->n, 0);
    char err[256];
    char *one[] = {"pool=*:ttft=100"}, *bad[] = {"pool"};
    assert_int_equal(px_slo_publish(s, one, 1, err, sizeof err), 0);
    assert_int_equal(px_slo_publish(s, bad, 1, err, sizeof err), -1);
    assert_int_equal(px_slo_current(s)->n, 1); /* the bad one changed nothing */
    px_slo_count(s, "llama", 0, "interactive", PX_SLO_MET);
    px_slo_count(s, "llama", 0, "interactive", PX_SLO_MET);
    px_slo_count(s, "llama", 3, NULL, PX_SLO_REFUSED);
    px_slo_count(s, "", 0, "0", PX_SLO_MISSED);
    px_buf b;
    px_buf_init(&b);
    px_slo_render_metrics(s, &b);
    assert_non_null(strstr(
        b.data,
        "pdproxy_slo_attained_total{pool=\"llama\",class=\"interactive\",result=\"met\"} 2\n"));
    assert_non_null(strstr(
        b.data, "pdproxy_slo_attained_total{pool=\"llama\",class=\"3\",result=\"refused\"} 1\n"));
    assert_non_null(
        strstr(b.data, "pdproxy_slo_attained_total{pool=\"\",class=\"0\",result=\"missed\"} 1\n"));
    px_buf_reset(&b);
    px_slo_render_json(s, &b);
    assert_string_equal(b.data,
                        "{\"specs\":[{\"kind\":\"pool\",\"name\":\"*\",\"ttft_ms\":100.000}]}");
    px_buf_cleanup(&b);
    px_slo_destroy(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fit_recovers_a_line),
        cmocka_unit_test(test_fit_prior_and_bounds),
        cmocka_unit_test(test_model_forgets),
        cmocka_unit_test(test_model_pairs_and_pooled),
        cmocka_unit_test(test_model_bounded),
        cmocka_unit_test(test_plan_picks_fast_pair),
        cmocka_unit_test(test_plan_decode_only_by_prediction),
        cmocka_unit_test(test_plan_explores),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_concurrent),
        cmocka_unit_test(test_slo_specs),
        cmocka_unit_test(test_slo_publish_and_count),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
