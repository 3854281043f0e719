/* CUDA end-to-end check of libkvconnector: a producer and a consumer agent
 * (one process, two agents, both driven here) move blocks between CUDA
 * regions.  Without UCX CUDA support the bytes are staged through pinned host
 * mirrors (device->host at publish, host->device before FETCH_DONE).
 * Exit 0: pass; 77: skipped (no usable CUDA device); 1: failure. */
#include "kvconnector.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NREG 4
#define NBLOCKS 256
#define BLOCK (64 << 10)

static uint8_t pat(int r, uint64_t b, size_t i) {
    return (uint8_t)(r * 131 + b * 7 + i * 13 + (i >> 9));
}

static kvc_agent_t *agent(const char *name, void **dev) {
    kvc_agent_params_t ap = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID, .engine_id = name};
    kvc_agent_t *a;
    if (kvc_agent_create(&ap, &a) != KVC_OK) return NULL;
    kvc_region_params_t rp[NREG];
    memset(rp, 0, sizeof(rp));
    for (int r = 0; r < NREG; r++) {
        rp[r].field_mask = KVC_REGION_FIELD_BASE | KVC_REGION_FIELD_MEM_TYPE;
        rp[r].base = dev[r];
        rp[r].len = (size_t)NBLOCKS * BLOCK;
        rp[r].mem_type = KVC_MEM_CUDA;
    }
    kvc_status_t st = kvc_agent_register_regions(a, NBLOCKS, rp, NREG);
    if (st != KVC_OK) {
        fprintf(stderr, "register CUDA regions: %s\n", kvc_status_str(st));
        kvc_agent_destroy(a);
        return NULL;
    }
    return a;
}

int main(void) {
    int n = 0;
    cudaError_t ce = cudaGetDeviceCount(&n);
    if (ce != cudaSuccess || n == 0) {
        printf("SKIP: no CUDA device (%s)\n",
               ce == cudaSuccess ? "count 0" : cudaGetErrorString(ce));
        return 77;
    }
    size_t len = (size_t)NBLOCKS * BLOCK;
    uint8_t *host = malloc(len);
    void *pdev[NREG], *ddev[NREG];
    for (int r = 0; r < NREG; r++) {
        if (cudaMalloc(&pdev[r], len) != cudaSuccess || cudaMalloc(&ddev[r], len) != cudaSuccess) {
            fprintf(stderr, "cudaMalloc failed\n");
            return 1;
        }
        for (uint64_t b = 0; b < NBLOCKS; b++)
            for (size_t i = 0; i < BLOCK; i++)
                host[b * BLOCK + i] = pat(r, b, i);
        cudaMemcpy(pdev[r], host, len, cudaMemcpyHostToDevice);
        cudaMemset(ddev[r], 0, len);
    }
    kvc_agent_t *P = agent("gpu-P", pdev), *D = agent("gpu-D", ddev);
    if (!P || !D) return 1;

    uint64_t remote[64], local[64];
    for (int i = 0; i < 64; i++) {
        remote[i] = (uint64_t)(i < 32 ? 10 + i : 200 - i); /* a run, then descending ids */
        local[i] = (uint64_t)(100 + i);
    }
    char *json;
    kvc_status_t st = kvc_publish(P, "gpu-req:1", remote, 64, NULL, &json);
    if (st != KVC_OK) {
        fprintf(stderr, "publish: %s\n", kvc_status_str(st));
        return 1;
    }
    kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS,
                             .kv_transfer_params_json = json,
                             .local_block_ids = local,
                             .num_local_blocks = 64};
    uint64_t xid;
    if ((st = kvc_fetch(D, &fp, &xid)) != KVC_INPROGRESS) {
        fprintf(stderr, "fetch: %s\n", kvc_status_str(st));
        return 1;
    }
    kvc_free(json);
    int done = 0, released = 0;
    for (int spin = 0; spin < 200000 && !(done && released); spin++) {
        kvc_agent_progress(P);
        kvc_agent_progress(D);
        kvc_event_t ev;
        while (kvc_agent_next_event(D, &ev) == KVC_OK) {
            if (ev.type == KVC_EV_FETCH_FAILED) {
                fprintf(stderr, "fetch failed: %s %s\n", kvc_status_str(ev.status), ev.message);
                return 1;
            }
            done |= ev.type == KVC_EV_FETCH_DONE;
        }
        while (kvc_agent_next_event(P, &ev) == KVC_OK)
            released |= ev.type == KVC_EV_RELEASED;
    }
    if (!done || !released) {
        fprintf(stderr, "timed out: done=%d released=%d\n", done, released);
        return 1;
    }
    int bad = 0;
    for (int r = 0; r < NREG && !bad; r++) {
        cudaMemcpy(host, ddev[r], len, cudaMemcpyDeviceToHost);
        for (int k = 0; k < 64 && !bad; k++)
            for (size_t i = 0; i < BLOCK; i++)
                if (host[local[k] * BLOCK + i] != pat(r, remote[k], i)) {
                    fprintf(stderr, "mismatch region %d local block %llu byte %zu\n", r,
                            (unsigned long long)local[k], i);
                    bad = 1;
                    break;
                }
    }
    kvc_agent_destroy(D);
    kvc_agent_destroy(P);
    for (int r = 0; r < NREG; r++) {
        cudaFree(pdev[r]);
        cudaFree(ddev[r]);
    }
    free(host);
    printf("%s: 64 blocks x %d regions x %d KiB, device->device via %s\n", bad ? "FAIL" : "PASS",
           NREG, BLOCK >> 10, getenv("UCX_TLS") ? getenv("UCX_TLS") : "default UCX_TLS");
    return bad;
}
