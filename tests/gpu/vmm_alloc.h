/* SPDX-License-Identifier: Apache-2.0 */
/* Test helper: device memory mapped the way PyTorch's expandable segments
 * map it (one reserved range, physical allocations of `piece` bytes mapped
 * one after the other, read-write for one device), with the driver's VMM
 * calls reached through cudaGetDriverEntryPointByVersion (nothing links
 * libcuda).  Works on a GPU and on the CUDA stand-in (tests/cudasim).
 * Header-only: included by tests/unit/test_kvc_ipc.c and
 * tests/gpu/kvc_gpu_test.c.  Tests only. */
#ifndef KVC_TEST_VMM_ALLOC_H
#define KVC_TEST_VMM_ALLOC_H

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct {
    CUdeviceptr va;
    size_t size, piece; /* the range; each physical allocation */
    size_t n;
    CUmemGenericAllocationHandle *h; /* owned */
} vmm_mem_t;

static void *vmm_fn(const char *name) {
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        fprintf(stderr, "vmm_alloc: the CUDA driver has no %s\n", name);
        return NULL;
    }
    return fn;
}

#define VMM_FN(name) ((__typeof__(&name))vmm_fn(#name))

static void vmm_free(vmm_mem_t *m) {
    __typeof__(&cuMemUnmap) unmap = VMM_FN(cuMemUnmap);
    __typeof__(&cuMemRelease) release = VMM_FN(cuMemRelease);
    __typeof__(&cuMemAddressFree) afree = VMM_FN(cuMemAddressFree);
    if (!unmap || !release || !afree) return;
    for (size_t i = 0; i < m->n; i++) {
        unmap(m->va + i * m->piece, m->piece);
        release(m->h[i]);
    }
    if (m->va) afree(m->va, m->size);
    free(m->h);
    m->h = NULL;
    m->n = 0;
    m->va = 0;
}

/* At least `size` bytes in physical allocations of at least `piece` bytes
 * (both rounded up to the granularity) on device dev; fd: the allocations
 * may be exported as POSIX fds.  0, or -1 (message on stderr). */
static int vmm_alloc(vmm_mem_t *m, size_t size, size_t piece, int dev, bool fd) {
    __typeof__(&cuMemGetAllocationGranularity) gran = VMM_FN(cuMemGetAllocationGranularity);
    __typeof__(&cuMemAddressReserve) reserve = VMM_FN(cuMemAddressReserve);
    __typeof__(&cuMemCreate) create = VMM_FN(cuMemCreate);
    __typeof__(&cuMemMap) map = VMM_FN(cuMemMap);
    __typeof__(&cuMemSetAccess) access = VMM_FN(cuMemSetAccess);
    if (!gran || !reserve || !create || !map || !access) return -1;
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        fd ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t g = 0;
    CUresult r = gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS || !g) {
        fprintf(stderr, "vmm_alloc: cuMemGetAllocationGranularity: %d\n", (int)r);
        return -1;
    }
    *m = (vmm_mem_t){0};
    m->piece = (piece + g - 1) / g * g;
    m->n = (size + m->piece - 1) / m->piece;
    m->size = m->n * m->piece;
    m->h = calloc(m->n, sizeof(*m->h));
    if (!m->h) return -1;
    size_t done = 0;
    if ((r = reserve(&m->va, m->size, 0, 0, 0)) != CUDA_SUCCESS) {
        fprintf(stderr, "vmm_alloc: cuMemAddressReserve: %d\n", (int)r);
        goto fail;
    }
    for (; done < m->n; done++) {
        if ((r = create(&m->h[done], m->piece, &prop, 0)) != CUDA_SUCCESS) {
            fprintf(stderr, "vmm_alloc: cuMemCreate: %d\n", (int)r);
            goto fail;
        }
        if ((r = map(m->va + done * m->piece, m->piece, 0, m->h[done], 0)) != CUDA_SUCCESS) {
            fprintf(stderr, "vmm_alloc: cuMemMap: %d\n", (int)r);
            __typeof__(&cuMemRelease) release = VMM_FN(cuMemRelease);
            if (release) release(m->h[done]);
            goto fail;
        }
    }
    CUmemAccessDesc ad = {0};
    ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    ad.location.id = dev;
    ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if ((r = access(m->va, m->size, &ad, 1)) != CUDA_SUCCESS) {
        fprintf(stderr, "vmm_alloc: cuMemSetAccess: %d\n", (int)r);
        goto fail;
    }
    return 0;
fail:
    m->n = done;
    vmm_free(m);
    return -1;
}

#endif
