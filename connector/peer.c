/* SPDX-License-Identifier: Apache-2.0 */
/* The consumer side of the side channel: the cache of producers ("peers"):
 * connect, authenticate, compatibility checks, UCX endpoint and unpacked
 * rkeys.  A peer whose endpoint fails is dropped from the cache, so the next
 * fetch handshakes again (remote restart).  The producer's listener is
 * listen.c. */
#include "connector/kvc_int.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

/* UCX asserts (aborts the process) on a malformed worker address, and its
 * format is private: the best we can do is refuse what cannot be one of
 * ours — another header byte (UCX version and flags) or an absurd length.
 * The address now comes only from an authenticated producer (its MAC is
 * checked first). */
static bool addr_plausible(const kvc_agent_t *a, const uint8_t *addr, size_t len) {
    return len >= 16 && len <= 65536 && a->worker_addr_len >= 1 &&
           addr[0] == ((const uint8_t *)a->worker_addr)[0];
}

/* ---------------------------------------------------------------- peers -- */

static void peer_ready(kvc_agent_t *a, kvc_peer_t *p);

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
    kvc_chan_cleanup(&p->chan);
}

/* Marks the peer dead; the fetches that depend on it fail on their next
 * advance (xfer.c).  May run from a UCX callback: it does not call UCX;
 * reap closes the endpoint later. */
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
    kvc_ipc_peer_close(a, p);
    free(p->rr);
    free(p->host);
    free(p->engine_id);
    free(p);
}

