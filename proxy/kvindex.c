/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/kvindex.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "base/hash.h"

/* Open addressing with linear probing over 16-byte cells (key and value
 * side by side: one cache line per probe); key 0 marks an empty cell, so
 * keys are never 0 (nz()). Grown at half full; when the byte bound refuses
 * the growth, filled up to three quarters before blocks are refused. */
typedef struct cell {
    uint64_t k, v;
} cell;

typedef struct table {
    cell *c;    /* owned */
    size_t cap; /* a power of two, or 0 */
    size_t n;
} table;

#define CELL_BYTES sizeof(cell)
#define MIN_CAP 64
#define WRITE_CHUNK 32 /* blocks applied per hold of the write lock */

static uint64_t nz(uint64_t k) {
    return k ? k : 0x9e3779b97f4a7c15ull;
}

static size_t home(uint64_t k, size_t m) {
    return (size_t)px_mix64(k) & m;
}

static size_t find(const table *t, uint64_t k) {
    size_t m = t->cap - 1, i = home(k, m);
    while (t->c[i].k && t->c[i].k != k)
        i = (i + 1) & m;
    return i;
}

static int tget(const table *t, uint64_t k, uint64_t *v) {
    if (!t->cap) return 0;
    const cell *c = &t->c[find(t, k)];
    if (!c->k) return 0;
    if (v) *v = c->v;
    return 1;
}

/* Tables of 2 MiB and more (a backend past ~65,000 blocks) are mapped
 * 2 MiB aligned and marked for transparent huge pages, which the common
 * THP setting "madvise" gives no other memory: a lookup's random cell then
 * costs a cache miss but no TLB miss (with 4 KiB pages nearly every probe
 * of a large table missed the TLB as well). Zero-filled; cells_free()
 * releases either kind. */
#define HUGE_BYTES ((size_t)2 << 20)
static cell *cells_alloc(size_t cap) {
    size_t bytes = cap * sizeof(cell);
    if (bytes < HUGE_BYTES) return calloc(cap, sizeof(cell));
    char *m = mmap(NULL, bytes + HUGE_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED) return NULL;
    char *p = (char *)(((uintptr_t)m + HUGE_BYTES - 1) & ~(uintptr_t)(HUGE_BYTES - 1));
    if (p > m) munmap(m, (size_t)(p - m));
    if (m + HUGE_BYTES > p) munmap(p + bytes, (size_t)(m + HUGE_BYTES - p));
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE); /* a hint: without THP, 4 KiB pages */
#endif
    return (cell *)p;
}

static void cells_free(cell *c, size_t cap) {
    if (c && cap * sizeof(cell) >= HUGE_BYTES)
        munmap(c, cap * sizeof(cell));
    else
        free(c);
}

/* A copy of t in a table of `cap` cells (t's cells fit at most half of
 * it). t is only read: the writer builds it while readers still use t. */
static int rehash(const table *t, size_t cap, table *out) {
    cell *c = cells_alloc(cap);
    if (!c) return -1;
    table nt = {c, cap, 0};
    size_t m = cap - 1;
    for (size_t i = 0; i < t->cap; i++) {
        if (i + 16 < t->cap && t->c[i + 16].k) __builtin_prefetch(&c[home(t->c[i + 16].k, m)], 1);
        if (t->c[i].k) {
            nt.c[find(&nt, t->c[i].k)] = t->c[i];
            nt.n++;
        }
    }
    *out = nt;
    return 0;
}

/* Sets k to v in a table with room for it. */
static void tset_at(table *t, size_t i, uint64_t k, uint64_t v) {
    if (!t->c[i].k) t->n++;
    t->c[i].k = k;
    t->c[i].v = v;
}

/* Removes the cell at i, shifting back the cells of its probe run so that
 * lookups need no tombstones. */
