/* SPDX-License-Identifier: Apache-2.0 */
/* KV regions: registration of caller memory, connector-allocated host pools
 * (ucp_mem_map ALLOCATE: shared memory, so same-host gets are one-sided),
 * CUDA regions (direct, or staged through the pinned pool of stage.c),
 * packed rkeys, and the handshake reply built from them. */
#include "connector/kvc_int.h"

#include <stdlib.h>
#include <string.h>

static void region_cleanup(kvc_agent_t *a, kvc_region_t *r) {
    if (r->rkey_buf) ucp_rkey_buffer_release(r->rkey_buf);
    if (r->memh) ucp_mem_unmap(a->ctx, r->memh);
    memset(r, 0, sizeof(*r));
}

void kvc_mem_cleanup(kvc_agent_t *a) {
    /* Copies still queued read or write the pool: they end first. */
    kvc_stage_cleanup(a);
    kvc_ipc_export_cleanup(a);
    kvc_cuda_drain(a->cuda);
    for (size_t i = 0; i < a->n_regions; i++)
        region_cleanup(a, &a->regions[i]);
    free(a->regions);
    a->regions = NULL;
    a->n_regions = 0;
}

static kvc_status_t map(kvc_agent_t *a, kvc_region_t *r, void *addr, size_t len, bool alloc,
                        ucs_memory_type_t mt) {
    ucp_mem_map_params_t mp;
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_PROT;
    /* Least privilege: peers only ever read these regions (gets, or our own
     * pushes); UCX's default would also grant remote write. */
    mp.prot =
        UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE | UCP_MEM_MAP_PROT_REMOTE_READ;
    mp.address = addr;
    mp.length = len;
    mp.flags = alloc ? UCP_MEM_MAP_ALLOCATE : 0;
    if (mt != UCS_MEMORY_TYPE_HOST) {
        mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        mp.memory_type = mt;
    }
    ucs_status_t us = ucp_mem_map(a->ctx, &mp, &r->memh);
    if (us != UCS_OK) {
        KVC_LOG(a, KVC_LOG_ERROR, "ucp_mem_map len=%zu alloc=%d: %s", len, (int)alloc,
                ucs_status_string(us));
        r->memh = NULL;
        return us == UCS_ERR_NO_MEMORY ? KVC_ERR_NO_MEMORY : KVC_ERR_TRANSPORT;
    }
    ucp_mem_attr_t ma;
    memset(&ma, 0, sizeof(ma));
    ma.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    if (ucp_mem_query(r->memh, &ma) != UCS_OK || ma.length < len) {
        ucp_mem_unmap(a->ctx, r->memh);
        r->memh = NULL;
        return KVC_ERR_TRANSPORT;
    }
    r->base = ma.address;
    us = ucp_rkey_pack(a->ctx, r->memh, &r->rkey_buf, &r->rkey_len);
    if (us != UCS_OK) {
        KVC_LOG(a, KVC_LOG_ERROR, "ucp_rkey_pack: %s", ucs_status_string(us));
        r->rkey_buf = NULL;
        return KVC_ERR_TRANSPORT;
    }
    return KVC_OK;
}

/* UCX registered the region as device memory (ucp_mem_query's memory type;
 * an older UCX that cannot say is believed). */
static bool registered_as_cuda(const kvc_region_t *r) {
    ucp_mem_attr_t ma;
    memset(&ma, 0, sizeof(ma));
    ma.field_mask = UCP_MEM_ATTR_FIELD_MEM_TYPE;
    if (ucp_mem_query(r->memh, &ma) != UCS_OK) return true;
    return ma.mem_type == UCS_MEMORY_TYPE_CUDA || ma.mem_type == UCS_MEMORY_TYPE_CUDA_MANAGED;
}

