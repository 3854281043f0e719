/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA side of libkvconnector: per-device streams for the staged copies
 * between device regions and the pinned staging pool, ordering against the
 * engine's stream or event, and the device of each region.
 *
 * Rules every function here keeps:
 *  - the caller's current device is restored on every path (the engine's
 *    thread must not find another device current after a kvc_ call);
 *  - every CUDA call is checked; after a failure cudaGetLastError() clears
 *    the error, so that it does not surface later inside the engine, and
 *    the CUDA error name goes into the message (kvc_cuda_last_error);
 *  - copies are queued on the stream of the device that owns the memory,
 *    never on the current device's. */
#include "connector/kvc_int.h"
#include "connector/kvc_vmm.h"

#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_DEVICES 64
#define SPARE_EVENTS 4 /* per device: CUDA IPC fetches' events, kept for the next fetches */

typedef struct {
    int device;
    cudaStream_t stream; /* non-blocking: ordered only by the events we wait on */
    cudaEvent_t done;    /* recorded after queued work when no host sync is done */
    cudaEvent_t user;    /* records the caller's stream (single-device agents) */
    bool queued;         /* work queued since the last sync or record */
    bool copies;         /* of which copies (a wait alone reads no staging memory) */
    bool recorded;       /* `done` recorded, maybe not complete yet */
    bool slot_copies;    /* staging-pool copies queued (stage.c polls their events) */
    bool ipc_copies;     /* CUDA IPC copies queued (ipc.c polls their events) */
    cudaEvent_t spare[SPARE_EVENTS]; /* events of this device handed back, for reuse */
    int nspare;
} cdev_t;

/* A publication's capture: one event per device, recorded on its stream
 * after the wait for the engine's writes (kvc_cuda_capture). */
struct kvc_cuda_cap {
    kvc_cuda_cap_t *next; /* spare list */
    kvc_cuda_t *c;
    int n;
    cudaEvent_t ev[MAX_DEVICES];
};

struct kvc_cuda {
    cdev_t devs[MAX_DEVICES];
    int ndev;
    kvc_cuda_cap_t *cap_spare; /* captures handed back, their events kept */
    char err[320];
};

bool kvc_cuda_built(void) {
    return true;
}

const char *kvc_cuda_last_error(const kvc_cuda_t *c) {
    return c && c->err[0] ? c->err : "no CUDA error";
}

/* Records a failed call: clears CUDA's last error, keeps its name. */
static kvc_status_t cfail(kvc_cuda_t *c, cudaError_t ce, const char *what) {
    (void)cudaGetLastError();
    if (c)
        snprintf(c->err, sizeof(c->err), "%s: %s (%s)", what, cudaGetErrorName(ce),
                 cudaGetErrorString(ce));
    switch (ce) {
    case cudaErrorMemoryAllocation:
        return KVC_ERR_NO_MEMORY;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
        return KVC_ERR_NO_DEVICE;
    default:
        return KVC_ERR_CUDA;
    }
}

/* Makes `dev` current, remembering the caller's device in *saved. */
static kvc_status_t dev_enter(kvc_cuda_t *c, int dev, int *saved) {
    cudaError_t ce = cudaGetDevice(saved);
    if (ce != cudaSuccess) return cfail(c, ce, "cudaGetDevice");
    if (*saved != dev && (ce = cudaSetDevice(dev)) != cudaSuccess) {
        kvc_status_t st = cfail(c, ce, "cudaSetDevice");
        cudaSetDevice(*saved);
        (void)cudaGetLastError();
        return st;
    }
    return KVC_OK;
}

/* Makes the caller's device current again; a failure to do so is reported
 * unless an earlier failure (st) is. */
static kvc_status_t dev_leave(kvc_cuda_t *c, int saved, kvc_status_t st) {
    cudaError_t ce = cudaSetDevice(saved);
    if (ce == cudaSuccess) return st;
    if (st != KVC_OK) {
        (void)cudaGetLastError();
        return st;
    }
    return cfail(c, ce, "cudaSetDevice (restoring the caller's device)");
}

kvc_status_t kvc_cuda_dev_enter(kvc_cuda_t *c, int dev, int *saved) {
    return dev_enter(c, dev, saved);
}

kvc_status_t kvc_cuda_dev_leave(kvc_cuda_t *c, int saved, kvc_status_t st) {
    return dev_leave(c, saved, st);
}

