/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests of the connector API that vLLM's plugin needs (issues 23, 25):
 * two or three agents in this process, progressed alternately (or by their
 * own progress threads), moving real blocks over UCX on loopback.
 *
 *  - the caller supplies the publication token; a wrong one is denied;
 *  - a fetch that reaches the producer before kvc_publish waits for it
 *    (push-mode registration) and gets byte-exact blocks, on push and on
 *    one-sided reads; an unmet registration expires (KVC_ERR_TIMED_OUT); the
 *    bounds on held registrations refuse with KVC_ERR_BUSY;
 *  - kvc_fetch_cancel: one FETCH_FAILED/KVC_ERR_CANCELED, and no byte lands
 *    after it returns (a canary written after the call survives);
 *  - leases: renewals keep a publication, a missed lease frees it long
 *    before the fixed expiry;
 *  - partial-block reads for TP 1->2 and 2->1, byte-exact, the rest of
 *    each local block untouched; block geometry mismatches refused with
 *    KVC_ERR_INCOMPATIBLE; rank r's side channel is remote_port + r;
 *  - progress threads: publish and fetch from two threads, events arrive
 *    without any caller progress.
 * Loops are bounded in time and count. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "connector/kvc_int.h"

#define KVC_FIXTURE_SECRET "unit-api2-secret"
#include "tests/unit/kvc_fixture.h"

/* ------------------------------------------------- caller's token -- */

static void test_caller_token(void **state) {
    (void)state;
    side_t P, D;
    side_init(&P, &(opts_t){.name = "tok-P", .nb = 16, .bl = 4096});
    side_init(&D, &(opts_t){.name = "tok-D", .nb = 16, .bl = 4096});
    char tok[33], other[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    assert_int_equal(kvc_token_new(other), KVC_OK);
    assert_int_equal(strlen(tok), 32);
    assert_true(strcmp(tok, other) != 0);
    /* A token that is not 32 hex digits is refused, nothing published. */
    uint64_t ids[3] = {2, 3, 4}, lids[3] = {7, 8, 9};
    kvc_publish_params_t bad = {.field_mask = KVC_PUBLISH_FIELD_TOKEN, .kv_token = "xyz"};
    char *json = NULL;
    assert_int_equal(kvc_publish(P.a, "tok", ids, 3, &bad, &json), KVC_ERR_INVALID_PARAM);
    assert_int_equal(stat(&P, KVC_STAT_PUBLISHED_NOW), 0);
    for (int i = 0; i < 3; i++)
        fill(&P, ids[i], 1);
    publish_tok(&P, "tok", ids, 3, tok);
    /* The other token is denied; the caller's one works, byte-exact. */
    uint64_t x1 = fetch_p(&D, params_json("tok-P", port_of(&P), "tok", ids, 3, other), lids, 3, 0,
                          NULL);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x1), 20000);
    assert_int_equal(fetch_ev(&D, x1)->st, KVC_ERR_DENIED);
    uint64_t x2 =
        fetch_p(&D, params_json("tok-P", port_of(&P), "tok", ids, 3, tok), lids, 3, 0, NULL);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x2), 20000);
    assert_int_equal(fetch_ev(&D, x2)->st, KVC_OK);
    for (int i = 0; i < 3; i++)
        assert_true(same_blocks(&P, ids[i], &D, lids[i]));
    PUMP_UNTIL(&P, &D, find_ev(&P, KVC_EV_RELEASED, "tok"), 20000);
    side_cleanup(&D);
    side_cleanup(&P);
}

/* ---------------------------------- fetch before publish (issue 25) -- */

static void before_publish(bool pool) {
    side_t P, D;
    opts_t po = {.name = "reg-P", .nb = 32, .bl = 8192, .pool = pool, .tls = pool ? "sm,tcp,self" : NULL};
    opts_t dopt = {.name = "reg-D", .nb = 32, .bl = 8192, .pool = pool, .tls = po.tls};
    side_init(&P, &po);
    side_init(&D, &dopt);
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t ids[4] = {3, 4, 5, 9}, lids[4] = {10, 11, 12, 20};
    const char *json = params_json("reg-P", port_of(&P), "early", ids, 4, tok);
    kvc_fetch_params_t w = {.wait_ms = 20000};
    uint64_t x = fetch_p(&D, json, lids, 4, KVC_FETCH_FIELD_WAIT, &w);
    /* The pull reaches the producer and is held there. */
    PUMP_UNTIL(&P, &D, stat(&P, KVC_STAT_PENDING_FETCHES) == 1, 20000);
    for (int i = 0; i < 50; i++) {
        pump_once(&P);
        pump_once(&D);
    }
    assert_null(fetch_ev(&D, x));
    for (int i = 0; i < 4; i++)
        fill(&P, ids[i], 5);
    publish_tok(&P, "early", ids, 4, tok);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x), 20000);
    assert_int_equal(fetch_ev(&D, x)->st, KVC_OK);
    for (int i = 0; i < 4; i++)
        assert_true(same_blocks(&P, ids[i], &D, lids[i]));
    assert_int_equal(stat(&P, KVC_STAT_PENDING_SERVED), 1);
    /* The path asked for: one-sided reads from the pool, or pushes. */
    assert_int_equal(stat(&D, pool ? KVC_STAT_PEERS_GET : KVC_STAT_PEERS_PUSH), 1);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_FETCHES), 0);
    PUMP_UNTIL(&P, &D, find_ev(&P, KVC_EV_RELEASED, "early"), 20000);
    side_cleanup(&D);
    side_cleanup(&P);
}

