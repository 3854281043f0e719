/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests: libkvconnector agent bookkeeping without a peer — parameter
 * validation, publish table, notification handling, expiry, events, stats. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "connector/kvc_int.h"

static int log_lines;
static void quiet_log(void *arg, kvc_log_level_t level, const char *msg) {
    log_lines++;
}

static kvc_agent_t *mk_agent(uint32_t expiry_ms) {
    kvc_agent_params_t p = {0};
    p.field_mask = KVC_AGENT_FIELD_ENGINE_ID | KVC_AGENT_FIELD_LOG | KVC_AGENT_FIELD_LOG_LEVEL |
                   KVC_AGENT_FIELD_EXPIRY;
    p.engine_id = "unit-P";
    p.log_cb = quiet_log;
    p.log_level = KVC_LOG_DEBUG;
    p.expiry_ms = expiry_ms;
    kvc_agent_t *a = NULL;
    assert_int_equal(kvc_agent_create(&p, &a), KVC_OK);
    return a;
}

static void regions(kvc_agent_t *a) {
    kvc_region_params_t rp[2] = {{.len = 16 * 1024}, {.len = 16 * 1024}};
    assert_int_equal(kvc_agent_register_regions(a, 16, rp, 2), KVC_OK);
}

static void test_create_params(void **state) {
    kvc_agent_t *a = (kvc_agent_t *)0x1;
    kvc_agent_params_t p = {0};
    assert_int_equal(kvc_agent_create(&p, &a), KVC_ERR_INVALID_PARAM);
    assert_ptr_equal(a, (kvc_agent_t *)0x1); /* out-param untouched */
    p.field_mask = KVC_AGENT_FIELD_ENGINE_ID;
    p.engine_id = "";
    assert_int_equal(kvc_agent_create(&p, &a), KVC_ERR_INVALID_PARAM);
    p.engine_id = "bad\nid";
    assert_int_equal(kvc_agent_create(&p, &a), KVC_ERR_INVALID_PARAM);
    p.engine_id = "ok";
    p.field_mask |= KVC_AGENT_FIELD_LISTEN_HOST;
    p.listen_host = "no.such.host.invalid";
    assert_int_equal(kvc_agent_create(&p, &a), KVC_ERR_INVALID_PARAM);
    assert_ptr_equal(a, (kvc_agent_t *)0x1);
    kvc_agent_destroy(NULL);

    a = mk_agent(0);
    uint16_t port = 0;
    int fd = -1;
    assert_int_equal(kvc_agent_get_port(a, &port), KVC_OK);
    assert_true(port != 0); /* port 0 picked a free one */
    assert_int_equal(kvc_agent_get_fd(a, &fd), KVC_OK);
    assert_true(fd >= 0);
    assert_int_equal(kvc_agent_progress(a), KVC_OK);
    kvc_agent_destroy(a);
}