kvc_status_t kvc_cuda_set_error(kvc_cuda_t *c, kvc_status_t st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (c) vsnprintf(c->err, sizeof(c->err), fmt, ap);
    va_end(ap);
    return st;
}

kvc_status_t kvc_cuda_create(kvc_cuda_t **out, char *err, size_t errlen) {
    int n = 0;
    cudaError_t ce = cudaGetDeviceCount(&n);
    /* No driver (error 35) or any other error: there is no usable device. */
    if (ce != cudaSuccess || n <= 0) {
        (void)cudaGetLastError();
        snprintf(err, errlen, "no usable CUDA device (%s, count %d)",
                 ce == cudaSuccess ? "cudaSuccess" : cudaGetErrorName(ce), n);
        return KVC_ERR_NO_DEVICE;
    }
    kvc_cuda_t *c = calloc(1, sizeof(*c));
    if (!c) return KVC_ERR_NO_MEMORY;
    *out = c;
    return KVC_OK;
}

static cdev_t *find_dev(kvc_cuda_t *c, int dev) {
    for (int i = 0; i < c->ndev; i++)
        if (c->devs[i].device == dev) return &c->devs[i];
    return NULL;
}

static kvc_status_t add_dev(kvc_cuda_t *c, int dev) {
    if (find_dev(c, dev)) return KVC_OK;
    if (c->ndev == MAX_DEVICES) {
        snprintf(c->err, sizeof(c->err), "more than %d CUDA devices", MAX_DEVICES);
        return KVC_ERR_INVALID_PARAM;
    }
    int saved;
    kvc_status_t st = dev_enter(c, dev, &saved);
    if (st != KVC_OK) return st;
    cdev_t d = {.device = dev};
    cudaError_t ce = cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking);
    if (ce != cudaSuccess) {
        st = cfail(c, ce, "cudaStreamCreateWithFlags");
        goto out;
    }
    if ((ce = cudaEventCreateWithFlags(&d.done, cudaEventDisableTiming)) != cudaSuccess) {
        st = cfail(c, ce, "cudaEventCreateWithFlags");
        goto err_stream;
    }
    if ((ce = cudaEventCreateWithFlags(&d.user, cudaEventDisableTiming)) != cudaSuccess) {
        st = cfail(c, ce, "cudaEventCreateWithFlags");
        goto err_done;
    }
    c->devs[c->ndev++] = d;
    goto out;

err_done:
    cudaEventDestroy(d.done);
err_stream:
    cudaStreamDestroy(d.stream);
    (void)cudaGetLastError();
out:
    return dev_leave(c, saved, st);
}

/* The driver's cuPointerGetAttribute, reached through the runtime so that
 * libkvconnector does not link libcuda; NULL when the driver lacks it.  The
 * attribute values and the signature are the driver API's (cuda.h). */
typedef int (*cu_ptr_attr_fn)(void *data, int attribute, unsigned long long ptr);
#define CU_PTR_RANGE_START 11 /* CU_POINTER_ATTRIBUTE_RANGE_START_ADDR */
#define CU_PTR_RANGE_SIZE 12  /* CU_POINTER_ATTRIBUTE_RANGE_SIZE */

static cu_ptr_attr_fn ptr_attr_fn(void) {
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t ce = cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &fn, 12000,
                                                      cudaEnableDefault, &q);
    if (ce != cudaSuccess || q != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return (cu_ptr_attr_fn)fn;
}

/* [base, base+len) inside the one allocation that holds base (the driver's
 * address range of base).  Without the driver function: true (the two-end
 * check of the caller stands alone).  For VMM memory (cuMemCreate, cuMemMap)
 * the range is the whole reservation (cuMemAddressReserve), so a region
 * may span several physical allocations mapped one after the other, as
 * PyTorch's expandable segments map them; the CUDA IPC export walks the
 * mappings themselves (cuda_vmm.c). */
static bool one_allocation(const void *base, size_t len) {
    cu_ptr_attr_fn fn = ptr_attr_fn();
    if (!fn) return true;
    unsigned long long start = 0;
    size_t size = 0;
    unsigned long long p = (unsigned long long)(uintptr_t)base;
    if (fn(&start, CU_PTR_RANGE_START, p) != 0 || fn(&size, CU_PTR_RANGE_SIZE, p) != 0)
        return false;
    return p >= start && p - start <= size && len <= size - (p - start);
}

