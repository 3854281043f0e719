/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/upstream.h"

#include <arpa/inet.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/client.h"
#include "base/json.h"
#include "base/log.h"
#include "base/util.h"
#include "proxy/curlx.h"

struct px_uploop {
    struct event_base *base; /* borrowed */
    px_client *client;       /* owned: http:// backends */
    px_buf head;             /* scratch: the request head being built */
    /* https:// backends, created on the first one. */
    CURLM *multi;        /* owned, or NULL */
    struct event *timer; /* owned, or NULL */
    px_upstream *live;   /* transfers in flight, for destroy */
    CURL *idle[64];      /* owned: easy handles kept for reuse */
    int nidle;
    int nhttps;               /* https transfers in flight */
    struct event *idle_close; /* owned, or NULL: drops curl's idle connections */
};

struct px_upstream {
    px_uploop *loop; /* borrowed */
    px_upstream_cbs cbs;
    void *arg;
    px_upstream *prev, *next; /* in loop->live */
    px_creq *q;               /* http: the client's exchange, or NULL */
    /* https */
    CURL *easy; /* owned */
    int headers_seen;
    int paused;
    int upload_done;
    int abort_after_upload;
    struct curl_slist *hdrs;       /* owned */
    struct curl_slist *connect_to; /* owned */
    const char *body;              /* borrowed: valid until on_done */
    size_t body_len, body_off;
    char errbuf[CURL_ERROR_SIZE];
    /* The response head while on_headers runs (px_upstream_header): http's
     * parsed head, or https's header lines as curl gave them. */
    const px_http_head *cur_head;
    px_buf hlines; /* https: owned, the current response's header lines */
};

/* One per socket curl watches; freed when curl says CURL_POLL_REMOVE. */
typedef struct sockwatch {
    px_uploop *loop;
    struct event *ev;
    short events;
} sockwatch;

static void unlink_up(px_upstream *u) {
    if (u->prev)
        u->prev->next = u->next;
    else
        u->loop->live = u->next;
    if (u->next) u->next->prev = u->prev;
}

/* Easy handles are reused: creating one allocates tens of kilobytes, which
 * showed up in profiles at ~10 % of the per-request cost. */
static void release_easy(px_uploop *l, CURL *e) {
    if (l->nidle < (int)(sizeof l->idle / sizeof *l->idle))
        l->idle[l->nidle++] = e;
    else
        curl_easy_cleanup(e);
}

/* Idle https connections go after this, like the http client's (below
 * uvicorn's 5 s keep-alive): libcurl keeps them until its next transfer. */
#define HTTPS_IDLE_CLOSE_S 4

static void free_up(px_upstream *u) {
    px_uploop *l = u->loop;
    unlink_up(u);
    if (u->easy) { /* https only: an http transfer never loads libcurl */
        curl_slist_free_all(u->connect_to);
        curl_slist_free_all(u->hdrs);
        release_easy(l, u->easy);
        px_buf_cleanup(&u->hlines);
        if (--l->nhttps == 0 && l->idle_close) {
            struct timeval tv = {HTTPS_IDLE_CLOSE_S, 0};
            evtimer_add(l->idle_close, &tv);
        }
    }
    px_mem_put(u);
}

static px_up_result result_of(CURLcode rc) {
    switch (rc) {
    case CURLE_OK:
        return PX_UP_OK;
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_PEER_FAILED_VERIFICATION:
        return PX_UP_CONNECT;
    case CURLE_OPERATION_TIMEDOUT:
        return PX_UP_TIMEOUT;
    case CURLE_WRITE_ERROR:
    case CURLE_ABORTED_BY_CALLBACK:
        return PX_UP_ABORTED;
    default:
        return PX_UP_RESET;
    }
}

