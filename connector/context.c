/* SPDX-License-Identifier: Apache-2.0 */
/* The agent: UCX context and worker, create/destroy, progress (which drives
 * the other files' I/O and timers) and counters.  The pieces every file
 * calls back into (log, clock, event queue, wake-up, poll set) are in
 * loop.c, so that calls run one way: context.c -> the rest -> loop.c. */
#include "connector/kvc_int.h"
#include "connector/kvc_vmm.h"

#include <openssl/crypto.h>

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_CONNECT_TIMEOUT_MS 5000u
#define DEFAULT_EXPIRY_MS 480000u
#define DEFAULT_XFER_TIMEOUT_MS 60000u
#define DEFAULT_LEASE_MS 30000u
#define DEFAULT_PENDING_FETCH_MS 30000u
#define DEFAULT_MAX_PENDING 4096u
#define DEFAULT_MAX_PENDING_PEER 1024u
#define DEFAULT_MAX_PENDING_BYTES ((size_t)64 << 20)

kvc_status_t kvc_agent_stat(const kvc_agent_t *a, kvc_stat_t which, uint64_t *value) {
    if (!a || !value || (int)which < 0 || which > KVC_STAT_LAST) return KVC_ERR_INVALID_PARAM;
    kvc_lock(a);
    if (which == KVC_STAT_PUBLISHED_NOW)
        *value = a->pubs.count;
    else if (which == KVC_STAT_AUTHENTICATED)
        *value = a->secret != NULL;
    else
        *value = a->stats[which];
    kvc_unlock(a);
    return KVC_OK;
}

/* One turn of work.  The progress thread does not free the event the
 * caller popped last (release false): only the caller's calls do. */