static void test_regions(void **state) {
    kvc_agent_t *a = mk_agent(0);
    kvc_region_params_t bad = {.len = 1000};
    assert_int_equal(kvc_agent_register_regions(a, 16, &bad, 1), KVC_ERR_INVALID_PARAM);
    assert_int_equal(kvc_agent_register_regions(a, 0, &bad, 1), KVC_ERR_INVALID_PARAM);
    assert_int_equal(kvc_agent_register_regions(a, 16, &bad, 0), KVC_ERR_INVALID_PARAM);
    kvc_region_params_t cuda = {
        .field_mask = KVC_REGION_FIELD_MEM_TYPE, .len = 4096, .mem_type = KVC_MEM_CUDA};
    assert_int_equal(kvc_agent_register_regions(a, 16, &cuda, 1), KVC_ERR_INVALID_PARAM);
    /* Host memory declared as CUDA: refused, whatever the machine: no device
     * (driver missing), a CPU-only build, or, with a GPU, memory that
     * cudaPointerGetAttributes does not place on a device. */
    static uint8_t fake_dev[4096];
    cuda.field_mask |= KVC_REGION_FIELD_BASE;
    cuda.base = fake_dev;
    kvc_status_t cst = kvc_agent_register_regions(a, 16, &cuda, 1);
    assert_true(cst == KVC_ERR_NO_DEVICE || cst == KVC_ERR_UNSUPPORTED ||
                cst == KVC_ERR_INVALID_PARAM);
    char *json = NULL;
    uint64_t b0 = 0;
    assert_int_equal(kvc_publish(a, "r", &b0, 1, NULL, &json), KVC_ERR_STATE);
    void *base;
    assert_int_equal(kvc_region_base(a, 0, &base), KVC_ERR_NOT_FOUND);

    static uint8_t user[8 * 512];
    kvc_region_params_t rp[2] = {
        {.len = 8 * 512}, {.field_mask = KVC_REGION_FIELD_BASE, .len = 8 * 512, .base = user}};
    assert_int_equal(kvc_agent_register_regions(a, 8, rp, 2), KVC_OK);
    assert_int_equal(kvc_agent_register_regions(a, 8, rp, 2), KVC_ERR_STATE);
    assert_int_equal(kvc_region_base(a, 1, &base), KVC_OK);
    assert_ptr_equal(base, user);
    assert_int_equal(kvc_region_base(a, 0, &base), KVC_OK);
    memset(base, 0xab, 8 * 512); /* the pool is writable host memory */
    kvc_agent_destroy(a);
}

static void test_publish(void **state) {
    kvc_agent_t *a = mk_agent(0);
    regions(a);
    uint64_t ids[] = {1, 2, 15};
    char *json = (char *)0x1;
    assert_int_equal(kvc_publish(a, "", ids, 3, NULL, &json), KVC_ERR_INVALID_PARAM);
    assert_int_equal(kvc_publish(a, "bad\x01", ids, 3, NULL, &json), KVC_ERR_INVALID_PARAM);
    uint64_t oor[] = {1, 16};
    assert_int_equal(kvc_publish(a, "r", oor, 2, NULL, &json), KVC_ERR_INVALID_PARAM);
    assert_ptr_equal(json, (char *)0x1);
    assert_int_equal(kvc_publish(a, "cmpl-1:x", ids, 3, NULL, &json), KVC_OK);
    kvc_remote_t r;
    char err[128];
    assert_int_equal(kvc_params_parse_json(json, &r, err, sizeof(err)), KVC_OK);
    assert_string_equal(r.request_id, "cmpl-1:x");
    assert_string_equal(r.engine_id, "unit-P");
    assert_string_equal(r.host, "127.0.0.1");
    assert_int_equal(r.num_blocks, 3);
    assert_int_equal(r.block_ids[2], 15);
    kvc_remote_cleanup(&r);
    kvc_free(json);
    assert_int_equal(kvc_publish(a, "cmpl-1:x", ids, 3, NULL, &json), KVC_ERR_EXISTS);
    assert_int_equal(kvc_unpublish(a, "cmpl-1:x"), KVC_OK);
    assert_int_equal(kvc_unpublish(a, "cmpl-1:x"), KVC_ERR_NOT_FOUND);
    /* many ids: the table grows */
    char id[32];
    for (int i = 0; i < 5000; i++) {
        snprintf(id, sizeof(id), "req-%d", i);
        assert_int_equal(kvc_publish(a, id, ids, 1, NULL, &json), KVC_OK);
        kvc_free(json);
    }
    uint64_t v;
    assert_int_equal(kvc_agent_stat(a, KVC_STAT_PUBLISHED_NOW, &v), KVC_OK);
    assert_int_equal(v, 5000);
    assert_int_equal(kvc_agent_stat(a, (kvc_stat_t)99, &v), KVC_ERR_INVALID_PARAM);
    kvc_agent_destroy(a); /* frees the 5000 entries */
}