static void check_done(px_uploop *l) {
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(l->multi, &left))) {
        if (msg->msg != CURLMSG_DONE) continue;
        px_upstream *u = NULL;
        CURL *easy = msg->easy_handle;
        CURLcode rc = msg->data.result;
        curl_easy_getinfo(easy, CURLINFO_PRIVATE, (char **)&u);
        curl_multi_remove_handle(l->multi, easy);
        if (u) {
            /* Whether the backend may have seen the request: any of it was
             * sent. (The connect time reads 0 on a reused connection.) */
            long sent = 0;
            curl_easy_getinfo(easy, CURLINFO_REQUEST_SIZE, &sent);
            px_upstream_cbs cbs = u->cbs;
            void *arg = u->arg;
            char why[CURL_ERROR_SIZE];
            snprintf(why, sizeof why, "%s", u->errbuf[0] ? u->errbuf : curl_easy_strerror(rc));
            free_up(u);
            cbs.on_done(arg, result_of(rc), why, sent > 0);
        } else {
            curl_easy_cleanup(easy);
        }
    }
}

static void on_sock_event(evutil_socket_t fd, short what, void *arg) {
    px_uploop *l = arg;
    int running, flags = 0;
    if (what & EV_READ) flags |= CURL_CSELECT_IN;
    if (what & EV_WRITE) flags |= CURL_CSELECT_OUT;
    curl_multi_socket_action(l->multi, fd, flags, &running);
    check_done(l);
}

static void on_timer(evutil_socket_t fd, short what, void *arg) {
    px_uploop *l = arg;
    int running;
    curl_multi_socket_action(l->multi, CURL_SOCKET_TIMEOUT, 0, &running);
    check_done(l);
}

static int sock_cb(CURL *easy, curl_socket_t s, int what, void *userp, void *socketp) {
    px_uploop *l = userp;
    sockwatch *w = socketp;
    if (what == CURL_POLL_REMOVE) {
        if (w) {
            event_free(w->ev);
            free(w);
            curl_multi_assign(l->multi, s, NULL);
        }
        return 0;
    }
    short ev = EV_PERSIST | ((what & CURL_POLL_IN) ? EV_READ : 0) |
               ((what & CURL_POLL_OUT) ? EV_WRITE : 0);
    if (!w) {
        w = px_xcalloc(1, sizeof *w);
        w->loop = l;
        w->ev = event_new(l->base, s, ev, on_sock_event, l);
        curl_multi_assign(l->multi, s, w);
    } else if (w->events == ev) {
        return 0; /* unchanged: spare the epoll_ctl */
    } else {
        event_del(w->ev);
        event_assign(w->ev, l->base, s, ev, on_sock_event, l);
    }
    w->events = ev;
    event_add(w->ev, NULL);
    return 0;
}

static int timer_cb(CURLM *multi, long timeout_ms, void *userp) {
    px_uploop *l = userp;
    if (timeout_ms < 0) {
        evtimer_del(l->timer);
    } else {
        struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
        evtimer_add(l->timer, &tv);
    }
    return 0;
}

/* No https transfer for HTTPS_IDLE_CLOSE_S: the multi handle goes, and
 * with it every connection it kept; the next https request makes another. */
static void on_idle_close(evutil_socket_t fd, short what, void *arg) {
    px_uploop *l = arg;
    if (l->nhttps || !l->multi) return;
    curl_multi_cleanup(l->multi); /* its sockets' watches go through sock_cb */
    l->multi = NULL;
    event_free(l->timer);
    l->timer = NULL;
}

/* The curl side, on the first https:// request. */
static int curl_side(px_uploop *l) {
    if (l->multi) return 0;
    if (!px_curl()) return -1;
    if (!l->idle_close) l->idle_close = evtimer_new(l->base, on_idle_close, l);
    l->multi = curl_multi_init();
    if (!l->multi) return -1;
    l->timer = evtimer_new(l->base, on_timer, l);
    if (!l->timer) {
        curl_multi_cleanup(l->multi);
        l->multi = NULL;
        return -1;
    }
    curl_multi_setopt(l->multi, CURLMOPT_SOCKETFUNCTION, sock_cb);
    curl_multi_setopt(l->multi, CURLMOPT_SOCKETDATA, l);
    curl_multi_setopt(l->multi, CURLMOPT_TIMERFUNCTION, timer_cb);
    curl_multi_setopt(l->multi, CURLMOPT_TIMERDATA, l);
    /* Keep enough idle connections for bursts of concurrent streams. */
    curl_multi_setopt(l->multi, CURLMOPT_MAXCONNECTS, 1024L);
    return 0;
}

