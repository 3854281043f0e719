/* The agent: UCX context and worker, the pollable fd, progress, logging,
 * the event queue and counters. */
#include "kvc_int.h"

#include <openssl/crypto.h>

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_CONNECT_TIMEOUT_MS 5000u
#define DEFAULT_EXPIRY_MS 480000u
#define DEFAULT_XFER_TIMEOUT_MS 60000u

const char *kvc_status_str(kvc_status_t st) {
    switch (st) {
    case KVC_OK:
        return "KVC_OK";
    case KVC_INPROGRESS:
        return "KVC_INPROGRESS";
    case KVC_AGAIN:
        return "KVC_AGAIN";
    case KVC_ERR_NO_MEMORY:
        return "KVC_ERR_NO_MEMORY";
    case KVC_ERR_INVALID_PARAM:
        return "KVC_ERR_INVALID_PARAM";
    case KVC_ERR_UNREACHABLE:
        return "KVC_ERR_UNREACHABLE";
    case KVC_ERR_TIMED_OUT:
        return "KVC_ERR_TIMED_OUT";
    case KVC_ERR_VERSION:
        return "KVC_ERR_VERSION";
    case KVC_ERR_INCOMPATIBLE:
        return "KVC_ERR_INCOMPATIBLE";
    case KVC_ERR_NOT_FOUND:
        return "KVC_ERR_NOT_FOUND";
    case KVC_ERR_EXISTS:
        return "KVC_ERR_EXISTS";
    case KVC_ERR_PROTOCOL:
        return "KVC_ERR_PROTOCOL";
    case KVC_ERR_PEER_FAILED:
        return "KVC_ERR_PEER_FAILED";
    case KVC_ERR_CANCELED:
        return "KVC_ERR_CANCELED";
    case KVC_ERR_TRANSPORT:
        return "KVC_ERR_TRANSPORT";
    case KVC_ERR_IO:
        return "KVC_ERR_IO";
    case KVC_ERR_UNSUPPORTED:
        return "KVC_ERR_UNSUPPORTED";
    case KVC_ERR_NO_DEVICE:
        return "KVC_ERR_NO_DEVICE";
    case KVC_ERR_STATE:
        return "KVC_ERR_STATE";
    case KVC_ERR_AUTH:
        return "KVC_ERR_AUTH";
    case KVC_ERR_DENIED:
        return "KVC_ERR_DENIED";
    case KVC_ERR_CUDA:
        return "KVC_ERR_CUDA";
    }
    return "KVC_ERR_UNKNOWN";
}

void kvc_free(void *p) {
    free(p);
}

uint64_t kvc_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ log -- */

static const char *level_name(kvc_log_level_t l) {
    switch (l) {
    case KVC_LOG_ERROR:
        return "error";
    case KVC_LOG_WARN:
        return "warn";
    case KVC_LOG_INFO:
        return "info";
    default:
        return "debug";
    }
}

static kvc_log_level_t env_log_level(void) {
    const char *e = getenv("KVC_LOG_LEVEL");
    if (!e || !*e) return KVC_LOG_WARN;
    if (!strcasecmp(e, "error")) return KVC_LOG_ERROR;
    if (!strcasecmp(e, "warn") || !strcasecmp(e, "warning")) return KVC_LOG_WARN;
    if (!strcasecmp(e, "info")) return KVC_LOG_INFO;
    if (!strcasecmp(e, "debug") || !strcasecmp(e, "trace")) return KVC_LOG_DEBUG;
    if (e[0] >= '0' && e[0] <= '3' && !e[1]) return (kvc_log_level_t)(e[0] - '0');
    return KVC_LOG_WARN;
}

static void stderr_log(void *arg, kvc_log_level_t level, const char *msg) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    fprintf(stderr, "kvc %lld.%06ld %s %s\n", (long long)ts.tv_sec, ts.tv_nsec / 1000,
            level_name(level), msg);
}