/* Delivers a notification "<token><text>" as the producer's AM handler does. */
static void notify(kvc_agent_t *a, const uint8_t *tok, const char *text) {
    uint8_t msg[512];
    memcpy(msg, tok, KVC_TOKEN_LEN);
    memcpy(msg + KVC_TOKEN_LEN, text, strlen(text));
    kvc_notify_handle(a, msg, KVC_TOKEN_LEN + strlen(text));
}

static void token_of(const char *json, uint8_t tok[KVC_TOKEN_LEN]) {
    kvc_remote_t r;
    char err[128];
    assert_int_equal(kvc_params_parse_json(json, &r, err, sizeof(err)), KVC_OK);
    memcpy(tok, r.token, KVC_TOKEN_LEN);
    kvc_remote_cleanup(&r);
}

static void test_notify_release(void **state) {
    kvc_agent_t *a = mk_agent(0);
    regions(a);
    uint64_t ids[] = {3, 4};
    char *json;
    kvc_publish_params_t pp = {.field_mask = KVC_PUBLISH_FIELD_USER_DATA, .user_data = 77};
    assert_int_equal(kvc_publish(a, "a:b:c", ids, 2, &pp, &json), KVC_OK);
    uint8_t tok[KVC_TOKEN_LEN], bad[KVC_TOKEN_LEN];
    token_of(json, tok);
    kvc_free(json);
    kvc_event_t ev;
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_AGAIN);

    /* A wrong token frees nothing: counted as denied, no event. */
    memcpy(bad, tok, sizeof(bad));
    bad[15] ^= 1;
    const char *n1 = "a:b:c:1";
    notify(a, bad, n1);
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_AGAIN);
    uint64_t v;
    kvc_agent_stat(a, KVC_STAT_DENIED, &v);
    assert_int_equal(v, 1);
    kvc_agent_stat(a, KVC_STAT_PUBLISHED_NOW, &v);
    assert_int_equal(v, 1);

    notify(a, tok, n1);
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_OK);
    assert_int_equal(ev.type, KVC_EV_RELEASED);
    assert_int_equal(ev.status, KVC_OK);
    assert_string_equal(ev.request_id, "a:b:c");
    assert_int_equal(ev.num_blocks, 2);
    assert_int_equal(ev.block_ids[1], 4);
    assert_int_equal(ev.user_data, 77);

    /* second notification for the same id: unknown now */
    notify(a, tok, n1);
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_OK);
    assert_int_equal(ev.type, KVC_EV_UNKNOWN_NOTIFY);
    assert_string_equal(ev.request_id, "a:b:c");
    notify(a, tok, "\x01:1"); /* malformed: counted, no event */
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_AGAIN);
    kvc_agent_stat(a, KVC_STAT_UNKNOWN_NOTIFY, &v);
    assert_int_equal(v, 2);
    kvc_agent_stat(a, KVC_STAT_RELEASED, &v);
    assert_int_equal(v, 1);
    kvc_agent_destroy(a);
}

static void test_expiry(void **state) {
    kvc_agent_t *a = mk_agent(60000);
    regions(a);
    uint64_t ids[] = {1};
    char *json;
    kvc_publish_params_t fast = {.field_mask = KVC_PUBLISH_FIELD_EXPIRY, .expiry_ms = 30};
    assert_int_equal(kvc_publish(a, "slow", ids, 1, NULL, &json), KVC_OK);
    kvc_free(json);
    assert_int_equal(kvc_publish(a, "fast", ids, 1, &fast, &json), KVC_OK);
    uint8_t tok[KVC_TOKEN_LEN];
    token_of(json, tok);
    kvc_free(json);
    /* The agent's fd (timerfd inside) wakes us; bounded loop, no sleeps. */
    kvc_event_t ev;
    uint64_t t0 = kvc_now_ns();
    for (;;) {
        assert_int_equal(kvc_agent_wait(a, 1000), KVC_OK);
        if (kvc_agent_next_event(a, &ev) == KVC_OK) break;
        assert_true(kvc_now_ns() - t0 < 5000000000ull);
    }
    assert_true(kvc_now_ns() - t0 >= 20000000ull);
    assert_int_equal(ev.type, KVC_EV_EXPIRED);
    assert_string_equal(ev.request_id, "fast");
    uint8_t zero[KVC_TOKEN_LEN] = {0};
    notify(a, zero, "fast:1"); /* late, but not with its token: refused, no event */
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_AGAIN);
    notify(a, tok, "fast:1"); /* late, with its token: one event */
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_OK);
    assert_int_equal(ev.type, KVC_EV_UNKNOWN_NOTIFY);
    notify(a, tok, "fast:1");
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_AGAIN);
    uint64_t v;
    kvc_agent_stat(a, KVC_STAT_PUBLISHED_NOW, &v);
    assert_int_equal(v, 1);
    kvc_agent_stat(a, KVC_STAT_EXPIRED, &v);
    assert_int_equal(v, 1);
    kvc_agent_destroy(a);
}

