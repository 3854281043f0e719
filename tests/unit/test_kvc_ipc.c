/* SPDX-License-Identifier: Apache-2.0 */
/* Unit test: the same-node CUDA IPC path (connector/ipc.c, the real code)
 * across two processes, over the CUDA stand-in (tests/cudasim: device
 * memory is a memfd the other process maps with cudaIpcOpenMemHandle).
 *
 * The producer is this binary run again ("--producer MODE"): it registers
 * two CUDA regions that share one allocation (region 1 at an offset inside
 * it), fills them, publishes, prints the kv_transfer_params on stdout and
 * serves until its stdin closes, printing "RELEASED" when the publication
 * is released.  The consumer (this process) has one region on each of two
 * devices, so the producer's allocation is opened once per device.
 * Checked: every byte of fetched blocks and of untouched ones, the path
 * (stats), mappings closed with the peer; a read after expiry DENIED with
 * nothing copied; a hold broken mid-read (the producer's xfer timeout
 * passes while the copies are queued) DENIED; a producer killed mid-copy
 * fails the fetch; a failing cudaIpcOpenMemHandle, KVC_IPC=0 on either
 * side and a producer on "another node" fall back to the staged push,
 * byte-exact; the IPC table's parser refuses what it must.
 * The same with the producer's memory mapped through the driver's VMM API
 * as PyTorch's expandable segments map it ("vmm" modes: three physical
 * allocations mapped one after the other, each region spanning two of
 * them): fds over the producer's Unix socket, byte-exact, a read after
 * expiry DENIED, the producer killed mid-copy, and the staged push when
 * the allocations cannot be exported (created without the POSIX fd handle
 * type, as vLLM's sleep-mode allocator creates them) or not imported. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "connector/kvc_int.h"
#include "connector/kvc_vmm.h"
#include "tests/cudasim/cudasim.h"
#include "tests/gpu/vmm_alloc.h"

#define NB 64
#define BL 4096
#define NREG 2
#define SECRET "unit-kvc-ipc-secret"

static const char *self_exe;

static uint8_t pat(int r, uint64_t b, size_t i) {
    return (uint8_t)(r * 131 + b * 7 + i * 13 + (i >> 9) + 1);
}

static void quiet_log(void *arg, kvc_log_level_t level, const char *msg) {
    (void)level;
    if (getenv("KVC_TEST_VERBOSE")) fprintf(stderr, "%s: %s\n", (const char *)arg, msg);
}

static uint32_t connect_ms; /* the next agents' connect timeout (0: the default) */
static uint32_t tp_size;    /* the next agents' TP size (0: 1) */

static kvc_agent_t *agent(const char *name, uint32_t xfer_timeout_ms) {
    kvc_agent_params_t ap = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID | KVC_AGENT_FIELD_SECRET |
                                           KVC_AGENT_FIELD_LOG | KVC_AGENT_FIELD_XFER_TIMEOUT |
                                           KVC_AGENT_FIELD_CONNECT_TIMEOUT |
                                           (tp_size ? KVC_AGENT_FIELD_TP_SIZE : 0),
                             .engine_id = name,
                             .secret = SECRET,
                             .secret_len = strlen(SECRET),
                             .log_cb = quiet_log,
                             .log_arg = (void *)name,
                             .log_level = KVC_LOG_DEBUG,
                             .xfer_timeout_ms = xfer_timeout_ms,
                             .connect_timeout_ms = connect_ms,
                             .tp_size = tp_size};
    kvc_agent_t *a = NULL;
    return kvc_agent_create(&ap, &a) == KVC_OK ? a : NULL;
}

static kvc_region_params_t cuda_region(void *base, int dev) {
    return (kvc_region_params_t){.field_mask = KVC_REGION_FIELD_BASE | KVC_REGION_FIELD_MEM_TYPE |
                                               KVC_REGION_FIELD_CUDA_DEVICE,
                                 .len = NB * BL,
                                 .base = base,
                                 .mem_type = KVC_MEM_CUDA,
                                 .cuda_device = dev};
}

/* The publication: remote 4..7, 30..33, 50..53, 60, fetched into local
 * 0..3, 10..13, 20..23, 40. */
static const uint64_t REM[] = {4, 5, 6, 7, 30, 31, 32, 33, 50, 51, 52, 53, 60};
static const uint64_t LOC[] = {0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 40};
#define NX (sizeof(LOC) / sizeof(LOC[0]))

/* ------------------------------------------------------------ producer -- */

