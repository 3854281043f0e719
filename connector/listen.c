/* SPDX-License-Identifier: Apache-2.0 */
/* The producer side of the side channel: a TCP listener that authenticates
 * each consumer (HELLO, CHALLENGE, AUTH: HMAC-SHA-256 over both nonces with
 * the cluster secret) and only then answers with this agent's handshake
 * (worker address, region table, rkeys when the consumer can read
 * one-sided), itself MACed, sealed with a key derived from the secret and
 * both nonces (auth.c), so that a relay learns none of it.  The consumer
 * side is peer.c.
 *
 * A consumer that says KVC_HFLAG_OWNER sends its worker address sealed
 * right after AUTH; the producer opens an endpoint of its own to it
 * (consumer.c) and answers that consumer's pulls there.  A consumer without
 * the flag is answered on the endpoint it opened (UCX's reply endpoint),
 * within each pull's callback only: push.c refuses what would need more.
 * Both flags bytes are under the AUTH MAC (auth.c), checked as soon as
 * AUTH is complete.
 * A malformed, oversized or slow side-channel client is closed on its own;
 * handshakes in progress are bounded per source address and in all, and an
 * unauthenticated client of the address holding the most slots gives way to
 * a new one (sconn_make_room). */
#include "connector/kvc_int.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

/* Room for AUTH and the sealed CONSUMER that follows it (KVC_HFLAG_OWNER). */
#define SCONN_IN_CAP (2 * (KVC_WIRE_HDR_LEN + KVC_WIRE_MAX_HELLO))

/* Producer side of one side-channel connection. */
/* SC_LIVE: authenticated, handshake sent, kept open idle (KVC_HFLAG_LIVE)
 * until the consumer closes it, which is its death for this producer. */
typedef enum { SC_HELLO, SC_AUTH, SC_CLOSING, SC_LIVE } kvc_sc_state_t;

struct kvc_sconn {
    kvc_sconn_t *next;
    kvc_pollent_t pe;
    int fd;
    kvc_sc_state_t state;
    uint8_t *in; /* owned, SCONN_IN_CAP bytes */
    size_t in_len;
    kvc_buf_t out;
    size_t out_off;
    uint64_t deadline_ns, accepted_ns;
    char addr[64];  /* the client's address, for limits and logs */
    bool same_host; /* the client connected from this host (loopback or our own address) */
    uint8_t nonce_c[KVC_NONCE_LEN], nonce_p[KVC_NONCE_LEN];
    kvc_chan_t chan; /* after AUTH */
    char *cons_id;   /* owned: the consumer's engine id from its HELLO */
    uint8_t hello_flags, chal_flags; /* as received and as sent: under the AUTH MAC */
    bool owner;      /* both sides said KVC_HFLAG_OWNER: a sealed CONSUMER follows AUTH */
    bool authed;     /* its AUTH verified (chan ready, proto set) */
    uint8_t proto;   /* from its AUTH */
    bool ipc;        /* KVC_HFLAG_IPC both ways: the handshake carries our IPC table */
    bool live;       /* both sides said KVC_HFLAG_LIVE: SC_LIVE after the handshake */
    kvc_cons_t *cons; /* referenced: the record its CONSUMER made, or NULL */
    bool dead;       /* closed; freed by kvc_sconns_reap (events may still name it) */
};

