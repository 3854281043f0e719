/* SPDX-License-Identifier: Apache-2.0 */
/* base/listen.c on 127.0.0.1: a listener serves connections through
 * px_conn; a host that does not resolve and a port already served are named
 * in the error; out of descriptors, accepting pauses and then resumes. */
/* cmocka needs these first, in this order. */
/* clang-format off */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
/* clang-format on */

#include <arpa/inet.h>
#include <errno.h>
#include <event2/event.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "base/listen.h"

static void dispatch(void *ctx, px_conn *c, const px_http_head *h, px_buf *body) {
    px_conn_reply(c, 200, "text/plain", NULL, NULL, "ok", 2);
}

/* A port nothing listens on right now. */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t l = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &l);
    close(fd);
    return ntohs(a.sin_port);
}

static int connect_to(int fd, int port) {
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &(struct timeval){5, 0}, sizeof(struct timeval));
    return connect(fd, (struct sockaddr *)&a, sizeof a);
}

typedef struct client {
    int fd;
    pthread_t thread;
    atomic_int done; /* 1: got an answer, -1: failed */
    char answer[256];
} client;

/* Sends one request on an already connected socket and reads the answer. */
static void *client_main(void *arg) {
    client *k = arg;
    const char req[] = "GET / HTTP/1.1\r\nHost: t\r\n\r\n";
    if (send(k->fd, req, sizeof req - 1, MSG_NOSIGNAL) != (ssize_t)sizeof req - 1) {
        atomic_store(&k->done, -1);
        return NULL;
    }
    size_t n = 0;
    while (n < sizeof k->answer - 1 && !strstr(k->answer, "\r\n\r\nok")) {
        ssize_t r = recv(k->fd, k->answer + n, sizeof k->answer - 1 - n, 0);
        if (r <= 0) break;
        n += (size_t)r;
        k->answer[n] = '\0';
    }
    atomic_store(&k->done, strstr(k->answer, "\r\n\r\nok") ? 1 : -1);
    return NULL;
}

/* Runs the loop until the client is done or `ms` passed. */
static void run_until(struct event_base *base, client *k, int ms) {
    for (int i = 0; i < ms / 10 && !atomic_load(&k->done); i++) {
        struct timeval tv = {0, 10000};
        event_base_loopexit(base, &tv);
        event_base_dispatch(base);
    }
}

/* A loop with a listener on a free port of 127.0.0.1. */
typedef struct fixture {
    struct event_base *base;
    px_conn_cfg cfg;
    px_conn_list list;
    px_listener *l;
    int port;
} fixture;

static void fixture_start(fixture *f) {
    memset(f, 0, sizeof *f);
    f->base = event_base_new();
    f->cfg = (px_conn_cfg){.max_body_bytes = 1024,
                           .header_timeout = 5,
                           .keepalive_timeout = 5,
                           .send_timeout = 5,
                           .dispatch = dispatch};
    char err[256] = "";
    f->port = free_port();
    f->l =
        px_listen(f->base, "127.0.0.1", f->port, 0, "--port", &f->cfg, &f->list, err, sizeof err);
    assert_non_null(f->l);
}

static void fixture_stop(fixture *f) {
    px_conn_list_close_all(&f->list);
    px_listener_free(f->l);
    event_base_free(f->base);
}

static void test_serves(void **state) {
    fixture f;
    fixture_start(&f);
    client k = {.fd = socket(AF_INET, SOCK_STREAM, 0)};
    assert_int_equal(connect_to(k.fd, f.port), 0);
    pthread_create(&k.thread, NULL, client_main, &k);
    run_until(f.base, &k, 5000);
    pthread_join(k.thread, NULL);
    assert_int_equal(atomic_load(&k.done), 1);
    assert_non_null(strstr(k.answer, "HTTP/1.1 200"));
    close(k.fd);
    fixture_stop(&f);
}

static void test_errors_name_the_setting(void **state) {
    struct event_base *base = event_base_new();
    px_conn_cfg cfg = {.dispatch = dispatch};
    px_conn_list list = {0};
    char err[256] = "";
    assert_null(px_listen(base, "no-such-host.invalid", 8080, 0, "--admin-port", &cfg, &list, err,
                          sizeof err));
    assert_non_null(strstr(err, "cannot resolve"));
    assert_non_null(strstr(err, "--admin-port"));

    /* A port another socket serves: the check says so, and so does a
     * listener that would not share it. */
    int port = free_port();
    int held = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(held, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(held, 8), 0);
    err[0] = '\0';
    assert_int_equal(px_listen_port_free("127.0.0.1", port, "--metrics-port", err, sizeof err), -1);
    assert_non_null(strstr(err, "already in use"));
    assert_non_null(strstr(err, "--metrics-port"));
    err[0] = '\0';
    assert_null(px_listen(base, "127.0.0.1", port, 0, "--port", &cfg, &list, err, sizeof err));
    assert_non_null(strstr(err, "--port"));
    assert_non_null(strstr(err, strerror(EADDRINUSE)));
    close(held);
    assert_int_equal(px_listen_port_free("127.0.0.1", port, "--port", err, sizeof err), 0);
    event_base_free(base);
}

/* Out of descriptors, a connection waits in the backlog; once descriptors
 * are free again the paused listener takes it and it is served. */
static void test_pauses_and_resumes_when_out_of_descriptors(void **state) {
    fixture f;
    fixture_start(&f);
    client k = {.fd = socket(AF_INET, SOCK_STREAM, 0)};

    struct rlimit old, low;
    getrlimit(RLIMIT_NOFILE, &old);
    low = old;
    low.rlim_cur = 256;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &low), 0);
    int fds[256], nfds = 0;
    while (nfds < 256) {
        int fd = dup(0);
        if (fd < 0) break;
        fds[nfds++] = fd;
    }
    assert_true(nfds < 256); /* the table is full */
    assert_int_equal(connect_to(k.fd, f.port), 0);
    pthread_create(&k.thread, NULL, client_main, &k);
    run_until(f.base, &k, 300);
    assert_int_equal(atomic_load(&k.done), 0); /* not served: no descriptor to accept it */
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    setrlimit(RLIMIT_NOFILE, &old);
    run_until(f.base, &k, 5000);
    pthread_join(k.thread, NULL);
    assert_int_equal(atomic_load(&k.done), 1);
    close(k.fd);
    fixture_stop(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_serves),
        cmocka_unit_test(test_errors_name_the_setting),
        cmocka_unit_test(test_pauses_and_resumes_when_out_of_descriptors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
