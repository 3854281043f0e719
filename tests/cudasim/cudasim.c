/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA stand-in: the runtime functions libkvconnector calls, asynchronous.
 *
 * "Device" memory is host memory handed out by cudaMalloc and remembered
 * with its device.  Each stream is a FIFO of operations (copies, event
 * records, event waits, host functions) that run later, in order: at a
 * synchronisation point and one per event query (lazy mode), or, like a
 * GPU, on copy-engine threads concurrently with the caller (threaded mode:
 * one thread per device runs the copies of that device's streams in
 * submission order, a stream at a time, and one host-function thread runs
 * cudaLaunchHostFunc's functions, so a slow one holds back its own stream
 * only; events complete when the work before them is done, and
 * synchronisations block until then; CUDASIM_GBPS caps each engine's copy
 * rate so that ratios resemble a device).  A program that never calls
 * cudasim_reset runs threaded unless CUDASIM_MODE=lazy.  Events and
 * cross-stream waits are honoured; the current
 * device is per thread; the last error is per thread and cleared by
 * cudaGetLastError.  Default streams as CUDA has them: handle 0 and
 * cudaStreamLegacy name the legacy default stream of the current device,
 * which is implicitly ordered with every blocking stream of that device (work
 * queued on it waits for what they queued before, and theirs waits for it);
 * cudaStreamPerThread names the calling thread's own default stream, a
 * blocking stream.  Streams created cudaStreamNonBlocking take no part in
 * that implicit ordering.  One rule is stricter than CUDA, on purpose: a copy that
 * touches device memory must be issued on a stream of the device that owns
 * that memory, so staging on the wrong device fails here. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* nanosleep */
#endif
#include "tests/cudasim/cudasim_int.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MAX_DEV 8

typedef enum { OP_COPY, OP_COPY2D, OP_RECORD, OP_WAIT, OP_HOSTFN, OP_MEMSET } op_kind_t;

typedef struct op {
    struct op *next;
    op_kind_t kind;
    void *dst;
    const void *src;
    size_t dpitch, spitch, width, height;
    cudaEvent_t ev;
    unsigned long gen;
    cudaStream_t wstream; /* OP_WAIT: the stream that records ev's generation */
    cudaHostFn_t fn;
    void *arg;
    cudaError_t fail; /* injected: fails when it runs */
    bool own_ev;      /* OP_WAIT: an implicit barrier's event, freed with the op */
    unsigned long ticket; /* submission order, across streams (copy engines) */
} op_t;

struct CUstream_st {
    struct CUstream_st *next_all;
    int device;
    op_t *head, *tail;
    size_t n;
    cudaError_t err; /* asynchronous error, reported at the next sync */
    bool held;       /* eager mode: runs only when a sync forces it */
    bool blocking;   /* created without cudaStreamNonBlocking (or a per-thread default) */
    bool legacy;     /* a device's legacy default stream */
    bool busy;       /* threaded: its head op is running on an engine thread, unlocked */
};

struct CUevent_st {
    int device;
    cudaError_t err; /* an asynchronous error of its stream before the record ran */
    unsigned long gen, done_gen;
    cudaStream_t stream; /* of the latest record */
};

typedef struct alloc {
    struct alloc *next;
    uint8_t *p;
    size_t len;
    int device;
    struct alloc *tail; /* cudasim_split: the allocation carved from this one's memory */
    bool borrowed;      /* its memory belongs to the allocation it was split from */
    /* Device memory is a memfd mapped here, so that another process can map
     * it too (cudaIpcOpenMemHandle).  fd: the memfd (owned unless borrowed),
     * off: where this allocation starts in it, maplen: the mapping's length
     * (owned mappings). */
    int fd;
    size_t off, maplen;
    /* An IPC mapping (cudaIpcOpenMemHandle): the exporter and its handle's
     * allocation id, opened `refs` times; never cudaFree'd. */
    bool imported;
    int pid, refs;
    uint64_t uid;
} alloc_t;

typedef struct {
    const char *fn;
    unsigned nth;
    cudaError_t err;
    bool async;
} fault_t;

#define MAX_FAULTS 16
#define MAX_FNS 64

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int ndev = 2;
static uint64_t next_uid; /* allocation ids, named in IPC handles */
/* Each device's legacy default stream, valid before any cudasim_reset (a
 * program that never calls it, like kvc_gpu_test_standin). */
#define LEGACY(d)                                                                                  \
    { .device = (d), .legacy = true }
static struct CUstream_st default_streams[MAX_DEV] = {LEGACY(0), LEGACY(1), LEGACY(2), LEGACY(3),
                                                      LEGACY(4), LEGACY(5), LEGACY(6), LEGACY(7)};
static cudaStream_t streams;
static alloc_t *allocs, *pinned;
static fault_t faults[MAX_FAULTS];
static struct {
    const char *fn;
    unsigned long n;
} counts[MAX_FNS];
static int nstreams_live;
static size_t pinned_now, pinned_peak;
/* Threaded mode: engines[d] runs device d's copies, engines[MAX_DEV] the
 * host functions; all wait on cv, which every enqueue and completion
 * broadcasts (synchronising callers wait on it too). */
