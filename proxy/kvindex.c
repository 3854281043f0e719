/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/kvindex.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"

/* Open addressing with linear probing; key 0 marks an empty cell, so keys
 * are never 0 (nz()). 16 bytes a cell, at most half full. */
typedef struct table {
    uint64_t *k; /* owned */
    uint64_t *v; /* owned */
    size_t cap;  /* a power of two, or 0 */
    size_t n;
} table;

static uint64_t nz(uint64_t k) {
    return k ? k : 0x9e3779b97f4a7c15ull;
}

static size_t find(const table *t, uint64_t k) {
    size_t m = t->cap - 1, i = (size_t)px_mix64(k) & m;
    while (t->k[i] && t->k[i] != k)
        i = (i + 1) & m;
    return i;
}

static int tget(const table *t, uint64_t k, uint64_t *v) {
    if (!t->cap) return 0;
    size_t i = find(t, k);
    if (!t->k[i]) return 0;
    if (v) *v = t->v[i];
    return 1;
}

static int grow(table *t) {
    size_t cap = t->cap ? t->cap * 2 : 64;
    uint64_t *k = calloc(cap, sizeof *k), *v = calloc(cap, sizeof *v);
    if (!k || !v) {
        free(k);
        free(v);
        return -1;
    }
    table nt = {k, v, cap, 0};
    for (size_t i = 0; i < t->cap; i++)
        if (t->k[i]) {
            size_t j = find(&nt, t->k[i]);
            nt.k[j] = t->k[i];
            nt.v[j] = t->v[i];
            nt.n++;
        }
    free(t->k);
    free(t->v);
    *t = nt;
    return 0;
}

/* Sets k to v (adding it). -1 when out of memory. */
static int tput(table *t, uint64_t k, uint64_t v) {
    if ((t->n + 1) * 2 > t->cap && grow(t) < 0) return -1;
    size_t i = find(t, k);
    if (!t->k[i]) t->n++;
    t->k[i] = k;
    t->v[i] = v;
    return 0;
}

/* Removes the cell at i, shifting back the cells of its probe run so that
 * lookups need no tombstones. */
static void tdel_at(table *t, size_t i) {
    size_t m = t->cap - 1, j = i;
    t->k[i] = 0;
    t->n--;
    for (;;) {
        j = (j + 1) & m;
        if (!t->k[j]) return;
        size_t home = (size_t)px_mix64(t->k[j]) & m;
        /* j's key may move to i when its home is not in (i, j] cyclically. */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            t->k[i] = t->k[j];
            t->v[i] = t->v[j];
            t->k[j] = 0;
            i = j;
        }
    }
}

static void tfree(table *t) {
    free(t->k);
    free(t->v);
    memset(t, 0, sizeof *t);
}

typedef struct slot {
    char *name; /* owned */
    pthread_rwlock_t mu;
    table eng; /* engine block hash -> token key */
    table tok; /* token key -> number of engine hashes naming it */
    atomic_size_t block_size;
    atomic_size_t blocks; /* tok.n, readable without the lock */
    atomic_size_t bytes;
} slot;

struct px_kvindex {
    size_t max_blocks;
    size_t max_slots;
    pthread_mutex_t mu; /* guards making slots */
    slot **s;           /* owned array of max_slots; filled in order, never moved */
    atomic_size_t ns;
};

uint64_t px_kv_chain(uint64_t parent, const uint32_t *tok, size_t n, uint64_t extra) {
    /* Little-endian bytes whatever the host, so keys agree across machines. */
    uint64_t h = px_hash64_seed(NULL, 0, parent ^ px_mix64(extra));
    unsigned char b[256];
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t t = tok[i];
        b[k++] = (unsigned char)t;
        b[k++] = (unsigned char)(t >> 8);
        b[k++] = (unsigned char)(t >> 16);
        b[k++] = (unsigned char)(t >> 24);
        if (k == sizeof b) {
            h = px_hash64_more(h, b, k);
            k = 0;
        }
    }
    h = px_hash64_more(h, b, k);
    return nz(px_mix64(h));
}

size_t px_kv_prompt_keys(const uint32_t *tok, size_t ntok, size_t block_size, uint64_t extra,
                         uint64_t *out, size_t cap) {
    if (!block_size) return 0;
    size_t n = ntok / block_size;
    if (n > cap) n = cap;
    uint64_t prev = 0;
    for (size_t i = 0; i < n; i++)
        prev = out[i] = px_kv_chain(prev, tok + i * block_size, block_size, extra);
    return n;
}

px_kvindex *px_kvindex_create(size_t max_blocks, size_t max_backends) {
    px_kvindex *x = calloc(1, sizeof *x);
    if (!x) return NULL;
    x->s = calloc(max_backends ? max_backends : 1, sizeof *x->s);
    if (!x->s) {
        free(x);
        return NULL;
    }
    x->max_blocks = max_blocks;
    x->max_slots = max_backends;
    pthread_mutex_init(&x->mu, NULL);
    return x;
}

void px_kvindex_destroy(px_kvindex *x) {
    if (!x) return;
    size_t n = atomic_load(&x->ns);
    for (size_t i = 0; i < n; i++) {
        slot *s = x->s[i];
        tfree(&s->eng);
        tfree(&s->tok);
        pthread_rwlock_destroy(&s->mu);
        free(s->name);
        free(s);
    }
    free(x->s);
    pthread_mutex_destroy(&x->mu);
    free(x);
}

