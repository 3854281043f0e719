/* SPDX-License-Identifier: Apache-2.0 */
/* The POSIX fds of a producer's VMM allocations (cuda_vmm.c), passed to a
 * consumer on its node over a Unix domain socket (SCM_RIGHTS): CUDA has no
 * other way to hand a cuMemCreate allocation to another process.
 *
 * The producer listens on an abstract-namespace SOCK_SEQPACKET socket whose
 * name ("kvc-vmm-" and 32 random hex digits) and a 32-byte random token
 * travel only in its sealed IPC table (ipc.c).  The abstract namespace is
 * visible to every process of the network namespace (/proc/net/unix), so
 * the name only routes: every request carries the token, compared in
 * constant time, and the producer serves only peers of its own user
 * (SO_PEERCRED).  The consumer checks, the same way, that the socket's
 * owner is the pid the table names before it sends the token.
 *
 * Messages, one per datagram:
 *   C->P REQ:   "KVF1", u32 first, u32 count, token[32]
 *   P->C BATCH: "KVF1", i32 status, u32 first, u32 count, and `count` fds
 *               as SCM_RIGHTS (none when status != 0: a refusal)
 * The consumer asks for batches of at most KVC_IPCFD_BATCH fds (Linux
 * passes at most SCM_MAX_FD = 253 per message), one request at a time, so
 * no more than one batch of fds is ever in flight.  The producer exports a
 * batch (cuMemExportToShareableHandle) when it is asked, and closes its
 * copies once sent: it never holds more than one batch of fds.
 *
 * Nothing blocks: both sockets are non-blocking and in the agent's epoll;
 * the producer's connections have an idle deadline and are freed after the
 * epoll batch (kvc_ipcfd_timers). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* struct ucred */
#endif
#include "connector/kvc_int.h"
#include "connector/kvc_vmm.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAGIC "KVF1"
#define REQ_LEN (4 + 4 + 4 + KVC_IPC_FD_TOKEN_LEN)
#define BATCH_LEN (4 + 4 + 4 + 4)
#define MAX_CONNS 16
#define CONN_IDLE_MS 10000

struct kvc_ipcfd_conn {
    kvc_ipcfd_conn_t *next;
    kvc_pollent_t pe;
    int fd;
    int pid; /* the peer's (SO_PEERCRED) */
    uint64_t deadline_ns;
    bool dead;
    /* the answer waiting for room in the socket */
    bool out_pending;
    uint8_t out[BATCH_LEN];
    int *out_fds; /* owned */
    uint32_t out_n;
};

struct kvc_ipcfd_srv {
    int fd;
    kvc_pollent_t pe;
    kvc_vmm_piece_t *pieces; /* owned: retained handles */
    int *dev;                /* owned: each piece's device */
    size_t n;
    uint8_t token[KVC_IPC_FD_TOKEN_LEN];
    kvc_ipcfd_conn_t *conns;
    uint32_t nconns;
};

struct kvc_ipcfd_cli {
    int fd;
    uint32_t batch;       /* fds asked for at a time */
    uint32_t total, next; /* fds wanted, index of the first not yet asked for */
    uint32_t want_first, want_n;
    uint8_t token[KVC_IPC_FD_TOKEN_LEN];
};

static void put32(uint8_t *p, uint32_t v) {
    memcpy(p, &v, 4); /* both ends are this host: native order */
}

static uint32_t get32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static socklen_t abstract_addr(struct sockaddr_un *sa, const char *name, size_t len) {
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    if (len > sizeof(sa->sun_path) - 1) len = sizeof(sa->sun_path) - 1;
    memcpy(sa->sun_path + 1, name, len); /* sun_path[0] = 0: the abstract namespace */
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + len);
}

static bool peer_cred(int fd, struct ucred *uc) {
    socklen_t l = sizeof(*uc);
    return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, uc, &l) == 0 && l == sizeof(*uc);
}

static void close_fds(int *fds, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        if (fds[i] >= 0) close(fds[i]);
}

/* ------------------------------------------------------------- producer -- */

