#include "server.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/listener.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "http.h"
#include "log.h"
#include "request.h"

typedef enum { CS_HEAD, CS_BODY, CS_BUSY, CS_CLOSING } conn_state;

struct px_conn {
    px_worker *w;             /* borrowed */
    struct bufferevent *bev;  /* owned */
    struct event *timer;      /* owned: idle / header timeout */
    struct event *resume;     /* owned: reads pipelined bytes on the next turn */
    px_conn *prev, *next;     /* in the worker's list of connections */
    conn_state state;
    px_http_head head;        /* spans point into headbuf */
    char *headbuf;            /* owned */
    px_buf body;              /* owned until moved into a request */
    px_chunked ck;
    int64_t body_left;        /* Content-Length bytes still to read */
    int keep_alive;
    int minor;
    int streaming;            /* a streamed response is open */
    int chunked_out;          /* ...and it uses chunked encoding */
    int got_bytes;            /* bytes of the current request received */
    int timer_is_header;
    int closed;               /* socket closed, free scheduled */
    px_req *req;              /* borrowed: the request in flight, if any */
};

static void conn_process(px_conn *c);

/* ---------- connection lifetime ---------- */

static void conn_unlink(px_conn *c)
{
    if (c->prev) c->prev->next = c->next;
    else c->w->conns = c->next;
    if (c->next) c->next->prev = c->prev;
}

static void conn_free_cb(evutil_socket_t fd, short what, void *arg)
{
    px_conn *c = arg;
    conn_unlink(c);
    bufferevent_free(c->bev);
    event_free(c->timer);
    event_free(c->resume);
    free(c->headbuf);
    px_buf_cleanup(&c->body);
    free(c);
}

/* Closes now; the memory goes on the next loop turn, since this may run
 * inside one of the connection's own callbacks. */
static void conn_close(px_conn *c)
{
    if (c->closed) return;
    c->closed = 1;
    if (c->req) {
        px_req *r = c->req;
        c->req = NULL;
        px_req_client_gone(r);
    }
    c->state = CS_CLOSING;
    bufferevent_disable(c->bev, EV_READ | EV_WRITE);
    bufferevent_setcb(c->bev, NULL, NULL, NULL, NULL);
    evtimer_del(c->timer);
    /* Close the socket at once so the peer sees it without waiting for the
     * deferred free. */
    evutil_socket_t fd = bufferevent_getfd(c->bev);
    if (fd >= 0) {
        bufferevent_setfd(c->bev, -1);
        evutil_closesocket(fd);
    }
    event_base_once(c->w->base, -1, EV_TIMEOUT, conn_free_cb, c, NULL);
}

static void arm_timer(px_conn *c, int header)
{
    const px_config *cfg = c->w->srv->cfg;
    double s = header ? cfg->client_header_timeout : cfg->keepalive_timeout;
    struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
    c->timer_is_header = header;
    evtimer_add(c->timer, &tv);
}

/* After the last byte of a response is queued. */
static void exchange_done(px_conn *c)
{
    c->req = NULL;
    c->streaming = 0;
    free(c->headbuf);
    c->headbuf = NULL;
    px_buf_reset(&c->body);
    if (!c->keep_alive) {
        /* Close once the queued response has been written. */
        c->state = CS_CLOSING;
        bufferevent_disable(c->bev, EV_READ);
        bufferevent_setwatermark(c->bev, EV_WRITE, 0, 0);
        if (evbuffer_get_length(bufferevent_get_output(c->bev)) == 0) conn_close(c);
        return;
    }
    c->state = CS_HEAD;
    c->got_bytes = 0;
    bufferevent_enable(c->bev, EV_READ);
    arm_timer(c, 0);
    /* A pipelined request may already be buffered: read it on the next loop
     * turn, not from inside the request that is ending now. */
    if (evbuffer_get_length(bufferevent_get_input(c->bev))) event_active(c->resume, EV_TIMEOUT, 0);
}

/* ---------- responses ---------- */