static long rss_kib(void) {
    char buf[512] = {0};
    int fd = open("/proc/self/status", O_RDONLY);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    char *l = n > 0 ? strstr(buf, "VmRSS:") : NULL;
    return l ? strtol(l + 6, NULL, 10) : -1;
}

/* 20,000 notifications for ids never published, 1 KB each, without a token
 * this producer issued: refused and counted, logged at most ten lines a
 * second, no event, and the producer's memory does not grow with them. */
static void test_unknown_notify_flood(void **state) {
    kvc_agent_t *a = mk_agent(0);
    regions(a);
    uint64_t ids[] = {1};
    char *json;
    assert_int_equal(kvc_publish(a, "real", ids, 1, NULL, &json), KVC_OK);
    uint8_t tok[KVC_TOKEN_LEN];
    token_of(json, tok);
    kvc_free(json);
    enum { N = 20000, IDLEN = 1000 };
    static uint8_t msg[KVC_TOKEN_LEN + IDLEN + 16];
    memset(msg, 0, KVC_TOKEN_LEN);
    memset(msg + KVC_TOKEN_LEN, 'x', IDLEN);
    long rss0 = rss_kib();
    int lines0 = log_lines;
    uint64_t t0 = kvc_now_ns();
    for (int i = 0; i < N; i++) {
        /* every other one carries the token of another publication */
        memcpy(msg, i % 2 ? tok : (const uint8_t[KVC_TOKEN_LEN]){0}, KVC_TOKEN_LEN);
        int k = snprintf((char *)msg + KVC_TOKEN_LEN, 16, "%d", i);
        msg[KVC_TOKEN_LEN + k] = 'x';
        memcpy(msg + KVC_TOKEN_LEN + IDLEN, ":1", 2);
        kvc_notify_handle(a, msg, KVC_TOKEN_LEN + IDLEN + 2);
    }
    double secs = (double)(kvc_now_ns() - t0) / 1e9;
    long grew = rss_kib() - rss0;
    int lines = log_lines - lines0;
    kvc_event_t ev;
    int events = 0;
    while (kvc_agent_next_event(a, &ev) == KVC_OK)
        events++;
    uint64_t v;
    kvc_agent_stat(a, KVC_STAT_UNKNOWN_NOTIFY, &v);
    assert_int_equal(v, N);
    kvc_agent_stat(a, KVC_STAT_DENIED, &v);
    assert_int_equal(v, N);
    kvc_agent_stat(a, KVC_STAT_PUBLISHED_NOW, &v);
    assert_int_equal(v, 1);
    assert_int_equal(events, 0);
    assert_true(lines <= 10 * ((int)secs + 2)); /* ten a second, per kind */
    assert_true(grew < 2048);
    kvc_agent_destroy(a);
}

/* Heterogeneous TP: blocks are released after as many matching
 * notifications as consumers are expected, stated or inferred. */