static pthread_t engines[MAX_DEV + 1];
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int nengines;
static bool engine_on, engine_stop, eager;
static double cap_bps; /* CUDASIM_GBPS: bytes per second per engine, 0: no cap */
static unsigned long tickets;
static _Thread_local int cur_dev;
static _Thread_local cudaError_t last_err;
static _Thread_local cudaStream_t per_thread[MAX_DEV]; /* cudaStreamPerThread, made on first use */

/* ---------------------------------------------------------- internals -- */

static cudaError_t set_err(cudaError_t e) {
    if (e != cudaSuccess && e != cudaErrorNotReady) last_err = e;
    return e;
}

/* Counts the call and applies a pending fault.  Returns the error to fail
 * with now, or cudaSuccess; *async_fail gets an error to attach to the op. */
static cudaError_t enter(const char *fn, cudaError_t *async_fail) {
    int i;
    for (i = 0; i < MAX_FNS && counts[i].fn; i++)
        if (!strcmp(counts[i].fn, fn)) break;
    if (i < MAX_FNS) {
        counts[i].fn = fn;
        counts[i].n++;
    }
    if (async_fail) *async_fail = cudaSuccess;
    for (int k = 0; k < MAX_FAULTS; k++) {
        fault_t *f = &faults[k];
        if (!f->fn || strcmp(f->fn, fn)) continue;
        if (--f->nth > 0) continue;
        cudaError_t e = f->err;
        bool async = f->async;
        f->fn = NULL;
        if (async && async_fail) {
            *async_fail = e;
            return cudaSuccess;
        }
        return e;
    }
    if (ndev == 0) return cudaErrorInsufficientDriver;
    return cudaSuccess;
}

static alloc_t *find_alloc(alloc_t *list, const void *p, size_t len) {
    const uint8_t *q = p;
    for (alloc_t *a = list; a; a = a->next)
        if (q >= a->p && q < a->p + a->len) return (size_t)(a->p + a->len - q) >= len ? a : NULL;
    return NULL;
}

static bool is_device_ptr(const void *p) {
    return find_alloc(allocs, p, 1) != NULL;
}

/* The stream a handle names: 0 and cudaStreamLegacy the current device's
 * legacy default stream, cudaStreamPerThread this thread's default stream
 * on the current device (NULL if it cannot be made). */
static cudaStream_t resolve(cudaStream_t s) {
    if (s == NULL || s == cudaStreamLegacy) return &default_streams[cur_dev];
    if (s != cudaStreamPerThread) return s;
    if (!per_thread[cur_dev]) {
        cudaStream_t p = calloc(1, sizeof(*p));
        if (!p) return NULL;
        p->device = cur_dev;
        p->blocking = true;
        p->next_all = streams;
        streams = p;
        per_thread[cur_dev] = p;
    }
    return per_thread[cur_dev];
}

static void pump(void);

static void append(cudaStream_t s, op_t *o) {
    o->next = NULL;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    s->n++;
}

/* s waits for everything queued on `on` so far: an implicit event recorded
 * at the end of `on`, waited for on s.  Out of memory: no barrier (tests
 * would show the missing order, never hide it). */
static void barrier(cudaStream_t s, cudaStream_t on) {
    if (!on->tail) return;
    cudaEvent_t ev = calloc(1, sizeof(*ev));
    op_t *rec = calloc(1, sizeof(*rec)), *w = calloc(1, sizeof(*w));
    if (!ev || !rec || !w) {
        free(ev);
        free(rec);
        free(w);
        return;
    }
    ev->device = on->device;
    ev->stream = on;
    *rec = (op_t){.kind = OP_RECORD, .ev = ev, .gen = ++ev->gen};
    append(on, rec);
    *w = (op_t){.kind = OP_WAIT, .ev = ev, .gen = ev->gen, .wstream = on, .own_ev = true};
    append(s, w);
}

/* The legacy default stream's implicit ordering with blocking streams. */
static void implicit_order(cudaStream_t s) {
    if (s->legacy) {
        for (cudaStream_t b = streams; b; b = b->next_all)
            if (b->blocking && b->device == s->device) barrier(s, b);
    } else if (s->blocking) {
        barrier(s, &default_streams[s->device]);
    }
}

static void enqueue(cudaStream_t s, op_t *o) {
    implicit_order(s);
    o->ticket = ++tickets;
    append(s, o);
    if (engine_on) pthread_cond_broadcast(&cv);
    else if (eager) pump();
}

static bool run_one(cudaStream_t s, int depth);
static void pop(cudaStream_t s);

/* What a copy, a memset or a host function does (no stream state: the
 * copy engines run it without the lock).  Returns the bytes moved. */
static size_t exec_data(op_t *o) {
    switch (o->kind) {
    case OP_COPY:
        memmove(o->dst, o->src, o->width);
        return o->width;
    case OP_COPY2D:
        for (size_t r = 0; r < o->height; r++)
            memmove((uint8_t *)o->dst + r * o->dpitch, (const uint8_t *)o->src + r * o->spitch,
                    o->width);
        return o->width * o->height;
    case OP_HOSTFN:
        o->fn(o->arg);
        return 0;
    case OP_MEMSET:
        memset(o->dst, (int)o->dpitch, o->width);
        return o->width;
    default:
        return 0;
    }
}

