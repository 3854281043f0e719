/* SPDX-License-Identifier: Apache-2.0 */
/* base/client.c against a scripted HTTP server on 127.0.0.1 (a thread with
 * blocking sockets): keep-alive reuse, the one resend on a stale reused
 * connection, no resend once the backend read the request, chunked bodies
 * with pause and resume, bodiless responses, refused connections. */
/* cmocka needs these first, in this order. */
/* clang-format off */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
/* clang-format on */

#include <arpa/inet.h>
#include <event2/event.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "base/client.h"

/* ---------- the scripted server ---------- */

typedef struct server {
    int lfd;
    struct sockaddr_in addr;
    pthread_t thread;
    void (*script)(struct server *);
    int accepted; /* connections accepted */
    int requests; /* complete requests read */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int step; /* script progress, for the test to wait on */
} server;

static void srv_set_step(server *s, int step) {
    pthread_mutex_lock(&s->mu);
    s->step = step;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void srv_wait_step(server *s, int step) {
    pthread_mutex_lock(&s->mu);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 5;
    while (s->step < step)
        if (pthread_cond_timedwait(&s->cv, &s->mu, &ts)) break;
    int got = s->step;
    pthread_mutex_unlock(&s->mu);
    assert_true(got >= step);
}

static int srv_accept(server *s, int timeout_ms) {
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    setsockopt(s->lfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    int fd = accept(s->lfd, NULL, NULL);
    if (fd >= 0) {
        s->accepted++;
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &(struct timeval){3, 0}, sizeof(struct timeval));
    }
    return fd;
}

/* Reads one request (head + Content-Length body). 1, or 0 on EOF/timeout. */
static int srv_read_request(server *s, int fd) {
    char buf[8192];
    size_t n = 0;
    for (;;) {
        ssize_t r = recv(fd, buf + n, sizeof buf - 1 - n, 0);
        if (r <= 0) return 0;
        n += (size_t)r;
        buf[n] = '\0';
        char *end = strstr(buf, "\r\n\r\n");
        if (!end) continue;
        size_t want = (size_t)(end - buf) + 4;
        char *cl = strstr(buf, "Content-Length: ");
        if (cl && cl < end) want += (size_t)atoi(cl + 16);
        while (n < want) {
            r = recv(fd, buf + n, sizeof buf - 1 - n, 0);
            if (r <= 0) return 0;
            n += (size_t)r;
        }
        s->requests++;
        return 1;
    }
}

static void srv_send(int fd, const char *text) {
    size_t n = strlen(text), off = 0;
    while (off < n) {
        ssize_t w = send(fd, text + off, n - off, MSG_NOSIGNAL);
        if (w <= 0) return;
        off += (size_t)w;
    }
}

static void *srv_main(void *arg) {
    server *s = arg;
    s->script(s);
    return NULL;
}

static void srv_start(server *s, void (*script)(server *)) {
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->lfd = socket(AF_INET, SOCK_STREAM, 0);
    s->addr.sin_family = AF_INET;
    s->addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(s->lfd, (struct sockaddr *)&s->addr, sizeof s->addr), 0);
    socklen_t len = sizeof s->addr;
    getsockname(s->lfd, (struct sockaddr *)&s->addr, &len);
    assert_int_equal(listen(s->lfd, 16), 0);
    s->script = script;
    pthread_create(&s->thread, NULL, srv_main, s);
}

static void srv_join(server *s) {
    pthread_join(s->thread, NULL);
    close(s->lfd);
}

/* ---------- the client side ---------- */

typedef struct result {
    int done;
    px_cresult r;
    int sent;
    int status;
    char body[4096];
    size_t blen;
    int pause_every; /* pause after each delivery when set */
    int paused;
} result;

static void on_head(void *arg, const px_http_head *h) {
    ((result *)arg)->status = h->status;
}

static int on_data(void *arg, const char *p, size_t n) {
    result *res = arg;
    if (res->pause_every && !res->paused) {
        res->paused = 1;
        return 1; /* delivered again after resume */
    }
    res->paused = 0;
    assert_true(res->blen + n < sizeof res->body);
    memcpy(res->body + res->blen, p, n);
    res->blen += n;
    return 0;
}

