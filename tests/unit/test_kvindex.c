/* SPDX-License-Identifier: Apache-2.0 */
/* The token-keyed KV index (proxy/kvindex.c) and the KV-event decoder
 * (proxy/kvevents.c) on payloads packed here with msgpack-c. */
/* cmocka.h needs these first. */
// clang-format off
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
// clang-format on
#include <msgpack.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "proxy/kvevents.h"
#include "proxy/kvindex.h"

#define BS 4

/* Tokens of block i of prompt p: distinct per (p, i). */
static void block_tokens(uint32_t p, size_t i, uint32_t *out) {
    for (size_t j = 0; j < BS; j++)
        out[j] = p * 100000u + (uint32_t)(i * BS + j);
}

static size_t prompt(uint32_t p, size_t nblocks, uint32_t *tok) {
    for (size_t i = 0; i < nblocks; i++)
        block_tokens(p, i, tok + i * BS);
    return nblocks * BS;
}

static size_t matched(px_kvindex *x, int slot, const uint32_t *tok, size_t ntok) {
    uint64_t keys[64];
    size_t n = px_kv_prompt_keys(tok, ntok, BS, 0, keys, 64);
    return px_kvindex_match(x, slot, keys, n);
}

static size_t matched_n(px_kvindex *x, int slot, const uint32_t *tok, size_t ntok) {
    size_t cap = ntok / BS + 1;
    uint64_t *keys = malloc(cap * sizeof *keys);
    size_t n = px_kv_prompt_keys(tok, ntok, BS, 0, keys, cap);
    size_t m = px_kvindex_match(x, slot, keys, n);
    free(keys);
    return m;
}

static void test_chain_stable(void **state) {
    (void)state;
    uint32_t t[BS] = {1, 2, 3, 4}, u[BS] = {1, 2, 3, 5};
    uint64_t a = px_kv_chain(0, t, BS, 0);
    assert_int_equal(a, px_kv_chain(0, t, BS, 0));
    assert_int_not_equal(a, px_kv_chain(0, u, BS, 0));
    assert_int_not_equal(a, px_kv_chain(1, t, BS, 0));
    assert_int_not_equal(a, px_kv_chain(0, t, BS, 7)); /* extra keys / LoRA */
    assert_int_not_equal(a, 0);
    uint32_t tok[10];
    uint64_t keys[4];
    prompt(1, 2, tok);
    tok[8] = tok[9] = 9;
    /* 10 tokens of block size 4: two full blocks; the partial one has no key. */
    assert_int_equal(px_kv_prompt_keys(tok, 10, BS, 0, keys, 4), 2);
    assert_int_equal(keys[0], px_kv_chain(0, tok, BS, 0));
    assert_int_equal(keys[1], px_kv_chain(keys[0], tok + BS, BS, 0));
    assert_int_equal(px_kv_prompt_keys(tok, 10, 0, 0, keys, 4), 0);
}

static void test_store_match_remove(void **state) {
    (void)state;
    px_kvindex *x = px_kvindex_create(1000, 4);
    int s = px_kvindex_slot(x, "a:1", 1);
    assert_int_equal(s, 0);
    assert_int_equal(px_kvindex_slot(x, "a:1", 0), 0);
    assert_int_equal(px_kvindex_slot(x, "b:1", 0), -1);
    uint32_t tok[8 * BS];
    size_t ntok = prompt(1, 8, tok);
    /* Blocks 0..2 stored as one event, 3..4 as a second chained to block 2. */
    uint64_t eh[5] = {101, 102, 103, 104, 105};
    size_t refused = 0;
    assert_int_equal(px_kvindex_store(x, s, eh, 3, 0, 0, tok, BS, NULL, &refused), 3);
    assert_int_equal(px_kvindex_store(x, s, eh + 3, 2, 1, 103, tok + 3 * BS, BS, NULL, &refused),
                     2);
    assert_int_equal(refused, 0);
    assert_int_equal(px_kvindex_block_size(x, s), BS);
    assert_int_equal(matched(x, s, tok, ntok), 5);
    /* A prompt that shares two blocks, then differs. */
    uint32_t other[8 * BS];
    memcpy(other, tok, sizeof other);
    other[2 * BS] ^= 1;
    assert_int_equal(matched(x, s, other, ntok), 2);
    /* Parent unknown: the blocks cannot be keyed, nothing is added. */
    uint64_t orphan = 999;
    assert_int_equal(px_kvindex_store(x, s, &orphan, 1, 1, 4242, tok, BS, NULL, &refused), 0);
    /* The same block stored again changes nothing. */
    assert_int_equal(px_kvindex_store(x, s, eh, 1, 0, 0, tok, BS, NULL, &refused), 0);
    px_kvindex_stats st;
    px_kvindex_stats_get(x, s, &st);
    assert_int_equal(st.blocks, 5);
    assert_true(st.bytes > 0);
    /* Removing block 3 cuts the prefix there. */
    assert_int_equal(px_kvindex_remove(x, s, eh + 3, 1), 1);
    assert_int_equal(matched(x, s, tok, ntok), 3);
    uint64_t unknown = 77;
    assert_int_equal(px_kvindex_remove(x, s, &unknown, 1), 0);
    px_kvindex_clear(x, s);
    assert_int_equal(matched(x, s, tok, ntok), 0);
    px_kvindex_stats_get(x, s, &st);
    assert_int_equal(st.blocks, 0);
    px_kvindex_destroy(x);
}