static void exec(cudaStream_t s, op_t *o, int depth) {
    if (o->fail != cudaSuccess) {
        if (s->err == cudaSuccess) s->err = o->fail;
        return;
    }
    switch (o->kind) {
    case OP_RECORD:
        if (o->ev->done_gen < o->gen) o->ev->done_gen = o->gen;
        o->ev->err = s->err; /* CUDA's errors are sticky: a query after it reports it */
        break;
    case OP_WAIT:
        /* Work on the other stream up to the awaited record runs first. */
        while (o->ev->done_gen < o->gen && run_one(o->wstream, depth + 1))
            ;
        break;
    default:
        exec_data(o);
        break;
    }
}

static bool run_one(cudaStream_t s, int depth) {
    if (depth > 64) {
        fprintf(stderr, "cudasim: cyclic stream waits (a deadlock on a real GPU)\n");
        abort();
    }
    op_t *o = s->head;
    if (!o) return false;
    /* Executed before it leaves the queue, so that a wait inside it sees a
     * consistent picture; then popped. */
    exec(s, o, depth);
    pop(s);
    return true;
}

static void pop(cudaStream_t s) {
    op_t *o = s->head;
    s->head = o->next;
    if (!s->head) s->tail = NULL;
    s->n--;
    if (o->own_ev) free(o->ev); /* its record ran: the wait saw it */
    free(o);
}

/* Eager mode: every stream that is not held runs what it can without
 * waiting: an event wait whose event is not complete stops that stream. */
static void pump(void) {
    static bool pumping;
    if (pumping) return; /* an op that enqueues (none today) must not recurse */
    pumping = true;
    for (bool progress = true; progress;) {
        progress = false;
        for (int d = -1; d < MAX_DEV; d++) {
            for (cudaStream_t s = d < 0 ? streams : &default_streams[d]; s;
                 s = d < 0 ? s->next_all : NULL) {
                while (!s->held && s->head &&
                       (s->head->kind != OP_WAIT || s->head->ev->done_gen >= s->head->gen)) {
                    run_one(s, 0);
                    progress = true;
                }
            }
        }
    }
    pumping = false;
}

/* Everything queued on s has run: run here (lazy), or waited for. */
static void drain(cudaStream_t s) {
    if (engine_on) {
        while (s->head)
            pthread_cond_wait(&cv, &mu);
        return;
    }
    while (run_one(s, 0))
        ;
}

static void discard(cudaStream_t s) {
    while (s->head) {
        op_t *o = s->head;
        s->head = o->next;
        /* A discarded record op never dereferences its event, so an implicit
         * event can go with its wait. */
        if (o->own_ev) free(o->ev);
        free(o);
    }
    s->tail = NULL;
    s->n = 0;
    s->err = cudaSuccess;
}

static cudaError_t take_async(cudaStream_t s) {
    cudaError_t e = s->err;
    s->err = cudaSuccess;
    return e;
}

/* The next op engine d runs: the runnable stream head submitted first
 * among its device's streams (d == MAX_DEV: among host functions). */
static cudaStream_t engine_pick(int d) {
    cudaStream_t best = NULL;
    for (int k = -1; k < MAX_DEV; k++)
        for (cudaStream_t s = k < 0 ? streams : &default_streams[k]; s;
             s = k < 0 ? s->next_all : NULL) {
            op_t *o = s->head;
            if (!o || s->busy || (o->kind == OP_WAIT && o->ev->done_gen < o->gen)) continue;
            bool host = o->kind == OP_HOSTFN && o->fail == cudaSuccess;
            if (d == MAX_DEV ? !host : host || s->device != d) continue;
            if (!best || o->ticket < best->head->ticket) best = s;
        }
    return best;
}

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *engine_main(void *arg) {
    int d = (int)(intptr_t)arg;
    pthread_mutex_lock(&mu);
    while (!engine_stop) {
        cudaStream_t s = engine_pick(d);
        if (!s) {
            pthread_cond_wait(&cv, &mu);
            continue;
        }
        op_t *o = s->head;
        if (o->kind == OP_RECORD || o->kind == OP_WAIT || o->fail != cudaSuccess) {
            exec(s, o, 0);
        } else {
            /* The bytes move without the lock, the stream held back meanwhile. */
            s->busy = true;
            pthread_mutex_unlock(&mu);
            double t0 = mono_s();
            size_t n = exec_data(o);
            double left = cap_bps > 0 ? t0 + (double)n / cap_bps - mono_s() : 0;
            if (left > 0) {
                struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
                nanosleep(&ts, NULL);
            }
            pthread_mutex_lock(&mu);
            s->busy = false;
        }
        pop(s);
        pthread_cond_broadcast(&cv);
    }
    pthread_mutex_unlock(&mu);
    return NULL;
}

static void engines_stop(void) {
    pthread_mutex_lock(&mu);
    engine_stop = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < nengines; i++)
        pthread_join(engines[i], NULL);
    nengines = 0;
    engine_on = false;
}

/* Under mu. */
static void engines_start(void) {
    const char *g = getenv("CUDASIM_GBPS");
    cap_bps = g && *g ? strtod(g, NULL) * 1e9 : 0;
    engine_stop = false;
    engine_on = true;
    for (int i = 0; i <= MAX_DEV; i++) {
        if (i < MAX_DEV && i >= ndev) continue;
        int d = i;
        if (pthread_create(&engines[nengines], NULL, engine_main, (void *)(intptr_t)d) == 0)
            nengines++;
    }
}

