/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests: what FETCH_DONE and FETCH_FAILED promise, with two agents in
 * this process (a producer P and a consumer D) moving blocks over UCX on
 * loopback (tcp, or shared memory for the connector-allocated pool).
 *
 *  - one-sided reads are bracketed by the producer's word: a fetch of an
 *    unpublished, expired or invented publication, or with a wrong token,
 *    fails with DENIED on the shared-memory pool as it does over push;
 *  - a release (unpublish, expiry, notification) waits for the pushes and
 *    confirmed reads of the publication before the engine gets its blocks
 *    back;
 *  - nothing lands in local blocks after FETCH_FAILED;
 *  - TP fan-in works for more than 8 consumers without a count;
 *  - a consumer forced to GET against a producer that cannot serve it fails
 *    at once with KVC_ERR_UNSUPPORTED.
 * Loops are bounded in time; nothing sleeps. */
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

#define NREG 2
#define MAXEV 128

typedef struct {
    kvc_event_type_t type;
    kvc_status_t st;
    uint64_t xfer_id;
    char req[64];
    char msg[300];
    uint64_t push_inflight; /* the agent's pushes in flight when the event came */
} rec_t;

typedef struct {
    kvc_agent_t *a;
    uint8_t *mem[NREG]; /* owned when the regions are the caller's */
    uint64_t nb;
    size_t bl;
    rec_t ev[MAXEV];
    int n;
} side_t;

static void quiet_log(void *arg, kvc_log_level_t level, const char *msg) {
    if (getenv("KVC_TEST_VERBOSE")) fprintf(stderr, "%s: %s\n", (const char *)arg, msg);
}

