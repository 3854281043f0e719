/* SPDX-License-Identifier: Apache-2.0 */
/* Unit test: driving agents from libevent exactly as kvconnector.h shows —
 * one EV_READ|EV_PERSIST event per agent fd, kvc_agent_progress() in the
 * callback, no polling timers.  A producer and a consumer agent share one
 * event_base; a missed wakeup shows up as the 10 s watchdog firing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <event2/event.h>
#include <stdlib.h>
#include <string.h>

#include "include/kvconnector.h"

typedef struct {
    struct event_base *base;
    kvc_agent_t *P, *D;
    int done, released, failed, callbacks;
    char *json;
} ctx_t;

static void on_kvc(evutil_socket_t fd, short what, void *arg) {
    ctx_t *c = arg;
    c->callbacks++;
    for (int i = 0; i < 2; i++) {
        kvc_agent_t *a = i ? c->D : c->P;
        kvc_event_t ev;
        kvc_agent_progress(a);
        while (kvc_agent_next_event(a, &ev) == KVC_OK) {
            c->done += ev.type == KVC_EV_FETCH_DONE;
            c->failed += ev.type == KVC_EV_FETCH_FAILED;
            c->released += ev.type == KVC_EV_RELEASED;
        }
    }
    if ((c->done || c->failed) && c->released) event_base_loopbreak(c->base);
}

static void on_watchdog(evutil_socket_t fd, short what, void *arg) {
    event_base_loopbreak(((ctx_t *)arg)->base);
}

static kvc_agent_t *mk(const char *name) {
    kvc_agent_params_t ap = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID, .engine_id = name};
    kvc_agent_t *a;
    assert_int_equal(kvc_agent_create(&ap, &a), KVC_OK);
    kvc_region_params_t rp = {.len = 64 * 4096};
    assert_int_equal(kvc_agent_register_regions(a, 64, &rp, 1), KVC_OK);
    return a;
}

static void test_libevent_drive(void **state) {
    ctx_t c = {0};
    c.base = event_base_new();
    c.P = mk("ev-P");
    c.D = mk("ev-D");
    void *pb, *db;
    kvc_region_base(c.P, 0, &pb);
    kvc_region_base(c.D, 0, &db);
    memset(pb, 0x5a, 64 * 4096);
    int pfd, dfd;
    kvc_agent_get_fd(c.P, &pfd);
    kvc_agent_get_fd(c.D, &dfd);
    struct event *pe = event_new(c.base, pfd, EV_READ | EV_PERSIST, on_kvc, &c);
    struct event *de = event_new(c.base, dfd, EV_READ | EV_PERSIST, on_kvc, &c);
    struct event *wd = evtimer_new(c.base, on_watchdog, &c);
    struct timeval tv = {10, 0};
    event_add(pe, NULL);
    event_add(de, NULL);
    evtimer_add(wd, &tv);

    uint64_t blocks[] = {1, 2, 3, 40}, local[] = {7, 8, 9, 10};
    assert_int_equal(kvc_publish(c.P, "ev:1", blocks, 4, NULL, &c.json), KVC_OK);
    kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS,
                             .kv_transfer_params_json = c.json,
                             .local_block_ids = local,
                             .num_local_blocks = 4};
    uint64_t xid;
    assert_int_equal(kvc_fetch(c.D, &fp, &xid), KVC_INPROGRESS);
    event_base_dispatch(c.base);

    assert_int_equal(c.failed, 0);
    assert_int_equal(c.done, 1);
    assert_int_equal(c.released, 1);
    assert_int_equal(((uint8_t *)db)[7 * 4096], 0x5a);
    assert_int_equal(((uint8_t *)db)[11 * 4096 - 1], 0x5a);
    assert_int_equal(((uint8_t *)db)[11 * 4096], 0);

    event_free(pe);
    event_free(de);
    event_free(wd);
    kvc_free(c.json);
    kvc_agent_destroy(c.D);
    kvc_agent_destroy(c.P);
    event_base_free(c.base);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_libevent_drive)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
