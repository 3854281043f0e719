/* SPDX-License-Identifier: Apache-2.0 */
/* The one 64-bit hash, and the one bit mixer, proxy/ and sim/ share. */
#ifndef PX_HASH_H
#define PX_HASH_H

#include <stddef.h>
#include <stdint.h>

/* FNV-1a over bytes, 64 bit, with the offset basis XORed with `seed`.
 * Stable across processes, builds and replicas: routing keys and
 * engine-sim's KV contents depend on it.  Not for untrusted keys in a hash
 * table (no flooding resistance). */
uint64_t px_hash64_seed(const void *p, size_t n, uint64_t seed);

/* Continues a hash over more bytes: px_hash64_more(px_hash64_seed(a, n,
 * seed), b, m) equals the hash of a's n bytes followed by b's m, so the
 * hashes of a growing prefix cost one pass in all. */
uint64_t px_hash64_more(uint64_t h, const void *p, size_t n);

/* Spreads a 64-bit value over all bits (MurmurHash3's finalizer): FNV-1a's
 * high bits are weak, and ring positions and simulated contents need all
 * 64. Stable across builds, like the hash. */
static inline uint64_t px_mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

/* Plain FNV-1a: seed 0. */
static inline uint64_t px_hash64(const void *p, size_t n) {
    return px_hash64_seed(p, n, 0);
}

#endif
