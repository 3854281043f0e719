/* SPDX-License-Identifier: Apache-2.0 */
/* Endpoint ownership on the producer: a consumer that goes away while the
 * producer still owes it something (a held registration, pushes in flight)
 * must not make the producer send on an endpoint UCX has destroyed.  UCX
 * 1.13 destroys an endpoint it created for a remote peer (the AM reply
 * endpoint) when that peer fails or closes (ucp_ep.c, ucp_ep_set_failed),
 * so a send on a kept reply endpoint reads freed memory.
 *
 * Two agents in this process on loopback tcp: the consumer registers, then
 * its agent is destroyed (worker and endpoints gone, as after a kill); the
 * producer goes on: publishes, serves, releases.  Under ASan a send on a
 * freed endpoint is a heap-use-after-free.  Loops are bounded in time. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <poll.h>
#include <pthread.h>

#include "tests/unit/kvc_fixture.h"
#include "tests/unit/kvc_rawpeer.h"

/* Pumps the producer alone for ms (the consumer is gone). */
static void pump_alone(side_t *P, uint64_t ms) {
    uint64_t t0 = kvc_now_ns();
    while (kvc_now_ns() - t0 < ms * 1000000ull)
        pump_once(P);
}

#define PUMP_ONE_UNTIL(P, cond, ms)                                                                \
    do {                                                                                           \
        uint64_t t0_ = kvc_now_ns();                                                               \
        while (!(cond)) {                                                                          \
            assert_true(kvc_now_ns() - t0_ < (uint64_t)(ms)*1000000ull);                           \
            pump_once(P);                                                                          \
        }                                                                                          \
    } while (0)

/* A held registration whose consumer leaves before the publication: the
 * producer drops it (its count and bytes returned), serves nobody, and the
 * publication's blocks still come back. */
static void held_then_gone(int rounds) {
    for (int k = 0; k < rounds; k++) {
        side_t P, D;
        side_init(&P, &(opts_t){.name = "own-P", .nb = 32, .bl = 8192});
        side_init(&D, &(opts_t){.name = "own-D", .nb = 32, .bl = 8192});
        char tok[33];
        assert_int_equal(kvc_token_new(tok), KVC_OK);
        uint64_t ids[4] = {3, 4, 5, 9}, lids[4] = {10, 11, 12, 20};
        kvc_fetch_params_t w = {.wait_ms = 20000};
        (void)fetch_p(&D, params_json("own-P", port_of(&P), "gone", ids, 4, tok), lids, 4,
                      KVC_FETCH_FIELD_WAIT, &w);
        PUMP_UNTIL(&P, &D, stat(&P, KVC_STAT_PENDING_FETCHES) == 1, 20000);
        side_cleanup(&D);
        /* The producer learns that its consumer is gone. */
        PUMP_ONE_UNTIL(&P, stat(&P, KVC_STAT_CONSUMERS_LOST) == 1, 20000);
        assert_int_equal(stat(&P, KVC_STAT_PENDING_FETCHES), 0);
        for (int i = 0; i < 4; i++)
            fill(&P, ids[i], 5);
        publish_tok(&P, "gone", ids, 4, tok);
        pump_alone(&P, 100);
        assert_int_equal(stat(&P, KVC_STAT_PENDING_SERVED), 0);
        /* No reader left: the blocks come back at once. */
        assert_int_equal(kvc_unpublish(P.a, "gone"), KVC_OK);
        side_cleanup(&P);
    }
}

static void test_held_fetch_consumer_gone(void **state) {
    (void)state;
    held_then_gone(3);
}

/* Pushes in flight when the consumer leaves: they end (failed or
 * cancelled), the publication's reader count drops, a release hands the
 * blocks back. */
