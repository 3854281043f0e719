/* SPDX-License-Identifier: Apache-2.0 */
#include "base/conn.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/bufferevent_ssl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/ssl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "base/list.h"
#include "base/log.h"

/* CS_LINGER: a refusal was queued while the client may still be sending;
 * its bytes are read and dropped until it closes (or a short timer), so the
 * close does not turn into a reset that destroys the answer in flight. */
typedef enum { CS_HEAD, CS_BODY, CS_BUSY, CS_CLOSING, CS_LINGER } conn_state;

struct px_conn {
    struct event_base *base; /* borrowed */
    const px_conn_cfg *cfg;  /* borrowed */
    px_conn_list *list;      /* borrowed */
    struct bufferevent *bev; /* owned */
    struct event *rd;        /* owned, plain sockets only: our own read event */
    int reading;             /* rd is added */
    struct event *timer;     /* owned: idle / header timeout */
    struct event *resume;    /* owned: reads pipelined bytes on the next turn */
    struct event *flush;     /* owned: writes what was queued, once per loop turn */
    int flush_pending;
    int tls;
    px_conn *prev, *next; /* in list */
    conn_state state;
    px_http_head head; /* spans point into headbuf */
    char *headbuf;     /* owned */
    px_buf body;       /* owned until moved into a request */
    px_chunked ck;
    int64_t body_left; /* Content-Length bytes still to read */
    int keep_alive;
    int minor;
    int streaming;   /* a streamed response is open */
    int chunked_out; /* ...and it uses chunked encoding */
    int got_bytes;   /* bytes of the current request received */
    int timer_is_header;
    int head_req;                /* the request in flight is a HEAD */
    int no_body;                 /* the response in flight has no body (HEAD, 204, 304) */
    int out_blocked;             /* pipelined requests wait: too much output queued */
    int idle_due;                /* the idle timer expired while output was still queued */
    int counted;                 /* counted in cfg->shared->conns */
    int shut_wr;                 /* CS_LINGER: our side is shut down for writing */
    int64_t body_held;           /* budget taken for the body being read */
    int64_t out_held;            /* budget taken for queued output */
    size_t searched;             /* bytes of the input already searched for the head's end */
    int closed;                  /* socket closed, free scheduled */
    const px_exchange_cbs *xcbs; /* borrowed: the exchange in flight's handler */
    void *xarg;
    char peer[INET6_ADDRSTRLEN]; /* the client's address, read once at accept ("": none) */
};

static void conn_process(px_conn *c);

/* Reading on or off. A plain socket is read by our own event rather than
 * the bufferevent's, which asks the kernel how much is waiting (an ioctl)
 * before every read; TLS goes through the bufferevent. */
static void set_reading(px_conn *c, int on) {
    if (c->tls) {
        if (on)
            bufferevent_enable(c->bev, EV_READ);
        else
            bufferevent_disable(c->bev, EV_READ);
        return;
    }
    if (on == c->reading) return;
    c->reading = on;
    if (on)
        event_add(c->rd, NULL);
    else
        event_del(c->rd);
}

/* ---------- the shared budget ---------- */

int px_budget_try(px_conn_shared *sh, int64_t n) {
    if (!sh) return 1;
    long long cur = atomic_load_explicit(&sh->buffered, memory_order_relaxed);
    do {
        if (sh->max_buffered > 0 && n > 0 && cur + n > sh->max_buffered) return 0;
    } while (!atomic_compare_exchange_weak_explicit(&sh->buffered, &cur, cur + n,
                                                    memory_order_relaxed, memory_order_relaxed));
    return 1;
}

void px_budget_add(px_conn_shared *sh, int64_t n) {
    if (sh && n) atomic_fetch_add_explicit(&sh->buffered, n, memory_order_relaxed);
}

static int budget_spent(const px_conn_shared *sh) {
    return sh && sh->max_buffered > 0 &&
           atomic_load_explicit(&sh->buffered, memory_order_relaxed) >= sh->max_buffered;
}

/* Brings the budget's share of this connection's queued output up to date:
 * one atomic only when the queue's length changed since the last look. */
static void account_output(px_conn *c) {
    int64_t now = (int64_t)evbuffer_get_length(bufferevent_get_output(c->bev));
    if (now != c->out_held) {
        px_budget_add(c->cfg->shared, now - c->out_held);
        c->out_held = now;
    }
}

/* ---------- connection lifetime ---------- */

static void conn_unlink(px_conn *c) {
    PX_LIST_UNLINK(c->list->head, c);
    c->list->n--;
}