static void write_head(px_conn *c, int status, const char *ctype, const char *req_id,
                       int64_t content_length, const char *extra)
{
    struct evbuffer *out = bufferevent_get_output(c->bev);
    evbuffer_add_printf(out, "HTTP/1.%d %d %s\r\n", c->minor, status, px_http_reason(status));
    if (ctype) evbuffer_add_printf(out, "Content-Type: %s\r\n", ctype);
    if (req_id) evbuffer_add_printf(out, "X-Request-Id: %s\r\n", req_id);
    if (extra) evbuffer_add(out, extra, strlen(extra));
    if (content_length >= 0)
        evbuffer_add_printf(out, "Content-Length: %lld\r\n", (long long)content_length);
    else if (c->chunked_out)
        evbuffer_add(out, "Transfer-Encoding: chunked\r\n", 28);
    if (!c->keep_alive)
        evbuffer_add(out, "Connection: close\r\n", 19);
    else if (c->minor == 0)
        evbuffer_add(out, "Connection: keep-alive\r\n", 24);
    evbuffer_add(out, "\r\n", 2);
}

static void reply_full(px_conn *c, int status, const char *ctype, const char *req_id,
                       const char *extra, const char *body, size_t n)
{
    write_head(c, status, ctype, req_id, (int64_t)n, extra);
    if (n) evbuffer_add(bufferevent_get_output(c->bev), body, n);
    exchange_done(c);
}

void px_conn_reply(px_conn *c, int status, const char *ctype, const char *req_id,
                   const char *body, size_t n)
{
    reply_full(c, status, ctype, req_id, NULL, body, n);
}