static void tdel_at(table *t, size_t i) {
    size_t m = t->cap - 1, j = i;
    t->c[i].k = 0;
    t->n--;
    for (;;) {
        j = (j + 1) & m;
        if (!t->c[j].k) return;
        size_t h = home(t->c[j].k, m);
        /* j's key may move to i when its home is not in (i, j] cyclically. */
        if ((j > i && (h <= i || h > j)) || (j < i && h <= i && h > j)) {
            t->c[i] = t->c[j];
            t->c[j].k = 0;
            i = j;
        }
    }
}

static void tfree(table *t) {
    cells_free(t->c, t->cap);
    memset(t, 0, sizeof *t);
}

typedef struct slot {
    char *name;        /* owned */
    pthread_mutex_t w; /* serializes writers; held across a whole event */
    pthread_rwlock_t mu; /* readers vs the writer's short in-place edits and table swaps */
    table eng;         /* engine block hash -> token key */
    table tok;         /* token key -> number of engine hashes naming it */
    atomic_size_t block_size;
    atomic_size_t blocks; /* tok.n, readable without the lock */
    atomic_size_t bytes;
} slot;

/* Backend names to slots: open addressing over slot numbers + 1, filled
 * under the index's mutex and read without it (cells only ever go from 0
 * to a published slot). */
struct px_kvindex {
    size_t max_blocks;
    size_t max_bytes; /* 0: no bound across backends */
    size_t max_slots;
    pthread_mutex_t mu; /* guards making slots */
    slot **s;           /* owned array of max_slots; filled in order, never moved */
    atomic_size_t ns;
    atomic_int *names; /* owned: name_cap cells */
    size_t name_cap;
    atomic_size_t bytes; /* sum of the slots' bytes */
    /* LoRA names seen in events (px_hash64, nz()): open addressing, cells
     * go from 0 to a hash once, under mu; read without it. */
    _Atomic uint64_t loras[2 * PX_KV_MAX_LORAS];
    size_t nloras;
};

/* The chained block key: the block's own hash (four independent
 * multiply-rotate lanes over its tokens taken two at a time as
 * little-endian 64-bit words, xxHash64's round, seeded with the extra
 * keys' hash), then one bijective mix with the parent's key. The chain
 * links blocks only through that last mix, so the hashes of a prompt's
 * blocks overlap in the CPU instead of waiting on one another. Word values
 * are built from the token values: keys agree whatever the host's byte
 * order. */
#define P1 0x9e3779b185ebca87ull
#define P2 0xc2b2ae3d27d4eb4full
#define P3 0x165667b19e3779f9ull
#define P4 0x85ebca77c2b2ae63ull

static inline uint64_t rotl(uint64_t x, int r) {
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t round64(uint64_t acc, uint64_t w) {
    return rotl(acc + w * P2, 31) * P1;
}

static inline uint64_t word(const uint32_t *t) {
    return (uint64_t)t[0] | (uint64_t)t[1] << 32;
}

static uint64_t block_hash(const uint32_t *tok, size_t n, uint64_t extra) {
    uint64_t seed = px_mix64(extra ^ P3);
    uint64_t a = seed + P1 + P2, b = seed + P2, c = seed, d = seed - P1;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a = round64(a, word(tok + i));
        b = round64(b, word(tok + i + 2));
        c = round64(c, word(tok + i + 4));
        d = round64(d, word(tok + i + 6));
    }
    uint64_t h = rotl(a, 1) + rotl(b, 7) + rotl(c, 12) + rotl(d, 18) + (uint64_t)n * P4;
    for (; i < n; i++)
        h = round64(h, (uint64_t)tok[i] + P3);
    return h;
}

uint64_t px_kv_chain(uint64_t parent, const uint32_t *tok, size_t n, uint64_t extra) {
    return nz(px_mix64(rotl(parent, 29) * P1 ^ block_hash(tok, n, extra)));
}