static void test_push_consumer_gone(void **state) {
    (void)state;
    for (int k = 0; k < 3; k++) {
        side_t P, D;
        /* 2 regions x 64 blocks x 256 KiB: 32 MiB, many DATA messages. */
        side_init(&P, &(opts_t){.name = "own-P", .nb = 64, .bl = 256 << 10});
        side_init(&D, &(opts_t){.name = "own-D", .nb = 64, .bl = 256 << 10});
        char tok[33];
        assert_int_equal(kvc_token_new(tok), KVC_OK);
        uint64_t ids[64];
        for (int i = 0; i < 64; i++)
            ids[i] = (uint64_t)i;
        publish_tok(&P, "big", ids, 64, tok);
        uint64_t x =
            fetch_p(&D, params_json("own-P", port_of(&P), "big", ids, 64, tok), ids, 64, 0, NULL);
        /* Until the producer has started sending (its push bytes count). */
        PUMP_UNTIL(&P, &D, P.a->push_bytes > 0 || fetch_ev(&D, x), 20000);
        side_cleanup(&D);
        PUMP_ONE_UNTIL(&P, P.a->push_inflight == 0 && P.a->push_bytes == 0, 20000);
        /* No push reads the blocks any more: released now (or already, by
         * the consumer's notification when it finished before leaving). */
        kvc_status_t st = kvc_unpublish(P.a, "big");
        assert_true(st == KVC_OK || st == KVC_ERR_NOT_FOUND);
        side_cleanup(&P);
    }
}

/* Waits ms on a producer that runs its own progress thread (nothing to
 * observe: the time its UCX takes to see a departed peer's connection go). */
static void idle_ms(uint64_t ms) {
    uint64_t t0 = kvc_now_ns();
    while (kvc_now_ns() - t0 < ms * 1000000ull)
        usleep(5000);
}

#define WAIT_STAT(P, which, value, ms)                                                             \
    do {                                                                                           \
        uint64_t t0_ = kvc_now_ns();                                                               \
        while (stat((P), (which)) != (value)) {                                                    \
            assert_true(kvc_now_ns() - t0_ < (uint64_t)(ms)*1000000ull);                           \
            usleep(2000);                                                                          \
        }                                                                                          \
    } while (0)

/* A consumer that leaves KVC_HFLAG_OWNER out of its HELLO (an older agent,
 * or anyone who drops the flag) asks to be held for a publication that
 * does not exist yet (KVC_PULL_WAIT), eight times, then leaves (dies, or
 * closes its endpoint first).  UCX then destroys the reply endpoint of its
 * pulls: a producer that kept it crashed at the publication (the held pulls
 * served on it) or at their deadline (refused on it).  Such a pull is
 * refused at once, in its callback, with KVC_ERR_UNSUPPORTED: nothing is
 * kept, and the producer serves on. */
static void wait_without_owner(bool at_deadline, bool close_ep) {
    side_t P;
    side_init(&P, &(opts_t){.name = "own-P", .nb = 32, .bl = 8192, .thread = true});
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    raw_t r;
    raw_up(&r, KVC_FIXTURE_SECRET);
    r.hello_flags = KVC_HFLAG_SECRET; /* no KVC_HFLAG_OWNER */
    assert_int_equal(raw_handshake(&r, port_of(&P), NULL, false, 0), KVC_OK);
    assert_false(r.chal_flags & KVC_HFLAG_OWNER);
    raw_connect(&r);
    for (int i = 0; i < 8; i++)
        raw_pull(&r, (uint64_t)i + 1, "noown", tok, 0, at_deadline ? 300 : 20000, 0,
                 (uint64_t)i + 3, (uint64_t)i, 1);
    /* Refused, or (the crash this guards against) held. */
    RAW_UNTIL(&r, r.refusals == 8 || stat(&P, KVC_STAT_PENDING_FETCHES) == 8, 10000);
    int refusals = r.refusals;
    int32_t why = r.last_refusal;
    raw_leave(&r, close_ep);
    idle_ms(300);
    if (!at_deadline) {
        uint64_t ids[8];
        for (int i = 0; i < 8; i++) {
            ids[i] = (uint64_t)i + 3;
            fill(&P, ids[i], 1);
        }
        publish_tok(&P, "noown", ids, 8, tok);
    }
    WAIT_STAT(&P, KVC_STAT_PENDING_FETCHES, 0, 10000);
    idle_ms(100);
    assert_int_equal(refusals, 8);
    assert_int_equal(why, KVC_ERR_UNSUPPORTED);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_SERVED), 0);
    assert_int_equal(stat(&P, KVC_STAT_PENDING_EXPIRED), 0);
    if (!at_deadline) assert_int_equal(kvc_unpublish(P.a, "noown"), KVC_OK);
    side_cleanup(&P);
}

