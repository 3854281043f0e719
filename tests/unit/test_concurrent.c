/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h> /* after what it uses */

#include <event2/event.h>

#include "proxy/concurrent.h"

/* The concurrent prefill leg on legs that never reach an engine: its
 * callbacks are called as the transfer would call them, and what it tells
 * its owner is recorded. */

static const char KVP_PUSH[] =
    "{\"remote_engine_id\":\"eng-1\",\"remote_host\":\"10.0.0.7\",\"remote_port\":5601,"
    "\"tp_size\":1,\"transfer_mode\":\"push\"}";

typedef struct owner {
    int account, over, rejected, failed;
    px_up_result rc;
} owner;

static void o_account(void *arg) {
    ((owner *)arg)->account++;
}
static void o_over(void *arg) {
    ((owner *)arg)->over++;
}
static void o_rejected(void *arg) {
    ((owner *)arg)->rejected++;
}
static void o_failed(void *arg, px_up_result rc, const char *why) {
    ((owner *)arg)->failed++;
    ((owner *)arg)->rc = rc;
}
static const px_conc_ops ops = {o_account, o_over, o_rejected, o_failed};

/* The request's side: the legs start with the serial prefill's table. */
static void serial_done(void *arg, px_up_result rc, const char *why, int connected) {
    fail_msg("the serial table was called");
}
static const px_leg_cbs serial_cbs = {.done = serial_done};

typedef struct fixture {
    px_config cfg;
    px_registry reg;
    px_ctx ctx;
    px_wctx w;
    px_leg pre, dec;
    px_reqlog log;
    char cached[24];
    owner o;
    px_conc c;
    char pname[16];
    px_backend pb;
} fixture;

static int setup(void **state) {
    fixture *f = test_calloc(1, sizeof *f);
    f->cfg.usage_from = "decode";
    f->reg.identities = px_pf_cache_create();
    f->ctx.cfg = &f->cfg;
    f->ctx.reg = &f->reg;
    f->w.ctx = &f->ctx;
    f->w.base = event_base_new();
    snprintf(f->log.lid, sizeof f->log.lid, "r1");
    f->log.t0 = px_now_ns();
    px_leg_init(&f->pre, PX_LEG_PREFILL, &f->w, &serial_cbs, &f->o, f->log.lid);
    px_leg_init(&f->dec, PX_LEG_DECODE, &f->w, &serial_cbs, &f->o, f->log.lid);
    snprintf(f->pname, sizeof f->pname, "p1:8000");
    f->pb.name = f->pname;
    snprintf(f->pre.name, sizeof f->pre.name, "p1:8000");
    px_conc_init(&f->c, &ops, &f->o, &f->pre, &f->dec, &f->log, f->cached);
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    f->pre.b = NULL; /* borrowed from the fixture: never handed back */
    px_leg_cleanup(&f->pre);
    px_leg_cleanup(&f->dec);
    px_pf_cache_destroy(f->reg.identities);
    event_base_free(f->w.base);
    test_free(f);
    return 0;
}

static void set(px_buf *b, const char *s) {
    px_buf_reset(b);
    px_buf_append(b, s, strlen(s));
}

/* Concurrent, with the leg taken over. */
static void go_concurrent(fixture *f) {
    assert_int_equal(px_dispatch_learn(f->reg.identities, "p1:8000", KVP_PUSH, strlen(KVP_PUSH)),
                     0);
    f->pre.b = &f->pb;
    px_buf client;
    px_buf_init(&client);
    set(&client, "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":9}");
    set(&f->pre.body, "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":1}");
    assert_int_equal(px_conc_dispatch(&f->c, PX_DISPATCH_CONCURRENT, "xfer-1", &client),
                     PX_DISP_CONCURRENT);
    px_buf_cleanup(&client);
    f->pre.b = NULL;
    f->pre.beside = 1;
}

/* Unknown identity: serial, the leg left to the request; known and
 * pushing: concurrent, both bodies built, the leg reports here. */
static void test_dispatch(void **state) {
    fixture *f = *state;
    px_buf client;
    px_buf_init(&client);
    set(&client, "{\"model\":\"m\",\"prompt\":\"hi\"}");
    f->pre.b = &f->pb;
    assert_int_equal(px_conc_dispatch(&f->c, PX_DISPATCH_SERIAL, "xfer-1", &client),
                     PX_DISP_SERIAL);
    assert_int_equal(px_conc_dispatch(&f->c, PX_DISPATCH_CONCURRENT, "xfer-1", &client),
                     PX_DISP_NO_IDENTITY);
    assert_ptr_equal(f->pre.cbs, &serial_cbs);
    assert_ptr_equal(f->pre.owner, &f->o);
    assert_int_equal(f->o.account, 0);
    px_buf_cleanup(&client);
    go_concurrent(f);
    assert_ptr_not_equal(f->pre.cbs, &serial_cbs);
    assert_ptr_equal(f->pre.owner, &f->c);
    assert_int_equal(f->o.account, 1);
    assert_non_null(strstr(f->dec.body.data, "xfer-1"));
    assert_non_null(strstr(f->pre.body.data, "xfer-1"));
}

