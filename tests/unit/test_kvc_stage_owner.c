/* SPDX-License-Identifier: Apache-2.0 */
/* Unit test: a staged producer (CUDA regions through the pinned pool,
 * against the CUDA stand-in of tests/cudasim) and a consumer without an
 * endpoint of the producer's own (KVC_HFLAG_OWNER left out of its HELLO,
 * pulls without KVC_PULL_CONS).  A staged push sends its chunks after the
 * pull's callback returned; a producer that kept UCX's reply endpoint for
 * them sent on an endpoint UCX destroyed when that consumer left.  Such a
 * pull is refused in its callback (KVC_ERR_UNSUPPORTED). */
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

static void test_staged_pull_without_owner(void **state) {
    (void)state;
    for (int round = 0; round < 2; round++) {
        cudasim_reset(1, true);
        setenv("UCX_TLS", "tcp,self", 1);
        setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
        kvc_agent_params_t ap = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID |
                                               KVC_AGENT_FIELD_PROGRESS_THREAD |
                                               KVC_AGENT_FIELD_STAGING_POOL,
                                 .engine_id = "stage-P",
                                 .progress_thread = 1,
                                 .staging_pool_bytes = 2 * BL};
        kvc_agent_t *P;
        assert_int_equal(kvc_agent_create(&ap, &P), KVC_OK);
        void *dev;
        assert_int_equal(cudaMalloc(&dev, (size_t)NB * BL), cudaSuccess);
        kvc_region_params_t rp = {.field_mask = KVC_REGION_FIELD_BASE | KVC_REGION_FIELD_MEM_TYPE,
                                  .len = (size_t)NB * BL,
                                  .base = dev,
                                  .mem_type = KVC_MEM_CUDA};
        assert_int_equal(kvc_agent_register_regions(P, NB, &rp, 1), KVC_OK);
        char tok[33];
        assert_int_equal(kvc_token_new(tok), KVC_OK);
        uint64_t ids[NB];
        for (uint64_t i = 0; i < NB; i++)
            ids[i] = i;
        kvc_publish_params_t pp = {.field_mask = KVC_PUBLISH_FIELD_TOKEN, .kv_token = tok};
        char *json = NULL;
        assert_int_equal(kvc_publish(P, "staged", ids, NB, &pp, &json), KVC_OK);
        kvc_free(json);
        uint16_t port;
        assert_int_equal(kvc_agent_get_port(P, &port), KVC_OK);

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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_staged_pull_without_owner),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