static void test_wait_without_owner_publish(void **state) {
    (void)state;
    wait_without_owner(false, false);
    wait_without_owner(false, true);
}

static void test_wait_without_owner_deadline(void **state) {
    (void)state;
    wait_without_owner(true, false);
    wait_without_owner(true, true);
}

/* A relay on the side channel, without the secret: it passes one
 * connection through, whole messages at a time, and XORs `flip` into one
 * byte of message `msg` (0: the first) of direction `dir` (0: consumer to
 * producer, HELLO, AUTH, sealed CONSUMER; 1: back, CHALLENGE, sealed
 * HANDSHAKE): body byte `off`, or with off -1 the flags byte of a HELLO or
 * CHALLENGE (after the str16 engine id).  Bounded: 20 s. */
typedef struct {
    int dir, msg, off;
    uint8_t flip;
} tamper_t;

typedef struct {
    int lfd;
    uint16_t port, target;
    tamper_t t;
    pthread_t thr;
} relay_t;

typedef struct {
    uint8_t buf[65536];
    size_t len;
    int seen; /* whole messages passed */
} flow_t;

/* Reads what `from` has and passes on every whole message.  False at EOF. */
static bool relay_pass(relay_t *r, int dir, flow_t *f, int from, int to) {
    ssize_t n = read(from, f->buf + f->len, sizeof(f->buf) - f->len);
    if (n <= 0) return false;
    f->len += (size_t)n;
    kvc_wire_hdr_t h;
    while (kvc_wire_parse_hdr(f->buf, f->len, sizeof(f->buf), &h) == KVC_OK &&
           f->len >= KVC_WIRE_HDR_LEN + (size_t)h.body_len) {
        size_t whole = KVC_WIRE_HDR_LEN + h.body_len;
        uint8_t *body = f->buf + KVC_WIRE_HDR_LEN;
        if (dir == r->t.dir && f->seen == r->t.msg) {
            size_t at = r->t.off >= 0 ? (size_t)r->t.off : 2 + (body[0] | (size_t)body[1] << 8);
            assert_true(at < h.body_len);
            body[at] ^= r->t.flip;
        }
        f->seen++;
        if (write(to, f->buf, whole) != (ssize_t)whole) return false;
        memmove(f->buf, f->buf + whole, f->len - whole);
        f->len -= whole;
    }
    return true;
}

static void *relay_run(void *arg) {
    relay_t *r = arg;
    struct pollfd lp = {.fd = r->lfd, .events = POLLIN};
    if (poll(&lp, 1, 20000) != 1) return NULL;
    int c = accept(r->lfd, NULL, NULL);
    int p = raw_dial(r->target, NULL);
    static flow_t flows[2];
    memset(flows, 0, sizeof(flows));
    uint64_t t0 = kvc_now_ns();
    while (c >= 0 && p >= 0 && kvc_now_ns() - t0 < 20000000000ull) {
        struct pollfd fds[2] = {{.fd = c, .events = POLLIN}, {.fd = p, .events = POLLIN}};
        if (poll(fds, 2, 100) <= 0) continue;
        if (fds[0].revents && !relay_pass(r, 0, &flows[0], c, p)) break;
        if (fds[1].revents && !relay_pass(r, 1, &flows[1], p, c)) break;
    }
    if (c >= 0) close(c);
    if (p >= 0) close(p);
    return NULL;
}

static void relay_start(relay_t *r, uint16_t target) {
    r->target = target;
    r->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    socklen_t sl = sizeof(sa);
    assert_int_equal(bind(r->lfd, (struct sockaddr *)&sa, sl), 0);
    assert_int_equal(listen(r->lfd, 4), 0);
    assert_int_equal(getsockname(r->lfd, (struct sockaddr *)&sa, &sl), 0);
    r->port = ntohs(sa.sin_port);
    assert_int_equal(pthread_create(&r->thr, NULL, relay_run, r), 0);
}

/* A relay without the secret changes one bit of the handshake: of the
 * HELLO's or the CHALLENGE's flags byte (the endpoint-ownership flag, or
 * one no version uses yet), of AUTH, of the consumer's sealed CONSUMER
 * message or of the producer's sealed reply.  The flags are under the
 * consumer's AUTH MAC and the rest under it or a seal: the consumer's fetch
 * fails with KVC_ERR_AUTH, never served on a path the relay chose. */