static void conn_free_cb(evutil_socket_t fd, short what, void *arg) {
    px_conn *c = arg;
    conn_unlink(c);
    px_budget_add(c->cfg->shared, -(c->body_held + c->out_held));
    if (c->counted) atomic_fetch_sub_explicit(&c->cfg->shared->conns, 1, memory_order_relaxed);
    if (c->rd) event_free(c->rd);
    bufferevent_free(c->bev);
    event_free(c->timer);
    event_free(c->resume);
    event_free(c->flush);
    px_mem_put(c->headbuf);
    px_buf_cleanup(&c->body);
    free(c);
}

/* Closes now; the memory goes on the next loop turn, since this may run
 * inside one of the connection's own callbacks. */
static void conn_close(px_conn *c) {
    if (c->closed) return;
    c->closed = 1;
    if (c->xcbs) {
        const px_exchange_cbs *cbs = c->xcbs;
        c->xcbs = NULL;
        cbs->on_gone(c->xarg);
    }
    c->state = CS_CLOSING;
    set_reading(c, 0);
    bufferevent_disable(c->bev, EV_READ | EV_WRITE);
    bufferevent_setcb(c->bev, NULL, NULL, NULL, NULL);
    evtimer_del(c->timer);
    /* Let the peer see the close at once, without waiting for the deferred
     * free (which closes the descriptor). */
    evutil_socket_t fd = bufferevent_getfd(c->bev);
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
    event_base_once(c->base, -1, EV_TIMEOUT, conn_free_cb, c, NULL);
}

static void arm_timer(px_conn *c, int header) {
    double s = header ? c->cfg->header_timeout : c->cfg->keepalive_timeout;
    struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
    c->timer_is_header = header;
    evtimer_add(c->timer, &tv);
}

/* Output is written straight to the socket once per loop turn, after every
 * callback of the turn has queued its part: a whole small response goes out
 * in one writev, and the write event (two epoll_ctl calls and a wakeup) is
 * armed only when the socket cannot take everything. */
static void queued(px_conn *c) {
    if (!c->flush_pending && !c->closed) {
        c->flush_pending = 1;
        event_active(c->flush, EV_WRITE, 0);
    }
}

static void arm_linger(px_conn *c);

/* After output left (or was queued): the budget's view, pipelined requests
 * held back for a full queue, an idle expiry that waited for the queue, a
 * refusal's lingering close. Returns 1 when the connection was closed. */
static int output_progress(px_conn *c) {
    account_output(c);
    size_t left = (size_t)c->out_held;
    struct evbuffer *in = bufferevent_get_input(c->bev);
    if (c->state == CS_LINGER) {
        if (!left && !c->shut_wr) arm_linger(c);
        return 0;
    }
    if (c->out_blocked && left <= PX_CONN_LOW_WATER) {
        c->out_blocked = 0;
        set_reading(c, 1);
        if (evbuffer_get_length(in)) event_active(c->resume, EV_TIMEOUT, 0);
    }
    if (c->idle_due && !left && c->state == CS_HEAD && !c->got_bytes && !c->out_blocked) {
        c->idle_due = 0;
        if (!evbuffer_get_length(in)) {
            conn_close(c);
            return 1;
        }
    }
    return 0;
}

static void on_flush(evutil_socket_t fd, short what, void *arg) {
    px_conn *c = arg;
    c->flush_pending = 0;
    if (c->closed) return;
    struct evbuffer *out = bufferevent_get_output(c->bev);
    if (!c->tls && evbuffer_get_length(out)) {
        /* A socket bufferevent keeps its output's start frozen except while
         * it writes itself; we write in its stead here. */
        evbuffer_unfreeze(out, 1);
        int n = evbuffer_write(out, bufferevent_getfd(c->bev));
        int err = errno;
        evbuffer_freeze(out, 1);
        errno = err;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            conn_close(c); /* the client is gone */
            return;
        }
    }
    size_t left = evbuffer_get_length(out);
    if (left) {
        /* Enabling an enabled write event would restart its --send-timeout
         * clock without any byte having left. */
        if (!(bufferevent_get_enabled(c->bev) & EV_WRITE)) bufferevent_enable(c->bev, EV_WRITE);
    } else if (c->state == CS_CLOSING) {
        conn_close(c);
        return;
    }
    if (output_progress(c)) return;
    /* A producer paused at the high-water mark hears here, too, that the
     * queue went down: the write event may never fire if this write took
     * it all. */
    if (left <= PX_CONN_LOW_WATER && c->xcbs && c->streaming && c->xcbs->on_drained)
        c->xcbs->on_drained(c->xarg);
}