px_uploop *px_uploop_create(struct event_base *base, int max_idle) {
    return px_uploop_create_keep(base, max_idle, 0);
}

px_uploop *px_uploop_create_keep(struct event_base *base, int max_idle, double idle_close_s) {
    px_uploop *l = px_xcalloc(1, sizeof *l);
    l->base = base;
    px_buf_init(&l->head);
    px_client_cfg ccfg = {.max_idle_per_host = max_idle, .idle_close_s = idle_close_s};
    l->client = px_client_create(base, &ccfg);
    return l;
}

void px_uploop_retire(px_uploop *l,
                      int (*keep)(void *ctx, const struct sockaddr *sa, socklen_t salen),
                      void *ctx) {
    px_client_retire(l->client, keep, ctx);
}

void px_uploop_destroy(px_uploop *l) {
    if (!l) return;
    while (l->live)
        px_upstream_cancel(l->live);
    while (l->nidle)
        curl_easy_cleanup(l->idle[--l->nidle]);
    if (l->multi) curl_multi_cleanup(l->multi);
    if (l->timer) event_free(l->timer);
    if (l->idle_close) event_free(l->idle_close);
    px_client_destroy(l->client);
    px_buf_cleanup(&l->head);
    free(l);
}

static size_t header_cb(char *p, size_t size, size_t n, void *arg) {
    px_upstream *u = arg;
    size_t len = size * n;
    if (len <= 2 && (p[0] == '\r' || p[0] == '\n')) {
        long status = 0;
        curl_easy_getinfo(u->easy, CURLINFO_RESPONSE_CODE, &status);
        if (status >= 200 && !u->headers_seen) {
            char *ct = NULL;
            curl_easy_getinfo(u->easy, CURLINFO_CONTENT_TYPE, &ct);
            u->headers_seen = 1;
            if (u->cbs.on_headers) u->cbs.on_headers(u->arg, (int)status, ct);
        }
        px_buf_reset(&u->hlines); /* a 1xx head's lines are not the answer's */
    } else if (!u->headers_seen && u->hlines.len + len <= 16384) {
        px_buf_append(&u->hlines, p, len);
    }
    return len;
}

static size_t write_cb(char *p, size_t size, size_t n, void *arg) {
    px_upstream *u = arg;
    size_t len = size * n;
    int r = u->cbs.on_data(u->arg, p, len);
    if (r == 1) {
        u->paused = 1;
        return CURL_WRITEFUNC_PAUSE;
    }
    return r == 0 ? len : 0;
}

static size_t read_cb(char *buf, size_t size, size_t n, void *arg) {
    px_upstream *u = arg;
    size_t take = size * n, left = u->body_len - u->body_off;
    if (take > left) take = left;
    memcpy(buf, u->body + u->body_off, take);
    u->body_off += take;
    return take;
}

/* Rewinding to the start before anything was sent is harmless; any other
 * rewind would resend the request. */
static int seek_cb(void *arg, curl_off_t off, int origin) {
    px_upstream *u = arg;
    if (origin == SEEK_SET && off == 0 && u->body_off == 0) return CURL_SEEKFUNC_OK;
    return CURL_SEEKFUNC_CANTSEEK;
}

static int xferinfo_cb(void *arg, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal,
                       curl_off_t ulnow) {
    px_upstream *u = arg;
    if (ultotal > 0 && ulnow >= ultotal) u->upload_done = 1;
    return u->upload_done && u->abort_after_upload;
}

/* Seconds as curl's milliseconds (0: none, or curl's default). */
static long ms(double s) {
    return s > 0 ? (long)(s * 1000) : 0L;
}

/* A backend that is one address of its URL's name (DNS discovery) is
 * reached at that address: curl is pinned to it (CONNECT_TO
 * "host:port:address:port"), the URL keeps the name for Host, SNI and the
 * certificate check. Such a backend is named by its address; any other by
 * its URL's authority. */
