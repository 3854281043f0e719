/* SPDX-License-Identifier: Apache-2.0 */
/* Controls of the CUDA stand-in (tests only): device count, execution mode,
 * fault injection and counters.  The runtime functions themselves are in
 * cuda_runtime_api.h beside this file. */
#ifndef CUDASIM_H
#define CUDASIM_H

#include "tests/cudasim/cuda_runtime_api.h"

#include <stdbool.h>
#include <stddef.h>

/* Forgets counters, pending faults and queued work (dropped, not run); sets the number of devices
 * (0: every call answers cudaErrorInsufficientDriver, as on a machine without a driver) and the
 * execution mode.  lazy (threaded false): queued work runs only when the host synchronises (stream
 * or event sync, one op per event query), so a missing synchronisation leaves the work undone,
 * deterministically.  threaded: like a GPU, copy-engine threads run queued work concurrently with
 * the caller (one per device for copies and memsets, in submission order; one for host
 * functions), events complete when the work before them is done and synchronisations block until
 * then; CUDASIM_GBPS=N caps each engine at N GB/s.  Also ends eager mode and releases held
 * streams (both lazy-mode tools). */
void cudasim_reset(int devices, bool threaded);
/* Eager mode: work runs as soon as it is queued and nothing it waits for is
 * pending, except on held streams, which run only when a synchronisation
 * needs them (an engine's slow kernels).  Shows copies that overwrite memory
 * the engine still reads because they wait for nothing. */
void cudasim_set_eager(bool on);
void cudasim_hold(cudaStream_t s, bool hold);
/* The nth next call (1 = the next) of runtime function `fn` fails at once
 * with err. */
void cudasim_fail(const char *fn, unsigned nth, cudaError_t err);
/* The nth next call of `fn` (a copy) is queued fine but fails when it runs:
 * the stream reports err at its next synchronisation, like an asynchronous
 * CUDA fault. */
void cudasim_fail_async(const char *fn, unsigned nth, cudaError_t err);
/* Splits the cudaMalloc allocation that holds p at offset `at`: two
 * allocations side by side afterwards, as the driver may hand out (freeing
 * the first frees both's memory; the second is then forgotten too). */
void cudasim_split(void *p, size_t at);
/* Calls of runtime function `fn` since the last reset. */
unsigned long cudasim_calls(const char *fn);
/* Operations queued on all streams and not yet run. */
size_t cudasim_pending(void);
/* Streams created and not destroyed. */
int cudasim_streams_live(void);
/* Pinned host bytes (cudaHostRegister, cudaMallocHost): now, and the most
 * at any time since the last reset. */
size_t cudasim_pinned_bytes(void);
size_t cudasim_pinned_peak(void);
/* IPC mappings open in this process (cudaIpcOpenMemHandle references not
 * yet closed). */
int cudasim_ipc_open_count(void);
/* The driver's virtual memory management (cudasim_vmm.c): mappings
 * (cuMemMap not yet unmapped) and physical allocations (cuMemCreate or
 * imported, not yet freed) in this process. */
int cudasim_vmm_mappings(void);
int cudasim_vmm_allocations(void);
/* Every later cuMemExportToShareableHandle first sleeps ms on the calling
 * thread (0: no more): a producer that takes a consumer's fd request and
 * answers only late. */
void cudasim_vmm_stall_export(unsigned ms);

#endif