static void test_relay_flips_flags(void **state) {
    (void)state;
    const tamper_t cases[] = {
        {0, 0, -1, KVC_HFLAG_OWNER}, /* HELLO: ownership cleared */
        {1, 0, -1, KVC_HFLAG_OWNER}, /* CHALLENGE: ownership cleared */
        {0, 0, -1, 0x80},            /* HELLO: a bit no version uses */
        {1, 0, -1, 0x40},            /* CHALLENGE: the same */
        {0, 1, 0, 1},                /* AUTH: the protocol asked for */
        {0, 2, 20, 1},               /* the sealed CONSUMER (worker address) */
        {1, 1, 20, 1},               /* the sealed HANDSHAKE */
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        side_t P, D;
        side_init(&P, &(opts_t){.name = "own-P", .nb = 32, .bl = 8192});
        side_init(&D, &(opts_t){.name = "own-D", .nb = 32, .bl = 8192});
        relay_t r = {.t = cases[k]};
        relay_start(&r, port_of(&P));
        char tok[33];
        assert_int_equal(kvc_token_new(tok), KVC_OK);
        uint64_t ids[2] = {3, 4}, lids[2] = {5, 6};
        publish_tok(&P, "relayed", ids, 2, tok);
        uint64_t x = fetch_p(&D, params_json("own-P", r.port, "relayed", ids, 2, tok), lids, 2, 0,
                             NULL);
        PUMP_UNTIL(&P, &D, fetch_ev(&D, x), 20000);
        const rec_t *e = fetch_ev(&D, x);
        if (e->type != KVC_EV_FETCH_FAILED || e->st != KVC_ERR_AUTH)
            fail_msg("case %zu (dir %d msg %d off %d flip %#x): %s %s (%s)", k, cases[k].dir,
                     cases[k].msg, cases[k].off, cases[k].flip,
                     e->type == KVC_EV_FETCH_DONE ? "FETCH_DONE" : "FETCH_FAILED",
                     kvc_status_str(e->st), e->msg);
        pthread_join(r.thr, NULL);
        close(r.lfd);
        side_cleanup(&D);
        side_cleanup(&P);
    }
}

/* Four consumer keys invented by one authenticated peer, each registering
 * held fetches (KVC_PULL_WAIT) for ids that will never be published, from
 * four other source addresses (`spread`) or from the honest consumer's own:
 * the held-fetch bounds are shared by source address, and within one by
 * consumer, so the honest consumer's held fetch takes the place of one of
 * theirs (refused KVC_ERR_BUSY) and is served on publish.  Keyed by the
 * self-chosen consumer key, four keys filled the total and the honest
 * fetch was refused with KVC_ERR_BUSY at once. */
