/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA virtual memory management: memory an engine maps itself with
 * cuMemCreate / cuMemAddressReserve / cuMemMap / cuMemSetAccess (PyTorch's
 * expandable segments map 2 or 20 MiB physical allocations one after the
 * other into one reserved range; vLLM's sleep-mode CuMemAllocator maps one
 * per tensor).  cudaIpcGetMemHandle refuses such memory; its physical
 * allocations are exported one by one as POSIX fds instead
 * (cuMemExportToShareableHandle), when they were created with that handle
 * type allowed, and the consumer maps them again, in order, into one range
 * of its own (ipc.c, ipcfd.c).
 *
 * The driver functions come through cudaGetDriverEntryPointByVersion like
 * cuda.c's cuPointerGetAttribute: libkvconnector links the runtime only.
 * Their signatures are checked against cuda.h at compile time.  Every
 * function makes the device current first (the driver's calls need its
 * primary context on the calling thread, which may be the progress
 * thread) and restores the caller's device. */
#include "connector/kvc_int.h"
#include "connector/kvc_vmm.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef CUresult (*fn_range_t)(CUdeviceptr *, size_t *, CUdeviceptr);
typedef CUresult (*fn_reserve_t)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*fn_afree_t)(CUdeviceptr, size_t);
typedef CUresult (*fn_release_t)(CUmemGenericAllocationHandle);
typedef CUresult (*fn_map_t)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                             unsigned long long);
typedef CUresult (*fn_unmap_t)(CUdeviceptr, size_t);
typedef CUresult (*fn_access_t)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*fn_export_t)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                unsigned long long);
typedef CUresult (*fn_import_t)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
typedef CUresult (*fn_gran_t)(size_t *, const CUmemAllocationProp *,
                              CUmemAllocationGranularity_flags);
typedef CUresult (*fn_props_t)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
typedef CUresult (*fn_retain_t)(CUmemGenericAllocationHandle *, void *);

/* Not called by name (nothing links libcuda): only their types are used. */
#define SAME_TYPE(fn, t)                                                                           \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&fn), t), #fn " differs from cuda.h")
SAME_TYPE(cuMemGetAddressRange, fn_range_t);
SAME_TYPE(cuMemAddressReserve, fn_reserve_t);
SAME_TYPE(cuMemAddressFree, fn_afree_t);
SAME_TYPE(cuMemRelease, fn_release_t);
SAME_TYPE(cuMemMap, fn_map_t);
SAME_TYPE(cuMemUnmap, fn_unmap_t);
SAME_TYPE(cuMemSetAccess, fn_access_t);
SAME_TYPE(cuMemExportToShareableHandle, fn_export_t);
SAME_TYPE(cuMemImportFromShareableHandle, fn_import_t);
SAME_TYPE(cuMemGetAllocationGranularity, fn_gran_t);
SAME_TYPE(cuMemGetAllocationPropertiesFromHandle, fn_props_t);
SAME_TYPE(cuMemRetainAllocationHandle, fn_retain_t);
_Static_assert(sizeof(CUmemGenericAllocationHandle) <= sizeof(uint64_t), "handle size");

typedef struct {
    fn_range_t range;
    fn_reserve_t reserve;
    fn_afree_t afree;
    fn_release_t release;
    fn_map_t map;
    fn_unmap_t unmap;
    fn_access_t access;
    fn_export_t exp;
    fn_import_t imp;
    fn_gran_t gran;
    fn_props_t props;
    fn_retain_t retain;
} drv_t;

/* The driver's functions (as of CUDA 12.0's ABI); false with the message
 * set when one is missing (a driver older than the VMM API). */