/* Two engine hashes for the same tokens (another KV-cache group): the key
 * stays until both are removed. */
static void test_shared_key(void **state) {
    (void)state;
    px_kvindex *x = px_kvindex_create(1000, 4);
    int s = px_kvindex_slot(x, "a:1", 1);
    uint32_t tok[BS];
    block_tokens(3, 0, tok);
    uint64_t e1 = 1, e2 = 2;
    assert_int_equal(px_kvindex_store(x, s, &e1, 1, 0, 0, tok, BS, NULL, NULL), 1);
    assert_int_equal(px_kvindex_store(x, s, &e2, 1, 0, 0, tok, BS, NULL, NULL), 0);
    assert_int_equal(px_kvindex_remove(x, s, &e1, 1), 0);
    assert_int_equal(matched(x, s, tok, BS), 1);
    assert_int_equal(px_kvindex_remove(x, s, &e2, 1), 1);
    assert_int_equal(matched(x, s, tok, BS), 0);
    px_kvindex_destroy(x);
}

static void test_bounds(void **state) {
    (void)state;
    px_kvindex *x = px_kvindex_create(10, 2);
    int s = px_kvindex_slot(x, "a:1", 1);
    assert_int_equal(px_kvindex_slot(x, "b:1", 1), 1);
    assert_int_equal(px_kvindex_slot(x, "c:1", 1), -1); /* max_backends */
    uint32_t tok[16 * BS];
    uint64_t eh[16];
    for (int i = 0; i < 16; i++)
        eh[i] = 500 + (uint64_t)i;
    prompt(4, 16, tok);
    size_t refused = 0;
    assert_int_equal(px_kvindex_store(x, s, eh, 16, 0, 0, tok, BS, NULL, &refused), 10);
    assert_int_equal(refused, 6);
    px_kvindex_stats st;
    px_kvindex_stats_get(x, s, &st);
    assert_int_equal(st.blocks, 10);
    assert_int_equal(matched(x, s, tok, 16 * BS), 10);
    /* The other slot is bounded on its own. */
    assert_int_equal(px_kvindex_store(x, 1, eh, 4, 0, 0, tok, BS, NULL, &refused), 4);
    px_kvindex_totals(x, &st);
    assert_int_equal(st.blocks, 14);
    /* Calls on a slot that does not exist are no-ops. */
    assert_int_equal(px_kvindex_store(x, 7, eh, 1, 0, 0, tok, BS, NULL, NULL), 0);
    assert_int_equal(px_kvindex_match(x, -1, eh, 1), 0);
    px_kvindex_destroy(x);
}

/* Many roots stored, half removed in a scattered order: every survivor is
 * still found (deletion without tombstones moves cells of probe runs). */
