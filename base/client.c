/* SPDX-License-Identifier: Apache-2.0 */
#include "base/client.h"

#include <errno.h>
#include <stdatomic.h>
#include <event2/buffer.h>
#include <event2/event_struct.h> /* events embedded in a request: no allocation each */
#include <linux/sockios.h>       /* SIOCOUTQ */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include "base/hash.h"
#include "base/list.h"

#define MAX_RESP_HEAD (64 * 1024)
/* 1xx answers skipped before a response: more is a broken or hostile backend. */
#define MAX_INFORMATIONAL 32

typedef enum { BM_NONE, BM_LENGTH, BM_CHUNKED, BM_CLOSE } body_mode;

typedef struct cconn cconn;

/* One backend address and its idle connections. It lives while a request
 * or a connection (idle or busy) refers to it, so addresses that come and
 * go (DNS discovery, reloads) leave nothing behind. */
typedef struct host {
    struct sockaddr_storage sa;
    socklen_t salen;
    cconn *idle; /* most recently used first */
    int nidle;
    int refs;    /* requests and connections that point here */
    int retired; /* no longer a backend: connections close after their exchange */
    int echoes;  /* its answers' X-Request-Id held the id sent: from now on they must */
    struct host *prev, *next;
    struct host *hnext; /* in its bucket of cl->tab */
    uint64_t hash;      /* of sa */
} host;

struct px_client {
    struct event_base *base; /* borrowed */
    int max_idle;
    double idle_close_s;
    host *hosts;  /* owned */
    host **tab;   /* owned: hosts by address hash, chained (10,000 backends: no list walk) */
    size_t ntab;  /* a power of two, or 0 */
    cconn *busy;  /* owned: connections with an exchange */
    size_t nidle; /* all hosts */
    size_t nhosts;
    px_http_head scratch; /* the response head being read (one at a time per loop) */
    char *rbuf;           /* owned: RBUF_BYTES, what one read brings (one read at a time) */
};

#define RBUF_BYTES (64 * 1024)

/* A connection is a socket with two events of its own, not a bufferevent:
 * reads go straight into the input buffer (no FIONREAD per read), writes
 * straight out with writev, and the read event stays registered for the
 * connection's life, so a request costs no epoll_ctl; the write event is
 * added only while the kernel cannot take the output. */
struct cconn {
    px_client *cl;
    host *h; /* borrowed: its address's pool */
    evutil_socket_t fd;
    struct event *rev;    /* owned: EV_READ|EV_PERSIST, added unless paused */
    struct event *wev;    /* owned: EV_WRITE|EV_PERSIST, added while output waits */
    struct evbuffer *in;  /* owned */
    struct evbuffer *out; /* owned */
    int reading, writing; /* rev / wev added */
    int connecting;
    int connect_err;     /* connect() failed at once with this */
    struct event *timer; /* owned: closes it after idle_close_s idle */
    cconn *prev, *next;  /* in h->idle or cl->busy */
    int idle;
    int reused; /* served an exchange before the current one */
    uint64_t idle_since_ns;
    px_creq *q; /* the exchange in flight, or NULL when idle */
    int *freed; /* set to 1 when freed, while a read lends cl->rbuf to `in` */
};

struct px_creq {
    px_client *cl; /* borrowed */
    cconn *cn;     /* owned while the exchange runs */
    host *h;       /* borrowed */
    px_buf head;   /* owned: the request head, kept for the one resend */
    const char *body;
    size_t body_len;
    size_t req_bytes;
    px_creq_opts o;
    px_creq_cbs cbs;
    void *arg;
    /* Embedded (assigned, not allocated: none costs a malloc per request). */
    struct event timer;     /* connect, then total timeout */
    struct event resume_ev; /* reads on after a pause, on the next loop turn */
    struct event idle_ev;   /* opts.idle_timeout without a byte */
    struct event acked_ev;  /* abort_after_upload waits for the peer's ACKs */
    uint64_t t_start_ns;
    uint64_t last_read_ns; /* opts.idle_timeout counts from here */
    int connected;
    int answering;
    int head_done;
    body_mode mode;
    int64_t left; /* BM_LENGTH: bytes still to come */
    px_chunked ck;
    size_t raw_pending; /* BM_CHUNKED: decoded body bytes at the input's start, undelivered */
    int paused;
    int keep_alive;
    int eof;
    int rerr; /* the connection failed (reset), not closed cleanly */
    int upload_done;
    int abort_after_upload;
    int resent;
    size_t searched;
    int n_informational; /* 1xx heads skipped so far */
    int early;           /* an answer began before the request was written whole, or the write
                            side was shut: the connection is not reused */
};

