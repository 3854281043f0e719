/* The one 64-bit hash proxy/ and sim/ share. */
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

/* Plain FNV-1a: seed 0. */
static inline uint64_t px_hash64(const void *p, size_t n) {
    return px_hash64_seed(p, n, 0);
}

#endif
