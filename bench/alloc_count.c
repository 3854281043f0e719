/* SPDX-License-Identifier: Apache-2.0 */
/* Counts heap allocations of a process: an LD_PRELOAD library for the
 * benchmark (bench/proxy_bench.sh ALLOCS=1). Each malloc, calloc and realloc
 * is counted; the totals are written to the file named by ALLOC_COUNT_OUT
 * when the process receives SIGUSR2 (so the counts can be read before and
 * after a fixed number of requests) and at exit.
 *
 *   cc -O2 -shared -fPIC -o alloc_count.so bench/alloc_count.c */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

static atomic_ulong n_malloc, n_calloc, n_realloc;

void *malloc(size_t n) {
    atomic_fetch_add_explicit(&n_malloc, 1, memory_order_relaxed);
    return __libc_malloc(n);
}

void *calloc(size_t a, size_t b) {
    atomic_fetch_add_explicit(&n_calloc, 1, memory_order_relaxed);
    return __libc_calloc(a, b);
}

void *realloc(void *p, size_t n) {
    atomic_fetch_add_explicit(&n_realloc, 1, memory_order_relaxed);
    return __libc_realloc(p, n);
}

static void dump(void) {
    const char *path = getenv("ALLOC_COUNT_OUT");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (!f) return;
    fprintf(f, "%lu %lu %lu\n", atomic_load(&n_malloc), atomic_load(&n_calloc),
            atomic_load(&n_realloc));
    fclose(f);
}

static void on_usr2(int sig) {
    (void)sig;
    dump(); /* stdio in a handler: acceptable for a benchmark aid */
}

__attribute__((constructor)) static void init(void) {
    signal(SIGUSR2, on_usr2);
    atexit(dump);
}
