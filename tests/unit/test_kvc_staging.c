/* SPDX-License-Identifier: Apache-2.0 */
/* Unit test: libkvconnector's CUDA path (connector/cuda.c, the real code)
 * against the asynchronous CUDA stand-in (tests/cudasim): no GPU needed.
 * Work queued on a stream runs only when someone synchronises (lazy mode) or
 * a little later on another thread (threaded mode), so a missing stream
 * wait or sync shows up as wrong bytes or work still queued.
 *
 * Two agents in this process, a producer P and a consumer D, each with four
 * CUDA regions, two on device 0 and two on device 1, move blocks over UCX on
 * loopback (shared-memory get and producer push).  Checked: publish is
 * ordered after the engine's event/stream, the consumer's completion before
 * the engine's stream, bytes of fetched and untouched blocks, the caller's
 * current device after every call, CUDA's last error left clear, copies
 * batched (2D copies, one sync per device per fetch), copies drained before
 * FETCH_FAILED, failures named with the CUDA error. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "connector/kvc_int.h"
#include "tests/cudasim/cudasim.h"

#define NB 64
#define BL 4096
#define NREG 4
#define CALLER_DEV 1 /* the engine's current device during kvc_ calls */

static uint8_t pat(int gen, int r, uint64_t b, size_t i) {
    return (uint8_t)(gen * 29 + r * 131 + b * 7 + i * 13 + (i >> 9));
}

/* ------------------------------------------------------ engine "kernels" -- */

typedef struct {
    uint8_t *dev[NREG];
    int gen;
} fill_t;

/* Runs on the engine's stream: writes every block of every region. */
static void fill_fn(void *arg) {
    fill_t *f = arg;
    for (int r = 0; r < NREG; r++)
        for (uint64_t b = 0; b < NB; b++)
            for (size_t i = 0; i < BL; i++)
                f->dev[r][b * BL + i] = pat(f->gen, r, b, i);
}

typedef struct {
    uint8_t *dev;
    uint8_t *out;
    size_t len;
} read_t;

/* Runs on the engine's stream: what a kernel reading the blocks would see. */
static void read_fn(void *arg) {
    read_t *rd = arg;
    memcpy(rd->out, rd->dev, rd->len);
}

/* ----------------------------------------------------------- fixtures -- */

typedef struct {
    kvc_agent_t *a;
    uint8_t *dev[NREG];
} side_t;

static void dev_check(void) {
    int d = -1;
    assert_int_equal(cudaGetDevice(&d), cudaSuccess);
    assert_int_equal(d, CALLER_DEV);
    assert_int_equal(cudaPeekAtLastError(), cudaSuccess);
}

static size_t pool_bytes; /* nonzero: the agents' staging_pool_bytes */

static void side_init(side_t *s, const char *name, int ndev, kvc_proto_t proto) {
    /* The staged path alone: an agent that exports CUDA IPC handles
     * completes kvc_publish's capture on the host (test_kvc_ipc.c). */
    kvc_agent_params_t ap = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID | KVC_AGENT_FIELD_PROTO |
                                           KVC_AGENT_FIELD_CUDA_IPC,
                             .engine_id = name,
                             .proto = proto,
                             .cuda_ipc = 0};
    if (pool_bytes) {
        ap.field_mask |= KVC_AGENT_FIELD_STAGING_POOL;
        ap.staging_pool_bytes = pool_bytes;
    }
    assert_int_equal(kvc_agent_create(&ap, &s->a), KVC_OK);
    kvc_region_params_t rp[NREG];
    for (int r = 0; r < NREG; r++) {
        int dev = ndev > 1 ? r / 2 : 0; /* regions 0,1 on device 0; 2,3 on device 1 */
        assert_int_equal(cudaSetDevice(dev), cudaSuccess);
        assert_int_equal(cudaMalloc((void **)&s->dev[r], NB * BL), cudaSuccess);
        rp[r] =
            (kvc_region_params_t){.field_mask = KVC_REGION_FIELD_BASE | KVC_REGION_FIELD_MEM_TYPE |
                                                KVC_REGION_FIELD_CUDA_DEVICE,
                                  .len = NB * BL,
                                  .base = s->dev[r],
                                  .mem_type = KVC_MEM_CUDA,
                                  .cuda_device = dev};
    }
    assert_int_equal(cudaSetDevice(CALLER_DEV < ndev ? CALLER_DEV : 0), cudaSuccess);
    assert_int_equal(kvc_agent_register_regions(s->a, NB, rp, NREG), KVC_OK);
    void *b;
    assert_int_equal(kvc_region_base(s->a, 1, &b), KVC_OK);
    assert_ptr_equal(b, s->dev[1]); /* the device base, not the mirror */
    uint64_t v;
    assert_int_equal(kvc_agent_stat(s->a, KVC_STAT_CUDA_STAGED_REGIONS, &v), KVC_OK);
    assert_int_equal(v, NREG);
}

static void side_cleanup(side_t *s) {
    kvc_agent_destroy(s->a);
    for (int r = 0; r < NREG; r++)
        assert_int_equal(cudaFree(s->dev[r]), cudaSuccess);
}

/* Drives both agents until D reports the fetch and P the release (bounded
 * in turns and time).  Returns the fetch's event status; *msg its text. */