kvc_status_t kvc_cuda_region_device(kvc_cuda_t *c, const void *base, size_t len, int hint,
                                    int *dev) {
    struct cudaPointerAttributes at, end;
    memset(&at, 0, sizeof(at));
    memset(&end, 0, sizeof(end));
    cudaError_t ce = cudaPointerGetAttributes(&at, base);
    if (ce != cudaSuccess) return cfail(c, ce, "cudaPointerGetAttributes");
    if (at.type != cudaMemoryTypeDevice && at.type != cudaMemoryTypeManaged) {
        snprintf(c->err, sizeof(c->err), "region at %p is not CUDA device memory (type %d)", base,
                 (int)at.type);
        return KVC_ERR_INVALID_PARAM;
    }
    ce = cudaPointerGetAttributes(&end, (const char *)base + len - 1);
    if (ce != cudaSuccess) return cfail(c, ce, "cudaPointerGetAttributes");
    if (end.type != at.type || end.device != at.device || !one_allocation(base, len)) {
        snprintf(c->err, sizeof(c->err),
                 "region at %p (%zu bytes) does not lie in one allocation of device %d", base, len,
                 at.device);
        return KVC_ERR_INVALID_PARAM;
    }
    if (hint >= 0 && hint != at.device) {
        snprintf(c->err, sizeof(c->err), "cuda_device %d, but the region's memory is on device %d",
                 hint, at.device);
        return KVC_ERR_INVALID_PARAM;
    }
    kvc_status_t st = add_dev(c, at.device);
    if (st == KVC_OK) *dev = at.device;
    return st;
}

kvc_status_t kvc_cuda_host_register(kvc_cuda_t *c, void *p, size_t len) {
    cudaError_t ce = cudaHostRegister(p, len, cudaHostRegisterPortable);
    return ce == cudaSuccess ? KVC_OK : cfail(c, ce, "cudaHostRegister");
}

void kvc_cuda_host_unregister(kvc_cuda_t *c, void *p) {
    cudaError_t ce = cudaHostUnregister(p);
    if (ce != cudaSuccess) cfail(c, ce, "cudaHostUnregister");
}

/* The default-stream handles name a stream relative to the caller: 0 and
 * cudaStreamLegacy the legacy default stream of the current device,
 * cudaStreamPerThread the calling thread's default stream on it.  0 is sent
 * as cudaStreamLegacy, which means the same whichever default-stream mode the
 * engine was compiled with (the legacy stream is ordered with per-thread
 * ones). */
static cudaStream_t engine_stream(void *stream) {
    return stream ? (cudaStream_t)stream : cudaStreamLegacy;
}

static bool default_stream(void *stream) {
    return !stream || (cudaStream_t)stream == cudaStreamLegacy ||
           (cudaStream_t)stream == cudaStreamPerThread;
}

kvc_status_t kvc_cuda_wait_for(kvc_cuda_t *c, void *event, bool has_stream, void *stream) {
    cudaEvent_t ev = event;
    cudaError_t ce;
    if (!ev && has_stream) {
        /* An event must be recorded on its own device's stream: with one
         * device that is the device of the regions, which is also the device
         * a default-stream handle is taken on. */
        if (c->ndev != 1) {
            snprintf(c->err, sizeof(c->err),
                     "a CUDA stream to wait on needs regions on one device (%d devices): pass an "
                     "event instead",
                     c->ndev);
            return KVC_ERR_INVALID_PARAM;
        }
        int saved;
        kvc_status_t st = dev_enter(c, c->devs[0].device, &saved);
        if (st != KVC_OK) return st;
        ce = cudaEventRecord(c->devs[0].user, engine_stream(stream));
        if (ce != cudaSuccess) st = cfail(c, ce, "cudaEventRecord on the caller's stream");
        if ((st = dev_leave(c, saved, st)) != KVC_OK) return st;
        ev = c->devs[0].user;
    }
    if (!ev) return KVC_OK;
    for (int i = 0; i < c->ndev; i++) {
        ce = cudaStreamWaitEvent(c->devs[i].stream, ev, 0);
        if (ce != cudaSuccess) return cfail(c, ce, "cudaStreamWaitEvent");
        c->devs[i].queued = true;
    }
    return KVC_OK;
}