static kvc_status_t region_init(kvc_agent_t *a, kvc_region_t *r, const kvc_region_params_t *p,
                                uint64_t num_blocks) {
    bool has_base = (p->field_mask & KVC_REGION_FIELD_BASE) && p->base;
    kvc_mem_type_t mt = (p->field_mask & KVC_REGION_FIELD_MEM_TYPE) ? p->mem_type : KVC_MEM_HOST;
    r->len = p->len;
    r->block_len = p->len / num_blocks;
    r->mem_type = mt;
    if (mt == KVC_MEM_HOST) {
        r->pool = !has_base;
        return map(a, r, has_base ? p->base : NULL, p->len, !has_base, UCS_MEMORY_TYPE_HOST);
    }
    if (!kvc_cuda_built()) {
        KVC_LOG(a, KVC_LOG_ERROR, "CUDA region but libkvconnector was built without CUDA");
        return KVC_ERR_UNSUPPORTED;
    }
    if (!a->cuda) {
        char err[256];
        kvc_status_t st = kvc_cuda_create(&a->cuda, err, sizeof(err));
        if (st != KVC_OK) {
            KVC_LOG(a, KVC_LOG_ERROR, "CUDA unavailable: %s", err);
            return st;
        }
    }
    /* The device comes from the pointer; cuda_device, when given, must agree. */
    int hint = (p->field_mask & KVC_REGION_FIELD_CUDA_DEVICE) ? p->cuda_device : -1;
    kvc_status_t st = kvc_cuda_region_device(a->cuda, p->base, p->len, hint, &r->cuda_dev);
    if (st != KVC_OK) {
        KVC_LOG(a, KVC_LOG_ERROR, "CUDA region at %p: %s", p->base, kvc_cuda_last_error(a->cuda));
        return st;
    }
    const char *force = getenv("KVC_CUDA_STAGED"); /* operations and the GPU check */
    if (a->cuda_native && !(force && *force && strcmp(force, "0"))) {
        st = map(a, r, p->base, p->len, false, UCS_MEMORY_TYPE_CUDA);
        if (st == KVC_OK && registered_as_cuda(r)) {
            a->cuda_direct = true;
            return st;
        }
        /* UCX says it supports CUDA memory but did not register this region
         * as such (no transport's memory domain took it: a VMM or IPC-less
         * allocation, a GPU the CUDA transports do not serve): staged. */
        KVC_LOG(a, KVC_LOG_WARN,
                "UCX could not register the CUDA region at %p (%zu bytes) as device memory (%s): "
                "staged through the pinned pool instead",
                p->base, p->len,
                st == KVC_OK ? "registered as another memory type" : kvc_status_str(st));
        if (r->rkey_buf) ucp_rkey_buffer_release(r->rkey_buf);
        if (r->memh) ucp_mem_unmap(a->ctx, r->memh);
        r->rkey_buf = NULL;
        r->memh = NULL;
        r->rkey_len = 0;
    }
    /* No CUDA memory support in UCX: nothing is registered with UCX and no
     * host copy of the region is kept; every transfer goes through the
     * agent's bounded pinned pool (stage.c), and consumers are pushed to
     * (the handshake carries no rkey for this region). */
    r->staged = true;
    r->dev_base = p->base;
    r->base = NULL;
    return KVC_OK;
}

static kvc_status_t register_impl(kvc_agent_t *a, uint64_t num_blocks,
                                        const kvc_region_params_t *rp, size_t n) {
    if (!a || !rp || n == 0 || n > KVC_WIRE_MAX_REGIONS || num_blocks == 0)
        return KVC_ERR_INVALID_PARAM;
    if (a->n_regions) return KVC_ERR_STATE;
    for (size_t i = 0; i < n; i++) {
        bool has_base = (rp[i].field_mask & KVC_REGION_FIELD_BASE) && rp[i].base;
        kvc_mem_type_t mt =
            (rp[i].field_mask & KVC_REGION_FIELD_MEM_TYPE) ? rp[i].mem_type : KVC_MEM_HOST;
        if (rp[i].len == 0 || rp[i].len % num_blocks ||
            (mt != KVC_MEM_HOST && mt != KVC_MEM_CUDA) || (mt == KVC_MEM_CUDA && !has_base))
            return KVC_ERR_INVALID_PARAM;
    }
    kvc_region_t *regs = calloc(n, sizeof(*regs));
    if (!regs) return KVC_ERR_NO_MEMORY;
    kvc_status_t st = KVC_OK;
    size_t done = 0;
    for (; done < n; done++) {
        st = region_init(a, &regs[done], &rp[done], num_blocks);
        if (st != KVC_OK) goto err_regions;
    }
    a->regions = regs;
    a->n_regions = n;
    a->num_blocks = num_blocks;
    for (size_t i = 0; i < n; i++) {
        a->n_staged += regs[i].staged;
        if (regs[i].mem_type == KVC_MEM_CUDA)
            a->stats[regs[i].staged ? KVC_STAT_CUDA_STAGED_REGIONS
                                    : KVC_STAT_CUDA_DIRECT_REGIONS]++;
    }
    if (a->n_staged && (st = kvc_stage_init(a)) != KVC_OK) goto err_built;
    kvc_ipc_export(a); /* none (logged) when the memory cannot be exported */
    if ((st = kvc_mem_build_handshake(a)) != KVC_OK) goto err_built;
    KVC_LOG(a, KVC_LOG_INFO, "registered regions=%zu num_blocks=%llu block_len0=%zu pool=%d", n,
            (unsigned long long)num_blocks, regs[0].block_len, (int)regs[0].pool);
    return KVC_OK;

err_built:
    kvc_stage_cleanup(a);
    kvc_ipc_export_cleanup(a);
    a->regions = NULL;
    a->n_regions = 0;
    a->num_blocks = 0;
    a->n_staged = 0;
    a->stats[KVC_STAT_CUDA_STAGED_REGIONS] = a->stats[KVC_STAT_CUDA_DIRECT_REGIONS] = 0;
    done = n;
err_regions:
    for (size_t i = 0; i <= done && i < n; i++)
        region_cleanup(a, &regs[i]);
    free(regs);
    a->cuda_direct = false;
    kvc_mem_build_handshake(a);
    return st;
}