/* Closes once what is queued has been written to the client. */
static void close_after_flush(px_conn *c) {
    c->state = CS_CLOSING;
    set_reading(c, 0);
    bufferevent_setwatermark(c->bev, EV_WRITE, 0, 0);
    if (evbuffer_get_length(bufferevent_get_output(c->bev)) == 0) {
        conn_close(c);
        return;
    }
    queued(c);
    arm_timer(c, 0); /* a client that never reads does not hold us forever */
}

/* After the last byte of a response is queued. */
static void exchange_done(px_conn *c) {
    c->xcbs = NULL;
    c->streaming = 0;
    px_mem_put(c->headbuf);
    c->headbuf = NULL;
    px_buf_cleanup(&c->body); /* an idle connection keeps no body's capacity */
    if (!c->keep_alive || c->cfg->draining) {
        close_after_flush(c);
        return;
    }
    c->state = CS_HEAD;
    c->got_bytes = 0;
    c->head_req = 0;
    arm_timer(c, 0);
    /* A client that pipelines requests and reads no answers would have us
     * queue answers without bound: past the high-water mark (or with the
     * process's budget spent) the next request waits for the queue to
     * drain, and the socket is not read meanwhile. */
    size_t pending = px_conn_pending(c);
    if (pending > PX_CONN_HIGH_WATER || (pending && budget_spent(c->cfg->shared))) {
        c->out_blocked = 1;
        set_reading(c, 0);
        return;
    }
    set_reading(c, 1);
    /* A pipelined request may already be buffered: read it on the next loop
     * turn, not from inside the request that is ending now. */
    if (evbuffer_get_length(bufferevent_get_input(c->bev))) event_active(c->resume, EV_TIMEOUT, 0);
}

/* ---------- responses ---------- */

/* A response head is assembled here and added to the output at once (no
 * printf, one add for a usual head). */
typedef struct head_buf {
    struct evbuffer *out;
    size_t n;
    char b[512];
} head_buf;

static void hb_put(head_buf *h, const char *p, size_t n) {
    if (h->n + n > sizeof h->b) {
        evbuffer_add(h->out, h->b, h->n);
        h->n = 0;
        if (n > sizeof h->b) {
            evbuffer_add(h->out, p, n);
            return;
        }
    }
    memcpy(h->b + h->n, p, n);
    h->n += n;
}

static void hb_puts(head_buf *h, const char *s) {
    hb_put(h, s, strlen(s));
}

static void hb_u64(head_buf *h, uint64_t v) {
    char d[20];
    char *s = px_u64_dec(d + sizeof d, v);
    hb_put(h, s, (size_t)(d + sizeof d - s));
}

static void write_head(px_conn *c, int status, const char *ctype, const char *req_id,
                       int64_t content_length, const char *extra) {
    if (c->cfg->draining) c->keep_alive = 0;
    head_buf h = {.out = bufferevent_get_output(c->bev)};
    hb_put(&h, c->minor ? "HTTP/1.1 " : "HTTP/1.0 ", 9);
    hb_u64(&h, (uint64_t)(status >= 0 ? status : 0));
    hb_put(&h, " ", 1);
    hb_puts(&h, px_http_reason(status));
    hb_put(&h, "\r\n", 2);
    if (ctype) {
        hb_put(&h, "Content-Type: ", 14);
        hb_puts(&h, ctype);
        hb_put(&h, "\r\n", 2);
    }
    if (req_id) {
        hb_put(&h, "X-Request-Id: ", 14);
        hb_puts(&h, req_id);
        hb_put(&h, "\r\n", 2);
    }
    if (extra) hb_puts(&h, extra);
    int bodiless_status = status == 204 || status == 304 || (status >= 100 && status < 200);
    if (bodiless_status) {
        /* RFC 9112 §6.3: no framing header, no body */
    } else if (content_length >= 0) {
        hb_put(&h, "Content-Length: ", 16);
        hb_u64(&h, (uint64_t)content_length);
        hb_put(&h, "\r\n", 2);
    } else if (c->chunked_out) {
        hb_put(&h, "Transfer-Encoding: chunked\r\n", 28);
    }
    if (!c->keep_alive)
        hb_put(&h, "Connection: close\r\n", 19);
    else if (c->minor == 0)
        hb_put(&h, "Connection: keep-alive\r\n", 24);
    hb_put(&h, "\r\n", 2);
    evbuffer_add(h.out, h.b, h.n);
    queued(c);
}

/* Whether the response for `status` to the request in flight carries no
 * body: the answer to a HEAD, or a 1xx, 204 or 304 (RFC 9112 §6.3). */
static void set_no_body(px_conn *c, int status) {
    c->no_body = c->head_req || status == 204 || status == 304 || (status >= 100 && status < 200);
}

