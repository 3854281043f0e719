/* CUDA staging (UCX without CUDA transports): copies whole blocks between a
 * device region and its pinned host mirror with cudaMemcpyAsync on one
 * stream, coalescing consecutive block ids into one copy. */
#include "kvc_int.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

struct kvc_cuda {
    int device;
    cudaStream_t stream;
};

bool kvc_cuda_built(void) {
    return true;
}

kvc_status_t kvc_cuda_create(int device, kvc_cuda_t **out, char *err, size_t errlen) {
    int n = 0;
    cudaError_t ce = cudaGetDeviceCount(&n);
    /* No driver (error 35) or any other error: there is no usable device. */
    if (ce != cudaSuccess || n <= device || device < 0) {
        snprintf(err, errlen, "no CUDA device %d (%s, count %d)", device,
                 ce == cudaSuccess ? "ok" : cudaGetErrorString(ce), n);
        return KVC_ERR_NO_DEVICE;
    }
    kvc_cuda_t *c = calloc(1, sizeof(*c));
    if (!c) return KVC_ERR_NO_MEMORY;
    c->device = device;
    if ((ce = cudaSetDevice(device)) != cudaSuccess ||
        (ce = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        snprintf(err, errlen, "CUDA device %d: %s", device, cudaGetErrorString(ce));
        free(c);
        return KVC_ERR_NO_DEVICE;
    }
    *out = c;
    return KVC_OK;
}

void kvc_cuda_destroy(kvc_cuda_t *c) {
    if (!c) return;
    cudaStreamDestroy(c->stream);
    free(c);
}

kvc_status_t kvc_cuda_host_register(kvc_cuda_t *c, void *p, size_t len) {
    return cudaHostRegister(p, len, cudaHostRegisterPortable) == cudaSuccess ? KVC_OK
                                                                             : KVC_ERR_NO_DEVICE;
}

void kvc_cuda_host_unregister(kvc_cuda_t *c, void *p) {
    cudaHostUnregister(p);
}

kvc_status_t kvc_cuda_copy_blocks(kvc_cuda_t *c, void *dev, void *host, size_t block_len,
                                  const uint64_t *ids, size_t n, bool to_device) {
    if (!c) return KVC_ERR_NO_DEVICE;
    cudaSetDevice(c->device);
    for (size_t i = 0; i < n;) {
        size_t j = i + 1;
        while (j < n && ids[j] == ids[j - 1] + 1)
            j++;
        size_t off = (size_t)ids[i] * block_len, len = (j - i) * block_len;
        char *d = (char *)dev + off, *h = (char *)host + off;
        cudaError_t ce = to_device ? cudaMemcpyAsync(d, h, len, cudaMemcpyHostToDevice, c->stream)
                                   : cudaMemcpyAsync(h, d, len, cudaMemcpyDeviceToHost, c->stream);
        if (ce != cudaSuccess) return KVC_ERR_TRANSPORT;
        i = j;
    }
    return KVC_OK;
}

kvc_status_t kvc_cuda_sync(kvc_cuda_t *c) {
    if (!c) return KVC_ERR_NO_DEVICE;
    return cudaStreamSynchronize(c->stream) == cudaSuccess ? KVC_OK : KVC_ERR_TRANSPORT;
}