kvc_status_t kvc_cuda_copy_runs(kvc_cuda_t *c, int dev, void *dev_base, void *host_base,
                                size_t block_len, const kvc_crun_t *runs, size_t nruns,
                                bool to_device) {
    cdev_t *d = find_dev(c, dev);
    if (!d) {
        snprintf(c->err, sizeof(c->err), "CUDA device %d has no stream", dev);
        return KVC_ERR_STATE;
    }
    if (nruns == 0) return KVC_OK;
    int saved;
    kvc_status_t st = dev_enter(c, dev, &saved);
    if (st != KVC_OK) return st;
    enum cudaMemcpyKind kind = to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
    for (size_t i = 0; i < nruns; i++) {
        const kvc_crun_t *r = &runs[i];
        size_t off = (size_t)r->start * block_len, width = (size_t)r->len * block_len;
        char *dp = (char *)dev_base + off, *hp = (char *)host_base + off;
        void *dst = to_device ? (void *)dp : (void *)hp;
        const void *src = to_device ? (const void *)hp : (const void *)dp;
        cudaError_t ce;
        if (r->count == 1) {
            ce = cudaMemcpyAsync(dst, src, width, kind, d->stream);
        } else {
            size_t pitch = (size_t)r->stride * block_len;
            ce = cudaMemcpy2DAsync(dst, pitch, src, pitch, width, r->count, kind, d->stream);
        }
        if (ce != cudaSuccess) {
            st = cfail(c, ce, r->count == 1 ? "cudaMemcpyAsync" : "cudaMemcpy2DAsync");
            break;
        }
        d->queued = d->copies = true;
    }
    return dev_leave(c, saved, st);
}

kvc_status_t kvc_cuda_copy_event(kvc_cuda_t *c, int dev, void *dst, const void *src, size_t len,
                                 bool to_device, void **ev, int *ev_dev) {
    cdev_t *d = find_dev(c, dev);
    if (!d) {
        snprintf(c->err, sizeof(c->err), "CUDA device %d has no stream", dev);
        return KVC_ERR_STATE;
    }
    int saved;
    kvc_status_t st = dev_enter(c, dev, &saved);
    if (st != KVC_OK) return st;
    cudaError_t ce;
    /* An event is recorded on a stream of its own device. */
    if (*ev && *ev_dev != dev) {
        cudaEventDestroy((cudaEvent_t)*ev);
        *ev = NULL;
    }
    if (!*ev) {
        cudaEvent_t e;
        if ((ce = cudaEventCreateWithFlags(&e, cudaEventDisableTiming)) != cudaSuccess) {
            st = cfail(c, ce, "cudaEventCreateWithFlags");
            return dev_leave(c, saved, st);
        }
        *ev = e;
        *ev_dev = dev;
    }
    ce = cudaMemcpyAsync(dst, src, len, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                         d->stream);
    if (ce != cudaSuccess) {
        st = cfail(c, ce, "cudaMemcpyAsync");
        return dev_leave(c, saved, st);
    }
    d->slot_copies = true;
    if ((ce = cudaEventRecord((cudaEvent_t)*ev, d->stream)) != cudaSuccess)
        st = cfail(c, ce, "cudaEventRecord");
    return dev_leave(c, saved, st);
}

int kvc_cuda_event_poll(kvc_cuda_t *c, void *ev, kvc_status_t *st) {
    cudaError_t ce = cudaEventQuery((cudaEvent_t)ev);
    if (ce == cudaErrorNotReady) return 0; /* not an error: nothing to clear */
    if (ce == cudaSuccess) return 1;
    *st = cfail(c, ce, "cudaEventQuery");
    return -1;
}

void kvc_cuda_event_destroy(kvc_cuda_t *c, void *ev) {
    cudaError_t ce = cudaEventDestroy((cudaEvent_t)ev);
    if (ce != cudaSuccess) cfail(c, ce, "cudaEventDestroy");
}