static void test_churn(void **state) {
    (void)state;
    enum { N = 20000 };
    px_kvindex *x = px_kvindex_create(N, 1);
    int s = px_kvindex_slot(x, "a:1", 1);
    uint32_t tok[BS];
    for (uint32_t i = 0; i < N; i++) {
        uint64_t e = i * 2654435761u;
        block_tokens(i, 0, tok);
        assert_int_equal(px_kvindex_store(x, s, &e, 1, 0, 0, tok, BS, NULL, NULL), 1);
    }
    for (uint32_t i = 0; i < N; i += 2) {
        uint64_t e = i * 2654435761u;
        assert_int_equal(px_kvindex_remove(x, s, &e, 1), 1);
    }
    for (uint32_t i = 0; i < N; i++) {
        block_tokens(i, 0, tok);
        assert_int_equal(matched(x, s, tok, BS), i % 2);
    }
    px_kvindex_stats st;
    px_kvindex_stats_get(x, s, &st);
    assert_int_equal(st.blocks, N / 2);
    px_kvindex_destroy(x);
}


/* The byte bound over all backends: stores past it are refused and
 * counted, the tables never pass it, and a cleared backend's memory is
 * there for another one. */
static void test_bytes_bound(void **state) {
    (void)state;
    enum { MAX = 16384, N = 2000 };
    px_kvindex *x = px_kvindex_create_bounded(1000000, MAX, 2);
    int a = px_kvindex_slot(x, "a:1", 1), b = px_kvindex_slot(x, "b:1", 1);
    uint32_t tok[BS];
    size_t added = 0, refused = 0;
    px_kvindex_stats st;
    for (uint32_t i = 0; i < N; i++) {
        uint64_t e = 1 + i;
        block_tokens(i, 0, tok);
        added += px_kvindex_store(x, a, &e, 1, 0, 0, tok, BS, NULL, &refused);
        px_kvindex_totals(x, &st);
        assert_true(st.bytes <= MAX);
    }
    assert_true(added > 0 && refused > 0);
    assert_int_equal(added + refused, N);
    px_kvindex_stats_get(x, a, &st);
    assert_int_equal(st.blocks, added);
    /* Every block it took is found. */
    for (uint32_t i = 0; i < added; i++) {
        block_tokens(i, 0, tok);
        assert_int_equal(matched(x, a, tok, BS), 1);
    }
    /* The other backend gets what is left, not more. */
    size_t refused_b = 0, added_b = 0;
    for (uint32_t i = 0; i < N; i++) {
        uint64_t e = 1 + i;
        block_tokens(N + i, 0, tok);
        added_b += px_kvindex_store(x, b, &e, 1, 0, 0, tok, BS, NULL, &refused_b);
    }
    assert_true(refused_b > 0 && added_b < added);
    px_kvindex_totals(x, &st);
    assert_true(st.bytes <= MAX);
    /* Cleared, a's memory is free again: b can now hold as many as a did. */
    px_kvindex_clear(x, a);
    px_kvindex_clear(x, b);
    px_kvindex_totals(x, &st);
    assert_int_equal(st.bytes, 0);
    assert_int_equal(st.blocks, 0);
    added_b = 0;
    for (uint32_t i = 0; i < N; i++) {
        uint64_t e = 1 + i;
        block_tokens(N + i, 0, tok);
        added_b += px_kvindex_store(x, b, &e, 1, 0, 0, tok, BS, NULL, NULL);
    }
    assert_int_equal(added_b, added);
    px_kvindex_destroy(x);
}

/* px_kvindex_match_prompt agrees with hashing every key up front, for
 * prompts shorter and longer than its local key buffer, and its keys are
 * shared between slots of one block size. */
