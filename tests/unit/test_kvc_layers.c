/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests of layer-wise publishing (KVC_PUBLISH_FIELD_LAYERWISE,
 * kvc_publish_ready): a producer and a consumer in this process, progressed
 * alternately, moving real blocks over UCX on loopback.
 *
 *  - a push fetch moves each region (layer) as it is marked ready, in order
 *    and out of order, byte-exact per region, while the other region is not
 *    written yet (its local blocks keep their canary), and ends only when
 *    every region is ready and moved;
 *  - a fetch that starts before the first region, or before the
 *    publication itself (a registration), waits and then completes;
 *  - one-sided reads wait for the whole publication (their HOLD is held);
 *  - a publication that expires or is unpublished half-written fails the
 *    waiting fetch (KVC_ERR_TIMED_OUT, KVC_ERR_DENIED) and hands its blocks
 *    back; a producer that dies halfway fails it (nothing leaks: ASan);
 *  - kvc_publish_ready's checks.
 * Loops are bounded in time and count. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "connector/kvc_int.h"

#define KVC_FIXTURE_SECRET "unit-layers-secret"
#include "tests/unit/kvc_fixture.h"

#define NB 3

static const uint64_t ids[NB] = {2, 5, 6}, lids[NB] = {9, 1, 2};

/* Region r of every fetched block equals the producer's. */
static bool region_landed(side_t *P, side_t *D, int r) {
    for (int i = 0; i < NB; i++)
        if (memcmp(block(P, r, ids[i]), block(D, r, lids[i]), P->bl)) return false;
    return true;
}

/* Region r of every local block still holds the canary c. */
static bool region_canary(side_t *D, int r, uint8_t c) {
    for (int i = 0; i < NB; i++)
        for (size_t k = 0; k < D->bl; k++)
            if (block(D, r, lids[i])[k] != c) return false;
    return true;
}

typedef struct {
    side_t P, D;
    char pn[32], dn[32]; /* the agents' names (their log argument) */
    char tok[33];
    const char *json;
} pair_t;

static void pair_init(pair_t *t, const char *name, bool pool, uint32_t pending_ms) {
    snprintf(t->pn, sizeof t->pn, "%s-P", name);
    snprintf(t->dn, sizeof t->dn, "%s-D", name);
    const char *tls = pool ? "sm,tcp,self" : NULL;
    side_init(&t->P, &(opts_t){.name = t->pn, .nb = 16, .bl = 8192, .pool = pool, .tls = tls,
                               .pending_ms = pending_ms});
    side_init(&t->D, &(opts_t){.name = t->dn, .nb = 16, .bl = 8192, .tls = tls});
    assert_int_equal(kvc_token_new(t->tok), KVC_OK);
    for (int i = 0; i < NB; i++)
        fill(&t->P, ids[i], 3);
    canary(&t->D, 0xa5);
    static char json[4096];
    snprintf(json, sizeof json, "%s", params_json(t->pn, port_of(&t->P), name, ids, NB, t->tok));
    t->json = json;
}

static void pair_cleanup(pair_t *t) {
    side_cleanup(&t->D);
    side_cleanup(&t->P);
}

static void publish_layers(pair_t *t, const char *id, uint32_t expiry_ms) {
    kvc_publish_params_t pp = {.field_mask = KVC_PUBLISH_FIELD_TOKEN | KVC_PUBLISH_FIELD_LAYERWISE,
                               .kv_token = t->tok};
    if (expiry_ms) {
        pp.field_mask |= KVC_PUBLISH_FIELD_EXPIRY;
        pp.expiry_ms = expiry_ms;
    }
    char *json = NULL;
    assert_int_equal(kvc_publish(t->P.a, id, ids, NB, &pp, &json), KVC_OK);
    kvc_free(json);
}

static void ready(pair_t *t, const char *id, size_t r) {
    assert_int_equal(kvc_publish_ready(t->P.a, id, r, 1, NULL), KVC_OK);
}

/* Fetch first, then the regions in `order`: each lands alone, the fetch
 * ends with the last. */
static void layers_push(const char *name, const int order[NREG], int ready_before) {
    pair_t t;
    pair_init(&t, name, false, 0);
    publish_layers(&t, name, 0);
    for (int i = 0; i < ready_before; i++)
        ready(&t, name, (size_t)order[i]);
    uint64_t x = fetch_p(&t.D, t.json, lids, NB, 0, NULL);
    /* The pull reached the producer and waits for the rest. */
    PUMP_UNTIL(&t.P, &t.D, t.P.a->defers != NULL, 20000);
    for (int i = 0; i < NREG; i++) {
        if (i >= ready_before) ready(&t, name, (size_t)order[i]);
        if (i == NREG - 1) break;
        /* This region lands while the next one is not written: no event. */
        PUMP_UNTIL(&t.P, &t.D, region_landed(&t.P, &t.D, order[i]), 20000);
        assert_true(region_canary(&t.D, order[i + 1], 0xa5));
        assert_null(fetch_ev(&t.D, x));
    }
    PUMP_UNTIL(&t.P, &t.D, fetch_ev(&t.D, x), 20000);
    assert_int_equal(fetch_ev(&t.D, x)->st, KVC_OK);
    for (int r = 0; r < NREG; r++)
        assert_true(region_landed(&t.P, &t.D, r));
    PUMP_UNTIL(&t.P, &t.D, find_ev(&t.P, KVC_EV_RELEASED, name), 20000);
    assert_null(t.P.a->defers);
    assert_int_equal(stat(&t.P, KVC_STAT_PUBLISHED_NOW), 0);
    pair_cleanup(&t);
}

