/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proxy/admission.h"

static px_adm_item *item(px_adm_item *it, int cls, size_t tenant, size_t bytes, int id)
{
    *it = (px_adm_item){.cls = cls, .tenant = tenant, .bytes = bytes,
                        .owner = (void *)(intptr_t)id};
    return it;
}

static int id_of(px_adm_item *it)
{
    return it ? (int)(intptr_t)it->owner : -1;
}

/* Lower classes first; FIFO inside a tenant. */
static void test_priority_order(void **state)
{
    (void)state;
    uint32_t w[1] = {1};
    px_admq q;
    px_admq_init(&q, w, 1, 100, 0);
    px_adm_item it[6];
    int cls[6] = {5, 1, 5, 0, 1, 15};
    for (int i = 0; i < 6; i++)
        assert_int_equal(px_admq_push(&q, item(&it[i], cls[i], 0, 10, i)), 0);
    int want[6] = {3, 1, 4, 0, 2, 5};
    for (int i = 0; i < 6; i++)
        assert_int_equal(id_of(px_admq_pop(&q, NULL, NULL)), want[i]);
    assert_null(px_admq_pop(&q, NULL, NULL));
    assert_int_equal(q.n, 0);
    assert_int_equal(q.bytes, 0);
    assert_int_equal(px_adm_class_of(-3), 0);
    assert_int_equal(px_adm_class_of(99), PX_ADM_CLASSES - 1);
    px_admq_cleanup(&q);
}

/* One tenant bursts 10x: the quiet one is served every other dispatch, and
 * weights give shares in proportion. */
static void test_fair_between_tenants(void **state)
{
    (void)state;
    uint32_t w[3] = {1, 1, 1};
    px_admq q;
    px_admq_init(&q, w, 3, 1000, 0);
    px_adm_item it[110];
    for (int i = 0; i < 100; i++)
        px_admq_push(&q, item(&it[i], 0, 0, 1, i));        /* loud: 0..99 */
    for (int i = 0; i < 10; i++)
        px_admq_push(&q, item(&it[100 + i], 0, 1, 1, 100 + i)); /* quiet */
    int quiet_at[10], nq = 0;
    for (int k = 0; k < 110; k++) {
        int id = id_of(px_admq_pop(&q, NULL, NULL));
        assert_true(id >= 0);
        if (id >= 100) quiet_at[nq++] = k;
    }
    assert_int_equal(nq, 10);
    /* Alone it would be dispatched at 0..9; with the burst, at 1,3,...,19. */
    for (int i = 0; i < 10; i++)
        assert_true(quiet_at[i] <= 2 * i + 1);
    px_admq_cleanup(&q);

    /* Weights 3:1 → three of tenant 0 for each of tenant 1. */
    uint32_t w2[2] = {3, 1};
    px_admq_init(&q, w2, 2, 1000, 0);
    for (int i = 0; i < 40; i++)
        px_admq_push(&q, item(&it[i], 2, (size_t)(i % 2), 1, i));
    int count0 = 0;
    for (int k = 0; k < 20; k++)
        count0 += id_of(px_admq_pop(&q, NULL, NULL)) % 2 == 0;
    assert_int_equal(count0, 15);
    while (px_admq_pop(&q, NULL, NULL)) {
    }
    px_admq_cleanup(&q);
}

/* Bounds in requests and bytes; removal anywhere. */
static void test_bounds_and_remove(void **state)
{
    (void)state;
    px_admq q;
    px_admq_init(&q, NULL, 2, 3, 100);
    px_adm_item it[5];
    assert_int_equal(px_admq_push(&q, item(&it[0], 0, 0, 60, 0)), 0);
    assert_int_equal(px_admq_push(&q, item(&it[1], 0, 1, 50, 1)), -1); /* bytes */
    assert_int_equal(px_admq_push(&q, item(&it[1], 0, 1, 20, 1)), 0);
    assert_int_equal(px_admq_push(&q, item(&it[2], 3, 0, 20, 2)), 0);
    assert_int_equal(px_admq_push(&q, item(&it[3], 0, 0, 0, 3)), -1); /* count */
    assert_int_equal(q.dropped, 2);
    px_admq_remove(&q, &it[1]);
    assert_false(it[1].queued);
    px_admq_remove(&q, &it[1]); /* no-op */
    assert_int_equal(q.n, 2);
    assert_int_equal(q.bytes, 80);
    px_admq_remove(&q, &it[0]);
    assert_int_equal(id_of(px_admq_pop(&q, NULL, NULL)), 2);
    assert_null(px_admq_pop(&q, NULL, NULL));
    px_admq_cleanup(&q);
}

