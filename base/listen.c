/* SPDX-License-Identifier: Apache-2.0 */
#include "base/listen.h"

#include <errno.h>
#include <event2/listener.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/log.h"
#include "base/util.h"

struct px_listener {
    struct evconnlistener *lev; /* owned */
    struct event_base *base;    /* borrowed */
    px_conn_cfg *cfg;           /* borrowed */
    px_conn_list *list;         /* borrowed */
    struct event *resume;       /* owned: ends an accept pause */
};

static int resolve(const char *host, int port, struct addrinfo **res) {
    struct addrinfo hints = {0};
    char ps[16];
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    snprintf(ps, sizeof ps, "%d", port);
    return getaddrinfo(host, ps, &hints, res);
}

int px_listen_port_free(const char *host, int port, const char *what, char *err, size_t errlen) {
    struct addrinfo *res = NULL;
    if (resolve(host, port, &res)) return 0;
    int rc = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 && errno == EADDRINUSE) {
            snprintf(err, errlen,
                     "cannot listen on %s:%d: address already in use by another process "
                     "(%s; --reuse-port shares it on purpose)",
                     host, port, what);
            rc = -1;
        }
        close(fd);
        break; /* the first address is the one px_listen binds */
    }
    freeaddrinfo(res);
    return rc;
}

static int listen_socket(const char *host, int port, int reuse_port, const char *what, char *err,
                         size_t errlen) {
    struct addrinfo *res = NULL;
    int rc = resolve(host, port, &res);
    if (rc) {
        snprintf(err, errlen, "cannot listen on %s:%d (%s): cannot resolve the host: %s", host,
                 port, what, gai_strerror(rc));
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (reuse_port) setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 4096) == 0) break;
        snprintf(err, errlen, "cannot listen on %s:%d (%s): %s", host, port, what, strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

static void on_accept(struct evconnlistener *lev, evutil_socket_t fd, struct sockaddr *sa,
                      int salen, void *arg) {
    px_listener *l = arg;
    px_conn_accept(l->base, fd, sa, (socklen_t)salen, l->cfg, l->list);
}

static void on_resume(evutil_socket_t fd, short what, void *arg) {
    px_listener *l = arg;
    evconnlistener_enable(l->lev);
}

static void on_accept_error(struct evconnlistener *lev, void *arg) {
    px_listener *l = arg;
    int err = EVUTIL_SOCKET_ERROR();
    PX_LOG(PX_LOG_WARN, "msg=\"accept failed; pausing the listener\" error=\"%s\"",
           evutil_socket_error_to_string(err));
    evconnlistener_disable(lev);
    struct timeval tv = {0, 100000};
    event_add(l->resume, &tv);
}

int px_listen_socket(const char *host, int port, const char *what, char *err, size_t errlen) {
    return listen_socket(host, port, 0, what, err, errlen);
}

static px_listener *listener_on(struct event_base *base, int fd, const char *host, int port,
                                const char *what, px_conn_cfg *cfg, px_conn_list *list, char *err,
                                size_t errlen);

px_listener *px_listen_fd(struct event_base *base, int fd, const char *host, int port,
                          const char *what, px_conn_cfg *cfg, px_conn_list *list, char *err,
                          size_t errlen) {
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) {
        snprintf(err, errlen, "cannot listen on %s:%d (%s): %s", host, port, what,
                 strerror(errno));
        return NULL;
    }
    return listener_on(base, own, host, port, what, cfg, list, err, errlen);
}

px_listener *px_listen(struct event_base *base, const char *host, int port, int reuse_port,
                       const char *what, px_conn_cfg *cfg, px_conn_list *list, char *err,
                       size_t errlen) {
    int fd = listen_socket(host, port, reuse_port, what, err, errlen);
    if (fd < 0) return NULL;
    return listener_on(base, fd, host, port, what, cfg, list, err, errlen);
}

/* Takes fd (closed on failure). */
static px_listener *listener_on(struct event_base *base, int fd, const char *host, int port,
                                const char *what, px_conn_cfg *cfg, px_conn_list *list, char *err,
                                size_t errlen) {
    px_listener *l = px_xcalloc(1, sizeof *l);
    l->base = base;
    l->cfg = cfg;
    l->list = list;
    l->resume = evtimer_new(base, on_resume, l);
    /* Backlog 0: listen() was called already, with 4096; a negative one would
     * make libevent call it again with 128. */
    l->lev = evconnlistener_new(base, on_accept, l, LEV_OPT_CLOSE_ON_FREE, 0, fd);
    if (!l->lev || !l->resume) {
        if (!l->lev) close(fd);
        snprintf(err, errlen, "cannot listen on %s:%d (%s): cannot create the listener", host, port,
                 what);
        px_listener_free(l);
        return NULL;
    }
    evconnlistener_set_error_cb(l->lev, on_accept_error);
    return l;
}

void px_listener_free(px_listener *l) {
    if (!l) return;
    if (l->lev) evconnlistener_free(l->lev);
    if (l->resume) event_free(l->resume);
    free(l);
}