/* A program that never calls cudasim_reset (the GPU check's stand-in
 * build, the benchmark) copies like a GPU unless CUDASIM_MODE=lazy. */
__attribute__((constructor)) static void cudasim_init(void) {
    const char *m = getenv("CUDASIM_MODE");
    if (m && !strcmp(m, "lazy")) return;
    pthread_mutex_lock(&mu);
    engines_start();
    pthread_mutex_unlock(&mu);
}

/* ----------------------------------------------------------- controls -- */

void cudasim_reset(int devices, bool threaded) {
    if (engine_on) engines_stop();
    pthread_mutex_lock(&mu);
    /* Work a failed test left queued is dropped, never run: what it points
     * to may be gone. */
    for (cudaStream_t s = streams; s; s = s->next_all)
        discard(s);
    for (int d = 0; d < MAX_DEV; d++)
        discard(&default_streams[d]);
    ndev = devices < 0 ? 0 : devices > MAX_DEV ? MAX_DEV : devices;
    eager = false;
    for (cudaStream_t s = streams; s; s = s->next_all)
        s->held = false;
    memset(faults, 0, sizeof(faults));
    memset(counts, 0, sizeof(counts));
    pinned_peak = pinned_now;
    for (int d = 0; d < MAX_DEV; d++) {
        default_streams[d].device = d;
        default_streams[d].legacy = true;
    }
    if (threaded) engines_start();
    pthread_mutex_unlock(&mu);
    cur_dev = 0;
    last_err = cudaSuccess;
}

void cudasim_set_eager(bool on) {
    pthread_mutex_lock(&mu);
    eager = on;
    if (eager && !engine_on) pump();
    pthread_mutex_unlock(&mu);
}

void cudasim_hold(cudaStream_t s, bool hold) {
    pthread_mutex_lock(&mu);
    s = resolve(s);
    if (s) s->held = hold;
    if (eager && !engine_on) pump();
    pthread_mutex_unlock(&mu);
}

void cudasim_fail(const char *fn, unsigned nth, cudaError_t err) {
    pthread_mutex_lock(&mu);
    for (int k = 0; k < MAX_FAULTS; k++)
        if (!faults[k].fn) {
            faults[k] = (fault_t){fn, nth ? nth : 1, err, false};
            break;
        }
    pthread_mutex_unlock(&mu);
}

void cudasim_fail_async(const char *fn, unsigned nth, cudaError_t err) {
    pthread_mutex_lock(&mu);
    for (int k = 0; k < MAX_FAULTS; k++)
        if (!faults[k].fn) {
            faults[k] = (fault_t){fn, nth ? nth : 1, err, true};
            break;
        }
    pthread_mutex_unlock(&mu);
}

unsigned long cudasim_calls(const char *fn) {
    unsigned long n = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_FNS && counts[i].fn; i++)
        if (!strcmp(counts[i].fn, fn)) n = counts[i].n;
    pthread_mutex_unlock(&mu);
    return n;
}

size_t cudasim_pending(void) {
    size_t n = 0;
    pthread_mutex_lock(&mu);
    for (cudaStream_t s = streams; s; s = s->next_all)
        n += s->n;
    for (int d = 0; d < MAX_DEV; d++)
        n += default_streams[d].n;
    pthread_mutex_unlock(&mu);
    return n;
}

static void pinned_add(size_t n) {
    pinned_now += n;
    if (pinned_now > pinned_peak) pinned_peak = pinned_now;
}

size_t cudasim_pinned_bytes(void) {
    pthread_mutex_lock(&mu);
    size_t n = pinned_now;
    pthread_mutex_unlock(&mu);
    return n;
}

size_t cudasim_pinned_peak(void) {
    pthread_mutex_lock(&mu);
    size_t n = pinned_peak;
    pthread_mutex_unlock(&mu);
    return n;
}

int cudasim_streams_live(void) {
    pthread_mutex_lock(&mu);
    int n = nstreams_live;
    pthread_mutex_unlock(&mu);
    return n;
}

/* ------------------------------------------------------------ runtime -- */

#define ENTER(name, afail)                                                                         \
    pthread_mutex_lock(&mu);                                                                       \
    cudaError_t e_ = enter(name, afail);                                                           \
    if (e_ != cudaSuccess) {                                                                       \
        pthread_mutex_unlock(&mu);                                                                 \
        return set_err(e_);                                                                        \
    }

#define LEAVE(e)                                                                                   \
    do {                                                                                           \
        cudaError_t r_ = (e);                                                                      \
        pthread_mutex_unlock(&mu);                                                                 \
        return set_err(r_);                                                                        \
    } while (0)

cudaError_t cudaGetDeviceCount(int *count) {
    ENTER("cudaGetDeviceCount", NULL);
    if (!count) LEAVE(cudaErrorInvalidValue);
    *count = ndev;
    LEAVE(cudaSuccess);
}

cudaError_t cudaGetDevice(int *device) {
    ENTER("cudaGetDevice", NULL);
    if (!device) LEAVE(cudaErrorInvalidValue);
    *device = cur_dev;
    LEAVE(cudaSuccess);
}