static int not_odd(void *arg, px_adm_item *it)
{
    (*(int *)arg)++;
    return id_of(it) % 2 == 0;
}

static int never(void *arg, px_adm_item *it)
{
    (void)it;
    (*(int *)arg)++;
    return 0;
}

/* A tenant whose oldest cannot go (its pool is saturated) does not block
 * the others; each flow is asked once per pop. */
static void test_pop_skips_blocked(void **state)
{
    (void)state;
    uint32_t w[3] = {1, 1, 1};
    px_admq q;
    px_admq_init(&q, w, 3, 10, 0);
    px_adm_item it[3];
    px_admq_push(&q, item(&it[0], 0, 0, 1, 1));
    px_admq_push(&q, item(&it[1], 0, 1, 1, 3));
    px_admq_push(&q, item(&it[2], 0, 2, 1, 4));
    int asked = 0;
    assert_int_equal(id_of(px_admq_pop(&q, not_odd, &asked)), 4);
    assert_int_equal(asked, 3);
    asked = 0;
    assert_null(px_admq_pop(&q, not_odd, &asked));
    assert_int_equal(asked, 2);
    assert_int_equal(id_of(px_admq_pop(&q, NULL, NULL)), 1);
    assert_int_equal(id_of(px_admq_pop(&q, NULL, NULL)), 3);
    px_admq_cleanup(&q);

    /* Rounds where nothing may go (the pool saturated, looked at again
     * and again) leave the shares as they were: 3:1 still. */
    uint32_t w2[2] = {3, 1};
    px_admq_init(&q, w2, 2, 100, 0);
    px_adm_item more[16];
    for (int i = 0; i < 16; i++)
        px_admq_push(&q, item(&more[i], 0, (size_t)(i % 2), 1, i));
    int none = 0, count0 = 0;
    for (int k = 0; k < 8; k++) {
        for (int j = 0; j < 3; j++)
            assert_null(px_admq_pop(&q, never, &none));
        count0 += id_of(px_admq_pop(&q, NULL, NULL)) % 2 == 0;
    }
    assert_int_equal(count0, 6);
    while (px_admq_pop(&q, NULL, NULL)) {
    }
    px_admq_cleanup(&q);
}

/* --priority-class: ranges in the order served, names, a value in none
 * to the last class, and the specs refused. */