static void held_share(bool spread) {
    side_t P, D;
    side_init(&P, &(opts_t){.name = "own-P", .nb = 32, .bl = 8192, .thread = true,
                            .max_pending = 16, .max_per_peer = 4});
    side_init(&D, &(opts_t){.name = "own-D", .nb = 32, .bl = 8192});
    raw_t r;
    raw_up(&r, KVC_FIXTURE_SECRET);
    r.hello_flags |= KVC_HFLAG_OWNER;
    char src[16], tok[33], id[32];
    for (uint64_t k = 0; k < 4; k++) {
        snprintf(src, sizeof(src), "127.0.0.%d", spread ? (int)k + 2 : 1);
        assert_int_equal(raw_handshake(&r, port_of(&P), src, true, 0xbad0 + k), KVC_OK);
    }
    raw_connect(&r);
    for (uint64_t k = 0; k < 4; k++)
        for (uint64_t i = 0; i < 4; i++) {
            assert_int_equal(kvc_token_new(tok), KVC_OK);
            snprintf(id, sizeof(id), "invented-%llu-%llu", (unsigned long long)k,
                     (unsigned long long)i);
            raw_pull(&r, k * 4 + i + 1, id, tok, KVC_PULL_CONS, 20000, 0xbad0 + k, 1, 1, 1);
        }
    /* Every pull held or refused. */
    RAW_UNTIL(&r, (int)stat(&P, KVC_STAT_PENDING_FETCHES) + r.refusals == 16, 10000);
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t ids[2] = {3, 4}, lids[2] = {5, 6};
    kvc_fetch_params_t w = {.wait_ms = 20000};
    uint64_t x = fetch_p(&D, params_json("own-P", port_of(&P), "honest", ids, 2, tok), lids, 2,
                         KVC_FETCH_FIELD_WAIT, &w);
    /* Held (every pull of the peer held or refused, and one more held) or
     * refused. */
    for (uint64_t t0 = kvc_now_ns();
         !fetch_ev(&D, x) && (int)stat(&P, KVC_STAT_PENDING_FETCHES) + r.refusals != 17;) {
        assert_true(kvc_now_ns() - t0 < 20000000000ull);
        pump_once(&D);
        ucp_worker_progress(r.w);
    }
    if (fetch_ev(&D, x))
        fail_msg("the honest held fetch ended before its publication: %s (%s)",
                 kvc_status_str(fetch_ev(&D, x)->st), fetch_ev(&D, x)->msg);
    fill(&P, 3, 7);
    fill(&P, 4, 7);
    publish_tok(&P, "honest", ids, 2, tok);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x), 20000);
    assert_int_equal(fetch_ev(&D, x)->type, KVC_EV_FETCH_DONE);
    assert_true(same_blocks(&P, 3, &D, 5) && same_blocks(&P, 4, &D, 6));
    /* Those refused were told so (KVC_ERR_BUSY) on their consumer's endpoint. */
    RAW_UNTIL(&r, (int)stat(&P, KVC_STAT_PENDING_FETCHES) + r.refusals == 16, 10000);
    assert_true(r.refusals >= 1);
    assert_int_equal(r.last_refusal, KVC_ERR_BUSY);
    raw_leave(&r, true);
    side_cleanup(&D);
    side_cleanup(&P);
}

static void test_held_share_addresses(void **state) {
    (void)state;
    held_share(true);
}

static void test_held_share_one_address(void **state) {
    (void)state;
    held_share(false);
}

/* Handshakes with fresh consumer keys (an attacker, or decode agents that
 * restart, each with a new key) never fill the producer's table of
 * consumers for good: records nothing references give way, least recently
 * used first, within their source address.  Before, the 4,097th handshake
 * was refused ("too many consumers") and so was every honest consumer
 * after it. */
static void test_consumer_churn(void **state) {
    (void)state;
    side_t P, D;
    side_init(&P, &(opts_t){.name = "own-P", .nb = 32, .bl = 8192, .thread = true});
    side_init(&D, &(opts_t){.name = "own-D", .nb = 32, .bl = 8192});
    raw_t r;
    raw_up(&r, KVC_FIXTURE_SECRET);
    r.hello_flags |= KVC_HFLAG_OWNER;
    for (uint64_t k = 0; k < KVC_MAX_CONSUMERS + 4; k++) {
        kvc_status_t st = raw_handshake(&r, port_of(&P), NULL, true, 0xf00d0000 + k);
        if (st != KVC_OK) fail_msg("handshake %llu: %s", (unsigned long long)k, kvc_status_str(st));
    }
    raw_leave(&r, false);
    char tok[33];
    assert_int_equal(kvc_token_new(tok), KVC_OK);
    uint64_t ids[2] = {3, 4}, lids[2] = {5, 6};
    fill(&P, 3, 9);
    fill(&P, 4, 9);
    publish_tok(&P, "after-churn", ids, 2, tok);
    kvc_fetch_params_t w = {.wait_ms = 20000}; /* held: its record is needed */
    uint64_t x = fetch_p(&D, params_json("own-P", port_of(&P), "after-churn", ids, 2, tok), lids,
                         2, KVC_FETCH_FIELD_WAIT, &w);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x), 20000);
    if (fetch_ev(&D, x)->type != KVC_EV_FETCH_DONE)
        fail_msg("honest fetch: %s (%s)", kvc_status_str(fetch_ev(&D, x)->st), fetch_ev(&D, x)->msg);
    assert_true(same_blocks(&P, 3, &D, 5) && same_blocks(&P, 4, &D, 6));
    side_cleanup(&D);
    side_cleanup(&P);
}

