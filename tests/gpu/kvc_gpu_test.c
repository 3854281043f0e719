/* SPDX-License-Identifier: Apache-2.0 */
/* GPU check of libkvconnector (run by tests/gpu/run_gpu_tests.sh): a real
 * CUDA device, a producer and a consumer in two processes, device memory on
 * both sides.
 *
 *   kvc_gpu_test probe-device                 exit 0 with a device, 77 without
 *   kvc_gpu_test baseline [opts]              cudaMemcpy GB/s, 2 MiB copies:
 *                                             device-to-device, pinned host-to-device
 *   kvc_gpu_test staging [opts]               the connector's staging copies
 *                                             (pinned pool slots -> device, the
 *                                             fetch's blocks in pushed-message
 *                                             chunks, events polled), GB/s
 *   kvc_gpu_test producer --params F [opts]   fill, publish, serve until released
 *   kvc_gpu_test consumer --params F [opts]   fetch, check every byte, GB/s
 * opts: --regions N --blocks N --block-kb N --fetch N (blocks fetched, in runs
 * of up to 64) --probe (the producer's blocks are written by copies queued
 * behind a slow stream operation and published with that stream, no host
 * sync; the consumer orders its completion before its own stream and reads
 * through it) --kill PIDFILE (consumer: SIGKILL the producer as soon as the
 * handshake is done, mid-fetch; the producer writes its pid to PARAMS.pid)
 * --default-stream (with --probe: the engine's stream is the legacy default
 * stream, passed as 0 with the stream field set) --device N (the CUDA device
 * of this process) --expiry-ms N (producer: the publication expires after N
 * ms; it counts as released when it does) --unpublish-ms N (producer: the
 * engine aborts the request, kvc_unpublish, after N ms) --delay-ms N
 * (consumer: waits N ms after the warm-up before fetching) --expect failed
 * (consumer: the check passes only if the fetch FAILS) --tp N (consumer:
 * this engine's TP size; N decode ranks fetch one prefill rank's blocks)
 * --xfer-timeout-ms N (the agent's data timeout, 30000 by default; a --kill
 * consumer gives up N ms + 30 s after its start) --host (producer and
 * consumer: the regions are host memory, pushed over the same transport:
 * the baseline of bench/kvc_bench.sh --staged; not with --probe) --vmm
 * (producer and consumer: the regions lie back to back in one range mapped
 * with the driver's VMM API in physical allocations of 20 MiB, as PyTorch's
 * expandable segments map them, created with the POSIX fd handle type: the
 * same-node IPC path then passes the allocations' fds; regions span
 * allocations) --vmm-piece-kb N (their size instead of 20 MiB).
 * The consumer's RESULT line says which path moved the bytes (path=ipc|get|
 * push; KVC_IPC=0 in the environment forbids the same-node CUDA IPC path,
 * which is otherwise chosen on one node), first_fetch_ms (the warm-up fetch
 * of one block: handshake, IPC open, one read) and memcpy_gbps: the fetched
 * runs copied device to device with cudaMemcpyAsync in the same process
 * right after (on the stand-in a host memcpy of the same bytes), the
 * ceiling the IPC path is measured against.
 *
 * Every result is one line starting with "RESULT " (key=value pairs) on
 * stdout; exit status 0 only when the check passed. */
#include "connector/kvc_int.h" /* staging mode: the connector's own copy plan and copies */
#include "include/kvconnector.h"

#include "tests/gpu/vmm_alloc.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #x, cudaGetErrorName(e_),  \
                    cudaGetErrorString(e_));                                                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define MAX_REG 256
#define RUN 64 /* blocks per fetched run: 2 MiB with 32 KiB blocks */

typedef struct {
    int regions;
    uint64_t blocks;
    size_t block;
    size_t fetch;
    const char *params, *kill_pidfile;
    bool probe, default_stream, expect_fail, host, vmm;
    int device;
    uint32_t expiry_ms, unpublish_ms, delay_ms, tp;
    size_t vmm_piece;
} opts_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Every 8-byte word names its generation, region, block and index: a block
 * landing in the wrong place, or a stale one, is caught.  The top nibble is
 * the generation (1 or 2), never the consumer's 0x5A fill. */
static uint64_t pat(int gen, int r, uint64_t b, size_t w) {
    return ((uint64_t)gen << 60) | ((uint64_t)r << 44) | (b << 16) | (uint64_t)(w & 0xffff);
}

static void fill_region(uint64_t *host, int gen, int r, uint64_t nblocks, size_t block) {
    size_t words = block / 8;
    for (uint64_t b = 0; b < nblocks; b++)
        for (size_t w = 0; w < words; w++)
            host[b * words + w] = pat(gen, r, b, w);
}

