/* SPDX-License-Identifier: Apache-2.0 */
#include "base/logsink.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/list.h"
#include "base/util.h"

/* The most the sink holds back while it cannot write (at least this, and
 * four buffers' worth): past it, lines are dropped. */
#define QUEUE_MIN (256 * 1024)

/* One thread's batched lines. Its owner appends under mu; the sink's
 * thread and the flushes take the lines under S.mu, then mu. */
typedef struct tbuf {
    pthread_mutex_t mu;
    char *data; /* owned: cap bytes */
    size_t len, cap;
    unsigned lines;
    uint64_t first_ns; /* when the oldest line in data came */
    struct tbuf *prev, *next; /* in S.threads */
} tbuf;

/* Bytes the sink refused, in order. */
typedef struct chunk {
    struct chunk *next;
    size_t len, off;
    char data[];
} chunk;

static struct {
    pthread_mutex_t mu; /* all below; taken before any tbuf's mu */
    pthread_cond_t cv;  /* the sink's thread waits on it (CLOCK_MONOTONIC) */
    int opened;         /* fd is ours (started, stopped or not) */
    int thread_on, stopping;
    int fd;
    int sock; /* fd is a socket: send() with MSG_DONTWAIT */
    char *path;
    size_t buffer_bytes;
    uint64_t flush_ns;
    size_t max_queued;
    chunk *qhead, *qtail;
    size_t queued;
    tbuf *threads;
    pthread_t thr;
    uint64_t reported; /* dropped, as of the last on_dropped */
    uint64_t warned_ns;
    void (*on_dropped)(uint64_t n);
} S = {.mu = PTHREAD_MUTEX_INITIALIZER, .fd = -1};

static atomic_int opened;  /* S.opened, read without the lock */
static atomic_int running; /* batching on: started, not stopped */
static atomic_int timer_armed; /* the sink's thread knows a batch waits */
static atomic_ullong dropped;
static pthread_key_t tkey;
static _Thread_local tbuf *mine;

static unsigned count_lines(const char *p, size_t n) {
    unsigned k = 0;
    for (const char *e = p + n; p < e && (p = memchr(p, '\n', (size_t)(e - p))); p++)
        k++;
    return k;
}

/* ---------- the sink (under S.mu) ---------- */

/* Writes what the sink takes now: the bytes written. *hard: it failed for
 * good (closed pipe, full disk): the rest is to be dropped. */
