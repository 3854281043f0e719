/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers shared by the proxy and engine-sim fuzz targets. Inputs are
 * copied into exact-size heap buffers so that any read past the end trips
 * AddressSanitizer, and a broken invariant aborts with its text so that
 * libFuzzer saves the input that broke it. */
#ifndef PX_FUZZ_COMMON_H
#define PX_FUZZ_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FZ_CHECK(cond)                                                                             \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: invariant broken: %s\n", __FILE__, __LINE__, #cond);           \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* An exact-size heap copy of d[0..n) (never NULL; n may be 0). */
static inline char *fz_dup(const void *d, size_t n) {
    char *p = malloc(n ? n : 1);
    if (!p) abort();
    if (n) memcpy(p, d, n);
    return p;
}

/* Whether [p, p+len) lies inside [base, base+n). */
static inline int fz_inside(const char *p, size_t len, const char *base, size_t n) {
    return p >= base && p <= base + n && len <= (size_t)(base + n - p);
}

/* A small deterministic generator, seeded from the input, for the split
 * points of incremental feeds: the same input always replays the same way. */
static inline uint64_t fz_seed(const uint8_t *d, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ d[i]) * 0x100000001b3ull;
    return h | 1;
}

static inline uint64_t fz_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

#endif