/* The fetched blocks: runs of up to RUN blocks at run-aligned slots picked
 * by a fixed pseudo-random order (scattered, deterministic).  Local block
 * of remote b: shifted by half the cache plus three runs, so runs stay runs
 * but land elsewhere. */
static uint64_t *pick_blocks(const opts_t *o, size_t *n) {
    uint64_t slots = o->blocks / RUN;
    size_t runs = (o->fetch + RUN - 1) / RUN;
    if (slots == 0 || runs > slots) return NULL;
    uint64_t *ids = malloc(o->fetch * sizeof(*ids));
    uint8_t *used = calloc(slots, 1);
    if (!ids || !used) exit(1);
    uint64_t x = 0x2545F4914F6CDD1Dull;
    size_t k = 0;
    for (size_t i = 0; i < runs; i++) {
        uint64_t s;
        do {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            s = x % slots;
        } while (used[s]);
        used[s] = 1;
        for (uint64_t j = 0; j < RUN && k < o->fetch; j++)
            ids[k++] = s * RUN + j;
    }
    free(used);
    *n = k;
    return ids;
}

static uint64_t local_of(const opts_t *o, uint64_t remote) {
    return (remote + o->blocks / 2 + 3 * RUN) % o->blocks;
}

static uint32_t xfer_timeout_ms = 30000;

/* A region's memory: device memory, or host memory with --host. */
static void *region_alloc(const opts_t *o, size_t len) {
    void *p = NULL;
    if (o->host) {
        if (!(p = aligned_alloc(4096, len))) exit(1);
        return p;
    }
    CK(cudaMalloc(&p, len));
    return p;
}

static void region_free(const opts_t *o, void *p) {
    if (o->host)
        free(p);
    else
        CK(cudaFree(p));
}

/* The regions' device memory: one cudaMalloc each, or (--vmm) one VMM
 * range holding them all back to back, in physical allocations of
 * vmm_piece bytes (rounded up to the granularity). */
static void alloc_regions(const opts_t *o, void **dev, vmm_mem_t *vm) {
    size_t len = o->blocks * o->block;
    if (!o->vmm) {
        for (int r = 0; r < o->regions; r++)
            dev[r] = region_alloc(o, len);
        return;
    }
    int d = 0;
    CK(cudaGetDevice(&d));
    if (vmm_alloc(vm, len * (size_t)o->regions, o->vmm_piece, d, true) != 0) exit(1);
    for (int r = 0; r < o->regions; r++)
        dev[r] = (char *)(uintptr_t)vm->va + (size_t)r * len;
}

static void free_regions(const opts_t *o, void **dev, vmm_mem_t *vm) {
    if (o->vmm) {
        CK(cudaDeviceSynchronize()); /* unmapping does not wait for the GPU */
        vmm_free(vm);
        return;
    }
    for (int r = 0; r < o->regions; r++)
        region_free(o, dev[r]);
}

static kvc_agent_t *agent(const char *name, uint32_t tp) {
    kvc_agent_params_t ap = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID |
                                           KVC_AGENT_FIELD_XFER_TIMEOUT | KVC_AGENT_FIELD_TP_SIZE,
                             .engine_id = name,
                             .xfer_timeout_ms = xfer_timeout_ms,
                             .tp_size = tp ? tp : 1};
    kvc_agent_t *a;
    kvc_status_t st = kvc_agent_create(&ap, &a);
    if (st != KVC_OK) {
        fprintf(stderr, "kvc_agent_create: %s\n", kvc_status_str(st));
        exit(1);
    }
    return a;
}


static void register_regions(kvc_agent_t *a, void **dev, const opts_t *o) {
    kvc_region_params_t *rp = calloc((size_t)o->regions, sizeof(*rp));
    if (!rp) exit(1);
    int d = 0;
    CK(cudaGetDevice(&d));
    for (int r = 0; r < o->regions; r++)
        rp[r] =
            (kvc_region_params_t){.field_mask = KVC_REGION_FIELD_BASE | KVC_REGION_FIELD_MEM_TYPE |
                                                KVC_REGION_FIELD_CUDA_DEVICE,
                                  .len = o->blocks * o->block,
                                  .base = dev[r],
                                  .mem_type = o->host ? KVC_MEM_HOST : KVC_MEM_CUDA,
                                  .cuda_device = d};
    for (int r = 0; o->host && r < o->regions; r++)
        rp[r].field_mask &= ~(uint64_t)KVC_REGION_FIELD_CUDA_DEVICE;
    kvc_status_t st = kvc_agent_register_regions(a, o->blocks, rp, (size_t)o->regions);
    free(rp);
    if (st != KVC_OK) {
        fprintf(stderr, "register CUDA regions: %s\n", kvc_status_str(st));
        exit(1);
    }
}

