/* SPDX-License-Identifier: Apache-2.0 */
/* Unit test: a staged producer (CUDA regions through the pinned pool,
 * against the CUDA stand-in of tests/cudasim) and a consumer without an
 * endpoint of the producer's own (KVC_HFLAG_OWNER left out of its HELLO,
 * pulls without KVC_PULL_CONS).  A staged push sends its chunks after the
 * pull's callback returned; a producer that kept UCX's reply endpoint for
 * them sent on an endpoint UCX destroyed when that consumer left.  Such a
 * pull is refused in its callback (KVC_ERR_UNSUPPORTED).
 * And a consumer that maps the producer's pool (staged-shm) but never hands
 * a lent slot back, alive or dead: the producer takes its slots back at its
 * xfer timeout and fails that pull (KVC_ERR_TIMED_OUT); the next consumer
 * gets every chunk through the same two slots, after a hostile peer's
 * malformed READY, POOL and SLOT messages were refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include "tests/cudasim/cudasim.h"
#include "tests/unit/kvc_rawpeer.h"

#define NB 64
#define BL (256 << 10)

/* A staged producer P (progress thread; a pool of two slots of a pushed
 * chunk; xfer timeout ms, 0: the default) with one CUDA region of NB
 * blocks in *dev, all published as "staged" under *tok; its port. */
static kvc_agent_t *staged_producer(uint32_t xfer_timeout_ms, void **dev, char tok[33],
                                    uint16_t *port) {
    cudasim_reset(1, true);
    setenv("UCX_TLS", "tcp,self", 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    kvc_agent_params_t ap = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID |
                                           KVC_AGENT_FIELD_PROGRESS_THREAD |
                                           KVC_AGENT_FIELD_STAGING_POOL |
                                           (xfer_timeout_ms ? KVC_AGENT_FIELD_XFER_TIMEOUT : 0),
                             .engine_id = "stage-P",
                             .progress_thread = 1,
                             .staging_pool_bytes = 2 * BL,
                             .xfer_timeout_ms = xfer_timeout_ms};
    kvc_agent_t *P;
    assert_int_equal(kvc_agent_create(&ap, &P), KVC_OK);
    assert_int_equal(cudaMalloc(dev, (size_t)NB * BL), cudaSuccess);
    kvc_region_params_t rp = {.field_mask = KVC_REGION_FIELD_BASE | KVC_REGION_FIELD_MEM_TYPE,
                              .len = (size_t)NB * BL,
                              .base = *dev,
                              .mem_type = KVC_MEM_CUDA};
    assert_int_equal(kvc_agent_register_regions(P, NB, &rp, 1), KVC_OK);
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t ids[NB];
    for (uint64_t i = 0; i < NB; i++)
        ids[i] = i;
    kvc_publish_params_t pp = {.field_mask = KVC_PUBLISH_FIELD_TOKEN, .kv_token = tok};
    char *json = NULL;
    assert_int_equal(kvc_publish(P, "staged", ids, NB, &pp, &json), KVC_OK);
    kvc_free(json);
    assert_int_equal(kvc_agent_get_port(P, port), KVC_OK);
    return P;
}

static void test_staged_pull_without_owner(void **state) {
    (void)state;
    for (int round = 0; round < 2; round++) {
        void *dev;
        char tok[33];
        uint16_t port;
        kvc_agent_t *P = staged_producer(0, &dev, tok, &port);

        raw_t r;
        raw_up(&r, NULL);
        assert_int_equal(raw_handshake(&r, port, NULL, false, 0), KVC_OK);
        raw_connect(&r);
        /* All 64 blocks, twice: 32 MiB through a pool of two slots. */
        raw_pull(&r, 1, "staged", tok, 0, 0, 0, 0, 0, NB);
        raw_pull(&r, 2, "staged", tok, 0, 0, 0, 0, 0, NB);
        /* Refused at once, or (what this guards against) pushed. */
        RAW_UNTIL(&r, r.refusals == 2 || r.data > 0, 10000);
        int refusals = r.refusals, data = r.data;
        int32_t why = r.last_refusal;
        raw_leave(&r, round == 1); /* dies mid-push, or closes its endpoint first */
        /* The producer goes on: what it still owed that consumer is dropped,
         * never sent on an endpoint UCX destroyed; the blocks come back once
         * nothing reads them. */
        kvc_status_t st = kvc_unpublish(P, "staged");
        assert_true(st == KVC_OK || st == KVC_INPROGRESS);
        uint64_t t0 = kvc_now_ns();
        for (bool back = st == KVC_OK; !back;) {
            assert_true(kvc_now_ns() - t0 < 20000000000ull);
            usleep(2000);
            kvc_event_t ev;
            while (kvc_agent_next_event(P, &ev) == KVC_OK)
                back |= ev.type == KVC_EV_RELEASED;
        }
        assert_int_equal(refusals, 2);
        assert_int_equal(data, 0);
        assert_int_equal(why, KVC_ERR_UNSUPPORTED);
        kvc_agent_destroy(P);
        assert_int_equal(cudaFree(dev), cudaSuccess);
    }
}

