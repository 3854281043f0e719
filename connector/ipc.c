/* SPDX-License-Identifier: Apache-2.0 */
/* Same-node CUDA IPC, with the CUDA runtime alone (no UCX CUDA transport):
 * a consumer on the producer's node maps the producer's device memory and
 * copies device to device on its own streams; no byte crosses UCX or host
 * memory.
 *
 * Producer (kvc_ipc_export, at registration): the allocation holding each
 * CUDA region is exported with cudaIpcGetMemHandle of its base (the
 * driver's address range of the region; the region's offset inside it
 * travels along), once per allocation.  The table (host identity, pid,
 * allocations with the PCI bus id of their GPU, regions) goes only to a
 * consumer that asked for it (KVC_HFLAG_IPC) and connected from this host,
 * inside the sealed HANDSHAKE, under its MAC.  Memory that has no such
 * handle (cuMemCreate/VMM mappings, stream-ordered pools) is not exported:
 * its consumers are served by push, as before.
 *
 * Consumer (kvc_ipc_peer_open, after the handshake): uses the table only
 * when the producer runs on this node and is another process (same boot id,
 * IPC and PID namespaces; another pid: CUDA cannot open a handle in the
 * process that made it), each producer GPU is visible here (PCI bus id),
 * and every allocation opens (cudaIpcOpenMemHandle, on the device of the
 * local region that reads it).  Otherwise the peer is served as before
 * (staged push) and nothing fails.  The mappings are opened once per
 * producer instance and closed when the peer goes.
 *
 * A fetch over IPC is a one-sided read (xfer.c): a HOLD pull, the copies,
 * an UNHOLD pull.  The copies are queued on the connector's stream of each
 * local device, an event recorded after them and polled (never a host
 * wait); the UNHOLD goes out only once every copy completed, so its END
 * means the producer held the blocks for the whole read, and FETCH_DONE
 * follows.  A refusal (DENIED: expired, released, hold broken by the
 * producer's xfer timeout) fails the fetch, the copied bytes may be of
 * reused blocks.  No stream order crosses processes: the producer's writes
 * must be complete before a consumer copies, so kvc_publish syncs its
 * CUDA wait on the host when the agent exports (publish.c).  A copy that
 * fails, or a producer that dies mid-copy (its END never comes), fails the
 * fetch; FETCH_FAILED comes after the copies were drained. */
#include "connector/kvc_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct kvc_ipc_peer {
    struct ipc_map {
        uint32_t alloc;
        int dev; /* the local device it is mapped on */
        void *ptr;
    } * maps; /* owned: opened mappings */
    uint32_t n_maps;
    const uint8_t **src; /* owned array: each region's first byte in the mappings */
};

/* This node and namespace: the kernel's boot id, then the IPC and PID
 * namespaces (a container with its own sees other handles and pids).
 * False when it cannot be told (then no IPC). */
static bool host_identity(char *out, size_t len) {
    const char *t = getenv("KVC_TEST_HOST_ID"); /* tests only: pose as another node */
    if (t && *t) {
        snprintf(out, len, "%s", t);
        return true;
    }
    char boot[64] = "", ipc[64] = "", pid[64] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof(boot), f)) boot[0] = 0;
        fclose(f);
    }
    boot[strcspn(boot, "\n")] = 0;
    ssize_t n = readlink("/proc/self/ns/ipc", ipc, sizeof(ipc) - 1);
    ipc[n > 0 ? n : 0] = 0;
    n = readlink("/proc/self/ns/pid", pid, sizeof(pid) - 1);
    pid[n > 0 ? n : 0] = 0;
    if (!boot[0] || !ipc[0] || !pid[0]) return false;
    snprintf(out, len, "%s/%s/%s", boot, ipc, pid);
    return true;
}

static void *region_dev_ptr(const kvc_region_t *r) {
    return r->staged ? r->dev_base : r->base;
}

bool kvc_ipc_can_import(const kvc_agent_t *a) {
    if (a->ipc_off || !a->cuda || !a->n_regions) return false;
    for (size_t i = 0; i < a->n_regions; i++)
        if (a->regions[i].mem_type != KVC_MEM_CUDA) return false;
    return true;
}