cudaError_t cudaSetDevice(int device) {
    ENTER("cudaSetDevice", NULL);
    if (device < 0 || device >= ndev) LEAVE(cudaErrorInvalidDevice);
    cur_dev = device;
    LEAVE(cudaSuccess);
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = last_err;
    last_err = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void) {
    return last_err;
}

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess:
        return "cudaSuccess";
    case cudaErrorInvalidValue:
        return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
        return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError:
        return "cudaErrorInitializationError";
    case cudaErrorInsufficientDriver:
        return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice:
        return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
        return "cudaErrorInvalidDevice";
    case cudaErrorDeviceUninitialized:
        return "cudaErrorDeviceUninitialized";
    case cudaErrorMapBufferObjectFailed:
        return "cudaErrorMapBufferObjectFailed";
    case cudaErrorNotSupported:
        return "cudaErrorNotSupported";
    case cudaErrorInvalidResourceHandle:
        return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
        return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
        return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure:
        return "cudaErrorLaunchFailure";
    default:
        return "cudaErrorUnknown";
    }
}

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInsufficientDriver:
        return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice:
        return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
        return "invalid device ordinal";
    case cudaErrorDeviceUninitialized:
        return "invalid device context";
    case cudaErrorMapBufferObjectFailed:
        return "mapping of buffer object failed";
    case cudaErrorNotSupported:
        return "operation not supported";
    case cudaErrorInvalidResourceHandle:
        return "invalid resource handle";
    case cudaErrorNotReady:
        return "device not ready";
    case cudaErrorIllegalAddress:
        return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure:
        return "unspecified launch failure";
    default:
        return "unknown error";
    }
}

/* A memfd of `size` bytes mapped shared at a->p (a->fd, a->maplen). */
static bool shared_map(alloc_t *a, size_t size) {
    size_t len = size ? size : 1;
    int fd = memfd_create("cudasim-device", MFD_CLOEXEC);
    if (fd < 0) return false;
    void *m = ftruncate(fd, (off_t)len)
                  ? MAP_FAILED
                  : mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return false;
    }
    a->p = m;
    a->fd = fd;
    a->maplen = len;
    return true;
}

static void shared_unmap(alloc_t *a) {
    munmap(a->p, a->maplen);
    if (!a->imported) close(a->fd);
}

cudaError_t cudaMalloc(void **p, size_t size) {
    ENTER("cudaMalloc", NULL);
    alloc_t *a = calloc(1, sizeof(*a));
    if (!p || !a) {
        free(a);
        LEAVE(p ? cudaErrorMemoryAllocation : cudaErrorInvalidValue);
    }
    if (!shared_map(a, size)) {
        free(a);
        LEAVE(cudaErrorMemoryAllocation);
    }
    /* Fresh device memory holds garbage, not zeros. */
    memset(a->p, 0xA5, size);
    a->len = size;
    a->device = cur_dev;
    a->uid = ++next_uid;
    a->next = allocs;
    allocs = a;
    *p = a->p;
    LEAVE(cudaSuccess);
}

static void forget(alloc_t *a) {
    for (alloc_t **pp = &allocs; *pp; pp = &(*pp)->next)
        if (*pp == a) {
            *pp = a->next;
            break;
        }
    for (alloc_t *o = allocs; o; o = o->next)
        if (o->tail == a) o->tail = NULL;
}

cudaError_t cudaFree(void *p) {
    ENTER("cudaFree", NULL);
    if (!p) LEAVE(cudaSuccess);
    for (alloc_t *a = allocs; a; a = a->next)
        if (a->p == p && !a->imported) {
            forget(a);
            if (a->tail) {
                forget(a->tail);
                free(a->tail);
            }
            if (!a->borrowed) shared_unmap(a);
            free(a);
            LEAVE(cudaSuccess);
        }
    LEAVE(cudaErrorInvalidValue);
}

void cudasim_split(void *p, size_t at) {
    pthread_mutex_lock(&mu);
    alloc_t *a = find_alloc(allocs, p, 1), *b = calloc(1, sizeof(*b));
    if (a && b && at > 0 && at < a->len && !a->tail) {
        *b = (alloc_t){.next = allocs,
                       .p = a->p + at,
                       .len = a->len - at,
                       .device = a->device,
                       .borrowed = true,
                       .fd = a->fd,
                       .off = a->off + at,
                       .uid = ++next_uid};
        allocs = b;
        a->len = at;
        a->tail = b;
    } else {
        free(b);
    }
    pthread_mutex_unlock(&mu);
}

/* cuPointerGetAttribute as the driver answers for the two range attributes
 * (CU_POINTER_ATTRIBUTE_RANGE_START_ADDR 11, RANGE_SIZE 12). */