kvc_status_t kvc_cuda_sync(kvc_cuda_t *c) {
    kvc_status_t first = KVC_OK;
    for (int i = 0; i < c->ndev; i++) {
        cdev_t *d = &c->devs[i];
        if (!d->queued) continue;
        /* Every device is synchronised even after one failed: nothing may
         * stay queued behind a reported failure. */
        cudaError_t ce = cudaStreamSynchronize(d->stream);
        d->queued = d->copies = false;
        if (ce != cudaSuccess) {
            kvc_status_t st = cfail(c, ce, "cudaStreamSynchronize");
            if (first == KVC_OK) first = st;
        }
    }
    return first;
}

kvc_status_t kvc_cuda_order_before(kvc_cuda_t *c, void *stream) {
    /* cudaStreamPerThread names the stream of the thread that makes the
     * call, and this runs on whichever thread progresses the agent: the
     * copies are waited for on the host instead. */
    if ((cudaStream_t)stream == cudaStreamPerThread) return kvc_cuda_sync(c);
    for (int i = 0; i < c->ndev; i++) {
        cdev_t *d = &c->devs[i];
        if (!d->queued) continue;
        cudaError_t ce = cudaEventRecord(d->done, d->stream);
        if (ce != cudaSuccess) return cfail(c, ce, "cudaEventRecord");
        d->queued = d->copies = false;
        d->recorded = true;
        if (!default_stream(stream)) {
            if ((ce = cudaStreamWaitEvent((cudaStream_t)stream, d->done, 0)) != cudaSuccess)
                return cfail(c, ce, "cudaStreamWaitEvent on the caller's stream");
            continue;
        }
        /* The legacy default stream is per device: the one of every device
         * that holds regions waits (the engine's reads run on its own). */
        for (int k = 0; k < c->ndev; k++) {
            int saved;
            kvc_status_t st = dev_enter(c, c->devs[k].device, &saved);
            if (st != KVC_OK) return st;
            ce = cudaStreamWaitEvent(cudaStreamLegacy, d->done, 0);
            if (ce != cudaSuccess)
                st = cfail(c, ce, "cudaStreamWaitEvent on the legacy default stream");
            if ((st = dev_leave(c, saved, st)) != KVC_OK) return st;
        }
    }
    return KVC_OK;
}

bool kvc_cuda_idle(kvc_cuda_t *c, kvc_status_t *st) {
    *st = KVC_OK;
    for (int i = 0; i < c->ndev; i++) {
        cdev_t *d = &c->devs[i];
        if (d->copies) return false;
        if (!d->recorded) continue;
        cudaError_t ce = cudaEventQuery(d->done);
        if (ce == cudaErrorNotReady) return false; /* not an error: nothing to clear */
        d->recorded = false;
        if (ce != cudaSuccess) {
            *st = cfail(c, ce, "cudaEventQuery");
            return false;
        }
    }
    return true;
}

void kvc_cuda_drain(kvc_cuda_t *c) {
    if (!c) return;
    for (int i = 0; i < c->ndev; i++) {
        cdev_t *d = &c->devs[i];
        if (!d->queued && !d->recorded && !d->slot_copies && !d->ipc_copies) continue;
        cudaError_t ce = cudaStreamSynchronize(d->stream);
        if (ce != cudaSuccess) cfail(c, ce, "cudaStreamSynchronize");
        d->queued = d->copies = d->recorded = d->slot_copies = d->ipc_copies = false;
    }
}

int kvc_cuda_devices(const kvc_cuda_t *c) {
    return c ? c->ndev : 0;
}

void kvc_cuda_destroy(kvc_cuda_t *c) {
    if (!c) return;
    kvc_cuda_drain(c);
    while (c->cap_spare) {
        kvc_cuda_cap_t *k = c->cap_spare;
        c->cap_spare = k->next;
        for (int i = 0; i < MAX_DEVICES; i++)
            if (k->ev[i]) cudaEventDestroy(k->ev[i]);
        free(k);
    }
    for (int i = 0; i < c->ndev; i++) {
        while (c->devs[i].nspare)
            cudaEventDestroy(c->devs[i].spare[--c->devs[i].nspare]);
        cudaEventDestroy(c->devs[i].user);
        cudaEventDestroy(c->devs[i].done);
        cudaStreamDestroy(c->devs[i].stream);
    }
    (void)cudaGetLastError();
    free(c);
}

/* ------------------------------------------------------------- CUDA IPC -- */

