/* SPDX-License-Identifier: Apache-2.0 */
/* The prefix index: which prompt prefixes a decode instance has served
 * recently, so the proxy can tell how much of a new prompt that instance
 * probably holds in its prefix cache (disagg.h), and which member each
 * prompt's block chain went to (route.h's prefix_affinity). A prompt's bytes are cut into
 * PX_PINDEX_BLOCK_BYTES pieces and each piece gets a chained hash (px_hash64 of the piece, mixed
 * with the hash of everything before it), so a hash stands for a whole prefix. The index keeps
 * (backend, prefix hash) entries up to a fixed capacity and evicts the least recently used. It is
 * approximate: an engine may have evicted what the index still lists, and the index forgets what
 * other proxies' workers sent. One index per worker thread: no locks. */
#ifndef PX_PINDEX_H
#define PX_PINDEX_H

#include <stddef.h>
#include <stdint.h>

#define PX_PINDEX_BLOCK_BYTES 128
/* Most blocks of one prompt that are hashed (512 KiB); the rest counts as
 * uncached. */
#define PX_PINDEX_MAX_BLOCKS 4096

typedef struct px_pindex px_pindex;

/* An index of at most `capacity` entries (>= 1). Never NULL. */
px_pindex *px_pindex_create(size_t capacity);
/* NULL is a no-op. */
void px_pindex_destroy(px_pindex *x);
/* Writes the chained hashes of the whole blocks of p[0..n) to out (at most
 * max) and returns how many. A trailing partial block is not hashed. */
size_t px_pindex_hashes(const void *p, size_t n, uint64_t *out, size_t max);
/* How many of hashes[0..n), from the first, backend `backend_key` (its
 * key_hash) is listed with; the entries found become the most recent. */
size_t px_pindex_match(px_pindex *x, uint64_t backend_key, const uint64_t *hashes, size_t n);
/* Lists hashes[0..n) for the backend (most recent), evicting the least
 * recently used entries beyond the capacity. */
void px_pindex_add(px_pindex *x, uint64_t backend_key, const uint64_t *hashes, size_t n);

#endif