static const char *error_type(int status)
{
    switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    case 502: return "bad_gateway";
    case 503: return "service_unavailable";
    case 504: return "gateway_timeout";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

static void reply_error_extra(px_conn *c, int status, const char *req_id, const char *msg,
                              const char *extra)
{
    px_buf b;
    px_buf_init(&b);
    px_buf_appends(&b, "{\"error\":{\"message\":");
    px_buf_append_json_str(&b, msg, strlen(msg));
    px_buf_printf(&b, ",\"type\":\"%s\",\"code\":%d}}", error_type(status), status);
    reply_full(c, status, "application/json", req_id, extra, b.data, b.len);
    px_buf_cleanup(&b);
}

void px_conn_reply_error(px_conn *c, int status, const char *req_id, const char *msg)
{
    reply_error_extra(c, status, req_id, msg, NULL);
}

/* An error found while reading the request: answer and close, since the
 * rest of the stream cannot be trusted to be framed. */
static void reject(px_conn *c, int status, const char *msg)
{
    PX_LOG(PX_LOG_INFO, "msg=\"rejected request\" status=%d reason=\"%s\"", status, msg);
    c->keep_alive = 0;
    reply_error_extra(c, status, NULL, msg, NULL);
}

void px_conn_stream_start(px_conn *c, int status, const char *ctype, const char *req_id)
{
    c->streaming = 1;
    c->chunked_out = c->minor >= 1;
    if (!c->chunked_out) c->keep_alive = 0; /* HTTP/1.0: the close ends the body */
    write_head(c, status, ctype, req_id, -1, NULL);
}

void px_conn_stream_write(px_conn *c, const char *p, size_t n)
{
    if (!n) return;
    struct evbuffer *out = bufferevent_get_output(c->bev);
    if (c->chunked_out) {
        evbuffer_add_printf(out, "%zx\r\n", n);
        evbuffer_add(out, p, n);
        evbuffer_add(out, "\r\n", 2);
    } else {
        evbuffer_add(out, p, n);
    }
}

void px_conn_stream_end(px_conn *c)
{
    if (c->chunked_out) evbuffer_add(bufferevent_get_output(c->bev), "0\r\n\r\n", 5);
    exchange_done(c);
}

void px_conn_abort(px_conn *c)
{
    c->req = NULL;
    conn_close(c);
}

size_t px_conn_pending(px_conn *c)
{
    return evbuffer_get_length(bufferevent_get_output(c->bev));
}

/* ---------- routing ---------- */

static int path_is(const px_http_head *h, const char *path)
{
    size_t n = h->target_len;
    const char *q = memchr(h->target, '?', n);
    if (q) n = (size_t)(q - h->target);
    return strlen(path) == n && memcmp(h->target, path, n) == 0;
}

static void dispatch(px_conn *c)
{
    px_http_head *h = &c->head;
    px_server *s = c->w->srv;
    int is_get = h->method_len == 3 && memcmp(h->method, "GET", 3) == 0;
    int is_post = h->method_len == 4 && memcmp(h->method, "POST", 4) == 0;
    c->state = CS_BUSY;
    evtimer_del(c->timer);

    if (path_is(h, "/v1/completions") || path_is(h, "/v1/chat/completions")) {
        if (!is_post) {
            reply_error_extra(c, 405, NULL, "method not allowed: use POST", "Allow: POST\r\n");
            return;
        }
        px_endpoint ep = path_is(h, "/v1/completions") ? PX_EP_COMPLETIONS : PX_EP_CHAT;
        c->req = px_req_start(c->w, c, ep, h, &c->body);
        return;
    }
    if (path_is(h, "/healthcheck") || path_is(h, "/health")) {
        if (!is_get) {
            reply_error_extra(c, 405, NULL, "method not allowed: use GET", "Allow: GET\r\n");
            return;
        }
        char body[160];
        int n;
        if (path_is(h, "/health"))
            n = snprintf(body, sizeof body, "{\"status\":\"ok\"}");
        else
            n = snprintf(body, sizeof body,
                         "{\"status\":\"ok\",\"prefill_instances\":%zu,\"decode_instances\":%zu}",
                         s->prefill.n, s->decode.n);
        px_conn_reply(c, 200, "application/json", NULL, body, (size_t)n);
        return;
    }
    px_buf m;
    px_buf_init(&m);
    px_buf_printf(&m, "not found: %.*s %.*s", (int)(h->method_len > 16 ? 16 : h->method_len),
                  h->method, (int)(h->target_len > 200 ? 200 : h->target_len), h->target);
    px_conn_reply_error(c, 404, NULL, m.data);
    px_buf_cleanup(&m);
}

/* ---------- reading requests ---------- */

static void read_head(px_conn *c)
{
    struct evbuffer *in = bufferevent_get_input(c->bev);
    size_t len = evbuffer_get_length(in);
    if (!c->got_bytes) {
        /* A new request starts: the header deadline replaces the idle one. */
        c->got_bytes = 1;
        arm_timer(c, 1);
    }
    struct evbuffer_ptr end;
    evbuffer_ptr_set(in, &end, len < PX_HTTP_MAX_HEAD_BYTES + 4 ? len : PX_HTTP_MAX_HEAD_BYTES + 4,
                     EVBUFFER_PTR_SET);
    struct evbuffer_ptr pos = evbuffer_search_range(in, "\r\n\r\n", 4, NULL, &end);
    if (pos.pos < 0) {
        if (len >= PX_HTTP_MAX_HEAD_BYTES + 4) reject(c, 431, "request header block too large");
        return;
    }
    size_t hlen = (size_t)pos.pos + 4;
    c->headbuf = px_xmalloc(hlen);
    evbuffer_remove(in, c->headbuf, hlen);
    const char *why = NULL;
    int st = px_http_parse_head(c->headbuf, hlen, &c->head, &why);
    if (st) {
        c->minor = 1;
        reject(c, st, why);
        return;
    }
    c->minor = c->head.minor;
    c->keep_alive = c->head.keep_alive;
    int64_t max = c->w->srv->cfg->max_body_bytes;
    if (c->head.content_length > max) {
        reject(c, 413, "request body exceeds --max-body-bytes");
        return;
    }
    px_buf_reset(&c->body);
    c->body_left = c->head.content_length > 0 ? c->head.content_length : 0;
    px_chunked_init(&c->ck);
    if (c->head.expect_continue && (c->head.chunked || c->body_left) &&
        evbuffer_get_length(in) == 0)
        evbuffer_add(bufferevent_get_output(c->bev), "HTTP/1.1 100 Continue\r\n\r\n", 25);
    c->state = CS_BODY;
}

/* Returns 1 once the whole body is in c->body. */
static int read_body(px_conn *c)
{
    struct evbuffer *in = bufferevent_get_input(c->bev);
    if (!c->head.chunked) {
        size_t avail = evbuffer_get_length(in);
        size_t take = avail < (size_t)c->body_left ? avail : (size_t)c->body_left;
        if (take) {
            px_buf_reserve(&c->body, take);
            evbuffer_remove(in, c->body.data + c->body.len, take);
            c->body.len += take;
            c->body.data[c->body.len] = '\0';
            c->body_left -= (int64_t)take;
        }
        return c->body_left == 0;
    }
    size_t max = (size_t)c->w->srv->cfg->max_body_bytes;
    while (!c->ck.done && evbuffer_get_length(in)) {
        struct evbuffer_iovec v;
        if (evbuffer_peek(in, -1, NULL, &v, 1) < 1) break;
        long used = px_chunked_feed(&c->ck, v.iov_base, v.iov_len, &c->body, max);
        if (used == -2) {
            reject(c, 413, "request body exceeds --max-body-bytes");
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

static void conn_process(px_conn *c)
{
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

static void on_resume(evutil_socket_t fd, short what, void *arg)
{
    px_conn *c = arg;
    if (c->state == CS_HEAD) conn_process(c);
}

static void on_read(struct bufferevent *bev, void *arg)
{
    px_conn *c = arg;
    if (c->state == CS_BUSY) {
        /* Pipelined bytes wait until the current exchange ends; stop reading
         * (and so stop noticing a close) only if a client floods us. */
        if (evbuffer_get_length(bufferevent_get_input(bev)) > PX_HTTP_MAX_HEAD_BYTES * 4)
            bufferevent_disable(bev, EV_READ);
        return;
    }
    if (c->state == CS_CLOSING) return;
    conn_process(c);
}

static void on_write(struct bufferevent *bev, void *arg)
{
    px_conn *c = arg;
    if (c->state == CS_CLOSING) {
        if (evbuffer_get_length(bufferevent_get_output(bev)) == 0) conn_close(c);
        return;
    }
    if (c->req && c->streaming) px_req_on_drained(c->req);
}

static void on_event(struct bufferevent *bev, short what, void *arg)
{
    px_conn *c = arg;
    if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR)) conn_close(c);
}

static void on_timeout(evutil_socket_t fd, short what, void *arg)
{
    px_conn *c = arg;
    if (c->state == CS_HEAD || c->state == CS_BODY) {
        if (c->timer_is_header && c->got_bytes) {
            PX_LOG(PX_LOG_INFO, "msg=\"client too slow sending its request\" state=%s",
                   c->state == CS_HEAD ? "head" : "body");
            c->minor = 1;
            reject(c, 408, "request not received within --client-header-timeout");
            return;
        }
        conn_close(c);
    }
}

static void on_accept(struct evconnlistener *lev, evutil_socket_t fd, struct sockaddr *sa,
                      int salen, void *arg)
{
    px_worker *w = arg;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    px_conn *c = px_xcalloc(1, sizeof *c);
    c->w = w;
    c->bev = bufferevent_socket_new(w->base, fd, BEV_OPT_CLOSE_ON_FREE);
    c->timer = evtimer_new(w->base, on_timeout, c);
    c->resume = event_new(w->base, -1, 0, on_resume, c);
    if (!c->bev || !c->timer || !c->resume) {
        if (c->bev) bufferevent_free(c->bev);
        else evutil_closesocket(fd);
        if (c->timer) event_free(c->timer);
        if (c->resume) event_free(c->resume);
        free(c);
        return;
    }
    c->next = w->conns;
    if (w->conns) w->conns->prev = c;
    w->conns = c;
    px_buf_init(&c->body);
    c->state = CS_HEAD;
    c->keep_alive = 1;
    c->minor = 1;
    bufferevent_setcb(c->bev, on_read, on_write, on_event, c);
    bufferevent_setwatermark(c->bev, EV_WRITE, PX_CONN_LOW_WATER, 0);
    bufferevent_enable(c->bev, EV_READ | EV_WRITE);
    arm_timer(c, 1);
}

/* ---------- workers ---------- */

static int make_listener(const char *host, int port, char *err, size_t errlen)
{
    struct addrinfo hints = {0}, *res = NULL;
    char ps[16];
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    snprintf(ps, sizeof ps, "%d", port);
    int rc = getaddrinfo(host, ps, &hints, &res);
    if (rc) {
        snprintf(err, errlen, "cannot resolve --host '%s': %s", host, gai_strerror(rc));
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 4096) == 0) break;
        snprintf(err, errlen, "cannot listen on %s:%d: %s", host, port, strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    px_worker *w = arg;
    uint64_t v;
    if (read(fd, &v, sizeof v) < 0) return;
    event_base_loopbreak(w->base);
}

static void *worker_main(void *arg)
{
    px_worker *w = arg;
    event_base_dispatch(w->base);
    return NULL;
}

static void worker_cleanup(px_worker *w)
{
    /* The loop has stopped: close what is left and free it here, since the
     * deferred frees will never run. */
    while (w->conns) {
        px_conn *c = w->conns;
        conn_close(c);
        conn_free_cb(-1, 0, c);
    }
    if (w->lev) evconnlistener_free(w->lev);
    px_uploop_destroy(w->up);
    if (w->wake) event_free(w->wake);
    if (w->wake_fd >= 0) close(w->wake_fd);
    if (w->base) event_base_free(w->base);
}

px_server *px_server_create(const px_config *cfg, char *err, size_t errlen)
{
    px_server *s = px_xcalloc(1, sizeof *s);
    s->cfg = cfg;
    px_pool_init(&s->prefill, "prefill", &cfg->prefiller_hosts, &cfg->prefiller_ports);
    px_pool_init(&s->decode, "decode", &cfg->decoder_hosts, &cfg->decoder_ports);
    const char *key = getenv("OPENAI_API_KEY");
    if (key && *key) {
        px_buf b;
        px_buf_init(&b);
        px_buf_printf(&b, "Bearer %s", key);
        s->env_auth = b.data;
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    s->nworkers = cfg->threads > 0 ? (int)cfg->threads : (ncpu > 0 ? (int)ncpu : 1);
    s->workers = px_xcalloc((size_t)s->nworkers, sizeof *s->workers);
    for (int i = 0; i < s->nworkers; i++) s->workers[i].wake_fd = -1;
    for (int i = 0; i < s->nworkers; i++) {
        px_worker *w = &s->workers[i];
        w->srv = s;
        w->index = i;
        struct event_config *ec = event_config_new();
        event_config_set_flag(ec, EVENT_BASE_FLAG_NOLOCK);
        w->base = event_base_new_with_config(ec);
        event_config_free(ec);
        if (!w->base) {
            snprintf(err, errlen, "cannot create an event loop");
            goto err;
        }
        int fd = make_listener(cfg->host, (int)cfg->port, err, errlen);
        if (fd < 0) goto err;
        w->lev = evconnlistener_new(w->base, on_accept, w, LEV_OPT_CLOSE_ON_FREE, -1, fd);
        if (!w->lev) {
            close(fd);
            snprintf(err, errlen, "cannot create a listener");
            goto err;
        }
        w->up = px_uploop_create(w->base);
        w->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (!w->up || w->wake_fd < 0) {
            snprintf(err, errlen, "cannot create the upstream loop");
            goto err;
        }
        w->wake = event_new(w->base, w->wake_fd, EV_READ | EV_PERSIST, on_wake, w);
        event_add(w->wake, NULL);
    }
    return s;
err:
    px_server_destroy(s);
    return NULL;
}

int px_server_run(px_server *s)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* workers inherit the mask */
    for (int i = 0; i < s->nworkers; i++)
        pthread_create(&s->workers[i].thread, NULL, worker_main, &s->workers[i]);
    PX_LOG(PX_LOG_INFO, "msg=\"listening\" addr=%s:%lld threads=%d prefill=%zu decode=%zu",
           s->cfg->host, (long long)s->cfg->port, s->nworkers, s->prefill.n, s->decode.n);
    int sig = 0;
    sigwait(&set, &sig);
    PX_LOG(PX_LOG_INFO, "msg=\"stopping\" signal=%d", sig);
    for (int i = 0; i < s->nworkers; i++) {
        uint64_t one = 1;
        if (write(s->workers[i].wake_fd, &one, sizeof one) < 0) continue;
    }
    for (int i = 0; i < s->nworkers; i++) pthread_join(s->workers[i].thread, NULL);
    return 0;
}

void px_server_destroy(px_server *s)
{
    if (!s) return;
    for (int i = 0; i < s->nworkers; i++) worker_cleanup(&s->workers[i]);
    free(s->workers);
    px_pool_cleanup(&s->prefill);
    px_pool_cleanup(&s->decode);
    free(s->env_auth);
    free(s);
}