static void side_init(side_t *s, const char *name, const char *tls, kvc_proto_t proto, uint32_t tp,
                      bool pool, uint64_t nb, size_t bl) {
    memset(s, 0, sizeof(*s));
    setenv("UCX_TLS", tls, 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    unsetenv("KVC_PROTO");
    kvc_agent_params_t p = {0};
    p.field_mask = KVC_AGENT_FIELD_ENGINE_ID | KVC_AGENT_FIELD_LOG | KVC_AGENT_FIELD_PROTO |
                   KVC_AGENT_FIELD_TP_SIZE | KVC_AGENT_FIELD_SECRET | KVC_AGENT_FIELD_XFER_TIMEOUT;
    p.engine_id = name;
    p.log_cb = quiet_log;
    p.log_arg = (void *)name;
    p.log_level = KVC_LOG_DEBUG;
    p.proto = proto;
    p.tp_size = tp;
    p.secret = "unit-xfer-secret";
    p.secret_len = strlen("unit-xfer-secret");
    p.xfer_timeout_ms = 30000;
    assert_int_equal(kvc_agent_create(&p, &s->a), KVC_OK);
    kvc_region_params_t rp[NREG];
    memset(rp, 0, sizeof(rp));
    for (int r = 0; r < NREG; r++) {
        rp[r].len = nb * bl;
        if (!pool) {
            s->mem[r] = calloc(nb, bl);
            assert_non_null(s->mem[r]);
            rp[r].field_mask = KVC_REGION_FIELD_BASE;
            rp[r].base = s->mem[r];
        }
    }
    assert_int_equal(kvc_agent_register_regions(s->a, nb, rp, NREG), KVC_OK);
    s->nb = nb;
    s->bl = bl;
}

static void side_cleanup(side_t *s) {
    kvc_agent_destroy(s->a);
    for (int r = 0; r < NREG; r++)
        free(s->mem[r]);
}

static uint8_t *block(side_t *s, int r, uint64_t b) {
    void *base;
    assert_int_equal(kvc_region_base(s->a, (size_t)r, &base), KVC_OK);
    return (uint8_t *)base + b * s->bl;
}

static void fill(side_t *s, uint64_t b, uint8_t gen) {
    for (int r = 0; r < NREG; r++)
        memset(block(s, r, b), gen + r, s->bl);
}

static bool holds(side_t *s, uint64_t b, uint8_t gen) {
    for (int r = 0; r < NREG; r++)
        for (size_t i = 0; i < s->bl; i++)
            if (block(s, r, b)[i] != (uint8_t)(gen + r)) return false;
    return true;
}

static uint64_t checksum(side_t *s) {
    uint64_t h = 1469598103934665603ull;
    for (int r = 0; r < NREG; r++)
        for (uint64_t b = 0; b < s->nb; b++) {
            const uint8_t *p = block(s, r, b);
            for (size_t i = 0; i < s->bl; i += 64)
                h = (h ^ p[i]) * 1099511628211ull;
        }
    return h;
}

static void pump_once(side_t *s) {
    kvc_agent_progress(s->a);
    kvc_event_t e;
    while (kvc_agent_next_event(s->a, &e) == KVC_OK) {
        assert_true(s->n < MAXEV);
        rec_t *r = &s->ev[s->n++];
        r->type = e.type;
        r->st = e.status;
        r->xfer_id = e.xfer_id;
        r->push_inflight = s->a->push_inflight;
        snprintf(r->req, sizeof(r->req), "%s", e.request_id ? e.request_id : "");
        snprintf(r->msg, sizeof(r->msg), "%s", e.message ? e.message : "");
    }
}

static const rec_t *find_ev(const side_t *s, kvc_event_type_t t, const char *req) {
    for (int i = 0; i < s->n; i++)
        if (s->ev[i].type == t && (!req || !strcmp(s->ev[i].req, req))) return &s->ev[i];
    return NULL;
}

static const rec_t *fetch_ev(const side_t *s, uint64_t id) {
    for (int i = 0; i < s->n; i++)
        if ((s->ev[i].type == KVC_EV_FETCH_DONE || s->ev[i].type == KVC_EV_FETCH_FAILED) &&
            s->ev[i].xfer_id == id)
            return &s->ev[i];
    return NULL;
}

/* Drives both agents until cond holds; fails the test after ms. */
#define PUMP_UNTIL(P, D, cond, ms)                                                                 \
    do {                                                                                           \
        uint64_t t0_ = kvc_now_ns();                                                               \
        while (!(cond)) {                                                                          \
            assert_true(kvc_now_ns() - t0_ < (uint64_t)(ms)*1000000ull);                           \
            pump_once(P);                                                                          \
            pump_once(D);                                                                          \
        }                                                                                          \
    } while (0)

static char *publish(side_t *P, const char *id, const uint64_t *ids, size_t n,
                     const kvc_publish_params_t *pp) {
    char *json = NULL;
    assert_int_equal(kvc_publish(P->a, id, ids, n, pp, &json), KVC_OK);
    return json;
}

static uint64_t fetch(side_t *D, const char *json, const uint64_t *lids, size_t n) {
    kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS,
                             .kv_transfer_params_json = json,
                             .local_block_ids = lids,
                             .num_local_blocks = n};
    uint64_t id = 0;
    assert_int_equal(kvc_fetch(D->a, &fp, &id), KVC_INPROGRESS);
    return id;
}

/* Runs one fetch to its event; returns it. */
static const rec_t *fetch_to_end(side_t *P, side_t *D, const char *json, const uint64_t *lids,
                                 size_t n) {
    uint64_t id = fetch(D, json, lids, n);
    PUMP_UNTIL(P, D, fetch_ev(D, id), 20000);
    return fetch_ev(D, id);
}

/* The same params with another value for one key (a string value). */
static char *with_key(const char *json, const char *key, const char *val) {
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":\"", key);
    const char *k = strstr(json, pat);
    assert_non_null(k);
    const char *v = k + strlen(pat), *e = strchr(v, '"');
    assert_non_null(e);
    size_t len = (size_t)(v - json) + strlen(val) + strlen(e) + 1;
    char *out = malloc(len);
    assert_non_null(out);
    snprintf(out, len, "%.*s%s%s", (int)(v - json), json, val, e);
    return out;
}

