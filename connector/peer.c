/* The side channel: a TCP listener that answers each HELLO with this agent's
 * handshake (worker address, region table, rkeys), and on the consumer side
 * the cache of producers ("peers"): connect, handshake, compatibility checks,
 * UCX endpoint and unpacked rkeys.  A peer whose endpoint fails is dropped
 * from the cache, so the next fetch handshakes again (remote restart). */
#include "kvc_int.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_CONS 4096  /* pre-connected consumer endpoints kept */
#define MAX_SCONNS 256 /* side-channel connections being served at once */

struct kvc_sconn {
    kvc_sconn_t *next;
    kvc_pollent_t pe;
    int fd;
    uint8_t *in; /* owned */
    size_t in_len;
    kvc_buf_t out;
    size_t out_off;
    bool replying;
    uint64_t deadline_ns;
};

static kvc_status_t resolve(const char *host, uint16_t port, struct sockaddr_storage *ss,
                            socklen_t *sl, bool passive) {
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    char ps[8];
    snprintf(ps, sizeof(ps), "%u", port);
    if (getaddrinfo(host, ps, &hints, &res) || !res) return KVC_ERR_INVALID_PARAM;
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *sl = res->ai_addrlen;
    freeaddrinfo(res);
    return KVC_OK;
}

/* ------------------------------------------------------------- listener -- */

kvc_status_t kvc_listen_open(kvc_agent_t *a) {
    struct sockaddr_storage ss;
    socklen_t sl;
    if (resolve(a->listen_host, a->port, &ss, &sl, true) != KVC_OK) {
        KVC_LOG(a, KVC_LOG_ERROR, "side channel: cannot resolve listen host %s", a->listen_host);
        return KVC_ERR_INVALID_PARAM;
    }
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) goto err_log;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&ss, sl) || listen(fd, 128)) goto err_close;
    sl = sizeof(ss);
    if (getsockname(fd, (struct sockaddr *)&ss, &sl)) goto err_close;
    a->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    a->listen_fd = fd;
    a->pe_listen = (kvc_pollent_t){PE_LISTEN, a};
    if (kvc_ep_add(a, fd, EPOLLIN, &a->pe_listen) != KVC_OK) goto err_unset;
    return KVC_OK;

err_unset:
    a->listen_fd = -1;
err_close:
    close(fd);
err_log:
    KVC_LOG(a, KVC_LOG_ERROR, "side channel: listen on %s:%u: %s", a->listen_host, a->port,
            strerror(errno));
    return KVC_ERR_IO;
}

static void sconn_close(kvc_agent_t *a, kvc_sconn_t *c) {
    kvc_sconn_t **pp = &a->sconns;
    while (*pp && *pp != c)
        pp = &(*pp)->next;
    if (*pp) *pp = c->next;
    kvc_ep_del(a, c->fd);
    close(c->fd);
    free(c->in);
    kvc_buf_cleanup(&c->out);
    free(c);
}

void kvc_listen_accept(kvc_agent_t *a) {
    for (int i = 0; i < 64; i++) {
        int fd = accept4(a->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                KVC_LOG(a, KVC_LOG_WARN, "side channel: accept: %s", strerror(errno));
            return;
        }
        size_t nc = 0;
        for (kvc_sconn_t *o = a->sconns; o; o = o->next)
            nc++;
        if (nc >= MAX_SCONNS) {
            close(fd);
            KVC_LOG(a, KVC_LOG_WARN, "side channel: %zu handshakes in progress, refusing", nc);
            continue;
        }
        kvc_sconn_t *c = calloc(1, sizeof(*c));
        if (!c || !(c->in = malloc(KVC_WIRE_HDR_LEN + KVC_WIRE_MAX_HELLO))) {
            free(c);
            close(fd);
            KVC_LOG(a, KVC_LOG_ERROR, "side channel: out of memory, connection dropped");
            continue;
        }
        c->fd = fd;
        c->pe = (kvc_pollent_t){PE_SCONN, c};
        c->deadline_ns = kvc_now_ns() + (uint64_t)a->connect_timeout_ms * 1000000ull;
        if (kvc_ep_add(a, fd, EPOLLIN | EPOLLRDHUP, &c->pe) != KVC_OK) {
            free(c->in);
            free(c);
            close(fd);
            continue;
        }
        c->next = a->sconns;
        a->sconns = c;
    }
}