static void test_match_prompt(void **state) {
    (void)state;
    enum { NB = 200 };
    px_kvindex *x = px_kvindex_create(100000, 3);
    int a = px_kvindex_slot(x, "a:1", 1), b = px_kvindex_slot(x, "b:1", 1);
    int c = px_kvindex_slot(x, "c:1", 1);
    uint32_t *tok = malloc(NB * BS * sizeof *tok);
    prompt(5, NB, tok);
    uint64_t *eh = malloc(NB * sizeof *eh);
    for (size_t i = 0; i < NB; i++)
        eh[i] = 7000 + i;
    /* a holds 150 blocks of the prompt, b 3; c has none (no block size). */
    assert_int_equal(px_kvindex_store(x, a, eh, 150, 0, 0, tok, BS, NULL, NULL), 150);
    assert_int_equal(px_kvindex_store(x, b, eh, 3, 0, 0, tok, BS, NULL, NULL), 3);
    size_t lens[] = {0, BS - 1, BS, 3 * BS + 1, 64 * BS, 150 * BS, NB * BS};
    for (size_t l = 0; l < sizeof lens / sizeof *lens; l++) {
        px_kv_prompt p;
        px_kv_prompt_init(&p, tok, lens[l], 0);
        size_t ma = px_kvindex_match_prompt(x, a, &p), mb = px_kvindex_match_prompt(x, b, &p);
        assert_int_equal(ma, matched_n(x, a, tok, lens[l]));
        assert_int_equal(mb, matched_n(x, b, tok, lens[l]));
        assert_int_equal(px_kvindex_match_prompt(x, c, &p), 0);
        assert_int_equal(px_kvindex_match_prompt(x, -1, &p), 0);
        if (lens[l] >= BS) assert_int_equal(p.keys[0], px_kv_chain(0, tok, BS, 0));
        /* Never more keys hashed than the walk needed, plus one step. */
        assert_true(p.n <= ma + 32 || p.n <= 32);
        px_kv_prompt_cleanup(&p);
    }
    /* A different LoRA / extra key: nothing matches. */
    px_kv_prompt p;
    px_kv_prompt_init(&p, tok, NB * BS, 12345);
    assert_int_equal(px_kvindex_match_prompt(x, a, &p), 0);
    px_kv_prompt_cleanup(&p);
    free(tok);
    free(eh);
    px_kvindex_destroy(x);
}

/* Blocks stored under a LoRA name match only requests for that adapter,
 * and base-model blocks only base-model requests. */
static void test_lora_keys(void **state) {
    (void)state;
    px_kvindex *x = px_kvindex_create(1000, 1);
    int s = px_kvindex_slot(x, "a:1", 1);
    uint64_t lora = px_hash64("sql-lora", 8), ex[3];
    for (int i = 0; i < 3; i++)
        ex[i] = px_mix64(lora); /* as the decoder keys lora_name without extra keys */
    assert_int_equal(px_kvindex_request_extra(x, "sql-lora", 8), 0); /* not seen yet */
    px_kvindex_lora_seen(x, lora);
    uint64_t el = px_kvindex_request_extra(x, "sql-lora", 8);
    assert_int_equal(el, px_mix64(lora));
    assert_int_equal(px_kvindex_request_extra(x, "base-model", 10), 0);
    uint32_t t[3 * BS], u[3 * BS];
    prompt(1, 3, t);
    prompt(2, 3, u);
    uint64_t eh[3] = {1, 2, 3}, fh[3] = {4, 5, 6};
    assert_int_equal(px_kvindex_store(x, s, eh, 3, 0, 0, t, BS, ex, NULL), 3);
    assert_int_equal(px_kvindex_store(x, s, fh, 3, 0, 0, u, BS, NULL, NULL), 3);
    struct {
        const uint32_t *tok;
        uint64_t extra;
        size_t want;
    } cases[] = {{t, el, 3}, {t, 0, 0}, {u, el, 0}, {u, 0, 3}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        px_kv_prompt p;
        px_kv_prompt_init(&p, cases[i].tok, 3 * BS, cases[i].extra);
        assert_int_equal(px_kvindex_match_prompt(x, s, &p), cases[i].want);
        px_kv_prompt_cleanup(&p);
    }
    px_kvindex_destroy(x);
}

/* ---------- the decoder ---------- */

typedef struct seen {
    int stored, removed, cleared;
    size_t blocks, removed_n;
    uint64_t first_hash, parent;
    int has_parent;
    uint32_t tok0;
    size_t bs;
    uint64_t extra0;
} seen;

static void on_stored(void *arg, const px_kv_stored *s) {
    seen *v = arg;
    v->stored++;
    v->blocks += s->n;
    v->first_hash = s->hashes[0];
    v->has_parent = s->has_parent;
    v->parent = s->parent;
    v->tok0 = s->tok[0];
    v->bs = s->block_size;
    v->extra0 = s->extra ? s->extra[0] : 0;
}

static void on_removed(void *arg, const uint64_t *h, size_t n) {
    seen *v = arg;
    v->removed++;
    v->removed_n += n;
    (void)h;
}

static void on_cleared(void *arg) {
    ((seen *)arg)->cleared++;
}

static void pstr(msgpack_packer *pk, const char *s) {
    msgpack_pack_str(pk, strlen(s));
    msgpack_pack_str_body(pk, s, strlen(s));
}