static void on_done(void *arg, px_cresult r, const char *why, int sent) {
    result *res = arg;
    res->done = 1;
    res->r = r;
    res->sent = sent;
}

static const px_creq_cbs cbs = {on_head, on_data, on_done};
static const char REQ[] = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n";

static px_creq *start(px_client *c, server *s, result *res) {
    memset(res, 0, sizeof *res);
    px_creq_opts o = {.connect_timeout = 2, .total_timeout = 5};
    return px_creq_start(c, (struct sockaddr *)&s->addr, sizeof s->addr, REQ, sizeof REQ - 1, "{}",
                         2, &o, &cbs, res);
}

static void run_until_done(struct event_base *base, result *res, px_creq *q) {
    for (int i = 0; i < 2000 && !res->done; i++) {
        if (res->paused) px_creq_resume(q);
        struct timeval tv = {0, 5000};
        event_base_loopexit(base, &tv);
        event_base_dispatch(base);
    }
    assert_true(res->done);
}

static const char OK_KEEP[] = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";

/* ---------- cases ---------- */

static void script_two_on_one(server *s) {
    int fd = srv_accept(s, 3000);
    for (int i = 0; i < 2 && srv_read_request(s, fd); i++)
        srv_send(fd, OK_KEEP);
    close(fd);
}

static void test_keep_alive_reuse(void **state) {
    struct event_base *base = event_base_new();
    px_client *c = px_client_create(base, NULL);
    server s;
    srv_start(&s, script_two_on_one);
    result r1, r2;
    px_creq *q = start(c, &s, &r1);
    run_until_done(base, &r1, q);
    assert_int_equal(r1.r, PX_CR_OK);
    assert_int_equal(r1.status, 200);
    assert_memory_equal(r1.body, "hello", 5);
    assert_int_equal(px_client_idle(c), 1);
    q = start(c, &s, &r2);
    run_until_done(base, &r2, q);
    assert_int_equal(r2.r, PX_CR_OK);
    srv_join(&s);
    assert_int_equal(s.accepted, 1); /* one connection served both */
    assert_int_equal(s.requests, 2);
    px_client_destroy(c);
    event_base_free(base);
}

/* The backend closes the idle connection; our next request walks into it
 * before the loop noticed, is refused by the backend's kernel, and goes once
 * more on a fresh connection. */
static void script_stale(server *s) {
    int fd = srv_accept(s, 3000);
    srv_read_request(s, fd);
    srv_send(fd, OK_KEEP);
    srv_wait_step(s, 1); /* the client has it */
    close(fd);
    srv_set_step(s, 2);
    int fd2 = srv_accept(s, 3000);
    if (fd2 >= 0 && srv_read_request(s, fd2)) srv_send(fd2, OK_KEEP);
    if (fd2 >= 0) close(fd2);
}

static void test_stale_reused_connection_resent_once(void **state) {
    struct event_base *base = event_base_new();
    px_client *c = px_client_create(base, NULL);
    server s;
    srv_start(&s, script_stale);
    result r1, r2;
    px_creq *q = start(c, &s, &r1);
    run_until_done(base, &r1, q);
    assert_int_equal(r1.r, PX_CR_OK);
    srv_set_step(&s, 1);
    srv_wait_step(&s, 2);
    usleep(1100000); /* the FIN is in our socket; the loop has not run for 1.1 s */
    q = start(c, &s, &r2);
    run_until_done(base, &r2, q);
    assert_int_equal(r2.r, PX_CR_OK);
    assert_int_equal(r2.status, 200);
    srv_join(&s);
    assert_int_equal(s.accepted, 2);
    assert_int_equal(s.requests, 2); /* the request reached a backend once */
    px_client_destroy(c);
    event_base_free(base);
}

/* A stray answer on an idle connection, reported by the kernel in the same
 * loop turn as the event that starts the next request (which came first,
 * so its callback runs first): the connection is not reused, and the
 * request gets a fresh connection and its own answer, without a peek (the
 * connection was idle for less than a second). */