/* Process-wide: answers that were not their request's (see client.h). */
static atomic_ullong answers_mismatched, answers_early;

void px_client_answer_counts(unsigned long long *mismatched, unsigned long long *early) {
    *mismatched = atomic_load_explicit(&answers_mismatched, memory_order_relaxed);
    *early = atomic_load_explicit(&answers_early, memory_order_relaxed);
}

static struct timeval tv_of(double s) {
    struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
    return tv;
}

/* ---------- connection lifetime ---------- */

static void host_unref(px_client *cl, host *h) {
    if (--h->refs > 0) return;
    host **at = &cl->tab[h->hash & (cl->ntab - 1)];
    while (*at != h)
        at = &(*at)->hnext;
    *at = h->hnext;
    PX_LIST_UNLINK(cl->hosts, h);
    cl->nhosts--;
    free(h);
}

static void conn_free(cconn *c) {
    if (c->freed) *c->freed = 1;
    if (c->idle) {
        PX_LIST_UNLINK(c->h->idle, c);
        c->h->nidle--;
        c->cl->nidle--;
    } else {
        PX_LIST_UNLINK(c->cl->busy, c);
    }
    host_unref(c->cl, c->h);
    event_free(c->rev);
    event_free(c->wev);
    evbuffer_free(c->in);
    evbuffer_free(c->out);
    evutil_closesocket(c->fd);
    event_free(c->timer);
    free(c);
}

static void set_reading(cconn *c, int on) {
    if (on == c->reading) return;
    c->reading = on;
    if (on)
        event_add(c->rev, NULL);
    else
        event_del(c->rev);
}

static void set_writing(cconn *c, int on) {
    if (on == c->writing) return;
    c->writing = on;
    if (on)
        event_add(c->wev, NULL);
    else
        event_del(c->wev);
}

/* The host of an address, with a reference taken for the caller. */
static host *host_for(px_client *cl, const struct sockaddr *sa, socklen_t salen) {
    uint64_t hash = px_hash64(sa, salen);
    for (host *h = cl->ntab ? cl->tab[hash & (cl->ntab - 1)] : NULL; h; h = h->hnext)
        if (h->hash == hash && h->salen == salen && !memcmp(&h->sa, sa, salen)) {
            h->retired = 0; /* a backend again */
            h->refs++;
            return h;
        }
    if (cl->nhosts + 1 > cl->ntab) { /* at most one host a bucket on average */
        free(cl->tab);
        cl->ntab = cl->ntab ? cl->ntab * 2 : 16;
        cl->tab = px_xcalloc(cl->ntab, sizeof *cl->tab);
        for (host *o = cl->hosts; o; o = o->next) {
            o->hnext = cl->tab[o->hash & (cl->ntab - 1)];
            cl->tab[o->hash & (cl->ntab - 1)] = o;
        }
    }
    host *h = px_xcalloc(1, sizeof *h);
    memcpy(&h->sa, sa, salen);
    h->salen = salen;
    h->refs = 1;
    h->hash = hash;
    h->hnext = cl->tab[hash & (cl->ntab - 1)];
    cl->tab[hash & (cl->ntab - 1)] = h;
    PX_LIST_PUSH(cl->hosts, h);
    cl->nhosts++;
    return h;
}

/* ---------- idle connections ---------- */

static void on_idle_timer(evutil_socket_t fd, short what, void *arg) {
    conn_free(arg);
}

static void to_idle(cconn *c) {
    px_client *cl = c->cl;
    PX_LIST_UNLINK(cl->busy, c);
    c->idle = 1;
    c->reused = 1;
    c->idle_since_ns = px_now_ns();
    set_writing(c, 0);
    /* Reading stays on: a backend closing an idle connection (or sending
     * what nobody asked for) is noticed at once, and the connection goes. */
    set_reading(c, 1);
    struct timeval tv = tv_of(cl->idle_close_s);
    evtimer_add(c->timer, &tv);
    PX_LIST_PUSH(c->h->idle, c);
    c->h->nidle++;
    cl->nidle++;
    if (c->h->nidle > cl->max_idle) {
        cconn *old = c->h->idle;
        while (old->next)
            old = old->next;
        conn_free(old);
    }
}