static uint64_t kstat(kvc_agent_t *a, kvc_stat_t s) {
    uint64_t v = 0;
    kvc_agent_stat(a, s, &v);
    return v;
}

static void transports_text(uint64_t bits, char *out, size_t len) {
    static const char *names[] = {"tcp",       "shm",      "cuda_ipc", "rdma",
                                  "cuda_copy", "gdr_copy", "other"};
    size_t k = 0;
    out[0] = 0;
    for (int i = 0; i < 7; i++)
        if (bits & (1u << i))
            k += (size_t)snprintf(out + k, len - k, "%s%s", k ? "+" : "", names[i]);
    if (!k) snprintf(out, len, "none");
}

/* ------------------------------------------------------------- baseline -- */

static double bw(void *dst, const void *src, size_t total, size_t chunk, enum cudaMemcpyKind kind,
                 cudaStream_t s) {
    double best = 0;
    for (int rep = 0; rep < 4; rep++) { /* the first is a warm-up */
        double t0 = now_s();
        for (size_t off = 0; off + chunk <= total; off += chunk)
            CK(cudaMemcpyAsync((char *)dst + off, (const char *)src + off, chunk, kind, s));
        CK(cudaStreamSynchronize(s));
        double g = total / (now_s() - t0) / 1e9;
        if (rep && g > best) best = g;
    }
    return best;
}

/* 1 GiB of 2 MiB copies (less when the cache given is smaller). */
static int run_baseline(const opts_t *o) {
    size_t total = (size_t)1 << 30, chunk = (size_t)2 << 20;
    if ((size_t)o->regions * o->blocks * o->block < total)
        total = ((size_t)o->regions * o->blocks * o->block + chunk - 1) / chunk * chunk;
    void *a, *b, *h;
    cudaStream_t s;
    CK(cudaMalloc(&a, total));
    CK(cudaMalloc(&b, total));
    CK(cudaMallocHost(&h, total));
    CK(cudaMemset(a, 1, total));
    memset(h, 2, total);
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    double d2d = bw(b, a, total, chunk, cudaMemcpyDeviceToDevice, s);
    double h2d = bw(b, h, total, chunk, cudaMemcpyHostToDevice, s);
    printf("RESULT baseline d2d_gbps=%.1f h2d_pinned_gbps=%.1f chunk_mib=2\n", d2d, h2d);
    CK(cudaStreamDestroy(s));
    CK(cudaFreeHost(h));
    CK(cudaFree(a));
    CK(cudaFree(b));
    return 0;
}

/* -------------------------------------------------------------- staging -- */

/* The connector's staging copies alone, as a staged fetch makes them: the
 * fetched blocks in pushed-message chunks (KVC_PUSH_CHUNK_KB, 4 MiB),
 * each copied from a slot of a pinned 256 MiB pool to the device on the
 * connector's per-device stream with the slot's event recorded after it
 * (kvc_cuda_copy_event), a slot reused once its event is complete (polled,
 * as the connector's progress does).  What the consumer side of the staged
 * path can move at most. */