int px_kvindex_slot(px_kvindex *x, const char *name, int create) {
    size_t n = atomic_load(&x->ns);
    for (size_t i = 0; i < n; i++)
        if (!strcmp(x->s[i]->name, name)) return (int)i;
    if (!create) return -1;
    pthread_mutex_lock(&x->mu);
    int r = -1;
    n = atomic_load(&x->ns);
    for (size_t i = 0; i < n && r < 0; i++)
        if (!strcmp(x->s[i]->name, name)) r = (int)i;
    if (r < 0 && n < x->max_slots) {
        slot *s = calloc(1, sizeof *s);
        if (s && (s->name = strdup(name))) {
            pthread_rwlock_init(&s->mu, NULL);
            x->s[n] = s;
            atomic_store(&x->ns, n + 1); /* publishes the filled slot */
            r = (int)n;
        } else {
            free(s);
        }
    }
    pthread_mutex_unlock(&x->mu);
    return r;
}

static slot *get(px_kvindex *x, int i) {
    if (i < 0 || (size_t)i >= atomic_load(&x->ns)) return NULL;
    return x->s[i];
}

static void account(slot *s) {
    atomic_store(&s->blocks, s->tok.n);
    atomic_store(&s->bytes, (s->eng.cap + s->tok.cap) * 2 * sizeof(uint64_t));
}

size_t px_kvindex_store(px_kvindex *x, int si, const uint64_t *eh, size_t n, int has_parent,
                        uint64_t parent, const uint32_t *tok, size_t block_size,
                        const uint64_t *extra, size_t *refused) {
    slot *s = get(x, si);
    if (!s || !block_size) return 0;
    size_t added = 0;
    pthread_rwlock_wrlock(&s->mu);
    atomic_store(&s->block_size, block_size);
    uint64_t prev = 0;
    if (has_parent && !tget(&s->eng, nz(parent), &prev)) goto out; /* parent unknown */
    for (size_t i = 0; i < n; i++) {
        uint64_t e = nz(eh[i]), key, cnt;
        if (tget(&s->eng, e, &key)) { /* stored again: keep the first */
            prev = key;
            continue;
        }
        key = px_kv_chain(prev, tok + i * block_size, block_size, extra ? extra[i] : 0);
        int have = tget(&s->tok, key, &cnt);
        if (!have && s->tok.n >= x->max_blocks) {
            if (refused) *refused += n - i;
            break; /* its children could not chain to it */
        }
        if (tput(&s->eng, e, key) < 0) {
            if (refused) *refused += n - i;
            break;
        }
        if (tput(&s->tok, key, have ? cnt + 1 : 1) < 0) {
            tdel_at(&s->eng, find(&s->eng, e));
            if (refused) *refused += n - i;
            break;
        }
        if (!have) added++;
        prev = key;
    }
out:
    account(s);
    pthread_rwlock_unlock(&s->mu);
    return added;
}

size_t px_kvindex_remove(px_kvindex *x, int si, const uint64_t *eh, size_t n) {
    slot *s = get(x, si);
    if (!s) return 0;
    size_t removed = 0;
    pthread_rwlock_wrlock(&s->mu);
    for (size_t i = 0; i < n && s->eng.cap; i++) {
        size_t at = find(&s->eng, nz(eh[i]));
        if (!s->eng.k[at]) continue;
        uint64_t key = s->eng.v[at];
        tdel_at(&s->eng, at);
        size_t t = find(&s->tok, key);
        if (!s->tok.k[t]) continue;
        if (s->tok.v[t] > 1) {
            s->tok.v[t]--;
        } else {
            tdel_at(&s->tok, t);
            removed++;
        }
    }
    account(s);
    pthread_rwlock_unlock(&s->mu);
    return removed;
}

void px_kvindex_clear(px_kvindex *x, int si) {
    slot *s = get(x, si);
    if (!s) return;
    pthread_rwlock_wrlock(&s->mu);
    tfree(&s->eng);
    tfree(&s->tok);
    account(s);
    pthread_rwlock_unlock(&s->mu);
}

size_t px_kvindex_match(px_kvindex *x, int si, const uint64_t *keys, size_t n) {
    slot *s = get(x, si);
    if (!s || !atomic_load(&s->blocks)) return 0;
    size_t i = 0;
    pthread_rwlock_rdlock(&s->mu);
    while (i < n && tget(&s->tok, keys[i], NULL))
        i++;
    pthread_rwlock_unlock(&s->mu);
    return i;
}

size_t px_kvindex_block_size(px_kvindex *x, int si) {
    slot *s = get(x, si);
    return s ? atomic_load(&s->block_size) : 0;
}

void px_kvindex_stats_get(px_kvindex *x, int si, px_kvindex_stats *st) {
    memset(st, 0, sizeof *st);
    slot *s = get(x, si);
    if (!s) return;
    st->blocks = atomic_load(&s->blocks);
    st->bytes = atomic_load(&s->bytes);
    st->block_size = atomic_load(&s->block_size);
}

void px_kvindex_totals(px_kvindex *x, px_kvindex_stats *st) {
    memset(st, 0, sizeof *st);
    size_t n = atomic_load(&x->ns);
    for (size_t i = 0; i < n; i++) {
        st->blocks += atomic_load(&x->s[i]->blocks);
        st->bytes += atomic_load(&x->s[i]->bytes);
    }
}