kvc_status_t kvc_ipcfd_serve(kvc_agent_t *a, kvc_vmm_piece_t *pieces, int *dev, size_t n,
                             char name[KVC_IPC_SOCK_LEN], uint8_t token[KVC_IPC_FD_TOKEN_LEN]) {
    kvc_ipcfd_serve_stop(a);
    uint8_t rnd[16];
    struct kvc_ipcfd_srv *s = calloc(1, sizeof(*s));
    if (!s) return KVC_ERR_NO_MEMORY;
    s->fd = -1;
    if (kvc_random(rnd, sizeof(rnd)) != KVC_OK ||
        kvc_random(s->token, sizeof(s->token)) != KVC_OK) {
        free(s);
        return KVC_ERR_IO;
    }
    size_t k = (size_t)snprintf(name, KVC_IPC_SOCK_LEN, "kvc-vmm-");
    for (size_t i = 0; i < sizeof(rnd); i++)
        k += (size_t)snprintf(name + k, KVC_IPC_SOCK_LEN - k, "%02x", rnd[i]);
    struct sockaddr_un sa;
    socklen_t sl = abstract_addr(&sa, name, k);
    s->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    s->pe = (kvc_pollent_t){PE_IPCFD_LISTEN, a};
    if (s->fd < 0 || bind(s->fd, (struct sockaddr *)&sa, sl) || listen(s->fd, MAX_CONNS) ||
        kvc_ep_add(a, s->fd, EPOLLIN, &s->pe) != KVC_OK) {
        KVC_LOG(a, KVC_LOG_WARN, "CUDA IPC: cannot listen for fd requests: %s", strerror(errno));
        if (s->fd >= 0) close(s->fd);
        OPENSSL_cleanse(s->token, sizeof(s->token));
        free(s);
        return KVC_ERR_IO;
    }
    memcpy(token, s->token, KVC_IPC_FD_TOKEN_LEN);
    s->pieces = pieces;
    s->dev = dev;
    s->n = n;
    a->ipcfd = s;
    return KVC_OK;
}

static void conn_close(kvc_agent_t *a, kvc_ipcfd_conn_t *c) {
    if (c->dead) return;
    c->dead = true;
    kvc_ep_del(a, c->fd);
    close(c->fd);
    c->fd = -1;
    close_fds(c->out_fds, c->out_n);
    free(c->out_fds);
    c->out_fds = NULL;
    c->out_n = 0;
    kvc_wake(a); /* freed by kvc_ipcfd_timers */
}

void kvc_ipcfd_serve_stop(kvc_agent_t *a) {
    struct kvc_ipcfd_srv *s = a->ipcfd;
    if (!s) return;
    while (s->conns) {
        kvc_ipcfd_conn_t *c = s->conns;
        s->conns = c->next;
        conn_close(a, c);
        free(c);
    }
    kvc_ep_del(a, s->fd);
    close(s->fd);
    kvc_cuda_vmm_release(a->cuda, s->pieces, s->n);
    free(s->dev);
    OPENSSL_cleanse(s->token, sizeof(s->token));
    free(s);
    a->ipcfd = NULL;
}

