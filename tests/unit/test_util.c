/* SPDX-License-Identifier: Apache-2.0 */
/* cmocka.h needs these first. */
// clang-format off
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
// clang-format on
#include <event2/buffer.h>
#include <fcntl.h>
#include <inttypes.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/util.h"

#if defined(__SANITIZE_ADDRESS__)
#define TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TEST_ASAN 1
#endif
#endif

/* px_xcalloc takes small blocks from malloc (its per-thread cache hands back
 * the block just freed, dirty) and zeroes them itself: each size, either
 * side of the small/large line, comes back all zeros after a block of that
 * size was filled and freed. */
static void test_xcalloc_zeroes_reused_blocks(void **state)
{
    (void)state;
    static const size_t sizes[] = {1, 7, 16, 128, 776, 1000, 1008, 1009, 1024, 5632, 70000};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        size_t n = sizes[i];
        for (int form = 0; form < 2; form++) {
            unsigned char *dirty = px_xmalloc(n);
            memset(dirty, 0xa5, n);
            free(dirty);
            unsigned char *p = form ? px_xcalloc(n, 1) : px_xcalloc(1, n);
            for (size_t j = 0; j < n; j++)
                if (p[j]) fail_msg("size %zu (%s): byte %zu is 0x%02x", n, form ? "n x 1" : "1 x n", j,
                                   p[j]);
            free(p);
        }
    }
    /* An element count times a size is zeroed whole, not just one element. */
    uint32_t *q = px_xcalloc(100, sizeof *q);
    for (int j = 0; j < 100; j++)
        assert_int_equal(q[j], 0);
    free(q);
    /* Zero of anything is still a block the caller may free. */
    free(px_xcalloc(0, 8));
    free(px_xcalloc(8, 0));
}

/* A count times a size past SIZE_MAX aborts (the process's one answer to
 * exhaustion), rather than wrapping to a small block the caller overruns. */
static void *xcalloc_overflow(void)
{
    return px_xcalloc(SIZE_MAX / 2, 3);
}

/* alloc, run in a child with stderr silenced, ends it with SIGABRT. */
static void assert_aborts(void *(*alloc)(void))
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open("/dev/null", O_WRONLY);
        if (fd >= 0) dup2(fd, 2);
        void *p = alloc();
        _exit(p ? 0 : 1);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFSIGNALED(st));
    assert_int_equal(WTERMSIG(st), SIGABRT);
}

static void test_xcalloc_overflow_aborts(void **state)
{
    (void)state;
    assert_aborts(xcalloc_overflow);
}

/* Spares: a block put back is the next one taken, zeroed again; no more than
 * PX_SPARES are kept (the rest are freed at once); drain frees the kept. */
static void test_spares_reuse_zeroed_and_bounded(void **state)
{
    (void)state;
    px_spares s = {0};
    enum { SIZE = 5632 };
    unsigned char *a = px_spare_take(&s, SIZE);
    for (size_t j = 0; j < SIZE; j++)
        assert_int_equal(a[j], 0);
    memset(a, 0x5a, SIZE);
    px_spare_put(&s, a);
#ifdef TEST_ASAN
    /* Under ASan every block is freed (its quarantine catches late uses). */
    assert_int_equal(s.n, 0);
    return;
#endif
    assert_int_equal(s.n, 1);
    unsigned char *b = px_spare_take(&s, SIZE);
    assert_ptr_equal(a, b);
    assert_int_equal(s.n, 0);
    for (size_t j = 0; j < SIZE; j++)
        if (b[j]) fail_msg("a spare came back with byte %zu = 0x%02x", j, b[j]);
    px_spare_put(&s, b);
    px_spare_put(&s, NULL);
    assert_int_equal(s.n, 1);
    void *many[PX_SPARES + 3];
    for (int i = 0; i < PX_SPARES + 3; i++)
        many[i] = px_spare_take(&s, SIZE);
    assert_int_equal(s.n, 0);
    for (int i = 0; i < PX_SPARES + 3; i++)
        px_spare_put(&s, many[i]);
    assert_int_equal(s.n, PX_SPARES);
    px_spare_drain(&s);
    assert_int_equal(s.n, 0);
    px_spare_drain(&s);
}

/* The classes, written out: a block of u usable bytes is kept in the
 * largest class of at most u bytes (none below 128 or from 1,536), and a
 * request of n bytes (65 to 1,024) is served from the smallest class of
 * at least n. */
static const size_t mem_classes[] = {128, 192, 256, 384, 512, 768, 1024};
enum { NCLASSES = sizeof mem_classes / sizeof *mem_classes };

static size_t class_serving(size_t n)
{
    for (int k = 0; k < NCLASSES; k++)
        if (n <= mem_classes[k]) return mem_classes[k];
    return 0;
}

/* Every request size gets a block of at least its class; a block put back
 * is the next one taken for the smallest and the largest size its class
 * serves; zalloc zeroes a dirty one; sizes off the classes are malloc's. */
