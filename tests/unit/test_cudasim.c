/* SPDX-License-Identifier: Apache-2.0 */
/* Unit test of the CUDA stand-in itself (tests/cudasim) in threaded mode,
 * where it must copy like a GPU: queued copies run on a copy engine while
 * the caller does something else, a slow host function holds back its own
 * stream only, events complete when the copies before them are done,
 * synchronisations block until then, cross-stream waits hold, and
 * CUDASIM_GBPS bounds the copy rate.  Each case observes the memory itself,
 * without a CUDA call that could run the work on the caller's thread. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/cudasim/cudasim.h"

#define LEN ((size_t)1 << 20)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void nap_ms(int ms) {
    struct timespec ts = {0, ms * 1000000L};
    nanosleep(&ts, NULL);
}

/* A host function that blocks its stream until the gate opens (bounded). */
static atomic_int gate;
static void gate_fn(void *arg) {
    (void)arg;
    for (double end = now_s() + 20; !atomic_load(&gate) && now_s() < end;)
        nap_ms(1);
}

/* True once every byte of p is v, polled without any CUDA call (bounded). */
static bool lands(const volatile uint8_t *p, size_t n, uint8_t v, double secs) {
    double end = now_s() + secs;
    for (;;) {
        size_t i = 0;
        while (i < n && p[i] == v)
            i++;
        if (i == n) return true;
        if (now_s() >= end) return false;
        nap_ms(1);
    }
}

/* Frees what a case made (sb may be NULL) and goes back to lazy mode. */
static void teardown(cudaEvent_t ev, cudaStream_t sa, cudaStream_t sb, void *dev, void *host) {
    assert_int_equal(cudaEventDestroy(ev), cudaSuccess);
    assert_int_equal(cudaStreamDestroy(sa), cudaSuccess);
    if (sb) assert_int_equal(cudaStreamDestroy(sb), cudaSuccess);
    assert_int_equal(cudaFree(dev), cudaSuccess);
    free(host);
    cudasim_reset(2, false);
}

/* A copy on stream B completes, and its event with it, while a host
 * function blocks stream A and the caller makes no CUDA call.  The old
 * background worker ran host functions under its lock (B stalled behind
 * A); lazy mode runs nothing without a sync. */
static void test_copies_run_beside_the_caller(void **state) {
    (void)state;
    cudasim_reset(1, true);
    uint8_t *dev, *host = malloc(LEN);
    assert_non_null(host);
    memset(host, 0x3C, LEN);
    assert_int_equal(cudaMalloc((void **)&dev, LEN), cudaSuccess);
    cudaStream_t sa, sb;
    cudaEvent_t ev;
    /* B first: whatever order streams are visited in, A's comes up first. */
    assert_int_equal(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
    atomic_store(&gate, 0);
    assert_int_equal(cudaLaunchHostFunc(sa, gate_fn, NULL), cudaSuccess);
    assert_int_equal(cudaMemcpyAsync(dev, host, LEN, cudaMemcpyHostToDevice, sb), cudaSuccess);
    assert_int_equal(cudaEventRecord(ev, sb), cudaSuccess);
    assert_true(lands(dev, LEN, 0x3C, 5));
    for (double end = now_s() + 5; cudaEventQuery(ev) == cudaErrorNotReady && now_s() < end;)
        nap_ms(1);
    assert_int_equal(cudaEventQuery(ev), cudaSuccess);
    atomic_store(&gate, 1);
    assert_int_equal(cudaStreamSynchronize(sa), cudaSuccess);
    assert_int_equal(cudasim_pending(), 0);
    teardown(ev, sa, sb, dev, host);
}

/* Stream order across streams: B waits for an event recorded on A behind a
 * blocked host function, so B's copy must not run before the gate opens. */
static void test_cross_stream_wait_holds(void **state) {
    (void)state;
    cudasim_reset(1, true);
    uint8_t *dev, *host = malloc(LEN);
    assert_non_null(host);
    memset(host, 0x77, LEN);
    assert_int_equal(cudaMalloc((void **)&dev, LEN), cudaSuccess);
    assert_int_equal(cudaMemset(dev, 0, LEN), cudaSuccess);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    cudaStream_t sa, sb;
    cudaEvent_t ev;
    assert_int_equal(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
    atomic_store(&gate, 0);
    assert_int_equal(cudaLaunchHostFunc(sa, gate_fn, NULL), cudaSuccess);
    assert_int_equal(cudaEventRecord(ev, sa), cudaSuccess);
    assert_int_equal(cudaStreamWaitEvent(sb, ev, 0), cudaSuccess);
    assert_int_equal(cudaMemcpyAsync(dev, host, LEN, cudaMemcpyHostToDevice, sb), cudaSuccess);
    assert_false(lands(dev, 1, 0x77, 0.05)); /* held back behind A */
    assert_int_equal(cudaEventQuery(ev), cudaErrorNotReady);
    atomic_store(&gate, 1);
    assert_int_equal(cudaStreamSynchronize(sb), cudaSuccess);
    assert_true(lands(dev, LEN, 0x77, 0));
    assert_int_equal(cudaEventQuery(ev), cudaSuccess);
    teardown(ev, sa, sb, dev, host);
}

/* CUDASIM_GBPS: 16 MiB at 0.05 GB/s take at least 0.33 s; the event is not
 * complete right after the copy is queued, and cudaEventSynchronize returns
 * only once the bytes are there. */
static void test_bandwidth_cap_and_event_sync(void **state) {
    (void)state;
    size_t n = (size_t)16 << 20;
    setenv("CUDASIM_GBPS", "0.05", 1);
    cudasim_reset(1, true);
    unsetenv("CUDASIM_GBPS");
    uint8_t *dev, *host = malloc(n);
    assert_non_null(host);
    memset(host, 0x42, n);
    assert_int_equal(cudaMalloc((void **)&dev, n), cudaSuccess);
    cudaStream_t s;
    cudaEvent_t ev;
    assert_int_equal(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
    double t0 = now_s();
    assert_int_equal(cudaMemcpyAsync(dev, host, n, cudaMemcpyHostToDevice, s), cudaSuccess);
    assert_int_equal(cudaEventRecord(ev, s), cudaSuccess);
    assert_int_equal(cudaEventQuery(ev), cudaErrorNotReady);
    assert_int_equal(cudaEventSynchronize(ev), cudaSuccess);
    double secs = now_s() - t0;
    assert_true(lands(dev, n, 0x42, 0));
    assert_true(secs >= 0.3);
    teardown(ev, s, NULL, dev, host);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_copies_run_beside_the_caller),
        cmocka_unit_test(test_cross_stream_wait_holds),
        cmocka_unit_test(test_bandwidth_cap_and_event_sync),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