void px_conn_reply(px_conn *c, int status, const char *ctype, const char *req_id, const char *extra,
                   const char *body, size_t n) {
    set_no_body(c, status);
    write_head(c, status, ctype, req_id, (int64_t)n, extra);
    if (n && !c->no_body) evbuffer_add(bufferevent_get_output(c->bev), body, n);
    exchange_done(c);
}

const char *px_error_type(int status) {
    switch (status) {
    case 401:
        return "authentication_error";
    case 404:
        return "not_found_error";
    case 429:
        return "rate_limit_error";
    case 502:
        return "bad_gateway";
    case 503:
        return "service_unavailable";
    case 504:
        return "gateway_timeout";
    default:
        return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

size_t px_conn_reply_error(px_conn *c, int status, const char *req_id, const char *extra,
                           const char *msg) {
    px_buf b;
    px_buf_init(&b);
    px_buf_appends(&b, "{\"error\":{\"message\":");
    px_buf_append_json_str(&b, msg, strlen(msg));
    px_buf_printf(&b, ",\"type\":\"%s\",\"param\":null,\"code\":%d}}", px_error_type(status),
                  status);
    px_conn_reply(c, status, "application/json", req_id, extra, b.data, b.len);
    size_t n = b.len;
    px_buf_cleanup(&b);
    return n;
}

/* Closes once the client has stopped sending (or after a short while):
 * what it sends meanwhile is read and dropped. */
static void arm_linger(px_conn *c) {
    evutil_socket_t fd = bufferevent_getfd(c->bev);
    if (fd >= 0 && !c->tls) shutdown(fd, SHUT_WR);
    c->shut_wr = 1;
    double s = c->cfg->header_timeout < 2.0 ? c->cfg->header_timeout : 2.0;
    struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
    evtimer_add(c->timer, &tv);
}

/* A refusal sent while the client may still be sending: 503 with
 * Retry-After, then a lingering close. */
static void refuse(px_conn *c, const char *msg) {
    c->keep_alive = 0;
    c->xcbs = NULL;
    px_buf b;
    px_buf_init(&b);
    px_buf_appends(&b, "{\"error\":{\"message\":");
    px_buf_append_json_str(&b, msg, strlen(msg));
    px_buf_appends(&b, ",\"type\":\"service_unavailable\",\"param\":null,\"code\":503}}");
    set_no_body(c, 503);
    write_head(c, 503, "application/json", NULL, (int64_t)b.len, "Retry-After: 1\r\n");
    if (!c->no_body) evbuffer_add(bufferevent_get_output(c->bev), b.data, b.len);
    px_buf_cleanup(&b);
    px_buf_cleanup(&c->body);
    px_budget_add(c->cfg->shared, -c->body_held);
    c->body_held = 0;
    c->state = CS_LINGER;
    set_reading(c, 1);
    evtimer_del(c->timer);
    if (c->tls) close_after_flush(c);
}

static void refuse_budget(px_conn *c) {
    px_conn_shared *sh = c->cfg->shared;
    atomic_fetch_add_explicit(&sh->budget_rejected, 1, memory_order_relaxed);
    PX_LOG(PX_LOG_WARN,
           "msg=\"request body refused: memory budget spent\" max_buffered_bytes=%lld "
           "buffered=%lld",
           (long long)sh->max_buffered, (long long)atomic_load(&sh->buffered));
    refuse(c, "request body refused: the proxy's memory budget for buffered bodies "
              "(--max-buffered-bytes) is spent; retry later");
}

/* An error found while reading the request: answer and close, since the
 * rest of the stream cannot be trusted to be framed. */
static void reject(px_conn *c, int status, const char *msg) {
    PX_LOG(PX_LOG_INFO, "msg=\"rejected request\" status=%d reason=\"%s\"", status, msg);
    c->keep_alive = 0;
    px_conn_reply_error(c, status, NULL, NULL, msg);
}

void px_conn_stream_start(px_conn *c, int status, const char *ctype, const char *req_id,
                          const char *extra) {
    c->streaming = 1;
    set_no_body(c, status);
    c->chunked_out = c->minor >= 1 && !c->no_body;
    /* HTTP/1.0: the close ends the body */
    if (!c->chunked_out && !c->no_body) c->keep_alive = 0;
    write_head(c, status, ctype, req_id, -1, extra);
}

/* Appends what a write left of [p, p + n) after `*done` bytes of it went. */
static void append_rest(struct evbuffer *out, const char *p, size_t n, size_t *done) {
    size_t skip = *done < n ? *done : n;
    *done -= skip;
    if (skip < n) evbuffer_add(out, p + skip, n - skip);
}

/* A large piece is written from the caller's memory at once, after what is
 * queued and in the same writev, rather than copied into the queue first:
 * a body relayed in big reads then costs no copy and no fresh buffer. What
 * the socket does not take is queued. A failed write is left for the flush
 * to find, since closing here would end the caller's exchange inside its
 * own call. Returns 0 when the piece should simply be queued. */
static int write_through(px_conn *c, const char *hp, size_t hn, const char *p, size_t n, int crlf) {
    struct evbuffer *out = bufferevent_get_output(c->bev);
    struct evbuffer_iovec qv[4];
    /* With a negative length, peek stops at the vector's end: the queue
     * must fit in it whole, or the piece would overtake its tail. */
    int nq = evbuffer_peek(out, -1, NULL, qv, 4);
    struct iovec iov[7];
    int k = 0;
    size_t queued_len = 0;
    for (int i = 0; i < nq; i++) {
        iov[k].iov_base = qv[i].iov_base;
        iov[k++].iov_len = qv[i].iov_len;
        queued_len += qv[i].iov_len;
    }
    if (queued_len != evbuffer_get_length(out)) return 0;
    if (hn) iov[k++] = (struct iovec){(void *)hp, hn};
    iov[k++] = (struct iovec){(void *)p, n};
    if (crlf) iov[k++] = (struct iovec){"\r\n", 2};
    ssize_t w = writev(bufferevent_getfd(c->bev), iov, k);
    size_t done = w > 0 ? (size_t)w : 0;
    size_t from_queue = done < queued_len ? done : queued_len;
    if (from_queue) {
        evbuffer_unfreeze(out, 1);
        evbuffer_drain(out, from_queue);
        evbuffer_freeze(out, 1);
    }
    done -= from_queue;
    append_rest(out, hp, hn, &done);
    append_rest(out, p, n, &done);
    if (crlf) append_rest(out, "\r\n", 2, &done);
    return 1;
}

/* Pieces at least this large are written through (see write_through). */
#define WRITE_THROUGH_MIN 8192

void px_conn_stream_write(px_conn *c, const char *p, size_t n) {
    if (!n || c->no_body) return;
    struct evbuffer *out = bufferevent_get_output(c->bev);
    /* The chunk's size line, data and CRLF: one add each, no printf. */
    char hex[24];
    int k = (int)sizeof hex;
    if (c->chunked_out) {
        hex[--k] = '\n';
        hex[--k] = '\r';
        size_t v = n;
        do {
            hex[--k] = "0123456789abcdef"[v & 15];
            v >>= 4;
        } while (v);
    }
    size_t hn = sizeof hex - (size_t)k;
    if (n >= WRITE_THROUGH_MIN && !c->tls && !c->closed &&
        write_through(c, hex + k, hn, p, n, c->chunked_out)) {
        queued(c); /* the flush accounts for what is left, and writes it */
        return;
    }
    if (hn) evbuffer_add(out, hex + k, hn);
    evbuffer_add(out, p, n);
    if (c->chunked_out) evbuffer_add(out, "\r\n", 2);
    queued(c);
}

void px_conn_stream_end(px_conn *c) {
    if (c->chunked_out) {
        evbuffer_add(bufferevent_get_output(c->bev), "0\r\n\r\n", 5);
        queued(c);
    }
    exchange_done(c);
}

void px_conn_abort(px_conn *c) {
    /* The bytes already queued are delivered; only the clean end is not. */
    c->xcbs = NULL;
    c->streaming = 0;
    close_after_flush(c);
}

const struct x509_st *px_conn_client_cert(const px_conn *c) {
    if (!c || !c->tls || !c->bev) return NULL;
    SSL *ssl = bufferevent_openssl_get_ssl(c->bev);
    X509 *x = ssl ? SSL_get0_peer_certificate(ssl) : NULL;
    return x && SSL_get_verify_result(ssl) == X509_V_OK ? x : NULL;
}

void px_conn_peer(const px_conn *c, char *out, size_t n) {
    px_strncpyz(out, n, c->peer, sizeof c->peer);
}

/* The peer's address as text, from what accept() returned: once per
 * connection, never per request ("" for a family without one). */
static void peer_text(const struct sockaddr *sa, socklen_t salen, char *out, size_t n) {
    out[0] = '\0';
    if (sa->sa_family == AF_INET && salen >= (socklen_t)sizeof(struct sockaddr_in))
        inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, out, (socklen_t)n);
    else if (sa->sa_family == AF_INET6 && salen >= (socklen_t)sizeof(struct sockaddr_in6))
        inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, out, (socklen_t)n);
}