/* Modes: "serve"; "expire" (the publication expires after 150 ms);
 * "short-hold" (xfer timeout 300 ms: a read's hold breaks after it; a 'U'
 * on stdin unpublishes, as an engine aborting the request; once released
 * the blocks are overwritten, as the engine reuses them); "other-host"
 * (poses as another node); "no-ipc" (KVC_IPC=0); "vmm" and "vmm-expire"
 * ("serve" and "expire" with the memory mapped through the VMM API, in
 * physical allocations of 192 KiB); "vmm-nofd" (the same, created without
 * the POSIX fd handle type); "vmm-export-fails" (the producer's first
 * cuMemExportToShareableHandle fails: its socket refuses the request);
 * "stream" ("serve" with the blocks written by copies still queued on the
 * engine's stream when it publishes, the stream given to kvc_publish: the
 * stand-in is lazy, so they run only when someone waits for them; prints
 * the host syncs kvc_publish made, "syncs_at_publish=N", before the JSON);
 * "vmm-stall" (its exports take 2 s each: a consumer's fd request is taken
 * and answered only after the consumer's 1 s connect timeout). */
static int producer_main(const char *mode) {
    setenv("UCX_TLS", "tcp,self", 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    bool vmm = !strncmp(mode, "vmm", 3), nofd = !strcmp(mode, "vmm-nofd");
    bool noexport = !strcmp(mode, "vmm-export-fails"), stall = !strcmp(mode, "vmm-stall");
    if (vmm) mode = !strcmp(mode, "vmm-expire") ? "expire" : "serve";
    if (!strcmp(mode, "other-host")) setenv("KVC_TEST_HOST_ID", "another-node", 1);
    if (!strcmp(mode, "no-ipc")) setenv("KVC_IPC", "0", 1);
    cudasim_reset(2, false);
    if (noexport) cudasim_fail("cuMemExportToShareableHandle", 1, cudaErrorNotSupported);
    if (stall) cudasim_vmm_stall_export(2000);
    kvc_agent_t *a = agent("ipc-P", !strcmp(mode, "short-hold") ? 300 : 30000);
    bool by_stream = !strcmp(mode, "stream");
    uint8_t *mem = NULL, *host = malloc(NREG * NB * BL);
    cudaStream_t es = NULL;
    if (by_stream && cudaStreamCreateWithFlags(&es, cudaStreamNonBlocking) != cudaSuccess) return 2;
    /* Both regions in one allocation, region 1 a page and a half in. */
    size_t off1 = NB * BL + 6144;
    vmm_mem_t vm = {0};
    if (vmm && vmm_alloc(&vm, off1 + NB * BL, 3 * 64 * 1024, 0, !nofd) == 0)
        mem = (uint8_t *)(uintptr_t)vm.va;
    else if (!vmm && cudaMalloc((void **)&mem, off1 + NB * BL) != cudaSuccess)
        mem = NULL;
    if (!a || !host || !mem) return 2;
    kvc_region_params_t rp[NREG] = {cuda_region(mem, 0), cuda_region(mem + off1, 0)};
    for (int r = 0; r < NREG; r++) {
        uint8_t *h = host + (size_t)r * NB * BL;
        for (uint64_t b = 0; b < NB; b++)
            for (size_t i = 0; i < BL; i++)
                h[b * BL + i] = pat(r, b, i);
        if (by_stream ? cudaMemset(rp[r].base, 0xEE, NB * BL) != cudaSuccess ||
                            cudaMemcpyAsync(rp[r].base, h, NB * BL, cudaMemcpyHostToDevice, es) !=
                                cudaSuccess
                      : cudaMemcpy(rp[r].base, h, NB * BL, cudaMemcpyHostToDevice) != cudaSuccess)
            return 2;
    }
    if (kvc_agent_register_regions(a, NB, rp, NREG) != KVC_OK) return 2;
    kvc_publish_params_t pp = {.field_mask = KVC_PUBLISH_FIELD_EXPIRY |
                                             (by_stream ? KVC_PUBLISH_FIELD_CUDA_STREAM : 0),
                               .expiry_ms = !strcmp(mode, "expire") ? 150 : 30000,
                               .cuda_stream = es};
    char *json = NULL;
    unsigned long s0 = cudasim_calls("cudaStreamSynchronize") +
                       cudasim_calls("cudaEventSynchronize") +
                       cudasim_calls("cudaDeviceSynchronize");
    if (kvc_publish(a, "ipc-req", REM, NX, &pp, &json) != KVC_OK) return 2;
    printf("syncs_at_publish=%lu\n",
           cudasim_calls("cudaStreamSynchronize") + cudasim_calls("cudaEventSynchronize") +
               cudasim_calls("cudaDeviceSynchronize") - s0);
    printf("%s\n", json);
    fflush(stdout);
    kvc_free(json);
    for (uint64_t t0 = kvc_now_ns(); kvc_now_ns() - t0 < 60000000000ull;) {
        kvc_agent_wait(a, 5);
        kvc_event_t ev;
        while (kvc_agent_next_event(a, &ev) == KVC_OK)
            if (ev.type == KVC_EV_RELEASED) {
                if (cudaMemset(mem, 0xEE, off1 + NB * BL) != cudaSuccess ||
                    cudaDeviceSynchronize() != cudaSuccess)
                    return 2;
                printf("RELEASED\n");
                fflush(stdout);
            }
        struct pollfd pf = {.fd = 0, .events = POLLIN};
        char c;
        if (poll(&pf, 1, 0) == 1) {
            if (read(0, &c, 1) <= 0) break; /* the consumer is done */
            if (c == 'U' && kvc_unpublish(a, "ipc-req") == KVC_ERR_NOT_FOUND) return 2;
        }
    }
    kvc_agent_destroy(a);
    if (es) cudaStreamDestroy(es);
    if (vmm)
        vmm_free(&vm);
    else
        cudaFree(mem);
    free(host);
    return 0;
}

/* ------------------------------------------------------------ consumer -- */

typedef struct {
    int syncs_at_publish; /* the producer's, -1: not said */
    pid_t pid;
    int open0;   /* IPC mappings open before the test */
    int in, out; /* the producer's stdin (ours to write) and stdout */
    char json[8192];
    kvc_agent_t *a;
    uint8_t *dev[NREG];
} ctx_t;

/* One line of the producer's stdout, waited for up to ms. */
static bool read_line(ctx_t *c, char *buf, size_t len, int ms) {
    size_t k = 0;
    uint64_t t0 = kvc_now_ns();
    while (k + 1 < len) {
        struct pollfd pf = {.fd = c->out, .events = POLLIN};
        int left = ms - (int)((kvc_now_ns() - t0) / 1000000);
        if (left <= 0 || poll(&pf, 1, left) != 1) return false;
        if (read(c->out, buf + k, 1) != 1) return false;
        if (buf[k] == '\n') break;
        k++;
    }
    buf[k] = 0;
    return true;
}

static void start(ctx_t *c, const char *mode, uint32_t xfer_timeout_ms) {
    memset(c, 0, sizeof(*c));
    c->open0 = cudasim_ipc_open_count();
    int pin[2], pout[2];
    assert_int_equal(pipe(pin), 0);
    assert_int_equal(pipe(pout), 0);
    c->pid = fork();
    assert_true(c->pid >= 0);
    if (c->pid == 0) {
        dup2(pin[0], 0);
        dup2(pout[1], 1);
        close(pin[1]);
        close(pout[0]);
        execl(self_exe, self_exe, "--producer", mode, (char *)NULL);
        _exit(127);
    }
    close(pin[0]);
    close(pout[1]);
    c->in = pin[1];
    c->out = pout[0];
    /* UCX may log on stdout too: the params are the line that is JSON. */
    c->syncs_at_publish = -1;
    do {
        assert_true(read_line(c, c->json, sizeof(c->json), 20000));
        sscanf(c->json, "syncs_at_publish=%d", &c->syncs_at_publish);
    } while (c->json[0] != '{');
    assert_non_null(strstr(c->json, "remote_kv_token"));
    setenv("UCX_TLS", "tcp,self", 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    cudasim_reset(2, false);
    assert_non_null(c->a = agent("ipc-D", xfer_timeout_ms));
    kvc_region_params_t rp[NREG];
    for (int r = 0; r < NREG; r++) {
        assert_int_equal(cudaSetDevice(r), cudaSuccess); /* region r on device r */
        assert_int_equal(cudaMalloc((void **)&c->dev[r], NB * BL), cudaSuccess);
        rp[r] = cuda_region(c->dev[r], r);
    }
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    assert_int_equal(kvc_agent_register_regions(c->a, NB, rp, NREG), KVC_OK);
}

/* Ends the producer (stdin closed, waited for) and the consumer.  The
 * producer's exit status, or -1 when it was killed. */
static int finish(ctx_t *c) {
    kvc_agent_destroy(c->a);
    assert_int_equal(cudasim_ipc_open_count(), c->open0); /* closed with the peer */
    assert_int_equal(cudasim_vmm_mappings(), 0);          /* unmapped with the peer */
    assert_int_equal(cudasim_vmm_allocations(), 0);       /* imported handles released */
    for (int r = 0; r < NREG; r++)
        assert_int_equal(cudaFree(c->dev[r]), cudaSuccess);
    close(c->in);
    int status = 0;
    assert_int_equal(waitpid(c->pid, &status, 0), c->pid);
    close(c->out);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static uint64_t kstat(ctx_t *c, kvc_stat_t s) {
    uint64_t v = 0;
    assert_int_equal(kvc_agent_stat(c->a, s, &v), KVC_OK);
    return v;
}

static void fetch(ctx_t *c) {
    kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS,
                             .kv_transfer_params_json = c->json,
                             .local_block_ids = LOC,
                             .num_local_blocks = NX};
    uint64_t id;
    assert_int_equal(kvc_fetch(c->a, &fp, &id), KVC_INPROGRESS);
}

/* Progresses until the fetch's event (or until `until` holds, when given);
 * 20 s at most.  Returns the event's status (KVC_INPROGRESS: stopped by
 * `until`). */
static kvc_status_t pump(ctx_t *c, bool (*until)(void), char *msg, size_t len) {
    uint64_t t0 = kvc_now_ns();
    for (;;) {
        assert_true(kvc_now_ns() - t0 < 20000000000ull);
        kvc_agent_progress(c->a);
        kvc_event_t ev;
        while (kvc_agent_next_event(c->a, &ev) == KVC_OK)
            if (ev.type == KVC_EV_FETCH_DONE || ev.type == KVC_EV_FETCH_FAILED) {
                if (msg) snprintf(msg, len, "%s", ev.message ? ev.message : "");
                return ev.status;
            }
        if (until && until()) return KVC_INPROGRESS;
        usleep(100);
    }
}

static void check_bytes(ctx_t *c) {
    for (int r = 0; r < NREG; r++)
        for (uint64_t b = 0; b < NB; b++) {
            uint64_t rem = UINT64_MAX;
            for (size_t k = 0; k < NX; k++)
                if (LOC[k] == b) rem = REM[k];
            for (size_t i = 0; i < BL; i++) {
                uint8_t want = rem == UINT64_MAX ? 0xA5 : pat(r, rem, i);
                if (c->dev[r][b * BL + i] != want)
                    fail_msg("region %d local block %llu byte %zu: %u, want %u", r,
                             (unsigned long long)b, i, c->dev[r][b * BL + i], want);
            }
        }
}

static void untouched(ctx_t *c) {
    for (int r = 0; r < NREG; r++)
        for (size_t i = 0; i < NB * BL; i++)
            if (c->dev[r][i] != 0xA5) fail_msg("region %d byte %zu written", r, i);
}

static void wait_released(ctx_t *c) {
    char line[512];
    do
        assert_true(read_line(c, line, sizeof(line), 20000));
    while (strcmp(line, "RELEASED"));
}

/* A fetch over CUDA IPC from a producer in `mode`, byte-exact, then
 * checked further by `more` before the producer goes. */
static void ipc_fetch(const char *mode, void (*more)(ctx_t *c)) {
    ctx_t c;
    start(&c, mode, 30000);
    fetch(&c);
    char msg[300];
    kvc_status_t st = pump(&c, NULL, msg, sizeof(msg));
    if (st != KVC_OK) fail_msg("fetch failed: %s (%s)", msg, kvc_status_str(st));
    check_bytes(&c);
    assert_int_equal(kstat(&c, KVC_STAT_PEERS_IPC), 1);
    assert_int_equal(kstat(&c, KVC_STAT_PEERS_PUSH), 0);
    assert_int_equal(kstat(&c, KVC_STAT_BYTES_IPC), NX * BL * NREG);
    assert_int_equal(kstat(&c, KVC_STAT_CUDA_COPIES), 0); /* device to device, no staging */
    more(&c);
    wait_released(&c);
    assert_int_equal(finish(&c), 0);
}

/* Fetches over CUDA IPC reuse their events: three fetches of one
 * publication (a consumer of TP 3: the producer releases it at the third
 * notification), events created for the first only (one per device), none
 * after; no host sync in any (their events are polled). */
static void test_ipc_fetches_reuse_events(void **state) {
    (void)state;
    tp_size = 3;
    ctx_t c;
    start(&c, "serve", 30000);
    tp_size = 0;
    unsigned long created[3], syncs = 0;
    for (int i = 0; i < 3; i++) {
        unsigned long e0 = cudasim_calls("cudaEventCreateWithFlags");
        unsigned long s0 = cudasim_calls("cudaStreamSynchronize") +
                           cudasim_calls("cudaEventSynchronize") +
                           cudasim_calls("cudaDeviceSynchronize");
        memset(c.dev[0], 0xA5, NB * BL);
        memset(c.dev[1], 0xA5, NB * BL);
        fetch(&c);
        char msg[300];
        kvc_status_t st = pump(&c, NULL, msg, sizeof(msg));
        if (st != KVC_OK) fail_msg("fetch %d failed: %s (%s)", i, msg, kvc_status_str(st));
        check_bytes(&c);
        created[i] = cudasim_calls("cudaEventCreateWithFlags") - e0;
        syncs += cudasim_calls("cudaStreamSynchronize") + cudasim_calls("cudaEventSynchronize") +
                 cudasim_calls("cudaDeviceSynchronize") - s0;
    }
    print_message("IPC fetches: events created %lu, %lu, %lu; host syncs %lu\n", created[0],
                  created[1], created[2], syncs);
    assert_int_equal(kstat(&c, KVC_STAT_BYTES_IPC), 3 * NX * BL * NREG);
    assert_int_equal(created[0], NREG); /* one per device */
    assert_int_equal(created[1], 0);
    assert_int_equal(created[2], 0);
    assert_int_equal(syncs, 0);
    wait_released(&c);
    assert_int_equal(finish(&c), 0);
}

/* The producer's blocks are written by copies still queued on its
 * engine's stream when it publishes (given the stream): kvc_publish makes
 * no host sync (an event recorded after its wait is checked, and waited
 * for, before the HOLD is confirmed), and the consumer's copies see every
 * written byte: a confirmation that did not wait would let them read the
 * 0xEE the blocks held before. */
static void test_ipc_publish_by_stream(void **state) {
    (void)state;
    ctx_t c;
    start(&c, "stream", 30000);
    assert_int_equal(c.syncs_at_publish, 0);
    fetch(&c);
    char msg[300];
    kvc_status_t st = pump(&c, NULL, msg, sizeof(msg));
    if (st != KVC_OK) fail_msg("fetch failed: %s (%s)", msg, kvc_status_str(st));
    check_bytes(&c);
    assert_int_equal(kstat(&c, KVC_STAT_BYTES_IPC), NX * BL * NREG);
    wait_released(&c);
    assert_int_equal(finish(&c), 0);
}

/* The same publication never read: the producer's agent goes with its
 * capture still held (handed back before the CUDA context goes; ASan
 * would see the use after free). */
static void test_ipc_publish_by_stream_unread(void **state) {
    (void)state;
    ctx_t c;
    start(&c, "stream", 30000);
    assert_int_equal(c.syncs_at_publish, 0);
    assert_int_equal(finish(&c), 0);
}

/* One allocation behind both producer regions, opened on each of our two
 * devices. */
static void handles_opened(ctx_t *c) {
    assert_int_equal(cudasim_calls("cudaIpcOpenMemHandle"), 2);
    assert_int_equal(cudasim_ipc_open_count(), c->open0 + 2);
}

static void test_ipc_fetch(void **state) {
    (void)state;
    ipc_fetch("serve", handles_opened);
}

/* A read that comes after the publication expired: refused at its HOLD,
 * before a byte is copied; imports: the VMM fds imported before (the path
 * was CUDA IPC all the same). */
static void after_expiry(const char *mode, unsigned long imports) {
    ctx_t c;
    start(&c, mode, 30000);
    usleep(400000); /* the producer's 150 ms expiry passes */
    fetch(&c);
    kvc_status_t st = pump(&c, NULL, NULL, 0);
    assert_int_equal(st, KVC_ERR_DENIED);
    assert_int_equal(cudasim_calls("cudaMemcpyAsync"), 0);
    assert_int_equal(cudasim_calls("cuMemImportFromShareableHandle"), imports);
    untouched(&c);
    assert_int_equal(finish(&c), 0);
}

static void test_ipc_after_expiry_denied(void **state) {
    (void)state;
    after_expiry("expire", 0);
}

static bool copies_queued(void) {
    return cudasim_calls("cudaMemcpyAsync") > 0;
}

/* The copies are queued (and not run: the stand-in runs them only when
 * polled) when the engine aborts the request; the producer's hold keeps
 * the blocks until its 300 ms xfer timeout breaks it, then hands them back
 * and the engine overwrites them.  The read ends after that: what it
 * copied may be the new bytes, and the UNHOLD is refused: DENIED. */
static void test_ipc_hold_broken_denied(void **state) {
    (void)state;
    ctx_t c;
    start(&c, "short-hold", 30000);
    fetch(&c);
    assert_int_equal(pump(&c, copies_queued, NULL, 0), KVC_INPROGRESS);
    assert_int_equal(write(c.in, "U", 1), 1);
    wait_released(&c); /* the hold broke, the blocks were reused */
    char msg[300];
    kvc_status_t st = pump(&c, NULL, msg, sizeof(msg));
    if (st != KVC_ERR_DENIED) fail_msg("want DENIED, got %s: %s", kvc_status_str(st), msg);
    assert_int_equal(cudasim_pending(), 0); /* FETCH_FAILED after the copies ended */
    assert_int_equal(finish(&c), 0);
}

/* The producer dies while the copies are queued: the fetch fails (no word
 * on the hold can come), the copies drained before the event; maps: the
 * VMM mappings open meanwhile. */
static void killed(const char *mode, int maps) {
    ctx_t c;
    start(&c, mode, 5000);
    fetch(&c);
    assert_int_equal(pump(&c, copies_queued, NULL, 0), KVC_INPROGRESS);
    assert_int_equal(cudasim_vmm_mappings(), maps);
    assert_int_equal(kill(c.pid, SIGKILL), 0);
    char msg[300];
    kvc_status_t st = pump(&c, NULL, msg, sizeof(msg));
    if (st == KVC_OK) fail_msg("a fetch from a killed producer succeeded");
    assert_true(st == KVC_ERR_PEER_FAILED || st == KVC_ERR_TIMED_OUT || st == KVC_ERR_TRANSPORT);
    assert_int_equal(cudasim_pending(), 0);
    assert_int_equal(finish(&c), -1);
}

static void test_ipc_producer_killed(void **state) {
    (void)state;
    killed("serve", 0);
}

/* Paths that must fall back to the staged push, byte-exact; fail_fn: a
 * CUDA call of the consumer that fails once. */
static void fallback(const char *mode, const char *consumer_ipc_env, const char *fail_fn) {
    ctx_t c;
    start(&c, mode, 30000);
    if (consumer_ipc_env) setenv("KVC_IPC", consumer_ipc_env, 1);
    if (consumer_ipc_env) { /* read at agent creation: a new consumer */
        kvc_agent_destroy(c.a);
        kvc_region_params_t rp[NREG] = {cuda_region(c.dev[0], 0), cuda_region(c.dev[1], 1)};
        assert_non_null(c.a = agent("ipc-D", 30000));
        assert_int_equal(kvc_agent_register_regions(c.a, NB, rp, NREG), KVC_OK);
        unsetenv("KVC_IPC");
    }
    if (fail_fn) cudasim_fail(fail_fn, 1, cudaErrorMapBufferObjectFailed);
    fetch(&c);
    char msg[300];
    kvc_status_t st = pump(&c, NULL, msg, sizeof(msg));
    if (st != KVC_OK) fail_msg("fetch failed: %s (%s)", msg, kvc_status_str(st));
    check_bytes(&c);
    assert_int_equal(kstat(&c, KVC_STAT_PEERS_IPC), 0);
    assert_int_equal(kstat(&c, KVC_STAT_PEERS_PUSH), 1);
    assert_int_equal(kstat(&c, KVC_STAT_BYTES_IPC), 0);
    if (fail_fn) assert_int_equal(cudasim_calls(fail_fn), 1);
    if (!fail_fn) assert_int_equal(cudasim_calls("cudaIpcOpenMemHandle"), 0);
    if (!fail_fn) assert_int_equal(cudasim_calls("cuMemImportFromShareableHandle"), 0);
    wait_released(&c);
    assert_int_equal(finish(&c), 0);
}

static void test_ipc_open_fails_fallback(void **state) {
    (void)state;
    fallback("serve", NULL, "cudaIpcOpenMemHandle");
}

static void test_ipc_consumer_disabled(void **state) {
    (void)state;
    fallback("serve", "0", NULL);
}

static void test_ipc_producer_disabled(void **state) {
    (void)state;
    fallback("no-ipc", NULL, NULL);
}

static void test_ipc_other_node(void **state) {
    (void)state;
    fallback("other-host", NULL, NULL);
}

/* ------------------------------------------------------------------ VMM -- */

/* Both producer regions span two of its three physical allocations: one
 * allocation of the table, three pieces, their fds imported once and
 * mapped on each of our two devices. */
static void vmm_mapped(ctx_t *c) {
    (void)c;
    assert_int_equal(cudasim_calls("cudaIpcOpenMemHandle"), 0);
    assert_int_equal(cudasim_calls("cuMemImportFromShareableHandle"), 3);
    assert_int_equal(cudasim_vmm_mappings(), 2 * 3);
    assert_int_equal(cudasim_vmm_allocations(), 3); /* held by the mappings only */
}

static void test_ipc_vmm_fetch(void **state) {
    (void)state;
    setenv("KVC_TEST_FD_BATCH", "2", 1); /* the three fds in two batches */
    ipc_fetch("vmm", vmm_mapped);
    unsetenv("KVC_TEST_FD_BATCH");
}

static void test_ipc_vmm_after_expiry_denied(void **state) {
    (void)state;
    after_expiry("vmm-expire", 3);
}

static void test_ipc_vmm_producer_killed(void **state) {
    (void)state;
    killed("vmm", 2 * 3);
}

/* Allocations created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
 * cannot leave the producer: no IPC table, the staged push. */
static void test_ipc_vmm_no_fd_type(void **state) {
    (void)state;
    fallback("vmm-nofd", NULL, NULL);
}

/* The producer cannot export an fd when asked: it refuses, and closes. */
static void test_ipc_vmm_export_fails(void **state) {
    (void)state;
    fallback("vmm-export-fails", NULL, NULL);
}

/* The fds came but one does not import here: the staged push. */
/* The producer's socket takes the fd request but the fds do not come
 * within the consumer's connect timeout (PEER_IPC): that producer is
 * pushed, byte-exact, nothing mapped; the late answer is not used. */
static void test_ipc_vmm_fds_time_out(void **state) {
    (void)state;
    connect_ms = 1000;
    fallback("vmm-stall", NULL, NULL);
    connect_ms = 0;
}

static void test_ipc_vmm_import_fails(void **state) {
    (void)state;
    fallback("vmm", NULL, "cuMemImportFromShareableHandle");
}

/* The producer's fd socket: a request with a wrong token is refused and
 * the connection closed, without a fd; a consumer does not send its token
 * to a socket that another pid than the table's owns. */
static void test_ipcfd_refusals(void **state) {
    (void)state;
    cudasim_reset(2, false);
    kvc_agent_t *a = agent("fd-P", 30000);
    assert_non_null(a);
    char name[KVC_IPC_SOCK_LEN];
    uint8_t token[KVC_IPC_FD_TOKEN_LEN];
    assert_int_equal(kvc_ipcfd_serve(a, NULL, NULL, 0, name, token), KVC_OK);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    memcpy(sa.sun_path + 1, name, strlen(name));
    socklen_t sl = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + strlen(name));
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sl), 0);
    uint8_t req[44] = "KVF1";
    uint32_t first = 0, count = 1;
    memcpy(req + 4, &first, 4);
    memcpy(req + 8, &count, 4);
    memcpy(req + 12, token, sizeof(token));
    req[12] ^= 1;
    assert_int_equal(send(fd, req, sizeof(req), 0), (ssize_t)sizeof(req));
    uint8_t ans[16];
    ssize_t n = -1;
    for (int i = 0; i < 2000 && n < 0; i++) {
        kvc_agent_progress(a);
        n = recv(fd, ans, sizeof(ans), MSG_DONTWAIT);
        if (n < 0) usleep(1000);
    }
    assert_int_equal(n, 16);
    int32_t status;
    memcpy(&status, ans + 4, 4);
    assert_int_equal(status, KVC_ERR_AUTH);
    for (int i = 0; i < 100; i++)
        kvc_agent_progress(a);
    assert_int_equal(recv(fd, ans, sizeof(ans), MSG_DONTWAIT), 0); /* closed */
    close(fd);
    /* The table names another pid than the socket's owner (this one). */
    kvc_ipc_table_t t = {.pid = (uint32_t)getpid() + 1,
                         .n_pieces = 1,
                         .sock = {(const uint8_t *)name, strlen(name)},
                         .token = {token, sizeof(token)}};
    kvc_pollent_t pe = {PE_IPCFD_FETCH, NULL};
    kvc_ipcfd_cli_t *cli = NULL;
    char err[256];
    assert_int_equal(kvc_ipcfd_fetch(a, &t, &pe, &cli, err, sizeof(err)), KVC_ERR_AUTH);
    assert_non_null(strstr(err, "belongs to pid"));
    kvc_agent_destroy(a);
}

