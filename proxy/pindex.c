/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/pindex.h"

#include <stdlib.h>

#include "base/hash.h"
#include "base/util.h"

/* Entries live in one array; `lru` threads them from most (head) to least
 * (tail) recently used, and each bucket of the hash table is a singly
 * linked chain through `chain`. Index 0 is the list's sentinel, so links
 * are 32-bit indexes and 0 means "none". */
typedef struct pix_entry {
    uint64_t key;
    uint32_t prev, next; /* LRU list */
    uint32_t chain;      /* next entry in the same bucket */
} pix_entry;

struct px_pindex {
    pix_entry *e; /* owned: [0] is the sentinel */
    uint32_t *bucket;
    size_t cap, n, nbuckets;
};

px_pindex *px_pindex_create(size_t capacity) {
    if (capacity < 1) capacity = 1;
    if (capacity > 0x7fffffff) capacity = 0x7fffffff;
    px_pindex *x = px_xcalloc(1, sizeof *x);
    x->cap = capacity;
    x->e = px_xcalloc(capacity + 1, sizeof *x->e);
    x->nbuckets = 1;
    while (x->nbuckets < capacity)
        x->nbuckets <<= 1;
    x->bucket = px_xcalloc(x->nbuckets, sizeof *x->bucket);
    return x;
}

void px_pindex_destroy(px_pindex *x) {
    if (!x) return;
    free(x->e);
    free(x->bucket);
    free(x);
}

size_t px_pindex_hashes(const void *p, size_t n, uint64_t *out, size_t max) {
    const unsigned char *s = p;
    uint64_t h = 0;
    size_t k = 0;
    for (; k < max && (k + 1) * PX_PINDEX_BLOCK_BYTES <= n; k++) {
        h = px_mix64(h * 0x9e3779b97f4a7c15ull ^
                     px_hash64(s + k * PX_PINDEX_BLOCK_BYTES, PX_PINDEX_BLOCK_BYTES));
        out[k] = h;
    }
    return k;
}

static uint64_t pix_key(uint64_t backend_key, uint64_t h) {
    uint64_t k = px_mix64(backend_key ^ px_mix64(h));
    return k ? k : 1;
}

static uint32_t *pix_slot(px_pindex *x, uint64_t key) {
    return &x->bucket[key & (x->nbuckets - 1)];
}

static void pix_unlink(px_pindex *x, uint32_t i) {
    x->e[x->e[i].prev].next = x->e[i].next;
    x->e[x->e[i].next].prev = x->e[i].prev;
}

static void pix_push_front(px_pindex *x, uint32_t i) {
    x->e[i].prev = 0;
    x->e[i].next = x->e[0].next;
    x->e[x->e[0].next].prev = i;
    x->e[0].next = i;
}

static uint32_t pix_find(px_pindex *x, uint64_t key) {
    for (uint32_t i = *pix_slot(x, key); i; i = x->e[i].chain)
        if (x->e[i].key == key) return i;
    return 0;
}

size_t px_pindex_match(px_pindex *x, uint64_t backend_key, const uint64_t *hashes, size_t n) {
    size_t k = 0;
    for (; k < n; k++) {
        uint32_t i = pix_find(x, pix_key(backend_key, hashes[k]));
        if (!i) break;
        pix_unlink(x, i);
        pix_push_front(x, i);
    }
    return k;
}

void px_pindex_add(px_pindex *x, uint64_t backend_key, const uint64_t *hashes, size_t n) {
    for (size_t k = 0; k < n; k++) {
        uint64_t key = pix_key(backend_key, hashes[k]);
        uint32_t i = pix_find(x, key);
        if (i) {
            pix_unlink(x, i);
        } else {
            if (x->n < x->cap) {
                i = (uint32_t)++x->n;
            } else {
                /* Evict the least recently used: off the list and its chain. */
                i = x->e[0].prev;
                pix_unlink(x, i);
                uint32_t *pp = pix_slot(x, x->e[i].key);
                while (*pp != i)
                    pp = &x->e[*pp].chain;
                *pp = x->e[i].chain;
            }
            x->e[i].key = key;
            uint32_t *slot = pix_slot(x, key);
            x->e[i].chain = *slot;
            *slot = i;
        }
        pix_push_front(x, i);
    }
}