static struct curl_slist *connect_pin(const px_backend *b) {
    char host[256], pin[600];
    int port, https;
    if (!strcmp(b->name, b->authority) ||
        px_url_split(b->url, host, sizeof host, &port, &https) < 0)
        return NULL;
    snprintf(pin, sizeof pin, "%s:%d:%s", host, port, b->name);
    return curl_slist_append(NULL, pin);
}

static px_upstream *start_https(px_uploop *l, const px_upstream_req *q, const px_upstream_cbs *cbs,
                                void *arg) {
    px_backend *b = q->backend;
    const char *method = q->method, *path = q->path, *body = q->body;
    size_t len = q->len;
    const px_buf *headers = q->headers;
    if (curl_side(l) < 0) return NULL;
    px_upstream *u = px_mem_zalloc(sizeof *u);
    u->loop = l;
    u->cbs = *cbs;
    u->arg = arg;
    u->easy = l->nidle ? l->idle[--l->nidle] : curl_easy_init();
    if (!u->easy) {
        px_mem_put(u);
        return NULL;
    }
    CURL *e = u->easy;
    px_buf url;
    px_buf_init(&url);
    px_buf_printf(&url, "%s%s", b->url, path);
    curl_easy_setopt(e, CURLOPT_URL, url.data); /* copied by curl */
    px_buf_cleanup(&url);
    /* The header lines, one list entry each; no 100-continue round trip. */
    for (size_t at = 0; headers && at < headers->len;) {
        const char *eol = memchr(headers->data + at, '\r', headers->len - at);
        size_t n = eol ? (size_t)(eol - (headers->data + at)) : headers->len - at;
        char *line = px_xstrndup(headers->data + at, n);
        u->hdrs = curl_slist_append(u->hdrs, line);
        free(line);
        at += n + 2;
    }
    u->hdrs = curl_slist_append(u->hdrs, "Expect:");
    if (body) {
        /* The body goes through a read callback that cannot rewind: given
         * POSTFIELDS, libcurl silently resends a request whose reused
         * connection died after the engine read it, and pdproxy must never
         * hand an engine the same request twice (decode may already have
         * pulled prefill's blocks). Now that case fails, and we decide. */
        u->body = body;
        u->body_len = len;
        u->body_off = 0;
        curl_easy_setopt(e, CURLOPT_POST, 1L);
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, NULL);
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
        curl_easy_setopt(e, CURLOPT_READFUNCTION, read_cb);
        curl_easy_setopt(e, CURLOPT_READDATA, u);
        curl_easy_setopt(e, CURLOPT_SEEKFUNCTION, seek_cb);
        curl_easy_setopt(e, CURLOPT_SEEKDATA, u);
    } else {
        curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
        curl_easy_setopt(e, CURLOPT_READFUNCTION, NULL);
        curl_easy_setopt(e, CURLOPT_SEEKFUNCTION, NULL);
    }
    /* Methods other than POST with a body and GET without (passed-through
     * endpoints); reset every time, a reused handle keeps the last one. */
    int plain = body ? !strcmp(method, "POST") : !strcmp(method, "GET");
    curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, plain ? NULL : method);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, u->hdrs);
    curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(e, CURLOPT_PRIVATE, u);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, u->errbuf);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, header_cb);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, u);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, write_cb);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, u);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, ms(q->connect_timeout));
    /* Set every option each time: a reused handle keeps the last ones. */
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, ms(q->total_timeout));
    /* The low-speed check counts whole seconds: at least one. */
    long idle_s = q->idle_timeout > 0 ? (q->idle_timeout < 1 ? 1L : (long)q->idle_timeout) : 0L;
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, idle_s > 0 ? 1L : 0L);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, idle_s);
    /* Engines are reached directly; never through a proxy from the environment. */
    curl_easy_setopt(e, CURLOPT_PROXY, "");
    curl_easy_setopt(e, CURLOPT_CAINFO, q->ca_file && q->ca_file[0] ? q->ca_file : NULL);
    curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, q->insecure ? 0L : 1L);
    curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, q->insecure ? 0L : 2L);
    u->connect_to = connect_pin(b);
    curl_easy_setopt(e, CURLOPT_CONNECT_TO, u->connect_to);
    curl_easy_setopt(e, CURLOPT_NOPROGRESS, q->track_upload ? 0L : 1L);
    curl_easy_setopt(e, CURLOPT_XFERINFOFUNCTION, q->track_upload ? xferinfo_cb : NULL);
    curl_easy_setopt(e, CURLOPT_XFERINFODATA, u);
    /* Only http and https upstreams; no redirects followed. */
    curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
    if (curl_multi_add_handle(l->multi, e) != CURLM_OK) {
        release_easy(l, e);
        curl_slist_free_all(u->connect_to);
        curl_slist_free_all(u->hdrs);
        px_mem_put(u);
        return NULL;
    }
    l->nhttps++;
    evtimer_del(l->idle_close);
    u->next = l->live;
    if (l->live) l->live->prev = u;
    l->live = u;
    return u;
}