kvc_status_t kvc_cuda_ipc_export(kvc_cuda_t *c, int dev, const void *p, size_t len,
                                 kvc_cuda_export_t *out) {
    memset(out, 0, sizeof(*out));
    /* cudaIpcGetMemHandle wants the base of the allocation: the driver's
     * address range of p gives it (the region may be a tensor inside a
     * larger block of the engine's caching allocator). */
    unsigned long long start = (unsigned long long)(uintptr_t)p;
    size_t size = len;
    cu_ptr_attr_fn fn = ptr_attr_fn();
    if (fn && (fn(&start, CU_PTR_RANGE_START, (unsigned long long)(uintptr_t)p) != 0 ||
               fn(&size, CU_PTR_RANGE_SIZE, (unsigned long long)(uintptr_t)p) != 0)) {
        snprintf(c->err, sizeof(c->err), "the driver has no address range for %p", p);
        return KVC_ERR_UNSUPPORTED;
    }
    int saved;
    kvc_status_t st = dev_enter(c, dev, &saved);
    if (st != KVC_OK) return st;
    cudaIpcMemHandle_t h;
    cudaError_t ce = cudaIpcGetMemHandle(&h, (void *)(uintptr_t)start);
    if (ce != cudaSuccess) {
        /* VMM (cuMemCreate) and stream-ordered pool memory have no legacy
         * IPC handle. */
        cfail(c, ce, "cudaIpcGetMemHandle of the region's allocation");
        st = KVC_ERR_UNSUPPORTED;
    } else if ((st = kvc_cuda_bus_id(c, dev, out->bus)) == KVC_OK) {
        memcpy(out->handle, &h, KVC_IPC_HANDLE_LEN < sizeof(h) ? KVC_IPC_HANDLE_LEN : sizeof(h));
        out->base = start;
        out->size = size;
    }
    return dev_leave(c, saved, st);
}

kvc_status_t kvc_cuda_bus_id(kvc_cuda_t *c, int dev, char bus[KVC_IPC_BUS_LEN]) {
    cudaError_t ce = cudaDeviceGetPCIBusId(bus, KVC_IPC_BUS_LEN, dev);
    return ce == cudaSuccess ? KVC_OK : cfail(c, ce, "cudaDeviceGetPCIBusId");
}

int kvc_cuda_device_by_bus(kvc_cuda_t *c, const char *bus) {
    int n = 0;
    cudaError_t ce = cudaGetDeviceCount(&n);
    if (ce != cudaSuccess) {
        cfail(c, ce, "cudaGetDeviceCount");
        return -1;
    }
    for (int d = 0; d < n && d < MAX_DEVICES; d++) {
        char id[KVC_IPC_BUS_LEN];
        if ((ce = cudaDeviceGetPCIBusId(id, (int)sizeof(id), d)) != cudaSuccess) {
            cfail(c, ce, "cudaDeviceGetPCIBusId");
            continue;
        }
        if (!strcasecmp(id, bus)) return d;
    }
    return -1;
}

kvc_status_t kvc_cuda_ipc_open(kvc_cuda_t *c, int dev, const uint8_t handle[KVC_IPC_HANDLE_LEN],
                               void **ptr) {
    int saved;
    kvc_status_t st = dev_enter(c, dev, &saved);
    if (st != KVC_OK) return st;
    cudaIpcMemHandle_t h;
    memset(&h, 0, sizeof(h));
    memcpy(&h, handle, KVC_IPC_HANDLE_LEN < sizeof(h) ? KVC_IPC_HANDLE_LEN : sizeof(h));
    void *p = NULL;
    cudaError_t ce = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (ce != cudaSuccess)
        st = cfail(c, ce, "cudaIpcOpenMemHandle");
    else
        *ptr = p;
    return dev_leave(c, saved, st);
}

void kvc_cuda_ipc_close(kvc_cuda_t *c, int dev, void *ptr) {
    int saved;
    if (dev_enter(c, dev, &saved) != KVC_OK) return;
    cudaError_t ce = cudaIpcCloseMemHandle(ptr);
    kvc_status_t st = ce == cudaSuccess ? KVC_OK : cfail(c, ce, "cudaIpcCloseMemHandle");
    dev_leave(c, saved, st);
}

