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

/* Plain FNV-1a: seed 0. */
static inline uint64_t px_hash64(const void *p, size_t n) {
    return px_hash64_seed(p, n, 0);
}

#endif