size_t px_kv_prompt_keys(const uint32_t *tok, size_t ntok, size_t block_size, uint64_t extra,
                         uint64_t *out, size_t cap) {
    return px_kv_salted_keys(tok, ntok, block_size, extra, 0, out, cap);
}

size_t px_kv_salted_keys(const uint32_t *tok, size_t ntok, size_t block_size, uint64_t extra,
                         uint64_t salt, uint64_t *out, size_t cap) {
    if (!block_size) return 0;
    size_t n = ntok / block_size;
    if (n > cap) n = cap;
    uint64_t prev = 0;
    for (size_t i = 0; i < n; i++)
        prev = out[i] = px_kv_chain(prev, tok + i * block_size, block_size,
                                    i ? extra : extra ^ salt);
    return n;
}

uint64_t px_kv_salt_key(const char *salt, size_t n) {
    /* Apart from any LoRA key (px_mix64 of a name's hash): another mix. */
    return n ? nz(px_mix64(px_hash64(salt, n) ^ 0x5a17c0de5a17c0deull)) : 0;
}

px_kvindex *px_kvindex_create_bounded(size_t max_blocks, size_t max_bytes, size_t max_backends) {
    px_kvindex *x = calloc(1, sizeof *x);
    if (!x) return NULL;
    if (!max_backends) max_backends = 1;
    x->name_cap = 16;
    while (x->name_cap < max_backends * 2)
        x->name_cap *= 2;
    x->s = calloc(max_backends, sizeof *x->s);
    x->names = calloc(x->name_cap, sizeof *x->names);
    if (!x->s || !x->names) {
        free(x->s);
        free(x->names);
        free(x);
        return NULL;
    }
    x->max_blocks = max_blocks;
    x->max_bytes = max_bytes;
    x->max_slots = max_backends;
    pthread_mutex_init(&x->mu, NULL);
    return x;
}

px_kvindex *px_kvindex_create(size_t max_blocks, size_t max_backends) {
    return px_kvindex_create_bounded(max_blocks, 0, max_backends);
}

void px_kvindex_destroy(px_kvindex *x) {
    if (!x) return;
    size_t n = atomic_load(&x->ns);
    for (size_t i = 0; i < n; i++) {
        slot *s = x->s[i];
        tfree(&s->eng);
        tfree(&s->tok);
        pthread_rwlock_destroy(&s->mu);
        pthread_mutex_destroy(&s->w);
        free(s->name);
        free(s);
    }
    free(x->s);
    free(x->names);
    pthread_mutex_destroy(&x->mu);
    free(x);
}

/* The name cell holding `name`, or the empty cell where it would go. */
static size_t name_cell(px_kvindex *x, const char *name, int *found) {
    size_t m = x->name_cap - 1, i = (size_t)px_mix64(px_hash64(name, strlen(name))) & m;
    for (;;) {
        int v = atomic_load_explicit(&x->names[i], memory_order_acquire);
        if (!v) break;
        if (!strcmp(x->s[v - 1]->name, name)) {
            *found = v - 1;
            return i;
        }
        i = (i + 1) & m;
    }
    *found = -1;
    return i;
}

int px_kvindex_slot(px_kvindex *x, const char *name, int create) {
    if (!x || !name) return -1;
    int r;
    name_cell(x, name, &r);
    if (r >= 0 || !create) return r;
    pthread_mutex_lock(&x->mu);
    size_t at = name_cell(x, name, &r), n = atomic_load(&x->ns);
    if (r < 0 && n < x->max_slots) {
        slot *s = calloc(1, sizeof *s);
        if (s && (s->name = strdup(name))) {
            pthread_rwlock_init(&s->mu, NULL);
            pthread_mutex_init(&s->w, NULL);
            x->s[n] = s;
            atomic_store(&x->ns, n + 1);
            /* publishes the filled slot to name lookups */
            atomic_store_explicit(&x->names[at], (int)n + 1, memory_order_release);
            r = (int)n;
        } else {
            free(s);
        }
    }
    pthread_mutex_unlock(&x->mu);
    return r;
}