size_t px_conn_pending(const px_conn *c) {
    return evbuffer_get_length(bufferevent_get_output(c->bev));
}

void px_conn_bind(px_conn *c, const px_exchange_cbs *cbs, void *arg) {
    c->xcbs = cbs;
    c->xarg = arg;
}

static void dispatch(px_conn *c) {
    c->state = CS_BUSY;
    evtimer_del(c->timer);
    /* The body may be moved into a request, which accounts for it from now. */
    px_budget_add(c->cfg->shared, -c->body_held);
    c->body_held = 0;
    c->cfg->dispatch(c->cfg->ctx, c, &c->head, &c->body);
}

/* ---------- reading requests ---------- */

static void read_head(px_conn *c) {
    struct evbuffer *in = bufferevent_get_input(c->bev);
    if (!c->got_bytes) {
        /* A new request starts: the header deadline replaces the idle one. */
        c->got_bytes = 1;
        c->idle_due = 0;
        arm_timer(c, 1);
    }
    long end = px_http_head_end(in, PX_HTTP_MAX_HEAD_BYTES, &c->searched);
    if (end < 0) reject(c, 431, "request header block too large");
    if (end <= 0) return;
    size_t hlen = (size_t)end;
    c->headbuf = px_mem_take(hlen);
    evbuffer_remove(in, c->headbuf, hlen);
    const char *why = NULL;
    int st = px_http_parse_head(c->headbuf, hlen, &c->head, &why);
    /* Routed and forwarded as the engines will read it (SECURITY.md). */
    if (!st) st = px_http_normalize_target(c->headbuf, &c->head, &why);
    if (st) {
        c->minor = 1;
        reject(c, st, why);
        return;
    }
    c->minor = c->head.minor;
    c->keep_alive = c->head.keep_alive;
    c->head_req = c->head.method_len == 4 && memcmp(c->head.method, "HEAD", 4) == 0;
    int64_t max = c->cfg->max_body_bytes;
    if (c->head.content_length > max) {
        reject(c, 413, "request body exceeds the size limit");
        return;
    }
    /* Refused before a byte of it is read when it cannot fit; otherwise the
     * budget is taken as the bytes arrive (an announced length costs
     * nothing until it is sent). */
    px_conn_shared *sh = c->cfg->shared;
    if (sh && sh->max_buffered > 0 && c->head.content_length > 0 &&
        atomic_load_explicit(&sh->buffered, memory_order_relaxed) + c->head.content_length >
            sh->max_buffered) {
        refuse_budget(c);
        return;
    }
    px_buf_reset(&c->body);
    c->body_left = c->head.content_length > 0 ? c->head.content_length : 0;
    px_chunked_init(&c->ck);
    if (c->head.expect_continue && c->head.minor >= 1 && (c->head.chunked || c->body_left) &&
        evbuffer_get_length(in) == 0) {
        evbuffer_add(bufferevent_get_output(c->bev), "HTTP/1.1 100 Continue\r\n\r\n", 25);
        queued(c);
    }
    c->state = CS_BODY;
}