static kvc_status_t run_fetch(side_t *P, side_t *D, kvc_status_t *out_st, char *msg, size_t len,
                              size_t *pending_at_event) {
    int done = 0, released = 0;
    kvc_status_t st = KVC_OK;
    uint64_t t0 = kvc_now_ns();
    for (long turn = 0; !(done && (released || st != KVC_OK)); turn++) {
        assert_true(turn < 2000000 && kvc_now_ns() - t0 < 20000000000ull);
        kvc_agent_progress(P->a);
        dev_check();
        kvc_agent_progress(D->a);
        dev_check();
        kvc_event_t ev;
        while (kvc_agent_next_event(D->a, &ev) == KVC_OK) {
            assert_true(ev.type == KVC_EV_FETCH_DONE || ev.type == KVC_EV_FETCH_FAILED);
            st = ev.status;
            if (msg) snprintf(msg, len, "%s", ev.message ? ev.message : "");
            if (pending_at_event) *pending_at_event = cudasim_pending();
            done = 1;
        }
        while (kvc_agent_next_event(P->a, &ev) == KVC_OK)
            released |= ev.type == KVC_EV_RELEASED;
    }
    if (out_st) *out_st = st;
    return st;
}

/* A fetch; with_stream: the CUDA stream field is set, to `stream` (which may
 * be 0, the legacy default stream). */
static void fetch_with(side_t *D, const char *json, const uint64_t *loc, size_t n, bool with_stream,
                       void *stream) {
    kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS,
                             .kv_transfer_params_json = json,
                             .local_block_ids = loc,
                             .num_local_blocks = n};
    if (with_stream) {
        fp.field_mask |= KVC_FETCH_FIELD_CUDA_STREAM;
        fp.cuda_stream = stream;
    }
    uint64_t xid;
    assert_int_equal(kvc_fetch(D->a, &fp, &xid), KVC_INPROGRESS);
    dev_check();
}

static void start_fetch(side_t *D, const char *json, const uint64_t *loc, size_t n, void *stream) {
    fetch_with(D, json, loc, n, stream != NULL, stream);
}

static void start_fetch_stream(side_t *D, const char *json, const uint64_t *loc, size_t n,
                               void *stream) {
    fetch_with(D, json, loc, n, true, stream);
}

/* Remote blocks 4..7 and 30..33 and 50; local: three runs of four at a stride
 * of ten, then one block: one 2D copy and one 1D copy per region. */
static const uint64_t REM[] = {4, 5, 6, 7, 30, 31, 32, 33, 50, 51, 52, 53, 60};
static const uint64_t LOC[] = {0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 40};
#define NX (sizeof(LOC) / sizeof(LOC[0]))
#define NRUNS 4 /* runs of consecutive (remote, local) pairs above */

static void check_blocks(side_t *D, int gen, const uint64_t *rem, const uint64_t *loc, size_t n) {
    for (int r = 0; r < NREG; r++) {
        for (size_t k = 0; k < n; k++)
            for (size_t i = 0; i < BL; i++)
                if (D->dev[r][loc[k] * BL + i] != pat(gen, r, rem[k], i))
                    fail_msg("region %d local block %llu byte %zu: %u, want %u", r,
                             (unsigned long long)loc[k], i, D->dev[r][loc[k] * BL + i],
                             pat(gen, r, rem[k], i));
        /* Untouched blocks keep what cudaMalloc left there. */
        for (uint64_t b = 0; b < NB; b++) {
            bool fetched = false;
            for (size_t k = 0; k < n; k++)
                fetched |= loc[k] == b;
            if (fetched) continue;
            for (size_t i = 0; i < BL; i++)
                if (D->dev[r][b * BL + i] != 0xA5)
                    fail_msg("untouched block %llu of region %d written", (unsigned long long)b, r);
        }
    }
}

/* Queues the engine's read of one region on its stream `es` (a host function
 * standing in for a kernel); the bytes land in the returned buffer when the
 * stream runs it. */
static uint8_t *engine_read(cudaStream_t es, uint8_t *dev, read_t *rd) {
    uint8_t *out = malloc(NB * BL);
    assert_non_null(out);
    *rd = (read_t){.dev = dev, .out = out, .len = NB * BL};
    assert_int_equal(cudaLaunchHostFunc(es, read_fn, rd), cudaSuccess);
    return out;
}

/* What the engine's read of region r saw after fetch `gen`: the fetched
 * blocks of that generation, not older ones nor half-landed ones. Frees
 * `seen`. */
static void check_seen(uint8_t *seen, int gen, int r) {
    for (size_t k = 0; k < NX; k++)
        for (size_t i = 0; i < BL; i++)
            if (seen[LOC[k] * BL + i] != pat(gen, r, REM[k], i))
                fail_msg("gen %d: the engine's stream read block %llu byte %zu = %u, want %u "
                         "(landed late, or overwritten by the next fetch first?)",
                         gen, (unsigned long long)LOC[k], i, seen[LOC[k] * BL + i],
                         pat(gen, r, REM[k], i));
    free(seen);
}

/* The engine writes the producer's blocks with a "kernel" still queued on
 * its stream, records an event and publishes right away, no host sync. */