/* ------------------------------------------------- item 1: late reads -- */

/* Shared-memory pool, one-sided reads: every fetch the producer would refuse
 * over push is refused here too, and a fetch of a live publication works. */
static void test_late_read_pool(void **state) {
    side_t P, D;
    side_init(&P, "xfer-P", "sm,tcp,self", KVC_PROTO_AUTO, 1, true, 32, 4096);
    side_init(&D, "xfer-D", "sm,tcp,self", KVC_PROTO_AUTO, 1, true, 32, 4096);
    uint64_t ids[] = {4, 5, 6, 7}, lids[] = {10, 11, 12, 13};
    for (uint64_t b = 0; b < 32; b++)
        fill(&P, b, 0x40);

    /* Live: read one-sided, right bytes. */
    char *ok = publish(&P, "live", ids, 4, NULL);
    const rec_t *ev = fetch_to_end(&P, &D, ok, lids, 4);
    assert_int_equal(ev->type, KVC_EV_FETCH_DONE);
    for (int i = 0; i < 4; i++)
        assert_true(holds(&D, lids[i], 0x40));
    uint64_t v;
    assert_int_equal(kvc_agent_stat(D.a, KVC_STAT_PEERS_GET, &v), KVC_OK);
    assert_int_equal(v, 1); /* the one-sided path, not push */
    PUMP_UNTIL(&P, &D, find_ev(&P, KVC_EV_RELEASED, "live"), 5000);

    /* Unpublished before the read. */
    char *gone = publish(&P, "gone", ids, 4, NULL);
    assert_int_equal(kvc_unpublish(P.a, "gone"), KVC_OK);
    fill(&P, 4, 0x77); /* the engine reuses the blocks for another request */
    ev = fetch_to_end(&P, &D, gone, lids, 4);
    assert_int_equal(ev->type, KVC_EV_FETCH_FAILED);
    assert_int_equal(ev->st, KVC_ERR_DENIED);

    /* Expired before the read. */
    kvc_publish_params_t shortp = {.field_mask = KVC_PUBLISH_FIELD_EXPIRY, .expiry_ms = 1};
    char *exp = publish(&P, "expired", ids, 4, &shortp);
    PUMP_UNTIL(&P, &D, find_ev(&P, KVC_EV_EXPIRED, "expired"), 5000);
    ev = fetch_to_end(&P, &D, exp, lids, 4);
    assert_int_equal(ev->type, KVC_EV_FETCH_FAILED);
    assert_int_equal(ev->st, KVC_ERR_DENIED);

    /* A live publication with a wrong token, and an invented id. */
    char *live2 = publish(&P, "live2", ids, 4, NULL);
    char *wrong = with_key(live2, "remote_kv_token", "00000000000000000000000000000000");
    ev = fetch_to_end(&P, &D, wrong, lids, 4);
    assert_int_equal(ev->type, KVC_EV_FETCH_FAILED);
    assert_int_equal(ev->st, KVC_ERR_DENIED);
    char *invented = with_key(live2, "remote_request_id", "never-published");
    ev = fetch_to_end(&P, &D, invented, lids, 4);
    assert_int_equal(ev->type, KVC_EV_FETCH_FAILED);
    assert_int_equal(ev->st, KVC_ERR_DENIED);
    /* The refusals did not release it: the right consumer still reads it. */
    ev = fetch_to_end(&P, &D, live2, lids, 4);
    assert_int_equal(ev->type, KVC_EV_FETCH_DONE);

    free(wrong);
    free(invented);
    kvc_free(ok);
    kvc_free(gone);
    kvc_free(exp);
    kvc_free(live2);
    side_cleanup(&D);
    side_cleanup(&P);
}

/* A confirmed read holds the publication: a release while it holds waits
 * for it (kvc_unpublish answers KVC_INPROGRESS and the blocks come back
 * with an event); a hold past its deadline is broken and its read fails. */