static slot *get(px_kvindex *x, int i) {
    if (!x || i < 0 || (size_t)i >= atomic_load(&x->ns)) return NULL;
    return x->s[i];
}

static size_t slot_bytes(const slot *s) {
    return (s->eng.cap + s->tok.cap) * CELL_BYTES;
}

/* Under s->w: publishes the slot's counts and its bytes into the total. */
static void account(px_kvindex *x, slot *s) {
    size_t was = atomic_load(&s->bytes), now = slot_bytes(s);
    atomic_store(&s->blocks, s->tok.n);
    atomic_store(&s->bytes, now);
    if (now >= was)
        atomic_fetch_add(&x->bytes, now - was);
    else
        atomic_fetch_sub(&x->bytes, was - now);
}

/* Under s->w: makes room for `more` keys in t. The new table is built
 * without the read lock (readers keep using the old one) and swapped in
 * under it, so readers never wait on a rehash. Growth that would pass the
 * byte bound is refused; the table then fills to three quarters. 0: room
 * made; -1: full (bound or memory). */
static int reserve(px_kvindex *x, slot *s, table *t, size_t more) {
    size_t need = t->n + more;
    if (t->cap && need * 2 <= t->cap) return 0;
    size_t cap = t->cap ? t->cap : MIN_CAP;
    while (need * 2 > cap)
        cap *= 2;
    size_t delta = (cap - t->cap) * CELL_BYTES;
    int over = x->max_bytes && atomic_load(&x->bytes) + delta > x->max_bytes;
    table nt;
    if (over || rehash(t, cap, &nt) < 0) return t->cap && need * 4 <= t->cap * 3 ? 0 : -1;
    pthread_rwlock_wrlock(&s->mu);
    table old = *t;
    *t = nt;
    account(x, s);
    pthread_rwlock_unlock(&s->mu);
    tfree(&old);
    return 0;
}

size_t px_kvindex_store(px_kvindex *x, int si, const uint64_t *eh, size_t n, int has_parent,
                        uint64_t parent, const uint32_t *tok, size_t block_size,
                        const uint64_t *extra, size_t *refused) {
    slot *s = get(x, si);
    if (!s || !block_size) return 0;
    size_t added = 0, i = 0;
    pthread_mutex_lock(&s->w);
    atomic_store(&s->block_size, block_size);
    uint64_t prev = 0;
    if (has_parent && !tget(&s->eng, nz(parent), &prev)) goto out; /* parent unknown */
    while (i < n) {
        size_t end = n - i > WRITE_CHUNK ? i + WRITE_CHUNK : n;
        size_t room = s->tok.n < x->max_blocks ? x->max_blocks - s->tok.n : 0;
        if (room > end - i) room = end - i;
        /* Room in both tables before the lock: growth happens outside it.
         * Where the byte bound refuses it, the checks below stop at the
         * first block that does not fit. */
        reserve(x, s, &s->eng, end - i);
        if (room) reserve(x, s, &s->tok, room);
        if (!s->eng.cap || !s->tok.cap) {
            if (refused) *refused += n - i;
            break;
        }
        /* Keys first, without the lock (this writer is the only one): the
         * cells of the chunk are fetched ahead, so its cache misses
         * overlap instead of following one another. */
        uint64_t keys[WRITE_CHUNK];
        size_t start = i, em = s->eng.cap - 1, tm = s->tok.cap - 1;
        for (size_t j = i; j < end; j++)
            __builtin_prefetch(&s->eng.c[home(nz(eh[j]), em)]);
        for (size_t j = i; j < end; j++) {
            uint64_t v;
            if (!tget(&s->eng, nz(eh[j]), &v)) /* else stored again: keep the first */
                v = px_kv_chain(prev, tok + j * block_size, block_size, extra ? extra[j] : 0);
            keys[j - start] = prev = v;
            __builtin_prefetch(&s->tok.c[home(v, tm)], 1);
        }
        pthread_rwlock_wrlock(&s->mu);
        for (; i < end; i++) {
            uint64_t e = nz(eh[i]), key = keys[i - start];
            size_t at = find(&s->eng, e);
            if (s->eng.c[at].k) continue; /* stored again (or twice in this chunk) */
            size_t kt = find(&s->tok, key);
            int have = s->tok.c[kt].k != 0;
            if ((s->eng.n + 1) * 4 > s->eng.cap * 3 ||
                (!have && (s->tok.n >= x->max_blocks || (s->tok.n + 1) * 4 > s->tok.cap * 3)))
                break;
            tset_at(&s->eng, at, e, key);
            tset_at(&s->tok, kt, key, have ? s->tok.c[kt].v + 1 : 1);
            if (!have) added++;
        }
        pthread_rwlock_unlock(&s->mu);
        if (i < end) {
            /* Bound reached: the chain stops here (children cannot chain). */
            if (refused) *refused += n - i;
            break;
        }
    }
out:
    account(x, s);
    pthread_mutex_unlock(&s->w);
    return added;
}