static char *publish_after_kernel(side_t *P, fill_t *f, cudaStream_t es, bool by_stream,
                                  const char *id) {
    cudaEvent_t ev = NULL;
    assert_int_equal(cudaLaunchHostFunc(es, fill_fn, f), cudaSuccess);
    kvc_publish_params_t pp = {0};
    if (by_stream) {
        pp.field_mask = KVC_PUBLISH_FIELD_CUDA_STREAM;
        pp.cuda_stream = es;
    } else {
        assert_int_equal(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
        assert_int_equal(cudaEventRecord(ev, es), cudaSuccess);
        pp.field_mask = KVC_PUBLISH_FIELD_CUDA_EVENT;
        pp.cuda_event = ev;
    }
    char *json;
    assert_int_equal(kvc_publish(P->a, id, REM, NX, &pp, &json), KVC_OK);
    dev_check();
    if (ev) assert_int_equal(cudaEventDestroy(ev), cudaSuccess);
    return json;
}

/* ---------------------------------------------------------------- tests -- */

static void roundtrip(bool threaded, kvc_proto_t proto, bool wire) {
    cudasim_reset(2, threaded);
    side_t P, D;
    int s0 = cudasim_streams_live(); /* 0 unless an earlier test failed midway */
    if (wire) setenv("KVC_STAGED_WIRE", "1", 1);
    side_init(&P, "stage-P", 2, proto);
    side_init(&D, "stage-D", 2, proto);
    unsetenv("KVC_STAGED_WIRE");
    assert_int_equal(cudaSetDevice(CALLER_DEV), cudaSuccess);
    assert_int_equal(cudasim_streams_live() - s0, 4); /* one per device per agent */
    cudaStream_t es;
    assert_int_equal(cudaStreamCreateWithFlags(&es, cudaStreamNonBlocking), cudaSuccess);
    fill_t f = {.gen = 1};
    memcpy(f.dev, P.dev, sizeof(f.dev));
    char *json = publish_after_kernel(&P, &f, es, false, "s:1");

    unsigned long m1 = cudasim_calls("cudaMemcpyAsync"), m2 = cudasim_calls("cudaMemcpy2DAsync"),
                  sy = cudasim_calls("cudaStreamSynchronize");
    start_fetch(&D, json, LOC, NX, NULL);
    kvc_free(json);
    size_t pending = 99;
    assert_int_equal(run_fetch(&P, &D, NULL, NULL, 0, &pending), KVC_OK);
    assert_int_equal(pending, 0); /* every copy ran before FETCH_DONE */
    check_blocks(&D, 1, REM, LOC, NX);
    /* Through the pools: one device->pool copy per pushed message on P, one
     * pool->device copy per message on D (four runs per region here), and
     * no host sync on either side. */
    assert_int_equal(cudasim_calls("cudaMemcpy2DAsync") - m2, 0);
    assert_int_equal(cudasim_calls("cudaMemcpyAsync") - m1, 2 * NRUNS * NREG);
    assert_int_equal(cudasim_calls("cudaStreamSynchronize") - sy, 0);
    uint64_t v;
    assert_int_equal(kvc_agent_stat(D.a, KVC_STAT_CUDA_SYNCS, &v), KVC_OK);
    assert_int_equal(v, 0);
    assert_int_equal(kvc_agent_stat(P.a, KVC_STAT_CUDA_SYNCS, &v), KVC_OK);
    assert_int_equal(v, 0); /* kvc_publish did not wait on the host either */
    assert_int_equal(kvc_agent_stat(D.a, KVC_STAT_CUDA_COPIES, &v), KVC_OK);
    assert_int_equal(v, NRUNS * NREG);
    assert_int_equal(kvc_agent_stat(P.a, KVC_STAT_CUDA_COPIES, &v), KVC_OK);
    assert_int_equal(v, NRUNS * NREG);
    /* Staged regions are pushed, whatever the consumer asked for. */
    (void)proto;
    assert_int_equal(kvc_agent_stat(D.a, KVC_STAT_PEERS_PUSH, &v), KVC_OK);
    assert_int_equal(v, 1);
    assert_int_equal(kvc_agent_stat(D.a, KVC_STAT_TRANSPORTS, &v), KVC_OK);
    assert_true(v & KVC_TRANSPORT_TCP);
    /* One host: D copied from P's pool mapped here, unless told the wire. */
    assert_int_equal(kvc_agent_stat(D.a, KVC_STAT_FETCH_STAGED_SHM, &v), KVC_OK);
    assert_int_equal(v, wire ? 0 : 1);
    assert_int_equal(kvc_agent_stat(D.a, KVC_STAT_FETCH_STAGED_WIRE, &v), KVC_OK);
    assert_int_equal(v, wire ? 1 : 0);

    assert_int_equal(cudaStreamDestroy(es), cudaSuccess);
    side_cleanup(&D);
    side_cleanup(&P);
    assert_int_equal(cudasim_streams_live(), s0);
    assert_int_equal(cudasim_pending(), 0);
    cudasim_reset(2, false);
}

static void test_roundtrip_get_lazy(void **state) {
    roundtrip(false, KVC_PROTO_AUTO, false);
}
static void test_roundtrip_push_lazy(void **state) {
    roundtrip(false, KVC_PROTO_PUSH, false);
}
static void test_roundtrip_get_threaded(void **state) {
    roundtrip(true, KVC_PROTO_AUTO, false);
}
static void test_roundtrip_push_threaded(void **state) {
    roundtrip(true, KVC_PROTO_PUSH, false);
}
static void test_roundtrip_wire_lazy(void **state) {
    roundtrip(false, KVC_PROTO_AUTO, true);
}
static void test_roundtrip_wire_threaded(void **state) {
    roundtrip(true, KVC_PROTO_AUTO, true);
}

/* Single-device agents: publish ordered by the engine's stream itself, and
 * the consumer's completion ordered before the engine's stream with no host
 * sync.  The engine reads the blocks on its stream right after each
 * FETCH_DONE without synchronising, and a second fetch into the same local
 * blocks follows at once: its data must not reach the mirror before the
 * first fetch's copies ran. */
static void test_stream_ordering(void **state) {
    cudasim_reset(2, false);
    side_t P, D;
    side_init(&P, "ord-P", 1, KVC_PROTO_AUTO);
    side_init(&D, "ord-D", 1, KVC_PROTO_AUTO);
    cudaStream_t pes, des; /* the engines' streams, on the regions' device 0 */
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    assert_int_equal(cudaStreamCreateWithFlags(&pes, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaStreamCreateWithFlags(&des, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaSetDevice(CALLER_DEV), cudaSuccess);
    uint8_t *seen[3];
    read_t rd[3];
    fill_t f[3];
    for (int gen = 1; gen <= 2; gen++) {
        f[gen] = (fill_t){.gen = gen};
        memcpy(f[gen].dev, P.dev, sizeof(f[gen].dev));
        char id[16];
        snprintf(id, sizeof(id), "o:%d", gen);
        char *json = publish_after_kernel(&P, &f[gen], pes, true, id);
        unsigned long sy = cudasim_calls("cudaStreamSynchronize");
        start_fetch(&D, json, LOC, NX, des);
        kvc_free(json);
        assert_int_equal(run_fetch(&P, &D, NULL, NULL, 0, NULL), KVC_OK);
        assert_int_equal(cudasim_calls("cudaStreamSynchronize") - sy, 0); /* no host sync */
        /* The engine's next "kernel" on its stream reads region 3. */
        seen[gen] = engine_read(des, D.dev[3], &rd[gen]);
    }
    assert_int_equal(cudaStreamSynchronize(des), cudaSuccess);
    for (int gen = 1; gen <= 2; gen++)
        check_seen(seen[gen], gen, 3);
    check_blocks(&D, 2, REM, LOC, NX);
    assert_int_equal(cudaStreamDestroy(pes), cudaSuccess);
    assert_int_equal(cudaStreamDestroy(des), cudaSuccess);
    side_cleanup(&D);
    side_cleanup(&P);
}

/* Eager stand-in, the engine's stream slow (held): the copies of a second
 * fetch into the same local blocks must wait for the engine's read of the
 * first fetch, queued on its stream before, instead of overwriting the
 * blocks under it. */
static void test_fetch_waits_for_engine_reads(void **state) {
    cudasim_reset(2, false);
    cudasim_set_eager(true);
    side_t P, D;
    side_init(&P, "eager-P", 1, KVC_PROTO_AUTO);
    side_init(&D, "eager-D", 1, KVC_PROTO_AUTO);
    cudaStream_t pes, des;
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    assert_int_equal(cudaStreamCreateWithFlags(&pes, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaStreamCreateWithFlags(&des, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaSetDevice(CALLER_DEV), cudaSuccess);
    cudasim_hold(des, true);
    uint8_t *seen[3];
    read_t rd[3];
    fill_t f[3];
    for (int gen = 1; gen <= 2; gen++) {
        f[gen] = (fill_t){.gen = gen};
        memcpy(f[gen].dev, P.dev, sizeof(f[gen].dev));
        char id[16];
        snprintf(id, sizeof(id), "e:%d", gen);
        char *json = publish_after_kernel(&P, &f[gen], pes, true, id);
        start_fetch(&D, json, LOC, NX, des);
        kvc_free(json);
        assert_int_equal(run_fetch(&P, &D, NULL, NULL, 0, NULL), KVC_OK);
        seen[gen] = engine_read(des, D.dev[0], &rd[gen]);
    }
    assert_int_equal(cudaStreamSynchronize(des), cudaSuccess);
    for (int gen = 1; gen <= 2; gen++)
        check_seen(seen[gen], gen, 0);
    check_blocks(&D, 2, REM, LOC, NX);
    cudasim_hold(des, false);
    assert_int_equal(cudaStreamDestroy(pes), cudaSuccess);
    assert_int_equal(cudaStreamDestroy(des), cudaSuccess);
    side_cleanup(&D);
    side_cleanup(&P);
    cudasim_reset(2, false);
}

/* The engine's default stream is a stream: handle 0 (the legacy default
 * stream, what torch.cuda.current_stream().cuda_stream gives unless a side
 * stream is used) and cudaStreamPerThread, passed with the field set.  The
 * engine's "kernel" writes P's blocks on that stream and publishes without a
 * host sync; D's engine reads its blocks on that stream after FETCH_DONE,
 * and a second fetch into the same local blocks follows at once.  Lazy
 * stand-in: nothing on the engine's stream runs unless something waits for
 * it, so a connector that reads 0 as "no stream" captures stale blocks and
 * overwrites blocks the engine has not read yet. */
static void default_stream(cudaStream_t handle) {
    cudasim_reset(2, false);
    side_t P, D;
    side_init(&P, "dflt-P", 1, KVC_PROTO_AUTO);
    side_init(&D, "dflt-D", 1, KVC_PROTO_AUTO);
    uint8_t *seen[3];
    read_t rd[3];
    fill_t f[3];
    for (int gen = 1; gen <= 2; gen++) {
        f[gen] = (fill_t){.gen = gen};
        memcpy(f[gen].dev, P.dev, sizeof(f[gen].dev));
        /* The engine's kernels run on its device's default stream. */
        assert_int_equal(cudaSetDevice(0), cudaSuccess);
        assert_int_equal(cudaLaunchHostFunc(handle, fill_fn, &f[gen]), cudaSuccess);
        assert_int_equal(cudaSetDevice(CALLER_DEV), cudaSuccess);
        kvc_publish_params_t pp = {.field_mask = KVC_PUBLISH_FIELD_CUDA_STREAM,
                                   .cuda_stream = handle};
        char id[16], *json;
        snprintf(id, sizeof(id), "d:%d", gen);
        assert_int_equal(kvc_publish(P.a, id, REM, NX, &pp, &json), KVC_OK);
        dev_check();
        start_fetch_stream(&D, json, LOC, NX, handle);
        kvc_free(json);
        assert_int_equal(run_fetch(&P, &D, NULL, NULL, 0, NULL), KVC_OK);
        assert_int_equal(cudaSetDevice(0), cudaSuccess);
        seen[gen] = engine_read(handle, D.dev[2], &rd[gen]);
        assert_int_equal(cudaSetDevice(CALLER_DEV), cudaSuccess);
    }
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    assert_int_equal(cudaStreamSynchronize(handle), cudaSuccess);
    assert_int_equal(cudaSetDevice(CALLER_DEV), cudaSuccess);
    for (int gen = 1; gen <= 2; gen++)
        check_seen(seen[gen], gen, 2);
    check_blocks(&D, 2, REM, LOC, NX);
    side_cleanup(&D);
    side_cleanup(&P);
    assert_int_equal(cudasim_pending(), 0);
}

static void test_legacy_default_stream(void **state) {
    default_stream(NULL);
}
static void test_per_thread_default_stream(void **state) {
    default_stream(cudaStreamPerThread);
}

/* The staging memory is a bounded pool, not a copy of the regions: two
 * agents with 1 MiB of CUDA regions each and 64 KiB pools (16 KiB slots)
 * move every block of every region, 16 times the pool, in chunks that take
 * turns in the slots, and no more than the two pools is ever pinned. */
static void test_pool_bounded(void **state) {
    cudasim_reset(2, false);
    setenv("KVC_PUSH_CHUNK_KB", "16", 1);
    pool_bytes = 64 << 10;
    size_t pinned0 = cudasim_pinned_bytes();
    side_t P, D;
    side_init(&P, "pool-P", 2, KVC_PROTO_AUTO);
    side_init(&D, "pool-D", 2, KVC_PROTO_AUTO);
    pool_bytes = 0;
    unsetenv("KVC_PUSH_CHUNK_KB");
    assert_int_equal(cudaSetDevice(CALLER_DEV), cudaSuccess);
    cudaStream_t es;
    assert_int_equal(cudaStreamCreateWithFlags(&es, cudaStreamNonBlocking), cudaSuccess);
    fill_t f = {.gen = 5};
    memcpy(f.dev, P.dev, sizeof(f.dev));
    assert_int_equal(cudaLaunchHostFunc(es, fill_fn, &f), cudaSuccess);
    cudaEvent_t ev;
    assert_int_equal(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
    assert_int_equal(cudaEventRecord(ev, es), cudaSuccess);
    uint64_t all[NB];
    for (uint64_t b = 0; b < NB; b++)
        all[b] = b;
    kvc_publish_params_t pp = {.field_mask = KVC_PUBLISH_FIELD_CUDA_EVENT, .cuda_event = ev};
    char *json;
    assert_int_equal(kvc_publish(P.a, "pool:1", all, NB, &pp, &json), KVC_OK);
    assert_int_equal(cudaEventDestroy(ev), cudaSuccess);
    start_fetch(&D, json, all, NB, NULL);
    kvc_free(json);
    assert_int_equal(run_fetch(&P, &D, NULL, NULL, 0, NULL), KVC_OK);
    for (int r = 0; r < NREG; r++)
        for (uint64_t b = 0; b < NB; b++)
            for (size_t i = 0; i < BL; i++)
                if (D.dev[r][b * BL + i] != pat(5, r, b, i))
                    fail_msg("region %d block %llu byte %zu", r, (unsigned long long)b, i);
    size_t regions = (size_t)NREG * NB * BL, peak = cudasim_pinned_peak() - pinned0;
    printf("staging: regions %zu bytes per agent, pinned peak %zu bytes for two agents "
           "(a full mirror: %zu)\n",
           regions, peak, 2 * regions);
    /* D pins its own pool and its mapping of P's (staged-shm: it copies
     * from P's slots), P its pool: never more. */
    assert_true(peak <= 3 * (size_t)(64 << 10));
    uint64_t v;
    assert_int_equal(kvc_agent_stat(D.a, KVC_STAT_CUDA_COPIES, &v), KVC_OK);
    assert_int_equal(v, NREG * NB * BL / (16 << 10)); /* one copy per 16 KiB message */
    assert_int_equal(cudaStreamDestroy(es), cudaSuccess);
    side_cleanup(&D);
    side_cleanup(&P);
    assert_int_equal(cudasim_pinned_bytes(), pinned0);
    assert_int_equal(cudasim_pending(), 0);
}

/* The engine aborts a request (kvc_unpublish) while a staged push of it is
 * halfway through the pool: the push stops, the fetch fails (DENIED) instead
 * of completing with blocks the engine may already be reusing. */
static void test_unpublish_stops_staged_push(void **state) {
    cudasim_reset(2, false);
    setenv("KVC_PUSH_CHUNK_KB", "16", 1);
    pool_bytes = 32 << 10; /* two 16 KiB slots: 64 chunks take turns */
    side_t P, D;
    side_init(&P, "unpub-P", 2, KVC_PROTO_AUTO);
    side_init(&D, "unpub-D", 2, KVC_PROTO_AUTO);
    pool_bytes = 0;
    unsetenv("KVC_PUSH_CHUNK_KB");
    assert_int_equal(cudaSetDevice(CALLER_DEV), cudaSuccess);
    uint64_t all[NB];
    for (uint64_t b = 0; b < NB; b++)
        all[b] = b;
    char *json;
    assert_int_equal(kvc_publish(P.a, "unpub:1", all, NB, NULL, &json), KVC_OK);
    start_fetch(&D, json, all, NB, NULL);
    kvc_free(json);
    bool unpublished = false;
    int got = 0;
    kvc_status_t st = KVC_OK;
    uint64_t t0 = kvc_now_ns();
    for (long turn = 0; !got; turn++) {
        assert_true(turn < 2000000 && kvc_now_ns() - t0 < 20000000000ull);
        kvc_agent_progress(P.a);
        kvc_agent_progress(D.a);
        uint64_t copies = 0;
        assert_int_equal(kvc_agent_stat(D.a, KVC_STAT_CUDA_COPIES, &copies), KVC_OK);
        if (!unpublished && copies >= 2) {
            assert_int_equal(kvc_unpublish(P.a, "unpub:1"), KVC_OK);
            unpublished = true;
        }
        kvc_event_t ev;
        while (kvc_agent_next_event(D.a, &ev) == KVC_OK) {
            got = ev.type == KVC_EV_FETCH_DONE ? 1 : ev.type == KVC_EV_FETCH_FAILED ? 2 : 0;
            st = ev.status;
        }
        while (kvc_agent_next_event(P.a, &ev) == KVC_OK)
            ;
    }
    assert_true(unpublished);
    assert_int_equal(got, 2);
    assert_int_equal(st, KVC_ERR_DENIED);
    side_cleanup(&D);
    side_cleanup(&P);
}

/* A copy that fails to queue halfway through a fetch: FETCH_FAILED with the
 * CUDA error's name, and nothing still queued when the event arrives. */
static void fetch_failure(bool async) {
    cudasim_reset(2, false);
    side_t P, D;
    setenv("KVC_STAGE_WINDOW", "64", 1); /* every chunk of the job in flight at once */
    side_init(&P, "fail-P", 2, KVC_PROTO_AUTO);
    side_init(&D, "fail-D", 2, KVC_PROTO_AUTO);
    unsetenv("KVC_STAGE_WINDOW");
    assert_int_equal(cudaSetDevice(CALLER_DEV), cudaSuccess);
    cudaStream_t es;
    assert_int_equal(cudaStreamCreateWithFlags(&es, cudaStreamNonBlocking), cudaSuccess);
    fill_t f = {.gen = 3};
    memcpy(f.dev, P.dev, sizeof(f.dev));
    char *json = publish_after_kernel(&P, &f, es, false, "f:1");
    /* P queues its NRUNS * NREG device->pool copies as soon as the pull
     * arrives (its pool has slots for all, its window is wide enough); D's
     * third pool->device copy comes after them. */
    unsigned nth = NRUNS * NREG + 3;
    if (async)
        cudasim_fail_async("cudaMemcpyAsync", nth, cudaErrorLaunchFailure);
    else
        cudasim_fail("cudaMemcpyAsync", nth, cudaErrorIllegalAddress);
    start_fetch(&D, json, LOC, NX, NULL);
    kvc_free(json);
    char msg[512];
    kvc_status_t st;
    run_fetch(&P, &D, &st, msg, sizeof(msg), NULL);
    assert_int_equal(st, KVC_ERR_CUDA);
    assert_non_null(strstr(msg, async ? "cudaErrorLaunchFailure" : "cudaErrorIllegalAddress"));
    assert_int_equal(cudaPeekAtLastError(), cudaSuccess);
    /* Nothing lands in D's blocks after FETCH_FAILED: what they hold now is
     * what they hold once both agents ran everything still in flight. */
    uint8_t *snap[NREG];
    for (int r = 0; r < NREG; r++) {
        assert_non_null(snap[r] = malloc(NB * BL));
        memcpy(snap[r], D.dev[r], NB * BL);
    }
    for (int turn = 0; turn < 2000; turn++) {
        kvc_agent_progress(P.a);
        kvc_agent_progress(D.a);
    }
    for (int d = 0; d < 2; d++) {
        assert_int_equal(cudaSetDevice(d), cudaSuccess);
        (void)cudaDeviceSynchronize();
        (void)cudaGetLastError();
    }
    assert_int_equal(cudaSetDevice(CALLER_DEV), cudaSuccess);
    for (int r = 0; r < NREG; r++) {
        assert_memory_equal(snap[r], D.dev[r], NB * BL);
        free(snap[r]);
    }
    uint64_t v;
    assert_int_equal(kvc_agent_stat(D.a, KVC_STAT_FETCH_FAILED, &v), KVC_OK);
    assert_int_equal(v, 1);
    assert_int_equal(cudaStreamDestroy(es), cudaSuccess);
    side_cleanup(&D);
    side_cleanup(&P);
}

static void test_fetch_copy_fails(void **state) {
    fetch_failure(false);
}
static void test_fetch_copy_fails_async(void **state) {
    fetch_failure(true);
}

/* A publish whose capture fails (the wait on the engine's event, on the
 * second device) publishes nothing and leaves nothing queued. */
static void test_publish_failure(void **state) {
    cudasim_reset(2, false);
    side_t P;
    side_init(&P, "pfail-P", 2, KVC_PROTO_AUTO);
    assert_int_equal(cudaSetDevice(CALLER_DEV), cudaSuccess);
    cudaEvent_t ev;
    assert_int_equal(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
    cudaStream_t ks;
    assert_int_equal(cudaStreamCreateWithFlags(&ks, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaEventRecord(ev, ks), cudaSuccess);
    kvc_publish_params_t ep = {.field_mask = KVC_PUBLISH_FIELD_CUDA_EVENT, .cuda_event = ev};
    cudasim_fail("cudaStreamWaitEvent", 2, cudaErrorInvalidValue);
    char *json = NULL;
    assert_int_equal(kvc_publish(P.a, "p:1", REM, NX, &ep, &json), KVC_ERR_CUDA);
    assert_int_equal(cudaStreamSynchronize(ks), cudaSuccess);
    assert_int_equal(cudaEventDestroy(ev), cudaSuccess);
    assert_int_equal(cudaStreamDestroy(ks), cudaSuccess);
    assert_null(json);
    dev_check();
    assert_int_equal(cudasim_pending(), 0);
    uint64_t v;
    assert_int_equal(kvc_agent_stat(P.a, KVC_STAT_PUBLISHED_NOW, &v), KVC_OK);
    assert_int_equal(v, 0);
    /* A stream to wait on needs regions on one device. */
    cudaStream_t es;
    assert_int_equal(cudaStreamCreateWithFlags(&es, cudaStreamNonBlocking), cudaSuccess);
    kvc_publish_params_t pp = {.field_mask = KVC_PUBLISH_FIELD_CUDA_STREAM, .cuda_stream = es};
    assert_int_equal(kvc_publish(P.a, "p:2", REM, NX, &pp, &json), KVC_ERR_INVALID_PARAM);
    dev_check();
    /* The same publish with no fault works. */
    assert_int_equal(kvc_publish(P.a, "p:1", REM, NX, NULL, &json), KVC_OK);
    kvc_free(json);
    dev_check();
    assert_int_equal(cudaStreamDestroy(es), cudaSuccess);
    side_cleanup(&P);
}

/* Registration: the device comes from the pointer; a disagreeing
 * cuda_device, host memory called CUDA, or no device at all are refused
 * with a clear status and CUDA's last error left clear. */
static void test_register_checks(void **state) {
    cudasim_reset(2, false);
    kvc_agent_params_t ap = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID, .engine_id = "reg"};
    kvc_agent_t *a;
    void *d1;
    assert_int_equal(cudaSetDevice(1), cudaSuccess);
    assert_int_equal(cudaMalloc(&d1, NB * BL), cudaSuccess);
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    kvc_region_params_t rp = {.field_mask = KVC_REGION_FIELD_BASE | KVC_REGION_FIELD_MEM_TYPE |
                                            KVC_REGION_FIELD_CUDA_DEVICE,
                              .len = NB * BL,
                              .base = d1,
                              .mem_type = KVC_MEM_CUDA,
                              .cuda_device = 0};
    assert_int_equal(kvc_agent_create(&ap, &a), KVC_OK);
    assert_int_equal(kvc_agent_register_regions(a, NB, &rp, 1), KVC_ERR_INVALID_PARAM);
    int d = -1;
    assert_int_equal(cudaGetDevice(&d), cudaSuccess);
    assert_int_equal(d, 0);
    uint8_t *host = malloc(NB * BL);
    rp.base = host;
    rp.cuda_device = 1;
    assert_int_equal(kvc_agent_register_regions(a, NB, &rp, 1), KVC_ERR_INVALID_PARAM);
    rp.base = (uint8_t *)d1 + BL; /* runs past the end of the allocation */
    assert_int_equal(kvc_agent_register_regions(a, NB, &rp, 1), KVC_ERR_INVALID_PARAM);
    /* Two allocations side by side on one device: both ends are device
     * memory of device 1, yet the region is not one allocation. */
    void *two;
    assert_int_equal(cudaSetDevice(1), cudaSuccess);
    assert_int_equal(cudaMalloc(&two, 2 * NB * BL), cudaSuccess);
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    cudasim_split(two, NB * BL);
    rp.base = (uint8_t *)two + NB * BL / 2;
    assert_int_equal(kvc_agent_register_regions(a, NB, &rp, 1), KVC_ERR_INVALID_PARAM);
    assert_int_equal(cudaFree(two), cudaSuccess);
    rp.base = d1;
    assert_int_equal(kvc_agent_register_regions(a, NB, &rp, 1), KVC_OK); /* device 1 agrees */
    assert_int_equal(cudaGetDevice(&d), cudaSuccess);
    assert_int_equal(d, 0);
    assert_int_equal(cudaPeekAtLastError(), cudaSuccess);
    kvc_agent_destroy(a);

    cudasim_reset(0, false); /* no driver: every call fails with error 35 */
    assert_int_equal(kvc_agent_create(&ap, &a), KVC_OK);
    assert_int_equal(kvc_agent_register_regions(a, NB, &rp, 1), KVC_ERR_NO_DEVICE);
    assert_int_equal(cudaPeekAtLastError(), cudaSuccess);
    kvc_agent_destroy(a);
    cudasim_reset(2, false);
    assert_int_equal(cudaFree(d1), cudaSuccess);
    free(host);
}

/* A UCX that says it supports CUDA memory but cannot register a region
 * (here: UCX without CUDA, told otherwise): the region is staged through the
 * pool instead of failing the registration, and blocks still move. */
static void test_direct_falls_back_to_staged(void **state) {
    cudasim_reset(2, false);
    kvc_agent_params_t ap = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID, .engine_id = "fb"};
    kvc_agent_t *a;
    void *d0;
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    assert_int_equal(cudaMalloc(&d0, NB * BL), cudaSuccess);
    kvc_region_params_t rp = {.field_mask = KVC_REGION_FIELD_BASE | KVC_REGION_FIELD_MEM_TYPE,
                              .len = NB * BL,
                              .base = d0,
                              .mem_type = KVC_MEM_CUDA};
    assert_int_equal(kvc_agent_create(&ap, &a), KVC_OK);
    a->cuda_native = true; /* what ucp_context_query would say on a GPU host */
    assert_int_equal(kvc_agent_register_regions(a, NB, &rp, 1), KVC_OK);
    uint64_t v;
    assert_int_equal(kvc_agent_stat(a, KVC_STAT_CUDA_STAGED_REGIONS, &v), KVC_OK);
    assert_int_equal(v, 1);
    assert_int_equal(kvc_agent_stat(a, KVC_STAT_CUDA_DIRECT_REGIONS, &v), KVC_OK);
    assert_int_equal(v, 0);
    assert_int_equal(cudaPeekAtLastError(), cudaSuccess);
    kvc_agent_destroy(a);
    assert_int_equal(cudaFree(d0), cudaSuccess);
}

/* Hybrid models: kv_transfer_params with several KV-cache groups are refused
 * before anything moves. */
static void test_hybrid_groups(void **state) {
    cudasim_reset(2, false);
    side_t D;
    side_init(&D, "hyb-D", 2, KVC_PROTO_AUTO);
    uint64_t loc[] = {1, 2};
    kvc_fetch_params_t fp = {
        .field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS,
        .kv_transfer_params_json =
            "{\"remote_block_ids\":[[4,5],[6,7]],\"remote_engine_id\":\"e\","
            "\"remote_request_id\":\"r\",\"remote_host\":\"127.0.0.1\",\"remote_port\":9,"
            "\"remote_kv_token\":\"00112233445566778899aabbccddeeff\"}",
        .local_block_ids = loc,
        .num_local_blocks = 2};
    uint64_t xid;
    assert_int_equal(kvc_fetch(D.a, &fp, &xid), KVC_ERR_INCOMPATIBLE);
    side_cleanup(&D);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_get_lazy),
        cmocka_unit_test(test_roundtrip_push_lazy),
        cmocka_unit_test(test_roundtrip_get_threaded),
        cmocka_unit_test(test_roundtrip_push_threaded),
        cmocka_unit_test(test_roundtrip_wire_lazy),
        cmocka_unit_test(test_roundtrip_wire_threaded),
        cmocka_unit_test(test_stream_ordering),
        cmocka_unit_test(test_fetch_waits_for_engine_reads),
        cmocka_unit_test(test_legacy_default_stream),
        cmocka_unit_test(test_per_thread_default_stream),
        cmocka_unit_test(test_pool_bounded),
        cmocka_unit_test(test_unpublish_stops_staged_push),
        cmocka_unit_test(test_fetch_copy_fails),
        cmocka_unit_test(test_fetch_copy_fails_async),
        cmocka_unit_test(test_publish_failure),
        cmocka_unit_test(test_register_checks),
        cmocka_unit_test(test_direct_falls_back_to_staged),
        cmocka_unit_test(test_hybrid_groups),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
