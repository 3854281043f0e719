/* SPDX-License-Identifier: Apache-2.0 */
/* What each engine holds in its KV cache, keyed by the tokens: every full
 * block is known by a chained hash of its token ids (px_kv_chain), which the
 * proxy computes the same way for an incoming prompt, so a lookup never
 * needs the engine's own hash function. The engine's block hashes (from its
 * KV events) map to the token keys so its removals find them.
 *
 * One slot per backend, made on first use and kept until the index is
 * destroyed (a reset empties it). Writers are the control thread (the KV
 * event subscriber); readers are the workers (routing) and the admin API.
 * Each slot has its own rwlock, held by a writer only for in-place edits of
 * at most 32 blocks or for swapping in a grown table (rehashed outside the
 * lock), and by a reader for one prefix walk: no reader waits on a batch or
 * a rehash, and slots never contend with each other. */
#ifndef PX_KVINDEX_H
#define PX_KVINDEX_H

#include <stddef.h>
#include <stdint.h>

typedef struct px_kvindex px_kvindex;

/* The key of a block whose parent's key is `parent` (0 for the first block
 * of a sequence: px_kv_chain(0, ...)), holding `n` token ids, with `extra`
 * the hash of its extra keys and LoRA name (0: none). Stable across
 * processes and builds: two proxies compute the same keys. */
uint64_t px_kv_chain(uint64_t parent, const uint32_t *tok, size_t n, uint64_t extra);

/* An index bounded to `max_blocks` blocks per backend and `max_backends`
 * backends. NULL when out of memory. */
px_kvindex *px_kvindex_create(size_t max_blocks, size_t max_backends);
/* The same, its tables also bounded to `max_bytes` in all (0: no bound).
 * At either bound new blocks are refused (counted, see px_kvindex_store):
 * what is indexed stays until the engine removes it, a clear or a reset;
 * an index never evicts on its own, so it never claims blocks an engine
 * still holds are gone nor the reverse. Tables grow at half full and, when
 * the byte bound refuses the growth, fill to three quarters. */
px_kvindex *px_kvindex_create_bounded(size_t max_blocks, size_t max_bytes, size_t max_backends);
void px_kvindex_destroy(px_kvindex *x); /* NULL is a no-op */

/* The slot of backend `name` (borrowed), made when `create` and missing.
 * -1 when missing (or, with create, when max_backends are taken). */
int px_kvindex_slot(px_kvindex *x, const char *name, int create);

/* A BlockStored event: n blocks of block_size tokens each, `tok` holding
 * n * block_size token ids; engine hashes `eh` (n of them), the parent's
 * engine hash (has_parent 0: the blocks start a sequence), `extra` per
 * block (NULL: none). Blocks whose parent the slot does not know are
 * skipped (their keys cannot be computed). Returns the blocks added; the
 * ones refused at the bound are added to *refused. Control thread. */
size_t px_kvindex_store(px_kvindex *x, int slot, const uint64_t *eh, size_t n, int has_parent,
                        uint64_t parent, const uint32_t *tok, size_t block_size,
                        const uint64_t *extra, size_t *refused);
/* A BlockRemoved event. Returns the blocks removed. */
size_t px_kvindex_remove(px_kvindex *x, int slot, const uint64_t *eh, size_t n);
/* AllBlocksCleared, a gap that cannot be replayed, a restarted engine. */
void px_kvindex_clear(px_kvindex *x, int slot);

/* How many of the prompt's leading full blocks (keys[0..n), as chained by
 * px_kv_chain) the slot holds. Any thread. */
size_t px_kvindex_match(px_kvindex *x, int slot, const uint64_t *keys, size_t n);
/* The block size the slot's events announced (0: none yet). */
size_t px_kvindex_block_size(px_kvindex *x, int slot);

typedef struct px_kvindex_stats {
    size_t blocks; /* token keys held */
    size_t bytes;  /* memory of its tables */
    size_t block_size;
} px_kvindex_stats;
void px_kvindex_stats_get(px_kvindex *x, int slot, px_kvindex_stats *st);
/* Totals over every slot. */
void px_kvindex_totals(px_kvindex *x, px_kvindex_stats *st);

/* Keys of a prompt's full blocks: out[i] = px_kv_chain(out[i-1], block i).
 * Returns how many (ntok / block_size, at most cap). */
size_t px_kv_prompt_keys(const uint32_t *tok, size_t ntok, size_t block_size, uint64_t extra,
                         uint64_t *out, size_t cap);
/* The same for a request with a cache_salt: its key (px_kv_salt_key) goes
 * into the first block's extra only, as vLLM puts the salt into the first
 * block's extra keys alone (kv_cache_utils.py, read at
 * vllm-project/vllm@001cabc1): every later key differs through the chain. */
size_t px_kv_salted_keys(const uint32_t *tok, size_t ntok, size_t block_size, uint64_t extra,
                         uint64_t salt, uint64_t *out, size_t cap);
/* The index's key of a cache_salt's text (n bytes; 0 when n is 0): the KV
 * event decoder keys a first block whose extra keys hold a salt by it, a
 * request by its own salt. */
uint64_t px_kv_salt_key(const char *salt, size_t n);

/* LoRA adapters: an engine stores a LoRA request's blocks under the
 * adapter's name (BlockStored's lora_name), and a request names the adapter
 * as its model. px_kvindex_lora_seen records a name's px_hash64 from an
 * event (at most PX_KV_MAX_LORAS names; control thread);
 * px_kvindex_request_extra gives the `extra` a request for `model` (n
 * bytes) hashes its blocks with: the adapter's key when blocks were stored
 * under that name, else 0 (the base model). Any thread. */
#define PX_KV_MAX_LORAS 1024
void px_kvindex_lora_seen(px_kvindex *x, uint64_t lora_hash);
uint64_t px_kvindex_request_extra(px_kvindex *x, const char *model, size_t n);

/* A prompt whose block keys are computed as lookups need them: a walk
 * stops at a backend's first missing block, so the keys past the longest
 * cached prefix are never hashed, and the keys are hashed once for all
 * the backends that share a block size. Init, match against any number of
 * slots, cleanup; one thread. */
typedef struct px_kv_prompt {
    const uint32_t *tok; /* borrowed: valid until cleanup */
    size_t ntok;
    uint64_t extra; /* hash of the LoRA name / extra keys, 0: none */
    uint64_t salt;  /* px_kv_salt_key of its cache_salt, first block only (set after init) */
    size_t bs;      /* the block size keys[] are for (0: none yet) */
    size_t n;       /* keys[0..n) computed */
    size_t cap;
    uint64_t *keys; /* owned when not local */
    uint64_t local[64];
} px_kv_prompt;
void px_kv_prompt_init(px_kv_prompt *p, const uint32_t *tok, size_t ntok, uint64_t extra);
void px_kv_prompt_cleanup(px_kv_prompt *p);
/* How many of the prompt's leading full blocks the slot holds (0: slot
 * unknown or no block size yet); the first key is computed whenever the
 * block size is known and the prompt has a full block. Any thread. */
size_t px_kvindex_match_prompt(px_kvindex *x, int slot, px_kv_prompt *p);

#endif