void kvc_ipcfd_accept(kvc_agent_t *a) {
    struct kvc_ipcfd_srv *s = a->ipcfd;
    for (int i = 0; s && i < 64; i++) {
        int fd = accept4(s->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return; /* EAGAIN, or a connection that went away */
        struct ucred uc = {0};
        if (!peer_cred(fd, &uc) || uc.uid != geteuid() || s->nconns >= MAX_CONNS) {
            if (kvc_log_ratelimit(a, KVC_RL_AUTH))
                KVC_LOG(
                    a, KVC_LOG_WARN,
                    "CUDA IPC: fd request refused (pid %d, uid %d; this producer runs as uid %d, "
                    "%u requests open)",
                    (int)uc.pid, (int)uc.uid, (int)geteuid(), s->nconns);
            close(fd);
            continue;
        }
        kvc_ipcfd_conn_t *c = calloc(1, sizeof(*c));
        if (!c) {
            close(fd);
            return;
        }
        c->fd = fd;
        c->pid = (int)uc.pid;
        c->pe = (kvc_pollent_t){PE_IPCFD_CONN, c};
        c->deadline_ns = kvc_now_ns() + CONN_IDLE_MS * 1000000ull;
        if (kvc_ep_add(a, fd, EPOLLIN | EPOLLRDHUP, &c->pe) != KVC_OK) {
            close(fd);
            free(c);
            return;
        }
        c->next = s->conns;
        s->conns = c;
        s->nconns++;
        KVC_LOG(a, KVC_LOG_DEBUG, "CUDA IPC: fd request from pid %d", c->pid);
    }
}

/* Sends the pending batch; false when the socket is full (EPOLLOUT then)
 * or the connection failed (closed). */
static bool conn_flush(kvc_agent_t *a, kvc_ipcfd_conn_t *c) {
    struct iovec iov = {c->out, BATCH_LEN};
    union {
        char buf[CMSG_SPACE(KVC_IPCFD_BATCH * sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (c->out_n) {
        memset(&u, 0, sizeof(u));
        mh.msg_control = u.buf;
        mh.msg_controllen = CMSG_SPACE(c->out_n * sizeof(int));
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(c->out_n * sizeof(int));
        memcpy(CMSG_DATA(cm), c->out_fds, c->out_n * sizeof(int));
    }
    ssize_t n = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        kvc_ep_mod(a, c->fd, EPOLLOUT | EPOLLRDHUP, &c->pe);
        return false;
    }
    /* Sent (the kernel holds the fds in flight) or failed: ours go. */
    close_fds(c->out_fds, c->out_n);
    free(c->out_fds);
    c->out_fds = NULL;
    c->out_n = 0;
    c->out_pending = false;
    if (n != BATCH_LEN || get32(c->out + 4) != 0) { /* failed, or a refusal went out */
        conn_close(a, c);
        return false;
    }
    kvc_ep_mod(a, c->fd, EPOLLIN | EPOLLRDHUP, &c->pe);
    return true;
}

/* Prepares the answer to one request: the batch of fds, or a refusal. */
static void conn_answer(kvc_agent_t *a, kvc_ipcfd_conn_t *c, const uint8_t *req) {
    struct kvc_ipcfd_srv *s = a->ipcfd;
    uint32_t first = get32(req + 4), count = get32(req + 8);
    int32_t status = KVC_OK;
    if (CRYPTO_memcmp(req + 12, s->token, KVC_IPC_FD_TOKEN_LEN)) {
        status = KVC_ERR_AUTH;
        a->stats[KVC_STAT_AUTH_FAILED]++;
        if (kvc_log_ratelimit(a, KVC_RL_AUTH))
            KVC_LOG(a, KVC_LOG_WARN, "CUDA IPC: fd request from pid %d with a wrong token", c->pid);
    } else if (count == 0 || count > KVC_IPCFD_BATCH || first > s->n || count > s->n - first) {
        status = KVC_ERR_PROTOCOL;
    } else if (!(c->out_fds = malloc(count * sizeof(int)))) {
        status = KVC_ERR_NO_MEMORY;
    } else {
        for (uint32_t i = 0; i < count && status == KVC_OK; i++) {
            int fd = -1;
            status =
                kvc_cuda_vmm_export(a->cuda, s->dev[first + i], s->pieces[first + i].handle, &fd);
            if (status != KVC_OK) {
                KVC_LOG(a, KVC_LOG_WARN, "CUDA IPC: cannot export VMM allocation %u: %s", first + i,
                        kvc_cuda_last_error(a->cuda));
                break;
            }
            c->out_fds[c->out_n++] = fd;
        }
    }
    if (status != KVC_OK) {
        if (c->out_fds) close_fds(c->out_fds, c->out_n);
        c->out_n = 0;
        count = 0;
    }
    c->out_pending = true;
    memcpy(c->out, MAGIC, 4);
    put32(c->out + 4, (uint32_t)status);
    put32(c->out + 8, first);
    put32(c->out + 12, count);
    KVC_LOG(a, KVC_LOG_DEBUG, "CUDA IPC: fds %u..%u of %zu to pid %d: %s", first, first + count,
            s->n, c->pid, kvc_status_str((kvc_status_t)status));
    if (status == KVC_OK && first + count == s->n)
        KVC_LOG(a, KVC_LOG_INFO, "CUDA IPC: fds of %zu VMM allocations passed to pid %d", s->n,
                c->pid);
}

void kvc_ipcfd_conn_io(kvc_agent_t *a, kvc_ipcfd_conn_t *c, uint32_t events) {
    if (c->dead || !a->ipcfd) return;
    if (c->out_pending && !conn_flush(a, c)) return;
    for (int i = 0; i < 16 && !c->dead; i++) {
        uint8_t req[REQ_LEN + 1];
        ssize_t n = recv(c->fd, req, sizeof(req), MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            if (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) conn_close(a, c);
            return;
        }
        if (n != REQ_LEN || memcmp(req, MAGIC, 4)) {
            conn_close(a, c); /* closed by the consumer, or not our protocol */
            return;
        }
        c->deadline_ns = kvc_now_ns() + CONN_IDLE_MS * 1000000ull;
        conn_answer(a, c, req);
        if (!conn_flush(a, c)) return;
    }
}

void kvc_ipcfd_timers(kvc_agent_t *a, uint64_t now, uint64_t *next) {
    struct kvc_ipcfd_srv *s = a->ipcfd;
    if (!s) return;
    for (kvc_ipcfd_conn_t **pp = &s->conns; *pp;) {
        kvc_ipcfd_conn_t *c = *pp;
        if (!c->dead && now >= c->deadline_ns) conn_close(a, c);
        if (c->dead) {
            *pp = c->next;
            s->nconns--;
            free(c);
            continue;
        }
        if (c->deadline_ns < *next) *next = c->deadline_ns;
        pp = &c->next;
    }
}

/* ------------------------------------------------------------- consumer -- */

static kvc_status_t cli_ask(kvc_ipcfd_cli_t *c) {
    uint8_t req[REQ_LEN];
    c->want_first = c->next;
    c->want_n = c->total - c->next < c->batch ? c->total - c->next : c->batch;
    memcpy(req, MAGIC, 4);
    put32(req + 4, c->want_first);
    put32(req + 8, c->want_n);
    memcpy(req + 12, c->token, KVC_IPC_FD_TOKEN_LEN);
    /* One request at a time on a fresh datagram socket: it fits. */
    ssize_t n = send(c->fd, req, sizeof(req), MSG_NOSIGNAL | MSG_DONTWAIT);
    OPENSSL_cleanse(req, sizeof(req));
    if (n != (ssize_t)sizeof(req)) return KVC_ERR_IO;
    c->next += c->want_n;
    return KVC_OK;
}

kvc_status_t kvc_ipcfd_fetch(kvc_agent_t *a, const kvc_ipc_table_t *t, kvc_pollent_t *pe,
                             kvc_ipcfd_cli_t **out, char *err, size_t errlen) {
    kvc_ipcfd_cli_t *c = calloc(1, sizeof(*c));
    if (!c) return KVC_ERR_NO_MEMORY;
    c->total = t->n_pieces;
    c->batch = KVC_IPCFD_BATCH;
    const char *tb = getenv("KVC_TEST_FD_BATCH"); /* tests only: several batches from few fds */
    if (tb && atoi(tb) > 0 && atoi(tb) < KVC_IPCFD_BATCH) c->batch = (uint32_t)atoi(tb);
    memcpy(c->token, t->token.p, KVC_IPC_FD_TOKEN_LEN);
    struct sockaddr_un sa;
    socklen_t sl = abstract_addr(&sa, (const char *)t->sock.p, t->sock.len);
    struct ucred uc = {0};
    kvc_status_t st = KVC_ERR_IO;
    c->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&sa, sl)) {
        /* Another network namespace has other abstract sockets. */
        snprintf(err, errlen, "cannot reach the producer's fd socket: %s", strerror(errno));
    } else if (!peer_cred(c->fd, &uc) || (uint32_t)uc.pid != t->pid) {
        snprintf(err, errlen, "the fd socket belongs to pid %d, the producer is pid %u",
                 (int)uc.pid, t->pid);
        st = KVC_ERR_AUTH;
    } else if (cli_ask(c) != KVC_OK) {
        snprintf(err, errlen, "cannot send the fd request: %s", strerror(errno));
    } else if (kvc_ep_add(a, c->fd, EPOLLIN | EPOLLRDHUP, pe) != KVC_OK) {
        snprintf(err, errlen, "epoll: %s", strerror(errno));
    } else {
        *out = c;
        return KVC_OK;
    }
    if (c->fd >= 0) close(c->fd);
    OPENSSL_cleanse(c->token, sizeof(c->token));
    free(c);
    return st;
}

kvc_status_t kvc_ipcfd_recv(kvc_ipcfd_cli_t *c, int fds[KVC_IPCFD_BATCH], uint32_t *first,
                            uint32_t *n, char *err, size_t errlen) {
    uint8_t hdr[BATCH_LEN + 1];
    struct iovec iov = {hdr, sizeof(hdr)};
    union {
        char buf[CMSG_SPACE(KVC_IPCFD_BATCH * sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof(u.buf)};
    ssize_t r = recvmsg(c->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return KVC_AGAIN;
    uint32_t got = 0;
    for (struct cmsghdr *cm = r > 0 ? CMSG_FIRSTHDR(&mh) : NULL; cm; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
        size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
            if (got < KVC_IPCFD_BATCH)
                fds[got++] = fd;
            else
                close(fd);
        }
    }
    const char *why = NULL;
    if (r <= 0)
        why = r == 0 ? "the producer closed the fd socket" : strerror(errno);
    else if (mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC) || r != BATCH_LEN || memcmp(hdr, MAGIC, 4))
        why = "malformed fd batch";
    else if (get32(hdr + 4) != 0)
        why = kvc_status_str((kvc_status_t)(int32_t)get32(hdr + 4));
    else if (get32(hdr + 8) != c->want_first || get32(hdr + 12) != c->want_n || got != c->want_n)
        why = "fd batch out of order";
    if (why) {
        close_fds(fds, got);
        snprintf(err, errlen, "fd request refused or failed: %s", why);
        return KVC_ERR_IO;
    }
    *first = c->want_first;
    *n = got;
    if (c->next < c->total && cli_ask(c) != KVC_OK) {
        close_fds(fds, got);
        snprintf(err, errlen, "cannot send the fd request: %s", strerror(errno));
        return KVC_ERR_IO;
    }
    return KVC_OK;
}

void kvc_ipcfd_fetch_close(kvc_agent_t *a, kvc_ipcfd_cli_t *c) {
    if (!c) return;
    kvc_ep_del(a, c->fd);
    close(c->fd);
    OPENSSL_cleanse(c->token, sizeof(c->token));
    free(c);
}
