/* CUDA side of libkvconnector: per-device streams for the staged copies
 * between device regions and their pinned host mirrors, ordering against the
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
#include "kvc_int.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEVICES 64

typedef struct {
    int device;
    cudaStream_t stream; /* non-blocking: ordered only by the events we wait on */
    cudaEvent_t done;    /* recorded after queued work when no host sync is done */
    cudaEvent_t user;    /* records the caller's stream (single-device agents) */
    bool queued;         /* work queued since the last sync or record */
    bool recorded;       /* `done` recorded, maybe not complete yet */
} cdev_t;

struct kvc_cuda {
    cdev_t devs[MAX_DEVICES];
    int ndev;
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
    if (end.type != at.type || end.device != at.device) {
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

kvc_status_t kvc_cuda_wait_for(kvc_cuda_t *c, void *event, void *stream) {
    cudaEvent_t ev = event;
    cudaError_t ce;
    if (!ev && stream) {
        /* An event must be recorded on its own device's stream: with one
         * device that is the device of the regions. */
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
        ce = cudaEventRecord(c->devs[0].user, (cudaStream_t)stream);
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
        d->queued = true;
    }
    return dev_leave(c, saved, st);
}

kvc_status_t kvc_cuda_sync(kvc_cuda_t *c) {
    kvc_status_t first = KVC_OK;
    for (int i = 0; i < c->ndev; i++) {
        cdev_t *d = &c->devs[i];
        if (!d->queued) continue;
        /* Every device is synchronised even after one failed: nothing may
         * stay queued behind a reported failure. */
        cudaError_t ce = cudaStreamSynchronize(d->stream);
        d->queued = false;
        if (ce != cudaSuccess) {
            kvc_status_t st = cfail(c, ce, "cudaStreamSynchronize");
            if (first == KVC_OK) first = st;
        }
    }
    return first;
}

kvc_status_t kvc_cuda_order_before(kvc_cuda_t *c, void *stream) {
    for (int i = 0; i < c->ndev; i++) {
        cdev_t *d = &c->devs[i];
        if (!d->queued) continue;
        cudaError_t ce = cudaEventRecord(d->done, d->stream);
        if (ce != cudaSuccess) return cfail(c, ce, "cudaEventRecord");
        d->queued = false;
        d->recorded = true;
        if ((ce = cudaStreamWaitEvent((cudaStream_t)stream, d->done, 0)) != cudaSuccess)
            return cfail(c, ce, "cudaStreamWaitEvent on the caller's stream");
    }
    return KVC_OK;
}

bool kvc_cuda_idle(kvc_cuda_t *c, kvc_status_t *st) {
    *st = KVC_OK;
    for (int i = 0; i < c->ndev; i++) {
        cdev_t *d = &c->devs[i];
        if (d->queued) return false;
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
        if (!d->queued && !d->recorded) continue;
        cudaError_t ce = cudaStreamSynchronize(d->stream);
        if (ce != cudaSuccess) cfail(c, ce, "cudaStreamSynchronize");
        d->queued = d->recorded = false;
    }
}

int kvc_cuda_devices(const kvc_cuda_t *c) {
    return c ? c->ndev : 0;
}

void kvc_cuda_destroy(kvc_cuda_t *c) {
    if (!c) return;
    kvc_cuda_drain(c);
    for (int i = 0; i < c->ndev; i++) {
        cudaEventDestroy(c->devs[i].user);
        cudaEventDestroy(c->devs[i].done);
        cudaStreamDestroy(c->devs[i].stream);
    }
    (void)cudaGetLastError();
    free(c);
}
