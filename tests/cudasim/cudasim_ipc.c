/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA stand-in: interprocess memory handles.  cudaMalloc's memory is a
 * memfd (cudasim.c), so a handle names the exporting process and the memfd
 * behind the allocation (/proc/<pid>/fd/<fd>), where the allocation starts
 * in it, its length and id; the importer maps that file: the same pages,
 * so what either side writes the other sees, as with CUDA IPC.  The
 * exporter's death does not unmap what an importer mapped (its bytes stay
 * readable, as the driver keeps an imported allocation alive). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "tests/cudasim/cudasim_int.h"

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct {
    char magic[8]; /* "cudasim" */
    int32_t pid, fd, device;
    uint32_t pad;
    uint64_t off, len, uid;
} ipc_handle_t;
_Static_assert(sizeof(ipc_handle_t) <= CUDA_IPC_HANDLE_SIZE, "IPC handle too large");

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *devPtr) {
    cudaError_t e = cudasim_enter_locked("cudaIpcGetMemHandle");
    if (e != cudaSuccess) return e;
    cudasim_export_t x;
    /* The base of an allocation of this process, as CUDA requires. */
    if (!handle || !cudasim_export(devPtr, &x)) return cudasim_leave_locked(cudaErrorInvalidValue);
    ipc_handle_t h = {.magic = "cudasim",
                      .pid = (int32_t)getpid(),
                      .fd = x.fd,
                      .device = x.device,
                      .off = x.off,
                      .len = x.len,
                      .uid = x.uid};
    memset(handle, 0, sizeof(*handle));
    memcpy(handle->reserved, &h, sizeof(h));
    return cudasim_leave_locked(cudaSuccess);
}

cudaError_t cudaIpcOpenMemHandle(void **devPtr, cudaIpcMemHandle_t handle, unsigned int flags) {
    cudaError_t e = cudasim_enter_locked("cudaIpcOpenMemHandle");
    if (e != cudaSuccess) return e;
    ipc_handle_t h;
    memcpy(&h, handle.reserved, sizeof(h));
    if (!devPtr || flags > cudaIpcMemLazyEnablePeerAccess || memcmp(h.magic, "cudasim", 8) ||
        h.len == 0)
        return cudasim_leave_locked(cudaErrorInvalidValue);
    /* CUDA refuses a handle in the process that exported it ("invalid
     * device context"). */
    if (h.pid == (int32_t)getpid()) return cudasim_leave_locked(cudaErrorDeviceUninitialized);
    /* Opened already on this device: the same pointer, one more reference. */
    void *p = cudasim_import_find(h.pid, h.uid, cudasim_current_device());
    if (p) {
        *devPtr = p;
        return cudasim_leave_locked(cudaSuccess);
    }
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)h.pid, (int)h.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return cudasim_leave_locked(cudaErrorInvalidValue); /* the exporter is gone */
    /* mmap's offset must be page-aligned: map from the page that holds off.
     * Populated now, as the driver maps the whole allocation at open: the
     * copies then do not pay page faults. */
    size_t pg = (size_t)sysconf(_SC_PAGESIZE), lead = (size_t)(h.off % pg);
    void *m = mmap(NULL, h.len + lead, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                   (off_t)(h.off - lead));
    close(fd);
    if (m == MAP_FAILED) return cudasim_leave_locked(cudaErrorMapBufferObjectFailed);
    if (!cudasim_import_add(m, h.len + lead, lead, h.len, h.pid, h.uid)) {
        munmap(m, h.len + lead);
        return cudasim_leave_locked(cudaErrorMemoryAllocation);
    }
    *devPtr = (uint8_t *)m + lead;
    return cudasim_leave_locked(cudaSuccess);
}

cudaError_t cudaIpcCloseMemHandle(void *devPtr) {
    cudaError_t e = cudasim_enter_locked("cudaIpcCloseMemHandle");
    if (e != cudaSuccess) return e;
    return cudasim_leave_locked(cudasim_import_drop(devPtr) ? cudaErrorInvalidValue : cudaSuccess);
}

/* Every process sees the same simulated GPUs: device d is at bus 0x10 + d. */
cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) return e;
    if ((e = cudasim_enter_locked("cudaDeviceGetPCIBusId")) != cudaSuccess) return e;
    if (!pciBusId || len < 13) return cudasim_leave_locked(cudaErrorInvalidValue);
    if (device < 0 || device >= n) return cudasim_leave_locked(cudaErrorInvalidDevice);
    snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", 0x10 + device);
    return cudasim_leave_locked(cudaSuccess);
}
