/* SPDX-License-Identifier: Apache-2.0 */
/* Counts heap allocations of a process: an LD_PRELOAD library for the
 * benchmark (bench/proxy_bench.sh ALLOCS=1). Each malloc, calloc and realloc
 * is counted; the totals are written to the file named by ALLOC_COUNT_OUT
 * when the process receives SIGUSR2 (so the counts can be read before and
 * after a fixed number of requests) and at exit.
 * With ALLOC_COUNT_CALLERS set, the file also gets one line per calling
 * site: "@ <object> <offset in it, hex> <count>", to be resolved with
 * addr2line -f -e <object> <offset> (e.g. which connector function
 * allocates per chunk: bench/kvc_allocs.sh).
 *
 *   cc -O2 -shared -fPIC -o alloc_count.so bench/alloc_count.c */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

static atomic_ulong n_malloc, n_calloc, n_realloc;

/* Calling sites (ALLOC_COUNT_CALLERS): open addressing, never removed; a
 * site that finds the table full is not counted by site. */
#define SITES 8192
static _Atomic(void *) site_pc[SITES];
static atomic_ulong site_n[SITES];
static int by_site = -1;

static void count_site(void *pc) {
    if (by_site < 0) by_site = getenv("ALLOC_COUNT_CALLERS") != NULL;
    if (!by_site) return;
    size_t h = ((size_t)pc >> 4) * 2654435761u % SITES;
    for (size_t i = 0; i < 64; i++, h = (h + 1) % SITES) {
        void *cur = atomic_load_explicit(&site_pc[h], memory_order_acquire);
        if (!cur && atomic_compare_exchange_strong(&site_pc[h], &cur, pc)) cur = pc;
        if (cur == pc) {
            atomic_fetch_add_explicit(&site_n[h], 1, memory_order_relaxed);
            return;
        }
    }
}

void *malloc(size_t n) {
    atomic_fetch_add_explicit(&n_malloc, 1, memory_order_relaxed);
    count_site(__builtin_return_address(0));
    return __libc_malloc(n);
}

void *calloc(size_t a, size_t b) {
    atomic_fetch_add_explicit(&n_calloc, 1, memory_order_relaxed);
    count_site(__builtin_return_address(0));
    return __libc_calloc(a, b);
}

void *realloc(void *p, size_t n) {
    atomic_fetch_add_explicit(&n_realloc, 1, memory_order_relaxed);
    count_site(__builtin_return_address(0));
    return __libc_realloc(p, n);
}

static void dump(void) {
    const char *path = getenv("ALLOC_COUNT_OUT");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (!f) return;
    fprintf(f, "%lu %lu %lu\n", atomic_load(&n_malloc), atomic_load(&n_calloc),
            atomic_load(&n_realloc));
    for (size_t i = 0; by_site > 0 && i < SITES; i++) {
        void *pc = atomic_load(&site_pc[i]);
        Dl_info di;
        if (pc && dladdr(pc, &di) && di.dli_fname)
            fprintf(f, "@ %s %lx %lu\n", di.dli_fname,
                    (unsigned long)((char *)pc - (char *)di.dli_fbase) - 1, atomic_load(&site_n[i]));
    }
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