kvc_status_t kvc_resolve(const char *host, uint16_t port, struct sockaddr_storage *ss,
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
    if (kvc_resolve(a->listen_host, a->port, &ss, &sl, true) != KVC_OK) {
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

/* Closes c at once; its memory goes at the end of this progress call, since
 * the epoll batch being handled may still hold events for it (a connection
 * evicted by another's accept). */
static void sconn_close(kvc_agent_t *a, kvc_sconn_t *c) {
    kvc_sconn_t **pp = &a->sconns;
    while (*pp && *pp != c)
        pp = &(*pp)->next;
    if (*pp) *pp = c->next;
    kvc_ep_del(a, c->fd);
    close(c->fd);
    c->fd = -1;
    if (c->cons) {
        kvc_cons_t *k = c->cons;
        if (c->state == SC_LIVE && !k->dead && !a->destroying) {
            /* Its consumer closed the live side channel: gone (or done with
             * us); what waits for it is dropped as on an endpoint failure. */
            kvc_cons_retire(k); /* its place given back, as on an endpoint failure */
            a->stats[KVC_STAT_CONSUMERS_LOST]++;
            KVC_LOG(a, KVC_LOG_INFO, "consumer %s (key %016llx): side channel closed",
                    k->engine_id ? k->engine_id : "?", (unsigned long long)k->key);
            kvc_wake(a);
        }
        c->cons = NULL;
        kvc_cons_unref(k);
    }
    free(c->in);
    c->in = NULL;
    free(c->cons_id);
    c->cons_id = NULL;
    kvc_buf_cleanup(&c->out);
    kvc_chan_cleanup(&c->chan);
    c->dead = true;
    c->next = a->sconns_dead;
    a->sconns_dead = c;
}

void kvc_sconns_reap(kvc_agent_t *a) {
    while (a->sconns_dead) {
        kvc_sconn_t *c = a->sconns_dead;
        a->sconns_dead = c->next;
        free(c);
    }
}

/* Closes a misbehaving client: counted, logged (rate-limited). */
static void sconn_drop(kvc_agent_t *a, kvc_sconn_t *c, const char *why) {
    a->stats[KVC_STAT_PEER_ERRORS]++;
    if (kvc_log_ratelimit(a, KVC_RL_PEER))
        KVC_LOG(a, KVC_LOG_WARN, "side channel: %s from %s, closing", why, c->addr);
    sconn_close(a, c);
}

static void addr_text(const struct sockaddr_storage *ss, char *out, size_t n) {
    const void *ip = ss->ss_family == AF_INET6
                         ? (const void *)&((const struct sockaddr_in6 *)ss)->sin6_addr
                         : (const void *)&((const struct sockaddr_in *)ss)->sin_addr;
    if (!inet_ntop(ss->ss_family, ip, out, (socklen_t)n)) snprintf(out, n, "?");
}

/* Whether a client is on this host: it came over loopback, or from the very
 * address it reached us on.  Only then can it map a shared-memory pool or
 * open a cuda_ipc handle, so only then is it sent rkeys for them. */
static bool same_host(int fd, const struct sockaddr_storage *peer) {
    struct sockaddr_storage me;
    socklen_t ml = sizeof(me);
    if (peer->ss_family == AF_INET) {
        const struct sockaddr_in *p4 = (const struct sockaddr_in *)peer;
        if ((ntohl(p4->sin_addr.s_addr) >> 24) == 127) return true;
        if (getsockname(fd, (struct sockaddr *)&me, &ml) || me.ss_family != AF_INET) return false;
        return p4->sin_addr.s_addr == ((const struct sockaddr_in *)&me)->sin_addr.s_addr;
    }
    if (peer->ss_family == AF_INET6) {
        const struct sockaddr_in6 *p6 = (const struct sockaddr_in6 *)peer;
        if (IN6_IS_ADDR_LOOPBACK(&p6->sin6_addr)) return true;
        if (IN6_IS_ADDR_V4MAPPED(&p6->sin6_addr) && p6->sin6_addr.s6_addr[12] == 127) return true;
        if (getsockname(fd, (struct sockaddr *)&me, &ml) || me.ss_family != AF_INET6) return false;
        return !memcmp(&p6->sin6_addr, &((const struct sockaddr_in6 *)&me)->sin6_addr,
                       sizeof(p6->sin6_addr));
    }
    return false;
}

static size_t addr_count(const kvc_agent_t *a, const char *addr) {
    size_t n = 0;
    for (const kvc_sconn_t *o = a->sconns; o; o = o->next)
        n += o->state != SC_LIVE && !strcmp(o->addr, addr);
    return n;
}

/* Makes room for one more handshake from `addr`; false: refuse it.
 * Every address may hold a quarter of the slots, whatever the state of its
 * connections.  A connection that has not authenticated (no HELLO yet, or a
 * CHALLENGE it has not answered) gives way: over the per-address limit, the
 * one of that address with the earliest deadline; when the table is full,
 * the one with the earliest deadline among the addresses that hold the most
 * slots, so an address with fewer connections than another never loses one
 * to a flood.  Authenticated connections (sending their handshake) are only
 * closed by their deadline.  O(n^2) in the worst case, only when full. */
static bool sconn_make_room(kvc_agent_t *a, const char *addr) {
    size_t total = 0, same = 0;
    uint32_t per = a->max_handshakes / 4 < 4 ? 4 : a->max_handshakes / 4;
    for (kvc_sconn_t *o = a->sconns; o; o = o->next) {
        if (o->state == SC_LIVE) continue; /* done with its handshake */
        total++;
        same += !strcmp(o->addr, addr);
    }
    bool by_addr = same >= per;
    if (total < a->max_handshakes && !by_addr) return true;
    kvc_sconn_t *victim = NULL;
    size_t vcount = 0;
    for (kvc_sconn_t *o = a->sconns; o; o = o->next) {
        if (o->state == SC_CLOSING || o->state == SC_LIVE) continue;
        if (by_addr) {
            if (strcmp(o->addr, addr)) continue;
            if (!victim || o->deadline_ns < victim->deadline_ns) victim = o;
            continue;
        }
        size_t n = victim && !strcmp(o->addr, victim->addr) ? vcount : addr_count(a, o->addr);
        if (!victim || n > vcount || (n == vcount && o->deadline_ns < victim->deadline_ns)) {
            victim = o;
            vcount = n;
        }
    }
    /* Never evict for a newcomer whose address would then hold more. */
    if (!victim || (!by_addr && vcount <= same)) return false;
    sconn_drop(a, victim, "unauthenticated handshake evicted for a new one");
    return true;
}

void kvc_listen_accept(kvc_agent_t *a) {
    for (int i = 0; i < 64; i++) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        int fd = accept4(a->listen_fd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                KVC_LOG(a, KVC_LOG_WARN, "side channel: accept: %s", strerror(errno));
            return;
        }
        char addr[64];
        addr_text(&ss, addr, sizeof(addr));
        if (!sconn_make_room(a, addr)) {
            close(fd);
            a->stats[KVC_STAT_PEER_ERRORS]++;
            if (kvc_log_ratelimit(a, KVC_RL_PEER))
                KVC_LOG(a, KVC_LOG_WARN,
                        "side channel: too many handshakes in progress, "
                        "refusing %s",
                        addr);
            continue;
        }
        kvc_sconn_t *c = calloc(1, sizeof(*c));
        if (!c || !(c->in = malloc(SCONN_IN_CAP))) {
            free(c);
            close(fd);
            KVC_LOG(a, KVC_LOG_ERROR, "side channel: out of memory, connection dropped");
            continue;
        }
        c->fd = fd;
        c->pe = (kvc_pollent_t){PE_SCONN, c};
        c->state = SC_HELLO;
        memcpy(c->addr, addr, sizeof(addr));
        c->same_host = same_host(fd, &ss);
        c->accepted_ns = kvc_now_ns();
        c->deadline_ns = c->accepted_ns + (uint64_t)a->connect_timeout_ms * 1000000ull;
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

/* Sends what is queued.  Closes the connection when it is done with
 * (SC_CLOSING, all written) or broken; false if c was freed. */
static bool sconn_flush(kvc_agent_t *a, kvc_sconn_t *c) {
    while (c->out_off < c->out.len) {
        ssize_t n = send(c->fd, c->out.p + c->out_off, c->out.len - c->out_off, MSG_NOSIGNAL);
        if (n > 0) {
            c->out_off += (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            /* A closing connection is not read any more: input from it must
             * not keep the level-triggered fd readable. */
            uint32_t in = c->state == SC_CLOSING ? 0 : EPOLLIN | EPOLLRDHUP;
            kvc_ep_mod(a, c->fd, in | EPOLLOUT, &c->pe);
            return true;
        }
        sconn_close(a, c); /* the consumer went away */
        return false;
    }
    kvc_buf_cleanup(&c->out);
    c->out_off = 0;
    if (c->state == SC_CLOSING && c->live) {
        c->state = SC_LIVE; /* the handshake went out: kept open, idle */
        free(c->in);
        c->in = NULL;
        c->in_len = 0;
        kvc_chan_cleanup(&c->chan);
    } else if (c->state == SC_CLOSING) {
        sconn_close(a, c);
        return false;
    }
    kvc_ep_mod(a, c->fd, EPOLLIN | EPOLLRDHUP, &c->pe);
    return true;
}

/* Queues an ERROR for the consumer and closes after it. */
static void sconn_refuse(kvc_agent_t *a, kvc_sconn_t *c, kvc_status_t st, const char *msg) {
    kvc_buf_cleanup(&c->out);
    c->out_off = 0;
    kvc_wire_encode_error(&c->out, a->wire_version, st, msg);
    c->state = SC_CLOSING;
    c->live = false;
}

static void on_hello(kvc_agent_t *a, kvc_sconn_t *c, const uint8_t *body, size_t len) {
    kvc_wire_hello_t h;
    if (kvc_wire_parse_hello(body, len, &h) != KVC_OK) {
        sconn_drop(a, c, "malformed hello");
        return;
    }
    bool has = (h.flags & KVC_HFLAG_SECRET) != 0;
    if (has != (a->secret != NULL)) {
        a->stats[KVC_STAT_AUTH_FAILED]++;
        if (kvc_log_ratelimit(a, KVC_RL_AUTH))
            KVC_LOG(a, KVC_LOG_WARN,
                    "side channel: authentication failed for engine %.*s from %s: %s",
                    (int)h.engine_id.len, (const char *)h.engine_id.p, c->addr,
                    has ? "it has a cluster secret, this producer has none"
                        : "it has no cluster secret, this producer requires one");
        sconn_refuse(a, c, KVC_ERR_AUTH,
                     has ? "authentication failed: the producer has no cluster secret"
                         : "authentication failed: the producer requires a cluster secret");
        return;
    }
    memcpy(c->nonce_c, h.nonce, KVC_NONCE_LEN);
    if (!(c->cons_id = kvc_strndup((const char *)h.engine_id.p, h.engine_id.len)) ||
        kvc_random(c->nonce_p, KVC_NONCE_LEN) != KVC_OK) {
        sconn_close(a, c);
        return;
    }
    c->owner = (h.flags & KVC_HFLAG_OWNER) != 0;
    /* IPC handles only to a consumer on this host that can use them. */
    c->ipc = (h.flags & KVC_HFLAG_IPC) && c->same_host && a->ipc_tab.len;
    c->live = (h.flags & KVC_HFLAG_LIVE) != 0;
    c->hello_flags = h.flags;
    c->chal_flags =
        (uint8_t)((a->secret ? KVC_HFLAG_SECRET : 0) | (c->owner ? KVC_HFLAG_OWNER : 0) |
                  (c->ipc ? KVC_HFLAG_IPC : 0) | (c->live ? KVC_HFLAG_LIVE : 0));
    KVC_LOG(a, KVC_LOG_DEBUG, "side channel: hello from engine %s at %s", c->cons_id, c->addr);
    kvc_wire_encode_hello(&c->out, a->wire_version, KVC_MSG_CHALLENGE, a->engine_id,
                          c->chal_flags, c->nonce_p);
    c->state = SC_AUTH;
}

/* The sealed CONSUMER after AUTH (keys ready): an endpoint of our own to
 * the consumer's worker.  False: c was refused (an ERROR queued). */
static bool on_consumer(kvc_agent_t *a, kvc_sconn_t *c, const uint8_t *rec, size_t rec_len) {
    uint8_t *msg = NULL;
    size_t mlen = 0;
    kvc_wire_hdr_t h;
    uint64_t key = 0;
    kvc_span_t addr = {NULL, 0};
    kvc_status_t st = kvc_chan_open(&c->chan, rec, rec_len, &msg, &mlen);
    if (st == KVC_OK &&
        (kvc_wire_parse_hdr(msg, mlen, KVC_WIRE_MAX_HELLO, &h) != KVC_OK ||
         h.type != KVC_MSG_CONSUMER || KVC_WIRE_HDR_LEN + (size_t)h.body_len != mlen ||
         kvc_wire_parse_consumer(msg + KVC_WIRE_HDR_LEN, h.body_len, &key, &addr) != KVC_OK))
        st = KVC_ERR_PROTOCOL;
    if (st == KVC_OK) st = kvc_cons_attach(a, key, addr.p, addr.len, c->cons_id, c->addr);
    if (st == KVC_OK && (c->cons = kvc_cons_find(a, key))) kvc_cons_ref(c->cons);
    if (msg) {
        OPENSSL_cleanse(msg, mlen);
        free(msg);
    }
    if (st == KVC_OK) return true;
    a->stats[KVC_STAT_PEER_ERRORS]++;
    if (kvc_log_ratelimit(a, KVC_RL_PEER))
        KVC_LOG(a, KVC_LOG_WARN, "side channel: consumer message from engine %s at %s: %s",
                c->cons_id, c->addr, kvc_status_str(st));
    kvc_chan_cleanup(&c->chan);
    sconn_refuse(a, c, st == KVC_ERR_BUSY || st == KVC_ERR_AUTH ? st : KVC_ERR_PROTOCOL,
                 st == KVC_ERR_BUSY   ? "too many consumers"
                 : st == KVC_ERR_AUTH ? "authentication failed: the sealed consumer message does "
                                        "not verify (changed in transit)"
                                      : "bad consumer message");
    return false;
}

/* AUTH, checked as soon as it is complete (before a CONSUMER that may
 * follow it: a relay that cleared the CHALLENGE's ownership flag leaves the
 * consumer sending none).  The MAC covers both nonces, engine ids and flags
 * bytes and the protocol.  True: c->authed, its channel keys ready; false:
 * c was dropped or refused (an ERROR queued). */
static bool auth_check(kvc_agent_t *a, kvc_sconn_t *c, const uint8_t *body, size_t len) {
    const uint8_t *mac;
    if (kvc_wire_parse_auth(body, len, &c->proto, &mac) != KVC_OK) {
        sconn_drop(a, c, "malformed auth");
        return false;
    }
    uint8_t want[KVC_MAC_LEN];
    kvc_span_t cid = {(const uint8_t *)c->cons_id, strlen(c->cons_id)};
    kvc_span_t pid = {(const uint8_t *)a->engine_id, strlen(a->engine_id)};
    kvc_mac_consumer(a, c->nonce_c, c->nonce_p, c->proto, c->hello_flags, c->chal_flags, cid, pid,
                     want);
    if (!kvc_mac_equal(want, mac, KVC_MAC_LEN)) {
        a->stats[KVC_STAT_AUTH_FAILED]++;
        if (kvc_log_ratelimit(a, KVC_RL_AUTH))
            KVC_LOG(a, KVC_LOG_WARN,
                    "side channel: authentication failed for engine %s from %s: wrong MAC "
                    "(different cluster secret, or HELLO/CHALLENGE changed in transit)",
                    c->cons_id, c->addr);
        sconn_refuse(a, c, KVC_ERR_AUTH,
                     "authentication failed: different cluster secret, or the handshake was "
                     "changed in transit");
        return false;
    }
    if (kvc_chan_init(&c->chan, a, c->nonce_c, c->nonce_p, mac, true) != KVC_OK) {
        sconn_drop(a, c, "cannot derive the channel keys (OpenSSL)");
        return false;
    }
    c->authed = true;
    return true;
}

/* The authenticated consumer's reply: its CONSUMER message first (rec,
 * KVC_HFLAG_OWNER), then our handshake, sealed. */
static void on_auth(kvc_agent_t *a, kvc_sconn_t *c, const uint8_t *rec, size_t rec_len) {
    uint8_t proto = c->proto;
    /* rkeys only for a consumer that can use them: on this host when every
     * region is a shared-memory pool or device memory registered directly
     * (mapped here, cuda_ipc); on another host only for a consumer that
     * asked for gets from a producer with UCX's RMA (RDMA), never for an
     * automatic one.  path.c picks push for everyone else. */
    bool local = a->n_regions > 0;
    for (size_t i = 0; i < a->n_regions; i++)
        local &= a->regions[i].pool ||
                 (a->regions[i].mem_type == KVC_MEM_CUDA && !a->regions[i].staged && a->rma);
    local &= c->same_host;
    bool rkeys =
        (proto == KVC_PROTO_AUTO && local) || (proto == KVC_PROTO_GET && (local || a->rma));
    /* A consumer that insists on one-sided reads it would not be given keys
     * for (no pool or direct region it can map here, no RMA for another
     * host) would wait for gets that never complete: it is told so at once. */
    if (proto == KVC_PROTO_GET && !rkeys) {
        sconn_refuse(a, c, KVC_ERR_UNSUPPORTED,
                     "this producer serves this consumer no one-sided GET (its regions are not "
                     "connector pools on this host and its UCX context has no RMA): use proto "
                     "auto or push");
        return;
    }
    const kvc_buf_t *hs = rkeys ? &a->hs_msg : &a->hs_msg_nokeys;
    /* The reply, MACed as in version 2, then sealed: a relay that passed the
     * exchange through learns neither the worker address nor the rkeys. */
    kvc_buf_t plain = {0};
    kvc_buf_put(&plain, hs->p, hs->len);
    if (c->ipc) kvc_ipc_hs_append(a, &plain); /* the IPC table, under the MAC and the seal */
    uint8_t m[KVC_MAC_LEN];
    if (!plain.failed)
        kvc_mac_producer(a, c->nonce_c, c->nonce_p, plain.p + KVC_WIRE_HDR_LEN,
                         plain.len - KVC_WIRE_HDR_LEN, m);
    kvc_buf_put(&plain, m, KVC_MAC_LEN);
    kvc_wire_end_msg(&plain, 0);
    bool chan = !plain.failed;
    if (chan && c->owner && !on_consumer(a, c, rec, rec_len)) {
        OPENSSL_cleanse(plain.p, plain.len);
        kvc_buf_cleanup(&plain);
        return;
    }
    if (!chan || kvc_chan_seal(&c->chan, &c->out, a->wire_version, plain.p, plain.len) != KVC_OK) {
        if (plain.p) OPENSSL_cleanse(plain.p, plain.len);
        kvc_buf_cleanup(&plain);
        sconn_drop(a, c, "cannot seal the handshake (out of memory or OpenSSL)");
        return;
    }
    OPENSSL_cleanse(plain.p, plain.len);
    kvc_buf_cleanup(&plain);
    KVC_LOG(a, KVC_LOG_DEBUG, "side channel: engine %s at %s authenticated, rkeys=%d", c->cons_id,
            c->addr, (int)rkeys);
    c->state = SC_CLOSING;
}

static bool sconn_alive(kvc_agent_t *a, kvc_sconn_t *c) {
    for (kvc_sconn_t *o = a->sconns; o; o = o->next)
        if (o == c) return true;
    return false;
}

void kvc_sconn_io(kvc_agent_t *a, kvc_sconn_t *c, uint32_t events) {
    if (c->dead) return;
    if (c->out.len && !sconn_flush(a, c)) return;
    if (c->state == SC_LIVE) { /* nothing may come: a close, or a consumer gone wrong */
        char junk[64];
        ssize_t n = read(c->fd, junk, sizeof(junk));
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
        (void)events;
        sconn_close(a, c);
        return;
    }
    if (c->state == SC_CLOSING) {
        /* Waiting for the reply to drain; a consumer that hangs up is closed. */
        if (events & (EPOLLERR | EPOLLHUP)) sconn_close(a, c);
        return;
    }
    bool eof = false;
    while (c->in_len < SCONN_IN_CAP) {
        ssize_t n = read(c->fd, c->in + c->in_len, SCONN_IN_CAP - c->in_len);
        if (n > 0) {
            c->in_len += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        eof = true;
        break;
    }
    kvc_wire_hdr_t h;
    kvc_status_t st = kvc_wire_parse_hdr(c->in, c->in_len, KVC_WIRE_MAX_HELLO, &h);
    if (st == KVC_AGAIN) {
        if (!eof) return;
        if (c->in_len || c->state != SC_HELLO)
            sconn_drop(a, c, "connection closed mid-handshake");
        else
            sconn_close(a, c); /* a port probe */
        return;
    }
    if (st != KVC_OK) {
        sconn_drop(a, c, "malformed hello or oversized message");
        return;
    }
    if (h.version != a->wire_version) {
        /* Distinct from an auth failure: the consumer reports both versions. */
        a->stats[KVC_STAT_PEER_ERRORS]++;
        if (kvc_log_ratelimit(a, KVC_RL_PEER))
            KVC_LOG(a, KVC_LOG_WARN,
                    "side channel: hello wire version %u from %s, ours %u: version mismatch",
                    h.version, c->addr, a->wire_version);
        char m[96];
        snprintf(m, sizeof(m), "side channel version mismatch: producer speaks %u, hello was %u",
                 a->wire_version, h.version);
        sconn_refuse(a, c, KVC_ERR_VERSION, m);
        sconn_flush(a, c);
        return;
    }
    uint16_t want_type = c->state == SC_HELLO ? KVC_MSG_HELLO : KVC_MSG_AUTH;
    if (h.type != want_type) {
        sconn_drop(a, c, "malformed hello (unexpected message type)");
        return;
    }
    size_t full = KVC_WIRE_HDR_LEN + h.body_len;
    if (c->in_len < full) {
        if (eof) sconn_drop(a, c, "truncated message");
        return; /* the rest comes later (the deadline bounds the wait) */
    }
    if (c->state == SC_AUTH && !c->authed &&
        !auth_check(a, c, c->in + KVC_WIRE_HDR_LEN, h.body_len)) {
        if (sconn_alive(a, c)) sconn_flush(a, c);
        return;
    }
    size_t auth_len = full;
    if (c->state == SC_AUTH && c->owner) { /* AUTH, then the sealed CONSUMER */
        kvc_wire_hdr_t h2;
        st = kvc_wire_parse_hdr(c->in + full, c->in_len - full, KVC_WIRE_MAX_HELLO, &h2);
        if (st == KVC_AGAIN) {
            if (eof) sconn_drop(a, c, "truncated message");
            return;
        }
        if (st != KVC_OK || h2.version != a->wire_version || h2.type != KVC_MSG_SEALED) {
            sconn_drop(a, c, "malformed consumer message");
            return;
        }
        full += KVC_WIRE_HDR_LEN + h2.body_len;
        if (c->in_len < full) {
            if (eof) sconn_drop(a, c, "truncated message");
            return;
        }
    }
    if (c->in_len > full) {
        /* Each message waits for the answer to the previous one: more bytes
         * are a client that does not follow the protocol. */
        sconn_drop(a, c, "malformed hello (bytes ahead of the protocol)");
        return;
    }
    if (c->state == SC_HELLO)
        on_hello(a, c, c->in + KVC_WIRE_HDR_LEN, h.body_len);
    else
        on_auth(a, c, c->in + auth_len, full - auth_len);
    if (!sconn_alive(a, c)) return; /* on_* closed it */
    c->in_len = 0;
    if (eof && c->state != SC_CLOSING) {
        sconn_drop(a, c, "connection closed mid-handshake");
        return;
    }
    sconn_flush(a, c);
}

void kvc_sconns_timers(kvc_agent_t *a, uint64_t now, uint64_t *next) {
    kvc_sconn_t *c = a->sconns;
    while (c) {
        kvc_sconn_t *nx = c->next;
        if (c->state == SC_LIVE) {
            c = nx;
            continue;
        }
        if (now >= c->deadline_ns) {
            sconn_drop(a, c, "client too slow");
        } else if (c->deadline_ns < *next) {
            *next = c->deadline_ns;
        }
        c = nx;
    }
}

void kvc_sconns_destroy(kvc_agent_t *a) {
    while (a->sconns)
        sconn_close(a, a->sconns);
    kvc_sconns_reap(a);
}