static int sim_cu_pointer_get_attribute(void *data, int attr, unsigned long long ptr) {
    pthread_mutex_lock(&mu);
    alloc_t *a = find_alloc(allocs, (const void *)(uintptr_t)ptr, 1);
    int r = 1; /* CUDA_ERROR_INVALID_VALUE */
    if (a && attr == 11) {
        *(unsigned long long *)data = (unsigned long long)(uintptr_t)a->p;
        r = 0;
    } else if (a && attr == 12) {
        *(size_t *)data = a->len;
        r = 0;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                             unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status) {
    (void)version;
    (void)flags;
    ENTER("cudaGetDriverEntryPointByVersion", NULL);
    if (!symbol || !fn) LEAVE(cudaErrorInvalidValue);
    bool found = !strcmp(symbol, "cuPointerGetAttribute");
    *fn = found ? (void *)sim_cu_pointer_get_attribute : cudasim_vmm_symbol(symbol);
    found = *fn != NULL;
    if (status) *status = found ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
    LEAVE(cudaSuccess);
}

cudaError_t cudaHostRegister(void *p, size_t size, unsigned int flags) {
    (void)flags;
    ENTER("cudaHostRegister", NULL);
    if (!p || !size || is_device_ptr(p) || find_alloc(pinned, p, 1)) LEAVE(cudaErrorInvalidValue);
    alloc_t *a = calloc(1, sizeof(*a));
    if (!a) LEAVE(cudaErrorMemoryAllocation);
    a->p = p;
    a->len = size;
    a->next = pinned;
    pinned = a;
    pinned_add(size);
    LEAVE(cudaSuccess);
}

cudaError_t cudaHostUnregister(void *p) {
    ENTER("cudaHostUnregister", NULL);
    for (alloc_t **pp = &pinned; *pp; pp = &(*pp)->next)
        if ((*pp)->p == p) {
            alloc_t *a = *pp;
            *pp = a->next;
            pinned_now -= a->len;
            free(a);
            LEAVE(cudaSuccess);
        }
    LEAVE(cudaErrorInvalidValue);
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *at, const void *p) {
    ENTER("cudaPointerGetAttributes", NULL);
    if (!at) LEAVE(cudaErrorInvalidValue);
    memset(at, 0, sizeof(*at));
    alloc_t *a = find_alloc(allocs, p, 1);
    if (a) {
        at->type = cudaMemoryTypeDevice;
        at->device = a->device;
        at->devicePointer = (void *)p;
    } else if (find_alloc(pinned, p, 1)) {
        at->type = cudaMemoryTypeHost;
        at->device = cur_dev;
        at->hostPointer = (void *)p;
        at->devicePointer = (void *)p;
    } else {
        at->type = cudaMemoryTypeUnregistered; /* CUDA 11+: success, unregistered */
        at->device = -2;
    }
    LEAVE(cudaSuccess);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *ps, unsigned int flags) {
    ENTER("cudaStreamCreateWithFlags", NULL);
    cudaStream_t s = calloc(1, sizeof(*s));
    if (!ps || !s) {
        free(s);
        LEAVE(cudaErrorInvalidValue);
    }
    s->device = cur_dev;
    s->blocking = !(flags & cudaStreamNonBlocking);
    s->next_all = streams;
    streams = s;
    nstreams_live++;
    *ps = s;
    LEAVE(cudaSuccess);
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
    ENTER("cudaStreamDestroy", NULL);
    if (!s || s == cudaStreamLegacy || s == cudaStreamPerThread)
        LEAVE(cudaErrorInvalidResourceHandle);
    for (cudaStream_t *pp = &streams; *pp; pp = &(*pp)->next_all)
        if (*pp == s) {
            /* CUDA lets queued work finish after the destroy call. */
            drain(s);
            *pp = s->next_all;
            free(s);
            nstreams_live--;
            LEAVE(cudaSuccess);
        }
    LEAVE(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    ENTER("cudaStreamSynchronize", NULL);
    if (!(s = resolve(s))) LEAVE(cudaErrorMemoryAllocation);
    drain(s);
    LEAVE(take_async(s));
}

cudaError_t cudaDeviceSynchronize(void) {
    ENTER("cudaDeviceSynchronize", NULL);
    cudaError_t e = cudaSuccess, e2;
    for (cudaStream_t s = streams; s; s = s->next_all)
        if (s->device == cur_dev) {
            drain(s);
            if ((e2 = take_async(s)) != cudaSuccess) e = e2;
        }
    drain(&default_streams[cur_dev]);
    if ((e2 = take_async(&default_streams[cur_dev])) != cudaSuccess) e = e2;
    LEAVE(e);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t ev, unsigned int flags) {
    ENTER("cudaStreamWaitEvent", NULL);
    if (!ev || flags) LEAVE(cudaErrorInvalidValue);
    if (!(s = resolve(s))) LEAVE(cudaErrorMemoryAllocation);
    if (ev->gen == 0 || ev->done_gen >= ev->gen) LEAVE(cudaSuccess); /* nothing to wait for */
    op_t *o = calloc(1, sizeof(*o));
    if (!o) LEAVE(cudaErrorMemoryAllocation);
    o->kind = OP_WAIT;
    o->ev = ev;
    o->gen = ev->gen;
    o->wstream = ev->stream;
    enqueue(s, o);
    LEAVE(cudaSuccess);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *pe, unsigned int flags) {
    (void)flags;
    ENTER("cudaEventCreateWithFlags", NULL);
    cudaEvent_t ev = calloc(1, sizeof(*ev));
    if (!pe || !ev) {
        free(ev);
        LEAVE(cudaErrorInvalidValue);
    }
    ev->device = cur_dev;
    *pe = ev;
    LEAVE(cudaSuccess);
}

cudaError_t cudaEventDestroy(cudaEvent_t ev) {
    ENTER("cudaEventDestroy", NULL);
    if (!ev) LEAVE(cudaErrorInvalidResourceHandle);
    /* Ops still referring to it must run first (CUDA defers the release). */
    if (ev->done_gen < ev->gen && ev->stream) drain(ev->stream);
    for (cudaStream_t s = streams; s; s = s->next_all)
        for (op_t *o = s->head; o; o = o->next)
            if (o->ev == ev) {
                drain(s); /* frees o */
                break;
            }
    free(ev);
    LEAVE(cudaSuccess);
}

cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t s) {
    ENTER("cudaEventRecord", NULL);
    if (!ev) LEAVE(cudaErrorInvalidResourceHandle);
    if (!(s = resolve(s))) LEAVE(cudaErrorMemoryAllocation);
    if (s->device != ev->device) LEAVE(cudaErrorInvalidResourceHandle); /* same device rule */
    op_t *o = calloc(1, sizeof(*o));
    if (!o) LEAVE(cudaErrorMemoryAllocation);
    o->kind = OP_RECORD;
    o->ev = ev;
    o->gen = ++ev->gen;
    ev->stream = s;
    enqueue(s, o);
    LEAVE(cudaSuccess);
}

cudaError_t cudaEventQuery(cudaEvent_t ev) {
    ENTER("cudaEventQuery", NULL);
    if (!ev) LEAVE(cudaErrorInvalidResourceHandle);
    if (ev->done_gen < ev->gen && !engine_on) run_one(ev->stream, 0); /* lazy: one op runs */
    LEAVE(ev->done_gen >= ev->gen ? ev->err : cudaErrorNotReady);
}

cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
    ENTER("cudaEventSynchronize", NULL);
    if (!ev) LEAVE(cudaErrorInvalidResourceHandle);
    while (ev->done_gen < ev->gen && (engine_on ? pthread_cond_wait(&cv, &mu) == 0
                                                 : run_one(ev->stream, 0)))
        ;
    LEAVE(cudaSuccess);
}