/* The most room given to a body before its bytes arrive: an announced
 * length is a promise, and a client that does not keep it holds no more. */
#define BODY_PRESIZE ((size_t)256 * 1024)

/* Returns 1 once the whole body is in c->body. */
static int read_body(px_conn *c) {
    struct evbuffer *in = bufferevent_get_input(c->bev);
    if (!c->head.chunked) {
        size_t avail = evbuffer_get_length(in);
        size_t take = avail < (size_t)c->body_left ? avail : (size_t)c->body_left;
        if (take) {
            if (!px_budget_try(c->cfg->shared, (int64_t)take)) {
                refuse_budget(c);
                return -1;
            }
            c->body_held += (int64_t)take;
            /* A body that comes in several reads gets its room at the
             * first (up to BODY_PRESIZE): grown read by read, each
             * doubling copied the whole body again. */
            size_t room = take;
            if (c->body.len == 0 && (size_t)c->body_left > take)
                room = (size_t)c->body_left < BODY_PRESIZE ? (size_t)c->body_left : BODY_PRESIZE;
            px_buf_reserve(&c->body, room);
            evbuffer_remove(in, c->body.data + c->body.len, take);
            c->body.len += take;
            c->body.data[c->body.len] = '\0';
            c->body_left -= (int64_t)take;
        }
        return c->body_left == 0;
    }
    size_t max = (size_t)c->cfg->max_body_bytes;
    while (!c->ck.done && evbuffer_get_length(in)) {
        struct evbuffer_iovec v;
        if (evbuffer_peek(in, -1, NULL, &v, 1) < 1) break;
        size_t before = c->body.len;
        long used = px_chunked_feed(&c->ck, v.iov_base, v.iov_len, &c->body, max);
        int64_t grew = (int64_t)(c->body.len - before);
        if (used >= 0 && grew) {
            if (!px_budget_try(c->cfg->shared, grew)) {
                refuse_budget(c);
                return -1;
            }
            c->body_held += grew;
        }
        if (used == -2) {
            reject(c, 413, "request body exceeds the size limit");
            return -1;
        }
        if (used < 0) {
            reject(c, 400, "malformed chunked request body");
            return -1;
        }
        evbuffer_drain(in, (size_t)used);
    }
    return c->ck.done;
}