void kvc_ipc_export(kvc_agent_t *a) {
    kvc_buf_cleanup(&a->ipc_tab);
    char host[256];
    if (!kvc_ipc_can_import(a) || !host_identity(host, sizeof(host))) return;
    size_t n = a->n_regions;
    kvc_cuda_export_t *ex = calloc(n, sizeof(*ex));
    uint32_t *ra = calloc(n, sizeof(*ra)), na = 0;
    uint64_t *off = calloc(n, sizeof(*off));
    if (!ex || !ra || !off) goto out;
    for (size_t r = 0; r < n; r++) {
        const kvc_region_t *rg = &a->regions[r];
        kvc_cuda_export_t e;
        void *p = region_dev_ptr(rg);
        kvc_status_t st = kvc_cuda_ipc_export(a->cuda, rg->cuda_dev, p, rg->len, &e);
        if (st != KVC_OK) {
            KVC_LOG(a, KVC_LOG_INFO,
                    "CUDA IPC off: region %zu cannot be exported (%s); consumers on this node "
                    "are served by push",
                    r, kvc_cuda_last_error(a->cuda));
            goto out;
        }
        uint32_t k = 0;
        while (k < na && (ex[k].base != e.base || strcmp(ex[k].bus, e.bus)))
            k++;
        if (k == na) ex[na++] = e;
        ra[r] = k;
        off[r] = (uint64_t)(uintptr_t)p - e.base;
    }
    kvc_wire_encode_ipc(&a->ipc_tab, host, (uint32_t)getpid(), ex, na, ra, off, (uint32_t)n);
    if (a->ipc_tab.failed || a->ipc_tab.len > KVC_WIRE_MAX_BLOB) {
        kvc_buf_cleanup(&a->ipc_tab);
        goto out;
    }
    KVC_LOG(a, KVC_LOG_INFO, "CUDA IPC: %zu regions in %u exported allocations", n, na);
out:
    /* The handles name memory: wiped with the table's copies. */
    if (ex) memset(ex, 0, n * sizeof(*ex));
    free(ex);
    free(ra);
    free(off);
}

void kvc_ipc_export_cleanup(kvc_agent_t *a) {
    if (a->ipc_tab.p) memset(a->ipc_tab.p, 0, a->ipc_tab.len);
    kvc_buf_cleanup(&a->ipc_tab);
}

void kvc_ipc_hs_append(const kvc_agent_t *a, kvc_buf_t *b) {
    kvc_buf_u32(b, (uint32_t)a->ipc_tab.len);
    kvc_buf_put(b, a->ipc_tab.p, a->ipc_tab.len);
}

static void peer_free_maps(kvc_agent_t *a, kvc_ipc_peer_t *ip) {
    for (uint32_t i = 0; i < ip->n_maps; i++)
        kvc_cuda_ipc_close(a->cuda, ip->maps[i].dev, ip->maps[i].ptr);
    free(ip->maps);
    free(ip->src);
    free(ip);
}

/* Opens what region r reads; false (logged) when it cannot. */
static bool map_region(kvc_agent_t *a, kvc_peer_t *p, kvc_ipc_peer_t *ip, const kvc_ipc_table_t *t,
                       size_t r) {
    uint32_t k = t->reg_alloc[r];
    const kvc_ipc_alloc_t *al = &t->allocs[k];
    int dev = a->regions[r].cuda_dev;
    for (uint32_t i = 0; i < ip->n_maps; i++)
        if (ip->maps[i].alloc == k && ip->maps[i].dev == dev) {
            ip->src[r] = (const uint8_t *)ip->maps[i].ptr + t->reg_off[r];
            return true;
        }
    char bus[KVC_IPC_BUS_LEN];
    snprintf(bus, sizeof(bus), "%.*s", (int)al->bus.len, (const char *)al->bus.p);
    if (kvc_cuda_device_by_bus(a->cuda, bus) < 0) {
        KVC_LOG(a, KVC_LOG_INFO,
                "CUDA IPC with engine %s off: its GPU %s is not visible here; pushed instead",
                p->engine_id, bus);
        return false;
    }
    void *ptr = NULL;
    if (kvc_cuda_ipc_open(a->cuda, dev, al->handle.p, &ptr) != KVC_OK) {
        KVC_LOG(a, KVC_LOG_WARN, "CUDA IPC with engine %s off: %s; pushed instead", p->engine_id,
                kvc_cuda_last_error(a->cuda));
        return false;
    }
    ip->maps[ip->n_maps++] = (struct ipc_map){k, dev, ptr};
    ip->src[r] = (const uint8_t *)ptr + t->reg_off[r];
    return true;
}