/* ---------- the exchange ---------- */

static void on_readable(evutil_socket_t fd, short what, void *arg);
static void on_writable(evutil_socket_t fd, short what, void *arg);
static void process(px_creq *q);
static void fail(px_creq *q, px_cresult r, const char *why);

static void on_resume(evutil_socket_t fd, short what, void *arg);
static void on_idle_timeout(evutil_socket_t fd, short what, void *arg);
static void on_acked_poll(evutil_socket_t fd, short what, void *arg);

/* One of the exchange's embedded events other than its timer, assigned on
 * first use: most exchanges never pause, time out idle or abort, and each
 * assigned event is one more to delete when the exchange ends. */
static struct event *q_ev(px_creq *q, struct event *ev, event_callback_fn cb) {
    if (!event_initialized(ev)) event_assign(ev, q->cl->base, -1, 0, cb, q);
    return ev;
}

static void creq_free(px_creq *q) {
    host_unref(q->cl, q->h);
    event_del(&q->timer);
    if (event_initialized(&q->resume_ev)) event_del(&q->resume_ev);
    if (event_initialized(&q->idle_ev)) event_del(&q->idle_ev);
    if (event_initialized(&q->acked_ev)) event_del(&q->acked_ev);
    px_buf_cleanup(&q->head);
    px_mem_put(q);
}

/* Whether any byte of the request was handed to the kernel. */
static int request_sent_bytes(const px_creq *q) {
    if (!q->cn) return 0;
    return evbuffer_get_length(q->cn->out) < q->req_bytes;
}

/* Whether any byte of the request may have reached the backend. */
static int request_sent(const px_creq *q) {
    return q->connected && request_sent_bytes(q);
}

static void finish(px_creq *q, px_cresult r, const char *why) {
    cconn *c = q->cn;
    int sent = r == PX_CR_OK || request_sent(q);
    if (c) {
        c->q = NULL;
        if (r == PX_CR_OK && q->keep_alive && !q->eof && !c->h->retired && !q->early &&
            !evbuffer_get_length(c->in) && !evbuffer_get_length(c->out)) {
            to_idle(c);
        } else {
            conn_free(c);
        }
        q->cn = NULL;
    }
    px_creq_cbs cbs = q->cbs;
    void *arg = q->arg;
    creq_free(q);
    cbs.on_done(arg, r, why, sent);
}

static int attach(px_creq *q, cconn *c);
static void arm_total(px_creq *q);