static void test_hold_defers_release(void **state) {
    side_t P;
    side_init(&P, "hold-P", "tcp,self", KVC_PROTO_AUTO, 1, true, 16, 4096);
    uint64_t ids[] = {1, 2};
    char *json = publish(&P, "held", ids, 2, NULL);
    kvc_pub_t *pub = kvc_pubtab_find(&P.a->pubs, "held", 4);
    assert_non_null(pub);
    uint8_t tok[KVC_TOKEN_LEN] = {1};
    assert_int_equal(kvc_pub_hold(P.a, pub, 7, tok, kvc_now_ns() + 5000000000ull), KVC_OK);
    assert_int_equal(kvc_unpublish(P.a, "held"), KVC_INPROGRESS);
    pump_once(&P);
    assert_null(find_ev(&P, KVC_EV_RELEASED, "held")); /* still read */
    assert_int_equal(kvc_unpublish(P.a, "held"), KVC_ERR_NOT_FOUND);
    assert_int_equal(kvc_pub_unhold(P.a, "held", 4, 7, tok), KVC_OK);
    pump_once(&P);
    const rec_t *ev = find_ev(&P, KVC_EV_RELEASED, "held");
    assert_non_null(ev);
    assert_int_equal(ev->st, KVC_ERR_CANCELED);

    /* A hold past its deadline: broken, the blocks come back, and the read
     * it covered is told so. */
    char *json2 = publish(&P, "stale", ids, 2, NULL);
    pub = kvc_pubtab_find(&P.a->pubs, "stale", 5);
    assert_int_equal(kvc_pub_hold(P.a, pub, 8, tok, kvc_now_ns()), KVC_OK);
    assert_int_equal(kvc_unpublish(P.a, "stale"), KVC_INPROGRESS);
    pump_once(&P);
    assert_non_null(find_ev(&P, KVC_EV_RELEASED, "stale"));
    assert_int_equal(kvc_pub_unhold(P.a, "stale", 5, 8, tok), KVC_ERR_DENIED);
    kvc_free(json);
    kvc_free(json2);
    side_cleanup(&P);
}

/* ------------------------------------------ item 5: pushes and release -- */

static void push_release(bool by_expiry) {
    side_t P, D;
    /* 2 regions x 48 blocks x 512 KiB: pushed as several rendezvous sends. */
    side_init(&P, "push-P", "tcp,self", KVC_PROTO_AUTO, 1, false, 64, 512 << 10);
    side_init(&D, "push-D", "tcp,self", KVC_PROTO_AUTO, 1, false, 64, 512 << 10);
    uint64_t ids[48], lids[48];
    for (int i = 0; i < 48; i++) {
        ids[i] = (uint64_t)i;
        lids[i] = (uint64_t)i + 8;
        fill(&P, ids[i], 0x10);
    }
    char *json = publish(&P, "pushed", ids, 48, NULL);
    uint64_t id = fetch(&D, json, lids, 48);
    PUMP_UNTIL(&P, &D, P.a->push_inflight > 0, 10000);
    if (by_expiry) {
        kvc_pub_t *pub = kvc_pubtab_find(&P.a->pubs, "pushed", 6);
        assert_non_null(pub);
        pub->deadline_ns = kvc_now_ns(); /* expires on the next progress */
    } else {
        assert_int_equal(kvc_unpublish(P.a, "pushed"), KVC_INPROGRESS);
    }
    kvc_event_type_t want = by_expiry ? KVC_EV_EXPIRED : KVC_EV_RELEASED;
    PUMP_UNTIL(&P, &D, find_ev(&P, want, "pushed") && fetch_ev(&D, id), 20000);
    /* The engine got its blocks back only when no push read them. */
    assert_int_equal(find_ev(&P, want, "pushed")->push_inflight, 0);
    const rec_t *ev = fetch_ev(&D, id);
    assert_int_equal(ev->type, KVC_EV_FETCH_DONE);
    for (int i = 0; i < 48; i++)
        assert_true(holds(&D, lids[i], 0x10));
    kvc_free(json);
    side_cleanup(&D);
    side_cleanup(&P);
}