static void test_before_publish_push(void **state) {
    (void)state;
    before_publish(false);
}

static void test_before_publish_get(void **state) {
    (void)state;
    before_publish(true);
}

/* Push mode: a held fetch without remote block ids (an empty list) is
 * served the publication's last blocks, in order, whichever ids prefill
 * chose; asking for more than it holds is refused.  Without
 * KVC_FETCH_FIELD_WAIT an empty list is invalid, as before. */
static void tail_fetch(bool pool) {
    side_t P, D;
    opts_t po = {.name = "tail-P", .nb = 32, .bl = 8192, .pool = pool, .tls = pool ? "sm,tcp,self" : NULL};
    opts_t dopt = {.name = "tail-D", .nb = 32, .bl = 8192, .pool = pool, .tls = po.tls};
    side_init(&P, &po);
    side_init(&D, &dopt);
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t ids[5] = {9, 3, 4, 17, 5}, lids[3] = {20, 11, 12};
    char json[4096];
    snprintf(json, sizeof json, "%s", params_json("tail-P", port_of(&P), "tail", NULL, 0, tok));
    kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS,
                             .kv_transfer_params_json = json,
                             .local_block_ids = lids,
                             .num_local_blocks = 3};
    uint64_t bad = 0;
    assert_int_equal(kvc_fetch(D.a, &fp, &bad), KVC_ERR_INVALID_PARAM);
    kvc_fetch_params_t w = {.wait_ms = 20000};
    uint64_t x = fetch_p(&D, json, lids, 3, KVC_FETCH_FIELD_WAIT, &w);
    uint64_t lbig[6] = {0, 1, 2, 6, 7, 8};
    char json2[4096];
    snprintf(json2, sizeof json2, "%s", params_json("tail-P", port_of(&P), "tail2", NULL, 0, tok));
    uint64_t x2 = fetch_p(&D, json2, lbig, 6, KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &D, stat(&P, KVC_STAT_PENDING_FETCHES) == 2, 20000);
    assert_null(fetch_ev(&D, x));
    for (int i = 0; i < 5; i++)
        fill(&P, ids[i], 3);
    publish_tok(&P, "tail", ids, 5, tok);
    publish_tok(&P, "tail2", ids, 5, tok);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x) && fetch_ev(&D, x2), 20000);
    assert_int_equal(fetch_ev(&D, x)->st, KVC_OK);
    for (int i = 0; i < 3; i++)
        assert_true(same_blocks(&P, ids[2 + i], &D, lids[i]));
    assert_int_equal(fetch_ev(&D, x2)->st, KVC_ERR_DENIED);
    PUMP_UNTIL(&P, &D, find_ev(&P, KVC_EV_RELEASED, "tail"), 20000);
    side_cleanup(&D);
    side_cleanup(&P);
}

static void test_tail_fetch_push(void **state) {
    (void)state;
    tail_fetch(false);
}

static void test_tail_fetch_get(void **state) {
    (void)state;
    tail_fetch(true);
}

/* An unmet registration expires; one whose publication comes with another
 * token is denied; without KVC_FETCH_FIELD_WAIT an unknown id fails fast. */
static void test_registration_expiry(void **state) {
    (void)state;
    side_t P, D;
    side_init(&P, &(opts_t){.name = "exp-P", .nb = 16, .bl = 4096, .pending_ms = 300});
    side_init(&D, &(opts_t){.name = "exp-D", .nb = 16, .bl = 4096});
    char tok[33], other[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    assert_int_equal(kvc_token_new(other), KVC_OK);
    uint64_t ids[2] = {1, 2}, lids[2] = {3, 4};
    uint16_t port = port_of(&P);
    kvc_fetch_params_t w = {.wait_ms = 20000};
    uint64_t never = fetch_p(&D, params_json("exp-P", port, "never", ids, 2, tok), lids, 2,
                             KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, never), 20000);
    assert_int_equal(fetch_ev(&D, never)->type, KVC_EV_FETCH_FAILED);
    assert_int_equal(fetch_ev(&D, never)->st, KVC_ERR_TIMED_OUT);
    assert_non_null(strstr(fetch_ev(&D, never)->msg, "registration"));
    assert_int_equal(stat(&P, KVC_STAT_PENDING_EXPIRED), 1);
    /* Registered with a token the publication does not have: denied at publish. */
    uint64_t wrong = fetch_p(&D, params_json("exp-P", port, "wrong", ids, 2, other), lids, 2,
                             KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &D, stat(&P, KVC_STAT_PENDING_FETCHES) == 1, 20000);
    publish_tok(&P, "wrong", ids, 2, tok);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, wrong), 20000);
    assert_int_equal(fetch_ev(&D, wrong)->st, KVC_ERR_DENIED);
    /* No wait asked: an unknown id is refused at once, nothing held. */
    uint64_t fast = fetch_p(&D, params_json("exp-P", port, "unknown", ids, 2, tok), lids, 2, 0, NULL);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, fast), 20000);
    assert_int_equal(fetch_ev(&D, fast)->st, KVC_ERR_DENIED);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_FETCHES), 0);
    side_cleanup(&D);
    side_cleanup(&P);
}