/* BlockStored with 2 blocks of size 2, in the array or map layout. */
static void pack_stored(msgpack_packer *pk, int map, int bytes_hash, int parent, int lora) {
    if (map) {
        msgpack_pack_map(pk, 8);
        pstr(pk, "type");
    } else {
        msgpack_pack_array(pk, 8);
    }
    pstr(pk, "BlockStored");
    if (map) pstr(pk, "block_hashes");
    msgpack_pack_array(pk, 2);
    for (int i = 0; i < 2; i++) {
        if (bytes_hash) {
            char h[32];
            memset(h, 'a' + i, sizeof h);
            msgpack_pack_bin(pk, sizeof h);
            msgpack_pack_bin_body(pk, h, sizeof h);
        } else {
            msgpack_pack_uint64(pk, 1000 + (uint64_t)i);
        }
    }
    if (map) pstr(pk, "parent_block_hash");
    if (parent)
        msgpack_pack_int64(pk, -5);
    else
        msgpack_pack_nil(pk);
    if (map) pstr(pk, "token_ids");
    msgpack_pack_array(pk, 4);
    for (int i = 0; i < 4; i++)
        msgpack_pack_uint32(pk, 7 + (uint32_t)i);
    if (map) pstr(pk, "block_size");
    msgpack_pack_int(pk, 2);
    if (map) pstr(pk, "lora_id");
    msgpack_pack_nil(pk);
    if (map) pstr(pk, "medium");
    pstr(pk, "GPU");
    if (map) pstr(pk, "lora_name");
    if (lora)
        pstr(pk, "adapter");
    else
        msgpack_pack_nil(pk);
}

static int decode(const msgpack_sbuffer *sb, seen *v, size_t *bad) {
    px_kv_sink sink = {v, on_stored, on_removed, on_cleared};
    char err[128];
    *bad = 0;
    return px_kv_decode(sb->data, sb->size, &sink, bad, err, sizeof err);
}

static void test_decode_layouts(void **state) {
    (void)state;
    for (int map = 0; map < 2; map++) {
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        msgpack_packer pk;
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        if (map) {
            msgpack_pack_map(&pk, 3);
            pstr(&pk, "ts");
            msgpack_pack_double(&pk, 1.5);
            pstr(&pk, "events");
        } else {
            msgpack_pack_array(&pk, 3);
            msgpack_pack_double(&pk, 1.5);
        }
        msgpack_pack_array(&pk, 4);
        pack_stored(&pk, map, 0, map, 0);
        if (map) {
            msgpack_pack_map(&pk, 3);
            pstr(&pk, "type");
            pstr(&pk, "BlockRemoved");
            pstr(&pk, "block_hashes");
        } else {
            msgpack_pack_array(&pk, 3);
            pstr(&pk, "BlockRemoved");
        }
        msgpack_pack_array(&pk, 1);
        msgpack_pack_uint64(&pk, 1001);
        if (map) pstr(&pk, "medium");
        msgpack_pack_nil(&pk);
        if (map) {
            msgpack_pack_map(&pk, 1);
            pstr(&pk, "type");
        } else {
            msgpack_pack_array(&pk, 1);
        }
        pstr(&pk, "AllBlocksCleared");
        if (map) {
            msgpack_pack_map(&pk, 1);
            pstr(&pk, "type");
        } else {
            msgpack_pack_array(&pk, 1);
        }
        pstr(&pk, "NoSuchEvent");
        if (map) pstr(&pk, "data_parallel_rank");
        msgpack_pack_int(&pk, 0);
        seen v = {0};
        size_t bad;
        assert_int_equal(decode(&sb, &v, &bad), 3);
        assert_int_equal(bad, 1); /* the unknown tag */
        assert_int_equal(v.stored, 1);
        assert_int_equal(v.blocks, 2);
        assert_int_equal(v.first_hash, 1000);
        assert_int_equal(v.has_parent, map);
        if (map) assert_int_equal(v.parent, (uint64_t)-5);
        assert_int_equal(v.tok0, 7);
        assert_int_equal(v.bs, 2);
        assert_int_equal(v.removed_n, 1);
        assert_int_equal(v.cleared, 1);
        msgpack_sbuffer_destroy(&sb);
    }
}