static size_t write_some(const char *p, size_t n, int *hard) {
    size_t done = 0;
    while (done < n) {
        ssize_t w = S.sock ? send(S.fd, p + done, n - done, MSG_DONTWAIT | MSG_NOSIGNAL)
                           : write(S.fd, p + done, n - done);
        if (w > 0) {
            done += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        *hard = 1;
        break;
    }
    return done;
}

static void enqueue(const char *p, size_t n) {
    chunk *c = malloc(sizeof *c + n);
    if (!c) {
        atomic_fetch_add(&dropped, count_lines(p, n));
        return;
    }
    c->next = NULL;
    c->len = n;
    c->off = 0;
    memcpy(c->data, p, n);
    if (S.qtail)
        S.qtail->next = c;
    else
        S.qhead = c;
    S.qtail = c;
    S.queued += n;
    pthread_cond_signal(&S.cv); /* the sink's thread waits for it to drain */
}

static void drop_queue(void) {
    while (S.qhead) {
        chunk *c = S.qhead;
        S.qhead = c->next;
        atomic_fetch_add(&dropped, count_lines(c->data + c->off, c->len - c->off));
        free(c);
    }
    S.qtail = NULL;
    S.queued = 0;
}

/* Writes what waits, as far as the sink takes it. */
static void drain(void) {
    while (S.qhead) {
        chunk *c = S.qhead;
        int hard = 0;
        size_t w = write_some(c->data + c->off, c->len - c->off, &hard);
        if (hard) {
            drop_queue();
            return;
        }
        c->off += w;
        S.queued -= w;
        if (c->off < c->len) return;
        S.qhead = c->next;
        if (!S.qhead) S.qtail = NULL;
        free(c);
    }
}

/* n bytes holding `lines` lines: written, queued behind what waits, or
 * dropped past the queue's bound. The rest of a line the sink took in part
 * is always queued: a torn line would run into the next. */
static void sink_put(const char *p, size_t n, unsigned lines) {
    if (!n) return;
    if (!S.qhead) {
        int hard = 0;
        size_t w = write_some(p, n, &hard);
        if (hard) {
            atomic_fetch_add(&dropped, count_lines(p + w, n - w));
            return;
        }
        if (w == n) return;
        if (w > 0 || !S.thread_on) {
            if (S.thread_on)
                enqueue(p + w, n - w);
            else /* stopped: nobody would write it */
                atomic_fetch_add(&dropped, count_lines(p + w, n - w));
            return;
        }
    }
    if (!S.thread_on || S.queued + n > S.max_queued) {
        atomic_fetch_add(&dropped, lines);
        return;
    }
    enqueue(p, n);
}

/* Hands the batches of every thread (`all`), or those whose oldest line
 * waited flush_ns, to the sink. Returns when the next batch is due, 0 for
 * none. */
static uint64_t flush_threads(uint64_t now, int all) {
    uint64_t next = 0;
    for (tbuf *t = S.threads; t; t = t->next) {
        pthread_mutex_lock(&t->mu);
        if (t->len && (all || now - t->first_ns >= S.flush_ns)) {
            sink_put(t->data, t->len, t->lines);
            t->len = 0;
            t->lines = 0;
        } else if (t->len && (!next || t->first_ns + S.flush_ns < next)) {
            next = t->first_ns + S.flush_ns;
        }
        pthread_mutex_unlock(&t->mu);
    }
    return next;
}

/* ---------- the sink's thread ---------- */

static void wait_until_ns(uint64_t when) {
    struct timespec ts = {(time_t)(when / 1000000000u), (long)(when % 1000000000u)};
    pthread_cond_timedwait(&S.cv, &S.mu, &ts);
}

static void *sink_main(void *arg) {
    pthread_mutex_lock(&S.mu);
    while (!S.stopping) {
        uint64_t now = px_now_ns();
        /* Cleared before the look at the buffers: a first line appended
         * after it signals again (under S.mu, so never between this look
         * and the wait). */
        atomic_store(&timer_armed, 0);
        uint64_t next = flush_threads(now, 0);
        if (next) atomic_store(&timer_armed, 1);
        drain();
        uint64_t d = atomic_load(&dropped);
        if (!S.qhead && d > S.reported && now - S.warned_ns >= 1000000000u && S.on_dropped) {
            uint64_t n = d - S.reported;
            S.reported = d;
            S.warned_ns = now;
            pthread_mutex_unlock(&S.mu);
            S.on_dropped(n); /* logs: takes S.mu */
            pthread_mutex_lock(&S.mu);
            continue;
        }
        if (S.qhead) {
            /* Until the sink takes more (or a batch is due, or 50 ms: the
             * descriptor may change under a reopen). */
            int ms = 50;
            if (next && next > now && (next - now) / 1000000u + 1 < (uint64_t)ms)
                ms = (int)((next - now) / 1000000u + 1);
            struct pollfd pf = {S.fd, POLLOUT, 0};
            pthread_mutex_unlock(&S.mu);
            poll(&pf, 1, ms);
            pthread_mutex_lock(&S.mu);
        } else if (next) {
            wait_until_ns(next);
        } else if (d > S.reported && S.on_dropped) {
            wait_until_ns(S.warned_ns + 1000000000u); /* the next warning's turn */
        } else {
            pthread_cond_wait(&S.cv, &S.mu);
        }
    }
    pthread_mutex_unlock(&S.mu);
    return NULL;
}

/* ---------- threads' buffers ---------- */

static void tbuf_gone(void *arg) {
    tbuf *t = arg;
    pthread_mutex_lock(&S.mu);
    pthread_mutex_lock(&t->mu);
    sink_put(t->data, t->len, t->lines); /* the exiting thread's last lines */
    pthread_mutex_unlock(&t->mu);
    PX_LIST_UNLINK(S.threads, t);
    pthread_mutex_unlock(&S.mu);
    pthread_mutex_destroy(&t->mu);
    free(t->data);
    free(t);
    mine = NULL;
}

static tbuf *tbuf_new(void) {
    tbuf *t = calloc(1, sizeof *t);
    char *data = t ? malloc(S.buffer_bytes) : NULL;
    if (!data) {
        free(t);
        return NULL;
    }
    t->data = data;
    t->cap = S.buffer_bytes;
    pthread_mutex_init(&t->mu, NULL);
    pthread_mutex_lock(&S.mu);
    PX_LIST_PUSH(S.threads, t);
    pthread_mutex_unlock(&S.mu);
    pthread_setspecific(tkey, t); /* tbuf_gone at the thread's exit */
    mine = t;
    return t;
}

/* The first line of a batch: the sink's thread is told, once, to time it. */
static void arm_timer(void) {
    if (atomic_exchange(&timer_armed, 1)) return;
    pthread_mutex_lock(&S.mu);
    pthread_cond_signal(&S.cv);
    pthread_mutex_unlock(&S.mu);
}

/* ---------- public ---------- */

static int open_sink(const char *path, char *err, size_t errlen) {
    S.sock = 0;
    if (path && *path) {
        /* O_NONBLOCK: a FIFO given as the file must not block us either. */
        int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644);
        if (fd < 0) snprintf(err, errlen, "cannot open --log-file %s: %s", path, strerror(errno));
        return fd;
    }
    struct stat st;
    if (fstat(2, &st) < 0) return open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (S_ISSOCK(st.st_mode)) { /* journald's stream: send() says not to wait */
        S.sock = 1;
        return fcntl(2, F_DUPFD_CLOEXEC, 3);
    }
    if (S_ISREG(st.st_mode)) return fcntl(2, F_DUPFD_CLOEXEC, 3); /* never waits on a reader */
    /* A pipe or a terminal: a description of our own, non-blocking, so that
     * stderr's own (shared with whoever started us) keeps its flags. */
    int fd = open("/proc/self/fd/2", O_WRONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0) return fd;
    /* No /proc: stderr's description made non-blocking, as a last resort. */
    fd = fcntl(2, F_DUPFD_CLOEXEC, 3);
    if (fd >= 0) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

static void make_key(void) {
    pthread_key_create(&tkey, tbuf_gone);
}

int px_logsink_start(const px_logsink_cfg *cfg, char *err, size_t errlen) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, make_key);
    if (S.opened) {
        snprintf(err, errlen, "the log sink is started already");
        return -1;
    }
    int fd = open_sink(cfg->path, err, errlen);
    if (fd < 0) {
        if (!cfg->path || !*cfg->path) snprintf(err, errlen, "cannot open stderr for the log");
        return -1;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&S.cv, &ca);
    pthread_condattr_destroy(&ca);
    S.fd = fd;
    S.path = cfg->path && *cfg->path ? px_xstrdup(cfg->path) : NULL;
    S.buffer_bytes = cfg->buffer_bytes;
    S.flush_ns = (uint64_t)((cfg->flush_s > 0 ? cfg->flush_s : 1.0) * 1e9);
    S.max_queued = 4 * S.buffer_bytes > QUEUE_MIN ? 4 * S.buffer_bytes : QUEUE_MIN;
    S.on_dropped = cfg->on_dropped;
    S.stopping = 0;
    S.opened = 1;
    S.thread_on = pthread_create(&S.thr, NULL, sink_main, NULL) == 0;
    if (!S.thread_on) {
        snprintf(err, errlen, "cannot start the log's thread");
        close(S.fd);
        S.fd = -1;
        S.opened = 0;
        free(S.path);
        S.path = NULL;
        return -1;
    }
    atomic_store_explicit(&opened, 1, memory_order_release);
    atomic_store_explicit(&running, 1, memory_order_release);
    return 0;
}