/* Sets P's bounds on consumer records (in all, per source address). */
static void cons_bounds(side_t *P, uint32_t all, uint32_t per_addr) {
    kvc_lock(P->a);
    P->a->max_cons = all;
    P->a->max_cons_addr = per_addr;
    kvc_unlock(P->a);
}

/* A producer whose consumer records are all in use (each with a held
 * fetch) refuses a new consumer's handshake with KVC_ERR_BUSY, and the
 * consumer's fetch fails with KVC_ERR_BUSY (it was KVC_ERR_PROTOCOL). */
static void test_consumer_table_busy(void **state) {
    (void)state;
    side_t P, D;
    side_init(&P, &(opts_t){.name = "own-P", .nb = 32, .bl = 8192, .thread = true});
    side_init(&D, &(opts_t){.name = "own-D", .nb = 32, .bl = 8192});
    cons_bounds(&P, 2, 2);
    raw_t r;
    raw_up(&r, KVC_FIXTURE_SECRET);
    r.hello_flags |= KVC_HFLAG_OWNER;
    char tok[33];
    for (uint64_t k = 0; k < 2; k++)
        assert_int_equal(raw_handshake(&r, port_of(&P), NULL, true, 0xb0057 + k), KVC_OK);
    raw_connect(&r);
    for (uint64_t k = 0; k < 2; k++) {
        assert_int_equal(kvc_token_new(tok), KVC_OK);
        raw_pull(&r, k + 1, "never", tok, KVC_PULL_CONS, 20000, 0xb0057 + k, 1, 1, 1);
    }
    RAW_UNTIL(&r, stat(&P, KVC_STAT_PENDING_FETCHES) == 2, 10000);
    /* Both records are in use: the third handshake finds no room. */
    assert_int_equal(raw_handshake(&r, port_of(&P), NULL, true, 0xb0059), KVC_ERR_BUSY);
    uint64_t ids[1] = {3};
    publish_tok(&P, "busy", ids, 1, tok);
    uint64_t x = fetch_p(&D, params_json("own-P", port_of(&P), "busy", ids, 1, tok), ids, 1, 0,
                         NULL);
    PUMP_UNTIL(&P, &D, fetch_ev(&D, x), 20000);
    assert_int_equal(fetch_ev(&D, x)->type, KVC_EV_FETCH_FAILED);
    if (fetch_ev(&D, x)->st != KVC_ERR_BUSY)
        fail_msg("%s (%s)", kvc_status_str(fetch_ev(&D, x)->st), fetch_ev(&D, x)->msg);
    raw_leave(&r, true);
    side_cleanup(&D);
    side_cleanup(&P);
}

/* Consumers that come, fetch over a live side channel and go (an engine
 * restarting): whichever end the producer sees first (the endpoint failing
 * or the side channel closing), the record's place is given back, so with
 * two places per address a third and a fourth consumer from 127.0.0.1 are
 * served.  A side-channel close seen first used to mark the record dead
 * without giving its place back (here UCX reported the endpoint first, so
 * this run did not catch that order; the code now has one retire path). */
static void test_closed_live_channels_free_their_places(void **state) {
    (void)state;
    side_t P;
    side_init(&P, &(opts_t){.name = "own-P", .nb = 32, .bl = 8192, .thread = true});
    cons_bounds(&P, 8, 2);
    for (uint64_t i = 0; i < 4; i++) {
        side_t D;
        side_init(&D, &(opts_t){.name = "own-D", .nb = 32, .bl = 8192});
        char tok[33], rid[32];
        assert_int_equal(kvc_token_new(tok), KVC_OK);
        snprintf(rid, sizeof rid, "restart-%llu", (unsigned long long)i);
        uint64_t ids[1] = {3 + i};
        fill(&P, 3 + i, 9);
        publish_tok(&P, rid, ids, 1, tok);
        uint64_t x =
            fetch_p(&D, params_json("own-P", port_of(&P), rid, ids, 1, tok), ids, 1, 0, NULL);
        PUMP_UNTIL(&P, &D, fetch_ev(&D, x), 20000);
        if (fetch_ev(&D, x)->type != KVC_EV_FETCH_DONE)
            fail_msg("consumer %llu: %s (%s)", (unsigned long long)i,
                     kvc_status_str(fetch_ev(&D, x)->st), fetch_ev(&D, x)->msg);
        uint64_t lost = stat(&P, KVC_STAT_CONSUMERS_LOST);
        side_cleanup(&D); /* closes its side channel */
        WAIT_STAT(&P, KVC_STAT_CONSUMERS_LOST, lost + 1, 10000);
    }
    side_cleanup(&P);
}