static void test_decode_bytes_hash_lora(void **state) {
    (void)state;
    uint64_t first[2];
    for (int lora = 0; lora < 2; lora++) {
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        msgpack_packer pk;
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_array(&pk, 2);
        msgpack_pack_double(&pk, 1.0);
        msgpack_pack_array(&pk, 1);
        pack_stored(&pk, 0, 1, 0, lora);
        seen v = {0};
        size_t bad;
        assert_int_equal(decode(&sb, &v, &bad), 1);
        assert_int_equal(bad, 0);
        first[lora] = v.first_hash;
        assert_true(lora ? v.extra0 != 0 : v.extra0 == 0);
        msgpack_sbuffer_destroy(&sb);
    }
    assert_int_equal(first[0], first[1]);
}

static void test_decode_hostile(void **state) {
    (void)state;
    seen v = {0};
    px_kv_sink sink = {&v, on_stored, on_removed, on_cleared};
    char err[128];
    size_t bad = 0;
    /* An array of 4 billion elements in 5 bytes: refused before msgpack-c
     * would allocate for it. */
    static const unsigned char huge[] = {0x92, 0xcb, 0,    0,    0,    0,    0,   0,
                                         0,    0,    0xdd, 0xff, 0xff, 0xff, 0xff};
    assert_int_equal(px_kv_decode(huge, sizeof huge, &sink, &bad, err, sizeof err), -1);
    static const unsigned char map_huge[] = {0xdf, 0x7f, 0xff, 0xff, 0xff, 0xa1, 'x'};
    assert_int_equal(px_kv_decode(map_huge, sizeof map_huge, &sink, &bad, err, sizeof err), -1);
    static const unsigned char truncated[] = {0x93, 0xcb, 0, 0};
    assert_int_equal(px_kv_decode(truncated, sizeof truncated, &sink, &bad, err, sizeof err), -1);
    static const unsigned char never[] = {0xc1};
    assert_int_equal(px_kv_decode(never, 1, &sink, &bad, err, sizeof err), -1);
    assert_int_equal(px_kv_decode("", 0, &sink, &bad, err, sizeof err), -1);
    /* Nesting past the depth bound. */
    unsigned char deep[64];
    memset(deep, 0x91, sizeof deep);
    deep[63] = 0xc0;
    assert_int_equal(px_kv_decode(deep, sizeof deep, &sink, &bad, err, sizeof err), -1);
    /* Not a batch: an integer, an array whose events are not an array. */
    static const unsigned char num[] = {0x05};
    assert_int_equal(px_kv_decode(num, 1, &sink, &bad, err, sizeof err), -1);
    static const unsigned char noev[] = {0x92, 0x01, 0x02};
    assert_int_equal(px_kv_decode(noev, 3, &sink, &bad, err, sizeof err), -1);
    assert_int_equal(v.stored + v.removed + v.cleared, 0);

    /* Token ids that do not make len(block_hashes) full blocks: refused. */
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 2);
    msgpack_pack_double(&pk, 1.0);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_array(&pk, 5);
    pstr(&pk, "BlockStored");
    msgpack_pack_array(&pk, 2);
    msgpack_pack_uint64(&pk, 1);
    msgpack_pack_uint64(&pk, 2);
    msgpack_pack_nil(&pk);
    msgpack_pack_array(&pk, 3);
    for (int i = 0; i < 3; i++)
        msgpack_pack_int(&pk, i);
    msgpack_pack_int(&pk, 2);
    /* Block size 0, and a negative token id. */
    msgpack_pack_array(&pk, 5);
    pstr(&pk, "BlockStored");
    msgpack_pack_array(&pk, 0);
    msgpack_pack_nil(&pk);
    msgpack_pack_array(&pk, 0);
    msgpack_pack_int(&pk, 0);
    msgpack_pack_array(&pk, 5);
    pstr(&pk, "BlockStored");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_uint64(&pk, 1);
    msgpack_pack_nil(&pk);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_int(&pk, -3);
    msgpack_pack_int(&pk, 1);
    bad = 0;
    assert_int_equal(px_kv_decode(sb.data, sb.size, &sink, &bad, err, sizeof err), 0);
    assert_int_equal(bad, 3);
    assert_int_equal(v.stored, 0);
    msgpack_sbuffer_destroy(&sb);
}

/* Readers walking prefixes while the writer stores and removes: no reader
 * sees a torn table (run under ASan/TSan in CI). */
