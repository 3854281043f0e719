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
 * handle because the engine maps it itself with the VMM API (cuMemCreate,
 * cuMemMap: PyTorch's expandable segments) is exported as its pieces, the
 * physical allocations mapped one after the other (cuda_vmm.c): contiguous
 * pieces of the regions form one allocation of the table, and the pieces'
 * POSIX fds go to an authenticated consumer over a Unix socket (ipcfd.c)
 * whose name and token the table carries.  Allocations created without the
 * POSIX fd handle type (vLLM's sleep-mode allocator) and stream-ordered
 * pools cannot leave the process: their consumers are served by push.
 *
 * Consumer (kvc_ipc_peer_open, after the handshake): uses the table only
 * when the producer runs on this node and is another process (same boot id,
 * IPC and PID namespaces; another pid: CUDA cannot open a handle in the
 * process that made it), each producer GPU is visible here (PCI bus id),
 * and every allocation opens (cudaIpcOpenMemHandle, on the device of the
 * local region that reads it).  VMM allocations open once their fds came
 * (the peer waits in PEER_IPC, its fetches queued): each piece imported
 * (cuMemImportFromShareableHandle), the pieces mapped in order into one
 * reserved range per allocation and device (cuMemMap, cuMemSetAccess),
 * the fds and imported handles released at once (the mappings keep the
 * memory).  Otherwise the peer is served as before (staged push) and
 * nothing fails.  The mappings are opened once per producer instance and
 * closed when the peer goes.
 *
 * A fetch over IPC is a one-sided read (xfer.c): a HOLD pull, the copies,
 * an UNHOLD pull.  The copies are queued on the connector's stream of each
 * local device, an event recorded after them and polled (never a host
 * wait); the UNHOLD goes out only once every copy completed, so its END
 * means the producer held the blocks for the whole read, and FETCH_DONE
 * follows.  A refusal (DENIED: expired, released, hold broken by the
 * producer's xfer timeout) fails the fetch, the copied bytes may be of
 * reused blocks.  No stream order crosses processes: the producer's writes
 * must be complete before a consumer copies, so kvc_publish records an
 * event after its CUDA wait when the agent exports (publish.c), and the
 * producer checks it before it confirms a HOLD, waiting for it on the host
 * only if the writes still run then (push.c).  A copy that
 * fails, or a producer that dies mid-copy (its END never comes), fails the
 * fetch; FETCH_FAILED comes after the copies were drained. */
#include "connector/kvc_int.h"
#include "connector/kvc_vmm.h"

#include <openssl/crypto.h>
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
    /* VMM allocations (KVC_IPC_KIND_VMM): what the table said of them,
     * kept while their fds come and for unmapping. */
    struct vmm_alloc {
        uint8_t kind;
        uint32_t first, n;
    } * allocs; /* owned, n_allocs */
    uint32_t n_allocs;
    uint64_t *piece_size;   /* owned, n_pieces */
    uint32_t n_pieces, got; /* fds imported so far */
    uint64_t *handles;      /* owned: imported, released once mapped */
    uint32_t *reg_alloc;    /* owned: region -> allocation */
    uint64_t *reg_off;      /* owned */
    kvc_ipcfd_cli_t *cli;   /* owned while the fds come */
    kvc_pollent_t pe;
    uint64_t t0;
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

/* ------------------------------------------------------------ producer -- */

/* The VMM pieces of the regions being exported, with their devices. */
typedef struct {
    kvc_vmm_piece_t pc;
    int dev;
} vpiece_t;
typedef struct {
    vpiece_t *p; /* owned, handles retained */
    size_t n, cap;
} vset_t;

static void release_pieces(kvc_agent_t *a, const vpiece_t *v, size_t n) {
    kvc_vmm_piece_t *pc = n ? malloc(n * sizeof(*pc)) : NULL;
    for (size_t i = 0; pc && i < n; i++)
        pc[i] = v[i].pc;
    kvc_cuda_vmm_release(a->cuda, pc, pc ? n : 0);
}

/* Region rg's pieces added to v; false with the message set. */
static bool vmm_collect(kvc_agent_t *a, vset_t *v, const kvc_region_t *rg, void *p) {
    kvc_vmm_piece_t *pc = NULL;
    size_t n = 0;
    if (kvc_cuda_vmm_pieces(a->cuda, rg->cuda_dev, p, rg->len, true, &pc, &n) != KVC_OK)
        return false;
    if (v->n + n > v->cap) {
        size_t cap = v->cap * 2 > v->n + n ? v->cap * 2 : v->n + n;
        vpiece_t *np = realloc(v->p, cap * sizeof(*np));
        if (!np) {
            kvc_cuda_vmm_release(a->cuda, pc, n);
            return false;
        }
        v->p = np;
        v->cap = cap;
    }
    for (size_t i = 0; i < n; i++)
        v->p[v->n++] = (vpiece_t){pc[i], rg->cuda_dev};
    free(pc);
    return true;
}

static int by_base(const void *x, const void *y) {
    const vpiece_t *a = x, *b = y;
    return a->pc.base < b->pc.base ? -1 : a->pc.base > b->pc.base;
}

/* Sorts the pieces, drops the ones several regions share, and makes each
 * run of contiguous pieces of one device an allocation of the table
 * (appended to ex, *na of them); VMM region r then reads allocation ra[r]
 * from offset off[r].  False (logged) when pieces overlap or too many. */
static bool vmm_layout(kvc_agent_t *a, vset_t *v, kvc_cuda_export_t *ex, uint32_t *na, uint32_t *ra,
                       uint64_t *off, const bool *vmm) {
    qsort(v->p, v->n, sizeof(*v->p), by_base);
    size_t k = 0;
    for (size_t i = 0; i < v->n; i++) {
        vpiece_t *prev = k ? &v->p[k - 1] : NULL;
        if (prev && prev->pc.base == v->p[i].pc.base && prev->pc.size == v->p[i].pc.size) {
            release_pieces(a, &v->p[i], 1); /* the same mapping, seen from another region */
            continue;
        }
        if (prev && prev->pc.base + prev->pc.size > v->p[i].pc.base) {
            KVC_LOG(a, KVC_LOG_WARN, "CUDA IPC off: VMM mappings at %#llx and %#llx overlap",
                    (unsigned long long)prev->pc.base, (unsigned long long)v->p[i].pc.base);
            release_pieces(a, &v->p[i], v->n - i);
            v->n = k;
            return false;
        }
        v->p[k++] = v->p[i];
    }
    v->n = k;
    if (v->n > KVC_IPC_MAX_PIECES) {
        KVC_LOG(a, KVC_LOG_INFO,
                "CUDA IPC off: %zu VMM allocations behind the regions (at most %u)", v->n,
                KVC_IPC_MAX_PIECES);
        return false;
    }
    uint32_t first_seg = *na;
    for (size_t i = 0; i < v->n; i++) {
        const vpiece_t *q = &v->p[i];
        kvc_cuda_export_t *cur = *na > first_seg ? &ex[*na - 1] : NULL;
        if (!cur || cur->base + cur->size != q->pc.base || v->p[i - 1].dev != q->dev) {
            cur = &ex[(*na)++];
            memset(cur, 0, sizeof(*cur));
            *cur = (kvc_cuda_export_t){
                .base = q->pc.base, .kind = KVC_IPC_KIND_VMM, .first_piece = (uint32_t)i};
            if (kvc_cuda_bus_id(a->cuda, q->dev, cur->bus) != KVC_OK) {
                KVC_LOG(a, KVC_LOG_WARN, "CUDA IPC off: %s", kvc_cuda_last_error(a->cuda));
                return false;
            }
        }
        cur->size += q->pc.size;
        cur->n_pieces++;
    }
    for (size_t r = 0; r < a->n_regions; r++) {
        if (!vmm[r]) continue;
        uint64_t p = (uint64_t)(uintptr_t)region_dev_ptr(&a->regions[r]);
        for (uint32_t s = first_seg; s < *na; s++)
            if (p >= ex[s].base && p - ex[s].base < ex[s].size) {
                ra[r] = s;
                off[r] = p - ex[s].base;
            }
    }
    return true;
}

/* Hands the pieces to the fd socket (ipcfd.c); its name and token into in. */
static bool vmm_serve(kvc_agent_t *a, vset_t *v, kvc_ipc_tab_in_t *in, uint64_t **sizes,
                      char name[KVC_IPC_SOCK_LEN], uint8_t token[KVC_IPC_FD_TOKEN_LEN]) {
    kvc_vmm_piece_t *pc = malloc(v->n * sizeof(*pc));
    int *dev = malloc(v->n * sizeof(*dev));
    *sizes = malloc(v->n * sizeof(**sizes));
    if (!pc || !dev || !*sizes) {
        free(pc);
        free(dev);
        return false;
    }
    for (size_t i = 0; i < v->n; i++) {
        pc[i] = v->p[i].pc;
        dev[i] = v->p[i].dev;
        (*sizes)[i] = v->p[i].pc.size;
    }
    size_t n = v->n;
    v->n = 0; /* the server owns the handles now, also when it fails */
    if (kvc_ipcfd_serve(a, pc, dev, n, name, token) != KVC_OK) {
        kvc_cuda_vmm_release(a->cuda, pc, n);
        free(dev);
        return false;
    }
    in->piece_size = *sizes;
    in->n_pieces = (uint32_t)n;
    in->sock = name;
    in->token = token;
    return true;
}

void kvc_ipc_export(kvc_agent_t *a) {
    kvc_ipc_export_cleanup(a);
    char host[256], name[KVC_IPC_SOCK_LEN] = "";
    uint8_t token[KVC_IPC_FD_TOKEN_LEN];
    if (!kvc_ipc_can_import(a) || !host_identity(host, sizeof(host))) return;
    size_t n = a->n_regions;
    /* Legacy allocations and VMM runs: n of each at most. */
    kvc_cuda_export_t *ex = calloc(2 * n, sizeof(*ex));
    uint32_t *ra = calloc(n, sizeof(*ra)), na = 0;
    uint64_t *off = calloc(n, sizeof(*off)), *sizes = NULL;
    bool *vmm = calloc(n, sizeof(*vmm));
    vset_t v = {0};
    kvc_ipc_tab_in_t in = {.host = host, .pid = (uint32_t)getpid()};
    if (!ex || !ra || !off || !vmm) goto out;
    for (size_t r = 0; r < n; r++) {
        const kvc_region_t *rg = &a->regions[r];
        kvc_cuda_export_t e;
        void *p = region_dev_ptr(rg);
        kvc_status_t st = kvc_cuda_ipc_export(a->cuda, rg->cuda_dev, p, rg->len, &e);
        if (st != KVC_OK) {
            char why[320];
            snprintf(why, sizeof(why), "%s", kvc_cuda_last_error(a->cuda));
            /* Mapped by the engine with the VMM API: its pieces instead. */
            if (st == KVC_ERR_UNSUPPORTED && vmm_collect(a, &v, rg, p)) {
                vmm[r] = true;
                continue;
            }
            KVC_LOG(a, KVC_LOG_INFO,
                    "CUDA IPC off: region %zu cannot be exported (%s; as VMM memory: %s); "
                    "consumers on this node are served by push",
                    r, why, kvc_cuda_last_error(a->cuda));
            goto out;
        }
        uint32_t k = 0;
        while (k < na && (ex[k].base != e.base || strcmp(ex[k].bus, e.bus)))
            k++;
        if (k == na) ex[na++] = e;
        ra[r] = k;
        off[r] = (uint64_t)(uintptr_t)p - e.base;
    }
    if (v.n &&
        (!vmm_layout(a, &v, ex, &na, ra, off, vmm) || !vmm_serve(a, &v, &in, &sizes, name, token)))
        goto out;
    in.allocs = ex;
    in.n_allocs = na;
    in.reg_alloc = ra;
    in.reg_off = off;
    in.n_regions = (uint32_t)n;
    kvc_wire_encode_ipc(&a->ipc_tab, &in);
    if (a->ipc_tab.failed || a->ipc_tab.len > KVC_WIRE_MAX_BLOB) {
        KVC_LOG(a, KVC_LOG_INFO, "CUDA IPC off: the IPC table does not fit a handshake");
        kvc_ipc_export_cleanup(a);
        goto out;
    }
    KVC_LOG(a, KVC_LOG_INFO, "CUDA IPC: %zu regions in %u exported allocations (%u VMM pieces)", n,
            na, in.n_pieces);
out:
    /* The handles name memory: wiped with the table's copies. */
    if (ex) memset(ex, 0, 2 * n * sizeof(*ex));
    OPENSSL_cleanse(token, sizeof(token));
    release_pieces(a, v.p, v.n);
    free(v.p);
    free(ex);
    free(ra);
    free(off);
    free(vmm);
    free(sizes);
}

void kvc_ipc_export_cleanup(kvc_agent_t *a) {
    if (a->ipc_tab.p) memset(a->ipc_tab.p, 0, a->ipc_tab.len);
    kvc_buf_cleanup(&a->ipc_tab);
    kvc_ipcfd_serve_stop(a);
}

void kvc_ipc_hs_append(const kvc_agent_t *a, kvc_buf_t *b) {
    kvc_buf_u32(b, (uint32_t)a->ipc_tab.len);
    kvc_buf_put(b, a->ipc_tab.p, a->ipc_tab.len);
}

/* ------------------------------------------------------------ consumer -- */

static void peer_free_maps(kvc_agent_t *a, kvc_ipc_peer_t *ip) {
    for (uint32_t i = 0; i < ip->n_maps; i++) {
        const struct ipc_map *m = &ip->maps[i];
        if (ip->allocs && ip->allocs[m->alloc].kind == KVC_IPC_KIND_VMM)
            kvc_cuda_vmm_unmap(a->cuda, m->dev, m->ptr, ip->piece_size + ip->allocs[m->alloc].first,
                               ip->allocs[m->alloc].n);
        else
            kvc_cuda_ipc_close(a->cuda, m->dev, m->ptr);
    }
    kvc_ipcfd_fetch_close(a, ip->cli);
    for (uint32_t i = 0; ip->handles && i < ip->got; i++)
        kvc_cuda_vmm_drop(a->cuda, ip->handles[i]);
    free(ip->maps);
    free(ip->src);
    free(ip->allocs);
    free(ip->piece_size);
    free(ip->handles);
    free(ip->reg_alloc);
    free(ip->reg_off);
    free(ip);
}

/* Opens what region r reads (VMM allocations later, when their fds came);
 * false (logged) when it cannot. */
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
    if (al->kind == KVC_IPC_KIND_VMM) return true;
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

/* Keeps what the VMM allocations need and asks the producer's socket for
 * their fds; false (logged) when it cannot. */
static bool vmm_start(kvc_agent_t *a, kvc_peer_t *p, kvc_ipc_peer_t *ip, const kvc_ipc_table_t *t) {
    ip->n_allocs = t->n_allocs;
    ip->n_pieces = t->n_pieces;
    ip->allocs = calloc(t->n_allocs, sizeof(*ip->allocs));
    ip->piece_size = malloc(t->n_pieces * sizeof(*ip->piece_size));
    ip->handles = calloc(t->n_pieces, sizeof(*ip->handles));
    ip->reg_alloc = malloc(a->n_regions * sizeof(*ip->reg_alloc));
    ip->reg_off = malloc(a->n_regions * sizeof(*ip->reg_off));
    if (!ip->allocs || !ip->piece_size || !ip->handles || !ip->reg_alloc || !ip->reg_off)
        return false;
    for (uint32_t i = 0; i < t->n_allocs; i++)
        ip->allocs[i] =
            (struct vmm_alloc){t->allocs[i].kind, t->allocs[i].first_piece, t->allocs[i].n_pieces};
    memcpy(ip->piece_size, t->piece_size, t->n_pieces * sizeof(*ip->piece_size));
    memcpy(ip->reg_alloc, t->reg_alloc, a->n_regions * sizeof(*ip->reg_alloc));
    memcpy(ip->reg_off, t->reg_off, a->n_regions * sizeof(*ip->reg_off));
    ip->pe = (kvc_pollent_t){PE_IPCFD_FETCH, p};
    char err[256];
    if (kvc_ipcfd_fetch(a, t, &ip->pe, &ip->cli, err, sizeof(err)) != KVC_OK) {
        KVC_LOG(a, KVC_LOG_WARN, "CUDA IPC with engine %s off: %s; pushed instead", p->engine_id,
                err);
        return false;
    }
    return true;
}

bool kvc_ipc_peer_open(kvc_agent_t *a, kvc_peer_t *p, kvc_span_t table) {
    if (!table.len || !kvc_ipc_can_import(a) || p->n_regions != a->n_regions) return false;
    uint64_t *rlen = calloc(p->n_regions, sizeof(*rlen));
    kvc_ipc_table_t t;
    bool pending = false, vmm = false;
    if (!rlen) return false;
    for (uint32_t i = 0; i < p->n_regions; i++)
        rlen[i] = p->rr[i].len;
    kvc_status_t st = kvc_wire_parse_ipc(table.p, table.len, rlen, p->n_regions, &t);
    free(rlen);
    if (st != KVC_OK) {
        KVC_LOG(a, KVC_LOG_WARN, "CUDA IPC with engine %s off: malformed IPC table (%s)",
                p->engine_id, kvc_status_str(st));
        return false;
    }
    char host[256];
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
    ip->t0 = kvc_now_ns();
    for (size_t r = 0; r < a->n_regions; r++) {
        if (!map_region(a, p, ip, &t, r)) goto fail;
        vmm |= t.allocs[t.reg_alloc[r]].kind == KVC_IPC_KIND_VMM;
    }
    if (vmm && !vmm_start(a, p, ip, &t)) goto fail;
    p->ipc = ip;
    pending = vmm;
    if (vmm)
        KVC_LOG(a, KVC_LOG_DEBUG, "CUDA IPC with engine %s: asking for the fds of %u VMM pieces",
                p->engine_id, t.n_pieces);
    else
        KVC_LOG(a, KVC_LOG_INFO, "CUDA IPC with engine %s: %u allocations mapped in %.2f ms",
                p->engine_id, ip->n_maps, (double)(kvc_now_ns() - ip->t0) / 1e6);
    goto out;
fail:
    if (ip) peer_free_maps(a, ip);
out:
    kvc_wire_ipc_cleanup(&t);
    return pending;
}

/* Every VMM allocation that a region reads, mapped on the region's device
 * from the imported handles, which are released afterwards (the mappings
 * hold the memory).  False with the CUDA message set. */
static bool vmm_map_all(kvc_agent_t *a, kvc_ipc_peer_t *ip) {
    for (size_t r = 0; r < a->n_regions; r++) {
        uint32_t k = ip->reg_alloc[r];
        if (ip->allocs[k].kind != KVC_IPC_KIND_VMM) continue;
        int dev = a->regions[r].cuda_dev;
        uint32_t i = 0;
        while (i < ip->n_maps && (ip->maps[i].alloc != k || ip->maps[i].dev != dev))
            i++;
        if (i == ip->n_maps) {
            void *va = NULL;
            const struct vmm_alloc *al = &ip->allocs[k];
            if (kvc_cuda_vmm_map(a->cuda, dev, ip->handles + al->first, ip->piece_size + al->first,
                                 al->n, &va) != KVC_OK)
                return false;
            ip->maps[ip->n_maps++] = (struct ipc_map){k, dev, va};
        }
        ip->src[r] = (const uint8_t *)ip->maps[i].ptr + ip->reg_off[r];
    }
    for (uint32_t i = 0; i < ip->got; i++)
        kvc_cuda_vmm_drop(a->cuda, ip->handles[i]);
    ip->got = 0;
    return true;
}

/* Logged, everything closed: the peer is pushed to.  True (the end). */
static bool vmm_fail(kvc_agent_t *a, kvc_peer_t *p, const char *why) {
    KVC_LOG(a, KVC_LOG_WARN, "CUDA IPC with engine %s off: %s; pushed instead", p->engine_id, why);
    kvc_ipc_peer_close(a, p);
    return true;
}

bool kvc_ipc_peer_io(kvc_agent_t *a, kvc_peer_t *p, uint32_t events) {
    (void)events; /* a hang-up reads as the end of the stream */
    kvc_ipc_peer_t *ip = p->ipc;
    if (!ip || !ip->cli) return false;
    /* Imports run on the device of the first local region that reads VMM
     * memory (any current context serves them). */
    int dev = 0;
    for (size_t r = a->n_regions; r-- > 0;)
        if (ip->allocs[ip->reg_alloc[r]].kind == KVC_IPC_KIND_VMM) dev = a->regions[r].cuda_dev;
    for (;;) {
        int fds[KVC_IPCFD_BATCH];
        uint32_t first = 0, n = 0;
        char err[256];
        kvc_status_t st = kvc_ipcfd_recv(ip->cli, fds, &first, &n, err, sizeof(err));
        if (st == KVC_AGAIN) return false;
        if (st != KVC_OK) return vmm_fail(a, p, err);
        for (uint32_t i = 0; i < n; i++) {
            if (st == KVC_OK &&
                (st = kvc_cuda_vmm_import(a->cuda, dev, fds[i], &ip->handles[first + i])) == KVC_OK)
                ip->got++;
            close(fds[i]); /* the imported handle holds the allocation */
        }
        if (st != KVC_OK) return vmm_fail(a, p, kvc_cuda_last_error(a->cuda));
        if (ip->got < ip->n_pieces) continue;
        kvc_ipcfd_fetch_close(a, ip->cli);
        ip->cli = NULL;
        if (!vmm_map_all(a, ip)) return vmm_fail(a, p, kvc_cuda_last_error(a->cuda));
        KVC_LOG(a, KVC_LOG_INFO,
                "CUDA IPC with engine %s: %u allocations mapped (%u VMM pieces over its fd "
                "socket) in %.2f ms",
                p->engine_id, ip->n_maps, ip->n_pieces, (double)(kvc_now_ns() - ip->t0) / 1e6);
        return true;
    }
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
        if (j->ev[k]) kvc_cuda_event_put(a->cuda, j->dev[k], j->ev[k]);
    free(j->ev);
    free(j->dev);
    memset(j, 0, sizeof(*j));
}