int px_logsink_put(const char *line, size_t n, int batched) {
    if (!atomic_load_explicit(&opened, memory_order_acquire)) return 0;
    if (!atomic_load_explicit(&running, memory_order_acquire)) {
        pthread_mutex_lock(&S.mu);
        int on = S.opened;
        if (on) sink_put(line, n, 1);
        pthread_mutex_unlock(&S.mu);
        return on;
    }
    tbuf *t = mine;
    if (batched && S.buffer_bytes && n <= S.buffer_bytes && (t || (t = tbuf_new()))) {
        pthread_mutex_lock(&t->mu);
        if (t->len + n <= t->cap) {
            int first = t->len == 0;
            if (first) t->first_ns = px_now_ns();
            memcpy(t->data + t->len, line, n);
            t->len += n;
            t->lines++;
            pthread_mutex_unlock(&t->mu);
            if (first) arm_timer();
            return 1;
        }
        pthread_mutex_unlock(&t->mu);
        /* Full: the batch goes (from this thread), and the line starts the
         * next one. */
        pthread_mutex_lock(&S.mu);
        pthread_mutex_lock(&t->mu);
        sink_put(t->data, t->len, t->lines);
        t->first_ns = px_now_ns();
        memcpy(t->data, line, n);
        t->len = n;
        t->lines = 1;
        pthread_mutex_unlock(&t->mu);
        pthread_mutex_unlock(&S.mu);
        arm_timer();
        return 1;
    }
    /* At once, behind this thread's batch. */
    pthread_mutex_lock(&S.mu);
    if (t) {
        pthread_mutex_lock(&t->mu);
        sink_put(t->data, t->len, t->lines);
        t->len = 0;
        t->lines = 0;
        pthread_mutex_unlock(&t->mu);
    }
    sink_put(line, n, 1);
    pthread_mutex_unlock(&S.mu);
    return 1;
}

