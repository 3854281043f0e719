/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h> /* after what it uses */

#include "proxy/pindex.h"

#define B PX_PINDEX_BLOCK_BYTES

/* A hash stands for a whole prefix: equal prefixes, equal hashes; a block
 * that differs changes its hash and every later one; a partial block is
 * not hashed. */
static void test_chained_hashes(void **state) {
    char a[4 * B + 10], b[4 * B + 10];
    memset(a, 'a', sizeof a);
    memcpy(b, a, sizeof b);
    b[2 * B + 1] = 'b';
    uint64_t ha[8], hb[8];
    assert_int_equal(px_pindex_hashes(a, sizeof a, ha, 8), 4);
    assert_int_equal(px_pindex_hashes(b, sizeof b, hb, 8), 4);
    assert_true(ha[0] == hb[0] && ha[1] == hb[1]);
    assert_true(ha[2] != hb[2] && ha[3] != hb[3]);
    /* Same bytes in every block: the chain still tells the blocks apart. */
    assert_true(ha[0] != ha[1]);
    assert_int_equal(px_pindex_hashes(a, B - 1, ha, 8), 0);
    assert_int_equal(px_pindex_hashes(a, sizeof a, ha, 2), 2); /* at most max */
}

/* Matches count from the first hash, for the backend they were added
 * for only. */
static void test_match_per_backend(void **state) {
    px_pindex *x = px_pindex_create(64);
    uint64_t h[4] = {11, 12, 13, 14};
    assert_int_equal(px_pindex_match(x, 1, h, 4), 0);
    px_pindex_add(x, 1, h, 3);
    assert_int_equal(px_pindex_match(x, 1, h, 4), 3);
    assert_int_equal(px_pindex_match(x, 2, h, 4), 0);
    uint64_t g[2] = {99, 12}; /* the second alone is listed: no prefix */
    assert_int_equal(px_pindex_match(x, 1, g, 2), 0);
    px_pindex_add(x, 1, h, 3); /* again: no duplicates, still 3 */
    assert_int_equal(px_pindex_match(x, 1, h, 4), 3);
    px_pindex_destroy(x);
    px_pindex_destroy(NULL);
}

/* Past its capacity the least recently used entry goes; a match makes its
 * entries the most recent. */
static void test_lru_eviction(void **state) {
    px_pindex *x = px_pindex_create(3);
    uint64_t h1[1] = {1}, h2[1] = {2}, h3[1] = {3}, h4[1] = {4};
    px_pindex_add(x, 7, h1, 1);
    px_pindex_add(x, 7, h2, 1);
    px_pindex_add(x, 7, h3, 1);
    assert_int_equal(px_pindex_match(x, 7, h1, 1), 1); /* 1 is now the most recent */
    px_pindex_add(x, 7, h4, 1);                        /* evicts 2 */
    assert_int_equal(px_pindex_match(x, 7, h2, 1), 0);
    assert_int_equal(px_pindex_match(x, 7, h1, 1), 1);
    assert_int_equal(px_pindex_match(x, 7, h3, 1), 1);
    assert_int_equal(px_pindex_match(x, 7, h4, 1), 1);
    px_pindex_destroy(x);
    /* Capacity 0 is taken as 1: the index always holds the latest. */
    x = px_pindex_create(0);
    px_pindex_add(x, 7, h1, 1);
    px_pindex_add(x, 7, h2, 1);
    assert_int_equal(px_pindex_match(x, 7, h1, 1), 0);
    assert_int_equal(px_pindex_match(x, 7, h2, 1), 1);
    px_pindex_destroy(x);
}

/* Many evictions through one bucket chain leave the index consistent. */
static void test_churn(void **state) {
    px_pindex *x = px_pindex_create(16);
    for (uint64_t i = 0; i < 10000; i++) {
        uint64_t h[1] = {i};
        px_pindex_add(x, i % 3, h, 1);
    }
    for (uint64_t i = 10000 - 16; i < 10000; i++) {
        uint64_t h[1] = {i};
        assert_int_equal(px_pindex_match(x, i % 3, h, 1), 1);
    }
    uint64_t old[1] = {0};
    assert_int_equal(px_pindex_match(x, 0, old, 1), 0);
    px_pindex_destroy(x);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chained_hashes),
        cmocka_unit_test(test_match_per_backend),
        cmocka_unit_test(test_lru_eviction),
        cmocka_unit_test(test_churn),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
