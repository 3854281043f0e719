/* SPDX-License-Identifier: Apache-2.0 */
/* Which way a consumer reads a producer's blocks (pure; peer.c applies it
 * after the handshake).  Device memory is read one-sided only over a
 * transport that reaches it: cuda_ipc between GPUs of one host, or an RDMA
 * transport (GPUDirect) across hosts.  Over anything else UCX would emulate
 * a get with a host memcpy, which on device memory is a crash, so the
 * producer pushes instead, and a forced get is refused with a clear status.
 * On one node CUDA memory goes device to device over CUDA IPC (ipc.c) when
 * both sides allow it and the protocol is automatic. */
#include "connector/kvc_int.h"

#include <string.h>

static uint32_t one_bit(const char *t, size_t n) {
    static const struct {
        const char *prefix;
        uint32_t bit;
    } tab[] = {
        {"tcp", KVC_TRANSPORT_TCP},           {"posix", KVC_TRANSPORT_SHM},
        {"sysv", KVC_TRANSPORT_SHM},          {"xpmem", KVC_TRANSPORT_SHM},
        {"cma", KVC_TRANSPORT_SHM},           {"knem", KVC_TRANSPORT_SHM},
        {"cuda_ipc", KVC_TRANSPORT_CUDA_IPC}, {"cuda_copy", KVC_TRANSPORT_CUDA_COPY},
        {"gdr_copy", KVC_TRANSPORT_GDR_COPY}, {"rc", KVC_TRANSPORT_RDMA},
        {"dc", KVC_TRANSPORT_RDMA},           {"ud", KVC_TRANSPORT_RDMA},
        {"ib", KVC_TRANSPORT_RDMA},           {"self", 0},
    };
    for (size_t i = 0; i < sizeof(tab) / sizeof(tab[0]); i++) {
        size_t k = strlen(tab[i].prefix);
        /* "rc_mlx5", "ud_verbs", "dc_mlx5": the family, then '_' or the end. */
        if (n >= k && !memcmp(t, tab[i].prefix, k) && (n == k || t[k] == '_')) return tab[i].bit;
    }
    return KVC_TRANSPORT_OTHER;
}

uint32_t kvc_transport_bits(const char *names) {
    uint32_t bits = 0;
    for (const char *s = names; s && *s;) {
        const char *e = strchr(s, ',');
        size_t n = e ? (size_t)(e - s) : strlen(s);
        if (n) bits |= one_bit(s, n);
        s = e ? e + 1 : s + n;
    }
    return bits;
}

kvc_status_t kvc_choose_path(const kvc_path_in_t *in, kvc_path_t *out) {
    bool dev = in->local_dev || in->remote_dev;
    bool reach_dev = (in->transports & (KVC_TRANSPORT_CUDA_IPC | KVC_TRANSPORT_RDMA)) != 0;
    /* The mapping is of host memory: a connector-allocated pool. */
    bool mapped = in->mapped && !dev;
    *out = (kvc_path_t){KVC_PROTO_PUSH, false, "producer push", false};
    if (in->ipc && in->want == KVC_PROTO_AUTO) {
        /* Device to device on this node, whatever UCX's lanes: the copies
         * run on our streams from the producer's memory mapped here. */
        *out = (kvc_path_t){KVC_PROTO_GET, false, "get: CUDA IPC, device-to-device copies", true};
        return KVC_OK;
    }
    if (in->local_staged) {
        /* No local address UCX could write but the pool's slots. */
        out->why = "push: local regions staged through the pinned pool";
        return KVC_OK;
    }
    if (!in->keys) {
        out->why = "push: the producer sent no rkeys";
        return KVC_OK;
    }
    switch (in->want) {
    case KVC_PROTO_PUSH:
        out->why = "push: asked for";
        return KVC_OK;
    case KVC_PROTO_GET:
        if (dev && !reach_dev) {
            out->why = "get of device memory refused: the endpoint has neither cuda_ipc nor an "
                       "RDMA transport, UCX would emulate it with a host memcpy (use push)";
            return KVC_ERR_UNSUPPORTED;
        }
        *out = (kvc_path_t){KVC_PROTO_GET, mapped,
                            mapped ? "get: shared-memory mapping" : "get: asked for", false};
        return KVC_OK;
    case KVC_PROTO_AUTO:
    default:
        break;
    }
    if (mapped) {
        *out = (kvc_path_t){KVC_PROTO_GET, true, "get: shared-memory mapping", false};
        return KVC_OK;
    }
    if (dev && reach_dev && in->rma) {
        *out = (kvc_path_t){KVC_PROTO_GET, false,
                            (in->transports & KVC_TRANSPORT_CUDA_IPC)
                                ? "get: device memory over cuda_ipc"
                                : "get: device memory over RDMA",
                            false};
        return KVC_OK;
    }
    out->why = dev ? "push: device memory without a cuda_ipc/RDMA lane or RMA"
                   : "push: remote memory not mapped here";
    return KVC_OK;
}
