/* SPDX-License-Identifier: Apache-2.0 */
/* Internals of the CUDA stand-in shared by cudasim.c (streams, memory),
 * cudasim_ipc.c (interprocess handles) and cudasim_vmm.c (the driver's
 * virtual memory management).  Tests only. */
#ifndef CUDASIM_INT_H
#define CUDASIM_INT_H

#include "tests/cudasim/cudasim.h"

#include <stdbool.h>
#include <stdint.h>

/* Takes the stand-in's lock and counts the call (faults of cudasim_fail
 * apply): cudaSuccess with the lock held, else the error, unlocked. */
cudaError_t cudasim_enter_locked(const char *fn);
/* Releases the lock; e becomes the thread's last error (unless success). */
cudaError_t cudasim_leave_locked(cudaError_t e);
int cudasim_current_device(void);

/* Under the lock. */
typedef struct {
    int fd, device;
    size_t off, len;
    uint64_t uid;
} cudasim_export_t;
/* p is the base of a cudaMalloc allocation of this process: its memfd. */
bool cudasim_export(const void *p, cudasim_export_t *x);
/* An IPC mapping of that exporter's allocation already open on `device`:
 * one more reference, its pointer; else NULL. */
void *cudasim_import_find(int pid, uint64_t uid, int device);
/* Remembers a new mapping (map, maplen: the whole mmap; the allocation at
 * map + lead, len bytes) as device memory of the current device. */
bool cudasim_import_add(void *map, size_t maplen, size_t lead, size_t len, int pid, uint64_t uid);
/* One reference less (unmapped at zero); -1 if p is no IPC mapping. */
int cudasim_import_drop(void *p);
/* cudasim_vmm.c's accessible mappings: [p, p+len) is device memory of
 * `device` (never cudaFree'd, no IPC handle, not counted as an IPC
 * mapping) until dropped; the caller owns the pages. */
bool cudasim_devmem_add(void *p, size_t len, int device);
void cudasim_devmem_drop(void *p);
/* cudasim_vmm.c: its driver function named `name`, or NULL (not locked). */
void *cudasim_vmm_symbol(const char *name);

#endif