typedef struct rd {
    px_kvindex *x;
    atomic_int *stop;
    size_t hits;
} rd;

static void *reader(void *arg) {
    rd *r = arg;
    uint32_t tok[8 * BS];
    prompt(9, 8, tok);
    uint64_t keys[8];
    px_kv_prompt_keys(tok, 8 * BS, BS, 0, keys, 8);
    while (!atomic_load(r->stop))
        r->hits += px_kvindex_match(r->x, 0, keys, 8);
    return NULL;
}

static void test_concurrent_readers(void **state) {
    (void)state;
    px_kvindex *x = px_kvindex_create(100000, 1);
    int s = px_kvindex_slot(x, "a:1", 1);
    atomic_int stop = 0;
    rd r[2] = {{x, &stop, 0}, {x, &stop, 0}};
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, reader, &r[i]);
    uint32_t tok[8 * BS];
    prompt(9, 8, tok);
    uint64_t eh[8];
    for (int round = 0; round < 2000; round++) {
        for (int i = 0; i < 8; i++)
            eh[i] = (uint64_t)round * 8 + (uint64_t)i + 1;
        px_kvindex_store(x, s, eh, 8, 0, 0, tok, BS, NULL, NULL);
        px_kvindex_remove(x, s, eh, 8);
    }
    px_kvindex_store(x, s, eh, 8, 0, 0, tok, BS, NULL, NULL);
    atomic_store(&stop, 1);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    assert_int_equal(matched(x, s, tok, 8 * BS), 8);
    px_kvindex_destroy(x);
}

/* Readers during growth: a writer grows the tables from empty to 50000
 * blocks (each growth a new table swapped in) while readers walk a prefix
 * stored first; they never see it shorter. */
typedef struct grd {
    px_kvindex *x;
    atomic_int *stop;
    size_t short_seen, walks;
} grd;

static void *grow_reader(void *arg) {
    grd *r = arg;
    uint32_t tok[8 * BS];
    prompt(9, 8, tok);
    while (!atomic_load(r->stop)) {
        px_kv_prompt p;
        px_kv_prompt_init(&p, tok, 8 * BS, 0);
        if (px_kvindex_match_prompt(r->x, 0, &p) != 8) r->short_seen++;
        px_kv_prompt_cleanup(&p);
        r->walks++;
    }
    return NULL;
}

static void test_readers_during_growth(void **state) {
    (void)state;
    px_kvindex *x = px_kvindex_create(100000, 1);
    int s = px_kvindex_slot(x, "a:1", 1);
    uint32_t tok[8 * BS];
    prompt(9, 8, tok);
    uint64_t eh[8];
    for (int i = 0; i < 8; i++)
        eh[i] = 1 + (uint64_t)i;
    assert_int_equal(px_kvindex_store(x, s, eh, 8, 0, 0, tok, BS, NULL, NULL), 8);
    atomic_int stop = 0;
    grd r[2] = {{x, &stop, 0, 0}, {x, &stop, 0, 0}};
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, grow_reader, &r[i]);
    uint32_t one[BS];
    for (uint32_t i = 0; i < 50000; i++) {
        uint64_t e = 100 + i;
        block_tokens(1000 + i, 0, one);
        px_kvindex_store(x, s, &e, 1, 0, 0, one, BS, NULL, NULL);
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    assert_int_equal(r[0].short_seen + r[1].short_seen, 0);
    assert_true(r[0].walks + r[1].walks > 0);
    px_kvindex_stats st;
    px_kvindex_stats_get(x, s, &st);
    assert_int_equal(st.blocks, 50008);
    px_kvindex_destroy(x);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chain_stable),
        cmocka_unit_test(test_store_match_remove),
        cmocka_unit_test(test_shared_key),
        cmocka_unit_test(test_bounds),
        cmocka_unit_test(test_churn),
        cmocka_unit_test(test_decode_layouts),
        cmocka_unit_test(test_decode_bytes_hash_lora),
        cmocka_unit_test(test_decode_hostile),
        cmocka_unit_test(test_concurrent_readers),
        cmocka_unit_test(test_bytes_bound),
        cmocka_unit_test(test_match_prompt),
        cmocka_unit_test(test_readers_during_growth),
        cmocka_unit_test(test_lora_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
