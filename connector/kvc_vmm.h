/* SPDX-License-Identifier: Apache-2.0 */
/* libkvconnector internals of the same-node IPC path for VMM memory: the
 * driver's virtual memory management calls (cuda_vmm.c, and the helpers of
 * cuda.c they use) and the Unix socket that passes a producer's physical
 * allocations as POSIX fds (ipcfd.c).  Included by the files that own or
 * drive them (cuda.c, cuda_vmm.c, cuda_none.c, ipc.c, ipcfd.c, context.c);
 * everything else sees only connector/kvc_int.h. */
#ifndef KVC_VMM_H
#define KVC_VMM_H

#include "connector/kvc_int.h"

/* The PCI bus id of device dev (KVC_IPC_BUS_LEN bytes at most). */
KVC_HIDDEN kvc_status_t kvc_cuda_bus_id(kvc_cuda_t *c, int dev, char bus[KVC_IPC_BUS_LEN]);
/* For cuda_vmm.c: dev made current (the caller's device in *saved), and
 * back; the message of a failure (kvc_cuda_last_error). */
KVC_HIDDEN kvc_status_t kvc_cuda_dev_enter(kvc_cuda_t *c, int dev, int *saved);
KVC_HIDDEN kvc_status_t kvc_cuda_dev_leave(kvc_cuda_t *c, int saved, kvc_status_t st);
KVC_HIDDEN kvc_status_t kvc_cuda_set_error(kvc_cuda_t *c, kvc_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* CUDA virtual memory management (cuda_vmm.c): memory mapped with
 * cuMemCreate/cuMemMap, whose physical allocations travel as POSIX fds.
 * A piece is one mapping: [base, base + size) maps one physical allocation
 * from its offset 0 (cuMemMap's offset must be 0). */
typedef struct {
    uint64_t base, size;
    uint64_t handle; /* CUmemGenericAllocationHandle, retained */
} kvc_vmm_piece_t;
/* The pieces that cover [p, p+len) on device dev, contiguous, each handle
 * retained (*out owned: kvc_cuda_vmm_release).  KVC_ERR_UNSUPPORTED (the
 * message says why) when that is not VMM memory mapped end to end on dev,
 * or (need_fd) a piece's allocation was created without
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR. */
KVC_HIDDEN kvc_status_t kvc_cuda_vmm_pieces(kvc_cuda_t *c, int dev, const void *p, size_t len,
                                            bool need_fd, kvc_vmm_piece_t **out, size_t *n);
KVC_HIDDEN void kvc_cuda_vmm_release(kvc_cuda_t *c, kvc_vmm_piece_t *pieces, size_t n);
/* A new POSIX fd (owned by the caller) of a retained allocation. */
KVC_HIDDEN kvc_status_t kvc_cuda_vmm_export(kvc_cuda_t *c, int dev, uint64_t handle, int *fd);
/* Consumer: an allocation from its fd (the fd stays the caller's), and
 * the release of that handle. */
KVC_HIDDEN kvc_status_t kvc_cuda_vmm_import(kvc_cuda_t *c, int dev, int fd, uint64_t *handle);
KVC_HIDDEN void kvc_cuda_vmm_drop(kvc_cuda_t *c, uint64_t handle);
/* Consumer: one address range reserved, the n allocations mapped one after
 * the other (sizes[i] bytes each, from offset 0), read-write for device
 * dev: *va.  Nothing left behind on failure. */
KVC_HIDDEN kvc_status_t kvc_cuda_vmm_map(kvc_cuda_t *c, int dev, const uint64_t *handles,
                                         const uint64_t *sizes, size_t n, void **va);
KVC_HIDDEN void kvc_cuda_vmm_unmap(kvc_cuda_t *c, int dev, void *va, const uint64_t *sizes,
                                   size_t n);

/* ----------------------------------------------------------- ipcfd.c -- */
/* VMM allocations' POSIX fds over a Unix socket (ipcfd.c has the design). */
#define KVC_IPCFD_BATCH 253 /* fds per message: Linux's SCM_MAX_FD */
typedef struct kvc_ipcfd_conn kvc_ipcfd_conn_t;
typedef struct kvc_ipcfd_cli kvc_ipcfd_cli_t;
/* Producer: listens on a new abstract socket for requests of the fds of
 * pieces (owned from now on, also on failure: released with the server;
 * dev: each piece's device, owned); its name and token out, for the table. */
KVC_HIDDEN kvc_status_t kvc_ipcfd_serve(kvc_agent_t *a, kvc_vmm_piece_t *pieces, int *dev, size_t n,
                                        char name[KVC_IPC_SOCK_LEN],
                                        uint8_t token[KVC_IPC_FD_TOKEN_LEN]);
KVC_HIDDEN void kvc_ipcfd_serve_stop(kvc_agent_t *a);
KVC_HIDDEN void kvc_ipcfd_accept(kvc_agent_t *a);
KVC_HIDDEN void kvc_ipcfd_conn_io(kvc_agent_t *a, kvc_ipcfd_conn_t *c, uint32_t events);
/* Idle connections closed, closed ones freed (after the epoll batch). */
KVC_HIDDEN void kvc_ipcfd_timers(kvc_agent_t *a, uint64_t now, uint64_t *next);
/* Consumer: connects to the table's socket (its owner must be the table's
 * pid), asks for the first batch and adds the socket to epoll with pe.
 * On failure err says why. */
KVC_HIDDEN kvc_status_t kvc_ipcfd_fetch(kvc_agent_t *a, const kvc_ipc_table_t *t, kvc_pollent_t *pe,
                                        kvc_ipcfd_cli_t **out, char *err, size_t errlen);
/* The next batch: fds (owned by the caller) of pieces *first..*first+*n-1,
 * KVC_OK, and the next batch asked for; KVC_AGAIN: nothing yet; an error
 * (err says why, nothing received is left open). */
KVC_HIDDEN kvc_status_t kvc_ipcfd_recv(kvc_ipcfd_cli_t *c, int fds[KVC_IPCFD_BATCH],
                                       uint32_t *first, uint32_t *n, char *err, size_t errlen);
KVC_HIDDEN void kvc_ipcfd_fetch_close(kvc_agent_t *a, kvc_ipcfd_cli_t *c);

#endif
