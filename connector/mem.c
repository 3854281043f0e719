/* KV regions: registration of caller memory, connector-allocated host pools
 * (ucp_mem_map ALLOCATE: shared memory, so same-host gets are one-sided),
 * CUDA staging mirrors, packed rkeys, and the handshake reply built from them. */
#include "kvc_int.h"

#include <stdlib.h>
#include <string.h>

static void region_cleanup(kvc_agent_t *a, kvc_region_t *r) {
    if (r->rkey_buf) ucp_rkey_buffer_release(r->rkey_buf);
    if (r->staged && !r->unpinned && a->cuda) kvc_cuda_host_unregister(a->cuda, r->base);
    if (r->memh) ucp_mem_unmap(a->ctx, r->memh);
    memset(r, 0, sizeof(*r));
}

void kvc_mem_cleanup(kvc_agent_t *a) {
    /* Copies still queued read or write the mirrors: they end first. */
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
        if (st == KVC_OK) a->cuda_direct = true;
        return st;
    }
    /* No CUDA memory support in UCX: a pinned host mirror in shared memory
     * carries the bytes; cudaMemcpyAsync moves them between mirror and
     * device on the device's own stream. */
    st = map(a, r, NULL, p->len, true, UCS_MEMORY_TYPE_HOST);
    if (st != KVC_OK) return st;
    /* Pinning makes the copies asynchronous and fast; without it they still
     * work (pageable), so a refusal is only worth a warning. */
    if (kvc_cuda_host_register(a->cuda, r->base, r->len) != KVC_OK) {
        KVC_LOG(a, KVC_LOG_WARN, "%zu-byte mirror not pinned, copies will be slower: %s", r->len,
                kvc_cuda_last_error(a->cuda));
        r->unpinned = true;
    }
    r->staged = true;
    r->pool = true;
    r->dev_base = p->base;
    return KVC_OK;
}

kvc_status_t kvc_agent_register_regions(kvc_agent_t *a, uint64_t num_blocks,
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
    if ((st = kvc_mem_build_handshake(a)) != KVC_OK) goto err_built;
    KVC_LOG(a, KVC_LOG_INFO, "registered regions=%zu num_blocks=%llu block_len0=%zu pool=%d", n,
            (unsigned long long)num_blocks, regs[0].block_len, (int)regs[0].pool);
    return KVC_OK;

err_built:
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

/* The largest block_len of the staged regions (plans are made for it). */
static size_t staged_block_len(const kvc_agent_t *a) {
    size_t m = 0;
    for (size_t i = 0; i < a->n_regions; i++)
        if (a->regions[i].staged && a->regions[i].block_len > m) m = a->regions[i].block_len;
    return m;
}

kvc_status_t kvc_stage_copy(kvc_agent_t *a, const uint64_t *ids, size_t n, bool to_device) {
    kvc_crun_t *runs = NULL;
    size_t nruns = 0;
    kvc_status_t st = kvc_cuda_plan(ids, n, staged_block_len(a), &runs, &nruns);
    for (size_t r = 0; r < a->n_regions && st == KVC_OK; r++) {
        kvc_region_t *rg = &a->regions[r];
        if (!rg->staged) continue;
        st = kvc_cuda_copy_runs(a->cuda, rg->cuda_dev, rg->dev_base, rg->base, rg->block_len, runs,
                                nruns, to_device);
        if (st == KVC_OK) a->stats[KVC_STAT_CUDA_COPIES] += nruns;
    }
    free(runs);
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
        /* Consumers see host memory for staged regions: the mirror. */
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