/* ------------------------------------------- lent slots never returned -- */

/* What the raw consumer got of the staged-shm messages (AM callbacks only
 * record; the SLOT answers go from the test's loop). */
static struct {
    int pools, readies;
    uint64_t xid;
    uint8_t token[KVC_TOKEN_LEN];
    uint64_t offs[64];
    int n_offs;
} shm;

static ucs_status_t on_pool(void *arg, const void *header, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *param) {
    (void)arg, (void)data, (void)param;
    kvc_wire_pool_t pl;
    if (kvc_wire_parse_pool(header, hlen, len, &pl) == KVC_OK) {
        shm.pools++;
        shm.xid = pl.h.xfer_id;
        memcpy(shm.token, pl.h.token, KVC_TOKEN_LEN);
    }
    return UCS_OK;
}

static ucs_status_t on_ready(void *arg, const void *header, size_t hlen, void *data, size_t len,
                             const ucp_am_recv_param_t *param) {
    (void)arg, (void)data, (void)len, (void)param;
    kvc_wire_ready_t rm;
    if (kvc_wire_parse_ready(header, hlen, &rm) == KVC_OK && shm.n_offs < 64) {
        shm.readies++;
        shm.offs[shm.n_offs++] = rm.off;
    }
    return UCS_OK;
}

/* One SLOT message (POOL_OK, or FREE of a lent slot) to the producer. */
static void raw_slot(raw_t *r, uint32_t kind, uint64_t off) {
    kvc_wire_slot_t m = {shm.xid, {0}, kind, off};
    memcpy(m.token, shm.token, KVC_TOKEN_LEN);
    uint8_t hdr[KVC_WIRE_SLOT_LEN];
    kvc_wire_encode_slot(hdr, &m);
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_AM_SEND_FLAG_EAGER};
    ucs_status_ptr_t q = ucp_am_send_nbx(r->ep, KVC_AM_SLOT, hdr, sizeof(hdr), NULL, 0, &rp);
    if (UCS_PTR_IS_PTR(q)) {
        RAW_UNTIL(r, ucp_request_check_status(q) != UCS_INPROGRESS, 5000);
        ucp_request_free(q);
    }
}

/* One active message id from the raw peer: header bytes, data (rendezvous
 * when rndv); waits until it went. */
static void raw_am(raw_t *r, unsigned id, const void *hdr, size_t hlen, const void *data,
                   size_t len, bool rndv) {
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = rndv ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER};
    ucs_status_ptr_t q = ucp_am_send_nbx(r->ep, id, hdr, hlen, data, len, &rp);
    if (UCS_PTR_IS_PTR(q)) {
        RAW_UNTIL(r, ucp_request_check_status(q) != UCS_INPROGRESS, 5000);
        ucp_request_free(q);
    }
}

/* A hostile peer's staged-shm messages to P (a consumer too: its READY
 * and POOL handlers run on the same worker): every length around the
 * right one, garbage, rendezvous; refused, nothing crashes or is counted
 * as a SLOT for a job, and a well-formed SLOT for no job is DENIED. */
