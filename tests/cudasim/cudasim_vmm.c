/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA stand-in: the driver's virtual memory management (cuMemCreate,
 * cuMemAddressReserve, cuMemMap, cuMemSetAccess, shareable handles), as
 * PyTorch's expandable segments and vLLM's sleep-mode allocator use it,
 * handed out by cudaGetDriverEntryPointByVersion like the real driver's.
 *
 * Model:
 *  - a physical allocation (cuMemCreate) is a memfd, filled with garbage
 *    (0xA5) like fresh device memory; its handle counts references
 *    (create, retain, import) and mappings, and the memfd is closed when
 *    both are gone;
 *  - a reservation (cuMemAddressReserve) is an inaccessible anonymous
 *    mapping; cuMemMap puts the memfd there (still inaccessible: touching
 *    it faults, as an access before cuMemSetAccess does on a GPU);
 *    cuMemSetAccess opens it read-write for one device; cuMemUnmap turns
 *    the range back into reservation;
 *  - exporting as a POSIX fd duplicates the memfd, whose name carries the
 *    device and the handle types (so the importer's properties are the
 *    exporter's); importing maps that file: the same pages in both
 *    processes, and the exporter's death leaves them alive in the importer;
 *  - accessible mappings that touch, of one device, are device memory of
 *    that device for the rest of the stand-in (copies may cross from one
 *    allocation into the next, as on a GPU where the range is contiguous);
 *    the pointer range attributes (cuPointerGetAttribute) name that run,
 *    while cuMemGetAddressRange names the one mapping that holds the
 *    address, as the driver does;
 *  - granularity 64 KiB (a GPU's is 2 MiB), one access descriptor per
 *    cuMemSetAccess, cuMemGetAddressRange for mapped VMM memory only.
 * Every call counts and can be failed (cudasim_fail with the driver
 * function's name; the error value is returned as a CUresult). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "tests/cudasim/cudasim_int.h"

#include <cuda.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GRAN (64u * 1024u)

typedef struct phys {
    struct phys *next;
    CUmemGenericAllocationHandle h;
    int fd;
    size_t size;
    int device;
    unsigned types;
    int refs, maps;
} phys_t;

typedef struct vmap {
    struct vmap *next;
    uint8_t *va;
    size_t size;
    phys_t *ph;
    int access; /* the device that may access it, -1: none yet */
} vmap_t;

typedef struct resv {
    struct resv *next;
    uint8_t *va;
    size_t size;
} resv_t;

/* Under the stand-in's lock. */
static phys_t *physs;
static vmap_t *vmaps;
static resv_t *resvs;
static CUmemGenericAllocationHandle next_handle = 0x1000;
/* The device-memory runs registered with cudasim.c (their bases). */
static void **runs;
static size_t nruns, runs_cap;

static CUresult enter(const char *fn) {
    return (CUresult)cudasim_enter_locked(fn);
}

static CUresult leave(CUresult r) {
    cudasim_leave_locked(cudaSuccess); /* driver calls leave the runtime's error alone */
    return r;
}

static phys_t *phys_of(CUmemGenericAllocationHandle h) {
    for (phys_t *p = physs; p; p = p->next)
        if (p->h == h) return p;
    return NULL;
}

static void phys_unref(phys_t *ph) {
    if (ph->refs > 0 || ph->maps > 0) return;
    for (phys_t **pp = &physs; *pp; pp = &(*pp)->next)
        if (*pp == ph) {
            *pp = ph->next;
            break;
        }
    close(ph->fd);
    free(ph);
}

static vmap_t *vmap_at(const void *p) {
    const uint8_t *q = p;
    for (vmap_t *m = vmaps; m; m = m->next)
        if (q >= m->va && q < m->va + m->size) return m;
    return NULL;
}

static resv_t *resv_of(const uint8_t *va, size_t size) {
    for (resv_t *r = resvs; r; r = r->next)
        if (va >= r->va && size <= r->size && (size_t)(va - r->va) <= r->size - size) return r;
    return NULL;
}

/* Re-registers the accessible runs as device memory (after any change). */
static void reregister(void) {
    for (size_t i = 0; i < nruns; i++)
        cudasim_devmem_drop(runs[i]);
    nruns = 0;
    for (vmap_t *m = vmaps; m; m = m->next) {
        if (m->access < 0) continue;
        /* A run starts where no accessible mapping of its device ends. */
        bool start = true;
        for (vmap_t *o = vmaps; o && start; o = o->next)
            if (o->access == m->access && o->va + o->size == m->va) start = false;
        if (!start) continue;
        size_t len = m->size;
        for (bool grew = true; grew;) {
            grew = false;
            for (vmap_t *o = vmaps; o; o = o->next)
                if (o->access == m->access && o->va == m->va + len) {
                    len += o->size;
                    grew = true;
                }
        }
        if (nruns == runs_cap) {
            size_t cap = runs_cap ? 2 * runs_cap : 16;
            void **n = realloc(runs, cap * sizeof(*n));
            if (!n) return; /* tests would see the memory missing, never wrongly present */
            runs = n;
            runs_cap = cap;
        }
        if (cudasim_devmem_add(m->va, len, m->access)) runs[nruns++] = m->va;
    }
}

/* ------------------------------------------------------------ the calls -- */

static CUresult sim_granularity(size_t *g, const CUmemAllocationProp *prop,
                                CUmemAllocationGranularity_flags option) {
    CUresult r = enter("cuMemGetAllocationGranularity");
    if (r) return r;
    if (!g || !prop || option > CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return leave(CUDA_ERROR_INVALID_VALUE);
    *g = GRAN;
    return leave(CUDA_SUCCESS);
}

static CUresult sim_create(CUmemGenericAllocationHandle *h, size_t size,
                           const CUmemAllocationProp *prop, unsigned long long flags) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = enter("cuMemCreate");
    if (r) return r;
    if (!h || !prop || flags || !size || size % GRAN ||
        prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        (prop->requestedHandleTypes & ~(unsigned)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return leave(CUDA_ERROR_INVALID_VALUE);
    if (prop->location.id < 0 || prop->location.id >= n) return leave(CUDA_ERROR_INVALID_DEVICE);
    char name[64];
    snprintf(name, sizeof(name), "cudasim-vmm:%d:%u", prop->location.id,
             (unsigned)prop->requestedHandleTypes);
    phys_t *ph = calloc(1, sizeof(*ph));
    int fd = memfd_create(name, MFD_CLOEXEC);
    void *m = MAP_FAILED;
    if (ph && fd >= 0 && ftruncate(fd, (off_t)size) == 0)
        m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        if (fd >= 0) close(fd);
        free(ph);
        return leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    memset(m, 0xA5, size); /* fresh device memory holds garbage */
    munmap(m, size);
    *ph = (phys_t){.next = physs,
                   .h = ++next_handle,
                   .fd = fd,
                   .size = size,
                   .device = prop->location.id,
                   .types = (unsigned)prop->requestedHandleTypes,
                   .refs = 1};
    physs = ph;
    *h = ph->h;
    return leave(CUDA_SUCCESS);
}

static CUresult sim_release(CUmemGenericAllocationHandle h) {
    CUresult r = enter("cuMemRelease");
    if (r) return r;
    phys_t *ph = phys_of(h);
    if (!ph || ph->refs <= 0) return leave(CUDA_ERROR_INVALID_VALUE);
    ph->refs--;
    phys_unref(ph);
    return leave(CUDA_SUCCESS);
}

static CUresult sim_reserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                            unsigned long long flags) {
    (void)addr; /* a hint */
    CUresult r = enter("cuMemAddressReserve");
    if (r) return r;
    if (!ptr || !size || size % GRAN || flags || (align & (align - 1)))
        return leave(CUDA_ERROR_INVALID_VALUE);
    if (align < GRAN) align = GRAN;
    resv_t *rv = calloc(1, sizeof(*rv));
    uint8_t *m =
        mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (!rv || m == MAP_FAILED) {
        free(rv);
        if (m != MAP_FAILED) munmap(m, size + align);
        return leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    uint8_t *va = (uint8_t *)(((uintptr_t)m + align - 1) & ~(uintptr_t)(align - 1));
    if (va > m) munmap(m, (size_t)(va - m));
    if (m + size + align > va + size) munmap(va + size, (size_t)(m + size + align - (va + size)));
    *rv = (resv_t){resvs, va, size};
    resvs = rv;
    *ptr = (CUdeviceptr)(uintptr_t)va;
    return leave(CUDA_SUCCESS);
}

static CUresult sim_address_free(CUdeviceptr ptr, size_t size) {
    CUresult r = enter("cuMemAddressFree");
    if (r) return r;
    uint8_t *va = (uint8_t *)(uintptr_t)ptr;
    for (resv_t **pp = &resvs; *pp; pp = &(*pp)->next) {
        resv_t *rv = *pp;
        if (rv->va != va || rv->size != size) continue;
        for (vmap_t *m = vmaps; m; m = m->next)
            if (m->va >= va && m->va < va + size)
                return leave(CUDA_ERROR_INVALID_VALUE); /* mapped */
        *pp = rv->next;
        munmap(rv->va, rv->size);
        free(rv);
        return leave(CUDA_SUCCESS);
    }
    return leave(CUDA_ERROR_INVALID_VALUE);
}

static CUresult sim_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                        unsigned long long flags) {
    CUresult r = enter("cuMemMap");
    if (r) return r;
    uint8_t *va = (uint8_t *)(uintptr_t)ptr;
    phys_t *ph = phys_of(h);
    if (!ph || offset || flags || !size || size % GRAN || (uintptr_t)va % GRAN || size > ph->size ||
        !resv_of(va, size))
        return leave(CUDA_ERROR_INVALID_VALUE);
    for (vmap_t *m = vmaps; m; m = m->next)
        if (m->va < va + size && va < m->va + m->size) return leave(CUDA_ERROR_INVALID_VALUE);
    vmap_t *m = calloc(1, sizeof(*m));
    if (!m) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    if (mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, ph->fd, 0) == MAP_FAILED) {
        free(m);
        return leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    *m = (vmap_t){.next = vmaps, .va = va, .size = size, .ph = ph, .access = -1};
    vmaps = m;
    ph->maps++;
    return leave(CUDA_SUCCESS);
}

/* The mappings that tile [va, va+size) exactly, in address order, counted;
 * 0 when the range is not wholly mapped. */
static size_t tiles(uint8_t *va, size_t size, vmap_t **out, size_t max) {
    size_t n = 0;
    for (uint8_t *q = va; q < va + size; n++) {
        vmap_t *m = vmap_at(q);
        if (!m || m->va != q || m->size > (size_t)(va + size - q) || n == max) return 0;
        out[n] = m;
        q += m->size;
    }
    return n;
}

static CUresult sim_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                               size_t count) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = enter("cuMemSetAccess");
    if (r) return r;
    if (!desc || count != 1 || desc->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        desc->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        return leave(count > 1 ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE);
    if (desc->location.id < 0 || desc->location.id >= n) return leave(CUDA_ERROR_INVALID_DEVICE);
    uint8_t *va = (uint8_t *)(uintptr_t)ptr;
    vmap_t *t[4096];
    size_t k = tiles(va, size, t, 4096);
    if (!k) return leave(CUDA_ERROR_INVALID_VALUE);
    if (mprotect(va, size, PROT_READ | PROT_WRITE)) return leave(CUDA_ERROR_UNKNOWN);
    for (size_t i = 0; i < k; i++)
        t[i]->access = desc->location.id;
    reregister();
    return leave(CUDA_SUCCESS);
}

static CUresult sim_unmap(CUdeviceptr ptr, size_t size) {
    CUresult r = enter("cuMemUnmap");
    if (r) return r;
    uint8_t *va = (uint8_t *)(uintptr_t)ptr;
    vmap_t *t[4096];
    size_t k = tiles(va, size, t, 4096);
    if (!k) return leave(CUDA_ERROR_INVALID_VALUE);
    /* Back to reservation: inaccessible, no pages. */
    if (mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) ==
        MAP_FAILED)
        return leave(CUDA_ERROR_UNKNOWN);
    for (size_t i = 0; i < k; i++) {
        for (vmap_t **pp = &vmaps; *pp; pp = &(*pp)->next)
            if (*pp == t[i]) {
                *pp = t[i]->next;
                break;
            }
        t[i]->ph->maps--;
        phys_unref(t[i]->ph);
        free(t[i]);
    }
    reregister();
    return leave(CUDA_SUCCESS);
}

static CUresult sim_retain(CUmemGenericAllocationHandle *h, void *addr) {
    CUresult r = enter("cuMemRetainAllocationHandle");
    if (r) return r;
    vmap_t *m = vmap_at(addr);
    if (!h || !m) return leave(CUDA_ERROR_INVALID_VALUE);
    m->ph->refs++;
    *h = m->ph->h;
    return leave(CUDA_SUCCESS);
}

static CUresult sim_properties(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
    CUresult r = enter("cuMemGetAllocationPropertiesFromHandle");
    if (r) return r;
    phys_t *ph = phys_of(h);
    if (!prop || !ph) return leave(CUDA_ERROR_INVALID_VALUE);
    memset(prop, 0, sizeof(*prop));
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->requestedHandleTypes = (CUmemAllocationHandleType)ph->types;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = ph->device;
    return leave(CUDA_SUCCESS);
}

static CUresult sim_address_range(CUdeviceptr *base, size_t *size, CUdeviceptr dptr) {
    CUresult r = enter("cuMemGetAddressRange");
    if (r) return r;
    vmap_t *m = vmap_at((const void *)(uintptr_t)dptr);
    if (!m) return leave(CUDA_ERROR_NOT_FOUND);
    if (base) *base = (CUdeviceptr)(uintptr_t)m->va;
    if (size) *size = m->size;
    return leave(CUDA_SUCCESS);
}

static unsigned export_stall_ms;

void cudasim_vmm_stall_export(unsigned ms) {
    export_stall_ms = ms;
}

static CUresult sim_export(void *out, CUmemGenericAllocationHandle h,
                           CUmemAllocationHandleType type, unsigned long long flags) {
    if (export_stall_ms) usleep(export_stall_ms * 1000u); /* outside the stand-in's lock */
    CUresult r = enter("cuMemExportToShareableHandle");
    if (r) return r;
    phys_t *ph = phys_of(h);
    if (!out || !ph || flags || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return leave(CUDA_ERROR_INVALID_VALUE);
    /* Created without that handle type: the driver refuses the export. */
    if (!(ph->types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return leave(CUDA_ERROR_NOT_PERMITTED);
    int fd = fcntl(ph->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return leave(CUDA_ERROR_OUT_OF_MEMORY);
    *(int *)out = fd;
    return leave(CUDA_SUCCESS);
}

static CUresult sim_import(CUmemGenericAllocationHandle *h, void *os,
                           CUmemAllocationHandleType type) {
    CUresult r = enter("cuMemImportFromShareableHandle");
    if (r) return r;
    int fd = (int)(intptr_t)os;
    char path[64], name[128];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, name, sizeof(name) - 1);
    int dev = -1;
    unsigned types = 0;
    struct stat sb;
    if (!h || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || n <= 0)
        return leave(CUDA_ERROR_INVALID_VALUE);
    name[n] = 0;
    /* Only what this stand-in exported: "/memfd:cudasim-vmm:DEV:TYPES (deleted)". */
    if (sscanf(name, "/memfd:cudasim-vmm:%d:%u", &dev, &types) != 2 || fstat(fd, &sb) ||
        sb.st_size <= 0)
        return leave(CUDA_ERROR_INVALID_VALUE);
    phys_t *ph = calloc(1, sizeof(*ph));
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (!ph || own < 0) {
        free(ph);
        if (own >= 0) close(own);
        return leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    *ph = (phys_t){.next = physs,
                   .h = ++next_handle,
                   .fd = own,
                   .size = (size_t)sb.st_size,
                   .device = dev,
                   .types = types,
                   .refs = 1};
    physs = ph;
    *h = ph->h;
    return leave(CUDA_SUCCESS);
}

/* ---------------------------------------------------------- for cudasim -- */

void *cudasim_vmm_symbol(const char *name) {
    static const struct {
        const char *name;
        void *fn;
    } tab[] = {
        {"cuMemGetAllocationGranularity", (void *)sim_granularity},
        {"cuMemCreate", (void *)sim_create},
        {"cuMemRelease", (void *)sim_release},
        {"cuMemAddressReserve", (void *)sim_reserve},
        {"cuMemAddressFree", (void *)sim_address_free},
        {"cuMemMap", (void *)sim_map},
        {"cuMemUnmap", (void *)sim_unmap},
        {"cuMemSetAccess", (void *)sim_set_access},
        {"cuMemRetainAllocationHandle", (void *)sim_retain},
        {"cuMemGetAllocationPropertiesFromHandle", (void *)sim_properties},
        {"cuMemGetAddressRange", (void *)sim_address_range},
        {"cuMemExportToShareableHandle", (void *)sim_export},
        {"cuMemImportFromShareableHandle", (void *)sim_import},
    };
    for (size_t i = 0; i < sizeof(tab) / sizeof(tab[0]); i++)
        if (!strcmp(tab[i].name, name)) return tab[i].fn;
    return NULL;
}

/* How many mappings (or physical allocations) this process has. */
static int count(bool maps) {
    if (cudasim_enter_locked("cudasim_vmm_count") != cudaSuccess) return -1;
    int n = 0;
    for (vmap_t *m = maps ? vmaps : NULL; m; m = m->next)
        n++;
    for (phys_t *p = maps ? NULL : physs; p; p = p->next)
        n++;
    cudasim_leave_locked(cudaSuccess);
    return n;
}

int cudasim_vmm_mappings(void) {
    return count(true);
}

int cudasim_vmm_allocations(void) {
    return count(false);
}