void kvc_log(kvc_agent_t *a, kvc_log_level_t lvl, const char *fmt, ...) {
    char line[1024];
    int off = snprintf(line, sizeof(line), "engine=%s ", a->engine_id ? a->engine_id : "?");
    if (off < 0) off = 0;
    if ((size_t)off >= sizeof(line)) off = sizeof(line) - 1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + off, sizeof(line) - (size_t)off, fmt, ap);
    va_end(ap);
    a->log_cb(a->log_arg, lvl, line);
}

/* --------------------------------------------------------------- events -- */

static void evnode_free(kvc_evnode_t *n) {
    if (!n) return;
    free(n->request_id);
    free(n->blocks);
    free(n->message);
    free(n);
}

void kvc_event_push(kvc_agent_t *a, kvc_event_type_t type, kvc_status_t st, uint64_t xfer_id,
                    uint64_t user_data, const char *request_id, const uint64_t *blocks, size_t n,
                    uint64_t bytes, const char *msg) {
    if (a->destroying) return;
    kvc_evnode_t *e = calloc(1, sizeof(*e));
    if (!e) goto err_oom;
    if (request_id && !(e->request_id = kvc_strdup(request_id))) goto err_node;
    if (n) {
        e->blocks = malloc(n * sizeof(*blocks));
        if (!e->blocks) goto err_node;
        memcpy(e->blocks, blocks, n * sizeof(*blocks));
    }
    if (msg && !(e->message = kvc_strdup(msg))) goto err_node;
    e->ev.type = type;
    e->ev.status = st;
    e->ev.xfer_id = xfer_id;
    e->ev.user_data = user_data;
    e->ev.request_id = e->request_id;
    e->ev.block_ids = e->blocks;
    e->ev.num_blocks = n;
    e->ev.bytes = bytes;
    e->ev.message = e->message ? e->message : "";
    if (a->evq_tail)
        a->evq_tail->next = e;
    else
        a->evq_head = e;
    a->evq_tail = e;
    kvc_wake(a);
    return;
err_node:
    evnode_free(e);
err_oom:
    KVC_LOG(a, KVC_LOG_ERROR, "out of memory: dropped event type=%d req=%s", (int)type,
            request_id ? request_id : "");
}

kvc_status_t kvc_agent_next_event(kvc_agent_t *a, kvc_event_t *ev) {
    if (!a || !ev) return KVC_ERR_INVALID_PARAM;
    evnode_free(a->ev_cur);
    a->ev_cur = NULL;
    kvc_evnode_t *e = a->evq_head;
    if (!e) return KVC_AGAIN;
    a->evq_head = e->next;
    if (!a->evq_head) a->evq_tail = NULL;
    a->ev_cur = e;
    *ev = e->ev;
    return KVC_OK;
}

kvc_status_t kvc_agent_stat(const kvc_agent_t *a, kvc_stat_t which, uint64_t *value) {
    if (!a || !value || (int)which < 0 || which > KVC_STAT_CUDA_SYNCS) return KVC_ERR_INVALID_PARAM;
    if (which == KVC_STAT_PUBLISHED_NOW)
        *value = a->pubs.count;
    else if (which == KVC_STAT_AUTHENTICATED)
        *value = a->secret != NULL;
    else
        *value = a->stats[which];
    return KVC_OK;
}

/* ----------------------------------------------------------------- poll -- */

kvc_status_t kvc_ep_add(kvc_agent_t *a, int fd, uint32_t events, kvc_pollent_t *pe) {
    struct epoll_event ev = {.events = events, .data.ptr = pe};
    return epoll_ctl(a->epfd, EPOLL_CTL_ADD, fd, &ev) ? KVC_ERR_IO : KVC_OK;
}

kvc_status_t kvc_ep_mod(kvc_agent_t *a, int fd, uint32_t events, kvc_pollent_t *pe) {
    struct epoll_event ev = {.events = events, .data.ptr = pe};
    return epoll_ctl(a->epfd, EPOLL_CTL_MOD, fd, &ev) ? KVC_ERR_IO : KVC_OK;
}

void kvc_ep_del(kvc_agent_t *a, int fd) {
    epoll_ctl(a->epfd, EPOLL_CTL_DEL, fd, NULL);
}