static void test_push_unpublish_waits(void **state) {
    push_release(false);
}

static void test_push_expiry_waits(void **state) {
    push_release(true);
}

/* --------------------------------------- item 6: nothing after FAILED -- */

/* A producer whose push sends the requested runs as rendezvous messages,
 * then one message for a block nobody asked for (a data error). */
static int evil_sends;
static uint8_t evil_hdr[8][KVC_WIRE_DATA_HDR_LEN];

static void evil_cb(void *req, ucs_status_t us, void *ud) {
    evil_sends--;
    ucp_request_free(req);
}

static ucs_status_t evil_pull_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                                 const ucp_am_recv_param_t *param) {
    kvc_agent_t *a = arg;
    kvc_wire_pull_t pl;
    if (kvc_wire_parse_pull(data, len, &pl) != KVC_OK || pl.n != 1) return UCS_OK;
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = evil_cb;
    int k = 0;
    for (uint32_t r = 0; r < a->n_regions; r++, k++) {
        kvc_region_t *rg = &a->regions[r];
        kvc_wire_data_hdr_t h = {pl.xfer_id, r, 0, pl.runs[0].local, pl.runs[0].count, {0}};
        memcpy(h.token, pl.xfer_token, KVC_TOKEN_LEN);
        kvc_wire_encode_data_hdr(evil_hdr[k], &h);
        rp.flags = UCP_AM_SEND_FLAG_RNDV;
        ucs_status_ptr_t s =
            ucp_am_send_nbx(param->reply_ep, KVC_AM_DATA, evil_hdr[k], KVC_WIRE_DATA_HDR_LEN,
                            (uint8_t *)rg->base + pl.runs[0].remote * rg->block_len,
                            pl.runs[0].count * rg->block_len, &rp);
        if (UCS_PTR_IS_PTR(s)) evil_sends++;
    }
    /* Block 0 was not asked for. */
    kvc_wire_data_hdr_t h = {pl.xfer_id, 0, 0, 0, 1, {0}};
    memcpy(h.token, pl.xfer_token, KVC_TOKEN_LEN);
    kvc_wire_encode_data_hdr(evil_hdr[k], &h);
    rp.flags = UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t s =
        ucp_am_send_nbx(param->reply_ep, KVC_AM_DATA, evil_hdr[k], KVC_WIRE_DATA_HDR_LEN,
                        a->regions[0].base, a->regions[0].block_len, &rp);
    if (UCS_PTR_IS_PTR(s)) evil_sends++;
    free(pl.runs);
    return UCS_OK;
}

static void test_no_write_after_failed(void **state) {
    side_t P, D;
    side_init(&P, "evil-P", "tcp,self", KVC_PROTO_AUTO, 1, false, 64, 1 << 20);
    side_init(&D, "evil-D", "tcp,self", KVC_PROTO_AUTO, 1, false, 64, 1 << 20);
    assert_int_equal(kvc_set_am_handler(P.a, KVC_AM_PULL, evil_pull_cb), KVC_OK);
    uint64_t ids[32], lids[32];
    for (int i = 0; i < 32; i++) {
        ids[i] = (uint64_t)i + 1;
        lids[i] = (uint64_t)i + 1;
        fill(&P, ids[i], 0x55);
    }
    char *json = publish(&P, "evil", ids, 32, NULL);
    uint64_t id = fetch(&D, json, lids, 32);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, id), 20000);
    const rec_t *ev = fetch_ev(&D, id);
    assert_int_equal(ev->type, KVC_EV_FETCH_FAILED);
    assert_int_equal(ev->st, KVC_ERR_PROTOCOL);
    uint64_t at_event = checksum(&D);
    /* Let everything the producer sent finish (or be refused). */
    PUMP_UNTIL(&P, &D, evil_sends == 0, 20000);
    for (int i = 0; i < 200; i++) {
        pump_once(&P);
        pump_once(&D);
    }
    assert_true(checksum(&D) == at_event);
    kvc_free(json);
    side_cleanup(&D);
    side_cleanup(&P);
}