/* Writes the handshake reply; closes the connection when done or broken.
 * May free c. */
static void sconn_write(kvc_agent_t *a, kvc_sconn_t *c) {
    while (c->out_off < c->out.len) {
        ssize_t n = send(c->fd, c->out.p + c->out_off, c->out.len - c->out_off, MSG_NOSIGNAL);
        if (n > 0) {
            c->out_off += (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
        break;
    }
    sconn_close(a, c); /* done, or the consumer went away */
}

/* ------------------------------------------- producer -> consumer endpoints -- */

struct kvc_cons {
    struct kvc_cons *next;
    kvc_agent_t *a;
    ucp_ep_h ep;
    bool failed;
    void *close_req;
};

static void cons_err_cb(void *arg, ucp_ep_h ep, ucs_status_t us) {
    struct kvc_cons *k = arg;
    k->failed = true; /* closed by kvc_cons_reap, outside this callback */
    kvc_wake(k->a);
}

/* UCX asserts (aborts the process) on a malformed worker address, and its
 * format is private: the best we can do is refuse what cannot be one of
 * ours — another header byte (UCX version and flags) or an absurd length.
 * A crafted address can still get through; the side channel must only be
 * reachable inside the cluster (SECURITY.md). */
static bool addr_plausible(const kvc_agent_t *a, const uint8_t *addr, size_t len) {
    return len >= 16 && len <= 65536 && a->worker_addr_len >= 1 &&
           addr[0] == ((const uint8_t *)a->worker_addr)[0];
}

static void cons_connect(kvc_agent_t *a, const void *addr, size_t len) {
    size_t n = 0;
    for (struct kvc_cons *k = a->cons; k; k = k->next)
        n++;
    if (n >= MAX_CONS) return; /* only an optimisation: skip it */
    struct kvc_cons *k = calloc(1, sizeof(*k));
    if (!k) return;
    k->a = a;
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = addr;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = cons_err_cb;
    ep.err_handler.arg = k;
    if (ucp_ep_create(a->worker, &ep, &k->ep) != UCS_OK) {
        /* Only an optimisation: the consumer's own endpoint still works. */
        free(k);
        return;
    }
    k->next = a->cons;
    a->cons = k;
}

static void *close_force(ucp_ep_h ep) {
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void *req = ucp_ep_close_nbx(ep, &rp);
    return UCS_PTR_IS_PTR(req) ? req : NULL;
}

void kvc_cons_reap(kvc_agent_t *a) {
    struct kvc_cons **pp = &a->cons;
    while (*pp) {
        struct kvc_cons *k = *pp;
        if (k->failed && k->ep) {
            k->close_req = close_force(k->ep);
            k->ep = NULL;
        }
        if (k->close_req && ucp_request_check_status(k->close_req) != UCS_INPROGRESS) {
            ucp_request_free(k->close_req);
            k->close_req = NULL;
        }
        if (!k->ep && !k->close_req) {
            *pp = k->next;
            free(k);
            continue;
        }
        if (k->close_req) kvc_wake(a);
        pp = &k->next;
    }
}

void kvc_cons_destroy(kvc_agent_t *a) {
    for (struct kvc_cons *k = a->cons; k; k = k->next)
        if (k->ep) {
            k->close_req = close_force(k->ep);
            k->ep = NULL;
        }
    uint64_t until = kvc_now_ns() + 1000000000ull;
    while (a->cons) {
        struct kvc_cons *k = a->cons;
        while (k->close_req && ucp_request_check_status(k->close_req) == UCS_INPROGRESS &&
               kvc_now_ns() < until)
            ucp_worker_progress(a->worker);
        if (k->close_req) ucp_request_free(k->close_req);
        a->cons = k->next;
        free(k);
    }
}

void kvc_sconn_io(kvc_agent_t *a, kvc_sconn_t *c, uint32_t events) {
    if (!c->replying) {
        size_t cap = KVC_WIRE_HDR_LEN + KVC_WIRE_MAX_HELLO;
        for (;;) {
            ssize_t n = read(c->fd, c->in + c->in_len, cap - c->in_len);
            if (n > 0) {
                c->in_len += (size_t)n;
                if (c->in_len == cap) break;
                continue;
            }
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
            sconn_close(a, c); /* EOF or error before a full HELLO */
            return;
        }
        kvc_wire_hdr_t h;
        kvc_status_t st = kvc_wire_parse_hdr(c->in, c->in_len, KVC_WIRE_MAX_HELLO, &h);
        if (st == KVC_AGAIN) return;
        if (st != KVC_OK || h.type != KVC_MSG_HELLO) {
            KVC_LOG(a, KVC_LOG_WARN, "side channel: malformed hello, closing");
            sconn_close(a, c);
            return;
        }
        if (c->in_len < KVC_WIRE_HDR_LEN + h.body_len) return;
        if (h.version != a->wire_version) {
            /* Reply anyway: the consumer reports the mismatch with both values. */
            KVC_LOG(a, KVC_LOG_WARN, "side channel: hello wire version %u, ours %u", h.version,
                    a->wire_version);
        }
        kvc_span_t id = {NULL, 0}, addr = {NULL, 0};
        if (h.version == a->wire_version &&
            kvc_wire_parse_hello(c->in + KVC_WIRE_HDR_LEN, h.body_len, &id, &addr) != KVC_OK) {
            KVC_LOG(a, KVC_LOG_WARN, "side channel: malformed hello body, closing");
            sconn_close(a, c);
            return;
        }
        KVC_LOG(a, KVC_LOG_DEBUG, "side channel: hello from engine %.*s", (int)id.len,
                id.p ? (const char *)id.p : "");
        kvc_buf_put(&c->out, a->hs_msg.p, a->hs_msg.len);
        if (c->out.failed) {
            sconn_close(a, c);
            return;
        }
        c->replying = true;
        kvc_ep_mod(a, c->fd, EPOLLOUT | EPOLLRDHUP, &c->pe);
        events |= EPOLLOUT;
        if (addr.len && !addr_plausible(a, addr.p, addr.len)) {
            KVC_LOG(a, KVC_LOG_WARN,
                    "side channel: HELLO with an implausible worker address "
                    "(%zu bytes) ignored",
                    (size_t)addr.len);
        } else if (addr.len) {
            /* Reply first, then connect back: the consumer creates its endpoint
             * meanwhile, UCX pairs the two (same connection sequence number),
             * and the two costly endpoint setups overlap instead of running
             * one after the other during wireup. */
            uint8_t *copy = malloc(addr.len);
            if (copy) memcpy(copy, addr.p, addr.len);
            sconn_write(a, c);
            if (copy) cons_connect(a, copy, addr.len);
            free(copy);
            return;
        }
    }
    if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) sconn_write(a, c);
}

void kvc_sconns_timers(kvc_agent_t *a, uint64_t now, uint64_t *next) {
    kvc_sconn_t *c = a->sconns;
    while (c) {
        kvc_sconn_t *nx = c->next;
        if (now >= c->deadline_ns) {
            KVC_LOG(a, KVC_LOG_WARN, "side channel: client too slow, closing");
            sconn_close(a, c);
        } else if (c->deadline_ns < *next) {
            *next = c->deadline_ns;
        }
        c = nx;
    }
}

void kvc_sconns_destroy(kvc_agent_t *a) {
    while (a->sconns)
        sconn_close(a, a->sconns);
}

/* ---------------------------------------------------------------- peers -- */

void kvc_peer_ref(kvc_peer_t *p) {
    p->refs++;
}

void kvc_peer_unref(kvc_agent_t *a, kvc_peer_t *p) {
    p->refs--;
    kvc_wake(a); /* reap may free it */
}

bool kvc_peer_ready(const kvc_peer_t *p) {
    return p->state == PEER_READY;
}

bool kvc_peer_dead(const kvc_peer_t *p, kvc_status_t *st, const char **msg) {
    if (p->state != PEER_DEAD) return false;
    *st = p->fail_status;
    *msg = p->fail_msg;
    return true;
}

static void peer_close_socket(kvc_agent_t *a, kvc_peer_t *p) {
    if (p->fd >= 0) {
        kvc_ep_del(a, p->fd);
        close(p->fd);
        p->fd = -1;
    }
    free(p->in);
    p->in = NULL;
    p->in_len = p->in_cap = 0;
    kvc_buf_cleanup(&p->out);
}

/* Marks the peer dead and fails the fetches that depend on it.  May run from
 * a UCX callback: it does not call UCX; reap closes the endpoint later. */
static void peer_fail(kvc_agent_t *a, kvc_peer_t *p, kvc_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void peer_fail(kvc_agent_t *a, kvc_peer_t *p, kvc_status_t st, const char *fmt, ...) {
    if (p->state == PEER_DEAD) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->fail_msg, sizeof(p->fail_msg), fmt, ap);
    va_end(ap);
    p->fail_status = st;
    p->state = PEER_DEAD;
    p->linked = false;
    peer_close_socket(a, p);
    KVC_LOG(a, KVC_LOG_WARN, "peer %s:%u: %s (%s)", p->host, p->port, p->fail_msg,
            kvc_status_str(st));
    kvc_xfers_fail_peer(a, p, st, p->fail_msg);
    kvc_wake(a);
}

void kvc_peer_abort(kvc_agent_t *a, kvc_peer_t *p, kvc_status_t st, const char *msg) {
    peer_fail(a, p, st, "%s", msg);
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t us) {
    kvc_peer_t *p = arg;
    peer_fail(p->a, p, KVC_ERR_PEER_FAILED, "endpoint to engine %s failed: %s",
              p->engine_id ? p->engine_id : "?", ucs_status_string(us));
}

static void peer_free(kvc_agent_t *a, kvc_peer_t *p) {
    peer_close_socket(a, p);
    free(p->rr);
    free(p->host);
    free(p->engine_id);
    free(p);
}

static void peer_release_rkeys(kvc_peer_t *p) {
    for (uint32_t i = 0; p->rr && i < p->n_regions; i++)
        if (p->rr[i].rkey) {
            ucp_rkey_destroy(p->rr[i].rkey);
            p->rr[i].rkey = NULL;
        }
}

static void *ep_close(kvc_peer_t *p) {
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void *req = ucp_ep_close_nbx(p->ep, &rp);
    p->ep = NULL;
    return UCS_PTR_IS_PTR(req) ? req : NULL;
}

void kvc_peers_reap(kvc_agent_t *a) {
    kvc_peer_t **pp = &a->peers;
    while (*pp) {
        kvc_peer_t *p = *pp;
        bool retire = p->state == PEER_DEAD || (!p->linked && p->refs == 0);
        if (retire && p->ep) {
            /* Force close cancels the requests still on the endpoint; their
             * callbacks run while the fetches they point to still exist. */
            p->close_req = ep_close(p);
        }
        if (p->close_req && ucp_request_check_status(p->close_req) != UCS_INPROGRESS) {
            ucp_request_free(p->close_req);
            p->close_req = NULL;
        }
        if (retire && p->refs == 0 && !p->close_req) {
            peer_release_rkeys(p);
            *pp = p->next;
            peer_free(a, p);
            continue;
        }
        if (p->close_req) kvc_wake(a); /* poll the close again */
        pp = &p->next;
    }
}

void kvc_peers_destroy(kvc_agent_t *a) {
    for (kvc_peer_t *p = a->peers; p; p = p->next)
        if (p->ep) p->close_req = ep_close(p);
    /* Wait (bounded) for the closes so that cancelled requests call back now,
     * while the fetches they point to still exist. */
    uint64_t until = kvc_now_ns() + 1000000000ull;
    for (kvc_peer_t *p = a->peers; p; p = p->next) {
        if (!p->close_req) continue;
        while (ucp_request_check_status(p->close_req) == UCS_INPROGRESS && kvc_now_ns() < until)
            ucp_worker_progress(a->worker);
        ucp_request_free(p->close_req);
        p->close_req = NULL;
    }
    while (a->peers) {
        kvc_peer_t *p = a->peers;
        a->peers = p->next;
        peer_release_rkeys(p);
        peer_free(a, p);
    }
}

void kvc_peers_timers(kvc_agent_t *a, uint64_t now, uint64_t *next) {
    for (kvc_peer_t *p = a->peers; p; p = p->next) {
        if (p->state != PEER_CONNECTING && p->state != PEER_HELLO) continue;
        if (now >= p->deadline_ns)
            peer_fail(a, p, KVC_ERR_UNREACHABLE, "handshake with %s:%u timed out after %u ms",
                      p->host, p->port, a->connect_timeout_ms);
        else if (p->deadline_ns < *next)
            *next = p->deadline_ns;
    }
}

kvc_status_t kvc_peer_get(kvc_agent_t *a, const char *host, uint16_t port, const char *engine_id,
                          kvc_peer_t **out) {
    for (kvc_peer_t *p = a->peers; p; p = p->next) {
        if (!p->linked || p->port != port || strcmp(p->host, host)) continue;
        if (p->state == PEER_READY && engine_id && strcmp(engine_id, p->engine_id)) {
            /* Another engine answers there now: a restart.  Stop using the old
             * entry; fetches still on it finish or fail on their own. */
            KVC_LOG(a, KVC_LOG_INFO, "peer %s:%u: engine id changed %s -> %s, new handshake", host,
                    port, p->engine_id, engine_id);
            p->linked = false;
            continue;
        }
        *out = p;
        return KVC_OK;
    }
    kvc_peer_t *p = calloc(1, sizeof(*p));
    if (!p) return KVC_ERR_NO_MEMORY;
    p->a = a;
    p->fd = -1;
    p->pe = (kvc_pollent_t){PE_PEER, p};
    p->host = kvc_strdup(host);
    p->engine_id = engine_id ? kvc_strdup(engine_id) : NULL;
    p->port = port;
    if (!p->host || (engine_id && !p->engine_id)) {
        peer_free(a, p);
        return KVC_ERR_NO_MEMORY;
    }
    p->state = PEER_CONNECTING;
    p->linked = true;
    p->deadline_ns = kvc_now_ns() + (uint64_t)a->connect_timeout_ms * 1000000ull;
    p->next = a->peers;
    a->peers = p;

    struct sockaddr_storage ss;
    socklen_t sl;
    if (resolve(host, port, &ss, &sl, false) != KVC_OK) {
        peer_fail(a, p, KVC_ERR_UNREACHABLE, "cannot resolve %s", host);
        goto out;
    }
    p->fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (p->fd < 0) {
        peer_fail(a, p, KVC_ERR_IO, "socket: %s", strerror(errno));
        goto out;
    }
    int one = 1;
    setsockopt(p->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (connect(p->fd, (struct sockaddr *)&ss, sl) && errno != EINPROGRESS) {
        peer_fail(a, p, KVC_ERR_UNREACHABLE, "connect to %s:%u: %s", host, port, strerror(errno));
        goto out;
    }
    if (kvc_ep_add(a, p->fd, EPOLLOUT | EPOLLIN | EPOLLRDHUP, &p->pe) != KVC_OK)
        peer_fail(a, p, KVC_ERR_IO, "epoll: %s", strerror(errno));
out:
    *out = p;
    return KVC_OK;
}

static kvc_proto_t choose_proto(kvc_agent_t *a, kvc_peer_t *p) {
    bool shm = p->n_regions > 0;
    for (uint32_t i = 0; i < p->n_regions && shm; i++) {
        void *ptr = NULL;
        shm = ucp_rkey_ptr(p->rr[i].rkey, p->rr[i].base, &ptr) == UCS_OK && ptr;
        p->rr[i].mapped = shm ? ptr : NULL;
    }
    p->shm = shm;
    if (a->proto != KVC_PROTO_AUTO) return a->proto;
    /* A mapping of every remote region means shared memory on this host:
     * reads are one-sided memcpy through UCX's mapping (xfer.c), whatever
     * lanes the endpoint uses.  Otherwise (tcp, registered memory) a get is
     * emulated by the producer's handler and slow on tcp; a producer push is
     * what the transport does well.  With RDMA, set KVC_PROTO=get. */
    return shm ? KVC_PROTO_GET : KVC_PROTO_PUSH;
}

/* Logs which UCX transports the endpoint's lanes use ("tcp", "posix", ...):
 * tests check that the sm configuration really moves data over shared memory. */
static void log_transports(kvc_agent_t *a, kvc_peer_t *p) {
    char *text = NULL, names[256] = "";
    size_t tlen = 0, nl = 0;
    FILE *f = open_memstream(&text, &tlen);
    if (!f) return;
    ucp_ep_print_info(p->ep, f);
    fclose(f);
    /* Lane lines look like "lane[0]:  3:posix/memory.0 md[2] ...". */
    for (char *s = text; s && (s = strstr(s, "lane[")); s++) {
        char *c = strchr(s, ':');
        if (!c) break;
        c++;
        while (*c == ' ')
            c++;
        while (*c >= '0' && *c <= '9')
            c++;
        if (*c != ':') continue;
        char *tl = c + 1, *e = tl;
        while (*e && *e != '/' && *e != ' ' && *e != '\n')
            e++;
        size_t k = (size_t)(e - tl);
        if (k == 0 || k > 32) continue;
        char tok[40];
        snprintf(tok, sizeof(tok), ",%.*s,", (int)k, tl);
        char padded[260];
        snprintf(padded, sizeof(padded), ",%s,", names);
        if (strstr(padded, tok)) continue;
        if (nl + k + 2 >= sizeof(names)) break;
        nl += (size_t)snprintf(names + nl, sizeof(names) - nl, "%s%.*s", nl ? "," : "", (int)k, tl);
    }
    if (getenv("KVC_DUMP_EP")) fprintf(stderr, "%s\n", text);
    free(text);
    KVC_LOG(a, KVC_LOG_DEBUG, "peer %s:%u transports=%s", p->host, p->port, names[0] ? names : "?");
}

static kvc_status_t ep_create(kvc_agent_t *a, kvc_peer_t *p, const kvc_span_t *addr) {
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = (const ucp_address_t *)addr->p;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = ep_err_cb;
    ep.err_handler.arg = p;
    ucs_status_t us = ucp_ep_create(a->worker, &ep, &p->ep);
    if (us != UCS_OK) {
        /* e.g. UCX_TLS=sm alone: no transport supports peer-failure mode. */
        KVC_LOG(a, KVC_LOG_WARN,
                "peer %s:%u: endpoint with peer-failure handling failed (%s); "
                "retrying without: a dead peer is then only caught by timeouts",
                p->host, p->port, ucs_status_string(us));
        ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
        us = ucp_ep_create(a->worker, &ep, &p->ep);
    }
    if (us != UCS_OK) {
        p->ep = NULL;
        peer_fail(a, p, KVC_ERR_TRANSPORT, "ucp_ep_create: %s", ucs_status_string(us));
        return KVC_ERR_TRANSPORT;
    }
    return KVC_OK;
}

static void handshake_done(kvc_agent_t *a, kvc_peer_t *p, const uint8_t *body, size_t len) {
    kvc_wire_hs_t hs;
    KVC_LOG(a, KVC_LOG_DEBUG, "peer %s:%u: handshake received (%zu bytes)", p->host, p->port, len);
    kvc_status_t st = kvc_wire_parse_handshake(body, len, &hs);
    if (st != KVC_OK) {
        peer_fail(a, p, st == KVC_ERR_NO_MEMORY ? st : KVC_ERR_PROTOCOL,
                  "malformed handshake from %s:%u", p->host, p->port);
        return;
    }
    int eid_len = (int)hs.engine_id.len;
    const char *eid = (const char *)hs.engine_id.p;
    if (p->engine_id &&
        (strlen(p->engine_id) != hs.engine_id.len || memcmp(p->engine_id, eid, hs.engine_id.len))) {
        peer_fail(a, p, KVC_ERR_INCOMPATIBLE,
                  "engine id mismatch: kv_transfer_params name %s, %s:%u is %.*s", p->engine_id,
                  p->host, p->port, eid_len, eid);
        goto out;
    }
    if (hs.layout.len != strlen(a->layout) || memcmp(hs.layout.p, a->layout, hs.layout.len)) {
        peer_fail(a, p, KVC_ERR_INCOMPATIBLE, "KV layout mismatch: local %s=%s, remote %.*s=%.*s",
                  a->engine_id, a->layout, eid_len, eid, (int)hs.layout.len,
                  (const char *)hs.layout.p);
        goto out;
    }
    if (hs.n_regions != a->n_regions) {
        peer_fail(a, p, KVC_ERR_INCOMPATIBLE,
                  "region count mismatch: local %s has %zu, remote %.*s has %u", a->engine_id,
                  a->n_regions, eid_len, eid, hs.n_regions);
        goto out;
    }
    for (uint32_t i = 0; i < hs.n_regions; i++) {
        if (hs.regions[i].block_len != a->regions[i].block_len) {
            peer_fail(a, p, KVC_ERR_INCOMPATIBLE,
                      "block_len mismatch in region %u: local %s=%zu, remote %.*s=%llu", i,
                      a->engine_id, a->regions[i].block_len, eid_len, eid,
                      (unsigned long long)hs.regions[i].block_len);
            goto out;
        }
    }
    if (!p->engine_id && !(p->engine_id = kvc_strndup(eid, hs.engine_id.len))) {
        peer_fail(a, p, KVC_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    p->rr = calloc(hs.n_regions ? hs.n_regions : 1, sizeof(*p->rr));
    if (!p->rr) {
        peer_fail(a, p, KVC_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    p->n_regions = hs.n_regions;
    p->num_blocks = hs.num_blocks;
    p->nonce = hs.nonce;
    if (!addr_plausible(a, hs.worker_addr.p, hs.worker_addr.len)) {
        peer_fail(a, p, KVC_ERR_PROTOCOL, "handshake carries an implausible worker address");
        goto out;
    }
    if (ep_create(a, p, &hs.worker_addr) != KVC_OK) goto out;
    KVC_LOG(a, KVC_LOG_DEBUG, "peer %s:%u: endpoint created", p->host, p->port);
    for (uint32_t i = 0; i < hs.n_regions; i++) {
        p->rr[i].base = hs.regions[i].base;
        p->rr[i].len = hs.regions[i].len;
        p->rr[i].block_len = hs.regions[i].block_len;
        ucs_status_t us = ucp_ep_rkey_unpack(p->ep, hs.regions[i].rkey.p, &p->rr[i].rkey);
        if (us != UCS_OK) {
            p->rr[i].rkey = NULL;
            peer_fail(a, p, KVC_ERR_PROTOCOL, "rkey %u from %.*s: %s", i, eid_len, eid,
                      ucs_status_string(us));
            goto out;
        }
    }
    p->proto = choose_proto(a, p);
    if (a->log_level >= KVC_LOG_DEBUG) log_transports(a, p); /* ucp_ep_print_info: ms */
    p->state = PEER_READY;
    peer_close_socket(a, p);
    a->stats[KVC_STAT_HANDSHAKES]++;
    KVC_LOG(a, KVC_LOG_INFO,
            "handshake with engine %s at %s:%u: regions=%u num_blocks=%llu proto=%s "
            "remote_memory=%s",
            p->engine_id, p->host, p->port, p->n_regions, (unsigned long long)p->num_blocks,
            p->proto == KVC_PROTO_GET ? "get" : "push", p->shm ? "shared-mapped" : "remote");
    kvc_wake(a);
out:
    kvc_wire_hs_cleanup(&hs);
}

void kvc_peer_io(kvc_agent_t *a, kvc_peer_t *p, uint32_t events) {
    if (p->state == PEER_CONNECTING) {
        if (!(events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) return;
        int err = 0;
        socklen_t el = sizeof(err);
        if (getsockopt(p->fd, SOL_SOCKET, SO_ERROR, &err, &el) || err) {
            peer_fail(a, p, KVC_ERR_UNREACHABLE, "connect to %s:%u: %s", p->host, p->port,
                      strerror(err ? err : errno));
            return;
        }
        kvc_wire_encode_hello(&p->out, a->wire_version, a->engine_id, a->worker_addr,
                              a->worker_addr_len);
        if (p->out.failed) {
            peer_fail(a, p, KVC_ERR_NO_MEMORY, "out of memory");
            return;
        }
        p->state = PEER_HELLO;
        events |= EPOLLOUT;
    }
    if (p->state != PEER_HELLO) return;
    while (p->out_off < p->out.len) {
        ssize_t n = send(p->fd, p->out.p + p->out_off, p->out.len - p->out_off, MSG_NOSIGNAL);
        if (n > 0) {
            p->out_off += (size_t)n;
            if (p->out_off == p->out.len) kvc_ep_mod(a, p->fd, EPOLLIN | EPOLLRDHUP, &p->pe);
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        peer_fail(a, p, KVC_ERR_UNREACHABLE, "send hello to %s:%u: %s", p->host, p->port,
                  strerror(errno));
        return;
    }
    for (;;) {
        kvc_wire_hdr_t h;
        size_t want = KVC_WIRE_HDR_LEN;
        kvc_status_t st = kvc_wire_parse_hdr(p->in, p->in_len, KVC_WIRE_MAX_BODY, &h);
        if (st == KVC_ERR_PROTOCOL) {
            peer_fail(a, p, KVC_ERR_PROTOCOL, "bad handshake header from %s:%u", p->host, p->port);
            return;
        }
        if (st == KVC_OK) {
            if (h.version != a->wire_version) {
                peer_fail(a, p, KVC_ERR_VERSION,
                          "handshake wire version mismatch: local %s speaks %u, remote %s:%u "
                          "speaks %u",
                          a->engine_id, a->wire_version, p->host, p->port, h.version);
                return;
            }
            if (h.type != KVC_MSG_HANDSHAKE) {
                peer_fail(a, p, KVC_ERR_PROTOCOL, "unexpected message type %u from %s:%u", h.type,
                          p->host, p->port);
                return;
            }
            want = KVC_WIRE_HDR_LEN + h.body_len;
            if (p->in_len >= want) {
                handshake_done(a, p, p->in + KVC_WIRE_HDR_LEN, h.body_len);
                return;
            }
        }
        if (p->in_cap < want) {
            size_t cap = want < 4096 ? 4096 : want;
            uint8_t *ni = realloc(p->in, cap);
            if (!ni) {
                peer_fail(a, p, KVC_ERR_NO_MEMORY, "out of memory");
                return;
            }
            p->in = ni;
            p->in_cap = cap;
        }
        ssize_t n = read(p->fd, p->in + p->in_len, (st == KVC_OK ? want : p->in_cap) - p->in_len);
        if (n > 0) {
            p->in_len += (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
        peer_fail(a, p, KVC_ERR_UNREACHABLE, "%s:%u closed the side channel during handshake",
                  p->host, p->port);
        return;
    }
}