void kvc_wake(kvc_agent_t *a) {
    if (a->wake_pending || a->wake_fd < 0) return;
    uint64_t one = 1;
    if (write(a->wake_fd, &one, sizeof(one)) == (ssize_t)sizeof(one)) a->wake_pending = true;
}

static void arm_timer(kvc_agent_t *a, uint64_t next) {
    struct itimerspec its;
    memset(&its, 0, sizeof(its));
    if (next != UINT64_MAX) {
        if (next == 0) next = 1; /* zero would disarm */
        its.it_value.tv_sec = (time_t)(next / 1000000000ull);
        its.it_value.tv_nsec = (long)(next % 1000000000ull);
    }
    timerfd_settime(a->timer_fd, TFD_TIMER_ABSTIME, &its, NULL);
}

kvc_status_t kvc_agent_progress(kvc_agent_t *a) {
    if (!a) return KVC_ERR_INVALID_PARAM;
    kvc_status_t st = KVC_OK;
    evnode_free(a->ev_cur);
    a->ev_cur = NULL;

    struct epoll_event evs[64];
    int n = epoll_wait(a->epfd, evs, 64, 0);
    if (n < 0 && errno != EINTR) st = KVC_ERR_IO;
    for (int i = 0; i < n; i++) {
        kvc_pollent_t *pe = evs[i].data.ptr;
        uint64_t junk;
        switch (pe->kind) {
        case PE_LISTEN:
            kvc_listen_accept(a);
            break;
        case PE_UCX:
            break; /* drained by ucp_worker_arm below */
        case PE_TIMER:
            if (read(a->timer_fd, &junk, sizeof(junk)) < 0) { /* EAGAIN: raced */
            }
            break;
        case PE_WAKE:
            if (read(a->wake_fd, &junk, sizeof(junk)) < 0) {
            }
            a->wake_pending = false;
            break;
        case PE_SCONN:
            kvc_sconn_io(a, pe->obj, evs[i].events);
            break;
        case PE_PEER:
            kvc_peer_io(a, pe->obj, evs[i].events);
            break;
        }
    }

    /* Bounded so that a flood of incoming messages cannot starve the caller;
     * the wake fd keeps the agent fd readable if work remains. */
    for (int i = 0; i < 4096 && ucp_worker_progress(a->worker); i++) {
    }

    uint64_t now = kvc_now_ns(), next = UINT64_MAX;
    kvc_peers_timers(a, now, &next);
    kvc_sconns_timers(a, now, &next);
    kvc_xfers_advance(a, now, &next);
    kvc_expiry_run(a, now, &next);
    kvc_peers_reap(a);
    kvc_sconns_reap(a);
    for (int i = 0; i < 4096 && ucp_worker_progress(a->worker); i++) {
    }
    kvc_xfers_advance(a, now, &next);

    ucs_status_t us = ucp_worker_arm(a->worker);
    if (us == UCS_ERR_BUSY) kvc_wake(a);
    if (a->evq_head) kvc_wake(a);
    arm_timer(a, next);
    return st;
}

kvc_status_t kvc_agent_wait(kvc_agent_t *a, int timeout_ms) {
    if (!a) return KVC_ERR_INVALID_PARAM;
    struct pollfd p = {.fd = a->epfd, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) < 0 && errno != EINTR) return KVC_ERR_IO;
    return kvc_agent_progress(a);
}

kvc_status_t kvc_agent_get_fd(const kvc_agent_t *a, int *fd) {
    if (!a || !fd) return KVC_ERR_INVALID_PARAM;
    *fd = a->epfd;
    return KVC_OK;
}

kvc_status_t kvc_agent_get_port(const kvc_agent_t *a, uint16_t *port) {
    if (!a || !port) return KVC_ERR_INVALID_PARAM;
    *port = a->port;
    return KVC_OK;
}

/* ---------------------------------------------------------- create/destroy -- */