static void hostile_staged(kvc_agent_t *P, uint16_t port) {
    raw_t r;
    raw_up(&r, NULL);
    assert_int_equal(raw_handshake(&r, port, NULL, false, 0), KVC_OK);
    raw_connect(&r);
    uint64_t denied0 = 0, denied = 0;
    assert_int_equal(kvc_agent_stat(P, KVC_STAT_DENIED, &denied0), KVC_OK);
    static uint8_t junk[256 << 10];
    memset(junk, 0xff, sizeof(junk));
    static const unsigned ids[] = {KVC_AM_SLOT, KVC_AM_READY, KVC_AM_POOL};
    for (int k = 0; k < 3; k++)
        for (size_t n = 0; n <= KVC_WIRE_POOL_LEN + 8; n += 3) {
            raw_am(&r, ids[k], junk, n, NULL, 0, false);
            raw_am(&r, ids[k], junk, n, junk, n * 7, false);
        }
    for (int k = 0; k < 3; k++) /* oversized, as rendezvous */
        raw_am(&r, ids[k], junk, KVC_WIRE_SLOT_LEN, junk, sizeof(junk), true);
    kvc_wire_slot_t m = {999, {1}, KVC_SLOT_FREE, 0};
    uint8_t hdr[KVC_WIRE_SLOT_LEN];
    kvc_wire_encode_slot(hdr, &m);
    raw_am(&r, KVC_AM_SLOT, hdr, sizeof(hdr), NULL, 0, false);
    for (uint64_t t0 = kvc_now_ns(); denied == denied0;) {
        assert_true(kvc_now_ns() - t0 < 5000000000ull);
        ucp_worker_progress(r.w);
        assert_int_equal(kvc_agent_stat(P, KVC_STAT_DENIED, &denied), KVC_OK);
    }
    assert_int_equal(denied, denied0 + 1);
    raw_leave(&r, true);
}

/* A consumer of P's pool (owner endpoint, KVC_PULL_SHM) pulling all NB
 * blocks as fetch xid: the pool offer is accepted; `free_slots`: each lent
 * slot is handed back, until the END; else none is, and the pull must end
 * in P's refusal within timeout_ms.  Leaves (dies) when `die`. */
static void shm_pull(raw_t *r, uint16_t port, const char *tok, uint64_t xid, bool free_slots,
                     bool die, int timeout_ms) {
    static uint64_t key = 0x1000;
    memset(&shm, 0, sizeof(shm));
    raw_up(r, NULL);
    r->hello_flags |= KVC_HFLAG_OWNER;
    raw_handler(r, KVC_AM_POOL, on_pool);
    raw_handler(r, KVC_AM_READY, on_ready);
    assert_int_equal(raw_handshake(r, port, NULL, true, ++key), KVC_OK);
    raw_connect(r);
    raw_pull(r, xid, "staged", tok, KVC_PULL_CONS | KVC_PULL_SHM | KVC_PULL_RNDV, 0, key, 0, 0,
             NB);
    RAW_UNTIL(r, shm.pools == 1, 5000);
    raw_slot(r, KVC_SLOT_POOL_OK, 0);
    if (die) { /* dies holding what it was lent */
        RAW_UNTIL(r, shm.readies > 0, 5000);
        raw_leave(r, false);
        return;
    }
    uint64_t t0 = kvc_now_ns();
    for (int freed = 0; r->ends + r->refusals == 0;) {
        assert_true(kvc_now_ns() - t0 < (uint64_t)timeout_ms * 1000000ull);
        ucp_worker_progress(r->w);
        for (; free_slots && freed < shm.n_offs; freed++)
            raw_slot(r, KVC_SLOT_FREE, shm.offs[freed]);
    }
}

static void test_lent_slot_reclaimed(void **state) {
    (void)state;
    void *dev;
    char tok[33];
    uint16_t port;
    kvc_agent_t *P = staged_producer(400, &dev, tok, &port);

    /* Alive but silent: both slots lent, neither handed back; refused at
     * the 400 ms xfer timeout, nothing more lent meanwhile. */
    raw_t r;
    shm_pull(&r, port, tok, 1, false, false, 5000);
    assert_int_equal(r.refusals, 1);
    assert_int_equal(r.last_refusal, KVC_ERR_TIMED_OUT);
    assert_int_equal(r.ends, 0);
    assert_int_equal(shm.readies, 2);
    raw_leave(&r, true);
    /* Dead while holding its slots. */
    shm_pull(&r, port, tok, 2, false, true, 5000);
    hostile_staged(P, port);
    /* The next consumer gets every chunk (16 MiB through the two 4 MiB
     * slots): the slots came back both times. */
    shm_pull(&r, port, tok, 3, true, false, 10000);
    assert_int_equal(r.refusals, 0);
    assert_int_equal(r.ends, 1);
    assert_int_equal(shm.readies, (int)(NB * BL / (4u << 20)));
    raw_leave(&r, true);
    kvc_agent_destroy(P);
    assert_int_equal(cudaFree(dev), cudaSuccess);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_staged_pull_without_owner),
        cmocka_unit_test(test_lent_slot_reclaimed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