static void script_stray(server *s) {
    int fd = srv_accept(s, 3000);
    srv_read_request(s, fd);
    srv_send(fd, OK_KEEP);
    srv_wait_step(s, 1);
    srv_send(fd, "HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nstolen");
    srv_set_step(s, 2);
    int fd2 = srv_accept(s, 3000);
    if (fd2 >= 0 && srv_read_request(s, fd2)) srv_send(fd2, OK_KEEP);
    if (fd2 >= 0) close(fd2);
    close(fd);
}

typedef struct trigger {
    px_client *c;
    server *s;
    result *res;
    px_creq *q;
} trigger;

static void on_trigger(evutil_socket_t fd, short what, void *arg) {
    trigger *t = arg;
    char b;
    if (read(fd, &b, 1) == 1 && !t->q) t->q = start(t->c, t->s, t->res);
}

static void test_stray_answer_in_the_same_turn(void **state) {
    struct event_base *base = event_base_new();
    px_client *c = px_client_create(base, NULL);
    server s;
    srv_start(&s, script_stray);
    result r1, r2;
    px_creq *q = start(c, &s, &r1);
    run_until_done(base, &r1, q);
    assert_int_equal(r1.r, PX_CR_OK);
    /* One poll with nothing to report, so that the kernel lists the events
     * below in the order they happen (level-triggered descriptors reported
     * last time would be looked at first). */
    event_base_loop(base, EVLOOP_NONBLOCK);
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    trigger t = {c, &s, &r2, NULL};
    struct event *ev = event_new(base, pfd[0], EV_READ | EV_PERSIST, on_trigger, &t);
    event_add(ev, NULL);
    assert_int_equal(write(pfd[1], "x", 1), 1); /* ready first */
    srv_set_step(&s, 1);
    srv_wait_step(&s, 2);
    usleep(5000); /* the stray answer is in our socket; the loop has not run */
    memset(&r2, 0, sizeof r2);
    for (int i = 0; i < 2000 && !r2.done; i++) {
        struct timeval tv = {0, 5000};
        event_base_loopexit(base, &tv);
        event_base_dispatch(base);
    }
    assert_true(r2.done);
    assert_int_equal(r2.r, PX_CR_OK);
    assert_int_equal(r2.blen, 5);
    assert_memory_equal(r2.body, "hello", 5);
    srv_join(&s);
    assert_int_equal(s.accepted, 2);
    event_free(ev);
    close(pfd[0]);
    close(pfd[1]);
    px_client_destroy(c);
    event_base_free(base);
}

/* The backend read the request on the reused connection, then closed it
 * without answering: it may have acted on it, so it is never sent again. */
static void script_read_then_close(server *s) {
    int fd = srv_accept(s, 3000);
    srv_read_request(s, fd);
    srv_send(fd, OK_KEEP);
    srv_read_request(s, fd);
    close(fd);
    int fd2 = srv_accept(s, 500); /* a resend would arrive here */
    if (fd2 >= 0) {
        srv_read_request(s, fd2);
        close(fd2);
    }
}

static void test_request_read_then_closed_not_resent(void **state) {
    struct event_base *base = event_base_new();
    px_client *c = px_client_create(base, NULL);
    server s;
    srv_start(&s, script_read_then_close);
    result r1, r2;
    px_creq *q = start(c, &s, &r1);
    run_until_done(base, &r1, q);
    q = start(c, &s, &r2);
    run_until_done(base, &r2, q);
    assert_int_equal(r2.r, PX_CR_RESET);
    assert_true(r2.sent);
    srv_join(&s);
    assert_int_equal(s.accepted, 1);
    assert_int_equal(s.requests, 2);
    px_client_destroy(c);
    event_base_free(base);
}