static void test_tp_fan_in(void **state) {
    kvc_agent_t *a = mk_agent(0);
    regions(a);
    uint64_t ids[] = {1, 2};
    char *json;
    uint8_t t1[KVC_TOKEN_LEN], t2[KVC_TOKEN_LEN];
    kvc_publish_params_t two = {.field_mask = KVC_PUBLISH_FIELD_CONSUMERS, .consumers = 2};
    assert_int_equal(kvc_publish(a, "fan", ids, 2, &two, &json), KVC_OK);
    token_of(json, t1);
    kvc_free(json);
    assert_int_equal(kvc_publish(a, "inferred", ids, 2, NULL, &json), KVC_OK);
    token_of(json, t2);
    kvc_free(json);
    kvc_event_t ev;
    notify(a, t1, "fan:1");
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_AGAIN); /* 1 of 2 */
    notify(a, t2, "inferred:2"); /* a TP-2 consumer under a TP-1 producer: 2 ranks */
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_AGAIN);
    notify(a, t1, "fan:1");
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_OK);
    assert_int_equal(ev.type, KVC_EV_RELEASED);
    assert_string_equal(ev.request_id, "fan");
    notify(a, t2, "inferred:2");
    assert_int_equal(kvc_agent_next_event(a, &ev), KVC_OK);
    assert_int_equal(ev.type, KVC_EV_RELEASED);
    assert_string_equal(ev.request_id, "inferred");
    uint64_t v;
    kvc_agent_stat(a, KVC_STAT_RELEASED, &v);
    assert_int_equal(v, 2);
    kvc_agent_destroy(a);
}

static kvc_agent_t *mk_secret_agent(const kvc_agent_params_t *extra, kvc_status_t want) {
    kvc_agent_params_t p = *extra;
    p.field_mask |= KVC_AGENT_FIELD_ENGINE_ID | KVC_AGENT_FIELD_LOG;
    p.engine_id = "unit-S";
    p.log_cb = quiet_log;
    p.log_level = KVC_LOG_DEBUG;
    kvc_agent_t *a = NULL;
    assert_int_equal(kvc_agent_create(&p, &a), want);
    return a;
}

static void test_secret(void **state) {
    unsetenv("KVC_SECRET");
    unsetenv("KVC_SECRET_FILE");
    kvc_agent_params_t p = {0};
    uint64_t v = 9;
    /* none: runs unauthenticated, says so once */
    log_lines = 0;
    kvc_agent_t *a = mk_secret_agent(&p, KVC_OK);
    assert_int_equal(kvc_agent_stat(a, KVC_STAT_AUTHENTICATED, &v), KVC_OK);
    assert_int_equal(v, 0);
    assert_true(log_lines >= 1);
    kvc_agent_destroy(a);
    /* parameter */
    p.field_mask = KVC_AGENT_FIELD_SECRET;
    p.secret = "s3cret";
    p.secret_len = 6;
    a = mk_secret_agent(&p, KVC_OK);
    kvc_agent_stat(a, KVC_STAT_AUTHENTICATED, &v);
    assert_int_equal(v, 1);
    assert_int_equal(a->secret_len, 6);
    kvc_agent_destroy(a);
    p.secret_len = 0;
    mk_secret_agent(&p, KVC_ERR_INVALID_PARAM);
    p.secret = NULL;
    p.secret_len = 4;
    mk_secret_agent(&p, KVC_ERR_INVALID_PARAM);
    /* KVC_SECRET_FILE: trailing newline stripped; empty or missing: refused */
    p.field_mask = 0;
    char path[] = "/tmp/kvc_unit_secretXXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "file-secret\n", 12), 12);
    close(fd);
    setenv("KVC_SECRET_FILE", path, 1);
    a = mk_secret_agent(&p, KVC_OK);
    assert_int_equal(a->secret_len, 11);
    assert_memory_equal(a->secret, "file-secret", 11);
    kvc_agent_destroy(a);
    fd = open(path, O_WRONLY | O_TRUNC);
    assert_int_equal(write(fd, "\n", 1), 1);
    close(fd);
    mk_secret_agent(&p, KVC_ERR_INVALID_PARAM);
    unlink(path);
    mk_secret_agent(&p, KVC_ERR_INVALID_PARAM);
    unsetenv("KVC_SECRET_FILE");
    /* KVC_SECRET (tests) */
    setenv("KVC_SECRET", "env-secret", 1);
    a = mk_secret_agent(&p, KVC_OK);
    assert_int_equal(a->secret_len, 10);
    kvc_agent_destroy(a);
    unsetenv("KVC_SECRET");
}