size_t px_kvindex_remove(px_kvindex *x, int si, const uint64_t *eh, size_t n) {
    slot *s = get(x, si);
    if (!s) return 0;
    size_t removed = 0;
    pthread_mutex_lock(&s->w);
    for (size_t i = 0; i < n && s->eng.cap;) {
        size_t end = n - i > WRITE_CHUNK ? i + WRITE_CHUNK : n;
        pthread_rwlock_wrlock(&s->mu);
        for (; i < end; i++) {
            size_t at = find(&s->eng, nz(eh[i]));
            if (!s->eng.c[at].k) continue;
            uint64_t key = s->eng.c[at].v;
            tdel_at(&s->eng, at);
            size_t t = find(&s->tok, key);
            if (!s->tok.c[t].k) continue;
            if (s->tok.c[t].v > 1) {
                s->tok.c[t].v--;
            } else {
                tdel_at(&s->tok, t);
                removed++;
            }
        }
        pthread_rwlock_unlock(&s->mu);
    }
    atomic_store(&s->blocks, s->tok.n);
    pthread_mutex_unlock(&s->w);
    return removed;
}

void px_kvindex_clear(px_kvindex *x, int si) {
    slot *s = get(x, si);
    if (!s) return;
    pthread_mutex_lock(&s->w);
    pthread_rwlock_wrlock(&s->mu);
    table e = s->eng, t = s->tok;
    memset(&s->eng, 0, sizeof s->eng);
    memset(&s->tok, 0, sizeof s->tok);
    account(x, s);
    pthread_rwlock_unlock(&s->mu);
    pthread_mutex_unlock(&s->w);
    tfree(&e);
    tfree(&t);
}

/* Longest run of keys[0..n) in t; the cells of the next keys are fetched
 * ahead, so the misses of one prompt's walk overlap. Under s->mu. */
#define AHEAD 8
static size_t walk(const table *t, const uint64_t *keys, size_t n) {
    if (!t->cap) return 0;
    size_t m = t->cap - 1, i = 0;
    for (size_t j = 0; j < n && j < AHEAD; j++)
        __builtin_prefetch(&t->c[home(keys[j], m)]);
    for (; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&t->c[home(keys[i + AHEAD], m)]);
        if (!t->c[find(t, keys[i])].k) break;
    }
    return i;
}

size_t px_kvindex_match(px_kvindex *x, int si, const uint64_t *keys, size_t n) {
    slot *s = get(x, si);
    if (!s || !n || !atomic_load_explicit(&s->blocks, memory_order_relaxed)) return 0;
    pthread_rwlock_rdlock(&s->mu);
    size_t i = walk(&s->tok, keys, n);
    pthread_rwlock_unlock(&s->mu);
    return i;
}