static void test_mem_classes_reuse(void **state)
{
    (void)state;
    px_mem_drain();
    for (size_t n = 1; n <= PX_MEM_MAX + 8; n++) {
        unsigned char *p = px_mem_take(n);
        memset(p, 0xa5, n); /* ASan: the block holds n bytes */
        px_mem_put(p);
#ifdef TEST_ASAN
        assert_int_equal(px_mem_kept(), 0); /* freed: the quarantine catches late uses */
        continue;
#endif
        if (n <= PX_MEM_MIN || n > PX_MEM_MAX) {
            /* malloc's own block: kept only if it happens to fit a class. */
            px_mem_drain();
            continue;
        }
        size_t cls = class_serving(n);
        if (malloc_usable_size(p) < cls)
            fail_msg("size %zu: %zu usable bytes, under its class %zu", n, malloc_usable_size(p), cls);
        assert_int_equal(px_mem_kept(), 1);
        size_t lo = cls == 128 ? PX_MEM_MIN + 1 : mem_classes[0];
        for (int k = 1; k < NCLASSES; k++)
            if (mem_classes[k] == cls) lo = mem_classes[k - 1] + 1;
        size_t other = (n % 2) ? cls : lo;
        unsigned char *q = px_mem_zalloc(other);
        assert_ptr_equal(p, q);
        for (size_t j = 0; j < other; j++)
            if (q[j]) fail_msg("size %zu: a kept block came back with byte %zu = 0x%02x", n, j, q[j]);
        assert_int_equal(px_mem_kept(), 0);
        px_mem_put(q);
        px_mem_drain();
    }
    px_mem_put(NULL);
    assert_int_equal(px_mem_kept(), 0);
    free(px_mem_take(0)); /* a block the caller may free */
    free(px_mem_zalloc(5000)); /* past the classes: plain malloc */
}

/* What is kept of malloc's own blocks, by their usable size: none under
 * the smallest class or from 1.5 KiB, else in the largest class they can
 * serve, which then hands them out (and a larger class does not). */
static void test_mem_keeps_malloc_blocks_by_size(void **state)
{
    (void)state;
    px_mem_drain();
    for (size_t n = 1; n <= 1700; n++) {
        void *p = malloc(n);
        size_t u = malloc_usable_size(p);
        px_mem_put(p);
#ifdef TEST_ASAN
        assert_int_equal(px_mem_kept(), 0);
        continue;
#endif
        if (u < 128 || u >= 1536) {
            if (px_mem_kept()) fail_msg("malloc(%zu), %zu usable: kept", n, u);
            continue;
        }
        if (px_mem_kept() != 1) fail_msg("malloc(%zu), %zu usable: not kept", n, u);
        int k = NCLASSES - 1;
        while (mem_classes[k] > u)
            k--;
        if (k + 1 < NCLASSES) {
            void *big = px_mem_take(mem_classes[k + 1]);
            if (big == p) fail_msg("malloc(%zu), %zu usable: served %zu bytes", n, u, mem_classes[k + 1]);
            free(big);
        }
        if (px_mem_take(mem_classes[k]) != p)
            fail_msg("malloc(%zu), %zu usable: not served from class %zu", n, u, mem_classes[k]);
        free(p);
    }
    assert_int_equal(px_mem_kept(), 0);
}

/* At most PX_MEM_KEEP blocks of a class; the other classes have room of
 * their own; drain frees them all. A px_buf's first room is a kept block. */
static void test_mem_bounded(void **state)
{
    (void)state;
    px_mem_drain();
    enum { N = PX_MEM_KEEP + 5 };
    void *v[N];
    for (int i = 0; i < N; i++)
        v[i] = px_mem_take(1024);
    for (int i = 0; i < N; i++)
        px_mem_put(v[i]);
#ifdef TEST_ASAN
    assert_int_equal(px_mem_kept(), 0);
    return;
#endif
    assert_int_equal(px_mem_kept(), PX_MEM_KEEP);
    px_mem_put(px_mem_take(256));
    assert_int_equal(px_mem_kept(), PX_MEM_KEEP + 1);
    px_mem_drain();
    assert_int_equal(px_mem_kept(), 0);
    void *room = px_mem_take(256);
    px_mem_put(room);
    px_buf b;
    px_buf_init(&b);
    px_buf_append(&b, "x", 1);
    assert_ptr_equal(b.data, room);
    px_buf_cleanup(&b);
    assert_int_equal(px_mem_kept(), 1);
    px_mem_drain();
}

static void *put_and_exit(void *arg)
{
    void **v = arg;
    for (int i = 0; i < PX_MEM_KEEP; i++)
        px_mem_put(v[i]);
    return (void *)px_mem_kept();
}

/* A thread's kept blocks are freed when it exits: blocks allocated here,
 * put by a thread that then exits, are back in malloc's free space
 * (mallinfo2 counts the blocks in use). */