static void conn_process(px_conn *c) {
    if (c->state == CS_HEAD) {
        if (evbuffer_get_length(bufferevent_get_input(c->bev)) == 0) return;
        read_head(c);
        if (c->state != CS_BODY) return;
    }
    if (c->state == CS_BODY) {
        int r = read_body(c);
        if (r == 1) dispatch(c);
    }
}

static void on_resume(evutil_socket_t fd, short what, void *arg) {
    px_conn *c = arg;
    if (c->state == CS_HEAD && !c->out_blocked) conn_process(c);
}

static void on_read(struct bufferevent *bev, void *arg) {
    px_conn *c = arg;
    if (c->state == CS_BUSY) {
        /* Pipelined bytes wait until the current exchange ends; stop reading
         * (and so stop noticing a close) only if a client floods us. */
        if (evbuffer_get_length(bufferevent_get_input(bev)) > PX_HTTP_MAX_HEAD_BYTES * 4)
            set_reading(c, 0);
        return;
    }
    if (c->state == CS_LINGER) {
        evbuffer_drain(bufferevent_get_input(bev), evbuffer_get_length(bufferevent_get_input(bev)));
        return;
    }
    if (c->state == CS_CLOSING || c->out_blocked) return;
    conn_process(c);
}

/* A plain socket is readable: one read into a scratch buffer, then only
 * the bytes that came are copied into the input (a reserve of the
 * input's own would allocate a large chunk per read). */
static void on_sock_read(evutil_socket_t fd, short what, void *arg) {
    static _Thread_local char scratch[16384];
    px_conn *c = arg;
    ssize_t n = recv(fd, scratch, sizeof scratch, 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) {
        conn_close(c); /* the client closed, or the connection broke */
        return;
    }
    /* A socket bufferevent keeps its input's end frozen except while it
     * reads itself; we read in its stead here. */
    struct evbuffer *in = bufferevent_get_input(c->bev);
    evbuffer_unfreeze(in, 0);
    int added = evbuffer_add(in, scratch, (size_t)n);
    evbuffer_freeze(in, 0);
    if (added < 0) {
        conn_close(c); /* out of memory */
        return;
    }
    on_read(c->bev, c);
}

static void on_write(struct bufferevent *bev, void *arg) {
    px_conn *c = arg;
    if (c->state == CS_CLOSING) {
        if (evbuffer_get_length(bufferevent_get_output(bev)) == 0) conn_close(c);
        return;
    }
    if (!c->tls && evbuffer_get_length(bufferevent_get_output(bev)) == 0)
        bufferevent_disable(bev, EV_WRITE); /* the next output is flushed directly */
    if (output_progress(c)) return;
    if (c->xcbs && c->streaming && c->xcbs->on_drained) c->xcbs->on_drained(c->xarg);
}

static void on_event(struct bufferevent *bev, short what, void *arg) {
    px_conn *c = arg;
    if ((what & BEV_EVENT_TIMEOUT) && (what & BEV_EVENT_WRITING)) {
        /* Nothing of the queued output left for --send-timeout. */
        if (c->cfg->shared)
            atomic_fetch_add_explicit(&c->cfg->shared->send_timeouts, 1, memory_order_relaxed);
        PX_LOG(PX_LOG_INFO,
               "msg=\"closing a connection whose client reads nothing\" send-timeout_s=%g "
               "queued_bytes=%zu",
               c->cfg->send_timeout, px_conn_pending(c));
        conn_close(c);
        return;
    }
    if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR)) conn_close(c);
}

static void on_timeout(evutil_socket_t fd, short what, void *arg) {
    px_conn *c = arg;
    if (c->state == CS_CLOSING || c->state == CS_LINGER) {
        conn_close(c);
        return;
    }
    if (c->state == CS_HEAD && !c->got_bytes && px_conn_pending(c) > 0) {
        /* Still sending the last answer: idle once it is out (a client that
         * reads nothing meets --send-timeout instead). Not re-armed, so a
         * trickle of output never keeps an idle connection. */
        c->idle_due = 1;
        return;
    }
    if (c->state == CS_HEAD || c->state == CS_BODY) {
        if (c->timer_is_header && c->got_bytes) {
            PX_LOG(PX_LOG_INFO, "msg=\"client too slow sending its request\" state=%s",
                   c->state == CS_HEAD ? "head" : "body");
            c->minor = 1;
            reject(c, 408, "request not received within the client header timeout");
            return;
        }
        conn_close(c);
    }
}