/* Held registrations are bounded per consumer: beyond, KVC_ERR_BUSY; the
 * held ones are still served when their publications come. */
static void test_registration_bounds(void **state) {
    (void)state;
    side_t P, D;
    side_init(&P, &(opts_t){.name = "bnd-P", .nb = 16, .bl = 4096, .max_per_peer = 2});
    side_init(&D, &(opts_t){.name = "bnd-D", .nb = 16, .bl = 4096});
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint16_t port = port_of(&P);
    kvc_fetch_params_t w = {.wait_ms = 20000};
    uint64_t ids[1] = {5};
    uint64_t l0[1] = {1}, l1[1] = {2}, l2[1] = {3};
    uint64_t x0 = fetch_p(&D, params_json("bnd-P", port, "b0", ids, 1, tok), l0, 1,
                          KVC_FETCH_FIELD_WAIT, &w);
    uint64_t x1 = fetch_p(&D, params_json("bnd-P", port, "b1", ids, 1, tok), l1, 1,
                          KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &D, stat(&P, KVC_STAT_PENDING_FETCHES) == 2, 20000);
    uint64_t x2 = fetch_p(&D, params_json("bnd-P", port, "b2", ids, 1, tok), l2, 1,
                          KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x2), 20000);
    assert_int_equal(fetch_ev(&D, x2)->st, KVC_ERR_BUSY);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_REFUSED), 1);
    fill(&P, 5, 9);
    publish_tok(&P, "b0", ids, 1, tok);
    publish_tok(&P, "b1", ids, 1, tok);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x0) && fetch_ev(&D, x1), 20000);
    assert_int_equal(fetch_ev(&D, x0)->st, KVC_OK);
    assert_int_equal(fetch_ev(&D, x1)->st, KVC_OK);
    assert_true(same_blocks(&P, 5, &D, 1) && same_blocks(&P, 5, &D, 2));
    side_cleanup(&D);
    side_cleanup(&P);
}

/* The total bound, shared fairly between consumers: a second consumer's
 * registration takes the place of the first one's, which holds more (one
 * against none), and that one is refused (KVC_ERR_BUSY); a third one of the
 * second consumer is refused, since it would then hold more than the first.
 * The agent's stats show the refusals. */
static void test_registration_total_bound(void **state) {
    (void)state;
    side_t P, D, E;
    side_init(&P, &(opts_t){.name = "tot-P", .nb = 16, .bl = 4096, .max_pending = 1});
    side_init(&D, &(opts_t){.name = "tot-D", .nb = 16, .bl = 4096});
    side_init(&E, &(opts_t){.name = "tot-E", .nb = 16, .bl = 4096});
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint16_t port = port_of(&P);
    kvc_fetch_params_t w = {.wait_ms = 20000};
    uint64_t ids[1] = {5}, l0[1] = {1}, l1[1] = {2};
    uint64_t x0 = fetch_p(&D, params_json("tot-P", port, "t0", ids, 1, tok), l0, 1,
                          KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &D, stat(&P, KVC_STAT_PENDING_FETCHES) == 1, 20000);
    uint64_t y = fetch_p(&E, params_json("tot-P", port, "t1", ids, 1, tok), l0, 1,
                         KVC_FETCH_FIELD_WAIT, &w);
    for (uint64_t t0 = kvc_now_ns(); !fetch_ev(&D, x0);) { /* E's pull, P, D's refusal */
        assert_true(kvc_now_ns() - t0 < 20000000000ull);
        pump_once(&E);
        pump_once(&P);
        pump_once(&D);
    }
    assert_int_equal(fetch_ev(&D, x0)->st, KVC_ERR_BUSY);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_REFUSED), 1);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_FETCHES), 1);
    uint64_t y2 = fetch_p(&E, params_json("tot-P", port, "t2", ids, 1, tok), l1, 1,
                          KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &E, fetch_ev(&E, y2), 20000);
    assert_int_equal(fetch_ev(&E, y2)->st, KVC_ERR_BUSY);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_REFUSED), 2);
    fill(&P, 5, 2);
    publish_tok(&P, "t1", ids, 1, tok);
    PUMP_UNTIL(&P, &E, fetch_ev(&E, y), 20000);
    assert_int_equal(fetch_ev(&E, y)->st, KVC_OK);
    assert_true(same_blocks(&P, 5, &E, 1));
    side_cleanup(&E);
    side_cleanup(&D);
    side_cleanup(&P);
}

/* --------------------------------------------------------- cancel -- */

static uint64_t inflight(side_t *s) {
    kvc_lock(s->a);
    uint64_t v = s->a->push_inflight;
    kvc_unlock(s->a);
    return v;
}

