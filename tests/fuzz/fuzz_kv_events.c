/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the KV-event decoder (proxy/kvevents.c), which reads
 * what any engine's ZeroMQ publisher sends, fed into a real KV index.
 *
 * Invariants: no read past the payload, no allocation beyond what the
 * payload's bytes allow (a declared count must fit the bytes left); every
 * stored event handed over is consistent (block size within bounds, tokens
 * for every block); the index never exceeds its bounds (blocks, bytes);
 * a prompt walk over the stored tokens never matches more blocks than the
 * prompt has; no leak. */
#include "proxy/kvevents.h"
#include "proxy/kvindex.h"
#include "tests/fuzz/fuzz_common.h"

#define MAX_BLOCKS 64
#define MAX_BYTES 4096

static volatile uint32_t token_sum; /* keeps the reads below */

typedef struct fz {
    px_kvindex *x;
    int slot;
} fz;

static void on_stored(void *arg, const px_kv_stored *s) {
    fz *f = arg;
    FZ_CHECK(s->block_size >= 1 && s->block_size <= PX_KV_MAX_BLOCK_SIZE);
    FZ_CHECK(s->n <= PX_KV_MAX_BLOCKS);
    /* Touch every token: ASan catches an array shorter than n * block_size. */
    for (size_t i = 0; i < s->n * s->block_size; i++)
        token_sum += s->tok[i];
    if (s->lora) px_kvindex_lora_seen(f->x, s->lora);
    px_kvindex_store(f->x, f->slot, s->hashes, s->n, s->has_parent, s->parent, s->tok,
                     s->block_size, s->extra, NULL);
    px_kv_prompt p;
    px_kv_prompt_init(&p, s->tok, s->n * s->block_size, s->extra ? s->extra[0] : 0);
    FZ_CHECK(px_kvindex_match_prompt(f->x, f->slot, &p) <= s->n);
    px_kv_prompt_cleanup(&p);
}

static void on_removed(void *arg, const uint64_t *h, size_t n) {
    fz *f = arg;
    FZ_CHECK(n <= PX_KV_MAX_BLOCKS);
    px_kvindex_remove(f->x, f->slot, h, n);
}

static void on_cleared(void *arg) {
    fz *f = arg;
    px_kvindex_clear(f->x, f->slot);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = fz_dup(data, size);
    fz f = {px_kvindex_create_bounded(MAX_BLOCKS, MAX_BYTES, 1), 0};
    f.slot = px_kvindex_slot(f.x, "fuzz:1", 1);
    px_kv_sink sink = {&f, on_stored, on_removed, on_cleared};
    size_t bad = 0;
    char err[128];
    err[0] = 0;
    int n = px_kv_decode(buf, size, &sink, &bad, err, sizeof err);
    FZ_CHECK(n >= -1);
    if (n < 0) FZ_CHECK(memchr(err, 0, sizeof err) && err[0]);
    px_kvindex_stats st;
    px_kvindex_stats_get(f.x, f.slot, &st);
    FZ_CHECK(st.blocks <= MAX_BLOCKS);
    px_kvindex_totals(f.x, &st);
    FZ_CHECK(st.bytes <= MAX_BYTES);
    px_kvindex_destroy(f.x);
    free(buf);
    return 0;
}