/* Checks one side of a copy: device memory of the stream's device, entirely
 * inside one allocation, or host memory. */
static bool side_ok(const void *p, size_t len, bool device, int dev) {
    alloc_t *a = find_alloc(allocs, p, 1);
    if (!device) return a == NULL;
    return a && a->device == dev && find_alloc(allocs, p, len) == a;
}

static cudaError_t copy_check(void *dst, const void *src, size_t dlen, size_t slen,
                              enum cudaMemcpyKind kind, cudaStream_t s) {
    bool dd, sd;
    switch (kind) {
    case cudaMemcpyHostToDevice:
        dd = true, sd = false;
        break;
    case cudaMemcpyDeviceToHost:
        dd = false, sd = true;
        break;
    case cudaMemcpyDeviceToDevice:
        dd = sd = true;
        break;
    case cudaMemcpyDefault:
        dd = is_device_ptr(dst), sd = is_device_ptr(src);
        break;
    default:
        return cudaErrorInvalidValue;
    }
    if (!dst || !src || !side_ok(dst, dlen, dd, s->device) || !side_ok(src, slen, sd, s->device))
        return cudaErrorInvalidValue;
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
    cudaError_t af;
    ENTER("cudaMemcpyAsync", &af);
    cudaStream_t s = resolve(stream);
    if (!s) LEAVE(cudaErrorMemoryAllocation);
    cudaError_t e = copy_check(dst, src, count, count, kind, s);
    if (e != cudaSuccess) LEAVE(e);
    op_t *o = calloc(1, sizeof(*o));
    if (!o) LEAVE(cudaErrorMemoryAllocation);
    o->kind = OP_COPY;
    o->dst = dst;
    o->src = src;
    o->width = count;
    o->fail = af;
    enqueue(s, o);
    LEAVE(cudaSuccess);
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, enum cudaMemcpyKind kind,
                              cudaStream_t stream) {
    cudaError_t af;
    ENTER("cudaMemcpy2DAsync", &af);
    cudaStream_t s = resolve(stream);
    if (!s) LEAVE(cudaErrorMemoryAllocation);
    if (width > dpitch || width > spitch) LEAVE(cudaErrorInvalidValue);
    size_t dlen = height ? (height - 1) * dpitch + width : 0;
    size_t slen = height ? (height - 1) * spitch + width : 0;
    cudaError_t e = copy_check(dst, src, dlen, slen, kind, s);
    if (e != cudaSuccess) LEAVE(e);
    op_t *o = calloc(1, sizeof(*o));
    if (!o) LEAVE(cudaErrorMemoryAllocation);
    o->kind = OP_COPY2D;
    o->dst = dst;
    o->src = src;
    o->dpitch = dpitch;
    o->spitch = spitch;
    o->width = width;
    o->height = height;
    o->fail = af;
    enqueue(s, o);
    LEAVE(cudaSuccess);
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *arg) {
    ENTER("cudaLaunchHostFunc", NULL);
    if (!fn) LEAVE(cudaErrorInvalidValue);
    op_t *o = calloc(1, sizeof(*o));
    if (!o) LEAVE(cudaErrorMemoryAllocation);
    o->kind = OP_HOSTFN;
    o->fn = fn;
    o->arg = arg;
    cudaStream_t s = resolve(stream);
    if (!s) {
        free(o);
        LEAVE(cudaErrorMemoryAllocation);
    }
    enqueue(s, o);
    LEAVE(cudaSuccess);
}

