/* SPDX-License-Identifier: Apache-2.0 */
/* Build without CUDA: every CUDA entry point reports it is unavailable.  The
 * copy planner is pure and shared by both builds (copyplan.c). */
#include "connector/kvc_int.h"
#include "connector/kvc_vmm.h"

#include <stdio.h>

bool kvc_cuda_built(void) {
    return false;
}

const char *kvc_cuda_last_error(const kvc_cuda_t *c) {
    return "built without CUDA";
}

kvc_status_t kvc_cuda_create(kvc_cuda_t **out, char *err, size_t errlen) {
    snprintf(err, errlen, "built without CUDA");
    return KVC_ERR_UNSUPPORTED;
}

void kvc_cuda_destroy(kvc_cuda_t *c) {}

kvc_status_t kvc_cuda_region_device(kvc_cuda_t *c, const void *base, size_t len, int hint,
                                    int *dev) {
    return KVC_ERR_UNSUPPORTED;
}

kvc_status_t kvc_cuda_host_register(kvc_cuda_t *c, void *p, size_t len) {
    return KVC_ERR_UNSUPPORTED;
}

void kvc_cuda_host_unregister(kvc_cuda_t *c, void *p) {}

kvc_status_t kvc_cuda_wait_for(kvc_cuda_t *c, void *event, bool has_stream, void *stream) {
    return KVC_ERR_UNSUPPORTED;
}

kvc_status_t kvc_cuda_copy_runs(kvc_cuda_t *c, int dev, void *dev_base, void *host_base,
                                size_t block_len, const kvc_crun_t *runs, size_t nruns,
                                bool to_device) {
    return KVC_ERR_UNSUPPORTED;
}

kvc_status_t kvc_cuda_copy_event(kvc_cuda_t *c, int dev, void *dst, const void *src, size_t len,
                                 bool to_device, void **ev, int *ev_dev) {
    return KVC_ERR_UNSUPPORTED;
}

int kvc_cuda_event_poll(kvc_cuda_t *c, void *ev, kvc_status_t *st) {
    *st = KVC_ERR_UNSUPPORTED;
    return -1;
}

void kvc_cuda_event_destroy(kvc_cuda_t *c, void *ev) {}
void kvc_cuda_event_put(kvc_cuda_t *c, int dev, void *ev) {}
kvc_status_t kvc_cuda_capture(kvc_cuda_t *c, kvc_cuda_cap_t **out) {
    return KVC_ERR_UNSUPPORTED;
}
kvc_status_t kvc_cuda_capture_wait(kvc_cuda_cap_t *k, unsigned *syncs) {
    return KVC_OK;
}
void kvc_cuda_capture_put(kvc_cuda_cap_t *k) {}

kvc_status_t kvc_cuda_sync(kvc_cuda_t *c) {
    return KVC_ERR_UNSUPPORTED;
}

kvc_status_t kvc_cuda_order_before(kvc_cuda_t *c, void *stream) {
    return KVC_ERR_UNSUPPORTED;
}

bool kvc_cuda_idle(kvc_cuda_t *c, kvc_status_t *st) {
    *st = KVC_OK;
    return true;
}

void kvc_cuda_drain(kvc_cuda_t *c) {}

int kvc_cuda_devices(const kvc_cuda_t *c) {
    return 0;
}

kvc_status_t kvc_cuda_ipc_export(kvc_cuda_t *c, int dev, const void *p, size_t len,
                                 kvc_cuda_export_t *out) {
    return KVC_ERR_UNSUPPORTED;
}

int kvc_cuda_device_by_bus(kvc_cuda_t *c, const char *bus) {
    return -1;
}

kvc_status_t kvc_cuda_ipc_open(kvc_cuda_t *c, int dev, const uint8_t handle[KVC_IPC_HANDLE_LEN],
                               void **ptr) {
    return KVC_ERR_UNSUPPORTED;
}

void kvc_cuda_ipc_close(kvc_cuda_t *c, int dev, void *ptr) {}

kvc_status_t kvc_cuda_d2d_runs(kvc_cuda_t *c, int dev, void *dst, const void *src, size_t block_len,
                               const kvc_run_t *runs, size_t n, void **ev) {
    return KVC_ERR_UNSUPPORTED;
}

kvc_status_t kvc_cuda_bus_id(kvc_cuda_t *c, int dev, char bus[KVC_IPC_BUS_LEN]) {
    return KVC_ERR_UNSUPPORTED;
}

kvc_status_t kvc_cuda_vmm_pieces(kvc_cuda_t *c, int dev, const void *p, size_t len, bool need_fd,
                                 kvc_vmm_piece_t **out, size_t *n) {
    return KVC_ERR_UNSUPPORTED;
}

void kvc_cuda_vmm_release(kvc_cuda_t *c, kvc_vmm_piece_t *pieces, size_t n) {}

kvc_status_t kvc_cuda_vmm_export(kvc_cuda_t *c, int dev, uint64_t handle, int *fd) {
    return KVC_ERR_UNSUPPORTED;
}

kvc_status_t kvc_cuda_vmm_import(kvc_cuda_t *c, int dev, int fd, uint64_t *handle) {
    return KVC_ERR_UNSUPPORTED;
}

void kvc_cuda_vmm_drop(kvc_cuda_t *c, uint64_t handle) {}

kvc_status_t kvc_cuda_vmm_map(kvc_cuda_t *c, int dev, const uint64_t *handles,
                              const uint64_t *sizes, size_t n, void **va) {
    return KVC_ERR_UNSUPPORTED;
}

void kvc_cuda_vmm_unmap(kvc_cuda_t *c, int dev, void *va, const uint64_t *sizes, size_t n) {}