static void script_chunked(server *s) {
    int fd = srv_accept(s, 3000);
    srv_read_request(s, fd);
    srv_send(fd, "HTTP/1.1 100 Continue\r\n\r\n");
    srv_send(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n");
    usleep(20000);
    srv_send(fd, "6;x=1\r\n world\r\n0\r\nT: v\r\n\r\n");
    srv_read_request(s, fd); /* a 204, then a close-delimited body */
    srv_send(fd, "HTTP/1.1 204 No Content\r\n\r\n");
    srv_read_request(s, fd);
    srv_send(fd, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end");
    close(fd);
}

static void test_chunked_pause_resume_and_bodiless(void **state) {
    struct event_base *base = event_base_new();
    px_client *c = px_client_create(base, NULL);
    server s;
    srv_start(&s, script_chunked);
    result r;
    px_creq *q = start(c, &s, &r);
    r.pause_every = 1;
    run_until_done(base, &r, q);
    assert_int_equal(r.r, PX_CR_OK);
    assert_int_equal(r.status, 200);
    assert_int_equal(r.blen, 11);
    assert_memory_equal(r.body, "hello world", 11);
    q = start(c, &s, &r);
    run_until_done(base, &r, q);
    assert_int_equal(r.status, 204);
    assert_int_equal(r.blen, 0);
    q = start(c, &s, &r);
    run_until_done(base, &r, q);
    assert_int_equal(r.r, PX_CR_OK);
    assert_int_equal(r.blen, 13);
    assert_int_equal(px_client_idle(c), 0); /* a close-delimited body is not reused */
    srv_join(&s);
    assert_int_equal(s.accepted, 1);
    px_client_destroy(c);
    event_base_free(base);
}

static void test_refused_is_connect_error_not_sent(void **state) {
    struct event_base *base = event_base_new();
    px_client *c = px_client_create(base, NULL);
    server s;
    memset(&s, 0, sizeof s);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    s.addr.sin_family = AF_INET;
    s.addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd, (struct sockaddr *)&s.addr, sizeof s.addr);
    socklen_t len = sizeof s.addr;
    getsockname(fd, (struct sockaddr *)&s.addr, &len);
    close(fd); /* nobody listens there now */
    result r;
    px_creq *q = start(c, &s, &r);
    run_until_done(base, &r, q);
    assert_int_equal(r.r, PX_CR_CONNECT);
    assert_false(r.sent);
    px_client_destroy(c);
    event_base_free(base);
}

static void script_malformed(server *s) {
    int fd = srv_accept(s, 3000);
    srv_read_request(s, fd);
    srv_send(fd, "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n");
    usleep(50000);
    close(fd);
}

static void test_smuggling_shaped_response_refused(void **state) {
    struct event_base *base = event_base_new();
    px_client *c = px_client_create(base, NULL);
    server s;
    srv_start(&s, script_malformed);
    result r;
    px_creq *q = start(c, &s, &r);
    run_until_done(base, &r, q);
    assert_int_equal(r.r, PX_CR_PROTOCOL);
    srv_join(&s);
    px_client_destroy(c);
    event_base_free(base);
}

/* The backend answers the first request, then reads the second on the same
 * connection and says nothing: the idle timeout ends it there too (it is
 * armed on a reused connection as on a new one), and a trickle of bytes
 * within the timeout keeps a third alive. */
static void script_answer_then_silent(server *s) {
    int fd = srv_accept(s, 3000);
    if (srv_read_request(s, fd)) srv_send(fd, OK_KEEP);
    if (srv_read_request(s, fd)) srv_wait_step(s, 1); /* silent until the client gave up */
    close(fd);
    int fd2 = srv_accept(s, 3000);
    if (fd2 >= 0 && srv_read_request(s, fd2)) {
        /* 5 body bytes 300 ms apart: 1.5 s in all, each gap well inside
         * the 1 s idle timeout. */
        srv_send(fd2, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n");
        for (int i = 0; i < 5; i++) {
            usleep(300000);
            srv_send(fd2, "x");
        }
    }
    if (fd2 >= 0) close(fd2);
}

static void test_idle_timeout_on_reused_connection(void **state) {
    struct event_base *base = event_base_new();
    px_client *c = px_client_create(base, NULL);
    server s;
    srv_start(&s, script_answer_then_silent);
    /* The total timeout is far beyond the test's patience: only the idle
     * timeout can end the silent request in time. */
    px_creq_opts o = {.connect_timeout = 2, .total_timeout = 60, .idle_timeout = 1.0};
    result r1, r2, r3;
    memset(&r1, 0, sizeof r1);
    px_creq *q = px_creq_start(c, (struct sockaddr *)&s.addr, sizeof s.addr, REQ, sizeof REQ - 1,
                               "{}", 2, &o, &cbs, &r1);
    run_until_done(base, &r1, q);
    assert_int_equal(r1.r, PX_CR_OK);
    memset(&r2, 0, sizeof r2);
    q = px_creq_start(c, (struct sockaddr *)&s.addr, sizeof s.addr, REQ, sizeof REQ - 1, "{}", 2,
                      &o, &cbs, &r2);
    run_until_done(base, &r2, q);
    assert_int_equal(r2.r, PX_CR_TIMEOUT);
    srv_set_step(&s, 1);
    memset(&r3, 0, sizeof r3);
    q = px_creq_start(c, (struct sockaddr *)&s.addr, sizeof s.addr, REQ, sizeof REQ - 1, "{}", 2,
                      &o, &cbs, &r3);
    run_until_done(base, &r3, q);
    assert_int_equal(r3.r, PX_CR_OK);
    assert_memory_equal(r3.body, "xxxxx", 5);
    srv_join(&s);
    px_client_destroy(c);
    event_base_free(base);
}

static int keep_none(void *ctx, const struct sockaddr *sa, socklen_t salen) {
    return 0;
}

/* An address is remembered only while a request or a connection refers to
 * it: backends that come and go (DNS, reloads) leave nothing behind, and
 * the per-request lookup stays short. */
static void test_hosts_go_with_their_connections(void **state) {
    struct event_base *base = event_base_new();
    px_client *c = px_client_create(base, NULL);
    server s;
    srv_start(&s, script_two_on_one);
    result r;
    px_creq *q = start(c, &s, &r);
    assert_int_equal(px_client_hosts(c), 1);
    run_until_done(base, &r, q);
    assert_int_equal(r.r, PX_CR_OK);
    assert_int_equal(px_client_idle(c), 1);
    assert_int_equal(px_client_hosts(c), 1); /* its idle connection holds it */
    px_client_retire(c, keep_none, NULL);
    assert_int_equal(px_client_idle(c), 0);
    assert_int_equal(px_client_hosts(c), 0);
    srv_join(&s);
    /* A refused address: gone once its request ended. */
    server dead;
    memset(&dead, 0, sizeof dead);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    dead.addr.sin_family = AF_INET;
    dead.addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd, (struct sockaddr *)&dead.addr, sizeof dead.addr);
    socklen_t len = sizeof dead.addr;
    getsockname(fd, (struct sockaddr *)&dead.addr, &len);
    close(fd);
    q = start(c, &dead, &r);
    run_until_done(base, &r, q);
    assert_int_equal(r.r, PX_CR_CONNECT);
    assert_int_equal(px_client_hosts(c), 0);
    /* A cancelled request lets go of its address too. */
    q = start(c, &dead, &r);
    assert_int_equal(px_client_hosts(c), 1);
    px_creq_cancel(q);
    assert_int_equal(px_client_hosts(c), 0);
    px_client_destroy(c);
    event_base_free(base);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_keep_alive_reuse),
        cmocka_unit_test(test_stale_reused_connection_resent_once),
        cmocka_unit_test(test_stray_answer_in_the_same_turn),
        cmocka_unit_test(test_request_read_then_closed_not_resent),
        cmocka_unit_test(test_chunked_pause_resume_and_bodiless),
        cmocka_unit_test(test_refused_is_connect_error_not_sent),
        cmocka_unit_test(test_smuggling_shaped_response_refused),
        cmocka_unit_test(test_idle_timeout_on_reused_connection),
        cmocka_unit_test(test_hosts_go_with_their_connections),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
