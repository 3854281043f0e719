/* Unit test: the CUDA staging flow of libkvconnector without a GPU.  The CUDA
 * layer (cuda.c's interface) is replaced here by a fake whose "device"
 * memory is host memory and whose copies are memcpy, counted; the library is
 * linked from its core sources (kvc_fakecuda, tests only).  Checks that the
 * producer stages device->mirror at publish, that the consumer copies
 * mirror->device before FETCH_DONE, only for the fetched blocks. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "kvc_int.h"

/* ------------------------------------------------------------ fake CUDA -- */
struct kvc_cuda {
    int device;
};
static size_t copies_d2h, copies_h2d, syncs;

bool kvc_cuda_built(void) {
    return true;
}
kvc_status_t kvc_cuda_create(int device, kvc_cuda_t **out, char *err, size_t errlen) {
    kvc_cuda_t *c = calloc(1, sizeof(*c));
    if (!c) return KVC_ERR_NO_MEMORY;
    c->device = device;
    *out = c;
    return KVC_OK;
}
void kvc_cuda_destroy(kvc_cuda_t *c) {
    free(c);
}
kvc_status_t kvc_cuda_host_register(kvc_cuda_t *c, void *p, size_t len) {
    return KVC_OK;
}
void kvc_cuda_host_unregister(kvc_cuda_t *c, void *p) {}
kvc_status_t kvc_cuda_copy_blocks(kvc_cuda_t *c, void *dev, void *host, size_t block_len,
                                  const uint64_t *ids, size_t n, bool to_device) {
    for (size_t i = 0; i < n; i++) {
        uint8_t *d = (uint8_t *)dev + ids[i] * block_len, *h = (uint8_t *)host + ids[i] * block_len;
        if (to_device) {
            memcpy(d, h, block_len);
            copies_h2d++;
        } else {
            memcpy(h, d, block_len);
            copies_d2h++;
        }
    }
    return KVC_OK;
}
kvc_status_t kvc_cuda_sync(kvc_cuda_t *c) {
    syncs++;
    return KVC_OK;
}

/* ----------------------------------------------------------------- test -- */
#define NB 32
#define BL 8192

static kvc_agent_t *mk(const char *name, uint8_t *dev[2]) {
    kvc_agent_params_t ap = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID, .engine_id = name};
    kvc_agent_t *a;
    assert_int_equal(kvc_agent_create(&ap, &a), KVC_OK);
    kvc_region_params_t rp[2];
    for (int r = 0; r < 2; r++) {
        rp[r] =
            (kvc_region_params_t){.field_mask = KVC_REGION_FIELD_BASE | KVC_REGION_FIELD_MEM_TYPE,
                                  .len = NB * BL,
                                  .base = dev[r],
                                  .mem_type = KVC_MEM_CUDA};
    }
    assert_int_equal(kvc_agent_register_regions(a, NB, rp, 2), KVC_OK);
    void *b;
    assert_int_equal(kvc_region_base(a, 1, &b), KVC_OK);
    assert_ptr_equal(b, dev[1]); /* the "device" base, not the mirror */
    return a;
}

static void test_staged_roundtrip(void **state) {
    uint8_t *pd[2], *dd[2];
    for (int r = 0; r < 2; r++) {
        pd[r] = malloc(NB * BL);
        dd[r] = calloc(1, NB * BL);
        for (size_t i = 0; i < NB * BL; i++)
            pd[r][i] = (uint8_t)(i * 7 + r * 3 + i / BL);
    }
    kvc_agent_t *P = mk("stage-P", pd), *D = mk("stage-D", dd);
    uint64_t rem[] = {4, 5, 6, 20}, loc[] = {0, 1, 2, 31};
    char *json;
    assert_int_equal(kvc_publish(P, "s:1", rem, 4, NULL, &json), KVC_OK);
    assert_int_equal(copies_d2h, 8); /* 4 blocks x 2 regions, before publish returned */
    assert_true(syncs >= 1);
    kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS,
                             .kv_transfer_params_json = json,
                             .local_block_ids = loc,
                             .num_local_blocks = 4};
    uint64_t xid;
    assert_int_equal(kvc_fetch(D, &fp, &xid), KVC_INPROGRESS);
    kvc_free(json);
    int done = 0, released = 0;
    uint64_t t0 = kvc_now_ns();
    while (!(done && released)) {
        assert_true(kvc_now_ns() - t0 < 10000000000ull);
        kvc_agent_progress(P);
        kvc_agent_progress(D);
        kvc_event_t ev;
        while (kvc_agent_next_event(D, &ev) == KVC_OK) {
            assert_int_equal(ev.type, KVC_EV_FETCH_DONE);
            assert_int_equal(copies_h2d, 8); /* device filled before completion */
            done = 1;
        }
        while (kvc_agent_next_event(P, &ev) == KVC_OK)
            released |= ev.type == KVC_EV_RELEASED;
    }
    for (int r = 0; r < 2; r++) {
        for (int k = 0; k < 4; k++)
            assert_memory_equal(dd[r] + loc[k] * BL, pd[r] + rem[k] * BL, BL);
        assert_int_equal(dd[r][10 * BL], 0); /* untouched block */
    }
    kvc_agent_destroy(D);
    kvc_agent_destroy(P);
    for (int r = 0; r < 2; r++) {
        free(pd[r]);
        free(dd[r]);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_staged_roundtrip)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