static int run_staging(const opts_t *o) {
    size_t len = o->blocks * o->block, n;
    uint64_t *rem = pick_blocks(o, &n);
    if (!rem) return 1;
    char err[256];
    kvc_cuda_t *c;
    if (kvc_cuda_create(&c, err, sizeof(err)) != KVC_OK) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    size_t slot = (size_t)4 << 20, nslots = 64;
    if (slot < o->block) slot = o->block;
    size_t per = slot / o->block; /* blocks per chunk */
    void **dev = calloc((size_t)o->regions, sizeof(void *));
    int *rdev = calloc((size_t)o->regions, sizeof(int));
    void **ev = calloc(nslots, sizeof(void *));
    int *evdev = calloc(nslots, sizeof(int));
    bool *busy = calloc(nslots, sizeof(bool));
    uint8_t *pool = aligned_alloc(4096, slot * nslots);
    if (!dev || !rdev || !ev || !evdev || !busy || !pool) return 1;
    memset(pool, 7, slot * nslots);
    if (kvc_cuda_host_register(c, pool, slot * nslots) != KVC_OK) {
        fprintf(stderr, "staging pool: %s\n", kvc_cuda_last_error(c));
        return 1;
    }
    for (int r = 0; r < o->regions; r++) {
        CK(cudaMalloc(&dev[r], len));
        if (kvc_cuda_region_device(c, dev[r], len, -1, &rdev[r]) != KVC_OK) {
            fprintf(stderr, "staging setup: %s\n", kvc_cuda_last_error(c));
            return 1;
        }
    }
    double best = 0;
    size_t copies = 0;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = now_s();
        size_t k = 0;
        copies = 0;
        for (int r = 0; r < o->regions; r++)
            for (size_t i = 0; i < n;) {
                size_t cnt = 1; /* a chunk: consecutive ids, at most `per` */
                while (i + cnt < n && cnt < per && rem[i + cnt] == rem[i] + cnt)
                    cnt++;
                size_t sl = k++ % nslots;
                kvc_status_t st = KVC_OK;
                while (busy[sl]) {
                    int q = kvc_cuda_event_poll(c, ev[sl], &st);
                    if (q < 0) {
                        fprintf(stderr, "staging copy: %s\n", kvc_cuda_last_error(c));
                        return 1;
                    }
                    busy[sl] = q == 0;
                }
                if (kvc_cuda_copy_event(c, rdev[r], (char *)dev[r] + rem[i] * o->block,
                                        pool + sl * slot, cnt * o->block, true, &ev[sl],
                                        &evdev[sl]) != KVC_OK) {
                    fprintf(stderr, "staging copy: %s\n", kvc_cuda_last_error(c));
                    return 1;
                }
                busy[sl] = true;
                copies++;
                i += cnt;
            }
        for (size_t sl = 0; sl < nslots; sl++) {
            kvc_status_t st = KVC_OK;
            while (busy[sl]) {
                int q = kvc_cuda_event_poll(c, ev[sl], &st);
                if (q < 0) {
                    fprintf(stderr, "staging copy: %s\n", kvc_cuda_last_error(c));
                    return 1;
                }
                busy[sl] = q == 0;
            }
        }
        double g = (double)n * o->block * o->regions / (now_s() - t0) / 1e9;
        if (rep && g > best) best = g;
    }
    printf("RESULT staging h2d_gbps=%.1f copies_per_region=%zu blocks=%zu regions=%d "
           "slot_kib=%zu slots=%zu\n",
           best, copies / (size_t)o->regions, n, o->regions, slot >> 10, nslots);
    for (size_t sl = 0; sl < nslots; sl++)
        if (ev[sl]) kvc_cuda_event_destroy(c, ev[sl]);
    kvc_cuda_host_unregister(c, pool);
    for (int r = 0; r < o->regions; r++)
        CK(cudaFree(dev[r]));
    kvc_cuda_destroy(c);
    free(pool);
    free(dev);
    free(rdev);
    free(ev);
    free(evdev);
    free(busy);
    free(rem);
    return 0;
}

/* ------------------------------------------------------------- producer -- */

static void slow_op(void *arg) {
    (void)arg; /* a host function must not call CUDA */
    struct timespec ts = {0, 300 * 1000000L};
    nanosleep(&ts, NULL);
}