static void test_layers_in_order(void **state) {
    (void)state;
    layers_push("lw-in", (const int[NREG]){0, 1}, 0);
}

static void test_layers_out_of_order(void **state) {
    (void)state;
    layers_push("lw-out", (const int[NREG]){1, 0}, 0);
}

/* One region ready before the pull comes: it goes at once. */
static void test_layers_some_ready_first(void **state) {
    (void)state;
    layers_push("lw-some", (const int[NREG]){1, 0}, 1);
}

/* A registration (fetch before the publication), then the layers. */
static void test_layers_before_publish(void **state) {
    (void)state;
    pair_t t;
    pair_init(&t, "lw-reg", false, 0);
    kvc_fetch_params_t w = {.wait_ms = 20000};
    uint64_t x = fetch_p(&t.D, t.json, lids, NB, KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&t.P, &t.D, stat(&t.P, KVC_STAT_PENDING_FETCHES) == 1, 20000);
    publish_layers(&t, "lw-reg", 0);
    PUMP_UNTIL(&t.P, &t.D, t.P.a->defers != NULL, 20000);
    ready(&t, "lw-reg", 0);
    PUMP_UNTIL(&t.P, &t.D, region_landed(&t.P, &t.D, 0), 20000);
    assert_true(region_canary(&t.D, 1, 0xa5));
    ready(&t, "lw-reg", 1);
    PUMP_UNTIL(&t.P, &t.D, fetch_ev(&t.D, x), 20000);
    assert_int_equal(fetch_ev(&t.D, x)->st, KVC_OK);
    assert_true(region_landed(&t.P, &t.D, 1));
    pair_cleanup(&t);
}

/* One-sided reads (the producer's shared-memory pool) wait for the whole
 * publication: the HOLD is held, then the read is byte-exact. */
static void test_layers_one_sided_waits(void **state) {
    (void)state;
    pair_t t;
    pair_init(&t, "lw-get", true, 0);
    publish_layers(&t, "lw-get", 0);
    uint64_t x = fetch_p(&t.D, t.json, lids, NB, 0, NULL);
    PUMP_UNTIL(&t.P, &t.D, stat(&t.P, KVC_STAT_PENDING_FETCHES) == 1, 20000);
    ready(&t, "lw-get", 1);
    for (int i = 0; i < 50; i++) { /* nothing is read while region 0 is not written */
        pump_once(&t.P);
        pump_once(&t.D);
    }
    assert_null(fetch_ev(&t.D, x));
    assert_true(region_canary(&t.D, 1, 0xa5));
    ready(&t, "lw-get", 0);
    PUMP_UNTIL(&t.P, &t.D, fetch_ev(&t.D, x), 20000);
    assert_int_equal(fetch_ev(&t.D, x)->st, KVC_OK);
    assert_true(region_landed(&t.P, &t.D, 0) && region_landed(&t.P, &t.D, 1));
    assert_int_equal(stat(&t.D, KVC_STAT_PEERS_GET), 1);
    pair_cleanup(&t);
}

/* Half written, then expired: the waiting fetch fails with TIMED_OUT, the
 * blocks come back with EXPIRED once the push's sends ended. */
static void test_layers_expiry(void **state) {
    (void)state;
    pair_t t;
    pair_init(&t, "lw-exp", false, 0);
    publish_layers(&t, "lw-exp", 400);
    ready(&t, "lw-exp", 0);
    uint64_t x = fetch_p(&t.D, t.json, lids, NB, 0, NULL);
    PUMP_UNTIL(&t.P, &t.D, fetch_ev(&t.D, x), 20000);
    assert_int_equal(fetch_ev(&t.D, x)->st, KVC_ERR_TIMED_OUT);
    PUMP_UNTIL(&t.P, &t.D, find_ev(&t.P, KVC_EV_EXPIRED, "lw-exp"), 20000);
    assert_null(t.P.a->defers);
    assert_int_equal(kvc_publish_ready(t.P.a, "lw-exp", 1, 1, NULL), KVC_ERR_NOT_FOUND);
    /* A half-written publication nobody fetches expires as any other. */
    publish_layers(&t, "lw-exp2", 200);
    ready(&t, "lw-exp2", 1);
    PUMP_UNTIL(&t.P, &t.D, find_ev(&t.P, KVC_EV_EXPIRED, "lw-exp2"), 20000);
    pair_cleanup(&t);
}

/* Unpublished half written (the engine aborted it): the push and a held
 * one-sided read are refused (DENIED), the blocks come back. */