/* A fresh connection to q's backend. 0, or -1 when no socket could be had. */
static int connect_new(px_creq *q) {
    px_client *cl = q->cl;
    int fd = socket(q->h->sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    cconn *c = px_xcalloc(1, sizeof *c);
    c->cl = cl;
    c->fd = fd;
    c->rev = event_new(cl->base, fd, EV_READ | EV_PERSIST, on_readable, c);
    c->wev = event_new(cl->base, fd, EV_WRITE | EV_PERSIST, on_writable, c);
    c->in = evbuffer_new();
    c->out = evbuffer_new();
    c->timer = evtimer_new(cl->base, on_idle_timer, c);
    if (!c->rev || !c->wev || !c->in || !c->out || !c->timer) {
        if (c->rev) event_free(c->rev);
        if (c->wev) event_free(c->wev);
        if (c->in) evbuffer_free(c->in);
        if (c->out) evbuffer_free(c->out);
        if (c->timer) event_free(c->timer);
        close(fd);
        free(c);
        return -1;
    }
    c->h = q->h;
    c->h->refs++;
    PX_LIST_PUSH(cl->busy, c);
    q->connected = 0;
    struct timeval tv = tv_of(q->o.connect_timeout > 0 ? q->o.connect_timeout : 5.0);
    evtimer_add(&q->timer, &tv);
    int r = connect(fd, (struct sockaddr *)&q->h->sa, q->h->salen);
    /* Refused at once (loopback) is reported from the loop like a late
     * failure, never from inside px_creq_start: the write event tells. */
    c->connecting = r < 0;
    if (r < 0 && errno != EINPROGRESS) c->connect_err = errno ? errno : ECONNREFUSED;
    attach(q, c);
    if (c->connect_err) event_active(c->wev, EV_WRITE, 0);
    if (!c->connecting) {
        q->connected = 1;
        arm_total(q);
    }
    return 0;
}

static void arm_total(px_creq *q) {
    if (q->o.total_timeout <= 0) {
        evtimer_del(&q->timer);
        return;
    }
    double left = q->o.total_timeout - (double)(px_now_ns() - q->t_start_ns) / 1e9;
    struct timeval tv = tv_of(left > 0.001 ? left : 0.001);
    evtimer_add(&q->timer, &tv);
}

static void flush(cconn *c);

/* Hands q's request to connection c, and writes it when it can. */
static int attach(px_creq *q, cconn *c) {
    q->cn = c;
    c->q = q;
    if (!c->connecting && evbuffer_get_length(c->out) == 0) {
        /* Written at once from the request's own memory; only what the
         * socket does not take is queued. A failed write is queued whole
         * and left to flush(), which meets the error again and handles
         * it as always. */
        set_reading(c, 1);
        struct iovec iov[2] = {{q->head.data, q->head.len}, {(void *)q->body, q->body_len}};
        ssize_t w = writev(c->fd, iov, q->body_len ? 2 : 1);
        size_t done = w > 0 ? (size_t)w : 0;
        if (done < q->head.len) evbuffer_add(c->out, q->head.data + done, q->head.len - done);
        size_t bdone = done > q->head.len ? done - q->head.len : 0;
        if (bdone < q->body_len)
            evbuffer_add_reference(c->out, q->body + bdone, q->body_len - bdone, NULL, NULL);
        flush(c);
        return 0;
    }
    evbuffer_add(c->out, q->head.data, q->head.len);
    if (q->body_len) evbuffer_add_reference(c->out, q->body, q->body_len, NULL, NULL);
    set_reading(c, 1);
    if (c->connecting)
        set_writing(c, 1); /* writable: connected (or failed) */
    else
        flush(c);
    return 0;
}

/* The one resend: the request went to a reused connection that turned out
 * dead before the kernel took a byte of it (the write itself failed), so
 * the backend cannot have read any. Once bytes left, never: a reset after
 * the backend read the request looks the same as one before. */
static int may_resend(px_creq *q) {
    cconn *c = q->cn;
    return c && c->reused && !q->resent && !q->answering && !request_sent_bytes(q);
}

static void fail(px_creq *q, px_cresult r, const char *why) {
    if ((r == PX_CR_RESET) && may_resend(q)) {
        cconn *c = q->cn;
        c->q = NULL;
        conn_free(c);
        q->cn = NULL;
        q->resent = 1;
        q->eof = 0;
        q->rerr = 0;
        q->searched = 0;
        if (connect_new(q) == 0) return;
        r = PX_CR_CONNECT;
        why = "no socket for the resend";
    }
    finish(q, r, why);
}

/* Writes what the output holds; the write event only while the kernel
 * cannot take it all. May finish the exchange (abort after upload). */
static void flush(cconn *c) {
    px_creq *q = c->q;
    while (evbuffer_get_length(c->out)) {
        int n = evbuffer_write(c->out, c->fd);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            if (errno == EINTR) continue;
            set_writing(c, 0);
            if (q) {
                /* A reset on write: process() decides (the one resend when
                 * nothing left, else a failure) from the loop, never from
                 * inside px_creq_start, whose caller has no handle yet. */
                q->eof = 1;
                q->rerr = 1;
                set_reading(c, 0);
                event_active(q_ev(q, &q->resume_ev, on_resume), EV_TIMEOUT, 0);
            } else {
                conn_free(c);
            }
            return;
        }
    }
    int left = evbuffer_get_length(c->out) != 0;
    set_writing(c, left);
    if (!left && q && !q->upload_done) {
        q->upload_done = 1;
        /* Abort once the backend's kernel holds the whole request (polled:
         * a rare path, taken when a client leaves mid-upload). */
        if (q->abort_after_upload) {
            struct timeval now = {0, 0};
            evtimer_add(q_ev(q, &q->acked_ev, on_acked_poll), &now);
        }
    }
}

