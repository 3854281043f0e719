/* SPDX-License-Identifier: Apache-2.0 */
#include "base/hash.h"

uint64_t px_hash64_seed(const void *p, size_t n, uint64_t seed) {
    return px_hash64_more(0xcbf29ce484222325ull ^ seed, p, n);
}

uint64_t px_hash64_more(uint64_t h, const void *p, size_t n) {
    const unsigned char *s = p;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}