static kvc_status_t progress_turn(kvc_agent_t *a, bool release) {
    kvc_status_t st = KVC_OK;
    if (release) kvc_event_release(a);

    struct epoll_event evs[64];
    int n = epoll_wait(a->epfd, evs, 64, 0);
    if (n < 0 && errno != EINTR) st = KVC_ERR_IO;
    for (int i = 0; i < n; i++) {
        kvc_pollent_t *pe = evs[i].data.ptr;
        switch (pe->kind) {
        case PE_LISTEN:
            kvc_listen_accept(a);
            break;
        case PE_UCX:
            break; /* drained by ucp_worker_arm below */
        case PE_TIMER:
            kvc_timer_drain(a);
            break;
        case PE_WAKE:
            kvc_wake_drain(a);
            break;
        case PE_SCONN:
            kvc_sconn_io(a, pe->obj, evs[i].events);
            break;
        case PE_PEER:
            kvc_peer_io(a, pe->obj, evs[i].events);
            break;
        case PE_IPCFD_LISTEN:
            kvc_ipcfd_accept(a);
            break;
        case PE_IPCFD_CONN:
            kvc_ipcfd_conn_io(a, pe->obj, evs[i].events);
            break;
        case PE_IPCFD_FETCH:
            kvc_peer_ipc_io(a, pe->obj, evs[i].events);
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
    kvc_ipcfd_timers(a, now, &next);
    kvc_stage_progress(a, now, &next);
    kvc_xfers_advance(a, now, &next);
    kvc_expiry_run(a, now, &next);
    kvc_pending_timers(a, now, &next);
    kvc_cons_sweep(a);
    kvc_peers_reap(a);
    kvc_sconns_reap(a);
    for (int i = 0; i < 4096 && ucp_worker_progress(a->worker); i++) {
    }
    kvc_xfers_advance(a, now, &next);

    ucs_status_t us = ucp_worker_arm(a->worker);
    if (us == UCS_ERR_BUSY) kvc_wake(a);
    if (a->evq_head) kvc_wake(a);
    kvc_timer_arm(a, next);
    return st;
}

kvc_status_t kvc_agent_progress(kvc_agent_t *a) {
    if (!a) return KVC_ERR_INVALID_PARAM;
    kvc_lock(a);
    kvc_status_t st = progress_turn(a, true);
    kvc_unlock(a);
    return st;
}

/* The progress thread: waits for the agent's fd (bounded, so that a stop
 * is seen), then does a turn under the mutex.  While events wait to be
 * popped the fd stays readable (that is what wakes a caller's poll), so the
 * thread then naps 1 ms between turns instead of spinning on it. */
static void *progress_main(void *arg) {
    kvc_agent_t *a = arg;
    while (!atomic_load(&a->thr_stop)) {
        kvc_lock(a);
        bool queued = a->evq_head != NULL;
        kvc_unlock(a);
        if (queued) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        } else {
            struct pollfd p = {.fd = a->epfd, .events = POLLIN};
            poll(&p, 1, 50);
        }
        kvc_lock(a);
        progress_turn(a, false);
        kvc_unlock(a);
    }
    return NULL;
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
    kvc_log_init(a, p);
    a->connect_timeout_ms = (m & KVC_AGENT_FIELD_CONNECT_TIMEOUT) && p->connect_timeout_ms
                                ? p->connect_timeout_ms
                                : DEFAULT_CONNECT_TIMEOUT_MS;
    a->expiry_ms = (m & KVC_AGENT_FIELD_EXPIRY) && p->expiry_ms ? p->expiry_ms : DEFAULT_EXPIRY_MS;
    a->xfer_timeout_ms = (m & KVC_AGENT_FIELD_XFER_TIMEOUT) && p->xfer_timeout_ms
                             ? p->xfer_timeout_ms
                             : DEFAULT_XFER_TIMEOUT_MS;
    a->tp_size = (m & KVC_AGENT_FIELD_TP_SIZE) && p->tp_size ? p->tp_size : 1;
    a->lease_ms = (m & KVC_AGENT_FIELD_LEASE) ? p->lease_ms : DEFAULT_LEASE_MS;
    bool pf = (m & KVC_AGENT_FIELD_PENDING_FETCH) != 0;
    a->pending_fetch_ms = pf ? p->pending_fetch_ms : DEFAULT_PENDING_FETCH_MS;
    a->max_pending = pf && p->max_pending_fetches ? p->max_pending_fetches : DEFAULT_MAX_PENDING;
    a->max_pending_peer =
        pf && p->max_pending_per_peer ? p->max_pending_per_peer : DEFAULT_MAX_PENDING_PEER;
    a->max_cons = KVC_MAX_CONSUMERS;
    a->max_cons_addr = KVC_MAX_CONSUMERS_ADDR;
    a->max_pending_bytes =
        pf && p->max_pending_bytes ? p->max_pending_bytes : DEFAULT_MAX_PENDING_BYTES;
    a->max_handshakes =
        (m & KVC_AGENT_FIELD_MAX_HANDSHAKES) && p->max_handshakes ? p->max_handshakes : 256;
    a->proto = env_proto((m & KVC_AGENT_FIELD_PROTO) ? p->proto : KVC_PROTO_AUTO);
    a->ipc_off = (m & KVC_AGENT_FIELD_CUDA_IPC) && !p->cuda_ipc;
    const char *ipc = getenv("KVC_IPC"); /* operations and the GPU check: overrides */
    if (ipc && *ipc) a->ipc_off = !strcmp(ipc, "0");
    a->wire_version = KVC_WIRE_VERSION;
    const char *wv = getenv("KVC_TEST_WIRE_VERSION"); /* compatibility tests only */
    if (wv && *wv) a->wire_version = (uint16_t)strtoul(wv, NULL, 10);
    if (getrandom(&a->nonce, sizeof(a->nonce), GRND_NONBLOCK) != (ssize_t)sizeof(a->nonce))
        a->nonce = kvc_now_ns() ^ ((uint64_t)getpid() << 32);
    a->next_xfer_id = 1;
    a->push_chunk = 4u << 20;
    a->stage_pool_bytes = (m & KVC_AGENT_FIELD_STAGING_POOL) && p->staging_pool_bytes
                              ? p->staging_pool_bytes
                              : KVC_STAGE_POOL_DEFAULT;
    const char *sp = getenv("KVC_STAGING_POOL_MB"); /* operations: overrides the parameter */
    if (sp && *sp && strtoull(sp, NULL, 10) > 0)
        a->stage_pool_bytes = (size_t)strtoull(sp, NULL, 10) << 20;
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
    if ((st = kvc_push_register_am(a)) != KVC_OK) goto err_ucx;
    if ((st = kvc_notify_register_am(a)) != KVC_OK) goto err_ucx;
    if ((st = kvc_loop_open(a)) != KVC_OK) goto err_fds;
    if ((st = kvc_listen_open(a)) != KVC_OK) goto err_fds;
    if ((st = kvc_mem_build_handshake(a)) != KVC_OK) goto err_fds;
    KVC_LOG(a, KVC_LOG_INFO,
            "agent up side_channel=%s:%u proto=%d cuda_native=%d rma=%d ucx=%s (built with %d.%d)",
            a->listen_host, a->port, (int)a->proto, (int)a->cuda_native, (int)a->rma,
            ucp_get_version_string(), UCP_API_MAJOR, UCP_API_MINOR);
    kvc_wake(a); /* first progress arms the worker */
    if ((m & KVC_AGENT_FIELD_PROGRESS_THREAD) && p->progress_thread) {
        pthread_mutexattr_t ma;
        pthread_mutexattr_init(&ma);
        pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_RECURSIVE);
        int rc = pthread_mutex_init(&a->mu, &ma);
        pthread_mutexattr_destroy(&ma);
        if (rc != 0) {
            st = KVC_ERR_NO_MEMORY;
            goto err_fds;
        }
        atomic_init(&a->thr_stop, false);
        a->threaded = true;
        if (pthread_create(&a->thr, NULL, progress_main, a) != 0) {
            a->threaded = false;
            pthread_mutex_destroy(&a->mu);
            st = KVC_ERR_NO_MEMORY;
            goto err_fds;
        }
    }
    *out = a;
    return KVC_OK;

err_fds:
    close_fd(&a->listen_fd);
    kvc_loop_close(a);
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
    if (a->threaded) { /* stop the progress thread first: nothing runs beside us then */
        atomic_store(&a->thr_stop, true);
        pthread_join(a->thr, NULL);
        a->threaded = false;
        pthread_mutex_destroy(&a->mu);
    }
    a->destroying = true; /* callbacks below queue no events */
    kvc_sconns_destroy(a);
    kvc_peers_destroy(a); /* closes endpoints: in-flight requests complete as cancelled */
    kvc_cons_close_all(a); /* the same for the producer's endpoints to its consumers */
    /* Producer pushes still in flight reference region memory: let them end
     * before the memory goes away (bounded: peers may be gone). */
    uint64_t until = kvc_now_ns() + 2000000000ull;
    while (a->push_inflight && kvc_now_ns() < until)
        ucp_worker_progress(a->worker);
    kvc_mem_cleanup(a);
    ucp_worker_release_address(a->worker, a->worker_addr);
    ucp_worker_destroy(a->worker);
    kvc_xfers_destroy(a); /* after the worker: no callback can reach them now */
    kvc_push_destroy(a);
    kvc_cons_destroy(a);
    ucp_cleanup(a->ctx);
    kvc_pubtab_cleanup(&a->pubs); /* before the CUDA context: their captures go back to it */
    kvc_cuda_destroy(a->cuda);
    close_fd(&a->listen_fd);
    kvc_loop_close(a);
    kvc_buf_cleanup(&a->hs_msg);
    kvc_buf_cleanup(&a->hs_msg_nokeys);
    free_secret(a);
    free(a->engine_id);
    free(a->listen_host);
    free(a->adv_host);
    free(a->layout);
    free(a);
}
