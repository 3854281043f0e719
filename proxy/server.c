#include "server.h"

#include <errno.h>
#include <event2/listener.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "http.h"
#include "log.h"
#include "request.h"

/* ---------- routing ---------- */

static int path_is(const px_http_head *h, const char *path)
{
    size_t n = h->target_len;
    const char *q = memchr(h->target, '?', n);
    if (q) n = (size_t)(q - h->target);
    return strlen(path) == n && memcmp(h->target, path, n) == 0;
}

static void dispatch(void *ctx, px_conn *c, const px_http_head *h, px_buf *body)
{
    px_worker *w = ctx;
    px_server *s = w->srv;
    int is_get = h->method_len == 3 && memcmp(h->method, "GET", 3) == 0;
    int is_post = h->method_len == 4 && memcmp(h->method, "POST", 4) == 0;

    if (path_is(h, "/v1/completions") || path_is(h, "/v1/chat/completions")) {
        if (!is_post) {
            px_conn_reply_error(c, 405, NULL, "Allow: POST\r\n", "method not allowed: use POST");
            return;
        }
        px_endpoint ep = path_is(h, "/v1/completions") ? PX_EP_COMPLETIONS : PX_EP_CHAT;
        px_req_start(w, c, ep, h, body);
        return;
    }
    if (path_is(h, "/healthcheck") || path_is(h, "/health")) {
        if (!is_get) {
            px_conn_reply_error(c, 405, NULL, "Allow: GET\r\n", "method not allowed: use GET");
            return;
        }
        char json[160];
        int n;
        if (path_is(h, "/health"))
            n = snprintf(json, sizeof json, "{\"status\":\"ok\"}");
        else
            n = snprintf(json, sizeof json,
                         "{\"status\":\"ok\",\"prefill_instances\":%zu,\"decode_instances\":%zu}",
                         s->prefill.n, s->decode.n);
        px_conn_reply(c, 200, "application/json", NULL, NULL, json, (size_t)n);
        return;
    }
    px_buf m;
    px_buf_init(&m);
    px_buf_printf(&m, "not found: %.*s %.*s", (int)(h->method_len > 16 ? 16 : h->method_len),
                  h->method, (int)(h->target_len > 200 ? 200 : h->target_len), h->target);
    px_conn_reply_error(c, 404, NULL, NULL, m.data);
    px_buf_cleanup(&m);
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

static void on_accept(struct evconnlistener *lev, evutil_socket_t fd, struct sockaddr *sa,
                      int salen, void *arg)
{
    px_worker *w = arg;
    px_conn_accept(w->base, fd, &w->conn_cfg, &w->conns);
}

static void worker_cleanup(px_worker *w)
{
    px_conn_list_close_all(&w->conns);
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
        w->conn_cfg.max_body_bytes = cfg->max_body_bytes;
        w->conn_cfg.header_timeout = cfg->client_header_timeout;
        w->conn_cfg.keepalive_timeout = cfg->keepalive_timeout;
        w->conn_cfg.dispatch = dispatch;
        w->conn_cfg.ctx = w;
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