kvc_status_t kvc_region_base(const kvc_agent_t *a, size_t idx, void **base) {
    if (!a || !base) return KVC_ERR_INVALID_PARAM;
    if (idx >= a->n_regions) return KVC_ERR_NOT_FOUND;
    *base = a->regions[idx].staged ? a->regions[idx].dev_base : a->regions[idx].base;
    return KVC_OK;
}

static kvc_status_t build_one(kvc_agent_t *a, bool rkeys, kvc_buf_t *out) {
    kvc_wire_hs_t hs;
    memset(&hs, 0, sizeof(hs));
    hs.engine_id = (kvc_span_t){(const uint8_t *)a->engine_id, strlen(a->engine_id)};
    hs.layout = (kvc_span_t){(const uint8_t *)a->layout, strlen(a->layout)};
    hs.worker_addr = (kvc_span_t){(const uint8_t *)a->worker_addr, a->worker_addr_len};
    hs.nonce = a->nonce;
    hs.tp_size = a->tp_size;
    hs.num_blocks = a->num_blocks;
    hs.n_regions = (uint32_t)a->n_regions;
    kvc_wire_region_t *wr = NULL;
    if (a->n_regions) {
        wr = calloc(a->n_regions, sizeof(*wr));
        if (!wr) return KVC_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < a->n_regions; i++) {
        kvc_region_t *r = &a->regions[i];
        wr[i].base = (uint64_t)(uintptr_t)r->base;
        wr[i].len = r->len;
        wr[i].block_len = r->block_len;
        /* Staged regions: no address or rkey a consumer could read (push). */
        wr[i].mem_type = (uint8_t)(r->staged ? KVC_MEM_HOST : r->mem_type);
        wr[i].flags =
            (uint8_t)((r->pool ? KVC_RFLAG_POOL : 0) | (r->staged ? KVC_RFLAG_STAGED : 0));
        if (rkeys) wr[i].rkey = (kvc_span_t){r->rkey_buf, r->rkey_len};
    }
    hs.regions = wr;
    kvc_buf_t b = {0};
    kvc_wire_encode_handshake(&b, a->wire_version, &hs);
    free(wr);
    if (b.failed) {
        kvc_buf_cleanup(&b);
        return KVC_ERR_NO_MEMORY;
    }
    kvc_buf_cleanup(out);
    *out = b;
    return KVC_OK;
}

/* Two prebuilt replies: with rkeys for consumers that read one-sided, without
 * for those the producer pushes to (they never need a key). */
kvc_status_t kvc_mem_build_handshake(kvc_agent_t *a) {
    kvc_status_t st = build_one(a, true, &a->hs_msg);
    if (st == KVC_OK) st = build_one(a, false, &a->hs_msg_nokeys);
    return st;
}

kvc_status_t kvc_agent_register_regions(kvc_agent_t *a, uint64_t num_blocks,
                                        const kvc_region_params_t *regions, size_t n) {
    if (!a) return KVC_ERR_INVALID_PARAM;
    kvc_lock(a);
    kvc_status_t st = register_impl(a, num_blocks, regions, n);
    kvc_unlock(a);
    return st;
}
