/* Build without CUDA: every CUDA entry point reports it is unavailable. */
#include "kvc_int.h"

#include <stdio.h>

bool kvc_cuda_built(void) {
    return false;
}

kvc_status_t kvc_cuda_create(int device, kvc_cuda_t **out, char *err, size_t errlen) {
    snprintf(err, errlen, "built without CUDA");
    return KVC_ERR_UNSUPPORTED;
}

void kvc_cuda_destroy(kvc_cuda_t *c) {}

kvc_status_t kvc_cuda_host_register(kvc_cuda_t *c, void *p, size_t len) {
    return KVC_ERR_UNSUPPORTED;
}

void kvc_cuda_host_unregister(kvc_cuda_t *c, void *p) {}

kvc_status_t kvc_cuda_copy_blocks(kvc_cuda_t *c, void *dev, void *host, size_t block_len,
                                  const uint64_t *ids, size_t n, bool to_device) {
    return KVC_ERR_UNSUPPORTED;
}

kvc_status_t kvc_cuda_sync(kvc_cuda_t *c) {
    return KVC_ERR_UNSUPPORTED;
}