static void test_cancel_mid_transfer(void **state) {
    (void)state;
    side_t P, D;
    /* The producer progresses by itself, as another process would, while
     * kvc_fetch_cancel waits for the requests in flight to end. */
    side_init(&P, &(opts_t){.name = "can-P", .nb = 64, .bl = 1 << 20, .thread = true});
    side_init(&D, &(opts_t){.name = "can-D", .nb = 64, .bl = 1 << 20});
    assert_int_equal(kvc_fetch_cancel(D.a, 12345), KVC_ERR_NOT_FOUND);
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t ids[48], lids[48];
    for (int i = 0; i < 48; i++) {
        ids[i] = (uint64_t)i + 8;
        lids[i] = (uint64_t)i + 2;
        fill(&P, ids[i], 3);
    }
    /* The transfer has to be caught under way. Over loopback a whole 48 MiB
     * fetch can end inside one pump of the consumer while the producer's
     * thread pushes, so an attempt that finished first (and must have
     * finished well) is followed by another under a new request id; at
     * least one of 8 has to be caught in flight. */
    char rid[16] = "";
    uint64_t x = 0;
    int attempt = 0;
    for (; attempt < 8; attempt++) {
        snprintf(rid, sizeof(rid), "big-%d", attempt);
        publish_tok(&P, rid, ids, 48, tok);
        x = fetch_p(&D, params_json("can-P", port_of(&P), rid, ids, 48, tok), lids, 48, 0, NULL);
        /* Until the producer pushes (the transfer is under way). */
        PUMP_UNTIL(&P, &D, inflight(&P) > 0 || fetch_ev(&D, x), 20000);
        if (!fetch_ev(&D, x)) break;
        assert_int_equal(fetch_ev(&D, x)->st, KVC_OK);
        fprintf(stderr, "attempt %d ended before it was seen in flight\n", attempt);
        PUMP_UNTIL(&P, &D, inflight(&P) == 0, 20000);
    }
    assert_true(attempt < 8);
    assert_null(fetch_ev(&D, x));
    uint64_t canceled0 = stat(&D, KVC_STAT_FETCH_CANCELED);
    uint64_t c0 = kvc_now_ns();
    assert_int_equal(kvc_fetch_cancel(D.a, x), KVC_OK);
    fprintf(stderr, "cancel returned after %.1f ms\n", (double)(kvc_now_ns() - c0) / 1e6);
    assert_int_equal(kvc_fetch_cancel(D.a, x), KVC_ERR_NOT_FOUND);
    assert_int_equal(stat(&D, KVC_STAT_FETCH_CANCELED), canceled0 + 1);
    /* Nothing of the fetch lands any more: a canary written now survives
     * everything the producer still sends. */
    canary(&D, 0xA5);
    PUMP_UNTIL(&P, &D, inflight(&P) == 0, 20000);
    for (int i = 0; i < 300; i++) {
        pump_once(&P);
        pump_once(&D);
    }
    for (int r = 0; r < NREG; r++)
        for (uint64_t b = 0; b < D.nb; b++)
            for (size_t i = 0; i < D.bl; i += 512)
                assert_int_equal(block(&D, r, b)[i], 0xA5);
    assert_int_equal(count_fetch_ev(&D, x), 1);
    assert_int_equal(fetch_ev(&D, x)->type, KVC_EV_FETCH_FAILED);
    assert_int_equal(fetch_ev(&D, x)->st, KVC_ERR_CANCELED);
    /* The agent keeps working: a new fetch of the same blocks succeeds
     * (the cancelled one never notified, so the publication is live). */
    uint64_t y = fetch_p(&D, params_json("can-P", port_of(&P), rid, ids, 48, tok), lids, 48, 0,
                         NULL);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, y), 30000);
    assert_int_equal(fetch_ev(&D, y)->st, KVC_OK);
    assert_true(same_blocks(&P, ids[47], &D, lids[47]));
    side_cleanup(&D);
    side_cleanup(&P);
}

/* --------------------------------------------------------- leases -- */

static void test_lease(void **state) {
    (void)state;
    side_t P, D;
    side_init(&P, &(opts_t){.name = "lea-P", .nb = 16, .bl = 4096, .lease_ms = 1000});
    side_init(&D, &(opts_t){.name = "lea-D", .nb = 16, .bl = 4096});
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t a_ids[2] = {1, 2}, b_ids[2] = {3, 4}, lids[2] = {8, 9};
    fill(&P, 1, 4);
    fill(&P, 2, 4);
    publish_tok(&P, "kept", a_ids, 2, tok);
    publish_tok(&P, "dropped", b_ids, 2, tok);
    const char *kept = params_json("lea-P", port_of(&P), "kept", a_ids, 2, tok);
    char kept_json[4096];
    snprintf(kept_json, sizeof(kept_json), "%s", kept);
    kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON, .kv_transfer_params_json = kept_json};
    /* Decode renews "kept" every ~100 ms while it waits; "dropped" is not
     * renewed and goes after its 1 s lease (the fixed expiry is 480 s). */
    uint64_t t0 = kvc_now_ns(), last = 0;
    while (!find_ev(&P, KVC_EV_EXPIRED, "dropped")) {
        assert_true(kvc_now_ns() - t0 < 20000000000ull);
        if (kvc_now_ns() - last > 100000000ull) {
            assert_int_equal(kvc_lease_renew(D.a, &fp), KVC_OK);
            last = kvc_now_ns();
        }
        pump_once(&P);
        pump_once(&D);
    }
    const rec_t *e = find_ev(&P, KVC_EV_EXPIRED, "dropped");
    assert_non_null(strstr(e->msg, "lease"));
    assert_null(find_ev(&P, KVC_EV_EXPIRED, "kept"));
    assert_true(stat(&P, KVC_STAT_LEASE_RENEWALS) >= 5);
    assert_int_equal(stat(&P, KVC_STAT_LEASE_EXPIRED), 1);
    /* A renewal with a wrong token is refused and counted. */
    uint64_t denied = stat(&P, KVC_STAT_DENIED);
    char wrong_tok[33];
    assert_int_equal(kvc_token_new(wrong_tok), KVC_OK);
    kvc_fetch_params_t bad = {.field_mask = KVC_FETCH_FIELD_JSON,
                              .kv_transfer_params_json =
                                  params_json("lea-P", port_of(&P), "kept", a_ids, 2, wrong_tok)};
    assert_int_equal(kvc_lease_renew(D.a, &bad), KVC_OK);
    PUMP_UNTIL(&P, &D, stat(&P, KVC_STAT_DENIED) > denied, 20000);
    /* The renewed publication is still whole. */
    uint64_t x = fetch_p(&D, kept_json, lids, 2, 0, NULL);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x), 20000);
    assert_int_equal(fetch_ev(&D, x)->st, KVC_OK);
    assert_true(same_blocks(&P, 1, &D, 8) && same_blocks(&P, 2, &D, 9));
    side_cleanup(&D);
    side_cleanup(&P);
}

