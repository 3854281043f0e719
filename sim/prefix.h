/* SPDX-License-Identifier: Apache-2.0 */
/* engine-sim's prefix cache: whole token blocks keyed by their chained
 * hash (the hash of the prefix ending with the block, kvsim_prefix_hashes),
 * a fixed capacity in blocks, least recently used evicted first. Each
 * block stored or evicted is reported to an observer, which turns them into
 * vLLM KV events (sim/kvevents.c). No clock, no I/O. */
#ifndef SIM_PREFIX_H
#define SIM_PREFIX_H

#include <stddef.h>
#include <stdint.h>

typedef struct sim_prefix sim_prefix;

typedef struct sim_prefix_obs {
    /* Blocks hashes[0..n) became cached, in prompt order; `parent` is the
     * hash of the block before hashes[0] (has_parent 0: they start the
     * prompt); tok holds n * block_tokens token ids. */
    void (*stored)(void *ctx, const uint64_t *hashes, size_t n, int has_parent, uint64_t parent,
                   const uint32_t *tok, size_t ntok);
    /* Block `hash` left the cache (evicted). */
    void (*removed)(void *ctx, uint64_t hash);
    void *ctx;
} sim_prefix_obs;

/* A cache of `cap` blocks of `block_tokens` tokens; obs may be NULL. */
sim_prefix *sim_prefix_new(size_t cap, size_t block_tokens, const sim_prefix_obs *obs);
void sim_prefix_free(sim_prefix *p);

/* The number of leading blocks of ph[0..n) that are cached; those become
 * the most recently used. */
size_t sim_prefix_match(sim_prefix *p, const uint64_t *ph, size_t n);

/* Caches the whole blocks ph[0..n) of a prompt whose tokens are tok
 * (n * block_tokens of them at least): blocks already there are touched,
 * the others stored, evicting the least recently used beyond capacity
 * (never a block of this prompt). Reports the stored runs and evictions. */
void sim_prefix_insert(sim_prefix *p, const uint64_t *ph, const uint32_t *tok, size_t n);

/* Drops every block without reporting them; returns how many there were. */
size_t sim_prefix_clear(sim_prefix *p);

size_t sim_prefix_size(const sim_prefix *p);

#endif