cudaError_t cudaMallocHost(void **p, size_t size) {
    ENTER("cudaMallocHost", NULL);
    alloc_t *a = calloc(1, sizeof(*a));
    if (!p || !a || !(a->p = malloc(size ? size : 1))) {
        free(a);
        LEAVE(p ? cudaErrorMemoryAllocation : cudaErrorInvalidValue);
    }
    a->len = size;
    a->next = pinned;
    pinned = a;
    pinned_add(size);
    *p = a->p;
    LEAVE(cudaSuccess);
}

cudaError_t cudaFreeHost(void *p) {
    ENTER("cudaFreeHost", NULL);
    for (alloc_t **pp = &pinned; *pp; pp = &(*pp)->next)
        if ((*pp)->p == p) {
            alloc_t *a = *pp;
            *pp = a->next;
            pinned_now -= a->len;
            free(a->p);
            free(a);
            LEAVE(cudaSuccess);
        }
    LEAVE(cudaErrorInvalidValue);
}

/* Synchronous: the legacy default stream of the current device runs first,
 * then the copy. */
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
    ENTER("cudaMemcpy", NULL);
    cudaStream_t s = &default_streams[cur_dev];
    cudaError_t e = copy_check(dst, src, count, count, kind, s);
    if (e != cudaSuccess) LEAVE(e);
    implicit_order(s);
    drain(s);
    memmove(dst, src, count);
    LEAVE(take_async(s));
}

/* Queued on the legacy default stream, like an asynchronous kernel. */
cudaError_t cudaMemset(void *p, int value, size_t count) {
    ENTER("cudaMemset", NULL);
    cudaStream_t s = &default_streams[cur_dev];
    if (!side_ok(p, count, true, s->device)) LEAVE(cudaErrorInvalidValue);
    op_t *o = calloc(1, sizeof(*o));
    if (!o) LEAVE(cudaErrorMemoryAllocation);
    o->kind = OP_MEMSET;
    o->dst = p;
    o->dpitch = (size_t)(unsigned char)value;
    o->width = count;
    enqueue(s, o);
    LEAVE(cudaSuccess);
}

/* ---------------------------------------------- for cudasim_ipc.c -- */

cudaError_t cudasim_enter_locked(const char *fn) {
    pthread_mutex_lock(&mu);
    cudaError_t e = enter(fn, NULL);
    if (e != cudaSuccess) {
        pthread_mutex_unlock(&mu);
        return set_err(e);
    }
    return cudaSuccess;
}

cudaError_t cudasim_leave_locked(cudaError_t e) {
    pthread_mutex_unlock(&mu);
    return set_err(e);
}

int cudasim_current_device(void) {
    return cur_dev;
}

bool cudasim_export(const void *p, cudasim_export_t *x) {
    alloc_t *a = find_alloc(allocs, p, 1);
    if (!a || a->p != p || a->imported) return false;
    *x = (cudasim_export_t){a->fd, a->device, a->off, a->len, a->uid};
    return true;
}

void *cudasim_import_find(int pid, uint64_t uid, int device) {
    for (alloc_t *a = allocs; a; a = a->next)
        if (a->imported && a->pid == pid && a->uid == uid && a->device == device) {
            a->refs++;
            return a->p;
        }
    return NULL;
}

bool cudasim_import_add(void *map, size_t maplen, size_t lead, size_t len, int pid, uint64_t uid) {
    alloc_t *a = calloc(1, sizeof(*a));
    if (!a) return false;
    *a = (alloc_t){.next = allocs,
                   .p = (uint8_t *)map + lead,
                   .len = len,
                   .device = cur_dev, /* mapped into the current device's address space */
                   .fd = -1,
                   .off = lead,
                   .maplen = maplen,
                   .imported = true,
                   .pid = pid,
                   .refs = 1,
                   .uid = uid};
    allocs = a;
    return true;
}

int cudasim_import_drop(void *p) {
    for (alloc_t *a = allocs; a; a = a->next)
        if (a->imported && a->pid != -1 && a->p == p) {
            if (--a->refs > 0) return 0;
            forget(a);
            munmap(a->p - a->off, a->maplen);
            free(a);
            return 0;
        }
    return -1;
}

bool cudasim_devmem_add(void *p, size_t len, int device) {
    alloc_t *a = calloc(1, sizeof(*a));
    if (!a) return false;
    *a = (alloc_t){.next = allocs,
                   .p = p,
                   .len = len,
                   .device = device,
                   .fd = -1,
                   .imported = true, /* never cudaFree'd */
                   .pid = -1};       /* no IPC mapping: refs 0 */
    allocs = a;
    return true;
}

void cudasim_devmem_drop(void *p) {
    for (alloc_t *a = allocs; a; a = a->next)
        if (a->imported && a->pid == -1 && a->p == p) {
            forget(a);
            free(a);
            return;
        }
}

int cudasim_ipc_open_count(void) {
    int n = 0;
    pthread_mutex_lock(&mu);
    for (alloc_t *a = allocs; a; a = a->next)
        n += a->imported ? a->refs : 0;
    pthread_mutex_unlock(&mu);
    return n;
}