/* --------------------------------------------------------- slices -- */

static void check_part(side_t *P, uint64_t pb, uint32_t rparts, uint32_t rpart, side_t *D,
                       uint64_t db, uint32_t lparts, uint32_t lpart, uint8_t untouched) {
    size_t part = D->bl / lparts;
    for (int r = 0; r < NREG; r++) {
        assert_int_equal(P->bl / rparts, part);
        assert_memory_equal(block(D, r, db) + lpart * part, block(P, r, pb) + rpart * part, part);
        for (size_t i = 0; i < D->bl; i++)
            if (i / part != lpart) assert_int_equal(block(D, r, db)[i], untouched);
    }
}

static void slice_1to2(bool pool) {
    side_t P, D0, D1;
    const char *tls = pool ? "sm,tcp,self" : NULL;
    side_init(&P, &(opts_t){.name = "s12-P", .nb = 8, .bl = 4096, .pool = pool, .tls = tls});
    /* Decode TP 2: both ranks pull before the blocks are released. */
    side_init(&D0,
              &(opts_t){.name = "s12-D0", .nb = 8, .bl = 2048, .pool = pool, .tls = tls, .tp = 2});
    side_init(&D1,
              &(opts_t){.name = "s12-D1", .nb = 8, .bl = 2048, .pool = pool, .tls = tls, .tp = 2});
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t ids[3] = {1, 2, 5}, lids[3] = {0, 3, 4};
    for (int i = 0; i < 3; i++)
        fill(&P, ids[i], 7);
    publish_tok(&P, "s12", ids, 3, tok);
    const char *json = params_json("s12-P", port_of(&P), "s12", ids, 3, tok);
    kvc_fetch_params_t s0 = {.remote_parts = 2, .remote_part = 0, .local_parts = 1};
    kvc_fetch_params_t s1 = {.remote_parts = 2, .remote_part = 1, .local_parts = 1};
    uint64_t x0 = fetch_p(&D0, json, lids, 3, KVC_FETCH_FIELD_SLICE, &s0);
    uint64_t x1 = fetch_p(&D1, json, lids, 3, KVC_FETCH_FIELD_SLICE, &s1);
    uint64_t t0 = kvc_now_ns();
    while (!fetch_ev(&D0, x0) || !fetch_ev(&D1, x1)) {
        assert_true(kvc_now_ns() - t0 < 20000000000ull);
        pump_once(&P);
        pump_once(&D0);
        pump_once(&D1);
    }
    assert_int_equal(fetch_ev(&D0, x0)->st, KVC_OK);
    assert_int_equal(fetch_ev(&D1, x1)->st, KVC_OK);
    assert_int_equal(stat(&D0, pool ? KVC_STAT_PEERS_GET : KVC_STAT_PEERS_PUSH), 1);
    for (int i = 0; i < 3; i++) {
        check_part(&P, ids[i], 2, 0, &D0, lids[i], 1, 0, 0);
        check_part(&P, ids[i], 2, 1, &D1, lids[i], 1, 0, 0);
    }
    /* A whole-block fetch across the different block lengths is refused. */
    uint64_t bad = fetch_p(&D0, json, lids, 3, 0, NULL);
    t0 = kvc_now_ns();
    while (!fetch_ev(&D0, bad)) {
        assert_true(kvc_now_ns() - t0 < 20000000000ull);
        pump_once(&P);
        pump_once(&D0);
    }
    assert_int_equal(fetch_ev(&D0, bad)->st, KVC_ERR_INCOMPATIBLE);
    assert_non_null(strstr(fetch_ev(&D0, bad)->msg, "block geometry"));
    /* As are parts whose sizes differ (4096/4 != 2048/1). */
    kvc_fetch_params_t s4 = {.remote_parts = 4, .remote_part = 1, .local_parts = 1};
    uint64_t bad4 = fetch_p(&D1, json, lids, 3, KVC_FETCH_FIELD_SLICE, &s4);
    t0 = kvc_now_ns();
    while (!fetch_ev(&D1, bad4)) {
        assert_true(kvc_now_ns() - t0 < 20000000000ull);
        pump_once(&P);
        pump_once(&D1);
    }
    assert_int_equal(fetch_ev(&D1, bad4)->st, KVC_ERR_INCOMPATIBLE);
    side_cleanup(&D1);
    side_cleanup(&D0);
    side_cleanup(&P);
}