static kvc_status_t ucx_init(kvc_agent_t *a) {
    ucp_config_t *cfg = NULL;
    ucs_status_t us = ucp_config_read(NULL, NULL, &cfg);
    if (us != UCS_OK) goto err_status;
    ucp_params_t pp;
    memset(&pp, 0, sizeof(pp));
    pp.field_mask = UCP_PARAM_FIELD_FEATURES;
    /* Least privilege: UCX's emulated RMA (tcp, shared memory) serves a
     * peer's put or get at any address the peer names, whatever the
     * registration allows (a hostile-peer test wrote a producer block that
     * way).  Only an agent told to read with gets (KVC_PROTO_GET, meant for
     * RDMA, where the NIC enforces the registration) enables RMA; AUTO reads
     * one-sided only through a shared-memory mapping, which needs no RMA
     * lanes.  (UCX_TCP_PUT_ENABLE=n does not help: the software emulation
     * takes over.) */
    pp.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    if (a->proto == KVC_PROTO_GET) pp.features |= UCP_FEATURE_RMA;
    us = ucp_init(&pp, cfg, &a->ctx);
    if (us != UCS_OK) goto err_cfg;

    ucp_context_attr_t ca;
    memset(&ca, 0, sizeof(ca));
    ca.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (ucp_context_query(a->ctx, &ca) == UCS_OK)
        a->cuda_native = (ca.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
    /* A UCX with CUDA support (a GPU host): device memory is registered
     * directly and read one-sided where cuda_ipc or RDMA reaches it (path.c),
     * which needs RMA.  SECURITY.md: on such hosts, UCX's emulated RMA over
     * tcp/shared memory is enabled too. */
    if (a->cuda_native && a->proto == KVC_PROTO_AUTO && !(pp.features & UCP_FEATURE_RMA)) {
        ucp_cleanup(a->ctx);
        pp.features |= UCP_FEATURE_RMA;
        us = ucp_init(&pp, cfg, &a->ctx);
        if (us != UCS_OK) goto err_cfg;
    }
    a->rma = (pp.features & UCP_FEATURE_RMA) != 0;
    ucp_config_release(cfg);
    cfg = NULL;

    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    us = ucp_worker_create(a->ctx, &wp, &a->worker);
    if (us != UCS_OK) goto err_ctx;
    us = ucp_worker_get_efd(a->worker, &a->ucx_efd);
    if (us != UCS_OK) goto err_worker;
    us = ucp_worker_get_address(a->worker, &a->worker_addr, &a->worker_addr_len);
    if (us != UCS_OK) goto err_worker;
    return KVC_OK;

err_worker:
    ucp_worker_destroy(a->worker);
    a->worker = NULL;
err_ctx:
    ucp_cleanup(a->ctx);
    a->ctx = NULL;
    goto err_status;
err_cfg:
    ucp_config_release(cfg);
    a->ctx = NULL;
err_status:
    KVC_LOG(a, KVC_LOG_ERROR, "UCX init failed: %s", ucs_status_string(us));
    return KVC_ERR_TRANSPORT;
}

static kvc_status_t fds_init(kvc_agent_t *a) {
    a->epfd = epoll_create1(EPOLL_CLOEXEC);
    a->timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    a->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (a->epfd < 0 || a->timer_fd < 0 || a->wake_fd < 0) return KVC_ERR_IO;
    a->pe_ucx = (kvc_pollent_t){PE_UCX, a};
    a->pe_timer = (kvc_pollent_t){PE_TIMER, a};
    a->pe_wake = (kvc_pollent_t){PE_WAKE, a};
    if (kvc_ep_add(a, a->ucx_efd, EPOLLIN, &a->pe_ucx) ||
        kvc_ep_add(a, a->timer_fd, EPOLLIN, &a->pe_timer) ||
        kvc_ep_add(a, a->wake_fd, EPOLLIN, &a->pe_wake))
        return KVC_ERR_IO;
    return KVC_OK;
}

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

static kvc_proto_t env_proto(kvc_proto_t dflt) {
    const char *e = getenv("KVC_PROTO");
    if (!e) return dflt;
    if (!strcasecmp(e, "get")) return KVC_PROTO_GET;
    if (!strcasecmp(e, "push")) return KVC_PROTO_PUSH;
    if (!strcasecmp(e, "auto")) return KVC_PROTO_AUTO;
    return dflt;
}

static void free_secret(kvc_agent_t *a) {
    if (a->secret) OPENSSL_cleanse(a->secret, a->secret_len);
    free(a->secret);
    a->secret = NULL;
    a->secret_len = 0;
}

kvc_status_t kvc_agent_create(const kvc_agent_params_t *p, kvc_agent_t **out) {
    if (!p || !out || !(p->field_mask & KVC_AGENT_FIELD_ENGINE_ID) || !p->engine_id ||
        !*p->engine_id || strlen(p->engine_id) > KVC_WIRE_MAX_STR ||
        !kvc_printable(p->engine_id, strlen(p->engine_id)))
        return KVC_ERR_INVALID_PARAM;
    uint64_t m = p->field_mask;
    kvc_status_t st = KVC_ERR_NO_MEMORY;
    kvc_agent_t *a = calloc(1, sizeof(*a));
    if (!a) return KVC_ERR_NO_MEMORY;
    a->epfd = a->timer_fd = a->wake_fd = a->listen_fd = a->ucx_efd = -1;
    a->log_cb = stderr_log;
    a->log_level = env_log_level();
    if ((m & KVC_AGENT_FIELD_LOG) && p->log_cb) {
        a->log_cb = p->log_cb;
        a->log_arg = p->log_arg;
    }
    if (m & (KVC_AGENT_FIELD_LOG | KVC_AGENT_FIELD_LOG_LEVEL)) a->log_level = p->log_level;
    a->connect_timeout_ms = (m & KVC_AGENT_FIELD_CONNECT_TIMEOUT) && p->connect_timeout_ms
                                ? p->connect_timeout_ms
                                : DEFAULT_CONNECT_TIMEOUT_MS;
    a->expiry_ms = (m & KVC_AGENT_FIELD_EXPIRY) && p->expiry_ms ? p->expiry_ms : DEFAULT_EXPIRY_MS;
    a->xfer_timeout_ms = (m & KVC_AGENT_FIELD_XFER_TIMEOUT) && p->xfer_timeout_ms
                             ? p->xfer_timeout_ms
                             : DEFAULT_XFER_TIMEOUT_MS;
    a->tp_size = (m & KVC_AGENT_FIELD_TP_SIZE) && p->tp_size ? p->tp_size : 1;
    a->max_handshakes =
        (m & KVC_AGENT_FIELD_MAX_HANDSHAKES) && p->max_handshakes ? p->max_handshakes : 256;
    a->proto = env_proto((m & KVC_AGENT_FIELD_PROTO) ? p->proto : KVC_PROTO_AUTO);
    a->wire_version = KVC_WIRE_VERSION;
    const char *wv = getenv("KVC_TEST_WIRE_VERSION"); /* compatibility tests only */
    if (wv && *wv) a->wire_version = (uint16_t)strtoul(wv, NULL, 10);
    if (getrandom(&a->nonce, sizeof(a->nonce), GRND_NONBLOCK) != (ssize_t)sizeof(a->nonce))
        a->nonce = kvc_now_ns() ^ ((uint64_t)getpid() << 32);
    a->next_xfer_id = 1;
    a->push_chunk = 4u << 20;
    const char *pc = getenv("KVC_PUSH_CHUNK_KB"); /* tuning knob for benchmarks */
    if (pc && *pc && strtoul(pc, NULL, 10) > 0) a->push_chunk = strtoul(pc, NULL, 10) << 10;

    const char *lh =
        (m & KVC_AGENT_FIELD_LISTEN_HOST) && p->listen_host ? p->listen_host : "127.0.0.1";
    const char *ah =
        (m & KVC_AGENT_FIELD_ADVERTISE_HOST) && p->advertise_host ? p->advertise_host : lh;
    const char *lt = (m & KVC_AGENT_FIELD_LAYOUT_TAG) && p->layout_tag ? p->layout_tag : "NHD";
    if (strlen(lt) > KVC_WIRE_MAX_STR || !kvc_printable(lt, strlen(lt))) {
        st = KVC_ERR_INVALID_PARAM;
        goto err_agent;
    }
    a->engine_id = kvc_strdup(p->engine_id);
    a->listen_host = kvc_strdup(lh);
    a->adv_host = kvc_strdup(ah);
    a->layout = kvc_strdup(lt);
    if (!a->engine_id || !a->listen_host || !a->adv_host || !a->layout) goto err_agent;
    if ((st = kvc_secret_init(a, p)) != KVC_OK) goto err_agent;
    if (!a->secret)
        KVC_LOG(a, KVC_LOG_WARN,
                "no cluster secret (KVC_SECRET_FILE): the side channel is NOT authenticated; "
                "any host that reaches it can read published KV blocks");
    a->port = (m & KVC_AGENT_FIELD_LISTEN_PORT) ? p->listen_port : 0;
    if ((st = kvc_pubtab_init(&a->pubs)) != KVC_OK) goto err_agent;

    if ((st = ucx_init(a)) != KVC_OK) goto err_agent;
    if ((st = kvc_xfer_register_am(a)) != KVC_OK) goto err_ucx;
    if ((st = kvc_notify_register_am(a)) != KVC_OK) goto err_ucx;
    if ((st = fds_init(a)) != KVC_OK) goto err_fds;
    if ((st = kvc_listen_open(a)) != KVC_OK) goto err_fds;
    if ((st = kvc_mem_build_handshake(a)) != KVC_OK) goto err_fds;
    KVC_LOG(a, KVC_LOG_INFO, "agent up side_channel=%s:%u proto=%d cuda_native=%d rma=%d",
            a->listen_host, a->port, (int)a->proto, (int)a->cuda_native, (int)a->rma);
    kvc_wake(a); /* first progress arms the worker */
    *out = a;
    return KVC_OK;

err_fds:
    close_fd(&a->listen_fd);
    close_fd(&a->wake_fd);
    close_fd(&a->timer_fd);
    close_fd(&a->epfd);
err_ucx:
    ucp_worker_release_address(a->worker, a->worker_addr);
    ucp_worker_destroy(a->worker);
    ucp_cleanup(a->ctx);
err_agent:
    free_secret(a);
    kvc_buf_cleanup(&a->hs_msg);
    kvc_buf_cleanup(&a->hs_msg_nokeys);
    kvc_pubtab_cleanup(&a->pubs);
    free(a->engine_id);
    free(a->listen_host);
    free(a->adv_host);
    free(a->layout);
    free(a);
    return st;
}

void kvc_agent_destroy(kvc_agent_t *a) {
    if (!a) return;
    a->destroying = true; /* callbacks below queue no events */
    kvc_sconns_destroy(a);
    kvc_peers_destroy(a); /* closes endpoints: in-flight requests complete as cancelled */
    /* Producer pushes still in flight reference region memory: let them end
     * before the memory goes away (bounded: peers may be gone). */
    uint64_t until = kvc_now_ns() + 2000000000ull;
    while (a->push_inflight && kvc_now_ns() < until)
        ucp_worker_progress(a->worker);
    kvc_mem_cleanup(a);
    ucp_worker_release_address(a->worker, a->worker_addr);
    ucp_worker_destroy(a->worker);
    kvc_xfers_destroy(a); /* after the worker: no callback can reach them now */
    ucp_cleanup(a->ctx);
    kvc_cuda_destroy(a->cuda);
    close_fd(&a->listen_fd);
    close_fd(&a->wake_fd);
    close_fd(&a->timer_fd);
    close_fd(&a->epfd);
    while (a->evq_head) {
        kvc_evnode_t *e = a->evq_head;
        a->evq_head = e->next;
        evnode_free(e);
    }
    evnode_free(a->ev_cur);
    kvc_buf_cleanup(&a->hs_msg);
    kvc_buf_cleanup(&a->hs_msg_nokeys);
    kvc_pubtab_cleanup(&a->pubs);
    free_secret(a);
    free(a->engine_id);
    free(a->listen_host);
    free(a->adv_host);
    free(a->layout);
    free(a);
}