static void peer_release_rkeys(kvc_peer_t *p) {
    kvc_stage_peer_cleanup(p->a, p);
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
        if (p->state != PEER_CONNECTING && p->state != PEER_HELLO && p->state != PEER_AUTH &&
            p->state != PEER_IPC)
            continue;
        if (now >= p->deadline_ns && p->state == PEER_IPC) {
            /* The producer's fds did not come: its memory is pushed. */
            KVC_LOG(a, KVC_LOG_WARN,
                    "CUDA IPC with engine %s off: its VMM allocations' fds did not come within "
                    "%u ms; pushed instead",
                    p->engine_id, a->connect_timeout_ms);
            kvc_ipc_peer_close(a, p);
            peer_ready(a, p);
        } else if (now >= p->deadline_ns)
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
    if (kvc_resolve(host, port, &ss, &sl, false) != KVC_OK) {
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

/* Appends transport name tl (k bytes) to the comma-separated names (of
 * *nl bytes) unless it is there already. */
static void add_name(char names[256], size_t *nl, const char *tl, size_t k) {
    if (k == 0 || k > 32) return;
    char tok[40], padded[260];
    snprintf(tok, sizeof(tok), ",%.*s,", (int)k, tl);
    snprintf(padded, sizeof(padded), ",%s,", names);
    if (strstr(padded, tok) || *nl + k + 2 >= 256) return;
    *nl += (size_t)snprintf(names + *nl, 256 - *nl, "%s%.*s", *nl ? "," : "", (int)k, tl);
}

/* The UCX transports the endpoint's lanes use ("tcp,posix", ...) into names:
 * the path choice needs them, and tests check that the sm configuration
 * really moves data over shared memory.  From ucp_ep_query where UCX has it
 * (1.14 on); UCX 1.13 has no API for it, and there the lanes are read from
 * ucp_ep_print_info's text. */
static void ep_transports(kvc_peer_t *p, char names[256]) {
    size_t nl = 0;
    names[0] = 0;
#if UCP_API_VERSION >= UCP_VERSION(1, 14)
    ucp_transport_entry_t ents[32];
    ucp_ep_attr_t ea;
    memset(&ea, 0, sizeof(ea));
    memset(ents, 0, sizeof(ents));
    ea.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    ea.transports.entries = ents;
    ea.transports.num_entries = sizeof(ents) / sizeof(ents[0]);
    ea.transports.entry_size = sizeof(ents[0]);
    if (ucp_ep_query(p->ep, &ea) == UCS_OK) {
        for (unsigned i = 0; i < ea.transports.num_entries && i < 32; i++)
            if (ents[i].transport_name)
                add_name(names, &nl, ents[i].transport_name, strlen(ents[i].transport_name));
        return;
    }
#endif
    char *text = NULL;
    size_t tlen = 0;
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
        add_name(names, &nl, tl, (size_t)(e - tl));
    }
    if (getenv("KVC_DUMP_EP")) fprintf(stderr, "%s\n", text);
    free(text);
}

/* Maps the remote regions here when they are shared memory on this host,
 * then picks GET or PUSH (path.c).  False (peer failed) when the wanted
 * protocol cannot serve these memory types. */
static bool choose_path(kvc_agent_t *a, kvc_peer_t *p) {
    kvc_path_in_t in = {.want = a->proto,
                        .ipc = p->ipc != NULL,
                        .rma = a->rma,
                        .local_dev = a->cuda_direct,
                        .local_staged = a->n_staged > 0};
    in.keys = p->n_regions > 0;
    for (uint32_t i = 0; i < p->n_regions; i++) {
        in.keys &= p->rr[i].rkey != NULL;
        in.remote_dev |= p->rr[i].mem_type == KVC_MEM_CUDA;
    }
    in.mapped = in.keys && !in.remote_dev;
    for (uint32_t i = 0; i < p->n_regions && in.mapped; i++) {
        void *ptr = NULL;
        in.mapped = ucp_rkey_ptr(p->rr[i].rkey, p->rr[i].base, &ptr) == UCS_OK && ptr;
        p->rr[i].mapped = in.mapped ? ptr : NULL;
    }
    /* ucp_ep_print_info takes milliseconds: only where the choice needs the
     * transports (device memory on either side) or someone reads the log. */
    char names[256] = "";
    if (in.local_dev || in.remote_dev || a->n_staged || a->log_level >= KVC_LOG_DEBUG) {
        ep_transports(p, names);
        p->transports = kvc_transport_bits(names);
        a->stats[KVC_STAT_TRANSPORTS] |= p->transports;
    }
    in.transports = p->transports;
    kvc_path_t path;
    kvc_status_t st = kvc_choose_path(&in, &path);
    KVC_LOG(a, KVC_LOG_DEBUG,
            "peer %s:%u transports=%s path=%s (%s) local_memory=%s remote_memory=%s", p->host,
            p->port, names[0] ? names : "?", path.proto == KVC_PROTO_GET ? "get" : "push", path.why,
            a->cuda_direct ? "cuda-direct"
            : a->n_staged  ? "cuda-staged"
                           : "host",
            in.remote_dev ? "cuda" : "host");
    if (st != KVC_OK) {
        peer_fail(a, p, st, "engine %s at %s:%u: %s (transports %s)", p->engine_id, p->host,
                  p->port, path.why, names[0] ? names : "?");
        return false;
    }
    p->proto = path.proto;
    /* The mapping is used only for host memory; a get of device memory goes
     * through UCX. */
    p->shm = path.mapped_copy;
    if (!path.ipc_copy) kvc_ipc_peer_close(a, p); /* not used: not kept open */
    a->stats[path.ipc_copy                 ? KVC_STAT_PEERS_IPC
             : path.proto == KVC_PROTO_GET ? KVC_STAT_PEERS_GET
                                           : KVC_STAT_PEERS_PUSH]++;
    return true;
}

static kvc_status_t ep_create(kvc_agent_t *a, kvc_peer_t *p, const kvc_span_t *addr) {
    bool degraded;
    ucs_status_t us = kvc_ep_open(a, addr->p, ep_err_cb, p, &p->ep, &degraded);
    if (degraded && us == UCS_OK)
        KVC_LOG(a, KVC_LOG_WARN,
                "peer %s:%u: endpoint with peer-failure handling failed; "
                "made one without: a dead peer is then only caught by timeouts",
                p->host, p->port);
    if (us != UCS_OK) {
        peer_fail(a, p, KVC_ERR_TRANSPORT, "ucp_ep_create: %s", ucs_status_string(us));
        return KVC_ERR_TRANSPORT;
    }
    return KVC_OK;
}

/* The handshake's end: the path chosen, fetches may go. */
/* After the handshake: a live side channel (KVC_HFLAG_LIVE both ways) is
 * kept open, idle, its close the producer's death (kvc_peer_io); any other
 * is closed. */
static void side_channel_idle(kvc_agent_t *a, kvc_peer_t *p) {
    if (!p->live) {
        peer_close_socket(a, p);
        return;
    }
    free(p->in);
    p->in = NULL;
    p->in_len = p->in_cap = 0;
    kvc_buf_cleanup(&p->out);
    kvc_chan_cleanup(&p->chan);
    kvc_ep_mod(a, p->fd, EPOLLIN | EPOLLRDHUP, &p->pe);
}

static void peer_ready(kvc_agent_t *a, kvc_peer_t *p) {
    if (!choose_path(a, p)) return;
    if (p->state != PEER_IPC) side_channel_idle(a, p); /* PEER_IPC: already */
    p->state = PEER_READY;
    a->stats[KVC_STAT_HANDSHAKES]++;
    KVC_LOG(a, KVC_LOG_INFO,
            "handshake with engine %s at %s:%u: regions=%u num_blocks=%llu proto=%s "
            "remote_memory=%s",
            p->engine_id, p->host, p->port, p->n_regions, (unsigned long long)p->num_blocks,
            p->ipc                      ? "ipc"
            : p->proto == KVC_PROTO_GET ? "get"
                                        : "push",
            p->ipc   ? "cuda-ipc-mapped"
            : p->shm ? "shared-mapped"
                     : "remote");
    kvc_wake(a);
}

void kvc_peer_ipc_io(kvc_agent_t *a, kvc_peer_t *p, uint32_t events) {
    if (p->state != PEER_IPC) {
        kvc_ipc_peer_close(a, p); /* failed meanwhile: nothing more to read */
        return;
    }
    if (kvc_ipc_peer_io(a, p, events)) peer_ready(a, p);
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
    /* Nothing of the handshake (worker address, rkeys) is used before its
     * MAC checks out. */
    uint8_t want[KVC_MAC_LEN];
    kvc_mac_producer(a, p->nonce_c, p->nonce_p, body, hs.signed_len, want);
    if (!kvc_mac_equal(want, hs.mac, KVC_MAC_LEN)) {
        a->stats[KVC_STAT_AUTH_FAILED]++;
        peer_fail(a, p, KVC_ERR_AUTH,
                  "authentication failed: the handshake from %s:%u does not carry a valid MAC "
                  "(different cluster secret)",
                  p->host, p->port);
        goto out;
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
        if (hs.regions[i].mem_type != KVC_MEM_HOST && hs.regions[i].mem_type != KVC_MEM_CUDA) {
            peer_fail(a, p, KVC_ERR_INCOMPATIBLE,
                      "region %u of %.*s has memory type %u, which this agent cannot read", i,
                      eid_len, eid, hs.regions[i].mem_type);
            goto out;
        }
        /* Block lengths may differ (heterogeneous TP reads parts of
         * blocks): each fetch checks its part sizes (xfer.c, start_data). */
        if (hs.regions[i].block_len == 0) {
            peer_fail(a, p, KVC_ERR_PROTOCOL, "region %u of %.*s has block_len 0", i, eid_len,
                      eid);
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
        p->rr[i].mem_type = hs.regions[i].mem_type;
        if (hs.regions[i].rkey.len == 0) continue; /* push only: no rkeys were sent */
        ucs_status_t us = ucp_ep_rkey_unpack(p->ep, hs.regions[i].rkey.p, &p->rr[i].rkey);
        if (us != UCS_OK && hs.regions[i].mem_type == KVC_MEM_CUDA) {
            /* Device memory this UCX cannot reach (no CUDA support here): no
             * one-sided reads, the producer pushes (path.c). */
            KVC_LOG(a, KVC_LOG_DEBUG, "rkey %u from %.*s (device memory) not usable here: %s", i,
                    eid_len, eid, ucs_status_string(us));
            p->rr[i].rkey = NULL;
            continue;
        }
        if (us != UCS_OK) {
            p->rr[i].rkey = NULL;
            peer_fail(a, p, KVC_ERR_PROTOCOL, "rkey %u from %.*s: %s", i, eid_len, eid,
                      ucs_status_string(us));
            goto out;
        }
    }
    /* p->ipc: this node's GPUs, mapped; VMM memory's fds may still come. */
    if (kvc_ipc_peer_open(a, p, hs.ipc)) {
        p->state = PEER_IPC;
        p->deadline_ns = kvc_now_ns() + (uint64_t)a->connect_timeout_ms * 1000000ull;
        side_channel_idle(a, p);
        goto out;
    }
    peer_ready(a, p);
out:
    kvc_wire_hs_cleanup(&hs);
}

/* The flags of our HELLO (under the AUTH MAC, with the CHALLENGE's). */
static uint8_t hello_flags(const kvc_agent_t *a) {
    /* KVC_TEST_NO_LIVE (tests only): a consumer that does not keep its side
     * channel, as a peer may choose, so its record can give way. */
    bool live = !getenv("KVC_TEST_NO_LIVE");
    return (uint8_t)((a->secret ? KVC_HFLAG_SECRET : 0) | KVC_HFLAG_OWNER |
                     (live ? KVC_HFLAG_LIVE : 0) | (kvc_ipc_can_import(a) ? KVC_HFLAG_IPC : 0));
}

/* The producer's CHALLENGE: answer with our MAC over both nonces and both
 * flags bytes. */
static void on_challenge(kvc_agent_t *a, kvc_peer_t *p, const uint8_t *body, size_t len) {
    kvc_wire_hello_t h;
    if (kvc_wire_parse_hello(body, len, &h) != KVC_OK) {
        peer_fail(a, p, KVC_ERR_PROTOCOL, "malformed challenge from %s:%u", p->host, p->port);
        return;
    }
    if (!(h.flags & KVC_HFLAG_SECRET) && a->secret) {
        a->stats[KVC_STAT_AUTH_FAILED]++;
        peer_fail(a, p, KVC_ERR_AUTH,
                  "authentication failed: producer %s:%u has no cluster secret, this agent has one",
                  p->host, p->port);
        return;
    }
    memcpy(p->nonce_p, h.nonce, KVC_NONCE_LEN);
    uint8_t mac[KVC_MAC_LEN];
    kvc_span_t cid = {(const uint8_t *)a->engine_id, strlen(a->engine_id)};
    kvc_mac_consumer(a, p->nonce_c, p->nonce_p, (uint8_t)a->proto, p->hello_flags, h.flags, cid,
                     h.engine_id, mac);
    kvc_buf_cleanup(&p->out);
    p->out_off = 0;
    kvc_wire_encode_auth(&p->out, a->wire_version, (uint8_t)a->proto, mac);
    if (p->out.failed) {
        peer_fail(a, p, KVC_ERR_NO_MEMORY, "out of memory");
        return;
    }
    if (kvc_chan_init(&p->chan, a, p->nonce_c, p->nonce_p, mac, false) != KVC_OK) {
        peer_fail(a, p, KVC_ERR_IO, "cannot derive the side channel's keys (OpenSSL)");
        return;
    }
    /* A producer that takes our worker address (KVC_HFLAG_OWNER) answers our
     * pulls on an endpoint of its own: the address goes sealed, right
     * after AUTH, before its HANDSHAKE can let us pull. */
    p->owner = (h.flags & KVC_HFLAG_OWNER) != 0;
    p->live = (h.flags & KVC_HFLAG_LIVE) != 0;
    if (p->owner) {
        kvc_buf_t inner = {0};
        kvc_wire_encode_consumer(&inner, a->wire_version, a->nonce, a->worker_addr,
                                 a->worker_addr_len);
        kvc_status_t st = inner.failed ? KVC_ERR_NO_MEMORY
                                       : kvc_chan_seal(&p->chan, &p->out, a->wire_version, inner.p,
                                                       inner.len);
        kvc_buf_cleanup(&inner);
        if (st != KVC_OK || p->out.failed) {
            peer_fail(a, p, KVC_ERR_NO_MEMORY, "cannot seal the consumer message");
            return;
        }
    }
    p->state = PEER_AUTH;
    kvc_ep_mod(a, p->fd, EPOLLOUT | EPOLLIN | EPOLLRDHUP, &p->pe);
}

/* The producer's answer to AUTH, sealed: opened, then the handshake inside.
 * A tag that does not verify means the bytes were changed on the way (or
 * the producer holds another secret): the connection is closed. */
static void on_sealed(kvc_agent_t *a, kvc_peer_t *p, const uint8_t *rec, size_t len) {
    uint8_t *msg = NULL;
    size_t mlen = 0;
    kvc_status_t st = kvc_chan_open(&p->chan, rec, len, &msg, &mlen);
    if (st == KVC_ERR_AUTH) {
        a->stats[KVC_STAT_AUTH_FAILED]++;
        peer_fail(a, p, KVC_ERR_AUTH,
                  "authentication failed: the sealed handshake from %s:%u does not verify "
                  "(changed in transit, or a different cluster secret); connection closed",
                  p->host, p->port);
        return;
    }
    if (st != KVC_OK) {
        peer_fail(a, p, st == KVC_ERR_NO_MEMORY ? st : KVC_ERR_PROTOCOL,
                  "cannot open the sealed handshake from %s:%u", p->host, p->port);
        return;
    }
    kvc_wire_hdr_t h;
    if (kvc_wire_parse_hdr(msg, mlen, KVC_WIRE_MAX_BODY, &h) != KVC_OK ||
        h.version != a->wire_version || h.type != KVC_MSG_HANDSHAKE ||
        mlen != KVC_WIRE_HDR_LEN + (size_t)h.body_len)
        peer_fail(a, p, KVC_ERR_PROTOCOL, "the sealed message from %s:%u is not a handshake",
                  p->host, p->port);
    else
        handshake_done(a, p, msg + KVC_WIRE_HDR_LEN, h.body_len);
    OPENSSL_cleanse(msg, mlen);
    free(msg);
}

/* The producer's ERROR: it refused us and closes. */
static void on_error(kvc_agent_t *a, kvc_peer_t *p, const uint8_t *body, size_t len) {
    int32_t code;
    kvc_span_t m;
    if (kvc_wire_parse_error(body, len, &code, &m) != KVC_OK) {
        peer_fail(a, p, KVC_ERR_PROTOCOL, "malformed error message from %s:%u", p->host, p->port);
        return;
    }
    kvc_status_t st = code == KVC_ERR_AUTH          ? KVC_ERR_AUTH
                      : code == KVC_ERR_VERSION     ? KVC_ERR_VERSION
                      : code == KVC_ERR_UNSUPPORTED ? KVC_ERR_UNSUPPORTED
                      : code == KVC_ERR_BUSY        ? KVC_ERR_BUSY
                                                    : KVC_ERR_PROTOCOL;
    if (st == KVC_ERR_AUTH) a->stats[KVC_STAT_AUTH_FAILED]++;
    peer_fail(a, p, st, "producer %s:%u refused the handshake: %.*s", p->host, p->port, (int)m.len,
              (const char *)m.p);
}

static bool peer_send(kvc_agent_t *a, kvc_peer_t *p) {
    while (p->out_off < p->out.len) {
        ssize_t n = send(p->fd, p->out.p + p->out_off, p->out.len - p->out_off, MSG_NOSIGNAL);
        if (n > 0) {
            p->out_off += (size_t)n;
            if (p->out_off == p->out.len) kvc_ep_mod(a, p->fd, EPOLLIN | EPOLLRDHUP, &p->pe);
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        peer_fail(a, p, KVC_ERR_UNREACHABLE, "send to %s:%u: %s", p->host, p->port,
                  strerror(errno));
        return false;
    }
    return true;
}

void kvc_peer_io(kvc_agent_t *a, kvc_peer_t *p, uint32_t events) {
    if (p->state == PEER_READY || p->state == PEER_IPC) { /* the live side channel: idle */
        char junk[64];
        ssize_t n = p->fd >= 0 ? read(p->fd, junk, sizeof(junk)) : 0;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
        (void)events;
        peer_fail(a, p, KVC_ERR_PEER_FAILED,
                  n > 0 ? "producer %s:%u wrote on the idle side channel"
                        : "producer %s:%u closed its side channel: it is gone",
                  p->host, p->port);
        return;
    }
    if (p->state == PEER_CONNECTING) {
        if (!(events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) return;
        int err = 0;
        socklen_t el = sizeof(err);
        if (getsockopt(p->fd, SOL_SOCKET, SO_ERROR, &err, &el) || err) {
            peer_fail(a, p, KVC_ERR_UNREACHABLE, "connect to %s:%u: %s", p->host, p->port,
                      strerror(err ? err : errno));
            return;
        }
        if (kvc_random(p->nonce_c, KVC_NONCE_LEN) != KVC_OK) {
            peer_fail(a, p, KVC_ERR_IO, "no randomness for the handshake nonce");
            return;
        }
        kvc_wire_encode_hello(&p->out, a->wire_version, KVC_MSG_HELLO, a->engine_id,
                              p->hello_flags = hello_flags(a), p->nonce_c);
        if (p->out.failed) {
            peer_fail(a, p, KVC_ERR_NO_MEMORY, "out of memory");
            return;
        }
        p->state = PEER_HELLO;
    }
    for (;;) {
        if (p->state != PEER_HELLO && p->state != PEER_AUTH) return;
        if (!peer_send(a, p)) return;
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
            /* After AUTH only a sealed message (or a refusal) may come. */
            uint16_t expect = p->state == PEER_HELLO ? KVC_MSG_CHALLENGE : KVC_MSG_SEALED;
            if (h.type != expect && h.type != KVC_MSG_ERROR) {
                peer_fail(a, p, KVC_ERR_PROTOCOL, "unexpected message type %u from %s:%u", h.type,
                          p->host, p->port);
                return;
            }
            want = KVC_WIRE_HDR_LEN + h.body_len;
            if (p->in_len >= want) {
                const uint8_t *body = p->in + KVC_WIRE_HDR_LEN;
                if (h.type == KVC_MSG_ERROR) {
                    on_error(a, p, body, h.body_len);
                    return;
                }
                if (h.type == KVC_MSG_SEALED) {
                    on_sealed(a, p, p->in, want);
                    return;
                }
                if (p->in_len != want) {
                    peer_fail(a, p, KVC_ERR_PROTOCOL, "bytes after the challenge from %s:%u",
                              p->host, p->port);
                    return;
                }
                on_challenge(a, p, body, h.body_len);
                p->in_len = 0;
                continue; /* send AUTH, read on */
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