static void test_slice_1to2_push(void **state) {
    (void)state;
    slice_1to2(false);
}

static void test_slice_1to2_get(void **state) {
    (void)state;
    slice_1to2(true);
}

/* TP 2 -> 1: two prefill ranks of one engine (same engine id, rank 1 on
 * remote_port + 1), one request token; decode reads part 0 of 1 from each
 * into local parts 0 and 1 of 2, one kv_transfer_params for both. */
static void test_slice_2to1(void **state) {
    (void)state;
    side_t P0, P1, D;
    side_init(&P1, &(opts_t){.name = "s21-P", .nb = 8, .bl = 2048, .tp = 2});
    kvc_status_t st = KVC_ERR_IO;
    for (int i = 0; i < 20 && st != KVC_OK; i++) { /* rank 0 on the port below rank 1's */
        st = side_try(&P0, &(opts_t){.name = "s21-P", .nb = 8, .bl = 2048, .tp = 2,
                                     .port = (uint16_t)(port_of(&P1) - 1)});
        if (st != KVC_OK) {
            side_cleanup(&P1);
            side_init(&P1, &(opts_t){.name = "s21-P", .nb = 8, .bl = 2048, .tp = 2});
        }
    }
    assert_int_equal(st, KVC_OK);
    side_init(&D, &(opts_t){.name = "s21-D", .nb = 8, .bl = 4096});
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t ids[2] = {2, 6}, lids[2] = {1, 7};
    for (int i = 0; i < 2; i++) {
        fill(&P0, ids[i], 10);
        fill(&P1, ids[i], 20);
    }
    publish_tok(&P0, "s21", ids, 2, tok);
    publish_tok(&P1, "s21", ids, 2, tok);
    canary(&D, 0x5A);
    const char *json = params_json("s21-P", port_of(&P0), "s21", ids, 2, tok);
    kvc_fetch_params_t r0 = {.remote_parts = 1, .local_parts = 2, .local_part = 0};
    kvc_fetch_params_t r1 = {.remote_parts = 1, .local_parts = 2, .local_part = 1, .remote_rank = 1};
    uint64_t x0 = fetch_p(&D, json, lids, 2, KVC_FETCH_FIELD_SLICE, &r0);
    uint64_t t0 = kvc_now_ns();
    while (!fetch_ev(&D, x0)) {
        assert_true(kvc_now_ns() - t0 < 20000000000ull);
        pump_once(&P0);
        pump_once(&P1);
        pump_once(&D);
    }
    assert_int_equal(fetch_ev(&D, x0)->st, KVC_OK);
    for (int i = 0; i < 2; i++) /* only part 0 written so far */
        check_part(&P0, ids[i], 1, 0, &D, lids[i], 2, 0, 0x5A);
    uint64_t x1 =
        fetch_p(&D, json, lids, 2, KVC_FETCH_FIELD_SLICE | KVC_FETCH_FIELD_REMOTE_RANK, &r1);
    t0 = kvc_now_ns();
    while (!fetch_ev(&D, x1)) {
        assert_true(kvc_now_ns() - t0 < 20000000000ull);
        pump_once(&P0);
        pump_once(&P1);
        pump_once(&D);
    }
    assert_int_equal(fetch_ev(&D, x1)->st, KVC_OK);
    for (int i = 0; i < 2; i++)
        for (int r = 0; r < NREG; r++) {
            assert_memory_equal(block(&D, r, lids[i]), block(&P0, r, ids[i]), 2048);
            assert_memory_equal(block(&D, r, lids[i]) + 2048, block(&P1, r, ids[i]), 2048);
        }
    /* Blocks not fetched keep the canary. */
    for (int r = 0; r < NREG; r++)
        assert_int_equal(block(&D, r, 0)[100], 0x5A);
    /* Each rank got its own notification. */
    t0 = kvc_now_ns();
    while (!find_ev(&P0, KVC_EV_RELEASED, "s21") || !find_ev(&P1, KVC_EV_RELEASED, "s21")) {
        assert_true(kvc_now_ns() - t0 < 20000000000ull);
        pump_once(&P0);
        pump_once(&P1);
        pump_once(&D);
    }
    side_cleanup(&D);
    side_cleanup(&P1);
    side_cleanup(&P0);
}

/* TP 2 -> 1 over runs of several blocks: contiguous on both sides, so the
 * producer may send a run in one message while each block lands in part
 * `local_part` of a local block twice its size (plugin issue: "data message
 * does not match the fetch").  Both halves come from two publications of
 * one producer; the other half and the blocks not named keep the canary. */