static bool drv_load(kvc_cuda_t *c, drv_t *d) {
    static const struct {
        const char *name;
        size_t off;
    } syms[] = {
        {"cuMemGetAddressRange", offsetof(drv_t, range)},
        {"cuMemAddressReserve", offsetof(drv_t, reserve)},
        {"cuMemAddressFree", offsetof(drv_t, afree)},
        {"cuMemRelease", offsetof(drv_t, release)},
        {"cuMemMap", offsetof(drv_t, map)},
        {"cuMemUnmap", offsetof(drv_t, unmap)},
        {"cuMemSetAccess", offsetof(drv_t, access)},
        {"cuMemExportToShareableHandle", offsetof(drv_t, exp)},
        {"cuMemImportFromShareableHandle", offsetof(drv_t, imp)},
        {"cuMemGetAllocationGranularity", offsetof(drv_t, gran)},
        {"cuMemGetAllocationPropertiesFromHandle", offsetof(drv_t, props)},
        {"cuMemRetainAllocationHandle", offsetof(drv_t, retain)},
    };
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        void *fn = NULL;
        enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        cudaError_t ce =
            cudaGetDriverEntryPointByVersion(syms[i].name, &fn, 12000, cudaEnableDefault, &q);
        if (ce != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn) {
            (void)cudaGetLastError();
            kvc_cuda_set_error(c, KVC_ERR_UNSUPPORTED, "the CUDA driver has no %s", syms[i].name);
            return false;
        }
        memcpy((char *)d + syms[i].off, &fn, sizeof(fn));
    }
    return true;
}

static kvc_status_t dfail(kvc_cuda_t *c, CUresult r, const char *what) {
    kvc_status_t st = r == CUDA_ERROR_OUT_OF_MEMORY ? KVC_ERR_NO_MEMORY
                      : r == CUDA_ERROR_NOT_PERMITTED || r == CUDA_ERROR_NOT_SUPPORTED
                          ? KVC_ERR_UNSUPPORTED
                          : KVC_ERR_CUDA;
    return kvc_cuda_set_error(c, st, "%s: CUDA driver error %d", what, (int)r);
}

static CUdeviceptr dptr(const void *p) {
    return (CUdeviceptr)(uintptr_t)p;
}

/* The mapping that holds address q: [*base, *base + *size) maps the
 * allocation *h (retained) from its start.  cuMemGetAddressRange gives the
 * mapping's bounds; its last byte must belong to the same allocation (the
 * driver hands back the handle value that mapped it), or the bounds are not
 * one mapping's and nothing is claimed. */
static kvc_status_t one_piece(kvc_cuda_t *c, const drv_t *d, CUdeviceptr q, CUdeviceptr *base,
                              size_t *size, CUmemGenericAllocationHandle *h) {
    CUresult r = d->retain(h, (void *)(uintptr_t)q);
    if (r != CUDA_SUCCESS)
        return kvc_cuda_set_error(c, KVC_ERR_UNSUPPORTED,
                                  "%#llx is not VMM memory (cuMemRetainAllocationHandle: CUDA "
                                  "driver error %d)",
                                  (unsigned long long)q, (int)r);
    CUmemGenericAllocationHandle last = 0;
    kvc_status_t st = KVC_OK;
    if ((r = d->range(base, size, q)) != CUDA_SUCCESS) {
        st = dfail(c, r, "cuMemGetAddressRange");
    } else if (q < *base || q - *base >= *size) {
        st = kvc_cuda_set_error(c, KVC_ERR_UNSUPPORTED, "the driver's range of %#llx misses it",
                                (unsigned long long)q);
    } else if ((r = d->retain(&last, (void *)(uintptr_t)(*base + *size - 1))) != CUDA_SUCCESS) {
        st = dfail(c, r, "cuMemRetainAllocationHandle (end of mapping)");
    } else {
        d->release(last);
        if (last != *h)
            st = kvc_cuda_set_error(c, KVC_ERR_UNSUPPORTED,
                                    "the driver's range of %#llx (%zu bytes) is not one mapping",
                                    (unsigned long long)q, *size);
    }
    if (st != KVC_OK) d->release(*h);
    return st;
}

/* Whether allocation h may back a piece of a region on dev (and, need_fd,
 * be exported as a POSIX fd). */