/* dev's stream in *d, dev made current (the caller's device in *saved). */
static kvc_status_t stream_enter(kvc_cuda_t *c, int dev, cdev_t **d, int *saved) {
    if (!(*d = find_dev(c, dev))) {
        snprintf(c->err, sizeof(c->err), "CUDA device %d has no stream", dev);
        return KVC_ERR_STATE;
    }
    return dev_enter(c, dev, saved);
}

kvc_status_t kvc_cuda_d2d_runs(kvc_cuda_t *c, int dev, void *dst, const void *src, size_t block_len,
                               const kvc_run_t *runs, size_t n, void **ev) {
    cdev_t *d;
    int saved;
    kvc_status_t st = stream_enter(c, dev, &d, &saved);
    if (st != KVC_OK) return st;
    cudaError_t ce;
    for (size_t i = 0; i < n; i++) {
        ce = cudaMemcpyAsync((char *)dst + runs[i].local * block_len,
                             (const char *)src + runs[i].remote * block_len,
                             runs[i].count * block_len, cudaMemcpyDeviceToDevice, d->stream);
        if (ce != cudaSuccess) {
            st = cfail(c, ce, "cudaMemcpyAsync (CUDA IPC)");
            break;
        }
        d->ipc_copies = true;
    }
    if (st == KVC_OK && !*ev && d->nspare) {
        *ev = d->spare[--d->nspare];
    } else if (st == KVC_OK && !*ev) {
        cudaEvent_t e;
        if ((ce = cudaEventCreateWithFlags(&e, cudaEventDisableTiming)) != cudaSuccess)
            st = cfail(c, ce, "cudaEventCreateWithFlags");
        else
            *ev = e;
    }
    if (st == KVC_OK && (ce = cudaEventRecord((cudaEvent_t)*ev, d->stream)) != cudaSuccess)
        st = cfail(c, ce, "cudaEventRecord");
    return dev_leave(c, saved, st);
}

void kvc_cuda_event_put(kvc_cuda_t *c, int dev, void *ev) {
    cdev_t *d = find_dev(c, dev);
    if (d && d->nspare < SPARE_EVENTS)
        d->spare[d->nspare++] = ev;
    else
        kvc_cuda_event_destroy(c, ev);
}

/* -------------------------------------------------- publication capture -- */

kvc_status_t kvc_cuda_capture(kvc_cuda_t *c, kvc_cuda_cap_t **out) {
    kvc_cuda_cap_t *k = c->cap_spare;
    if (k)
        c->cap_spare = k->next;
    else if (!(k = calloc(1, sizeof(*k))))
        return KVC_ERR_NO_MEMORY;
    k->next = NULL;
    k->c = c;
    k->n = c->ndev;
    kvc_status_t st = KVC_OK;
    for (int i = 0; i < c->ndev && st == KVC_OK; i++) {
        int saved;
        if ((st = dev_enter(c, c->devs[i].device, &saved)) != KVC_OK) break;
        cudaError_t ce;
        if (!k->ev[i] &&
            (ce = cudaEventCreateWithFlags(&k->ev[i], cudaEventDisableTiming)) != cudaSuccess) {
            k->ev[i] = NULL;
            st = cfail(c, ce, "cudaEventCreateWithFlags");
        } else if ((ce = cudaEventRecord(k->ev[i], c->devs[i].stream)) != cudaSuccess) {
            st = cfail(c, ce, "cudaEventRecord");
        }
        st = dev_leave(c, saved, st);
    }
    if (st != KVC_OK) {
        kvc_cuda_capture_put(k);
        return st;
    }
    *out = k;
    return KVC_OK;
}

kvc_status_t kvc_cuda_capture_wait(kvc_cuda_cap_t *k, unsigned *syncs) {
    kvc_status_t first = KVC_OK;
    for (int i = 0; i < k->n; i++) {
        cudaError_t ce = cudaEventQuery(k->ev[i]);
        if (ce == cudaErrorNotReady) { /* the engine's writes still run: wait for them */
            (*syncs)++;
            ce = cudaEventSynchronize(k->ev[i]);
        }
        if (ce != cudaSuccess && first == KVC_OK)
            first = cfail(k->c, ce, "cudaEventSynchronize (the publication's capture)");
    }
    return first;
}

void kvc_cuda_capture_put(kvc_cuda_cap_t *k) {
    if (!k) return;
    k->next = k->c->cap_spare;
    k->c->cap_spare = k;
}