static void slice_2to1_runs(bool pool) {
    side_t P, D;
    const char *tls = pool ? "sm,tcp,self" : NULL;
    side_init(&P, &(opts_t){.name = "r21-P", .nb = 16, .bl = 2048, .pool = pool, .tls = tls});
    side_init(&D, &(opts_t){.name = "r21-D", .nb = 16, .bl = 4096, .pool = pool, .tls = tls});
    char tok[2][33];
    /* Runs of 4 and 3 contiguous blocks, and a single block. */
    uint64_t ids[2][8] = {{2, 3, 4, 5, 9, 10, 11, 14}, {6, 7, 8, 12, 13, 0, 1, 15}};
    uint64_t lids[8] = {1, 2, 3, 4, 8, 9, 10, 13};
    const char *req[2] = {"r21-a", "r21-b"};
    for (int h = 0; h < 2; h++) {
        assert_int_equal(kvc_token_new(tok[h]), KVC_OK);
        for (int i = 0; i < 8; i++)
            fill(&P, ids[h][i], (uint8_t)(40 + h));
        publish_tok(&P, req[h], ids[h], 8, tok[h]);
    }
    canary(&D, 0xA5);
    for (int h = 0; h < 2; h++) {
        const char *json = params_json("r21-P", port_of(&P), req[h], ids[h], 8, tok[h]);
        kvc_fetch_params_t s = {.remote_parts = 1, .local_parts = 2, .local_part = (uint32_t)h};
        uint64_t x = fetch_p(&D, json, lids, 8, KVC_FETCH_FIELD_SLICE, &s);
        PUMP_UNTIL(&P, &D, fetch_ev(&D, x), 20000);
        assert_string_equal(fetch_ev(&D, x)->msg, "");
        assert_int_equal(fetch_ev(&D, x)->st, KVC_OK);
        for (int i = 0; i < 8; i++)
            for (int r = 0; r < NREG; r++)
                assert_memory_equal(block(&D, r, lids[i]) + (size_t)h * 2048,
                                    block(&P, r, ids[h][i]), 2048);
        PUMP_UNTIL(&P, &D, find_ev(&P, KVC_EV_RELEASED, req[h]), 20000);
    }
    assert_int_equal(stat(&D, pool ? KVC_STAT_PEERS_GET : KVC_STAT_PEERS_PUSH), 1);
    for (uint64_t b = 0; b < 16; b++) {
        bool named = false;
        for (int i = 0; i < 8; i++)
            named |= lids[i] == b;
        if (named) continue;
        for (int r = 0; r < NREG; r++)
            for (size_t i = 0; i < D.bl; i++)
                if (block(&D, r, b)[i] != 0xA5)
                    fail_msg("block %llu byte %zu written", (unsigned long long)b, i);
    }
    side_cleanup(&D);
    side_cleanup(&P);
}

static void test_slice_2to1_runs_push(void **state) {
    (void)state;
    slice_2to1_runs(false);
}

static void test_slice_2to1_runs_get(void **state) {
    (void)state;
    slice_2to1_runs(true);
}

/* A notify-only fetch (no local blocks: an aborted decode request, an
 * extra MLA rank) that reaches the producer before the publication is held
 * with KVC_FETCH_FIELD_WAIT, and releases it the moment it is published
 * (no lease here: nothing else would ever release it). */
static void notify_before_publish(bool pool) {
    side_t P, D;
    const char *tls = pool ? "sm,tcp,self" : NULL;
    side_init(&P, &(opts_t){.name = "nb-P", .nb = 8, .bl = 4096, .pool = pool, .tls = tls});
    side_init(&D, &(opts_t){.name = "nb-D", .nb = 8, .bl = 4096, .pool = pool, .tls = tls});
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t ids[3] = {1, 2, 6};
    const char *json = params_json("nb-P", port_of(&P), "bare", ids, 3, tok);
    kvc_fetch_params_t w = {.wait_ms = 20000};
    uint64_t x = fetch_p(&D, json, NULL, 0, KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &D, stat(&P, KVC_STAT_PENDING_FETCHES) == 1, 20000);
    for (int i = 0; i < 50; i++) {
        pump_once(&P);
        pump_once(&D);
    }
    assert_null(fetch_ev(&D, x));
    assert_int_equal(stat(&P, KVC_STAT_DENIED), 0);
    publish_tok(&P, "bare", ids, 3, tok);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x) && find_ev(&P, KVC_EV_RELEASED, "bare"), 20000);
    assert_int_equal(fetch_ev(&D, x)->st, KVC_OK);
    assert_int_equal(find_ev(&P, KVC_EV_RELEASED, "bare")->st, KVC_OK);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_SERVED), 1);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_FETCHES), 0);
    assert_int_equal(stat(&P, KVC_STAT_DENIED), 0);
    assert_int_equal(stat(&P, KVC_STAT_UNKNOWN_NOTIFY), 0);
    /* Published first: the same bare release goes straight through. */
    publish_tok(&P, "bare2", ids, 3, tok);
    json = params_json("nb-P", port_of(&P), "bare2", ids, 3, tok);
    x = fetch_p(&D, json, NULL, 0, KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x) && find_ev(&P, KVC_EV_RELEASED, "bare2"), 20000);
    assert_int_equal(fetch_ev(&D, x)->st, KVC_OK);
    /* Released already: not held, the notification goes out as a late one. */
    x = fetch_p(&D, json, NULL, 0, KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x) && find_ev(&P, KVC_EV_UNKNOWN_NOTIFY, "bare2"), 20000);
    assert_int_equal(fetch_ev(&D, x)->st, KVC_OK);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_FETCHES), 0);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_SERVED), 1);
    side_cleanup(&D);
    side_cleanup(&P);
}