/* ------------------------------------------------------------ the table -- */

static void test_ipc_table_parse(void **state) {
    (void)state;
    /* A legacy handle, a VMM allocation of three pieces, a legacy one. */
    kvc_cuda_export_t al[3];
    memset(al, 0, sizeof(al));
    snprintf(al[0].bus, sizeof(al[0].bus), "0000:10:00.0");
    snprintf(al[1].bus, sizeof(al[1].bus), "0000:11:00.0");
    snprintf(al[2].bus, sizeof(al[2].bus), "0000:11:00.0");
    al[0].size = 1000;
    al[1] = (kvc_cuda_export_t){.size = 700, .kind = KVC_IPC_KIND_VMM, .n_pieces = 3};
    snprintf(al[1].bus, sizeof(al[1].bus), "0000:10:00.0");
    al[2].size = 500;
    memset(al[0].handle, 7, KVC_IPC_HANDLE_LEN);
    uint64_t pieces[3] = {100, 200, 400};
    uint8_t token[KVC_IPC_FD_TOKEN_LEN];
    memset(token, 9, sizeof(token));
    uint32_t ra[4] = {0, 2, 0, 1};
    uint64_t off[4] = {0, 100, 600, 50}, rlen[4] = {600, 400, 400, 650};
    kvc_ipc_tab_in_t in = {.host = "boot/ipc/pid",
                           .pid = 42,
                           .allocs = al,
                           .n_allocs = 3,
                           .piece_size = pieces,
                           .n_pieces = 3,
                           .sock = "kvc-vmm-0123",
                           .token = token,
                           .reg_alloc = ra,
                           .reg_off = off,
                           .n_regions = 4};
    kvc_buf_t b = {0};
    kvc_wire_encode_ipc(&b, &in);
    assert_false(b.failed);
    kvc_ipc_table_t t;
    assert_int_equal(kvc_wire_parse_ipc(b.p, b.len, rlen, 4, &t), KVC_OK);
    assert_int_equal(t.pid, 42);
    assert_int_equal(t.n_allocs, 3);
    assert_int_equal(t.reg_alloc[1], 2);
    assert_int_equal(t.reg_off[2], 600);
    assert_memory_equal(t.allocs[0].handle.p, al[0].handle, KVC_IPC_HANDLE_LEN);
    assert_int_equal(t.allocs[1].kind, KVC_IPC_KIND_VMM);
    assert_int_equal(t.allocs[1].first_piece, 0);
    assert_int_equal(t.allocs[1].n_pieces, 3);
    assert_int_equal(t.n_pieces, 3);
    assert_int_equal(t.piece_size[2], 400);
    assert_int_equal(t.sock.len, strlen("kvc-vmm-0123"));
    assert_memory_equal(t.token.p, token, KVC_IPC_FD_TOKEN_LEN);
    kvc_wire_ipc_cleanup(&t);
    /* Every truncation, a trailing byte, a region past its allocation,
     * another region count: refused. */
    for (size_t n = 0; n < b.len; n++)
        assert_int_equal(kvc_wire_parse_ipc(b.p, n, rlen, 4, &t), KVC_ERR_PROTOCOL);
    kvc_buf_u8(&b, 0);
    assert_int_equal(kvc_wire_parse_ipc(b.p, b.len, rlen, 4, &t), KVC_ERR_PROTOCOL);
    b.len--;
    uint64_t big[4] = {600, 401, 400, 650}, bigv[4] = {600, 400, 400, 651};
    assert_int_equal(kvc_wire_parse_ipc(b.p, b.len, big, 4, &t), KVC_ERR_PROTOCOL);
    assert_int_equal(kvc_wire_parse_ipc(b.p, b.len, bigv, 4, &t), KVC_ERR_PROTOCOL);
    assert_int_equal(kvc_wire_parse_ipc(b.p, b.len, rlen, 3, &t), KVC_ERR_PROTOCOL);
    kvc_buf_cleanup(&b);
    /* Pieces that do not sum to their allocation, a piece of 0 bytes, a
     * token of another length: refused. */
    uint64_t short_pieces[3] = {100, 200, 399}, zero[3] = {0, 300, 400};
    const uint64_t *bad[] = {short_pieces, zero};
    for (int i = 0; i < 2; i++) {
        in.piece_size = bad[i];
        kvc_wire_encode_ipc(&b, &in);
        assert_int_equal(kvc_wire_parse_ipc(b.p, b.len, rlen, 4, &t), KVC_ERR_PROTOCOL);
        kvc_buf_cleanup(&b);
    }
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--producer")) return producer_main(argv[2]);
    self_exe = "/proc/self/exe";
    static char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = 0;
        self_exe = exe;
    }
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ipc_table_parse),
        cmocka_unit_test(test_ipc_fetch),
        cmocka_unit_test(test_ipc_fetches_reuse_events),
        cmocka_unit_test(test_ipc_publish_by_stream),
        cmocka_unit_test(test_ipc_publish_by_stream_unread),
        cmocka_unit_test(test_ipc_after_expiry_denied),
        cmocka_unit_test(test_ipc_hold_broken_denied),
        cmocka_unit_test(test_ipc_producer_killed),
        cmocka_unit_test(test_ipc_open_fails_fallback),
        cmocka_unit_test(test_ipc_consumer_disabled),
        cmocka_unit_test(test_ipc_producer_disabled),
        cmocka_unit_test(test_ipc_other_node),
        cmocka_unit_test(test_ipc_vmm_fetch),
        cmocka_unit_test(test_ipc_vmm_after_expiry_denied),
        cmocka_unit_test(test_ipc_vmm_producer_killed),
        cmocka_unit_test(test_ipc_vmm_no_fd_type),
        cmocka_unit_test(test_ipc_vmm_export_fails),
        cmocka_unit_test(test_ipc_vmm_import_fails),
        cmocka_unit_test(test_ipc_vmm_fds_time_out),
        cmocka_unit_test(test_ipcfd_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