static void test_mem_freed_at_thread_exit(void **state)
{
    (void)state;
    void *v[PX_MEM_KEEP];
    for (int i = 0; i < PX_MEM_KEEP; i++)
        v[i] = malloc(1024);
    size_t before = mallinfo2().uordblks;
    pthread_t t;
    void *kept = NULL;
    assert_int_equal(pthread_create(&t, NULL, put_and_exit, v), 0);
    assert_int_equal(pthread_join(t, &kept), 0);
#ifdef TEST_ASAN
    assert_int_equal((size_t)kept, 0);
    return;
#endif
    assert_int_equal((size_t)kept, PX_MEM_KEEP);
    size_t after = mallinfo2().uordblks;
    if (!before) skip(); /* an allocator that keeps no such count */
    /* Half of them at least: the thread's own start and end move the count
     * too (kept, none of them would be back). */
    if (after + (size_t)PX_MEM_KEEP * 512 > before)
        fail_msg("blocks in use %zu before the thread, %zu after it exited: its kept blocks leaked",
                 before, after);
}

static pthread_key_t late_key;
static size_t late_kept = 99;

static void late_put(void *arg)
{
    px_mem_put(arg);
    late_kept = px_mem_kept();
}

static void *put_then_late_put(void *arg)
{
    px_mem_put(px_mem_take(512));
    /* A key made after the cache's first put: its destructor runs after
     * the cache's own. */
    pthread_setspecific(late_key, arg);
    return NULL;
}

/* A block put by a destructor that runs after the cache's own is freed, not
 * kept where nothing would free it. */
static void test_mem_put_after_thread_drain(void **state)
{
    (void)state;
    assert_int_equal(pthread_key_create(&late_key, late_put), 0);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, put_then_late_put, malloc(512)), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(late_kept, 0);
    pthread_key_delete(late_key);
}

static void *mem_take_too_much(void)
{
    return px_mem_take(SIZE_MAX / 2);
}

static void *mem_zalloc_too_much(void)
{
    return px_mem_zalloc(SIZE_MAX / 2);
}

/* Exhaustion aborts, as px_xmalloc does, rather than handing back NULL
 * (only libevent's hook returns NULL, libevent's contract). */
static void test_mem_exhaustion_aborts(void **state)
{
    (void)state;
#ifdef TEST_ASAN
    skip(); /* ASan reports the allocation itself and exits its own way */
#endif
    assert_aborts(mem_take_too_much);
    assert_aborts(mem_zalloc_too_much);
}

/* libevent's buffers allocate through the cache once px_mem_for_libevent
 * ran: a chain freed by a drain is kept, and the next chain reuses it. */
static void test_mem_libevent_chains(void **state)
{
    (void)state;
    px_mem_for_libevent();
    px_mem_drain();
    struct evbuffer *b = evbuffer_new();
    assert_non_null(b);
    assert_int_equal(evbuffer_add(b, "hello", 5), 0);
    assert_int_equal(px_mem_kept(), 0);
    assert_int_equal(evbuffer_drain(b, 5), 0);
#ifdef TEST_ASAN
    assert_int_equal(px_mem_kept(), 0);
#else
    assert_true(px_mem_kept() > 0);
    size_t kept = px_mem_kept();
    kept = px_mem_kept();
    assert_int_equal(evbuffer_add(b, "again", 5), 0);
    assert_true(px_mem_kept() < kept);
#endif
    evbuffer_free(b);
    px_mem_drain();
}

/* px_hex64 writes what printf's "%016" PRIx64 writes, 16 bytes and not one
 * more: every nibble value at every position, the edges, and a stream of
 * pseudo-random values. */
static void test_hex64_as_printf(void **state)
{
    (void)state;
    char got[20], want[20];
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < 20000; i++) {
        uint64_t v;
        if (i < 16 * 16)
            v = (uint64_t)(i % 16) << (4 * (i / 16)); /* nibble i%16 at position i/16 */
        else if (i < 16 * 16 + 4)
            v = (uint64_t[]){0, UINT64_MAX, 1, 0x8000000000000000ull}[i - 16 * 16];
        else
            v = (x ^= x << 13, x ^= x >> 7, x ^= x << 17);
        memset(got, '#', sizeof got);
        px_hex64(got, v);
        snprintf(want, sizeof want, "%016" PRIx64, v);
        if (memcmp(got, want, 16)) fail_msg("%016" PRIx64 ": got %.16s", v, got);
        for (size_t j = 16; j < sizeof got; j++)
            assert_int_equal(got[j], '#');
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xcalloc_zeroes_reused_blocks),
        cmocka_unit_test(test_xcalloc_overflow_aborts),
        cmocka_unit_test(test_spares_reuse_zeroed_and_bounded),
        cmocka_unit_test(test_hex64_as_printf),
        cmocka_unit_test(test_mem_classes_reuse),
        cmocka_unit_test(test_mem_keeps_malloc_blocks_by_size),
        cmocka_unit_test(test_mem_bounded),
        cmocka_unit_test(test_mem_put_after_thread_drain),
        cmocka_unit_test(test_mem_exhaustion_aborts),
        cmocka_unit_test(test_mem_freed_at_thread_exit),
        cmocka_unit_test(test_mem_libevent_chains),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