static void on_writable(evutil_socket_t fd, short what, void *arg) {
    cconn *c = arg;
    px_creq *q = c->q;
    if (c->connecting) {
        int err = c->connect_err;
        socklen_t len = sizeof err;
        if (!err && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
        if (err == EINPROGRESS) return;
        c->connecting = 0;
        if (err) {
            set_writing(c, 0);
            if (q)
                fail(q, PX_CR_CONNECT, evutil_socket_error_to_string(err));
            else
                conn_free(c);
            return;
        }
        if (q) {
            q->connected = 1;
            arm_total(q);
        }
    }
    flush(c);
}

static void on_timer(evutil_socket_t fd, short what, void *arg) {
    px_creq *q = arg;
    if (!q->connected)
        fail(q, PX_CR_TIMEOUT, "connect timeout"); /* sent stays 0 */
    else
        fail(q, PX_CR_TIMEOUT, "total timeout");
}

/* Whether the backend's kernel acknowledged every byte we wrote: the
 * request is there, not only in our send queue. */
static int all_acked(px_creq *q) {
    int outq = 0;
    return !q->cn || ioctl(q->cn->fd, SIOCOUTQ, &outq) < 0 || outq == 0;
}

static void on_acked_poll(evutil_socket_t fd, short what, void *arg) {
    px_creq *q = arg;
    if (all_acked(q)) {
        fail(q, PX_CR_ABORTED, "aborted after the upload");
        return;
    }
    struct timeval tv = {0, 5000};
    evtimer_add(&q->acked_ev, &tv);
}

/* opts.idle_timeout: armed once; a read only notes the time, and the
 * timer waits out the rest when it fires after activity. */
static void arm_idle(px_creq *q, double s) {
    struct timeval tv = tv_of(s > 0.001 ? s : 0.001);
    evtimer_add(q_ev(q, &q->idle_ev, on_idle_timeout), &tv);
}

static void on_idle_timeout(evutil_socket_t fd, short what, void *arg) {
    px_creq *q = arg;
    double idle = (double)(px_now_ns() - q->last_read_ns) / 1e9;
    if (idle < q->o.idle_timeout) {
        arm_idle(q, q->o.idle_timeout - idle);
        return;
    }
    fail(q, PX_CR_TIMEOUT, "no byte from the backend within the idle timeout");
}

static void on_resume(evutil_socket_t fd, short what, void *arg) {
    process(arg);
}

/* One read. With nothing pending, the bytes land in the client's read
 * buffer, which the input borrows while they are processed (no chunk
 * allocated per read, no copy of a body that is passed on at once); what
 * is left unconsumed is copied before the next read. Otherwise the read
 * goes straight into the input. */
static void on_readable(evutil_socket_t fd, short what, void *arg) {
    cconn *c = arg;
    px_creq *q = c->q;
    if (c->connecting) return; /* the write event tells */
    int borrowed = q && evbuffer_get_length(c->in) == 0;
    struct evbuffer_iovec v[2];
    int nv = 0;
    ssize_t n;
    if (borrowed) {
        n = recv(fd, c->cl->rbuf, RBUF_BYTES, 0);
    } else {
        nv = evbuffer_reserve_space(c->in, RBUF_BYTES, v, 2);
        n = nv > 0 ? readv(fd, (struct iovec *)v, nv) : -1;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n > 0) {
        if (borrowed) {
            if (evbuffer_add_reference(c->in, c->cl->rbuf, (size_t)n, NULL, NULL) < 0) {
                fail(q, PX_CR_RESET, "out of memory reading the response");
                return;
            }
        } else {
            size_t left = (size_t)n;
            for (int i = 0; i < nv; i++) {
                size_t take = left < v[i].iov_len ? left : v[i].iov_len;
                v[i].iov_len = take;
                left -= take;
            }
            evbuffer_commit_space(c->in, v, nv);
        }
        if (!q) {
            conn_free(c); /* bytes nobody asked for: not reusable */
            return;
        }
        if (q->o.idle_timeout > 0) q->last_read_ns = px_now_ns();
        if (!borrowed) {
            process(q);
            return;
        }
        int freed = 0;
        c->freed = &freed;
        process(q);
        if (freed) return;
        c->freed = NULL;
        size_t rest = evbuffer_get_length(c->in);
        if (rest) {
            /* Paused, or a partial head: keep an own copy, then let go of
             * the borrowed bytes. */
            const unsigned char *p = evbuffer_pullup(c->in, (ev_ssize_t)rest);
            if (!p || evbuffer_add(c->in, p, rest) < 0) {
                if (c->q)
                    fail(c->q, PX_CR_RESET, "out of memory reading the response");
                else
                    conn_free(c);
                return;
            }
            evbuffer_drain(c->in, rest);
        }
        return;
    }
    if (!q) {
        conn_free(c); /* the backend closed an idle connection */
        return;
    }
    set_reading(c, 0);
    q->eof = 1; /* what is buffered is still the response's */
    q->rerr = n < 0;
    process(q);
}

/* Reads the response head when it is complete. 1: done (q->head_done),
 * 0: more bytes needed, -1: q was finished. */
static int read_head(px_creq *q, struct evbuffer *in) {
    for (;;) {
        size_t len = evbuffer_get_length(in);
        if (!len) return 0;
        if (!q->answering && !q->upload_done && !q->early) {
            /* Answering what it has not read: another request's answer,
             * or an engine out of step. This connection is not reused. */
            q->early = 1;
            atomic_fetch_add_explicit(&answers_early, 1, memory_order_relaxed);
        }
        q->answering = 1;
        long end = px_http_head_end(in, MAX_RESP_HEAD, &q->searched);
        if (end < 0) {
            fail(q, PX_CR_PROTOCOL, "response head too large");
            return -1;
        }
        if (end == 0) {
            /* A head ended by bare LFs never gets its CRLFCRLF: fail now
             * rather than at the idle timeout. */
            struct evbuffer_ptr lf = evbuffer_search(in, "\n\n", 2, NULL);
            if (lf.pos >= 0) {
                fail(q, PX_CR_PROTOCOL, "bare LF in the response head");
                return -1;
            }
            return 0;
        }
        size_t hlen = (size_t)end;
        /* Header spans point into this copy while on_head runs. */
        char *buf = (char *)evbuffer_pullup(in, (ev_ssize_t)hlen);
        px_http_head *h = &q->cl->scratch;
        const char *why = NULL;
        if (!buf || px_http_parse_response(buf, hlen, h, &why)) {
            fail(q, PX_CR_PROTOCOL, why ? why : "malformed response head");
            return -1;
        }
        if (h->status == 101) { /* never asked for: the connection is no longer HTTP */
            fail(q, PX_CR_PROTOCOL, "101 Switching Protocols, but no upgrade was asked for");
            return -1;
        }
        if (h->status >= 100 && h->status < 200) { /* 100 Continue and the like */
            if (++q->n_informational > MAX_INFORMATIONAL) {
                fail(q, PX_CR_PROTOCOL, "too many 1xx answers before the response");
                return -1;
            }
            evbuffer_drain(in, hlen);
            continue;
        }
        const px_http_header *x = q->o.expect_id ? px_http_find(h, "x-request-id") : NULL;
        if (x) {
            /* A backend that echoed the id sent (as it is, or inside its
             * own) is held to it; one that sends ids of its own is not. */
            size_t el = strlen(q->o.expect_id);
            if (el && memmem(x->value, x->value_len, q->o.expect_id, el)) {
                q->h->echoes = 1;
            } else if (q->h->echoes) {
                atomic_fetch_add_explicit(&answers_mismatched, 1, memory_order_relaxed);
                fail(q, PX_CR_MISMATCH, "the answer names another request (X-Request-Id)");
                return -1;
            }
        }
        int st = h->status;
        if (q->o.head_request || st == 204 || st == 304) {
            q->mode = BM_NONE;
        } else if (h->chunked) {
            q->mode = BM_CHUNKED;
            px_chunked_init(&q->ck);
        } else if (h->content_length >= 0) {
            q->mode = BM_LENGTH;
            q->left = h->content_length;
        } else {
            q->mode = BM_CLOSE;
        }
        q->keep_alive = h->keep_alive && q->mode != BM_CLOSE;
        q->head_done = 1;
        q->cbs.on_head(q->arg, h);
        evbuffer_drain(in, hlen); /* after on_head: its spans point into these bytes */
        return 1;
    }
}

/* Feeds what the input holds to on_data until it pauses, the body ends or
 * the input runs dry. */
static void process(px_creq *q) {
    if (q->paused || !q->cn) return;
    struct evbuffer *in = q->cn->in;
    if (!q->head_done) {
        int r = read_head(q, in);
        if (r < 0) return;
        if (r == 0) {
            if (q->eof) fail(q, PX_CR_RESET, "closed before the response head");
            return;
        }
    }
    for (;;) {
        if (q->mode == BM_NONE || (q->mode == BM_LENGTH && q->left == 0) ||
            (q->mode == BM_CHUNKED && q->ck.done && !q->raw_pending)) {
            finish(q, PX_CR_OK, "");
            return;
        }
        struct evbuffer_iovec v;
        if (evbuffer_peek(in, -1, NULL, &v, 1) < 1 || v.iov_len == 0) break;
        const char *data = v.iov_base;
        size_t dn = v.iov_len, used = v.iov_len, framing = 0;
        if (q->mode == BM_CHUNKED) {
            if (q->raw_pending) {
                if (dn > q->raw_pending) dn = q->raw_pending;
                used = dn;
            } else {
                long u = px_chunked_span(&q->ck, v.iov_base, v.iov_len, &data, &dn);
                if (u < 0) {
                    fail(q, PX_CR_PROTOCOL, "malformed chunked response body");
                    return;
                }
                used = (size_t)u;
                framing = used - dn;
            }
        } else if (q->mode == BM_LENGTH && (int64_t)dn > q->left) {
            dn = used = (size_t)q->left;
        }
        if (dn) {
            int r = q->cbs.on_data(q->arg, data, dn);
            if (r < 0) {
                fail(q, PX_CR_ABORTED, "the receiver stopped the transfer");
                return;
            }
            if (r > 0) {
                /* Not consumed: keep the bytes, drop only the framing before
                 * them, and stop reading until resumed. */
                if (q->mode == BM_CHUNKED && !q->raw_pending) {
                    evbuffer_drain(in, framing);
                    q->raw_pending = dn;
                }
                q->paused = 1;
                set_reading(q->cn, 0);
                return;
            }
        }
        evbuffer_drain(in, used);
        if (q->mode == BM_CHUNKED && q->raw_pending) q->raw_pending -= dn;
        if (q->mode == BM_LENGTH) q->left -= (int64_t)dn;
    }
    if (q->eof) {
        if (q->mode == BM_CLOSE && !q->rerr)
            finish(q, PX_CR_OK, "");
        else
            fail(q, PX_CR_RESET, "closed before the response body was complete");
    }
}

/* An idle connection this long is peeked at before it is used (below). */
#define PEEK_AFTER_IDLE_NS 1000000000ull

/* Whether the connection's read event is due in this loop turn: the
 * kernel reported it in the epoll_wait whose events are being run, and its
 * callback has not run yet. libevent has no call that says so, but refuses
 * to change the priority of an active event (and only then, for a valid
 * priority), which tells. */
static int read_due(cconn *c) {
    return event_priority_set(c->rev, event_get_priority(c->rev)) < 0;
}

/* Whether an idle connection may carry the next request. A backend that
 * closed it, or that sent bytes nobody asked for (a second answer, an
 * answer before the request), makes it unusable: such bytes must never be
 * read as the next request's answer, they could be another request's, with
 * another user's kv_transfer_params. The idle connection's read event
 * catches both: before this loop turn it closed the connection already,
 * and in this turn (the kernel reported it with the event that brought the
 * request here, its callback not run yet) read_due says so. No system call
 * is spent on it per request. What no event shows is what arrived after
 * the loop last asked the kernel; for a stray answer that window is as
 * short as the one after the request is written (HTTP/1.1 cannot tell
 * those apart either). A backend's keep-alive timer, though, fires after
 * an idle time, and may fire while the loop is busy with the rest of its
 * turn: a connection idle for over PEEK_AFTER_IDLE_NS (1 s: far above a
 * loop turn, below the keep-alive timeouts servers use, uvicorn's 5 s
 * among them) is peeked at once more, so that such a close is not met by
 * a request that is then lost (a close after the write reads as a failure
 * after sending, which is never resent). Under load connections are
 * reused well within that (a pool's least used ones too, which a shorter
 * bound peeked at under load), and pay nothing. */
static int usable(cconn *c) {
    if (read_due(c)) return 0;
    if (px_now_ns() - c->idle_since_ns < PEEK_AFTER_IDLE_NS) return 1;
    char b;
    ssize_t r = recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

/* ---------- public ---------- */

px_client *px_client_create(struct event_base *base, const px_client_cfg *cfg) {
    px_client *c = px_xcalloc(1, sizeof *c);
    c->base = base;
    c->max_idle = cfg && cfg->max_idle_per_host > 0 ? cfg->max_idle_per_host : 64;
    c->idle_close_s = cfg && cfg->idle_close_s > 0 ? cfg->idle_close_s : 4.0;
    c->rbuf = px_xmalloc(RBUF_BYTES);
    return c;
}

void px_client_retire(px_client *cl,
                      int (*keep)(void *ctx, const struct sockaddr *sa, socklen_t salen),
                      void *ctx) {
    host *h = cl->hosts;
    while (h) {
        host *next = h->next;
        if (!keep(ctx, (const struct sockaddr *)&h->sa, h->salen)) {
            h->retired = 1;
            h->refs++; /* held while its idle connections go */
            while (h->idle)
                conn_free(h->idle);
            host_unref(cl, h);
        }
        h = next;
    }
}

void px_client_destroy(px_client *c) {
    if (!c) return;
    while (c->busy) {
        cconn *k = c->busy;
        if (k->q) {
            creq_free(k->q);
            k->q = NULL;
        }
        conn_free(k);
    }
    /* What is left is held by idle connections only: the owner cancelled
     * its requests first. */
    while (c->hosts) {
        host *h = c->hosts;
        h->refs++;
        while (h->idle)
            conn_free(h->idle);
        h->refs = 1;
        host_unref(c, h);
    }
    free(c->rbuf);
    free(c->tab);
    free(c);
}

px_creq *px_creq_start(px_client *cl, const struct sockaddr *sa, socklen_t salen, const char *head,
                       size_t head_len, const char *body, size_t len, const px_creq_opts *o,
                       const px_creq_cbs *cbs, void *arg) {
    if (salen > sizeof(struct sockaddr_storage)) return NULL;
    px_creq *q = px_mem_zalloc(sizeof *q);
    q->cl = cl;
    q->h = host_for(cl, sa, salen);
    px_buf_init(&q->head);
    px_buf_append(&q->head, head, head_len);
    q->body = body;
    q->body_len = len;
    q->req_bytes = head_len + len;
    q->o = *o;
    q->cbs = *cbs;
    q->arg = arg;
    q->t_start_ns = px_now_ns();
    evtimer_assign(&q->timer, cl->base, on_timer, q);
    if (q->o.idle_timeout > 0) { /* on a reused connection as on a new one */
        q->last_read_ns = q->t_start_ns;
        arm_idle(q, q->o.idle_timeout);
    }
    host *h = q->h;
    while (h->idle && !usable(h->idle))
        conn_free(h->idle);
    if (h->idle) {
        cconn *c = h->idle;
        PX_LIST_UNLINK(h->idle, c);
        h->nidle--;
        cl->nidle--;
        c->idle = 0;
        evtimer_del(c->timer);
        PX_LIST_PUSH(cl->busy, c);
        q->connected = 1;
        arm_total(q);
        attach(q, c);
        return q;
    }
    if (connect_new(q) < 0) {
        creq_free(q);
        return NULL;
    }
    return q;
}

int px_creq_answering(const px_creq *q) {
    return q && q->answering;
}

int px_creq_abort_after_upload(px_creq *q) {
    if (q->upload_done && all_acked(q)) return 1;
    q->abort_after_upload = 1;
    if (q->upload_done) {
        struct timeval soon = {0, 5000};
        evtimer_add(q_ev(q, &q->acked_ev, on_acked_poll), &soon);
    }
    return 0;
}

int px_creq_shutdown_write(px_creq *q) {
    if (!q->cn || !q->upload_done || q->cn->connecting) return -1;
    q->early = 1; /* not reused: its other side is shut */
    return shutdown(q->cn->fd, SHUT_WR) == 0 ? 0 : -1;
}

void px_creq_resume(px_creq *q) {
    if (!q || !q->paused) return;
    q->paused = 0;
    if (q->cn && !q->eof) set_reading(q->cn, 1);
    /* On the next loop turn: the caller may be inside its own callbacks, and
     * what is delivered may end the exchange. */
    event_active(q_ev(q, &q->resume_ev, on_resume), EV_TIMEOUT, 0);
}

void px_creq_cancel(px_creq *q) {
    if (!q) return;
    if (q->cn) {
        q->cn->q = NULL;
        conn_free(q->cn);
    }
    creq_free(q);
}

size_t px_client_hosts(const px_client *c) {
    return c->nhosts;
}

size_t px_client_idle(const px_client *c) {
    return c->nidle;
}