static void test_fetch_params(void **state) {
    kvc_agent_t *a = mk_agent(0);
    uint64_t id = 12345;
    kvc_fetch_params_t fp = {0};
    fp.field_mask = KVC_FETCH_FIELD_JSON;
    fp.kv_transfer_params_json = "{}";
    assert_int_equal(kvc_fetch(a, &fp, &id), KVC_ERR_STATE);
    regions(a);
    assert_int_equal(kvc_fetch(a, &fp, &id), KVC_ERR_INVALID_PARAM);
    uint64_t rem[] = {1, 2}, loc_bad[] = {1, 16}, loc3[] = {1, 2, 3};
    fp.field_mask = KVC_FETCH_FIELD_REMOTE | KVC_FETCH_FIELD_LOCAL_BLOCKS;
    fp.remote_engine_id = "P";
    fp.remote_request_id = "r";
    fp.remote_host = "127.0.0.1";
    fp.remote_port = 1;
    fp.remote_block_ids = rem;
    fp.num_remote_blocks = 2;
    uint64_t loc_ok[] = {5, 6}, loc_dup[] = {5, 5};
    fp.local_block_ids = loc_ok;
    fp.num_local_blocks = 2;
    assert_int_equal(kvc_fetch(a, &fp, &id), KVC_ERR_INVALID_PARAM); /* no token */
    fp.remote_kv_token = "0011223344556677";
    assert_int_equal(kvc_fetch(a, &fp, &id), KVC_ERR_INVALID_PARAM); /* short token */
    fp.remote_kv_token = "00112233445566778899aabbccddeeff";
    fp.local_block_ids = loc_dup;
    assert_int_equal(kvc_fetch(a, &fp, &id), KVC_ERR_INVALID_PARAM); /* local id twice */
    fp.local_block_ids = loc_bad;
    fp.num_local_blocks = 2;
    assert_int_equal(kvc_fetch(a, &fp, &id), KVC_ERR_INVALID_PARAM); /* local out of range */
    fp.local_block_ids = loc3;
    fp.num_local_blocks = 3;
    assert_int_equal(kvc_fetch(a, &fp, &id), KVC_ERR_INVALID_PARAM); /* more local than remote */
    fp.remote_port = 0;
    fp.num_local_blocks = 1;
    assert_int_equal(kvc_fetch(a, &fp, &id), KVC_ERR_INVALID_PARAM);
    assert_int_equal(id, 12345);
    kvc_agent_destroy(a);
}

static void test_status_str(void **state) {
    for (int s = -18; s <= 2; s++)
        assert_null(strstr(kvc_status_str((kvc_status_t)s), "UNKNOWN"));
    assert_string_equal(kvc_status_str(KVC_ERR_INCOMPATIBLE), "KVC_ERR_INCOMPATIBLE");
    assert_string_equal(kvc_status_str((kvc_status_t)-999), "KVC_ERR_UNKNOWN");
    /* codes never renumber */
    assert_int_equal(KVC_ERR_UNREACHABLE, -3);
    assert_int_equal(KVC_ERR_VERSION, -5);
    assert_int_equal(KVC_ERR_INCOMPATIBLE, -6);
    assert_int_equal(KVC_ERR_AUTH, -17);
    assert_int_equal(KVC_ERR_DENIED, -18);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_params), cmocka_unit_test(test_regions),
        cmocka_unit_test(test_publish),       cmocka_unit_test(test_notify_release),
        cmocka_unit_test(test_tp_fan_in),     cmocka_unit_test(test_secret),
        cmocka_unit_test(test_expiry),        cmocka_unit_test(test_fetch_params),
        cmocka_unit_test(test_status_str),    cmocka_unit_test(test_unknown_notify_flood),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