static void test_layers_unpublish(void **state) {
    (void)state;
    pair_t t;
    pair_init(&t, "lw-un", false, 0);
    publish_layers(&t, "lw-un", 0);
    ready(&t, "lw-un", 1);
    uint64_t x = fetch_p(&t.D, t.json, lids, NB, 0, NULL);
    PUMP_UNTIL(&t.P, &t.D, t.P.a->defers != NULL && region_landed(&t.P, &t.D, 1), 20000);
    kvc_status_t st = kvc_unpublish(t.P.a, "lw-un");
    assert_true(st == KVC_INPROGRESS || st == KVC_OK);
    PUMP_UNTIL(&t.P, &t.D, fetch_ev(&t.D, x), 20000);
    assert_int_equal(fetch_ev(&t.D, x)->st, KVC_ERR_DENIED);
    if (st == KVC_INPROGRESS)
        PUMP_UNTIL(&t.P, &t.D, find_ev(&t.P, KVC_EV_RELEASED, "lw-un"), 20000);
    assert_null(t.P.a->defers);
    pair_cleanup(&t);

    pair_init(&t, "lw-ung", true, 0);
    publish_layers(&t, "lw-ung", 0);
    x = fetch_p(&t.D, t.json, lids, NB, 0, NULL);
    PUMP_UNTIL(&t.P, &t.D, stat(&t.P, KVC_STAT_PENDING_FETCHES) == 1, 20000);
    assert_int_equal(kvc_unpublish(t.P.a, "lw-ung"), KVC_OK);
    PUMP_UNTIL(&t.P, &t.D, fetch_ev(&t.D, x), 20000);
    assert_int_equal(fetch_ev(&t.D, x)->st, KVC_ERR_DENIED);
    assert_int_equal(stat(&t.P, KVC_STAT_PENDING_FETCHES), 0);
    pair_cleanup(&t);
}

/* The producer goes away with one region moved: the fetch fails (its
 * endpoint), in bounded time; the producer frees what it held. */
static void test_layers_producer_dies(void **state) {
    (void)state;
    pair_t t;
    pair_init(&t, "lw-die", false, 0);
    publish_layers(&t, "lw-die", 0);
    ready(&t, "lw-die", 0);
    uint64_t x = fetch_p(&t.D, t.json, lids, NB, 0, NULL);
    PUMP_UNTIL(&t.P, &t.D, region_landed(&t.P, &t.D, 0), 20000);
    kvc_agent_destroy(t.P.a);
    for (int r = 0; r < NREG; r++)
        free(t.P.mem[r]);
    uint64_t t0 = kvc_now_ns();
    while (!fetch_ev(&t.D, x)) {
        assert_true(kvc_now_ns() - t0 < 20000000000ull);
        kvc_agent_wait(t.D.a, 10);
        pump_once(&t.D);
    }
    kvc_status_t st = fetch_ev(&t.D, x)->st;
    assert_true(st == KVC_ERR_PEER_FAILED || st == KVC_ERR_TRANSPORT);
    side_cleanup(&t.D);
}

/* kvc_publish_ready's checks; a whole publication is ready already. */
static void test_layers_ready_checks(void **state) {
    (void)state;
    pair_t t;
    pair_init(&t, "lw-chk", false, 0);
    assert_int_equal(kvc_publish_ready(t.P.a, "none", 0, 1, NULL), KVC_ERR_NOT_FOUND);
    publish_layers(&t, "lw-chk", 0);
    assert_int_equal(kvc_publish_ready(t.P.a, "lw-chk", 0, 0, NULL), KVC_ERR_INVALID_PARAM);
    assert_int_equal(kvc_publish_ready(t.P.a, "lw-chk", 2, 1, NULL), KVC_ERR_INVALID_PARAM);
    assert_int_equal(kvc_publish_ready(t.P.a, "lw-chk", 1, 2, NULL), KVC_ERR_INVALID_PARAM);
    assert_int_equal(kvc_publish_ready(NULL, "lw-chk", 0, 1, NULL), KVC_ERR_INVALID_PARAM);
    assert_int_equal(kvc_publish_ready(t.P.a, "lw-chk", 0, 2, NULL), KVC_OK);
    assert_int_equal(kvc_publish_ready(t.P.a, "lw-chk", 1, 1, NULL), KVC_OK); /* again */
    publish_tok(&t.P, "whole", ids, NB, t.tok);
    assert_int_equal(kvc_publish_ready(t.P.a, "whole", 0, 1, NULL), KVC_OK);
    pair_cleanup(&t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layers_in_order),        cmocka_unit_test(test_layers_out_of_order),
        cmocka_unit_test(test_layers_some_ready_first), cmocka_unit_test(test_layers_before_publish),
        cmocka_unit_test(test_layers_one_sided_waits), cmocka_unit_test(test_layers_expiry),
        cmocka_unit_test(test_layers_unpublish),       cmocka_unit_test(test_layers_producer_dies),
        cmocka_unit_test(test_layers_ready_checks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
