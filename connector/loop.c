/* SPDX-License-Identifier: Apache-2.0 */
/* What every connector file calls back into, kept apart from the agent so
 * that calls run one way (context.c -> peer.c, xfer.c, ... -> loop.c): the
 * status text and kvc_free, the clock, logging, the event queue, the wake-up
 * eventfd, the timerfd and the epoll set behind the agent's fd, and the
 * UCX endpoints that peer.c and consumer.c open.  Calls nothing else of the connector but wire.c's kvc_strdup. */
#include "connector/kvc_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

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
    case KVC_ERR_BUSY:
        return "KVC_ERR_BUSY";
    }
    return "KVC_ERR_UNKNOWN";
}

void kvc_free(void *p) {
    free(p);
}

void kvc_lock(const kvc_agent_t *a) {
    if (a->threaded) pthread_mutex_lock((pthread_mutex_t *)&a->mu);
}

void kvc_unlock(const kvc_agent_t *a) {
    if (a->threaded) pthread_mutex_unlock((pthread_mutex_t *)&a->mu);
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

void kvc_log_init(kvc_agent_t *a, const kvc_agent_params_t *p) {
    uint64_t m = p->field_mask;
    a->log_cb = stderr_log;
    a->log_level = env_log_level();
    if ((m & KVC_AGENT_FIELD_LOG) && p->log_cb) {
        a->log_cb = p->log_cb;
        a->log_arg = p->log_arg;
    }
    if (m & (KVC_AGENT_FIELD_LOG | KVC_AGENT_FIELD_LOG_LEVEL)) a->log_level = p->log_level;
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

void kvc_event_release(kvc_agent_t *a) {
    evnode_free(a->ev_cur);
    a->ev_cur = NULL;
}

static kvc_status_t next_event_impl(kvc_agent_t *a, kvc_event_t *ev) {
    if (!a || !ev) return KVC_ERR_INVALID_PARAM;
    kvc_event_release(a);
    kvc_evnode_t *e = a->evq_head;
    if (!e) return KVC_AGAIN;
    a->evq_head = e->next;
    if (!a->evq_head) a->evq_tail = NULL;
    a->ev_cur = e;
    *ev = e->ev;
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

void kvc_wake_drain(kvc_agent_t *a) {
    uint64_t junk;
    if (read(a->wake_fd, &junk, sizeof(junk)) < 0) {
    }
    a->wake_pending = false;
}

void kvc_timer_drain(kvc_agent_t *a) {
    uint64_t junk;
    if (read(a->timer_fd, &junk, sizeof(junk)) < 0) { /* EAGAIN: raced */
    }
}

void kvc_timer_arm(kvc_agent_t *a, uint64_t next) {
    struct itimerspec its;
    memset(&its, 0, sizeof(its));
    if (next != UINT64_MAX) {
        if (next == 0) next = 1; /* zero would disarm */
        its.it_value.tv_sec = (time_t)(next / 1000000000ull);
        its.it_value.tv_nsec = (long)(next % 1000000000ull);
    }
    timerfd_settime(a->timer_fd, TFD_TIMER_ABSTIME, &its, NULL);
}

kvc_status_t kvc_loop_open(kvc_agent_t *a) {
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

void kvc_loop_close(kvc_agent_t *a) {
    close_fd(&a->wake_fd);
    close_fd(&a->timer_fd);
    close_fd(&a->epfd);
    while (a->evq_head) {
        kvc_evnode_t *e = a->evq_head;
        a->evq_head = e->next;
        evnode_free(e);
    }
    kvc_event_release(a);
}

kvc_status_t kvc_agent_next_event(kvc_agent_t *a, kvc_event_t *ev) {
    if (!a) return KVC_ERR_INVALID_PARAM;
    kvc_lock(a);
    kvc_status_t st = next_event_impl(a, ev);
    kvc_unlock(a);
    return st;
}

ucs_status_t kvc_ep_open(kvc_agent_t *a, const void *worker_addr, ucp_err_handler_cb_t cb,
                         void *arg, ucp_ep_h *out, bool *degraded) {
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = (const ucp_address_t *)worker_addr;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = cb;
    ep.err_handler.arg = arg;
    *degraded = false;
    ucs_status_t us = ucp_ep_create(a->worker, &ep, out);
    if (us != UCS_OK) {
        /* e.g. UCX_TLS=sm alone: no transport supports peer-failure mode. */
        *degraded = true;
        ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
        us = ucp_ep_create(a->worker, &ep, out);
    }
    if (us != UCS_OK) *out = NULL;
    return us;
}