/* Decode answered in full: the leg is let end; its answer (or the grace)
 * ends the request, a good one teaching the identity again. */
static void test_await(void **state) {
    fixture *f = *state;
    go_concurrent(f);
    px_dispatch_forget(f->reg.identities, "p1:8000");
    px_conc_await(&f->c);
    assert_int_equal(f->pre.beside, 0);
    f->pre.status = 200;
    char answer[400];
    snprintf(answer, sizeof answer, "{\"kv_transfer_params\":%s}", KVP_PUSH);
    set(&f->pre.resp, answer);
    f->pre.cbs->done(f->pre.owner, PX_UP_OK, "", 1);
    assert_int_equal(f->o.over, 1);
    px_pf_identity id;
    assert_int_equal(px_dispatch_get(f->reg.identities, "p1:8000", &id), 1);
    /* A failed answer ends it too, without a word about decode. */
    f->pre.status = 503;
    f->pre.cbs->done(f->pre.owner, PX_UP_OK, "", 1);
    assert_int_equal(f->o.over, 2);
    assert_int_equal(f->o.failed + f->o.rejected, 0);
    f->pre.cbs->grace(f->pre.owner);
    assert_int_equal(f->o.over, 3);
}

/* Prefill answered while decode streams: the identity is taught again,
 * the request goes on. */
static void test_answer_while_decoding(void **state) {
    fixture *f = *state;
    go_concurrent(f);
    px_dispatch_forget(f->reg.identities, "p1:8000");
    f->pre.status = 200;
    char answer[400];
    snprintf(answer, sizeof answer, "{\"kv_transfer_params\":%s}", KVP_PUSH);
    set(&f->pre.resp, answer);
    f->pre.cbs->done(f->pre.owner, PX_UP_OK, "", 1);
    assert_int_equal(f->o.over + f->o.failed + f->o.rejected, 0);
    px_pf_identity id;
    assert_int_equal(px_dispatch_get(f->reg.identities, "p1:8000", &id), 1);
}

/* Prefill failed while decode waited for its KV: a 4xx is passed on with
 * its answer, anything else fails (or falls back) without it. */
static void test_failed_while_waiting(void **state) {
    fixture *f = *state;
    go_concurrent(f);
    f->pre.status = 400;
    set(&f->pre.resp, "{\"error\":{\"message\":\"bad\"}}");
    f->pre.cbs->done(f->pre.owner, PX_UP_OK, "", 1);
    assert_int_equal(f->o.rejected, 1);
    assert_int_equal(f->pre.beside, 0);
    assert_true(f->pre.resp.len > 0);
    f->pre.beside = 1;
    f->pre.status = 0;
    set(&f->pre.resp, "x");
    f->pre.cbs->done(f->pre.owner, PX_UP_RESET, "reset", 1);
    assert_int_equal(f->o.failed, 1);
    assert_int_equal(f->o.rc, PX_UP_RESET);
    assert_int_equal(f->pre.resp.len, 0);
    assert_int_equal(f->o.over, 0);
}

/* Once decode has answered (or no longer waits), prefill's failure
 * changes nothing. */
static void test_failed_after_decode(void **state) {
    fixture *f = *state;
    go_concurrent(f);
    f->log.t_first = px_now_ns();
    f->pre.status = 500;
    f->pre.cbs->done(f->pre.owner, PX_UP_OK, "", 1);
    f->log.t_first = 0;
    f->pre.beside = 0;
    f->pre.cbs->done(f->pre.owner, PX_UP_OK, "", 1);
    assert_int_equal(f->o.failed + f->o.rejected + f->o.over, 0);
}

/* A failed KV load from this prefill: its identity is forgotten. */
static void test_distrust(void **state) {
    fixture *f = *state;
    go_concurrent(f);
    px_conc_distrust(&f->c);
    assert_int_equal(f->pre.beside, 0);
    px_pf_identity id;
    assert_int_equal(px_dispatch_get(f->reg.identities, "p1:8000", &id), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_dispatch, setup, teardown),
        cmocka_unit_test_setup_teardown(test_await, setup, teardown),
        cmocka_unit_test_setup_teardown(test_answer_while_decoding, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failed_while_waiting, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failed_after_decode, setup, teardown),
        cmocka_unit_test_setup_teardown(test_distrust, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