/* ------------------------------------------------ item 7: TP fan-in -- */

/* A TP-16 decode reading from a TP-1 prefill: 16 consumers, no count, all
 * pulling before the first of them notifies (as the ranks of one decode
 * step do). */
static int fetches_done(const side_t *D, const uint64_t *xid, int n) {
    int k = 0;
    for (int i = 0; i < n; i++)
        k += fetch_ev(D, xid[i]) != NULL;
    return k;
}

static void test_fan_in_16(void **state) {
    side_t P, D;
    side_init(&P, "fan-P", "tcp,self", KVC_PROTO_AUTO, 1, false, 64, 4096);
    side_init(&D, "fan-D", "tcp,self", KVC_PROTO_AUTO, 16, false, 64, 4096);
    uint64_t ids[] = {1, 2, 3}, xid[16];
    fill(&P, 1, 1);
    fill(&P, 2, 2);
    fill(&P, 3, 3);
    char *json = publish(&P, "fan", ids, 3, NULL);
    for (int rank = 0; rank < 16; rank++) {
        uint64_t lids[] = {(uint64_t)rank * 3 + 10, (uint64_t)rank * 3 + 11,
                           (uint64_t)rank * 3 + 12};
        xid[rank] = fetch(&D, json, lids, 3);
    }
    PUMP_UNTIL(&P, &D, fetches_done(&D, xid, 16) == 16, 20000);
    for (int rank = 0; rank < 16; rank++) {
        const rec_t *ev = fetch_ev(&D, xid[rank]);
        assert_int_equal(ev->type, KVC_EV_FETCH_DONE);
        assert_true(holds(&D, (uint64_t)rank * 3 + 10, 1) && holds(&D, (uint64_t)rank * 3 + 12, 3));
    }
    PUMP_UNTIL(&P, &D, find_ev(&P, KVC_EV_RELEASED, "fan"), 5000);
    uint64_t v;
    assert_int_equal(kvc_agent_stat(P.a, KVC_STAT_DENIED, &v), KVC_OK);
    assert_int_equal(v, 0);
    kvc_free(json);
    side_cleanup(&D);
    side_cleanup(&P);
}

/* ------------------------------------- item 9: GET it cannot be served -- */

static void test_get_unsupported(void **state) {
    side_t P, D;
    side_init(&P, "plain-P", "tcp,self", KVC_PROTO_AUTO, 1, false, 16, 4096);
    side_init(&D, "get-D", "tcp,self", KVC_PROTO_GET, 1, false, 16, 4096);
    uint64_t ids[] = {1}, lids[] = {2};
    char *json = publish(&P, "g", ids, 1, NULL);
    uint64_t t0 = kvc_now_ns();
    uint64_t id = fetch(&D, json, lids, 1);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, id), 5000); /* not the 30 s transfer timeout */
    const rec_t *ev = fetch_ev(&D, id);
    assert_int_equal(ev->type, KVC_EV_FETCH_FAILED);
    assert_int_equal(ev->st, KVC_ERR_UNSUPPORTED);
    assert_non_null(strstr(ev->msg, "one-sided"));
    assert_true(kvc_now_ns() - t0 < 5000000000ull);
    kvc_free(json);
    side_cleanup(&D);
    side_cleanup(&P);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_late_read_pool),        cmocka_unit_test(test_hold_defers_release),
        cmocka_unit_test(test_push_unpublish_waits),  cmocka_unit_test(test_push_expiry_waits),
        cmocka_unit_test(test_no_write_after_failed), cmocka_unit_test(test_fan_in_16),
        cmocka_unit_test(test_get_unsupported),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