static kvc_status_t piece_ok(kvc_cuda_t *c, const drv_t *d, CUmemGenericAllocationHandle h, int dev,
                             bool need_fd, CUdeviceptr base) {
    CUmemAllocationProp pr;
    memset(&pr, 0, sizeof(pr));
    CUresult r = d->props(&pr, h);
    if (r != CUDA_SUCCESS) return dfail(c, r, "cuMemGetAllocationPropertiesFromHandle");
    if (pr.location.type != CU_MEM_LOCATION_TYPE_DEVICE || pr.location.id != dev)
        return kvc_cuda_set_error(c, KVC_ERR_UNSUPPORTED,
                                  "the VMM allocation mapped at %#llx is not memory of device %d",
                                  (unsigned long long)base, dev);
    if (need_fd && !(pr.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return kvc_cuda_set_error(
            c, KVC_ERR_UNSUPPORTED,
            "the VMM allocation mapped at %#llx was created without "
            "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (requested handle types %#x): it cannot "
            "be passed to another process",
            (unsigned long long)base, (unsigned)pr.requestedHandleTypes);
    return KVC_OK;
}

kvc_status_t kvc_cuda_vmm_pieces(kvc_cuda_t *c, int dev, const void *p, size_t len, bool need_fd,
                                 kvc_vmm_piece_t **out, size_t *n) {
    drv_t d;
    if (!drv_load(c, &d)) return KVC_ERR_UNSUPPORTED;
    int saved;
    kvc_status_t st = kvc_cuda_dev_enter(c, dev, &saved);
    if (st != KVC_OK) return st;
    kvc_vmm_piece_t *pc = NULL;
    size_t k = 0, cap = 0;
    CUdeviceptr q = dptr(p), end = dptr(p) + len;
    while (st == KVC_OK && q < end) {
        CUdeviceptr base;
        size_t size;
        CUmemGenericAllocationHandle h;
        if ((st = one_piece(c, &d, q, &base, &size, &h)) != KVC_OK) break;
        if ((st = piece_ok(c, &d, h, dev, need_fd, base)) != KVC_OK) {
            d.release(h);
            break;
        }
        if (k == cap) {
            size_t ncap = cap ? 2 * cap : 8;
            kvc_vmm_piece_t *np =
                ncap <= KVC_IPC_MAX_PIECES ? realloc(pc, ncap * sizeof(*np)) : NULL;
            if (!np) {
                d.release(h);
                st = kvc_cuda_set_error(
                    c, ncap <= KVC_IPC_MAX_PIECES ? KVC_ERR_NO_MEMORY : KVC_ERR_UNSUPPORTED,
                    "more than %u VMM pieces", KVC_IPC_MAX_PIECES);
                break;
            }
            pc = np;
            cap = ncap;
        }
        pc[k++] = (kvc_vmm_piece_t){base, size, h};
        q = base + size;
    }
    if (st == KVC_OK) {
        *out = pc;
        *n = k;
    } else {
        for (size_t i = 0; i < k; i++)
            d.release(pc[i].handle);
        free(pc);
    }
    return kvc_cuda_dev_leave(c, saved, st);
}

void kvc_cuda_vmm_release(kvc_cuda_t *c, kvc_vmm_piece_t *pieces, size_t n) {
    drv_t d;
    if (n && drv_load(c, &d))
        for (size_t i = 0; i < n; i++)
            d.release(pieces[i].handle);
    free(pieces);
}

kvc_status_t kvc_cuda_vmm_export(kvc_cuda_t *c, int dev, uint64_t handle, int *fd) {
    drv_t d;
    if (!drv_load(c, &d)) return KVC_ERR_UNSUPPORTED;
    int saved;
    kvc_status_t st = kvc_cuda_dev_enter(c, dev, &saved);
    if (st != KVC_OK) return st;
    int f = -1;
    CUresult r = d.exp(&f, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS)
        st = dfail(c, r, "cuMemExportToShareableHandle");
    else
        *fd = f;
    return kvc_cuda_dev_leave(c, saved, st);
}

kvc_status_t kvc_cuda_vmm_import(kvc_cuda_t *c, int dev, int fd, uint64_t *handle) {
    drv_t d;
    if (!drv_load(c, &d)) return KVC_ERR_UNSUPPORTED;
    int saved;
    kvc_status_t st = kvc_cuda_dev_enter(c, dev, &saved);
    if (st != KVC_OK) return st;
    CUmemGenericAllocationHandle h = 0;
    /* A POSIX fd travels in the pointer argument itself. */
    CUresult r = d.imp(&h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS)
        st = dfail(c, r, "cuMemImportFromShareableHandle");
    else
        *handle = h;
    return kvc_cuda_dev_leave(c, saved, st);
}

void kvc_cuda_vmm_drop(kvc_cuda_t *c, uint64_t handle) {
    drv_t d;
    if (drv_load(c, &d)) d.release(handle);
}

/* Unmaps the first n pieces mapped from base, then frees the range. */
static void unmap_n(const drv_t *d, CUdeviceptr base, const uint64_t *sizes, size_t n,
                    size_t total) {
    CUdeviceptr off = 0;
    for (size_t i = 0; i < n; i++) {
        d->unmap(base + off, sizes[i]);
        off += sizes[i];
    }
    d->afree(base, total);
}

kvc_status_t kvc_cuda_vmm_map(kvc_cuda_t *c, int dev, const uint64_t *handles,
                              const uint64_t *sizes, size_t n, void **va) {
    drv_t d;
    if (!drv_load(c, &d)) return KVC_ERR_UNSUPPORTED;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (sizes[i] > SIZE_MAX - total)
            return kvc_cuda_set_error(c, KVC_ERR_INVALID_PARAM, "VMM pieces overflow");
        total += sizes[i];
    }
    if (!n || !total) return kvc_cuda_set_error(c, KVC_ERR_INVALID_PARAM, "no VMM pieces");
    int saved;
    kvc_status_t st = kvc_cuda_dev_enter(c, dev, &saved);
    if (st != KVC_OK) return st;
    /* The reservation aligned as the allocations want it; every piece
     * size is a multiple of that granularity (the producer mapped them). */
    CUmemAllocationProp pr;
    memset(&pr, 0, sizeof(pr));
    size_t gran = 0;
    CUdeviceptr base = 0, off = 0;
    CUresult r = d.props(&pr, handles[0]);
    if (r == CUDA_SUCCESS) r = d.gran(&gran, &pr, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS) {
        st = dfail(c, r, "cuMemGetAllocationGranularity");
        goto out;
    }
    if ((r = d.reserve(&base, total, gran, 0, 0)) != CUDA_SUCCESS) {
        st = dfail(c, r, "cuMemAddressReserve");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        if ((r = d.map(base + off, sizes[i], 0, handles[i], 0)) != CUDA_SUCCESS) {
            unmap_n(&d, base, sizes, i, total);
            st = dfail(c, r, "cuMemMap");
            goto out;
        }
        off += sizes[i];
    }
    CUmemAccessDesc ad;
    memset(&ad, 0, sizeof(ad));
    ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    ad.location.id = dev;
    ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if ((r = d.access(base, total, &ad, 1)) != CUDA_SUCCESS) {
        unmap_n(&d, base, sizes, n, total);
        st = dfail(c, r, "cuMemSetAccess");
        goto out;
    }
    *va = (void *)(uintptr_t)base;
out:
    return kvc_cuda_dev_leave(c, saved, st);
}

void kvc_cuda_vmm_unmap(kvc_cuda_t *c, int dev, void *va, const uint64_t *sizes, size_t n) {
    drv_t d;
    int saved;
    if (!drv_load(c, &d) || kvc_cuda_dev_enter(c, dev, &saved) != KVC_OK) return;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += sizes[i];
    unmap_n(&d, dptr(va), sizes, n, total);
    kvc_cuda_dev_leave(c, saved, KVC_OK);
}