px_conn *px_conn_accept(struct event_base *base, evutil_socket_t fd, const struct sockaddr *sa,
                        socklen_t salen, const px_conn_cfg *cfg, px_conn_list *list) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    px_conn *c = px_xcalloc(1, sizeof *c);
    peer_text(sa, salen, c->peer, sizeof c->peer);
    c->base = base;
    c->cfg = cfg;
    c->list = list;
    if (cfg->tls) {
        SSL *ssl = SSL_new(cfg->tls);
        c->bev = ssl ? bufferevent_openssl_socket_new(base, fd, ssl, BUFFEREVENT_SSL_ACCEPTING,
                                                      BEV_OPT_CLOSE_ON_FREE)
                     : NULL;
        if (!c->bev && ssl) SSL_free(ssl);
        /* Peers that close without close_notify are the norm over HTTP/1.1. */
        if (c->bev) bufferevent_openssl_set_allow_dirty_shutdown(c->bev, 1);
    } else {
        c->bev = bufferevent_socket_new(base, fd, BEV_OPT_CLOSE_ON_FREE);
    }
    c->timer = evtimer_new(base, on_timeout, c);
    c->resume = event_new(base, -1, 0, on_resume, c);
    c->flush = event_new(base, -1, 0, on_flush, c);
    c->tls = cfg->tls != NULL;
    if (!c->tls && c->bev) c->rd = event_new(base, fd, EV_READ | EV_PERSIST, on_sock_read, c);
    if (c->bev && cfg->send_timeout > 0) {
        double s = cfg->send_timeout;
        struct timeval wt = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
        bufferevent_set_timeouts(c->bev, NULL, &wt);
    }
    if (!c->bev || !c->timer || !c->resume || !c->flush || (!c->tls && !c->rd)) {
        if (c->rd) event_free(c->rd);
        if (c->bev)
            bufferevent_free(c->bev);
        else
            evutil_closesocket(fd);
        if (c->timer) event_free(c->timer);
        if (c->resume) event_free(c->resume);
        if (c->flush) event_free(c->flush);
        free(c);
        return NULL;
    }
    PX_LIST_PUSH(list->head, c);
    list->n++;
    px_buf_init(&c->body);
    c->state = CS_HEAD;
    c->keep_alive = 1;
    c->minor = 1;
    bufferevent_setcb(c->bev, on_read, on_write, on_event, c);
    bufferevent_setwatermark(c->bev, EV_WRITE, PX_CONN_LOW_WATER, 0);
    if (c->tls) {
        bufferevent_enable(c->bev, EV_READ | EV_WRITE);
    } else {
        /* Writes go out from on_flush; the write event only when the socket
         * is full. Reads come through our own event. */
        bufferevent_disable(c->bev, EV_READ | EV_WRITE);
        set_reading(c, 1);
    }
    arm_timer(c, 1);
    px_conn_shared *sh = cfg->shared;
    if (sh) {
        long n = atomic_fetch_add_explicit(&sh->conns, 1, memory_order_relaxed) + 1;
        c->counted = 1;
        if (sh->max_conns > 0 && n > sh->max_conns) {
            atomic_fetch_add_explicit(&sh->conns_refused, 1, memory_order_relaxed);
            /* A refused connection does not hold a slot while it lingers. */
            atomic_fetch_sub_explicit(&sh->conns, 1, memory_order_relaxed);
            c->counted = 0;
            PX_LOG(PX_LOG_WARN, "msg=\"connection refused: --max-connections reached\" max=%ld",
                   sh->max_conns);
            refuse(c, "too many client connections (--max-connections); retry later");
        }
    }
    return c;
}

void px_conn_list_close_idle(px_conn_list *list) {
    for (px_conn *c = list->head; c; c = c->next)
        if (c->state == CS_HEAD && !c->got_bytes) {
            if (px_conn_pending(c))
                close_after_flush(c);
            else
                conn_close(c);
        }
}

void px_conn_list_close_all(px_conn_list *list) {
    /* The loop has stopped: the deferred frees will never run, so free here. */
    while (list->head) {
        px_conn *c = list->head;
        conn_close(c);
        conn_free_cb(-1, 0, c);
    }
}