static void test_notify_before_publish_push(void **state) {
    (void)state;
    notify_before_publish(false);
}

static void test_notify_before_publish_get(void **state) {
    (void)state;
    notify_before_publish(true);
}

/* A held bare release whose publication never comes fails with the
 * registration wait, and one without KVC_FETCH_FIELD_WAIT is refused as
 * before (nothing held). */
static void test_notify_before_publish_expiry(void **state) {
    (void)state;
    side_t P, D;
    side_init(&P, &(opts_t){.name = "ne-P", .nb = 8, .bl = 4096, .pending_ms = 300});
    side_init(&D, &(opts_t){.name = "ne-D", .nb = 8, .bl = 4096});
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t ids[2] = {1, 2};
    const char *json = params_json("ne-P", port_of(&P), "never", ids, 2, tok);
    kvc_fetch_params_t w = {.wait_ms = 20000};
    uint64_t x = fetch_p(&D, json, NULL, 0, KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x), 20000);
    assert_int_equal(fetch_ev(&D, x)->st, KVC_ERR_TIMED_OUT);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_FETCHES), 0);
    side_cleanup(&D);
    side_cleanup(&P);
}

/* -------------------------------------------------- progress thread -- */

typedef struct {
    side_t *D;
    const char *json;
    uint64_t xfer;
} fetcher_t;

static void *fetcher(void *arg) {
    fetcher_t *f = arg;
    static const uint64_t lids[3] = {4, 5, 6};
    kvc_fetch_params_t w = {.wait_ms = 20000};
    kvc_fetch_params_t fp = w;
    fp.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS | KVC_FETCH_FIELD_WAIT;
    fp.kv_transfer_params_json = f->json;
    fp.local_block_ids = lids;
    fp.num_local_blocks = 3;
    if (kvc_fetch(f->D->a, &fp, &f->xfer) != KVC_INPROGRESS) f->xfer = 0;
    return NULL;
}

/* Events only: no kvc_agent_progress from the test. */
static bool pop_until(side_t *s, kvc_event_type_t t, uint64_t ms) {
    uint64_t t0 = kvc_now_ns();
    while (kvc_now_ns() - t0 < ms * 1000000ull) {
        kvc_event_t e;
        while (kvc_agent_next_event(s->a, &e) == KVC_OK) {
            record_ev(s, &e);
            if (e.type == t) return true;
        }
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    return false;
}

static void test_progress_thread(void **state) {
    (void)state;
    side_t P, D;
    side_init(&P, &(opts_t){.name = "thr-P", .nb = 16, .bl = 65536, .thread = true});
    side_init(&D, &(opts_t){.name = "thr-D", .nb = 16, .bl = 65536, .thread = true});
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t ids[3] = {1, 2, 3};
    static char json[4096];
    snprintf(json, sizeof(json), "%s", params_json("thr-P", port_of(&P), "thr", ids, 3, tok));
    fetcher_t f = {.D = &D, .json = json};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, fetcher, &f), 0);
    for (int i = 0; i < 3; i++)
        fill(&P, ids[i], 11);
    publish_tok(&P, "thr", ids, 3, tok); /* this thread, while the other fetches */
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_true(f.xfer != 0);
    /* The fd still tells a caller's poll that events wait. */
    assert_true(pop_until(&D, KVC_EV_FETCH_DONE, 20000));
    assert_int_equal(fetch_ev(&D, f.xfer)->st, KVC_OK);
    for (int i = 0; i < 3; i++)
        assert_true(same_blocks(&P, ids[i], &D, ids[i] + 3));
    assert_true(pop_until(&P, KVC_EV_RELEASED, 20000));
    side_cleanup(&D);
    side_cleanup(&P);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_caller_token),
        cmocka_unit_test(test_before_publish_push),
        cmocka_unit_test(test_before_publish_get),
        cmocka_unit_test(test_tail_fetch_push),
        cmocka_unit_test(test_tail_fetch_get),
        cmocka_unit_test(test_registration_expiry),
        cmocka_unit_test(test_registration_bounds),
        cmocka_unit_test(test_registration_total_bound),
        cmocka_unit_test(test_cancel_mid_transfer),
        cmocka_unit_test(test_lease),
        cmocka_unit_test(test_slice_1to2_push),
        cmocka_unit_test(test_slice_1to2_get),
        cmocka_unit_test(test_slice_2to1),
        cmocka_unit_test(test_slice_2to1_runs_push),
        cmocka_unit_test(test_slice_2to1_runs_get),
        cmocka_unit_test(test_notify_before_publish_push),
        cmocka_unit_test(test_notify_before_publish_get),
        cmocka_unit_test(test_notify_before_publish_expiry),
        cmocka_unit_test(test_progress_thread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
