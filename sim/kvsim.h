/* SPDX-License-Identifier: Apache-2.0 */
/* engine-sim's stand-ins for a model: a deterministic tokenizer, KV-cache
 * block contents that are a pure function of the prompt, and generated text.
 * Same inputs, same bytes, in any process: decode can verify what it
 * received from prefill, and disaggregated output equals local output.
 * Every function builds on base/'s px_hash64_seed(). */
#ifndef SIM_KVSIM_H
#define SIM_KVSIM_H

#include <stddef.h>
#include <stdint.h>

/* Splits text into tokens (runs of letters/digits, or single other
 * non-space characters) and appends their ids to *ids (realloc'd).
 * Returns the new count. */
size_t kvsim_tokenize(const char *text, size_t len, uint32_t **ids, size_t n);

/* out[b], for each block b < nblocks: the hash of the prefix of `ids`
 * that ends with block b (block_tokens per block; the last block may be
 * partial, blocks past the end hash the whole prompt). One pass over the
 * tokens for all of them. */
void kvsim_prefix_hashes(uint64_t model_hash, const uint32_t *ids, size_t ntok, size_t block_tokens,
                         uint64_t *out, size_t nblocks);

/* Fills out[0..len) with the bytes of block `b` for (layer, kv: 0=K, 1=V),
 * given the block's prefix hash. */
void kvsim_fill_block(uint64_t prefix_hash, uint32_t layer, uint32_t kv, void *out, size_t len);

/* The i-th generated word (with its leading space) for a prompt, in a
 * buffer of at least 24 bytes; returns its length. */
size_t kvsim_word(uint64_t prompt_hash, uint64_t seed, size_t i, char *out);

#endif