static void test_priority_classes(void **state)
{
    (void)state;
    char *specs[] = {"interactive:5..9", "batch:-3..4", "solo:-7"};
    px_prio_map m;
    char err[256] = "";
    assert_int_equal(px_prio_map_parse(specs, 3, &m, err, sizeof err), 0);
    assert_int_equal(m.n, 3);
    assert_int_equal(px_prio_map_class(&m, 7), 0);
    assert_int_equal(px_prio_map_class(&m, 5), 0);
    assert_int_equal(px_prio_map_class(&m, 9), 0);
    assert_int_equal(px_prio_map_class(&m, 0), 1);
    assert_int_equal(px_prio_map_class(&m, -3), 1);
    assert_int_equal(px_prio_map_class(&m, -7), 2);
    assert_int_equal(px_prio_map_class(&m, 10), 2); /* in none: the last */
    assert_int_equal(px_prio_map_class(&m, -100), 2);
    assert_int_equal(px_prio_map_named(&m, "batch", 5), 1);
    assert_int_equal(px_prio_map_named(&m, "batc", 4), -1);
    /* No classes: the priority itself, clamped. */
    px_prio_map none = {0};
    assert_int_equal(px_prio_map_class(&none, 3), 3);
    assert_int_equal(px_prio_map_class(&none, -3), 0);
    assert_int_equal(px_prio_map_class(NULL, 99), PX_ADM_CLASSES - 1);
    assert_int_equal(px_prio_map_named(&none, "batch", 5), -1);

    const char *bad[] = {"x", "x:", ":1..2", "x:2..1", "x:a..3", "x:1..", "9x:1", "-x:1",
                         "x y:1", "x:1..2..3", "x:99999999999999999999",
                         "abcdefghijabcdefghijabcdefghijab:1"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char *v[] = {(char *)bad[i]};
        px_prio_map keep = {.n = 7};
        err[0] = 0;
        assert_int_equal(px_prio_map_parse(v, 1, &keep, err, sizeof err), -1);
        assert_int_equal(keep.n, 7);
        assert_non_null(strstr(err, "--priority-class"));
        assert_int_equal(px_prio_spec_check(bad[i], err, sizeof err), -1);
    }
    char *dup[] = {"a:1", "a:2"};
    assert_int_equal(px_prio_map_parse(dup, 2, &m, err, sizeof err), -1);
    assert_non_null(strstr(err, "twice"));
    char *many[17];
    char names[17][8];
    for (int i = 0; i < 17; i++) {
        snprintf(names[i], sizeof names[i], "c%d:%d", i, i);
        many[i] = names[i];
    }
    assert_int_equal(px_prio_map_parse(many, 16, &m, err, sizeof err), 0);
    assert_int_equal(px_prio_map_parse(many, 17, &m, err, sizeof err), -1);
    assert_non_null(strstr(err, "at most 16"));
}

/* Issue 41: classes with shares are served in rounds (3 of class 0, 1 of
 * class 1), so the lower class is never starved; a class whose requests
 * wait for their pool keeps its credit, and one out of credit still serves
 * a pool the others cannot use. */
static int not_id7(void *arg, px_adm_item *it)
{
    (void)arg;
    return id_of(it) != 7;
}

static void test_class_shares(void **state)
{
    (void)state;
    uint32_t w[1] = {1};
    px_admq q;
    px_admq_init(&q, w, 1, 100, 0);
    char *specs[] = {"hi:0:share=3", "lo:1:share=1"};
    px_prio_map m;
    char err[256];
    assert_int_equal(px_prio_map_parse(specs, 2, &m, err, sizeof err), 0);
    px_admq_set_shares(&q, &m);
    px_adm_item it[12];
    for (int i = 0; i < 8; i++)
        assert_int_equal(px_admq_push(&q, item(&it[i], 0, 0, 1, i)), 0);
    for (int i = 8; i < 11; i++)
        assert_int_equal(px_admq_push(&q, item(&it[i], 1, 0, 1, i)), 0);
    int want[11] = {0, 1, 2, 8, 3, 4, 5, 9, 6, 7, 10};
    for (int i = 0; i < 11; i++)
        assert_int_equal(id_of(px_admq_pop(&q, NULL, NULL)), want[i]);
    /* hi's next (id 7) waits for its pool: lo, out of credit, still goes. */
    px_admq_set_shares(&q, &m);
    assert_int_equal(px_admq_push(&q, item(&it[0], 0, 0, 1, 7)), 0);
    assert_int_equal(px_admq_push(&q, item(&it[1], 1, 0, 1, 1)), 0);
    assert_int_equal(px_admq_push(&q, item(&it[2], 1, 0, 1, 2)), 0);
    assert_int_equal(id_of(px_admq_pop(&q, not_id7, NULL)), 1);
    assert_int_equal(id_of(px_admq_pop(&q, not_id7, NULL)), 2);
    assert_null(px_admq_pop(&q, not_id7, NULL));
    assert_int_equal(id_of(px_admq_pop(&q, NULL, NULL)), 7);
    px_admq_cleanup(&q);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_priority_order),
        cmocka_unit_test(test_fair_between_tenants),
        cmocka_unit_test(test_bounds_and_remove),
        cmocka_unit_test(test_pop_skips_blocked),
        cmocka_unit_test(test_priority_classes),
        cmocka_unit_test(test_class_shares),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