/* A consumer whose record gave way (least recently used, its address at
 * its bound) is refused its next pull (KVC_ERR_PEER_FAILED) and handshakes
 * again for the one after: it is not refused for good.  Only a consumer that
 * keeps no live side channel can be forgotten (the channel references its
 * record): this one leaves KVC_HFLAG_LIVE out, as a peer may; with it the
 * record stays, test_live_consumer_not_forgotten. */
static void forgotten_case(bool live) {
    side_t P, D;
    if (!live) setenv("KVC_TEST_NO_LIVE", "1", 1);
    side_init(&P, &(opts_t){.name = "own-P", .nb = 32, .bl = 8192, .thread = true});
    side_init(&D, &(opts_t){.name = "own-D", .nb = 32, .bl = 8192});
    cons_bounds(&P, 4096, 2);
    char tok[33];
    uint64_t ids[1] = {3}, lids[1] = {4};
    fill(&P, 3, 5);
    const char *reqs[3] = {"first", "second", "third"};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvc_token_new(tok), KVC_OK);
        publish_tok(&P, reqs[i], ids, 1, tok);
        uint64_t x = fetch_p(&D, params_json("own-P", port_of(&P), reqs[i], ids, 1, tok), lids, 1,
                             0, NULL);
        PUMP_UNTIL(&P, &D, fetch_ev(&D, x), 20000);
        const rec_t *e = fetch_ev(&D, x);
        if (i == 1 && !live) { /* the record was forgotten since the first */
            assert_int_equal(e->type, KVC_EV_FETCH_FAILED);
            assert_int_equal(e->st, KVC_ERR_PEER_FAILED);
            kvc_unpublish(P.a, reqs[i]);
        } else {
            if (e->type != KVC_EV_FETCH_DONE)
                fail_msg("%s: %s (%s)", reqs[i], kvc_status_str(e->st), e->msg);
            assert_true(same_blocks(&P, 3, &D, 4));
        }
        if (i == 0) { /* two newer consumers from the same address */
            raw_t r;
            raw_up(&r, KVC_FIXTURE_SECRET);
            r.hello_flags |= KVC_HFLAG_OWNER;
            assert_int_equal(raw_handshake(&r, port_of(&P), NULL, true, 0x1e57), KVC_OK);
            assert_int_equal(raw_handshake(&r, port_of(&P), NULL, true, 0x1e58), KVC_OK);
            raw_leave(&r, false);
        }
    }
    assert_int_equal(stat(&D, KVC_STAT_HANDSHAKES), live ? 1 : 2);
    unsetenv("KVC_TEST_NO_LIVE");
    side_cleanup(&D);
    side_cleanup(&P);
}

static void test_consumer_forgotten_handshakes_again(void **state) {
    (void)state;
    forgotten_case(false);
}

/* The same newcomers against a consumer that keeps its side channel open:
 * its record is referenced, the newcomers give way to each other instead,
 * and every fetch of the honest consumer is served on its one handshake. */
static void test_live_consumer_not_forgotten(void **state) {
    (void)state;
    forgotten_case(true);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_held_fetch_consumer_gone),
        cmocka_unit_test(test_push_consumer_gone),
        cmocka_unit_test(test_wait_without_owner_publish),
        cmocka_unit_test(test_wait_without_owner_deadline),
        cmocka_unit_test(test_relay_flips_flags),
        cmocka_unit_test(test_held_share_addresses),
        cmocka_unit_test(test_held_share_one_address),
        cmocka_unit_test(test_consumer_churn),
        cmocka_unit_test(test_consumer_table_busy),
        cmocka_unit_test(test_closed_live_channels_free_their_places),
        cmocka_unit_test(test_consumer_forgotten_handshakes_again),
        cmocka_unit_test(test_live_consumer_not_forgotten),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
