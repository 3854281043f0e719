/* SPDX-License-Identifier: Apache-2.0 */
/* engine-sim's prefix cache (sim/prefix.c) against a plain reference model:
 * the same LRU order, the same evictions and stored runs reported, and its
 * hash index intact through many evictions (backward-shift deletion). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "sim/prefix.h"

#define BT 2

/* What the observer saw, one line per event. */
static void on_stored(void *ctx, const uint64_t *h, size_t n, int has_parent, uint64_t parent,
                      const uint32_t *tok, size_t ntok)
{
    px_buf *log = ctx;
    assert_int_equal(ntok, n * BT);
    px_buf_printf(log, "S");
    for (size_t i = 0; i < n; i++) {
        px_buf_printf(log, " %llu", (unsigned long long)h[i]);
        assert_int_equal(tok[i * BT], (uint32_t)h[i]); /* the block's own tokens */
    }
    if (has_parent)
        px_buf_printf(log, " <%llu", (unsigned long long)parent);
    px_buf_printf(log, "\n");
}

static void on_removed(void *ctx, uint64_t h)
{
    px_buf_printf(ctx, "R %llu\n", (unsigned long long)h);
}

/* The reference: entries with a use clock, searched linearly. */
typedef struct model {
    size_t cap, n;
    uint64_t h[64], used[64], clock;
    px_buf log;
} model;

static int m_find(model *m, uint64_t h)
{
    for (size_t i = 0; i < m->n; i++)
        if (m->h[i] == h)
            return (int)i;
    return -1;
}

static size_t m_match(model *m, const uint64_t *ph, size_t n)
{
    size_t b = 0;
    for (int i; b < n && (i = m_find(m, ph[b])) >= 0; b++)
        m->used[i] = ++m->clock;
    return b;
}

static void m_insert(model *m, const uint64_t *ph, size_t n)
{
    if (n > m->cap)
        n = m->cap;
    size_t run = SIZE_MAX;
    for (size_t b = 0; b <= n; b++) {
        int i = b < n ? m_find(m, ph[b]) : -1;
        if ((b == n || i >= 0) && run != SIZE_MAX) {
            px_buf_printf(&m->log, "S");
            for (size_t k = run; k < b; k++)
                px_buf_printf(&m->log, " %llu", (unsigned long long)ph[k]);
            if (run > 0)
                px_buf_printf(&m->log, " <%llu", (unsigned long long)ph[run - 1]);
            px_buf_printf(&m->log, "\n");
            run = SIZE_MAX;
        }
        if (b == n)
            break;
        if (i >= 0) {
            m->used[i] = ++m->clock;
            continue;
        }
        if (m->n == m->cap) {
            size_t lru = 0;
            for (size_t k = 1; k < m->n; k++)
                if (m->used[k] < m->used[lru])
                    lru = k;
            px_buf_printf(&m->log, "R %llu\n", (unsigned long long)m->h[lru]);
            m->h[lru] = m->h[--m->n];
            m->used[lru] = m->used[m->n];
        }
        m->h[m->n] = ph[b];
        m->used[m->n++] = ++m->clock;
        if (run == SIZE_MAX)
            run = b;
    }
}

/* A prompt of n blocks: block b's "hash" is a small id (so that collisions
 * in the index and shared prefixes are frequent); tokens carry it. */
static void prompt(uint64_t *ph, uint32_t *tok, size_t n, unsigned seed)
{
    for (size_t b = 0; b < n; b++) {
        ph[b] = b < 2 ? (seed % 3) * 100 + b + 1 : (uint64_t)(rand() % 40) + 1000 * (b + 1);
        tok[b * BT] = tok[b * BT + 1] = (uint32_t)ph[b];
    }
}

static void test_against_model(void **state)
{
    (void)state;
    for (size_t cap = 1; cap <= 24; cap += 5) {
        px_buf log;
        px_buf_init(&log);
        model m = {.cap = cap};
        px_buf_init(&m.log);
        sim_prefix_obs obs = {.stored = on_stored, .removed = on_removed, .ctx = &log};
        sim_prefix *p = sim_prefix_new(cap, BT, &obs);
        srand((unsigned)cap);
        for (int op = 0; op < 3000; op++) {
            uint64_t ph[32];
            uint32_t tok[64];
            size_t n = (size_t)(rand() % 8);
            prompt(ph, tok, n, (unsigned)rand());
            if (rand() % 3 == 0) {
                assert_int_equal(sim_prefix_match(p, ph, n), m_match(&m, ph, n));
            } else {
                sim_prefix_insert(p, ph, tok, n);
                m_insert(&m, ph, n);
            }
            assert_int_equal(sim_prefix_size(p), m.n);
        }
        assert_int_equal(log.len, m.log.len);
        assert_memory_equal(log.data, m.log.data, log.len);
        /* Everything the model holds is found, and nothing else. */
        for (size_t i = 0; i < m.n; i++)
            assert_int_equal(sim_prefix_match(p, &m.h[i], 1), 1);
        uint64_t absent = 999999;
        assert_int_equal(sim_prefix_match(p, &absent, 1), 0);
        assert_int_equal(sim_prefix_clear(p), m.n);
        assert_int_equal(sim_prefix_size(p), 0);
        if (m.n)
            assert_int_equal(sim_prefix_match(p, &m.h[0], 1), 0);
        sim_prefix_free(p);
        px_buf_cleanup(&log);
        px_buf_cleanup(&m.log);
    }
}

/* The exact events of a small scenario: a run, a shared prefix, eviction
 * of the least recently used, a chain whose parent was evicted. */
static void test_scenario(void **state)
{
    (void)state;
    px_buf log;
    px_buf_init(&log);
    sim_prefix_obs obs = {.stored = on_stored, .removed = on_removed, .ctx = &log};
    sim_prefix *p = sim_prefix_new(3, BT, &obs);
    uint64_t a[] = {1, 2}, b[] = {1, 3}, c[] = {4, 5};
    uint32_t ta[] = {1, 1, 2, 2}, tb[] = {1, 1, 3, 3}, tc[] = {4, 4, 5, 5};
    sim_prefix_insert(p, a, ta, 2);
    sim_prefix_insert(p, b, tb, 2);
    assert_int_equal(sim_prefix_match(p, a, 2), 2); /* 1, 2 now newer than 3 */
    sim_prefix_insert(p, c, tc, 2);                 /* evicts 3 then 1 */
    assert_int_equal(sim_prefix_match(p, a, 2), 0); /* 1 gone: nothing matches */
    /* 1 is new again; making room for it evicts 2 (the least recently used
     * by then), so 2 is new as well and one run holds both. */
    sim_prefix_insert(p, a, ta, 2);
    const char *want = "S 1 2\n"
                       "S 3 <1\n"
                       "R 3\n"
                       "R 1\n"
                       "S 4 5\n"
                       "R 2\n"
                       "R 4\n"
                       "S 1 2\n";
    assert_int_equal(log.len, strlen(want));
    assert_memory_equal(log.data, want, log.len);
    assert_int_equal(sim_prefix_match(p, c, 2), 0); /* 4 gone, though 5 is there */
    assert_int_equal(sim_prefix_match(p, c + 1, 1), 1);
    sim_prefix_free(p);
    px_buf_cleanup(&log);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_model),
        cmocka_unit_test(test_scenario),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