static int run_producer(const opts_t *o) {
    size_t len = o->blocks * o->block, n;
    uint64_t *rem = pick_blocks(o, &n);
    if (!rem) return 1;
    kvc_agent_t *a = agent("gpu-P", 1);
    void **dev = calloc((size_t)o->regions, sizeof(void *));
    uint64_t *host;
    vmm_mem_t vm = {0};
    if (!dev) return 1;
    CK(cudaMallocHost((void **)&host, len));
    alloc_regions(o, dev, &vm);
    for (int r = 0; r < o->regions; r++) {
        fill_region(o->host ? dev[r] : host, 1, r, o->blocks, o->block);
        if (!o->host) CK(cudaMemcpy(dev[r], host, len, cudaMemcpyHostToDevice));
    }
    register_regions(a, dev, o);
    /* A one-block publication first: the consumer's warm-up fetch, so that
     * the timed fetch does not include the handshake. */
    char *warm;
    kvc_status_t st = kvc_publish(a, "gpu-warm", rem, 1, NULL, &warm);
    if (st != KVC_OK) {
        fprintf(stderr, "publish: %s\n", kvc_status_str(st));
        return 1;
    }
    kvc_publish_params_t pp = {0};
    cudaStream_t es = NULL;
    uint64_t **gen2 = NULL;
    if (o->probe) {
        /* The engine's stream: a slow operation, then the copies that write
         * generation 2 into the published blocks; publish right away. */
        if (!o->default_stream) CK(cudaStreamCreateWithFlags(&es, cudaStreamNonBlocking));
        CK(cudaLaunchHostFunc(es, slow_op, NULL)); /* es 0: the legacy default stream */
        gen2 = calloc((size_t)o->regions, sizeof(*gen2));
        size_t words = o->block / 8;
        for (int r = 0; r < o->regions; r++) {
            CK(cudaMallocHost((void **)&gen2[r], n * o->block));
            for (size_t k = 0; k < n; k++)
                for (size_t w = 0; w < words; w++)
                    gen2[r][k * words + w] = pat(2, r, rem[k], w);
            for (size_t k = 0; k < n; k++)
                CK(cudaMemcpyAsync((char *)dev[r] + rem[k] * o->block, gen2[r] + k * words,
                                   o->block, cudaMemcpyHostToDevice, es));
        }
        pp.field_mask = KVC_PUBLISH_FIELD_CUDA_STREAM; /* set: 0 is a stream too */
        pp.cuda_stream = es;
    }
    if (o->expiry_ms) {
        pp.field_mask |= KVC_PUBLISH_FIELD_EXPIRY;
        pp.expiry_ms = o->expiry_ms;
    }
    char *json;
    st = kvc_publish(a, "gpu-req-1", rem, n, &pp, &json);
    if (st != KVC_OK) {
        fprintf(stderr, "publish: %s\n", kvc_status_str(st));
        return 1;
    }
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.pid", o->params); /* for the consumer's --kill */
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%d\n", (int)getpid()) < 0 || fclose(f)) {
        fprintf(stderr, "writing %s: %s\n", tmp, strerror(errno));
        return 1;
    }
    snprintf(tmp, sizeof(tmp), "%s.tmp", o->params);
    f = fopen(tmp, "w");
    if (!f || fprintf(f, "%s\n%s\n", warm, json) < 0 || fclose(f) || rename(tmp, o->params)) {
        fprintf(stderr, "writing %s: %s\n", o->params, strerror(errno));
        return 1;
    }
    kvc_free(warm);
    kvc_free(json);
    int released = 0; /* the main publication released (the warm-up may not be) */
    double until = now_s() + 240, t_pub = now_s();
    bool unpublished = false, expired = false;
    while (!released && now_s() < until) {
        kvc_agent_wait(a, 20);
        if (o->unpublish_ms && !unpublished && now_s() - t_pub >= o->unpublish_ms / 1e3) {
            /* The engine aborts the request: its blocks go back at once. */
            if (kvc_unpublish(a, "gpu-req-1") != KVC_OK) {
                fprintf(stderr, "unpublish: not found\n");
                return 1;
            }
            unpublished = true;
            until = now_s() + 4; /* serve (and refuse) the late consumer a while */
        }
        kvc_event_t ev;
        while (kvc_agent_next_event(a, &ev) == KVC_OK) {
            if (strcmp(ev.request_id ? ev.request_id : "", "gpu-req-1")) continue;
            released |= ev.type == KVC_EV_RELEASED;
            if (o->expiry_ms && ev.type == KVC_EV_EXPIRED && !expired) {
                expired = true;
                until = now_s() + 4; /* the same for a consumer that comes too late */
            }
        }
    }
    /* Nothing left to release after an expiry or an abort. */
    if ((expired || unpublished) && !released) released = 1;
    /* Keep serving a moment, as an engine would: the consumer's notification
     * send completes only while this endpoint is alive. */
    for (double end = now_s() + 1.0; released && now_s() < end;)
        kvc_agent_wait(a, 50);
    printf("RESULT producer released=%d direct_regions=%llu staged_regions=%llu\n", released,
           (unsigned long long)kstat(a, KVC_STAT_CUDA_DIRECT_REGIONS),
           (unsigned long long)kstat(a, KVC_STAT_CUDA_STAGED_REGIONS));
    kvc_agent_destroy(a);
    if (es) CK(cudaStreamDestroy(es));
    free_regions(o, dev, &vm);
    for (int r = 0; gen2 && r < o->regions; r++)
        CK(cudaFreeHost(gen2[r]));
    CK(cudaFreeHost(host));
    free(gen2);
    free(dev);
    free(rem);
    return released ? 0 : 1;
}

/* ------------------------------------------------------------- consumer -- */

/* The fetched runs (remote -> local, consecutive blocks merged) copied
 * device to device inside each region with cudaMemcpyAsync on one stream,
 * as the IPC path copies them: best of three after a warm-up, GB/s.  Run
 * after the bytes were checked (it overwrites the fetched blocks). */
static double runs_memcpy_gbps(const opts_t *o, void **dev, const uint64_t *rem,
                               const uint64_t *loc, size_t n) {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    double best = 0;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = now_s();
        for (int r = 0; r < o->regions; r++)
            for (size_t i = 0; i < n;) {
                size_t cnt = 1;
                while (i + cnt < n && rem[i + cnt] == rem[i] + cnt && loc[i + cnt] == loc[i] + cnt)
                    cnt++;
                CK(cudaMemcpyAsync((char *)dev[r] + loc[i] * o->block,
                                   (const char *)dev[r] + rem[i] * o->block, cnt * o->block,
                                   cudaMemcpyDeviceToDevice, s));
                i += cnt;
            }
        CK(cudaStreamSynchronize(s));
        double g = (double)n * o->block * o->regions / (now_s() - t0) / 1e9;
        if (rep && g > best) best = g;
    }
    CK(cudaStreamDestroy(s));
    return best;
}