void kvc_ipc_peer_open(kvc_agent_t *a, kvc_peer_t *p, kvc_span_t table) {
    if (!table.len || !kvc_ipc_can_import(a) || p->n_regions != a->n_regions) return;
    uint64_t *rlen = calloc(p->n_regions, sizeof(*rlen));
    kvc_ipc_table_t t;
    if (!rlen) return;
    for (uint32_t i = 0; i < p->n_regions; i++)
        rlen[i] = p->rr[i].len;
    kvc_status_t st = kvc_wire_parse_ipc(table.p, table.len, rlen, p->n_regions, &t);
    free(rlen);
    if (st != KVC_OK) {
        KVC_LOG(a, KVC_LOG_WARN, "CUDA IPC with engine %s off: malformed IPC table (%s)",
                p->engine_id, kvc_status_str(st));
        return;
    }
    char host[256];
    uint64_t t0 = kvc_now_ns();
    kvc_ipc_peer_t *ip = NULL;
    if (!host_identity(host, sizeof(host)) || strlen(host) != t.host.len ||
        memcmp(host, t.host.p, t.host.len)) {
        KVC_LOG(a, KVC_LOG_DEBUG, "CUDA IPC with engine %s off: another node or namespace",
                p->engine_id);
        goto out;
    }
    if (t.pid == (uint32_t)getpid()) {
        KVC_LOG(a, KVC_LOG_DEBUG,
                "CUDA IPC with engine %s off: same process (CUDA opens no handle of its own)",
                p->engine_id);
        goto out;
    }
    ip = calloc(1, sizeof(*ip));
    if (!ip || !(ip->maps = calloc(a->n_regions, sizeof(*ip->maps))) ||
        !(ip->src = calloc(a->n_regions, sizeof(*ip->src))))
        goto fail;
    for (size_t r = 0; r < a->n_regions; r++)
        if (!map_region(a, p, ip, &t, r)) goto fail;
    p->ipc = ip;
    KVC_LOG(a, KVC_LOG_INFO, "CUDA IPC with engine %s: %u allocations mapped in %.2f ms",
            p->engine_id, ip->n_maps, (double)(kvc_now_ns() - t0) / 1e6);
    goto out;
fail:
    if (ip) peer_free_maps(a, ip);
out:
    kvc_wire_ipc_cleanup(&t);
}

void kvc_ipc_peer_close(kvc_agent_t *a, kvc_peer_t *p) {
    if (!p->ipc) return;
    /* Copies still queued read the mappings: they end first. */
    kvc_cuda_drain(a->cuda);
    peer_free_maps(a, p->ipc);
    p->ipc = NULL;
}

kvc_status_t kvc_ipc_copy(kvc_agent_t *a, kvc_peer_t *p, const kvc_run_t *runs, size_t n,
                          kvc_ipc_job_t *j) {
    if (!p->ipc) return KVC_ERR_STATE;
    if (!j->ev) {
        j->ev = calloc(a->n_regions, sizeof(*j->ev));
        j->dev = calloc(a->n_regions, sizeof(*j->dev));
        if (!j->ev || !j->dev) return KVC_ERR_NO_MEMORY;
    }
    for (size_t r = 0; r < a->n_regions; r++) {
        const kvc_region_t *rg = &a->regions[r];
        int k = 0;
        while (k < j->n && j->dev[k] != rg->cuda_dev)
            k++;
        if (k == j->n) j->dev[j->n++] = rg->cuda_dev;
        /* One event per device, recorded again after each region's copies:
         * the stream runs them in order, so the last record covers all. */
        kvc_status_t st = kvc_cuda_d2d_runs(a->cuda, rg->cuda_dev, region_dev_ptr(rg),
                                            p->ipc->src[r], rg->block_len, runs, n, &j->ev[k]);
        if (st != KVC_OK) return st;
    }
    return KVC_OK;
}

int kvc_ipc_poll(kvc_agent_t *a, kvc_ipc_job_t *j, kvc_status_t *st) {
    for (int k = 0; k < j->n; k++) {
        int q = j->ev[k] ? kvc_cuda_event_poll(a->cuda, j->ev[k], st) : 1;
        if (q <= 0) return q;
    }
    return 1;
}

void kvc_ipc_job_cleanup(kvc_agent_t *a, kvc_ipc_job_t *j) {
    for (int k = 0; j->ev && k < j->n; k++)
        if (j->ev[k]) kvc_cuda_event_destroy(a->cuda, j->ev[k]);
    free(j->ev);
    free(j->dev);
    memset(j, 0, sizeof(*j));
}