void px_logsink_flush(void) {
    pthread_mutex_lock(&S.mu);
    if (S.opened) flush_threads(0, 1);
    pthread_mutex_unlock(&S.mu);
}

int px_logsink_reopen(char *err, size_t errlen) {
    int rc = 0;
    pthread_mutex_lock(&S.mu);
    if (S.opened) {
        flush_threads(0, 1);
        drain();
        if (S.path) {
            int old = S.fd;
            int fd = open_sink(S.path, err, errlen);
            if (fd < 0) {
                rc = -1;
            } else {
                S.fd = fd; /* what still waits goes to the new file */
                close(old);
            }
        }
    }
    pthread_mutex_unlock(&S.mu);
    return rc;
}

void px_logsink_stop(double timeout_s) {
    pthread_mutex_lock(&S.mu);
    if (!S.thread_on) {
        pthread_mutex_unlock(&S.mu);
        return;
    }
    atomic_store_explicit(&running, 0, memory_order_release);
    flush_threads(0, 1);
    uint64_t end = px_now_ns() + (uint64_t)(timeout_s * 1e9);
    drain();
    for (int i = 0; S.qhead && i < 100000; i++) {
        uint64_t now = px_now_ns();
        if (now >= end) break;
        struct pollfd pf = {S.fd, POLLOUT, 0};
        pthread_mutex_unlock(&S.mu);
        poll(&pf, 1, (int)((end - now) / 1000000u) + 1);
        pthread_mutex_lock(&S.mu);
        drain();
    }
    drop_queue(); /* a sink that stayed stalled past the timeout */
    S.stopping = 1;
    S.thread_on = 0; /* from now on, what the sink refuses is dropped */
    pthread_cond_signal(&S.cv);
    pthread_mutex_unlock(&S.mu);
    pthread_join(S.thr, NULL);
}

uint64_t px_logsink_dropped(void) {
    return atomic_load(&dropped);
}