/* ---------- http:// through base's client ---------- */

static void link_up(px_uploop *l, px_upstream *u) {
    u->next = l->live;
    if (l->live) l->live->prev = u;
    l->live = u;
}

static void h_head(void *arg, const px_http_head *h) {
    px_upstream *u = arg;
    const px_http_header *ct = px_http_find(h, "content-type");
    char buf[256];
    if (ct) px_strncpyz(buf, sizeof buf, ct->value, ct->value_len);
    u->cur_head = h;
    if (u->cbs.on_headers) u->cbs.on_headers(u->arg, h->status, ct ? buf : NULL);
    u->cur_head = NULL;
}

int px_upstream_header(px_upstream *u, const char *name, char *out, size_t cap) {
    const char *v = NULL;
    size_t vl = 0, nl = strlen(name);
    if (!u || !cap) return 0;
    if (u->cur_head) {
        const px_http_header *x = px_http_find(u->cur_head, name);
        if (x) v = x->value, vl = x->value_len;
    } else {
        const char *p = u->hlines.data ? u->hlines.data : "", *end = p + u->hlines.len;
        while (!v && p < end) {
            const char *eol = memchr(p, '\n', (size_t)(end - p));
            if (!eol) eol = end;
            if ((size_t)(eol - p) > nl && p[nl] == ':' && !strncasecmp(p, name, nl)) {
                v = p + nl + 1;
                vl = (size_t)(eol - v);
            }
            p = eol + 1;
        }
        while (vl && (*v == ' ' || *v == '\t'))
            v++, vl--;
        while (vl && (v[vl - 1] == '\r' || v[vl - 1] == ' ' || v[vl - 1] == '\t'))
            vl--;
    }
    if (!v) return 0;
    px_strncpyz(out, cap, v, vl);
    return 1;
}

static int h_data(void *arg, const char *p, size_t n) {
    px_upstream *u = arg;
    return u->cbs.on_data(u->arg, p, n);
}

static void h_done(void *arg, px_cresult r, const char *why, int sent) {
    px_upstream *u = arg;
    px_upstream_cbs cbs = u->cbs;
    void *uarg = u->arg;
    u->q = NULL;
    free_up(u);
    /* An answer that named another request (PX_CR_MISMATCH) ends like a
     * broken one: no byte of it was ours. */
    px_up_result res = r == PX_CR_OK        ? PX_UP_OK
                       : r == PX_CR_CONNECT ? PX_UP_CONNECT
                       : r == PX_CR_TIMEOUT ? PX_UP_TIMEOUT
                       : r == PX_CR_ABORTED ? PX_UP_ABORTED
                                            : PX_UP_RESET;
    cbs.on_done(uarg, res, why, sent);
}

static const px_creq_cbs h_cbs = {h_head, h_data, h_done};