void px_kv_prompt_init(px_kv_prompt *p, const uint32_t *tok, size_t ntok, uint64_t extra) {
    memset(p, 0, offsetof(px_kv_prompt, local));
    p->tok = tok;
    p->ntok = ntok;
    p->extra = extra;
    p->keys = p->local;
    p->cap = sizeof p->local / sizeof *p->local;
}

void px_kv_prompt_cleanup(px_kv_prompt *p) {
    if (p->keys != p->local) free(p->keys);
    p->keys = p->local;
}

/* Computes keys up to at least `want` (at most the prompt's full blocks).
 * Returns how many are computed. */
static size_t prompt_extend(px_kv_prompt *p, size_t want) {
    size_t total = p->ntok / p->bs;
    if (want > total) want = total;
    if (want > p->cap) {
        uint64_t *k = malloc(total * sizeof *k);
        if (!k) return p->n; /* matches stop early; never wrong */
        memcpy(k, p->keys, p->n * sizeof *k);
        if (p->keys != p->local) free(p->keys);
        p->keys = k;
        p->cap = total;
    }
    uint64_t prev = p->n ? p->keys[p->n - 1] : 0;
    for (; p->n < want; p->n++)
        prev = p->keys[p->n] = px_kv_chain(prev, p->tok + p->n * p->bs, p->bs,
                                           p->n ? p->extra : p->extra ^ p->salt);
    return p->n;
}

size_t px_kvindex_match_prompt(px_kvindex *x, int si, px_kv_prompt *p) {
    slot *s = get(x, si);
    size_t bs = s ? atomic_load(&s->block_size) : 0;
    if (!bs) return 0;
    if (bs != p->bs) {
        p->bs = bs;
        p->n = 0;
    }
    if (!prompt_extend(p, 32) || !atomic_load_explicit(&s->blocks, memory_order_relaxed)) return 0;
    size_t i = 0;
    pthread_rwlock_rdlock(&s->mu);
    /* Keys in steps of 32 blocks: at most 31 hashed past the longest match. */
    while (s->tok.cap) {
        size_t m = walk(&s->tok, p->keys + i, p->n - i);
        i += m;
        if (i < p->n) break; /* a miss */
        size_t had = p->n;
        if (prompt_extend(p, had + 32) == had) break; /* all matched */
    }
    pthread_rwlock_unlock(&s->mu);
    return i;
}

static size_t lora_cell(px_kvindex *x, uint64_t h, int *found) {
    size_t m = 2 * PX_KV_MAX_LORAS - 1, i = home(h, m);
    uint64_t v;
    while ((v = atomic_load_explicit(&x->loras[i], memory_order_acquire)) && v != h)
        i = (i + 1) & m;
    *found = v == h;
    return i;
}

void px_kvindex_lora_seen(px_kvindex *x, uint64_t lora_hash) {
    if (!x || !lora_hash) return;
    uint64_t h = nz(lora_hash);
    int found;
    lora_cell(x, h, &found);
    if (found) return;
    pthread_mutex_lock(&x->mu);
    size_t at = lora_cell(x, h, &found);
    if (!found && x->nloras < PX_KV_MAX_LORAS) {
        atomic_store_explicit(&x->loras[at], h, memory_order_release);
        x->nloras++;
    }
    pthread_mutex_unlock(&x->mu);
}

uint64_t px_kvindex_request_extra(px_kvindex *x, const char *model, size_t n) {
    if (!x || !model || !n) return 0;
    uint64_t h = px_hash64(model, n);
    int found;
    lora_cell(x, nz(h), &found);
    /* As the decoder keys a block of lora_name h without extra keys. */
    return found ? px_mix64(h) : 0;
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
    for (size_t i = 0; i < n; i++)
        st->blocks += atomic_load(&x->s[i]->blocks);
    st->bytes = atomic_load(&x->bytes);
}
