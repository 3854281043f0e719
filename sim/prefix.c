/* SPDX-License-Identifier: Apache-2.0 */
#include "sim/prefix.h"

#include <stdlib.h>
#include <string.h>

#include "base/util.h"

#define NIL SIZE_MAX

typedef struct pentry {
    uint64_t hash;
    size_t prev, next; /* LRU list: head is the most recently used */
} pentry;

struct sim_prefix {
    size_t cap, block_tokens, n;
    pentry *e;     /* cap entries; unused ones chained by next from free_head */
    size_t *index; /* open addressing, linear probing: entry + 1, 0 empty */
    size_t mask;
    size_t head, tail, free_head;
    sim_prefix_obs obs;
};

static size_t slot_of(const sim_prefix *p, uint64_t h) {
    return (size_t)(h ^ (h >> 29)) & p->mask;
}

/* The index slot holding hash h, or the empty slot where it would go. */
static size_t find_slot(const sim_prefix *p, uint64_t h) {
    size_t s = slot_of(p, h);
    while (p->index[s] && p->e[p->index[s] - 1].hash != h)
        s = (s + 1) & p->mask;
    return s;
}

/* Empties slot s, shifting back the entries probed past it. */
static void index_remove(sim_prefix *p, size_t s) {
    size_t j = s;
    p->index[s] = 0;
    for (;;) {
        j = (j + 1) & p->mask;
        if (!p->index[j]) return;
        size_t home = slot_of(p, p->e[p->index[j] - 1].hash);
        /* Move j back to s unless its home lies cyclically in (s, j]. */
        int stays = s <= j ? (home > s && home <= j) : (home > s || home <= j);
        if (!stays) {
            p->index[s] = p->index[j];
            p->index[j] = 0;
            s = j;
        }
    }
}

static void lru_unlink(sim_prefix *p, size_t i) {
    pentry *x = &p->e[i];
    if (x->prev != NIL)
        p->e[x->prev].next = x->next;
    else
        p->head = x->next;
    if (x->next != NIL)
        p->e[x->next].prev = x->prev;
    else
        p->tail = x->prev;
}

static void lru_push_front(sim_prefix *p, size_t i) {
    p->e[i].prev = NIL;
    p->e[i].next = p->head;
    if (p->head != NIL) p->e[p->head].prev = i;
    p->head = i;
    if (p->tail == NIL) p->tail = i;
}

static void touch(sim_prefix *p, size_t i) {
    if (p->head == i) return;
    lru_unlink(p, i);
    lru_push_front(p, i);
}

static void reset(sim_prefix *p) {
    memset(p->index, 0, (p->mask + 1) * sizeof *p->index);
    for (size_t i = 0; i < p->cap; i++)
        p->e[i].next = i + 1 < p->cap ? i + 1 : NIL;
    p->free_head = 0;
    p->head = p->tail = NIL;
    p->n = 0;
}

sim_prefix *sim_prefix_new(size_t cap, size_t block_tokens, const sim_prefix_obs *obs) {
    sim_prefix *p = px_xcalloc(1, sizeof *p);
    p->cap = cap ? cap : 1;
    p->block_tokens = block_tokens;
    size_t slots = 2;
    while (slots < p->cap * 2)
        slots <<= 1;
    p->mask = slots - 1;
    p->e = px_xmalloc(p->cap * sizeof *p->e);
    p->index = px_xmalloc(slots * sizeof *p->index);
    if (obs) p->obs = *obs;
    reset(p);
    return p;
}

void sim_prefix_free(sim_prefix *p) {
    if (!p) return;
    free(p->e);
    free(p->index);
    free(p);
}

size_t sim_prefix_match(sim_prefix *p, const uint64_t *ph, size_t n) {
    size_t b = 0;
    for (; b < n; b++) {
        size_t s = find_slot(p, ph[b]);
        if (!p->index[s]) break;
        touch(p, p->index[s] - 1);
    }
    return b;
}

/* A free entry, evicting the least recently used one when full. */
static size_t take_entry(sim_prefix *p) {
    if (p->free_head != NIL) {
        size_t i = p->free_head;
        p->free_head = p->e[i].next;
        p->n++;
        return i;
    }
    size_t i = p->tail;
    uint64_t h = p->e[i].hash;
    lru_unlink(p, i);
    index_remove(p, find_slot(p, h));
    if (p->obs.removed) p->obs.removed(p->obs.ctx, h);
    return i;
}

void sim_prefix_insert(sim_prefix *p, const uint64_t *ph, const uint32_t *tok, size_t n) {
    if (n > p->cap) n = p->cap; /* the rest could only evict this prompt's own blocks */
    size_t run = NIL;           /* first block of the run of new blocks */
    for (size_t b = 0; b <= n; b++) {
        size_t s = b < n ? find_slot(p, ph[b]) : 0;
        int have = b < n && p->index[s];
        if ((b == n || have) && run != NIL) {
            if (p->obs.stored)
                p->obs.stored(p->obs.ctx, ph + run, b - run, run > 0, run > 0 ? ph[run - 1] : 0,
                              tok + run * p->block_tokens, (b - run) * p->block_tokens);
            run = NIL;
        }
        if (b == n) break;
        if (have) {
            touch(p, p->index[s] - 1);
            continue;
        }
        size_t i = take_entry(p);
        s = find_slot(p, ph[b]); /* an eviction may have moved the slot */
        p->e[i].hash = ph[b];
        p->index[s] = i + 1;
        lru_push_front(p, i);
        if (run == NIL) run = b;
    }
}

size_t sim_prefix_clear(sim_prefix *p) {
    size_t n = p->n;
    reset(p);
    return n;
}

size_t sim_prefix_size(const sim_prefix *p) {
    return p->n;
}