static px_upstream *start_http(px_uploop *l, const px_upstream_req *q, const px_upstream_cbs *cbs,
                               void *arg) {
    px_backend *b = q->backend;
    if (!b->addrlen) return NULL; /* its name did not resolve */
    px_buf *hd = &l->head;
    px_buf_reset(hd);
    px_buf_appends(hd, q->method);
    px_buf_append(hd, " ", 1);
    px_buf_appends(hd, q->path);
    px_buf_append(hd, " HTTP/1.1\r\nHost: ", 17);
    px_buf_appends(hd, b->authority);
    px_buf_append(hd, "\r\n", 2);
    if (q->body) {
        px_buf_append(hd, "Content-Length: ", 16);
        px_buf_append_u64(hd, q->len);
        px_buf_append(hd, "\r\n", 2);
    }
    if (q->headers) px_buf_append(hd, q->headers->data, q->headers->len);
    px_buf_append(hd, "\r\n", 2);
    px_creq_opts co = {
        .connect_timeout = q->connect_timeout,
        .total_timeout = q->total_timeout,
        .idle_timeout = q->idle_timeout,
        .track_upload = q->track_upload,
        .expect_id = q->request_id,
    };
    px_upstream *u = px_mem_zalloc(sizeof *u);
    u->loop = l;
    u->cbs = *cbs;
    u->arg = arg;
    u->q = px_creq_start(l->client, (struct sockaddr *)&b->addr, b->addrlen, hd->data, hd->len,
                         q->body, q->body ? q->len : 0, &co, &h_cbs, u);
    if (!u->q) {
        px_mem_put(u);
        return NULL;
    }
    link_up(l, u);
    return u;
}

px_upstream *px_upstream_start(px_uploop *l, const px_upstream_req *q, const px_upstream_cbs *cbs,
                               void *arg) {
    if (q->backend->https) return start_https(l, q, cbs, arg);
    return start_http(l, q, cbs, arg);
}

void px_upstream_set_cbs(px_upstream *u, const px_upstream_cbs *cbs) {
    u->cbs = *cbs;
}

void px_upstream_resume(px_upstream *u) {
    if (u->q) {
        px_creq_resume(u->q);
        return;
    }
    if (!u->paused) return;
    u->paused = 0;
    /* May call write_cb synchronously with the data held back; a second
     * pause sets u->paused again. */
    curl_easy_pause(u->easy, CURLPAUSE_CONT);
}

void px_upstream_cancel(px_upstream *u) {
    if (!u) return;
    if (u->q)
        px_creq_cancel(u->q);
    else
        curl_multi_remove_handle(u->loop->multi, u->easy);
    u->q = NULL;
    free_up(u);
}

int px_upstream_answering(px_upstream *u) {
    if (u->q) return px_creq_answering(u->q);
    if (u->headers_seen) return 1;
    curl_socket_t fd = CURL_SOCKET_BAD;
    if (curl_easy_getinfo(u->easy, CURLINFO_ACTIVESOCKET, &fd) != CURLE_OK || fd == CURL_SOCKET_BAD)
        return 0;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    return poll(&pfd, 1, 0) == 1 && (pfd.revents & POLLIN);
}

int px_upstream_half_close(px_upstream *u) {
    return u->q ? px_creq_shutdown_write(u->q) : -1;
}

int px_upstream_abort_after_upload(px_upstream *u) {
    if (u->q) return px_creq_abort_after_upload(u->q);
    u->abort_after_upload = 1;
    return u->upload_done;
}

int px_upstream_answer_foreign(px_backend *b, const px_json_member *rid, const char *id) {
    char text[512];
    if (!b || !rid || !rid->val || rid->type != PX_JSON_STRING || !id || !*id) return 0;
    long l = px_json_str_decode(rid->val + 1, rid->val_len - 2, text, sizeof text);
    if (l < 0) return 0;
    if (memmem(text, (size_t)l, id, strlen(id))) {
        if (!atomic_load_explicit(&b->echoes_id, memory_order_relaxed))
            atomic_store_explicit(&b->echoes_id, 1, memory_order_relaxed);
        return 0;
    }
    return atomic_load_explicit(&b->echoes_id, memory_order_relaxed);
}

int px_upstream_status_for(px_up_result r) {
    return r == PX_UP_TIMEOUT ? 504 : 502;
}

const char *px_up_result_str(px_up_result r) {
    switch (r) {
    case PX_UP_OK:
        return "ok";
    case PX_UP_CONNECT:
        return "could not connect";
    case PX_UP_TIMEOUT:
        return "timed out";
    case PX_UP_RESET:
        return "connection closed before a complete response";
    case PX_UP_ABORTED:
        return "aborted";
    }
    return "unknown";
}
