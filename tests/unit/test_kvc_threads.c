/* SPDX-License-Identifier: Apache-2.0 */
/* Stress: agents with their internal progress thread (progress_thread = 1)
 * driven by several application threads at once, as an engine's threads
 * would: one publishes, one fetches (registered before publication, or
 * after) and cancels some, one renews leases and reads stats, one pops each
 * agent's events.  Checked: every fetch gets exactly one event, each
 * finished fetch holds the producer's bytes, every publication comes back.
 * Built with -DSANITIZE=thread by tests/tsan/run.sh, which is where it
 * earns its keep: the library's shared state (agent, events, fetches,
 * publications, consumer records) must only ever be touched under the
 * agent's mutex or by the thread that owns it.  Bounded: 60 s. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "tests/unit/kvc_fixture.h"

#define NREQ 96
#define BL 4096

typedef struct {
    side_t P, D;
    char tok[NREQ][33];
    char json[NREQ][1024];
    atomic_int published;      /* requests published so far */
    atomic_bool stop;
    int events[NREQ];          /* the popper's: events per request */
    kvc_status_t status[NREQ]; /* the popper's */
    int released;              /* the popper's: RELEASED/EXPIRED of P */
} stress_t;

static void nap_us(long us) {
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

static void *publisher(void *arg) {
    stress_t *s = arg;
    for (int i = 0; i < NREQ; i++) {
        char id[32];
        snprintf(id, sizeof(id), "s-%d", i);
        uint64_t b = (uint64_t)i;
        kvc_publish_params_t pp = {.field_mask = KVC_PUBLISH_FIELD_TOKEN, .kv_token = s->tok[i]};
        char *json = NULL;
        assert_int_equal(kvc_publish(s->P.a, id, &b, 1, &pp, &json), KVC_OK);
        kvc_free(json);
        atomic_store(&s->published, i + 1);
        if (i % 7 == 0) nap_us(500); /* some fetches come first, some after */
    }
    return NULL;
}

static void *fetcher(void *arg) {
    stress_t *s = arg;
    for (int i = 0; i < NREQ; i++) {
        uint64_t lid = (uint64_t)i;
        kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON |
                                               KVC_FETCH_FIELD_LOCAL_BLOCKS |
                                               KVC_FETCH_FIELD_WAIT | KVC_FETCH_FIELD_USER_DATA,
                                 .kv_transfer_params_json = s->json[i],
                                 .local_block_ids = &lid,
                                 .num_local_blocks = 1,
                                 .wait_ms = 20000,
                                 .user_data = (uint64_t)i};
        uint64_t x = 0;
        assert_int_equal(kvc_fetch(s->D.a, &fp, &x), KVC_INPROGRESS);
        if (i % 11 == 5) { /* cancelled at once, or already done */
            kvc_status_t st = kvc_fetch_cancel(s->D.a, x);
            assert_true(st == KVC_OK || st == KVC_ERR_NOT_FOUND);
        }
    }
    return NULL;
}

/* Lease renewals and stats from yet another thread, until told to stop. */
static void *meddler(void *arg) {
    stress_t *s = arg;
    for (int k = 0; !atomic_load(&s->stop); k++) {
        int n = atomic_load(&s->published);
        if (n > 0) {
            kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON,
                                     .kv_transfer_params_json = s->json[k % n]};
            assert_int_equal(kvc_lease_renew(s->D.a, &fp), KVC_OK);
        }
        uint64_t v;
        for (int st = 0; st <= KVC_STAT_LAST; st++) {
            assert_int_equal(kvc_agent_stat(s->P.a, (kvc_stat_t)st, &v), KVC_OK);
            assert_int_equal(kvc_agent_stat(s->D.a, (kvc_stat_t)st, &v), KVC_OK);
        }
        int fd;
        assert_int_equal(kvc_agent_get_fd(s->D.a, &fd), KVC_OK);
        nap_us(200);
    }
    return NULL;
}

/* The one thread that pops both agents' events. */
static void *popper(void *arg) {
    stress_t *s = arg;
    uint64_t t0 = kvc_now_ns();
    int done = 0, ok = 0; /* fetches ended; of those, done (their notification sent) */
    while ((done < NREQ || s->released < ok) && kvc_now_ns() - t0 < 60000000000ull) {
        kvc_event_t e;
        bool any = false;
        while (kvc_agent_next_event(s->D.a, &e) == KVC_OK) {
            any = true;
            assert_true(e.type == KVC_EV_FETCH_DONE || e.type == KVC_EV_FETCH_FAILED);
            assert_true(e.user_data < NREQ);
            if (s->events[e.user_data]++ == 0) done++;
            ok += e.status == KVC_OK;
            s->status[e.user_data] = e.status;
            char want[32];
            snprintf(want, sizeof(want), "s-%d", (int)e.user_data);
            assert_string_equal(e.request_id, want);
        }
        while (kvc_agent_next_event(s->P.a, &e) == KVC_OK) {
            any = true;
            if (e.type == KVC_EV_RELEASED || e.type == KVC_EV_EXPIRED) s->released++;
        }
        if (!any) nap_us(300);
    }
    return NULL;
}

static void test_threads_stress(void **state) {
    (void)state;
    static stress_t s;
    memset(&s, 0, sizeof(s));
    side_init(&s.P, &(opts_t){.name = "thr-P", .nb = NREQ, .bl = BL, .thread = true,
                              .lease_ms = 30000});
    side_init(&s.D, &(opts_t){.name = "thr-D", .nb = NREQ, .bl = BL, .thread = true});
    for (int i = 0; i < NREQ; i++) {
        fill(&s.P, (uint64_t)i, 3); /* before any thread: never written again */
        assert_int_equal(kvc_token_new(s.tok[i]), KVC_OK);
        char id[32];
        uint64_t b = (uint64_t)i;
        snprintf(id, sizeof(id), "s-%d", i);
        const char *j = params_json("thr-P", port_of(&s.P), id, &b, 1, s.tok[i]);
        assert_true(strlen(j) < sizeof(s.json[i]));
        memcpy(s.json[i], j, strlen(j) + 1);
    }
    pthread_t th[4];
    void *(*fn[4])(void *) = {popper, meddler, fetcher, publisher};
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&th[i], NULL, fn[i], &s), 0);
    assert_int_equal(pthread_join(th[3], NULL), 0);
    assert_int_equal(pthread_join(th[2], NULL), 0);
    assert_int_equal(pthread_join(th[0], NULL), 0);
    atomic_store(&s.stop, true);
    assert_int_equal(pthread_join(th[1], NULL), 0);
    int ok = 0;
    for (int i = 0; i < NREQ; i++) {
        if (s.events[i] != 1) fail_msg("request %d: %d events", i, s.events[i]);
        if (s.status[i] == KVC_OK) {
            ok++;
            assert_true(same_blocks(&s.P, (uint64_t)i, &s.D, (uint64_t)i));
        } else if (s.status[i] != KVC_ERR_CANCELED) {
            fail_msg("request %d: %s", i, kvc_status_str(s.status[i]));
        }
    }
    assert_true(ok >= NREQ - NREQ / 11 - 1);
    /* Cancelled fetches leave their publication to its lease: unpublished
     * here, the rest came back by notification. */
    for (int i = 0; i < NREQ; i++) {
        char id[32];
        snprintf(id, sizeof(id), "s-%d", i);
        kvc_unpublish(s.P.a, id);
    }
    side_cleanup(&s.D);
    side_cleanup(&s.P);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_threads_stress),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