static char *read_params(const char *path) {
    for (int i = 0; i < 2400; i++) { /* up to 120 s for the producer's fill */
        FILE *f = fopen(path, "r");
        if (f) {
            static char buf[1 << 20];
            size_t k = fread(buf, 1, sizeof(buf) - 1, f);
            fclose(f);
            buf[k] = 0;
            if (k) return buf;
        }
        struct timespec ts = {0, 50 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static int run_consumer(const opts_t *o) {
    size_t len = o->blocks * o->block, words = o->block / 8;
    kvc_agent_t *a = agent("gpu-D", o->tp);
    void **dev = calloc((size_t)o->regions, sizeof(void *));
    uint64_t *host;
    vmm_mem_t vm = {0};
    if (!dev) return 1;
    CK(cudaMallocHost((void **)&host, len));
    alloc_regions(o, dev, &vm);
    for (int r = 0; r < o->regions; r++) {
        if (o->host)
            memset(dev[r], 0x5A, len);
        else
            CK(cudaMemset(dev[r], 0x5A, len));
    }
    CK(cudaDeviceSynchronize());
    register_regions(a, dev, o);
    char *warm = read_params(o->params), *json = warm ? strchr(warm, '\n') : NULL;
    if (!json) {
        fprintf(stderr, "no kv_transfer_params in %s\n", o->params);
        return 1;
    }
    *json++ = 0; /* line 1: the warm-up publication, line 2: the fetch's */
    uint64_t *rem = malloc(o->blocks * sizeof(*rem)), *loc = malloc(o->blocks * sizeof(*loc));
    uint8_t *want = calloc(o->blocks, 1);
    if (!rem || !loc || !want) return 1;
    kvc_remote_t pr;
    char perr[256] = "";
    memset(&pr, 0, sizeof(pr));
    if (kvc_params_parse_json(json, &pr, perr, sizeof(perr)) != KVC_OK ||
        pr.num_blocks > o->blocks) {
        fprintf(stderr, "bad kv_transfer_params in %s: %s\n", o->params, perr);
        kvc_remote_cleanup(&pr);
        return 1;
    }
    size_t n = pr.num_blocks;
    memcpy(rem, pr.block_ids, n * sizeof(*rem));
    kvc_remote_cleanup(&pr);
    for (size_t k = 0; k < n; k++) {
        loc[k] = local_of(o, rem[k]);
        want[loc[k]] = 1;
    }
    cudaStream_t ds = NULL;
    kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS,
                             .kv_transfer_params_json = json,
                             .local_block_ids = loc,
                             .num_local_blocks = n};
    bool use_stream = o->probe;
    if (o->probe) {
        if (!o->default_stream) CK(cudaStreamCreateWithFlags(&ds, cudaStreamNonBlocking));
        fp.field_mask |= KVC_FETCH_FIELD_CUDA_STREAM; /* ds 0: the legacy default stream */
        fp.cuda_stream = ds;
    }
    uint64_t xid;
    kvc_status_t st;
    double first_ms = -1; /* the warm-up: handshake, path set-up, one block */
    if (!o->kill_pidfile) {
        /* Warm-up: one block into the first local block, handshake done. */
        double w0 = now_s();
        kvc_fetch_params_t wp = fp;
        wp.kv_transfer_params_json = warm;
        wp.num_local_blocks = 1;
        if ((st = kvc_fetch(a, &wp, &xid)) != KVC_INPROGRESS) {
            fprintf(stderr, "warm-up fetch: %s\n", kvc_status_str(st));
            return 1;
        }
        int wgot = 0;
        for (double end = now_s() + 60; !wgot && now_s() < end;) {
            kvc_agent_wait(a, 100);
            kvc_event_t wev;
            while (kvc_agent_next_event(a, &wev) == KVC_OK)
                wgot = wev.type == KVC_EV_FETCH_DONE ? 1 : wev.type == KVC_EV_FETCH_FAILED ? 2 : 0;
        }
        if (wgot != 1) {
            printf("RESULT fetch outcome=warm-up-failed\n");
            return 1;
        }
        first_ms = (now_s() - w0) * 1e3;
    }
    for (double end = now_s() + o->delay_ms / 1e3; now_s() < end;)
        kvc_agent_wait(a, 10); /* progressed meanwhile, as an engine does */
    double t0 = now_s();
    st = kvc_fetch(a, &fp, &xid);
    if (st != KVC_INPROGRESS) {
        fprintf(stderr, "fetch: %s\n", kvc_status_str(st));
        return 1;
    }
    bool killed = false;
    kvc_event_t ev;
    int got = 0;
    char msg[512] = "";
    /* Killed: the failure is due within the data timeout (plus its grace). */
    double until = now_s() + (o->kill_pidfile ? xfer_timeout_ms / 1000.0 + 30 : 120);
    while (!got && now_s() < until) {
        kvc_agent_wait(a, o->kill_pidfile && !killed ? 0 : 100);
        if (o->kill_pidfile && !killed && kstat(a, KVC_STAT_HANDSHAKES) > 0) {
            FILE *f = fopen(o->kill_pidfile, "r");
            int pid = 0;
            if (f && fscanf(f, "%d", &pid) == 1 && pid > 1) kill(pid, SIGKILL);
            if (f) fclose(f);
            killed = true;
        }
        while (!got && kvc_agent_next_event(a, &ev) == KVC_OK) {
            got = ev.type == KVC_EV_FETCH_DONE ? 1 : ev.type == KVC_EV_FETCH_FAILED ? 2 : 0;
            st = ev.status;
            if (ev.message) snprintf(msg, sizeof(msg), "%s", ev.message);
        }
    }
    double secs = now_s() - t0;
    char tl[128];
    transports_text(kstat(a, KVC_STAT_TRANSPORTS), tl, sizeof(tl));
    const char *path = kstat(a, KVC_STAT_PEERS_IPC)   ? "ipc"
                       : kstat(a, KVC_STAT_PEERS_GET) ? "get"
                                                      : "push";
    const char *mem = o->host                                  ? "host"
                      : kstat(a, KVC_STAT_CUDA_DIRECT_REGIONS) ? "direct"
                                                               : "staged";
    /* The staged variant of the last fetch (the warm-up ran the same way). */
    const char *staged = kstat(a, KVC_STAT_FETCH_STAGED_SHM)    ? "shm"
                         : kstat(a, KVC_STAT_FETCH_STAGED_WIRE) ? "wire"
                                                                : "none";
    if (o->kill_pidfile) {
        /* Killed mid-fetch: a clear failure within the timeouts (or, if the
         * bytes were all there before the kill took effect, correct bytes). */
        printf("RESULT kill outcome=%s status=%s seconds=%.2f message=\"%s\"\n",
               got == 2   ? "failed"
               : got == 1 ? "done"
                          : "hung",
               kvc_status_str(st), secs, msg);
    } else if (got != 1) {
        printf("RESULT fetch outcome=%s status=%s seconds=%.2f message=\"%s\"\n",
               got ? "failed" : "hung", kvc_status_str(st), secs, msg);
    }
    int rc = o->kill_pidfile ? got == 0 : o->expect_fail ? got != 2 : got != 1;
    uint64_t bad = 0;
    if (got == 1) {
        /* Every byte: fetched blocks hold the producer's, untouched blocks the
         * 0x5A fill.  With --probe the engine's stream reads them, after the
         * completion and without any other sync. */
        uint64_t fill = 0x5A5A5A5A5A5A5A5Aull;
        int gen = o->probe ? 2 : 1;
        for (int r = 0; r < o->regions; r++) {
            if (use_stream) {
                CK(cudaMemcpyAsync(host, dev[r], len, cudaMemcpyDeviceToHost, ds));
                CK(cudaStreamSynchronize(ds));
            } else if (o->host) {
                memcpy(host, dev[r], len);
            } else {
                CK(cudaMemcpy(host, dev[r], len, cudaMemcpyDeviceToHost));
            }
            for (size_t k = 0; k < n; k++)
                for (size_t w = 0; w < words; w++)
                    if (host[loc[k] * words + w] != pat(gen, r, rem[k], w) && bad++ < 5)
                        fprintf(stderr,
                                "region %d local block %llu word %zu: %016llx, want %016llx\n", r,
                                (unsigned long long)loc[k], w,
                                (unsigned long long)host[loc[k] * words + w],
                                (unsigned long long)pat(gen, r, rem[k], w));
            for (uint64_t b = 0; b < o->blocks; b++) {
                if (want[b]) continue;
                for (size_t w = 0; w < words; w++)
                    if (host[b * words + w] != fill && bad++ < 5)
                        fprintf(stderr, "region %d untouched block %llu written\n", r,
                                (unsigned long long)b);
            }
        }
        double bytes = (double)n * o->block * o->regions;
        double mc = o->host ? 0 : runs_memcpy_gbps(o, dev, rem, loc, n); /* host: no device */
        printf("RESULT fetch outcome=done bad_words=%llu blocks=%zu regions=%d bytes=%.0f "
               "seconds=%.3f gbps=%.2f path=%s memory=%s staged=%s transports=%s copies=%llu "
               "syncs=%llu first_fetch_ms=%.1f memcpy_gbps=%.1f alloc=%s ucx=%s\n",
               (unsigned long long)bad, n, o->regions, bytes, secs, bytes / secs / 1e9, path, mem,
               staged, tl, (unsigned long long)kstat(a, KVC_STAT_CUDA_COPIES),
               (unsigned long long)kstat(a, KVC_STAT_CUDA_SYNCS), first_ms, mc,
               o->vmm ? "vmm" : "cudaMalloc", ucp_get_version_string());
        if (bad || o->expect_fail) rc = 1; /* a fetch that had to fail succeeded */
    }
    kvc_agent_destroy(a);
    if (ds) CK(cudaStreamDestroy(ds));
    free_regions(o, dev, &vm);
    CK(cudaFreeHost(host));
    free(dev);
    free(rem);
    free(loc);
    free(want);
    return rc;
}

int main(int argc, char **argv) {
    opts_t o = {
        .regions = 64, .blocks = 4096, .block = 32 << 10, .fetch = 2048, .vmm_piece = 20u << 20};
    if (argc < 2) {
        fprintf(stderr, "usage: %s probe-device|baseline|staging|producer|consumer [opts]\n",
                argv[0]);
        return 2;
    }
    for (int i = 2; i < argc; i++) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(k, "--probe")) {
            o.probe = true;
            continue;
        }
        if (!strcmp(k, "--default-stream")) {
            o.default_stream = true;
            continue;
        }
        if (!strcmp(k, "--host")) {
            o.host = true;
            continue;
        }
        if (!strcmp(k, "--vmm")) {
            o.vmm = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "%s needs a value\n", k);
            return 2;
        }
        i++;
        if (!strcmp(k, "--regions"))
            o.regions = atoi(v);
        else if (!strcmp(k, "--blocks"))
            o.blocks = strtoull(v, NULL, 10);
        else if (!strcmp(k, "--block-kb"))
            o.block = strtoull(v, NULL, 10) << 10;
        else if (!strcmp(k, "--fetch"))
            o.fetch = strtoull(v, NULL, 10);
        else if (!strcmp(k, "--params"))
            o.params = v;
        else if (!strcmp(k, "--kill"))
            o.kill_pidfile = v;
        else if (!strcmp(k, "--device"))
            o.device = atoi(v);
        else if (!strcmp(k, "--expiry-ms"))
            o.expiry_ms = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(k, "--unpublish-ms"))
            o.unpublish_ms = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(k, "--delay-ms"))
            o.delay_ms = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(k, "--tp"))
            o.tp = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(k, "--xfer-timeout-ms"))
            xfer_timeout_ms = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(k, "--vmm-piece-kb"))
            o.vmm_piece = strtoull(v, NULL, 10) << 10;
        else if (!strcmp(k, "--expect"))
            o.expect_fail = !strcmp(v, "failed");
        else {
            fprintf(stderr, "unknown option %s\n", k);
            return 2;
        }
    }
    if (o.regions < 1 || o.regions > MAX_REG || o.blocks < RUN || o.block < 8 || o.block % 8 ||
        o.fetch == 0 || o.fetch > o.blocks / 2 || (o.host && (o.probe || o.vmm)) ||
        o.vmm_piece == 0) {
        fprintf(stderr, "bad sizes\n");
        return 2;
    }
    int n = 0;
    cudaError_t ce = cudaGetDeviceCount(&n);
    if (ce != cudaSuccess || n == 0) {
        printf("RESULT device none (%s)\n", ce == cudaSuccess ? "count 0" : cudaGetErrorName(ce));
        return 77;
    }
    if (o.device < 0 || o.device >= n) {
        printf("RESULT device missing (device %d of %d)\n", o.device, n);
        return 77;
    }
    CK(cudaSetDevice(o.device));
    if (!strcmp(argv[1], "probe-device")) {
        printf("RESULT device count=%d\n", n);
        return 0;
    }
    if (!strcmp(argv[1], "baseline")) return run_baseline(&o);
    if (!strcmp(argv[1], "staging")) return run_staging(&o);
    if ((!strcmp(argv[1], "producer") || !strcmp(argv[1], "consumer")) && !o.params) {
        fprintf(stderr, "--params FILE is required\n");
        return 2;
    }
    if (!strcmp(argv[1], "producer")) return run_producer(&o);
    if (!strcmp(argv[1], "consumer")) return run_consumer(&o);
    fprintf(stderr, "unknown mode %s\n", argv[1]);
    return 2;
}
